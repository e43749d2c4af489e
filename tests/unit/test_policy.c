/* test_policy — eviction scores on synthetic attention and block layouts with known answers:
** H2O and SnapKV block mass and selections, EWMA arithmetic, kvtier's role floors and prefer
** bonus, policy/recovery names.  No model needed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */
#include "policy/policy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* 2 queries x 2 heads over keys at positions 0,1,2 | 10,11,12 | 20 */
static float W[2 * 2 * 7] = {
    /* q0 h0 */ 0.50f, 0.10f, 0.00f, 0.10f, 0.10f, 0.10f, 0.10f,
    /* q0 h1 */ 0.20f, 0.20f, 0.20f, 0.10f, 0.10f, 0.10f, 0.10f,
    /* q1 h0 */ 0.00f, 0.00f, 0.00f, 0.40f, 0.40f, 0.00f, 0.20f,
    /* q1 h1 */ 0.10f, 0.00f, 0.00f, 0.00f, 0.00f, 0.80f, 0.10f,
};
static kvt_pos KP[7] = { 0, 1, 2, 10, 11, 12, 20 };
static kvt_pos QP[2] = { 21, 22 };

static kvt_attn synthetic(void) {
    kvt_attn a;
    memset(&a, 0, sizeof a);
    a.layer = 0;
    a.n_query = 2;
    a.n_head = 2;
    a.n_keys = 7;
    a.q_pos = QP;
    a.k_pos = KP;
    a.w = W;
    return a;
}

static void test_block_mass_h2o(void **st) {
    (void) st;
    kvt_attn a = synthetic();
    kvt_pos p0[2] = { 10, 0 }; /* any order */
    int32_t n[2] = { 3, 3 };
    double m[2];
    assert_int_equal(kvt_attn_block_mass(&a, 0, NULL, p0, n, 2, m), 0);
    /* block [0,3): (0.6 + 0.6 + 0 + 0.1) / 4 = 0.325 ; block [10,13): (0.3 + 0.3 + 0.8 + 0.8) / 4 = 0.55 */
    assert_true(fabs(m[1] - 0.325) < 1e-6);
    assert_true(fabs(m[0] - 0.55) < 1e-6);
    /* H2O keeps the heavier block: the lighter one scores lower */
    struct kvt_block_info b0 = { 0 }, b1 = { 0 };
    b0.attn_mass = m[1];
    b1.attn_mass = m[0];
    struct kvt__score_ctx c = { 30, 3, 0, 0 };
    assert_true(kvt__score(KVT_POLICY_H2O, &b0, &c) < kvt__score(KVT_POLICY_H2O, &b1, &c));
}

static void test_block_mass_snapkv_window(void **st) {
    (void) st;
    kvt_attn a = synthetic();
    kvt_pos p0[2] = { 0, 10 };
    int32_t n[2] = { 3, 3 };
    double m[2];
    /* observation window = the last query only */
    assert_int_equal(kvt_attn_block_mass(&a, 1, NULL, p0, n, 2, m), 0);
    assert_true(fabs(m[0] - 0.05) < 1e-6); /* (0 + 0.1) / 2 */
    assert_true(fabs(m[1] - 0.80) < 1e-6); /* (0.8 + 0.8) / 2 */
    struct kvt_block_info b0 = { 0 }, b1 = { 0 };
    b0.attn_window = m[0];
    b1.attn_window = m[1];
    b0.attn_mass = 10; /* H2O would keep b0; SnapKV looks at the window only */
    struct kvt__score_ctx c = { 30, 3, 0, 0 };
    assert_true(kvt__score(KVT_POLICY_SNAPKV, &b0, &c) < kvt__score(KVT_POLICY_SNAPKV, &b1, &c));
    assert_true(kvt__score(KVT_POLICY_H2O, &b0, &c) > kvt__score(KVT_POLICY_H2O, &b1, &c));
    assert_int_equal(kvt_attn_block_mass(&a, 2, NULL, p0, n, 2, m), KVT_EINVAL);
}

