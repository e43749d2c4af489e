"""serve_compat_test.py — `kvtier serve` as a llama-server drop-in, started by
tests/server/cli_serve_compat.sh with llama-server's own flags (--alias code,tinyllama-2 --tags
--temp 0.8 --seed 42 -n 64 -b 32 --ctx-size 512 --parallel 2 --cors-origins localhost ...) on the
chat model (SmolLM2-135M-Instruct).  Checks llama-server's endpoints (routes without /v1, native
/completion and its stream, /tokenize, /detokenize, /apply-template, /props, /slots, CORS,
X-Api-Key, llamacpp:* metrics) and Anthropic's Messages API through the official `anthropic`
client.  References are computed in the same run (greedy text through another route, token ids
detokenized back, count_tokens against the reply's usage); nothing asserts what the model writes.
The model's numbers are compared only with a reference decoded the same way (the same prompt tokens
in the same ubatches over the same KV: equal on any CPU), never across two decode paths (a cached
prompt against a whole prefill, a session against a scratch sequence, batched against alone): those
differ with the CPU's float summation order, and greedy text with them.
Prints "ok   NAME" / "FAIL NAME: why"; exit status = failures.

  python serve_compat_test.py BASE_URL KEY KEY2
"""
import json
import re
import sys
import threading
import time

from serve_client import check, finish, init, raw

import anthropic
import openai

BASE, KEY, KEY2 = sys.argv[1:4]
init(BASE, KEY)


def stream_events(path, body, key="default"):
    """The data objects of a server-sent-event reply (and the raw text)."""
    st, _, txt = raw("POST", path, body, key=key)
    if not isinstance(txt, str):
        return st, [], json.dumps(txt)
    ev = [json.loads(l[6:]) for l in txt.splitlines() if l.startswith("data: ") and l[6:] != "[DONE]"]
    return st, ev, txt


