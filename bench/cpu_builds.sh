#!/usr/bin/env bash
# bench/cpu_builds.sh — decode and prefill speed of kvtier built against different llama.cpp CPU
# builds (issue #22): the native build (-march=native, probed), the lower-ISA one
# (KVTIER_PROBE_FAIL=avx512) and the portable one (KVTIER_LLAMA_PORTABLE=1: GGML_BACKEND_DL +
# GGML_CPU_ALL_VARIANTS), each a kvtier build tree configured against that prefix.
#
#   bench/cpu_builds.sh [-m MODEL] [-r ROUNDS] [-t THREADS] [--json] LABEL=BUILD_DIR ...
#
# Each round runs `kvtier bench policy --policies no_eviction` (6 user turns of 200 essay tokens,
# 32 greedy tokens after each) once per build, in turn (A B C A B C ...), so drift of a shared
# machine hits every build alike; reports per build the median decode ms/step and prefill
# ms/token over the rounds, tok/s, and the ratio to the first build, with the stamp (model,
# llama.cpp and CPU build of each, kvtier commit, CPU, date).  --json: one JSON object on the
# last stdout line as well.
#
# Make the trees first, e.g.:
#   make build                                                         # native, build/
#   KVTIER_PROBE_FAIL=avx512 make build BUILD=build-isa                # AVX2
#   KVTIER_LLAMA_PORTABLE=1 make build BUILD=build-portable            # portable
set -euo pipefail
MODEL=${KVTIER_CHAT_MODEL:-}
ROUNDS=5
THREADS=2
JSON=0
while [ $# -gt 0 ]; do
    case $1 in
        -m) MODEL=$2; shift 2 ;;
        -r) ROUNDS=$2; shift 2 ;;
        -t) THREADS=$2; shift 2 ;;
        --json) JSON=1; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        -*) echo "cpu_builds.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || { echo "cpu_builds.sh: give at least one LABEL=BUILD_DIR (see --help)" >&2; exit 2; }
[ -f "$MODEL" ] || { echo "cpu_builds.sh: model '$MODEL' is not a file (-m, or \$KVTIER_CHAT_MODEL)" >&2; exit 2; }
for b in "$@"; do
    [ -x "${b#*=}/kvtier" ] || { echo "cpu_builds.sh: ${b#*=}/kvtier is not built (${b%%=*})" >&2; exit 2; }
done
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
for r in $(seq 1 "$ROUNDS"); do
    for b in "$@"; do
        label=${b%%=*}
        printf '[cpu_builds] round %d/%d: %s\n' "$r" "$ROUNDS" "$label" >&2
        "${b#*=}/kvtier" bench policy -m "$MODEL" --policies no_eviction --turns 6 --gen 32 -t "$THREADS" --json \
            2>/dev/null | tail -n 1 >"$OUT/$label.$r.json"
    done
done
python3 - "$OUT" "$ROUNDS" "$JSON" "$@" <<'PY'
import json, statistics, subprocess, sys, time
out, rounds, want_json, builds = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:]
rows, stamp = [], {}
cpu = subprocess.run("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2", shell=True, capture_output=True,
                     text=True).stdout.strip()
for b in builds:
    label = b.split("=", 1)[0]
    runs = [json.load(open(f"{out}/{label}.{r}.json")) for r in range(1, rounds + 1)]
    p = [x["policies"][0] for x in runs]
    dec = statistics.median(x["decode_ms_per_step"] for x in p)
    pre = statistics.median(x["prefill_ms_per_token"] for x in p)
    rows.append({"build": label, "llama_cpp": runs[0]["llama_cpp"], "decode_ms_per_step": dec,
                 "decode_tok_s": 1000 / dec, "prefill_ms_per_token": pre, "prefill_tok_s": 1000 / pre,
                 "decode_min_max": [min(x["decode_ms_per_step"] for x in p), max(x["decode_ms_per_step"] for x in p)]})
    stamp = {"model": runs[0]["model"], "commit": runs[0]["commit"], "threads": runs[0]["threads"]}
base = rows[0]
for r in rows:
    r["decode_vs_first"] = base["decode_ms_per_step"] / r["decode_ms_per_step"]
    r["prefill_vs_first"] = base["prefill_ms_per_token"] / r["prefill_ms_per_token"]
stamp.update({"cpu": cpu, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rounds": rounds,
              "workload": "bench policy --policies no_eviction --turns 6 --gen 32 (median over rounds)"})
print(f"# bench/cpu_builds.sh | {stamp['model']} | kvtier commit {stamp['commit']} | {cpu} | {stamp['threads']} threads "
      f"| {stamp['date']} | {rounds} rounds, interleaved | {stamp['workload']}")
print(f"{'build':<10} {'decode ms/step':>15} {'tok/s':>8} {'x first':>8} {'prefill ms/tok':>15} {'tok/s':>8} {'x first':>8}"
      f"  decode min-max   llama.cpp CPU build")
for r in rows:
    print(f"{r['build']:<10} {r['decode_ms_per_step']:>15.2f} {r['decode_tok_s']:>8.1f} {r['decode_vs_first']:>8.3f} "
          f"{r['prefill_ms_per_token']:>15.3f} {r['prefill_tok_s']:>8.1f} {r['prefill_vs_first']:>8.3f}  "
          f"{r['decode_min_max'][0]:.2f}-{r['decode_min_max'][1]:.2f}   {r['llama_cpp'].split('CPU build ')[-1]}")
if want_json:
    print(json.dumps({"stamp": stamp, "builds": rows}))
PY