static void test_head_weights(void **st) {
    (void) st;
    kvt_attn a = synthetic();
    kvt_pos p0[2] = { 0, 10 };
    int32_t n[2] = { 3, 3 };
    double m[2];
    /* all weight on head 1: block [0,3) gets (0.6 + 0.1) / 2, block [10,13) (0.3 + 0.8) / 2 */
    const float hw[2] = { 0.0f, 2.0f };
    assert_int_equal(kvt_attn_block_mass(&a, 0, hw, p0, n, 2, m), 0);
    assert_true(fabs(m[0] - 0.35) < 1e-6);
    assert_true(fabs(m[1] - 0.55) < 1e-6);
    const float zero[2] = { 0, 0 };
    assert_int_equal(kvt_attn_block_mass(&a, 0, zero, p0, n, 2, m), KVT_EINVAL);
    /* weights from a profile: 1/H normalised to mean 1 within the layer */
    char path[] = "/tmp/kvt-profile-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char *json = "{\"layers\":[{\"layer\":5,\"heads\":[{\"head\":0,\"entropy_bits\":1.0},"
                       "{\"head\":1,\"entropy_bits\":3.0}]}]}";
    assert_int_equal(write(fd, json, strlen(json)), (ssize_t) strlen(json));
    close(fd);
    int32_t layers[1] = { 5 };
    float w[2];
    assert_int_equal(kvt_head_weights_load(path, layers, 1, 2, w), 0);
    assert_true(fabs(w[0] - 1.5) < 1e-6 && fabs(w[1] - 0.5) < 1e-6); /* 1 : 1/3, mean 2/3 */
    layers[0] = 6;
    assert_int_equal(kvt_head_weights_load(path, layers, 1, 2, w), KVT_EFORMAT);
    assert_non_null(strstr(kvt_errmsg(), "layer 6"));
    unlink(path);
    assert_int_equal(kvt_head_weights_load("/nonexistent/p.json", layers, 1, 2, w), KVT_EIO);
}

static void test_ewma(void **st) {
    (void) st;
    double e = 0;
    e = kvt__ewma(e, 1.0, 0.3); /* 0.3 */
    e = kvt__ewma(e, 0.0, 0.3); /* 0.21 */
    e = kvt__ewma(e, 0.5, 0.3); /* 0.15 + 0.147 = 0.297 */
    assert_true(fabs(e - 0.297) < 1e-12);
    assert_true(fabs(kvt__ewma(0.4, 0.4, 0.9) - 0.4) < 1e-12);
}

static void test_kvtier_score(void **st) {
    (void) st;
    struct kvt__score_ctx c = { 1000, 100, 8.0, 0.5 };
    struct kvt_block_info old = { 0 }, recent = { 0 }, relevant = { 0 };
    old.p0 = 36;
    old.n_tokens = 64; /* ends at the oldest point: recency 0 */
    recent.p0 = 936;
    recent.n_tokens = 64; /* ends at now: recency 1 */
    relevant = old;
    relevant.relevance = 8.0; /* the most relevant block */
    double s_old = kvt__score(KVT_POLICY_KVTIER, &old, &c);
    double s_recent = kvt__score(KVT_POLICY_KVTIER, &recent, &c);
    double s_rel = kvt__score(KVT_POLICY_KVTIER, &relevant, &c);
    assert_true(fabs(s_old - 0.0) < 1e-12);
    assert_true(fabs(s_recent - KVT__W_RECENCY) < 1e-12);
    assert_true(fabs(s_rel - KVT__W_RELEVANCE) < 1e-12);
    assert_true(s_rel > s_recent); /* relevance to the current message outranks recency */
    /* role floors */
    struct kvt_block_info u = old, as = old, sy = old;
    u.role = KVT_ROLE_USER;
    as.role = KVT_ROLE_ASSISTANT;
    sy.role = KVT_ROLE_SYSTEM;
    assert_true(fabs(kvt__score(KVT_POLICY_KVTIER, &u, &c) - KVT__FLOOR_USER) < 1e-12);
    assert_true(fabs(kvt__score(KVT_POLICY_KVTIER, &as, &c) - KVT__FLOOR_ASSISTANT) < 1e-12);
    assert_true(kvt__score(KVT_POLICY_KVTIER, &sy, &c) == 0.0);
    /* attention EWMA, normalised by the largest */
    struct kvt_block_info hot = old;
    hot.attn_ewma = 0.5;
    assert_true(fabs(kvt__score(KVT_POLICY_KVTIER, &hot, &c) - KVT__W_ATTENTION) < 1e-12);
    /* prefer */
    struct kvt_block_info pref = old;
    pref.keep = KVT_KEEP_PREFER;
    assert_true(fabs(kvt__score(KVT_POLICY_KVTIER, &pref, &c) - KVT__BONUS_PREFER) < 1e-12);
    /* streaming / truncate: plain recency */
    assert_true(kvt__score(KVT_POLICY_STREAMING, &old, &c) < kvt__score(KVT_POLICY_STREAMING, &recent, &c));
}

static void test_names(void **st) {
    (void) st;
    const char *names[] = { "kvtier", "no_eviction", "truncate", "streaming", "h2o", "snapkv", "infllm" };
    for (int i = 0; i < 7; i++) {
        int32_t p = -1;
        assert_int_equal(kvt_policy_from_name(names[i], &p), 0);
        assert_int_equal(p, i);
        assert_string_equal(kvt_policy_name(p), names[i]);
    }
    int32_t p;
    assert_int_equal(kvt_policy_from_name("lru", &p), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "'lru'"));
    int32_t r;
    assert_int_equal(kvt_recovery_from_name("breadcrumb", &r), 0);
    assert_int_equal(r, KVT_RECOVERY_BREADCRUMB);
    assert_int_equal(kvt_recovery_from_name("none", &r), KVT_EINVAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_block_mass_h2o), cmocka_unit_test(test_block_mass_snapkv_window),
        cmocka_unit_test(test_ewma),           cmocka_unit_test(test_head_weights),
        cmocka_unit_test(test_kvtier_score),   cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
