/* sched.c — the engine thread of `kvtier serve`: owns the kvt_engine, the host pool and
** every session; takes jobs from the queue and runs them.
**
** Scheduling: up to --parallel jobs, chats and completions alike, are active at once; every
** scheduler step generates one token for each of them in ONE llama_decode
** (kvt_session_gen_step_batch_ex: continuous batching; a job joins or leaves the batch between
** steps).  A job's prompt (for a chat, the new tail after the session's cached prefix) is
** prefilled when the job is admitted, in chunks of at most one block; between chunks the active
** jobs take a batched step (kvt_session_set_chunk_cb for sessions), so a long prefill does not
** stall them.  Prefill chunks and decode tokens are not mixed in one llama_decode.
**
** Completions (/v1/completions, no session) are raw rows of the batch: each runs in a scratch
** sequence of its own (sequences max_sessions .., one per job that may run at once, at most 64
** in all), with its own logits and sampling.  Together they hold at most one --budget of KV
** cells (the one cmd_serve reserves beside the sessions' budgets): a completion reserves its
** prompt plus max_tokens and, when the running ones leave no room or no sequence is free, waits
** (holding its --parallel slot, in arrival order) until they finish.
**
** Sessions: one kvt_session per conversation, on its own sequence id; chosen by X-Session-Id
** within the caller's API-key namespace, else the idle session of that namespace whose whole
** conversation the request continues (every message of it begins the request), else the one
** whose token stream (kvt_session_tokens) shares the longest prefix with the request's tokens
** (the chat template with the assistant prefix, tokenized once per request) if that is at least
** one block, else a new one.  A session chosen by prefix is cut back to the first token that
** differs (kvt_session_sync), so only the request's own tail is decoded; a shorter common prefix
** (the template's opening), or one whose take-over would cut back more tokens than it reuses (a
** long conversation sharing only its system prompt), does not take over another conversation's
** session.  Past --max-sessions the least recently used idle session is parked
** (kvt_session_park: its KV goes to the host pool and comes back with kvt_session_resume, no
** recompute); SERVE_PARK_FACTOR x --max-sessions sessions are kept in all, past that the least
** recently used parked one is freed. */
#include "serve.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const double serve_hist_bounds[HIST_N] = { 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000 };

void serve_hist_add(struct hist *h, double ms) {
    int i = 0;
    while (i < HIST_N && ms > serve_hist_bounds[i]) i++;
    h->bucket[i]++;
    h->count++;
    h->sum += ms;
}

struct sess {
    kvt_session *s;
    int32_t      seq;        /* engine sequence, -1 while parked */
    char         id[80], ns[80];
    double       last_used;  /* seconds since the epoch */
    struct job  *job;        /* running job, NULL when idle */
};

/* /v1/completions run in scratch sequences comp_seq0 .. comp_seq0 + n_comp - 1 and share one
** budget of KV cells (the one cmd_serve reserves beside the sessions' budgets). */
enum { SERVE_MAX_SEQ = 64 }; /* kvt_engine_open takes at most 64 sequences */

/* The engine thread's state: everything it owns beside srv->eng, one per server (no process
** globals, so two servers can live in one process).  Created by serve_engine_open, freed by
** serve_engine_close; touched by the engine thread only. */
struct sched {
    struct sess *sess;          /* [cap]: max_sessions hold a sequence, the others are parked */
    int32_t      cap;
    kvt_pool    *pool;
    uint64_t     n_new;         /* sessions opened without a name (their ids count them) */
    const char  *fallback;      /* the sessions' chat template fallback (request tokens must agree) */
    int32_t      comp_seq0, n_comp;
    bool         comp_busy[SERVE_MAX_SEQ];
    int32_t      comp_cells;
    struct job **wait;          /* [parallel] admitted completions waiting for a sequence or cells, FIFO */
    int32_t      n_wait;
    /* the jobs generating now; shared with the chunk callback, which keeps them generating while
    ** another job's prompt is prefilled */
    struct job **active;        /* [parallel] */
    double      *t_last;        /* [parallel] ms of each active job's last token */
    int32_t      n_active;
};

static void on_chunk(void *ud);

