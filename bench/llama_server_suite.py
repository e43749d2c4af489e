"""llama_server_suite.py — the table of bench/llama_server_suite.sh from pytest's JUnit XML:
per test file, the tests llama-server passes and how many of those kvtier passes; then each test
llama-server passes and kvtier does not, with kvtier's first error line.  Writes DIR/suite.json.

    python3 bench/llama_server_suite.py --dir DIR --files "test_basic ..." [--json] [meta...]
"""
import argparse
import datetime
import json
import os
import xml.etree.ElementTree as ET


def outcomes(path):
    """{test name: (outcome, first line of the failure)} of one JUnit file; {} when missing."""
    if not os.path.exists(path):
        return {}
    res = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = tc.get("name")
        out, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                out = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                why = (el.get("message") or el.text or "").strip().splitlines()
                why = why[0][:200] if why else ""
                break
        res[name] = (out, why)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--files", required=True)
    ap.add_argument("--json", action="store_true")
    for k in ("model", "llama-cpp", "commit", "cpu"):
        ap.add_argument("--" + k, default="")
    a = ap.parse_args()
    rows, diffs = [], []
    for f in a.files.split():
        ll = outcomes(os.path.join(a.dir, "llama", f + ".xml"))
        kv = outcomes(os.path.join(a.dir, "kvtier", f + ".xml"))
        base = sorted(t for t, (o, _) in ll.items() if o == "passed")
        both = [t for t in base if kv.get(t, ("missing", ""))[0] == "passed"]
        extra = sorted(t for t, (o, _) in kv.items() if o == "passed" and t not in base)
        rows.append({"file": f, "llama_server_passed": len(base), "kvtier_passed_of_those": len(both),
                     "kvtier_passed_other": len(extra), "llama_ran": len(ll), "kvtier_ran": len(kv)})
        for t in base:
            o, why = kv.get(t, ("missing", "not run"))
            if o != "passed":
                diffs.append({"file": f, "test": t, "kvtier": o, "why": why})
    tot_l = sum(r["llama_server_passed"] for r in rows)
    tot_k = sum(r["kvtier_passed_of_those"] for r in rows)
    meta = {"model": a.model, "llama_cpp": a.llama_cpp, "commit": a.commit, "cpu": a.cpu,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    doc = {"meta": meta, "files": rows, "total": {"llama_server_passed": tot_l, "kvtier_passed_of_those": tot_k,
           "ratio": round(tot_k / tot_l, 4) if tot_l else None}, "differences": diffs}
    with open(os.path.join(a.dir, "suite.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    print("llama.cpp server tests: %s, %s; kvtier %s; %s; %s" % (meta["model"], meta["llama_cpp"], meta["commit"],
                                                                   meta["cpu"], meta["date"]))
    print()
    print("| test file (slow tests deselected) | llama-server passes | kvtier passes of those | kvtier passes besides |")
    print("|---|---|---|---|")
    for r in rows:
        print("| %s | %d | %d | %d |" % (r["file"], r["llama_server_passed"], r["kvtier_passed_of_those"],
                                         r["kvtier_passed_other"]))
    pct = " (%.0f %%)" % (100.0 * tot_k / tot_l) if tot_l else ""
    print("| **total** | **%d** | **%d%s** | |" % (tot_l, tot_k, pct))
    if diffs:
        print()
        print("llama-server passes, kvtier does not:")
        for d in diffs:
            print("  %s::%s  %s: %s" % (d["file"], d["test"], d["kvtier"], d["why"]))


if __name__ == "__main__":
    main()
