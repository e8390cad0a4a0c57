"""Bytes per image example: encoded (what the source holds) against processed (float32 patches).

    PYTHONPATH=. python benchmarks/vision_bytes.py [--smoke] [--out FILE]

Decides what prepared image examples store (raypack/data/images.py). Two cases:
- the bundled sample (raypack/assets/vision_sample/vision.jsonl) under the bundled tiny processor;
- synthetic photos (smooth gradients, shapes and noise, JPEG quality 90) at common sizes under
  Qwen2.5-VL's released image-processor settings (14-pixel patches, temporal patch 2, merge 2,
  min_pixels 3136, max_pixels 12845056), and with max_pixels capped at 1003520 (1280 tokens).
Also times the processing, which storing encoded bytes repeats in the collate.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from benchmarks.common import REPO, cpu_header, host_now, write_results

SAMPLE = REPO / "raypack" / "assets" / "vision_sample"


def photo(w: int, h: int, seed: int) -> bytes:
    """A photo-like JPEG: gradients, a few shapes, sensor-like noise (compresses like a photo, roughly)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    base = np.stack([120 + 80 * np.sin(3 * x + c) * np.cos(2 * y - c) for c in range(3)], -1)
    im = Image.fromarray(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(im)
    for _ in range(12):
        x0, y0 = rng.integers(0, w), rng.integers(0, h)
        d.ellipse((x0, y0, x0 + rng.integers(20, w // 3), y0 + rng.integers(20, h // 3)),
                  fill=tuple(int(v) for v in rng.integers(0, 255, 3)))  # fmt: skip
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def measure(processor, blobs: list[bytes]) -> tuple[float, float, float, float]:
    """Mean encoded bytes, processed float32 bytes, image tokens and ms to decode+process, per image."""
    t0 = time.perf_counter()
    processed, tokens = 0, 0
    for b in blobs:
        out = processor(images=[Image.open(io.BytesIO(b)).convert("RGB")], return_tensors="np")
        processed += out["pixel_values"].astype(np.float32).nbytes
        tokens += int(np.prod(out["image_grid_thw"][0])) // processor.merge_size**2
    ms = (time.perf_counter() - t0) * 1000 / len(blobs)
    n = len(blobs)
    return sum(map(len, blobs)) / n, processed / n, tokens / n, ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one photo size, one photo: proves the script works")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = host_now()
    rows = []
    sample = [json.loads(line) for line in (SAMPLE / "vision.jsonl").read_text().splitlines()]
    blobs = [(SAMPLE / r["messages"][0]["content"][0]["image"]).read_bytes() for r in sample]
    tiny = Qwen2VLImageProcessorPil.from_pretrained(REPO / "raypack" / "assets" / "vlm_processor")
    rows.append(("bundled sample, tiny processor", "16-32 px PNG", *measure(tiny, blobs)))
    qwen = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
    for cap, label in ((12845056, "Qwen2.5-VL default"), (1003520, "max_pixels 1003520")):
        proc = Qwen2VLImageProcessorPil(**qwen, size={"shortest_edge": 3136, "longest_edge": cap})
        for w, h in ((640, 480),) if args.smoke else ((640, 480), (1280, 960)):
            photos = [photo(w, h, s) for s in range(1 if args.smoke else 4)]
            rows.append((label, f"{w}x{h} JPEG q90", *measure(proc, photos)))
    lines = ["| processor | images | encoded bytes | processed float32 bytes | ratio | image tokens | decode+process ms |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, what, enc, proc_bytes, tokens, ms in rows:
        lines.append(f"| {label} | {what} | {enc:,.0f} | {proc_bytes:,.0f} | {proc_bytes / enc:.1f}x | {tokens:,.0f} | {ms:.1f} |")
    header = cpu_header("Bytes per image example: encoded against processed", __file__, argv, args.smoke, started,
                        ("PIL", "transformers"))  # fmt: skip
    write_results("vision_bytes", args.smoke, args.out, [*header, "", *lines])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
