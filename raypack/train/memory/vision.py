"""A VLM's vision tower for the memory estimate (raypack/train/memory/estimate.py) and the plan's balance
(raypack/data/tower.py): its parameters, what it keeps for backward per patch, and its training
FLOPs. Arithmetic over the tower's shape, read from the model's structure on the meta device (no
weights), for towers of patch blocks (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `blocks` of attention + MLP
over a flat sequence of patches, a patch merger as the projector).

What a block keeps for backward, per patch, bf16 (d: width, i: MLP width, H: heads), counted from
transformers' code and checked against what autograd saves for the tiny Qwen2.5-VL
(tests/unit/train/memory/test_vision.py):

    each norm          RMSNorm: fp32 input 4d, rsqrt 4, bf16 normed input 2d (6d + 4);
                       LayerNorm: input 2d, mean and rstd 8 (2d + 8)
    attention          qkv's input 2d and output 6d (v is a view of it), q and k after the rotary
                       2d each, the attention's output 2d and fp32 log-sum-exp 4H, proj's input 2d
    MLP                its input 2d; gated (gate, up, down: Qwen2.5-VL) 8i, else (fc1, fc2) 4i

and once per patch for the whole tower: the pixels the patch embedding keeps (2 x channels x
temporal x patch²), the rotary tables (fp32 cos and sin, 8 x head dim), the projector (a norm,
then 6d over its merged inputs) and the window permutation's indices. Attention runs per image (or
window) through SDPA, which keeps no patches² matrix on a GPU.

Under `full` checkpointing a block keeps its input (2d), plus one block recomputed; under
`selective` its input and matmul and attention outputs (not checked against autograd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from raypack.data.tower import TowerCost
    from raypack.model.facts import ModelTree


@dataclass(frozen=True)
class Tower:
    """A vision tower's shape, as the estimate and the plan need it."""

    blocks: int
    hidden: int
    inter: int
    heads: int
    gated: bool
    """MLP of gate, up and down projections (Qwen2.5-VL); else fc1 and fc2."""
    rms_norm: bool
    """RMSNorm with an fp32 upcast (Qwen2.5-VL); else LayerNorm."""
    patch_in: int
    """Pixel values a patch: channels x temporal patch x patch²."""
    merge: int
    """Patches merged into one image token (spatial merge size²)."""
    full_blocks: int
    """Blocks that attend over whole images; the rest attend within windows of `window` patches."""
    window: int
    params: int
    """The tower's parameters, projector included."""
    projector: int
    """The projector's (the patch merger's) parameters."""
    patch_weights: float = 0.0
    """Matrix weights (linears, the patch embedding's convolution) a patch meets once: the tower's
    outside the projector, and the projector's over the `merge` patches it takes at a time."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def _norm(self) -> int:
        return 6 * self.hidden + 4 if self.rms_norm else 2 * self.hidden + 8

    def block_bytes(self, mode: str = "none") -> float:
        """What one block keeps for backward per patch under checkpointing `mode` (module doc)."""
        d, i = self.hidden, self.inter
        if mode == "full":
            return 2 * d
        if mode == "selective":  # input, qkv, attention output and lse, proj, the MLP's matmul outputs
            return 2 * d + 6 * d + 2 * d + 4 * self.heads + 2 * d + (4 * i if self.gated else 2 * i) + 2 * d
        mlp = 8 * i if self.gated else 4 * i
        return 2 * self._norm() + 18 * d + 4 * self.heads + mlp

    def patch_bytes(self) -> float:
        """What the tower keeps once per patch, besides its blocks (module doc)."""
        return 2 * self.patch_in + 8 * self.head_dim + self._norm() + 6 * self.hidden + 16 / self.merge

    def activations(self, patches: int, mode: str = "none") -> float:
        """Bytes the tower keeps for a micro-batch of `patches` patches, and the block recomputed
        in backward under `full` and `selective` (counted apart: the caller takes the larger of it
        and the language model's recomputed layer, as both never run at once)."""
        return patches * (self.blocks * self.block_bytes(mode) + self.patch_bytes())

    def recomputed(self, patches: int, mode: str) -> float:
        """Bytes of the one block a recomputing mode runs again in backward (0 under `none`)."""
        return 0.0 if mode == "none" else patches * self.block_bytes("none")

    def cost(self, token_flops: float, length_flops: float) -> TowerCost:
        """Training FLOPs (forward and backward, 6 per weight per input, 12·d per attended pair
        and block) of the tower per patch and per image patch², beside the language model's per
        token and per length² (`memory.tower_cost` counts those, as raypack/train/metrics.py does
        for MFU): what the plan weighs a patch against a token with (raypack/data/tower.py)."""
        from raypack.data.tower import TowerCost

        # Windowed blocks attend over `window` patches a patch: linear in patches too.
        per_patch = 6 * self.patch_weights + 12 * self.hidden * self.window * (self.blocks - self.full_blocks)
        return TowerCost(patch_flops=per_patch, image_flops=12 * self.hidden * self.full_blocks,
                         token_flops=token_flops, length_flops=length_flops)  # fmt: skip


def _mlp(block: nn.Module) -> tuple[int, bool]:
    from torch import nn

    linears = [m for m in block.mlp.modules() if isinstance(m, nn.Linear)]
    return linears[0].out_features, len(linears) == 3


def vision_tower(tree: ModelTree, config: Any) -> Tower | None:
    """The Tower of a VLM (its ModelTree: a meta-device model will do), or None where it has no
    tower of patch blocks the arithmetic knows (LLaVA's CLIP/SigLIP towers, Idefics3's: not sized yet)."""
    from raypack.model.vision import parts

    model, tower = tree.model, tree.tower
    blocks = getattr(tower, "blocks", None)
    if tower is None or not blocks or not hasattr(blocks[0], "attn") or not hasattr(blocks[0], "mlp"):
        return None
    vc = config.vision_config
    first = blocks[0]
    inter, gated = _mlp(first)
    found = parts(model)
    params = dict(model.named_parameters())
    vision, projector = (sum(params[n].numel() for n in found[part]) for part in ("vision", "projector"))
    # what matmuls multiply (not biases and norms' weights, added elementwise)
    matrices = {part: sum(params[n].numel() for n in found[part] if params[n].dim() >= 2) for part in found}
    full = getattr(vc, "fullatt_block_indexes", None)
    merge_side = vc.spatial_merge_size
    window = 0
    if full is not None:  # Qwen2.5-VL: windows of window_size pixels, counted in merged units
        side = vc.window_size // merge_side // vc.patch_size * merge_side
        window = side * side
    embed = tower.patch_embed.proj
    return Tower(
        blocks=len(blocks), hidden=first.attn.qkv.in_features, inter=inter, heads=first.attn.num_heads,
        gated=gated, rms_norm="RMSNorm" in type(first.norm1).__name__,
        patch_in=embed.in_channels * int(embed.weight.shape[2:].numel()), merge=merge_side**2,
        full_blocks=len(blocks) if full is None else len([b for b in full if b < len(blocks)]),
        window=window, params=vision + projector, projector=projector,
        patch_weights=matrices["vision"] + matrices["projector"] / merge_side**2,
    )  # fmt: skip
