/* test_store_prefetch.c — the block store's prefetch (kvt_store_prefetch, src/store/prefetch.c)
** with a real SQLite index, real blob files and a real redis-server (redis_fixture.h):
** promotion from disk into RAM (later gets are RAM hits, counted as prefetch hits; a store
** without prefetch threads is the control: the same gets are disk hits); the bounds (a full
** queue drops, the caller never waits; prefetch_bytes caps unread promotions; a promotion evicted
** unread is wasted); a corrupt blob is not promoted and the later get misses; a Redis prefetch
** (pipelined) returns the same bytes; a frozen Redis: the prefetch call returns at once, a get of
** a key in flight waits at most the deadline (the key then counts as skipped: not answered), a
** get of a key still queued reads it itself; the fault site fails reads, which the gets then do
** themselves. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "store_fixture.h"
#include "redis_fixture.h"
#include "fault.h"

static kvt_key MODEL;

struct fx {
    struct rfx redis;
    char dir_a[64], dir_b[64];
};

static int setup(void **state) {
    struct fx *f = calloc(1, sizeof *f);
    if (!f) return -1;
    strcpy(f->dir_a, "/tmp/kvt-test-pf-a-XXXXXX");
    strcpy(f->dir_b, "/tmp/kvt-test-pf-b-XXXXXX");
    if (!mkdtemp(f->dir_a) || !mkdtemp(f->dir_b)) return -1;
    *state = f;
    return 0;
}

static int teardown(void **state) {
    struct fx *f = *state;
    rfx_cleanup(&f->redis);
    sk_rm_rf(f->dir_a);
    sk_rm_rf(f->dir_b);
    free(f);
    return 0;
}

static void need_redis(struct fx *f) {
    int rc = rfx_start(&f->redis);
    if (rc == 1) {
        print_message("redis-server is not installed (Debian: apt-get install redis-server): skipped\n");
        skip();
    }
    assert_int_equal(rc, 0);
}

static kvt_store *open_p(const struct kvt_store_params *p) {
    kvt_store *st = NULL;
    int rc = kvt_store_open(p, &st);
    if (rc) fail_msg("kvt_store_open %s: %s (%s)", p->dir, kvt_strerror(rc), kvt_errmsg());
    return st;
}

static struct kvt_store_params params(const char *dir, int threads) {
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = dir;
    p.prefetch_threads = threads;
    return p;
}

static void put_block(kvt_store *st, const kvt_key *k) {
    size_t n;
    uint8_t *b = sk_content(k, &n);
    struct kvt_store_meta m = sk_meta(&MODEL, k);
    assert_int_equal(kvt_store_put(st, k, &m, b, n), 0);
    free(b);
}

/* Write n blocks "<tag>/i" to a store in dir and close it (so a reopened store has them on disk only). */
static void fill(const char *dir, const char *tag, int n, kvt_key *ks) {
    struct kvt_store_params p = params(dir, 0);
    kvt_store *st = open_p(&p);
    for (int i = 0; i < n; i++) {
        ks[i] = sk_key(tag, i);
        put_block(st, &ks[i]);
    }
    kvt_store_free(st);
}

/* get key, check the bytes on a hit; returns the tier (NONE on a miss). */
static enum kvt_tier get_tier(kvt_store *st, const kvt_key *k) {
    void *d = NULL;
    size_t n = 0;
    enum kvt_tier t = KVT_TIER_NONE;
    int rc = kvt_store_get(st, k, &MODEL, &d, &n, NULL, &t);
    if (rc) {
        assert_int_equal(rc, KVT_ENOENT);
        assert_null(d);
        return KVT_TIER_NONE;
    }
    size_t want_n;
    uint8_t *want = sk_content(k, &want_n);
    assert_int_equal(n, want_n);
    assert_memory_equal(d, want, n);
    free(want);
    free(d);
    return t;
}

static struct kvt_store_prefetch_stats pstats(kvt_store *st) {
    struct kvt_store_stats s;
    kvt_store_get_stats(st, &s);
    return s.prefetch;
}

/* Until every issued key has been dealt with (5 s at most). */
static struct kvt_store_prefetch_stats wait_idle(kvt_store *st) {
    struct kvt_store_prefetch_stats s;
    for (int i = 0; i < 5000; i++) {
        s = pstats(st);
        if (s.issued == s.promoted + s.skipped + s.absent + s.failed + s.claimed + s.cancelled) return s;
        usleep(1000);
    }
    fail_msg("prefetch never went idle: issued %lld", (long long) s.issued);
    return s;
}

