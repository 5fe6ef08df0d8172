#!/usr/bin/env bash
# Make the lock of the GPU stack, requirements/gpu-linux-x86_64-py311.txt, from a CPU machine: `bash scripts/lock_gpu.sh`.
# Its input is what scripts/setup_gpu.sh installs, read from the two files that name it:
#   settings.ini    requirements, dev_requirements, gpu_requirements (sglang, megatron-core)
#   setup_gpu.sh    TORCH_PIN (the torch sglang pins), TE_VERSION (Transformer Engine's wheels: the meta package and its CUDA 13 core),
#                   TE_TORCH_DEPS (what transformer-engine-torch's setup.py requires besides torch and the core)
# transformer-engine-torch is not in the lock: it is an sdist whose metadata needs a build against torch, so setup_gpu.sh pins it by
# version and sdist hash. uv resolves for the GPU machine's platform (Linux x86_64, glibc 2.34, CPython 3.11) and reads each wheel's
# metadata without downloading the wheel where the index serves it (PEP 658); the index is the user's own uv configuration, and no
# index URL is written into the lock. Needs uv (`pip install uv`); CI never runs this (tests/test_gpu_lock.py checks the lock agrees).
set -euo pipefail
cd "$(dirname "$0")/.."
lock=requirements/gpu-linux-x86_64-py311.txt
uv=${UV:-uv}
ini() { python3 -c "import configparser,sys; c=configparser.ConfigParser(delimiters=['=']); c.read('settings.ini'); print(c['DEFAULT'][sys.argv[1]])" "$1"; }
pin() { sed -n "s/^$1=\([^ ]*\).*/\1/p" scripts/setup_gpu.sh; }
# on any failure (uv, the index, a read of the inputs) the temporaries go and the lock is left as it was
cleanup() { rc=$?; rm -rf "$tmp" "$lock.tmp"; [ "$rc" -eq 0 ] || echo "lock_gpu.sh: failed (exit $rc): $lock is unchanged" >&2; }
tmp=$(mktemp -d); trap cleanup EXIT; trap 'exit 130' INT; trap 'exit 143' TERM
in=$tmp/gpu-stack.in                       # the input's name is what the lock's "via -r" annotations show
{ for k in requirements dev_requirements gpu_requirements; do ini "$k" | tr ' ' '\n'; done
  pin TORCH_PIN; echo "transformer-engine[core_cu13]==$(pin TE_VERSION)"; pin TE_TORCH_DEPS | tr ',' '\n'; } \
  | grep -v '^$' | awk '!seen[$0]++' >"$in"
cmd=("$uv" pip compile gpu-stack.in --python-platform x86_64-manylinux_2_34 --python-version 3.11 --generate-hashes
     --no-emit-index-url --no-header --quiet)
{ echo "# The GPU stack of memagent for Linux x86_64 (glibc >= 2.34), CPython 3.11: exact versions and hashes."
  echo "# Made by: bash scripts/lock_gpu.sh, which runs"
  echo "#   uv pip compile INPUT --python-platform x86_64-manylinux_2_34 --python-version 3.11 --generate-hashes --no-emit-index-url"
  echo "# where INPUT is settings.ini's requirements, dev_requirements and gpu_requirements, and setup_gpu.sh's TORCH_PIN,"
  echo "# transformer-engine[core_cu13]==TE_VERSION and TE_TORCH_DEPS:"
  sed 's/^/#   /' "$in"
  echo "# scripts/setup_gpu.sh installs from it: its versions constrain scripts/setup.sh (torch first), then every file is installed"
  echo "# hash-checked (--require-hashes). transformer-engine-torch, an sdist built against this torch, is not here: setup_gpu.sh pins"
  echo "# it by version and sha256. The index is the user's own pip/uv configuration; none is named here."
  (cd "$tmp" && "${cmd[@]}"); } >"$lock.tmp"
mv "$lock.tmp" "$lock"
echo "wrote $lock ($(grep -c '^[a-z0-9]' "$lock") packages)"
