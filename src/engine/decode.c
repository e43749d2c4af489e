/* decode.c — llama_decode for one sequence in ubatch-sized chunks and for rows of several
** sequences in one batch; the logits of the last decode; sampling (llama.cpp's sampler chain,
** GBNF grammar); sequence removal and copy with the position shadow kept in step. */
#include "engine/engine_int.h"
#include "fault.h"
#include "test_hooks.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

bool kvt__engine_seq_ok(const kvt_engine *e, int32_t seq) { return seq >= 0 && seq < e->n_seq_max; }

int kvt_engine_decode(kvt_engine *e, int32_t seq, const kvt_token *tokens, int32_t n, kvt_pos pos0, bool want_logits) {
    if (!kvt__engine_seq_ok(e, seq)) return kvt__fail(KVT_EINVAL, "sequence id %d is outside 0..%d", seq, e->p.n_seq - 1);
    if (n <= 0 || !tokens) return kvt__fail(KVT_EINVAL, "decode of %d tokens", n);
    if (pos0 < 0 || (int64_t) pos0 + n > KVT__MAX_POS)
        return kvt__fail(KVT_EINVAL, "decode of %d tokens at position %d: positions are 0..%d", n, pos0, KVT__MAX_POS - 1);
    kvt_pos pos_buf[4096];
    e->have_logits = false;
    for (int32_t off = 0; off < n; off += e->p.n_ubatch) {
        int32_t m = KVT_MIN(n - off, e->p.n_ubatch);
        struct llama_batch *b = &e->batch;
        for (int32_t i = 0; i < m; i++) {
            if (tokens[off + i] < 0 || tokens[off + i] >= e->info.n_vocab)
                return kvt__fail(KVT_EINVAL, "token %d at index %d is outside the vocabulary of %d", tokens[off + i], off + i,
                                 e->info.n_vocab);
            b->token[i] = tokens[off + i];
            b->pos[i] = pos0 + off + i;
            b->n_seq_id[i] = 1;
            b->seq_id[i][0] = seq;
            b->logits[i] = want_logits && off + i == n - 1;
            if (i < 4096) pos_buf[i] = pos0 + off + i;
        }
        b->n_tokens = m;
        e->capturing = e->n_caps > 0 && seq < e->p.n_seq && m <= 4096;
        e->cur_seq = seq;
        e->cur_n = m;
        e->cur_pos = pos_buf;
        e->cap_ubatch = 0;
        e->cap_rows = m;
        e->ub_seen = -1;
        for (int i = 0; e->capturing && i < e->n_caps; i++) e->caps[i].have = e->caps[i].have_q = false;
        int r = llama_decode(e->ctx, *b);
        e->capturing = false;
        if (r == 1)
            return kvt__fail(KVT_ECTX, "no free KV cells for %d tokens at position %d of sequence %d (%s of %d cells)", m,
                             pos0 + off, seq, e->unified ? "context" : "its stream", e->n_ctx_seq);
        if (r != 0) return kvt__fail(KVT_ELLAMA, "llama_decode returned %d at position %d", r, pos0 + off);
        e->shift_pending = false;
        for (int32_t i = 0; i < m; i++)
            if (kvt__pm_set(&e->pm[seq], pos0 + off + i)) return KVT_ENOMEM;
        e->gen++;
        for (int i = 0; i < e->n_caps; i++)
            if (e->caps[i].have) e->caps[i].gen = e->gen;
    }
    if (want_logits) {
        const float *l = llama_get_logits_ith(e->ctx, -1);
        if (!l) return kvt__fail(KVT_ELLAMA, "llama.cpp returned no logits");
        memcpy(e->logits, l, sizeof(float) * (size_t) e->info.n_vocab);
        e->have_logits = true;
    }
    return 0;
}

/* Order of the batch rows, chosen for llama.cpp's ubatch split (llama-batch.cpp split_equal with
** sequential = true, used with one stream per sequence): a ubatch holds a run of CONSECUTIVE
** sequence ids taken in batch order from the first unused row, and as many tokens of each as
** the one with fewest has.  Rows in ascending sequence order form the fewest runs.  A chunk goes
** between the rows of higher and of lower sequences: the run of the higher ones cannot reach it
** (it starts above it), and when its ubatch begins no row of sequence chunk + 1 is left, so the
** chunk's ubatch is the chunk alone, all of it, exactly as kvt_engine_decode would have decoded it (same
** numbers; its attention is captured as kvt_engine_decode's).  Returns the index of the chunk's ubatch
** (the runs of rows above it).  The unified cache (split_simple: ubatches of n_ubatch rows in
** batch order) gets the chunk first, in ubatch 0 with the rows. */
static int32_t mixed_order(const kvt_engine *e, const int32_t *seqs, int32_t n, int32_t chunk_seq, int32_t *ord,
                           int32_t *chunk_at) {
    for (int32_t i = 0; i < n; i++) ord[i] = i;
    for (int32_t i = 1; i < n; i++) { /* insertion sort by sequence: n <= n_ubatch, nearly sorted */
        int32_t x = ord[i], k = i - 1;
        while (k >= 0 && seqs[ord[k]] > seqs[x]) {
            ord[k + 1] = ord[k];
            k--;
        }
        ord[k + 1] = x;
    }
    if (e->unified || chunk_seq < 0) {
        *chunk_at = 0;
        return 0;
    }
    int32_t n_low = 0;
    while (n_low < n && seqs[ord[n_low]] < chunk_seq) n_low++;
    int32_t tmp[512], runs = 0; /* rotate: the higher rows first, then the lower ones */
    for (int32_t i = 0; i < n; i++) tmp[i] = ord[(i + n_low) % (n > 0 ? n : 1)];
    memcpy(ord, tmp, sizeof(int32_t) * (size_t) n);
    for (int32_t i = 0; i < n - n_low; i++) runs += i == 0 || seqs[ord[i]] != seqs[ord[i - 1]] + 1;
    *chunk_at = n - n_low;
    return runs;
}

