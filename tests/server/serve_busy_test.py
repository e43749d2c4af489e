"""serve_busy_test.py — a session is never given to two jobs at once (started by
tests/server/cli_serve.sh against its second server, which runs with --parallel 3 --queue 8).

  python serve_busy_test.py BASE_URL KEY

The collision: session S holds a conversation H.  Job A, without X-Session-Id, continues H, so the
server chooses S for it by conversation; job B names S with X-Session-Id.  Both are queued while
the engine thread prefills a long prompt (job D, streamed: its headers go out when that prefill
is over), so that one admission round takes both, A first.  A then runs in S, and B must neither
share S with A nor fail: it waits in the queue until A is done, then runs in S on top of A's turn
(cut back to H, since its question differs from A's).  The old scheduler checked only at admission
whether a named session was busy, so B was handed S while A was generating in it.

The setup itself is checked (A and B both seen queued before D's headers arrived): if D's prefill
ever got too short for that, the test says so instead of passing without a collision.

Every case prints "ok   NAME" or "FAIL NAME: why"; the exit status is the number of failures.
"""
import http.client
import json
import sys
import threading
import time
import urllib.parse

from serve_client import check, finish, init, metric, raw

BASE, KEY = sys.argv[1:3]
U = urllib.parse.urlparse(BASE)
init(BASE, KEY)
SID = "busy-s"


class Chat:
    """A streamed /v1/chat/completions request on its own thread: .headers_at (response headers:
    the engine has taken the prompt in), .first (first content chunk), .end ([DONE]), .text,
    .usage, .session, .error."""

    def __init__(self, messages, max_tokens, session=None):
        self.body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}}
        self.headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        if session:
            self.headers["X-Session-Id"] = session
        self.headers_at = self.first = self.end = None
        self.text, self.usage, self.session, self.error = "", None, None, None
        self.th = threading.Thread(target=self.run)
        self.th.start()

    def run(self):
        try:
            c = http.client.HTTPConnection(U.hostname, U.port, timeout=300)
            c.request("POST", "/v1/chat/completions", body=json.dumps(self.body).encode(), headers=self.headers)
            r = c.getresponse()
            self.headers_at = time.time()
            self.session = r.getheader("X-Session-Id")
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
                if "error" in ev:
                    self.error = str(ev["error"])[:300]
                if ev.get("usage"):
                    self.usage = ev["usage"]
                for ch in ev.get("choices", []):
                    t = ch.get("delta", {}).get("content")
                    if t:
                        if self.first is None:
                            self.first = time.time()
                        self.text += t
            c.close()
        except Exception as e:  # reported by the checks
            self.error = repr(e)

    def join(self):
        self.th.join()
        return self


def wait_metric(name, value, limit):
    """Poll /metrics until name == value; the time it was seen, or None."""
    t0 = time.time()
    while time.time() - t0 < limit:
        if metric(name) == value:
            return time.time()
        time.sleep(0.005)
    return None


def chat(messages, max_tokens, session=None):
    st, h, b = raw("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0},
                   headers={"X-Session-Id": session} if session else None)
    if st != 200:
        raise RuntimeError(f"chat: {st} {str(b)[:300]}")
    return b


wait_metric("kvtier_active_requests", 0, 60)

# S: a short conversation H, named
h = [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Name a large animal that lives in the sea."}]
r0 = chat(h, 8, SID)
h.append({"role": "assistant", "content": r0["choices"][0]["message"]["content"]})
check("S holds a conversation", r0["usage"]["kvtier"]["session_id"] == SID, str(r0["usage"]))

# D: a long prompt of its own (no common start with H) keeps the engine thread in its prefill
filler = " ".join(f"Entry {i}: the lighthouse keeper logged {i * 7 % 31} ships and {i * 3 % 11} storms that week."
                  for i in range(60))
d = Chat([{"role": "user", "content": filler + " Which week had the most storms?"}], 1)
admitted = wait_metric("kvtier_active_requests", 1, 60)
qa = h + [{"role": "user", "content": "How long can it hold its breath?"}]
qb = h + [{"role": "user", "content": "What does it eat?"}]
a = Chat(qa, 24)  # no X-Session-Id: S, by conversation
one = wait_metric("kvtier_queue_length", 1, 10)
b = Chat(qb, 24, SID)  # names S
both = wait_metric("kvtier_queue_length", 2, 10)
d.join()
a.join()
b.join()
print(f"     D admitted at {admitted}, A queued at {one}, B queued at {both}, D's headers at {d.headers_at}\n"
      f"     A: session {a.session} usage {a.usage} {a.first}..{a.end} {a.text!r}\n"
      f"     B: session {b.session} usage {b.usage} {b.first}..{b.end} {b.text!r}")
check("setup: A and B were queued together while D's prompt was prefilled (one admission round takes both)",
      admitted and one and both and d.headers_at and both < d.headers_at,
      f"admitted {admitted} A {one} B {both} D headers {d.headers_at}: D's prefill was too short to build the collision")
check("A (no X-Session-Id, continuing S's conversation) ran in S",
      a.error is None and a.session == SID and a.usage and a.usage["kvtier"]["session_id"] == SID,
      f"{a.error} {a.session} {a.usage}")
check("B (X-Session-Id S, S busy with A) waited and was served, not refused",
      b.error is None and b.session == SID and b.usage and b.usage["kvtier"]["session_id"] == SID and b.end is not None,
      f"{b.error} {b.session} {b.usage}")
check("B did not share S with A: it started after A's reply was over",
      a.end is not None and b.headers_at is not None and b.headers_at >= a.end,
      f"B's headers at {b.headers_at}, A ended at {a.end}")
check("B reused S's history (cut back to it from A's turn) and decoded only its own question",
      b.usage and b.usage["kvtier"]["prompt_tokens_reused"] >= r0["usage"]["prompt_tokens"]
      and b.usage["kvtier"]["prompt_tokens_decoded"] < 30, str(b.usage))

# S is consistent afterwards: B's conversation continues with everything reused.  (/v1/sessions
# is a snapshot the engine thread publishes after the step in which B ended, which may come just
# after B's client has its reply.)
ss, t0 = [], time.time()
while time.time() - t0 < 10:
    st, _, ls = raw("GET", "/v1/sessions")
    ss = [x for x in ls["data"] if x["id"] == SID] if st == 200 else []
    if len(ss) == 1 and ss[0]["busy"] is False:
        break
    time.sleep(0.05)
check("one session S, idle", len(ss) == 1 and ss[0]["busy"] is False, str(ss))
if b.usage:
    qc = qb + [{"role": "assistant", "content": b.text}, {"role": "user", "content": "Thank you."}]
    rc = chat(qc, 4, SID)
    kc = rc["usage"]["kvtier"]
    check("S continues B's conversation with all of it reused",
          kc["prompt_tokens_reused"] >= b.usage["prompt_tokens"] + b.usage["completion_tokens"] - 1, f"{kc} after {b.usage}")

finish()
