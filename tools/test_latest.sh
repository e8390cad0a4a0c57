#!/usr/bin/env bash
# make test-latest: the whole suite on the newest release of every dependency pyproject.toml's
# ranges allow (torch stays $TORCH), in .venv-latest. Not in CI: it finds a dependency's new
# release before the lock moves to it. Writes benchmarks/results/latest_cpu_<date>.md with the
# versions that differ from the lock, the command and pytest's counts.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
TESTS=${TESTS:-tests}
venv=.venv-latest
rm -rf "$venv" && "$PYTHON" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip "$TORCH"
"$venv/bin/pip" install -q --upgrade --upgrade-strategy eager -e ".[dev]" || exit 1
# shellcheck source=tools/suite_results.sh
. tools/suite_results.sh
log=.cache/latest.log
out=benchmarks/results/latest_cpu_$(date -u +%Y%m%d).md
run_suite "$venv" "$log" "$TESTS"
{
    echo "# The suite on the newest versions pyproject.toml allows"
    echo
    suite_facts "TESTS=$TESTS make test-latest" tools/test_latest.sh
    echo "- versions that differ from the lock (constraints.txt -> .venv-latest; the lock's extras this venv"
    echo "  doesn't install left out):"
    echo
    echo '```text'
    "$venv/bin/pip" freeze --exclude-editable | "$venv/bin/python" -c '
import sys
from packaging.utils import canonicalize_name as name
def pins(lines):
    return {name(a): b for a, _, b in (l.strip().partition("==") for l in lines) if b and not a.startswith("#")}
lock, now = pins(open("constraints.txt")), pins(sys.stdin)
for n in sorted(now):
    if lock.get(n) != now[n]:
        print(n + ": " + lock.get(n, "not in the lock") + " -> " + now[n])'
    echo '```'
    echo
    suite_counts "$log"
} > "$out"
cat "$out"
exit $SUITE_CODE
