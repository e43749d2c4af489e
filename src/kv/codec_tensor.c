/* codec_tensor.c — the lossy coders of one K/V tensor (layout in codec.h).
**
** q8 / q4 follow KIVI (Liu et al. 2024): keys are quantised per channel (outlier channels keep
** their own range), values per token; asymmetric min/max per group, round to nearest, so every
** element is within half a step of its original (plus F32 arithmetic and the F16 store).
** elastic follows ElasticKV's magnitude pruning: per KV head tau = max(sigma/2, mu) * s over |x|. */
#include "kv/codec.h"
#include "fault.h"
#include "internal.h"
#include "test_hooks.h"

#include "ggml.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void kvt__buf_put(struct kvt__buf *b, const void *src, size_t k) {
    if (b->err || k == 0) return;
    if (b->n + k > b->cap) {
        if (kvt__fault_check(KVT__FAULT_CODEC_ALLOC)) {
            b->err = true;
            return;
        }
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + k) cap *= 2;
        uint8_t *np = realloc(b->p, cap);
        if (!np) {
            b->err = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, k);
    b->n += k;
}

void kvt__buf_reserve(struct kvt__buf *b, size_t cap) {
    if (b->err || cap <= b->cap) return;
    uint8_t *np = kvt__fault_check(KVT__FAULT_CODEC_ALLOC) ? NULL : realloc(b->p, cap);
    if (!np) {
        b->err = true;
        return;
    }
    b->p = np;
    b->cap = cap;
}

void kvt__buf_zero(struct kvt__buf *b, size_t k) {
    kvt__buf_reserve(b, b->n + k);
    if (b->err) return;
    memset(b->p + b->n, 0, k);
    b->n += k;
}

static size_t mat_idx(const struct kvt__mat *m, uint32_t c, uint32_t e) {
    return m->trans ? (size_t) e * m->n_cells + c : (size_t) c * m->n_embd + e;
}

float kvt__mat_get(const struct kvt__mat *m, uint32_t c, uint32_t e) {
    const uint8_t *q = m->base + mat_idx(m, c, e) * m->elsize;
    if (m->elsize == 4) {
        float f;
        memcpy(&f, q, 4);
        return f;
    }
    ggml_fp16_t h;
    memcpy(&h, q, 2);
    return ggml_fp16_to_fp32(h);
}

void kvt__mat_set(const struct kvt__mat *m, uint32_t c, uint32_t e, float v) {
    uint8_t *q = m->base + mat_idx(m, c, e) * m->elsize;
    if (m->elsize == 4) {
        memcpy(q, &v, 4);
        return;
    }
    ggml_fp16_t h = ggml_fp32_to_fp16(v);
    memcpy(q, &h, 2);
}

void kvt__elastic_tau(const float *x, uint32_t n_cells, uint32_t n_embd, int n_head, float s, float *tau) {
    uint32_t hd = n_embd / (uint32_t) n_head;
    for (int h = 0; h < n_head; h++) {
        double sum = 0, sq = 0;
        for (uint32_t c = 0; c < n_cells; c++)
            for (uint32_t e = (uint32_t) h * hd; e < (uint32_t) (h + 1) * hd; e++) {
                double a = fabs((double) x[(size_t) c * n_embd + e]);
                sum += a;
                sq += a * a;
            }
        double n = (double) n_cells * hd;
        double mu = n > 0 ? sum / n : 0, var = n > 0 ? sq / n - mu * mu : 0;
        double sigma = sqrt(var > 0 ? var : 0);
        tau[h] = (float) (fmax(sigma / 2, mu) * s);
    }
}

/* ---- KIVI groups over the lossy rows Y[m][E] ---- */

struct groups {
    int kind;
    uint32_t m, E, G;
    size_t n; /* groups */
};

static struct groups groups_of(int kind, uint32_t m, uint32_t E, const struct kvt_codec_params *p) {
    struct groups g = { kind, m, E, (uint32_t) (kind == KVT__SEC_K ? p->group_k : p->group_v), 0 };
    if (kind == KVT__SEC_K) g.n = (size_t) E * ((m + g.G - 1) / g.G);
    else g.n = (size_t) m * ((E + g.G - 1) / g.G);
    return g;
}

/* Row-major indices (c * E + e) of group gi's elements into idx; returns the count. */
static uint32_t group_elems(const struct groups *g, size_t gi, uint32_t *idx) {
    uint32_t k = 0;
    if (g->kind == KVT__SEC_K) {
        size_t per = (g->m + g->G - 1) / g->G;
        uint32_t e = (uint32_t) (gi / per), c0 = (uint32_t) (gi % per) * g->G;
        for (uint32_t c = c0; c < g->m && c < c0 + g->G; c++) idx[k++] = c * g->E + e;
    } else {
        size_t per = (g->E + g->G - 1) / g->G;
        uint32_t c = (uint32_t) (gi / per), e0 = (uint32_t) (gi % per) * g->G;
        for (uint32_t e = e0; e < g->E && e < e0 + g->G; e++) idx[k++] = c * g->E + e;
    }
    return k;
}

