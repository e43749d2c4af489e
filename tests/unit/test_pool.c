/* test_pool.c — the host pool: round trips, budget and LRU spilling, replace and delete,
** spill-file integrity (corrupt, truncated), open and I/O errors, cleanup at free.  Failure
** handling past the budget, the quota, stale directories and threads: test_pool_faults.c. */
#include "pool_fixture.h"

/* ---- tests ------------------------------------------------------------------------- */

static void test_round_trip(void **state) {
    struct fx *f = *state;
    kvt_pool *pool = open_pool(1 << 20, f->dir);
    uint64_t s = 42;
    enum { N = 50 };
    uint8_t *vals[N];
    size_t sizes[N];
    for (int i = 0; i < N; i++) {
        sizes[i] = i == 0 ? 0 : (size_t) (rng_next(&s) % 5000);
        vals[i] = rand_bytes(&s, sizes[i]);
        assert_int_equal(kvt_pool_put(pool, (uint64_t) i * 0x9e3779b97f4a7c15ull, vals[i], sizes[i]), 0);
    }
    int64_t total = 0;
    for (int i = 0; i < N; i++) {
        check_value(pool, (uint64_t) i * 0x9e3779b97f4a7c15ull, vals[i], sizes[i]);
        total += (int64_t) sizes[i];
    }
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.n_entries, N);
    assert_int_equal(st.n_spilled, 0);
    assert_int_equal(st.ram_bytes, total);
    assert_int_equal(count_entries(f->dir), 0);

    void *out = (void *) 0x1;
    size_t n = 7;
    assert_int_equal(kvt_pool_get(pool, 999, &out, &n), KVT_ENOENT);
    assert_null(out);
    assert_non_null(strstr(kvt_errmsg(), "00000000000003e7"));
    assert_int_equal(kvt_pool_del(pool, 999), KVT_ENOENT);
    assert_int_equal(kvt_pool_put(pool, 1, NULL, 5), KVT_EINVAL);
    assert_int_equal(kvt_pool_put(NULL, 1, vals[1], 5), KVT_EINVAL);
    for (int i = 0; i < N; i++) free(vals[i]);
    kvt_pool_free(pool);
    kvt_pool_free(NULL);
}

static void test_budget(void **state) {
    struct fx *f = *state;
    const size_t budget = 10000;
    kvt_pool *pool = open_pool(budget, f->dir);
    uint64_t s = 7;
    enum { N = 100 };
    uint8_t *vals[N];
    size_t sizes[N];
    int64_t total = 0;
    struct kvt_pool_stats st;
    for (int i = 0; i < N; i++) {
        sizes[i] = 1 + (size_t) (rng_next(&s) % 3000);
        vals[i] = rand_bytes(&s, sizes[i]);
        total += (int64_t) sizes[i];
        assert_int_equal(kvt_pool_put(pool, (uint64_t) i, vals[i], sizes[i]), 0);
        stats(pool, &st);
        assert_true(st.ram_bytes <= (int64_t) budget);
        assert_int_equal(st.ram_bytes + st.spill_bytes, total);
    }
    assert_true(st.n_spilled > 0);
    assert_int_equal(st.n_spill_writes, st.n_spilled);
    assert_int_equal(count_entries(f->dir), (int) st.n_spilled);
    int64_t n_disk = 0;
    for (int i = 0; i < N; i++) {
        n_disk += is_spilled(pool, (uint64_t) i);
        check_value(pool, (uint64_t) i, vals[i], sizes[i]);
    }
    stats(pool, &st);
    assert_int_equal(n_disk, st.n_spilled);
    assert_int_equal(st.n_spill_reads, n_disk);
    assert_true(st.ram_bytes <= (int64_t) budget);
    for (int i = 0; i < N; i++) free(vals[i]);

    /* An entry larger than the whole budget goes straight to disk, evicting nobody. */
    uint8_t *big = rand_bytes(&s, 3 * budget);
    int64_t ram_before = st.ram_bytes;
    assert_int_equal(kvt_pool_put(pool, 5000, big, 3 * budget), 0);
    assert_true(is_spilled(pool, 5000));
    stats(pool, &st);
    assert_int_equal(st.ram_bytes, ram_before);
    check_value(pool, 5000, big, 3 * budget);
    free(big);
    kvt_pool_free(pool);
}

