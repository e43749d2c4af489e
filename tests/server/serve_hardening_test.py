"""serve_hardening_test.py — issue #38's attacks on the surfaces added by #25-#28 (Responses,
Anthropic Messages, llama-server's native routes), each a check that failed on 10fe331:

  1  a Responses request whose bad field is a 3 MB key: the error named a key of the freed
     request (a use-after-free; the server runs with MALLOC_MMAP_THRESHOLD_ so it crashed); since
     #39 an unknown field is answered and listed back in usage.kvtier.ignored_fields: the name
     travels in the reply, cut to 63 bytes, from a copy
  2  stored responses changed by later requests: a function_call item merged into the stored
     reply before the input was validated (a 400 still grew it), and a resent call twice
  3  one LRU for all keys: one key's responses evicted another's (--responses-per-key)
  5  /tokenize with_pieces: a JSON object per token, six at once grew the server by gigabytes
  6  Anthropic text blocks joined quadratically, --max-content-parts not applied
  7  POST /health read the whole body (up to --max-body-mb) before answering
 10  llama-server's logit_bias pair ["123", false] read as token id 123; /slots showed other
     keys' busy slots; /props showed the model's path to every key; control characters of a
     field name reached the log; a batch of prompts larger than one key's queue share got 429;
     response ids from a counter and the clock

Usage: serve_hardening_test.py BASE_URL KEY OTHER_KEY PID   (tests/server/cli_serve_hardening.sh:
--max-responses 8 with two keys, so 4 per key; --max-content-parts 64; --queue-per-key 4)
"""
import json
import re
import socket
import sys
import threading
import time

from serve_client import check, finish, init, raw

BASE, KEY, OTHER, PID = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
init(BASE, KEY)
HOST, PORT = BASE.split("//")[1].split(":")[0], int(BASE.rsplit(":", 1)[1])


def alive(what):
    st, _, b = raw("GET", "/health", timeout=10)
    check(f"{what}: the server still answers /health", st == 200, f"{st} {b}")


def peak_rss_mib():
    for line in open(f"/proc/{PID}/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) // 1024
    return -1


# ---- 1: the error of a request names a field of the request it freed ------------------------
big = ("{\"" + "x" * 3_000_000 + "\": 1, \"input\": \"hi\", \"max_output_tokens\": 2}").encode()
st, _, b = raw("POST", "/v1/responses", big)
ign = b.get("usage", {}).get("kvtier", {}).get("ignored_fields") if isinstance(b, dict) else None
check("Responses with a 3 MB unknown field -> 200 listing it (the name cut to 63 bytes, copied before the request is freed)",
      st == 200 and isinstance(ign, list) and len(ign) == 1 and 0 < len(ign[0]) <= 63 and set(ign[0]) == {"x"},
      f"{st} {str(b)[:200]}")
alive("after the 3 MB field name")
st, _, b = raw("POST", "/v1/responses", {"input": "hi", "max_output_tokens": "x" * 3_000_000})
p = b.get("error", {}).get("param") if isinstance(b, dict) else None
check("Responses with a 3 MB value of the wrong type -> 400 naming the field", st == 400 and p == "max_output_tokens",
      f"{st} {str(b)[:200]}")
st, _, b = raw("POST", "/v1/responses", {"a\u0001b\u001b[31m": 1, "input": "hi", "max_output_tokens": 2})
ign = b.get("usage", {}).get("kvtier", {}).get("ignored_fields") if isinstance(b, dict) else None
check("a field name with control characters -> listed back showing them as '?'", st == 200 and ign == ["a?b?[31m"], f"{st} {b}")
raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "evil\u001b]0;x\u0007": 1})

# ---- 2: a stored response is never changed by a later request --------------------------------
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
st, _, r1 = raw("POST", "/v1/responses", {"input": "What is the weather in Paris?", "tools": TOOLS,
                                          "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 120,
                                          "temperature": 0})  # greedy: a short call, never cut by the limit
calls = [o for o in r1.get("output", []) if o.get("type") == "function_call"] if st == 200 else []
check("a forced tool call is stored as a response with a function_call item", len(calls) == 1, f"{st} {str(r1)[:300]}")
check("response ids are 128 random bits (resp_ and 32 hex digits), not a counter and the clock",
      re.fullmatch(r"resp_[0-9a-f]{32}", r1.get("id", "")) is not None, r1.get("id"))
