#!/usr/bin/env bash
# cli_eval — smoke test of `kvtier eval niah|multifact|ppl` on the tiny random-weight model
# (tests/unit/mkmodel.c, which carries a real SentencePiece vocabulary).  The tiny model answers
# nonsense, so this checks the harness, not the policies:
#   - each task runs three policies side by side, exits 0, and its last stdout line is one JSON
#     object with, per policy, policy / pass_rate / ci_low / ci_high / answer_logprob and
#     ci_low <= pass_rate <= ci_high;
#   - the budget really binds (streaming evicts, no_eviction never does, peaks stay in budget);
#   - <out>/<task>-<stamp>.json (with per-case rows) and .csv are written (.png when gnuplot is
#     installed), with the expected number of rows;
#   - the same seed gives the same cases and numbers, another seed other needles, and
#     --fresh-engine (a model load per session) the same cases;
#   - bad input fails with exit 2 and a message naming the bad value.
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVT_TINY_DIR, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/lib.sh"
t_need_essays
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
TINY=${KVT_TINY_DIR:?KVT_TINY_DIR is not set}/tiny-llama.gguf
t_init cli-eval
ulimit -c 0 2>/dev/null || true


if [ ! -f "$TINY" ]; then
    echo "FAIL tiny model '$TINY' is missing (run the gen_tiny_models test first)"
    echo "0 passed, 1 failed"
    exit 1
fi
HAVE_GNUPLOT=0
command -v gnuplot >/dev/null 2>&1 && HAVE_GNUPLOT=1

# one thread: the tiny model gains nothing from two, and spinning OpenMP workers on a loaded
# 2-core machine make it several times slower
SIZES=(--context 1024 --budget 512 --cases 2 --policies no_eviction,streaming,kvtier --threads 1 -m "$TINY")

# run NAME TASK ARGS...: stdout/stderr into $TMP/NAME.{out,err}, output files under $TMP/NAME/
run() {
    local name=$1 task=$2
    shift 2
    if "$BIN" eval "$task" "${SIZES[@]}" --out "$TMP/$name" --json "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"; then
        ok "eval $task ($name) ran"
    else
        bad "eval $task ($name) exited with status $?"
        tail -n 20 "$TMP/$name.err"
    fi
}

# check NAME DESCRIPTION PYTHON-EXPRESSION: evaluated with j (last stdout line), f (the .json
# file), rows (the .csv rows as dicts), files (names under the out dir), gnuplot (bool)
check() {
    local out
    out=$(python3 - "$TMP" "$1" "$3" "$HAVE_GNUPLOT" <<'EOF'
import csv, glob, json, os, sys
tmp, name, expr, gnuplot = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
def last_line():
    try:
        lines = [l for l in open(f"{tmp}/{name}.out").read().splitlines() if l.strip()]
        return json.loads(lines[-1])
    except (OSError, ValueError, IndexError):
        return {}
def one(pattern, loader):
    paths = glob.glob(f"{tmp}/{name}/{pattern}")
    if len(paths) != 1:
        return None
    try:
        return loader(paths[0])
    except (OSError, ValueError):
        return None
j = last_line()
f = one("*.json", lambda p: json.load(open(p))) or {}
rows = one("*.csv", lambda p: list(csv.DictReader(open(p)))) or []
files = sorted(os.listdir(f"{tmp}/{name}")) if os.path.isdir(f"{tmp}/{name}") else []
P = {p.get("policy"): p for p in j.get("policies", [])}
try:
    print("yes" if eval(expr) else "no")
except Exception as e:  # a missing field is a failure, not a crash of the test
    print(f"error: {type(e).__name__}: {e}")
EOF
)
    if [ "$out" = yes ]; then ok "$2"; else bad "$2 ($3 -> $out)"; fi
}

FIELDS='all(all(k in p for k in ("policy", "pass_rate", "ci_low", "ci_high", "answer_logprob")) for p in j["policies"])'
CI='all(p["n"] > 0 and p["ci_low"] <= p["pass_rate"] <= p["ci_high"] and 0 <= p["ci_low"] and p["ci_high"] <= 1 for p in j["policies"])'
POLS='[p["policy"] for p in j["policies"]] == ["no_eviction", "streaming", "kvtier"]'
BINDS='P["no_eviction"]["evictions"] == 0 and P["streaming"]["evictions"] > 0 and P["streaming"]["peak_resident_tokens"] <= 512 and P["kvtier"]["peak_resident_tokens"] <= 512'
STAMPS='all(j[k] for k in ("model", "llama_cpp", "commit", "date", "machine")) and j["budget"] == 512 and j["context"] == 1024 and j["cases"] == 2'
CSVCOLS='set(("policy", "case", "depth", "context", "budget", "passed", "answer_logprob", "evictions", "recoveries")) <= set(rows[0])'
PNG='any(x.endswith(".png") for x in files) == gnuplot'

for task in niah multifact ppl; do
    extra=()
    [ "$task" = ppl ] && extra=(--segment 128)
    run "$task" "$task" "${extra[@]}"
    check "$task" "$task: the JSON line has policy, pass_rate, ci_low, ci_high, answer_logprob" "$FIELDS"
    check "$task" "$task: ci_low <= pass_rate <= ci_high for every policy" "$CI"
    check "$task" "$task: the three policies in the order given" "$POLS"
    check "$task" "$task: the budget binds (streaming evicts, no_eviction does not, peaks <= 512)" "$BINDS"
    check "$task" "$task: stamped with model, llama.cpp, commit, date, machine and the sizes" "$STAMPS"
    check "$task" "$task: the .json file holds the summary and per-case rows" \
        'f["policies"] == j["policies"] and len(f["rows"]) == len(rows) > 0'
    check "$task" "$task: the .csv has the per-case columns" "$CSVCOLS"
    check "$task" "$task: .png written iff gnuplot is installed (gnuplot: $HAVE_GNUPLOT)" "$PNG"
    if ! grep -q "^\[$task\] case 2/2" "$TMP/$task.err"; then bad "$task: progress lines on stderr"; else ok "$task: progress lines on stderr"; fi
