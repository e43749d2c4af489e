#!/usr/bin/env bash
# run_serve_bench.sh — bench/serve_bench.py against `kvtier serve` and against llama-server built
# from the same vendored llama.cpp (scripts/bootstrap.sh llama-server), same model, same threads.
#
#   bench/run_serve_bench.sh [OUT_DIR]      (default: bench/results)
#
# Environment: SESSIONS (8), TURNS (10), WORDS (90), MAX_TOKENS (32), THREADS (2), KVTIER (the
# kvtier binary, default build/kvtier), EXTRA (more `kvtier serve` flags).
# Servers run one at a time (never two model processes at once); results are JSON lines in
# OUT_DIR/serve_bench.jsonl, one per server configuration.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
OUT=${1:-$HERE/results}
mkdir -p "$OUT"
eval "$("$SRC/scripts/bootstrap.sh" env)"
PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient
LLAMA_SERVER=$("$SRC/scripts/bootstrap.sh" llama-server-path)
SESSIONS=${SESSIONS:-8} TURNS=${TURNS:-10} WORDS=${WORDS:-90} MAX_TOKENS=${MAX_TOKENS:-32} THREADS=${THREADS:-2}
KVTIER=${KVTIER:-$SRC/build/kvtier}  # KVTIER=path: another build (before/after runs)
# idle OpenMP threads sleep instead of spinning: on a shared, loaded machine spinning threads of a
# nice'd server starve each other (llama-server measured 1.3 tok/s without this, 46 with it)
export OMP_WAIT_POLICY=PASSIVE
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; true' EXIT

. "$HERE/lib.sh" # free_port, wait_up
run() { # label cmd...
  local label=$1 port
  shift
  port=$(free_port)
  "$@" --port "$port" >"$OUT/$label.log" 2>&1 &
  PID=$!
  wait_up "$port" || { echo "$label did not start; see $OUT/$label.log" >&2; kill "$PID" 2>/dev/null; PID=; return 1; }
  "$PY" "$HERE/serve_bench.py" --url "http://127.0.0.1:$port" --pid "$PID" --sessions "$SESSIONS" --turns "$TURNS" \
    --words "$WORDS" --max-tokens "$MAX_TOKENS" --label "$label" | tee -a "$OUT/serve_bench.jsonl"
  kill -TERM "$PID"
  wait "$PID" || true
  PID=
}

CTX_SLOT=2048
# EXTRA: more `kvtier serve` flags (e.g. "--batch-tokens 0" for the schedule before mixed prefill)
run kvtier-budget512 "$KVTIER" serve -m "$KVTIER_MODEL" -c 8192 --budget 512 --parallel "$SESSIONS" \
  --max-sessions "$SESSIONS" --threads "$THREADS" ${EXTRA:-}
if [ -x "$LLAMA_SERVER" ]; then
  # --no-jinja: with jinja (the default) "--chat-template gemma" is taken as a template text and the
  # messages never reach the prompt (3-token prompts); the GGUF has no template of its own
  run llama-server "$LLAMA_SERVER" -m "$KVTIER_MODEL" -c $((CTX_SLOT * SESSIONS)) -np "$SESSIONS" -t "$THREADS" \
    --no-jinja --chat-template gemma --host 127.0.0.1
else
  echo "llama-server not built (scripts/bootstrap.sh llama-server); skipped" >&2
fi
run kvtier-budget2048 "$KVTIER" serve -m "$KVTIER_MODEL" -c $((CTX_SLOT * (SESSIONS + 1))) --budget $CTX_SLOT \
  --parallel "$SESSIONS" --max-sessions "$SESSIONS" --threads "$THREADS" ${EXTRA:-}
