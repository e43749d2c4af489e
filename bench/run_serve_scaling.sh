#!/usr/bin/env bash
# run_serve_scaling.sh — the same per-session workload (bench/serve_bench.py) at 1, 4, 8, 16 and 32
# concurrent sessions against `kvtier serve` (one KV stream per session, budget 512) and against
# llama-server from the same vendored llama.cpp (-np matching the sessions), one server at a time.
# Per configuration: generated tok/s (wall clock), TTFT p50 of turns >= 2, peak RSS, and the
# server's CPU seconds per generated token (utime + stime of the server process over the run,
# from /proc: the cost of a token, prefill included, independent of how busy the machine is).
#
#   bench/run_serve_scaling.sh [OUT_DIR]     (default bench/results/scaling)
#
# Environment: COUNTS ("1 4 8 16 32"), TURNS (3), WORDS (90), MAX_TOKENS (16), THREADS (2),
# KVTIER (default build/kvtier).  Writes OUT_DIR/scaling.jsonl and OUT_DIR/scaling.png (gnuplot).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
OUT=${1:-$HERE/results/scaling}
mkdir -p "$OUT"
eval "$("$SRC/scripts/bootstrap.sh" env)"
PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient
LLAMA_SERVER=$("$SRC/scripts/bootstrap.sh" llama-server-path)
COUNTS=${COUNTS:-"1 4 8 16 32"} TURNS=${TURNS:-3} WORDS=${WORDS:-90} MAX_TOKENS=${MAX_TOKENS:-16} THREADS=${THREADS:-2}
KVTIER=${KVTIER:-$SRC/build/kvtier}
export OMP_WAIT_POLICY=PASSIVE
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; true' EXIT

. "$HERE/lib.sh" # free_port, wait_up
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$1/stat"; }
run() { # label sessions cmd...
  local label=$1 n=$2 port c0 c1
  shift 2
  port=$(free_port)
  "$@" --port "$port" >"$OUT/$label-$n.log" 2>&1 &
  PID=$!
  wait_up "$port" || { echo "$label did not start; see $OUT/$label-$n.log" >&2; kill "$PID" 2>/dev/null; PID=; return 1; }
  c0=$(cpu_s "$PID")
  "$PY" "$HERE/serve_bench.py" --url "http://127.0.0.1:$port" --pid "$PID" --sessions "$n" --turns "$TURNS" \
    --words "$WORDS" --max-tokens "$MAX_TOKENS" --label "$label" --json "$OUT/.one.json" >/dev/null
  c1=$(cpu_s "$PID")
  python3 - "$OUT/.one.json" "$c0" "$c1" "$(cat /proc/loadavg | cut -d' ' -f1)" <<'EOF' | tee -a "$OUT/scaling.jsonl"
import json, sys
r = json.load(open(sys.argv[1]))
cpu = float(sys.argv[3]) - float(sys.argv[2])
r["server_cpu_s"] = round(cpu, 2)
r["cpu_ms_per_token"] = round(1000 * cpu / max(1, r["generated_tokens"]), 2)
r["loadavg_after"] = float(sys.argv[4])
print(json.dumps(r))
EOF
  kill -TERM "$PID"
  wait "$PID" || true
  PID=
}

for n in $COUNTS; do
  run kvtier "$n" "$KVTIER" serve -m "$KVTIER_MODEL" -c $((512 * (n + 1))) --budget 512 --parallel "$n" \
    --max-sessions "$n" --threads "$THREADS" --no-store
  if [ -x "$LLAMA_SERVER" ]; then
    run llama-server "$n" "$LLAMA_SERVER" -m "$KVTIER_MODEL" -c $((2048 * n)) -np "$n" -t "$THREADS" \
      --no-jinja --chat-template gemma --host 127.0.0.1
  fi
done

python3 - "$OUT/scaling.jsonl" "$OUT/scaling.dat" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
with open(sys.argv[2], "w") as f:
    for lab in ("kvtier", "llama-server"):
        f.write(f"# {lab}\n")
        for r in sorted((r for r in rows if r["label"] == lab), key=lambda r: r["sessions"]):
            f.write(f'{r["sessions"]} {r["gen_tok_per_s"]} {r["cpu_ms_per_token"]}\n')
        f.write("\n\n")
EOF
if command -v gnuplot >/dev/null; then
  gnuplot <<EOF
set terminal pngcairo size 900,380 noenhanced
set output "$OUT/scaling.png"
set multiplot layout 1,2
set logscale x 2
set xlabel "concurrent sessions"
set key top left
set title "generated tokens/s (wall)"
plot "$OUT/scaling.dat" index 0 using 1:2 with linespoints title "kvtier serve", "" index 1 using 1:2 with linespoints title "llama-server"
set title "server CPU ms per generated token"
plot "$OUT/scaling.dat" index 0 using 1:3 with linespoints title "kvtier serve", "" index 1 using 1:3 with linespoints title "llama-server"
unset multiplot
EOF
fi
echo "results: $OUT/scaling.jsonl $OUT/scaling.png"
