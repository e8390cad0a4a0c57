"""The rest of an epoch (raypack/data/rest.py): which examples of the draw are left once the
step logs' are taken out, one occurrence each."""

from __future__ import annotations

import numpy as np
import pytest

from raypack.data.rest import untrained
from raypack.errors import InputError


def test_the_rest_leaves_out_one_occurrence_per_trained_id_and_keeps_everything_else():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, 200)  # a mixture's draw: some ids twice or more
    trained = rng.permutation(ids)[:120]
    keep = untrained(ids, trained)
    left, done = np.bincount(ids[keep], minlength=50), np.bincount(trained, minlength=50)
    assert (left + done == np.bincount(ids, minlength=50)).all()
    assert untrained(ids, np.zeros(0, np.int64)).all()
    assert not untrained(ids, ids).any()


def test_a_log_with_an_id_the_draw_lacks_is_refused():
    with pytest.raises(InputError, match="example 9 trained 1 times this epoch, but the data draws it 0 times"):
        untrained(np.array([5, 3]), np.array([9]))
    with pytest.raises(InputError, match="example 5 trained 2 times"):
        untrained(np.array([5, 3]), np.array([5, 5]))
