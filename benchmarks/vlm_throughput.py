"""A Qwen2.5-VL-shaped model on image data, packed (issue 44): exact for both towers against its own
unpacked forward, and tokens/s packed over padded at the model level, in one run.

    PYTHONPATH=. python benchmarks/vlm_throughput.py            # one GPU: ~250M parameters, bf16
    PYTHONPATH=. python benchmarks/vlm_throughput.py --smoke    # the bundled sample and tiny model, CPU

1. Exactness (tests/vision_families.py `vlm_packed_vs_alone`: one packed row of three examples --
   one image, text only, two images of two sizes -- against each example alone through the
   model's own forward under eager attention, which builds its own mRoPE positions; the logits,
   the summed loss and the worst gradient of the vision tower, the projector and the language
   model, relative), tests/unit/model/test_vision.py's tiny Qwen2.5-VL, under
   benchmarks/common.py's EXACT_BOUNDS:
       fp32      language attention sdpa_varlen (raypack's exact path), the tower's sdpa
       bf16      raypack's CUDA varlen attention (`auto`) in the language model
       noise     the fp32 packed model against the bf16 reference: bf16's own rounding of the
                 examples alone; the bf16 bound is the larger of EXACT_BOUNDS' and twice it
       control   fp32 with the positions a naive packer builds (text positions for the image
                 tokens, test_vision.py's negative control): must exceed the bound
2. Throughput: the same examples a step (one image each, text around it), forward and backward
   (no optimizer), both models loaded from one folder saved in bf16 as published checkpoints are,
   as
       packed    raypack.data.vision_collate's one row (each example's own get_rope_index
                 positions), raypack's varlen attention in the language model
       padded    [examples, longest] with attention_mask, the images beside it, transformers'
                 sdpa model building its own positions (a padded strategy)
   tokens/s counts real tokens (image placeholders included); both modes run the same images
   through the same tower.

Images: on a GPU, synthetic photos (benchmarks/vision_bytes.py's) at four sizes under
Qwen2.5-VL's released processor settings (14-pixel patches, temporal patch 2, merge 2) with
max_pixels 200704 (at most 256 image tokens); --smoke, the bundled sample
(raypack/assets/vision_sample) through the bundled tiny processor and the quickstart's tiny model,
the sample's questions and answers tokenized. Works at the model and collate level: no Ray.
Exit status 1 when an exactness check fails (the results file is written first).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.common import (EXACT_BOUNDS, command_line, device_name, gpu_or_smoke, machine, results_path,  # noqa: E402
                               save_checkpoint, smoke_banner, packed_over_padded, versions, write_results)  # fmt: skip
from benchmarks.hybrid_throughput import bound_cell, verdict  # noqa: E402

SAMPLE = ROOT / "raypack" / "assets" / "vision_sample"
PROCESSOR = ROOT / "raypack" / "assets" / "vlm_processor"
IMAGE, VIDEO, START, END = 31_996, 31_997, 31_998, 31_999
"""The measured model's special token ids (the top of its 32,000-token vocabulary)."""
MEASURED_TEXT = dict(vocab_size=32_000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=8192,
                     rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
                     bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
"""Qwen2.5-VL's language model scaled down: head_dim 128 with its mRoPE sections."""
MEASURED_VISION = dict(depth=8, hidden_size=640, intermediate_size=1712, num_heads=10, out_hidden_size=1024,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=112,
                       fullatt_block_indexes=[3, 7])  # fmt: skip
"""Qwen2.5-VL's tower scaled down: window attention with a full-attention block every fourth."""
PHOTO_SIZES = ((224, 224), (448, 336), (320, 240), (640, 480))
MAX_PIXELS = 200_704


def measured_config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=MEASURED_TEXT, vision_config=MEASURED_VISION, image_token_id=IMAGE,
                            video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)  # fmt: skip


def example(prompt, image, answer) -> dict:
    """prompt ids, <vision_start> image placeholders <vision_end>, answer ids; labels on the answer."""
    import torch

    pixels, grid, n, start, placeholder, end = image
    ids = torch.tensor([*prompt, start, *[placeholder] * n, end, *answer])
    labels = ids.clone()
    labels[: len(ids) - len(answer)] = -100
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels, "image_grid_thw": grid}


def processed(processor, picture, config) -> tuple:
    grid_out = processor(images=[picture], return_tensors="pt")
    grid = grid_out["image_grid_thw"]
    n = int(grid.prod()) // processor.merge_size**2
    return (grid_out["pixel_values"], grid, n, config.vision_start_token_id, config.image_token_id,
            config.vision_end_token_id)  # fmt: skip


