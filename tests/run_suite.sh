#!/usr/bin/env bash
# tests/run_suite.sh — `make test`: the whole suite on the normal build, then under
# AddressSanitizer + UBSan, the second half run even when the first has failures; the exit status
# and the closing lines name both halves' failures.
#   tests/run_suite.sh [BUILD_DIR [ASAN_DIR]]     (default: build build-asan)
# The demo, the benchmark smoke test and the single-prompt NIAH checks (cli_eval_single,
# cli_serve_long) run only in the normal half: they exercise code paths the unit tests run under
# the sanitizers too (test_recovery's own-tail cases), at model speed.  So do the device tests of a
# GPU backend (label "device") but device_exact, whose device-side paths (state copies across the
# device, attention read back from device tensors) the sanitizers see there.
set -u
cd "$(dirname "$0")/.."
NORMAL=${1:-build}
ASAN=${2:-build-asan}
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

# half NAME DIR [CTEST ARGS...]: runs ctest there, the log into $LOGS/NAME.log
half() {
    local name=$1 dir=$2
    shift 2
    printf '\n=== %s half (%s) ===\n' "$name" "$dir"
    (cd "$dir" && ctest --output-on-failure "$@") 2>&1 | tee "$LOGS/$name.log"
    return "${PIPESTATUS[0]}"
}

# summary NAME: "NAME: P passed, F failed, S skipped" and the failed tests' names
summary() {
    local log=$LOGS/$1.log total failed skipped
    total=$(sed -n 's/.*tests passed, \([0-9]*\) tests\? failed out of \([0-9]*\).*/\2/p' "$log" | tail -1)
    failed=$(sed -n 's/.*tests passed, \([0-9]*\) tests\? failed out of \([0-9]*\).*/\1/p' "$log" | tail -1)
    skipped=$(awk '/The following tests did not run:/ { on = 1; next } on && /^[[:space:]]+[0-9]+ - / { n++ } on && !/^[[:space:]]+[0-9]+ - / { on = 0 } END { print n + 0 }' "$log")
    if [ -z "$total" ]; then
        echo "$1 half: no ctest summary (ctest itself failed)"
        return
    fi
    echo "$1 half: $((total - failed - skipped)) passed, $failed failed, $skipped skipped"
    awk '/The following tests FAILED:/ { on = 1; next } on && /^[[:space:]]+[0-9]+ - / { sub(/^[[:space:]]+/, "  "); print; next } on { on = 0 }' "$log"
}

rc_n=0 rc_a=0
half normal "$NORMAL" || rc_n=$?
half sanitizer "$ASAN" -E 'cli_demo|cli_bench|cli_eval_single|cli_serve_long|device_primitives|device_attention|device_serve' || rc_a=$?

echo
echo "=== make test: both halves ==="
summary normal
summary sanitizer
P=0 F=0 S=0
for h in normal sanitizer; do
    line=$(summary "$h" | head -1)
    set -- $(sed -n 's/.*: \([0-9]*\) passed, \([0-9]*\) failed, \([0-9]*\) skipped/\1 \2 \3/p' <<<"$line")
    if [ $# -eq 3 ]; then P=$((P + $1)) F=$((F + $2)) S=$((S + $3)); else F=$((F + 1)); fi
done
[ "$rc_n" -ne 0 ] || [ "$rc_a" -ne 0 ] && [ "$F" -eq 0 ] && F=1   # ctest failed without a summary
echo "total: $P passed, $F failed, $S skipped"
[ "$rc_n" -eq 0 ] && [ "$rc_a" -eq 0 ]
