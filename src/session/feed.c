/* feed.c — a run of tokens into the cache: chunks that end at block boundaries, each preceded by
** eviction under the budget (blocks.c) and position reservation (positions.c) and followed by
** recording, sealing, live ElasticKV and the attention signals; before the first chunk the
** longest prefix of full blocks comes from the block store (reuse.c) and reused chunks are
** planned (chunks.c).  A run's chunks are handed out one at a time (kvt__sess_feed_next) and
** their decode's result taken back (kvt__sess_feed_done), so prefill.c can hand them to its
** caller; kvt__sess_feed decodes them alone. */
#include "session/session_int.h"

#include <stdlib.h>
#include <string.h>

void kvt__sess_feed_init(struct feed *f, const kvt_token *tok, int32_t n, int role, int32_t reserve_after) {
    memset(f, 0, sizeof *f);
    f->tok = tok;
    f->n = n;
    f->role = role;
    f->reserve_after = reserve_after;
    f->routed = role == KVT_ROLE_ASSISTANT; /* a prompt's blocks may be in the store */
    f->logits = true;
}

void kvt__sess_feed_free(struct feed *f) {
    kvt__sess_chunk_free(f->runs, f->n_runs);
    f->runs = NULL;
    f->n_runs = 0;
}

/* Keep the engine's logits of this session's last token (sessions share the engine). */
static int save_logits(kvt_session *s) {
    const float *l = kvt_engine_logits(s->eng);
    s->dec.have_logits = false;
    if (!l) return 0;
    if (!s->dec.logits && !(s->dec.logits = malloc(sizeof(float) * (size_t) s->n_vocab))) return kvt__fail(KVT_ENOMEM, "logits");
    memcpy(s->dec.logits, l, sizeof(float) * (size_t) s->n_vocab);
    s->dec.have_logits = true;
    return 0;
}

/* Room for m tokens, and the reply's reserve after them when the run ends with them (best effort). */
static int make_room(kvt_session *s, int32_t m, int32_t reserve_after, bool last) {
    int rc = kvt__sess_make_room(s, m + (last ? reserve_after : 0));
    if (rc == KVT_EBUDGET && last && reserve_after) rc = kvt__sess_make_room(s, m);
    return rc;
}

/* The next chunk of the run: whatever must see the whole prompt before its first chunk (the
** store's prefix lookup, the plan of reused chunks) and the loads of reused chunks happen here;
** then room is made for the chunk (eviction) and its positions reserved.  room > 0: at most that
** many tokens.  Returns 1 with *c (decode it, then feed_done), 0 when the run is in, or an error. */
int kvt__sess_feed_next(kvt_session *s, struct feed *f, int32_t room, struct kvt_decode_chunk *c) {
    int rc = 0;
    while (f->off < f->n) {
        if (!f->routed && s->open < 0) { /* at the first block boundary (after completing an open block) */
            int32_t used = 0;
            if ((rc = kvt__sess_route(s, f->tok + f->off, f->n - f->off, f->role, &used))) return rc;
            f->routed = true;
            f->off += used;
            f->runs_base = f->off;
            if ((rc = kvt__sess_chunk_plan(s, f->tok + f->off, f->n - f->off, &f->runs, &f->n_runs))) return rc;
            continue;
        }
        if (f->next_run < f->n_runs && f->off == f->runs_base + f->runs[f->next_run].at) {
            int32_t used = 0;
            if ((rc = kvt__sess_chunk_load(s, &f->runs[f->next_run++], f->tok + f->off, f->role, &used))) return rc;
            f->off += used;
            if (used) continue;
        }
        /* chunks end at block boundaries so each completed block is sealed right after it is
        ** decoded (its SWA cells still exist), and where a reused chunk's load starts */
        int32_t room_in_block = s->open >= 0 ? s->p.block - s->b[s->open].info.n_tokens : s->p.block;
        int32_t m = KVT_MIN(f->n - f->off, room_in_block);
        if (f->next_run < f->n_runs) m = KVT_MIN(m, f->runs_base + f->runs[f->next_run].at - f->off);
        if (room > 0) m = KVT_MIN(m, room);
        /* a chunk that reaches the assistant prefix makes room for the message's part first, as the
        ** message's last chunk of its own did; if the message then lost blocks of its own, they
        ** come back before the prefix (kvt__sess_plan_own_tail): the run ends with the message */
        const bool joins = f->split > 0 && f->off <= f->split && f->off + m > f->split;
        double t1 = kvt__now_ms();
        if (joins && f->off < f->split) rc = make_room(s, f->split - f->off, f->reserve_after, true);
        if (rc == 0 && joins && kvt__sess_own_tail_lost(s)) {
            f->n = f->split;
            f->split = 0;
            f->split_cut = true;
            f->logits = false;
            if (f->off == f->n) {
                s->st.policy_ms += kvt__now_ms() - t1;
                return 0;
            }
            m = f->n - f->off;
        }
        const bool last = f->off + m == f->n;
        if (rc == 0) rc = make_room(s, m, f->reserve_after, last);
        s->st.policy_ms += kvt__now_ms() - t1; /* scoring; the seq_rm of evictions is in here too (cheap) */
        if (rc || (rc = kvt__sess_reserve_positions(s, m))) return rc;
        *c = (struct kvt_decode_chunk){ s->p.seq, f->tok + f->off, m, s->next_pos, last && f->logits };
        f->m = m;
        f->last = last;
        f->t0 = kvt__now_ms();
        return 1;
    }
    return 0;
}

