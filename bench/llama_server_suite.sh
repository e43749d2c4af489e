#!/usr/bin/env bash
# llama_server_suite.sh — llama.cpp's own server tests (tools/server/tests in the vendored
# llama.cpp, run where bootstrap extracted them; nothing of them is copied into this repository)
# against llama-server and against `kvtier serve`, both on SmolLM2-135M-Instruct, same llama.cpp
# commit, one test at a time, slow tests deselected.  kvtier is started with the suite's own
# llama-server command lines: bench/llama_server_suite_wrap.sh only inserts "serve" (and, for
# both servers alike, turns the suite's model downloads into -m SmolLM2).  Prints, per test file,
# the tests llama-server passes and how many of those kvtier passes, then each test llama-server
# passes and kvtier does not, with kvtier's first error line; JSON in OUT/suite.json.
#
#   bench/llama_server_suite.sh [--server both|kvtier|llama] [--files "test_basic test_tokenize ..."]
#                               [--out DIR] [--json] [-k EXPR]
#
# Environment: KVTIER (default build/kvtier), LLAMA_SERVER (default: the one bootstrap builds),
# TEST_TIMEOUT_S (one file's pytest, default 1200).  Needs the network once (pip, for the
# suite's requirements.txt; scripts/bootstrap.sh server-suite).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(dirname "$HERE")
# the files of issue #28's measurement; test_template (Jinja rendering, which kvtier does not have: it
# applies templates through llama_chat_apply_template) is run with --files test_template
FILES_DEFAULT="test_basic test_chat_completion test_completion test_security test_tool_call test_metrics test_tokenize
test_compat_oai_responses test_compat_anthropic test_ctx_shift test_slot_save"
SERVER=both FILES=$FILES_DEFAULT OUT=$HERE/results/llama_server_suite JSON=0 KEXPR=
while [ $# -gt 0 ]; do
  case "$1" in
    --server) SERVER=$2; shift 2 ;;
    --files) FILES=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --json) JSON=1; shift ;;
    -k) KEXPR=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "llama_server_suite.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$SERVER" in both|kvtier|llama) ;; *) echo "llama_server_suite.sh: --server '$SERVER': use both, kvtier or llama" >&2; exit 2 ;; esac
eval "$("$SRC/scripts/bootstrap.sh" env)"
TESTS=$("$SRC/scripts/bootstrap.sh" server-suite | tail -1)
PY=$("$SRC/scripts/bootstrap.sh" server-suite-python)
KVTIER=${KVTIER:-$SRC/build/kvtier}
if [ "$SERVER" != kvtier ]; then
  "$SRC/scripts/bootstrap.sh" llama-server >&2
  LLAMA_SERVER=${LLAMA_SERVER:-$("$SRC/scripts/bootstrap.sh" llama-server-path)}
fi
[ "$SERVER" = llama ] || [ -x "$KVTIER" ] || { echo "llama_server_suite.sh: no kvtier binary at $KVTIER (make build)" >&2; exit 2; }
mkdir -p "$OUT"
. "$HERE/lib.sh"
export OMP_WAIT_POLICY=PASSIVE SUITE_MODEL=$KVTIER_CHAT_MODEL
export LLAMA_CACHE=$OUT/llama-cache
run_one() { # server file
  local who=$1 f=$2 bin serve=0 xdg=
  if [ "$who" = kvtier ]; then bin=$KVTIER serve=1 xdg=$OUT/xdg; else bin=$LLAMA_SERVER; fi
  mkdir -p "$OUT/$who" "$OUT/work"
  echo "== $who: $f" >&2
  # the suite writes into its working directory (./tmp): run it from a scratch one
  ( cd "$TESTS" && env SUITE_BIN="$bin" SUITE_SERVE=$serve LLAMA_SERVER_BIN_PATH="$HERE/llama_server_suite_wrap.sh" \
      PORT="$(free_port)" ${xdg:+XDG_CACHE_HOME=$xdg} \
      timeout "${TEST_TIMEOUT_S:-1200}" "$PY" -m pytest "unit/$f.py" -m "not slow" -p no:cacheprovider -q \
        ${KEXPR:+-k "$KEXPR"} -o cache_dir="$OUT/work" --basetemp="$OUT/work/$who-$f" \
        --junitxml="$OUT/$who/$f.xml" >"$OUT/$who/$f.log" 2>&1 ) || true
  tail -1 "$OUT/$who/$f.log" >&2
}
for f in $FILES; do
  [ -f "$TESTS/unit/$f.py" ] || { echo "llama_server_suite.sh: no unit/$f.py in $TESTS" >&2; exit 2; }
  [ "$SERVER" = kvtier ] || run_one llama "$f"
  [ "$SERVER" = llama ] || run_one kvtier "$f"
done
"$PY" "$HERE/llama_server_suite.py" --dir "$OUT" --files "$FILES" --model "$(basename "$SUITE_MODEL")" \
  --llama-cpp "$(basename "$(cd "$TESTS/../../../.." && pwd)") (llama-cpp-python sdist)" \
  --commit "$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  --cpu "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')" $([ $JSON = 1 ] && echo --json)
