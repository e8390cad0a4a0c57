"""A Hugging Face folder from any checkpoint a run reported, on the CPU: what `raypack export` writes.

    done = export("results/tiny_cpu")                          # the last checkpoint
    done = export(run, step=200, out="exports/s200", dtype="bfloat16")
    done = export(run, best="eval_loss")                       # the lowest eval_loss reported

    RUN/checkpoint_manager_snapshot.json ─> which checkpoint: step N, the lowest eval_loss, or the last
    RUN/checkpoint_*/ds/ or torch/ (from a URI: downloaded) ─> checkpoint.read_saved ─> the weights, whole
    RUN/raypack_config.yaml ─> the model's skeleton, the tokenizer and the chat template it trained with
        ─> OUT/model/            a full fine-tune: weights and tokenizer, as the final checkpoint's model/
           OUT/adapter/, model/, base/    LoRA: the final checkpoint's layout (adapters.save_adapted)

Which checkpoint holds which step: Ray Train's snapshot records the metrics each kept checkpoint
was reported with (the file a resume continues from, so it lists exactly the registered ones);
the TrainState inside the checkpoint confirms the step.

Exact or refused. A full fine-tune's weights are all in the checkpoint. With LoRA the frozen base
weights are not: they come from where training took them (model.name, or for a base built from a
config, the train.seed init, which every engine and stage builds alike, or the run's final base/),
and must match the checksums of them that the checkpoint carries (each rank's: its whole copy, or
its ZeRO-3 or FSDP2 shard, `adapters.expected_digests`), or the export stops. QLoRA's adapters were
trained on 4-bit weights, which no merged full-precision model reproduces: only `adapter_only`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raypack import runs, storage
from raypack.config import Config
from raypack.data.encode import load_image_processor, load_tokenizer
from raypack.data.image_layouts import processor_settings
from raypack.errors import ConfigError, InputError
from raypack.model.adapters import apply_adapters, expected_digests, save_adapted
from raypack.model.build import load_model, meta_model, model_config, resolve_dtype
from raypack.model.vision import ProcessorParts, trains_as_vlm
from raypack.train.checkpoint import Saved, read_saved
from raypack.train.engines import ENGINES

EXPORT_INFO = "raypack_export.json"
"""Written into the output folder: which run, checkpoint and step it came from, in which dtype."""


class ExportError(InputError):
    """A run or checkpoint that can't be exported as asked (the message names the run folder)."""


@dataclass(frozen=True)
class Reported:
    """One checkpoint a run reported and Ray Train still keeps."""

    step: int
    name: str
    """Its folder's name under the run folder (checkpoint_<time>)."""
    metrics: dict[str, Any]


@dataclass
class Exported:
    """What `export` wrote."""

    out: str
    step: int
    checkpoint: str
    dtype: str
    folders: list[str]
    """The Hugging Face folders under `out`: model, or adapter (and model, base) for LoRA."""
    base: str | None = None
    """With adapters: what adapter/ loads onto (OUT/base, or model.name)."""
    metrics: dict[str, Any] = field(default_factory=dict)


# --- which checkpoint -----------------------------------------------------------------------------


def reported(root: str) -> list[Reported]:
    """The run's kept checkpoints, by step."""
    found = [Reported(int(c["metrics"]["step"]), c["checkpoint_dir_name"], c["metrics"])
             for c in runs.reported_checkpoints(root) if c.get("metrics", {}).get("step") is not None]
    return sorted(found, key=lambda r: r.step)


def choose(root: str, step: int | None = None, best: str | None = None) -> Reported:
    """The checkpoint at `step`, or with the lowest `best` metric, or else the last one."""
    kept = reported(root)
    if not kept:
        raise ExportError(f"run {root} has no checkpoint yet (no {runs.CHECKPOINTS} there)")
    steps = ", ".join(str(r.step) for r in kept)
    if step is not None:
        if match := [r for r in kept if r.step == step]:
            return match[-1]
        raise ExportError(f"run {root} has no checkpoint at step {step}; its checkpoints are at steps {steps} "
                          "(Ray Train keeps the last train.keep_checkpoints)")
    if best is not None:
        scored = [r for r in kept if _finite(r.metrics.get(best))]
        if not scored:
            raise ExportError(f"run {root}: no checkpoint reported {best} (checkpoints at steps {steps}); a run "
                              "evaluates at train.eval_every_steps and at its last step, on data.eval_fraction > 0")
        return min(scored, key=lambda r: (r.metrics[best], -r.step))
    return kept[-1]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def default_out(root: str, step: int) -> str:
    """RUN/export/step_<N>; a URI run has none (an export is read here, so it is written here)."""
    if storage.is_uri(root):
        raise ConfigError(f"run {root} is not on this machine: name a local folder for the export with --out")
    return f"{root}/export/step_{step}"


