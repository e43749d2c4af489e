"""serve_sched_test.py — black-box tests of how `kvtier serve` schedules (started by tests/server/cli_serve.sh,
right after serve_test.py, against the same server).

  python serve_sched_test.py BASE_URL KEY_A KEY_B [ignored...]

Session choice without X-Session-Id is by the longest common TOKEN prefix between the request (the
chat template's tokens with the assistant prefix) and each idle session's token stream:
  - a request whose first message shares a long start (> one block of 64 tokens) with another
    conversation's lands in that session and decodes only its own tail (the session is cut back
    to the first differing token); control: the same request with another first word, and the
    same request under the other API key, reuse nothing;
  - a conversation continued without the header lands in its own session, even when it is
    shorter than a block (the whole-conversation rule);
  - a request sharing less than a block with every session gets a new one;
  - a long conversation that merely opens like the request (cutting it back would drop more
    tokens than it reuses) is not taken over: the request gets its own session.
/v1/completions are batched with the chats (continuous batching, raw rows in the same
llama_decode):
  - a short chat sent while a 200-token completion runs finishes before it (the old scheduler ran
    a completion to its end while every chat waited);
  - the greedy completion is the same text alone and with a chat batched beside it;
  - streaming with a stop string and include_usage, two completions at once, and a disconnect
    that frees the slot.

Greedy text and cell layout: llama.cpp's attention sums run over the cells of the unified cache,
so a different layout (another session's cells, a batch neighbour) changes rounding, and a
free-running greedy story on this Q4_K_M model can flip at a near-tie: measured on Gemma 3 270M,
the continuation of "Once upon a time, in a small village by the sea," alone versus with a chat
batched beside it, or alone after one more idle session was opened, agreed on its first 32 to 50
words, then parted.  The identity test therefore uses a continuation with wide logit margins
(counting), where rounding cannot flip a token but a batching bug (a row given another row's
logits or position) would at once.

Every case prints "ok   NAME" or "FAIL NAME: why"; the exit status is the number of failures.
"""
import http.client
import json
import sys
import threading
import time
import urllib.parse

from serve_client import check, finish, init, metric, raw

BASE, KEY_A, KEY_B = sys.argv[1:4]
U = urllib.parse.urlparse(BASE)
init(BASE, KEY_A)
BLOCK = 64  # the server's --block (default)





def chat(messages, key=KEY_A, max_tokens=8, **kw):
    st, _, b = raw("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw},
                   key=key)
    if st != 200:
        raise RuntimeError(f"chat: {st} {str(b)[:300]}")
    return b


def kv(resp):
    return resp["usage"]["kvtier"]



def wait_idle(limit=60):
    t0 = time.time()
    while time.time() - t0 < limit and metric("kvtier_active_requests") != 0:
        time.sleep(0.05)


class Stream:
    """A streamed /v1/completions request read on its own thread: .first (time of the first text
    chunk), .end (time of [DONE]), .text, .usage, .finish."""

    def __init__(self, body, key=KEY_A):
        self.body, self.key = dict(body, stream=True), key
        self.first = self.end = None
        self.text, self.usage, self.finish, self.error = "", None, None, None
        self.started = threading.Event()
        self.th = threading.Thread(target=self.run)
        self.th.start()

    def run(self):
        try:
            c = http.client.HTTPConnection(U.hostname, U.port, timeout=300)
            c.request("POST", "/v1/completions", body=json.dumps(self.body).encode(),
                      headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                self.error = f"{r.status} {r.read()[:300]}"
                return
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    self.end = time.time()
                    break
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    self.usage = ev["usage"]
                for ch in ev.get("choices", []):
                    if ch.get("text"):
                        if self.first is None:
                            self.first = time.time()
                            self.started.set()
                        self.text += ch["text"]
                    if ch.get("finish_reason"):
                        self.finish = ch["finish_reason"]
            c.close()
        except Exception as e:  # reported by the checks
            self.error = repr(e)
        finally:
            self.started.set()

    def join(self):
        self.th.join()
        return self


wait_idle()

# ---- (a) a long common start inside the first message -------------------------------------
doc = " ".join(f"Item {i}: the warehouse in district {i % 7} stores {i * 13 % 97} crates of apples and pears."
               for i in range(12))
q1 = [{"role": "user", "content": doc + " Question: which district stores the most crates?"}]
q2 = [{"role": "user", "content": doc + " Question: how many items are listed in total?"}]
r1 = chat(q1)
s1 = kv(r1)["session_id"]
r2 = chat(q2)
k2 = kv(r2)
print(f"     conversation 1: prompt {r1['usage']['prompt_tokens']} {kv(r1)}\n"
      f"     conversation 2: prompt {r2['usage']['prompt_tokens']} {k2}")
check("(a) a request sharing a long start (> 1 block) with another conversation lands in its session",
      r1["usage"]["prompt_tokens"] > 3 * BLOCK and k2["session_id"] == s1, f"{s1} vs {k2['session_id']}")
check("(a) ... and decodes only its own tail (the shared document is reused)",
      k2["prompt_tokens_reused"] >= r1["usage"]["prompt_tokens"] - 20 and k2["prompt_tokens_decoded"] <= 20
      and k2["prompt_tokens_decoded"] == r2["usage"]["prompt_tokens"] - k2["prompt_tokens_reused"], str(k2))
# control: the same request with another first word shares only the template's opening
q3 = [{"role": "user", "content": "Consider " + q2[0]["content"]}]
r3 = chat(q3)
k3 = kv(r3)
check("(a) control: another first word -> a new session, nothing reused",
      k3["session_id"] not in (s1,) and k3["prompt_tokens_reused"] == 0, str(k3))
# control: another API key never sees key A's sessions, however long the common prefix
rb = chat(q2, key=KEY_B)
check("(a) control: the same request under key B reuses nothing of key A's session",
      kv(rb)["prompt_tokens_reused"] == 0 and kv(rb)["session_id"] != s1, str(kv(rb)))

# ---- (b) a conversation continued without the header: its own session ---------------------
h = [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "What colour is the sky on Mars?"}]
t1 = chat(h, max_tokens=12)
sb = kv(t1)["session_id"]
h += [{"role": "assistant", "content": t1["choices"][0]["message"]["content"]},
      {"role": "user", "content": "And at sunset?"}]
