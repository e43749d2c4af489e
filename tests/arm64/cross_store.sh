#!/usr/bin/env bash
# cross_store — blocks cross architectures (issue #44): a block store written by the x86-64 server
# is read by the ARM64 build (under qemu-aarch64) and the reverse, through the store's files and
# through Redis, on SmolLM2-135M-Instruct:
#   1. x86-64 answers a ~430-token prompt with its own prefill (store miss; files + Redis A);
#   2. ARM64 answers it with its own prefill (store miss; files + Redis B);
#   3. each architecture reloads its own blocks from its files: store "exact" (the load path's
#      own effect: the prompt's tail decoded after the loaded prefix, in other ubatches);
#   4. ARM64 on x86-64's files, and on a fresh directory with Redis A: store "exact" (the same
#      content keys: the fingerprint names the model and the cache types, not the CPU);
#   5. x86-64 on ARM64's files, and on Redis B: store "exact";
# and the answer with the other architecture's blocks against the same architecture with its own
# blocks (3): the same greedy reply, and per-token log-probabilities within 2x the largest
# per-token difference this run measures between the two architectures' own prefills (1 vs 2)
# + 0.01. The answer's log-probability (the sum over the reply's tokens) is printed beside the
# same floor: measured here it is *beyond* it (0.30 and 0.43 nats against 0.086 over 12 tokens,
# per token 0.14 against 0.11; docs/PLATFORMS.md): the CPU is not in the key all the same.
# The replies are kept in $CROSS_STORE_KEEP when that names a directory.
#   tests/arm64/cross_store.sh X86_KVTIER ARM64_KVTIER      (ARM64_KVTIER: a command, e.g. a wrapper
#                                                          that runs the aarch64 binary under qemu)
# Environment: KVTIER_CHAT_MODEL. Needs redis-server (Debian's).
set -u
. "$(dirname "$0")/../cli/lib.sh"
X86=${1:?usage: cross_store.sh X86_KVTIER ARM64_KVTIER}
ARM=${2:?usage: cross_store.sh X86_KVTIER ARM64_KVTIER}
t_need_chat_model
command -v redis-server >/dev/null || { echo "SKIP: no redis-server"; exit 77; }
t_init arm64-cross-store
PID= RPID=
trap '{ [ -n "$PID" ] && kill -KILL "$PID"; [ -n "$RPID" ] && kill -KILL "$RPID" && wait "$RPID"; } 2>/dev/null; rm -rf "$TMP"' EXIT

# a private redis-server on a free port, no persistence
RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$RPORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP" >"$TMP/redis.log" 2>&1 &
RPID=$!
for _ in $(seq 1 50); do redis-cli -p "$RPORT" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done

# serve NAME BIN ARGS...: `BIN serve` on a free port (PORT once it listens); under qemu a prefill
# takes minutes and a Redis read more than the default 20 ms: no request deadline, 5 s for Redis
serve() {
    local name=$1 bin=$2
    shift 2
    $bin serve -m "$MODEL" --port 0 --threads 2 --budget 2048 -c 4096 --parallel 1 \
        --request-timeout-s 0 --redis-timeout-ms 5000 "$@" >/dev/null 2>"$TMP/$name.err" &
    PID=$!
    PORT=$(t_listening "$TMP/$name.err" "$PID" 300)
    [ -n "$PORT" ] && return 0
    bad "$name: the server did not start: $(tail -3 "$TMP/$name.err")"
    t_finish
    exit 1
}
stop() {
    kill -TERM "$PID" 2>/dev/null
    wait "$PID"
    local rc=$?
    PID=
    [ "$rc" -eq 0 ] || bad "$1: the server exited $rc"
}
# ask NAME: the same greedy request, with per-token log-probabilities, into $TMP/NAME.json
ask() {
    python3 - "$PORT" >"$TMP/$1.json" 2>"$TMP/$1.pyerr" <<'EOF'
import json, sys, urllib.request
vocab = ("the river mill lantern harbor orchard comet glacier violin stone garden window winter summer market "
         "bridge quiet old north road letter clock paper music forest light small village").split()
r, out = 4242, []
for i in range(300):
    r = (r * 1103515245 + 12345) % 2**31
    out.append(vocab[(r >> 8) % len(vocab)] + ("." if i % 11 == 10 else ""))
doc = "Harbor log. The keeper's code word is amber-falcon. " + " ".join(out)
body = {"model": "m", "temperature": 0, "max_tokens": 12, "logprobs": True,
        "messages": [{"role": "system", "content": doc},
                     {"role": "user", "content": "What is the keeper's code word?"}]}
req = urllib.request.Request("http://127.0.0.1:%s/v1/chat/completions" % sys.argv[1], json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=1800))))
EOF
    [ -s "$TMP/$1.json" ] || bad "$1: no reply: $(tail -2 "$TMP/$1.pyerr")"
}
route() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); k=d["usage"]["kvtier"]; print(k["store"], k["prompt_tokens_from_store"], d["usage"]["prompt_tokens"])' "$TMP/$1.json" 2>/dev/null; }
# diff A B: "SUM_ABS MAX_ABS N TEXT_A | TEXT_B" over the replies' common leading tokens (N of
# them): |difference of the sums of their log-probabilities|, the largest per-token difference
diff_lp() {
    python3 - "$TMP/$1.json" "$TMP/$2.json" <<'EOF'
import json, sys
def toks(p):
    try:
        d = json.load(open(p))
    except Exception:
        print("nan nan 0 (no reply in %s)" % p); sys.exit(0)
    c = d["choices"][0]
    return [(t["token"], t["logprob"]) for t in c["logprobs"]["content"]], c["message"]["content"]
a, ta = toks(sys.argv[1]); b, tb = toks(sys.argv[2])
n, m, sa, sb = 0, 0.0, 0.0, 0.0
while n < min(len(a), len(b)) and a[n][0] == b[n][0]:
    m = max(m, abs(a[n][1] - b[n][1])); sa += a[n][1]; sb += b[n][1]; n += 1
print("%.6f %.6f %d %s | %s" % (abs(sa - sb), m, n, ta.replace("\n", " "), tb.replace("\n", " ")))
EOF
}