@contextmanager
def local_checkpoint(root: str, name: str,
                     parts: tuple[str, ...] = ("latest", *(tag for _, tag in ENGINES.values()))) -> Iterator[Path]:
    """The checkpoint folder on this machine: as it is when local; from a URI, `parts` of it
    downloaded into a temporary folder removed on exit (not the final model/ it may also hold)."""
    path = f"{root}/{name}"
    if not storage.is_uri(root):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="raypack-export-") as tmp:
        for part in parts:
            if storage.exists(f"{path}/{part}"):
                storage.download(f"{path}/{part}", f"{tmp}/{part}")
        yield Path(tmp)


# --- export ---------------------------------------------------------------------------------------


def export(
    root: str, *, step: int | None = None, best: str | None = None, out: str | None = None,
    dtype: str | None = None, merge: bool | None = None, adapter_only: bool = False,
    log: Callable[[str], None] = print,
) -> Exported:
    """Write the chosen checkpoint of the run in `root` (a folder or URI) as Hugging Face folders
    under `out` (default: `default_out`), in `dtype` (default: the dtype it trained in). With
    adapters, `merge` (default: model.peft.merge) also writes the merged model/; `adapter_only`
    writes adapter/ alone, needing no base weights."""
    root = storage.absolute(root)
    if not storage.exists(f"{root}/{runs.SAVED_CONFIG}"):
        if not storage.exists(root):
            raise ExportError(f"{root}: no such folder")
        raise ExportError(f"{root}: not a raypack run folder (no {runs.SAVED_CONFIG} there)")
    cfg = runs.saved_config(root)
    peft = cfg.model.peft
    if adapter_only and not peft.enabled:
        raise ExportError(f"run {root} trained every weight (model.peft.method: none): it has no adapter to "
                          "export alone")
    if peft.method == "qlora" and not adapter_only:
        raise ExportError(f"run {root} trained QLoRA adapters on 4-bit base weights: no full-precision model/ is the "
                          "model that trained, so export writes none; export the adapter with --adapter-only and load "
                          f"it onto {cfg.model.name} in 4 bits")
    chosen = choose(root, step, best)
    if out and storage.is_uri(out):
        raise ConfigError(f"--out {out}: name a local folder (copy it to object storage after)")
    out = str(Path(out).expanduser().resolve()) if out else default_out(root, chosen.step)
    check_out(out)
    log(f"[raypack] run {root}: checkpoint of step {chosen.step} ({chosen.name}); "
        f"kept: steps {', '.join(str(r.step) for r in reported(root))}")
    # Staged from the start, so a folder that can't be made stops it before the checkpoint is read;
    # a failed or interrupted export leaves nothing a second try would refuse.
    with staged(out) as staging:
        tokenizer = load_tokenizer(cfg.tokenize.tokenizer, cfg.tokenize.chat_template)
        if trains_as_vlm(model_config(cfg.model.name, cfg.model.trust_remote_code, vocab_size=len(tokenizer))):
            # the image processor beside the tokenizer, as the run's final model/ has it
            tokenizer = ProcessorParts(tokenizer, load_image_processor(cfg.tokenize.tokenizer),
                                       processor_settings(cfg.tokenize.tokenizer))
        with local_checkpoint(root, chosen.name) as folder:
            saved = read_saved(folder, adapters=peft.enabled)
        if saved.state.step != chosen.step:
            raise ExportError(f"run {root}: {chosen.name} was reported at step {chosen.step} but holds step "
                              f"{saved.state.step}; the folder was changed after the run")
        out_dtype = resolve_dtype(dtype) if dtype else saved.dtype
        name = str(out_dtype).removeprefix("torch.")
        log(f"[raypack] read the {saved.engine} engine's state (zero_stage {saved.zero_stage}) of {saved.world_size} "
            f"rank(s): {len(saved.weights)} tensors{' (the adapters)' if peft.enabled else ''}; writing {name} weights to {out}")
        folders, base = _write(cfg, saved, tokenizer, root, staging, out, out_dtype, merge, adapter_only, log)
        info = {"run": root, "checkpoint": chosen.name, "step": chosen.step, "dtype": name, "folders": folders,
                "metrics": chosen.metrics}
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=1))
    return Exported(out, chosen.step, chosen.name, name, folders, base, chosen.metrics)


