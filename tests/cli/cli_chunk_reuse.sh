#!/bin/bash
# cli_chunk_reuse.sh — --chunk-reuse / --chunk-recompute on chat and serve: bad values are usage
# errors (exit 2) naming the value; --chunk-recompute needs --chunk-reuse, --chunk-reuse a store;
# end to end on the tiny model, a second `kvtier chat` process whose prompt holds the first one's
# documents in another order loads them as chunks (the JSON stats say how many tokens), and
# without --chunk-reuse loads none (the mechanism itself: tests/unit/test_chunk_reuse.c).
. "$(dirname "$0")/lib.sh"
t_init chunk_reuse
K=${KVTIER_BIN:?}
TINY=${KVT_TINY_DIR:?}/tiny-llama.gguf

check_usage() { # what expected-substring cmd...
    local what=$1 want=$2
    shift 2
    local err
    err=$("$@" 2>&1 >/dev/null </dev/null)
    local rc=$?
    if [ $rc -eq 2 ] && grep -qF -- "$want" <<<"$err"; then ok "$what"; else bad "$what: rc $rc, '$err'"; fi
}

for c in chat serve; do
    check_usage "$c: words" "chunk recompute 'abc' is not a token count K or a percentage P%" \
        $K $c -m "$TINY" --chunk-reuse --chunk-recompute abc
    check_usage "$c: above 100 %" "chunk recompute '150%': 150 % is outside 0..100 %" \
        $K $c -m "$TINY" --chunk-reuse --chunk-recompute 150%
    check_usage "$c: negative" "chunk recompute '-4' is not a whole number of tokens" \
        $K $c -m "$TINY" --chunk-reuse --chunk-recompute -4
    check_usage "$c: recompute without reuse" "--chunk-recompute '16' needs --chunk-reuse" \
        $K $c -m "$TINY" --chunk-recompute 16
    check_usage "$c: no store" "--chunk-reuse finds blocks in the block store" $K $c -m "$TINY" --chunk-reuse --no-store
done

# three "documents" of distinct words; the second process has them in another order
doc() { local w=$1; for i in $(seq 1 12); do printf '%s%d ' "$w" "$i"; done; }
A=$(doc amber); B=$(doc basil); C=$(doc cedar)
run() { # store extra-flags line -> the JSON turn line
    local store=$1 flags=$2 line=$3
    printf '%s\n' "$line" | $K chat -m "$TINY" --ctx 2048 --budget 0 --block 16 --store "$store" $flags --max-tokens 2 \
        --json --seed 1 2>>"$TMP/err"
}
out1=$(run "$TMP/s1" "--chunk-reuse --chunk-recompute 0" "$A. $B. $C. first question")
out2=$(run "$TMP/s1" "--chunk-reuse --chunk-recompute 0" "$C. $A. $B. second question")
n=$(sed -n 's/.*"prompt_tokens_from_chunks":\([0-9]*\).*/\1/p' <<<"$out2")
if [ -n "$n" ] && [ "$n" -ge 32 ]; then ok "chat --chunk-reuse: $n prompt tokens loaded as chunks in another order"
else bad "chat --chunk-reuse: '$n' from $out2 (first: $out1) $(cat "$TMP/err")"; fi
out3=$(run "$TMP/s2" "" "$A. $B. $C. first question")
out4=$(run "$TMP/s2" "" "$C. $A. $B. second question")
if [ -n "$out4" ] && ! grep -q '"chunks"' <<<"$out3$out4"; then ok "chat without --chunk-reuse: no chunk stored or loaded"
else bad "chat without --chunk-reuse: $out3 $out4 $(cat "$TMP/err")"; fi

# the server: --chunk-reuse through HTTP, counted in usage.kvtier and /metrics
PID=
trap '[ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT
$K serve -m "$TINY" --port 0 --threads 1 -c 2048 --budget 512 --block 16 --store "$TMP/ss" --chunk-reuse \
    --chunk-recompute 0 >/dev/null 2>"$TMP/serr" &
PID=$!
PORT=
for _ in $(seq 1 300); do
    PORT=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/serr" | sed 's/.*://')
    [ -n "$PORT" ] && break
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.2
done
ask() { # system-text -> usage.kvtier.prompt_tokens_from_chunks of a greedy 2-token reply
    python3 - "$PORT" "$1" <<'PYEOF'
import json, sys, urllib.request
port, system = sys.argv[1], sys.argv[2]
body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "which words?"}],
        "max_tokens": 2, "temperature": 0}
req = urllib.request.Request("http://127.0.0.1:%s/v1/chat/completions" % port, json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=120))["usage"]["kvtier"]["prompt_tokens_from_chunks"])
PYEOF
}
if [ -n "$PORT" ]; then
    c1=$(ask "$A. $B. $C.")
    c2=$(ask "$C. $A. $B.")
    m=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" |
        awk '$1 == "kvtier_prompt_tokens_from_chunks_total" { print $2 }')
    if [ "$c1" = 0 ] && [ -n "$c2" ] && [ "$c2" -ge 32 ] && [ "$m" = "$c2" ]; then
        ok "serve --chunk-reuse: usage.kvtier.prompt_tokens_from_chunks 0 then $c2, /metrics $m"
    else bad "serve --chunk-reuse: '$c1' then '$c2', /metrics '$m' $(tail -3 "$TMP/serr")"; fi
    kill -TERM "$PID"; wait "$PID"; PID=
else bad "server did not start: $(tail -3 "$TMP/serr")"; fi

# kvtier bench chunks --live: the measurement through sessions runs, and its rows say what they
# measured (k=0 loads chunks, off loads none); the numbers themselves: docs/BENCHMARKS.md
ESSAYS=${KVT_SOURCE_DIR:?}/../shared/data/pg_essays
if [ ! -d "$ESSAYS" ]; then echo "note: $ESSAYS is not a directory, bench chunks --live not run"; t_finish; exit; fi
out=$(OMP_WAIT_POLICY=PASSIVE $K bench chunks -m "$TINY" --live --quick --threads 1 --block 16 --texts "$ESSAYS" 2>"$TMP/err")
rc=$?
k0=$(awk '$1 == "k=0" { print $NF }' <<<"$out")
off=$(awk '$1 == "off" { print $NF }' <<<"$out")
if [ $rc -eq 0 ] && awk -v a="$k0" -v b="$off" 'BEGIN { exit !(a > 0 && b == 0) }'; then
    ok "bench chunks --live: k=0 loads $k0 of the prompt as chunks, off none"
else bad "bench chunks --live: rc $rc, k=0 '$k0', off '$off': $out $(tail -3 "$TMP/err")"; fi
t_finish
