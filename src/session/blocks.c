/* blocks.c — the block table: tokens are recorded into the open tail block; a block is saved to
** the host pool the moment it is complete ("sealed": write-through, as LMCache does), so eviction
** is only a seq_rm and the sliding-window cells of iSWA models are captured while they still
** exist.  Eviction is watermark-triggered (above high * budget, down to low * budget) and scored;
** the first block is an attention sink (StreamingLLM) and the recent tail is kept.  An evicted
** block comes back by loading its saved K/V at the tail with RoPE re-anchoring (no forward pass). */
#include "session/session_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- where copies live: the host pool, or the store (which replaces it) ---------------------- */

static int copy_put(kvt_session *s, uint64_t key, const void *data, size_t n) {
    return s->p.store ? kvt_store_put_private(s->p.store, key, data, n) : kvt_pool_put(s->pool, key, data, n);
}

static int copy_get(kvt_session *s, const struct blk *b, void **data, size_t *n) {
    if (b->copy_content) {
        int rc = kvt__sess_store_fetch(s, b, data, n);
        if (rc == KVT_ENOENT)
            kvt__fail(rc, "its content entry is in no tier of the store any more (TTL, quota, a dropped write, "
                          "a store clear)");
        return rc;
    }
    return s->p.store ? kvt_store_get_private(s->p.store, b->key, data, n) : kvt_pool_get(s->pool, b->key, data, n);
}

void kvt__sess_copy_del(kvt_session *s, struct blk *b) {
    if (b->copy_content) b->copy_content = false; /* shared with other sessions: never deleted */
    else if (s->p.store) kvt_store_del_private(s->p.store, b->key);
    else kvt_pool_del(s->pool, b->key);
    kvt__clear_error();
}

int kvt__sess_copy_tier(const kvt_session *s, const struct blk *b) {
    if (b->copy_content) return kvt_store_tier(s->p.store, &b->ckey);
    if (s->p.store) return kvt_store_private_tier(s->p.store, b->key);
    char path[4096];
    int rc = kvt_pool_spill_path(s->pool, b->key, path, sizeof path);
    kvt__clear_error();
    return rc ? KVT_TIER_NONE : path[0] ? KVT_TIER_DISK : KVT_TIER_RAM;
}

/* Put block b's blob under b->key (the pool, or the store's private entries), encoded with the
** session's codec_ram (raw: the blob's bytes).  A blob the codec refuses (a quantised cache type:
** KVT_EUNSUPPORTED) is put raw.  b->enc says which is held.  Returns kvt_pool_put's code
** (KVT_ENOMEM also when encoding runs out of memory). */
static int pool_save(kvt_session *s, struct blk *b, const kvt_blob *blob) {
    uint8_t *enc = NULL;
    size_t n = 0;
    if (s->codec.codec != KVT_CODEC_RAW) {
        const double t0 = kvt__now_ms();
        int rc = kvt_codec_encode(blob, &s->codec, &enc, &n, NULL);
        s->st.codec_enc_ms += kvt__now_ms() - t0;
        if (rc == KVT_ENOMEM) return rc;
        if (rc) kvt__clear_error(); /* not codable: saved raw */
    }
    const void *data = enc ? (const void *) enc : (const void *) blob->data;
    const size_t size = enc ? n : blob->size;
    b->copy_content = false;
    int rc = copy_put(s, b->key, data, size);
    free(enc);
    b->enc = enc != NULL;
    if (rc == 0 || rc == KVT_EIO) {
        s->st.pool_tokens += b->info.n_tokens;
        s->st.pool_raw_bytes += (int64_t) blob->size;
        s->st.pool_bytes += (int64_t) size;
    }
    return rc;
}

