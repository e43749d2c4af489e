"""serve_fields_walk_test.py — every *honoured* field of the field tables (server/fields.c, as
`kvtier serve --print-api` prints them) changes the reply where it should, against a reference
computed in the same run: the same request without the field (or with its default), or greedy
decoding where a sampling field must reduce to it.  A row marked honoured with no probe here is a
failure, so a field cannot be called honoured without a test that shows it (issue #39).

Nothing depends on the text a small model writes on one machine: each probe compares two replies
of this server in this run (token counts, shapes, equality with greedy, a stop string cut out of
the reference reply itself).

Usage: serve_fields_walk_test.py BASE_URL API_MD
"""
import json
import random
import sys

from serve_client import check, finish, init, raw

BASE, MD = sys.argv[1], sys.argv[2]
init(BASE, None)

# the honoured rows: (table, field, apis)
honoured, table = [], None
for line in open(MD):
    if line.startswith("### "):
        table = line[4:].strip()
    elif table and line.startswith("| `"):
        cells = [c.strip() for c in line.strip().strip("|").replace("\\|", "\x00").split("|")]
        if cells[3] == "honoured":
            honoured.append((table.split(" (")[0].split(":")[0], cells[0].strip("`"), cells[2]))
check("the tables mark 40 or more fields honoured", len(honoured) >= 40, str(len(honoured)))

Q = {"role": "user", "content": "Write a short story about a cat and a boat."}
COUNT = "Count from one to forty in words: one, two, three,"


FRESH = [False]  # set while a probe compares texts: each request in a session of its own


def post(path, body):
    """a request; while FRESH, in a new session (X-Session-Id) and, for completions, with no cached
    prompt: the whole prompt decoded the same way every time, so greedy replies compare exactly
    (a reused prefix decodes in other ubatches, and a near-tie may flip: serve_compat_test's note)"""
    if FRESH[0]:
        if path in ("/completion", "/v1/completions"):
            body = {**body, "cache_prompt": False}
        s, h, b = raw("POST", path, body, headers={"X-Session-Id": f"walk-{random.randrange(1 << 62)}"})
    else:
        s, h, b = raw("POST", path, body)
    return s, b


def fresh(fn):
    """run fn with FRESH set"""
    def run(*a, **k):
        FRESH[0] = True
        try:
            return fn(*a, **k)
        finally:
            FRESH[0] = False
    return run


def events(b):
    """the JSON data of an SSE body (text), in order"""
    out = []
    for line in (b if isinstance(b, str) else "").split("\n"):
        if line.startswith("data: ") and line[6:] != "[DONE]":
            try:
                out.append(json.loads(line[6:]))
            except ValueError:
                pass
    return out


# ---- one request per API, its text and token counts ----

def chat(extra=None, msgs=None, n=8):
    s, b = post("/v1/chat/completions", {"messages": msgs or [Q], "max_tokens": n, "temperature": 0, **(extra or {})})
    return s, b


def chat_text(b):
    return b["choices"][0]["message"].get("content") or ""


def comp(extra=None, prompt=COUNT, n=8):
    return post("/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0, **(extra or {})})


def comp_text(b):
    return b["choices"][0]["text"]


def nat(extra=None, prompt=COUNT, n=8):
    return post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, **(extra or {})})


def nat_text(b):
    return b["content"]


def resp(extra=None, inp="Write a short story about a cat and a boat.", n=8):
    return post("/v1/responses", {"input": inp, "max_output_tokens": n, "temperature": 0, **(extra or {})})


def resp_text(b):
    for it in b.get("output", []):
        if it.get("type") == "message":
            return "".join(c.get("text", "") for c in it.get("content", []))
    return ""


def anth(extra=None, msgs=None, n=8):
    return post("/v1/messages", {"messages": msgs or [Q], "max_tokens": n, "temperature": 0, **(extra or {})})


def anth_text(b):
    return "".join(c.get("text", "") for c in b.get("content", []) if c.get("type") == "text")


API = {  # route -> (request, text of a reply, prompt tokens, generated tokens)
    "chat": (chat, chat_text, lambda b: b["usage"]["prompt_tokens"], lambda b: b["usage"]["completion_tokens"]),
    "completions": (comp, comp_text, lambda b: b["usage"]["prompt_tokens"], lambda b: b["usage"]["completion_tokens"]),
    "native": (nat, nat_text, lambda b: b["tokens_evaluated"], lambda b: b["tokens_predicted"]),
    "responses": (resp, resp_text, lambda b: b["usage"]["input_tokens"], lambda b: b["usage"]["output_tokens"]),
    "messages": (anth, anth_text, lambda b: b["usage"]["input_tokens"] + b["usage"].get("cache_read_input_tokens", 0),
                 lambda b: b["usage"]["output_tokens"]),
}
MAXF = {"chat": "max_tokens", "completions": "max_tokens", "native": "n_predict", "responses": "max_output_tokens", "messages": "max_tokens"}


