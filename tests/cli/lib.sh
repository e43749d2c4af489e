# lib.sh — what the command-line test scripts share (sourced, not run): a private temporary
# directory removed on exit, the ok/bad counters, the closing "N passed, N failed" line that
# ctest's output shows, and the rule for the essays that some commands read.
#   . "$(dirname "$0")/../cli/lib.sh"
#   t_init NAME          TMP=a fresh directory, pass=0, fail=0
#   t_need_essays        ESSAYS=../shared/data/pg_essays beside the repository, or exit 77
#                        (reported as skipped: SKIP_RETURN_CODE in tests/CMakeLists.txt)
#   t_need_chat_model    MODEL=$KVTIER_CHAT_MODEL (SmolLM2-135M-Instruct), or exit 77
#   ok MSG / bad MSG     count and print one check
#   t_listening ERR PID [S]  the port a `kvtier serve` logs in file ERR once it listens (S seconds
#                        at most, default 60; empty when the process PID ended first)
#   t_py_checks OUT RC NAME  print a Python check script's output OUT (its "ok"/"FAIL" lines) and add
#                        them to the counts; an exit status RC other than 0 without a FAIL line fails too
#   t_finish             print the counts; the script's status is 0 only when nothing failed
t_init() {
    TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvt-$1.XXXXXX")
    trap 'rm -rf "$TMP"' EXIT
    # the block store's default directory (kvt_store_default_dir): private to this script, so a
    # test never reuses blocks another test (or the user) computed
    export XDG_CACHE_HOME="$TMP/cache"
    pass=0
    fail=0
}

ok() { pass=$((pass + 1)); echo "ok   $*"; }

t_py_checks() {
    local n_fail
    cat "$1"
    n_fail=$(grep -c '^FAIL ' "$1")
    pass=$((pass + $(grep -c '^ok ' "$1")))
    fail=$((fail + n_fail))
    [ "$2" -eq 0 ] || [ "$n_fail" -gt 0 ] || bad "$3 exited with status $2"
}
bad() { fail=$((fail + 1)); echo "FAIL $*"; }

t_need_essays() {
    # the essays are the team's data, beside the repository (docs/TESTING.md), not installable
    ESSAYS=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}/../shared/data/pg_essays
    if [ ! -d "$ESSAYS" ]; then
        echo "SKIP: $ESSAYS is not a directory (make test expects shared/ beside the repository)"
        exit 77
    fi
}

t_need_chat_model() {
    MODEL=${KVTIER_CHAT_MODEL:-}
    if [ ! -f "$MODEL" ]; then
        echo "SKIP: KVTIER_CHAT_MODEL ('$MODEL') is not a file"
        exit 77
    fi
}

t_finish() {
    echo "$pass passed, $fail failed"
    [ "$fail" -eq 0 ]
}

t_listening() {
    local port=
    for _ in $(seq 1 $((${3:-60} * 5))); do
        port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$1" 2>/dev/null | sed 's/.*://')
        [ -n "$port" ] && break
        kill -0 "$2" 2>/dev/null || break
        sleep 0.2
    done
    echo "$port"
}
