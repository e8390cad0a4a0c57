"""Sweep packing strategies on a Ray cluster: the entrypoint of `ray job submit`.

    ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env-json '{"excludes": [".venv", ".git", ".cache", "results"]}' \
        -- python jobs/sweep.py --config jobs/configs/sweeps/packing.yaml

Arguments are `raypack sweep`'s: --config FILE, then dotted overrides, or --resume EXPERIMENT_DIR
to continue an interrupted sweep. Each trial is a full Ray Train run; the table and plots land in
`<run.storage_path>/<run.name>/`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # import raypack from the working dir

from raypack.versions import check  # noqa: E402

if __name__ == "__main__":
    # The cluster's own Python and packages run the job: a Ray raypack can't use is one line, at once.
    check("this cluster")
    from raypack.cli import main

    sys.exit(main(["sweep", *sys.argv[1:]]))
