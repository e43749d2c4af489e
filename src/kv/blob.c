/* blob.c — parse llama.cpp sequence-state bytes; re-anchor saved K by RoPE on the host.
**
** Re-anchoring: RoPE rotates each pair of K dims by an angle proportional to the position, so
** K computed at p and rotated by delta equals K computed at p + delta (angles add).  Rotating
** the saved rows on the host moves a block to a new position without a forward pass and
** without llama.cpp's lazy whole-cache K-shift (EVOKE; "KV splice").  src/engine/engine.c checks these
** rotations against llama.cpp's own RoPE when it opens a model. */
#include "kv/blob.h"
#include "internal.h"

#include "ggml.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct rd {
    const uint8_t *buf;
    size_t n, off;
};

static int rd_bytes(struct rd *r, void *dst, size_t k, const char *what) {
    if (k > r->n - r->off)
        return kvt__fail(KVT_EFORMAT, "KV block truncated: %s at byte %zu needs %zu bytes, %zu left", what, r->off, k,
                         r->n - r->off);
    if (dst) memcpy(dst, r->buf + r->off, k);
    r->off += k;
    return 0;
}

#define RD(r, v, what)                                    \
    do {                                                  \
        int rc_ = rd_bytes((r), &(v), sizeof(v), (what)); \
        if (rc_) return rc_;                              \
    } while (0)

static int skip(struct rd *r, uint64_t k, const char *what) {
    if (k > r->n - r->off)
        return kvt__fail(KVT_EFORMAT, "KV block truncated: %s at byte %zu needs %llu bytes, %zu left", what, r->off,
                         (unsigned long long) k, r->n - r->off);
    r->off += (size_t) k;
    return 0;
}

/* A type ggml knows (not one of its removed ids, whose sizes are 0) and a row of whole elements
** (blocks, for a quantised type) of it. */
static bool type_ok(int32_t t, uint64_t row_bytes) {
    if (t < 0 || t >= GGML_TYPE_COUNT) return false;
    const size_t ts = ggml_type_size((enum ggml_type) t);
    return ts > 0 && ggml_blck_size((enum ggml_type) t) > 0 && row_bytes % ts == 0;
}

/* One non-empty stream record: cells, then K and V of every layer. */
static int parse_record(struct rd *r, struct kvt__blob_part *P) {
    P->cells_off = r->off;
    P->cells_fixed = true;
    for (uint32_t c = 0; c < P->n_cells; c++) {
        int32_t pos = 0;
        uint32_t n_seq_id = 0;
        RD(r, pos, "cell pos");
        if (pos < 0 || pos >= KVT__MAX_POS)
            return kvt__fail(KVT_EFORMAT, "KV block cell %u at byte %zu has position %d (0..%d expected)", c, r->off - 4, pos,
                             KVT__MAX_POS - 1);
        RD(r, n_seq_id, "cell n_seq_id");
        if (n_seq_id > 64) return kvt__fail(KVT_EFORMAT, "KV block cell %u has %u seq ids", c, n_seq_id);
        P->cells_fixed &= n_seq_id == 1;
        int rc = skip(r, (uint64_t) n_seq_id * 4, "cell seq ids");
        if (rc) return rc;
    }
    RD(r, P->v_trans, "v_trans");
    RD(r, P->n_layer, "n_layer");
    if (P->n_layer == 0 || P->n_layer > KVT__MAX_LAYERS)
        return kvt__fail(KVT_EFORMAT, "KV block part has %u layers (1..%d expected)", P->n_layer, KVT__MAX_LAYERS);
    for (uint32_t l = 0; l < P->n_layer; l++) {
        RD(r, P->k_type[l], "k type");
        RD(r, P->k_row_bytes[l], "k row bytes");
        if (P->k_row_bytes[l] == 0 || P->k_row_bytes[l] > (1u << 24) || !type_ok(P->k_type[l], P->k_row_bytes[l]))
            return kvt__fail(KVT_EFORMAT, "KV block layer %u: bad K type %d / row bytes %llu", l, P->k_type[l],
                             (unsigned long long) P->k_row_bytes[l]);
        P->k_off[l] = r->off;
        int rc = skip(r, P->k_row_bytes[l] * P->n_cells, "K rows");
        if (rc) return rc;
    }
    size_t v0 = r->off;
    for (uint32_t l = 0; l < P->n_layer; l++) {
        RD(r, P->v_type[l], "v type");
        int rc;
        if (!P->v_trans) {
            RD(r, P->v_row_bytes[l], "v row bytes");
            if (P->v_row_bytes[l] > (1u << 24) || !type_ok(P->v_type[l], P->v_row_bytes[l]))
                return kvt__fail(KVT_EFORMAT, "KV block layer %u: bad V type %d / row bytes %llu", l, P->v_type[l],
                                 (unsigned long long) P->v_row_bytes[l]);
            P->v_n_embd[l] = 0;
            P->v_off[l] = r->off;
            rc = skip(r, P->v_row_bytes[l] * P->n_cells, "V rows");
        } else {
            uint32_t el = 0, ne = 0;
            RD(r, el, "v elem size");
            RD(r, ne, "n_embd_v");
            if (el == 0 || el > 64 || ne > (1u << 20) || !type_ok(P->v_type[l], el) ||
                el != ggml_type_size((enum ggml_type) P->v_type[l]))
                return kvt__fail(KVT_EFORMAT, "KV block layer %u: transposed V of %u elements of %u bytes, type %d", l, ne, el,
                                 P->v_type[l]);
            P->v_row_bytes[l] = el;
            P->v_n_embd[l] = ne;
            P->v_off[l] = r->off;
            rc = skip(r, (uint64_t) el * ne * P->n_cells, "V (transposed)");
        }
        if (rc) return rc;
    }
    P->v_bytes = r->off - v0;
    return 0;
}

