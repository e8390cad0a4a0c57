"""The sweep's three plots are PNGs, also when every trial failed, and say so on a CPU sweep."""

from __future__ import annotations

from raypack.tune import plots

from tests.unit.tune.test_report import ROWS

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_plot_is_a_png(tmp_path):
    assert plots.throughput_vs_loss(ROWS, tmp_path / "a.png", on_cpu=True).read_bytes()[:8] == PNG
    assert plots.learning_curves(ROWS, tmp_path / "b.png").read_bytes()[:8] == PNG
    assert plots.eval_vs_time(ROWS, tmp_path / "c.png", target=4.55).read_bytes()[:8] == PNG


def test_no_data_is_an_empty_plot_not_an_error(tmp_path):
    failed = [r for r in ROWS if r["status"] == "ERROR"]
    for draw in (plots.throughput_vs_loss, plots.learning_curves, plots.eval_vs_time):
        assert draw(failed, tmp_path / f"{draw.__name__}.png").stat().st_size > 0


def test_cpu_note_is_in_the_title(monkeypatch, tmp_path):
    titles = []
    real = plots._finish
    monkeypatch.setattr(plots, "_finish", lambda ax, title, on_cpu, **kw: (real(ax, title, on_cpu, **kw),
                                                                          titles.append(ax.get_title())))
    plots.throughput_vs_loss(ROWS, tmp_path / "cpu.png", on_cpu=True)
    plots.throughput_vs_loss(ROWS, tmp_path / "gpu.png", on_cpu=False)
    assert plots.CPU_NOTE in titles[0] and plots.CPU_NOTE not in titles[1]
