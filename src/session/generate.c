/* generate.c — reply generation (whole or step-wise), teacher-forced answer log-probabilities,
** and batched decode steps over several sessions and raw rows (continuous batching: one
** llama_decode for all). */
#include "session/session_int.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Draw `draw` of the session's reply: kvt_engine_sample_at with, when smp sets a repetition penalty or
** DRY, the last tokens of the stream (their window; prompt and reply so far) as their history. */
static int sess_sample(kvt_session *s, const struct kvt_sampling *smp, int64_t draw, kvt_token *tok) {
    const int32_t win = KVT_MIN(kvt_history_window(smp), s->total);
    if (win <= 0) return kvt_engine_sample_at(s->eng, smp, s->p.seq, draw, tok);
    kvt_token *h = malloc(sizeof *h * (size_t) win);
    if (!h) return kvt__fail(KVT_ENOMEM, "a penalty window of %d tokens", win);
    int32_t at = win; /* h[at .. win): the stream's last tokens, oldest first */
    for (int32_t i = s->n_b - 1; i >= 0 && at > 0; i--)
        for (int32_t k = s->b[i].tok ? s->b[i].info.n_tokens - 1 : -1; k >= 0 && at > 0; k--) h[--at] = s->b[i].tok[k];
    struct kvt_sampling one = *smp;
    one.history = h + at;
    one.n_history = win - at;
    int rc = kvt_engine_sample_at(s->eng, &one, s->p.seq, draw, tok);
    free(h);
    return rc;
}

int kvt_session_generate(kvt_session *s, int32_t max_tokens, const struct kvt_sampling *smp, kvt_token_cb cb, void *ud,
                         char **reply) {
    kvt__clear_error();
    if (reply) *reply = NULL;
    if (s->is_parked) return kvt__sess_parked_error();
    if (!s->dec.have_logits) return kvt__fail(KVT_EINVAL, "generate: no user turn to reply to");
    kvt__engine_set_logits(s->eng, s->dec.logits);
    kvt_token *gen = malloc(sizeof(kvt_token) * (size_t) (max_tokens > 0 ? max_tokens : 1));
    if (!gen) return kvt__fail(KVT_ENOMEM, "generate");
    int32_t n = 0;
    int rc = 0;
    while (n < max_tokens) {
        kvt_token t;
        if ((rc = sess_sample(s, smp, n, &t))) break; /* draw n of this reply */
        if (kvt_token_is_eog(s->eng, t)) break;
        gen[n++] = t;
        rc = kvt__sess_feed(s, &t, 1, KVT_ROLE_ASSISTANT, 0);
        if (rc) break;
        if (cb) {
            char *piece = NULL;
            if (kvt_detokenize(s->eng, &t, 1, false, &piece) == 0) {
                bool go = cb(piece, ud);
                free(piece);
                if (!go) break;
            }
        }
    }
    char *text = NULL;
    int rc2 = kvt_detokenize(s->eng, gen, n, false, &text);
    free(gen);
    if (rc2) return rc ? rc : rc2;
    /* the reply is in the stream: extend the message list and the decoded template text */
    int rc3 = kvt__sess_append_reply(s, text, strlen(text));
    if (reply) *reply = text;
    else free(text);
    return rc ? rc : rc3;
}

int kvt_session_answer_logprob(kvt_session *s, const char *answer, double *logprob, int32_t *n_tokens) {
    if (s->is_parked) return kvt__sess_parked_error();
    if (s->dec.have_logits) kvt__engine_set_logits(s->eng, s->dec.logits);
    const float *cur = s->dec.have_logits ? kvt_engine_logits(s->eng) : NULL;
    *logprob = 0;
    *n_tokens = 0;
    if (!cur) return kvt__fail(KVT_EINVAL, "answer_logprob: no user turn decoded yet");
    float *saved = malloc(sizeof(float) * (size_t) s->n_vocab);
    kvt_token *tok = NULL;
    int32_t n = 0;
    int rc = saved ? kvt_tokenize(s->eng, answer, false, false, &tok, &n) : kvt__fail(KVT_ENOMEM, "logits");
    if (rc) {
        free(saved);
        return rc;
    }
    memcpy(saved, cur, sizeof(float) * (size_t) s->n_vocab);
    if (kvt__sess_resident(s) + n > s->p.budget) {
        free(saved);
        free(tok);
        return kvt__fail(KVT_EBUDGET, "scoring %d answer tokens would exceed the budget of %d (%d resident)", n, s->p.budget,
                         kvt__sess_resident(s));
    }
    if ((rc = kvt__sess_reserve_positions(s, n))) {
        free(saved);
        free(tok);
        return rc;
    }
    double lp = 0;
    const kvt_pos start = s->next_pos;
    for (int32_t i = 0; i < n && rc == 0; i++) {
        const float *l = kvt_engine_logits(s->eng);
        double mx = -INFINITY, z = 0;
        for (int32_t v = 0; v < s->n_vocab; v++) mx = fmax(mx, l[v]);
        for (int32_t v = 0; v < s->n_vocab; v++) z += exp(l[v] - mx);
        lp += l[tok[i]] - mx - log(z);
        if (i + 1 < n) {
            rc = kvt_engine_decode(s->eng, s->p.seq, &tok[i], 1, start + i, true);
            kvt__sess_note_peak(s);
        }
    }
    kvt_seq_rm(s->eng, s->p.seq, start, -1);
    kvt__engine_set_logits(s->eng, saved);
    free(saved);
    free(tok);
    if (rc == 0) {
        *logprob = lp;
        *n_tokens = n;
    }
    return rc;
}

