"""benchlib.py — what bench/serve_bench.py and bench/long_sessions.py share: percentiles, a
process's peak RSS, and one streamed chat turn against an OpenAI-compatible server."""
import threading
import time


def pct(xs, p):
    """The p-th percentile of xs (linear interpolation), NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    f = int(k)
    return xs[f] if f + 1 >= len(xs) else xs[f] + (xs[f + 1] - xs[f]) * (k - f)


def vmhwm_mb(pid):
    """Peak resident memory (VmHWM) of pid in MiB, NaN when it cannot be read."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def stream_turn(client, hist, max_tokens, session_id):
    """One chat turn, greedy and streamed, with X-Session-Id.  Returns (seconds to the first
    content token or None, reply text, completion tokens, prompt tokens); raises what the client
    raises."""
    t0 = time.time()
    first = None
    text = []
    n = pt = 0
    stream = client.chat.completions.create(
        model="bench", messages=hist, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": session_id})
    for c in stream:
        if c.choices and c.choices[0].delta.content:
            if first is None:
                first = time.time() - t0
            text.append(c.choices[0].delta.content)
        if c.usage:
            n, pt = c.usage.completion_tokens, c.usage.prompt_tokens
    return first, "".join(text), n, pt


def run_sessions(session, n, pid):
    """Run session(i) for i in 0..n-1 on threads at once, sampling pid's peak RSS every 0.2 s.
    Returns (wall seconds, peak RSS in MiB; 0 without a pid)."""
    t0 = time.time()
    ths = [threading.Thread(target=session, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    peak = 0.0
    while any(t.is_alive() for t in ths):
        time.sleep(0.2)
        if pid:
            peak = max(peak, vmhwm_mb(pid))
    return time.time() - t0, peak
