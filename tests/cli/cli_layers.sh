#!/usr/bin/env bash
# cli_layers — src/session's files call only downwards.
#
# The import graph is drawn from the compiled objects, not from the source text: an arrow
# A -> B means A's object has an undefined symbol that B's object defines (nm).  The layers are
# the ones src/session/session_int.h's head comment lists ("N file.c", a file on the next line
# without a number shares the layer above it).  Every arrow must go to a strictly lower layer,
# which also rules out circles.  Every object of src/session must be in the table and every file
# of the table must be an object.  Controls: the graph has arrows at all (the objects were read),
# and the same check fed one made-up arrow upwards (state.c -> prefill.c) fails.
# Environment (from tests/CMakeLists.txt): KVT_BINARY_DIR, KVT_SOURCE_DIR.
set -u
BUILD=${KVT_BINARY_DIR:?KVT_BINARY_DIR is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
OBJ=$BUILD/CMakeFiles/kvtier_obj.dir/src/session
HDR=$SRC/src/session/session_int.h
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvt-cli-layers.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0
ok()  { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; shift; for f in "$@"; do [ -f "$f" ] && sed 's/^/     /' "$f" | head -n 20; done; }
if ! ls "$OBJ"/*.o >/dev/null 2>&1; then echo "skipped: no objects under $OBJ"; exit 77; fi

# the layer table: "file layer"
awk '/^\*\* +[0-9]+ [a-z_]+\.c / { layer = $2; print $3, layer; next }
     /^\*\* +[a-z_]+\.c / && layer != "" { print $2, layer }
     /^\*\/|\*\/$/ && layer != "" { exit }' "$HDR" | sort >"$TMP/layers"
# the objects: "file.c defined-symbol" and "file.c undefined-symbol"
# (the sources decide which objects count: a build tree may hold objects of removed files)
for c in "$SRC"/src/session/*.c; do
    f=$(basename "$c")
    o=$OBJ/$f.o
    [ -f "$o" ] || { echo "missing object $o" >>"$TMP/missing"; continue; }
    nm --defined-only "$o" | awk -v f="$f" '$2 ~ /^[TDBR]$/ { print $3, f }'
    nm --undefined-only "$o" | awk -v f="$f" '{ print "U", $NF, f }'
done >"$TMP/syms"
[ -s "$TMP/missing" ] && bad "src/session files without an object" "$TMP/missing"
(cd "$SRC/src/session" && ls -- *.c) | sort -u >"$TMP/objfiles"
cut -d' ' -f1 "$TMP/layers" | sort -u >"$TMP/tablefiles"
if diff "$TMP/tablefiles" "$TMP/objfiles" >"$TMP/filediff"; then
    ok "session_int.h's layer table names the $(wc -l <"$TMP/objfiles") files of src/session, no more"
else
    bad "the layer table and src/session's files differ (< table, > files)" "$TMP/filediff"
fi
# arrows: "from to symbol"
awk 'NR == FNR { if ($1 != "U") def[$1] = $2; next }
     $1 == "U" && ($2 in def) && def[$2] != $3 { print $3, def[$2], $2 }' "$TMP/syms" "$TMP/syms" | sort -u >"$TMP/arrows"
cut -d' ' -f1,2 "$TMP/arrows" | sort -u >"$TMP/edges"

# check EDGES: every arrow to a strictly lower layer; prints the ones that are not
check() {
    awk 'NR == FNR { layer[$1] = $2; next }
         !(($1 in layer) && ($2 in layer)) { print "unknown layer:", $0; next }
         layer[$2] + 0 >= layer[$1] + 0 { print $1 " (layer " layer[$1] ") -> " $2 " (layer " layer[$2] ")" }' "$TMP/layers" "$1"
}
n_edges=$(wc -l <"$TMP/edges")
[ "$n_edges" -ge 20 ] && ok "the objects give $n_edges arrows between src/session's files" ||
    bad "only $n_edges arrows read from the objects (nm?)" "$TMP/edges"
check "$TMP/edges" >"$TMP/up"
if [ ! -s "$TMP/up" ]; then
    ok "every arrow goes to a lower layer: no circle, nothing calls upwards"
else
    awk 'NR == FNR { up[$1 " " $5] = 1; next } (($1 " " $2) in up)' "$TMP/up" "$TMP/arrows" >>"$TMP/up"
    bad "arrows up or sideways (with the symbols that make them)" "$TMP/up"
fi
# control: one made-up arrow upwards is caught
{ cat "$TMP/edges"; echo "state.c prefill.c"; } >"$TMP/edges_bad"
check "$TMP/edges_bad" >"$TMP/up_bad"
grep -q '^state.c (layer 0) -> prefill.c' "$TMP/up_bad" && ok "control: an arrow state.c -> prefill.c is reported" ||
    bad "control: the made-up arrow state.c -> prefill.c was not reported" "$TMP/up_bad"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
