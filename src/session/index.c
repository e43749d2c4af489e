/* index.c — what a sealed block is found by, one explicit step at its seal: its chain key and its
** chunk key in the content-addressed block store (the put is write-behind), its InfLLM
** representative keys, its text vector for dense recovery.  Each is best effort: the store is a
** cache and an index that cannot take a block only makes that block harder to find.  Reads the
** block table, never changes the cache.
**
** A block's chain key names the K/V a cold prefill of the token stream from position 0 gives
** (vLLM's prefix caching and LMCache key blocks the same way).  A session's block i carries that
** K/V exactly while the session is "chain-pure" (reuse.c says when that ends).  Chunk keys
** (chunks.c) name a block's tokens wherever they stand. */
#include "session/session_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* h_0 for this session, computed once (the model's fingerprint reads the GGUF file once per
** engine).  A failure turns the store off for the session: it is a cache, never a reason to fail
** a request. */
bool kvt__sess_roots(kvt_session *s) {
    if (s->reuse.have_root) return true;
    if (!s->p.store || s->reuse.store_broken) return false;
    struct kvt_chain_params cp;
    char layout[512];
    memset(&cp, 0, sizeof cp);
    int rc = kvt_engine_fingerprint(s->eng, &cp.model);
    if (rc == 0) {
        kvt_engine_layout(s->eng, layout, sizeof layout);
        cp.layout = layout;
        cp.block = s->p.block;
        cp.tenant = s->reuse.tenant;
        rc = kvt_chain_root(&cp, &s->reuse.root);
        if (rc == 0 && s->p.chunk_reuse) rc = kvt_chunk_root(&cp, &s->chunk.root);
    }
    if (rc) {
        fprintf(stderr, "kvtier: block store off for this session: %s\n", kvt_errmsg());
        kvt__clear_error();
        s->reuse.store_broken = true;
        return false;
    }
    s->reuse.model_fp = cp.model;
    s->reuse.have_root = true;
    return true;
}

/* Key of block i from its predecessor's; false when there is none (not pure, not full). */
static bool block_key(kvt_session *s, int32_t i, kvt_key *out) {
    const struct blk *b = &s->b[i];
    if (b->info.n_tokens != s->p.block || b->info.orig_p0 != i * s->p.block) return false;
    const kvt_key *prev = NULL;
    if (i == 0) {
        if (!kvt__sess_roots(s)) return false;
        prev = &s->reuse.root;
    } else if (s->b[i - 1].has_ckey) {
        prev = &s->b[i - 1].ckey;
    } else {
        return false;
    }
    kvt_chain_next(prev, b->tok, b->info.n_tokens, out);
    return true;
}

/* Block b (full) was just saved as blob: with chunk_reuse, put it in the store under its chunk
** key too (write-behind, any purity: chunks.c). */
static void chunk_store(kvt_session *s, const struct blk *b, const kvt_blob *blob) {
    const int32_t B = s->p.block;
    if (!s->p.chunk_reuse || !s->p.store || b->info.n_tokens != B || !kvt__sess_roots(s)) return;
    kvt_key key;
    if (kvt_chain_next(&s->chunk.root, b->tok, B, &key) == 0 && !kvt_store_has(s->p.store, &key)) {
        struct kvt_store_meta m = { s->reuse.model_fp, B, 0 };
        if (kvt_store_put(s->p.store, &key, &m, blob->data, blob->size) == 0) s->st.chunk_put++;
    }
    kvt__clear_error(); /* a store that cannot take it costs a later prefill, nothing now */
}

/* Block b was just saved as blob: while the session is pure, give it its chain key and put it in
** the store (write-behind).  Returns true if the store holds b's bytes under its chain key now
** (put, or there already). */
static bool store_block(kvt_session *s, struct blk *b, const kvt_blob *blob) {
    chunk_store(s, b, blob); /* chunk keys: blocks of any purity */
    if (!s->p.store || !s->reuse.chain_ok) return false;
    const int32_t i = (int32_t) (b - s->b);
    if (blob->p0 != b->info.orig_p0 || !block_key(s, i, &b->ckey)) return false;
    b->has_ckey = true;
    if (kvt_store_has(s->p.store, &b->ckey)) return true;
    struct kvt_store_meta m = { s->reuse.model_fp, b->info.n_tokens, 0 };
    const bool put = kvt_store_put(s->p.store, &b->ckey, &m, blob->data, blob->size) == 0;
    if (put) s->st.store_put++;
    /* a put that neither tier kept (larger than RAM with no disk tier, say) is no copy */
    const bool held = put && kvt_store_has(s->p.store, &b->ckey);
    kvt__clear_error(); /* a store that cannot take it (memory) costs a later prefill, nothing now */
    return held;
}

