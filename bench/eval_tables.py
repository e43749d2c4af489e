#!/usr/bin/env python3
"""bench/eval_tables.py [--pool] DIR — Markdown tables from the JSON files `kvtier eval` wrote into
DIR (e.g. results/grid-<time>/ from bench/eval_grid.sh), for docs/EVALUATION.md: one table per
run (niah/multifact: pass rates with Wilson intervals, log-probabilities and their paired
differences to no_eviction; ppl: perplexity, exact KL), then a grid summary of the niah runs.

--pool: runs of the same model, task, context and budget (e.g. several seeds) pooled into one
table per cell, with Wilson intervals over all their probes (multifact: five probes per case, not
independent, so its intervals are narrower than the cases justify), and each policy's failed
probes sorted by why, from the per-case rows (and, when DIR holds several niah cells, one grid table
of them: passes [Wilson 95 %] and the mean answer log-prob difference to no_eviction per policy): 'model' (no_eviction failed the same probe too),
'not recovered' (the fact's block was evicted and not resident at the question), 'recovered, not
used' (evicted, back at the question, the reply still missed it), 'resident, not used' (never
evicted), 'unknown' (the fact was not found in the block texts)."""
import glob
import json
import math
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


def wilson(k, n, z=1.959964):
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


ORDER = ["no_eviction", "truncate", "streaming", "h2o", "snapkv", "infllm", "kvtier"]


def order(name):
    """The eval's own policy order (kvtier eval --help); others after it, as met."""
    return ORDER.index(name) if name in ORDER else len(ORDER)


def pooled(rs):
    cells = {}
    for f, j in rs:
        if j["task"] in ("niah", "multifact"):
            cells.setdefault((j["model"], j["task"], j["context"], j["budget"]), []).append((f, j))
    for (model, task, ctx, budget), group in sorted(cells.items()):
        seeds = sorted(set(j["seed"] for _, j in group))
        rows, seen, differ = [], {}, 0  # rows: ((seed, case, item), row)
        for f, j in group:
            for r in j.get("rows", []):
                k = (j["seed"], r["case"], r["item"])
                if (r["policy"], k) in seen:  # the same probe run again (e.g. no_eviction in two runs)
                    differ += seen[(r["policy"], k)]["passed"] != r["passed"]
                    continue
                seen[(r["policy"], k)] = r
                rows.append((k, r))
        pols = []
        for _, j in group:
            pols += [p["policy"] for p in j["policies"] if p["policy"] not in pols]
        pols.sort(key=order)
        ref = {k: r for k, r in rows if r["policy"] == "no_eviction"}
        n_cases = len({(k[0], k[1]) for k, _ in rows})
        commits = sorted(set(j["commit"] for _, j in group))
        print(f"#### {model}: {task}, context {ctx}, budget {budget}: {n_cases} cases ({len(rows) // max(1, len(pols))} "
              f"probes) pooled over seeds {', '.join(map(str, seeds))} (commit {', '.join(f'`{c}`' for c in commits)}, "
              f"{sum(j['seconds'] for _, j in group) / 3600:.1f} h of runs)\n")
        if differ:
            print(f"(warning: {differ} probes run twice passed in one run and failed in the other; the first run counts)\n")
        print("| policy | pass (free reply) [95% CI] | vs no_eviction (same probes) | prefix pass [95% CI] | answer log-prob | "
              "Δ vs no_eviction | fact at the question: resident / recovered / evicted | "
              "failed: model / not recovered / recovered, not used / resident, not used / unknown |")
        print("|---|---|---|---|---|---|---|---|")
        for name in pols:
            mine = [(k, r) for k, r in rows if r["policy"] == name and not r.get("error")]
            n = len(mine)
            k_pass = sum(r["passed"] for _, r in mine)
            k_pre = sum(r["prefix_passed"] for _, r in mine)
            lo, hi = wilson(k_pass, n)
            plo, phi = wilson(k_pre, n)
            lps = [r["answer_logprob"] for _, r in mine if r["answer_logprob"] is not None]
            d = [r["answer_logprob"] - ref[k]["answer_logprob"] for k, r in mine
                 if k in ref and r["answer_logprob"] is not None and ref[k]["answer_logprob"] is not None]
            st = {s: sum(1 for _, r in mine if r.get("fact") == s) for s in ("resident", "recovered", "evicted")}
            fails = [(k, r) for k, r in mine if not r["passed"]]
            mod = [(k, r) for k, r in fails if k in ref and not ref[k]["passed"]]
            rest = [r for k, r in fails if not (k in ref and not ref[k]["passed"])]
            why = [sum(1 for r in rest if r.get("fact") == f) for f in ("evicted", "recovered", "resident")]
            why.append(len(rest) - sum(why))
            ref_pass = sum(ref[k]["passed"] for k, _ in mine if k in ref)
            k_matched = sum(r["passed"] for k, r in mine if k in ref)
            rel = f"{k_matched / ref_pass * 100:.0f} %" if ref_pass else "–"
            print(f"| {name} | {k_pass}/{n} = {k_pass / n if n else 0:.2f} [{lo:.2f}, {hi:.2f}] | {rel} | "
                  f"{k_pre}/{n} [{plo:.2f}, {phi:.2f}] | {sum(lps) / len(lps) if lps else float('nan'):.2f} | "
                  f"{(sum(d) / len(d)) if d else 0:+.2f} | {st['resident']} / {st['recovered']} / {st['evicted']} | "
                  f"{len(mod)} / {' / '.join(map(str, why))} |")
        print()
    pooled_grid(cells)


def pooled_grid(cells):
    niah = {k: g for k, g in cells.items() if k[1] == "niah"}
    if len(niah) < 2:
        return
    pols = []
    for g in niah.values():
        for _, j in g:
            for p in j["policies"]:
                if p["policy"] not in pols:
                    pols.append(p["policy"])
    pols.sort(key=order)
    print("#### NIAH grid (pooled): free-reply passes [Wilson 95 %] / mean answer log-prob Δ vs no_eviction "
          "(nats, same cases) per cell\n")
    print("| model | context | budget | cases | " + " | ".join(pols) + " |")
    print("|---|---|---|---|" + "---|" * len(pols))
    for (model, _, ctx, budget), group in sorted(niah.items()):
        rows = list({(r["policy"], j["seed"], r["case"], r["item"]): ((j["seed"], r["case"], r["item"]), r)
                     for _, j in reversed(group) for r in j.get("rows", [])}.values())  # a probe run twice: the first run's
        ref = {k: r for k, r in rows if r["policy"] == "no_eviction"}
        out = []
        for name in pols:
            mine = [(k, r) for k, r in rows if r["policy"] == name and not r.get("error")]
            n = len(mine)
            if not n:
                out.append("–")
                continue
            k_pass = sum(r["passed"] for _, r in mine)
            lo, hi = wilson(k_pass, n)
            d = [r["answer_logprob"] - ref[k]["answer_logprob"] for k, r in mine
                 if k in ref and r["answer_logprob"] is not None and ref[k]["answer_logprob"] is not None]
            cell = f"{k_pass}/{n} [{lo:.2f}, {hi:.2f}]"
            if name != "no_eviction" and d:
                cell += f" / {sum(d) / len(d):+.2f}"
            out.append(cell)
        print(f"| {model} | {ctx} | {budget} | {len({(k[0], k[1]) for k, _ in rows})} | " + " | ".join(out) + " |")
    print()


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--pool":
        pooled(runs(args[1]))
        sys.exit(0)
    rs = runs(args[0])
    for f, j in rs:
        table(f, j)
    grid(rs)
