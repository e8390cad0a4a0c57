"""Host time a VLM micro-batch costs the worker: VisionRows decoding and processing its images
from their stored bytes (raypack/train/vision_rows.py), on 1 thread and on a pool, against the
step that runs beside it.

    PYTHONPATH=. python benchmarks/vision_host.py [--smoke] [--out FILE]

The prefetch thread builds the next step's micro-batches while the current step runs
(raypack/train/prefetch.py): host time per micro-batch above the step's time is a stall. Two rows:

- the bundled sample (raypack/assets/vision_sample) under the tiny processor, one packed row of
  the quickstart's budget (256 tokens), beside the tiny Qwen2.5-VL's forward and backward of the
  same micro-batch on this CPU (the step here);
- a 16k-token row of 640x480 photo-like JPEGs (benchmarks/vision_bytes.py's) under Qwen2.5-VL's
  released image-processor settings: 391 image tokens an image, 40 images of 391 tokens plus a
  little text each. No GPU step is measured here: what a 7B VLM's step on such a row takes on an
  H100 is arithmetic in the docs, not a measurement.

Each figure is the median of `--repeats` calls of the whole collate (pixels, positions, the
packed batch), after one warm-up call, the pool sizes taken in turn; beside the wall time, the
CPU time the process spent (all its threads): the work a micro-batch costs, which a pool spreads
over the cores it finds free.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, cpu_header, host_now, write_results  # noqa: E402

PROCESSOR = REPO / "raypack" / "assets" / "vlm_processor"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: the processor's first call
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def alternating(calls: dict, repeats: int) -> dict:
    """{key: (median wall ms, median CPU ms of this process)} of each call, the keys taken in
    turn `repeats` times (a shared machine's load then weighs on every pool size alike)."""
    for fn in calls.values():
        fn()  # warm-up: the pool's threads, the processor's first call
    wall, cpu = {k: [] for k in calls}, {k: [] for k in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]) * 1000, statistics.median(cpu[k]) * 1000) for k in calls}


def photo_row(rows, count: int, seed: int = 0):
    """`count` photo-like 640x480 JPEGs as one packed row of image examples for `rows` (a
    VisionRows whose tokenizer is swapped for Qwen2.5-VL's default processor): ids with each
    image's tokens, the grids stored as prepare stores them, position_ids restarting per example."""
    import numpy as np
    from PIL import Image

    from benchmarks.vision_bytes import photo

    from raypack.data.sources import example_id

    tok = rows.tokenize
    row = {"input_ids": [], "labels": [], "position_ids": [], "example_ids": []}
    images = {}
    rng = np.random.default_rng(seed)
    for i in range(count):
        eid = example_id(0, i)  # as the source stage numbers rows (piece 0: whole)
        blob = photo(640, 480, seed + i)
        pix = tok.pixels([Image.open(io.BytesIO(blob)).convert("RGB")])
        text = rng.integers(3, 500, 12).tolist()
        ids = text[:6] + [tok.pad_id] * sum(tok.layout.token_counts(pix)) + text[6:]
        row["input_ids"] += ids
        row["labels"] += [-100] * (len(ids) - 6) + text[6:]
        row["position_ids"] += list(range(len(ids)))
        row["example_ids"].append(eid)
        images[eid] = ([blob], [v for g in tok.layout.stored(pix) for v in g])
    row["num_tokens"] = len(row["input_ids"])
    return row, images


def sample_row(budget: int = 256):
    """The bundled sample's examples, tokenized as prepare tokenizes them, packed into one row of `budget`."""
    import json

    from raypack.data.sources import example_id
    from raypack.data.encode import load_image_tokenizer, load_tokenizer

    sample = REPO / "raypack" / "assets" / "vision_sample"
    tok = load_image_tokenizer(str(PROCESSOR), load_tokenizer(str(PROCESSOR)))
    row = {"input_ids": [], "labels": [], "position_ids": [], "example_ids": []}
    images = {}
    for i, line in enumerate((sample / "vision.jsonl").read_text().splitlines()):
        eid, record = example_id(0, i), json.loads(line)
        enc = tok(record, f"line {i + 1}", sample)
        if len(row["input_ids"]) + enc["length"] > budget:
            break
        row["input_ids"] += enc["input_ids"]
        row["labels"] += enc["labels"]
        row["position_ids"] += list(range(enc["length"]))
        row["example_ids"].append(eid)
        images[eid] = (enc["images"], [v for g in enc["image_grid_thw"] for v in g])
    row["num_tokens"] = len(row["input_ids"])
    return row, images


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="4 photos, one repeat: proves the script works")
    ap.add_argument("--threads", default="1,2", help="pool sizes to time (this machine has 2 cores)")
    ap.add_argument("--photos", type=int, default=40, help="photos in the long row")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = host_now()
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from raypack.data.images import ImageTokenizer
    from raypack.model.build import load_model
    from raypack.train.objectives.loss import make_loss
    from raypack.train.prefetch import prepare_step
    from raypack.train.vision_rows import VisionRows

    torch.manual_seed(0)
    threads = [int(t) for t in args.threads.split(",")]
    photos, repeats = (4, 1) if args.smoke else (args.photos, args.repeats)
    model = load_model("tiny-qwen2_5_vl", attention="auto", dtype="float32")
    lines = ["| row | tokens | images | threads | host ms per micro-batch (wall) | CPU ms | wall ms per image |",
             "|---|---|---|---|---|---|---|"]

    row, images = sample_row()
    pools = {n: VisionRows(model, images, str(PROCESSOR), workers=n) for n in threads}
    got = alternating({n: (lambda r=r: prepare_step([row], collate=r)) for n, r in pools.items()}, repeats)
    for n, (ms, cpu) in got.items():
        lines.append(f"| bundled sample, tiny processor | {len(row['input_ids'])} | {len(images)} | {n} | {ms:.1f} | "
                     f"{cpu:.1f} | {ms / len(images):.2f} |")
    step = prepare_step([row], collate=pools[threads[0]])
    loss = make_loss(model, "chunked")

    def forward_backward():
        model.zero_grad(set_to_none=True)
        batch = dict(step.batches[0])
        loss(model, batch).backward()

    step_ms = timed(forward_backward, repeats)

    qwen = Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 3136, "longest_edge": 12845056})
    base = VisionRows(model, {}, str(PROCESSOR), workers=1)
    base.tokenize = ImageTokenizer(qwen, base.tokenize.tokenizer)
    long_row, long_images = photo_row(base, photos)
    pools = {n: VisionRows(model, long_images, str(PROCESSOR), workers=n) for n in threads}
    for r in pools.values():
        r.tokenize = base.tokenize
    got = alternating({n: (lambda r=r: r([long_row])) for n, r in pools.items()}, repeats)
    for n, (ms, cpu) in got.items():
        lines.append(f"| 640x480 JPEG q90, Qwen2.5-VL default processor | {len(long_row['input_ids']):,} | {photos} | "
                     f"{n} | {ms:,.0f} | {cpu:,.0f} | {ms / photos:.1f} |")
    lines += ["", f"The tiny Qwen2.5-VL's forward and backward of the bundled sample's micro-batch on this CPU (torch "
                  f"threads {torch.get_num_threads()}): {step_ms:.1f} ms."]
    header = cpu_header("VLM host time per micro-batch: images decoded and processed, 1 thread and a pool", __file__,
                        argv, args.smoke, started, ("PIL", "torch", "transformers"))  # fmt: skip
    write_results("vision_host", args.smoke, args.out, [*header, "", *lines])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
