#!/usr/bin/env python3
"""bench/ruler_tables.py — the tables and the follow-up plot of a RULER grid (bench/ruler_grid.py).

Usage: bench/ruler_tables.py DIR [DIR ...] [--plot docs/ruler_followup.png [--plot-cell smollm2-4096]] [--cases N]
                             [--json] [--all-commits]

Reads the units (one case of one cell each) of every DIR: a grid's OUT (OUT/units/*.json) or an
archive (bench/ruler_units/seed1-ratio4: DIR/*.json, the units without their text); a unit in
several is read from the first DIR that has it; a unit of kvtier from before the grid's configuration
(bench/ruler_grid.py's CONFIG_SINCE: stale, to be run again) is left out and counted, unless
--all-commits.  Prints, per model x length x shape:
  - per task and method: RULER's score (references found / references, string_match_all) with a
    Wilson 95 % interval over the references, and the mean teacher-forced log-probability of the
    reference answer paired with no_eviction on the same cases (nats, higher is better);
  - the mean over tasks per method, its ratio to no_eviction, and the goals of issue #42 at this
    budget: kvtier >= 0.95 x no eviction, and >= the best of SnapKV / H2O / StreamingLLM + 10
    points (on the score; and on the paired log-probability, which ranks methods when greedy
    scores are near zero);
  - for the followup shape: the score by query index (1..5) per method, and the plot of it; the
    paired log-probability by query index; and how many replies to query q repeat a value of the
    same method's reply to query q-1 that is not one of q's references (the model copying its
    previous answer instead of reading the context).
Everything is computed from the unit files; nothing is tuned per task.
"""
import argparse
import collections
import glob
import json
import math
import os
import re
import subprocess
import sys


VALUE = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b|\b\d{5,}\b|\b[A-Z]{5}\b")
COLORS = ["#000000", "#e69f00", "#56b4e9", "#009e73", "#f0e442", "#0072b2", "#d55e00", "#cc79a7", "#999999", "#7f3fbf"]


