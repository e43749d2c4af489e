/* pool.c — the host pool: a byte-budgeted RAM tier that spills to checksummed files.
**
** Entries live in one array sorted by key (binary search; a few thousand entries at most).
** Each entry is in RAM, being spilled (still in RAM, a put is writing its file), or on disk
** (its payload only in its spill file).  LRU is a per-pool use counter stamped on every
** put/get; the victim is found by a linear scan, which is cheap next to the file write it
** precedes.
**
** The RAM budget is a ceiling: a put spills least recently used values until RAM is within it
** again, and a value whose spill write fails (a full disk) is dropped, not kept over budget;
** so is a value the spill quota (spill_bytes_max) has no room for, after the least recently
** used values on disk.  Dropped values are counted (n_dropped): the pool is a cache, and its
** user (a session) recomputes what a dropped value held.
**
** One mutex guards the entries and counters; spill file writes, reads and unlinks run outside
** it, so a thread reading a value in RAM never waits for a disk.  A value being written stays
** readable from RAM; deleted or replaced meanwhile, its buffer is left to the writer, which
** frees it (and the file it wrote) when it relocks and finds the value gone.  Each value has
** its own file name (a per-pool generation number), so a late writer or unlink can never touch
** the file of a newer value under the same key.
**
** The spill files themselves (format, names, the private directory, stale directories of dead
** processes) are store/spill.c's.
*/
#include "internal.h"
#include "fault.h"
#include "store/spill.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define JOBS_MAX 16 /* spill writes one put starts per round (then it relocks and looks again) */

enum { E_RAM, E_SPILLING, E_DISK };

struct pool_entry {
    uint64_t key;
    uint64_t gen;      /* pool-unique number of this value: names its spill file, tells a spill
                       ** writer whether the value it wrote is still the entry's */
    uint8_t *data;     /* payload in RAM (E_RAM, E_SPILLING); NULL on disk or when n == 0 */
    size_t n;          /* payload bytes */
    uint8_t state;     /* E_RAM; E_SPILLING: in RAM, a put is writing it outside the lock;
                       ** E_DISK: only in its spill file */
    uint64_t last_use; /* LRU stamp: larger = more recent */
};

/* A spill write taken out of the lock: the writer owns nothing but reads `data`, which stays
** valid until the writer relocks (a del or replace of an E_SPILLING entry leaves the buffer to
** the writer, which frees it when it finds its value gone). */
struct spill_job {
    uint64_t key, gen;
    const uint8_t *data;
    size_t n;
    int err;          /* errno of the failed step, 0 = written */
    const char *what; /* the failed step (NULL: the directory could not be made) */
};

/* Spill files to unlink once the lock is released. */
struct trash {
    uint64_t (*kg)[2]; /* key, gen */
    size_t n, cap;
};

struct kvt_pool {
    pthread_mutex_t mu;
    size_t budget;
    size_t spill_max;     /* spill quota in payload bytes, 0 = none */
    struct kvt__spill sp; /* the spill directory (sp.dir set once, under the lock) */
    uint64_t clock;       /* LRU counter */
    uint64_t gen;         /* value counter */
    struct pool_entry *e;
    size_t n_e, cap_e;
    int64_t in_flight;     /* RAM bytes of E_SPILLING values (and of orphaned ones being written) */
    int64_t disk_reserved; /* spill bytes reserved by writes in flight (the quota counts them) */
    struct kvt_pool_stats st;
};

static atomic_uint_fast64_t pool_serial;

struct kvt_pool_params kvt_pool_default_params(void) {
    return (struct kvt_pool_params){ .budget_bytes = (size_t) 256 << 20, .spill_dir = NULL, .spill_bytes_max = 0 };
}