static int parse_part(struct rd *r, struct kvt__blob_part *P) {
    uint32_t n_stream = 0;
    RD(r, n_stream, "n_stream");
    if (n_stream < 1 || n_stream > KVT__MAX_STREAMS)
        return kvt__fail(KVT_EFORMAT, "KV block part has %u streams (1..%d expected)", n_stream, KVT__MAX_STREAMS);
    P->n_stream = n_stream;
    P->slot = 0;
    P->n_cells = 0;
    P->cells_off = r->off;
    P->cells_fixed = true;
    P->n_layer = 0;
    P->v_trans = 0;
    P->v_bytes = 0;
    bool seen = false;
    for (uint32_t s = 0; s < n_stream; s++) {
        uint32_t nc = 0;
        RD(r, nc, "cell_count");
        if (nc == 0) continue;
        if (seen) /* llama.cpp would load each record over the previous one: only the last survives */
            return kvt__fail(KVT_EFORMAT, "KV block part has cells in streams %u and %u (one sequence's state has one)", P->slot,
                             s);
        seen = true;
        P->slot = s;
        P->n_cells = nc;
        int rc = parse_record(r, P);
        if (rc) return rc;
    }
    return 0;
}

int kvt__blob_parse(const uint8_t *buf, size_t n, int n_parts, struct kvt__blob_layout *out) {
    struct rd r = { buf, n, 0 };
    uint32_t magic = 0;
    int32_t seq = 0;
    if (!buf) return kvt__fail(KVT_EFORMAT, "KV block is empty");
    RD(&r, magic, "magic");
    RD(&r, seq, "seq id");
    if (magic != KVT__BLOB_MAGIC)
        return kvt__fail(KVT_EFORMAT, "KV block magic is 0x%08x, expected 0x%08x", magic, KVT__BLOB_MAGIC);
    if (n_parts < 1 || n_parts > 2) return kvt__fail(KVT_EINVAL, "n_parts %d", n_parts);
    out->n_parts = n_parts;
    for (int p = 0; p < n_parts; p++) {
        int rc = parse_part(&r, &out->part[p]);
        if (rc) return rc;
    }
    out->end = r.off;
    if (r.off != n)
        return kvt__fail(KVT_EFORMAT, "KV block has %zu trailing bytes after %d parts (%zu of %zu used)", n - r.off, n_parts, r.off,
                         n);
    return 0;
}