/* Save block b (resident at [p0, p0 + n_tokens)) to the pool and detokenize its text.  On error
** nothing of b is in the pool and b's text is unchanged. */
static int save_block(kvt_session *s, struct blk *b) {
    kvt_blob *blob = NULL;
    int rc = 0;
    /* a block just loaded from the store: its bytes are at hand, no need to read them back */
    const bool preloaded = s->reuse.preload && s->reuse.n_preload > 0 && s->reuse.preload[0]->n_tokens == b->info.n_tokens &&
                           (s->reuse.preload_moved || s->reuse.preload[0]->p0 == b->info.p0);
    if (preloaded) {
        blob = (kvt_blob *) s->reuse.preload[0];
        s->reuse.preload++;
        s->reuse.n_preload--;
    } else if ((rc = kvt_block_save(s->eng, s->p.seq, b->info.p0, b->info.p0 + b->info.n_tokens, &blob))) {
        return rc;
    }
    b->key = ((uint64_t) s->serial << 32) | (uint32_t) b->info.id;
    b->info.pool_key = b->key;
    /* with a store, a pure block's copy is its content entry (one copy, shared), any other
    ** block's a private entry; without one, the pool's */
    const bool content = kvt__sess_index_block(s, b, blob);
    rc = content ? 0 : pool_save(s, b, blob);
    b->copy_content = content;
    /* KVT_EIO: a spill failed and the pool dropped what it was for, possibly this block's copy;
    ** a block without a copy is recomputed from its tokens when it is needed (load_block) */
    if (rc && rc != KVT_EIO) {
        if (!preloaded) kvt_blob_free(blob);
        return rc;
    }
    b->blob_p0 = blob->p0;
    b->blob_cells = blob->n_cells;
    b->blob_cells_swa = blob->n_cells_swa;
    b->blob_bytes = blob->size;
    if (!preloaded) kvt_blob_free(blob);
    char *text = NULL;
    if ((rc = kvt_detokenize(s->eng, b->tok, b->info.n_tokens, false, &text))) {
        kvt__sess_copy_del(s, b);
        return rc;
    }
    free(b->text);
    b->text = text;
    return 0;
}

/* The open block is complete: it stops taking tokens. */
static void close_open_block(kvt_session *s, struct blk *b) {
    b->info.text = b->text ? b->text : "";
    b->info.role = kvt__sess_block_role(b);
    b->info.sealed = true;
    s->open = -1;
    if (s->rcv.emb_dim > 0) kvt__sess_index_text(s, b);
}

/* Seal the open block: save its K/V to the pool (write-through) and detokenize its text.
** On error the block stays open and resident; nothing is lost. */
int kvt__sess_seal(kvt_session *s) {
    if (s->open < 0) return 0;
    struct blk *b = &s->b[s->open];
    if (b->info.n_tokens < s->p.block) kvt__sess_chain_off(s); /* the blocks after it are not aligned */
    int rc = save_block(s, b);
    if (rc) return rc;
    close_open_block(s, b);
    return 0;
}

/* The open block is full: seal it.  When the seal fails it is closed all the same, without a
** saved copy, rather than left open: a full open block has no room for the next token, and the
** token is already decoded.  Its tokens and cells stay; if it is evicted and needed again it is
** recomputed from its tokens (kvt__sess_load_block), exactly as a block whose copy the pool has
** dropped.  So a failing pool costs recomputation later, never a token or a failed step now. */
static void seal_full(kvt_session *s) {
    int rc = kvt__sess_seal(s);
    if (rc == 0) return;
    struct blk *b = &s->b[s->open];
    fprintf(stderr,
            "kvtier: block %d (%d tokens at position %d) kept without a saved copy, recomputed if needed "
            "after eviction: %s\n",
            b->info.id, b->info.n_tokens, b->info.p0, kvt_errmsg());
    b->key = ((uint64_t) s->serial << 32) | (uint32_t) b->info.id;
    b->info.pool_key = b->key;
    char *text = NULL;
    if (kvt_detokenize(s->eng, b->tok, b->info.n_tokens, false, &text) == 0) { /* else: no text, BM25 cannot find it */
        free(b->text);
        b->text = text;
    }
    kvt__clear_error();
    close_open_block(s, b);
}

