/* engine.c — the only kvtier file that includes llama.h.
**
** One llama.cpp model + context with a unified KV cache, and on top of its public API:
** tokenize/detokenize, chat template, chunked prefill/decode, sampling, and the three block
** primitives (save, load with RoPE re-anchoring, attention capture).  Facts and traps of the
** API this relies on are in shared/notes/llama-kv-api.md. */
#include "internal.h"
#include "blob.h"

#include "ggml.h"
#include "llama.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

double kvt__now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Per-sequence shadow of which positions hold a cell (the full-attention cache). */
struct posmap {
    uint8_t *bits;
    int32_t  cap;  /* positions covered */
    int32_t  n;    /* positions set */
};

/* What the attention callback keeps for one layer: the last ubatch. */
struct attn_cap {
    int32_t layer;
    int32_t n_kv, n_tok, n_head;  /* softmax shape */
    float   *w;                   /* [n_head][n_tok][n_kv] */
    uint8_t *vis;                 /* [n_tok][n_kv]: mask says visible */
    size_t   cap_w, cap_vis;
    int32_t  hd;                  /* Q head dim */
    float   *q;                   /* [n_tok][n_head][hd] */
    size_t   cap_q;
    bool     have, have_q;
    uint64_t gen;                 /* cache generation right after the capture */
    int32_t  seq;
    kvt_pos *q_pos;               /* [n_tok] */
    size_t   cap_qpos;
};

struct kvt_engine {
    struct llama_model         *model;
    struct llama_context       *ctx;
    const struct llama_vocab   *vocab;
    struct kvt_engine_params    p;
    struct kvt_engine_info      info;
    char                        model_path[1024];
    int32_t                     seq_a, seq_b, seq_flush; /* scratch sequence ids */
    int                         n_parts;                 /* 2 for iSWA caches */
    struct llama_batch          batch;
    float                      *logits;
    bool                        have_logits;
    bool                        shift_pending, skip_flush;
    struct posmap              *pm;                      /* [n_seq + 3] */
    uint64_t                    gen;                     /* bumps on every cache mutation */
    /* re-anchoring */
    struct kvt__rope           *rope[2];                 /* per part, per layer of the part */
    int32_t                     n_rot;
    bool                        neox;
    /* layer il -> part (0 full, 1 SWA) and index within the part; -1 unknown */
    int8_t                     *layer_part;
    int16_t                    *layer_idx;
    /* attention capture */
    struct attn_cap            *caps;
    int32_t                     n_caps;
    bool                        capture_q, capturing;
    int32_t                     cur_seq, cur_n;
    const kvt_pos              *cur_pos;
    void                       *mask_probe[KVT__MAX_LAYERS]; /* open-time: mask tensor per layer */
    bool                        probing;
    /* sampler chain, rebuilt when the sampling params change */
    struct llama_sampler       *smpl;
    struct kvt_sampling         smpl_p;
    /* last whole-sequence snapshot taken for attention mapping, reused while gen is unchanged */
    uint8_t                    *snap;
    size_t                      snap_n;
    uint64_t                    snap_gen;
    int32_t                     snap_seq;
};

/* ---------------------------------------------------------------------------------------- */
/* logging                                                                                  */

static bool g_verbose;
static void log_cb(enum ggml_log_level level, const char *text, void *ud) {
    (void) ud;
    if (g_verbose || level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static bool quiet_progress(float progress, void *ud) { (void) progress; (void) ud; return true; }

/* ---------------------------------------------------------------------------------------- */
/* position shadow                                                                          */

static int pm_set(struct posmap *m, kvt_pos p) {
    if (p < 0) return KVT_EINVAL;
    if (p >= m->cap) {
        int32_t cap = m->cap ? m->cap : 4096;
        while (cap <= p) cap *= 2;
        uint8_t *nb = realloc(m->bits, (size_t) cap / 8);
        if (!nb) return kvt__fail(KVT_ENOMEM, "position map of %d positions", cap);
        memset(nb + m->cap / 8, 0, (size_t) (cap - m->cap) / 8);
        m->bits = nb;
        m->cap = cap;
    }
    if (!(m->bits[p >> 3] & (1u << (p & 7)))) {
        m->bits[p >> 3] |= (uint8_t) (1u << (p & 7));
        m->n++;
    }
    return 0;
}

static void pm_clear(struct posmap *m, kvt_pos p0, kvt_pos p1) {
    if (p0 < 0) p0 = 0;
    if (p1 < 0 || p1 > m->cap) p1 = m->cap;
    for (kvt_pos p = p0; p < p1; p++)
        if (m->bits[p >> 3] & (1u << (p & 7))) {
            m->bits[p >> 3] &= (uint8_t) ~(1u << (p & 7));
            m->n--;
        }
}

static kvt_pos pm_max(const struct posmap *m) {
    for (kvt_pos p = m->cap - 1; p >= 0; p--)
        if (m->bits[p >> 3] & (1u << (p & 7))) return p;
    return -1;
}

/* ---------------------------------------------------------------------------------------- */
/* attention callback                                                                       */

static int layer_of(const char *name, const char *prefix) {
    size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) != 0 || name[n] != '-') return -1;
    char *end;
    long il = strtol(name + n + 1, &end, 10);
    return (*end == '\0' && il >= 0 && il < KVT__MAX_LAYERS) ? (int) il : -1;
}

static struct attn_cap *cap_for(kvt_engine *e, int il) {
    for (int i = 0; i < e->n_caps; i++)
        if (e->caps[i].layer == il) return &e->caps[i];
    return NULL;
}

static bool grow(void **p, size_t *cap, size_t need) {
    if (need <= *cap) return true;
    void *n = realloc(*p, need);
    if (!n) return false;
    *p = n;
    *cap = need;
    return true;
}

static float tensor_f(const struct ggml_tensor *t, size_t off) {
    const uint8_t *d = (const uint8_t *) t->data + off;
    if (t->type == GGML_TYPE_F16) return ggml_fp16_to_fp32(*(const ggml_fp16_t *) (const void *) d);
    return *(const float *) (const void *) d;
}