/* Cell records can have several seq ids, so cell c is found by walking. */
static size_t cell_off(const uint8_t *buf, const struct kvt__blob_part *P, uint32_t c) {
    if (P->cells_fixed) return P->cells_off + (size_t) c * 12;
    size_t off = P->cells_off;
    for (uint32_t i = 0; i < c; i++) {
        uint32_t nsid;
        memcpy(&nsid, buf + off + 4, 4);
        off += 8 + (size_t) nsid * 4;
    }
    return off;
}

int32_t kvt__blob_cell_pos(const uint8_t *buf, const struct kvt__blob_layout *L, int p, uint32_t c) {
    int32_t pos;
    memcpy(&pos, buf + cell_off(buf, &L->part[p], c), 4);
    return pos;
}

void kvt__blob_positions(const uint8_t *buf, const struct kvt__blob_layout *L, int p, int32_t *pos) {
    const struct kvt__blob_part *P = &L->part[p];
    size_t off = P->cells_off;
    for (uint32_t c = 0; c < P->n_cells; c++) {
        uint32_t nsid;
        memcpy(&pos[c], buf + off, 4);
        memcpy(&nsid, buf + off + 4, 4);
        off += 8 + (size_t) nsid * 4;
    }
}

/* ---- writer ---- */

struct selection {
    uint32_t *idx; /* cell indices of the source part, in cell order */
    int32_t *pos;  /* their positions, delta applied */
    uint32_t n;
};

/* pos moved by delta, if that stays in [0, KVT__MAX_POS). */
static bool move_pos(int32_t pos, int32_t delta, int32_t *out) {
    const int64_t q = (int64_t) pos + delta;
    if (q < 0 || q >= KVT__MAX_POS) return false;
    *out = (int32_t) q;
    return true;
}

static int select_cells(const struct kvt__blob_src *S, int p, struct selection *out) {
    const struct kvt__blob_part *P = &S->L->part[p];
    out->idx = NULL;
    out->pos = NULL;
    out->n = 0;
    if (P->n_cells == 0) return 0;
    out->idx = malloc(sizeof(uint32_t) * P->n_cells);
    out->pos = malloc(sizeof(int32_t) * P->n_cells);
    if (!out->idx || !out->pos) return kvt__fail(KVT_ENOMEM, "selection of %u cells", P->n_cells);
    size_t off = P->cells_off;
    for (uint32_t c = 0; c < P->n_cells; c++) {
        int32_t pos;
        uint32_t nsid;
        memcpy(&pos, S->buf + off, 4);
        memcpy(&nsid, S->buf + off + 4, 4);
        off += 8 + (size_t) nsid * 4;
        if (pos >= S->lo[p] && pos < S->hi[p]) {
            if (!move_pos(pos, S->delta, &out->pos[out->n]))
                return kvt__fail(KVT_EFORMAT, "KV block cell %u: position %d moved by %d leaves 0..%d", c, pos, S->delta,
                                 KVT__MAX_POS - 1);
            out->idx[out->n++] = c;
        }
    }
    return 0;
}

/* Same layers, types and row sizes: cells of both can share one record. */
static int same_layout(const struct kvt__blob_part *A, const struct kvt__blob_part *B, int p) {
    if (A->v_trans != B->v_trans || A->n_layer != B->n_layer)
        return kvt__fail(KVT_EFORMAT,
                         "KV blocks of another cache layout: part %d has v_trans %u and %u layers, "
                         "the other %u and %u",
                         p, B->v_trans, B->n_layer, A->v_trans, A->n_layer);
    for (uint32_t l = 0; l < A->n_layer; l++)
        if (A->k_type[l] != B->k_type[l] || A->k_row_bytes[l] != B->k_row_bytes[l] || A->v_type[l] != B->v_type[l] ||
            A->v_row_bytes[l] != B->v_row_bytes[l] || A->v_n_embd[l] != B->v_n_embd[l])
            return kvt__fail(KVT_EFORMAT,
                             "KV blocks of another cache layout: part %d layer %u has K type %d (%llu-byte rows), "
                             "V type %d, the other K type %d (%llu-byte rows), V type %d",
                             p, l, B->k_type[l], (unsigned long long) B->k_row_bytes[l], B->v_type[l], A->k_type[l],
                             (unsigned long long) A->k_row_bytes[l], A->v_type[l]);
    return 0;
}