/* Disk -> RAM: after the prefetch every get is a RAM hit with the stored bytes; prefetch hits
** count them and the disk tier counts no hit.  Control: without prefetch threads the same gets
** are disk hits. */
static void test_promote(void **state) {
    struct fx *f = *state;
    enum { N = 24 };
    kvt_key ks[N];
    fill(f->dir_a, "pf", N, ks);
    for (int on = 0; on < 2; on++) {
        struct kvt_store_params p = params(f->dir_a, on ? 2 : 0);
        kvt_store *st = open_p(&p);
        int q = kvt_store_prefetch(st, ks, N, &MODEL);
        assert_int_equal(q, on ? N : 0);
        struct kvt_store_prefetch_stats s = wait_idle(st);
        assert_int_equal(s.on, on);
        assert_int_equal(s.promoted, on ? N : 0);
        assert_int_equal(kvt_store_prefetch(st, ks, N, &MODEL), 0); /* all in RAM now (or no threads): nothing queued */
        for (int i = 0; i < N; i++) assert_int_equal(get_tier(st, &ks[i]), on ? KVT_TIER_RAM : KVT_TIER_DISK);
        struct kvt_store_stats ss;
        kvt_store_get_stats(st, &ss);
        assert_int_equal(ss.prefetch.hits, on ? N : 0);
        assert_int_equal(ss.prefetch.unread_bytes, 0);
        assert_int_equal(ss.prefetch.wasted, 0);
        assert_int_equal(ss.disk.hits, on ? 0 : N);
        assert_int_equal(ss.ram.hits, on ? N : 0);
        kvt_store_free(st);
    }
    /* bad arguments */
    struct kvt_store_params p = params(f->dir_a, 1);
    kvt_store *st = open_p(&p);
    assert_int_equal(kvt_store_prefetch(NULL, ks, 1, &MODEL), KVT_EINVAL);
    assert_int_equal(kvt_store_prefetch(st, ks, -1, &MODEL), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "-1"));
    assert_int_equal(kvt_store_prefetch(st, NULL, 2, &MODEL), KVT_EINVAL);
    assert_int_equal(kvt_store_prefetch(st, ks, 1, NULL), KVT_EINVAL);
    kvt_store_free(st);
    p.prefetch_threads = 17;
    assert_int_equal(kvt_store_open(&p, &st), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "17"));
}

/* The bounds.  A queue of 4 keys asked for 400: most are dropped (counted) and the call takes
** no time.  prefetch_bytes of ~3 blocks: promotions stop near it (each thread may overshoot by
** one block) and the rest are dropped or skipped.  A RAM tier too small for what was promoted:
** the evicted unread promotions are wasted. */
static void test_bounded(void **state) {
    struct fx *f = *state;
    enum { N = 400 };
    kvt_key *ks = malloc(sizeof *ks * N);
    assert_non_null(ks);
    fill(f->dir_a, "bound", N, ks);

    struct kvt_store_params p = params(f->dir_a, 1);
    p.prefetch_queue = 4;
    kvt_store *st = open_p(&p);
    double t0 = rfx_now_ms();
    int q = kvt_store_prefetch(st, ks, N, &MODEL);
    double dt = rfx_now_ms() - t0;
    struct kvt_store_prefetch_stats s = wait_idle(st);
    print_message("queue 4, %d keys: %d queued, %lld dropped, call %.2f ms\n", N, q, (long long) s.dropped, dt);
    assert_int_equal(s.issued, q);
    assert_int_equal(s.issued + s.dropped, N);
    assert_true(s.dropped >= N / 2);
    assert_true(dt < 200);
    kvt_store_free(st);

    p = params(f->dir_a, 1);
    p.prefetch_bytes = 3 * 8692; /* sk_size() < 8692 */
    st = open_p(&p);
    kvt_store_prefetch(st, ks, 40, &MODEL);
    s = wait_idle(st);
    print_message("prefetch_bytes %zu: %lld promoted, %lld unread bytes, %lld dropped, %lld skipped\n", p.prefetch_bytes,
                  (long long) s.promoted, (long long) s.unread_bytes, (long long) s.dropped, (long long) s.skipped);
    assert_true(s.unread_bytes <= (int64_t) p.prefetch_bytes + 8692);
    assert_true(s.promoted >= 3 && s.promoted < 40);
    assert_int_equal(s.promoted + s.dropped + s.skipped, 40);
    kvt_store_free(st);

    p = params(f->dir_a, 1);
    p.ram_bytes = 20 * 8692;        /* holds >= 20 blocks */
    p.prefetch_bytes = p.ram_bytes; /* let prefetch fill it, then push its own promotions out */
    st = open_p(&p);
    kvt_store_prefetch(st, ks, 20, &MODEL);
    wait_idle(st);
    kvt_store_prefetch(st, ks + 100, 60, &MODEL);
    s = wait_idle(st);
    struct kvt_store_stats ss;
    kvt_store_get_stats(st, &ss);
    print_message("small RAM: %lld promoted, %lld wasted, %lld evictions\n", (long long) s.promoted, (long long) s.wasted,
                  (long long) ss.ram.evictions);
    assert_true(s.wasted > 0);
    assert_int_equal(s.wasted, ss.ram.evictions); /* every eviction here was an unread promotion */
    kvt_store_free(st);
    free(ks);
}

