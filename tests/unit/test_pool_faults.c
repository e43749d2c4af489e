/* test_pool_faults.c — the host pool when things fail or run concurrently: a failed spill drops
** its entry (RAM is a ceiling, n_dropped counts it), the spill quota's drop order, cleanup of
** stale private directories of dead processes, concurrent use on disjoint keys and on shared keys
** with spill writes failing (failure injection: src/fault.h). */
#include "pool_fixture.h"

/* A full disk under a busy pool (every other spill write fails, by injection): RAM never goes
** above the budget, each failed write drops its entry and is counted, every key reads back
** either its value or KVT_ENOENT, and the put that hit the failure says so. */
static void test_failed_spill_drops(void **state) {
    struct fx *f = *state;
    const size_t budget = 10000;
    kvt_pool *pool = open_pool(budget, f->dir);
    uint64_t s = 31;
    enum { N = 60 };
    uint8_t *vals[N];
    size_t sizes[N];
    int n_eio = 0;
    struct kvt_pool_stats st;
    for (int i = 0; i < N; i++) {
        sizes[i] = 500 + (size_t) (rng_next(&s) % 2500);
        vals[i] = rand_bytes(&s, sizes[i]);
        kvt__fault_set(KVT__FAULT_SPILL_WRITE, i % 2, 1); /* this put's first or second write fails */
        int rc = kvt_pool_put(pool, (uint64_t) i, vals[i], sizes[i]);
        const bool hit = kvt__fault_hits(KVT__FAULT_SPILL_WRITE) > 0;
        kvt__fault_set(KVT__FAULT_SPILL_WRITE, 0, 0);
        stats(pool, &st);
        if (st.ram_bytes > (int64_t) budget)
            fail_msg("after put %d: %lld bytes in RAM, budget %zu", i, (long long) st.ram_bytes, budget);
        if (hit) {
            assert_int_equal(rc, KVT_EIO);
            assert_non_null(strstr(kvt_errmsg(), strerror(ENOSPC)));
            assert_non_null(strstr(kvt_errmsg(), "dropped"));
            n_eio++;
        } else {
            assert_int_equal(rc, 0);
        }
    }
    assert_true(n_eio > 10);
    stats(pool, &st);
    assert_int_equal(st.n_dropped, n_eio);                       /* one entry per failed write */
    assert_int_equal(count_entries(f->dir), (int) st.n_spilled); /* no temporary file left */
    int64_t present = 0, bytes = 0;
    for (int i = 0; i < N; i++) {
        void *got = NULL;
        size_t n = 0;
        int rc = kvt_pool_get(pool, (uint64_t) i, &got, &n);
        if (rc == KVT_ENOENT) continue;
        assert_int_equal(rc, 0);
        assert_int_equal(n, sizes[i]);
        assert_memory_equal(got, vals[i], n);
        free(got);
        present++;
        bytes += (int64_t) n;
    }
    stats(pool, &st);
    assert_int_equal(present, N - n_eio);
    assert_int_equal(st.n_entries, present);
    assert_int_equal(st.ram_bytes + st.spill_bytes, bytes);
    for (int i = 0; i < N; i++) free(vals[i]);
    kvt_pool_free(pool);
    assert_int_equal(count_entries(f->dir), 0);
}