/* The chunk feed_next handed out was decoded with result rc (its last logits in the engine when
** it wanted them): record its tokens, seal completed blocks, run the attention signals. */
int kvt__sess_feed_done(kvt_session *s, struct feed *f, int rc) {
    s->st.decode_ms += kvt__now_ms() - f->t0;
    if (rc) return rc;
    if (f->last && f->logits) {
        if ((rc = save_logits(s))) return rc;
    } else s->dec.have_logits = false; /* the stream moved on: a later chunk (or run) brings them */
    s->st.decoded += f->m;
    kvt__sess_note_peak(s);
    if ((rc = kvt__sess_record(s, f->tok + f->off, f->m, f->role))) return rc;
    if ((rc = kvt__sess_elastic(s, f->m))) return rc;
    /* prompt chunks always feed the attention signals; generated tokens every 8th (one token's
    ** attention changes the accumulated mass little, and each read costs a copy of the
    ** sequence's cells).  A chunk holding a message's end and its assistant prefix is observed as
    ** the two chunks it replaces: the message's rows, then the prefix's */
    const int32_t at = f->split - f->off; /* the prefix's first row in the chunk */
    if (f->role != KVT_ROLE_ASSISTANT && f->split > 0 && at > 0 && at < f->m) {
        kvt__sess_observe_rows(s, true, 0, at);
        kvt__sess_observe_rows(s, true, at, f->m);
    } else if (f->role != KVT_ROLE_ASSISTANT || s->st.decoded % 8 == 0) kvt__sess_observe(s, f->role != KVT_ROLE_ASSISTANT);
    f->off += f->m;
    return 0;
}

int kvt__sess_feed(kvt_session *s, const kvt_token *tok, int32_t n, int role, int32_t reserve_after) {
    struct feed f;
    struct kvt_decode_chunk c;
    int rc;
    kvt__sess_feed_init(&f, tok, n, role, reserve_after);
    while ((rc = kvt__sess_feed_next(s, &f, 0, &c)) == 1) {
        rc = kvt_engine_decode(s->eng, c.seq, c.tokens, c.n, c.pos0, c.want_logits);
        if ((rc = kvt__sess_feed_done(s, &f, rc))) break;
    }
    kvt__sess_feed_free(&f);
    return rc;
}
