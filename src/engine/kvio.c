/* kvio.c — the block primitives' engine side: save [p0, p1) of a sequence as a blob (a copy into a
** scratch sequence + llama_state_seq_get_data, a pending K-shift applied first), load a blob at a
** new position (host RoPE re-anchoring in src/kv/blob.c, then llama_state_seq_set_data). */
#include "engine/engine_int.h"
#include "test_hooks.h"

#include <stdlib.h>
#include <string.h>

/* A pending K-shift is applied by the next llama_decode; force it with one token in the flush
** sequence, then remove that token. */
int kvt__engine_flush_shift(kvt_engine *e) {
    if (!e->shift_pending || e->skip_flush) return 0;
    kvt_token t = 0;
    int rc = kvt_decode(e, e->seq_flush, &t, 1, 0, false);
    kvt_seq_rm(e, e->seq_flush, -1, -1);
    return rc;
}

int kvt__engine_save_seq(kvt_engine *e, int32_t seq, uint8_t **buf, size_t *n) {
    *buf = NULL;
    size_t sz = llama_state_seq_get_size(e->ctx, seq);
    if (sz == 0) return kvt__fail(KVT_ELLAMA, "llama_state_seq_get_size failed for seq %d", seq);
    uint8_t *b = malloc(sz);
    if (!b) return kvt__fail(KVT_ENOMEM, "KV block of %zu bytes", sz);
    size_t w = llama_state_seq_get_data(e->ctx, b, sz, seq);
    if (w != sz) { free(b); return kvt__fail(KVT_ELLAMA, "llama_state_seq_get_data wrote %zu of %zu bytes", w, sz); }
    *buf = b;
    *n = sz;
    return 0;
}

int kvt_block_save(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_blob **out) {
    *out = NULL;
    if (!kvt__engine_seq_ok(e, seq) || seq >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "block save: sequence id %d", seq);
    if (p0 < 0 || p1 <= p0) return kvt__fail(KVT_EINVAL, "block save: empty range [%d, %d)", p0, p1);
    int rc = kvt__engine_flush_shift(e);
    if (rc) return rc;
    llama_memory_t mem = llama_get_memory(e->ctx);
    llama_memory_seq_cp(mem, seq, e->seq_a, p0, p1); /* metadata only: cells are shared */
    kvt_blob *b = calloc(1, sizeof *b);
    if (!b) { llama_memory_seq_rm(mem, e->seq_a, -1, -1); return kvt__fail(KVT_ENOMEM, "blob"); }
    rc = kvt__engine_save_seq(e, e->seq_a, &b->data, &b->size);
    llama_memory_seq_rm(mem, e->seq_a, -1, -1);
    if (rc) { free(b); return rc; }
    struct kvt__blob_layout L;
    if ((rc = kvt__blob_parse(b->data, b->size, e->n_parts, &L))) { kvt_blob_free(b); return rc; }
    if (L.part[0].n_cells == 0) {
        kvt_blob_free(b);
        return kvt__fail(KVT_ENOENT, "block save: sequence %d has no cells in [%d, %d)", seq, p0, p1);
    }
    kvt_pos lo = INT32_MAX, hi = -1;
    for (uint32_t c = 0; c < L.part[0].n_cells; c++) {
        kvt_pos pp = kvt__blob_cell_pos(b->data, &L, 0, c);
        lo = KVT_MIN(lo, pp);
        hi = KVT_MAX(hi, pp);
    }
    b->p0 = lo;
    b->n_tokens = hi - lo + 1;
    b->n_cells = (int32_t) L.part[0].n_cells;
    b->n_cells_swa = e->n_parts > 1 ? (int32_t) L.part[1].n_cells : 0;
    *out = b;
    return 0;
}

