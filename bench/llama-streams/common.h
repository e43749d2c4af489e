/* common.h — helpers shared by the kv_unified=false experiments (header-only, C11).
** Blob parser/assembler for llama_state_seq_get_data bytes with n_stream >= 1 per part. */
#ifndef RS_COMMON_H
#define RS_COMMON_H
#include "llama.h"
#include "ggml.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct llama_context llama_context;
typedef struct llama_model llama_model;

static int g_show_log = 0; /* print INFO lines that mention these substrings */
static void rs_log(enum ggml_log_level level, const char *text, void *ud) {
    (void) ud;
    if (level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
        return;
    }
    if (g_show_log && (strstr(text, "n_ctx") || strstr(text, "KV cache, size") || strstr(text, "llama_kv_cache: size")))
        fprintf(stdout, "  [log] %s", text);
}

static llama_model *rs_model(const char *path) {
    setvbuf(stdout, NULL, _IONBF, 0);
    llama_log_set(rs_log, NULL);
    llama_backend_init();
    llama_model *m = llama_model_load_from_file(path, llama_model_default_params());
    if (!m) {
        fprintf(stderr, "cannot load %s\n", path);
        exit(1);
    }
    return m;
}

static struct llama_context_params rs_params(int n_ctx, int n_seq_max, int unified) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_seq_max = n_seq_max;
    cp.kv_unified = unified;
    cp.swa_full = false;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    cp.no_perf = true;
    return cp;
}

static int n_vocab_g;

/* decode toks at pos0.. for one sequence; copy last logits to out if out != NULL */
static int rs_decode(llama_context *ctx, int seq, const llama_token *toks, int n, int pos0, float *out) {
    for (int off = 0; off < n; off += 512) {
        int m = n - off < 512 ? n - off : 512;
        llama_batch b = llama_batch_init(m, 0, 1);
        for (int i = 0; i < m; i++) {
            b.token[i] = toks[off + i];
            b.pos[i] = pos0 + off + i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = seq;
            b.logits[i] = out && off + i == n - 1;
        }
        b.n_tokens = m;
        int rc = llama_decode(ctx, b);
        llama_batch_free(b);
        if (rc) return rc;
    }
    if (out) memcpy(out, llama_get_logits_ith(ctx, -1), sizeof(float) * n_vocab_g);
    return 0;
}

static double rs_maxdiff(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs(a[i] - b[i]);
        if (d > m) m = d;
    }
    return m;
}

static uint8_t *rs_save(llama_context *ctx, int seq, size_t *n) {
    *n = llama_state_seq_get_size(ctx, seq);
    uint8_t *b = malloc(*n ? *n : 1);
    size_t w = llama_state_seq_get_data(ctx, b, *n, seq);
    if (w != *n) printf("  !! get_data wrote %zu of %zu\n", w, *n);
    return b;
}

/* ---------------- blob parsing ---------------- */
#define RS_MAXL 64
#define RS_MAXS 16
struct rs_rec {    /* one stream record with cells */
    uint32_t slot; /* stream index in the blob */
    uint32_t nc;
    const uint8_t *cells; /* nc x {i32 pos; u32 n_seq_id(=1); i32 seq} (no ext for these models) */
    uint32_t v_trans, n_layer;
    int32_t k_type[RS_MAXL];
    uint64_t k_row[RS_MAXL];
    const uint8_t *k[RS_MAXL];
    int32_t v_type[RS_MAXL];
    uint64_t v_row[RS_MAXL];
    uint32_t v_el[RS_MAXL], v_ne[RS_MAXL];
    const uint8_t *v[RS_MAXL];
};
struct rs_part {
    uint32_t n_stream;
    uint32_t counts[RS_MAXS];
    int n_rec;
    struct rs_rec rec[RS_MAXS];
};
struct rs_blob {
    uint32_t magic;
    int32_t seq;
    int n_parts;
    struct rs_part part[2];
    size_t used;
};

#define RS_RD(T, v)           \
    T v;                      \
    memcpy(&v, p, sizeof(T)); \
    p += sizeof(T)
