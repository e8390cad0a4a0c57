"""The wheels a bare GPU machine needs beside its image to run raypack's GPU kit, worked out from the lock.

    tools/gpu_wheels.sh                        # -> .whl/ (git-ignored): wheels + requirements.json
    python tools/gpu_wheels.py [--dest .whl] [--image tools/gpu_image_packages.txt] [--limit-mib 60]
    python tools/gpu_wheels.py --image-requirements    # the image's packages on raypack's path, pinned
                                                       # (what `make gpu-rehearsal` installs as the image)

Run it with the venv `make setup` built (it holds exactly the lock, constraints.txt, whose metadata
this reads). How the set is worked out:

1. Roots: pyproject.toml's dependencies (Ray's `default` extra among them) with the `bench`, `peft`
   and `liger` extras, pytest (the GPU tests), and the hybrid kernels that fit (KERNELS).
2. Their closure at the lock's versions, evaluated for CPython 3.12 on Linux x86_64. A package
   outside the lock (liger-kernel: its Triton is 1 GB, so the CPU lock leaves it out) is taken at
   the newest version its range allows.
3. Left out: a few requirements of Ray's `default` extra that nothing on raypack's path imports
   (NEVER_IMPORTED: virtualenv, py-spy, ...), with whatever only they need.
4. A package is carried unless the image (--image, one `name==version` or `name` a line) holds a
   version that every requirement on it in the closure allows; an image package is not walked
   into (its own needs are the image's). A name the image lists without a version is taken as
   it is: requirements.json holds every requirement on the image's packages, and `make gpu-check`
   checks them on the machine before any step runs.
5. cp312 manylinux x86_64 or pure-Python wheels, downloaded into .cache/gpu-wheels; a package with
   only an sdist (DeepSpeed) is built here into a pure-Python wheel.
6. Trimmed: Ray's rllib, serve, llm and jars, which raypack never imports, and the dashboard's
   web page (not the dashboard); Ray's binaries stripped of their symbol tables (STRIP);
   transformers' model folders that nothing on raypack's path names (see `transformers_keep`).
7. The wheels and the repository as it travels (tracked and untracked, not ignored, files) must
   fit in --limit-mib (default 60: the device tool carries 64 MiB in all), or this fails saying so.
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "gpu-wheels"
EXTRAS = ("bench", "peft", "liger")
KIT_TOOLS = ("pytest>=8",)
"""What the kit itself runs beside raypack's own requirements."""
KERNELS = ("fla-core>=0.6,<0.7",)
"""The hybrid mixers' CUDA kernels that fit the kit (`make gpu-check`'s hybrid step): fla-core is
flash-linear-attention's ops and modules, the part transformers calls (fla.ops.gated_delta_rule),
pure Python and Triton, 1.0 MiB; the flash-linear-attention package adds only its own model
classes (0.4 MiB). Not carried: causal-conv1d and mamba-ssm, which publish no wheel on the
package index, only sdists of CUDA code (causal-conv1d 1.7.0: 30 kB) whose setup either fetches a
prebuilt wheel from the project's GitHub releases (outside the package index, unreachable from the
GPU machine and from here) or compiles the kernels with nvcc, minutes of the GPU machine's time.
Without causal-conv1d raypack's gated delta rule takes its exact torch path on CUDA, in which
transformers still calls fla's chunked kernel, on the examples as a padded batch."""
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "platform_release": "",
          "platform_version": ""}  # fmt: skip
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
              "--abi", "abi3", "--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p))]  # fmt: skip
