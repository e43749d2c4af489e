/* engine.c — one llama.cpp model + context, opened through the public API only: parameters,
** the cache layout (a unified KV cache with scratch sequences, or one KV stream per sequence),
** the RoPE of every layer verified at open against llama.cpp's own K-shift (host re-anchoring is
** trusted only where it matches), the per-sequence position shadow, logging. */
#include "engine/engine_int.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

bool kvt__engine_verbose;

_Thread_local bool kvt__engine_short_write;

void kvt__engine_log_cb(enum ggml_log_level level, const char *text, void *ud) {
    (void) ud;
    if (kvt__engine_short_write && level >= GGML_LOG_LEVEL_ERROR) return;
    if (kvt__engine_verbose || level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

bool kvt__engine_quiet_progress(float progress, void *ud) {
    (void) progress;
    (void) ud;
    return true;
}

/* A llama.cpp built with GGML_BACKEND_DL (the bootstrap's KVTIER_LLAMA_PORTABLE=1: one CPU
** backend per x86-64 level) registers no backend until one is loaded: load them all, and ggml
** keeps the best CPU variant this CPU supports.  A native build has its CPU backend linked in,
** so this does nothing there.  Idempotent: the second engine finds the CPU device present. */
void kvt__engine_backends(void) {
    if (ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) == NULL) ggml_backend_load_all();
}

int kvt__pm_reserve(struct posmap *m, kvt_pos p) {
    if (p < 0 || p >= KVT__MAX_POS) return kvt__fail(KVT_EINVAL, "position %d is outside 0..%d", p, KVT__MAX_POS - 1);
    if (p < m->cap) return 0;
    int64_t cap = m->cap ? m->cap : 4096; /* a power of two, so at most KVT__MAX_POS: no overflow */
    while (cap <= p) cap *= 2;
    uint8_t *nb = realloc(m->bits, (size_t) cap / 8);
    if (!nb) return kvt__fail(KVT_ENOMEM, "position map of %lld positions", (long long) cap);
    memset(nb + m->cap / 8, 0, (size_t) (cap - m->cap) / 8);
    m->bits = nb;
    m->cap = (int32_t) cap;
    return 0;
}

int kvt__pm_set(struct posmap *m, kvt_pos p) {
    int rc = kvt__pm_reserve(m, p);
    if (rc) return rc;
    if (!(m->bits[p >> 3] & (1u << (p & 7)))) {
        m->bits[p >> 3] |= (uint8_t) (1u << (p & 7));
        m->n++;
    }
    return 0;
}

void kvt__pm_clear(struct posmap *m, kvt_pos p0, kvt_pos p1) {
    if (p0 < 0) p0 = 0;
    if (p1 < 0 || p1 > m->cap) p1 = m->cap;
    for (kvt_pos p = p0; p < p1; p++)
        if (m->bits[p >> 3] & (1u << (p & 7))) {
            m->bits[p >> 3] &= (uint8_t) ~(1u << (p & 7));
            m->n--;
        }
}

kvt_pos kvt__pm_max(const struct posmap *m) {
    for (kvt_pos p = m->cap - 1; p >= 0; p--)
        if (m->bits[p >> 3] & (1u << (p & 7))) return p;
    return -1;
}

/* The device llama.cpp offloads to (its first GPU or integrated GPU: llama_model_load_from_file
** takes the GPUs in ggml's order when no device list is given) and how many repeating layers go
** there: llama.cpp counts the output layer too, so N offloads the last N - 1 repeating layers and
** the output, and a negative N (or more than n_layer) all of them. */
static void device_info(kvt_engine *e) {
    struct kvt_engine_info *I = &e->info;
    snprintf(I->device, sizeof I->device, "CPU");
    I->n_layer_device = 0;
    if (e->p.n_gpu_layers == 0) return;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        enum ggml_backend_dev_type t = ggml_backend_dev_type(d);
        if (t != GGML_BACKEND_DEVICE_TYPE_GPU && t != GGML_BACKEND_DEVICE_TYPE_IGPU) continue;
        snprintf(I->device, sizeof I->device, "%s (%s)", ggml_backend_dev_name(d), ggml_backend_dev_description(d));
        I->n_layer_device = e->p.n_gpu_layers < 0 || e->p.n_gpu_layers > I->n_layer ? I->n_layer : e->p.n_gpu_layers - 1;
        return;
    }
}