/* spill_bytes_max: the least recently used entries on disk make room (dropped and counted; not
** an error), unless the entry being spilled is less recently used than all of them; an entry
** larger than the quota is dropped itself; one larger than budget and quota is refused. */
static void test_spill_quota(void **state) {
    struct fx *f = *state;
    struct kvt_pool_params p = kvt_pool_default_params();
    assert_int_equal(p.spill_bytes_max, 0); /* unlimited by default */
    p.budget_bytes = 1000;
    p.spill_bytes_max = 3000;
    p.spill_dir = f->dir;
    kvt_pool *pool = NULL;
    assert_int_equal(kvt_pool_open(&p, &pool), 0);
    uint64_t s = 37;
    uint8_t *v[12];
    for (int k = 0; k < 12; k++) v[k] = rand_bytes(&s, 1000);
    struct kvt_pool_stats st;
    for (int k = 0; k < 10; k++) {
        assert_int_equal(kvt_pool_put(pool, (uint64_t) k, v[k], 1000), 0);
        stats(pool, &st);
        assert_true(st.ram_bytes <= 1000);
        assert_true(st.spill_bytes <= 3000);
    }
    /* RAM: 9; disk: 6, 7, 8; dropped: 0..5, oldest first */
    assert_int_equal(st.n_dropped, 6);
    assert_int_equal(st.spill_bytes, 3000);
    assert_int_equal(count_entries(f->dir), 3);
    for (int k = 0; k < 6; k++) {
        void *out = NULL;
        size_t n = 0;
        assert_int_equal(kvt_pool_get(pool, (uint64_t) k, &out, &n), KVT_ENOENT);
    }
    for (int k = 6; k < 10; k++) check_value(pool, (uint64_t) k, v[k], 1000);
    /* LRU on disk: 6 was just read before 7 and 8, so... read 7 and 8 again: 6 is the oldest */
    check_value(pool, 7, v[7], 1000);
    check_value(pool, 8, v[8], 1000);
    check_value(pool, 9, v[9], 1000);
    assert_int_equal(kvt_pool_put(pool, 10, v[10], 1000), 0); /* 9 spills, 6 makes room */
    assert_false(is_spilled(pool, 10));
    assert_true(is_spilled(pool, 9));
    void *out = NULL;
    size_t n = 0;
    assert_int_equal(kvt_pool_get(pool, 6, &out, &n), KVT_ENOENT);
    check_value(pool, 7, v[7], 1000);
    stats(pool, &st);
    assert_int_equal(st.n_dropped, 7);
    kvt_pool_free(pool);

    /* The entry being spilled is the least recently used of all: it goes, not the disk's. */
    p.budget_bytes = 2000;
    p.spill_bytes_max = 1000;
    assert_int_equal(kvt_pool_open(&p, &pool), 0);
    assert_int_equal(kvt_pool_put(pool, 1, v[1], 1000), 0);
    assert_int_equal(kvt_pool_put(pool, 2, v[2], 1000), 0);
    assert_int_equal(kvt_pool_put(pool, 3, v[3], 1000), 0); /* 1 spills */
    assert_true(is_spilled(pool, 1));
    check_value(pool, 1, v[1], 1000);                       /* 1 is now more recent than 2 */
    assert_int_equal(kvt_pool_put(pool, 4, v[4], 1000), 0); /* 2 would spill: the quota drops 2 */
    assert_int_equal(kvt_pool_get(pool, 2, &out, &n), KVT_ENOENT);
    check_value(pool, 1, v[1], 1000);
    check_value(pool, 3, v[3], 1000);
    check_value(pool, 4, v[4], 1000);
    stats(pool, &st);
    assert_int_equal(st.n_dropped, 1);
    assert_int_equal(st.ram_bytes, 2000);
    assert_int_equal(st.spill_bytes, 1000);

    /* Larger than the quota: dropped when it would spill.  Larger than budget and quota both:
    ** refused, naming the sizes, and the pool is unchanged. */
    uint8_t *big = rand_bytes(&s, 1500);
    assert_int_equal(kvt_pool_put(pool, 5, big, 1500), 0); /* 3 spills (1 goes), then 4 (3 goes) */
    stats(pool, &st);
    assert_int_equal(st.ram_bytes, 1500);
    assert_int_equal(st.spill_bytes, 1000);
    assert_int_equal(st.n_dropped, 3);
    assert_true(is_spilled(pool, 4));
    p.spill_bytes_max = 500; /* smaller than a value: it is dropped when it would spill */
    kvt_pool *small = NULL;
    assert_int_equal(kvt_pool_open(&p, &small), 0);
    assert_int_equal(kvt_pool_put(small, 1, v[1], 1000), 0);
    assert_int_equal(kvt_pool_put(small, 2, big, 1500), 0); /* 1 cannot spill: dropped */
    assert_int_equal(kvt_pool_get(small, 1, &out, &n), KVT_ENOENT);
    check_value(small, 2, big, 1500);
    stats(small, &st);
    assert_int_equal(st.n_dropped, 1);
    assert_int_equal(st.spill_bytes, 0);
    kvt_pool_free(small);
    uint8_t *huge = rand_bytes(&s, 2500);
    assert_int_equal(kvt_pool_put(pool, 4, huge, 2500), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "2500"));
    assert_non_null(strstr(kvt_errmsg(), "1000"));
    check_value(pool, 4, v[4], 1000);
    free(big);
    free(huge);
    kvt_pool_free(pool);
    for (int k = 0; k < 12; k++) free(v[k]);
}