/* One element: constant-size copies the compiler inlines (the sizes are 2 and 4 only). */
static inline void el_cp(uint8_t *d, const uint8_t *s, uint32_t es) {
    if (es == 2) memcpy(d, s, 2);
    else memcpy(d, s, 4);
}

static size_t bytes_of_bits(size_t bits) { return (bits + 7) / 8; }
static bool bit_get(const uint8_t *bm, size_t i) { return (bm[i >> 3] >> (i & 7)) & 1; }
static void bit_set(uint8_t *bm, size_t i) { bm[i >> 3] |= (uint8_t) (1u << (i & 7)); }

/* Bits of a quantised code: 4 for q4 and elastic+q4, else 8. */
static int q_bits(int codec) { return codec == KVT_CODEC_Q4 || codec == KVT_CODEC_ELASTIC_Q4 ? 4 : 8; }
static bool is_elastic(int codec) {
    return codec == KVT_CODEC_ELASTIC || codec == KVT_CODEC_ELASTIC_Q8 || codec == KVT_CODEC_ELASTIC_Q4;
}

/* A rounded code in [0, levels]: a NaN or infinite element (a block decoded from hostile bytes
** can hold any bits) gives 0 or levels, never a float-to-integer conversion out of range. */
static uint8_t code_of(float q, float levels) { return !(q > 0) ? 0 : q > levels ? (uint8_t) levels : (uint8_t) q; }

/* Quantise the (kept) elements of every group: params to out, codes to codes[] (one per
** element in group order; packed by the caller). */
static int quantise(struct kvt__buf *out, const float *y, const uint8_t *keep, const struct groups *g, int bits, uint8_t *codes,
                    size_t *n_codes) {
    uint32_t *idx = malloc(sizeof *idx * g->G);
    if (!idx) return kvt__fail(KVT_ENOMEM, "codec: group index of %u", g->G);
    const float levels = (float) ((1 << bits) - 1);
    size_t nc = 0;
    for (size_t gi = 0; gi < g->n; gi++) {
        uint32_t k = group_elems(g, gi, idx), w = 0;
        for (uint32_t i = 0; i < k; i++)
            if (!keep || bit_get(keep, idx[i])) idx[w++] = idx[i];
        float lo = 0, hi = 0;
        for (uint32_t i = 0; i < w; i++) {
            float v = y[idx[i]];
            if (i == 0 || v < lo) lo = v;
            if (i == 0 || v > hi) hi = v;
        }
        float step = (hi - lo) / levels;
        float prm[2] = { lo, step };
        kvt__buf_put(out, prm, sizeof prm);
        const float inv = step > 0 ? 1.0f / step : 0; /* round half up: (x - lo) * inv >= 0 */
        for (uint32_t i = 0; i < w; i++) {
            float q = (y[idx[i]] - lo) * inv + 0.5f;
            codes[nc++] = code_of(q, levels);
        }
    }
    free(idx);
    *n_codes = nc;
    return 0;
}

/* The KV head of group gi (its first channel's). */
static uint32_t group_head(const struct groups *g, size_t gi, uint32_t hd) {
    if (g->kind == KVT__SEC_K) return (uint32_t) (gi / ((g->m + g->G - 1) / g->G)) / hd;
    return (uint32_t) ((gi % ((g->E + g->G - 1) / g->G)) * g->G) / hd;
}

/* Elements in group gi (without listing them). */
static uint32_t group_size(const struct groups *g, size_t gi) {
    if (g->kind == KVT__SEC_K) {
        size_t per = (g->m + g->G - 1) / g->G;
        uint32_t c0 = (uint32_t) (gi % per) * g->G;
        return KVT_MIN(g->G, g->m - c0);
    }
    size_t per = (g->E + g->G - 1) / g->G;
    uint32_t e0 = (uint32_t) (gi % per) * g->G;
    return KVT_MIN(g->G, g->E - e0);
}

/* q8/q4 with per-head bits: every group's min/step, then each group's codes in hb[its head] bits
** (a 4-bit group packed low nibble first, padded to a byte). */
static int quantise_mixed(struct kvt__buf *out, const float *y, const struct groups *g, const uint8_t *hb, uint32_t hd) {
    uint32_t *idx = malloc(sizeof *idx * g->G);
    float *prm = malloc(sizeof *prm * 2 * (g->n + 1));
    uint8_t *codes = calloc((size_t) g->m * g->E + g->n + 1, 1);
    int rc = 0;
    if (!idx || !prm || !codes) {
        rc = kvt__fail(KVT_ENOMEM, "codec: per-head groups");
        goto out;
    }
    size_t at = 0;
    for (size_t gi = 0; gi < g->n; gi++) {
        uint32_t k = group_elems(g, gi, idx);
        const int bits = hb[group_head(g, gi, hd)];
        const float levels = (float) ((1 << bits) - 1);
        float lo = 0, hi = 0;
        for (uint32_t i = 0; i < k; i++) {
            float v = y[idx[i]];
            if (i == 0 || v < lo) lo = v;
            if (i == 0 || v > hi) hi = v;
        }
        float step = (hi - lo) / levels;
        prm[2 * gi] = lo;
        prm[2 * gi + 1] = step;
        const float inv = step > 0 ? 1.0f / step : 0;
        for (uint32_t i = 0; i < k; i++) {
            float q = (y[idx[i]] - lo) * inv + 0.5f;
            uint8_t c = code_of(q, levels);
            if (bits == 8) codes[at + i] = c;
            else codes[at + i / 2] |= (uint8_t) (c << ((i & 1) * 4));
        }
        at += bits == 8 ? k : (k + 1) / 2;
    }
    kvt__buf_put(out, prm, sizeof *prm * 2 * g->n);
    kvt__buf_put(out, codes, at);
out:
    free(idx);
    free(prm);
    free(codes);
    return rc;
}

