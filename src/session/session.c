/* session.c — a session's lifetime: parameters, open/free, statistics, the block table as the
** caller sees it, and park/resume (a parked session holds no cells: its resident blocks are saved
** to the pool and come back at the positions they had).  The jobs of a session are spread over
** src/session/ and its neighbours; session_int.h lists which file does what. */
#include "session/session_int.h"
#include "test_hooks.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_uint g_serial;

struct kvt_session_params kvt_session_default_params(void) {
    struct kvt_session_params p;
    memset(&p, 0, sizeof p);
    p.seq = 0;
    p.budget = 512;
    p.block = 64;
    p.high_watermark = 0.95f;
    p.low_watermark = 0.75f;
    p.n_sink_blocks = 1;
    p.n_recent_blocks = 1;
    p.recovery = KVT_RECOVERY_KV_RESTORE;
    p.top_k = 4;
    p.gen_reserve = 64;
    p.min_recovery_score = 3.0f;
    p.policy = KVT_POLICY_KVTIER;
    p.snap_window = 32;
    p.ewma_alpha = 0.3f;
    p.template_fallback = "gemma";
    p.min_recovery_cosine = 0.5f;
    p.ann_min_blocks = 1024;
    p.successor_blocks = 1;
    return p;
}

int kvt_session_open(kvt_engine *eng, const struct kvt_session_params *params, kvt_session **out) {
    struct kvt_session_params p = params ? *params : kvt_session_default_params();
    struct kvt_engine_info I;
    *out = NULL;
    kvt__clear_error();
    kvt_engine_info(eng, &I);
    if (p.block < 1 || p.block > 4096) return kvt__fail(KVT_EINVAL, "block size %d is outside 1..4096 tokens", p.block);
    if (p.budget < 2 * p.block)
        return kvt__fail(KVT_EINVAL, "budget %d is smaller than two blocks of %d tokens", p.budget, p.block);
    if (p.policy < 0 || p.policy >= KVT_POLICY__COUNT)
        return kvt__fail(KVT_EINVAL, "policy %d is not one of the %d known policies", p.policy, KVT_POLICY__COUNT);
    if (p.policy == KVT_POLICY_NO_EVICTION) p.budget = I.n_ctx_seq; /* the reference keeps everything */
    if (p.policy == KVT_POLICY_INFLLM) p.recovery = KVT_RECOVERY_KV_RESTORE;
    else if (p.policy != KVT_POLICY_KVTIER && p.policy != KVT_POLICY_NO_EVICTION) p.recovery = KVT_RECOVERY_DISCARD;
    if (p.policy != KVT_POLICY_NO_EVICTION && I.n_ctx_train > 0 && p.budget > I.n_ctx_train)
        return kvt__fail(KVT_EINVAL, "budget %d exceeds the model's trained context of %d positions", p.budget, I.n_ctx_train);
    if (p.budget > I.n_ctx_seq)
        return kvt__fail(KVT_EINVAL, "budget %d exceeds the %d cells one sequence can hold (%s)", p.budget, I.n_ctx_seq,
                         I.kv_unified ? "the context" : "its KV stream: n_ctx / n_seq");
    if (!(p.low_watermark > 0 && p.low_watermark < p.high_watermark && p.high_watermark <= 1))
        return kvt__fail(KVT_EINVAL, "watermarks low %.2f / high %.2f must satisfy 0 < low < high <= 1", p.low_watermark,
                         p.high_watermark);
    if (p.seq < 0 || p.seq >= I.n_seq) return kvt__fail(KVT_EINVAL, "sequence %d is outside 0..%d", p.seq, I.n_seq - 1);
    if (kvt_seq_n_cells(eng, p.seq) != 0) return kvt__fail(KVT_EINVAL, "sequence %d is not empty", p.seq);
    if (p.recovery < KVT_RECOVERY_KV_RESTORE || p.recovery > KVT_RECOVERY_BREADCRUMB)
        return kvt__fail(KVT_EINVAL, "recovery mode %d is not kv_restore (0), discard (1) or breadcrumb (2)", p.recovery);
    if (p.snap_window < 1 || !(p.ewma_alpha > 0 && p.ewma_alpha <= 1))
        return kvt__fail(KVT_EINVAL, "snap_window %d must be >= 1 and ewma_alpha %.2f in (0, 1]", p.snap_window, p.ewma_alpha);
    for (int32_t i = 0; i < p.n_attn_layers; i++)
        if (!p.attn_layers || p.attn_layers[i] < 0 || p.attn_layers[i] >= I.n_layer)
            return kvt__fail(KVT_EINVAL, "attention layer %d is outside 0..%d", p.attn_layers ? p.attn_layers[i] : -1,
                             I.n_layer - 1);
    if (p.top_k < 0 || p.gen_reserve < 0 || p.n_sink_blocks < 0 || p.n_recent_blocks < 0 || p.successor_blocks < 0)
        return kvt__fail(KVT_EINVAL, "top_k %d, gen_reserve %d, sink %d, recent %d and successor %d blocks must be >= 0", p.top_k,
                         p.gen_reserve, p.n_sink_blocks, p.n_recent_blocks, p.successor_blocks);
    if (p.embedder && (!(p.min_recovery_cosine >= -1 && p.min_recovery_cosine <= 1) || p.ann_min_blocks < 1))
        return kvt__fail(KVT_EINVAL, "min_recovery_cosine %.2f must be in [-1, 1] and ann_min_blocks %d >= 1",
                         p.min_recovery_cosine, p.ann_min_blocks);
    if (p.pool && p.store)
        return kvt__fail(KVT_EINVAL, "kvt_session_open: both a pool and a store given: with a store the session "
                                     "keeps its block copies in the store (its private entries); pass pool NULL");
    int rce = kvt__sess_elastic_check(&p);
    if (rce) return rce;
    struct kvt_codec_params codec = kvt_codec_default_params(KVT_CODEC_RAW);
    if (p.codec_ram && kvt_codec_parse(p.codec_ram, &codec)) {
        char why[256];
        snprintf(why, sizeof why, "%s", kvt_errmsg()); /* kvt__fail writes the message buffer */
        return kvt__fail(KVT_EINVAL, "codec_ram: %s", why);
    }
    codec.n_head_kv = I.n_head_kv;
    if (p.codec_ram_bits || p.n_codec_ram_bits) { /* per-head bits: checked as the codec will */
        codec.head_bits = p.codec_ram_bits;
        codec.n_head_bits = p.n_codec_ram_bits;
        if (p.n_codec_ram_bits != I.n_layer * I.n_head_kv)
            return kvt__fail(KVT_EINVAL, "codec_ram_bits: %d entries for a model of %d layers x %d KV heads", p.n_codec_ram_bits,
                             I.n_layer, I.n_head_kv);
        if (kvt__codec_check(&codec)) {
            char why[256];
            snprintf(why, sizeof why, "%s", kvt_errmsg());
            return kvt__fail(KVT_EINVAL, "codec_ram_bits: %s", why);
        }
        codec.head_bits = NULL; /* the session's copy, made below */
    }
    int32_t chunk_k_tok = -1;
    double chunk_k_pct = 15;
    if (p.chunk_recompute && kvt_chunk_recompute_parse(p.chunk_recompute, &chunk_k_tok, &chunk_k_pct)) {
        char why[256];
        snprintf(why, sizeof why, "%s", kvt_errmsg());
        return kvt__fail(KVT_EINVAL, "chunk_recompute: %s", why);
    }
    if (p.chunk_reuse && !p.store) return kvt__fail(KVT_EINVAL, "chunk_reuse needs a block store (store is NULL)");
    kvt_session *s = calloc(1, sizeof *s);
    if (!s) return kvt__fail(KVT_ENOMEM, "session");
    s->chunk.k_tok = chunk_k_tok;
    s->chunk.k_pct = chunk_k_pct;
    s->codec = codec;
    p.codec_ram = NULL;       /* the caller's string: parsed into s->codec */
    p.chunk_recompute = NULL; /* parsed into chunk_k_tok / chunk_k_pct */
    s->eng = eng;
    s->rcv.emb_dim = p.embedder ? kvt_embedder_dim(p.embedder) : 0;
    s->p = p;
    s->open = -1;
    s->n_vocab = I.n_vocab;
    s->pos_limit = I.n_ctx_train > 0 ? I.n_ctx_train : INT32_MAX / 2;
    s->serial = atomic_fetch_add(&g_serial, 1) + 1;
    s->conv.kv_text = strdup("");
    if (!s->conv.kv_text) {
        free(s);
        return kvt__fail(KVT_ENOMEM, "session");
    }
    int rc0 = 0;
    if (p.policy == KVT_POLICY_H2O || p.policy == KVT_POLICY_SNAPKV || p.policy == KVT_POLICY_KVTIER ||
        p.policy == KVT_POLICY_INFLLM) {
        /* attention signals: the given layers, else the full-attention layers of an iSWA model
        ** (Gemma 3 270M: 5, 11, 17), else three spread layers */
        s->sig.layers = malloc(sizeof(int32_t) * (size_t) (I.n_layer > 3 ? I.n_layer : 3));
        if (!s->sig.layers) rc0 = kvt__fail(KVT_ENOMEM, "layers");
        for (int32_t i = 0; rc0 == 0 && i < p.n_attn_layers; i++) s->sig.layers[s->sig.n_layers++] = p.attn_layers[i];
        if (rc0 == 0 && p.n_attn_layers == 0 && I.n_swa > 0)
            for (int32_t il = 0; il < I.n_layer; il++) {
                int part, idx;
                if (kvt_engine_layer_part(eng, il, &part, &idx) == 0 && part == 0) s->sig.layers[s->sig.n_layers++] = il;
            }
        if (rc0 == 0 && s->sig.n_layers == 0) {
            s->sig.layers[s->sig.n_layers++] = I.n_layer / 4;
            if (I.n_layer > 1) s->sig.layers[s->sig.n_layers++] = I.n_layer / 2;
            if (I.n_layer > 2) s->sig.layers[s->sig.n_layers++] = (3 * I.n_layer) / 4;
        }
        if (rc0 == 0) rc0 = kvt_attn_capture(eng, s->sig.layers, s->sig.n_layers, p.policy == KVT_POLICY_INFLLM);
        s->sig.n_head = I.n_head;
        if (rc0 == 0 && p.head_profile) {
            s->sig.head_w = malloc(sizeof(float) * (size_t) s->sig.n_layers * (size_t) I.n_head);
            rc0 = s->sig.head_w ? kvt_head_weights_load(p.head_profile, s->sig.layers, s->sig.n_layers, I.n_head, s->sig.head_w)
                                : kvt__fail(KVT_ENOMEM, "head weights");
        }
        s->rcv.rep_layer = s->sig.layers[s->sig.n_layers / 2];
        if (rc0) {
            free(s->sig.head_w);
            free(s->sig.layers);
            free(s->conv.kv_text);
            free(s);
            return rc0;
        }
        s->p.attn_layers = s->sig.layers;
        s->p.n_attn_layers = s->sig.n_layers;
    }
    if (p.pool) {
        s->pool = p.pool;
    } else if (!p.store) {
        struct kvt_pool_params pp = kvt_pool_default_params();
        int rc = kvt_pool_open(&pp, &s->pool);
        if (rc) {
            free(s->sig.head_w);
            free(s->sig.layers);
            free(s->conv.kv_text);
            free(s);
            return rc;
        }
        s->own_pool = true;
    }
    if (p.tenant && *p.tenant && !(s->reuse.tenant = strdup(p.tenant))) {
        kvt_session_free(s);
        return kvt__fail(KVT_ENOMEM, "tenant");
    }
    if (p.codec_ram_bits) {
        if (!(s->codec_bits = malloc((size_t) p.n_codec_ram_bits))) {
            kvt_session_free(s);
            return kvt__fail(KVT_ENOMEM, "codec_ram_bits");
        }
        memcpy(s->codec_bits, p.codec_ram_bits, (size_t) p.n_codec_ram_bits);
        s->codec.head_bits = s->p.codec_ram_bits = s->codec_bits;
    }
    s->p.tenant = s->reuse.tenant;
    s->reuse.chain_ok = p.store != NULL;
    *out = s;
    return 0;
}