NEVER_IMPORTED = {
    "virtualenv": "Ray's runtime_env pip/uv environments, which raypack never asks for",
    "py-spy": "a binary the Ray dashboard runs for stack dumps on request",
    "google-auth": "Google Cloud credentials (with cryptography, 4.5 MiB), for opencensus's exporters to Google Cloud, "
                   "which Ray's metrics agent doesn't use",
    "smart-open": "Ray's runtime_env packages from remote URIs, which raypack never asks for",
}
"""Requirements of the closure left out with everything only they need (tools/gpu_wheels.py found
none of them imported by Ray's driver, dashboard and agents, Ray Train/Tune/Data, DeepSpeed, TRL,
peft or datasets; `make gpu-rehearsal` runs the kit without them)."""
TRIM = {
    # The dashboard's web page (its scripts and images, 2.4 MiB) goes; the dashboard itself stays
    # (raypack starts it, Ray Train's State API and `ray job submit` talk to it) and refuses to start
    # without client/build/ and client/build/static/, so their small files stay. The GPU machine is
    # reached by no browser anyway.
    # Its examples, and Ray on Spark and on Dask (each imported only inside the functions that use
    # them: ray.data's from_spark / to_dask, the Spark cluster launcher), go too; so do the cluster
    # launcher's cloud providers (imported by provider type, and the GPU machine launches no
    # cluster: KubeRay's and the local ones stay) and the experimental sandbox (imported by none).
    "ray": ("ray/rllib/", "ray/serve/", "ray/llm/", "ray/jars/", "ray/dashboard/client/build/static/js/",
            "ray/dashboard/client/build/static/media/", "ray/dashboard/client/build/speedscope-",
            "ray/tune/examples/", "ray/train/examples/", "ray/train/v2/examples/", "ray/util/spark/", "ray/util/dask/",
            "ray/autoscaler/_private/spark/", "ray/autoscaler/_private/aws/", "ray/autoscaler/_private/gcp/",
            "ray/autoscaler/_private/_azure/", "ray/autoscaler/_private/vsphere/", "ray/autoscaler/_private/aliyun/",
            "ray/experimental/sandbox/"),
}
"""Paths dropped from a carried wheel: raypack never imports them."""
STRIP = {"ray"}
"""Carried wheels whose ELF files (Ray's gcs_server, raylet and _raylet.so, 114 MiB unpacked) go
without their symbol tables (`strip --strip-unneeded`: what the dynamic linker and Python's import
need stays). They are shipped unstripped; stripped, Ray's wheel goes from 39.7 to 33.4 MiB. What is
lost is function names in a Ray process's own crash stack trace, which the kit has never needed."""


def fail(message: str) -> None:
    sys.exit(f"gpu_wheels: {message}")


def read_lines(path: Path) -> dict[str, str | None]:
    """`name==version` or `name` lines (comments and blanks skipped) -> {canonical name: version or None}."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version.strip() or None
    return out


def roots() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in [*reqs, *KIT_TOOLS, *KERNELS]]


def applies(req: Requirement, extras: set[str]) -> bool:
    """Does `req` hold on the GPU machine, for a package asked for with `extras`?"""
    return req.marker is None or any(req.marker.evaluate({**TARGET, "extra": e}) for e in extras | {""})


@dataclass
class Node:
    name: str
    version: str
    requires: list[Requirement]
    extras: set[str] = field(default_factory=set)
    wanted: dict[str, str] = field(default_factory=dict)
    """who asks for this package -> the specifier they ask with"""

    def allows(self, version: str) -> bool:
        return all(SpecifierSet(s).contains(Version(version), prereleases=True) for s in self.wanted.values())


class Metadata:
    """Each package's version and requirements: the lock's version from this venv's metadata, or,
    for one outside the lock or not installed here, from its wheel (downloaded into the cache)."""

    def __init__(self, lock: dict[str, str | None]) -> None:
        self.lock, self.seen = lock, {}

    def __call__(self, name: str, spec: SpecifierSet) -> tuple[str, list[Requirement]]:
        if name not in self.seen:
            version = self.lock.get(name)
            try:
                dist = importlib.metadata.distribution(name)
                if version is None or canonicalize_name(dist.version) != canonicalize_name(version):
                    raise importlib.metadata.PackageNotFoundError(name)
                self.seen[name] = (version, [Requirement(r) for r in dist.requires or []])
            except importlib.metadata.PackageNotFoundError:
                wheel = fetch(name, f"=={version}" if version else str(spec))
                _, wheel_version, *_ = parse_wheel_filename(wheel.name)
                self.seen[name] = (str(wheel_version), wheel_requires(wheel))
        return self.seen[name]


def wheel_requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]


def closure(image: dict[str, str | None], meta: Metadata) -> tuple[dict[str, Node], dict[str, bool]]:
    """Walk the roots' requirements; returns the nodes and, per node, whether the image provides it.
    Repeated until stable: a package the image provides isn't walked into, which can only take
    requirements away from the others."""
    provided: dict[str, bool] = {}
    while True:
        nodes: dict[str, Node] = {}
        queue = [("raypack", r) for r in roots()]
        while queue:
            parent, req = queue.pop(0)
            name = canonicalize_name(req.name)
            if name in NEVER_IMPORTED:
                continue
            node = nodes.get(name)
            if node is None:
                node = nodes[name] = Node(name, *meta(name, req.specifier))
                new = set(req.extras) | {""}
            else:
                new = set(req.extras) - node.extras
            node.wanted[parent] = str(SpecifierSet(node.wanted.get(parent, "")) & req.specifier)
            node.extras |= set(req.extras)
            if provided.get(name) or not new:
                continue
            queue += [(name, dep) for dep in node.requires if applies(dep, new)]
        decided = {name: image_provides(node, image) for name, node in nodes.items()}
        if decided == provided:
            return nodes, provided
        provided = decided


def image_provides(node: Node, image: dict[str, str | None]) -> bool:
    if node.name not in image:
        return False
    version = image[node.name]
    return version is None or node.allows(version)


def fetch(name: str, spec: str) -> Path:
    """The wheel of `name` for the GPU machine, from the cache or downloaded into it; built from its
    sdist where none is published (it must then be pure Python)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    wanted = SpecifierSet(spec)

    def cached(pattern: str, parse) -> Path | None:
        hits = [p for p in CACHE.glob(pattern) if canonicalize_name(parse(p.name)[0]) == name
                and wanted.contains(parse(p.name)[1], prereleases=True)]  # fmt: skip
        return max(hits, key=lambda p: parse(p.name)[1]) if hits else None

    wheel = cached("*.whl", parse_wheel_filename)
    if wheel:
        return wheel
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(CACHE)]
    got = subprocess.run([*pip, *PIP_TARGET, f"{name}{spec}"], capture_output=True, text=True)
    if got.returncode == 0 and (wheel := cached("*.whl", parse_wheel_filename)):
        return wheel
    got = subprocess.run([*pip, "--no-binary=:all:", f"{name}{spec}"], capture_output=True, text=True)
    sdist = cached("*.tar.gz", parse_sdist_filename)
    if got.returncode or sdist is None:
        fail(f"no wheel for {name}{spec} on cp312 manylinux x86_64, and no sdist: {got.stderr.strip()[-500:]}")
    print(f"gpu_wheels: building {sdist.name} into a wheel (it publishes none)", flush=True)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(CACHE), str(sdist)], capture_output=True, text=True)  # fmt: skip
    wheel = cached("*.whl", parse_wheel_filename)
    if built.returncode or wheel is None:
        fail(f"building {sdist.name} failed: {built.stderr.strip()[-1000:]}")
    if not wheel.name.endswith("-none-any.whl"):
        fail(f"{wheel.name} was built for this machine, not the GPU machine's Python 3.12: only a pure-Python "
             "package can be built here")  # fmt: skip
    return wheel


