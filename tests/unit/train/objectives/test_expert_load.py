"""Expert load in the reports: busiest expert over the mean per layer, the worst layer, the window's
router loss, and the layers-by-experts heatmap in TensorBoard's event file."""

from __future__ import annotations

import io

import numpy as np
import pytest
from tensorboardX import SummaryWriter
from trackfiles import tensorboard_images, tensorboard_scalars

from raypack.train.objectives.expert_load import ExpertLoad, busiest_over_mean, heatmap, shares
from raypack.train.metrics import Reporter
from raypack.train.tracking import Trackers

EVEN = [25.0, 25.0, 25.0, 25.0]
COLLAPSED = [97.0, 1.0, 1.0, 1.0]


def test_busiest_over_mean_and_shares():
    load = np.array([EVEN, COLLAPSED, [0.0] * 4])
    assert busiest_over_mean(load).tolist() == [1.0, 3.88, 1.0]  # an empty layer reads as even
    assert shares(load)[1].tolist() == [0.97, 0.01, 0.01, 0.01] and shares(load)[2].sum() == 0


@pytest.mark.parametrize("experts,top_k", [(4, 2), (8, 2), (128, 8), (4, 1)])
def test_the_figure_tops_out_at_e_over_k_as_moe_md_says(experts, top_k):
    """Top-k routing counts each token for k experts: one expert taking every token (the rest
    spread evenly) reads E/k, not E; the MoE guide says so."""
    from paths import REPO

    tokens = 1000
    load = np.zeros((1, experts))
    for t in range(tokens):  # expert 0, then top_k - 1 others in turn
        load[0, 0] += 1
        for j in range(top_k - 1):
            load[0, 1 + (t * (top_k - 1) + j) % (experts - 1)] += 1
    assert busiest_over_mean(load)[0] == pytest.approx(experts / top_k)
    guide = " ".join((REPO / "docs" / "guides" / "moe.md").read_text().split())
    assert "the ceiling is E/k, reached when one expert takes every token" in guide
    assert "E means one expert takes every token" not in guide


def test_heatmap_cells_and_colours():
    image = heatmap(np.array([EVEN, COLLAPSED]))
    assert image.shape == (16, 32, 3) and image.dtype == np.uint8
    even, hot, cold = image[0, 0], image[8, 0], image[8, 8]
    assert (image[:8] == even).all()  # an even layer is one colour
    # even: viridis' middle; twice the even share or more: its bright end; 1% of the tokens: near its dark end
    assert tuple(even) == (33, 145, 140) and tuple(hot) == (253, 231, 37) and tuple(cold) == (67, 7, 88)
    assert heatmap(np.ones((3, 1000))).shape == (6, 2000, 3)  # wide models: smaller cells


def step(n, load, aux, units):
    return {"tokens": 10.0, "label_tokens": 8.0, "loss": 1.0, "lr": 1e-3, "data_wait_s": 0.0, "step_time_s": 0.1,
            "busy_s": 0.1, "router_aux_loss": aux, "router_units": units, "router_load": np.asarray(load)}


def test_a_report_carries_the_router_metrics_and_the_heatmap(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    reporter = Reporter(rank=1, total_steps=10, report_every=2, static={}, trackers=Trackers(writer),
                        experts=ExpertLoad(layers=2, experts=4))
    for n, (aux, units) in enumerate(((2.0, 3.0), (4.0, 1.0)), start=1):
        reporter.log_step(n, step(n, [EVEN, COLLAPSED], aux, units))
    metrics = reporter.summary(2, 0)
    writer.close()
    assert metrics["router_aux_loss"] == pytest.approx((2.0 * 3 + 4.0 * 1) / 4)  # weighted by units
    assert metrics["expert_load_worst_layer"] == 1 and metrics["expert_load_max"] == pytest.approx(3.88)
    assert not any(k.startswith("expert_load/") for k in metrics)  # per layer: trackers only
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["train/router_aux_loss"] == {1: 2.0, 2: 4.0}
    assert scalars["train/expert_load/layer_0"] == {2: 1.0}
    assert scalars["train/expert_load/layer_1"][2] == pytest.approx(3.88)
    height, width, png = tensorboard_images(tmp_path)["train/expert_load"][2]
    assert (height, width) == (16, 32) and png[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).tolist() == heatmap(
        np.array([EVEN, COLLAPSED]) * 2).tolist()


def test_a_window_of_skipped_steps_has_no_router_values():
    reporter = Reporter(rank=1, total_steps=10, report_every=1, static={}, experts=ExpertLoad(2, 4))
    reporter.log_step(1, {k: v for k, v in step(1, [EVEN, EVEN], 1.0, 1.0).items()
                          if not k.startswith("router_")} | {"label_tokens": 0.0})
    metrics = reporter.summary(1, 0)
    assert metrics["router_aux_loss"] is None and metrics["expert_load_max"] is None
