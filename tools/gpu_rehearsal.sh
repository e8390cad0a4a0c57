#!/usr/bin/env bash
# `make gpu-rehearsal`: the GPU kit rehearsed on the CPU, the way the GPU machine runs it, so that the
# one GPU call a session gets works the first time.
#
#   1. An "image" venv, built once (.cache/gpu-rehearsal/image, ~5 GB, ~1 min): Python 3.12, PyPI's
#      torch 2.11.0 (the CUDA build; it runs on the CPU), transformers 5.17.0, and the image's
#      packages that raypack's path needs (tools/gpu_wheels.py --image-requirements: the image list's
#      versions, the lock's where the list gives none). Nothing else: what the kit needs beyond it
#      must come from the wheels.
#   2. The wheels, gathered as shipped (tools/gpu_wheels.sh) into the travelling copy's .whl.
#   3. The repository as the device tool carries it (tracked and untracked, not ignored, files, and
#      .whl) copied into .cache/gpu-rehearsal/travel; the image venv hard-linked into a fresh
#      .cache/gpu-rehearsal/run, which the kit may install into.
#   4. In a network namespace with loopback only (no network, as on the GPU machine), gpu-check's own
#      command with that interpreter, every step in its --smoke mode: tools/bench_gpu.py --smoke (its
#      steps include --peers' three). Any step that fails fails the rehearsal.
#
# Arguments go to tools/bench_gpu.py instead of --smoke (e.g. `--smoke --only peers`). Needs root
# (unshare) and python3.12 (PYTHON312=...). The log: .cache/gpu-rehearsal/rehearsal.log.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${REHEARSAL_DIR:-$repo/.cache/gpu-rehearsal}
venv_py=${PYTHON:-$repo/.venv/bin/python}
py312=${PYTHON312:-}
if [ -z "$py312" ]; then  # a pyenv shim answers to python3.12 without one being selected: try each
  for c in "$(command -v python3.12 2>/dev/null)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312=$c; break; fi
  done
fi
[ -n "$py312" ] || { echo "gpu-rehearsal: needs Python 3.12 (the GPU image's); set PYTHON312=/path/to/python3.12" >&2; exit 2; }
[ -x "$venv_py" ] || { echo "gpu-rehearsal: run make setup first ($venv_py is missing)" >&2; exit 2; }
mkdir -p "$work"
exec > >(tee "$work/rehearsal.log") 2>&1
say() { echo "[gpu-rehearsal] $*"; }

image=$work/image
if [ ! -f "$image/.ready" ]; then
  say "building the image venv in $image (Python 3.12, torch 2.11.0, transformers 5.17.0, the image's packages)"
  rm -rf "$image"
  "$py312" -m venv "$image"
  "$venv_py" "$repo/tools/gpu_wheels.py" --image-requirements > "$work/image-requirements.txt"
  # The image's transformers and torch, whatever the lock says; pip's global constraints file (if
  # any) caps torch for this machine's disk only, so it is left out here.
  PIP_CONSTRAINT= "$image/bin/pip" install -q --disable-pip-version-check \
    -r "$work/image-requirements.txt" torch==2.11.0 transformers==5.17.0
  # pip pulled in what those need; whatever the image list doesn't name goes again, so that the kit
  # can't lean on a package the GPU machine lacks.
  extra=$(cd / && "$image/bin/python" - "$repo/tools/gpu_image_packages.txt" <<'PY'
import importlib.metadata, sys
from packaging.utils import canonicalize_name as canon
listed = {canon(line.split("==")[0].strip()) for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")}
print(" ".join(sorted({canon(d.metadata["Name"]) for d in importlib.metadata.distributions()} - listed - {"pip"})))
PY
)
  [ -z "$extra" ] || { say "removing what the image list lacks: $extra"; "$image/bin/pip" uninstall -q -y $extra; }
  touch "$image/.ready"
fi

travel=$work/travel
say "gathering the wheels as shipped: tools/gpu_wheels.sh"
rm -rf "$travel" && mkdir -p "$travel"
(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$travel")
PYTHON=$venv_py "$repo/tools/gpu_wheels.sh" --dest "$travel/.whl"
du -sh "$travel" | sed 's/^/[gpu-rehearsal] travelling: /'

run=$work/run
rm -rf "$run" && cp -al "$image" "$run"
tmp=$(mktemp -d /tmp/rpr-XXXX)  # short: Ray's unix sockets live under it (107-byte paths)
# A venv's scripts name their interpreter by path; the copy's python is what the kit runs.
py=$run/bin/python
say "running the kit offline (loopback only) with $py"
args=${*:---smoke --budget 3600}
say "tools/bench_gpu.py $args"
status=0
unshare --net -- sh -c "ip link set lo up && cd '$travel' && env -u VIRTUAL_ENV PATH='$run/bin:$PATH' \
    HOME='$work/home' TMPDIR='$tmp' RAYPACK_BENCH_OUT='$work/results' '$py' tools/bench_gpu.py $args" || status=$?
say "tools/bench_gpu.py $args: exit status $status"
rm -rf "$tmp"
say "$([ "$status" -eq 0 ] && echo passed || echo FAILED) (log: $work/rehearsal.log)"
exit "$status"
