#!/usr/bin/env bash
# The checks only a GPU machine can make, as one prepared run. Install first: bash scripts/setup_gpu.sh (torch at SGLang's
# pin, SGLang, megatron-core and Transformer Engine, from the lock); the one-GPU subset also runs offline (below).
#
#   bash scripts/gpu_check.sh [--dry-run] [--part subset|cluster|all|NAME] [--out DIR] [--models DIR] [--reduced] [--cpu-simulation]
#
# subset   one GPU, no network, its parts each in their own process under their own cap (memagent.gpucheck): megatron-core
#          in bf16 with fp32 main grads and its own (distributed) optimizer per recompute mode against the fp32 torch step, the
#          optimizer-state round trip and a checkpoint before step 1; the weight check after a sync; the in-process Trainer for
#          2 steps with the torch and the megatron backend (health, KL, seconds per phase, peak GPU memory); the in-process
#          engine against generate() on a GPU-sized workload; the megatron step at Qwen3-4B shapes (random weights) with the
#          local spec's attention and SDPA (full recompute), SDPA with selective recompute and TE where installed, side by side
#          against the bf16 matmul rate and memagent.plan, each with a profiled split of the step; a bf16-vs-fp32 step that can
#          fail. Writes subset.md, subset.json and parts/*.json under --out as each part ends, with the environment (driver,
#          CUDA, torch, TE, sglang). Meant to take under 7 minutes on one H200 (the report records each part's seconds). Sequence parallel
#          needs TP >= 2: not checked on one GPU (the report says so).
# cluster  every GPU of this node, the colocated layout of the preset that matches the largest model found locally
#          (Qwen3-4B: qwen3-4b-frozen; Qwen3-0.6B: the pilot; none: the tiny model in the frozen layout): the 2-step
#          smoke (rows generated = transferred = consumed), SGLang vs HF engine tokens/s and megatron vs torch step
#          time on the same rows, peak GPU memory per rank against the plan.
# all      subset, then cluster (default: all with 2 GPUs or more, subset with one).
# NAME     one part of the subset alone (memagent.gpucheck.parts.PARTS: megatron, ..., step4b-sdpa-full, optimizer, train-notebook).
#
# The layout is never changed silently: each part checks its preset's layout as configured, or refuses (exit 2) naming
# the memagent-doctor rows that fail (Transformer Engine, GPU count, GPU memory, ...) with their fixes.
# --reduced         where Transformer Engine is missing, run the named reduced layout 'no-te' instead (SDPA attention,
#                   no sequence parallel); every report then starts with 'layout: reduced' and the parts not checked.
# --cpu-simulation  the subset's own parts on CPU at tiny shapes (the CPU stand-in optimizer), and the Qwen3-4B plan a GPU run
#                   would run: the named reduced layout 'cpu-simulation', written as such in the report's first lines; a
#                   code-path check, not a GPU check.
# --dry-run         prints every command it would run, the layouts (a refusal is printed, and the dry run still exits 0)
#                   and the plans, and runs nothing on a GPU (CI runs this on CPU).
# PYTHON            the interpreter (default: .venv/bin/python, else python, else python3). memagent runs from this
#                   checkout through PYTHONPATH: no install of memagent itself is needed.
#
# Results land in reports/smoke/gpu-<UTC date>/ (or --out); the subset writes nothing outside --out (its built tiny
# model goes to --out/cache unless MEMAGENT_CACHE is set; no bytecode is written).
# On a borrowed GPU machine without network that has torch, transformers, safetensors and pyyaml: fetch the rest here
# with `bash scripts/gpu_wheels.sh .cache/gpu-wheels` (under 64 MiB; it travels with the working tree), then there:
#   python3 -m pip install --no-index --no-deps --target /tmp/gpu-site --find-links .cache/gpu-wheels -r .cache/gpu-wheels/requirements.txt && PYTHONPATH=/tmp/gpu-site HF_HUB_OFFLINE=1 bash scripts/gpu_check.sh --part subset --out /tmp/gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0; part=''; out=''; models=${MEMAGENT_MODELS:-}; reduced=0; cpusim=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --part) part=$2; shift ;;
    --out) out=$2; shift ;;
    --models) models=$2; shift ;;
    --reduced) reduced=1 ;;
    --cpu-simulation) cpusim=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; elif command -v python >/dev/null 2>&1; then py=python; else py=python3; fi
fi
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
subset_parts=''
case "$part" in
  ''|subset|cluster|all) ;;
  *) if $py -c 'import sys; from memagent.gpucheck.parts import PARTS; sys.exit(sys.argv[1] not in [n for n, _, _ in PARTS])' "$part"; then
       subset_parts=$part; part=subset           # one part of the subset, alone
     else echo "gpu_check.sh: --part must be subset, cluster, all or a part of the subset, got '$part'" >&2; exit 2; fi ;;