int kvt_block_load(kvt_engine *e, const kvt_blob *blob, int32_t seq, kvt_pos new_p0) {
    if (!blob || !blob->data) return kvt__fail(KVT_EINVAL, "block load: NULL blob");
    if (!kvt__engine_seq_ok(e, seq) || seq >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "block load: sequence id %d", seq);
    kvt_pos tail = kvt__pm_max(&e->pm[seq]);
    if (new_p0 <= tail)
        return kvt__fail(KVT_EINVAL, "block load at position %d: sequence %d already holds position %d (load at the tail)",
                         new_p0, seq, tail);
    struct kvt__blob_layout L;
    int rc = kvt__blob_parse(blob->data, blob->size, e->n_parts, &L);
    if (rc) return rc;
    const int32_t delta = new_p0 - blob->p0;
    llama_memory_t mem = llama_get_memory(e->ctx);
    const uint8_t *src = blob->data;
    uint8_t *tmp = NULL;
    if (e->info.reanchor == KVT_REANCHOR_HOST && delta != 0) {
        tmp = malloc(blob->size);
        if (!tmp) return kvt__fail(KVT_ENOMEM, "block load copy of %zu bytes", blob->size);
        memcpy(tmp, blob->data, blob->size);
        if ((rc = kvt__blob_reanchor(tmp, &L, delta, e->info.n_head_kv, e->rope))) { free(tmp); return rc; }
        src = tmp;
    }
    llama_memory_seq_rm(mem, e->seq_b, -1, -1);
    size_t r = llama_state_seq_set_data(e->ctx, src, blob->size, e->seq_b);
    free(tmp);
    if (r != blob->size) {
        llama_memory_seq_rm(mem, e->seq_b, -1, -1);
        return kvt__fail(KVT_ECTX, "block load of %d tokens failed (llama.cpp read %zu of %zu bytes): no free KV cells "
                         "or a blob from another model/cache layout", blob->n_tokens, r, blob->size);
    }
    if (e->info.reanchor == KVT_REANCHOR_SEQ_ADD && delta != 0) {
        llama_memory_seq_add(mem, e->seq_b, -1, -1, delta);
        e->shift_pending = true;
    }
    llama_memory_seq_cp(mem, e->seq_b, seq, -1, -1);
    llama_memory_seq_rm(mem, e->seq_b, -1, -1);
    for (uint32_t c = 0; c < L.part[0].n_cells; c++)
        if ((rc = kvt__pm_set(&e->pm[seq], kvt__blob_cell_pos(blob->data, &L, 0, c) + delta))) return rc;
    e->gen++;
    return 0;
}

void kvt_blob_free(kvt_blob *b) {
    if (!b) return;
    free(b->data);
    free(b);
}

int kvt_blob_dup(const kvt_blob *b, kvt_blob **out) {
    kvt_blob *n = malloc(sizeof *n);
    *out = NULL;
    if (!n) return kvt__fail(KVT_ENOMEM, "blob");
    *n = *b;
    n->data = malloc(b->size);
    if (!n->data) { free(n); return kvt__fail(KVT_ENOMEM, "blob of %zu bytes", b->size); }
    memcpy(n->data, b->data, b->size);
    *out = n;
    return 0;
}

void kvt_engine_set_unsafe_skip_shift_flush(kvt_engine *e, bool skip) { e->skip_flush = skip; }

bool kvt_engine_shift_pending(const kvt_engine *e) { return e->shift_pending; }

int kvt_blob_k_rows(const kvt_engine *e, const kvt_blob *blob, int part, int il, float **k, kvt_pos **pos,
                    int32_t *n_cells, int32_t *row_elems) {
    struct kvt__blob_layout L;
    *k = NULL;
    *pos = NULL;
    int rc = kvt__blob_parse(blob->data, blob->size, e->n_parts, &L);
    if (rc) return rc;
    if (part < 0 || part >= L.n_parts) return kvt__fail(KVT_EINVAL, "blob has no part %d", part);
    uint32_t nc = L.part[part].n_cells;
    if ((rc = kvt__blob_k_f32(blob->data, &L, part, il, NULL, row_elems))) return rc;
    float *kk = malloc(sizeof(float) * (nc ? nc : 1) * (size_t) (*row_elems ? *row_elems : 1));
    kvt_pos *pp = malloc(sizeof(kvt_pos) * (nc ? nc : 1));
    if (!kk || !pp) { free(kk); free(pp); return kvt__fail(KVT_ENOMEM, "K rows"); }
    if (nc) kvt__blob_k_f32(blob->data, &L, part, il, kk, row_elems);
    for (uint32_t c = 0; c < nc; c++) pp[c] = kvt__blob_cell_pos(blob->data, &L, part, c);
    *k = kk;
    *pos = pp;
    *n_cells = (int32_t) nc;
    return 0;
}

int kvt_engine_layer_part(const kvt_engine *e, int32_t il, int *part, int *idx) {
    if (il < 0 || il >= e->info.n_layer || e->layer_part[il] < 0)
        return kvt__fail(KVT_ENOENT, "layer %d has no known cache part", il);
    *part = e->layer_part[il];
    *idx = e->layer_idx[il];
    return 0;
}

/* Rotate a head vector with the RoPE verified at open (used for InfLLM's position-free keys). */
int kvt__engine_rotate(const kvt_engine *e, int32_t il, float *x, int32_t n, int32_t delta) {
    int part = 0, idx = 0;
    if (kvt_engine_layer_part(e, il, &part, &idx) || !e->rope[part])
        return kvt__fail(KVT_EUNSUPPORTED, "no verified RoPE for layer %d", il);
    struct kvt__rope r = e->rope[part][idx];
    if (r.n_rot > n) return kvt__fail(KVT_EINVAL, "head vector of %d dims, n_rot %d", n, r.n_rot);
    kvt__rope_rotate_f32(x, &r, delta);
    return 0;
}
