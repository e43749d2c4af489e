/* test_positions — positions stay inside the model's trained context.
**
** kvt_seq_shift (llama.cpp's context shift) against the verified block primitives: a block moved
** down by the shift gives the same next-token logits as the same block saved, removed and loaded
** at the new position with host RoPE re-anchoring (tiny llama, F32 cache, tolerance 1e-3), and
** different logits from the block left where it was (control: the shift changes something).
** Bad shifts (target occupied, negative) fail and leave the sequence as it was.
** A session on a tiny model trained for 256 positions runs far more than 256 tokens through a
** budget of 96 with recoveries: next_pos never passes 256 (before the fix it grew to 900+), the
** gaps are closed by compaction, and the session keeps answering.  A message that cannot fit the
** trained context even after compaction fails with KVT_ECTX instead. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvt_engine *open_tiny(const char *name, int32_t n_ctx) {
    static char path[1024];
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(path, sizeof path, "%s/%s.gguf", d ? d : "tests/models", name);
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = n_ctx;
    p.n_seq = 2;
    p.type_k = "f32";
    p.type_v = "f32";
    kvt_engine *e = NULL;
    int rc = kvt_engine_open(&p, &e);
    if (rc) fprintf(stderr, "open %s: %s: %s\n", path, kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, 0);
    return e;
}

enum { NS = 20, NB = 30, GAP = 80 };

static void tokens(kvt_token *t, int n, unsigned seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        t[i] = (kvt_token) (3 + (seed >> 8) % 400);
    }
}

static double max_abs_diff(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs((double) a[i] - b[i]));
    return m;
}

/* S at [0, NS), B at [NS + GAP, NS + GAP + NB) in sequence 0 with a gap between them, made as
** eviction makes it: filler decoded there and removed (llama.cpp wants consecutive positions). */
static void scene(kvt_engine *e, const kvt_token *S, const kvt_token *B) {
    kvt_token X[GAP];
    tokens(X, GAP, 5);
    kvt_seq_rm(e, 0, -1, -1);
    assert_int_equal(kvt_engine_decode(e, 0, S, NS, 0, false), 0);
    assert_int_equal(kvt_engine_decode(e, 0, X, GAP, NS, false), 0);
    assert_int_equal(kvt_engine_decode(e, 0, B, NB, NS + GAP, false), 0);
    assert_int_equal(kvt_seq_rm(e, 0, NS, NS + GAP), 0);
}

static void next_logits(kvt_engine *e, kvt_token t, kvt_pos pos, float *out, int nv) {
    assert_int_equal(kvt_engine_decode(e, 0, &t, 1, pos, true), 0);
    memcpy(out, kvt_engine_logits(e), sizeof(float) * (size_t) nv);
    kvt_seq_rm(e, 0, pos, -1);
}

static void test_seq_shift_exact(void **st) {
    (void) st;
    kvt_engine *e = open_tiny("tiny-llama", 512);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    const int nv = I.n_vocab;
    kvt_token S[NS], B[NB], T = 42;
    tokens(S, NS, 7);
    tokens(B, NB, 99);
    float *by_shift = malloc(sizeof(float) * nv), *by_load = malloc(sizeof(float) * nv), *left = malloc(sizeof(float) * nv);

    scene(e, S, B);
    assert_int_equal(kvt_seq_shift(e, 0, NS + GAP, NS + GAP + NB, -GAP), 0);
    assert_int_equal(kvt_seq_pos_max(e, 0), NS + NB - 1);
    assert_int_equal(kvt_seq_n_cells(e, 0), NS + NB);
    next_logits(e, T, NS + NB, by_shift, nv);

    scene(e, S, B); /* the verified path: save, remove, load at the new position */
    kvt_blob *blob = NULL;
    assert_int_equal(kvt_block_save(e, 0, NS + GAP, NS + GAP + NB, &blob), 0);
    assert_int_equal(kvt_seq_rm(e, 0, NS + GAP, -1), 0);
    assert_int_equal(kvt_block_load(e, blob, 0, NS), 0);
    kvt_blob_free(blob);
    next_logits(e, T, NS + NB, by_load, nv);

    scene(e, S, B); /* control: the gap kept */
    next_logits(e, T, NS + GAP + NB, left, nv);

    double d = max_abs_diff(by_shift, by_load, nv), d_ctl = max_abs_diff(by_shift, left, nv);
    printf("  shift vs save/load: max|dlogit| %.3g (tolerance 1e-3); vs the gap kept: %.3g\n", d, d_ctl);
    assert_true(d <= 1e-3);
    assert_true(d_ctl > 1e-2);

    /* bad shifts fail and change nothing */
    scene(e, S, B);
    assert_int_equal(kvt_seq_shift(e, 0, NS + GAP, NS + GAP + NB, -(GAP + 5)), KVT_EINVAL); /* onto S */
    assert_non_null(strstr(kvt_errmsg(), "occupied"));
    assert_int_equal(kvt_seq_shift(e, 0, 0, NS, -1), KVT_EINVAL); /* below 0 */
    assert_int_equal(kvt_seq_shift(e, 0, 5, 5, -1), KVT_EINVAL);  /* empty */
    assert_int_equal(kvt_seq_shift(e, 7, 0, NS, 1), KVT_EINVAL);  /* no such sequence */
    assert_int_equal(kvt_seq_pos_max(e, 0), NS + GAP + NB - 1);
    assert_int_equal(kvt_seq_n_cells(e, 0), NS + NB);
    free(by_shift);
    free(by_load);
    free(left);
    kvt_engine_free(e);
}

