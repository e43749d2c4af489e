#!/usr/bin/env bash
# run.sh — bench/codec_estimate: dump.c's K/V for both reference models, then estimate.py
# (numpy, in a private venv under $TMPDIR).  Needs `make build` first.  Prints one table a model.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$(dirname "$HERE")")
eval "$("$SRC/scripts/bootstrap.sh" env)"
W=${TMPDIR:-/tmp}/kvtier-codec-estimate
mkdir -p "$W"
gcc -O1 -std=c11 -D_POSIX_C_SOURCE=200809L -I "$SRC/include" -I "$SRC/src" "$HERE/dump.c" "$SRC/build/libkvtier.a" \
    -L"$LLAMA_PREFIX/lib" -Wl,-rpath,"$LLAMA_PREFIX/lib" -lllama -lggml -lggml-base -lsqlite3 -lcrypto -ljansson -lhiredis \
    -lxxhash -lzstd -lpthread -lm -lstdc++ -o "$W/dump"
[ -x "$W/venv/bin/python" ] || { python3 -m venv "$W/venv" && "$W/venv/bin/pip" install -q numpy==2.4.6; }
cat $(ls "$SRC"/../shared/data/pg_essays/*.txt | grep -v LICENSE | head -n 8) >"$W/text.txt" # the first 1,024 tokens are used
export LD_LIBRARY_PATH=$LLAMA_PREFIX/lib
for m in smollm2:$KVTIER_CHAT_MODEL:64:192 gemma3:$KVTIER_MODEL:256:256; do
    IFS=: read -r name path hd e <<<"$m"
    mkdir -p "$W/$name"
    "$W/dump" "$path" "$W/text.txt" "$W/$name" 2>/dev/null | grep -E '^part'
    echo "== $name ($(basename "$path")): head_dim $hd"
    "$W/venv/bin/python" "$HERE/estimate.py" "$W/$name" "$hd" "$e" 2>/dev/null
done