int kvt_engine_decode_batch(kvt_engine *e, const int32_t *seqs, const kvt_token *toks, const kvt_pos *pos, int32_t n,
                            float *logits_out, const struct kvt_decode_chunk *c) {
    const int32_t m = c ? c->n : 0;
    if (n < 0 || m < 0 || n + m <= 0 || n + m > KVT_MIN(e->p.n_ubatch, 512) || (n > 0 && (!seqs || !toks || !pos || !logits_out)) ||
        (m > 0 && !c->tokens))
        return kvt__fail(KVT_EINVAL, "mixed decode of %d rows and a chunk of %d tokens (1..%d in all)", n, m,
                         KVT_MIN(e->p.n_ubatch, 512));
    if (m > 0 && (c->seq < 0 || c->seq >= e->p.n_seq))
        return kvt__fail(KVT_EINVAL, "chunk sequence id %d is outside 0..%d", c->seq, e->p.n_seq - 1);
    struct llama_batch *b = &e->batch;
    for (int32_t i = 0; i < n; i++) {
        if (seqs[i] < 0 || seqs[i] >= e->p.n_seq)
            return kvt__fail(KVT_EINVAL, "sequence id %d is outside 0..%d", seqs[i], e->p.n_seq - 1);
        for (int32_t k = 0; k < i; k++)
            if (seqs[k] == seqs[i]) return kvt__fail(KVT_EINVAL, "sequence %d appears twice in one multi-sequence decode", seqs[i]);
        if (m > 0 && seqs[i] == c->seq)
            return kvt__fail(KVT_EINVAL, "sequence %d is both a decode row and the prefill chunk of one decode", seqs[i]);
        if (toks[i] < 0 || toks[i] >= e->info.n_vocab)
            return kvt__fail(KVT_EINVAL, "token %d at index %d is outside the vocabulary of %d", toks[i], i, e->info.n_vocab);
        if (pos[i] < 0 || pos[i] >= KVT__MAX_POS)
            return kvt__fail(KVT_EINVAL, "row %d at position %d: positions are 0..%d", i, pos[i], KVT__MAX_POS - 1);
    }
    if (m > 0 && (c->pos0 < 0 || (int64_t) c->pos0 + m > KVT__MAX_POS))
        return kvt__fail(KVT_EINVAL, "chunk of %d tokens at position %d: positions are 0..%d", m, c->pos0, KVT__MAX_POS - 1);
    for (int32_t i = 0; i < m; i++)
        if (c->tokens[i] < 0 || c->tokens[i] >= e->info.n_vocab)
            return kvt__fail(KVT_EINVAL, "chunk token %d at index %d is outside the vocabulary of %d", c->tokens[i], i,
                             e->info.n_vocab);
    int32_t ord[512], at[512], chunk_at = 0;
    const int32_t ub = mixed_order(e, seqs, n, m > 0 ? c->seq : -1, ord, &chunk_at);
    kvt_pos cpos[512];
    int32_t r = 0;
    for (int32_t k = 0; k <= n; k++) {
        if (k == chunk_at)
            for (int32_t i = 0; i < m; i++, r++) {
                b->token[r] = c->tokens[i];
                b->pos[r] = cpos[i] = c->pos0 + i;
                b->n_seq_id[r] = 1;
                b->seq_id[r][0] = c->seq;
                b->logits[r] = c->want_logits && i == m - 1;
            }
        if (k == n) break;
        const int32_t i = ord[k];
        at[i] = r;
        b->token[r] = toks[i];
        b->pos[r] = pos[i];
        b->n_seq_id[r] = 1;
        b->seq_id[r][0] = seqs[i];
        b->logits[r++] = 1;
    }
    b->n_tokens = r;
    e->have_logits = false;
    /* the chunk's attention: its rows of its ubatch (streams: the chunk alone; unified: rows
    ** 0 .. m-1 of the one ubatch) */
    e->capturing = m > 0 && e->n_caps > 0;
    e->cur_seq = m > 0 ? c->seq : -1;
    e->cur_n = m;
    e->cur_pos = cpos;
    e->cap_ubatch = ub;
    e->cap_rows = e->unified ? r : m;
    e->ub_seen = -1;
    for (int i = 0; e->capturing && i < e->n_caps; i++) e->caps[i].have = e->caps[i].have_q = false;
    int rc = llama_decode(e->ctx, *b);
    e->capturing = false;
    e->cap_ubatch = 0;
    e->cap_rows = 0;
    if (rc == 1)
        return kvt__fail(KVT_ECTX, "no free KV cells for %d rows and a chunk of %d tokens (%s of %d cells)", n, m,
                         e->unified ? "context" : "one sequence's stream", e->n_ctx_seq);
    if (rc != 0) return kvt__fail(KVT_ELLAMA, "llama_decode returned %d for a batch of %d rows and a chunk of %d", rc, n, m);
    e->shift_pending = false;
    for (int32_t i = 0; i < n; i++)
        if (kvt__pm_set(&e->pm[seqs[i]], pos[i])) return KVT_ENOMEM;
    for (int32_t i = 0; i < m; i++)
        if (kvt__pm_set(&e->pm[c->seq], c->pos0 + i)) return KVT_ENOMEM;
    e->gen++;
    for (int32_t i = 0; i < n; i++) e->multi_gen[seqs[i]] = e->gen; /* kvt_attn_get refuses these rows */
    for (int i = 0; m > 0 && i < e->n_caps; i++)
        if (e->caps[i].have) e->caps[i].gen = e->gen;
    for (int32_t i = 0; i < n; i++) {
        const float *l = llama_get_logits_ith(e->ctx, at[i]);
        if (!l) return kvt__fail(KVT_ELLAMA, "llama.cpp returned no logits for batch row %d", i);
        memcpy(logits_out + (size_t) i * e->info.n_vocab, l, sizeof(float) * (size_t) e->info.n_vocab);
    }
    if (m > 0 && c->want_logits) {
        const float *l = llama_get_logits_ith(e->ctx, chunk_at + m - 1);
        if (!l) return kvt__fail(KVT_ELLAMA, "llama.cpp returned no logits for the chunk's last token");
        memcpy(e->logits, l, sizeof(float) * (size_t) e->info.n_vocab);
        e->have_logits = true;
    }
    return 0;
}