static const char *words[] = { "river", "mill", "lantern", "harbor", "orchard", "comet", "glacier", "violin" };

static void test_session_positions_bounded(void **st) {
    (void) st;
    kvt_engine *e = open_tiny("tiny-llama-ctx256", 256);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    assert_int_equal(I.n_ctx_train, 256);
    struct kvt_session_params p = kvt_session_default_params();
    p.budget = 96;
    p.block = 16;
    p.gen_reserve = 8;
    p.min_recovery_score = 0.5f;
    p.template_fallback = "chatml";
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &p, &s), 0);
    struct kvt_sampling smp = { 0 };
    char msg[256];
    int32_t max_pos = 0;
    struct kvt_session_stats stt;
    for (int t = 0; t < 40; t++) {
        /* every fourth turn names an earlier turn's word, so evicted blocks come back */
        if (t % 4 == 3) snprintf(msg, sizeof msg, "what about the %s", words[(t / 4) % 8]);
        else snprintf(msg, sizeof msg, "note %d the %s by the %s", t, words[t % 8], words[(t + 3) % 8]);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
        char *reply = NULL;
        assert_int_equal(kvt_session_generate(s, 4, &smp, NULL, NULL, &reply), 0);
        free(reply);
        kvt_session_get_stats(s, &stt);
        if (stt.next_pos > max_pos) max_pos = stt.next_pos;
        assert_true(stt.next_pos <= I.n_ctx_train);
        assert_true(stt.resident_tokens <= p.budget);
    }
    printf("  40 turns: %d tokens, highest next_pos %d (trained context %d), %lld compactions, %lld recoveries\n", stt.total_tokens,
           max_pos, I.n_ctx_train, (long long) stt.compactions, (long long) stt.recoveries);
    assert_true(stt.total_tokens > 2 * I.n_ctx_train);
    assert_true(stt.compactions >= 2);
    assert_true(stt.recoveries >= 1);
    kvt_session_free(s);
    kvt_engine_free(e);
}

/* More resident tokens than the trained context holds (512 cells for the session's sequence on a
** model trained for 256: a context of 1024 cells, two sequences with a stream each).  An evicting
** policy's budget above n_ctx_train is refused at open, naming it; no_eviction (whose budget is
** the sequence's cells) fails the turn with KVT_ECTX naming the numbers.  No position past 255
** is ever used. */
static void test_session_past_trained_context(void **st) {
    (void) st;
    kvt_engine *e = open_tiny("tiny-llama-ctx256", 1024);
    struct kvt_session_params p = kvt_session_default_params();
    p.budget = 448;
    p.block = 16;
    p.gen_reserve = 8;
    p.template_fallback = "chatml";
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &p, &s), KVT_EINVAL);
    printf("  budget 448 on a model trained for 256 positions: %s\n", kvt_errmsg());
    assert_non_null(strstr(kvt_errmsg(), "trained context of 256 positions"));
    p.policy = KVT_POLICY_NO_EVICTION;
    assert_int_equal(kvt_session_open(e, &p, &s), 0);
    char msg[4096] = "";
    for (int i = 0; i < 24; i++) strcat(msg, i % 2 ? "lantern harbor " : "river orchard ");
    int rc = kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE);
    printf("  no_eviction, a %zu-byte message: %s: %s\n", strlen(msg), kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, KVT_ECTX);
    assert_non_null(strstr(kvt_errmsg(), "trained context of 256 positions"));
    assert_true(kvt_seq_pos_max(e, 0) < 256);
    assert_int_equal(kvt_session_n_messages(s), 0); /* the message is not part of the conversation */
    kvt_session_free(s);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_seq_shift_exact),
        cmocka_unit_test(test_session_positions_bounded),
        cmocka_unit_test(test_session_past_trained_context),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
