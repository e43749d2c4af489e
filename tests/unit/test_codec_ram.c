/* test_codec_ram — the session's host-pool codec (kvt_session_params.codec_ram) on the tiny
** generated models (F16 KV cache).  A session is parked (every block's copy is in the pool) and
** resumed (every block decoded from the pool and loaded back in place), then the full next-token
** distribution after a probe token is compared with the same session never parked:
**
**   raw_exact       codec_ram NULL and "raw": bit-identical logits (KL 0, max |dlogit| 0) and the
**                   pool holds exactly the raw bytes (stored == raw).
**   q8_bound        q8: KL below Q8_KL_MAX, the pool holds the encoded bytes (stored < 0.7 raw,
**                   and the pool's own byte count equals the session's); control: elastic:8,8,0
**                   (nearly every element pruned) is far above the bound, so the test can see
**                   a lossy copy.
**   corrupt         q8 bytes damaged in the pool (a payload byte: checksum; the magic: format):
**                   the block is recomputed (recomputes == 1, resident again), never loaded;
**                   its KL stays within the q8 bound.
**   bad_spec        an unknown codec or a bad argument: KVT_EINVAL naming the value.
**   bits            codec_ram_bits: q4 with all 8s restores q8's very logits, all 4s q4's; bad
**                   tables refused.
*/
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

#define Q8_KL_MAX 2e-3 /* the bound test_codec asserts for q8 on the tiny models */

static kvt_engine *open_tiny(const char *name) {
    const char *dir = getenv("KVT_TINY_DIR");
    assert_non_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.gguf", dir, name);
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 1024;
    p.n_threads = 2;
    kvt_engine *e = NULL;
    assert_int_equal(kvt_engine_open(&p, &e), 0);
    return e;
}

static void filler_msg(char *buf, size_t size, uint32_t seed, int n) {
    size_t k = 0;
    for (int w = 0; w < n && k + 10 < size; w++) {
        int len = 4 + (int) (seed % 4);
        for (int c = 0; c < len; c++) {
            seed = seed * 1103515245u + 12345u;
            buf[k++] = (char) ('a' + (seed >> 16) % 26);
        }
        buf[k++] = ' ';
    }
    buf[k ? k - 1 : 0] = '\0';
}

enum damage { NONE, PAYLOAD, MAGIC };

static const uint8_t *g_bits; /* kvt_session_params.codec_ram_bits of the next run()s (NULL = none) */
static int32_t g_n_bits;

struct result {
    float *logits; /* [n_vocab] after the probe token */
    int64_t recomputes;
    int64_t raw_bytes, stored_bytes, pool_bytes;
    double enc_ms, dec_ms;
};

/* A session of a few turns (blocks of 32), parked, [damaged], resumed (every block decoded from
** the pool), then one probe token decoded at the tail: OUT r->logits (caller frees). */
static void run(kvt_engine *e, const char *spec, enum damage d, struct result *r) {
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    struct kvt_pool_params pp = kvt_pool_default_params();
    kvt_pool *pool = NULL;
    assert_int_equal(kvt_pool_open(&pp, &pool), 0);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 1024; /* no eviction */
    sp.block = 32;
    sp.pool = pool;
    sp.codec_ram = spec;
    sp.codec_ram_bits = g_bits;
    sp.n_codec_ram_bits = g_n_bits;
    kvt_session *s = NULL;
    int rc = kvt_session_open(e, &sp, &s);
    if (rc) fail_msg("open with codec_ram %s: %s", spec ? spec : "NULL", kvt_errmsg());
    char msg[512];
    for (uint32_t t = 1; t <= 3; t++) {
        filler_msg(msg, sizeof msg, t, 40);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "ok", KVT_KEEP_NONE), 0);
    }
    assert_int_equal(kvt_session_park(s), 0); /* seals the open block: every block is in the pool */
    const int32_t victim = 2;
    assert_true(kvt_session_n_blocks(s) > victim + 1);
    if (d != NONE) {
        struct kvt_block_info b;
        assert_int_equal(kvt_session_block(s, victim, &b), 0);
        void *data = NULL;
        size_t n = 0;
        assert_int_equal(kvt_pool_get(pool, b.pool_key, &data, &n), 0);
        assert_true(n > 200);
        if (d == PAYLOAD) ((uint8_t *) data)[n / 2] ^= 0x40;
        else ((uint8_t *) data)[0] ^= 0x01;
        assert_int_equal(kvt_pool_put(pool, b.pool_key, data, n), 0);
        free(data);
    }
    assert_int_equal(kvt_session_resume(s, 0), 0);
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    assert_int_equal(st.n_blocks_resident, st.n_blocks);
    const kvt_token probe = 7;
    assert_int_equal(kvt_engine_decode(e, 0, &probe, 1, st.next_pos, true), 0);
    r->logits = malloc(sizeof(float) * (size_t) I.n_vocab);
    memcpy(r->logits, kvt_engine_logits(e), sizeof(float) * (size_t) I.n_vocab);
    kvt_seq_rm(e, 0, st.next_pos, -1);
    r->recomputes = st.recomputes;
    r->raw_bytes = st.pool_raw_bytes;
    r->stored_bytes = st.pool_stored_bytes;
    r->pool_bytes = st.pool.ram_bytes + st.pool.spill_bytes;
    r->enc_ms = st.codec_encode_ms;
    r->dec_ms = st.codec_decode_ms;
    kvt_session_free(s);
    kvt_pool_free(pool);
}

