"""The supported-models table (raypack/model/families.py, its rows in raypack/model/family_table.py),
as the tests import it: every family raypack is tried on, as a tiny config in the layouts its
published checkpoints use; the rows of tests/unit/model/test_families.py (exact on packed rows, or
refused), of the sequence-parallel checks (tests/unit/model/test_ulysses.py) and of every other
test parametrized by family.

To check a family a newer transformers adds: add a row to raypack/model/family_table.py.
"""

from __future__ import annotations

from raypack.model.families import COMMON, TOLERANCE, Family, exact, modes, with_routers  # noqa: F401
from raypack.model.family_table import (  # noqa: F401
    DSA, FAMILIES, GDN, HYBRID, INDEXER, KDA, MAMBA2, MAMBA2_BAMBA, MAMBA2_ZAMBA, MLA, MOE, WINDOW,
)