/* Binary search.  Returns true and *idx = position if key is present, else false and
** *idx = where it would be inserted. */
static bool find(const kvt_pool *pool, uint64_t key, size_t *idx) {
    size_t lo = 0, hi = pool->n_e;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (pool->e[mid].key == key) {
            *idx = mid;
            return true;
        }
        if (pool->e[mid].key < key) lo = mid + 1;
        else hi = mid;
    }
    *idx = lo;
    return false;
}

/* ---- entries (pool lock held) ------------------------------------------------------ */

/* Queue the spill file of (key, gen) for unlinking after the lock is released; if the queue
** cannot grow, unlink it now. */
static void trash_add(kvt_pool *pool, struct trash *t, uint64_t key, uint64_t gen) {
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 8;
        uint64_t(*kg)[2] = realloc(t->kg, cap * sizeof *kg);
        if (!kg) {
            kvt__spill_unlink(&pool->sp, key, gen);
            return;
        }
        t->kg = kg;
        t->cap = cap;
    }
    t->kg[t->n][0] = key;
    t->kg[t->n][1] = gen;
    t->n++;
}

/* Unlink the queued files (lock released; the names are never reused) and free the queue. */
static void trash_empty(const kvt_pool *pool, struct trash *t) {
    for (size_t i = 0; i < t->n; i++) kvt__spill_unlink(&pool->sp, t->kg[i][0], t->kg[i][1]);
    free(t->kg);
}

/* Release e's value and its share of the counters; the slot itself stays.  A value being spilled
** keeps its buffer and its RAM bytes: the writer frees them when it finds the value gone. */
static void release_value(kvt_pool *pool, struct pool_entry *e, struct trash *t) {
    if (e->state == E_DISK) {
        trash_add(pool, t, e->key, e->gen);
        pool->st.n_spilled--;
        pool->st.spill_bytes -= (int64_t) e->n;
    } else if (e->state == E_RAM) {
        pool->st.ram_bytes -= (int64_t) e->n;
        free(e->data);
    }
    e->data = NULL;
    e->state = E_RAM;
}

/* Remove slot i (its value already released). */
static void remove_at(kvt_pool *pool, size_t i) {
    memmove(&pool->e[i], &pool->e[i + 1], (pool->n_e - i - 1) * sizeof *pool->e);
    pool->n_e--;
    pool->st.n_entries--;
}

/* The entry holding value (key, gen), or NULL. */
static struct pool_entry *find_value(kvt_pool *pool, uint64_t key, uint64_t gen, size_t *idx) {
    size_t i;
    if (!find(pool, key, &i) || pool->e[i].gen != gen) return NULL;
    if (idx) *idx = i;
    return &pool->e[i];
}

/* Least recently used entry in `state` with a payload, or NULL. */
static struct pool_entry *lru(kvt_pool *pool, int state) {
    struct pool_entry *v = NULL;
    for (size_t j = 0; j < pool->n_e; j++) {
        struct pool_entry *c = &pool->e[j];
        if (c->state == state && c->n > 0 && (!v || c->last_use < v->last_use)) v = c;
    }
    return v;
}

/* The spill quota: reserve room on disk for value (key, gen).  While it does not fit next to
** what is spilled and reserved, the least recently used entry on disk is dropped (n_dropped),
** unless that one is more recent than the value itself, or the value alone exceeds the quota:
** then the value is the one to go (RESERVE_DROP).  RESERVE_WAIT: only writes in flight stand
** in the way (their files may be dropped once written). */
enum { RESERVE_OK, RESERVE_DROP, RESERVE_WAIT };
static int reserve_disk(kvt_pool *pool, uint64_t key, uint64_t gen, struct trash *t) {
    struct pool_entry *v = find_value(pool, key, gen, NULL);
    const int64_t n = (int64_t) v->n, max = (int64_t) pool->spill_max;
    if (max && n > max) return RESERVE_DROP;
    while (max && pool->st.spill_bytes + pool->disk_reserved + n > max) {
        struct pool_entry *d = lru(pool, E_DISK);
        if (!d) return RESERVE_WAIT;
        if (d->last_use > v->last_use) return RESERVE_DROP;
        release_value(pool, d, t);
        remove_at(pool, (size_t) (d - pool->e));
        pool->st.n_dropped++;
        v = find_value(pool, key, gen, NULL); /* the array moved */
    }
    pool->disk_reserved += n;
    return RESERVE_OK;
}