static double wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int serve_engine_open(struct server *srv) {
    struct sched *sc = srv->sched = calloc(1, sizeof *sc);
    if (sc) {
        sc->cap = SERVE_PARK_FACTOR * srv->max_sessions;
        sc->sess = calloc((size_t) sc->cap, sizeof *sc->sess);
        sc->active = calloc((size_t) srv->parallel, sizeof *sc->active);
        sc->t_last = calloc((size_t) srv->parallel, sizeof *sc->t_last);
        sc->wait = calloc((size_t) srv->parallel, sizeof *sc->wait);
    }
    if (!sc || !sc->sess || !sc->active || !sc->t_last || !sc->wait) {
        fprintf(stderr, "kvtier serve: out of memory for %d sessions\n", SERVE_PARK_FACTOR * srv->max_sessions);
        serve_engine_close(srv);
        return APP_ERR;
    }
    sc->fallback = kvt_session_default_params().template_fallback;
    /* one scratch sequence per completion that may run at once (they count against --parallel) */
    sc->n_comp = KVT_MAX(1, KVT_MIN(srv->parallel, SERVE_MAX_SEQ - srv->max_sessions));
    sc->comp_seq0 = srv->max_sessions;
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = srv->model_path;
    ep.n_ctx = srv->n_ctx;
    ep.n_seq = srv->max_sessions + sc->n_comp;
    ep.n_threads = srv->threads;
    int rc = kvt_engine_open(&ep, &srv->eng);
    if (rc) {
        app_fail("kvtier serve", "cannot open the model", rc);
        serve_engine_close(srv);
        return APP_ERR;
    }
    struct kvt_pool_params pp = kvt_pool_default_params();
    pp.budget_bytes = (size_t) srv->pool_mb << 20;
    pp.spill_dir = srv->spill_dir;
    if ((rc = kvt_pool_open(&pp, &sc->pool))) {
        app_fail("kvtier serve", "cannot open the host pool", rc);
        serve_engine_close(srv);
        return APP_ERR;
    }
    struct kvt_engine_info I;
    kvt_engine_info(srv->eng, &I);
    snprintf(srv->model_name, sizeof srv->model_name, "%s", I.name[0] ? I.name : I.desc);
    return APP_OK;
}

void serve_engine_close(struct server *srv) {
    struct sched *sc = srv->sched;
    if (sc) {
        for (int32_t i = 0; sc->sess && i < sc->cap; i++) kvt_session_free(sc->sess[i].s);
        free(sc->sess);
        kvt_pool_free(sc->pool);
        free(sc->active);
        free(sc->t_last);
        free(sc->wait);
        free(sc);
        srv->sched = NULL;
    }
    kvt_engine_free(srv->eng);
    srv->eng = NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* queue                                                                                    */

void serve_job_free(struct job *j) {
    if (!j) return;
    for (int32_t i = 0; i < j->n_msgs; i++) {
        free((char *) j->msgs[i].role);
        free((char *) j->msgs[i].content);
    }
    free(j->msgs);
    free(j->prompt);
    free(j->grammar);
    kvt_grammar_free(j->smp.grammar);
    for (int32_t i = 0; i < j->n_stop; i++) free(j->stop[i]);
    free(j->text);
    free(j->gen);
    free(j->ptok);
    free(j->row.logits);
    pthread_cond_destroy(&j->cv);
    free(j);
}

int serve_submit(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    if (srv->stopping) {
        pthread_mutex_unlock(&srv->mu);
        return 503;
    }
    if (j->kind != JOB_DELETE && srv->n_queued >= srv->max_queue) {
        pthread_mutex_unlock(&srv->mu);
        return 429;
    }
    j->state = JOB_QUEUED;
    j->refs = 2;
    j->ticket = srv->n_tickets++;
    j->next = NULL;
    if (srv->tail) srv->tail->next = j;
    else srv->head = j;
    srv->tail = j;
    srv->n_queued++;
    srv->m.queue_len = srv->n_queued;
    pthread_cond_signal(&srv->work);
    pthread_mutex_unlock(&srv->mu);
    return 0;
}

/* An admitted job that cannot start yet (the session it names is generating) goes back to the
** queue at its place in arrival order; it is admitted again once runnable() says so.  It stays
** queued for the client (not an error) and does not count against --queue a second time. */
static void requeue(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    struct job **pp = &srv->head;
    while (*pp && (*pp)->ticket < j->ticket) pp = &(*pp)->next;
    j->next = *pp;
    *pp = j;
    if (!j->next) srv->tail = j;
    j->state = JOB_QUEUED;
    srv->n_queued++;
    srv->m.queue_len = srv->n_queued;
    srv->m.active--;
    pthread_mutex_unlock(&srv->mu);
}

/* under srv->mu */
static void release_locked(struct job *j) {
    if (--j->refs == 0) serve_job_free(j);
}

void serve_job_release(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    release_locked(j);
    pthread_mutex_unlock(&srv->mu);
}

/* ---------------------------------------------------------------------------------------- */
/* jobs                                                                                     */

static void job_error(struct job *j, int status, const char *type, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void job_error(struct job *j, int status, const char *type, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->err_msg, sizeof j->err_msg, fmt, ap);
    va_end(ap);
    j->http_status = status;
    snprintf(j->err_type, sizeof j->err_type, "%s", type);
    snprintf(j->err_code, sizeof j->err_code, "%s", code ? code : "");
}

/* A library error as an HTTP error: input the library refused is the client's (400), the rest
** is ours (500). */
static void job_lib_error(struct job *j, const char *what, int rc) {
    if (rc == KVT_ECTX || rc == KVT_EBUDGET)
        job_error(j, 400, "invalid_request_error", "context_length_exceeded", "%s: %s", what, kvt_errmsg());
    else if (rc == KVT_EINVAL)
        job_error(j, 400, "invalid_request_error", NULL, "%s: %s", what, kvt_errmsg());
    else
        job_error(j, 500, "server_error", NULL, "%s: %s: %s", what, kvt_strerror(rc), kvt_errmsg());
}

static void finish(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    j->state = JOB_DONE;
    srv->m.active--;
    srv->m.prompt_tokens += j->prompt_tokens;
    srv->m.completion_tokens += j->completion_tokens;
    srv->m.prompt_reused += j->sync.tokens_reused;
    srv->m.prompt_decoded += j->sync.tokens_decoded;
    srv->m.evictions += j->sync.evictions;
    srv->m.recoveries += j->sync.recoveries;
    pthread_cond_broadcast(&j->cv);
    release_locked(j);
    pthread_mutex_unlock(&srv->mu);
}

/* Append the new token's text; apply stop strings.  Returns true when a stop string ended the reply. */
static bool update_text(struct server *srv, struct job *j, kvt_engine *eng) {
    char *t = NULL;
    if (kvt_detokenize(eng, j->gen, j->n_gen, false, &t)) return false;
    size_t n = strlen(t);
    bool stopped = false;
    size_t hold = 0;
    for (int32_t i = 0; i < j->n_stop; i++) {
        char *p = strstr(t, j->stop[i]);
        if (p) {
            n = KVT_MIN(n, (size_t) (p - t));
            stopped = true;
        }
        hold = KVT_MAX(hold, strlen(j->stop[i]) - 1);
    }
    pthread_mutex_lock(&srv->mu);
    free(j->text);
    t[n] = '\0';
    j->text = t;
    /* published bytes: hold back what could still become a stop string */
    j->n_text = stopped ? n : (n > hold ? n - hold : 0);
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&srv->mu);
    return stopped;
}

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
    while (k < n && k < j->n_msgs) {
        struct kvt_chat_msg m;
        if (kvt_session_message(x->s, k, &m) || strcmp(m.role, j->msgs[k].role) || strcmp(m.content, j->msgs[k].content))
            break;
        k++;
    }
    return k == n && k > 0;
}

