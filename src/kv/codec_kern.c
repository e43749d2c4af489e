/* codec_kern.c — the q8/q4 codecs' inner loops over contiguous rows (codec.h, "kernels").
**
** Written for the compiler's vectoriser (this file is built with -O3 outside Debug builds), not
** by hand: the group minimum and maximum are kept in eight independent lanes so that they map to
** packed min/max instructions without -ffast-math, and every loop has a unit stride.  Only the
** F16 <-> F32 conversions name instructions: F16C's (through <immintrin.h>, chosen at run time by
** __builtin_cpu_supports, as ggml-cpu does at build time) on x86-64 and the _Float16 type on
** AArch64; elsewhere ggml's scalar converters.  The file is built with -ffp-contract=off: a
** decoded element is lo + code * step rounded twice on every architecture, never fused, so the
** same encoded block decodes to the same bits on x86-64 and ARM64. */
#include "kv/codec.h"

#include "ggml.h"

#include <float.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#include <stdatomic.h>

__attribute__((target("avx,f16c"))) static void h2f_f16c(const uint8_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (const void *) (src + 2 * i))));
    for (; i < n; i++) {
        ggml_fp16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = ggml_fp16_to_fp32(h);
    }
}

__attribute__((target("avx,f16c"))) static void f2h_f16c(const float *src, uint8_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *) (void *) (dst + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) {
        ggml_fp16_t h = ggml_fp32_to_fp16(src[i]);
        memcpy(dst + 2 * i, &h, 2);
    }
}

/* AVX usable (the CPU and the OS's saved state: __builtin_cpu_supports) and F16C (CPUID leaf 1,
** ECX bit 29; Clang's builtin does not name it); asked once (CPUID traps to a hypervisor). */
static bool have_f16c(void) {
    static _Atomic int known = -1;
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        unsigned a, b, c = 0, d;
        v = __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v;
}
#endif

void kvt__h2f(const uint8_t *src, float *dst, size_t n) {
#if defined(__x86_64__) || defined(__i386__)
    if (have_f16c()) {
        h2f_f16c(src, dst, n);
        return;
    }
#elif defined(__aarch64__)
    _Float16 t[256];
    for (size_t i = 0; i < n; i += 256) {
        size_t k = n - i < 256 ? n - i : 256;
        memcpy(t, src + 2 * i, 2 * k);
        for (size_t j = 0; j < k; j++) dst[i + j] = (float) t[j];
    }
    return;
#endif
    for (size_t i = 0; i < n; i++) {
        ggml_fp16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = ggml_fp16_to_fp32(h);
    }
}

void kvt__f2h(const float *src, uint8_t *dst, size_t n) {
#if defined(__x86_64__) || defined(__i386__)
    if (have_f16c()) {
        f2h_f16c(src, dst, n);
        return;
    }
#elif defined(__aarch64__)
    _Float16 t[256];
    for (size_t i = 0; i < n; i += 256) {
        size_t k = n - i < 256 ? n - i : 256;
        for (size_t j = 0; j < k; j++) t[j] = (_Float16) src[i + j];
        memcpy(dst + 2 * i, t, 2 * k);
    }
    return;
#endif
    for (size_t i = 0; i < n; i++) {
        ggml_fp16_t h = ggml_fp32_to_fp16(src[i]);
        memcpy(dst + 2 * i, &h, 2);
    }
}

