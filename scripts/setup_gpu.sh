#!/usr/bin/env bash
# Install memagent's GPU stack in one resolution, from the lock: `bash scripts/setup_gpu.sh [--dry-run] [VENV_DIR]` (default .venv).
# Needs (checked first, before any download): Linux x86_64, Python 3.11, glibc >= 2.34 (sglang's wheels are manylinux_2_34; on an
# older glibc pip would silently pick an older sglang with another torch), an NVIDIA driver of the CUDA 13 line (torch 2.14.1, the one
# sglang 0.5.23 pins, is a CUDA 13 build), and, to compile Transformer Engine's torch extension, nvcc of CUDA 13 and cuDNN's headers.
# Steps, in order (each pip install takes its versions from requirements/gpu-linux-x86_64-py311.txt, made by scripts/lock_gpu.sh):
#   1. torch at the version sglang pins, with the CPU side: scripts/setup.sh (the one way to make the venv), TORCH_SPEC=$TORCH_PIN
#   2. the gpu extra (sglang, megatron-core, settings.ini gpu_requirements) and the rest of the lock, every file hash-checked
#   3. Transformer Engine: its wheels from the lock, then transformer-engine-torch built from its sdist (pinned below by version and
#      sha256) against the installed torch with --no-build-isolation (an isolated build would fetch another torch and fails)
#   4. pip check, and memagent-doctor's rows for the frozen preset's software (python ... Transformer Engine, sglang)
# The early checks are memagent-doctor's rows (nbs/13d_doctor.ipynb), run from the source tree before anything heavy is installed.
# --dry-run prints the commands in order and runs the early checks as warnings; it installs nothing. The index is your own pip
# configuration. PIP_CONSTRAINT is set for step 1 (it replaces a constraint your pip configuration may name).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN=torch==2.14.1          # sglang==0.5.23 (settings.ini gpu_requirements) pins torch==2.14.1: a CUDA 13 build
TE_VERSION=2.11.0                # inside megatron-core 0.16.1's declared range for transformer-engine: >=2.9.0a0,<2.12.0
TE_TORCH_SDIST_SHA256=b58d6322bdf885dfab0646da572aff9cf090b332ad470559aa58883c231e1816   # transformer_engine_torch-2.11.0.tar.gz
TE_TORCH_DEPS=einops,onnxscript,onnx,packaging,pydantic   # transformer-engine-torch's install_requires (its build_tools/pytorch.py)
LOCK=requirements/gpu-linux-x86_64-py311.txt
dry=0; [ "${1:-}" = --dry-run ] && { dry=1; shift; }
venv=${1:-.venv}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
pip="$venv/bin/python -m pip"
say() { echo "== $*"; }
run() { echo "+ $*"; [ "$dry" = 1 ] || eval "$@"; }
problems=0
problem() { problems=$((problems + 1)); if [ "$dry" = 1 ]; then echo "WARN (dry run) $*"; else echo "FAIL $*"; fi; }

say "0/4 early checks (before any install): Python 3.11, then memagent-doctor's rows python, glibc, CUDA driver, nvcc, cuDNN headers"
[ -f "$LOCK" ] || { echo "setup_gpu.sh: no lock $LOCK (make it with: bash scripts/lock_gpu.sh)"; exit 1; }
"$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || problem "python: found $("$py" -V 2>&1); needed Python 3.11 (the lock is made for CPython 3.11, its wheels are cp311); fix: install Python 3.11 and pass PYTHON=python3.11"
# The doctor's own rows, from the source tree, in a bootstrap environment that has only what memagent.doctor imports
# (pyyaml, packaging; a few hundred kB): a throwaway one outside the tree, so that nothing is written before the checks pass.
boot=$(mktemp -d)
"$py" -m venv "$boot" && "$boot/bin/python" -m pip install -q pyyaml packaging || { echo "setup_gpu.sh: could not make the bootstrap environment $boot"; exit 1; }
doctor_rows='python,glibc,CUDA driver,nvcc,cuDNN headers'
if ! PYTHONPATH=. "$boot/bin/python" -c "import sys; from memagent.doctor import doctor_cli; sys.exit(doctor_cli(sys.argv[1:]))" \
     --preset qwen3-4b-frozen --world-size 8 --fast --rows "$doctor_rows"; then
  problem "memagent-doctor: a row above fails (found, needed and the fix are printed under it)"
fi
rm -rf "$boot"
if [ "$problems" -gt 0 ] && [ "$dry" = 0 ]; then echo "setup_gpu.sh: $problems early check(s) failed; stopping before any install"; exit 1; fi

pins=$(mktemp); trap 'rm -f "$pins"' EXIT
sed -n 's/^\([A-Za-z0-9][^ ]*==[^ ]*\).*/\1/p' "$LOCK" >"$pins"      # the lock's exact versions, without hashes: step 1's constraints
say "1/4 torch at the version sglang pins ($TORCH_PIN), with the CPU side, in $venv (scripts/setup.sh, constrained by $LOCK)"
run "PIP_CONSTRAINT=$pins TORCH_SPEC=$TORCH_PIN bash scripts/setup.sh '$venv'"
say "2/4 the gpu extra (sglang, megatron-core) and the rest of the lock, every file hash-checked (transformer-engine* apart)"
not_te="awk '/^[A-Za-z0-9]/{te = (\$1 ~ /^transformer-engine/)} !te' $LOCK"
run "$pip install -q --require-hashes -r <($not_te)"
run "$pip install -q --no-deps -e '.[gpu]'"
say "3/4 Transformer Engine $TE_VERSION: its wheels (hash-checked, from the lock), then transformer-engine-torch built from its sdist"
only_te="awk '/^[A-Za-z0-9]/{te = (\$1 ~ /^transformer-engine/)} te' $LOCK"
te_torch="echo 'transformer-engine-torch==$TE_VERSION --hash=sha256:$TE_TORCH_SDIST_SHA256'"
run "NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE $pip install --no-build-isolation --require-hashes --no-binary transformer-engine-torch -r <($only_te; $te_torch)"
say "4/4 checks: pip check; memagent-doctor's software rows for the frozen preset (its GPU rows need the cluster: run memagent-doctor there)"
run "$pip check"
run "$venv/bin/memagent-doctor --preset qwen3-4b-frozen --world-size 8 --fast --rows 'python,glibc,torch build,CUDA driver,megatron-core,Transformer Engine,sglang'"
[ "$dry" = 1 ] && { echo "dry run: $problems early check(s) would stop the install; nothing was installed"; exit 0; }
echo "the GPU stack is installed in $venv: run 'source $venv/bin/activate', then memagent-doctor --preset qwen3-4b-frozen --world-size 8"
