/* test_pool.c — the host pool: round trips, budget and LRU spilling, spill-file integrity,
** I/O failures, cleanup, and concurrent use. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvtier.h"
#include "internal.h"     /* kvt_pool_spill_path */

#define HDR 64 /* spill file header bytes: magic, version, reserved, key, length, SHA-256 */

/* ---- fixtures and helpers ---------------------------------------------------------- */

struct fx {
    char dir[64];     /* per-test scratch directory under /tmp */
    char *old_tmpdir; /* $TMPDIR to restore */
};

static uint64_t rng_next(uint64_t *s) { /* xorshift64*: reproducible payloads */
    *s ^= *s >> 12; *s ^= *s << 25; *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static uint8_t *rand_bytes(uint64_t *s, size_t n) {
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(rng_next(s) >> 56);
    return p;
}

static void rm_rf(const char *path) {
    struct stat sb;
    if (lstat(path, &sb)) return;
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            char sub[PATH_MAX];
            snprintf(sub, sizeof sub, "%s/%s", path, de->d_name);
            rm_rf(sub);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static int count_entries(const char *dir) { /* files in dir, excluding . and .. */
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) n++;
    closedir(d);
    return n;
}

static bool exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

static int setup(void **state) {
    struct fx *f = calloc(1, sizeof *f);
    if (!f) return -1;
    strcpy(f->dir, "/tmp/kvt-test-pool-XXXXXX");
    if (!mkdtemp(f->dir)) { free(f); return -1; }
    const char *t = getenv("TMPDIR");
    f->old_tmpdir = t ? strdup(t) : NULL;
    *state = f;
    return 0;
}

static int teardown(void **state) {
    struct fx *f = *state;
    if (f->old_tmpdir) setenv("TMPDIR", f->old_tmpdir, 1); else unsetenv("TMPDIR");
    free(f->old_tmpdir);
    rm_rf(f->dir);
    free(f);
    return 0;
}

static kvt_pool *open_pool(size_t budget, const char *dir) {
    struct kvt_pool_params p = kvt_pool_default_params();
    p.budget_bytes = budget;
    p.spill_dir = dir;
    kvt_pool *pool = NULL;
    int rc = kvt_pool_open(&p, &pool);
    if (rc) fail_msg("kvt_pool_open: %s (%s)", kvt_strerror(rc), kvt_errmsg());
    return pool;
}

static void check_value(kvt_pool *pool, uint64_t key, const uint8_t *want, size_t n) {
    void *got = NULL;
    size_t got_n = 12345;
    int rc = kvt_pool_get(pool, key, &got, &got_n);
    if (rc) fail_msg("get key %llu: %s (%s)", (unsigned long long)key, kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(got_n, n);
    assert_non_null(got);
    if (n) assert_memory_equal(got, want, n);
    free(got);
}

static bool is_spilled(kvt_pool *pool, uint64_t key) {
    char path[PATH_MAX];
    assert_int_equal(kvt_pool_spill_path(pool, key, path, sizeof path), 0);
    return path[0] != '\0';
}

static void stats(kvt_pool *pool, struct kvt_pool_stats *st) { kvt_pool_get_stats(pool, st); }

/* ---- tests ------------------------------------------------------------------------- */

static void test_round_trip(void **state) {
    struct fx *f = *state;
    kvt_pool *pool = open_pool(1 << 20, f->dir);
    uint64_t s = 42;
    enum { N = 50 };
    uint8_t *vals[N];
    size_t sizes[N];
    for (int i = 0; i < N; i++) {
        sizes[i] = i == 0 ? 0 : (size_t)(rng_next(&s) % 5000);
        vals[i] = rand_bytes(&s, sizes[i]);
        assert_int_equal(kvt_pool_put(pool, (uint64_t)i * 0x9e3779b97f4a7c15ull, vals[i], sizes[i]), 0);
    }
    int64_t total = 0;
    for (int i = 0; i < N; i++) {
        check_value(pool, (uint64_t)i * 0x9e3779b97f4a7c15ull, vals[i], sizes[i]);
        total += (int64_t)sizes[i];
    }
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.n_entries, N);
    assert_int_equal(st.n_spilled, 0);
    assert_int_equal(st.ram_bytes, total);
    assert_int_equal(count_entries(f->dir), 0);

    void *out = (void *)0x1;
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
        sizes[i] = 1 + (size_t)(rng_next(&s) % 3000);
        vals[i] = rand_bytes(&s, sizes[i]);
        total += (int64_t)sizes[i];
        assert_int_equal(kvt_pool_put(pool, (uint64_t)i, vals[i], sizes[i]), 0);
        stats(pool, &st);
        assert_true(st.ram_bytes <= (int64_t)budget);
        assert_int_equal(st.ram_bytes + st.spill_bytes, total);
    }
    assert_true(st.n_spilled > 0);
    assert_int_equal(st.n_spill_writes, st.n_spilled);
    assert_int_equal(count_entries(f->dir), (int)st.n_spilled);
    int64_t n_disk = 0;
    for (int i = 0; i < N; i++) {
        n_disk += is_spilled(pool, (uint64_t)i);
        check_value(pool, (uint64_t)i, vals[i], sizes[i]);
    }
    stats(pool, &st);
    assert_int_equal(n_disk, st.n_spilled);
    assert_int_equal(st.n_spill_reads, n_disk);
    assert_true(st.ram_bytes <= (int64_t)budget);
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
    for (int k = 1; k <= 3; k++) assert_int_equal(kvt_pool_put(pool, (uint64_t)k, v[k], 1000), 0);
    for (int k = 1; k <= 3; k++) assert_false(is_spilled(pool, (uint64_t)k));
    check_value(pool, 1, v[1], 1000); /* 1 is now the most recently used */
    assert_int_equal(kvt_pool_put(pool, 4, v[4], 1000), 0);
    assert_false(is_spilled(pool, 1));
    assert_true(is_spilled(pool, 2));  /* least recently used */
    assert_false(is_spilled(pool, 3));
    assert_false(is_spilled(pool, 4));
    check_value(pool, 3, v[3], 1000); /* order now (old→new): 1, 4, 3 */
    assert_int_equal(kvt_pool_put(pool, 5, v[5], 1000), 0);
    assert_true(is_spilled(pool, 1));
    assert_false(is_spilled(pool, 3));
    assert_false(is_spilled(pool, 4));
    assert_false(is_spilled(pool, 5));
    for (int k = 1; k <= 5; k++) check_value(pool, (uint64_t)k, v[k], 1000);
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
    free(a); free(b); free(c);
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
    void *out = (void *)&out; /* sentinel: must not come back as data */
    size_t n = 99;
    int rc = kvt_pool_get(pool, key, &out, &n);
    if (rc != want1 && rc != want2)
        fail_msg("get key %llu returned %d (%s), want %d or %d", (unsigned long long)key, rc,
                 kvt_errmsg(), want1, want2);
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
    free(v); free(w);
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
    kvt_pool *pool = (kvt_pool *)&p;
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
    assert_false(is_spilled(pool, 1));
    check_value(pool, 1, v, 300);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.ram_bytes, 300);
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

    /* The directory is replaced by a regular file behind the pool's back. */
    assert_int_equal(rmdir(dir), 0);
    FILE *fp = fopen(dir, "w");
    assert_non_null(fp);
    fclose(fp);
    assert_int_equal(kvt_pool_put(pool, 2, b, 800), KVT_EIO);
    assert_non_null(strstr(kvt_errmsg(), dir));
    check_value(pool, 1, a, 800);
    check_value(pool, 2, b, 800);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.ram_bytes, 1600); /* over budget, nothing dropped */
    assert_int_equal(st.n_entries, 2);

    /* Once the directory is back, the next put spills and the budget holds again; no
    ** temporary file was left behind by the failed attempt. */
    assert_int_equal(unlink(dir), 0);
    assert_int_equal(mkdir(dir, 0700), 0);
    assert_int_equal(kvt_pool_put(pool, 3, a, 10), 0);
    stats(pool, &st);
    assert_true(st.ram_bytes <= 1000);
    assert_int_equal(count_entries(dir), (int)st.n_spilled);
    check_value(pool, 1, a, 800);
    check_value(pool, 2, b, 800);
    check_value(pool, 3, a, 10);
    free(a); free(b);
    kvt_pool_free(pool);
    assert_int_equal(count_entries(dir), 0);
}