# ---- health, auth, models ---------------------------------------------------------------
for p in ("/health", "/v1/health"):
    st, _, b = raw("GET", p, key=None)
    check(f"GET {p} without a key -> 200", st == 200 and b.get("status") == "ok", f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": "Hi", "n_predict": 2}, key=None)
check("no key -> 401 typed authentication_error (llama-server's)", st == 401 and b["error"]["type"] == "authentication_error",
      f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": "Hi", "n_predict": 2}, key=None, headers={"X-Api-Key": KEY})
check("X-Api-Key: KEY is accepted (Anthropic's clients send it)", st == 200 and "content" in b, f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": "Hi", "n_predict": 2}, key=None, headers={"X-Api-Key": "wrong"})
check("a wrong X-Api-Key -> 401", st == 401, st)
for p in ("/models", "/v1/models"):
    st, _, b = raw("GET", p)
    m = b["data"][0] if st == 200 else {}
    check(f"GET {p}: id is the first --alias in byte order, aliases and tags listed",
          m.get("id") == "code" and set(m.get("aliases", [])) == {"code", "tinyllama-2"} and set(m.get("tags", [])) == {"chat", "small"},
          f"{st} {b}")
check("--embedding was accepted: /embeddings answers 501", raw("POST", "/embeddings", {"input": "x"})[0] == 501)

# ---- /props, /slots ---------------------------------------------------------------------
st, _, props = raw("GET", "/props")
dg = props.get("default_generation_settings", {}) if st == 200 else {}
check("GET /props: the server's defaults (--seed 42, --temp 0.8, -n 64), the model path, a slot's context = --budget",
      st == 200 and dg["params"]["seed"] == 42 and abs(dg["params"]["temperature"] - 0.8) < 1e-6 and dg["params"]["n_predict"] == 64
      and props["model_path"].endswith(".gguf") and dg["n_ctx"] == props["kvtier"]["budget"] and props["total_slots"] >= 1,
      f"{st} {props}")
budget = props.get("kvtier", {}).get("budget")
check("-c 512 --parallel 2 without --budget: llama-server's slot of 256 tokens as the budget, 2 sessions, said in the log",
      budget == 256 and props["total_slots"] == 2, props.get("kvtier"))
st, _, slots = raw("GET", "/slots")
check("GET /slots: one entry per session slot, each with n_ctx = --budget and no params",
      st == 200 and len(slots) == props["total_slots"] and all(s["n_ctx"] == budget and "params" not in s for s in slots),
      f"{st} {slots}")
check("POST /props -> 405", raw("POST", "/props", {})[0] == 405)

# ---- POST /slots/N?action=erase (save, restore: 501) ---------------------------------------
# The reference is the same request before the erase: a completion sent twice reuses its cached
# prompt (the control: without an erase the cache is there), after the erase it decodes it all.
def native_prompt_n(key="default"):
    st, _, b = raw("POST", "/completion", {"prompt": "What is the capital of France?", "n_predict": 2, "id_slot": 1,
                                           "cache_prompt": True}, key=key)
    return (b["timings"]["prompt_n"], b["tokens_evaluated"]) if st == 200 else (st, b)


def sessions(key="default"):
    return [s["id"] for s in raw("GET", "/v1/sessions", key=key)[2]["data"]]


native_prompt_n()
pn, n_eval = native_prompt_n()
check("control: the same completion again reuses its cached prompt", pn < n_eval, (pn, n_eval))
st, _, b = raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "id_slot": 1})
check("a chat with id_slot 1 runs in the caller's session slot-1", st == 200 and "slot-1" in sessions(), sessions())
st, _, b = raw("POST", "/slots/1?action=erase", key=KEY2)
check("another key's erase of slot 1 erases its own (nothing): the caller's session and cache stay",
      st == 200 and b == {"id_slot": 1, "n_erased": 0} and "slot-1" in sessions() and native_prompt_n()[0] < n_eval, f"{st} {b}")
st, _, b = raw("POST", "/slots/1?action=erase")
check("POST /slots/1?action=erase: llama-server's reply, the session's and the cached prompt's tokens counted",
      st == 200 and b.get("id_slot") == 1 and b.get("n_erased", 0) >= n_eval, f"{st} {b}")
check("after the erase the session slot-1 is gone", "slot-1" not in sessions(), sessions())
pn2 = native_prompt_n()
check("after the erase the completion decodes its whole prompt again", pn2 == (n_eval, n_eval), pn2)
st, _, b = raw("POST", "/slots/1?action=erase", {})
check("an empty slot erased again -> 200, n_erased 0 (a body of {} is taken)", st == 200 and b["n_erased"] >= 0, f"{st} {b}")
for path, want, param in (("/slots/0?action=save", 501, "action"), ("/slots/0?action=restore", 501, "action"),
                          ("/slots/2?action=erase", 400, "id_slot"), ("/slots/-1?action=erase", 400, "id_slot"),
                          ("/slots/1x?action=erase", 400, "id_slot"), ("/slots/" + "9" * 40 + "?action=erase", 400, "id_slot"),
                          ("/slots/1", 400, "action"), ("/slots/1?action=ERASE", 400, "action"),
                          ("/slots/1?action=%FF%00%1b", 400, "action")):
    st, _, b = raw("POST", path)
    e = b.get("error", {}) if isinstance(b, dict) else {}
    check(f"POST {path[:40]} -> {want} naming {param}", st == want and e.get("param") == param and e.get("message"), f"{st} {b}")
st, _, b = raw("POST", "/slots/1?action=save", {"filename": "slot1.bin"})
check("save with llama-server's filename -> 501 saying where kvtier keeps a session's blocks",
      st == 501 and "block store" in b["error"]["message"], f"{st} {b}")
st, _, b = raw("POST", "/slots/1?action=erase", {"filename": "slot1.bin"})
check("erase with a field -> 400 naming it (never ignored)", st == 400 and b["error"]["param"] == "filename", f"{st} {b}")
st, _, b = raw("POST", "/slots/1?action=erase", b"[1, 2]")
check("erase with a body that is not an object -> 400", st == 400, f"{st} {b}")
st, _, b = raw("POST", "/slots/1?action=erase", b"{" * 100000)
check("erase with a deep body -> 400, the server answers", st == 400 and raw("GET", "/health")[0] == 200, f"{st}")
st, _, b = raw("POST", "/slots/1?action=erase", b"{}" + b" " * (9 << 20))
check("erase with a body over --max-body-mb -> 413, the server answers", st == 413 and raw("GET", "/health")[0] == 200, f"{st}")
check("GET /slots/1 -> 405", raw("GET", "/slots/1?action=erase")[0] == 405)
check("POST /slots/1?action=erase without a key -> 401", raw("POST", "/slots/1?action=erase", key=None)[0] == 401)
# a generation running in slot 1: its erase waits for nothing and is refused, the reply unharmed
res = {}
th = threading.Thread(target=lambda: res.update(r=raw("POST", "/v1/chat/completions", {
    "messages": [{"role": "user", "content": "Count from one to one hundred."}], "max_tokens": 96, "temperature": 0,
    "id_slot": 1, "stream": False})))
th.start()
busy = None
for _ in range(400):
    busy = [s for s in raw("GET", "/v1/sessions")[2]["data"] if s["id"] == "slot-1" and s["busy"]]
    if busy:
        break
    time.sleep(0.01)
st, _, b = raw("POST", "/slots/1?action=erase")
th.join()
check("erase while slot 1 generates -> 409 session_busy, the generation finishes",
      bool(busy) and st == 409 and b["error"]["code"] == "session_busy", f"{st} {b} (busy seen: {bool(busy)})")
check("... and its reply is whole", res["r"][0] == 200 and res["r"][2]["choices"][0]["message"]["content"], res["r"][:1])
check("... then the erase succeeds", raw("POST", "/slots/1?action=erase")[0] == 200)

# ---- /tokenize, /detokenize, /apply-template -----------------------------------------------
text = "What is the capital of France ?"
st, _, b = raw("POST", "/tokenize", {"content": text})
toks = b.get("tokens", []) if st == 200 else []
check("POST /tokenize: token ids", st == 200 and len(toks) > 5 and all(isinstance(t, int) for t in toks), f"{st} {b}")
st, _, b = raw("POST", "/detokenize", {"tokens": toks})
check("POST /detokenize gives the text back", st == 200 and b.get("content", "").strip() == text, f"{st} {b}")
st, _, b = raw("POST", "/tokenize", {"content": "unicode 媽 and emoji 🤗", "with_pieces": True})
pieces = b.get("tokens", []) if st == 200 else []
joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
check("with_pieces: each id with its piece (a partial character as its bytes); the pieces make the text",
      st == 200 and all("id" in p and "piece" in p for p in pieces) and joined.decode() == "unicode 媽 and emoji 🤗", f"{st} {b}")
st, _, b = raw("POST", "/tokenize", {})
check("POST /tokenize without content -> 400 naming it", st == 400 and b["error"]["param"] == "content", f"{st} {b}")
st, _, b = raw("POST", "/detokenize", {"tokens": [1, 10 ** 9]})
check("POST /detokenize with an id outside the vocabulary -> 400 naming it", st == 400 and "tokens[1]" in b["error"]["message"],
      f"{st} {b}")
st, _, b = raw("POST", "/detokenize", {"tokens": "abc"})
check("POST /detokenize with a string -> 400", st == 400 and b["error"]["param"] == "tokens", f"{st} {b}")
st, _, b = raw("POST", "/apply-template", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
check("POST /apply-template: the chat template's prompt with the assistant prefix (ChatML here)",
      st == 200 and b["prompt"].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") and "Be brief." in b["prompt"],
      f"{st} {b}")

# ---- native /completion ---------------------------------------------------------------------
# Greedy text is compared only between requests decoded the same way: cache_prompt false (llama-server's)
# in each, so that none reuses a prompt another left in the completions' prompt cache and every one
# decodes its whole prompt alone in a fresh scratch sequence.  A cached prompt decodes its last token
# alone instead, and a batched step decodes several sequences' rows in one ubatch: other float
# summation orders, whose top probabilities differed by up to 0.016 on an AMD EPYC (greedy text can
# then differ); those paths get references decoded their way (the prompt cache, n > 1, below).
P = "The capital of France is"
st, _, n1 = raw("POST", "/completion", {"prompt": P, "n_predict": 8, "temperature": 0, "cache_prompt": False, "return_tokens": True})
check("POST /completion: content, stop true, tokens_predicted <= n_predict, stop_type, timings",
      st == 200 and isinstance(n1["content"], str) and n1["stop"] is True and 0 < n1["tokens_predicted"] <= 8
      and n1["stop_type"] in ("limit", "eos", "word") and n1["timings"]["predicted_n"] == n1["tokens_predicted"]
      and n1["timings"]["prompt_n"] + n1["timings"]["cache_n"] == n1["tokens_evaluated"], f"{st} {n1}")
st, _, d = raw("POST", "/detokenize", {"tokens": n1.get("tokens", [])})
check("return_tokens: the ids detokenize to the content", st == 200 and d["content"] == n1["content"], f"{d} vs {n1.get('content')}")
st, _, o1 = raw("POST", "/v1/completions", {"prompt": P, "max_tokens": 8, "temperature": 0, "cache_prompt": False})
check("the same greedy text as /v1/completions (OpenAI's shape there)", st == 200 and o1["choices"][0]["text"] == n1["content"],
      f"{o1} vs {n1.get('content')}")
st, ev, txt = stream_events("/completion", {"prompt": P, "n_predict": 8, "temperature": 0, "cache_prompt": False, "stream": True})
check("stream: every event has a boolean stop; the last one stop true with timings; no [DONE]",
      st == 200 and ev and all(isinstance(e["stop"], bool) for e in ev) and ev[-1]["stop"] and "timings" in ev[-1]
      and not any(e["stop"] for e in ev[:-1]) and "[DONE]" not in txt, txt[-400:])
check("stream: the pieces make the same greedy text", "".join(e["content"] for e in ev) == n1["content"],
      f"{''.join(e['content'] for e in ev)!r} vs {n1['content']!r}")
st, _, pt = raw("POST", "/tokenize", {"content": P, "add_special": True})
st, _, n2 = raw("POST", "/completion", {"prompt": pt["tokens"], "n_predict": 8, "temperature": 0, "cache_prompt": False})
check("a prompt of token ids (the tokenizer's own) gives the same greedy text", st == 200 and n2["content"] == n1["content"],
      f"{st} {n2}")
st, _, b = raw("POST", "/completion", {"prompt": [1, 2, 10 ** 8], "n_predict": 4})
check("a token id outside the vocabulary -> 400 naming prompt[2]", st == 400 and "prompt[2]" in b["error"]["message"], f"{st} {b}")
# logit_bias: ban the greedy reply's first token; the reply then starts otherwise (control: the
# empty bias leaves it as it was)
first = n1.get("tokens", [None])[0]
for name, lb in (("OpenAI's {\"ID\": -100}", {str(first): -100}), ("llama-server's [[ID, false]]", [[first, False]])):
    st, _, b = raw("POST", "/completion", {"prompt": P, "n_predict": 4, "temperature": 0, "cache_prompt": False, "return_tokens": True, "logit_bias": lb})
    check(f"logit_bias {name} bans the greedy first token", st == 200 and b["tokens"] and b["tokens"][0] != first, f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": P, "n_predict": 4, "temperature": 0, "cache_prompt": False, "return_tokens": True, "logit_bias": {}})
check("control: an empty logit_bias leaves the greedy reply as it was", st == 200 and b["tokens"][:1] == [first], f"{st} {b}")
piece = raw("POST", "/detokenize", {"tokens": [first]})[2]["content"]
st, _, b = raw("POST", "/completion", {"prompt": P, "n_predict": 4, "temperature": 0, "cache_prompt": False, "return_tokens": True,
                                        "logit_bias": [[piece, -100]]})
check("logit_bias by text (llama-server's): the text's tokens are banned", st == 200 and b["tokens"][0] != first, f"{piece!r} {st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": P, "logit_bias": {"99999999": -5}})
check("logit_bias with a token id outside the vocabulary -> 400 naming it", st == 400 and b["error"]["param"] == "logit_bias"
      and "99999999" in b["error"]["message"], f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": P, "logit_bias": {str(first): 500}})
check("logit_bias 500 -> 400 (the range is -100..100)", st == 400 and b["error"]["param"] == "logit_bias", f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": P, "n_predict": 0})
check("n_predict 0 -> 400 naming it", st == 400 and b["error"]["param"] == "n_predict", f"{st} {b}")
st, ev, txt = stream_events("/completion", {"prompt": P, "n_predict": 8, "temperature": 0, "cache_prompt": False, "stream": True, "n_probs": 3})
sp = [c for e in ev for c in e.get("completion_probabilities", [])]
check("n_probs streamed: every token's entry arrives once, with its alternatives, and the entries spell the text",
      st == 200 and len(sp) == ev[-1]["tokens_predicted"] and all(len(c["top_logprobs"]) == 3 for c in sp)
      and "".join(c["token"] for c in sp) == n1["content"], txt[:500])
st, _, b = raw("POST", "/completion", {"prompt": P, "n_probs": 500})
check("n_probs 500 -> 400 naming it", st == 400 and b["error"]["param"] == "n_probs", f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": P, "temperature": 0, "cache_prompt": False})
check("-n 64 is the limit of a request that gives none (llama-server's)", st == 200 and b["generation_settings"]["n_predict"] == 64
      and b["tokens_predicted"] <= 64, f"{st} {b.get('generation_settings')}")
st, _, b = raw("POST", "/completion", {"prompt": P, "n_predict": 100, "temperature": 0, "cache_prompt": False})
check("a request's own n_predict above -n is honoured (as llama-server does)", st == 200 and b["generation_settings"]["n_predict"] == 100,
      f"{st} {b.get('generation_settings')}")
st, _, b = raw("POST", "/completion", {"prompt": {"prompt_string": P}, "n_predict": 8, "temperature": 0, "cache_prompt": False})
check("a prompt object {prompt_string} (llama.cpp's) gives the same greedy text", st == 200 and b["content"] == n1["content"], f"{st} {b}")
half = len(pt["tokens"]) // 2
mixed = pt["tokens"][:half] + [raw("POST", "/detokenize", {"tokens": pt["tokens"][half:]})[2]["content"]]
st, _, b = raw("POST", "/completion", {"prompt": mixed, "n_predict": 8, "temperature": 0, "cache_prompt": False})
check("a prompt of ids and text in one sequence runs", st == 200 and isinstance(b["content"], str), f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": [P, pt["tokens"], {"prompt_string": P}], "n_predict": 8, "temperature": 0,
                                       "cache_prompt": False, "return_tokens": True})
check("several prompts on /completion (text, ids, object): a list, one greedy reply each, each starting with the single "
      "prompt's first token (each prompt is prefilled alone as n1's was; the later tokens are decoded in batched steps "
      "beside the other prompts, another decode path than n1's steps alone)",
      st == 200 and isinstance(b, list) and len(b) == 3 and all(x["content"] and x["tokens"][:1] == n1["tokens"][:1] for x in b)
      and [x["index"] for x in b] == [0, 1, 2], f"{st} {str(b)[:400]}")
st, _, b = raw("POST", "/completion", {"prompt": [P, [1, 10 ** 8]], "n_predict": 4})
check("one bad prompt of several -> 400 naming it, nothing else kept running", st == 400 and "prompt" in b["error"]["message"],
      f"{st} {b}")
st, _, b = raw("POST", "/v1/completions", {"prompt": [P, P], "max_tokens": 4})
check("several prompts on /v1/completions -> 400 (one prompt per request there)", st == 400 and b["error"]["param"] == "prompt",
      f"{st} {b}")
st, _, b = raw("POST", "/chat/completions", {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "Hi"}],
                                             "max_tokens": 2, "verbose": True})
check("\"verbose\": true -> __verbose.prompt, the template's text", st == 200 and "Book" in b.get("__verbose", {}).get("prompt", "")
      and b["__verbose"]["prompt"].endswith("<|im_start|>assistant\n"), f"{st} {b}")
st, _, b2 = raw("POST", "/chat/completions/input_tokens", {"messages": [{"role": "system", "content": "Book"},
                                                                       {"role": "user", "content": "Hi"}]})
n_tpl = len(raw("POST", "/tokenize", {"content": b.get("__verbose", {}).get("prompt", ""), "add_special": True,
                                      "parse_special": True})[2]["tokens"])
check("POST /chat/completions/input_tokens = the template text's tokens", st == 200 and b2.get("input_tokens") == n_tpl,
      f"{b2} vs {n_tpl}")
# --seed 42 and --temp 0.8: a request without them is sampled at 0.8 with seed 42, every time (cache_prompt
# false: the second would otherwise decode only the prompt's last token, over the first one's cached KV)
outs = [raw("POST", "/completion", {"prompt": "Once upon a time", "n_predict": 24, "cache_prompt": False})[2]["content"]
        for _ in range(2)]
check("--seed: two requests without a seed, each decoding its whole prompt, give the same sampled text", outs[0] == outs[1], outs)
other = [raw("POST", "/completion", {"prompt": "Once upon a time", "n_predict": 24, "seed": s, "cache_prompt": False})[2]["content"]
         for s in (7, 8, 9)]
check("control: other seeds give other text (the default seed is a seed, the sampling is not greedy)",
      any(o != outs[0] for o in other), other)
st, _, b = raw("POST", "/completion", {"prompt": "the quick brown fox " * 80, "n_predict": 8})
check("a completion beyond the budget (no session to evict from) -> 400 exceed_context_size_error with n_prompt_tokens, n_ctx",
      st == 400 and b["error"]["type"] == "exceed_context_size_error" and b["error"]["n_prompt_tokens"] > budget
      and b["error"]["n_ctx"] == budget, f"{st} {b}")
# no n_predict: the server's -n 64 (this server's) is kept to, as llama-server keeps to its -n: a
# prompt that leaves less than 64 of the budget is a 400 (llama.cpp's test_nocache_long_input_prompt);
# one that leaves room runs (a server given no limit fills the budget instead: serve_fields_walk_test)
st, _, b = raw("POST", "/completion", {"prompt": "I believe the meaning of life is" * 32, "cache_prompt": False})
check("no n_predict under the server's -n 64, a prompt leaving less than 64 of the budget -> 400 exceed_context_size_error",
      st == 400 and b["error"]["type"] == "exceed_context_size_error", f"{st} {str(b)[:200]}")
st, _, b = raw("POST", "/completion", {"prompt": "Write a very long book.", "temperature": 0})
check("no n_predict, a short prompt -> 200, at most the server's -n 64 tokens",
      st == 200 and 0 < b["tokens_predicted"] <= 64, f"{st} {str(b)[:200]}")
st, _, b = raw("POST", "/completions", {"prompt": P, "n_predict": 4})
check("/completions without /v1 is llama-server's native API", st == 200 and "content" in b and "choices" not in b, f"{st} {b}")

# ---- routes without /v1 through the openai client -------------------------------------------
A = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=300)  # no /v1: llama-server serves both
r = A.chat.completions.create(model="code", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
check("openai client with a base URL without /v1: POST /chat/completions", r.choices[0].message.content is not None, str(r))
check("the reply names the model by its --alias id", r.model == "code", r.model)

# ---- top_logprobs / n_probs: the most likely tokens at each position ---------------------------
# the stream's reference is decoded the same way: each request opens a session of its own (X-Session-Id)
# and decodes the whole conversation; without it the second would find its message in the first's
# session (a retried turn) and decode only the assistant prefix, over KV decoded in other ubatches
r = A.chat.completions.create(model="code", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0,
                              logprobs=True, top_logprobs=5, extra_headers={"X-Session-Id": "logprobs-plain"})
lc = r.choices[0].logprobs.content if r.choices[0].logprobs else []
import math
check("top_logprobs 5: five alternatives per token, best first, the greedy token the best, probabilities summing to <= 1",
      lc and all(len(t.top_logprobs) == 5 and t.top_logprobs[0].token == t.token
                 and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
                 and all(t.top_logprobs[k].logprob >= t.top_logprobs[k + 1].logprob for k in range(4))
                 and sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1.0 + 1e-4 for t in lc)
      and "".join(t.token for t in lc) == r.choices[0].message.content, str(lc)[:600])
ent, txt_s = [], ""
for ch in A.chat.completions.create(model="code", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
                                    temperature=0, logprobs=True, top_logprobs=5, stream=True,
                                    extra_headers={"X-Session-Id": "logprobs-stream"}):
    if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content:
        ent += ch.choices[0].logprobs.content
    if ch.choices and ch.choices[0].delta.content:
        txt_s += ch.choices[0].delta.content
check("logprobs streamed (a fresh session, as the reply without stream): the same entries, spelling the streamed text",
      [(t.token, round(t.logprob, 4)) for t in ent] == [(t.token, round(t.logprob, 4)) for t in lc]
      and "".join(t.token for t in ent) == txt_s, f"{[t.token for t in ent]} vs {[t.token for t in lc]}")
st, _, b = raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})
check("top_logprobs without logprobs -> 400 naming it", st == 400 and b["error"]["param"] == "top_logprobs", f"{st} {b}")
st, _, b = raw("POST", "/completion", {"prompt": P, "n_predict": 5, "temperature": 0, "n_probs": 4, "return_tokens": True})
cp = b.get("completion_probabilities", []) if st == 200 else []
check("n_probs 4 (native): completion_probabilities per token with its id and four alternatives, the greedy one first",
      len(cp) == b.get("tokens_predicted") and all(c["id"] == t and len(c["top_logprobs"]) == 4 and c["top_logprobs"][0]["id"] == t
                                                   and isinstance(c["bytes"], list) for c, t in zip(cp, b.get("tokens", []))),
      f"{st} {str(b)[:600]}")

