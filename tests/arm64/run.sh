#!/usr/bin/env bash
# tests/arm64/run.sh — `make test-arm64`: the ARM64 cross build tested under qemu-aarch64 on this
# x86-64 machine (docs/PLATFORMS.md, "ARM64").
#   tests/arm64/run.sh BUILD_ARM64 BUILD_X86          (make test-arm64 builds both first)
# Environment: ARM64_CPU (qemu -cpu model of BUILD_ARM64, default max), ARM64_CPU_LOW (one without
# the kept extensions, default cortex-a53), BUILD_ARM64_LOW (default build-arm64-low), JOBS.
#   1. the probe's line on ARM64_CPU and on ARM64_CPU_LOW (what is kept, what is compiled out);
#   2. in BUILD_ARM64 under qemu -cpu ARM64_CPU, JOBS tests at a time: every unit test (the primitives' exactness on
#      the tiny models and on both reference models among them, the store's and the codecs'),
#      the store and codec command-line tests, and the live demo (cli_demo_live);
#   3. the probe's fallback: BUILD_ARM64's programs on ARM64_CPU_LOW die on an instruction that
#      CPU lacks (the control: the fallback is needed); the build the probe makes for that CPU
#      (its own llama.cpp prefix, BUILD_ARM64_LOW) runs the primitives' exactness there (on the
#      tiny models: that CPU model is the slow one);
#   4. blocks cross architectures: tests/arm64/cross_store.sh, x86-64 <-> ARM64, files and Redis.
set -u
cd "$(dirname "$0")/../.."
ARM=${1:-build-arm64}
X86=${2:-build}
ARM64_CPU=${ARM64_CPU:-max}
ARM64_CPU_LOW=${ARM64_CPU_LOW:-cortex-a53}
LOW=${BUILD_ARM64_LOW:-build-arm64-low}
JOBS=${JOBS:-$(nproc)}
BOOT=scripts/bootstrap.sh
export OMP_WAIT_POLICY=PASSIVE
ulimit -c 0 2>/dev/null || true   # the control below traps on purpose: no core file
fails=()
T0=$SECONDS
step() { printf '\n=== %s (%d s so far) ===\n' "$*" $((SECONDS - T0)); }
eval "$($BOOT env 2>/dev/null)"   # KVTIER_MODEL, KVTIER_CHAT_MODEL (the same files on both sides)
export KVTIER_MODEL KVTIER_CHAT_MODEL

step "1. the probe on qemu -cpu $ARM64_CPU and -cpu $ARM64_CPU_LOW"
KVTIER_ARCH=arm64 KVTIER_ARM64_CPU=$ARM64_CPU $BOOT cpu | head -1
low_line=$(KVTIER_ARCH=arm64 KVTIER_ARM64_CPU=$ARM64_CPU_LOW $BOOT cpu | head -1)
echo "$low_line"
grep -q 'compiled out: none' <<<"$low_line" && fails+=("probe: nothing compiled out on $ARM64_CPU_LOW")

step "2. $ARM under qemu -cpu $ARM64_CPU: unit tests, store and codec tests, the live demo"
TESTS=${ARM64_TESTS:-^(gen_tiny_models|test_.*|cli_store|cli_codec_ram|cli_demo_live)$}
(cd "$ARM" && ctest --output-on-failure -j "$JOBS" -R "$TESTS") || fails+=("ctest in $ARM")

step "3. the probe's fallback on qemu -cpu $ARM64_CPU_LOW"
# the control: the build for ARM64_CPU on a CPU without its extensions traps
out=$(cd "$ARM" && printf 'Hi\n' | qemu-aarch64-static -cpu "$ARM64_CPU_LOW" ./kvtier chat -m "$KVTIER_CHAT_MODEL" \
      --max-tokens 2 --no-store -t 1 2>&1)
rc=$?
if [ "$rc" -ne 0 ] && grep -q 'Illegal instruction' <<<"$out"; then
    echo "ok   control: $ARM's kvtier on -cpu $ARM64_CPU_LOW dies with SIGILL (exit $rc)"
else
    fails+=("control: $ARM's kvtier ran on -cpu $ARM64_CPU_LOW (exit $rc)"); tail -3 <<<"$out"
fi
if KVTIER_ARCH=arm64 KVTIER_ARM64_CPU=$ARM64_CPU_LOW $BOOT llama &&
    eval "$(KVTIER_ARCH=arm64 KVTIER_ARM64_CPU=$ARM64_CPU_LOW $BOOT env 2>/dev/null)" &&
    cmake -S . -B "$LOW" -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
        "-DCMAKE_CROSSCOMPILING_EMULATOR=qemu-aarch64-static;-cpu;$ARM64_CPU_LOW" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DLLAMA_PREFIX="$LLAMA_PREFIX" -DKVTIER_MODEL= -DKVTIER_CHAT_MODEL= >/dev/null &&
    cmake --build "$LOW" -j "$JOBS" --target kvtier mkmodel test_primitives >/dev/null; then
    "$LOW/tests/emu/kvtier" --version | sed -n 2p
    (cd "$LOW" && ctest --output-on-failure -R '^(gen_tiny_models|test_primitives)$') \
        || fails+=("test_primitives in $LOW on -cpu $ARM64_CPU_LOW")
else
    fails+=("the fallback build ($LOW)")
fi
eval "$($BOOT env 2>/dev/null)"

step "4. blocks cross architectures (files and Redis, both ways)"
bash tests/arm64/cross_store.sh "$X86/kvtier" "$ARM/tests/emu/kvtier" || fails+=("cross_store")

step "done in $((SECONDS - T0)) s"
if [ ${#fails[@]} -gt 0 ]; then
    printf 'FAILED: %s\n' "${fails[@]}"
    exit 1
fi
echo "make test-arm64: all passed"
