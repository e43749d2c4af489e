/* sched.c — the engine thread of `kvtier serve`: owns the kvt_engine, the host pool and
** every session; takes jobs from the queue (queue.c) and runs them: chats here (their sessions
** are chosen in admit.c), completions in completion.c, every token in a step (step.c).
**
** Scheduling: up to --parallel jobs, chats and completions alike, are active at once; every
** scheduler step generates one token for each of them in ONE llama_decode
** (kvt_session_gen_step_batch: continuous batching; a job joins or leaves the batch between
** steps).  A job's prompt (for a chat, the new tail after the session's cached prefix) is
** prefilled when the job is admitted, in chunks of at most one block, and each chunk but the
** last rides in a step: ONE llama_decode holds every active job's next decode token AND the
** chunk (mixed prefill and decode, as llama-server and vLLM schedule chunked prefill), the chunk
** cut so that the step holds at most --batch-tokens tokens (a session hands out its chunks,
** kvt_session_prefill; completions cut theirs in completion.c).  The last chunk goes alone: the
** step after the prefill takes the new job too (see serve_prefill_decode).  A long prefill thus
** never stalls the generating jobs.  --batch-tokens 0: the older schedule, each chunk decoded
** alone with a batched step of the active jobs between chunks (serve_prefill_between).
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
    ep.n_gpu_layers = srv->n_gpu_layers;
    ep.flash_attn = srv->flash_attn;
    ep.no_op_offload = srv->no_op_offload;
    ep.chat_template = srv->chat_template;
    ep.verbose = srv->verbose;
    if (srv->n_batch > 0) ep.n_batch = srv->n_batch;
    if (srv->n_ubatch > 0) ep.n_ubatch = srv->n_ubatch;
    int rc = kvt_engine_open(&ep, &srv->eng);
    if (rc) {
        app_fail("kvtier serve", "cannot open the model", rc);
        serve_engine_close(srv);
        return APP_ERR;
    }
    struct kvt_engine_info ei;
    kvt_engine_info(srv->eng, &ei);
    sc->comp_cache = !ei.kv_unified && ei.n_swa == 0;
    if ((rc = app_codec_bits("kvtier serve", srv->eng, srv->codec_bits, &sc->head_bits, &sc->n_head_bits))) {
        serve_engine_close(srv);
        return APP_ERR;
    }
    sc->ram_bits = sc->head_bits && app_codec_takes_bits(srv->codec_ram);
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
        if (sc->head_bits && app_codec_takes_bits(srv->codec_disk)) {
            stp.disk_codec_bits = sc->head_bits;
            stp.n_disk_codec_bits = sc->n_head_bits;
        }
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
        double t0 = serve_mono_ms();
        if ((rc = kvt_engine_fingerprint(srv->eng, &fp))) {
            app_fail("kvtier serve", "cannot fingerprint the model for the block store (--no-store runs without one)", rc);
            serve_engine_close(srv);
            return APP_ERR;
        }
        char hex[2 * KVT_KEY_BYTES + 1];
        kvt_key_hex(&fp, hex);
        const char *dir = serve_store_dir(srv);
        fprintf(stderr, "kvtier serve: block store %s, model fingerprint %.16s (hashed in %.0f ms)\n", dir ? dir : "(none)", hex,
                serve_mono_ms() - t0);
    }
    struct kvt_engine_info I;
    kvt_engine_info(srv->eng, &I);
    if (!srv->model_name[0]) snprintf(srv->model_name, sizeof srv->model_name, "%s", I.name[0] ? I.name : I.desc);
    return APP_OK;
}

const char *serve_store_dir(struct server *srv) {
    if (!srv->sched || !srv->sched->store) return NULL;
    struct kvt_store_stats st;
    kvt_store_get_stats(srv->sched->store, &st);
    return st.dir;
}

void serve_engine_close(struct server *srv) {
    struct sched *sc = srv->sched;
    if (sc) {
        for (int32_t i = 0; sc->sess && i < sc->cap; i++) kvt_session_free(sc->sess[i].s);
        free(sc->sess);
        kvt_pool_free(sc->pool);
        kvt_store_free(sc->store); /* writes out what is queued */
        free(sc->head_bits);
        free(sc->active);
        free(sc->t_last);
        free(sc->wait);
        for (int32_t q = 0; q < SERVE_MAX_SEQ; q++) free(sc->comp_tok[q]);
        free(sc);
        srv->sched = NULL;
    }
    kvt_engine_free(srv->eng);
    srv->eng = NULL;
}

/* Tokens of the session's conversation so far. */
static int32_t sess_tokens(const struct sess *x) {
    struct kvt_session_stats st;
    kvt_session_get_stats(x->s, &st);
    return st.total_tokens;
}