/* Fault injection on the write itself: a file-size limit makes write(2) fail with EFBIG
** part-way through the spill file.  The put must report it, keep the data in RAM, and leave
** no temporary file behind. */
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
    assert_false(is_spilled(pool, 4));
    check_value(pool, 4, v, 5000);
    struct kvt_pool_stats st;
    stats(pool, &st);
    assert_int_equal(st.ram_bytes, 5000);
    assert_int_equal(st.n_spill_writes, 0);
    /* Without the limit, the next put spills it. */
    assert_int_equal(kvt_pool_put(pool, 5, v, 10), 0);
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

/* ---- threads: disjoint keys, every value checked ----------------------------------- */

struct worker {
    kvt_pool *pool;
    int id;
    int n_fail;
    char first_fail[256];
};

#define W_KEYS 40
#define W_ROUNDS 6

static void w_fail(struct worker *w, const char *what, uint64_t key, int rc) {
    if (w->n_fail++ == 0)
        snprintf(w->first_fail, sizeof w->first_fail, "thread %d: %s key %llu rc %d: %s", w->id,
                 what, (unsigned long long)key, rc, kvt_errmsg());
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    uint64_t s = 1000 + (uint64_t)w->id;
    uint8_t *vals[W_KEYS] = {0};
    size_t sizes[W_KEYS] = {0};
    for (int r = 0; r < W_ROUNDS; r++) {
        for (int i = 0; i < W_KEYS; i++) {
            uint64_t key = ((uint64_t)w->id << 32) | (uint64_t)i;
            if (vals[i] && rng_next(&s) % 4 == 0) {
                int rc = kvt_pool_del(w->pool, key);
                if (rc) w_fail(w, "del", key, rc);
                free(vals[i]);
                vals[i] = NULL;
                continue;
            }
            free(vals[i]);
            sizes[i] = 1 + (size_t)(rng_next(&s) % 2000);
            vals[i] = malloc(sizes[i]);
            for (size_t b = 0; b < sizes[i]; b++) vals[i][b] = (uint8_t)(rng_next(&s) >> 56);
            int rc = kvt_pool_put(w->pool, key, vals[i], sizes[i]);
            if (rc) w_fail(w, "put", key, rc);
        }
        for (int i = 0; i < W_KEYS; i++) {
            uint64_t key = ((uint64_t)w->id << 32) | (uint64_t)i;
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
    assert_true(st.ram_bytes <= (int64_t)budget);
    assert_int_equal(st.n_corrupt, 0);
    assert_int_equal(count_entries(f->dir), (int)st.n_spilled);
    kvt_pool_free(pool);
    assert_int_equal(count_entries(f->dir), 0);
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
        cmocka_unit_test_setup_teardown(test_threads, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
