#!/usr/bin/env bash
# gpu_device.sh — the GPU figures of docs/BENCHMARKS.md ("GPU backends") in one run on a CUDA
# machine that has nvcc, cmake, ninja, Python 3 with numpy and nvidia-smi, but no network and none
# of kvtier's caches (a machine lent for a short while). kvtier itself is built on the CPU machine
# against the same llama.cpp source; its libllama is swapped for a CUDA one built on the device.
#
#   bench/gpu_device.sh pack            (on the CPU machine) fill CARRY: the pinned llama.cpp source
#                                       as a tarball, build/kvtier and the libraries it needs beyond
#                                       libc, SmolLM2's tokenizer (bench/gpu_model.py vocab), essays
#   bench/gpu_device.sh build           llama.cpp with ggml-cuda for CUDA_ARCHS (default 90: H100,
#                                       H200) and llama-server, shared libraries installed where
#                                       CARRY/kvtier looks for them (its RPATH)
#   bench/gpu_device.sh model           two random-weight models (bench/gpu_model.py): Llama 3.2 1B's
#                                       shapes (1.07B, F16) and SmolLM2-135M's; SmolLM2's tokenizer
#   bench/gpu_device.sh bench           kvtier bench primitives on both (host and seq_add
#                                       re-anchoring, flash attention on and off), then long sessions
#                                       against llama-server (bench/run_long_sessions.sh, peak VRAM)
#   bench/gpu_device.sh all             build, model, bench; each step skipped once its results exist
#
# Environment: CARRY (default .devcarry, relative to the repository root), OUT (results; default
# /tmp/gpu-out), WORK (build and models; default /tmp/kvtier-gpu), CUDA_ARCHS, DEADLINE (a Unix time:
# steps that would not finish by then are skipped with a line saying so). The models' weights are
# random: these runs measure time and memory, never answers (recall columns are noise).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
CARRY=$(cd "$SRC" && mkdir -p "${CARRY:-.devcarry}" && cd "${CARRY:-.devcarry}" && pwd)
OUT=${OUT:-/tmp/gpu-out} WORK=${WORK:-/tmp/kvtier-gpu} CUDA_ARCHS=${CUDA_ARCHS:-90}
DEADLINE=${DEADLINE:-$(($(date +%s) + 86400))}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/log.txt
say() { printf '[gpu %s +%ss] %s\n' "$(date -u +%H:%M:%S)" "$SECONDS" "$*" | tee -a "$LOG" >&2; }
left() { echo $((DEADLINE - $(date +%s))); }
KV=$CARRY/kvtier
for d in /usr/local/cuda/bin; do [ -d "$d" ] && export PATH=$d:$PATH; done
for d in /usr/local/cuda/lib64; do [ -d "$d" ] && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; done

pack() {
    local llama_src vocab lib
    eval "$("$SRC/scripts/bootstrap.sh" env)"
    llama_src=$(cd "$LLAMA_PREFIX/../../src" && pwd) || return 1 # <cache>/llama.cpp-<ver>/{src,<cpu key>/prefix}
    say "pack: llama.cpp source $llama_src"
    tar -C "$llama_src" -cJf "$CARRY/llama-src.tar.xz" --exclude=ggml/src/ggml-sycl --exclude=ggml/src/ggml-hexagon \
        --exclude=ggml/src/ggml-opencl --exclude=ggml/src/ggml-metal --exclude=ggml/src/ggml-et \
        --exclude=ggml/src/ggml-vulkan CMakeLists.txt cmake common ggml include src tools vendor gguf-py licenses LICENSE
    cp "$SRC/build/kvtier" "$KV"
    rm -rf "$CARRY/libs" && mkdir -p "$CARRY/libs"
    ldd "$SRC/build/kvtier" | awk '/=> \// {print $3}' | while read -r lib; do
        case "$(basename "$lib")" in
            libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*|libgomp*|libllama*|libggml*) ;;
            *) cp -L "$lib" "$CARRY/libs/" ;;
        esac
    done
    rm -rf "$CARRY/essays" && cp -r "$SRC/../shared/data/pg_essays" "$CARRY/essays"
    # the suite's Python client (openai and what it needs, the same versions) as CPython 3.12 wheels
    rm -rf "$CARRY/whl"
    "$("$SRC/scripts/bootstrap.sh" pyclient-path)" -m pip freeze | grep -v -i '^anthropic' >"$CARRY/requirements.txt"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$CARRY/whl" -r "$CARRY/requirements.txt" || return 1
    vocab=$CARRY/vocab.json.gz
    [ -f "$vocab" ] || PYTHONPATH=$llama_src/gguf-py "${PYTHON:-python3}" "$HERE/gpu_model.py" vocab "$KVTIER_CHAT_MODEL" "$vocab"
    du -sh "$CARRY" | tee -a "$LOG"
}

