#!/usr/bin/env bash
# tests/fuzz/run.sh — `make fuzz`: each harness under libFuzzer for SECONDS, then one line per
# harness with its executions and the crashes it left.
#   tests/fuzz/run.sh BUILD_DIR SECONDS HARNESS...
# New corpus entries go to BUILD_DIR/fuzz-corpus/<h>/ (the committed seeds in
# tests/fuzz/corpus/<h>/ are read, never written); crashes, leaks, timeouts and out-of-memory
# inputs to BUILD_DIR/fuzz-out/<h>/ (crash-*, leak-*, timeout-*, oom-*).  A harness stops at its
# first crash.  Exit status 1 when any harness left a crash.
set -u
cd "$(dirname "$0")/../.."
BUILD=$1 SECONDS_EACH=$2
shift 2
summary=() bad=0
for h in "$@"; do
    work=$BUILD/fuzz-corpus/$h out=$BUILD/fuzz-out/$h log=$BUILD/fuzz-out/$h.log
    mkdir -p "$work" "$out"
    printf '=== fuzz_%s for %ss ===\n' "$h" "$SECONDS_EACH"
    # 1 GiB and 10 s per input: an allocation or a loop sized from a few hostile bytes is a finding
    ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$BUILD/tests/fuzz/fuzz_$h" -max_total_time="$SECONDS_EACH" -print_final_stats=1 -rss_limit_mb=1024 \
        -malloc_limit_mb=1024 -timeout=10 -max_len=65536 -artifact_prefix="$out/" \
        "$work" "tests/fuzz/corpus/$h" >"$log" 2>&1
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    n_bad=$(find "$out" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
    tail -3 "$log"
    summary+=("$(printf '%-12s %12s executions  %d crash(es)' "$h" "${execs:-?}" "$n_bad")")
    [ "$n_bad" -eq 0 ] || bad=1
done
echo
echo "=== make fuzz: ${SECONDS_EACH}s per harness ==="
printf '%s\n' "${summary[@]}"
[ "$bad" -eq 0 ] || echo "crash inputs: $BUILD/fuzz-out/<harness>/ (tests/fuzz/README.md: add them to tests/fuzz/crashes/<harness>/)"
exit "$bad"
