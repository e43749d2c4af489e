#!/usr/bin/env bash
# cli_serve_soak — the smoke version of bench/soak.sh (issue #24): 30 s of 12 sessions (chats,
# streams, completions, tool calls, disconnects mid-stream, edited histories) beside 40 hostile
# connections (trickled headers and bodies, bodies without a key, garbage, bad requests): no 5xx,
# every good request answered, /health within 1 s throughout, RSS within its budget, and the
# server drains on SIGTERM.  The 10-minute run and its figures: docs/RELIABILITY.md.
# Skips (77) without the chat model.  Environment: KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
t_need_chat_model
t_init cli-serve-soak
cd "$SRC" || exit 2
OUT="$TMP/soak" BIN="$BIN" MODEL="$MODEL" SOAK_ARGS="--rss-slack-mb 512" bench/soak.sh 30 12 40 >"$TMP/out" 2>&1
rc=$?
tail -30 "$TMP/out"
[ $rc -eq 0 ] && ok "soak smoke: 30 s, 12 sessions, 40 hostile connections: no 5xx, /health < 1 s, RSS in budget, drained" ||
    bad "soak smoke failed (status $rc)"
grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:' "$TMP/soak/server.err" &&
    { bad "sanitizer report"; grep -A20 -E 'Sanitizer|runtime error' "$TMP/soak/server.err" | head -40; } || ok "no sanitizer report"
t_finish
