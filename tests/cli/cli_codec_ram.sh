#!/usr/bin/env bash
# cli_codec_ram — block codecs on every tier from the command line:
#   --codec-ram (the session's host pool) on serve, chat and demo: a bad value is refused with a
#   message naming it (exit 2), before any model is loaded;
#   the live planted-fact demo on the instruct model (KVTIER_CHAT_MODEL, SmolLM2-135M-Instruct,
#   `demo --live`: 14 generated turns at budget 512) with q4 on the RAM tier and on the block
#   store's disk tier, beside the same demo with raw tiers: the q4 run evicts the fact's block,
#   loads it back from the q4-encoded pool copy and recalls the fact whenever the raw run does
#   (issue #14: "a session with codecs on all tiers passes the demo's recall on the instruct
#   model"), its answer's log-probability within 0.5 nats of raw's.
#   --codec-bits (per-head bits of q4/q8 tiers from a `kvtier calibrate` profile): bad specs, a
#   FRAC outside 0..1 and raw-only tiers are refused before any model loads (exit 2); a profile of
#   another model or a missing file exits 1 naming it; with the instruct model and its own profile
#   the store's q4 blocks with entropy:P:0.5 cost exactly the midpoint of q4's and q8's bytes (plus
#   the table's 8 + 96 bytes a block for 90 units), with 0 they cost q4's plus the table and with 1
#   q8's plus the table (the control: a flag that changed nothing would give q4's bytes).
set -u
. "$(dirname "$0")/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
CHAT=${KVTIER_CHAT_MODEL:-}
t_init cli-codec-ram

for c in serve chat demo; do
    "$BIN" $c -m /nonexistent.gguf --codec-ram q5 >"$TMP/$c.out" 2>"$TMP/$c.err"
    st=$?
    if [ $st -eq 2 ] && grep -q "codec-ram" "$TMP/$c.err" && grep -q "'q5'" "$TMP/$c.err"; then
        ok "$c --codec-ram q5 refused naming the value"
    else
        bad "$c --codec-ram q5: status $st, $(head -c 300 "$TMP/$c.err")"
    fi
done
"$BIN" chat -m /nonexistent.gguf --codec-ram q8:0 >"$TMP/g.out" 2>"$TMP/g.err"
st=$?
if [ $st -eq 2 ] && grep -q "group size 0" "$TMP/g.err"; then ok "chat --codec-ram q8:0 refused (group size)"; else
    bad "chat --codec-ram q8:0: status $st, $(head -c 300 "$TMP/g.err")"; fi

# --codec-bits: refused before the model loads, naming the value
for args in "--codec-disk q4 --codec-bits entropy" "--codec-disk q4 --codec-bits bogus:x" \
    "--codec-disk q4 --codec-bits entropy:/p.json:1.5" "--codec-disk raw --codec-bits entropy:/p.json" \
    "--codec-ram elastic --codec-bits entropy:/p.json"; do
    for c in serve chat demo; do
        # shellcheck disable=SC2086
        "$BIN" $c -m /nonexistent.gguf $args >"$TMP/b.out" 2>"$TMP/b.err"
        st=$?
        if [ $st -eq 2 ] && grep -q -- "--codec-bits '" "$TMP/b.err"; then ok "$c $args: refused (exit 2)"; else
            bad "$c $args: status $st, $(head -c 300 "$TMP/b.err")"; fi
    done
done

# eval --codec: bad lists refused naming what is wrong
expect_usage() { # DESCRIPTION NEEDLE ARGS...
    local what=$1 needle=$2
    shift 2
    "$BIN" eval ppl -m /nonexistent.gguf "$@" >"$TMP/e.out" 2>"$TMP/e.err"
    local st=$?
    if [ $st -eq 2 ] && grep -qF -- "$needle" "$TMP/e.err"; then ok "$what"; else
        bad "$what: status $st, $(head -c 300 "$TMP/e.err")"; fi
}
expect_usage "eval --codec q9 refused naming it" "'q9'" --policies no_eviction,kvtier --codec q9
expect_usage "eval --codec with an empty element refused" "empty" --policies kvtier --codec q4,,q8
# a codec's own arguments are comma-separated too: "q4:32,64,q9" is q4:32,64 (valid) and q9 (refused)
expect_usage "eval --codec keeps a codec's arguments together" "'q9'" --policies kvtier --codec q4:32,64,q9
expect_usage "eval --codec without a recovering policy refused" "lists neither" --policies no_eviction,h2o --codec q4

