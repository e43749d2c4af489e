#!/usr/bin/env bash
# cli_errors — bad input to the kvtier command line.
#
# Each case asserts the exit status (2 = usage error, 1 = runtime error), that stderr names the
# bad value, and that the process did not crash (no signal, no sanitizer report).
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_MODEL, KVT_TINY_DIR.
set -u
. "$(dirname "$0")/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
MODEL=${KVTIER_MODEL:-}
TINY=${KVT_TINY_DIR:-}
t_init cli-errors
ulimit -c 0 2>/dev/null || true

# expect NAME WANT_EXIT STREAM FRAGMENT -- COMMAND...
#   STREAM is err or out: where FRAGMENT (a fixed string) must appear.
expect() {
    local name=$1 want=$2 stream=$3 frag=$4
    shift 5
    "$@" >"$TMP/out" 2>"$TMP/err" </dev/null
    local rc=$? why=""
    if [ "$rc" -ge 128 ]; then
        why="killed by signal $((rc - 128))"
    elif [ "$rc" -ne "$want" ]; then
        why="exit status $rc, expected $want"
    fi
    if ! grep -qF -- "$frag" "$TMP/$stream"; then
        why="${why:+$why; }std$stream lacks \"$frag\""
    fi
    if grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:|Segmentation fault|core dumped' \
        "$TMP/err"; then
        why="${why:+$why; }crash or sanitizer report on stderr"
    fi
    if [ -z "$why" ]; then
        pass=$((pass + 1))
        echo "ok   $name"
    else
        fail=$((fail + 1))
        echo "FAIL $name: $why"
        echo "     command: $*"
        sed 's/^/     stderr: /' "$TMP/err" | head -n 8
    fi
}

if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    echo "FAIL KVTIER_MODEL ('$MODEL') is not a file"
    echo "0 passed, 1 failed"
    exit 1
fi

# --- the model file ---
expect "missing model file" 1 err "model file '$TMP/missing.gguf': No such file or directory" -- \
    "$BIN" chat -m "$TMP/missing.gguf"
head -c 1048576 "$MODEL" >"$TMP/truncated.gguf"
expect "truncated model file" 1 err "could not load '$TMP/truncated.gguf' (1048576 bytes)" -- \
    "$BIN" chat -m "$TMP/truncated.gguf"
printf 'these are my notes, not a model\n' >"$TMP/notes.gguf"
expect "non-GGUF file" 1 err "could not load '$TMP/notes.gguf'" -- \
    "$BIN" chat -m "$TMP/notes.gguf"
expect "model path is a directory" 1 err "model path '$TMP' is not a regular file" -- \
    "$BIN" chat -m "$TMP"
if [ -n "$TINY" ] && [ -f "$TINY/tiny-notok.gguf" ]; then
    printf 'hello\n' >"$TMP/hello.txt"
    expect "model without a tokenizer" 1 err "has no tokenizer" -- \
        "$BIN" chat -m "$TINY/tiny-notok.gguf" --script "$TMP/hello.txt"
fi

# --- flags ---
expect "budget smaller than two blocks" 2 err "budget 48 is smaller than two blocks of 64 tokens" -- \
    "$BIN" chat -m "$MODEL" --budget 48 --block 64
expect "unknown flag" 2 err "kvtier chat: unknown option '--foo'" -- \
    "$BIN" chat -m "$MODEL" --foo
expect "unknown flag hint" 2 err "Try 'kvtier chat --help'" -- \
    "$BIN" chat -m "$MODEL" --foo=1
expect "recovery bogus" 2 err "--recovery 'bogus' is not one of kv_restore, discard" -- \
    "$BIN" chat -m "$MODEL" --recovery bogus
expect "budget not an integer" 2 err "--budget '12x' is not an integer" -- \
    "$BIN" chat -m "$MODEL" --budget 12x
expect "temperature out of range" 2 err "--temp -1 is outside" -- \
    "$BIN" chat -m "$MODEL" --temp -1
expect "flag without its value" 2 err "option '--ctx' needs a value" -- \
    "$BIN" chat -m "$MODEL" --ctx
