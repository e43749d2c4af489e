/* sched.c — the engine thread of `kvtier serve`: owns the kvt_engine, the host pool and
** every session; takes jobs from the queue and runs them (their sessions are chosen in
** server/admit.c).
**
** Scheduling: up to --parallel jobs, chats and completions alike, are active at once; every
** scheduler step generates one token for each of them in ONE llama_decode
** (kvt_session_gen_step_mixed: continuous batching; a job joins or leaves the batch between
** steps).  A job's prompt (for a chat, the new tail after the session's cached prefix) is
** prefilled when the job is admitted, in chunks of at most one block, and each chunk but the
** last rides in a step: ONE llama_decode holds every active job's next decode token AND the
** chunk (mixed prefill and decode, as llama-server and vLLM schedule chunked prefill), the chunk
** cut so that the step holds at most --batch-tokens tokens (kvt_session_set_prefill_hooks for
** sessions; completions cut their chunks here).  The last chunk goes alone: the step after the
** prefill takes the new job too (see chunk_decode).  A long prefill thus never stalls the
** generating jobs.  --batch-tokens 0: the older schedule, each chunk decoded alone with a
** batched step of the active jobs between chunks (kvt_session_set_chunk_cb).
**
** Completions (/v1/completions, no session) are raw rows of the batch: each runs in a scratch
** sequence of its own (sequences max_sessions .., one per job that may run at once, at most 64
** in all), with its own logits and sampling.  Together they hold at most one --budget of KV
** cells (the one cmd_serve reserves beside the sessions' budgets): a completion reserves its
** prompt plus max_tokens and, when the running ones leave no room or no sequence is free, waits
** (holding its --parallel slot, in arrival order) until they finish. */
#include "sched.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int32_t chunk_room(void *ud);
static int chunk_decode(void *ud, const struct kvt_decode_chunk *c);

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

/* Is the job to stop: its client left, or it ran past its deadline (--request-timeout-s, from
** its arrival; j->timed_out then says which)?  Any thread may set cancelled: read under srv->mu. */
static bool job_stopped(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    bool stop = j->cancelled || srv->abort_jobs;
    pthread_mutex_unlock(&srv->mu);
    if (!stop && j->deadline > 0 && mono_ms() > j->deadline) stop = j->timed_out = true;
    return stop;
}

/* The error of a job stopped by its deadline (or by the end of the drain) before its reply began. */
static void job_timeout_error(struct server *srv, struct job *j, const char *where) {
    if (j->timed_out)
        serve_job_error(j, 408, "invalid_request_error", "request_timeout", "the request ran past --request-timeout-s %d (%s)",
                        srv->lim.request_timeout_s, where);
    else
        serve_job_error(j, 503, "server_error", "shutting_down", "the server is shutting down (--drain-s %d passed; %s)",
                        srv->lim.drain_s, where);
}

