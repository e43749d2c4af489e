/* cmd_bench_chunks.c — `kvtier bench chunks`: what non-prefix chunk reuse costs in quality.
**
** Issue #12's --chunk-reuse would key blocks by their own tokens only (position-free), load them
** anywhere in a prompt at their new positions (RoPE re-anchoring), and re-decode the first k
** tokens of each reused chunk in context (EPIC's boundary recompute, Hu et al. 2024).  This
** measures it before it exists, with the public block primitives only.  Per case (seeded):
**   prompt   BOS + instruction, D documents (consecutive essay sentences, about --doc-tokens
**            tokens each, one with a planted "The secret code of <name> is <number>." as in
**            `kvtier eval niah`), then "Question: ... Answer: The secret code of <name> is";
**            the answer is " <number>.".  Every piece is tokenized alone and the token arrays
**            concatenated, so a document has the same tokens wherever it stands.  The documents
**            stand in a random permutation (the needle's document anywhere).
**   ref      full prefill of the prompt; then the answer teacher-forced one token at a time,
**            keeping the next-token distribution before each answer token.
**   chunks   each document prefilled ALONE from position 0 (no BOS: its position-free KV as a
**            chunk cache would have stored it when first seen), and for every k the range
**            [k, n) saved with kvt_block_save right away (Gemma 3: while its SWA cells exist).
**   k        instruction decoded; per document in prompt order: its first k tokens decoded at
**            their new positions, then the saved [k, n) loaded after them (kvt_block_load
**            re-anchors by the new offset); the question decoded; the answer teacher-forced.
**            k = P% takes ceil(P% of the document) first tokens: CacheBlend's (Yao et al. 2025)
**            15 % recompute ratio as a reference point only, since CacheBlend chooses the tokens
**            by KV deviation, not the first ones.  k = all decodes everything in the same pieces
**            (a sanity check: KL must be ~0).
**   drop     control: instruction, the needle's document only, question (full prefill).
** Per config and case: KL(ref || config) in nats averaged over the answer's tokens, the answer's
** log-probability minus the reference's, greedy match (every answer token is the argmax, i.e.
** greedy decoding reproduces the answer), top-1 agreement with the reference per answer token,
** and the fraction of prompt tokens run through the model (the cost).  Means with 95 % t
** intervals over cases (Wilson for the match rate).  One engine, one sequence, streams mode. */
#include "cli.h"
#include "eval.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#define MAX_DOCS 8
#define MAX_KS   16
#define MAX_ANS  24
#define K_ALL    (-1000) /* config code: decode every token (k = n) */
#define K_DROP   (-2000) /* config code: the drop-the-other-documents control */
#define K_OFF    (-3000) /* config code (--live): chunk_reuse off (prefix reuse only) */

struct cfg {
    int32_t k; /* >= 0 tokens; -P for P percent; K_ALL; K_DROP */
    char label[24];
    /* per-case values */
    double *kl, *dlogp, *agree, *frac, *ms;
    int *match;
};

struct doc {
    kvt_token *tok;
    int32_t n;
    kvt_blob *blob[MAX_KS]; /* [k_i, n) saved from the standalone prefill, per config (NULL: none) */
};

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Tokens of doc d that config c decodes in context. */
static int32_t cfg_k(const struct cfg *c, int32_t n) {
    if (c->k == K_ALL) return n;
    int32_t k = c->k >= 0 ? c->k : (int32_t) ceil(-c->k * (double) n / 100.0);
    return k > n ? n : k;
}

/* "0,4,16,64,15%" -> configs (then all and drop appended by the caller). */
static int parse_ks(const char *cmd, const char *s, struct cfg *c, int *n) {
    *n = 0;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        bool pct = end != p && *end == '%';
        if (pct) end++;
        if (end == p || (*end && *end != ',') || errno == ERANGE || v < 0 || v > (pct ? 100 : 1 << 20)) {
            size_t len = strcspn(p, ",");
            fprintf(stderr, "%s: --ks element '%.*s' is neither a token count nor a percentage 0%%..100%% (in '%s')\n", cmd,
                    (int) len, p, s);
            return APP_USAGE;
        }
        if (*n >= MAX_KS - 2) {
            fprintf(stderr, "%s: --ks lists more than %d values\n", cmd, MAX_KS - 2);
            return APP_USAGE;
        }
        c[*n].k = pct ? -(int32_t) v : (int32_t) v;
        if (pct && v == 0) c[*n].k = 0;
        snprintf(c[*n].label, sizeof c[*n].label, pct ? "k=%ld%%" : "k=%ld", v);
        (*n)++;
        if (!*end) return APP_OK;
        p = end + 1;
    }
}

