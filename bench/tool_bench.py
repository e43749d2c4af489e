"""tool_bench.py — how well the model behind a running server calls tools, through the openai client.

  python tool_bench.py --url http://127.0.0.1:8080 [--label NAME] [--json] [--show]

Cases: 12 cities x 2 questions (weather -> get_weather, local time -> get_time) and 6 questions
that need no tool.  Modes:
  required  tool_choice "required": is the call well-formed JSON under its schema (the grammar's
            job), the right function, the city named in the question?
  auto      tool_choice "auto": does the model call a tool for the 24 tool questions and answer
            in text for the 6 others (and is that text only the system message repeated, as a
            base model's may be)?
  control   the same system message as the server writes for tools (server/tools.c), sent
            as a plain system message without `tools`: no grammar.  How many free-text replies
            are a well-formed call of the right function anyway?
Prints a table (and one JSON line with --json).  Greedy, 48 tokens per reply, one request at a
time; latency is the client's wall time per request.
"""
import argparse
import json
import statistics
import time

import openai

CITIES = ["Paris", "Tokyo", "Oslo", "Cairo", "Lima", "Madrid", "Toronto", "Nairobi", "Seoul", "Berlin", "Sydney",
          "Chicago"]
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The current weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {
             "name": "get_time", "description": "The local time in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NO_TOOL = ["Write a short poem about the sea.", "What is two plus two?", "Say hello in French.",
           "Name three colours.", "Who wrote Hamlet?", "Tell me a joke about cats."]


# what server/tools.c puts in the system message for TOOLS (keep in step with it)
CONTROL_SYSTEM = ("You can call any of the following tools to satisfy the user's requests: " +
                  json.dumps([{k: v for k, v in t["function"].items()} for t in TOOLS], separators=(",", ":")) +
                  "\n\nTo call a tool, respond with only a JSON object, for example {\"tool_call\":{\"name\":\"tool_name\","
                  "\"arguments\":{\"arg1\":\"value\"}}}. To answer the user directly, respond in plain text.")


ECHO = "You can call any of the following tools"


def cases():
    for c in CITIES:
        yield f"What is the weather like in {c} right now?", "get_weather", c
        yield f"What time is it in {c}?", "get_time", c


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--label", default="kvtier")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--json", action="store_true", help="also print one JSON line")
    ap.add_argument("--show", action="store_true", help="print the auto replies to the questions needing no tool")
    a = ap.parse_args()
    cl = openai.OpenAI(base_url=a.url + "/v1", api_key=a.api_key, max_retries=0, timeout=300)

    def ask(q, choice):
        t0 = time.time()
        if choice == "control":
            r = cl.chat.completions.create(model="m", messages=[{"role": "system", "content": CONTROL_SYSTEM},
                                                                {"role": "user", "content": q}],
                                           max_tokens=48, temperature=0)
        else:
            r = cl.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], tools=TOOLS,
                                           tool_choice=choice, max_tokens=48, temperature=0)
        return r.choices[0], (time.time() - t0) * 1e3

    req = {"n": 0, "well_formed": 0, "right_function": 0, "right_city": 0, "ms": []}
    for q, fn, city in cases():
        ch, ms = ask(q, "required")
        req["n"] += 1
        req["ms"].append(ms)
        calls = ch.message.tool_calls or []
        try:
            args = json.loads(calls[0].function.arguments) if calls else None
        except ValueError:
            args = None
        ok = ch.finish_reason == "tool_calls" and len(calls) == 1 and isinstance(args, dict) and \
            set(args) == {"city"} and isinstance(args["city"], str)
        req["well_formed"] += ok
        req["right_function"] += ok and calls[0].function.name == fn
        req["right_city"] += ok and args["city"].strip().lower() == city.lower()
    auto = {"tool_q": 0, "tool_called": 0, "plain_q": 0, "plain_answered": 0, "plain_echo": 0, "ms": []}
    for q, _, _ in cases():
        ch, ms = ask(q, "auto")
        auto["tool_q"] += 1
        auto["ms"].append(ms)
        auto["tool_called"] += bool(ch.message.tool_calls)
    for q in NO_TOOL:
        ch, ms = ask(q, "auto")
        auto["plain_q"] += 1
        auto["ms"].append(ms)
        text = ch.message.content if not ch.message.tool_calls else None
        auto["plain_answered"] += bool(text)
        auto["plain_echo"] += bool(text) and ECHO in text  # a base model repeating the system message
        if a.show:
            print(f"  auto {q!r}: {(text or ch.message.tool_calls)!r}"[:160])
    free = {"n": 0, "well_formed": 0, "right_function": 0}
    for q, fn, _ in cases():
        ch, _ = ask(q, "control")
        free["n"] += 1
        try:
            o = json.loads(ch.message.content or "")
            c = o.get("tool_call") if isinstance(o, dict) else None
            ok = isinstance(c, dict) and isinstance(c.get("arguments"), dict) and isinstance(c["arguments"].get("city"), str)
        except ValueError:
            ok, c = False, None
        free["well_formed"] += ok
        free["right_function"] += ok and c.get("name") == fn
    out = {"label": a.label, "control": free, "required": {k: v for k, v in req.items() if k != "ms"},
           "required_ms_p50": round(statistics.median(req["ms"]), 1),
           "auto": {k: v for k, v in auto.items() if k != "ms"}, "auto_ms_p50": round(statistics.median(auto["ms"]), 1)}
    n = req["n"]
    print(f"{a.label}: tool_choice=required, {n} tool questions")
    print(f"  well-formed call under the schema  {req['well_formed']}/{n}")
    print(f"  right function                     {req['right_function']}/{n}")
    print(f"  right city (exact)                 {req['right_city']}/{n}")
    print(f"  latency p50                        {out['required_ms_p50']} ms")
    print(f"{a.label}: tool_choice=auto")
    print(f"  tool questions answered by a call  {auto['tool_called']}/{auto['tool_q']}")
    print(f"  other questions answered in text   {auto['plain_answered']}/{auto['plain_q']}")
    print(f"  ... text repeating the system msg  {auto['plain_echo']}/{auto['plain_q']}")
    print(f"  latency p50                        {out['auto_ms_p50']} ms")
    print(f"{a.label}: control (the same system message, no tools, no grammar)")
    print(f"  well-formed call in the free text  {free['well_formed']}/{free['n']}")
    print(f"  ... of the right function          {free['right_function']}/{free['n']}")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
