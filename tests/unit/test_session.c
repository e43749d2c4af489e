/* test_session — budgeted sessions on Gemma 3 270M: the budget holds at every step, the sink
** block stays, recovered blocks land contiguously at the tail; BM25 ranks a known corpus. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "internal.h" /* kvt_pool_spill_path */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A system prompt longer than one block, so the attention-sink block holds it and the fact of
** turn 1 lives in blocks that can be evicted. */
static const char *system_prompt =
    "You are a helpful assistant in a long conversation. Answer each question clearly and briefly, in plain "
    "English, and keep track of what the user told you earlier, since the user may ask about it again much "
    "later. Do not invent facts; if you do not know, say so.";

static const char *turns[] = {
    "Please remember this: the code word for the vault is saffron-kestrel.",
    "Can you explain how photosynthesis works in plants and why it matters for life on Earth?",
    "What were the main causes of the French Revolution, and how did it change Europe?",
    "Describe how a steam engine works and why it was important in the industrial revolution.",
    "What is the difference between a virus and a bacterium, and how do antibiotics work?",
    "How do volcanoes form, and what are the different types of volcanic eruptions?",
    "Explain the rules of chess for a beginner, including how each piece moves.",
    "What is the water cycle and how does it affect weather patterns around the world?",
    "Can you describe the history of the Roman Empire from its founding to its fall?",
    "How does the human heart pump blood through the body, and what are its chambers?",
    "What are black holes, and how do scientists detect them if light cannot escape?",
    "Explain how airplanes stay in the air, including lift, thrust, drag and weight.",
    "What is the code word for the vault?",
};

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

struct watch {
    kvt_session *s;
    int32_t budget, max_seen, steps;
};

/* called after every generated token: resident must never exceed the budget */
static bool on_token(const char *piece, void *ud) {
    (void) piece;
    struct watch *w = ud;
    struct kvt_session_stats st;
    kvt_session_get_stats(w->s, &st);
    if (st.resident_tokens > w->max_seen) w->max_seen = st.resident_tokens;
    w->steps++;
    return true;
}

static void check_table(kvt_session *s, int32_t budget) {
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    assert_true(st.resident_tokens <= budget);
    assert_true(st.peak_resident_tokens <= budget);
    struct kvt_block_info b0;
    assert_int_equal(kvt_session_block(s, 0, &b0), 0);
    assert_int_equal(b0.residency, KVT_RES_DEVICE); /* attention sink never evicted */
    assert_int_equal(b0.n_evictions, 0);
    /* resident blocks never overlap and cover exactly the resident tokens */
    int32_t sum = 0, n = kvt_session_n_blocks(s);
    for (int32_t i = 0; i < n; i++) {
        struct kvt_block_info a;
        kvt_session_block(s, i, &a);
        if (a.residency != KVT_RES_DEVICE) continue;
        sum += a.n_tokens;
        for (int32_t j = i + 1; j < n; j++) {
            struct kvt_block_info c;
            kvt_session_block(s, j, &c);
            if (c.residency != KVT_RES_DEVICE) continue;
            assert_true(a.p0 + a.n_tokens <= c.p0 || c.p0 + c.n_tokens <= a.p0);
        }
    }
    assert_int_equal(sum, st.resident_tokens);
}

