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
** EdgeSync-LLM's TTL rule (30 min, 7 days once hot) does. */
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

#define HITS_MAX     4096 /* pending hit records; more are not recorded (advisory counts) */
#define HITS_BATCH   256  /* wake the writer at this many */
#define SCHEMA_VERSION 1

static const char *SCHEMA =
    "CREATE TABLE IF NOT EXISTS blocks("
    "  key BLOB PRIMARY KEY,"        /* 32-byte chain key */
    "  file TEXT NOT NULL,"          /* name under blobs/ */
    "  size INTEGER NOT NULL,"       /* payload bytes */
    "  codec INTEGER NOT NULL,"
    "  checksum BLOB NOT NULL,"      /* SHA-256 of the payload */
    "  model BLOB NOT NULL,"         /* model fingerprint */
    "  n_tokens INTEGER NOT NULL,"
    "  created REAL NOT NULL,"       /* epoch seconds */
    "  last_hit REAL NOT NULL,"      /* epoch seconds: the write, then the last get */
    "  hits INTEGER NOT NULL DEFAULT 0"
    ") WITHOUT ROWID;"
    "CREATE INDEX IF NOT EXISTS blocks_last_hit ON blocks(last_hit);";

struct kvt_store_params kvt_store_default_params(void) {
    return (struct kvt_store_params){ .dir = NULL, .ram_bytes = (size_t)256 << 20, .disk_bytes = (size_t)8 << 30,
                                      .ttl_s = 1800, .ttl_hot_s = 7 * 86400.0, .hot_hits = 5, .queue_max = 256,
                                      .read_only = false, .redis_url = NULL, .redis_timeout_ms = 20,
                                      .redis_ttl_s = 86400, .redis_max_bytes = (size_t)64 << 20,
                                      .redis_queue_max = 256, .prefetch_threads = 2, .prefetch_queue = 256,
                                      .prefetch_bytes = 0 };
}

double kvt__store_now(kvt_store *st) {
    long long us = atomic_load_explicit(&st->clock_us, memory_order_relaxed);
    if (us) return (double)us / 1e6;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

void kvt_store_test_set_clock(kvt_store *st, double now) {
    atomic_store(&st->clock_us, (long long)(now * 1e6));
}

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

/* ---- index ---------------------------------------------------------------------------------- */

static int exec(kvt_store *st, sqlite3 *db, const char *sql) {
    char *err = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &err) != SQLITE_OK) {
        int rc = kvt__fail(KVT_EIO, "store index %s/index.db: %s: %s", st->dir, sql, err ? err : "?");
        sqlite3_free(err);
        return rc;
    }
    return 0;
}

static int open_db(kvt_store *st, bool writer, sqlite3 **db) {
    char path[4096];
    snprintf(path, sizeof path, "%s/index.db", st->dir);
    int flags = SQLITE_OPEN_NOMUTEX | (st->p.read_only ? SQLITE_OPEN_READONLY
                                                       : SQLITE_OPEN_READWRITE | (writer ? SQLITE_OPEN_CREATE : 0));
    if (sqlite3_open_v2(path, db, flags, NULL) != SQLITE_OK) {
        int rc = kvt__fail(KVT_EIO, "store index %s: cannot open: %s", path, *db ? sqlite3_errmsg(*db) : "no memory");
        sqlite3_close(*db);
        *db = NULL;
        return rc;
    }
    sqlite3_busy_timeout(*db, 10000);
    return 0;
}

static int prepare(kvt_store *st, sqlite3 *db, const char *sql, sqlite3_stmt **out) {
    return sqlite3_prepare_v2(db, sql, -1, out, NULL) == SQLITE_OK ? 0 : kvt__store_sql_fail(st, db, sql);
}

/* Refuse an index written by a newer kvtier (PRAGMA user_version). */
static int check_version(kvt_store *st, sqlite3 *db) {
    sqlite3_stmt *v;
    int rc = prepare(st, db, "PRAGMA user_version", &v);
    if (rc) return rc;
    int version = sqlite3_step(v) == SQLITE_ROW ? sqlite3_column_int(v, 0) : -1;
    sqlite3_finalize(v);
    if (version > SCHEMA_VERSION)
        return kvt__fail(KVT_EIO, "store index %s/index.db has format version %d, newer than this kvtier's %d",
                         st->dir, version, SCHEMA_VERSION);
    return 0;
}