if calls:
    call = calls[0]
    out = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21 C"}

    def cont(items, **kw):
        return raw("POST", "/v1/responses", {"previous_response_id": r1["id"], "input": items, "max_output_tokens": 2,
                                             "store": False, **kw})

    st, _, b = cont([out])
    base = b["usage"]["input_tokens"] if st == 200 else None
    check("the tool's result continues the stored conversation", st == 200 and base, f"{st} {b}")
    newcall = {"type": "function_call", "call_id": "call_new1", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}
    st, _, b = cont([newcall, {"type": "bogus"}])
    check("a continuation starting with a new function_call whose next item is bad -> 400", st == 400, f"{st} {b}")
    st, _, b = cont([out])
    check("...and the stored response did not grow: the same continuation has the same input tokens",
          st == 200 and b["usage"]["input_tokens"] == base, f"{base} then {b.get('usage')}")
    st, _, b = cont([{k: call[k] for k in ("type", "call_id", "name", "arguments")}, out])
    check("the previous response's own function_call sent again with its output: replayed once (same input tokens)",
          st == 200 and b["usage"]["input_tokens"] == base, f"{base} vs {b.get('usage')}")
    # continuations of one response at once, half of them bad: nothing of theirs reaches the stored one
    res = []

    def one(i):
        items = [dict(newcall, call_id=f"call_c{i}"), {"type": "bogus"}] if i % 2 else [dict(newcall, call_id=f"call_c{i}"), out]
        res.append(cont(items, max_output_tokens=1)[0])

    th = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    [t.start() for t in th]
    [t.join() for t in th]
    st, _, b = cont([out])
    check("12 concurrent continuations of one stored response (6 bad): 200s (or 429: the key's queue share is 4) and 400s, "
          "and the stored response unchanged",
          set(res) <= {200, 400, 429} and res.count(400) == 6 and 200 in res and st == 200 and b["usage"]["input_tokens"] == base, f"{res} {base} {b.get('usage')}")
    st, _, g = raw("GET", f"/v1/responses/{r1['id']}")
    check("GET of the stored response: its output as it was", st == 200 and g["output"] == r1["output"], f"{st} {str(g)[:200]}")
alive("after the continuations")

# ---- 3: each key's share of stored responses --------------------------------------------------
st, _, theirs = raw("POST", "/v1/responses", {"input": "Say hi.", "max_output_tokens": 2}, key=OTHER)
mine = []
for i in range(6):  # key one fills its share (4 of --max-responses 8) and more
    mine.append(raw("POST", "/v1/responses", {"input": f"Count to {i}.", "max_output_tokens": 2})[2].get("id"))
got = [raw("GET", f"/v1/responses/{i}")[0] for i in mine]
check("one key past its share (4 of 8): its own oldest responses go first", got == [404, 404, 200, 200, 200, 200], got)
st, _, b = raw("GET", f"/v1/responses/{theirs.get('id')}", key=OTHER)
check("...and another key's stored response is still there", st == 200, f"{st} {b}")
st, _, b = raw("GET", f"/v1/responses/{theirs.get('id')}")
check("...and not to be read with another key (404)", st == 404, f"{st} {b}")
# a chain deeper than the share: its ancestors are used whenever it is continued, so they stay
prev = None
for i in range(3):
    st, _, b = raw("POST", "/v1/responses", {"input": f"Step {i}.", "max_output_tokens": 2,
                                             **({"previous_response_id": prev} if prev else {})})
    prev = b.get("id")
st, _, b = raw("POST", "/v1/responses", {"input": "Last step.", "max_output_tokens": 2, "previous_response_id": prev})
check("a conversation of 4 responses fills the share and is continued whole", st == 200, f"{st} {str(b)[:200]}")

# ---- 5: /tokenize with_pieces, six at once ----------------------------------------------------
h0 = peak_rss_mib()
res = []


def tok():
    st, _, b = raw("POST", "/tokenize", {"content": " a" * 1_000_000, "with_pieces": True})
    res.append((st, len(b["tokens"]) if isinstance(b, dict) else b))


th = [threading.Thread(target=tok) for _ in range(6)]
t0 = time.time()
[t.start() for t in th]
[t.join() for t in th]
grew = peak_rss_mib() - h0
print(f"     six /tokenize with_pieces of 1M tokens: {time.time() - t0:.1f} s, peak RSS +{grew} MiB")
# 10fe331: +3,027 MiB (a JSON object per token, all six at once); now +187 MiB, +613 MiB under ASan
check("six concurrent /tokenize with_pieces of 1M tokens each: all answered, peak RSS +{} MiB < 1200 (was 3 GB)".format(grew),
      [r[0] for r in res] == [200] * 6 and all(r[1] == 1_000_000 for r in res) and grew < 1200, f"{res} +{grew} MiB")
st, _, b = raw("POST", "/tokenize", {"content": "a\u0001b\"c\\ \u00e9", "with_pieces": True})
check("with_pieces: pieces with control characters, quotes and UTF-8 come back as valid JSON strings",
      st == 200 and "".join(t["piece"] for t in b["tokens"] if isinstance(t["piece"], str)) == "a\u0001b\"c\\ \u00e9", f"{st} {b}")

# ---- 6: Anthropic text blocks -----------------------------------------------------------------
many = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]}
t0 = time.time()
st, _, b = raw("POST", "/v1/messages/count_tokens", many)
dt = time.time() - t0
check(f"Anthropic: 100,000 text blocks in one message -> 400 naming --max-content-parts in {dt:.2f} s (< 2)",
      st == 400 and "max-content-parts" in str(b) and dt < 2, f"{st} {str(b)[:200]}")
some = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "word"}] * 60}],
        "system": [{"type": "text", "text": "Be brief."}] * 3}
st, _, b = raw("POST", "/v1/messages/count_tokens", some)
check("Anthropic: 60 blocks (under the cap) are joined and counted", st == 200 and b.get("input_tokens", 0) > 60, f"{st} {b}")
st, _, b = raw("POST", "/v1/messages/count_tokens", dict(some, system=[{"type": "text", "text": "x"}] * 100))
check("Anthropic: 100 system blocks -> 400 naming system", st == 400 and b.get("error", {}).get("type") == "invalid_request_error"
      and "system" in str(b), f"{st} {b}")


# ---- 7: the routes open without a key answer other methods before the body ---------------------
def head_only(path, key):
    s = socket.create_connection((HOST, PORT), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\n{auth}Content-Length: 8000000\r\n\r\n".encode())
    t0 = time.time()
    try:
        line = s.recv(100).split(b"\r\n")[0].decode()
    except OSError as e:
        line = str(e)
    s.close()
    return line, time.time() - t0


for path, key in (("/health", None), ("/health", KEY), ("/v1/health", None)):
    line, dt = head_only(path, key)
    check(f"POST {path} {'with' if key else 'without'} a key, 8 MB announced, no body sent: 405 at once ({dt * 1000:.0f} ms)",
          " 405 " in line and dt < 2, line)

# ---- 10: the smaller ones ------------------------------------------------------------------------
P = {"prompt": "1,2,3,4,5,6,7,8,", "n_predict": 1, "temperature": 0, "cache_prompt": False}
st, _, a = raw("POST", "/completion", P)
c0 = a.get("content", "") if st == 200 else ""
st, _, a2 = raw("POST", "/completion", {**P, "logit_bias": [[c0, False]]})
check(f"logit_bias [[{c0!r}, false]] (llama-server's pair, a string of digits): the text is tokenized and banned, not read "
      f"as token id {c0}", c0.strip().isdigit() and st == 200 and a2.get("content") != c0, f"{c0!r} then {a2.get('content')!r}")
st, _, a3 = raw("POST", "/completion", {**P, "logit_bias": [[int(c0) if c0.strip().isdigit() else 0, False]]})
check("...and a number in a pair is a token id (banning that id leaves the greedy text)",
      st == 200 and a3.get("content") == c0, f"{a3.get('content')!r} vs {c0!r}")

# a native reply cut inside a character: found by fuzz_api (the reply object was NULL for text
# that is not UTF-8 and the connection was dropped without an answer)
st, _, tk = raw("POST", "/tokenize", {"content": "\U0001F642\u4e2d", "with_pieces": True})
frag = [t["id"] for t in tk.get("tokens", []) if isinstance(t.get("piece"), list)]
if frag:
    for stream in (False, True):
        try:
            st, _, b = raw("POST", "/completion", {"prompt": "x", "n_predict": 1, "temperature": 0, "cache_prompt": False,
                                                   "logit_bias": [[frag[0], 100]], "stream": stream})
        except Exception as ex:  # noqa: BLE001 - a dropped connection is the failure
            st, b = -1, repr(ex)
        check(f"/completion whose one token is part of a character (id {frag[0]}){' streamed' if stream else ''}: "
              "200 with valid UTF-8, not a dropped connection", st == 200, f"{st} {str(b)[:200]}")
else:
    check("the tokenizer splits an emoji into byte tokens (the cut-character case needs one)", False, str(tk)[:200])

busy = threading.Thread(target=lambda: raw("POST", "/v1/chat/completions", {
    "messages": [{"role": "user", "content": "Write a long story about a dragon."}], "max_tokens": 150, "temperature": 0}, key=OTHER))
busy.start()
seen_other = seen_mine = False
for _ in range(60):
    time.sleep(0.1)
    _, _, so = raw("GET", "/slots", key=OTHER)
    _, _, sm = raw("GET", "/slots")
    seen_other |= any(s.get("is_processing") for s in so)
    seen_mine |= any(s.get("is_processing") for s in sm)
busy.join()
check("/slots: the key whose request runs sees its slot busy, another key does not (nothing of other tenants)",
      seen_other and not seen_mine, f"other key saw busy {seen_other}, this key {seen_mine}")
st, _, props = raw("GET", "/props")
check("/props with API keys: model_path is the file's name, not the server's directories",
      st == 200 and "/" not in props.get("model_path", "/") and props["model_path"].endswith(".gguf"), str(props.get("model_path")))
st, _, b = raw("POST", "/completion", {"prompt": [f"p{i}" for i in range(6)], "n_predict": 1})
check("6 prompts in one batch over one key's queue share (4) -> 400 naming prompt (it can never fit: not a 429)",
      st == 400 and b["error"]["param"] == "prompt" and "queue" in b["error"]["message"], f"{st} {b}")
alive("at the end")
finish()
