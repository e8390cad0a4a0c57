"""raypack/data/images.py (and the processor layouts of raypack/data/image_layouts.py): both image
layouts read, bad images named by file and line, and the tokens, labels and pixels the same as
the model's own processor gives: Qwen2VLProcessor over the bundled Qwen processor, LlavaProcessor
over the bundled LLaVA one (CLIP pictures) and over a SigLIP one, Idefics3Processor over the
bundled Idefics3 one (tiles); processors without an exact data path (LLaVA-NeXT's and Pixtral's
image sizes, tiles without their image_seq_len) refused naming the trait."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

from raypack.config import ASSETS
from raypack.errors import InputError
from raypack.data.images import ImageError, ImageTokenizer, decode_image, image_messages, read_image_bytes

PROCESSOR = ASSETS / "vlm_processor"
SAMPLE = ASSETS / "vision_sample"


@pytest.fixture(scope="module")
def parts():
    image_processor, tokenizer = AutoImageProcessor.from_pretrained(PROCESSOR), AutoTokenizer.from_pretrained(PROCESSOR)
    return image_processor, tokenizer, ImageTokenizer(image_processor, tokenizer)


def _records(name):
    return [json.loads(line) for line in (SAMPLE / name).read_text().splitlines()]


def test_the_pil_image_processor_loads_without_torchvision(parts):
    image_processor, _, _ = parts
    assert type(image_processor).__name__ == "Qwen2VLImageProcessorPil"


def processor_encoding(processor, rec: dict) -> tuple[dict, list]:
    """What a model's own processor gives for the record `rec` (its chat template with the pictures,
    decoded, in the image parts), and the record's image sources."""
    messages, sources = image_messages(rec, "")
    pictures = iter(decode_image(read_image_bytes(s, SAMPLE, ""), s, "") for s in sources)
    for m in messages:
        for part in m["content"]:
            if part["type"] == "image":
                part["image"] = next(pictures)
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                         return_tensors="np"), sources  # fmt: skip


def test_tokens_labels_and_pixels_match_the_models_processor(parts, monkeypatch):
    image_processor, tokenizer, tokenize = parts
    # Without torchvision, transformers can't name the video-processor base class its processors
    # check their arguments against (VideoProcessorMixin isn't exported), so Qwen2VLProcessor
    # can't be built here at all; skip that check, nothing else, to use it as the reference.
    monkeypatch.setattr(Qwen2VLProcessor, "check_argument_for_proper_class", lambda *args: None)
    reference = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                 chat_template=tokenizer.chat_template)  # fmt: skip
    for i, rec in enumerate(_records("vision.jsonl")[:6]):
        ours = tokenize(rec, f"vision.jsonl:{i + 1}", base_dir=SAMPLE)
        ref, _ = processor_encoding(reference, rec)
        ids = ref["input_ids"][0]
        eos = tokenizer.eos_token_id  # raypack ends an example with EOS, trained after the assistant
        assert ours["input_ids"] == [*ids.tolist(), eos]
        assert ours["labels"] == [*np.where(ref["assistant_masks"][0] == 1, ids, -100).tolist(), eos]
        assert ours["length"] == len(ids) + 1 and ours["vision_patches"] == ref["pixel_values"].shape[0]
        pixels = tokenize.example_pixels(ours)
        assert np.array_equal(pixels["image_grid_thw"], ref["image_grid_thw"])
        assert np.array_equal(pixels["pixel_values"], ref["pixel_values"])
        image_tokens = (ref["mm_token_type_ids"][0] == 1).sum()
        assert image_tokens > 0 and all(ours["labels"][j] == -100 for j in np.flatnonzero(ref["mm_token_type_ids"][0]))


def test_both_layouts_give_the_same_example(parts):
    _, _, tokenize = parts
    for a, b in zip(_records("vision.jsonl")[:4], _records("vision_pairs.jsonl")[:4]):
        x, y = tokenize(a, "a", base_dir=SAMPLE), tokenize(b, "b", base_dir=SAMPLE)
        assert x["input_ids"] == y["input_ids"] and x["images"] == y["images"]


def _pair(content, images):
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}], "images": images}


