#!/usr/bin/env bash
# cli_bench_chunks — `kvtier bench chunks --quick` (issue #12's chunk-reuse measurement) runs on
# the real model and reports what it should: the JSON line's labels, one row per config in the
# order asked (k=0, k=4, k=15%, then k=all and the drop control), a decoded fraction that grows
# with k and is 1 for k=all, KL ~ 0 for k=all (every token decoded: the reference itself, up to
# batch-split rounding) and a KL for k=0 clearly above it (position-free chunks loaded without
# recompute do change the answer's distribution: the measurement can see a difference).  Bad
# --ks values are usage errors naming the value.  No speed or quality-threshold assertions.
set -u
. "$(dirname "$0")/lib.sh"
t_need_essays
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
MODEL=${KVTIER_MODEL:?KVTIER_MODEL is not set}
t_init cli-bench-chunks

if "$BIN" bench chunks -m "$MODEL" --quick --threads 1 --texts "$ESSAYS" --json >"$TMP/json.out" 2>"$TMP/json.err"; then
    ok "bench chunks --quick --json ran"
else
    bad "bench chunks --quick --json exited with status $?"
    tail -n 20 "$TMP/json.err"
fi
tail -n 1 "$TMP/json.out"

python3 - "$TMP/json.out" >"$TMP/checks" <<'PY'
import json, sys
try:
    d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except (IndexError, ValueError) as e:
    print(f"FAIL last stdout line is not JSON ({e})")
    sys.exit()
print("ok   last line is JSON")
for k in ("model", "llama_cpp", "commit", "date", "machine"):
    v = d.get(k)
    print(("ok  " if isinstance(v, str) and v else "FAIL") + f" field {k} = {v!r}")
print(("ok  " if d.get("cases") == 2 and d.get("docs") == 2 else "FAIL") + f" quick: cases {d.get('cases')}, docs {d.get('docs')}")
C = {c["config"]: c for c in d.get("configs", [])}
print(("ok  " if list(C) == ["k=0", "k=4", "k=15%", "k=all", "drop"] else "FAIL") + f" configs {list(C)}")
if len(C) == 5:
    f = [C[k]["decoded_frac"] for k in ("k=0", "k=4", "k=15%", "k=all")]
    print(("ok  " if f[0] > 0 and f[0] < f[1] < f[2] < f[3] == 1.0 else "FAIL") + f" decoded fraction grows with k to 1: {f}")
    a, z = C["k=all"]["kl_mean"], C["k=0"]["kl_mean"]
    print(("ok  " if 0 <= a < 0.005 else "FAIL") + f" k=all KL {a} ~ 0 (the reference recomputed)")
    print(("ok  " if z > 10 * max(a, 1e-4) else "FAIL") + f" k=0 KL {z} is clearly above k=all's {a}")
    print(("ok  " if C["k=all"]["match"] == d.get("ref_match") else "FAIL")
          + f" k=all greedy match {C['k=all']['match']} equals the reference's {d.get('ref_match')}")
    good = all(0 <= c["match"] <= 2 and 0 <= c["top1_agree"] <= 1 and c["kl_mean"] >= -1e-9 for c in C.values())
    print(("ok  " if good else "FAIL") + " match counts, top-1 agreement and KL in range")
PY
while IFS= read -r line; do
    case "$line" in
        ok*) ok "${line#ok   }" ;;
        *) bad "${line#FAIL }" ;;
    esac
done <"$TMP/checks"

for ks in "4,x" "101%" "-3"; do
    brc=0
    "$BIN" bench chunks -m "$MODEL" --ks "$ks" >/dev/null 2>"$TMP/bad.err" || brc=$?
    if [ "$brc" -eq 2 ] && grep -q -- "--ks element" "$TMP/bad.err"; then
        ok "bench chunks --ks '$ks' is a usage error naming the element"
    else
        bad "bench chunks --ks '$ks': exit $brc, $(head -c 300 "$TMP/bad.err")"
    fi
done

t_finish
