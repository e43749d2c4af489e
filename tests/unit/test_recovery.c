/* test_recovery — what comes back before a user turn.
**
** Novel-term query (pure): the terms of a message that no resident text holds, as BM25 sees them.
** Successor rule (Gemma 3 270M): a fact is cut on purpose at a block boundary — the name at the
** end of one block, the number at the start of the next — and evicted; the question names only
** the person, so only the first half matches it.  Both halves must come back, in order, right
** before the question, and the number's log-probability must beat the same session with
** successor_blocks = 0 (control: only the name's half comes back) and with recovery off.
** The recovery planner alone returns the list naming both halves and changes no cell.
** The same inside one user message longer than the budget (its own blocks evicted during its
** prefill, recovered before the reply by its end), with the same controls.
** Dense recovery (Gemma 3 270M as its own embedder): the evicted block with the highest cosine to
** the question, measured here with kvt_embedder_embed, is recovered, by a linear scan and through the
** HNSW index (ann_min_blocks 1); with min_recovery_cosine 1.0 nothing is (the threshold binds).
** The resident half (Gemma 3 270M): the same cut fact with the name's half resident and the
** number's half evicted (lifted out, as the policy evicts it); every term of the question is
** resident, so the novel-term rule finds nothing.  The number's half must come back right after
** the name's half, both at the tail, and the number's log-probability must beat the control (the
** rule off through test_hooks.h: the number's half stays evicted). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h"          /* what the library shares internally: the tests call it too */
#include "session/session_int.h" /* the recovery planner, called alone */
#include "test_hooks.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvt_engine *open_real(void) {
    const char *m = getenv("KVTIER_MODEL");
    if (!m || !*m) return NULL;
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = m;
    p.n_ctx = 2048;
    kvt_engine *e = NULL;
    assert_int_equal(kvt_engine_open(&p, &e), 0);
    return e;
}

static void test_novel_terms(void **state) {
    (void) state;
    const char *ctx[] = { "Here is some code and a number.", "Please answer briefly." };
    char *q = NULL;
    assert_int_equal(kvt_bm25_novel_terms("What is the secret code of Tavoren? Answer with the number.", ctx, 2, &q), 0);
    assert_string_equal(q, "secret tavoren"); /* stop words gone, case folded, covered terms gone */
    free(q);
    assert_int_equal(kvt_bm25_novel_terms("the code, the CODE", ctx, 2, &q), 0);
    assert_string_equal(q, ""); /* everything covered */
    free(q);
    assert_int_equal(kvt_bm25_novel_terms("vault vault kestrel", NULL, 0, &q), 0);
    assert_string_equal(q, "vault kestrel"); /* each term once */
    free(q);
}

/* Filler that never mentions the fact's words. */
static const char *filler[] = {
    "Rivers carry sediment from the mountains to the sea, and over thousands of years the deltas they build "
    "change the shape of coastlines, create fertile plains for farming, and shift as floods cut new channels.",
    "Bread rises because yeast ferments sugars in the dough and releases carbon dioxide, which the gluten "
    "network traps in small bubbles; baking then sets the structure and browns the crust.",
    "Chess openings are studied for centuries: players learn to control the centre, develop knights and "
    "bishops early, castle the king to safety, and avoid moving the same piece twice without reason.",
    "Glaciers grind rock into fine flour as they move, and when they melt the meltwater turns lakes a milky "
    "turquoise colour that hikers photograph every summer in the high valleys.",
    "Lighthouses once needed keepers who trimmed wicks and wound clockwork every few hours through the night, "
    "until electric lamps and automatic rotation made the job unnecessary.",
    "Honeybees communicate the direction and distance of flowers with a waggle dance on the comb, and the "
    "other foragers follow that dance to find the nectar source.",
};

/* Tokens of the formatted conversation so far (the session's own bookkeeping). */
static int32_t total_tokens(kvt_session *s) {
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    return st.total_tokens;
}

