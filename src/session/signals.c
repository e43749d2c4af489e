/* signals.c — attention signals of the eviction policies: the attention captured for the last
** decoded chunk becomes per-block H2O accumulated mass (Zhang et al. 2023), SnapKV observation-
** window share (Li et al. 2024) and kvtier's EWMA of the block's attention share. */
#include "session/session_int.h"

#include <stdio.h>
#include <stdlib.h>

/* Turn the attention captured for the last decoded chunk into block signals: H2O's accumulated
** mass, SnapKV's observation-window share (prompt chunks only), kvtier's EWMA.  Best effort: a
** capture that cannot be mapped leaves the signals as they were. */
void kvt__sess_observe(kvt_session *s, bool prompt) { kvt__sess_observe_rows(s, prompt, 0, INT32_MAX); }

void kvt__sess_observe_rows(kvt_session *s, bool prompt, int32_t lo, int32_t hi) {
    if (s->sig.n_layers == 0 || s->n_b == 0 || lo >= hi) return;
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
        for (int32_t l = 0; l < s->sig.n_layers; l++) {
            kvt_attn *a = NULL;
            if (kvt_attn_get(s->eng, s->sig.layers[l], s->p.seq, &a) != 0) {
                if (getenv("KVT_DEBUG_SIGNALS")) fprintf(stderr, "[signals] layer %d: %s\n", s->sig.layers[l], kvt_errmsg());
                continue;
            }
            /* rows [lo, hi) of the chunk: its first hi rows are a whole chunk of their own (a row
            ** sees no later one), read from row q0 (a->w is row-major by query) */
            const int32_t q_hi = KVT_MIN(hi, a->n_query), q0 = KVT_MIN(lo, q_hi);
            if (q0 >= q_hi) {
                kvt_attn_free(a);
                continue;
            }
            a->n_query = q_hi;
            if (s->p.policy == KVT_POLICY_INFLLM) /* per-token attention received, for representatives */
                for (int32_t k = 0; k < a->n_keys; k++)
                    for (int32_t j = 0; j < nb; j++) {
                        struct blk *bk = &s->b[idx[j]];
                        if (a->k_pos[k] < p0[j] || a->k_pos[k] >= p0[j] + n[j]) continue;
                        double w = 0;
                        for (int32_t t = q0; t < a->n_query; t++)
                            for (int32_t h = 0; h < a->n_head; h++) w += a->w[((size_t) t * a->n_head + h) * a->n_keys + k];
                        bk->tok_mass[a->k_pos[k] - p0[j]] += (float) w;
                        break;
                    }
            const float *hw = s->sig.head_w && a->n_head == s->sig.n_head ? s->sig.head_w + (size_t) l * s->sig.n_head : NULL;
            if (kvt_attn_block_mass(a, q0, hw, p0, n, nb, m) == 0) {
                for (int32_t j = 0; j < nb; j++) all[j] += m[j] * (q_hi - q0); /* mass summed over queries */
                got++;
            }
            int32_t from = KVT_MAX(q0, q_hi - s->p.snap_window);
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
    free(p0);
    free(n);
    free(idx);
    free(all);
    free(win);
    free(m);
    s->st.policy_ms += kvt__now_ms() - t0;
}
