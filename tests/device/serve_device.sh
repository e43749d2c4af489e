#!/usr/bin/env bash
# serve_device — `kvtier serve -ngl 99` on the device backend (label "device", via
# tests/device/run.sh) answers like the CPU: SmolLM2-135M-Instruct, greedy, per-token
# log-probabilities of the answer, compared while the answers' tokens agree.
#   floor:   the CPU server with flash attention on against off (two correct evaluations of the
#            same attention, other float sums), measured in this run (SmolLM2: ~0.15 nats);
#   check:   the device server (-ngl 99 -fa on) against the CPU server with -fa on: within
#            floor + 0.01 nats, and the same first answer token (lavapipe: ~0.02);
#   control: the device's answer to the same question behind a system message ("You are a
#            pirate.": the same words, other context) is outside that bound (~0.45).
# Each server runs alone, one after another (a CPU Vulkan driver is slow: short answers).
# Environment (tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}/tests/cli/lib.sh"
t_init serve-device
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
t_need_chat_model
PID=
trap '[ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null; rm -rf "$TMP"' EXIT

# ask NAME SYSTEM QUESTION FLAGS...: start a server with FLAGS, ask QUESTION (after the system
# message SYSTEM unless empty; greedy, logprobs), save the answer's tokens and log-probs as JSON in
# $TMP/NAME.json, stop the server
ask() {
    local name=$1 sys=$2 q=$3 port
    shift 3
    "$BIN" serve -m "$MODEL" --port 0 -c 1024 --budget 512 --max-sessions 1 --parallel 1 --no-store "$@" \
        >/dev/null 2>"$TMP/$name.err" &
    PID=$!
    port=
    for _ in $(seq 1 1500); do # 5 minutes: a CPU Vulkan driver compiles its shaders first
        port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/$name.err" 2>/dev/null | sed 's/.*://')
        [ -n "$port" ] && break
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.2
    done
    if [ -z "$port" ]; then
        bad "server $name ($*) did not start: $(tail -3 "$TMP/$name.err")"
        return
    fi
    python3 - "$port" "$sys" "$q" "$TMP/$name.json" <<'PY' || bad "request to server $name failed"
import json, sys, urllib.request
port, system, q, out = sys.argv[1:5]
msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "logprobs": True}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=900) as r:
    b = json.load(r)
lp = b["choices"][0]["logprobs"]["content"]
json.dump({"tokens": [t["token"] for t in lp], "logprobs": [t["logprob"] for t in lp]}, open(out, "w"))
PY
    grep -o 'device [^)]*' "$TMP/$name.err" | head -1 | sed "s/^/  $name: /"
    kill -TERM "$PID" 2>/dev/null
    wait "$PID" 2>/dev/null
    PID=
}

Q="What is the capital of France? Answer in one word."
# --no-op-offload: the CPU servers' prompt batches stay on the CPU (llama.cpp would offload them)
ask cpu_fa_off "" "$Q" -ngl 0 --no-op-offload -fa off
ask cpu_fa_on "" "$Q" -ngl 0 --no-op-offload -fa on
ask dev "" "$Q" -ngl 99 -fa on
ask dev_ctl "You are a pirate." "$Q" -ngl 99 -fa on
grep -q "Vulkan\|CUDA" "$TMP/dev.err" && ok "the -ngl 99 server names the device it offloaded to" \
    || bad "the -ngl 99 server's log names no device: $(grep -m1 'listening' "$TMP/dev.err")"

python3 - "$TMP" >"$TMP/cmp.out" 2>&1 <<'PY'
import json, sys
d = sys.argv[1]
r = {n: json.load(open(f"{d}/{n}.json")) for n in ("cpu_fa_off", "cpu_fa_on", "dev", "dev_ctl")}
def gap(a, b):
    """max |dlogprob| over the tokens both answers share from the start (at least the first)"""
    m, n = 0.0, 0
    for ta, la, tb, lb in zip(a["tokens"], a["logprobs"], b["tokens"], b["logprobs"]):
        m = max(m, abs(la - lb)); n += 1
        if ta != tb: break
    return m, n
floor, nf = gap(r["cpu_fa_off"], r["cpu_fa_on"])
cross, nc = gap(r["cpu_fa_on"], r["dev"])
ctl, _ = gap(r["dev"], r["dev_ctl"])
bound = floor + 0.01
print(f"  answer: CPU {r['cpu_fa_on']['tokens']} device {r['dev']['tokens']}")
print(f"  floor (CPU fa on vs off, {nf} tokens) {floor:.4g}; device vs CPU ({nc} tokens) {cross:.4g}; bound {bound:.4g}; "
      f"control (the same question behind a system message) {ctl:.4g}")
ok = lambda c, m: print(("ok   " if c else "FAIL ") + m)
ok(r["cpu_fa_on"]["tokens"][0] == r["dev"]["tokens"][0], "the device's first answer token is the CPU's")
ok(cross <= bound, f"device log-probs within the CPU's noise floor + 0.01 ({cross:.4g} <= {bound:.4g})")
ok(ctl > bound, f"control: the answer in another context is outside the bound ({ctl:.4g} > {bound:.4g})")
PY
cat "$TMP/cmp.out"
pass=$((pass + $(grep -c '^ok ' "$TMP/cmp.out")))
fail=$((fail + $(grep -c '^FAIL ' "$TMP/cmp.out")))
grep -q '^ok .*control' "$TMP/cmp.out" || bad "the comparison did not complete"
t_finish