static double kl(const float *p_logits, const float *q_logits, int n) {
    double mp = -INFINITY, mq = -INFINITY, zp = 0, zq = 0, k = 0;
    for (int i = 0; i < n; i++) {
        mp = fmax(mp, p_logits[i]);
        mq = fmax(mq, q_logits[i]);
    }
    for (int i = 0; i < n; i++) {
        zp += exp(p_logits[i] - mp);
        zq += exp(q_logits[i] - mq);
    }
    for (int i = 0; i < n; i++) {
        double lp = p_logits[i] - mp - log(zp), lq = q_logits[i] - mq - log(zq);
        k += exp(lp) * (lp - lq);
    }
    return k;
}

static double max_dlogit(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs((double) a[i] - b[i]));
    return m;
}

/* The reference: codec_ram NULL, the path as it was before codecs (the pool holds the raw blob). */
static void check_model(const char *name) {
    kvt_engine *e = open_tiny(name);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    const int nv = I.n_vocab;
    struct result ref, raw, q8, ctrl, bad_pay, bad_magic;
    run(e, NULL, NONE, &ref);
    run(e, "raw", NONE, &raw);
    run(e, "q8", NONE, &q8);
    run(e, "elastic:8,8,0", NONE, &ctrl);
    run(e, "q8", PAYLOAD, &bad_pay);
    run(e, "q8", MAGIC, &bad_magic);
    double k_raw = kl(ref.logits, raw.logits, nv), k_q8 = kl(ref.logits, q8.logits, nv);
    double k_ctrl = kl(ref.logits, ctrl.logits, nv);
    double k_pay = kl(ref.logits, bad_pay.logits, nv), k_mag = kl(ref.logits, bad_magic.logits, nv);
    printf("%s: raw KL %.2e max|dlogit| %.3g; q8 KL %.2e max|dlogit| %.3g, %.3fx raw bytes (%lld of %lld), "
           "encode %.2f ms, decode %.2f ms; control elastic:8,8,0 KL %.2e; corrupt payload KL %.2e (recomputes %lld), "
           "corrupt magic KL %.2e (recomputes %lld)\n",
           name, k_raw, max_dlogit(ref.logits, raw.logits, nv), k_q8, max_dlogit(ref.logits, q8.logits, nv),
           (double) q8.stored_bytes / (double) q8.raw_bytes, (long long) q8.stored_bytes, (long long) q8.raw_bytes, q8.enc_ms,
           q8.dec_ms, k_ctrl, k_pay, (long long) bad_pay.recomputes, k_mag, (long long) bad_magic.recomputes);
    /* raw: bit-exact, and the pool holds the blob's bytes */
    assert_memory_equal(ref.logits, raw.logits, sizeof(float) * (size_t) nv);
    assert_int_equal(ref.stored_bytes, ref.raw_bytes);
    assert_int_equal(raw.stored_bytes, raw.raw_bytes);
    assert_true(raw.raw_bytes > 0 && raw.raw_bytes == q8.raw_bytes);
    assert_int_equal(ref.recomputes, 0);
    assert_true(ref.enc_ms == 0 && ref.dec_ms == 0);
    /* q8: bounded, the pool counts encoded bytes */
    assert_int_equal(q8.recomputes, 0);
    assert_true(k_q8 < Q8_KL_MAX);
    assert_true(q8.stored_bytes < 0.7 * (double) q8.raw_bytes); /* 1 + 8/32 bytes an element (K groups of 32 cells) */
    assert_int_equal(q8.pool_bytes, q8.stored_bytes);
    assert_true(q8.enc_ms > 0 && q8.dec_ms > 0);
    /* control: a lossy copy is seen */
    assert_true(k_ctrl > 0.1 && k_ctrl > 20 * k_q8);
    /* corrupt copies: recomputed, never loaded */
    assert_int_equal(bad_pay.recomputes, 1);
    assert_int_equal(bad_magic.recomputes, 1);
    assert_true(k_pay < Q8_KL_MAX && k_mag < Q8_KL_MAX);
    struct result *all[] = { &ref, &raw, &q8, &ctrl, &bad_pay, &bad_magic };
    for (int i = 0; i < 6; i++) free(all[i]->logits);
    kvt_engine_free(e);
}

