#!/usr/bin/env bash
# cli_serve_faults — `kvtier serve` keeps serving through faults of its tiers, under
# bench/soak.py's load (issue #24), each counted in /metrics:
#   1. a full disk: the store on an 8 MiB tmpfs (its quota says 8 GiB): writes fail, dropped and
#      counted (kvtier_store_writes_dropped_total{tier="disk"}), no 5xx (skipped where tmpfs
#      cannot be mounted: not root);
#   2. Redis killed (SIGKILL) under load: errors counted, no 5xx;
#   3. Redis frozen (SIGSTOP) under load: reads time out at --redis-timeout-ms (counted in
#      kvtier_store_timeouts_total), no 5xx, /health within 1 s; SIGCONT afterwards.
# Skips (77) without the chat model.  Environment: KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
t_need_chat_model
t_init cli-serve-faults
PID= RPID= MNT=
trap '[ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null; [ -n "$RPID" ] && kill -CONT "$RPID" 2>/dev/null && kill -KILL "$RPID" 2>/dev/null; [ -n "$MNT" ] && umount "$MNT" 2>/dev/null; rm -rf "$TMP"' EXIT
PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient || { bad "bootstrap.sh pyclient"; echo "$pass passed, $fail failed"; exit 1; }
KEY=faults-key-1
echo "$KEY" >"$TMP/keys"

start() { # NAME ARGS...: PID, PORT
    local name=$1
    shift
    PORT=
    "$BIN" serve -m "$MODEL" --port 0 --threads 1 --api-key-file "$TMP/keys" -c 4096 --budget 512 --parallel 2 --queue 128 "$@" \
        >/dev/null 2>"$TMP/$name.err" &
    PID=$!
    PORT=$(t_listening "$TMP/$name.err" "$PID")
    [ -n "$PORT" ] && ok "$name server listening on port $PORT" || bad "$name server did not start: $(tail -3 "$TMP/$name.err")"
}
load() { # NAME SECONDS: bench/soak.py against the server; its PASS/FAIL counted
    "$PY" "$SRC/bench/soak.py" --url "http://127.0.0.1:$PORT" --key "$KEY" --pid "$PID" --seconds "$2" --sessions 8 \
        --hostile 0 --rss-slack-mb 512 --out "$TMP/$1" >"$TMP/$1.out" 2>&1
}
metric() { # NAME: its value in /metrics
    curl -s -H "Authorization: Bearer $KEY" "http://127.0.0.1:$PORT/metrics" | grep -F "$1 " | awk '{print $2}'
}
verdict() { # NAME WHAT
    if grep -q '^soak: PASS' "$TMP/$1.out"; then ok "$2: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["requests"], "requests,", d["responses_5xx"], "5xx, /health max", round(d["health_max_ms"]), "ms")' "$TMP/$1/summary.json")"
    else bad "$2: $(tail -25 "$TMP/$1.out")"; fi
}

# 1. a full disk
MNT="$TMP/small"
mkdir -p "$MNT"
if mount -t tmpfs -o size=8m tmpfs "$MNT" 2>/dev/null; then
    start fulldisk --store "$MNT/store" --store-ram-mb 4
    load fulldisk 20
    verdict fulldisk "full disk (8 MiB tmpfs) under load: served"
    d=$(metric 'kvtier_store_writes_dropped_total{tier="disk"}')
    [ "${d%.*}" -gt 0 ] 2>/dev/null && ok "full disk: $d block writes dropped and counted" || bad "full disk: writes dropped '$d'"
    kill -TERM "$PID"; wait "$PID"; src=$?; PID=
    [ $src -eq 0 ] && ok "full disk: clean exit" || bad "full disk: exit $src"
    umount "$MNT"; MNT=
else
    echo "SKIP (check 1): cannot mount a tmpfs here (not root)"
    MNT=
fi

# 2, 3. Redis killed, Redis frozen
if command -v redis-server >/dev/null; then
    for fault in KILL STOP; do
        RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        ( exec redis-server --port "$RPORT" --bind 127.0.0.1 --dir "$TMP" --save "" --appendonly no --logfile "redis-$fault.log" ) &
        RPID=$!
        for _ in $(seq 1 100); do [ "$(redis-cli -p "$RPORT" ping 2>/dev/null)" = PONG ] && break; sleep 0.05; done
        start "redis$fault" --store "$TMP/store-$fault" --store-ram-mb 4 --redis "redis://127.0.0.1:$RPORT/0"
        load "redis$fault" 20 &
        L=$!
        sleep 6
        kill -"$fault" "$RPID"
        wait "$L"
        verdict "redis$fault" "Redis SIG$fault under load: served"
        e=$(metric 'kvtier_store_errors_total{tier="redis"}') t=$(metric 'kvtier_store_timeouts_total{tier="redis"}')
        [ $((${e%.*} + ${t%.*})) -gt 0 ] 2>/dev/null && ok "Redis SIG$fault: $e errors, $t timeouts counted" ||
            bad "Redis SIG$fault: errors '$e', timeouts '$t'"
        kill -TERM "$PID"; wait "$PID"; src=$?; PID=
        [ $src -eq 0 ] && ok "Redis SIG$fault: clean exit" || bad "Redis SIG$fault: exit $src"
        kill -CONT "$RPID" 2>/dev/null; kill -KILL "$RPID" 2>/dev/null; wait "$RPID" 2>/dev/null; RPID=
    done
else
    echo "SKIP (checks 2, 3): redis-server is not installed"
fi
if grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:' "$TMP"/*.err; then
    bad "sanitizer report on a server's stderr"; grep -A20 -E 'Sanitizer|runtime error' "$TMP"/*.err | head -60
else
    ok "no sanitizer report"
fi
t_finish
