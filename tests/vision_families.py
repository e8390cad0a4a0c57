"""Vision-language families as tiny configs, their image+text examples, and the packed-vs-alone
check for both towers (tests/unit/model/test_vision.py).

An example is text, image placeholders where its images go, and the images' pixels in the
layout the family's processor gives (Qwen: flat patches and a (t, h, w) grid; CLIP/SigLIP towers:
one [3, S, S] picture each). The reference runs each example alone through the model's own
forward, which builds its own positions (`get_rope_index` for mRoPE) from the example's grids.

To check a family: add a row to VLM_FAMILIES.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from raypack.model.vision import example_positions, token_types

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=2,
            initializer_range=0.1, use_cache=False)  # fmt: skip
IMAGE, VIDEO, START, END = 500, 501, 502, 503
"""Special token ids of the tiny configs (inside the 512-token vocabulary)."""
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}


@dataclass(frozen=True)
class VisionFamily:
    config: str
    """The transformers config class."""
    kwargs: dict[str, Any]
    """Its arguments (text_config, vision_config, token ids)."""
    layout: str
    """`patches` (Qwen: flat patches + grid_thw, dynamic resolution), `pictures` ([1, 3, S, S]
    each), `sized` (pictures with their image_sizes: Pixtral) or `stacked` (Idefics3/SmolVLM:
    [1, 1, 3, S, S] each, images along dimension 1)."""
    refused: str | None = None
    """None: must be exact. Else a regex the refusal must match."""

    def build_config(self):
        return getattr(transformers, self.config)(**self.kwargs)


QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=1, in_channels=3, initializer_range=0.1)  # fmt: skip
CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                   patch_size=4, projection_dim=32)  # fmt: skip
SIGLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                     patch_size=4)  # fmt: skip
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)

VLM_FAMILIES: dict[str, VisionFamily] = {
    # mRoPE; window attention in the tower (windows of 2x2 merged patches, smaller than the images)
    "qwen2_5_vl": VisionFamily("Qwen2_5_VLConfig", dict(
        text_config={**TEXT, "rope_parameters": MROPE},
        vision_config={**QWEN_VISION, "window_size": 16, "fullatt_block_indexes": [1]}, **TOKENS), "patches"),
    "qwen2_vl": VisionFamily("Qwen2VLConfig", dict(
        text_config={**TEXT, "rope_parameters": MROPE},
        vision_config={**QWEN_VISION, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}, **TOKENS), "patches"),
    # mRoPE (interleaved), deepstack features added to the image tokens of early decoder layers
    "qwen3_vl": VisionFamily("Qwen3VLConfig", dict(
        text_config={**TEXT, "rope_parameters": {**MROPE, "mrope_interleaved": True}},
        vision_config={**QWEN_VISION, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        **TOKENS), "patches"),  # fmt: skip
    # GLM-4.1V: mRoPE (its own get_rope_index), a tower with 2-D position embeddings interpolated per image
    "glm4v": VisionFamily("Glm4vConfig", dict(
        text_config={**TEXT, "rope_parameters": {**MROPE, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}},
        vision_config={**QWEN_VISION, "image_size": 16, "out_hidden_size": 64}, image_token_id=IMAGE, video_token_id=VIDEO,
        image_start_token_id=START, image_end_token_id=END, video_start_token_id=START, video_end_token_id=END),
        "patches"),
    # Qwen3-VL-MoE: Qwen3-VL with routed experts (per token: packing can't change routing)
    "qwen3_vl_moe": VisionFamily("Qwen3VLMoeConfig", dict(
        text_config={**TEXT, "rope_parameters": {**MROPE, "mrope_interleaved": True}, "num_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
        vision_config={**QWEN_VISION, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        **TOKENS), "patches"),  # fmt: skip
    # LLaVA: a CLIP tower and a projector on a Llama
    "llava_clip": VisionFamily("LlavaConfig", dict(
        text_config={**TEXT, "model_type": "llama"}, vision_config={**CLIP_VISION, "model_type": "clip_vision_model"},
        image_token_id=IMAGE, vision_feature_layer=-1, projector_hidden_act="gelu"), "pictures"),
    # the same with a SigLIP tower (no CLS token: every patch is a feature)
    "llava_siglip": VisionFamily("LlavaConfig", dict(
        text_config={**TEXT, "model_type": "llama"}, vision_config={**SIGLIP_VISION, "model_type": "siglip_vision_model"},
        image_token_id=IMAGE, vision_feature_layer=-1, vision_feature_select_strategy="full"), "pictures"),
    # Idefics3 and SmolVLM: a SigLIP-like tower, pixel shuffle (scale 2) and a projector on a Llama
    "idefics3": VisionFamily("Idefics3Config", dict(
        text_config={**TEXT, "model_type": "llama"}, vision_config={**SIGLIP_VISION, "model_type": "idefics3_vision"},
        image_token_id=IMAGE, scale_factor=2), "stacked"),
    "smolvlm": VisionFamily("SmolVLMConfig", dict(
        text_config={**TEXT, "model_type": "llama"}, vision_config={**SIGLIP_VISION, "model_type": "smolvlm_vision"},
        image_token_id=IMAGE, scale_factor=2), "stacked"),
    # Mistral 3: a Pixtral tower (all images in one sequence, a block mask per image) and a patch merger
    "mistral3": VisionFamily("Mistral3Config", dict(
        text_config={**TEXT, "model_type": "mistral"}, vision_config={**SIGLIP_VISION, "model_type": "pixtral",
        "head_dim": 16}, image_token_index=IMAGE, spatial_merge_size=2, vision_feature_layer=-1), "sized"),
    # Gemma 3: image tokens attend to each other bidirectionally
    "gemma3": VisionFamily("Gemma3Config", dict(
        text_config={**TEXT, "model_type": "gemma3_text", "sliding_window": 8, "query_pre_attn_scalar": 16},
        vision_config={**SIGLIP_VISION, "model_type": "siglip_vision_model"}, mm_tokens_per_image=4,
        image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END), "pictures",
        refused=r"token_type_ids.*bidirectionally"),
}


CHECKPOINTED = ("qwen2_5_vl", "qwen3_vl", "llava_siglip", "idefics3")
"""Families whose full gradient checkpointing is checked (one per tower kind and layout)."""


def _image(spec: VisionFamily, config, g: torch.Generator, size: tuple[int, int]):
    """(placeholder token count, pixels, grid or None) for one image of `size` patches."""
    vision = config.vision_config
    if spec.layout == "patches":
        h, w = size
        dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.randn(h * w, dim, generator=g)
        return h * w // vision.spatial_merge_size**2, pixels, torch.tensor([[1, h, w]])
    side = vision.image_size
    n = getattr(config, "mm_tokens_per_image", None) or (side // vision.patch_size) ** 2
    if spec.layout == "stacked":
        return n // config.scale_factor**2, torch.randn(1, 1, 3, side, side, generator=g), None
    if spec.layout == "sized":
        return n // config.spatial_merge_size**2, torch.randn(1, 3, side, side, generator=g), None
    return n, torch.randn(1, 3, side, side, generator=g), None


EXAMPLES = ((5, [(4, 4)], 7), (9, [], 4), (3, [(4, 6), (2, 2)], 6))
"""(prompt tokens, images as patch grids, answer tokens): one image; text only; two of two sizes."""


def make_examples(spec: VisionFamily, config, seed: int = 0, layout=EXAMPLES) -> list[dict]:
    """Examples of text, images between vision start/end tokens, an answer; labels on the answer only."""
    g = torch.Generator().manual_seed(seed)
    image = getattr(config, "image_token_id", None) or config.image_token_index
    start, end = getattr(config, "vision_start_token_id", START), getattr(config, "vision_end_token_id", END)
    out = []
    for prompt, images, answer in layout:
        ids, pixels, grids = [torch.randint(3, 400, (prompt,), generator=g)], [], []
        for size in images:
            n, pix, grid = _image(spec, config, g, size)
            ids += [torch.tensor([start] + [image] * n + [end]), torch.randint(3, 400, (2,), generator=g)]
            pixels.append(pix)
            if grid is not None:
                grids.append(grid)
        ids = torch.cat(ids)
        labels = torch.full_like(ids, -100)
        ids = torch.cat([ids, torch.randint(3, 400, (answer,), generator=g)])
        labels = torch.cat([labels, ids[-answer:]])
        out.append({"input_ids": ids, "labels": labels,
                    "pixel_values": torch.cat(pixels, 1 if spec.layout == "stacked" else 0) if pixels else None,
                    "image_grid_thw": torch.cat(grids) if grids else None,
                    "image_sizes": torch.tensor([[p.shape[-2], p.shape[-1]] for p in pixels])
                    if pixels and spec.layout == "sized" else None})  # fmt: skip
    return out


def with_positions(model, examples: list[dict]) -> list[dict]:
    """The examples with the positions raypack packs them with (example_positions)."""
    return [{**e, "position_ids": example_positions(model, e["input_ids"], e["image_grid_thw"])} for e in examples]


def alone_inputs(model, example: dict) -> dict:
    """One example as the model's own forward takes it unpacked: it builds its own positions."""
    kwargs = {"input_ids": example["input_ids"][None]}
    if example["pixel_values"] is not None:
        kwargs["pixel_values"] = example["pixel_values"]
        if example["image_grid_thw"] is not None:
            kwargs["image_grid_thw"] = example["image_grid_thw"]
            kwargs["mm_token_type_ids"] = token_types(model.config, kwargs["input_ids"])
        if example.get("image_sizes") is not None:
            kwargs["image_sizes"] = example["image_sizes"]
        if "token_type_ids" in inspect.signature(type(model).forward).parameters:
            kwargs["token_type_ids"] = token_types(model.config, kwargs["input_ids"]).long()
    return kwargs


