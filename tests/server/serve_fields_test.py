"""serve_fields_test.py — walks the field tables (server/fields.c, printed by `kvtier serve
--print-api` as docs/API.md) against a live server: every field of each API is honoured, or refused
with a 400 naming it, or accepted at its neutral value only, or accepted with no effect by design;
a wrong JSON type is a 400 naming the field; a field no table names is answered 200 and listed back
in usage.kvtier.ignored_fields.  Issue #39: on 10fe331 fields were accepted and silently ignored
(echo, best_of: answered 200 without effect, as the issue measured; n_keep, chat_template_kwargs,
reasoning_effort, id_slot, session_id, Anthropic's thinking, Responses' include were in its lists
of accepted fields and never read); each is a 400 naming it here unless it carries its neutral
value.

Usage: serve_fields_test.py BASE_URL API_MD   (API_MD: the output of `kvtier serve --print-api`)
"""
import json
import sys

from serve_client import check, finish, init, raw

BASE, MD = sys.argv[1], sys.argv[2]
init(BASE, None)

# the tables, parsed from the Markdown the server printed
tables, cur = {}, None
for line in open(MD):
    if line.startswith("## "):
        cur = tables.setdefault(line[3:].strip(), [])
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
        if t not in types and not (t == "a number" and "an integer" in types and False):
            if t == "a number" and "an integer" in types:
                continue  # 1.5 is refused as a non-integer, but keep the clear cases
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
finish()