# ---- assistant prefill: the reply continues the final assistant message ----------------------
# (a prefilled chat runs as a completion of the template's text in a scratch sequence; cache_prompt false in
# both, so that each decodes its whole prompt alone: the same decode, the same greedy text on any CPU)
msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]
pf = A.chat.completions.create(model="code", messages=msgs, max_tokens=8, temperature=0, extra_body={"cache_prompt": False})
tmpl = raw("POST", "/apply-template", {"messages": msgs[:1]})[2]["prompt"]
ids_ = raw("POST", "/tokenize", {"content": tmpl + msgs[1]["content"], "add_special": True, "parse_special": True})[2]["tokens"]
ref = raw("POST", "/completion", {"prompt": ids_, "n_predict": 8, "temperature": 0, "cache_prompt": False})[2]
check("assistant prefill: the reply is the greedy continuation of the template's text ending in the prefill (the same "
      "prompt tokens, both decoded whole)",
      pf.choices[0].message.content == ref["content"] and pf.usage.prompt_tokens == len(ids_),
      f"{pf.choices[0].message.content!r} vs {ref['content']!r}, {pf.usage.prompt_tokens} vs {len(ids_)} prompt tokens")
st, _, b = raw("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "continue_final_message": True,
                                                "add_generation_prompt": True})
