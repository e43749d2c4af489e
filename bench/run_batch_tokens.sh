#!/usr/bin/env bash
# run_batch_tokens.sh — `kvtier serve --batch-tokens N` for N in $VALUES (default "0 64 128 256 512";
# 0 = prefill chunks decoded alone, the schedule before mixed prefill), each against
# bench/serve_bench.py (SESSIONS x TURNS chat sessions, defaults 8 x 4), one server at a time,
# in an interleaved order repeated ROUNDS times (default 1) so that a change in machine load
# hits every value alike.  JSON lines (label bt-N) in OUT_DIR/batch_tokens.jsonl.
#
#   bench/run_batch_tokens.sh [OUT_DIR]      (default: bench/results)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
OUT=${1:-$HERE/results}
mkdir -p "$OUT"
eval "$("$SRC/scripts/bootstrap.sh" env)"
PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient
SESSIONS=${SESSIONS:-8} TURNS=${TURNS:-4} WORDS=${WORDS:-90} MAX_TOKENS=${MAX_TOKENS:-32} THREADS=${THREADS:-2}
VALUES=${VALUES:-"0 64 128 256 512"} ROUNDS=${ROUNDS:-1} MODEL=${MODEL:-$KVTIER_MODEL}
KVTIER=${KVTIER:-$SRC/build/kvtier}
export OMP_WAIT_POLICY=PASSIVE
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; true' EXIT
for r in $(seq 1 "$ROUNDS"); do
  for bt in $VALUES; do
    "$KVTIER" serve -m "$MODEL" --port 0 -c 8192 --budget 512 --parallel "$SESSIONS" --max-sessions "$SESSIONS" \
      --threads "$THREADS" --batch-tokens "$bt" 2>"$OUT/bt-$bt.log" &
    PID=$!
    port=
    for _ in $(seq 1 300); do
      port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$OUT/bt-$bt.log" | sed 's/.*://') || true
      [ -n "$port" ] && break
      sleep 0.2
    done
    [ -n "$port" ] || { echo "server --batch-tokens $bt did not start; see $OUT/bt-$bt.log" >&2; exit 1; }
    "$PY" "$HERE/serve_bench.py" --url "http://127.0.0.1:$port" --pid "$PID" --sessions "$SESSIONS" --turns "$TURNS" \
      --words "$WORDS" --max-tokens "$MAX_TOKENS" --label "bt-$bt" | tee -a "$OUT/batch_tokens.jsonl"
    curl -s "http://127.0.0.1:$port/metrics" | grep -E '^kvtier_(steps|step_tokens|mixed_steps|mixed_prefill_tokens)_total' \
      | tr '\n' ' ' | sed "s/^/bt-$bt metrics: /; s/\$/\n/" | tee -a "$OUT/batch_tokens.metrics"
    kill -TERM "$PID"
    wait "$PID" || true
    PID=
  done
done
