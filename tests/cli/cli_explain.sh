#!/bin/bash
# cli_explain.sh — `kvtier chat --explain` prints each prompt's decisions on stderr, and they are
# the decisions taken: on the tiny model under a small budget, one "evict blk" line per eviction
# the JSON stats count, "recovered K of the N blocks" lines whose K add up to the stats'
# recoveries (a plan's weakest blocks are dropped when they do not fit), a "feed" line per run
# (message and assistant prefix every turn).  Control: without --explain, none, the same turns.
. "$(dirname "$0")/lib.sh"
t_init explain
K=${KVTIER_BIN:?}
TINY=${KVT_TINY_DIR:?}/tiny-llama.gguf
for i in $(seq 1 8); do echo "turn $i: the river stone lamp orbit number $i is $((i * 137)) and the harbor lantern glows"; done >"$TMP/script"
run() { $K chat -m "$TINY" --ctx 2048 --budget 192 --block 32 --no-store --max-tokens 8 --json --seed 1 --script "$TMP/script" "$@"; }
run --explain >"$TMP/out" 2>"$TMP/err"
rc=$?
last=$(tail -n 1 "$TMP/out")
ev=$(sed -n 's/.*"evictions":\([0-9]*\).*/\1/p' <<<"$last")
rec=$(sed -n 's/.*"recoveries":\([0-9]*\).*/\1/p' <<<"$last")
n_ev=$(grep -c '^\[explain\] evict blk' "$TMP/err")
n_rec=$(grep '^\[explain\] recovered [0-9]* of' "$TMP/err" | sed 's/.*recovered \([0-9]*\) of.*/\1/' | awk '{ s += $1 } END { print s + 0 }')
n_feed=$(grep -c '^\[explain\] feed ' "$TMP/err")
if [ $rc -eq 0 ] && [ -n "$ev" ] && [ "$ev" -gt 0 ] && [ "$n_ev" -eq "$ev" ]; then ok "one evict line per eviction ($n_ev, the stats say $ev)"
else bad "evict lines $n_ev against $ev evictions (rc $rc) $(tail -n 3 "$TMP/err")"; fi
if [ -n "$rec" ] && [ "$rec" -gt 0 ] && [ "$n_rec" -eq "$rec" ]; then ok "the recovery lines say $n_rec blocks came back, as the stats ($rec)"
else bad "the recovery lines say $n_rec blocks came back, the stats $rec"; fi
[ "$n_feed" -ge 16 ] && ok "$n_feed runs fed over 8 turns" || bad "$n_feed feed lines over 8 turns"
run >"$TMP/out2" 2>"$TMP/err2"
if [ $? -eq 0 ] && ! grep -q '^\[explain\]' "$TMP/err2" && [ "$(tail -n 1 "$TMP/out2")" = "$last" ]; then
    ok "control: without --explain no line, and the same turns"
else bad "control: explain lines without --explain, or other turns"; fi
t_finish
