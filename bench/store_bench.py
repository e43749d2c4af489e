"""store_bench.py — the block store (kvtier.h section 8) measured through `kvtier serve`.

Two benchmarks; each starts and stops its own servers (restarts are part of what is measured):

  ttft      Warm TTFT against a cold prefill at several prompt sizes (default 1k, 4k, 8k tokens):
            cold (empty store), RAM hit (same server, a new session), disk hit after a restart
            (page cache warm; and cold when /proc/sys/vm/drop_caches is writable), another
            server through Redis (a redis-server on a free port: server A computes the prompt,
            server B starts on an empty store; skipped with --no-redis), and PARTIAL (the first
            half of the prompt cached).  TTFT = a non-streamed request with
            max_tokens 1 (prefill + one token), wall clock at the client.
  edgesync  EdgeSync-LLM's workload run for real: R requests (default 1000) drawn Zipf(s) over C
            clusters (default 8); a cluster is a system prompt + a document of 1-2k tokens, a
            request asks one of its questions (distinct questions and rephrasings), max_tokens 8.
            Configurations: kvtier with its store, a fresh session per request (every reuse goes
            through the store); the same with the client's own sessions (no header: the server
            picks the session by prefix); no cache (--no-store, fresh sessions: every prompt
            prefilled; run on the first --baseline-requests requests); an exact-response cache
            (a client-side dict keyed by the request: its hit ratio is measured on the trace,
            its misses cost the no-cache run's measured mean, as it would pay a prefill).
            Reports average / p50 / p99 TTFT, token hit ratio (prompt tokens not prefilled),
            store bytes.

  prefetch  The store's prefetch (kvt_store_prefetch), A/B with --prefetch / --no-prefetch
            alternating in one run (--repeats pairs, the order flipped each pair): (1) disk hit
            after a restart with the page cache dropped (--prefetch-size tokens); (2) server B
            served from Redis (a redis-server started on a free port; server A computes the
            prompt once, every B starts on an empty store); (3) queued requests: --parallel 1,
            --clients requests at once whose prompts (--queued-size tokens each) are in the
            store, page cache dropped; each request's latency (queue wait + prefill + --gen
            tokens) at the client.  Reports TTFT / latency and the tiers the blocks came from
            (the server's /metrics before it stops).

  ram       Host RAM held for block copies (issue #12: the store replaces the host pool): K sessions
            (--ram-sessions, default 4) share one document (--ram-doc tokens, default 1536) under a
            --budget (512) below it, so each evicts while its prompt is decoded; each asks its own
            question, then a second one.  Per binary (--bin, and --bin-before: an older build, to
            compare): /metrics after the last request, host RAM = kvtier_pool_ram_bytes (the host pool,
            or the store's private entries) + kvtier_store_bytes{tier="ram"} (content entries), and
            spill bytes; the replies (greedy: equal replies = the same K/V loaded) and TTFT.

  python bench/store_bench.py ttft --bin build/kvtier --model M [--sizes 1024,4096,8192] [--json F]
  python bench/store_bench.py ram --bin build/kvtier [--bin-before OLD/kvtier] --model M [--json F]
  python bench/store_bench.py prefetch --bin build/kvtier --model M [--repeats 3] [--json F]
  python bench/store_bench.py edgesync --bin build/kvtier --model M [--requests 1000] [--json F]

Text: ../shared/data/pg_essays when present (natural English), else a deterministic word salad.
"""
import argparse
import glob
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    f = int(k)
    return xs[f] if f + 1 >= len(xs) else xs[f] + (xs[f + 1] - xs[f]) * (k - f)


def corpus_words():
    d = os.path.join(HERE, "..", "..", "shared", "data", "pg_essays")
    files = sorted(f for f in glob.glob(os.path.join(d, "*.txt")) if "LICENSE" not in f)
    words = []
    for f in files:
        words += open(f, encoding="utf-8", errors="replace").read().split()
    if len(words) > 50000:
        return words, "pg_essays"
    rnd = random.Random(7)
    vocab = ("the river mill lantern harbor orchard comet glacier violin stone garden window winter summer market "
             "bridge quiet old north road letter clock paper music forest light small village").split()
    return [rnd.choice(vocab) for _ in range(200000)], "synthetic"


