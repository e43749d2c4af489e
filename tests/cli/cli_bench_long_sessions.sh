#!/usr/bin/env bash
# cli_bench_long_sessions — the smoke version of bench/run_long_sessions.sh: bench/long_sessions.py
# against `kvtier serve` on the chat model, 2 sessions x 6 turns that grow past the budget, with 2
# facts each planted and asked.  Checks what the report must hold, not how fast or how well: every
# turn answered, the sessions' context past the budget (eviction was at work), the probes counted
# and recall inside its Wilson interval, peak RSS and server CPU read, one series row per turn,
# and the markdown table from the JSON lines.  Control: the same script on a server that refuses
# every request (wrong API key) reports its errors and exits non-zero.
set -u
. "$(dirname "$0")/lib.sh"
t_need_essays
t_need_chat_model
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
t_init cli-bench-long
PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient >/dev/null || { bad "bootstrap.sh pyclient"; t_finish; }
PID=
trap '[ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT

BUDGET=256
"$BIN" serve -m "$MODEL" --port 0 -c $((BUDGET * 3)) --budget $BUDGET --block 32 --parallel 2 --max-sessions 2 \
    --threads 2 --no-store --api-key k-long >"$TMP/out" 2>"$TMP/err" &
PID=$!
PORT=$(t_listening "$TMP/err" "$PID")
[ -n "$PORT" ] || { bad "kvtier serve did not start: $(tail -3 "$TMP/err")"; t_finish; }

OPENAI_API_KEY=k-long "$PY" "$SRC/bench/long_sessions.py" --url "http://127.0.0.1:$PORT" --pid "$PID" --sessions 2 \
    --turns 6 --words 60 --max-tokens 12 --facts 2 --label smoke --essays "$ESSAYS" --series "$TMP/series.csv" \
    >"$TMP/res.jsonl" 2>"$TMP/progress" && ok "long_sessions.py ran" || bad "long_sessions.py exited $?: $(tail -3 "$TMP/progress")"
tail -1 "$TMP/res.jsonl"
"$PY" - "$TMP/res.jsonl" "$TMP/series.csv" "$BUDGET" >"$TMP/checks" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
rows = open(sys.argv[2]).read().strip().splitlines()
budget = int(sys.argv[3])
def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg)
check(r["n_errors"] == 0, f"every turn answered ({r['n_errors']} errors)")
check(r["generated_tokens"] > 0 and r["gen_tok_per_s"] > 0, f"{r['generated_tokens']} tokens generated, {r['gen_tok_per_s']} tok/s")
check(r["last_prompt_tokens"] > budget, f"the last turn's prompt ({r['last_prompt_tokens']} tokens) is past the budget ({budget})")
check(r["probes"] == 4, f"2 sessions x 2 facts probed ({r['probes']})")
lo, hi = r["recall_wilson95"]
check(0 <= lo <= r["recall"] <= hi <= 1, f"recall {r['recall']} inside its Wilson interval [{lo}, {hi}]")
check(r["peak_rss_mb"] > 50 and r["server_cpu_s"] > 0, f"peak RSS {r['peak_rss_mb']} MB and server CPU {r['server_cpu_s']} s read")
check(all(len(v) == 2 for v in r["ttft_ms_p50_p99"].values()), "TTFT p50/p99 per turn bucket")
check(rows[0].startswith("turn,") and len(rows) == 7, f"one series row per turn ({len(rows) - 1})")
EOF
while read -r line; do case $line in ok*) ok "${line#ok   }" ;; *) bad "${line#FAIL }" ;; esac; done <"$TMP/checks"
[ -s "$TMP/checks" ] || bad "the report could not be read"

"$PY" "$SRC/bench/long_sessions.py" --table "$TMP/res.jsonl" >"$TMP/table" 2>&1
grep -q "^| smoke | " "$TMP/table" && ok "markdown table from the JSON lines" || bad "table: $(cat "$TMP/table")"

# control: a server that answers every request with 401 -> errors reported, non-zero exit
OPENAI_API_KEY=wrong "$PY" "$SRC/bench/long_sessions.py" --url "http://127.0.0.1:$PORT" --sessions 1 --turns 2 --words 10 \
    --max-tokens 4 --facts 1 --essays "$ESSAYS" >"$TMP/bad.jsonl" 2>/dev/null
rc=$?
[ $rc -ne 0 ] && grep -q '"n_errors": 1' "$TMP/bad.jsonl" && ok "control: refused requests are reported (exit $rc)" \
    || bad "control: exit $rc, $(cat "$TMP/bad.jsonl")"
kill -TERM "$PID"
wait "$PID"
PID=
t_finish