def sample_examples(config, count: int) -> list[dict]:
    """The bundled sample's examples, in order and repeated to `count`: its questions and answers
    through the bundled tokenizer, its images through the bundled image processor."""
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(PROCESSOR)
    processor = Qwen2VLImageProcessorPil.from_pretrained(PROCESSOR)
    rows = [json.loads(line) for line in (SAMPLE / "vision.jsonl").read_text().splitlines()]
    out = []
    for i in range(count):
        user, assistant = rows[i % len(rows)]["messages"]
        image = next(c["image"] for c in user["content"] if c["type"] == "image")
        question = " ".join(c["text"] for c in user["content"] if c["type"] == "text")
        picture = Image.open(SAMPLE / image).convert("RGB")
        out.append(example(tokenizer.encode(question, add_special_tokens=False), processed(processor, picture, config),
                           tokenizer.encode(assistant["content"], add_special_tokens=False)))  # fmt: skip
    return out


def photo_examples(config, count: int, max_length: int, seed: int = 0) -> list[dict]:
    """`count` examples, each a synthetic photo of one of PHOTO_SIZES, a prompt of 8-48 random
    tokens and a FLAN-like answer (clipped to `max_length`)."""
    import io

    import torch
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from benchmarks.vision_bytes import photo
    from raypack.data.synthetic import sample_lengths

    processor = Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2,
                                         size={"shortest_edge": 3136, "longest_edge": MAX_PIXELS})  # fmt: skip
    pool = [processed(processor, Image.open(io.BytesIO(photo(w, h, s))).convert("RGB"), config)
            for s, (w, h) in enumerate(PHOTO_SIZES * 4)]  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    answers = sample_lengths("flan", count, seed=seed, max_length=max_length).tolist()
    out = []
    for i, n in enumerate(answers):
        prompt = torch.randint(3, IMAGE - 100, (int(torch.randint(8, 49, (1,), generator=g)),), generator=g).tolist()
        answer = torch.randint(3, IMAGE - 100, (n,), generator=g).tolist()
        out.append(example(prompt, pool[int(torch.randint(len(pool), (1,), generator=g))], answer))
    return out


