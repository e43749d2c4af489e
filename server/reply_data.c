/* reply_data.c — what the HTTP side builds from a job's numbers for its replies: the logprob
** entries (OpenAI's logprobs.content, llama-server's completion_probabilities) and llama-server's
** "timings".  The engine thread keeps token ids, ln p and times (server/step.c); the JSON is built
** here, on the connection's thread. */
#include "sched.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "logprobs": the reply's logprobs.content (token text, ln p, UTF-8 bytes), built on the
** connection's thread from the ids and ln p the engine thread keeps: streamed, the entries of the
** tokens since the last piece; not streamed, the whole array once the job is done (20
** top_logprobs are ~12 KB of JSON a token: built on the engine thread, a long reply's array
** stalled every other tenant's step; issue #38, and #39 for the streamed entries). */
/* One token's entry: its text, ln p and UTF-8 bytes (and with native, its id). */
static json_t *lp_entry(struct server *srv, const struct job *j, kvt_token t, float lp) {
    char *piece = NULL;
    if (kvt_detokenize(srv->eng, &t, 1, false, &piece)) piece = NULL;
    json_t *bytes = json_array();
    for (const unsigned char *p = (const unsigned char *) (piece ? piece : ""); bytes && *p; p++)
        json_array_append_new(bytes, json_integer(*p));
    char *clean = app_utf8_clean(piece ? piece : "");
    /* post_sampling_probs: llama-server's "prob" (the probability the samplers gave it) */
    const bool post = j->req.post_sampling && j->req.llama_probs;
    json_t *o = json_pack("{s:s, s:f, s:o}", "token", clean ? clean : "", post ? "prob" : "logprob", post ? exp(lp) : (double) lp,
                          "bytes", bytes ? bytes : json_null());
    if (o && j->req.llama_probs) json_object_set_new(o, "id", json_integer(t));
    free(clean);
    free(piece);
    return o;
}

/* Token i of a logprob record's entry with its top_logprobs. */
static json_t *lp_token_entry(struct server *srv, const struct job *j, const struct lp_rec *r, int32_t i) {
    const int32_t K = j->req.top_logprobs;
    json_t *e = lp_entry(srv, j, r->tok[i], r->lp[i]), *top = json_array();
    for (int32_t k = 0; top && r->top_tok && k < K; k++)
        if (r->top_tok[(size_t) i * K + k] >= 0) /* post_sampling: fewer candidates than K were left */
            json_array_append_new(top, lp_entry(srv, j, r->top_tok[(size_t) i * K + k], r->top_lp[(size_t) i * K + k]));
    if (e)
        json_object_set_new(e, j->req.post_sampling && j->req.llama_probs ? "top_probs" : "top_logprobs", top ? top : json_array());
    else json_decref(top);
    return e;
}

json_t *serve_logprobs_entries(struct server *srv, const struct job *j, const struct lp_rec *r) {
    json_t *a = json_array();
    for (int32_t i = 0; a && i < r->n; i++) json_array_append_new(a, lp_token_entry(srv, j, r, i));
    return a;
}

json_t *serve_logprobs_json(struct server *srv, const struct job *j) {
    if (!j->req.logprobs || !j->lp || j->req.stream) return NULL;
    const struct lp_rec r = { j->gen, j->lp, j->top_tok, j->top_lp, j->n_gen };
    return serve_logprobs_entries(srv, j, &r);
}

int serve_logprobs_take(struct job *j, struct lp_rec *out) {
    memset(out, 0, sizeof *out);
    int32_t from = j->n_lp_sent, n = j->n_lp_ready - from;
    const size_t K = (size_t) j->req.top_logprobs;
    if (n <= 0 || !j->lp) return 0;
    out->tok = malloc(sizeof *out->tok * (size_t) n);
    out->lp = malloc(sizeof *out->lp * (size_t) n);
    if (K && j->top_tok) {
        out->top_tok = malloc(sizeof *out->top_tok * (size_t) n * K);
        out->top_lp = malloc(sizeof *out->top_lp * (size_t) n * K);
    }
    if (!out->tok || !out->lp || (K && j->top_tok && (!out->top_tok || !out->top_lp))) {
        serve_lp_rec_free(out);
        return -1;
    }
    memcpy(out->tok, j->gen + from, sizeof *out->tok * (size_t) n);
    memcpy(out->lp, j->lp + from, sizeof *out->lp * (size_t) n);
    if (out->top_tok) {
        memcpy(out->top_tok, j->top_tok + (size_t) from * K, sizeof *out->top_tok * (size_t) n * K);
        memcpy(out->top_lp, j->top_lp + (size_t) from * K, sizeof *out->top_lp * (size_t) n * K);
    }
    out->n = n;
    j->n_lp_sent = j->n_lp_ready;
    return 0;
}

void serve_lp_rec_free(struct lp_rec *r) {
    free(r->tok);
    free(r->lp);
    free(r->top_tok);
    free(r->top_lp);
    memset(r, 0, sizeof *r);
}
/* ln softmax(l)[tok] over n_vocab logits */

json_t *serve_timings(const struct job *j, double t_done) {
    /* llama-server's timings: prompt_n the tokens run through the model (cache_n reused), the
    ** generation rate over the steps after the first token (which comes from the prompt's logits) */
    double prompt_ms = j->t_first > 0 ? j->t_first - j->req.t_arrival : t_done - j->req.t_arrival;
    double pred_ms = j->t_first > 0 ? t_done - j->t_first : 0;
    /* a job still running: the tokens published with its text (the caller holds srv->mu) */
    int32_t n_pred = j->state == JOB_DONE ? j->n_gen : j->n_gen_pub, n_prompt = j->prompt_tokens - (int32_t) j->sync.tokens_reused;
    return json_pack("{s:i, s:f, s:f, s:f, s:i, s:f, s:f, s:f, s:I}", "prompt_n", n_prompt, "prompt_ms", prompt_ms,
                     "prompt_per_token_ms", n_prompt > 0 ? prompt_ms / n_prompt : 0.0, "prompt_per_second",
                     prompt_ms > 0 ? 1e3 * n_prompt / prompt_ms : 0.0, "predicted_n", n_pred, "predicted_ms", pred_ms,
                     "predicted_per_token_ms", n_pred > 1 ? pred_ms / (n_pred - 1) : 0.0, "predicted_per_second",
                     n_pred > 1 && pred_ms > 0 ? 1e3 / pred_ms * (n_pred - 1) : 0.0, "cache_n", (json_int_t) j->sync.tokens_reused);
}

json_t *serve_progress_timings(const struct prompt_progress *p) {
    const int32_t n = p->processed - p->cache;
    return json_pack("{s:i, s:f, s:f, s:f, s:i, s:f, s:f, s:f, s:i}", "prompt_n", n, "prompt_ms", p->prompt_ms,
                     "prompt_per_token_ms", n > 0 ? p->prompt_ms / n : 0.0, "prompt_per_second",
                     p->prompt_ms > 0 ? 1e3 * n / p->prompt_ms : 0.0, "predicted_n", 0, "predicted_ms", 0.0,
                     "predicted_per_token_ms", 0.0, "predicted_per_second", 0.0, "cache_n", p->cache);
}

void serve_progress_attach(json_t *ev, const struct job *j, const struct prompt_progress *p) {
    if (!ev) return;
    json_object_set_new(ev, "prompt_progress", json_pack("{s:i, s:i, s:i, s:I}", "total", p->total, "cache", p->cache, "processed",
                                                         p->processed, "time_ms", (json_int_t) p->time_ms));
    if (j->req.timings) json_object_set_new(ev, "timings", serve_progress_timings(p));
}
