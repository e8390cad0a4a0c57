"""One live run per run folder: a lock file that names its owner and leaves with it.

    with hold(root, "run 'quickstart'", "train"):    # InputError while another live run holds root
        ...                                          # renewed in a thread; removed on the way out

    <run folder>/raypack_lock.json    {"command", "host", "pid", "process", "started", "renewed", "lease_s", "token"}

A run (`raypack train`) or a sweep (`raypack sweep`, whose trials' run folders lie inside its own)
holds its folder from before its inputs are checked until the command ends, however it ends
(finished, failed, Ctrl-C, SIGTERM). A second command on the same folder meets one line naming
the owner. A process killed outright (SIGKILL, out of memory, a lost machine) leaves its lock
behind, and the next command takes it over, saying so, when

- the owner ran on this host and its process is gone: its pid runs no process, or a process that
  started after the lock was taken (a pid used again; `process` records the owner's own start), or
- its lease ran out: the owner renews `renewed` every `lease_s / 4` seconds, so a lock not renewed
  for `lease_s` seconds belongs to no live process on any host (host clocks are taken to agree to
  well within the lease, as NTP keeps them).

Taking it. On local disk the record is written beside the lock and hard-linked into place, which
fails if a lock is there: of runs that start at once, one gets it. Object stores offer no
create-if-absent through pyarrow, so there (and to replace a stale lock anywhere) the record is
written, then read back `SETTLE_S` later: of writers at once the last one's record stands and the
others refuse, provided each wrote within `SETTLE_S` of finding the folder free (a run that found
another's record once the first had written would have refused). S3 and GCS read back what was
last written (strong read-after-write consistency), which this needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from raypack import storage
from raypack.errors import InputError

LOCK = "raypack_lock.json"
LEASE_S = 60.0
"""How long a lock stands without being renewed (its owner renews it every quarter of this)."""
SETTLE_S = {"local": 0.2, "uri": 2.0}
"""How long a written record is left before it is read back (see the module doc)."""


class LockedError(InputError):
    """A run folder another live raypack command holds."""


def hold(root: str, what: str, command: str, guards: Sequence[str] = ()) -> contextlib.AbstractContextManager:
    """Hold the lock of the folder `root` (`what` names it on the screen: "run 'x'", "sweep 'y'")
    for raypack `command` while the block runs. `guards`: folders whose live lock also refuses
    (a sweep's, for a trial's run folder inside it), which are not taken."""
    return _held(root, what, command, tuple(guards))


@contextlib.contextmanager
def _held(root: str, what: str, command: str, guards: tuple[str, ...]) -> Iterator[None]:
    for folder in guards:
        if (owner := read(folder)) is not None and stale(owner) is None:
            raise LockedError(f"{what} in {root} belongs to the sweep in {folder}, which {describe(owner)} is running; "
                              "wait for it to finish")
    made = _missing_folders(root)
    lock = Lock(root, command)
    lock.acquire(what)
    try:
        yield
    finally:
        lock.release()
        # a command that ended before it wrote anything leaves no folder, nor the storage path's
        with contextlib.suppress(OSError, InputError):
            for folder in made:
                if storage.list_files(folder) or storage.list_dirs(folder):
                    break
                storage.remove_dir(folder)


class Lock:
    """The lock of one folder, as this process holds it."""

    def __init__(self, root: str, command: str) -> None:
        self.root, self.path, self.command = root, f"{root}/{LOCK}", command
        self.record = own_record(command)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, what: str) -> None:
        local = not storage.is_uri(self.root)
        try:
            if local and _link_new(self.path, self.record):
                self._start_renewing()
                return
            if (owner := read(self.path)) is not None:
                if (reason := stale(owner)) is None:
                    raise LockedError(f"{what} in {self.root} is in use by {describe(owner)}; wait for it to finish, "
                                      "or start a new run with run.name=NEW_NAME")
            _write(self.path, self.record)
            time.sleep(SETTLE_S["local" if local else "uri"])
            if (now := read(self.path)) is None or now.get("token") != self.record["token"]:
                raise LockedError(f"{what} in {self.root} is in use by {describe(now or {})}, which took it as this "
                                  "command did; wait for it to finish, or start a new run with run.name=NEW_NAME")
        except LockedError:
            raise
        except BaseException:  # Ctrl-C in the settle time: leave no record of this process
            self.release()
            raise
        if owner is not None:
            print(f"[raypack] {what}: took over the lock {describe(owner)} left in {self.root}: {reason}", flush=True)
        self._start_renewing()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError, InputError):
            if (now := read(self.path)) is not None and now.get("token") == self.record["token"]:
                fs, p = storage.resolve(self.path)
                fs.delete_file(p)

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew, name="raypack-lock", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.record["lease_s"] / 4):
            try:
                now = read(self.path)
                if now is None or now.get("token") != self.record["token"]:
                    print(f"[raypack] lost the lock of {self.root} to {describe(now or {})}: this process's lease ran "
                          "out unrenewed; the folder may now be written by both", file=sys.stderr, flush=True)
                    return
                self.record["renewed"] = time.time()
                _write(self.path, self.record)
            except Exception:  # an unreachable store now and then: the next renewal tries again
                continue


# --- the record ----------------------------------------------------------------------------------


def own_record(command: str) -> dict[str, Any]:
    now = time.time()
    return {"command": command, "host": socket.gethostname(), "pid": os.getpid(), "process": process_start(os.getpid()),
            "started": now, "renewed": now, "lease_s": LEASE_S, "token": uuid.uuid4().hex}


def read(path_or_root: str) -> dict[str, Any] | None:
    """The lock record at `path_or_root` (a lock file, or a folder holding one); None if there is
    none. One that can't be parsed (not raypack's) reads as an empty record: a stale one."""
    path = path_or_root if path_or_root.endswith(LOCK) else f"{path_or_root}/{LOCK}"
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        return None
    except OSError:
        if not storage.exists(path):
            return None
        raise
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def stale(owner: dict[str, Any]) -> str | None:
    """Why the lock `owner` holds stands for no live process (a sentence), or None while it may."""
    if not {"host", "pid", "renewed"} <= owner.keys():
        return "it is not a lock record raypack wrote"
    if owner["host"] == socket.gethostname():
        started = process_start(int(owner["pid"]))
        if started is None or (owner.get("process") is not None and started != owner["process"]):
            return "that process is gone"
        return None
    ago = time.time() - float(owner["renewed"])
    lease = float(owner.get("lease_s", LEASE_S))
    return f"its lease ran out {_duration(ago - lease)} ago (last renewed {_duration(ago)} ago)" if ago > lease else None


def describe(owner: dict[str, Any]) -> str:
    """`raypack train (pid 123 on host h, started 2026-05-01 10:00:00 UTC)`, as far as `owner` says."""
    if not owner:
        return "another raypack command"
    started = owner.get("started")
    when = datetime.fromtimestamp(float(started), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if started is not None else "?"
    return f"raypack {owner.get('command', '?')} (pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {when})"


def process_start(pid: int) -> str | None:
    """When process `pid` of this host started (this boot's id and its start in clock ticks, from
    /proc), '' where /proc doesn't say (then only whether it runs counts); None if none runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22, after the command's name
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def _missing_folders(root: str) -> list[str]:
    """`root` and those of its parents that don't exist yet, innermost first."""
    missing = []
    folder = root
    while folder and not storage.exists(folder):
        missing.append(folder)
        parent = folder.rpartition("/")[0]
        if parent == folder or parent.endswith(":/") or not parent:
            break
        folder = parent
    return missing


def _duration(s: float) -> str:
    s = max(s, 0)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.0f} h"


def _link_new(path: str, record: dict[str, Any]) -> bool:
    """Put `record` at the local `path` unless a file is there, atomically; whether it was put."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.{record['token']}"
    Path(tmp).write_text(json.dumps(record))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: create-exclusive, then write
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record))
        return True
    finally:
        os.unlink(tmp)


def _write(path: str, record: dict[str, Any]) -> None:
    """Replace the record at `path` whole: a reader sees the old one or the new one, never a part."""
    text = json.dumps(record)
    fs, local = storage.resolve(path)
    if not isinstance(fs, pafs.LocalFileSystem):
        storage.write_text(path, text)  # an object is replaced whole
        return
    # a file is not (pyarrow truncates, then writes): of two writers at once, a longer record's tail
    # could outlast a shorter one's, which reads as no record at all and refuses every writer
    tmp = f"{local}.{record['token']}"
    Path(local).parent.mkdir(parents=True, exist_ok=True)
    Path(tmp).write_text(text)
    os.replace(tmp, local)
