#!/usr/bin/env bash
# cli_serve_streams — GitHub issue #11 end to end on SmolLM2-135M-Instruct ($KVTIER_CHAT_MODEL):
#  - isolation: a probe session's greedy tokens and per-token log-probs are the same alone and
#    among 7 sessions generating at the same time (one KV stream per sequence), within the
#    single-session noise floor (the probe alone, run twice);
#  - mixed prefill: on the default server (--batch-tokens 128) the probe's prefill chunks went
#    into the same llama_decode as the 7 others' decode tokens (/metrics), and its numbers equal
#    those of a server that decodes prefill chunks alone (--batch-tokens 0);
#  - control: with --kv-unified (one cache for all sequences) the probe's numbers among the
#    busy sessions are NOT those it has alone: the test would see a leak.
# The client is tests/server/serve_streams_test.py (official openai venv's Python, raw HTTP).
# Skips (exit 77) when KVTIER_CHAT_MODEL is not set.
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh" # t_py_checks (this script keeps its own ok, bad and temporary directory)
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
MODEL=${KVTIER_CHAT_MODEL:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    echo "SKIP: KVTIER_CHAT_MODEL ('$MODEL') is not a file"
    exit 77 # reported as skipped (SKIP_RETURN_CODE), never as passed
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvt-cli-streams.XXXXXX")
PID=
cleanup() {
    [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null
    rm -rf "$TMP"
}
trap cleanup EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   $*"; }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }

PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient >/dev/null 2>&1 || { echo "FAIL bootstrap.sh pyclient"; exit 1; }
export PYTHONPATH="$SRC/tests/server${PYTHONPATH:+:$PYTHONPATH}"

# py ARGS...: the client; its ok/FAIL lines count here
py() {
    "$PY" "$SRC/tests/server/serve_streams_test.py" "$@" >"$TMP/py.out" 2>&1
    local prc=$?
    t_py_checks "$TMP/py.out" "$prc" "serve_streams_test.py $1"
}

# serve NAME FLAGS...: a server for 8 sessions generating at once; runs the probe against it
# (OUT: $TMP/NAME.json), then stops it
serve() {
    local name=$1 port=
    shift
    # --no-store: every run of the probe prefills its whole prompt (the schedule is what is
    # measured; with the block store its second run would load most of it, tests/server/cli_serve_store.sh)
    "$BIN" serve -m "$MODEL" --port 0 -c 4608 --budget 512 --max-sessions 8 --parallel 8 --threads 2 \
        --spill-dir "$TMP" --no-store "$@" >/dev/null 2>"$TMP/$name.err" &
    PID=$!
    for _ in $(seq 1 300); do
        port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/$name.err" | sed 's/.*://')
        [ -n "$port" ] && break
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.2
    done
    if [ -z "$port" ]; then
        bad "server $name ($*) did not start: $(cat "$TMP/$name.err")"
    else
        ok "server $name ($*) listening on port $port"
        py probe "http://127.0.0.1:$port" "$TMP/$name.json" ${EXPECT_MIXED:+--expect-mixed}
    fi
    kill -TERM "$PID" 2>/dev/null
    wait "$PID" 2>/dev/null
    PID=
}

"$BIN" serve -m "$MODEL" --batch-tokens 600 >/dev/null 2>"$TMP/err"; rc=$?
[ $rc -eq 2 ] && grep -q "600" "$TMP/err" && ok "--batch-tokens 600 -> usage error naming the value" \
    || bad "--batch-tokens 600 ($rc): $(cat "$TMP/err")"
"$BIN" serve --help >"$TMP/help" 2>&1; grep -q -- "--kv-unified" "$TMP/help" && grep -q -- "--batch-tokens N" "$TMP/help" && ok "serve --help lists --batch-tokens and --kv-unified" \
    || bad "serve --help"

EXPECT_MIXED=1 serve mixed
serve alone-chunks --batch-tokens 0
serve unified --kv-unified

F=$TMP/mixed.json
py compare "isolation (one stream per sequence, mixed prefill)" "$F" "$F:alone1" "$F:busy" equal
py compare "isolation (one stream per sequence, chunks alone)" "$TMP/alone-chunks.json" \
    "$TMP/alone-chunks.json:alone1" "$TMP/alone-chunks.json:busy" equal
py compare "mixed prefill = prefill chunks alone, among 7 busy sessions" "$F" "$F:busy" "$TMP/alone-chunks.json:busy" equal
py compare "mixed prefill = prefill chunks alone, the probe alone" "$F" "$F:alone1" "$TMP/alone-chunks.json:alone1" equal
py compare "unified KV cache: the probe among 7 busy sessions" "$F" "$TMP/unified.json:alone1" "$TMP/unified.json:busy" differ

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
