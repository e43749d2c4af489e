/* store.c — the block store (kvtier.h section 8): content-addressed blocks in a RAM tier (ram.c)
** over a persistent disk tier (an SQLite index, DIR/index.db, and checksummed blob files under
** DIR/blobs/, blobfile.c), written behind the caller by one writer thread; optionally over a
** Redis tier shared by servers (redis.c: asked on a local miss, written behind by its own thread).
**
** Threads.  Any thread may call put/get/has/stats/flush/ls/gc/verify/clear.  The writer thread
** takes disk writes from a bounded queue (queue_max); a put that finds it full drops the disk
** write (writes_dropped) and never waits.  The index has two connections: `rd` for lookups
** (rd_mu) and `wr` for every change (wr_mu), so a get's lookup never waits for a write's
** transaction; WAL lets them run at once, busy_timeout covers other processes.  Neither mutex is
** held during file I/O.  Hits of gets are queued too (hits[]) and applied by the writer in
** batches, so a get never writes to the index (except to remove a corrupt entry).
**
** Write order of a block: blob file durable under its name (blobfile.c), then the index row.  A
** row therefore always names a complete, durable file; a crash in between leaves a file without
** a row (an orphan gc removes).  The writer holds DIR/lock shared for each write; gc, verify and
** clear hold it exclusive, so they never mistake another process's write in flight for an
** orphan.
**
** Eviction (disk): before a write that would pass disk_bytes, entries leave in this order:
** expired ones, then cold ones (fewer than hot_hits hits) least recently hit first, then hot ones
** least recently hit first: hit-count promotion protects hot blocks from a scan of cold ones, as
** EdgeSync-LLM's TTL rule (30 min, 7 days once hot) does.
**
** Files: store.c (parameters, open, close, flush), store_index.c (the SQLite index: schema,
** statements, removal), store_writer.c (put, the write queue and the writer thread: files, rows,
** the disk quota, hits), store_get.c (get through the tiers, has, tier), store_gc.c (stats, ls, gc,
** verify, clear), with ram.c, blobfile.c, redis.c, prefetch.c, pool.c below them. */
#include "store/store_int.h"
#include "kv/blob.h"
#include "fault.h"
#include "test_hooks.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct kvt_store_params kvt_store_default_params(void) {
    return (struct kvt_store_params){ .dir = NULL,
                                      .ram_bytes = (size_t) 256 << 20,
                                      .disk_bytes = (size_t) 8 << 30,
                                      .ttl_s = 1800,
                                      .ttl_hot_s = 7 * 86400.0,
                                      .hot_hits = 5,
                                      .queue_max = 256,
                                      .read_only = false,
                                      .redis_url = NULL,
                                      .redis_timeout_ms = 20,
                                      .redis_ttl_s = 86400,
                                      .redis_max_bytes = (size_t) 64 << 20,
                                      .redis_queue_max = 256,
                                      .prefetch_threads = 2,
                                      .prefetch_queue = 256,
                                      .prefetch_bytes = 0 };
}

double kvt__store_now(kvt_store *st) {
    long long us = atomic_load_explicit(&st->clock_us, memory_order_relaxed);
    if (us) return (double) us / 1e6;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double) ts.tv_sec + ts.tv_nsec / 1e9;
}

void kvt_store_test_set_clock(kvt_store *st, double now) { atomic_store(&st->clock_us, (long long) (now * 1e6)); }

void kvt_store_test_unsafe_write_order(kvt_store *st, bool on) {
    pthread_mutex_lock(&st->q_mu);
    st->unsafe_order = on;
    pthread_mutex_unlock(&st->q_mu);
}

void kvt_store_test_hold_writer(kvt_store *st, bool hold) {
    pthread_mutex_lock(&st->q_mu);
    st->hold = hold;
    pthread_cond_broadcast(&st->q_cv);
    pthread_mutex_unlock(&st->q_mu);
}

int kvt__store_sql_fail(kvt_store *st, sqlite3 *db, const char *what) {
    return kvt__fail(KVT_EIO, "store index %s/index.db: %s: %s", st->dir, what, db ? sqlite3_errmsg(db) : "no connection");
}

int kvt__store_lock_all(kvt_store *st) {
    char path[4096];
    snprintf(path, sizeof path, "%s/lock", st->dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    while (flock(fd, LOCK_EX) && errno == EINTR) {}
    return fd;
}

void kvt__store_unlock(int fd) {
    if (fd >= 0) close(fd); /* releases the flock */
}

/* ---- open / close --------------------------------------------------------------------------- */

static int mkdir_p(const char *path) {
    char buf[4096];
    size_t n = strlen(path);
    if (n >= sizeof buf) return ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0700) && errno != EEXIST) return errno;
        *p = '/';
    }
    if (mkdir(buf, 0700) && errno != EEXIST) return errno;
    struct stat sb;
    if (stat(buf, &sb)) return errno;
    return S_ISDIR(sb.st_mode) ? 0 : ENOTDIR;
}