/* Append tokens of text to *buf (growing it). */
static int push_text(kvt_engine *eng, const char *text, bool bos, kvt_token **buf, int32_t *n) {
    kvt_token *t = NULL;
    int32_t nt = 0;
    int rc = kvt_tokenize(eng, text, bos, false, &t, &nt);
    if (rc) return rc;
    kvt_token *nb = realloc(*buf, sizeof *nb * (size_t) (*n + nt + 1));
    if (!nb) {
        free(t);
        return KVT_ENOMEM;
    }
    memcpy(nb + *n, t, sizeof *t * (size_t) nt);
    *buf = nb;
    *n += nt;
    free(t);
    return KVT_OK;
}

/* log-softmax of the engine's last logits into out[n_vocab] (double). */
static int logsoftmax(kvt_engine *eng, int32_t n_vocab, double *out) {
    const float *l = kvt_engine_logits(eng);
    if (!l) return KVT_EINVAL;
    double mx = -INFINITY, s = 0;
    for (int32_t v = 0; v < n_vocab; v++) mx = l[v] > mx ? l[v] : mx;
    for (int32_t v = 0; v < n_vocab; v++) s += exp(l[v] - mx);
    double lse = mx + log(s);
    for (int32_t v = 0; v < n_vocab; v++) out[v] = l[v] - lse;
    return KVT_OK;
}

static int32_t argmax(const double *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++) b = x[i] > x[b] ? i : b;
    return b;
}

/* With the question's logits in the engine at position pos: teacher-force ans[0..m), writing the
** log-distribution before each answer token into lp[j * n_vocab ...]. */
static int teacher_force(kvt_engine *eng, int32_t n_vocab, const kvt_token *ans, int32_t m, kvt_pos pos, double *lp) {
    int rc = KVT_OK;
    for (int32_t j = 0; j < m && !rc; j++) {
        if ((rc = logsoftmax(eng, n_vocab, lp + (size_t) j * n_vocab))) break;
        if (j + 1 < m) rc = kvt_engine_decode(eng, 0, &ans[j], 1, pos + j, true);
    }
    return rc;
}

/* Mean and 95 % t half-width of x[0..n). */
static void mean_ci(const double *x, int n, double *mean, double *half) {
    static const double T[] = { 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                                2.201,  2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
                                2.080,  2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042 };
    double s = 0, ss = 0;
    for (int i = 0; i < n; i++) s += x[i];
    *mean = n ? s / n : NAN;
    for (int i = 0; i < n; i++) ss += (x[i] - *mean) * (x[i] - *mean);
    if (n < 2) {
        *half = NAN;
        return;
    }
    double t = n - 1 <= 30 ? T[n - 2] : 1.96;
    *half = t * sqrt(ss / (n - 1)) / sqrt(n);
}

static void usage(FILE *f, const struct cli_opt *opts) {
    fprintf(f, "Usage: kvtier bench chunks [-m MODEL] [options]\n"
               "\n"
               "Measures non-prefix chunk reuse (issue #12): RAG-style prompts of --docs documents in a\n"
               "random order with a planted fact; each document's KV computed alone from position 0, loaded\n"
               "at its new position (RoPE re-anchoring) with its first k tokens re-decoded in context (EPIC\n"
               "boundary recompute). Per k: KL(full prefill || reuse) over the teacher-forced answer tokens,\n"
               "answer log-prob difference, greedy answer match, fraction of prompt tokens decoded. Also\n"
               "k=all (everything decoded: KL ~ 0, a sanity check) and 'drop' (only the needle's document).\n"
               "MODEL defaults to $KVTIER_MODEL; texts to $KVT_SOURCE_DIR/../shared/data/pg_essays.\n"
               "Progress goes to stderr.\n"
               "\n"
               "Options:\n");
    cli_print_opts(f, opts);
}

struct run {
    const char *cmd;
    kvt_engine *eng;
    int32_t n_vocab;
    struct cfg *cfg;
    int n_cfg;
    bool chunk_bos;
    bool live;     /* --live: through sessions with kvt_session_params.chunk_reuse */
    int32_t block; /* --live: session block size */
};

