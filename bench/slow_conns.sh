#!/usr/bin/env bash
# bench/slow_conns.sh — issue #38's connection target: 10,000 slow connections from 400 loopback
# addresses held for 60 s while /health from 127.0.0.1 answers every poll within 100 ms, the
# server's RSS grows < 200 MB and a generation in flight keeps its tok/s within 5 % of the same
# generation alone (bench/slow_conns.py; loopback only, bounded in time).  Then the same load
# against --thread-per-connection (the server before #38) for the contrast.
#   bench/slow_conns.sh [CONNS] [ADDRS] [SECONDS]    (defaults 10000 400 60)
# Environment: OUT=results/slow-<time> BIN=./build/kvtier MODEL=$KVTIER_CHAT_MODEL
set -u
cd "$(dirname "$0")/.." || exit 2
eval "$(scripts/bootstrap.sh env)"
CONNS=${1:-10000} ADDRS=${2:-400} SECS=${3:-60}
OUT=${OUT:-results/slow-$(date -u +%Y%m%d-%H%M%S)}
BIN=${BIN:-./build/kvtier}
MODEL=${MODEL:-$KVTIER_CHAT_MODEL}
mkdir -p "$OUT"
PID=
trap '[ -n "$PID" ] && kill -KILL $PID 2>/dev/null' EXIT
run() { # NAME SERVER-FLAGS...
    local name=$1
    shift
    "$BIN" serve -m "$MODEL" --port 0 --threads 1 --parallel 1 -c 2048 --budget 512 --no-store "$@" >/dev/null 2>"$OUT/$name.err" &
    PID=$!
    local port=
    for _ in $(seq 1 300); do
        port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$OUT/$name.err" | sed 's/.*://')
        [ -n "$port" ] && break
        sleep 0.2
    done
    echo "=== $name: $BIN serve $* (port $port) ==="
    python3 bench/slow_conns.py --url "http://127.0.0.1:$port" --pid "$PID" --conns "$CONNS" --addrs "$ADDRS" --seconds "$SECS" \
        --json "$OUT/$name.json"
    local rc=$?
    kill -TERM "$PID"
    wait "$PID"
    PID=
    return $rc
}
echo "kvtier $("$BIN" --version | head -1); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-); $(nproc) cores; $(date -u +%FT%TZ)"
run event-driven
rc=$?
run thread-per-connection --thread-per-connection
echo "results: $OUT"
exit $rc
