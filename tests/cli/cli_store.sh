#!/usr/bin/env bash
# cli_store — `kvtier store stats|ls|verify|gc|clear` on a store that tests/unit/store_fill.c fills
# (12 blocks whose bytes are a function of their keys): tables and --json, verify finding a
# flipped byte and --repair removing it, gc removing a dead writer's temporary file, clear, the
# default directory ($XDG_CACHE_HOME/kvtier/store), and bad input (exit 2, the value named).
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVT_STORE_FILL.
set -u
. "$(dirname "$0")/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
FILL=${KVT_STORE_FILL:?KVT_STORE_FILL is not set}
t_init cli-store
ulimit -c 0 2>/dev/null || true

# run NAME WANT_EXIT COMMAND...: stdout in $TMP/out, stderr in $TMP/err; checks the exit status
# and that nothing crashed; returns 0 when both hold
run() {
    local name=$1 want=$2
    shift 2
    "$@" >"$TMP/out" 2>"$TMP/err" </dev/null
    local rc=$?
    if grep -qE 'AddressSanitizer|LeakSanitizer|runtime error:|Segmentation fault' "$TMP/err"; then
        bad "$name: sanitizer report or crash"; cat "$TMP/err"; return 1
    fi
    if [ "$rc" -ne "$want" ]; then
        bad "$name: exit status $rc, expected $want"; cat "$TMP/err"; return 1
    fi
    return 0
}
# check NAME PYTHON-EXPR: evaluate against the JSON object in $TMP/out (as d)
check() {
    if python3 -c 'import json,sys; d=json.loads(open(sys.argv[2]).read()); sys.exit(0 if eval(sys.argv[1]) else 1)' \
        "$2" "$TMP/out" 2>"$TMP/pyerr"; then ok "$1"; else bad "$1: $2 is false for $(cat "$TMP/out")"; fi
}
has() { # NAME STREAM FRAGMENT
    if grep -qF -- "$3" "$TMP/$2"; then ok "$1"; else bad "$1: std$2 lacks \"$3\""; sed 's/^/     /' "$TMP/$2"; fi
}

S=$TMP/store
K0=$("$FILL" "$S" 12) || { bad "store_fill"; t_finish; exit 1; }
BLOB0=$(ls "$S"/blobs/"$K0"*.kvb)

# usage
run "store --help" 0 "$BIN" store --help && has "store --help lists verify" out "verify"
run "store without a command" 2 "$BIN" store && has "store usage on stderr" err "Usage: kvtier store"
run "unknown subcommand" 2 "$BIN" store frob && has "unknown subcommand named" err "unknown command 'frob'"
run "unknown flag" 2 "$BIN" store stats --bogus && has "unknown flag named" err "--bogus"
run "--repair outside verify" 2 "$BIN" store gc --repair --store "$S" && has "gc --repair refused" err "--repair"
for c in stats ls verify gc clear; do
    run "store $c --help" 0 "$BIN" store $c --help && has "store $c --help names --store" out "--store DIR"
done

# stats, ls
run "stats" 0 "$BIN" store stats --store "$S" && has "stats: 12 entries" out "entries   12 "
run "stats --json" 0 "$BIN" store stats --store "$S" --json &&
    check "stats --json: 12 entries, bytes" "d['entries'] == 12 and d['bytes'] > 12 * 500 and d['store'] == '$S'"
[ "$(wc -l <"$TMP/out")" -eq 1 ] && ok "stats --json is one line" || bad "stats --json is not one line"
run "ls" 0 "$BIN" store ls --store "$S" && has "ls: header" out "KEY" && has "ls: block 0" out "${K0:0:16}"
[ "$(wc -l <"$TMP/out")" -eq 13 ] && ok "ls: 12 rows" || bad "ls: $(wc -l <"$TMP/out") lines, expected 13"
grep -qE "^${K0:0:16}  [0-9a-f]{8} +[0-9]+  raw " "$TMP/out" && ok "ls: the codec by name (raw)" ||
    bad "ls: block 0's codec not named raw: $(grep "${K0:0:16}" "$TMP/out")"
