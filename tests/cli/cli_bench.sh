#!/usr/bin/env bash
# cli_bench — `kvtier bench primitives` runs on the real model and reports what it should:
# the JSON form's last line carries the labels (model, llama.cpp, commit, date, threads, cache
# type) and one row per block size with positive timings; the table form prints a header and
# one row per block.  `kvtier bench policy` (short run, three policies) reports, per policy,
# decode steps and positive decode times, policy time only where a policy has work, and
# evictions under the budget.  `kvtier bench prefill` (short) reports chunks and positive times.
# No speed assertions: shared machines are too noisy for them.
set -u
. "$(dirname "$0")/lib.sh"
t_need_essays
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
MODEL=${KVTIER_MODEL:?KVTIER_MODEL is not set}
t_init cli-bench


if "$BIN" bench primitives -m "$MODEL" --json --repeats 2 --blocks 16,64 >"$TMP/json.out" 2>"$TMP/json.err"; then
    ok "bench --json ran"
else
    bad "bench --json exited with status $?"
    tail -n 20 "$TMP/json.err"
fi
tail -n 1 "$TMP/json.out"

python3 - "$TMP/json.out" >"$TMP/checks" <<'EOF'
import json, sys
lines = open(sys.argv[1]).read().strip().splitlines()
try:
    d = json.loads(lines[-1])
except (IndexError, ValueError) as e:
    print(f"FAIL last stdout line is not JSON ({e})")
    sys.exit()
print("ok   last line is JSON")
for k in ("model", "llama_cpp", "commit", "date", "type_k"):
    v = d.get(k)
    print(("ok  " if isinstance(v, str) and v else "FAIL") + f" field {k} = {v!r}")
t = d.get("threads")
print(("ok  " if isinstance(t, int) and t > 0 else "FAIL") + f" field threads = {t!r}")
rows = d.get("rows")
blocks = [r.get("block") for r in rows] if isinstance(rows, list) else None
print(("ok  " if blocks == [16, 64] else "FAIL") + f" rows for blocks {blocks}")
for r in rows or []:
    for k in ("save_ms", "load_ms", "prefill_ms", "load_speedup", "lifecycle_speedup", "bytes_per_token"):
        v = r.get(k)
        good = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        print(("ok  " if good else "FAIL") + f" block {r.get('block')}: {k} = {v!r}")
EOF
while IFS= read -r line; do
    case "$line" in
        ok*) ok "${line#ok   }" ;;
        *) bad "${line#FAIL }" ;;
    esac
done <"$TMP/checks"

if "$BIN" bench primitives -m "$MODEL" --repeats 1 --blocks 16 >"$TMP/table.out" 2>"$TMP/table.err"; then
    ok "bench (table) ran"
else
    bad "bench (table) exited with status $?"
    tail -n 20 "$TMP/table.err"
fi
cat "$TMP/table.out"
if head -n 1 "$TMP/table.out" | grep -q '^# kvtier bench primitives | .*llama.cpp .*| kvtier commit '; then
    ok "table header names model, llama.cpp and commit"
else
    bad "table header: $(head -n 1 "$TMP/table.out")"
fi
if grep -qE '^ +16 +[0-9.]+ +[0-9.]+ +[0-9.]+ ' "$TMP/table.out"; then ok "table row for block 16"; else bad "no table row for block 16"; fi

# iSWA (Gemma 3, window 512): the load at [512, 1024) moves the window past [0, 512), whose
# sliding-window cells llama.cpp then drops; every round must still save a whole block.  The
# second round (after the warm-up) failed, "holds 0 of the 511 sliding-window cells", before
# the bench restored sequence 0 between rounds.
if "$BIN" bench primitives -m "$MODEL" --repeats 1 --blocks 512 >"$TMP/swa.out" 2>"$TMP/swa.err" \
    && grep -qE '^ +512 +[0-9.]+ +[0-9.]+ +[0-9.]+ ' "$TMP/swa.out"; then
    ok "bench primitives, block 512 = the sliding window: every round saves and loads"
else
    bad "bench primitives --blocks 512: $(tail -n 3 "$TMP/swa.err")"
