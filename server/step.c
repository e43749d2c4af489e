/* step.c — one scheduler step of `kvtier serve` (engine thread): a token for every active job,
** chats and completions, and the prefill chunk of a job being admitted, in ONE llama_decode
** (kvt_session_gen_step_batch); the reply text, stop strings, logprobs, TTFT and per-token
** times; the decode of prefill chunks; the gauges published for /v1/sessions and /metrics.
** sched.c says how the steps are scheduled. */
#include "sched.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static float log_prob(const float *l, int32_t n_vocab, kvt_token tok) {
    double mx = -INFINITY, z = 0;
    for (int32_t v = 0; v < n_vocab; v++) mx = fmax(mx, l[v]);
    for (int32_t v = 0; v < n_vocab; v++) z += exp(l[v] - mx);
    return (float) (l[tok] - mx - log(z));
}
void serve_job_finish(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    j->state = JOB_DONE;
    srv->m.active--;
    serve_running_remove(srv, j);
    srv->m.prompt_tokens += j->prompt_tokens;
    srv->m.completion_tokens += j->completion_tokens;
    srv->m.prompt_reused += j->sync.tokens_reused;
    if (j->kind == JOB_CHAT && j->sync.route >= 0 && j->sync.route < 4) srv->m.route[j->sync.route]++;
    srv->m.prompt_from_store += j->sync.tokens_from_store;
    srv->m.prompt_from_chunks += j->sync.tokens_from_chunks;
    srv->m.prompt_decoded += j->sync.tokens_decoded;
    if (j->t_first > 0) { /* llama-server's prompt and generation times (ms) */
        srv->m.prompt_ms += j->t_first - j->req.t_arrival;
        srv->m.predicted_ms += serve_mono_ms() - j->t_first;
    }
    srv->m.n_tokens_max = KVT_MAX(srv->m.n_tokens_max, (int64_t) j->prompt_tokens + j->completion_tokens);
    srv->m.evictions += j->sync.evictions;
    srv->m.recoveries += j->sync.recoveries;
    srv->m.recomputes += j->sync.recomputes;
    pthread_cond_broadcast(&j->cv);
    serve_job_release_locked(j);
    pthread_mutex_unlock(&srv->mu);
}
/* Append the new token's text; apply stop strings.  Returns true when a stop string ended the reply. */
static bool update_text(struct server *srv, struct job *j, kvt_engine *eng) {
    char *t = NULL;
    if (kvt_detokenize(eng, j->gen, j->n_gen, false, &t)) return false;
    size_t n = strlen(t);
    bool stopped = false;
    size_t hold = 0;
    for (int32_t i = 0; i < j->req.n_stop; i++) {
        char *p = strstr(t, j->req.stop[i]);
        if (p) {
            n = KVT_MIN(n, (size_t) (p - t));
            stopped = true;
        }
        hold = KVT_MAX(hold, strlen(j->req.stop[i]) - 1);
    }
    pthread_mutex_lock(&srv->mu);
    free(j->text);
    t[n] = '\0';
    j->text = t;
    j->n_gen_pub = j->n_gen;
    /* published bytes: hold back what could still become a stop string */
    j->n_text = stopped ? n : (n > hold ? n - hold : 0);
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&srv->mu);
    return stopped;
}
/* lp: ln p of t (with logprobs) */
/* Append a generated token, its ln p and, with top_logprobs, the K most likely tokens of the
** logits it was sampled from (NULL without logprobs). */
static int add_gen(struct server *srv, struct job *j, kvt_token t, float lp, const float *logits, int32_t n_vocab) {
    const int32_t K = j->req.top_logprobs;
    if (j->n_gen == j->cap_gen) {
        /* under srv->mu: a streamed reply's connection copies the ids and ln p it has not sent */
        pthread_mutex_lock(&srv->mu);
        int rc = 0;
        int32_t cap = j->cap_gen ? 2 * j->cap_gen : 64;
        kvt_token *g = realloc(j->gen, sizeof *g * (size_t) cap);
        if (g) j->gen = g;
        else rc = -1;
        if (rc == 0 && j->req.logprobs) {
            float *l = realloc(j->lp, sizeof *l * (size_t) cap);
            if (l) j->lp = l;
            else rc = -1;
        }
        if (rc == 0 && j->req.logprobs && K > 0) {
            kvt_token *tt = realloc(j->top_tok, sizeof *tt * (size_t) cap * (size_t) K);
            if (tt) j->top_tok = tt;
            float *tl = tt ? realloc(j->top_lp, sizeof *tl * (size_t) cap * (size_t) K) : NULL;
            if (tl) j->top_lp = tl;
            else rc = -1;
        }
        if (rc == 0) j->cap_gen = cap;
        pthread_mutex_unlock(&srv->mu);
        if (rc) return -1;
    }
    if (j->req.logprobs && j->post) { /* post_sampling: the distribution the samplers drew t from */
        j->lp[j->n_gen] = j->post[0].tok == t && j->post[0].p > 0 ? logf(j->post[0].p) : -INFINITY;
        for (int32_t k = 0; k < K; k++) {
            const struct kvt_token_p *c = &j->post[1 + k];
            j->top_tok[(size_t) j->n_gen * K + k] = c->p > 0 ? c->tok : -1;
            j->top_lp[(size_t) j->n_gen * K + k] = c->p > 0 ? logf(c->p) : -INFINITY;
        }
    } else if (j->req.logprobs) j->lp[j->n_gen] = lp;
    if (j->req.logprobs && K > 0 && !j->post) {
        kvt_token *tt = j->top_tok + (size_t) j->n_gen * K;
        float *tl = j->top_lp + (size_t) j->n_gen * K;
        int32_t n = 0;
        double mx = -INFINITY, z = 0;
        for (int32_t v = 0; logits && v < n_vocab; v++) mx = fmax(mx, logits[v]);
        for (int32_t v = 0; logits && v < n_vocab; v++) {
            z += exp(logits[v] - mx);
            if (n == K && logits[v] <= tl[K - 1]) continue; /* keep the K largest, sorted */
            int32_t p = n < K ? n++ : K - 1;
            while (p > 0 && tl[p - 1] < logits[v]) {
                tl[p] = tl[p - 1];
                tt[p] = tt[p - 1];
                p--;
            }
            tl[p] = logits[v];
            tt[p] = v;
        }
        for (int32_t k = 0; k < n; k++) tl[k] = (float) (tl[k] - mx - log(z));
        for (int32_t k = n; k < K; k++) tt[k] = 0, tl[k] = -INFINITY;
    }
    j->gen[j->n_gen++] = t;
    return 0;
}
static void note_token(struct server *srv, struct job *j, double *t_last) {
    double now = serve_mono_ms();
    pthread_mutex_lock(&srv->mu);
    /* a streamed reply with logprobs: the new token's ids and ln p are complete; its connection
    ** builds the entry (serve_logprobs_take) */
    if (j->req.logprobs && j->req.stream) j->n_lp_ready = j->n_gen;
    if (j->t_first == 0) {
        j->t_first = now;
        serve_hist_add(&srv->m.ttft, now - j->req.t_arrival);
    } else {
        serve_hist_add(&srv->m.per_token, now - *t_last);
    }
    pthread_mutex_unlock(&srv->mu);
    *t_last = now;
}
void serve_job_progress(struct server *srv, struct job *j, int32_t total, int32_t cache, int32_t processed) {
    if (!j->req.return_progress || !j->req.stream) return;
    const double now = serve_mono_ms();
    pthread_mutex_lock(&srv->mu);
    const struct prompt_progress *last = j->n_prog ? &j->prog[j->n_prog - 1] : NULL;
    processed = KVT_MIN(processed, total);
    if (last && processed <= last->processed) goto out;
    if (j->n_prog == j->cap_prog) {
        int32_t cap = j->cap_prog ? 2 * j->cap_prog : 16;
        struct prompt_progress *p = realloc(j->prog, sizeof *p * (size_t) cap);
        if (!p) goto out;
        j->prog = p;
        j->cap_prog = cap;
        last = j->n_prog ? &j->prog[j->n_prog - 1] : NULL;
    }
    /* the first event is the 0 % one, before any token is decoded: prompt time counts from it */
    const double t = now - j->req.t_arrival;
    j->prog[j->n_prog++] = (struct prompt_progress){
        .total = total,
        .cache = last ? last->cache : KVT_MIN(cache, total),
        .processed = last ? processed : KVT_MIN(cache, total),
        .time_ms = t,
        .prompt_ms = last ? KVT_MAX(t - j->prog[0].time_ms, last->prompt_ms) : 0,
    };
    pthread_cond_broadcast(&j->cv);
out:
    pthread_mutex_unlock(&srv->mu);
}
/* The job's prompt is in: it joins the batch of running requests, and its stream may send its
** headers (HTTP side waits on j->cv for `started`). */
void serve_job_activate(struct server *srv, struct job *j) {
    struct sched *sc = srv->sched;
    pthread_mutex_lock(&srv->mu);
    j->started = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&srv->mu);
    sc->t_last[sc->n_active] = 0;
    sc->active[sc->n_active++] = j;
}
/* One token for every active job, chats and completions, and the prefill chunk c of a job being
** admitted (NULL: none), all in one llama_decode (continuous batching with mixed prefill:
** kvt_session_gen_step_batch, completions as raw rows).  Fills over[k] for the jobs whose reply
** ended.  Returns the number that ended; *drc: the shared decode's error (0: the chunk is in). */
static int32_t step_all(struct server *srv, struct job **active, int32_t n_active, double *t_last, bool *over,
                        const struct kvt_decode_chunk *c, int *drc) {
    kvt_session *ss[64] = { 0 };
    struct kvt_sampling smp[64] = { { 0 } };
    struct kvt_gen_row rows[64];
    kvt_token tok[64];
    bool done[64], last[64];
    int st[64];
    int64_t ev0[64], rec0[64];
    float *lpl[64] = { 0 }; /* with logprobs: the logits each job samples from */
    int32_t map[64], rmap[64], n = 0, n_rows = 0, n_over = 0;
    struct kvt_engine_info I;
    kvt_engine_info(srv->eng, &I);
    for (int32_t k = 0; k < n_active; k++) {
        struct job *j = active[k];
        over[k] = serve_job_stopped(srv, j) || j->n_gen >= j->req.max_tokens; /* a deadline cuts the reply: "length" */
        if (over[k]) continue;
        const float *from = j->kind == JOB_COMPLETION ? j->row.logits : kvt_session_logits(((struct sess *) j->slot)->s);
        if (j->req.logprobs && j->req.post_sampling && j->req.top_logprobs > 0 && !j->post)
            j->post = calloc((size_t) j->req.top_logprobs + 1, sizeof *j->post); /* out of memory: the model's probabilities */
        if (j->req.logprobs && !j->post && from && (lpl[k] = malloc(sizeof(float) * (size_t) I.n_vocab)))
            memcpy(lpl[k], from, sizeof(float) * (size_t) I.n_vocab);
        struct kvt_sampling one = j->req.smp; /* draw n_gen of the reply: the session and the row count it */
        if (j->post) one.post = j->post, one.n_post = j->req.top_logprobs;
        /* the reply's last token (max_tokens) is sampled and not decoded: nothing reads its logits */
        const bool final = j->n_gen + 1 >= j->req.max_tokens;
        if (j->kind == JOB_COMPLETION && j->pen) { /* the window: the prompt's last tokens, then the reply's */
            const int32_t win = serve_history_window(&j->req.smp), g = KVT_MIN(j->n_gen, win), p = KVT_MIN(j->n_pen, win - g);
            kvt_token *w = j->pen + win;
            if (p > 0) memcpy(w, j->pen + (j->n_pen - p), sizeof *w * (size_t) p);
            if (g > 0) memcpy(w + p, j->gen + (j->n_gen - g), sizeof *w * (size_t) g);
            one.history = w;
            one.n_history = p + g;
        }
        if (j->kind == JOB_COMPLETION) {
            rows[n_rows] = j->row;
            rows[n_rows].smp = one;
            rows[n_rows].last = final;
            rmap[n_rows++] = k;
            continue;
        }
        struct sess *x = j->slot;
        struct kvt_session_stats s0;
        kvt_session_get_stats(x->s, &s0);
        ev0[n] = s0.evictions;
        rec0[n] = s0.recoveries;
        ss[n] = x->s;
        smp[n] = one;
        last[n] = final;
        map[n++] = k;
    }
    int rc = n + n_rows > 0 || c
                 ? kvt_session_gen_step_batch(srv->eng, &(struct kvt_gen_batch){ ss, n, smp, tok, done, st, rows, n_rows, c, last })
                 : 0;
    if (drc) *drc = rc;
    /* the decode rows that went in (sampled tokens that did not end a generation) */
    int32_t n_dec = 0;
    for (int32_t i = 0; rc == 0 && i < n; i++) n_dec += !st[i] && !done[i] && !last[i];
    for (int32_t i = 0; rc == 0 && i < n_rows; i++) n_dec += !rows[i].status && !rows[i].done && !rows[i].last;
    const int32_t n_chunk = c ? c->n : 0;
    if (rc == 0 && n_dec + n_chunk > 0) {
        pthread_mutex_lock(&srv->mu);
        srv->m.steps++;
        srv->m.step_tokens += n_dec + n_chunk;
        srv->m.decode_rows += n_dec;
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
        if (r) {
            j->end(srv, j, r);
            over[map[i]] = true;
            continue;
        }
        if (done[i]) {
            j->finish = "stop";
            over[map[i]] = true;
            continue;
        }
        j->shared_steps += shared;
        float lp = lpl[map[i]] ? log_prob(lpl[map[i]], I.n_vocab, tok[i]) : 0;
        if (add_gen(srv, j, tok[i], lp, lpl[map[i]], I.n_vocab)) {
            j->end(srv, j, KVT_ENOMEM);
            over[map[i]] = true;
            continue;
        }
        note_token(srv, j, &t_last[map[i]]);
        if (update_text(srv, j, srv->eng)) {
            j->finish = "stop";
            j->stop_word = true;
            over[map[i]] = true;
        } else if (j->n_gen >= j->req.max_tokens) over[map[i]] = true;
    }
    for (int32_t i = 0; i < n_rows; i++) {
        struct job *j = active[rmap[i]];
        j->row.pos = rows[i].pos; /* the logits were written in place */
        j->row.n_gen = rows[i].n_gen;
        int r = rc ? rc : rows[i].status;
        if (r) {
            j->end(srv, j, r);
            over[rmap[i]] = true;
            continue;
        }
        if (rows[i].done) {
            j->finish = "stop";
            over[rmap[i]] = true;
            continue;
        }
        j->shared_steps += shared;
        float lp = lpl[rmap[i]] ? log_prob(lpl[rmap[i]], I.n_vocab, rows[i].tok) : 0;
        if (add_gen(srv, j, rows[i].tok, lp, lpl[rmap[i]], I.n_vocab)) {
            j->end(srv, j, KVT_ENOMEM);
            over[rmap[i]] = true;
            continue;
        }
        note_token(srv, j, &t_last[rmap[i]]);
        if (update_text(srv, j, srv->eng)) {
            j->finish = "stop";
            j->stop_word = true;
            over[rmap[i]] = true;
        } else if (j->n_gen >= j->req.max_tokens) over[rmap[i]] = true;
    }
    for (int32_t k = 0; k < n_active; k++) {
        free(lpl[k]);
        if (!over[k]) continue;
        n_over++;
        struct job *j = active[k];
        if (j->kind == JOB_COMPLETION || (j->slot && ((struct sess *) j->slot)->job == j)) j->end(srv, j, 0);
    }
    return n_over;
}
/* Sessions and gauges for GET /v1/sessions and /metrics. */
void serve_publish(struct server *srv) {
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
bool serve_step_active(struct server *srv, const struct kvt_decode_chunk *c, int *drc) {
    struct sched *sc = srv->sched;
    bool over[64];
    if (drc) *drc = 0;
    if (sc->n_active == 0 && !c) return false;
    if (step_all(srv, sc->active, sc->n_active, sc->t_last, over, c, drc) == 0) return false;
    int32_t w = 0;
    for (int32_t k = 0; k < sc->n_active; k++) {
        if (over[k]) {
            serve_job_finish(srv, sc->active[k]);
            continue;
        }
        sc->active[w] = sc->active[k];
        sc->t_last[w++] = sc->t_last[k];
    }
    sc->n_active = w;
    return true;
}
int32_t serve_prefill_room(struct server *srv) {
    return srv->batch_tokens > 0 ? KVT_MAX(1, srv->batch_tokens - srv->sched->n_active) : 0;
}
/* A prefill chunk rides in a step of the active jobs: one llama_decode for all.  Except the last
** chunk of what is being prefilled (it wants logits): the step right after the prefill decodes
** every active job AND the new one, so a step here too would cost the active jobs one more
** pass over the weights per admitted request for no token of the new one (measured: 187 steps
** instead of 160 for the same decode tokens, docs/BENCHMARKS.md).  With one KV stream per
** sequence llama.cpp runs the chunk as a ubatch of its own anyway (kvt_engine_decode_batch), so
** mixing it saves the call, not the weight pass.  The steps between chunks are thus exactly
** those of --batch-tokens 0, each merged with a chunk. */
int serve_prefill_decode(struct server *srv, struct job *j, const struct kvt_decode_chunk *c) {
    /* a prompt whose client left or whose deadline passed stops between chunks: what was
    ** decoded before stays (a chat's message is undone by its session, kvt_prefill_done) */
    if (serve_job_stopped(srv, j)) return KVT_ECANCELED;
    int rc = 0;
    if (srv->batch_tokens > 0 && !c->want_logits) {
        if (serve_step_active(srv, c, &rc)) serve_publish(srv);
        return rc;
    }
    rc = kvt_engine_decode(srv->eng, c->seq, c->tokens, c->n, c->pos0, c->want_logits);
    pthread_mutex_lock(&srv->mu);
    if (rc == 0 && srv->batch_tokens > 0) srv->m.prefill_alone_tokens += c->n;
    if (rc == 0) srv->m.prefill_alone_steps++; /* a llama_decode of its own */
    pthread_mutex_unlock(&srv->mu);
    return rc;
}
void serve_prefill_between(struct server *srv, const struct kvt_decode_chunk *c) {
    if (srv->batch_tokens == 0 && !c->want_logits && serve_step_active(srv, NULL, NULL)) serve_publish(srv);
}
