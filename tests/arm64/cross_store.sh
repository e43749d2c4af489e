#!/usr/bin/env bash
# cross_store — blocks cross architectures (issue #44): a block store written by the x86-64 server
# is read by the ARM64 build (under qemu-aarch64) and the reverse, through the store's files and
# through Redis, on SmolLM2-135M-Instruct, over CROSS_PROMPTS prompts (default 4; each a ~370-token
# document with a code word and a question: tests/arm64/cross_lp.py):
#   1. x86-64 answers them with its own prefills (store misses; files + Redis A);
#   2. ARM64 answers them with its own prefills (store misses; files + Redis B);
#   3. each architecture reloads its own blocks from its files: store "exact" (the load path's
#      own effect: the prompt's tail decoded after the loaded prefix, in other ubatches);
#   4. ARM64 on x86-64's files, and on a fresh directory with Redis A: store "exact" (the same
#      content keys: the fingerprint names the model and the cache types, not the CPU);
#   5. x86-64 on ARM64's files, and on Redis B: store "exact";
# and the answers with the other architecture's blocks against the same architecture with its own
# blocks (3), beside the noise floor between the two architectures' own prefills (1 vs 2): as many
# prompts with the same greedy reply as the floor's (one fewer at most); the largest per-token
# log-probability difference within 2x the floor's largest + 0.01; the answer's log-probability
# (sum over the reply's common tokens), mean |difference| over the prompts, within 2x the floor's
# mean + 0.01, and printed against 1x.  The floor is a distribution: per prompt it spans 0.01-0.5
# nats here, so one prompt says little (docs/PLATFORMS.md has the figures, and the same test run
# between two x86-64 builds, AVX-512 and AVX2, for comparison).
# The replies are kept in $CROSS_STORE_KEEP when that names a directory.
#   tests/arm64/cross_store.sh X86_KVTIER ARM64_KVTIER      (ARM64_KVTIER: a command, e.g. a wrapper
#                                                          that runs the aarch64 binary under qemu;
#                                                          any two kvtier builds compare the same way)
# Environment: KVTIER_CHAT_MODEL, CROSS_PROMPTS. Needs redis-server (Debian's).
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
# ask NAME: the same CROSS_PROMPTS greedy requests, with per-token log-probabilities, into $TMP/NAME.json
LP=$(dirname "$0")/cross_lp.py
NP=${CROSS_PROMPTS:-4}
ask() {
    python3 "$LP" ask "$PORT" "$NP" "$TMP/$1.json" 2>"$TMP/$1.pyerr" || bad "$1: no reply: $(tail -2 "$TMP/$1.pyerr")"
}
# --- 1, 2: each architecture's own prefill, into its own files and Redis database ---------------
serve x86_own "$X86" --store "$TMP/s_x86" --redis "redis://127.0.0.1:$RPORT/1"
ask x86_own
stop x86_own
serve arm_own "$ARM" --store "$TMP/s_arm" --redis "redis://127.0.0.1:$RPORT/2"
ask arm_own
stop arm_own
# routes NAME: "STORE FROM PROMPT" per reply; ROUTES_N the replies, ROUTES_OK those that match $2
routes_all() { python3 "$LP" route "$TMP/$1.json" 2>/dev/null; }
routes_all x86_own >"$TMP/r1"; routes_all arm_own >"$TMP/r2"
if [ "$(wc -l <"$TMP/r1")" -eq "$NP" ] && ! grep -qv '^miss ' "$TMP/r1" "$TMP/r2" && cmp -s "$TMP/r1" "$TMP/r2" &&
    [ "$(awk '$3 < 300' "$TMP/r1" | wc -l)" -eq 0 ]; then
    ok "own prefills: $NP prompts, store miss on both, the same tokenization ($(awk '{print $3}' "$TMP/r1" | paste -sd' ') tokens)"
else
    bad "own prefills: x86 $(paste -sd, "$TMP/r1"); arm64 $(paste -sd, "$TMP/r2")"
