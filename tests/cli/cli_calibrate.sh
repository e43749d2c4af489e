#!/usr/bin/env bash
# cli_calibrate — `kvtier calibrate` on the real model (Gemma 3 270M): a small run writes a
# profile with every layer and head, entropies within [0, log2(256)] (256 tokens is the most any
# query sees), valid classes and budgets, the split-half correlation, and the same object as the
# last stdout line with --json; no FILE.tmp is left behind.  Bad input (positions out of order,
# a missing model) fails with a non-zero exit and a message naming the value.
set -u
. "$(dirname "$0")/lib.sh"
t_need_essays
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
MODEL=${KVTIER_MODEL:?KVTIER_MODEL is not set}
t_init cli-calibrate


if "$BIN" calibrate -m "$MODEL" -o "$TMP/p.json" --n-texts 2 --tokens 256 --positions 128,256 --json \
    >"$TMP/out" 2>"$TMP/err"; then
    ok "calibrate ran"
else
    bad "calibrate exited with status $?"
    tail -n 20 "$TMP/err"
fi
head -n 3 "$TMP/out"
if [ -e "$TMP/p.json.tmp" ]; then bad "p.json.tmp left behind"; else ok "no p.json.tmp left behind"; fi
if head -n 1 "$TMP/out" | grep -q '^# kvtier calibrate | .*llama.cpp .*| 2 texts: .*| positions 128,256 '; then
    ok "table header names model, llama.cpp, texts and positions"
else
    bad "table header: $(head -n 1 "$TMP/out")"
fi

python3 - "$TMP/p.json" "$TMP/out" >"$TMP/checks" <<'EOF'
import json, math, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"FAIL profile is not readable JSON ({e})")
    sys.exit()
print("ok   profile is JSON")
try:
    last = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
    print(("ok  " if last == d else "FAIL") + " --json last line equals the profile")
except (IndexError, ValueError) as e:
    print(f"FAIL last stdout line is not JSON ({e})")
for k in ("model", "llama_cpp", "date"):
    v = d.get(k)
    print(("ok  " if isinstance(v, str) and v else "FAIL") + f" field {k} = {v!r}")
print(("ok  " if isinstance(d.get("texts"), list) and len(d["texts"]) == 2 else "FAIL") + f" texts = {d.get('texts')!r}")
print(("ok  " if d.get("positions") == [128, 256] else "FAIL") + f" positions = {d.get('positions')!r}")
print(("ok  " if d.get("base_budget") == 512 else "FAIL") + f" base_budget = {d.get('base_budget')!r}")
r = d.get("split_half_correlation")
print(("ok  " if isinstance(r, float) and -1 <= r <= 1 else "FAIL") + f" split_half_correlation = {r!r}")
c = d.get("effective_compression")
print(("ok  " if isinstance(c, float) and c > 0 else "FAIL") + f" effective_compression = {c!r}")
layers = d.get("layers") or []
nh = [len(l.get("heads") or []) for l in layers]
print(("ok  " if len(layers) == 18 and set(nh) == {4} else "FAIL") + f" {len(layers)} layers x heads {sorted(set(nh))}")
hmax, bad, types, total = math.log2(256), [], set(), 0
for l in layers:
    types.add(l.get("type"))
    budgets = []
    for h in l.get("heads") or []:
        e, cls, b = h.get("entropy_bits"), h.get("class"), h.get("budget")
        if not (isinstance(e, (int, float)) and 0 <= e <= hmax + 1e-9):
            bad.append(f"layer {l.get('layer')} head {h.get('head')} entropy {e!r}")
        want = "sink" if e < 0.5 else "focused" if e < 1.5 else "moderate" if e < 3 else "mixed"
        if cls not in ("sink", "focused", "moderate", "mixed") or cls != want:
            bad.append(f"layer {l.get('layer')} head {h.get('head')} class {cls!r} for {e!r} bits")
        if not (isinstance(b, int) and 0.3 * 512 - 1 <= b <= 2.5 * 512):
            bad.append(f"layer {l.get('layer')} head {h.get('head')} budget {b!r}")
        for k in ("entropy_half_a", "entropy_half_b"):
            if not isinstance(h.get(k), float):
                bad.append(f"layer {l.get('layer')} head {h.get('head')} {k} {h.get(k)!r}")
        budgets.append(b)
    if budgets and l.get("max_budget") != max(budgets):
        bad.append(f"layer {l.get('layer')} max_budget {l.get('max_budget')!r} != {max(budgets)}")
    total += l.get("max_budget") or 0
print(("ok  " if not bad else "FAIL") + " per-head entropy, class, budget: " + ("; ".join(bad[:5]) or "all valid"))
print(("ok  " if types == {"full", "swa"} else "FAIL") + f" layer types {sorted(map(str, types))}")
if total and isinstance(c, float):
    print(("ok  " if abs(c - 18 * 512 / total) < 1e-6 else "FAIL") + f" compression {c} = 18 x 512 / {total}")
EOF
while IFS= read -r line; do
    case "$line" in
        ok*) ok "${line#ok   }" ;;
        *) bad "${line#FAIL }" ;;
    esac
done <"$TMP/checks"

# bad input: non-zero exit and a message naming the value
expect_fail() { # expect_fail NAME PATTERN ARGS...
    local name=$1 pat=$2
    shift 2
    "$BIN" calibrate "$@" >"$TMP/bad.out" 2>"$TMP/bad.err"
    local st=$?
    if [ "$st" -ne 0 ] && grep -q -- "$pat" "$TMP/bad.err"; then
        ok "$name: exit $st, $(head -n 1 "$TMP/bad.err")"
    else
        bad "$name: exit $st, stderr: $(head -n 2 "$TMP/bad.err")"
    fi
}
expect_fail "positions out of order" "300" -m "$MODEL" -o "$TMP/q.json" --positions 300,200
expect_fail "missing model" "$TMP/no-such-model.gguf" -m "$TMP/no-such-model.gguf" -o "$TMP/q.json" --n-texts 1
expect_fail "position past --tokens" "512" -m "$MODEL" --tokens 256 --positions 128,512
expect_fail "unreadable text dir" "$TMP/no-texts" -m "$MODEL" --texts "$TMP/no-texts"
if [ -e "$TMP/q.json" ]; then bad "a failed run wrote q.json"; else ok "failed runs wrote no profile"; fi

t_finish