int kvt__sess_store_fetch(kvt_session *s, const struct blk *b, void **data, size_t *n) {
    *data = NULL;
    *n = 0;
    if (!s->p.store || !b->has_ckey || !s->reuse.have_root) return KVT_ENOENT;
    int rc = kvt_store_get_copy(s->p.store, &b->ckey, &s->reuse.model_fp, data, n); /* its own copy: any age */
    if (rc) kvt__clear_error();
    return rc;
}

/* InfLLM's representative tokens: the N_REP tokens of the block that received the most
** attention, their keys at rep_layer taken from the saved block and rotated back to position
** 0, so that scoring against a query (also at position 0) ignores distance.  Best effort: a
** block without representatives is simply never retrieved. */
static void pick_representatives(kvt_session *s, struct blk *b, const kvt_blob *blob) {
    int part, idx;
    float *K = NULL;
    kvt_pos *pos = NULL;
    int32_t nc = 0, row = 0;
    struct kvt_engine_info I;
    kvt_engine_info(s->eng, &I);
    if (kvt_engine_layer_part(s->eng, s->rcv.rep_layer, &part, &idx) ||
        kvt_blob_k_rows(s->eng, blob, part, idx, &K, &pos, &nc, &row)) {
        kvt__clear_error();
        return;
    }
    int32_t pick[N_REP], n_pick = 0;
    for (int32_t r = 0; r < N_REP && r < b->info.n_tokens; r++) {
        int32_t best = -1;
        for (int32_t t = 0; t < b->info.n_tokens; t++) {
            bool used = false;
            for (int32_t q = 0; q < n_pick; q++) used |= pick[q] == t;
            if (!used && (best < 0 || b->tok_mass[t] >= b->tok_mass[best])) best = t;
        }
        pick[n_pick++] = best;
    }
    free(b->rep);
    b->rep = malloc(sizeof(float) * (size_t) n_pick * (size_t) row);
    b->n_rep = 0;
    const int32_t hd = row / I.n_head_kv;
    for (int32_t r = 0; b->rep && r < n_pick; r++)
        for (int32_t c = 0; c < nc; c++)
            if (pos[c] == b->info.p0 + pick[r]) {
                float *dst = b->rep + (size_t) b->n_rep * row;
                memcpy(dst, K + (size_t) c * row, sizeof(float) * (size_t) row);
                for (int32_t h = 0; h < I.n_head_kv; h++) kvt__engine_rotate(s->eng, s->rcv.rep_layer, dst + h * hd, hd, -pos[c]);
                b->n_rep++;
                break;
            }
    s->rcv.rep_row = row;
    kvt__clear_error();
    free(K);
    free(pos);
}

/* With an embedder: the block's text vector, and into the HNSW index once the session has
** ann_min_blocks sealed blocks (the earlier ones are added when the index is built).  Best
** effort: a block that cannot be embedded is only invisible to dense recovery. */
void kvt__sess_index_text(kvt_session *s, struct blk *b) {
    double t0 = kvt__now_ms();
    if (!b->text || !b->text[0]) return;
    if (!(b->emb = malloc(sizeof(float) * (size_t) s->rcv.emb_dim))) return;
    if (kvt_embedder_embed(s->p.embedder, b->text, b->emb) != 0) {
        free(b->emb);
        b->emb = NULL;
        kvt__clear_error();
        return;
    }
    if (!s->rcv.ann && b->info.id + 1 >= s->p.ann_min_blocks) {
        if (kvt_ann_open(s->rcv.emb_dim, 2 * s->p.ann_min_blocks, 0, 0, &s->rcv.ann) == 0)
            for (int32_t i = 0; i < b->info.id; i++)
                if (s->b[i].emb) kvt_ann_add(s->rcv.ann, (uint64_t) i, s->b[i].emb);
    }
    if (s->rcv.ann) kvt_ann_add(s->rcv.ann, (uint64_t) b->info.id, b->emb);
    kvt__clear_error();
    s->st.embed_ms += kvt__now_ms() - t0;
}

bool kvt__sess_index_block(kvt_session *s, struct blk *b, const kvt_blob *blob) {
    const bool content = store_block(s, b, blob);
    if (s->p.policy == KVT_POLICY_INFLLM) pick_representatives(s, b, blob);
    return content;
}
