"""What a hybrid model's token mixers (raypack/model/mixers.py) keep for backward, for the memory
estimate (raypack/train/memory/estimate.py): the gated delta rule, Mamba-2, the short convolution and KDA on
the exact torch path, per layer. Arithmetic over the mixer's shape, read from the model's structure
on the meta device (no weights), as the model's description found it (raypack/model/facts.py).

The torch path runs a packed row's examples as the rows of right-padded batches, one per length
bucket (raypack/model/mixers.py and mixer_buckets.py), and the scans pad each row up to their chunk:

    row     [a a a a a a | b b | c c c]           9 tokens: what attention and the MLP keep
    mixer   [b b] [c c c] [a a a a a a] [.]       3 buckets of one example, and a spare call on
                                                  one token (BUCKETS is 4): 4 rows of 64 here

The estimate (`activations`) is told a row's examples and its longest, not each length, so it
sizes every example as the longest (each bucket's longest is at most the row's) plus the spare
calls: exact for examples of one length, an upper bound otherwise. `row` sizes the buckets of a
given row.

Per layer, for `examples` rows of `longest` tokens (P = longest rounded up to the chunk):

- per token of the padded batch, `token_bytes`: what transformers' torch fallbacks save, counted
  from their code and checked against what autograd saves on the tiny models
  (tests/unit/train/memory/test_mixers.py). Inputs and projections in bf16, the scans in fp32 (as
  transformers computes them):
    gated delta rule (value heads Hv, key heads Hk, dims dk dv, chunk C, conv channels D = 2Hk dk + Hv dv):
        5 fp32 C x C products a head (the decay matrix, k·k and q·k, the triangular system, the
        intra-chunk attention) 20 Hv C; fp32 copies of q, k and their normed, decayed and solved
        forms (8 Hv dk) and of v, the solved values, the gated norm (6 Hv dv), 4 B each; bf16 the
        convolution's input and output (2D), the layer's input (h) and z, the norm's input and output
        (3 Hv dv), 2 B each; gates and decays 40 Hv
    Mamba-2 (heads H, head dim p, state N, chunk C, conv channels D, in_proj width W):
        3 fp32 C x C products a head (segment sums and their decays) 12 H C; fp32 x and the
        gated norm's copies (10 H p) and B, C broadcast to the heads (5 H N), 4 B each; bf16 the
        projection (W), the convolution's input (D), the layer's input (h) and out_proj's (H p);
        gates 28 H
    short convolution (width h): bf16 the layer's input, B, C, x, B*x, the convolution's output
        and out_proj's input: 14 h
    KDA (heads H, head dim K, chunk C = 64, conv channels D = 3HK): its decay is per channel, so
        3 fp32 C x C x K products a head (the decay matrix, k·k and q·k, each a K-vector per pair)
        12 H C K; the triangular solve's row-by-row clones (4 Σ i² + i over a chunk, per token);
        about 22 fp32 copies of q, k, v, gates and their solved forms (88 H K) and two C x C
        products a head (8 H C); the convolution's input and output, counted fp32 (Bailing keeps
        its weight in fp32) 8D; bf16 the layer's input, its gate's and output's (6h, 4K)
- per token of the row, `row_bytes`: its input (2h) and index (8) moving into and out of the
  padded batch.
- per example, `chunk_state_bytes` for every chunk: the fp32 recurrent state the scan carries
  into it, kept for its backward (the "state in flight"): gated delta rule Hv x dk x dv; Mamba-2
  H x p x N, twice (the chunk's state and its decayed sum); KDA H x K x K, twice.

What the CUDA kernels keep instead (flash-linear-attention, mamba-ssm) is not sized here: they run
the row unpadded and recompute most of this in backward, so they should keep less (not measured:
no GPU run has checked it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raypack.model.mixer_buckets import BUCKETS, layout

if TYPE_CHECKING:  # the estimate's module imports this one; torch only where a model is read
    from torch import nn

    from raypack.model.mixers import MixerKind

TORCH_CHUNK = 64
"""transformers' torch gated delta rule scans in chunks of 64 tokens (its chunk_size default)."""


