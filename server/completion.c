/* completion.c — /v1/completions on the engine thread: no session, a scratch sequence per job
** and one shared budget of KV cells (sched.c's header says how they are shared); a completion
** waits in arrival order for a sequence and room, is prefilled in chunks riding in the steps,
** then runs as a raw row of the batch (step.c). */
#include "sched.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* /v1/completions, admitted: the prompt's tokens and its KV cell reservation.  Returns false
** (the job has its error) when it cannot run at all; else it waits for a sequence (serve_completion_start_waiting). */
bool serve_completion_prepare(struct server *srv, struct job *j) {
    int rc = 0;
    if (serve_job_grammar(srv, j)) return false; /* llama-server's grammar / json_schema on /completion */
    if (j->req.prompt_ids) {                     /* llama.cpp's native API: the prompt as token ids */
        struct kvt_engine_info I;
        kvt_engine_info(srv->eng, &I);
        for (int32_t i = 0; i < j->req.n_prompt_ids; i++)
            if (j->req.prompt_ids[i] < 0 || j->req.prompt_ids[i] >= I.n_vocab) {
                serve_error_param(&j->err, "prompt");
                serve_bad(&j->err, "'prompt[%d]' token id %d is outside 0..%d (the model's vocabulary)", i, j->req.prompt_ids[i],
                          I.n_vocab - 1);
                return false;
            }
        j->ptok = j->req.prompt_ids;
        j->prompt_tokens = j->req.n_prompt_ids;
        j->req.prompt_ids = NULL;
        j->req.n_prompt_ids = 0;
    } else rc = kvt_tokenize(srv->eng, j->req.prompt, true, j->req.prompt_special, &j->ptok, &j->prompt_tokens);
    if (rc) {
        serve_error_lib(&j->err, "prompt", rc);
        return false;
    }
    const int32_t n = j->prompt_tokens;
    j->sync.prompt_tokens = n;
    j->sync.tokens_decoded = n;
    j->finish = "length";
    j->seq = -1;
    /* no limit asked for, by the request or the server (llama-server's n_predict -1): the reply may
    ** fill what the prompt leaves of the budget, as llama-server's fills its slot's context */
    if (!j->req.max_tokens_given && srv->max_tokens_unset && n < srv->budget && n + j->req.max_tokens > srv->budget)
        j->req.max_tokens = srv->budget - n;
    if (n + j->req.max_tokens > srv->budget) {
        serve_error_set(&j->err, 400, "exceed_context_size_error", "context_length_exceeded",
                        "the prompt is %d tokens and max_tokens %d; together they must fit the budget of %d tokens (a completion "
                        "has no session to evict from)",
                        n, j->req.max_tokens, srv->budget);
        j->err.n_prompt_tokens = n;
        j->err.n_ctx = srv->budget;
        return false;
    }
    if (n == 0) {
        serve_error_set(&j->err, 400, "invalid_request_error", NULL, "the prompt is empty (0 tokens)");
        return false;
    }
    j->cells = n + j->req.max_tokens;
    return true;
}
/* Forget what scratch sequence q holds (its cells cleared). */
static void comp_cache_clear(struct server *srv, int32_t q) {
    struct sched *sc = srv->sched;
    kvt_seq_rm(srv->eng, sc->comp_seq0 + q, -1, -1);
    sc->n_comp_tok[q] = 0;
}

/* Append n tokens to what scratch sequence q holds.  Out of memory: q's contents are marked
** unknown (n_comp_tok -1), and its cells cleared when its completion ends. */
static void comp_cache_add(struct server *srv, int32_t q, const kvt_token *tok, int32_t n) {
    struct sched *sc = srv->sched;
    if (n <= 0 || sc->n_comp_tok[q] < 0) return;
    if (sc->n_comp_tok[q] + n > sc->cap_comp_tok[q]) {
        int32_t cap = KVT_MAX(2 * sc->cap_comp_tok[q], sc->n_comp_tok[q] + n);
        kvt_token *t = realloc(sc->comp_tok[q], sizeof *t * (size_t) cap);
        if (!t) { /* what the sequence holds is not known any more: cleared when its job ends */
            sc->n_comp_tok[q] = -1;
            return;
        }
        sc->comp_tok[q] = t;
        sc->cap_comp_tok[q] = cap;
    }
    memcpy(sc->comp_tok[q] + sc->n_comp_tok[q], tok, sizeof *tok * (size_t) n);
    sc->n_comp_tok[q] += n;
}

int64_t serve_completion_forget(struct server *srv, const char *ns) {
    struct sched *sc = srv->sched;
    int64_t n = 0;
    for (int32_t q = 0; q < sc->n_comp; q++)
        if (!sc->comp_busy[q] && sc->n_comp_tok[q] > 0 && !strcmp(sc->comp_ns[q], ns)) {
            n += sc->n_comp_tok[q];
            comp_cache_clear(srv, q);
        }
    return n;
}