static bool eval_cb(struct ggml_tensor *t, bool ask, void *ud) {
    kvt_engine *e = ud;
    int il;
    if (e->probing) {
        il = layer_of(t->name, "kq_soft_max");
        if (ask) return il >= 0;
        if (il >= 0 && t->src[1]) e->mask_probe[il] = t->src[1];
        return true;
    }
    if (!e->capturing) return ask ? false : true;
    if ((il = layer_of(t->name, "kq_soft_max")) >= 0) {
        struct attn_cap *c = cap_for(e, il);
        if (ask) return c != NULL;
        if (!c || !t->src[1] || !ggml_backend_buffer_is_host(t->buffer)) return true;
        const struct ggml_tensor *m = t->src[1];
        const int32_t n_kv = (int32_t) t->ne[0], n_tok = (int32_t) t->ne[1], n_head = (int32_t) t->ne[2];
        if (n_tok != e->cur_n || t->ne[3] != 1) return true; /* not our ubatch layout */
        size_t nw = (size_t) n_kv * n_tok * n_head, nv = (size_t) n_kv * n_tok;
        if (!grow((void **) &c->w, &c->cap_w, nw * sizeof(float)) || !grow((void **) &c->vis, &c->cap_vis, nv) ||
            !grow((void **) &c->q_pos, &c->cap_qpos, (size_t) n_tok * sizeof(kvt_pos)))
            return true;
        for (int h = 0; h < n_head; h++)
            for (int tk = 0; tk < n_tok; tk++) {
                const float *row = (const float *) (const void *) ((const uint8_t *) t->data + h * t->nb[2] + tk * t->nb[1]);
                memcpy(c->w + ((size_t) h * n_tok + tk) * n_kv, row, (size_t) n_kv * sizeof(float));
            }
        for (int tk = 0; tk < n_tok; tk++)
            for (int k = 0; k < n_kv; k++)
                c->vis[(size_t) tk * n_kv + k] = tensor_f(m, (size_t) k * m->nb[0] + (size_t) tk * m->nb[1]) > -INFINITY;
        memcpy(c->q_pos, e->cur_pos, (size_t) n_tok * sizeof(kvt_pos));
        c->n_kv = n_kv;
        c->n_tok = n_tok;
        c->n_head = n_head;
        c->seq = e->cur_seq;
        c->have = true;
        return true;
    }
    if (e->capture_q && (il = layer_of(t->name, "Qcur")) >= 0) {
        struct attn_cap *c = cap_for(e, il);
        if (ask) return c != NULL && t->op == GGML_OP_ROPE;
        if (!c || t->op != GGML_OP_ROPE || t->type != GGML_TYPE_F32 || !ggml_backend_buffer_is_host(t->buffer)) return true;
        /* [head_dim, n_head, n_tokens] */
        int32_t hd = (int32_t) t->ne[0], nh = (int32_t) t->ne[1], nt = (int32_t) t->ne[2];
        if (nt != e->cur_n) return true;
        if (!grow((void **) &c->q, &c->cap_q, (size_t) hd * nh * nt * sizeof(float))) return true;
        for (int tk = 0; tk < nt; tk++)
            for (int h = 0; h < nh; h++)
                memcpy(c->q + ((size_t) tk * nh + h) * hd,
                       (const uint8_t *) t->data + tk * t->nb[2] + h * t->nb[1], (size_t) hd * sizeof(float));
        c->hd = hd;
        c->have_q = true;
        return true;
    }
    return ask ? false : true;
}

/* ---------------------------------------------------------------------------------------- */
/* open / close                                                                             */

struct kvt_engine_params kvt_engine_default_params(void) {
    struct kvt_engine_params p;
    memset(&p, 0, sizeof p);
    p.n_ctx = 4096;
    p.n_batch = 512;
    p.n_ubatch = 512;
    p.n_seq = 1;
    p.n_threads = 0;
    p.type_k = "f16";
    p.type_v = "f16";
    p.flash_attn = false;
    p.reanchor = KVT_REANCHOR_AUTO;
    return p;
}

static int parse_type(const char *s, enum ggml_type *t, const char *what) {
    if (!s || !strcmp(s, "f16")) *t = GGML_TYPE_F16;
    else if (!strcmp(s, "f32")) *t = GGML_TYPE_F32;
    else if (!strcmp(s, "q8_0")) *t = GGML_TYPE_Q8_0;
    else return kvt__fail(KVT_EINVAL, "%s cache type '%s' is not one of f16, f32, q8_0", what, s);
    return 0;
}

static int meta_str(const struct llama_model *m, const char *key, char *buf, size_t n) {
    int r = llama_model_meta_val_str(m, key, buf, n);
    if (r < 0) buf[0] = '\0';
    return r;
}

static bool meta_f32(const struct llama_model *m, const char *arch, const char *suffix, float *v) {
    char key[128], buf[64];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (meta_str(m, key, buf, sizeof buf) < 0) return false;
    *v = strtof(buf, NULL);
    return true;
}

static int save_seq_all(kvt_engine *e, int32_t seq, uint8_t **buf, size_t *n);
static int flush_shift(kvt_engine *e);

