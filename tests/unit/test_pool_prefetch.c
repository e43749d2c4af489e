/* test_pool_prefetch — the host pool's prefetch (kvt_pool_prefetch) with real spill files, and a
** parked session's (kvt_session_prefetch_resume) on the tiny generated llama model.
**
**   promote        spilled values prefetched come back into RAM (no longer spilled, pf_promoted),
**                  a later get is served from RAM (pf_hits, no spill read) with the same bytes;
**                  RAM stays within the budget.  Control: a get of a spilled value that was not
**                  prefetched reads its file (n_spill_reads grows).
**   queue_full     more keys than the queue holds: exactly 128 queued, the rest dropped and
**                  counted, and the call returns at once (it never reads a file).
**   corrupt        a damaged spill file is not promoted (pf_failed), stays spilled, and its get
**                  reports KVT_ECORRUPT as without prefetch (n_corrupt).
**   fault          KVT__FAULT_POOL_PREFETCH fails one read: that value is not promoted, its get
**                  still reads the right bytes from disk; the other one is promoted.
**   race           keys prefetched and immediately asked for: every value right, and each file
**                  read exactly once (spill reads by gets + promotions == keys).
**   session        a parked session whose blocks spilled, resumed with and without
**                  kvt_session_prefetch_resume: bit-identical logits; with it, resume's gets are
**                  served by promoted blocks (pf_hits == pf_promoted > 0), no file read twice,
**                  none of its blocks pushed out of RAM.  A session alone in its pool (RAM
**                  holds its own blocks, named by the prefetch): nothing promoted, same logits.
*/
#include "pool_fixture.h"

#include <math.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Wait until every queued key has been dealt with (promoted, skipped, failed or claimed). */
static void quiesce(kvt_pool *pool, struct kvt_pool_stats *st) {
    const double t0 = now_ms();
    for (;;) {
        kvt_pool_get_stats(pool, st);
        if (st->pf_promoted + st->pf_skipped + st->pf_failed + st->pf_claimed == st->pf_issued) return;
        if (now_ms() - t0 > 20000) fail_msg("prefetch did not finish within 20 s");
        usleep(1000);
    }
}

/* n values of `size` bytes under keys 1..n into a pool of `budget` bytes: OUT vals[k] is key k+1's. */
static kvt_pool *filled(struct fx *f, size_t budget, int n, size_t size, uint8_t **vals) {
    kvt_pool *pool = open_pool(budget, f->dir);
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int k = 0; k < n; k++) {
        vals[k] = rand_bytes(&seed, size);
        assert_int_equal(kvt_pool_put(pool, (uint64_t)k + 1, vals[k], size), 0);
    }
    return pool;
}

static void free_vals(uint8_t **vals, int n) {
    for (int k = 0; k < n; k++) free(vals[k]);
}

static void test_promote(void **state) {
    struct fx *f = *state;
    uint8_t *vals[8];
    kvt_pool *pool = filled(f, 4096, 8, 1000, vals); /* 4 in RAM, keys 1..4 spilled */
    assert_true(is_spilled(pool, 1) && is_spilled(pool, 2) && is_spilled(pool, 3));
    const uint64_t keys[] = { 1, 2, 7 }; /* 7 is in RAM: ignored */
    assert_int_equal(kvt_pool_prefetch(pool, keys, 3), 2);
    struct kvt_pool_stats st;
    quiesce(pool, &st);
    assert_int_equal(st.pf_issued, 2);
    assert_int_equal(st.pf_promoted, 2);
    assert_false(is_spilled(pool, 1));
    assert_false(is_spilled(pool, 2));
    assert_true(st.ram_bytes <= 4096);
    assert_int_equal(st.n_spill_reads, 0);
    check_value(pool, 1, vals[0], 1000);
    check_value(pool, 2, vals[1], 1000);
    stats(pool, &st);
    assert_int_equal(st.pf_hits, 2);
    assert_int_equal(st.n_spill_reads, 0); /* served from RAM */
    assert_int_equal(st.n_entries, 8);
    assert_true(st.ram_bytes <= 4096);
    check_value(pool, 2, vals[1], 1000); /* a promotion is a hit once */
    stats(pool, &st);
    assert_int_equal(st.pf_hits, 2);
    /* control: a spilled value not prefetched is read from its file */
    int spilled = 0;
    for (uint64_t k = 3; k <= 8; k++)
        if (is_spilled(pool, k)) {
            check_value(pool, k, vals[k - 1], 1000);
            spilled++;
        }
    assert_true(spilled > 0);
    stats(pool, &st);
    assert_int_equal(st.n_spill_reads, spilled);
    kvt_pool_free(pool);
    free_vals(vals, 8);
}