fi
# diff A B: per-prompt lines, then "all SUM MEAN TOKMEAN NTOK NSAME" (cross_lp.py diff); FMAX is
# the largest per-token difference over the prompts
diff_lp() { python3 "$LP" diff "$TMP/$1.json" "$TMP/$2.json"; }
diff_lp x86_own arm_own >"$TMP/floor"
sed 's/^/  floor /' "$TMP/floor" | grep -v '^  floor all'
read -r _ fsum floor ftok fn fsame <<<"$(grep '^all ' "$TMP/floor")"
fmax=$(awk '$1 != "all" && $3 > m { m = $3 } END { printf "%.6f", m }' "$TMP/floor")
echo "  noise floor between the architectures' own prefills, mean over $NP prompts: |d answer logprob| $floor, per token $ftok (largest $fmax), $fn common tokens, $fsame same replies"
[ "${fn:-0}" -ge "$NP" ] && ok "the two architectures' replies share $fn leading tokens over $NP prompts" || bad "few common leading tokens: $(cat "$TMP/floor")"

# exact NAME: every request was a store "exact" with all its prompt's full blocks loaded
exact() {
    local bad_lines
    bad_lines=$(routes_all "$1" | awk '$1 != "exact" || $2 < $3 - 128' | paste -sd,)
    [ "$(routes_all "$1" | wc -l)" -eq "$NP" ] && [ -z "$bad_lines" ] \
        && ok "$1: store exact on all $NP prompts ($(routes_all "$1" | awk '{print $2 "/" $3}' | paste -sd' ') tokens loaded)" \
        || bad "$1: not exact: ${bad_lines:-$(routes_all "$1" | wc -l) replies}"
}
# check NAME REF: the answers with the other architecture's blocks (NAME) against the same
# architecture with its own blocks through the same load (REF): the same greedy replies; the
# largest per-token difference within 2x the floor's largest + 0.01; the answer's log-probability,
# mean |difference| over the prompts, against the floor's mean
check() {
    local d m tok n same
    exact "$1"
    diff_lp "$1" "$2" >"$TMP/d_$1"
    read -r _ _ d tok n same <<<"$(grep '^all ' "$TMP/d_$1")"
    m=$(awk '$1 != "all" && $3 > m { m = $3 } END { printf "%.6f", m }' "$TMP/d_$1")
    [ "$same" -ge $((fsame - 1)) ] && ok "$1: the same greedy reply as $2 on $same of $NP prompts (the own prefills agree on $fsame)" \
        || bad "$1: the same greedy reply as $2 on only $same of $NP prompts (the own prefills agree on $fsame)"
    if python3 -c "import sys; sys.exit(0 if float('$m') <= 2 * float('$fmax') + 0.01 else 1)" 2>/dev/null; then
        ok "$1: per-token |d logprob| at most $m vs $2, within 2 x the floor's $fmax + 0.01"
    else
        bad "$1: per-token |d logprob| up to $m vs $2, above 2 x the floor's $fmax + 0.01"
    fi
    sed "s/^/  $1 /" "$TMP/d_$1" | grep -v " all "
    python3 -c "import sys; sys.exit(0 if float('$d') <= float('$floor') + 0.01 else 1)" 2>/dev/null && w=within || w=above
    if python3 -c "import sys; sys.exit(0 if float('$d') <= 2 * float('$floor') + 0.01 else 1)" 2>/dev/null; then
        ok "$1: the answer's log-probability differs from $2's by $d nats (mean over $NP prompts; per token $tok): $w the floor $floor (+ 0.01), within 2 x"
    else
        bad "$1: the answer's log-probability differs from $2's by $d nats (mean over $NP prompts; per token $tok): above 2 x the floor $floor (+ 0.01)"
    fi
    echo "$1 $2 $d $tok $m $n $floor $ftok $fmax" >>"$TMP/findings"
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
    read -r _ _ d tok n same <<<"$(diff_lp $pair | grep '^all ')"
    echo "  the load path on one architecture ($pair): mean |d answer logprob| $d, per token $tok, over $n tokens, $same of $NP the same reply"
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
