#!/usr/bin/env bash
# cli_install — the installed kvtier is usable by another program.
#
# Installs this build tree into a temporary prefix (cmake --install --prefix), checks what the
# install manifest lists, then builds one small C program against the INSTALLED copy three ways
# and runs it: `pkg-config --cflags --libs kvtier` (libkvtier.so), the same with --static
# (libkvtier.a: Libs.private and Requires.private must be complete), and find_package(kvtier)
# from a tiny CMake project (kvtier::kvtier and kvtier::kvtier_static).  The program needs no
# model: version strings, an error string, and a host-pool round trip through a spill file.
# Controls that must fail: a test hook (kvt_pool_spill_path) must not link against the shared
# library, and find_package(kvtier 99) must be refused.
# Environment (from tests/CMakeLists.txt): KVT_BINARY_DIR, KVT_SOURCE_DIR, LLAMA_PREFIX,
# KVT_CC, KVT_CMAKE, KVT_SANITIZE (ON: the program is built with the same sanitizers as the
# library, which needs their runtime first).
set -u
BUILD=${KVT_BINARY_DIR:?KVT_BINARY_DIR is not set}
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
LLAMA=${LLAMA_PREFIX:?LLAMA_PREFIX is not set}
CC=${KVT_CC:-cc}
CMAKE=${KVT_CMAKE:-cmake}
SAN=""
case "${KVT_SANITIZE:-OFF}" in ON|on|1|TRUE|true) SAN="-fsanitize=address,undefined -fno-omit-frame-pointer" ;; esac
if ! command -v pkg-config >/dev/null; then echo "skipped: pkg-config is not installed"; exit 77; fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvt-cli-install.XXXXXX")
P=$TMP/prefix
# cmake --install rewrites the build tree's install_manifest.txt: keep the one a real install left.
MANIFEST=$BUILD/install_manifest.txt
[ -f "$MANIFEST" ] && cp -p "$MANIFEST" "$TMP/manifest.saved"
cleanup() {
    if [ -f "$TMP/manifest.saved" ]; then cp -p "$TMP/manifest.saved" "$MANIFEST"; else rm -f "$MANIFEST"; fi
    rm -rf "$TMP"
}
trap cleanup EXIT
pass=0
fail=0
ok()  { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; shift; for f in "$@"; do [ -f "$f" ] && sed 's/^/     /' "$f" | tail -n 12; done; }
# check NAME COMMAND...: COMMAND's status decides; its output is shown on failure.
check() {
    local name=$1; shift
    if "$@" >"$TMP/out" 2>&1; then ok "$name"; else bad "$name" "$TMP/out"; fi
}

# --- install -------------------------------------------------------------------------------
if ! "$CMAKE" --install "$BUILD" --prefix "$P" >"$TMP/install.log" 2>&1; then
    bad "cmake --install $BUILD --prefix $P" "$TMP/install.log"
    echo "$pass passed, $fail failed"; exit 1
fi
ok "cmake --install into a temporary prefix"
sed "s|^$P/||" "$MANIFEST" | sort >"$TMP/manifest"
echo "     installed: $(tr '\n' ' ' <"$TMP/manifest")"
VERSION=$(PKG_CONFIG_PATH=$P/lib/pkgconfig:$LLAMA/lib/pkgconfig pkg-config --modversion kvtier 2>&1)
MAJMIN=${VERSION%.*}
case "$MAJMIN" in 0.*) SOV=$MAJMIN ;; *) SOV=${VERSION%%.*} ;; esac
{
    echo bin/kvtier
    echo include/kvtier.h
    echo lib/cmake/kvtier/kvtierConfig.cmake
    echo lib/cmake/kvtier/kvtierConfigVersion.cmake
    echo lib/cmake/kvtier/kvtierTargets.cmake
    sed -n 's|^\(lib/cmake/kvtier/kvtierTargets-[a-z]*\.cmake\)$|\1|p' "$TMP/manifest"  # the build type's
    echo lib/libkvtier.a
    echo lib/libkvtier.so
    echo "lib/libkvtier.so.$SOV"
    echo "lib/libkvtier.so.$VERSION"
    echo lib/pkgconfig/kvtier.pc
} | sort >"$TMP/manifest.want"
if diff -u "$TMP/manifest.want" "$TMP/manifest" >"$TMP/diff"; then
    ok "manifest: the program, both libraries, kvtier.h, kvtier.pc, the CMake package (version $VERSION)"