@fresh
def greedy_same(api, extra, label):
    """extra at a high temperature reduces sampling to greedy: equal to the greedy reference, for 3 seeds"""
    req, text, _, _ = API[api]
    s0, ref = req()
    same = []
    for seed in (1, 2, 3):
        s, b = req({"temperature": 1.5, "seed": seed, **extra})
        same.append(s == 200 and text(b) == text(ref))
    return s0 == 200 and all(same), f"{label}: {same} ref {text(ref)[:40]!r}"


@fresh
def sampled_differs(api, extra):
    """extra makes some of 3 seeded samples differ from the greedy reference"""
    req, text, _, _ = API[api]
    _, ref = req()
    outs = [req({"seed": seed, **extra}) for seed in (1, 2, 3)]
    return any(s == 200 and text(b) != text(ref) for s, b in outs), f"ref {text(ref)[:40]!r} vs {[text(b)[:20] for _, b in outs]}"


def max_probe(api, field):
    req, _, _, ntok = API[api]
    s1, b1 = req({field: 1})
    s5, b5 = req({field: 6})
    return s1 == 200 and s5 == 200 and ntok(b1) == 1 and 1 < ntok(b5) <= 6, f"{ntok(b1) if s1 == 200 else b1} / {ntok(b5) if s5 == 200 else b5}"


@fresh
def stop_probe(api, field):
    """a stop string taken from inside the reference reply cuts the reply there"""
    req, text, _, _ = API[api]
    _, ref = req(n=16)
    t = text(ref)
    k = next((i for i in range(2, len(t) - 3) if t[i] not in " \n" and t.find(t[i:i + 3]) == i), None)
    if k is None:
        return False, f"no stop string in {t!r}"
    stop = t[k:k + 3]
    s, b = req({field: [stop]}, n=16)
    return s == 200 and text(b) == t[:k], f"stop {stop!r}: {text(b)!r} vs {t[:k]!r}"