const float *kvt_engine_logits(kvt_engine *e) { return e->have_logits ? e->logits : NULL; }

void kvt__engine_set_logits(kvt_engine *e, const float *logits) {
    memcpy(e->logits, logits, sizeof(float) * (size_t) e->info.n_vocab);
    e->have_logits = true;
}

struct kvt_grammar {
    struct llama_sampler *smpl;
};

int kvt_grammar_new(kvt_engine *e, const char *gbnf, const char *root, kvt_grammar **out) {
    *out = NULL;
    if (!gbnf || !*gbnf) return kvt__fail(KVT_EINVAL, "grammar: empty GBNF text");
    kvt_grammar *g = calloc(1, sizeof *g);
    if (!g) return kvt__fail(KVT_ENOMEM, "grammar");
    g->smpl = llama_sampler_init_grammar(e->vocab, gbnf, root ? root : "root");
    if (!g->smpl) {
        free(g);
        return kvt__fail(KVT_EINVAL, "grammar: the GBNF text (%zu bytes) does not parse, or has no rule '%s'", strlen(gbnf),
                         root ? root : "root");
    }
    *out = g;
    return 0;
}

void kvt_grammar_free(kvt_grammar *g) {
    if (!g) return;
    llama_sampler_free(g->smpl);
    free(g);
}

/* The repetition penalties of s over the last window tokens of s->history: llama.cpp's penalties
** sampler (llama-server's, run after logit_bias as in its chain), given the window with
** llama_sampler_accept and applied to the window's distinct tokens only (it leaves every other
** candidate as it is), so a draw costs O(window), not O(n_vocab).  d is indexed by token id with
** p = 0; p marks a token already taken and is 0 again on return.  KVT_ENOMEM. */
static int apply_penalties(const kvt_engine *e, const struct kvt_sampling *s, llama_token_data *d) {
    const int32_t win = kvt_penalty_window(s), nv = e->info.n_vocab;
    if (win == 0 || !s->history || s->n_history <= 0) return 0;
    const float rep = s->repeat_penalty > 0 ? s->repeat_penalty : 1.0f;
    const int32_t n = KVT_MIN(s->n_history, win);
    const kvt_token *h = s->history + (s->n_history - n);
    struct llama_sampler *p = llama_sampler_init_penalties(nv, n, rep, s->frequency_penalty, s->presence_penalty);
    llama_token_data *sub = kvt__fault_check(KVT__FAULT_PENALTIES) ? NULL : malloc(sizeof *sub * (size_t) n);
    if (!p || !sub) {
        if (p) llama_sampler_free(p);
        free(sub);
        return kvt__fail(KVT_ENOMEM, "repetition penalties over %d tokens", n);
    }
    size_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        if (h[i] < 0 || h[i] >= nv) continue;
        llama_sampler_accept(p, h[i]);
        if (d[h[i]].p == 0.0f) {
            d[h[i]].p = 1.0f;
            sub[m++] = d[h[i]];
        }
    }
    llama_token_data_array a = { sub, m, -1, false };
    llama_sampler_apply(p, &a);
    for (size_t k = 0; k < m; k++) d[sub[k].id] = (llama_token_data){ sub[k].id, sub[k].logit, 0.0f };
    llama_sampler_free(p);
    free(sub);
    return 0;
}