/* Remove temporary files of writers that died (none is in flight: we hold DIR/lock exclusive). */
static void remove_stale_tmp(kvt_store *st) {
    int fd = kvt__store_lock_all(st);
    if (fd < 0) return;
    int dfd = openat(st->blobs_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* its own offset */
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    struct dirent *de;
    long pid;
    while (d && (de = readdir(d)))
        if (kvt__sblob_is_tmp(de->d_name, &pid)) unlinkat(st->blobs_fd, de->d_name, 0);
    if (d) closedir(d);
    else if (dfd >= 0) close(dfd);
    kvt__store_unlock(fd);
}

static int check_params(const struct kvt_store_params *p) {
    if (p->dir && !*p->dir) return kvt__fail(KVT_EINVAL, "store directory is the empty string");
    if (!(p->ttl_s > 0)) return kvt__fail(KVT_EINVAL, "store ttl_s %g is not positive", p->ttl_s);
    if (!(p->ttl_hot_s >= p->ttl_s))
        return kvt__fail(KVT_EINVAL, "store ttl_hot_s %g is shorter than ttl_s %g", p->ttl_hot_s, p->ttl_s);
    if (p->hot_hits < 1) return kvt__fail(KVT_EINVAL, "store hot_hits %d is below 1", p->hot_hits);
    if (p->queue_max < 1) return kvt__fail(KVT_EINVAL, "store queue_max %d is below 1", p->queue_max);
    struct kvt_codec_params cp;
    if (p->disk_codec && kvt_codec_parse(p->disk_codec, &cp)) return kvt__fail(KVT_EINVAL, "store disk codec: %s", kvt_errmsg());
    if (p->disk_codec_heads < 0) return kvt__fail(KVT_EINVAL, "store disk_codec_heads %d is negative", p->disk_codec_heads);
    if (p->disk_codec_bits || p->n_disk_codec_bits) { /* per-head bits: checked as the codec will */
        if (!p->disk_codec) cp = kvt_codec_default_params(KVT_CODEC_RAW);
        cp.n_head_kv = p->disk_codec_heads;
        cp.head_bits = p->disk_codec_bits;
        cp.n_head_bits = p->n_disk_codec_bits;
        if (kvt__codec_check(&cp)) return kvt__fail(KVT_EINVAL, "store disk codec bits: %s", kvt_errmsg());
    }
    if (p->prefetch_threads < 0 || p->prefetch_threads > 16)
        return kvt__fail(KVT_EINVAL, "store prefetch_threads %d is outside 0..16", p->prefetch_threads);
    if (p->prefetch_threads > 0 && p->prefetch_queue < 1)
        return kvt__fail(KVT_EINVAL, "store prefetch_queue %d is below 1", p->prefetch_queue);
    return 0;
}

int kvt_store_open(const struct kvt_store_params *pp, kvt_store **out) {
    if (!out) return kvt__fail(KVT_EINVAL, "kvt_store_open: out is NULL");
    *out = NULL;
    struct kvt_store_params p = pp ? *pp : kvt_store_default_params();
    int rc = check_params(&p);
    if (rc) return rc;
    kvt_store *st = calloc(1, sizeof *st);
    if (!st) return kvt__fail(KVT_ENOMEM, "kvt_store_open: no memory");
    st->p = p;
    st->blobs_fd = st->lock_fd = -1;
    st->dcodec = kvt_codec_default_params(KVT_CODEC_RAW);
    if (p.disk_codec) kvt_codec_parse(p.disk_codec, &st->dcodec); /* checked by check_params */
    st->dcodec.n_head_kv = p.disk_codec_heads;
    st->p.disk_codec = NULL; /* the caller's string */
    if (p.disk_codec_bits) { /* the caller's table: the store's copy serves the disk and Redis writers */
        if (!(st->dbits = malloc((size_t) p.n_disk_codec_bits))) {
            free(st);
            return kvt__fail(KVT_ENOMEM, "kvt_store_open: no memory");
        }
        memcpy(st->dbits, p.disk_codec_bits, (size_t) p.n_disk_codec_bits);
        st->dcodec.head_bits = p.disk_codec_bits = st->p.disk_codec_bits = st->dbits;
        st->dcodec.n_head_bits = p.n_disk_codec_bits;
    }
    st->ttl = (struct kvt__ttl){ p.ttl_s, p.ttl_hot_s, p.hot_hits };
    st->disk = p.disk_bytes > 0;
    pthread_mutex_init(&st->rd_mu, NULL);
    pthread_mutex_init(&st->wr_mu, NULL);
    pthread_mutex_init(&st->q_mu, NULL);
    pthread_cond_init(&st->q_cv, NULL);
    pthread_cond_init(&st->idle_cv, NULL);
    if ((rc = kvt__ram_init(&st->ram, p.ram_bytes))) goto fail;
    if (st->disk) {
        char def[4096];
        if (!p.dir) {
            if ((rc = kvt_store_default_dir(def, sizeof def))) goto fail;
            p.dir = def;
        }
        size_t n = strlen(p.dir);
        while (n > 1 && p.dir[n - 1] == '/') n--;
        if (!(st->dir = strndup(p.dir, n)) || !(st->blobs_dir = malloc(n + 8))) {
            rc = kvt__fail(KVT_ENOMEM, "kvt_store_open: no memory");
            goto fail;
        }
        snprintf(st->blobs_dir, n + 8, "%s/blobs", st->dir);
        int err = p.read_only ? 0 : mkdir_p(st->blobs_dir);
        if (err) {
            rc = kvt__fail(KVT_EIO, "store directory %s: %s", st->blobs_dir, strerror(err));
            goto fail;
        }
        if ((st->blobs_fd = open(st->blobs_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
            rc = kvt__fail(KVT_EIO, "store directory %s: %s%s", st->blobs_dir, strerror(errno),
                           p.read_only && errno == ENOENT ? " (no store there)" : "");
            goto fail;
        }
        char path[4200];
        snprintf(path, sizeof path, "%s/lock", st->dir);
        if (!p.read_only && (st->lock_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600)) < 0) {
            rc = kvt__fail(KVT_EIO, "store lock file %s: %s", path, strerror(errno));
            goto fail;
        }
        if ((rc = kvt__store_index_open(st))) goto fail;
        if (!p.read_only) {
            remove_stale_tmp(st);
            st->disk_bytes_now = kvt__store_sum_sizes(st->wr);
            if ((err = pthread_create(&st->writer, NULL, kvt__store_writer_main, st))) {
                rc = kvt__fail(KVT_ENOMEM, "store writer thread: %s", strerror(err));
                goto fail;
            }
            st->writer_started = true;
        }
    }
    if (p.redis_url && *p.redis_url && (rc = kvt__redis_open(&p, &st->redis))) goto fail;
    if ((rc = kvt__pf_start(st))) goto fail;
    if ((rc = kvt__store_priv_open(st))) goto fail;
    st->p.dir = st->dir;
    st->p.redis_url = NULL;         /* the caller's string; the tier keeps what it parsed */
    st->p.redis_secret_file = NULL; /* read at open */
    st->p.private_dir = NULL;       /* the caller's string; the pool copied it */
    *out = st;
    return 0;
fail:
    kvt_store_free(st);
    return rc;
}

void kvt_store_free(kvt_store *st) {
    if (!st) return;
    kvt__pf_stop(st);            /* its threads read the tiers: before anything closes */
    kvt__redis_close(st->redis); /* its queue holds references to RAM's buffers: first */
    if (st->writer_started) {
        pthread_mutex_lock(&st->q_mu);
        st->stop = true;
        st->hold = false;
        pthread_cond_broadcast(&st->q_cv);
        pthread_mutex_unlock(&st->q_mu);
        pthread_join(st->writer, NULL);
    }
    sqlite3_stmt *stmts[] = { st->rd_get, st->wr_exists, st->wr_ins, st->wr_hit, st->wr_del };
    for (size_t i = 0; i < sizeof stmts / sizeof *stmts; i++) sqlite3_finalize(stmts[i]);
    if (st->wr) sqlite3_exec(st->wr, "PRAGMA optimize", NULL, NULL, NULL);
    sqlite3_close(st->rd);
    sqlite3_close(st->wr);
    for (struct kvt__job *j = st->q_head, *nx; j; j = nx) { /* only if the writer never started */
        nx = j->next;
        kvt__sbuf_unref(j->buf);
        free(j);
    }
    free(st->hits);
    kvt_pool_free(st->priv);
    kvt__ram_free(&st->ram);
    if (st->blobs_fd >= 0) close(st->blobs_fd);
    if (st->lock_fd >= 0) close(st->lock_fd);
    pthread_mutex_destroy(&st->rd_mu);
    pthread_mutex_destroy(&st->wr_mu);
    pthread_mutex_destroy(&st->q_mu);
    pthread_cond_destroy(&st->q_cv);
    pthread_cond_destroy(&st->idle_cv);
    free(st->dir);
    free(st->blobs_dir);
    free(st->dbits);
    free(st);
}

void kvt_store_flush(kvt_store *st) {
    if (!st) return;
    kvt__redis_flush(st->redis);
    if (!st->writer_started) return;
    pthread_mutex_lock(&st->q_mu);
    st->flush_req++;
    pthread_cond_broadcast(&st->q_cv);
    while (st->q_head || st->busy || st->n_hits) pthread_cond_wait(&st->idle_cv, &st->q_mu);
    st->flush_req--;
    pthread_mutex_unlock(&st->q_mu);
}