def wilson(k, n, z=1.96):
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, c - h), min(1.0, c + h)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", metavar="DIR")
    ap.add_argument("--plot", default=None, help="write the follow-up plot (PNG, gnuplot) here")
    ap.add_argument("--plot-cell", default=None, metavar="MODEL-LENGTH",
                    help="the follow-up cell to plot, e.g. smollm2-4096 (default: the first in order)")
    ap.add_argument("--cases", type=int, default=0, metavar="N",
                    help="read cases 1..N only (a grid part-way through a case: every cell on the same cases)")
    ap.add_argument("--json", action="store_true", help="also print the aggregates as one JSON object")
    ap.add_argument("--all-commits", action="store_true", help="also read units of kvtier from before the grid's configuration")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ruler_grid import CONFIG_SINCE, Freshness  # noqa: E402 -- the grid's own staleness rule
    fresh = None if a.all_commits else Freshness()
    seen = {}
    for d in a.dirs:
        where = os.path.join(d, "units") if os.path.isdir(os.path.join(d, "units")) else d
        for f in sorted(glob.glob(os.path.join(where, "*.json"))):
            if not f.endswith(".llama.json"):
                seen.setdefault(os.path.basename(f), f)
    units = [seen[k] for k in sorted(seen) if not a.cases or int(k[:-5].rsplit("-", 1)[1]) <= a.cases]
    stale = [f for f in units if fresh and not fresh.file_current(f)]
    units = [f for f in units if f not in stale]
    if not units:
        sys.exit(f"ruler_tables: no units under {', '.join(a.dirs)}")
    a.out = " + ".join(a.dirs)
    cells = collections.defaultdict(lambda: collections.defaultdict(list))  # (model, L, shape) -> task -> rows
    stamp = None
    runs = collections.Counter()  # (kvtier commit, llama.cpp, machine, threads) -> units
    budget = {}
    input_limit = {}
    for f in units:
        base = os.path.basename(f)[:-5]
        model, L, shape, task, case = base.rsplit("-", 4)[0], *base.rsplit("-", 4)[1:]
        d = json.load(open(f))
        stamp = stamp or {k: d[k] for k in ("model", "llama_cpp", "commit", "date", "machine", "threads", "budget", "context")}
        runs[(d["commit"], d["llama_cpp"], d["machine"], d["threads"])] += 1
        budget[(model, int(L), shape)] = d["budget"]
        if d.get("input_limit", d["context"]) < d["context"]:  # the trained context keeps room for the replies
            input_limit[(model, int(L), shape)] = d["input_limit"]
        rows = d["rows"]
        if os.path.exists(f[:-5] + ".llama.json"):  # llama-server's rows on the same case (score only)
            rows = rows + json.load(open(f[:-5] + ".llama.json"))["rows"]
        facts = d["cases_detail"][0]["facts"] if d.get("cases_detail") else []
        for r in rows:
            if r["error"]:
                continue
            refs = facts[r["item"]].get("refs") if r["item"] < len(facts) else None  # query q asks facts[q]
            cells[(model, int(L), shape)][task].append(dict(r, case=int(case), refs_text=refs))
    print(f"# RULER grid from {a.out}: {len(units)} units; first stamp: {stamp['model']}, {stamp['llama_cpp']}, kvtier "
          f"{stamp['commit']}, {stamp['date']}, {stamp['machine']}, {stamp['threads']} threads\n")
    if stale:
        print(f"{len(stale)} unit{'s' if len(stale) != 1 else ''} of kvtier before {CONFIG_SINCE} (the grid's configuration) left out; --all-commits reads "
              "them\n")
    if len(runs) > 1:
        print("units by kvtier commit, llama.cpp, machine, threads:\n")
        for (commit, lc, machine, th), n in sorted(runs.items()):
            print(f"- {n} units: kvtier {commit}, llama.cpp {lc}, {machine}, {th} threads")
        print()
    agg = {}
    agg_repeat = {}
    for (model, L, shape), tasks in sorted(cells.items()):
        methods = []
        for rows in tasks.values():
            for r in rows:
                if r["policy"] not in methods:
                    methods.append(r["policy"])
        ncases = {t: len({r["case"] for r in rows}) for t, rows in tasks.items()}
        inp = input_limit.get((model, L, shape))
        print(f"## {model}, context {L}{f' (input {inp} tokens: the trained context holds the replies too)' if inp else ''}, "
              f"budget {budget[(model, L, shape)]}, shape {shape} ({min(ncases.values())}-{max(ncases.values())} cases per task)\n")
        print("| task | " + " | ".join(methods) + " |")
        print("|---|" + "---|" * len(methods))
        per_task = {}
        for t in sorted(tasks, key=lambda x: x):
            rows = tasks[t]
            ref = {(r["case"], r["item"]): r["answer_logprob"] for r in rows if r["policy"] == "no_eviction"}
            cells_txt = []
            for m in methods:
                mr = [r for r in rows if r["policy"] == m]
                k, n = sum(r["refs_hit"] for r in mr), sum(r["refs"] for r in mr)
                lo, hi = wilson(k, n)
                d = [r["answer_logprob"] - ref[(r["case"], r["item"])] for r in mr
                     if (r["case"], r["item"]) in ref and r["answer_logprob"] is not None]
                dlp = sum(d) / len(d) if d else float("nan")
                per_task.setdefault(t, {})[m] = {"score": k / n if n else float("nan"), "k": k, "n": n, "lo": lo, "hi": hi,
                                                 "dlp": dlp}
                cells_txt.append((f"{k / n:.2f} [{lo:.2f}, {hi:.2f}]" + (f" ({dlp:+.1f})" if d else "")) if n else "-")
            print(f"| {t} | " + " | ".join(cells_txt) + " |")
        def avg(m, key):  # over the tasks the method ran (llama-server's pass may be behind)
            v = [per_task[t][m][key] for t in per_task if per_task[t][m]["n"] and per_task[t][m][key] == per_task[t][m][key]]
            return sum(v) / len(v) if v else float("nan")
        mean = {m: avg(m, "score") for m in methods}
        mdlp = {m: avg(m, "dlp") for m in methods}
        n_tasks = {m: sum(1 for t in per_task if per_task[t][m]["n"]) for m in methods}
        print("| **mean over tasks** | " + " | ".join(f"**{mean[m]:.3f}**" + (f" ({mdlp[m]:+.1f})" if mdlp[m] == mdlp[m] else "")
                                                    + (f" ({n_tasks[m]} tasks)" if n_tasks[m] < len(per_task) else "")
                                                    for m in methods) + " |")
        print("\nscore [Wilson 95 % over references] (mean paired log-probability of the reference answer minus "
              "no_eviction's, nats)\n")
        base = mean.get("no_eviction", float("nan"))
        if "kvtier" in mean:
            others = [m for m in ("snapkv", "h2o", "streaming") if m in mean]
            best = max(others, key=lambda m: mean[m]) if others else None
            best_lp = max(others, key=lambda m: mdlp[m]) if others else None
            print(f"goals: kvtier / no_eviction = {mean['kvtier'] / base if base else float('nan'):.3f} (target >= 0.95); "
                  + (f"kvtier - best one-shot ({best} {mean[best]:.3f}) = {100 * (mean['kvtier'] - mean[best]):+.1f} points "
                     f"(target >= +10); on the paired log-probability kvtier {mdlp['kvtier']:+.2f} vs {best_lp} "
                     f"{mdlp[best_lp]:+.2f} nats" if best else "") + "\n")
        byq = {}
        if shape == "followup":
            print("score by query index (1 = the query that came with the context):\n")
            print("| method | " + " | ".join(f"q{i + 1}" for i in range(5)) + " | q2-5 minus q1 |")
            print("|---|" + "---|" * 6)
            ref = {(t, r["case"], r["item"]): r["answer_logprob"] for t in tasks for r in tasks[t] if r["policy"] == "no_eviction"}
            dlpq = {}
            for m in methods:
                v, dl = [], []
                for q in range(5):
                    mr = [r for t in tasks for r in tasks[t] if r["policy"] == m and r["item"] == q]
                    k, n = sum(r["refs_hit"] for r in mr), sum(r["refs"] for r in mr)
                    v.append((k / n if n else float("nan"), *wilson(k, n)))
                    d = [r["answer_logprob"] - ref[(t, r["case"], q)] for t in tasks for r in tasks[t]
                         if r["policy"] == m and r["item"] == q and r["answer_logprob"] is not None and (t, r["case"], q) in ref]
                    dl.append(sum(d) / len(d) if d else float("nan"))
                byq[m] = v
                dlpq[m] = dl
                later = sum(x[0] for x in v[1:]) / 4
                print(f"| {m} | " + " | ".join(f"{x[0]:.2f} [{x[1]:.2f}, {x[2]:.2f}]" for x in v) + f" | {100 * (later - v[0][0]):+.1f} |")
            print("\nthe same by query index on the paired log-probability of the reference answer (minus no_eviction's on "
                  "the same query, nats; higher is better):\n")
            print("| method | " + " | ".join(f"q{i + 1}" for i in range(5)) + " | q2-5 minus q1 |")
            print("|---|" + "---|" * 6)
            for m in methods:
                dl = dlpq[m]
                if m == "no_eviction" or all(x != x for x in dl):
                    continue
                later = [x for x in dl[1:] if x == x]
                print(f"| {m} | " + " | ".join(f"{x:+.1f}" if x == x else "-" for x in dl)
                      + (f" | {sum(later) / len(later) - dl[0]:+.1f} |" if later and dl[0] == dl[0] else " | - |"))
            # a reply to query q that repeats a value of the reply to query q-1 which is not one of
            # q's references: the model copying its previous answer instead of reading the context
            refs_of, reply_of = {}, {}
            for t in tasks:
                for r in tasks[t]:
                    if r.get("refs_text") is not None:
                        refs_of[(t, r["case"], r["item"])] = r["refs_text"]
                    reply_of[(t, r["policy"], r["case"], r["item"])] = r.get("reply") or ""
            if refs_of:
                print("\nreplies to query q that repeat a value (a number of 5+ digits, a UUID, a variable name) of the "
                      "same method's reply to query q-1 that is not one of q's references:\n")
                print("| method | " + " | ".join(f"q{i + 1}" for i in range(1, 5)) + " | all |")
                print("|---|" + "---|" * 5)
                rep = {}
                for m in methods:
                    cnt = []
                    for q in range(1, 5):
                        k = n = 0
                        for t in tasks:
                            for r in tasks[t]:
                                own = refs_of.get((t, r["case"], q))
                                prev = reply_of.get((t, m, r["case"], q - 1))
                                if r["policy"] != m or r["item"] != q or prev is None or own is None:
                                    continue
                                n += 1
                                said = set(VALUE.findall(r.get("reply") or "")) & set(VALUE.findall(prev))
                                k += bool(said - {x for x in own})
                        cnt.append((k, n))
                    rep[m] = cnt
                    tk, tn = sum(k for k, _ in cnt), sum(n for _, n in cnt)
                    print(f"| {m} | " + " | ".join(f"{k}/{n}" for k, n in cnt) + f" | {tk}/{tn} |")
                agg_repeat[f"{model}-{L}-{shape}"] = rep
            print()
        agg[f"{model}-{L}-{shape}"] = {"per_task": per_task, "mean": mean, "mean_dlp": mdlp, "by_query": byq,
                                       "by_query_dlp": dlpq if shape == "followup" else {},
                                       "cases": ncases}
    if a.plot:
        fu = {k: v for k, v in agg.items() if v["by_query"]}
        if a.plot_cell:
            fu = {k: v for k, v in fu.items() if k == f"{a.plot_cell}-followup"}
            if not fu:
                sys.exit(f"ruler_tables: no follow-up cell {a.plot_cell} (--plot-cell) among the units")
        if fu:
            key, v = sorted(fu.items())[0]
            data = "\n".join(f"{q + 1} " + " ".join(f"{v['by_query'][m][q][0]:.4f} {v['by_query'][m][q][1]:.4f} "
                                                    f"{v['by_query'][m][q][2]:.4f}" for m in v["by_query"])
                             for q in range(5))
            names = list(v["by_query"])
            gp = (f"set terminal pngcairo size 900,480 noenhanced font ',10'\nset output '{a.plot}'\n"
                  f"$d << EOD\n{data}\nEOD\n"
                  f"set title 'RULER follow-up queries on one context ({key}; {stamp['commit']}): score by query index'\n"
                  "set xlabel 'query index (1 = asked with the context)'\nset ylabel 'score (string_match_all)'\n"
                  "set xrange [0.7:5.3]\nset yrange [0:1.05]\nset grid ytics\nset key outside right\nset xtics 1\n"
                  "plot " + ", ".join(f"$d using ($1+{(i - len(names) / 2) * 0.04:.2f}):{2 + 3 * i}:{3 + 3 * i}:{4 + 3 * i} "
                                      f"with yerrorlines lw 2 lc rgb '{COLORS[i % len(COLORS)]}' title '{n}'" for i, n in enumerate(names)) + "\n")
            r = subprocess.run(["gnuplot"], input=gp, text=True, capture_output=True)
            print(f"plot: {a.plot}" if r.returncode == 0 else f"plot failed: {r.stderr}")
    if a.json:
        for k, v in agg_repeat.items():
            agg[k]["repeats_previous"] = v
        print(json.dumps(agg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
