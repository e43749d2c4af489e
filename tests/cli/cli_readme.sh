#!/usr/bin/env bash
# cli_readme — every command README.md shows is run by a test (issue #44).
#
# Every fenced code block of README.md is read: ```sh, ```bash and ```console blocks as shell
# commands (one per line, `\` continuations joined, `# comments` dropped; in a console block only
# the lines that start with "$ "), ```python blocks as whole programs.  A fence with another
# language, or none, fails: the README shows no code whose running nobody checks.
# Each shell command must be a key of one of the two tables below, compared after runs of white
# space are squeezed to one space:
#   RUN     run here, for real: `kvtier --help`, `--version`, the bootstrap's env (in a subshell),
#           `kvtier serve` on the chat model (`--port 8080` replaced by `--port 0`, `build/kvtier`
#           by $KVTIER_BIN, nothing else changed);
#   MAPPED  too long for here (`make demo`, `make test`): the ctest tests or script that run it,
#           each of which must exist, with the Makefile line that ties them to the command.
# Every Python block runs, whole, through the official openai client (the python of
# `scripts/bootstrap.sh pyclient-path`) against that server, with "127.0.0.1:8080" replaced by the
# port it listens on: it must exit 0 and print; where it prints usage.kvtier twice or more, the
# last turn must show prompt tokens reused (the README says the second turn reuses the first).
# Control: a README command in neither table fails ("neither run nor mapped"), and so does a table
# entry the README no longer shows (stale), a mapped test that does not exist, a Python block
# without 127.0.0.1:8080, and a README without a single command.
# Skips (exit 77), after the table checks, when KVTIER_CHAT_MODEL is not a file.
# Environment (from tests/CMakeLists.txt): KVTIER_BIN, KVTIER_CHAT_MODEL, KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/lib.sh"
BIN=${KVTIER_BIN:?KVTIER_BIN is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
README=$SRC/README.md
t_init cli-readme
ulimit -c 0 2>/dev/null || true
SERVER_PID=
trap '[ -n "$SERVER_PID" ] && kill -KILL "$SERVER_PID" 2>/dev/null; rm -rf "$TMP"' EXIT

# ---- the tables ------------------------------------------------------------------------------
# command as README.md shows it  ->  the function below that runs it here
declare -A RUN=(
    ['build/kvtier --help']=run_help
    ['build/kvtier --version']=run_version
    ['eval "$(scripts/bootstrap.sh env)"']=run_env
    ['build/kvtier serve -m "$KVTIER_CHAT_MODEL" --port 8080']=run_serve
)
# command as README.md shows it  ->  the ctest tests (tests/cli/NAME.sh, tests/server/NAME.sh) or
# the script that run it
declare -A MAPPED=(
    ['make demo']='cli_demo cli_demo_live'   # Gemma 3 kv_restore/discard; SmolLM2 --live kv_restore/discard
    ['make test']='tests/run_suite.sh'       # the suite itself (this test among it)
)
# ... and the Makefile line that makes the command what those tests run
declare -A WITNESS=(
    ['make demo']='kvtier demo -m "$$KVTIER_CHAT_MODEL" --live'
    ['make test']='tests/run_suite.sh $(BUILD) $(BUILD_ASAN)'
)

# ---- README.md's code blocks -----------------------------------------------------------------
# extract: one record per shell command "sh<TAB>LINE<TAB>COMMAND", per Python block
# "py<TAB>LINE<TAB>FILE" (the block written to FILE), per unknown fence "fence<TAB>LINE<TAB>LANG"
extract() {
    awk -v tmp="$TMP" '
        function squeeze(s) { gsub(/[ \t]+/, " ", s); sub(/^ /, "", s); sub(/ $/, "", s); return s }
        function emit(s, n) {
            sub(/(^|[ \t]+)#.*$/, "", s)          # a comment, or a comment-only line
            s = squeeze(s)
            if (s != "") printf "sh\t%d\t%s\n", n, s
        }
        /^[ \t]*(```|~~~)/ {
            if (!inb) {
                inb = 1; start = NR; cont = ""; skip = 0
                lang = $0; sub(/^[ \t]*(```|~~~)[ \t]*/, "", lang); sub(/[ \t{].*$/, "", lang)
                if (lang == "python") { npy++; pyfile = tmp "/readme_" npy ".py"; printf "" > pyfile }
                else if (lang != "sh" && lang != "bash" && lang != "console" && lang != "shell")
                    { printf "fence\t%d\t%s\n", NR, (lang == "" ? "(none)" : lang); skip = 1 }
            } else {
                if (cont != "") emit(cont, cstart)
                if (lang == "python") { close(pyfile); printf "py\t%d\t%s\n", start, pyfile }
                inb = 0
            }
            next
        }
        !inb || skip { next }                   # prose, or a block already failed as a whole
        lang == "python" { print > pyfile; next }
        lang == "console" && !/^[ \t]*\$ / && cont == "" { next }   # output, not a command
        {
            line = $0
            if (lang == "console" && cont == "") sub(/^[ \t]*\$ /, "", line)
            if (cont == "") cstart = NR
            if (line ~ /\\$/) { sub(/\\$/, "", line); cont = cont " " line; next }
            emit(cont " " line, cstart); cont = ""
        }
        END { if (inb) printf "fence\t%d\tunclosed\n", start }
    ' "$README"
}