/* The padding that cuts "Kelvarin's locker" | " number is 58213." at a block boundary: the last
** user message "<lead>so so ... Kelvarin's locker" after before[0..n_before), formatted by the
** chat template and tokenized, must end exactly at a block boundary past the sink block and past
** min_tokens.  OUT out[n_out]: that message.  Returns whether a padding of < 150 words does it. */
static bool pad_to_boundary(kvt_engine *e, int32_t block, const struct kvt_chat_msg *before, int32_t n_before, const char *lead,
                            int32_t min_tokens, char *out, size_t n_out) {
    for (int32_t pad = 0; pad < 150; pad++) {
        snprintf(out, n_out, "%s", lead);
        for (int32_t k = 0; k < pad; k++) strncat(out, "so ", n_out - strlen(out) - 1);
        strncat(out, "Kelvarin's locker", n_out - strlen(out) - 1);
        struct kvt_chat_msg cm[4];
        assert_true(n_before < 4);
        for (int32_t k = 0; k < n_before; k++) cm[k] = before[k];
        cm[n_before] = (struct kvt_chat_msg){ "user", out };
        char *fmt = NULL;
        assert_int_equal(kvt_chat_format(e, cm, n_before + 1, false, "gemma", &fmt), 0);
        char *end = strstr(fmt, "Kelvarin's locker");
        assert_non_null(end);
        end[strlen("Kelvarin's locker")] = '\0';
        kvt_token *tok = NULL;
        int32_t n = 0;
        assert_int_equal(kvt_tokenize(e, fmt, true, true, &tok, &n), 0);
        free(tok);
        free(fmt);
        if (n % block == 0 && n >= 2 * block && n > min_tokens) return true;
    }
    return false;
}

/* kvt_session_params.explain collected: every line, and the session's evictions at its end */
static char g_explain[1 << 16];
static size_t g_explain_len;
static int64_t g_evictions;
static void collect_explain(void *ud, const char *line) {
    (void) ud;
    g_explain_len += (size_t) snprintf(g_explain + g_explain_len, sizeof g_explain - g_explain_len, "%s\n", line);
    if (g_explain_len >= sizeof g_explain) g_explain_len = sizeof g_explain - 1;
}

static int64_t count_lines(const char *prefix) {
    int64_t n = 0;
    for (const char *p = g_explain; (p = strstr(p, prefix)); p++) n += p == g_explain || p[-1] == '\n';
    return n;
}

/* The number's log-prob after the teacher-forced "Kelvarin's locker number is"; OUT *recoveries
** (the session's); frees the session. */
static double number_logprob_free(kvt_session *s, int64_t *recoveries) {
    double lp_all = 0, lp_pre = 0;
    int32_t n1 = 0, n2 = 0;
    assert_int_equal(kvt_session_answer_logprob(s, "Kelvarin's locker number is 58213.", &lp_all, &n1), 0);
    assert_int_equal(kvt_session_answer_logprob(s, "Kelvarin's locker number is", &lp_pre, &n2), 0);
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    *recoveries = st.recoveries;
    g_evictions = st.evictions;
    kvt_session_free(s);
    return lp_all - lp_pre;
}

/* The block holding "Kelvarin" (*a, its index returned) and the one after it (*b); when the cut
** landed (split_ok), *b holds the number and not the name. */
static int32_t fact_halves(kvt_session *s, bool split_ok, struct kvt_block_info *a, struct kvt_block_info *b) {
    int32_t n_b = kvt_session_n_blocks(s), first = -1;
    for (int32_t i = 0; i < n_b && first < 0; i++) {
        kvt_session_block(s, i, a);
        if (strstr(a->text, "Kelvarin")) first = i;
    }
    if (!(first > 0 && first + 1 < n_b)) printf("  fact block %d of %d\n", first, n_b);
    assert_true(first > 0 && first + 1 < n_b);
    kvt_session_block(s, first, a);
    kvt_session_block(s, first + 1, b);
    if (split_ok) {
        assert_non_null(strstr(b->text, "58213"));
        assert_null(strstr(b->text, "Kelvarin"));
    }
    return first;
}

/* A session at budget 384 with the given recovery and successor_blocks; OUT *sp its params. */
static kvt_session *open_split_session(kvt_engine *e, int32_t recovery, int32_t successors, struct kvt_session_params *sp) {
    *sp = kvt_session_default_params();
    sp->budget = 384;
    sp->recovery = recovery;
    sp->successor_blocks = successors;
    sp->explain = collect_explain;
    g_explain_len = 0;
    g_explain[0] = '\0';
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, sp, &s), 0);
    return s;
}

/* The session's first exchanges: a filler turn, then the fact "... Kelvarin's locker number is
** 58213." padded so that "Kelvarin's locker" ends a block (the padding found by tokenizing), each
** answered "Noted.".  Returns whether the cut landed as planned. */
static bool add_cut_fact(kvt_engine *e, kvt_session *s, int32_t block) {
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, filler[0], KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "Noted.", KVT_KEEP_NONE), 0);
    char msg[2048];
    const struct kvt_chat_msg before[2] = { { "user", filler[0] }, { "assistant", "Noted." } };
    const bool split_ok = pad_to_boundary(e, block, before, 2, "", total_tokens(s), msg, sizeof msg);
    char full[2200];
    snprintf(full, sizeof full, "%s number is 58213. Please keep that in mind.", msg);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, full, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "Noted.", KVT_KEEP_NONE), 0);
    return split_ok;
}

