/* admit.c — which session a chat job runs in (the engine thread, for server/sched.c).
**
** One kvt_session per conversation, on its own sequence id; chosen by X-Session-Id within the
** caller's API-key namespace, else the idle session of that namespace whose whole conversation
** the request continues (every message of it begins the request), else the one whose token
** stream (kvt_session_tokens) shares the longest prefix with the request's tokens (the chat
** template with the assistant prefix, tokenized once per request) if that is at least one block,
** else a new one.  A session chosen by prefix is cut back to the first token that differs
** (kvt_session_sync), so only the request's own tail is decoded; a shorter common prefix (the
** template's opening), or one whose take-over would cut back more tokens than it reuses (a long
** conversation sharing only its system prompt), does not take over another conversation's
** session.  Past --max-sessions the least recently used idle session is parked (kvt_session_park:
** its KV goes to the host pool and comes back with kvt_session_resume, no recompute);
** SERVE_PARK_FACTOR x --max-sessions sessions are kept in all, past that the least
** recently used parked one is freed.  With several API keys the session parked or freed is
** taken from the key over its share first (victim_tenant), so one key cannot push out the
** others' sessions.
**
** A session is given to one job at a time.  A job naming a session that is generating waits in
** the queue (admit_runnable keeps it there; admit_session answers PICK_BUSY when a job without
** X-Session-Id admitted in the same round took that session first), a session chosen by
** conversation or prefix is an idle one, parking and freeing take idle sessions only, and a
** busy session cannot be deleted (409). */
#include "sched.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static struct sess *find_session(struct server *srv, const char *ns, const char *id) {
    struct sched *sc = srv->sched;
    for (int32_t i = 0; i < sc->cap; i++)
        if (sc->sess[i].s && !strcmp(sc->sess[i].ns, ns) && !strcmp(sc->sess[i].id, id)) return &sc->sess[i];
    return NULL;
}

/* Does the request continue the session's whole conversation (every message of the session,
** role and content byte-equal, begins the request)?  Nothing is then cut back. */
static bool continues(const struct sess *x, const struct job *j) {
    int32_t n = kvt_session_n_messages(x->s), k = 0;
    while (k < n && k < j->req.n_msgs) {
        struct kvt_chat_msg m;
        if (kvt_session_message(x->s, k, &m) || strcmp(m.role, j->req.msgs[k].role) || strcmp(m.content, j->req.msgs[k].content))
            break;
        k++;
    }
    return k == n && k > 0;
}

/* The request as its session will decode it: the template's tokens of its messages with the
** assistant prefix (kvt_chat_tokenize with the sessions' template fallback), computed once per job (prefetch while it waits, then admission) and again only if
** canonicalise_replies changed a message.  OUT *tok (the job owns it), *n.  Returns a library
** error; the request then matches by conversation only. */
int admit_request_tokens(struct server *srv, struct job *j, const kvt_token **tok, int32_t *n) {
    if (!j->have_ptok) {
        if (kvt_chat_tokenize(srv->eng, j->req.msgs, j->req.n_msgs, true, srv->sched->fallback, &j->ptok, &j->n_ptok)) {
            free(j->ptok);
            j->ptok = NULL;
            j->n_ptok = 0;
        }
        j->have_ptok = true;
    }
    *tok = j->ptok;
    *n = j->n_ptok;
    return j->ptok ? 0 : KVT_EINVAL;
}

/* Tokens at the start of the session's stream equal to req[0..n); buf: room for n tokens. */
static int32_t common_tokens(const struct sess *x, const kvt_token *req, int32_t n, kvt_token *buf) {
    int32_t m = KVT_MIN(n, kvt_session_tokens(x->s, buf, n)), c = 0;
    while (c < m && buf[c] == req[c]) c++;
    return c;
}

/* Sessions of tenant ns among those in `in` (resident: holding a sequence; all: any). */
static int32_t n_of(const struct sched *sc, const char *ns, bool resident) {
    int32_t n = 0;
    for (int32_t i = 0; i < sc->cap; i++) n += sc->sess[i].s && (!resident || sc->sess[i].seq >= 0) && !strcmp(sc->sess[i].ns, ns);
    return n;
}

