#!/usr/bin/env bash
# run_long_sessions.sh — long sessions with planted facts (bench/long_sessions.py) against kvtier
# at two budgets and llama-server (the same vendored llama.cpp, scripts/bootstrap.sh llama-server)
# at full context and at kvtier's KV memory, one server at a time, in one invocation.
#
#   bench/run_long_sessions.sh [OUT_DIR]      (default: bench/results/long-<date>)
#
# Environment: MODEL (default $KVTIER_CHAT_MODEL, SmolLM2-135M-Instruct), SESSIONS (4), TURNS (24),
# WORDS (200), MAX_TOKENS (32), FACTS (4), THREADS (2), BUDGETS ("1024 2048": kvtier's
# --budget per session), CTX_FULL (8192: llama-server's context per slot, the model's trained
# context for SmolLM2), KVTIER (build/kvtier), EXTRA (more `kvtier serve` flags), SKIP_LLAMA=1,
# CODECS_RAM (default "raw": kvtier's --codec-ram, one kvtier run per codec and budget, e.g. "raw q4"),
# SKIP_KVTIER=1 (only the llama-server rows, appended to an earlier run's OUT_DIR), ESSAYS (the essays'
# folder), NO_BOOTSTRAP=1 (a machine without kvtier's caches: then MODEL, KVTIER, LLAMA_SERVER and
# PY, a Python 3 with the standard library, are given; bench/gpu_device.sh does so).
# GPU: KVTIER_BACKEND=vulkan|cuda (scripts/bootstrap.sh; kvtier from build-<backend>/, llama-server
# built with the same backend) and NGL (default 99 there, 0 on cpu): both servers get -ngl NGL;
# with CUDA each server's peak VRAM (nvidia-smi) is a column of the table.
# Writes OUT_DIR/long_sessions.jsonl (one line per server), OUT_DIR/<label>.csv (per turn),
# OUT_DIR/<label>.metrics (kvtier's /metrics at the end: kvtier_pool_ram_bytes, kvtier_pool_spill_bytes),
# OUT_DIR/table.md and OUT_DIR/long_sessions.png (generated tok/s and TTFT against turn number).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
OUT=${1:-$HERE/results/long-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
if [ -z "${NO_BOOTSTRAP:-}" ]; then
    eval "$("$SRC/scripts/bootstrap.sh" env)"
    PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
    "$SRC/scripts/bootstrap.sh" pyclient >/dev/null
fi
MODEL=${MODEL:-$KVTIER_CHAT_MODEL}
SESSIONS=${SESSIONS:-4} TURNS=${TURNS:-24} WORDS=${WORDS:-200} MAX_TOKENS=${MAX_TOKENS:-32} FACTS=${FACTS:-4}
THREADS=${THREADS:-2} BUDGETS=${BUDGETS:-"1024 2048"} CTX_FULL=${CTX_FULL:-8192} CODECS_RAM=${CODECS_RAM:-raw}
KVTIER_BACKEND=${KVTIER_BACKEND:-cpu}
if [ "$KVTIER_BACKEND" = cpu ]; then KVTIER=${KVTIER:-$SRC/build/kvtier} NGL=${NGL:-0}
else KVTIER=${KVTIER:-$SRC/build-$KVTIER_BACKEND/kvtier} NGL=${NGL:-99}; fi
export OMP_WAIT_POLICY=PASSIVE # idle OpenMP threads sleep (see run_serve_bench.sh)
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; true' EXIT

. "$HERE/lib.sh" # free_port, wait_up
run() { # label cmd...
    local label=$1 port
    shift
    port=$(free_port)
    echo "== $label: $*" >&2
    "$@" --port "$port" >"$OUT/$label.log" 2>&1 &
    PID=$!
    wait_up "$port" || { echo "$label did not start; see $OUT/$label.log" >&2; kill "$PID" 2>/dev/null; PID=; return 1; }
    "$PY" "$HERE/long_sessions.py" --url "http://127.0.0.1:$port" --pid "$PID" --sessions "$SESSIONS" --turns "$TURNS" \
        --words "$WORDS" --max-tokens "$MAX_TOKENS" --facts "$FACTS" --label "$label" --series "$OUT/$label.csv" ${ESSAYS:+--essays "$ESSAYS"} |
        tee -a "$OUT/long_sessions.jsonl" || echo "$label: requests failed (n_errors and errors in its JSON line)" >&2
    # where the evicted history lives at the end (kvtier: host pool bytes in RAM and in spill files)
    "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
        "http://127.0.0.1:$port/metrics" >"$OUT/$label.metrics" 2>/dev/null || rm -f "$OUT/$label.metrics"
    kill -TERM "$PID"
    wait "$PID" || true
    PID=
}

{
    echo "# bench/run_long_sessions.sh | $(basename "$MODEL") | $("$KVTIER" --version 2>/dev/null | tail -1) |"
    echo "# source tree: $(git -C "$SRC" describe --always --dirty 2>/dev/null || echo unknown) |"
    echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores | $(date -u +%Y-%m-%dT%H:%M:%SZ) |"
    echo "# backend $KVTIER_BACKEND, -ngl $NGL | load before: $(cut -d' ' -f1-3 /proc/loadavg) | $SESSIONS sessions x $TURNS turns, $WORDS words + $MAX_TOKENS tokens a turn, $FACTS facts each"
} >"$OUT/header.txt"
cat "$OUT/header.txt" >&2

for b in $BUDGETS; do # the KV of one session's budget per sequence, plus a spare sequence
    [ -n "${SKIP_KVTIER:-}" ] && break
    for c in $CODECS_RAM; do # the host pool's codec: its label says which unless only raw runs
        label="kvtier-budget$b"
        [ "$CODECS_RAM" = raw ] || label="$label-ram-$c"
        run "$label" "$KVTIER" serve -m "$MODEL" -c $((b * (SESSIONS + 1))) --budget "$b" --parallel "$SESSIONS" \
            --max-sessions "$SESSIONS" --threads "$THREADS" --no-store --codec-ram "$c" -ngl "$NGL" ${EXTRA:-}
    done
done
[ -n "${LLAMA_SERVER:-}" ] || LLAMA_SERVER=$("$SRC/scripts/bootstrap.sh" llama-server-path)
if [ -z "${SKIP_LLAMA:-}" ] && [ -x "$LLAMA_SERVER" ]; then
    run llama-server-full "$LLAMA_SERVER" -m "$MODEL" -c $((CTX_FULL * SESSIONS)) -np "$SESSIONS" -t "$THREADS" -ngl "$NGL" --host 127.0.0.1
    b=${BUDGETS%% *} # the KV memory kvtier's first budget holds, context shift on (what fits is what it keeps)
    run "llama-server-kv$b" "$LLAMA_SERVER" -m "$MODEL" -c $((b * SESSIONS)) -np "$SESSIONS" -t "$THREADS" -ngl "$NGL" --context-shift \
        --host 127.0.0.1
elif [ -z "${SKIP_LLAMA:-}" ]; then
    echo "llama-server not built (scripts/bootstrap.sh llama-server); its rows are skipped" >&2
fi

"$PY" "$HERE/long_sessions.py" --table "$OUT/long_sessions.jsonl" | tee "$OUT/table.md"
plots=""
for f in "$OUT"/*.csv; do
    plots="$plots${plots:+, }'$f' skip 1 using 1:2 with linespoints title '$(basename "$f" .csv)' axes x1y1"
done
gnuplot -e "set datafile separator ','; set terminal pngcairo size 1000,520 font ',10' noenhanced;
  set output '$OUT/long_sessions.png'; set title 'generated tok/s per request against turn ($SESSIONS sessions)';
  set xlabel 'turn'; set ylabel 'tok/s of the turn''s requests'; set key top right; set grid;
  plot $plots" 2>/dev/null || echo "gnuplot failed; the series are in $OUT/*.csv" >&2
echo "results: $OUT" >&2