def test_images_from_paths_uris_and_base64(parts):
    _, _, tokenize = parts
    png = (SAMPLE / "images/000.png").read_bytes()
    sources = [str(SAMPLE / "images/000.png"), (SAMPLE / "images/000.png").as_uri(),
               "data:image/png;base64," + base64.b64encode(png).decode(), base64.b64encode(png).decode()]  # fmt: skip
    for source in sources:
        assert tokenize(_pair("<image>hi", [source]), "x")["images"] == [png]


def test_bad_images_name_the_file_and_line(parts, tmp_path):
    _, _, tokenize = parts
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    with pytest.raises(ImageError, match=r"data.jsonl:3: image 'gone.png' can't be read: no such file"):
        tokenize(_pair("<image>hi", ["gone.png"]), "data.jsonl:3", base_dir=tmp_path)
    with pytest.raises(ImageError, match=r"data.jsonl:4: image 'broken.png' is not a decodable image"):
        tokenize(_pair("<image>hi", ["broken.png"]), "data.jsonl:4", base_dir=tmp_path)
    with pytest.raises(ImageError, match=r"data.jsonl:5: 2 <image> placeholder\(s\) in messages but 1 image\(s\)"):
        tokenize(_pair("<image><image>hi", ["a.png"]), "data.jsonl:5", base_dir=tmp_path)
    with pytest.raises(ImageError, match=r"data.jsonl:6: 0 <image> placeholder\(s\) in messages but 1 image\(s\)"):
        tokenize(_pair("hi", ["a.png"]), "data.jsonl:6", base_dir=tmp_path)
    with pytest.raises(ImageError, match=r"data.jsonl:7: an image part needs"):
        tokenize({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "data.jsonl:7")


@pytest.mark.parametrize("processor, trait", [  # tiles without image_seq_len (processor_config.json) too
    ("Idefics3ImageProcessorPil", r"gives pixel_attention_mask and splits images \(do_image_splitting\)"),
    ("SmolVLMImageProcessorPil", r"gives pixel_attention_mask and splits images \(do_image_splitting\)"),
    ("LlavaNextImageProcessorPil", r"gives image_sizes and splits images \(image_grid_pinpoints\)"),
    ("PixtralImageProcessorPil", r"gives image_sizes: raypack's image data path takes grid processors")])
def test_processors_without_an_exact_data_path_are_refused_naming_the_trait(parts, processor, trait):
    import transformers

    _, tokenizer, _ = parts
    with pytest.raises(InputError, match=f"{processor} {trait}"):
        ImageTokenizer(getattr(transformers, processor)(), tokenizer, {"patch_size": 4})


def test_a_picture_processor_needs_the_processors_patch_size(parts):
    from transformers import CLIPImageProcessorPil

    _, tokenizer, _ = parts
    with pytest.raises(InputError, match=r"CLIPImageProcessorPil gives whole pictures, but .*processor_config.json has "
                                         r"no patch_size"):
        ImageTokenizer(CLIPImageProcessorPil(), tokenizer, {})
    with pytest.raises(InputError, match=r"CLIPImageProcessorPil gives pictures of each image's own size"):
        ImageTokenizer(CLIPImageProcessorPil(do_center_crop=False), tokenizer, {"patch_size": 4})


def _siglip_folder(folder):
    """A LLaVA processor with a SigLIP image processor (no CLS: every patch a token, `full`)."""
    from transformers import AutoTokenizer, LlavaProcessor, SiglipImageProcessorPil

    processor = LlavaProcessor(image_processor=SiglipImageProcessorPil(size={"height": 12, "width": 12}),
                               tokenizer=AutoTokenizer.from_pretrained(PROCESSOR), patch_size=4,
                               image_token="<|image_pad|>", vision_feature_select_strategy="full")  # fmt: skip
    processor.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_llava_tokens_labels_and_pixels_match_llava_processor(tower, tmp_path):
    from transformers import AutoProcessor

    from raypack.data.encode import load_image_tokenizer, load_tokenizer

    folder = str(ASSETS / "llava_processor" if tower == "clip" else _siglip_folder(tmp_path / "siglip"))
    reference = AutoProcessor.from_pretrained(folder)  # LlavaProcessor builds without torchvision
    assert type(reference).__name__ == "LlavaProcessor"
    tokenizer = load_tokenizer(folder)
    tokenize = load_image_tokenizer(folder, tokenizer)
    per_image = {"clip": 16, "siglip": 9}[tower]  # (16/4)² + CLS - CLS dropped; (12/4)², all kept
    for i, rec in enumerate(_records("vision_pairs.jsonl")[:6]):
        ours = tokenize(rec, f"vision_pairs.jsonl:{i + 1}", base_dir=SAMPLE)
        ref, sources = processor_encoding(reference, rec)
        ids = ref["input_ids"][0]
        eos = tokenizer.eos_token_id
        assert ours["input_ids"] == [*ids.tolist(), eos]
        assert ours["labels"] == [*np.where(ref["assistant_masks"][0] == 1, ids, -100).tolist(), eos]
        assert ours["image_tokens"] == (ids == reference.image_token_id).sum() == per_image * len(sources)
        assert ours["image_grid_thw"] == [] and ours["vision_patches"] == len(sources) * (per_image if tower == "siglip" else 16)
        pixels = tokenize.example_pixels(ours)
        assert set(pixels) == {"pixel_values"} and np.array_equal(pixels["pixel_values"], ref["pixel_values"])
    with pytest.raises(ValueError, match=r"16 image tokens in the text but the image processor makes 9"):
        load_image_tokenizer(str(_siglip_folder(tmp_path / "other")), tokenizer).example_pixels(
            {**tokenize(_records("vision_pairs.jsonl")[0], "x", base_dir=SAMPLE), "input_ids": [769] * 16})


def test_the_source_stage_reads_both_layouts_into_the_same_vision_rows():
    """Read where Ray Data reads the text (sources.read_unit): each image row becomes a `vision`
    row holding its messages in parts and its images' bytes as in the files, the same from
    either layout; a text chat row beside them stays a chat row."""
    from raypack.data import sources
    from raypack.data.listing import list_sources, read_units

    read = {}
    for name in ("vision.jsonl", "vision_pairs.jsonl"):
        units = read_units(list_sources((str(SAMPLE / name),)))
        read[name] = [r for u in units for r in sources.read_unit({k: [u[k]] for k in u}, "auto").to_pylist()]
    rows, pairs = read["vision.jsonl"], read["vision_pairs.jsonl"]
    assert len(rows) == 36 and all(r["format"] == "vision" and r["error"] is None for r in rows)
    for row, pair, rec in zip(rows, pairs, _records("vision.jsonl")):
        assert (row["vision_messages"], row["images"]) == (pair["vision_messages"], pair["images"])
        _, paths = image_messages(rec, "")
        assert row["images"] == [(SAMPLE / p).read_bytes() for p in paths]
        assert json.loads(row["vision_messages"])[0]["content"][0] == {"type": "image"}
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert json.loads(sources.validate(text, "chat")["messages"])[0]["content"] == "hi"


def test_idefics3_tokens_labels_and_pixels_match_idefics3_processor():
    """Tiles: each image's text is the processor's prompt string (fake tokens, <row_i_col_j>,
    image_seq_len image tokens a tile, the whole picture last), spliced in as tokens."""
    from transformers import AutoProcessor

    from raypack.data.encode import load_image_tokenizer, load_tokenizer

    folder = str(ASSETS / "idefics3_processor")
    reference = AutoProcessor.from_pretrained(folder)  # Idefics3Processor builds without torchvision
    assert type(reference).__name__ == "Idefics3Processor"
    tokenizer = load_tokenizer(folder)
    tokenize = load_image_tokenizer(folder, tokenizer)
    tiles = set()
    for i, rec in enumerate(_records("vision_pairs.jsonl")[:8]):
        ours = tokenize(rec, f"vision_pairs.jsonl:{i + 1}", base_dir=SAMPLE)
        ref, _ = processor_encoding(reference, rec)
        ids = ref["input_ids"][0]
        assert ours["input_ids"] == [*ids.tolist(), tokenizer.eos_token_id]
        assert ours["labels"][:-1] == np.where(ref["assistant_masks"][0] == 1, ids, -100).tolist()
        assert ours["image_tokens"] == (ids == reference.image_token_id).sum() > 0
        pixels = tokenize.example_pixels(ours)
        assert np.array_equal(pixels["pixel_values"], ref["pixel_values"])
        assert np.array_equal(pixels["pixel_attention_mask"], ref["pixel_attention_mask"])
        tiles.add(pixels["pixel_values"].shape[1])
    assert len(tiles) > 1, f"every picture split alike: {tiles}"


def test_smolvlm_tokens_and_pixels_match_smolvlm_processor(monkeypatch):
    """SmolVLM's tiles take the same path (its image processor, its processor's prompt function)."""
    import transformers.models.smolvlm.processing_smolvlm as smolvlm
    from transformers import SmolVLMImageProcessorPil, SmolVLMProcessor

    # SmolVLMProcessor wants num2words (not installed; for video prompts only) and a video
    # processor (torchvision); neither touches images, so both checks are skipped, nothing else.
    monkeypatch.setattr(smolvlm, "num2words", object())
    monkeypatch.setattr(SmolVLMProcessor, "check_argument_for_proper_class", lambda *args: None)
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "idefics3_processor")
    tiles = SmolVLMImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 16})
    reference = SmolVLMProcessor(image_processor=tiles, tokenizer=tokenizer, video_processor=None, image_seq_len=4)
    tokenize = ImageTokenizer(tiles, tokenizer, {"image_seq_len": 4})
    for i, rec in enumerate(_records("vision_pairs.jsonl")[:6]):
        ours = tokenize(rec, f"vision_pairs.jsonl:{i + 1}", base_dir=SAMPLE)
        messages, sources = image_messages(rec, "")
        pictures = [decode_image(read_image_bytes(s, SAMPLE, ""), s, "") for s in sources]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ref = reference(text=text, images=[pictures], add_special_tokens=False, return_tensors="np")
        assert ours["input_ids"] == [*ref["input_ids"][0].tolist(), tokenizer.eos_token_id]
        assert np.array_equal(tokenize.example_pixels(ours)["pixel_values"], ref["pixel_values"])


