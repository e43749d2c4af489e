"""serve_responses_store_test.py — stored responses outlive the process (server/respdb.c).

Run by cli_serve_responses_store.sh: BIN MODEL TMPDIR.  Each server is a real `kvtier serve`
on a free port; the store is a real directory (SQLite index) kept between them.

  1. a 4-turn Responses conversation on server A (a ~600-token document planted in turn 1); the
     5th turn asked on A (the reference, same run);
  2. A stopped (SIGTERM), B started on the same store: GET of every turn equals A's object; the
     5th turn continued on B from the 4th's id rebuilds the same prompt (input_tokens equal to
     A's) and finds most of it in the store (cached_tokens); another key: 404 on GET and on
     continuing; DELETE of turn 3 on B, then a restart: it stays deleted, and continuing turn 4
     fails naming it;
  3. a row changed on disk (one byte of its body): never served (GET 404, continuing its child
     500 naming it), `kvtier store verify` exits 1 and counts it, --repair removes it;
  4. --response-quota 2: three first turns of one key, a restart: the oldest is gone, the other
     two are there; the other key's response is untouched;
  5. --response-ttl 2: a response is there, then 3 s later gone, in RAM and after a restart;
  6. two servers on one store, one writing responses while the other reads them at once: every
     read is a whole response (200 with the id and its output) or 404, never an error;
  7. control: with --no-store a restart forgets every response (the checks above can fail);
  8. with one redis-server (skipped, and said so, where it is not installed): servers X and Y with
     stores of their own and one --redis-secret-file: Y continues X's conversation (the prompt
     rebuilt in full, its KV mostly from Redis), GETs X's turns, refuses them to another key; a
     DELETE on Y is seen by X (404 there too, though X kept the response in RAM); a value
     planted in Redis under a response's key is refused (its MAC), never served; Y without the
     secret file (a server outside the fleet) cannot read X's rows.
"""
import http.client
import shutil
import socket
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

BIN, MODEL, TMP = sys.argv[1], sys.argv[2], sys.argv[3]
STORE = os.path.join(TMP, "store")
KEYS = os.path.join(TMP, "keys")
with open(KEYS, "w") as f:
    f.write("key-a\nkey-b\n")
fails = 0


def check(name, cond, why=""):
    global fails
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else f": {why}"), flush=True)
    fails += 0 if cond else 1


class Server:
    def __init__(self, tag, *extra, store=True):
        self.err = os.path.join(TMP, f"{tag}.err")
        args = [BIN, "serve", "-m", MODEL, "--port", "0", "--threads", "2", "--api-key-file", KEYS, "--budget", "1024",
                "-c", "4096"] + (["--store", STORE] if store else ["--no-store"]) + list(extra)
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.err, "w"))
        self.port = None
        for _ in range(600):
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", open(self.err).read())
            if m:
                self.port = int(m.group(1))
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.2)
        raise SystemExit(f"server {tag} did not start: " + open(self.err).read()[-1500:])

    def req(self, method, path, body=None, key="key-a"):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        h = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        c.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, data.decode(errors="replace")

    def turn(self, text, prev=None, key="key-a", n=8):
        body = {"model": "m", "input": text, "max_output_tokens": n, "temperature": 0}
        if prev:
            body["previous_response_id"] = prev
        return self.req("POST", "/v1/responses", body, key)

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        return self.p.wait(timeout=120)


WORDS = ("the river mill lantern harbor orchard comet glacier violin stone garden window winter summer market "
         "bridge quiet old north road letter clock paper music forest light small village").split()
doc = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(450))
T1 = f"Here are my notes: {doc}\nThe code of the blue locker is 4917. Say OK."
TURNS = [T1, "What season comes after winter?", "Name a musical instrument.", "Name a color."]

# ---- 1. four turns on A, the fifth as the reference ------------------------------------------
A = Server("A")
ids, objs, prev = [], [], None
for t in TURNS:
    st, o = A.turn(t, prev)
    check(f"A: turn {len(ids) + 1} stored (200)", st == 200 and isinstance(o, dict) and o.get("id"), f"{st} {str(o)[:200]}")
    if st != 200:
        raise SystemExit(1)
    ids.append(o["id"])
    objs.append(o)
    prev = o["id"]
st, ref = A.turn("What is the code of the blue locker?", ids[-1])
check("A: the 5th turn (reference)", st == 200, str(ref)[:200])
check("A stops cleanly (SIGTERM)", A.stop() == 0)

