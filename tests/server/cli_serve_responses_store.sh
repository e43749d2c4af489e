#!/usr/bin/env bash
# cli_serve_responses_store — stored responses (the Responses API's previous_response_id, GET,
# DELETE) outlive the server: they are rows of the block store's SQLite index (server/respdb.c),
# read back after a restart, expired by --response-ttl and --response-quota, MACed (a row changed
# on disk is never served; `kvtier store verify` counts it), shared by two servers on one store
# whole or not at all.  The checks: tests/server/serve_responses_store_test.py's header.
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL.
set -u
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
MODEL=${KVTIER_CHAT_MODEL:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    echo "SKIP: KVTIER_CHAT_MODEL ('$MODEL') is not a file"
    exit 77 # reported as skipped (SKIP_RETURN_CODE), never as passed
fi
TMP=$(mktemp -d)
trap 'pkill -KILL -f -- "--api-key-file $TMP/keys" 2>/dev/null; rm -rf "$TMP"' EXIT
python3 "$(dirname "$0")/serve_responses_store_test.py" "$BIN" "$MODEL" "$TMP"
