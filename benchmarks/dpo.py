"""Packed DPO (raypack) against TRL's DPOTrainer (padded), same pairs, same steps, in one run.

    PYTHONPATH=. python benchmarks/dpo.py              # CUDA: ~1.1B Llama, bf16
    PYTHONPATH=. python benchmarks/dpo.py --smoke      # tiny model on the CPU: the ratio at toy scale

The same model (a random-init Llama saved once; no download), the same preference pairs (text
from the bundled tokenizer's words, long-tailed prompt and completion lengths, TRL's standard
format, which both sides tokenize identically: tests/unit/data/test_pairs.py), the same number of
optimizer steps, each configuration a fresh process:

- `trl`: TRL's DPOTrainer, `precompute_ref_log_probs=True`, `--pairs-per-step` pairs a device
  batch, padded as it pads (chosen and rejected of the batch to their longest; padding_free is
  unavailable in TRL's DPO), its fused chunked log-probabilities, gradient checkpointing as raypack's.
- `raypack`: `raypack train` with `train.objective: dpo` on one worker (Ray Train, DeepSpeed
  ZeRO-2, the chunked loss, the balanced strategy), its budget the pairs a step times their mean
  length, so a row holds as many pairs, on average, as TRL's batch.
- `steps`: the two steps alone, in one process, alternating round by round, every pair of the
  data once a round: TRL's (its collator's padded batches of `--pairs-per-step` pairs, its loss,
  backward) against raypack's (its packed rows, its DPO loss, backward), the same weights, no
  optimizer. Both see the same real tokens (checked), so the time ratio is the throughput ratio,
  and a busy shared host slows both alike: the comparison to trust on a CPU.
- `lora-reference`: LoRA (r 16) with the reference precomputed against on the fly (a no-grad
  forward with the adapters off in every step): which is faster, with the precompute's one pass
  counted in (`dpo.reference: auto` picks the one measured faster). In one process without Ray,
  the two step kinds alternating round by round on the same packed rows, medians over rounds,
  so that a busy shared host slows both alike.

Measured per configuration over optimizer steps warmup+1..warmup+steps: real tokens/s (TRL: its
attention mask's tokens, counted at the model's input; raypack: its TensorBoard tokens), pairs/s,
peak memory (GPU: torch's peak allocated; CPU: the process's peak RSS, raypack's worker), and the
reference pass (TRL: its precompute in __init__, timed; raypack: the seconds its reference entry
records). Results: benchmarks/results/dpo_<device>_<yyyymmdd>.md (--smoke: the temp folder).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")  # ray.train.report blocks ~2 s a call otherwise

import numpy as np  # noqa: E402

from benchmarks.common import (child_env, command_line, device_name, gpu_or_smoke, machine, smoke_banner,  # noqa: E402
                               versions, write_results)

CONFIGS = ("steps", "trl", "raypack", "lora-reference")
ROUNDS = 5
"""Alternating rounds of the in-process comparisons (`--rounds`; 2 for --smoke)."""


def write_pairs(path: Path, n: int, max_words: int, seed: int) -> dict:
    """`n` standard-format pairs: prompt, chosen and rejected of long-tailed word counts."""
    from raypack.data.synthetic import _WORDS

    rng = np.random.default_rng(seed)

    def text(k: int) -> str:
        return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), max(1, k)))

    def words(median: float) -> int:
        return int(np.clip(rng.lognormal(np.log(median), 0.9), 2, max_words))

    rows = [{"prompt": text(words(60)), "chosen": " " + text(words(90)), "rejected": " " + text(words(90))}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"pairs": n}


def save_model(path: Path, smoke: bool, seed: int) -> None:
    import torch
    from transformers import LlamaConfig

    from benchmarks.attention_throughput import LLAMA_1B
    from raypack.model.build import load_model, tiny_config

    torch.manual_seed(seed)
    config = (tiny_config("llama", vocab_size=768) if smoke else
              LlamaConfig(**{**LLAMA_1B, "vocab_size": 768}, pad_token_id=2, bos_token_id=0, eos_token_id=1))
    config.use_cache = False
    load_model(config, attention="sdpa", dtype="float32" if smoke else "bfloat16").save_pretrained(path)


def peak_gib(cuda: bool) -> float:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# --- one configuration, in its own process -----------------------------------------------------------


def child_trl(args, work: Path) -> dict:
    import datasets
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from raypack.config import ASSETS

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)  # as raypack's workers run (Ray gives each one thread)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa")
    tokens, times = [], []

    def count(module, a, kwargs):  # real tokens: the padded batch's attention mask
        mask = kwargs.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(kwargs["input_ids"].numel()))

    model.register_forward_pre_hook(count, with_kwargs=True)

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append((time.time(), sum(tokens)))
            if len(times) == args.warmup and cuda:
                torch.cuda.reset_peak_memory_stats()

    config = DPOConfig(
        output_dir=str(work / "trl"), beta=0.1, precompute_ref_log_probs=True, max_length=None,
        per_device_train_batch_size=args.pairs_per_step, gradient_accumulation_steps=1, bf16=cuda,
        activation_checkpointing=args.gradient_checkpointing, max_steps=args.warmup + args.steps,
        learning_rate=1e-5, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, report_to=[],
        save_strategy="no", seed=args.seed, dataloader_num_workers=0, use_cpu=not cuda,
    )  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    data = datasets.load_dataset("json", data_files=str(work / "pairs.jsonl"), split="train")
    t0 = time.time()
    trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tok, callbacks=[Clock()])
    setup_s = time.time() - t0
    trainer.train()
    (t0, n0), (t1, n1) = times[args.warmup - 1], times[-1]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"tokens_per_s": (n1 - n0) / (t1 - t0), "pairs_per_s": args.pairs_per_step * args.steps / (t1 - t0),
            "step_s": (t1 - t0) / args.steps, "peak_gib": peak_gib(cuda), "loss": losses[-1],
            "reference_s": setup_s, "reference_what": "DPOTrainer.__init__ (tokenize + reference pass)"}


def child_raypack(args, work: Path) -> dict:
    import torch

    from benchmarks.train_throughput import read_tensorboard
    from raypack.config import Config, DataConfig, DpoConfig, ModelConfig, PackConfig, RunConfig, TokenizeConfig, TrainConfig
    from raypack.runs import run_dir
    from raypack.train.trainer import start

    cuda = torch.cuda.is_available()
    cfg = Config(
        data=DataConfig(paths=(str(work / "pairs.jsonl"),), eval_fraction=0.0),
        tokenize=TokenizeConfig(num_cpus=0.5, max_length=args.budget),
        pack=PackConfig(strategy="balanced", budget=args.budget, seed=args.seed),
        model=ModelConfig(name=str(work / "model"), dtype="bfloat16" if cuda else "float32",
                          gradient_checkpointing=args.gradient_checkpointing),
        train=TrainConfig(objective="dpo", num_workers=1, use_gpu=cuda, zero_stage=2, grad_accum=1,
                          max_steps=args.warmup + args.steps, seed=args.seed, warmup_steps=2, lr=1e-5,
                          report_every_steps=5, checkpoint_every_steps=0, eval_every_steps=0, max_failures=0),
        dpo=DpoConfig(beta=0.1),
        run=RunConfig(name="raypack", storage_path=str(work / "runs")),
    )  # fmt: skip
    result = start(cfg).result
    root = Path(run_dir(cfg))
    tb = read_tensorboard(str(root / "tensorboard"))
    measured = range(args.warmup + 1, args.warmup + args.steps + 1)
    tokens = sum(tb[s]["train/tokens"] for s in measured)
    pairs = sum(tb[s]["train/pairs"] for s in measured)
    t0, t1 = tb[args.warmup]["wall_time"], tb[args.warmup + args.steps]["wall_time"]
    manifests = list((root / "packed" / "reference").glob("*/manifest.json"))
    reference_s = json.loads(manifests[0].read_text())["seconds"] if manifests else 0.0
    return {"tokens_per_s": tokens / (t1 - t0), "pairs_per_s": pairs / (t1 - t0), "step_s": (t1 - t0) / args.steps,
            "peak_gib": (result.metrics or {}).get("peak_memory_gb", float("nan")),
            "loss": tb[args.warmup + args.steps]["train/loss"], "reference_s": reference_s}


def packed_rows(path: Path, budget: int) -> list[dict]:
    """The pairs of `path` as raypack packs them for one rank (tokenize, plan, route, assemble), no Ray."""
    from raypack.config import ASSETS, PackConfig
    from raypack.data.encode import Encoder, kept_rows
    from raypack.data.listing import Sources, read_units
    from raypack.data.pack import Router, assemble_rows, plan_routing
    from raypack.data.sources import read_unit
    from raypack.data.strategies import make_plan

    unit = read_units(Sources.of((str(path),)).files)[0]
    raw = read_unit({k: [v] for k, v in unit.items()}, "auto")
    table = kept_rows(Encoder(str(ASSETS / "tokenizer"), None, "auto", "truncate", budget).encode_table(raw))
    table = table.sort_by("example_id")
    plan = make_plan(table["length"].to_numpy(), PackConfig(strategy="balanced", budget=budget), 1, pairs=True)
    return assemble_rows(Router(plan_routing(plan, table["example_id"].to_numpy()))(table), True).to_pylist()


def child_steps(args, work: Path) -> dict:
    """TRL's DPO step on padded batches against raypack's on packed rows, alternating (module docstring)."""
    import datasets
    import torch
    import transformers
    from trl import DPOConfig, DPOTrainer

    from raypack.config import ASSETS, DpoConfig
    from raypack.model.build import load_model
    from raypack.train.objectives.dpo import DPOLoss
    from raypack.train.objectives.dpo_reference import rows_logps
    from raypack.train.objectives.loss import make_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if cuda else torch.float32
    padded = transformers.AutoModelForCausalLM.from_pretrained(work / "model", dtype=dtype, attn_implementation="sdpa")
    config = DPOConfig(output_dir=str(work / "trl-steps"), beta=0.1, precompute_ref_log_probs=True, max_length=None,
                       per_device_train_batch_size=args.pairs_per_step, bf16=cuda, report_to=[], use_cpu=not cuda,
                       activation_checkpointing=args.gradient_checkpointing, seed=args.seed)
    tok = transformers.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    data = datasets.load_dataset("json", data_files=str(work / "pairs.jsonl"), split="train")
    trainer = DPOTrainer(model=padded, args=config, train_dataset=data, processing_class=tok)
    ds = trainer.train_dataset
    groups = [range(i, min(i + args.pairs_per_step, len(ds))) for i in range(0, len(ds), args.pairs_per_step)]
    batches = [{k: v.to(device) for k, v in trainer.data_collator([ds[j] for j in g]).items()} for g in groups]
    packed = load_model(str(work / "model"), attention="auto", dtype="bfloat16" if cuda else "float32",
                        gradient_checkpointing=args.gradient_checkpointing).to(device)
    rows = packed_rows(work / "pairs.jsonl", args.budget)
    loss = DPOLoss(make_loss(packed, "chunked"), DpoConfig(beta=0.1), _gather)
    loss = DPOLoss(loss.base, DpoConfig(beta=0.1), _gather,
                   reference=rows_logps(loss, packed, rows, False, 2, device))
    steps = [loss.prepare_step([row]) for row in rows if row["example_ids"]]
    tokens = {"trl": sum(int(b["attention_mask"].sum()) for b in batches), "raypack": sum(s.tokens for s in steps)}
    if tokens["trl"] != tokens["raypack"]:
        raise SystemExit(f"the two sides see different tokens: {tokens}")
    pairs = sum(s.pairs for s in steps)
    padded.train()
    packed.train()

    def trl_round() -> None:
        for batch in batches:
            trainer.compute_loss(padded, batch).backward()
        padded.zero_grad(set_to_none=True)

    def raypack_round() -> None:
        for step in steps:
            (loss(packed, _moved(step.batches[0], device)) / pairs).backward()
        packed.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"trl": [], "raypack": []}
    for r in range(args.rounds + 1):  # round 0 warms both up
        for name, fn in (("trl", trl_round), ("raypack", raypack_round))[:: 1 if r % 2 else -1]:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if r:
                times[name].append(time.perf_counter() - t0)
    median = {k: float(np.median(v)) for k, v in times.items()}
    return {"tokens": tokens["trl"], "pairs": pairs, "rows": len(steps), "batches": len(batches),
            "padded_tokens": sum(int(b["attention_mask"].numel()) for b in batches),
            "trl_s": median["trl"], "raypack_s": median["raypack"],
            "rounds": {k: [round(x, 3) for x in v] for k, v in times.items()}}


def child_lora_reference(args, work: Path) -> dict:
    """LoRA's reference precomputed against on the fly, alternating (see the module docstring)."""
    import torch

    from raypack.config import DpoConfig, PeftConfig
    from raypack.model.adapters import apply_adapters
    from raypack.model.build import load_model
    from raypack.train.objectives.dpo import DPOLoss
    from raypack.train.objectives.dpo_reference import rows_logps
    from raypack.train.objectives.loss import make_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)  # a tiny model on a shared host: threads only fight
    rows = packed_rows(work / "pairs.jsonl", args.budget)
    model = load_model(str(work / "model"), attention="auto", dtype="bfloat16" if cuda else "float32",
                       gradient_checkpointing=args.gradient_checkpointing).to(device)
    model = apply_adapters(model, PeftConfig(method="lora", r=16, alpha=32), str(work / "model"))
    base = make_loss(model, "chunked")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    otf = DPOLoss(base, DpoConfig(beta=0.1), _gather, adapters_off=model.disable_adapter)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    with model.disable_adapter():
        reference = rows_logps(otf, model, rows, False, 2, device)
    sync()
    pass_s = time.perf_counter() - t0
    pre = DPOLoss(base, DpoConfig(beta=0.1), _gather, reference=reference)
    steps = [row for row in rows if row["example_ids"]][: args.steps]
    times: dict[str, list[float]] = {"precomputed": [], "on_the_fly": []}
    for r in range(args.rounds + 1):  # round 0 warms both up
        for kind, loss in (("precomputed", pre), ("on_the_fly", otf))[:: 1 if r % 2 else -1]:
            sync()
            t0 = time.perf_counter()
            for row in steps:
                step = loss.prepare_step([row])
                pairs = step.pairs
                loss_sum = loss(model, {**_moved(step.batches[0], device), "sft_scale": 0.0})
                (loss_sum / pairs).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            sync()
            if r:
                times[kind].append((time.perf_counter() - t0) / len(steps))
    median = {k: float(np.median(v)) for k, v in times.items()}
    return {"pass_s": pass_s, "rows": len(rows), "pass_per_row_s": pass_s / len(rows),
            "precomputed_step_s": median["precomputed"], "on_the_fly_step_s": median["on_the_fly"],
            "rounds": {k: [round(x, 4) for x in v] for k, v in times.items()}}