static void test_lru(void **state) {
    struct fx *f = *state;
    kvt_pool *pool = open_pool(3000, f->dir);
    uint64_t s = 3;
    uint8_t *v[6];
    for (int i = 0; i < 6; i++) v[i] = rand_bytes(&s, 1000);
    for (int k = 1; k <= 3; k++) assert_int_equal(kvt_pool_put(pool, (uint64_t) k, v[k], 1000), 0);
    for (int k = 1; k <= 3; k++) assert_false(is_spilled(pool, (uint64_t) k));
    check_value(pool, 1, v[1], 1000); /* 1 is now the most recently used */
    assert_int_equal(kvt_pool_put(pool, 4, v[4], 1000), 0);
    assert_false(is_spilled(pool, 1));
    assert_true(is_spilled(pool, 2)); /* least recently used */
    assert_false(is_spilled(pool, 3));
    assert_false(is_spilled(pool, 4));
    check_value(pool, 3, v[3], 1000); /* order now (old→new): 1, 4, 3 */
    assert_int_equal(kvt_pool_put(pool, 5, v[5], 1000), 0);
    assert_true(is_spilled(pool, 1));
    assert_false(is_spilled(pool, 3));
    assert_false(is_spilled(pool, 4));
    assert_false(is_spilled(pool, 5));
    for (int k = 1; k <= 5; k++) check_value(pool, (uint64_t) k, v[k], 1000);
    for (int i = 0; i < 6; i++) free(v[i]);
    kvt_pool_free(pool);
}

static void test_replace(void **state) {
    struct fx *f = *state;
    kvt_pool *pool = open_pool(1000, f->dir);
    uint64_t s = 11;
    uint8_t *a = rand_bytes(&s, 600), *b = rand_bytes(&s, 200), *c = rand_bytes(&s, 1500);
    assert_int_equal(kvt_pool_put(pool, 9, a, 600), 0);
    assert_int_equal(kvt_pool_put(pool, 9, b, 200), 0);
    check_value(pool, 9, b, 200);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.n_entries, 1);
    assert_int_equal(st.ram_bytes, 200);

    /* Replace a RAM value by an oversized one (spilled), then that by a small one: the spill
    ** file must go away and the accounting follow. */
    assert_int_equal(kvt_pool_put(pool, 9, c, 1500), 0);
    char path[PATH_MAX];
    assert_int_equal(kvt_pool_spill_path(pool, 9, path, sizeof path), 0);
    assert_true(path[0] && exists(path));
    check_value(pool, 9, c, 1500);
    assert_int_equal(kvt_pool_put(pool, 9, a, 600), 0);
    assert_false(exists(path));
    assert_false(is_spilled(pool, 9));
    check_value(pool, 9, a, 600);
    stats(pool, &st);
    assert_int_equal(st.n_entries, 1);
    assert_int_equal(st.n_spilled, 0);
    assert_int_equal(st.spill_bytes, 0);
    assert_int_equal(st.ram_bytes, 600);
    free(a);
    free(b);
    free(c);
    kvt_pool_free(pool);
}

static void test_del(void **state) {
    struct fx *f = *state;
    kvt_pool *pool = open_pool(100, f->dir);
    uint64_t s = 5;
    uint8_t *v = rand_bytes(&s, 500);
    assert_int_equal(kvt_pool_put(pool, 77, v, 500), 0);
    assert_int_equal(kvt_pool_put(pool, 78, v, 50), 0);
    char path[PATH_MAX];
    assert_int_equal(kvt_pool_spill_path(pool, 77, path, sizeof path), 0);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_size, HDR + 500);
    assert_int_equal(kvt_pool_del(pool, 77), 0);
    errno = 0;
    assert_int_equal(stat(path, &sb), -1);
    assert_int_equal(errno, ENOENT);
    void *out = NULL;
    size_t n = 0;
    assert_int_equal(kvt_pool_get(pool, 77, &out, &n), KVT_ENOENT);
    assert_int_equal(kvt_pool_del(pool, 77), KVT_ENOENT);
    assert_int_equal(kvt_pool_spill_path(pool, 77, path, sizeof path), KVT_ENOENT);
    assert_int_equal(kvt_pool_del(pool, 78), 0);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.n_entries, 0);
    assert_int_equal(st.ram_bytes, 0);
    assert_int_equal(st.spill_bytes, 0);
    assert_int_equal(count_entries(f->dir), 0);
    free(v);
    kvt_pool_free(pool);
}

