"""Hybrid models on packed rows, before and after raypack's mixers: the largest packed-vs-alone error.

    PYTHONPATH=. python benchmarks/hybrid_exactness.py            # every hybrid family; results file
    PYTHONPATH=. python benchmarks/hybrid_exactness.py --smoke    # two families; results in the temp folder

For each hybrid family of tests/families.py (a tiny model, fp32, CPU), one packed forward and
backward of tests/exactness.py's two rows against every example run alone through transformers'
own eager model with the same weights: the largest relative error over the logits, the summed
loss and every parameter's gradient (tests/exactness.py's `packed_vs_alone`), and where it is.

    before   raypack's attention, and each mixer as transformers runs it on the whole row with the
             packing keyword arguments dropped (transformers 5.24's torch fallback for the gated
             delta rule refuses cu_seqlens outright; its convolutions never see them): what a run
             bypassing raypack's refusal computed
    after    raypack's mixers installed (raypack/model/mixers.py): what `raypack train` runs

The family test (tests/unit/model/test_families.py) asserts the `after` column; this file records both.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.common import cpu_header, host_now, write_results  # noqa: E402

SMOKE = ("lfm2", "nemotron_h")


def _drop_boundaries(original, *args, **kwargs):
    from raypack.model import mixers

    return original(*args, **{k: v for k, v in kwargs.items() if k not in mixers.PACKING_KWARGS})


def measure(family: str, install: bool) -> tuple[str, float]:
    import torch
    from exactness import packed_vs_alone
    from families import FAMILIES
    from transformers import AutoModelForCausalLM

    from raypack.model import mixers
    from raypack.model.attention import NAMES, attn_implementation_name
    from raypack.model.build import load_model
    from raypack.model.traits import decoder

    config = FAMILIES[family].build_config(family)
    torch.manual_seed(0)
    attn_implementation_name("sdpa_varlen")  # registers raypack's names
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    model.config._attn_implementation = NAMES["sdpa_varlen"]  # as load_model does for these classes
    text = decoder(model)
    if install:
        mixers.install(text)
    else:
        for name in mixers.find(text):
            module = text.get_submodule(name)
            module.forward = functools.partial(_drop_boundaries, module.forward)
    ref = load_model(config, attention="eager", dtype="float32").eval()
    ref.load_state_dict(model.state_dict())
    errors = packed_vs_alone(model, ref)
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="two families; results in the temp folder")
    parser.add_argument("--out", help="results file (default: benchmarks/results/hybrid_exactness_cpu_<date>.md)")
    args = parser.parse_args(argv)
    started = host_now()
    warnings.filterwarnings("ignore")
    import torch
    from families import FAMILIES, HYBRID

    from raypack.model import mixers
    from raypack.model.build import meta_model
    from raypack.model.traits import decoder

    torch.set_num_threads(1)
    hybrids = [f for f, spec in FAMILIES.items() if not spec.refused and spec.split_refused == HYBRID["split_refused"]]
    families = [f for f in hybrids if f in SMOKE] if args.smoke else hybrids
    rows, t0 = [], time.perf_counter()
    for family in families:
        spec = FAMILIES[family]
        kinds = sorted({k.name for k in mixers.find(decoder(meta_model(spec.build_config(family)))).values()})
        before, after = measure(family, install=False), measure(family, install=True)
        rows.append(f"| {family} | {spec.config} | {', '.join(kinds)} | {before[1]:.2e} | `{before[0]}` | "
                    f"{after[1]:.2e} | `{after[0]}` | {spec.tolerance:.0e} |")  # fmt: skip
    lines = [
        *cpu_header("Hybrid models: packed vs each example alone, before and after raypack's mixers",
                    "hybrid_exactness.py", argv, args.smoke, started, modules=("torch", "transformers")),
        "",
        "Tiny models of tests/families.py (hidden 64, 2 to 6 layers; scans in chunks of 8), fp32, CPU, one torch thread; "
        "two packed rows (examples of 21, 6 / 13, 1, 9 tokens) against every example alone through transformers' "
        "eager model. Largest relative error over logits, summed loss and every gradient (tests/exactness.py). "
        f"{time.perf_counter() - t0:.0f} s.",
        "",
        "| family | config | mixers | before | where | after | where | test bound |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    write_results("hybrid_exactness", args.smoke, args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
