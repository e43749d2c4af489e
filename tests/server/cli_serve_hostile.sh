#!/usr/bin/env bash
# cli_serve_hostile — `kvtier serve` against hostile and broken clients (issue #24,
# tests/server/serve_hostile_test.py: every class of bad input, bodies without a key, slow
# headers and bodies, the per-address cap), with tight deadlines so it runs in seconds; then
# the tenant ids: the same key keeps its tenant when the key file is reordered, and a server
# with another secret gives it another.  Skips (77) without the chat model.
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
t_need_chat_model
t_init cli-serve-hostile
PID=
trap '[ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT
PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient || { bad "bootstrap.sh pyclient"; t_finish; exit 1; }

# start NAME ARGS...: the server in the background (PID), its port in PORT
start() {
    local name=$1
    shift
    PORT=
    "$BIN" serve -m "$MODEL" --port 0 --threads 1 --parallel 1 -c 2048 --budget 512 "$@" >/dev/null 2>"$TMP/$name.err" &
    PID=$!
    PORT=$(t_listening "$TMP/$name.err" "$PID")
    [ -n "$PORT" ] && ok "$name server listening on port $PORT" || { bad "$name server did not start"; cat "$TMP/$name.err"; }
}
stop() {
    kill -TERM "$PID" 2>/dev/null
    wait "$PID" 2>/dev/null
    PID=
}

printf 'key-one-111\nkey-two-222\n' >"$TMP/keys"
start hostile --api-key-file "$TMP/keys" --store "$TMP/store" --header-timeout-s 2 --body-timeout-s 3 \
    --max-connections-per-ip 150 --max-body-mb 1 --queue 4
if [ -n "$PORT" ]; then
    ( cd "$SRC/tests/server" && "$PY" serve_hostile_test.py "http://127.0.0.1:$PORT" key-two-222 key-one-111 ) >"$TMP/py" 2>&1
    prc=$?
    t_py_checks "$TMP/py" "$prc" serve_hostile_test.py
fi
# tenant of a key: the salt of the blocks its prompts store; a prompt sent under key-two must
# still be key-two's after the key file is reordered (a tenant was once the key's line number)
# (the prompt: ~250 tokens, so whole blocks of 64 are stored)
words=$(for i in $(seq 1 120); do printf 'river%d stone ' "$i"; done)
q="{\"messages\":[{\"role\":\"user\",\"content\":\"Remember these words: $words\"}],\"max_tokens\":2}"
curl -s -H "Authorization: Bearer key-two-222" -d "$q" "http://127.0.0.1:$PORT/v1/chat/completions" >/dev/null
stop
n_log=$(grep -c 'libmicrohttpd\|connection limit' "$TMP/hostile.err")
[ "$n_log" -le 10 ] && ok "libmicrohttpd's messages about refused connections: $n_log lines (at most one a second)" ||
    bad "libmicrohttpd flooded the log: $n_log lines"
[ -f "$TMP/store/server-secret" ] && [ "$(stat -c %a "$TMP/store/server-secret")" = 600 ] &&
    [ "$(stat -c %s "$TMP/store/server-secret")" = 32 ] && ok "server secret: 32 bytes, mode 600, in the store" ||
    bad "server secret: $(ls -l "$TMP/store" 2>&1)"
t1=$(grep -c . "$TMP/keys")
printf 'key-zero-000\nkey-two-222\nkey-one-111\n' >"$TMP/keys2"
sum=$(sha256sum "$TMP/store/server-secret")
start reordered --api-key-file "$TMP/keys2" --store "$TMP/store"
# the store keeps its blocks, not sessions: the same prompt under the same key must come from
# the store (same tenant salt); under key-zero (line 1 now, where key-two was line 2) it must not
fs2=$(curl -s -H "Authorization: Bearer key-two-222" -d "$q" "http://127.0.0.1:$PORT/v1/chat/completions" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["usage"]["kvtier"]["prompt_tokens_from_store"])')
fs0=$(curl -s -H "Authorization: Bearer key-zero-000" -d "$q" "http://127.0.0.1:$PORT/v1/chat/completions" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["usage"]["kvtier"]["prompt_tokens_from_store"])')
stop
[ "$sum" = "$(sha256sum "$TMP/store/server-secret")" ] && ok "the secret is kept across restarts" || bad "the secret changed"
[ "${fs2:-0}" -gt 0 ] && [ "${fs0:-1}" = 0 ] &&
    ok "key file reordered ($t1 -> 3 keys): key-two's prompt from the store ($fs2 tokens), the new key-zero gets none" ||
    bad "key file reordered: key-two from store '$fs2', key-zero '$fs0'"
# another server secret (another store): the same key is another tenant there
start other --api-key-file "$TMP/keys2" --store "$TMP/store2"
cmp -s "$TMP/store/server-secret" "$TMP/store2/server-secret" && bad "two stores drew the same secret" ||
    ok "another store, another secret"
stop
# --request-timeout-s: a stopped prefill leaves its session as it was (tests/server/serve_deadline_test.py)
start deadline --no-store -c 16384 --request-timeout-s 2
if [ -n "$PORT" ]; then
    ( cd "$SRC/tests/server" && "$PY" serve_deadline_test.py "http://127.0.0.1:$PORT" ) >"$TMP/py2" 2>&1
    prc=$?
    t_py_checks "$TMP/py2" "$prc" serve_deadline_test.py
fi
stop
# SIGTERM drains with a deadline (--drain-s), a second signal stops at once: a completion of 4000
# tokens (~40 s here) in flight; the server must be gone within a few seconds either way, and the
# client gets its reply cut (200, finish_reason length)
for how in deadline second-signal; do
    if [ $how = deadline ]; then start drain-$how --no-store -c 8192 --budget 4096 --drain-s 2 --request-timeout-s 0
    else start drain-$how --no-store -c 8192 --budget 4096 --drain-s 600 --request-timeout-s 0; fi
    # a completion that counts on (it does not end by itself)
    curl -s -o "$TMP/drain-$how.json" -d '{"prompt":"1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,","max_tokens":4000,"temperature":0}' \
        "http://127.0.0.1:$PORT/v1/completions" &
    CURL=$!
    for _ in $(seq 1 100); do
        curl -s "http://127.0.0.1:$PORT/metrics" | grep -q '^kvtier_active_requests 1$' && break
        sleep 0.05
    done
    t0=$(date +%s%N)
    kill -TERM "$PID"
    if [ $how = second-signal ]; then sleep 1; kill -INT "$PID"; fi
    wait "$PID"; src=$?
    dt=$((($(date +%s%N) - t0) / 1000000000))
    PID=
    wait "$CURL"
    fin=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["choices"][0]["finish_reason"], d["usage"]["completion_tokens"])' "$TMP/drain-$how.json" 2>/dev/null)
    [ "$dt" -lt 6 ] && [ $src -eq 0 ] && [ "${fin%% *}" = length ] && [ "${fin##* }" -lt 4000 ] &&
        ok "SIGTERM, $how: exited 0 in $dt s, the reply in flight cut ($fin)" ||
        bad "SIGTERM, $how: exit $src after $dt s, reply '$fin' $(tail -2 "$TMP/drain-$how.err")"
done
if grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:' "$TMP"/*.err; then
    bad "sanitizer report on a server's stderr"; grep -A20 -E 'Sanitizer|runtime error' "$TMP"/*.err | head -60
else
    ok "no sanitizer report"
fi
t_finish
