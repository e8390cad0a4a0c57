"""DeepSpeed's ZeRO state on another worker count: its universal checkpoint.

    driver: universal.convert(checkpoint)      # ds/ (one ZeRO partition a rank) -> ds_universal/ beside it
    workers: engine.load(folder)               # reads ds_universal/ where ds/ was partitioned for another count

ZeRO 1-3 keep each rank's slice of the fp32 master weights and Adam moments as flat partitions
cut for the rank count that saved them, which no other count can read. DeepSpeed's
`ds_to_universal` (0.19.8, deepspeed/checkpoint/ds_to_universal.py) writes them out again one
folder a parameter (`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`, `step.pt`), whole; an
engine built with `checkpoint.load_universal` cuts its own partitions from them (ZeRO 1-2:
`load_hp_checkpoint_state_from_checkpoint_dir`, ZeRO-3: `..._stage3`) and copies the fp32 master
weights into the model's bf16 ones. Its functions run here in-process (its `main` with the
arguments its command line would parse), one worker each: no subprocess, no process pool.

The converted state goes into the checkpoint's own folder, beside `ds/` (which it never
touches), so that every worker reads it through `ray.train.get_checkpoint()` as it reads `ds/`,
wherever the storage is; a second resume from the same checkpoint reuses it (`DONE` marks a
whole one).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

from raypack import storage

TAG = "ds_universal"
"""The converted state's folder in a checkpoint, beside DeepSpeed's own `ds/`."""
DONE = "raypack_converted"
"""Written last into TAG: a conversion cut short leaves none, and is done again."""


def partitions(ds_folder: str | Path) -> int:
    """The rank count the ZeRO partitions in `ds_folder` (a checkpoint's ds/) were cut for: one
    optimizer file a rank (`[bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt`); 0 where the
    optimizer state is not partitioned (ZeRO-0 without bf16: whole in the model states)."""
    return len(glob.glob(os.path.join(str(ds_folder), "*zero_pp_rank_*_optim_states.pt")))


def convert(checkpoint: str) -> str:
    """Write checkpoint/ds_universal from checkpoint/ds (a local folder or a URI); its path. A
    whole one already there is kept."""
    out = f"{checkpoint}/{TAG}"
    if storage.exists(f"{out}/{DONE}"):
        return out
    if storage.is_uri(checkpoint):
        with tempfile.TemporaryDirectory(prefix="raypack-universal-") as tmp:
            storage.download(f"{checkpoint}/ds", f"{tmp}/ds")
            _convert(Path(tmp) / "ds", Path(tmp) / TAG)
            storage.upload(f"{tmp}/{TAG}", out)
    else:
        storage.remove_dir(out)  # one cut short
        _convert(Path(checkpoint) / "ds", Path(out))
    storage.write_text(f"{out}/{DONE}", "")  # last: the folder is whole
    return out


def _convert(ds: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    # the arguments its command line would parse (ds_to_universal.parse_arguments), as attributes
    args = SimpleNamespace(input_folder=str(ds), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              # raypack's model sets no tensor/pipeline-parallel patterns: a plain
                              # data-parallel state, whose only required info is the format version
                              inject_missing_state=True)
    # It prints each phase and draws progress bars; raypack says what it did in one line.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)
    # `main` points a `latest_universal` file beside its output at it: raypack names the tag itself
    (out.parent / "latest_universal").unlink(missing_ok=True)
    shutil.rmtree(out / "tmp", ignore_errors=True)
