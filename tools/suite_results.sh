# Sourced by tools/test_latest.sh and tools/test_compat.sh: run the suite in a virtual environment
# and write the results file both keep under benchmarks/results/.
#   run_suite VENV LOG TESTS   pytest -q over TESTS into LOG; sets SUITE_CODE, SUITE_SECONDS and
#                              SUITE_COMMIT (read before the run: the results file it writes next
#                              is no uncommitted change)
#   suite_facts COMMAND SCRIPT the results file's command and machine lines
#   suite_counts LOG           the failures and pytest's last line, as a text block

run_suite() {
    local venv=$1 log=$2 tests=$3 start
    SUITE_COMMIT="$(git rev-parse --short HEAD)$(git diff --quiet -- . ':!benchmarks/results' || echo ' (with uncommitted changes)')"
    start=$(date +%s)
    mkdir -p "$(dirname "$log")"
    # shellcheck disable=SC2086  # tests may name several paths
    "$venv/bin/pytest" -q -p no:cacheprovider $tests > "$log" 2>&1
    SUITE_CODE=$?
    SUITE_SECONDS=$(( $(date +%s) - start ))
}

suite_facts() {
    echo "- command: \`$1\` ($2), exit $SUITE_CODE, $SUITE_SECONDS s"
    echo "- machine: $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB, no GPU; commit $SUITE_COMMIT"
}

suite_counts() {
    echo '```text'
    grep -E '^(FAILED|ERROR) ' "$1" | head -50
    tail -n 1 "$1"
    echo '```'
}
