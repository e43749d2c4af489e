#!/usr/bin/env bash
# cli_ruler_grid — bench/ruler_grid.py, the unattended RULER grid, is resumable: on the tiny model
# (its answers do not matter), a grid of 2 tasks x 2 cases x 2 shapes, two units at once (--jobs 2),
# is killed (SIGKILL, the runner and its kvtier processes) once its first unit is done; started
# again with the same directory it runs only what is missing (the done units' files are not
# rewritten, the killed units run again, no scratch directory is left), and ends with every unit.  Control: a fresh directory runs everything.  bench/ruler_tables.py
# then prints every cell with 2 cases per task and the follow-up curve.  The archive (--archive):
# every unit is there without its context text; a fresh directory with the same archive has
# nothing to run and the tables read from the archive are those read from the grid's directory;
# controls: without the archive, with --rerun, or with one archived unit removed, it runs again.
set -u
. "$(dirname "$0")/lib.sh"
t_need_essays
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
TINY=${KVT_TINY_DIR:?KVT_TINY_DIR is not set}/tiny-llama.gguf
t_init cli-ruler-grid
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
GRID=(python3 "$SRC/bench/ruler_grid.py" --bin "$BIN" --models "tiny=$TINY" --lengths 2048 --shapes prompt,followup
      --tasks niah_single_1,niah_single_2 --cases 2 --policies no_eviction,kvtier --threads 1 --jobs 2 --max-tokens 4
      --archive "$TMP/arch")
OUT=$TMP/grid