check("continue_final_message with add_generation_prompt -> 400", st == 400 and b["error"]["param"] == "continue_final_message",
      f"{st} {b}")
st, _, b = raw("POST", "/v1/chat/completions", {"messages": msgs + [{"role": "assistant", "content": "x"}], "max_tokens": 4})
check("two final assistant messages -> 400 (one can be continued)", st == 400 and b["error"]["param"] == "messages", f"{st} {b}")
st, _, b = raw("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "continue_final_message": False})
check("continue_final_message false with a final assistant message -> 400 (nothing to answer)", st == 400, f"{st} {b}")

st, ev, txt = stream_events("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True,
                                                   "stream_options": {"include_usage": True}, "timings_per_token": True})
uc = [e for e in ev if not e.get("choices")]
check("timings_per_token: the usage chunk carries llama-server's timings (predicted_n = the reply's tokens); the role chunk's "
      "content is null", st == 200 and ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": None} and uc
      and uc[-1]["timings"]["predicted_n"] == uc[-1]["usage"]["completion_tokens"], txt[-600:])

# ---- n > 1: several choices ---------------------------------------------------------------
# The first choice runs in the request's session, the others are completions of the template's text in
# scratch sequences, side by side.  Each first-token distribution is compared with a reference decoded
# its way: the first choice's with the same conversation alone in a fresh session (X-Session-Id on both),
# the others' with that text's token ids on /completion; cache_prompt false everywhere, so that no choice
# starts from a prompt another left in the prompt cache.  Then the numbers are equal bit for bit on any
# CPU.  (The first choice against the others, or any choice's later tokens, decoded in batched steps,
# would compare two decode paths: not compared.)
conv = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
lpq = {"max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 5, "cache_prompt": False}
st, _, g1 = raw("POST", "/v1/chat/completions", {"messages": conv, **lpq}, headers={"X-Session-Id": "n-one"})
st2, _, g3 = raw("POST", "/v1/chat/completions", {"messages": conv, "n": 3, **lpq}, headers={"X-Session-Id": "n-three"})
ch = g3.get("choices", []) if st2 == 200 else []
tmpl_c = raw("POST", "/apply-template", {"messages": conv})[2]["prompt"]
ids_c = raw("POST", "/tokenize", {"content": tmpl_c, "add_special": True, "parse_special": True})[2]["tokens"]
st3, _, gc = raw("POST", "/completion", {"prompt": ids_c, "n_predict": 1, "temperature": 0, "n_probs": 5, "cache_prompt": False})


def first_dist(choice):
    """The first generated position's five most likely tokens and their log-probabilities, best first."""
    return [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"][0]["top_logprobs"]]


def same_dist(a, b):
    """The same tokens in the same order with the same log-probabilities (1e-6: the printing's)."""
    return len(a) == len(b) > 0 and all(x[0] == y[0] and abs(x[1] - y[1]) < 1e-6 for x, y in zip(a, b))


d1 = first_dist(g1["choices"][0]) if st == 200 else []
dc = [(t["token"], t["logprob"]) for t in gc["completion_probabilities"][0]["top_logprobs"]] if st3 == 200 else []
check("n 3 (greedy): three choices indexed 0..2; the first's first-token distribution is the single request's in a fresh "
      "session, the others' that of the template's text decoded whole on /completion (each reference decoded the "
      "choice's way: equal bit for bit); usage their sum",
      st == st3 == 200 and [c["index"] for c in ch] == [0, 1, 2] and all(c["finish_reason"] for c in ch)
      and same_dist(first_dist(ch[0]), d1) and all(same_dist(first_dist(c), dc) for c in ch[1:])
      and g3["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in ch)
      and g3["usage"]["total_tokens"] == g3["usage"]["prompt_tokens"] + g3["usage"]["completion_tokens"],
      f"{d1} / {dc} vs {[first_dist(c) for c in ch]}; {g3.get('usage')}")
st, _, s3 = raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a story about a cat."}],
                                                 "max_tokens": 16, "temperature": 1.0, "seed": 5, "n": 3})
texts = [c["message"]["content"] for c in s3.get("choices", [])] if st == 200 else []
check("n 3 sampled with a seed: each choice draws its own numbers (seed + i), so the choices differ",
      len(texts) == 3 and len(set(texts)) >= 2, texts)
st, _, b = raw("POST", "/v1/completions", {"prompt": P, "max_tokens": 4, "temperature": 0, "n": 2})
check("n 2 on /v1/completions: two text choices, usage their sum", st == 200 and [c["index"] for c in b["choices"]] == [0, 1]
      and all(c["text"] and c["finish_reason"] for c in b["choices"]) and b["usage"]["completion_tokens"] <= 8
      and b["usage"]["total_tokens"] == b["usage"]["prompt_tokens"] + b["usage"]["completion_tokens"], f"{st} {b}")
for body, why in (({"n": 2, "stream": True}, "streamed"), ({"n": 40}, "above 16"), ({"n": 0}, "0"), ({"n": "2"}, "a string"),
                  ({"n": 2, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
                   "with tools")):
    st, _, b = raw("POST", "/v1/chat/completions", {"messages": conv, "max_tokens": 2, **body})
    check(f"n {why} -> 400 naming n", st == 400 and b["error"]["param"] == "n", f"{st} {b}")

# ---- post_sampling_probs: the probabilities after the samplers --------------------------------
# cache_prompt false in every request: each decodes the whole prompt the same way, so the model's
# probabilities are the same numbers in all of them (the second would otherwise decode only the prompt's
# last token over the first's cached KV: 3e-3 apart on an AMD EPYC).  The 1e-3 left is the two
# renormalisations' rounding (llama.cpp's in float, this script's from printed log-probabilities).
PS = {"prompt": "Today was the day. Today I would finally become a", "n_probs": 10, "n_predict": 4, "temperature": 1.0,
      "top_k": 5, "top_p": 1, "min_p": 0, "seed": 11, "return_tokens": True, "cache_prompt": False}
st, _, pre = raw("POST", "/completion", PS)
st2, _, post = raw("POST", "/completion", {**PS, "post_sampling_probs": True})
ok = st == st2 == 200 and pre["tokens"] == post["tokens"]
why = ""
for a, b in zip(pre.get("completion_probabilities", []), post.get("completion_probabilities", [])):
    top5 = a["top_logprobs"][:5]
    z = sum(math.exp(t["logprob"]) for t in top5)
    want = {t["id"]: math.exp(t["logprob"]) / z for t in top5}  # top_k 5 at temperature 1: the five renormalised
    got = {t["id"]: t["prob"] for t in b["top_probs"]}
    ok = ok and set(got) == set(want) and all(abs(got[k] - want[k]) < 1e-3 for k in got) and abs(b["prob"] - got.get(b["id"], -1)) < 1e-6
    why = f"{got} vs {want}"
check("post_sampling_probs: prob / top_probs are the model's probabilities renormalised over what top_k 5 kept (computed here "
      "from the same request without it, decoded the same way); the same seed samples the same tokens",
      ok and len(pre["completion_probabilities"]) == 4, why)
st, _, g = raw("POST", "/completion", {**PS, "temperature": 0, "post_sampling_probs": True})
check("post_sampling_probs greedy: the token alone, probability 1",
      st == 200 and all(c["prob"] == 1 and len(c["top_probs"]) == 1 and c["top_probs"][0]["id"] == c["id"]
                        for c in g["completion_probabilities"]), str(g.get("completion_probabilities"))[:300])
st, _, mp = raw("POST", "/completion", {**PS, "top_k": 0, "min_p": 0.2, "n_predict": 1, "post_sampling_probs": True})
a = pre["completion_probabilities"][0]["top_logprobs"] if pre.get("completion_probabilities") else []
pmax = math.exp(a[0]["logprob"]) if a else 1
keep = {t["id"] for t in a if math.exp(t["logprob"]) >= 0.2 * pmax}
got = {t["id"] for t in mp["completion_probabilities"][0]["top_probs"]} if st == 200 else set()
check("min_p 0.2 (llama.cpp's min_p sampler): the candidates left are those with at least 0.2 x the best one's probability",
      st == 200 and got == keep and 0 < len(keep) < 10, f"{got} vs {keep}")
gs = raw("POST", "/completion", {"prompt": P, "n_predict": 1})[2].get("generation_settings", {})
check("--top-k 40 --min-p 0.05 (llama-server's flags): a request that sends none samples with them (generation_settings)",
      gs.get("top_k") == 40 and abs(gs.get("top_p", 0) - 1) < 1e-6 and abs(gs.get("min_p", 0) - 0.05) < 1e-6, str(gs))
st, _, b = raw("POST", "/v1/chat/completions", {"messages": conv, "max_tokens": 1, "min_p": 1.5})
check("min_p 1.5 -> 400 naming it", st == 400 and b["error"]["param"] == "min_p", f"{st} {b}")
dp = props.get("default_generation_settings", {}).get("params", {})
near = lambda d, k, want: abs(d.get(k, -99) - want) < 1e-6
check("--xtc-threshold 0.2 --dynatemp-exp 1.5 in /props, and llama-server's off values for the samplers not set "
      "(top_n_sigma -1, typical_p 1, xtc_probability 0, dynatemp_range 0, mirostat 0 at tau 5, eta 0.1)",
      near(dp, "xtc_threshold", 0.2) and near(dp, "dynatemp_exponent", 1.5) and near(dp, "top_n_sigma", -1)
      and near(dp, "typical_p", 1) and near(dp, "xtc_probability", 0) and near(dp, "dynatemp_range", 0)
      and dp.get("mirostat") == 0 and near(dp, "mirostat_tau", 5) and near(dp, "mirostat_eta", 0.1)
      and near(dp, "dry_multiplier", 0) and near(dp, "dry_base", 1.75) and dp.get("dry_allowed_length") == 2
      and dp.get("dry_sequence_breakers") == ["\n", ":", "\"", "*"], str(dp))
st, _, b = raw("POST", "/completion", {"prompt": P, "n_predict": 2, "top_n_sigma": 2, "typical_p": 0.9, "xtc_probability": 0.3,
                                       "dynatemp_range": 0.4, "mirostat": 2, "mirostat_tau": 3, "mirostat_eta": 0.2,
                                       "dry_multiplier": 0.8, "dry_penalty_last_n": 32})
gs = b.get("generation_settings", {}) if st == 200 else {}
check("top_n_sigma, typical_p, xtc_probability, dynatemp_range, mirostat, dry_* sent: generation_settings reports them, with the server's "
      "--xtc-threshold and --dynatemp-exp", st == 200 and near(gs, "top_n_sigma", 2) and near(gs, "typical_p", 0.9)
      and near(gs, "xtc_probability", 0.3) and near(gs, "dynatemp_range", 0.4) and near(gs, "xtc_threshold", 0.2)
      and near(gs, "dynatemp_exponent", 1.5) and gs.get("mirostat") == 2 and near(gs, "mirostat_tau", 3)
      and near(gs, "mirostat_eta", 0.2) and near(gs, "dry_multiplier", 0.8) and gs.get("dry_penalty_last_n") == 32, f"{st} {gs}")
st, _, b = raw("POST", "/completion", {**PS, "post_sampling_probs": "yes"})
check("post_sampling_probs not a boolean -> 400 naming it", st == 400 and b["error"]["param"] == "post_sampling_probs", f"{st} {b}")

# ---- the completions' prompt cache (llama-server's cache_prompt) ----------------------------
Q = "A long time ago in a galaxy far, far away, there lived"
nq = len(raw("POST", "/tokenize", {"content": Q, "add_special": True})[2]["tokens"])
st, _, c1 = raw("POST", "/completion", {"prompt": Q, "n_predict": 4, "temperature": 0})
st2, _, c2 = raw("POST", "/completion", {"prompt": Q, "n_predict": 4, "temperature": 0})
t1, t2 = c1.get("timings", {}), c2.get("timings", {})
check("the same prompt again: all but its last token come from the cache (cache_n, prompt_n), said in tokens_cached",
      st == st2 == 200 and t2.get("cache_n") == nq - 1 and t2.get("prompt_n") == 1 and c2.get("tokens_cached") == nq - 1
      and t1.get("prompt_n", 0) + t1.get("cache_n", 0) == nq, f"{t1} {t2} n={nq}")
# What the cache serves, against a reference decoded the same way without it: the reference prefills the
# prompt's first n-1 tokens (cache_prompt false) and logit_bias forces its first generated token to be the
# prompt's last, decoded alone after them; the cached request reuses those n-1 tokens' KV (the reference
# left them in its sequence) and decodes its last token alone: the same computation, the same numbers bit
# for bit.  (Against the whole prompt prefilled at once, another decode path, the top probabilities
# differed by up to 0.013 on an AMD EPYC.)
ids_q = raw("POST", "/tokenize", {"content": "In the old harbour town, every lighthouse keeper", "add_special": True})[2]["tokens"]
st, _, qr = raw("POST", "/completion", {"prompt": ids_q[:-1], "n_predict": 2, "temperature": 0, "n_probs": 8, "cache_prompt": False,
                                        "logit_bias": [[ids_q[-1], 100]], "return_tokens": True})
st2, _, qc = raw("POST", "/completion", {"prompt": ids_q, "n_predict": 1, "temperature": 0, "n_probs": 8})
p1 = [(e["id"], e["logprob"]) for e in qr["completion_probabilities"][1]["top_logprobs"]] if st == 200 else []
p2 = [(e["id"], e["logprob"]) for e in qc["completion_probabilities"][0]["top_logprobs"]] if st2 == 200 else []
check("a cached prompt's next-token distribution is the one decoding the same tokens the same way without the cache gives "
      "(top 8, bit for bit: the prompt's n-1 tokens prefilled, its last decoded alone after them)",
      st == st2 == 200 and qr["tokens"][:1] == ids_q[-1:] and qc["timings"]["cache_n"] == len(ids_q) - 1
      and qc["timings"]["prompt_n"] == 1 and same_dist(p1, p2), f"{p1} vs {p2}; {qc.get('timings')}")
st, _, c0 = raw("POST", "/completion", {"prompt": Q, "n_predict": 2, "temperature": 0, "cache_prompt": False})
check("control: cache_prompt false decodes the whole cached prompt again (cache_n 0)",
      st == 200 and c0["timings"]["cache_n"] == 0 and c0["timings"]["prompt_n"] == nq, f"{st} {c0.get('timings')}")
st, _, c3 = raw("POST", "/completion", {"prompt": Q + " a dragon who", "n_predict": 2, "temperature": 0})
check("a prompt extending a cached one decodes only its new tokens", st == 200 and c3["timings"]["cache_n"] >= nq - 1
      and c3["timings"]["prompt_n"] + c3["timings"]["cache_n"] == c3["tokens_evaluated"], f"{c3.get('timings')}")
st, _, c4 = raw("POST", "/completion", {"prompt": Q, "n_predict": 2, "temperature": 0}, key=KEY2)
check("control: another API key's completion never reuses the first key's cached prompt (cache_n 0)",
      st == 200 and c4["timings"]["cache_n"] == 0 and c4["timings"]["prompt_n"] == nq, f"{st} {c4.get('timings')}")

# ---- return_progress: prompt-progress events while the prompt is prefilled ---------------------
def progress_ok(ev, is_text):
    """(ok, why): progress events all before the first text, the first at 0 % (processed == cache),
    processed growing to total, total and cache the same in all."""
    idx = [i for i, e in enumerate(ev) if "prompt_progress" in e]
    pr = [ev[i]["prompt_progress"] for i in idx]
    first_text = next((i for i, e in enumerate(ev) if is_text(e)), len(ev))
    ok = (len(pr) >= 1 and pr[0]["processed"] == pr[0]["cache"] and pr[-1]["processed"] == pr[-1]["total"] > 0
          and all(a["processed"] < b["processed"] for a, b in zip(pr, pr[1:])) and len({(p["total"], p["cache"]) for p in pr}) == 1
          and idx[-1] < first_text)
    return ok, pr


long_p = "the quick brown fox jumps over the lazy dog " * 14
st, ev, txt = stream_events("/completion", {"prompt": long_p, "n_predict": 3, "stream": True, "return_progress": True,
                                            "timings_per_token": True})
ok, pr = progress_ok(ev, lambda e: e.get("content"))
tm = [e["timings"] for e in ev if "prompt_progress" in e]
check("return_progress (native): one event per prefill chunk of a long prompt, 0 % first, 100 % before the text; their timings "
      "start at 0 and prompt_n = processed - cache", st == 200 and ok and len(pr) >= 3 and tm[0]["prompt_n"] == 0
      and tm[0]["prompt_ms"] == 0 and all(t["prompt_n"] == p["processed"] - p["cache"] for t, p in zip(tm, pr))
      and all(a["prompt_ms"] <= b["prompt_ms"] for a, b in zip(tm, tm[1:])), str(pr))
# a piece may hold more than one token (a token ending inside a UTF-8 character prints nothing),
# so predicted_n grows with every piece and ends at the tokens generated
pn = [e["timings"]["predicted_n"] for e in ev if e.get("content")]
check("timings_per_token: every streamed piece carries timings, predicted_n counting the tokens",
      pn and pn[0] >= 1 and all(a < b for a, b in zip(pn, pn[1:])) and pn[-1] <= 3
      and [e for e in ev if e.get("stop")][-1]["timings"]["predicted_n"] == 3,
      str([e.get("timings") for e in ev if e.get("content") or e.get("stop")]))
chat_body = {"messages": [{"role": "user", "content": "Tell me a fact about owls."}], "max_tokens": 6, "temperature": 0,
             "stream": True, "return_progress": True}
st, ev1, _ = stream_events("/v1/chat/completions", chat_body)
st2, ev2, txt = stream_events("/v1/chat/completions", chat_body)
said1, said2 = ("".join(e["choices"][0]["delta"].get("content") or "" for e in ev if e.get("choices")) for ev in (ev1, ev2))
ok1, pr1 = progress_ok(ev1, lambda e: e["choices"] and e["choices"][0]["delta"].get("content"))
ok2, pr2 = progress_ok(ev2, lambda e: e["choices"] and e["choices"][0]["delta"].get("content"))
check("return_progress (chat): progress chunks carry the role delta; the same conversation sent again (a retried turn) "
      "finds its whole prompt in its session (cache = total, one event: nothing decoded, the prompt's logits kept) and "
      "gets the same greedy reply",
      st == st2 == 200 and ok1 and ok2 and all(ev1[i]["choices"][0]["delta"].get("role") == "assistant" for i in
                                              range(len(pr1))) and len(pr2) == 1
      and pr2[0]["cache"] == pr2[0]["total"] == pr1[0]["total"] and said1 == said2 != "", f"{pr1} {pr2} {said1!r} {said2!r}")
st, ev, txt = stream_events("/v1/responses", {"input": "Tell me a fact about owls.", "max_output_tokens": 4, "stream": True,
                                              "return_progress": True, "timings_per_token": True})
rp = [e for e in ev if "prompt_progress" in e]
check("return_progress (Responses): response.in_progress events with prompt_progress; timings on the text deltas",
      st == 200 and rp and all(e["type"] == "response.in_progress" for e in rp) and rp[-1]["prompt_progress"]["processed"]
      == rp[-1]["prompt_progress"]["total"] and all("timings" in e for e in ev if e["type"] == "response.output_text.delta"),
      txt[:600])
st, _, b = raw("POST", "/completion", {"prompt": P, "n_predict": 2, "return_progress": "yes"})
check("return_progress not a boolean -> 400 naming it", st == 400 and b["error"]["param"] == "return_progress", f"{st} {b}")

# ---- CORS -----------------------------------------------------------------------------------
pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
st, h, _ = raw("OPTIONS", "/v1/chat/completions", key=None, headers={"Origin": "http://localhost:3000", **pre})
check("CORS preflight without a key from an allowed origin (--cors-origins localhost) -> 200, origin echoed",
      st == 200 and h.get("Access-Control-Allow-Origin") == "http://localhost:3000"
      and "POST" in h.get("Access-Control-Allow-Methods", ""), f"{st} {dict(h)}")
st, h, _ = raw("OPTIONS", "/v1/chat/completions", key=None, headers={"Origin": "http://localhost.evil.com", **pre})
check("a preflight from another origin -> 200 without Access-Control-Allow-Origin",
      st == 200 and "Access-Control-Allow-Origin" not in h, f"{st} {dict(h)}")
st, h, _ = raw("POST", "/tokenize", {"content": "x"}, headers={"Origin": "http://127.0.0.1:8080"})
check("a reply to an allowed origin carries Access-Control-Allow-Origin", h.get("Access-Control-Allow-Origin") == "http://127.0.0.1:8080",
      dict(h))

# ---- llama.cpp's metric names ---------------------------------------------------------------
def metrics():
    st, h, txt = raw("GET", "/metrics")
    vals = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(llamacpp:\w+) (\S+)$", txt, re.M)}
    types = set(re.findall(r"^# TYPE (llamacpp:\w+) ", txt, re.M))
    return st, h, vals, types


st, h, m0, types = metrics()
check("/metrics: Process-Start-Time-Unix header and llama.cpp's names, each with its TYPE line",
      st == 200 and "Process-Start-Time-Unix" in h and {"llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                                                        "llamacpp:n_decode_total", "llamacpp:requests_processing"} <= set(m0)
      and set(m0) == types, f"{st} {sorted(m0)}")
st, _, b = raw("POST", "/completion", {"prompt": "I believe", "n_predict": 5, "temperature": 0})
_, _, m1, _ = metrics()
check("llamacpp:tokens_predicted_total grows by the reply's tokens_predicted",
      m1["llamacpp:tokens_predicted_total"] - m0["llamacpp:tokens_predicted_total"] == b["tokens_predicted"],
      f"{m0.get('llamacpp:tokens_predicted_total')} -> {m1.get('llamacpp:tokens_predicted_total')}, reply {b.get('tokens_predicted')}")
check("llamacpp:prompt_tokens_total grows by the prompt tokens decoded (timings.prompt_n)",
      m1["llamacpp:prompt_tokens_total"] - m0["llamacpp:prompt_tokens_total"] == b["timings"]["prompt_n"],
      f"{m0.get('llamacpp:prompt_tokens_total')} -> {m1.get('llamacpp:prompt_tokens_total')}")

# ---- Anthropic Messages through the official client ------------------------------------------
C = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=300)
conv = [{"role": "user", "content": "Name a colour."}]
# the streamed reply's reference is decoded the same way: each in a fresh session of its own (X-Session-Id;
# without it the stream would find the conversation in the first's session and decode only the assistant
# prefix there)
m = C.messages.create(model="code", max_tokens=24, extra_body={"temperature": 0}, system="Answer in one word.", messages=conv,
                      extra_headers={"X-Session-Id": "anthropic-plain"})
check("anthropic messages.create: a message, a text block, a stop reason, usage",
      m.type == "message" and m.role == "assistant" and m.content and m.content[0].type == "text"
      and m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens > 0 and m.usage.output_tokens > 0, str(m))
n = C.messages.count_tokens(model="code", system="Answer in one word.", messages=conv)
check("count_tokens = the reply's prompt tokens (input + cache read)",
      n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), f"{n} vs {m.usage}")
with C.messages.stream(model="code", max_tokens=24, extra_body={"temperature": 0}, system="Answer in one word.", messages=conv,
                       extra_headers={"X-Session-Id": "anthropic-stream"}) as s:
    streamed = "".join(s.text_stream)
    fin = s.get_final_message()
check("anthropic streaming (a fresh session, as the message without stream): the same greedy text, the final message's usage "
      "and stop reason",
      streamed == m.content[0].text and fin.usage.output_tokens == m.usage.output_tokens and fin.stop_reason == m.stop_reason,
      f"{streamed!r} vs {m.content[0].text!r}")
conv2 = conv + [{"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": "And another one?"}]
m2 = C.messages.create(model="code", max_tokens=16, extra_body={"temperature": 0}, system="Answer in one word.", messages=conv2)
check("the second turn reuses the session's KV: usage.cache_read_input_tokens > 0",
      (m2.usage.cache_read_input_tokens or 0) > 0, str(m2.usage))
tools = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}]
q = [{"role": "user", "content": "What is the weather in Paris?"}]
t = C.messages.create(model="code", max_tokens=64, extra_body={"temperature": 0}, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
                      messages=q)