/* Record tokens[0..n) just decoded at positions next_pos.. in the block table, sealing blocks
** as they fill.  A block never holds more than `block` tokens: a full block is closed even when
** its seal fails (seal_full). */
int kvt__sess_record(kvt_session *s, const kvt_token *tok, int32_t n, int role) {
    for (int32_t i = 0; i < n; i++) {
        if (s->open >= 0 && s->b[s->open].info.n_tokens >= s->p.block) seal_full(s);
        if (s->open < 0) {
            if (s->n_b == s->cap_b) {
                int32_t cap = s->cap_b ? 2 * s->cap_b : 64;
                struct blk *nb = realloc(s->b, sizeof *nb * (size_t) cap);
                if (!nb) return kvt__fail(KVT_ENOMEM, "block table of %d blocks", cap);
                for (int32_t j = 0; j < s->n_b; j++) nb[j].info.text = nb[j].text ? nb[j].text : ""; /* keep aliases valid */
                s->b = nb;
                s->cap_b = cap;
            }
            struct blk *b = &s->b[s->n_b];
            memset(b, 0, sizeof *b);
            b->tok = malloc(sizeof(kvt_token) * (size_t) s->p.block);
            b->tok_mass = calloc((size_t) s->p.block, sizeof(float));
            if (!b->tok || !b->tok_mass) {
                free(b->tok);
                free(b->tok_mass);
                memset(b, 0, sizeof *b);
                return kvt__fail(KVT_ENOMEM, "out of memory for block %d of %d tokens", s->n_b, s->p.block);
            }
            b->info.id = s->n_b;
            b->info.orig_p0 = b->info.p0 = s->next_pos;
            b->info.turn = s->turn;
            b->info.residency = KVT_RES_DEVICE;
            b->info.last_use_turn = s->turn;
            b->info.keep = s->cur_keep;
            b->info.recovered_turn = -1;
            b->info.text = "";
            s->open = s->n_b++;
        }
        struct blk *b = &s->b[s->open];
        if (s->cur_keep > b->info.keep) b->info.keep = s->cur_keep; /* a block is pinned if any token is */
        b->tok[b->info.n_tokens++] = tok[i];
        b->role_n[role]++;
        s->next_pos++;
        s->total++;
        if (b->info.n_tokens == s->p.block) seal_full(s); /* now, while its sliding-window cells exist */
    }
    return 0;
}

static bool protected_block(const kvt_session *s, int32_t i, bool allow_current_turn) {
    const struct blk *b = &s->b[i];
    if (!b->info.sealed || b->info.residency != KVT_RES_DEVICE) return true;
    if (b->info.id < s->p.n_sink_blocks) return true; /* attention sink */
    if (b->info.keep == KVT_KEEP_PIN) return true;
    if (s->p.policy == KVT_POLICY_KVTIER && b->info.recovered_turn == s->turn) return true; /* just brought back */
    if (!allow_current_turn && b->info.turn == s->turn) return true;
    /* the last n_recent sealed resident blocks by position */
    int32_t newer = 0;
    for (int32_t j = 0; j < s->n_b; j++) {
        const struct blk *o = &s->b[j];
        if (j != i && o->info.sealed && o->info.residency == KVT_RES_DEVICE && o->info.p0 > b->info.p0) newer++;
    }
    return newer < s->p.n_recent_blocks;
}

static void evict(kvt_session *s, int32_t i, double score) {
    struct blk *b = &s->b[i];
    kvt__sess_explain(s, "evict blk%d (%d tokens at %d, turn %d, %s %.3f)", b->info.id, b->info.n_tokens, b->info.p0, b->info.turn,
                      kvt_policy_name(s->p.policy), score);
    kvt_seq_rm(s->eng, s->p.seq, b->info.p0, b->info.p0 + b->info.n_tokens);
    b->info.n_evictions++;
    s->st.evictions++;
    kvt__sess_chain_off(s); /* blocks decoded from now on attend to a context with a hole */
    if (s->p.recovery == KVT_RECOVERY_DISCARD) {
        kvt__sess_copy_del(s, b);
        b->info.residency = KVT_RES_LOST;
        return;
    }
    b->info.residency = KVT_RES_HOST; /* kvt_session_get_stats refreshes HOST vs DISK */
}

