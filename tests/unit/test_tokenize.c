/* test_tokenize — kvt_tokenize's memo of recent tokenizations (src/engine/text.c): a text that
** starts like one tokenized a moment ago takes that one's tokens up to a control token and
** tokenizes only the rest.  Every answer is compared with llama_tokenize of the whole text
** computed in the same run (the memo switched off through test_hooks.h), on the texts chat clients
** send: a conversation growing turn by turn with the assistant prefix, a request resent as it was,
** an earlier message edited, a prefix cut inside a word and then the whole, two conversations on
** one document, message contents that spell special tokens, non-ASCII text.
**
**   memo_equal_*   on the tiny generated model (SPM, no special token to cut at: only identical
**                  texts are taken whole), Gemma 3 ($KVTIER_MODEL, SPM) and SmolLM2
**                  ($KVTIER_CHAT_MODEL, BPE): every answer equals the reference, and on the two
**                  real models most tokens came from the memo (it is used, not bypassed).
**                  The same without the BOS (add_bos false, as the session tokenizes the rest of
**                  a text).  Controls, on the same texts: a memo that cuts after any token (mode 2) gives
**                  other tokens on some text, so the comparison can fail.
**   memo_across    a vocabulary with a control token "<|e|>" and a user-defined token
**                  "e|>\n\nUser:" that overlaps its end: a text that continues "<|e|>" with
**                  "\n\nUser:" is cut by llama.cpp at the longer token, so the memo must not cut
**                  after "<|e|>" there: the answer equals the reference; the control that skips
**                  the check (mode 3) does not.
**   memo_threads   four threads tokenizing their own growing conversations at once on one
**                  engine: every answer equals the reference computed before.
**   memo_faults    the memo's allocations fail (fault site KVT__FAULT_TOK_MEMO): the answers are
**                  still the reference, nothing is taken from the memo while they fail, and it
**                  is used again once they stop.
**   chat_tokenize  kvt_chat_tokenize (the server's admission) goes through the memo.
** Not covered: tokens with the lstrip / rstrip attributes (llama.cpp sets them at load for a few
** vocabularies by name; a GGUF cannot carry them, so mkmodel cannot make one): text.c refuses a
** cut at such a token, and after one that ends in whitespace when any token strips to its left. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "fault.h"
#include "test_hooks.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_next(uint64_t *s) { /* xorshift64* */
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static const char *const WORDS[] = {
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "you",
    "for",
    "on",
    "was",
    "with",
    "as",
    "are",
    "be",
    "this",
    "have",
    "not",
    "what",
    "at",
    "or",
    "but",
    "they",
    "from",
    "we",
    "startup",
    "startups",
    "founder",
    "founders",
    "investors",
    "investor",
    "code",
    "codes",
    "number",
    "document",
    "answer",
    "answers",
    "people",
    "about",
    "would",
    "could",
    "because",
    "things",
    "thing",
    "good",
    "make",
    "making",
    "how",
    "time",
    "way",
    "who",
    "all",
    "naïve",
    "café",
    "媽媽",
    "🤗",
    "12",
    "345",
    "6789",
    "x=1;",
    "{\"a\": [1, 2]}",
    "\n",
    "\n\n",
    "  ",
    "\t",
    ",",
    ".",
    "?",
    "don't",
    "it's",
    "e-mail",
    "http://example.com/a?b=c",
    /* texts that are special tokens in some vocabulary: a user may paste them */
    "<end_of_turn>",
    "<start_of_turn>",
    "<unused3>",
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<|e|>",
    "e|>",
};
#define N_WORDS ((int) (sizeof WORDS / sizeof WORDS[0]))

/* n random words, space separated (the words above in a seeded order), caller frees. */
static char *words(uint64_t *rng, int n) {
    size_t cap = 64, len = 0;
    char *s = malloc(cap);
    assert_non_null(s);
    s[0] = '\0';
    for (int i = 0; i < n; i++) {
        const char *w = WORDS[rng_next(rng) % (N_WORDS - 10)]; /* the special texts only by choice below */
        if (rng_next(rng) % 40 == 0) w = WORDS[N_WORDS - 10 + (int) (rng_next(rng) % 10)];
        const size_t k = strlen(w);
        if (len + k + 2 > cap) {
            cap = (len + k + 2) * 2;
            s = realloc(s, cap);
            assert_non_null(s);
        }
        if (i > 0) s[len++] = ' ';
        memcpy(s + len, w, k + 1);
        len += k;
    }
    return s;
}