else
    bad "manifest differs from the expected list (version '$VERSION')" "$TMP/diff"
fi
check "installed kvtier.h is include/kvtier.h" cmp "$SRC/include/kvtier.h" "$P/include/kvtier.h"
check "SONAME is libkvtier.so.$SOV" sh -c "readelf -d '$P/lib/libkvtier.so' | grep -F '[libkvtier.so.$SOV]'"
# libkvtier.so exports exactly the functions the installed kvtier.h declares (issue #25: the
# header is the manual, src/kvtier_int.h and the kvt__ internals stay local).  A declaration
# is a line at column 0 that starts with a lower-case type and names kvt_...( (not a typedef).
grep -E '^[a-z][a-z0-9_ ]*[ *]+kvt_[a-z0-9_]+ *\(' "$P/include/kvtier.h" | grep -v '^typedef' |
    grep -oE 'kvt_[a-z0-9_]+ *\(' | tr -d ' (' | sort -u >"$TMP/declared"
nm -D --defined-only "$P/lib/libkvtier.so" | awk '$2 == "T" { print $3 }' | sort -u >"$TMP/exported"
if [ "$(wc -l <"$TMP/declared")" -ge 50 ] && diff "$TMP/declared" "$TMP/exported" >"$TMP/expdiff"; then
    ok "libkvtier.so exports the $(wc -l <"$TMP/exported") functions kvtier.h declares, nothing else"
else
    bad "exports differ from kvtier.h's declarations ($(wc -l <"$TMP/declared") declared)" "$TMP/expdiff"
fi
# the header is the manual and stays one (issue #40): at most 90 exported functions and 1,200
# lines, and no measured timings, benchmark links or issue numbers (they live in docs/)
n_decl=$(wc -l <"$TMP/declared")
[ "$n_decl" -le 90 ] && ok "kvtier.h declares $n_decl functions (<= 90)" || bad "kvtier.h declares $n_decl functions (> 90)"
n_lines=$(wc -l <"$P/include/kvtier.h")
[ "$n_lines" -le 1200 ] && ok "kvtier.h is $n_lines lines (<= 1200)" || bad "kvtier.h is $n_lines lines (> 1200)"
grep -nE 'docs/(BENCHMARKS|EVALUATION)|REPORT\.md|[Ii]ssue #?[0-9]|\(#[0-9]+\)|[0-9.]+ ?(ms|s) to (save|load)|[0-9] ?[MG]B/s' \
    "$P/include/kvtier.h" >"$TMP/hdr_noise" || true
[ ! -s "$TMP/hdr_noise" ] && ok "kvtier.h carries no timings, benchmark links or issue numbers" ||
    bad "kvtier.h carries timings, benchmark links or issue numbers" "$TMP/hdr_noise"
# the control: a function of the internal header is in libkvtier.a and not in libkvtier.so
if nm --defined-only "$P/lib/libkvtier.a" 2>/dev/null | grep -q ' T kvt_store_put$' && ! grep -qx kvt_store_put "$TMP/exported"; then
    ok "control: kvt_store_put (src/kvtier_int.h) is in libkvtier.a, not exported by libkvtier.so"
else
    bad "control: kvt_store_put is exported, or missing from libkvtier.a"
fi
nm -D --defined-only "$P/lib/libkvtier.so" | awk '$2 != "T" && $2 != "A" { print }' >"$TMP/exp_other"
[ ! -s "$TMP/exp_other" ] && ok "libkvtier.so exports no data symbols" || bad "libkvtier.so exports data" "$TMP/exp_other"
check "installed bin/kvtier runs (RPATH) and reports $VERSION" \
    sh -c "'$P/bin/kvtier' --version | grep -Fx 'kvtier $VERSION'"

