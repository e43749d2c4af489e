"""serve_deadline_test.py — --request-timeout-s (issue #24): a prompt still prefilling at its
deadline gets 408 request_timeout within a chunk of it, and leaves its session exactly as before
(the same question then gets the log-probabilities a fresh session gives it, in this run: a
fragment of the stopped message left in the session changed them by ~0.1-0.5 nats); a reply
still generating at its deadline ends with finish_reason "length".

Usage: serve_deadline_test.py BASE_URL   (the server: --request-timeout-s 2 -c 16384 --budget 512,
no keys; tests/server/cli_serve_hostile.sh)
"""
import sys
import time

from serve_client import check, finish, init, raw

init(sys.argv[1], None)
CHAT = "/v1/chat/completions"
Q = {"messages": [{"role": "user", "content": "Hi, what is a river?"}], "max_tokens": 8, "temperature": 0, "logprobs": True}


def lps(js):
    return [x["logprob"] for x in js["choices"][0]["logprobs"]["content"]]


st, _, ref = raw("POST", CHAT, Q, headers={"X-Session-Id": "fresh"})
check("reference: a fresh session answers", st == 200, str(ref)[:200])
doc = " ".join(f"word{i} stone river" for i in range(2000))  # ~13k tokens: seconds of prefill
t0 = time.time()
st, _, js = raw("POST", CHAT, {"messages": [{"role": "user", "content": doc}], "max_tokens": 4},
                headers={"X-Session-Id": "cut"})
dt = time.time() - t0
err = js.get("error", {}) if isinstance(js, dict) else {}
check(f"a prompt prefilling past --request-timeout-s 2 -> 408 request_timeout in {dt:.1f} s",
      st == 408 and err.get("code") == "request_timeout" and "prefill" in err.get("message", "") and dt < 4, f"{st} {js}")
st, _, js = raw("POST", CHAT, Q, headers={"X-Session-Id": "cut"})
same = st == 200 and st == 200 and js["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"] and \
    all(abs(a - b) < 1e-4 for a, b in zip(lps(js), lps(ref)))
check("... and its session is as before: the same question, the same prompt tokens and log-probabilities as a fresh session",
      same, f"{js.get('usage', {}).get('prompt_tokens')} vs {ref['usage']['prompt_tokens']}; {lps(js) if st == 200 else js} vs {lps(ref)}")
t0 = time.time()
# the end-of-turn token banned: the reply must run into the deadline, whatever this seed samples
eot = raw("POST", "/tokenize", {"content": "<|im_end|>", "parse_special": True})[2].get("tokens", [])
st, _, js = raw("POST", CHAT, {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 4000,
                               "temperature": 0.8, "seed": 1, "logit_bias": {str(t): -100 for t in eot}})
dt = time.time() - t0
check(f"a reply generating past the deadline ends: 200, finish_reason length, {js.get('usage', {}).get('completion_tokens')} tokens in {dt:.1f} s",
      st == 200 and js["choices"][0]["finish_reason"] == "length" and js["usage"]["completion_tokens"] < 4000 and dt < 4,
      str(js)[:300])
finish()