int kvt_session_gen_step(kvt_session *s, const struct kvt_sampling *smp, kvt_token *tok, bool *done) {
    kvt__clear_error();
    *done = false;
    if (s->is_parked) return kvt__sess_parked_error();
    if (!s->dec.have_logits) return kvt__fail(KVT_EINVAL, "gen_step: no user turn to reply to");
    if (!s->dec.generating) s->dec.n_gen = 0, s->dec.last_unfed = false;
    s->dec.generating = true;
    kvt__engine_set_logits(s->eng, s->dec.logits);
    kvt_token t;
    int rc = sess_sample(s, smp, s->dec.n_gen, &t); /* draw n_gen of this reply */
    if (rc) return rc;
    *tok = t;
    if (kvt_token_is_eog(s->eng, t)) {
        *done = true;
        return 0;
    }
    if (s->dec.n_gen == s->dec.cap_gen) {
        int32_t cap = s->dec.cap_gen ? 2 * s->dec.cap_gen : 64;
        kvt_token *g = realloc(s->dec.gen, sizeof *g * (size_t) cap);
        if (!g) return kvt__fail(KVT_ENOMEM, "reply of %d tokens", cap);
        s->dec.gen = g;
        s->dec.cap_gen = cap;
    }
    rc = kvt__sess_feed(s, &t, 1, KVT_ROLE_ASSISTANT, 0);
    if (rc) return rc;
    s->dec.gen[s->dec.n_gen++] = t;
    return 0;
}

int kvt_session_gen_end(kvt_session *s, char **reply) {
    kvt__clear_error();
    if (reply) *reply = NULL;
    char *text = NULL, *fed = NULL;
    int rc = kvt_detokenize(s->eng, s->dec.gen, s->dec.n_gen, false, &text);
    if (rc) return rc;
    /* a last draw that was not decoded: kv_text ends with the decoded tokens' text, the longest
    ** prefix of the reply's text it shares (their pieces concatenate) */
    size_t n_dec = strlen(text);
    if (s->dec.last_unfed && s->dec.n_gen > 0) {
        if ((rc = kvt_detokenize(s->eng, s->dec.gen, s->dec.n_gen - 1, false, &fed))) {
            free(text);
            return rc;
        }
        size_t k = 0;
        while (k < n_dec && fed[k] && fed[k] == text[k]) k++;
        n_dec = k;
        free(fed);
    }
    rc = kvt__sess_append_reply(s, text, n_dec);
    s->dec.last_unfed = false;
    s->dec.generating = false;
    s->dec.n_gen = 0;
    if (reply && rc == 0) *reply = text;
    else free(text);
    return rc;
}