# --- the program ---------------------------------------------------------------------------
mkdir -p "$TMP/app" "$TMP/run"
cat >"$TMP/app/app.c" <<'EOF'
#include <kvtier.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
    printf("version %s\n", kvt_version());
    printf("build %s\n", strstr(kvt_build_info(), "llama.cpp") ? "names llama.cpp" : kvt_build_info());
    printf("strerror %s\n", kvt_strerror(KVT_ECORRUPT));
    struct kvt_pool_params pp = kvt_pool_default_params();
    pp.budget_bytes = 64; /* the 100-byte value goes straight to a spill file */
    kvt_pool *pool = NULL;
    int rc = kvt_pool_open(&pp, &pool);
    if (rc != 0) { printf("open %d %s\n", rc, kvt_errmsg()); return 1; }
    unsigned char big[100];
    for (int i = 0; i < 100; i++) big[i] = (unsigned char)(i * 7);
    printf("put %d %d\n", kvt_pool_put(pool, 1, "hello", 6), kvt_pool_put(pool, 2, big, sizeof big));
    void *d = NULL;
    size_t n = 0;
    rc = kvt_pool_get(pool, 1, &d, &n);
    printf("get 1: %d %zu %s\n", rc, n, d ? (const char *)d : "(null)");
    free(d);
    rc = kvt_pool_get(pool, 2, &d, &n);
    printf("get 2: %d %zu %s\n", rc, n, d && n == sizeof big && memcmp(d, big, n) == 0 ? "intact" : "differs");
    free(d);
    struct kvt_pool_stats st;
    kvt_pool_get_stats(pool, &st);
    printf("spilled %lld, spill reads %lld, corrupt %lld\n", (long long)st.n_spilled,
           (long long)st.n_spill_reads, (long long)st.n_corrupt);
    rc = kvt_pool_get(pool, 3, &d, &n);
    printf("get 3: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
    kvt_pool_free(pool);
    /* the engine reaches llama.cpp: a missing model is refused with the path in the message */
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = "/nonexistent/kvtier-install-test.gguf";
    kvt_engine *eng = NULL;
    rc = kvt_engine_open(&ep, &eng);
    printf("engine: %s, %s, %s\n", kvt_strerror(rc), eng ? "engine set" : "no engine",
           strstr(kvt_errmsg(), ep.model_path) ? "message names the path" : kvt_errmsg());
    kvt_engine_free(eng);
    return 0;
}
EOF
cat >"$TMP/want" <<EOF
version $VERSION
build names llama.cpp
strerror stored data failed its checksum
put 0 0
get 1: 0 6 hello
get 2: 0 100 intact
spilled 1, spill reads 1, corrupt 0
get 3: not found: key 0000000000000003 is not in the pool
engine: model could not be loaded, no engine, message names the path
EOF
# run_app NAME EXE: the output is exactly $TMP/want, and the pool removed its private spill
# directory (made under TMPDIR) when freed.
run_app() {
    local name=$1 exe=$2
    rm -rf "$TMP/run"/*
    if ! TMPDIR=$TMP/run "$exe" >"$TMP/got" 2>"$TMP/err"; then
        bad "$name: the program failed" "$TMP/got" "$TMP/err"; return
    fi
    if ! diff -u "$TMP/want" "$TMP/got" >"$TMP/diff"; then bad "$name: output" "$TMP/diff" "$TMP/err"; return; fi
    if [ -n "$(ls -A "$TMP/run")" ]; then bad "$name: spill files left after kvt_pool_free: $(ls -A "$TMP/run")"; return; fi
    ok "$name: output as expected, no spill files left"
}

export PKG_CONFIG_PATH=$P/lib/pkgconfig:$LLAMA/lib/pkgconfig
CFLAGS_PC=$(pkg-config --cflags kvtier)
FLAGS_PC=$(pkg-config --cflags --libs kvtier)
# the source tree as a whole path component ("$SRC/" or "$SRC" at a word's end): a cache beside it
# whose name starts the same (/tmp/ci and /tmp/ci.home) is not in it
case " $CFLAGS_PC " in *"$SRC/"* | *"$SRC "*) bad "pkg-config --cflags points into the source tree: $CFLAGS_PC" ;; esac
# shellcheck disable=SC2086 # word splitting of flags is intended
check "pkg-config: build against libkvtier.so" \
    $CC -std=c11 -Wall -Wextra -Werror $SAN -o "$TMP/app/app_pc" "$TMP/app/app.c" \
    $FLAGS_PC -Wl,-rpath,"$P/lib"
if [ -x "$TMP/app/app_pc" ]; then
    run_app "pkg-config (shared)" "$TMP/app/app_pc"
    check "pkg-config (shared): runs the installed libkvtier.so" \
        sh -c "ldd '$TMP/app/app_pc' | grep -F '$P/lib/libkvtier.so.$SOV'"
fi
# The static library, with every other library as pkg-config --static lists it.  llama.cpp's
# shared libraries carry no RPATH, so the program's own must reach their dependencies too
# (libggml.so.0 needs libggml-cpu.so.0): DT_RPATH (--disable-new-dtags), not DT_RUNPATH.
LIBS_STATIC=$(pkg-config --static --libs kvtier | sed 's/-lkvtier\b/-l:libkvtier.a/')
# shellcheck disable=SC2086
check "pkg-config --static: build against libkvtier.a" \
    $CC -std=c11 -Wall -Wextra -Werror $SAN -o "$TMP/app/app_pcs" "$TMP/app/app.c" \
    $CFLAGS_PC $LIBS_STATIC -Wl,--disable-new-dtags,-rpath,"$LLAMA/lib"
if [ -x "$TMP/app/app_pcs" ]; then
    run_app "pkg-config --static" "$TMP/app/app_pcs"
    check "pkg-config --static: no libkvtier.so needed" sh -c "! ldd '$TMP/app/app_pcs' | grep -F libkvtier"
fi

# Control: a test hook is not API.  Declared by hand it links against libkvtier.a (the tests
# do that) but not against libkvtier.so, which exports only what kvtier.h declares.
cat >"$TMP/app/hook.c" <<'EOF'
#include <kvtier.h>
int kvt_pool_spill_path(kvt_pool *pool, uint64_t key, char *buf, size_t buf_size);
int main(void) { char b[8]; return kvt_pool_spill_path(NULL, 0, b, sizeof b) == KVT_EINVAL ? 0 : 1; }
EOF
# shellcheck disable=SC2086
if $CC $SAN -o "$TMP/app/hook" "$TMP/app/hook.c" $FLAGS_PC >"$TMP/out" 2>&1; then
    bad "control: kvt_pool_spill_path linked against libkvtier.so (it must stay internal)"
elif ! grep -q "undefined reference to .kvt_pool_spill_path" "$TMP/out"; then
    bad "control: the hook program failed to link for another reason" "$TMP/out"
else
    # shellcheck disable=SC2086
    check "control: a test hook links from libkvtier.a only, not from libkvtier.so" \
        $CC $SAN -o "$TMP/app/hook_s" "$TMP/app/hook.c" $CFLAGS_PC $LIBS_STATIC -Wl,--disable-new-dtags,-rpath,"$LLAMA/lib"
fi

# --- find_package --------------------------------------------------------------------------
# libkvtier.so's own DT_RPATH reaches llama.cpp's libraries; a program holding libkvtier.a needs
# a DT_RPATH of its own, as with pkg-config --static above.
mkdir -p "$TMP/cm"
cat >"$TMP/cm/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.16)
project(kvtier_user C)
find_package(kvtier \${WANT} CONFIG REQUIRED)
add_executable(app_cm $TMP/app/app.c)
target_link_libraries(app_cm PRIVATE kvtier::kvtier)
add_executable(app_cms $TMP/app/app.c)
target_link_libraries(app_cms PRIVATE kvtier::kvtier_static)
target_link_options(app_cms PRIVATE -Wl,--disable-new-dtags)
EOF
cm_configure() { # build-dir wanted-version
    "$CMAKE" -S "$TMP/cm" -B "$1" -DWANT="$2" -DCMAKE_PREFIX_PATH="$P;$LLAMA" \
        -DCMAKE_C_COMPILER="$CC" -DCMAKE_C_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN"
}
check "find_package(kvtier $MAJMIN): configure" cm_configure "$TMP/cm/b" "$MAJMIN"
check "find_package(kvtier $MAJMIN): build kvtier::kvtier and kvtier::kvtier_static" \
    "$CMAKE" --build "$TMP/cm/b"
[ -x "$TMP/cm/b/app_cm" ] && run_app "find_package kvtier::kvtier" "$TMP/cm/b/app_cm"
[ -x "$TMP/cm/b/app_cms" ] && run_app "find_package kvtier::kvtier_static" "$TMP/cm/b/app_cms"
if cm_configure "$TMP/cm/b99" 99.0 >"$TMP/out" 2>&1; then
    bad "control: find_package(kvtier 99.0) accepted version $VERSION"
elif grep -q "kvtierConfig.cmake, version: $VERSION" "$TMP/out"; then
    ok "control: find_package(kvtier 99.0) refused by the version file"
else
    bad "control: find_package(kvtier 99.0) failed for another reason" "$TMP/out"
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