static void test_queue_full(void **state) {
    struct fx *f = *state;
    enum { N = 300 };
    uint8_t *vals[N];
    kvt_pool *pool = filled(f, 1000, N, 100, vals); /* 10 in RAM, 290 spilled */
    uint64_t keys[200];
    for (int k = 0; k < 200; k++) keys[k] = (uint64_t)k + 1;
    const double t0 = now_ms();
    int q = kvt_pool_prefetch(pool, keys, 200);
    const double dt = now_ms() - t0;
    assert_int_equal(q, 128);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.pf_issued, 128);
    assert_int_equal(st.pf_dropped, 72);
    assert_true(dt < 1000); /* queues only: 200 file reads are not done in the call */
    quiesce(pool, &st);
    assert_true(st.ram_bytes <= 1000);
    assert_true(st.pf_promoted > 0);
    assert_true(st.pf_skipped > 0); /* unread promotions may hold half the budget only */
    for (int k = 0; k < 200; k++) check_value(pool, (uint64_t)k + 1, vals[k], 100);
    kvt_pool_free(pool);
    free_vals(vals, N);
    /* bad input */
    assert_int_equal(kvt_pool_prefetch(NULL, keys, 1), KVT_EINVAL);
    pool = open_pool(1000, f->dir);
    assert_int_equal(kvt_pool_prefetch(pool, NULL, 1), KVT_EINVAL);
    assert_int_equal(kvt_pool_prefetch(pool, keys, -1), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "negative"));
    assert_int_equal(kvt_pool_prefetch(pool, keys, 5), 0); /* absent keys */
    kvt_pool_free(pool);
}

static void test_corrupt(void **state) {
    struct fx *f = *state;
    uint8_t *vals[8];
    kvt_pool *pool = filled(f, 4096, 8, 1000, vals);
    char path[PATH_MAX];
    assert_int_equal(kvt_pool_spill_path(pool, 1, path, sizeof path), 0);
    assert_true(path[0]);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    assert_int_equal(pread(fd, &b, 1, HDR + 500), 1);
    b ^= 0x20;
    assert_int_equal(pwrite(fd, &b, 1, HDR + 500), 1);
    close(fd);
    const uint64_t keys[] = { 1, 2 };
    assert_int_equal(kvt_pool_prefetch(pool, keys, 2), 2);
    struct kvt_pool_stats st;
    quiesce(pool, &st);
    assert_int_equal(st.pf_failed, 1);
    assert_int_equal(st.pf_promoted, 1);
    assert_true(is_spilled(pool, 1));
    void *data = NULL;
    size_t n = 7;
    assert_int_equal(kvt_pool_get(pool, 1, &data, &n), KVT_ECORRUPT);
    assert_null(data);
    assert_non_null(strstr(kvt_errmsg(), "SHA-256"));
    stats(pool, &st);
    assert_int_equal(st.n_corrupt, 1); /* the get's, as without prefetch */
    check_value(pool, 2, vals[1], 1000);
    kvt_pool_free(pool);
    free_vals(vals, 8);
}