void kvt_session_free(kvt_session *s) {
    if (!s) return;
    if (!s->is_parked) kvt_seq_rm(s->eng, s->p.seq, -1, -1);
    for (int32_t i = 0; i < s->n_b; i++) {
        if (s->b[i].info.sealed && s->b[i].info.residency != KVT_RES_LOST) kvt__sess_copy_del(s, &s->b[i]);
        free(s->b[i].tok);
        free(s->b[i].text);
        free(s->b[i].tok_mass);
        free(s->b[i].rep);
        free(s->b[i].emb);
    }
    kvt_ann_free(s->rcv.ann);
    for (int32_t i = 0; i < s->conv.n_m; i++) free(s->conv.m[i].content);
    if (s->own_pool) kvt_pool_free(s->pool);
    free(s->b);
    free(s->conv.m);
    free(s->conv.kv_text);
    free(s->sig.layers);
    free(s->sig.head_w);
    free(s->conv.seg_tok);
    free(s->conv.seg_chr);
    free(s->dec.logits);
    free(s->dec.prompt_logits);
    free(s->dec.gen);
    free(s->reuse.tenant);
    free(s->codec_bits);
    free(s);
}

void kvt_session_get_stats(kvt_session *s, struct kvt_session_stats *st) {
    memset(st, 0, sizeof *st);
    st->resident_tokens = kvt__sess_resident(s);
    st->peak_resident_tokens = s->st.peak;
    st->total_tokens = s->total;
    st->n_blocks = s->n_b;
    for (int32_t i = 0; i < s->n_b; i++) {
        struct blk *b = &s->b[i];
        kvt__sess_refresh_residency(s, b);
        switch (b->info.residency) {
            case KVT_RES_DEVICE: st->n_blocks_resident++; break;
            case KVT_RES_HOST: st->n_blocks_host++; break;
            case KVT_RES_DISK: st->n_blocks_disk++; break;
            default: st->n_blocks_lost++; break;
        }
    }
    st->evictions = s->st.evictions;
    st->recoveries = s->st.recoveries;
    st->tokens_decoded = s->st.decoded;
    st->tokens_recovered = s->st.recovered;
    st->recomputes = s->st.recomputes;
    st->next_pos = s->next_pos;
    st->compactions = s->st.compactions;
    st->policy_ms = s->st.policy_ms;
    st->decode_ms = s->st.decode_ms;
    if (s->p.store) kvt_store_private_stats(s->p.store, &st->pool);
    else kvt_pool_get_stats(s->pool, &st->pool);
    st->route = kvt__sess_route_kind(s->reuse.route_want, s->reuse.route_tokens);
    st->route_tokens = s->reuse.route_tokens;
    st->route_lookup_tokens = s->reuse.route_want;
    st->store_tokens = s->st.store_tokens;
    st->store_blocks_put = s->st.store_put;
    st->store_ms = s->st.store_ms;
    st->store_load_errors = s->st.store_load_errors;
    st->pool_saved_tokens = s->st.pool_tokens;
    st->pool_raw_bytes = s->st.pool_raw_bytes;
    st->pool_stored_bytes = s->st.pool_bytes;
    st->codec_encode_ms = s->st.codec_enc_ms;
    st->codec_decode_ms = s->st.codec_dec_ms;
    kvt__sess_elastic_stats(s, st);
    st->chunk_tokens = s->st.chunk_tokens;
    st->chunk_recompute_tokens = s->st.chunk_recompute_tokens;
    st->chunk_runs = s->st.chunk_runs;
    st->chunk_blocks_put = s->st.chunk_put;
    st->chunk_load_errors = s->st.chunk_load_errors;
    st->chunk_scan_ms = s->st.chunk_scan_ms;
}

