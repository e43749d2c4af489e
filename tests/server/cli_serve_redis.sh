#!/usr/bin/env bash
# cli_serve_redis — the block store's Redis tier shared by two servers, on Gemma 3 270M:
#   1. servers A and B run at once, each with its own --store directory, both with --redis on one
#      redis-server (started here on a free port, in this script's directory);
#   2. A answers a ~1.1k-token prompt (store "miss": prefilled; its blocks go to RAM, disk and Redis);
#   3. B answers the same prompt with store "exact" from Redis (nearly every prompt token loaded,
#      the identical greedy reply, redis hits in B's /metrics);
#   4. redis-server killed: both servers keep answering new prompts (prefill), and count Redis
#      errors in /metrics;
#   5. bad input: --redis with --no-store, a malformed URL (named, its password hidden).
# Skips (77) only when redis-server is not installed (scripts/bootstrap.sh installs it).
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_MODEL.
set -u
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
MODEL=${KVTIER_MODEL:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    echo "SKIP: KVTIER_MODEL ('$MODEL') is not a file"
    exit 77 # reported as skipped (SKIP_RETURN_CODE), never as passed
fi
if ! command -v redis-server >/dev/null; then
    echo "SKIP: redis-server is not installed (Debian: apt-get install redis-server)"
    exit 77
fi
. "$(dirname "$0")/../cli/lib.sh"
t_init serve-redis
PIDA= PIDB= RPID=
trap 'for p in $PIDA $PIDB $RPID; do kill -KILL "$p" 2>/dev/null; done; rm -rf "$TMP"' EXIT

RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$RPORT" --bind 127.0.0.1 --dir "$TMP" --save "" --appendonly no --logfile redis.log &
RPID=$!
for _ in $(seq 1 100); do
    [ "$(redis-cli -p "$RPORT" ping 2>/dev/null)" = PONG ] && break
    sleep 0.05
done
[ "$(redis-cli -p "$RPORT" ping 2>/dev/null)" = PONG ] && ok "redis-server on port $RPORT" || { bad "redis-server did not start"; t_finish; exit 1; }
URL=redis://127.0.0.1:$RPORT/0

# start VAR ERR ARGS...: `kvtier serve ARGS` on a free port; sets PID$VAR and PORT$VAR
start() {
    local v=$1 err=$2 pid port=
    shift 2
    "$BIN" serve -m "$MODEL" --port 0 --threads 1 "$@" >/dev/null 2>"$TMP/$err" &
    pid=$!
    for _ in $(seq 1 300); do
        port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/$err" | sed 's/.*://')
        [ -n "$port" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    eval "PID$v=$pid PORT$v=$port"
    [ -n "$port" ] && return 0
    bad "server $v did not start: $(tail -3 "$TMP/$err")"
    t_finish
    exit 1
}

# ask NAME PORT WORDS [TITLE]: one greedy chat request with a system document of WORDS words
ask() {
    python3 - "$2" "$3" "${4:-Archive notes}" >"$TMP/$1.json" 2>"$TMP/$1.pyerr" <<'EOF'
import json, sys, time, urllib.error, urllib.request
port, words, title = sys.argv[1], int(sys.argv[2]), sys.argv[3]
vocab = ("the river mill lantern harbor orchard comet glacier violin stone garden window winter summer market "
         "bridge quiet old north road letter clock paper music forest light small village").split()
r, out = 12345, []
for i in range(words):
    r = (r * 1103515245 + 12345) % 2**31
    out.append(vocab[(r >> 8) % len(vocab)] + ("." if i % 11 == 10 else ""))
doc = title + ": " + " ".join(out)
body = {"model": "m", "temperature": 0, "max_tokens": 12,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": "What is the first word of the notes?"}]}
req = urllib.request.Request("http://127.0.0.1:%s/v1/chat/completions" % port, json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
t0 = time.time()
try:
    res = json.load(urllib.request.urlopen(req, timeout=600))
except urllib.error.HTTPError as e:
    sys.exit("HTTP %d: %s" % (e.code, e.read().decode()[:300]))
res["_seconds"] = time.time() - t0
print(json.dumps(res))
EOF
}
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$TMP/$1.json" "$2" 2>/dev/null; }
metric() { curl -s "http://127.0.0.1:$1/metrics" | grep "^$2 " | awk '{print $2}'; } # PORT NAME{labels}

# --- 1-3. A computes, B loads it from Redis ---
start A errA --store "$TMP/storeA" --redis "$URL" --redis-timeout-ms 200 --budget 2048 -c 6144 --parallel 1
# B without prefetch: its gets themselves read Redis, so its /metrics count Redis hits (with
# prefetch, on by default, the blocks are promoted from Redis ahead and the gets hit RAM:
# tests/unit/test_store_prefetch.c and docs/BENCHMARKS.md "Block store prefetch")
start B errB --store "$TMP/storeB" --redis "$URL" --redis-timeout-ms 200 --budget 2048 -c 6144 --parallel 1 --no-prefetch
ask cold "$PORTA" 1000
route=$(field cold 'd["usage"]["kvtier"]["store"]')
pt=$(field cold 'd["usage"]["prompt_tokens"]')
[ "$route" = miss ] && [ "${pt:-0}" -ge 1050 ] && ok "A: $pt prompt tokens, store miss (prefilled)" || bad "A: route '$route', prompt $pt: $(cat "$TMP/cold.pyerr")"
# A's Redis writes are asynchronous: wait for its queue to drain
for _ in $(seq 1 100); do
    q=$(metric "$PORTA" kvtier_store_redis_queue_length)
    w=$(metric "$PORTA" 'kvtier_store_writes_total{tier="redis"}')
    [ "${q:-1}" = 0 ] && [ "${w:-0}" -gt 0 ] && break
    sleep 0.1
done
keys=$(redis-cli -p "$RPORT" --scan --pattern 'kvtier:b1:*' | wc -l)
[ "${w:-0}" -ge 16 ] && [ "$keys" = "$w" ] && ok "A wrote $w blocks to Redis ($keys keys kvtier:b1:*)" || bad "A's Redis writes: $w, keys $keys"
ask warm "$PORTB" 1000
route=$(field warm 'd["usage"]["kvtier"]["store"]')
fs=$(field warm 'd["usage"]["kvtier"]["prompt_tokens_from_store"]')
[ "$route" = exact ] && [ "${fs:-0}" -ge $((pt - 128)) ] \
    && ok "B (own empty store): store exact, $fs of $pt prompt tokens from Redis" || bad "B: route '$route', from store '$fs' of $pt"
c1=$(field cold 'd["choices"][0]["message"]["content"]')
c2=$(field warm 'd["choices"][0]["message"]["content"]')
[ -n "$c1" ] && [ "$c1" = "$c2" ] && ok "identical greedy reply: '$c1'" || bad "replies differ: '$c1' vs '$c2'"
echo "  time to the reply: A cold $(field cold 'round(d["_seconds"], 2)') s, B from Redis $(field warm 'round(d["_seconds"], 2)') s"
hB=$(metric "$PORTB" 'kvtier_store_hits_total{tier="redis"}')
dB=$(metric "$PORTB" 'kvtier_store_hits_total{tier="disk"}')
[ "${hB:-0}" -ge 16 ] && [ "${dB:-1}" = 0 ] && ok "B /metrics: $hB Redis hits, no disk hits" || bad "B /metrics: redis hits '$hB', disk hits '$dB'"
ratio=$(metric "$PORTB" 'kvtier_store_hit_ratio{tier="redis"}')
awk -v r="${ratio:-0}" 'BEGIN { exit !(r > 0.5 && r <= 1) }' && ok "B /metrics: Redis hit ratio $ratio" || bad "B /metrics: Redis hit ratio '$ratio'"
"$BIN" store stats --store "$TMP/storeA" --redis "$URL" >"$TMP/stats" 2>&1 && grep -q "^redis .*: $keys blocks" "$TMP/stats" \
    && ok "kvtier store stats --redis: $keys blocks" || bad "store stats: $(cat "$TMP/stats")"

# --- 4. Redis gone: both keep answering ---
kill -KILL "$RPID"; wait "$RPID" 2>/dev/null; RPID=
ask downA "$PORTA" 300 "Fresh ledger"
ask downB "$PORTB" 300 "Other ledger"
rA=$(field downA 'd["usage"]["kvtier"]["store"]'); rB=$(field downB 'd["usage"]["kvtier"]["store"]')
[ "$rA" = miss ] && [ "$rB" = miss ] && ok "Redis killed: A and B answer by prefill (store $rA, $rB)" \
    || bad "Redis killed: A '$rA' ($(cat "$TMP/downA.pyerr" | tail -1)), B '$rB' ($(cat "$TMP/downB.pyerr" | tail -1))"
sleep 0.3 # A's writer meets the dead Redis
eA=$(metric "$PORTA" 'kvtier_store_errors_total{tier="redis"}')
eB=$(metric "$PORTB" 'kvtier_store_errors_total{tier="redis"}')
[ "${eA:-0}" -ge 1 ] && [ "${eB:-0}" -ge 1 ] && ok "/metrics: Redis errors A $eA, B $eB" || bad "/metrics errors: A '$eA', B '$eB'"
ask again "$PORTB" 1000
[ "$(field again 'd["choices"][0]["message"]["content"]')" = "$c1" ] && ok "B still answers the first prompt (its own tiers now)" || bad "B again: $(cat "$TMP/again.pyerr" | tail -1)"
for v in A B; do
    eval "p=\$PID$v"
    kill -TERM "$p"; wait "$p" && ok "server $v: SIGTERM, exit 0 with Redis down" || bad "server $v exit status"
    eval "PID$v="
done

# --- 5. bad input ---
"$BIN" serve -m "$MODEL" --port 0 --no-store --redis "$URL" >/dev/null 2>"$TMP/err5"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--no-store" "$TMP/err5" && ok "--redis with --no-store: exit 2" || bad "--redis --no-store: rc $rc: $(cat "$TMP/err5")"
"$BIN" serve -m "$MODEL" --port 0 --store "$TMP/storeA" --redis "redis://admin:hunter2@localhost:port" >/dev/null 2>"$TMP/err6"; rc=$?
[ $rc -ne 0 ] && grep -q 'admin:\*\*\*@localhost:port' "$TMP/err6" && ! grep -q hunter2 "$TMP/err6" \
    && ok "a malformed URL: exit $rc naming it, password hidden" || bad "bad URL: rc $rc: $(cat "$TMP/err6")"
t_finish
