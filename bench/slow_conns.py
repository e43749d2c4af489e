"""bench/slow_conns.py — many slow connections against `kvtier serve` (issue #38): N connections
from A loopback addresses (127.0.1.x ... : never the address the checks use), each sending one
header line every TRICKLE seconds and opening again when the server cuts it, held for SECONDS;
meanwhile /health is asked every POLL seconds from 127.0.0.1 and a greedy generation runs, and
the same generation runs alone before the load (tokens per second, same run).  The server's RSS
is read from /proc before and during the load.

    slow_conns.py --url http://127.0.0.1:PORT --pid PID [--key KEY] [--conns 10000] [--addrs 400]
                  [--seconds 60] [--trickle 2] [--poll 1] [--tokens 128] [--json OUT]

Prints a table and, with --json, the figures; exits 1 when a target is missed: every /health
answered within --health-ms (default 100), RSS growth < --rss-mb (default 200), the generation's
tok/s under load >= --tps-ratio (default 0.95) x alone.  Loopback only; bounded in time.
"""
import argparse
import asyncio
import http.client
import json
import statistics
import sys
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("--url", required=True)
ap.add_argument("--pid", type=int, required=True)
ap.add_argument("--key", default=None)
ap.add_argument("--conns", type=int, default=10000)
ap.add_argument("--addrs", type=int, default=400)
ap.add_argument("--seconds", type=float, default=60)
ap.add_argument("--trickle", type=float, default=2)
ap.add_argument("--poll", type=float, default=1)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--health-ms", type=float, default=100)
ap.add_argument("--rss-mb", type=float, default=200)
ap.add_argument("--tps-ratio", type=float, default=0.95)
ap.add_argument("--json", default=None)
a = ap.parse_args()
HOST, PORT = a.url.split("//")[1].split(":")[0], int(a.url.rsplit(":", 1)[1])


def rss_mb():
    for line in open(f"/proc/{a.pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return -1


def threads():
    for line in open(f"/proc/{a.pid}/status"):
        if line.startswith("Threads"):
            return int(line.split()[1])
    return -1


def post(path, body, timeout=600):
    c = http.client.HTTPConnection(HOST, PORT, timeout=timeout)
    h = {"Content-Type": "application/json"}
    if a.key:
        h["Authorization"] = f"Bearer {a.key}"
    c.request("POST", path, body=json.dumps(body).encode(), headers=h)
    r = c.getresponse()
    d = json.loads(r.read())
    c.close()
    return r.status, d


# the generation: greedy, its end-of-turn token banned so that it always runs --tokens
st, tk = post("/tokenize", {"content": "<|im_end|>", "parse_special": True})
eot = tk.get("tokens", []) if st == 200 else []
GEN = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}], "max_tokens": a.tokens,
       "temperature": 0, "logit_bias": {str(t): -100 for t in eot}}


def generate():
    t0 = time.time()
    try:
        st, d = post("/v1/chat/completions", GEN)
    except (OSError, ValueError) as ex:  # refused or timed out under the load: no tokens
        return 0, 0, repr(ex)
    dt = time.time() - t0
    n = d.get("usage", {}).get("completion_tokens", 0) if st == 200 else 0
    return n / dt if dt > 0 else 0, n, st


generate()  # warm-up
tps_alone = statistics.median([generate()[0] for _ in range(2)])
rss0, thr0 = rss_mb(), threads()

stop = False
stats = {"opened": 0, "cut": 0, "failed_open": 0, "lines": 0, "held_max": 0}
held = 0


async def slow(i):
    global held
    src = f"127.0.{1 + (i % a.addrs) // 250}.{1 + (i % a.addrs) % 250}"
    while not stop:
        try:
            r, w = await asyncio.open_connection(HOST, PORT, local_addr=(src, 0))
        except OSError:
            stats["failed_open"] += 1
            await asyncio.sleep(1)
            continue
        stats["opened"] += 1
        held += 1
        stats["held_max"] = max(stats["held_max"], held)
        try:
            w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            await w.drain()
            k = 0
            while not stop:
                await asyncio.sleep(a.trickle)
                if r.at_eof():
                    break
                w.write(b"X-Slow-%d: %d\r\n" % (k, i))
                await w.drain()
                stats["lines"] += 1
                k += 1
        except (OSError, ConnectionError):
            pass
        held -= 1
        stats["cut"] += 1
        try:
            w.close()
        except Exception:  # noqa: BLE001
            pass


