/*
 * cpu_probe: does this CPU *and* this OS let a process execute an ISA extension?
 *
 *   cpu_probe [NAME ...]      (no NAME: every probe below; "ud2" on x86-64 and "udf" on AArch64
 *                              are the controls, which always fail)
 *
 * For each NAME prints one line "NAME ok" or "NAME fail (why)" and exits 0 (2 on an unknown
 * NAME). Each probe runs in a child process, so an instruction that traps (SIGILL, or SIGSEGV
 * for a tile instruction whose state the kernel never granted) fails that probe only.
 *
 * Why execute instead of reading cpuid: cpuid says what the silicon has, not what the OS
 * enabled. AVX and AVX-512 need their register state in XCR0 (a hypervisor may leave it out);
 * AMX needs XTILECFG/XTILEDATA in XCR0 *and* a per-process permission (arch_prctl
 * ARCH_REQ_XCOMP_PERM, Linux 5.16+), and guests have been seen where the permission request
 * succeeds while the first tile instruction still traps. GCC's -march=native reads cpuid, so a
 * native build of ggml can contain instructions that die on their first use.
 *
 * Built and run by scripts/bootstrap.sh with the host compiler and no -m flags: the instructions
 * are inline assembly (binutils knows them all), so the probe itself runs on any x86-64.
 *
 * AArch64 (a native ARM build, or the cross build run under qemu-aarch64 -cpu MODEL): dotprod,
 * fp16, i8mm, bf16, sve, sve2, sme. There a probe passes when the kernel's HWCAP/HWCAP2 lists the
 * extension (what ggml's run-time checks read) *and* one of its instructions executes; "fail
 * (not in the kernel's HWCAP)" names the first condition, "fail (Illegal instruction)" the second.
 *
 * One probe tests the compiler, not the CPU: amx_cc configures a tile through the compiler's own
 * intrinsics (<immintrin.h>, as ggml's AMX kernels do, amx/mmq.cpp ggml_tile_config_init) and
 * uses it. GCC 12's _tile_loadconfig declares an 8-byte memory operand, so at -O1 and above the
 * stores of the tile sizes are dead to it and dropped: the tile is configured with palette 1 and
 * no rows (or from stack bytes never written), and ggml's first tilezero traps (seen on a Xeon
 * with AMX enabled: SIGILL in tinygemm_kernel_amx at the first prefill of a Q4_1 model).
 * bootstrap.sh builds this file at -O2, as llama.cpp is built.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__aarch64__)
#include <sys/auxv.h>

/* AArch64: what ggml's ARM kernels use (ggml-cpu/CMakeLists.txt, its feature checks and its
 * GGML_CPU_ALL_VARIANTS table). Each probe first reads the kernel's HWCAP/HWCAP2 bit, as ggml's
 * run-time variant selection does (ggml-cpu/arch/arm/cpu-feats.cpp), then executes one
 * instruction of the extension. The instructions are written as .inst words so that the probe
 * builds with any -march (the cross compiler's default is armv8-a). */
#define HW1(bit) ((getauxval(AT_HWCAP) & (1UL << (bit))) != 0)
#define HW2(bit) ((getauxval(AT_HWCAP2) & (1UL << (bit))) != 0)
static void need(int listed) {
    /* CPU_PROBE_IGNORE_HWCAP=1 executes the instruction even where HWCAP does not list it: the
     * control that the instruction itself traps (tests/cli/cli_cpu_probe.sh, under qemu) */
    const char *e = getenv("CPU_PROBE_IGNORE_HWCAP");
    if (!listed && !(e && *e == '1')) _exit(5); /* the kernel does not offer it to this process */
}
/* sdot v0.4s, v1.16b, v2.16b */
static void p_dotprod(void) {
    need(HW1(20));
    __asm__ volatile(".inst 0x4e829420" ::: "v0");
}
/* fadd v0.8h, v1.8h, v2.8h (FEAT_FP16: half-precision vector arithmetic) */
static void p_fp16(void) {
    need(HW1(10));
    __asm__ volatile(".inst 0x4e421420" ::: "v0");
}
/* smmla v0.4s, v1.16b, v2.16b */
static void p_i8mm(void) {
    need(HW2(13));
    __asm__ volatile(".inst 0x4e82a420" ::: "v0");
}
/* bfmmla v0.4s, v1.8h, v2.8h */
static void p_bf16(void) {
    need(HW2(14));
    __asm__ volatile(".inst 0x6e42ec20" ::: "v0");
}
/* add z0.b, z1.b, z2.b */
static void p_sve(void) {
    need(HW1(22));
    __asm__ volatile(".inst 0x04220020" ::: "v0");
}
/* eor3 z0.d, z0.d, z1.d, z2.d */
static void p_sve2(void) {
    need(HW2(1));
    __asm__ volatile(".inst 0x04213840" ::: "v0");
}
/* smstart; smstop (streaming mode and ZA on, then off) */
static void p_sme(void) {
    need(HW2(23));
    __asm__ volatile(".inst 0xd503477f\n\t.inst 0xd503467f" ::: "memory");
}
/* The control: udf #0 traps on every CPU (tests/cli/cli_cpu_probe.sh expects "udf fail"). */
static void p_udf(void) { __asm__ volatile(".inst 0x00000000"); }

