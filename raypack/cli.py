"""`raypack` command line: train, sweep, plan, data, config, export and chat. Parses arguments and hands off.

    raypack train --config jobs/configs/tiny_cpu.yaml train.lr=2e-5
    raypack plan --config jobs/configs/qwen7b.yaml pack.budget=4096 train.num_workers=64
    raypack plan --lengths lengths.npy pack.budget=4096 train.num_workers=8 --strategy bfd balanced
    raypack sweep --config jobs/configs/sweeps/packing_cpu.yaml
    raypack sweep --resume ./results/sweeps/sweep-packing-cpu   # continue an interrupted sweep
    raypack data --config jobs/configs/quickstart.yaml      # tokenize only, print a summary
    raypack config pack.budget                              # what a field means: type, default, docstring
    raypack config --config jobs/configs/tiny_cpu.yaml      # the resolved config a run would train
    raypack export ./results/tiny_cpu --checkpoint 10       # a Hugging Face folder from any checkpoint
    raypack export ./results/tiny_cpu --best eval_loss --dtype bfloat16 --out ./exports/best
    raypack chat ./results/tiny_cpu                         # talk to the trained model in the terminal
    raypack chat ./exports/best/model --prompt "Hi" --temperature 0

Each command's handler is `raypack.commands.<command>.run(args)`; this module and those are the
only ones that see an argparse namespace. Bad input (a config value, a data file or row, a
tokenizer, a model: any `raypack.errors.InputError`) prints one line and exits with 2; `--debug`
prints the traceback too. SIGTERM ends a command as Ctrl-C does, with one line and exit status
143 (a training run first stops after its step with a checkpoint: raypack/train/stop.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import traceback

from raypack.config import blame, load
from raypack.config.sections import MAX_IMAGE_PIXELS
from raypack.errors import ConfigError, InputError


def _add_config(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--config", required=required, help="YAML run config (see jobs/configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=2e-5 pack.strategy=bfd")


READS_DATA = ("train", "sweep", "data", "plan")
"""The commands that read the configured data (`plan --lengths` reads a lengths file instead)."""

DESCRIPTION = ("Supervised fine-tuning of causal language models on packed sequences, exactly as unpacked (no "
               "example sees another), on Ray: Ray Data tokenizes and packs, Ray Train trains on DeepSpeed ZeRO or "
               "torch's DDP and FSDP2 (train.engine), Ray Tune sweeps.")
"""What `raypack --help` says raypack is (the module doc is for readers of this file)."""
EPILOG = ("Start with: raypack train --config jobs/configs/quickstart.yaml (make run). `raypack COMMAND --help` "
          "for a command's arguments; `raypack config FIELD` for what a config field means.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypack", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error too")
    # Also accepted after the command; SUPPRESS keeps the subparser from resetting the flag.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print the traceback of an error too")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", parents=[common], help="fine-tune with Ray Train + DeepSpeed on packed rows")
    _add_config(p)
    p.add_argument("--resume", help="path of a stopped run (storage_path/name) to continue")
    p.add_argument("--reprepare", action="store_true",
                   help="tokenize and pack the sources again after they changed (a run with no checkpoint yet)")

    p = sub.add_parser("sweep", parents=[common], help="Ray Tune sweep over packing strategies")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="YAML sweep config (see jobs/configs/sweeps/)")
    src.add_argument("--resume", help="experiment dir (storage_path/name) of an interrupted sweep to continue")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. tune.num_samples=3 (with --config)")

    p = sub.add_parser("data", parents=[common], help="read and tokenize the configured data, print a summary")
    _add_config(p)
    p.add_argument("--show", type=int, metavar="N",
                   help="print the first N examples as the model sees them, the trained text marked, instead of the summary")
    p.add_argument("--json", action="store_true", help="with --show: one JSON object a line (input_ids, labels, source, line)")

    p = sub.add_parser("plan", parents=[common], help="dry run: the packing plan a run would train, on its data or a lengths file")
    _add_config(p)
    p.add_argument("--lengths", help=".npy file of example lengths to plan instead of the configured data")
    p.add_argument("--strategy", nargs="+", default=None,
                   help="strategies to compare under the same config, or `all` (default: pack.strategy)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--out", help="write the (first strategy's) assignment as Parquet")

    p = sub.add_parser("config", parents=[common], help="print the resolved config, or what a field means")
    p.add_argument("--config", help="YAML run config (default: raypack's defaults)")
    p.add_argument("items", nargs="*", metavar="FIELD_OR_OVERRIDE",
                   help="a field or section to explain (pack.budget, model.peft), or dotted overrides (train.lr=2e-5)")

    p = sub.add_parser("export", parents=[common], help="write a Hugging Face folder from any checkpoint of a run")
    p.add_argument("run", metavar="RUN", help="run folder (<run.storage_path>/<run.name>), local or a URI")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", type=int, metavar="N", help="the checkpoint reported at step N (default: the last)")
    which.add_argument("--best", choices=["eval_loss"], help="the checkpoint with the lowest reported eval_loss")
    p.add_argument("--out", help="output folder (default: RUN/export/step_<N>; required for a URI run)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype (default: the dtype the run trained in)")
    p.add_argument("--adapter-only", action="store_true",
                   help="LoRA: write adapter/ alone, reading no base weights (QLoRA's only export)")

    p = sub.add_parser("chat", parents=[common], help="chat in the terminal with a trained model (a run or model folder)")
    p.add_argument("target", metavar="RUN_OR_MODEL_DIR", help="a run folder, or a Hugging Face model folder")
    p.add_argument("--prompt", help="answer this one message, print the answer and exit")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="an image (path, URI or base64) before the first message, for a vision-language model; "
                        "repeat for several")  # fmt: skip
    p.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS, metavar="N",
                   help=f"most pixels an image may have, read from its header before it is decoded (default: "
                        f"{MAX_IMAGE_PIXELS}, PIL's limit, as data.max_image_pixels)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer, in tokens (default: 256)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 is greedy (default: 0.7)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from raypack.train.stop import signal_of, stop_on_sigterm, stopped_by

    # SIGTERM (a pod evicted, `ray job stop`, Slurm, kill) ends a command as Ctrl-C does
    sigterm = stop_on_sigterm()
    try:
        cfg = None
        if hasattr(args, "overrides") and not getattr(args, "resume", None):
            from raypack.data.strategies import check_strategies

            # a config error in 0.3 s, before the imports below
            cfg = load(args.config, args.overrides)
            try:
                check_strategies(cfg)
            except ConfigError as e:  # named after the override that holds the value, else the file
                raise ConfigError(f"{blame(str(e), args.overrides, args.config or '<defaults>')}: {e}") from None
        elif args.command == "train" and args.resume and not args.config:  # its saved config, as train.py reads it
            from raypack.runs import check_rerun, saved_config

            check_rerun(args.overrides, args.resume)
            cfg = saved_config(args.resume, args.overrides)
        listed = contextlib.nullcontext()
        if cfg is not None and args.command in READS_DATA and not getattr(args, "lengths", None):
            from raypack.data.hub import listed_first

            # Its hub datasets listed before those imports too (raypack/data/hub.py), the listings
            # kept for the command: a hub that doesn't answer is one line within seconds, not after them.
            listed = listed_first(cfg.data)
        with listed:
            # Only the command that runs is imported: `raypack --help` takes 0.1 s, while the command
            # modules bring in Ray, torch and transformers (3 to 10 s on 2 cores, 25 s under load).
            command = importlib.import_module(f"raypack.commands.{args.command}")
            return command.run(args) or 0
    except BrokenPipeError:  # `raypack config | head`: the reader left early, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt as e:  # what a command doesn't handle itself: one line, no traceback
        print(f"\n[raypack] {stopped_by(signal_of(e))}", file=sys.stderr, flush=True)
        return 128 + signal_of(e)
    except Exception as e:
        error = input_error(e)
        if error is None:
            raise
        if args.debug:
            traceback.print_exc()
        kind = "config error" if isinstance(error, ConfigError) else "error"
        print(f"raypack: {kind}: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


def input_error(e: BaseException) -> InputError | None:
    """The InputError `e` is or wraps (Ray re-raises a task's error as a subclass of both its own
    error type and the cause, or with the cause in `.cause`), if any."""
    found, seen = None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, InputError):
            found = e  # the innermost one: Ray's subclass carries a traceback dump as its message
        e = getattr(e, "cause", None) or e.__cause__
    return found


if __name__ == "__main__":
    sys.exit(main())