health = []
rss_max = [rss0]
thr_max = [thr0]


def checker():
    while not stop:
        t0 = time.time()
        try:
            c = http.client.HTTPConnection(HOST, PORT, timeout=10)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
        except OSError:
            ok = False
        health.append(((time.time() - t0) * 1000, ok))
        rss_max[0] = max(rss_max[0], rss_mb())
        thr_max[0] = max(thr_max[0], threads())
        time.sleep(max(0, a.poll - (time.time() - t0)))


loaded = []


def gen_loop():
    while not stop:
        loaded.append(generate())


async def main():
    global stop
    tasks = []
    for i in range(a.conns):  # ramp: a thousand a second
        tasks.append(asyncio.create_task(slow(i)))
        if i % 1000 == 999:
            await asyncio.sleep(1)
    th = [threading.Thread(target=checker), threading.Thread(target=gen_loop)]
    [t.start() for t in th]
    await asyncio.sleep(a.seconds)
    stop = True
    [t.join() for t in th]
    await asyncio.gather(*tasks, return_exceptions=True)


asyncio.run(main())
lat = sorted(h[0] for h in health)
failed = sum(1 for h in health if not h[1])
tps_loaded = statistics.median([x[0] for x in loaded if x[2] == 200]) if loaded else 0
res = {"conns": a.conns, "addrs": a.addrs, "seconds": a.seconds, "held_max": stats["held_max"], "opened": stats["opened"],
       "cut_and_reopened": stats["cut"], "open_failures": stats["failed_open"], "header_lines": stats["lines"],
       "health_polls": len(health), "health_failed": failed, "health_ms_max": round(lat[-1], 1) if lat else None,
       "health_ms_p50": round(lat[len(lat) // 2], 1) if lat else None, "rss_mb_before": round(rss0), "rss_mb_max": round(rss_max[0]),
       "rss_growth_mb": round(rss_max[0] - rss0), "threads_before": thr0, "threads_max": thr_max[0],
       "tok_s_alone": round(tps_alone, 2), "tok_s_loaded": round(tps_loaded, 2), "generations_loaded": len(loaded),
       "tok_s_ratio": round(tps_loaded / tps_alone, 3) if tps_alone else 0}
ok_h = failed == 0 and lat and lat[-1] <= a.health_ms
ok_r = res["rss_growth_mb"] < a.rss_mb
ok_t = res["tok_s_ratio"] >= a.tps_ratio
print(f"slow connections: {a.conns} from {a.addrs} addresses for {a.seconds:.0f} s (trickling a header line every {a.trickle:g} s)")
print(f"  held at once (max)      {res['held_max']:>8}   opened {res['opened']}, cut and reopened {res['cut_and_reopened']}, "
      f"failed to open {res['open_failures']}")
print(f"  /health                 {len(health):>8} polls, {failed} failed, p50 {res['health_ms_p50']} ms, max {res['health_ms_max']} ms "
      f"(target <= {a.health_ms:g})  {'ok' if ok_h else 'MISSED'}")
print(f"  server RSS              {res['rss_mb_before']:>8} MiB before, {res['rss_mb_max']} max: +{res['rss_growth_mb']} "
      f"(target < {a.rss_mb:g})  {'ok' if ok_r else 'MISSED'}")
print(f"  server threads          {thr0:>8} before, {thr_max[0]} max")
print(f"  generation tok/s        {res['tok_s_alone']:>8} alone, {res['tok_s_loaded']} under load ({len(loaded)} runs): "
      f"x{res['tok_s_ratio']} (target >= {a.tps_ratio:g})  {'ok' if ok_t else 'MISSED'}")
if a.json:
    json.dump(res, open(a.json, "w"), indent=1)
sys.exit(0 if ok_h and ok_r and ok_t else 1)
