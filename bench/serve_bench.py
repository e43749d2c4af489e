"""serve_bench.py — N concurrent multi-turn chat sessions against an OpenAI-compatible server.

Each session sends T turns; every user message is a paragraph-sized slice of a Paul Graham essay
(../shared/data/pg_essays); the client resends the whole history each turn (as real clients do),
with the server's replies echoed back.  Streams every reply to time the first token.

  python serve_bench.py --url http://127.0.0.1:8080 --pid SERVER_PID [--sessions 8] [--turns 10]
                        [--max-tokens 32] [--words 120] [--label kvtier] [--json out.json]

Reports generated tokens/s (all sessions, wall clock), TTFT p50/p99 for turn 1 and for turns >= 2,
and the server's peak RSS (VmHWM of --pid).  With X-Session-Id per session for kvtier (llama-server
ignores the header; it matches slots by prompt prefix with cache_prompt).
"""
import argparse
import glob
import json
import os
import statistics
import sys
import threading
import time

import openai

from benchlib import pct, run_sessions, stream_turn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int, default=0)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--words", type=int, default=120)
    ap.add_argument("--essays", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "pg_essays"))
    ap.add_argument("--label", default="server")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    files = sorted(f for f in glob.glob(os.path.join(a.essays, "*.txt")) if "LICENSE" not in f)
    words = []
    for f in files:
        words += open(f, encoding="utf-8", errors="replace").read().split()
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="bench", max_retries=0, timeout=3600)
    ttft1, ttft2, gen = [], [], [0]
    lock = threading.Lock()
    errors = []

    def session(i):
        hist = []
        off = (i * 7919 * a.words) % max(1, len(words) - a.words * a.turns)
        for t in range(a.turns):
            chunk = " ".join(words[off + t * a.words: off + (t + 1) * a.words])
            hist.append({"role": "user", "content": f"Here is part {t + 1} of an essay. Summarise it in one sentence.\n\n{chunk}"})
            t0 = time.time()
            try:
                first, reply, n, _ = stream_turn(client, hist, a.max_tokens, f"bench-{i}")
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                with lock:
                    errors.append(f"session {i} turn {t + 1}: {e}")
                return
            with lock:
                (ttft1 if t == 0 else ttft2).append((first if first is not None else time.time() - t0) * 1e3)
                gen[0] += n
            hist.append({"role": "assistant", "content": reply})

    wall, peak = run_sessions(session, a.sessions, a.pid)
    res = {
        "label": a.label, "sessions": a.sessions, "turns": a.turns, "max_tokens": a.max_tokens, "words": a.words,
        "wall_s": round(wall, 2), "generated_tokens": gen[0], "gen_tok_per_s": round(gen[0] / wall, 2),
        "ttft_turn1_p50_ms": round(pct(ttft1, 50), 1), "ttft_turn1_p99_ms": round(pct(ttft1, 99), 1),
        "ttft_later_p50_ms": round(pct(ttft2, 50), 1), "ttft_later_p99_ms": round(pct(ttft2, 99), 1),
        "peak_rss_mb": round(peak, 1), "errors": errors[:5], "n_errors": len(errors),
    }
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