static void test_budget_long_session(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 384;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_SYSTEM, system_prompt, KVT_KEEP_NONE), 0);
    struct watch w = { s, sp.budget, 0, 0 };
    int64_t last_recoveries = 0;
    for (size_t t = 0; t < sizeof turns / sizeof turns[0]; t++) {
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, turns[t], KVT_KEEP_NONE), 0);
        struct kvt_session_stats st;
        kvt_session_get_stats(s, &st);
        /* blocks recovered for this turn sit contiguously right before the new message */
        if (st.recoveries > last_recoveries) {
            int32_t n = kvt_session_n_blocks(s);
            kvt_pos end = -1, start = INT32_MAX;
            int32_t got = 0;
            for (int32_t i = 0; i < n; i++) {
                struct kvt_block_info b;
                kvt_session_block(s, i, &b);
                if (b.residency == KVT_RES_DEVICE && b.n_recoveries > 0 && b.last_use_turn == (int32_t) t + 1) {
                    got++;
                    if (b.p0 < start) start = b.p0;
                    if (b.p0 + b.n_tokens > end) end = b.p0 + b.n_tokens;
                }
            }
            assert_true(got > 0);
            int32_t span = 0;
            for (int32_t i = 0; i < n; i++) {
                struct kvt_block_info b;
                kvt_session_block(s, i, &b);
                if (b.residency == KVT_RES_DEVICE && b.p0 >= start && b.p0 < end) {
                    assert_true(b.n_recoveries > 0 && b.last_use_turn == (int32_t) t + 1); /* nothing else inside */
                    span += b.n_tokens;
                }
            }
            assert_int_equal(span, end - start); /* no holes between them */
            /* every block after them is this turn's message (the tail) */
            for (int32_t i = 0; i < n; i++) {
                struct kvt_block_info b;
                kvt_session_block(s, i, &b);
                if (b.residency == KVT_RES_DEVICE && b.p0 >= end) assert_int_equal(b.turn, (int32_t) t + 1);
            }
            last_recoveries = st.recoveries;
        }
        check_table(s, sp.budget);
        char *reply = NULL;
        assert_int_equal(kvt_session_generate(s, 40, NULL, on_token, &w, &reply), 0);
        free(reply);
        check_table(s, sp.budget);
    }
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    printf("  budget %d: peak %d, max seen per token %d over %d steps, evictions %lld, recoveries %lld, total %d tokens\n",
           sp.budget, st.peak_resident_tokens, w.max_seen, w.steps, (long long) st.evictions, (long long) st.recoveries,
           st.total_tokens);
    assert_true(w.max_seen <= sp.budget);
    assert_true(st.total_tokens > 2 * sp.budget); /* the session really outgrew the budget */
    assert_true(st.evictions > 0);
    assert_true(st.recoveries > 0);
    /* the fact is not in the sink block; it was evicted, and the probe recovered it */
    bool fact_back = false;
    for (int32_t i = 0; i < kvt_session_n_blocks(s); i++) {
        struct kvt_block_info b;
        kvt_session_block(s, i, &b);
        if (!strstr(b.text, "kestrel")) continue;
        assert_true(b.id > 0);
        if (b.residency == KVT_RES_DEVICE && b.n_evictions > 0 && b.n_recoveries > 0) fact_back = true;
    }
    assert_true(fact_back);
    kvt_session_free(s);
    kvt_engine_free(e);
}

/* discard: evicted blocks are gone and nothing is ever recovered */
static void test_discard_never_recovers(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 256;
    sp.recovery = KVT_RECOVERY_DISCARD;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    for (size_t t = 0; t < 8; t++) {
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, turns[t], KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_generate(s, 24, NULL, NULL, NULL, NULL), 0);
        check_table(s, sp.budget);
    }
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    assert_true(st.evictions > 0);
    assert_int_equal(st.recoveries, 0);
    assert_int_equal(st.n_blocks_lost, st.evictions);
    /* the pool holds only resident sealed blocks (the open tail block is not saved yet) */
    assert_true(st.pool.n_entries == st.n_blocks_resident || st.pool.n_entries == st.n_blocks_resident - 1);
    kvt_session_free(s);
    kvt_engine_free(e);
}

