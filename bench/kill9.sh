#!/usr/bin/env bash
# bench/kill9.sh — `kill -9` of `kvtier serve` under load, ITER times (default 20; issue #24).
# Before the first kill a probe conversation (~1200 tokens, past the --budget 512) is sent, so its
# blocks are in the store.  Each round: the server on the same store under bench/soak.py's load
# (sessions and hostile connections), killed with SIGKILL after 2-6 s; then `kvtier store verify`
# must pass (no corrupt or missing block), the store must open again, and the probe must come from the
# store (usage.kvtier.prompt_tokens_from_store > 0) with the log-probabilities it had before any
# kill: no corrupt block is served.  That reference (same run) is the probe served from the store
# by a server started after the first one stopped cleanly: the same blocks loaded, the rest decoded
# alike, so the same numbers on any CPU.  A server without a store decodes the whole probe (another
# decode path, float summation in other orders): its numbers are printed, not compared.
#   bench/kill9.sh [ITER]    Environment: OUT=results/kill9-<time> BIN MODEL (as bench/soak.sh)
set -u
cd "$(dirname "$0")/.." || exit 2
eval "$(scripts/bootstrap.sh env)"
ITER=${1:-20}
OUT=${OUT:-results/kill9-$(date -u +%Y%m%d-%H%M%S)}
BIN=${BIN:-./build/kvtier}
MODEL=${MODEL:-$KVTIER_CHAT_MODEL}
PY=$(scripts/bootstrap.sh pyclient-path)
mkdir -p "$OUT"
KEY=kill-key-$RANDOM$RANDOM
echo "$KEY" >"$OUT/keys"
PID= LOAD= fails=0
trap 'kill -KILL $PID $LOAD 2>/dev/null' EXIT
start() { # NAME ARGS...: PID, PORT
    local name=$1
    shift
    "$BIN" serve -m "$MODEL" --port 0 --api-key-file "$OUT/keys" -c 8192 --budget 512 --parallel 4 --queue 128 "$@" \
        >/dev/null 2>"$OUT/$name.err" &
    PID=$!
    PORT=
    for _ in $(seq 1 300); do
        PORT=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$OUT/$name.err" | sed 's/.*://')
        [ -n "$PORT" ] && return 0
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.1
    done
    echo "kill9: server $name did not start: $(tail -3 "$OUT/$name.err")"
    return 1
}
probe() { # -> "from_store lp1 lp2 ..." of the probe conversation
    "$PY" - "http://127.0.0.1:$PORT" "$KEY" <<'PYEOF'
import json, sys, urllib.request
words = "river stone garden lamp window paper music winter orange bridge number forest engine cloud".split()
doc = " ".join(f"{words[i % len(words)]}{i % 97}" for i in range(400))
body = {"messages": [{"role": "user", "content": "Here are my notes: " + doc + "\nWhat is the first word?"}],
        "max_tokens": 6, "temperature": 0, "logprobs": True}
r = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json", "Authorization": "Bearer " + sys.argv[2]})
js = json.load(urllib.request.urlopen(r, timeout=300))
print(js["usage"]["kvtier"]["prompt_tokens_from_store"], *[round(x["logprob"], 5) for x in js["choices"][0]["logprobs"]["content"]])
PYEOF
}
start nostore --no-store || exit 1
nostore=$(probe)
kill -TERM "$PID"; wait "$PID"
echo "kill9: without a store (the whole probe decoded; not compared): ${nostore#* }"
start first --store "$OUT/store" || exit 1
probe >/dev/null
sleep 2 # the store's writer thread files the probe's blocks
kill -TERM "$PID"; wait "$PID"
# the reference: the probe served from the store before any kill, as every round serves it
start reference --store "$OUT/store" || exit 1
ref=$(probe)
kill -TERM "$PID"; wait "$PID"
echo "kill9: reference (from the store, before any kill): $ref"
if ! [ "${ref%% *}" -gt 0 ] 2>/dev/null; then
    echo "kill9: the reference probe did not come from the store: '$ref'"
    exit 1
fi
for i in $(seq 1 "$ITER"); do
    start "round$i" --store "$OUT/store" || { fails=$((fails + 1)); continue; }
    "$PY" bench/soak.py --url "http://127.0.0.1:$PORT" --key "$KEY" --pid "$PID" --seconds 30 --sessions 16 --hostile 20 \
        --out "$OUT/load$i" >/dev/null 2>&1 &
    LOAD=$!
    sleep "$((2 + RANDOM % 5)).$((RANDOM % 10))"
    kill -KILL "$PID"; wait "$PID" 2>/dev/null
    kill -KILL "$LOAD" 2>/dev/null; wait "$LOAD" 2>/dev/null
    # no corrupt or missing block; an orphan (a file whose row the kill prevented, or a temporary
    # file) is the crash remnant the store's write order allows and gc removes: counted, not a failure
    "$BIN" store verify --store "$OUT/store" --json >"$OUT/verify$i.txt" 2>&1
    vrc=$(python3 -c 'import json, sys
try:
    d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
    print(0 if d["corrupt"] == 0 and d["missing"] == 0 else 1, d["orphans"])
except Exception:
    print(2, 0)' "$OUT/verify$i.txt")
    orphans=${vrc#* }
    vrc=${vrc%% *}
    start "after$i" --store "$OUT/store" || { fails=$((fails + 1)); continue; }
    got=$(probe)
    kill -TERM "$PID"; wait "$PID"
    # the same blocks from the store and the same decode as the reference: the same numbers
    same=$(python3 -c 'import sys; a=sys.argv[1].split(); b=sys.argv[2].split(); print(int(a == b))' "$ref" "$got")
    if [ $vrc -eq 0 ] && [ "${got%% *}" -gt 0 ] 2>/dev/null && [ "$same" = 1 ]; then
        echo "kill9: round $i: verify ok (0 corrupt, 0 missing, $orphans orphans), probe from the store (${got%% *} tokens), log-probs as before the kills"
    else
        fails=$((fails + 1))
        echo "kill9: round $i FAILED: verify $vrc ($(tail -1 "$OUT/verify$i.txt")), probe '$got' vs '$ref'"
    fi
done
echo "kill9: $ITER rounds, $fails failed"
[ $fails -eq 0 ]