/* Whether the breakers b[0..nb) are the bytes t holds (each ended by a zero byte; the lengths were
** compared by the caller). */
static bool dry_same(const char *t, const char *const *b, int32_t nb) {
    for (int32_t i = 0; i < nb; i++) {
        const char *c = b[i] ? b[i] : "";
        const size_t m = strlen(c) + 1;
        if (memcmp(t, c, m)) return false;
        t += m;
    }
    return true;
}

/* DRY over the last kvt_dry_window(s) tokens of s->history (llama.cpp's sampler, as llama-server runs it
** after the penalties): the sampler made for these settings and breakers (one of the engine's last n_seq + 4:
** making one maps the breakers over the whole vocabulary), reset and given the window, then applied to
** cand.
** KVT_ENOMEM. */
static int apply_dry(kvt_engine *e, const struct kvt_sampling *s, llama_token_data *cand) {
    static const char *const def[] = { "\n", ":", "\"", "*" };                           /* llama-server's dry_sequence_breakers */
    const int32_t win = KVT_MIN(kvt_dry_window(s), e->info.n_ctx), nv = e->info.n_vocab; /* no history is longer */
    if (win == 0 || !s->history || s->n_history <= 0) return 0;
    const char *const *b = s->dry_sequence_breakers ? s->dry_sequence_breakers : def;
    const int32_t nb = s->dry_sequence_breakers ? s->n_dry_sequence_breakers : 4;
    uint64_t h = 1469598103934665603ULL; /* FNV-1a over the breakers, each ended by a zero byte */
    size_t len = 0;
    for (int32_t i = 0; i < nb; i++)
        for (const char *c = b[i] ? b[i] : "";; c++, len++) {
            h = (h ^ (uint8_t) *c) * 1099511628211ULL;
            if (!*c) {
                len++;
                break;
            }
        }
    if (e->test_dry_hash) h = 1;
    const float base = s->dry_base > 0 ? s->dry_base : 1.75f;
    struct dry_slot *d = NULL, *lru = &e->dry[0];
    for (int32_t i = 0; i < e->n_dry && !d; i++) {
        struct dry_slot *x = &e->dry[i];
        if (x->s && x->mult == s->dry_multiplier && x->base == base && x->allowed == s->dry_allowed_length && x->win == win &&
            x->hash == h && (e->test_dry_hash == 2 || (x->brk_len == len && dry_same(x->brk, b, nb))))
            d = x;
        else if (!x->s || (lru->s && x->used < lru->used)) lru = x;
    }
    if (!d) {
        d = lru;
        if (d->s) llama_sampler_free(d->s);
        free(d->brk);
        d->s = NULL, d->brk = NULL;
        char *t = kvt__fault_check(KVT__FAULT_PENALTIES) ? NULL : malloc(len ? len : 1);
        if (t) {
            size_t at = 0;
            for (int32_t i = 0; i < nb; i++) {
                const size_t m = strlen(b[i] ? b[i] : "") + 1;
                memcpy(t + at, b[i] ? b[i] : "", m);
                at += m;
            }
            d->s = llama_sampler_init_dry(e->vocab, s->dry_multiplier, base, s->dry_allowed_length, win, (const char **) b,
                                          (size_t) (nb > 0 ? nb : 0));
        }
        if (!d->s) {
            free(t);
            return kvt__fail(KVT_ENOMEM, "DRY sampler");
        }
        d->mult = s->dry_multiplier, d->base = base, d->allowed = s->dry_allowed_length, d->win = win, d->hash = h;
        d->brk = t, d->brk_len = len;
        e->dry_made++;
    }
    d->used = ++e->dry_clock;
    llama_sampler_reset(d->s);
    const int32_t n = KVT_MIN(s->n_history, win);
    const kvt_token *w = s->history + (s->n_history - n);
    for (int32_t i = 0; i < n; i++)
        if (w[i] >= 0 && w[i] < nv) llama_sampler_accept(d->s, w[i]);
    llama_token_data_array a = { cand, (size_t) nv, -1, false };
    llama_sampler_apply(d->s, &a);
    return 0;
}

/* The logits with logit_bias, then the penalties and DRY (not with Mirostat: llama-server's chain then
** has neither).  KVT_ENOMEM. */
static int fill_candidates(kvt_engine *e, const struct kvt_sampling *s, llama_token_data *d) {
    for (int32_t i = 0; i < e->info.n_vocab; i++) d[i] = (llama_token_data){ i, e->logits[i], 0.0f };
    for (int32_t k = 0; k < s->n_logit_bias; k++) {
        kvt_token t = s->logit_bias[k].token;
        if (t >= 0 && t < e->info.n_vocab) d[t].logit += s->logit_bias[k].bias;
    }
    if (s->mirostat == 1 || s->mirostat == 2) return 0;
    return apply_penalties(e, s, d) ? KVT_ENOMEM : apply_dry(e, s, d);
}