use = [b for b in t.content if b.type == "tool_use"]
check("tool_choice {type: tool}: a tool_use block with the tool's name and an object input, stop_reason tool_use",
      t.stop_reason == "tool_use" and use and use[0].name == "get_weather" and isinstance(use[0].input, dict)
      and isinstance(use[0].input.get("location"), str), str(t))
if use:
    back = q + [{"role": "assistant", "content": [{"type": "tool_use", "id": use[0].id, "name": "get_weather", "input": use[0].input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "Sunny, 21 C"}]}]
    t2 = C.messages.create(model="code", max_tokens=32, extra_body={"temperature": 0}, tools=tools, messages=back)
    check("a tool_result round trip answers", t2.type == "message" and t2.content, str(t2))
with C.messages.stream(model="code", max_tokens=64, extra_body={"temperature": 0}, tools=tools, tool_choice={"type": "any"}, messages=q) as s:
    fm = s.get_final_message()
check("anthropic streaming under tool_choice any: the final message holds the tool_use block",
      any(b.type == "tool_use" and b.name == "get_weather" for b in fm.content), str(fm))
try:
    C.messages.create(model="code", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    check("an image block -> 400", False, "no error")
except anthropic.BadRequestError as e:
    check("an image block -> 400 saying image input is not supported", "image input is not supported" in str(e), str(e))
st, _, b = raw("POST", "/v1/messages", {"model": "code", "max_tokens": 8})
check("/v1/messages without messages -> 400 in Anthropic's error shape",
      st == 400 and b.get("type") == "error" and b["error"]["type"] == "invalid_request_error" and "messages" in b["error"]["message"],
      f"{st} {b}")
st, ev, txt = stream_events("/v1/messages", {"model": "code", "max_tokens": 8, "stream": True,
                                             "messages": [{"role": "user", "content": "Hello"}]})
types_seen = [e["type"] for e in ev]
check("raw event order: message_start, content_block_start/delta.../stop, message_delta, message_stop",
      types_seen[:2] == ["message_start", "content_block_start"] and types_seen[-3:] == ["content_block_stop", "message_delta", "message_stop"]
      and ev[0]["message"]["content"] == [] and all(t == "content_block_delta" for t in types_seen[2:-3])
      and txt.count("event: ") == len(ev), txt[:600])

# ---- Responses API: the server holds the conversation (previous_response_id) ------------------
O = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=300)
INS = "Answer in a few words."
turns = ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a city.", "Name a planet.", "Name a tree.", "Name a river.",
         "Name a metal.", "Name a flower.", "Name a sport."]