# ---- 2. B on the same store --------------------------------------------------------------------
B = Server("B")
for i, rid in enumerate(ids):
    st, o = B.req("GET", f"/v1/responses/{rid}")
    check(f"B: GET turn {i + 1} after the restart equals A's object", st == 200 and o == objs[i],
          f"{st} {str(o)[:200]} vs {str(objs[i])[:200]}")
st, o = B.req("GET", f"/v1/responses/{ids[1]}", key="key-b")
check("B: another key's GET is 404", st == 404, f"{st} {str(o)[:200]}")
st, o = B.turn("What is the code?", ids[-1], key="key-b")
check("B: another key cannot continue the conversation (404)", st == 404, f"{st} {str(o)[:200]}")
st, o = B.turn("What is the code of the blue locker?", ids[-1])
u, ru = (o.get("usage") or {}) if st == 200 else {}, ref.get("usage") or {}
check("B: the 5th turn after the restart rebuilds the whole conversation (input_tokens as on A)",
      st == 200 and u.get("input_tokens") == ru.get("input_tokens") and ru.get("input_tokens", 0) > 500,
      f"{st} {u} vs {ru}")
cached = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
check("B: most of its prompt's KV comes from the block store (cached_tokens >= 75 %)",
      u.get("input_tokens") and cached >= 0.75 * u["input_tokens"], f"{u}")
st, o = B.req("DELETE", f"/v1/responses/{ids[2]}")
check("B: DELETE turn 3", st == 200 and o.get("deleted") is True, f"{st} {o}")
check("B stops cleanly", B.stop() == 0)
C = Server("C")
st, o = C.req("GET", f"/v1/responses/{ids[2]}")
check("C: the deleted turn stays deleted after a restart (404)", st == 404, f"{st} {str(o)[:200]}")
st, o = C.turn("And the code?", ids[3])
check("C: continuing turn 4 fails naming the deleted turn 3 (404)",
      st == 404 and ids[2] in json.dumps(o), f"{st} {str(o)[:300]}")
st, o = C.req("GET", f"/v1/responses/{ids[1]}")
check("C: turn 2 is still there", st == 200 and o == objs[1], f"{st}")
check("C stops cleanly", C.stop() == 0)

# ---- 3. a row changed on disk ------------------------------------------------------------------
db = sqlite3.connect(os.path.join(STORE, "index.db"))
body = db.execute("SELECT body FROM responses WHERE id = ?", (ids[1],)).fetchone()[0]
body = bytes(body)
i = body.index(b'"content"')
db.execute("UPDATE responses SET body = ? WHERE id = ?", (body[:i + 12] + b"X" + body[i + 13:], ids[1]))
db.commit()
db.close()
D = Server("D")
st, o = D.req("GET", f"/v1/responses/{ids[1]}")
check("D: a response changed on disk is not served (GET 404)", st == 404, f"{st} {str(o)[:200]}")
st, o = D.turn("Name a fruit.", ids[1])
check("D: continuing it fails naming it and the MAC (500)",
      st == 500 and ids[1] in json.dumps(o) and "MAC" in json.dumps(o), f"{st} {str(o)[:300]}")
st, o = D.req("GET", f"/v1/responses/{ids[0]}")
check("D: the rows around it are served", st == 200 and o == objs[0], f"{st}")
check("D stops cleanly", D.stop() == 0)
v = subprocess.run([BIN, "store", "verify", "--store", STORE, "--json"], capture_output=True, text=True)
try:
    vj = json.loads(v.stdout)
except ValueError:
    vj = {}
check("store verify: exit 1 and the changed response counted corrupt",
      v.returncode == 1 and vj.get("responses", {}).get("corrupt") == 1, f"rc {v.returncode} {v.stdout[-400:]} {v.stderr[-400:]}")
v = subprocess.run([BIN, "store", "verify", "--store", STORE, "--repair", "--json"], capture_output=True, text=True)
v2 = subprocess.run([BIN, "store", "verify", "--store", STORE, "--json"], capture_output=True, text=True)
try:
    vj2 = json.loads(v2.stdout)
except ValueError:
    vj2 = {}
check("store verify --repair removes it; verify is clean again",
      v.returncode == 0 and v2.returncode == 0 and vj2.get("responses", {}).get("corrupt") == 0
      and vj2.get("responses", {}).get("ok", 0) >= 2, f"{v.returncode} {v2.returncode} {v2.stdout[-400:]}")

# ---- 4. per-key quota on disk ------------------------------------------------------------------
E = Server("E", "--response-quota", "2")
st, ob = E.turn("Say yes.", key="key-b", n=2)
q = []
for t in ("Say one.", "Say two.", "Say three."):
    st, o = E.turn(t, n=2)
    q.append(o.get("id") if st == 200 else None)