# --- 1, 2: each architecture's own prefill, into its own files and Redis database ---------------
serve x86_own "$X86" --store "$TMP/s_x86" --redis "redis://127.0.0.1:$RPORT/1"
ask x86_own
stop x86_own
serve arm_own "$ARM" --store "$TMP/s_arm" --redis "redis://127.0.0.1:$RPORT/2"
ask arm_own
stop arm_own
read -r rx fx px <<<"$(route x86_own)"; read -r ra fa pa <<<"$(route arm_own)"
[ "$rx" = miss ] && [ "$ra" = miss ] && [ "$px" = "$pa" ] && [ "${px:-0}" -ge 300 ] \
    && ok "own prefills: store miss on both ($px prompt tokens, the same tokenization)" \
    || bad "own prefills: x86 '$rx' $px tokens, arm64 '$ra' $pa tokens"
read -r floor fmax nfl rest <<<"$(diff_lp x86_own arm_own)"
echo "  noise floor between the architectures' own prefills: |d answer logprob| $floor (largest per token $fmax) over $nfl common tokens ($rest)"
[ "${nfl:-0}" -ge 1 ] && ok "the two architectures' replies share $nfl leading tokens" || bad "no common leading token: $rest"

# exact NAME: the request was a store "exact" with all the prompt's full blocks loaded
exact() {
    local r f p
    read -r r f p <<<"$(route "$1")"
    [ "$r" = exact ] && [ "${f:-0}" -ge $((p - 128)) ] \
        && ok "$1: store exact, $f of $p prompt tokens loaded" || bad "$1: route '$r', $f of $p from the store"
}
# check NAME REF: the answer with the other architecture's blocks (NAME) against the same
# architecture with its own blocks through the same load (REF)
check() {
    local d m n rest t1 t2
    exact "$1"
    read -r d m n rest <<<"$(diff_lp "$1" "$2")"
    t1=${rest%% | *}; t2=${rest#* | }
    [ "$n" -ge 1 ] && [ "$t1" = "$t2" ] && ok "$1: the same greedy reply as $2 ($n tokens)" || bad "$1: replies differ: $rest"
    if python3 -c "import sys; sys.exit(0 if float('$m') <= 2 * float('$fmax') + 0.01 else 1)" 2>/dev/null; then
        ok "$1: per-token |d logprob| at most $m vs $2, within 2 x the floor $fmax + 0.01"
    else
        bad "$1: per-token |d logprob| up to $m vs $2, above 2 x the floor $fmax + 0.01 ($rest)"
    fi
    python3 -c "import sys; sys.exit(0 if float('$d') <= float('$floor') + 0.01 else 1)" 2>/dev/null && w=within || w=BEYOND
    echo "  $1: the answer's log-probability differs by $d nats from $2's: $w the floor $floor (+ 0.01)"
    echo "$1 $2 $d $m $n" >>"$TMP/findings"
}

# --- 3. each architecture's own blocks, loaded back ---------------------------------------------
serve x86_reload "$X86" --store "$TMP/s_x86"
ask x86_reload
stop x86_reload
exact x86_reload
serve arm_reload "$ARM" --store "$TMP/s_arm"
ask arm_reload
stop arm_reload
exact arm_reload
for pair in "x86_reload x86_own" "arm_reload arm_own"; do
    read -r d m n rest <<<"$(diff_lp $pair)"
    echo "  the load path on one architecture ($pair): |d answer logprob| $d, per token at most $m, over $n tokens"
done

# --- 4. ARM64 reads what x86-64 wrote ---------------------------------------------------------------
serve arm_files "$ARM" --store "$TMP/s_x86"
ask arm_files
stop arm_files
check arm_files arm_reload
serve arm_redis "$ARM" --store "$TMP/s_arm_empty" --redis "redis://127.0.0.1:$RPORT/1"
ask arm_redis
stop arm_redis
check arm_redis arm_reload

# --- 5. x86-64 reads what ARM64 wrote ---------------------------------------------------------------
serve x86_files "$X86" --store "$TMP/s_arm"
ask x86_files
stop x86_files
check x86_files x86_reload
serve x86_redis "$X86" --store "$TMP/s_x86_empty" --redis "redis://127.0.0.1:$RPORT/2"
ask x86_redis
stop x86_redis
check x86_redis x86_reload

[ -n "${CROSS_STORE_KEEP:-}" ] && [ -d "$CROSS_STORE_KEEP" ] && cp "$TMP"/*.json "$TMP/findings" "$CROSS_STORE_KEEP"/ 2>/dev/null
t_finish