int kvt_devices(char *buf, size_t n) {
    int n_gpu = 0;
    size_t used = 0;
    kvt__engine_backends();
    if (n) buf[0] = '\0';
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        enum ggml_backend_dev_type t = ggml_backend_dev_type(d);
        n_gpu += t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU;
        if (used < n) {
            int w = snprintf(buf + used, n - used, "%s%s (%s)", used ? "; " : "", ggml_backend_dev_name(d),
                             ggml_backend_dev_description(d));
            used = w < 0 ? n : KVT_MIN(n, used + (size_t) w);
        }
    }
    return n_gpu;
}

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
    p.flash_attn = KVT_FLASH_ATTN_AUTO;
    p.n_gpu_layers = -1;
    p.reanchor = KVT_REANCHOR_AUTO;
    p.kv_unified = false;
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

/* Decode a few tokens at position 0 in sequence 0 (empty at open), save them, shift them by D
** with llama.cpp's own K-shift (llama_memory_seq_add, applied by the next decode: one more token
** at D + N) and save them again; then find for every layer the RoPE (base, scale) under which the
** host rotation of the first K by D equals the second K.  This checks our understanding of
** llama.cpp's RoPE on this exact model and cache type instead of trusting per-architecture
** defaults.  One sequence, so no scratch stream is needed in streams mode. */
static int calibrate_reanchor(kvt_engine *e, double *err_out) {
    enum { N = 4, D = 777 };
    kvt_token toks[N];
    for (int i = 0; i < N; i++) toks[i] = (kvt_token) ((7 + 13 * i) % e->info.n_vocab);
    uint8_t *ba = NULL, *bb = NULL;
    size_t na = 0, nb = 0;
    int rc;
    *err_out = -1;
    e->probing = true;
    rc = kvt_engine_decode(e, 0, toks, N, 0, false);
    e->probing = false;
    if (rc == 0) rc = kvt__engine_save_seq(e, 0, &ba, &na);
    if (rc == 0) {
        llama_memory_seq_add(llama_get_memory(e->ctx), 0, -1, -1, D);
        rc = kvt_engine_decode(e, 0, toks, 1, N + D, false); /* runs the pending shift first */
    }
    if (rc == 0) rc = kvt__engine_save_seq(e, 0, &bb, &nb);
    llama_memory_seq_rm(llama_get_memory(e->ctx), 0, -1, -1);
    kvt__pm_clear(&e->pm[0], -1, -1);
    e->gen++;
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
        if (A->n_cells != N || B->n_cells != N + 1 || A->n_layer != B->n_layer) {
            rc = kvt__fail(KVT_EFORMAT, "calibration blobs have %u/%u cells in part %d", A->n_cells, B->n_cells, p);
            goto out;
        }
        for (uint32_t c = 0; c < N; c++) /* the shifted cells first, in the same order */
            if (kvt__blob_cell_pos(bb, &Lb, p, c) != kvt__blob_cell_pos(ba, &La, p, c) + D) {
                rc = kvt__fail(KVT_EFORMAT, "calibration: shifted cell %u of part %d is at position %d, expected %d", c, p,
                               kvt__blob_cell_pos(bb, &Lb, p, c), kvt__blob_cell_pos(ba, &La, p, c) + D);
                goto out;
            }
        e->rope[p] = calloc(A->n_layer, sizeof(struct kvt__rope));
        if (!e->rope[p]) {
            rc = kvt__fail(KVT_ENOMEM, "rope table");
            goto out;
        }
        int32_t ne;
        if ((rc = kvt__blob_k_f32(ba, &La, p, 0, NULL, &ne))) goto out;
        float *ka = malloc(sizeof(float) * N * ne), *kb = malloc(sizeof(float) * (N + 1) * ne);
        if (!ka || !kb) {
            free(ka);
            free(kb);
            rc = kvt__fail(KVT_ENOMEM, "calibration rows");
            goto out;
        }
        /* Every layer: the same K bytes rotated by us and by llama.cpp must agree. */
        for (uint32_t il = 0; il < A->n_layer && rc == 0; il++) {
            int32_t ne_l = 0;
            if ((rc = kvt__blob_k_f32(ba, &La, p, (int) il, NULL, &ne_l))) break;
            if (ne_l != ne) {
                rc = kvt__fail(KVT_EUNSUPPORTED, "K rows differ in size across layers (%d vs %d)", ne_l, ne);
                break;
            }
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
                            for (int d = 0; d < hd; d++) err = fmax(err, fabs(tmp[d] - kb[(size_t) c * ne + (size_t) h * hd + d]));
                        }
                    if (err < best) {
                        best = err;
                        best_r = r;
                    }
                }
            e->rope[p][il] = best_r;
            double rel = kmax > 0 ? best / kmax : best;
            if (getenv("KVT_DEBUG_CALIB"))
                fprintf(stderr, "calib part %d layer %u: base %g scale %g n_rot %d err %.3g kmax %.3g\n", p, il, best_r.base,
                        best_r.scale, best_r.n_rot, best, kmax);
            worst = fmax(worst, rel);
        }
        if (rc) {
            free(ka);
            free(kb);
            goto out;
        }
        free(ka);
        free(kb);
        if (rc) goto out;
    }
    *err_out = worst;
    const double tol = (!strcmp(e->info.type_k, "f32")) ? 1e-4 : 5e-3; /* relative to max|K| */
    if (worst > tol)
        rc = kvt__fail(KVT_EUNSUPPORTED, "host RoPE re-anchoring differs from llama.cpp by %.3g (relative, tolerance %.3g)", worst,
                       tol);