static void flip_byte(const char *path, off_t off) {
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    assert_int_equal(pread(fd, &b, 1, off), 1);
    b ^= 0x01;
    assert_int_equal(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

static void expect_get_fails(kvt_pool *pool, uint64_t key, int want1, int want2) {
    void *out = (void *) &out; /* sentinel: must not come back as data */
    size_t n = 99;
    int rc = kvt_pool_get(pool, key, &out, &n);
    if (rc != want1 && rc != want2)
        fail_msg("get key %llu returned %d (%s), want %d or %d", (unsigned long long) key, rc, kvt_errmsg(), want1, want2);
    assert_null(out);
}

static void test_corrupt(void **state) {
    struct fx *f = *state;
    kvt_pool *pool = open_pool(100, f->dir);
    uint64_t s = 9;
    uint8_t *v = rand_bytes(&s, 400), *w = rand_bytes(&s, 400);
    assert_int_equal(kvt_pool_put(pool, 1, v, 400), 0);
    assert_int_equal(kvt_pool_put(pool, 2, w, 400), 0);
    char path[PATH_MAX], path2[PATH_MAX];
    assert_int_equal(kvt_pool_spill_path(pool, 1, path, sizeof path), 0);
    assert_int_equal(kvt_pool_spill_path(pool, 2, path2, sizeof path2), 0);
    assert_true(path[0] && path2[0]);

    /* Control: the untouched file reads back. */
    check_value(pool, 1, v, 400);
    flip_byte(path, HDR + 123); /* one payload bit */
    expect_get_fails(pool, 1, KVT_ECORRUPT, KVT_ECORRUPT);
    assert_non_null(strstr(kvt_errmsg(), path));
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.n_corrupt, 1);
    /* The entry stays and stays corrupt. */
    expect_get_fails(pool, 1, KVT_ECORRUPT, KVT_ECORRUPT);
    stats(pool, &st);
    assert_int_equal(st.n_corrupt, 2);
    assert_int_equal(st.n_entries, 2);
    /* Flipping it back restores it: the check is on the content, not a sticky flag. */
    flip_byte(path, HDR + 123);
    check_value(pool, 1, v, 400);

    /* Header damage: the key field, and the stored SHA-256 itself. */
    flip_byte(path, 16);
    expect_get_fails(pool, 1, KVT_ECORRUPT, KVT_ECORRUPT);
    assert_non_null(strstr(kvt_errmsg(), path));
    flip_byte(path, 16);
    flip_byte(path2, 40);
    expect_get_fails(pool, 2, KVT_ECORRUPT, KVT_ECORRUPT);
    assert_non_null(strstr(kvt_errmsg(), path2));
    flip_byte(path2, 0); /* magic too */
    expect_get_fails(pool, 2, KVT_ECORRUPT, KVT_ECORRUPT);
    check_value(pool, 1, v, 400);
    stats(pool, &st);
    assert_int_equal(st.n_corrupt, 5);

    /* A corrupt entry can still be deleted or replaced. */
    assert_int_equal(kvt_pool_put(pool, 2, w, 50), 0);
    check_value(pool, 2, w, 50);
    free(v);
    free(w);
    kvt_pool_free(pool);
}

static void test_truncate(void **state) {
    struct fx *f = *state;
    kvt_pool *pool = open_pool(100, f->dir);
    uint64_t s = 13;
    uint8_t *v = rand_bytes(&s, 1000);
    const off_t cuts[] = { HDR + 999, HDR + 500, HDR, 30, 0 };
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        assert_int_equal(kvt_pool_put(pool, 3, v, 1000), 0);
        char path[PATH_MAX];
        assert_int_equal(kvt_pool_spill_path(pool, 3, path, sizeof path), 0);
        assert_true(path[0] != '\0');
        assert_int_equal(truncate(path, cuts[i]), 0);
        expect_get_fails(pool, 3, KVT_ECORRUPT, KVT_EIO);
        assert_non_null(strstr(kvt_errmsg(), path));
    }
    /* Extra bytes appended are corruption too. */
    assert_int_equal(kvt_pool_put(pool, 3, v, 1000), 0);
    char path[PATH_MAX];
    assert_int_equal(kvt_pool_spill_path(pool, 3, path, sizeof path), 0);
    assert_int_equal(truncate(path, HDR + 1001), 0);
    expect_get_fails(pool, 3, KVT_ECORRUPT, KVT_EIO);
    /* A vanished file is an I/O error naming the file. */
    assert_int_equal(unlink(path), 0);
    expect_get_fails(pool, 3, KVT_EIO, KVT_EIO);
    assert_non_null(strstr(kvt_errmsg(), path));
    assert_int_equal(kvt_pool_del(pool, 3), 0);
    free(v);
    kvt_pool_free(pool);
}

