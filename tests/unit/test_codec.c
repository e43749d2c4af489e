/* test_codec — block codecs (kvtier.h section 9).
**
**   names      the spec parser's values and its errors (each names the spec);
**   synthetic  blobs built here in llama.cpp's state format (F16/F32, V transposed or not, one or
**              two parts): raw is bit-exact; q8/q4 keep every element within the documented
**              bound of its KIVI group (keys per channel, values per token), and a control checks
**              q4 against q8's bound and must see violations; a q8_0 cache is KVT_EUNSUPPORTED;
**   elastic    a tensor built with two heads of different scale: the zeroed elements are exactly
**              those under a host reference tau_h = max(sigma_h/2, mu_h) * s, kept ones and sink
**              cells are bit-exact; controls (one threshold for both heads, a wrong s) disagree;
**   faults     an allocation failing at each point of encode and of decode: KVT_ENOMEM, nothing
**              returned or leaked; threads encoding one blob at once get the same bytes;
**   damage     a flipped byte, every truncation, an extra byte, foreign magic, another version,
**              an unknown codec id give KVT_EFORMAT / KVT_ECORRUPT with a message; random
**              mutations with a re-computed checksum never crash (run under ASan); the same
**              bytes as the SHA-256 versions (1, 2) decode to the same block, a checksum of the
**              other kind is refused;
**   kernels    the q8/q4 kernels (codec_kern.c: contiguous groups, F16C/NEON conversions, one
**              transpose) give the same section bytes and the same decoded tensor as the generic
**              per-group coder, over shapes that end groups early (odd cells and channels, group 1
**              and larger than the row), F16 and F32, V transposed or not, raw cells, a
**              misaligned tensor and NaN / Inf / -0 / subnormal elements; the F16 converters
**              agree with ggml's on all 65,536 F16 values and on 10^6 F32 values and the edges;
**   engine     real blocks of the tiny llama and tiny Gemma 3 (iSWA, V transposed) models and of
**              Gemma 3 270M: raw round trip bit-exact, decoded blocks load with kvt_block_load
**              and next-token logits stay close (KL) to the raw blocks'; a control that prunes
**              nearly everything must be far. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */
#include "fault.h"
#include "kv/codec.h"
#include "test_hooks.h"

#include <pthread.h>

#include <math.h>
#include <openssl/evp.h>
#include <zstd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- synthetic blobs (src/kv/blob.h describes the format) ---- */

enum { T_F32 = 0, T_F16 = 1, T_Q8_0 = 8 }; /* ggml_type values */

struct syn {
    int n_parts, n_layer, n_cells, p0, type, v_trans;
    int n_embd_k, n_embd_v;
    unsigned seed;
};

static unsigned lcg(unsigned *s) { return *s = *s * 1103515245u + 12345u; }
static float rnd(unsigned *s) { return ((lcg(s) >> 8) & 0xffff) / 65536.0f * 2 - 1; }

static uint16_t f2h(float f) { /* round to nearest even F16 through the library's own matrix store */
    uint16_t h;
    struct kvt__mat m = { (uint8_t *) &h, 1, 1, 2, false };
    kvt__mat_set(&m, 0, 0, f);
    return h;
}

struct wbuf {
    uint8_t *p;
    size_t n, cap;
};
static void w(struct wbuf *b, const void *src, size_t k) {
    if (b->n + k > b->cap) {
        b->cap = (b->n + k) * 2;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, src, k);
    b->n += k;
}
static void w32(struct wbuf *b, uint32_t v) { w(b, &v, 4); }
static void w64(struct wbuf *b, uint64_t v) { w(b, &v, 8); }

/* Element value of (part, layer, K/V, cell, channel): channels of the second half are 8x
** larger (an outlier head), channel 3 of K carries a large offset (a KIVI outlier channel). */
static float val(unsigned *s, int kind, int e, int n_embd) {
    float x = rnd(s) * (e >= n_embd / 2 ? 8.0f : 1.0f);
    if (kind == 0 && e == 3) x += 20;
    return x;
}

static void w_elem(struct wbuf *b, int type, float x) {
    if (type == T_F32) w(b, &x, 4);
    else {
        uint16_t h = f2h(x);
        w(b, &h, 2);
    }
}

static kvt_blob *syn_blob(const struct syn *S) {
    struct wbuf b = { 0 };
    unsigned s = S->seed;
    w32(&b, 0xaf143cd8u);
    w32(&b, 0);
    for (int p = 0; p < S->n_parts; p++) {
        int nc = p == 0 ? S->n_cells : S->n_cells / 2; /* the SWA part keeps the later half */
        int c0 = S->n_cells - nc;
        w32(&b, 1);
        w32(&b, (uint32_t) nc);
        for (int c = 0; c < nc; c++) {
            w32(&b, (uint32_t) (S->p0 + c0 + c));
            w32(&b, 1);
            w32(&b, 0);
        }
        w32(&b, (uint32_t) S->v_trans);
        w32(&b, (uint32_t) S->n_layer);
        size_t es = S->type == T_F32 ? 4 : 2;
        for (int l = 0; l < S->n_layer; l++) {
            w32(&b, (uint32_t) S->type);
            if (S->type == T_Q8_0) {
                w64(&b, (uint64_t) S->n_embd_k / 32 * 34);
                for (int i = 0; i < nc * S->n_embd_k / 32 * 34; i++) {
                    uint8_t z = (uint8_t) lcg(&s);
                    w(&b, &z, 1);
                }
                continue;
            }
            w64(&b, S->n_embd_k * es);
            for (int c = 0; c < nc; c++)
                for (int e = 0; e < S->n_embd_k; e++) w_elem(&b, S->type, val(&s, 0, e, S->n_embd_k));
        }
        for (int l = 0; l < S->n_layer; l++) {
            w32(&b, (uint32_t) S->type);
            if (S->type == T_Q8_0) { /* rows of whole q8_0 blocks (34 bytes per 32 elements), as llama.cpp writes them */
                w64(&b, (uint64_t) S->n_embd_v / 32 * 34);
                for (int i = 0; i < nc * S->n_embd_v / 32 * 34; i++) {
                    uint8_t z = (uint8_t) lcg(&s);
                    w(&b, &z, 1);
                }
                continue;
            }
            if (!S->v_trans) {
                w64(&b, S->n_embd_v * es);
                for (int c = 0; c < nc; c++)
                    for (int e = 0; e < S->n_embd_v; e++) w_elem(&b, S->type, val(&s, 1, e, S->n_embd_v));
            } else {
                w32(&b, (uint32_t) es);
                w32(&b, (uint32_t) S->n_embd_v);
                for (int e = 0; e < S->n_embd_v; e++)
                    for (int c = 0; c < nc; c++) w_elem(&b, S->type, val(&s, 1, e, S->n_embd_v));
            }
        }
    }
    kvt_blob *bl = calloc(1, sizeof *bl);
    assert_non_null(bl);
    bl->data = b.p;
    bl->size = b.n;
    bl->p0 = S->p0;
    bl->n_tokens = S->n_cells;
    bl->n_cells = S->n_cells;
    bl->n_cells_swa = S->n_parts > 1 ? S->n_cells / 2 : 0;
    return bl;
}

/* Every K/V tensor of a synthetic blob as a matrix view, found by walking the same format. */
static int syn_mats(const struct syn *S, uint8_t *data, struct kvt__mat *m, int *kind) {
    size_t off = 8;
    int k = 0;
    uint32_t es = S->type == T_F32 ? 4 : 2;
    for (int p = 0; p < S->n_parts; p++) {
        uint32_t nc = (uint32_t) (p == 0 ? S->n_cells : S->n_cells / 2);
        off += 8 + (size_t) nc * 12 + 8;
        for (int l = 0; l < S->n_layer; l++) {
            off += 12;
            m[k] = (struct kvt__mat){ data + off, nc, (uint32_t) S->n_embd_k, es, false };
            kind[k++] = KVT__SEC_K;
            off += (size_t) nc * S->n_embd_k * es;
        }
        for (int l = 0; l < S->n_layer; l++) {
            off += S->v_trans ? 12 : 12;
            m[k] = (struct kvt__mat){ data + off, nc, (uint32_t) S->n_embd_v, es, S->v_trans != 0 };
            kind[k++] = KVT__SEC_V;
            off += (size_t) nc * S->n_embd_v * es;
        }
    }
    return k;
}

static double half_ulp_f16(double v) {
    v = fabs(v);
    if (v < 6.103515625e-05) return 0.5 * 5.960464477539063e-08;
    return ldexp(1.0, (int) floor(log2(v)) - 11);
}