/* --live, one case: the documents' texts in their original order (session 1, which stores the
** chunk keys) and in the case's permutation (session 2, measured), through kvt_session_add with
** chunk_reuse and chunk_recompute as `kvtier serve --chunk-reuse` sets them, a fresh RAM-only
** store per config.  Reference: a session without a store (a full prefill).  Per config:
** KL(reference || session 2) of the next-token distribution after the prompt, the answer's
** teacher-forced log-prob minus the reference's (kvt_session_answer_logprob), whether the greedy
** reply (16 tokens) equals the reference's (agree) and holds the number (match), and the prompt
** tokens decoded (frac) and loaded as chunks (ms column reused) over the prompt. */
static int run_live(struct run *R, int ci, char *const *dtext, int32_t n_docs, const int *perm, const char *instr,
                    const char *question, const char *answer, const char *number, double *ref_logp, int *ref_match) {
    const int32_t V = R->n_vocab;
    struct kvt_engine_info I;
    kvt_engine_info(R->eng, &I);
    size_t cap = strlen(instr) + 1;
    for (int32_t d = 0; d < n_docs; d++) cap += strlen(dtext[d]);
    char *sys[2] = { malloc(cap), malloc(cap) };
    float *ref = malloc(sizeof(float) * (size_t) V);
    char *ref_reply = NULL;
    int rc = sys[0] && sys[1] && ref ? 0 : KVT_ENOMEM;
    for (int o = 0; o < 2 && !rc; o++) {
        strcpy(sys[o], instr);
        for (int32_t d = 0; d < n_docs; d++) strcat(sys[o], dtext[o ? perm[d] : d]);
    }
    struct kvt_sampling smp = { .temperature = 0, .top_p = 1.0f };
    for (int c = -1; c < R->n_cfg && !rc; c++) { /* c = -1: the reference */
        struct cfg *cf = c >= 0 ? &R->cfg[c] : NULL;
        kvt_store *st = NULL;
        struct kvt_store_params stp = kvt_store_default_params();
        stp.disk_bytes = 0; /* RAM only: nothing of one config is seen by the next */
        if (cf && (rc = kvt_store_open(&stp, &st))) break;
        char spec[32];
        if (cf && cf->k >= 0) snprintf(spec, sizeof spec, "%d", cf->k);
        else if (cf) snprintf(spec, sizeof spec, "%d%%", -cf->k);
        kvt_session *s = NULL;
        double logp = 0, t0 = now_ms();
        int32_t n_ans = 0;
        char *reply = NULL;
        struct kvt_session_stats ss;
        for (int o = cf ? 0 : 1; o < 2 && !rc; o++) {
            struct kvt_session_params sp = kvt_session_default_params();
            sp.budget = I.n_ctx_seq;
            sp.block = R->block;
            sp.store = st;
            sp.chunk_reuse = cf && cf->k != K_OFF;
            sp.chunk_recompute = sp.chunk_reuse ? spec : NULL;
            if ((rc = kvt_session_open(R->eng, &sp, &s))) break;
            if (!(rc = kvt_session_add(s, KVT_ROLE_SYSTEM, sys[o], KVT_KEEP_NONE)) &&
                !(rc = kvt_session_add(s, KVT_ROLE_USER, question, KVT_KEEP_NONE)) && o == 1) {
                kvt_session_get_stats(s, &ss);
                const float *l = kvt_session_logits(s);
                if (!cf) memcpy(ref, l, sizeof(float) * (size_t) V);
                else {
                    double mr = -INFINITY, ml = -INFINITY, zr = 0, zl = 0, kl = 0;
                    for (int32_t v = 0; v < V; v++) {
                        mr = fmax(mr, ref[v]);
                        ml = fmax(ml, l[v]);
                    }
                    for (int32_t v = 0; v < V; v++) {
                        zr += exp(ref[v] - mr);
                        zl += exp(l[v] - ml);
                    }
                    for (int32_t v = 0; v < V; v++) {
                        double a = ref[v] - mr - log(zr), b = l[v] - ml - log(zl);
                        kl += exp(a) * (a - b);
                    }
                    cf->kl[ci] = kl;
                    cf->ms[ci] = ss.chunk_tokens / (double) ss.total_tokens;
                    cf->frac[ci] = ss.tokens_decoded / (double) ss.total_tokens;
                }
                if (!rc) rc = kvt_session_answer_logprob(s, answer, &logp, &n_ans);
                if (!rc) rc = kvt_session_generate(s, 16, &smp, NULL, NULL, &reply);
            }
            kvt_session_free(s);
            s = NULL;
        }
        kvt_store_free(st);
        if (rc) {
            free(reply);
            break;
        }
        if (!cf) {
            *ref_logp = logp;
            *ref_match = strstr(reply, number) != NULL;
            ref_reply = reply;
            fprintf(stderr, "[bench chunks] case %d reference reply '%s'\n", ci, reply);
            continue;
        }
        cf->dlogp[ci] = logp - *ref_logp;
        cf->agree[ci] = !strcmp(reply, ref_reply);
        cf->match[ci] = strstr(reply, number) != NULL;
        fprintf(stderr,
                "[bench chunks] case %d %-8s KL %.5f dlogp %+.3f same reply %d match %d decoded %.3f chunks %.3f "
                "(%.0f ms)\n",
                ci, cf->label, cf->kl[ci], cf->dlogp[ci], (int) cf->agree[ci], cf->match[ci], cf->frac[ci], cf->ms[ci],
                now_ms() - t0);
        free(reply);
    }
    if (rc) app_fail(R->cmd, "live case failed", rc);
    free(sys[0]);
    free(sys[1]);
    free(ref);
    free(ref_reply);
    return rc ? APP_ERR : APP_OK;
}

