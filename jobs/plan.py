"""Packing dry run on a Ray cluster: compare strategies before paying for GPUs.

    ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env-json '{"excludes": [".venv", ".git", ".cache", "results"]}' \
        -- python jobs/plan.py --config jobs/configs/qwen7b.yaml pack.budget=8192 train.num_workers=16

Arguments are `raypack plan`'s: --config FILE and dotted overrides (the data is tokenized on the
cluster, and the plan printed is the plan `raypack train` with that config would train), or
--lengths FILE.npy for a what-if; optionally --strategy NAME ... (after the overrides), --json, --out.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # import raypack from the working dir

from raypack.versions import check  # noqa: E402

if __name__ == "__main__":
    # The cluster's own Python and packages run the job: a Ray raypack can't use is one line, at once.
    check("this cluster")
    from raypack.cli import main

    sys.exit(main(["plan", *sys.argv[1:]]))
