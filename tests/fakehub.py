"""A Hugging Face Hub on 127.0.0.1 for a few small datasets: the routes huggingface_hub calls to list
a dataset (`dataset_info`), walk and read its files (HfFileSystem: tree, paths-info, ranged GETs of
`resolve`) and download it into the hub cache (`snapshot_download`: HEAD and GET of `resolve`).
Tests point HF_ENDPOINT (or huggingface_hub.constants.ENDPOINT) at it; nothing reaches the internet.

    hub = FakeHub({"org/chat": Repo({"main": {"train.jsonl": b"..."}})}).start()   # hub.url
    FakeHub({}, silent=True).start()   # accepts every connection and never answers
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from raypack.config import ASSETS

SAMPLE = ASSETS / "sample"


@dataclass
class Repo:
    revisions: dict[str, dict[str, bytes]]
    """{branch: {path: bytes}}; every branch is one commit, whose sha the fake derives from it."""
    card: dict = field(default_factory=dict)
    """The README's YAML metadata (`configs`), as the API's `cardData` reports it (the README itself
    is one of the files, for the hub cache's readers)."""
    gated: bool = False
    """Files answer 401 (GatedRepo) to a request without a token; listing them needs none, as on the hub."""


def sha(repo: str, branch: str) -> str:
    return hashlib.sha1(f"{repo}@{branch}".encode()).hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, Repo], silent: bool = False):
        self.repos = repos
        self.silent = silent
        """Read each request, then answer nothing until stopped: a hub behind a proxy or firewall
        that holds connections open (what a timeout per request waited out, request after request)."""
        self.stopped = threading.Event()
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()

    def commit(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(sha, files) of a branch or a commit sha of `repo`; None if it has neither."""
        for branch, files in self.repos[repo].revisions.items():
            if revision in (branch, sha(repo, branch)):
                return sha(repo, branch), files
        return None


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: pytest shows what the test asserts
            pass

        def do_GET(self):
            self._route(body=True)

        def do_HEAD(self):
            self._route(body=False)

        def do_POST(self):
            self._route(body=True)

        def _reply(self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True):
            self.send_response(status)
            for k, v in {"Content-Length": str(len(data)), **(headers or {})}.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, body: bool):
            self._reply(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code,
                                                                        "Content-Type": "application/json"}, body)

        def _json(self, obj, body: bool):
            self._reply(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, body)

        def _route(self, body: bool):
            url = urlsplit(self.path)
            hub.requests.append(f"{self.command} {url.path}")
            if hub.silent:
                hub.stopped.wait()
                return
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            api = parts[:2] == ["api", "datasets"]
            if not (api or parts[:1] == ["datasets"]) or len(parts) < (4 if api else 3):
                return self._error(404, "RepoNotFound", body)
            org, name = parts[2:4] if api else parts[1:3]
            repo, rest = f"{org}/{name}", parts[4:] if api else parts[3:]
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound", body)
            if not api:  # /datasets/{repo}/resolve/{revision}/{path}
                return self._file(repo, rest[1], "/".join(rest[2:]), body)
            if not rest or rest[0] == "revision":
                return self._info(repo, rest[1] if rest else "main", body)
            found = hub.commit(repo, rest[1])
            if found is None:
                return self._error(404, "RevisionNotFound", body)
            if rest[0] == "tree":
                recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
                return self._json(_tree(found[1], "/".join(rest[2:]), recursive), body)
            if rest[0] == "paths-info":
                form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
                return self._json([e for p in form.get("paths", []) for e in _tree(found[1], p, False, own=True)], body)
            return self._error(404, "EntryNotFound", body)

        def _info(self, repo: str, revision: str, body: bool):
            found = hub.commit(repo, revision)
            if found is None:
                return self._error(404, "RevisionNotFound", body)
            r = hub.repos[repo]
            self._json({"id": repo, "_id": sha(repo, "id")[:24], "sha": found[0], "private": False,
                        "gated": "manual" if r.gated else False, "disabled": False, "tags": [], "downloads": 0,
                        "likes": 0, "cardData": r.card, "siblings": [{"rfilename": p} for p in sorted(found[1])]}, body)

        def _file(self, repo: str, revision: str, path: str, body: bool):
            if hub.repos[repo].gated and "authorization" not in {k.lower() for k in self.headers}:
                return self._error(401, "GatedRepo", body)
            found = hub.commit(repo, revision)
            if found is None:
                return self._error(404, "RevisionNotFound", body)
            if path not in found[1]:
                return self._error(404, "EntryNotFound", body)
            data = found[1][path]
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": found[0],
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            rng = self.headers.get("Range") or self.headers.get("range")
            if rng and rng.startswith("bytes="):
                start, _, end = rng[len("bytes="):].partition("-")
                start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                return self._reply(206, data[start:end + 1], headers, body)
            self._reply(200, data, headers, body)

    return Handler


def _tree(files: dict[str, bytes], path: str, recursive: bool, own: bool = False) -> list[dict]:
    """The hub's tree entries under `path` (its children, or all below it); `own`: `path`'s own entry."""
    path = path.strip("/")
    folders = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    entries = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()} for f, b in files.items()]
    entries += [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()} for d in folders]
    if own:
        return [e for e in entries if e["path"] == path]
    below = [e for e in entries if not path or e["path"].startswith(path + "/")]
    depth = path.count("/") + 1 if path else 0
    return sorted((e for e in below if recursive or e["path"].count("/") == depth), key=lambda e: e["path"])


def point_at(hub: FakeHub, monkeypatch, tmp_path) -> FakeHub:
    """huggingface_hub in this process pointed at `hub` (as HF_ENDPOINT would at its import), with a
    fresh cache under `tmp_path`, no token and online; its HfFileSystem instances dropped."""
    from huggingface_hub import HfFileSystem, constants

    # both as huggingface_hub's import sets them from HF_ENDPOINT (hf_hub_url reads the template)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    HfFileSystem.clear_instance_cache()  # one cached per endpoint and token: no listing of another test's
    return hub


# --- the sample datasets ---------------------------------------------------------------------------


def lines(name: str, start: int, stop: int) -> bytes:
    """Lines [start, stop) of a bundled sample file."""
    return b"".join((SAMPLE / name).read_bytes().splitlines(keepends=True)[start:stop])


def parquet(start: int, stop: int) -> bytes:
    """Rows [start, stop) of the bundled completions, as a Parquet file."""
    rows = [json.loads(line) for line in lines("completion.jsonl", start, stop).splitlines()]
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()


MIX_CARD = {"configs": [
    {"config_name": "short", "data_files": [{"split": "train", "path": "short/train-*.parquet"},
                                             {"split": "test", "path": "short/test.parquet"}]},
    {"config_name": "long", "default": True, "data_files": "long/*.parquet"},
    {"config_name": "dir", "data_dir": "short"},  # datasets' split patterns, in the folder
]}


def sample_repos() -> dict[str, Repo]:
    """A JSONL chat dataset with a tag, a Parquet one with configs, a CSV one the hub converted to
    Parquet, one with files of two formats, and a gated one, from the bundled samples."""
    csv = b"prompt,completion\nhi,there\n"
    return {
        "fake/chat": Repo({"main": {"README.md": b"# chats\n", "train.jsonl": lines("chat.jsonl", 0, 12),
                                    "test.jsonl": lines("chat.jsonl", 12, 15)},
                           "v1": {"train.jsonl": lines("chat.jsonl", 20, 24)}}),
        "fake/mix": Repo({"main": {"README.md": b"---\n" + yaml.safe_dump(MIX_CARD).encode() + b"---\n# mixed\n",
                                   "short/train-0.parquet": parquet(0, 4), "short/train-1.parquet": parquet(4, 6),
                                   "short/test.parquet": parquet(6, 8), "long/a.parquet": parquet(8, 15)}},
                         card=MIX_CARD),
        "fake/csv": Repo({"main": {"data.csv": csv},
                          "refs/convert/parquet": {"default/train/0000.parquet": parquet(0, 3),
                                                   "default/partial-test/0000.parquet": parquet(3, 4)}}),
        # one builder a split: its most common extension's, Parquet where tied (load_dataset's choice)
        "fake/formats": Repo({"main": {"train.jsonl": b"", "train-2.jsonl": b"", "train-3.parquet": b""},
                              "tie": {"a.jsonl": b"", "b.parquet": b""}}),
        "fake/gated": Repo({"main": {"train.jsonl": lines("chat.jsonl", 0, 3)}}, gated=True),
    }


# --- stand-ins for the hub datasets the docs name -----------------------------------------------------


def _table(rows: list[dict], schema: pa.Schema) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out)
    return out.getvalue()


def _card(card: dict, title: str) -> bytes:
    return b"---\n" + yaml.safe_dump(card, sort_keys=False).encode() + f"---\n# {title}\n".encode()


_MESSAGES = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))


def stand_in_repos() -> dict[str, Repo]:
    """Same-named stand-ins for the real datasets docs/guides/data.md names, with their schemas
    (column names, types and order), file layouts and README `configs` as their hub pages show
    them (their dataset cards' `dataset_info` and `configs`, and their file trees), and rows made
    from the bundled samples: what raypack lists and reads of them, without their text. They are
    not the real datasets; nothing here reached the hub.

    - trl-lib/Capybara (TRL's SFT examples): `source`, `messages` (content, role), `num_turns`;
      `data/train-00000-of-00001.parquet` and `data/test-...`, a default config naming both.
    - HuggingFaceH4/ultrachat_200k: `prompt`, `prompt_id`, `messages`; splits train_sft, test_sft,
      train_gen, test_gen as `data/{split}-0000k-of-0000n-<hash>.parquet`, train_sft in 3 shards.
    - openai/gsm8k: `question`, `answer`; configs main and socratic and no default one, as
      `main/train-00000-of-00001.parquet`, `main/test-...`, `socratic/...`.
    """
    chats = [json.loads(line)["messages"] for line in lines("chat.jsonl", 0, 40).splitlines()]
    qa = [json.loads(line) for line in lines("completion.jsonl", 0, 24).splitlines()]

    capybara = pa.schema([("source", pa.string()), ("messages", _MESSAGES), ("num_turns", pa.int64())])
    capy = [{"source": "sample", "messages": m, "num_turns": len(m)} for m in chats]
    capybara_card = {"configs": [{"config_name": "default", "data_files": [
        {"split": "train", "path": "data/train-*"}, {"split": "test", "path": "data/test-*"}]}]}

    ultra = pa.schema([("prompt", pa.string()), ("prompt_id", pa.string()), ("messages", _MESSAGES)])
    rows = [{"prompt": m[0]["content"], "prompt_id": hashlib.sha256(m[0]["content"].encode()).hexdigest(),
             "messages": m} for m in chats]
    splits = {"train_sft": (rows[0:8], rows[8:16], rows[16:24]), "test_sft": (rows[24:28],),
              "train_gen": (rows[28:36],), "test_gen": (rows[36:40],)}
    ultra_files = {f"data/{split}-{k:05d}-of-{len(parts):05d}-{sha(split, str(k))[:16]}.parquet": _table(part, ultra)
                   for split, parts in splits.items() for k, part in enumerate(parts)}
    ultra_card = {"configs": [{"config_name": "default", "data_files": [
        {"split": s, "path": f"data/{s}-*"} for s in splits]}]}

    gsm = pa.schema([("question", pa.string()), ("answer", pa.string())])
    qa = [{"question": r["prompt"], "answer": r["completion"]} for r in qa]
    gsm_files = {f"{config}/{split}-00000-of-00001.parquet": _table(part, gsm)
                 for config, halves in (("main", (qa[0:8], qa[8:12])), ("socratic", (qa[12:22], qa[22:24])))
                 for split, part in zip(("train", "test"), halves)}
    gsm_card = {"configs": [{"config_name": c, "data_files": [{"split": s, "path": f"{c}/{s}-*"}
                                                              for s in ("train", "test")]}
                            for c in ("main", "socratic")]}
    return {
        "trl-lib/Capybara": Repo({"main": {"README.md": _card(capybara_card, "Capybara"),
                                           "data/train-00000-of-00001.parquet": _table(capy[:32], capybara),
                                           "data/test-00000-of-00001.parquet": _table(capy[32:], capybara)}},
                                 card=capybara_card),
        "HuggingFaceH4/ultrachat_200k": Repo({"main": {"README.md": _card(ultra_card, "UltraChat 200k"), **ultra_files}},
                                             card=ultra_card),
        "openai/gsm8k": Repo({"main": {"README.md": _card(gsm_card, "GSM8K"), **gsm_files}}, card=gsm_card),
    }
