#!/usr/bin/env bash
# gpu_device.sh — the GPU figures of docs/BENCHMARKS.md ("GPU backends") in one run on a CUDA
# machine that has nvcc, cmake, ninja, Python 3 with numpy and nvidia-smi, but no network and none
# of kvtier's caches (a machine lent for a short while). kvtier itself is built on the CPU machine
# against the same llama.cpp source; its libllama is swapped for a CUDA one built on the device.
#
#   bench/gpu_device.sh pack            (on the CPU machine) fill CARRY: the pinned llama.cpp source
#                                       (llama-src.tar.xz) and its gguf-py alone (gguf-py.tar.xz),
#                                       build/kvtier with the libraries it needs beyond libc
#                                       (kvtier-bin.tar.xz), SmolLM2's tokenizer (bench/gpu_model.py
#                                       vocab: vocab.json.gz), essays/, the Python client's wheels (whl/)
#   bench/gpu_device.sh prebuild        (on the CPU machine, after pack; 27 min on 2 cores) llama.cpp with
#                                       ggml-cuda for CUDA_ARCHS and llama-server, built here with the
#                                       pinned CUDA 13.0 wheels (scripts/bootstrap.sh cuda-toolchain),
#                                       x86-64-v3 CPU code, into CARRY/llama-cuda-bin.tar.xz: the device
#                                       then spends no time building (its build took 5 of 15 minutes).
#                                       With it, carry every CARRY file but llama-src.tar.xz (64 MiB)
#   bench/gpu_device.sh build           the prebuilt libraries if CARRY has them and they find the
#                                       device (llama-server --list-devices), else llama.cpp with
#                                       ggml-cuda for CUDA_ARCHS (default 90: H100, H200) and
#                                       llama-server built there; the shared libraries installed where
#                                       CARRY/kvtier looks for them (its RPATH)
#   bench/gpu_device.sh model           two random-weight models (bench/gpu_model.py): Llama 3.2 1B's
#                                       shapes (1.07B, F16) and SmolLM2-135M's; SmolLM2's tokenizer
#   bench/gpu_device.sh bench           kvtier bench primitives on both (host and seq_add
#                                       re-anchoring, flash attention on and off) and long sessions
#                                       against llama-server (bench/run_long_sessions.sh, peak VRAM),
#                                       interleaved so that a short lease still gets kvtier at the first
#                                       budget beside llama-server: primitives with host re-anchoring,
#                                       kvtier --budget 1024, llama-server (full, KV 1024), seq_add,
#                                       kvtier --budget 2048, flash attention off
#   bench/gpu_device.sh all             build, model, bench; each step skipped once its results exist
#
# Environment: CARRY (default .devcarry, relative to the repository root), OUT (results; default
# /tmp/gpu-out), WORK (build and models; default /tmp/kvtier-gpu), CUDA_ARCHS, DEADLINE (a Unix time:
# steps that would not finish by then are skipped with a line saying so), PYTHON (pack: a Python 3
# with numpy and PyYAML, for gguf-py), PREBUILD_DIR (prebuild's build tree; default build-cuda-llama).
# The models' weights are random: these runs measure time and memory, never answers (recall columns
# are noise).
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
BIN=$WORK/bin KV=$WORK/bin/kvtier # kvtier and the libraries it needs, unpacked from CARRY/kvtier-bin.tar.xz
# the CUDA libllama and ggml: kvtier finds libllama by its RPATH, but libllama's own RUNPATH (the tree
# it was built in) may not exist here, so its ggml libraries are found through this path
export LD_LIBRARY_PATH=$WORK/llama/b/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
unpack() { [ -x "$KV" ] || { mkdir -p "$BIN" && tar -C "$BIN" -xJf "$CARRY/kvtier-bin.tar.xz"; }; }
for d in /usr/local/cuda/bin; do [ -d "$d" ] && export PATH=$d:$PATH; done
# cudart and cuBLAS: the CUDA install's first, the image's PyPI wheels' (PyTorch's) as a fallback
for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib /usr/local/cuda/lib64; do [ -d "$d" ] && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; done

