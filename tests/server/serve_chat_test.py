"""serve_chat_test.py — the openai-client path of `kvtier serve` on the chat model (SmolLM2-135M-
Instruct: llama architecture, ChatML template), started by tests/server/cli_serve_chat.sh.

The model-independent core of serve_test.py (which runs on Gemma 3 270M) on the second model:
replies and their end (ChatML's <|im_end|> ends a reply, never shows in it), usage, streaming
(the same greedy text as without, the usage chunk), multi-turn reuse, /v1/completions, tool
calls (required: a call under the schema; auto: a plain question answered in text; the round
trip continuing the session), errors the client raises.  Prints "ok   NAME" / "FAIL NAME: why";
exit status = failures.

  python serve_chat_test.py BASE_URL KEY
"""
import json
import sys

from serve_client import check, finish, init, raw

import openai

BASE, KEY = sys.argv[1:3]
init(BASE, KEY)
A = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=300)


def kvt(resp):
    return resp.model_dump()["usage"]["kvtier"]


def usage_ok(u, max_tokens):
    return u.prompt_tokens > 0 and 0 < u.completion_tokens <= max_tokens and \
        u.total_tokens == u.prompt_tokens + u.completion_tokens


models = A.models.list().data
check("GET /v1/models (client): one model", len(models) == 1 and models[0].id, str(models))
model = models[0].id

# ---- a reply, its end, its usage ---------------------------------------------------------
q = [{"role": "user", "content": "Name three colours."}]
r = A.chat.completions.create(model=model, messages=q, max_tokens=48, temperature=0)
c = r.choices[0].message.content
k = kvt(r)
print(f"     reply {c!r} finish {r.choices[0].finish_reason} usage {r.usage.prompt_tokens}+{r.usage.completion_tokens} {k}")
check("chat completion: text, ended by the model (finish_reason stop)",
      r.object == "chat.completion" and isinstance(c, str) and c.strip() and r.choices[0].finish_reason == "stop", str(r))
check("ChatML: no template token in the reply", "<|im_" not in c and "<|endoftext|>" not in c, repr(c))
check("usage: prompt, completion (within max_tokens), total", usage_ok(r.usage, 48), str(r.usage))
check("usage.kvtier: reused + decoded = prompt tokens",
      k["prompt_tokens_reused"] + k["prompt_tokens_decoded"] == r.usage.prompt_tokens, str(k))
rl = A.chat.completions.create(model=model, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
                               max_tokens=5, temperature=0)
check("max_tokens reached: finish_reason length, 5 completion tokens",
      rl.choices[0].finish_reason == "length" and rl.usage.completion_tokens == 5, str(rl))

# ---- streaming: the same greedy text, then the usage chunk --------------------------------
s = [{"role": "user", "content": "Write one sentence about the sea."}]
r1 = A.chat.completions.create(model=model, messages=s, max_tokens=24, temperature=0)
chunks = list(A.chat.completions.create(model=model, messages=s, max_tokens=24, temperature=0, stream=True,
                                        stream_options={"include_usage": True}))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
fin = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
check("stream: several deltas, one finish_reason, the usage chunk last",
      len(chunks) >= 3 and len(fin) == 1 and chunks[-1].usage is not None and not chunks[-1].choices,
      f"{len(chunks)} chunks, finish {fin}")
check("stream and non-stream give the same greedy text and token count",
      text == r1.choices[0].message.content and chunks[-1].usage.completion_tokens == r1.usage.completion_tokens,
      f"{text!r} vs {r1.choices[0].message.content!r}")

# ---- multi-turn: the second turn decodes only the new tail --------------------------------
hist = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "My cat is called Pixel. Tell me one fact about cats."}]
w1 = A.chat.completions.with_raw_response.create(model=model, messages=hist, max_tokens=20, temperature=0)
t1 = w1.parse()
hist += [{"role": "assistant", "content": t1.choices[0].message.content},
         {"role": "user", "content": "What is my cat called?"}]
w2 = A.chat.completions.with_raw_response.create(model=model, messages=hist, max_tokens=20, temperature=0)
t2 = w2.parse()
k2 = kvt(t2)
print(f"     turn 2: prompt {t2.usage.prompt_tokens} {k2}; reply {t2.choices[0].message.content!r}")
check("turn 2: same session, turn 1's prompt and reply reused, only the tail decoded (< 25 tokens)",
      w2.headers.get("x-session-id") == w1.headers.get("x-session-id")
      and k2["prompt_tokens_reused"] >= t1.usage.prompt_tokens + t1.usage.completion_tokens - 1
      and k2["prompt_tokens_decoded"] < 25, str(k2))