/* Elements of decoded tensor d outside bits-bit KIVI bound of their group in original o. */
static long bound_violations(const struct kvt__mat *o, const struct kvt__mat *d, int kind, int bits, int G, double *worst_ratio) {
    long bad = 0;
    uint32_t N = o->n_cells, E = o->n_embd;
    uint32_t outer = kind == KVT__SEC_K ? E : N, inner = kind == KVT__SEC_K ? N : E;
    for (uint32_t a = 0; a < outer; a++)
        for (uint32_t g0 = 0; g0 < inner; g0 += (uint32_t) G) {
            double lo = INFINITY, hi = -INFINITY;
            uint32_t g1 = g0 + (uint32_t) G < inner ? g0 + (uint32_t) G : inner;
            for (uint32_t i = g0; i < g1; i++) {
                double x = kind == KVT__SEC_K ? kvt__mat_get(o, i, a) : kvt__mat_get(o, a, i);
                lo = fmin(lo, x);
                hi = fmax(hi, x);
            }
            double half_step = (hi - lo) / ((1 << bits) - 1) / 2;
            for (uint32_t i = g0; i < g1; i++) {
                uint32_t c = kind == KVT__SEC_K ? i : a, e = kind == KVT__SEC_K ? a : i;
                double x = kvt__mat_get(o, c, e), y = kvt__mat_get(d, c, e);
                double bound = half_step * (1 + 1e-5) + 1e-6 * fmax(fabs(lo), fabs(hi)) + (o->elsize == 2 ? half_ulp_f16(y) : 0);
                if (fabs(x - y) > bound) bad++;
                if (half_step > 0 && worst_ratio) *worst_ratio = fmax(*worst_ratio, fabs(x - y) / half_step);
            }
        }
    return bad;
}

static kvt_blob *round_trip(const kvt_blob *b, const struct kvt_codec_params *p, struct kvt_codec_stats *st) {
    uint8_t *enc = NULL;
    size_t n = 0;
    int rc = kvt_codec_encode(b, p, &enc, &n, st);
    if (rc) fprintf(stderr, "encode %s: %s\n", kvt_codec_name(p->codec), kvt_errmsg());
    assert_int_equal(rc, 0);
    kvt_blob *d = NULL;
    rc = kvt_codec_decode(enc, n, &d);
    if (rc) fprintf(stderr, "decode %s: %s\n", kvt_codec_name(p->codec), kvt_errmsg());
    assert_int_equal(rc, 0);
    free(enc);
    assert_int_equal(d->size, b->size);
    assert_int_equal(d->p0, b->p0);
    assert_int_equal(d->n_tokens, b->n_tokens);
    assert_int_equal(d->n_cells, b->n_cells);
    assert_int_equal(d->n_cells_swa, b->n_cells_swa);
    return d;
}

static void test_names(void **st) {
    (void) st;
    struct kvt_codec_params p;
    const char *names[] = { "raw", "q8", "q4", "elastic", "elastic+q8", "elastic+q4", "ecq" };
    for (int i = 0; i < KVT_CODEC__COUNT; i++) {
        assert_int_equal(kvt_codec_parse(names[i], &p), 0);
        assert_int_equal(p.codec, i);
        assert_string_equal(kvt_codec_name(i), names[i]);
    }
    assert_int_equal(kvt_codec_parse("elastic:0.3,0.6", &p), 0);
    assert_true(fabsf(p.s_k - 0.3f) < 1e-6f && fabsf(p.s_v - 0.6f) < 1e-6f && p.n_sink == 64);
    assert_int_equal(kvt_codec_parse("elastic+q8:0.45,0.5,0", &p), 0);
    assert_int_equal(p.n_sink, 0);
    assert_int_equal(kvt_codec_parse("elastic+q4:0.3,0.4", &p), 0);
    assert_true(p.codec == KVT_CODEC_ELASTIC_Q4 && fabsf(p.s_k - 0.3f) < 1e-6f && p.n_sink == 64 && p.group_k == 64);
    assert_int_equal(kvt_codec_parse("ecq", &p), 0);
    assert_true(p.codec == KVT_CODEC_ECQ && fabsf(p.s_k - KVT__ECQ_STEP) < 1e-6f && fabsf(p.s_v - KVT__ECQ_STEP) < 1e-6f &&
                p.n_sink == 0);
    assert_int_equal(kvt_codec_parse("ecq:0.2,0.4,8", &p), 0);
    assert_true(fabsf(p.s_k - 0.2f) < 1e-6f && fabsf(p.s_v - 0.4f) < 1e-6f && p.n_sink == 8);
    assert_int_equal(kvt_codec_parse("q4:32,128", &p), 0);
    assert_true(p.group_k == 32 && p.group_v == 128 && p.n_sink == 0);
    struct kvt_codec_params d = kvt_codec_default_params(KVT_CODEC_ELASTIC);
    assert_true(fabsf(d.s_k - 0.45f) < 1e-6f && fabsf(d.s_v - 0.50f) < 1e-6f && d.n_sink == 64);
    const char *bad[] = { "zstd",
                          "q8:",
                          "q8:0",
                          "q8:abc",
                          "q4:1,2,3,4",
                          "q4:1,2,-1",
                          "raw:1",
                          "elastic:0",
                          "elastic:-1",
                          "elastic:0.4,0.5,-3",
                          "elastic:x",
                          "Q8",
                          "elastic+q8:1,2,3,4",
                          "elastic+q4:0",
                          "elastic+q2",
                          "ecq:0",
                          "ecq:0.3,11",
                          "ecq:0.3,0.3,1,2",
                          "",
                          "q8,q4" };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(kvt_codec_parse(bad[i], &p), KVT_EINVAL);
        if (!strstr(kvt_errmsg(), bad[i]) || !*bad[i]) /* every message names the spec */
            assert_true(!*bad[i] && strstr(kvt_errmsg(), "''"));
    }
    assert_int_equal(kvt_codec_parse(NULL, &p), KVT_EINVAL);
    assert_string_equal(kvt_codec_name(99), "unknown");
}

static const struct syn SYN[] = {
    /* parts layers cells p0 type  v_trans nk nv  seed */
    { 1, 2, 64, 64, T_F16, 1, 128, 128, 1 },
    { 1, 2, 70, 128, T_F32, 0, 64, 96, 2 },
    { 2, 3, 64, 192, T_F16, 0, 128, 64, 3 },
    { 2, 2, 48, 0, T_F16, 1, 64, 64, 4 }, /* sinks: positions 0..47 */
};

static void test_synthetic(void **st) {
    (void) st;
    for (size_t k = 0; k < sizeof SYN / sizeof *SYN; k++) {
        const struct syn *S = &SYN[k];
        kvt_blob *b = syn_blob(S);
        struct kvt_codec_params p = kvt_codec_default_params(KVT_CODEC_RAW);
        kvt_blob *d = round_trip(b, &p, NULL);
        assert_memory_equal(d->data, b->data, b->size);
        kvt_blob_free(d);
        struct kvt__mat mo[16], md[16];
        int kind[16];
        int nm = syn_mats(S, b->data, mo, kind);
        for (int q = 0; q < 2; q++) {
            int bits = q ? 4 : 8;
            p = kvt_codec_default_params(q ? KVT_CODEC_Q4 : KVT_CODEC_Q8);
            p.group_k = 32; /* two groups per channel and a short last one for 70 cells */
            struct kvt_codec_stats cs;
            d = round_trip(b, &p, &cs);
            syn_mats(S, d->data, md, kind);
            double worst = 0;
            long bad = 0, ctrl = 0;
            for (int i = 0; i < nm; i++) {
                int G = kind[i] == KVT__SEC_K ? p.group_k : p.group_v;
                bad += bound_violations(&mo[i], &md[i], kind[i], bits, G, &worst);
                if (bits == 4) ctrl += bound_violations(&mo[i], &md[i], kind[i], 8, G, NULL);
            }
            printf("syn %zu %s: %zu -> %zu bytes (%.3fx), worst |err| / half-step %.3f\n", k, kvt_codec_name(p.codec), cs.raw_bytes,
                   cs.encoded_bytes, (double) cs.encoded_bytes / cs.raw_bytes, worst);
            assert_int_equal(bad, 0);
            assert_true(worst > 0.5);             /* the bound is nearly reached: it is not loose */
            if (bits == 4) assert_true(ctrl > 0); /* control: q8's bound must be violated by q4 */
            assert_int_equal(cs.n_lossy, cs.n_elems);
            kvt_blob_free(d);
        }
        kvt_blob_free(b);
    }
    /* a quantised cache: lossy codecs refuse, raw keeps it */
    struct syn q = { 1, 2, 64, 0, T_Q8_0, 0, 64, 64, 9 };
    kvt_blob *b = syn_blob(&q);
    uint8_t *enc = (uint8_t *) 1;
    size_t n = 1;
    for (int c = 1; c < KVT_CODEC__COUNT; c++) {
        struct kvt_codec_params p = kvt_codec_default_params(c);
        assert_int_equal(kvt_codec_encode(b, &p, &enc, &n, NULL), KVT_EUNSUPPORTED);
        assert_null(enc);
        assert_non_null(strstr(kvt_errmsg(), "q8_0"));
    }
    struct kvt_codec_params p = kvt_codec_default_params(KVT_CODEC_RAW);
    kvt_blob *d = round_trip(b, &p, NULL);
    assert_memory_equal(d->data, b->data, b->size);
    kvt_blob_free(d);
    /* heads that do not divide a row */
    p = kvt_codec_default_params(KVT_CODEC_ELASTIC);
    p.n_head_kv = 3;
    kvt_blob_free(b);
    b = syn_blob(&SYN[0]);
    assert_int_equal(kvt_codec_encode(b, &p, &enc, &n, NULL), KVT_EUNSUPPORTED);
    p.n_head_kv = 2;
    p.s_k = -1;
    assert_int_equal(kvt_codec_encode(b, &p, &enc, &n, NULL), KVT_EINVAL);
    kvt_blob_free(b);
}

