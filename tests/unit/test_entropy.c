/* test_entropy.c — attention entropy, head classes and entropy-adaptive budgets (src/policy/entropy.c),
** and entropy of attention actually captured from a tiny model.
**
** The pure functions are checked against closed forms (uniform over n -> log2 n, one-hot -> 0),
** at and around every class threshold, and through both budget clamps.  The capture test reads
** the last query's rows of a real decode and compares kvt_entropy_bits with a direct
** -sum p log2 p; a control on a perturbed row must differ, so the comparison can fail. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EPS 1e-9

static void assert_close(double got, double want, double tol, const char *what) {
    if (!(fabs(got - want) <= tol)) fail_msg("%s: got %.12g, want %.12g (tol %g)", what, got, want, tol);
}

/* -sum p log2 p over the positive entries, p normalised: the reference computation. */
static double direct_bits(const float *w, int n) {
    double z = 0, h = 0;
    for (int i = 0; i < n; i++) z += w[i] > 0 ? w[i] : 0;
    for (int i = 0; i < n; i++)
        if (w[i] > 0) h -= (w[i] / z) * log2(w[i] / z);
    return h;
}

static void test_uniform(void **state) {
    (void) state;
    const int ns[] = { 1, 2, 7, 256 };
    float w[256];
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int n = ns[k];
        for (int i = 0; i < n; i++) w[i] = 1.0f / (float) n;
        char what[64];
        snprintf(what, sizeof what, "uniform over %d", n);
        assert_close(kvt_entropy_bits(w, n), log2((double) n), 1e-6, what);
    }
    assert_close(kvt_entropy_bits(w, 1), 0.0, 0.0, "n = 1 is exactly 0");
}

static void test_one_hot(void **state) {
    (void) state;
    float w[100] = { 0 };
    for (int hot = 0; hot < 100; hot += 33) {
        memset(w, 0, sizeof w);
        w[hot] = 1.0f;
        assert_close(kvt_entropy_bits(w, 100), 0.0, 0.0, "one-hot");
    }
    w[0] = 7.5f; /* one-hot of any mass */
    assert_close(kvt_entropy_bits(w, 1), 0.0, 0.0, "single unnormalised entry");
}

static void test_normalises(void **state) {
    (void) state;
    float a[8], b[8];
    for (int i = 0; i < 8; i++) a[i] = 5.0f; /* uniform, summing to 40 */
    assert_close(kvt_entropy_bits(a, 8), 3.0, 1e-6, "uniform of mass 40");
    const float p[4] = { 0.5f, 0.25f, 0.125f, 0.125f }; /* 1.75 bits */
    for (int i = 0; i < 4; i++) b[i] = p[i] * 12.0f;
    assert_close(kvt_entropy_bits(p, 4), 1.75, 1e-6, "dyadic");
    assert_close(kvt_entropy_bits(b, 4), 1.75, 1e-6, "dyadic x 12");
    for (int i = 0; i < 4; i++) b[i] = p[i] * 1e-3f;
    assert_close(kvt_entropy_bits(b, 4), 1.75, 1e-5, "dyadic x 1e-3");
}

static void test_zeros_skipped(void **state) {
    (void) state;
    const float w[6] = { 0.0f, 0.5f, 0.0f, 0.0f, 0.5f, 0.0f };
    assert_close(kvt_entropy_bits(w, 6), 1.0, 1e-9, "two of six nonzero");
    const float z[5] = { 0 };
    assert_close(kvt_entropy_bits(z, 5), 0.0, 0.0, "all zero");
    assert_close(kvt_entropy_bits(z, 0), 0.0, 0.0, "n = 0");
    assert_close(kvt_entropy_bits(z, -3), 0.0, 0.0, "n < 0");
    /* a skipped zero does not change the entropy of the rest */
    const float p[3] = { 0.2f, 0.3f, 0.5f }, q[5] = { 0.2f, 0.0f, 0.3f, 0.0f, 0.5f };
    assert_close(kvt_entropy_bits(q, 5), kvt_entropy_bits(p, 3), 1e-12, "zeros interleaved");
    assert_close(kvt_entropy_bits(p, 3), direct_bits(p, 3), 1e-9, "three-point");
}

static void test_classify(void **state) {
    (void) state;
    const struct {
        double bits;
        int32_t cls;
    } cases[] = {
        { 0.0, KVT_HEAD_SINK },           { 0.5 - EPS, KVT_HEAD_SINK },     { 0.5, KVT_HEAD_FOCUSED },
        { 0.5 + EPS, KVT_HEAD_FOCUSED },  { 1.5 - EPS, KVT_HEAD_FOCUSED },  { 1.5, KVT_HEAD_MODERATE },
        { 1.5 + EPS, KVT_HEAD_MODERATE }, { 3.0 - EPS, KVT_HEAD_MODERATE }, { 3.0, KVT_HEAD_MIXED },
        { 3.0 + EPS, KVT_HEAD_MIXED },    { 8.0, KVT_HEAD_MIXED },          { 20.0, KVT_HEAD_MIXED },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int32_t got = kvt_head_classify(cases[i].bits);
        if (got != cases[i].cls)
            fail_msg("classify(%.10f) = %s, want %s", cases[i].bits, kvt_head_class_name(got), kvt_head_class_name(cases[i].cls));
    }
    assert_string_equal(kvt_head_class_name(KVT_HEAD_SINK), "sink");
    assert_string_equal(kvt_head_class_name(KVT_HEAD_FOCUSED), "focused");
    assert_string_equal(kvt_head_class_name(KVT_HEAD_MODERATE), "moderate");
    assert_string_equal(kvt_head_class_name(KVT_HEAD_MIXED), "mixed");
    assert_non_null(kvt_head_class_name(-1));
    assert_non_null(kvt_head_class_name(4));
}