static kvt_engine *open_model(const char *path) {
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 256;
    p.n_seq = 1;
    p.n_threads = 2;
    kvt_engine *e = NULL;
    assert_int_equal(kvt_engine_open(&p, &e), 0);
    return e;
}

static char *tiny_path(const char *name) {
    const char *dir = getenv("KVT_TINY_DIR");
    assert_non_null(dir);
    static char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return path;
}

/* ---- the texts ----------------------------------------------------------------------- */

struct texts {
    char **t;
    int n, cap;
};

static void texts_add(struct texts *x, char *t) {
    if (x->n == x->cap) {
        x->cap = x->cap ? x->cap * 2 : 64;
        x->t = realloc(x->t, sizeof *x->t * (size_t) x->cap);
        assert_non_null(x->t);
    }
    x->t[x->n++] = t;
}

static void texts_free(struct texts *x) {
    for (int i = 0; i < x->n; i++) free(x->t[i]);
    free(x->t);
}

static char *format(kvt_engine *e, struct kvt_chat_msg *m, int n, bool add_ass) {
    char *t = NULL;
    assert_int_equal(kvt_chat_format(e, m, n, add_ass, "chatml", &t), 0);
    return t;
}

/* The texts a chat client sends for one conversation on a document of doc_words words, in order. */
static void conversation(kvt_engine *e, uint64_t seed, int doc_words, int turns, struct texts *out) {
    uint64_t rng = seed;
    struct kvt_chat_msg m[64];
    char *own[64];
    int n = 0;
    own[n] = words(&rng, doc_words);
    m[n] = (struct kvt_chat_msg){ "system", own[n] };
    n++;
    for (int t = 0; t < turns && n + 2 < 64; t++) {
        own[n] = words(&rng, 3 + (int) (rng_next(&rng) % 40));
        m[n] = (struct kvt_chat_msg){ "user", own[n] };
        n++;
        char *text = format(e, m, n, true);
        const size_t len = strlen(text);
        switch (rng_next(&rng) % 4) {
            case 0: { /* a prefix cut anywhere (inside a word, a UTF-8 sequence or a special token's text) first */
                char *pre = strdup(text);
                assert_non_null(pre);
                pre[len / 2 + rng_next(&rng) % (len / 2)] = '\0';
                texts_add(out, pre);
                break;
            }
            case 1: { /* an earlier message edited: one word changed */
                const int k = (int) (rng_next(&rng) % (uint64_t) n);
                char *was = own[k], *w = words(&rng, 1);
                const size_t at = rng_next(&rng) % (strlen(was) + 1);
                char *ed = malloc(strlen(was) + strlen(w) + 1);
                assert_non_null(ed);
                sprintf(ed, "%.*s%s%s", (int) at, was, w, was + at);
                m[k].content = ed;
                texts_add(out, format(e, m, n, true));
                m[k].content = was;
                free(ed);
                free(w);
                break;
            }
            default: break;
        }
        texts_add(out, text);
        if (rng_next(&rng) % 3 == 0) texts_add(out, strdup(text)); /* resent as it was */
        own[n] = words(&rng, 1 + (int) (rng_next(&rng) % 60));
        m[n] = (struct kvt_chat_msg){ "assistant", own[n] };
        n++;
    }
    for (int i = 0; i < n; i++) free(own[i]);
}

static bool g_bos = true; /* kvt_tokenize's add_bos in tokenize(): the session tokenizes the rest of a text without */

static kvt_token *tokenize(kvt_engine *e, const char *text, int32_t *n) {
    kvt_token *t = NULL;
    assert_int_equal(kvt_tokenize(e, text, g_bos, true, &t, n), 0);
    return t;
}

/* The reference: each text tokenized whole (the memo off). */
struct refs {
    kvt_token **t;
    int32_t *n;
};

static struct refs reference(kvt_engine *e, const struct texts *x) {
    struct refs r = { calloc((size_t) x->n, sizeof(kvt_token *)), calloc((size_t) x->n, sizeof(int32_t)) };
    assert_true(r.t && r.n);
    kvt_engine_test_tokenize_memo(e, 1);
    for (int i = 0; i < x->n; i++) r.t[i] = tokenize(e, x->t[i], &r.n[i]);
    return r;
}

static void refs_free(struct refs *r, int n) {
    for (int i = 0; i < n; i++) free(r->t[i]);
    free(r->t);
    free(r->n);
}

static bool same(const kvt_token *a, int32_t na, const kvt_token *b, int32_t nb) {
    return na == nb && memcmp(a, b, sizeof *a * (size_t) na) == 0;
}