/* A pid that no process has: a child that has exited and been reaped. */
static long dead_pid(void) {
    pid_t c = fork();
    assert_true(c >= 0);
    if (c == 0) _exit(0);
    assert_int_equal(waitpid(c, NULL, 0), c);
    return (long) c;
}

static void touch(const char *dir, const char *name) {
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fclose(fp);
}

/* At open without a spill_dir, private directories of dead processes go, and nothing else:
** not a live process's, not one another pool holds locked (another pid namespace), not other
** names, not through a symlink, not a directory holding a file that is not ours. */
static void test_stale_dirs(void **state) {
    struct fx *f = *state;
    setenv("TMPDIR", f->dir, 1);
    const long dead = dead_pid();
    char stale[PATH_MAX], foreign[PATH_MAX], live[PATH_MAX], oldstyle[PATH_MAX], short6[PATH_MAX], link[PATH_MAX], target[PATH_MAX],
        locked[PATH_MAX];
    snprintf(stale, sizeof stale, "%s/kvtier-spill-%ld-aB3dE9", f->dir, dead);
    snprintf(foreign, sizeof foreign, "%s/kvtier-spill-%ld-xyz789", f->dir, dead);
    snprintf(live, sizeof live, "%s/kvtier-spill-%ld-live01", f->dir, (long) getppid());
    snprintf(oldstyle, sizeof oldstyle, "%s/kvtier-spill-QwErTy", f->dir);
    snprintf(short6, sizeof short6, "%s/kvtier-spill-%ld-abc12", f->dir, dead);
    snprintf(link, sizeof link, "%s/kvtier-spill-%ld-lnk123", f->dir, dead);
    snprintf(target, sizeof target, "%s/target", f->dir);
    snprintf(locked, sizeof locked, "%s/kvtier-spill-%ld-lock01", f->dir, dead);
    const char *dirs[] = { stale, foreign, live, oldstyle, short6, target, locked };
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        assert_int_equal(mkdir(dirs[i], 0700), 0);
        touch(dirs[i], "kvt-1-0-0000000000000001-1.blk");
        touch(dirs[i], ".tmp-Ab12Cd");
    }
    touch(foreign, "precious.txt");
    assert_int_equal(symlink(target, link), 0);
    int lfd = open(locked, O_RDONLY | O_DIRECTORY);
    assert_true(lfd >= 0);
    assert_int_equal(flock(lfd, LOCK_EX | LOCK_NB), 0); /* a live pool elsewhere */

    kvt_pool *pool = open_pool(100, NULL);
    assert_false(exists(stale));  /* dead pid, our files only: gone */
    assert_true(exists(foreign)); /* our files gone, the rest stays */
    assert_int_equal(count_entries(foreign), 1);
    char precious[PATH_MAX + 16];
    snprintf(precious, sizeof precious, "%s/precious.txt", foreign);
    assert_true(exists(precious));
    assert_int_equal(count_entries(live), 2);     /* a live process's */
    assert_int_equal(count_entries(oldstyle), 2); /* not our pattern */
    assert_int_equal(count_entries(short6), 2);
    assert_int_equal(count_entries(target), 2); /* never through a symlink */
    assert_int_equal(count_entries(locked), 2); /* held by a live pool */
    close(lfd);

    /* The pool's own directory carries its pid, and a second open leaves it alone. */
    uint64_t s = 41;
    uint8_t *v = rand_bytes(&s, 300);
    assert_int_equal(kvt_pool_put(pool, 1, v, 300), 0);
    char path[PATH_MAX], want[64];
    assert_int_equal(kvt_pool_spill_path(pool, 1, path, sizeof path), 0);
    snprintf(want, sizeof want, "/kvtier-spill-%ld-", (long) getpid());
    assert_non_null(strstr(path, want));
    kvt_pool *other = open_pool(100, NULL);
    check_value(pool, 1, v, 300);
    kvt_pool_free(other);
    kvt_pool_free(pool);
    assert_false(exists(path));
    free(v);
}

/* ---- threads: disjoint keys, every value checked ----------------------------------- */