/* Choose the chat's session and decode its prompt there.  Returns PICK_OK (j->slot is set unless
** the job failed: it has its error), or PICK_BUSY: the session it names is generating, the job
** must wait (serve_job_requeue). */
static enum pick start_chat(struct server *srv, struct job *j) {
    if (serve_job_grammar(srv, j)) return PICK_OK; /* the job has its error */
    struct sess *x;
    enum pick p = admit_session(srv, j, &x);
    if (p == PICK_BUSY) return p;
    if (!x) {
        if (!j->err.status)
            serve_error_set(&j->err, 503, "server_error", NULL, "every one of the %d session slots is generating",
                            srv->max_sessions);
        return PICK_OK;
    }
    snprintf(j->out_session, sizeof j->out_session, "%s", x->id);
    x->last_used = serve_wall_s();
    x->job = j; /* busy from here: its prompt is decoded with other jobs stepping in between */
    /* the session hands out its prompt's chunks; each is decoded here, in a step of the active
    ** jobs or alone (step.c), and handed back */
    /* the request's template tokens, computed once for admission, are the session's too (it
    ** checks they are its text's and tokenizes what they cannot give) */
    const kvt_token *ptok = NULL;
    int32_t n_ptok = 0;
    if (admit_request_tokens(srv, j, &ptok, &n_ptok)) ptok = NULL, n_ptok = 0;
    kvt_prefill *pf = NULL;
    int rc = kvt_session_prefill(x->s, j->req.msgs, j->req.n_msgs, ptok, n_ptok, &pf);
    memset(&j->sync, 0, sizeof j->sync);
    /* return_progress: the prompt's tokens (the template's, as admission counted them), the
    ** stream's length when the first chunk is handed out (the kept prefix and the blocks loaded
    ** from the store: llama-server's "cache"), then after each chunk */
    const int32_t total = j->req.return_progress && j->req.stream ? n_ptok : 0;
    if (rc == 0) {
        struct kvt_decode_chunk c;
        bool first = true;
        while ((rc = kvt_prefill_next(pf, serve_prefill_room(srv), &c)) == 1) {
            if (first && total > 0) serve_job_progress(srv, j, total, sess_tokens(x), 0); /* the 0 % event: processed = cache */
            first = false;
            if (kvt_prefill_done(pf, serve_prefill_decode(srv, j, &c))) break;
            if (total > 0) serve_job_progress(srv, j, total, 0, sess_tokens(x));
            serve_prefill_between(srv, &c);
        }
        rc = kvt_prefill_end(pf, &j->sync);
        /* the prompt is in (a turn with nothing to decode gets its one event here) */
        const int32_t all = total > 0 ? total : j->sync.prompt_tokens;
        if (rc == 0 && first && j->req.return_progress) serve_job_progress(srv, j, all, all, all);
        else if (rc == 0 && j->req.return_progress) serve_job_progress(srv, j, all, 0, all);
    }
    j->sync.recoveries += j->resumed;
    j->prompt_tokens = j->sync.prompt_tokens;
    if (rc) {
        x->job = NULL;
        if (rc == KVT_ECANCELED && (j->timed_out || serve_aborting(srv))) serve_job_timeout_error(srv, j, "prefill");
        else serve_error_lib(&j->err, "prompt", rc);
        return PICK_OK;
    }
    j->slot = x;
    j->finish = "length";
    return PICK_OK;
}

/* The job's reply is over (end of generation, stop string, max_tokens, cancelled or an error):
** close the reply in the session. */
void serve_chat_end(struct server *srv, struct job *j, int rc) {
    struct sess *x = j->slot;
    (void) srv;
    if (rc) serve_error_lib(&j->err, "generation", rc);
    int rc2 = kvt_session_gen_end(x->s, NULL);
    if (rc2 && !rc) serve_error_lib(&j->err, "reply", rc2);
    struct kvt_session_stats st;
    kvt_session_get_stats(x->s, &st);
    j->resident_tokens = st.resident_tokens;
    j->completion_tokens = j->n_gen;
    x->job = NULL;
    x->last_used = serve_wall_s();
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
    serve_publish(srv);
    for (;;) {
        struct job *adm[64];
        int32_t n_adm = 0;
        pthread_mutex_lock(&srv->mu);
        for (;;) {
            struct job **pp = &srv->head, *prev = NULL;
            while (*pp && n_adm < 64) {
                struct job *j = *pp;
                const bool room = sc->n_active + sc->n_wait + n_adm < srv->parallel;
                bool take = j->kind == JOB_DELETE || (room && admit_runnable(srv, j));
                /* one job per named session per round, so two queued turns of one session run in order */
                for (int32_t k = 0; take && k < n_adm; k++) take = !serve_same_session(adm[k], j);
                if (room) j->blocked = !take; /* a free slot would not start it: serve_submit counts it waiting */
                if (!take) {
                    prev = j;
                    pp = &j->next;
                    continue;
                }
                *pp = j->next;
                if (srv->tail == j) srv->tail = prev;
                srv->n_queued--;
                j->state = JOB_RUNNING;
                if (j->kind != JOB_DELETE) {
                    srv->m.active++;
                    j->run_next = srv->running;
                    srv->running = j;
                }
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
                serve_publish(srv); /* GET /v1/sessions right after the answer must not list it */
                pthread_mutex_lock(&srv->mu);
                j->state = JOB_DONE;
                pthread_cond_broadcast(&j->cv);
                serve_job_release_locked(j);
                pthread_mutex_unlock(&srv->mu);
                continue;
            }
            bool gone = serve_job_stopped(srv, j); /* its client left while it was queued, or its time is up */
            if (gone && (j->timed_out || serve_aborting(srv))) serve_job_timeout_error(srv, j, "queued");
            if (gone) {
                j->finish = "stop";
                serve_job_finish(srv, j);
                continue;
            }
            if (j->kind == JOB_COMPLETION) {
                if (serve_completion_prepare(srv, j)) sc->wait[sc->n_wait++] = j;
                else serve_job_finish(srv, j);
                continue;
            }
            if (start_chat(srv, j) == PICK_BUSY) {
                serve_job_requeue(srv, j);
                continue;
            }
            if (!j->slot) {
                serve_job_finish(srv, j);
                continue;
            }
            j->end = serve_chat_end;
            serve_job_activate(srv, j);
        }
        serve_completion_start_waiting(srv);
        if (srv->prefetch && sc->store) prefetch_queued(srv);
        if (n_adm > 0) serve_publish(srv);
        /* one token for every active job, one batched decode */
        bool ended = serve_step_active(srv, NULL, NULL);
        if (ended) serve_publish(srv);
    }
    pthread_mutex_lock(&srv->mu);
    srv->engine_done = true;
    pthread_mutex_unlock(&srv->mu);
    return NULL;
}
