#!/usr/bin/env bash
# cli_cpu_probe — issue #22: llama.cpp is built for what this CPU *and* this OS let a process run.
#   1. scripts/cpu_probe.c: every probe answers; the control (ud2) fails; a probe that passes names
#      an extension the kernel lists for this CPU (/proc/cpuinfo), and for the extensions whose
#      register state the kernel manages (AVX, AVX-512) the two agree both ways.
#   2. scripts/bootstrap.sh cpu: KVTIER_PROBE_FAIL compiles the named extension out (-mno-...),
#      the compiler then defines none of its macros, and the cache key changes with it (a cache
#      moved to a CPU with other features is rebuilt, not run).
#   4. Where the ARM64 cross tools are installed: the AArch64 probe under qemu-aarch64 (-cpu max
#      passes all, cortex-a53 fails all through HWCAP, the instructions trap when HWCAP is
#      ignored) and the bootstrap's ARM64 -march and cache key for each.
#   3. The libggml-cpu this suite runs on ($LLAMA_PREFIX) holds what its cpu.txt line says: no
#      AMX tile instruction unless AMX was kept, no zmm register unless AVX-512 was kept, and
#      (the check's own control) zmm registers when AVX-512 *was* kept.
set -u
. "$(dirname "$0")/lib.sh"
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
PREFIX=${LLAMA_PREFIX:?LLAMA_PREFIX is not set}
CC=${KVT_CC:-cc}
t_init cli-cpu-probe

if [ "$(uname -m)" != x86_64 ]; then
    echo "SKIP: the probes are x86-64 instructions"
    exit 77
fi

# --- 1. the probe program -------------------------------------------------------------------
if "$CC" -std=c11 -O2 -Wall -Wextra -Werror -o "$TMP/cpu_probe" "$SRC/scripts/cpu_probe.c" 2>"$TMP/cc.err"; then
    ok "cpu_probe.c builds warning-free with no -m flags"
else
    bad "cpu_probe.c does not build"; cat "$TMP/cc.err"
fi
"$TMP/cpu_probe" >"$TMP/probe.out" 2>&1
rc=$?
cat "$TMP/probe.out"
[ "$rc" -eq 0 ] && ok "cpu_probe exits 0" || bad "cpu_probe exited $rc"
n=$(grep -cE '^[a-z0-9_]+ (ok|fail \(.+\))$' "$TMP/probe.out")
[ "$n" -eq 15 ] && ok "15 probes answered, one line each" || bad "expected 15 probe lines, got $n"
grep -qx 'ud2 fail (Illegal instruction)' "$TMP/probe.out" && ok "control: ud2 traps and its probe fails" \
    || bad "control: the ud2 probe did not fail with SIGILL"
"$TMP/cpu_probe" no_such_probe >/dev/null 2>"$TMP/unknown.err"
rc=$?
[ "$rc" -eq 2 ] && grep -q "unknown probe 'no_such_probe'" "$TMP/unknown.err" && ok "an unknown probe name: exit 2 and its name" \
    || bad "unknown probe: rc $rc, '$(cat "$TMP/unknown.err")'"

# amx_cc tests the compiler (the tile config's stores kept by the optimiser), so its control is the
# same probe built at -O0, where no store is dropped: where the CPU runs tiles (amx_tile ok), that
# build must pass, or the probe could not tell a good compiler from a bad one
if [ "$(grep '^amx_tile ' "$TMP/probe.out" | cut -d' ' -f2)" = ok ]; then
    "$CC" -std=c11 -O0 -o "$TMP/cpu_probe_O0" "$SRC/scripts/cpu_probe.c" && r0=$("$TMP/cpu_probe_O0" amx_cc)
    [ "${r0:-}" = "amx_cc ok" ] && ok "control: amx_cc built at -O0 passes on this AMX CPU (-O2: $(grep '^amx_cc ' "$TMP/probe.out"))" \
        || bad "amx_cc fails even at -O0: '${r0:-}'"
fi

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
res() { grep "^$1 " "$TMP/probe.out" | cut -d' ' -f2; }
# probe -> the /proc/cpuinfo flag; "=" where the kernel clears the flag when it does not enable
# the state (XCR0), so probe and flag must agree both ways
for pair in avx:avx:= avx2:avx2:= fma:fma:= f16c:f16c:= bmi2:bmi2:= avx_vnni:avx_vnni \
            avx512:avx512f:= avx512_vbmi:avx512vbmi:= avx512_vnni:avx512_vnni:= avx512_bf16:avx512_bf16:= \
            amx_tile:amx_tile amx_int8:amx_int8 amx_bf16:amx_bf16; do
    IFS=: read -r p f both <<<"$pair"
    r=$(res "$p")
    if [ "$r" = ok ] && ! has "$f"; then bad "probe $p passed but /proc/cpuinfo has no '$f'"; continue; fi
    if [ -n "$both" ] && [ "$r" != ok ] && has "$f"; then bad "probe $p failed but the kernel lists '$f'"; continue; fi
    ok "probe $p ($r) agrees with /proc/cpuinfo ('$f' $(has "$f" && echo listed || echo absent))"