int kvt_session_gen_step_batch(kvt_engine *eng, const struct kvt_gen_batch *gb) {
    if (!gb) return kvt__fail(KVT_EINVAL, "NULL batch");
    kvt_session *const *ss = gb->sessions;
    const int32_t n = gb->n, n_rows = gb->n_rows;
    const struct kvt_sampling *smp = gb->smp;
    kvt_token *tok = gb->tok;
    bool *done = gb->done;
    int *status = gb->status;
    struct kvt_gen_row *rows = gb->rows;
    const struct kvt_decode_chunk *chunk = gb->chunk;
    const bool *last = gb->last;
    kvt__clear_error();
    if (n < 0 || n_rows < 0 || (n > 0 && (!ss || !smp || !tok || !done || !status)) || (n_rows > 0 && !rows))
        return kvt__fail(KVT_EINVAL, "batch of %d sessions and %d rows", n, n_rows);
    if (chunk && chunk->n <= 0) chunk = NULL;
    if (n + n_rows == 0) return chunk ? kvt_engine_decode_batch(eng, NULL, NULL, NULL, 0, NULL, chunk) : 0;
    struct kvt_engine_info I;
    kvt_engine_info(eng, &I);
    const int32_t nt = n + n_rows;
    int32_t *seqs = malloc(sizeof(int32_t) * (size_t) nt), *idx = malloc(sizeof(int32_t) * (size_t) nt);
    kvt_pos *pos = malloc(sizeof(kvt_pos) * (size_t) nt);
    kvt_token *bt = malloc(sizeof(kvt_token) * (size_t) nt);
    float *logits = malloc(sizeof(float) * (size_t) nt * (size_t) I.n_vocab);
    int rc = (!seqs || !idx || !pos || !bt || !logits) ? kvt__fail(KVT_ENOMEM, "batch of %d sessions and %d rows", n, n_rows) : 0;
    int32_t m = 0;
    for (int32_t i = 0; rc == 0 && i < n; i++) {
        kvt_session *s = ss[i];
        done[i] = false;
        status[i] = 0;
        if (s->eng != eng) {
            status[i] = kvt__fail(KVT_EINVAL, "batched sessions must share one engine");
            continue;
        }
        if (s->is_parked) {
            status[i] = kvt__sess_parked_error();
            continue;
        }
        if (!s->dec.have_logits) {
            status[i] = kvt__fail(KVT_EINVAL, "gen_step: no user turn to reply to");
            continue;
        }
        if (!s->dec.generating) s->dec.n_gen = 0, s->dec.last_unfed = false;
        s->dec.generating = true;
        kvt__engine_set_logits(eng, s->dec.logits);
        if ((status[i] = sess_sample(s, &smp[i], s->dec.n_gen, &tok[i]))) continue;
        if (kvt_token_is_eog(eng, tok[i])) {
            done[i] = true;
            continue;
        }
        if (s->dec.n_gen == s->dec.cap_gen) {
            int32_t cap = s->dec.cap_gen ? 2 * s->dec.cap_gen : 64;
            kvt_token *g = realloc(s->dec.gen, sizeof *g * (size_t) cap);
            if (!g) {
                status[i] = kvt__fail(KVT_ENOMEM, "reply of %d tokens", cap);
                continue;
            }
            s->dec.gen = g;
            s->dec.cap_gen = cap;
        }
        if (last && last[i]) continue; /* the reply's last token: joins it below, not decoded */
        double t1 = kvt__now_ms();
        status[i] = kvt__sess_make_room(s, 1);
        s->st.policy_ms += kvt__now_ms() - t1;
        if (status[i]) continue;
        if ((status[i] = kvt__sess_reserve_positions(s, 1))) continue;
        seqs[m] = s->p.seq;
        pos[m] = s->next_pos;
        bt[m] = tok[i];
        idx[m++] = i;
    }
    for (int32_t r = 0; rc == 0 && r < n_rows; r++) { /* rows: sample from their own logits the same way */
        struct kvt_gen_row *w = &rows[r];
        w->done = false;
        w->status = 0;
        if (!w->logits) {
            w->status = kvt__fail(KVT_EINVAL, "batch row %d has no logits", r);
            continue;
        }
        kvt__engine_set_logits(eng, w->logits);
        if ((w->status = kvt_engine_sample_at(eng, &w->smp, w->seq, w->n_gen, &w->tok) /* draw n_gen of this row */)) continue;
        if (kvt_token_is_eog(eng, w->tok)) {
            w->done = true;
            continue;
        }
        if (w->last) continue; /* sampled, not decoded */
        seqs[m] = w->seq;
        pos[m] = w->pos;
        bt[m] = w->tok;
        idx[m++] = n + r;
    }
    if (rc == 0 && (m > 0 || chunk)) {
        double t0 = kvt__now_ms();
        rc = kvt_engine_decode_batch(eng, seqs, bt, pos, m, logits, chunk);
        double dt = (kvt__now_ms() - t0) / (m > 0 ? m : 1);
        for (int32_t k = 0; rc == 0 && k < m; k++) {
            const float *l = logits + (size_t) k * I.n_vocab;
            if (idx[k] >= n) {
                struct kvt_gen_row *w = &rows[idx[k] - n];
                memcpy(w->logits, l, sizeof(float) * (size_t) I.n_vocab);
                w->pos++;
                w->n_gen++;
                continue;
            }
            kvt_session *s = ss[idx[k]];
            s->st.decode_ms += dt;
            s->st.decoded++;
            kvt__sess_note_peak(s);
            memcpy(s->dec.logits, l, sizeof(float) * (size_t) s->n_vocab);
            s->dec.have_logits = true;
            s->dec.gen[s->dec.n_gen++] = bt[k];
            status[idx[k]] = kvt__sess_record(s, &bt[k], 1, KVT_ROLE_ASSISTANT);
            if (status[idx[k]] == 0) status[idx[k]] = kvt__sess_elastic(s, 1);
        }
    }
    /* the last draws join their replies once the shared decode went in (else nothing took a
    ** token); no logits to sample from until the next turn */
    for (int32_t i = 0; rc == 0 && last && i < n; i++)
        if (last[i] && !status[i] && !done[i]) {
            kvt_session *s = ss[i];
            s->dec.gen[s->dec.n_gen++] = tok[i];
            s->dec.last_unfed = true;
            s->dec.have_logits = false;
        }
    free(seqs);
    free(idx);
    free(pos);
    free(bt);
    free(logits);
    return rc;
}

const float *kvt_session_logits(const kvt_session *s) { return s->dec.have_logits && !s->is_parked ? s->dec.logits : NULL; }