static void test_llama(void **st) {
    (void) st;
    check_model("tiny-llama");
}

static void test_gemma3(void **st) {
    (void) st;
    check_model("tiny-gemma3");
}

static void test_bad_spec(void **st) {
    (void) st;
    kvt_engine *e = open_tiny("tiny-llama");
    const char *bad[] = { "q7", "q8:0", "elastic:0.5,x", "raw:1" };
    const char *needle[] = { "q7", "0", "x", "raw" };
    for (int i = 0; i < 4; i++) {
        struct kvt_session_params sp = kvt_session_default_params();
        sp.codec_ram = bad[i];
        kvt_session *s = NULL;
        assert_int_equal(kvt_session_open(e, &sp, &s), KVT_EINVAL);
        assert_null(s);
        printf("codec_ram '%s': %s\n", bad[i], kvt_errmsg());
        assert_non_null(strstr(kvt_errmsg(), "codec_ram"));
        assert_non_null(strstr(kvt_errmsg(), needle[i]));
    }
    kvt_engine_free(e);
}

/* codec_ram_bits (what `--codec-bits entropy` gives the host pool): each (layer, KV head) is coded
** exactly as the uniform codec of its bits codes it, so q4 with a table of all 8s restores the
** very logits q8 restores (and all 4s q4's), and costs their bytes plus the table.  The
** table is the session's copy (the caller's buffer is clobbered after open).  Bad tables:
** KVT_EINVAL naming codec_ram_bits. */
static void test_bits(void **st) {
    (void) st;
    kvt_engine *e = open_tiny("tiny-llama");
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    const int nv = I.n_vocab, nu = I.n_layer * I.n_head_kv;
    uint8_t *b = malloc((size_t) nu);
    struct result q4, q8, q4all4, q4all8;
    run(e, "q4", NONE, &q4);
    run(e, "q8", NONE, &q8);
    g_n_bits = nu;
    g_bits = b;
    memset(b, 4, (size_t) nu);
    run(e, "q4", NONE, &q4all4);
    memset(b, 8, (size_t) nu);
    run(e, "q4", NONE, &q4all8);
    printf("codec_ram_bits: q4 %lld bytes, q4 + all-4 table %lld; q8 %lld, q4 + all-8 table %lld; KL q4 %.2e q8 %.2e\n",
           (long long) q4.stored_bytes, (long long) q4all4.stored_bytes, (long long) q8.stored_bytes,
           (long long) q4all8.stored_bytes, kl(q4all4.logits, q4.logits, nv), kl(q4all8.logits, q8.logits, nv));
    assert_memory_equal(q4all4.logits, q4.logits, sizeof(float) * (size_t) nv);
    assert_memory_equal(q4all8.logits, q8.logits, sizeof(float) * (size_t) nv);
    assert_true(max_dlogit(q4.logits, q8.logits, nv) > 0); /* the control: q4 and q8 differ, so the table shows */
    /* the table and the per-head sections' padding: a few bytes a block, under 1 % here */
    assert_true(q4all4.stored_bytes > q4.stored_bytes && q4all4.stored_bytes - q4.stored_bytes < q4.stored_bytes / 100);
    assert_true(q4all8.stored_bytes > q8.stored_bytes && q4all8.stored_bytes - q8.stored_bytes < q4.stored_bytes / 100);
    /* refused, named */
    const char *codec[] = { "q4", "raw", "q4" };
    const int32_t n[] = { nu - 1, nu, nu };
    for (int i = 0; i < 3; i++) {
        b[0] = i < 2 ? 8 : 3;
        struct kvt_session_params sp = kvt_session_default_params();
        sp.codec_ram = codec[i];
        sp.codec_ram_bits = b;
        sp.n_codec_ram_bits = n[i];
        kvt_session *s = NULL;
        assert_int_equal(kvt_session_open(e, &sp, &s), KVT_EINVAL);
        assert_null(s);
        printf("codec_ram_bits refused: %s\n", kvt_errmsg());
        assert_non_null(strstr(kvt_errmsg(), "codec_ram_bits: "));
    }
    g_bits = NULL;
    g_n_bits = 0;
    free(b);
    struct result *all[] = { &q4, &q8, &q4all4, &q4all8 };
    for (int i = 0; i < 4; i++) free(all[i]->logits);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama),
        cmocka_unit_test(test_gemma3),
        cmocka_unit_test(test_bad_spec),
        cmocka_unit_test(test_bits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
