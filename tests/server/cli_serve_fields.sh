#!/usr/bin/env bash
# cli_serve_fields — the request-field tables (server/fields.c, issue #39): docs/API.md is what
# `kvtier serve --print-api` prints (the documentation is the code), and every row holds against a
# live server (tests/server/serve_fields_test.py: refused fields and values other than the neutral
# one get a 400 naming the field, wrong types too, no-effect fields a 200, unknown fields a 200
# that lists them; tests/server/serve_fields_walk_test.py: every honoured field changes the reply,
# against a reference from the same server).  Skips (77) without the chat model (the docs check runs first, without it).
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
t_init cli-serve-fields
"$BIN" serve --print-api >"$TMP/API.md" 2>"$TMP/print.err" && ok "kvtier serve --print-api" || bad "kvtier serve --print-api: $(cat "$TMP/print.err")"
if diff -u "$SRC/docs/API.md" "$TMP/API.md" >"$TMP/diff"; then
    ok "docs/API.md is current (make docs)"
else
    bad "docs/API.md is not what kvtier serve --print-api prints: run make docs"
    head -20 "$TMP/diff"
fi
t_need_chat_model
PID=
trap '[ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT
PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient || { bad "bootstrap.sh pyclient"; echo "$pass passed, $fail failed"; exit 1; }
"$BIN" serve -m "$MODEL" --port 0 --threads 1 --parallel 2 -c 2048 --budget 512 --no-store >/dev/null 2>"$TMP/err" &
PID=$!
PORT=$(t_listening "$TMP/err" "$PID")
if [ -n "$PORT" ]; then
    ok "server listening on port $PORT"
    (cd "$SRC/tests/server" && "$PY" serve_fields_test.py "http://127.0.0.1:$PORT" "$TMP/API.md") >"$TMP/py" 2>&1
    prc=$?
    t_py_checks "$TMP/py" "$prc" serve_fields_test.py
    # every honoured field changes the reply where it should (a reference from the same server)
    (cd "$SRC/tests/server" && "$PY" serve_fields_walk_test.py "http://127.0.0.1:$PORT" "$TMP/API.md") >"$TMP/walk" 2>&1
    prc=$?
    t_py_checks "$TMP/walk" "$prc" serve_fields_walk_test.py
    kill -TERM "$PID"
    wait "$PID" && ok "the server exits cleanly" || bad "the server's exit status"
    PID=
else
    bad "the server did not start: $(tail -3 "$TMP/err")"
fi
t_finish