/* Four floats through GCC's and Clang's vector extensions: SSE on x86-64, NEON on AArch64. */
typedef float v4f __attribute__((vector_size(16)));
static inline v4f ld4(const float *p) {
    v4f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void st4(float *p, v4f v) { memcpy(p, &v, sizeof v); }
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
/* (no functions of v8f: without AVX their ABI differs between compilation units) */
#define SEL8(m, a, b) ((v8f) (((v8i) (a) & (m)) | ((v8i) (b) & ~(m))))

/* On x86-64 the loops below are compiled twice, for AVX2 and for the baseline (SSE2), and the
** loader picks one by the CPU (GCC's target_clones, an ifunc); elsewhere, and with Clang, once:
** Clang 14 (Debian's, the `make fuzz` compiler) names the ifunc "f.ifunc", so callers in other
** files find no "f" and the link fails. */
#if defined(__x86_64__) && defined(__gnu_linux__) && !defined(__clang__)
#define KVT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KVT_CLONES
#endif

/* One 4 x 4 block: rows i..i+3 of src (row length cols) to rows j..j+3 of dst (row length rows). */
static inline void tr4(const float *src, uint32_t rows, uint32_t cols, float *dst, uint32_t i, uint32_t j) {
    const float *s = src + (size_t) i * cols + j;
    v4f a = ld4(s), b = ld4(s + cols), c = ld4(s + 2 * (size_t) cols), d = ld4(s + 3 * (size_t) cols);
    v4f t0 = __builtin_shufflevector(a, b, 0, 4, 1, 5), t1 = __builtin_shufflevector(a, b, 2, 6, 3, 7);
    v4f t2 = __builtin_shufflevector(c, d, 0, 4, 1, 5), t3 = __builtin_shufflevector(c, d, 2, 6, 3, 7);
    float *o = dst + (size_t) j * rows + i;
    st4(o, __builtin_shufflevector(t0, t2, 0, 1, 4, 5));
    st4(o + rows, __builtin_shufflevector(t0, t2, 2, 3, 6, 7));
    st4(o + 2 * (size_t) rows, __builtin_shufflevector(t1, t3, 0, 1, 4, 5));
    st4(o + 3 * (size_t) rows, __builtin_shufflevector(t1, t3, 2, 3, 6, 7));
}

/* In tiles of 16 x 16 (1 KiB of source, whole cache lines of destination), 4 x 4 blocks inside. */
void kvt__transpose(const float *src, uint32_t rows, uint32_t cols, float *dst) {
    enum { T = 16 };
    const uint32_t r4 = rows & ~3u, c4 = cols & ~3u;
    for (uint32_t i0 = 0; i0 < r4; i0 += T)
        for (uint32_t j0 = 0; j0 < c4; j0 += T) {
            const uint32_t i1 = r4 - i0 < T ? r4 : i0 + T, j1 = c4 - j0 < T ? c4 : j0 + T;
            for (uint32_t i = i0; i < i1; i += 4)
                for (uint32_t j = j0; j < j1; j += 4) tr4(src, rows, cols, dst, i, j);
        }
    for (uint32_t i = 0; i < r4; i++) /* the last cols % 4 columns, the last rows % 4 rows */
        for (uint32_t j = c4; j < cols; j++) dst[(size_t) j * rows + i] = src[(size_t) i * cols + j];
    for (uint32_t i = r4; i < rows; i++)
        for (uint32_t j = 0; j < cols; j++) dst[(size_t) j * rows + i] = src[(size_t) i * cols + j];
}

/* The smallest and largest of x[0..k), k >= 1, with the scalar loop's answer for every input:
** x[0] first, then "v < lo" / "v > hi" (a NaN never replaces a number; a NaN x[0] stays). */
static inline void minmax(const float *x, uint32_t k, float *plo, float *phi) {
    float lo = x[0], hi = x[0];
    uint32_t i = 0;
    if (k >= 16) {
        v8f l = { x[0], x[0], x[0], x[0], x[0], x[0], x[0], x[0] }, h = l;
        for (; i + 8 <= k; i += 8) {
            v8f v;
            memcpy(&v, x + i, sizeof v);
            l = SEL8(v < l, v, l);
            h = SEL8(v > h, v, h);
        }
        for (int j = 0; j < 8; j++) {
            lo = l[j] < lo ? l[j] : lo;
            hi = h[j] > hi ? h[j] : hi;
        }
    }
    for (; i < k; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    *plo = lo;
    *phi = hi;
}

KVT_CLONES void kvt__quant_rows(const float *x, uint32_t R, uint32_t L, uint32_t G, int bits, uint8_t *prm, uint8_t *codes) {
    const float levels = (float) ((1 << bits) - 1);
    size_t gi = 0;
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t j0 = 0; j0 < L; j0 += G, gi++) {
            const uint32_t k = L - j0 < G ? L - j0 : G;
            const float *g = x + (size_t) r * L + j0;
            uint8_t *c = codes + (size_t) r * L + j0;
            float lo, hi;
            minmax(g, k, &lo, &hi);
            const float step = (hi - lo) / levels;
            memcpy(prm + 8 * gi, &lo, 4);
            memcpy(prm + 8 * gi + 4, &step, 4);
            const float inv = step > 0 ? 1.0f / step : 0; /* round half up: (x - lo) * inv >= 0 */
            for (uint32_t i = 0; i < k; i++) {
                float q = (g[i] - lo) * inv + 0.5f;
                q = q > 0 ? q : 0; /* a NaN gives 0, past the top gives levels (codec.h) */
                q = q < levels ? q : levels;
                c[i] = (uint8_t) (int32_t) q;
            }
        }
}

KVT_CLONES void kvt__dequant_rows(const uint8_t *codes, const uint8_t *prm, uint32_t R, uint32_t L, uint32_t G, float *x) {
    size_t gi = 0;
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t j0 = 0; j0 < L; j0 += G, gi++) {
            const uint32_t k = L - j0 < G ? L - j0 : G;
            const uint8_t *c = codes + (size_t) r * L + j0;
            float *g = x + (size_t) r * L + j0, lo, step;
            memcpy(&lo, prm + 8 * gi, 4);
            memcpy(&step, prm + 8 * gi + 4, 4);
            for (uint32_t i = 0; i < k; i++) g[i] = lo + (float) c[i] * step;
        }
}

