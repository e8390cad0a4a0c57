"""`raypack export`: a Hugging Face folder (weights, tokenizer, chat template) from any checkpoint of a run.

    raypack export RUN                          # the last checkpoint, into RUN/export/step_<N>/
    raypack export RUN --checkpoint 200         # the checkpoint reported at step 200
    raypack export RUN --best eval_loss --dtype bfloat16 --out ./exports/best
    raypack export s3://bucket/runs/NAME --out ./exports/NAME   # a URI run: --out is required

RUN is a run folder (<run.storage_path>/<run.name>), local or a URI, from any working folder.
The weights are consolidated on the CPU from every rank's DeepSpeed shard; nothing starts Ray.
The output has the final checkpoint's layout: model/, or with LoRA adapter/ (peft), the merged
model/ (model.peft.merge) and base/ (for a base built from a config); `raypack chat` loads any of
them (an adapter onto its base). The library side is raypack/train/export.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from raypack.train.export import Exported, export


def run(args: argparse.Namespace) -> int:
    quiet_progress_bars()
    done = export(args.run, step=args.checkpoint, best=args.best, out=args.out, dtype=args.dtype,
                  adapter_only=args.adapter_only)
    print(f"[raypack] exported step {done.step} ({done.dtype}) to {done.out}")
    for line in how_to_load(done):
        print(f"  {line}")
    return 0


def how_to_load(done: Exported) -> list[str]:
    lines = []
    if "model" in done.folders:
        m = f"{done.out}/model"
        if Path(m, "preprocessor_config.json").exists():  # a vision-language model, its image processor beside it
            lines += [f'transformers: AutoModelForImageTextToText.from_pretrained("{m}"), '
                      f'AutoTokenizer.from_pretrained("{m}"), AutoImageProcessor.from_pretrained("{m}")',
                      f"chat:         raypack chat {m} --image PICTURE"]
        else:
            lines += [f'transformers: AutoModelForCausalLM.from_pretrained("{m}"), AutoTokenizer.from_pretrained("{m}")',
                      f"chat:         raypack chat {m}"]
    if "adapter" in done.folders:
        base = f'AutoModelForCausalLM.from_pretrained("{done.base}")' if done.base else "<the base model>"
        lines.append(f'peft:         PeftModel.from_pretrained({base}, "{done.out}/adapter")')
        if "model" not in done.folders and done.base:  # chat loads the adapter onto its base (train/chat.py)
            lines.append(f"chat:         raypack chat {done.out}/adapter")
    return lines


def quiet_progress_bars() -> None:
    """save_pretrained draws a progress bar for every shard it writes, loading one for every read."""
    from transformers.utils import logging

    logging.disable_progress_bar()
