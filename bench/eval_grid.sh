#!/usr/bin/env bash
# bench/eval_grid.sh — the measurements behind docs/EVALUATION.md, in one run:
#   1. the target cell: niah and multifact at context 4096, budget 1024 (10 and 4 cases);
#   2. ppl with the exact KL at context 2048, budget 1024 (2 held-out texts);
#   3. the grid: niah at contexts 2048/4096/8192 x budgets 512/1024/2048 (CASES cases each,
#      cycling through DEPTHS; cells whose budget holds the whole context are skipped, and
#      4096/1024 is the target cell of part 1).
# Every policy runs side by side in each invocation, each session on a freshly loaded model
# (--fresh-engine).  Results (JSON, CSV, PNG per invocation, and each table) go under
# results/grid-<UTC time>/ (OUT=DIR to add to an earlier run).  Usage: bench/eval_grid.sh [MODEL]
# (default $KVTIER_MODEL after `scripts/bootstrap.sh`); in the environment CASES=3,
# DEPTHS=5,50,95, THREADS=2, PARTS="target ppl grid", CELLS="8192/1024 2048/512 ..." (grid
# cells CONTEXT/BUDGET in the order they run).
set -eu
cd "$(dirname "$0")/.."
eval "$(scripts/bootstrap.sh env)"
MODEL=${1:-$KVTIER_MODEL}
CASES=${CASES:-3}
DEPTHS=${DEPTHS:-5,50,95}
THREADS=${THREADS:-2}
PARTS=${PARTS:-target ppl grid}
BIN=./build/kvtier
[ -x "$BIN" ] || make build
OUT=${OUT:-results/grid-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE
run() { # NAME ARGS...
    local name=$1
    shift
    echo "== $name: kvtier eval $*" | tee -a "$OUT/commands.txt"
    local t0=$SECONDS
    "$BIN" eval "$@" -m "$MODEL" --threads "$THREADS" --fresh-engine --out "$OUT" --json >"$OUT/$name.txt" 2>"$OUT/$name.err" ||
        echo "   (exit status $?)" | tee -a "$OUT/commands.txt"
    echo "   $((SECONDS - t0)) s" | tee -a "$OUT/commands.txt"
}
for part in $PARTS; do
    case $part in
    target)
        run niah-4096-1024 niah --context 4096 --budget 1024 --cases 10 --max-tokens 48
        run multifact-4096-1024 multifact --context 4096 --budget 1024 --cases 4 --max-tokens 48 ;;
    ppl)
        run ppl-2048-1024 ppl --context 2048 --budget 1024 --cases 2 ;;
    grid)
        # cells as CONTEXT/BUDGET, in the order they run (the ones that tell most first, so a
        # run cut short still covers the targets' neighbourhood)
        for cell in ${CELLS:-8192/1024 2048/512 4096/512 4096/2048 8192/2048 2048/1024 8192/512}; do
            ctx=${cell%/*} budget=${cell#*/}
            [ "$budget" -ge "$ctx" ] && continue
            [ -f "$OUT/niah-$ctx-$budget.txt" ] && continue
            run "niah-$ctx-$budget" niah --context "$ctx" --budget "$budget" --cases "$CASES" \
                --depths "$DEPTHS" --max-tokens 48
        done ;;
    esac
done
echo "results in $OUT"