def tower(name: str) -> str:
    """Which part a parameter belongs to: vision, projector or language."""
    if any(k in name for k in ("merger", "multi_modal_projector", "connector", "mm_input_projection", "mm_soft_emb")):
        return "projector"
    if any(k in name for k in ("visual.", "vision_tower", "vision_model", "vision_encoder")):
        return "vision"
    return "language"


def summed_loss(logits, labels):
    return F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], reduction="sum", ignore_index=-100)


def vlm_packed_vs_alone(model, ref, examples: list[dict], batch: dict) -> dict[str, float]:
    """Relative errors of `model` on the packed `batch` against `ref` (same weights) on each example
    alone: `loss`, `logits`, and the largest gradient error of each tower (`grad:vision`,
    `grad:projector`, `grad:language`; each gradient relative to its own scale, floored at 1e-3 of
    the largest gradient, as tests/exactness.py does), and `missing` (parameters with a gradient
    in one run only)."""
    batch = dict(batch)
    labels = batch.pop("labels")
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    logits = model(**batch).logits
    loss = summed_loss(logits, labels)
    loss.backward()
    ref_logits, ref_loss = [], 0.0
    for e in examples:
        out = ref(**alone_inputs(ref, e)).logits
        ref_logits.append(out[0])
        lab = e["labels"].clone()
        lab[0] = -100
        ref_loss = ref_loss + summed_loss(out, lab[None])
    ref_loss.backward()

    ref_logits = torch.cat(ref_logits)
    errors = {"logits": ((logits[0] - ref_logits).abs().max() / ref_logits.abs().max()).item(),
              "loss": (abs(loss - ref_loss) / abs(ref_loss)).item(), "missing": 0.0}  # fmt: skip
    ref_params = dict(ref.named_parameters())
    floor = 1e-3 * max(q.grad.abs().max().item() for q in ref_params.values() if q.grad is not None)
    for name, p in model.named_parameters():
        q = ref_params[name]
        if p.grad is None and q.grad is None:
            continue
        key = f"grad:{tower(name)}"
        if (p.grad is None) != (q.grad is None):
            errors["missing"] = 1.0
            continue
        err = (p.grad - q.grad).abs().max().item() / max(q.grad.abs().max().item(), floor)
        errors[key] = max(errors.get(key, 0.0), err)
    return errors


