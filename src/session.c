/* session.c — one conversation in one llama.cpp sequence under a token budget.
**
** The KV of the conversation is managed in blocks of `block` consecutive positions (vLLM's
** paged blocks).  A block is saved to the host pool the moment it is complete ("sealed"):
** write-through, as LMCache does, so that eviction is only a seq_rm and the sliding-window
** cells of iSWA models are captured while they still exist.  Eviction is watermark-triggered
** (above high * budget, down to low * budget) and scored (recency by default); the first block
** is an attention sink (StreamingLLM) and the recent tail is kept.  Before a user turn, the
** evicted blocks most relevant to the message (BM25) are loaded back at the tail with RoPE
** re-anchoring instead of being recomputed (EVOKE-style recovery). */
#include "internal.h"
#include "policy.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct blk {
    struct kvt_block_info info; /* info.text points at text */
    kvt_token *tok;             /* [block] */
    int32_t    role_n[3];       /* tokens per role */
    float     *tok_mass;        /* [block] attention each token received (InfLLM representatives) */
    float     *rep;             /* InfLLM: n_rep x row representative keys, un-rotated */
    int32_t    n_rep;
    char      *text;
    uint64_t   key;             /* pool key (sealed blocks) */
    kvt_pos    blob_p0;         /* position the saved K is rotated for */
    int32_t    blob_cells, blob_cells_swa;
    size_t     blob_bytes;
    float     *emb;             /* [emb_dim] unit vector of the text (with an embedder), else NULL */
    bool       parked;          /* resident when the session was parked: comes back on resume */
};

struct msg {
    int   role;
    int   keep;
    char *content;
};

struct kvt_session {
    kvt_engine *eng;
    struct kvt_session_params p;
    kvt_pool   *pool;
    bool        own_pool;
    uint32_t    serial;
    struct blk *b;
    int32_t     n_b, cap_b;
    int32_t     open;           /* index of the open tail block, -1 if none */
    kvt_pos     next_pos;
    struct msg *m;
    int32_t     n_m, cap_m, n_m_decoded;
    char       *kv_text;        /* template text whose tokens are in the stream */
    int32_t     turn;
    int32_t     peak, total;
    int64_t     evictions, recoveries, decoded, recovered;
    int32_t     n_vocab;
    int32_t     cur_keep;       /* keep hint of the message being decoded */
    int32_t     n_layers;       /* attention layers observed (0 = no attention signals) */
    int32_t    *layers;
    float      *head_w;         /* [n_layers * n_head] from head_profile, NULL = equal */
    int32_t     n_head;
    double      policy_ms;      /* signals + scoring + bookkeeping (not the primitives) */
    int32_t     rep_layer;      /* InfLLM: layer of the representative keys */
    int32_t     rep_row;        /* floats per representative key row (n_head_kv * head_dim) */
    double      decode_ms;      /* time in kvt_decode for this session's tokens */
    int32_t     emb_dim;        /* embedder width, 0 without one */
    kvt_ann    *ann;            /* HNSW over block vectors once ann_min_blocks are sealed */
    double      embed_ms;       /* time embedding blocks and messages */
    /* segment boundaries (tokens in the stream, bytes of kv_text) wherever kv_text was extended:
    ** a conversation that diverges from kv_text is cut back to the last boundary before the
    ** divergence and re-fed from there (cut_stream) */
    int32_t    *seg_tok;
    size_t     *seg_chr;
    int32_t     n_seg, cap_seg;
    /* logits after this session's last token (the engine's are shared by every session) */
    float      *logits;
    bool        have_logits;
    kvt_token  *gen;            /* reply being generated step-wise (kvt_session_gen_step) */
    int32_t     n_gen, cap_gen;
    bool        generating;
    bool        is_parked;      /* kvt_session_park: no cells, no sequence */
    kvt_chunk_cb chunk_cb;      /* called between prefill chunks (kvt_session_set_chunk_cb) */
    void       *chunk_ud;
};

static atomic_uint g_serial;
static const char *role_name[] = { "system", "user", "assistant" };

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

double kvt_scorer_recency(const struct kvt_block_info *b, kvt_pos now, void *ud) {
    (void) now;
    (void) ud;
    return (double) (b->p0 + b->n_tokens);
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
    if (p.policy == KVT_POLICY_NO_EVICTION) p.budget = I.n_ctx; /* the reference keeps everything */
    if (p.policy == KVT_POLICY_INFLLM) p.recovery = KVT_RECOVERY_KV_RESTORE;
    else if (p.policy != KVT_POLICY_KVTIER && p.policy != KVT_POLICY_NO_EVICTION) p.recovery = KVT_RECOVERY_DISCARD;
    if (p.budget > I.n_ctx)
        return kvt__fail(KVT_EINVAL, "budget %d exceeds the context of %d tokens", p.budget, I.n_ctx);
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
        return kvt__fail(KVT_EINVAL, "top_k %d, gen_reserve %d, sink %d, recent %d and successor %d blocks must be >= 0",
                         p.top_k, p.gen_reserve, p.n_sink_blocks, p.n_recent_blocks, p.successor_blocks);
    if (p.embedder && (!(p.min_recovery_cosine >= -1 && p.min_recovery_cosine <= 1) || p.ann_min_blocks < 1))
        return kvt__fail(KVT_EINVAL, "min_recovery_cosine %.2f must be in [-1, 1] and ann_min_blocks %d >= 1",
                         p.min_recovery_cosine, p.ann_min_blocks);
    kvt_session *s = calloc(1, sizeof *s);
    if (!s) return kvt__fail(KVT_ENOMEM, "session");
    s->eng = eng;
    s->emb_dim = p.embedder ? kvt_embedder_dim(p.embedder) : 0;
    s->p = p;
    s->open = -1;
    s->n_vocab = I.n_vocab;
    s->serial = atomic_fetch_add(&g_serial, 1) + 1;
    s->kv_text = strdup("");
    if (!s->kv_text) { free(s); return kvt__fail(KVT_ENOMEM, "session"); }
    int rc0 = 0;
    if (p.policy == KVT_POLICY_H2O || p.policy == KVT_POLICY_SNAPKV || p.policy == KVT_POLICY_KVTIER ||
        p.policy == KVT_POLICY_INFLLM) {
        /* attention signals: the given layers, else the full-attention layers of an iSWA model
        ** (Gemma 3 270M: 5, 11, 17), else three spread layers */
        s->layers = malloc(sizeof(int32_t) * (size_t) (I.n_layer > 3 ? I.n_layer : 3));
        if (!s->layers) rc0 = kvt__fail(KVT_ENOMEM, "layers");
        for (int32_t i = 0; rc0 == 0 && i < p.n_attn_layers; i++) s->layers[s->n_layers++] = p.attn_layers[i];
        if (rc0 == 0 && p.n_attn_layers == 0 && I.n_swa > 0)
            for (int32_t il = 0; il < I.n_layer; il++) {
                int part, idx;
                if (kvt_engine_layer_part(eng, il, &part, &idx) == 0 && part == 0) s->layers[s->n_layers++] = il;
            }
        if (rc0 == 0 && s->n_layers == 0) {
            s->layers[s->n_layers++] = I.n_layer / 4;
            if (I.n_layer > 1) s->layers[s->n_layers++] = I.n_layer / 2;
            if (I.n_layer > 2) s->layers[s->n_layers++] = (3 * I.n_layer) / 4;
        }
        if (rc0 == 0) rc0 = kvt_attn_capture(eng, s->layers, s->n_layers, p.policy == KVT_POLICY_INFLLM);
        s->n_head = I.n_head;
        if (rc0 == 0 && p.head_profile) {
            s->head_w = malloc(sizeof(float) * (size_t) s->n_layers * (size_t) I.n_head);
            rc0 = s->head_w ? kvt_head_weights_load(p.head_profile, s->layers, s->n_layers, I.n_head, s->head_w)
                            : kvt__fail(KVT_ENOMEM, "head weights");
        }
        s->rep_layer = s->layers[s->n_layers / 2];
        if (rc0) { free(s->head_w); free(s->layers); free(s->kv_text); free(s); return rc0; }
        s->p.attn_layers = s->layers;
        s->p.n_attn_layers = s->n_layers;
    }
    if (p.pool) {
        s->pool = p.pool;
    } else {
        struct kvt_pool_params pp = kvt_pool_default_params();
        int rc = kvt_pool_open(&pp, &s->pool);
        if (rc) { free(s->head_w); free(s->layers); free(s->kv_text); free(s); return rc; }
        s->own_pool = true;
    }
    *out = s;
    return 0;
}

void kvt_session_free(kvt_session *s) {
    if (!s) return;
    if (!s->is_parked) kvt_seq_rm(s->eng, s->p.seq, -1, -1);
    for (int32_t i = 0; i < s->n_b; i++) {
        if (s->b[i].info.sealed && s->b[i].info.residency != KVT_RES_LOST) kvt_pool_del(s->pool, s->b[i].key);
        free(s->b[i].tok);
        free(s->b[i].text);
        free(s->b[i].tok_mass);
        free(s->b[i].rep);
        free(s->b[i].emb);
    }
    kvt_ann_free(s->ann);
    for (int32_t i = 0; i < s->n_m; i++) free(s->m[i].content);
    if (s->own_pool) kvt_pool_free(s->pool);
    free(s->b);
    free(s->m);
    free(s->kv_text);
    free(s->layers);
    free(s->head_w);
    free(s->seg_tok);
    free(s->seg_chr);
    free(s->logits);
    free(s->gen);
    free(s);
}

/* ---------------------------------------------------------------------------------------- */
/* block table                                                                              */

static int32_t resident(const kvt_session *s) { return s->is_parked ? 0 : kvt_seq_n_cells(s->eng, s->p.seq); }