done

# --- 2. the bootstrap's compile-out and its cache key ---------------------------------------
export KVTIER_CACHE="$TMP/cache"   # the probe binary only: `cpu` builds nothing else
boot() { KVTIER_PROBE_FAIL=$1 bash "$SRC/scripts/bootstrap.sh" cpu 2>&1; }
base=$(boot "")
echo "$base"
key0=$(sed -n 's/^CPU_KEY=//p' <<<"$base")
grep -q '^cpu: probed the extensions -march=native' <<<"$base" && ok "the bootstrap's one line names what it probed" \
    || bad "no 'cpu: probed ...' line"
grep -q '; kept: ' <<<"$base" && ok "... and what it kept" || bad "the cpu line does not say what was kept"
for forced in avx512:__AVX512F__:-mno-avx512f amx:__AMX_TILE__:-mno-amx-tile; do
    IFS=: read -r name macro flag <<<"$forced"
    out=$(boot "$name")
    key=$(sed -n 's/^CPU_KEY=//p' <<<"$out")
    cflags=$(sed -n 's/^LLAMA_CFLAGS=//p' <<<"$out")
    [[ " $cflags " == *" $flag "* ]] && ok "KVTIER_PROBE_FAIL=$name adds $flag" || bad "KVTIER_PROBE_FAIL=$name: flags '$cflags' lack $flag"
    if [[ " $(sed -n 's/^LLAMA_CFLAGS=//p' <<<"$base") " == *" $flag "* ]]; then
        # already compiled out on this machine (a failed probe): the same build, the same key
        [ "$key" = "$key0" ] && ok "KVTIER_PROBE_FAIL=$name: $name is compiled out here anyway, the same key" \
            || bad "KVTIER_PROBE_FAIL=$name changed the key ($key vs $key0) though $flag was there already"
    else
        [ -n "$key" ] && [ "$key" != "$key0" ] && ok "KVTIER_PROBE_FAIL=$name: another cache key ($key vs $key0)" \
            || bad "KVTIER_PROBE_FAIL=$name left the cache key at '$key'"
    fi
    # shellcheck disable=SC2086
    if "$CC" -march=native $cflags -dM -E - </dev/null | grep -q "^#define $macro "; then
        bad "-march=native $cflags still defines $macro"
    else
        ok "-march=native $cflags defines no $macro"
    fi
    if grep -qE "^#define __AVX512F__ " < <("$CC" -march=native -dM -E - </dev/null) && [ "$name" = avx512 ]; then
        grep -q "compiled out: .*avx512(KVTIER_PROBE_FAIL)" <<<"$out" && ok "the line says avx512 was compiled out on purpose" \
            || bad "the line does not say avx512 was compiled out: $(head -1 <<<"$out")"
    fi
done
[ "$(boot "")" = "$base" ] && ok "the same CPU gives the same line and key again" || bad "the cpu step is not deterministic"

# --- 3. the library the suite runs on -------------------------------------------------------
LIB=$(ls "$PREFIX"/lib/libggml-cpu.so "$PREFIX"/lib/ggml-backends/libggml-cpu-*.so 2>/dev/null | head -1)
LINE=$(cat "$PREFIX/cpu.txt" 2>/dev/null)
echo "llama.cpp prefix: $PREFIX"
echo "its line: $LINE"
if [ -z "$LIB" ] || [ -z "$LINE" ]; then
    bad "no libggml-cpu or cpu.txt under $PREFIX (scripts/bootstrap.sh llama writes both)"
elif [[ "$LINE" == "cpu: portable"* ]]; then
    ls "$PREFIX"/lib/ggml-backends/ | grep -q sapphirerapids && bad "the portable build kept its AMX variant" \
        || ok "the portable build has no AMX variant"
else
    objdump -d --no-show-raw-insn "$LIB" >"$TMP/ggml-cpu.s" || bad "objdump $LIB failed"
    kept=$(sed -n 's/.*kept: \([^;]*\);.*/\1/p' <<<"$LINE")
    tiles=$(grep -cE '\s(tilezero|ldtilecfg|tileloadd|tdpb[a-z0-9]*)\s' "$TMP/ggml-cpu.s")
    zmm=$(grep -c '%zmm' "$TMP/ggml-cpu.s")
    echo "libggml-cpu: $tiles AMX tile instructions, $zmm instructions on zmm registers"
    if [[ " $kept " == *" amx_tile "* ]]; then
        [ "$tiles" -gt 0 ] && ok "AMX kept: libggml-cpu has its tile kernels" || bad "AMX kept but no tile instruction in $LIB"
    else
        [ "$tiles" -eq 0 ] && ok "AMX not kept: no AMX tile instruction in libggml-cpu" || bad "AMX not kept but $LIB has $tiles tile instructions"
    fi
    if [[ " $kept " == *" avx512 "* ]]; then
        [ "$zmm" -gt 0 ] && ok "AVX-512 kept: libggml-cpu uses zmm registers (the check can see them)" \
            || bad "AVX-512 kept but no zmm register in $LIB"
    else
        [ "$zmm" -eq 0 ] && ok "AVX-512 not kept: no zmm register in libggml-cpu" || bad "AVX-512 not kept but $LIB has $zmm zmm instructions"
    fi