def report() -> list[str]:
    """One line a family: the largest packed-vs-alone error of the logits, loss and each tower's
    gradients (the numbers test_vision.py bounds), or the refusal."""
    from raypack.data.vision_collate import collate_vision_packed
    from raypack.model.traits import UnsupportedModelError
    from raypack.model.vision import build_vlm

    lines = ["| family | logits | loss | vision grad | projector grad | language grad |", "|---|---|---|---|---|---|"]
    for family, spec in VLM_FAMILIES.items():
        config = spec.build_config()
        torch.manual_seed(0)
        try:
            model = build_vlm(config, "sdpa_varlen").eval()
        except UnsupportedModelError as e:
            lines.append(f"| {family} | refused: {str(e).split(': ', 1)[1][:90]}... | | | | |")
            continue
        ref = build_vlm(config, "eager").eval()
        ref.load_state_dict(model.state_dict())
        examples = make_examples(spec, config)
        e = vlm_packed_vs_alone(model, ref, examples, collate_vision_packed(with_positions(model, examples)))
        cells = [f"{e[k]:.1e}" for k in ("logits", "loss", "grad:vision", "grad:projector", "grad:language")]
        lines.append(f"| {family} | {' | '.join(cells)} |")
    return lines


if __name__ == "__main__":  # PYTHONPATH=.:tests python tests/vision_families.py
    torch.set_num_threads(1)
    print("\n".join(report()))