t2 = chat(h, max_tokens=4)
k = kv(t2)
print(f"     turn 1: prompt {t1['usage']['prompt_tokens']} {kv(t1)}\n     turn 2: prompt {t2['usage']['prompt_tokens']} {k}")
check("(b) a continued conversation (shorter than a block) lands in its own session",
      t1["usage"]["prompt_tokens"] < BLOCK and k["session_id"] == sb, f"{sb} vs {k['session_id']}")
check("(b) ... reusing at least the previous turn's prompt",
      k["prompt_tokens_reused"] >= t1["usage"]["prompt_tokens"], str(k))

# ---- (c) less than one block in common: a new session --------------------------------------
c1 = chat([{"role": "user", "content": "Quick question: what is the capital of Peru?"}], max_tokens=4)
c2 = chat([{"role": "user", "content": "Quick question: what is the capital of Chile?"}], max_tokens=4)
print(f"     short prefix: {kv(c1)} / {kv(c2)}")
check("(c) a request sharing less than one block with every session gets a new one",
      kv(c2)["session_id"] != kv(c1)["session_id"] and kv(c2)["prompt_tokens_reused"] == 0, f"{kv(c1)} {kv(c2)}")

# ---- (d) a long conversation that merely opens like the request keeps its history -----------
# (an agent's long system prompt shared by two users): taking the session over would cut back
# more than it reuses, so the newcomer gets its own session.  Control: (a) above, where the cut
# part is short, is taken over.
sysp = "You are a careful assistant for a logistics team. Reference data follows. " + doc
la = [{"role": "system", "content": sysp}]
sa, ka = None, None
for i, t in enumerate(["List two fruits.", "Name a colour of apples.", "Why are pears soft?", "Count to three."]):
    la.append({"role": "user", "content": t + " " + " ".join(
        f"Note {i}.{n}: the morning delivery to the dock in sector {n} arrived late again." for n in range(5))})
    ra = chat(la, max_tokens=12)
    sa, ka = kv(ra)["session_id"], ra
    la.append({"role": "assistant", "content": ra["choices"][0]["message"]["content"]})
rb = chat([{"role": "system", "content": sysp}, {"role": "user", "content": "Which district stores the most crates?"}])
la.append({"role": "user", "content": "Thanks. And one more fruit?"})
ra2 = chat(la, max_tokens=4)
print(f"     long conversation {sa}: {kv(ka)}; newcomer {kv(rb)}; the conversation again {kv(ra2)}")
check("(d) a newcomer sharing only a long conversation's opening gets a session of its own",
      kv(rb)["session_id"] != sa and kv(rb)["prompt_tokens_reused"] == 0, f"{sa} {kv(rb)}")
check("(d) ... and the long conversation continues in its session with its history reused",
      kv(ra2)["session_id"] == sa
      and kv(ra2)["prompt_tokens_reused"] >= ka["usage"]["prompt_tokens"] + ka["usage"]["completion_tokens"] - 1,
      f"{kv(ra2)} after prompt {ka['usage']['prompt_tokens']} + {ka['usage']['completion_tokens']}")