esac
if [ "$cpusim" = 1 ]; then
  [ -z "$part" ] || [ "$part" = subset ] || { echo "gpu_check.sh: --cpu-simulation runs only the subset, got --part $part" >&2; exit 2; }
  part=subset; export CUDA_VISIBLE_DEVICES=''      # the CPU code path even where a GPU is present
fi
ngpu=$($py -c 'import torch; print(torch.cuda.device_count())')
[ -n "$part" ] || { if [ "$dry" = 1 ] || [ "$ngpu" -ge 2 ]; then part=all; else part=subset; fi; }
case "$part" in subset|cluster|all) ;; *) echo "gpu_check.sh: --part must be subset, cluster or all, got '$part'" >&2; exit 2 ;; esac
out=${out:-reports/smoke/gpu-$(date -u +%Y%m%d)}
abs_out=$(realpath -m "$out")
for src in nbs memagent scripts tests; do     # the cluster part writes smoke.ipynb beside its own input, nbs/smoke.ipynb
  case "$abs_out/" in "$PWD/$src/"*) echo "gpu_check.sh: --out $out is inside the source folder $src/, whose files it would replace; give a folder under reports/ or elsewhere" >&2; exit 2 ;; esac
done
nodes=$([ "$dry" = 1 ] && echo 8 || echo "$ngpu")     # a dry run shows the plan of an 8-GPU node
flags=$([ "$reduced" = 1 ] && echo --reduced || true)

run() {   # print a command; run it unless --dry-run
  echo "+ $*"
  [ "$dry" = 1 ] || "$@"
}
check() {  # check PART: its layout and the parts not checked; a refusal stops a real run (exit 2), a dry run prints it and goes on
  local rc=0
  $py scripts/gpu_check.py layout --part "$1" --gpus "$([ "$1" = subset ] && echo 1 || echo "$nodes")" --models "${models:-none}" \
      $flags $([ "$cpusim" = 1 ] && echo --cpu-simulation || true) || rc=$?
  [ "$rc" = 0 ] && return 0
  [ "$rc" = 3 ] || exit "$rc"
  if [ "$dry" = 1 ]; then echo "gpu_check: part $1 refused (above); a real run stops here, this dry run goes on"; return 0; fi
  [ "$ngpu" != 0 ] || echo "gpu_check.sh: no CUDA device here; use --dry-run to see the commands and the plans, --cpu-simulation for the subset's code path on CPU" >&2
  echo "gpu_check.sh: part $1 refused: its layout cannot run here (see the failing rows above); --reduced runs a named reduced layout where one exists" >&2
  exit 2
}

echo "gpu_check: part=$part out=$out gpus=$ngpu dry_run=$dry reduced=$reduced cpu_simulation=$cpusim"
# every check of every part before the first write: the cluster part's model folder, preset and layout are refused here,
# not after the subset has run and written for minutes
if [ "$part" = cluster ] || [ "$part" = all ]; then
  params=$($py scripts/gpu_check.py preset --models "${models:-none}" --gpus "$nodes" $flags)
  preset=$(echo "$params" | sed -n 's/^preset: //p')
  check cluster
fi
if [ "$part" = subset ] || [ "$part" = all ]; then check subset; fi
if [ "$part" = subset ] || [ "$part" = all ]; then
  echo "== subset: one GPU, tiny Qwen3, megatron-core bf16 + distributed optimizer + recompute"
  run mkdir -p "$out"
  [ "$dry" = 1 ] || export MEMAGENT_CACHE="${MEMAGENT_CACHE:-$out/cache}"   # the built tiny model: under --out
  $py scripts/gpu_check.py plan --preset tiny-megatron --gpus-per-node 1
  run $py scripts/gpu_check.py subset --out "$out/subset" \
      $([ "$cpusim" = 1 ] && echo --cpu-simulation || true) $([ -n "$subset_parts" ] && echo --parts "$subset_parts" || true)
fi
if [ "$part" = cluster ] || [ "$part" = all ]; then
  echo "== cluster: the colocated layout of $preset on $nodes GPUs"
  run mkdir -p "$out"
  echo "smoke parameters (written to $out/smoke_params.yaml):"; echo "$params" | sed 's/^/  /'
  [ "$dry" = 1 ] || echo "$params" > "$out/smoke_params.yaml"
  ov=$($py -c 'import sys, yaml, json; print(json.dumps(yaml.safe_load(sys.stdin.read())["overrides"]))' <<<"$params")
  $py scripts/gpu_check.py plan --preset "$preset" --gpus-per-node "$nodes" --overrides "$ov"
  run $py -m papermill nbs/smoke.ipynb "$out/smoke.ipynb" -f "$out/smoke_params.yaml" -p engine sglang \
      -p run "$(basename "$out")" -p report_dir "$(dirname "$out")"
  run $py scripts/gpu_check.py compare --params "$out/smoke_params.yaml" --gpus "$nodes" --out "$out/compare" \
      --smoke-run "runs/smoke/$(basename "$out")"
fi
echo "gpu_check: done (dry_run=$dry)"