ids, texts, usages = [], [], []
prev = None
for k, q in enumerate(turns):
    r = O.responses.create(model="code", input=q, instructions=INS, previous_response_id=prev, max_output_tokens=12, temperature=0)
    ids.append(r.id)
    texts.append(r.output_text)
    usages.append(r.usage)
    prev = r.id
check("10 turns sent with previous_response_id only: each completes (or stops at max_output_tokens)",
      len(ids) == 10 and len(set(ids)) == 10, ids)
cached = [u.input_tokens_details.cached_tokens for u in usages]
check("every later turn reuses the session's KV (usage.input_tokens_details.cached_tokens > 0), the early ones all of the "
      "previous prompt", all(c > 0 for c in cached[1:]) and all(cached[k] >= usages[k - 1].input_tokens for k in (1, 2)),
      f"cached {cached}, input {[u.input_tokens for u in usages]}")
check("the prompt grows with the conversation the server holds (input_tokens)",
      all(usages[k].input_tokens > usages[k - 1].input_tokens for k in range(1, 10)), [u.input_tokens for u in usages])
# reference in the same run: the same three turns sent whole as chat completions, decoded the way the server
# decoded the Responses conversation: the first turn whole in a fresh session, each later one as its tail
# in that session (X-Session-Id names it, so that no other session holding the same text is chosen)
hist = [{"role": "system", "content": INS}]
for k in range(3):
    hist.append({"role": "user", "content": turns[k]})
    cr = O.chat.completions.create(model="code", messages=hist, max_tokens=12, temperature=0,
                                   extra_headers={"X-Session-Id": "responses-reference"})
    hist.append({"role": "assistant", "content": cr.choices[0].message.content})
    check(f"turn {k + 1}: the same greedy text as the whole history sent to /v1/chat/completions",
          cr.choices[0].message.content == texts[k], f"{cr.choices[0].message.content!r} vs {texts[k]!r}")