static bool aborting(struct server *srv) {
    pthread_mutex_lock(&srv->mu);
    bool a = srv->abort_jobs;
    pthread_mutex_unlock(&srv->mu);
    return a;
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
    ep.n_seq = srv->max_sessions + sc->n_comp;
    /* one KV stream per sequence (the engine's default): every session and every completion slot
    ** must hold a whole budget in its own stream, whatever -c divided by the sequences gives */
    ep.n_ctx = KVT_MAX(srv->n_ctx, srv->budget * ep.n_seq);
    ep.n_threads = srv->threads;
    ep.kv_unified = srv->kv_unified;
    int rc = kvt_engine_open(&ep, &srv->eng);
    if (rc) {
        app_fail("kvtier serve", "cannot open the model", rc);
        serve_engine_close(srv);
        return APP_ERR;
    }
    if (srv->no_store) { /* no block store: the sessions' host pool */
        struct kvt_pool_params pp = kvt_pool_default_params();
        pp.budget_bytes = (size_t) srv->pool_mb << 20;
        pp.spill_dir = srv->spill_dir;
        pp.spill_bytes_max = (size_t) srv->spill_mb << 20;
        if ((rc = kvt_pool_open(&pp, &sc->pool))) {
            app_fail("kvtier serve", "cannot open the host pool", rc);
            serve_engine_close(srv);
            return APP_ERR;
        }
    } else { /* the store replaces the pool: evicted blocks are its private entries */
        struct kvt_store_params stp = kvt_store_default_params();
        stp.dir = srv->store_dir;
        stp.ram_bytes = (size_t) srv->store_ram_mb << 20;
        stp.disk_bytes = (size_t) srv->store_disk_mb << 20;
        stp.redis_url = srv->redis_url;
        stp.redis_secret_file = srv->redis_secret_file;
        stp.private_dir = srv->spill_dir;
        stp.private_disk_bytes = (size_t) srv->spill_mb << 20;
        stp.disk_codec = srv->codec_disk;
        struct kvt_engine_info EI;
        kvt_engine_info(srv->eng, &EI);
        stp.disk_codec_heads = EI.n_head_kv;
        if (srv->redis_timeout_ms > 0) stp.redis_timeout_ms = srv->redis_timeout_ms;
        if (srv->redis_ttl_s > 0) stp.redis_ttl_s = srv->redis_ttl_s;
        if (!srv->prefetch) stp.prefetch_threads = 0; /* --no-prefetch */
        if ((rc = kvt_store_open(&stp, &sc->store))) {
            app_fail("kvtier serve", "cannot open the block store (--no-store runs without one)", rc);
            serve_engine_close(srv);
            return APP_ERR;
        }
        /* the model's fingerprint names every block: hash the GGUF now, not in the first request */
        kvt_key fp;
        double t0 = mono_ms();
        if ((rc = kvt_engine_fingerprint(srv->eng, &fp))) {
            app_fail("kvtier serve", "cannot fingerprint the model for the block store (--no-store runs without one)", rc);
            serve_engine_close(srv);
            return APP_ERR;
        }
        char hex[2 * KVT_KEY_BYTES + 1], dir[1024];
        kvt_key_hex(&fp, hex);
        if (srv->store_dir) snprintf(dir, sizeof dir, "%s", srv->store_dir);
        else if (kvt_store_default_dir(dir, sizeof dir)) snprintf(dir, sizeof dir, "(default directory)");
        fprintf(stderr, "kvtier serve: block store %s, model fingerprint %.16s (hashed in %.0f ms)\n", dir, hex,
                mono_ms() - t0);
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
        kvt_store_close(sc->store); /* writes out what is queued */
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
    free(j->lp);
    json_decref(j->lp_json);
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
    if (j->kind != JOB_DELETE && srv->queue_per_key < srv->max_queue) { /* one key's share */
        int32_t mine = 0;
        for (struct job *q = srv->head; q; q = q->next) mine += q->kind != JOB_DELETE && !strcmp(q->ns, j->ns);
        if (mine >= srv->queue_per_key) {
            pthread_mutex_unlock(&srv->mu);
            return 430; /* 429 for the client: this key's share is full */
        }
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

void serve_job_error(struct job *j, int status, const char *type, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->err_msg, sizeof j->err_msg, fmt, ap);
    va_end(ap);
    j->http_status = status;
    snprintf(j->err_type, sizeof j->err_type, "%s", type);
    snprintf(j->err_code, sizeof j->err_code, "%s", code ? code : "");
}

void serve_job_lib_error(struct job *j, const char *what, int rc) {
    if (rc == KVT_ECTX || rc == KVT_EBUDGET)
        serve_job_error(j, 400, "invalid_request_error", "context_length_exceeded", "%s: %s", what, kvt_errmsg());
    else if (rc == KVT_EINVAL)
        serve_job_error(j, 400, "invalid_request_error", NULL, "%s: %s", what, kvt_errmsg());
    else
        serve_job_error(j, 500, "server_error", NULL, "%s: %s: %s", what, kvt_strerror(rc), kvt_errmsg());
}

/* "logprobs": the reply's logprobs.content (token text, ln p, UTF-8 bytes), built on the engine
** thread (it detokenizes) for the HTTP side to send. */
static void build_logprobs(struct server *srv, struct job *j) {
    if (!j->logprobs || !j->lp || j->lp_json) return;
    json_t *a = json_array();
    for (int32_t i = 0; a && i < j->n_gen; i++) {
        char *piece = NULL;
        if (kvt_detokenize(srv->eng, &j->gen[i], 1, false, &piece)) piece = NULL;
        json_t *bytes = json_array();
        for (const unsigned char *p = (const unsigned char *) (piece ? piece : ""); bytes && *p; p++)
            json_array_append_new(bytes, json_integer(*p));
        char *clean = app_utf8_clean(piece ? piece : "");
        json_array_append_new(a, json_pack("{s:s, s:f, s:o, s:[]}", "token", clean ? clean : "", "logprob", (double) j->lp[i],
                                           "bytes", bytes ? bytes : json_null(), "top_logprobs"));
        free(clean);
        free(piece);
    }
    j->lp_json = a;
}

/* ln softmax(l)[tok] over n_vocab logits */
static float log_prob(const float *l, int32_t n_vocab, kvt_token tok) {
    double mx = -INFINITY, z = 0;
    for (int32_t v = 0; v < n_vocab; v++) mx = fmax(mx, l[v]);
    for (int32_t v = 0; v < n_vocab; v++) z += exp(l[v] - mx);
    return (float) (l[tok] - mx - log(z));
}

static void finish(struct server *srv, struct job *j) {
    build_logprobs(srv, j);
    pthread_mutex_lock(&srv->mu);
    j->state = JOB_DONE;
    srv->m.active--;
    srv->m.prompt_tokens += j->prompt_tokens;
    srv->m.completion_tokens += j->completion_tokens;
    srv->m.prompt_reused += j->sync.tokens_reused;
    if (j->kind == JOB_CHAT && j->sync.route >= 0 && j->sync.route < 4) srv->m.route[j->sync.route]++;
    srv->m.prompt_from_store += j->sync.tokens_from_store;
    srv->m.prompt_from_chunks += j->sync.tokens_from_chunks;
    srv->m.prompt_decoded += j->sync.tokens_decoded;
    srv->m.evictions += j->sync.evictions;
    srv->m.recoveries += j->sync.recoveries;
    srv->m.recomputes += j->sync.recomputes;
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

/* lp: ln p of t (with logprobs) */
static int add_gen(struct job *j, kvt_token t, float lp) {
    if (j->n_gen == j->cap_gen) {
        int32_t cap = j->cap_gen ? 2 * j->cap_gen : 64;
        kvt_token *g = realloc(j->gen, sizeof *g * (size_t) cap);
        if (!g) return -1;
        j->gen = g;
        if (j->logprobs) {
            float *l = realloc(j->lp, sizeof *l * (size_t) cap);
            if (!l) return -1;
            j->lp = l;
        }
        j->cap_gen = cap;
    }
    if (j->logprobs) j->lp[j->n_gen] = lp;
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
    if (rc) { serve_job_lib_error(j, "prompt", rc); return false; }
    const int32_t n = j->prompt_tokens;
    j->sync.prompt_tokens = n;
    j->sync.tokens_decoded = n;
    j->finish = "length";
    j->seq = -1;
    if (n + j->max_tokens > srv->budget) {
        serve_job_error(j, 400, "invalid_request_error", "context_length_exceeded",
                  "the prompt is %d tokens and max_tokens %d; together they must fit the budget of %d tokens", n,
                  j->max_tokens, srv->budget);
        return false;
    }
    if (n == 0) {
        serve_job_error(j, 400, "invalid_request_error", NULL, "the prompt is empty (0 tokens)");
        return false;
    }
    j->cells = n + j->max_tokens;
    return true;
}

/* The completion leaves its sequence (its cells are freed) and gives back its reservation. */
static void end_completion(struct server *srv, struct job *j, int rc) {
    struct sched *sc = srv->sched;
    if (rc) serve_job_lib_error(j, "generation", rc);
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

/* The job's prompt is in: it joins the batch of running requests, and its stream may send its
** headers (HTTP side waits on j->cv for `started`). */
static void activate(struct server *srv, struct job *j) {
    struct sched *sc = srv->sched;
    pthread_mutex_lock(&srv->mu);
    j->started = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&srv->mu);
    sc->t_last[sc->n_active] = 0;
    sc->active[sc->n_active++] = j;
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
    sc->prefilling = j;
    for (int32_t off = 0; rc == 0 && off < n;) {
        int32_t m = KVT_MIN(n - off, srv->block);
        if (srv->batch_tokens > 0) { /* mixed: the chunk rides in a step of the active jobs */
            m = KVT_MIN(m, chunk_room(srv));
            const struct kvt_decode_chunk c = { j->seq, j->ptok + off, m, off, off + m == n };
            rc = chunk_decode(srv, &c);
            off += m;
            continue;
        }
        rc = job_stopped(srv, j) ? KVT_ECANCELED : kvt_decode(srv->eng, j->seq, j->ptok + off, m, off, off + m == n);
        off += m;
        if (rc == 0 && off < n) serve_on_chunk(srv);
    }
    sc->prefilling = NULL;
    const float *l = rc == 0 ? kvt_logits(srv->eng) : NULL;
    if (rc == 0 && !l) rc = KVT_ELLAMA;
    free(j->ptok);
    j->ptok = NULL;
    if (rc) {
        if (rc == KVT_ECANCELED && (j->timed_out || aborting(srv))) job_timeout_error(srv, j, "prefill");
        else serve_job_lib_error(j, "prompt", rc);
        end_completion(srv, j, 0);
        finish(srv, j);
        return false;
    }
    memcpy(j->row.logits, l, sizeof(float) * (size_t) I.n_vocab);
    j->row.seq = j->seq;
    j->row.pos = n;
    activate(srv, j);
    return true;
}

/* Start the waiting completions, in arrival order, while a scratch sequence is free and the
** cells they reserve fit the shared budget; a cancelled one leaves without running. */
static void start_waiting(struct server *srv) {
    struct sched *sc = srv->sched;
    int32_t w = 0; /* first, the ones whose client left, wherever they wait */
    for (int32_t k = 0; k < sc->n_wait; k++) {
        bool gone = job_stopped(srv, sc->wait[k]);
        if (gone && (sc->wait[k]->timed_out || aborting(srv))) job_timeout_error(srv, sc->wait[k], "waiting for a sequence");
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
            serve_job_error(j, 400, "invalid_request_error", NULL, "the tools / response_format schema could not be compiled to a grammar: %s",
                      kvt_errmsg());
            return PICK_OK;
        }
    }
    struct sess *x;
    enum pick p = admit_session(srv, j, &x);
    if (p == PICK_BUSY) return p;
    if (!x) {
        if (!j->http_status)
            serve_job_error(j, 503, "server_error", NULL, "every one of the %d session slots is generating", srv->max_sessions);
        return PICK_OK;
    }
    snprintf(j->out_session, sizeof j->out_session, "%s", x->id);
    x->last_used = wall_s();
    x->job = j; /* busy from here: its prompt is decoded with other jobs stepping in between */
    srv->sched->prefilling = j;
    int rc = kvt_session_sync(x->s, j->msgs, j->n_msgs, &j->sync);
    srv->sched->prefilling = NULL;
    j->sync.recoveries += j->resumed;
    j->prompt_tokens = j->sync.prompt_tokens;
    if (rc) {
        x->job = NULL;
        if (rc == KVT_ECANCELED && (j->timed_out || aborting(srv))) job_timeout_error(srv, j, "prefill");
        else serve_job_lib_error(j, "prompt", rc);
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
    if (rc) serve_job_lib_error(j, "generation", rc);
    int rc2 = kvt_session_gen_end(x->s, NULL);
    if (rc2 && !rc) serve_job_lib_error(j, "reply", rc2);
    struct kvt_session_stats st;
    kvt_session_get_stats(x->s, &st);
    j->resident_tokens = st.resident_tokens;
    j->completion_tokens = j->n_gen;
    x->job = NULL;
    x->last_used = wall_s();
}

/* One token for every active job, chats and completions, and the prefill chunk c of a job being
** admitted (NULL: none), all in one llama_decode (continuous batching with mixed prefill:
** kvt_session_gen_step_mixed, completions as raw rows).  Fills over[k] for the jobs whose reply
** ended.  Returns the number that ended; *drc: the shared decode's error (0: the chunk is in). */
static int32_t step_all(struct server *srv, struct job **active, int32_t n_active, double *t_last, bool *over,
                        const struct kvt_decode_chunk *c, int *drc) {
    kvt_session *ss[64] = { 0 };
    struct kvt_sampling smp[64] = { { 0 } };
    struct kvt_gen_row rows[64];
    kvt_token tok[64];
    bool done[64];
    int st[64];
    int64_t ev0[64], rec0[64];
    float *lpl[64] = { 0 }; /* with logprobs: the logits each job samples from */
    int32_t map[64], rmap[64], n = 0, n_rows = 0, n_over = 0;
    struct kvt_engine_info I;
    kvt_engine_info(srv->eng, &I);
    for (int32_t k = 0; k < n_active; k++) {
        struct job *j = active[k];
        over[k] = job_stopped(srv, j) || j->n_gen >= j->max_tokens; /* a deadline cuts the reply: "length" */
        if (over[k]) continue;
        const float *from = j->kind == JOB_COMPLETION ? j->row.logits : kvt_session_logits(((struct sess *) j->slot)->s);
        if (j->logprobs && from && (lpl[k] = malloc(sizeof(float) * (size_t) I.n_vocab)))
            memcpy(lpl[k], from, sizeof(float) * (size_t) I.n_vocab);
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
    int rc = n + n_rows > 0 || c ? kvt_session_gen_step_mixed(srv->eng, ss, n, smp, tok, done, st, rows, n_rows, c) : 0;
    if (drc) *drc = rc;
    /* the decode rows that went in (sampled tokens that did not end a generation) */
    int32_t n_dec = 0;
    for (int32_t i = 0; rc == 0 && i < n; i++) n_dec += !st[i] && !done[i];
    for (int32_t i = 0; rc == 0 && i < n_rows; i++) n_dec += !rows[i].status && !rows[i].done;
    const int32_t n_chunk = c ? c->n : 0;
    if (rc == 0 && n_dec + n_chunk > 0) {
        pthread_mutex_lock(&srv->mu);
        srv->m.steps++;
        srv->m.step_tokens += n_dec + n_chunk;
        if (n_chunk > 0 && n_dec > 0) {
            srv->m.mixed_steps++;
            srv->m.mixed_prefill_tokens += n_chunk;
        }
        pthread_mutex_unlock(&srv->mu);
    }
    const bool shared = n_dec + (n_chunk > 0) > 1; /* another request's tokens were in this llama_decode */
    for (int32_t i = 0; i < n; i++) {
        struct job *j = active[map[i]];
        struct kvt_session_stats s1;
        kvt_session_get_stats(ss[i], &s1);
        j->sync.evictions += s1.evictions - ev0[i];
        j->sync.recoveries += s1.recoveries - rec0[i];
        int r = rc ? rc : st[i];
        if (r) { end_chat(srv, j, r); over[map[i]] = true; continue; }
        if (done[i]) { j->finish = "stop"; over[map[i]] = true; continue; }
        j->shared_steps += shared;
        float lp = lpl[map[i]] ? log_prob(lpl[map[i]], I.n_vocab, tok[i]) : 0;
        if (add_gen(j, tok[i], lp)) { end_chat(srv, j, KVT_ENOMEM); over[map[i]] = true; continue; }
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
        j->shared_steps += shared;
        float lp = lpl[rmap[i]] ? log_prob(lpl[rmap[i]], I.n_vocab, rows[i].tok) : 0;
        if (add_gen(j, rows[i].tok, lp)) { end_completion(srv, j, KVT_ENOMEM); over[rmap[i]] = true; continue; }
        note_token(srv, j, &t_last[rmap[i]]);
        if (update_text(srv, j, srv->eng)) { j->finish = "stop"; over[rmap[i]] = true; }
        else if (j->n_gen >= j->max_tokens) over[rmap[i]] = true;
    }
    for (int32_t k = 0; k < n_active; k++) {
        free(lpl[k]);
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
    srv->m.pool_dropped = ps.n_dropped;
    srv->m.have_store = sc->store != NULL;
    if (sc->store) {
        kvt_store_get_stats(sc->store, &srv->m.store);
        srv->m.pool_ram = srv->m.store.priv.ram_bytes; /* the store holds evicted blocks */
        srv->m.pool_spill = srv->m.store.priv.spill_bytes;
        srv->m.pool_dropped = srv->m.store.priv.n_dropped;
    }
    pthread_mutex_unlock(&srv->mu);
}

/* One batched step of the active jobs, with the prefill chunk c (NULL: none) in the same
** llama_decode; finished ones leave the set.  Returns true if any did; *drc: the decode's error. */
static bool step_active(struct server *srv, const struct kvt_decode_chunk *c, int *drc) {
    struct sched *sc = srv->sched;
    bool over[64];
    if (drc) *drc = 0;
    if (sc->n_active == 0 && !c) return false;
    if (step_all(srv, sc->active, sc->n_active, sc->t_last, over, c, drc) == 0) return false;
    int32_t w = 0;
    for (int32_t k = 0; k < sc->n_active; k++) {
        if (over[k]) { finish(srv, sc->active[k]); continue; }
        sc->active[w] = sc->active[k];
        sc->t_last[w++] = sc->t_last[k];
    }
    sc->n_active = w;
    return true;
}

/* Between the prefill chunks of an admitted job (--batch-tokens 0): the others keep generating. */
void serve_on_chunk(void *ud) {
    if (step_active(ud, NULL, NULL)) publish(ud);
}

/* The tokens the next prefill chunk may take: --batch-tokens less one per active job (each
** decodes one token in the same step), at least 1. */
static int32_t chunk_room(void *ud) {
    struct server *srv = ud;
    return KVT_MAX(1, srv->batch_tokens - srv->sched->n_active);
}

/* A prefill chunk rides in a step of the active jobs: one llama_decode for all.  Except the last
** chunk of what is being prefilled (it wants logits): the step right after the prefill decodes
** every active job AND the new one, so a step here too would cost the active jobs one more
** pass over the weights per admitted request for no token of the new one (measured: 187 steps
** instead of 160 for the same decode tokens, docs/BENCHMARKS.md).  With one KV stream per
** sequence llama.cpp runs the chunk as a ubatch of its own anyway (kvt_decode_mixed), so mixing
** it saves the call, not the weight pass.  The
** steps between chunks are thus exactly those of --batch-tokens 0, each merged with a chunk. */
static int chunk_decode(void *ud, const struct kvt_decode_chunk *c) {
    struct server *srv = ud;
    int rc = 0;
    /* a prompt whose client left or whose deadline passed stops between chunks: the session
    ** keeps what was decoded before (kvt_prefill_hooks: the prefill fails with this error) */
    if (srv->sched->prefilling && job_stopped(srv, srv->sched->prefilling)) return KVT_ECANCELED;
    if (c->want_logits) {
        rc = kvt_decode(srv->eng, c->seq, c->tokens, c->n, c->pos0, true);
        pthread_mutex_lock(&srv->mu);
        if (rc == 0) srv->m.prefill_alone_tokens += c->n;
        pthread_mutex_unlock(&srv->mu);
        return rc;
    }
    if (step_active(srv, c, &rc)) publish(srv);
    return rc;
}

void serve_session_hooks(struct server *srv, kvt_session *s) {
    if (srv->batch_tokens > 0) {
        const struct kvt_prefill_hooks h = { chunk_room, chunk_decode, srv };
        kvt_session_set_prefill_hooks(s, &h);
    } else {
        kvt_session_set_chunk_cb(s, serve_on_chunk, srv);
    }
}

/* Chat jobs left waiting in the queue (--parallel busy, their session generating): their prompts'
** blocks are prefetched into the store's RAM tier once each (admit_prefetch), so that the disk and
** Redis reads happen while they wait, not after admission.  A reference keeps each job alive
** while it is tokenized outside the lock. */
static void prefetch_queued(struct server *srv) {
    struct job *pf[16];
    int n = 0;
    pthread_mutex_lock(&srv->mu);
    for (struct job *j = srv->head; j && n < 16; j = j->next)
        if (j->kind == JOB_CHAT && !j->prefetched && !j->cancelled) {
            j->prefetched = true;
            j->refs++;
            pf[n++] = j;
        }
    pthread_mutex_unlock(&srv->mu);
    for (int k = 0; k < n; k++) {
        admit_prefetch(srv, pf[k]);
        serve_job_release(srv, pf[k]);
    }
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
                bool take = j->kind == JOB_DELETE || (sc->n_active + sc->n_wait + n_adm < srv->parallel && admit_runnable(srv, j));
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
                admit_delete(srv, j);
                pthread_mutex_lock(&srv->mu);
                j->state = JOB_DONE;
                pthread_cond_broadcast(&j->cv);
                release_locked(j);
                pthread_mutex_unlock(&srv->mu);
                continue;
            }
            bool gone = job_stopped(srv, j); /* its client left while it was queued, or its time is up */
            if (gone && (j->timed_out || aborting(srv))) job_timeout_error(srv, j, "queued");
            if (gone) { j->finish = "stop"; finish(srv, j); continue; }
            if (j->kind == JOB_COMPLETION) {
                if (prepare_completion(srv, j)) sc->wait[sc->n_wait++] = j;
                else finish(srv, j);
                continue;
            }
            if (start_chat(srv, j) == PICK_BUSY) { requeue(srv, j); continue; }
            if (!j->slot) { finish(srv, j); continue; }
            activate(srv, j);
        }
        start_waiting(srv);
        if (srv->prefetch && sc->store) prefetch_queued(srv);
        if (n_adm > 0) publish(srv);
        /* one token for every active job, one batched decode */
        bool ended = step_active(srv, NULL, NULL);
        if (ended) publish(srv);
    }
    pthread_mutex_lock(&srv->mu);
    srv->engine_done = true;
    pthread_mutex_unlock(&srv->mu);
    return NULL;
}
