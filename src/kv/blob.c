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
#include <string.h>

struct rd {
    const uint8_t *buf;
    size_t n, off;
};

static int rd_bytes(struct rd *r, void *dst, size_t k, const char *what) {
    if (k > r->n - r->off)
        return kvt__fail(KVT_EFORMAT, "KV block truncated: %s at byte %zu needs %zu bytes, %zu left",
                         what, r->off, k, r->n - r->off);
    if (dst) memcpy(dst, r->buf + r->off, k);
    r->off += k;
    return 0;
}

#define RD(r, v, what)                                          \
    do {                                                        \
        int rc_ = rd_bytes((r), &(v), sizeof(v), (what));       \
        if (rc_) return rc_;                                    \
    } while (0)

static int skip(struct rd *r, uint64_t k, const char *what) {
    if (k > r->n - r->off)
        return kvt__fail(KVT_EFORMAT, "KV block truncated: %s at byte %zu needs %llu bytes, %zu left",
                         what, r->off, (unsigned long long) k, r->n - r->off);
    r->off += (size_t) k;
    return 0;
}

static int parse_part(struct rd *r, struct kvt__blob_part *P) {
    uint32_t n_stream = 0;
    RD(r, n_stream, "n_stream");
    if (n_stream != 1)
        return kvt__fail(KVT_EFORMAT, "KV block has %u streams; kvtier needs a unified cache (1)", n_stream);
    RD(r, P->n_cells, "cell_count");
    P->cells_off = r->off;
    P->n_layer = 0;
    P->v_trans = 0;
    P->v_bytes = 0;
    if (P->n_cells == 0) return 0;
    for (uint32_t c = 0; c < P->n_cells; c++) {
        int32_t pos = 0;
        uint32_t n_seq_id = 0;
        RD(r, pos, "cell pos");
        RD(r, n_seq_id, "cell n_seq_id");
        if (n_seq_id > 64) return kvt__fail(KVT_EFORMAT, "KV block cell %u has %u seq ids", c, n_seq_id);
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
        if (P->k_type[l] < 0 || P->k_type[l] >= GGML_TYPE_COUNT || P->k_row_bytes[l] == 0 ||
            P->k_row_bytes[l] > (1u << 24))
            return kvt__fail(KVT_EFORMAT, "KV block layer %u: bad K type %d / row bytes %llu", l,
                             P->k_type[l], (unsigned long long) P->k_row_bytes[l]);
        P->k_off[l] = r->off;
        int rc = skip(r, P->k_row_bytes[l] * P->n_cells, "K rows");
        if (rc) return rc;
    }
    size_t v0 = r->off;
    for (uint32_t l = 0; l < P->n_layer; l++) {
        int32_t vt = 0;
        RD(r, vt, "v type");
        int rc;
        if (!P->v_trans) {
            uint64_t row = 0;
            RD(r, row, "v row bytes");
            rc = skip(r, row * P->n_cells, "V rows");
        } else {
            uint32_t el, ne = 0;
            RD(r, el, "v elem size");
            RD(r, ne, "n_embd_v");
            rc = skip(r, (uint64_t) el * ne * P->n_cells, "V (transposed)");
        }
        if (rc) return rc;
    }
    P->v_bytes = r->off - v0;
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
        return kvt__fail(KVT_EFORMAT, "KV block has %zu trailing bytes after %d parts (%zu of %zu used)",
                         n - r.off, n_parts, r.off, n);
    return 0;
}

/* Cell records can have several seq ids, so cell c is found by walking. */
static size_t cell_off(const uint8_t *buf, const struct kvt__blob_part *P, uint32_t c) {
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
        return kvt__fail(KVT_EUNSUPPORTED, "K cache type %s cannot be rotated on the host (F32/F16 only)",
                         ggml_type_name(t));
    *row_elems = (int32_t) (P->k_row_bytes[il] / ggml_type_size(t));
    return 0;
}

int kvt__blob_reanchor(uint8_t *buf, const struct kvt__blob_layout *L, int32_t delta, int n_head_kv,
                       struct kvt__rope *const rope[2]) {
    for (int p = 0; p < L->n_parts; p++) {
        const struct kvt__blob_part *P = &L->part[p];
        size_t off = P->cells_off;
        for (uint32_t c = 0; c < P->n_cells; c++) {
            int32_t pos;
            uint32_t nsid;
            memcpy(&pos, buf + off, 4);
            memcpy(&nsid, buf + off + 4, 4);
            pos += delta;
            memcpy(buf + off, &pos, 4);
            off += 8 + (size_t) nsid * 4;
        }
        if (delta == 0) continue;
        for (uint32_t il = 0; il < P->n_layer; il++) {
            int32_t ne = 0;
            int rc = k_row_elems(P, (int) il, &ne);
            if (rc) return rc;
            if (ne % n_head_kv) return kvt__fail(KVT_EFORMAT, "K row of %d elems for %d KV heads", ne, n_head_kv);
            const int hd = ne / n_head_kv;
            const struct kvt__rope *r = &rope[p][il];
            if (r->n_rot > hd) return kvt__fail(KVT_EFORMAT, "n_rot %d > head_dim %d", r->n_rot, hd);
            float tmp[4096], cs[4096];
            if (hd > 4096) return kvt__fail(KVT_EUNSUPPORTED, "head_dim %d > 4096", hd);
            kvt__rope_table(r, delta, cs); /* one table per layer: the angles depend only on delta */
            for (uint32_t c = 0; c < P->n_cells; c++) {
                uint8_t *row = buf + P->k_off[il] + (size_t) c * P->k_row_bytes[il];
                for (int h = 0; h < n_head_kv; h++) {
                    if (P->k_type[il] == GGML_TYPE_F32) {
                        kvt__rope_apply((float *) (void *) row + (size_t) h * hd, r, cs);
                    } else {
                        ggml_fp16_t *x = (ggml_fp16_t *) (void *) row + (size_t) h * hd;
                        ggml_fp16_to_fp32_row(x, tmp, r->n_rot);
                        kvt__rope_apply(tmp, r, cs);
                        ggml_fp32_to_fp16_row(tmp, x, r->n_rot);
                    }
                }
            }
        }
    }
    return 0;
}

int kvt__blob_k_f32(const uint8_t *buf, const struct kvt__blob_layout *L, int p, int il, float *out,
                    int32_t *row_elems) {
    if (p < 0 || p >= L->n_parts) return kvt__fail(KVT_EINVAL, "KV block has no part %d", p);
    const struct kvt__blob_part *P = &L->part[p];
    if (P->n_cells == 0) { *row_elems = 0; return 0; }
    if (il < 0 || (uint32_t) il >= P->n_layer)
        return kvt__fail(KVT_EINVAL, "KV block part %d has no layer %d (%u layers)", p, il, P->n_layer);
    int rc = k_row_elems(P, il, row_elems);
    if (rc || !out) return rc;
    const uint8_t *k = buf + P->k_off[il];
    size_t n = (size_t) P->n_cells * (size_t) *row_elems;
    if (P->k_type[il] == GGML_TYPE_F32) {
        memcpy(out, k, n * sizeof(float));
    } else {
        const ggml_fp16_t *h = (const ggml_fp16_t *) (const void *) k;
        for (size_t i = 0; i < n; i++) out[i] = ggml_fp16_to_fp32(h[i]);
    }
    return 0;
}