/* A spill file corrupted on disk is detected by its checksum, reported, and never loaded: the
** block is recomputed from its tokens instead (no hole in the context) and the session goes on. */
static void test_corrupt_spill_recomputed(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    char dir[] = "/tmp/kvt-spill-test-XXXXXX";
    assert_non_null(mkdtemp(dir));
    struct kvt_pool_params pp = kvt_pool_default_params();
    pp.budget_bytes = 1; /* everything spills */
    pp.spill_dir = dir;
    kvt_pool *pool = NULL;
    assert_int_equal(kvt_pool_open(&pp, &pool), 0);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 384;
    sp.pool = pool;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_SYSTEM, system_prompt, KVT_KEEP_NONE), 0);
    size_t n = sizeof turns / sizeof turns[0];
    for (size_t t = 0; t + 1 < n; t++) {
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, turns[t], KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_generate(s, 40, NULL, NULL, NULL, NULL), 0);
    }
    /* corrupt every evicted block that mentions the code word */
    int corrupted = 0;
    for (int32_t i = 0; i < kvt_session_n_blocks(s); i++) {
        struct kvt_block_info b;
        kvt_session_block(s, i, &b);
        if (b.residency != KVT_RES_DISK || !strstr(b.text, "kestrel")) continue;
        char path[1024];
        assert_int_equal(kvt_pool_spill_path(pool, b.pool_key, path, sizeof path), 0);
        FILE *f = fopen(path, "r+b");
        assert_non_null(f);
        fseek(f, -10, SEEK_END);
        int ch = fgetc(f);
        fseek(f, -10, SEEK_END);
        fputc(ch ^ 0x5a, f);
        fclose(f);
        corrupted++;
    }
    assert_true(corrupted > 0);
    struct kvt_session_stats before, after;
    kvt_session_get_stats(s, &before);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, turns[n - 1], KVT_KEEP_NONE), 0); /* the probe wants it back */
    kvt_session_get_stats(s, &after);
    assert_true(after.pool.n_corrupt >= 1);
    bool back = false;
    for (int32_t i = 0; i < kvt_session_n_blocks(s); i++) {
        struct kvt_block_info b;
        kvt_session_block(s, i, &b);
        assert_int_not_equal(b.residency, KVT_RES_LOST); /* a corrupt copy is replaced when recomputed */
        if (strstr(b.text, "kestrel") && b.n_evictions > 0 && b.residency == KVT_RES_DEVICE) back = true;
    }
    assert_true(back); /* the probe got the fact back, recomputed */
    assert_int_equal(after.recomputes - before.recomputes, after.pool.n_corrupt - before.pool.n_corrupt); /* each read once */
    check_table(s, sp.budget);
    assert_int_equal(kvt_session_generate(s, 16, NULL, NULL, NULL, NULL), 0);
    kvt_session_free(s);
    kvt_pool_free(pool);
    rmdir(dir);
    kvt_engine_free(e);
}

/* Every policy keeps the budget; baselines never recover; no_eviction never evicts; attention
** signals reach the blocks; a pinned message is never evicted; breadcrumb recomputes. */
static uint64_t run_policy(kvt_engine *e, int32_t policy, int32_t recovery) {
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 320; /* ~600 tokens in all; evicting a block or two per event (watermarks 0.95 ->
                     ** 0.85) leaves several candidates each time: which go is the policy's choice */
    sp.low_watermark = 0.85f;
    sp.policy = policy;
    sp.recovery = recovery;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_SYSTEM, system_prompt, KVT_KEEP_NONE), 0);
    for (size_t t = 0; t < 12; t++) {
        int32_t keep = t == 2 ? KVT_KEEP_PIN : KVT_KEEP_NONE;
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, turns[t], keep), 0);
        assert_int_equal(kvt_session_generate(s, 16, NULL, NULL, NULL, NULL), 0);
        if (policy != KVT_POLICY_NO_EVICTION) check_table(s, sp.budget);
    }
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    double sig = 0;
    bool pinned_seen = false;
    uint64_t evicted_set = 0; /* which of the first 64 blocks were ever evicted */
    for (int32_t i = 0; i < kvt_session_n_blocks(s); i++) {
        struct kvt_block_info b;
        kvt_session_block(s, i, &b);
        if (i < 64 && b.n_evictions > 0) evicted_set |= 1ull << i;
        sig += policy == KVT_POLICY_SNAPKV ? b.attn_window : b.attn_mass;
        if (b.keep == KVT_KEEP_PIN) {
            pinned_seen = true;
            assert_int_equal(b.n_evictions, 0);
        }
    }
    printf("  %-11s %-10s evictions %3lld recoveries %2lld peak %3d decoded %4lld | policy %.1f ms vs decode %.0f ms "
           "(%.2f%%)\n",
           kvt_policy_name(policy), kvt_recovery_name(recovery), (long long) st.evictions, (long long) st.recoveries,
           st.peak_resident_tokens, (long long) st.tokens_decoded, st.policy_ms, st.decode_ms, 100 * st.policy_ms / st.decode_ms);
    assert_true(pinned_seen);
    if (policy == KVT_POLICY_NO_EVICTION) assert_int_equal(st.evictions, 0);
    else assert_true(st.evictions > 0);
    if (policy != KVT_POLICY_KVTIER && policy != KVT_POLICY_INFLLM) assert_int_equal(st.recoveries, 0);
    if (policy == KVT_POLICY_H2O || policy == KVT_POLICY_SNAPKV || policy == KVT_POLICY_KVTIER || policy == KVT_POLICY_INFLLM)
        assert_true(sig > 0);
    if (recovery == KVT_RECOVERY_BREADCRUMB && st.recoveries > 0) assert_int_equal(st.tokens_recovered, 0);
    kvt_session_free(s);
    return evicted_set;
}