cp = A.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
check("POST /v1/completions (client)", cp.object == "text_completion" and isinstance(cp.choices[0].text, str)
      and cp.choices[0].text and usage_ok(cp.usage, 6), str(cp))

# ---- tool calls ----------------------------------------------------------------------------
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
th = [{"role": "user", "content": "What is the weather in Paris today?"}]
w1 = A.chat.completions.with_raw_response.create(model=model, messages=th, tools=tools, tool_choice="required",
                                                 max_tokens=48, temperature=0)
t1 = w1.parse()
m1 = t1.choices[0].message
calls = m1.tool_calls or []
try:
    args = json.loads(calls[0].function.arguments) if calls else None
except ValueError:
    args = None
print(f"     required: {[(x.function.name, x.function.arguments) for x in calls]}")
check("tool_choice required: one call of get_weather, arguments {city: string}, finish_reason tool_calls",
      t1.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
      and calls[0].id and m1.content is None and isinstance(args, dict) and set(args) == {"city"}
      and isinstance(args["city"], str), str(m1))
th += [m1, {"role": "tool", "tool_call_id": calls[0].id if calls else "x", "content": '{"sky": "sunny", "temperature": 18}'}]
w2 = A.chat.completions.with_raw_response.create(model=model, messages=th, tools=tools, max_tokens=24, temperature=0)
t2 = w2.parse()
k2 = kvt(t2)
check("tool round trip: the echoed call continues the session (only the tool result decoded)",
      w2.headers.get("x-session-id") == w1.headers.get("x-session-id")
      and k2["prompt_tokens_reused"] >= t1.usage.prompt_tokens + t1.usage.completion_tokens - 1, str(k2))
a1 = A.chat.completions.create(model=model, messages=[{"role": "user", "content": "Who wrote Hamlet?"}], tools=tools,
                               tool_choice="auto", max_tokens=24, temperature=0)
ac = a1.choices[0].message.content
print(f"     auto, no tool needed: {ac!r}")
check("tool_choice auto: a question needing no tool is answered in plain text",
      isinstance(ac, str) and ac.strip() and not ac.startswith("{") and not a1.choices[0].message.tool_calls, str(a1))
# streamed, the plain-text reply comes piece by piece (its first character chose text), the same greedy text;
# a call (control: tool_choice required) still comes whole, in one delta
sa = list(A.chat.completions.create(model=model, messages=[{"role": "user", "content": "Who wrote Hamlet?"}], tools=tools,
                                    tool_choice="auto", max_tokens=24, temperature=0, stream=True))
pieces = [ch.choices[0].delta.content for ch in sa if ch.choices and ch.choices[0].delta.content]
check("tool_choice auto, stream: a plain-text reply is streamed in several deltas, the same text, no tool_calls",
      len(pieces) >= 2 and "".join(pieces) == ac and not any(ch.choices and ch.choices[0].delta.tool_calls for ch in sa),
      f"{len(pieces)} content deltas: {pieces!r}")
sr = list(A.chat.completions.create(model=model, messages=th, tools=tools, tool_choice="required", max_tokens=48,
                                    temperature=0, stream=True))
cd = [ch for ch in sr if ch.choices and ch.choices[0].delta.tool_calls]
check("tool_choice required, stream: the call comes whole in one delta, no content, finish_reason tool_calls",
      len(cd) == 1 and cd[0].choices[0].delta.tool_calls[0].function.name == "get_weather"
      and not any(ch.choices and ch.choices[0].delta.content for ch in sr)
      and [ch.choices[0].finish_reason for ch in sr if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"],
      f"{len(cd)} call deltas of {len(sr)} chunks")

# ---- errors the client raises ----------------------------------------------------------------
try:
    A.chat.completions.create(model=model, messages=q, tool_choice="required")
    check("tool_choice without tools -> BadRequestError", False, "no exception")
except openai.BadRequestError as e:
    check("tool_choice without tools -> BadRequestError naming it", "needs 'tools'" in str(e), str(e))
try:  # a chat's prompt may outgrow the budget (blocks are evicted); a completion's may not
    A.completions.create(model=model, prompt="apple " * 600, max_tokens=2)
    check("a completion prompt over the budget (512) -> BadRequestError", False, "no exception")
except openai.BadRequestError as e:
    check("a completion prompt over the budget (512) -> BadRequestError", "must fit the budget of 512" in str(e), str(e))
try:
    openai.OpenAI(base_url=BASE + "/v1", api_key="wrong-key", max_retries=0).models.list()
    check("a wrong API key -> AuthenticationError", False, "no exception")
except openai.AuthenticationError as e:
    check("a wrong API key -> AuthenticationError", "401" in str(e), str(e))
st, _, b = raw("GET", "/health", key=None)
check("still serving after the errors", st == 200, f"{st} {b}")

finish()