pack() {
    local llama_src vocab lib
    eval "$("$SRC/scripts/bootstrap.sh" env)"
    llama_src=$(cd "$LLAMA_PREFIX/../../src" && pwd) || return 1 # <cache>/llama.cpp-<ver>/{src,<cpu key>/prefix}
    say "pack: llama.cpp source $llama_src"
    tar -C "$llama_src" -cJf "$CARRY/llama-src.tar.xz" --exclude=ggml/src/ggml-sycl --exclude=ggml/src/ggml-hexagon \
        --exclude=ggml/src/ggml-opencl --exclude=ggml/src/ggml-metal --exclude=ggml/src/ggml-et \
        --exclude=ggml/src/ggml-vulkan CMakeLists.txt cmake common ggml include src tools vendor gguf-py licenses LICENSE
    # gguf-py alone as well: a device run that carries prebuilt libraries (prebuild) leaves the
    # source behind (a run carries 64 MiB in all)
    tar -C "$llama_src" -cJf "$CARRY/gguf-py.tar.xz" gguf-py
    rm -rf "$CARRY/bin" && mkdir -p "$CARRY/bin/libs"
    cp "$SRC/build/kvtier" "$CARRY/bin/kvtier"
    ldd "$SRC/build/kvtier" | awk '/=> \// {print $3}' | while read -r lib; do
        case "$(basename "$lib")" in
            libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*|libgomp*|libllama*|libggml*) ;;
            *) cp -L "$lib" "$CARRY/bin/libs/" ;;
        esac
    done
    tar -C "$CARRY/bin" -cJf "$CARRY/kvtier-bin.tar.xz" . && rm -rf "$CARRY/bin"
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

prebuild() {
    local b=${PREBUILD_DIR:-$SRC/build-cuda-llama} ch commit gen=()
    command -v ninja >/dev/null && gen=(-G Ninja) # else CMake's default, make
    eval "$("$SRC/scripts/bootstrap.sh" env)"
    KVTIER_BACKEND=cuda "$SRC/scripts/bootstrap.sh" cuda-toolchain || return 1
    ch=$("$SRC/scripts/bootstrap.sh" cuda-home)
    commit=$(sed -n 's/^LLAMA_COMMIT=\([0-9a-f]*\).*/\1/p' "$SRC/scripts/bootstrap.sh")
    say "prebuild: llama.cpp $(cd "$LLAMA_PREFIX/../../src" && pwd) with ggml-cuda (archs $CUDA_ARCHS) into $b"
    # GGML_CUDA_NO_VMM as scripts/bootstrap.sh's CUDA build: no link against the driver's libcuda.so,
    # which only a machine with the driver has; x86-64-v3 for the CPU code, which any device host runs
    cmake -S "$LLAMA_PREFIX/../../src" -B "$b" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DGGML_CUDA=ON "-DCMAKE_CUDA_COMPILER=$ch/bin/nvcc" "-DCUDAToolkit_ROOT=$ch" \
        "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS" -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMIT="$commit" -DLLAMA_BUILD_NUMBER=0 \
        >"$b.configure.txt" 2>&1 || { tail -20 "$b.configure.txt"; return 1; }
    cmake --build "$b" --target llama llama-server -j "$(nproc)" >"$b.build.txt" 2>&1 \
        || { tail -30 "$b.build.txt"; return 1; }
    tar -C "$b/bin" -cJf "$CARRY/llama-cuda-bin.tar.xz" --owner=0 --group=0 $(cd "$b/bin" && ls lib*.so* llama-server) || return 1
    du -sh "$CARRY/llama-cuda-bin.tar.xz" "$CARRY" | tee -a "$LOG"
}

