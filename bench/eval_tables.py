#!/usr/bin/env python3
"""bench/eval_tables.py DIR — Markdown tables from the JSON files `kvtier eval` wrote into DIR
(e.g. results/grid-<time>/ from bench/eval_grid.sh), for docs/EVALUATION.md: one table per
run (niah/multifact: pass rates with Wilson intervals, log-probabilities and their paired
differences to no_eviction; ppl: perplexity, exact KL), then a grid summary of the niah runs."""
import glob
import json
import sys


def ci(k, n, lo, hi):
    return f"{k}/{n} = {k / n:.2f} [{lo:.2f}, {hi:.2f}]" if n else "-"


def num(x, fmt="{:.2f}", sign=False):
    if x is None:
        return "–"
    return (("{:+.2f}" if sign else fmt).format(x))


def runs(d):
    out = []
    for f in sorted(glob.glob(f"{d}/*.json")):
        try:
            j = json.load(open(f))
        except ValueError:
            continue
        if "policies" in j and "task" in j:
            out.append((f, j))
    return out


def table(f, j):
    t = j["task"]
    print(f"#### {t}, context {j['context']}, budget {j['budget']}, {j['cases']} cases "
          f"(commit `{j['commit']}`, {j['date']}, {j['threads']} threads, {j['seconds']:.0f} s)\n")
    if t == "ppl":
        print("| policy | budget | ppl | NLL/token | mean abs ΔNLL vs no_eviction | KL(no_eviction ‖ policy) nats/token | top-1 [95% CI] | evictions | recoveries | peak |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for p in j["policies"]:
            print(f"| {p['policy']} | {p['budget']} | {p['ppl']:.3f} | {p['nll_per_token']:.4f} | "
                  f"{num(p.get('nll_abs_diff_vs_ref'), '{:.4f}')} | {num(p.get('kl_vs_ref'), '{:.4f}')} | "
                  f"{p['pass_rate']:.3f} [{p['ci_low']:.3f}, {p['ci_high']:.3f}] | {p['evictions']:.1f} | "
                  f"{p['recoveries']:.1f} | {p['peak_resident_tokens']} |")
    else:
        print("| policy | budget | pass (free reply) [95% CI] | prefix pass [95% CI] | answer log-prob | Δ vs no_eviction | number log-prob | Δ vs no_eviction | evictions | recoveries | TTFT ms | peak |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for p in j["policies"]:
            print(f"| {p['policy']} | {p['budget']} | {ci(p['passes'], p['n'], p['ci_low'], p['ci_high'])} | "
                  f"{ci(p['prefix_passes'], p['n'], p['prefix_ci_low'], p['prefix_ci_high'])} | "
                  f"{num(p['answer_logprob'])} | {num(p.get('answer_logprob_vs_ref'), sign=True)} | "
                  f"{num(p['number_logprob'])} | {num(p.get('number_logprob_vs_ref'), sign=True)} | "
                  f"{p['evictions']:.1f} | {p['recoveries']:.1f} | {p['ttft_ms']:.0f} | {p['peak_resident_tokens']} |")
    print()


def grid(rs):
    cells = [(j["context"], j["budget"], j) for _, j in rs if j["task"] == "niah"]
    if not cells:
        return
    pols = [p["policy"] for p in cells[0][2]["policies"]]
    print("#### NIAH grid: free-reply passes / answer log-prob Δ vs no_eviction (nats) per cell\n")
    print("| context | budget | cases | " + " | ".join(pols) + " |")
    print("|---|---|---|" + "---|" * len(pols))
    for ctx, b, j in sorted(cells, key=lambda c: (c[0], c[1])):
        P = {p["policy"]: p for p in j["policies"]}
        row = []
        for name in pols:
            p = P.get(name)
            if not p:
                row.append("–")
                continue
            d = p.get("answer_logprob_vs_ref")
            row.append(f"{p['passes']}/{p['n']}" + ("" if d is None else f" / {d:+.2f}"))
        print(f"| {ctx} | {b} | {j['cases']} | " + " | ".join(row) + " |")
    print()


if __name__ == "__main__":
    rs = runs(sys.argv[1])
    for f, j in rs:
        table(f, j)
    grid(rs)