/* A blob whose payload was damaged on disk: not promoted (failed, disk.corrupt), removed, and
** the later get is a miss; the others are promoted. */
static void test_corrupt(void **state) {
    struct fx *f = *state;
    enum { N = 8, BAD = 3 };
    kvt_key ks[N];
    fill(f->dir_a, "pfbad", N, ks);
    sk_flip_byte(f->dir_a, &ks[BAD], KVT__SBLOB_HDR + 7, 0x40);
    struct kvt_store_params p = params(f->dir_a, 2);
    kvt_store *st = open_p(&p);
    kvt_store_prefetch(st, ks, N, &MODEL);
    struct kvt_store_prefetch_stats s = wait_idle(st);
    assert_int_equal(s.promoted, N - 1);
    assert_int_equal(s.failed, 1);
    for (int i = 0; i < N; i++) assert_int_equal(get_tier(st, &ks[i]), i == BAD ? KVT_TIER_NONE : KVT_TIER_RAM);
    struct kvt_store_stats ss;
    kvt_store_get_stats(st, &ss);
    assert_int_equal(ss.disk.corrupt, 1);
    assert_int_equal(ss.prefetch.hits, N - 1);
    assert_int_equal(sk_count_files(f->dir_a), N - 1);
    kvt_store_free(st);
}

/* The fault site: the first two reads fail; those blocks stay on disk and their gets read them
** there; the rest are RAM hits. */
static void test_fault(void **state) {
    struct fx *f = *state;
    enum { N = 6 };
    kvt_key ks[N];
    fill(f->dir_a, "pffault", N, ks);
    struct kvt_store_params p = params(f->dir_a, 1); /* one thread: reads in queue order */
    kvt_store *st = open_p(&p);
    kvt__fault_set(KVT__FAULT_STORE_PREFETCH, 0, 2);
    kvt_store_prefetch(st, ks, N, &MODEL);
    struct kvt_store_prefetch_stats s = wait_idle(st);
    assert_int_equal(kvt__fault_hits(KVT__FAULT_STORE_PREFETCH), 2);
    kvt__fault_set(KVT__FAULT_STORE_PREFETCH, 0, 0);
    assert_int_equal(s.failed, 2);
    assert_int_equal(s.promoted, N - 2);
    for (int i = 0; i < N; i++) assert_int_equal(get_tier(st, &ks[i]), i < 2 ? KVT_TIER_DISK : KVT_TIER_RAM);
    kvt_store_free(st);
}