/* ---- keeping the budget ----------------------------------------------------------- */

/* Fold job j's outcome into the pool (lock held).  Its value was written: it is on disk now, its
** RAM freed.  The write failed: the entry is dropped (the RAM budget is a ceiling, and a caller
** of get then recomputes what it held), counted in n_dropped.  The value was deleted or replaced
** while being written: its buffer, and a file written for it, go.  Returns true if j's value was
** dropped because its write failed. */
static bool commit_job(kvt_pool *pool, const struct spill_job *j, struct trash *t) {
    size_t i = 0;
    struct pool_entry *e = find_value(pool, j->key, j->gen, &i);
    pool->in_flight -= (int64_t) j->n;
    pool->disk_reserved -= (int64_t) j->n;
    pool->st.ram_bytes -= (int64_t) j->n;
    free((void *) j->data);
    if (!e || e->state != E_SPILLING) { /* orphaned */
        if (j->err == 0) trash_add(pool, t, j->key, j->gen);
        return false;
    }
    e->data = NULL;
    if (j->err == 0) {
        e->state = E_DISK;
        pool->st.n_spilled++;
        pool->st.spill_bytes += (int64_t) j->n;
        pool->st.n_spill_writes++;
        return false;
    }
    e->state = E_RAM; /* released above; the slot goes */
    remove_at(pool, i);
    pool->st.n_dropped++;
    return true;
}

/* Bring RAM back within the budget after value (key, gen) was stored (lock held; released
** around the spill writes, which run JOBS_MAX at a time).  Victims: that value first if it alone
** exceeds the budget, then the least recently used values in RAM.  A value the spill quota
** refuses, or whose write fails, is dropped.  Values other threads are writing count as leaving
** RAM already, so two puts never spill for the same excess.  OUT *self_dropped: (key, gen) is
** no longer stored.  Returns KVT_EIO when a write failed (message: the first failure, how many
** entries were dropped for it), else 0. */
static int make_room(kvt_pool *pool, uint64_t key, uint64_t gen, struct trash *t, bool *self_dropped) {
    char first[PATH_MAX + 160] = "";
    int n_failed = 0;
    *self_dropped = false;
    for (;;) {
        struct spill_job jobs[JOBS_MAX];
        int nj = 0;
        while (nj < JOBS_MAX && pool->st.ram_bytes - pool->in_flight > (int64_t) pool->budget) {
            struct pool_entry *v = find_value(pool, key, gen, NULL);
            if (!v || v->state != E_RAM || v->n <= pool->budget) v = lru(pool, E_RAM);
            if (!v) break; /* everything left is being written by other puts */
            const uint64_t vk = v->key, vg = v->gen;
            const int res = reserve_disk(pool, vk, vg, t);
            if (res == RESERVE_WAIT && nj > 0) break; /* write these first, then look again */
            if (res != RESERVE_OK) {                  /* the quota says this one goes (or other threads hold it all) */
                size_t i = 0;
                v = find_value(pool, vk, vg, &i); /* still there: only entries on disk were dropped */
                release_value(pool, v, t);
                remove_at(pool, i);
                pool->st.n_dropped++;
                if (vk == key && vg == gen) *self_dropped = true;
                continue;
            }
            v = find_value(pool, vk, vg, NULL);
            v->state = E_SPILLING;
            pool->in_flight += (int64_t) v->n;
            jobs[nj++] = (struct spill_job){ .key = vk, .gen = vg, .data = v->data, .n = v->n };
        }
        if (nj == 0) break;
        int rc_dir = kvt__spill_ensure_dir(&pool->sp);
        char dir_err[512] = "";
        if (rc_dir) snprintf(dir_err, sizeof dir_err, "%s", kvt_errmsg());
        pthread_mutex_unlock(&pool->mu);
        for (int k = 0; k < nj; k++) {
            struct spill_job *j = &jobs[k];
            j->what = NULL;
            j->err = rc_dir ? EIO : kvt__spill_write(&pool->sp, j->key, j->gen, j->data, j->n, &j->what);
        }
        pthread_mutex_lock(&pool->mu);
        for (int k = 0; k < nj; k++) {
            const struct spill_job *j = &jobs[k];
            bool dropped = commit_job(pool, j, t);
            if (dropped && j->key == key && j->gen == gen) *self_dropped = true;
            if (!dropped) continue;
            if (n_failed++ == 0 && !j->what)
                snprintf(first, sizeof first, "key %016llx (%zu bytes): %s", (unsigned long long) j->key, j->n, dir_err);
            else if (n_failed == 1)
                snprintf(first, sizeof first, "key %016llx (%zu bytes): %s spill file in %s failed: %s",
                         (unsigned long long) j->key, j->n, j->what, pool->sp.dir, strerror(j->err));
        }
    }
    if (n_failed == 0) return 0;
    return kvt__fail(KVT_EIO,
                     "spill write failed, %d entr%s dropped to keep the pool's RAM within %zu bytes; "
                     "first: %s",
                     n_failed, n_failed == 1 ? "y" : "ies", pool->budget, first);
}