static void test_open_errors(void **state) {
    struct fx *f = *state;
    char file[PATH_MAX], sub[PATH_MAX], fresh[PATH_MAX];
    snprintf(file, sizeof file, "%s/regular", f->dir);
    snprintf(sub, sizeof sub, "%s/regular/spill", f->dir);
    snprintf(fresh, sizeof fresh, "%s/fresh", f->dir);
    FILE *fp = fopen(file, "w");
    assert_non_null(fp);
    fclose(fp);

    struct kvt_pool_params p = kvt_pool_default_params();
    assert_true(p.budget_bytes > 0);
    assert_null(p.spill_dir);
    kvt_pool *pool = (kvt_pool *) &p;
    p.spill_dir = file;
    assert_int_equal(kvt_pool_open(&p, &pool), KVT_EIO);
    assert_null(pool);
    assert_non_null(strstr(kvt_errmsg(), file));
    p.spill_dir = sub;
    assert_int_equal(kvt_pool_open(&p, &pool), KVT_EIO);
    assert_non_null(strstr(kvt_errmsg(), sub));
    p.spill_dir = f->dir;
    p.budget_bytes = 0;
    assert_int_equal(kvt_pool_open(&p, &pool), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "0"));

    /* A missing spill_dir is created, private to the user. */
    p.budget_bytes = 10;
    p.spill_dir = fresh;
    assert_int_equal(kvt_pool_open(&p, &pool), 0);
    struct stat sb;
    assert_int_equal(stat(fresh, &sb), 0);
    assert_true(S_ISDIR(sb.st_mode));
    assert_int_equal(sb.st_mode & 0777, 0700);
    kvt_pool_free(pool);
}

static void test_unwritable_tmpdir(void **state) {
    struct fx *f = *state;
    char file[PATH_MAX], bad[PATH_MAX];
    snprintf(file, sizeof file, "%s/regular", f->dir);
    snprintf(bad, sizeof bad, "%s/regular/tmp", f->dir);
    FILE *fp = fopen(file, "w");
    assert_non_null(fp);
    fclose(fp);
    setenv("TMPDIR", bad, 1); /* the private spill directory cannot be made under it */

    kvt_pool *pool = open_pool(100, NULL);
    uint64_t s = 17;
    uint8_t *v = rand_bytes(&s, 300);
    assert_int_equal(kvt_pool_put(pool, 1, v, 300), KVT_EIO);
    assert_non_null(strstr(kvt_errmsg(), bad));
    assert_non_null(strstr(kvt_errmsg(), "NOT stored")); /* larger than the budget, nowhere to go */
    void *out = NULL;
    size_t n = 0;
    assert_int_equal(kvt_pool_get(pool, 1, &out, &n), KVT_ENOENT); /* dropped, not kept over budget */
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.ram_bytes, 0);
    assert_int_equal(st.n_entries, 0);
    assert_int_equal(st.n_dropped, 1);
    assert_int_equal(st.n_spilled, 0);
    assert_int_equal(st.n_spill_writes, 0);
    free(v);
    kvt_pool_free(pool);
}

static void test_unwritable_dir(void **state) {
    struct fx *f = *state;
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/spill", f->dir);
    kvt_pool *pool = open_pool(1000, dir);
    uint64_t s = 19;
    uint8_t *a = rand_bytes(&s, 800), *b = rand_bytes(&s, 800);
    assert_int_equal(kvt_pool_put(pool, 1, a, 800), 0);

    /* The directory is replaced by a regular file behind the pool's back: the spill of key 1
    ** (least recently used) fails, and key 1 is dropped so that RAM stays within the budget. */
    assert_int_equal(rmdir(dir), 0);
    FILE *fp = fopen(dir, "w");
    assert_non_null(fp);
    fclose(fp);
    assert_int_equal(kvt_pool_put(pool, 2, b, 800), KVT_EIO);
    assert_non_null(strstr(kvt_errmsg(), dir));
    assert_non_null(strstr(kvt_errmsg(), "0000000000000001"));
    assert_non_null(strstr(kvt_errmsg(), "key 0000000000000002 stored"));
    void *out = NULL;
    size_t n = 0;
    assert_int_equal(kvt_pool_get(pool, 1, &out, &n), KVT_ENOENT);
    check_value(pool, 2, b, 800);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.ram_bytes, 800);
    assert_int_equal(st.n_entries, 1);
    assert_int_equal(st.n_dropped, 1);

    /* Once the directory is back, spilling works again; no temporary file was left behind by
    ** the failed attempt. */
    assert_int_equal(unlink(dir), 0);
    assert_int_equal(mkdir(dir, 0700), 0);
    assert_int_equal(kvt_pool_put(pool, 3, a, 800), 0);
    stats(pool, &st);
    assert_true(st.ram_bytes <= 1000);
    assert_int_equal(st.n_spilled, 1);
    assert_int_equal(count_entries(dir), (int) st.n_spilled);
    check_value(pool, 2, b, 800);
    check_value(pool, 3, a, 800);
    free(a);
    free(b);
    kvt_pool_free(pool);
    assert_int_equal(count_entries(dir), 0);
}

