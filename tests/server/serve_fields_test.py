"""serve_fields_test.py — walks the field tables (server/fields.c, printed by `kvtier serve
--print-api` as docs/API.md) against a live server: every field of each API is honoured, or refused
with a 400 naming it, or accepted at its neutral value only, or accepted with no effect by design;
a wrong JSON type is a 400 naming the field; a field no table names is answered 200 and listed back
in usage.kvtier.ignored_fields.  Issue #39: on 10fe331 fields were accepted and silently ignored
(echo, best_of: answered 200 without effect, as the issue measured; n_keep, chat_template_kwargs,
reasoning_effort, session_id, Responses' include were in its lists of accepted fields and never
read); each is a 400 naming it here unless it carries its neutral value (id_slot is honoured now,
as the session "slot-N"; Anthropic's thinking has no effect by design).

Usage: serve_fields_test.py BASE_URL API_MD   (API_MD: the output of `kvtier serve --print-api`)
"""
import json
import sys

from serve_client import check, finish, init, raw

BASE, MD = sys.argv[1], sys.argv[2]
init(BASE, None)

# the tables, parsed from the Markdown the server printed
tables, cur, routes, in_routes = {}, None, [], False
for line in open(MD):
    if line.startswith("## "):
        in_routes, cur = line.strip() == "## Routes", None
    elif line.startswith("### "):
        cur = tables.setdefault(line[4:].strip(), [])
    elif in_routes and line.startswith("| ") and "`" in line:
        m, path, key = [c.strip() for c in line.strip().strip("|").split("|")][:3]
        routes.append({"methods": m, "path": path.strip("`"), "key": key})
    elif cur is not None and line.startswith("| `"):
        cells = [c.strip() for c in line.strip().strip("|").replace("\\|", "\x00").split("|")]
        name, types, apis, status, neutral = cells[0].strip("`"), cells[1], cells[2], cells[3], cells[4].strip("`")
        cur.append({"name": name, "types": types, "apis": apis, "status": status,
                    "neutral": [json.loads(v) for v in neutral.split("\x00")] if neutral else []})
check("the tables: three, with the fields of five APIs", len(tables) == 3 and sum(len(t) for t in tables.values()) > 90,
      str({k: len(v) for k, v in tables.items()}))

HI = {"role": "user", "content": "Hi"}


def route(table, row):
    """(path, base body, usage getter) for a field of a table"""
    if table.startswith("OpenAI Responses"):
        return "/v1/responses", {"input": "Hi", "max_output_tokens": 1}, lambda b: b.get("usage", {})
    if table.startswith("Anthropic"):
        return "/v1/messages", {"messages": [HI], "max_tokens": 1}, lambda b: b.get("usage", {})
    apis = row["apis"]
    if "chat" in apis:
        return "/v1/chat/completions", {"messages": [HI], "max_tokens": 1}, lambda b: b.get("usage", {})
    if "completions" in apis:
        return "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, lambda b: b.get("usage", {})
    return "/completion", {"prompt": "Hi", "n_predict": 1}, None


def valid(types):
    """a value of the first allowed type (the shape a no-effect field is sent with)"""
    for t, v in (("a string", "x"), ("an object", {}), ("a boolean", False), ("an array", []),
                 ("an integer", 0), ("a number", 0)):
        if t in types:
            return v
    raise ValueError(types)


def other(row):
    """a value of an allowed type that is none of the neutral values"""
    types = row["types"]
    for t, v in (("a boolean", True), ("an integer", 7), ("a number", 0.5), ("a string", "zzz"),
                 ("an array", ["zzz"]), ("an object", {"zzz": 1})):
        if t in types and not any(v == n and type(v) is type(n) for n in row["neutral"]):
            return v
    raise ValueError(row)


def wrong(types):
    """a value of a type the field does not take"""
    for t, v in (("a string", "x"), ("an object", {"x": 1}), ("an array", ["x"]), ("a boolean", True), ("a number", 1.5)):
        if t not in types and not (t == "a number" and "an integer" in types):  # 1.5 for an integer: kept out
            return v
    return None