/* Host reference of ElasticKV's thresholds, written apart from the library's. */
static void ref_tau(const struct kvt__mat *m, int n_head, double s, double *tau) {
    uint32_t hd = m->n_embd / (uint32_t) n_head;
    for (int h = 0; h < n_head; h++) {
        double n = 0, mu = 0, m2 = 0; /* Welford over |x| */
        for (uint32_t c = 0; c < m->n_cells; c++)
            for (uint32_t e = h * hd; e < (h + 1) * hd; e++) {
                double a = fabs(kvt__mat_get(m, c, e)), d0 = a - mu;
                n += 1;
                mu += d0 / n;
                m2 += d0 * (a - mu);
            }
        double sigma = sqrt(m2 / n);
        tau[h] = (sigma / 2 > mu ? sigma / 2 : mu) * s;
    }
}

/* Elements whose decoded value disagrees with pruning at tau (zero under it, bit-exact above);
** elements within 1e-5 relative of tau are skipped (F32 vs double sums). */
static long elastic_mismatch(const struct kvt__mat *o, const struct kvt__mat *d, const double *tau, int n_head, int32_t n_sink,
                             int32_t p0, long *n_zero) {
    long bad = 0;
    uint32_t hd = o->n_embd / (uint32_t) n_head;
    for (uint32_t c = 0; c < o->n_cells; c++)
        for (uint32_t e = 0; e < o->n_embd; e++) {
            double x = kvt__mat_get(o, c, e), y = kvt__mat_get(d, c, e), t = tau[e / hd];
            bool sink = p0 + (int32_t) c < n_sink;
            if (!sink && fabs(fabs(x) - t) < 1e-5 * t) continue;
            bool zero = !sink && fabs(x) < t;
            if (zero) (*n_zero)++;
            if (zero ? y != 0
                     : memcmp(o->base + (o->trans ? (size_t) e * o->n_cells + c : (size_t) c * o->n_embd + e) * o->elsize,
                              d->base + (d->trans ? (size_t) e * d->n_cells + c : (size_t) c * d->n_embd + e) * d->elsize,
                              o->elsize) != 0)
                bad++;
        }
    return bad;
}

static void test_elastic(void **st) {
    (void) st;
    for (int sinks = 0; sinks < 2; sinks++) {
        /* p0 32 with n_sink 64: cells 0..31 are sinks (raw), 32..63 pruned */
        struct syn S = { 1, 2, 64, sinks ? 32 : 256, T_F16, 1, 128, 128, 11 };
        kvt_blob *b = syn_blob(&S);
        struct kvt_codec_params p = kvt_codec_default_params(KVT_CODEC_ELASTIC);
        p.n_head_kv = 2;
        struct kvt_codec_stats cs;
        kvt_blob *d = round_trip(b, &p, &cs);
        struct kvt__mat mo[8], md[8];
        int kind[8];
        int nm = syn_mats(&S, b->data, mo, kind);
        syn_mats(&S, d->data, md, kind);
        long bad = 0, zeros = 0, ctrl_one = 0, ctrl_s = 0, z2 = 0;
        for (int i = 0; i < nm; i++) {
            double s = kind[i] == KVT__SEC_K ? p.s_k : p.s_v, tau[2], one[2], wrong[2];
            ref_tau(&mo[i], 2, s, tau);
            ref_tau(&mo[i], 1, s, one);
            one[1] = one[0];
            ref_tau(&mo[i], 2, s * 0.8, wrong);
            assert_true(tau[1] > 2 * tau[0]); /* the heads differ: per-head thresholds matter */
            bad += elastic_mismatch(&mo[i], &md[i], tau, 2, p.n_sink, S.p0, &zeros);
            ctrl_one += elastic_mismatch(&mo[i], &md[i], one, 2, p.n_sink, S.p0, &z2);
            ctrl_s += elastic_mismatch(&mo[i], &md[i], wrong, 2, p.n_sink, S.p0, &z2);
        }
        double sparsity = (double) cs.n_zeroed / (double) cs.n_elems;
        printf("elastic (%s): %lld of %lld elements zeroed (sparsity %.1f%%), %zu -> %zu bytes (%.3fx)\n",
               sinks ? "half the cells sinks" : "no sinks", (long long) cs.n_zeroed, (long long) cs.n_elems, 100 * sparsity,
               cs.raw_bytes, cs.encoded_bytes, (double) cs.encoded_bytes / cs.raw_bytes);
        assert_int_equal(bad, 0);
        assert_int_equal(zeros, cs.n_zeroed);
        assert_true(ctrl_one > 0 && ctrl_s > 0); /* controls: a global or a wrong threshold is seen */
        assert_int_equal(cs.n_lossy, sinks ? cs.n_elems / 2 : cs.n_elems);
        assert_true(sparsity > 0.1 && sparsity < 0.6);
        kvt_blob_free(d);
        /* elastic+q8 and elastic+q4: the same elements are zero; the kept ones within the codec's
        ** step of their group; q4 in fewer bytes than q8 */
        size_t prev_bytes = cs.encoded_bytes;
        for (int qc = 0; qc < 2; qc++) {
            p.codec = qc ? KVT_CODEC_ELASTIC_Q4 : KVT_CODEC_ELASTIC_Q8;
            const double levels = qc ? 15 : 255;
            struct kvt_codec_stats c2;
            d = round_trip(b, &p, &c2);
            syn_mats(&S, d->data, md, kind);
            assert_int_equal(c2.n_zeroed, cs.n_zeroed);
            assert_true(c2.encoded_bytes < prev_bytes);
            prev_bytes = c2.encoded_bytes;
            long nz_bad = 0, q_bad = 0, q_near = 0;
            for (int i = 0; i < nm; i++) {
                double s = kind[i] == KVT__SEC_K ? p.s_k : p.s_v, tau[2];
                ref_tau(&mo[i], 2, s, tau);
                for (uint32_t c = 0; c < mo[i].n_cells; c++)
                    for (uint32_t e = 0; e < mo[i].n_embd; e++) {
                        double x = kvt__mat_get(&mo[i], c, e), y = kvt__mat_get(&md[i], c, e);
                        bool sink = S.p0 + (int32_t) c < p.n_sink;
                        if (sink) {
                            nz_bad += x != y;
                            continue;
                        }
                        if (fabs(fabs(x) - tau[e / 64]) < 1e-5 * tau[e / 64]) continue;
                        if (fabs(x) < tau[e / 64]) nz_bad += y != 0;
                        else {
                            const double bound = (e >= 64 ? 16.0 : 2.0 + 40 * (kind[i] == KVT__SEC_K && e == 3)) / levels / 2 *
                                                     1.01 +
                                                 half_ulp_f16(y) + 1e-4;
                            q_bad += fabs(x - y) > bound;
                            q_near += fabs(x - y) > bound / 4; /* the bound is not loose by 4x */
                        }
                    }
            }
            printf("elastic+q%d (%s): %zu bytes (%.3fx), %ld kept elements beyond a quarter of the step bound\n", qc ? 4 : 8,
                   sinks ? "half the cells sinks" : "no sinks", c2.encoded_bytes, (double) c2.encoded_bytes / c2.raw_bytes, q_near);
            assert_int_equal(nz_bad, 0);
            assert_int_equal(q_bad, 0);
            if (qc) assert_true(q_near > 0);
            kvt_blob_free(d);
        }
        kvt_blob_free(b);
    }
}

/* Recompute the checksum of encoded bytes x[0..n) for the version its header names. */
static void fix_sum(uint8_t *x, size_t n) {
    uint16_t ver;
    memcpy(&ver, x + 4, 2);
    assert_int_equal(kvt__codec_digest(ver, x + 104, n - 104, x + 72), 0);
}

/* The same bytes as the SHA-256 version that came before (1 or 2), summed here with OpenSSL. */
static void as_sha256(uint8_t *x, size_t n) {
    uint16_t ver;
    memcpy(&ver, x + 4, 2);
    ver = ver == KVT_CODEC_VERSION_HEADS ? KVT_CODEC_VERSION_HEADS_SHA256 : KVT_CODEC_VERSION_SHA256;
    memcpy(x + 4, &ver, 2);
    unsigned len;
    assert_int_equal(EVP_Digest(x + 104, n - 104, x + 72, &len, EVP_sha256(), NULL), 1);
}

/* enc[0..n) rewritten in x as the SHA-256 version before it decodes to the same block. */
static void sha256_reads(const uint8_t *enc, size_t n, uint8_t *x) {
    memcpy(x, enc, n);
    as_sha256(x, n);
    kvt_blob *old = NULL, *cur = NULL;
    assert_int_equal(kvt_codec_decode(x, n, &old), 0);
    assert_int_equal(kvt_codec_decode(enc, n, &cur), 0);
    assert_true(old->size == cur->size && memcmp(old->data, cur->data, old->size) == 0);
    kvt_blob_free(old);
    kvt_blob_free(cur);
}

