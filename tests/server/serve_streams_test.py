"""serve_streams_test.py — a session's numbers do not depend on the other sessions (one KV stream
per sequence, GitHub issue #11), and a new prompt's prefill rides in the same llama_decode as the
other requests' decode tokens (mixed prefill) without changing any number.

  python serve_streams_test.py probe BASE_URL OUT_JSON [--expect-mixed]
  python serve_streams_test.py compare ...

  probe            on a fresh server: the probe session ALONE, twice (two new sessions: the
                   noise floor), then the probe among 7 other sessions that are generating (they
                   overlap it: each one's first token came before the probe was sent and its
                   last after the probe's reply; every decode step of the probe shared its
                   llama_decode with them: usage.kvtier.decode_steps_shared).  Writes the greedy
                   tokens and per-token log-probs of the three runs to OUT_JSON.
                   With --expect-mixed: the probe's prefill chunks went into mixed steps
                   (/metrics kvtier_mixed_steps_total, kvtier_mixed_prefill_tokens_total).
  compare NAME FLOOR.json A.json:RUN B.json:RUN {equal|differ}
                   run RUN (alone1, alone2, busy) of A against run RUN of B: the greedy tokens
                   are equal and every log-prob within the single-session noise floor (the
                   largest difference between FLOOR's two runs alone, at least 1e-6: printing)
                   -- or, for a control, they are not.
"""
import http.client
import json
import sys
import threading
import time
import urllib.parse

from serve_client import check, finish, init, metric, raw

KEY = None
PROBE_TOKENS = 16
BG_TOKENS = 72

# the probe: a prompt of several blocks (its prefill takes several chunks) and a question
PROBE = [{"role": "system", "content": "You are a careful assistant. Answer briefly."},
         {"role": "user", "content": " ".join(
             f"Note {i}: the harbour of town {i} received {i * 13 % 29} boats and {i * 5 % 17} barges on day {i}."
             for i in range(9)) + " Which town received the most boats, and how many?"}]


def background_prompt(i):
    return [{"role": "user", "content": f"Count from {i * 100} upwards, one number per line, and never stop."}]


class Chat:
    """A streamed chat in its own thread: times of its first token and of its end."""

    def __init__(self, url, messages, max_tokens, session):
        self.u = urllib.parse.urlparse(url)
        self.body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}}
        self.headers = {"Content-Type": "application/json", "X-Session-Id": session}
        self.first = self.end = None
        self.usage, self.error, self.n = None, None, 0
        self.th = threading.Thread(target=self.run)
        self.th.start()

    def run(self):
        try:
            c = http.client.HTTPConnection(self.u.hostname, self.u.port, timeout=300)
            c.request("POST", "/v1/chat/completions", body=json.dumps(self.body).encode(), headers=self.headers)
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
                    if ch.get("delta", {}).get("content"):
                        self.n += 1
                        if self.first is None:
                            self.first = time.time()
            c.close()
        except Exception as e:  # reported by the checks
            self.error = repr(e)


def probe(session):
    """The probe, greedy, with log-probs: (tokens, logprobs, usage, t_sent, t_done)."""
    t0 = time.time()
    st, _, b = raw("POST", "/v1/chat/completions",
                   {"messages": PROBE, "max_tokens": PROBE_TOKENS, "temperature": 0, "logprobs": True},
                   headers={"X-Session-Id": session})
    t1 = time.time()
    if st != 200:
        raise RuntimeError(f"probe: {st} {str(b)[:300]}")
    lp = b["choices"][0]["logprobs"]["content"]
    return [x["token"] for x in lp], [x["logprob"] for x in lp], b["usage"], t0, t1


def wait_idle(limit=60):
    t0 = time.time()
    while time.time() - t0 < limit and metric("kvtier_active_requests") != 0:
        time.sleep(0.05)


