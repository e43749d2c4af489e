# kvtier — two commands for a fresh machine:
#   make demo   the planted-fact session at budget 512, kv_restore vs discard, on Gemma 3 270M
#               (replayed conversation) then SmolLM2-135M-Instruct (every reply generated live)
#   make test   build (normal + ASan/UBSan) and run the whole test suite
SHELL := /bin/bash
BOOT  := scripts/bootstrap.sh
JOBS  ?= $(shell nproc)
# build trees (the lower-ISA check below uses its own pair, so it never rebuilds these); a GPU
# backend (KVTIER_BACKEND=vulkan|cuda: scripts/bootstrap.sh) gets its own pair, build-<backend>
KVTIER_BACKEND ?= cpu
export KVTIER_BACKEND
ifeq ($(KVTIER_BACKEND),cpu)
BUILD      ?= build
BUILD_ASAN ?= build-asan
else
BUILD      ?= build-$(KVTIER_BACKEND)
BUILD_ASAN ?= build-$(KVTIER_BACKEND)-asan
endif

.PHONY: all build build-asan build-arm64 test test-isa test-arm64 demo serve bench clean setup fuzz format docs
all: build

setup:
	@$(BOOT) all

build: setup
	@eval "$$($(BOOT) env)"; \
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLLAMA_PREFIX="$$LLAMA_PREFIX" -DKVTIER_MODEL="$$KVTIER_MODEL" -DKVTIER_CHAT_MODEL="$$KVTIER_CHAT_MODEL" >/dev/null && \
	cmake --build $(BUILD) -j $(JOBS)

build-asan: setup
	@eval "$$($(BOOT) env)"; \
	cmake -S . -B $(BUILD_ASAN) -DCMAKE_BUILD_TYPE=Debug -DKVT_SANITIZE=ON -DLLAMA_PREFIX="$$LLAMA_PREFIX" -DKVTIER_MODEL="$$KVTIER_MODEL" -DKVTIER_CHAT_MODEL="$$KVTIER_CHAT_MODEL" >/dev/null && \
	cmake --build $(BUILD_ASAN) -j $(JOBS)

# The full suite on the normal build, then again under AddressSanitizer + UBSan (the demo, the
# benchmark smoke test and the single-prompt NIAH checks only once: tests/run_suite.sh); the
# sanitizer half runs even when the normal half fails, and the end lists both halves' failures.
test: build build-asan
	@tests/run_suite.sh $(BUILD) $(BUILD_ASAN)

# The suite on a llama.cpp with ggml restricted to a lower ISA: the bootstrap compiles the
# extensions named in ISA_OFF out (KVTIER_PROBE_FAIL; default avx512: an AVX2 build) into its
# own cached prefix, and the suite runs in build-isa/ and build-isa-asan/.  Tests must not depend
# on the CPU's float summation order: this passes wherever `make test` does.
ISA_OFF ?= avx512
test-isa:
	@KVTIER_PROBE_FAIL=$(ISA_OFF) $(MAKE) --no-print-directory test BUILD=build-isa BUILD_ASAN=build-isa-asan

# ARM64 under emulation on an x86-64 machine (docs/PLATFORMS.md): llama.cpp and kvtier
# cross-built for aarch64 (KVTIER_ARCH=arm64: Debian's cross toolchain, arm64 libraries through
# multiarch, the probe run under qemu-aarch64 -cpu $(ARM64_CPU)) into $(BUILD_ARM64); then
# tests/arm64/run.sh: the unit tests, the primitives' exactness on both models, the store and
# codec tests and the live demo under qemu; the probe's fallback on $(ARM64_CPU_LOW) (a build
# without the extensions, its own tree); a block store written by each architecture read by the
# other (files and Redis). ARM64_CPU: a qemu -cpu model (`qemu-aarch64-static -cpu help`).
ARM64_CPU     ?= max
ARM64_CPU_LOW ?= cortex-a53
BUILD_ARM64   ?= build-arm64
build-arm64:
	@KVTIER_ARCH=arm64 KVTIER_ARM64_CPU=$(ARM64_CPU) $(BOOT) all
	@eval "$$(KVTIER_ARCH=arm64 KVTIER_ARM64_CPU=$(ARM64_CPU) $(BOOT) env)"; \
	cmake -S . -B $(BUILD_ARM64) -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
	  "-DCMAKE_CROSSCOMPILING_EMULATOR=qemu-aarch64-static;-cpu;$(ARM64_CPU)" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DLLAMA_PREFIX="$$LLAMA_PREFIX" -DKVTIER_MODEL="$$KVTIER_MODEL" -DKVTIER_CHAT_MODEL="$$KVTIER_CHAT_MODEL" >/dev/null && \
	cmake --build $(BUILD_ARM64) -j $(JOBS)

