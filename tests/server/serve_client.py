"""serve_client.py — what the black-box tests of `kvtier serve` share (serve_test.py and
serve_sched_test.py): checks that count failures, raw HTTP for what the openai client cannot
send, and /metrics lookups.  Call init(BASE_URL, DEFAULT_KEY) first; finish() prints the count
and exits with the number of failures (0 = all passed).
"""
import http.client
import json
import re
import sys
import urllib.parse

_u = None
_key = None
fails = 0


def init(base, key):
    global _u, _key
    _u, _key = urllib.parse.urlparse(base), key


def check(name, cond, why=""):
    """Print "ok   NAME" or "FAIL NAME: why" and count the failure."""
    global fails
    if cond:
        print(f"ok   {name}", flush=True)
    else:
        fails += 1
        print(f"FAIL {name}: {why}", flush=True)


def raw(method, path, body=None, key="default", headers=None, timeout=300):
    """(status, headers, parsed JSON or text).  body: dict/list (sent as JSON) or bytes; key:
    the bearer key ("default": the one given to init, None: no Authorization header)."""
    c = http.client.HTTPConnection(_u.hostname, _u.port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    key = _key if key == "default" else key
    if key:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    try:
        c.request(method, path, body=body, headers=h)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered before taking the whole body (a 401 or 413 at the headers): read it
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, r.headers, json.loads(data)
    except ValueError:
        return r.status, r.headers, data.decode("utf-8", "replace")


def metric(name):
    """The value of one /metrics line without labels (None if absent); read with the default key
    (/metrics needs one where the server has keys, unless --metrics-public)."""
    _, _, txt = raw("GET", "/metrics")
    m = re.search(rf"^{re.escape(name)} (\S+)$", txt, re.M)
    return float(m.group(1)) if m else None


def finish():
    print(f"{fails} failed")
    sys.exit(min(fails, 100))
