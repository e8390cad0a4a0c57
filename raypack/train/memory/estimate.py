"""Per-GPU memory of a training run, from its typed config and the model's shape: the estimate
`raypack plan` prints and cluster/memory.py tabulates. Arithmetic, not a measurement.

    arch = Arch.from_config(model_config(cfg.model.name))      # a transformers config, no weights
    mem = estimate(cfg, arch)                                   # bytes per GPU, term by term
    print(mem.line(cfg, arch))

Per rank (= per GPU); P parameters, P_t of them trained, N ranks, T = tokens in a micro-batch:

- weights, gradients and optimizer state: what the engine keeps (raypack/train/memory/engines.py).
  Under DeepSpeed: bf16 weights, 2 B/param, whole under ZeRO 0-2, a 1/N shard plus the gathered
  working set under ZeRO-3; bf16 gradients, sharded for ZeRO >= 2, plus one reduce bucket; fp32
  master + m + v, 12 B per trained param (8 B for train.precision bf16), sharded 1/N, on the host
  with offload. At the optimizer step ZeRO 1-2 also makes an fp32 copy of the rank's gradient
  partition (4 B per trained param / N), while the activations are gone: not counted. The torch
  engine keeps fp32 master weights in the model (4 B) and a gathered or cast bf16 copy for the
  forward, fp32 gradients and m + v (8 B), sharded by FSDP2 at zero_stage 1-3. QLoRA stores each
  layer's linear weights in NF4: 0.5 B/param, plus the double-quantized constants (one 8-bit absmax
  per 64-weight block and one fp32 absmax per 256 blocks: 1/64 + 4/16384 B/param, the QLoRA paper's
  0.127 bits), plus one linear dequantized to bf16 while it computes; embeddings, output head and
  norms stay bf16.
- frozen weights (LoRA, QLoRA) have neither gradients nor optimizer state. Adapters: r x (in + out)
  per adapted linear (`all-linear`: q, k, v, o, gate, up, down), + out with DoRA (its magnitude);
  `modules_to_save` (embed_tokens, lm_head) trains a copy of the module in full.
- activations (bf16; Llama/Qwen layers; varlen attention, so no T^2 term): a layer keeps
  ~(16h + 4kv + 8i) bytes per token (fp32 RMSNorm inputs 2x4h, norm outputs 2x2h, q 2h, k/v
  2x2kv, attention output 2h, gate/up/act/product 4x2i). `model.gradient_checkpointing` (raypack/
  model/checkpointing.py): `full` keeps only each layer's input (2h), plus one layer recomputed;
  `selective` keeps the input, the matmul outputs and the attention's output and log-sum-exp
  (2h + 2(q + 2kv + h + 2i + h) + 2q + 4 x heads), plus one layer's recomputed elementwise work
  (counted as a whole layer); `none` keeps every layer whole. The backward through frozen layers needs
  the same tensors (each adapter's A reads the linear's saved input), and LoRA adds its own: the
  r-wide A x of every adapted linear (2r B per token), and with dropout the dropped-out input and
  its mask (3 B per input feature). `model.tiled_mlp_tokens` keeps the MLP's 8i bytes a token for
  one tile only; `model.offload_checkpoints` moves the layers' inputs (2h x layers a token) to the
  host. With `train.sequence_parallel` N, T is a rank's 1/N of the row.
- hybrids (Qwen3.5, Nemotron-H, LFM2, ...): a layer whose token mixer is a gated delta rule, Mamba-2
  or a short convolution (raypack/model/mixers.py) keeps the layer less attention's q, k, v and
  output, plus what its mixer keeps on the exact torch path (raypack/train/memory/mixers.py): the
  row's examples in length buckets, each padded to its own longest (raypack/model/mixer_buckets.py),
  with the scans' fp32 chunk products and the recurrent state at every chunk (heads x k x v for the
  gated delta rule, heads x head_dim x state for Mamba-2) per example. `raypack plan` sizes it for
  the plan's widest padded batch (Plan.widest_padded, examples x longest: an upper bound of the
  buckets); without a plan, one example of T tokens. Under `selective` the mixer's part
  is counted whole. Parameters are the model's own count (its structure on the meta device).
- vision-language models (Qwen2/2.5/3-VL): the vision tower and projector are parameters like
  the rest (less what `model.freeze` freezes), and the tower keeps, per patch of the micro-batch,
  what raypack/train/memory/vision.py counts (checked against autograd on the tiny Qwen2.5-VL),
  for the plan's widest micro-batch in patches (`raypack plan`, and the workers from the prepared
  data's stats); without a plan, every token an image token. Its recomputed block and the language
  model's recomputed layer never coexist: the larger counts.
- loss: the logits at their peak, 12 B per element (bf16 logits 2 + fp32 upcast 4 + fp32 gradient
  4 + bf16 gradient 2), over all T tokens (`train.loss: full`) or one chunk (`chunked`), whose fp32
  sum of the head's gradient (4 B x vocab x hidden) is counted too where the head trains (not with
  adapters: the chunked loss refuses an adapted head).
- not counted: CUDA context, NCCL buffers and allocator fragmentation, ~3-5 GB per GPU.

`model.gradient_checkpointing: auto` picks a mode by this estimate: raypack/train/memory/auto.py.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from raypack.config import Config, PeftConfig
from raypack.train.memory.engines import engine_state
from raypack.train.memory.mixers import MixerLayers, mixer_layers
from raypack.train.memory.vision import Tower, vision_tower

if TYPE_CHECKING:
    from raypack.model.facts import ModelFacts

GB = 1e9
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""A layer's linear weights, by the names transformers gives Llama-like layers (and peft matches)."""
SAVED_MODULES = ("embed_tokens", "lm_head")
"""`modules_to_save` names this arithmetic sizes (a vocab x hidden matrix each)."""
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per QLoRA base weight: 4 bits, plus bitsandbytes' double-quantized constants (block 64)."""
LOGIT_BYTES = 12
"""Per logit at the loss's peak: bf16 logits 2 + fp32 upcast 4 + fp32 gradient 4 + bf16 gradient 2."""