static void test_fault(void **state) {
    struct fx *f = *state;
    uint8_t *vals[8];
    kvt_pool *pool = filled(f, 4096, 8, 1000, vals);
    kvt__fault_set(KVT__FAULT_POOL_PREFETCH, 0, 1);
    const uint64_t keys[] = { 1, 2 };
    assert_int_equal(kvt_pool_prefetch(pool, keys, 2), 2);
    struct kvt_pool_stats st;
    quiesce(pool, &st);
    assert_int_equal(kvt__fault_hits(KVT__FAULT_POOL_PREFETCH), 1);
    kvt__fault_set(KVT__FAULT_POOL_PREFETCH, 0, 0);
    assert_int_equal(st.pf_failed, 1);
    assert_int_equal(st.pf_promoted, 1);
    assert_true(is_spilled(pool, 1)); /* the failed one, taken first */
    assert_false(is_spilled(pool, 2));
    check_value(pool, 1, vals[0], 1000);
    check_value(pool, 2, vals[1], 1000);
    stats(pool, &st);
    assert_int_equal(st.n_spill_reads, 1);
    assert_int_equal(st.pf_hits, 1);
    assert_int_equal(st.n_corrupt, 0);
    kvt_pool_free(pool);
    free_vals(vals, 8);
}

static void test_race(void **state) {
    struct fx *f = *state;
    enum { N = 64 };
    uint8_t *vals[N];
    kvt_pool *pool = filled(f, 64 * 1024, N, 4096, vals); /* 16 in RAM, 48 spilled */
    uint64_t keys[48];
    for (int k = 0; k < 48; k++) keys[k] = (uint64_t)k + 1;
    for (int k = 0; k < 48; k++) assert_true(is_spilled(pool, keys[k]));
    assert_int_equal(kvt_pool_prefetch(pool, keys, 48), 48);
    for (int k = 0; k < 48; k++) check_value(pool, keys[k], vals[k], 4096);
    struct kvt_pool_stats st;
    quiesce(pool, &st);
    /* every file read once: by a get (claimed) or by the thread (promoted; its get copies RAM) */
    assert_int_equal(st.n_spill_reads + st.pf_promoted, 48);
    assert_int_equal(st.pf_claimed + st.pf_promoted + st.pf_skipped + st.pf_failed, 48);
    assert_int_equal(st.pf_failed, 0);
    assert_true(st.ram_bytes <= 64 * 1024);
    kvt_pool_free(pool);
    free_vals(vals, N);
}

/* ---- a parked session --------------------------------------------------------------- */

static kvt_engine *open_tiny(void) {
    const char *dir = getenv("KVT_TINY_DIR");
    assert_non_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny-llama.gguf", dir);
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
        int len = 4 + (int)(seed % 4);
        for (int c = 0; c < len; c++) {
            seed = seed * 1103515245u + 12345u;
            buf[k++] = (char)('a' + (seed >> 16) % 26);
        }
        buf[k++] = ' ';
    }
    buf[k ? k - 1 : 0] = '\0';
}

struct run_out {
    float *logits;
    int64_t n_blocks, pool_bytes, spilled, queued, promoted, hits, spill_reads, recomputes;
};

