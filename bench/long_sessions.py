"""long_sessions.py — long multi-turn sessions with planted facts against an OpenAI-compatible server.

N sessions run at once, T turns each.  A user turn is a W-word slice of the essays
(../shared/data/pg_essays); the client resends the whole history every turn (as OpenAI clients
do), the server's replies echoed back, so each session's context grows by about W * 1.3 + M
tokens a turn.  F facts per session are planted at evenly spaced depths of its first three
quarters of turns ("Note for later: the code of the red fox is 4821.") and asked in its last F
turns ("What is the code of the red fox? Answer with the number only."); a probe is correct when
the reply holds the number.  Every reply is streamed to time its first token.

  python long_sessions.py --url http://127.0.0.1:8080 --pid SERVER_PID [--sessions 4] [--turns 24]
                          [--words 200] [--max-tokens 32] [--facts 4] [--label kvtier] [--series out.csv]

One JSON line on stdout: generated tokens/s (all sessions, wall clock), TTFT p50/p99 per turn
bucket, the prompt tokens of the last turn (the context reached), the server's peak RSS (VmHWM)
and CPU seconds (utime + stime of --pid) with CPU ms per generated token, and recall = correct /
probes with a 95% Wilson interval.  --series writes one CSV row per turn (generated tok/s of the
turn's requests, median TTFT, mean prompt tokens, probes and correct) for plots.  Progress goes
to stderr.  X-Session-Id names each session (kvtier; llama-server matches slots by prefix).
"""
import argparse
import glob
import json
import math
import os
import random
import re
import statistics
import sys
import subprocess
import threading
import time

import openai

from benchlib import pct, run_sessions, stream_turn

COLORS = ["red", "blue", "green", "golden", "silver", "black", "white", "amber", "violet", "grey"]
ANIMALS = ["fox", "heron", "otter", "badger", "falcon", "lynx", "salmon", "beaver", "raven", "hare"]


