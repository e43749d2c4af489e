/*
 * cpu_probe: does this CPU *and* this OS let a process execute an ISA extension?
 *
 *   cpu_probe [NAME ...]      (no NAME: every probe below; "ud2" is the control, always fails)
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
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#if !defined(__x86_64__)
int main(void) { puts("cpu_probe: not x86-64, nothing to probe"); return 0; }
#else

static void p_avx(void)     { __asm__ volatile("vxorps %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); }
static void p_avx2(void)    { __asm__ volatile("vpaddd %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); }
static void p_fma(void)     { __asm__ volatile("vfmadd231ps %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); }
static void p_f16c(void)    { __asm__ volatile("vcvtph2ps %%xmm0, %%ymm0" ::: "xmm0"); }
static void p_bmi2(void)    { unsigned r = 0; __asm__ volatile("pdep %0, %0, %0" : "+r"(r)); }
static void p_avxvnni(void) { __asm__ volatile("%{vex%} vpdpbusd %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); }
static void p_avx512(void)  /* F, BW, DQ, VL, CD: what ggml's GGML_AVX512 compiles for */
{
    __asm__ volatile("vpaddd %%zmm0, %%zmm0, %%zmm0\n\t"        /* F  */
                     "vpaddb %%zmm0, %%zmm0, %%zmm0\n\t"        /* BW */
                     "vandps %%zmm0, %%zmm0, %%zmm0\n\t"        /* DQ */
                     "vpaddd %%ymm0, %%ymm0, %%ymm0%{%%k1%}\n\t" /* VL: EVEX ymm */
                     "vplzcntd %%zmm0, %%zmm0\n\t"              /* CD */
                     "kmovw %%k1, %%eax"
                     ::: "xmm0", "eax");
}
static void p_avx512vbmi(void) { __asm__ volatile("vpermb %%zmm0, %%zmm0, %%zmm0" ::: "xmm0"); }
static void p_avx512vnni(void) { __asm__ volatile("vpdpbusd %%zmm0, %%zmm0, %%zmm0" ::: "xmm0"); }
static void p_avx512bf16(void) { __asm__ volatile("vdpbf16ps %%zmm0, %%zmm0, %%zmm0" ::: "xmm0"); }

/* AMX: ask for the tile data permission as ggml does (ggml-cpu/amx/amx.cpp), then configure
 * three 16x64-byte tiles and run the instructions ggml's AMX kernels use. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA  18
static int amx_begin(void)
{
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
    static struct __attribute__((aligned(64))) { uint8_t palette, start; uint8_t rsv[14];
                                                 uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 3; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    __asm__ volatile("ldtilecfg %0" :: "m"(cfg));
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2" ::: "memory");
    return 0;
}
static void p_amx_tile(void) { if (amx_begin()) _exit(3); __asm__ volatile("tilerelease"); }
static void p_amx_int8(void)
{
    if (amx_begin()) _exit(3);
    __asm__ volatile("tdpbssd %%tmm2, %%tmm1, %%tmm0\n\ttilerelease" ::: "memory");
}
static void p_amx_bf16(void)
{
    if (amx_begin()) _exit(3);
    __asm__ volatile("tdpbf16ps %%tmm2, %%tmm1, %%tmm0\n\ttilerelease" ::: "memory");
}

/* The control: an instruction that traps on every CPU, so a probe that cannot fail is noticed
 * (tests/cli/cli_cpu_probe.sh expects "ud2 fail"). */
static void p_ud2(void) { __asm__ volatile("ud2"); }

static const struct probe { const char *name; void (*run)(void); } probes[] = {
    {"avx", p_avx}, {"avx2", p_avx2}, {"fma", p_fma}, {"f16c", p_f16c}, {"bmi2", p_bmi2},
    {"avx_vnni", p_avxvnni}, {"avx512", p_avx512}, {"avx512_vbmi", p_avx512vbmi},
    {"avx512_vnni", p_avx512vnni}, {"avx512_bf16", p_avx512bf16},
    {"amx_tile", p_amx_tile}, {"amx_int8", p_amx_int8}, {"amx_bf16", p_amx_bf16},
    {"ud2", p_ud2},
};
#define N_PROBES (sizeof probes / sizeof probes[0])

static int run_probe(const struct probe *p)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) { printf("%s fail (fork: %s)\n", p->name, strerror(errno)); return 1; }
    if (pid == 0) {
        alarm(5);
        p->run();
        _exit(0);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0) { /* EINTR */ }
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) printf("%s ok\n", p->name);
    else if (WIFEXITED(st) && WEXITSTATUS(st) == 3) printf("%s fail (arch_prctl refused the tile data permission)\n", p->name);
    else if (WIFSIGNALED(st)) printf("%s fail (%s)\n", p->name, strsignal(WTERMSIG(st)));
    else printf("%s fail (exit %d)\n", p->name, WEXITSTATUS(st));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 1) {
        for (size_t i = 0; i < N_PROBES; i++) run_probe(&probes[i]);
        return 0;
    }
    int rc = 0;
    for (int a = 1; a < argc; a++) {
        size_t i = 0;
        while (i < N_PROBES && strcmp(probes[i].name, argv[a]) != 0) i++;
        if (i == N_PROBES) { fprintf(stderr, "cpu_probe: unknown probe '%s'\n", argv[a]); rc = 2; continue; }
        run_probe(&probes[i]);
    }
    return rc;
}
#endif