CHUNK_TOKENS = 2048
"""Auto chunk size, in label tokens. Every chunk adds its dW (as large as the head, V x H) into an fp32
sum, a fixed cost per chunk, so fewer, larger chunks are faster: that sum moves O(V x H) bytes a
chunk against the chunk's O(C x V x H) matmul FLOPs, so its share depends on C, not on V or H. On an H100 (1.2B model, 128k vocabulary,
16k tokens a step; benchmarks/results/loss_memory_h100_20261123_chunk*.md) a train step ran at
0.94x / 0.98x / 1.00x of the full loss's tokens/s with 512 / 1024 / 2048-token chunks, for 1.7 to 2.9
GiB more peak memory at 2048 than at 512 (the full loss peaked at 32 GiB with gradient checkpointing,
59 GiB without)."""
CHUNK_BYTES = 2**30
"""...capped so that one chunk's fp32 logits stay within 1 GiB (the chunk's whole working set, bf16
logits, fp32 copy, softmax and gradients, is ~5x that): 2048 tokens up to a 131k vocabulary."""


def default_chunk(vocab: int) -> int:
    """Label tokens per chunk when train.loss_chunk_tokens is 0: CHUNK_TOKENS, capped by CHUNK_BYTES."""
    return min(CHUNK_TOKENS, max(64, CHUNK_BYTES // (4 * vocab) // 64 * 64))


CHECKPOINTING = ("none", "selective", "full")
"""model.gradient_checkpointing's modes, fastest first (raypack/model/checkpointing.py's MODES)."""


@dataclass(frozen=True)
class Arch:
    """A decoder's shape, as its transformers config states it."""

    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    head_dim: int = 0
    """0: hidden // heads."""
    mixers: tuple[MixerLayers, ...] = ()
    """A hybrid's token mixers other than attention (raypack/train/memory/mixers.py), each in
    place of attention in its layers."""
    counted_params: int = 0
    """The model's own parameter count where its structure was read (hybrids); 0: the arithmetic's."""
    tower: Tower | None = None
    """A VLM's vision tower and projector (raypack/train/memory/vision.py): in the parameters, and
    its activations over a micro-batch's patches."""

    @classmethod
    def from_config(cls, config: Any, trust_remote_code: bool = False) -> Arch:
        """From a transformers config (`raypack.model.build.model_config`: no weights needed)."""
        from raypack.model.facts import describe  # transformers: only where a config is sized

        return cls.from_facts(describe(config, trust_remote_code))

    @classmethod
    def from_facts(cls, facts: ModelFacts) -> Arch:
        """From a model's description (raypack/model/facts.py). A hybrid's mixers and parameter
        count, and a VLM's tower, come from its structure on the meta device; where transformers
        builds none here (remote code not at hand), it is sized as a Llama-like decoder."""
        if facts.varies:
            raise AttributeError(f"{type(facts.text).__name__} sets {', '.join(facts.varies)} per layer")
        if missing := [name for name in ("layers", "hidden", "heads", "vocab") if getattr(facts, name) is None]:
            raise AttributeError(f"{type(facts.config).__name__} names no {', '.join(missing)}")
        tree = facts.meta_tree()
        hybrid = mixer_layers(tree.decoder, tree.mixers) if tree is not None else ()
        return cls(layers=facts.layers, hidden=facts.hidden, inter=facts.inter, heads=facts.heads,
                   kv_heads=facts.kv_heads, vocab=facts.vocab, tied=facts.tied, qkv_bias=facts.qkv_bias,
                   head_dim=0 if facts.head_dim == facts.hidden // facts.heads else facts.head_dim,
                   mixers=hybrid, counted_params=sum(p.numel() for p in tree.model.parameters()) if hybrid else 0,
                   tower=vision_tower(tree, facts.config) if tree is not None and facts.vlm else None)  # fmt: skip

    @property
    def q(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def linears(self) -> dict[str, tuple[int, int]]:
        """A layer's linear weights: name -> (in, out) features."""
        h, i = self.hidden, self.inter
        return {"q_proj": (h, self.q), "k_proj": (h, self.kv), "v_proj": (h, self.kv), "o_proj": (self.q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def linear_params(self) -> int:
        """Per layer: the weights QLoRA quantizes."""
        return sum(a * b for a, b in self.linears().values())

    @property
    def layer_params(self) -> int:
        bias = self.q + 2 * self.kv if self.qkv_bias else 0
        return self.linear_params + bias + 2 * self.hidden  # + two RMSNorm weights

    @property
    def mixer_layers(self) -> int:
        """Layers whose token mixer is one of `mixers`, not attention."""
        return sum(m.layers for m in self.mixers)

    @property
    def params(self) -> int:
        if self.counted_params:
            return self.counted_params
        embed = self.vocab * self.hidden
        tower = self.tower.params if self.tower else 0
        return self.layers * self.layer_params + embed * (1 if self.tied else 2) + self.hidden + tower


def adapted(peft: PeftConfig) -> tuple[str, ...]:
    """The projections `peft.target_modules` reaches in every layer (peft matches a module whose
    path ends with a target, so `self_attn.q_proj` is every layer's q_proj)."""
    if layer := next((t for t in peft.target_modules if any(part.isdigit() for part in t.split("."))), None):
        raise ValueError(f"model.peft.target_modules: can't size {layer!r}, which names some layers only")
    names = {t.rsplit(".", 1)[-1] for t in peft.target_modules}
    if "all-linear" in names:
        return PROJECTIONS
    if unknown := sorted(names - set(PROJECTIONS)):
        raise ValueError(f"model.peft.target_modules: can't size {unknown}; the estimate knows {', '.join(PROJECTIONS)}")
    return tuple(p for p in PROJECTIONS if p in names)


def trained_params(arch: Arch, peft: PeftConfig, freeze: tuple[str, ...] = ()) -> int:
    """Parameters that get gradients and optimizer state: all of them less a VLM's frozen parts
    (`model.freeze`), or the adapters (+ DoRA's magnitudes) and the `modules_to_save` copies (the
    adapters peft puts in a vision tower are not counted)."""
    if not peft.enabled:
        tower = arch.tower
        if tower is None:
            return arch.params
        return (arch.params - ("vision" in freeze) * (tower.params - tower.projector)
                - ("projector" in freeze) * tower.projector)
    shapes = arch.linears()
    per_layer = sum(peft.r * (a + b) + (b if peft.use_dora else 0) for a, b in (shapes[p] for p in adapted(peft)))
    saved = {m.rsplit(".", 1)[-1] for m in peft.modules_to_save}
    if unknown := sorted(saved - set(SAVED_MODULES)):
        raise ValueError(f"model.peft.modules_to_save: can't size {unknown}; the estimate knows {', '.join(SAVED_MODULES)}")
    return arch.layers * per_layer + len(saved) * arch.vocab * arch.hidden


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU, term by term (see the module docstring); `host` is per rank, in host RAM."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    head_sum: float
    """The chunked loss's fp32 sum of the head's gradient (0 if the head is frozen or the loss full)."""
    host: float
    trained: int
    checkpointing: str = "full"
    """The model.gradient_checkpointing mode the activations were sized for."""
    mixers: str = ""
    """A hybrid's mixer layers and the padded batch they were sized for ("" if none)."""

    @property
    def loss(self) -> float:
        return self.logits + self.head_sum

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.loss

    def line(self, cfg: Config, arch: Arch, tokens: int | None = None) -> str:
        """One line: the total, its terms, and the setting they were computed for."""
        m, t = cfg.model, cfg.train
        unit, scale = ("GB", GB) if self.total >= 0.1 * GB else ("MB", 1e6)  # tiny models: MB
        terms = " + ".join(f"{name} {value / scale:.1f}" for name, value in (
            ("weights", self.weights), ("gradients", self.grads), ("optimizer", self.optimizer),
            ("activations", self.activations), ("loss", self.loss)))  # fmt: skip
        host = f"; host {self.host / scale:.1f} {unit} per rank" if self.host else ""
        mode = "full fine-tuning" if not m.peft.enabled else f"{m.peft.method} r{m.peft.r}"
        zero = (f"ZeRO-{t.zero_stage}" if t.engine == "deepspeed" else
                "torch engine, " + ("DDP" if t.zero_stage == 0 else f"FSDP2 zero_stage {t.zero_stage}"))
        zero += " + optimizer offload" if t.offload_optimizer else ""
        return (f"{self.total / scale:.1f} {unit} = {terms}{host} ({mode}: {_count(self.trained)} of {_count(arch.params)} "
                f"params trained; {zero} over {t.num_workers} rank(s); {t.precision} precision; gradient checkpointing "
                f"{self.checkpointing}; {_row(cfg, tokens)}; {self.mixers + '; ' if self.mixers else ''}{t.loss} loss; "
                f"{unit} = 1e{9 if unit == 'GB' else 6} B; ~3-5 GB of CUDA context and buffers not counted)")  # fmt: skip


def _row(cfg: Config, tokens: int | None) -> str:
    if tokens or cfg.train.sequence_parallel == 1:
        return f"{tokens or cfg.pack.budget} tokens a row"
    return f"{cfg.pack.budget} tokens a row over {cfg.train.sequence_parallel} ranks, {rank_tokens(cfg)} a rank"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def rank_tokens(cfg: Config) -> int:
    """Tokens a rank holds of a full row: pack.budget, or its 1/N under sequence parallelism (the
    all-to-all's buffers, a layer's q, k, v and output twice over, come and go within a layer)."""
    return -(-cfg.pack.budget // cfg.train.sequence_parallel)


def chunk_tokens(cfg: Config, vocab: int) -> int:
    """The chunked loss's chunk, as raypack.train.objectives.loss.CausalLMLoss picks it."""
    return cfg.train.loss_chunk_tokens or default_chunk(vocab)


def preset_zero(cfg: Config) -> dict[str, Any]:
    """The `zero_optimization` section of the run's DeepSpeed preset (bucket sizes, live params)."""
    from raypack.train.presets import load_preset  # JSON only: no DeepSpeed import

    return load_preset(cfg.train.deepspeed_preset).get("zero_optimization", {})


def estimate(cfg: Config, arch: Arch, *, tokens: int | None = None, loss: str | None = None,
             chunk: int | None = None, zero: Mapping[str, Any] | None = None,
             checkpointing: str | None = None, padded: tuple[int, int] | None = None,
             patches: int | None = None, shard_ranks: int | None = None) -> Memory:
    """Bytes per GPU of a run of `cfg` on a model of shape `arch`: `tokens` per micro-batch (default
    a rank's share of pack.budget), `loss` full or chunked (default train.loss) in chunks of `chunk` tokens (default
    the loss's own), `zero` the preset's ZeRO section (default read from train.deepspeed_preset),
    `checkpointing` one of CHECKPOINTING (default model.gradient_checkpointing; `auto` must be resolved
    first, by memory/auto.py), `padded` the (examples, longest example) of the row a hybrid's
    mixers run as a padded batch (default one example of all the tokens: no padding), `patches` the
    most patches a micro-batch runs through a VLM's vision tower (the plan's widest; default every
    token an image token, the most a row of `tokens` can carry), `shard_ranks` the ranks FSDP2 shards
    over (default all: memory/engines.py's shard_ranks_of)."""
    t, peft = cfg.train, cfg.model.peft
    mode = checkpointing or cfg.model.gradient_checkpointing
    if mode not in CHECKPOINTING:
        raise ValueError(f"estimate: gradient checkpointing {mode!r}; expected one of {', '.join(CHECKPOINTING)}")
    zero = preset_zero(cfg) if zero is None else zero
    tokens = tokens or rank_tokens(cfg)
    p = arch.params
    trained = trained_params(arch, peft, cfg.model.freeze)

    base = None
    if peft.method == "qlora":  # ZeRO 0-2 (the config refuses 3): whole on every GPU
        quantized = arch.layers * arch.linear_params
        working = max(a * b for a, b in arch.linears().values())  # one linear dequantized at a time
        base = NF4_BYTES * quantized + 2 * (p - quantized) + 2 * working
    # what the engine keeps of the weights, gradients and optimizer state (memory/engines.py)
    state = engine_state(cfg, arch, trained, zero, base, shard_ranks)
    weights, grads, optimizer, host = state.weights, state.grads, state.optimizer, state.host

    h, q, kv, i = arch.hidden, arch.q, arch.kv, arch.inter
    per_layer = 16 * h + 4 * kv + 8 * i
    # selective: the layer's input, the seven matmul outputs, the attention's output and its fp32 log-sum-exp
    kept = 2 * h + 2 * (q + 2 * kv + h + 2 * i + h) + 2 * q + 4 * arch.heads
    if peft.enabled:
        shapes = arch.linears()
        per_layer += sum(2 * peft.r + (3 * shapes[name][0] if peft.dropout > 0 else 0) for name in adapted(peft))
        kept += 2 * peft.r * len(adapted(peft))  # each adapter's A x is a matmul output too
    m = cfg.model
    # model.tiled_mlp_tokens: the MLP's gate/up/act/product exist for one tile at a time
    tile = min(m.tiled_mlp_tokens or tokens, tokens)
    layer = tokens * per_layer - (tokens - tile) * 8 * arch.inter
    # A hybrid's mixer layers (memory/mixers.py): the layer less attention's q, k, v and output
    # (and, kept by selective, its matmul outputs and log-sum-exp), plus what the mixer keeps over
    # its padded batch. Selective keeps the mixers' matmul outputs, most of what their scans keep:
    # counted whole.
    examples, longest = padded or (1, tokens)
    mixed = sum(x.activations(examples, longest, tokens) for x in arch.mixers)
    n_mixed, n_attention = arch.mixer_layers, arch.layers - arch.mixer_layers
    biggest = max((x.activations(examples, longest, tokens) / x.layers for x in arch.mixers), default=0.0)
    attention = tokens * (4 * h + 4 * kv)
    largest = max(layer, layer - attention + biggest) if arch.mixers else layer  # the layer recomputed
    if mode == "full":
        saved = tokens * 2 * arch.hidden * arch.layers  # each layer's input, kept for backward
        activations = 2 * largest + (0 if m.offload_checkpoints else saved)
        host += saved if m.offload_checkpoints else 0.0
    elif mode == "selective":
        kept_attention = 2 * (q + 2 * kv + h) + 2 * q + 4 * arch.heads
        activations = 2 * largest + tokens * (kept * n_attention + (kept - kept_attention) * n_mixed) + mixed
    else:
        activations = layer * arch.layers - attention * n_mixed + mixed
    tower = arch.tower
    if tower is not None:  # memory/vision.py: its blocks over the micro-batch's patches
        patches = tokens * tower.merge if patches is None else patches
        recomputed = 2 * largest if mode != "none" else 0.0
        # the tower's block recomputed in backward and the language model's layer never coexist
        activations += tower.activations(patches, mode) + max(0.0, 2 * tower.recomputed(patches, mode) - recomputed)
    kind = loss or t.loss
    if kind == "full":
        logits, head_sum = LOGIT_BYTES * tokens * arch.vocab, 0.0
    else:
        logits = LOGIT_BYTES * min(chunk or chunk_tokens(cfg, arch.vocab), tokens) * arch.vocab
        # With adapters the head is frozen: the chunked loss refuses one an adapter reaches.
        head_sum = 0.0 if peft.enabled else 4 * arch.vocab * arch.hidden
    told = ", ".join(f"{x.layers} {x.kind}" for x in arch.mixers)
    told = f"{told} layer(s) on the torch path over {examples} example(s) x {longest} tokens" if told else ""
    if tower is not None:
        told = (told + "; " if told else "") + f"vision tower over {patches} patches a micro-batch"
    return Memory(weights=weights, grads=grads, optimizer=optimizer, activations=activations, logits=logits,
                  head_sum=head_sum, host=host, trained=trained, checkpointing=mode, mixers=told)  # fmt: skip


def summary(cfg: Config, arch: Arch, padded: tuple[int, int] | None = None, patches: int | None = None) -> str:
    """`Memory.line` of cfg's run (a hybrid's mixers sized for `padded`, as `estimate`); under
    `auto`, which the worker's device decides, every mode's total first, then full's line."""
    if cfg.model.gradient_checkpointing != "auto":
        return estimate(cfg, arch, padded=padded, patches=patches).line(cfg, arch)
    sizes = {c: estimate(cfg, arch, checkpointing=c, padded=padded, patches=patches) for c in CHECKPOINTING}
    unit, scale = ("GB", GB) if sizes["full"].total >= 0.1 * GB else ("MB", 1e6)
    told = ", ".join(f"{c} {m.total / scale:.1f} {unit}" for c, m in sizes.items())
    return (f"{told} by gradient checkpointing mode (auto: each worker takes the fastest that fits its device); "
            f"with full: {sizes['full'].line(cfg, arch)}")


def tower_cost(config: Any, trust_remote_code: bool = False):
    """A VLM's vision tower's cost against its language model's (memory.vision.Tower.cost), which
    the plan's balance weighs patches by; None for a model without a tower the arithmetic knows."""
    from raypack.model.facts import describe

    facts = describe(config, trust_remote_code)
    if not facts.vlm:
        return None
    arch = Arch.from_facts(facts)
    if arch.tower is None:
        return None
    lm_token = 6 * (arch.layers * arch.linear_params + arch.vocab * arch.hidden)
    return arch.tower.cost(token_flops=lm_token, length_flops=6 * arch.layers * arch.q)