# --- where it goes --------------------------------------------------------------------------------


def check_out(out: str) -> None:
    """An ExportError, before any work, for an output folder that can't be written: a file, a
    folder with files in it, or one that can't be made (a file on its path, no permission)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ExportError(f"--out {out} is a file; name a folder (made if missing)")
    if path.is_dir() and any(path.iterdir()):
        raise ExportError(f"{out} exists already; remove it, or name another folder with --out")
    above = path.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ExportError(f"--out {out}: can't make it, {above} is a file; name another folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: can't make it, {above} is not writable here; name a folder you can write")


@contextmanager
def staged(out: str) -> Iterator[Path]:
    """A new folder beside `out` to write into, renamed to `out` once everything is in it, so
    `out` is never half-written: an export that stops leaves only its hidden staging folder
    (removed unless killed), and of two exports to one folder the second is refused at the rename,
    not mixed into the first. Files get this process's ordinary permissions (safetensors writes
    its file 0600 through a temporary file)."""
    target = Path(out)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        folder = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
    except OSError as e:
        raise ExportError(f"--out {out}: can't make it ({e.strerror or e}); name a folder you can write") from None
    try:
        yield folder
        _ordinary_permissions(folder)
        try:
            os.rename(folder, target)  # atomic; replaces an empty folder, not a filled one
        except OSError as e:
            raise ExportError(f"{out} was written meanwhile (by another export?); this one is discarded: remove it "
                              f"or name another folder with --out ({e.strerror})") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _ordinary_permissions(folder: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _write(cfg: Config, saved: Saved, tokenizer, root: str, folder: Path, out: str, dtype: torch.dtype,
           merge: bool | None, adapter_only: bool, log: Callable[[str], None]) -> tuple[list[str], str | None]:
    """Write the Hugging Face folders into `folder` (to become `out`); returns their names and
    what adapter/ loads onto."""
    peft, vocab_size = cfg.model.peft, len(tokenizer)
    if not peft.enabled:
        model = _for_inference(full_model(cfg, saved, vocab_size, dtype))
        model.save_pretrained(folder / "model", safe_serialization=True)
        tokenizer.save_pretrained(folder / "model")
        return ["model"], None
    if adapter_only:
        model = adapted_skeleton(cfg, saved, vocab_size)
        model.save_pretrained(folder / "adapter", safe_serialization=True)
        tokenizer.save_pretrained(folder / "adapter")
        return ["adapter"], None if cfg.model.name.startswith("tiny-") else cfg.model.name
    model = adapted_model(cfg, saved, vocab_size, root, log)
    _for_inference(model.get_base_model())  # save_adapted builds what it writes from this config
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    folders = save_adapted(model, state, str(folder), merge=peft.merge if merge is None else merge,
                           tokenizer=tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    return folders, f"{out}/base" if "base" in folders else cfg.model.name


# --- the model, rebuilt -------------------------------------------------------------------------


def full_model(cfg: Config, saved: Saved, vocab_size: int, dtype: torch.dtype):
    """The run's model with every weight from the checkpoint: its skeleton built on the meta device
    from the config (no base weights read), the checkpoint's tensors assigned."""
    m = cfg.model
    model = meta_model(model_config(m.name, m.trust_remote_code, vocab_size=vocab_size), m.trust_remote_code)
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in saved.weights.items()}
    _, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing or unexpected:
        raise ExportError(f"the checkpoint doesn't fit model.name {m.name!r}: "
                          + (f"{len(missing)} weights missing, e.g. {missing[0]}" if missing else
                             f"{len(unexpected)} unknown, e.g. {unexpected[0]}"))
    return model