static void expect_err(const uint8_t *enc, size_t n, int want, const char *needle) {
    kvt_blob *d = (kvt_blob *) 1;
    int rc = kvt_codec_decode(enc, n, &d);
    if (rc != want) fprintf(stderr, "decode of %zu bytes: got %d (%s), want %d\n", n, rc, kvt_errmsg(), want);
    assert_int_equal(rc, want);
    assert_null(d);
    if (needle && !strstr(kvt_errmsg(), needle)) fprintf(stderr, "message '%s' lacks '%s'\n", kvt_errmsg(), needle);
    if (needle) assert_non_null(strstr(kvt_errmsg(), needle));
    assert_true(strlen(kvt_errmsg()) > 10);
}

static void test_damage(void **st) {
    (void) st;
    kvt_blob *b = syn_blob(&SYN[3]);
    for (int c = 0; c < KVT_CODEC__COUNT; c++) {
        struct kvt_codec_params p = kvt_codec_default_params(c);
        p.n_sink = 16;
        uint8_t *enc;
        size_t n;
        assert_int_equal(kvt_codec_encode(b, &p, &enc, &n, NULL), 0);
        struct kvt_codec_info I;
        assert_int_equal(kvt_codec_inspect(enc, n, &I), 0);
        assert_true(I.params.codec == c && I.raw_bytes == b->size && I.encoded_bytes == n && I.n_cells == 48 &&
                    I.n_cells_swa == 24 && I.p0 == 0 && I.version == KVT_CODEC_VERSION);
        uint8_t *x = malloc(n + 1);
        memcpy(x, enc, n);
        x[n - 5] ^= 0x10; /* a flipped payload byte */
        expect_err(x, n, KVT_ECORRUPT, "XXH3-128");
        /* the SHA-256 versions are still read: the same bytes as version 1 decode to the same
        ** block; a SHA-256 under version 3 and an XXH3-128 under version 1 are both refused */
        sha256_reads(enc, n, x);
        uint16_t v3 = KVT_CODEC_VERSION;
        memcpy(x + 4, &v3, 2);
        expect_err(x, n, KVT_ECORRUPT, "XXH3-128");
        memcpy(x, enc, n);
        x[4] = KVT_CODEC_VERSION_SHA256;
        expect_err(x, n, KVT_ECORRUPT, "SHA-256");
        memcpy(x, enc, n);
        for (size_t k = 0; k < n; k += (k < 200 ? 1 : 97)) /* truncations */
            expect_err(x, k, k < 104 ? KVT_EFORMAT : KVT_ECORRUPT, NULL);
        x[n] = 0;
        expect_err(x, n + 1, KVT_ECORRUPT, "bytes");
        x[1] = 'X';
        expect_err(x, n, KVT_EFORMAT, "magic");
        memcpy(x, enc, n);
        x[4] = 5;
        expect_err(x, n, KVT_EFORMAT, "version 5");
        memcpy(x, enc, n);
        x[6] = 9;
        expect_err(x, n, KVT_EFORMAT, "codec id 9");
        /* consistent checksums over damaged payloads: the structure checks must hold */
        unsigned s = 77u + (unsigned) c;
        long ok = 0;
        for (int it = 0; it < 400; it++) {
            memcpy(x, enc, n);
            int flips = 1 + (int) (lcg(&s) % 4);
            for (int f = 0; f < flips; f++) {
                size_t at = 104 + (it % 2 ? lcg(&s) % (n - 104) : lcg(&s) % (n - 104 < 600 ? n - 104 : 600));
                x[at] ^= (uint8_t) (1u << (lcg(&s) % 8));
            }
            fix_sum(x, n);
            kvt_blob *d = NULL;
            int rc = kvt_codec_decode(x, n, &d);
            assert_true(rc == 0 || rc == KVT_ECORRUPT);
            ok += rc == 0;
            kvt_blob_free(d);
        }
        printf("%s: %ld of 400 re-hashed mutations still decode (values or cell records changed)\n", kvt_codec_name(c), ok);
        free(x);
        free(enc);
    }
    kvt_blob_free(b);
    kvt_blob *d = (kvt_blob *) 1;
    assert_int_equal(kvt_codec_decode(NULL, 0, &d), KVT_EFORMAT);
    assert_int_equal(kvt_codec_decode("KVTC", 4, &d), KVT_EFORMAT);
}

/* Elements of decoded tensor d farther than frac x ecq's step of their group from original o:
** KIVI's groups over the lossy cells (position >= n_sink, in cell order), the step s x the
** group's standard deviation over its finite elements, computed here in double (then to F16, as
** stored); sinks must be bit-exact, non-finite elements and those past 126 steps exact (escapes).
** *worst: the largest |err| / half-step; *sq: the squared error summed. */
static long ecq_violations(const struct kvt__mat *o, const struct kvt__mat *d, int kind, uint32_t G, double s, double frac,
                           int32_t p0, int32_t n_sink, double *worst, double *sq) {
    long bad = 0;
    uint32_t N = o->n_cells, E = o->n_embd, lossy[512], M = 0;
    for (uint32_t c = 0; c < N; c++) {
        if (p0 + (int32_t) c >= n_sink) lossy[M++] = c;
        else
            for (uint32_t e = 0; e < E; e++) bad += kvt__mat_get(o, c, e) != kvt__mat_get(d, c, e);
    }
    uint32_t outer = kind == KVT__SEC_K ? E : M, inner = kind == KVT__SEC_K ? M : E;
    for (uint32_t a = 0; a < outer; a++)
        for (uint32_t g0 = 0; g0 < inner; g0 += G) {
            uint32_t g1 = g0 + G < inner ? g0 + G : inner;
            /* the statistics over the finite elements, then again over those within 4 deviations */
            double mu = 0, ss = 0, n = 0, lo = -INFINITY, hi = INFINITY;
            for (int round = 0; round < 2; round++) {
                double m1 = 0, s1 = 0, n1 = 0;
                for (int pass = 0; pass < 2; pass++)
                    for (uint32_t i = g0; i < g1; i++) {
                        double x = kind == KVT__SEC_K ? kvt__mat_get(o, lossy[i], a) : kvt__mat_get(o, lossy[a], i);
                        if (!isfinite(x) || x < lo || x > hi) continue;
                        if (pass == 0) m1 += x, n1++;
                        else s1 += (x - m1 / n1) * (x - m1 / n1);
                    }
                if (n1 > 0) m1 /= n1;
                mu = m1, ss = s1, n = n1;
                const double r = 4 * sqrt(n > 0 ? ss / n : 0);
                if (!(r > 0)) break;
                lo = mu - r, hi = mu + r;
            }
            uint16_t ho = f2h((float) fmax(-65504, fmin(65504, mu)));
            struct kvt__mat om = { (uint8_t *) &ho, 1, 1, 2, false };
            const double off = kvt__mat_get(&om, 0, 0);
            uint16_t h = f2h((float) fmax(s * sqrt(n > 0 ? ss / n : 0), fabs(mu - off) / 64));
            struct kvt__mat hm = { (uint8_t *) &h, 1, 1, 2, false };
            double step = kvt__mat_get(&hm, 0, 0);
            for (uint32_t i = g0; i < g1; i++) {
                uint32_t c = kind == KVT__SEC_K ? lossy[i] : lossy[a], e = kind == KVT__SEC_K ? a : i;
                double x = kvt__mat_get(o, c, e), y = kvt__mat_get(d, c, e);
                const double t = fabs(x - off) / step;
                if (!isfinite(x) || t > 126.5 * (1 + 1e-4)) { /* escaped: exact */
                    bad += !(x == y || (isnan(x) && isnan(y)));
                    continue;
                }
                if (t > 126.5 * (1 - 1e-4)) { /* at the threshold: either */
                    bad += !(x == y || fabs(x - y) <= step / 2 * (1 + 1e-3));
                    continue;
                }
                double bound = step * frac * (1 + 1e-3) + 1e-6 * fabs(x) + (o->elsize == 2 ? half_ulp_f16(y) : 0);
                bad += fabs(x - y) > bound;
                if (worst && step > 0) *worst = fmax(*worst, fabs(x - y) / (step / 2));
                if (sq) *sq += (x - y) * (x - y);
            }
        }
    return bad;
}

static double sq_err(const struct kvt__mat *o, const struct kvt__mat *d) {
    double sq = 0;
    for (uint32_t c = 0; c < o->n_cells; c++)
        for (uint32_t e = 0; e < o->n_embd; e++) {
            double x = kvt__mat_get(o, c, e), y = kvt__mat_get(d, c, e);
            sq += (x - y) * (x - y);
        }
    return sq;
}