/* kvt_sampling.post from the candidates the chain left (the dist sampler normalised their p over
** what top_k / top_p / the grammar kept; greedy sets none: the token alone, p 1). */
static void post_probs(const llama_token_data_array *arr, bool greedy, struct kvt_token_p *post, int32_t k) {
    const llama_token_data *sel = &arr->data[arr->selected];
    post[0] = (struct kvt_token_p){ sel->id, greedy ? 1.0f : sel->p };
    for (int32_t i = 1; i <= k; i++) post[i] = (struct kvt_token_p){ -1, 0.0f };
    if (greedy) {
        post[1] = post[0];
        return;
    }
    int32_t n = 0; /* post[1 .. n]: the largest p so far, sorted (insertion: k is small) */
    for (size_t i = 0; i < arr->size; i++) {
        const float p = arr->data[i].p;
        if (!(p > 0) || isinf(arr->data[i].logit) || (n == k && p <= post[k].p)) continue;
        int32_t at = n < k ? ++n : k;
        while (at > 1 && post[at - 1].p < p) {
            post[at] = post[at - 1];
            at--;
        }
        post[at] = (struct kvt_token_p){ arr->data[i].id, p };
    }
}

/* The generator of draw `draw` of the generation on slot g (a sequence id, or the last slot for
** kvt_engine_sample) seeded with seed: llama.cpp's dist sampler, kept while the generation goes on
** draw after draw, so that a generation's draws are one stream of mt19937(seed), as a llama-server
** slot's (the same seeded tokens as llama-server from the same probabilities; LLAMA_DEFAULT_SEED:
** a random seed per generation).  Another seed, or a draw other than the next one, starts the
** stream again and advances it to the draw (one uniform draw per earlier draw: exact unless an
** earlier draw had a single candidate, which draws none).  NULL when out of memory. */
static struct llama_sampler *gen_rng(kvt_engine *e, int32_t g, uint32_t seed, int64_t draw) {
    struct gen_rng *r = &e->rng[g];
    if (r->dist && r->seed == seed && r->next == draw) return r->dist;
    if (r->dist) llama_sampler_free(r->dist);
    r->dist = llama_sampler_init_dist(seed);
    r->seed = seed;
    r->next = 0;
    if (!r->dist) return NULL;
    llama_token_data two[2] = { { 0, 0.0f, 0.0f }, { 1, 0.0f, 0.0f } };
    for (; r->next < draw; r->next++) {
        llama_token_data_array a = { two, 2, -1, false };
        llama_sampler_apply(r->dist, &a);
    }
    return r->dist;
}

/* What selects the chain (not the grammar, the biases, XTC nor the post output), padding zeroed;
** the seed is not in the chain: each generation has its own generators (gen_rng, gen_xtc). */
static void chain_key(const struct kvt_sampling *s, struct kvt_sampling *key) {
    memset(key, 0, sizeof *key);
    if (!s) return;
    key->temperature = s->temperature;
    key->top_p = s->top_p;
    key->top_k = s->top_k;
    key->min_p = s->min_p;
    key->top_n_sigma = s->top_n_sigma;
    key->typical_p = s->typical_p;
    key->dynatemp_range = s->dynatemp_range;
    key->dynatemp_exponent = s->dynatemp_exponent;
    key->mirostat = s->mirostat;
    key->mirostat_tau = s->mirostat_tau;
    key->mirostat_eta = s->mirostat_eta;
    key->xtc_probability = s->xtc_probability > 0 && s->xtc_threshold <= 0.5f; /* XTC on: greedy's chain is whole */
}

static bool miro_on(const struct kvt_sampling *s) { return s->mirostat == 1 || s->mirostat == 2; }

/* The Mirostat sampler of the generation on slot g (llama.cpp's, v1 with m = 100 as llama-server;
** its generator seeded with the generation's seed), kept draw after draw: mu is the state of the
** generation.  Another setting or seed, or a draw other than the next, starts it again (mu = 2 tau,
** the generator from the seed: mu cannot be replayed without the earlier draws' distributions).
** NULL when out of memory. */
static struct llama_sampler *gen_miro(kvt_engine *e, int32_t g, const struct kvt_sampling *s, int64_t draw) {
    struct gen_rng *r = &e->rng[g];
    const float tau = s->mirostat_tau > 0 ? s->mirostat_tau : 5.0f, eta = s->mirostat_eta > 0 ? s->mirostat_eta : 0.1f;
    if (r->miro && r->miro_v == s->mirostat && r->miro_seed == s->seed && r->miro_tau == tau && r->miro_eta == eta &&
        r->miro_next == draw)
        return r->miro;
    if (r->miro) llama_sampler_free(r->miro);
    r->miro = kvt__fault_check(KVT__FAULT_XTC) ? NULL
              : s->mirostat == 1               ? llama_sampler_init_mirostat(e->info.n_vocab, s->seed, tau, eta, 100)
                                               : llama_sampler_init_mirostat_v2(s->seed, tau, eta);
    r->miro_v = s->mirostat;
    r->miro_seed = s->seed;
    r->miro_tau = tau;
    r->miro_eta = eta;
    r->miro_next = draw;
    return r->miro;
}