static int parked_error(void) { return kvt__fail(KVT_EINVAL, "the session is parked (kvt_session_resume it first)"); }

static void note_peak(kvt_session *s) {
    int32_t r = resident(s);
    if (r > s->peak) s->peak = r;
}

static int block_role(const struct blk *b) {
    int best = 0;
    for (int r = 1; r < 3; r++)
        if (b->role_n[r] > b->role_n[best]) best = r;
    return best;
}

enum { N_REP = 4, INFLLM_WINDOW = 32 };

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
    if (kvt_engine_layer_part(s->eng, s->rep_layer, &part, &idx) ||
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
                for (int32_t h = 0; h < I.n_head_kv; h++) kvt__engine_rotate(s->eng, s->rep_layer, dst + h * hd, hd, -pos[c]);
                b->n_rep++;
                break;
            }
    s->rep_row = row;
    kvt__clear_error();
    free(K);
    free(pos);
}

/* Seal the open block: save its K/V to the pool (write-through) and detokenize its text.
** On error the block stays open and resident; nothing is lost. */
/* With an embedder: the block's text vector, and into the HNSW index once the session has
** ann_min_blocks sealed blocks (the earlier ones are added when the index is built).  Best
** effort: a block that cannot be embedded is only invisible to dense recovery. */
static void embed_block(kvt_session *s, struct blk *b) {
    double t0 = kvt__now_ms();
    if (!b->text || !b->text[0]) return;
    if (!(b->emb = malloc(sizeof(float) * (size_t) s->emb_dim))) return;
    if (kvt_embed(s->p.embedder, b->text, b->emb) != 0) {
        free(b->emb);
        b->emb = NULL;
        kvt__clear_error();
        return;
    }
    if (!s->ann && b->info.id + 1 >= s->p.ann_min_blocks) {
        if (kvt_ann_open(s->emb_dim, 2 * s->p.ann_min_blocks, 0, 0, &s->ann) == 0)
            for (int32_t i = 0; i < b->info.id; i++)
                if (s->b[i].emb) kvt_ann_add(s->ann, (uint64_t) i, s->b[i].emb);
    }
    if (s->ann) kvt_ann_add(s->ann, (uint64_t) b->info.id, b->emb);
    kvt__clear_error();
    s->embed_ms += kvt__now_ms() - t0;
}

static int seal(kvt_session *s) {
    if (s->open < 0) return 0;
    struct blk *b = &s->b[s->open];
    kvt_blob *blob = NULL;
    int rc = kvt_block_save(s->eng, s->p.seq, b->info.p0, b->info.p0 + b->info.n_tokens, &blob);
    if (rc) return rc;
    b->key = ((uint64_t) s->serial << 32) | (uint32_t) b->info.id;
    b->info.pool_key = b->key;
    rc = kvt_pool_put(s->pool, b->key, blob->data, blob->size);
    if (rc && rc != KVT_EIO) { kvt_blob_free(blob); return rc; } /* EIO: kept in RAM over budget */
    b->blob_p0 = blob->p0;
    b->blob_cells = blob->n_cells;
    b->blob_cells_swa = blob->n_cells_swa;
    b->blob_bytes = blob->size;
    if (s->p.policy == KVT_POLICY_INFLLM) pick_representatives(s, b, blob);
    kvt_blob_free(blob);
    free(b->text);
    if ((rc = kvt_detokenize(s->eng, b->tok, b->info.n_tokens, false, &b->text))) {
        b->text = NULL;
        kvt_pool_del(s->pool, b->key);
        return rc;
    }
    b->info.text = b->text;
    b->info.role = block_role(b);
    b->info.sealed = true;
    s->open = -1;
    if (s->emb_dim > 0) embed_block(s, b);
    return 0;
}