/* A session at budget 384 whose fact "... Kelvarin's locker number is 58213." is cut after
** "Kelvarin's locker" at a block boundary, then buried under filler.  Returns the log-prob of
** the answer's number after the question; *split_ok tells that the cut landed as planned. */
static double split_fact_session(kvt_engine *e, int32_t recovery, int32_t successors, bool *split_ok, int64_t *recoveries) {
    struct kvt_session_params sp;
    kvt_session *s = open_split_session(e, recovery, successors, &sp);
    *split_ok = add_cut_fact(e, s, sp.block);
    for (int32_t k = 1; k < 18; k++) { /* ~950 tokens after the fact */
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, filler[k % 6], KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "Noted.", KVT_KEEP_NONE), 0);
    }
    /* both halves are evicted by now */
    struct kvt_block_info a, b;
    const int32_t first = fact_halves(s, *split_ok, &a, &b);
    assert_int_not_equal(a.residency, KVT_RES_DEVICE);
    assert_int_not_equal(b.residency, KVT_RES_DEVICE);

    if (recovery == KVT_RECOVERY_KV_RESTORE && successors > 0) {
        /* the planner alone: a list naming the fact's two blocks, and no cell, block or residency
        ** changed by making it (kvt__sess_recover_apply, not the planner, loads) */
        const int32_t cells0 = kvt_seq_n_cells(e, 0), n_b0 = kvt_session_n_blocks(s);
        int32_t res0[512];
        for (int32_t i = 0; i < n_b0 && i < 512; i++) res0[i] = s->b[i].info.residency;
        struct rplan rp;
        assert_int_equal(kvt__sess_plan_recover(s, "Which locker does Kelvarin have?", 12, &rp), 0);
        bool has_a = false, has_b = false;
        for (int32_t k = 0; k < rp.n_c; k++) {
            has_a |= rp.c[k].i == first;
            has_b |= rp.c[k].i == first + 1;
        }
        assert_true(has_a && has_b && rp.where == RPLAN_TAIL);
        assert_int_equal(kvt_seq_n_cells(e, 0), cells0);
        assert_int_equal(kvt_session_n_blocks(s), n_b0);
        for (int32_t i = 0; i < n_b0 && i < 512; i++) assert_int_equal(s->b[i].info.residency, res0[i]);
        free(rp.c);
    }
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "Which locker does Kelvarin have?", KVT_KEEP_NONE), 0);
    kvt_session_block(s, first, &a);
    kvt_session_block(s, first + 1, &b);
    if (recovery == KVT_RECOVERY_KV_RESTORE && successors == 0) {
        assert_int_equal(a.residency, KVT_RES_DEVICE); /* only the half that matches the question */
        assert_int_not_equal(b.residency, KVT_RES_DEVICE);
    } else if (recovery == KVT_RECOVERY_KV_RESTORE) {
        /* both halves back, in their original order, adjacent */
        assert_int_equal(a.residency, KVT_RES_DEVICE);
        assert_int_equal(b.residency, KVT_RES_DEVICE);
        assert_int_equal(b.p0, a.p0 + a.n_tokens);
        /* the plan said so (kvt_session_params.explain): the hit and its successor, in a line
        ** of the last turn's recovery */
        char want[64];
        snprintf(want, sizeof want, " blk%d=", a.id);
        const char *last = strstr(g_explain, "recover ");
        for (const char *p = last; p && (p = strstr(p + 1, "recover "));) last = p;
        assert_non_null(last);
        const char *eol = strchr(last, '\n');
        const char *ha = strstr(last, want);
        snprintf(want, sizeof want, " blk%d=", b.id);
        const char *hb = strstr(last, want);
        assert_true(ha && hb && ha < eol && hb < eol);
    }
    const int64_t n_evict_lines = count_lines("evict blk"), n_feed = count_lines("feed ");
    const double lp = number_logprob_free(s, recoveries);
    printf("  explain: %lld evict lines (%lld evictions), %lld runs fed\n", (long long) n_evict_lines, (long long) g_evictions,
           (long long) n_feed);
    assert_int_equal(n_evict_lines, g_evictions); /* one line per eviction, no more */
    assert_true(n_feed >= 40);                    /* 21 user turns and their prefixes, 20 replies */
    return lp;
}