struct wr {
    uint8_t *b;
    size_t off;
};

static void put(struct wr *w, const void *d, size_t k) {
    memcpy(w->b + w->off, d, k);
    w->off += k;
}

#define PUT(w, T, v)              \
    do {                          \
        T v_ = (T) (v);           \
        put((w), &v_, sizeof v_); \
    } while (0)

/* Copy the selected cells' pieces of size `el` from base (piece of cell c at base + c * el),
** in runs of consecutive cells. */
static void put_runs(struct wr *w, const uint8_t *base, const struct selection *S, size_t el) {
    for (uint32_t i = 0; i < S->n;) {
        uint32_t j = i + 1;
        while (j < S->n && S->idx[j] == S->idx[j - 1] + 1) j++;
        put(w, base + (size_t) S->idx[i] * el, (size_t) (j - i) * el);
        i = j;
    }
}

enum { MAX_SRC = 1 << 16 }; /* a prefix load passes one source per block */

int kvt__blob_write(const struct kvt__blob_src *src, int n_src, int n_parts, uint32_t n_stream, uint32_t slot, int32_t seq,
                    uint8_t **out, size_t *n) {
    *out = NULL;
    *n = 0;
    if (n_parts < 1 || n_parts > 2 || n_src < 0 || n_src > MAX_SRC || n_stream < 1 || n_stream > KVT__MAX_STREAMS ||
        slot >= n_stream)
        return kvt__fail(KVT_EINVAL, "KV block writer: %d parts, %d sources, stream %u of %u", n_parts, n_src, slot, n_stream);
    for (int i = 0; i < n_src; i++)
        if (src[i].L->n_parts != n_parts)
            return kvt__fail(KVT_EFORMAT, "KV block source %d has %d parts, the cache %d", i, src[i].L->n_parts, n_parts);
    struct selection(*sel)[2] = calloc((size_t) (n_src > 0 ? n_src : 1), sizeof *sel);
    if (!sel) return kvt__fail(KVT_ENOMEM, "KV block writer: %d sources", n_src);
    const struct kvt__blob_part *ref[2] = { NULL, NULL };
    uint32_t tot[2] = { 0, 0 };
    int rc = 0;
    size_t size = 8;
    for (int p = 0; p < n_parts && rc == 0; p++) {
        for (int i = 0; i < n_src && rc == 0; i++) {
            const struct kvt__blob_part *P = &src[i].L->part[p];
            if (P->n_cells == 0) continue;
            if (!ref[p]) ref[p] = P;
            else if ((rc = same_layout(ref[p], P, p))) break;
            if ((rc = select_cells(&src[i], p, &sel[i][p]))) break;
            tot[p] += sel[i][p].n;
        }
        size += 4 + 4 * (size_t) n_stream;
        if (rc || tot[p] == 0) continue;
        const struct kvt__blob_part *R = ref[p];
        size += (size_t) tot[p] * 12 + 8;
        for (uint32_t l = 0; l < R->n_layer; l++) {
            size += 12 + (size_t) tot[p] * R->k_row_bytes[l];
            size += R->v_trans ? 12 + (size_t) tot[p] * R->v_row_bytes[l] * R->v_n_embd[l]
                               : 12 + (size_t) tot[p] * R->v_row_bytes[l];
        }
    }
    uint8_t *b = rc ? NULL : malloc(size);
    if (!rc && !b) rc = kvt__fail(KVT_ENOMEM, "KV block of %zu bytes", size);
    if (rc) goto done;
    struct wr w = { b, 0 };
    PUT(&w, uint32_t, KVT__BLOB_MAGIC);
    PUT(&w, int32_t, seq);
    for (int p = 0; p < n_parts; p++) {
        PUT(&w, uint32_t, n_stream);
        for (uint32_t s = 0; s < n_stream; s++) {
            if (s != slot || tot[p] == 0) {
                PUT(&w, uint32_t, 0);
                continue;
            }
            const struct kvt__blob_part *R = ref[p];
            PUT(&w, uint32_t, tot[p]);
            for (int i = 0; i < n_src; i++)
                for (uint32_t c = 0; c < sel[i][p].n; c++) {
                    PUT(&w, int32_t, sel[i][p].pos[c]);
                    PUT(&w, uint32_t, 1);
                    PUT(&w, int32_t, seq);
                }
            PUT(&w, uint32_t, R->v_trans);
            PUT(&w, uint32_t, R->n_layer);
            for (uint32_t l = 0; l < R->n_layer; l++) {
                PUT(&w, int32_t, R->k_type[l]);
                PUT(&w, uint64_t, R->k_row_bytes[l]);
                for (int i = 0; i < n_src; i++)
                    if (sel[i][p].n) put_runs(&w, src[i].buf + src[i].L->part[p].k_off[l], &sel[i][p], R->k_row_bytes[l]);
            }
            for (uint32_t l = 0; l < R->n_layer; l++) {
                PUT(&w, int32_t, R->v_type[l]);
                if (!R->v_trans) {
                    PUT(&w, uint64_t, R->v_row_bytes[l]);
                    for (int i = 0; i < n_src; i++)
                        if (sel[i][p].n) put_runs(&w, src[i].buf + src[i].L->part[p].v_off[l], &sel[i][p], R->v_row_bytes[l]);
                } else {
                    /* transposed: n_embd_v rows of one element per cell */
                    const size_t el = R->v_row_bytes[l];
                    PUT(&w, uint32_t, el);
                    PUT(&w, uint32_t, R->v_n_embd[l]);
                    for (uint32_t j = 0; j < R->v_n_embd[l]; j++)
                        for (int i = 0; i < n_src; i++)
                            if (sel[i][p].n) {
                                const struct kvt__blob_part *P = &src[i].L->part[p];
                                put_runs(&w, src[i].buf + P->v_off[l] + (size_t) j * P->n_cells * el, &sel[i][p], el);
                            }
                }
            }
        }
    }
    if (w.off != size) {
        free(b);
        rc = kvt__fail(KVT_EFORMAT, "KV block writer: wrote %zu of %zu bytes", w.off, size);
        goto done;
    }
    *out = b;
    *n = size;
done:
    for (int i = 0; i < n_src; i++)
        for (int p = 0; p < 2; p++) {
            free(sel[i][p].idx);
            free(sel[i][p].pos);
        }
    free(sel);
    return rc;
}