/* Which tenant gives up a session when tenant ns needs room among `slots` (resident sessions:
** sequences; all sessions: entries), so that no API key can park or free every other key's
** sessions: a tenant holding at least its share (slots / tenants present, the requester
** counted) makes room among its own; otherwise the tenant holding the most over its share does;
** NULL when nobody is over (then the least recently used anywhere, as without keys). */
static const char *victim_tenant(const struct sched *sc, const char *ns, int32_t slots, bool resident) {
    int32_t n_ten = 0, mine = n_of(sc, ns, resident);
    for (int32_t i = 0; i < sc->cap; i++) { /* distinct tenants present */
        if (!sc->sess[i].s || (resident && sc->sess[i].seq < 0) || !strcmp(sc->sess[i].ns, ns)) continue;
        bool seen = false;
        for (int32_t k = 0; k < i && !seen; k++)
            seen = sc->sess[k].s && (!resident || sc->sess[k].seq >= 0) && !strcmp(sc->sess[k].ns, sc->sess[i].ns);
        n_ten += !seen;
    }
    int32_t share = KVT_MAX(1, slots / (n_ten + 1));
    if (mine >= share) return ns;
    const char *worst = NULL;
    int32_t most = share;
    for (int32_t i = 0; i < sc->cap; i++) {
        if (!sc->sess[i].s || (resident && sc->sess[i].seq < 0) || sc->sess[i].job) continue;
        int32_t c = n_of(sc, sc->sess[i].ns, resident);
        if (c > most) {
            most = c;
            worst = sc->sess[i].ns;
        }
    }
    return worst;
}

/* A free sequence: one no session holds, else the one of the least recently used idle session
** of the tenant victim_tenant() names (any tenant's if that one has none idle), which is parked
** (its KV goes to the host pool, nothing is lost).  -1 if all are generating. */
static int32_t take_seq(struct server *srv, const char *ns) {
    struct sched *sc = srv->sched;
    for (int32_t q = 0; q < srv->max_sessions; q++) {
        bool used = false;
        for (int32_t i = 0; i < sc->cap && !used; i++) used = sc->sess[i].s && sc->sess[i].seq == q;
        if (!used) return q;
    }
    const char *vt = victim_tenant(sc, ns, srv->max_sessions, true);
    struct sess *lru = NULL;
    for (int pass = vt ? 0 : 1; pass < 2 && !lru; pass++)
        for (int32_t i = 0; i < sc->cap; i++)
            if (sc->sess[i].s && sc->sess[i].seq >= 0 && !sc->sess[i].job && (pass || !strcmp(sc->sess[i].ns, vt)) &&
                (!lru || sc->sess[i].last_used < lru->last_used))
                lru = &sc->sess[i];
    if (!lru) return -1;
    int32_t q = lru->seq;
    if (kvt_session_park(lru->s)) { /* cannot park: free it */
        fprintf(stderr, "kvtier serve: session %s could not be parked (%s); freed\n", lru->id, kvt_errmsg());
        kvt_session_free(lru->s);
        memset(lru, 0, sizeof *lru);
    } else {
        lru->seq = -1;
    }
    return q;
}

/* An empty entry, freeing the least recently used parked (else idle) session if all are taken,
** of the tenant victim_tenant() names when it has one idle. */
static struct sess *new_slot(struct server *srv, const char *ns) {
    struct sched *sc = srv->sched;
    for (int32_t i = 0; i < sc->cap; i++)
        if (!sc->sess[i].s) return &sc->sess[i];
    const char *vt = victim_tenant(sc, ns, sc->cap, false);
    struct sess *lru = NULL;
    for (int pass = vt ? 0 : 1; pass < 2 && !lru; pass++)
        for (int32_t i = 0; i < sc->cap; i++) {
            if (sc->sess[i].job || (!pass && strcmp(sc->sess[i].ns, vt))) continue;
            if (!lru || (sc->sess[i].seq < 0 && lru->seq >= 0) ||
                ((sc->sess[i].seq < 0) == (lru->seq < 0) && sc->sess[i].last_used < lru->last_used))
                lru = &sc->sess[i];
        }
    if (lru) {
        kvt_session_free(lru->s);
        memset(lru, 0, sizeof *lru);
    }
    return lru;
}

