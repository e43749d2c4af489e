#!/usr/bin/env python3
"""bench/ruler_grid.py — the RULER grid of docs/EVALUATION.md, unattended and resumable.

One unit of work is one case of one cell (model x length x shape x task): one invocation of
`kvtier eval ruler TASK --shape S --context L --budget L/RATIO --cases 1 --first-case I`, every
method side by side on that case (followup adds --store: kvtier+store, each query a fresh session
that finds the context in the block store), its JSON written under OUT/units/.  A unit whose JSON exists is
done; a killed run started again with the same OUT continues with the next unit (the unit that was
running is run again from its start).  Units run case-major (case 1 of every cell, then case 2,
...), so a grid stopped early still has every cell at the same number of cases.

Progress goes to stdout, one line per unit with the elapsed time and an estimate of what is left;
OUT/commands.txt lists every invocation and its time.  bench/ruler_tables.py OUT turns the units
into the tables and the follow-up plot.

The archive: every finished unit is also written, without its context text (a case is reproducible
from its seed and index), to ARCHIVE/<model>-<length>-<shape>-<task>-<case>.json, by default
bench/ruler_units/seed<S>-ratio<R>/ in the source tree, which is committed: the grid is ~150 h
of a 2-core machine (docs/EVALUATION.md), so it accumulates across machines and sessions.  A unit in the archive is done
(run again with --rerun to replace it) unless it is stale: measured by a kvtier from before
CONFIG_SINCE, the commit since which the grid's configuration holds (a unit of an older kvtier is run
again, so that the grid measures one configuration); bench/ruler_tables.py reads the archive as it reads OUT.  The
default archive takes only the grid's own configuration (the default --policies and --max-tokens,
the models smollm2 and gemma); any other run archives only where --archive names a directory.

llama-server (the same vendored llama.cpp, `scripts/bootstrap.sh llama-server-path`) runs as two
more methods on the same cases, through its OpenAI API with the model's own chat template, greedy:
at kvtier's KV memory (`-c` = the budget, `--context-shift`) and at the full context (the ceiling).
Its rows go to UNIT.llama.json beside the unit (the same resumption: done when the file exists);
they carry the score only (no log-probabilities through that API).  --llama-server runs this pass
over the done units (add --no-kvtier to run only it).

Usage:
  bench/ruler_grid.py [--out DIR] [--models smollm2,gemma] [--lengths 4096] [--shapes prompt,followup]
                      [--tasks all] [--cases 20] [--ratio 4] [--policies LIST] [--threads 1] [--jobs NCPU]
Lengths default to the issue's: 2048,4096,8192 for SmolLM2 and 4096,8192,16384 for Gemma 3.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
SINGLE_QUESTION = {"cwe", "fwe"}  # no followup shape: one question per context
LENGTHS = {"smollm2": [2048, 4096, 8192], "gemma": [4096, 8192, 16384]}
POLICIES = "no_eviction,truncate,streaming,h2o,snapkv,kvtier"
# The grid measures one configuration of kvtier (issue #42): CONFIG_SINCE is the last commit that changed
# what a unit measures (kvtier's eviction or recovery, the eval's cases or scoring).  A unit from a commit
# before it, or from a commit this clone's git does not know, is stale: it is run again (its files
# replaced) as a unit not yet done; a dirty tree's unit counts as its commit's.  Move CONFIG_SINCE with
# any such change.
CONFIG_SINCE = "64d0585"


def env_models():
    out = subprocess.run([os.path.join(ROOT, "scripts/bootstrap.sh"), "env"], capture_output=True, text=True, check=True).stdout
    env = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("export "):
            line = line[7:]
        if "=" in line:
            k, v = line.split("=", 1)
            env[k] = v.strip("'\"")
    return {"smollm2": env.get("KVTIER_CHAT_MODEL"), "gemma": env.get("KVTIER_MODEL")}


class Freshness:
    """Whether a unit's kvtier commit is CONFIG_SINCE or a descendant of it (git merge-base --is-ancestor,
    one call per distinct commit).  Outside a git checkout every unit counts as current (said once)."""
    def __init__(self):
        self.memo = {}
        self.git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", "-q", CONFIG_SINCE + "^{commit}"],
                                  capture_output=True).returncode == 0
        if not self.git:
            print(f"ruler_grid: no git history here with {CONFIG_SINCE}: units are not checked for staleness", flush=True)

    def current(self, commit):
        if not self.git:
            return True
        if commit not in self.memo:
            c = (commit or "").removesuffix("-dirty")
            self.memo[commit] = bool(c) and subprocess.run(
                ["git", "-C", ROOT, "merge-base", "--is-ancestor", CONFIG_SINCE, c], capture_output=True).returncode == 0
        return self.memo[commit]

    def file_current(self, path):
        try:
            with open(path) as f:
                return self.current(json.load(f).get("commit"))
        except (OSError, ValueError):
            return False


def default_jobs():
    """One unit per CPU this process may use, at most one per 3 GiB of the machine's memory (a Gemma 3 unit at
    16k holds its model, KV cells and attention capture: ~1-2 GiB)."""
    ncpu = len(os.sched_getaffinity(0))
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return ncpu
    return max(1, min(ncpu, mem // (3 << 30)))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(port, messages, max_tokens):
    """One greedy chat completion; (reply, error)."""
    import urllib.error
    import urllib.request
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.load(r)["choices"][0]["message"]["content"] or "", None
    except urllib.error.HTTPError as e:
        return "", f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}"
    except Exception as e:  # noqa: BLE001 -- any failure is this method's answer to the case
        return "", str(e)[:200]


def write_atomic(path, obj):
    """obj as JSON at path, whole or not at all (a temporary file renamed over it)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=None, separators=(",", ":"))
        f.write("\n")
    os.replace(tmp, path)