/* ecq: every element within half its group's step (computed here, not read from the bytes), the
** bound nearly reached, a quarter-step bound broken (control); sinks, NaN, Inf and
** outliers exact; an all-zero block exact and small; fewer bytes than q4 at no more squared
** error; damaged bytes are test_damage's. */
static void test_ecq(void **st) {
    (void) st;
    for (size_t k = 0; k < sizeof SYN / sizeof *SYN; k++) {
        const struct syn *S = &SYN[k];
        kvt_blob *b = syn_blob(S);
        struct kvt__mat mo[16], md[16];
        int kind[16];
        int nm = syn_mats(S, b->data, mo, kind);
        if (k == 0) { /* escapes: an outlier far beyond the codes, NaN, -Inf */
            kvt__mat_set(&mo[0], 5, 2, 1e4f);
            kvt__mat_set(&mo[nm - 1], 7, 1, NAN);
            kvt__mat_set(&mo[nm - 1], 9, 3, -INFINITY);
        }
        struct kvt_codec_params p = kvt_codec_default_params(KVT_CODEC_ECQ);
        p.n_sink = k == 3 ? 16 : 0;
        struct kvt_codec_stats cs;
        kvt_blob *d = round_trip(b, &p, &cs);
        syn_mats(S, d->data, md, kind);
        if (k == 0) { /* the planted elements come back exactly: escapes, the outlier included */
            assert_true(kvt__mat_get(&md[0], 5, 2) == 1e4f);
            assert_true(isnan(kvt__mat_get(&md[nm - 1], 7, 1)));
            assert_true(kvt__mat_get(&md[nm - 1], 9, 3) == -INFINITY);
        }
        double worst = 0;
        long bad = 0, ctrl = 0;
        for (int i = 0; i < nm; i++) {
            const int32_t p0 = S->p0 + (mo[i].n_cells < (uint32_t) S->n_cells ? S->n_cells / 2 : 0);
            const uint32_t G = (uint32_t) (kind[i] == KVT__SEC_K ? p.group_k : p.group_v);
            bad += ecq_violations(&mo[i], &md[i], kind[i], G, KVT__ECQ_STEP, 0.5, p0, p.n_sink, &worst, NULL);
            ctrl += ecq_violations(&mo[i], &md[i], kind[i], G, KVT__ECQ_STEP, 0.25, p0, p.n_sink, NULL, NULL);
        }
        printf("syn %zu ecq: %zu -> %zu bytes (%.3fx), worst |err| / half-step %.3f\n", k, cs.raw_bytes, cs.encoded_bytes,
               (double) cs.encoded_bytes / cs.raw_bytes, worst);
        assert_int_equal(bad, 0);
        assert_true(worst > 0.9 && ctrl > 0);
        kvt_blob_free(d);
        /* against q4 in the same run: the largest ecq step whose squared error is no more than
        ** q4's must take fewer bytes (uniform elements in two scales, an offset channel; not on
        ** syn 0's planted NaN and Inf, which q4's groups spread, nor syn 3's sinks) */
        if (k == 1 || k == 2) {
            struct kvt_codec_params q = kvt_codec_default_params(KVT_CODEC_Q4);
            struct kvt_codec_stats qs;
            d = round_trip(b, &q, &qs);
            syn_mats(S, d->data, md, kind);
            double q_sq = 0;
            for (int i = 0; i < nm; i++) q_sq += sq_err(&mo[i], &md[i]);
            kvt_blob_free(d);
            size_t best = 0;
            for (double sc = 0.40; sc > 0.02; sc *= 0.8) {
                p.s_k = p.s_v = (float) sc;
                d = round_trip(b, &p, &cs);
                syn_mats(S, d->data, md, kind);
                double e_sq = 0;
                for (int i = 0; i < nm; i++) e_sq += sq_err(&mo[i], &md[i]);
                kvt_blob_free(d);
                if (e_sq <= q_sq) {
                    best = cs.encoded_bytes;
                    printf("syn %zu ecq step %.3f: %zu bytes, squared error %.3g; q4 %zu bytes, %.3g\n", k, sc, best, e_sq,
                           qs.encoded_bytes, q_sq);
                    break;
                }
            }
            assert_true(best > 0 && best < qs.encoded_bytes);
        }
        kvt_blob_free(b);
    }
    /* an all-zero block (a zeroed cache): exact, and padded to the body's minimum (the decoder's allocation bound) */
    struct syn z = { 1, 2, 64, 0, T_F16, 0, 64, 64, 3 };
    kvt_blob *b = syn_blob(&z);
    struct kvt__mat mo[4];
    int kind[4];
    int nm = syn_mats(&z, b->data, mo, kind);
    for (int i = 0; i < nm; i++)
        for (uint32_t c = 0; c < mo[i].n_cells; c++)
            for (uint32_t e = 0; e < mo[i].n_embd; e++) kvt__mat_set(&mo[i], c, e, 0.0f);
    struct kvt_codec_params p = kvt_codec_default_params(KVT_CODEC_ECQ);
    struct kvt_codec_stats cs;
    kvt_blob *d = round_trip(b, &p, &cs);
    assert_memory_equal(d->data, b->data, b->size);
    printf("constant: %zu -> %zu bytes\n", cs.raw_bytes, cs.encoded_bytes);
    assert_true(cs.encoded_bytes < cs.raw_bytes / 8 && cs.encoded_bytes >= (size_t) nm * kvt__ecq_min_body(64 * 64));
    kvt_blob_free(d);
    kvt_blob_free(b);
    /* hostile sections, built by hand (a checksum is no defence: whoever writes a store can
    ** write one): each refused with KVT_ECORRUPT naming what, before the codes are allocated */
    uint8_t *t = calloc(64 * 64, 2);
    struct kvt__mat m = { t, 64, 64, 2, false };
    struct {
        size_t n_codes; /* bytes the frame holds (the section has 4096 elements) */
        int esc_at;     /* a code 255 here (-1: none) */
        uint32_t n_esc; /* escapes stored */
        uint16_t step;  /* group 0's step */
        bool cut;       /* the body below its minimum */
        int tamper;     /* 1 an empty frame after the frame, 2 a skippable frame after it, 3 a legacy
                        ** (v0.7) magic, 4 a padding byte not 0, 5 a code 253, 6 n_esc 5000 */
        const char *want;
    } H[] = { { 4096, -1, 0, 0x3c00, false, 0, NULL }, /* control: a valid section */
              { 4096, 7, 1, 0x3c00, false, 0, NULL },
              { 4097, -1, 0, 0x3c00, false, 0, "holds 4097" },
              { 16u << 20, -1, 0, 0x3c00, false, 0, "holds 16777216" }, /* 16 MiB in a few hundred bytes */
              { 4096, 7, 0, 0x3c00, false, 0, "escape more" },
              { 4096, -1, 1, 0x3c00, false, 0, "codes use 0" },
              { 4096, -1, 0, 0x0000, false, 0, "step 0x0000" },
              { 4096, -1, 0, 0x7c00, false, 0, "step 0x7c00" },
              { 4096, -1, 0, 0x3c00, true, 0, "inside the body" },
              { 4096, -1, 0, 0x3c00, false, 1, "more than one zstd frame" },
              { 4096, -1, 0, 0x3c00, false, 2, "more than one zstd frame" },
              { 4096, -1, 0, 0x3c00, false, 3, "magic" },
              { 4096, -1, 0, 0x3c00, false, 4, "padding byte" },
              { 4096, -1, 0, 0x3c00, false, 5, "outside 0..252" },
              { 4096, -1, 0, 0x3c00, false, 6, "5000 escapes" } };
    for (size_t k = 0; k < sizeof H / sizeof *H; k++) {
        uint8_t *codes = calloc(H[k].n_codes, 1);
        if (H[k].esc_at >= 0) codes[H[k].esc_at] = 255;
        if (H[k].tamper == 5) codes[3] = 253;
        size_t cap = ZSTD_compressBound(H[k].n_codes) + 64;
        uint8_t *frame = malloc(cap);
        size_t zl = ZSTD_compress(frame, cap, codes, H[k].n_codes, 1);
        assert_false(ZSTD_isError(zl));
        if (H[k].tamper == 1) { /* a second, empty frame */
            size_t z2 = ZSTD_compress(frame + zl, cap - zl, "", 0, 1);
            assert_false(ZSTD_isError(z2));
            zl += z2;
        } else if (H[k].tamper == 2) { /* a skippable frame of 4 bytes */
            const uint32_t sk[3] = { 0x184D2A50u, 4, 0xdeadbeefu };
            memcpy(frame + zl, sk, 12);
            zl += 12;
        } else if (H[k].tamper == 3) {
            const uint32_t v07 = 0xFD2FB527u;
            memcpy(frame, &v07, 4);
        }
        struct wbuf sec = { 0 };
        uint8_t bm[8] = { 0 };
        w(&sec, bm, 8);
        for (int g = 0; g < 64; g++) {
            uint16_t off = 0, sp = g == 0 ? H[k].step : 0x3c00;
            w(&sec, &off, 2);
            w(&sec, &sp, 2);
        }
        w32(&sec, H[k].tamper == 6 ? 5000 : H[k].n_esc);
        for (uint32_t i = 0; i < H[k].n_esc; i++) {
            float v = 3.5f;
            w(&sec, &v, 4);
        }
        const size_t body = sec.n - 8 + 8 + zl, min = kvt__ecq_min_body(4096);
        const uint32_t pad = H[k].cut || body >= min ? 0 : (uint32_t) (min - body);
        w32(&sec, (uint32_t) zl);
        w32(&sec, pad);
        w(&sec, frame, zl);
        for (uint32_t i = 0; i < pad; i++) w(&sec, H[k].tamper == 4 && i + 1 == pad ? "\xab" : "", 1);
        assert_true(H[k].tamper != 4 || pad > 0);
        if (H[k].cut) sec.n = 8 + min - 1; /* refused on its size, before its fields are read */
        struct kvt_codec_params p1 = kvt_codec_default_params(KVT_CODEC_ECQ);
        int rc = kvt__sec_decode(sec.p, sec.n, &m, KVT__SEC_K, &p1, 1, "hostile", NULL);
        printf("hostile ecq section %zu: rc %d %s\n", k, rc, rc ? kvt_errmsg() : "");
        if (!H[k].want) {
            assert_int_equal(rc, 0);
            float v0 = kvt__mat_get(&m, 0, 0), v7 = kvt__mat_get(&m, 7, 0); /* K's code 7: channel 0, cell 7 */
            assert_true(v0 == 0 && v7 == (H[k].esc_at == 7 ? 3.5f : 0.0f));
        } else {
            assert_int_equal(rc, KVT_ECORRUPT);
            assert_non_null(strstr(kvt_errmsg(), H[k].want));
        }
        free(sec.p);
        free(frame);
        free(codes);
    }
    free(t);
}