/* Element copies go through el_cp, never typed pointers into the blob: a tensor's offset in a
** blob is whatever the bytes say (only whole elements apart), so it may be misaligned. */

/* The tensor's elements cell-major (row c = cell c): m->base itself unless V is transposed,
** else a transposed copy in *tmp (caller frees). */
static const uint8_t *gather(const struct kvt__mat *m, uint8_t **tmp) {
    *tmp = NULL;
    if (!m->trans) return m->base;
    const uint32_t N = m->n_cells, E = m->n_embd, es = m->elsize;
    uint8_t *t = malloc((size_t) N * E * es + 1);
    if (!t) return NULL;
    for (uint32_t e = 0; e < E; e++)
        for (uint32_t c = 0; c < N; c++) el_cp(t + ((size_t) c * E + e) * es, m->base + ((size_t) e * N + c) * es, es);
    *tmp = t;
    return t;
}

/* Write cell-major elements src back into the tensor's own layout. */
static void scatter(const struct kvt__mat *m, const uint8_t *src) {
    const uint32_t N = m->n_cells, E = m->n_embd, es = m->elsize;
    if (!m->trans) {
        if (src != m->base) memcpy(m->base, src, (size_t) N * E * es);
        return;
    }
    for (uint32_t e = 0; e < E; e++)
        for (uint32_t c = 0; c < N; c++) el_cp(m->base + ((size_t) e * N + c) * es, src + ((size_t) c * E + e) * es, es);
}

/* F16/F32 rows to and from F32: ggml's row converters where the F16 side is 2-byte aligned (as
** llama.cpp's own states are), element by element through memcpy where it is not. */
static void row_to_f32(const uint8_t *src, float *dst, size_t n, uint32_t elsize) {
    if (elsize == 4) {
        memcpy(dst, src, n * 4);
        return;
    }
    if (!((uintptr_t) src & 1)) {
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) (const void *) src, dst, (int64_t) n);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        ggml_fp16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = ggml_fp16_to_fp32(h);
    }
}

static void row_from_f32(const float *src, uint8_t *dst, size_t n, uint32_t elsize) {
    if (elsize == 4) {
        memcpy(dst, src, n * 4);
        return;
    }
    if (!((uintptr_t) dst & 1)) {
        ggml_fp32_to_fp16_row(src, (ggml_fp16_t *) (void *) dst, (int64_t) n);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        ggml_fp16_t h = ggml_fp32_to_fp16(src[i]);
        memcpy(dst + 2 * i, &h, 2);
    }
}

static bool test_generic; /* kvt_codec_test_generic */
void kvt_codec_test_generic(bool on) { test_generic = on; }

/* Per-head bits (hb: the layer's n_head entries, hd channels a head): a group's bits are its
** head's.  X's row-major order is the group order, so a group's codes are G consecutive codes of
** X; a K head is hd consecutive rows of X, a V head hd consecutive channels of each row. */
static int x_bits(const uint8_t *hb, uint32_t hd, int kind, uint32_t row, uint32_t col) {
    return hb[(kind == KVT__SEC_K ? row : col) / hd];
}

struct kvt__xshape kvt__x_shape(int kind, uint32_t M, uint32_t E, const struct kvt_codec_params *p) {
    struct kvt__xshape x;
    x.R = kind == KVT__SEC_K ? E : M;
    x.L = kind == KVT__SEC_K ? M : E;
    x.G = (uint32_t) (kind == KVT__SEC_K ? p->group_k : p->group_v);
    x.ne = (size_t) M * E;
    x.n_groups = (size_t) x.R * ((x.L + x.G - 1) / x.G);
    return x;
}

