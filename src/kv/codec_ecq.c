/* codec_ecq.c — ecq, the entropy-coded uniform quantiser for blocks at rest (kvtier.h section 9;
** the section layout is in codec.h).
**
** Why this codec: KIVI's q4 spends 4 bits on every element plus 1 bit of group min/step, whatever
** the element's distribution.  ecq keeps KIVI's groups (K per channel over group_k cells, V per
** token over group_v channels: the error lands where q4's does, relative to each group's spread)
** but gives each group a step proportional to its standard deviation instead of its range, lets
** the codes run past 16 levels, and entropy-codes them: a Gaussian-like group at a step of 0.3
** standard deviations (about q4's) needs ~3.9 bits an element instead of 4, and a heavy-tailed
** group, whose range makes q4's step coarse, keeps a step set by its spread.
**
** What was measured before this design (docs/BENCHMARKS.md, "ecq"): one step for a whole K or V
** tensor (the squared-error optimum across channels, bench/codec_estimate) reached q4's squared
** error in ~0.22x of raw but cost 2-3x q4's KL on Gemma 3, whose small-magnitude K channels meet
** large queries; a per-KV-head PCA basis in front of the quantiser (KVTC, Staniszewski et al.
** 2025) bought nothing: keys reach us rotated by RoPE (llama.cpp's state API holds no pre-RoPE
** keys), and the basis helped V by 3-6 % and cost K as much.  So no transform is stored.
**
** The entropy coder is zstd (Debian's libzstd) at level 1: its literals go through a Huffman
** coder, which for one-byte symbols comes within a few percent of their order-0 entropy (3.91 bits
** against 3.78 on Gaussian groups at s 0.3), it decodes at GB/s, and it is a format with a fuzzed
** reference decoder and a stable ABI.  An arithmetic coder with a model per channel would save a
** few percent more but would be our own entropy coder.
**
** Per group { f16 offset (the mean), f16 step (s x the standard deviation) }: 0.5 bit an element
** at groups of 64, half of q4's F32 min/step.  The loops are kernels in codec_kern.c. */
#include "kv/codec.h"
#include "fault.h"
#include "internal.h"

#include <zstd.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define ZSTD_LEVEL \
    1 /* literals are Huffman-coded at every positive level; higher levels only search
                     ** harder for matches, which quantised noise does not have */

size_t kvt__ecq_min_body(size_t ne) { return (ne + 7) / 8; }

/* One zstd compression and decompression context per thread, kept (creating one costs more than
** coding a section); freed when the thread exits. */
struct zctx {
    ZSTD_CCtx *c;
    ZSTD_DCtx *d;
};
static pthread_key_t zkey;
static pthread_once_t zonce = PTHREAD_ONCE_INIT;
static int zkey_ok;
static void zctx_free(void *v) {
    struct zctx *z = v;
    ZSTD_freeCCtx(z->c);
    ZSTD_freeDCtx(z->d);
    free(z);
}
static void zkey_init(void) { zkey_ok = pthread_key_create(&zkey, zctx_free) == 0; }
static struct zctx *zctx_get(void) {
    pthread_once(&zonce, zkey_init);
    if (!zkey_ok) return NULL;
    struct zctx *z = pthread_getspecific(zkey);
    if (!z) {
        if (!(z = calloc(1, sizeof *z))) return NULL;
        if (pthread_setspecific(zkey, z)) {
            free(z);
            return NULL;
        }
    }
    return z;
}