/* kvt_store_prefetch_chain: the keys of a prompt's full blocks before its last token, from the
** chain root as a session computes them: blocks stored under those keys are promoted, the
** partial last block is not asked for, and bad arguments are refused. */
static void test_chain(void **state) {
    struct fx *f = *state;
    enum { B = 16, NT = 5 * B + 1 }; /* 5 full blocks before the last token */
    kvt_token tok[6 * B];            /* the prompt is tok[0..NT); the 6th block's key is computed for the control */
    for (int i = 0; i < 6 * B; i++) tok[i] = 1000 + i * 7;
    struct kvt_chain_params cp = { .model = MODEL, .layout = "test-layout", .block = B, .tenant = "t1" };
    kvt_key ks[6], k;
    assert_int_equal(kvt_chain_root(&cp, &k), 0);
    for (int i = 0; i < 6; i++) { /* 6 keys: the 6th would be the block holding the last token */
        assert_int_equal(kvt_chain_next(&k, tok + i * B, B, &k), 0);
        ks[i] = k;
    }
    struct kvt_store_params p = params(f->dir_a, 0);
    kvt_store *st = open_p(&p);
    for (int i = 0; i < 6; i++) put_block(st, &ks[i]);
    kvt_store_free(st);
    p = params(f->dir_a, 2);
    st = open_p(&p);
    assert_int_equal(kvt_store_prefetch_chain(st, &cp, tok, NT), 5);
    struct kvt_store_prefetch_stats s = wait_idle(st);
    assert_int_equal(s.promoted, 5);
    for (int i = 0; i < 6; i++) assert_int_equal(get_tier(st, &ks[i]), i < 5 ? KVT_TIER_RAM : KVT_TIER_DISK);
    cp.tenant = "t2"; /* another tenant's chain: nothing of it is stored */
    assert_int_equal(kvt_store_prefetch_chain(st, &cp, tok, NT), 5);
    s = wait_idle(st);
    assert_int_equal(s.absent, 5);
    assert_int_equal(kvt_store_prefetch_chain(st, &cp, tok, B), 0); /* no full block before the last token */
    assert_int_equal(kvt_store_prefetch_chain(st, &cp, tok, -1), KVT_EINVAL);
    assert_int_equal(kvt_store_prefetch_chain(st, NULL, tok, NT), KVT_EINVAL);
    cp.block = 0;
    assert_int_equal(kvt_store_prefetch_chain(st, &cp, tok, NT), KVT_EINVAL);
    kvt_store_free(st);
}

static struct kvt_store_params rparams(const char *dir, const char *url, int threads, int timeout_ms) {
    struct kvt_store_params p = params(dir, threads);
    p.redis_url = url;
    p.redis_timeout_ms = timeout_ms;
    return p;
}

/* Store A writes blocks to Redis; store B (its own, empty directory) prefetches them: pipelined
** GETs, promoted into RAM with the same bytes; B's gets are RAM hits, Redis counts no get. */
static void test_redis(void **state) {
    struct fx *f = *state;
    need_redis(f);
    enum { N = 20 };
    kvt_key ks[N];
    struct kvt_store_params pa = rparams(f->dir_a, f->redis.url, 0, 1000);
    kvt_store *a = open_p(&pa);
    for (int i = 0; i < N; i++) {
        ks[i] = sk_key("pfredis", i);
        put_block(a, &ks[i]);
    }
    kvt_store_flush(a);
    kvt_store_free(a);
    struct kvt_store_params pb = rparams(f->dir_b, f->redis.url, 2, 1000);
    kvt_store *b = open_p(&pb);
    kvt_key absent = sk_key("pfredis", N + 1);
    kvt_store_prefetch(b, ks, N, &MODEL);
    kvt_store_prefetch(b, &absent, 1, &MODEL);
    struct kvt_store_prefetch_stats s = wait_idle(b);
    assert_int_equal(s.promoted, N);
    assert_int_equal(s.absent, 1);
    for (int i = 0; i < N; i++) assert_int_equal(get_tier(b, &ks[i]), KVT_TIER_RAM);
    assert_int_equal(get_tier(b, &absent), KVT_TIER_NONE);
    struct kvt_store_stats ss;
    kvt_store_get_stats(b, &ss);
    assert_int_equal(ss.prefetch.hits, N);
    assert_int_equal(ss.redis.hits, 0);
    assert_int_equal(ss.redis.errors + ss.redis.timeouts + ss.redis.corrupt, 0);
    kvt_store_flush(b); /* promoted from Redis: queued for B's disk too */
    kvt_store_get_stats(b, &ss);
    assert_int_equal(ss.disk.entries, N);
    kvt_store_free(b);
}