/* Decode a few tokens at position 0 and at position D in two scratch sequences, then find for
** every layer the RoPE (base, scale) under which the host rotation of the first K by D equals
** the second K.  This checks our understanding of llama.cpp's RoPE on this exact model and
** cache type instead of trusting per-architecture defaults. */
static int calibrate_reanchor(kvt_engine *e, double *err_out) {
    enum { N = 4, D = 777 };
    kvt_token toks[N];
    for (int i = 0; i < N; i++) toks[i] = (kvt_token) ((7 + 13 * i) % e->info.n_vocab);
    uint8_t *ba = NULL, *bb = NULL;
    size_t na = 0, nb = 0;
    int rc;
    *err_out = -1;
    e->probing = true;
    rc = kvt_decode(e, e->seq_a, toks, N, 0, false);
    e->probing = false;
    if (rc == 0) rc = save_seq_all(e, e->seq_a, &ba, &na);
    kvt_seq_rm(e, e->seq_a, -1, -1);
    /* llama.cpp's own K-shift of the same bytes: restore into seq_b, seq_add(D), force it */
    if (rc == 0 && llama_state_seq_set_data(e->ctx, ba, na, e->seq_b) != na)
        rc = kvt__fail(KVT_ELLAMA, "calibration: llama_state_seq_set_data failed");
    if (rc == 0) {
        llama_memory_seq_add(llama_get_memory(e->ctx), e->seq_b, -1, -1, D);
        e->shift_pending = true;
        rc = flush_shift(e);
    }
    if (rc == 0) rc = save_seq_all(e, e->seq_b, &bb, &nb);
    llama_memory_seq_rm(llama_get_memory(e->ctx), e->seq_b, -1, -1);
    if (rc) goto out;

    struct kvt__blob_layout La, Lb;
    if ((rc = kvt__blob_parse(ba, na, e->n_parts, &La)) || (rc = kvt__blob_parse(bb, nb, e->n_parts, &Lb))) goto out;

    /* layer il -> part: group layers by the mask tensor their softmax used */
    {
        void *base_mask = NULL;
        int n_first = 0;
        for (int il = 0; il < e->info.n_layer; il++) {
            if (!e->mask_probe[il]) continue;
            if (!base_mask) base_mask = e->mask_probe[il];
            if (e->mask_probe[il] == base_mask) n_first++;
        }
        int idx[2] = { 0, 0 };
        bool first_is_base = e->n_parts == 1 || (uint32_t) n_first == La.part[0].n_layer;
        bool ok = base_mask != NULL && (e->n_parts == 1 || La.part[0].n_layer != La.part[1].n_layer);
        for (int il = 0; il < e->info.n_layer; il++) {
            e->layer_part[il] = -1;
            e->layer_idx[il] = -1;
            if (!ok || !e->mask_probe[il]) continue;
            int part = (e->mask_probe[il] == base_mask) ? (first_is_base ? 0 : 1) : (first_is_base ? 1 : 0);
            e->layer_part[il] = (int8_t) part;
            e->layer_idx[il] = (int16_t) idx[part]++;
        }
    }

    if (e->p.reanchor == KVT_REANCHOR_SEQ_ADD) goto out;
    const enum llama_rope_type rt = llama_model_rope_type(e->model);
    if (rt != LLAMA_ROPE_TYPE_NORM && rt != LLAMA_ROPE_TYPE_NEOX) {
        rc = kvt__fail(KVT_EUNSUPPORTED, "rope type %d cannot be re-anchored on the host", (int) rt);
        goto out;
    }
    float fb = 10000.0f, fb_swa = 0.0f, fs = llama_model_rope_freq_scale_train(e->model);
    meta_f32(e->model, e->info.arch, "rope.freq_base", &fb);
    bool has_swa_base = meta_f32(e->model, e->info.arch, "rope.freq_base_swa", &fb_swa);
    const float bases[] = { fb, has_swa_base ? fb_swa : 10000.0f, 10000.0f, 1e6f, 5e5f };
    const float scales[] = { fs, 1.0f };
    double worst = 0;
    for (int p = 0; p < e->n_parts; p++) {
        const struct kvt__blob_part *A = &La.part[p], *B = &Lb.part[p];
        if (A->n_cells != N || B->n_cells != N || A->n_layer != B->n_layer) {
            rc = kvt__fail(KVT_EFORMAT, "calibration blobs have %u/%u cells in part %d", A->n_cells, B->n_cells, p);
            goto out;
        }
        e->rope[p] = calloc(A->n_layer, sizeof(struct kvt__rope));
        if (!e->rope[p]) { rc = kvt__fail(KVT_ENOMEM, "rope table"); goto out; }
        int32_t ne;
        if ((rc = kvt__blob_k_f32(ba, &La, p, 0, NULL, &ne))) goto out;
        float *ka = malloc(sizeof(float) * N * ne), *kb = malloc(sizeof(float) * N * ne);
        if (!ka || !kb) { free(ka); free(kb); rc = kvt__fail(KVT_ENOMEM, "calibration rows"); goto out; }
        /* Every layer: the same K bytes rotated by us and by llama.cpp must agree. */
        for (uint32_t il = 0; il < A->n_layer && rc == 0; il++) {
            int32_t ne_l = 0;
            if ((rc = kvt__blob_k_f32(ba, &La, p, (int) il, NULL, &ne_l))) break;
            if (ne_l != ne) { rc = kvt__fail(KVT_EUNSUPPORTED, "K rows differ in size across layers (%d vs %d)", ne_l, ne); break; }
            kvt__blob_k_f32(ba, &La, p, (int) il, ka, &ne);
            kvt__blob_k_f32(bb, &Lb, p, (int) il, kb, &ne);
            const int hd = ne / e->info.n_head_kv;
            double best = INFINITY, kmax = 0;
            struct kvt__rope best_r = { 0 };
            for (int i = 0; i < N * ne; i++) kmax = fmax(kmax, fabs(kb[i]));
            for (size_t bi = 0; bi < sizeof bases / sizeof bases[0]; bi++)
                for (size_t si = 0; si < sizeof scales / sizeof scales[0]; si++) {
                    struct kvt__rope r = { bases[bi], scales[si], e->n_rot > 0 && e->n_rot <= hd ? e->n_rot : hd, e->neox };
                    double err = 0;
                    float tmp[4096];
                    for (int c = 0; c < N && hd <= 4096; c++)
                        for (int h = 0; h < e->info.n_head_kv; h++) {
                            memcpy(tmp, ka + (size_t) c * ne + (size_t) h * hd, sizeof(float) * hd);
                            kvt__rope_rotate_f32(tmp, &r, D);
                            for (int d = 0; d < hd; d++)
                                err = fmax(err, fabs(tmp[d] - kb[(size_t) c * ne + (size_t) h * hd + d]));
                        }
                    if (err < best) { best = err; best_r = r; }
                }
            e->rope[p][il] = best_r;
            double rel = kmax > 0 ? best / kmax : best;
            if (getenv("KVT_DEBUG_CALIB"))
                fprintf(stderr, "calib part %d layer %u: base %g scale %g n_rot %d err %.3g kmax %.3g\n", p, il,
                        best_r.base, best_r.scale, best_r.n_rot, best, kmax);
            worst = fmax(worst, rel);
        }
        if (rc) { free(ka); free(kb); goto out; }
        free(ka);
        free(kb);
        if (rc) goto out;
    }
    *err_out = worst;
    const double tol = (!strcmp(e->info.type_k, "f32")) ? 1e-4 : 5e-3; /* relative to max|K| */
    if (worst > tol)
        rc = kvt__fail(KVT_EUNSUPPORTED, "host RoPE re-anchoring differs from llama.cpp by %.3g (relative, tolerance %.3g)",
                       worst, tol);
out:
    free(ba);
    free(bb);
    return rc;
}