/* A session of a few turns (blocks of 32) in a pool of `budget` bytes, parked, `other` values of
** `block` bytes put after it (another session parked later), [prefetched], resumed, then one
** probe token: OUT r (r->logits freed by the caller). */
static void run(struct fx *f, kvt_engine *e, size_t budget, bool prefetch, int other, size_t block, struct run_out *r) {
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    kvt_pool *pool = open_pool(budget, f->dir);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 1024;
    sp.block = 32;
    sp.pool = pool;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    char msg[512];
    for (uint32_t t = 1; t <= 3; t++) {
        filler_msg(msg, sizeof msg, t, 40);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg), 0);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "ok"), 0);
    }
    assert_int_equal(kvt_session_prefetch_resume(s), 0); /* not parked: nothing */
    assert_int_equal(kvt_session_park(s), 0);
    /* another session parked after it: its blocks take the RAM (this one's are spilled) */
    uint64_t seed = 42;
    for (int k = 0; k < other; k++) {
        uint8_t *junk = rand_bytes(&seed, block);
        assert_int_equal(kvt_pool_put(pool, 0xabc000 + (uint64_t)k, junk, block), 0);
        free(junk);
    }
    struct kvt_pool_stats ps;
    stats(pool, &ps);
    r->spilled = ps.n_spilled;
    r->pool_bytes = ps.ram_bytes + ps.spill_bytes;
    r->queued = 0;
    if (prefetch) {
        r->queued = kvt_session_prefetch_resume(s);
        assert_true(r->queued >= 0);
        quiesce(pool, &ps);
    }
    assert_int_equal(kvt_session_resume(s, 0), 0);
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    assert_int_equal(st.n_blocks_resident, st.n_blocks);
    r->n_blocks = st.n_blocks;
    r->recomputes = st.recomputes;
    r->promoted = st.pool.pf_promoted;
    r->hits = st.pool.pf_hits;
    r->spill_reads = st.pool.n_spill_reads;
    const kvt_token probe = 7;
    assert_int_equal(kvt_decode(e, 0, &probe, 1, st.next_pos, true), 0);
    r->logits = malloc(sizeof(float) * (size_t)I.n_vocab);
    assert_non_null(r->logits);
    memcpy(r->logits, kvt_logits(e), sizeof(float) * (size_t)I.n_vocab);
    kvt_seq_rm(e, 0, 0, -1);
    kvt_session_free(s);
    kvt_pool_free(pool);
}

static void test_session(void **state) {
    struct fx *f = *state;
    kvt_engine *e = open_tiny();
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    struct run_out probe, off, on;
    run(f, e, (size_t)256 << 20, false, 0, 0, &probe); /* nothing spills: the block size */
    assert_int_equal(probe.spilled, 0);
    assert_true(probe.n_blocks >= 5);
    const size_t block = (size_t)(probe.pool_bytes / probe.n_blocks);
    const size_t budget = 4 * block + block / 2; /* about 4 blocks in RAM, the rest spilled */
    run(f, e, budget, false, 4, block, &off);
    run(f, e, budget, true, 4, block, &on);
    struct run_out alone; /* no other session: its own blocks fill RAM and prefetch evicts none */
    run(f, e, budget, true, 0, block, &alone);
    assert_true(alone.queued > 0);
    assert_int_equal(alone.promoted, 0);
    print_message("blocks %lld (about %zu bytes), budget %zu: %lld spilled; prefetch queued %lld, promoted %lld, "
                  "hits %lld, spill reads %lld (off: %lld)\n", (long long)off.n_blocks, block, budget,
                  (long long)off.spilled, (long long)on.queued, (long long)on.promoted, (long long)on.hits,
                  (long long)on.spill_reads, (long long)off.spill_reads);
    assert_true(off.spilled > 0);
    assert_int_equal(on.spilled, off.spilled);
    assert_int_equal(on.queued, on.spilled);
    assert_true(on.promoted >= 1);
    assert_int_equal(on.hits, on.promoted); /* every promoted block served resume */
    assert_int_equal(off.hits, 0);
    assert_int_equal(on.spill_reads + on.promoted, off.spill_reads); /* each file read once, none pushed out */
    assert_int_equal(on.recomputes, 0);
    assert_int_equal(off.recomputes, 0);
    double m = 0;
    for (int i = 0; i < I.n_vocab; i++) {
        m = fmax(m, fabs((double)on.logits[i] - off.logits[i]));
        m = fmax(m, fabs((double)on.logits[i] - probe.logits[i]));
        m = fmax(m, fabs((double)alone.logits[i] - probe.logits[i]));
    }
    assert_true(m == 0.0);
    free(probe.logits);
    free(off.logits);
    free(on.logits);
    free(alone.logits);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_promote, setup, teardown),
        cmocka_unit_test_setup_teardown(test_queue_full, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupt, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fault, setup, teardown),
        cmocka_unit_test_setup_teardown(test_race, setup, teardown),
        cmocka_unit_test_setup_teardown(test_session, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