/* Assistant messages the client sends back are matched against the replies the session stored,
** which are the text the model generated: a tool call echoed as `tool_calls`, or the "response"
** of a tool-mode reply echoed as plain content, is replaced by the stored text, so the session's
** tokens are reused instead of cut back and re-decoded (server/tools.c). */
static int canonicalise_replies(struct sess *x, struct job *j) {
    int32_t n = KVT_MIN(kvt_session_n_messages(x->s), j->req.n_msgs);
    for (int32_t k = 0; k < n; k++) {
        struct kvt_chat_msg m;
        if (kvt_session_message(x->s, k, &m) || strcmp(m.role, j->req.msgs[k].role)) break;
        if (!strcmp(m.content, j->req.msgs[k].content)) continue;
        if (strcmp(m.role, "assistant") || !tools_same_reply(m.content, j->req.msgs[k].content)) break;
        char *c = strdup(m.content);
        if (!c) return -1;
        free((char *) j->req.msgs[k].content);
        j->req.msgs[k].content = c;
        free(j->ptok); /* the request's tokens change with it */
        j->ptok = NULL;
        j->n_ptok = 0;
        j->have_ptok = false;
    }
    return 0;
}

/* The session a chat job runs in (*out): the one it names, else one chosen by conversation or
** token prefix among the idle sessions of its namespace, else a new one.  A session generating a
** reply is never handed out: PICK_BUSY when the job names one (it goes back to the queue and
** waits its turn; admission alone cannot see this, since a job without X-Session-Id admitted in
** the same round may have taken that session by prefix).  PICK_ERR: the job has its error. */
enum pick admit_session(struct server *srv, struct job *j, struct sess **out) {
    struct sched *sc = srv->sched;
    struct sess *x = NULL;
    *out = NULL;
    if (j->req.session_id[0]) {
        x = find_session(srv, j->req.ns, j->req.session_id);
        if (x && x->job) return PICK_BUSY;
        if (x && canonicalise_replies(x, j)) {
            serve_error_set(&j->err, 500, "server_error", NULL, "out of memory");
            return PICK_ERR;
        }
    } else {
        /* the session whose whole conversation the request continues, else the one sharing the
        ** longest token prefix with the request, if at least one block (shorter: a common system
        ** prompt or template opening, not worth cutting another conversation back for) or the
        ** whole request (a short conversation sent again: a retried or regenerated turn); the
        ** request is tokenized once and compared with every idle session of its namespace */
        const kvt_token *req = NULL;
        kvt_token *buf = NULL;
        int32_t n_req = 0, best = 0;
        bool best_whole = false, any = false;
        /* echoed replies in the sessions' own generated form first (a tool-mode reply echoed as
        ** plain text), so that the comparison sees the tokens the sessions hold */
        for (int32_t i = 0; i < sc->cap; i++)
            if (sc->sess[i].s && !sc->sess[i].job && !strcmp(sc->sess[i].ns, j->req.ns)) {
                any = true;
                if (canonicalise_replies(&sc->sess[i], j)) {
                    serve_error_set(&j->err, 500, "server_error", NULL, "out of memory");
                    return PICK_ERR;
                }
            }
        if (any && admit_request_tokens(srv, j, &req, &n_req) == 0 && !(buf = malloc(sizeof *buf * (size_t) KVT_MAX(n_req, 1))))
            n_req = 0;
        for (int32_t i = 0; any && i < sc->cap; i++) {
            struct sess *c = &sc->sess[i];
            if (!c->s || c->job || strcmp(c->ns, j->req.ns)) continue;
            bool whole = continues(c, j);
            int32_t common = buf ? common_tokens(c, req, n_req, buf) : 0;
            if (!whole && common < srv->block && !(n_req > 0 && common == n_req)) continue;
            /* taking over another conversation cuts it back to the common prefix: only worth it
            ** when that drops fewer tokens than it reuses (an edited or retried last turn, a
            ** second question on the same document); a long conversation that merely opens
            ** like the request (an agent's shared system prompt) keeps its history, and the
            ** request gets a session of its own */
            if (!whole && kvt_session_tokens(c->s, NULL, 0) - common > common) continue;
            if ((whole && !best_whole) ||
                (whole == best_whole && (common > best || (common == best && x && c->last_used > x->last_used)))) {
                best = common;
                best_whole = whole;
                x = c;
            }
        }
        free(buf);
    }
    if (x && x->seq < 0) { /* parked: back into a sequence, no recompute */
        int32_t q = take_seq(srv, j->req.ns);
        if (q < 0) return PICK_ERR;
        struct kvt_session_stats s0, s1;
        kvt_session_get_stats(x->s, &s0);
        int rc = kvt_session_resume(x->s, q);
        kvt_session_get_stats(x->s, &s1);
        j->resumed = s1.recoveries - s0.recoveries;
        if (rc) {
            serve_error_lib(&j->err, "cannot resume the session", rc);
            kvt_session_free(x->s);
            memset(x, 0, sizeof *x);
            return PICK_ERR;
        }
        x->seq = q;
    }
    if (x) {
        *out = x;
        return PICK_OK;
    }
    if (!(x = new_slot(srv, j->req.ns))) return PICK_ERR;
    int32_t q = take_seq(srv, j->req.ns);
    if (q < 0) return PICK_ERR;
    struct kvt_session_params sp = kvt_session_default_params();
    sp.seq = q;
    sp.budget = srv->budget;
    sp.block = srv->block;
    sp.elastic_sk = srv->elastic_sk;
    sp.elastic_sv = srv->elastic_sv;
    sp.pool = sc->pool;
    sp.store = sc->store;
    sp.codec_ram = srv->codec_ram;
    if (sc->ram_bits) {
        sp.codec_ram_bits = sc->head_bits;
        sp.n_codec_ram_bits = sc->n_head_bits;
    }
    sp.chunk_reuse = srv->chunk_reuse && sc->store; /* without a store (--no-store): nothing to reuse */
    sp.chunk_recompute = srv->chunk_recompute;
    sp.tenant = srv->share_store ? NULL : j->req.ns; /* API keys never see each other's blocks */
    int rc = kvt_session_open(srv->eng, &sp, &x->s);
    if (rc) {
        serve_error_lib(&j->err, "cannot open a session", rc);
        x->s = NULL;
        return PICK_ERR;
    }
    x->seq = q;
    snprintf(x->ns, sizeof x->ns, "%s", j->req.ns);
    if (j->req.session_id[0]) snprintf(x->id, sizeof x->id, "%s", j->req.session_id);
    else snprintf(x->id, sizeof x->id, "sess-%llu-%llu", (unsigned long long) time(NULL), (unsigned long long) ++sc->n_new);
    *out = x;
    return PICK_OK;
}