static void test_successor_recovered(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    bool split[3];
    int64_t rec[3];
    double lp = split_fact_session(e, KVT_RECOVERY_KV_RESTORE, 1, &split[0], &rec[0]);
    double lp_hit = split_fact_session(e, KVT_RECOVERY_KV_RESTORE, 0, &split[1], &rec[1]);
    double lp_off = split_fact_session(e, KVT_RECOVERY_DISCARD, 1, &split[2], &rec[2]);
    printf("  fact cut at a block boundary: %s; number log-prob %.2f with its successor block recovered (%lld blocks in "
           "the session), %.2f with only the hit (%lld), %.2f with no recovery\n",
           split[0] ? "yes" : "no", lp, (long long) rec[0], lp_hit, (long long) rec[1], lp_off);
    assert_true(split[0] && split[1] && split[2]); /* the set-up really cut the fact */
    assert_int_equal(rec[2], 0);
    assert_true(rec[0] >= 2);
    assert_true(lp > lp_off + 2.0); /* the number came back with the block that holds it */
    assert_true(lp > lp_hit + 2.0); /* control: without the successor rule it does not */
    kvt_engine_free(e);
}

/* The same cut fact inside ONE user message longer than the budget (a document with the question
** at its end, as a RAG prompt or a pasted file): its own blocks are evicted while it is prefilled,
** and before the reply the ones its end asks about come back (recover_own_tail, by recover()'s
** rule).  Returns the number's log-prob; *a_back / *b_back: the name's and the number's blocks are
** resident at the reply, *adjacent: in order, next to each other. */
static double own_tail_session(kvt_engine *e, int32_t recovery, int32_t successors, bool *split_ok, bool *a_back, bool *b_back,
                               bool *adjacent, int64_t *recoveries) {
    struct kvt_session_params sp;
    kvt_session *s = open_split_session(e, recovery, successors, &sp);
    /* pad so that "Kelvarin's locker" ends a block, as in split_fact_session */
    char head[2048], lead[1024];
    snprintf(lead, sizeof lead, "%s ", filler[0]);
    *split_ok = pad_to_boundary(e, sp.block, NULL, 0, lead, 0, head, sizeof head);
    char *msg = malloc(16384);
    assert_non_null(msg);
    snprintf(msg, 16384, "%s number is 58213. Please keep that in mind.", head);
    for (int32_t k = 1; k < 13; k++) { /* ~800 tokens after the fact, the message ~950 > the budget */
        strcat(msg, " ");
        strcat(msg, filler[k % 6]);
    }
    strcat(msg, " Now the question about the lockers. Which locker does Kelvarin have?");
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
    free(msg);
    struct kvt_block_info a, b;
    fact_halves(s, *split_ok, &a, &b);
    assert_true(a.n_evictions > 0 && b.n_evictions > 0); /* both halves left during the prefill */
    *a_back = a.residency == KVT_RES_DEVICE;
    *b_back = b.residency == KVT_RES_DEVICE;
    *adjacent = *a_back && *b_back && b.p0 == a.p0 + a.n_tokens;
    /* the message's end stays last: the block holding the question is resident after every
    ** recovered block (issue #23: loaded after the question, between the end of the user's turn
    ** and the reply, the recovered text made models go on with the document) */
    struct kvt_block_info q, x;
    int32_t qi = -1;
    for (int32_t i = kvt_session_n_blocks(s) - 1; i >= 0 && qi < 0; i--)
        if (kvt_session_block(s, i, &q) == 0 && q.text && strstr(q.text, "Kelvarin have")) qi = i;
    assert_true(qi >= 0);
    if (q.residency != KVT_RES_DEVICE) /* what went where, to see why */
        for (int32_t i = 0; i < kvt_session_n_blocks(s); i++)
            if (kvt_session_block(s, i, &x) == 0)
                printf("  block %d: p0 %d n %d res %d ev %d rec %d \"%.40s\"\n", i, x.p0, x.n_tokens, x.residency, x.n_evictions,
                       x.n_recoveries, x.text ? x.text : "");
    assert_int_equal(q.residency, KVT_RES_DEVICE);
    for (int32_t i = 0; i < kvt_session_n_blocks(s); i++)
        if (kvt_session_block(s, i, &x) == 0 && x.residency == KVT_RES_DEVICE && x.n_recoveries > 0) assert_true(x.p0 < q.p0);
    return number_logprob_free(s, recoveries);
}

