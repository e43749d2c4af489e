/* attn.c — attention capture: a cb_eval graph callback keeps the kq_soft_max rows (and Q) of the
** chosen layers for the last ubatch; kvt_attn_get maps the KV columns to positions through the
** mask and the positions of the sequence's cells (kvt__engine_cell_pos: their records, no K/V).
**
** With flash attention the softmax is fused into GGML_OP_FLASH_ATTN_EXT and never materialised:
** the callback then stops after that op (its output is the "kqv_out-<il>" view) and recomputes
** the rows on the host from the op's own inputs: softmax(scale * Q K^T (+ soft-cap) + mask) with
** the op's scale and soft-cap, each query head against its KV head (GQA).  The same numbers the
** fused kernel used, at n_tok * n_kv * n_head * head_dim multiply-adds per captured layer.
** Tensors on a device (Vulkan, CUDA) are copied to the host first (ggml_backend_tensor_get). */
#include "engine/engine_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int layer_of(const char *name, const char *prefix) {
    size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) != 0 || name[n] != '-') return -1;
    char *end;
    long il = strtol(name + n + 1, &end, 10);
    return (*end == '\0' && il >= 0 && il < KVT__MAX_LAYERS) ? (int) il : -1;
}

struct attn_cap *kvt__attn_cap_for(kvt_engine *e, int il) {
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

/* The bytes of t readable on the host: t->data itself in a host buffer, else a copy of t's span
** (ggml_nbytes covers a view's strides) in scratch slot i.  NULL when the copy cannot be made. */
static const uint8_t *host_bytes(kvt_engine *e, const struct ggml_tensor *t, int i) {
    if (!t->buffer || !t->data) return NULL;
    if (ggml_backend_buffer_is_host(t->buffer)) return t->data;
    size_t n = ggml_nbytes(t);
    if (!grow((void **) &e->dev_buf[i], &e->dev_cap[i], n)) return NULL;
    ggml_backend_tensor_get(t, e->dev_buf[i], 0, n);
    return e->dev_buf[i];
}

static float tensor_f(const struct ggml_tensor *t, const uint8_t *base, size_t off) {
    const uint8_t *d = base + off;
    if (t->type == GGML_TYPE_F16) return ggml_fp16_to_fp32(*(const ggml_fp16_t *) (const void *) d);
    return *(const float *) (const void *) d;
}

/* The flash-attention node behind "kqv_out-<il>" (its reshape), or NULL. */
static const struct ggml_tensor *fattn_of(const struct ggml_tensor *t) {
    const struct ggml_tensor *s = t->src[0];
    return s && s->op == GGML_OP_FLASH_ATTN_EXT ? s : NULL;
}

/* Shapes of one captured layer, from the softmax [n_kv, n_rows, n_head, 1] or from the flash-
** attention inputs (Q [hd, n_rows, n_head, 1], K [hd, n_kv, n_head_kv, 1]); false when it is not
** this capture's ubatch layout or its buffers cannot grow (nothing is kept then). */
static bool cap_begin(kvt_engine *e, struct attn_cap *c, int32_t n_kv, int32_t n_rows, int32_t n_head, int64_t ne3) {
    const int32_t n_tok = e->cur_n; /* our rows: the first cur_n of the ubatch's cap_rows */
    if (n_rows != e->cap_rows || n_tok > n_rows || ne3 != 1) return false;
    size_t nw = (size_t) n_kv * n_tok * n_head, nv = (size_t) n_kv * n_tok;
    if (!grow((void **) &c->w, &c->cap_w, nw * sizeof(float)) || !grow((void **) &c->vis, &c->cap_vis, nv) ||
        !grow((void **) &c->q_pos, &c->cap_qpos, (size_t) n_tok * sizeof(kvt_pos)))
        return false;
    c->n_kv = n_kv;
    c->n_tok = n_tok;
    c->n_head = n_head;
    return true;
}

static void cap_finish(kvt_engine *e, struct attn_cap *c, const struct ggml_tensor *m, const uint8_t *mb) {
    for (int tk = 0; tk < c->n_tok; tk++)
        for (int k = 0; k < c->n_kv; k++)
            c->vis[(size_t) tk * c->n_kv + k] = tensor_f(m, mb, (size_t) k * m->nb[0] + (size_t) tk * m->nb[1]) > -INFINITY;
    memcpy(c->q_pos, e->cur_pos, (size_t) c->n_tok * sizeof(kvt_pos));
    c->seq = e->cur_seq;
    c->have = true;
}

/* The softmax rows of a flash-attention layer, recomputed on the host from the op's inputs. */
static void cap_fattn(kvt_engine *e, struct attn_cap *c, const struct ggml_tensor *fa) {
    const struct ggml_tensor *q = fa->src[0], *k = fa->src[1], *m = fa->src[3];
    float scale, max_bias, softcap;
    memcpy(&scale, (const float *) fa->op_params + 0, sizeof scale);
    memcpy(&max_bias, (const float *) fa->op_params + 1, sizeof max_bias);
    memcpy(&softcap, (const float *) fa->op_params + 2, sizeof softcap);
    /* ALiBi slopes and attention sinks change the softmax in ways not recomputed here */
    if (!q || !k || !m || q->type != GGML_TYPE_F32 || max_bias != 0.0f || fa->src[4]) return;
    const int32_t hd = (int32_t) q->ne[0], n_head = (int32_t) q->ne[2], n_kv = (int32_t) k->ne[1];
    const int32_t n_head_kv = (int32_t) k->ne[2];
    if (k->ne[0] != hd || n_head_kv < 1 || n_head % n_head_kv || k->ne[3] != 1) return;
    const struct ggml_type_traits *tt = ggml_get_type_traits(k->type);
    if (k->type != GGML_TYPE_F32 && !tt->to_float) return;
    if (!cap_begin(e, c, n_kv, (int32_t) q->ne[1], n_head, q->ne[3])) return;
    const uint8_t *qb = host_bytes(e, q, 0), *kb = host_bytes(e, k, 1), *mb = host_bytes(e, m, 2);
    size_t nk = (size_t) hd * n_kv * n_head_kv;
    if (!qb || !kb || !mb || !grow((void **) &e->fa_k, &e->fa_cap_k, nk * sizeof(float))) return;
    for (int32_t h = 0; h < n_head_kv; h++) /* K as floats: [n_head_kv][n_kv][hd] */
        for (int32_t j = 0; j < n_kv; j++) {
            const uint8_t *row = kb + (size_t) j * k->nb[1] + (size_t) h * k->nb[2];
            float *dst = e->fa_k + ((size_t) h * n_kv + j) * hd;
            if (k->type == GGML_TYPE_F32) memcpy(dst, row, (size_t) hd * sizeof(float));
            else tt->to_float(row, dst, hd);
        }
    if (softcap != 0.0f) scale /= softcap; /* as ggml's kernels: s = softcap * tanh(scale / softcap * q.k) */
    const int32_t gqa = n_head / n_head_kv;
    for (int32_t h = 0; h < n_head; h++)
        for (int32_t tk = 0; tk < c->n_tok; tk++) {
            const uint8_t *qr = qb + (size_t) tk * q->nb[1] + (size_t) h * q->nb[2];
            float *w = c->w + ((size_t) h * c->n_tok + tk) * n_kv, mx = -INFINITY;
            for (int32_t j = 0; j < n_kv; j++) {
                const float mv = tensor_f(m, mb, (size_t) j * m->nb[0] + (size_t) tk * m->nb[1]);
                if (mv == -INFINITY) {
                    w[j] = -INFINITY;
                    continue;
                }
                const float *kr = e->fa_k + ((size_t) (h / gqa) * n_kv + j) * hd;
                float s = 0;
                for (int32_t d = 0; d < hd; d++) s += *(const float *) (const void *) (qr + (size_t) d * q->nb[0]) * kr[d];
                s *= scale;
                if (softcap != 0.0f) s = softcap * tanhf(s);
                w[j] = s + mv;
                if (w[j] > mx) mx = w[j];
            }
            double sum = 0;
            for (int32_t j = 0; j < n_kv; j++) sum += w[j] = w[j] == -INFINITY ? 0.0f : expf(w[j] - mx);
            for (int32_t j = 0; j < n_kv && sum > 0; j++) w[j] = (float) (w[j] / sum);
        }
    cap_finish(e, c, m, mb);
}

bool kvt__attn_eval_cb(struct ggml_tensor *t, bool ask, void *ud) {
    kvt_engine *e = ud;
    int il;
    if (e->probing) {
        /* the mask each layer's attention uses (SWA layers have their own): the softmax's src[1],
        ** or flash attention's src[3] */
        const struct ggml_tensor *fa = NULL;
        il = layer_of(t->name, "kq_soft_max");
        if (il < 0 && (il = layer_of(t->name, "kqv_out")) >= 0 && !(fa = fattn_of(t))) il = -1;
        if (ask) return il >= 0;
        if (il >= 0 && fa && fa->src[3]) e->mask_probe[il] = fa->src[3];
        else if (il >= 0 && t->src[1]) e->mask_probe[il] = t->src[1];
        return true;
    }
    if (!e->capturing) return ask ? false : true;
    const bool fa_on = e->p.flash_attn;
    if ((il = layer_of(t->name, fa_on ? "kqv_out" : "kq_soft_max")) >= 0) {
        struct attn_cap *c = kvt__attn_cap_for(e, il);
        /* One llama_decode may run several ubatches (kvt_engine_decode_batch): the scheduler asks about
        ** every node once per ubatch, and the lowest captured layer's softmax is the first asked
        ** of ours, so counting those asks tells which ubatch this is.  Only the target ubatch's
        ** nodes are asked for: each one asked splits the graph compute there (a sync of the
        ** threads), which the other ubatches are spared. */
        if (ask) {
            if (c && il == e->cap_first_layer) e->ub_seen++;
            return c != NULL && e->ub_seen == e->cap_ubatch;
        }
        if (!c || e->ub_seen != e->cap_ubatch) return true;
        if (fa_on) {
            const struct ggml_tensor *fa = fattn_of(t);
            if (fa) cap_fattn(e, c, fa);
            return true;
        }
        if (!t->src[1] || t->type != GGML_TYPE_F32) return true;
        const struct ggml_tensor *m = t->src[1];
        const int32_t n_kv = (int32_t) t->ne[0], n_head = (int32_t) t->ne[2];
        if (!cap_begin(e, c, n_kv, (int32_t) t->ne[1], n_head, t->ne[3])) return true;
        const uint8_t *tb = host_bytes(e, t, 0), *mb = host_bytes(e, m, 1);
        if (!tb || !mb) return true;
        for (int h = 0; h < n_head; h++)
            for (int tk = 0; tk < c->n_tok; tk++) {
                const float *row = (const float *) (const void *) (tb + h * t->nb[2] + tk * t->nb[1]);
                memcpy(c->w + ((size_t) h * c->n_tok + tk) * n_kv, row, (size_t) n_kv * sizeof(float));
            }
        cap_finish(e, c, m, mb);
        return true;
    }
    if (e->capture_q && (il = layer_of(t->name, "Qcur")) >= 0) {
        struct attn_cap *c = kvt__attn_cap_for(e, il);
        /* Q comes before the softmax of its layer: in the lowest captured layer the count of
        ** ubatches is still that of the previous one */
        const bool ours = e->ub_seen + (il == e->cap_first_layer) == e->cap_ubatch;
        if (ask) return c != NULL && t->op == GGML_OP_ROPE && ours;
        if (!c || t->op != GGML_OP_ROPE || t->type != GGML_TYPE_F32) return true;
        /* [head_dim, n_head, n_tokens] */
        int32_t hd = (int32_t) t->ne[0], nh = (int32_t) t->ne[1], nt = e->cur_n;
        if ((int32_t) t->ne[2] != e->cap_rows || !ours) return true;
        const uint8_t *tb = host_bytes(e, t, 0);
        if (!tb || !grow((void **) &c->q, &c->cap_q, (size_t) hd * nh * nt * sizeof(float))) return true;
        for (int tk = 0; tk < nt; tk++)
            for (int h = 0; h < nh; h++)
                memcpy(c->q + ((size_t) tk * nh + h) * hd, tb + tk * t->nb[2] + h * t->nb[1], (size_t) hd * sizeof(float));
        c->hd = hd;
        c->have_q = true;
        return true;
    }
    return ask ? false : true;
}

int kvt_attn_capture(kvt_engine *e, const int32_t *layers, int32_t n, bool capture_q) {
    for (int32_t i = 0; i < n; i++)
        if (layers[i] < 0 || layers[i] >= e->info.n_layer)
            return kvt__fail(KVT_EINVAL, "attention layer %d is outside 0..%d", layers[i], e->info.n_layer - 1);
    struct attn_cap *c = n ? calloc((size_t) n, sizeof *c) : NULL;
    if (n && !c) return kvt__fail(KVT_ENOMEM, "attention capture");
    for (int i = 0; i < e->n_caps; i++) {
        free(e->caps[i].w);
        free(e->caps[i].vis);
        free(e->caps[i].q);
        free(e->caps[i].q_pos);
    }
    free(e->caps);
    e->cap_first_layer = n > 0 ? layers[0] : -1;
    for (int32_t i = 0; i < n; i++) {
        c[i].layer = layers[i];
        e->cap_first_layer = KVT_MIN(e->cap_first_layer, layers[i]);
    }
    e->caps = c;
    e->n_caps = n;
    e->capture_q = capture_q;
    return 0;
}

void kvt_attn_free(kvt_attn *a) {
    if (!a) return;
    free(a->q_pos);
    free(a->k_pos);
    free(a->w);
    free(a->q);
    free(a);
}

int kvt_attn_get(kvt_engine *e, int32_t layer, int32_t seq, kvt_attn **out) {
    *out = NULL;
    struct attn_cap *c = kvt__attn_cap_for(e, layer);
    if (c && kvt__engine_seq_ok(e, seq) && e->multi_gen[seq] == e->gen && e->gen != 0)
        return kvt__fail(KVT_EUNSUPPORTED,
                         "the last decode of sequence %d was a decode row of a multi-sequence batch "
                         "(kvt_engine_decode_batch): attention is captured for kvt_engine_decode and for the "
                         "prefill chunk of kvt_engine_decode_batch only",
                         seq);
    if (!c || !c->have || c->seq != seq)
        return kvt__fail(KVT_ENOENT, "no attention captured for layer %d of sequence %d", layer, seq);
    if (c->gen != e->gen) return kvt__fail(KVT_ENOENT, "the KV cache changed since layer %d was captured", layer);
    int part = 0, idx = 0;
    if (kvt_engine_layer_part(e, layer, &part, &idx)) return kvt__fail(KVT_EFORMAT, "layer %d: cache part unknown", layer);
    int rc;
    const kvt_pos *cpos;
    uint32_t nc;
    /* the positions of the sequence's cells in cell order (a unified cache: the sequence's cells;
    ** streams: its own stream's, the columns of its softmax block), from llama.cpp's cell records */
    if ((rc = kvt__engine_cell_pos(e, seq, part, &cpos, &nc))) return rc;
    const int32_t nk = c->n_kv, nt = c->n_tok, nh = c->n_head;
    /* cells visible to any query row, ascending cell index */
    int32_t *vis_cells = malloc(sizeof(int32_t) * (size_t) nk);
    kvt_pos *cell_pos = malloc(sizeof(kvt_pos) * (size_t) nk);
    kvt_pos *cand = malloc(sizeof(kvt_pos) * (nc ? nc : 1));
    kvt_attn *a = calloc(1, sizeof *a);
    if (!vis_cells || !cell_pos || !cand || !a) {
        rc = kvt__fail(KVT_ENOMEM, "attention map");
        goto done;
    }
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
        kvt_pos p = cpos[i];
        if (p <= qmax && (!swa || qmax - p < e->info.n_swa)) cand[n_cand++] = p;
    }
    if (n_cand != n_vis) {
        rc = kvt__fail(KVT_EFORMAT, "layer %d: %d visible cells but %d cells of sequence %d in range", layer, n_vis, n_cand, seq);
        goto done;
    }
    for (int32_t i = 0; i < n_vis; i++) cell_pos[i] = cand[i];
    /* keys sorted by position: order of visible cells by pos */
    int32_t *ord = malloc(sizeof(int32_t) * (size_t) (n_vis ? n_vis : 1));
    if (!ord) {
        rc = kvt__fail(KVT_ENOMEM, "attention map");
        goto done;
    }
    for (int32_t i = 0; i < n_vis; i++) ord[i] = i;
    for (int32_t i = 1; i < n_vis; i++) { /* insertion sort: cells are nearly sorted by position */
        int32_t x = ord[i], j = i - 1;
        while (j >= 0 && cell_pos[ord[j]] > cell_pos[x]) {
            ord[j + 1] = ord[j];
            j--;
        }
        ord[j + 1] = x;
    }
    a->layer = layer;
    a->n_query = nt;
    a->n_head = nh;
    a->n_keys = n_vis;
    a->q_pos = malloc(sizeof(kvt_pos) * (size_t) nt);
    a->k_pos = malloc(sizeof(kvt_pos) * (size_t) (n_vis ? n_vis : 1));
    a->w = calloc((size_t) nt * nh * (n_vis ? n_vis : 1), sizeof(float));
    if (!a->q_pos || !a->k_pos || !a->w) {
        free(ord);
        rc = kvt__fail(KVT_ENOMEM, "attention");
        goto done;
    }
    memcpy(a->q_pos, c->q_pos, sizeof(kvt_pos) * (size_t) nt);
    for (int32_t i = 0; i < n_vis; i++) a->k_pos[i] = cell_pos[ord[i]];
    for (int32_t t = 0; t < nt; t++)
        for (int32_t h = 0; h < nh; h++)
            for (int32_t i = 0; i < n_vis; i++) {
                int32_t cell = vis_cells[ord[i]];
                a->w[((size_t) t * nh + h) * n_vis + i] = c->vis[(size_t) t * nk + cell] ? c->w[((size_t) h * nt + t) * nk + cell]
                                                                                         : 0.0f;
            }
    free(ord);
    if (e->capture_q && c->have_q) {
        a->head_dim = c->hd;
        a->q = malloc(sizeof(float) * (size_t) nt * nh * c->hd);
        if (!a->q) {
            rc = kvt__fail(KVT_ENOMEM, "attention Q");
            goto done;
        }
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
