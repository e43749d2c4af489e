#!/usr/bin/env bash
# cli_serve_kill — the smoke version of bench/kill9.sh (issue #24): `kvtier serve` killed with
# SIGKILL under load twice; each time `kvtier store verify` finds no corrupt or missing block (an orphan, the
# crash remnant gc removes, is counted, not failed) and a conversation stored
# before the kills comes back from the store with the log-probabilities it had from the store
# before the kills (same run, decoded the same way: equal on any CPU).  The 20-round run:
# docs/RELIABILITY.md.  Skips (77) without the chat model.
# Environment: KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
t_need_chat_model
t_init cli-serve-kill
cd "$SRC" || exit 2
OUT="$TMP/k9" BIN="$BIN" MODEL="$MODEL" bench/kill9.sh 2 >"$TMP/out" 2>&1
rc=$?
cat "$TMP/out"
[ $rc -eq 0 ] && ok "kill -9 under load, 2 rounds: store verified, stored conversation served from it unchanged" ||
    bad "kill -9 rounds failed (status $rc)"
grep -lE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:' "$TMP"/k9/after*.err "$TMP"/k9/reference.err \
    "$TMP"/k9/nostore.err 2>/dev/null | grep -q . &&
    bad "sanitizer report on a server that was not killed" || ok "no sanitizer report"
t_finish
