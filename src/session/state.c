/* state.c — the facts about a session's state that every other file reads: resident tokens, the
** peak, a block's role, the roles' names, the chain purity flag and the route kinds.  Nothing
** here touches the cache.  The bottom layer of src/session (session_int.h has the order). */
#include "session/session_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const kvt__sess_role_name[3] = { "system", "user", "assistant" };

int32_t kvt__sess_resident(const kvt_session *s) { return s->is_parked ? 0 : kvt_seq_n_cells(s->eng, s->p.seq); }

int kvt__sess_parked_error(void) { return kvt__fail(KVT_EINVAL, "the session is parked (kvt_session_resume it first)"); }

void kvt__sess_note_peak(kvt_session *s) {
    int32_t r = kvt__sess_resident(s);
    if (r > s->st.peak) s->st.peak = r;
}

int kvt__sess_block_role(const struct blk *b) {
    int best = 0;
    for (int r = 1; r < 3; r++)
        if (b->role_n[r] > b->role_n[best]) best = r;
    return best;
}

int kvt__sess_role_from_name(const char *r) {
    for (int i = 0; r && i < 3; i++)
        if (!strcmp(r, kvt__sess_role_name[i])) return i;
    return -1;
}

void kvt__sess_chain_off(kvt_session *s) { s->reuse.chain_ok = false; }

int32_t kvt__sess_route_kind(int64_t want, int64_t found) {
    if (want == 0) return KVT_ROUTE_NONE;
    if (found == 0) return KVT_ROUTE_MISS;
    return found >= want ? KVT_ROUTE_EXACT : KVT_ROUTE_PARTIAL;
}

void kvt__sess_explain(const kvt_session *s, const char *fmt, ...) {
    const bool debug = !s->p.explain && getenv("KVT_DEBUG_RECOVERY"); /* the debugging switch prints the same lines */
    if (!s->p.explain && !debug) return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (debug) fprintf(stderr, "[explain] %s\n", line);
    else s->p.explain(s->p.explain_ud, line);
}