/* The request as kvt_session_sync decodes it: the template's tokens of its messages with the
** assistant prefix (same template fallback, BOS and special-token parsing as the sessions).
** OUT *tok (caller frees), *n.  Returns a library error; the request then matches by
** conversation only. */
static int request_tokens(struct server *srv, const struct job *j, kvt_token **tok, int32_t *n) {
    struct sched *sc = srv->sched;
    char *text = NULL;
    *tok = NULL;
    *n = 0;
    int rc = kvt_chat_format(srv->eng, j->msgs, j->n_msgs, true, sc->fallback, &text);
    if (rc == 0) rc = kvt_tokenize(srv->eng, text, true, true, tok, n);
    free(text);
    return rc;
}

/* Tokens at the start of the session's stream equal to req[0..n); buf: room for n tokens. */
static int32_t common_tokens(const struct sess *x, const kvt_token *req, int32_t n, kvt_token *buf) {
    int32_t m = KVT_MIN(n, kvt_session_tokens(x->s, buf, n)), c = 0;
    while (c < m && buf[c] == req[c]) c++;
    return c;
}

/* A free sequence: one no session holds, else the one of the least recently used idle session,
** which is parked (its KV goes to the host pool, nothing is lost).  -1 if all are generating. */
static int32_t take_seq(struct server *srv) {
    struct sched *sc = srv->sched;
    for (int32_t q = 0; q < srv->max_sessions; q++) {
        bool used = false;
        for (int32_t i = 0; i < sc->cap && !used; i++) used = sc->sess[i].s && sc->sess[i].seq == q;
        if (!used) return q;
    }
    struct sess *lru = NULL;
    for (int32_t i = 0; i < sc->cap; i++)
        if (sc->sess[i].s && sc->sess[i].seq >= 0 && !sc->sess[i].job && (!lru || sc->sess[i].last_used < lru->last_used)) lru = &sc->sess[i];
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

/* An empty entry, freeing the least recently used parked (else idle) session if all are taken. */
static struct sess *new_slot(struct server *srv) {
    struct sched *sc = srv->sched;
    struct sess *lru = NULL;
    for (int32_t i = 0; i < sc->cap; i++) {
        if (!sc->sess[i].s) return &sc->sess[i];
        if (sc->sess[i].job) continue;
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
    int32_t n = KVT_MIN(kvt_session_n_messages(x->s), j->n_msgs);
    for (int32_t k = 0; k < n; k++) {
        struct kvt_chat_msg m;
        if (kvt_session_message(x->s, k, &m) || strcmp(m.role, j->msgs[k].role)) break;
        if (!strcmp(m.content, j->msgs[k].content)) continue;
        if (strcmp(m.role, "assistant") || !tools_same_reply(m.content, j->msgs[k].content)) break;
        char *c = strdup(m.content);
        if (!c) return -1;
        free((char *) j->msgs[k].content);
        j->msgs[k].content = c;
    }
    return 0;
}

/* What pick_session found: a session, one that is generating (the job waits), or an error. */
enum pick { PICK_OK, PICK_BUSY, PICK_ERR };

/* The session a chat job runs in (*out): the one it names, else one chosen by conversation or
** token prefix among the idle sessions of its namespace, else a new one.  A session generating a
** reply is never handed out: PICK_BUSY when the job names one (it goes back to the queue and
** waits its turn; admission alone cannot see this, since a job without X-Session-Id admitted in
** the same round may have taken that session by prefix).  PICK_ERR: the job has its error. */
static enum pick pick_session(struct server *srv, struct job *j, struct sess **out) {
    struct sched *sc = srv->sched;
    struct sess *x = NULL;
    *out = NULL;
    if (j->session_id[0]) {
        x = find_session(srv, j->ns, j->session_id);
        if (x && x->job) return PICK_BUSY;
        if (x && canonicalise_replies(x, j)) { job_error(j, 500, "server_error", NULL, "out of memory"); return PICK_ERR; }
    } else {
        /* the session whose whole conversation the request continues, else the one sharing the
        ** longest token prefix with the request, if at least one block (shorter: a common system
        ** prompt or template opening, not worth cutting another conversation back for); the
        ** request is tokenized once and compared with every idle session of its namespace */
        kvt_token *req = NULL, *buf = NULL;
        int32_t n_req = 0, best = 0;
        bool best_whole = false, any = false;
        /* echoed replies in the sessions' own generated form first (a tool-mode reply echoed as
        ** plain text), so that the comparison sees the tokens the sessions hold */
        for (int32_t i = 0; i < sc->cap; i++)
            if (sc->sess[i].s && !sc->sess[i].job && !strcmp(sc->sess[i].ns, j->ns)) {
                any = true;
                if (canonicalise_replies(&sc->sess[i], j)) { job_error(j, 500, "server_error", NULL, "out of memory"); return PICK_ERR; }
            }
        if (any && request_tokens(srv, j, &req, &n_req) == 0 && !(buf = malloc(sizeof *buf * (size_t) KVT_MAX(n_req, 1))))
            n_req = 0;
        for (int32_t i = 0; any && i < sc->cap; i++) {
            struct sess *c = &sc->sess[i];
            if (!c->s || c->job || strcmp(c->ns, j->ns)) continue;
            bool whole = continues(c, j);
            int32_t common = buf ? common_tokens(c, req, n_req, buf) : 0;
            if (!whole && common < srv->block) continue;
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
        free(req);
        free(buf);
    }
    if (x && x->seq < 0) { /* parked: back into a sequence, no recompute */
        int32_t q = take_seq(srv);
        if (q < 0) return PICK_ERR;
        struct kvt_session_stats s0, s1;
        kvt_session_get_stats(x->s, &s0);
        int rc = kvt_session_resume(x->s, q);
        kvt_session_get_stats(x->s, &s1);
        j->resumed = s1.recoveries - s0.recoveries;
        if (rc) {
            job_lib_error(j, "cannot resume the session", rc);
            kvt_session_free(x->s);
            memset(x, 0, sizeof *x);
            return PICK_ERR;
        }
        x->seq = q;
    }
    if (x) { *out = x; return PICK_OK; }
    if (!(x = new_slot(srv))) return PICK_ERR;
    int32_t q = take_seq(srv);
    if (q < 0) return PICK_ERR;
    struct kvt_session_params sp = kvt_session_default_params();
    sp.seq = q;
    sp.budget = srv->budget;
    sp.block = srv->block;
    sp.pool = sc->pool;
    int rc = kvt_session_open(srv->eng, &sp, &x->s);
    if (rc == 0) kvt_session_set_chunk_cb(x->s, on_chunk, srv);
    if (rc) {
        job_lib_error(j, "cannot open a session", rc);
        x->s = NULL;
        return PICK_ERR;
    }
    x->seq = q;
    snprintf(x->ns, sizeof x->ns, "%s", j->ns);
    if (j->session_id[0]) snprintf(x->id, sizeof x->id, "%s", j->session_id);
    else snprintf(x->id, sizeof x->id, "sess-%llu-%llu", (unsigned long long) time(NULL), (unsigned long long) ++sc->n_new);
    *out = x;
    return PICK_OK;
}

/* Is the job runnable now?  (A named session that is busy waits in the queue.) */
static bool runnable(struct server *srv, const struct job *j) {
    if (j->kind != JOB_CHAT || !j->session_id[0]) return true;
    struct sess *x = find_session(srv, j->ns, j->session_id);
    return !x || !x->job;
}

static void run_delete(struct server *srv, struct job *j) {
    struct sess *x = find_session(srv, j->ns, j->session_id);
    if (!x) job_error(j, 404, "invalid_request_error", "session_not_found", "no session '%s'", j->session_id);
    else if (x->job) job_error(j, 409, "invalid_request_error", "session_busy", "session '%s' is generating a reply", j->session_id);
    else {
        kvt_session_free(x->s);
        memset(x, 0, sizeof *x);
    }
    snprintf(j->out_session, sizeof j->out_session, "%s", j->session_id);
}

static int add_gen(struct job *j, kvt_token t) {
    if (j->n_gen == j->cap_gen) {
        int32_t cap = j->cap_gen ? 2 * j->cap_gen : 64;
        kvt_token *g = realloc(j->gen, sizeof *g * (size_t) cap);
        if (!g) return -1;
        j->gen = g;
        j->cap_gen = cap;
    }
    j->gen[j->n_gen++] = t;
    return 0;
}

static void note_token(struct server *srv, struct job *j, double *t_last) {
    double now = mono_ms();
    pthread_mutex_lock(&srv->mu);
    if (j->t_first == 0) {
        j->t_first = now;
        serve_hist_add(&srv->m.ttft, now - j->t_arrival);
    } else {
        serve_hist_add(&srv->m.per_token, now - *t_last);
    }
    pthread_mutex_unlock(&srv->mu);
    *t_last = now;
}

/* /v1/completions, admitted: the prompt's tokens and its KV cell reservation.  Returns false
** (the job has its error) when it cannot run at all; else it waits for a sequence (start_waiting). */
static bool prepare_completion(struct server *srv, struct job *j) {
    int rc = kvt_tokenize(srv->eng, j->prompt, true, false, &j->ptok, &j->prompt_tokens);
    if (rc) { job_lib_error(j, "prompt", rc); return false; }
    const int32_t n = j->prompt_tokens;
    j->sync.prompt_tokens = n;
    j->sync.tokens_decoded = n;
    j->finish = "length";
    j->seq = -1;
    if (n + j->max_tokens > srv->budget) {
        job_error(j, 400, "invalid_request_error", "context_length_exceeded",
                  "the prompt is %d tokens and max_tokens %d; together they must fit the budget of %d tokens", n,
                  j->max_tokens, srv->budget);
        return false;
    }
    if (n == 0) {
        job_error(j, 400, "invalid_request_error", NULL, "the prompt is empty (0 tokens)");
        return false;
    }
    j->cells = n + j->max_tokens;
    return true;
}

/* The completion leaves its sequence (its cells are freed) and gives back its reservation. */
static void end_completion(struct server *srv, struct job *j, int rc) {
    struct sched *sc = srv->sched;
    if (rc) job_lib_error(j, "generation", rc);
    if (j->seq >= 0) {
        kvt_seq_rm(srv->eng, j->seq, -1, -1);
        sc->comp_busy[j->seq - sc->comp_seq0] = false;
        sc->comp_cells -= j->cells;
        j->seq = -1;
    }
    free(j->row.logits);
    j->row.logits = NULL;
    j->completion_tokens = j->n_gen;
}

/* Prefill a completion's prompt into a free scratch sequence, in chunks of one block with a
** batched step of the active jobs between them (as sessions prefill); then it joins the active
** set as a raw row of kvt_session_gen_step_batch_ex.  Returns false when it failed (finished). */
static bool start_completion(struct server *srv, struct job *j) {
    struct sched *sc = srv->sched;
    int32_t q = 0;
    while (sc->comp_busy[q]) q++;
    sc->comp_busy[q] = true;
    sc->comp_cells += j->cells;
    j->seq = sc->comp_seq0 + q;
    struct kvt_engine_info I;
    kvt_engine_info(srv->eng, &I);
    int rc = (j->row.logits = malloc(sizeof(float) * (size_t) I.n_vocab)) ? 0 : KVT_ENOMEM;
    const int32_t n = j->prompt_tokens;
    for (int32_t off = 0; rc == 0 && off < n;) {
        int32_t m = KVT_MIN(n - off, srv->block);
        rc = kvt_decode(srv->eng, j->seq, j->ptok + off, m, off, off + m == n);
        off += m;
        if (rc == 0 && off < n) on_chunk(srv);
    }
    const float *l = rc == 0 ? kvt_logits(srv->eng) : NULL;
    if (rc == 0 && !l) rc = KVT_ELLAMA;
    free(j->ptok);
    j->ptok = NULL;
    if (rc) {
        job_lib_error(j, "prompt", rc);
        end_completion(srv, j, 0);
        finish(srv, j);
        return false;
    }
    memcpy(j->row.logits, l, sizeof(float) * (size_t) I.n_vocab);
    j->row.seq = j->seq;
    j->row.pos = n;
    pthread_mutex_lock(&srv->mu); /* the stream may start: headers go out now */
    j->started = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&srv->mu);
    sc->t_last[sc->n_active] = 0;
    sc->active[sc->n_active++] = j;
    return true;
}

/* Start the waiting completions, in arrival order, while a scratch sequence is free and the
** cells they reserve fit the shared budget; a cancelled one leaves without running. */
static void start_waiting(struct server *srv) {
    struct sched *sc = srv->sched;
    int32_t w = 0; /* first, the ones whose client left, wherever they wait */
    for (int32_t k = 0; k < sc->n_wait; k++) {
        pthread_mutex_lock(&srv->mu);
        bool gone = sc->wait[k]->cancelled;
        pthread_mutex_unlock(&srv->mu);
        if (gone) { sc->wait[k]->completion_tokens = 0; sc->wait[k]->finish = "stop"; finish(srv, sc->wait[k]); }
        else sc->wait[w++] = sc->wait[k];
    }
    sc->n_wait = w;
    while (sc->n_wait > 0) {
        struct job *j = sc->wait[0];
        bool cancelled;
        pthread_mutex_lock(&srv->mu);
        cancelled = j->cancelled;
        pthread_mutex_unlock(&srv->mu);
        bool seq_free = false;
        for (int32_t q = 0; q < sc->n_comp; q++) seq_free |= !sc->comp_busy[q];
        if (!cancelled && (!seq_free || sc->comp_cells + j->cells > srv->budget)) break;
        memmove(sc->wait, sc->wait + 1, sizeof *sc->wait * (size_t) --sc->n_wait);
        if (cancelled) {
            j->completion_tokens = 0;
            finish(srv, j);
            continue;
        }
        start_completion(srv, j);
    }
}

/* Choose the chat's session and decode its prompt there.  Returns PICK_OK (j->slot is set unless
** the job failed: it has its error), or PICK_BUSY: the session it names is generating, the job
** must wait (requeue). */
static enum pick start_chat(struct server *srv, struct job *j) {
    if (j->grammar && !j->smp.grammar) {
        int rc = kvt_grammar_new(srv->eng, j->grammar, "root", &j->smp.grammar);
        if (rc) { /* our own translation of the schema failed: say which text */
            job_error(j, 400, "invalid_request_error", NULL, "the tools / response_format schema could not be compiled to a grammar: %s",
                      kvt_errmsg());
            return PICK_OK;
        }
    }
    struct sess *x;
    enum pick p = pick_session(srv, j, &x);
    if (p == PICK_BUSY) return p;
    if (!x) {
        if (!j->http_status)
            job_error(j, 503, "server_error", NULL, "every one of the %d session slots is generating", srv->max_sessions);
        return PICK_OK;
    }
    snprintf(j->out_session, sizeof j->out_session, "%s", x->id);
    x->last_used = wall_s();
    x->job = j; /* busy from here: its prompt is decoded with other jobs stepping in between */
    int rc = kvt_session_sync(x->s, j->msgs, j->n_msgs, &j->sync);
    j->sync.recoveries += j->resumed;
    j->prompt_tokens = j->sync.prompt_tokens;
    if (rc) {
        x->job = NULL;
        job_lib_error(j, "prompt", rc);
        return PICK_OK;
    }
    j->slot = x;
    j->finish = "length";
    return PICK_OK;
}

/* The job's reply is over (end of generation, stop string, max_tokens, cancelled or an error):
** close the reply in the session. */
static void end_chat(struct server *srv, struct job *j, int rc) {
    struct sess *x = j->slot;
    (void) srv;
    if (rc) job_lib_error(j, "generation", rc);
    int rc2 = kvt_session_gen_end(x->s, NULL);
    if (rc2 && !rc) job_lib_error(j, "reply", rc2);
    struct kvt_session_stats st;
    kvt_session_get_stats(x->s, &st);
    j->resident_tokens = st.resident_tokens;
    j->completion_tokens = j->n_gen;
    x->job = NULL;
    x->last_used = wall_s();
}

/* One token for every active job, chats and completions, all in one llama_decode (continuous
** batching: kvt_session_gen_step_batch_ex, completions as raw rows).  Fills over[k] for the jobs
** whose reply ended.  Returns the number that ended. */
static int32_t step_all(struct server *srv, struct job **active, int32_t n_active, double *t_last, bool *over) {
    kvt_session *ss[64] = { 0 };
    struct kvt_sampling smp[64] = { { 0 } };
    struct kvt_gen_row rows[64];
    kvt_token tok[64];
    bool done[64];
    int st[64];
    int64_t ev0[64], rec0[64];
    int32_t map[64], rmap[64], n = 0, n_rows = 0, n_over = 0;
    for (int32_t k = 0; k < n_active; k++) {
        struct job *j = active[k];
        bool cancelled;
        pthread_mutex_lock(&srv->mu);
        cancelled = j->cancelled;
        pthread_mutex_unlock(&srv->mu);
        over[k] = cancelled || j->n_gen >= j->max_tokens;
        if (over[k]) continue;
        if (j->kind == JOB_COMPLETION) {
            rows[n_rows] = j->row;
            rows[n_rows].smp = j->smp;
            rows[n_rows].smp.seed += (uint32_t) j->n_gen;
            rmap[n_rows++] = k;
            continue;
        }
        struct sess *x = j->slot;
        struct kvt_session_stats s0;
        kvt_session_get_stats(x->s, &s0);
        ev0[n] = s0.evictions;
        rec0[n] = s0.recoveries;
        ss[n] = x->s;
        smp[n] = j->smp;
        smp[n].seed += (uint32_t) j->n_gen;
        map[n++] = k;
    }
    int rc = n + n_rows > 0 ? kvt_session_gen_step_batch_ex(srv->eng, ss, n, smp, tok, done, st, rows, n_rows) : 0;
    for (int32_t i = 0; i < n; i++) {
        struct job *j = active[map[i]];
        struct kvt_session_stats s1;
        kvt_session_get_stats(ss[i], &s1);
        j->sync.evictions += s1.evictions - ev0[i];
        j->sync.recoveries += s1.recoveries - rec0[i];
        int r = rc ? rc : st[i];
        if (r) { end_chat(srv, j, r); over[map[i]] = true; continue; }
        if (done[i]) { j->finish = "stop"; over[map[i]] = true; continue; }
        if (add_gen(j, tok[i])) { end_chat(srv, j, KVT_ENOMEM); over[map[i]] = true; continue; }
        note_token(srv, j, &t_last[map[i]]);
        if (update_text(srv, j, srv->eng)) { j->finish = "stop"; over[map[i]] = true; }
        else if (j->n_gen >= j->max_tokens) over[map[i]] = true;
    }
    for (int32_t i = 0; i < n_rows; i++) {
        struct job *j = active[rmap[i]];
        j->row.pos = rows[i].pos; /* the logits were written in place */
        int r = rc ? rc : rows[i].status;
        if (r) { end_completion(srv, j, r); over[rmap[i]] = true; continue; }
        if (rows[i].done) { j->finish = "stop"; over[rmap[i]] = true; continue; }
        if (add_gen(j, rows[i].tok)) { end_completion(srv, j, KVT_ENOMEM); over[rmap[i]] = true; continue; }
        note_token(srv, j, &t_last[rmap[i]]);
        if (update_text(srv, j, srv->eng)) { j->finish = "stop"; over[rmap[i]] = true; }
        else if (j->n_gen >= j->max_tokens) over[rmap[i]] = true;
    }
    for (int32_t k = 0; k < n_active; k++) {
        if (!over[k]) continue;
        n_over++;
        struct job *j = active[k];
        if (j->kind == JOB_COMPLETION) end_completion(srv, j, 0);
        else if (j->slot && ((struct sess *) j->slot)->job == j) end_chat(srv, j, 0);
    }
    return n_over;
}

/* Sessions and gauges for GET /v1/sessions and /metrics. */
static void publish(struct server *srv) {
    struct sched *sc = srv->sched;
    struct sess_view *v = calloc((size_t) sc->cap, sizeof *v);
    int32_t n = 0;
    int64_t resident = 0, parked = 0;
    for (int32_t i = 0; v && i < sc->cap; i++) {
        struct sess *x = &sc->sess[i];
        if (!x->s) continue;
        struct kvt_session_stats st;
        kvt_session_get_stats(x->s, &st);
        snprintf(v[n].id, sizeof v[n].id, "%s", x->id);
        snprintf(v[n].ns, sizeof v[n].ns, "%s", x->ns);
        v[n].n_messages = kvt_session_n_messages(x->s);
        v[n].total_tokens = st.total_tokens;
        v[n].resident_tokens = st.resident_tokens;
        v[n].evictions = st.evictions;
        v[n].recoveries = st.recoveries;
        v[n].last_used = x->last_used;
        v[n].busy = x->job != NULL;
        v[n].parked = x->seq < 0;
        parked += x->seq < 0;
        resident += st.resident_tokens;
        n++;
    }
    struct kvt_pool_stats ps;
    kvt_pool_get_stats(sc->pool, &ps);
    pthread_mutex_lock(&srv->mu);
    if (v) {
        free(srv->views);
        srv->views = v;
        srv->n_views = n;
    }
    srv->m.resident_tokens = resident;
    srv->m.n_sessions = n;
    srv->m.n_parked = parked;
    srv->m.pool_ram = ps.ram_bytes;
    srv->m.pool_spill = ps.spill_bytes;
    pthread_mutex_unlock(&srv->mu);
}

/* One batched step of the active jobs; finished ones leave the set.  Returns true if any did. */
static bool step_active(struct server *srv) {
    struct sched *sc = srv->sched;
    bool over[64];
    if (sc->n_active == 0 || step_all(srv, sc->active, sc->n_active, sc->t_last, over) == 0) return false;
    int32_t w = 0;
    for (int32_t k = 0; k < sc->n_active; k++) {
        if (over[k]) { finish(srv, sc->active[k]); continue; }
        sc->active[w] = sc->active[k];
        sc->t_last[w++] = sc->t_last[k];
    }
    sc->n_active = w;
    return true;
}

/* Between the prefill chunks of an admitted job: the others keep generating. */
static void on_chunk(void *ud) {
    if (step_active(ud)) publish(ud);
}

void *serve_engine_main(void *arg) {
    struct server *srv = arg;
    struct sched *sc = srv->sched;
    sc->n_active = sc->n_wait = 0;
    publish(srv);
    for (;;) {
        struct job *adm[64];
        int32_t n_adm = 0;
        pthread_mutex_lock(&srv->mu);
        for (;;) {
            struct job **pp = &srv->head, *prev = NULL;
            while (*pp && n_adm < 64) {
                struct job *j = *pp;
                bool take = j->kind == JOB_DELETE || (sc->n_active + sc->n_wait + n_adm < srv->parallel && runnable(srv, j));
                /* one job per named session per round, so two queued turns of one session run in order */
                for (int32_t k = 0; take && k < n_adm; k++)
                    if (adm[k]->kind == JOB_CHAT && j->kind == JOB_CHAT && j->session_id[0] &&
                        !strcmp(adm[k]->session_id, j->session_id) && !strcmp(adm[k]->ns, j->ns))
                        take = false;
                if (!take) { prev = j; pp = &j->next; continue; }
                *pp = j->next;
                if (srv->tail == j) srv->tail = prev;
                srv->n_queued--;
                j->state = JOB_RUNNING;
                if (j->kind != JOB_DELETE) srv->m.active++;
                adm[n_adm++] = j;
            }
            srv->m.queue_len = srv->n_queued;
            if (n_adm > 0 || sc->n_active > 0 || sc->n_wait > 0) break;
            if (srv->stopping && !srv->head) break;
            pthread_cond_wait(&srv->work, &srv->mu);
        }
        pthread_mutex_unlock(&srv->mu);
        if (n_adm == 0 && sc->n_active == 0 && sc->n_wait == 0) break; /* stopping and drained */
        for (int32_t k = 0; k < n_adm; k++) {
            struct job *j = adm[k];
            if (j->kind == JOB_DELETE) {
                run_delete(srv, j);
                pthread_mutex_lock(&srv->mu);
                j->state = JOB_DONE;
                pthread_cond_broadcast(&j->cv);
                release_locked(j);
                pthread_mutex_unlock(&srv->mu);
                continue;
            }
            pthread_mutex_lock(&srv->mu);
            bool gone = j->cancelled; /* its client left while it was queued */
            pthread_mutex_unlock(&srv->mu);
            if (gone) { j->finish = "stop"; finish(srv, j); continue; }
            if (j->kind == JOB_COMPLETION) {
                if (prepare_completion(srv, j)) sc->wait[sc->n_wait++] = j;
                else finish(srv, j);
                continue;
            }
            if (start_chat(srv, j) == PICK_BUSY) { requeue(srv, j); continue; }
            if (!j->slot) { finish(srv, j); continue; }
            pthread_mutex_lock(&srv->mu); /* the stream may start: headers go out now */
            j->started = true;
            pthread_cond_broadcast(&j->cv);
            pthread_mutex_unlock(&srv->mu);
            sc->t_last[sc->n_active] = 0;
            sc->active[sc->n_active++] = j;
        }
        start_waiting(srv);
        if (n_adm > 0) publish(srv);
        /* one token for every active job, one batched decode */
        bool ended = step_active(srv);
        if (ended) publish(srv);
    }
    pthread_mutex_lock(&srv->mu);
    srv->engine_done = true;
    pthread_mutex_unlock(&srv->mu);
    return NULL;
}