def collate_padded(examples: list[dict], config) -> dict:
    """A padded batch of `examples` as transformers' Qwen2.5-VL takes it: input_ids and labels
    right-padded, attention_mask, mm_token_type_ids, the images concatenated in order; no
    position_ids (the model builds them with get_rope_index, the padding masked)."""
    import torch

    from raypack.model.vision import token_types

    longest = max(len(e["input_ids"]) for e in examples)
    pad = config.text_config.pad_token_id or 0
    ids = torch.full((len(examples), longest), pad, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = e["input_ids"], e["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "mm_token_type_ids": token_types(config, ids),
            "pixel_values": torch.cat([e["pixel_values"] for e in examples]),
            "image_grid_thw": torch.cat([e["image_grid_thw"] for e in examples])}  # fmt: skip


def to(device, value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to(device, v) for k, v in value.items()}
    if isinstance(value, list):
        return [to(device, v) for v in value]
    return value


RUNS = (("fp32", "float32", "float32", "sdpa_varlen"), ("noise", "float32", "bfloat16", "sdpa_varlen"),
        ("bf16", "bfloat16", "bfloat16", "auto"), ("control", "float32", "float32", "sdpa_varlen"))
"""(check, packed model's dtype, reference's dtype, language attention), as benchmarks/hybrid_throughput.py's:
`noise` is bf16's own rounding of the examples alone, which sets the bf16 check's bound."""
TOWERS = ("grad:vision", "grad:projector", "grad:language")


def exactness(device: str) -> list[dict]:
    """The checks of the module doc (RUNS), each a dict: name, dtype, attention, errors, bound, ok."""
    import torch
    from vision_families import VLM_FAMILIES, make_examples, vlm_packed_vs_alone, with_positions

    from benchmarks.hybrid_throughput import bf16_bound
    from raypack.data.vision_collate import collate_vision_packed
    from raypack.model.vision import build_vlm

    spec = VLM_FAMILIES["qwen2_5_vl"]
    rows = {}
    for name, dtype, ref_dtype, attention in RUNS:
        dtype, ref_dtype = getattr(torch, dtype), getattr(torch, ref_dtype)
        config = spec.build_config()
        torch.manual_seed(0)
        model = build_vlm(config, attention, dtype=dtype).to(device).eval()
        ref = build_vlm(config, "eager", dtype=ref_dtype).to(device).eval()
        ref.load_state_dict(model.state_dict())
        examples = make_examples(spec, config)
        batch = collate_vision_packed(with_positions(model, examples))
        if name == "control":  # text positions for the image tokens too
            text = batch["position_ids"][0]
            batch["position_ids"] = torch.cat([text[None], text[None].expand(3, -1, -1)])
        alone = [{k: v.to(ref_dtype) if k == "pixel_values" and v is not None else v for k, v in e.items()} for e in examples]
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
        errors = vlm_packed_vs_alone(model, ref, to(device, alone), to(device, batch))
        towers = {k: errors.get(k, float("nan")) for k in TOWERS}  # nan: a tower without a gradient, which fails
        rows[name] = {"name": name, "attention": attention, **errors, **towers, "grad": max(towers.values()),
                      "dtype": str(dtype).removeprefix("torch.") + ("" if dtype == ref_dtype else
                                                                     f" vs {str(ref_dtype).removeprefix('torch.')}")}  # fmt: skip
        print(f"exactness {name}: " + " ".join(f"{k} {v:.2e}" for k, v in errors.items()), flush=True)
        del model, ref
    for row in rows.values():
        if row["name"] == "noise":
            row.update(bound=None, ok=True)
            continue
        values, gradients = bf16_bound(rows["noise"]) if row["name"] == "bf16" else EXACT_BOUNDS["float32"]
        row["bound_key"] = "bfloat16, or twice bf16's own rounding" if row["name"] == "bf16" else "float32"
        exact = (row["logits"] < values and row["loss"] < values and row["missing"] == 0
                 and all(row[k] < gradients for k in TOWERS))  # fmt: skip
        row.update(bound=(values, gradients), ok=(not exact) if row["name"] == "control" else exact)
    return list(rows.values())


def throughput(config, examples: list[dict], device: str, steps: int, warmup: int, per_step: int) -> dict:
    import torch

    from raypack.data.vision_collate import collate_vision_packed
    from raypack.model.vision import build_vlm, example_positions, load_vlm

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="vlm_model_") as folder:  # both load it, as users load a checkpoint
        save_checkpoint(build_vlm(config, "sdpa", dtype=torch.bfloat16), folder)
        packed = load_vlm(folder, "auto", dtype).to(device).train()
        padded = load_vlm(folder, "sdpa", dtype).to(device).train()
    examples = [{**e, "pixel_values": e["pixel_values"].to(dtype)} for e in examples]
    groups = [examples[i * per_step : (i + 1) * per_step] for i in range(warmup + steps)]
    measured = [e for g in groups[warmup:] for e in g]
    real = sum(len(e["input_ids"]) for e in measured)
    out = {"params": sum(p.numel() for p in packed.parameters()), "real_tokens": real,
           "image_tokens": sum(int((e["input_ids"] == config.image_token_id).sum()) for e in measured),
           "patches": sum(len(e["pixel_values"]) for e in measured)}  # fmt: skip
    host = {
        # positions built on the host per example, as the data pipeline does ahead of the step
        "packed": [collate_vision_packed([{**e, "position_ids": example_positions(packed, e["input_ids"], e["image_grid_thw"])}
                                          for e in g]) for g in groups],  # fmt: skip
        "padded": [collate_padded(g, config) for g in groups],
    }
    out.update(packed_over_padded({"packed": packed, "padded": padded}, host, real, warmup, device))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="the bundled sample, tiny model, CPU: proves the script runs")
    p.add_argument("--steps", type=int, default=None, help="measured steps a mode (default 10; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps a mode first (default 3; smoke 1)")
    p.add_argument("--examples-per-step", type=int, default=None, help="examples a step (default 16; smoke 4)")
    p.add_argument("--max-length", type=int, default=1024, help="clip answer lengths (GPU run)")
    p.add_argument("--out", default=None, help="results file (default: see benchmarks/common.py)")
    args = p.parse_args(argv)
    device = gpu_or_smoke(__file__, args.smoke, "measures packed image+text rows on CUDA")
    if device is None:
        return 2
    from raypack.model import attention as attn

    steps = args.steps or (1 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else 1 if args.smoke else 3
    per_step = args.examples_per_step or (4 if args.smoke else 16)
    backend = ("flash_attn" if attn.flash_attn_available() else "torch_varlen") if device == "cuda" else "sdpa_varlen"
    out = results_path("vlm", args.smoke, args.out)
    header = [f"# Vision-language (Qwen2.5-VL-shaped) on packed rows: exactness and throughput, {device_name()}, "
              f"{time.strftime('%Y-%m-%d')}", *smoke_banner(args.smoke), "", f"Command: `{command_line(__file__, argv)}`", "",
              f"Machine: {machine()}. Versions: {versions('flash_attn', 'PIL')}. Language model attention `auto` here: "
              f"{backend}; the vision tower: transformers' sdpa, per image.", ""]  # fmt: skip
    t0 = time.perf_counter()
    checks = exactness(device)
    check_lines = [
        "## Exactness: one packed row against each example alone, both towers", "",
        f"tests/vision_families.py's tiny qwen2_5_vl (hidden 64, 2 layers, a 2-block tower): one image; text only; two "
        f"images of two sizes. {time.perf_counter() - t0:.0f} s.", "",
        "| check | dtype | attention | logits | loss | vision grad | projector grad | language grad | bound (values, "
        "gradients) | verdict |", "|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {c['name']} | {c['dtype']} | {c['attention']} | {c['logits']:.2e} | {c['loss']:.2e} | "
          f"{c['grad:vision']:.2e} | {c['grad:projector']:.2e} | {c['grad:language']:.2e} | {bound_cell(c)} | "
          f"{verdict(c)} |" for c in checks], ""]  # fmt: skip
    out.write_text("\n".join([*header, *check_lines, "**Incomplete: the throughput part did not finish.**", ""]))

    t0 = time.perf_counter()
    if args.smoke:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from raypack.model.vision import tiny_vlm_config

        config = tiny_vlm_config(Qwen2VLImageProcessorPil.from_pretrained(PROCESSOR), AutoTokenizer.from_pretrained(PROCESSOR))
        examples = sample_examples(config, (warmup + steps) * per_step)
        source = "the bundled sample (raypack/assets/vision_sample) through the bundled tiny processor"
    else:
        config = measured_config()
        examples = photo_examples(config, (warmup + steps) * per_step, args.max_length)
        source = (f"synthetic photos of {', '.join(f'{w}x{h}' for w, h in PHOTO_SIZES)} under Qwen2.5-VL's processor "
                  f"settings, max_pixels {MAX_PIXELS:,}; prompts of 8-48 tokens, FLAN-like answers clipped to "
                  f"{args.max_length}")  # fmt: skip
    got = throughput(copy.deepcopy(config), examples, device, steps, warmup, per_step)
    ratio = got["packed"]["tokens_per_s"] / got["padded"]["tokens_per_s"]
    text, vision = config.text_config, config.vision_config
    lines = [
        *header, *check_lines,
        "## Throughput: packed over padded, same examples and images", "",
        f"Model: {type(config).__name__}, {got['params'] / 1e6:.1f}M parameters (language: hidden {text.hidden_size}, "
        f"{text.num_hidden_layers} layers; tower: hidden {vision.hidden_size}, {vision.depth} blocks), "
        f"{'bf16' if device == 'cuda' else 'fp32'}, random init; forward and backward, no optimizer. Examples: {source}; "
        f"{per_step} a step, one image each, {warmup} warm-up + {steps} measured steps a mode; measured: "
        f"{got['real_tokens']:,} real tokens ({got['image_tokens']:,} image tokens, {got['patches']:,} patches); "
        f"{time.perf_counter() - t0:.0f} s.", "",
        "| mode | tokens/s | peak GiB | padding fraction | first-step loss |", "|---|---|---|---|---|",
        *[f"| {m} | {got[m]['tokens_per_s']:,.0f} | {got[m]['peak_gib']:.2f} | {got[m]['padding']:.2f} | "
          f"{got[m]['first_loss']:.4f} |" for m in ("packed", "padded")],
        "", f"**tokens/s packed / padded: {ratio:.2f}x.**", "",
        "packed: raypack.data.vision_collate's row, each example's positions from the model's own get_rope_index, "
        "raypack's varlen attention; padded: transformers' sdpa model on a right-padded batch with attention_mask, "
        "building its own positions. The first-step losses agree to bf16 noise when both are exact.", "",
    ]  # fmt: skip
    write_results("vlm", args.smoke, str(out), lines)
    failed = [c["name"] for c in checks if not c["ok"]]
    if failed:
        print(f"vlm_throughput: exactness check(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
