#!/usr/bin/env bash
# run_serve_ab.sh — two kvtier builds (A = $KVTIER_A, B = $KVTIER_B, e.g. main before a change and
# this tree after it) against bench/serve_bench.py, alternating A, B, A, B, ... ROUNDS times
# (default 2), so that a change in machine load hits both alike; same flags as the budget-512 row
# of run_serve_bench.sh.  JSON lines (labels A-N / B-N) in OUT_DIR/serve_ab.jsonl.
#
#   KVTIER_A=/path/kvtier-before KVTIER_B=build/kvtier bench/run_serve_ab.sh [OUT_DIR]
#
# Environment: SESSIONS (8), TURNS (10), WORDS (90), MAX_TOKENS (32), THREADS (2), ROUNDS (2),
# FLAGS_A / FLAGS_B (more flags for one side).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
OUT=${1:-$HERE/results}
mkdir -p "$OUT"
eval "$("$SRC/scripts/bootstrap.sh" env)"
PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient
: "${KVTIER_A:?KVTIER_A (the first kvtier binary) is not set}"
KVTIER_B=${KVTIER_B:-$SRC/build/kvtier}
SESSIONS=${SESSIONS:-8} TURNS=${TURNS:-10} WORDS=${WORDS:-90} MAX_TOKENS=${MAX_TOKENS:-32} THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
export OMP_WAIT_POLICY=PASSIVE
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; true' EXIT
one() { # label binary flags...
  local label=$1 bin=$2 port=
  shift 2
  "$bin" serve -m "$KVTIER_MODEL" --port 0 -c 8192 --budget 512 --parallel "$SESSIONS" --max-sessions "$SESSIONS" \
    --threads "$THREADS" "$@" 2>"$OUT/$label.log" &
  PID=$!
  for _ in $(seq 1 300); do
    port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$OUT/$label.log" | sed 's/.*://') || true
    [ -n "$port" ] && break
    sleep 0.2
  done
  [ -n "$port" ] || { echo "$label did not start; see $OUT/$label.log" >&2; exit 1; }
  "$PY" "$HERE/serve_bench.py" --url "http://127.0.0.1:$port" --pid "$PID" --sessions "$SESSIONS" --turns "$TURNS" \
    --words "$WORDS" --max-tokens "$MAX_TOKENS" --label "$label" | tee -a "$OUT/serve_ab.jsonl"
  # the server's CPU seconds (user + system): less sensitive than wall time to other processes
  # on a shared machine; and its scheduler counters
  awk -v l="$label" -v hz="$(getconf CLK_TCK)" '{ printf "%s cpu_s %.1f\n", l, ($14 + $15) / hz }' "/proc/$PID/stat" \
    | tee -a "$OUT/serve_ab.cpu"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^kvtier_(steps|step_tokens|mixed_steps|mixed_prefill_tokens)_total' \
    | tr '\n' ' ' | sed "s/^/$label metrics: /; s/\$/\n/" | tee -a "$OUT/serve_ab.cpu" || true
  kill -TERM "$PID"
  wait "$PID" || true
  PID=
}
for r in $(seq 1 "$ROUNDS"); do
  # shellcheck disable=SC2086
  one "A-$r" "$KVTIER_A" ${FLAGS_A:-}
  # shellcheck disable=SC2086
  one "B-$r" "$KVTIER_B" ${FLAGS_B:-}
done
