/* seqstate.c — whole-sequence state passes: live ElasticKV (kvt_seq_elastic, kvtier.h section 3).
**
** Read the sequence's state once (llama_state_seq_get_data), threshold every K and V tensor of
** every layer of every part on the host with the elastic codec's tau (src/kv/codec_tensor.c
** kvt__elastic_tau: one implementation for the codec and the live pass), and write the whole
** state back with one llama_state_seq_set_data (kvt__engine_replace_seq: the previous state goes
** back if llama.cpp rejects the write).  The original bytes are kept until the write succeeded,
** so every failure leaves the sequence's K/V as it was. */
#include "engine/engine_int.h"
#include "fault.h"
#include "kv/codec.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* One K or V tensor of a parsed state, as a matrix (cells x channels). */
static int tensor_of(const struct kvt__blob_part *P, uint8_t *buf, uint32_t l, int kind, int p, struct kvt__mat *m) {
    const int32_t type = kind == KVT__SEC_K ? P->k_type[l] : P->v_type[l];
    const uint32_t es = type == GGML_TYPE_F16 ? 2 : type == GGML_TYPE_F32 ? 4 : 0;
    if (!es)
        return kvt__fail(KVT_EUNSUPPORTED,
                         "elastic: part %d layer %u: %s cache type %s cannot be thresholded (F16 or F32 "
                         "only)",
                         p, l, kind == KVT__SEC_K ? "K" : "V", ggml_type_name((enum ggml_type) type));
    if (kind == KVT__SEC_K) {
        *m = (struct kvt__mat){ buf + P->k_off[l], P->n_cells, (uint32_t) (P->k_row_bytes[l] / es), es, false };
    } else if (P->v_trans) {
        if (P->v_row_bytes[l] != es) return kvt__fail(KVT_EFORMAT, "elastic: part %d layer %u: V element size", p, l);
        *m = (struct kvt__mat){ buf + P->v_off[l], P->n_cells, P->v_n_embd[l], es, true };
    } else {
        *m = (struct kvt__mat){ buf + P->v_off[l], P->n_cells, (uint32_t) (P->v_row_bytes[l] / es), es, false };
    }
    return 0;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

struct work {
    float *x;        /* [n_elig * E]: the eligible cells' elements, F32 */
    uint32_t *cells; /* [n_cells]: eligible cell indices */
    uint32_t *idx;   /* random control: candidate element indices of one head */
    size_t cap_x, cap_cells, cap_idx;
};

static int grow(void **p, size_t *cap, size_t need, size_t el) {
    if (need <= *cap) return 0;
    if (kvt__fault_check(KVT__FAULT_ELASTIC_ALLOC)) return kvt__fail(KVT_ENOMEM, "elastic: %zu elements", need);
    void *n = realloc(*p, need * el);
    if (!n) return kvt__fail(KVT_ENOMEM, "elastic: %zu elements", need);
    *p = n;
    *cap = need;
    return 0;
}

/* F16 -> F32 of every bit pattern (256 KiB, built once): a pass converts every element of the
** sequence, and a table lookup is several times faster than a call per element. */
static float f16_tab[65536];
static pthread_once_t f16_once = PTHREAD_ONCE_INIT;
static void f16_init(void) {
    for (uint32_t h = 0; h < 65536; h++) f16_tab[h] = ggml_fp16_to_fp32((ggml_fp16_t) h);
}

static inline size_t at(const struct kvt__mat *m, uint32_t c, uint32_t e) {
    return m->trans ? (size_t) e * m->n_cells + c : (size_t) c * m->n_embd + e;
}
static inline float get(const struct kvt__mat *m, size_t i) {
    if (m->elsize == 2) {
        uint16_t h;
        memcpy(&h, m->base + i * 2, 2);
        return f16_tab[h];
    }
    float f;
    memcpy(&f, m->base + i * 4, 4);
    return f;
}
/* +0 is all-zero bytes in F16 and F32 alike */
static inline void zero(const struct kvt__mat *m, size_t i) { memset(m->base + i * m->elsize, 0, m->elsize); }

/* Threshold one tensor: eligible cells cells[0..n), scale s.  Adds to st. */
static int threshold(const struct kvt__mat *m, const uint32_t *cells, uint32_t n, int n_head, float s, bool random, float frac,
                     uint64_t *rng, struct work *w, struct kvt_elastic_stats *st) {
    const uint32_t E = m->n_embd, hd = E / (uint32_t) n_head;
    int rc;
    if ((rc = grow((void **) &w->x, &w->cap_x, (size_t) n * E + 1, sizeof *w->x))) return rc;
    if (m->trans) { /* channel-major in memory: walk it that way */
        for (uint32_t e = 0; e < E; e++)
            for (uint32_t r = 0; r < n; r++) w->x[(size_t) r * E + e] = get(m, (size_t) e * m->n_cells + cells[r]);
    } else {
        for (uint32_t r = 0; r < n; r++)
            for (uint32_t e = 0; e < E; e++) w->x[(size_t) r * E + e] = get(m, (size_t) cells[r] * E + e);
    }
    float tau[KVT__MAX_HEADS];
    kvt__elastic_tau(w->x, n, E, n_head, s, tau);
    if (!random) {
        for (uint32_t r = 0; r < n; r++)
            for (uint32_t e = 0; e < E; e++) {
                const float v = w->x[(size_t) r * E + e];
                if (v != 0.0f && fabsf(v) < tau[e / hd]) {
                    zero(m, at(m, cells[r], e));
                    st->n_zeroed++;
                }
            }
        return 0;
    }
    /* control: per head, as many zeros as the threshold leaves (or random_frac of the head's
    ** elements), placed uniformly at random */
    if ((rc = grow((void **) &w->idx, &w->cap_idx, (size_t) n * hd + 1, sizeof *w->idx))) return rc;
    for (int h = 0; h < n_head; h++) {
        size_t below = 0, cand = 0;
        for (uint32_t r = 0; r < n; r++)
            for (uint32_t e = (uint32_t) h * hd; e < (uint32_t) (h + 1) * hd; e++) {
                const float v = w->x[(size_t) r * E + e];
                below += fabsf(v) < tau[h] || v == 0.0f;
                if (v != 0.0f) w->idx[cand++] = r * E + e;
            }
        const size_t zeros = (size_t) n * hd - cand;
        if (frac > 0) below = (size_t) llround((double) frac * n * hd);
        size_t need = below > zeros ? below - zeros : 0;
        for (size_t i = 0; i < need; i++) { /* partial Fisher-Yates over the non-zero elements */
            size_t j = i + (size_t) (splitmix(rng) % (cand - i));
            uint32_t t = w->idx[i];
            w->idx[i] = w->idx[j];
            w->idx[j] = t;
            zero(m, at(m, cells[w->idx[i] / E], w->idx[i] % E));
            st->n_zeroed++;
        }
    }
    return 0;
}

/* Count elements and zeros of m (all cells) and of its eligible cells. */
static void count(const struct kvt__mat *m, const uint8_t *eligible, struct kvt_elastic_stats *st) {
    const size_t ne = (size_t) m->n_cells * m->n_embd;
    int64_t z_all = 0, z_el = 0, n_el = 0;
    for (size_t i = 0; i < ne; i++) { /* every element in memory order; its cell from the layout */
        const uint32_t c = (uint32_t) (m->trans ? i % m->n_cells : i / m->n_embd);
        bool z;
        if (m->elsize == 2) {
            uint16_t h;
            memcpy(&h, m->base + i * 2, 2);
            z = (h & 0x7fff) == 0;
        } else {
            float f;
            memcpy(&f, m->base + i * 4, 4);
            z = f == 0.0f;
        }
        z_all += z;
        n_el += eligible[c];
        z_el += z && eligible[c];
    }
    st->n_zero += z_all;
    st->n_eligible += n_el;
    st->n_zero_eligible += z_el;
    st->n_elems += (int64_t) ne;
}

int kvt_seq_elastic(kvt_engine *e, int32_t seq, const struct kvt_elastic_params *p, struct kvt_elastic_stats *out) {
    kvt__clear_error();
    const double t0 = kvt__now_ms();
    struct kvt_elastic_stats st;
    memset(&st, 0, sizeof st);
    if (out) *out = st;
    if (!p) return kvt__fail(KVT_EINVAL, "elastic: no parameters");
    if (!kvt__engine_seq_ok(e, seq)) return kvt__fail(KVT_EINVAL, "elastic: sequence %d is out of range", seq);
    if (!(isfinite(p->s_k) && isfinite(p->s_v) && p->s_k >= 0 && p->s_v >= 0))
        return kvt__fail(KVT_EINVAL, "elastic: scales s_k %g, s_v %g must be finite and >= 0", (double) p->s_k, (double) p->s_v);
    if (!(p->random_frac >= 0 && p->random_frac <= 1))
        return kvt__fail(KVT_EINVAL, "elastic: random_frac %g is outside [0, 1]", (double) p->random_frac);
    if (p->p0 > p->p1) return kvt__fail(KVT_EINVAL, "elastic: range [%d, %d) is reversed", p->p0, p->p1);
    const int n_head = e->info.n_head_kv > 0 ? e->info.n_head_kv : 1;
    if (n_head > KVT__MAX_HEADS) return kvt__fail(KVT_EUNSUPPORTED, "elastic: %d KV heads (at most %d)", n_head, KVT__MAX_HEADS);
    int rc = kvt__engine_flush_shift(e);
    if (rc) return rc;
    pthread_once(&f16_once, f16_init);
    uint8_t *prev = NULL, *buf = NULL, *eligible = NULL;
    size_t n = 0;
    struct kvt__blob_layout *L = malloc(sizeof *L);
    struct work w;
    memset(&w, 0, sizeof w);
    uint64_t rng = p->seed;
    if (!L || kvt__fault_check(KVT__FAULT_ELASTIC_ALLOC)) {
        rc = kvt__fail(KVT_ENOMEM, "elastic: state layout");
        goto out;
    }
    if ((rc = kvt__engine_save_seq(e, seq, &prev, &n)) || (rc = kvt__blob_parse(prev, n, e->n_parts, L))) goto out;
    if (!(buf = malloc(n)) || kvt__fault_check(KVT__FAULT_ELASTIC_ALLOC)) {
        rc = kvt__fail(KVT_ENOMEM, "elastic: copy of the %zu-byte state", n);
        goto out;
    }
    memcpy(buf, prev, n);
    for (int part = 0; part < L->n_parts; part++) {
        const struct kvt__blob_part *P = &L->part[part];
        if (!P->n_cells) continue;
        uint8_t *el = realloc(eligible, P->n_cells);
        if (!el) {
            rc = kvt__fail(KVT_ENOMEM, "elastic: cell map");
            goto out;
        }
        eligible = el;
        if ((rc = grow((void **) &w.cells, &w.cap_cells, P->n_cells, sizeof *w.cells))) goto out;
        uint32_t n_el = 0;
        for (uint32_t c = 0; c < P->n_cells; c++) {
            const kvt_pos pos = kvt__blob_cell_pos(buf, L, part, c);
            eligible[c] = pos >= p->p0 && pos < p->p1;
            if (eligible[c]) w.cells[n_el++] = c;
        }
        for (int kind = KVT__SEC_K; kind <= KVT__SEC_V; kind++)
            for (uint32_t l = 0; l < P->n_layer; l++) {
                struct kvt__mat m = { 0 };
                if ((rc = tensor_of(P, buf, l, kind, part, &m))) goto out;
                if (m.n_embd % (uint32_t) n_head) {
                    rc = kvt__fail(KVT_EUNSUPPORTED,
                                   "elastic: part %d layer %u: %u channels are not a multiple of %d "
                                   "KV heads",
                                   part, l, m.n_embd, n_head);
                    goto out;
                }
                const float s = kind == KVT__SEC_K ? p->s_k : p->s_v;
                if (s > 0 && n_el > 0 && (rc = threshold(&m, w.cells, n_el, n_head, s, p->random, p->random_frac, &rng, &w, &st)))
                    goto out;
                count(&m, eligible, &st);
            }
    }
    if (st.n_zeroed > 0 && (rc = kvt__engine_replace_seq(e, seq, buf, n, prev, n, "elastic"))) goto out;
out:
    free(L);
    free(prev);
    free(buf);
    free(eligible);
    free(w.x);
    free(w.cells);
    free(w.idx);
    st.ms = kvt__now_ms() - t0;
    if (rc == 0 && out) *out = st;
    return rc;
}