/* Make room so that `need` more tokens fit: above the high watermark, evict the lowest-scored
** unprotected blocks until resident + need <= low * budget.  Fails with KVT_EBUDGET (and evicts
** nothing more) when even that cannot make resident + need <= budget. */
int kvt__sess_make_room(kvt_session *s, int32_t need) {
    const int32_t budget = s->p.budget;
    if (kvt__sess_resident(s) + need <= (int32_t) floorf(s->p.high_watermark * budget)) return 0;
    if (s->p.policy == KVT_POLICY_NO_EVICTION) {
        if (kvt__sess_resident(s) + need <= budget) return 0;
        return kvt__fail(KVT_EBUDGET, "no_eviction: %d new tokens do not fit next to %d resident (capacity %d)", need,
                         kvt__sess_resident(s), budget);
    }
    int32_t target = (int32_t) floorf(s->p.low_watermark * budget) - need;
    struct kvt__score_ctx sc = { s->next_pos, s->next_pos, 0, 0 };
    for (int32_t i = 0; i < s->n_b; i++) {
        const struct kvt_block_info *b = &s->b[i].info;
        if (b->residency != KVT_RES_DEVICE) continue;
        sc.oldest = KVT_MIN(sc.oldest, b->p0 + b->n_tokens);
        sc.max_relevance = fmax(sc.max_relevance, b->relevance);
        sc.max_ewma = fmax(sc.max_ewma, b->attn_ewma);
    }
    if (s->p.policy == KVT_POLICY_TRUNCATE) {
        /* llama-server's context shift: the older half of what may go, at once */
        int32_t n_ev = 0;
        for (int32_t i = 0; i < s->n_b; i++) n_ev += !protected_block(s, i, false);
        for (int32_t k = 0; k < n_ev / 2; k++) {
            int32_t victim = -1;
            kvt_pos oldest = INT32_MAX;
            for (int32_t i = 0; i < s->n_b; i++)
                if (!protected_block(s, i, false) && s->b[i].info.p0 < oldest) {
                    oldest = s->b[i].info.p0;
                    victim = i;
                }
            if (victim >= 0) evict(s, victim, -(double) oldest); /* the oldest first */
        }
    }
    for (int pass = 0; pass < 2 && kvt__sess_resident(s) > target; pass++) {
        while (kvt__sess_resident(s) > target) {
            int32_t victim = -1;
            double worst = INFINITY;
            for (int32_t i = 0; i < s->n_b; i++) {
                if (protected_block(s, i, pass == 1)) continue;
                const struct kvt_block_info *b = &s->b[i].info;
                double v = s->p.scorer ? s->p.scorer(b, s->next_pos, s->p.scorer_ud) : kvt__score(s->p.policy, b, &sc);
                if (v < worst || (v == worst && victim >= 0 && b->p0 < s->b[victim].info.p0)) {
                    worst = v;
                    victim = i;
                }
            }
            if (victim < 0) break;
            evict(s, victim, worst);
        }
    }
    if (kvt__sess_resident(s) + need > budget)
        return kvt__fail(KVT_EBUDGET,
                         "%d new tokens do not fit the budget of %d tokens: %d resident tokens are "
                         "protected (sink, recent tail, open block, pins)",
                         need, budget, kvt__sess_resident(s));
    return 0;
}

/* The recompute path: decode the block's tokens again at the tail, then re-save its K/V.  Only a
** failed decode is an error (its cells are removed again); once decoded the block is in the cache,
** and a failed re-save leaves it there without a copy (recomputed again if it is needed after a
** later eviction). */
static int breadcrumb(kvt_session *s, struct blk *b) {
    /* llama.cpp decodes a sequence only at consecutive positions: a block re-decoded while the
    ** session is being resumed in place (next_pos = the block's old p0, behind an eviction gap)
    ** goes right after what is already back instead */
    const kvt_pos tail = kvt_seq_pos_max(s->eng, s->p.seq) + 1;
    if (s->next_pos > tail) s->next_pos = tail;
    int rc = kvt_engine_decode(s->eng, s->p.seq, b->tok, b->info.n_tokens, s->next_pos, false);
    if (rc) {
        kvt_seq_rm(s->eng, s->p.seq, s->next_pos, s->next_pos + b->info.n_tokens);
        return rc;
    }
    kvt_blob *blob = NULL;
    if (kvt_block_save(s->eng, s->p.seq, s->next_pos, s->next_pos + b->info.n_tokens, &blob) == 0) {
        pool_save(s, b, blob); /* a failure only means: no copy */
        b->blob_p0 = blob->p0;
        b->blob_cells = blob->n_cells;
        b->blob_cells_swa = blob->n_cells_swa;
        b->blob_bytes = blob->size;
        kvt_blob_free(blob);
    }
    kvt__clear_error();
    s->st.decoded += b->info.n_tokens;
    return 0;
}

