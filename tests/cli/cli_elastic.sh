#!/bin/bash
# cli_elastic.sh — --elastic S_K,S_V on chat, serve and eval: bad values are usage errors (exit 2)
# whose message names the flag and the value; --elastic-random needs --elastic; a good value on
# the tiny model runs a chat turn with elastic on (the passes themselves: tests/unit/test_elastic.c).
. "$(dirname "$0")/lib.sh"
t_init elastic
K=${KVTIER_BIN:?}
TINY=${KVT_TINY_DIR:?}/tiny-llama.gguf

check_usage() { # what expected-substring cmd...
    local what=$1 want=$2
    shift 2
    local err
    err=$("$@" 2>&1 >/dev/null)
    local rc=$?
    if [ $rc -eq 2 ] && grep -qF -- "$want" <<<"$err"; then ok "$what"; else bad "$what: rc $rc, '$err'"; fi
}

for c in chat serve "eval ppl"; do
    check_usage "$c: negative" "K scale -0.1 is outside [0, 2]" $K $c -m "$TINY" --elastic -0.1,0.5
    check_usage "$c: above 2" "V scale 2.5 is outside [0, 2]" $K $c -m "$TINY" --elastic 0.45,2.5
    check_usage "$c: one number" "--elastic '0.45' is not two numbers" $K $c -m "$TINY" --elastic 0.45
    check_usage "$c: three numbers" "--elastic '1,1,1' is not two numbers" $K $c -m "$TINY" --elastic 1,1,1
    check_usage "$c: words" "--elastic 'a,b' is not two numbers" $K $c -m "$TINY" --elastic a,b
done
check_usage "eval: random without elastic" "--elastic-random needs --elastic" $K eval ppl -m "$TINY" --elastic-random
check_usage "eval: a bad second pair" "--elastic '0.5,x' is not two numbers" $K eval ppl -m "$TINY" --elastic 0.45,0.5/0.5,x

# a chat turn with elastic on: long enough for passes (the first at 192 tokens)
words=$(for i in $(seq 1 30); do printf 'river stone lamp orbit '; done)
out=$(printf '%s\n' "$words" | $K chat -m "$TINY" --ctx 2048 --budget 0 --no-store --max-tokens 4 --elastic 0.45,0.50 --json --seed 1 2>"$TMP/err")
rc=$?
if [ $rc -eq 0 ] && grep -q '"elastic":{"passes":' <<<"$out"; then ok "chat turn with --elastic 0.45,0.50 reports its passes"
else bad "chat with elastic: rc $rc, $out $(cat "$TMP/err")"; fi
t_finish
