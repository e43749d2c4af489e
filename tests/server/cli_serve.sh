#!/usr/bin/env bash
# cli_serve — `kvtier serve` end to end on Gemma 3 270M: started on a free port with two API keys,
# driven by tests/server/serve_test.py through the official openai Python client and raw HTTP (replies,
# streams, multi-turn reuse, bad input, key isolation, disconnect, 429, metrics, the planted fact
# at budget 512), then by tests/server/serve_sched_test.py (session choice by longest common token prefix,
# /v1/completions batched with chats), then SIGTERM with a request in flight: it must finish and
# the server exit 0.  A second server, started without -m (it serves $KVTIER_MODEL's model), with
# --parallel 3, runs tests/server/serve_busy_test.py: a session a job names while another job has
# taken it is not shared; that job waits its turn.
# Also the flags: --help, bad values.  Skips (exit 77) when KVTIER_MODEL is not set.
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh" # t_py_checks (this script keeps its own ok, bad and temporary directory)
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
MODEL=${KVTIER_MODEL:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    echo "SKIP: KVTIER_MODEL ('$MODEL') is not a file"
    exit 77 # reported as skipped (SKIP_RETURN_CODE), never as passed
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvt-cli-serve.XXXXXX")
export XDG_CACHE_HOME="$TMP/cache" # the servers' default block store: private to this script
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

# listening_port ERR PID: the port a server logs in $TMP/ERR once it listens (up to 60 s), or
# nothing when it exits or never says
listening_port() {
    local port=
    for _ in $(seq 1 300); do
        port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/$1" | sed 's/.*://')
        [ -n "$port" ] && break
        kill -0 "$2" 2>/dev/null || break
        sleep 0.2
    done
    echo "$port"
}

# --- flags ---
"$BIN" serve --help >"$TMP/help" 2>&1 && grep -q -- "--api-key-file" "$TMP/help" && grep -q -- "--api-key KEY" "$TMP/help" \
    && ok "serve --help" || bad "serve --help"
# without -m and $KVTIER_MODEL: the model the build was configured with (this suite's $MODEL)
env -u KVTIER_MODEL "$BIN" serve --port 0 --threads 1 >/dev/null 2>"$TMP/err0" &
P0=$!
P0_PORT=$(listening_port err0 $P0)
kill -TERM $P0 2>/dev/null; wait $P0 2>/dev/null
[ -n "$P0_PORT" ] && grep -qF "model $MODEL:" "$TMP/err0" && grep -q "no -m given" "$TMP/err0" \
    && ok "serve without -m or \$KVTIER_MODEL serves the build's model and says so" \
    || bad "serve without a model: $(cat "$TMP/err0")"
"$BIN" serve -m "$MODEL" --port 70000 >/dev/null 2>"$TMP/err"; rc=$?
[ $rc -eq 2 ] && grep -q "port 70000 is outside" "$TMP/err" && ok "bad --port -> usage error" || bad "bad --port ($rc)"
"$BIN" serve -m "$MODEL" --api-key-file "$TMP/none" >/dev/null 2>"$TMP/err"; rc=$?
[ $rc -eq 2 ] && grep -q "cannot read" "$TMP/err" && ok "missing --api-key-file -> usage error" || bad "missing key file ($rc)"
"$BIN" serve -m "$MODEL" -c 1024 --budget 512 --max-sessions 4 >/dev/null 2>"$TMP/err"; rc=$?
[ $rc -eq 2 ] && grep -q "need" "$TMP/err" && ok "sessions that cannot fit the context -> usage error" || bad "max-sessions ($rc)"
"$BIN" serve -m "$MODEL" --api-key key-ok-1 --api-key '' >/dev/null 2>"$TMP/err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--api-key #2 is an empty API key" "$TMP/err" && ok "empty --api-key -> usage error naming which" \
    || bad "empty --api-key ($rc): $(cat "$TMP/err")"
"$BIN" serve -m "$MODEL" --api-key 'secret with-space-55' >/dev/null 2>"$TMP/err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--api-key #1 holds white space" "$TMP/err" && ! grep -q "with-space-55" "$TMP/err" \
    && ok "--api-key with white space -> usage error that does not print the key" || bad "--api-key with space ($rc): $(cat "$TMP/err")"
"$BIN" serve -m "$MODEL" --api-key >/dev/null 2>"$TMP/err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "'--api-key' needs a value" "$TMP/err" && ok "--api-key without a value -> usage error" \
    || bad "--api-key without a value ($rc): $(cat "$TMP/err")"

PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient || { bad "bootstrap.sh pyclient"; echo "$pass passed, $fail failed"; exit 1; }

# start_server ERR ARGS...: `kvtier serve ARGS` in the background, its stderr in $TMP/ERR; sets PID
# and PORT once it listens, else counts a failure and exits
start_server() {
    local err=$1
    shift
    "$BIN" serve "$@" >"$TMP/$err.out" 2>"$TMP/$err" &
    PID=$!
    PORT=$(listening_port "$err" "$PID")
    if [ -z "$PORT" ]; then
        bad "server ($*) did not start"; cat "$TMP/$err"; echo "$pass passed, $fail failed"; exit 1
    fi
    ok "server listening on port $PORT"
}

# --- the server ---
printf '# test keys\nkey-alpha-123\n\n  key-beta-456  \n' >"$TMP/keys"
start_server err -m "$MODEL" --port 0 -c 4096 --budget 512 --parallel 2 --queue 1 --threads 2 \
    --api-key-file "$TMP/keys" --spill-dir "$TMP"
grep -qF "kvtier serve: model $MODEL: " "$TMP/err" && ! grep -q 'no -m given' "$TMP/err" \
    && ok "the model it loaded (-m) is logged: path and name" || bad "model line: $(grep 'model' "$TMP/err" | head -2)"

# one client script against the running server; its ok/FAIL lines count here
run_py() { # script out [args: default the two keys and the demo's source]
    local script=$1 out=$2
    shift 2
    [ $# -gt 0 ] || set -- key-alpha-123 key-beta-456 "$SRC/cli/cmd_demo.c"
    "$PY" "$SRC/tests/server/$script" "http://127.0.0.1:$PORT" "$@" >"$TMP/$out" 2>&1
    local prc=$?
    t_py_checks "$TMP/$out" "$prc" "$script"
}
# the no-eviction reference for the planted fact (serve_test.py: recall is asserted where the
# reference recalls): budget 2000 holds the whole 1490-token conversation
"$BIN" serve -m "$MODEL" --port 0 -c 4096 --budget 2000 --max-sessions 1 --parallel 1 --threads 2 \
    --spill-dir "$TMP" >/dev/null 2>"$TMP/err_ref" &
REF_PID=$!
REF_PORT=$(listening_port err_ref "$REF_PID")
[ -n "$REF_PORT" ] && ok "reference server (no eviction) listening on port $REF_PORT" || bad "reference server: $(cat "$TMP/err_ref")"
KVT_REF_URL=${REF_PORT:+http://127.0.0.1:$REF_PORT} run_py serve_test.py py
kill -TERM "$REF_PID" 2>/dev/null
wait "$REF_PID" 2>/dev/null
# scheduling: session choice by longest common token prefix, completions batched with chats
run_py serve_sched_test.py py2

# --- a field kvtier does not read: accepted, named in the log once (not on every request) ---
for _ in 1 2; do
    curl -s -o /dev/null -H "Authorization: Bearer key-alpha-123" \
        -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"frobnicate_level":3}' \
        "http://127.0.0.1:$PORT/v1/chat/completions"
done
n=$(grep -c "request field 'frobnicate_level' is not one kvtier reads" "$TMP/err")
[ "$n" = 1 ] && ok "an unknown request field is logged once (two requests)" || bad "unknown field logged $n times"

# --- SIGTERM with a request in flight: it completes, the server exits 0 ---
curl -s -o "$TMP/inflight" -w '%{http_code}' -H "Authorization: Bearer key-alpha-123" \
    -d '{"messages":[{"role":"user","content":"Tell me a story."}],"max_tokens":60}' \
    "http://127.0.0.1:$PORT/v1/chat/completions" >"$TMP/code" &
CURL=$!
for _ in $(seq 1 200); do # until the request is really in flight (admitted by the engine)
    curl -s -H "Authorization: Bearer key-alpha-123" "http://127.0.0.1:$PORT/metrics" | grep -q '^kvtier_active_requests 1$' && break
    sleep 0.05
done
kill -TERM "$PID"
wait "$CURL"
wait "$PID"; src=$?
PID=
[ "$(cat "$TMP/code")" = 200 ] && grep -q '"finish_reason"' "$TMP/inflight" && ok "SIGTERM: the request in flight completed" \
    || bad "SIGTERM: in-flight request got $(cat "$TMP/code"): $(head -c 300 "$TMP/inflight")"
[ $src -eq 0 ] && grep -q "stopped" "$TMP/err" && ok "SIGTERM: the server drained and exited 0" || bad "SIGTERM: exit status $src"

# --- a second server, without -m (the model $KVTIER_MODEL names), three jobs at once and a longer
# queue: a session is never given to two jobs.  Its keys: two --api-key flags and a key file.
printf 'key-gamma-789\n' >"$TMP/keys2"
start_server err2 --port 0 -c 4096 --budget 512 --parallel 3 --queue 8 --threads 2 \
    --api-key key-delta-000 --api-key=key-eps-111 --api-key-file "$TMP/keys2" --spill-dir "$TMP"
grep -qF "kvtier serve: model $MODEL: " "$TMP/err2" && grep -qE 'model .*: [^ ].* \(.*\) \(no -m given: \$KVTIER_MODEL or the build.s default\)' "$TMP/err2" \
    && ok "without -m: \$KVTIER_MODEL's model is served, its path and name logged" || bad "no -m: $(grep 'model' "$TMP/err2" | head -2)"
code() { # KEY (empty: no Authorization header) -> HTTP status of GET /v1/models
    if [ -n "$1" ]; then curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $1" "http://127.0.0.1:$PORT/v1/models"
    else curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/models"; fi
}
[ "$(code key-delta-000)" = 200 ] && [ "$(code key-eps-111)" = 200 ] && ok "each --api-key key is accepted" \
    || bad "--api-key keys: $(code key-delta-000) $(code key-eps-111)"
[ "$(code key-gamma-789)" = 200 ] && ok "--api-key-file's key too, beside --api-key" || bad "file key with --api-key: $(code key-gamma-789)"
[ "$(code key-delta-001)" = 401 ] && [ "$(code '')" = 401 ] && ok "a wrong key, or none -> 401" \
    || bad "wrong key: $(code key-delta-001), none: $(code '')"
run_py serve_busy_test.py py3 key-delta-000
kill -TERM "$PID"
wait "$PID"; src=$?
PID=
[ $src -eq 0 ] && ok "second server: SIGTERM, exit 0" || bad "second server: exit status $src"

# keys are secrets: the servers never print one
leaked=
for k in key-alpha-123 key-beta-456 key-gamma-789 key-delta-000 key-eps-111; do
    grep -qF -- "$k" "$TMP/err" "$TMP/err.out" "$TMP/err2" "$TMP/err2.out" && leaked="$leaked $k"
done
[ -z "$leaked" ] && ok "no API key in the servers' logs" || bad "API keys in the servers' logs:$leaked"

for e in err err2 err_ref; do
    if grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:' "$TMP/$e"; then
        bad "sanitizer report on the server's stderr ($e)"; grep -A20 -E 'Sanitizer|runtime error' "$TMP/$e" | head -60
    else
        ok "no sanitizer report ($e)"
    fi
done

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