/* Block b's saved copy is gone (`why`): it failed its checksum (KVT_ECORRUPT), its spill file is
** missing or unreadable (KVT_EIO), or the pool dropped it or never got it (KVT_ENOENT).  Its
** tokens are kept, so it is recomputed at the tail rather than left out: a block left out would
** be a hole in the context that no later sync re-decodes (its tokens are still in the stream).
** Counted in recomputes.  If the recompute fails the block stays evicted as LOST (no copy) and
** a later recovery may try again. */
static int recompute_lost(kvt_session *s, struct blk *b, int why) {
    fprintf(stderr, "kvtier: block %d is recomputed from its %d tokens: %s\n", b->info.id, b->info.n_tokens, kvt_errmsg());
    if (why != KVT_ENOENT) kvt__sess_copy_del(s, b);
    b->copy_content = false;
    b->info.residency = KVT_RES_LOST;
    kvt__clear_error();
    int rc = breadcrumb(s, b);
    if (rc == 0) s->st.recomputes++;
    return rc;
}

/* Load block i at the tail.  `counted`: a recovery (stats, recovered_turn); a move of a resident
** block (kvt__sess_lift_block / kvt__sess_place_block) is not one. */
static int load_block(kvt_session *s, int32_t i, bool counted) {
    struct blk *b = &s->b[i];
    int rc0 = kvt__sess_reserve_positions(s, b->info.n_tokens); /* loads go at the tail */
    if (rc0) return rc0;
    kvt__sess_chain_off(s);
    if (s->p.recovery == KVT_RECOVERY_BREADCRUMB) {
        int rc = breadcrumb(s, b);
        if (rc) return rc;
        goto placed;
    }
    void *data = NULL;
    size_t n = 0;
    int rc = copy_get(s, b, &data, &n);
    bool enc = rc == 0 && b->enc && !b->copy_content;
    kvt_blob *dec = NULL;
    if (enc) { /* codec_ram: decoded here, on the load path; bytes that do not decode are lost */
        const double t0 = kvt__now_ms();
        rc = kvt_codec_decode(data, n, &dec);
        s->st.codec_dec_ms += kvt__now_ms() - t0;
        free(data);
        data = NULL;
        if (rc == KVT_EFORMAT) rc = KVT_ECORRUPT;
        else if (rc == 0 && (dec->n_tokens != b->info.n_tokens || dec->p0 != b->blob_p0 || dec->n_cells != b->blob_cells ||
                             dec->n_cells_swa != b->blob_cells_swa)) {
            rc = kvt__fail(KVT_ECORRUPT, "block %d: its encoded copy decodes to %d tokens at %d, expected %d at %d", b->info.id,
                           dec->n_tokens, dec->p0, b->info.n_tokens, b->blob_p0);
            kvt_blob_free(dec);
            dec = NULL;
        }
    }
    /* the pool lost its copy; the store has the block's bytes by its chain key, saved at its
    ** original position: usable only while the pool's copy was saved there too (a block
    ** recomputed or re-saved at another position has other cells than the store's bytes) */
    if ((rc == KVT_ECORRUPT || rc == KVT_EIO || rc == KVT_ENOENT) && !b->copy_content && b->blob_p0 == b->info.orig_p0 &&
        kvt__sess_store_fetch(s, b, &data, &n) == 0) {
        kvt__clear_error();
        rc = 0;
    }
    if (rc == KVT_ECORRUPT || rc == KVT_EIO || rc == KVT_ENOENT) { /* the saved copy is gone */
        if ((rc = recompute_lost(s, b, rc))) return rc;
        goto placed;
    }
    if (rc) return rc;
    kvt_blob blob = { data, n, b->blob_p0, b->info.n_tokens, b->blob_cells, b->blob_cells_swa };
    rc = kvt_block_load(s->eng, dec ? dec : &blob, s->p.seq, s->next_pos);
    free(data);
    kvt_blob_free(dec);
    if (rc == KVT_EFORMAT) { /* a copy that cannot be loaded here (e.g. an iSWA block saved without
                             ** the sliding-window cells it needs): recomputed, never a hole */
        if ((rc = recompute_lost(s, b, KVT_ECORRUPT))) return rc;
        goto placed;
    }
    if (rc) return rc;
    if (counted) s->st.recovered += b->info.n_tokens;
placed:
    b->info.p0 = s->next_pos;
    b->info.residency = KVT_RES_DEVICE;
    b->info.last_use_turn = s->turn;
    s->next_pos += b->info.n_tokens;
    if (counted) {
        b->info.recovered_turn = s->turn;
        b->info.n_recoveries++;
        s->st.recoveries++;
    }
    kvt__sess_note_peak(s);
    return 0;
}