def stream_probe(path, body, done):
    s, h, b = raw("POST", path, {**body, "stream": True})
    evs = events(b)
    s2, h2, b2 = raw("POST", path, body)
    return (s == 200 and "text/event-stream" in h.get("Content-Type", "") and len(evs) >= 2 and done(evs)
            and "application/json" in h2.get("Content-Type", "")), f"{s} {h.get('Content-Type')} {len(evs)} events"


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]}}}]
TIME = {"type": "function", "function": {"name": "get_time", "description": "the time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def token_of(word):
    s, b = post("/tokenize", {"content": word})
    tok = b["tokens"][0] if s == 200 and b.get("tokens") else None
    s, p = post("/detokenize", {"tokens": [tok]}) if tok is not None else (0, {})
    return tok, (p.get("content") if s == 200 else None)


probes = {}


def probe(table, field, *apis):
    def deco(fn):
        for a in apis or ("",):
            probes[(table, field, a)] = fn
        return fn
    return deco


def run(table, field, api, fn):
    try:
        ok, why = fn(api) if api else fn()
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        ok, why = False, f"{type(e).__name__}: {e}"
    check(f"{table} '{field}'{' on ' + api if api else ''} changes the reply", ok, why)


OA = "OpenAI Chat Completions, Completions and llama-server"  # prefix of the first table's title


def oa(field, *apis):
    return probe("OA", field, *apis)


@oa("messages", "chat")
def _(api):
    s1, b1 = chat(msgs=[{"role": "user", "content": "Hi"}])
    s2, b2 = chat()
    return s1 == s2 == 200 and b1["usage"]["prompt_tokens"] < b2["usage"]["prompt_tokens"], "prompt tokens"


@oa("prompt", "completions", "native")
def _(api):
    req, text, ptok, _ = API[api]
    s1, b1 = req(prompt="Hi")
    s2, b2 = req()
    return s1 == s2 == 200 and ptok(b1) < ptok(b2) and text(b1) != text(b2), f"{ptok(b1)} {ptok(b2)}"


for f, apis in (("max_tokens", ("chat", "completions", "native")), ("max_completion_tokens", ("chat",))):
    oa(f, *apis)(lambda api, f=f: max_probe(api, f))


@oa("n_predict", "native")
def _(api):
    """as max_tokens; absent or -1 on this server (given neither -n nor --max-tokens): a prompt that
    leaves less than the default 256 of the budget is answered with what it leaves, while an explicit
    n_predict that does not fit is a 400 (the control)"""
    ok, why = max_probe(api, "n_predict")
    budget = raw("GET", "/props")[2]["kvtier"]["budget"]
    long = "the quick brown fox " * (budget // 5)  # ~4 tokens a repeat: well over budget - 256, under the budget
    s1, b1 = post("/completion", {"prompt": long, "temperature": 0, "n_predict": -1})
    s2, b2 = post("/completion", {"prompt": long, "temperature": 0, "n_predict": 256})
    fills = s1 == 200 and b1["tokens_evaluated"] + 256 > budget and b1["tokens_evaluated"] + b1["tokens_predicted"] <= budget
    return ok and fills and s2 == 400, f"{why}; -1: {s1} {str(b1)[:120]}; 256: {s2}"
oa("temperature", "chat", "completions", "native")(lambda api: sampled_differs(api, {"temperature": 1.5}))
oa("top_p", "chat", "completions", "native")(lambda api: greedy_same(api, {"top_p": 1e-9}, "top_p 1e-9 = greedy"))
oa("top_k", "native")(lambda api: greedy_same(api, {"top_k": 1}, "top_k 1 = greedy"))
oa("min_p", "native")(lambda api: greedy_same(api, {"min_p": 1.0}, "min_p 1 = greedy"))
oa("top_n_sigma", "native")(lambda api: greedy_same(api, {"top_n_sigma": 1e-6}, "top_n_sigma 1e-6 = greedy"))


@fresh
def greedy_changed(api, on, off, label):
    """at temperature 0: `on` changes the greedy reply, `off` (the same field at its off value) leaves it"""
    req, text, _, _ = API[api]
    s0, ref = req()
    s1, b1 = req({"temperature": 0, **on})
    s2, b2 = req({"temperature": 0, **off})
    return (s0 == s1 == s2 == 200 and text(b1) != text(ref) and text(b2) == text(ref),
            f"{label}: {text(b1)[:30]!r} / {text(b2)[:30]!r} vs greedy {text(ref)[:30]!r}")


@fresh
def seeds_agree(api, extra, hot, label):
    """3 seeds at the temperature of `hot`: with extra they give one reply, without it they do not"""
    req, text, _, _ = API[api]
    a = [text(req({**hot, **extra, "seed": s})[1]) for s in (1, 2, 3)]
    b = [text(req({**hot, "seed": s})[1]) for s in (1, 2, 3)]
    return len(set(a)) == 1 and len(set(b)) > 1, f"{label}: {[t[:20] for t in a]} / {[t[:20] for t in b]}"


# XTC at temperature 0 (llama-server's chain runs it before the temperature): with probability 1 a
# step with two tokens or more above the threshold takes the least likely of them
oa("xtc_probability", "native")(lambda api: greedy_changed(api, {"xtc_probability": 1, "xtc_threshold": 0.02},
                                                             {"xtc_probability": 0, "xtc_threshold": 0.02}, "XTC 1 / 0"))
oa("xtc_threshold", "native")(lambda api: greedy_changed(api, {"xtc_probability": 1, "xtc_threshold": 0.02},
                                                           {"xtc_probability": 1, "xtc_threshold": 0.6}, "threshold 0.02 / 0.6 (off)"))
# locally typical sampling with p -> 0 keeps one token a step (the most typical): seeds agree at 1.5
oa("typical_p", "native")(lambda api: seeds_agree(api, {"typical_p": 1e-6}, {"temperature": 1.5}, "typical_p 1e-6"))
@fresh
def dynatemp_probe(api, exponent=False):
    """the dynamic temperature on a story's next tokens (their entropy a good part of the
    vocabulary's): from a near-greedy 0.001 (3 seeds agree) up to 0.001 + 2 x the normalised entropy,
    so that seeds differ; the exponent 10 takes the normalised entropy (< 1) to ~0, back to the
    near-greedy reply, 0.2 towards 1"""
    req, text, _, _ = API[api]
    story = "Once upon a time, in a small village by the sea, there lived a"

    def texts(extra):
        return [text(req({"temperature": 0.001, **extra, "seed": s}, prompt=story, n=16)[1]) for s in (1, 2, 3)]
    base = texts({})
    if exponent:
        low, high = texts({"dynatemp_range": 2, "dynatemp_exponent": 10}), texts({"dynatemp_range": 2, "dynatemp_exponent": 0.2})
        return low == base and len(set(high)) > 1, f"exponent 10: {[t[:20] for t in low]}; 0.2: {[t[:20] for t in high]}"
    dyn = texts({"dynatemp_range": 2})
    return len(set(base)) == 1 and len(set(dyn)) > 1, f"{[t[:20] for t in base]} / {[t[:20] for t in dyn]}"




@fresh
def mirostat_probe(api, field):
    """Mirostat at temperature 1.5: a target surprise of 0.01 bits keeps one candidate a step (the
    greedy reply, for 3 seeds, 1.0 and 2.0); 8 bits samples (seeds differ from greedy); the learning
    rate moves mu, so that at a target of 2 bits eta 0.001 and eta 5 give other replies for one seed
    at least, each the same again"""
    req, text, _, _ = API[api]
    story = "Once upon a time, in a small village by the sea, there lived a"

    def texts(extra):
        return [text(req({"temperature": 1.5, **extra, "seed": s}, prompt=story, n=16)[1]) for s in (1, 2, 3)]
    greedy = text(req({"temperature": 0}, prompt=story, n=16)[1])
    if field == "mirostat_eta":
        slow, fast = texts({"mirostat": 2, "mirostat_tau": 2, "mirostat_eta": 0.001}), texts({"mirostat": 2, "mirostat_tau": 2, "mirostat_eta": 5})
        again = texts({"mirostat": 2, "mirostat_tau": 2, "mirostat_eta": 5})
        return slow != fast and fast == again, f"eta 0.001 {[t[:16] for t in slow]}; 5 {[t[:16] for t in fast]}"
    low = texts({"mirostat": 2, "mirostat_tau": 0.01}) + texts({"mirostat": 1, "mirostat_tau": 0.01})
    high = texts({"mirostat": 2, "mirostat_tau": 8})
    return all(t == greedy for t in low) and any(t != greedy for t in high), f"greedy {greedy[:20]!r}; tau 0.01 {[t[:16] for t in low]}; 8 {[t[:16] for t in high]}"


for f in ("mirostat", "mirostat_tau", "mirostat_eta"):
    oa(f, "native")(lambda api, f=f: mirostat_probe(api, f))


@fresh
def dry_probe(api, on, off):
    """DRY on a prompt that repeats a line, whose greedy reply goes on repeating it: `on` changes the
    greedy reply, `off` (the field at a value that leaves DRY without effect) does not"""
    req, text, _, _ = API[api]
    rep = "the old cat sat on the warm mat by the door. " * 3
    s0, ref = req({"temperature": 0}, prompt=rep, n=16)
    s1, b1 = req({"temperature": 0, **on}, prompt=rep, n=16)
    s2, b2 = req({"temperature": 0, **off}, prompt=rep, n=16)
    return (s0 == s1 == s2 == 200 and text(b1) != text(ref) and text(b2) == text(ref),
            f"greedy {text(ref)[:30]!r}; {on}: {text(b1)[:30]!r}; {off}: {text(b2)[:30]!r}")


oa("dry_multiplier", "native")(lambda api: dry_probe(api, {"dry_multiplier": 5}, {"dry_multiplier": 0}))
oa("dry_base", "native")(lambda api: dry_probe(api, {"dry_multiplier": 0.01, "dry_base": 10}, {"dry_multiplier": 0.01, "dry_base": 1}))
oa("dry_allowed_length", "native")(lambda api: dry_probe(api, {"dry_multiplier": 2, "dry_allowed_length": 2},
                                                         {"dry_multiplier": 2, "dry_allowed_length": 200}))
oa("dry_penalty_last_n", "native")(lambda api: dry_probe(api, {"dry_multiplier": 5, "dry_penalty_last_n": -1},
                                                         {"dry_multiplier": 5, "dry_penalty_last_n": 0}))
# llama-server's default breakers, sent: the repeat runs through them (none of \n : " * is in it); breakers
# that every token of the line but "." holds: no repeat is longer than one token, DRY has nothing to penalise
oa("dry_sequence_breakers", "native")(lambda api: dry_probe(api, {"dry_multiplier": 5, "dry_sequence_breakers": ["\n", ":", "\"", "*"]},
                                                            {"dry_multiplier": 5, "dry_sequence_breakers": [" ", "e", "o"]}))
oa("dynatemp_range", "native")(lambda api: dynatemp_probe(api))
oa("dynatemp_exponent", "native")(lambda api: dynatemp_probe(api, exponent=True))


@fresh
def penalty_changes(api, *extras):
    """a repetition penalty at either end of its range changes the 16-token greedy reply (words and
    commas recur within the window of prompt and reply); with repeat_last_n 0 (no window) it is the
    greedy reply"""
    req, text, _, _ = API[api]
    s0, ref = req(n=16)
    changed, why = False, []
    for extra in extras:
        s1, b1 = req(extra, n=16)
        s2, b2 = req({**extra, "repeat_last_n": 0}, n=16)
        if s1 != 200 or s2 != 200 or text(b2) != text(ref):
            return False, f"{extra}: {s1} {s2}, repeat_last_n 0 gives {text(b2)[:40]!r}, greedy {text(ref)[:40]!r}"
        changed |= text(b1) != text(ref)
        why.append(f"{extra}: {text(b1)[:30]!r}")
    return s0 == 200 and changed, f"greedy {text(ref)[:30]!r}; " + "; ".join(why)


for f, lo, hi in (("frequency_penalty", -2, 2), ("presence_penalty", -2, 2), ("repeat_penalty", 0.1, 10)):
    oa(f, "chat", "completions", "native")(lambda api, f=f, lo=lo, hi=hi: penalty_changes(api, {f: hi}, {f: lo}))
oa("repeat_last_n", "chat", "completions", "native")(lambda api: penalty_changes(api, {"frequency_penalty": 2, "repeat_last_n": -1}))


@oa("seed", "chat", "completions", "native")
@fresh
def _(api):
    req, text, _, _ = API[api]
    a = [req({"temperature": 1.5, "seed": 7})[1] for _ in range(2)]
    others = [req({"temperature": 1.5, "seed": s})[1] for s in (8, 9, 10)]
    return text(a[0]) == text(a[1]) and any(text(o) != text(a[0]) for o in others), f"{text(a[0])[:30]!r}"


@oa("n", "chat", "completions")
def _(api):
    s, b = API[api][0]({"n": 2, "temperature": 1.0})
    return s == 200 and len(b["choices"]) == 2, str(b)[:200]


oa("stop", "chat", "completions", "native")(lambda api: stop_probe(api, "stop"))


@oa("stream", "chat", "completions", "native")
def _(api):
    path, body = {"chat": ("/v1/chat/completions", {"messages": [Q], "max_tokens": 4}),
                  "completions": ("/v1/completions", {"prompt": COUNT, "max_tokens": 4}),
                  "native": ("/completion", {"prompt": COUNT, "n_predict": 4})}[api]
    last = (lambda evs: evs[-1].get("stop") is True) if api == "native" else (lambda evs: evs[-1]["choices"][0]["finish_reason"])
    return stream_probe(path, body, last)


@oa("stream_options", "chat", "completions")
def _(api):
    path, body = {"chat": ("/v1/chat/completions", {"messages": [Q], "max_tokens": 4, "stream": True}),
                  "completions": ("/v1/completions", {"prompt": COUNT, "max_tokens": 4, "stream": True})}[api]
    with_u = events(raw("POST", path, {**body, "stream_options": {"include_usage": True}})[2])
    without = events(raw("POST", path, body)[2])
    return any(e.get("usage") for e in with_u) and not any(e.get("usage") for e in without), f"{len(with_u)} {len(without)}"


@oa("logprobs", "chat", "completions")
def _(api):
    if api == "chat":
        s, b = chat({"logprobs": True})
        s0, b0 = chat()
        got = b["choices"][0]["logprobs"]["content"] if s == 200 else None
        return (s0 == 200 and b0["choices"][0]["logprobs"] is None and isinstance(got, list)
                and len(got) == b["usage"]["completion_tokens"]), str(b)[:200]
    s, b = comp({"logprobs": True})
    s0, b0 = comp()
    return s == 200 and b["choices"][0]["logprobs"] and b0["choices"][0]["logprobs"] is None, str(b)[:200]


@oa("top_logprobs", "chat", "completions")
def _(api):
    s, b = API[api][0]({"logprobs": True, "top_logprobs": 3})
    ents = b["choices"][0]["logprobs"]["content"]
    return s == 200 and ents and all(len(e["top_logprobs"]) == 3 for e in ents), str(ents[:1])[:200]


@oa("n_probs", "native")
def _(api):
    s, b = nat({"n_probs": 3})
    s0, b0 = nat()
    ents = b.get("completion_probabilities") or []
    return (ents and all(len(e["top_logprobs"]) == 3 for e in ents) and not b0.get("completion_probabilities")), str(b)[:200]


@oa("post_sampling_probs", "native")
def _(api):
    s, b = nat({"n_probs": 2, "post_sampling_probs": True})
    s0, b0 = nat({"n_probs": 2})
    e, e0 = b["completion_probabilities"][0], b0["completion_probabilities"][0]
    return "prob" in e and "top_probs" in e and "logprob" in e0 and "prob" not in e0, f"{list(e)} {list(e0)}"


@oa("return_tokens", "native")
def _(api):
    s, b = nat({"return_tokens": True})
    s0, b0 = nat()
    return len(b["tokens"]) == b["tokens_predicted"] > 0 and b0["tokens"] == [], f"{b['tokens']} {b0['tokens']}"


@oa("tools", "chat")
def _(api):
    s, b = chat({"tools": WEATHER, "tool_choice": "required"}, msgs=ASK, n=40)
    s0, b0 = chat(msgs=ASK, n=40)
    calls = b["choices"][0]["message"].get("tool_calls") or []
    return (s == 200 and calls and calls[0]["function"]["name"] == "get_weather"
            and not b0["choices"][0]["message"].get("tool_calls")), str(b)[:200]


@oa("tool_choice", "chat")
def _(api):
    s, b = chat({"tools": WEATHER, "tool_choice": "none"}, msgs=ASK, n=40)
    s2, b2 = chat({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, msgs=ASK, n=40)
    return (not b["choices"][0]["message"].get("tool_calls")
            and b2["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"), f"{str(b)[:100]} {str(b2)[:100]}"


@oa("parallel_tool_calls", "chat")
def _(api):
    """false: one call a reply (the grammar allows no second); true: the replies still hold calls
    (a small model seldom writes two, so "several" is not asserted)"""
    two = [{"role": "user", "content": "What are the weather and the time in Paris? Call both tools."}]
    many = lambda b: len(b["choices"][0]["message"].get("tool_calls") or [])  # noqa: E731
    t = [chat({"tools": WEATHER + [TIME], "tool_choice": "required", "parallel_tool_calls": True, "temperature": 1.0,
               "seed": s}, msgs=two, n=80)[1] for s in (1, 2, 3, 4)]
    f = [chat({"tools": WEATHER + [TIME], "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0,
               "seed": s}, msgs=two, n=80)[1] for s in (1, 2, 3, 4)]
    # a sampled reply may run out of its 80 tokens inside a call (finish_reason "length"): judged on
    # the replies that finished
    fin = lambda b: b["choices"][0].get("finish_reason") != "length"  # noqa: E731
    fd, td = [b for b in f if fin(b)], [b for b in t if fin(b)]
    return (all(many(b) <= 1 for b in f) and len(fd) >= 2 and len(td) >= 2 and all(many(b) == 1 for b in fd)
            and all(many(b) >= 1 for b in td)), \
        f"true {[(many(b), b['choices'][0].get('finish_reason')) for b in t]} false {[(many(b), b['choices'][0].get('finish_reason')) for b in f]}"


@oa("response_format", "chat")
def _(api):
    s, b = chat({"response_format": {"type": "json_object"}}, n=60)
    t = chat_text(b)
    try:
        ok = b["choices"][0]["finish_reason"] == "length" or isinstance(json.loads(t), dict)  # cut by max_tokens: not whole
    except ValueError:
        ok = False
    return s == 200 and ok and t.lstrip().startswith("{"), t[:100]


@oa("json_schema", "native")
def _(api):
    s, b = nat({"json_schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}, n=20)
    return s == 200 and isinstance(json.loads(b["content"])["x"], int), b.get("content", "")[:100]


@oa("grammar", "native")
def _(api):
    s, b = nat({"grammar": 'root ::= "yes" | "no"'})
    return s == 200 and b["content"] in ("yes", "no"), str(b.get("content"))


@oa("logit_bias", "chat", "completions", "native")
def _(api):
    req, text, _, _ = API[api]
    tok, piece = token_of(" zebra")
    bias = {str(tok): 100} if api != "native" else [[tok, 100]]
    s, b = req({"logit_bias": bias}, n=3)
    s0, b0 = req(n=3)
    return s == 200 and piece and piece.strip() in text(b) and piece.strip() not in text(b0), f"{piece!r}: {text(b)!r} vs {text(b0)!r}"


@oa("cache_prompt", "native")
def _(api):
    long = COUNT + " " + "and so on " * 40
    nat(prompt=long)
    s, b = nat({"cache_prompt": True}, prompt=long)
    s2, b2 = nat({"cache_prompt": False}, prompt=long)
    return b["tokens_cached"] > 0 and b2["tokens_cached"] == 0, f"{b['tokens_cached']} {b2['tokens_cached']}"


@oa("timings_per_token", "native")
def _(api):
    body = {"prompt": COUNT, "n_predict": 4, "stream": True}
    w = events(raw("POST", "/completion", {**body, "timings_per_token": True})[2])
    wo = events(raw("POST", "/completion", body)[2])
    return all("timings" in e for e in w) and not any("timings" in e for e in wo[:-1]), f"{len(w)} {len(wo)}"


@oa("return_progress", "native")
def _(api):
    body = {"prompt": COUNT, "n_predict": 2, "stream": True}
    w = events(raw("POST", "/completion", {**body, "return_progress": True})[2])
    wo = events(raw("POST", "/completion", body)[2])
    return any("prompt_progress" in e for e in w) and not any("prompt_progress" in e for e in wo), f"{len(w)} {len(wo)}"


@oa("verbose", "native")
def _(api):
    s, b = nat({"verbose": True})
    s0, b0 = nat()
    return "__verbose" in b and COUNT in b["__verbose"]["prompt"] and "__verbose" not in b0, str(list(b))[:200]


CONT = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital of France is"}]


@oa("continue_final_message", "chat")
def _(api):  # true: the final assistant message is continued; true after a user message, or false before an assistant one: 400
    s, b = chat({"continue_final_message": True, "add_generation_prompt": False}, msgs=CONT)
    s1, b1 = chat({"continue_final_message": True})
    s2, b2 = chat({"continue_final_message": False}, msgs=CONT)
    named = lambda b: b.get("error", {}).get("param") == "continue_final_message"  # noqa: E731
    return s == 200 and s1 == 400 and named(b1) and s2 == 400, f"{s} {s1} {s2} {str(b1)[:100]}"


@oa("add_generation_prompt", "chat")
def _(api):  # false: the final assistant message is continued; true after one (a new turn): 400; false after a user message: 400
    s, b = chat({"add_generation_prompt": False}, msgs=CONT)
    s1, b1 = chat({"add_generation_prompt": True}, msgs=CONT)
    s2, b2 = chat({"add_generation_prompt": False})
    named = lambda b: b.get("error", {}).get("param") == "add_generation_prompt"  # noqa: E731
    return s == 200 and s1 == 400 and named(b1) and s2 == 400 and named(b2), f"{s} {s1} {s2} {str(b1)[:100]}"


@oa("id_slot", "native")
def _(api):  # the session "slot-N" (serve_fields_test.py checks its KV is kept); shown on the chat route
    one = [{"role": "user", "content": f"Tell me about the number {random.randrange(10**9)}."}]
    two = [{"role": "user", "content": f"Tell me about the number {random.randrange(10**9)}."}]
    s, b = chat({"id_slot": 5}, msgs=one)
    s0, b0 = chat(msgs=two)
    return b["usage"]["kvtier"]["session_id"] == "slot-5" and b0["usage"]["kvtier"]["session_id"] != "slot-5", \
        f"{b['usage']['kvtier']['session_id']} {b0['usage']['kvtier']['session_id']}"


@oa("response_fields", "native")
def _(api):
    s, b = nat({"response_fields": ["content"]})
    return s == 200 and list(b) == ["content"], str(b)[:100]


# ---- OpenAI Responses ----

def rs(field):
    return probe("Responses", field)


@rs("input")
def _():
    s1, b1 = resp(inp="Hi")
    s2, b2 = resp()
    return b1["usage"]["input_tokens"] < b2["usage"]["input_tokens"], "input tokens"


@rs("instructions")
def _():
    s1, b1 = resp({"instructions": "Answer in French, in one short sentence, politely."})
    s0, b0 = resp()
    return b1["usage"]["input_tokens"] > b0["usage"]["input_tokens"], f"{b1['usage']} {b0['usage']}"


@rs("previous_response_id")
def _():
    s1, b1 = resp()
    s2, b2 = resp({"previous_response_id": b1["id"]}, inp="And then?")
    s3, b3 = resp(inp="And then?")
    return b2["usage"]["input_tokens"] > b3["usage"]["input_tokens"] and b2.get("previous_response_id") == b1["id"], \
        f"{b2['usage']} {b3['usage']}"


rs("max_output_tokens")(lambda: max_probe("responses", "max_output_tokens"))
rs("temperature")(lambda: sampled_differs("responses", {"temperature": 1.5}))
rs("top_p")(lambda: greedy_same("responses", {"top_p": 1e-9}, "top_p 1e-9 = greedy"))


@rs("stream")
def _():
    return stream_probe("/v1/responses", {"input": "Hi", "max_output_tokens": 4},
                        lambda evs: evs[-1].get("type") in ("response.completed", "response.incomplete"))


@rs("store")
def _():
    s1, b1 = resp({"store": False})
    s2, b2 = resp({"store": True})
    g1 = raw("GET", f"/v1/responses/{b1['id']}")[0]
    g2 = raw("GET", f"/v1/responses/{b2['id']}")[0]
    return g1 == 404 and g2 == 200, f"{g1} {g2}"


RTOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@rs("tools")
def _():
    s, b = resp({"tools": RTOOLS, "tool_choice": "required"}, inp="What is the weather in Paris?", n=40)
    s0, b0 = resp(inp="What is the weather in Paris?", n=40)
    return (any(i["type"] == "function_call" for i in b["output"]) and not any(i["type"] == "function_call" for i in b0["output"])), \
        str(b.get("output"))[:200]


@rs("tool_choice")
def _():
    s, b = resp({"tools": RTOOLS, "tool_choice": "none"}, inp="What is the weather in Paris?", n=40)
    s2, b2 = resp({"tools": RTOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}, inp="What is the weather in Paris?", n=40)
    return (not any(i["type"] == "function_call" for i in b["output"])
            and any(i["type"] == "function_call" for i in b2["output"])), f"{str(b['output'])[:80]} {str(b2['output'])[:80]}"


@rs("parallel_tool_calls")
def _():
    RT2 = RTOOLS + [{**RTOOLS[0], "name": "get_time", "description": "the time in a city"}]
    n = lambda b: sum(i["type"] == "function_call" for i in b["output"])  # noqa: E731
    f = [resp({"tools": RT2, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0, "seed": s},
              inp="What are the weather and the time in Paris? Call both tools.", n=80)[1] for s in (1, 2, 3, 4)]
    # a sampled reply may run out of its 80 tokens inside its call (status "incomplete", no call
    # parsed): the field is judged on the replies that completed, never more than one call
    done = [b for b in f if b.get("status") == "completed"]
    return (all(n(b) <= 1 for b in f) and len(done) >= 2 and all(n(b) == 1 for b in done),
            str([(n(b), b.get("status")) for b in f]))


@rs("text")
def _():
    s, b = resp({"text": {"format": {"type": "json_object"}}}, n=60)
    t = resp_text(b)
    return s == 200 and t.lstrip().startswith("{"), t[:100]


@rs("reasoning")
def _():
    s, b = resp({"reasoning": {"effort": "high"}})
    s2, b2 = resp({"reasoning": {"summary": "auto"}})
    return s == 400 and "effort" in json.dumps(b) and s2 == 200, f"{s} {s2}"


@rs("timings_per_token")
def _():
    body = {"input": "Hi", "max_output_tokens": 4, "stream": True}
    w = events(raw("POST", "/v1/responses", {**body, "timings_per_token": True})[2])
    wo = events(raw("POST", "/v1/responses", body)[2])
    return any("timings" in e for e in w) and not any("timings" in e for e in wo), f"{len(w)} {len(wo)}"


@rs("return_progress")
def _():
    body = {"input": "Hi", "max_output_tokens": 2, "stream": True}
    w = events(raw("POST", "/v1/responses", {**body, "return_progress": True})[2])
    wo = events(raw("POST", "/v1/responses", body)[2])
    return any("prompt_progress" in e for e in w) and not any("prompt_progress" in e for e in wo), f"{len(w)} {len(wo)}"


# ---- Anthropic Messages ----

def an(field):
    return probe("Anthropic", field)


@an("messages")
def _():
    s1, b1 = anth(msgs=[{"role": "user", "content": "Hi"}])
    s2, b2 = anth()
    return API["messages"][2](b1) < API["messages"][2](b2), "input tokens"


@an("system")
def _():
    s1, b1 = anth({"system": "Answer in French, in one short sentence, politely."})
    s0, b0 = anth()
    return API["messages"][2](b1) > API["messages"][2](b0), f"{b1.get('usage')} {b0.get('usage')}"


an("max_tokens")(lambda: max_probe("messages", "max_tokens"))


@an("stop_sequences")
def _():
    ok, why = stop_probe("messages", "stop_sequences")
    return ok, why


an("temperature")(lambda: sampled_differs("messages", {"temperature": 1.5}))
an("top_p")(lambda: greedy_same("messages", {"top_p": 1e-9}, "top_p 1e-9 = greedy"))
an("top_k")(lambda: greedy_same("messages", {"top_k": 1}, "top_k 1 = greedy"))


@an("stream")
def _():
    s, h, b = raw("POST", "/v1/messages", {"messages": [Q], "max_tokens": 4, "stream": True})
    types = [e.get("type") for e in events(b)]
    return s == 200 and types[:1] == ["message_start"] and types[-1:] == ["message_stop"], str(types)[:200]


ATOOLS = [{"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@an("tools")
def _():
    s, b = anth({"tools": ATOOLS, "tool_choice": {"type": "any"}}, msgs=ASK, n=40)
    s0, b0 = anth(msgs=ASK, n=40)
    return (any(c["type"] == "tool_use" for c in b["content"]) and not any(c["type"] == "tool_use" for c in b0["content"])), \
        str(b.get("content"))[:200]


@an("tool_choice")
def _():
    s, b = anth({"tools": ATOOLS, "tool_choice": {"type": "none"}}, msgs=ASK, n=40)
    s2, b2 = anth({"tools": ATOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}}, msgs=ASK, n=40)
    return (not any(c["type"] == "tool_use" for c in b["content"])
            and any(c["type"] == "tool_use" for c in b2["content"])), f"{str(b['content'])[:80]} {str(b2['content'])[:80]}"


# ---- the walk: every honoured row has its probe, and each probe holds ----
for tname, field, apis in honoured:
    key = "OA" if tname.startswith("OpenAI Chat") or "llama-server" in tname else \
        "Responses" if "Responses" in tname else "Anthropic"
    routes = [a.strip() for a in apis.split(",")]
    if key != "OA":
        routes = [""]
    for a in routes:
        fn = probes.get((key, field, a))
        if fn is None:
            check(f"{tname} '{field}' ({a or 'its route'}): honoured, with a probe in this walk", False, "no probe: write one")
            continue
        run(key, field, a, fn)

finish()
