"""A run folder's lock (raypack/runlock.py): a second holder refused with one line naming the
owner, a stale lock (its process gone, its lease run out) taken over with one line, renewed while
held, gone afterwards; on local disk and through a URI (`file://` stands for any object store:
the same pyarrow calls reach S3 or GCS)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from raypack import runlock
from raypack.runlock import LOCK, LockedError, hold

from lockholder import holder, let_go

@pytest.fixture(params=["local", "uri"])
def root(request, tmp_path):
    folder = tmp_path / "runs" / "r"
    return str(folder) if request.param == "local" else f"file://{folder}"


def path_of(root: str) -> str:
    return root.removeprefix("file://")


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(runlock, "SETTLE_S", {"local": 0.05, "uri": 0.1})


def test_a_second_holder_is_refused_naming_the_owner_until_it_ends(root, quick, capsys):
    proc = holder(root)
    try:
        with pytest.raises(LockedError) as e:
            with hold(root, "run 'r'", "train"):
                raise AssertionError("held twice")
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"run 'r' in {root} is in use by raypack train (pid {proc.pid} on host "
                                  f"{socket.gethostname()}, started 20"), message
        assert message.endswith("UTC); wait for it to finish, or start a new run with run.name=NEW_NAME")
    finally:
        let_go(proc)
    assert not os.path.exists(f"{path_of(root)}/{LOCK}"), "the owner left its lock behind"
    with hold(root, "run 'r'", "train"):
        pass
    assert "took over" not in capsys.readouterr().out


def test_a_folder_made_only_for_the_lock_is_gone_afterwards_and_one_holding_files_stays(root, quick, tmp_path):
    with hold(root, "run 'r'", "train"):
        assert json.loads(open(f"{path_of(root)}/{LOCK}").read())["pid"] == os.getpid()
    assert not (tmp_path / "runs").exists()
    with hold(root, "run 'r'", "train"):
        open(f"{path_of(root)}/raypack_config.yaml", "w").close()
    assert os.listdir(path_of(root)) == ["raypack_config.yaml"]


def _record(root: str, **fields) -> None:
    record = runlock.own_record("train") | fields
    os.makedirs(path_of(root), exist_ok=True)
    with open(f"{path_of(root)}/{LOCK}", "w") as f:
        json.dump(record, f)


def test_the_lock_of_a_process_that_is_gone_is_taken_over_with_one_line(root, quick, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _record(root, pid=gone.pid, process="x", started=0)
    with hold(root, "run 'r'", "train"):
        assert json.loads(open(f"{path_of(root)}/{LOCK}").read())["pid"] == os.getpid()
    out = capsys.readouterr().out
    assert out == (f"[raypack] run 'r': took over the lock raypack train (pid {gone.pid} on host {socket.gethostname()}, "
                   f"started 1970-01-01 00:00:00 UTC) left in {root}: that process is gone\n")


def test_a_pid_used_again_by_another_process_is_no_owner(root, quick, capsys):
    _record(root, pid=os.getppid(), process="another-boot:1")  # a live pid, but not the process that took it
    with hold(root, "run 'r'", "train"):
        pass
    assert "that process is gone" in capsys.readouterr().out


def test_another_hosts_lock_stands_for_its_lease_and_is_taken_over_once_it_ran_out(root, quick, capsys):
    _record(root, host="elsewhere", pid=1, renewed=time.time() - 10)
    with pytest.raises(LockedError, match=r"in use by raypack train \(pid 1 on host elsewhere, started "):
        with hold(root, "run 'r'", "train"):
            pass
    _record(root, host="elsewhere", pid=1, renewed=time.time() - 3600)
    with hold(root, "run 'r'", "train"):
        pass
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("[raypack] run 'r': took over the lock raypack train (pid 1 on host elsewhere")
    assert line.endswith("its lease ran out 59 min ago (last renewed 60 min ago)"), line


def test_the_owner_renews_its_lease_while_it_holds_the_lock(root, quick, monkeypatch):
    monkeypatch.setattr(runlock, "LEASE_S", 0.4)
    with hold(root, "run 'r'", "train"):
        first = json.loads(open(f"{path_of(root)}/{LOCK}").read())
        time.sleep(0.5)
        later = json.loads(open(f"{path_of(root)}/{LOCK}").read())
    assert later["token"] == first["token"] and later["renewed"] > first["renewed"]


def test_a_trial_folder_is_refused_while_its_sweep_holds_the_sweep(tmp_path, quick):
    sweep = str(tmp_path / "sweep")
    proc = holder(sweep, "sweep")
    try:
        trial = f"{sweep}/runs/t1"
        with pytest.raises(LockedError, match=rf"^run 't1' in {trial} belongs to the sweep in {sweep}, which raypack "
                                              rf"sweep \(pid {proc.pid} on host "):
            with hold(trial, "run 't1'", "train", guards=(sweep,)):
                pass
    finally:
        let_go(proc)


def _contend(root: str, barrier, results) -> None:
    barrier.wait()
    try:
        with hold(root, "run 'r'", "train"):
            results.put("held")
            time.sleep(1.0)  # the others try while this one holds it
    except LockedError:
        results.put("refused")


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_of_runs_that_start_at_once_one_holds_the_folder(root, stale):
    """Four processes at once, on a free folder or one whose lock a dead process left: one holds it."""
    if stale:
        _record(root, host="elsewhere", renewed=0)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(4), context.Queue()
    procs = [context.Process(target=_contend, args=(root, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert sorted(results.get(timeout=5) for _ in procs) == ["held", "refused", "refused", "refused"]


def _rewrite(path: str, pad: int, n: int) -> None:
    record = runlock.own_record("train") | {"pad": "x" * pad}
    for _ in range(n):
        runlock._write(path, record)


def test_a_record_is_replaced_whole_so_no_reader_meets_part_of_one(root):
    """Two writers of records of different lengths and a reader, at once: the reader sees whole
    records only. (A file written in place is truncated first, and of two such writes a longer
    record's tail can outlast a shorter one's: no record at all, and every contender refused.)"""
    path = f"{root}/{LOCK}"
    runlock._write(path, runlock.own_record("train"))
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_rewrite, args=(path, pad, 400)) for pad in (0, 40)]
    for w in writers:
        w.start()
    torn = 0
    while any(w.is_alive() for w in writers):
        torn += runlock.read(path) == {}
    for w in writers:
        w.join()
    assert torn == 0 and runlock.read(path)["pad"] in ("", "x" * 40)