build() {
    local rp
    [ -x "$WORK/llama/b/bin/llama-server" ] && [ -f "$WORK/installed" ] && { say "build: done already"; return 0; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
    nvcc --version | tail -2 | tee -a "$LOG"
    mkdir -p "$WORK/llama"
    [ -f "$WORK/llama/CMakeLists.txt" ] || tar -C "$WORK/llama" -xJf "$CARRY/llama-src.tar.xz"
    say "build: configure (CUDA archs $CUDA_ARCHS, $(nproc) cores)"
    cmake -S "$WORK/llama" -B "$WORK/llama/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS" -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF >"$OUT/configure.txt" 2>&1 \
        || { tail -20 "$OUT/configure.txt"; return 1; }
    say "build: llama, ggml-cuda, llama-server"
    cmake --build "$WORK/llama/b" --target llama llama-server -j "$(nproc)" >"$WORK/build.log" 2>&1 \
        || { tail -30 "$WORK/build.log" | tee -a "$LOG"; return 1; }
    rp=$(readelf -d "$KV" | sed -n 's/.*R[UN]*PATH.*\[\([^]:]*\).*/\1/p')
    [ -n "$rp" ] || { say "build: $KV has no RPATH"; return 1; }
    mkdir -p "$rp" && cp -a "$WORK/llama/b/bin/"lib*.so* "$rp/" && cp -a "$CARRY/libs/"* "$rp/"
    touch "$WORK/installed"
    say "build: done; libraries in $rp"
}

model() {
    local gp=$WORK/llama/gguf-py
    [ -f "$WORK/llama-1b.gguf" ] || PYTHONPATH=$gp python3 "$HERE/gpu_model.py" model "$CARRY/vocab.json.gz" \
        "$WORK/llama-1b.gguf" 2>&1 | tee -a "$LOG"
    [ -f "$WORK/smollm2-shape.gguf" ] || PYTHONPATH=$gp python3 "$HERE/gpu_model.py" model "$CARRY/vocab.json.gz" \
        "$WORK/smollm2-shape.gguf" --embd 576 --layers 30 --heads 9 --heads-kv 3 --ff 1536 2>&1 | tee -a "$LOG"
}

prim() { # name model args...
    local name=$1 m=$2
    shift 2
    [ -s "$OUT/prim-$name.txt" ] && return 0
    [ "$(left)" -gt 60 ] || { say "primitives $name: skipped (deadline)"; return 0; }
    say "primitives $name: $*"
    timeout 180 "$KV" bench primitives -m "$m" -ngl 99 --blocks 64,256,1024 --repeats 5 "$@" \
        >"$OUT/prim-$name.txt" 2>>"$LOG" || say "primitives $name: exit $?"
    cat "$OUT/prim-$name.txt" >&2
}

bench() {
    command -v curl >/dev/null || { # bench/lib.sh's wait_up asks /health with curl
        mkdir -p "$WORK/shim" && printf '#!/bin/sh\nfor u; do :; done\nexec python3 -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$u" 2>/dev/null\n' \
            >"$WORK/shim/curl" && chmod +x "$WORK/shim/curl" && export PATH=$WORK/shim:$PATH
    }
    python3 -c 'import openai' 2>/dev/null || { # bench/long_sessions.py's client, carried as wheels
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
            "$CARRY/whl/"*.whl >>"$LOG" 2>&1 && export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
    }
    "$KV" --version 2>&1 | tee -a "$LOG"
    prim 1b-host "$WORK/llama-1b.gguf"
    prim 1b-seqadd "$WORK/llama-1b.gguf" --reanchor seq_add
    prim 1b-fa-off "$WORK/llama-1b.gguf" --flash-attn off
    prim smol-host "$WORK/smollm2-shape.gguf"
    if [ -s "$OUT/long-table.md" ]; then return 0; fi
    [ "$(left)" -gt 150 ] || { say "long sessions: skipped (deadline)"; return 0; }
    say "long sessions: kvtier (budgets 1024, 2048) and llama-server (full, KV 1024), 1B, -ngl 99"
    rm -rf "$WORK/long"
    NO_BOOTSTRAP=1 MODEL=$WORK/llama-1b.gguf KVTIER=$KV LLAMA_SERVER=$WORK/llama/b/bin/llama-server PY=python3 \
        ESSAYS=$CARRY/essays KVTIER_BACKEND=cuda NGL=99 THREADS=8 \
        timeout $(($(left) - 10)) "$HERE/run_long_sessions.sh" "$WORK/long" >>"$LOG" 2>&1 || say "long sessions: exit $?"
    cat "$WORK/long/header.txt" "$WORK/long/table.md" >"$OUT/long-table.md" 2>/dev/null
    cat "$WORK/long/long_sessions.jsonl" >"$OUT/long-sessions.jsonl" 2>/dev/null
    cat "$OUT/long-table.md" >&2
}

case "${1:-all}" in
    pack) pack ;;
    build) build ;;
    model) model ;;
    bench) bench ;;
    all) build && model && bench ;;
    *) echo "usage: bench/gpu_device.sh pack|build|model|bench|all" >&2; exit 2 ;;
esac