/* One case: build, reference, chunks, every config.  Returns APP_OK or APP_ERR (printed). */
static int run_case(struct run *R, struct eval_corpus *corpus, int32_t seed, int ci, int32_t n_docs, int32_t doc_tokens,
                    double *ref_lp, double *lp, int *ref_match, double *ref_logp) {
    kvt_engine *eng = R->eng;
    const int32_t V = R->n_vocab;
    struct eval_rng r;
    eval_rng_init(&r, (uint64_t) seed, "chunks", ci);
    char name[16] = "", number[16], needle[96], question[192], answer[32];
    static const char C[] = "bdfgklmnprstvz", Vw[] = "aeiou";
    for (int i = 0; i < 3; i++) {
        name[2 * i] = C[eval_rng_below(&r, sizeof C - 1)];
        name[2 * i + 1] = Vw[eval_rng_below(&r, sizeof Vw - 1)];
    }
    name[0] = (char) (name[0] - 'a' + 'A');
    snprintf(number, sizeof number, "%u", 10000u + eval_rng_below(&r, 90000u));
    snprintf(needle, sizeof needle, "The secret code of %s is %s.", name, number);
    snprintf(question, sizeof question, "Question: What is the secret code of %s?\nAnswer: The secret code of %s is", name, name);
    snprintf(answer, sizeof answer, " %s.", number);

    int32_t needle_doc = (int32_t) eval_rng_below(&r, (uint32_t) n_docs);
    int used[MAX_DOCS], perm[MAX_DOCS];
    struct doc docs[MAX_DOCS];
    memset(docs, 0, sizeof docs);
    kvt_token *instr = NULL, *q = NULL, *ans = NULL, *prompt = NULL;
    char *dtext[MAX_DOCS] = { 0 };
    static const char instr_text[] = "Read the documents below and answer the question at the end.\n\n";
    int32_t n_instr = 0, n_q = 0, n_ans = 0, n_prompt = 0;
    int rc = push_text(eng, instr_text, true, &instr, &n_instr);
    if (!rc) rc = push_text(eng, question, false, &q, &n_q);
    if (!rc) rc = push_text(eng, answer, false, &ans, &n_ans);
    if (!rc && n_ans > MAX_ANS) n_ans = MAX_ANS;
    char *text = NULL;
    for (int32_t d = 0; d < n_docs && !rc; d++) {
        /* a distinct essay with enough sentences, a random start, sentences up to doc_tokens */
        int e;
        for (int tries = 0;; tries++) { /* essays of > 8 sentences first; any unused one after 1000 tries */
            e = (int) eval_rng_below(&r, (uint32_t) corpus->n);
            bool dup = false;
            for (int j = 0; j < d; j++) dup |= used[j] == e;
            if (!dup && (corpus->e[e].n_sent > 8 || (tries > 1000 && corpus->e[e].n_sent > 0))) break;
        }
        used[d] = e;
        const struct eval_essay *es = &corpus->e[e];
        int32_t s0 = (int32_t) eval_rng_below(&r, (uint32_t) (es->n_sent / 2));
        size_t cap = (size_t) doc_tokens * 16 + 256, len = 0;
        if (!(text = dtext[d] = malloc(cap))) {
            rc = KVT_ENOMEM;
            break;
        }
        len = (size_t) snprintf(text, cap, "Document:\n");
        int32_t budget = doc_tokens - (d == needle_doc ? eval_count_tokens(eng, needle) + 1 : 0), got = 0;
        int32_t n_sent = 0, plant = -1;
        for (int32_t s = s0; s < es->n_sent; s++) {
            char *sent = strndup(es->text + es->s_off[s], (size_t) es->s_len[s]);
            int32_t t = sent ? eval_count_tokens(eng, sent) + 1 : -1;
            free(sent);
            if (t < 0) {
                rc = KVT_ENOMEM;
                break;
            }
            if (got + t > budget && n_sent > 0) break;
            if (len + (size_t) es->s_len[s] + 2 + sizeof needle + 8 >= cap) break; /* room for the needle */
            len += (size_t) snprintf(text + len, cap - len, "%s%.*s", n_sent ? " " : "", es->s_len[s], es->text + es->s_off[s]);
            got += t;
            n_sent++;
        }
        if (d == needle_doc) { /* plant at a random sentence boundary: rebuild with the needle */
            plant = (int32_t) eval_rng_below(&r, (uint32_t) n_sent + 1);
            len = (size_t) snprintf(text, cap, "Document:\n");
            for (int32_t s = 0; s <= n_sent; s++) {
                if (s == plant) len += (size_t) snprintf(text + len, cap - len, "%s%s", s ? " " : "", needle);
                if (s < n_sent)
                    len += (size_t) snprintf(text + len, cap - len, "%s%.*s", s || plant == 0 ? " " : "", es->s_len[s0 + s],
                                             es->text + es->s_off[s0 + s]);
            }
        }
        snprintf(text + len, cap - len, "\n\n");
        if (!rc) rc = push_text(eng, text, false, &docs[d].tok, &docs[d].n);
    }
    for (int32_t d = 0; d < n_docs; d++) perm[d] = d;
    for (int32_t d = n_docs - 1; d > 0; d--) {
        int j = (int) eval_rng_below(&r, (uint32_t) d + 1), t = perm[d];
        perm[d] = perm[j];
        perm[j] = t;
    }
    /* the prompt */
    int32_t total = n_instr + n_q;
    for (int32_t d = 0; d < n_docs; d++) total += docs[d].n;
    if (!rc && !(prompt = malloc(sizeof *prompt * (size_t) total))) rc = KVT_ENOMEM;
    if (!rc) {
        memcpy(prompt, instr, sizeof *instr * (size_t) n_instr);
        n_prompt = n_instr;
        for (int32_t i = 0; i < n_docs; i++) {
            const struct doc *dd = &docs[perm[i]];
            memcpy(prompt + n_prompt, dd->tok, sizeof *dd->tok * (size_t) dd->n);
            n_prompt += dd->n;
        }
        memcpy(prompt + n_prompt, q, sizeof *q * (size_t) n_q);
        n_prompt += n_q;
    }
    if (!rc) fprintf(stderr, "[bench chunks] case %d: %d prompt tokens, docs", ci, n_prompt);
    for (int32_t i = 0; i < n_docs && !rc; i++) fprintf(stderr, " %d%s", docs[perm[i]].n, perm[i] == needle_doc ? "*" : "");
    if (!rc) fprintf(stderr, " (* needle), answer %d tokens\n", n_ans);

    if (R->live) {
        if (!rc)
            rc = run_live(R, ci, dtext, n_docs, perm, instr_text, question, answer, number, ref_logp, ref_match) ? KVT_EINVAL : 0;
        goto done;
    }
    /* reference */
    double t0 = now_ms();
    kvt_seq_rm(eng, 0, -1, -1);
    if (!rc) rc = kvt_engine_decode(eng, 0, prompt, n_prompt, 0, true);
    double ref_ms = now_ms() - t0;
    if (!rc) rc = teacher_force(eng, V, ans, n_ans, n_prompt, ref_lp);
    if (!rc) {
        *ref_logp = 0;
        *ref_match = 1;
        for (int32_t j = 0; j < n_ans; j++) {
            *ref_logp += ref_lp[(size_t) j * V + ans[j]];
            *ref_match &= argmax(ref_lp + (size_t) j * V, V) == ans[j];
        }
    }
    /* chunks: each document alone from position 0 (after BOS with --chunk-bos), [k, n) saved */
    const int32_t off = R->chunk_bos ? 1 : 0;
    for (int32_t d = 0; d < n_docs && !rc; d++) {
        kvt_seq_rm(eng, 0, -1, -1);
        if (off) rc = kvt_engine_decode(eng, 0, instr, 1, 0, false);
        if (!rc) rc = kvt_engine_decode(eng, 0, docs[d].tok, docs[d].n, off, false);
        for (int c = 0; c < R->n_cfg && !rc; c++) {
            if (R->cfg[c].k == K_DROP) continue;
            int32_t k = cfg_k(&R->cfg[c], docs[d].n);
            if (k < docs[d].n) rc = kvt_block_save(eng, 0, off + k, off + docs[d].n, &docs[d].blob[c]);
        }
    }
    /* configs */
    for (int c = 0; c < R->n_cfg && !rc; c++) {
        struct cfg *cf = &R->cfg[c];
        int32_t decoded = n_instr + n_q, pos;
        kvt_seq_rm(eng, 0, -1, -1);
        t0 = now_ms();
        rc = kvt_engine_decode(eng, 0, instr, n_instr, 0, false);
        pos = n_instr;
        if (cf->k == K_DROP) {
            const struct doc *dd = &docs[needle_doc];
            if (!rc) rc = kvt_engine_decode(eng, 0, dd->tok, dd->n, pos, false);
            pos += dd->n;
            decoded += dd->n;
        } else {
            for (int32_t i = 0; i < n_docs && !rc; i++) {
                const struct doc *dd = &docs[perm[i]];
                int32_t k = cfg_k(cf, dd->n);
                if (k > 0) rc = kvt_engine_decode(eng, 0, dd->tok, k, pos, false);
                if (!rc && k < dd->n) rc = kvt_block_load(eng, dd->blob[c], 0, pos + k);
                pos += dd->n;
                decoded += k;
            }
        }
        if (!rc) rc = kvt_engine_decode(eng, 0, q, n_q, pos, true);
        cf->ms[ci] = now_ms() - t0;
        pos += n_q;
        if (!rc) rc = teacher_force(eng, V, ans, n_ans, pos, lp);
        if (rc) break;
        double kl = 0, logp = 0;
        int agree = 0, match = 1;
        for (int32_t j = 0; j < n_ans; j++) {
            const double *a = ref_lp + (size_t) j * V, *b = lp + (size_t) j * V;
            double s = 0;
            for (int32_t v = 0; v < V; v++) s += exp(a[v]) * (a[v] - b[v]);
            kl += s;
            logp += b[ans[j]];
            int32_t am = argmax(b, V);
            agree += am == argmax(a, V);
            match &= am == ans[j];
        }
        cf->kl[ci] = kl / n_ans;
        cf->dlogp[ci] = logp - *ref_logp;
        cf->agree[ci] = (double) agree / n_ans;
        cf->match[ci] = match;
        cf->frac[ci] = (double) decoded / n_prompt;
        fprintf(stderr, "[bench chunks] case %d %-8s KL %.5f dlogp %+.3f match %d decoded %.3f (%.0f ms; ref %.0f ms)\n", ci,
                cf->label, cf->kl[ci], cf->dlogp[ci], match, cf->frac[ci], cf->ms[ci], ref_ms);
    }
    if (rc) app_fail(R->cmd, "case failed", rc);
done:
    kvt_seq_rm(eng, 0, -1, -1);
    for (int32_t d = 0; d < n_docs; d++) free(dtext[d]);
    for (int32_t d = 0; d < n_docs; d++) {
        free(docs[d].tok);
        for (int c = 0; c < MAX_KS; c++) kvt_blob_free(docs[d].blob[c]);
    }
    free(instr);
    free(q);
    free(ans);
    free(prompt);
    return rc ? APP_ERR : APP_OK;
}

