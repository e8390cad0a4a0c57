"""Check an environment against constraints.txt, the lock: the last step of the image build.

    python docker/check_image.py                     # versions only (any venv, e.g. the dev one)
    python docker/check_image.py --image             # in the image: also prebuilt DeepSpeed ops,
                                                     # presets from the installed package, EFA plugin
    python docker/check_image.py --requirements tracking,peft   # raypack's dependencies and
                                                     # those extras' (what the image installs)

Every installed package the lock pins must be at its pin, and raypack's own dependencies must be
installed; the lock also pins dev tools, which an image need not have. Exits non-zero naming
every mismatch, so a build that drifted from the pins fails instead of shipping. A local version
label (torch 2.13.0+cu128, +cpu) matches its pin (2.13.0).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import os
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
PYPROJECT = ROOT / "pyproject.toml"
IMAGE_EXTRAS = ("tracking", "peft")
"""The optional dependencies a cluster run uses, installed in the image beside the required ones."""
PREBUILT_OPS = ("cpu_adam", "fused_adam")
# torch's bundled NCCL (the nvidia-nccl wheel) in the image: the TCPX files preload it, so that
# Google's libnccl.so.2 on their library path does not replace it.
TORCH_NCCL = "/home/ray/anaconda3/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
"""DeepSpeed ops raypack can use on GPUs: CPU Adam for optimizer offload, fused Adam otherwise."""


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """`name -> version` for every `name[extras]==version` line (comments and blanks skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;]+)", line)
        if not m:
            raise ValueError(f"{path}: not an exact pin: {line!r}")
        out[normalize(m[1])] = m[3]
    return out


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(extras: tuple[str, ...] = (), path: Path = PYPROJECT) -> list[str]:
    """pyproject.toml's dependencies and those of `extras`, as requirement strings."""
    project = tomllib.loads(path.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return reqs


def requirement_name(req: str) -> str:
    return normalize(re.match(r"[A-Za-z0-9_.-]+", req)[0])


def version_mismatches(expected: dict[str, str], required: tuple[str, ...] = ()) -> list[str]:
    """Installed packages of `expected` at another version, and `required` names not installed."""
    errors = []
    for name, want in expected.items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            if name in required:
                errors.append(f"{name}: not installed, pinned {want}")
            continue
        if have.split("+", 1)[0] != want:
            errors.append(f"{name}: installed {have}, pinned {want}")
    errors += [f"{name}: required but not pinned by {CONSTRAINTS.name}" for name in required if name not in expected]
    return errors


def image_mismatches() -> list[str]:
    errors = []
    from deepspeed.git_version_info import installed_ops

    errors += [f"deepspeed op {op} is not prebuilt" for op in PREBUILT_OPS if not installed_ops.get(op)]
    import raypack
    from raypack.train.engines.presets import PRESETS, load_preset

    if "site-packages" not in raypack.__file__:
        errors.append(f"raypack is imported from {raypack.__file__}, not the installed package")
    if not load_preset("zero3") or not PRESETS.is_dir():
        errors.append(f"DeepSpeed presets not found under {PRESETS}")
    if not os.path.isfile(TORCH_NCCL):
        errors.append(f"torch's NCCL is not at {TORCH_NCCL}, which the TCPX files preload (LD_PRELOAD)")
    if not glob.glob("/opt/amazon/**/libnccl-net*.so*", recursive=True):
        errors.append("no aws-ofi-nccl plugin (libnccl-net*.so) under /opt/amazon: EFA would fall back to TCP")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", action="store_true", help="also check what only the built image has")
    parser.add_argument("--requirements", metavar="EXTRAS", help="print raypack's requirements and those of these extras")
    args = parser.parse_args(argv)
    if args.requirements is not None:
        print("\n".join(requirements(tuple(e for e in args.requirements.split(",") if e))))
        return 0
    required = tuple(requirement_name(r) for r in requirements(IMAGE_EXTRAS)) if args.image else ()
    errors = version_mismatches(pins(), required)
    if args.image:
        errors += image_mismatches()
    for e in errors:
        print(f"check_image: {e}", file=sys.stderr)
    if not errors:
        print(f"check_image: {len(pins())} pins match" + ("; ops, presets and EFA plugin present" if args.image else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
