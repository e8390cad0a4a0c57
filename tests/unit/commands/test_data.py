"""`raypack data` on small data: tokenized in this process, as `raypack train` prepares it
(data.driver_max_mb), with no Ray started and nothing on the screen but the summary."""

from __future__ import annotations

import pytest
import ray

from raypack.cli import main

from paths import REPO


def test_the_quickstarts_data_is_summarized_without_ray(monkeypatch, capsys):
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # another test's Ray may be up
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["data", "--config", str(REPO / "jobs" / "configs" / "quickstart.yaml")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == "examples   300 in (chat 300), 300 out", out
    assert [line.split()[0] for line in lines] == ["examples", "tokens", "length", "over", "no", "bad", "lost"], out