run "ls --json" 0 "$BIN" store ls --store "$S" --json &&
    check "ls --json: 12 entries with block 0" "len(d['entries']) == 12 and '$K0' in [e['key'] for e in d['entries']]" &&
    check "ls --json: codec 0 named raw" "all(e['codec'] == 0 and e['codec_name'] == 'raw' for e in d['entries'])"

# verify: clean, then a flipped payload byte (exit 1), --repair, clean again
run "verify clean" 0 "$BIN" store verify --store "$S" && has "verify: 12 ok" out "12 ok"
[ -f "$BLOB0" ] && ok "block 0's file is where the format says" || bad "no file $BLOB0"
printf 'Z' | dd of="$BLOB0" bs=1 seek=300 conv=notrunc status=none
run "verify finds the flipped byte" 1 "$BIN" store verify --store "$S" --json &&
    check "verify --json: 1 corrupt, 11 ok, nothing removed" "d['corrupt'] == 1 and d['ok'] == 11 and d['removed'] == 0"
[ -f "$BLOB0" ] && ok "verify without --repair removes nothing" || bad "verify without --repair removed the file"
run "verify --repair" 0 "$BIN" store verify --repair --store "$S" --json &&
    check "verify --repair: the corrupt block removed" "d['corrupt'] == 1 and d['removed'] == 1 and d['repaired']"
[ ! -e "$BLOB0" ] && ok "repair removed the file" || bad "the corrupt file is still there"
run "verify after repair" 0 "$BIN" store verify --store "$S" --json &&
    check "verify after repair: 11 ok, no problems" "d['ok'] == 11 and d['corrupt'] + d['missing'] + d['orphans'] == 0"

# gc: a file without a row, a row whose file is gone, a dead writer's temporary file (removed
# when the store opens, before gc looks)
K1=$(ls "$S/blobs" | grep '\.kvb$' | head -1)
STRAY=$(printf 'a%.0s' $(seq 64)).kvb
cp "$S/blobs/$K1" "$S/blobs/$STRAY"
rm -f "$S/blobs/$K1"
printf 'half' >"$S/blobs/.tmp-999999999-0123456789abcdef-XyZ123"
run "verify sees both ways" 1 "$BIN" store verify --store "$S" --json &&
    check "verify: 1 orphan, 1 missing" "d['orphans'] == 2 and d['missing'] == 1 and d['removed'] == 0"
run "gc" 0 "$BIN" store gc --store "$S" --json &&
    check "gc: 1 orphan, 1 missing, 2 removed" "d['orphans'] == 1 and d['missing'] == 1 and d['removed'] == 2 and d['ok'] == 10"
[ ! -e "$S/blobs/$STRAY" ] && [ ! -e "$S/blobs/.tmp-999999999-0123456789abcdef-XyZ123" ] && ok "gc removed the stray files" ||
    bad "stray files left: $(ls -a "$S/blobs")"
run "gc (human)" 0 "$BIN" store gc --store "$S" && has "gc table" out "orphans   0"

# clear
run "clear" 0 "$BIN" store clear --store "$S" && has "clear says what it removed" out "removed 10 blocks"
run "stats after clear" 0 "$BIN" store stats --store "$S" --json && check "empty after clear" "d['entries'] == 0"
[ -z "$(ls "$S/blobs")" ] && ok "clear left no file" || bad "files left after clear: $(ls "$S/blobs")"

# errors at run time: no store there (read-only commands create nothing)
run "stats of a missing store" 1 "$BIN" store stats --store "$TMP/nope" && has "missing store named" err "$TMP/nope"
[ ! -e "$TMP/nope" ] && ok "stats created nothing" || bad "stats created $TMP/nope"
printf 'x' >"$TMP/afile"
run "gc on a file" 1 "$BIN" store gc --store "$TMP/afile" && has "not a directory named" err "$TMP/afile"

# the default directory
"$FILL" "$TMP/xdg/kvtier/store" 3 >/dev/null || bad "store_fill into the default directory"
run "default dir" 0 env XDG_CACHE_HOME="$TMP/xdg" "$BIN" store stats --json &&
    check "default dir is \$XDG_CACHE_HOME/kvtier/store" "d['store'] == '$TMP/xdg/kvtier/store' and d['entries'] == 3"
run "no default dir" 2 env -u HOME -u XDG_CACHE_HOME "$BIN" store stats && has "no default dir: says so" err "--store DIR"

t_finish
