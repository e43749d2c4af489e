/* elastic.c — live ElasticKV in a session (kvt_session_params.elastic_sk / elastic_sv).
**
** The source design (ElasticKV, a CUDA patch of llama.cpp) thresholds the dense cache every 64
** tokens after 128 warm-up tokens, sinks (first 64 tokens) protected.  Here a pass is one
** kvt_seq_elastic over the session's sequence: positions [KVT_ELASTIC_SINK, tail) where the
** tail is the open block and at least the last KVT_ELASTIC_TAIL positions.  Passes run after a
** chunk is recorded (kvt__sess_record seals a full block first, so the pool's copy of a block
** is the unpruned one).  The zeros save no memory in llama.cpp's dense cache. */
#include "session/session_int.h"

#include <math.h>
#include <string.h>

int kvt__sess_elastic_check(const struct kvt_session_params *p) {
    if (!(isfinite(p->elastic_sk) && p->elastic_sk >= 0 && p->elastic_sk <= 2))
        return kvt__fail(KVT_EINVAL, "elastic_sk %g is outside [0, 2]", (double) p->elastic_sk);
    if (!(isfinite(p->elastic_sv) && p->elastic_sv >= 0 && p->elastic_sv <= 2))
        return kvt__fail(KVT_EINVAL, "elastic_sv %g is outside [0, 2]", (double) p->elastic_sv);
    if (!(p->elastic_random_frac >= 0 && p->elastic_random_frac <= 1))
        return kvt__fail(KVT_EINVAL, "elastic_random_frac %g is outside [0, 1]", (double) p->elastic_random_frac);
    return 0;
}

int kvt__sess_elastic(kvt_session *s, int32_t n) {
    if (!(s->p.elastic_sk > 0 || s->p.elastic_sv > 0) || s->is_parked) return 0;
    s->el_pending += n;
    if (s->el_pending < KVT_ELASTIC_INTERVAL || kvt__sess_resident(s) < KVT_ELASTIC_WARMUP) return 0;
    kvt_pos tail = s->next_pos - KVT_ELASTIC_TAIL;
    if (s->open >= 0 && s->b[s->open].info.p0 < tail) tail = s->b[s->open].info.p0;
    if (tail <= KVT_ELASTIC_SINK) return 0;
    const struct kvt_elastic_params ep = { s->p.elastic_sk,
                                           s->p.elastic_sv,
                                           KVT_ELASTIC_SINK,
                                           tail,
                                           s->p.elastic_random,
                                           s->p.elastic_random_frac,
                                           ((uint64_t) s->serial << 32) ^ (uint64_t) s->st.el_passes };
    struct kvt_elastic_stats st;
    int rc = kvt_seq_elastic(s->eng, s->p.seq, &ep, &st);
    if (rc) return rc; /* the cache is unchanged; el_pending stays, so the next tokens retry */
    s->el_pending = 0;
    s->st.el_passes++;
    s->st.el_zeroed += st.n_zeroed;
    s->st.el_last = st;
    s->st.el_ms += st.ms;
    if (st.n_zeroed > 0) kvt__sess_chain_off(s); /* what follows is no cold prefill's any more */
    return 0;
}

void kvt__sess_elastic_stats(const kvt_session *s, struct kvt_session_stats *st) {
    st->elastic_passes = s->st.el_passes;
    st->elastic_zeroed = s->st.el_zeroed;
    st->elastic_elems = s->st.el_last.n_elems;
    st->elastic_zero = s->st.el_last.n_zero;
    st->elastic_eligible = s->st.el_last.n_eligible;
    st->elastic_zero_eligible = s->st.el_last.n_zero_eligible;
    st->elastic_ms = s->st.el_ms;
}
