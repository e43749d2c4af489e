"""serve_fleet_test.py — a fleet as users run it (bench/fleet.py): two `kvtier serve`, each with a
store of its own, one redis-server, HAProxy in front forced to alternate between them
(round-robin), one --redis-secret-file.  Run by cli_serve_fleet.sh: BIN MODEL TMPDIR.

A 20-turn Responses conversation (a document with a planted fact in turn 1, small talk, the fact
asked at turn 20), each turn sending only its input and previous_response_id:
  1. the reference: the same 20 turns on one server alone, in this run;
  2. through the balancer: every turn answers (200), its prompt is the whole conversation
     (input_tokens equal to the reference's turn), consecutive turns are served by different
     servers, and from turn 2 on cached_tokens covers >= 90 % of the prompt on whichever server
     serves it (the KV of the other server's turns comes from Redis);
  3. both servers restarted between turns 10 and 11: the same checks hold after it;
  4. one server killed with SIGKILL after turn 15: the next turns are served by the other, with
     the whole conversation and the same cached share;
  5. turn 20 recalls the fact as the single-server reference does (the number in the reply in
     both runs or in neither: greedy replies of a small model may differ in wording);
  6. the other API key can neither read nor continue the conversation, on either server.
"""
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import fleet as F  # noqa: E402

BIN, MODEL, TMP = sys.argv[1], sys.argv[2], sys.argv[3]
EXTRA = ["--threads", "1", "--budget", "2048", "-c", "4096"]
TURNS = F.conversation(700, 20)
fails = 0


def check(name, cond, why=""):
    global fails
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else f": {why}"), flush=True)
    fails += 0 if cond else 1


def turn(url, k, prev, key="key-a"):
    body = {"model": "m", "input": TURNS[k], "max_output_tokens": 12, "temperature": 0}
    if prev:
        body["previous_response_id"] = prev
    return F.post(url, "/v1/responses", body, key)


def reply_text(o):
    return " ".join(c.get("text", "") for it in o.get("output", []) for c in it.get("content", []) if isinstance(c, dict))


# ---- 1. the reference: one server ------------------------------------------------------------------
one = F.Fleet(BIN, MODEL, os.path.join(TMP, "one"), 1, extra=EXTRA, redis=False)
ref, prev = [], None
try:
    for k in range(20):
        st, o, h, dt = turn(one.url, k, prev)
        if st != 200:
            check(f"reference: turn {k + 1}", False, f"{st} {str(o)[:300]}")
            sys.exit(1)
        ref.append(o)
        prev = o["id"]
finally:
    one.close()
check("reference: 20 turns on one server", len(ref) == 20)

# ---- 2..6. the fleet ----------------------------------------------------------------------------------
f = F.Fleet(BIN, MODEL, os.path.join(TMP, "fleet"), 2, extra=EXTRA)
try:
    got, prev, backends = [], None, []
    bad_prompt, low_cache, errors = [], [], []
    for k in range(20):
        if k == 10:  # 3. both servers restarted between turns 10 and 11
            rcs = [f.stop(0), f.stop(1)]
            f.start(0)
            f.start(1)
            time.sleep(1.2)  # haproxy sees both up again (rise 2 x 500 ms)
            check("both servers stopped cleanly (SIGTERM) and started again on their stores", rcs == [0, 0], str(rcs))
        if k == 15:  # 4. one server killed
            f.kill(0)
        st, o, h, dt = turn(f.url, k, prev)
        if st != 200:
            errors.append((k + 1, st, str(o)[:200]))
            break
        got.append(o)
        prev = o["id"]
        backends.append(h.get("x-kvtier-backend", "?"))
        u, ru = o.get("usage") or {}, ref[k].get("usage") or {}
        if u.get("input_tokens") != ru.get("input_tokens"):
            bad_prompt.append((k + 1, u.get("input_tokens"), ru.get("input_tokens")))
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
        if k >= 1 and cached < 0.9 * u.get("input_tokens", 1):
            low_cache.append((k + 1, cached, u.get("input_tokens"), backends[-1]))
    check("through the balancer: 20 turns, each answered (200)", not errors and len(got) == 20, str(errors))
    check("every turn's prompt is the whole conversation (input_tokens as on one server)", not bad_prompt, str(bad_prompt))
    check("from turn 2 on, cached_tokens >= 90 % of the prompt on whichever server served it", not low_cache, str(low_cache))
    alt = all(backends[k] != backends[k + 1] for k in range(0, 9))
    check("turns 1-10 alternate between the two servers (round-robin)", alt and set(backends[:10]) == {"s0", "s1"}, str(backends))
    alt2 = all(backends[k] != backends[k + 1] for k in range(10, 14))
    check("after the restart (turns 11-15) they alternate again", alt2, str(backends))
    check("after s0 was killed (SIGKILL) turns 16-20 are served by s1", backends[15:] == ["s1"] * 5, str(backends))
    if len(got) == 20:
        a, b = reply_text(got[19]), reply_text(ref[19])
        print(f"     turn 20, fleet: {a!r}; one server: {b!r}")
        check("turn 20 recalls the planted fact as the single-server run does", ("4917" in a) == ("4917" in b), f"{a!r} vs {b!r}")
    # 6. the other key, on both servers (round-robin: two tries reach both; s0 is started again)
    f.start(0)
    time.sleep(1.2)
    seen = set()
    for _ in range(4):
        st, o, h = F.get(f.url, f"/v1/responses/{got[0]['id']}", "key-b")
        st2, o2, h2, _ = F.post(f.url, "/v1/responses", {"model": "m", "input": "And the code?", "previous_response_id": prev,
                                                          "max_output_tokens": 4}, "key-b")
        seen |= {h.get("x-kvtier-backend"), h2.get("x-kvtier-backend")}
        if st != 404 or st2 != 404:
            check("another key: GET and continuing are 404 on every server", False, f"{st} {st2} {str(o2)[:200]}")
            break
    else:
        check("another key: GET and continuing are 404 on every server", seen == {"s0", "s1"}, str(seen))
finally:
    f.close()
# every server's stderr: no sanitizer report (the suite runs this script in the ASan/UBSan build too)
import glob as _glob  # noqa: E402
reports = [f for f in _glob.glob(os.path.join(TMP, "*", "server*.log"))
           if re.search(r"AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:", open(f, errors="replace").read())]
check("no sanitizer report in any server's stderr", not reports, str(reports))
print(f"{fails} failure(s)")
sys.exit(1 if fails else 0)