def run_probe(url, out, expect_mixed):
    init(url, KEY)
    wait_idle()
    if expect_mixed:  # bad input for the new fields: 400 naming the field, the server keeps serving
        m = [{"role": "user", "content": "hi"}]
        for body, field, words in (({"logprobs": "yes"}, "logprobs", "must be a boolean or an integer, got a string"),
                                   ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
                                   ({"top_logprobs": 3}, "top_logprobs", "needs 'logprobs'")):
            st, _, b = raw("POST", "/v1/chat/completions", dict(body, messages=m, max_tokens=2))
            err = b.get("error", {}) if isinstance(b, dict) else {}
            check(f"{body} -> 400 naming '{field}'", st == 400 and err.get("param") == field and words in err.get("message", ""),
                  f"{st} {b}")
    a1 = probe("probe-alone-1")
    a2 = probe("probe-alone-2")
    check("the probe alone replies with log-probs for every token",
          len(a1[0]) == a1[2]["completion_tokens"] and len(a1[0]) > 0, str(a1[2]))
    check("alone, no other request shares the probe's steps", a1[2]["kvtier"]["decode_steps_shared"] == 0, str(a1[2]))
    bg = [Chat(url, background_prompt(i), BG_TOKENS, f"bg-{i}") for i in range(7)]
    t0 = time.time()
    while time.time() - t0 < 120 and not all(c.first or c.error or c.end for c in bg):
        time.sleep(0.01)
    # from here on, the only prefill is the probe's
    mixed0, mtok0 = metric("kvtier_mixed_steps_total"), metric("kvtier_mixed_prefill_tokens_total")
    alone0 = metric("kvtier_prefill_alone_tokens_total")
    busy = probe("probe-busy")
    for c in bg:
        c.th.join()
    errs = [c.error for c in bg if c.error]
    check("the 7 background sessions ran without error", not errs, str(errs))
    overlap = all(c.first and c.end and c.first < busy[3] and c.end > busy[4] for c in bg)
    check("all 7 background sessions were generating from before the probe was sent until after its reply",
          overlap, str([(c.first and c.first - busy[3], c.end and c.end - busy[4], c.n) for c in bg]))
    n_dec = busy[2]["completion_tokens"]
    shared = busy[2]["kvtier"]["decode_steps_shared"]
    check(f"every decode step of the busy probe shared its llama_decode with other sessions ({shared} of {n_dec})",
          n_dec > 0 and shared == n_dec, str(busy[2]))
    if expect_mixed:
        d_steps = metric("kvtier_mixed_steps_total") - mixed0
        d_tok = metric("kvtier_mixed_prefill_tokens_total") - mtok0
        d_alone = metric("kvtier_prefill_alone_tokens_total") - alone0
        pt = busy[2]["kvtier"]["prompt_tokens_decoded"]
        # the probe's whole prompt arrived while all 7 generated: each of its chunks but the last
        # of each part (system message, user message, ...) was a mixed step
        check(f"the probe's prefill went into mixed steps ({d_steps:.0f} mixed steps held {d_tok:.0f} of its prefill "
              f"tokens, {d_alone:.0f} went alone as last chunks; it decoded {pt})",
              d_steps >= 2 and d_tok > d_alone and d_tok + d_alone == pt, f"{d_steps} {d_tok} {d_alone} {pt}")
    json.dump({"alone1": a1[:2], "alone2": a2[:2], "busy": busy[:2],
               "mixed_steps": metric("kvtier_mixed_steps_total")}, open(out, "w"))
    finish()


def load(spec):
    f, key = spec.rsplit(":", 1)
    return json.load(open(f))[key]


def compare(name, floor_file, sa, sb, want):
    """Run sa (FILE:KEY) against run sb: equal greedy tokens and every log-prob within the noise
    floor of floor_file (its two runs alone; at least 1e-6, the printing's), or (want "differ",
    a control) not."""
    r = json.load(open(floor_file))
    fl = max([abs(x - y) for x, y in zip(r["alone1"][1], r["alone2"][1])] + [1e-6])
    check(f"{name}: noise floor of one session alone, run twice: tokens equal, max |d logprob| {fl:.2g}",
          r["alone1"][0] == r["alone2"][0], f"{r['alone1'][0]} vs {r['alone2'][0]}")
    (ta, la), (tb, lb) = load(sa), load(sb)
    same_tok = ta == tb
    d = max([abs(x - y) for x, y in zip(la, lb)] + [0.0]) if len(la) == len(lb) else float("inf")
    equal = same_tok and d <= fl
    msg = f"{sa.split('/')[-1]} vs {sb.split('/')[-1]}: tokens {'equal' if same_tok else 'differ'}, max |d logprob| {d:.3g}"
    if want == "equal":
        check(f"{name}: {msg}", equal, f"{ta} vs {tb}")
    else:
        check(f"{name} (control, must differ): {msg}", not equal, f"{ta} vs {tb}")
    finish()


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        run_probe(sys.argv[2], sys.argv[3], "--expect-mixed" in sys.argv)
    elif sys.argv[1] == "compare":
        compare(*sys.argv[2:7])
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