/* Fault injection on the write itself: a file-size limit makes write(2) fail with EFBIG
** part-way through the spill file.  The put must report it, drop the value (it is larger than
** the whole budget: RAM is a ceiling) and leave no temporary file behind. */
static void test_write_fails(void **state) {
    struct fx *f = *state;
    kvt_pool *pool = open_pool(1000, f->dir);
    uint64_t s = 29;
    uint8_t *v = rand_bytes(&s, 5000);
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = 1000;
    void (*old_sig)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int rc = kvt_pool_put(pool, 4, v, 5000);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, old_sig);
    assert_int_equal(rc, KVT_EIO);
    assert_non_null(strstr(kvt_errmsg(), f->dir));
    assert_non_null(strstr(kvt_errmsg(), strerror(EFBIG)));
    assert_int_equal(count_entries(f->dir), 0);
    void *out = NULL;
    size_t n = 0;
    assert_int_equal(kvt_pool_get(pool, 4, &out, &n), KVT_ENOENT);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.ram_bytes, 0);
    assert_int_equal(st.n_dropped, 1);
    assert_int_equal(st.n_spill_writes, 0);
    /* Without the limit, the same put spills it. */
    assert_int_equal(kvt_pool_put(pool, 4, v, 5000), 0);
    assert_true(is_spilled(pool, 4));
    check_value(pool, 4, v, 5000);
    free(v);
    kvt_pool_free(pool);
}

static void test_free_cleanup(void **state) {
    struct fx *f = *state;
    setenv("TMPDIR", f->dir, 1);
    kvt_pool *pool = open_pool(500, NULL);
    uint64_t s = 23;
    uint8_t *v = rand_bytes(&s, 400);
    for (uint64_t k = 0; k < 10; k++) assert_int_equal(kvt_pool_put(pool, k, v, 400), 0);
    assert_int_equal(count_entries(f->dir), 1); /* the private directory */
    char path[PATH_MAX];
    assert_int_equal(kvt_pool_spill_path(pool, 0, path, sizeof path), 0);
    assert_true(path[0] != '\0');
    assert_non_null(strstr(path, "/kvtier-spill-"));
    *strrchr(path, '/') = '\0';
    assert_int_equal(count_entries(path), 9);
    /* A buffer too small for the path is refused, never silently truncated. */
    char tiny[8];
    assert_int_equal(kvt_pool_spill_path(pool, 0, tiny, sizeof tiny), KVT_EINVAL);
    assert_string_equal(tiny, "");
    kvt_pool_free(pool);
    assert_false(exists(path));
    assert_int_equal(count_entries(f->dir), 0);

    /* A caller's spill_dir is emptied but kept. */
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/mine", f->dir);
    pool = open_pool(500, dir);
    for (uint64_t k = 0; k < 10; k++) assert_int_equal(kvt_pool_put(pool, k, v, 400), 0);
    assert_int_equal(count_entries(dir), 9);
    kvt_pool_free(pool);
    assert_int_equal(count_entries(dir), 0);
    free(v);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_budget, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lru, setup, teardown),
        cmocka_unit_test_setup_teardown(test_replace, setup, teardown),
        cmocka_unit_test_setup_teardown(test_del, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupt, setup, teardown),
        cmocka_unit_test_setup_teardown(test_truncate, setup, teardown),
        cmocka_unit_test_setup_teardown(test_open_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unwritable_tmpdir, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unwritable_dir, setup, teardown),
        cmocka_unit_test_setup_teardown(test_write_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_free_cleanup, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