setsid "${GRID[@]}" --out "$OUT" >"$TMP/first.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
    [ -n "$(ls "$OUT/units" 2>/dev/null)" ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
done
kill -9 -- -$pid 2>/dev/null
wait $pid 2>/dev/null
done1=$(ls "$OUT/units" | grep -c '\.json$')
[ "$done1" -ge 1 ] && [ "$done1" -lt 8 ] && ok "killed after $done1 of 8 units" || bad "killed with $done1 units done ($(tail -3 "$TMP/first.log"))"
(cd "$OUT/units" && stat -c '%n %y %s' -- *.json) >"$TMP/before.txt"
if "${GRID[@]}" --out "$OUT" >"$TMP/second.log" 2>&1; then ok "the second run ended with status 0"; else bad "second run: status $? ($(tail -3 "$TMP/second.log"))"; fi
head -1 "$TMP/second.log" | sed 's/^/     /'
grep -q "8 units, $done1 done, $((8 - done1)) to run" "$TMP/second.log" && ok "it resumed: $((8 - done1)) units to run" \
    || bad "the second run did not resume where the first stopped: $(head -1 "$TMP/second.log")"
n=$(ls "$OUT/units" | grep -c '\.json$')
[ "$n" = 8 ] && ok "all 8 units done" || bad "$n units done"
unchanged=1
while read -r line; do
    grep -qxF -- "$line" <(cd "$OUT/units" && stat -c '%n %y %s' -- *.json) || unchanged=0
done <"$TMP/before.txt"
[ $unchanged = 1 ] && ok "the units done before the kill were not run again" || bad "a unit done before the kill was rewritten"
ls -d "$OUT"/running* >/dev/null 2>&1 && bad "a scratch directory is left behind: $(ls -d "$OUT"/running*)" || ok "no scratch directory left"

# the runs above: --jobs 2 (two units at once, each in its own scratch directory); --jobs 1 gives the
# same 8 units with the same rows (answers and log-probabilities), and progress lines for all 8
if "${GRID[@]}" --out "$TMP/jobs" --no-archive --jobs 1 >"$TMP/jobs.log" 2>&1; then ok "--jobs 1 ended with status 0"; else bad "--jobs 1: status $? ($(tail -3 "$TMP/jobs.log"))"; fi
python3 - "$OUT/units" "$TMP/jobs/units" <<'PY' && ok "--jobs 2 and --jobs 1: the same 8 units, the same rows" || bad "--jobs 2 and --jobs 1 units differ"
import json, os, sys
keys = ("policy", "case", "item", "passed", "refs_hit", "answer_logprob", "reply")
a, b = sorted(os.listdir(sys.argv[1])), sorted(os.listdir(sys.argv[2]))
assert len(a) == 8 and a == b, (a, b)
for f in a:
    ra, rb = ([{k: r.get(k) for k in keys} for r in json.load(open(os.path.join(d, f)))["rows"]] for d in sys.argv[1:3])
    assert ra == rb, f
PY
ls -d "$TMP/jobs"/running* >/dev/null 2>&1 && bad "--jobs 1 left a scratch directory" || ok "--jobs 1: no scratch directory left"
grep -c "^\[[0-9]/8\] " "$TMP/jobs.log" | grep -qx 8 && ok "--jobs 1: 8 progress lines" || bad "--jobs 1 progress: $(cat "$TMP/jobs.log")"
# SIGTERM to the runner alone (not its process group) while two units run: it stops them (no kvtier
# left running, none writing into a scratch directory a later run reuses), says so, exits 130
"${GRID[@]}" --out "$TMP/int" --no-archive >"$TMP/int.log" 2>&1 &
gpid=$!
for _ in $(seq 1 300); do
    pgrep -f -- "--out $TMP/int/running" >/dev/null && break
    sleep 0.1
done
kill -TERM $gpid
wait $gpid
rc=$?
sleep 0.5
left=$(pgrep -f -- "--out $TMP/int/running" | wc -l)
[ $rc = 130 ] && [ "$left" = 0 ] && grep -q "interrupted; the units in flight were stopped" "$TMP/int.log" \
    && ok "SIGTERM to the runner: the units in flight stopped, status 130" \
    || bad "SIGTERM: status $rc, $left kvtier left, $(tail -2 "$TMP/int.log")"
"${GRID[@]}" --out "$TMP/fresh" --no-archive --dry-run >"$TMP/dry.log" 2>&1
grep -q "8 units, 0 done, 8 to run" "$TMP/dry.log" && ok "control: a fresh directory has everything to run" || bad "control: $(cat "$TMP/dry.log")"

# the archive: the units without their text, enough to resume from and to make the tables
n=$(ls "$TMP/arch" | grep -v '\.llama\.json$' | grep -c '\.json$')
[ "$n" = 8 ] && ok "8 units archived" || bad "$n units archived: $(ls "$TMP/arch")"
python3 - "$OUT/units" "$TMP/arch" <<'PY' && ok "archived units are the grid's without the context text" || bad "archived units differ"
import json, os, sys
for f in sorted(os.listdir(sys.argv[1])):
    a, b = json.load(open(os.path.join(sys.argv[1], f))), json.load(open(os.path.join(sys.argv[2], f)))
    assert all("messages" in c for c in a["cases_detail"]) and not any("messages" in c for c in b["cases_detail"]), f
    assert a["rows"] == b["rows"] and a["commit"] == b["commit"], f
    assert [{k: v for k, v in c.items() if k != "messages"} for c in a["cases_detail"]] == b["cases_detail"], f
PY
"${GRID[@]}" --out "$TMP/fresh" --dry-run >"$TMP/dry2.log" 2>&1
grep -q "8 units, 8 done, 0 to run" "$TMP/dry2.log" && ok "a fresh directory with the archive has nothing to run" \
    || bad "fresh directory with the archive: $(cat "$TMP/dry2.log")"
"${GRID[@]}" --out "$TMP/fresh" --rerun --dry-run >"$TMP/dry3.log" 2>&1
grep -q "8 units, 0 done, 8 to run" "$TMP/dry3.log" && ok "control: --rerun runs the archived units again" || bad "--rerun: $(cat "$TMP/dry3.log")"
mkdir -p "$TMP/arch2" && cp "$TMP/arch"/*.json "$TMP/arch2"/ && rm "$TMP/arch2/tiny-2048-prompt-niah_single_2-002.json"
"${GRID[@]}" --out "$TMP/fresh" --archive "$TMP/arch2" --dry-run >"$TMP/dry4.log" 2>&1
grep -q "8 units, 7 done, 1 to run" "$TMP/dry4.log" && ok "control: a unit missing from the archive runs" || bad "arch2: $(cat "$TMP/dry4.log")"
# staleness: an archived unit from a commit before ruler_grid.py's CONFIG_SINCE (the repository's
# first commit here), or from a commit git does not know, runs again; the unit as it was (control) does not
if root=$(git -C "$SRC" rev-list --max-parents=0 HEAD 2>/dev/null | tail -1) && [ -n "$root" ]; then
    for c in "$root" 0badc0de; do
        rm -rf "$TMP/arch3" && mkdir -p "$TMP/arch3" && cp "$TMP/arch"/*.json "$TMP/arch3"/
        python3 - "$TMP/arch3/tiny-2048-followup-niah_single_1-001.json" "$c" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d["commit"] = sys.argv[2][:7]; json.dump(d, open(sys.argv[1], "w"))
PY
        "${GRID[@]}" --out "$TMP/fresh" --archive "$TMP/arch3" --dry-run >"$TMP/dry5.log" 2>&1
        grep -q "8 units, 7 done, 1 to run (1 of them stale" "$TMP/dry5.log" && ok "a unit of kvtier ${c:0:7} (before the grid's configuration) runs again" \
            || bad "stale unit ${c:0:7}: $(cat "$TMP/dry5.log")"
        python3 "$SRC/bench/ruler_tables.py" "$TMP/arch3" >"$TMP/tables3.txt" 2>&1
        grep -q "^7 units; \|: 7 units; " "$TMP/tables3.txt" && grep -q "^1 unit of kvtier before" "$TMP/tables3.txt" \
            && ok "ruler_tables.py leaves the stale unit out" || bad "ruler_tables on a stale unit: $(head -4 "$TMP/tables3.txt")"
    done
else
    echo "     (no git history at $SRC: the staleness check is not exercised)"
fi

# an archived unit's text is its case built again from the seed (kvtier eval ruler --cases-only, what
# the llama-server pass does for units without their text): the grid's messages, byte for byte;
# control: the next case's are not
for unit in prompt-niah_single_2-002 followup-niah_single_1-001; do
    shape=${unit%%-*}; rest=${unit#*-}; task=${rest%-*}; case=$((10#${rest##*-}))
    for fc in $case $((case + 1)); do
        rm -rf "$TMP/co" && "$BIN" eval ruler "$task" --shape "$shape" -m "$TINY" --context 2048 --budget 512 --cases 1 \
            --first-case "$fc" --seed 1 --max-tokens 4 --threads 1 --out "$TMP/co" --cases-only >"$TMP/co.log" 2>&1
        same=$(python3 - "$OUT/units/tiny-2048-$unit.json" "$TMP/co" <<'PY'
import glob, json, sys
a = json.load(open(sys.argv[1]))["cases_detail"][0]
files = glob.glob(sys.argv[2] + "/*.json")
b = json.load(open(files[0]))["cases_detail"][0] if len(files) == 1 else {}
print("same" if a == b and "messages" in a else "differ")
PY
)
        if [ "$fc" = "$case" ]; then
            [ "$same" = same ] && ok "$unit: its case built again (--cases-only) is the grid's, text included" \
                || bad "$unit: case built again: $same ($(tail -2 "$TMP/co.log"))"
        else
            [ "$same" = differ ] && ok "control: case $fc is not $unit's" || bad "control: case $fc equals $unit's"
        fi
    done
done
grep -q "cases built, no policy run" "$TMP/co.log" && ! grep -q " policy [a-z_+]*: score" "$TMP/co.log" \
    && ok "--cases-only runs no policy" || bad "--cases-only: $(cat "$TMP/co.log")"

ls "$SRC/bench/ruler_units" 2>/dev/null | grep -q '^tiny\|tiny-' && bad "a tiny-model unit went into the source tree's archive" \
    || ok "the default archive takes only the grid's own configuration"

if python3 "$SRC/bench/ruler_tables.py" "$OUT" --plot "$TMP/fu.png" >"$TMP/tables.txt" 2>&1; then ok "ruler_tables.py ran"; else bad "ruler_tables.py: $(tail -3 "$TMP/tables.txt")"; fi
grep -c "^| niah_single_1 \|^| niah_single_2 " "$TMP/tables.txt" | grep -qx 4 && ok "both tasks in both shapes' tables" || bad "tables: $(head -30 "$TMP/tables.txt")"
grep -q "shape prompt (2-2 cases per task)" "$TMP/tables.txt" && grep -q "shape followup (2-2 cases per task)" "$TMP/tables.txt" \
    && ok "2 cases per task in each shape" || bad "cases per task: $(grep '^## ' "$TMP/tables.txt")"
grep -q "^| kvtier+store |" "$TMP/tables.txt" && ok "the follow-up curve has kvtier+store" || bad "no kvtier+store row in the follow-up curve"
grep -q "^replies to query q that repeat a value" "$TMP/tables.txt" && grep -q "^the same by query index on the paired log-probability" "$TMP/tables.txt" \
    && ok "the follow-up tables: repeated answers and the paired log-probability by query index" || bad "follow-up tables missing"
# the repeat count on a unit made for it: method copy answers query 2 with query 1's number, method
# own with query 2's reference (which query 1's reply also named: a reference is never a repeat)
mkdir -p "$TMP/rep"
python3 - "$TMP/rep/m-2048-followup-niah_single_1-001.json" <<'PY'
import json, sys
row = lambda m, q, reply, hit: {"policy": m, "item": q, "refs": 1, "refs_hit": hit, "error": False, "answer_logprob": -1.0, "reply": reply}
json.dump({"model": "m", "llama_cpp": "x", "commit": "c", "date": "d", "machine": "h", "threads": 1, "budget": 512, "context": 2048,
           "cases_detail": [{"facts": [{"refs": ["1111111"]}, {"refs": ["2222222"]}]}],
           "rows": [row("no_eviction", 0, "It is 1111111.", 1), row("no_eviction", 1, "It is 2222222.", 1),
                    row("copy", 0, "It is 1111111.", 1), row("copy", 1, "It is 1111111.", 0),
                    row("own", 0, "1111111 and 2222222", 1), row("own", 1, "It is 2222222.", 1)]}, open(sys.argv[1], "w"))
PY
python3 "$SRC/bench/ruler_tables.py" "$TMP/rep" --all-commits >"$TMP/rep.txt" 2>&1  # a unit made by hand: no kvtier commit
grep -q "^| copy | 1/1 | 0/0 | 0/0 | 0/0 | 1/1 |" "$TMP/rep.txt" && grep -q "^| own | 0/1 | 0/0 | 0/0 | 0/0 | 0/1 |" "$TMP/rep.txt" \
    && ok "a reply repeating the previous answer is counted, one naming its own reference is not" || bad "repeat count: $(grep '^| copy\|^| own' "$TMP/rep.txt")"
python3 "$SRC/bench/ruler_tables.py" "$TMP/arch" >"$TMP/tables_arch.txt" 2>&1
tables_body() { tail -n +2 "$1" | grep -v '^plot'; }
diff <(tables_body "$TMP/tables.txt") <(tables_body "$TMP/tables_arch.txt") >/dev/null && ok "the tables from the archive are the grid's" \
    || bad "tables from the archive differ: $(diff <(tables_body "$TMP/tables.txt") <(tables_body "$TMP/tables_arch.txt") | head -5)"
if command -v gnuplot >/dev/null 2>&1; then
    [ -s "$TMP/fu.png" ] && ok "the follow-up plot was written" || bad "no follow-up plot"
fi
t_finish