static void test_budget(void **state) {
    (void) state;
    assert_int_equal(kvt_entropy_budget(512, 3.0, 3.0), 512); /* h = mean */
    assert_int_equal(kvt_entropy_budget(512, 4.5, 3.0), 768); /* x1.5 */
    assert_int_equal(kvt_entropy_budget(512, 2.0, 3.0), 341); /* 341.33 rounded down */
    assert_int_equal(kvt_entropy_budget(100, 1.0, 3.0), 33);  /* 33.33 rounded down */
    /* lower clamp 0.3: at, just below and far below */
    assert_int_equal(kvt_entropy_budget(100, 0.9, 3.0), 30);
    assert_int_equal(kvt_entropy_budget(100, 0.6, 3.0), 30);
    assert_int_equal(kvt_entropy_budget(100, 0.0, 3.0), 30);
    assert_int_equal(kvt_entropy_budget(100, 0.93, 3.0), 31); /* 0.31 is above the clamp */
    /* upper clamp 2.5: at, just above and far above */
    assert_int_equal(kvt_entropy_budget(100, 7.5, 3.0), 250);
    assert_int_equal(kvt_entropy_budget(100, 7.2, 3.0), 240);
    assert_int_equal(kvt_entropy_budget(100, 30.0, 3.0), 250);
    assert_int_equal(kvt_entropy_budget(512, 1e9, 1.0), 1280);
    /* mean_h <= 0 returns base whatever h is */
    assert_int_equal(kvt_entropy_budget(512, 4.0, 0.0), 512);
    assert_int_equal(kvt_entropy_budget(512, 4.0, -1.0), 512);
    assert_int_equal(kvt_entropy_budget(0, 4.0, 2.0), 0);
}

/* ---- entropy of attention captured from a tiny model ---------------------------------- */

static void test_capture(void **state) {
    (void) state;
    char path[1024];
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(path, sizeof path, "%s/tiny-llama.gguf", d ? d : "tests/models");
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 256;
    p.type_k = p.type_v = "f32";
    p.flash_attn = false;
    kvt_engine *e = NULL;
    if (kvt_engine_open(&p, &e)) fail_msg("open %s: %s", path, kvt_errmsg());
    const int32_t layer0 = 0;
    assert_int_equal(kvt_attn_capture(e, &layer0, 1, false), 0);
    kvt_token t[64];
    for (int i = 0; i < 64; i++) t[i] = (kvt_token) (3 + (i * 37) % 498); /* ids 3..500 */
    assert_int_equal(kvt_engine_decode(e, 0, t, 64, 0, false), 0);
    kvt_attn *a = NULL;
    if (kvt_attn_get(e, 0, 0, &a)) fail_msg("attn_get: %s", kvt_errmsg());
    assert_int_equal(a->n_query, 64);
    assert_int_equal(a->n_keys, 64);
    assert_int_equal(a->q_pos[a->n_query - 1], 63);
    const double hmax = log2((double) a->n_keys);
    float *perturbed = malloc(sizeof(float) * (size_t) a->n_keys);
    assert_non_null(perturbed);
    for (int h = 0; h < a->n_head; h++) {
        const float *row = a->w + ((size_t) (a->n_query - 1) * a->n_head + h) * a->n_keys;
        const double got = kvt_entropy_bits(row, a->n_keys), want = direct_bits(row, a->n_keys);
        if (!(got >= 0 && got <= hmax + 1e-9)) fail_msg("head %d: %.6f bits outside [0, %.6f]", h, got, hmax);
        char what[64];
        snprintf(what, sizeof what, "head %d vs direct", h);
        assert_close(got, want, 1e-6, what);
        /* control: moving mass onto one key lowers the entropy visibly */
        memcpy(perturbed, row, sizeof(float) * (size_t) a->n_keys);
        perturbed[a->n_keys - 1] += 1.0f;
        assert_true(fabs(kvt_entropy_bits(perturbed, a->n_keys) - want) > 1e-3);
    }
    free(perturbed);
    kvt_attn_free(a);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_uniform),       cmocka_unit_test(test_one_hot),  cmocka_unit_test(test_normalises),
        cmocka_unit_test(test_zeros_skipped), cmocka_unit_test(test_classify), cmocka_unit_test(test_budget),
        cmocka_unit_test(test_capture),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
