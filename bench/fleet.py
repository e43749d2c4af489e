"""fleet.py — several `kvtier serve` behind HAProxy, with one redis-server: the fleet users run.

Each server has a block store of its own (as on separate machines); they share one Redis (KV
blocks and stored responses, `--redis`) and one `--redis-secret-file` (values MACed under it;
tenants derived from it, so an API key is the same tenant on every server).  HAProxy (Debian's
package; scripts/bootstrap.sh installs it) balances them: round-robin, or with affinity on a
header where the balancer can hash it (`--balance hdr:X-Session-Id`, `hdr:Authorization` for the
API key; round-robin for requests without it).  HAProxy cannot hash previous_response_id (it is
in the JSON body), and does not need to: every server reads the conversation from Redis.  No
request router is written here.  Health checks on /health take a dead server out within ~0.5 s;
a request sent to it meanwhile is retried on another (retry-on conn-failure, redispatch).

As a library (tests/server/serve_fleet_test.py):

    f = Fleet(bin, model, root, n=2)      # starts redis-server, n servers, haproxy
    f.url                                  # http://127.0.0.1:PORT (the balancer)
    f.stop(i); f.start(i); f.kill(i)       # SIGTERM / start again (same port, store) / SIGKILL
    f.close()

As a command (bench/fleet.sh): `python3 bench/fleet.py serve --bin B --model M --servers N`
starts the fleet and prints its URL until interrupted; `python3 bench/fleet.py bench ...` runs the
figures of docs/BENCHMARKS.md (per-turn TTFT through the fleet, against one server and against
llama-server given the whole conversation each turn; Redis bytes per turn).
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc=None, seconds=120, what="server"):
    t_end = time.time() + seconds
    while time.time() < t_end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode}")
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {seconds} s")


def wait_health(port, proc, seconds=180):
    t_end = time.time() + seconds
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"kvtier serve exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"kvtier serve on port {port} not healthy within {seconds} s")


class Fleet:
    def __init__(self, bin, model, root, n=2, keys=("key-a", "key-b"), balance="roundrobin", extra=(), redis=True):
        self.bin, self.model, self.root, self.n = bin, model, root, n
        self.extra = list(extra)
        self.procs = [None] * n
        self.ports = [free_port() for _ in range(n)]
        os.makedirs(root, exist_ok=True)
        self.keys_file = os.path.join(root, "keys")
        with open(self.keys_file, "w") as f:
            f.write("".join(k + "\n" for k in keys))
        self.secret = os.path.join(root, "redis-secret")
        with open(self.secret, "wb") as f:
            f.write(os.urandom(32))
        self.redis = None
        self.redis_port = None
        if redis:
            self.redis_port = free_port()
            rdir = os.path.join(root, "redis")
            os.makedirs(rdir, exist_ok=True)
            self.redis = subprocess.Popen(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", rdir,
                                           "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
            wait_port(self.redis_port, self.redis, 30, "redis-server")
        self.haproxy = None
        try:
            for i in range(n):
                self.start(i)
            self.port = free_port()
            self._haproxy(balance)
        except BaseException:
            self.close()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def _haproxy(self, balance):
        if balance.startswith("hdr:"):
            how = f"balance hdr({balance[4:]})\n    hash-type consistent"
        elif balance == "roundrobin":
            how = "balance roundrobin"
        else:
            raise ValueError(f"balance '{balance}': roundrobin or hdr:NAME")
        servers = "\n".join(f"    server s{i} 127.0.0.1:{p} check inter 500ms fall 1 rise 2" for i, p in enumerate(self.ports))
        cfg = f"""global
    maxconn 1024
defaults
    mode http
    timeout connect 2s
    timeout client 900s
    timeout server 900s
    timeout http-request 60s
    retries 3
    option redispatch
    option http-buffer-request
    retry-on conn-failure empty-response
frontend fe
    bind 127.0.0.1:{self.port}
    default_backend kvtier
backend kvtier
    {how}
    option httpchk GET /health
    http-check expect status 200
    http-response set-header X-Kvtier-Backend %[srv_name]
{servers}
"""
        path = os.path.join(self.root, "haproxy.cfg")
        with open(path, "w") as f:
            f.write(cfg)
        self.haproxy_log = open(os.path.join(self.root, "haproxy.log"), "w")
        self.haproxy = subprocess.Popen(["haproxy", "-f", path, "-db"], stdout=self.haproxy_log, stderr=subprocess.STDOUT)
        wait_port(self.port, self.haproxy, 30, "haproxy")
        # every server up in haproxy's eyes (rise 2 x 500 ms) before the first request
        time.sleep(1.2)

    def start(self, i):
        store = os.path.join(self.root, f"store{i}")
        args = [self.bin, "serve", "-m", self.model, "--port", str(self.ports[i]), "--api-key-file", self.keys_file,
                "--store", store] + self.extra
        if self.redis:
            args += ["--redis", f"redis://127.0.0.1:{self.redis_port}/0", "--redis-secret-file", self.secret]
        err = open(os.path.join(self.root, f"server{i}.log"), "a")
        self.procs[i] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
        err.close()
        wait_health(self.ports[i], self.procs[i])

    def stop(self, i):
        p = self.procs[i]
        if p and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=120)
        self.procs[i] = None
        return p.returncode if p else None

    def kill(self, i):
        p = self.procs[i]
        if p and p.poll() is None:
            p.kill()
            p.wait(timeout=60)
        self.procs[i] = None

    def close(self):
        for i in range(self.n):
            try:
                self.kill(i)
            except Exception:
                pass
        for p in (self.haproxy, self.redis):
            if p and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()

    def redis_cmd(self, *args):
        return subprocess.run(["redis-cli", "-p", str(self.redis_port)] + [str(a) for a in args], capture_output=True,
                              text=True).stdout


def post(url, path, body, key, headers=None, timeout=900):
    """(status, parsed JSON, response headers, seconds)."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}", **(headers or {})})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}, time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        data = e.read()
        try:
            j = json.loads(data)
        except ValueError:
            j = data.decode(errors="replace")
        return e.code, j, {k.lower(): v for k, v in e.headers.items()}, time.perf_counter() - t0


