#!/usr/bin/env bash
# cli_bench_codec — `kvtier bench codec` smoke run on the tiny generated llama (128 tokens, 8
# tokens of KL, one repeat: seconds): the JSON form's last line carries the labels and one row
# per codec in order, raw round trips with KL exactly 0 and ratio ~1, the lossy codecs are
# smaller than raw (ecq < q4 < q8 < raw), elastic reports a sparsity, quality numbers are finite;
# the table form prints the header, a row per codec and the targets' verdicts; bad flags exit 2
# naming the value.  No speed assertions: shared machines are too noisy for them.
set -u
. "$(dirname "$0")/lib.sh"
t_need_essays
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
MODEL=${KVT_TINY_DIR:?KVT_TINY_DIR is not set}/tiny-llama.gguf
t_init cli-bench-codec

if "$BIN" bench codec -m "$MODEL" --tokens 128 --eval 8 --repeats 1 --json >"$TMP/json.out" 2>"$TMP/json.err"; then
    ok "bench codec --json ran"
else
    bad "bench codec --json exited with status $?"
    tail -n 20 "$TMP/json.err"
fi
python3 - "$TMP/json.out" >"$TMP/checks" <<'PY'
import json, math, sys
lines = open(sys.argv[1]).read().strip().splitlines()
try:
    d = json.loads(lines[-1])
except (IndexError, ValueError) as e:
    print(f"FAIL last stdout line is not JSON ({e})")
    sys.exit()
print("ok   last line is JSON")
for k in ("model", "llama_cpp", "commit", "date", "machine", "type_k"):
    v = d.get(k)
    print(("ok  " if isinstance(v, str) and v else "FAIL") + f" field {k} = {v!r}")
print(("ok  " if d.get("tokens") == 128 and d.get("eval_tokens") == 8 else "FAIL") + " tokens / eval_tokens")
rows = {r["codec"]: r for r in d.get("rows", [])}
names = [r["codec"] for r in d.get("rows", [])]
want = ["rawload", "floor", "raw", "q8", "q4", "ecq", "elastic", "elastic+q8", "elastic+q4"]
print(("ok  " if names == want else "FAIL") + f" rows {names}")
def num(r, k):
    v = r.get(k)
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
for n, r in rows.items():
    good = all(num(r, k) for k in ("bytes_per_token", "ratio", "load_ms", "kl_mean", "kl_max", "max_dlogit"))
    good = good and r["load_ms"] > 0 and r["kl_mean"] >= 0
    if n not in ("rawload", "floor"):
        good = good and num(r, "encode_mb_s") and num(r, "decode_mb_s") and r["encode_mb_s"] > 0
    print(("ok  " if good else "FAIL") + f" {n}: finite, positive numbers")
raw, q8, q4 = rows.get("raw", {}), rows.get("q8", {}), rows.get("q4", {})
print(("ok  " if raw.get("kl_mean") == 0 and raw.get("max_dlogit") == 0 else "FAIL") + f" raw is exact (KL {raw.get('kl_mean')})")
print(("ok  " if 1.0 <= raw.get("ratio", 0) < 1.01 else "FAIL") + f" raw ratio {raw.get('ratio')}")
print(("ok  " if 0 < q4.get("ratio", 9) < q8.get("ratio", 0) < 0.7 else "FAIL") + f" q4 {q4.get('ratio')} < q8 {q8.get('ratio')} < 0.7")
print(("ok  " if q8.get("kl_mean", 0) > 0 else "FAIL") + f" q8 is lossy (KL {q8.get('kl_mean')})")
ecq = rows.get("ecq", {})
print(("ok  " if 0 < ecq.get("ratio", 9) < q4.get("ratio", 0) and ecq.get("kl_mean", 0) > 0 else "FAIL")
      + f" ecq {ecq.get('ratio')} < q4 {q4.get('ratio')}, lossy (KL {ecq.get('kl_mean')})")
e = rows.get("elastic", {})
print(("ok  " if 0.05 < e.get("sparsity", 0) < 0.9 else "FAIL") + f" elastic sparsity {e.get('sparsity')}")
e8, e4 = rows.get("elastic+q8", {}), rows.get("elastic+q4", {})
print(("ok  " if 0 < e4.get("ratio", 9) < e8.get("ratio", 0) < e.get("ratio", 0) else "FAIL")
      + f" elastic+q4 {e4.get('ratio')} < elastic+q8 {e8.get('ratio')} < elastic {e.get('ratio')}")
print(("ok  " if e4.get("sparsity") == e8.get("sparsity") == e.get("sparsity") else "FAIL") + " the elastic codecs zero the same elements")
PY
while IFS= read -r line; do
    case "$line" in
        ok*) ok "${line#ok   }" ;;
        *) bad "${line#FAIL }" ;;
    esac
done <"$TMP/checks"

if "$BIN" bench codec -m "$MODEL" --tokens 64 --eval 4 --repeats 1 --codecs 'q4:32;32,elastic:0.3;0.3;0' >"$TMP/table.out" 2>"$TMP/table.err"; then
    ok "bench codec (table) ran"
else
    bad "bench codec (table) exited with status $?"
    tail -n 20 "$TMP/table.err"
fi
cat "$TMP/table.out"
if head -n 1 "$TMP/table.out" | grep -q '^# kvtier bench codec | .*llama.cpp .*| kvtier commit '; then
    ok "table header names model, llama.cpp and commit"
else
    bad "table header: $(head -n 1 "$TMP/table.out")"
fi
for c in rawload floor 'q4:32,32' 'elastic:0.3,0.3,0'; do
    if grep -qE "^$c +[0-9]+ +[0-9.]+ " "$TMP/table.out"; then ok "table row for $c"; else bad "no table row for $c"; fi
done
if grep -qE '^  q4:32,32 +bytes [0-9.]+x (met|NOT met), KL [0-9.e+-]+ (met|NOT met), load [0-9.]+x (met|NOT met)' "$TMP/table.out"; then
    ok "verdict line for q4:32,32"
else
    bad "no verdict line for q4:32,32"
fi

"$BIN" bench codec -m "$MODEL" --codecs zstd >"$TMP/bad.out" 2>"$TMP/bad.err"
st=$?
if [ "$st" -eq 2 ] && grep -q "zstd" "$TMP/bad.err"; then ok "unknown codec: exit 2 naming it"; else bad "unknown codec: status $st: $(cat "$TMP/bad.err")"; fi
"$BIN" bench codec -m "$MODEL" --tokens 100 >"$TMP/bad.out" 2>"$TMP/bad.err"
st=$?
if [ "$st" -eq 2 ] && grep -q "100" "$TMP/bad.err"; then ok "--tokens 100 with blocks of 64: exit 2 naming it"; else bad "--tokens 100: status $st: $(cat "$TMP/bad.err")"; fi
t_finish
