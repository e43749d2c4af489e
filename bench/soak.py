"""soak.py — `kvtier serve` under a mixed, partly hostile load for a set time (issue #24).

Clients (threads, loopback only), each its own session, cycling through what users send:
  chat        multi-turn, the whole history resent every turn (as OpenAI clients do)
  stream      the same, streamed (server-sent events read to [DONE])
  completion  /v1/completions
  tools       a tool call, then the tool's result sent back
  drop        a stream the client closes after its first chunk (a disconnect mid-stream)
  edit        a conversation whose last user message is edited and resent
  responses   OpenAI's Responses API: each turn names the previous response (the server holds the
              conversation), every third streamed
  anthropic   Anthropic's Messages API, the history resent, every other turn streamed
  native      llama-server's /completion with n_probs, every other one streamed
and, beside them, --hostile connections from 127.0.0.2 that trickle headers or bodies, send bodies
without a key, garbage, or bad requests, reconnecting when shut.

Every second: GET /health from 127.0.0.1 (its latency), the server's RSS (/proc/PID/status), and
the p99 latency of the requests that ended in that second.  At the end: counts by status, 5xx,
health misses and slowest, RSS after warm-up (first 20 % of the run) min/max, and a CSV timeline
(t, rss_mb, health_ms, p99_ms, requests) that bench/soak.gp plots.

  python bench/soak.py --url http://127.0.0.1:PORT --key KEY --pid PID [--seconds 600]
                       [--sessions 64] [--hostile 200] [--out DIR]
Exit status 0 when: no 5xx, no health check slower than 1 s or failed, every good request
answered 200 (or 429 when the queue is full, counted), RSS never more than --rss-budget-mb over
its value at the start, and RSS at the end within --rss-slack-mb of its value at mid-run (flat
once the tiers have filled).
"""
import argparse
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
import http.client

ap = argparse.ArgumentParser()
ap.add_argument("--url", required=True)
ap.add_argument("--key", required=True)
ap.add_argument("--pid", type=int, required=True)
ap.add_argument("--seconds", type=float, default=600)
ap.add_argument("--sessions", type=int, default=64)
ap.add_argument("--hostile", type=int, default=200)
ap.add_argument("--max-tokens", type=int, default=12)
ap.add_argument("--rss-budget-mb", type=float, default=512,
                help="RSS may grow this much over its value at the start (the store's RAM tier, 256 MiB by default, fills)")
ap.add_argument("--rss-slack-mb", type=float, default=64, help="RSS may grow this much over the second half of the run")
ap.add_argument("--out", default="results/soak")
a = ap.parse_args()
HOST, PORT = a.url.split("//")[1].split(":")[0], int(a.url.rsplit(":", 1)[1])
os.makedirs(a.out, exist_ok=True)
T_END = time.time() + a.seconds
lock = threading.Lock()
status = {}       # status -> count (good clients)
lat = []          # (t_end, seconds) of good requests
errors = []       # first few unexpected answers
WORDS = ("river stone garden lamp window paper music winter orange bridge number forest engine cloud "
         "silver market doctor letter planet candle").split()


def note(st, dt, what):
    with lock:
        status[st] = status.get(st, 0) + 1
        lat.append((time.time(), dt))
        if st not in (200, 429) and len(errors) < 20:
            errors.append(what)


def request(method, path, body, sid=None, key=None, stream=False, drop=False, timeout=300):
    """(status, parsed JSON or None).  stream: read the SSE to [DONE]; drop: close after the
    first chunk."""
    c = http.client.HTTPConnection(HOST, PORT, timeout=timeout)
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {key or a.key}"}
    if sid:
        h["X-Session-Id"] = sid
    t0 = time.time()
    try:
        c.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=h)
        r = c.getresponse()
        if stream and r.status == 200:
            text = ""
            while True:
                ln = r.readline()
                if not ln:
                    break
                ln = ln.decode("utf-8", "replace").strip()
                if drop and ln.startswith("data:"):
                    break
                if ln == "data: [DONE]":
                    break
                if ln.startswith("data: "):
                    d = json.loads(ln[6:])
                    for ch in d.get("choices", []):
                        text += (ch.get("delta") or {}).get("content") or ""
            js = {"text": text}
        else:
            data = r.read()
            js = json.loads(data) if data else None
        st = r.status
    except (OSError, ValueError, http.client.HTTPException) as e:
        st, js = -1, {"exception": str(e)}
    finally:
        c.close()
    note(st, time.time() - t0, f"{method} {path} -> {st} {str(js)[:200]}")
    if st == -1:
        time.sleep(0.2)  # a client whose connection failed does not spin
    return st, js