done
check niah "niah: one row per case and policy" 'len(rows) == 6 and all(r["passed"] in ("0", "1") for r in rows)'
check niah "niah: each row says where the needle was at the question (no_eviction: resident; streaming: evicted in some case; ppl: unknown)" \
    'all(r["fact"] == "resident" for r in rows if r["policy"] == "no_eviction") and any(r["fact"] == "evicted" for r in rows if r["policy"] == "streaming") and all(r["fact"] in ("resident", "recovered", "evicted") for r in rows) and [r["fact"] for r in rows] == [r["fact"] for r in f["rows"]]'
check niah "niah: cases cycle through the depths" 'sorted(set(r["depth"] for r in rows)) == ["25", "5"]'
check niah "niah: the table is on stdout before the JSON line" \
    'open(f"{tmp}/niah.out").read().startswith("# kvtier eval niah")'
check multifact "multifact: five probes per case and policy" 'len(rows) == 30'
check multifact "multifact: no_eviction's facts are all resident, streaming lost some" \
    'all(r["fact"] == "resident" for r in rows if r["policy"] == "no_eviction") and any(r["fact"] == "evicted" for r in rows if r["policy"] == "streaming")'
check ppl "ppl: rows carry no fact (unknown)" 'all(r["fact"] == "unknown" for r in rows)'
check ppl "ppl: perplexity, NLL difference and KL bound per policy" \
    'all(p["ppl"] > 1 for p in j["policies"]) and P["no_eviction"]["kl_vs_ref"] < 1e-6 and P["streaming"]["kl_vs_ref"] > 0 and all(p["kl_vs_ref"] >= 0 for p in j["policies"]) and P["streaming"]["nll_abs_diff_vs_ref"] >= 0'

# same seed, same run; another seed, other needles
run niah2 niah
check niah2 "niah: the same seed reproduces the cases and the numbers" \
    '[(r["policy"], r["answer_logprob"], r["reply"]) for r in rows] == [(r["policy"], r["answer_logprob"], r["reply"]) for r in csv.DictReader(open(glob.glob(f"{tmp}/niah/*.csv")[0]))]'
run niah3 niah --seed 7
check niah3 "niah: another seed gives other needles" \
    '[c["facts"] for c in f["cases_detail"]] != [c["facts"] for c in json.load(open(glob.glob(f"{tmp}/niah/*.json")[0]))["cases_detail"]]'
run fresh niah --fresh-engine
check fresh "niah --fresh-engine: a model load per session, the same cases and rows" \
    'f["cases_detail"] == json.load(open(glob.glob(f"{tmp}/niah/*.json")[0]))["cases_detail"] and len(rows) == 6 and not any(r["error"] == "1" for r in rows)'

# dense recovery: kvtier with the (tiny) model as its own embedder
run embed niah --policies no_eviction,kvtier --embed-model "$TINY" --min-cosine -1
check embed "niah --embed-model: kvtier runs with dense recovery and recovers" \
    'len(rows) == 4 and not any(r["error"] == "1" for r in rows) and P["kvtier"]["recoveries"] > 0'

# expect NAME WANT_EXIT FRAGMENT -- COMMAND...: exit status and a fixed string on stderr
expect() {
    local name=$1 want=$2 frag=$3
    shift 4
    "$@" >"$TMP/x.out" 2>"$TMP/x.err" </dev/null
    local rc=$? why=""
    [ "$rc" -ne "$want" ] && why="exit status $rc, expected $want"
    grep -qF -- "$frag" "$TMP/x.err" || why="${why:+$why; }stderr lacks \"$frag\""
    if [ -z "$why" ]; then ok "$name"; else bad "$name: $why"; sed 's/^/     stderr: /' "$TMP/x.err" | head -n 5; fi
}
expect "unknown policy names the policy and the known ones" 2 "unknown policy 'bogus' (known: kvtier, no_eviction" -- \
    "$BIN" eval niah -m "$TINY" --policies no_eviction,bogus --out "$TMP/bad"
expect "budget larger than the context" 2 "--budget 2048 is larger than --context 1024" -- \
    "$BIN" eval niah -m "$TINY" --context 1024 --budget 2048 --out "$TMP/bad"
expect "unknown task" 2 "unknown task 'haystack'" -- "$BIN" eval haystack -m "$TINY"
expect "policy named twice" 2 "--policies names 'kvtier' twice" -- \
    "$BIN" eval niah -m "$TINY" --policies kvtier,kvtier
expect "bad depth" 2 "--depths element '120' is not a percentage" -- \
    "$BIN" eval niah -m "$TINY" --depths 5,120
expect "no essays" 2 "--texts '$TMP/none' is not a directory" -- \
    "$BIN" eval niah -m "$TINY" --texts "$TMP/none"
expect "unreadable embedding model names the path" 1 "$TMP/none.gguf" -- \
    "$BIN" eval niah -m "$TINY" --embed-model "$TMP/none.gguf" --out "$TMP/bad"
[ -e "$TMP/bad" ] && bad "a usage error wrote output files" || ok "usage errors write no output"
if "$BIN" eval niah --help | grep -q "Usage: kvtier eval"; then ok "--help"; else bad "--help"; fi

t_finish