/* A frozen Redis (SIGSTOP): the prefetch call returns at once; a get of a key whose prefetch is
** in flight waits for it and misses within the deadline (one timeout counted for the batch, the
** rest backed off); a key on disk queued behind the stuck batch is taken back by its get, which
** reads it itself (claimed, a disk hit). */
static void test_redis_frozen(void **state) {
    struct fx *f = *state;
    need_redis(f);
    enum { N = 16 };
    const int T = 200;
    kvt_key ks[N], d;
    struct kvt_store_params pb = rparams(f->dir_b, f->redis.url, 1, T);
    kvt_store *b = open_p(&pb);
    d = sk_key("pfdisk", 0);
    put_block(b, &d);
    kvt_store_flush(b);
    kvt_store_free(b);
    b = open_p(&pb); /* d is on disk only */
    for (int i = 0; i < N; i++) ks[i] = sk_key("pffrozen", i);
    kvt_key warm = sk_key("pffrozen", 99);
    assert_int_equal(get_tier(b, &warm), KVT_TIER_NONE); /* connects while Redis is fast */
    kill(f->redis.pid, SIGSTOP);
    double t0 = rfx_now_ms();
    kvt_store_prefetch(b, ks, N, &MODEL);
    kvt_store_prefetch(b, &d, 1, &MODEL);
    double t_call = rfx_now_ms() - t0;
    for (int i = 0; i < 2000 && pstats(b).queue_len == N + 1; i++) usleep(100); /* the thread took its first batch */
    assert_int_equal(get_tier(b, &d), KVT_TIER_DISK);                           /* queued behind the stuck batch: read here */
    double t_d = rfx_now_ms() - t0;
    assert_int_equal(get_tier(b, &ks[0]), KVT_TIER_NONE); /* in flight: waits, then a miss */
    double t_k = rfx_now_ms() - t0;
    struct kvt_store_prefetch_stats s = wait_idle(b);
    double t_all = rfx_now_ms() - t0;
    kill(f->redis.pid, SIGCONT);
    print_message("frozen Redis: prefetch call %.2f ms, disk key %.1f ms, key in flight %.1f ms, all %.1f ms (deadline %d)\n",
                  t_call, t_d, t_k, t_all, T);
    assert_true(t_call < 50);
    assert_true(t_d < T / 2);
    assert_true(t_k < 4.0 * T + 100); /* its prefetch's deadline, then its own */
    assert_true(t_all < 5.0 * T + 100);
    assert_int_equal(s.claimed, 1);
    assert_true(s.waited >= 1);
    assert_int_equal(s.skipped, N); /* not answered: skipped, and the get asked Redis itself */
    assert_int_equal(s.cancelled, 0);
    struct kvt_store_stats ss;
    kvt_store_get_stats(b, &ss);
    /* one per batch (the first may be short: at most 3 batches of N = 16), then the get's own */
    assert_true(ss.redis.timeouts >= 1 && ss.redis.timeouts <= 4);
    kvt_store_free(b);
}

/* kvt_store_prefetch_forget / _cancel take back what is still queued behind a batch stuck on a frozen
** Redis (counted), not the batch in flight. */
static void test_cancel(void **state) {
    struct fx *f = *state;
    need_redis(f);
    enum { N = 24 };
    const int T = 150;
    kvt_key ks[N];
    struct kvt_store_params pb = rparams(f->dir_b, f->redis.url, 1, T);
    kvt_store *b = open_p(&pb);
    for (int i = 0; i < N; i++) ks[i] = sk_key("pfcancel", i);
    kvt_key warm = sk_key("pfcancel", 99);
    assert_int_equal(get_tier(b, &warm), KVT_TIER_NONE);
    kill(f->redis.pid, SIGSTOP);
    assert_int_equal(kvt_store_prefetch(b, ks, N, &MODEL), N);
    for (int i = 0; i < 2000 && pstats(b).queue_len == N; i++) usleep(100); /* the thread took its first batch */
    int64_t queued = pstats(b).queue_len;
    /* the last 8 keys are queued behind the batch in flight: forget takes back exactly those */
    assert_int_equal(kvt_store_prefetch_forget(b, ks + N - 8, 8), 8);
    assert_int_equal(kvt_store_prefetch_forget(b, ks + N - 8, 8), 0); /* already taken back */
    assert_int_equal(kvt_store_prefetch_forget(b, &warm, 1), 0);      /* never queued */
    assert_int_equal(kvt_store_prefetch_forget(b, NULL, 3), 0);
    int n = 8 + kvt_store_prefetch_cancel(b);
    struct kvt_store_prefetch_stats s = wait_idle(b);
    kill(f->redis.pid, SIGCONT);
    print_message("cancel: %d of %d keys taken back (%lld queued just before)\n", n, N, (long long) queued);
    assert_true(n >= N - 8 && n <= queued); /* at most one batch of 8 was in flight */
    assert_int_equal(s.cancelled, n);
    assert_int_equal(s.skipped + s.absent, N - n); /* the batch in flight: not answered */
    assert_int_equal(s.queue_len, 0);
    assert_int_equal(kvt_store_prefetch_cancel(b), 0);
    assert_int_equal(kvt_store_prefetch_cancel(NULL), 0);
    kvt_store_free(b);
}

int main(void) {
    MODEL = sk_key("model", 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_promote, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bounded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupt, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fault, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chain, setup, teardown),
        cmocka_unit_test_setup_teardown(test_redis, setup, teardown),
        cmocka_unit_test_setup_teardown(test_redis_frozen, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