KVT_CLONES void kvt__pack4(const uint8_t *codes, size_t n, uint8_t *packed) {
    const size_t h = n / 2;
    for (size_t i = 0; i < h; i++) packed[i] = (uint8_t) (codes[2 * i] | codes[2 * i + 1] << 4);
    if (n & 1) packed[h] = codes[n - 1];
}

KVT_CLONES void kvt__unpack4(const uint8_t *packed, size_t n, uint8_t *codes) {
    const size_t h = n / 2;
    for (size_t i = 0; i < h; i++) {
        codes[2 * i] = packed[i] & 15u;
        codes[2 * i + 1] = packed[i] >> 4;
    }
    if (n & 1) codes[n - 1] = packed[h] & 15u;
}

/* ---- ecq (codec_ecq.c): per group { f16 offset, f16 step }, one zigzag code a byte ---- */

static float h2f1(ggml_fp16_t h) { return ggml_fp16_to_fp32(h); }

/* F16 of a positive step: at least the smallest F16 subnormal, at most the largest finite. */
static ggml_fp16_t step16(float st) {
    if (!(st >= 5.9604645e-08f)) st = 5.9604645e-08f; /* 2^-24; also a NaN */
    if (st > 65504.0f) st = 65504.0f;
    ggml_fp16_t h = ggml_fp32_to_fp16(st);
    return h;
}

/* Round to nearest even for |t| <= 2^22 (default rounding mode, no contraction: this file's
** flags): the same in the vector loop and the scalar tail, and on every architecture. */
#define RNE_MAGIC 12582912.0f /* 1.5 x 2^23 */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvt__ecq_quant_rows takes each code's low byte as the first of its four"
#endif
typedef uint8_t v32u8 __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef uint32_t v8u __attribute__((vector_size(32)));

/* Mean, sum of squared deviations and count of the elements of g[0..k) within [lo, hi] (NaN and
** the infinities never are, with finite bounds), in eight lanes then a fixed tree: no branch, the
** same order of additions everywhere. */
static inline __attribute__((always_inline)) void ecq_stats(const float *g, uint32_t k, float lo, float hi, float *pmean,
                                                            float *pss, float *pn) {
    const v8i one = { 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000, 0x3f800000 };
    const v8f lov = { lo, lo, lo, lo, lo, lo, lo, lo }, hiv = { hi, hi, hi, hi, hi, hi, hi, hi };
    v8f s8 = { 0 }, n8 = { 0 }, q8 = { 0 };
    float st = 0, nt = 0, qt = 0;
    const uint32_t i8 = k / 8 * 8;
    for (uint32_t i = 0; i < i8; i += 8) {
        v8f v;
        memcpy(&v, g + i, sizeof v);
        const v8i m = (v >= lov) & (v <= hiv);
        s8 += (v8f) ((v8i) v & m);
        n8 += (v8f) (m & one);
    }
    for (uint32_t i = i8; i < k; i++) {
        const bool in = g[i] >= lo && g[i] <= hi;
        st += in ? g[i] : 0.0f;
        nt += in ? 1.0f : 0.0f;
    }
    const float n = (((n8[0] + n8[1]) + (n8[2] + n8[3])) + ((n8[4] + n8[5]) + (n8[6] + n8[7]))) + nt;
    const float mean = n > 0 ? ((((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]))) + st) / n : 0.0f;
    const v8f mv = { mean, mean, mean, mean, mean, mean, mean, mean };
    for (uint32_t i = 0; i < i8; i += 8) {
        v8f v;
        memcpy(&v, g + i, sizeof v);
        const v8i m = (v >= lov) & (v <= hiv);
        const v8f d = v - mv, dd = d * d;
        q8 += (v8f) ((v8i) dd & m);
    }
    for (uint32_t i = i8; i < k; i++) {
        const float d = g[i] - mean;
        qt += g[i] >= lo && g[i] <= hi ? d * d : 0.0f;
    }
    *pmean = mean;
    *pss = (((q8[0] + q8[1]) + (q8[2] + q8[3])) + ((q8[4] + q8[5]) + (q8[6] + q8[7]))) + qt;
    *pn = n;
}

/* Elements farther than this many standard deviations from a group's mean (over its finite
** elements) are left out of its offset and step: one outlier would otherwise set the step of the
** group (in a group of k it is at most sqrt(k - 1) deviations out) and then be coded like the
** others, coarsely; left out, it lies past 126 steps and is stored exactly. */
#define ECQ_CLIP 4.0f