struct worker {
    kvt_pool *pool;
    int id;
    int n_fail;
    char first_fail[256];
};

#define W_KEYS   40
#define W_ROUNDS 6

static void w_fail(struct worker *w, const char *what, uint64_t key, int rc) {
    if (w->n_fail++ == 0)
        snprintf(w->first_fail, sizeof w->first_fail, "thread %d: %s key %llu rc %d: %s", w->id, what, (unsigned long long) key, rc,
                 kvt_errmsg());
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    uint64_t s = 1000 + (uint64_t) w->id;
    uint8_t *vals[W_KEYS] = { 0 };
    size_t sizes[W_KEYS] = { 0 };
    for (int r = 0; r < W_ROUNDS; r++) {
        for (int i = 0; i < W_KEYS; i++) {
            uint64_t key = ((uint64_t) w->id << 32) | (uint64_t) i;
            if (vals[i] && rng_next(&s) % 4 == 0) {
                int rc = kvt_pool_del(w->pool, key);
                if (rc) w_fail(w, "del", key, rc);
                free(vals[i]);
                vals[i] = NULL;
                continue;
            }
            free(vals[i]);
            sizes[i] = 1 + (size_t) (rng_next(&s) % 2000);
            vals[i] = malloc(sizes[i]);
            for (size_t b = 0; b < sizes[i]; b++) vals[i][b] = (uint8_t) (rng_next(&s) >> 56);
            int rc = kvt_pool_put(w->pool, key, vals[i], sizes[i]);
            if (rc) w_fail(w, "put", key, rc);
        }
        for (int i = 0; i < W_KEYS; i++) {
            uint64_t key = ((uint64_t) w->id << 32) | (uint64_t) i;
            void *got = NULL;
            size_t n = 0;
            int rc = kvt_pool_get(w->pool, key, &got, &n);
            if (!vals[i]) {
                if (rc != KVT_ENOENT) w_fail(w, "get of deleted", key, rc);
            } else if (rc) {
                w_fail(w, "get", key, rc);
            } else if (n != sizes[i] || memcmp(got, vals[i], n)) {
                w_fail(w, "value mismatch", key, 0);
            }
            free(got);
        }
    }
    for (int i = 0; i < W_KEYS; i++) free(vals[i]);
    return NULL;
}

static void test_threads(void **state) {
    struct fx *f = *state;
    const size_t budget = 20000; /* far below the ~160 KB live: constant spilling */
    kvt_pool *pool = open_pool(budget, f->dir);
    enum { T = 4 };
    pthread_t th[T];
    struct worker w[T];
    for (int t = 0; t < T; t++) {
        w[t] = (struct worker){ .pool = pool, .id = t };
        assert_int_equal(pthread_create(&th[t], NULL, worker_main, &w[t]), 0);
    }
    for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
    for (int t = 0; t < T; t++)
        if (w[t].n_fail) fail_msg("%d failures; first: %s", w[t].n_fail, w[t].first_fail);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_true(st.n_spill_writes > 0);
    assert_true(st.n_spill_reads > 0);
    assert_true(st.ram_bytes <= (int64_t) budget);
    assert_int_equal(st.n_corrupt, 0);
    assert_int_equal(count_entries(f->dir), (int) st.n_spilled);
    kvt_pool_free(pool);
    assert_int_equal(count_entries(f->dir), 0);
}

/* ---- threads: shared keys, spill writes failing ------------------------------------ */

/* A value that describes itself: [key | seed | bytes from seed], so any reader can check it
** without knowing which write it sees. */
static uint8_t *self_value(uint64_t key, uint64_t seed, size_t n) {
    uint8_t *p = malloc(n);
    memcpy(p, &key, 8);
    memcpy(p + 8, &seed, 8);
    uint64_t s = seed | 1;
    for (size_t b = 16; b < n; b++) p[b] = (uint8_t) (rng_next(&s) >> 56);
    return p;
}

static bool self_check(const uint8_t *p, size_t n, uint64_t key) {
    uint64_t k, seed;
    if (n < 16) return false;
    memcpy(&k, p, 8);
    memcpy(&seed, p + 8, 8);
    if (k != key) return false;
    uint64_t s = seed | 1;
    for (size_t b = 16; b < n; b++)
        if (p[b] != (uint8_t) (rng_next(&s) >> 56)) return false;
    return true;
}

