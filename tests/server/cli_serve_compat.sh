#!/usr/bin/env bash
# cli_serve_compat — `kvtier serve` started with llama-server's command line (the flags its own
# test suite passes, plus --cors-origins and two --alias names) on the chat model: the log says what
# was derived or raised (the budget from -c and --parallel, -b below a block, --embedding), then
# tests/server/serve_compat_test.py (llama-server's endpoints and shapes, Anthropic's Messages
# API through the official client, OpenAI's Responses API with previous_response_id through the
# official openai client).  A second server checks --no-slots, --no-metrics,
# --chat-template and IPv6 (::1, where the machine has it); a template llama.cpp does not know
# stops the start with a clear error.  Skips (exit 77) when KVTIER_CHAT_MODEL is not set.
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/../cli/lib.sh" # t_py_checks (this script keeps its own ok, bad and temporary directory)
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
MODEL=${KVTIER_CHAT_MODEL:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL" ]; then
    echo "SKIP: KVTIER_CHAT_MODEL ('$MODEL') is not a file"
    exit 77 # reported as skipped (SKIP_RETURN_CODE), never as passed
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvt-cli-serve-compat.XXXXXX")
export XDG_CACHE_HOME="$TMP/cache" # the server's default block store: private to this script
PID=
cleanup() {
    [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null
    rm -rf "$TMP"
}
trap cleanup EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   $*"; }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }

PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
"$SRC/scripts/bootstrap.sh" pyclient || { bad "bootstrap.sh pyclient"; echo "$pass passed, $fail failed"; exit 1; }

start() { # log-file args... : PORT set, or empty when the server did not start
    local log=$1
    shift
    "$BIN" serve -m "$MODEL" --port 0 --threads 2 "$@" >"$TMP/out" 2>"$log" &
    PID=$!
    PORT=
    for _ in $(seq 1 300); do
        PORT=$(grep -o 'listening on http://[^ ]*' "$log" | sed 's/.*://')
        [ -n "$PORT" ] && break
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.2
    done
}
stop() { # log-file
    kill -TERM "$PID"
    wait "$PID"; local src=$?
    PID=
    [ $src -eq 0 ] && grep -q "stopped" "$1" && ok "SIGTERM: the server exited 0" || bad "SIGTERM: exit status $src"
    if grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:' "$1"; then
        bad "sanitizer report on the server's stderr"; grep -A20 -E 'Sanitizer|runtime error' "$1" | head -60
    else
        ok "no sanitizer report"
    fi
}

# ---- llama-server's test-suite command line (tools/server/tests/utils.py, tinyllama2 preset) ----
KEY=key-compat-1618
KEY2=key-compat-3141
start "$TMP/err" --api-key "$KEY2" --temp 0.8 --seed 42 --host 127.0.0.1 --offline --batch-size 32 --alias tinyllama-2,code --tags chat,small \
    --ctx-size 512 --parallel 2 --n-predict 64 --no-jinja --api-key "$KEY" --cors-origins localhost --embedding --cont-batching \
    --metrics --top-k 40 --min_p 0.05 --backend_sampling --xtc-threshold 0.2 --dynatemp-exp 1.5 --swa-full --context-shift
if [ -z "$PORT" ]; then
    bad "server did not start with llama-server's flags"; cat "$TMP/err"; echo "$pass passed, $fail failed"; exit 1
fi
ok "server listening on port $PORT with llama-server's flags"
grep -q -- "-c 512 with --parallel 2: --budget 256 and 2 sessions" "$TMP/err" && ok "the budget derived from -c and --parallel is logged" \
    || bad "budget line: $(grep -i budget "$TMP/err" | head -3)"
grep -q -- "-b 32 is below a block of 64 tokens" "$TMP/err" && ok "-b below a block is raised, and said" \
    || bad "-b line: $(grep -- '-b ' "$TMP/err" | head -2)"
grep -q -- "--embedding: kvtier serves no embeddings" "$TMP/err" && ok "--embedding is accepted and logged" \
    || bad "--embedding line missing"
grep -q -- "--backend-sampling: kvtier samples on the host" "$TMP/err" \
    && ok "--backend_sampling (llama.cpp's '_' spelling) is accepted and logged" || bad "--backend-sampling line missing"
grep -q -- "--swa-full: kvtier reuses a sliding-window model's prefix from its blocks" "$TMP/err" \
    && ok "--swa-full is accepted and logged" || bad "--swa-full line missing"
grep -q -- "--context-shift: a session evicts past its budget" "$TMP/err" \
    && ok "--context-shift is accepted and logged" || bad "--context-shift line missing"

"$PY" "$SRC/tests/server/serve_compat_test.py" "http://127.0.0.1:$PORT" "$KEY" "$KEY2" >"$TMP/py" 2>&1
prc=$?
t_py_checks "$TMP/py" "$prc" serve_compat_test.py
stop "$TMP/err"
grep -qF -e "$KEY" -e "$KEY2" "$TMP/err" "$TMP/out" && bad "the API key is in the server's log" || ok "no API key in the server's log"

# ---- --no-slots, --no-metrics, --chat-template, IPv6 ------------------------------------------
HOSTS=127.0.0.1
if python3 -c 'import socket; s = socket.socket(socket.AF_INET6); s.bind(("::1", 0))' 2>/dev/null; then HOSTS=127.0.0.1,::1; fi
start "$TMP/err2" --host "$HOSTS" --no-slots --no-metrics --chat-template llama3 -c 2048 \
    --repeat-penalty 1.3 --frequency-penalty 1.5 --presence-penalty 0.5 --repeat-last-n 16
if [ -z "$PORT" ]; then
    bad "second server did not start"; cat "$TMP/err2"
else
    code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
    [ "$(code "http://127.0.0.1:$PORT/slots")" = 501 ] && ok "--no-slots: GET /slots -> 501" || bad "--no-slots: $(code "http://127.0.0.1:$PORT/slots")"
    [ "$(code "http://127.0.0.1:$PORT/metrics")" = 501 ] && ok "--no-metrics: GET /metrics -> 501" || bad "--no-metrics"
    tp=$(curl -s "http://127.0.0.1:$PORT/apply-template" -d '{"messages":[{"role":"user","content":"hi"}]}')
    echo "$tp" | grep -q 'start_header_id' && ! echo "$tp" | grep -q 'im_start' \
        && ok "--chat-template llama3 replaces the GGUF's ChatML" || bad "--chat-template: $tp"
    pre() { curl -s -o /dev/null -D - -X OPTIONS -H "Origin: $1" -H 'Access-Control-Request-Method: POST' "http://127.0.0.1:$PORT/v1/chat/completions"; }
    pre http://localhost:5173 | grep -qi '^Access-Control-Allow-Origin: http://localhost:5173' \
        && ! pre http://evil.example | grep -qi '^Access-Control-Allow-Origin' \
        && ok "without API keys the default --cors-origins is localhost: a page elsewhere cannot read the replies" \
        || bad "keyless CORS default: $(pre http://evil.example | tr -d '\r' | grep -i access-control)"
    r=$(curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}')
    echo "$r" | grep -q '"choices"' && ok "a chat request runs under the llama3 template" || bad "chat under llama3: $r"
    # llama-server's penalty flags are the defaults of a request that sends none: /props and
    # generation_settings report them; with repeat_penalty neutralised, each greedy token is the
    # argmax of the top-20 log-probabilities less 1.5 x its count in the last 16 tokens and 0.5 if
    # there (the flags' frequency and presence penalties, by definition); the reply with no field
    # equals the one sending the flags' values; repeat_last_n 0 in the request: the plain reply,
    # which the penalties change (control), and generation_settings says 0 (not an internal window)
    "$PY" - "http://127.0.0.1:$PORT" >"$TMP/pen" 2>&1 <<'PYEOF'
import json, sys, urllib.request
url = sys.argv[1]
def post(path, body):
    rq = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(rq, timeout=120) as r:
            return json.load(r)
    except Exception as e:
        return {"error": str(e)}
props = json.load(urllib.request.urlopen(url + "/props", timeout=30))["default_generation_settings"]["params"]
want = {"repeat_penalty": 1.3, "frequency_penalty": 1.5, "presence_penalty": 0.5, "repeat_last_n": 16}
ok_props = all(abs(props.get(k, -9) - v) < 1e-6 for k, v in want.items())
ids = post("/tokenize", {"content": "1, 1, 1, 1, 1, 1, 1, 1, 1, 1,"}).get("tokens", [])  # greedy: more 1s
base = {"prompt": ids, "n_predict": 12, "temperature": 0, "cache_prompt": False}
b = post("/completion", dict(base, n_probs=20, repeat_penalty=1))
gs = b.get("generation_settings", {})
probs = b.get("completion_probabilities", [])
gen = [e["id"] for e in probs]
decided = agree = changed = 0
for i, e in enumerate(probs):
    top = [(t["id"], t["logprob"]) for t in e["top_logprobs"]]
    win = (ids + gen[:i])[-16:]
    adj = sorted(((lp - 1.5 * win.count(k) - (0.5 if k in win else 0), k) for k, lp in top), reverse=True)
    best, bk = adj[0]
    if best < min(lp for _, lp in top) or best - adj[1][0] < 1e-3:  # a tie within float32's rounding: not decided
        continue
    decided += 1
    agree += bk == e["id"]
    changed += bk != max((lp, k) for k, lp in top)[1]
dflt = post("/completion", base).get("content")
given = post("/completion", dict(base, **want)).get("content")
plainb = post("/completion", dict(base, repeat_last_n=0))
plain = plainb.get("content")
print(json.dumps({"props": ok_props, "gs": all(abs(gs.get(k, -9) - v) < 1e-6 for k, v in want.items() if k != "repeat_penalty"),
                  "decided": decided, "agree": agree, "changed": changed, "same": dflt is not None and dflt == given,
                  "plain_differs": plain is not None and plain != dflt,
                  "plain_gs": plainb.get("generation_settings", {}).get("repeat_last_n"), "dflt": dflt, "plain": plain}))
PYEOF
    pen=$(tail -1 "$TMP/pen")
    echo "$pen" | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["props"] and d["gs"] and d["decided"] >= 6 and d["agree"] == d["decided"] and d["changed"] > 0 and d["same"] and d["plain_differs"] and d["plain_gs"] == 0 else 1)' \
        && ok "--repeat-penalty --frequency-penalty --presence-penalty --repeat-last-n: the defaults of a request that sends none ($pen)" \
        || bad "penalty flags: $(tail -5 "$TMP/pen")"
    if [ "$HOSTS" != 127.0.0.1 ]; then
        [ "$(code -g "http://[::1]:$PORT/health")" = 200 ] && ok "--host 127.0.0.1,::1: the server answers on IPv6 too, same port" \
            || bad "IPv6: $(code -g "http://[::1]:$PORT/health")"
    else
        ok "IPv6 loopback unavailable on this machine: --host ::1 not checked"
    fi
    stop "$TMP/err2"
fi
"$BIN" serve -m "$MODEL" --port 0 --chat-template 'no such {{ template' >"$TMP/out3" 2>"$TMP/err3" &
PID=$!
wait "$PID"; rc=$?
PID=
[ $rc -ne 0 ] && grep -q "is not one llama.cpp knows" "$TMP/err3" && ok "an unknown --chat-template stops the start, saying why" \
    || bad "unknown template: status $rc, $(tail -2 "$TMP/err3")"
"$BIN" serve -m "$MODEL" --port 0 --slots --no-slots >"$TMP/out4" 2>"$TMP/err4"
rc=$?
[ $rc -eq 2 ] && grep -q "contradict" "$TMP/err4" && ok "--slots with --no-slots -> usage error" || bad "--slots --no-slots: status $rc"
for bad_flag in "--repeat-penalty 0" "--frequency-penalty 3" "--repeat-last-n 9999" "--repeat-last-n -2"; do
    # shellcheck disable=SC2086 # the flag and its value, split
    "$BIN" serve -m "$MODEL" --port 0 -c 2048 $bad_flag >"$TMP/out5" 2>"$TMP/err5"
    rc=$?
    [ $rc -eq 2 ] && grep -q -- "${bad_flag% *}" "$TMP/err5" && ok "serve $bad_flag -> usage error naming it" \
        || bad "serve $bad_flag: status $rc, $(tail -2 "$TMP/err5")"
done

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
