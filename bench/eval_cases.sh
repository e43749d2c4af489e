#!/usr/bin/env bash
# bench/eval_cases.sh — one cell of the evaluation (docs/EVALUATION.md) as one case per `kvtier eval`
# invocation, so every finished case has its own JSON and a run cut short loses at most the cases
# in flight; `bench/eval_tables.py --pool DIR` pools them (Wilson intervals over all cases, failed
# probes sorted by why).  NIAH cases get seeds SEED0, SEED0+1, ... with needle depths cycling
# through DEPTHS; multifact cases (5 facts, probed one after another) seeds MSEED0, MSEED0+1, ...
# LANES processes run side by side with THREADS threads each (on a loaded 2-core machine two
# single-thread lanes did more cases per hour than one two-thread process).
# Usage: bench/eval_cases.sh [MODEL]   (default $KVTIER_CHAT_MODEL after `scripts/bootstrap.sh`)
# Environment: CONTEXT=4096 BUDGET=1024 NIAH=30 MULTIFACT=6 POLICIES=no_eviction,streaming,snapkv,kvtier
#   DEPTHS="5 25 50 75 95" SEED0=101 MSEED0=201 LANES=2 THREADS=1 MAX_TOKENS=32 OUT=results/cases-<time>
set -u
cd "$(dirname "$0")/.."
eval "$(scripts/bootstrap.sh env)"
MODEL=${1:-$KVTIER_CHAT_MODEL}
CONTEXT=${CONTEXT:-4096} BUDGET=${BUDGET:-1024} NIAH=${NIAH:-30} MULTIFACT=${MULTIFACT:-6}
POLICIES=${POLICIES:-no_eviction,streaming,snapkv,kvtier}
read -r -a D <<<"${DEPTHS:-5 25 50 75 95}"
SEED0=${SEED0:-101} MSEED0=${MSEED0:-201} LANES=${LANES:-2} THREADS=${THREADS:-1} MAX_TOKENS=${MAX_TOKENS:-32}
OUT=${OUT:-results/cases-$(date -u +%Y%m%d-%H%M%S)}
BIN=./build/kvtier
[ -x "$BIN" ] || make build
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE
run() { # NAME TASK ARGS...
    local name=$1 t0=$SECONDS
    shift
    [ -f "$OUT/$name.done" ] && return 0 # an earlier run of this OUT finished it
    echo "== $name: kvtier eval $* -m $MODEL --context $CONTEXT --budget $BUDGET --cases 1 --max-tokens $MAX_TOKENS --policies $POLICIES --threads $THREADS" >>"$OUT/commands.txt"
    "$BIN" eval "$@" -m "$MODEL" --context "$CONTEXT" --budget "$BUDGET" --cases 1 --max-tokens "$MAX_TOKENS" \
        --policies "$POLICIES" --threads "$THREADS" --out "$OUT" --json >"$OUT/$name.txt" 2>"$OUT/$name.err"
    local rc=$?
    [ "$rc" -eq 0 ] && touch "$OUT/$name.done"
    echo "   $name exit $rc $((SECONDS - t0)) s $(date -u +%H:%M:%S)" >>"$OUT/commands.txt"
}
# the jobs in order (multifact interleaved, so a run cut short has some of each), dealt to lanes
jobs=()
for ((i = 0, m = 0; i < NIAH || m < MULTIFACT; i++)); do
    [ "$i" -lt "$NIAH" ] && jobs+=("niah-$((SEED0 + i)) niah --seed $((SEED0 + i)) --depths ${D[$((i % ${#D[@]}))]}")
    if [ $((i % 5)) -eq 4 ] && [ "$m" -lt "$MULTIFACT" ] || { [ "$i" -ge "$NIAH" ] && [ "$m" -lt "$MULTIFACT" ]; }; then
        jobs+=("mf-$((MSEED0 + m)) multifact --seed $((MSEED0 + m))")
        m=$((m + 1))
    fi
done
lane() {
    for ((k = $1; k < ${#jobs[@]}; k += LANES)); do
        # shellcheck disable=SC2086 # a job is a word list
        run ${jobs[$k]}
    done
}
for ((l = 0; l < LANES; l++)); do lane "$l" & done
wait
echo "results in $OUT; tables: bench/eval_tables.py --pool $OUT"