int kvt__sec_x_encode(struct kvt__buf *out, const struct kvt__mat *m, const bool *raw_cell, int kind, uint32_t M, float **xo) {
    const uint32_t N = m->n_cells, E = m->n_embd, es = m->elsize;
    const size_t row = (size_t) E * es, nall = (size_t) N * E, ne = (size_t) M * E;
    float *all = malloc(sizeof *all * (nall + 1)), *tr = malloc(sizeof *tr * (ne + 1));
    uint8_t *rawrow = malloc(row + 1);
    *xo = NULL;
    if (!all || !tr || !rawrow) {
        free(all);
        free(tr);
        free(rawrow);
        return kvt__fail(KVT_ENOMEM, "codec: %u x %u tensor", N, E);
    }
    /* the raw cells, cell-major in the cache type */
    for (uint32_t c = 0; c < N && M < N; c++) {
        if (!raw_cell[c]) continue;
        if (!m->trans) kvt__buf_put(out, m->base + c * row, row);
        else {
            for (uint32_t e = 0; e < E; e++) el_cp(rawrow + (size_t) e * es, m->base + ((size_t) e * N + c) * es, es);
            kvt__buf_put(out, rawrow, row);
        }
    }
    free(rawrow);
    /* F32 in the tensor's own layout (cells x channels, or channels x cells when transposed),
    ** then the lossy cells only, in place */
    if (es == 2) kvt__h2f(m->base, all, nall);
    else memcpy(all, m->base, nall * 4);
    if (M < N) {
        if (!m->trans) {
            for (uint32_t c = 0, r = 0; c < N; c++)
                if (!raw_cell[c]) memmove(all + (size_t) (r++) * E, all + (size_t) c * E, sizeof *all * E);
        } else {
            for (uint32_t e = 0; e < E; e++)
                for (uint32_t c = 0, r = 0; c < N; c++)
                    if (!raw_cell[c]) all[(size_t) e * M + r++] = all[(size_t) e * N + c];
        }
    }
    if ((kind == KVT__SEC_K) == !m->trans) { /* K wants channels x cells, V cells x channels */
        kvt__transpose(all, m->trans ? E : M, m->trans ? M : E, tr);
        free(all);
        *xo = tr;
    } else {
        free(tr);
        *xo = all;
    }
    return 0;
}

/* q8/q4, uniform or with per-head bits (no keep mask): the lossy elements as X (codec.h,
** kernels), built with one F16 conversion and at most one transpose, then codec_kern.c.  The
** per-head layout is quantise_mixed's: every group's min/step, then each group's codes in its
** head's bits (a 4-bit group packed on its own, low nibble first). */
static int enc_uniform(struct kvt__buf *out, const struct kvt__mat *m, const bool *raw_cell, int kind,
                       const struct kvt_codec_params *p, uint32_t M, const uint8_t *hb, uint32_t hd) {
    const uint32_t E = m->n_embd;
    const int bits = q_bits(p->codec);
    const struct kvt__xshape xs = kvt__x_shape(kind, M, E, p);
    const uint32_t R = xs.R, L = xs.L, G = xs.G;
    const size_t ne = xs.ne, n_groups = xs.n_groups;
    float *x = NULL;
    uint8_t *prm = malloc(8 * n_groups + 1), *codes = malloc(ne + (ne + 1) / 2 + 1);
    int rc = 0;
    if (!prm || !codes) {
        rc = kvt__fail(KVT_ENOMEM, "codec: %u x %u tensor", M, E);
        goto out;
    }
    if ((rc = kvt__sec_x_encode(out, m, raw_cell, kind, M, &x))) goto out;
    if (hb) {
        const uint32_t per = (L + G - 1) / G;
        if (kind == KVT__SEC_K) /* a head: hd rows */
            for (uint32_t r0 = 0; r0 < R; r0 += hd)
                kvt__quant_rows(x + (size_t) r0 * L, KVT_MIN(hd, R - r0), L, G, x_bits(hb, hd, kind, r0, 0),
                                prm + (size_t) r0 * per * 8, codes + (size_t) r0 * L);
        else /* a head: hd channels of a row, whole groups (hd is a multiple of G) */
            for (uint32_t r = 0; r < R; r++)
                for (uint32_t e0 = 0; e0 < L; e0 += hd)
                    kvt__quant_rows(x + (size_t) r * L + e0, 1, KVT_MIN(hd, L - e0), G, x_bits(hb, hd, kind, r, e0),
                                    prm + ((size_t) r * per + e0 / G) * 8, codes + (size_t) r * L + e0);
        kvt__buf_put(out, prm, 8 * n_groups);
        uint8_t *packed = codes + ne; /* room for (ne + 1) / 2 bytes; a group's 4-bit codes at a time */
        for (uint32_t r = 0; r < R; r++)
            for (uint32_t c0 = 0; c0 < L; c0 += G) {
                const uint32_t k = KVT_MIN(G, L - c0);
                const uint8_t *gc = codes + (size_t) r * L + c0;
                if (x_bits(hb, hd, kind, r, c0) == 8) kvt__buf_put(out, gc, k);
                else {
                    kvt__pack4(gc, k, packed);
                    kvt__buf_put(out, packed, (k + 1) / 2);
                }
            }
    } else {
        kvt__quant_rows(x, R, L, G, bits, prm, codes);
        kvt__buf_put(out, prm, 8 * n_groups);
        if (bits == 8) kvt__buf_put(out, codes, ne);
        else {
            kvt__pack4(codes, ne, codes + ne);
            kvt__buf_put(out, codes + ne, (ne + 1) / 2);
        }
    }
    if (out->err) rc = kvt__fail(KVT_ENOMEM, "codec: output buffer");
out:
    free(x);
    free(prm);
    free(codes);
    return rc;
}