fi

# --- 4. the AArch64 probe, under qemu-aarch64 (where `KVTIER_ARCH=arm64 scripts/bootstrap.sh deps`
#        installed the cross compiler and qemu-user; docs/PLATFORMS.md) --------------------------
if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64-static >/dev/null &&
    [ -e /lib/ld-linux-aarch64.so.1 ]; then
    if aarch64-linux-gnu-gcc -std=c11 -O2 -Wall -Wextra -Werror -o "$TMP/probe_a64" "$SRC/scripts/cpu_probe.c" 2>"$TMP/cc64.err"; then
        ok "cpu_probe.c cross-builds for aarch64 warning-free"
        qa() { qemu-aarch64-static -cpu "$1" "$TMP/probe_a64" 2>/dev/null; }
        hi=$(qa max); lo=$(qa cortex-a53); n1=$(qa neoverse-n1)
        echo "max: $(tr '\n' ' ' <<<"$hi")"; echo "cortex-a53: $(tr '\n' ' ' <<<"$lo")"
        [ "$(grep -c ' ok$' <<<"$hi")" -eq 7 ] && grep -qx 'udf fail (Illegal instruction)' <<<"$hi" \
            && ok "-cpu max: the 7 extensions pass, the control udf traps" || bad "-cpu max: $hi"
        [ "$(grep -c "fail (not in the kernel's HWCAP)" <<<"$lo")" -eq 7 ] \
            && ok "-cpu cortex-a53 (ARMv8.0): all 7 fail, not in HWCAP" || bad "-cpu cortex-a53: $lo"
        grep -qx 'dotprod ok' <<<"$n1" && grep -qx "i8mm fail (not in the kernel's HWCAP)" <<<"$n1" \
            && ok "-cpu neoverse-n1 (ARMv8.2): dotprod passes, i8mm fails" || bad "-cpu neoverse-n1: $n1"
        # the instructions themselves, HWCAP ignored: they trap on the CPU that lacks them
        ig=$(CPU_PROBE_IGNORE_HWCAP=1 qemu-aarch64-static -cpu cortex-a53 "$TMP/probe_a64" dotprod i8mm 2>/dev/null)
        [ "$(grep -c 'fail (Illegal instruction)' <<<"$ig")" -eq 2 ] \
            && ok "control: dotprod and i8mm executed on cortex-a53 trap (SIGILL)" || bad "HWCAP ignored on cortex-a53: $ig"
        # the bootstrap's ARM64 line and key: what fails is compiled out, -march follows ggml's table
        a64() { KVTIER_ARCH=arm64 KVTIER_ARM64_CPU=$1 KVTIER_PROBE_FAIL=${2:-} bash "$SRC/scripts/bootstrap.sh" cpu 2>&1; }
        o_hi=$(a64 max); o_lo=$(a64 cortex-a53); o_f=$(a64 max i8mm)
        echo "$(head -1 <<<"$o_hi")"; echo "$(head -1 <<<"$o_lo")"
        grep -qx 'LLAMA_CFLAGS=-march=armv8.6-a+dotprod+fp16+i8mm' <<<"$o_hi" && ok "-cpu max: -march=armv8.6-a+dotprod+fp16+i8mm" \
            || bad "-cpu max: $(grep LLAMA_CFLAGS <<<"$o_hi")"
        grep -qx 'LLAMA_CFLAGS=-march=armv8-a' <<<"$o_lo" && grep -q 'compiled out: dotprod(' <<<"$o_lo" \
            && ok "-cpu cortex-a53: everything compiled out, -march=armv8-a" || bad "-cpu cortex-a53: $o_lo"
        grep -qx 'LLAMA_CFLAGS=-march=armv8.2-a+dotprod+fp16' <<<"$o_f" && grep -q 'i8mm(KVTIER_PROBE_FAIL)' <<<"$o_f" \
            && ok "KVTIER_PROBE_FAIL=i8mm: -march=armv8.2-a+dotprod+fp16" || bad "KVTIER_PROBE_FAIL=i8mm: $o_f"
        k_hi=$(sed -n 's/^CPU_KEY=//p' <<<"$o_hi"); k_lo=$(sed -n 's/^CPU_KEY=//p' <<<"$o_lo")
        [ -n "$k_hi" ] && [ "$k_hi" != "$k_lo" ] && [ "$k_hi" != "$key0" ] && ok "each ARM64 target its own cache key ($k_hi, $k_lo)" \
            || bad "ARM64 keys: '$k_hi' '$k_lo' (x86: $key0)"
    else
        bad "cpu_probe.c does not cross-build for aarch64"; cat "$TMP/cc64.err"
    fi
else
    echo "(no aarch64 cross compiler or qemu-user here: the AArch64 probe is checked by make test-arm64)"
fi

t_finish
