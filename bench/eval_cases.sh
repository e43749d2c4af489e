#!/usr/bin/env bash
# bench/eval_cases.sh — one cell of the evaluation (docs/EVALUATION.md) as one case per `kvtier eval`
# invocation, so every finished case has its own JSON and a run cut short loses at most the cases
# in flight; `bench/eval_tables.py --pool DIR` pools them (Wilson intervals over all cases, failed
# probes sorted by why).  NIAH cases get seeds SEED0, SEED0+1, ... with needle depths cycling
# through DEPTHS; multifact cases (5 facts, probed one after another) seeds MSEED0, MSEED0+1, ...
# LANES processes run side by side with THREADS threads each (on a loaded 2-core machine two
# single-thread lanes did more cases per hour than one two-thread process), each taking the next
# job of one queue when its last one ends (so no lane idles while another has a backlog).
# CELLS="2048/512 8192/1024 ..." runs the same cases in every cell CONTEXT/BUDGET listed, in that
# order (the grid of docs/EVALUATION.md); job names then start with c<context>-b<budget>-.
# Usage: bench/eval_cases.sh [MODEL]   (default $KVTIER_CHAT_MODEL after `scripts/bootstrap.sh`)
# Environment: CONTEXT=4096 BUDGET=1024 CELLS=$CONTEXT/$BUDGET NIAH=30 MULTIFACT=6
#   POLICIES=no_eviction,streaming,snapkv,kvtier DEPTHS="5 25 50 75 95" SEED0=101 MSEED0=201
#   LANES=2 THREADS=1 MAX_TOKENS=32 OUT=results/cases-<time> BIN=./build/kvtier (a copy of the
#   binary lets a long run go on while build/ is rebuilt)
set -u
cd "$(dirname "$0")/.." || exit 2
eval "$(scripts/bootstrap.sh env)"
MODEL=${1:-$KVTIER_CHAT_MODEL}
CONTEXT=${CONTEXT:-4096} BUDGET=${BUDGET:-1024} NIAH=${NIAH:-30} MULTIFACT=${MULTIFACT:-6}
POLICIES=${POLICIES:-no_eviction,streaming,snapkv,kvtier}
read -r -a D <<<"${DEPTHS:-5 25 50 75 95}"
SEED0=${SEED0:-101} MSEED0=${MSEED0:-201} LANES=${LANES:-2} THREADS=${THREADS:-1} MAX_TOKENS=${MAX_TOKENS:-32}
OUT=${OUT:-results/cases-$(date -u +%Y%m%d-%H%M%S)}
CELLS=${CELLS:-$CONTEXT/$BUDGET}
BIN=${BIN:-./build/kvtier}
[ -x "$BIN" ] || make build
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE
run() { # CONTEXT BUDGET NAME TASK ARGS...
    local ctx=$1 budget=$2 name=$3 t0=$SECONDS
    shift 3
    [ -f "$OUT/$name.done" ] && return 0 # an earlier run of this OUT finished it
    echo "== $name: kvtier eval $* -m $MODEL --context $ctx --budget $budget --cases 1 --max-tokens $MAX_TOKENS --policies $POLICIES --threads $THREADS" >>"$OUT/commands.txt"
    "$BIN" eval "$@" -m "$MODEL" --context "$ctx" --budget "$budget" --cases 1 --max-tokens "$MAX_TOKENS" \
        --policies "$POLICIES" --threads "$THREADS" --out "$OUT" --json >"$OUT/$name.txt" 2>"$OUT/$name.err"
    local rc=$?
    [ "$rc" -eq 0 ] && touch "$OUT/$name.done"
    echo "   $name exit $rc $((SECONDS - t0)) s $(date -u +%H:%M:%S)" >>"$OUT/commands.txt"
}
# the jobs in order, cell by cell (multifact interleaved, so a run cut short has some of each)
read -r -a C <<<"$CELLS"
jobs=()
for cell in "${C[@]}"; do
    ctx=${cell%/*} budget=${cell#*/} pre=
    [ "${#C[@]}" -gt 1 ] && pre="c$ctx-b$budget-"
    for ((i = 0, m = 0; i < NIAH || m < MULTIFACT; i++)); do
        [ "$i" -lt "$NIAH" ] && jobs+=("$ctx $budget ${pre}niah-$((SEED0 + i)) niah --seed $((SEED0 + i)) --depths ${D[$((i % ${#D[@]}))]}")
        if [ $((i % 5)) -eq 4 ] && [ "$m" -lt "$MULTIFACT" ] || { [ "$i" -ge "$NIAH" ] && [ "$m" -lt "$MULTIFACT" ]; }; then
            jobs+=("$ctx $budget ${pre}mf-$((MSEED0 + m)) multifact --seed $((MSEED0 + m))")
            m=$((m + 1))
        fi
    done
done
# one queue: a lane takes the next job number under a lock when its last job ends
echo 0 >"$OUT/.next"
lane() {
    local k
    while :; do
        k=$(flock "$OUT/.next" sh -c 'read -r k <"$1"; echo $((k + 1)) >"$1"; echo "$k"' sh "$OUT/.next")
        [ "$k" -lt "${#jobs[@]}" ] || return 0
        # shellcheck disable=SC2086 # a job is a word list
        run ${jobs[$k]}
    done
}
for ((l = 0; l < LANES; l++)); do lane "$l" & done
wait
rm -f "$OUT/.next"
echo "results in $OUT; tables: bench/eval_tables.py --pool $OUT"
