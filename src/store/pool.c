/* pool.c — the host pool: a byte-budgeted RAM tier that spills to checksummed files.
**
** Entries live in one array sorted by key (binary search; a few thousand entries at most).
** Each entry is either in RAM (data != NULL or n == 0) or spilled (its payload is only in
** its spill file).  LRU is a per-pool use counter stamped on every put/get; the victim is
** found by a linear scan, which is cheap next to the file write it precedes.
**
** One mutex guards the whole pool, including spill writes and reads: simple, and a pool is
** shared by a handful of threads at most.  Nothing is ever dropped: a spill that fails
** leaves its entry in RAM, over budget.
**
** Spill file (all integers little-endian):
**   "KVTSPILL" | u32 version = 1 | u32 reserved = 0 | u64 key | u64 payload bytes |
**   32-byte SHA-256 of the payload | payload
** written to "<dir>/.tmp-XXXXXX", fsync'd, closed and renamed to
** "<dir>/kvt-<pid>-<pool serial>-<key as 16 hex>.blk", so a crash never leaves a
** half-written file under a valid name.  The directory is not fsync'd: spill files do not
** outlive the pool, so the rename only has to be atomic, not durable.
*/
#include "internal.h"
#include "fault.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SPILL_MAGIC   "KVTSPILL"
#define SPILL_VERSION 1u
#define SPILL_HDR     64 /* 8 magic + 4 version + 4 reserved + 8 key + 8 length + 32 sha */

struct pool_entry {
    uint64_t key;
    uint8_t *data;     /* payload in RAM; NULL when spilled (or when n == 0) */
    size_t   n;        /* payload bytes */
    bool     spilled;  /* payload lives only in the spill file */
    uint64_t last_use; /* LRU stamp: larger = more recent */
};

struct kvt_pool {
    pthread_mutex_t mu;
    size_t   budget;
    char    *dir;       /* spill directory; NULL until the private one is made */
    bool     own_dir;   /* dir was made by us with mkdtemp: rmdir it in free */
    long     pid;       /* pid at open, part of spill file names */
    uint64_t serial;    /* process-unique pool number, part of spill file names */
    uint64_t clock;     /* LRU counter */
    struct pool_entry *e;
    size_t   n_e, cap_e;
    struct kvt_pool_stats st;
};

static atomic_uint_fast64_t pool_serial;

struct kvt_pool_params kvt_pool_default_params(void) {
    return (struct kvt_pool_params){ .budget_bytes = (size_t)256 << 20, .spill_dir = NULL };
}

/* ---- small helpers ---------------------------------------------------------------- */

static void put_le(uint8_t *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Binary search.  Returns true and *idx = position if key is present, else false and
** *idx = where it would be inserted. */
static bool find(const kvt_pool *pool, uint64_t key, size_t *idx) {
    size_t lo = 0, hi = pool->n_e;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (pool->e[mid].key == key) { *idx = mid; return true; }
        if (pool->e[mid].key < key) lo = mid + 1; else hi = mid;
    }
    *idx = lo;
    return false;
}

/* Final spill file name of key.  Needs pool->dir set.  Truncates silently if buf is small
** (callers pass PATH_MAX; open rejects directories too long for that). */
static void spill_name(const kvt_pool *pool, uint64_t key, char *buf, size_t size) {
    snprintf(buf, size, "%s/kvt-%ld-%llu-%016llx.blk", pool->dir, pool->pid,
             (unsigned long long)pool->serial, (unsigned long long)key);
}

/* 0 on success, -1 if libcrypto fails. */
static int sha256(const uint8_t *p, size_t n, uint8_t md[32]) {
    static const uint8_t empty = 0;
    unsigned int len = 0;
    return EVP_Digest(n ? p : &empty, n, md, &len, EVP_sha256(), NULL) == 1 && len == 32 ? 0 : -1;
}

/* write(2) all of buf, retrying short writes and EINTR.  -1 with errno set on failure. */
static int write_all(int fd, const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) { if (errno == EINTR) continue; return -1; }
        p += w; n -= (size_t)w;
    }
    return 0;
}

/* read(2) exactly n bytes.  -1 with errno set on error; errno = 0 on early end of file. */
static int read_all(int fd, uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r < 0) { if (errno == EINTR) continue; return -1; }
        if (r == 0) { errno = 0; return -1; }
        p += r; n -= (size_t)r;
    }
    return 0;
}