def param(b):
    if not isinstance(b, dict):
        return None
    err = b.get("error")
    return err.get("param") if isinstance(err, dict) else None


def anth_named(b, name):
    """Anthropic errors have no param: the message names the field"""
    return isinstance(b, dict) and name in json.dumps(b.get("error", {}))


counts = {}
for table, rows in tables.items():
    for row in rows:
        name, st = row["name"], row["status"]
        path, base, _ = route(table, row)
        named = (lambda b, n=name: anth_named(b, n)) if table.startswith("Anthropic") else (lambda b, n=name: param(b) == n)
        w = wrong(row["types"])
        if w is not None and name not in base:
            s, _, b = raw("POST", path, {**base, name: w})
            check(f"{path} '{name}' of the wrong type ({type(w).__name__}) -> 400 naming it", s == 400 and named(b), f"{s} {str(b)[:200]}")
        if st.startswith("refused"):
            v = other({**row, "neutral": []})
            s, _, b = raw("POST", path, {**base, name: v})
            check(f"{path} refused '{name}': {json.dumps(v)} -> 400 naming it", s == 400 and named(b), f"{s} {str(b)[:200]}")
        elif st.startswith("accepted at a neutral"):
            v = other(row)
            s, _, b = raw("POST", path, {**base, name: v})
            check(f"{path} '{name}' {json.dumps(v)} (not its neutral value) -> 400 naming it", s == 400 and named(b), f"{s} {str(b)[:200]}")
            for n in row["neutral"][:2]:
                s, _, b = raw("POST", path, {**base, name: n})
                check(f"{path} '{name}' at its neutral value {json.dumps(n)} -> 200", s == 200, f"{s} {str(b)[:200]}")
        elif st.startswith("accepted, no effect") and name not in base:
            s, _, b = raw("POST", path, {**base, name: valid(row["types"])})
            check(f"{path} '{name}' (no effect by design) -> 200", s == 200, f"{s} {str(b)[:200]}")
        counts[st] = counts.get(st, 0) + 1
print("# rows by status:", counts)

# a field no table names: 200, listed back (and the JSON type or value of it does not matter)
for path, body in (("/v1/chat/completions", {"messages": [HI], "max_tokens": 1}),
                   ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                   ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
                   ("/v1/messages", {"messages": [HI], "max_tokens": 1})):
    s, _, b = raw("POST", path, {**body, "frobnicate_level": {"deep": [1, 2]}, "x_other": 1})
    ign = (b.get("usage", {}).get("kvtier", {}) or {}).get("ignored_fields") if isinstance(b, dict) else None
    check(f"{path}: unknown fields -> 200, listed in usage.kvtier.ignored_fields", s == 200 and sorted(ign or []) == ["frobnicate_level", "x_other"],
          f"{s} {str(b)[:300]}")
    s, _, b = raw("POST", path, body)
    check(f"{path}: no unknown field -> no ignored_fields", s == 200 and "ignored_fields" not in json.dumps(b.get("usage", {})), str(b)[:200])
# many unknown fields: at most 16 listed, names cut to 63 bytes, control characters shown as '?'
many = {f"f{i:03d}" + "y" * 100: i for i in range(40)}
many["a\u0001b"] = 1
s, _, b = raw("POST", "/v1/chat/completions", {"messages": [HI], "max_tokens": 1, **many})
ign = b.get("usage", {}).get("kvtier", {}).get("ignored_fields", []) if s == 200 else []
check("41 unknown fields: 16 listed, each at most 63 bytes, no control character",
      len(ign) == 16 and all(len(n.encode()) <= 63 and not any(ord(c) < 32 for c in n) for n in ign), f"{s} {ign[:3]}")
# an honoured field that changes the reply's shape: llama-server's response_fields (unstreamed native)
s, _, b = raw("POST", "/completion", {"prompt": "Hi", "n_predict": 4, "response_fields": ["content", "generation_settings/n_predict", "nope/x"]})
check("response_fields: only the named fields, 'a/b' named so, a missing one left out",
      s == 200 and sorted(b) == ["content", "generation_settings/n_predict"] and b["generation_settings/n_predict"] == 4, f"{s} {str(b)[:200]}")