KVT_CLONES uint32_t kvt__ecq_quant_rows(const float *x, uint32_t R, uint32_t L, uint32_t G, float s, uint8_t *prm, uint8_t *codes,
                                        float *esc) {
    uint32_t n_esc = 0;
    size_t gi = 0;
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t j0 = 0; j0 < L; j0 += G, gi++) {
            const uint32_t k = L - j0 < G ? L - j0 : G;
            const float *g = x + (size_t) r * L + j0;
            uint8_t *c = codes + (size_t) r * L + j0;
            float mean, ss, n;
            ecq_stats(g, k, -FLT_MAX, FLT_MAX, &mean, &ss, &n);
            const float rad = ECQ_CLIP * sqrtf(n > 0 ? ss / n : 0.0f);
            if (rad > 0 && rad < FLT_MAX) ecq_stats(g, k, mean - rad, mean + rad, &mean, &ss, &n);
            const float mc = mean > 65504.0f ? 65504.0f : mean < -65504.0f ? -65504.0f : mean;
            const ggml_fp16_t ho = ggml_fp32_to_fp16(mc);
            /* the step: s standard deviations, and enough that the mean lies within 64 steps of
            ** its F16 offset (a constant group of F32 values F16 cannot hold is coded, not escaped) */
            const float sd = s * sqrtf(n > 0 ? ss / n : 0.0f), dm = fabsf(mean - h2f1(ho)) / 64.0f;
            const ggml_fp16_t hs = step16(sd > dm ? sd : dm);
            memcpy(prm + 4 * gi, &ho, 2);
            memcpy(prm + 4 * gi + 2, &hs, 2);
            const float off = h2f1(ho), inv = 1.0f / h2f1(hs);
            const v8f offv = { off, off, off, off, off, off, off, off }, invv = { inv, inv, inv, inv, inv, inv, inv, inv };
            const v8f lim = { 126.5f, 126.5f, 126.5f, 126.5f, 126.5f, 126.5f, 126.5f, 126.5f };
            const v8f mag = { RNE_MAGIC, RNE_MAGIC, RNE_MAGIC, RNE_MAGIC, RNE_MAGIC, RNE_MAGIC, RNE_MAGIC, RNE_MAGIC };
            const v8i absm = { 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff };
            const v8i esc8 = { 255, 255, 255, 255, 255, 255, 255, 255 };
            const uint32_t i8 = k / 8 * 8;
            uint32_t any = 0;
            v8i out = { 0 };
            for (uint32_t i = 0; i < i8; i += 8) {
                v8f v;
                memcpy(&v, g + i, sizeof v);
                const v8f t = (v - offv) * invv, a = (v8f) ((v8i) t & absm);
                const v8i in = a < lim; /* false for NaN */
                const v8f tt = SEL8(in, t, (v8f){ 0 });
                const v8i q = __builtin_convertvector((tt + mag) - mag, v8i);
                const v8i zig = (v8i) ((v8u) q << 1) ^ (q >> 31);
                const v8i code = (zig & in) | (esc8 & ~in);
                const v32u8 cb = (v32u8) code; /* each code's low byte (little-endian) */
                const v8u8 b = __builtin_shufflevector(cb, cb, 0, 4, 8, 12, 16, 20, 24, 28);
                memcpy(c + i, &b, 8);
                out |= ~in;
            }
            for (int j = 0; j < 8; j++) any |= (uint32_t) out[j];
            for (uint32_t i = i8; i < k; i++) {
                const float t = (g[i] - off) * inv;
                const bool in = fabsf(t) < 126.5f;
                const int32_t q = (int32_t) rintf(in ? t : 0.0f); /* as the vector loop rounds (|t| < 2^22) */
                c[i] = in ? (uint8_t) ((uint32_t) q << 1 ^ (uint32_t) (q >> 31)) : 255u;
                any |= !in;
            }
            if (any) /* escapes are rare */
                for (uint32_t i = 0; i < k; i++)
                    if (c[i] == 255) esc[n_esc++] = g[i];
        }
    return n_esc;
}

KVT_CLONES void kvt__ecq_dequant_rows(const uint8_t *codes, const uint8_t *prm, uint32_t R, uint32_t L, uint32_t G, float *x) {
    size_t gi = 0;
    for (uint32_t r = 0; r < R; r++)
        for (uint32_t j0 = 0; j0 < L; j0 += G, gi++) {
            const uint32_t k = L - j0 < G ? L - j0 : G;
            const uint8_t *c = codes + (size_t) r * L + j0;
            float *g = x + (size_t) r * L + j0;
            ggml_fp16_t ho, hs;
            memcpy(&ho, prm + 4 * gi, 2);
            memcpy(&hs, prm + 4 * gi + 2, 2);
            const float off = h2f1(ho), step = h2f1(hs);
            for (uint32_t i = 0; i < k; i++) {
                const int32_t q = (int32_t) (c[i] >> 1) ^ -(int32_t) (c[i] & 1);
                g[i] = off + (float) q * step;
            }
        }
}