int kvt__sess_load_block(kvt_session *s, int32_t i) { return load_block(s, i, true); }

void kvt__sess_lift_block(kvt_session *s, int32_t i) {
    struct blk *b = &s->b[i];
    kvt_seq_rm(s->eng, s->p.seq, b->info.p0, b->info.p0 + b->info.n_tokens);
    kvt__sess_chain_off(s);
    b->info.residency = KVT_RES_HOST; /* its sealed copy; kvt_session_get_stats refreshes HOST vs DISK */
}

int kvt__sess_place_block(kvt_session *s, int32_t i) { return load_block(s, i, false); }

void kvt__sess_drop_block(kvt_session *s, struct blk *b) {
    if (b->info.residency == KVT_RES_DEVICE) kvt_seq_rm(s->eng, s->p.seq, b->info.p0, b->info.p0 + b->info.n_tokens);
    if (b->info.sealed && b->info.residency != KVT_RES_LOST) kvt__sess_copy_del(s, b);
    if (s->rcv.ann && b->emb) kvt_ann_remove(s->rcv.ann, (uint64_t) b->info.id);
    kvt__clear_error();
    free(b->tok);
    free(b->text);
    free(b->tok_mass);
    free(b->rep);
    free(b->emb);
    memset(b, 0, sizeof *b);
}

/* HOST vs DISK changes under the pool's (or the store's) LRU, and a copy may be dropped (a failed
** spill, a quota, a content entry's TTL): ask where it is.  A block without a copy is LOST until
** it is recomputed. */
void kvt__sess_refresh_residency(const kvt_session *s, struct blk *b) {
    if (b->info.residency == KVT_RES_HOST || b->info.residency == KVT_RES_DISK) {
        const int t = kvt__sess_copy_tier(s, b);
        b->info.residency = t == KVT_TIER_RAM ? KVT_RES_HOST : t == KVT_TIER_DISK ? KVT_RES_DISK : KVT_RES_LOST;
    }
}

/* ---- the recovery executor: a plan of session/recovery.c's planners, loaded ----------------- */

/* Load candidate blocks c[0..n_c) (best first) back at the tail: room is made for them plus
** `extra` tokens (the message and the reply reserve), dropping the weakest (successors first)
** while they do not fit; the open block is sealed first so block ranges never interleave; they
** are loaded in the order of their original positions, so they read as they were said.  A block
** whose saved copy is gone (failed checksum, missing spill file, dropped by the pool) is
** recomputed from its tokens by kvt__sess_load_block. */
static int load_candidates(kvt_session *s, struct cand *c, int32_t n_c, int32_t extra) {
    int32_t need = 0;
    for (int32_t k = 0; k < n_c; k++) need += s->b[c[k].i].info.n_tokens;
    while (n_c > 0 && kvt__sess_make_room(s, need + extra) == KVT_EBUDGET) need -= s->b[c[--n_c].i].info.n_tokens;
    kvt__clear_error();
    int rc = n_c > 0 ? kvt__sess_seal(s) : 0;
    for (int32_t k = 0; rc == 0 && k < n_c; k++)
        for (int32_t j = k + 1; j < n_c; j++)
            if (s->b[c[j].i].info.orig_p0 < s->b[c[k].i].info.orig_p0) {
                struct cand t = c[k];
                c[k] = c[j];
                c[j] = t;
            }
    for (int32_t k = 0; rc == 0 && k < n_c; k++) rc = kvt__sess_load_block(s, c[k].i); /* lost copies: recomputed */
    return rc;
}

