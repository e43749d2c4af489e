#!/usr/bin/env bash
# cli_serve_chat — `kvtier serve` on the chat model ($KVTIER_CHAT_MODEL, SmolLM2-135M-Instruct: llama
# architecture, ChatML template) through the official openai Python client: tests/server/
# serve_chat_test.py (replies and their end, usage, streaming, multi-turn reuse, completions, tool
# calls, errors), then SIGTERM: the server exits 0, no sanitizer report, the key never logged.
# cli_serve.sh runs the whole of serve_test.py on Gemma 3 270M; this is its model-independent core
# on the second model.  Skips (exit 77) when KVTIER_CHAT_MODEL is not set.
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
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvt-cli-serve-chat.XXXXXX")
export XDG_CACHE_HOME="$TMP/cache" # the server's default block store: private to this script
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
"$SRC/scripts/bootstrap.sh" pyclient || { bad "bootstrap.sh pyclient"; echo "$pass passed, $fail failed"; exit 1; }

KEY=key-chat-2718
"$BIN" serve -m "$MODEL" --port 0 -c 2048 --budget 512 --threads 2 --api-key "$KEY" >"$TMP/out" 2>"$TMP/err" &
PID=$!
PORT=
for _ in $(seq 1 300); do
    PORT=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/err" | sed 's/.*://')
    [ -n "$PORT" ] && break
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.2
done
if [ -z "$PORT" ]; then
    bad "server did not start"; cat "$TMP/err"; echo "$pass passed, $fail failed"; exit 1
fi
grep -qF "kvtier serve: model $MODEL: " "$TMP/err" && grep -q "(llama " "$TMP/err" \
    && ok "server listening on port $PORT, the llama-architecture model logged" || bad "model line: $(grep model "$TMP/err" | head -2)"

"$PY" "$SRC/tests/server/serve_chat_test.py" "http://127.0.0.1:$PORT" "$KEY" >"$TMP/py" 2>&1
prc=$?
t_py_checks "$TMP/py" "$prc" serve_chat_test.py

kill -TERM "$PID"
wait "$PID"; src=$?
PID=
[ $src -eq 0 ] && grep -q "stopped" "$TMP/err" && ok "SIGTERM: the server exited 0" || bad "SIGTERM: exit status $src"
grep -qF -- "$KEY" "$TMP/err" "$TMP/out" && bad "the API key is in the server's log" || ok "no API key in the server's log"
if grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:' "$TMP/err"; then
    bad "sanitizer report on the server's stderr"; grep -A20 -E 'Sanitizer|runtime error' "$TMP/err" | head -60
else
    ok "no sanitizer report"
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
