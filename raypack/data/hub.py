"""Hugging Face Hub datasets named in `data.paths` or a source's `paths`: `org/name` and `hf://datasets/...`.

    if is_hub_path(path):
        files = hub_files(path, where, config="short", split="test", revision="v1.0")  # [(file, kind)]

A hub dataset stands for the files of one config and split, chosen as `datasets.load_dataset`
chooses them (the README's `configs`, else datasets' own split patterns over the repo's file names),
and read as local files are: `raypack/data/listing.py` cuts them into read units, each read by a
Ray task over `HfFileSystem` (raypack/storage.py), so a large dataset's Parquet row groups are read
in parallel by the workers and never pass through the driver. The files are named at the commit
the revision pointed to when listed (`hf://datasets/org/name@<sha>/...`), so every task reads the
same bytes, and a cache of prepared data is keyed by that commit (raypack/data/fingerprint.py).

Files raypack can't read as they are (CSV, text, scripts) are read from the Parquet conversion the
hub keeps of every public dataset's main branch (`refs/convert/parquet`, `{config}/{split}/*.parquet`);
a partial conversion (of the first rows of a large dataset) is refused, as anything but the whole
split would not be what `load_dataset` trains on.

`HF_TOKEN` is the token, as for huggingface_hub. With `HF_HUB_OFFLINE=1` nothing is asked of the
network: the files are those the hub cache already holds for the revision (`hf download
--repo-type dataset org/name` or `snapshot_download`), read as local files. Every failure (no
network, no such dataset, config, split or revision, a gated one without access, offline and not
cached) is one SourceError naming the dataset and the cause, before any Ray work. Every request
of a listing shares one deadline (raypack/data/hub_deadline.py), and a command lists the hub
datasets of its config before its heavy imports, then reuses those listings (`listed_first`):
a hub that doesn't answer fails the command in one line well within 30 s of its start.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote

from raypack.data.hub_deadline import answer, within_deadline
from raypack.errors import SourceError
from raypack.storage import is_repo_id, is_uri

PREFIX = "hf://datasets/"
PARQUET_BRANCH = "refs/convert/parquet"
READABLE = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
_LOCAL_LOOKING = (".jsonl", ".json", ".parquet", ".arrow")


def is_hub_path(path: str) -> bool:
    """An `hf://` URI, or `org/name` where no such local file or folder exists: a hub dataset's name.
    A missing `data/chat.jsonl` is a local path (it names a data file), not a dataset to look up."""
    if path.startswith("hf://"):
        return True
    return (not is_uri(path) and not os.path.exists(path) and not path.startswith((".", "/", "~"))
            and path.count("/") == 1 and not path.endswith(_LOCAL_LOOKING) and is_repo_id(path))


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str | None
    path: str
    """A file or folder in the repo (an `hf://` URI's rest); "" for the dataset as a whole."""


def parse(path: str, revision: str | None, where: str) -> HubRef:
    """The repo, revision and path in it that `path` names; `revision` is the source's own."""
    if not path.startswith("hf://"):
        return HubRef(path, revision, "")
    if not path.startswith(PREFIX):
        raise SourceError(f"{where}: {path}: only dataset URIs (hf://datasets/org/name) are data")
    parts = path[len(PREFIX):].strip("/").split("/")
    if len(parts) < 2:
        raise SourceError(f"{where}: {path}: expected hf://datasets/org/name[@revision][/path]")
    name, _, rev = parts[1].partition("@")
    rest = parts[2:]
    if rev == "refs" and rest[:2] == ["convert", "parquet"]:  # written unquoted, as HfFileSystem takes them
        rev, rest = PARQUET_BRANCH, rest[2:]
    elif rev == "refs" and rest[:1] == ["pr"] and len(rest) > 1:
        rev, rest = f"refs/pr/{rest[1]}", rest[2:]
    rev = unquote(rev) or None
    if rev and revision and rev != revision:
        raise SourceError(f"{where}: {path}: revision {revision!r} set too; name the revision once")
    return HubRef(f"{parts[0]}/{name}", rev or revision, "/".join(rest))


@dataclass(frozen=True)
class RepoView:
    """One revision of a repo as listed: its files and README configs, and where they are read."""

    sha: str
    files: tuple[str, ...]
    configs: tuple[dict, ...]
    root: str
    """What a file's path in the repo is appended to: `hf://datasets/org/name@sha` or a cache folder."""
    gated: bool = False

    def located(self, files: list[str]) -> list[tuple[str, str]]:
        return [(f"{self.root}/{f}", READABLE[PurePosixPath(f).suffix.lower()]) for f in files]


_listed: dict[tuple, list[tuple[str, str]]] = {}
"""Listings `listed_first` made, by (path, config, split, revision, endpoint, offline), while its
block runs: what the command's own listing of the same datasets takes instead of asking again."""


def choice(source) -> dict[str, str]:
    """The config, split and revision a `data.sources` item (or None) sets: `hub_files`' keywords."""
    return {k: getattr(source, k) for k in ("config", "split", "revision") if getattr(source, k, None) is not None}


@contextlib.contextmanager
def listed_first(data):
    """Every hub dataset `data` (a DataConfig) names, listed now under one deadline, and those
    listings reused by `hub_files` until the block ends. raypack/cli.py lists before it imports
    a command (Ray, torch, transformers: 10 to 25 s on a loaded machine), so that a hub that
    doesn't answer, a missing dataset or a gated one is one line within seconds of the start."""
    from raypack.config.sections import source_where

    named = [(p, "data.paths", None) for p in data.paths]
    named += [(p, source_where(i, s.paths), s) for i, s in enumerate(data.sources) for p in s.paths]
    keys = []
    try:
        with within_deadline():
            for path, where, source in named:
                if is_hub_path(path):
                    files = hub_files(path, where, **choice(source))
                    keys.append(_key(path, choice(source)))
                    _listed[keys[-1]] = files
        yield
    finally:
        for key in keys:
            _listed.pop(key, None)


def _key(path: str, chosen: dict[str, str]) -> tuple:
    from huggingface_hub import constants

    return (path, chosen.get("config"), chosen.get("split"), chosen.get("revision"), constants.ENDPOINT,
            constants.HF_HUB_OFFLINE)


def hub_files(path: str, where: str, *, config: str | None = None, split: str | None = None,
              revision: str | None = None) -> list[tuple[str, str]]:
    """(file, kind) of every file the hub dataset `path` stands for, in name order; its requests
    share one deadline (that of an enclosing `within_deadline`, as `listed_first`'s)."""
    chosen = {k: v for k, v in (("config", config), ("split", split), ("revision", revision)) if v is not None}
    if (key := _key(path, chosen)) in _listed:
        return list(_listed[key])
    with within_deadline():
        return _hub_files(path, where, config, split, revision)


def _hub_files(path: str, where: str, config: str | None, split: str | None,
               revision: str | None) -> list[tuple[str, str]]:
    ref = parse(path, revision, where)
    label = f"{where}: {path}" + (f" (revision {ref.revision})" if ref.revision and ref.revision not in path else "")
    view = _view(ref.repo, ref.revision, label, bare=not path.startswith("hf://"))
    if ref.path:
        if config or split:
            raise SourceError(f"{label}: config and split choose among a whole dataset's files; a path in it names them")
        chosen = [f for f in view.files if f == ref.path or f.startswith(ref.path.rstrip("/") + "/")]
        if not chosen:
            raise SourceError(f"{label}: no file or folder {ref.path} in the dataset")
        readable = [f for f in chosen if PurePosixPath(f).suffix.lower() in READABLE]
        if not readable:  # as a local file or folder would be refused
            raise SourceError(f"{label}: unknown file type; expected .jsonl, .json or .parquet" if chosen == [ref.path]
                              else f"{label}: folder holds no .jsonl, .json or .parquet files")
        chosen = readable
    else:
        chosen = _chosen(view, config, split, label)
        if chosen is None:  # files raypack doesn't read: the hub's Parquet conversion of them
            if ref.revision not in (None, "main"):
                raise SourceError(f"{label}: its files aren't Parquet or JSON Lines, and the hub converts "
                                  "only the main branch to Parquet")
            label = f"{label} (its Parquet conversion, {PARQUET_BRANCH})"
            view = _view(ref.repo, PARQUET_BRANCH, label)
            chosen = converted(view.files, config, split, label)
    if view.gated:
        _check_access(ref.repo, view, chosen[0], label)
    return view.located(sorted(chosen))


def _chosen(view: RepoView, config: str | None, split: str | None, label: str) -> list[str] | None:
    """The repo's own files of the config and split, as load_dataset picks them; None where they
    aren't all Parquet or JSON Lines (or there are none it would read)."""
    from datasets.packaged_modules import _EXTENSION_TO_MODULE

    data = [f for f in view.files if PurePosixPath(f).suffix.lower() in _EXTENSION_TO_MODULE
            and not any(part.startswith((".", "__")) for part in f.split("/"))]
    patterns = config_patterns(view.configs, config, label, data)
    if patterns is None:
        if config not in (None, "default"):
            raise SourceError(f"{label}: no config {config!r}: the dataset has one (default)")
        patterns = default_patterns(data)
    if patterns is None:
        return None
    # the config's files in every split, so that its splits are named from the files read
    files = {s: sorted({f for p in ps for f in match(data, p)}) for s, ps in patterns.items()}
    files = of_one_format(files)
    if files is None or any(PurePosixPath(f).suffix.lower() not in READABLE for fs in files.values() for f in fs):
        return None
    split = split or "train"
    if split not in patterns:
        raise SourceError(f"{label}: no split {split!r}; it has {', '.join(patterns)} (set split)")
    return files[split]


def of_one_format(files: dict[str, list[str]]) -> dict[str, list[str]] | None:
    """`files` less those load_dataset leaves out: it reads every split with one builder, that of
    the split's most common extension (Parquet where tied), and only that builder's files; None if
    the splits' builders differ or there are no files (load_dataset refuses both)."""
    from datasets.load import infer_module_for_data_files_list
    from datasets.packaged_modules import _MODULE_TO_EXTENSIONS

    modules = {infer_module_for_data_files_list(fs)[0] for fs in files.values()}
    if len(modules) != 1 or None in modules:
        return None
    extensions = tuple(_MODULE_TO_EXTENSIONS[modules.pop()])
    return {split: [f for f in fs if f.lower().endswith(extensions)] for split, fs in files.items()}


def default_patterns(data: list[str], folder: str = "") -> dict[str, list[str]] | None:
    """{split: patterns} that datasets finds in the names of the files `data` (of those in `folder`):
    `data/train-00000-of-00002.parquet`, `test.jsonl`, ...; None if it finds none."""
    from datasets.data_files import _get_data_files_patterns

    prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
    inside = [f[len(prefix):] for f in data if f.startswith(prefix)]
    try:
        found = _get_data_files_patterns(lambda p: match(inside, p))
    except FileNotFoundError:
        return None
    return {str(split): [prefix + p for p in ps] for split, ps in found.items()}


def config_patterns(configs: tuple[dict, ...], config: str | None, label: str,
                    data: list[str]) -> dict[str, list[str]] | None:
    """{split: patterns} of the README's config `config` (its default where None); None if the
    README declares no configs, or its config's folder (`data_dir`) has no files datasets finds."""
    if not configs:
        return None
    names = [c.get("config_name", "default") for c in configs]
    if config is None:
        default = [c for c in configs if c.get("default")] or [c for c in configs if c.get("config_name", "default") == "default"]
        if not default and len(configs) > 1:
            raise SourceError(f"{label}: the dataset has configs {', '.join(names)}; set config to one")
        chosen = (default or configs)[0]
    elif config in names:
        chosen = configs[names.index(config)]
    else:
        raise SourceError(f"{label}: no config {config!r}; it has {', '.join(names)}")
    if "data_files" not in chosen:  # the files datasets finds in its data_dir, or the whole repo
        return default_patterns(data, chosen.get("data_dir") or "")
    files = chosen["data_files"]
    if isinstance(files, dict):
        return {split: [p] if isinstance(p, str) else list(p) for split, p in files.items()}
    if isinstance(files, str) or (isinstance(files, list) and all(isinstance(f, str) for f in files)):
        return {"train": [files] if isinstance(files, str) else files}
    return {f["split"]: [f["path"]] if isinstance(f["path"], str) else list(f["path"]) for f in files}


def converted(files: tuple[str, ...], config: str | None, split: str | None, label: str) -> list[str]:
    """The Parquet conversion's files of `config` and `split`: `{config}/{split}/*.parquet`."""
    layout: dict[str, dict[str, list[str]]] = {}
    for f in files:
        parts = f.split("/")
        if len(parts) == 3 and f.endswith(".parquet"):
            layout.setdefault(parts[0], {}).setdefault(parts[1], []).append(f)
    if not layout:
        raise SourceError(f"{label}: no Parquet files; raypack reads Parquet and JSON Lines")
    if config is None:
        if "default" not in layout and len(layout) > 1:
            raise SourceError(f"{label}: the dataset has configs {', '.join(sorted(layout))}; set config to one")
        config = "default" if "default" in layout else next(iter(layout))
    if config not in layout:
        raise SourceError(f"{label}: no config {config!r}; it has {', '.join(sorted(layout))}")
    split = split or "train"
    if split not in layout[config]:
        if f"partial-{split}" in layout[config]:
            raise SourceError(f"{label}: the hub converted only the first rows of split {split!r} to Parquet "
                              "(a partial conversion); export the whole split as Parquet or JSON Lines")
        raise SourceError(f"{label}: no split {split!r} in config {config!r}; it has {', '.join(sorted(layout[config]))}")
    return layout[config][split]


def match(files: list[str], pattern: str) -> list[str]:
    """The files a data_files pattern names, by fsspec's glob rules (as datasets resolves them)."""
    import re

    from fsspec.utils import glob_translate

    regex = re.compile(glob_translate(pattern.lstrip("/")))
    return [f for f in files if regex.match(f)]


def task_env(files: tuple[tuple[str, str], ...]) -> dict:
    """Ray remote args for the tasks that read `files` (a `Sources.files`): where any is a hub
    dataset's, this process's HF_ENDPOINT, the hub that listed the commit they are named at, on
    every node. HF_TOKEN is not passed: a secret in a runtime_env shows in Ray's dashboard and
    logs, so a gated dataset's token is the cluster's own (docs/guides/data.md)."""
    if not any(f.startswith("hf://") for f, _ in files):
        return {}
    from huggingface_hub import constants

    return {"runtime_env": {"env_vars": {"HF_ENDPOINT": constants.ENDPOINT}}}


# --- listing a revision: online, or from the hub cache ----------------------------------------------


def _view(repo: str, revision: str | None, label: str, bare: bool = False) -> RepoView:
    """`bare`: named `org/name`, which could have been a local path: messages that find nothing say
    it isn't one either."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return _cached_view(repo, revision, label, bare)
    from huggingface_hub import HfApi

    api = HfApi(endpoint=constants.ENDPOINT)
    with hub_errors(label, bare):
        info = answer(lambda timeout: api.dataset_info(repo, revision=revision, timeout=timeout), label,
                      constants.ENDPOINT)
    card = info.card_data.to_dict() if info.card_data is not None else {}
    return RepoView(info.sha, tuple(s.rfilename for s in info.siblings or ()), tuple(card.get("configs") or ()),
                    f"{PREFIX}{repo}@{info.sha}", bool(info.gated))


def _cached_view(repo: str, revision: str | None, label: str, bare: bool) -> RepoView:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.repocard import metadata_load

    try:
        folder = snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        missing = "no such file or folder, nor in the hub cache" if bare else "not in the hub cache"
        raise SourceError(f"{label}: {missing}, and HF_HUB_OFFLINE=1 keeps raypack off the network "
                          f"(download it first: hf download --repo-type dataset {repo})") from None
    root = PurePosixPath(folder)
    files = tuple(sorted(str(PurePosixPath(d, f).relative_to(root)) for d, _, names in os.walk(folder) for f in names))
    card = metadata_load(root / "README.md") if "README.md" in files else None
    return RepoView(root.name, files, tuple((card or {}).get("configs") or ()), folder)


def _check_access(repo: str, view: RepoView, first: str, label: str) -> None:
    """A gated dataset lists its files to anyone but serves them only to accounts that accepted its
    terms: one HEAD of a file says so here, rather than in every read task."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(repo, first, repo_type="dataset", revision=view.sha, endpoint=constants.ENDPOINT)
    with hub_errors(label):  # retry_on_errors=False (its default): no backoff beyond the deadline
        answer(lambda timeout: get_hf_file_metadata(url, timeout=timeout, retry_on_errors=False), label,
               constants.ENDPOINT)


class hub_errors:
    """huggingface_hub's exceptions as one SourceError line each, naming `label`'s dataset."""

    def __init__(self, label: str, bare: bool = False):
        self.label, self.bare = label, bare

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, SourceError):
            return False
        if (why := cause(e, self.bare)) is None:
            return False
        raise SourceError(f"{self.label}: {why}") from e