expect "no model given" 2 err "no model given" -- \
    "$BIN" chat --budget 512
expect "budget above the context" 2 err "budget 512 exceeds the context of 256 tokens" -- \
    "$BIN" chat -m "$MODEL" --ctx 256
expect "unknown cache type" 2 err "K cache type 'q4_0' is not one of f16, f32, q8_0" -- \
    "$BIN" chat -m "$MODEL" --type-k q4_0
expect "missing script" 1 err "cannot open script '$TMP/none.txt'" -- \
    "$BIN" chat -m "$MODEL" --script "$TMP/none.txt"
expect "demo: unknown flag" 2 err "kvtier demo: unknown option '--bogus'" -- \
    "$BIN" demo -m "$MODEL" --bogus
expect "bench: bad block list" 2 err "--blocks element 'x' is not a block size" -- \
    "$BIN" bench primitives -m "$MODEL" --blocks 16,x
expect "bench: unknown benchmark" 2 err "unknown benchmark 'everything'" -- \
    "$BIN" bench everything
expect "unknown command" 2 err "kvtier: unknown command 'frobnicate'" -- \
    "$BIN" frobnicate

# --- a prompt longer than the context ---
python3 -c "import sys; sys.stdout.write(' '.join('word%d' % (i % 97) for i in range(2000)) + '\n')" >"$TMP/long.txt"
expect "prompt longer than the context" 1 err "the context holds 256" -- \
    "$BIN" chat -m "$MODEL" --ctx 256 --budget 256 --script "$TMP/long.txt"
expect "prompt longer than the context names its tokens" 1 err "turn 1: user message of" -- \
    "$BIN" chat -m "$MODEL" --ctx 256 --budget 256 --script "$TMP/long.txt"

# --- version ---
expect "--version names llama.cpp" 0 out "llama.cpp 0." -- "$BIN" --version
expect "version names kvtier" 0 out "kvtier 0." -- "$BIN" version
expect "--version names the device backend" 0 out ", backend " -- "$BIN" --version
expect "--version lists the devices llama.cpp can use" 0 out "devices: " -- "$BIN" --version

# --- device flags (llama-server's names and values) ---
expect "-ngl abc -> usage error naming the value" 2 err "'abc'" -- "$BIN" serve -ngl abc
expect "--n-gpu-layers -5 -> usage error naming the value" 2 err "'-5'" -- "$BIN" chat -m x --n-gpu-layers -5
expect "-fa maybe -> usage error naming the value" 2 err "--flash-attn 'maybe' is not on, off or auto" -- "$BIN" serve -fa maybe
expect "bench primitives --flash-attn sometimes -> usage error" 2 err "'sometimes'" -- "$BIN" bench primitives --flash-attn sometimes
expect "serve --help lists -ngl's long name" 0 out "--n-gpu-layers N" -- "$BIN" serve --help
# stored responses' expiry (issue #41): out of range -> usage error naming the flag; --help lists them
expect "--response-ttl -1 -> usage error naming it" 2 err "response-ttl" -- "$BIN" serve --response-ttl -1
expect "--response-quota x -> usage error naming it" 2 err "response-quota" -- "$BIN" serve --response-quota x
expect "serve --help lists --response-ttl and --response-quota" 0 out "--response-quota N" -- "$BIN" serve --help
expect "store verify --help names --secret-file" 0 out "--secret-file FILE" -- "$BIN" store verify --help
if [ -n "$TINY" ] && [ -f "$TINY/tiny-llama.gguf" ]; then
    # -ngl 0 -fa on: the CPU with flash attention; the primitives run and the header says so
    expect "bench primitives -ngl 0 -fa on runs on the CPU with flash attention" 0 out "device CPU, 0/" -- \
        "$BIN" bench primitives -m "$TINY/tiny-llama.gguf" --blocks 16 --repeats 1 -ngl 0 -fa on
    grep -qF "flash attn on" "$TMP/out" && ok "bench primitives header says flash attn on" \
        || bad "bench primitives -fa on: header lacks 'flash attn on': $(head -1 "$TMP/out")"
fi
expect "--help" 0 out "Usage:" -- "$BIN" chat --help

t_finish