int32_t kvt_session_n_blocks(const kvt_session *s) { return s->n_b; }

int kvt_session_block(kvt_session *s, int32_t i, struct kvt_block_info *info) {
    if (i < 0 || i >= s->n_b) return kvt__fail(KVT_EINVAL, "block %d is outside 0..%d", i, s->n_b - 1);
    struct blk *b = &s->b[i];
    kvt__sess_refresh_residency(s, b);
    if (!b->info.sealed) { /* the open tail block: role and text as of now */
        b->info.role = kvt__sess_block_role(b);
        char *t = NULL;
        if (kvt_detokenize(s->eng, b->tok, b->info.n_tokens, false, &t) == 0) {
            free(b->text);
            b->text = t;
        }
    }
    *info = b->info;
    info->text = b->text ? b->text : "";
    return 0;
}

int kvt_session_park(kvt_session *s) {
    kvt__clear_error();
    if (s->is_parked) return 0;
    if (s->dec.generating) return kvt__fail(KVT_EINVAL, "park: a reply is being generated (call kvt_session_gen_end first)");
    int rc = kvt__sess_seal(s); /* the open block is saved as it is (sealed early) */
    if (rc) return rc;
    for (int32_t i = 0; i < s->n_b; i++) {
        struct blk *b = &s->b[i];
        b->parked = b->info.residency == KVT_RES_DEVICE; /* info.p0 keeps its position for resume */
        if (b->parked) b->info.residency = KVT_RES_HOST;
    }
    kvt_seq_rm(s->eng, s->p.seq, -1, -1);
    s->is_parked = true;
    free(s->dec.prompt_logits); /* n_vocab floats a session: parked ones do not keep them */
    s->dec.prompt_logits = NULL;
    s->dec.prompt_total = -1;
    return 0;
}