/* RPLAN_TAIL with resident blocks mv[0..n_mv) that move: they are kept (pinned) while room is
** made for the candidates, then lifted, and candidates and moved blocks come back at the tail
** together in the order of their original positions (a moved block by RoPE re-anchoring of its
** sealed copy, not counted as a recovery; a candidate as load_candidates loads it). */
static int load_with_moves(kvt_session *s, struct cand *c, int32_t n_c, int32_t extra, const int32_t *mv, int32_t n_mv) {
    int32_t keep[8], need = 0;
    for (int32_t j = 0; j < n_mv; j++) {
        keep[j] = s->b[mv[j]].info.keep;
        s->b[mv[j]].info.keep = KVT_KEEP_PIN;
    }
    for (int32_t k = 0; k < n_c; k++) need += s->b[c[k].i].info.n_tokens;
    while (n_c > 0 && kvt__sess_make_room(s, need + extra) == KVT_EBUDGET) need -= s->b[c[--n_c].i].info.n_tokens;
    kvt__clear_error();
    for (int32_t j = 0; j < n_mv; j++) s->b[mv[j]].info.keep = keep[j];
    int32_t *idx = malloc(sizeof(int32_t) * (size_t) (n_c + n_mv)), n = 0;
    bool *moved = malloc(sizeof(bool) * (size_t) (n_c + n_mv));
    int rc = !idx || !moved ? kvt__fail(KVT_ENOMEM, "recovery plan") : kvt__sess_seal(s);
    if (rc) {
        free(idx);
        free(moved);
        return rc;
    }
    /* one list: candidates (loaded) and moves (placed), by original position */
    for (int32_t k = 0; k < n_c; k++, n++) idx[n] = c[k].i, moved[n] = false;
    for (int32_t j = 0; j < n_mv; j++, n++) idx[n] = mv[j], moved[n] = true;
    for (int32_t k = 0; k < n; k++)
        for (int32_t j = k + 1; j < n; j++)
            if (s->b[idx[j]].info.orig_p0 < s->b[idx[k]].info.orig_p0) {
                int32_t ti = idx[k];
                bool tm = moved[k];
                idx[k] = idx[j], moved[k] = moved[j];
                idx[j] = ti, moved[j] = tm;
            }
    for (int32_t j = 0; j < n_mv; j++) kvt__sess_lift_block(s, mv[j]);
    for (int32_t k = 0; k < n; k++) {
        int rc2 = moved[k] ? kvt__sess_place_block(s, idx[k]) : rc == 0 ? kvt__sess_load_block(s, idx[k]) : 0;
        if (rc == 0) rc = rc2; /* moved blocks are placed back even when a candidate failed to load */
    }
    free(idx);
    free(moved);
    return rc;
}

/* Load candidates c[0..n_c) of a long message's own blocks so that the message's end (its last
** q_tokens: the question and the end of its turn) stays last, right before the assistant prefix,
** as the recovery before a message puts what it brings back before the message: the blocks holding that end are
** lifted, the candidates loaded, and those blocks placed back after them (RoPE re-anchoring, no
** forward pass).  Loaded after the question instead, a document fragment sits between the end of
** the user's turn and the reply, and models go on with the document (issue #23). */
static int load_before_question(kvt_session *s, struct cand *c, int32_t n_c, int32_t q_tokens, const int32_t *hold,
                                int32_t n_hold) {
    int rc = kvt__sess_seal(s); /* the question's last block too: it moves as a whole */
    if (rc) return rc;
    /* the blocks holding the message's end: the last ones back to q_tokens (all just decoded) */
    int32_t first = s->n_b;
    for (int32_t covered = 0; first > 0 && covered < q_tokens; covered += s->b[--first].info.n_tokens)
        if (s->b[first - 1].info.residency != KVT_RES_DEVICE || !s->b[first - 1].info.sealed) break;
    /* room first, with those blocks resident and pinned for the while (the question is what the
    ** reply needs most; lifted, they would also move the recent-tail protection to older blocks
    ** and leave less to evict), and so are hold[0..n_hold): resident blocks that answer the
    ** question already (the room for what comes back must not be made by evicting them); the
    ** weakest candidates are dropped while they do not fit, as load_candidates does,
    ** which then finds the room made */
    int32_t need = 0, pin[16], keep[16], n_pin = 0;
    first = s->n_b - KVT_MIN(s->n_b - first, 8);
    for (int32_t i = first; i < s->n_b; i++) pin[n_pin++] = i;
    for (int32_t j = 0; j < n_hold && n_pin < 16; j++)
        if (hold[j] < first) pin[n_pin++] = hold[j];
    for (int32_t k = 0; k < n_c; k++) need += s->b[c[k].i].info.n_tokens;
    for (int32_t j = 0; j < n_pin; j++) {
        keep[j] = s->b[pin[j]].info.keep;
        s->b[pin[j]].info.keep = KVT_KEEP_PIN;
    }
    while (n_c > 0 && kvt__sess_make_room(s, need + s->p.gen_reserve) == KVT_EBUDGET) need -= s->b[c[--n_c].i].info.n_tokens;
    kvt__clear_error();
    for (int32_t j = 0; j < n_pin; j++) s->b[pin[j]].info.keep = keep[j];
    if (n_c == 0) return 0;
    int32_t q_held = 0;
    for (int32_t i = first; i < s->n_b; i++) q_held += s->b[i].info.n_tokens;
    for (int32_t i = first; i < s->n_b; i++) kvt__sess_lift_block(s, i);
    rc = load_candidates(s, c, n_c, q_held + s->p.gen_reserve);
    for (int32_t i = first; i < s->n_b; i++) {
        int rc2 = kvt__sess_place_block(s, i); /* placed back even when a candidate failed to load */
        if (rc == 0) rc = rc2;
    }
    return rc;
}