def test_an_image_over_the_pixel_limit_is_a_bad_row_that_skip_skips(tmp_path):
    """Read from its header before anything is decoded: a 20000 x 20000 PNG (a few dozen bytes
    here) is a bad row naming its file and line under data.max_image_pixels' default (PIL's limit,
    which would raise DecompressionBombError with a traceback), skipped under on_bad_rows=skip;
    the bundled 000.png is over a limit set below its size, and within null (no limit)."""
    from raypack.config import load
    from raypack.data.listing import Sources
    from raypack.data.sources import rows_here
    from raypack.errors import SourceError

    from hugeimage import huge_png

    (tmp_path / "huge.png").write_bytes(huge_png())
    (tmp_path / "ok.png").write_bytes((SAMPLE / "images" / "000.png").read_bytes())
    row = {"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A shape."}]}
    path = tmp_path / "vision.jsonl"
    path.write_text("".join(json.dumps({**row, "images": [name]}) + "\n" for name in ("ok.png", "huge.png", "ok.png")))

    def read(*overrides):
        cfg = load(None, [f"data.paths=[{path}]", *overrides]).data
        tables = rows_here(cfg, Sources.of(cfg.paths))
        return [e for t in tables for e in t["error"].to_pylist()]

    with pytest.raises(SourceError, match=rf"^{path} line 2: image 'huge.png' is 20000x20000, 400,000,000 pixels, "
                                          r"over data.max_image_pixels \(178,956,970\); make it smaller"):
        read()
    errors = read("data.on_bad_rows=skip")
    assert errors[0] is None and errors[2] is None and "huge.png' is 20000x20000" in errors[1]
    with pytest.raises(SourceError, match=r"line 1: image 'ok.png' is \d+x\d+, \d+ pixels, over data.max_image_pixels \(100\)"):
        read("data.max_image_pixels=100")
    with pytest.raises(SourceError, match="huge.png' is not a decodable image"):  # no limit: decoded, and truncated
        read("data.max_image_pixels=null")