void kvt__rope_table(const struct kvt__rope *r, int32_t delta, float *cs) {
    const int half = r->n_rot / 2;
    for (int i = 0; i < half; i++) {
        double theta = (double) delta * r->scale * pow((double) r->base, -2.0 * i / r->n_rot);
        cs[2 * i] = (float) cos(theta);
        cs[2 * i + 1] = (float) sin(theta);
    }
}

void kvt__rope_apply(float *x, const struct kvt__rope *r, const float *cs) {
    const int half = r->n_rot / 2;
    if (r->neox) {
        for (int i = 0; i < half; i++) {
            float x0 = x[i], x1 = x[i + half], c = cs[2 * i], s = cs[2 * i + 1];
            x[i] = x0 * c - x1 * s;
            x[i + half] = x0 * s + x1 * c;
        }
    } else {
        for (int i = 0; i < half; i++) {
            float x0 = x[2 * i], x1 = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
            x[2 * i] = x0 * c - x1 * s;
            x[2 * i + 1] = x0 * s + x1 * c;
        }
    }
}

void kvt__rope_rotate_f32(float *x, const struct kvt__rope *r, int32_t delta) {
    const int half = r->n_rot / 2;
    for (int i = 0; i < half; i++) {
        double theta = (double) delta * r->scale * pow((double) r->base, -2.0 * i / r->n_rot);
        double c = cos(theta), s = sin(theta);
        int a = r->neox ? i : 2 * i;
        int b = r->neox ? i + half : 2 * i + 1;
        double x0 = x[a], x1 = x[b];
        x[a] = (float) (x0 * c - x1 * s);
        x[b] = (float) (x0 * s + x1 * c);
    }
}

static int k_row_elems(const struct kvt__blob_part *P, int il, int32_t *row_elems) {
    enum ggml_type t = (enum ggml_type) P->k_type[il];
    if (t != GGML_TYPE_F32 && t != GGML_TYPE_F16)
        return kvt__fail(KVT_EUNSUPPORTED, "K cache type %s cannot be rotated on the host (F32/F16 only)", ggml_type_name(t));
    *row_elems = (int32_t) (P->k_row_bytes[il] / ggml_type_size(t));
    return 0;
}