def sentence(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 30))) + "."


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def client(i):
    rng = random.Random(i)
    kind = ["chat", "stream", "completion", "tools", "drop", "edit", "responses", "anthropic", "native"][i % 9]
    prev = None  # responses: the last response of this client's conversation
    sid = f"soak-{i}"
    hist = []
    while time.time() < T_END:
        mt = a.max_tokens
        if kind == "completion":
            request("POST", "/v1/completions", {"prompt": sentence(rng), "max_tokens": mt})
            continue
        if kind == "native":
            n = rng.randint(0, 1 << 30)
            request("POST", "/completion", {"prompt": sentence(rng), "n_predict": mt, "n_probs": 3, "stream": n % 2 == 1},
                    stream=n % 2 == 1)
            continue
        if kind == "responses":
            if rng.random() < 0.05:
                prev = None  # a new conversation now and then
            n = rng.randint(0, 1 << 30)
            body = {"input": sentence(rng), "max_output_tokens": mt, **({"previous_response_id": prev} if prev else {})}
            if n % 3 == 0:
                body["stream"] = True
                request("POST", "/v1/responses", body, stream=True)
                prev = None  # the stream's id is not read here: the next turn starts again
            else:
                st, js = request("POST", "/v1/responses", body)
                prev = js.get("id") if st == 200 and isinstance(js, dict) else None
            continue
        if len(hist) > 40:
            hist = []  # a new conversation now and then
            sid = f"soak-{i}-{rng.randint(0, 1 << 30)}"
        hist.append({"role": "user", "content": sentence(rng)})
        body = {"messages": hist, "max_tokens": mt, "temperature": 0.7, "seed": rng.randint(0, 1000)}
        if kind == "tools":
            body.update(tools=TOOLS, tool_choice="required")
            st, js = request("POST", "/v1/chat/completions", body, sid)
            msg = js["choices"][0]["message"] if st == 200 else None
            if msg and msg.get("tool_calls"):
                hist.append({"role": "assistant", "content": None, "tool_calls": msg["tool_calls"]})
                hist.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": '{"celsius": 21}'})
                st, js = request("POST", "/v1/chat/completions", {"messages": hist, "max_tokens": mt, "tools": TOOLS}, sid)
                msg = js["choices"][0]["message"] if st == 200 else None
            if msg:
                hist.append({"role": "assistant", "content": msg.get("content") or "", **({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {})})
                if msg.get("tool_calls"):
                    hist.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "ok"})
            else:
                hist = []
            continue
        if kind == "anthropic":
            stream = len(hist) % 4 == 1
            st, js = request("POST", "/v1/messages", {"model": "m", "max_tokens": mt, "messages": hist, "stream": stream}, sid,
                             stream=stream)
            if st == 200 and not stream:
                text = "".join(b.get("text", "") for b in js.get("content", []) if b.get("type") == "text")
                hist.append({"role": "assistant", "content": text or "ok"})
            else:
                hist.pop()  # streamed (not read here) or refused: the next question replaces it
            continue
        if kind in ("stream", "drop"):
            body["stream"] = True
            st, js = request("POST", "/v1/chat/completions", body, sid, stream=True, drop=kind == "drop")
            if st == 200 and kind == "stream":
                hist.append({"role": "assistant", "content": js["text"]})
            elif kind == "drop":
                hist.pop()  # the reply never arrived: the client retries another question
            continue
        st, js = request("POST", "/v1/chat/completions", body, sid)
        if st == 200:
            hist.append({"role": "assistant", "content": js["choices"][0]["message"]["content"] or ""})
            if kind == "edit" and len(hist) >= 4 and rng.random() < 0.5:
                hist = hist[:-2]  # the client drops its last exchange: the next question replaces it
        else:
            hist.pop()


hostile_shut = [0]