def strip_elf(data: bytes) -> bytes:
    """`data` stripped of its symbol tables if it is an ELF file, else as it is."""
    if data[:4] != b"\x7fELF":
        return data
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "elf"
        path.write_bytes(data)
        got = subprocess.run(["strip", "--strip-unneeded", str(path)], capture_output=True, text=True)
        if got.returncode:
            fail(f"strip failed ({got.stderr.strip()[-300:]}): install binutils, or take the wheel out of STRIP")
        return path.read_bytes()


def rewrite(src: Path, dest: Path, drop, strip: bool = False) -> int:
    """Copy wheel `src` to `dest` without the members `drop(name)` is true for, and with its ELF
    files stripped if `strip`; RECORD rewritten so that pip accepts it. Returns how many members
    were dropped."""
    dropped, rows = 0, []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if info.filename == record:
                continue
            if drop(info.filename):
                dropped += 1
                continue
            data = zin.read(info.filename)
            if strip:
                data = strip_elf(data)
            member = zipfile.ZipInfo(info.filename, info.date_time)
            member.external_attr, member.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            zout.writestr(member, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append([info.filename, f"sha256={digest}", str(len(data))])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([*rows, [record, "", ""]])
        zout.writestr(record, buf.getvalue())
    return dropped


MODELS = re.compile(r"(?:transformers\.models\.|from \.\.+(?:models\.)?)([a-z][a-z0-9_]*)")


def transformers_keep(wheel: Path, carried: list[Path]) -> set[str]:
    """transformers' model folders anything on raypack's path may import: those raypack, its tests,
    benchmarks and tools name (`transformers.models.X`, or a class imported from transformers),
    the test families' and tiny models' config classes, what the carried libraries (TRL, peft,
    DeepSpeed, Liger, ...) name, and, repeatedly, the folders those folders import."""
    import transformers

    with zipfile.ZipFile(wheel) as z:
        files = {n: n for n in z.namelist() if n.startswith("transformers/models/") and n.endswith(".py")}
        folders = {n.split("/")[2] for n in files if n.count("/") >= 3}
        source = {n: z.read(n).decode(errors="replace") for n in files}
    keep = {"auto"}
    texts = [p.read_text(errors="replace") for d in ("raypack", "tests", "benchmarks", "tools") for p in (REPO / d).rglob("*.py")]
    for text in texts:
        keep |= set(MODELS.findall(text))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module == "transformers":
                keep |= {module_folder(getattr(transformers, a.name, None)) for a in node.names}
    sys.path.insert(0, str(REPO / "tests"))
    from families import FAMILIES

    from raypack.model.build import TINY_FAMILIES

    keep |= {f.module_name(name) for name, f in FAMILIES.items()}
    keep |= {module_folder(getattr(transformers, cls)) for cls, _ in TINY_FAMILIES.values()}
    for other in carried:
        with zipfile.ZipFile(other) as z:
            for n in z.namelist():
                if n.endswith(".py"):
                    keep |= import_time_models(z.read(n).decode(errors="replace"))
    keep &= folders
    while True:
        more = {m for n, text in source.items() if n.split("/")[2] in keep for m in MODELS.findall(text)} & folders
        if more <= keep:
            return keep
        keep |= more


def import_time_models(text: str) -> set[str]:
    """The transformers model folders a module imports when it is imported (at its top level, in
    its classes' bodies, under if/try), not in its functions: a library names many models in code
    that runs only for a model of that type."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformers.models."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("transformers.models.")}
        todo.extend(ast.iter_child_nodes(node))
    return found


def module_folder(obj) -> str:
    parts = getattr(obj, "__module__", "").split(".")
    return parts[2] if parts[:2] == ["transformers", "models"] and len(parts) > 2 else ""


def travelling_bytes() -> int:
    """The repository as the device tool carries it: tracked and untracked, not ignored, files."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")  # fmt: skip
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", default=str(REPO / ".whl"))
    p.add_argument("--image", default=str(REPO / "tools" / "gpu_image_packages.txt"))
    p.add_argument("--limit-mib", type=float, default=60)
    p.add_argument("--image-requirements", action="store_true",
                   help="print the image's packages that raypack's path needs, pinned (the lock's version where "
                        "the image list gives none), and exit")  # fmt: skip
    args = p.parse_args(argv)
    image = read_lines(Path(args.image))
    lock = read_lines(REPO / "constraints.txt")
    nodes, provided = closure(image, Metadata(lock))
    if args.image_requirements:
        for name in sorted(n for n, yes in provided.items() if yes):
            print(f"{name}=={image[name] or nodes[name].version}")
        return 0

    carry = sorted(n for n, yes in provided.items() if not yes)
    print(f"gpu_wheels: {len(nodes)} packages on raypack's path; the image provides {len(nodes) - len(carry)}, "
          f"{len(carry)} travel as wheels")  # fmt: skip
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    wheels = {name: fetch(name, f"=={nodes[name].version}") for name in carry}
    for name, wheel in wheels.items():
        reason = "not in the image" if name not in image else f"the image's {image[name]} is outside {nodes[name].wanted}"
        out = dest / wheel.name
        if name == "transformers":
            keep = transformers_keep(wheel, [w for n, w in wheels.items() if n != "transformers"])
            drop = rewrite(wheel, out, lambda f: f.count("/") >= 3 and f.startswith("transformers/models/")
                           and f.split("/")[2] not in keep)  # fmt: skip
            reason += f"; {len(keep)} model folders kept, {drop} files dropped"
        elif name in TRIM or name in STRIP:
            drop = rewrite(wheel, out, lambda f: f.startswith(TRIM.get(name, ())), strip=name in STRIP)
            reason += f"; {drop} files of {', '.join(TRIM[name])} dropped" if name in TRIM else ""
            reason += "; ELF files stripped of symbols" if name in STRIP else ""
        else:
            out.write_bytes(wheel.read_bytes())
        print(f"  {out.name:<72} {out.stat().st_size / 2**20:6.2f} MiB  {reason}")
    requirements = {n: {"version": image[n], "wanted": nodes[n].wanted} for n in sorted(nodes) if provided[n]}
    (dest / "requirements.json").write_text(json.dumps(requirements, indent=1) + "\n")

    wheels_mib = sum(w.stat().st_size for w in dest.glob("*.whl")) / 2**20
    repo_mib = travelling_bytes() / 2**20
    print(f"gpu_wheels: {wheels_mib:.1f} MiB of wheels in {dest} + {repo_mib:.1f} MiB of repository = "
          f"{wheels_mib + repo_mib:.1f} MiB (limit {args.limit_mib:.0f})")  # fmt: skip
    if wheels_mib + repo_mib > args.limit_mib:
        fail(f"{wheels_mib + repo_mib:.1f} MiB exceeds {args.limit_mib:.0f} MiB: the device tool carries 64 MiB in all. "
             "Trim a large wheel above (TRIM) or add what it needs to the image list")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