check("E: three first turns stored", all(q), str(q))
check("E stops cleanly", E.stop() == 0)
F = Server("F")
got = [F.req("GET", f"/v1/responses/{x}")[0] for x in q]
check("F: --response-quota 2 kept the key's two most recent (404, 200, 200)", got == [404, 200, 200], str(got))
st, o = F.req("GET", f"/v1/responses/{ob.get('id')}", key="key-b")
check("F: the other key's response is not touched by this key's quota", st == 200, f"{st}")
check("F stops cleanly", F.stop() == 0)

# ---- 5. TTL ------------------------------------------------------------------------------------
G = Server("G", "--response-ttl", "2")
st, o = G.turn("Say hello.", n=2)
tid = o.get("id")
st1, _ = G.req("GET", f"/v1/responses/{tid}")
time.sleep(3.2)
st2, _ = G.req("GET", f"/v1/responses/{tid}")
st3, o3 = G.turn("Again.", tid, n=2)
check("G: --response-ttl 2: there (200), 3 s later gone in RAM (404), and not continuable (404)",
      (st1, st2, st3) == (200, 404, 404), f"{st1} {st2} {st3} {str(o3)[:200]}")
check("G stops cleanly", G.stop() == 0)
H = Server("H")
st, _ = H.req("GET", f"/v1/responses/{tid}")
check("H: the expired response is gone on disk too (404)", st == 404, f"{st}")

# ---- 6. two servers, one writing while the other reads -------------------------------------------


def read_while_writing(writer, reader, n=8):
    """writer stores an n-turn conversation while a thread GETs each response on reader as soon
    as its id is known, until it is found: (reads that were whole responses, 404s, anything
    else), and the last id."""
    written, seen, bad = [], {"200": 0, "404": 0}, []
    done = threading.Event()

    def poll():
        while True:
            for rid in list(written):
                st_, o_ = reader.req("GET", f"/v1/responses/{rid}")
                if st_ == 200 and isinstance(o_, dict) and o_.get("id") == rid and isinstance(o_.get("output"), list):
                    seen["200"] += 1
                    written.remove(rid)
                elif st_ == 404:
                    seen["404"] += 1
                else:
                    bad.append((st_, str(o_)[:200]))
            if done.is_set() and not written:
                break
            time.sleep(0.01)

    th = threading.Thread(target=poll)
    th.start()
    last = None
    for k in range(n):
        st_, o_ = writer.turn(f"Count {k}.", last, n=2)
        if st_ == 200:
            last = o_["id"]
            written.append(last)
    done.set()
    th.join(timeout=300)
    return seen, bad, last


W = Server("W")
seen, bad, prev = read_while_writing(W, H)
check("two servers on one store: every read during the writes was a whole response or 404 (8 written, all read)",
      not bad and seen["200"] == 8, f"{seen} {bad[:3]}")
st, o = H.turn("And next?", prev, n=2)
check("the reading server continues the writer's conversation (200)", st == 200, f"{st} {str(o)[:200]}")
check("W and H stop cleanly", W.stop() == 0 and H.stop() == 0)

# ---- 7. control: without a store a restart forgets -------------------------------------------------
N = Server("N", store=False)
st, o = N.turn("Say hi.", n=2)
nid = o.get("id")
st1, _ = N.req("GET", f"/v1/responses/{nid}")
N.stop()
N = Server("N2", store=False)
st2, _ = N.req("GET", f"/v1/responses/{nid}")
check("control --no-store: the response is there (200), and gone after a restart (404)", (st1, st2) == (200, 404), f"{st1} {st2}")
N.stop()
# ---- 8. two servers, separate stores, one Redis ----------------------------------------------------
if not shutil.which("redis-server"):
    print("SKIP section 8: redis-server is not installed (Debian: apt-get install redis-server)")
else:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        rport = so.getsockname()[1]
    rdir = os.path.join(TMP, "redis")
    os.makedirs(rdir)
    rs = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--dir", rdir, "--save", "",
                           "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", rport), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    sec = os.path.join(TMP, "redis-secret")
    with open(sec, "wb") as f:
        f.write(os.urandom(32))
    url = f"redis://127.0.0.1:{rport}/0"

    def fleet(tag, secret=True):
        global STORE
        saved, STORE = STORE, os.path.join(TMP, f"store-{tag}")
        try:
            return Server(tag, "--redis", url, *(["--redis-secret-file", sec] if secret else []))
        finally:
            STORE = saved

    X = fleet("X")
    xids, xobjs, prev = [], [], None
    for t in TURNS:
        st, o = X.turn(t, prev)
        if st != 200:
            check("X: a turn", False, f"{st} {str(o)[:200]}")
            break
        xids.append(o["id"])
        xobjs.append(o)
        prev = o["id"]
    st, xref = X.turn("What is the code of the blue locker?", xids[-1])
    time.sleep(1.0)  # X's Redis writer puts the blocks (asynchronous, as a user's next turn would find them)
    Y = fleet("Y")
    st, o = Y.turn("What is the code of the blue locker?", xids[-1])
    u, ru = (o.get("usage") or {}) if st == 200 else {}, xref.get("usage") or {}
    check("Y (its own store) continues X's conversation through Redis: the whole prompt (input_tokens as on X)",
          st == 200 and u.get("input_tokens") == ru.get("input_tokens"), f"{st} {str(o)[:300]} vs {ru}")
    cached = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
    check("Y: most of that prompt's KV comes from Redis (cached_tokens >= 75 %)",
          u.get("input_tokens") and cached >= 0.75 * u["input_tokens"], f"{u}")
    st, o = Y.req("GET", f"/v1/responses/{xids[0]}")
    check("Y: GET of X's first turn equals X's object", st == 200 and o == xobjs[0], f"{st} {str(o)[:200]}")
    st, o = Y.req("GET", f"/v1/responses/{xids[0]}", key="key-b")
    check("Y: another key cannot read it (404)", st == 404, f"{st}")
    st, o = Y.turn("And the code?", xids[-1], key="key-b")
    check("Y: another key cannot continue it (404)", st == 404, f"{st}")
    st, o = X.req("GET", f"/v1/responses/{xids[1]}")
    check("X: turn 2 is there before the delete", st == 200, f"{st}")
    st, o = Y.req("DELETE", f"/v1/responses/{xids[1]}")
    check("Y: DELETE of X's turn 2", st == 200, f"{st} {o}")
    st, o = X.req("GET", f"/v1/responses/{xids[1]}")
    check("X: the turn deleted on Y is gone on X too (404; X held it in RAM)", st == 404, f"{st} {str(o)[:200]}")
    # a value planted in Redis under the key of X's turn 3 (as anyone who can write the Redis could)
    import urllib.parse
    rc = subprocess.run(["redis-cli", "-p", str(rport), "--scan", "--pattern", f"kvt:rec:resp:*:{xids[2]}"],
                        capture_output=True, text=True)
    key = rc.stdout.strip().splitlines()[0] if rc.stdout.strip() else ""
    subprocess.run(["redis-cli", "-p", str(rport), "SET", key, json.dumps(
        {"parent": xids[1], "created": 1, "expires": 0, "body": json.dumps({"turn": [], "object": {}}), "mac": "00" * 32})],
        capture_output=True)
    Z = fleet("Z")
    st, o = Z.req("GET", f"/v1/responses/{xids[2]}")
    check("Z: a value planted in Redis is refused (its MAC), not served (404)", key and st == 404, f"{key!r} {st} {str(o)[:200]}")
    st, o = Z.req("GET", f"/v1/responses/{xids[0]}")
    check("Z: X's untouched turn 1 is served", st == 200 and o == xobjs[0], f"{st}")
    # X writing a conversation while Y reads each response as soon as its id is known: through
    # Redis every read is the whole response or 404, never a part or an error
    seen8, bad8, _ = read_while_writing(X, Y)
    check("through Redis: every read while X wrote was a whole response or 404 (8 written, all read on Y)",
          not bad8 and seen8["200"] == 8, f"{seen8} {bad8[:3]}")
    V = fleet("V", secret=False)
    st, o = V.req("GET", f"/v1/responses/{xids[0]}")
    check("V (no --redis-secret-file: outside the fleet) cannot read X's rows (404)", st == 404, f"{st} {str(o)[:200]}")
    for srv_ in (X, Y, Z, V):
        srv_.stop()
    rs.terminate()
    rs.wait()

# every server's stderr: no sanitizer report (the suite runs this script in the ASan/UBSan build too)
import glob as _glob  # noqa: E402
reports = [f for f in _glob.glob(os.path.join(TMP, "*.err"))
           if re.search(r"AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:", open(f, errors="replace").read())]
check("no sanitizer report in any server's stderr", not reports, str(reports))
print(f"{fails} failure(s)")
sys.exit(1 if fails else 0)