int cmd_bench_chunks(int argc, char **argv) {
    static const char cmd[] = "kvtier bench chunks";
    const char *model = getenv("KVTIER_MODEL"), *texts = NULL, *ks = "0,4,16,64,15%";
    int32_t cases = 12, n_docs = 4, doc_tokens = 300, seed = 1, threads = 0;
    bool json = false, verbose = false, quick = false, chunk_bos = false, live = false;
    int32_t block = 64;
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        { "model", 'm', OPT_STR, &model, 0, 0, "MODEL", "GGUF model file (default $KVTIER_MODEL)", NULL },
        { "cases", 0, OPT_INT, &cases, 2, 1000, "N", "prompts (seeded cases) (default 12)", NULL },
        { "docs", 0, OPT_INT, &n_docs, 1, MAX_DOCS, "N", "documents per prompt (default 4)", NULL },
        { "doc-tokens", 0, OPT_INT, &doc_tokens, 16, 4096, "N", "tokens per document, about (default 300)", NULL },
        { "ks", 0, OPT_STR, &ks, 0, 0, "LIST",
          "tokens re-decoded at the start of each chunk: counts or percentages (default 0,4,16,64,15%)", NULL },
        { "chunk-bos", 0, OPT_FLAG, &chunk_bos, 0, 0, NULL,
          "prefill each document alone after a BOS token (default: from position 0 without one)", NULL },
        { "live", 0, OPT_FLAG, &live, 0, 0, NULL,
          "through sessions with chunk_reuse (kvtier serve --chunk-reuse --chunk-recompute K): session 1 stores the "
          "documents in their order, session 2 reads them permuted; KL of the next token, reply agreement",
          NULL },
        { "block", 0, OPT_INT, &block, 1, 4096, "N", "--live: session block size (default 64)", NULL },
        { "seed", 0, OPT_INT, &seed, 0, 2147483647, "N", "case seed (default 1)", NULL },
        { "quick", 0, OPT_FLAG, &quick, 0, 0, NULL, "smoke test: 2 cases, 2 documents of 48 tokens, k 0,4,15%", NULL },
        { "threads", 't', OPT_INT, &threads, 0, 1024, "N", "CPU threads (default 0 = all cores)", NULL },
        { "texts", 0, OPT_STR, &texts, 0, 0, "DIR", "essay directory (default ../shared/data/pg_essays)", NULL },
        { "json", 0, OPT_FLAG, &json, 0, 0, NULL, "print the results as one JSON object on the last stdout line", NULL },
        { "verbose", 'v', OPT_FLAG, &verbose, 0, 0, NULL, "llama.cpp's log on stderr", NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */
    int n_pos;
    int rc = cli_parse(cmd, opts, argc, argv, NULL, 0, &n_pos);
    if (rc < 0) {
        usage(stdout, opts);
        return APP_OK;
    }
    if (rc) return rc;
    if (quick) {
        cases = 2;
        n_docs = 2;
        doc_tokens = 48;
        ks = "0,4,15%";
    }
    struct cfg cfg[MAX_KS];
    memset(cfg, 0, sizeof cfg);
    int n_cfg = 0;
    if ((rc = parse_ks(cmd, ks, cfg, &n_cfg))) return rc;
    if (live) {
        cfg[n_cfg].k = K_OFF;
        snprintf(cfg[n_cfg++].label, sizeof cfg[0].label, "off");
    } else {
        cfg[n_cfg].k = K_ALL;
        snprintf(cfg[n_cfg++].label, sizeof cfg[0].label, "k=all");
        cfg[n_cfg].k = K_DROP;
        snprintf(cfg[n_cfg++].label, sizeof cfg[0].label, "drop");
    }
    if (!model || !*model) {
        fprintf(stderr, "%s: no model given (use -m MODEL or set KVTIER_MODEL)\n", cmd);
        return APP_USAGE;
    }
    struct eval_corpus corpus;
    if ((rc = eval_corpus_load(cmd, texts, &corpus))) return rc;
    if (corpus.n < n_docs) {
        fprintf(stderr, "%s: '%s' has %d essays, fewer than --docs %d\n", cmd, corpus.dir, corpus.n, n_docs);
        eval_corpus_free(&corpus);
        return APP_USAGE;
    }
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = model;
    ep.n_ctx = n_docs * (doc_tokens + 128) + 512;
    ep.n_seq = 1;
    ep.n_threads = threads;
    ep.verbose = verbose;
    kvt_engine *eng = NULL;
    if ((rc = kvt_engine_open(&ep, &eng))) {
        fprintf(stderr, "%s: %s\n", cmd, *kvt_errmsg() ? kvt_errmsg() : kvt_strerror(rc));
        eval_corpus_free(&corpus);
        return rc == KVT_EINVAL ? APP_USAGE : APP_ERR;
    }
    struct kvt_engine_info info;
    kvt_engine_info(eng, &info);
    int n_threads = threads > 0 ? threads : (int) sysconf(_SC_NPROCESSORS_ONLN);
    struct eval_stamp st;
    eval_stamp_fill(&st, &info, model, n_threads);
    if (info.n_swa > 0 && doc_tokens + 64 > info.n_swa)
        fprintf(stderr,
                "%s: warning: documents of up to %d tokens pass the sliding window (%d); a saved chunk may "
                "lack SWA cells and fail to load\n",
                cmd, doc_tokens + 64, info.n_swa);
    fprintf(stderr, "%s: %s | %d cases x %d documents of ~%d tokens | %d configs | swa %d | reanchor %s\n", cmd, info.desc, cases,
            n_docs, doc_tokens, n_cfg, info.n_swa, info.reanchor == KVT_REANCHOR_HOST ? "host" : "seq_add");
    const size_t V = (size_t) info.n_vocab;
    double *ref_lp = malloc(sizeof(double) * V * MAX_ANS), *lp = malloc(sizeof(double) * V * MAX_ANS);
    double *ref_logp = calloc((size_t) cases, sizeof(double));
    int *ref_match = calloc((size_t) cases, sizeof(int));
    bool oom = !ref_lp || !lp || !ref_logp || !ref_match;
    for (int c = 0; c < n_cfg && !oom; c++) {
        struct cfg *cf = &cfg[c];
        cf->kl = calloc((size_t) cases * 5, sizeof(double));
        cf->match = calloc((size_t) cases, sizeof(int));
        if (!cf->kl || !cf->match) oom = true;
        else {
            cf->dlogp = cf->kl + cases;
            cf->agree = cf->kl + 2 * cases;
            cf->frac = cf->kl + 3 * cases;
            cf->ms = cf->kl + 4 * cases;
        }
    }
    struct run R = { cmd, eng, info.n_vocab, cfg, n_cfg, chunk_bos, live, block };
    if (oom) {
        fprintf(stderr, "%s: out of memory\n", cmd);
        rc = APP_ERR;
    }
    double t_start = now_ms();
    for (int ci = 0; ci < cases && !rc; ci++)
        rc = run_case(&R, &corpus, seed, ci, n_docs, doc_tokens, ref_lp, lp, &ref_match[ci], &ref_logp[ci]);
    double wall_s = (now_ms() - t_start) / 1e3;
    kvt_engine_free(eng);
    eval_corpus_free(&corpus);
    free(ref_lp);
    free(lp);

    if (!rc) {
        int ref_k = 0;
        double ref_m, ref_h;
        for (int i = 0; i < cases; i++) ref_k += ref_match[i];
        mean_ci(ref_logp, cases, &ref_m, &ref_h);
        double rlo, rhi;
        eval_wilson(ref_k, cases, &rlo, &rhi);
        json_t *arr = json ? json_array() : NULL;
        if (!json) {
            printf("# kvtier bench chunks | %s | %s | kvtier commit %s | %s | %s | %d threads | swa %d | %d cases x %d docs"
                   " of ~%d tokens%s | seed %d | %.0f s\n",
                   st.model, st.llama, st.commit, st.date, st.machine, n_threads, info.n_swa, cases, n_docs, doc_tokens,
                   chunk_bos ? " (chunks prefilled after BOS)" : "", seed, wall_s);
            printf("# reference (full prefill): greedy match %d/%d [%.2f, %.2f], answer log-prob %.3f +- %.3f nats\n", ref_k, cases,
                   rlo, rhi, ref_m, ref_h);
            if (live)
                printf("# --live: KL of the next token after the prompt; match = the greedy reply holds the number; "
                       "same = the reply equals the reference's; chunks = prompt tokens loaded as chunks\n");
            printf("%-8s %9s %21s %20s %20s %14s %8s %8s\n", "config", "decoded", live ? "KL nats (next token)" : "KL nats/token",
                   "dlogp answer", live ? "reply match" : "greedy match", live ? "same reply" : "top1 agree", "KL max",
                   live ? "chunks" : "ms");
        }
        for (int c = 0; c < n_cfg; c++) {
            const struct cfg *cf = &cfg[c];
            double klm, klh, dm, dh, am, ah, fm, fh, mm, mh, klmax = 0;
            int mk = 0;
            for (int i = 0; i < cases; i++) {
                mk += cf->match[i];
                klmax = cf->kl[i] > klmax ? cf->kl[i] : klmax;
            }
            mean_ci(cf->kl, cases, &klm, &klh);
            mean_ci(cf->dlogp, cases, &dm, &dh);
            mean_ci(cf->agree, cases, &am, &ah);
            mean_ci(cf->frac, cases, &fm, &fh);
            mean_ci(cf->ms, cases, &mm, &mh);
            double lo, hi;
            eval_wilson(mk, cases, &lo, &hi);
            if (json) {
                json_t *o = json_pack("{s:s, s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:i, s:f, s:f, s:f, s:f, s:f}", "config", cf->label,
                                      "k", cf->k, "decoded_frac", fm, "kl_mean", klm, "kl_ci95", klh, "kl_max", klmax, "dlogp_mean",
                                      dm, "dlogp_ci95", dh, "match", mk, "match_lo", lo, "match_hi", hi, "top1_agree", am,
                                      "top1_agree_ci95", ah, "ms_mean", mm);
                if (!o || json_array_append_new(arr, o)) rc = APP_ERR;
            } else {
                printf(live ? "%-8s %9.3f %10.5f +- %7.5f %8.3f +- %7.3f %3d/%-3d [%.2f, %.2f] %6.3f+-%5.3f %8.5f %8.3f\n"
                            : "%-8s %9.3f %10.5f +- %7.5f %8.3f +- %7.3f %3d/%-3d [%.2f, %.2f] %6.3f+-%5.3f %8.5f %8.0f\n",
                       cf->label, fm, klm, klh, dm, dh, mk, cases, lo, hi, am, ah, klmax, mm);
            }
        }
        if (json) {
            json_t *obj = arr ? json_pack("{s:s, s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:b, s:f, s:i, s:f, "
                                          "s:f, s:o}",
                                          "model", st.model, "llama_cpp", st.llama, "commit", st.commit, "date", st.date, "machine",
                                          st.machine, "threads", n_threads, "swa", info.n_swa, "cases", cases, "docs", n_docs,
                                          "doc_tokens", doc_tokens, "seed", seed, "chunk_bos", chunk_bos, "wall_s", wall_s,
                                          "ref_match", ref_k, "ref_logp_mean", ref_m, "ref_logp_ci95", ref_h, "configs", arr)
                              : NULL;
            rc = app_json_line(cmd, obj);
        }
    }
    for (int c = 0; c < n_cfg; c++) {
        free(cfg[c].kl);
        free(cfg[c].match);
    }
    free(ref_logp);
    free(ref_match);
    return rc;
}