int kvt__blob_reanchor_range(uint8_t *buf, const struct kvt__blob_layout *L, int32_t delta, int32_t lo, int32_t hi, int n_head_kv,
                             struct kvt__rope *const rope[2]) {
    /* check everything first, so that nothing is modified on error */
    for (int p = 0; p < L->n_parts && delta != 0; p++) {
        const struct kvt__blob_part *P = &L->part[p];
        if (P->n_cells == 0) continue;
        if (!rope[p]) return kvt__fail(KVT_EUNSUPPORTED, "no verified RoPE for part %d", p);
        for (uint32_t il = 0; il < P->n_layer; il++) {
            int32_t ne = 0;
            int rc = k_row_elems(P, (int) il, &ne);
            if (rc) return rc;
            if (ne % n_head_kv) return kvt__fail(KVT_EFORMAT, "K row of %d elems for %d KV heads", ne, n_head_kv);
            const int hd = ne / n_head_kv;
            if (rope[p][il].n_rot > hd) return kvt__fail(KVT_EFORMAT, "n_rot %d > head_dim %d", rope[p][il].n_rot, hd);
            if (hd > 4096) return kvt__fail(KVT_EUNSUPPORTED, "head_dim %d > 4096", hd);
        }
    }
    for (int p = 0; p < L->n_parts; p++) { /* every moved position stays a position */
        const struct kvt__blob_part *P = &L->part[p];
        size_t off = P->cells_off;
        for (uint32_t c = 0; c < P->n_cells; c++) {
            int32_t pos, moved;
            uint32_t nsid;
            memcpy(&pos, buf + off, 4);
            memcpy(&nsid, buf + off + 4, 4);
            off += 8 + (size_t) nsid * 4;
            if (pos >= lo && pos < hi && !move_pos(pos, delta, &moved))
                return kvt__fail(KVT_EFORMAT, "re-anchoring: part %d cell %u at position %d moved by %d leaves 0..%d", p, c, pos,
                                 delta, KVT__MAX_POS - 1);
        }
    }
    for (int p = 0; p < L->n_parts; p++) {
        const struct kvt__blob_part *P = &L->part[p];
        if (P->n_cells == 0) continue;
        uint8_t *hit = malloc(P->n_cells);
        if (!hit) return kvt__fail(KVT_ENOMEM, "re-anchoring %u cells", P->n_cells);
        size_t off = P->cells_off;
        for (uint32_t c = 0; c < P->n_cells; c++) {
            int32_t pos;
            uint32_t nsid;
            memcpy(&pos, buf + off, 4);
            memcpy(&nsid, buf + off + 4, 4);
            hit[c] = pos >= lo && pos < hi;
            if (hit[c]) {
                pos += delta;
                memcpy(buf + off, &pos, 4);
            }
            off += 8 + (size_t) nsid * 4;
        }
        for (uint32_t il = 0; il < P->n_layer && delta != 0; il++) {
            int32_t ne = 0;
            k_row_elems(P, (int) il, &ne);
            const int hd = ne / n_head_kv;
            const struct kvt__rope *r = &rope[p][il];
            float tmp[4096], cs[4096];
            kvt__rope_table(r, delta, cs);                            /* one table per layer: the angles depend only on delta */
            const size_t es = P->k_type[il] == GGML_TYPE_F32 ? 4 : 2; /* rows are whole elements apart */
            const bool aligned = (uintptr_t) (buf + P->k_off[il]) % es == 0;
            for (uint32_t c = 0; c < P->n_cells; c++) {
                if (!hit[c]) continue;
                uint8_t *row = buf + P->k_off[il] + (size_t) c * P->k_row_bytes[il];
                for (int h = 0; h < n_head_kv; h++) {
                    if (P->k_type[il] == GGML_TYPE_F32 && aligned) {
                        kvt__rope_apply((float *) (void *) row + (size_t) h * hd, r, cs);
                    } else if (P->k_type[il] == GGML_TYPE_F32) { /* rows where the bytes put them: copied */
                        uint8_t *x = row + (size_t) h * hd * 4;
                        memcpy(tmp, x, (size_t) r->n_rot * 4);
                        kvt__rope_apply(tmp, r, cs);
                        memcpy(x, tmp, (size_t) r->n_rot * 4);
                    } else if (!aligned) {
                        uint8_t *x = row + (size_t) h * hd * 2;
                        for (int i = 0; i < r->n_rot; i++) {
                            ggml_fp16_t v;
                            memcpy(&v, x + 2 * i, 2);
                            tmp[i] = ggml_fp16_to_fp32(v);
                        }
                        kvt__rope_apply(tmp, r, cs);
                        for (int i = 0; i < r->n_rot; i++) {
                            ggml_fp16_t v = ggml_fp32_to_fp16(tmp[i]);
                            memcpy(x + 2 * i, &v, 2);
                        }
                    } else {
                        ggml_fp16_t *x = (ggml_fp16_t *) (void *) row + (size_t) h * hd;
                        ggml_fp16_to_fp32_row(x, tmp, r->n_rot);
                        kvt__rope_apply(tmp, r, cs);
                        ggml_fp32_to_fp16_row(tmp, x, r->n_rot);
                    }
                }
            }
        }
        free(hit);
    }
    return 0;
}