def get(url, path, key, timeout=60):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace"), {k.lower(): v for k, v in e.headers.items()}


WORDS = ("the river mill lantern harbor orchard comet glacier violin stone garden window winter summer market "
         "bridge quiet old north road letter clock paper music forest light small village").split()
QUESTIONS = ["What season comes after winter?", "Name a musical instrument.", "Name a color.", "Name a fruit.",
             "What is two plus two?", "Name a bird.", "Name a tree.", "Name a city.", "Name a planet.", "Name a metal."]


def conversation(n_doc_words=700, turns=20):
    """The turns of the planted-fact conversation: a document with the fact, small talk, the question."""
    doc = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n_doc_words))
    first = f"Here are my notes: {doc}\nThe code of the blue locker is 4917. Say OK."
    mid = [QUESTIONS[i % len(QUESTIONS)] for i in range(turns - 2)]
    return [first] + mid + ["What is the code of the blue locker? Answer with the number."]


def cmd_serve(a):
    root = tempfile.mkdtemp(prefix="kvt-fleet-")
    f = Fleet(a.bin, a.model, root, a.servers, balance=a.balance, extra=a.extra.split() if a.extra else [])
    print(f"fleet: {a.servers} kvtier serve behind haproxy at {f.url} (keys key-a, key-b; redis :{f.redis_port}; "
          f"logs in {root}); Ctrl-C stops it", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        f.close()
        shutil.rmtree(root, ignore_errors=True)


def run_conversation(url, turns, key, n_out, label, stateless=False, model="m"):
    """Per turn: (seconds, input_tokens, cached_tokens, backend).  stateless: the whole
    conversation resent each turn as chat messages (llama-server's way)."""
    rows, prev, msgs = [], None, []
    for k, text in enumerate(turns):
        if stateless:
            msgs.append({"role": "user", "content": text})
            st, o, h, dt = post(url, "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": n_out,
                                                               "temperature": 0, "cache_prompt": True}, key)
            if st != 200:
                raise RuntimeError(f"{label}: turn {k + 1}: {st} {str(o)[:300]}")
            msgs.append({"role": "assistant", "content": o["choices"][0]["message"]["content"]})
            u = o.get("usage") or {}
            rows.append((dt, u.get("prompt_tokens"), (o.get("timings") or {}).get("cache_n"), h.get("x-kvtier-backend", "")))
        else:
            body = {"model": model, "input": text, "max_output_tokens": n_out, "temperature": 0}
            if prev:
                body["previous_response_id"] = prev
            st, o, h, dt = post(url, "/v1/responses", body, key)
            if st != 200:
                raise RuntimeError(f"{label}: turn {k + 1}: {st} {str(o)[:300]}")
            prev = o["id"]
            u = o.get("usage") or {}
            rows.append((dt, u.get("input_tokens"), (u.get("input_tokens_details") or {}).get("cached_tokens"),
                         h.get("x-kvtier-backend", "")))
        print(f"  {label:10s} turn {k + 1:2d}: {dt:6.3f} s  prompt {rows[-1][1]}  cached {rows[-1][2]}  {rows[-1][3]}",
              file=sys.stderr, flush=True)
    return rows


def redis_bytes(f):
    info = f.redis_cmd("INFO", "stats")
    for line in info.splitlines():
        if line.startswith("total_net_output_bytes:"):
            out = int(line.split(":")[1])
        if line.startswith("total_net_input_bytes:"):
            inp = int(line.split(":")[1])
    return inp, out