g = O.responses.retrieve(ids[3])
check("GET /v1/responses/ID returns the stored response", g.id == ids[3] and g.output_text == texts[3]
      and g.previous_response_id == ids[2], str(g))
# streaming continues the same conversation
ev_types, deltas, final = [], "", None
for ev in O.responses.create(model="code", input="Name a bird.", instructions=INS, previous_response_id=ids[-1],
                             max_output_tokens=12, temperature=0, stream=True):
    ev_types.append(ev.type)
    if ev.type == "response.output_text.delta":
        deltas += ev.delta
    if ev.type in ("response.completed", "response.incomplete"):
        final = ev.response
check("streamed: response.created, in_progress, output_item.added, content_part.added, deltas ... output_item.done, completed",
      ev_types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
      and ev_types[-1] in ("response.completed", "response.incomplete") and "response.output_item.done" in ev_types, ev_types)
check("streamed: the deltas make the final response's text, which reused the conversation's KV",
      final is not None and deltas == final.output_text and final.usage.input_tokens_details.cached_tokens > 0, f"{deltas!r} {final}")
# a fork: two continuations of one parent, each its own conversation
fa = O.responses.create(model="code", input="Name a vegetable.", instructions=INS, previous_response_id=ids[1], max_output_tokens=8,
                        temperature=0)