out:
    free(ba);
    free(bb);
    return rc;
}

/* Create the llama.cpp context for the cache mode: unified, n_seq + 3 ids in one cache of n_ctx
** cells; streams, n_seq ids (+1 scratch) with n_ctx / n_seq cells each (padded to 256 as
** llama.cpp pads them, so the request is exact). */
static int make_context(kvt_engine *e, struct llama_context_params *cp, bool scratch) {
    const struct kvt_engine_params *p = &e->p;
    if (e->unified) {
        e->n_seq_max = p->n_seq + 3;
        cp->n_ctx = (uint32_t) p->n_ctx;
        e->seq_a = p->n_seq;
        e->seq_b = p->n_seq + 1;
        e->seq_flush = p->n_seq + 2;
    } else {
        e->n_seq_max = p->n_seq + (scratch ? 1 : 0);
        int64_t per = ((int64_t) p->n_ctx + p->n_seq - 1) / p->n_seq;
        per = (per + 255) / 256 * 256;
        cp->n_ctx = (uint32_t) (per * e->n_seq_max);
        e->seq_a = e->seq_b = -1;
        e->seq_flush = scratch ? p->n_seq : -1;
    }
    cp->n_seq_max = (uint32_t) e->n_seq_max;
    cp->kv_unified = e->unified;
    e->ctx = llama_init_from_model(e->model, *cp);
    if (!e->ctx)
        return kvt__fail(KVT_ELLAMA, "llama.cpp could not create a context of %u cells (%s, %d sequences) for '%s'", cp->n_ctx,
                         e->unified ? "unified" : "one stream per sequence", e->n_seq_max, p->model_path);
    e->n_stream = e->unified ? 1 : (uint32_t) e->n_seq_max;
    e->n_ctx_seq = (int32_t) llama_n_ctx_seq(e->ctx);
    e->info.n_ctx = (int32_t) llama_n_ctx(e->ctx);
    e->info.n_ctx_seq = e->n_ctx_seq;
    return 0;
}