static bool xtc_on(const struct kvt_sampling *s) { return s->xtc_probability > 0 && s->xtc_threshold <= 0.5f; }

/* The XTC sampler of the generation on slot g (llama.cpp's, seeded with the generation's seed as
** llama-server seeds its slot's), kept draw after draw as gen_rng keeps the generator; another
** setting, seed or draw starts it again and advances it (one uniform draw per earlier draw, as
** llama.cpp's XTC draws one per draw of two candidates or more).  NULL when out of memory. */
static struct llama_sampler *gen_xtc(kvt_engine *e, int32_t g, const struct kvt_sampling *s, int64_t draw) {
    struct gen_rng *r = &e->rng[g];
    if (r->xtc && r->xtc_seed == s->seed && r->xtc_p == s->xtc_probability && r->xtc_t == s->xtc_threshold && r->xtc_next == draw)
        return r->xtc;
    if (r->xtc) llama_sampler_free(r->xtc);
    r->xtc = kvt__fault_check(KVT__FAULT_XTC) ? NULL : llama_sampler_init_xtc(s->xtc_probability, s->xtc_threshold, 1, s->seed);
    r->xtc_seed = s->seed;
    r->xtc_p = s->xtc_probability;
    r->xtc_t = s->xtc_threshold;
    r->xtc_next = 0;
    if (!r->xtc) return NULL;
    llama_token_data two[2];
    for (; r->xtc_next < draw; r->xtc_next++) {
        two[0] = (llama_token_data){ 0, 0.0f, 0.0f };
        two[1] = (llama_token_data){ 1, 0.0f, 0.0f };
        llama_token_data_array a = { two, 2, -1, false };
        llama_sampler_apply(r->xtc, &a);
    }
    return r->xtc;
}

/* Build e->smpl (top_n_sigma, top_k, typical_p, top_p, min_p: llama-server's order) and e->smpl_t
** (the temperature, dynamic with a range; greedy at temperature <= 0, after the whole chain when
** typical_p or XTC is on, as llama-server's temperature 0 keeps its chain, else alone: the others
** keep the most likely token).  KVT_ENOMEM. */
static int build_chain(kvt_engine *e, const struct kvt_sampling *s) {
    if (e->smpl) llama_sampler_free(e->smpl);
    if (e->smpl_t) llama_sampler_free(e->smpl_t);
    e->smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    e->smpl_t = NULL;
    if (!e->smpl) return kvt__fail(KVT_ENOMEM, "sampler chain");
    const bool typical = s->typical_p > 0 && s->typical_p < 1;
    if (miro_on(s)) { /* llama-server's chain with Mirostat: the temperature, then Mirostat draws */
        e->smpl_t = s->temperature > 0 ? llama_sampler_init_temp(s->temperature) : llama_sampler_init_greedy();
    } else if (s->temperature <= 0 && !typical && !xtc_on(s)) { /* the rest keeps the most likely token */
        e->smpl_t = llama_sampler_init_greedy();
    } else { /* greedy with typical_p or XTC: llama-server's whole chain, greedy for the temperature */
        if (s->top_n_sigma > 0) llama_sampler_chain_add(e->smpl, llama_sampler_init_top_n_sigma(s->top_n_sigma));
        if (s->top_k > 0) llama_sampler_chain_add(e->smpl, llama_sampler_init_top_k(s->top_k));
        if (typical) llama_sampler_chain_add(e->smpl, llama_sampler_init_typical(s->typical_p, 1));
        if (s->top_p < 1.0f) llama_sampler_chain_add(e->smpl, llama_sampler_init_top_p(s->top_p, 1));
        if (s->min_p > 0.0f) llama_sampler_chain_add(e->smpl, llama_sampler_init_min_p(s->min_p, 1));
        e->smpl_t = s->temperature <= 0     ? llama_sampler_init_greedy()
                    : s->dynatemp_range > 0 ? llama_sampler_init_temp_ext(s->temperature, s->dynatemp_range,
                                                                          s->dynatemp_exponent > 0 ? s->dynatemp_exponent : 1.0f)
                                            : llama_sampler_init_temp(s->temperature);
    }
    if (!e->smpl_t) {
        llama_sampler_free(e->smpl);
        e->smpl = NULL;
        return kvt__fail(KVT_ENOMEM, "sampler chain");
    }
    return 0;
}

/* The chain, then the generation's XTC, the temperature and its generator, over arr. */
static void run_chain(kvt_engine *e, struct llama_sampler *xtc, struct llama_sampler *dist, llama_token_data_array *arr) {
    llama_sampler_apply(e->smpl, arr);
    if (xtc) llama_sampler_apply(xtc, arr);
    llama_sampler_apply(e->smpl_t, arr);
    if (dist) llama_sampler_apply(dist, arr);
}

