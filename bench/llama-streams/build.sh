#!/bin/sh
# build one experiment: ./build.sh e1_ctx
P=/root/.cache/kvtier/llama.cpp-0.3.36/prefix
exec gcc -O1 -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wno-unused-function -I"$P/include" -o "$1" "$1.c" -L"$P/lib" -Wl,--disable-new-dtags,-rpath,"$P/lib" -lllama -lggml -lggml-base -lm
