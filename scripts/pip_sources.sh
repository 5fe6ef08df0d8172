#!/usr/bin/env bash
# The package sources pip would use, as uv's flags, one per line: `bash scripts/pip_sources.sh [PYTHON]`.
# uv reads no pip configuration, so these pass pip's on: the index, extra indexes, wheel directories and constraints
# that the PIP_* variables name, else pip.conf (the keys pip itself reads, through PYTHON's pip), and pip's choice of
# the best version across all of them. setup.sh installs with them; the offline-subset test builds its base venv with them.
set -euo pipefail
py=${1:-python3}
src() { printenv "PIP_$(echo "$1" | tr a-z- A-Z_)" || "$py" -m pip config get "global.$1" 2>/dev/null || true; }
printf '%s\n' --index-strategy unsafe-best-match
idx=$(src index-url); [ -z "$idx" ] || printf '%s\n' --index-url "$idx"
for u in $(src extra-index-url); do printf '%s\n' --extra-index-url "$u"; done
for d in $(src find-links); do printf '%s\n' --find-links "$d"; done
for c in $(src constraint); do printf '%s\n' --constraint "$c"; done