/* A queued job that names an existing session, or continues one's whole conversation, finds its
** history in that session (resident, or in the host pool when parked): prefetching its chain from
** the root would only push other entries out of the store's RAM tier for blocks no get reads. */
static bool has_session(struct server *srv, const struct job *j) {
    struct sched *sc = srv->sched;
    if (j->req.session_id[0]) return find_session(srv, j->req.ns, j->req.session_id) != NULL;
    for (int32_t i = 0; i < sc->cap; i++)
        if (sc->sess[i].s && !strcmp(sc->sess[i].ns, j->req.ns) && continues(&sc->sess[i], j)) return true;
    return false;
}

void admit_prefetch(struct server *srv, struct job *j) {
    struct sched *sc = srv->sched;
    if (!sc->store || j->kind != JOB_CHAT || has_session(srv, j)) return;
    const kvt_token *tok = NULL;
    int32_t n = 0;
    struct kvt_chain_params cp = { .block = srv->block, .tenant = srv->share_store ? NULL : j->req.ns };
    char layout[512];
    if (admit_request_tokens(srv, j, &tok, &n) == 0 && kvt_engine_fingerprint(srv->eng, &cp.model) == 0) {
        kvt_engine_layout(srv->eng, layout, sizeof layout);
        cp.layout = layout;
        kvt_store_prefetch_chain(sc->store, &cp, tok, n);
    }
}

bool admit_runnable(struct server *srv, const struct job *j) {
    if (j->kind != JOB_CHAT || !j->req.session_id[0]) return true;
    struct sess *x = find_session(srv, j->req.ns, j->req.session_id);
    return !x || !x->job;
}

void admit_delete(struct server *srv, struct job *j) {
    struct sess *x = find_session(srv, j->req.ns, j->req.session_id);
    if (j->erase_slot && !(x && x->job)) { /* llama-server's erase: an empty slot is no error */
        if (x) {
            j->n_erased = kvt_session_tokens(x->s, NULL, 0);
            kvt_session_free(x->s);
            memset(x, 0, sizeof *x);
        }
        j->n_erased += serve_completion_forget(srv, j->req.ns);
    } else if (!x)
        serve_error_set(&j->err, 404, "invalid_request_error", "session_not_found", "no session '%s'", j->req.session_id);
    else if (x->job)
        serve_error_set(&j->err, 409, "invalid_request_error", "session_busy", "session '%s' is generating a reply",
                        j->req.session_id);
    else {
        kvt_session_free(x->s);
        memset(x, 0, sizeof *x);
    }
    snprintf(j->out_session, sizeof j->out_session, "%s", j->req.session_id);
}