/* Tokenizes x's texts in order with the memo in `mode` (emptied first) and compares each with
** the reference.  Returns the texts whose tokens differ; *taken: tokens taken from the memo,
** *total: tokens of all texts. */
static int run_texts(kvt_engine *e, const struct texts *x, const struct refs *r, int mode, int64_t *taken, int64_t *total) {
    int differ = 0;
    *total = 0;
    kvt_engine_test_tokenize_memo(e, mode);
    const int64_t t0 = kvt_engine_test_memo_tokens(e);
    for (int i = 0; i < x->n; i++) {
        int32_t n = 0;
        kvt_token *t = tokenize(e, x->t[i], &n);
        if (!same(t, n, r->t[i], r->n[i])) {
            if (mode == 0) printf("text %d of %zu bytes: %d tokens, reference %d\n", i, strlen(x->t[i]), n, r->n[i]);
            differ++;
        }
        *total += r->n[i];
        free(t);
    }
    *taken = kvt_engine_test_memo_tokens(e) - t0;
    kvt_engine_test_tokenize_memo(e, 0);
    return differ;
}

/* ---- the tests ----------------------------------------------------------------------- */

/* min_taken: the share of tokens the memo must have given (0: only that it gave some). */
static void memo_equal_on(const char *path, double min_taken) {
    kvt_engine *e = open_model(path);
    struct texts x = { 0 };
    for (uint64_t c = 1; c <= 3; c++) conversation(e, 0x9E3779B97F4A7C15ull * c, 200 + 150 * (int) c, 10, &x);
    /* two conversations on one document: the second finds the first's system message */
    conversation(e, 77, 400, 4, &x);
    conversation(e, 77, 400, 4, &x);
    struct refs r = reference(e, &x);
    int64_t taken = 0, total = 0;
    const int differ = run_texts(e, &x, &r, 0, &taken, &total);
    printf("%s: %d texts, %lld tokens, %lld (%.0f %%) taken from the memo, %d differ\n", path, x.n, (long long) total,
           (long long) taken, 100.0 * (double) taken / (double) total, differ);
    assert_int_equal(differ, 0);
    assert_true(taken > 0);
    assert_true((double) taken >= min_taken * (double) total);
    /* control: cuts after any token give other tokens on some of the same texts */
    int64_t t2 = 0, n2 = 0;
    const int d2 = run_texts(e, &x, &r, 2, &t2, &n2);
    printf("control (a cut after any token): %d texts differ\n", d2);
    assert_true(d2 > 0);
    refs_free(&r, x.n);
    /* without the BOS, as the session tokenizes what follows its text */
    g_bos = false;
    r = reference(e, &x);
    assert_int_equal(run_texts(e, &x, &r, 0, &taken, &total), 0);
    assert_true(taken > 0);
    g_bos = true;
    refs_free(&r, x.n);
    texts_free(&x);
    kvt_engine_free(e);
}

static void test_memo_equal_tiny(void **state) {
    (void) state;
    memo_equal_on(tiny_path("tiny-llama.gguf"), 0.0);
}

static void test_memo_equal_real(void **state) {
    (void) state;
    const char *real[2] = { getenv("KVTIER_MODEL"), getenv("KVTIER_CHAT_MODEL") };
    for (int i = 0; i < 2; i++) {
        if (!real[i] || !*real[i]) {
            printf("skipped: %s not set\n", i ? "KVTIER_CHAT_MODEL" : "KVTIER_MODEL");
            continue;
        }
        memo_equal_on(real[i], 0.5);
    }
}

static void test_memo_across(void **state) {
    (void) state;
    kvt_engine *e = open_model(tiny_path("tiny-llama-specials.gguf"));
    uint64_t rng = 5;
    char *doc = words(&rng, 300);
    struct texts x = { 0 };
    const char *tails[3] = { "<|e|>\n\nAssistant: ok", "<|e|>\n\nUser: hi there", "<|e|>\n\nAssistant: again" };
    for (int i = 0; i < 3; i++) {
        char *t = malloc(strlen(doc) + 64);
        assert_non_null(t);
        sprintf(t, "%s%s", doc, tails[i]);
        texts_add(&x, t);
    }
    struct refs r = reference(e, &x);
    /* the vocabulary is what the test means: the user-defined token is in the second text's reference */
    int32_t n1 = 0;
    kvt_token *ud = NULL;
    assert_int_equal(kvt_tokenize(e, "e|>\n\nUser:", false, true, &ud, &n1), 0);
    assert_int_equal(n1, 1);
    bool found = false;
    for (int32_t i = 0; i < r.n[1]; i++) found |= r.t[1][i] == ud[0];
    assert_true(found);
    free(ud);
    int64_t taken = 0, total = 0;
    assert_int_equal(run_texts(e, &x, &r, 0, &taken, &total), 0);
    assert_true(taken > 0); /* the third text took the first one's cut after "<|e|>" */
    int64_t t3 = 0, n3 = 0;
    assert_true(run_texts(e, &x, &r, 3, &t3, &n3) > 0); /* control: no check across the cut */
    refs_free(&r, x.n);
    texts_free(&x);
    free(doc);
    kvt_engine_free(e);
}