/* Per-head bits (entropy-sized heads): every element of a head decodes exactly as the uniform
** codec of that head's bits decodes it (same groups, same min/step, same rounding: the uniform
** codecs' bounds are checked by test_synthetic), the table travels in the header, and a header
** whose table is inconsistent is refused. */
static void test_head_bits(void **st) {
    (void) st;
    const struct syn *S = &SYN[2]; /* 2 parts x 3 layers, K rows 128, V rows 64 */
    kvt_blob *b = syn_blob(S);
    enum { NH = 2, NU = 6 * NH };
    uint8_t tab[NU];
    for (int i = 0; i < NU; i++) tab[i] = (uint8_t) (i % 3 == 0 ? 8 : 4);
    struct kvt_codec_params pm = kvt_codec_default_params(KVT_CODEC_Q4), p8 = kvt_codec_default_params(KVT_CODEC_Q8),
                            p4 = kvt_codec_default_params(KVT_CODEC_Q4);
    pm.group_v = p8.group_v = p4.group_v = 32; /* V head_dim is 32 */
    pm.group_k = p8.group_k = p4.group_k = 32;
    pm.n_head_kv = p8.n_head_kv = p4.n_head_kv = NH;
    pm.head_bits = tab;
    pm.n_head_bits = NU;
    struct kvt_codec_stats cm, c8, c4;
    kvt_blob *dm = round_trip(b, &pm, &cm), *d8 = round_trip(b, &p8, &c8), *d4 = round_trip(b, &p4, &c4);
    struct kvt__mat mm[16], m8[16], m4[16];
    int kind[16];
    int nm = syn_mats(S, dm->data, mm, kind);
    syn_mats(S, d8->data, m8, kind);
    syn_mats(S, d4->data, m4, kind);
    long n8 = 0, n4 = 0;
    for (int i = 0; i < nm; i++) {
        const int layer = (i / (2 * S->n_layer)) * S->n_layer + (i % S->n_layer); /* blob order */
        const uint32_t hd = mm[i].n_embd / NH;
        for (uint32_t c = 0; c < mm[i].n_cells; c++)
            for (uint32_t e = 0; e < mm[i].n_embd; e++) {
                const int bits = tab[layer * NH + (int) (e / hd)];
                float want = bits == 8 ? kvt__mat_get(&m8[i], c, e) : kvt__mat_get(&m4[i], c, e);
                if (kvt__mat_get(&mm[i], c, e) != want)
                    fail_msg("tensor %d cell %u channel %u (%d bits): %g, uniform q%d gives %g", i, c, e, bits,
                             (double) kvt__mat_get(&mm[i], c, e), bits, (double) want);
                if (bits == 8) n8++;
                else n4++;
            }
    }
    printf("per-head bits: %ld elements at 8 bits, %ld at 4; %zu bytes (q8 %zu, q4 %zu)\n", n8, n4, cm.encoded_bytes,
           c8.encoded_bytes, c4.encoded_bytes);
    assert_true(n8 > 0 && n4 > 0);
    assert_true(cm.encoded_bytes > c4.encoded_bytes && cm.encoded_bytes < c8.encoded_bytes);
    /* control: the uniform codecs differ where the table says 4 (else the check above is empty) */
    assert_true(memcmp(d8->data, d4->data, b->size) != 0);
    kvt_blob_free(dm);
    kvt_blob_free(d8);
    kvt_blob_free(d4);
    /* the header carries the table */
    uint8_t *enc;
    size_t n;
    assert_int_equal(kvt_codec_encode(b, &pm, &enc, &n, NULL), 0);
    struct kvt_codec_info I;
    assert_int_equal(kvt_codec_inspect(enc, n, &I), 0);
    assert_int_equal(I.version, KVT_CODEC_VERSION_HEADS);
    assert_int_equal(I.params.n_head_bits, NU);
    assert_memory_equal(I.params.head_bits, tab, NU);
    const size_t hb = 104 + 8 + 16; /* 12 entries padded to 16 */
    uint8_t *x = malloc(n + 64);
    memcpy(x, enc, n);
    x[104 + 8 + 3] = 5; /* an entry that is not 4 or 8 */
    fix_sum(x, n);
    expect_err(x, n, KVT_EFORMAT, "entry 3");
    memcpy(x, enc, n);
    x[104] = 13; /* a count that does not match the header size */
    expect_err(x, n, KVT_EFORMAT, "13 entries");
    memcpy(x, enc, n);
    x[104 + 8 + 1] ^= 12; /* 4 <-> 8 under a valid checksum: the sections no longer add up */
    fix_sum(x, n);
    expect_err(x, n, KVT_ECORRUPT, NULL);
    memcpy(x, enc, n);
    x[104 + 8 + 1] ^= 12; /* the same without re-hashing: the checksum covers the table */
    expect_err(x, n, KVT_ECORRUPT, "XXH3-128");
    sha256_reads(enc, n, x); /* the SHA-256 version with the table (2) is still read */
    /* a table of 2 layers x 2 heads for a block of 6 layers (header size and checksum consistent) */
    uint8_t *y = calloc(1, n + 64);
    memcpy(y, enc, 104);
    uint32_t nu = 4, hb2 = 104 + 8 + 8;
    memcpy(y + 8, &hb2, 4);
    memcpy(y + 104, &nu, 4);
    memcpy(y + 112, tab, 4);
    memcpy(y + hb2, enc + hb, n - hb);
    size_t ny = hb2 + (n - hb);
    fix_sum(y, ny);
    expect_err(y, ny, KVT_ECORRUPT, "per-head table");
    free(y);
    free(x);
    free(enc);
    /* encode refuses inconsistent tables, naming them */
    enc = (uint8_t *) 1;
    pm.n_head_bits = NU - NH;
    assert_int_equal(kvt_codec_encode(b, &pm, &enc, &n, NULL), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "10 entries"));
    assert_null(enc);
    pm.n_head_bits = NU;
    pm.group_v = 64;
    assert_int_equal(kvt_codec_encode(b, &pm, &enc, &n, NULL), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "group_v 64"));
    pm.group_v = 32;
    tab[0] = 6;
    assert_int_equal(kvt_codec_encode(b, &pm, &enc, &n, NULL), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "entry 0 is 6"));
    tab[0] = 8;
    pm.codec = KVT_CODEC_ELASTIC;
    assert_int_equal(kvt_codec_encode(b, &pm, &enc, &n, NULL), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "q8 and q4 only"));
    kvt_blob_free(b);
}

/* An allocation that fails at any point of encode or decode: KVT_ENOMEM, nothing returned,
** nothing leaked (ASan), and the next call works. */
static void test_alloc_faults(void **st) {
    (void) st;
    kvt_blob *b = syn_blob(&SYN[2]);
    for (int c = 0; c < KVT_CODEC__COUNT; c++) {
        struct kvt_codec_params p = kvt_codec_default_params(c);
        p.n_sink = 200; /* some cells raw */
        int failed = 0;
        for (int64_t skip = 0; skip < 200; skip++) {
            kvt__fault_set(KVT__FAULT_CODEC_ALLOC, skip, 1);
            uint8_t *enc = (uint8_t *) 1;
            size_t n = 1;
            int rc = kvt_codec_encode(b, &p, &enc, &n, NULL);
            bool hit = kvt__fault_hits(KVT__FAULT_CODEC_ALLOC) > 0;
            kvt__fault_set(KVT__FAULT_CODEC_ALLOC, 0, 0);
            if (!hit) {
                assert_int_equal(rc, 0);
                free(enc);
                break;
            } /* past the last allocation */
            assert_int_equal(rc, KVT_ENOMEM);
            assert_null(enc);
            assert_int_equal(n, 0);
            failed++;
        }
        assert_true(failed > 0);
        uint8_t *enc;
        size_t n;
        assert_int_equal(kvt_codec_encode(b, &p, &enc, &n, NULL), 0);
        kvt__fault_set(KVT__FAULT_CODEC_ALLOC, 0, 1);
        kvt_blob *d = (kvt_blob *) 1;
        assert_int_equal(kvt_codec_decode(enc, n, &d), KVT_ENOMEM);
        assert_null(d);
        kvt__fault_set(KVT__FAULT_CODEC_ALLOC, 0, 0);
        assert_int_equal(kvt_codec_decode(enc, n, &d), 0);
        kvt_blob_free(d);
        free(enc);
    }
    kvt_blob_free(b);
}