build() {
    local rp
    [ -x "$WORK/llama/b/bin/llama-server" ] && [ -f "$WORK/installed" ] && { say "build: done already"; return 0; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
    nvcc --version | tail -2 | tee -a "$LOG"
    mkdir -p "$WORK/llama"
    [ -f "$WORK/llama/CMakeLists.txt" ] || [ ! -f "$CARRY/llama-src.tar.xz" ] || tar -C "$WORK/llama" -xJf "$CARRY/llama-src.tar.xz"
    unpack || return 1
    if [ -f "$CARRY/llama-cuda-bin.tar.xz" ] && [ ! -x "$WORK/llama/b/bin/llama-server" ]; then
        mkdir -p "$WORK/llama/b/bin" && tar -C "$WORK/llama/b/bin" -xJf "$CARRY/llama-cuda-bin.tar.xz"
        if "$WORK/llama/b/bin/llama-server" --list-devices 2>&1 | tee -a "$LOG" | grep -q CUDA0; then
            say "build: prebuilt llama.cpp (CARRY/llama-cuda-bin.tar.xz) finds the device"
        else
            say "build: the prebuilt llama.cpp does not find the device; building here"
            rm -rf "$WORK/llama/b"
        fi
    fi
    if [ ! -x "$WORK/llama/b/bin/llama-server" ]; then
        [ -f "$WORK/llama/CMakeLists.txt" ] || { say "build: no prebuilt libraries that work and no source (CARRY/llama-src.tar.xz)"; return 1; }
        say "build: configure (CUDA archs $CUDA_ARCHS, $(nproc) cores)"
        cmake -S "$WORK/llama" -B "$WORK/llama/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
            "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS" -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF >"$OUT/configure.txt" 2>&1 \
            || { tail -20 "$OUT/configure.txt"; return 1; }
        say "build: llama, ggml-cuda, llama-server"
        cmake --build "$WORK/llama/b" --target llama llama-server -j "$(nproc)" >"$WORK/build.log" 2>&1 \
            || { tail -30 "$WORK/build.log" | tee -a "$LOG"; return 1; }
    fi
    rp=$(readelf -d "$KV" | sed -n 's/.*R[UN]*PATH.*\[\([^]:]*\).*/\1/p')
    [ -n "$rp" ] || { say "build: $KV has no RPATH"; return 1; }
    mkdir -p "$rp" && cp -a "$WORK/llama/b/bin/"lib*.so* "$rp/" && cp -a "$BIN/libs/"* "$rp/"
    touch "$WORK/installed"
    say "build: done; libraries in $rp"
}

model() {
    local gp=$WORK/llama/gguf-py
    [ -d "$gp" ] || tar -C "$WORK/llama" -xJf "$CARRY/gguf-py.tar.xz" || return 1
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
    timeout $(($(left) < 185 ? $(left) - 5 : 180)) "$KV" bench primitives -m "$m" -ngl 99 --blocks 64,256,1024 --repeats 5 "$@" \
        >"$OUT/prim-$name.txt" 2>>"$LOG" || say "primitives $name: exit $?"
    cat "$OUT/prim-$name.txt" >&2
}

long_part() { # name seconds-it-needs env...: one part of bench/run_long_sessions.sh, appended to $WORK/long
    local name=$1 need=$2
    shift 2
    [ -f "$WORK/long/.done-$name" ] && return 0
    [ "$(left)" -gt "$need" ] || { say "long sessions $name: skipped (deadline: $(left) s left, needs ~$need)"; return 0; }
    say "long sessions $name: $*"
    mkdir -p "$WORK/long"
    env "$@" NO_BOOTSTRAP=1 MODEL="$WORK/llama-1b.gguf" KVTIER="$KV" LLAMA_SERVER="$WORK/llama/b/bin/llama-server" PY=python3 \
        ESSAYS="$CARRY/essays" KVTIER_BACKEND=cuda NGL=99 THREADS=8 \
        timeout $(($(left) - 10)) "$HERE/run_long_sessions.sh" "$WORK/long" >>"$LOG" 2>&1 \
        && touch "$WORK/long/.done-$name" || say "long sessions $name: exit $?"
    cat "$WORK/long/header.txt" "$WORK/long/table.md" >"$OUT/long-table.md" 2>/dev/null
    cat "$WORK/long/long_sessions.jsonl" >"$OUT/long-sessions.jsonl" 2>/dev/null
    cat "$OUT/long-table.md" >&2
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
    unpack || return 1
    "$KV" --version 2>&1 | tee -a "$LOG"
    # 1B random weights, 4 sessions x 24 turns x (200 words + 32 tokens); kvtier's first budget
    # and llama-server first, so that a short lease still compares them (one kvtier row took 167 s
    # on an H100)
    prim 1b-host "$WORK/llama-1b.gguf"
    prim smol-host "$WORK/smollm2-shape.gguf"
    long_part kvtier1024 200 BUDGETS=1024 SKIP_LLAMA=1
    long_part llama 90 BUDGETS=1024 SKIP_KVTIER=1
    prim 1b-seqadd "$WORK/llama-1b.gguf" --reanchor seq_add
    long_part kvtier2048 200 BUDGETS=2048 SKIP_LLAMA=1
    prim 1b-fa-off "$WORK/llama-1b.gguf" --flash-attn off
}

case "${1:-all}" in
    pack) pack ;;
    prebuild) prebuild ;;
    build) build ;;
    model) model ;;
    bench) bench ;;
    all) build && model && bench ;;
    *) echo "usage: bench/gpu_device.sh pack|prebuild|build|model|bench|all" >&2; exit 2 ;;
esac