int kvt__sec_encode(struct kvt__buf *out, const struct kvt__mat *m, const bool *raw_cell, int kind,
                    const struct kvt_codec_params *p, int n_head, int64_t *n_lossy, int64_t *n_zeroed, const uint8_t *head_bits) {
    const uint32_t N = m->n_cells, E = m->n_embd, es = m->elsize;
    const size_t row = (size_t) E * es;
    uint8_t *cbm = calloc(bytes_of_bits(N) + 1, 1), *tmp = NULL;
    uint32_t n_raw = 0;
    if (!cbm) return kvt__fail(KVT_ENOMEM, "codec: cell bitmap");
    for (uint32_t c = 0; c < N; c++)
        if (raw_cell[c]) {
            bit_set(cbm, c);
            n_raw++;
        }
    kvt__buf_put(out, cbm, bytes_of_bits(N));
    free(cbm);
    const bool elastic = is_elastic(p->codec);
    if (p->codec == KVT_CODEC_ECQ) {
        *n_lossy += (int64_t) (N - n_raw) * E;
        return kvt__ecq_encode(out, m, raw_cell, kind, p, N - n_raw);
    }
    if (!elastic && !test_generic) {
        *n_lossy += (int64_t) (N - n_raw) * E;
        return enc_uniform(out, m, raw_cell, kind, p, N - n_raw, head_bits, head_bits ? E / (uint32_t) n_head : 0);
    }
    const uint8_t *cm = gather(m, &tmp);
    const uint32_t M = N - n_raw;
    const size_t ne = (size_t) M * E;
    float *y = malloc(sizeof *y * (ne + 1));
    float *all = malloc(sizeof *all * ((size_t) N * E + 1));
    uint8_t *keep = calloc(bytes_of_bits(ne) + 1, 1);
    uint8_t *codes = malloc(ne + 1);
    int rc = 0;
    if (!cm || !y || !all || !keep || !codes) {
        rc = kvt__fail(KVT_ENOMEM, "codec: %u x %u tensor", N, E);
        goto out;
    }
    for (uint32_t c = 0; c < N; c++)
        if (raw_cell[c]) kvt__buf_put(out, cm + c * row, row);
    row_to_f32(cm, all, (size_t) N * E, es);
    for (uint32_t c = 0, r = 0; c < N; c++)
        if (!raw_cell[c]) memcpy(y + (size_t) (r++) * E, all + (size_t) c * E, sizeof *y * E);
    *n_lossy += (int64_t) ne;
    if (elastic) {
        float tau[KVT__MAX_HEADS];
        /* statistics over every cell of the block (sinks included), pruning of the lossy ones */
        kvt__elastic_tau(all, N, E, n_head, kind == KVT__SEC_K ? p->s_k : p->s_v, tau);
        kvt__buf_put(out, tau, sizeof(float) * (size_t) n_head);
        uint32_t hd = E / (uint32_t) n_head;
        size_t n_kept = 0;
        for (size_t r = 0, i = 0; r < M; r++)
            for (uint32_t e = 0; e < E; e++, i++)
                if (fabsf(y[i]) >= tau[e / hd]) {
                    bit_set(keep, i);
                    n_kept++;
                }
        *n_zeroed += (int64_t) (ne - n_kept);
        kvt__buf_put(out, keep, bytes_of_bits(ne));
    }
    if (p->codec == KVT_CODEC_ELASTIC) {
        uint8_t *vals = malloc(ne * es + 1);
        if (!vals) {
            rc = kvt__fail(KVT_ENOMEM, "codec: kept values");
            goto out;
        }
        size_t k = 0;
        for (uint32_t c = 0, r = 0; c < N; c++) {
            if (raw_cell[c]) continue;
            const uint8_t *src = cm + c * row;
            for (uint32_t e = 0; e < E; e++)
                if (bit_get(keep, (size_t) r * E + e)) {
                    el_cp(vals + k * es, src + (size_t) e * es, es);
                    k++;
                }
            r++;
        }
        kvt__buf_put(out, vals, k * es);
        free(vals);
    } else if (head_bits) {
        struct groups g = groups_of(kind, M, E, p);
        if ((rc = quantise_mixed(out, y, &g, head_bits, E / (uint32_t) n_head))) goto out;
    } else {
        struct groups g = groups_of(kind, M, E, p);
        int bits = q_bits(p->codec);
        size_t nc = 0;
        if ((rc = quantise(out, y, elastic ? keep : NULL, &g, bits, codes, &nc))) goto out;
        if (bits == 8) kvt__buf_put(out, codes, nc);
        else {
            uint8_t *packed = calloc(bytes_of_bits(nc * 4) + 1, 1);
            if (!packed) {
                rc = kvt__fail(KVT_ENOMEM, "codec: packed codes");
                goto out;
            }
            for (size_t i = 0; i < nc; i++) packed[i >> 1] |= (uint8_t) (codes[i] << ((i & 1) * 4));
            kvt__buf_put(out, packed, bytes_of_bits(nc * 4));
            free(packed);
        }
    }
    if (out->err) rc = kvt__fail(KVT_ENOMEM, "codec: output buffer");
out:
    free(tmp);
    free(y);
    free(all);
    free(keep);
    free(codes);
    return rc;
}