s, _, b = raw("POST", "/completion", {"prompt": "Hi", "n_predict": 4, "response_fields": []})
check("response_fields [] -> the whole reply", s == 200 and "generation_settings" in b and "content" in b, f"{s} {str(b)[:200]}")
s, _, b = raw("POST", "/completion", {"prompt": "Hi", "n_predict": 4, "stream": True, "response_fields": ["content"]})
check("response_fields with stream -> 400 naming it", s == 400 and param(b) == "response_fields", f"{s} {str(b)[:200]}")

# id_slot N: the session "slot-N", reused by the next request naming it
conv = [{"role": "user", "content": "Name three colours."}]
s1, _, b1 = raw("POST", "/v1/chat/completions", {"messages": conv, "max_tokens": 8, "id_slot": 3})
conv2 = conv + [{"role": "assistant", "content": b1["choices"][0]["message"]["content"] if s1 == 200 else ""},
                {"role": "user", "content": "And three more."}]
s2, _, b2 = raw("POST", "/v1/chat/completions", {"messages": conv2, "max_tokens": 8, "id_slot": 3})
k2 = b2.get("usage", {}).get("kvtier", {}) if s2 == 200 else {}
check("id_slot 3: the session 'slot-3', its KV reused by the next request naming it",
      s1 == 200 and b1["usage"]["kvtier"]["session_id"] == "slot-3" and k2.get("session_id") == "slot-3"
      and k2.get("prompt_tokens_reused", 0) > 0, f"{s1} {s2} {k2}")

# the route table: each route answers its methods only (405 naming them), at the prefixes it names (404 elsewhere)
check("the route table has the five APIs' routes", len(routes) >= 20 and any(r["path"] == "/v1/messages" for r in routes), str(len(routes)))
for r in routes:
    path = r["path"].replace("ID", "resp_0000")
    forms = [path.replace("[/v1]", ""), path.replace("[/v1]", "/v1")] if "[/v1]" in path else [path]
    if r["methods"] != "any":
        allowed = r["methods"].split(" or ")
        wrong_m = next(m for m in ("PUT", "PATCH") if m not in allowed)
        for form in forms:
            s, _, b = raw(wrong_m, form, {})
            msg = b.get("error", {}).get("message", "") if isinstance(b, dict) else ""
            check(f"{wrong_m} {form} -> 405 naming {r['methods']}", s == 405 and f"use {r['methods']}" in msg, f"{s} {msg[:120]}")
    listed = {f for q in routes for f in ([q["path"].replace("[/v1]", ""), q["path"].replace("[/v1]", "/v1")]
                                           if "[/v1]" in q["path"] else [q["path"]])}
    other = path[3:] if path.startswith("/v1/") else "/v1" + path
    if "[/v1]" not in path and path != "/metrics" and other not in listed:  # /completions and /v1/completions: two APIs
        s, _, b = raw("POST" if "POST" in r["methods"] else "GET", other, {})
        check(f"{other} (the route is {path} only) -> 404", s == 404, f"{s} {str(b)[:120]}")

# JSON-schema keywords (issue #39): compiled into the grammar, or the request refused naming the keyword
import re  # noqa: E402

DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
COMPILED = [
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     lambda v: isinstance(v, list) and 2 <= len(v) <= 3 and all(isinstance(x, int) for x in v)),
    ("maxItems 0", {"type": "array", "maxItems": 0}, lambda v: v == []),
    ("minLength/maxLength", {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
                             "required": ["s"]}, lambda v: 2 <= len(v["s"]) <= 5),
    ("minimum 0 (integer)", {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 3, "maxItems": 3},
     lambda v: len(v) == 3 and all(isinstance(x, int) and x >= 0 for x in v)),
    ("minimum 1 (integer)", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"]},
     lambda v: isinstance(v["n"], int) and v["n"] >= 1),
    ("format date", {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
     lambda v: re.fullmatch(DATE, v["d"])),
    ("format date-time", {"type": "object", "properties": {"t": {"type": "string", "format": "date-time"}}, "required": ["t"]},
     lambda v: re.fullmatch(DATE + "T" + TIME, v["t"])),
    ("format uuid", {"type": "object", "properties": {"u": {"type": "string", "format": "uuid"}}, "required": ["u"]},
     lambda v: re.fullmatch(r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}", v["u"])),
    ("local $ref ($defs, allOf of one, as pydantic writes)",
     {"$defs": {"P": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
                      "required": ["name", "age"]}},
      "type": "object", "properties": {"who": {"allOf": [{"$ref": "#/$defs/P"}]}}, "required": ["who"]},
     lambda v: len(v["who"]["name"]) <= 8 and isinstance(v["who"]["age"], int) and v["who"]["age"] >= 0),
    ("recursive $ref (definitions)",
     {"definitions": {"T": {"type": "object", "properties": {"v": {"type": "integer"},
                                                               "kids": {"type": "array", "items": {"$ref": "#/definitions/T"}, "maxItems": 2}},
                            "required": ["v", "kids"]}}, "$ref": "#/definitions/T"},
     lambda v: isinstance(v["v"], int) and isinstance(v["kids"], list) and len(v["kids"]) <= 2),
]
# SmolLM2 opens another child rather than close a list at any seed, so the recursive schema's
# replies would all run to max_tokens: a bias toward the tokens that close a list lets a whole
# value end in time (the grammar still decides what may come; a grammar without ']' there gives none)
_, _, closers = raw("POST", "/tokenize", {"content": "]"})
_, _, closers2 = raw("POST", "/tokenize", {"content": "[]"})
CLOSE = {str(t): 5 for t in (closers.get("tokens", []) + closers2.get("tokens", []))}
for name, schema, ok in COMPILED:
    whole = 0
    for seed in (1, 2, 3):
        body = {"messages": [{"role": "user", "content": "Give me some JSON."}], "max_tokens": 120, "temperature": 1.0, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        if name.startswith("recursive"):
            body["logit_bias"] = CLOSE
        s, _, b = raw("POST", "/v1/chat/completions", body)
        text = b["choices"][0]["message"]["content"] if s == 200 else ""
        fin = b["choices"][0]["finish_reason"] if s == 200 else None
        try:
            good = fin == "length" or bool(ok(json.loads(text)))  # a reply cut by max_tokens is not a whole value
        except (ValueError, KeyError, TypeError):
            good = False
        check(f"schema {name}, seed {seed}: the reply holds it", s == 200 and good, f"{s} {fin} {text[:200]!r} {str(b)[:200]}")
        whole += fin == "stop"
    check(f"schema {name}: a whole value in one of 3 replies at least (not all cut by max_tokens)", whole >= 1, f"{whole} of 3")
for kw, schema in (("pattern", {"type": "string", "pattern": "^a+$"}), ("maximum", {"type": "integer", "maximum": 9}),
                   ("minimum", {"type": "integer", "minimum": 5}), ("format", {"type": "string", "format": "email"}),
                   ("not", {"not": {"type": "string"}}), ("uniqueItems", {"type": "array", "uniqueItems": True}),
                   ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}), ("$ref", {"$ref": "https://example.com/s.json"}),
                   ("$ref", {"$ref": "#/$defs/missing"}), ("allOf", {"allOf": [{"type": "string"}, {"maxLength": 3}]}),
                   ("maxLength", {"type": "string", "maxLength": 100000})):
    for where, body in (("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
                        ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                            "type": "object", "properties": {"a": schema}, "required": ["a"]}}}]})):
        s, _, b = raw("POST", "/v1/chat/completions", {"messages": [HI], "max_tokens": 4, **body})
        msg = b.get("error", {}).get("message", "") if isinstance(b, dict) else ""
        check(f"schema keyword '{kw}' not compiled ({json.dumps(schema)[:50]}) in {where} -> 400 naming it",
              s == 400 and f"'{kw}'" in msg and param(b) == where, f"{s} {msg[:200]}")

finish()