int kvt_engine_open(const struct kvt_engine_params *params, kvt_engine **out) {
    struct kvt_engine_params p = params ? *params : kvt_engine_default_params();
    enum ggml_type tk = GGML_TYPE_F16, tv = GGML_TYPE_F16; /* set by parse_type (a Release build cannot see it) */
    int rc;
    *out = NULL;
    kvt__clear_error();
    if (!p.model_path || !*p.model_path) return kvt__fail(KVT_EINVAL, "no model path given");
    if ((rc = parse_type(p.type_k, &tk, "K")) || (rc = parse_type(p.type_v, &tv, "V"))) return rc;
    if (p.flash_attn < KVT_FLASH_ATTN_AUTO || p.flash_attn > KVT_FLASH_ATTN_ON)
        return kvt__fail(KVT_EINVAL, "flash_attn %d is not -1 (auto), 0 (off) or 1 (on)", p.flash_attn);
    if (p.flash_attn == KVT_FLASH_ATTN_AUTO) p.flash_attn = tv != GGML_TYPE_F16 && tv != GGML_TYPE_F32; /* + device below */
    if (tv != GGML_TYPE_F16 && tv != GGML_TYPE_F32 && !p.flash_attn)
        return kvt__fail(KVT_EINVAL, "V cache type %s needs flash attention (quantised V is stored transposed otherwise)",
                         p.type_v);
    if (p.n_ctx < 64) return kvt__fail(KVT_EINVAL, "context of %d tokens is too small (minimum 64)", p.n_ctx);
    if (p.n_seq < 1 || p.n_seq > 64) return kvt__fail(KVT_EINVAL, "n_seq %d is outside 1..64", p.n_seq);
    if (p.n_batch < 1 || p.n_ubatch < 1)
        return kvt__fail(KVT_EINVAL, "batch %d / ubatch %d must be positive", p.n_batch, p.n_ubatch);
    if (p.n_ubatch > p.n_batch) p.n_ubatch = p.n_batch;
    struct stat st;
    if (stat(p.model_path, &st) != 0) return kvt__fail(KVT_EMODEL, "model file '%s': %s", p.model_path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return kvt__fail(KVT_EMODEL, "model path '%s' is not a regular file", p.model_path);

    kvt_engine *e = calloc(1, sizeof *e);
    if (!e) return kvt__fail(KVT_ENOMEM, "engine");
    if (pthread_mutex_init(&e->memo_mu, NULL)) {
        free(e);
        return kvt__fail(KVT_ENOMEM, "engine lock");
    }
    e->p = p;
    snprintf(e->model_path, sizeof e->model_path, "%s", p.model_path);
    e->p.model_path = e->model_path;
    e->model_size = (int64_t) st.st_size;
    e->model_mtime_ns = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    e->info.type_k = ggml_type_name(tk);
    e->info.type_v = ggml_type_name(tv);
    e->p.type_k = e->info.type_k;
    e->p.type_v = e->info.type_v;

    kvt__engine_verbose = p.verbose;
    llama_log_set(kvt__engine_log_cb, NULL);
    kvt__engine_backends();
    llama_backend_init();

    struct llama_model_params mp = llama_model_default_params();
    mp.progress_callback = kvt__engine_quiet_progress;
    mp.n_gpu_layers = p.n_gpu_layers;
    e->model = llama_model_load_from_file(p.model_path, mp);
    if (!e->model) {
        pthread_mutex_destroy(&e->memo_mu);
        free(e);
        return kvt__fail(KVT_EMODEL,
                         "llama.cpp could not load '%s' (%lld bytes): not a GGUF file, truncated, or an "
                         "unsupported architecture (run with --verbose for llama.cpp's reason)",
                         p.model_path, (long long) st.st_size);
    }
    e->vocab = llama_model_get_vocab(e->model);
    if (p.chat_template) {
        struct llama_chat_message m = { "user", "hi" };
        char probe[256];
        if (!(e->chat_template = strdup(p.chat_template))) {
            kvt_engine_free(e);
            return kvt__fail(KVT_ENOMEM, "chat template");
        }
        e->p.chat_template = e->chat_template;
        if (llama_chat_apply_template(e->chat_template, &m, 1, true, probe, (int32_t) sizeof probe) < 0) {
            kvt_engine_free(e);
            return kvt__fail(KVT_EINVAL,
                             "chat template '%.60s' is not one llama.cpp knows (a built-in name such as chatml, llama3, gemma, or "
                             "a template text with one's markers)",
                             p.chat_template);
        }
    }

    struct kvt_engine_info *I = &e->info;
    llama_model_desc(e->model, I->desc, sizeof I->desc);
    meta_str(e->model, "general.architecture", I->arch, sizeof I->arch);
    meta_str(e->model, "general.name", I->name, sizeof I->name);
    I->has_chat_template = e->chat_template || llama_model_chat_template(e->model, NULL) != NULL;
    I->n_layer = llama_model_n_layer(e->model);
    I->n_head = llama_model_n_head(e->model);
    I->n_head_kv = llama_model_n_head_kv(e->model);
    I->n_embd = llama_model_n_embd(e->model);
    I->n_swa = llama_model_n_swa(e->model);
    I->n_ctx_train = llama_model_n_ctx_train(e->model);
    I->n_vocab = llama_vocab_n_tokens(e->vocab);
    I->n_seq = p.n_seq;
    device_info(e);
    if (params && params->flash_attn == KVT_FLASH_ATTN_AUTO && I->n_layer_device > 0) e->p.flash_attn = p.flash_attn = 1;
    I->flash_attn = p.flash_attn != 0;
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
    cp.n_batch = (uint32_t) p.n_batch;
    cp.n_ubatch = (uint32_t) p.n_ubatch;
    cp.swa_full = false;
    cp.type_k = tk;
    cp.type_v = tv;
    cp.flash_attn_type = p.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.op_offload = !p.no_op_offload;
    int nt = p.n_threads > 0 ? p.n_threads : (int) sysconf(_SC_NPROCESSORS_ONLN);
    cp.n_threads = nt;
    cp.n_threads_batch = nt;
    cp.cb_eval = kvt__attn_eval_cb;
    cp.cb_eval_user_data = e;
    cp.no_perf = true;
    e->unified = p.kv_unified;
    I->kv_unified = p.kv_unified;
    e->n_parts = I->n_swa > 0 ? 2 : 1;
    e->test_corrupt_part = -1;
    e->batch = llama_batch_init(p.n_ubatch, 0, 1);
    e->logits = malloc(sizeof(float) * (size_t) I->n_vocab);
    e->pm = calloc((size_t) p.n_seq + 3, sizeof *e->pm);
    e->multi_gen = calloc((size_t) p.n_seq + 3, sizeof *e->multi_gen);
    e->n_rng = p.n_seq + 4;
    e->rng = calloc((size_t) e->n_rng, sizeof *e->rng);
    e->n_dry = p.n_seq + 4;
    e->dry = calloc((size_t) e->n_dry, sizeof *e->dry);
    e->layer_part = calloc((size_t) I->n_layer, 1);
    e->layer_idx = calloc((size_t) I->n_layer, sizeof(int16_t));
    if (!e->logits || !e->pm || !e->multi_gen || !e->rng || !e->dry || !e->layer_part || !e->layer_idx) {
        kvt_engine_free(e);
        return kvt__fail(KVT_ENOMEM, "engine buffers");
    }
    /* Streams: a scratch stream only where the SEQ_ADD path will need it (a quantised K cannot be
    ** rotated on the host); AUTO learns its path at calibration and re-creates the context if it
    ** guessed wrong. */
    bool scratch = p.reanchor == KVT_REANCHOR_SEQ_ADD || (tk != GGML_TYPE_F16 && tk != GGML_TYPE_F32);
    if ((rc = make_context(e, &cp, scratch))) {
        kvt_engine_free(e);
        return rc;
    }

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
    if (!e->unified && I->reanchor == KVT_REANCHOR_SEQ_ADD && !scratch) {
        llama_free(e->ctx);
        e->ctx = NULL;
        if ((rc = make_context(e, &cp, true))) {
            kvt_engine_free(e);
            return rc;
        }
    }
    /* bytes per token, from a one-token save; in streams mode it is also the reference layout
    ** that blocks are checked against before any cell of a sequence is touched */
    {
        kvt_token t0 = 1 % I->n_vocab;
        uint8_t *b = NULL;
        size_t n = 0, n0;
        rc = kvt_engine_decode(e, 0, &t0, 1, 0, false);
        if (rc == 0) rc = kvt__engine_save_seq(e, 0, &b, &n);
        kvt_seq_rm(e, 0, -1, -1);
        n0 = 8 + (size_t) e->n_parts * (4 + 4 * (size_t) e->n_stream); /* header + per-part stream/cell counts */
        I->kv_bytes_per_token = n > n0 ? n - n0 : 0;
        if (rc == 0 && !e->unified) {
            struct kvt__blob_layout L;
            rc = kvt__blob_parse(b, n, e->n_parts, &L);
            if (rc == 0) {
                struct kvt__blob_src src = { b, &L, { INT32_MIN, INT32_MIN }, { INT32_MAX, INT32_MAX }, 0 };
                rc = kvt__blob_write(&src, 1, e->n_parts, 1, 0, 0, &e->ref, &e->ref_n);
            }
        }
        free(b);
        if (rc) {
            kvt_engine_free(e);
            return rc;
        }
    }
    kvt__clear_error();
    *out = e;
    return 0;
}

void kvt_engine_free(kvt_engine *e) {
    if (!e) return;
    if (e->smpl) llama_sampler_free(e->smpl);
    if (e->smpl_t) llama_sampler_free(e->smpl_t);
    for (int32_t i = 0; e->dry && i < e->n_dry; i++) {
        if (e->dry[i].s) llama_sampler_free(e->dry[i].s);
        free(e->dry[i].brk);
    }
    free(e->dry);
    for (int32_t i = 0; e->rng && i < e->n_rng; i++) {
        if (e->rng[i].dist) llama_sampler_free(e->rng[i].dist);
        if (e->rng[i].xtc) llama_sampler_free(e->rng[i].xtc);
        if (e->rng[i].miro) llama_sampler_free(e->rng[i].miro);
    }
    free(e->rng);
    if (e->batch.token) llama_batch_free(e->batch);
    if (e->ctx) llama_free(e->ctx);
    if (e->model) llama_model_free(e->model);
    free(e->chat_template);
    for (int i = 0; e->pm && i < e->p.n_seq + 3; i++) free(e->pm[i].bits);
    free(e->multi_gen);
    free(e->ref);
    for (int i = 0; i < e->n_caps; i++) {
        free(e->caps[i].w);
        free(e->caps[i].vis);
        free(e->caps[i].q);
        free(e->caps[i].q_pos);
    }
    free(e->caps);
    for (int i = 0; i < 3; i++) free(e->dev_buf[i]);
    free(e->fa_k);
    free(e->snap);
    free(e->cp_buf);
    free(e->cp_pos);
    free(e->pm);
    free(e->rope[0]);
    free(e->rope[1]);
    free(e->layer_part);
    free(e->layer_idx);
    free(e->logits);
    kvt__engine_memo_free(e);
    pthread_mutex_destroy(&e->memo_mu);
    free(e);
}

void kvt_engine_info(const kvt_engine *e, struct kvt_engine_info *info) { *info = e->info; }