/* ---- spill write / read ----------------------------------------------------------- */

/* Make the private spill directory on first use.  On error pool->dir stays NULL. */
static int ensure_dir(kvt_pool *pool) {
    if (pool->dir) return 0;
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp) tmp = "/tmp";
    char tmpl[PATH_MAX];
    if (snprintf(tmpl, sizeof tmpl, "%s/kvtier-spill-XXXXXX", tmp) >= (int)sizeof tmpl)
        return kvt__fail(KVT_EIO, "TMPDIR \"%s\" is too long for a spill directory", tmp);
    if (!mkdtemp(tmpl))
        return kvt__fail(KVT_EIO, "cannot create spill directory %s: %s", tmpl, strerror(errno));
    if (!(pool->dir = strdup(tmpl))) {
        rmdir(tmpl);
        return kvt__fail(KVT_ENOMEM, "out of memory for spill directory name %s", tmpl);
    }
    pool->own_dir = true;
    return 0;
}

/* Write entry e (in RAM, n > 0) to its spill file and release its RAM copy.
** On error the temporary file is unlinked, the entry is still in RAM, and the pool is
** unchanged apart from a private spill directory that may now exist. */
static int spill(kvt_pool *pool, struct pool_entry *e) {
    int rc = ensure_dir(pool);
    if (rc) return rc;
    uint8_t hdr[SPILL_HDR] = {0};
    memcpy(hdr, SPILL_MAGIC, 8);
    put_le(hdr + 8, SPILL_VERSION, 4);
    put_le(hdr + 16, e->key, 8);
    put_le(hdr + 24, e->n, 8);
    if (sha256(e->data, e->n, hdr + 32))
        return kvt__fail(KVT_EIO, "SHA-256 of key %016llx (%zu bytes) failed",
                         (unsigned long long)e->key, e->n);

    char tmp[PATH_MAX], path[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s/.tmp-XXXXXX", pool->dir);
    spill_name(pool, e->key, path, sizeof path);
    int fd = mkstemp(tmp);
    if (fd < 0)
        return kvt__fail(KVT_EIO, "cannot create spill file %s: %s", tmp, strerror(errno));
    const char *what = "write";
    if (kvt__fault_check(KVT__FAULT_SPILL_WRITE)) { errno = ENOSPC; goto fail; }
    if (write_all(fd, hdr, sizeof hdr) || write_all(fd, e->data, e->n)) goto fail;
    what = "fsync";
    if (fsync(fd)) goto fail;
    what = "close";
    int c = close(fd);
    fd = -1;
    if (c) goto fail;
    what = "rename";
    if (rename(tmp, path)) goto fail;

    free(e->data);
    e->data = NULL;
    e->spilled = true;
    pool->st.n_spilled++;
    pool->st.ram_bytes -= (int64_t)e->n;
    pool->st.spill_bytes += (int64_t)e->n;
    pool->st.n_spill_writes++;
    return 0;
fail:;
    int err = errno;
    if (fd >= 0) close(fd);
    unlink(tmp);
    return kvt__fail(KVT_EIO, "spill of key %016llx: %s %s%s%s failed: %s",
                     (unsigned long long)e->key, what, tmp, strcmp(what, "rename") ? "" : " to ",
                     strcmp(what, "rename") ? "" : path, strerror(err));
}

/* Read and verify e's spill file.  OUT *out (malloc'd, n bytes; at least 1 byte allocated).
** Errors: KVT_EIO (open/read failed), KVT_ECORRUPT (size, header or SHA-256 mismatch;
** counted in n_corrupt), KVT_ENOMEM.  On error nothing is returned and the entry is kept. */
static int unspill(kvt_pool *pool, const struct pool_entry *e, uint8_t **out) {
    char path[PATH_MAX];
    spill_name(pool, e->key, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvt__fail(KVT_EIO, "cannot open spill file %s: %s", path, strerror(errno));

    uint8_t hdr[SPILL_HDR], md[32];
    uint8_t *buf = NULL;
    struct stat sb;
    int rc;
    if (fstat(fd, &sb)) {
        rc = kvt__fail(KVT_EIO, "cannot stat spill file %s: %s", path, strerror(errno));
        goto out;
    }
    if ((uint64_t)sb.st_size != SPILL_HDR + (uint64_t)e->n) {
        rc = kvt__fail(KVT_ECORRUPT, "spill file %s has %lld bytes, expected %llu", path,
                       (long long)sb.st_size, (unsigned long long)(SPILL_HDR + (uint64_t)e->n));
        goto corrupt;
    }
    if (!(buf = malloc(e->n ? e->n : 1))) {
        rc = kvt__fail(KVT_ENOMEM, "out of memory reading %zu bytes from %s", e->n, path);
        goto out;
    }
    if (read_all(fd, hdr, sizeof hdr) || read_all(fd, buf, e->n)) {
        if (errno == 0) { /* shrank between fstat and read */
            rc = kvt__fail(KVT_ECORRUPT, "spill file %s is truncated", path);
            goto corrupt;
        }
        rc = kvt__fail(KVT_EIO, "cannot read spill file %s: %s", path, strerror(errno));
        goto out;
    }
    if (memcmp(hdr, SPILL_MAGIC, 8) || get_le(hdr + 8, 4) != SPILL_VERSION ||
        get_le(hdr + 16, 8) != e->key || get_le(hdr + 24, 8) != e->n) {
        rc = kvt__fail(KVT_ECORRUPT, "spill file %s: bad header (expected key %016llx, %zu "
                       "bytes, version %u)", path, (unsigned long long)e->key, e->n, SPILL_VERSION);
        goto corrupt;
    }
    if (sha256(buf, e->n, md)) {
        rc = kvt__fail(KVT_EIO, "SHA-256 of spill file %s failed", path);
        goto out;
    }
    if (memcmp(md, hdr + 32, 32)) {
        rc = kvt__fail(KVT_ECORRUPT, "spill file %s failed its SHA-256 check", path);
        goto corrupt;
    }
    close(fd);
    pool->st.n_spill_reads++;
    *out = buf;
    return 0;
corrupt:
    pool->st.n_corrupt++;
out:
    close(fd);
    free(buf);
    return rc;
}

/* Release e's value (RAM copy or spill file) and its share of the counters; the slot itself
** stays.  An unlink failure is ignored: the value is gone from the pool either way. */
static void drop_value(kvt_pool *pool, struct pool_entry *e) {
    if (e->spilled) {
        char path[PATH_MAX];
        spill_name(pool, e->key, path, sizeof path);
        unlink(path);
        pool->st.n_spilled--;
        pool->st.spill_bytes -= (int64_t)e->n;
    } else {
        pool->st.ram_bytes -= (int64_t)e->n;
    }
    free(e->data);
    e->data = NULL;
    e->spilled = false;
}

/* ---- public API ------------------------------------------------------------------- */

/* NULL p means kvt_pool_default_params().  A given spill_dir is created (mode 0700) if
** missing.  On error *out is NULL and nothing is leaked (a spill_dir made here stays). */
int kvt_pool_open(const struct kvt_pool_params *p, kvt_pool **out) {
    if (!out) return kvt__fail(KVT_EINVAL, "kvt_pool_open: out is NULL");
    *out = NULL;
    struct kvt_pool_params d = p ? *p : kvt_pool_default_params();
    if (d.budget_bytes == 0)
        return kvt__fail(KVT_EINVAL, "pool budget_bytes is 0; it must be at least 1 byte");
    if (d.spill_dir) {
        struct stat sb;
        if (!*d.spill_dir) return kvt__fail(KVT_EINVAL, "pool spill_dir is \"\"");
        if (strlen(d.spill_dir) > PATH_MAX - 64)
            return kvt__fail(KVT_EINVAL, "pool spill_dir is %zu bytes long, the limit is %d",
                             strlen(d.spill_dir), PATH_MAX - 64);
        if (stat(d.spill_dir, &sb) && (errno != ENOENT || mkdir(d.spill_dir, 0700)))
            return kvt__fail(KVT_EIO, "spill_dir %s cannot be created: %s", d.spill_dir,
                             strerror(errno));
        if (stat(d.spill_dir, &sb) || !S_ISDIR(sb.st_mode))
            return kvt__fail(KVT_EIO, "spill_dir %s is not a directory", d.spill_dir);
        if (access(d.spill_dir, W_OK | X_OK))
            return kvt__fail(KVT_EIO, "spill_dir %s is not writable: %s", d.spill_dir,
                             strerror(errno));
    }
    kvt_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return kvt__fail(KVT_ENOMEM, "out of memory for a pool");
    if (d.spill_dir && !(pool->dir = strdup(d.spill_dir))) {
        free(pool);
        return kvt__fail(KVT_ENOMEM, "out of memory for spill_dir %s", d.spill_dir);
    }
    if (pthread_mutex_init(&pool->mu, NULL)) {
        free(pool->dir);
        free(pool);
        return kvt__fail(KVT_ENOMEM, "pthread_mutex_init failed for a pool");
    }
    pool->budget = d.budget_bytes;
    pool->pid = (long)getpid();
    pool->serial = atomic_fetch_add(&pool_serial, 1);
    *out = pool;
    return 0;
}

/* Unlinks every spill file, then the private directory if we made it.  Must not race
** with other calls on the same pool. */
void kvt_pool_free(kvt_pool *pool) {
    if (!pool) return;
    for (size_t i = 0; i < pool->n_e; i++) drop_value(pool, &pool->e[i]);
    if (pool->own_dir) rmdir(pool->dir);
    free(pool->dir);
    free(pool->e);
    pthread_mutex_destroy(&pool->mu);
    free(pool);
}

/* Failure behaviour: KVT_EINVAL/KVT_ENOMEM leave the pool unchanged (an old value under key
** stays).  KVT_EIO means the new value IS stored (in RAM) and the old one is gone, but a
** spill failed, so the pool is over budget; the next put retries the spill. */
int kvt_pool_put(kvt_pool *pool, uint64_t key, const void *data, size_t n) {
    if (!pool) return kvt__fail(KVT_EINVAL, "kvt_pool_put: pool is NULL");
    if (!data && n > 0)
        return kvt__fail(KVT_EINVAL, "kvt_pool_put: data is NULL with n = %zu", n);
    if (kvt__fault_check(KVT__FAULT_POOL_PUT))
        return kvt__fail(KVT_ENOMEM, "out of memory copying %zu bytes for key %016llx (injected)", n,
                         (unsigned long long)key);
    uint8_t *copy = NULL;
    if (n > 0) {
        if (!(copy = malloc(n)))
            return kvt__fail(KVT_ENOMEM, "out of memory copying %zu bytes for key %016llx",
                             n, (unsigned long long)key);
        memcpy(copy, data, n);
    }
    pthread_mutex_lock(&pool->mu);
    size_t i;
    if (find(pool, key, &i)) { /* replace: drop the old value */
        drop_value(pool, &pool->e[i]);
    } else {
        if (pool->n_e == pool->cap_e) {
            size_t cap = pool->cap_e ? 2 * pool->cap_e : 64;
            struct pool_entry *ne = realloc(pool->e, cap * sizeof *ne);
            if (!ne) {
                pthread_mutex_unlock(&pool->mu);
                free(copy);
                return kvt__fail(KVT_ENOMEM, "out of memory growing the pool to %zu entries", cap);
            }
            pool->e = ne;
            pool->cap_e = cap;
        }
        memmove(&pool->e[i + 1], &pool->e[i], (pool->n_e - i) * sizeof *pool->e);
        pool->n_e++;
        pool->st.n_entries++;
    }
    struct pool_entry *e = &pool->e[i];
    *e = (struct pool_entry){ .key = key, .data = copy, .n = n, .last_use = ++pool->clock };
    pool->st.ram_bytes += (int64_t)n;

    /* Enforce the budget.  An entry larger than the whole budget can never fit, so it is
    ** spilled first rather than pushing every other entry out ahead of it. */
    int rc = 0;
    if (n > pool->budget) rc = spill(pool, e);
    while (rc == 0 && (size_t)pool->st.ram_bytes > pool->budget) {
        struct pool_entry *victim = NULL;
        for (size_t j = 0; j < pool->n_e; j++) {
            struct pool_entry *c = &pool->e[j];
            if (!c->spilled && c->n > 0 && (!victim || c->last_use < victim->last_use))
                victim = c;
        }
        rc = spill(pool, victim); /* ram_bytes > budget >= 1, so a victim exists */
    }
    if (rc) {
        char why[900];
        snprintf(why, sizeof why, "%s", kvt_errmsg());
        rc = kvt__fail(rc, "key %016llx stored, but the pool is over budget (%lld > %zu "
                       "bytes in RAM): %s", (unsigned long long)key,
                       (long long)pool->st.ram_bytes, pool->budget, why);
    }
    pthread_mutex_unlock(&pool->mu);
    return rc;
}

/* On any error *data = NULL and *n = 0 (when those pointers are valid) and the entry, if
** any, is unchanged: a corrupt spill file is reported again by the next get. */
int kvt_pool_get(kvt_pool *pool, uint64_t key, void **data, size_t *n) {
    if (!pool || !data || !n)
        return kvt__fail(KVT_EINVAL, "kvt_pool_get: %s is NULL",
                         !pool ? "pool" : !data ? "data" : "n");
    *data = NULL;
    *n = 0;
    pthread_mutex_lock(&pool->mu);
    size_t i;
    int rc = 0;
    uint8_t *buf = NULL;
    if (!find(pool, key, &i)) {
        rc = kvt__fail(KVT_ENOENT, "key %016llx is not in the pool", (unsigned long long)key);
        goto out;
    }
    struct pool_entry *e = &pool->e[i];
    if (e->spilled) {
        rc = unspill(pool, e, &buf);
    } else if (!(buf = malloc(e->n ? e->n : 1))) {
        rc = kvt__fail(KVT_ENOMEM, "out of memory copying %zu bytes of key %016llx", e->n,
                       (unsigned long long)key);
    } else if (e->n > 0) {
        memcpy(buf, e->data, e->n);
    }
    if (rc == 0) {
        e->last_use = ++pool->clock;
        *data = buf;
        *n = e->n;
    }
out:
    pthread_mutex_unlock(&pool->mu);
    return rc;
}

int kvt_pool_del(kvt_pool *pool, uint64_t key) {
    if (!pool) return kvt__fail(KVT_EINVAL, "kvt_pool_del: pool is NULL");
    pthread_mutex_lock(&pool->mu);
    size_t i;
    int rc = 0;
    if (!find(pool, key, &i)) {
        rc = kvt__fail(KVT_ENOENT, "key %016llx is not in the pool", (unsigned long long)key);
    } else {
        drop_value(pool, &pool->e[i]);
        memmove(&pool->e[i], &pool->e[i + 1], (pool->n_e - i - 1) * sizeof *pool->e);
        pool->n_e--;
        pool->st.n_entries--;
    }
    pthread_mutex_unlock(&pool->mu);
    return rc;
}

/* Errors: KVT_ENOENT; KVT_EINVAL if buf is NULL or too small for the path (buf then holds
** ""). */
int kvt_pool_spill_path(kvt_pool *pool, uint64_t key, char *buf, size_t buf_size) {
    if (!pool || !buf || buf_size == 0)
        return kvt__fail(KVT_EINVAL, "kvt_pool_spill_path: %s", !pool ? "pool is NULL"
                         : !buf ? "buf is NULL" : "buf_size is 0");
    buf[0] = '\0';
    pthread_mutex_lock(&pool->mu);
    size_t i;
    int rc = 0;
    if (!find(pool, key, &i)) {
        rc = kvt__fail(KVT_ENOENT, "key %016llx is not in the pool", (unsigned long long)key);
    } else if (pool->e[i].spilled) {
        char path[PATH_MAX];
        spill_name(pool, key, path, sizeof path);
        if (strlen(path) >= buf_size)
            rc = kvt__fail(KVT_EINVAL, "buffer of %zu bytes is too small for spill path %s",
                           buf_size, path);
        else
            memcpy(buf, path, strlen(path) + 1);
    }
    pthread_mutex_unlock(&pool->mu);
    return rc;
}

/* Cannot fail; a NULL pool gives all-zero stats. */
void kvt_pool_get_stats(kvt_pool *pool, struct kvt_pool_stats *st) {
    if (!st) return;
    memset(st, 0, sizeof *st);
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    *st = pool->st;
    pthread_mutex_unlock(&pool->mu);
}