static int rs_parse(const uint8_t *buf, size_t n, int n_parts, struct rs_blob *B) {
    const uint8_t *p = buf;
    memset(B, 0, sizeof *B);
    RS_RD(uint32_t, magic);
    RS_RD(int32_t, seq);
    B->magic = magic;
    B->seq = seq;
    B->n_parts = n_parts;
    for (int pt = 0; pt < n_parts; pt++) {
        struct rs_part *P = &B->part[pt];
        RS_RD(uint32_t, ns);
        P->n_stream = ns;
        if (ns > RS_MAXS) return -1;
        for (uint32_t s = 0; s < ns; s++) {
            RS_RD(uint32_t, nc);
            P->counts[s] = nc;
            if (!nc) continue;
            struct rs_rec *R = &P->rec[P->n_rec++];
            R->slot = s;
            R->nc = nc;
            R->cells = p;
            for (uint32_t c = 0; c < nc; c++) {
                RS_RD(int32_t, pos);
                RS_RD(uint32_t, nsid);
                (void) pos;
                p += 4 * nsid;
            }
            RS_RD(uint32_t, vt);
            RS_RD(uint32_t, nl);
            R->v_trans = vt;
            R->n_layer = nl;
            for (uint32_t l = 0; l < nl; l++) {
                RS_RD(int32_t, kt);
                RS_RD(uint64_t, kr);
                R->k_type[l] = kt;
                R->k_row[l] = kr;
                R->k[l] = p;
                p += kr * nc;
            }
            for (uint32_t l = 0; l < nl; l++) {
                RS_RD(int32_t, vty);
                R->v_type[l] = vty;
                if (!vt) {
                    RS_RD(uint64_t, vr);
                    R->v_row[l] = vr;
                    R->v[l] = p;
                    p += vr * nc;
                } else {
                    RS_RD(uint32_t, el);
                    RS_RD(uint32_t, ne);
                    R->v_el[l] = el;
                    R->v_ne[l] = ne;
                    R->v[l] = p;
                    p += (size_t) el * ne * nc;
                }
            }
        }
    }
    B->used = (size_t) (p - buf);
    return B->used == n ? 0 : -2;
}
static int32_t rs_pos(const struct rs_rec *R, uint32_t c) {
    int32_t v;
    memcpy(&v, R->cells + 12 * c, 4);
    return v;
}

static void rs_describe(const char *tag, const uint8_t *buf, size_t n, int n_parts) {
    struct rs_blob B;
    int rc = rs_parse(buf, n, n_parts, &B);
    printf("  %s: %zu bytes, magic=0x%08x src_seq=%d, parse=%s\n", tag, n, B.magic, B.seq,
           rc == 0 ? "OK (consumed all)" : "MISMATCH");
    for (int pt = 0; pt < n_parts; pt++) {
        struct rs_part *P = &B.part[pt];
        printf("    part %d: n_stream=%u counts=[", pt, P->n_stream);
        for (uint32_t s = 0; s < P->n_stream; s++) printf("%s%u", s ? "," : "", P->counts[s]);
        printf("]");
        for (int r = 0; r < P->n_rec; r++) {
            struct rs_rec *R = &P->rec[r];
            int32_t sid;
            memcpy(&sid, R->cells + 8, 4);
            printf(" | slot %u: %u cells pos %d..%d (seq_id %d) v_trans=%u n_layer=%u k_row=%llu", R->slot, R->nc, rs_pos(R, 0),
                   rs_pos(R, R->nc - 1), sid, R->v_trans, R->n_layer, (unsigned long long) R->k_row[0]);
        }
        printf("\n");
    }
}

/* ---------------- assembly ---------------- */
struct rs_w {
    uint8_t *b;
    size_t n, cap;
};
static void rs_put(struct rs_w *w, const void *d, size_t k) {
    if (w->n + k > w->cap) {
        w->cap = (w->n + k) * 2;
        w->b = realloc(w->b, w->cap);
    }
    memcpy(w->b + w->n, d, k);
    w->n += k;
}
#define RS_PUT(w, T, v)              \
    do {                             \
        T v_ = (v);                  \
        rs_put((w), &v_, sizeof v_); \
    } while (0)

/* one input piece: record R, cells [c0,c1), positions shifted by delta, K re-rotated by delta */
struct rs_piece {
    const struct rs_rec *R;
    uint32_t c0, c1;
    int32_t delta;
};

struct rs_rope {
    int neox;
    int n_rot;
    float base[2];
}; /* base per part */

static void rs_rotate(float *x, int n_rot, int neox, float base, int32_t delta) {
    for (int i = 0; i < n_rot / 2; i++) {
        double th = delta * pow(base, -2.0 * i / n_rot), c = cos(th), s = sin(th);
        int a = neox ? i : 2 * i, b = neox ? i + n_rot / 2 : 2 * i + 1;
        double x0 = x[a], x1 = x[b];
        x[a] = (float) (x0 * c - x1 * s);
        x[b] = (float) (x0 * s + x1 * c);
    }
}