int kvt_engine_open(const struct kvt_engine_params *params, kvt_engine **out) {
    struct kvt_engine_params p = params ? *params : kvt_engine_default_params();
    enum ggml_type tk, tv;
    int rc;
    *out = NULL;
    kvt__clear_error();
    if (!p.model_path || !*p.model_path) return kvt__fail(KVT_EINVAL, "no model path given");
    if ((rc = parse_type(p.type_k, &tk, "K")) || (rc = parse_type(p.type_v, &tv, "V"))) return rc;
    if (tv != GGML_TYPE_F16 && tv != GGML_TYPE_F32 && !p.flash_attn)
        return kvt__fail(KVT_EINVAL, "V cache type %s needs flash attention (quantised V is stored transposed otherwise)", p.type_v);
    if (p.n_ctx < 64) return kvt__fail(KVT_EINVAL, "context of %d tokens is too small (minimum 64)", p.n_ctx);
    if (p.n_seq < 1 || p.n_seq > 64) return kvt__fail(KVT_EINVAL, "n_seq %d is outside 1..64", p.n_seq);
    if (p.n_batch < 1 || p.n_ubatch < 1) return kvt__fail(KVT_EINVAL, "batch %d / ubatch %d must be positive", p.n_batch, p.n_ubatch);
    if (p.n_ubatch > p.n_batch) p.n_ubatch = p.n_batch;
    struct stat st;
    if (stat(p.model_path, &st) != 0)
        return kvt__fail(KVT_EMODEL, "model file '%s': %s", p.model_path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return kvt__fail(KVT_EMODEL, "model path '%s' is not a regular file", p.model_path);

    kvt_engine *e = calloc(1, sizeof *e);
    if (!e) return kvt__fail(KVT_ENOMEM, "engine");
    e->p = p;
    snprintf(e->model_path, sizeof e->model_path, "%s", p.model_path);
    e->p.model_path = e->model_path;
    e->info.type_k = ggml_type_name(tk);
    e->info.type_v = ggml_type_name(tv);
    e->p.type_k = e->info.type_k;
    e->p.type_v = e->info.type_v;

    g_verbose = p.verbose;
    llama_log_set(log_cb, NULL);
    llama_backend_init();

    struct llama_model_params mp = llama_model_default_params();
    mp.progress_callback = quiet_progress;
    e->model = llama_model_load_from_file(p.model_path, mp);
    if (!e->model) {
        free(e);
        return kvt__fail(KVT_EMODEL, "llama.cpp could not load '%s' (%lld bytes): not a GGUF file, truncated, or an "
                         "unsupported architecture (run with --verbose for llama.cpp's reason)",
                         p.model_path, (long long) st.st_size);
    }
    e->vocab = llama_model_get_vocab(e->model);

    struct kvt_engine_info *I = &e->info;
    llama_model_desc(e->model, I->desc, sizeof I->desc);
    meta_str(e->model, "general.architecture", I->arch, sizeof I->arch);
    meta_str(e->model, "general.name", I->name, sizeof I->name);
    I->has_chat_template = llama_model_chat_template(e->model, NULL) != NULL;
    I->n_layer = llama_model_n_layer(e->model);
    I->n_head = llama_model_n_head(e->model);
    I->n_head_kv = llama_model_n_head_kv(e->model);
    I->n_embd = llama_model_n_embd(e->model);
    I->n_swa = llama_model_n_swa(e->model);
    I->n_ctx_train = llama_model_n_ctx_train(e->model);
    I->n_vocab = llama_vocab_n_tokens(e->vocab);
    I->n_seq = p.n_seq;
    {
        char key[96];
        char buf[32];
        snprintf(key, sizeof key, "%s.rope.dimension_count", I->arch);
        e->n_rot = meta_str(e->model, key, buf, sizeof buf) >= 0 ? atoi(buf) : 0;
        e->neox = llama_model_rope_type(e->model) == LLAMA_ROPE_TYPE_NEOX;
    }
    if (I->n_layer > KVT__MAX_LAYERS) {
        kvt_engine_free(e);
        return kvt__fail(KVT_EUNSUPPORTED, "model has %d layers (max %d)", I->n_layer, KVT__MAX_LAYERS);
    }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) p.n_ctx;
    cp.n_batch = (uint32_t) p.n_batch;
    cp.n_ubatch = (uint32_t) p.n_ubatch;
    cp.n_seq_max = (uint32_t) p.n_seq + 3;
    cp.kv_unified = true; /* required: partial seq_cp across streams aborts otherwise */
    cp.swa_full = false;
    cp.type_k = tk;
    cp.type_v = tv;
    cp.flash_attn_type = p.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    int nt = p.n_threads > 0 ? p.n_threads : (int) sysconf(_SC_NPROCESSORS_ONLN);
    cp.n_threads = nt;
    cp.n_threads_batch = nt;
    cp.cb_eval = eval_cb;
    cp.cb_eval_user_data = e;
    cp.no_perf = true;
    e->ctx = llama_init_from_model(e->model, cp);
    if (!e->ctx) {
        kvt_engine_free(e);
        return kvt__fail(KVT_ELLAMA, "llama.cpp could not create a context of %d tokens for '%s'", p.n_ctx, p.model_path);
    }
    I->n_ctx = (int32_t) llama_n_ctx(e->ctx);
    e->seq_a = p.n_seq;
    e->seq_b = p.n_seq + 1;
    e->seq_flush = p.n_seq + 2;
    e->n_parts = I->n_swa > 0 ? 2 : 1;
    e->batch = llama_batch_init(p.n_ubatch, 0, 1);
    e->logits = malloc(sizeof(float) * (size_t) I->n_vocab);
    e->pm = calloc((size_t) p.n_seq + 3, sizeof *e->pm);
    e->layer_part = calloc((size_t) I->n_layer, 1);
    e->layer_idx = calloc((size_t) I->n_layer, sizeof(int16_t));
    if (!e->logits || !e->pm || !e->layer_part || !e->layer_idx) {
        kvt_engine_free(e);
        return kvt__fail(KVT_ENOMEM, "engine buffers");
    }

    /* bytes per token, from a one-token save */
    double err = -1;
    rc = calibrate_reanchor(e, &err);
    I->reanchor_err = err;
    if (rc == KVT_ENOMEM || rc == KVT_ELLAMA || rc == KVT_ECTX) {
        kvt_engine_free(e);
        return rc;
    }
    if (p.reanchor == KVT_REANCHOR_HOST && rc) {
        kvt_engine_free(e);
        return rc;
    }
    I->reanchor = (rc == 0 && p.reanchor != KVT_REANCHOR_SEQ_ADD) ? KVT_REANCHOR_HOST : KVT_REANCHOR_SEQ_ADD;
    {
        kvt_token t0 = 1 % I->n_vocab;
        uint8_t *b = NULL;
        size_t n = 0, n0;
        rc = kvt_decode(e, e->seq_a, &t0, 1, 0, false);
        if (rc == 0) rc = save_seq_all(e, e->seq_a, &b, &n);
        kvt_seq_rm(e, e->seq_a, -1, -1);
        free(b);
        n0 = 8 + 8 * (size_t) e->n_parts; /* header + per-part stream/cell counts */
        I->kv_bytes_per_token = n > n0 ? n - n0 : 0;
        if (rc) { kvt_engine_free(e); return rc; }
    }
    kvt__clear_error();
    *out = e;
    return 0;
}

void kvt_engine_free(kvt_engine *e) {
    if (!e) return;
    if (e->smpl) llama_sampler_free(e->smpl);
    if (e->batch.token) llama_batch_free(e->batch);
    if (e->ctx) llama_free(e->ctx);
    if (e->model) llama_model_free(e->model);
    for (int i = 0; e->pm && i < e->p.n_seq + 3; i++) free(e->pm[i].bits);
    for (int i = 0; i < e->n_caps; i++) {
        free(e->caps[i].w); free(e->caps[i].vis); free(e->caps[i].q); free(e->caps[i].q_pos);
    }
    free(e->caps);
    free(e->snap);
    free(e->pm);
    free(e->rope[0]);
    free(e->rope[1]);
    free(e->layer_part);
    free(e->layer_idx);
    free(e->logits);
    free(e);
}

void kvt_engine_info(const kvt_engine *e, struct kvt_engine_info *info) { *info = e->info; }

/* ---------------------------------------------------------------------------------------- */
/* text                                                                                     */

int kvt_tokenize(kvt_engine *e, const char *text, bool add_bos, bool parse_special, kvt_token **tokens,
                 int32_t *n_tokens) {
    *tokens = NULL;
    *n_tokens = 0;
    if (!text) return kvt__fail(KVT_EINVAL, "tokenize: NULL text");
    if (llama_vocab_type(e->vocab) == LLAMA_VOCAB_TYPE_NONE)
        return kvt__fail(KVT_EINVAL, "model '%s' has no tokenizer", e->model_path);
    size_t len = strlen(text);
    if (len > INT32_MAX / 2) return kvt__fail(KVT_EINVAL, "text of %zu bytes is too long to tokenize", len);
    int32_t cap = (int32_t) len + 8;
    kvt_token *t = malloc(sizeof(kvt_token) * (size_t) cap);
    if (!t) return kvt__fail(KVT_ENOMEM, "tokenize %zu bytes", len);
    int32_t n = llama_tokenize(e->vocab, text, (int32_t) len, t, cap, add_bos, parse_special);
    if (n < 0) {
        cap = -n;
        kvt_token *t2 = realloc(t, sizeof(kvt_token) * (size_t) cap);
        if (!t2) { free(t); return kvt__fail(KVT_ENOMEM, "tokenize"); }
        t = t2;
        n = llama_tokenize(e->vocab, text, (int32_t) len, t, cap, add_bos, parse_special);
        if (n < 0) { free(t); return kvt__fail(KVT_ELLAMA, "llama_tokenize failed"); }
    }
    *tokens = t;
    *n_tokens = n;
    return 0;
}

int kvt_detokenize(kvt_engine *e, const kvt_token *tokens, int32_t n, bool render_special, char **text) {
    int32_t cap = n * 8 + 16;
    char *buf = malloc((size_t) cap);
    *text = NULL;
    if (!buf) return kvt__fail(KVT_ENOMEM, "detokenize");
    int32_t r = llama_detokenize(e->vocab, tokens, n, buf, cap - 1, false, render_special);
    if (r < 0) {
        cap = -r + 1;
        char *b2 = realloc(buf, (size_t) cap);
        if (!b2) { free(buf); return kvt__fail(KVT_ENOMEM, "detokenize"); }
        buf = b2;
        r = llama_detokenize(e->vocab, tokens, n, buf, cap - 1, false, render_special);
        if (r < 0) { free(buf); return kvt__fail(KVT_ELLAMA, "llama_detokenize failed"); }
    }
    buf[r] = '\0';
    *text = buf;
    return 0;
}

