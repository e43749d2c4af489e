/* pool_fixture.h — what the host pool's tests share (test_pool.c, test_pool_faults.c): a private
** scratch directory per test as $TMPDIR, reproducible payloads, value and spill checks. */
#ifndef KVT_TEST_POOL_FIXTURE_H
#define KVT_TEST_POOL_FIXTURE_H

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
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvtier.h"
#include "internal.h" /* kvt_pool_spill_path */
#include "fault.h"    /* internal failure injection (src/fault.h) */

#define HDR 64 /* spill file header bytes: magic, version, reserved, key, length, SHA-256 */


/* ---- fixtures and helpers ---------------------------------------------------------- */

struct fx {
    char dir[64];     /* per-test scratch directory under /tmp */
    char *old_tmpdir; /* $TMPDIR to restore */
};

static inline uint64_t rng_next(uint64_t *s) { /* xorshift64*: reproducible payloads */
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static inline uint8_t *rand_bytes(uint64_t *s, size_t n) {
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t) (rng_next(s) >> 56);
    return p;
}

static inline void rm_rf(const char *path) {
    struct stat sb;
    if (lstat(path, &sb)) return;
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            char sub[PATH_MAX];
            if ((size_t) snprintf(sub, sizeof sub, "%s/%s", path, de->d_name) >= sizeof sub) continue;
            rm_rf(sub);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static inline int count_entries(const char *dir) { /* files in dir, excluding . and .. */
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) n++;
    closedir(d);
    return n;
}

static inline bool exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

static inline int setup(void **state) {
    struct fx *f = calloc(1, sizeof *f);
    if (!f) return -1;
    strcpy(f->dir, "/tmp/kvt-test-pool-XXXXXX");
    if (!mkdtemp(f->dir)) {
        free(f);
        return -1;
    }
    const char *t = getenv("TMPDIR");
    f->old_tmpdir = t ? strdup(t) : NULL;
    *state = f;
    return 0;
}

static inline int teardown(void **state) {
    struct fx *f = *state;
    if (f->old_tmpdir) setenv("TMPDIR", f->old_tmpdir, 1);
    else unsetenv("TMPDIR");
    free(f->old_tmpdir);
    rm_rf(f->dir);
    free(f);
    return 0;
}

static inline kvt_pool *open_pool(size_t budget, const char *dir) {
    struct kvt_pool_params p = kvt_pool_default_params();
    p.budget_bytes = budget;
    p.spill_dir = dir;
    kvt_pool *pool = NULL;
    int rc = kvt_pool_open(&p, &pool);
    if (rc) fail_msg("kvt_pool_open: %s (%s)", kvt_strerror(rc), kvt_errmsg());
    return pool;
}

static inline void check_value(kvt_pool *pool, uint64_t key, const uint8_t *want, size_t n) {
    void *got = NULL;
    size_t got_n = 12345;
    int rc = kvt_pool_get(pool, key, &got, &got_n);
    if (rc) fail_msg("get key %llu: %s (%s)", (unsigned long long) key, kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(got_n, n);
    assert_non_null(got);
    if (n) assert_memory_equal(got, want, n);
    free(got);
}

static inline bool is_spilled(kvt_pool *pool, uint64_t key) {
    char path[PATH_MAX];
    assert_int_equal(kvt_pool_spill_path(pool, key, path, sizeof path), 0);
    return path[0] != '\0';
}

static inline void stats(kvt_pool *pool, struct kvt_pool_stats *st) { kvt_pool_get_stats(pool, st); }


#endif
