/* eval_run.c — one case under one policy: a fresh session on sequence 0, the document turns
** (each followed by the replayed reply EVAL_REPLY), then the task's probes.
**
**   niah, multifact  per probe: add the question; teacher-forced log-probability of the expected
**                    answer (kvt_session_answer_logprob, before generating); greedy reply of at
**                    most --max-tokens (or to the end of the turn); pass = the reply contains
**                    the number.
**   ppl              after each fed turn from --skip on: the next segment's first
**                    --score-tokens tokens are teacher-forced as the reply, one token at a time
**                    into the session's sequence (kvt_engine_decode at the session's next position,
**                    then kvt_seq_rm, as kvt_session_answer_logprob does), and each position's
**                    full next-token distribution is read with kvt_engine_logits: NLL, top-1 hit, and
**                    KL from no_eviction's distribution at the same position.
** With --codec, a policy's session stores its host pool's blocks through o->codec[pi]
** (kvt_session_params.codec_ram), so every block it recovers was decoded from that codec; the
** session record keeps the pool's raw and stored bytes and the codec's time. */
#include "eval.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int eval_add_row(struct eval_results *r, const struct eval_row *row) {
    if (r->n_rows == r->cap_rows) {
        int32_t cap = r->cap_rows ? 2 * r->cap_rows : 256;
        struct eval_row *n = realloc(r->rows, sizeof *n * (size_t) cap);
        if (!n) return -1;
        r->rows = n;
        r->cap_rows = cap;
    }
    r->rows[r->n_rows++] = *row;
    return 0;
}

int eval_add_sess(struct eval_results *r, const struct eval_sess *s) {
    if (r->n_sess == r->cap_sess) {
        int32_t cap = r->cap_sess ? 2 * r->cap_sess : 64;
        struct eval_sess *n = realloc(r->sess, sizeof *n * (size_t) cap);
        if (!n) return -1;
        r->sess = n;
        r->cap_sess = cap;
    }
    r->sess[r->n_sess++] = *s;
    return 0;
}

void eval_results_free(struct eval_results *r) {
    for (int32_t i = 0; i < r->n_rows; i++) free(r->rows[i].reply);
    free(r->rows);
    free(r->sess);
    memset(r, 0, sizeof *r);
}

void eval_ref_free(struct eval_ref *ref) {
    if (!ref) return;
    if (ref->f) fclose(ref->f);
    free(ref->off);
    free(ref->n);
    memset(ref, 0, sizeof *ref);
}

/* ---------------------------------------------------------------------------------------- */
/* generation                                                                               */

struct gen_state {
    double t_first; /* ms timestamp of the first piece, 0 before */
};

/* Notes the time of the first token; generation runs to --max-tokens or end of turn. */
static bool on_piece(const char *piece, void *ud) {
    struct gen_state *g = ud;
    (void) piece;
    if (g->t_first == 0) g->t_first = now_ms();
    return true;
}

