#!/usr/bin/env bash
# llama_server_suite_wrap.sh — what llama.cpp's server tests start as "llama-server"
# (LLAMA_SERVER_BIN_PATH) under bench/llama_server_suite.sh.  The suite's command line is passed
# on as it is, with two changes the same for both servers:
#   - the model: --hf-repo/--hf-file/--model-url (downloads; there is no network here) become
#     -m $SUITE_MODEL (SmolLM2-135M-Instruct: both servers run the same GGUF);
#   - for kvtier, "serve" is inserted after the binary ($SUITE_BIN).  Nothing else: flags kvtier
#     cannot honour are refused or logged by kvtier itself.
# Environment: SUITE_BIN (llama-server or kvtier), SUITE_SERVE (1 for kvtier), SUITE_MODEL.
set -euo pipefail
: "${SUITE_BIN:?}" "${SUITE_MODEL:?}"
args=()
model=0
while [ $# -gt 0 ]; do
  case "$1" in
    --hf-repo|-hfr|--hf-file|-hff|--model-url|-mu)
      shift 2 || shift
      [ $model = 1 ] || { args+=(-m "$SUITE_MODEL"); model=1; } ;;
    *) args+=("$1"); shift ;;
  esac
done
# a command line without a model (the suite's router preset) gets kvtier's default, $KVTIER_MODEL
if [ "${SUITE_SERVE:-0}" = 1 ]; then KVTIER_MODEL=$SUITE_MODEL exec "$SUITE_BIN" serve "${args[@]}"; fi
exec "$SUITE_BIN" "${args[@]}"
