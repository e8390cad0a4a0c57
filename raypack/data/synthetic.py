"""Synthetic example lengths (and, built on them, examples) that follow real SFT corpora.

The packing work and the benchmarks need realistic length distributions at sizes no test can
download. Three shapes cover the cases the papers study:

- `flan`:     short with a wide spread (FLAN instructions: many tiny, some long)
- `orcamath`: longer and narrow (OrcaMath word problems with worked answers)
- `wildchat`: long-tailed multi-turn conversations

The parameters are lognormal fits chosen to match the shapes above, not measured corpora.
"""

from __future__ import annotations

import numpy as np

# (median tokens, lognormal sigma, min, max)
DISTRIBUTIONS: dict[str, tuple[float, float, int, int]] = {
    "flan": (180.0, 1.0, 8, 4096),
    "orcamath": (420.0, 0.3, 64, 2048),
    "wildchat": (700.0, 1.1, 16, 16384),
}


def sample_lengths(kind: str, n: int, seed: int = 0, max_length: int | None = None) -> np.ndarray:
    """`n` example lengths (int64) drawn from distribution `kind`, clipped to [min, max_length]."""
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {kind!r}; expected one of {', '.join(DISTRIBUTIONS)}")
    median, sigma, lo, hi = DISTRIBUTIONS[kind]
    hi = min(hi, max_length) if max_length else hi
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(median), sigma, size=n)
    return np.clip(np.rint(lengths), lo, hi).astype(np.int64)