int kvt__ecq_encode(struct kvt__buf *out, const struct kvt__mat *m, const bool *raw_cell, int kind,
                    const struct kvt_codec_params *p, uint32_t M) {
    const uint32_t E = m->n_embd;
    const struct kvt__xshape xs = kvt__x_shape(kind, M, E, p);
    const uint32_t R = xs.R, L = xs.L, G = xs.G;
    const size_t ne = xs.ne, n_groups = xs.n_groups;
    float *x = NULL, *esc = NULL;
    uint8_t *codes = NULL, *frame = NULL, *prm = NULL;
    if (ne > UINT32_MAX / 2) /* the frame's length is a u32 */
        return kvt__fail(KVT_EUNSUPPORTED, "codec ecq: a tensor of %u x %u elements (at most 2^31)", M, E);
    int rc = kvt__sec_x_encode(out, m, raw_cell, kind, M, &x);
    if (rc) return rc;
    const size_t cap = ZSTD_compressBound(ne);
    struct zctx *z = zctx_get();
    ZSTD_CCtx *own = NULL; /* a context of this call only, when the thread cannot keep one */
    codes = malloc(ne + 1);
    esc = malloc(sizeof *esc * (ne + 1));
    prm = malloc(4 * n_groups + 1);
    frame = malloc(cap + 1);
    if (z && !z->c) z->c = ZSTD_createCCtx();
    ZSTD_CCtx *cc = z && z->c ? z->c : (own = ZSTD_createCCtx());
    if (!codes || !esc || !prm || !frame || !cc || kvt__fault_check(KVT__FAULT_CODEC_ALLOC)) {
        rc = kvt__fail(KVT_ENOMEM, "codec ecq: %u x %u tensor", M, E);
        goto out;
    }
    const uint32_t n_esc = kvt__ecq_quant_rows(x, R, L, G, kind == KVT__SEC_K ? p->s_k : p->s_v, prm, codes, esc);
    const size_t zlen = ZSTD_compressCCtx(cc, frame, cap, codes, ne, ZSTD_LEVEL);
    if (ZSTD_isError(zlen)) {
        rc = kvt__fail(KVT_ENOMEM, "codec ecq: zstd: %s", ZSTD_getErrorName(zlen));
        goto out;
    }
    const size_t head = 4 * n_groups + 4 + 4 * (size_t) n_esc + 8;
    const size_t min = kvt__ecq_min_body(ne), pad = head + zlen < min ? min - head - zlen : 0;
    const uint32_t z32[2] = { (uint32_t) zlen, (uint32_t) pad };
    kvt__buf_put(out, prm, 4 * n_groups);
    kvt__buf_put(out, &n_esc, 4);
    kvt__buf_put(out, esc, 4 * (size_t) n_esc);
    kvt__buf_put(out, z32, 8);
    kvt__buf_put(out, frame, zlen);
    kvt__buf_zero(out, pad);
    if (out->err) rc = kvt__fail(KVT_ENOMEM, "codec ecq: output buffer");
out:
    ZSTD_freeCCtx(own);
    free(x);
    free(esc);
    free(codes);
    free(prm);
    free(frame);
    return rc;
}

int kvt__ecq_decode(const uint8_t *b, size_t n, const struct kvt__mat *m, const uint8_t *cbm, const uint8_t *rawv, uint32_t M,
                    int kind, const struct kvt_codec_params *p, const char *what) {
    const uint32_t E = m->n_embd;
    const struct kvt__xshape xs = kvt__x_shape(kind, M, E, p);
    const uint32_t R = xs.R, L = xs.L, G = xs.G;
    const size_t ne = xs.ne, n_groups = xs.n_groups;
    size_t at = 0;
#define TAKE(k, part)                                                                                                          \
    do {                                                                                                                       \
        if ((size_t) (k) > n - at)                                                                                             \
            return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq body of %zu bytes ends inside the %s (needs %zu more at byte %zu)", \
                             what, n, part, (size_t) (k), at);                                                                 \
    } while (0)
    if (n < kvt__ecq_min_body(ne))
        return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq body of %zu bytes is too short for %u x %u elements (at least %zu)", what, n,
                         R, L, kvt__ecq_min_body(ne));
    TAKE(4 * n_groups, "group parameters");
    const uint8_t *prm = b + at;
    at += 4 * n_groups;
    for (size_t gi = 0; gi < n_groups; gi++) { /* offsets finite, steps positive and finite (F16) */
        uint16_t ho, hs;
        memcpy(&ho, prm + 4 * gi, 2);
        memcpy(&hs, prm + 4 * gi + 2, 2);
        if ((ho & 0x7c00) == 0x7c00 || (hs & 0x7c00) == 0x7c00 || (hs & 0x8000) || !(hs & 0x7fff))
            return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq group %zu has offset 0x%04x step 0x%04x (F16: finite, step > 0)", what,
                             gi, ho, hs);
    }
    uint32_t n_esc;
    TAKE(4, "escape count");
    memcpy(&n_esc, b + at, 4);
    at += 4;
    if (n_esc > ne) return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq has %u escapes for %zu elements", what, n_esc, ne);
    TAKE(4 * (size_t) n_esc, "escaped elements");
    const uint8_t *escb = b + at;
    at += 4 * (size_t) n_esc;
    uint32_t z32[2];
    TAKE(8, "frame lengths");
    memcpy(z32, b + at, 8);
    at += 8;
    TAKE(z32[0], "zstd frame");
    const uint8_t *frame = b + at;
    at += z32[0];
    TAKE(z32[1], "padding");
    for (size_t i = 0; i < z32[1]; i++)
        if (b[at + i]) return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq padding byte %zu is 0x%02x (must be 0)", what, i, b[at + i]);
    at += z32[1];