/* A cursor over the section's bytes that refuses to read past its end. */
struct cur {
    const uint8_t *p;
    size_t n, off;
    const char *what;
};

static const uint8_t *take(struct cur *c, size_t k) {
    static const uint8_t none = 0;
    if (k > c->n - c->off) return NULL;
    if (!c->p) return &none; /* a section of 0 bytes may come without a buffer: nothing to read */
    const uint8_t *q = c->p + c->off;
    c->off += k;
    return q;
}

static int short_sec(const struct cur *c, const char *part, size_t need) {
    return kvt__fail(KVT_ECORRUPT, "codec: %s: section of %zu bytes ends inside the %s (needs %zu more at byte %zu)", c->what, c->n,
                     part, need, c->off);
}

static int hb_bits(const uint8_t *hb, const struct groups *g, size_t gi, uint32_t hd) { return hb[group_head(g, gi, hd)]; }

static size_t popcount_bits(const uint8_t *bm, size_t n_bits) {
    size_t k = 0, full = n_bits / 8;
    for (size_t i = 0; i < full; i++) k += (size_t) __builtin_popcount(bm[i]);
    for (size_t i = full * 8; i < n_bits; i++) k += bit_get(bm, i); /* bits past n_bits do not count */
    return k;
}

/* The inverse of enc_uniform: the body after the raw cells (rawv, n_raw of them), nothing
** written to m before the section is known to be whole. */
static int dec_uniform(struct cur *cu, const struct kvt__mat *m, const uint8_t *cbm, const uint8_t *rawv, uint32_t M, int kind,
                       const struct kvt_codec_params *p, const uint8_t *hb, uint32_t hd) {
    const uint32_t E = m->n_embd;
    const int bits = q_bits(p->codec);
    const struct kvt__xshape xs = kvt__x_shape(kind, M, E, p);
    const uint32_t R = xs.R, L = xs.L, G = xs.G;
    const size_t ne = xs.ne, n_groups = xs.n_groups;
    const uint8_t *prm = take(cu, n_groups * 8);
    if (!prm) return short_sec(cu, "group parameters", n_groups * 8);
    size_t code_bytes = bits == 8 ? ne : (ne + 1) / 2;
    if (hb) { /* each group's codes in its head's bits */
        code_bytes = 0;
        for (uint32_t r = 0; r < R; r++)
            for (uint32_t c0 = 0; c0 < L; c0 += G) {
                const uint32_t k = KVT_MIN(G, L - c0);
                code_bytes += x_bits(hb, hd, kind, r, c0) == 8 ? k : (k + 1) / 2;
            }
    }
    const uint8_t *codes = take(cu, code_bytes);
    if (!codes) return short_sec(cu, "codes", code_bytes);
    if (cu->off != cu->n)
        return kvt__fail(KVT_ECORRUPT, "codec: %s: section has %zu trailing bytes after %zu", cu->what, cu->n - cu->off, cu->off);
    float *x = malloc(sizeof *x * (ne + 1));
    uint8_t *c8 = bits == 8 && !hb ? NULL : malloc(ne + 1);
    int rc = 0;
    if (!x || ((bits != 8 || hb) && !c8)) {
        rc = kvt__fail(KVT_ENOMEM, "codec: %u x %u tensor", M, E);
        goto out;
    }
    if (hb) { /* one code a byte in X's order, as the uniform coder's */
        const uint8_t *at = codes;
        for (uint32_t r = 0; r < R; r++)
            for (uint32_t c0 = 0; c0 < L; c0 += G) {
                const uint32_t k = KVT_MIN(G, L - c0);
                uint8_t *gc = c8 + (size_t) r * L + c0;
                if (x_bits(hb, hd, kind, r, c0) == 8) {
                    memcpy(gc, at, k);
                    at += k;
                } else {
                    kvt__unpack4(at, k, gc);
                    at += (k + 1) / 2;
                }
            }
    } else if (c8) kvt__unpack4(codes, ne, c8);
    kvt__dequant_rows(c8 ? c8 : codes, prm, R, L, G, x);
    rc = kvt__sec_x_decode(m, cbm, rawv, M, kind, x);
out:
    free(x);
    free(c8);
    return rc;
}

