"""Starting a run, the parts that need no Ray: when a run is already complete, and which worker
errors end it."""

from __future__ import annotations

import json
import types

from raypack.config import load
from raypack.runs import RESULT
from raypack.train.trainer import _finished


def test_a_finished_run_is_known_by_its_steps(tmp_path):
    cfg = load(None, ["train.grad_accum=2", "train.epochs=1"])
    prepared = types.SimpleNamespace(total_steps=lambda accum, epochs, max_steps: 10 // accum * epochs)

    def checked(cfg, prepared=prepared):
        return types.SimpleNamespace(cfg=cfg, prepared=prepared)

    assert _finished(str(tmp_path), checked(cfg)) is None  # never finished
    (tmp_path / RESULT).write_text(json.dumps({"step": 5, "metrics": {}}))
    assert _finished(str(tmp_path), checked(cfg))["step"] == 5
    more = load(None, ["train.grad_accum=2", "train.epochs=2"])  # asks for 10 steps: train on
    assert _finished(str(tmp_path), checked(more)) is None
    assert _finished(str(tmp_path), checked(cfg, None)) is None  # data not packed yet
    # finished after a resize: its packed data is for another worker count, so no plan counts the
    # steps; the epochs and step cap it finished under say whether more is asked
    (tmp_path / RESULT).write_text(json.dumps({"step": 5, "metrics": {}, "ran": {"epochs": 1, "max_steps": None}}))
    assert _finished(str(tmp_path), checked(cfg, None))["step"] == 5
    assert _finished(str(tmp_path), checked(more, None)) is None
    assert _finished(str(tmp_path), checked(load(None, ["train.max_steps=4"]), None))["step"] == 5
    assert _finished(str(tmp_path), checked(load(None, ["train.max_steps=9"]), None)) is None


def test_a_run_whose_packed_data_another_version_keyed_is_refused_not_repacked(tmp_path):
    """Resume must not rewrite packed/ under a run's checkpoints. The same config keyed otherwise
    (another raypack version) is refused, and the folder is left as it was; a folder that is gone
    is packed again (the same config makes the same rows)."""
    import pytest

    from raypack.errors import InputError
    from raypack.runs import absolute_paths, run_dir, save_config
    from raypack.train.trainer import _check_same_data

    cfg = absolute_paths(load(None, [f"run.storage_path={tmp_path}", "run.name=r"]))
    save_config(cfg)
    root = run_dir(cfg)
    not_packed = types.SimpleNamespace(prepared=None)
    _check_same_data(cfg, root, not_packed)  # no packed/: made again
    manifest = tmp_path / "r" / "packed" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"fingerprint": "0123456789abcdef"}))
    with pytest.raises(InputError, match="packed data that another raypack version made"):
        _check_same_data(cfg, root, not_packed)
    assert json.loads(manifest.read_text()) == {"fingerprint": "0123456789abcdef"}
    with pytest.raises(InputError, match=r"would change \(pack.budget: 1024 there, 512 here"):
        _check_same_data(absolute_paths(load(None, [f"run.storage_path={tmp_path}", "run.name=r", "pack.budget=512"])),
                         root, not_packed)


def test_settings_that_shape_no_row_leave_the_data_keys_alone():
    from raypack.data.cache import packed_key, tokenized_key

    base = load(None)
    for override in ("data.max_dropped_fraction=0.9", "data.cache_path=/tmp/c", "tokenize.num_actors=4",
                     "model.peft.method=lora", "train.lr=0.5"):
        other = load(None, [override])
        assert (tokenized_key(other), packed_key(other, 2)) == (tokenized_key(base), packed_key(base, 2)), override
    assert packed_key(load(None, ["data.eval_fraction=0.2"]), 2) != packed_key(base, 2)


def test_an_error_about_the_input_or_the_environment_stops_the_run_and_its_traceback_is_not_logged():
    """What a worker raised, as the controller's callback sees it: an InputError (a tracker that
    can't start, a model that can't pack) or an ImportError (a package missing on a node) ends the
    run at once, not retried, and Ray Train's log of its traceback is left out (the command prints
    the cause as its one line); a crash is left to Ray Train's restarts."""
    import logging

    import pytest

    from raypack.errors import InputError
    from raypack.train.tracking import TrackingError
    from raypack.raycompat import CONTROLLER_LOGGER
    from raypack.train.remote import StopOnInputError, as_input_error

    callback = StopOnInputError()
    callback.after_exception(None, {0: RuntimeError("a crash"), 1: MemoryError()})  # retried: nothing raised
    assert as_input_error(RuntimeError("x")) is None
    with pytest.raises(TrackingError, match="W&B failed to start"):
        callback.after_exception(None, {0: RuntimeError("collateral"), 1: TrackingError("W&B failed to start")})
    missing = ModuleNotFoundError("No module named 'mlflow'", name="mlflow")
    with pytest.raises(InputError, match=r"a worker can't import mlflow \(No module named 'mlflow'\): install it on "
                                         "every node"):
        callback.after_exception(None, {0: missing})

    logger = logging.getLogger(CONTROLLER_LOGGER)
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        for error in (TrackingError("quiet"), RuntimeError("loud")):
            try:
                raise error
            except Exception:
                logger.exception("Error in control loop iteration: %s", error)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["Error in control loop iteration: loud"]
