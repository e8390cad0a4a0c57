"""What tests/ray/train/test_loop.py's and test_matrix.py's Ray Train runs share: 2 ranks x 2
micro-batches of packed examples, and a fit of several cases over gloo."""

from __future__ import annotations

import json

import numpy as np

VOCAB = 97
# Examples (token lists) per rank per micro-batch: deliberately unequal in count and length.
rng = np.random.default_rng(0)
EXAMPLES = {
    0: [[rng.integers(1, VOCAB, 13), rng.integers(1, VOCAB, 5)], [rng.integers(1, VOCAB, 21)]],
    1: [[rng.integers(1, VOCAB, 3), rng.integers(1, VOCAB, 8), rng.integers(1, VOCAB, 11)], [rng.integers(1, VOCAB, 4)]],
}


def packed_row(examples):
    ids = np.concatenate(examples).tolist()
    return {
        "input_ids": ids,
        "labels": ids,
        "position_ids": np.concatenate([np.arange(len(e)) for e in examples]).tolist(),
        "num_tokens": len(ids),
        "example_ids": list(range(len(examples))),
    }


def fit_on_gloo(fn, tmp_path, name: str, workers: int, **config) -> None:
    """Run `fn` on `workers` Ray Train workers over gloo, with `config` plus a DeepSpeed preset
    (`preset`) that partitions even tiny parameters under ZeRO-3: it keeps those under 1e5 elements
    whole on every rank ("persistent"), and a threshold of 0 partitions the tiny head as a real
    model's would be."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    preset = tmp_path / "zero.json"
    preset.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    TorchTrainer(
        fn,
        train_loop_config={**config, "preset": str(preset)},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"{name}-{tmp_path.name}", storage_path=str(tmp_path / "runs")),
    ).fit()