def _gather(values, device):
    """loop.global_count on one rank: the values as a [1, n] float64 tensor."""
    import torch

    return torch.tensor([values], dtype=torch.float64)


def _moved(batch: dict, device) -> dict:
    from raypack.data.collate import move_batch

    return move_batch(batch, device)


def run_config(name: str, args, work: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--work", str(work), *child_args(args)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout,
                          env=child_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    out = json.loads(lines[-1].removeprefix("RESULT "))
    print(name, out, flush=True)
    return out


def child_args(args) -> list[str]:
    return [*(["--smoke"] if args.smoke else []), "--rounds", str(args.rounds), "--budget", str(args.budget),
            "--pairs-per-step", str(args.pairs_per_step), "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
            *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]


def mean_pair_tokens(path: Path) -> float:
    """Mean tokens of a pair (prompt + chosen, prompt + rejected) as both sides tokenize it."""
    from transformers import AutoTokenizer

    from raypack.config import ASSETS
    from raypack.data.pairs import tokenize_pairs

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    cols = {k: [r.get(k) for r in rows] for k in ("prompt", "chosen", "rejected")}
    cols.update({f"{k}_messages": [None] * len(rows) for k in ("prompt", "chosen", "rejected")})
    pairs = tokenize_pairs(AutoTokenizer.from_pretrained(ASSETS / "tokenizer"), cols)
    lengths = np.array([len(p.chosen) + len(p.rejected) for p in pairs])
    return float(lengths.mean()), int(lengths.max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, a few steps")
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--pairs-per-step", type=int, default=16, help="TRL's per-device batch; raypack's rows hold as many")
    p.add_argument("--max-words", type=int, default=1500, help="longest prompt or completion, in words (~tokens)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gradient-checkpointing", action="store_true", default=None)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=None,
                   help=f"alternating rounds in one process (default {ROUNDS}; smoke 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=None)
    p.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = not args.smoke
    if args.rounds is None:
        args.rounds = 2 if args.smoke else ROUNDS
    if args.child:
        work = Path(args.work)
        children = {"steps": child_steps, "trl": child_trl, "raypack": child_raypack,
                    "lora-reference": child_lora_reference}
        result = children[args.child](args, work)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.smoke:
        args.pairs, args.pairs_per_step, args.max_words, args.steps, args.warmup = 64, 4, 100, 4, 2
    if gpu_or_smoke(__file__, args.smoke, "compares packed DPO with TRL's DPOTrainer on one GPU") is None:
        return 2
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="dpo_bench_") as tmp:
        work = Path(tmp)
        write_pairs(work / "pairs.jsonl", args.pairs, args.max_words, args.seed)
        mean, longest = mean_pair_tokens(work / "pairs.jsonl")
        # raypack's rows hold the pairs of a TRL batch on average, and every pair fits one
        args.budget = max(int(np.ceil(args.pairs_per_step * mean)), longest)
        save_model(work / "model", args.smoke, args.seed)
        results = {name: run_config(name, args, work) for name in args.configs}
    lines = [
        f"# Packed DPO (raypack) against TRL's DPOTrainer (padded), {device_name()}, {time.strftime('%Y-%m-%d')}",
        *smoke_banner(args.smoke),
        "",
        f"Command: `{command_line(__file__, argv)}`",
        "",
        f"Machine: {machine()}; started {started}. Versions: {versions('trl', 'ray', 'deepspeed', 'peft')}.",
        "",
        f"Model: {'tiny-llama' if args.smoke else 'Llama-style ~1.1B (hidden 2048, 16 layers), vocabulary 768'}, random "
        f"init. Data: {args.pairs:,} pairs (standard format), prompt and completions lognormal in length (median 60 and "
        f"90 words, up to {args.max_words}), {mean:.0f} tokens a pair on average. TRL: {args.pairs_per_step} pairs a "
        f"step; raypack: a {args.budget:,}-token budget a row (the same pairs a step on average). {args.warmup} warm-up "
        f"then {args.steps} measured optimizer steps; gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}.",
        "",
        "| config | tokens/s | pairs/s | s / step | peak GiB | reference pass s | loss at the last step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if name in ("trl", "raypack"):
            lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['pairs_per_s']:.1f} | {r['step_s']:.3f} | "
                         f"{r['peak_gib']:.2f} | {r['reference_s']:.1f} | {r['loss']:.4f} |")
    lines.append("")
    if "raypack" in results and "trl" in results:
        for key in ("tokens_per_s", "pairs_per_s"):
            lines.append(f"- full stacks, run one after the other, raypack / trl {key.replace('_per_s', '/s')}: "
                         f"**{results['raypack'][key] / results['trl'][key]:.2f}x**")
    if "steps" in results:
        r = results["steps"]
        lines += ["", f"The steps alone, one process, alternating ({len(r['rounds']['trl'])} rounds, every pair once a "
                  f"round; medians; seconds by round: {r['rounds']}):", "",
                  "| step | real tokens | tokens computed | s a round | tokens/s |", "|---|---|---|---|---|",
                  f"| TRL, {r['batches']} padded batches | {r['tokens']:,} | {r['padded_tokens']:,} | {r['trl_s']:.3f} | "
                  f"{r['tokens'] / r['trl_s']:,.0f} |",
                  f"| raypack, {r['rows']} packed rows | {r['tokens']:,} | {r['tokens']:,} | {r['raypack_s']:.3f} | "
                  f"{r['tokens'] / r['raypack_s']:,.0f} |", "",
                  f"- raypack / TRL tokens/s, the steps alone: **{r['trl_s'] / r['raypack_s']:.2f}x** (TRL computes "
                  f"{r['padded_tokens'] / r['tokens']:.2f}x the real tokens)"]
    if "lora-reference" in results:
        r = results["lora-reference"]
        pre, otf, per_row = r["precomputed_step_s"], r["on_the_fly_step_s"], r["pass_per_row_s"]
        lines += ["", "LoRA's reference, precomputed or on the fly (one process, the two alternating over "
                  f"{len(r['rounds']['precomputed'])} rounds of {args.steps} one-row steps; medians; seconds a step "
                  f"by round: {r['rounds']}):", "",
                  "| | s / step | for E epochs of N rows |", "|---|---|---|",
                  f"| precomputed | {pre:.4f} | {per_row:.4f} x N (the pass, {r['rows']} rows in {r['pass_s']:.1f} s) "
                  f"+ {pre:.4f} x N x E |",
                  f"| on the fly | {otf:.4f} | {otf:.4f} x N x E |", "",
                  f"- on the fly / precomputed, a step: **{otf / pre:.2f}x**; precomputed is faster from "
                  f"E > {per_row / max(otf - pre, 1e-12):.2f} epochs" if otf > pre else
                  f"- on the fly / precomputed, a step: **{otf / pre:.2f}x**: on the fly was not slower here"]
    lines += ["", "tokens/s and pairs/s over the measured steps only (start-up, tokenizing and the reference pass "
              "excluded: that column has them). The last-step losses differ by the steps' pairs (TRL's batches and "
              "raypack's packs hold different pairs): close, not equal. A CPU ratio is not a GPU one.", ""]
    write_results("dpo", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
