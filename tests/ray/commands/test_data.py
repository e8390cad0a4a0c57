"""`raypack data` through Ray Data (data larger than data.driver_max_mb, here 0): the same
summary as the driver's own path gives for the same rows."""

from __future__ import annotations

import pytest

from raypack.cli import main

from paths import REPO

pytestmark = pytest.mark.ray


def test_ray_datas_summary_is_the_drivers(ray_local, capsys):
    config = ["data", "--config", str(REPO / "jobs" / "configs" / "quickstart.yaml")]
    assert main(config) == 0
    here = capsys.readouterr().out
    assert main([*config, "data.driver_max_mb=0"]) == 0
    through_ray = capsys.readouterr().out
    assert through_ray.endswith(here) and here.startswith("examples   300 in"), (here, through_ray)