@dataclass(frozen=True)
class MixerLayers:
    """One kind of mixer in a model: its layers, parameters and what each keeps for backward."""

    kind: str
    """mixers.MixerKind.name."""
    layers: int
    params: int
    """Parameters of all its layers' mixers."""
    token_bytes: float
    """Per token of the padded batch, per layer."""
    chunk_state_bytes: float
    """Per example per chunk, per layer (0: no recurrent state)."""
    chunk: int
    """The scan's chunk in tokens (1: none, a convolution)."""
    row_bytes: float
    """Per token of the packed row, per layer: what moving it into the padded batch and back keeps
    (the row's bf16 input and the int64 index of its places, mixers._buckets)."""

    def activations(self, examples: int, longest: int, tokens: int) -> float:
        """Bytes all its layers keep for a row of `tokens` tokens: `examples` examples, the longest
        `longest` tokens; at most what the length buckets keep (the module doc)."""
        spares = max(0, BUCKETS - examples)  # the buckets a row of fewer examples leaves empty
        return self.kept(((examples, longest), *[(1, 1)] * spares), tokens)

    def row(self, lengths: list[int]) -> float:
        """Bytes all its layers keep for a row of examples of `lengths` tokens, bucketed as the
        torch path buckets it."""
        shapes = layout(lengths, BUCKETS).shapes
        return self.kept((*shapes, *[(1, 1)] * (BUCKETS - len(shapes))), sum(lengths))

    def kept(self, shapes: tuple[tuple[int, int], ...], tokens: int) -> float:
        """Bytes all its layers keep for padded batches of (examples, longest) `shapes` of a row of
        `tokens` tokens."""
        rows = sum(n * -(-longest // self.chunk) for n, longest in shapes)  # rows of whole chunks
        return self.layers * (rows * self.chunk * self.token_bytes + rows * self.chunk_state_bytes
                              + tokens * self.row_bytes)  # fmt: skip


def _gated_delta(m: nn.Module) -> tuple[float, float, int]:
    hv, dk = m.A_log.numel(), m.head_k_dim
    dv = m.out_proj.in_features // hv
    conv, h, c = m.conv1d.out_channels, m.out_proj.out_features, TORCH_CHUNK
    token = 20 * hv * c + 4 * (8 * hv * dk + 6 * hv * dv) + 2 * (2 * conv + h + 3 * hv * dv) + 40 * hv
    return token, 4 * hv * dk * dv, c


def _mamba2(m: nn.Module) -> tuple[float, float, int]:
    heads, n, c = m.A_log.numel(), m.ssm_state_size, m.chunk_size
    inner = m.out_proj.in_features  # heads x head dim
    conv, width, h = m.conv1d.out_channels, m.in_proj.out_features, m.out_proj.out_features
    token = 12 * heads * c + 4 * (10 * inner + 5 * heads * n) + 2 * (width + conv + h + inner) + 28 * heads
    return token, 2 * 4 * inner * n, c


def _kda(m: nn.Module) -> tuple[float, float, int]:
    heads, k, c = m.num_heads, m.head_dim, TORCH_CHUNK
    conv, h = m.conv1d.out_channels, m.o_proj.out_features
    solve = 4 * sum(i * i + i for i in range(1, c)) / c  # the triangular solve's row-by-row clones
    token = 12 * heads * c * k + heads * solve + 88 * heads * k + 8 * heads * c + 8 * conv + 2 * (3 * h + 2 * k)
    return token + heads * k + 20 * heads, 2 * 4 * heads * k * k, c


def _short_conv(m: nn.Module) -> tuple[float, float, int]:
    h = m.out_proj.out_features
    return 14 * h, 0.0, 1


SIZES = {"gated delta rule": _gated_delta, "Mamba-2": _mamba2, "short convolution": _short_conv, "KDA": _kda}
"""mixers.KINDS by name -> (token_bytes, chunk_state_bytes, chunk) of one such module."""


def mixer_layers(decoder: nn.Module, found: dict[str, MixerKind]) -> tuple[MixerLayers, ...]:
    """The known mixers of a text `decoder` (a meta-device one will do), by kind: `found`, its
    mixers by module name (ModelTree.mixers)."""
    by_kind: dict[str, list[nn.Module]] = {}
    modules = dict(decoder.named_modules())
    for name, kind in found.items():
        by_kind.setdefault(kind.name, []).append(modules[name])
    out = []
    for kind, ms in by_kind.items():
        token, state, chunk = SIZES[kind](ms[0])  # a model's layers of one kind share a shape
        params = sum(p.numel() for m in ms for p in m.parameters())
        proj = getattr(ms[0], "out_proj", None) or ms[0].o_proj  # KDA's is o_proj
        row = 2 * proj.out_features + 8
        out.append(MixerLayers(kind, len(ms), params, float(token), float(state), chunk, float(row)))
    return tuple(out)