int kvt__blob_reanchor(uint8_t *buf, const struct kvt__blob_layout *L, int32_t delta, int n_head_kv,
                       struct kvt__rope *const rope[2]) {
    return kvt__blob_reanchor_range(buf, L, delta, INT32_MIN, INT32_MAX, n_head_kv, rope);
}

int kvt__blob_k_f32(const uint8_t *buf, const struct kvt__blob_layout *L, int p, int il, float *out, int32_t *row_elems) {
    if (p < 0 || p >= L->n_parts) return kvt__fail(KVT_EINVAL, "KV block has no part %d", p);
    const struct kvt__blob_part *P = &L->part[p];
    if (P->n_cells == 0) {
        *row_elems = 0;
        return 0;
    }
    if (il < 0 || (uint32_t) il >= P->n_layer)
        return kvt__fail(KVT_EINVAL, "KV block part %d has no layer %d (%u layers)", p, il, P->n_layer);
    int rc = k_row_elems(P, il, row_elems);
    if (rc || !out) return rc;
    const uint8_t *k = buf + P->k_off[il];
    size_t n = (size_t) P->n_cells * (size_t) *row_elems;
    if (P->k_type[il] == GGML_TYPE_F32) {
        memcpy(out, k, n * sizeof(float));
    } else {
        for (size_t i = 0; i < n; i++) { /* memcpy: the rows may be misaligned (offsets come from the bytes) */
            ggml_fp16_t h;
            memcpy(&h, k + 2 * i, 2);
            out[i] = ggml_fp16_to_fp32(h);
        }
    }
    return 0;
}

/* kvt_blob is the blob's owner-facing handle (kvtier.h); it lives here, with the format, so the
** store frees blobs without depending on the engine. */
void kvt_blob_free(kvt_blob *b) {
    if (!b) return;
    free(b->data);
    free(b);
}

int kvt__blob_shape(kvt_blob *b) {
    struct kvt__blob_layout *L = malloc(sizeof *L);
    if (!L) return kvt__fail(KVT_ENOMEM, "blob layout");
    int rc = kvt__blob_parse(b->data, b->size, 1, L);
    if (rc) rc = kvt__blob_parse(b->data, b->size, 2, L);
    if (rc == 0 && L->part[0].n_cells > 0) {
        b->n_cells = (int32_t) L->part[0].n_cells;
        b->n_cells_swa = L->n_parts > 1 ? (int32_t) L->part[1].n_cells : 0;
        kvt_pos p0 = INT32_MAX;
        for (uint32_t c = 0; c < L->part[0].n_cells; c++) p0 = KVT_MIN(p0, kvt__blob_cell_pos(b->data, L, 0, c));
        b->p0 = p0;
    } else if (rc == 0) {
        rc = kvt__fail(KVT_EFORMAT, "block blob has no cells");
    }
    free(L);
    return rc;
}
