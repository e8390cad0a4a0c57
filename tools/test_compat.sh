#!/usr/bin/env bash
# make test-compat: the Ray tier of the suite (tests/ray, local Ray clusters the tests start) on
# each Ray release pyproject.toml's range names as its ends, each in a virtual environment of its
# own (.venv-ray<version>) holding the lock's versions of everything else. Not in CI (each run is
# the Ray tier's ~30 min on 2 cores); each writes benchmarks/results/compat_ray<version>_cpu_<date>.md
# with the versions, the command and pytest's counts.
#   RAYS="2.55.1 2.60.0" make test-compat      (the default: the oldest and the newest pyproject.toml allows)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
RAYS=${RAYS:-"2.55.1 2.60.0"}
TESTS=${TESTS:-tests/ray}
# shellcheck source=tools/suite_results.sh
. tools/suite_results.sh
status=0
for ray in $RAYS; do
    venv=.venv-ray$ray
    if [ ! -f "$venv/.installed" ]; then
        rm -rf "$venv" && "$PYTHON" -m venv "$venv"
        "$venv/bin/pip" install -q --upgrade pip "$TORCH"
        mkdir -p .cache && grep -v -e '^torch==' -e '^ray==' constraints.txt > ".cache/constraints-without-ray.txt"
        "$venv/bin/pip" install -q -c .cache/constraints-without-ray.txt -e ".[dev]" "ray[default,train,data,tune]==$ray" \
            && touch "$venv/.installed" || { status=1; continue; }
    fi
    out=benchmarks/results/compat_ray${ray}_cpu_$(date -u +%Y%m%d).md
    log=.cache/compat_ray$ray.log
    run_suite "$venv" "$log" "$TESTS"
    {
        echo "# The Ray tier on Ray $ray"
        echo
        suite_facts "RAYS=$ray TESTS=$TESTS make test-compat" tools/test_compat.sh
        echo "- versions: $("$venv/bin/python" -c 'import importlib.metadata as m, sys; print(", ".join([f"python {sys.version.split()[0]}"] + [f"{p} {m.version(p)}" for p in ("ray", "torch", "transformers", "deepspeed", "pyarrow", "datasets", "peft")]))')"
        echo
        suite_counts "$log"
    } > "$out"
    cat "$out"
    [ "$SUITE_CODE" -eq 0 ] || status=1
done
exit $status