int kvt__sec_x_decode(const struct kvt__mat *m, const uint8_t *cbm, const uint8_t *rawv, uint32_t M, int kind, const float *x) {
    const uint32_t N = m->n_cells, E = m->n_embd, es = m->elsize;
    const size_t row = (size_t) E * es, ne = (size_t) M * E;
    float *tr = malloc(sizeof *tr * (ne + 1)), *line = malloc(sizeof *line * (N + 1));
    if (!tr || !line) {
        free(tr);
        free(line);
        return kvt__fail(KVT_ENOMEM, "codec: %u x %u tensor", M, E);
    }
    if (!m->trans) { /* cells x channels: K's X transposed, V's as it is */
        const float *cx = x;
        if (kind == KVT__SEC_K) {
            kvt__transpose(x, E, M, tr);
            cx = tr;
        }
        for (uint32_t c = 0, r = 0, k = 0; c < N; c++) {
            uint8_t *dst = m->base + c * row;
            if (bit_get(cbm, c)) memcpy(dst, rawv + (size_t) (k++) * row, row);
            else if (es == 2) kvt__f2h(cx + (size_t) (r++) * E, dst, E);
            else memcpy(dst, cx + (size_t) (r++) * E, row);
        }
    } else { /* channels x cells: V's X transposed, K's as it is; raw cells element by element */
        const float *tx = x;
        if (kind == KVT__SEC_V) {
            kvt__transpose(x, M, E, tr);
            tx = tr;
        }
        for (uint32_t e = 0; e < E; e++) {
            uint8_t *dst = m->base + (size_t) e * N * es;
            const float *src = tx + (size_t) e * M;
            if (M < N) {
                for (uint32_t c = 0, r = 0; c < N; c++) line[c] = bit_get(cbm, c) ? 0 : src[r++];
                src = line;
            }
            if (es == 2) kvt__f2h(src, dst, N);
            else memcpy(dst, src, (size_t) N * 4);
            if (M < N)
                for (uint32_t c = 0, k = 0; c < N; c++)
                    if (bit_get(cbm, c)) el_cp(dst + (size_t) c * es, rawv + (size_t) (k++) * row + (size_t) e * es, es);
        }
    }
    free(tr);
    free(line);
    return 0;
}

