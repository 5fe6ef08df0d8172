#!/usr/bin/env bash
# The checks only a GPU machine can make, as one prepared run. Install first: TORCH_SPEC=torch bash scripts/setup.sh
# && .venv/bin/pip install -e ".[gpu]" (SGLang, megatron-core; Transformer Engine if you want its attention).
#
#   bash scripts/gpu_check.sh [--dry-run] [--part subset|cluster|all] [--out DIR] [--models DIR]
#
# subset   one GPU, no network (a random tiny Qwen3): megatron-core in bf16 with fp32 main grads, its own optimizer
#          (distributed over DP), selective and full recompute, Transformer Engine attention when installed; the step
#          against the fp32 torch step on the same rows; the distributed-optimizer checkpoint round trip; peak GPU
#          memory against memagent.plan.
# cluster  every GPU of this node, the colocated layout of the preset that matches the largest model found locally
#          (Qwen3-4B: qwen3-4b-frozen; Qwen3-0.6B: the pilot; none: the tiny model in the frozen layout): the 2-step
#          smoke (rows generated = transferred = consumed), SGLang vs HF engine tokens/s and megatron vs torch step
#          time on the same rows, peak GPU memory per rank against the plan.
# all      subset, then cluster (default: all with 2 GPUs or more, subset with one).
# --dry-run  prints every command it would run and the plans, and runs nothing on a GPU (CI runs this on CPU).
#
# Results land in reports/smoke/gpu-<UTC date>/ (or --out).
# On a borrowed machine without network, the subset needs only torch, transformers, safetensors, pyyaml and
# megatron-core==0.16.1 besides memagent itself (pip install --no-deps -e .): carry the missing ones as wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0; part=''; out=''; models=${MEMAGENT_MODELS:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --part) part=$2; shift ;;
    --out) out=$2; shift ;;
    --models) models=$2; shift ;;
    -h|--help) sed -n 2,19p "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
py=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
ngpu=$($py -c 'import torch; print(torch.cuda.device_count())')
if [ "$dry" = 0 ] && [ "$ngpu" = 0 ]; then
  echo "gpu_check.sh: no CUDA device here; use --dry-run to see the commands and the plans" >&2; exit 2
fi
[ -n "$part" ] || { if [ "$dry" = 1 ] || [ "$ngpu" -ge 2 ]; then part=all; else part=subset; fi; }
case "$part" in subset|cluster|all) ;; *) echo "gpu_check.sh: --part must be subset, cluster or all, got '$part'" >&2; exit 2 ;; esac
out=${out:-reports/smoke/gpu-$(date -u +%Y%m%d)}
nodes=$([ "$dry" = 1 ] && echo 8 || echo "$ngpu")     # a dry run shows the plan of an 8-GPU node
params=$($py scripts/gpu_check.py preset --models "${models:-none}" --gpus "$([ "$dry" = 1 ] && echo 8 || echo "$ngpu")")
preset=$(echo "$params" | sed -n 's/^preset: //p')

run() {   # print a command; run it unless --dry-run
  echo "+ $*"
  [ "$dry" = 1 ] || "$@"
}

echo "gpu_check: part=$part out=$out gpus=$ngpu cluster-preset=$preset dry_run=$dry"
run mkdir -p "$out"
if [ "$part" = subset ] || [ "$part" = all ]; then
  echo "== subset: one GPU, tiny Qwen3, megatron-core bf16 + distributed optimizer + recompute"
  $py scripts/gpu_check.py plan --preset tiny-megatron --gpus-per-node 1
  run $py scripts/gpu_check.py subset --out "$out/subset"
fi
if [ "$part" = cluster ] || [ "$part" = all ]; then
  echo "== cluster: the colocated layout of $preset on $nodes GPUs"
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