#undef TAKE
    if (at != n) return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq body has %zu trailing bytes after %zu", what, n - at, at);
    /* exactly one zstd frame of the current format (not a legacy or skippable one, nothing after
    ** it) that says it holds one code per element */
    uint32_t magic = 0;
    if (z32[0] >= 4) memcpy(&magic, frame, 4);
    if (magic != ZSTD_MAGICNUMBER)
        return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq frame of %u bytes does not start with zstd's magic (0x%08x)", what, z32[0],
                         magic);
    const size_t fsize = ZSTD_findFrameCompressedSize(frame, z32[0]);
    if (ZSTD_isError(fsize) || fsize != z32[0])
        return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq frame of %u bytes %s", what, z32[0],
                         ZSTD_isError(fsize) ? ZSTD_getErrorName(fsize) : "holds more than one zstd frame");
    const unsigned long long fcs = ZSTD_getFrameContentSize(frame, z32[0]);
    if (fcs == ZSTD_CONTENTSIZE_ERROR || fcs == ZSTD_CONTENTSIZE_UNKNOWN)
        return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq zstd frame does not say its size", what);
    if (fcs != (unsigned long long) ne)
        return kvt__fail(KVT_ECORRUPT, "codec: %s: ecq zstd frame holds %llu bytes, the section has %zu elements", what, fcs, ne);
    struct zctx *z = zctx_get();
    ZSTD_DCtx *own = NULL; /* a context of this call only, when the thread cannot keep one */
    uint8_t *codes = malloc(ne + 1);
    float *x = malloc(sizeof *x * (ne + 1));
    int rc = 0;
    if (z && !z->d) z->d = ZSTD_createDCtx();
    ZSTD_DCtx *dc = z && z->d ? z->d : (own = ZSTD_createDCtx());
    if (!codes || !x || !dc || kvt__fault_check(KVT__FAULT_CODEC_ALLOC)) {
        rc = kvt__fail(KVT_ENOMEM, "codec ecq: %u x %u tensor", M, E);
        goto out;
    }
    const size_t got = ZSTD_decompressDCtx(dc, codes, ne, frame, z32[0]);
    if (ZSTD_isError(got) || got != ne) {
        rc = kvt__fail(KVT_ECORRUPT, "codec: %s: ecq zstd frame: %s", what, ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short");
        goto out;
    }
    const bool odd = memchr(codes, 253, ne) || memchr(codes, 254, ne); /* never written */
    if (odd) {
        rc = kvt__fail(KVT_ECORRUPT, "codec: %s: ecq codes outside 0..252 and 255", what);
        goto out;
    }
    kvt__ecq_dequant_rows(codes, prm, R, L, G, x);
    uint32_t e_i = 0; /* the escaped elements, in code order */
    for (const uint8_t *c = codes, *end = codes + ne; (c = memchr(c, 255, (size_t) (end - c))) != NULL; c++) {
        if (e_i == n_esc) {
            rc = kvt__fail(KVT_ECORRUPT, "codec: %s: ecq codes escape more than the %u elements stored", what, n_esc);
            goto out;
        }
        memcpy(&x[c - codes], escb + 4 * (size_t) e_i++, 4);
    }
    if (e_i != n_esc) {
        rc = kvt__fail(KVT_ECORRUPT, "codec: %s: ecq stores %u escaped elements, its codes use %u", what, n_esc, e_i);
        goto out;
    }
    rc = kvt__sec_x_decode(m, cbm, rawv, M, kind, x);
out:
    ZSTD_freeDCtx(own);
    free(codes);
    free(x);
    return rc;
}