/* Record tokens[0..n) just decoded at positions next_pos.. in the block table, sealing blocks
** as they fill. */
static int record(kvt_session *s, const kvt_token *tok, int32_t n, int role) {
    for (int32_t i = 0; i < n; i++) {
        if (s->open < 0) {
            if (s->n_b == s->cap_b) {
                int32_t cap = s->cap_b ? 2 * s->cap_b : 64;
                struct blk *nb = realloc(s->b, sizeof *nb * (size_t) cap);
                if (!nb) return kvt__fail(KVT_ENOMEM, "block table of %d blocks", cap);
                for (int32_t j = 0; j < s->n_b; j++) nb[j].info.text = nb[j].text; /* keep aliases valid */
                s->b = nb;
                s->cap_b = cap;
            }
            struct blk *b = &s->b[s->n_b];
            memset(b, 0, sizeof *b);
            if (!(b->tok = malloc(sizeof(kvt_token) * (size_t) s->p.block))) return kvt__fail(KVT_ENOMEM, "block");
            if (!(b->tok_mass = calloc((size_t) s->p.block, sizeof(float)))) return kvt__fail(KVT_ENOMEM, "block");
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
        if (b->info.n_tokens == s->p.block) {
            int rc = seal(s);
            if (rc) return rc;
        }
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

static void evict(kvt_session *s, int32_t i) {
    struct blk *b = &s->b[i];
    kvt_seq_rm(s->eng, s->p.seq, b->info.p0, b->info.p0 + b->info.n_tokens);
    b->info.n_evictions++;
    s->evictions++;
    if (s->p.recovery == KVT_RECOVERY_DISCARD) {
        kvt_pool_del(s->pool, b->key);
        b->info.residency = KVT_RES_LOST;
        return;
    }
    b->info.residency = KVT_RES_HOST; /* kvt_session_get_stats refreshes HOST vs DISK */
}

/* Make room so that `need` more tokens fit: above the high watermark, evict the lowest-scored
** unprotected blocks until resident + need <= low * budget.  Fails with KVT_EBUDGET (and evicts
** nothing more) when even that cannot make resident + need <= budget. */
static int make_room(kvt_session *s, int32_t need) {
    const int32_t budget = s->p.budget;
    if (resident(s) + need <= (int32_t) floorf(s->p.high_watermark * budget)) return 0;
    if (s->p.policy == KVT_POLICY_NO_EVICTION) {
        if (resident(s) + need <= budget) return 0;
        return kvt__fail(KVT_EBUDGET, "no_eviction: %d new tokens do not fit next to %d resident (capacity %d)", need,
                         resident(s), budget);
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
                if (!protected_block(s, i, false) && s->b[i].info.p0 < oldest) { oldest = s->b[i].info.p0; victim = i; }
            if (victim >= 0) evict(s, victim);
        }
    }
    for (int pass = 0; pass < 2 && resident(s) > target; pass++) {
        while (resident(s) > target) {
            int32_t victim = -1;
            double worst = INFINITY;
            for (int32_t i = 0; i < s->n_b; i++) {
                if (protected_block(s, i, pass == 1)) continue;
                const struct kvt_block_info *b = &s->b[i].info;
                double v = s->p.scorer ? s->p.scorer(b, s->next_pos, s->p.scorer_ud) : kvt__score(s->p.policy, b, &sc);
                if (v < worst || (v == worst && victim >= 0 && b->p0 < s->b[victim].info.p0)) { worst = v; victim = i; }
            }
            if (victim < 0) break;
            evict(s, victim);
        }
    }
    if (resident(s) + need > budget)
        return kvt__fail(KVT_EBUDGET, "%d new tokens do not fit the budget of %d tokens: %d resident tokens are "
                         "protected (sink, recent tail, open block, pins)", need, budget, resident(s));
    return 0;
}

/* Turn the attention captured for the last decoded chunk into block signals: H2O's accumulated
** mass, SnapKV's observation-window share (prompt chunks only), kvtier's EWMA.  Best effort: a
** capture that cannot be mapped leaves the signals as they were. */
static void observe(kvt_session *s, bool prompt) {
    if (s->n_layers == 0 || s->n_b == 0) return;
    double t0 = kvt__now_ms();
    kvt_pos *p0 = malloc(sizeof(kvt_pos) * (size_t) s->n_b);
    int32_t *n = malloc(sizeof(int32_t) * (size_t) s->n_b), *idx = malloc(sizeof(int32_t) * (size_t) s->n_b);
    double *all = calloc((size_t) s->n_b, sizeof(double)), *win = calloc((size_t) s->n_b, sizeof(double));
    double *m = malloc(sizeof(double) * (size_t) s->n_b);
    int32_t nb = 0, got = 0;
    if (p0 && n && idx && all && win && m) {
        for (int32_t i = 0; i < s->n_b; i++)
            if (s->b[i].info.residency == KVT_RES_DEVICE) {
                p0[nb] = s->b[i].info.p0;
                n[nb] = s->b[i].info.n_tokens;
                idx[nb++] = i;
            }
        for (int32_t l = 0; l < s->n_layers; l++) {
            kvt_attn *a = NULL;
            if (kvt_attn_get(s->eng, s->layers[l], s->p.seq, &a) != 0) {
                if (getenv("KVT_DEBUG_SIGNALS")) fprintf(stderr, "[signals] layer %d: %s\n", s->layers[l], kvt_errmsg());
                continue;
            }
            if (s->p.policy == KVT_POLICY_INFLLM) /* per-token attention received, for representatives */
                for (int32_t k = 0; k < a->n_keys; k++)
                    for (int32_t j = 0; j < nb; j++) {
                        struct blk *bk = &s->b[idx[j]];
                        if (a->k_pos[k] < p0[j] || a->k_pos[k] >= p0[j] + n[j]) continue;
                        double w = 0;
                        for (int32_t t = 0; t < a->n_query; t++)
                            for (int32_t h = 0; h < a->n_head; h++) w += a->w[((size_t) t * a->n_head + h) * a->n_keys + k];
                        bk->tok_mass[a->k_pos[k] - p0[j]] += (float) w;
                        break;
                    }
            const float *hw = s->head_w && a->n_head == s->n_head ? s->head_w + (size_t) l * s->n_head : NULL;
            if (kvt_attn_block_mass(a, 0, hw, p0, n, nb, m) == 0) {
                for (int32_t j = 0; j < nb; j++) all[j] += m[j] * a->n_query; /* mass summed over queries */
                got++;
            }
            int32_t from = a->n_query > s->p.snap_window ? a->n_query - s->p.snap_window : 0;
            if (prompt && kvt_attn_block_mass(a, from, hw, p0, n, nb, m) == 0)
                for (int32_t j = 0; j < nb; j++) win[j] += m[j];
            kvt_attn_free(a);
        }
    }
    if (got > 0) {
        double total = 0;
        for (int32_t j = 0; j < nb; j++) total += all[j];
        for (int32_t j = 0; j < nb; j++) {
            struct kvt_block_info *b = &s->b[idx[j]].info;
            b->attn_mass += all[j] / got;
            double share = total > 0 ? all[j] / total : 0;
            b->attn_ewma = kvt__ewma(b->attn_ewma, share, s->p.ewma_alpha);
            if (prompt) b->attn_window = win[j] / got;
        }
    }
    kvt__clear_error();
    free(p0); free(n); free(idx); free(all); free(win); free(m);
    s->policy_ms += kvt__now_ms() - t0;
}

/* Keep the engine's logits of this session's last token (sessions share the engine). */
static int save_logits(kvt_session *s) {
    const float *l = kvt_logits(s->eng);
    s->have_logits = false;
    if (!l) return 0;
    if (!s->logits && !(s->logits = malloc(sizeof(float) * (size_t) s->n_vocab))) return kvt__fail(KVT_ENOMEM, "logits");
    memcpy(s->logits, l, sizeof(float) * (size_t) s->n_vocab);
    s->have_logits = true;
    return 0;
}

/* Decode tokens for the conversation, keeping the budget at every chunk. */
static int feed(kvt_session *s, const kvt_token *tok, int32_t n, int role, int32_t reserve_after) {
    struct kvt_engine_info I;
    kvt_engine_info(s->eng, &I);
    if (s->next_pos + n >= INT32_MAX / 2) return kvt__fail(KVT_ECTX, "positions exhausted");
    int32_t off = 0;
    while (off < n) {
        /* chunks end at block boundaries so each completed block is sealed right after it is
        ** decoded (its SWA cells still exist) */
        int32_t room_in_block = s->open >= 0 ? s->p.block - s->b[s->open].info.n_tokens : s->p.block;
        int32_t m = KVT_MIN(n - off, room_in_block);
        bool last = off + m == n;
        double t1 = kvt__now_ms();
        int rc = make_room(s, m + (last ? reserve_after : 0));
        if (rc == KVT_EBUDGET && last && reserve_after) rc = make_room(s, m); /* reply room is best effort */
        s->policy_ms += kvt__now_ms() - t1; /* scoring; the seq_rm of evictions is in here too (cheap) */
        if (rc) return rc;
        double t0 = kvt__now_ms();
        rc = kvt_decode(s->eng, s->p.seq, tok + off, m, s->next_pos, last);
        s->decode_ms += kvt__now_ms() - t0;
        if (rc) return rc;
        if (last && (rc = save_logits(s))) return rc;
        s->decoded += m;
        note_peak(s);
        if ((rc = record(s, tok + off, m, role))) return rc;
        /* prompt chunks always feed the attention signals; generated tokens every 8th (one
        ** token's attention changes the accumulated mass little, and each read costs a copy
        ** of the sequence's cells) */
        if (role != KVT_ROLE_ASSISTANT || s->decoded % 8 == 0) observe(s, role != KVT_ROLE_ASSISTANT);
        off += m;
        if (s->chunk_cb && off < n) s->chunk_cb(s->chunk_ud); /* others may decode between our chunks */
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* recovery                                                                                 */

/* The recompute path: decode the block's tokens again at the tail, then re-save its K/V. */
static int breadcrumb(kvt_session *s, struct blk *b) {
    int rc = kvt_decode(s->eng, s->p.seq, b->tok, b->info.n_tokens, s->next_pos, false);
    if (rc) return rc;
    kvt_blob *blob = NULL;
    if ((rc = kvt_block_save(s->eng, s->p.seq, s->next_pos, s->next_pos + b->info.n_tokens, &blob)) == 0) {
        if ((rc = kvt_pool_put(s->pool, b->key, blob->data, blob->size)) == KVT_EIO) rc = 0;
        b->blob_p0 = blob->p0;
        b->blob_cells = blob->n_cells;
        b->blob_cells_swa = blob->n_cells_swa;
        kvt_blob_free(blob);
    }
    s->decoded += b->info.n_tokens;
    return rc;
}

static int load_block(kvt_session *s, int32_t i) {
    struct blk *b = &s->b[i];
    if (s->p.recovery == KVT_RECOVERY_BREADCRUMB) {
        int rc = breadcrumb(s, b);
        if (rc) return rc;
        goto placed;
    }
    void *data = NULL;
    size_t n = 0;
    int rc = kvt_pool_get(s->pool, b->key, &data, &n);
    if (rc) {
        if (rc == KVT_ECORRUPT) {
            fprintf(stderr, "kvtier: block %d not recovered: %s\n", b->info.id, kvt_errmsg());
            kvt_pool_del(s->pool, b->key);
            b->info.residency = KVT_RES_LOST;
        }
        return rc;
    }
    kvt_blob blob = { data, n, b->blob_p0, b->info.n_tokens, b->blob_cells, b->blob_cells_swa };
    rc = kvt_block_load(s->eng, &blob, s->p.seq, s->next_pos);
    free(data);
    if (rc) return rc;
    s->recovered += b->info.n_tokens;
placed:
    b->info.p0 = s->next_pos;
    b->info.recovered_turn = s->turn;
    b->info.residency = KVT_RES_DEVICE;
    b->info.n_recoveries++;
    b->info.last_use_turn = s->turn;
    s->next_pos += b->info.n_tokens;
    s->recoveries++;
    note_peak(s);
    return 0;
}

struct cand {
    int32_t i;
    double  score;
};

static int cmp_cand(const void *a, const void *b) {
    double x = ((const struct cand *) a)->score, y = ((const struct cand *) b)->score;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Load candidate blocks c[0..n_c) (best first) back at the tail: room is made for them plus
** `extra` tokens (the message and the reply reserve), dropping the weakest (successors first)
** while they do not fit; the open block is sealed first so block ranges never interleave; they
** are loaded in the order of their original positions, so they read as they were said.  A block
** whose saved copy fails its checksum is reported, marked lost and skipped. */
static int load_candidates(kvt_session *s, struct cand *c, int32_t n_c, int32_t extra) {
    int32_t need = 0;
    for (int32_t k = 0; k < n_c; k++) need += s->b[c[k].i].info.n_tokens;
    while (n_c > 0 && make_room(s, need + extra) == KVT_EBUDGET) need -= s->b[c[--n_c].i].info.n_tokens;
    kvt__clear_error();
    int rc = n_c > 0 ? seal(s) : 0;
    for (int32_t k = 0; rc == 0 && k < n_c; k++)
        for (int32_t j = k + 1; j < n_c; j++)
            if (s->b[c[j].i].info.orig_p0 < s->b[c[k].i].info.orig_p0) {
                struct cand t = c[k];
                c[k] = c[j];
                c[j] = t;
            }
    for (int32_t k = 0; rc == 0 && k < n_c; k++) {
        int r = load_block(s, c[k].i);
        if (r != KVT_ECORRUPT) rc = r;
    }
    return rc;
}

/* Dense recovery candidates: evicted blocks whose text vector has cosine >= min_recovery_cosine
** with the message's, from a linear scan, or from the HNSW index once it exists (asked for
** enough neighbours to see past the resident blocks).  OUT c[0..*n_c) unsorted. */
static int dense_candidates(kvt_session *s, const char *query, struct cand *c, int32_t *n_c) {
    double t0 = kvt__now_ms();
    *n_c = 0;
    float *q = malloc(sizeof(float) * (size_t) s->emb_dim);
    if (!q) return kvt__fail(KVT_ENOMEM, "query vector");
    int rc = kvt_embed(s->p.embedder, query, q);
    if (rc) {
        free(q);
        kvt__clear_error(); /* e.g. an empty message: nothing to retrieve with */
        return 0;
    }
#define EVICTED(b) ((b)->info.residency == KVT_RES_HOST || (b)->info.residency == KVT_RES_DISK)
    if (s->ann) {
        int32_t n_res = 0;
        for (int32_t i = 0; i < s->n_b; i++) n_res += !EVICTED(&s->b[i]);
        int32_t k = KVT_MIN(s->n_b, n_res + 4 * s->p.top_k + 16), got = 0;
        uint64_t *ids = malloc(sizeof(uint64_t) * (size_t) k);
        float *sims = malloc(sizeof(float) * (size_t) k);
        if (ids && sims && (rc = kvt_ann_search(s->ann, q, k, ids, sims, &got)) == 0)
            for (int32_t j = 0; j < got; j++)
                if (ids[j] < (uint64_t) s->n_b && EVICTED(&s->b[ids[j]]) && sims[j] >= s->p.min_recovery_cosine)
                    c[(*n_c)++] = (struct cand){ (int32_t) ids[j], sims[j] };
        if (!ids || !sims) rc = kvt__fail(KVT_ENOMEM, "ann search");
        free(ids);
        free(sims);
    } else {
        for (int32_t i = 0; i < s->n_b; i++) {
            const struct blk *b = &s->b[i];
            if (!b->emb || !EVICTED(b)) continue;
            double dot = 0;
            for (int32_t d = 0; d < s->emb_dim; d++) dot += (double) q[d] * b->emb[d];
            if (dot >= s->p.min_recovery_cosine) c[(*n_c)++] = (struct cand){ i, dot };
        }
    }
#undef EVICTED
    free(q);
    s->embed_ms += kvt__now_ms() - t0;
    return rc;
}

/* Before a user message.  Every sealed block gets its BM25 relevance to the message (the kvtier
** policy's relevance signal).  Recovery asks what the resident context lacks: the message's
** terms that occur in no resident block (kvt_bm25_novel_terms) score the evicted blocks, and
** those scoring at least min_recovery_score come back at the tail, best first, at most top_k,
** each followed by the block after it when that one is evicted too (a fact cut by a block
** boundary goes on there: "... the secret code of Tavoren" | "is 48213."), as long as they fit
** next to the message and the reply reserve.  A message whose terms are all resident recovers
** nothing, so earlier turns that repeat the question's wording cannot outbid an evicted fact. */
static int recover(kvt_session *s, const char *query, int32_t msg_tokens) {
    if (s->p.policy != KVT_POLICY_KVTIER && s->p.recovery == KVT_RECOVERY_DISCARD) return 0;
    int32_t n_ev = 0;
    for (int32_t i = 0; i < s->n_b; i++)
        n_ev += s->b[i].info.residency == KVT_RES_HOST || s->b[i].info.residency == KVT_RES_DISK;
    const size_t nb = (size_t) (s->n_b > 0 ? s->n_b : 1);
    const char **docs = malloc(sizeof(char *) * nb), **res = malloc(sizeof(char *) * nb);
    double *sc = malloc(sizeof(double) * nb);
    struct cand *c = malloc(sizeof *c * 2 * nb);
    char *novel = NULL, *open_text = NULL;
    int rc = (!docs || !res || !sc || !c) ? kvt__fail(KVT_ENOMEM, "recovery scores") : 0;
    if (rc == 0) {
        for (int32_t i = 0; i < s->n_b; i++) docs[i] = s->b[i].info.sealed && s->b[i].text ? s->b[i].text : "";
        rc = kvt_bm25_score(docs, s->n_b, query, sc);
        for (int32_t i = 0; rc == 0 && i < s->n_b; i++) s->b[i].info.relevance = sc[i]; /* kvtier's relevance signal */
    }
    int32_t n_c = 0;
    /* a message that (with the reply reserve) fills half the budget is content, not a query:
    ** what came back for it would mostly be evicted again while it is decoded */
    bool long_msg = msg_tokens + s->p.gen_reserve > s->p.budget / 2;
    if (rc == 0 && n_ev > 0 && !long_msg && s->p.recovery != KVT_RECOVERY_DISCARD && s->p.top_k > 0) {
        int32_t n_res = 0;
        for (int32_t i = 0; i < s->n_b; i++)
            if (s->b[i].info.residency == KVT_RES_DEVICE && s->b[i].info.sealed) res[n_res++] = docs[i];
        if (s->open >= 0 &&
            kvt_detokenize(s->eng, s->b[s->open].tok, s->b[s->open].info.n_tokens, false, &open_text) == 0)
            res[n_res++] = open_text;
        if (s->emb_dim > 0) {
            rc = dense_candidates(s, query, c, &n_c);
        } else {
            rc = kvt_bm25_novel_terms(query, res, n_res, &novel);
            if (rc == 0 && novel[0]) rc = kvt_bm25_score(docs, s->n_b, novel, sc);
            for (int32_t i = 0; rc == 0 && novel[0] && i < s->n_b; i++) {
                int r = s->b[i].info.residency;
                if ((r == KVT_RES_HOST || r == KVT_RES_DISK) && sc[i] >= s->p.min_recovery_score)
                    c[n_c++] = (struct cand){ i, sc[i] };
            }
        }
        qsort(c, (size_t) n_c, sizeof *c, cmp_cand);
        if (n_c > s->p.top_k) n_c = s->p.top_k;
        /* each hit followed by its successor block, if that is evicted and not a hit itself */
        int32_t n_hit = n_c;
        struct cand *x = c + nb;
        int32_t n_x = 0;
        for (int32_t k = 0; k < n_hit; k++) {
            x[n_x++] = c[k];
            /* BM25 hits: only when the match is in the block's last quarter, where a statement
            ** about it may run on past the boundary (a successor that starts the next turn
            ** would otherwise come back as noise) */
            const char *t = s->b[c[k].i].text;
            if (s->emb_dim == 0 && t && novel && kvt__bm25_last_match(t, novel) < (int32_t) (strlen(t) * 3 / 4)) continue;
            for (int32_t j = c[k].i + 1; j <= c[k].i + s->p.successor_blocks && n_x < (int32_t) nb; j++) {
                bool taken = j >= s->n_b || !s->b[j].info.sealed ||
                             (s->b[j].info.residency != KVT_RES_HOST && s->b[j].info.residency != KVT_RES_DISK);
                for (int32_t q = 0; q < n_x && !taken; q++) taken = x[q].i == j;
                for (int32_t q = k + 1; q < n_hit && !taken; q++) taken = c[q].i == j;
                if (taken) break; /* only a contiguous run after the hit */
                x[n_x++] = (struct cand){ j, c[k].score };
            }
        }
        memcpy(c, x, sizeof *c * (size_t) n_x);
        n_c = n_x;
        if (getenv("KVT_DEBUG_RECOVERY")) {
            fprintf(stderr, "[recovery] turn %d %s \"%.80s\":", s->turn, s->emb_dim ? "cosine" : "novel terms",
                    novel ? novel : "");
            for (int32_t k = 0; k < n_c; k++) fprintf(stderr, " blk%d=%.2f", s->b[c[k].i].info.id, c[k].score);
            fprintf(stderr, "\n");
        }
    }
    if (rc == 0 && n_c > 0) {
        rc = load_candidates(s, c, n_c, msg_tokens + s->p.gen_reserve);
    }
    free(novel);
    free(open_text);
    free(docs);
    free(res);
    free(sc);
    free(c);
    return rc;
}

/* InfLLM retrieval, after the user message is decoded: the mean query of its last tokens
** (rep_layer, rotated back to position 0) against every evicted block's representative keys;
** a block scores its best representative; the top_k come back at the tail. */
static int infllm_recover(kvt_session *s, int32_t suffix_tokens) {
    kvt_attn *a = NULL;
    struct kvt_engine_info I;
    kvt_engine_info(s->eng, &I);
    if (s->p.top_k == 0 || s->rep_row == 0 || kvt_attn_get(s->eng, s->rep_layer, s->p.seq, &a) || !a->q) {
        kvt_attn_free(a);
        kvt__clear_error();
        return 0;
    }
    double t0 = kvt__now_ms();
    const int32_t hd = a->head_dim, nh = a->n_head, group = nh / I.n_head_kv;
    float *qbar = calloc((size_t) nh * hd, sizeof(float)), *tmp = malloc(sizeof(float) * (size_t) hd);
    struct cand *c = malloc(sizeof *c * (size_t) (s->n_b ? s->n_b : 1));
    int32_t from = a->n_query > INFLLM_WINDOW ? a->n_query - INFLLM_WINDOW : 0, n_c = 0;
    if (qbar && tmp && c && hd == s->rep_row / I.n_head_kv) {
        for (int32_t t = from; t < a->n_query; t++)
            for (int32_t h = 0; h < nh; h++) {
                memcpy(tmp, a->q + ((size_t) t * nh + h) * hd, sizeof(float) * (size_t) hd);
                kvt__engine_rotate(s->eng, s->rep_layer, tmp, hd, -a->q_pos[t]);
                for (int32_t d = 0; d < hd; d++) qbar[(size_t) h * hd + d] += tmp[d] / (float) (a->n_query - from);
            }
        double bar = -INFINITY; /* like the BM25 rule: only blocks that beat every resident non-sink block */
        for (int32_t i = 0; i < s->n_b; i++) {
            const struct blk *b = &s->b[i];
            bool evicted = b->info.residency == KVT_RES_HOST || b->info.residency == KVT_RES_DISK;
            if (b->n_rep == 0 || (!evicted && (b->info.residency != KVT_RES_DEVICE || b->info.id < s->p.n_sink_blocks)))
                continue;
            double best = -INFINITY;
            for (int32_t r = 0; r < b->n_rep; r++) {
                double dot = 0;
                for (int32_t h = 0; h < nh; h++) {
                    const float *k = b->rep + (size_t) r * s->rep_row + (size_t) (h / group) * hd;
                    for (int32_t d = 0; d < hd; d++) dot += (double) qbar[(size_t) h * hd + d] * k[d];
                }
                best = fmax(best, dot / sqrt((double) hd));
            }
            if (evicted) c[n_c++] = (struct cand){ i, best };
            else bar = fmax(bar, best);
        }
        int32_t kept = 0;
        for (int32_t k = 0; k < n_c; k++)
            if (c[k].score > bar) c[kept++] = c[k];
        n_c = kept;
        qsort(c, (size_t) n_c, sizeof *c, cmp_cand);
        if (n_c > s->p.top_k) n_c = s->p.top_k;
    }
    kvt_attn_free(a);
    free(qbar);
    free(tmp);
    s->policy_ms += kvt__now_ms() - t0;
    int rc = 0;
    int32_t need = 0;
    for (int32_t k = 0; k < n_c; k++) need += s->b[c[k].i].info.n_tokens;
    while (n_c > 0 && make_room(s, need + suffix_tokens + s->p.gen_reserve) == KVT_EBUDGET)
        need -= s->b[c[--n_c].i].info.n_tokens;
    kvt__clear_error();
    if (n_c > 0) rc = seal(s);
    for (int32_t k = 0; rc == 0 && k < n_c; k++) {
        int r = load_block(s, c[k].i);
        if (r != KVT_ECORRUPT) rc = r;
    }
    free(c);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* conversation                                                                             */

static int push_msg(kvt_session *s, int role, const char *text, int keep) {
    if (s->n_m == s->cap_m) {
        int32_t cap = s->cap_m ? 2 * s->cap_m : 16;
        struct msg *nm = realloc(s->m, sizeof *nm * (size_t) cap);
        if (!nm) return kvt__fail(KVT_ENOMEM, "messages");
        s->m = nm;
        s->cap_m = cap;
    }
    if (!(s->m[s->n_m].content = strdup(text))) return kvt__fail(KVT_ENOMEM, "message of %zu bytes", strlen(text));
    s->m[s->n_m].role = role;
    s->m[s->n_m].keep = keep;
    s->n_m++;
    return 0;
}

/* kv_text becomes fmt (owned by the session from here), a segment boundary at the current end of
** the stream.  Cannot fail: a boundary that cannot be recorded only makes later cut-backs go
** further back. */
static void set_text(kvt_session *s, char *fmt) {
    free(s->kv_text);
    s->kv_text = fmt;
    if (s->n_seg == s->cap_seg) {
        int32_t cap = s->cap_seg ? 2 * s->cap_seg : 16;
        int32_t *t = realloc(s->seg_tok, sizeof *t * (size_t) cap);
        if (t) s->seg_tok = t;
        size_t *c = realloc(s->seg_chr, sizeof *c * (size_t) cap);
        if (c) s->seg_chr = c;
        if (!t || !c) return;
        s->cap_seg = cap;
    }
    s->seg_tok[s->n_seg] = s->total;
    s->seg_chr[s->n_seg] = strlen(fmt);
    s->n_seg++;
}

static void drop_block(kvt_session *s, struct blk *b) {
    if (b->info.residency == KVT_RES_DEVICE) kvt_seq_rm(s->eng, s->p.seq, b->info.p0, b->info.p0 + b->info.n_tokens);
    if (b->info.sealed && b->info.residency != KVT_RES_LOST) kvt_pool_del(s->pool, b->key);
    if (s->ann && b->emb) kvt_ann_remove(s->ann, (uint64_t) b->info.id);
    kvt__clear_error();
    free(b->tok);
    free(b->text);
    free(b->tok_mass);
    free(b->rep);
    free(b->emb);
    memset(b, 0, sizeof *b);
}

/* Cut the stream (the conversation's tokens in the order they were said, i.e. the blocks by id)
** back to its first `keep` tokens: later blocks leave the cache and the pool; the open tail block
** and a block cut in the middle that is resident at the physical tail are trimmed in place (a
** sealed one is unsealed: its saved copy is deleted and it is saved again when it fills); any
** other block cut in the middle is dropped and its first tokens are decoded again at the tail.
** Positions continue after the highest resident one. */
static int cut_stream(kvt_session *s, int32_t keep) {
    int32_t acc = 0, i = 0;
    while (i < s->n_b && acc + s->b[i].info.n_tokens <= keep) acc += s->b[i].info.n_tokens, i++;
    const int32_t r = keep - acc;
    int32_t n_re = 0, re_role = KVT_ROLE_USER, n_keep = i;
    kvt_token *re = NULL;
    for (int32_t j = s->n_b - 1; j > i; j--) drop_block(s, &s->b[j]);
    if (i < s->n_b) {
        struct blk *b = &s->b[i];
        if (r > 0 && b->info.residency == KVT_RES_DEVICE &&
            b->info.p0 + b->info.n_tokens - 1 == kvt_seq_pos_max(s->eng, s->p.seq)) {
            /* the physical tail: trim its cells in place; it is the open block again */
            kvt_seq_rm(s->eng, s->p.seq, b->info.p0 + r, b->info.p0 + b->info.n_tokens);
            for (int32_t cut = b->info.n_tokens - r; cut > 0;) { /* per-token roles are not kept: newest role first */
                int k = b->role_n[KVT_ROLE_ASSISTANT] ? KVT_ROLE_ASSISTANT : b->role_n[KVT_ROLE_USER] ? KVT_ROLE_USER : KVT_ROLE_SYSTEM;
                int32_t d = KVT_MIN(cut, b->role_n[k]);
                b->role_n[k] -= d;
                cut -= d;
                if (d == 0) break;
            }
            if (b->info.sealed) kvt_pool_del(s->pool, b->key);
            b->info.sealed = false;
            if (s->ann && b->emb) kvt_ann_remove(s->ann, (uint64_t) b->info.id); /* embedded again when resealed */
            kvt__clear_error();
            free(b->emb);
            b->emb = NULL;
            b->info.n_tokens = r;
            s->open = i;
            n_keep = i + 1;
        } else {
            if (r > 0) { /* elsewhere: dropped, its first r tokens decoded again at the tail */
                if (!(re = malloc(sizeof(kvt_token) * (size_t) r))) return kvt__fail(KVT_ENOMEM, "cut back");
                memcpy(re, b->tok, sizeof(kvt_token) * (size_t) r);
                n_re = r;
                re_role = block_role(b);
            }
            drop_block(s, b);
        }
    }
    if (s->open >= n_keep) s->open = -1;
    s->n_b = n_keep;
    s->next_pos = kvt_seq_pos_max(s->eng, s->p.seq) + 1;
    s->total = keep - n_re;
    s->have_logits = false;
    int rc = n_re > 0 ? feed(s, re, n_re, re_role, 0) : 0;
    free(re);
    return rc;
}

/* Tokens of the stream (blocks by id) that equal tok[0..n) from the start. */
static int32_t stream_common(const kvt_session *s, const kvt_token *tok, int32_t n) {
    int32_t c = 0;
    for (int32_t i = 0; i < s->n_b; i++)
        for (int32_t k = 0; k < s->b[i].info.n_tokens; k++, c++)
            if (c >= n || s->b[i].tok[k] != tok[c]) return c;
    return c;
}

/* The formatted conversation fmt diverges from kv_text after `common` bytes.  A cut at the last
** segment boundary (a message boundary) would drop everything after it, also what the two share
** inside the message where they differ (two requests that open with the same long document and
** then ask different questions).  Instead, when the template's tokens of fmt share more tokens
** with the stream than that boundary holds, cut the stream at the first token that differs:
** the stream then continues with fmt's own tokens from there, *tok / *n (caller frees), and holds
** exactly the template's tokens of fmt.  Returns 1 when the boundary keeps at least as much or
** the cut point cannot be mapped back to a byte of fmt (the tokens' text is not a suffix of fmt),
** else 0 or an error of cut_stream / allocation. */
static int cut_to_common_tokens(kvt_session *s, const char *fmt, size_t common, kvt_token **tok, int32_t *n) {
    int32_t k = s->n_seg - 1;
    while (k >= 0 && s->seg_chr[k] > common) k--;
    const int32_t at_boundary = k >= 0 ? s->seg_tok[k] : 0;
    kvt_token *all = NULL;
    int32_t n_all = 0;
    if (kvt_tokenize(s->eng, fmt, true, true, &all, &n_all)) { kvt__clear_error(); return 1; }
    const int32_t c = stream_common(s, all, n_all);
    char *tail = NULL;
    size_t len = strlen(fmt), n_tail = 0;
    bool ok = c > at_boundary;
    if (ok && c < n_all) {
        ok = kvt_detokenize(s->eng, all + c, n_all - c, true, &tail) == 0 && (n_tail = strlen(tail)) <= len &&
             !strcmp(fmt + len - n_tail, tail);
        kvt__clear_error();
    }
    /* the text of all[0..c) is fmt[0..off), which kv_text holds too */
    const size_t off = len - n_tail;
    if (!ok || off > common) {
        free(tail);
        free(all);
        return 1;
    }
    free(tail);
    int rc = cut_stream(s, c);
    if (rc) { free(all); return rc; }
    while (s->n_seg > 0 && (s->seg_tok[s->n_seg - 1] > c || s->seg_chr[s->n_seg - 1] > off)) s->n_seg--;
    s->kv_text[off] = '\0';
    memmove(all, all + c, sizeof(kvt_token) * (size_t) (n_all - c));
    *tok = all;
    *n = n_all - c;
    return 0;
}

/* Tokens of the template text that is not yet in the stream (the conversation formatted with
** the assistant prefix, minus what was already decoded).  When the formatted conversation
** diverges from what was decoded (two user messages in a row replace the assistant prefix; a
** client edits its history), the stream is first cut back to the last segment boundary before
** the divergence, so the stream always holds exactly the template's tokens. */
static int pending_tokens(kvt_session *s, int32_t n_msgs, bool add_ass, kvt_token **tok, int32_t *n, char **fmt_out) {
    struct kvt_chat_msg *cm = malloc(sizeof *cm * (size_t) (n_msgs > 0 ? n_msgs : 1));
    if (!cm) return kvt__fail(KVT_ENOMEM, "chat");
    for (int32_t i = 0; i < n_msgs; i++) cm[i] = (struct kvt_chat_msg){ role_name[s->m[i].role], s->m[i].content };
    char *fmt = NULL;
    int rc = kvt_chat_format(s->eng, cm, n_msgs, add_ass, s->p.template_fallback, &fmt);
    free(cm);
    if (rc) return rc;
    size_t common = 0, have = strlen(s->kv_text);
    while (common < have && fmt[common] == s->kv_text[common]) common++;
    *tok = NULL;
    *n = 0;
    if (common < have && (rc = cut_to_common_tokens(s, fmt, common, tok, n)) != 1) {
        if (rc) { free(fmt); return rc; }
        *fmt_out = fmt;
        return 0;
    }
    if (common < have) {
        int32_t k = s->n_seg - 1;
        while (k >= 0 && s->seg_chr[k] > common) k--;
        if ((rc = cut_stream(s, k >= 0 ? s->seg_tok[k] : 0))) { free(fmt); return rc; }
        s->n_seg = k + 1;
        common = have = k >= 0 ? s->seg_chr[k] : 0;
        s->kv_text[have] = '\0';
    }
    if (fmt[common] == '\0') { *fmt_out = fmt; return 0; }
    rc = kvt_tokenize(s->eng, fmt + common, have == 0, true, tok, n);
    if (rc) { free(fmt); return rc; }
    *fmt_out = fmt;
    return 0;
}

/* A message longer than the budget evicted blocks of its own during its prefill.  Before the
** reply, the ones relevant to the end of the message (its last ~40 words, the question, as
** SnapKV's observation window is the prompt's end) come back at the tail: BM25 against that
** query; at most top_k; a block must score at least min_recovery_score and above every resident
** non-sink block except the two newest (which hold the query itself).  Best effort: nothing is
** recovered when no block qualifies or none fits. */
static int recover_own_tail(kvt_session *s, const char *text) {
    if (s->p.recovery != KVT_RECOVERY_KV_RESTORE || s->p.top_k == 0) return 0;
    bool lost = false;
    for (int32_t i = 0; i < s->n_b && !lost; i++)
        lost = s->b[i].info.turn == s->turn && (s->b[i].info.residency == KVT_RES_HOST || s->b[i].info.residency == KVT_RES_DISK);
    if (!lost) return 0;
    size_t len = strlen(text), from = len > 240 ? len - 240 : 0;
    while (from > 0 && from < len && text[from - 1] != ' ') from++;
    const char *query = text + from;
    const char **docs = malloc(sizeof(char *) * (size_t) s->n_b);
    double *sc = malloc(sizeof(double) * (size_t) s->n_b);
    struct cand *c = malloc(sizeof *c * (size_t) s->n_b);
    int rc = (!docs || !sc || !c) ? kvt__fail(KVT_ENOMEM, "recovery scores") : 0;
    int32_t n_c = 0;
    if (rc == 0) {
        for (int32_t i = 0; i < s->n_b; i++) docs[i] = s->b[i].info.sealed && s->b[i].text ? s->b[i].text : "";
        rc = kvt_bm25_score(docs, s->n_b, query, sc);
    }
    if (rc == 0) {
        int32_t newest[2] = { -1, -1 }; /* the two resident blocks with the highest positions */
        for (int32_t i = 0; i < s->n_b; i++) {
            if (s->b[i].info.residency != KVT_RES_DEVICE) continue;
            if (newest[0] < 0 || s->b[i].info.p0 > s->b[newest[0]].info.p0) { newest[1] = newest[0]; newest[0] = i; }
            else if (newest[1] < 0 || s->b[i].info.p0 > s->b[newest[1]].info.p0) newest[1] = i;
        }
        double bar = 0;
        for (int32_t i = 0; i < s->n_b; i++)
            if (s->b[i].info.residency == KVT_RES_DEVICE && s->b[i].info.sealed && s->b[i].info.id >= s->p.n_sink_blocks &&
                i != newest[0] && i != newest[1])
                bar = fmax(bar, sc[i]);
        for (int32_t i = 0; i < s->n_b; i++) {
            int r = s->b[i].info.residency;
            if ((r == KVT_RES_HOST || r == KVT_RES_DISK) && sc[i] > bar && sc[i] >= s->p.min_recovery_score)
                c[n_c++] = (struct cand){ i, sc[i] };
        }
        qsort(c, (size_t) n_c, sizeof *c, cmp_cand);
        if (n_c > s->p.top_k) n_c = s->p.top_k;
        rc = load_candidates(s, c, n_c, s->p.gen_reserve);
    }
    free(docs);
    free(sc);
    free(c);
    return rc;
}

int kvt_session_add(kvt_session *s, enum kvt_role role, const char *text) {
    return kvt_session_add_ex(s, role, text, KVT_KEEP_NONE);
}

int kvt_session_add_ex(kvt_session *s, enum kvt_role role, const char *text, int32_t keep) {
    kvt__clear_error();
    if (keep < KVT_KEEP_NONE || keep > KVT_KEEP_PIN) return kvt__fail(KVT_EINVAL, "keep %d is not none, prefer or pin", keep);
    if ((int) role < 0 || role > KVT_ROLE_ASSISTANT) return kvt__fail(KVT_EINVAL, "role %d is not system, user or assistant", role);
    if (!text) return kvt__fail(KVT_EINVAL, "NULL message text");
    if (s->is_parked) return parked_error();
    int rc = push_msg(s, role, text, keep);
    if (rc || role != KVT_ROLE_USER) return rc; /* system/assistant text is decoded with the next user turn */
    s->turn++;
    kvt_token *tok = NULL;
    int32_t n = 0;
    char *fmt = NULL;
    /* 1. text of messages added since the last decode (assistant replies a client replays,
    **    system prompts) goes in first, so recovered blocks never split a turn */
    if (s->n_m_decoded < s->n_m - 1) {
        if ((rc = pending_tokens(s, s->n_m - 1, false, &tok, &n, &fmt))) goto fail;
        s->cur_keep = KVT_KEEP_NONE;
        for (int32_t i = s->n_m_decoded; i < s->n_m - 1; i++) s->cur_keep = KVT_MAX(s->cur_keep, s->m[i].keep);
        rc = n > 0 ? feed(s, tok, n, s->m[s->n_m - 2].role, 0) : 0;
        s->cur_keep = KVT_KEEP_NONE;
        if (rc) goto fail;
        set_text(s, fmt);
        fmt = NULL;
        free(tok);
        tok = NULL;
        s->n_m_decoded = s->n_m - 1;
    }
    /* 2. the new user message (the assistant prefix follows as its own segment, so a message
    **    added after it replaces only the prefix) */
    if ((rc = pending_tokens(s, s->n_m, s->p.policy == KVT_POLICY_INFLLM, &tok, &n, &fmt))) goto fail;
    struct kvt_engine_info I;
    kvt_engine_info(s->eng, &I);
    if (n + s->p.gen_reserve > I.n_ctx) {
        rc = kvt__fail(KVT_ECTX, "the message is %d tokens; the context holds %d (with %d reserved for the reply)", n,
                       I.n_ctx, s->p.gen_reserve);
        goto fail;
    }
    /* 3. evicted blocks relevant to it come back right before it (InfLLM: right after it,
    **    since its retrieval query is the message's own attention queries) */
    if (s->p.policy == KVT_POLICY_INFLLM) {
        kvt_token *tc = NULL;
        int32_t nc = 0;
        char *fc = NULL;
        if ((rc = pending_tokens(s, s->n_m, false, &tc, &nc, &fc))) goto fail;
        s->cur_keep = keep;
        rc = nc > 0 ? feed(s, tc, nc, KVT_ROLE_USER, s->p.gen_reserve) : 0;
        s->cur_keep = KVT_KEEP_NONE;
        free(tc);
        if (rc) { free(fc); goto fail; }
        set_text(s, fc);
        free(tok);
        free(fmt);
        tok = NULL;
        fmt = NULL;
        if ((rc = infllm_recover(s, 8))) goto fail;
        if ((rc = pending_tokens(s, s->n_m, true, &tok, &n, &fmt))) goto fail; /* the assistant prefix */
    } else if ((rc = recover(s, text, n))) {
        goto fail;
    }
    s->cur_keep = keep;
    if (n > 0 && (rc = feed(s, tok, n, KVT_ROLE_USER, s->p.gen_reserve))) { s->cur_keep = KVT_KEEP_NONE; goto fail; }
    s->cur_keep = KVT_KEEP_NONE;
    set_text(s, fmt);
    fmt = NULL;
    s->n_m_decoded = s->n_m;
    free(tok);
    tok = NULL;
    if (s->p.policy != KVT_POLICY_INFLLM) { /* 4. the assistant prefix */
        if ((rc = recover_own_tail(s, text))) return rc;
        if ((rc = pending_tokens(s, s->n_m, true, &tok, &n, &fmt))) return rc;
        if (n > 0 && (rc = feed(s, tok, n, KVT_ROLE_USER, s->p.gen_reserve))) { free(tok); free(fmt); return rc; }
        set_text(s, fmt);
        free(tok);
    }
    return 0;
fail:
    /* the message is not part of the conversation; decoded chunks stay (the table matches) */
    free(tok);
    free(fmt);
    if (s->n_m_decoded < s->n_m) {
        free(s->m[--s->n_m].content);
    }
    return rc;
}

/* A generated reply is in the stream: it becomes an assistant message, and kv_text is extended
** by the reply as the template renders it (templates trim messages: "gemma" strips the leading
** space of " Sure"), so that the next turn's formatted conversation extends kv_text and the
** reply's generated tokens are kept (canonicalised) instead of being cut back and re-decoded.
** If the template's rendering cannot be found, the raw text is appended. */
static int append_reply(kvt_session *s, const char *text) {
    int rc = push_msg(s, KVT_ROLE_ASSISTANT, text, KVT_KEEP_NONE);
    if (rc) return rc;
    s->n_m_decoded = s->n_m;
    size_t a = strlen(s->kv_text), b = strlen(text);
    const char *t0 = text, *t1 = text + b;
    while (t0 < t1 && (*t0 == ' ' || *t0 == '\n' || *t0 == '\t' || *t0 == '\r')) t0++;
    while (t1 > t0 && (t1[-1] == ' ' || t1[-1] == '\n' || t1[-1] == '\t' || t1[-1] == '\r')) t1--;
    struct kvt_chat_msg *cm = malloc(sizeof *cm * (size_t) s->n_m);
    char *fmt = NULL;
    if (cm) {
        for (int32_t i = 0; i < s->n_m; i++) cm[i] = (struct kvt_chat_msg){ role_name[s->m[i].role], s->m[i].content };
        if (kvt_chat_format(s->eng, cm, s->n_m, false, s->p.template_fallback, &fmt)) fmt = NULL;
        free(cm);
    }
    kvt__clear_error();
    if (fmt && !strncmp(fmt, s->kv_text, a)) {
        size_t n = (size_t) (t1 - t0);
        char *hit = n ? NULL : fmt + a;
        for (char *p = fmt + a; n && *p; p++)
            if (!strncmp(p, t0, n)) { hit = p; break; }
        if (hit) {
            hit[n] = '\0';
            set_text(s, fmt);
            return 0;
        }
    }
    free(fmt);
    char *kv = malloc(a + b + 1);
    if (!kv) return kvt__fail(KVT_ENOMEM, "reply text");
    memcpy(kv, s->kv_text, a);
    memcpy(kv + a, text, b + 1);
    set_text(s, kv);
    return 0;
}

int kvt_session_generate(kvt_session *s, int32_t max_tokens, const struct kvt_sampling *smp, kvt_token_cb cb, void *ud,
                         char **reply) {
    kvt__clear_error();
    if (reply) *reply = NULL;
    if (s->is_parked) return parked_error();
    if (!s->have_logits) return kvt__fail(KVT_EINVAL, "generate: no user turn to reply to");
    kvt__engine_set_logits(s->eng, s->logits);
    kvt_token *gen = malloc(sizeof(kvt_token) * (size_t) (max_tokens > 0 ? max_tokens : 1));
    if (!gen) return kvt__fail(KVT_ENOMEM, "generate");
    int32_t n = 0;
    int rc = 0;
    while (n < max_tokens) {
        kvt_token t;
        if ((rc = kvt_sample(s->eng, smp, &t))) break;
        if (kvt_token_is_eog(s->eng, t)) break;
        gen[n++] = t;
        if ((rc = feed(s, &t, 1, KVT_ROLE_ASSISTANT, 0))) break;
        if (cb) {
            char *piece = NULL;
            if (kvt_detokenize(s->eng, &t, 1, false, &piece) == 0) {
                bool go = cb(piece, ud);
                free(piece);
                if (!go) break;
            }
        }
    }
    char *text = NULL;
    int rc2 = kvt_detokenize(s->eng, gen, n, false, &text);
    free(gen);
    if (rc2) return rc ? rc : rc2;
    /* the reply is in the stream: extend the message list and the decoded template text */
    int rc3 = append_reply(s, text);
    if (reply) *reply = text; else free(text);
    return rc ? rc : rc3;
}

int kvt_session_answer_logprob(kvt_session *s, const char *answer, double *logprob, int32_t *n_tokens) {
    if (s->is_parked) return parked_error();
    if (s->have_logits) kvt__engine_set_logits(s->eng, s->logits);
    const float *cur = s->have_logits ? kvt_logits(s->eng) : NULL;
    *logprob = 0;
    *n_tokens = 0;
    if (!cur) return kvt__fail(KVT_EINVAL, "answer_logprob: no user turn decoded yet");
    float *saved = malloc(sizeof(float) * (size_t) s->n_vocab);
    kvt_token *tok = NULL;
    int32_t n = 0;
    int rc = saved ? kvt_tokenize(s->eng, answer, false, false, &tok, &n) : kvt__fail(KVT_ENOMEM, "logits");
    if (rc) { free(saved); return rc; }
    memcpy(saved, cur, sizeof(float) * (size_t) s->n_vocab);
    if (resident(s) + n > s->p.budget) {
        free(saved);
        free(tok);
        return kvt__fail(KVT_EBUDGET, "scoring %d answer tokens would exceed the budget of %d (%d resident)", n,
                         s->p.budget, resident(s));
    }
    double lp = 0;
    const kvt_pos start = s->next_pos;
    for (int32_t i = 0; i < n && rc == 0; i++) {
        const float *l = kvt_logits(s->eng);
        double mx = -INFINITY, z = 0;
        for (int32_t v = 0; v < s->n_vocab; v++) mx = fmax(mx, l[v]);
        for (int32_t v = 0; v < s->n_vocab; v++) z += exp(l[v] - mx);
        lp += l[tok[i]] - mx - log(z);
        if (i + 1 < n) {
            rc = kvt_decode(s->eng, s->p.seq, &tok[i], 1, start + i, true);
            note_peak(s);
        }
    }
    kvt_seq_rm(s->eng, s->p.seq, start, -1);
    kvt__engine_set_logits(s->eng, saved);
    free(saved);
    free(tok);
    if (rc == 0) {
        *logprob = lp;
        *n_tokens = n;
    }
    return rc;
}

/* HOST vs DISK changes under the pool's LRU spilling; ask the pool. */
static void refresh_residency(const kvt_session *s, struct blk *b) {
    if (b->info.residency == KVT_RES_HOST || b->info.residency == KVT_RES_DISK) {
        char path[1024];
        if (kvt_pool_spill_path(s->pool, b->key, path, sizeof path) == 0)
            b->info.residency = path[0] ? KVT_RES_DISK : KVT_RES_HOST;
    }
}

void kvt_session_get_stats(kvt_session *s, struct kvt_session_stats *st) {
    memset(st, 0, sizeof *st);
    st->resident_tokens = resident(s);
    st->peak_resident_tokens = s->peak;
    st->total_tokens = s->total;
    st->n_blocks = s->n_b;
    for (int32_t i = 0; i < s->n_b; i++) {
        struct blk *b = &s->b[i];
        refresh_residency(s, b);
        switch (b->info.residency) {
        case KVT_RES_DEVICE: st->n_blocks_resident++; break;
        case KVT_RES_HOST: st->n_blocks_host++; break;
        case KVT_RES_DISK: st->n_blocks_disk++; break;
        default: st->n_blocks_lost++; break;
        }
    }
    st->evictions = s->evictions;
    st->recoveries = s->recoveries;
    st->tokens_decoded = s->decoded;
    st->tokens_recovered = s->recovered;
    st->next_pos = s->next_pos;
    st->policy_ms = s->policy_ms;
    st->decode_ms = s->decode_ms;
    kvt_pool_get_stats(s->pool, &st->pool);
}

int32_t kvt_session_n_blocks(const kvt_session *s) { return s->n_b; }

int kvt_session_block(kvt_session *s, int32_t i, struct kvt_block_info *info) {
    if (i < 0 || i >= s->n_b) return kvt__fail(KVT_EINVAL, "block %d is outside 0..%d", i, s->n_b - 1);
    struct blk *b = &s->b[i];
    refresh_residency(s, b);
    if (!b->info.sealed) { /* the open tail block: role and text as of now */
        b->info.role = block_role(b);
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

/* ---------------------------------------------------------------------------------------- */
/* whole-conversation sync and step-wise generation (for servers)                           */

static int role_from_name(const char *r) {
    for (int i = 0; r && i < 3; i++)
        if (!strcmp(r, role_name[i])) return i;
    return -1;
}

/* The stream ends with a token whose logits are not kept (nothing was decoded after a cut back):
** decode its last token again. */
static int refresh_logits(kvt_session *s) {
    if (s->have_logits || s->n_b == 0) return 0;
    struct blk *b = &s->b[s->n_b - 1];
    if (b->info.residency != KVT_RES_DEVICE || b->info.n_tokens == 0) return kvt__fail(KVT_EINVAL, "no user turn to reply to");
    kvt_token t = b->tok[b->info.n_tokens - 1];
    int role = block_role(b);
    int rc = cut_stream(s, s->total - 1);
    if (rc == 0 && s->n_seg > 0 && s->seg_tok[s->n_seg - 1] > s->total) s->seg_tok[s->n_seg - 1] = s->total + 1;
    return rc ? rc : feed(s, &t, 1, role, 0);
}

int kvt_session_sync(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n_msgs, struct kvt_sync_info *out) {
    kvt__clear_error();
    if (out) memset(out, 0, sizeof *out);
    if (s->is_parked) return parked_error();
    if (s->generating) return kvt__fail(KVT_EINVAL, "sync: a reply is being generated (call kvt_session_gen_end first)");
    if (!msgs || n_msgs < 1) return kvt__fail(KVT_EINVAL, "sync: %d messages; at least one user message is needed", n_msgs);
    for (int32_t i = 0; i < n_msgs; i++) {
        if (role_from_name(msgs[i].role) < 0)
            return kvt__fail(KVT_EINVAL, "message %d has role '%s'; expected system, user or assistant", i,
                             msgs[i].role ? msgs[i].role : "(null)");
        if (!msgs[i].content) return kvt__fail(KVT_EINVAL, "message %d has no content", i);
    }
    if (role_from_name(msgs[n_msgs - 1].role) != KVT_ROLE_USER)
        return kvt__fail(KVT_EINVAL, "the last message is '%s'; it must be a user message", msgs[n_msgs - 1].role);
    int32_t k = 0;
    while (k < n_msgs && k < s->n_m && s->m[k].role == role_from_name(msgs[k].role) && !strcmp(s->m[k].content, msgs[k].content))
        k++;
    if (k == n_msgs && s->n_m == n_msgs && s->n_m_decoded == n_msgs && s->have_logits) { /* nothing new */
        if (out) out->prompt_tokens = out->tokens_reused = s->total;
        return 0;
    }
    if (k == n_msgs) k--; /* the same conversation again: its last user message is added once more */
    while (s->n_m > k) free(s->m[--s->n_m].content);
    if (s->n_m_decoded > k) s->n_m_decoded = k;
    const int64_t dec0 = s->decoded, rec0 = s->recovered, ev0 = s->evictions, nrec0 = s->recoveries;
    int rc = 0;
    for (int32_t i = k; rc == 0 && i < n_msgs; i++) rc = kvt_session_add(s, (enum kvt_role) role_from_name(msgs[i].role), msgs[i].content);
    if (rc == 0) rc = refresh_logits(s);
    if (out) {
        out->prompt_tokens = s->total;
        out->tokens_decoded = s->decoded - dec0;
        out->tokens_recovered = s->recovered - rec0;
        out->tokens_reused = KVT_MAX(0, s->total - (int32_t) out->tokens_decoded);
        out->evictions = s->evictions - ev0;
        out->recoveries = s->recoveries - nrec0;
    }
    return rc;
}

int kvt_session_gen_step(kvt_session *s, const struct kvt_sampling *smp, kvt_token *tok, bool *done) {
    kvt__clear_error();
    *done = false;
    if (s->is_parked) return parked_error();
    if (!s->have_logits) return kvt__fail(KVT_EINVAL, "gen_step: no user turn to reply to");
    if (!s->generating) s->n_gen = 0;
    s->generating = true;
    kvt__engine_set_logits(s->eng, s->logits);
    kvt_token t;
    int rc = kvt_sample(s->eng, smp, &t);
    if (rc) return rc;
    *tok = t;
    if (kvt_token_is_eog(s->eng, t)) { *done = true; return 0; }
    if (s->n_gen == s->cap_gen) {
        int32_t cap = s->cap_gen ? 2 * s->cap_gen : 64;
        kvt_token *g = realloc(s->gen, sizeof *g * (size_t) cap);
        if (!g) return kvt__fail(KVT_ENOMEM, "reply of %d tokens", cap);
        s->gen = g;
        s->cap_gen = cap;
    }
    if ((rc = feed(s, &t, 1, KVT_ROLE_ASSISTANT, 0))) return rc;
    s->gen[s->n_gen++] = t;
    return 0;
}

int kvt_session_gen_end(kvt_session *s, char **reply) {
    kvt__clear_error();
    if (reply) *reply = NULL;
    char *text = NULL;
    int rc = kvt_detokenize(s->eng, s->gen, s->n_gen, false, &text);
    if (rc) return rc;
    rc = append_reply(s, text);
    s->generating = false;
    s->n_gen = 0;
    if (reply && rc == 0) *reply = text;
    else free(text);
    return rc;
}

int32_t kvt_session_n_messages(const kvt_session *s) { return s->n_m; }

int32_t kvt_session_tokens(const kvt_session *s, kvt_token *out, int32_t n_max) {
    int32_t c = 0;
    for (int32_t i = 0; i < s->n_b; i++) {
        const struct blk *b = &s->b[i];
        int32_t m = KVT_MIN(b->info.n_tokens, n_max - c);
        if (m > 0) memcpy(out + c, b->tok, sizeof(kvt_token) * (size_t) m);
        c += b->info.n_tokens;
    }
    return c;
}

int kvt_session_message(const kvt_session *s, int32_t i, struct kvt_chat_msg *msg) {
    if (i < 0 || i >= s->n_m) return kvt__fail(KVT_EINVAL, "message %d is outside 0..%d", i, s->n_m - 1);
    msg->role = role_name[s->m[i].role];
    msg->content = s->m[i].content;
    return 0;
}

int kvt_session_gen_step_batch(kvt_session *const *ss, int32_t n, const struct kvt_sampling *smp, kvt_token *tok,
                               bool *done, int *status) {
    kvt__clear_error();
    return n > 0 ? kvt_session_gen_step_batch_ex(ss[0]->eng, ss, n, smp, tok, done, status, NULL, 0) : 0;
}

int kvt_session_gen_step_batch_ex(kvt_engine *eng, kvt_session *const *ss, int32_t n, const struct kvt_sampling *smp,
                                  kvt_token *tok, bool *done, int *status, struct kvt_gen_row *rows, int32_t n_rows) {
    kvt__clear_error();
    if (n < 0 || n_rows < 0 || (n > 0 && (!ss || !smp || !tok || !done || !status)) || (n_rows > 0 && !rows))
        return kvt__fail(KVT_EINVAL, "batch of %d sessions and %d rows", n, n_rows);
    if (n + n_rows == 0) return 0;
    struct kvt_engine_info I;
    kvt_engine_info(eng, &I);
    const int32_t nt = n + n_rows;
    int32_t *seqs = malloc(sizeof(int32_t) * (size_t) nt), *idx = malloc(sizeof(int32_t) * (size_t) nt);
    kvt_pos *pos = malloc(sizeof(kvt_pos) * (size_t) nt);
    kvt_token *bt = malloc(sizeof(kvt_token) * (size_t) nt);
    float *logits = malloc(sizeof(float) * (size_t) nt * (size_t) I.n_vocab);
    int rc = (!seqs || !idx || !pos || !bt || !logits) ? kvt__fail(KVT_ENOMEM, "batch of %d sessions and %d rows", n, n_rows) : 0;
    int32_t m = 0;
    for (int32_t i = 0; rc == 0 && i < n; i++) {
        kvt_session *s = ss[i];
        done[i] = false;
        status[i] = 0;
        if (s->eng != eng) { status[i] = kvt__fail(KVT_EINVAL, "batched sessions must share one engine"); continue; }
        if (s->is_parked) { status[i] = parked_error(); continue; }
        if (!s->have_logits) { status[i] = kvt__fail(KVT_EINVAL, "gen_step: no user turn to reply to"); continue; }
        if (!s->generating) s->n_gen = 0;
        s->generating = true;
        kvt__engine_set_logits(eng, s->logits);
        if ((status[i] = kvt_sample(eng, &smp[i], &tok[i]))) continue;
        if (kvt_token_is_eog(eng, tok[i])) { done[i] = true; continue; }
        if (s->n_gen == s->cap_gen) {
            int32_t cap = s->cap_gen ? 2 * s->cap_gen : 64;
            kvt_token *g = realloc(s->gen, sizeof *g * (size_t) cap);
            if (!g) { status[i] = kvt__fail(KVT_ENOMEM, "reply of %d tokens", cap); continue; }
            s->gen = g;
            s->cap_gen = cap;
        }
        double t1 = kvt__now_ms();
        status[i] = make_room(s, 1);
        s->policy_ms += kvt__now_ms() - t1;
        if (status[i]) continue;
        if (s->next_pos + 1 >= INT32_MAX / 2) { status[i] = kvt__fail(KVT_ECTX, "positions exhausted"); continue; }
        seqs[m] = s->p.seq;
        pos[m] = s->next_pos;
        bt[m] = tok[i];
        idx[m++] = i;
    }
    for (int32_t r = 0; rc == 0 && r < n_rows; r++) { /* rows: sample from their own logits the same way */
        struct kvt_gen_row *w = &rows[r];
        w->done = false;
        w->status = 0;
        if (!w->logits) { w->status = kvt__fail(KVT_EINVAL, "batch row %d has no logits", r); continue; }
        kvt__engine_set_logits(eng, w->logits);
        if ((w->status = kvt_sample(eng, &w->smp, &w->tok))) continue;
        if (kvt_token_is_eog(eng, w->tok)) { w->done = true; continue; }
        seqs[m] = w->seq;
        pos[m] = w->pos;
        bt[m] = w->tok;
        idx[m++] = n + r;
    }
    if (rc == 0 && m > 0) {
        double t0 = kvt__now_ms();
        rc = kvt_decode_multi(eng, seqs, bt, pos, m, logits);
        double dt = (kvt__now_ms() - t0) / m;
        for (int32_t k = 0; rc == 0 && k < m; k++) {
            const float *l = logits + (size_t) k * I.n_vocab;
            if (idx[k] >= n) {
                struct kvt_gen_row *w = &rows[idx[k] - n];
                memcpy(w->logits, l, sizeof(float) * (size_t) I.n_vocab);
                w->pos++;
                continue;
            }
            kvt_session *s = ss[idx[k]];
            s->decode_ms += dt;
            s->decoded++;
            note_peak(s);
            memcpy(s->logits, l, sizeof(float) * (size_t) s->n_vocab);
            s->have_logits = true;
            s->gen[s->n_gen++] = bt[k];
            status[idx[k]] = record(s, &bt[k], 1, KVT_ROLE_ASSISTANT);
        }
    }
    free(seqs);
    free(idx);
    free(pos);
    free(bt);
    free(logits);
    return rc;
}

void kvt_session_set_chunk_cb(kvt_session *s, kvt_chunk_cb cb, void *ud) {
    s->chunk_cb = cb;
    s->chunk_ud = ud;
}

int kvt_session_park(kvt_session *s) {
    kvt__clear_error();
    if (s->is_parked) return 0;
    if (s->generating) return kvt__fail(KVT_EINVAL, "park: a reply is being generated (call kvt_session_gen_end first)");
    int rc = seal(s); /* the open block is saved as it is (sealed early) */
    if (rc) return rc;
    for (int32_t i = 0; i < s->n_b; i++) {
        struct blk *b = &s->b[i];
        b->parked = b->info.residency == KVT_RES_DEVICE; /* info.p0 keeps its position for resume */
        if (b->parked) b->info.residency = KVT_RES_HOST;
    }
    kvt_seq_rm(s->eng, s->p.seq, -1, -1);
    s->is_parked = true;
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
    const kvt_pos end = s->next_pos;
    int rc = 0;
    for (;;) { /* each block back at the position it had, in position order (gaps kept) */
        int32_t i = -1;
        for (int32_t k = 0; k < s->n_b; k++)
            if (s->b[k].parked && (i < 0 || s->b[k].info.p0 < s->b[i].info.p0)) i = k;
        if (i < 0) break;
        struct blk *b = &s->b[i];
        b->parked = false;
        if (rc) { b->info.residency = KVT_RES_HOST; continue; }
        s->next_pos = b->info.p0;
        int r = load_block(s, i);
        if (r != KVT_ECORRUPT) rc = r; /* a corrupt block is reported and marked lost */
    }
    s->next_pos = end;
    return rc;
}