static int open_index(kvt_store *st) {
    int rc;
    if (!st->p.read_only) {
        if ((rc = open_db(st, true, &st->wr))) return rc;
        if ((rc = exec(st, st->wr, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"))) return rc;
        if ((rc = check_version(st, st->wr))) return rc;
        if ((rc = exec(st, st->wr, "BEGIN IMMEDIATE"))) return rc;
        if ((rc = exec(st, st->wr, SCHEMA)) || (rc = exec(st, st->wr, "PRAGMA user_version = 1")) ||
            (rc = exec(st, st->wr, "COMMIT"))) {
            exec(st, st->wr, "ROLLBACK");
            return rc;
        }
        if ((rc = prepare(st, st->wr, "SELECT last_hit, hits, file, size FROM blocks WHERE key = ?1", &st->wr_exists)) ||
            (rc = prepare(st, st->wr,
                          "INSERT OR REPLACE INTO blocks(key, file, size, codec, checksum, model, n_tokens, created, "
                          "last_hit, hits) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)", &st->wr_ins)) ||
            (rc = prepare(st, st->wr, "UPDATE blocks SET hits = hits + 1, last_hit = max(last_hit, ?2) WHERE key = ?1",
                          &st->wr_hit)) ||
            (rc = prepare(st, st->wr, "DELETE FROM blocks WHERE key = ?1 AND (?2 IS NULL OR file = ?2) RETURNING size", &st->wr_del)))
            return rc;
    }
    if ((rc = open_db(st, false, &st->rd)) || (st->p.read_only && (rc = check_version(st, st->rd)))) return rc;
    return prepare(st, st->rd,
                   "SELECT file, size, codec, checksum, model, n_tokens, last_hit, hits FROM blocks WHERE key = ?1",
                   &st->rd_get);
}

static int64_t sum_sizes(sqlite3 *db) {
    sqlite3_stmt *s;
    int64_t n = 0;
    if (sqlite3_prepare_v2(db, "SELECT COALESCE(SUM(size), 0) FROM blocks", -1, &s, NULL) != SQLITE_OK) return 0;
    if (sqlite3_step(s) == SQLITE_ROW) n = sqlite3_column_int64(s, 0);
    sqlite3_finalize(s);
    return n;
}

int64_t kvt__store_remove(kvt_store *st, const kvt_key *key, const char *file) {
    if (!st->wr) return -1;
    int64_t freed = -1;
    pthread_mutex_lock(&st->wr_mu);
    sqlite3_bind_blob(st->wr_del, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
    sqlite3_bind_text(st->wr_del, 2, file, -1, SQLITE_STATIC);
    if (sqlite3_step(st->wr_del) == SQLITE_ROW) freed = sqlite3_column_int64(st->wr_del, 0);
    while (sqlite3_step(st->wr_del) == SQLITE_ROW) {}
    sqlite3_reset(st->wr_del);
    if (freed >= 0) st->disk_bytes_now -= freed;
    pthread_mutex_unlock(&st->wr_mu);
    if (st->on_remove) st->on_remove(st->on_remove_ud);
    /* the file that row named, and only a blob's name: a fresh write of key has a name of its
    ** own, and a row's text never sends the unlink out of blobs/ */
    kvt_key k;
    if (kvt__sblob_is_blob(file, &k)) unlinkat(st->blobs_fd, file, 0);
    return freed;
}

void kvt_store_test_on_remove(kvt_store *st, void (*cb)(void *), void *ud) {
    st->on_remove = cb;
    st->on_remove_ud = ud;
}

/* ---- writer thread ----------------------------------------------------------------------- */

static void apply_hits(kvt_store *st, struct kvt__hit *h, size_t n) {
    if (!n) return;
    pthread_mutex_lock(&st->wr_mu);
    sqlite3_exec(st->wr, "BEGIN", NULL, NULL, NULL);
    for (size_t i = 0; i < n; i++) {
        sqlite3_bind_blob(st->wr_hit, 1, h[i].key.b, KVT_KEY_BYTES, SQLITE_STATIC);
        sqlite3_bind_double(st->wr_hit, 2, h[i].t);
        sqlite3_step(st->wr_hit);
        sqlite3_reset(st->wr_hit);
    }
    if (sqlite3_exec(st->wr, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) sqlite3_exec(st->wr, "ROLLBACK", NULL, NULL, NULL);
    pthread_mutex_unlock(&st->wr_mu);
}

/* Make room for `need` more blob bytes within disk_bytes (wr_mu held): expired entries first,
** then cold, then hot, least recently hit first.  Returns false if it cannot. */
static bool make_room(kvt_store *st, int64_t need, double now) {
    const int64_t quota = (int64_t)st->p.disk_bytes;
    if (need > quota) return false;
    if (st->disk_bytes_now + need <= quota) return true;
    st->disk_bytes_now = sum_sizes(st->wr); /* other processes may have written or removed */
    sqlite3_stmt *sel;
    if (sqlite3_prepare_v2(st->wr,
                           "SELECT key, size, last_hit + CASE WHEN hits >= ?1 THEN ?2 ELSE ?3 END <= ?4, file FROM blocks "
                           "ORDER BY 3 DESC, hits >= ?1, last_hit LIMIT 256", -1, &sel, NULL) != SQLITE_OK)
        return false;
    bool ok = true;
    while (ok && st->disk_bytes_now + need > quota) {
        sqlite3_bind_int(sel, 1, st->ttl.hot_hits);
        sqlite3_bind_double(sel, 2, st->ttl.ttl_hot_s);
        sqlite3_bind_double(sel, 3, st->ttl.ttl_s);
        sqlite3_bind_double(sel, 4, now);
        kvt_key victims[256];
        char files[256][KVT__SBLOB_NAME];
        int64_t sizes[256];
        int expired[256], n = 0;
        int64_t freed = 0;
        while (n < 256 && st->disk_bytes_now + need - freed > quota && sqlite3_step(sel) == SQLITE_ROW) {
            if (sqlite3_column_bytes(sel, 0) != KVT_KEY_BYTES) continue;
            memcpy(victims[n].b, sqlite3_column_blob(sel, 0), KVT_KEY_BYTES);
            const char *f = (const char *)sqlite3_column_text(sel, 3);
            snprintf(files[n], sizeof files[n], "%s", f ? f : "");
            sizes[n] = sqlite3_column_int64(sel, 1);
            expired[n] = sqlite3_column_int(sel, 2);
            freed += sizes[n];
            n++;
        }
        sqlite3_reset(sel);
        if (n == 0) {
            ok = false;
            break;
        }
        sqlite3_exec(st->wr, "BEGIN", NULL, NULL, NULL);
        for (int i = 0; i < n; i++) {
            sqlite3_bind_blob(st->wr_del, 1, victims[i].b, KVT_KEY_BYTES, SQLITE_STATIC);
            sqlite3_bind_text(st->wr_del, 2, files[i], -1, SQLITE_STATIC);
            while (sqlite3_step(st->wr_del) == SQLITE_ROW) {}
            sqlite3_reset(st->wr_del);
        }
        if (sqlite3_exec(st->wr, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
            sqlite3_exec(st->wr, "ROLLBACK", NULL, NULL, NULL);
            ok = false;
            break;
        }
        int64_t n_exp = 0;
        for (int i = 0; i < n; i++) {
            kvt_key k;
            if (kvt__sblob_is_blob(files[i], &k)) unlinkat(st->blobs_fd, files[i], 0);
            n_exp += expired[i];
        }
        st->disk_bytes_now -= freed;
        pthread_mutex_lock(&st->q_mu);
        st->d_expired += n_exp;
        st->d_evictions += n - n_exp;
        pthread_mutex_unlock(&st->q_mu);
    }
    sqlite3_finalize(sel);
    return ok;
}

/* Fill old[KVT__SBLOB_NAME] with the file key's row names ("" if none); OUT *size (wr_mu held). */
static bool row_file(kvt_store *st, const kvt_key *key, char old[KVT__SBLOB_NAME], int64_t *size,
                     double *last_hit, int64_t *hits) {
    old[0] = '\0';
    sqlite3_bind_blob(st->wr_exists, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
    bool have = sqlite3_step(st->wr_exists) == SQLITE_ROW;
    if (have) {
        const char *f = (const char *)sqlite3_column_text(st->wr_exists, 2);
        snprintf(old, KVT__SBLOB_NAME, "%s", f ? f : "");
        if (size) *size = sqlite3_column_int64(st->wr_exists, 3);
        if (last_hit) *last_hit = sqlite3_column_double(st->wr_exists, 0);
        if (hits) *hits = sqlite3_column_int64(st->wr_exists, 1);
    }
    sqlite3_reset(st->wr_exists);
    return have;
}

/* The index row of a block whose file `name` is written (wr_mu taken inside).  A row another
** process wrote for key since write_job looked is replaced, and the file it named unlinked after
** the commit (its name is its own).  Fault site: KVT__FAULT_STORE_INDEX. */
static bool insert_row(kvt_store *st, const struct kvt__job *j, const struct kvt__sblob_hdr *h, const char *name) {
    char old[KVT__SBLOB_NAME] = "";
    int64_t old_size = 0;
    pthread_mutex_lock(&st->wr_mu);
    bool ok = !kvt__fault_check(KVT__FAULT_STORE_INDEX) && sqlite3_exec(st->wr, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK;
    if (ok) {
        if (!row_file(st, &j->key, old, &old_size, NULL, NULL)) old_size = 0;
        sqlite3_stmt *s = st->wr_ins;
        sqlite3_bind_blob(s, 1, j->key.b, KVT_KEY_BYTES, SQLITE_STATIC);
        sqlite3_bind_text(s, 2, name, -1, SQLITE_STATIC);
        sqlite3_bind_int64(s, 3, (sqlite3_int64)h->size);
        sqlite3_bind_int(s, 4, h->codec);
        sqlite3_bind_blob(s, 5, h->sha, 32, SQLITE_STATIC);
        sqlite3_bind_blob(s, 6, j->meta.model.b, KVT_KEY_BYTES, SQLITE_STATIC);
        sqlite3_bind_int(s, 7, j->meta.n_tokens);
        sqlite3_bind_double(s, 8, j->t);
        sqlite3_bind_double(s, 9, j->last_hit);
        sqlite3_bind_int64(s, 10, j->hits);
        ok = sqlite3_step(s) == SQLITE_DONE;
        sqlite3_reset(s);
        ok = ok && sqlite3_exec(st->wr, "COMMIT", NULL, NULL, NULL) == SQLITE_OK;
        if (!ok) sqlite3_exec(st->wr, "ROLLBACK", NULL, NULL, NULL);
    }
    if (ok) st->disk_bytes_now += (int64_t)h->size - old_size;
    pthread_mutex_unlock(&st->wr_mu);
    kvt_key k;
    if (ok && old[0] && strcmp(old, name) && kvt__sblob_is_blob(old, &k)) unlinkat(st->blobs_fd, old, 0);
    return ok;
}

/* Write one queued block: skip a key already in the index, make room, write the file, then the
** row.  Any failure drops the write (counted); nothing half-written stays visible.  (The test
** hook kvt_store_test_unsafe_write_order reverses the order on purpose: row first, then the
** file in place, slowly; the kill -9 test's control.) */
static void write_job(kvt_store *st, struct kvt__job *j) {
    while (flock(st->lock_fd, LOCK_SH) && errno == EINTR) {}
    bool written = false, skipped = false;
    pthread_mutex_lock(&st->wr_mu);
    const double now = kvt__store_now(st);
    bool expired = false;
    char old[KVT__SBLOB_NAME];
    double last_hit = 0;
    int64_t hits = 0;
    if (row_file(st, &j->key, old, NULL, &last_hit, &hits)) {
        /* an expired row is no copy for lookups: skipping the fresh write for it (while the RAM
        ** tier records the block as on disk) lost the block (issue #24 item 7).  The fresh row
        ** replaces it (insert_row), and its file goes; until then it is still the session's copy. */
        expired = kvt__expires(&st->ttl, last_hit, hits) <= now;
        skipped = !expired;
    }
    bool room = skipped || make_room(st, (int64_t)j->buf->n, now);
    pthread_mutex_unlock(&st->wr_mu);
    /* the disk tier's codec, here on the writer thread (off the decode path) */
    const uint8_t *data = j->buf->data;
    size_t size = j->buf->n;
    int32_t codec = j->meta.codec;
    uint8_t *enc = NULL;
    kvt_blob raw = { (uint8_t *)j->buf->data, j->buf->n, 0, j->meta.n_tokens, 0, 0 };
    bool encode = !skipped && room && codec == KVT_CODEC_RAW && st->dcodec.codec != KVT_CODEC_RAW;
    if (encode && kvt__blob_shape(&raw) != 0) { /* not a block's blob: stored raw */
        encode = false;
        kvt__clear_error();
    }
    if (encode) {
        size_t en = 0;
        if (kvt_codec_encode(&raw, &st->dcodec, &enc, &en, NULL) == 0) {
            data = enc;
            size = en;
            codec = st->dcodec.codec;
        } else { /* e.g. a quantised cache: stored raw */
            kvt__clear_error();
        }
    }
    if (!skipped && room) {
        struct kvt__sblob_hdr h = { .key = j->key, .model = j->meta.model, .codec = codec,
                                   .n_tokens = j->meta.n_tokens, .size = size };
        const char *what = NULL;
        char name[KVT__SBLOB_NAME];
        if (kvt__sha256(data, size, h.sha) != 0) {
            /* dropped */
        } else if (st->unsafe_order) {
            kvt__sblob_name(&j->key, 0, name); /* one name per key, rewritten in place */
            written = insert_row(st, j, &h, name) && kvt__sblob_write_unsafe(st->blobs_fd, &h, data, name) == 0;
        } else if (kvt__sblob_write(st->blobs_fd, st->blobs_dir, &h, data, name, &what) == 0) {
            written = insert_row(st, j, &h, name);
            if (!written) unlinkat(st->blobs_fd, name, 0); /* no row names it: it must not stay */
        }
    }
    flock(st->lock_fd, LOCK_UN);
    free(enc);
    pthread_mutex_lock(&st->q_mu);
    if (written) st->d_writes++;
    else if (!skipped) st->d_dropped++;
    pthread_mutex_unlock(&st->q_mu);
}

static void *writer_main(void *arg) {
    kvt_store *st = arg;
    pthread_mutex_lock(&st->q_mu);
    for (;;) {
        /* sleep until there is a block to write, or hits that are many, old (1 s) or flushed */
        bool timed_out = false;
        while (!st->stop &&
               (st->hold || (!st->q_head && !(st->n_hits && (st->flush_req || st->n_hits >= HITS_BATCH || timed_out))))) {
            if (st->n_hits && !st->hold) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_sec += 1;
                timed_out = pthread_cond_timedwait(&st->q_cv, &st->q_mu, &ts) == ETIMEDOUT;
            } else {
                pthread_cond_wait(&st->q_cv, &st->q_mu);
            }
        }
        if (st->stop && !st->q_head && !st->n_hits) break;
        struct kvt__hit *hits = st->hits;
        size_t n_hits = st->n_hits;
        st->hits = NULL;
        st->n_hits = st->cap_hits = 0;
        struct kvt__job *j = st->q_head;
        if (j) {
            st->q_head = j->next;
            if (!st->q_head) st->q_tail = NULL;
            st->q_len--;
        }
        st->busy = true;
        pthread_mutex_unlock(&st->q_mu);
        apply_hits(st, hits, n_hits);
        free(hits);
        if (j) {
            write_job(st, j);
            kvt__sbuf_unref(j->buf);
            free(j);
        }
        pthread_mutex_lock(&st->q_mu);
        st->busy = false;
        pthread_cond_broadcast(&st->idle_cv);
    }
    pthread_mutex_unlock(&st->q_mu);
    return NULL;
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
    if (d) closedir(d); else if (dfd >= 0) close(dfd);
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
    if (p->disk_codec && kvt_codec_parse(p->disk_codec, &cp))
        return kvt__fail(KVT_EINVAL, "store disk codec: %s", kvt_errmsg());
    if (p->disk_codec_heads < 0) return kvt__fail(KVT_EINVAL, "store disk_codec_heads %d is negative", p->disk_codec_heads);
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
        if ((rc = open_index(st))) goto fail;
        if (!p.read_only) {
            remove_stale_tmp(st);
            st->disk_bytes_now = sum_sizes(st->wr);
            if ((err = pthread_create(&st->writer, NULL, writer_main, st))) {
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
    st->p.redis_url = NULL; /* the caller's string; the tier keeps what it parsed */
    st->p.redis_secret_file = NULL; /* read at open */
    st->p.private_dir = NULL; /* the caller's string; the pool copied it */
    st->dcodec = kvt_codec_default_params(KVT_CODEC_RAW);
    if (p.disk_codec) kvt_codec_parse(p.disk_codec, &st->dcodec); /* checked by check_params */
    st->dcodec.n_head_kv = p.disk_codec_heads;
    st->p.disk_codec = NULL; /* the caller's string */
    *out = st;
    return 0;
fail:
    kvt_store_close(st);
    return rc;
}

void kvt_store_close(kvt_store *st) {
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
    free(st);
}

/* ---- put / get / has ------------------------------------------------------------------------ */

static bool key_queued(kvt_store *st, const kvt_key *key) { /* q_mu held */
    for (struct kvt__job *j = st->q_head; j; j = j->next)
        if (!memcmp(j->key.b, key->b, KVT_KEY_BYTES)) return true;
    return false;
}

/* RAM + disk (+ Redis when to_redis: a block that came from Redis is not sent back). */
int kvt__store_put_local(kvt_store *st, const kvt_key *key, const struct kvt_store_meta *m, const void *data, size_t n,
                         bool to_redis, bool prefetched) {
    if (!st || !key || !m || (!data && n > 0))
        return kvt__fail(KVT_EINVAL, "kvt_store_put: NULL %s", !st ? "store" : !key ? "key" : !m ? "meta" : "data");
    if (st->p.read_only) return kvt__fail(KVT_EINVAL, "kvt_store_put: the store at %s is open read-only", st->dir ? st->dir : "(RAM only)");
    if (m->n_tokens < 0) return kvt__fail(KVT_EINVAL, "kvt_store_put: n_tokens %d is negative", m->n_tokens);
    const double now = kvt__store_now(st);
    bool on_disk;
    const bool in_ram = kvt__ram_has(&st->ram, key, &st->ttl, now, &on_disk);
    /* content-addressed: same key, same bytes; but a block whose disk write was dropped (a full
    ** queue) while RAM kept it is queued again */
    if (in_ram && (on_disk || !st->disk)) return 0;
    struct kvt__sbuf *buf = kvt__sbuf_new(data, n);
    if (!buf) return kvt__fail(KVT_ENOMEM, "kvt_store_put: no memory for %zu bytes", n);
    if (!in_ram) kvt__ram_put(&st->ram, key, m, buf, &st->ttl, now, prefetched);
    int rc = 0;
    if (st->disk) {
        struct kvt__job *j = malloc(sizeof *j);
        bool queued = true;
        pthread_mutex_lock(&st->q_mu);
        if (key_queued(st, key)) {
            free(j);
        } else if (!j) {
            queued = false;
            rc = kvt__fail(KVT_ENOMEM, "kvt_store_put: no memory for the disk write");
        } else if (st->q_len >= st->p.queue_max) {
            st->d_dropped++; /* write-behind never waits for the disk */
            free(j);
            queued = false;
        } else {
            *j = (struct kvt__job){ .key = *key, .meta = *m, .buf = kvt__sbuf_ref(buf), .t = now, .last_hit = now };
            if (st->q_tail) st->q_tail->next = j; else st->q_head = j;
            st->q_tail = j;
            st->q_len++;
            pthread_cond_signal(&st->q_cv);
        }
        pthread_mutex_unlock(&st->q_mu);
        if (queued) kvt__ram_set_on_disk(&st->ram, key);
    }
    if (to_redis && st->redis && !in_ram) kvt__redis_put(st->redis, key, m, buf); /* after the local tiers have it */
    kvt__sbuf_unref(buf);
    return rc;
}

int kvt_store_put(kvt_store *st, const kvt_key *key, const struct kvt_store_meta *m, const void *data, size_t n) {
    return kvt__store_put_local(st, key, m, data, n, true, false);
}

static void record_hit(kvt_store *st, const kvt_key *key, double now) {
    if (!st->writer_started) return;
    pthread_mutex_lock(&st->q_mu);
    for (struct kvt__job *j = st->q_head; j; j = j->next) { /* not in the index yet: its row starts with them */
        if (memcmp(j->key.b, key->b, KVT_KEY_BYTES)) continue;
        j->hits++;
        j->last_hit = now;
        pthread_mutex_unlock(&st->q_mu);
        return;
    }
    if (st->n_hits == st->cap_hits && st->cap_hits < HITS_MAX) {
        size_t cap = st->cap_hits ? 2 * st->cap_hits : 64;
        struct kvt__hit *h = realloc(st->hits, cap * sizeof *h);
        if (h) {
            st->hits = h;
            st->cap_hits = cap;
        }
    }
    if (st->n_hits < st->cap_hits) {
        st->hits[st->n_hits++] = (struct kvt__hit){ .key = *key, .t = now };
        if (st->n_hits == HITS_BATCH) pthread_cond_signal(&st->q_cv);
    }
    pthread_mutex_unlock(&st->q_mu);
}

static void count(kvt_store *st, int64_t *ctr) {
    pthread_mutex_lock(&st->q_mu);
    (*ctr)++;
    pthread_mutex_unlock(&st->q_mu);
}

/* A block still waiting for the writer is the disk tier's too: copy it out (q_mu held). */
static int get_queued(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                      struct kvt_store_meta *meta, bool *found) {
    *found = false;
    for (struct kvt__job *j = st->q_head; j; j = j->next) {
        if (memcmp(j->key.b, key->b, KVT_KEY_BYTES)) continue;
        *found = true;
        if (memcmp(j->meta.model.b, model->b, KVT_KEY_BYTES)) {
            st->d_corrupt++;
            st->d_misses++;
            return KVT_ENOENT;
        }
        if (!(*data = malloc(j->buf->n ? j->buf->n : 1))) return KVT_ENOMEM;
        if (j->buf->n) memcpy(*data, j->buf->data, j->buf->n);
        *n = j->buf->n;
        *meta = j->meta;
        st->d_hits++;
        return 0;
    }
    return KVT_ENOENT;
}

static int miss(kvt_store *st, int64_t *ctr, const char *why, const char *hex, int *pf) {
    pthread_mutex_lock(&st->q_mu);
    if (ctr) (*ctr)++;
    if (!pf) st->d_misses++; /* a prefetch is not a get: the get that follows counts */
    pthread_mutex_unlock(&st->q_mu);
    return kvt__fail(KVT_ENOENT, "block %.16s: %s", hex, why);
}

const struct kvt__ttl kvt__ttl_forever = { 1e300, 1e300, 1 };

/* The local tiers.  pf NULL: a get.  pf set: a prefetch's read (prefetch.c): RAM and the write
** queue are only looked at (*pf KVT__PF_SKIPPED, nothing read), a disk hit goes into RAM marked
** prefetched without counting a hit or recording one in the index, and *pf says what happened
** (PROMOTED with rc 0; ABSENT: not stored, expired or another model's; FAILED: corrupt, removed,
** counted in disk.corrupt as a get's read is). */
int kvt__store_get_local(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                         struct kvt_store_meta *meta, enum kvt_tier *tier, int *pf, const struct kvt__ttl *ttl) {
    if (data) *data = NULL;
    if (n) *n = 0;
    if (tier) *tier = KVT_TIER_NONE;
    if (!st || !key || !model || !data || !n)
        return kvt__fail(KVT_EINVAL, "kvt_store_get: NULL %s",
                         !st ? "store" : !key ? "key" : !model ? "model fingerprint" : "data or n");
    struct kvt_store_meta mt;
    char hex[65];
    kvt_key_hex(key, hex);
    const double now = kvt__store_now(st);
    bool oom, found;
    if (pf) {
        *pf = KVT__PF_SKIPPED;
        if (kvt__ram_has(&st->ram, key, ttl, now, NULL)) return KVT_ENOENT;
        *pf = KVT__PF_ABSENT;
        if (!st->disk) return KVT_ENOENT;
        pthread_mutex_lock(&st->q_mu);
        found = key_queued(st, key);
        pthread_mutex_unlock(&st->q_mu);
        if (found) { /* waiting for the writer: RAM holds it, or held it moments ago */
            *pf = KVT__PF_SKIPPED;
            return KVT_ENOENT;
        }
        goto index;
    }
    int r = kvt__ram_get(&st->ram, key, model, ttl, now, data, n, &mt, &oom);
    if (r == KVT__RAM_HIT) {
        if (oom) return kvt__fail(KVT_ENOMEM, "kvt_store_get: no memory for block %.16s", hex);
        record_hit(st, key, now);
        if (meta) *meta = mt;
        if (tier) *tier = KVT_TIER_RAM;
        return 0;
    }
    if (r == KVT__RAM_FOREIGN) return kvt__fail(KVT_ENOENT, "block %.16s belongs to another model", hex);
    if (!st->disk) return kvt__fail(KVT_ENOENT, "block %.16s %s", hex, r == KVT__RAM_EXPIRED ? "expired" : "is not stored");

    pthread_mutex_lock(&st->q_mu);
    int rc = get_queued(st, key, model, data, n, &mt, &found);
    pthread_mutex_unlock(&st->q_mu);
    if (found) {
        if (rc) return rc == KVT_ENOMEM ? kvt__fail(rc, "kvt_store_get: no memory for block %.16s", hex)
                                        : kvt__fail(rc, "block %.16s belongs to another model", hex);
        record_hit(st, key, now);
        if (meta) *meta = mt;
        if (tier) *tier = KVT_TIER_DISK;
        return 0;
    }

index:;
    struct { int64_t size, hits; int32_t codec, n_tokens; uint8_t sha[32]; kvt_key model; double last_hit;
             char file[KVT__SBLOB_NAME]; } row;
    pthread_mutex_lock(&st->rd_mu);
    sqlite3_bind_blob(st->rd_get, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
    int s = sqlite3_step(st->rd_get);
    bool have = s == SQLITE_ROW && sqlite3_column_bytes(st->rd_get, 3) == 32 && sqlite3_column_bytes(st->rd_get, 4) == 32;
    if (have) {
        const char *f = (const char *)sqlite3_column_text(st->rd_get, 0);
        snprintf(row.file, sizeof row.file, "%s", f ? f : "");
        row.size = sqlite3_column_int64(st->rd_get, 1);
        row.codec = sqlite3_column_int(st->rd_get, 2);
        memcpy(row.sha, sqlite3_column_blob(st->rd_get, 3), 32);
        memcpy(row.model.b, sqlite3_column_blob(st->rd_get, 4), 32);
        row.n_tokens = sqlite3_column_int(st->rd_get, 5);
        row.last_hit = sqlite3_column_double(st->rd_get, 6);
        row.hits = sqlite3_column_int64(st->rd_get, 7);
    }
    sqlite3_reset(st->rd_get);
    if (s != SQLITE_ROW && s != SQLITE_DONE) {
        rc = kvt__store_sql_fail(st, st->rd, "lookup");
        pthread_mutex_unlock(&st->rd_mu);
        return rc;
    }
    pthread_mutex_unlock(&st->rd_mu);
    if (!have) return miss(st, s == SQLITE_ROW ? &st->d_corrupt : NULL, "not stored", hex, pf);
    /* an expired row is a miss for lookups but stays: it is still the copy of the session that
    ** wrote it (kvt_store_get_copy reads at any age); the quota (make_room) and gc remove it */
    if (kvt__expires(ttl, row.last_hit, row.hits) <= now) return miss(st, &st->d_expired, "expired", hex, pf);
    if (memcmp(row.model.b, model->b, KVT_KEY_BYTES))
        return miss(st, &st->d_corrupt, "stored for another model fingerprint", hex, pf);
    if (pf) *pf = KVT__PF_FAILED; /* from here on a miss is a bad file */

    struct kvt__sblob_hdr h;
    const char *why = "";
    uint8_t *buf = NULL;
    kvt_key fk;
    if (!kvt__sblob_is_blob(row.file, &fk) || memcmp(fk.b, key->b, KVT_KEY_BYTES)) {
        kvt__store_remove(st, key, row.file);
        return miss(st, &st->d_corrupt, "the index names a file of another key", hex, pf);
    }
    r = kvt__sblob_read(st->blobs_fd, row.file, &h, &buf, &why);
    if (r == KVT__SBLOB_NOMEM) return kvt__fail(KVT_ENOMEM, "kvt_store_get: block %.16s: %s", hex, why);
    if (r == KVT__SBLOB_OK) {
        why = memcmp(h.key.b, key->b, 32) ? "header names another key"
            : memcmp(h.model.b, row.model.b, 32) ? "header names another model"
            : (int64_t)h.size != row.size || h.codec != row.codec || h.n_tokens != row.n_tokens
                ? "header disagrees with the index"
            : memcmp(h.sha, row.sha, 32) ? "checksum disagrees with the index" : NULL;
        char dec_why[512];
        if (!why && h.codec != KVT_CODEC_RAW) { /* the disk tier's codec: callers see raw bytes */
            kvt_blob *dec = NULL;
            int drc = kvt_codec_decode(buf, (size_t)h.size, &dec);
            free(buf);
            buf = NULL;
            if (drc == KVT_ENOMEM) return kvt__fail(KVT_ENOMEM, "kvt_store_get: decoding block %.16s", hex);
            if (drc) {
                snprintf(dec_why, sizeof dec_why, "codec payload does not decode (%s)", kvt_errmsg());
                why = dec_why;
            } else {
                buf = dec->data;
                h.size = dec->size;
                h.codec = KVT_CODEC_RAW;
                row.codec = KVT_CODEC_RAW;
                dec->data = NULL;
                kvt_blob_free(dec);
            }
        }
        if (!why) {
            if (st->ram.budget) { /* a disk hit is copied into RAM */
                struct kvt__sbuf *b = kvt__sbuf_new(buf, (size_t)h.size);
                if (b) {
                    kvt__ram_put(&st->ram, key, &(struct kvt_store_meta){ row.model, row.n_tokens, row.codec }, b,
                                 &st->ttl, now, pf != NULL);
                    kvt__ram_set_on_disk(&st->ram, key);
                }
                kvt__sbuf_unref(b);
            }
            if (pf) {
                *pf = KVT__PF_PROMOTED;
            } else {
                record_hit(st, key, now);
                count(st, &st->d_hits);
            }
            *data = buf;
            *n = (size_t)h.size;
            if (meta) *meta = (struct kvt_store_meta){ row.model, row.n_tokens, row.codec };
            if (tier) *tier = KVT_TIER_DISK;
            return 0;
        }
        free(buf);
    } else if (r == KVT__SBLOB_MISSING) {
        /* evicted between the lookup and the open is an ordinary miss; a row left without its
        ** file is not */
        pthread_mutex_lock(&st->rd_mu);
        sqlite3_bind_blob(st->rd_get, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
        bool still = sqlite3_step(st->rd_get) == SQLITE_ROW;
        if (still) { /* the same write's row: a fresh one names another file */
            const char *f = (const char *)sqlite3_column_text(st->rd_get, 0);
            still = f && !strcmp(f, row.file);
        }
        sqlite3_reset(st->rd_get);
        pthread_mutex_unlock(&st->rd_mu);
        if (!still) {
            if (pf) *pf = KVT__PF_ABSENT;
            return miss(st, NULL, "evicted", hex, pf);
        }
        why = "file missing";
    }
    kvt__store_remove(st, key, row.file); /* never returned, never read again */
    return miss(st, &st->d_corrupt, why, hex, pf);
}

/* RAM, disk, then Redis: a Redis hit is copied into RAM and queued for disk. */
static int get_tiers(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                     struct kvt_store_meta *meta, enum kvt_tier *tier, const struct kvt__ttl *ttl) {
    /* a prefetch of key in flight is waited for (never read twice); one that found no tier
    ** holding it spares the get Redis's round trip, not the local tiers: the key may have been
    ** put since the prefetch looked */
    const bool pf_absent = st && key && model && data && n && kvt__pf_wait(st, key) == KVT__PF_ABSENT;
    int rc = kvt__store_get_local(st, key, model, data, n, meta, tier, NULL, ttl);
    if (rc != KVT_ENOENT || !st->redis || pf_absent) return rc;
    char local[256], hex[65];
    snprintf(local, sizeof local, "%s", kvt_errmsg());
    kvt_key_hex(key, hex);
    struct kvt_store_meta mt;
    const char *why = "";
    rc = kvt__redis_get(st->redis, key, model, data, n, &mt, &why);
    if (rc == KVT_ENOMEM) return kvt__fail(rc, "kvt_store_get: no memory for block %.16s from Redis", hex);
    if (rc) return kvt__fail(rc, "%s; %s", local, why);
    if (!st->p.read_only) {
        kvt__store_put_local(st, key, &mt, *data, *n, false, false);
        kvt__clear_error();
    }
    if (meta) *meta = mt;
    if (tier) *tier = KVT_TIER_REDIS;
    return 0;
}

int kvt_store_get(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                  struct kvt_store_meta *meta, enum kvt_tier *tier) {
    return get_tiers(st, key, model, data, n, meta, tier, st ? &st->ttl : NULL);
}

int kvt_store_get_copy(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n) {
    return get_tiers(st, key, model, data, n, NULL, NULL, &kvt__ttl_forever);
}

/* Where key's bytes are under ttl: RAM (or its write queued), disk, none. */
static int tier_of(kvt_store *st, const kvt_key *key, const struct kvt__ttl *ttl) {
    if (!st || !key) return KVT_TIER_NONE;
    if (kvt__ram_has(&st->ram, key, ttl, kvt__store_now(st), NULL)) return KVT_TIER_RAM;
    if (!st->disk) return KVT_TIER_NONE;
    pthread_mutex_lock(&st->q_mu);
    bool has = key_queued(st, key);
    pthread_mutex_unlock(&st->q_mu);
    if (has) return KVT_TIER_RAM; /* its bytes wait in the write queue */
    pthread_mutex_lock(&st->rd_mu);
    sqlite3_bind_blob(st->rd_get, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
    if (sqlite3_step(st->rd_get) == SQLITE_ROW)
        has = kvt__expires(ttl, sqlite3_column_double(st->rd_get, 6), sqlite3_column_int64(st->rd_get, 7)) >
              kvt__store_now(st);
    sqlite3_reset(st->rd_get);
    pthread_mutex_unlock(&st->rd_mu);
    return has ? KVT_TIER_DISK : KVT_TIER_NONE;
}

int kvt_store_tier(kvt_store *st, const kvt_key *key) {
    return tier_of(st, key, &kvt__ttl_forever);
}

bool kvt_store_has(kvt_store *st, const kvt_key *key) {
    return st && tier_of(st, key, &st->ttl) != KVT_TIER_NONE;
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