class Server:
    def __init__(self, a, store, extra, log):
        args = [a.bin, "serve", "-m", a.model, "--port", "0", "--threads", str(a.threads)] + shlex.split(a.serve_args) + extra
        args += ["--store", store] if store else ["--no-store"]
        self.log = open(log, "w")
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.log)
        self.port = None
        for _ in range(600):
            txt = open(log).read()
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", txt)
            if m:
                self.port = int(m.group(1))
                break
            if self.p.poll() is not None:
                raise SystemExit("server exited: " + txt[-2000:])
            time.sleep(0.2)
        if not self.port:
            raise SystemExit("server did not start")

    def chat(self, messages, max_tokens=1, session=None):
        body = {"model": "m", "temperature": 0, "max_tokens": max_tokens, "messages": messages}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        if session:
            req.add_header("X-Session-Id", session)
        t0 = time.perf_counter()
        res = json.load(urllib.request.urlopen(req, timeout=3600))
        return time.perf_counter() - t0, res

    def metrics(self):
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60).read().decode()

    def stop(self):
        self.p.terminate()
        rc = self.p.wait(timeout=600)
        self.log.close()
        if rc != 0:
            raise SystemExit(f"server exit status {rc}")


def drop_page_cache():
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def kv(res):
    return res["usage"]["kvtier"]


