/* positions.c — keeping a session's positions inside the model's trained context.
**
** Positions only grow: every decoded token takes next_pos, evicted blocks leave gaps, and
** recovered blocks load at the tail.  A long conversation under a small budget therefore walks
** past n_ctx_train long before it runs out of cells, and RoPE past the trained context is
** silently wrong (the model was never trained on those angles).  Before a decode or a load would
** place a token at or past the limit, the resident blocks are compacted: moved down, in position
** order, so that they sit contiguously from position 0 (llama.cpp's context shift re-rotates K;
** relative order is kept, only the gaps close, as llama-server's context shift does after it
** discards).  If the resident tokens plus the new ones still do not fit, the caller gets KVT_ECTX
** with the numbers, never a position past the limit. */
#include "session/session_int.h"

#include <stdlib.h>

/* Resident blocks of s by ascending position (indices into s->b).  Caller frees. */
static int32_t *resident_by_pos(const kvt_session *s, int32_t *n_out) {
    int32_t *ix = malloc(sizeof(int32_t) * (size_t) (s->n_b > 0 ? s->n_b : 1)), n = 0;
    if (!ix) return NULL;
    for (int32_t i = 0; i < s->n_b; i++)
        if (s->b[i].info.residency == KVT_RES_DEVICE && s->b[i].info.n_tokens > 0) ix[n++] = i;
    for (int32_t i = 1; i < n; i++) /* insertion sort: few blocks, mostly ordered already */
        for (int32_t j = i; j > 0 && s->b[ix[j - 1]].info.p0 > s->b[ix[j]].info.p0; j--) {
            int32_t t = ix[j];
            ix[j] = ix[j - 1];
            ix[j - 1] = t;
        }
    *n_out = n;
    return ix;
}

int kvt__sess_compact(kvt_session *s) {
    int32_t n = 0;
    int32_t *ix = resident_by_pos(s, &n);
    if (!ix) return kvt__fail(KVT_ENOMEM, "position compaction of %d blocks", s->n_b);
    kvt_pos to = 0;
    int rc = 0;
    for (int32_t k = 0; rc == 0 && k < n; k++) {
        struct blk *b = &s->b[ix[k]];
        if (b->info.p0 != to) {
            rc = kvt_seq_shift(s->eng, s->p.seq, b->info.p0, b->info.p0 + b->info.n_tokens, to - b->info.p0);
            if (rc == 0) b->info.p0 = to; /* on error: this block and the ones after it stay put */
        }
        to += b->info.n_tokens;
    }
    free(ix);
    if (rc) return rc;
    s->next_pos = to;
    s->st.compactions++;
    kvt__sess_chain_off(s);
    return 0;
}

int kvt__sess_reserve_positions(kvt_session *s, int32_t n) {
    if (s->next_pos + n <= s->pos_limit) return 0;
    int rc = kvt__sess_compact(s);
    if (rc) return rc;
    if (s->next_pos + n > s->pos_limit)
        return kvt__fail(KVT_ECTX,
                         "%d resident tokens and %d new ones do not fit the model's trained context of %d "
                         "positions",
                         s->next_pos, n, s->pos_limit);
    return 0;
}