bool kvt_token_is_eog(const kvt_engine *e, kvt_token tok) { return llama_vocab_is_eog(e->vocab, tok); }

int kvt_chat_format(kvt_engine *e, const struct kvt_chat_msg *msgs, int32_t n, bool add_ass, const char *fallback,
                    char **text) {
    *text = NULL;
    const char *tmpl = llama_model_chat_template(e->model, NULL);
    if (!tmpl) tmpl = fallback ? fallback : "chatml";
    struct llama_chat_message *cm = malloc(sizeof *cm * (size_t) (n > 0 ? n : 1));
    if (!cm) return kvt__fail(KVT_ENOMEM, "chat messages");
    size_t total = 64;
    for (int32_t i = 0; i < n; i++) {
        const char *r = msgs[i].role;
        if (!r || (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant"))) {
            free(cm);
            return kvt__fail(KVT_EINVAL, "message %d has role '%s'; expected system, user or assistant", i, r ? r : "(null)");
        }
        cm[i].role = r;
        cm[i].content = msgs[i].content ? msgs[i].content : "";
        total += strlen(cm[i].content) + 64;
    }
    char *buf = malloc(total * 2);
    if (!buf) { free(cm); return kvt__fail(KVT_ENOMEM, "chat format"); }
    int32_t r = llama_chat_apply_template(tmpl, cm, (size_t) n, add_ass, buf, (int32_t) (total * 2));
    if (r > (int32_t) (total * 2)) {
        char *b2 = realloc(buf, (size_t) r + 1);
        if (!b2) { free(buf); free(cm); return kvt__fail(KVT_ENOMEM, "chat format"); }
        buf = b2;
        r = llama_chat_apply_template(tmpl, cm, (size_t) n, add_ass, buf, r + 1);
    }
    free(cm);
    if (r < 0) {
        free(buf);
        return kvt__fail(KVT_EINVAL, "chat template '%.40s' is not supported by llama_chat_apply_template", tmpl);
    }
    buf[r] = '\0';
    *text = buf;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* decode                                                                                   */

static bool seq_ok(const kvt_engine *e, int32_t seq) { return seq >= 0 && seq < e->p.n_seq + 3; }

int kvt_decode(kvt_engine *e, int32_t seq, const kvt_token *tokens, int32_t n, kvt_pos pos0, bool want_logits) {
    if (!seq_ok(e, seq)) return kvt__fail(KVT_EINVAL, "sequence id %d is outside 0..%d", seq, e->p.n_seq - 1);
    if (n <= 0 || !tokens) return kvt__fail(KVT_EINVAL, "decode of %d tokens", n);
    kvt_pos pos_buf[4096];
    e->have_logits = false;
    for (int32_t off = 0; off < n; off += e->p.n_ubatch) {
        int32_t m = KVT_MIN(n - off, e->p.n_ubatch);
        struct llama_batch *b = &e->batch;
        for (int32_t i = 0; i < m; i++) {
            if (tokens[off + i] < 0 || tokens[off + i] >= e->info.n_vocab)
                return kvt__fail(KVT_EINVAL, "token %d at index %d is outside the vocabulary of %d", tokens[off + i],
                                 off + i, e->info.n_vocab);
            b->token[i] = tokens[off + i];
            b->pos[i] = pos0 + off + i;
            b->n_seq_id[i] = 1;
            b->seq_id[i][0] = seq;
            b->logits[i] = want_logits && off + i == n - 1;
            if (i < 4096) pos_buf[i] = pos0 + off + i;
        }
        b->n_tokens = m;
        e->capturing = e->n_caps > 0 && seq < e->p.n_seq && m <= 4096;
        e->cur_seq = seq;
        e->cur_n = m;
        e->cur_pos = pos_buf;
        for (int i = 0; e->capturing && i < e->n_caps; i++) e->caps[i].have = e->caps[i].have_q = false;
        int r = llama_decode(e->ctx, *b);
        e->capturing = false;
        if (r == 1)
            return kvt__fail(KVT_ECTX, "no free KV cells for %d tokens at position %d (context of %d cells)", m,
                             pos0 + off, e->info.n_ctx);
        if (r != 0) return kvt__fail(KVT_ELLAMA, "llama_decode returned %d at position %d", r, pos0 + off);
        e->shift_pending = false;
        for (int32_t i = 0; i < m; i++)
            if (pm_set(&e->pm[seq], pos0 + off + i)) return KVT_ENOMEM;
        e->gen++;
        for (int i = 0; i < e->n_caps; i++)
            if (e->caps[i].have) e->caps[i].gen = e->gen;
    }
    if (want_logits) {
        const float *l = llama_get_logits_ith(e->ctx, -1);
        if (!l) return kvt__fail(KVT_ELLAMA, "llama.cpp returned no logits");
        memcpy(e->logits, l, sizeof(float) * (size_t) e->info.n_vocab);
        e->have_logits = true;
    }
    return 0;
}

int kvt_decode_multi(kvt_engine *e, const int32_t *seqs, const kvt_token *toks, const kvt_pos *pos, int32_t n,
                     float *logits_out) {
    if (n <= 0 || n > e->p.n_ubatch || !seqs || !toks || !pos || !logits_out)
        return kvt__fail(KVT_EINVAL, "multi-sequence decode of %d tokens (1..%d)", n, e->p.n_ubatch);
    struct llama_batch *b = &e->batch;
    for (int32_t i = 0; i < n; i++) {
        if (seqs[i] < 0 || seqs[i] >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "sequence id %d is outside 0..%d", seqs[i], e->p.n_seq - 1);
        for (int32_t k = 0; k < i; k++)
            if (seqs[k] == seqs[i]) return kvt__fail(KVT_EINVAL, "sequence %d appears twice in one multi-sequence decode", seqs[i]);
        if (toks[i] < 0 || toks[i] >= e->info.n_vocab)
            return kvt__fail(KVT_EINVAL, "token %d at index %d is outside the vocabulary of %d", toks[i], i, e->info.n_vocab);
        b->token[i] = toks[i];
        b->pos[i] = pos[i];
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = seqs[i];
        b->logits[i] = 1;
    }
    b->n_tokens = n;
    e->have_logits = false;
    e->capturing = false; /* the capture maps one sequence per ubatch */
    int r = llama_decode(e->ctx, *b);
    if (r == 1) return kvt__fail(KVT_ECTX, "no free KV cells for %d tokens (context of %d cells)", n, e->info.n_ctx);
    if (r != 0) return kvt__fail(KVT_ELLAMA, "llama_decode returned %d for a batch of %d sequences", r, n);
    e->shift_pending = false;
    for (int32_t i = 0; i < n; i++)
        if (pm_set(&e->pm[seqs[i]], pos[i])) return KVT_ENOMEM;
    e->gen++;
    for (int32_t i = 0; i < n; i++) {
        const float *l = llama_get_logits_ith(e->ctx, i);
        if (!l) return kvt__fail(KVT_ELLAMA, "llama.cpp returned no logits for batch row %d", i);
        memcpy(logits_out + (size_t) i * e->info.n_vocab, l, sizeof(float) * (size_t) e->info.n_vocab);
    }
    return 0;
}

const float *kvt_logits(kvt_engine *e) { return e->have_logits ? e->logits : NULL; }

void kvt__engine_set_logits(kvt_engine *e, const float *logits) {
    memcpy(e->logits, logits, sizeof(float) * (size_t) e->info.n_vocab);
    e->have_logits = true;
}

struct kvt_grammar {
    struct llama_sampler *smpl;
};

int kvt_grammar_new(kvt_engine *e, const char *gbnf, const char *root, kvt_grammar **out) {
    *out = NULL;
    if (!gbnf || !*gbnf) return kvt__fail(KVT_EINVAL, "grammar: empty GBNF text");
    kvt_grammar *g = calloc(1, sizeof *g);
    if (!g) return kvt__fail(KVT_ENOMEM, "grammar");
    g->smpl = llama_sampler_init_grammar(e->vocab, gbnf, root ? root : "root");
    if (!g->smpl) {
        free(g);
        return kvt__fail(KVT_EINVAL, "grammar: the GBNF text (%zu bytes) does not parse, or has no rule '%s'", strlen(gbnf),
                         root ? root : "root");
    }
    *out = g;
    return 0;
}

void kvt_grammar_free(kvt_grammar *g) {
    if (!g) return;
    llama_sampler_free(g->smpl);
    free(g);
}

static void fill_candidates(const kvt_engine *e, llama_token_data *d) {
    for (int32_t i = 0; i < e->info.n_vocab; i++) d[i] = (llama_token_data){ i, e->logits[i], 0.0f };
}

int kvt_sample(kvt_engine *e, const struct kvt_sampling *s, kvt_token *tok) {
    static const struct kvt_sampling greedy = { 0, 1, 0, 0, NULL };
    if (!s) s = &greedy;
    if (!e->have_logits) return kvt__fail(KVT_EINVAL, "sample: no logits (decode with want_logits first)");
    struct kvt_sampling key = *s;
    key.grammar = NULL; /* the chain does not depend on the grammar */
    if (!e->smpl || memcmp(&e->smpl_p, &key, sizeof key) != 0) {
        if (e->smpl) llama_sampler_free(e->smpl);
        e->smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
        if (s->temperature <= 0) {
            llama_sampler_chain_add(e->smpl, llama_sampler_init_greedy());
        } else {
            if (s->top_k > 0) llama_sampler_chain_add(e->smpl, llama_sampler_init_top_k(s->top_k));
            if (s->top_p < 1.0f) llama_sampler_chain_add(e->smpl, llama_sampler_init_top_p(s->top_p, 1));
            llama_sampler_chain_add(e->smpl, llama_sampler_init_temp(s->temperature));
            llama_sampler_chain_add(e->smpl, llama_sampler_init_dist(s->seed));
        }
        e->smpl_p = key;
    }
    const int32_t nv = e->info.n_vocab;
    llama_token_data *d = malloc(sizeof *d * (size_t) nv);
    if (!d) return kvt__fail(KVT_ENOMEM, "sampling candidates");
    fill_candidates(e, d);
    llama_token_data_array arr = { d, (size_t) nv, -1, false };
    llama_sampler_apply(e->smpl, &arr);
    int rc = 0;
    if (arr.selected < 0 || arr.selected >= (int64_t) arr.size) rc = kvt__fail(KVT_ELLAMA, "sampler selected nothing");
    if (rc == 0 && s->grammar) {
        /* cheap path first: keep the token if the grammar allows it (one candidate to check) */
        llama_token_data one = { arr.data[arr.selected].id, 1.0f, 0.0f };
        llama_token_data_array a1 = { &one, 1, -1, false };
        llama_sampler_apply(s->grammar->smpl, &a1);
        if (isinf(one.logit)) { /* rejected: mask the whole vocabulary, then sample again */
            fill_candidates(e, d);
            arr = (llama_token_data_array){ d, (size_t) nv, -1, false };
            llama_sampler_apply(s->grammar->smpl, &arr);
            bool any = false;
            for (size_t i = 0; i < arr.size && !any; i++) any = !isinf(arr.data[i].logit);
            if (!any) rc = kvt__fail(KVT_EINVAL, "sample: the grammar allows no token here");
            else {
                llama_sampler_apply(e->smpl, &arr);
                if (arr.selected < 0 || arr.selected >= (int64_t) arr.size || isinf(arr.data[arr.selected].logit))
                    rc = kvt__fail(KVT_ELLAMA, "sampler selected nothing the grammar allows");
            }
        }
    }
    if (rc == 0) {
        *tok = arr.data[arr.selected].id;
        llama_sampler_accept(e->smpl, *tok);
        if (s->grammar) llama_sampler_accept(s->grammar->smpl, *tok);
    }
    free(d);
    return rc;
}

int kvt_seq_rm(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1) {
    if (!seq_ok(e, seq)) return kvt__fail(KVT_EINVAL, "sequence id %d", seq);
    llama_memory_seq_rm(llama_get_memory(e->ctx), seq, p0, p1);
    pm_clear(&e->pm[seq], p0, p1);
    e->gen++;
    return 0;
}

int kvt_seq_cp(kvt_engine *e, int32_t src, int32_t dst, kvt_pos p0, kvt_pos p1) {
    if (!seq_ok(e, src) || !seq_ok(e, dst) || src == dst)
        return kvt__fail(KVT_EINVAL, "seq_cp from %d to %d", src, dst);
    llama_memory_seq_cp(llama_get_memory(e->ctx), src, dst, p0, p1);
    struct posmap *s = &e->pm[src];
    kvt_pos lo = p0 < 0 ? 0 : p0, hi = (p1 < 0 || p1 > s->cap) ? s->cap : p1;
    for (kvt_pos p = lo; p < hi; p++)
        if (s->bits[p >> 3] & (1u << (p & 7)))
            if (pm_set(&e->pm[dst], p)) return KVT_ENOMEM;
    e->gen++;
    return 0;
}

kvt_pos kvt_seq_pos_max(kvt_engine *e, int32_t seq) { return seq_ok(e, seq) ? pm_max(&e->pm[seq]) : -1; }

int32_t kvt_seq_n_cells(kvt_engine *e, int32_t seq) { return seq_ok(e, seq) ? e->pm[seq].n : 0; }

/* ---------------------------------------------------------------------------------------- */
/* block primitives                                                                         */

/* A pending K-shift is applied by the next llama_decode; force it with one token in the flush
** sequence, then remove that token. */
static int flush_shift(kvt_engine *e) {
    if (!e->shift_pending || e->skip_flush) return 0;
    kvt_token t = 0;
    int rc = kvt_decode(e, e->seq_flush, &t, 1, 0, false);
    kvt_seq_rm(e, e->seq_flush, -1, -1);
    return rc;
}

static int save_seq_all(kvt_engine *e, int32_t seq, uint8_t **buf, size_t *n) {
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
    if (!seq_ok(e, seq) || seq >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "block save: sequence id %d", seq);
    if (p0 < 0 || p1 <= p0) return kvt__fail(KVT_EINVAL, "block save: empty range [%d, %d)", p0, p1);
    int rc = flush_shift(e);
    if (rc) return rc;
    llama_memory_t mem = llama_get_memory(e->ctx);
    llama_memory_seq_cp(mem, seq, e->seq_a, p0, p1); /* metadata only: cells are shared */
    kvt_blob *b = calloc(1, sizeof *b);
    if (!b) { llama_memory_seq_rm(mem, e->seq_a, -1, -1); return kvt__fail(KVT_ENOMEM, "blob"); }
    rc = save_seq_all(e, e->seq_a, &b->data, &b->size);
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
    if (!seq_ok(e, seq) || seq >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "block load: sequence id %d", seq);
    kvt_pos tail = pm_max(&e->pm[seq]);
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
        if ((rc = pm_set(&e->pm[seq], kvt__blob_cell_pos(blob->data, &L, 0, c) + delta))) return rc;
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

/* ---------------------------------------------------------------------------------------- */
/* attention capture                                                                        */

int kvt_attn_capture(kvt_engine *e, const int32_t *layers, int32_t n, bool capture_q) {
    if (n > 0 && e->p.flash_attn)
        return kvt__fail(KVT_EUNSUPPORTED, "attention capture needs flash attention off (softmax is fused otherwise)");
    for (int32_t i = 0; i < n; i++)
        if (layers[i] < 0 || layers[i] >= e->info.n_layer)
            return kvt__fail(KVT_EINVAL, "attention layer %d is outside 0..%d", layers[i], e->info.n_layer - 1);
    struct attn_cap *c = n ? calloc((size_t) n, sizeof *c) : NULL;
    if (n && !c) return kvt__fail(KVT_ENOMEM, "attention capture");
    for (int i = 0; i < e->n_caps; i++) {
        free(e->caps[i].w); free(e->caps[i].vis); free(e->caps[i].q); free(e->caps[i].q_pos);
    }
    free(e->caps);
    for (int32_t i = 0; i < n; i++) c[i].layer = layers[i];
    e->caps = c;
    e->n_caps = n;
    e->capture_q = capture_q;
    return 0;
}

void kvt_attn_free(kvt_attn *a) {
    if (!a) return;
    free(a->q_pos); free(a->k_pos); free(a->w); free(a->q);
    free(a);
}

int kvt_attn_get(kvt_engine *e, int32_t layer, int32_t seq, kvt_attn **out) {
    *out = NULL;
    struct attn_cap *c = cap_for(e, layer);
    if (!c || !c->have || c->seq != seq)
        return kvt__fail(KVT_ENOENT, "no attention captured for layer %d of sequence %d", layer, seq);
    if (c->gen != e->gen)
        return kvt__fail(KVT_ENOENT, "the KV cache changed since layer %d was captured", layer);
    int part = 0, idx = 0;
    if (kvt_engine_layer_part(e, layer, &part, &idx)) return kvt__fail(KVT_EFORMAT, "layer %d: cache part unknown", layer);
    int rc;
    if (!e->snap || e->snap_gen != e->gen || e->snap_seq != seq) {
        free(e->snap);
        e->snap = NULL;
        if ((rc = save_seq_all(e, seq, &e->snap, &e->snap_n))) return rc;
        e->snap_gen = e->gen;
        e->snap_seq = seq;
    }
    const uint8_t *buf = e->snap;
    size_t n = e->snap_n;
    struct kvt__blob_layout L;
    if ((rc = kvt__blob_parse(buf, n, e->n_parts, &L))) return rc;
    const uint32_t nc = L.part[part].n_cells;
    const int32_t nk = c->n_kv, nt = c->n_tok, nh = c->n_head;
    /* cells visible to any query row, ascending cell index */
    int32_t *vis_cells = malloc(sizeof(int32_t) * (size_t) nk);
    kvt_pos *cell_pos = malloc(sizeof(kvt_pos) * (size_t) nk);
    kvt_pos *cand = malloc(sizeof(kvt_pos) * (nc ? nc : 1));
    kvt_attn *a = calloc(1, sizeof *a);
    if (!vis_cells || !cell_pos || !cand || !a) { rc = kvt__fail(KVT_ENOMEM, "attention map"); goto done; }
    /* Full-attention layers: every cell of the sequence some query row can see.  SWA layers:
    ** the cells the last row can see, since llama.cpp serialises only SWA cells within the
    ** window of the sequence's last position. */
    const bool swa = part == 1 && e->info.n_swa > 0;
    const int32_t t0 = swa ? nt - 1 : 0;
    int32_t n_vis = 0;
    for (int32_t k = 0; k < nk; k++) {
        bool any = false;
        for (int32_t t = t0; t < nt && !any; t++) any = c->vis[(size_t) t * nk + k];
        if (any) vis_cells[n_vis++] = k;
    }
    kvt_pos qmax = c->q_pos[nt - 1];
    int32_t n_cand = 0;
    for (uint32_t i = 0; i < nc; i++) {
        kvt_pos p = kvt__blob_cell_pos(buf, &L, part, i);
        if (p <= qmax && (!swa || qmax - p < e->info.n_swa)) cand[n_cand++] = p;
    }
    if (n_cand != n_vis) {
        rc = kvt__fail(KVT_EFORMAT, "layer %d: %d visible cells but %d cells of sequence %d in range", layer, n_vis, n_cand, seq);
        goto done;
    }
    for (int32_t i = 0; i < n_vis; i++) cell_pos[i] = cand[i];
    /* keys sorted by position: order of visible cells by pos */
    int32_t *ord = malloc(sizeof(int32_t) * (size_t) (n_vis ? n_vis : 1));
    if (!ord) { rc = kvt__fail(KVT_ENOMEM, "attention map"); goto done; }
    for (int32_t i = 0; i < n_vis; i++) ord[i] = i;
    for (int32_t i = 1; i < n_vis; i++) { /* insertion sort: cells are nearly sorted by position */
        int32_t x = ord[i], j = i - 1;
        while (j >= 0 && cell_pos[ord[j]] > cell_pos[x]) { ord[j + 1] = ord[j]; j--; }
        ord[j + 1] = x;
    }
    a->layer = layer;
    a->n_query = nt;
    a->n_head = nh;
    a->n_keys = n_vis;
    a->q_pos = malloc(sizeof(kvt_pos) * (size_t) nt);
    a->k_pos = malloc(sizeof(kvt_pos) * (size_t) (n_vis ? n_vis : 1));
    a->w = calloc((size_t) nt * nh * (n_vis ? n_vis : 1), sizeof(float));
    if (!a->q_pos || !a->k_pos || !a->w) { free(ord); rc = kvt__fail(KVT_ENOMEM, "attention"); goto done; }
    memcpy(a->q_pos, c->q_pos, sizeof(kvt_pos) * (size_t) nt);
    for (int32_t i = 0; i < n_vis; i++) a->k_pos[i] = cell_pos[ord[i]];
    for (int32_t t = 0; t < nt; t++)
        for (int32_t h = 0; h < nh; h++)
            for (int32_t i = 0; i < n_vis; i++) {
                int32_t cell = vis_cells[ord[i]];
                a->w[((size_t) t * nh + h) * n_vis + i] =
                    c->vis[(size_t) t * nk + cell] ? c->w[((size_t) h * nt + t) * nk + cell] : 0.0f;
            }
    free(ord);
    if (e->capture_q && c->have_q) {
        a->head_dim = c->hd;
        a->q = malloc(sizeof(float) * (size_t) nt * nh * c->hd);
        if (!a->q) { rc = kvt__fail(KVT_ENOMEM, "attention Q"); goto done; }
        memcpy(a->q, c->q, sizeof(float) * (size_t) nt * nh * c->hd);
    }
    *out = a;
    a = NULL;
done:
    kvt_attn_free(a);
    free(vis_cells);
    free(cell_pos);
    free(cand);
    return rc;
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

/* ---------------------------------------------------------------------------------------- */
/* dense retrieval: the embedder (kvtier.h section 7)                                       */
/*
** Its own model and context, apart from any engine: embeddings on, MEAN pooling over the
** tokens of sequence 0, one sequence, flash attention off.  A text is decoded as ONE ubatch
** (n_batch = n_ubatch = n_ctx): llama.cpp pools per ubatch and overwrites the sequence's pooled
** vector with each ubatch, so a text split across ubatches would be embedded by its last
** piece only.  llama.cpp outputs logits for every token of an embeddings batch as well
** (n_vocab floats per token, 1 MiB per token for Gemma 3's 262144 tokens): the price of
** embedding with a generative GGUF through the public API. */

struct kvt_embedder {
    struct llama_model       *model;
    struct llama_context     *ctx;
    const struct llama_vocab *vocab;
    int32_t                   n_ctx;   /* longest text in tokens (requested, not padded) */
    int32_t                   dim;     /* pooled embedding width */
    bool                      add_bos; /* the vocab asks for BOS */
    kvt_token                *tok;     /* tokenizer scratch */
    int32_t                   cap_tok;
    char                      path[1024];
};

int kvt_embedder_open(const char *model_path, int32_t n_ctx, int32_t n_threads, kvt_embedder **out) {
    if (!out) return kvt__fail(KVT_EINVAL, "embedder open: NULL out");
    *out = NULL;
    kvt__clear_error();
    if (!model_path || !*model_path) return kvt__fail(KVT_EINVAL, "embedder: no model path given");
    if (n_ctx <= 0) n_ctx = 512;
    if (n_ctx < 8) return kvt__fail(KVT_EINVAL, "embedder context of %d tokens is too small (minimum 8)", n_ctx);
    if (n_threads < 0) return kvt__fail(KVT_EINVAL, "embedder: %d threads", n_threads);
    struct stat st;
    if (stat(model_path, &st) != 0)
        return kvt__fail(KVT_EMODEL, "embedding model file '%s': %s", model_path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return kvt__fail(KVT_EMODEL, "embedding model path '%s' is not a regular file", model_path);

    kvt_embedder *em = calloc(1, sizeof *em);
    if (!em) return kvt__fail(KVT_ENOMEM, "embedder");
    snprintf(em->path, sizeof em->path, "%s", model_path);
    llama_log_set(log_cb, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.progress_callback = quiet_progress;
    em->model = llama_model_load_from_file(model_path, mp);
    if (!em->model) {
        free(em);
        return kvt__fail(KVT_EMODEL, "llama.cpp could not load embedding model '%s' (%lld bytes): not a GGUF file, "
                         "truncated, or an unsupported architecture", model_path, (long long) st.st_size);
    }
    em->vocab = llama_model_get_vocab(em->model);
    const int32_t n_train = llama_model_n_ctx_train(em->model);
    if (n_train > 0 && n_ctx > n_train) {
        kvt_embedder_free(em);
        return kvt__fail(KVT_EINVAL, "embedder context of %d tokens exceeds the %d tokens '%s' was trained on", n_ctx,
                         n_train, model_path);
    }
    em->n_ctx = n_ctx;
    em->dim = llama_model_n_embd_out(em->model);
    em->add_bos = llama_vocab_get_add_bos(em->vocab);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n_ctx;
    cp.n_batch = (uint32_t) n_ctx;  /* one text = one batch = one ubatch (see above) */
    cp.n_ubatch = (uint32_t) n_ctx;
    cp.n_seq_max = 1;
    cp.kv_unified = true;
    cp.embeddings = true;
    cp.pooling_type = LLAMA_POOLING_TYPE_MEAN;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    int nt = n_threads > 0 ? n_threads : (int) sysconf(_SC_NPROCESSORS_ONLN);
    cp.n_threads = nt;
    cp.n_threads_batch = nt;
    cp.no_perf = true;
    em->ctx = llama_init_from_model(em->model, cp);
    if (!em->ctx) {
        kvt_embedder_free(em);
        return kvt__fail(KVT_ELLAMA, "llama.cpp could not create an embedding context of %d tokens for '%s'", n_ctx,
                         model_path);
    }
    if (em->dim <= 0 || llama_pooling_type(em->ctx) != LLAMA_POOLING_TYPE_MEAN) {
        int32_t d = em->dim;
        kvt_embedder_free(em);
        return kvt__fail(KVT_ELLAMA, "embedding context for '%s' has width %d and not mean pooling", model_path, d);
    }
    *out = em;
    return 0;
}

void kvt_embedder_free(kvt_embedder *em) {
    if (!em) return;
    if (em->ctx) llama_free(em->ctx);
    if (em->model) llama_model_free(em->model);
    free(em->tok);
    free(em);
}

int32_t kvt_embedder_dim(const kvt_embedder *em) { return em ? em->dim : 0; }

int kvt_embed(kvt_embedder *em, const char *text, float *out) {
    if (!em || !out) return kvt__fail(KVT_EINVAL, "embed: NULL %s", em ? "output" : "embedder");
    if (!text || !*text) return kvt__fail(KVT_EINVAL, "embed: empty text");
    if (llama_vocab_type(em->vocab) == LLAMA_VOCAB_TYPE_NONE)
        return kvt__fail(KVT_EINVAL, "embedding model '%s' has no tokenizer", em->path);
    size_t len = strlen(text);
    if (len > INT32_MAX / 2) return kvt__fail(KVT_EINVAL, "embed: text of %zu bytes is too long", len);
    int32_t n = llama_tokenize(em->vocab, text, (int32_t) len, em->tok, em->cap_tok, em->add_bos, false);
    if (n < 0) { /* -n tokens needed */
        kvt_token *t = realloc(em->tok, sizeof(kvt_token) * (size_t) -n);
        if (!t) return kvt__fail(KVT_ENOMEM, "embed: %d tokens", -n);
        em->tok = t;
        em->cap_tok = -n;
        n = llama_tokenize(em->vocab, text, (int32_t) len, em->tok, em->cap_tok, em->add_bos, false);
        if (n < 0) return kvt__fail(KVT_ELLAMA, "llama_tokenize failed on %zu bytes", len);
    }
    if (n == 0) return kvt__fail(KVT_EINVAL, "embed: text of %zu bytes has no tokens", len);
    if (n > em->n_ctx) n = em->n_ctx; /* the first n_ctx tokens */

    llama_memory_t mem = llama_get_memory(em->ctx);
    llama_memory_clear(mem, true);
    int rc = 0;
    int r = llama_decode(em->ctx, llama_batch_get_one(em->tok, n));
    const float *v = r == 0 ? llama_get_embeddings_seq(em->ctx, 0) : NULL;
    if (r != 0) rc = kvt__fail(KVT_ELLAMA, "embed: llama_decode returned %d for %d tokens", r, n);
    else if (!v) rc = kvt__fail(KVT_ELLAMA, "embed: llama.cpp returned no pooled embedding for %d tokens", n);
    else {
        double ss = 0;
        for (int32_t i = 0; i < em->dim; i++) ss += (double) v[i] * v[i];
        const double norm = sqrt(ss);
        if (!(norm > 0) || !isfinite(norm)) rc = kvt__fail(KVT_ELLAMA, "embed: pooled embedding has norm %g", norm);
        else
            for (int32_t i = 0; i < em->dim; i++) out[i] = (float) (v[i] / norm);
    }
    llama_memory_clear(mem, true);
    return rc;
}