static const struct probe {
    const char *name;
    void (*run)(void);
} probes[] = {
    { "dotprod", p_dotprod }, { "fp16", p_fp16 }, { "i8mm", p_i8mm }, { "bf16", p_bf16 },
    { "sve", p_sve },         { "sve2", p_sve2 }, { "sme", p_sme },   { "udf", p_udf },
};

#elif !defined(__x86_64__)
int main(void) {
    puts("cpu_probe: neither x86-64 nor AArch64, nothing to probe");
    return 0;
}
#else

static void p_avx(void) { __asm__ volatile("vxorps %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); }
static void p_avx2(void) { __asm__ volatile("vpaddd %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); }
static void p_fma(void) { __asm__ volatile("vfmadd231ps %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); }
static void p_f16c(void) { __asm__ volatile("vcvtph2ps %%xmm0, %%ymm0" ::: "xmm0"); }
static void p_bmi2(void) {
    unsigned r = 0;
    __asm__ volatile("pdep %0, %0, %0" : "+r"(r));
}
static void p_avxvnni(void) { __asm__ volatile("%{vex%} vpdpbusd %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); }
static void p_avx512(void) /* F, BW, DQ, VL, CD: what ggml's GGML_AVX512 compiles for */
{
    __asm__ volatile("vpaddd %%zmm0, %%zmm0, %%zmm0\n\t"         /* F  */
                     "vpaddb %%zmm0, %%zmm0, %%zmm0\n\t"         /* BW */
                     "vandps %%zmm0, %%zmm0, %%zmm0\n\t"         /* DQ */
                     "vpaddd %%ymm0, %%ymm0, %%ymm0%{%%k1%}\n\t" /* VL: EVEX ymm */
                     "vplzcntd %%zmm0, %%zmm0\n\t"               /* CD */
                     "kmovw %%k1, %%eax" ::
                         : "xmm0", "eax");
}
static void p_avx512vbmi(void) { __asm__ volatile("vpermb %%zmm0, %%zmm0, %%zmm0" ::: "xmm0"); }
static void p_avx512vnni(void) { __asm__ volatile("vpdpbusd %%zmm0, %%zmm0, %%zmm0" ::: "xmm0"); }
static void p_avx512bf16(void) { __asm__ volatile("vdpbf16ps %%zmm0, %%zmm0, %%zmm0" ::: "xmm0"); }

/* AMX: ask for the tile data permission as ggml does (ggml-cpu/amx/amx.cpp), then configure
 * three 16x64-byte tiles and run the instructions ggml's AMX kernels use. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA  18
static int amx_begin(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
    static struct __attribute__((aligned(64))) {
        uint8_t palette, start;
        uint8_t rsv[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 3; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2" ::: "memory");
    return 0;
}
static void p_amx_tile(void) {
    if (amx_begin()) _exit(3);
    __asm__ volatile("tilerelease");
}
static void p_amx_int8(void) {
    if (amx_begin()) _exit(3);
    __asm__ volatile("tdpbssd %%tmm2, %%tmm1, %%tmm0\n\ttilerelease" ::: "memory");
}
static void p_amx_bf16(void) {
    if (amx_begin()) _exit(3);
    __asm__ volatile("tdpbf16ps %%tmm2, %%tmm1, %%tmm0\n\ttilerelease" ::: "memory");
}

/* AMX through the compiler's intrinsics, the way ggml configures its tiles: a zeroed 64-byte
 * config, the fields stored one by one, _tile_loadconfig, then a tile instruction on tile 4. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 11
static void p_amx_cc(void) { _exit(4); } /* no AMX intrinsics: -march=native cannot use AMX either */
#else
#include <immintrin.h>
struct amx_cfg {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
__attribute__((target("amx-tile"), noinline)) static void amx_cc_use(void) {
    struct amx_cfg tc __attribute__((aligned(64)));
    memset(&tc, 0, sizeof tc);
    tc.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        tc.rows[i] = 16;
        tc.colsb[i] = 64;
    }
    _tile_loadconfig(&tc);
    _tile_zero(4);
    _tile_release();
}
static void p_amx_cc(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) _exit(3);
    amx_cc_use();
}
#endif

/* The control: an instruction that traps on every CPU, so a probe that cannot fail is noticed
 * (tests/cli/cli_cpu_probe.sh expects "ud2 fail"). */
static void p_ud2(void) { __asm__ volatile("ud2"); }

static const struct probe {
    const char *name;
    void (*run)(void);
} probes[] = {
    { "avx", p_avx },
    { "avx2", p_avx2 },
    { "fma", p_fma },
    { "f16c", p_f16c },
    { "bmi2", p_bmi2 },
    { "avx_vnni", p_avxvnni },
    { "avx512", p_avx512 },
    { "avx512_vbmi", p_avx512vbmi },
    { "avx512_vnni", p_avx512vnni },
    { "avx512_bf16", p_avx512bf16 },
    { "amx_tile", p_amx_tile },
    { "amx_int8", p_amx_int8 },
    { "amx_bf16", p_amx_bf16 },
    { "amx_cc", p_amx_cc },
    { "ud2", p_ud2 },
};
#endif

#if defined(__x86_64__) || defined(__aarch64__)
#define N_PROBES (sizeof probes / sizeof probes[0])

static int run_probe(const struct probe *p) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        printf("%s fail (fork: %s)\n", p->name, strerror(errno));
        return 1;
    }
    if (pid == 0) {
        struct rlimit no_core = { 0, 0 }; /* a trap is an answer, not a crash: no core file */
        setrlimit(RLIMIT_CORE, &no_core);
        alarm(5);
        p->run();
        _exit(0);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0) { /* EINTR */
    }
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) printf("%s ok\n", p->name);
    else if (WIFEXITED(st) && WEXITSTATUS(st) == 3) printf("%s fail (arch_prctl refused the tile data permission)\n", p->name);
    else if (WIFEXITED(st) && WEXITSTATUS(st) == 4) printf("%s fail (the compiler has no AMX intrinsics)\n", p->name);
    else if (WIFEXITED(st) && WEXITSTATUS(st) == 5) printf("%s fail (not in the kernel's HWCAP)\n", p->name);
#if defined(__x86_64__)
    else if (p->run == p_amx_cc && WIFSIGNALED(st) && (WTERMSIG(st) == SIGILL || WTERMSIG(st) == SIGSEGV))
        /* SIGILL: a tile without rows; SIGSEGV: ldtilecfg of stack bytes never stored (#GP);
        ** which one depends on the stack's old bytes, so the line names neither */
        printf("%s fail (a tile configured through the compiler's _tile_loadconfig traps: it drops the config's stores)\n",
               p->name);
#endif
    else if (WIFSIGNALED(st)) printf("%s fail (%s)\n", p->name, strsignal(WTERMSIG(st)));
    else printf("%s fail (exit %d)\n", p->name, WEXITSTATUS(st));
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 1) {
        for (size_t i = 0; i < N_PROBES; i++) run_probe(&probes[i]);
        return 0;
    }
    int rc = 0;
    for (int a = 1; a < argc; a++) {
        size_t i = 0;
        while (i < N_PROBES && strcmp(probes[i].name, argv[a]) != 0) i++;
        if (i == N_PROBES) {
            fprintf(stderr, "cpu_probe: unknown probe '%s'\n", argv[a]);
            rc = 2;
            continue;
        }
        run_probe(&probes[i]);
    }
    return rc;
}
#endif