struct worker {
    kvt_engine *e;
    const struct texts *x;
    const struct refs *r;
    int differ;
};

static void *work(void *arg) {
    struct worker *w = arg;
    for (int i = 0; i < w->x->n; i++) {
        kvt_token *t = NULL;
        int32_t n = 0;
        if (kvt_tokenize(w->e, w->x->t[i], true, true, &t, &n) || !same(t, n, w->r->t[i], w->r->n[i])) w->differ++;
        free(t);
    }
    return NULL;
}

static void test_memo_threads(void **state) {
    (void) state;
    const char *m = getenv("KVTIER_MODEL");
    if (!m || !*m) m = tiny_path("tiny-llama.gguf");
    kvt_engine *e = open_model(m);
    struct texts x[4] = { 0 };
    struct refs r[4];
    for (int i = 0; i < 4; i++) {
        conversation(e, 1000 + (uint64_t) i, 250, 8, &x[i]);
        r[i] = reference(e, &x[i]);
    }
    kvt_engine_test_tokenize_memo(e, 0);
    const int64_t t0 = kvt_engine_test_memo_tokens(e);
    pthread_t th[4];
    struct worker w[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (struct worker){ e, &x[i], &r[i], 0 };
        assert_int_equal(pthread_create(&th[i], NULL, work, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(w[i].differ, 0);
    }
    assert_true(kvt_engine_test_memo_tokens(e) > t0);
    for (int i = 0; i < 4; i++) {
        refs_free(&r[i], x[i].n);
        texts_free(&x[i]);
    }
    kvt_engine_free(e);
}

static void test_memo_faults(void **state) {
    (void) state;
    const char *m = getenv("KVTIER_MODEL");
    if (!m || !*m) m = tiny_path("tiny-llama.gguf");
    kvt_engine *e = open_model(m);
    struct texts x = { 0 };
    conversation(e, 31, 300, 8, &x);
    struct refs r = reference(e, &x);
    int64_t taken = 0, total = 0;
    kvt__fault_set(KVT__FAULT_TOK_MEMO, 0, -1);
    assert_int_equal(run_texts(e, &x, &r, 0, &taken, &total), 0);
    assert_int_equal(taken, 0);
    assert_true(kvt__fault_hits(KVT__FAULT_TOK_MEMO) > 0);
    kvt__fault_set(KVT__FAULT_TOK_MEMO, 2, 3); /* some fail, then they work again */
    assert_int_equal(run_texts(e, &x, &r, 0, &taken, &total), 0);
    assert_int_equal(kvt__fault_hits(KVT__FAULT_TOK_MEMO), 3);
    assert_true(taken > 0);
    kvt__fault_set(KVT__FAULT_TOK_MEMO, 0, 0);
    refs_free(&r, x.n);
    texts_free(&x);
    kvt_engine_free(e);
}

static void test_chat_tokenize(void **state) {
    (void) state;
    const char *m = getenv("KVTIER_MODEL");
    if (!m || !*m) m = tiny_path("tiny-llama.gguf");
    kvt_engine *e = open_model(m);
    uint64_t rng = 9;
    char *doc = words(&rng, 400);
    struct kvt_chat_msg msgs[2] = { { "system", doc }, { "user", "Summarize the text in one sentence." } };
    kvt_token *a = NULL, *b = NULL;
    int32_t na = 0, nb = 0;
    assert_int_equal(kvt_chat_tokenize(e, msgs, 2, true, "chatml", &a, &na), 0);
    const int64_t t0 = kvt_engine_test_memo_tokens(e);
    assert_int_equal(kvt_chat_tokenize(e, msgs, 2, true, "chatml", &b, &nb), 0);
    assert_int_equal(kvt_engine_test_memo_tokens(e) - t0, nb);
    assert_true(same(a, na, b, nb));
    free(a);
    free(b);
    free(doc);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memo_equal_tiny), cmocka_unit_test(test_memo_equal_real), cmocka_unit_test(test_memo_across),
        cmocka_unit_test(test_memo_threads),    cmocka_unit_test(test_memo_faults),     cmocka_unit_test(test_chat_tokenize),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
