#!/usr/bin/env bash
# Gather the wheels `make gpu-check` installs on a bare GPU machine: tools/gpu_wheels.py, run with the
# venv `make setup` built (its metadata is the lock's). Arguments go to it (--dest, --image, --limit-mib).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || { echo "gpu_wheels.sh: $py is missing: run make setup first (its metadata is the lock's)" >&2; exit 2; }
exec "$py" "$repo/tools/gpu_wheels.py" "$@"