#define SH_KEYS 24
static atomic_int sh_done;

static void *shared_main(void *arg) {
    struct worker *w = arg;
    uint64_t s = 7000 + (uint64_t) w->id;
    for (int r = 0; r < 400; r++) {
        uint64_t key = rng_next(&s) % SH_KEYS, op = rng_next(&s) % 10;
        if (op < 4) {
            size_t n = 16 + (size_t) (rng_next(&s) % 1500);
            uint8_t *v = self_value(key, rng_next(&s), n);
            int rc = kvt_pool_put(w->pool, key, v, n);
            if (rc && rc != KVT_EIO) w_fail(w, "put", key, rc);
            free(v);
        } else if (op < 9) {
            void *got = NULL;
            size_t n = 0;
            int rc = kvt_pool_get(w->pool, key, &got, &n);
            if (rc == 0 && !self_check(got, n, key)) w_fail(w, "torn value", key, 0);
            else if (rc && rc != KVT_ENOENT) w_fail(w, "get", key, rc);
            free(got);
        } else {
            int rc = kvt_pool_del(w->pool, key);
            if (rc && rc != KVT_ENOENT) w_fail(w, "del", key, rc);
        }
    }
    atomic_fetch_add(&sh_done, 1);
    return NULL;
}

/* Puts, gets and deletes of the same keys from 4 threads while about every 3rd spill write fails:
** values being spilled are read, replaced and deleted meanwhile.  No torn value, RAM within the
** budget at the end, the counters match what is there, and no file is left behind. */
static void test_threads_shared(void **state) {
    struct fx *f = *state;
    const size_t budget = 6000;
    kvt_pool *pool = open_pool(budget, f->dir);
    atomic_store(&sh_done, 0);
    kvt__fault_set(KVT__FAULT_SPILL_WRITE, 2, 1);
    enum { T = 4 };
    pthread_t th[T];
    struct worker w[T];
    for (int t = 0; t < T; t++) {
        w[t] = (struct worker){ .pool = pool, .id = t };
        assert_int_equal(pthread_create(&th[t], NULL, shared_main, &w[t]), 0);
    }
    /* meanwhile: fail about one write in three */
    while (atomic_load(&sh_done) < T) {
        if (kvt__fault_hits(KVT__FAULT_SPILL_WRITE) > 0) kvt__fault_set(KVT__FAULT_SPILL_WRITE, 2, 1); /* re-arm */
        usleep(50);
    }
    for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
    kvt__fault_set(KVT__FAULT_SPILL_WRITE, 0, 0);
    for (int t = 0; t < T; t++)
        if (w[t].n_fail) fail_msg("%d failures; first: %s", w[t].n_fail, w[t].first_fail);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_true(st.ram_bytes <= (int64_t) budget);
    assert_true(st.n_spill_writes > 0);
    int64_t bytes = 0, present = 0;
    for (uint64_t key = 0; key < SH_KEYS; key++) {
        void *got = NULL;
        size_t n = 0;
        int rc = kvt_pool_get(pool, key, &got, &n);
        if (rc == KVT_ENOENT) continue;
        assert_int_equal(rc, 0);
        assert_true(self_check(got, n, key));
        bytes += (int64_t) n;
        present++;
        free(got);
    }
    stats(pool, &st);
    printf("  shared keys: %lld spill writes, %lld reads, %lld dropped; %lld entries left\n", (long long) st.n_spill_writes,
           (long long) st.n_spill_reads, (long long) st.n_dropped, (long long) present);
    assert_int_equal(st.n_entries, present);
    assert_int_equal(st.ram_bytes + st.spill_bytes, bytes);
    assert_int_equal(count_entries(f->dir), (int) st.n_spilled);
    kvt_pool_free(pool);
    assert_int_equal(count_entries(f->dir), 0);
}

/* teardown that also disarms the failure injection, so a failed test cannot leak it */
static int teardown_faults(void **state) {
    for (int k = 0; k < KVT__FAULT__COUNT; k++) kvt__fault_set((enum kvt__fault_site) k, 0, 0);
    return teardown(state);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_failed_spill_drops, setup, teardown_faults),
        cmocka_unit_test_setup_teardown(test_spill_quota, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stale_dirs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_threads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_threads_shared, setup, teardown_faults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
