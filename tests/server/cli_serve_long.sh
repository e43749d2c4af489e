#!/usr/bin/env bash
# cli_serve_long — `kvtier serve` on the chat model (SmolLM2-135M-Instruct) answering a question
# at the end of ONE message four times its budget (tests/server/serve_long_test.py), beside a
# reference server on the same model that never evicts (issue #23).  Skips (77) without the
# chat model or the essays.
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh"
t_need_essays
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
t_need_chat_model
t_init cli-serve-long
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done; rm -rf "$TMP"' EXIT

PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient || { bad "bootstrap.sh pyclient"; t_finish; exit 1; }

# start NAME ARGS...: a server in the background; PORT_NAME its port
start() {
    local name=$1 port=
    shift
    "$BIN" serve -m "$MODEL" --port 0 --threads 1 --parallel 1 "$@" >/dev/null 2>"$TMP/$name.err" &
    PIDS+=($!)
    for _ in $(seq 1 300); do
        port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/$name.err" | sed 's/.*://')
        [ -n "$port" ] && break
        kill -0 "${PIDS[-1]}" 2>/dev/null || break
        sleep 0.2
    done
    [ -n "$port" ] && ok "$name server listening on port $port" || { bad "$name server did not start"; cat "$TMP/$name.err"; }
    eval "PORT_$name=$port"
}
start kvtier -c 4096 --budget 512
start reference -c 8192 --budget 4096 --max-sessions 1
"$PY" "$SRC/tests/server/serve_long_test.py" "http://127.0.0.1:${PORT_kvtier:-1}" "http://127.0.0.1:${PORT_reference:-1}" \
    "$ESSAYS" >"$TMP/py" 2>&1
prc=$?
t_py_checks "$TMP/py" "$prc" serve_long_test.py
for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
PIDS=()
if grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:' "$TMP"/*.err; then
    bad "sanitizer report on a server's stderr"; grep -A20 -E 'Sanitizer|runtime error' "$TMP"/*.err | head -60
else
    ok "no sanitizer report"
fi
t_finish