/* The reply without leading white space. */
static void trim_reply(char *r) {
    char *p = r;
    while (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t') p++;
    memmove(r, p, strlen(p) + 1);
}

const char *eval_fact_state_name(int32_t state) {
    static const char *const names[] = { "unknown", "resident", "recovered", "evicted" };
    return state >= 0 && state < 4 ? names[state] : "unknown";
}

/* Where the fact is now: the blocks whose texts (concatenated in creation order: the
** conversation's text) cover the first occurrence of its number, and whether each of them is
** resident and was ever evicted. */
static int32_t fact_state(kvt_session *s, const struct eval_fact *f) {
    const int32_t nb = kvt_session_n_blocks(s);
    size_t len = 0, cap = 0;
    char *all = NULL;
    size_t *start = malloc(sizeof *start * (size_t) (nb > 0 ? nb + 1 : 1));
    int32_t state = EVAL_FACT_UNKNOWN;
    if (!start) return state;
    for (int32_t i = 0; i < nb; i++) {
        struct kvt_block_info bi;
        start[i] = len;
        if (kvt_session_block(s, i, &bi) || !bi.text) continue;
        size_t m = strlen(bi.text);
        if (len + m + 1 > cap) {
            size_t nc = (len + m + 1) * 2;
            char *t = realloc(all, nc);
            if (!t) goto out;
            all = t;
            cap = nc;
        }
        memcpy(all + len, bi.text, m + 1);
        len += m;
    }
    start[nb] = len;
    /* the number's first occurrence as a whole number (not inside a longer one) */
    const size_t nl = strlen(f->number);
    const char *hit = all;
    while (hit && (hit = strstr(hit, f->number)) &&
           ((hit > all && isdigit((unsigned char) hit[-1])) || isdigit((unsigned char) hit[nl])))
        hit++;
    if (!hit) goto out;
    const size_t a = (size_t) (hit - all), b = a + strlen(f->number);
    bool evicted = false, resident = true;
    for (int32_t i = 0; i < nb; i++) {
        struct kvt_block_info bi;
        if (start[i + 1] <= a || start[i] >= b || kvt_session_block(s, i, &bi)) continue;
        evicted |= bi.n_evictions > 0;
        resident &= bi.residency == KVT_RES_DEVICE;
    }
    state = !resident ? EVAL_FACT_EVICTED : evicted ? EVAL_FACT_RECOVERED : EVAL_FACT_RESIDENT;
out:
    free(all);
    free(start);
    return state;
}

/* Whether hay contains needle, ASCII case-insensitively (RULER lowercases both). */
static bool contains_ci(const char *hay, const char *needle) {
    const size_t n = strlen(needle);
    for (const char *h = hay; n && *h; h++) {
        size_t i = 0;
        while (i < n && h[i] && tolower((unsigned char) h[i]) == tolower((unsigned char) needle[i])) i++;
        if (i == n) return true;
    }
    return false;
}

/* One probe: the question (or `message`, the whole single-prompt message ending with it);
** log-probabilities of the answer and of the number after the answer's prefix; greedy reply.
** OUT row fields. */
static int probe(const char *cmd, kvt_engine *eng, kvt_session *s, const struct eval_opts *o, const struct eval_fact *f,
                 const char *message, struct eval_row *row) {
    double t0 = now_ms();
    int rc = kvt_session_add(s, KVT_ROLE_USER, message ? message : f->question, KVT_KEEP_NONE);
    if (rc) {
        app_fail(cmd, "question", rc);
        return rc;
    }
    double t_added = now_ms();
    row->fact = fact_state(s, f);
    if ((rc = kvt_session_answer_logprob(s, f->answer, &row->answer_logprob, &row->answer_tokens))) {
        app_fail(cmd, "answer log-probability", rc);
        return rc;
    }
    /* the number given the answer's prefix: log P(answer) - log P(prefix), valid when the
    ** prefix's tokens are a prefix of the answer's (checked) */
    double lp_prefix = 0;
    int32_t n_prefix = 0;
    if ((rc = kvt_session_answer_logprob(s, f->prefix, &lp_prefix, &n_prefix))) {
        app_fail(cmd, "answer-prefix log-probability", rc);
        return rc;
    }
    row->number_logprob = NAN;
    kvt_token *ta = NULL, *tp = NULL;
    int32_t na = 0, np = 0;
    if (kvt_tokenize(eng, f->answer, false, false, &ta, &na) == 0 && kvt_tokenize(eng, f->prefix, false, false, &tp, &np) == 0 &&
        np < na && np == n_prefix && !memcmp(ta, tp, sizeof *ta * (size_t) np))
        row->number_logprob = row->answer_logprob - lp_prefix;
    free(ta);
    free(tp);
    row->prefix_passed = !isnan(row->number_logprob) && row->number_logprob > log(0.5);
    struct kvt_sampling smp = { .temperature = 0.0f, .top_p = 1.0f };
    struct gen_state g = { 0 };
    char *reply = NULL;
    double t_gen = now_ms();
    rc = kvt_session_generate(s, o->max_tokens, &smp, on_piece, &g, &reply);
    if (rc && rc != KVT_ECANCELED) {
        app_fail(cmd, "generation", rc);
        free(reply);
        return rc;
    }
    if (!reply && !(reply = calloc(1, 1))) return KVT_ENOMEM;
    trim_reply(reply);
    row->reply = reply;
    row->n = 1;
    if (f->n_refs > 0) { /* RULER's string_match_all: the references the reply contains, any case */
        row->refs = f->n_refs;
        for (int32_t i = 0; i < f->n_refs; i++) row->refs_hit += contains_ci(reply, f->refs[i]);
        row->passed = row->refs_hit == row->refs;
    } else {
        row->passed = strstr(reply, f->number) != NULL;
        row->refs = 1;
        row->refs_hit = row->passed;
    }
    /* time to first token without the scoring pass in between */
    row->ttft_ms = (t_added - t0) + ((g.t_first ? g.t_first : now_ms()) - t_gen);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* ppl scoring                                                                              */

/* log-softmax pieces of a logit row: max and log-sum-exp. */
static void lse(const float *l, int32_t n, double *mx, double *logz) {
    double m = -INFINITY, z = 0;
    for (int32_t v = 0; v < n; v++) m = l[v] > m ? l[v] : m;
    for (int32_t v = 0; v < n; v++) z += exp(l[v] - m);
    *mx = m;
    *logz = log(z);
}

/* KL(ref || pol) in nats over the whole vocabulary: sum_v p_ref(v) (log p_ref(v) - log p_pol(v)),
** ref a log-softmax row, pol a logit row with its max and log-sum-exp. */
static double full_kl(const float *ref, const float *l, int32_t n_vocab, double mx, double logz) {
    double kl = 0;
    for (int32_t v = 0; v < n_vocab; v++) {
        if (ref[v] < -80.0f) continue; /* p_ref < 1e-35: no contribution a double can hold */
        kl += exp(ref[v]) * (ref[v] - (l[v] - mx - logz));
    }
    return kl > 0 ? kl : 0;
}

/* Teacher-force tok[0..n) after the current logits (the assistant prefix of the last user turn)
** into the session's sequence at its next position, then remove them.  fill: append each
** position's log-softmax to the reference file; row0 >= 0 (and not fill): compare against the
** reference rows row0.. (exact KL).  OUT sums over positions. */
static int score_segment(kvt_engine *eng, kvt_session *s, const kvt_token *tok, int32_t n, int32_t n_vocab, struct eval_ref *ref,
                         bool fill, int64_t row0, double *nll, int32_t *hits, double *kl) {
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    const kvt_pos start = st.next_pos;
    *nll = *kl = 0;
    *hits = 0;
    float *row = (fill || row0 >= 0) ? malloc(sizeof(float) * (size_t) n_vocab) : NULL;
    if ((fill || row0 >= 0) && !row) return KVT_ENOMEM;
    int rc = 0;
    for (int32_t i = 0; i < n && rc == 0; i++) {
        const float *l = kvt_engine_logits(eng);
        if (!l) {
            rc = KVT_EINVAL;
            break;
        }
        double mx, logz;
        lse(l, n_vocab, &mx, &logz);
        *nll -= l[tok[i]] - mx - logz;
        int32_t best = 0;
        for (int32_t v = 1; v < n_vocab; v++) best = l[v] > l[best] ? v : best;
        *hits += best == tok[i];
        if (fill) {
            for (int32_t v = 0; v < n_vocab; v++) row[v] = (float) (l[v] - mx - logz);
            if (fwrite(row, sizeof(float), (size_t) n_vocab, ref->f) != (size_t) n_vocab) {
                rc = KVT_EIO;
                break;
            }
            ref->n_rows++;
        } else if (row0 >= 0) {
            if (fseeko(ref->f, (off_t) (row0 + i) * n_vocab * (off_t) sizeof(float), SEEK_SET) != 0 ||
                fread(row, sizeof(float), (size_t) n_vocab, ref->f) != (size_t) n_vocab) {
                rc = KVT_EIO;
                break;
            }
            *kl += full_kl(row, l, n_vocab, mx, logz);
        }
        if (i + 1 < n) rc = kvt_engine_decode(eng, 0, &tok[i], 1, start + i, true);
    }
    if (fill && ref->f) fseeko(ref->f, 0, SEEK_END);
    free(row);
    kvt_seq_rm(eng, 0, start, -1);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* one case under one policy                                                                */

static void fill_session_fields(kvt_session *s, struct eval_row *row) {
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    row->evictions = st.evictions;
    row->recoveries = st.recoveries;
    row->tokens = st.total_tokens;
    row->peak_resident = st.peak_resident_tokens;
}

static int run_ppl(const char *cmd, kvt_engine *eng, kvt_session *s, const struct eval_opts *o, int32_t pi,
                   const struct eval_case *k, struct eval_ref *ref, struct eval_results *res, int32_t n_vocab) {
    const bool is_ref = o->policies[pi] == KVT_POLICY_NO_EVICTION && o->variant[pi] == EVAL_PLAIN;
    const bool have_ref = ref && ref->f && !is_ref;
    if (is_ref && ref) {
        eval_ref_free(ref);
        ref->off = calloc((size_t) k->n_turns, sizeof *ref->off);
        ref->n = calloc((size_t) k->n_turns, sizeof *ref->n);
        ref->f = tmpfile();
        if (!ref->off || !ref->n || !ref->f) {
            int err = ref->f ? KVT_ENOMEM : KVT_EIO;
            eval_ref_free(ref);
            fprintf(stderr, "kvtier %s: cannot keep the reference distributions (%s)\n", cmd,
                    err == KVT_EIO ? "tmpfile failed" : "out of memory");
            return err;
        }
        ref->n_seg = k->n_turns;
        ref->n_vocab = n_vocab;
    }
    int rc = 0;
    for (int32_t t = 0; t < k->n_turns && rc == 0; t++) {
        if (t > 0 && (rc = kvt_session_add(s, KVT_ROLE_ASSISTANT, EVAL_REPLY, KVT_KEEP_NONE))) break;
        if ((rc = kvt_session_add(s, KVT_ROLE_USER, k->turns[t], KVT_KEEP_NONE))) {
            char what[64];
            snprintf(what, sizeof what, "turn %d", t + 1);
            app_fail(cmd, what, rc);
            break;
        }
        if (t < o->skip) continue;
        kvt_token *tok = NULL;
        int32_t n = 0;
        if ((rc = kvt_tokenize(eng, k->score[t], false, false, &tok, &n))) break;
        if (n > o->score_tokens) n = o->score_tokens;
        int64_t row0 = -1;
        if (is_ref && ref) {
            ref->off[t] = ref->n_rows;
            ref->n[t] = n;
        } else if (have_ref && t < ref->n_seg && ref->n[t] == n && ref->n_vocab == n_vocab) {
            row0 = ref->off[t];
        }
        struct eval_row row;
        memset(&row, 0, sizeof row);
        double nll, kl;
        int32_t hits;
        rc = score_segment(eng, s, tok, n, n_vocab, ref, is_ref && ref, row0, &nll, &hits, &kl);
        free(tok);
        if (rc) {
            app_fail(cmd, "scoring", rc);
            break;
        }
        row.pi = pi;
        row.case_index = k->index;
        row.item = t;
        row.depth = -1;
        row.n = n;
        row.passed = hits;
        row.answer_logprob = -nll;
        row.answer_tokens = n;
        row.number_logprob = NAN;
        row.ttft_ms = NAN;
        row.nll = n ? nll / n : NAN;
        row.kl = row0 >= 0 && n ? kl / n : (is_ref && ref && n ? 0.0 : NAN);
        fill_session_fields(s, &row);
        if (!(row.reply = calloc(1, 1)) || eval_add_row(res, &row)) {
            free(row.reply);
            rc = KVT_ENOMEM;
        }
    }
    return rc;
}

/* +store: the counts of the queries' sessions added up (peak: the largest). */
static void stats_add(struct kvt_session_stats *into, const struct kvt_session_stats *from) {
    into->evictions += from->evictions;
    into->recoveries += from->recoveries;
    into->tokens_decoded += from->tokens_decoded;
    into->tokens_recovered += from->tokens_recovered;
    into->store_tokens += from->store_tokens;
    into->policy_ms += from->policy_ms;
    into->decode_ms += from->decode_ms;
    if (from->peak_resident_tokens > into->peak_resident_tokens) into->peak_resident_tokens = from->peak_resident_tokens;
}

int eval_run_case(const char *cmd, kvt_engine *eng, kvt_pool *pool, const struct eval_opts *o, int32_t pi,
                  const struct eval_case *k, struct eval_ref *ref, struct eval_results *res) {
    const int32_t policy = o->policies[pi];
    o->el_frac[pi] = 0; /* set again when this run ends: a +random twin never reads a previous case's */
    struct kvt_engine_info info;
    kvt_engine_info(eng, &info);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.policy = policy;
    sp.budget = policy == KVT_POLICY_NO_EVICTION ? o->n_ctx : o->budget;
    sp.block = o->block;
    sp.pool = pool;
    sp.codec_ram = o->codec[pi];
    if (o->variant[pi] != EVAL_PLAIN) { /* live ElasticKV, or its matched-random control */
        sp.elastic_sk = o->el_sk[pi];
        sp.elastic_sv = o->el_sv[pi];
        sp.elastic_random = o->variant[pi] == EVAL_ELASTIC_RANDOM;
        if (sp.elastic_random) { /* the sparsity the twin reached on this case (it ran just before) */
            const double f = o->el_frac[o->el_twin[pi]];
            sp.elastic_random_frac = (float) (f > 0 && f <= 1 ? f : 0);
        }
    }
    if (policy == KVT_POLICY_KVTIER && o->embedder) {
        sp.embedder = o->embedder;
        sp.min_recovery_cosine = o->min_cosine;
    }
    /* +store (ruler followup): every query is a request of its own, a fresh session that finds the
    ** context in a block store the first query's session filled (RAM tier only) */
    const bool by_store = o->variant[pi] == EVAL_STORE;
    kvt_store *store = NULL;
    if (by_store) {
        struct kvt_store_params stp = kvt_store_default_params();
        stp.disk_bytes = 0;
        stp.ram_bytes = (size_t) 1 << 30;
        stp.prefetch_threads = 0;
        int src = kvt_store_open(&stp, &store);
        if (src) {
            app_fail(cmd, "cannot open the RAM block store", src);
            return APP_ERR;
        }
        sp.store = store;
        sp.pool = NULL; /* with a store, the session keeps its block copies there */
    }
    struct kvt_session_stats acc; /* +store: the earlier queries' sessions */
    memset(&acc, 0, sizeof acc);
    double t0 = now_ms();
    kvt_session *s = NULL;
    int rc = kvt_session_open(eng, &sp, &s);
    if (rc) {
        app_fail(cmd, "cannot open the session", rc);
        kvt_store_free(store);
        return APP_ERR;
    }
    int32_t first_row = res->n_rows;
    if (o->task == EVAL_PPL) {
        rc = run_ppl(cmd, eng, s, o, pi, k, ref, res, info.n_vocab);
    } else {
        for (int32_t t = 0; t < k->n_turns && !k->single && rc == 0; t++) {
            if ((rc = kvt_session_add(s, KVT_ROLE_USER, k->turns[t], KVT_KEEP_NONE))) {
                char what[64];
                snprintf(what, sizeof what, "document turn %d of %d", t + 1, k->n_turns);
                app_fail(cmd, what, rc);
            } else if ((rc = kvt_session_add(s, KVT_ROLE_ASSISTANT, EVAL_REPLY, KVT_KEEP_NONE))) {
                app_fail(cmd, "replayed reply", rc);
            }
        }
        for (int32_t q = 0; q < k->n_facts && rc == 0; q++) {
            const struct eval_fact *f = &k->facts[k->probe_order[q]];
            struct eval_row row;
            memset(&row, 0, sizeof row);
            row.pi = pi;
            row.case_index = k->index;
            row.item = q;
            row.depth = f->depth;
            row.nll = row.kl = NAN;
            char *msg = NULL;
            if (by_store && q > 0) { /* the same context, this query at its end, in a new session */
                struct kvt_session_stats one;
                kvt_session_get_stats(s, &one);
                stats_add(&acc, &one);
                kvt_session_free(s);
                s = NULL;
                const char *q0 = k->facts[k->probe_order[0]].question;
                const size_t keep = strlen(k->single) - strlen(q0);
                if (!(msg = malloc(keep + strlen(f->question) + 1))) {
                    rc = KVT_ENOMEM;
                    break;
                }
                memcpy(msg, k->single, keep);
                strcpy(msg + keep, f->question);
                if ((rc = kvt_session_open(eng, &sp, &s))) {
                    app_fail(cmd, "cannot open the session", rc);
                    free(msg);
                    break;
                }
            }
            rc = probe(cmd, eng, s, o, f, q == 0 ? k->single : msg, &row);
            free(msg);
            if (rc) break;
            fill_session_fields(s, &row);
            if (eval_add_row(res, &row)) {
                free(row.reply);
                rc = KVT_ENOMEM;
            }
        }
    }
    struct kvt_session_stats st;
    memset(&st, 0, sizeof st);
    if (s) kvt_session_get_stats(s, &st);
    if (by_store) stats_add(&st, &acc); /* the whole run: every query's session */
    o->el_frac[pi] = st.elastic_eligible ? (double) st.elastic_zero_eligible / (double) st.elastic_eligible : 0;
    struct eval_sess se = { pi,
                            k->index,
                            st.evictions,
                            st.recoveries,
                            st.tokens_decoded,
                            st.tokens_recovered,
                            st.peak_resident_tokens,
                            st.total_tokens,
                            (now_ms() - t0) / 1e3,
                            st.policy_ms,
                            st.decode_ms,
                            rc != 0,
                            st.pool_saved_tokens,
                            st.pool_raw_bytes,
                            st.pool_stored_bytes,
                            st.codec_encode_ms,
                            st.codec_decode_ms };
    kvt_session_free(s);
    kvt_store_free(store);
    if (eval_add_sess(res, &se)) rc = rc ? rc : KVT_ENOMEM;

    /* progress line */
    int32_t n = 0, passed = 0;
    double lp = 0, nll = 0, kl = 0;
    int32_t n_kl = 0;
    for (int32_t i = first_row; i < res->n_rows; i++) {
        n += res->rows[i].n;
        passed += res->rows[i].passed;
        lp += res->rows[i].answer_logprob;
        if (o->task == EVAL_PPL) {
            nll += res->rows[i].nll * res->rows[i].n;
            if (!isnan(res->rows[i].kl)) {
                kl += res->rows[i].kl * res->rows[i].n;
                n_kl += res->rows[i].n;
            }
        }
    }
    int32_t n_rows = res->n_rows - first_row;
    fprintf(stderr, "[%s] case %d/%d", o->task_name, k->index + 1, o->first_case + o->cases);
    if (o->task == EVAL_NIAH) fprintf(stderr, " depth %d%%", k->depth);
    fprintf(stderr, " policy %s: ", o->label[pi]);
    if (rc) {
        fprintf(stderr, "ERROR (%s)", kvt_strerror(rc));
    } else if (o->task == EVAL_NIAH) {
        const struct eval_row *r = &res->rows[first_row];
        fprintf(stderr, "%s, prefix %s, lp %.2f, number lp %.2f, needle %s", passed ? "pass" : "fail",
                r->prefix_passed ? "pass" : "fail", lp, r->number_logprob, eval_fact_state_name(r->fact));
        char *clean = app_utf8_clean(r->reply ? r->reply : "");
        if (clean) {
            for (char *c = clean; *c; c++) *c = (*c == '\n' || *c == '\r' || *c == '\t') ? ' ' : *c;
            app_utf8_cut(clean, 60);
            fprintf(stderr, ", reply \"%s\"", clean);
        }
        free(clean);
    } else if (o->task == EVAL_RULER) {
        int32_t hit = 0, refs = 0;
        for (int32_t i = first_row; i < res->n_rows; i++) {
            hit += res->rows[i].refs_hit;
            refs += res->rows[i].refs;
        }
        fprintf(stderr, "score %d/%d refs over %d quer%s, mean lp %.2f", hit, refs, n_rows, n_rows == 1 ? "y" : "ies",
                n_rows ? lp / n_rows : 0.0);
        if (by_store) fprintf(stderr, ", %lld tokens from the store", (long long) st.store_tokens);
        char *clean = n_rows ? app_utf8_clean(res->rows[first_row].reply ? res->rows[first_row].reply : "") : NULL;
        if (clean) {
            for (char *c = clean; *c; c++) *c = (*c == '\n' || *c == '\r' || *c == '\t') ? ' ' : *c;
            app_utf8_cut(clean, 60);
            fprintf(stderr, ", reply \"%s\"", clean);
        }
        free(clean);
    } else if (o->task == EVAL_MULTIFACT) {
        int32_t pp = 0, nf[4] = { 0 };
        for (int32_t i = first_row; i < res->n_rows; i++) {
            pp += res->rows[i].prefix_passed;
            nf[res->rows[i].fact >= 0 && res->rows[i].fact < 4 ? res->rows[i].fact : 0]++;
        }
        fprintf(stderr, "%d/%d pass, %d/%d prefix pass, mean lp %.2f, facts resident %d recovered %d evicted %d", passed, n, pp, n,
                n_rows ? lp / n_rows : 0.0, nf[EVAL_FACT_RESIDENT], nf[EVAL_FACT_RECOVERED], nf[EVAL_FACT_EVICTED]);
    } else {
        fprintf(stderr, "ppl %.3f, top-1 %d/%d", n ? exp(nll / n) : NAN, passed, n);
        if (n_kl) fprintf(stderr, ", kl %.4f", kl / n_kl);
    }
    fprintf(stderr, " | evictions %lld, recoveries %lld, peak %d, %.1f s", (long long) st.evictions, (long long) st.recoveries,
            st.peak_resident_tokens, se.seconds);
    if (st.elastic_passes)
        fprintf(stderr, " | elastic %lld passes, %.1f ms, zeros %.2f%% of resident K/V, %.2f%% of the thresholded range",
                (long long) st.elastic_passes, st.elastic_ms, 100.0 * (double) st.elastic_zero / (double) st.elastic_elems,
                100.0 * (double) st.elastic_zero_eligible / (double) st.elastic_eligible);
    fprintf(stderr, "\n");
    if (rc) {
        /* a session that failed contributes no partial rows, only an error row */
        for (int32_t i = first_row; i < res->n_rows; i++) free(res->rows[i].reply);
        res->n_rows = first_row;
        struct eval_row row;
        memset(&row, 0, sizeof row);
        row.pi = pi;
        row.case_index = k->index;
        row.depth = k->depth;
        row.error = true;
        row.answer_logprob = row.number_logprob = row.ttft_ms = row.nll = row.kl = NAN;
        row.reply = calloc(1, 1);
        if (!row.reply || eval_add_row(res, &row)) free(row.reply);
        return APP_ERR;
    }
    return APP_OK;
}