if [ -z "$CHAT" ] || [ ! -f "$CHAT" ]; then
    echo "no KVTIER_CHAT_MODEL: the demo part is skipped"
    t_finish
    exit $?
fi

run() {
    local name=$1
    shift
    if "$BIN" demo -m "$CHAT" --json-only --store "$TMP/store-$name" "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"; then
        tail -n 1 "$TMP/$name.out" >"$TMP/$name.json"
        echo "$name: $(cat "$TMP/$name.json")"
        ok "demo $name ran"
    else
        bad "demo $name exited with status $?"
        tail -n 20 "$TMP/$name.err"
        echo '{}' >"$TMP/$name.json"
    fi
}
run q4 --live --codec-ram q4 --codec-disk q4
run raw --live

check() {
    local out
    out=$(python3 - "$TMP" "$2" <<'EOF'
import json, sys
tmp, expr = sys.argv[1], sys.argv[2]
def load(name):
    try:
        return json.load(open(f"{tmp}/{name}.json"))
    except (OSError, ValueError):
        return {}
q, r = load("q4"), load("raw")
try:
    print("yes" if eval(expr) else "no")
except Exception as e:
    print(f"error: {type(e).__name__}: {e}")
EOF
)
    if [ "$out" = yes ]; then ok "$1"; else bad "$1 ($2 -> $out)"; fi
}
check "q4 tiers: evicted and recovered" 'q["evictions"] > 0 and q["recoveries"] > 0'
check "q4 tiers: the fact's block was evicted and is resident at the probe" \
    'q["fact_block_evictions"] > 0 and q["fact_block_resident_at_probe"] is True'
check "q4 tiers: the fact's block was loaded back" 'q["fact_block_recoveries"] > 0'
# greedy text moves with the CPU: q4's recall is judged against raw's in this same run
check "q4 tiers recall the fact whenever raw tiers do" 'q["recalled"] is True or r["recalled"] is False'
# (the counts are not compared with raw's: q4 and raw are not bit-identical, and live replies
# that part at a near tie on one CPU and not on another change every later count)
check "q4 tiers: the expected answer's log-probability within 0.5 nats of raw's" \
    'abs(q["answer_logprob"] - r["answer_logprob"]) <= 0.5'
python3 - "$TMP" <<'EOF2'
import json, sys
tmp = sys.argv[1]
try:
    q, r = (json.load(open(f"{tmp}/{n}.json")) for n in ("q4", "raw"))
    print(f"recalled: q4 {q['recalled']}, raw {r['recalled']}; answer_logprob q4 {q['answer_logprob']:.3f}, "
          f"raw {r['answer_logprob']:.3f}")
except Exception as e:
    print(f"unavailable ({e})")
EOF2

# --codec-bits on the store's disk tier, bytes against q4 and q8 in this run. The checks are on
# sizes, which any profile of this model gives: two of the repository's documents are the texts,
# so the test does not need the essays beside the repository.
mkdir -p "$TMP/texts"
cp "$KVT_SOURCE_DIR/docs/ARCHITECTURE.md" "$TMP/texts/a.txt"
cp "$KVT_SOURCE_DIR/docs/STORE.md" "$TMP/texts/b.txt"
if "$BIN" calibrate -m "$CHAT" -o "$TMP/prof.json" --texts "$TMP/texts" --n-texts 2 --tokens 256 --positions 128,256 -t 2 \
    >"$TMP/cal.out" 2>"$TMP/cal.err"; then ok "calibrate wrote the instruct model's profile"; else
    bad "calibrate: $(tail -n 5 "$TMP/cal.err")"; fi