/* Encoding is pure: threads encoding the same blob at once get the single-threaded bytes (ecq's
** per-thread zstd contexts included), and decode what they encoded. */
struct enc_job {
    const kvt_blob *b;
    const uint8_t *want;
    size_t want_n;
    int codec, same;
};
static void *enc_thread(void *arg) {
    struct enc_job *j = arg;
    struct kvt_codec_params p = kvt_codec_default_params(j->codec);
    p.n_head_kv = 2;
    for (int i = 0; i < 20; i++) {
        uint8_t *enc;
        size_t n;
        kvt_blob *d = NULL;
        if (kvt_codec_encode(j->b, &p, &enc, &n, NULL) == 0) {
            j->same += n == j->want_n && !memcmp(enc, j->want, n) && kvt_codec_decode(enc, n, &d) == 0;
            kvt_blob_free(d);
            free(enc);
        }
    }
    return NULL;
}

static void test_threads(void **st) {
    (void) st;
    kvt_blob *b = syn_blob(&SYN[0]);
    const int codecs[2] = { KVT_CODEC_ELASTIC_Q8, KVT_CODEC_ECQ };
    for (int c = 0; c < 2; c++) {
        struct kvt_codec_params p = kvt_codec_default_params(codecs[c]);
        p.n_head_kv = 2;
        uint8_t *want;
        size_t n;
        assert_int_equal(kvt_codec_encode(b, &p, &want, &n, NULL), 0);
        struct enc_job jobs[3];
        pthread_t th[3];
        for (int i = 0; i < 3; i++) {
            jobs[i] = (struct enc_job){ b, want, n, codecs[c], 0 };
            assert_int_equal(pthread_create(&th[i], NULL, enc_thread, &jobs[i]), 0);
        }
        for (int i = 0; i < 3; i++) {
            pthread_join(th[i], NULL);
            assert_int_equal(jobs[i].same, 20);
        }
        free(want);
    }
    kvt_blob_free(b);
}

/* ---- real blocks ---- */

static char *model_path(const char *name) {
    static char buf[1024];
    if (!strcmp(name, "gemma3-270m")) {
        const char *m = getenv("KVTIER_MODEL");
        return (m && *m) ? strcpy(buf, m) : NULL;
    }
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(buf, sizeof buf, "%s/%s.gguf", d ? d : "tests/models", name);
    return buf;
}

static double kl(const float *p_logits, const float *q_logits, int n) {
    double mp = -INFINITY, mq = -INFINITY, zp = 0, zq = 0, k = 0;
    for (int i = 0; i < n; i++) {
        mp = fmax(mp, p_logits[i]);
        mq = fmax(mq, q_logits[i]);
    }
    for (int i = 0; i < n; i++) {
        zp += exp(p_logits[i] - mp);
        zq += exp(q_logits[i] - mq);
    }
    for (int i = 0; i < n; i++) {
        double lp = p_logits[i] - mp - log(zp), lq = q_logits[i] - mq - log(zq);
        k += exp(lp) * (lp - lq);
    }
    return k;
}

enum { NB = 2, BL = 64 };
#define Q4_KL_MAX      1e-2 /* Gemma 3 270M, text: 1.8e-4 measured */
#define ELASTIC_KL_MAX 1e-2 /* 1.3e-4 and 1.6e-4 measured */

/* Load blocks into empty sequence 1 at their own positions, decode `next` at NB*BL, copy logits. */
static void load_and_step(kvt_engine *e, kvt_blob **blk, kvt_token next, float *logits, int n_vocab) {
    assert_int_equal(kvt_seq_rm(e, 1, 0, -1), 0);
    for (int i = 0; i < NB; i++) {
        int rc = kvt_block_load(e, blk[i], 1, i * BL);
        if (rc) fprintf(stderr, "load: %s\n", kvt_errmsg());
        assert_int_equal(rc, 0);
    }
    assert_int_equal(kvt_engine_decode(e, 1, &next, 1, NB * BL, true), 0);
    memcpy(logits, kvt_engine_logits(e), sizeof *logits * (size_t) n_vocab);
}

static void run_engine(const char *name, bool text) {
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = model_path(name);
    if (!ep.model_path) {
        printf("%s: no model, skipped\n", name);
        return;
    }
    ep.n_ctx = 512;
    ep.n_seq = 2;
    kvt_engine *e = NULL;
    int rc = kvt_engine_open(&ep, &e);
    if (rc) fprintf(stderr, "open %s: %s\n", name, kvt_errmsg());
    assert_int_equal(rc, 0);
    struct kvt_engine_info info;
    kvt_engine_info(e, &info);
    kvt_token tok[NB * BL + 1];
    if (text) {
        static const char T[] =
            "The most important thing to understand about startups is that they are not just small big companies. "
            "A startup is a company designed to grow fast. Being newly founded does not in itself make a company a "
            "startup. Nor is it necessary for a startup to work on technology, or take venture funding, or have some "
            "sort of exit. The only essential thing is growth. Everything else we associate with startups follows.";
        char TT[2 * sizeof T + 2];
        snprintf(TT, sizeof TT, "%s %s", T, T); /* 130+ tokens on any tokenizer */
        kvt_token *t = NULL;
        int32_t nt = 0;
        assert_int_equal(kvt_tokenize(e, TT, true, false, &t, &nt), 0);
        assert_true(nt > NB * BL);
        memcpy(tok, t, sizeof tok);
        free(t);
    } else {
        unsigned s = 5;
        for (int i = 0; i <= NB * BL; i++) tok[i] = 3 + (kvt_token) (lcg(&s) >> 8) % (info.n_vocab - 3);
    }
    kvt_blob *raw[NB];
    for (int i = 0; i < NB; i++) { /* saved right after decoding: iSWA blocks keep their window's cells */
        assert_int_equal(kvt_engine_decode(e, 0, tok + i * BL, BL, i * BL, false), 0);
        assert_int_equal(kvt_block_save(e, 0, i * BL, (i + 1) * BL, &raw[i]), 0);
    }
    float *ref = malloc(sizeof *ref * (size_t) info.n_vocab), *got = malloc(sizeof *got * (size_t) info.n_vocab);
    load_and_step(e, raw, tok[NB * BL], ref, info.n_vocab);
    const char *specs[] = { "raw", "q8", "q4", "elastic", "elastic+q8", "elastic+q4", "elastic:8,8,0" /* control */, "ecq" };
    double kls[8];
    for (int k = 0; k < 8; k++) {
        struct kvt_codec_params p;
        assert_int_equal(kvt_codec_parse(specs[k], &p), 0);
        p.n_head_kv = info.n_head_kv;
        kvt_blob *dec[NB];
        size_t enc_total = 0, raw_total = 0;
        int64_t zeroed = 0, lossy = 0;
        for (int i = 0; i < NB; i++) {
            struct kvt_codec_stats cs;
            uint8_t *enc;
            size_t n;
            rc = kvt_codec_encode(raw[i], &p, &enc, &n, &cs);
            if (rc) fprintf(stderr, "%s %s: %s\n", name, specs[k], kvt_errmsg());
            assert_int_equal(rc, 0);
            assert_int_equal(kvt_codec_decode(enc, n, &dec[i]), 0);
            free(enc);
            enc_total += n;
            raw_total += raw[i]->size;
            zeroed += cs.n_zeroed;
            lossy += cs.n_lossy;
            if (p.codec == KVT_CODEC_RAW) assert_memory_equal(dec[i]->data, raw[i]->data, raw[i]->size);
            if (p.n_sink > 0 && i == 0) assert_int_equal(cs.n_lossy, 0); /* block 0 is all sinks */
        }
        load_and_step(e, dec, tok[NB * BL], got, info.n_vocab);
        double md = 0;
        for (int v = 0; v < info.n_vocab; v++) md = fmax(md, fabs((double) ref[v] - got[v]));
        kls[k] = kl(ref, got, info.n_vocab);
        printf("%-12s %-14s %.3fx raw bytes, sparsity %5.1f%%, KL %.2e nats, max|dlogit| %.4f\n", name, specs[k],
               (double) enc_total / raw_total, lossy ? 100.0 * zeroed / lossy : 0.0, kls[k], md);
        for (int i = 0; i < NB; i++) kvt_blob_free(dec[i]);
    }
    assert_true(kls[0] < 1e-9); /* raw: the same bytes give the same logits */
    assert_true(kls[1] < 2e-3); /* q8 */
    assert_true(kls[2] > kls[1]);
    if (text) { /* a trained model on text (random-weight tiny models are far more fragile) */
        assert_true(kls[2] < Q4_KL_MAX);
        assert_true(kls[3] < ELASTIC_KL_MAX && kls[4] < ELASTIC_KL_MAX);
        assert_true(kls[5] < ELASTIC_KL_MAX + Q4_KL_MAX); /* elastic's zeros and q4's steps */
        assert_true(kls[7] < Q4_KL_MAX);                  /* ecq at its default step */
    }
    assert_true(kls[7] > kls[1]); /* ecq is lossy: not below q8 (a codec that kept the raw bytes would be) */
    /* control: pruning nearly everything must be seen, far beyond every real codec */
    for (int k = 1; k < 8; k++)
        if (k != 6) assert_true(kls[6] > 2 * kls[k]);
    assert_true(kls[6] > 0.1);
    for (int i = 0; i < NB; i++) kvt_blob_free(raw[i]);
    free(ref);
    free(got);
    kvt_engine_free(e);
}