/* The completion leaves its sequence and gives back its reservation.  With the prompt cache, a
** completion that ended well leaves its tokens' KV there for the next one (its prompt and the
** generated tokens decoded: positions 0 .. row.pos); otherwise the cells are freed. */
void serve_completion_end(struct server *srv, struct job *j, int rc) {
    struct sched *sc = srv->sched;
    if (rc) serve_error_lib(&j->err, "generation", rc);
    if (j->seq >= 0) {
        const int32_t q = j->seq - sc->comp_seq0;
        const int32_t n_dec = j->row.pos - sc->n_comp_tok[q]; /* generated tokens decoded after the prompt */
        if (sc->comp_cache && !rc && !j->err.status && j->row.logits && sc->n_comp_tok[q] > 0 && n_dec >= 0 && n_dec <= j->n_gen)
            comp_cache_add(srv, q, j->gen, n_dec);
        else comp_cache_clear(srv, q);
        sc->comp_busy[q] = false;
        sc->comp_cells -= j->cells;
        j->seq = -1;
    }
    free(j->row.logits);
    j->row.logits = NULL;
    j->completion_tokens = j->n_gen;
}
/* Prefill a completion's prompt into a free scratch sequence, in chunks of one block with a
** batched step of the active jobs between them (as sessions prefill); then it joins the active
** set as a raw row of kvt_session_gen_step_batch.  Returns false when it failed (finished). */
static bool start_completion(struct server *srv, struct job *j) {
    struct sched *sc = srv->sched;
    const int32_t n = j->prompt_tokens;
    /* the idle sequence whose cached tokens share the longest prefix with the prompt (the first
    ** free one when none does); at least the prompt's last token is decoded, for its logits */
    int32_t q = -1, reuse = -1;
    for (int32_t k = 0; k < sc->n_comp; k++) {
        if (sc->comp_busy[k]) continue;
        int32_t c = 0;
        const bool mine = !j->req.no_prompt_cache && (srv->share_store || !strcmp(sc->comp_ns[k], j->req.ns));
        while (sc->comp_cache && mine && c < sc->n_comp_tok[k] && c < n - 1 && sc->comp_tok[k][c] == j->ptok[c]) c++;
        if (c > reuse) q = k, reuse = c;
    }
    sc->comp_busy[q] = true;
    snprintf(sc->comp_ns[q], sizeof sc->comp_ns[q], "%s", j->req.ns);
    sc->comp_cells += j->cells;
    j->seq = sc->comp_seq0 + q;
    if (reuse != sc->n_comp_tok[q]) { /* what follows the common prefix leaves the sequence */
        if (reuse == 0) comp_cache_clear(srv, q);
        else if (!kvt_seq_rm(srv->eng, j->seq, reuse, -1)) sc->n_comp_tok[q] = reuse;
        else comp_cache_clear(srv, q), reuse = 0;
    }
    j->sync.tokens_decoded = n - reuse;
    j->sync.tokens_reused = reuse;
    struct kvt_engine_info I;
    kvt_engine_info(srv->eng, &I);
    int rc = (j->row.logits = malloc(sizeof(float) * (size_t) I.n_vocab)) ? 0 : KVT_ENOMEM;
    serve_job_progress(srv, j, n, reuse, reuse);
    for (int32_t off = reuse; rc == 0 && off < n;) { /* chunks as a session's: step.c decodes them */
        int32_t m = KVT_MIN(n - off, srv->block), room = serve_prefill_room(srv);
        if (room > 0) m = KVT_MIN(m, room);
        const struct kvt_decode_chunk c = { j->seq, j->ptok + off, m, off, off + m == n };
        rc = serve_prefill_decode(srv, j, &c);
        off += m;
        if (rc == 0) serve_job_progress(srv, j, n, 0, off);
        if (rc == 0) serve_prefill_between(srv, &c);
    }
    const float *l = rc == 0 ? kvt_engine_logits(srv->eng) : NULL;
    if (rc == 0 && !l) rc = KVT_ELLAMA;
    if (rc == 0 && sc->comp_cache) comp_cache_add(srv, q, j->ptok + reuse, n - reuse);
    if (rc == 0 && serve_history_window(&j->req.smp) > 0) { /* the prompt's part of the penalties' and DRY's window */
        const int32_t win = serve_history_window(&j->req.smp);
        if (!(j->pen = malloc(sizeof *j->pen * 2 * (size_t) win))) rc = KVT_ENOMEM;
        else {
            j->n_pen = KVT_MIN(win, n);
            memcpy(j->pen, j->ptok + (n - j->n_pen), sizeof *j->pen * (size_t) j->n_pen);
        }
    }
    free(j->ptok);
    j->ptok = NULL;
    if (rc) {
        if (rc == KVT_ECANCELED && (j->timed_out || serve_aborting(srv))) serve_job_timeout_error(srv, j, "prefill");
        else serve_error_lib(&j->err, "prompt", rc);
        serve_completion_end(srv, j, 0);
        serve_job_finish(srv, j);
        return false;
    }
    memcpy(j->row.logits, l, sizeof(float) * (size_t) I.n_vocab);
    j->row.seq = j->seq;
    j->row.pos = n;
    j->row.n_gen = 0; /* draw 0 next */
    j->end = serve_completion_end;
    serve_job_activate(srv, j);
    return true;
}
/* Start the waiting completions, in arrival order, while a scratch sequence is free and the
** cells they reserve fit the shared budget; a cancelled one leaves without running. */
void serve_completion_start_waiting(struct server *srv) {
    struct sched *sc = srv->sched;
    int32_t w = 0; /* first, the ones whose client left, wherever they wait */
    for (int32_t k = 0; k < sc->n_wait; k++) {
        bool gone = serve_job_stopped(srv, sc->wait[k]);
        if (gone && (sc->wait[k]->timed_out || serve_aborting(srv)))
            serve_job_timeout_error(srv, sc->wait[k], "waiting for a sequence");
        if (gone) {
            sc->wait[k]->completion_tokens = 0;
            sc->wait[k]->finish = "stop";
            serve_job_finish(srv, sc->wait[k]);
        } else sc->wait[w++] = sc->wait[k];
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
            serve_job_finish(srv, j);
            continue;
        }
        start_completion(srv, j);
    }
}
