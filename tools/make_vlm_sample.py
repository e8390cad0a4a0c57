"""Make the bundled vision-language assets: a tiny processor and a small image sample.

    python tools/make_vlm_sample.py       # rewrites raypack/assets/vlm_processor/ and raypack/assets/vision_sample/

Nothing may come from a model hub, so the processor is the bundled tokenizer (tools/make_tokenizer.py)
plus Qwen's image tokens and a chat template that renders image parts, and a Qwen2-VL image
processor sized for a tiny tower (4-pixel patches, 2x2 merge, at most 32x32 pixels). The sample is
a few dozen generated pictures (a coloured shape on a background, 16 to 32 pixels a side, PNG)
with a question and its answer each, in both layouts raypack reads (raypack/data/images.py), in
a folder of its own: the text sample's folder (raypack/assets/sample/) is read whole as text data.
`preference.jsonl` asks about the same pictures as preference pairs (DPO with image prompts:
raypack/data/vision_pairs.py): the right answer chosen, one naming another colour or shape
rejected, the rows alternating between the two layouts.
Deterministic: the same seed gives the same files. Prints the bytes per example stored encoded
(PNG) against processed (float32 patches), the measurement behind storing encoded images.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import sys
from pathlib import Path

from PIL import Image, ImageDraw
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# Like the bundled template, with content as text or a list of parts; each image renders as
# Qwen's start, pad and end tokens, and {% generation %} marks what the assistant writes.
CHAT_TEMPLATE = (
    r"{{ bos_token }}{% for message in messages %}"
    r"{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    r"{% else %}{% set parts = message['content'] %}{% endif %}"
    r"{{ '<|' + message['role'] + '|>\n' }}"
    r"{% if message['role'] == 'assistant' %}{% generation %}{% for p in parts %}{{ p['text'] }}{% endfor %}"
    r"{{ '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    r"{% else %}{% for p in parts %}{% if p['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    r"{% else %}{{ p['text'] }}{% endif %}{% endfor %}{{ '<|end|>\n' }}{% endif %}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "triangle")


def image_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=1, merge_size=2,
                                    size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32})  # fmt: skip


def make_processor(out: Path) -> None:
    tok = AutoTokenizer.from_pretrained(REPO / "raypack" / "assets" / "tokenizer")
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    tok.chat_template = CHAT_TEMPLATE
    if out.exists():
        shutil.rmtree(out)
    tok.save_pretrained(out)
    image_processor().save_pretrained(out)


def picture(rng: random.Random) -> tuple[Image.Image, str, str]:
    w, h = rng.choice([16, 24, 32]), rng.choice([16, 24, 32])
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    im = Image.new("RGB", (w, h), (245, 245, 240))
    d = ImageDraw.Draw(im)
    box = (w // 5, h // 5, w - w // 5, h - h // 5)
    if shape == "square":
        d.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        d.ellipse(box, fill=COLOURS[colour])
    else:
        d.polygon([(w // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=COLOURS[colour])
    return im, colour, shape


def preference_rows(shown: list[tuple[str, str, str]], rng: random.Random) -> list[dict]:
    """A preference pair a picture: the question's right answer chosen, a wrong one rejected."""
    rows = []
    for i, (name, colour, shape) in enumerate(shown):
        other_colour = rng.choice([c for c in sorted(COLOURS) if c != colour])
        other_shape = rng.choice([s for s in SHAPES if s != shape])
        question, chosen, rejected = rng.choice([
            ("What colour is the shape?", f"It is {colour}.", f"It is {other_colour}."),
            ("What shape is this?", f"A {shape}.", f"A {other_shape}."),
            ("Describe the picture.", f"A {colour} {shape}.", f"A {other_colour} {other_shape}.")])  # fmt: skip
        answers = {"chosen": [{"role": "assistant", "content": chosen}],
                   "rejected": [{"role": "assistant", "content": rejected}]}  # fmt: skip
        if i % 2:
            rows.append({"prompt": [{"role": "user", "content": f"<image>{question}"}], **answers, "images": [name]})
        else:
            rows.append({"prompt": [{"role": "user", "content": [{"type": "image", "image": name},
                                                                 {"type": "text", "text": question}]}], **answers})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=36)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    assets = REPO / "raypack" / "assets"
    make_processor(assets / "vlm_processor")
    folder = assets / "vision_sample"
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "images").mkdir(parents=True)
    rng = random.Random(args.seed)
    parts, pairs, shown, encoded, processed = [], [], [], 0, 0
    proc = image_processor()
    for i in range(args.examples):
        im, colour, shape = picture(rng)
        name = f"images/{i:03d}.png"
        buf = io.BytesIO()
        im.save(buf, format="PNG", optimize=True)
        (folder / name).write_bytes(buf.getvalue())
        shown.append((name, colour, shape))
        encoded += len(buf.getvalue())
        processed += proc(images=[im], return_tensors="np")["pixel_values"].astype("float32").nbytes
        question, answer = rng.choice([("What colour is the shape?", f"It is {colour}."),
                                       ("What shape is this?", f"A {shape}."),
                                       ("Describe the picture.", f"A {colour} {shape}.")])  # fmt: skip
        parts.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer}]})  # fmt: skip
        pairs.append({"messages": [{"role": "user", "content": f"<image>{question}"},
                                   {"role": "assistant", "content": answer}], "images": [name]})  # fmt: skip
    preferences = preference_rows(shown, random.Random(args.seed + 1))  # its own generator: the rows above stay
    for fname, rows in (("vision.jsonl", parts), ("vision_pairs.jsonl", pairs), ("preference.jsonl", preferences)):
        with open(folder / fname, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    n = args.examples
    print(f"wrote {n} examples; bytes per example: encoded PNG {encoded / n:.0f}, processed float32 {processed / n:.0f} "
          f"({processed / encoded:.1f}x)")


if __name__ == "__main__":
    main()
