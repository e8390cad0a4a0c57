"""Fine-tune on a Ray cluster: the entrypoint of `ray job submit`.

    ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env-json '{"excludes": [".venv", ".git", ".cache", "results"]}' \
        -- python jobs/sft.py --config jobs/configs/llama8b_zero3_1node.yaml train.lr=1e-5

Arguments are `raypack train`'s: --config FILE, optional --resume PATH, then dotted overrides.
The job driver joins the cluster through RAY_ADDRESS, which `ray job submit` sets.
"""

import sys
from pathlib import Path

# The uploaded working dir is the job's cwd, but `python jobs/sft.py` puts jobs/ on sys.path,
# not the repo root; add it so `raypack` imports without being installed on the cluster.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raypack.versions import check  # noqa: E402

if __name__ == "__main__":
    # The cluster's own Python and packages run the job: a Ray raypack can't use is one line, at once.
    check("this cluster")
    from raypack.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