static void test_own_tail_successor(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    bool split[3], a[3], b[3], adj[3];
    int64_t rec[3];
    double lp = own_tail_session(e, KVT_RECOVERY_KV_RESTORE, 1, &split[0], &a[0], &b[0], &adj[0], &rec[0]);
    double lp_hit = own_tail_session(e, KVT_RECOVERY_KV_RESTORE, 0, &split[1], &a[1], &b[1], &adj[1], &rec[1]);
    double lp_off = own_tail_session(e, KVT_RECOVERY_DISCARD, 1, &split[2], &a[2], &b[2], &adj[2], &rec[2]);
    printf("  one message over the budget, fact cut at a block boundary: %s; number log-prob %.2f with the successor "
           "(%lld recoveries, name %s, number %s), %.2f with only the hit (%lld, number %s), %.2f with no recovery\n",
           split[0] ? "yes" : "no", lp, (long long) rec[0], a[0] ? "back" : "out", b[0] ? "back" : "out", lp_hit,
           (long long) rec[1], b[1] ? "back" : "out", lp_off);
    assert_true(split[0] && split[1] && split[2]);
    assert_true(a[0] && b[0] && adj[0]); /* both halves, in order, adjacent */
    assert_true(a[1] && !b[1]);          /* control: the hit only */
    assert_int_equal(rec[2], 0);
    assert_true(lp > lp_off + 2.0);
    assert_true(lp > lp_hit + 2.0);
    kvt_engine_free(e);
}

static const char *topics[] = {
    "Volcanoes erupt when magma from deep inside the earth rises through cracks in the crust, releasing lava, "
    "ash and gas; some eruptions are explosive and others pour out slow rivers of molten rock.",
    "A good sourdough loaf needs a lively starter, a long cold fermentation of the dough, careful shaping, "
    "and a very hot oven with steam so that the crust blisters and the crumb stays open.",
    "The violin has four strings tuned in fifths; players press the strings against the fingerboard and draw "
    "a bow strung with horsehair across them to make the instrument sing.",
    "Penguins live almost entirely in the southern hemisphere; they cannot fly, but their wings have become "
    "flippers that let them swim fast under water while hunting fish and krill.",
    "The stock market lets companies raise money by selling shares; prices move with expectations about "
    "future profits, interest rates and the general mood of investors.",
    "Tennis matches are scored in points, games and sets; a player must win a game by two points, and a set "
    "usually by two games, with a tie-break at six games all.",
};

static int64_t dense_session(kvt_engine *e, kvt_embedder *em, float min_cos, int32_t ann_min, int32_t *best_back) {
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 384;
    sp.embedder = em;
    sp.min_recovery_cosine = min_cos;
    sp.ann_min_blocks = ann_min;
    sp.top_k = 1;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    for (int32_t k = 0; k < 12; k++) { /* ~700 tokens: the first topics are evicted */
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, k < 6 ? topics[k] : filler[k - 6], KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "Noted.", KVT_KEEP_NONE), 0);
    }
    const char *question = "Tell me again about molten rock coming out of a mountain.";
    /* the evicted blocks before the question, and their cosine to it */
    int32_t n_b = kvt_session_n_blocks(s), best = -1, dim = kvt_embedder_dim(em);
    double best_cos = -2;
    float *qv = malloc(sizeof(float) * (size_t) dim), *bv = malloc(sizeof(float) * (size_t) dim);
    assert_non_null(qv);
    assert_non_null(bv);
    assert_int_equal(kvt_embedder_embed(em, question, qv), 0);
    for (int32_t i = 0; i < n_b; i++) {
        struct kvt_block_info b;
        kvt_session_block(s, i, &b);
        if (b.residency != KVT_RES_HOST && b.residency != KVT_RES_DISK) continue;
        assert_int_equal(kvt_embedder_embed(em, b.text, bv), 0);
        double c = 0;
        for (int32_t d = 0; d < dim; d++) c += (double) qv[d] * bv[d];
        if (c > best_cos) {
            best_cos = c;
            best = i;
        }
    }
    free(qv);
    free(bv);
    assert_true(best >= 0);
    struct kvt_session_stats st0, st1;
    kvt_session_get_stats(s, &st0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, question, KVT_KEEP_NONE), 0);
    kvt_session_get_stats(s, &st1);
    struct kvt_block_info b;
    kvt_session_block(s, best, &b);
    *best_back = b.residency == KVT_RES_DEVICE && b.n_recoveries > 0;
    printf("  dense recovery (min cosine %.2f, %s): best evicted block %d at cosine %.3f %s; %lld block(s) recovered\n", min_cos,
           ann_min <= 1 ? "HNSW index" : "linear scan", best, best_cos, *best_back ? "recovered" : "not recovered",
           (long long) (st1.recoveries - st0.recoveries));
    kvt_session_free(s);
    return st1.recoveries - st0.recoveries;
}

