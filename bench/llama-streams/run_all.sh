#!/bin/sh
# Build and run every experiment; outputs go to eN_*.out (llama.cpp's progress dots filtered).
set -e
cd "$(dirname "$0")"
M=/work/main/build/tests/models/tiny-gemma3.gguf
G=/root/.cache/kvtier/models/gemma-3-270m-q4_k_m.gguf
export GGML_NO_BACKTRACE=1
for e in e1_ctx e2_state e3_ops e4_swa e5_attn e7_misc e6_cost; do
    ./build.sh $e
    model=$M; [ $e = e6_cost ] && model=$G
    ./$e $model 2>&1 | sed 's/\.\.\.\.*$//' | grep -v '^$' > $e.out
done