/* ---- public API ------------------------------------------------------------------- */

/* NULL p means kvt_pool_default_params().  A given spill_dir is created (mode 0700) if
** missing.  Without one, stale private directories of dead processes are removed from $TMPDIR
** (clean_stale_dirs).  On error *out is NULL and nothing is leaked (a spill_dir made here
** stays). */
int kvt_pool_open(const struct kvt_pool_params *p, kvt_pool **out) {
    if (!out) return kvt__fail(KVT_EINVAL, "kvt_pool_open: out is NULL");
    *out = NULL;
    struct kvt_pool_params d = p ? *p : kvt_pool_default_params();
    if (d.budget_bytes == 0) return kvt__fail(KVT_EINVAL, "pool budget_bytes is 0; it must be at least 1 byte");
    if (d.spill_dir) {
        struct stat sb;
        if (!*d.spill_dir) return kvt__fail(KVT_EINVAL, "pool spill_dir is \"\"");
        if (strlen(d.spill_dir) > PATH_MAX - 64)
            return kvt__fail(KVT_EINVAL, "pool spill_dir is %zu bytes long, the limit is %d", strlen(d.spill_dir), PATH_MAX - 64);
        if (stat(d.spill_dir, &sb) && (errno != ENOENT || mkdir(d.spill_dir, 0700)))
            return kvt__fail(KVT_EIO, "spill_dir %s cannot be created: %s", d.spill_dir, strerror(errno));
        if (stat(d.spill_dir, &sb) || !S_ISDIR(sb.st_mode))
            return kvt__fail(KVT_EIO, "spill_dir %s is not a directory", d.spill_dir);
        if (access(d.spill_dir, W_OK | X_OK))
            return kvt__fail(KVT_EIO, "spill_dir %s is not writable: %s", d.spill_dir, strerror(errno));
    } else {
        kvt__spill_clean_stale_dirs(kvt__spill_tmp_dir());
    }
    kvt_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return kvt__fail(KVT_ENOMEM, "out of memory for a pool");
    if (d.spill_dir && !(pool->sp.dir = strdup(d.spill_dir))) {
        free(pool);
        return kvt__fail(KVT_ENOMEM, "out of memory for spill_dir %s", d.spill_dir);
    }
    if (pthread_mutex_init(&pool->mu, NULL)) {
        free(pool->sp.dir);
        free(pool);
        return kvt__fail(KVT_ENOMEM, "pthread_mutex_init failed for a pool");
    }
    pool->budget = d.budget_bytes;
    pool->spill_max = d.spill_bytes_max;
    pool->sp.dir_fd = -1;
    pool->sp.pid = (long) getpid();
    pool->sp.serial = atomic_fetch_add(&pool_serial, 1);
    *out = pool;
    return 0;
}