int kvt_engine_sample_at(kvt_engine *e, const struct kvt_sampling *s, int32_t seq, int64_t draw, kvt_token *tok) {
    static const struct kvt_sampling greedy = { .temperature = 0, .top_p = 1 };
    if (!s) s = &greedy;
    if (!e->have_logits) return kvt__fail(KVT_EINVAL, "sample: no logits (decode with want_logits first)");
    if (draw < 0) return kvt__fail(KVT_EINVAL, "sample: draw %lld is negative", (long long) draw);
    if (seq < -1 || seq >= e->n_rng - 1) return kvt__fail(KVT_EINVAL, "sample: sequence id %d", seq);
    struct kvt_sampling key;
    chain_key(s, &key);
    if (!e->smpl || memcmp(&e->smpl_p, &key, sizeof key) != 0) {
        if (build_chain(e, s)) return KVT_ENOMEM;
        e->smpl_p = key;
        e->smpl_draw = 0;
    }
    /* the generation's own generator: a seeded reply is the same alone or beside other generations
    ** on the engine, and the same request again gives it again (a generator kept in the engine's
    ** chain was shared by every caller with the same settings; issue #38) */
    const int32_t g = seq < 0 ? e->n_rng - 1 : seq;
    struct llama_sampler *dist = NULL, *xtc = NULL;
    if (miro_on(s)) { /* Mirostat draws in place of the dist sampler; XTC is not in its chain */
        if (s->temperature > 0 && !(dist = gen_miro(e, g, s, draw))) return kvt__fail(KVT_ENOMEM, "Mirostat sampler");
    } else {
        dist = s->temperature > 0 ? gen_rng(e, g, s->seed, draw) : NULL;
        if (s->temperature > 0 && !dist) return kvt__fail(KVT_ENOMEM, "sampler");
        xtc = xtc_on(s) ? gen_xtc(e, g, s, draw) : NULL;
        if (xtc_on(s) && !xtc) return kvt__fail(KVT_ENOMEM, "XTC sampler");
    }
    const int32_t nv = e->info.n_vocab;
    llama_token_data *d = malloc(sizeof *d * (size_t) nv);
    if (!d) return kvt__fail(KVT_ENOMEM, "sampling candidates");
    if (fill_candidates(e, s, d)) {
        free(d);
        return KVT_ENOMEM;
    }
    llama_token_data_array arr = { d, (size_t) nv, -1, false };
    run_chain(e, xtc, dist, &arr);
    int rc = 0;
    if (arr.selected < 0 || arr.selected >= (int64_t) arr.size) rc = kvt__fail(KVT_ELLAMA, "sampler selected nothing");
    if (rc == 0 && s->grammar) {
        /* cheap path first: keep the token if the grammar allows it (one candidate to check) */
        llama_token_data one = { arr.data[arr.selected].id, 1.0f, 0.0f };
        llama_token_data_array a1 = { &one, 1, -1, false };
        llama_sampler_apply(s->grammar->smpl, &a1);
        if (isinf(one.logit)) { /* rejected: mask the whole vocabulary, then sample again */
            rc = fill_candidates(e, s, d);
            arr = (llama_token_data_array){ d, (size_t) nv, -1, false };
            bool any = false;
            if (rc == 0) {
                llama_sampler_apply(s->grammar->smpl, &arr);
                for (size_t i = 0; i < arr.size && !any; i++) any = !isinf(arr.data[i].logit);
                if (!any) rc = kvt__fail(KVT_EINVAL, "sample: the grammar allows no token here");
            }
            if (rc == 0) {
                run_chain(e, xtc, dist, &arr);
                if (arr.selected < 0 || arr.selected >= (int64_t) arr.size || isinf(arr.data[arr.selected].logit))
                    rc = kvt__fail(KVT_ELLAMA, "sampler selected nothing the grammar allows");
            }
        }
    }
    if (rc == 0) {
        *tok = arr.data[arr.selected].id;
        if (s->post && s->n_post > 0) post_probs(&arr, s->temperature <= 0, s->post, s->n_post);
        llama_sampler_accept(e->smpl, *tok);
        llama_sampler_accept(e->smpl_t, *tok);
        if (s->grammar) llama_sampler_accept(s->grammar->smpl, *tok);
    }
    if (dist && miro_on(s)) e->rng[g].miro_next = rc == 0 ? draw + 1 : -1;
    else if (dist) e->rng[g].next = rc == 0 ? draw + 1 : -1; /* a failed draw: the stream starts again */
    if (xtc) e->rng[g].xtc_next = rc == 0 ? draw + 1 : -1;
    free(d);
    return rc;
}

int kvt_engine_sample(kvt_engine *e, const struct kvt_sampling *s, kvt_token *tok) {
    struct kvt_sampling key; /* the draws of one stream: counted while the settings and seed stay */
    chain_key(s, &key);
    const struct gen_rng *r = &e->rng[e->n_rng - 1];
    const bool same_xtc = !s || !xtc_on(s) || (r->xtc && r->xtc_p == s->xtc_probability && r->xtc_t == s->xtc_threshold);
    const bool same = e->smpl && !memcmp(&e->smpl_p, &key, sizeof key) && (!s || e->smpl_p_seed == s->seed) && same_xtc;
    const int64_t draw = same ? e->smpl_draw : 0;
    int rc = kvt_engine_sample_at(e, s, -1, draw, tok);
    if (rc == 0) {
        e->smpl_draw = draw + 1;
        e->smpl_p_seed = s ? s->seed : 0;
    }
    return rc;
}

