#!/usr/bin/env bash
# bench/fleet.sh — several `kvtier serve` (stores of their own), one redis-server, HAProxy in front
# (bench/fleet.py has the details).  With the bootstrap's environment:
#   bench/fleet.sh serve [--servers N] [--balance roundrobin|hdr:NAME]   run a fleet until Ctrl-C
#   bench/fleet.sh bench [--turns 20] [--llama-server PATH] [--json F]   the figures of BENCHMARKS.md
# Needs redis-server and haproxy (scripts/bootstrap.sh deps installs both).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/.."
set -a
eval "$(scripts/bootstrap.sh env)"
set +a
for tool in redis-server haproxy; do
    command -v "$tool" >/dev/null || { echo "bench/fleet.sh: $tool is not installed (scripts/bootstrap.sh deps)" >&2; exit 1; }
done
[ -x build/kvtier ] || make build >/dev/null
exec python3 bench/fleet.py "$@"
