"""raypack/data/prepare.py's checks that need no Ray (the stage itself: tests/ray/data/test_prepare.py)."""

from __future__ import annotations

import numpy as np
import pytest

from raypack.data.prepare import check_every_pack_sees_images
from raypack.data.strategies import get_strategy
from raypack.errors import InputError


def test_zero3_needs_an_image_in_every_micro_batch():
    """Under ZeRO-3 a micro-batch without an image would skip the vision tower that every other
    rank gathers: refused naming it; accepted when every (rank, step) sees one."""
    lengths = np.array([40, 41, 42, 43, 44, 45, 46, 47])
    ids = np.arange(8) * 1024
    plan = get_strategy("pad", budget=64, batch_size=1, seed=0).plan(lengths, num_ranks=2)
    check_every_pack_sees_images(plan, ids, ids, "train")  # every example has an image
    text_only = ids[plan.example[plan.pack == 3]]  # rank 1's micro-batch at step 1
    with pytest.raises(InputError, match=r"zero_stage=3: the train micro-batch of rank 1 at step 1 holds no image"):
        check_every_pack_sees_images(plan, ids, np.setdiff1d(ids, text_only), "train")


@pytest.mark.parametrize("overrides, vision_model, match", [
    (["model.name=tiny-llama"], False, r"model.name 'tiny-llama' trains as a text-only model .*: it would train without"),
    (["pack.strategy=wrapped"], True, r"pack.strategy=wrapped splits examples across rows"),
    (["train.num_workers=4", "train.sequence_parallel=2"], True, r"train.sequence_parallel=2 doesn't carry images"),
])  # fmt: skip
def test_image_rows_that_would_not_train_with_their_pictures_are_refused(overrides, vision_model, match):
    from paths import REPO

    from raypack.config import load
    from raypack.data.prepare import check_images_trainable

    config = str(REPO / "jobs" / "configs" / "vlm_quickstart.yaml")
    stats = {"images": 3, "formats": {"vision": 3}}
    with pytest.raises(InputError, match=match):
        check_images_trainable(load(config, overrides), stats, vision_model=vision_model)
    check_images_trainable(load(config), stats, vision_model=True)  # the quickstart itself passes


def test_image_pairs_for_a_text_model_are_refused():
    """DPO with image prompts on a model without a vision tower would train without the pictures."""
    from paths import REPO

    from raypack.config import load
    from raypack.data.prepare import check_images_trainable

    config = str(REPO / "jobs" / "configs" / "vlm_dpo_quickstart.yaml")
    stats = {"images": 3, "formats": {"vision_preference": 3}}
    with pytest.raises(InputError, match=r"3 images in 3 preference rows, but model.name 'tiny-llama' trains as a text"):
        check_images_trainable(load(config, ["model.name=tiny-llama"]), stats, vision_model=False)
    check_images_trainable(load(config), stats, vision_model=True)