def hostile(i):
    rng = random.Random(10_000 + i)
    while time.time() < T_END:
        try:
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.settimeout(5)
            s.connect((HOST, PORT))
            kind = i % 5
            if kind == 0:    # trickled headers
                s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
                while time.time() < T_END:
                    s.sendall(b"x")
                    time.sleep(0.5)
            elif kind == 1:  # trickled body with a key
                s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {a.key}\r\n"
                          f"Content-Length: 100000\r\n\r\n".encode())
                while time.time() < T_END:
                    s.sendall(b"{")
                    time.sleep(0.5)
            elif kind == 2:  # a big body without a key
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 8388608\r\n\r\n")
                s.sendall(b"x" * 65536)
                s.recv(4096)
            elif kind == 3:  # garbage
                s.sendall(bytes(rng.randrange(256) for _ in range(rng.randint(1, 4096))))
                s.recv(4096)
            else:            # a bad request with a key
                body = json.dumps({"messages": [{"role": "robot", "content": "x"}] * rng.randint(1, 5000)}).encode()
                s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {a.key}\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                s.recv(4096)
        except OSError:
            with lock:
                hostile_shut[0] += 1
        finally:
            s.close()
        time.sleep(rng.random())


def rss_mb():
    try:
        for ln in open(f"/proc/{a.pid}/status"):
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) / 1024
    except OSError:
        return float("nan")


timeline = []
health_fail = [0]


def monitor():
    t_start = time.time()
    seen = 0
    while time.time() < T_END:
        t0 = time.time()
        try:
            c = http.client.HTTPConnection(HOST, PORT, timeout=5)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
        except OSError:
            ok = False
        hms = (time.time() - t0) * 1e3
        if not ok:
            health_fail[0] += 1
        with lock:
            new = [d for t, d in lat[seen:]]
            seen = len(lat)
        p99 = sorted(new)[int(0.99 * (len(new) - 1))] * 1e3 if new else float("nan")
        timeline.append((round(time.time() - t_start, 1), rss_mb(), hms if ok else float("nan"), p99, len(new)))
        time.sleep(max(0, 1 - (time.time() - t0)))


RSS0 = rss_mb()
ths = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.sessions)]
ths += [threading.Thread(target=hostile, args=(i,), daemon=True) for i in range(a.hostile)]
mon = threading.Thread(target=monitor)
for t in ths:
    t.start()
mon.start()
mon.join()
for t in ths:
    t.join(timeout=600)

with open(os.path.join(a.out, "timeline.csv"), "w") as f:
    f.write("t_s,rss_mb,health_ms,p99_ms,requests\n")
    for r in timeline:
        f.write(",".join(str(x) for x in r) + "\n")
rss_all = [r[1] for r in timeline if r[1] == r[1]]
rss_mid = rss_all[len(rss_all) // 2] if rss_all else None
rss_end = rss_all[-1] if rss_all else None
health = [r[2] for r in timeline if r[2] == r[2]]
n5 = sum(v for k, v in status.items() if k >= 500)
bad = sum(v for k, v in status.items() if k not in (200, 429))
durs = [d for _, d in lat]
summary = {
    "seconds": a.seconds, "sessions": a.sessions, "hostile": a.hostile, "requests": len(lat),
    "status": {str(k): v for k, v in sorted(status.items())}, "responses_5xx": n5, "unexpected": bad,
    "health_checks": len(timeline), "health_failed": health_fail[0], "health_max_ms": max(health) if health else None,
    "latency_p50_s": statistics.median(durs) if durs else None,
    "latency_p99_s": sorted(durs)[int(0.99 * (len(durs) - 1))] if durs else None,
    "rss_start_mb": RSS0, "rss_mid_mb": rss_mid, "rss_end_mb": rss_end, "rss_max_mb": max(rss_all) if rss_all else None,
    "hostile_connections_shut": hostile_shut[0], "errors": errors,
}
json.dump(summary, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
good = (n5 == 0 and bad == 0 and health_fail[0] == 0 and health and max(health) < 1000 and rss_all
        and max(rss_all) - RSS0 <= a.rss_budget_mb and rss_end - rss_mid <= a.rss_slack_mb)
print("soak:", "PASS" if good else "FAIL")
sys.exit(0 if good else 1)