def cmd_bench(a):
    root = tempfile.mkdtemp(prefix="kvt-fleet-bench-")
    turns = conversation(a.doc_words, a.turns)
    out = {"model": os.path.basename(a.model), "turns": a.turns, "doc_words": a.doc_words, "servers": a.servers,
           "date": time.strftime("%Y-%m-%d"), "commit": subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)),
                                                                        "rev-parse", "--short", "HEAD"], capture_output=True,
                                                                       text=True).stdout.strip(),
           "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")}
    extra = a.extra.split() if a.extra else []
    try:
        f = Fleet(a.bin, a.model, os.path.join(root, "fleet"), a.servers, extra=extra)
        in0, out0 = redis_bytes(f)
        fleet_rows = run_conversation(f.url, turns, "key-a", a.n_out, "fleet")
        in1, out1 = redis_bytes(f)
        f.close()
        fa = Fleet(a.bin, a.model, os.path.join(root, "fleet-aff"), a.servers, balance="hdr:Authorization", extra=extra)
        aff_rows = run_conversation(fa.url, turns, "key-a", a.n_out, "affinity")
        fa.close()
        one = Fleet(a.bin, a.model, os.path.join(root, "one"), 1, extra=extra, redis=False)
        one_rows = run_conversation(one.url, turns, "key-a", a.n_out, "one")
        one.close()
        ls_rows = None
        if a.llama_server and os.path.exists(a.llama_server):
            port = free_port()
            p = subprocess.Popen([a.llama_server, "-m", a.model, "--port", str(port), "-c", str(a.ctx), "-np", "1",
                                  "-t", str(a.threads)], stdout=subprocess.DEVNULL, stderr=open(os.path.join(root, "ls.log"), "w"))
            try:
                wait_health(port, p)
                ls_rows = run_conversation(f"http://127.0.0.1:{port}", turns, "none", a.n_out, "llama-srv", stateless=True)
            finally:
                p.terminate()
                p.wait(timeout=60)
        out["redis_bytes_in_per_turn"] = (in1 - in0) / a.turns
        out["redis_bytes_out_per_turn"] = (out1 - out0) / a.turns
        out["rows"] = {"fleet": fleet_rows, "fleet_affinity": aff_rows, "one_server": one_rows,
                       "llama_server_stateless": ls_rows}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    aff_rows = out["rows"]["fleet_affinity"]
    print(f"| turn | fleet ({a.servers} servers, round-robin) | fleet, affinity on the API key | one server | "
          "llama-server, whole conversation resent |")
    print("|---:|---:|---:|---:|---:|")
    for k in range(a.turns):
        ls = f"{out['rows']['llama_server_stateless'][k][0]:.3f} s" if ls_rows else "-"
        print(f"| {k + 1} | {fleet_rows[k][0]:.3f} s ({fleet_rows[k][3]}, cached {fleet_rows[k][2]}/{fleet_rows[k][1]}) | "
              f"{aff_rows[k][0]:.3f} s ({aff_rows[k][3]}) | {one_rows[k][0]:.3f} s | {ls} |")
    print(f"median turns 2..: fleet {med([r[0] for r in fleet_rows[1:]]):.3f} s, affinity {med([r[0] for r in aff_rows[1:]]):.3f} s, "
          f"one server {med([r[0] for r in one_rows[1:]]):.3f} s"
          + (f", llama-server {med([r[0] for r in ls_rows[1:]]):.3f} s" if ls_rows else ""))
    bpt = out["redis_bytes_in_per_turn"] + out["redis_bytes_out_per_turn"]
    print(f"Redis bytes per turn: {out['redis_bytes_in_per_turn']:.0f} in, {out['redis_bytes_out_per_turn']:.0f} out")
    # on paper: a server turns a conversation every median-turn seconds; one Redis link carries
    # link / bytes-per-turn turns a second, so it feeds that many such servers before it limits
    t_turn = med([r[0] for r in fleet_rows[1:]])
    out["servers_per_redis"] = {}
    for gbit in (1, 10):
        turns_per_s = gbit * 1e9 / 8 / max(bpt, 1)
        out["servers_per_redis"][f"{gbit}Gb/s"] = turns_per_s * t_turn
        print(f"one Redis at {gbit} Gb/s: {turns_per_s:,.0f} turns/s, ~{turns_per_s * t_turn:,.0f} servers turning a "
              f"conversation every {t_turn:.3f} s (Redis bytes only; this fleet's mix of local and Redis hits)")
    if a.json:
        with open(a.json, "w") as fj:
            json.dump(out, fj, indent=1)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("serve", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--bin", default="build/kvtier")
        p.add_argument("--model", default=os.environ.get("KVTIER_CHAT_MODEL", ""))
        p.add_argument("--servers", type=int, default=2)
        p.add_argument("--extra", default="--threads 1 --budget 2048 -c 4096", help="more kvtier serve flags")
        if name == "serve":
            p.add_argument("--balance", default="roundrobin", help="roundrobin, or hdr:NAME (affinity on that header)")
        else:
            p.add_argument("--turns", type=int, default=20)
            p.add_argument("--doc-words", type=int, default=700)
            p.add_argument("--n-out", type=int, default=16)
            p.add_argument("--llama-server", default="", help="llama-server binary (scripts/bootstrap.sh llama-server-path)")
            p.add_argument("--ctx", type=int, default=4096)
            p.add_argument("--threads", type=int, default=1)
            p.add_argument("--json", default="")
    a = ap.parse_args()
    if not a.model:
        ap.error("--model (or $KVTIER_CHAT_MODEL) is required")
    return cmd_serve(a) if a.cmd == "serve" else cmd_bench(a)


if __name__ == "__main__":
    sys.exit(main())