int kvt_seq_rm(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1) {
    if (!kvt__engine_seq_ok(e, seq)) return kvt__fail(KVT_EINVAL, "sequence id %d", seq);
    llama_memory_seq_rm(llama_get_memory(e->ctx), seq, p0, p1);
    kvt__pm_clear(&e->pm[seq], p0, p1);
    e->gen++;
    return 0;
}

int kvt_seq_cp(kvt_engine *e, int32_t src, int32_t dst, kvt_pos p0, kvt_pos p1) {
    if (!kvt__engine_seq_ok(e, src) || !kvt__engine_seq_ok(e, dst) || src == dst)
        return kvt__fail(KVT_EINVAL, "seq_cp from %d to %d: ids must differ and be in 0..%d", src, dst, e->n_seq_max - 1);
    if (!e->unified) return kvt__engine_seq_cp_host(e, src, dst, p0, p1); /* llama.cpp aborts on a partial one */
    llama_memory_seq_cp(llama_get_memory(e->ctx), src, dst, p0, p1);
    struct posmap *s = &e->pm[src];
    kvt_pos lo = p0 < 0 ? 0 : p0, hi = (p1 < 0 || p1 > s->cap) ? s->cap : p1;
    for (kvt_pos p = lo; p < hi; p++)
        if (s->bits[p >> 3] & (1u << (p & 7)))
            if (kvt__pm_set(&e->pm[dst], p)) return KVT_ENOMEM;
    e->gen++;
    return 0;
}

int kvt_seq_shift(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_pos delta) {
    if (!kvt__engine_seq_ok(e, seq) || seq >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "seq_shift: sequence id %d", seq);
    if (p0 < 0 || p1 <= p0) return kvt__fail(KVT_EINVAL, "seq_shift: empty range [%d, %d)", p0, p1);
    if (p0 + delta < 0) return kvt__fail(KVT_EINVAL, "seq_shift: position %d moved by %d would be negative", p0, delta);
    if (delta == 0) return 0;
    struct posmap *m = &e->pm[seq];
#define PM_HAS(p) ((p) >= 0 && (p) < m->cap && (m->bits[(p) >> 3] & (1u << (7 & (p)))))
    for (kvt_pos p = p0 + delta; p < p1 + delta; p++)
        if ((p < p0 || p >= p1) && PM_HAS(p))
            return kvt__fail(KVT_EINVAL, "seq_shift: target position %d of sequence %d is occupied", p, seq);
    int32_t n = 0;
    for (kvt_pos p = p0; p < p1; p++) n += PM_HAS(p) ? 1 : 0;
    kvt_pos *moved = malloc(sizeof(kvt_pos) * (size_t) (n > 0 ? n : 1));
    if (!moved) return kvt__fail(KVT_ENOMEM, "seq_shift: %d positions", n);
    n = 0;
    for (kvt_pos p = p0; p < p1; p++)
        if (PM_HAS(p)) moved[n++] = p;
#undef PM_HAS
    /* grow the map before touching the cache, so that nothing can fail after llama.cpp moved */
    if (n > 0 && kvt__pm_set(m, moved[n - 1] + (delta > 0 ? delta : 0)) != 0) {
        free(moved);
        return KVT_ENOMEM;
    }
    if (n > 0 && delta > 0) kvt__pm_clear(m, moved[n - 1] + delta, moved[n - 1] + delta + 1);
    /* streams mode with host re-anchoring: rotate on the host and write the sequence back, so no
    ** shift is ever pending (a pending shift needs a decode in a scratch stream to land) */
    const bool host = !e->unified && e->info.reanchor == KVT_REANCHOR_HOST;
    int rc = 0;
    if (n > 0 && host) rc = kvt__engine_seq_shift_host(e, seq, p0, p1, delta);
    else llama_memory_seq_add(llama_get_memory(e->ctx), seq, p0, p1, delta);
    if (rc) {
        free(moved);
        return rc;
    }
    kvt__pm_clear(m, p0, p1);
    for (int32_t i = 0; i < n; i++) kvt__pm_set(m, moved[i] + delta); /* cannot fail: the map covers it */
    free(moved);
    if (n > 0 && !host) e->shift_pending = true;
    e->gen++;
    return 0;
}

kvt_pos kvt_seq_pos_max(kvt_engine *e, int32_t seq) { return kvt__engine_seq_ok(e, seq) ? kvt__pm_max(&e->pm[seq]) : -1; }

int32_t kvt_seq_n_cells(kvt_engine *e, int32_t seq) { return kvt__engine_seq_ok(e, seq) ? e->pm[seq].n : 0; }

void kvt_engine_test_dry_hash(kvt_engine *e, int mode) { e->test_dry_hash = mode; }
int64_t kvt_engine_test_dry_made(const kvt_engine *e) { return e->dry_made; }
