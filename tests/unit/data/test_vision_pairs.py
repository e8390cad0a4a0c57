"""raypack/data/vision_pairs.py: preference pairs whose prompt has images, read where the text is
read (both layouts, bad rows named by file and line), tokenized as the model's own processor
tokenizes each side (Qwen2VLProcessor over the bundled processor assets), each side carrying its
own copy of the prompt's image tokens, the images stored once a pair, the pair kept whole."""

from __future__ import annotations

import json

import numpy as np
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

from raypack.config import ASSETS
from raypack.data.encode import Encoder, counts, kept_rows
from raypack.data.listing import list_sources, read_units
from raypack.data.sources import read_unit

PROCESSOR = ASSETS / "vlm_processor"
SAMPLE = ASSETS / "vision_sample"
PAIRS = SAMPLE / "preference.jsonl"


def _read(path) -> list[dict]:
    units = read_units(list_sources((str(path),)))
    return [r for u in units for r in read_unit({k: [u[k]] for k in u}, "auto").to_pylist()]


def _encode(path, max_length: int = 4096, overlength: str = "truncate"):
    unit = read_units(list_sources((str(path),)))[0]
    table = read_unit({k: [unit[k]] for k in unit}, "auto").drop_columns(["error", "fatal"])
    return Encoder(str(PROCESSOR), None, "auto", overlength, max_length).encode_table(table)


def _write(path, *records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_each_side_tokenizes_as_the_models_processor_and_counts_its_image_tokens(monkeypatch):
    """Each sequence (prompt + chosen, prompt + rejected) is what Qwen2VLProcessor gives the
    conversation with its pictures; the completion starts after the processor's prompt with the
    generation prompt; no image token carries a label; each length counts its image tokens; the
    images are stored once, on the chosen row, and the counts see both sides' image tokens."""
    from PIL import Image

    image_processor, tokenizer = AutoImageProcessor.from_pretrained(PROCESSOR), AutoTokenizer.from_pretrained(PROCESSOR)
    # as tests/unit/data/test_images.py: without torchvision the processor can't check its video processor's class
    monkeypatch.setattr(Qwen2VLProcessor, "check_argument_for_proper_class", lambda *args: None)
    reference = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                 chat_template=tokenizer.chat_template)  # fmt: skip
    table = _encode(PAIRS)
    rows = kept_rows(table).sort_by("example_id").to_pylist()
    records = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    assert len(rows) == 2 * len(records)
    for k, rec in enumerate(records[:6]):
        chosen, rejected = rows[2 * k], rows[2 * k + 1]
        names = rec.get("images") or [p["image"] for p in rec["prompt"][0]["content"] if p["type"] == "image"]
        question = rec["prompt"][0]["content"]
        question = question.replace("<image>", "") if isinstance(question, str) else question[1]["text"]
        prompt = [{"role": "user", "content": [{"type": "image", "image": Image.open(SAMPLE / n).convert("RGB")}
                                               for n in names] + [{"type": "text", "text": question}]}]  # fmt: skip
        start = len(reference.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)[0])
        for row, key in ((chosen, "chosen"), (rejected, "rejected")):
            ref = reference.apply_chat_template(prompt + rec[key], tokenize=True, return_dict=True, return_tensors="np")
            ids = ref["input_ids"][0].tolist()
            assert row["input_ids"] == ids and row["length"] == len(ids)
            assert row["labels"] == [-100] * start + ids[start:]
            image = np.flatnonzero(ref["mm_token_type_ids"][0])
            assert len(image) and image.max() < start  # the image tokens are the prompt's, in both sides
        assert chosen["images"] == [(SAMPLE / n).read_bytes() for n in names] and rejected["images"] is None
        assert chosen["image_grid_thw"] == rejected["image_grid_thw"] == ref["image_grid_thw"].reshape(-1).tolist()
    got = counts(table)
    per_pair = table["_image_tokens"].to_numpy()
    assert got["images"] == len(records) and got["image_tokens"] == per_pair.sum() > 0
    assert (per_pair[0::2] == per_pair[1::2]).all()  # each side counts its own copy