test-arm64: build-arm64 build
	@ARM64_CPU=$(ARM64_CPU) ARM64_CPU_LOW=$(ARM64_CPU_LOW) tests/arm64/run.sh $(BUILD_ARM64) $(BUILD)

# Two models, budget 512 each, kv_restore then discard as the contrast:
#   1. Gemma 3 270M (base model): the replayed conversation, only the probe's reply generated;
#   2. SmolLM2-135M-Instruct (chat model): every reply generated live (--live).
demo: build
	@eval "$$($(BOOT) env)"; set -e; \
	for r in kv_restore discard; do \
	  printf '\n=== 1/2 Gemma 3 270M (base model): replayed conversation, probe reply generated | budget 512 | --recovery %s ===\n' $$r; \
	  ./$(BUILD)/kvtier demo -m "$$KVTIER_MODEL" --recovery $$r; \
	done; \
	for r in kv_restore discard; do \
	  printf '\n=== 2/2 SmolLM2-135M-Instruct (chat model): every reply generated live | budget 512 | --recovery %s ===\n' $$r; \
	  ./$(BUILD)/kvtier demo -m "$$KVTIER_CHAT_MODEL" --live --recovery $$r; \
	done

# The OpenAI-compatible server on the same model, on http://127.0.0.1:8080 until Ctrl-C
# (more flags: make serve SERVE_ARGS="--port 9000 --api-key-file keys.txt").
serve: build
	@eval "$$($(BOOT) env)"; ./$(BUILD)/kvtier serve -m "$$KVTIER_MODEL" $(SERVE_ARGS)

bench: build
	@eval "$$($(BOOT) env)"; ./$(BUILD)/kvtier bench primitives -m "$$KVTIER_MODEL"

# Fuzzing (tests/fuzz/README.md): every parser of untrusted bytes (state blobs, codec
# containers and sections, blob files, Redis values, the server's request bodies) under libFuzzer with ASan + UBSan, each for
# FUZZ_SECONDS (make fuzz FUZZ_SECONDS=600 FUZZ_HARNESSES=codec for one), built by clang in
# build-fuzz/; the end prints executions and crashes per harness.  A crash input is left in
# build-fuzz/fuzz-out/<harness>/: fix the bug, copy the input into tests/fuzz/crashes/<harness>/,
# and `make test` replays it (ctest fuzz_replay_<harness>) with the committed corpora from then on.
FUZZ_SECONDS   ?= 60
FUZZ_HARNESSES ?= blob codec codec_tensor blobfile redis_value request api stream
BUILD_FUZZ     ?= build-fuzz
fuzz: setup
	@eval "$$($(BOOT) env)"; set -e; \
	CC=clang CXX=clang++ cmake -S . -B $(BUILD_FUZZ) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_SANITIZE=ON -DKVT_FUZZ=ON \
	  -DKVT_BUILD_TESTS=OFF -DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link -DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link \
	  -DLLAMA_PREFIX="$$LLAMA_PREFIX" >/dev/null && \
	cmake --build $(BUILD_FUZZ) -j $(JOBS) --target $(addprefix fuzz_,$(FUZZ_HARNESSES)) && \
	tests/fuzz/run.sh $(BUILD_FUZZ) $(FUZZ_SECONDS) $(FUZZ_HARNESSES)

# .clang-format over every tracked C/C++ file (clang-format 14, Debian's clang-format package)
# docs/API.md: every request field of every API and what kvtier does with it, printed from the
# tables in server/fields.c (cli_serve_fields checks in the suite that it is current)
docs: build
	./$(BUILD)/kvtier serve --print-api >docs/API.md

format:
	@command -v clang-format >/dev/null || { echo "make format: clang-format is not installed (apt-get install clang-format)" >&2; exit 2; }
	git ls-files '*.c' '*.h' '*.cpp' | xargs clang-format -i

clean:
	rm -rf build build-asan build-arm64 build-arm64-low build-isa build-isa-asan build-fuzz build-vulkan build-vulkan-asan build-cuda build-cuda-asan