/* ---- kernels: codec_kern.c against the generic coder ---- */

/* ggml's scalar converters, through the library's matrix accessors */
static float ref_h2f(uint16_t h) {
    struct kvt__mat m = { (uint8_t *) &h, 1, 1, 2, false };
    return kvt__mat_get(&m, 0, 0);
}

static bool same_f32(float a, float b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, 4) == 0; }
static bool same_f16(uint16_t a, uint16_t b) {
    bool na = (a & 0x7c00) == 0x7c00 && (a & 0x3ff), nb = (b & 0x7c00) == 0x7c00 && (b & 0x3ff);
    return (na && nb) || a == b;
}

static void test_kernels(void **st) {
    (void) st;
    /* the converters: every F16 value; F32 values around every F16 rounding boundary, the edges */
    for (uint32_t h = 0; h < 65536; h++) {
        uint16_t hh = (uint16_t) h;
        float f;
        kvt__h2f((const uint8_t *) &hh, &f, 1);
        if (!same_f32(f, ref_h2f(hh))) fail_msg("h2f(0x%04x) = %a, ggml %a", h, (double) f, (double) ref_h2f(hh));
    }
    enum { NF = 1000003 };
    float *fx = malloc(sizeof *fx * NF);
    uint16_t *hx = malloc(sizeof *hx * NF);
    float *back = malloc(sizeof *back * NF);
    assert_true(fx && hx && back);
    unsigned sd = 77;
    const float edge[] = { 0.0f,          -0.0f,         65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e-8f, 5.9604645e-8f,
                           2.9802322e-8f, 6.1035156e-5f, INFINITY, -INFINITY, NAN,      1.0f / 3,  1e30f };
    for (size_t i = 0; i < NF; i++) {
        uint32_t b = lcg(&sd) ^ (lcg(&sd) << 16);
        if (i < sizeof edge / sizeof *edge) memcpy(&b, &edge[i], 4);
        else if (i % 3 == 0) b = (b & 0x8fffffffu) | 0x30000000u; /* most in or near the F16 range */
        memcpy(&fx[i], &b, 4);
    }
    kvt__f2h(fx, (uint8_t *) hx, NF); /* odd length: the scalar tail too */
    for (size_t i = 0; i < NF; i++)
        if (!same_f16(hx[i], f2h(fx[i]))) fail_msg("f2h(%a) = 0x%04x, ggml 0x%04x", (double) fx[i], hx[i], f2h(fx[i]));
    kvt__h2f((const uint8_t *) hx + 0, back, NF);
    for (size_t i = 0; i < NF; i++) assert_true(same_f32(back[i], ref_h2f(hx[i])));
    free(fx);
    free(hx);
    free(back);

    /* sections: kernels against the generic coder */
    const uint32_t cells[] = { 1, 3, 64, 70 }, embd[] = { 1, 5, 64, 192, 257 }, gk[] = { 1, 7, 32, 64, 100 }, gv[] = { 7, 64, 300 };
    unsigned s = 4242;
    int n_cases = 0;
    for (size_t ci = 0; ci < sizeof cells / sizeof *cells; ci++)
        for (size_t ei = 0; ei < sizeof embd / sizeof *embd; ei++)
            for (int v = 0; v < 8; v++) { /* es x trans x raw cells */
                const uint32_t N = cells[ci], E = embd[ei], es = v & 1 ? 4 : 2;
                const bool trans = v & 2, raws = v & 4;
                const size_t bytes = (size_t) N * E * es;
                uint8_t *buf = malloc(bytes + 1), *d1 = malloc(bytes + 1), *d2 = malloc(bytes + 1);
                bool *raw = calloc(N, 1);
                assert_true(buf && d1 && d2 && raw);
                uint8_t *base = es == 2 ? buf + 1 : buf; /* an F16 tensor at an odd address */
                for (size_t i = 0; i < (size_t) N * E; i++) {
                    float x = rnd(&s) * (i % 11 == 0 ? 50.0f : 1.0f);
                    unsigned r = lcg(&s) >> 20;
                    if (r % 97 == 0) x = NAN;
                    else if (r % 89 == 0) x = r & 1 ? INFINITY : -INFINITY;
                    else if (r % 83 == 0) x = -0.0f;
                    else if (r % 79 == 0) x = 3e-6f * rnd(&s); /* F16 subnormal */
                    struct kvt__mat one = { base + i * es, 1, 1, es, false };
                    kvt__mat_set(&one, 0, 0, x);
                }
                if (raws)
                    for (uint32_t c = 0; c < N; c++) raw[c] = lcg(&s) % 5 == 0;
                struct kvt__mat m = { base, N, E, es, trans };
                for (int kind = 0; kind < 2; kind++)
                    for (size_t gi = 0; gi < (kind ? sizeof gv / sizeof *gv : sizeof gk / sizeof *gk); gi++)
                        for (int q = 0; q < 4; q++) { /* q8, q4, then both with per-head bits */
                            struct kvt_codec_params p = kvt_codec_default_params(q & 1 ? KVT_CODEC_Q4 : KVT_CODEC_Q8);
                            p.group_k = (int32_t) gk[gi];
                            p.group_v = (int32_t) gv[kind ? gi : 0];
                            /* per-head bits: the most heads (of 5, 4, 3, 2, 1) that split the row, V's
                            ** groups within a head (as kvt_codec_encode requires), bits mixed */
                            uint8_t hbt[8];
                            const uint8_t *hb = NULL;
                            int nh = 1;
                            if (q >= 2) {
                                for (nh = 5; nh > 1; nh--)
                                    if (E % (uint32_t) nh == 0 && (kind == 0 || (E / (uint32_t) nh) % (uint32_t) p.group_v == 0))
                                        break;
                                if (kind == 1 && (E / (uint32_t) nh) % (uint32_t) p.group_v) continue;
                                for (int h = 0; h < nh; h++) hbt[h] = (lcg(&s) >> 16) & 1 ? 8 : 4;
                                if (nh > 1) {
                                    hbt[0] = 4;
                                    hbt[nh - 1] = 8;
                                }
                                hb = hbt;
                            }
                            struct kvt__buf fast = { 0 }, gen = { 0 };
                            int64_t nl1 = 0, nz1 = 0, nl2 = 0, nz2 = 0;
                            assert_int_equal(kvt__sec_encode(&fast, &m, raw, kind, &p, nh, &nl1, &nz1, hb), 0);
                            kvt_codec_test_generic(true);
                            assert_int_equal(kvt__sec_encode(&gen, &m, raw, kind, &p, nh, &nl2, &nz2, hb), 0);
                            assert_int_equal(nl1, nl2);
                            if (fast.n != gen.n || memcmp(fast.p, gen.p, fast.n) != 0)
                                fail_msg("section bytes differ: %u x %u es %u trans %d raws %d kind %d G %d/%d %s heads %d%s", N, E,
                                         es, trans, raws, kind, p.group_k, p.group_v, kvt_codec_name(p.codec), nh,
                                         hb ? " bits" : "");
                            struct kvt__mat m1 = { d1, N, E, es, trans }, m2 = { d2, N, E, es, trans };
                            memset(d1, 0xa5, bytes);
                            memset(d2, 0x5a, bytes);
                            assert_int_equal(kvt__sec_decode(gen.p, gen.n, &m2, kind, &p, nh, "generic", hb), 0);
                            kvt_codec_test_generic(false);
                            assert_int_equal(kvt__sec_decode(fast.p, fast.n, &m1, kind, &p, nh, "kernels", hb), 0);
                            for (size_t i = 0; i < (size_t) N * E; i++) {
                                uint16_t a16, b16;
                                float a32, b32;
                                bool same;
                                if (es == 2) {
                                    memcpy(&a16, d1 + 2 * i, 2);
                                    memcpy(&b16, d2 + 2 * i, 2);
                                    same = same_f16(a16, b16);
                                } else {
                                    memcpy(&a32, d1 + 4 * i, 4);
                                    memcpy(&b32, d2 + 4 * i, 4);
                                    same = same_f32(a32, b32);
                                }
                                if (!same)
                                    fail_msg("decoded element %zu differs: %u x %u es %u trans %d raws %d kind %d %s", i, N, E, es,
                                             trans, raws, kind, kvt_codec_name(p.codec));
                            }
                            free(fast.p);
                            free(gen.p);
                            n_cases++;
                        }
                free(buf);
                free(d1);
                free(d2);
                free(raw);
            }
    printf("kernels: %d sections, the same bytes and decoded tensors as the generic coder\n", n_cases);
}

static void test_engine_tiny(void **st) {
    (void) st;
    run_engine("tiny-llama", false);
    run_engine("tiny-gemma3", false);
}

static void test_engine_gemma(void **st) {
    (void) st;
    run_engine("gemma3-270m", true);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),       cmocka_unit_test(test_synthetic),    cmocka_unit_test(test_elastic),
        cmocka_unit_test(test_damage),      cmocka_unit_test(test_alloc_faults), cmocka_unit_test(test_threads),
        cmocka_unit_test(test_engine_tiny), cmocka_unit_test(test_engine_gemma), cmocka_unit_test(test_head_bits),
        cmocka_unit_test(test_kernels),     cmocka_unit_test(test_ecq),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