check("a fork (continuing turn 2 again) reuses the shared prefix's KV", fa.usage.input_tokens_details.cached_tokens > 0
      and fa.usage.input_tokens < usages[3].input_tokens, f"{fa.usage} vs turn 4 {usages[3].input_tokens}")
g3 = O.responses.retrieve(ids[2])
check("the original branch is unchanged by the fork", g3.output_text == texts[2] and g3.previous_response_id == ids[1], str(g3))
# store: false, delete, another key
ns = O.responses.create(model="code", input="Hi.", store=False, max_output_tokens=4)
try:
    O.responses.retrieve(ns.id)
    check("store: false is not kept", False, "retrieved")
except openai.NotFoundError:
    check("store: false is not kept (GET -> 404)", True)
O2 = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY2, max_retries=0, timeout=300)
try:
    O2.responses.create(model="code", input="x", previous_response_id=ids[0], max_output_tokens=4)
    check("another API key cannot continue the conversation", False, "continued")
except openai.NotFoundError:
    check("another API key cannot continue the conversation (404)", True)
O.responses.delete(ids[4])
try:
    O.responses.create(model="code", input="x", previous_response_id=ids[6], max_output_tokens=4)
    check("a conversation with a deleted response in it is refused, never replayed with a hole", False, "continued")
except openai.NotFoundError as e:
    check("a conversation with a deleted response in it is refused (404 naming it), never replayed with a hole", ids[4] in str(e), str(e))
tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
t = O.responses.create(model="code", input="What is the weather in Paris?", tools=tools, tool_choice="required",
                       max_output_tokens=64, temperature=0)
fc = [o for o in t.output if o.type == "function_call"]
check("tools: a function_call item with a call_id, the tool's name and JSON arguments",
      fc and fc[0].name == "get_weather" and isinstance(json.loads(fc[0].arguments).get("city"), str), str(t.output))
if fc:
    t2 = O.responses.create(model="code", previous_response_id=t.id, tools=tools, max_output_tokens=24, temperature=0,
                            input=[{"type": "function_call_output", "call_id": fc[0].call_id, "output": "Sunny, 21 C"}])
    check("function_call_output continues the conversation the server holds", t2.status in ("completed", "incomplete")
          and t2.usage.input_tokens_details.cached_tokens > 0, str(t2))
st, _, b = raw("POST", "/v1/responses", {"model": "code", "input": "x", "tools": [{"type": "web_search"}]})
check("a hosted tool (web_search) -> 400 naming tools", st == 400 and b["error"]["param"] == "tools", f"{st} {b}")
st, _, b = raw("POST", "/v1/responses", {"model": "code"})
check("no input -> 400 naming it", st == 400 and b["error"]["param"] == "input", f"{st} {b}")

finish()