def adapted_skeleton(cfg: Config, saved: Saved, vocab_size: int):
    """The adapters alone, on a base built on the meta device (no base weights read)."""
    m = cfg.model
    model = apply_adapters(meta_model(model_config(m.name, m.trust_remote_code, vocab_size=vocab_size),
                                      m.trust_remote_code), m.peft, m.name)
    _load_adapters(model, saved, assign=True)
    return model


def shard_groups(saved: Saved) -> list[int | None]:
    """The ranks each shard group held, as the checkpoint may have: FSDP2 over all of them, or
    under HSDP over one node's (fsdp.mesh_shape), a divisor of the world the checkpoint doesn't
    record; a match under any of them is the same weights, rank for rank."""
    n = saved.world_size
    if saved.layout != "fsdp":
        return [None]
    return [None, *(d for d in range(n - 1, 0, -1) if n % d == 0)]


def adapted_model(cfg: Config, saved: Saved, vocab_size: int, root: str, log: Callable[[str], None]):
    """The base weights the run trained on, with the checkpoint's adapters: the first source of
    them whose checksums match the checkpoint's (see the module doc)."""
    m = cfg.model
    recorded = list(saved.state.base_digest)
    tried = []
    for what, build in _base_sources(cfg, root, vocab_size, saved.dtype):
        model = apply_adapters(build(), m.peft, m.name)
        # as loaded, or as DeepSpeed held them: every weight in its dtype, fp32-kept ones too
        held = [None] + ([saved.dtype] if saved.engine == "deepspeed" else [])
        if any(expected_digests(model, saved.world_size, saved.layout, dtype, group) == recorded
               for dtype in held for group in shard_groups(saved)):
            log(f"[raypack] base weights from {what}: their checksums match the checkpoint's")
            _load_adapters(model, saved, assign=False)
            return model
        tried.append(what)
    raise ExportError(f"run {root}: the checkpoint's adapters were trained on other base weights than "
                      f"{' or '.join(tried)} hold (their checksums differ): model.name now names other weights, "
                      "or, for a base built from a config, the run has not finished (no base/ yet) and its "
                      "train.seed or its init differ (a ZeRO-3 run from before tiny models were built whole); "
                      "export the adapter alone with --adapter-only")


def _base_sources(cfg: Config, root: str, vocab_size: int, dtype: torch.dtype):
    """(description, builder) of each place the base weights may come from, cheapest first."""
    m = cfg.model

    def load(source: str, seed: int | None = None):
        def build():
            if seed is not None:
                torch.manual_seed(seed)  # as the worker did before building it (loop.setup)
            model = load_model(source, attention="sdpa", dtype=dtype, trust_remote_code=m.trust_remote_code,
                               vocab_size=vocab_size).eval()
            if m.name.startswith("tiny-"):
                # a base built from a config, even when read from a base/ folder: save_adapted
                # writes base/ for it (the folder read may be a temporary download)
                model.config._name_or_path = model.name_or_path = ""
            return model
        return build

    if not m.name.startswith("tiny-"):
        yield m.name, load(m.name)
        return
    yield f"{m.name} initialized with train.seed={cfg.train.seed}", load(m.name, cfg.train.seed)
    for r in reversed(reported(root)):  # the final checkpoint's base/: the frozen weights, gathered
        if storage.exists(f"{root}/{r.name}/base/config.json"):
            with local_checkpoint(root, r.name, parts=("base",)) as folder:
                yield f"{root}/{r.name}/base", load(str(folder / "base"))


def _load_adapters(model, saved: Saved, assign: bool) -> None:
    _, unexpected = model.load_state_dict(saved.weights, strict=False, assign=assign)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    if unexpected or (missing := [n for n in trained if n not in saved.weights]):
        raise ExportError("the checkpoint's adapters don't fit model.peft: "
                          + (f"{len(unexpected)} unknown, e.g. {unexpected[0]}" if unexpected else
                             f"{len(missing)} missing, e.g. {missing[0]}"))


def _for_inference(model):
    """Training turns the KV cache off (with it on, packed rows leak into each other); generating
    from an export wants it back."""
    model.config.use_cache = True
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True
    return model