fi
# the chat model (SmolLM2, llama architecture, no sliding window): the same bytes per token at
# every block size
CHAT=${KVTIER_CHAT_MODEL:-}
if [ -n "$CHAT" ] && [ -f "$CHAT" ]; then
    if "$BIN" bench primitives -m "$CHAT" --json --repeats 1 --blocks 16,64 >"$TMP/chat.out" 2>"$TMP/chat.err"; then
        ok "bench primitives on the chat model ran"
    else
        bad "bench primitives on the chat model: $(tail -n 3 "$TMP/chat.err")"
    fi
    python3 -c '
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
r = d["rows"]
b = [x["bytes_per_token"] for x in r]
ok = [x["block"] for x in r] == [16, 64] and all(x["load_ms"] > 0 and x["prefill_ms"] > 0 for x in r) and abs(b[0] - b[1]) < 0.01 * b[1]
print(("ok   " if ok else "FAIL ") + f"chat model: rows 16, 64, bytes per token {b}")' "$TMP/chat.out" >"$TMP/checks3" 2>&1 || echo "FAIL chat model JSON: $(cat "$TMP/checks3")" >"$TMP/checks3"
    while IFS= read -r line; do
        case "$line" in
            ok*) ok "${line#ok   }" ;;
            *) bad "${line#FAIL }" ;;
        esac
    done <"$TMP/checks3"
fi

if "$BIN" bench policy -m "$MODEL" --policies no_eviction,streaming,kvtier --turns 4 --turn-tokens 160 --gen 8 \
    --budget 256 --json >"$TMP/pol.out" 2>"$TMP/pol.err"; then
    ok "bench policy --json ran"
else
    bad "bench policy exited with status $?"
    tail -n 20 "$TMP/pol.err"
fi
tail -n 1 "$TMP/pol.out"
python3 - "$TMP/pol.out" >"$TMP/checks2" <<'EOF'
import json, sys
try:
    d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except (IndexError, ValueError) as e:
    print(f"FAIL bench policy: last stdout line is not JSON ({e})")
    sys.exit()
P = {p["policy"]: p for p in d.get("policies", [])}
print(("ok  " if list(P) == ["no_eviction", "streaming", "kvtier"] else "FAIL") + f" bench policy: policies {list(P)}")
for k in ("model", "llama_cpp", "commit", "date"):
    print(("ok  " if isinstance(d.get(k), str) and d[k] else "FAIL") + f" bench policy: field {k}")
for name, p in P.items():
    good = p["decode_steps"] > 0 and p["decode_ms_per_step"] > 0 and p["policy_ms_per_step"] >= 0 and p["errors"] == 0
    print(("ok  " if good else "FAIL") + f" bench policy {name}: steps {p['decode_steps']}, decode {p['decode_ms_per_step']} ms/step")
print(("ok  " if P["kvtier"]["policy_ms_per_step"] > P["no_eviction"]["policy_ms_per_step"] else "FAIL")
      + " bench policy: kvtier's attention signals cost more than no_eviction's nothing")
print(("ok  " if P["streaming"]["evictions"] > 0 and P["no_eviction"]["evictions"] == 0 else "FAIL")
      + " bench policy: the budget binds")
EOF
while IFS= read -r line; do
    case "$line" in
        ok*) ok "${line#ok   }" ;;
        *) bad "${line#FAIL }" ;;
    esac
done <"$TMP/checks2"
brc=0
"$BIN" bench policy -m "$MODEL" --policies bogus >/dev/null 2>"$TMP/bad.err" || brc=$?
if [ "$brc" -eq 2 ] && grep -q "unknown policy 'bogus'" "$TMP/bad.err"; then
    ok "bench policy: unknown policy is a usage error"
else
    bad "bench policy --policies bogus: exit $brc, $(head -c 300 "$TMP/bad.err")"
fi

# `kvtier bench prefill` (short): a session's prompt chunks and the same chunks decoded plain,
# with positive times and the labels; no speed assertion
if "$BIN" bench prefill -m "$MODEL" --resident 512 --message 24 --turns 2 --json >"$TMP/pf.out" 2>"$TMP/pf.err"; then
    ok "bench prefill ran"
else
    bad "bench prefill exited with status $?: $(tail -n 3 "$TMP/pf.err")"
fi
python3 - "$TMP/pf.out" >"$TMP/checks3" <<'EOF'
import json, sys
try:
    d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except (IndexError, ValueError) as e:
    print(f"FAIL bench prefill: last stdout line is not JSON ({e})")
    sys.exit()
print(("ok  " if d.get("chunks", 0) >= 2 and d.get("chunk_tokens", 0) >= 48 else "FAIL")
      + f" bench prefill: {d.get('chunks')} chunks of {d.get('chunk_tokens')} tokens")
for k in ("session_chunk_ms_median", "plain_decode_ms_median", "ratio", "turn_ms_median"):
    v = d.get(k)
    print(("ok  " if isinstance(v, (int, float)) and v > 0 else "FAIL") + f" bench prefill: {k} = {v!r}")
print(("ok  " if d.get("resident") == 512 and isinstance(d.get("build"), str) and d["build"] else "FAIL") + " bench prefill: labels")
EOF
while IFS= read -r line; do
    case "$line" in
        ok*) ok "${line#ok   }" ;;
        *) bad "${line#FAIL }" ;;
    esac
done <"$TMP/checks3"

t_finish