int kvt__sec_decode(const uint8_t *enc, size_t n, const struct kvt__mat *m, int kind, const struct kvt_codec_params *p, int n_head,
                    const char *what, const uint8_t *head_bits) {
    struct cur cu = { enc, n, 0, what };
    const uint32_t N = m->n_cells, E = m->n_embd, es = m->elsize;
    const size_t row = (size_t) E * es;
    const uint8_t *cbm = take(&cu, bytes_of_bits(N));
    if (!cbm) return short_sec(&cu, "raw-cell bitmap", bytes_of_bits(N));
    uint32_t n_raw = (uint32_t) popcount_bits(cbm, N);
    const uint8_t *rawv = take(&cu, (size_t) n_raw * row);
    if (!rawv) return short_sec(&cu, "raw cells", (size_t) n_raw * row);
    const uint32_t M = N - n_raw;
    const size_t ne = (size_t) M * E;
    const bool elastic = is_elastic(p->codec);
    /* before allocating from N and E: the body must hold at least its smallest encoding (elastic:
    ** the thresholds and a 1-bit mask per element; q8/q4: half a byte per element), so what is
    ** allocated stays within a fixed multiple of the section's bytes; element indices fit 32 bits */
    const size_t min_body = elastic                     ? sizeof(float) * (size_t) n_head + bytes_of_bits(ne)
                            : p->codec == KVT_CODEC_ECQ ? kvt__ecq_min_body(ne)
                                                        : bytes_of_bits(ne * 4);
    if (ne > UINT32_MAX) return kvt__fail(KVT_ECORRUPT, "codec: %s: %u x %u lossy elements exceed 2^32", what, M, E);
    if (min_body > cu.n - cu.off) return short_sec(&cu, "body", min_body);
    if (p->codec == KVT_CODEC_ECQ)
        return kvt__ecq_decode(cu.p ? cu.p + cu.off : NULL, cu.n - cu.off, m, cbm, rawv, M, kind, p, what);
    if (!elastic && !test_generic)
        return dec_uniform(&cu, m, cbm, rawv, M, kind, p, head_bits, head_bits ? E / (uint32_t) n_head : 0);
    /* cell-major output: the tensor itself unless V is transposed */
    uint8_t *cm = m->trans ? malloc((size_t) N * row + 1) : m->base;
    uint32_t *rows = malloc(sizeof *rows * (M + 1)); /* lossy row r is cell rows[r] */
    float *y = calloc(ne + 1, sizeof *y);
    uint32_t *idx = NULL;
    int rc = 0;
    if (!cm || !rows || !y) {
        rc = kvt__fail(KVT_ENOMEM, "codec: %u x %u tensor", M, E);
        goto out;
    }
    for (uint32_t c = 0, r = 0, k = 0; c < N; c++) {
        if (bit_get(cbm, c)) memcpy(cm + c * row, rawv + (size_t) (k++) * row, row);
        else rows[r++] = c;
    }
    const uint8_t *keep = NULL;
    size_t n_kept = ne;
    if (elastic) {
        if (!take(&cu, sizeof(float) * (size_t) n_head)) {
            rc = short_sec(&cu, "thresholds", 4 * (size_t) n_head);
            goto out;
        }
        if (!(keep = take(&cu, bytes_of_bits(ne)))) {
            rc = short_sec(&cu, "element bitmap", bytes_of_bits(ne));
            goto out;
        }
        n_kept = popcount_bits(keep, ne);
    }
    if (p->codec == KVT_CODEC_ELASTIC) {
        const uint8_t *kv = take(&cu, n_kept * es);
        if (!kv) {
            rc = short_sec(&cu, "kept values", n_kept * es);
            goto out;
        }
        size_t k = 0;
        for (uint32_t r = 0; r < M; r++) {
            uint8_t *dst = cm + rows[r] * row;
            memset(dst, 0, row); /* +0 in F16 and F32 */
            for (uint32_t e = 0; e < E; e++)
                if (bit_get(keep, (size_t) r * E + e)) {
                    el_cp(dst + (size_t) e * es, kv + k * es, es);
                    k++;
                }
        }
    } else if (head_bits) {
        struct groups g = groups_of(kind, M, E, p);
        const uint32_t hd = E / (uint32_t) n_head;
        const uint8_t *prm = take(&cu, g.n * 8);
        if (!prm) {
            rc = short_sec(&cu, "group parameters", g.n * 8);
            goto out;
        }
        size_t code_bytes = 0;
        for (size_t gi = 0; gi < g.n; gi++) {
            uint32_t k = group_size(&g, gi);
            code_bytes += hb_bits(head_bits, &g, gi, hd) == 8 ? k : (k + 1) / 2;
        }
        const uint8_t *codes = take(&cu, code_bytes);
        if (!codes) {
            rc = short_sec(&cu, "codes", code_bytes);
            goto out;
        }
        if (!(idx = malloc(sizeof *idx * g.G))) {
            rc = kvt__fail(KVT_ENOMEM, "codec: group index");
            goto out;
        }
        size_t at = 0;
        for (size_t gi = 0; gi < g.n; gi++) {
            float lo, step;
            memcpy(&lo, prm + gi * 8, 4);
            memcpy(&step, prm + gi * 8 + 4, 4);
            uint32_t k = group_elems(&g, gi, idx);
            if (hb_bits(head_bits, &g, gi, hd) == 8) {
                for (uint32_t i = 0; i < k; i++) y[idx[i]] = lo + (float) codes[at + i] * step;
                at += k;
            } else {
                for (uint32_t i = 0; i < k; i++) y[idx[i]] = lo + (float) ((codes[at + i / 2] >> ((i & 1) * 4)) & 15u) * step;
                at += (k + 1) / 2;
            }
        }
        for (uint32_t r = 0; r < M; r++) row_from_f32(y + (size_t) r * E, cm + rows[r] * row, E, es);
    } else {
        struct groups g = groups_of(kind, M, E, p);
        int bits = q_bits(p->codec);
        const uint8_t *prm = take(&cu, g.n * 8);
        if (!prm) {
            rc = short_sec(&cu, "group parameters", g.n * 8);
            goto out;
        }
        size_t code_bytes = bits == 8 ? n_kept : bytes_of_bits(n_kept * 4);
        const uint8_t *codes = take(&cu, code_bytes);
        if (!codes) {
            rc = short_sec(&cu, "codes", code_bytes);
            goto out;
        }
        if (!(idx = malloc(sizeof *idx * g.G))) {
            rc = kvt__fail(KVT_ENOMEM, "codec: group index");
            goto out;
        }
        size_t ci = 0;
        for (size_t gi = 0; gi < g.n; gi++) {
            float lo, step;
            memcpy(&lo, prm + gi * 8, 4);
            memcpy(&step, prm + gi * 8 + 4, 4);
            uint32_t k = group_elems(&g, gi, idx);
            if (keep && bits == 8) {
                for (uint32_t i = 0; i < k; i++)
                    if (bit_get(keep, idx[i])) y[idx[i]] = lo + (float) codes[ci++] * step;
            } else if (keep) { /* elastic+q4: the kept elements' codes, packed low nibble first */
                for (uint32_t i = 0; i < k; i++)
                    if (bit_get(keep, idx[i])) {
                        y[idx[i]] = lo + (float) ((codes[ci >> 1] >> ((ci & 1) * 4)) & 15u) * step;
                        ci++;
                    }
            } else if (bits == 8) {
                for (uint32_t i = 0; i < k; i++) y[idx[i]] = lo + (float) codes[ci++] * step;
            } else {
                for (uint32_t i = 0; i < k; i++, ci++) y[idx[i]] = lo + (float) ((codes[ci >> 1] >> ((ci & 1) * 4)) & 15u) * step;
            }
        }
        for (uint32_t r = 0; r < M; r++) row_from_f32(y + (size_t) r * E, cm + rows[r] * row, E, es);
    }
    if (cu.off != cu.n)
        rc = kvt__fail(KVT_ECORRUPT, "codec: %s: section has %zu trailing bytes after %zu", what, cu.n - cu.off, cu.off);
    else if (m->trans) scatter(m, cm);
out:
    if (m->trans) free(cm);
    free(rows);
    free(y);
    free(idx);
    return rc;
}