int kvt_session_resume(kvt_session *s, int32_t seq) {
    kvt__clear_error();
    if (!s->is_parked) return kvt__fail(KVT_EINVAL, "resume: the session is not parked");
    struct kvt_engine_info I;
    kvt_engine_info(s->eng, &I);
    if (seq < 0 || seq >= I.n_seq) return kvt__fail(KVT_EINVAL, "sequence %d is outside 0..%d", seq, I.n_seq - 1);
    if (kvt_seq_n_cells(s->eng, seq) != 0) return kvt__fail(KVT_EINVAL, "sequence %d is not empty", seq);
    s->p.seq = seq;
    s->is_parked = false;
    int rc = 0;
    for (;;) { /* each block back at the position it had, in position order (gaps kept) */
        int32_t i = -1;
        for (int32_t k = 0; k < s->n_b; k++)
            if (s->b[k].parked && (i < 0 || s->b[k].info.p0 < s->b[i].info.p0)) i = k;
        if (i < 0) break;
        struct blk *b = &s->b[i];
        b->parked = false;
        if (rc) {
            b->info.residency = KVT_RES_HOST;
            continue;
        }
        s->next_pos = b->info.p0;
        rc = kvt__sess_load_block(s, i); /* a block whose copy is gone is recomputed at the tail */
    }
    /* the tail as it now is: `end` when every block came back in place; lower when a block was
    ** recomputed behind a gap or the resume failed (the blocks not back stay evicted, HOST) */
    s->next_pos = kvt_seq_pos_max(s->eng, s->p.seq) + 1;
    return rc;
}

int64_t kvt_session_test_given_tokens(const kvt_session *s) { return s->st.given_tokens; }

void kvt_session_test_no_resident_successors(kvt_session *s, bool on) { s->rcv.no_resident_successors = on; }
