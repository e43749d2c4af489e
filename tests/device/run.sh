#!/usr/bin/env bash
# tests/device/run.sh PROGRAM [ARGS...] — run a test with the model's layers and KV cells on the
# device backend llama.cpp was built with (KVTIER_BACKEND=vulkan|cuda; ctest label "device").
#
# ggml-vulkan skips CPU-type Vulkan devices (Mesa's lavapipe, how this runs without a GPU) unless
# GGML_VK_VISIBLE_DEVICES names them: it is set to 0 here unless the caller chose.  The engine
# offloads every layer by default (kvt_engine_params.n_gpu_layers -1), so the test runs on the
# device when one is visible; KVT_EXPECT_DEVICE=1 tells the tests that check it to fail if not.
# Where no device is visible the test is skipped (exit 77) with the reason, never run on the CPU
# under a device test's name.
set -u
: "${KVTIER_BIN:?KVTIER_BIN is not set (ctest sets it)}"
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES-0}
version=$("$KVTIER_BIN" --version 2>&1) || { printf '%s\n' "$version"; echo "device test: kvtier --version failed"; exit 1; }
devices=$(sed -n 's/^devices: //p' <<<"$version")
backend=$(grep -o 'backend [a-z]*' <<<"$version" | head -1)
if ! grep -Eq '(^|; )(Vulkan|CUDA)[0-9]+ ' <<<"$devices"; then
  echo "SKIP: no GPU device visible to llama.cpp ($backend; devices: ${devices:-none};" \
       "GGML_VK_VISIBLE_DEVICES=$GGML_VK_VISIBLE_DEVICES). Vulkan without a GPU needs Mesa's lavapipe:" \
       "apt-get install mesa-vulkan-drivers (scripts/bootstrap.sh deps with KVTIER_BACKEND=vulkan)"
  exit 77
fi
echo "device test on: $devices ($backend)"
export KVT_EXPECT_DEVICE=1
exec "$@"