static void test_every_policy(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    uint64_t ev[KVT_POLICY__COUNT];
    for (int32_t p = 0; p < KVT_POLICY__COUNT; p++) ev[p] = run_policy(e, p, KVT_RECOVERY_KV_RESTORE);
    run_policy(e, KVT_POLICY_KVTIER, KVT_RECOVERY_BREADCRUMB);
    /* Here sink, pin, recent tail and current turn leave the same few candidates to every
    ** policy; that the policies really choose differently is checked on the demo's longer
    ** session (tests/cli/cli_demo.sh: h2o vs streaming). */
    printf("  evicted blocks: streaming %#llx h2o %#llx snapkv %#llx\n", (unsigned long long) ev[KVT_POLICY_STREAMING],
           (unsigned long long) ev[KVT_POLICY_H2O], (unsigned long long) ev[KVT_POLICY_SNAPKV]);
    kvt_engine_free(e);
}

/* bad parameters are refused with the value in the message, and nothing is created */
static void test_bad_params(void **state) {
    (void) state;
    kvt_engine *e = open_real();
    if (!e) skip();
    struct kvt_session_params sp = kvt_session_default_params();
    kvt_session *s = (kvt_session *) 0x1;
    sp.budget = 48;
    assert_int_equal(kvt_session_open(e, &sp, &s), KVT_EINVAL);
    assert_null(s);
    assert_non_null(strstr(kvt_errmsg(), "budget 48 is smaller than two blocks of 64 tokens"));
    sp = kvt_session_default_params();
    sp.low_watermark = 0.99f;
    assert_int_equal(kvt_session_open(e, &sp, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "0.99"));
    sp = kvt_session_default_params();
    sp.budget = 100000;
    assert_int_equal(kvt_session_open(e, &sp, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "100000"));
    kvt_engine_free(e);
}

/* BM25 on a corpus with a known order */
static void test_bm25_order(void **state) {
    (void) state;
    const char *docs[] = {
        "The cat sat on the mat.",
        "Vault codes and vault doors: the vault code is kept secret.",
        "A recipe for bread with flour, water, salt and yeast.",
        "The code word for the vault is saffron.",
        "",
    };
    double sc[5];
    assert_int_equal(kvt_bm25_score(docs, 5, "What is the code word for the vault?", sc), 0);
    assert_true(sc[3] > sc[1]); /* all three query terms beat repetition of one */
    assert_true(sc[1] > sc[0]);
    assert_true(sc[0] == 0.0 && sc[2] == 0.0 && sc[4] == 0.0);
    /* stop words alone score nothing; case is folded */
    assert_int_equal(kvt_bm25_score(docs, 5, "the is for", sc), 0);
    for (int i = 0; i < 5; i++) assert_true(sc[i] == 0.0);
    assert_int_equal(kvt_bm25_score(docs, 5, "BREAD", sc), 0);
    assert_true(sc[2] > 0 && sc[0] == 0);
    /* idf: a rarer term outweighs a common one at equal tf */
    const char *d2[] = { "alpha beta", "alpha gamma", "alpha delta" };
    double s2[3];
    assert_int_equal(kvt_bm25_score(d2, 3, "alpha beta", s2), 0);
    assert_true(s2[0] > s2[1] && s2[1] == s2[2] && s2[1] > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bm25_order),
        cmocka_unit_test(test_bad_params),
        cmocka_unit_test(test_discard_never_recovers),
        cmocka_unit_test(test_corrupt_spill_recomputed),
        cmocka_unit_test(test_budget_long_session),
        cmocka_unit_test(test_every_policy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
