#!/usr/bin/env bash
# bench/soak.sh — `kvtier serve` under bench/soak.py's mixed, partly hostile load for SECONDS
# (default 600), then the timeline plotted (bench/soak.gp) into OUT/soak.png.  Loopback only.
#   bench/soak.sh [SECONDS] [SESSIONS] [HOSTILE]        (defaults 600 64 200)
# Environment: OUT=results/soak-<time> BIN=./build/kvtier MODEL=$KVTIER_CHAT_MODEL, SERVE_ARGS
# (more flags for the server; default -c 8192 --budget 512 --parallel 4 --queue 128
# --max-connections-per-ip 100: the sessions and the health checks come from 127.0.0.1, the
# hostile connections from 127.0.0.2, so each address stays under its cap), SOAK_ARGS
# (more flags for bench/soak.py, e.g. --rss-slack-mb 512 for a run too short for the tiers to fill).
set -u
cd "$(dirname "$0")/.." || exit 2
eval "$(scripts/bootstrap.sh env)"
SECONDS_RUN=${1:-600} SESSIONS=${2:-64} HOSTILE=${3:-200}
OUT=${OUT:-results/soak-$(date -u +%Y%m%d-%H%M%S)}
BIN=${BIN:-./build/kvtier}
MODEL=${MODEL:-$KVTIER_CHAT_MODEL}
PY=$(scripts/bootstrap.sh pyclient-path)
mkdir -p "$OUT"
KEY=soak-key-$RANDOM$RANDOM
echo "$KEY" >"$OUT/keys"
# shellcheck disable=SC2086
"$BIN" serve -m "$MODEL" --port 0 --api-key-file "$OUT/keys" --store "$OUT/store" ${SERVE_ARGS:--c 8192 --budget 512 --parallel 4 --queue 128 --max-connections-per-ip 100} \
    >/dev/null 2>"$OUT/server.err" &
PID=$!
trap 'kill -KILL $PID 2>/dev/null' EXIT
PORT=
for _ in $(seq 1 300); do
    PORT=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$OUT/server.err" | sed 's/.*://')
    [ -n "$PORT" ] && break
    sleep 0.2
done
[ -n "$PORT" ] || { echo "soak: the server did not start"; cat "$OUT/server.err"; exit 1; }
"$PY" bench/soak.py --url "http://127.0.0.1:$PORT" --key "$KEY" --pid "$PID" --seconds "$SECONDS_RUN" \
    --sessions "$SESSIONS" --hostile "$HOSTILE" --out "$OUT" ${SOAK_ARGS:-}
rc=$?
kill -TERM "$PID"
wait "$PID"; src=$?
echo "soak: server exit status $src after SIGTERM"
{ echo "commit $(git rev-parse --short HEAD) | $("$BIN" --version | tail -1) | $(date -u +%FT%TZ)"
  echo "cpu $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores | model $(basename "$MODEL")"
  echo "seconds $SECONDS_RUN sessions $SESSIONS hostile $HOSTILE | server ${SERVE_ARGS:--c 8192 --budget 512 --parallel 4 --queue 128 --max-connections-per-ip 100}"; } >"$OUT/stamp.txt"
cat "$OUT/stamp.txt"
command -v gnuplot >/dev/null && gnuplot -e "in='$OUT/timeline.csv'; out='$OUT/soak.png'; title='kvtier serve soak: $SESSIONS sessions + $HOSTILE hostile connections, $(basename "$MODEL")'" bench/soak.gp &&
    echo "soak: $OUT/soak.png"
[ $rc -eq 0 ] && [ $src -eq 0 ]