def compact(d):
    """A unit's JSON for the archive: everything but the context's text (cases_detail[].messages, the
    bulk of the file: ~4.5 bytes per context token), which the case's seed and index reproduce."""
    d = dict(d)
    d["cases_detail"] = [{k: v for k, v in c.items() if k != "messages"} for c in d.get("cases_detail", [])]
    return d


def unit_text(a, out, paths, u, unit_file, archive):
    """The unit's JSON with its context text: the grid directory's, else the archived unit with the text of
    its case built again from the seed (kvtier eval ruler --cases-only, no policy run), which must be the
    archived case (its references, depths and token counts) or the unit is reported and skipped."""
    if os.path.exists(unit_file(u)):
        return json.load(open(unit_file(u)))
    m, L, shape, t, case = u
    d = json.load(open(os.path.join(archive, os.path.basename(unit_file(u)))))
    tmp = os.path.join(out, "running-cases")
    subprocess.run(["rm", "-rf", tmp])
    cmd = [a.bin, "eval", "ruler", t, "--shape", shape, "-m", paths[m], "--context", str(L), "--budget", str(L // a.ratio),
           "--cases", "1", "--first-case", str(case), "--seed", str(a.seed), "--out", tmp, "--cases-only",
           "--max-tokens", str(d["max_tokens"])]
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    files = [x for x in os.listdir(tmp) if x.endswith(".json")] if os.path.isdir(tmp) else []
    built = json.load(open(os.path.join(tmp, files[0]))) if p.returncode == 0 and len(files) == 1 else None
    subprocess.run(["rm", "-rf", tmp])
    if built is None:
        print(f"ruler_grid: {os.path.basename(unit_file(u))}: building its case failed: {p.stderr.strip()[-200:]}", flush=True)
        return None
    c = built["cases_detail"][0]
    if {k: v for k, v in c.items() if k != "messages"} != d["cases_detail"][0] or built["n_ctx"] != d["n_ctx"]:
        print(f"ruler_grid: {os.path.basename(unit_file(u))}: its case built again is not the archived one "
              "(the generator or the texts changed): skipped", flush=True)
        return None
    d["cases_detail"] = [c]
    return d


def llama_pass(a, out, paths, units, unit_file, archive):
    """llama-server at the budget (--context-shift) and at full context on every done unit (a unit only
    in the archive gets its text from its case built again: unit_text)."""
    binary = subprocess.run([os.path.join(ROOT, "scripts/bootstrap.sh"), "llama-server-path"], capture_output=True,
                            text=True).stdout.strip()
    if not binary or not os.path.exists(binary):
        print("ruler_grid: no llama-server (scripts/bootstrap.sh llama-server); its pass is skipped", flush=True)
        return 0
    def llama_done(u):
        name = os.path.basename(unit_file(u))[:-5] + ".llama.json"
        return os.path.exists(unit_file(u)[:-5] + ".llama.json") or (archive and os.path.exists(os.path.join(archive, name)))
    def archived(u):
        return archive and os.path.exists(os.path.join(archive, os.path.basename(unit_file(u))))
    todo = [u for u in units if not llama_done(u) and (os.path.exists(unit_file(u)) or archived(u))]
    llama_threads = min(a.threads * a.jobs, len(os.sched_getaffinity(0)))  # one server at a time: the grid's cores
    print(f"ruler_grid: llama-server pass over {len(todo)} units", flush=True)
    failed = 0
    t_start = time.time()
    for i, u in enumerate(todo):
        m, L, shape, t, case = u
        d = unit_text(a, out, paths, u, unit_file, archive)
        if d is None:
            failed += 1
            continue
        c = d["cases_detail"][0]
        facts, msgs = c["facts"], c["messages"]
        rows = []
        for label, n_ctx, extra in (("llama-server@budget", L // a.ratio, ["--context-shift"]),
                                    ("llama-server@full", d["n_ctx"], [])):
            port = free_port()
            log = open(unit_file(u)[:-5] + f".{label}.log", "w")
            srv = subprocess.Popen([binary, "-m", paths[m], "-c", str(n_ctx), "-np", "1", "-t", str(llama_threads), "--port", str(port),
                                    "--host", "127.0.0.1"] + extra, stdout=log, stderr=subprocess.STDOUT)
            try:
                import urllib.request
                for _ in range(600):
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                        break
                    except Exception:  # noqa: BLE001 -- not up yet
                        time.sleep(0.2)
                hist = []
                if shape == "turns":  # the document turns, each answered "Noted.", then the question
                    for m_ in msgs[:-1]:
                        hist += [{"role": "user", "content": m_}, {"role": "assistant", "content": "Noted."}]
                    queries = msgs[-1:]
                else:
                    queries = msgs
                for q, text in enumerate(queries):
                    hist.append({"role": "user", "content": text})
                    reply, err = chat(port, hist, d["max_tokens"])
                    hist.append({"role": "assistant", "content": reply})
                    refs = facts[q]["refs"]
                    hit = sum(1 for r in refs if r.lower() in reply.lower())
                    rows.append({"policy": label, "case": case, "item": q, "refs": len(refs), "refs_hit": hit,
                                 "passed": int(hit == len(refs)), "error": False, "http_error": err,
                                 "answer_logprob": None, "reply": reply, "n_ctx": n_ctx})
            finally:
                srv.terminate()
                srv.wait()
                log.close()
        write_atomic(unit_file(u)[:-5] + ".llama.json", {"rows": rows})
        if archive:
            write_atomic(os.path.join(archive, os.path.basename(unit_file(u))[:-5] + ".llama.json"), {"rows": rows})
        el = time.time() - t_start
        print(f"[llama {i + 1}/{len(todo)}] {m} {L} {shape} {t} case {case}: "
              + " ".join(f"{r['policy']} q{r['item'] + 1} {r['refs_hit']}/{r['refs']}{' (' + r['http_error'][:60] + ')' if r['http_error'] else ''}"
                         for r in rows) + f" | elapsed {el / 60:.0f} min", flush=True)
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results directory (default results/ruler-<UTC time>; reuse one to resume)")
    ap.add_argument("--models", default="smollm2,gemma", help="smollm2, gemma (installed by scripts/bootstrap.sh) or NAME=PATH")
    ap.add_argument("--lengths", default=None, help="context lengths for every model (default: the issue's per model)")
    ap.add_argument("--shapes", default="prompt,turns,followup")
    ap.add_argument("--tasks", default="all")
    ap.add_argument("--cases", type=int, default=20, help="cases per cell (default 20)")
    ap.add_argument("--ratio", type=int, default=4, help="budget = context / RATIO (default 4)")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--threads", type=int, default=1, help="threads of each kvtier eval (default 1)")
    ap.add_argument("--jobs", type=int, default=default_jobs(),
                    help="units run at once (default: the CPUs this process may use, at most one per 3 GiB of memory; "
                         "here %(default)s); one-thread units side by side give 1.40x the units per hour of one 2-thread "
                         "unit at a time on a 2-core machine, with identical rows (docs/EVALUATION.md); llama-server's "
                         "pass runs one server at a time with jobs x threads threads (at most the CPUs)")
    ap.add_argument("--max-tokens", type=int, default=0, help="reply limit (default: kvtier eval ruler's per task)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build/kvtier"))
    ap.add_argument("--llama-server", action="store_true", help="also run llama-server at the budget and at full context")
    ap.add_argument("--no-kvtier", action="store_true", help="with --llama-server: only the llama-server pass")
    ap.add_argument("--dry-run", action="store_true", help="list the units and how many are done, run nothing")
    ap.add_argument("--archive", default=None,
                    help="archive directory (default bench/ruler_units/seed<S>-ratio<R> for the grid's own configuration)")
    ap.add_argument("--no-archive", action="store_true", help="neither read nor write an archive")
    ap.add_argument("--rerun", action="store_true", help="run archived units again (their archive files are replaced)")
    a = ap.parse_args()
    if a.jobs < 1 or a.threads < 1:
        sys.exit("ruler_grid: --jobs and --threads must be at least 1")
    out = a.out or os.path.join(ROOT, "results", time.strftime("ruler-%Y%m%d-%H%M%S", time.gmtime()))
    os.makedirs(os.path.join(out, "units"), exist_ok=True)
    paths = env_models()
    names = []
    custom = False
    for spec in a.models.split(","):  # NAME, or NAME=PATH for any GGUF
        name, _, path = spec.partition("=")
        if path:
            custom = True
            paths[name] = path
            LENGTHS.setdefault(name, [2048, 4096, 8192])
        names.append(name)
    tasks = TASKS if a.tasks == "all" else a.tasks.split(",")
    for t in tasks:
        if t not in TASKS:
            sys.exit(f"ruler_grid: unknown task '{t}' (known: {', '.join(TASKS)})")
    units = []
    for case in range(1, a.cases + 1):
        for m in names:
            if m not in paths or not paths[m] or not os.path.isfile(paths[m]):
                sys.exit(f"ruler_grid: model '{m}' is not installed (scripts/bootstrap.sh; known: smollm2, gemma, "
                         "or NAME=PATH)")
            lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else LENGTHS[m]
            for L in lengths:
                for shape in a.shapes.split(","):
                    for t in tasks:
                        if shape == "followup" and t in SINGLE_QUESTION:
                            continue
                        units.append((m, L, shape, t, case))
    def unit_file(u):
        m, L, shape, t, case = u
        return os.path.join(out, "units", f"{m}-{L}-{shape}-{t}-{case:03d}.json")
    archive = None
    standard = a.policies == POLICIES and not a.max_tokens and not custom
    if not a.no_archive and (a.archive or standard):
        archive = a.archive or os.path.join(ROOT, "bench", "ruler_units", f"seed{a.seed}-ratio{a.ratio}")
        os.makedirs(archive, exist_ok=True)
    fresh = Freshness()
    def archived(u):
        return archive is not None and os.path.exists(os.path.join(archive, os.path.basename(unit_file(u))))
    def done(u):
        if os.path.exists(unit_file(u)) and fresh.file_current(unit_file(u)):
            return True
        return archived(u) and not a.rerun and fresh.file_current(os.path.join(archive, os.path.basename(unit_file(u))))
    stale = sum(1 for u in units if (os.path.exists(unit_file(u)) or archived(u)) and not done(u) and not a.rerun)
    if archive:  # units done here before the archive existed (or its write failed) go there now
        for u in units:
            for ext in (".json", ".llama.json"):
                src, dst = unit_file(u)[:-5] + ext, os.path.join(archive, os.path.basename(unit_file(u))[:-5] + ext)
                if os.path.exists(src) and not os.path.exists(dst) and (ext != ".json" or fresh.file_current(src)):
                    write_atomic(dst, compact(json.load(open(src))))
    todo = [] if a.no_kvtier else [u for u in units if not done(u)]
    n_done = sum(1 for u in units if done(u))
    n_arch = sum(1 for u in units if archived(u) and not os.path.exists(unit_file(u)))
    print(f"ruler_grid: {len(units)} units, {n_done} done, {len(todo)} to run"
          + (f" ({stale} of them stale: kvtier before {CONFIG_SINCE})" if stale and not a.no_kvtier else "")
          + (" (--no-kvtier: the llama-server pass only)" if a.no_kvtier else "") + f"; results in {out}"
          + (f"; archive {archive} ({n_arch} units there only)" if archive else "; no archive"), flush=True)
    if a.dry_run:
        return 0
    with open(os.path.join(out, "grid.json"), "w") as f:
        json.dump({"models": {m: paths.get(m) for m in names}, "cases": a.cases, "ratio": a.ratio,
                   "policies": a.policies, "shapes": a.shapes, "tasks": tasks, "seed": a.seed, "threads": a.threads}, f, indent=1)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    for x in os.listdir(out):  # the scratch directories of a run that was killed
        if x == "running" or x.startswith("running-"):
            subprocess.run(["rm", "-rf", os.path.join(out, x)])
    t_start = time.time()
    failed = 0
    n_run = 0
    lock = threading.Lock()
    procs = {}  # slot -> its running kvtier eval, killed if the grid is interrupted
    stopping = False
    def run_unit(u, slot):
        nonlocal failed, n_run
        m, L, shape, t, case = u
        tmp = os.path.join(out, f"running-{slot}")
        subprocess.run(["rm", "-rf", tmp])
        os.makedirs(tmp)
        cmd = [a.bin, "eval", "ruler", t, "--shape", shape, "-m", paths[m], "--context", str(L), "--budget", str(L // a.ratio),
               "--cases", "1", "--first-case", str(case), "--seed", str(a.seed), "--policies", a.policies,
               "--threads", str(a.threads), "--out", tmp] + (["--max-tokens", str(a.max_tokens)] if a.max_tokens else []) + (["--store"] if shape == "followup" and "kvtier" in a.policies else [])
        t0 = time.time()
        with lock:
            if stopping:
                return
            # errors="replace": a unit is not lost to a byte of its log (kvtier's eval cut a reply's preview
            # inside a character until 2026-12-07: a Gemma 3 unit failed so)
            p = procs[slot] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
                                               env=env)
        _, stderr = p.communicate()
        with lock:
            procs.pop(slot, None)
            if stopping:
                return
        dt = time.time() - t0
        files = [x for x in os.listdir(tmp) if x.endswith(".json")] if os.path.isdir(tmp) else []
        ok = p.returncode == 0 and len(files) == 1
        if ok:
            os.replace(os.path.join(tmp, files[0]), unit_file(u))  # atomic: a unit is done or not
            d = json.load(open(unit_file(u)))
            if archive:
                write_atomic(os.path.join(archive, os.path.basename(unit_file(u))), compact(d))
        subprocess.run(["rm", "-rf", tmp])
        with lock:
            n_run += 1
            with open(os.path.join(out, "commands.txt"), "a") as f:
                f.write(f"{' '.join(cmd)}  # {dt:.0f} s, exit {p.returncode}\n")
            if not ok:
                failed += 1
                with open(unit_file(u) + ".err", "w") as f:
                    f.write(stderr)
                print(f"[{n_run}/{len(todo)}] {m} {L} {shape} {t} case {case}: FAILED (exit {p.returncode}, {unit_file(u)}.err)",
                      flush=True)
                return
            score = {}
            for r in d["rows"]:
                s = score.setdefault(r["policy"], [0, 0])
                s[0] += r.get("refs_hit", 0)
                s[1] += r.get("refs", 0)
            el = time.time() - t_start
            eta = el / n_run * (len(todo) - n_run)
            print(f"[{n_run}/{len(todo)}] {m} {L} {shape} {t} case {case}: {dt:.0f} s | "
                  + " ".join(f"{k} {v[0]}/{v[1]}" for k, v in score.items())
                  + f" | elapsed {el / 60:.0f} min, left ~{eta / 60:.0f} min", flush=True)
    def guarded(u, slot):  # a unit that raises (a full disk, an unreadable result) is a failed unit, not a lost one
        nonlocal failed
        try:
            run_unit(u, slot)
        except Exception as e:  # noqa: BLE001 -- reported and counted; the grid goes on
            with lock:
                failed += 1
                print(f"ruler_grid: {os.path.basename(unit_file(u))}: FAILED ({type(e).__name__}: {e})", flush=True)
    pending = list(todo)
    def worker(slot):  # --jobs units at once, each in its own running-<slot> directory, taken in order
        while True:
            with lock:
                if not pending or stopping:
                    return
                u = pending.pop(0)
            guarded(u, slot)
    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    workers = []
    try:
        if a.jobs == 1:
            worker(0)
        else:
            workers = [threading.Thread(target=worker, args=(k,)) for k in range(a.jobs)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
    except KeyboardInterrupt:  # SIGINT or SIGTERM: the units in flight are stopped, not orphaned
        with lock:
            stopping = True
            for p in procs.values():
                p.kill()
        for w in workers:
            w.join()
        print("ruler_grid: interrupted; the units in flight were stopped (the same command continues the grid)", flush=True)
        return 130
    if a.llama_server:
        failed += llama_pass(a, out, paths, [u for u in units if done(u)], unit_file, archive)
    print(f"ruler_grid: done ({failed} failed units); tables: bench/ruler_tables.py {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