prompt="Repeat these numbers: $(seq 1 200 | tr '\n' ' ')"
store_bytes() { # NAME FLAGS... -> the disk tier's bytes after one prompt, on stdout
    local name=$1
    shift
    # shellcheck disable=SC2086
    echo "$prompt" | "$BIN" chat -m "$CHAT" --store "$TMP/bits-$name" --max-tokens 1 -t 2 "$@" >"$TMP/bits-$name.out" \
        2>"$TMP/bits-$name.err" || { echo "chat $name: status $? $(tail -n 3 "$TMP/bits-$name.err")" >&2; echo 0; return; }
    "$BIN" store stats --store "$TMP/bits-$name" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes"])'
}
b4=$(store_bytes q4 --codec-disk q4)
b8=$(store_bytes q8 --codec-disk q8)
bh=$(store_bytes half --codec-disk q4 --codec-bits "entropy:$TMP/prof.json:0.5")
b0=$(store_bytes zero --codec-disk q4 --codec-bits "entropy:$TMP/prof.json:0")
b1=$(store_bytes one --codec-disk q4 --codec-bits "entropy:$TMP/prof.json:1")
n=$("$BIN" store stats --store "$TMP/bits-q4" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["entries"])')
nq4=$("$BIN" store ls --store "$TMP/bits-q4" | grep -cE '^[0-9a-f]{16}  [0-9a-f]{8} +[0-9]+  q4 ')
[ "$nq4" -gt 0 ] && [ "$nq4" = "$n" ] && ok "store ls names the codec: $nq4 q4 blocks" || bad "store ls: $nq4 rows named q4 of $n"
echo "store bytes: q4 $b4, q8 $b8, entropy 0 / 0.5 / 1: $b0 / $bh / $b1 ($n blocks)"
table=$((n * (8 + 96))) # a block's table: u32 count, u32 0, SmolLM2's 30 x 3 = 90 entries padded to 96
if [ "$b4" -gt 0 ] && [ "$b0" -eq $((b4 + table)) ]; then ok "entropy:P:0 = q4's bytes + the table"; else
    bad "entropy:P:0: $b0, q4 $b4 + table $table"; fi
if [ "$b8" -gt 0 ] && [ "$b1" -eq $((b8 + table)) ]; then ok "entropy:P:1 = q8's bytes + the table"; else
    bad "entropy:P:1: $b1, q8 $b8 + table $table"; fi
if [ "$b4" -gt 0 ] && [ $((2 * (bh - table))) -eq $((b4 + b8)) ]; then
    ok "entropy:P:0.5 = the midpoint of q4's and q8's bytes + the table (45 of 90 units at 8 bits)"
else bad "entropy:P:0.5: $bh, midpoint $(((b4 + b8) / 2)) + table $table"; fi
if [ -n "${KVTIER_MODEL:-}" ] && [ -f "$KVTIER_MODEL" ] && [ "$KVTIER_MODEL" != "$CHAT" ]; then
    "$BIN" chat -m "$KVTIER_MODEL" --store "$TMP/bits-other" --codec-disk q4 --codec-bits "entropy:$TMP/prof.json" \
        </dev/null >"$TMP/o.out" 2>"$TMP/o.err"
    st=$?
    if [ $st -eq 1 ] && grep -q "prof.json" "$TMP/o.err" && grep -q "another model" "$TMP/o.err"; then
        ok "another model's profile refused (exit 1), naming the file"
    else bad "another model's profile: status $st, $(head -c 300 "$TMP/o.err")"; fi
fi
"$BIN" chat -m "$CHAT" --no-store --codec-ram q4 --codec-bits "entropy:$TMP/missing.json" </dev/null >"$TMP/m.out" 2>"$TMP/m.err"
st=$?
if [ $st -eq 1 ] && grep -q "missing.json" "$TMP/m.err"; then ok "a missing profile: exit 1 naming it"; else
    bad "missing profile: status $st, $(head -c 300 "$TMP/m.err")"; fi
t_finish