# ---- completions batched with chats --------------------------------------------------------
COUNT = ", ".join(str(i) for i in range(1, 21)) + ","
long_body = {"prompt": COUNT, "max_tokens": 200, "temperature": 0}
st, _, alone = raw("POST", "/v1/completions", long_body)
check("a 200-token greedy completion alone", st == 200 and alone["usage"]["completion_tokens"] == 200
      and alone["choices"][0]["finish_reason"] == "length", str(alone)[:300])
wait_idle()
# the same completion, streamed; a short chat is sent once it is generating
s = Stream(long_body)
s.started.wait(120)
t_chat0 = time.time()
rc = chat([{"role": "user", "content": "Say hello in French."}], max_tokens=8)
t_chat = time.time()
s.join()
print(f"     completion streamed {s.end - s.first if s.end and s.first else -1:.2f} s after its first token; "
      f"the chat took {t_chat - t_chat0:.2f} s and ended {s.end - t_chat if s.end else -1:.2f} s before it")
check("a short chat sent while a long completion runs finishes before it (batched, not queued behind it)",
      s.error is None and s.first is not None and s.first < t_chat0 and s.end is not None and t_chat < s.end
      and rc["usage"]["completion_tokens"] > 0, f"error {s.error}, chat end {t_chat}, completion end {s.end}")
check("the greedy completion is the same alone and batched beside a chat",
      s.error is None and s.text == alone["choices"][0]["text"] and s.finish == "length",
      f"{s.text[:120]!r} vs {alone['choices'][0]['text'][:120]!r}")

# streaming with a stop string, usage last
s = Stream({"prompt": COUNT, "max_tokens": 100, "temperature": 0, "stop": [" 25,"],
            "stream_options": {"include_usage": True}}).join()
check("streamed completion: stop string ends it, usage chunk sent",
      s.error is None and s.finish == "stop" and " 25," not in s.text and s.text.strip().startswith("21")
      and s.usage and 0 < s.usage["completion_tokens"] < 100, f"{s.error} {s.finish} {s.text!r} {s.usage}")

# two completions at once (--parallel 2): both run in their own scratch sequence, overlapping
a = Stream({"prompt": COUNT, "max_tokens": 60, "temperature": 0})
a.started.wait(120)
b = Stream({"prompt": "The alphabet: A, B, C, D,", "max_tokens": 60, "temperature": 0})
a.join()
b.join()
check("two completions generate at once",
      a.error is None and b.error is None and b.first is not None and a.end is not None and b.first < a.end
      and a.text == alone["choices"][0]["text"][:len(a.text)] and len(a.text) > 0, f"{a.error} {b.error} {a.first} {b.first} {a.end}")
# two that together do not fit the shared budget (512 cells): the second waits for the first
a = Stream({"prompt": COUNT, "max_tokens": 300, "temperature": 0})
a.started.wait(120)
b = Stream({"prompt": COUNT, "max_tokens": 300, "temperature": 0})
a.join()
b.join()
check("two completions that do not fit the budget together run one after the other, both complete",
      a.error is None and b.error is None and a.end is not None and b.first is not None and b.first >= a.end - 0.5
      and a.text == b.text, f"{a.error} {b.error} first b {b.first} end a {a.end}")

# a client that drops a streamed completion frees its slot at once
wait_idle()
gen0 = metric("kvtier_generated_tokens_total")
conn = http.client.HTTPConnection(U.hostname, U.port, timeout=60)
conn.request("POST", "/v1/completions", body=json.dumps({"prompt": COUNT, "max_tokens": 400, "stream": True, "temperature": 0}),
             headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
resp = conn.getresponse()
got = resp.read1(100)
resp.close()
conn.close()
t0 = time.time()
while time.time() - t0 < 10 and metric("kvtier_active_requests") != 0:
    time.sleep(0.05)
freed = time.time() - t0
check(f"a dropped streamed completion frees its slot ({freed:.2f} s) and stops",
      got.startswith(b"data: ") and metric("kvtier_active_requests") == 0 and freed < 3
      and metric("kvtier_generated_tokens_total") - gen0 < 300, f"active {metric('kvtier_active_requests')}")
st, _, after = raw("POST", "/v1/completions", {"prompt": COUNT, "max_tokens": 20, "temperature": 0})
check("completions still served after the drop", st == 200 and alone["choices"][0]["text"].startswith(after["choices"][0]["text"]),
      str(after)[:200])

finish()
