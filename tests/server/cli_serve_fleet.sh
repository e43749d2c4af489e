#!/usr/bin/env bash
# cli_serve_fleet — two `kvtier serve` with stores of their own, one redis-server and HAProxy in
# front (bench/fleet.py): a 20-turn Responses conversation alternating between the servers, both
# restarted mid-way, one killed with SIGKILL, against the same conversation on one server.  The
# checks: tests/server/serve_fleet_test.py's header.  Skips (77), and says so, only where
# redis-server or haproxy is not installed (scripts/bootstrap.sh installs both).
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL.
set -u
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
MODEL=${KVTIER_CHAT_MODEL:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    echo "SKIP: KVTIER_CHAT_MODEL ('$MODEL') is not a file"
    exit 77 # reported as skipped (SKIP_RETURN_CODE), never as passed
fi
for tool in redis-server haproxy; do
    if ! command -v "$tool" >/dev/null; then
        echo "SKIP: $tool is not installed (Debian: apt-get install $tool; scripts/bootstrap.sh deps does it)"
        exit 77
    fi
done
TMP=$(mktemp -d)
trap 'pkill -KILL -f -- "$TMP/" 2>/dev/null; rm -rf "$TMP"' EXIT
python3 "$(dirname "$0")/serve_fleet_test.py" "$BIN" "$MODEL" "$TMP"
