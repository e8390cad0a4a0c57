"""Make the bundled vision-language assets: a tiny processor and a small image sample.

    python tools/make_vlm_sample.py       # rewrites raypack/assets/{vlm,llava,idefics3}_processor/, vision_sample/

Nothing may come from a model hub, so the processor is the bundled tokenizer (tools/make_tokenizer.py)
plus Qwen's image tokens and a chat template that renders image parts, and a Qwen2-VL image
processor sized for a tiny tower (4-pixel patches, 2x2 merge, at most 32x32 pixels). The LLaVA
processor is the same tokenizer (its files linked, not copied: the GPU kit's size is tight) and a
LlavaProcessor's settings with a CLIP image processor of 16x16 pictures (4-pixel patches, CLS
dropped: 16 image tokens a picture, rendered as <|image_pad|>), all in processor_config.json. The
Idefics3 processor links the same tokenizer (which holds Idefics3's <image> and fake tokens too)
beside its own template and tiles of 16 pixels from pictures of up to 32 (4 image tokens a tile). The sample is
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
from transformers import LlavaProcessor
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
"""Idefics3's image tokens (Idefics3Processor adds them to its tokenizer): in the one tokenizer
all three processors share, so the LLaVA and Idefics3 folders link its files, not copy them."""
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
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS + IDEFICS3_TOKENS},
                           replace_extra_special_tokens=False)  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    if out.exists():
        shutil.rmtree(out)
    tok.save_pretrained(out)
    image_processor().save_pretrained(out)


def make_llava_processor(out: Path, tokenizer_folder: Path) -> None:
    """processor_config.json (LlavaProcessor's settings and its CLIP image processor) beside links
    to `tokenizer_folder`'s tokenizer files."""
    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    pictures = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(image_processor=pictures, tokenizer=tok, patch_size=4, image_token="<|image_pad|>",
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)  # fmt: skip
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    processor.image_processor.save_pretrained(out)  # processor_config.json alone needs the processor class to read
    settings = json.loads((out / "preprocessor_config.json").read_text())
    (out / "preprocessor_config.json").unlink()
    config = {"image_processor": settings, "image_token": processor.image_token, "patch_size": processor.patch_size,
              "num_additional_image_tokens": processor.num_additional_image_tokens,
              "vision_feature_select_strategy": processor.vision_feature_select_strategy,
              "processor_class": "LlavaProcessor"}  # fmt: skip
    (out / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).symlink_to(Path("..") / tokenizer_folder.name / name)


def make_idefics3_processor(out: Path, tokenizer_folder: Path) -> None:
    """An Idefics3 processor: processor_config.json (its image processor, splitting pictures of up
    to 32 pixels into 16x16 tiles plus the whole, 4 image tokens a tile) and a template rendering
    each image as <image>, beside links to `tokenizer_folder`'s tokenizer files."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    template = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    tiles = Idefics3ImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 16})
    if out.exists():
        shutil.rmtree(out)
    Idefics3Processor(image_processor=tiles, tokenizer=tok, image_seq_len=4, chat_template=template).save_pretrained(out)
    if len(AutoTokenizer.from_pretrained(out)) != len(tok):
        raise RuntimeError("Idefics3Processor added tokens the shared tokenizer lacks")
    (out / "chat_template.jinja").write_text(template)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
        (out / name).symlink_to(Path("..") / tokenizer_folder.name / name)


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
    make_llava_processor(assets / "llava_processor", assets / "vlm_processor")
    make_idefics3_processor(assets / "idefics3_processor", assets / "vlm_processor")
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