def wilson(k, n, z=1.96):
    """95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def cpu_s(pid):
    """utime + stime of pid (and its reaped children) in seconds."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def vram_mb(pid):
    """The GPU memory pid holds (MB) as nvidia-smi reports it; None without nvidia-smi or a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [float(f[1]) for f in (l.split(",") for l in out.splitlines()) if len(f) == 2 and f[0].strip() == str(pid)]
    return sum(used) if used else 0.0


def plan(i, turns, facts, rng):
    """Session i's facts: (plant turn, ask turn, name, code) for each, plant turns in the first 3/4."""
    n = min(facts, max(0, turns // 2))
    span = max(1, (3 * turns) // 4 - n)
    out = []
    for k in range(n):
        plant = k * span // max(1, n) if n > 1 else 0
        ask = turns - n + k
        name = f"{COLORS[(i * 3 + k) % len(COLORS)]} {ANIMALS[(i * 7 + k * 3) % len(ANIMALS)]}"
        out.append((plant, ask, name, str(rng.randint(1000, 9999))))
    return out


def table(path):
    """The results of one run (JSON lines) as a markdown table, ratios against the first row."""
    rs = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    if not rs:
        print(f"long_sessions.py: no results in {path}", file=sys.stderr)
        return 1
    base = rs[0]
    gpu = any(r.get("peak_vram_mb") for r in rs)
    print("| server | gen tok/s | TTFT p50 / p99, last third (s) | context reached | peak RSS (MB) | server CPU ms/token | recall (95% CI) |"
          + (" peak VRAM (MB) |" if gpu else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if gpu else ""))
    for r in rs:
        if r["n_errors"]:
            print(f"| {r['label']} | {r['n_errors']} of {r['sessions']} sessions stopped: {r['errors'][0][:120]} | | | | | |")
            continue
        last = list(r["ttft_ms_p50_p99"].values())[-1]
        print(f"| {r['label']} | {r['gen_tok_per_s']:.2f} ({r['gen_tok_per_s'] / base['gen_tok_per_s']:.2f}x) "
              f"| {last[0] / 1e3:.2f} / {last[1] / 1e3:.2f} | {r['last_prompt_tokens']} "
              f"| {r['peak_rss_mb']:.0f} ({r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x) | {r['cpu_ms_per_token']:.0f} "
              f"| {r['correct']}/{r['probes']} = {r['recall']:.2f} [{r['recall_wilson95'][0]:.2f}, {r['recall_wilson95'][1]:.2f}] |"
              + (f" {r.get('peak_vram_mb') or 0:.0f} |" if gpu else ""))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="the server's base URL (http://127.0.0.1:PORT)")
    ap.add_argument("--table", default="", help="print the JSON lines of this file as a markdown table and exit")
    ap.add_argument("--pid", type=int, default=0, help="the server's pid: peak RSS and CPU seconds")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--words", type=int, default=200, help="essay words per user turn")
    ap.add_argument("--facts", type=int, default=4, help="facts planted and probed per session")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--essays", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "pg_essays"))
    ap.add_argument("--label", default="server")
    ap.add_argument("--series", default="", help="CSV file for the per-turn series")
    ap.add_argument("--replies", default="", help="JSON lines file for every probe's question, expected code and reply")
    a = ap.parse_args()
    if a.table:
        return table(a.table)
    if not a.url:
        ap.error("--url is required (or --table FILE)")

    files = sorted(f for f in glob.glob(os.path.join(a.essays, "*.txt")) if "LICENSE" not in f)
    if not files:
        print(f"long_sessions.py: no essays in {a.essays}", file=sys.stderr)
        return 2
    words = []
    for f in files:
        words += open(f, encoding="utf-8", errors="replace").read().split()
    client = openai.OpenAI(base_url=a.url + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "bench"), max_retries=0,
                           timeout=3600)
    rng = random.Random(a.seed)
    plans = [plan(i, a.turns, a.facts, rng) for i in range(a.sessions)]
    lock = threading.Lock()
    rows = []  # (turn, ttft_ms, dur_s, completion tokens, prompt tokens, probe, correct)
    probe_log = []
    errors = []
    done_turns = [0]

    def session(i):
        hist = []
        off = (i * 7919 * a.words) % max(1, len(words) - a.words * a.turns)
        facts = plans[i]
        for t in range(a.turns):
            probe = next((f for f in facts if f[1] == t), None)
            if probe:
                msg = f"What is the code of the {probe[2]}? Answer with the number only."
            else:
                chunk = " ".join(words[off + t * a.words: off + (t + 1) * a.words])
                msg = f"Here is part {t + 1} of an essay. Summarise it in one sentence.\n\n{chunk}"
                for f in facts:
                    if f[0] == t:
                        msg += f"\n\nNote for later: the code of the {f[2]} is {f[3]}."
            hist.append({"role": "user", "content": msg})
            t0 = time.time()
            try:
                first, reply, n, pt = stream_turn(client, hist, a.max_tokens, f"long-{i}")
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                with lock:
                    errors.append(f"session {i} turn {t + 1}: {e}")
                return
            dur = time.time() - t0
            ok = bool(probe) and re.search(r"(?<!\d)" + probe[3] + r"(?!\d)", reply) is not None
            with lock:
                if probe:
                    probe_log.append({"session": i, "turn": t + 1, "fact": probe[2], "expected": probe[3], "planted_turn": probe[0] + 1,
                                      "correct": ok, "prompt_tokens": pt, "reply": reply})
                rows.append((t, (first if first is not None else dur) * 1e3, dur, n, pt, bool(probe), ok))
                done_turns[0] += 1
                if done_turns[0] % max(1, a.sessions) == 0:
                    print(f"  {a.label}: {done_turns[0]}/{a.sessions * a.turns} turns, prompt {pt} tokens",
                          file=sys.stderr, flush=True)
            hist.append({"role": "assistant", "content": reply})

    cpu0 = cpu_s(a.pid) if a.pid else float("nan")
    vram = [vram_mb(a.pid) if a.pid else None]  # peak GPU memory of the server (CUDA: nvidia-smi), sampled
    stop = threading.Event()

    def sample_vram():
        while vram[0] is not None and not stop.wait(1.0):
            v = vram_mb(a.pid)
            vram[0] = max(vram[0], v) if v is not None else vram[0]
    sampler = threading.Thread(target=sample_vram, daemon=True)
    sampler.start()
    wall, peak = run_sessions(session, a.sessions, a.pid)
    stop.set()
    cpu = (cpu_s(a.pid) - cpu0) if a.pid else float("nan")
    gen = sum(r[3] for r in rows)
    probes = [r for r in rows if r[5]]
    correct = sum(1 for r in probes if r[6])
    lo, hi = wilson(correct, len(probes))
    buckets = [(0, 0), (1, a.turns // 3), (a.turns // 3 + 1, 2 * a.turns // 3), (2 * a.turns // 3 + 1, a.turns - 1)]
    ttft = {}
    for b0, b1 in buckets:
        if b1 < b0:
            continue
        xs = [r[1] for r in rows if b0 <= r[0] <= b1]
        ttft[f"turns_{b0 + 1}_{b1 + 1}"] = [round(pct(xs, 50), 1), round(pct(xs, 99), 1)]
    last = [r[4] for r in rows if r[0] == a.turns - 1]
    res = {
        "label": a.label, "sessions": a.sessions, "turns": a.turns, "words": a.words, "max_tokens": a.max_tokens,
        "facts": a.facts, "wall_s": round(wall, 2), "generated_tokens": gen, "gen_tok_per_s": round(gen / wall, 2),
        "ttft_ms_p50_p99": ttft, "last_prompt_tokens": max(last) if last else 0, "peak_rss_mb": round(peak, 1),
        "server_cpu_s": round(cpu, 1), "cpu_ms_per_token": round(cpu * 1e3 / gen, 1) if gen else float("nan"),
        "probes": len(probes), "correct": correct, "recall": round(correct / len(probes), 3) if probes else float("nan"),
        "recall_wilson95": [round(lo, 3), round(hi, 3)], "n_errors": len(errors), "errors": errors[:5],
        "peak_vram_mb": vram[0],
    }
    print(json.dumps(res), flush=True)
    if a.replies:
        with open(a.replies, "w") as f:
            for p in sorted(probe_log, key=lambda p: (p["session"], p["turn"])):
                f.write(json.dumps(p) + "\n")
    if a.series:
        with open(a.series, "w") as f:
            f.write("turn,gen_tok_per_s,ttft_p50_ms,prompt_tokens,probes,correct\n")
            for t in range(a.turns):
                rs = [r for r in rows if r[0] == t]
                if not rs:
                    continue
                tps = sum(r[3] for r in rs) / max(1e-9, sum(r[2] for r in rs))
                f.write(f"{t + 1},{tps:.3f},{statistics.median(r[1] for r in rs):.1f},"
                        f"{statistics.mean(r[4] for r in rs):.0f},{sum(r[5] for r in rs)},{sum(r[6] for r in rs)}\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
