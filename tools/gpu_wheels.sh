#!/usr/bin/env bash
# Gather the wheels that `make bench-gpu` installs on the GPU machine (torch with CUDA and an older
# transformers, but no Ray, no DeepSpeed and no network), small enough to travel with the checkout.
#
#   tools/gpu_wheels.sh [DEST]        (default .whl, git-ignored; PYTHON=... picks the interpreter
#                                      whose transformers version to match, default .venv/bin/python)
#
# 1. ../shared/gpu/wheelhouse.sh builds Ray (without its jars), DeepSpeed and the small
#    pure-Python packages the image lacks (hjson, pydantic, jsonschema, tensorboardX, ...).
# 2. This script trims Ray further: rllib, serve, llm and the dashboard's web client are never
#    imported by raypack (Ray Train, Tune, Data and the core are kept).
# 3. It adds the transformers wheel of the version raypack is developed against (the image's is
#    older), drops huggingface_hub (the image's satisfies it), and adds peft and accelerate.
# 4. It fails if the wheels would exceed LIMIT_MIB (default 60): the device tool carries 64 MiB
#    in all, the repository included.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$repo/.whl}
limit_mib=${LIMIT_MIB:-60}
py=${PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
wheelhouse=${WHEELHOUSE:-$repo/../shared/gpu/wheelhouse.sh}

if [ ! -f "$wheelhouse" ]; then
  echo "gpu_wheels.sh: $wheelhouse not found. It builds the Ray, DeepSpeed and helper wheels; set WHEELHOUSE=<path>" >&2
  echo "or put the wheels into $dest yourself (ray without jars, deepspeed, hjson, pydantic(+core), jsonschema, tensorboardX)." >&2
  exit 1
fi
mkdir -p "$dest"
# wheelhouse.sh runs `python3`: make it this interpreter (DeepSpeed's sdist build imports torch).
PATH="$(dirname "$py"):$PATH" bash "$wheelhouse" "$dest"

# Trim Ray: drop packages raypack never imports, and rewrite RECORD so pip accepts the wheel.
for wheel in "$dest"/ray-*.whl; do
  "$py" - "$wheel" <<'PY'
import base64, csv, hashlib, io, os, sys, zipfile
path = sys.argv[1]
drop = ("ray/rllib/", "ray/serve/", "ray/llm/", "ray/dashboard/client/")
tmp = path + ".tmp"
with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    rows, dropped = [], 0
    for info in zin.infolist():
        if info.filename == record:
            continue
        if info.filename.startswith(drop):
            dropped += 1
            continue
        data = zin.read(info.filename)
        zi = zipfile.ZipInfo(info.filename, info.date_time)
        zi.external_attr, zi.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
        zout.writestr(zi, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append([info.filename, f"sha256={digest}", str(len(data))])
    rows.append([record, "", ""])
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    zout.writestr(record, buf.getvalue())
os.replace(tmp, path)
print(f"{os.path.basename(path)}: dropped {dropped} files of {', '.join(drop)}; {os.path.getsize(path) / 2**20:.1f} MiB")
PY
done

# transformers: the version of the interpreter raypack is developed with (the image's is older).
tf_version=$("$py" -c 'from importlib.metadata import version; print(version("transformers"))')
rm -f "$dest"/transformers-*.whl
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$dest" "transformers==$tf_version"
rm -f "$dest"/huggingface_hub-*.whl
# peft (model.peft, the lora step) and accelerate, which it imports, and trl (bench-peers): pure
# Python, this venv's versions; liger-kernel (model.kernels, on the GPU machine's Triton): pure
# Python, pyproject's range (it is not in the CPU venv).
rm -f "$dest"/liger_kernel-*.whl
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$dest" "liger-kernel>=0.8.5,<0.9"
for pkg in peft accelerate trl; do
  v=$("$py" -c "from importlib.metadata import version; print(version('$pkg'))")
  rm -f "$dest"/"$pkg"-*.whl
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$dest" "$pkg==$v"
done

total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
echo "wheels in $dest: $((total / 1048576)) MiB (limit $limit_mib MiB), transformers $tf_version"
ls -1 "$dest"
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
  echo "gpu_wheels.sh: $((total / 1048576)) MiB of wheels exceed $limit_mib MiB; the device tool carries 64 MiB in all" >&2
  exit 1
fi