static void test_dense_recovery(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    kvt_embedder *em = NULL;
    assert_int_equal(kvt_embedder_open(getenv("KVTIER_MODEL"), 64, 0, &em), 0);
    int32_t back = 0;
    assert_true(dense_session(e, em, 0.0f, 1024, &back) >= 1);
    assert_true(back);
    assert_true(dense_session(e, em, 0.0f, 1, &back) >= 1); /* the same through the HNSW index */
    assert_true(back);
    assert_int_equal(dense_session(e, em, 1.0f, 1024, &back), 0); /* control: the threshold binds */
    assert_false(back);
    kvt_embedder_free(em);
    kvt_engine_free(e);
}

/* The cut fact with both halves resident, then the number's half evicted, then the question.
** Returns the number's log-prob; OUT *back (the number's half resident again), *adjacent (right
** after the name's half, which is at the tail: after everything that was resident). */
static double resident_half_session(kvt_engine *e, bool rule, bool *split_ok, bool *back, bool *adjacent, int64_t *recoveries) {
    struct kvt_session_params sp;
    kvt_session *s = open_split_session(e, KVT_RECOVERY_KV_RESTORE, 1, &sp);
    kvt_session_test_no_resident_successors(s, !rule);
    *split_ok = add_cut_fact(e, s, sp.block);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, filler[1], KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "Noted.", KVT_KEEP_NONE), 0);
    struct kvt_block_info a, b, x;
    const int32_t first = fact_halves(s, *split_ok, &a, &b);
    assert_int_equal(a.residency, KVT_RES_DEVICE);
    assert_int_equal(b.residency, KVT_RES_DEVICE);
    kvt__sess_lift_block(s, first + 1); /* the policy evicted the number's half, kept the name's */
    kvt_pos tail = 0;
    for (int32_t i = 0; i < kvt_session_n_blocks(s); i++)
        if (kvt_session_block(s, i, &x) == 0 && x.residency == KVT_RES_DEVICE && x.p0 + x.n_tokens > tail) tail = x.p0 + x.n_tokens;
    char *novel = NULL; /* what the novel-term rule sees: nothing (both question terms are resident) */
    const char *res_text[1] = { a.text };
    assert_int_equal(kvt_bm25_novel_terms("Which locker does Kelvarin have?", res_text, 1, &novel), 0);
    assert_string_equal(novel, "");
    free(novel);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "Which locker does Kelvarin have?", KVT_KEEP_NONE), 0);
    kvt_session_block(s, first, &a);
    kvt_session_block(s, first + 1, &b);
    *back = b.residency == KVT_RES_DEVICE;
    *adjacent = *back && a.residency == KVT_RES_DEVICE && b.p0 == a.p0 + a.n_tokens && a.p0 >= tail;
    return number_logprob_free(s, recoveries);
}

static void test_resident_half(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    bool split[2], back[2], adj[2];
    int64_t rec[2];
    const double lp = resident_half_session(e, true, &split[0], &back[0], &adj[0], &rec[0]);
    const double lp_off = resident_half_session(e, false, &split[1], &back[1], &adj[1], &rec[1]);
    printf("  name's half resident, number's half evicted: number log-prob %.2f with the rule (number back %s, after the name "
           "at the tail %s, %lld recoveries), %.2f without (back %s)\n",
           lp, back[0] ? "yes" : "no", adj[0] ? "yes" : "no", (long long) rec[0], lp_off, back[1] ? "yes" : "no");
    assert_true(split[0] && split[1]);
    assert_true(back[0] && adj[0]);
    assert_int_equal(rec[0], 1); /* the number's half: the name's half moved, not recovered */
    assert_false(back[1]);       /* control: it stays evicted */
    assert_int_equal(rec[1], 0);
    assert_true(lp > lp_off + 2.0);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_novel_terms),        cmocka_unit_test(test_successor_recovered),
        cmocka_unit_test(test_own_tail_successor), cmocka_unit_test(test_dense_recovery),
        cmocka_unit_test(test_resident_half),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