/* Unlinks every spill file, then the private directory if we made it.  Must not race
** with other calls on the same pool (so no value is being spilled). */
void kvt_pool_free(kvt_pool *pool) {
    if (!pool) return;
    for (size_t i = 0; i < pool->n_e; i++) {
        struct pool_entry *e = &pool->e[i];
        if (e->state == E_DISK) kvt__spill_unlink(&pool->sp, e->key, e->gen);
        free(e->data);
    }
    kvt__spill_close(&pool->sp);
    free(pool->e);
    pthread_mutex_destroy(&pool->mu);
    free(pool);
}

/* Failure behaviour: KVT_EINVAL/KVT_ENOMEM leave the pool unchanged (an old value under key
** stays).  KVT_EIO: the old value is gone and a spill write failed; the entries it was for are
** dropped (possibly the new value), and RAM is within the budget. */
int kvt_pool_put(kvt_pool *pool, uint64_t key, const void *data, size_t n) {
    if (!pool) return kvt__fail(KVT_EINVAL, "kvt_pool_put: pool is NULL");
    if (!data && n > 0) return kvt__fail(KVT_EINVAL, "kvt_pool_put: data is NULL with n = %zu", n);
    if (n > pool->budget && pool->spill_max && n > pool->spill_max)
        return kvt__fail(KVT_EINVAL,
                         "kvt_pool_put: key %016llx of %zu bytes fits neither the RAM budget of %zu "
                         "bytes nor the spill quota of %zu bytes",
                         (unsigned long long) key, n, pool->budget, pool->spill_max);
    if (kvt__fault_check(KVT__FAULT_POOL_PUT))
        return kvt__fail(KVT_ENOMEM, "out of memory copying %zu bytes for key %016llx (injected)", n, (unsigned long long) key);
    uint8_t *copy = NULL;
    if (n > 0) {
        if (!(copy = malloc(n)))
            return kvt__fail(KVT_ENOMEM, "out of memory copying %zu bytes for key %016llx", n, (unsigned long long) key);
        memcpy(copy, data, n);
    }
    struct trash t = { 0 };
    pthread_mutex_lock(&pool->mu);
    size_t i;
    if (find(pool, key, &i)) { /* replace: drop the old value */
        release_value(pool, &pool->e[i], &t);
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
    const uint64_t gen = ++pool->gen;
    pool->e[i] = (struct pool_entry){ .key = key, .gen = gen, .data = copy, .n = n, .state = E_RAM, .last_use = ++pool->clock };
    pool->st.ram_bytes += (int64_t) n;
    bool self_dropped = false;
    int rc = make_room(pool, key, gen, &t, &self_dropped);
    if (rc) {
        char why[900];
        snprintf(why, sizeof why, "%s", kvt_errmsg());
        rc = kvt__fail(rc, "key %016llx %s: %s", (unsigned long long) key, self_dropped ? "NOT stored (dropped)" : "stored", why);
    } else if (self_dropped) {
        rc = kvt__fail(KVT_EIO,
                       "key %016llx of %zu bytes NOT stored: the spill quota of %zu bytes is taken by "
                       "writes in flight",
                       (unsigned long long) key, n, pool->spill_max);
    }
    pthread_mutex_unlock(&pool->mu);
    trash_empty(pool, &t);
    return rc;
}

/* A spilled value is read outside the lock.  If it is deleted or replaced meanwhile, the read
** either still finds the file (the value as it was when get began) or reports KVT_ENOENT.  On
** any error *data = NULL and *n = 0 (when those pointers are valid) and the entry, if any, is
** unchanged: a corrupt spill file is reported again by the next get. */
int kvt_pool_get(kvt_pool *pool, uint64_t key, void **data, size_t *n) {
    if (!pool || !data || !n) return kvt__fail(KVT_EINVAL, "kvt_pool_get: %s is NULL", !pool ? "pool" : !data ? "data" : "n");
    *data = NULL;
    *n = 0;
    pthread_mutex_lock(&pool->mu);
    size_t i;
    if (!find(pool, key, &i)) {
        pthread_mutex_unlock(&pool->mu);
        return kvt__fail(KVT_ENOENT, "key %016llx is not in the pool", (unsigned long long) key);
    }
    struct pool_entry *e = &pool->e[i];
    const uint64_t gen = e->gen;
    const size_t len = e->n;
    uint8_t *buf = NULL;
    int rc = 0;
    if (e->state != E_DISK) { /* in RAM (also while a put is writing it out) */
        if (!(buf = malloc(len ? len : 1)))
            rc = kvt__fail(KVT_ENOMEM, "out of memory copying %zu bytes of key %016llx", len, (unsigned long long) key);
        else if (len > 0) memcpy(buf, e->data, len);
    } else {
        pthread_mutex_unlock(&pool->mu);
        bool missing = false;
        rc = kvt__spill_read(&pool->sp, key, gen, len, &buf, &missing);
        pthread_mutex_lock(&pool->mu);
        e = find_value(pool, key, gen, NULL);
        if (rc == 0) pool->st.n_spill_reads++;
        if (rc == KVT_ECORRUPT) pool->st.n_corrupt++;
        if (rc == KVT_EIO && missing && !e)
            rc = kvt__fail(KVT_ENOENT, "key %016llx was deleted while it was being read", (unsigned long long) key);
    }
    if (rc == 0) {
        if (e) e->last_use = ++pool->clock;
        *data = buf;
        *n = len;
    }
    pthread_mutex_unlock(&pool->mu);
    return rc;
}

int kvt_pool_del(kvt_pool *pool, uint64_t key) {
    if (!pool) return kvt__fail(KVT_EINVAL, "kvt_pool_del: pool is NULL");
    struct trash t = { 0 };
    pthread_mutex_lock(&pool->mu);
    size_t i;
    int rc = 0;
    if (!find(pool, key, &i)) {
        rc = kvt__fail(KVT_ENOENT, "key %016llx is not in the pool", (unsigned long long) key);
    } else {
        release_value(pool, &pool->e[i], &t);
        remove_at(pool, i);
    }
    pthread_mutex_unlock(&pool->mu);
    trash_empty(pool, &t);
    return rc;
}

/* Errors: KVT_ENOENT; KVT_EINVAL if buf is NULL or too small for the path (buf then holds
** ""). */
int kvt_pool_spill_path(kvt_pool *pool, uint64_t key, char *buf, size_t buf_size) {
    if (!pool || !buf || buf_size == 0)
        return kvt__fail(KVT_EINVAL, "kvt_pool_spill_path: %s", !pool ? "pool is NULL" : !buf ? "buf is NULL" : "buf_size is 0");
    buf[0] = '\0';
    pthread_mutex_lock(&pool->mu);
    size_t i;
    int rc = 0;
    if (!find(pool, key, &i)) {
        rc = kvt__fail(KVT_ENOENT, "key %016llx is not in the pool", (unsigned long long) key);
    } else if (pool->e[i].state == E_DISK) {
        char path[PATH_MAX];
        kvt__spill_name(&pool->sp, key, pool->e[i].gen, path, sizeof path);
        if (strlen(path) >= buf_size)
            rc = kvt__fail(KVT_EINVAL, "buffer of %zu bytes is too small for spill path %s", buf_size, path);
        else memcpy(buf, path, strlen(path) + 1);
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