[ -f "$README" ] || { bad "no $README"; t_finish; exit; }
extract >"$TMP/blocks"
n_sh=$(grep -c '^sh' "$TMP/blocks")
n_py=$(grep -c '^py' "$TMP/blocks")
[ "$n_sh" -gt 0 ] && ok "README.md: $n_sh shell commands, $n_py Python blocks" \
    || bad "README.md: no shell command found in a code block (the extraction is broken)"

declare -A SEEN=()
RUN_LIST=()
while IFS=$'\t' read -r kind line what; do
    case $kind in
    fence) bad "README.md:$line: a code block in '$what': use sh, bash, console or python (this test runs those)" ;;
    py) ;;
    sh)
        SEEN[$what]=1
        if [ -n "${RUN[$what]:-}" ]; then
            RUN_LIST+=("$what")
        elif [ -n "${MAPPED[$what]:-}" ]; then
            miss=
            for t in ${MAPPED[$what]}; do
                if [[ $t == */* ]]; then
                    [ -f "$SRC/$t" ] || miss="$miss $t"
                else
                    [ -f "$SRC/tests/cli/$t.sh" ] || [ -f "$SRC/tests/server/$t.sh" ] || miss="$miss $t"
                fi
            done
            w=${WITNESS[$what]:-}
            if [ -n "$miss" ]; then
                bad "README.md:$line: '$what' is mapped to tests that do not exist:$miss"
            elif [ -n "$w" ] && ! grep -qF -- "$w" "$SRC/Makefile"; then
                bad "README.md:$line: '$what' is mapped to ${MAPPED[$what]}, but the Makefile no longer has: $w"
            else
                ok "README.md:$line: '$what' is run by ${MAPPED[$what]}"
            fi
        else
            bad "README.md:$line: '$what' is neither run nor mapped by tests/cli/cli_readme.sh (add it to RUN or MAPPED)"
        fi
        ;;
    esac
done <"$TMP/blocks"
for c in "${!RUN[@]}" "${!MAPPED[@]}"; do
    [ -n "${SEEN[$c]:-}" ] || bad "stale table entry: README.md no longer shows '$c'"
done

MODEL=${KVTIER_CHAT_MODEL:-}
if [ ! -f "$MODEL" ]; then
    if [ "$fail" -eq 0 ]; then
        echo "SKIP: KVTIER_CHAT_MODEL ('$MODEL') is not a file: the commands were not run"
        exit 77
    fi
    bad "KVTIER_CHAT_MODEL ('$MODEL') is not a file"
    t_finish
    exit
fi

# ---- the runners -----------------------------------------------------------------------------
# no_crash FILE: no signal or sanitizer report in a captured stderr
no_crash() {
    ! grep -qE 'AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:|Segmentation fault' "$1"
}

run_help() {
    "$BIN" --help >"$TMP/help.out" 2>"$TMP/help.err"
    local rc=$?
    [ $rc -eq 0 ] && grep -q 'kvtier serve' "$TMP/help.out" && grep -q 'kvtier chat' "$TMP/help.out" && no_crash "$TMP/help.err" \
        && ok "ran '$1': exit 0, the commands listed" || bad "'$1': exit $rc: $(head -5 "$TMP/help.out" "$TMP/help.err")"
}

run_version() {
    "$BIN" --version >"$TMP/version.out" 2>"$TMP/version.err"
    local rc=$?
    [ $rc -eq 0 ] && grep -q '^kvtier .*(commit ' "$TMP/version.out" && grep -q 'llama.cpp' "$TMP/version.out" \
        && grep -q 'CPU build' "$TMP/version.out" && no_crash "$TMP/version.err" \
        && ok "ran '$1': $(grep -m1 'commit' "$TMP/version.out" | cut -c1-100)..." \
        || bad "'$1': exit $rc: $(cat "$TMP/version.out" "$TMP/version.err" | head -5)"
}

run_env() {
    # the README's line itself, in a subshell in the source tree: the variables it promises are set
    (cd "$SRC" && eval "$1" && [ -f "$KVTIER_MODEL" ] && [ -f "$KVTIER_CHAT_MODEL" ] && [ -d "$LLAMA_PREFIX" ]) \
        >"$TMP/env.out" 2>&1 \
        && ok "ran '$1': KVTIER_MODEL, KVTIER_CHAT_MODEL and LLAMA_PREFIX name what exists" \
        || bad "'$1': $(head -5 "$TMP/env.out")"
}

PORT=
run_serve() {
    local cmd=$1
    case $cmd in
    'build/kvtier '*' --port 8080'* | 'build/kvtier '*' --port 8080') ;;
    *) bad "'$cmd': expected 'build/kvtier ... --port 8080' (the Python block talks to 8080)"; return ;;
    esac
    cmd=${cmd/#build\/kvtier /\"\$BIN\" }
    cmd=${cmd/ --port 8080/ --port 0}
    # exec: the background job is the server itself, so its pid is the one to stop
    (KVTIER_CHAT_MODEL=$MODEL; eval "exec $cmd") >"$TMP/serve.out" 2>"$TMP/serve.err" </dev/null &
    SERVER_PID=$!
    PORT=$(t_listening "$TMP/serve.err" "$SERVER_PID")
    if [ -n "$PORT" ]; then
        ok "ran '$1' (as '$cmd'): listening on port $PORT"
    else
        bad "'$1' (as '$cmd') did not start: $(tail -5 "$TMP/serve.err")"
        SERVER_PID=
    fi
}

for c in "${RUN_LIST[@]}"; do
    "${RUN[$c]}" "$c"
done

# ---- the Python blocks, through the official openai client, against that server ---------------
if [ "$n_py" -gt 0 ]; then
    PY=$("$SRC/scripts/bootstrap.sh" pyclient-path)
    "$SRC/scripts/bootstrap.sh" pyclient >"$TMP/pyclient.log" 2>&1 || bad "bootstrap.sh pyclient: $(tail -3 "$TMP/pyclient.log")"
fi
while IFS=$'\t' read -r kind line file; do
    [ "$kind" = py ] || continue
    if ! grep -qF '127.0.0.1:8080' "$file"; then
        bad "README.md:$line: a Python block that does not talk to 127.0.0.1:8080 (the server the README starts)"
        continue
    fi
    if [ -z "$PORT" ]; then
        bad "README.md:$line: a Python block, but no server is running (the README's serve command did not start one)"
        continue
    fi
    sed "s/127\.0\.0\.1:8080/127.0.0.1:$PORT/g" "$file" >"$file.run"
    timeout 120 "$PY" "$file.run" >"$TMP/py.out" 2>"$TMP/py.err"
    rc=$?
    reused=$(grep -o "'prompt_tokens_reused': [0-9]*" "$TMP/py.out" | sed 's/.*: //')
    n_usage=$(printf '%s\n' "$reused" | grep -c .)
    last=$(printf '%s\n' "$reused" | tail -n 1)
    if [ $rc -ne 0 ] || [ ! -s "$TMP/py.out" ]; then
        bad "README.md:$line: the Python block exited $rc: $(tail -8 "$TMP/py.err")"
    elif [ "$n_usage" -ge 2 ] && [ "${last:-0}" -le 0 ]; then
        bad "README.md:$line: the Python block's last turn reused no prompt tokens: $(cat "$TMP/py.out")"
    else
        ok "README.md:$line: the Python block ran against the server (exit 0; $n_usage usage lines, last reused ${last:-?} tokens)"
    fi
    sed 's/^/     python: /' "$TMP/py.out" | head -n 8
done <"$TMP/blocks"

if [ -n "$SERVER_PID" ]; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID"
    src=$?
    SERVER_PID=
    [ $src -eq 0 ] && ok "the server stopped on SIGTERM (exit 0)" || bad "the server exited $src on SIGTERM"
    no_crash "$TMP/serve.err" && ok "no sanitizer report from the server" \
        || { bad "sanitizer report on the server's stderr"; grep -A20 -E 'Sanitizer|runtime error' "$TMP/serve.err" | head -40; }
fi

t_finish
