"""The vision tower in `balanced`'s plan: the per-rank spread of tower work before (patches not
weighed, the plan before raypack/data/tower.py) and after (each example's tower FLOPs counted into
its linear work and attention cost), with the token and attention balance and the efficiency.

    python benchmarks/tower_balance.py                         # the bundled sample and a synthetic set
    python benchmarks/tower_balance.py --out benchmarks/results/tower_balance_cpu_<date>.md
    python benchmarks/tower_balance.py --smoke                 # 2k synthetic examples: proves the script runs

Data:
- `sample`: the bundled vision sample (raypack/assets/vision_sample/vision.jsonl), tokenized by
  the bundled processor (raypack's own ImageTokenizer), as vlm_quickstart.yaml plans it (budget
  256, 2 ranks) and at 4 ranks.
- `synthetic`: image-heavy examples: 85% with 1-4 images of 8-64 x 8-64 patches (dynamic
  resolution; image tokens = patches / 4), text of 20-1500 tokens (log-uniform), budget 8192, 8
  and 64 ranks.

Models: `tiny-qwen2_5_vl` (the quickstart's) and a Qwen2.5-VL-7B-shaped config (text 3584 x 28
layers, vision 1280 x 32 blocks with 4 full-attention ones; built from a config, nothing
downloaded). A model gives the weights (a patch as a share of a token, an image's patches² as a
share of a length²) and the FLOPs the figures count.

Figures (Σ over steps of the busiest rank / of the mean rank, raypack/data/stats.py): `tok` and
`attn` the plan's own (real tokens, Σ len²), `tower` the tower's training FLOPs, `total` the
language model's and the tower's FLOPs together (what a step's wall time follows); `eff` the
packing efficiency.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.common import cpu_header, host_now, write_results
from raypack.config import ASSETS, PackConfig
from raypack.data.strategies import make_plan
from raypack.data.tower import TowerCost, tower_stats


def sample_data() -> tuple[np.ndarray, np.ndarray]:
    """(lengths, work) of the bundled sample, tokenized as its pipeline does."""
    from transformers import AutoImageProcessor

    from raypack.data.encode import load_tokenizer
    from raypack.data.images import ImageTokenizer

    folder = ASSETS / "vlm_processor"
    tok = ImageTokenizer(AutoImageProcessor.from_pretrained(folder), load_tokenizer(str(folder)))
    data = ASSETS / "vision_sample" / "vision.jsonl"
    lengths, work = [], []
    for i, line in enumerate(data.read_text().splitlines()):
        out = tok(json.loads(line), f"{data}:{i + 1}", data.parent)
        p = np.prod(np.asarray(out["image_grid_thw"]).reshape(-1, 3), axis=1)
        lengths.append(out["length"])
        work.append((p.sum(), (p * p).sum()))
    return np.asarray(lengths), np.asarray(work, np.float64)


def synthetic_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    text = np.exp(rng.uniform(np.log(20), np.log(1500), n)).astype(np.int64)
    images = np.where(rng.random(n) < 0.85, rng.integers(1, 5, n), 0)
    lengths, work = text.copy(), np.zeros((n, 2))
    for i in np.flatnonzero(images):
        h, w = rng.integers(4, 33, (2, images[i])) * 2  # patches a side, even (2x2 merge)
        p = (h * w).astype(np.float64)
        lengths[i] += int((p // 4).sum()) + 2 * images[i]  # image tokens, vision start/end
        work[i] = p.sum(), (p * p).sum()
    keep = lengths <= 8192
    return lengths[keep], work[keep]


def model_costs() -> dict[str, TowerCost]:
    from transformers import Qwen2_5_VLConfig

    from raypack.model.build import model_config
    from raypack.train.memory.estimate import tower_cost

    seven_b = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064,
                         rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]))  # fmt: skip
    return {"tiny-qwen2_5_vl": tower_cost(model_config("tiny-qwen2_5_vl")), "qwen2_5_vl-7b-shape": tower_cost(seven_b)}


def figures(lengths, work, cost: TowerCost, budget: int, ranks: int, weighed: bool) -> dict[str, float]:
    plan = make_plan(lengths, PackConfig(strategy="balanced", budget=budget), ranks,
                     extra=cost.extra(work) if weighed else None)  # fmt: skip
    stats = plan.stats()
    tower = tower_stats(plan, cost, work, lengths)
    return {"eff": stats["efficiency"], "tok": stats["token_imbalance"], "attn": stats["attention_imbalance"],
            "tower": tower["tower_imbalance"], "tower_worst": tower["tower_imbalance_worst"], "total": tower["work_imbalance"],
            "steps": plan.num_steps}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--examples", type=int, default=50_000)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    started = host_now()
    sets = [("synthetic", *synthetic_data(2000 if args.smoke else args.examples), 8192, (8, 64))]
    if not args.smoke:
        sets.insert(0, ("sample", *sample_data(), 256, (2, 4)))
    lines = ["| data | model | w patch | w patch² | ranks | steps | eff before/after | tok | attn | tower | tower worst step | total |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, lengths, work, budget, all_ranks in sets:
        for model, cost in model_costs().items():
            for ranks in all_ranks:
                b, a = (figures(lengths, work, cost, budget, ranks, w) for w in (False, True))
                lines.append(
                    f"| {name} ({len(lengths)}, {int(lengths.sum())} tokens, {int(work[:, 0].sum())} patches) | {model} | "
                    f"{cost.linear_weight:.3g} | {cost.attention_weight:.3g} | {ranks} | {a['steps']} | "
                    f"{b['eff']:.4f} / {a['eff']:.4f} | {b['tok']:.4f} / {a['tok']:.4f} | {b['attn']:.4f} / {a['attn']:.4f} | "
                    f"**{b['tower']:.4f} / {a['tower']:.4f}** | {b['tower_worst']:.2f} / {a['tower_worst']:.2f} | "
                    f"{b['total']:.4f} / {a['total']:.4f} |")  # fmt: skip
                print(lines[-1], flush=True)
    header = cpu_header("The vision tower in balanced's plan: before / after weighing patches", __file__, argv,
                        args.smoke, started, ("numpy", "transformers"),
                        "Each cell is before / after: `balanced` without and with the tower weighed (the script's docstring).")
    write_results("tower_balance", args.smoke, args.out, [*header, "", *lines, ""])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