def build_info(a):
    out = subprocess.run([a.bin, "--version"], capture_output=True, text=True).stdout.strip()
    try:
        commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    return {"kvtier": out, "commit": commit, "model": os.path.basename(a.model), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": open("/proc/cpuinfo").read().split("model name")[1].split(":")[1].split("\n")[0].strip(), "cores": os.cpu_count()}


def ttft(a):
    words, src = corpus_words()
    sizes = [int(x) for x in a.sizes.split(",")]
    rows = []
    for n in sizes:
        # ~0.75 words per token for English: pick words until the server says the prompt has n tokens
        nw = int(n * 0.72)
        doc = " ".join(words[:nw])
        # PARTIAL: the first half of the same text, then other text
        alt = " ".join(words[:nw // 2] + words[len(words) - (nw - nw // 2):])
        msgs = [{"role": "system", "content": doc}, {"role": "user", "content": "Summarize the text in one sentence."}]
        half = [{"role": "system", "content": alt}, {"role": "user", "content": "Summarize the text in one sentence."}]
        budget = ((n + 600) // 64 + 1) * 64
        extra = ["--budget", str(budget), "-c", str(2 * budget), "--parallel", "1"]
        store = tempfile.mkdtemp(prefix="kvt-store-bench-")
        log = os.path.join(store, "..", os.path.basename(store) + ".log")
        try:
            s = Server(a, store, extra, log)
            t_cold, r_cold = s.chat(msgs, session="cold")
            t_ram, r_ram = s.chat(msgs, session="ram")
            t_part, r_part = s.chat(half, session="partial")
            s.stop()
            s = Server(a, store, extra, log)
            t_disk, r_disk = s.chat(msgs, session="disk-warm")
            s.stop()
            t_redis = r_redis = redis_mb = None
            if not a.no_redis and shutil.which("redis-server"):
                # another server through Redis: A (a store of its own) computes the prompt and
                # writes it behind to Redis as it stops; B starts on an empty store
                rp, rport, rdir = start_redis()
                try:
                    rb = ["--redis", f"redis://127.0.0.1:{rport}/0", "--redis-timeout-ms", str(a.redis_timeout_ms)]
                    s = Server(a, store + "-A", extra + rb, log)
                    s.chat(msgs, session="redis-A")
                    s.stop()
                    redis_mb = redis_value_mb(rport)
                    s = Server(a, store + "-B", extra + rb, log)
                    t_redis, r_redis = s.chat(msgs, session="redis-B")
                    s.stop()
                finally:
                    rp.terminate()
                    rp.wait()
                    shutil.rmtree(rdir, ignore_errors=True)
                    shutil.rmtree(store + "-A", ignore_errors=True)
                    shutil.rmtree(store + "-B", ignore_errors=True)
            dropped = drop_page_cache()
            t_dcold = None
            if dropped:
                s = Server(a, store, extra, log)
                t_dcold, r_dcold = s.chat(msgs, session="disk-cold")
                s.stop()
            store_mb = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(store) for f in fs) / 2**20
        finally:
            shutil.rmtree(store, ignore_errors=True)
        row = {"prompt_tokens": r_cold["usage"]["prompt_tokens"], "cold_s": t_cold, "ram_s": t_ram, "disk_warm_s": t_disk,
               "redis_s": t_redis, "redis_route": kv(r_redis)["store"] if r_redis else None,
               "redis_from_store": kv(r_redis)["prompt_tokens_from_store"] if r_redis else None,
               "disk_cold_s": t_dcold, "partial_s": t_part, "routes": [kv(r)["store"] for r in (r_cold, r_ram, r_disk, r_part)],
               "from_store": [kv(r)["prompt_tokens_from_store"] for r in (r_cold, r_ram, r_disk, r_part)],
               "partial_prompt_tokens": r_part["usage"]["prompt_tokens"], "store_mb": store_mb, "redis_mb": redis_mb}
        rows.append(row)
        print(f"{row['prompt_tokens']:6d} tokens: cold {t_cold:7.3f} s | RAM {t_ram:6.3f} s ({t_cold / t_ram:5.1f}x) | "
              f"disk after restart {t_disk:6.3f} s ({t_cold / t_disk:5.1f}x)"
              + (f" | page cache dropped {t_dcold:6.3f} s ({t_cold / t_dcold:5.1f}x)" if t_dcold else "")
              + (f" | Redis, another server {t_redis:6.3f} s ({t_cold / t_redis:5.1f}x, {row['redis_route']}"
                 f" {row['redis_from_store']})" if t_redis else "")
              + f" | partial {t_part:6.3f} s ({t_cold / t_part:4.1f}x) | routes {row['routes']} from store {row['from_store']}"
              f" | store {store_mb:.1f} MiB" + (f", Redis values {redis_mb:.1f} MiB" if redis_mb is not None else ""), flush=True)
    out = {"bench": "ttft", "serve_args": a.serve_args, "text": src, "page_cache_drop": dropped, "info": build_info(a), "rows": rows}
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return out


QUESTIONS = ["What is the main argument of the document?", "Who is the intended reader of this text?",
             "Name one example the author gives.", "What does the author conclude?", "Is the tone optimistic or pessimistic?",
             "Which claim is the most surprising?", "What would a critic say about it?", "Give a title for the document.",
             "What problem does the text describe?", "What advice does the author give?"]
REPHRASE = ["", "Briefly: ", "In one sentence, ", "Please answer: "]


def edgesync(a):
    words, src = corpus_words()
    rnd = random.Random(a.seed)
    clusters = []
    pos = 0
    for c in range(a.clusters):
        nw = rnd.randint(750, 1500)  # ~1-2k tokens
        clusters.append(f"You are assistant {c} for the archive. Answer from the document below.\n\n" + " ".join(words[pos:pos + nw]))
        pos += nw
    w = [1 / (k + 1) ** a.zipf for k in range(a.clusters)]
    trace = []
    for _ in range(a.requests):
        c = rnd.choices(range(a.clusters), weights=w)[0]
        q = rnd.choice(REPHRASE) + rnd.choice(QUESTIONS)
        trace.append((c, q))
    budget = 2560
    extra = ["--budget", str(budget), "-c", str(budget * 8), "--parallel", "1"]
    results = {}

    def run(label, store, fresh, n):
        d = tempfile.mkdtemp(prefix="kvt-edgesync-")
        log = d + ".log"
        s = Server(a, os.path.join(d, "store") if store else None, extra, log)
        ts, hit_tok, all_tok, routes = [], 0, 0, {}
        t0 = time.time()
        for i, (c, q) in enumerate(trace[:n]):
            t, r = s.chat([{"role": "system", "content": clusters[c]}, {"role": "user", "content": q}], max_tokens=8,
                          session=f"r{i}" if fresh else None)
            ts.append(t)
            u = r["usage"]
            all_tok += u["prompt_tokens"]
            hit_tok += u["prompt_tokens"] - kv(r)["prompt_tokens_decoded"]
            routes[kv(r)["store"]] = routes.get(kv(r)["store"], 0) + 1
            if (i + 1) % 100 == 0:
                print(f"  {label}: {i + 1}/{n} requests, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        m = s.metrics()
        s.stop()
        sb = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(d) for f in fs)
        shutil.rmtree(d, ignore_errors=True)
        os.unlink(log)
        res = {"requests": n, "avg_s": statistics.mean(ts), "p50_s": pct(ts, 50), "p99_s": pct(ts, 99),
               "token_hit_ratio": hit_tok / all_tok, "routes": routes, "store_bytes": sb}
        results[label] = res
        print(f"{label:34s} {n:5d} req  TTFT avg {res['avg_s']:.3f} s  p50 {res['p50_s']:.3f}  p99 {res['p99_s']:.3f}  "
              f"token hit ratio {res['token_hit_ratio']:.3f}  routes {routes}  store {sb / 2**20:.1f} MiB", flush=True)
        return ts

    run("kvtier store, fresh session each", True, True, a.requests)
    run("kvtier store, sessions by prefix", True, False, a.requests)
    base = run("no cache (--no-store, fresh sessions)", False, True, min(a.baseline_requests, a.requests))
    seen, hits = set(), 0
    for c, q in trace:
        hits += (c, q) in seen
        seen.add((c, q))
    mean_miss = statistics.mean(base)
    results["exact-response cache"] = {"requests": a.requests, "hit_ratio": hits / a.requests,
                                       "avg_s": (a.requests - hits) * mean_miss / a.requests,
                                       "note": "hits: 0 s; misses: the no-cache run's measured mean"}
    print(f"{'exact-response cache':34s} hit ratio {hits / a.requests:.3f}  TTFT avg {(a.requests - hits) * mean_miss / a.requests:.3f} s"
          f" (misses at the no-cache mean {mean_miss:.3f} s)")
    out = {"bench": "edgesync", "text": src, "clusters": a.clusters, "zipf": a.zipf, "info": build_info(a), "results": results}
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return out


def metric_map(text):
    """The block store's counters from /metrics: {"hits:ram": n, "prefetch:promoted": n, ...}."""
    out = {}
    for line in text.splitlines():
        m = re.match(r'kvtier_store_(hits|misses)_total\{tier="(\w+)"\} (\d+)', line)
        if m:
            out[m.group(1) + ":" + m.group(2)] = int(m.group(3))
        m = re.match(r'kvtier_store_prefetch_total\{what="(\w+)"\} (\d+)', line)
        if m:
            out["prefetch:" + m.group(1)] = int(m.group(2))
    return out


def start_redis():
    import socket
    so = socket.socket()
    so.bind(("127.0.0.1", 0))
    port = so.getsockname()[1]
    so.close()
    d = tempfile.mkdtemp(prefix="kvt-bench-redis-")
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p, port, d
        except OSError:
            time.sleep(0.1)
    raise SystemExit("redis-server did not start")


def redis_value_mb(port):
    """MiB of the values in the Redis on port (STRLEN of every key: what the servers wrote)."""
    cli = ["redis-cli", "-p", str(port), "--no-raw"]
    keys = subprocess.run(cli[:3] + ["--scan"], capture_output=True, text=True, check=True).stdout.split()
    total = 0
    for k in keys:
        out = subprocess.run(cli[:3] + ["STRLEN", k], capture_output=True, text=True, check=True).stdout.strip()
        total += int(out) if out.isdigit() else 0
    return total / 2**20


def prefetch_ab(a):
    import threading
    words, src = corpus_words()
    info = build_info(a)
    dropped = drop_page_cache()
    if not dropped:
        print("note: /proc/sys/vm/drop_caches is not writable: disk reads come from the page cache", flush=True)

    def prompt(offset, n):
        nw = int(n * 0.72)
        return [{"role": "system", "content": " ".join(words[offset:offset + nw])},
                {"role": "user", "content": "Summarize the text in one sentence."}]

    budget = ((a.prefetch_size + 600) // 64 + 1) * 64
    base = ["--budget", str(budget), "-c", str(2 * budget), "--parallel", "1"]
    modes = lambda r: (["off", "on"] if r % 2 == 0 else ["on", "off"])
    flag = {"on": ["--prefetch"], "off": ["--no-prefetch"]}
    res = {"disk_cold": [], "redis": [], "queued": []}
    root = tempfile.mkdtemp(prefix="kvt-prefetch-bench-")
    rp = None
    try:
        # (1) disk hit after restart, page cache dropped
        msgs = prompt(0, a.prefetch_size)
        store = os.path.join(root, "store1")
        s = Server(a, store, base + ["--no-prefetch"], os.path.join(root, "s1.log"))
        t_cold, r_cold = s.chat(msgs, session="cold")
        s.stop()
        print(f"(1) prompt {r_cold['usage']['prompt_tokens']} tokens, cold prefill {t_cold:.2f} s", flush=True)
        for r in range(a.repeats):
            for mode in modes(r):
                s = Server(a, store, base + flag[mode], os.path.join(root, "s1.log"))
                drop_page_cache()
                t, rr = s.chat(msgs, session=f"d{r}{mode}")
                m = metric_map(s.metrics())
                s.stop()
                row = {"mode": mode, "repeat": r, "ttft_s": t, "route": kv(rr)["store"],
                       "from_store": kv(rr)["prompt_tokens_from_store"], "metrics": m}
                res["disk_cold"].append(row)
                print(f"(1) disk, cache dropped, prefetch {mode:3s}: TTFT {t:.3f} s  route {row['route']}  {m}", flush=True)
        # (2) server B from Redis
        rp, rport, rdir = start_redis()
        url = f"redis://127.0.0.1:{rport}/0"
        rb = ["--redis", url, "--redis-timeout-ms", str(a.redis_timeout_ms)]
        s = Server(a, os.path.join(root, "storeA"), base + rb + ["--no-prefetch"], os.path.join(root, "s2.log"))
        s.chat(msgs, session="A")
        s.stop()  # writes its Redis queue out
        for r in range(a.repeats):
            for mode in modes(r):
                sb = os.path.join(root, f"storeB-{r}-{mode}")
                s = Server(a, sb, base + rb + flag[mode], os.path.join(root, "s2.log"))
                t, rr = s.chat(msgs, session=f"b{r}{mode}")
                m = metric_map(s.metrics())
                s.stop()
                shutil.rmtree(sb, ignore_errors=True)
                row = {"mode": mode, "repeat": r, "ttft_s": t, "route": kv(rr)["store"],
                       "from_store": kv(rr)["prompt_tokens_from_store"], "metrics": m}
                res["redis"].append(row)
                print(f"(2) server B from Redis, prefetch {mode:3s}: TTFT {t:.3f} s  route {row['route']}  {m}", flush=True)
        # (3) queued requests, --parallel 1
        qb = ((a.queued_size + 600) // 64 + 1) * 64
        qbase = ["--budget", str(qb), "-c", str((a.clients + 1) * qb), "--parallel", "1", "--max-sessions", str(a.clients)]
        qmsgs = [prompt(20000 + 5000 * c, a.queued_size) for c in range(a.clients)]
        store = os.path.join(root, "store3")
        s = Server(a, store, qbase + ["--no-prefetch"], os.path.join(root, "s3.log"))
        for c in range(a.clients):
            s.chat(qmsgs[c], session=f"fill{c}")
        s.stop()
        for r in range(a.repeats):
            for mode in modes(r):
                s = Server(a, store, qbase + flag[mode], os.path.join(root, "s3.log"))
                drop_page_cache()
                lat = [None] * a.clients
                routes = [None] * a.clients

                def one(c):
                    t, rr = s.chat(qmsgs[c], max_tokens=a.gen, session=f"q{r}{mode}{c}")
                    lat[c] = t
                    routes[c] = kv(rr)["store"]
                th = [threading.Thread(target=one, args=(c,)) for c in range(a.clients)]
                for t_ in th:
                    t_.start()
                    time.sleep(0.02)  # arrival order
                for t_ in th:
                    t_.join()
                m = metric_map(s.metrics())
                s.stop()
                row = {"mode": mode, "repeat": r, "latency_s": lat, "mean_s": statistics.mean(lat), "routes": routes, "metrics": m}
                res["queued"].append(row)
                print(f"(3) {a.clients} queued clients, prefetch {mode:3s}: latency {[round(x, 3) for x in lat]} mean "
                      f"{row['mean_s']:.3f} s routes {routes}  {m}", flush=True)
    finally:
        if rp:
            rp.terminate()
            rp.wait()
        shutil.rmtree(root, ignore_errors=True)
    summary = {}
    for k, key in (("disk_cold", "ttft_s"), ("redis", "ttft_s"), ("queued", "mean_s")):
        for mode in ("off", "on"):
            xs = [row[key] for row in res[k] if row["mode"] == mode]
            if xs:
                summary[f"{k}:{mode}"] = {"median": statistics.median(xs), "min": min(xs), "n": len(xs)}
    for k, v in summary.items():
        print(f"{k:16s} median {v['median']:.3f} s  min {v['min']:.3f} s  (n {v['n']})")
    out = {"bench": "prefetch", "text": src, "page_cache_drop": dropped, "info": info, "results": res, "summary": summary}
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return out


def gauge(text, name):
    m = re.search("^" + re.escape(name) + r" (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


def host_ram(a):
    words, src = corpus_words()
    doc = " ".join(words[:int(a.ram_doc * 0.72)])
    K, budget = a.ram_sessions, a.ram_budget
    extra = ["--budget", str(budget), "-c", str((K + 1) * budget), "--max-sessions", str(K), "--parallel", "1",
             "--store-ram-mb", "1024"]
    runs = []
    for label, binary in [("after", a.bin)] + ([("before", a.bin_before)] if a.bin_before else []):
        b = argparse.Namespace(**vars(a))
        b.bin = binary
        store = tempfile.mkdtemp(prefix="kvt-ram-bench-")
        log = store + ".log"
        try:
            s = Server(b, store, extra, log)
            replies, ttfts, usage = [], [], []
            for turn in range(2):
                for k in range(K):
                    q = QUESTIONS[(2 * k + turn) % len(QUESTIONS)]
                    msgs = [{"role": "system", "content": doc}]
                    if turn == 1:
                        msgs += [{"role": "user", "content": QUESTIONS[2 * k % len(QUESTIONS)]},
                                 {"role": "assistant", "content": replies[k]}]
                    msgs.append({"role": "user", "content": q})
                    t, r = s.chat(msgs, max_tokens=8, session=f"s{k}")
                    replies.append(r["choices"][0]["message"]["content"])
                    ttfts.append(t)
                    usage.append(kv(r))
            m = s.metrics()
            s.stop()
        finally:
            shutil.rmtree(store, ignore_errors=True)
        row = {"label": label, "bin": binary, "version": subprocess.run([binary, "--version"], capture_output=True,
                                                                        text=True).stdout.strip(),
               "pool_ram": gauge(m, "kvtier_pool_ram_bytes"), "pool_spill": gauge(m, "kvtier_pool_spill_bytes"),
               "store_ram": gauge(m, 'kvtier_store_bytes{tier="ram"}'), "store_ram_entries": gauge(m, 'kvtier_store_entries{tier="ram"}'),
               "evictions": gauge(m, "kvtier_evictions_total"), "recoveries": gauge(m, "kvtier_recoveries_total"),
               "recomputes": gauge(m, "kvtier_recomputes_total"), "replies": replies, "seconds": ttfts,
               "prompt_tokens_from_store": [u["prompt_tokens_from_store"] for u in usage]}
        row["host_ram"] = row["pool_ram"] + row["store_ram"]
        runs.append(row)
        print(f"{label:6s}: host RAM {row['host_ram'] / 2**20:7.2f} MiB = pool/private {row['pool_ram'] / 2**20:6.2f} + "
              f"content {row['store_ram'] / 2**20:6.2f} ({row['store_ram_entries']} blocks); spill "
              f"{row['pool_spill'] / 2**20:.2f} MiB; {row['evictions']} evictions, {row['recoveries']} recoveries, "
              f"{row['recomputes']} recomputes; mean request {statistics.mean(ttfts):.2f} s", flush=True)
    if len(runs) == 2:
        same = runs[0]["replies"] == runs[1]["replies"]
        print(f"replies identical before/after: {same}; host RAM after/before = "
              f"{runs[0]['host_ram'] / max(1, runs[1]['host_ram']):.3f}")
    out = {"bench": "ram", "text": src, "doc_tokens": a.ram_doc, "sessions": K, "budget": budget, "info": build_info(a),
           "runs": runs}
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["ttft", "edgesync", "prefetch", "ram"])
    ap.add_argument("--bin-before", default="", help="ram: an older kvtier binary to compare with")
    ap.add_argument("--ram-sessions", type=int, default=4, help="ram: sessions sharing the document")
    ap.add_argument("--ram-doc", type=int, default=1536, help="ram: document length (tokens, approx.)")
    ap.add_argument("--ram-budget", type=int, default=512, help="ram: --budget of the server")
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "kvtier"))
    ap.add_argument("--model", default=os.environ.get("KVTIER_MODEL", ""))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--sizes", default="1024,4096,8192")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--baseline-requests", type=int, default=60)
    ap.add_argument("--clusters", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default="")
    ap.add_argument("--repeats", type=int, default=3, help="prefetch: A/B pairs per case")
    ap.add_argument("--prefetch-size", type=int, default=4096, help="prefetch: prompt size of cases 1 and 2 (tokens, approx.)")
    ap.add_argument("--queued-size", type=int, default=2048, help="prefetch: prompt size of each queued client (approx.)")
    ap.add_argument("--clients", type=int, default=3, help="prefetch: clients at once in case 3")
    ap.add_argument("--gen", type=int, default=16, help="prefetch: tokens generated per queued request")
    ap.add_argument("--redis-timeout-ms", type=int, default=100, help="prefetch, ttft: --redis-timeout-ms of the servers")
    ap.add_argument("--serve-args", default="", help="more `kvtier serve` flags for every server, e.g. '--codec-disk q4' "
                    "(the disk tier's codec, which Redis also holds)")
    ap.add_argument("--no-redis", action="store_true", help="ttft: skip the Redis column (default: run it when redis-server is installed)")
    a = ap.parse_args()
    if not a.model:
        raise SystemExit("--model (or $KVTIER_MODEL) is required")
    {"ttft": ttft, "edgesync": edgesync, "prefetch": prefetch_ab, "ram": host_ram}[a.what](a)


if __name__ == "__main__":
    main()