def cause(e: BaseException, bare: bool = False) -> str | None:
    """What a huggingface_hub (or network) exception means for the dataset, in a few words; None
    for any other exception. `bare`: the dataset was named `org/name` (see `_view`)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    token = "HF_TOKEN set" if _has_token() else "no HF_TOKEN set"
    if isinstance(e, GatedRepoError):
        return ("a gated dataset whose terms HF_TOKEN's account hasn't accepted (on its hub page)" if _has_token()
                else "a gated dataset and no HF_TOKEN set: accept its terms on its hub page and set HF_TOKEN")
    if isinstance(e, RevisionNotFoundError):
        return "no such revision"
    if isinstance(e, RepositoryNotFoundError):
        nor = "no such file or folder, nor dataset" if bare else "no such dataset"
        return f"{nor} on {constants.ENDPOINT} (or a private one, {token})"
    if isinstance(e, HfHubHTTPError):
        return f"the hub answered HTTP {e.response.status_code if e.response is not None else '?'}"
    if isinstance(e, (OSError, ConnectionError)) or type(e).__module__.startswith(("httpx", "httpcore")):
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"can't reach the hub at {constants.ENDPOINT} ({reason}; HF_HUB_OFFLINE=1 reads the hub cache)"
    return None


def _has_token() -> bool:
    """HF_TOKEN, or a token `hf auth login` saved: what huggingface_hub sends."""
    from huggingface_hub import get_token

    return get_token() is not None