def test_both_layouts_and_an_implicit_prompt_read_the_same_pair(tmp_path):
    picture = str(SAMPLE / "images" / "000.png")
    answers = {"chosen": [{"role": "assistant", "content": "A circle."}],
               "rejected": [{"role": "assistant", "content": "A square."}]}  # fmt: skip
    question = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "What?"}]}]
    path = _write(tmp_path / "p.jsonl",
                  {"prompt": question, **answers},
                  {"prompt": [{"role": "user", "content": "<image>What?"}], **answers, "images": [picture]},
                  {"chosen": question + answers["chosen"], "rejected": question + answers["rejected"]})
    rows = _read(path)
    assert all(r["format"] == "vision_preference" and r["error"] is None for r in rows)
    assert rows[0]["vision_messages"] == rows[1]["vision_messages"] == rows[2]["vision_messages"]
    assert rows[0]["images"] == rows[1]["images"] == rows[2]["images"] == [(SAMPLE / "images" / "000.png").read_bytes()]


def test_bad_image_pairs_name_the_file_and_line(tmp_path):
    png = (SAMPLE / "images" / "000.png").read_bytes()
    (tmp_path / "ok.png").write_bytes(png)
    (tmp_path / "bad.png").write_bytes(png[:40])
    answers = {"chosen": [{"role": "assistant", "content": "A."}], "rejected": [{"role": "assistant", "content": "B."}]}
    good = {"prompt": [{"role": "user", "content": "<image>What?"}], **answers, "images": ["ok.png"]}
    bad = {
        "missing image": {**good, "images": ["nowhere.png"]},
        "placeholders": {**good, "images": ["ok.png", "ok.png"]},
        "undecodable": {**good, "images": ["bad.png"]},
        "image in an answer": {**good, "chosen": [{"role": "assistant", "content": "<image>A."}]},
        "image part in an answer": {**good, "images": None, "prompt": [{"role": "user", "content": "What?"}],
                                    "rejected": [{"role": "assistant", "content": [{"type": "image", "image": "ok.png"}]}]},
        "standard format": {"prompt": "<image>What?", "chosen": "A.", "rejected": "B.", "images": ["ok.png"]},
    }
    path = _write(tmp_path / "pairs.jsonl", good, *bad.values())
    rows = _read(path)
    assert rows[0]["error"] is None
    expected = {
        "missing image": "image 'nowhere.png' can't be read: no such file",
        "placeholders": "1 <image> placeholder(s) in messages but 2 image(s) in 'images'",
        "undecodable": "image 'bad.png' is not a decodable image",
        "image in an answer": "an image in `chosen`: a preference pair's images belong to its prompt",
        "image part in an answer": "an image in `rejected`: a preference pair's images belong to its prompt",
        "standard format": "a preference pair with images takes `prompt` as a list of chat messages",
    }
    for line, (case, row) in enumerate(zip(bad, rows[1:]), start=2):
        assert row["error"] is not None and row["error"].startswith(f"{path} line {line}: "), case
        assert expected[case] in row["error"], (case, row["error"])


def test_an_image_pair_over_the_length_limit_is_dropped_whole_never_cut():
    """truncate cuts a text pair's prompt first; an image pair's prompt holds the image tokens its
    pixels count, so it is dropped, both rows, under every policy."""
    lengths = kept_rows(_encode(PAIRS))["length"].to_numpy()
    limit = int((lengths[0::2] + lengths[1::2]).min())  # only the shortest pairs fit
    for overlength in ("truncate", "drop"):
        table = _encode(PAIRS, max_length=limit, overlength=overlength)
        kept = kept_rows(table)
        assert 0 < kept.num_rows < len(lengths) and kept.num_rows % 2 == 0
        assert (kept["length"].to_numpy()[0::2] + kept["length"].to_numpy()[1::2] <= limit).all()
        assert counts(table)["truncated"] == 0 and counts(table)["dropped"] == (len(lengths) - kept.num_rows) // 2