/* The InfLLM plan: room for the blocks plus `extra` (the weakest dropped while they do not fit),
** the open block sealed, the blocks loaded best first. */
static int load_by_score(kvt_session *s, const struct cand *c, int32_t n_c, int32_t extra) {
    int rc = 0;
    int32_t need = 0;
    for (int32_t k = 0; k < n_c; k++) need += s->b[c[k].i].info.n_tokens;
    while (n_c > 0 && kvt__sess_make_room(s, need + extra) == KVT_EBUDGET) need -= s->b[c[--n_c].i].info.n_tokens;
    kvt__clear_error();
    if (n_c > 0) rc = kvt__sess_seal(s);
    for (int32_t k = 0; rc == 0 && k < n_c; k++) rc = kvt__sess_load_block(s, c[k].i); /* lost copies: recomputed */
    return rc;
}

int kvt__sess_recover_apply(kvt_session *s, struct rplan *p) {
    static const char *const where[] = { "at the tail, in their order", "at the tail, best first", "before the question" };
    int rc = 0;
    const int64_t rec0 = s->st.recoveries;
    if (p->n_c > 0 && (s->p.explain || getenv("KVT_DEBUG_RECOVERY"))) {
        char line[768];
        int o = snprintf(line, sizeof line, "recover %d blocks %s:", p->n_c, where[p->where]);
        for (int32_t k = 0; k < p->n_c && o > 0 && o < (int) sizeof line; k++)
            o += snprintf(line + o, sizeof line - (size_t) o, " blk%d=%.2f", s->b[p->c[k].i].info.id, p->c[k].score);
        kvt__sess_explain(s, "%s", line);
    }
    if (p->n_move > 0) rc = load_with_moves(s, p->c, p->n_c, p->extra, p->move, p->n_move);
    else if (p->n_c > 0) switch (p->where) {
            case RPLAN_TAIL: rc = load_candidates(s, p->c, p->n_c, p->extra); break;
            case RPLAN_TAIL_BY_SCORE: rc = load_by_score(s, p->c, p->n_c, p->extra); break;
            case RPLAN_BEFORE_QUESTION: rc = load_before_question(s, p->c, p->n_c, p->q_tokens, p->hold, p->n_hold); break;
        }
    if (p->n_c > 0 || p->n_move > 0)
        kvt__sess_explain(s, "recovered %lld of the %d blocks (the weakest are dropped while they do not fit), moved %d%s",
                          (long long) (s->st.recoveries - rec0), p->n_c, p->n_move, rc ? " (stopped by an error)" : "");
    if (p->show && getenv("KVT_DEBUG_RECOVERY")) /* what the reply will see (block order; p0: position) */
        for (int32_t i = 0; i < s->n_b; i++)
            if (s->b[i].info.residency == KVT_RES_DEVICE)
                fprintf(stderr, "[recovery]   resident blk%d p0 %d n %d%s \"%.60s\"\n", s->b[i].info.id, s->b[i].info.p0,
                        s->b[i].info.n_tokens, s->b[i].info.n_recoveries ? " (recovered)" : "", s->b[i].text ? s->b[i].text : "");
    free(p->c);
    memset(p, 0, sizeof *p);
    return rc;
}