/* Build a blob: per part, n_stream slots, one record placed at out_slot with the pieces of that part.
** K must be F32 for delta != 0; head_dim = hd. */
static uint8_t *rs_assemble(int n_parts, uint32_t n_stream, uint32_t out_slot, int32_t seq, struct rs_piece *const pieces[2],
                            const int n_pieces[2], const struct rs_rope *rope, int hd, size_t *out_n) {
    struct rs_w w = { 0 };
    RS_PUT(&w, uint32_t, 0xaf143cd8u);
    RS_PUT(&w, int32_t, seq);
    for (int pt = 0; pt < n_parts; pt++) {
        RS_PUT(&w, uint32_t, n_stream);
        uint32_t nc = 0;
        for (int i = 0; i < n_pieces[pt]; i++) nc += pieces[pt][i].c1 - pieces[pt][i].c0;
        for (uint32_t s = 0; s < n_stream; s++) {
            RS_PUT(&w, uint32_t, s == out_slot ? nc : 0);
            if (s != out_slot || nc == 0) continue;
            for (int i = 0; i < n_pieces[pt]; i++) {
                const struct rs_piece *q = &pieces[pt][i];
                for (uint32_t c = q->c0; c < q->c1; c++) {
                    RS_PUT(&w, int32_t, rs_pos(q->R, c) + q->delta);
                    RS_PUT(&w, uint32_t, 1);
                    RS_PUT(&w, int32_t, seq);
                }
            }
            const struct rs_rec *R0 = pieces[pt][0].R;
            RS_PUT(&w, uint32_t, R0->v_trans);
            RS_PUT(&w, uint32_t, R0->n_layer);
            for (uint32_t l = 0; l < R0->n_layer; l++) {
                RS_PUT(&w, int32_t, R0->k_type[l]);
                RS_PUT(&w, uint64_t, R0->k_row[l]);
                for (int i = 0; i < n_pieces[pt]; i++) {
                    const struct rs_piece *q = &pieces[pt][i];
                    for (uint32_t c = q->c0; c < q->c1; c++) {
                        size_t at = w.n;
                        rs_put(&w, q->R->k[l] + c * q->R->k_row[l], q->R->k_row[l]);
                        if (q->delta && rope) {
                            float *row = (float *) (w.b + at);
                            int nh = (int) (q->R->k_row[l] / 4 / hd);
                            for (int h = 0; h < nh; h++) rs_rotate(row + h * hd, rope->n_rot, rope->neox, rope->base[pt], q->delta);
                        }
                    }
                }
            }
            for (uint32_t l = 0; l < R0->n_layer; l++) {
                RS_PUT(&w, int32_t, R0->v_type[l]);
                if (!R0->v_trans) {
                    RS_PUT(&w, uint64_t, R0->v_row[l]);
                    for (int i = 0; i < n_pieces[pt]; i++) {
                        const struct rs_piece *q = &pieces[pt][i];
                        rs_put(&w, q->R->v[l] + q->c0 * q->R->v_row[l], (q->c1 - q->c0) * q->R->v_row[l]);
                    }
                } else {
                    RS_PUT(&w, uint32_t, R0->v_el[l]);
                    RS_PUT(&w, uint32_t, R0->v_ne[l]);
                    for (uint32_t j = 0; j < R0->v_ne[l]; j++)
                        for (int i = 0; i < n_pieces[pt]; i++) {
                            const struct rs_piece *q = &pieces[pt][i];
                            uint32_t el = q->R->v_el[l];
                            rs_put(&w, q->R->v[l] + ((size_t) j * q->R->nc + q->c0) * el, (size_t) (q->c1 - q->c0) * el);
                        }
                }
            }
        }
    }
    *out_n = w.n;
    return w.b;
}

/* cell range [c0,c1) of record R whose positions are in [p0,p1) (cells are in cell order; for a
** sequence written into an empty stream this is position order) */
static void rs_range(const struct rs_rec *R, int32_t p0, int32_t p1, uint32_t *c0, uint32_t *c1) {
    *c0 = R->nc;
    *c1 = 0;
    for (uint32_t c = 0; c < R->nc; c++) {
        int32_t p = rs_pos(R, c);
        if (p >= p0 && p < p1) {
            if (c < *c0) *c0 = c;
            if (c + 1 > *c1) *c1 = c + 1;
        }
    }
    if (*c1 < *c0) *c0 = *c1 = 0;
}

static double rs_ms(struct timespec a, struct timespec b) { return (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6; }
#endif
