/* store_gc.c — the block store's reports and maintenance: stats, ls, gc, verify, clear (kvtier.h
** section 8).
**
** Each takes DIR/lock exclusively (gc, verify and clear) while it compares the index with the
** blob directory: every writer of every process holds it shared for the whole of one block's
** write (file, then row), so no write is half done meanwhile, and a file without a row or a
** temporary file is really left over (a killed writer's), not one in flight.
** Rows are read into memory first and the callback / the file checks run without any index
** connection's mutex, so a long verify never stalls gets. */
#include "store/store_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct row {
    kvt_key key, model;
    int64_t size, hits;
    int32_t codec, n_tokens;
    uint8_t sum[32];
    double created, last_hit;
    char file[KVT__SBLOB_NAME]; /* the file the row names ("" if it is no blob name of key) */
    bool sum_ok;                /* the checksum column is 32 bytes */
    bool gone;                  /* removed by this pass */
};

static int cmp_row(const void *a, const void *b) {
    return memcmp(((const struct row *) a)->key.b, ((const struct row *) b)->key.b, KVT_KEY_BYTES);
}

/* Every row of the index, sorted by key.  OUT *rows (caller frees), *n. */
static int read_rows(kvt_store *st, const char *order, struct row **rows, size_t *n) {
    *rows = NULL;
    *n = 0;
    char sql[256];
    snprintf(sql, sizeof sql,
             "SELECT key, model, size, hits, codec, n_tokens, checksum, created, last_hit, file FROM blocks ORDER BY %s", order);
    pthread_mutex_lock(&st->rd_mu);
    sqlite3_stmt *s;
    int rc = 0;
    if (sqlite3_prepare_v2(st->rd, sql, -1, &s, NULL) != SQLITE_OK) {
        rc = kvt__store_sql_fail(st, st->rd, "listing");
        pthread_mutex_unlock(&st->rd_mu);
        return rc;
    }
    size_t cap = 0;
    int step;
    while ((step = sqlite3_step(s)) == SQLITE_ROW) {
        if (sqlite3_column_bytes(s, 0) != KVT_KEY_BYTES) continue; /* not ours: gc never names it */
        if (*n == cap) {
            cap = cap ? 2 * cap : 256;
            struct row *r = realloc(*rows, cap * sizeof *r);
            if (!r) {
                rc = kvt__fail(KVT_ENOMEM, "store index listing: no memory for %zu rows", cap);
                break;
            }
            *rows = r;
        }
        struct row *r = &(*rows)[(*n)++];
        memset(r, 0, sizeof *r);
        memcpy(r->key.b, sqlite3_column_blob(s, 0), KVT_KEY_BYTES);
        if (sqlite3_column_bytes(s, 1) == KVT_KEY_BYTES) memcpy(r->model.b, sqlite3_column_blob(s, 1), KVT_KEY_BYTES);
        r->size = sqlite3_column_int64(s, 2);
        r->hits = sqlite3_column_int64(s, 3);
        r->codec = sqlite3_column_int(s, 4);
        r->n_tokens = sqlite3_column_int(s, 5);
        r->sum_ok = sqlite3_column_bytes(s, 6) == 32;
        if (r->sum_ok) memcpy(r->sum, sqlite3_column_blob(s, 6), 32);
        r->created = sqlite3_column_double(s, 7);
        r->last_hit = sqlite3_column_double(s, 8);
        const char *f = (const char *) sqlite3_column_text(s, 9);
        kvt_key fk;
        if (f && strlen(f) < sizeof r->file && kvt__sblob_is_blob(f, &fk) && !memcmp(fk.b, r->key.b, KVT_KEY_BYTES))
            strcpy(r->file, f);
    }
    if (!rc && step != SQLITE_DONE) rc = kvt__store_sql_fail(st, st->rd, "listing");
    sqlite3_finalize(s);
    pthread_mutex_unlock(&st->rd_mu);
    if (rc) {
        free(*rows);
        *rows = NULL;
        *n = 0;
    }
    return rc;
}

static int need_disk(kvt_store *st, const char *fn, bool write) {
    if (!st) return kvt__fail(KVT_EINVAL, "%s: store is NULL", fn);
    if (!st->disk) return kvt__fail(KVT_EINVAL, "%s: the store has no disk tier (disk_bytes 0)", fn);
    if (write && st->p.read_only) return kvt__fail(KVT_EINVAL, "%s: the store at %s is open read-only", fn, st->dir);
    return 0;
}

void kvt_store_get_stats(kvt_store *st, struct kvt_store_stats *out) {
    memset(out, 0, sizeof *out);
    if (!st) return;
    out->dir = st->dir;
    kvt__ram_stats(&st->ram, &out->ram);
    pthread_mutex_lock(&st->q_mu);
    struct kvt_store_tier_stats *d = &out->disk;
    d->hits = st->d_hits;
    d->misses = st->d_misses;
    d->writes = st->d_writes;
    d->writes_dropped = st->d_dropped;
    d->evictions = st->d_evictions;
    d->expired = st->d_expired;
    d->corrupt = st->d_corrupt;
    out->queue_len = st->q_len;
    pthread_mutex_unlock(&st->q_mu);
    kvt__pf_stats(st, &out->prefetch);
    kvt_pool_get_stats(st->priv, &out->priv);
    if (st->redis) {
        out->redis_on = true;
        kvt__redis_stats(st->redis, &out->redis, &out->redis_queue_len);
    }
    if (!st->rd) return;
    pthread_mutex_lock(&st->rd_mu);
    sqlite3_stmt *s;
    if (sqlite3_prepare_v2(st->rd, "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM blocks", -1, &s, NULL) == SQLITE_OK) {
        if (sqlite3_step(s) == SQLITE_ROW) {
            d->entries = sqlite3_column_int64(s, 0);
            d->bytes = sqlite3_column_int64(s, 1);
        }
        sqlite3_finalize(s);
    }
    pthread_mutex_unlock(&st->rd_mu);
}

int kvt_store_ls(kvt_store *st, int (*cb)(void *ud, const struct kvt_store_entry *e), void *ud) {
    int rc = need_disk(st, "kvt_store_ls", false);
    if (rc) return rc;
    if (!cb) return kvt__fail(KVT_EINVAL, "kvt_store_ls: callback is NULL");
    struct row *rows;
    size_t n;
    if ((rc = read_rows(st, "last_hit DESC", &rows, &n))) return rc;
    for (size_t i = 0; i < n && !rc; i++) {
        const struct row *r = &rows[i];
        struct kvt_store_entry e = { .key = r->key,
                                     .model = r->model,
                                     .n_tokens = r->n_tokens,
                                     .codec = r->codec,
                                     .bytes = r->size,
                                     .created = r->created,
                                     .last_hit = r->last_hit,
                                     .hits = r->hits,
                                     .expires = kvt__expires(&st->ttl, r->last_hit, r->hits) };
        rc = cb(ud, &e);
    }
    free(rows);
    return rc;
}

/* Remove the rows of keys[0..n) in one transaction (wr_mu), then their files. */
static int remove_rows(kvt_store *st, struct row **victims, size_t n) {
    if (!n) return 0;
    int rc = 0;
    pthread_mutex_lock(&st->wr_mu);
    sqlite3_exec(st->wr, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    for (size_t i = 0; i < n; i++) {
        sqlite3_bind_blob(st->wr_del, 1, victims[i]->key.b, KVT_KEY_BYTES, SQLITE_STATIC);
        sqlite3_bind_null(st->wr_del, 2);
        int s;
        while ((s = sqlite3_step(st->wr_del)) == SQLITE_ROW) {}
        sqlite3_reset(st->wr_del);
        if (s != SQLITE_DONE) {
            rc = kvt__store_sql_fail(st, st->wr, "removing entries");
            break;
        }
    }
    if (rc || sqlite3_exec(st->wr, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        if (!rc) rc = kvt__store_sql_fail(st, st->wr, "removing entries");
        sqlite3_exec(st->wr, "ROLLBACK", NULL, NULL, NULL);
    }
    if (!rc)
        for (size_t i = 0; i < n; i++) st->disk_bytes_now -= victims[i]->size;
    pthread_mutex_unlock(&st->wr_mu);
    if (rc) return rc;
    for (size_t i = 0; i < n; i++) {
        if (victims[i]->file[0]) unlinkat(st->blobs_fd, victims[i]->file, 0);
        victims[i]->gone = true;
    }
    return 0;
}

/* Files of blobs/ without a row (blob names) and temporary files: counted in out->orphans and,
** with remove, unlinked (bytes_freed, removed). */
static int scan_orphans(kvt_store *st, const struct row *rows, size_t n, bool remove, struct kvt_store_report *out) {
    int dfd = openat(st->blobs_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* its own offset */
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    if (!d) {
        if (dfd >= 0) close(dfd);
        return kvt__fail(KVT_EIO, "store directory %s: %s", st->blobs_dir, strerror(errno));
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        struct row probe;
        long pid;
        bool orphan = false;
        if (kvt__sblob_is_blob(de->d_name, &probe.key)) { /* no row of its key names it */
            const struct row *r = n ? bsearch(&probe, rows, n, sizeof *rows, cmp_row) : NULL;
            orphan = !r || strcmp(r->file, de->d_name);
        } else orphan = kvt__sblob_is_tmp(de->d_name, &pid);
        if (!orphan) continue;
        out->orphans++;
        if (!remove) continue;
        struct stat sb;
        int64_t sz = fstatat(st->blobs_fd, de->d_name, &sb, AT_SYMLINK_NOFOLLOW) == 0 ? sb.st_size : 0;
        if (unlinkat(st->blobs_fd, de->d_name, 0) == 0) {
            out->removed++;
            out->bytes_freed += sz;
        }
    }
    closedir(d);
    return 0;
}

int kvt_store_gc(kvt_store *st, struct kvt_store_report *out) {
    if (out) memset(out, 0, sizeof *out);
    int rc = need_disk(st, "kvt_store_gc", true);
    if (rc) return rc;
    if (!out) return kvt__fail(KVT_EINVAL, "kvt_store_gc: report is NULL");
    int lk = kvt__store_lock_all(st);
    struct row *rows = NULL, **victims = NULL;
    size_t n = 0, nv = 0;
    if ((rc = read_rows(st, "key", &rows, &n))) goto done;
    if (n && !(victims = malloc(n * sizeof *victims))) {
        rc = kvt__fail(KVT_ENOMEM, "kvt_store_gc: no memory");
        goto done;
    }
    const double now = kvt__store_now(st);
    /* expired rows, and rows whose file is gone */
    for (size_t i = 0; i < n; i++) {
        struct row *r = &rows[i];
        struct stat sb;
        out->checked++;
        if (kvt__expires(&st->ttl, r->last_hit, r->hits) <= now) {
            out->expired++;
        } else if (!r->file[0] || (fstatat(st->blobs_fd, r->file, &sb, AT_SYMLINK_NOFOLLOW) && errno == ENOENT)) {
            out->missing++;
        } else {
            continue;
        }
        out->bytes_freed += r->size;
        victims[nv++] = r;
    }
    if ((rc = remove_rows(st, victims, nv))) goto done;
    out->removed += (int64_t) nv;
    /* over quota: cold before hot, least recently hit first */
    int64_t total = 0;
    nv = 0;
    for (size_t i = 0; i < n; i++)
        if (!rows[i].gone) {
            total += rows[i].size;
            victims[nv++] = &rows[i];
        }
    if (total > (int64_t) st->p.disk_bytes) {
        struct row **order = victims;
        size_t m = nv;
        /* insertion order is by key; sort the candidates by (hot, last_hit) */
        for (size_t i = 1; i < m; i++) {
            struct row *x = order[i];
            bool xh = x->hits >= st->ttl.hot_hits;
            size_t j = i;
            for (; j > 0; j--) {
                bool yh = order[j - 1]->hits >= st->ttl.hot_hits;
                if (yh < xh || (yh == xh && order[j - 1]->last_hit <= x->last_hit)) break;
                order[j] = order[j - 1];
            }
            order[j] = x;
        }
        size_t k = 0;
        while (k < m && total > (int64_t) st->p.disk_bytes) {
            total -= order[k]->size;
            out->bytes_freed += order[k]->size;
            k++;
        }
        if ((rc = remove_rows(st, order, k))) goto done;
        out->over_quota = (int64_t) k;
        out->removed += (int64_t) k;
    }
    out->ok = out->checked - out->expired - out->missing - out->over_quota;
    rc = scan_orphans(st, rows, n, true, out);
done:
    free(victims);
    free(rows);
    kvt__store_unlock(lk);
    return rc;
}

int kvt_store_verify(kvt_store *st, bool repair, struct kvt_store_report *out) {
    if (out) memset(out, 0, sizeof *out);
    int rc = need_disk(st, "kvt_store_verify", repair);
    if (rc) return rc;
    if (!out) return kvt__fail(KVT_EINVAL, "kvt_store_verify: report is NULL");
    int lk = kvt__store_lock_all(st);
    struct row *rows = NULL, **victims = NULL;
    size_t n = 0, nv = 0;
    if ((rc = read_rows(st, "key", &rows, &n))) goto done;
    if (n && !(victims = malloc(n * sizeof *victims))) {
        rc = kvt__fail(KVT_ENOMEM, "kvt_store_verify: no memory");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        struct row *r = &rows[i];
        struct kvt__sblob_hdr h;
        const char *why = NULL;
        out->checked++;
        int b = r->file[0] ? kvt__sblob_read(st->blobs_fd, r->file, &h, NULL, &why) : KVT__SBLOB_BAD;
        if (b == KVT__SBLOB_NOMEM) {
            rc = kvt__fail(KVT_ENOMEM, "kvt_store_verify: %s", why);
            goto done;
        }
        if (b == KVT__SBLOB_MISSING) {
            out->missing++;
        } else if (b != KVT__SBLOB_OK || memcmp(h.key.b, r->key.b, 32) || memcmp(h.model.b, r->model.b, 32) ||
                   (int64_t) h.size != r->size || h.codec != r->codec || h.n_tokens != r->n_tokens || !r->sum_ok ||
                   memcmp(h.sum, r->sum, 32)) {
            out->corrupt++;
        } else {
            out->ok++;
            continue;
        }
        if (repair) {
            victims[nv++] = r;
            out->bytes_freed += r->size;
        }
    }
    if ((rc = remove_rows(st, victims, nv))) goto done;
    out->removed += (int64_t) nv;
    rc = scan_orphans(st, rows, n, repair, out);
done:
    free(victims);
    free(rows);
    kvt__store_unlock(lk);
    return rc;
}

int kvt_store_clear(kvt_store *st) {
    if (!st) return kvt__fail(KVT_EINVAL, "kvt_store_clear: store is NULL");
    if (st->p.read_only)
        return kvt__fail(KVT_EINVAL, "kvt_store_clear: the store at %s is open read-only", st->dir ? st->dir : "(RAM only)");
    /* queued writes would write entries back after the clear: drop them, wait for the one in flight */
    pthread_mutex_lock(&st->q_mu);
    struct kvt__job *j = st->q_head;
    st->q_head = st->q_tail = NULL;
    st->q_len = 0;
    pthread_mutex_unlock(&st->q_mu);
    while (j) {
        struct kvt__job *nx = j->next;
        kvt__sbuf_unref(j->buf);
        free(j);
        j = nx;
    }
    kvt_store_flush(st);
    kvt__ram_clear(&st->ram);
    if (!st->disk) return 0;
    int lk = kvt__store_lock_all(st);
    int rc = 0;
    pthread_mutex_lock(&st->wr_mu);
    if (sqlite3_exec(st->wr, "DELETE FROM blocks", NULL, NULL, NULL) != SQLITE_OK) rc = kvt__store_sql_fail(st, st->wr, "clearing");
    else st->disk_bytes_now = 0;
    pthread_mutex_unlock(&st->wr_mu);
    if (!rc) {
        struct kvt_store_report scratch = { 0 };
        rc = scan_orphans(st, NULL, 0, true, &scratch); /* every blob and temporary file is an orphan now */
    }
    kvt__store_unlock(lk);
    return rc;
}

int kvt_store_record(kvt_store *st, enum kvt_record_op op, const char *name, const void *data, size_t n, int64_t ttl_s, void **out,
                     size_t *n_out) {
    if (out) *out = NULL;
    if (n_out) *n_out = 0;
    if (!st || !name) return kvt__fail(KVT_EINVAL, "kvt_store_record: NULL %s", !st ? "store" : "name");
    if (!st->redis) return kvt__fail(KVT_EINVAL, "kvt_store_record: the store has no Redis tier (no redis_url)");
    size_t len = strlen(name);
    bool printable = len >= 1 && len <= 200;
    for (size_t i = 0; printable && i < len; i++) printable = name[i] > ' ' && name[i] < 0x7f;
    if (!printable) return kvt__fail(KVT_EINVAL, "kvt_store_record: the name must be 1 to 200 printable bytes without spaces");
    if (op == KVT_RECORD_PUT && ((!data && n) || ttl_s <= 0))
        return kvt__fail(KVT_EINVAL, "kvt_store_record: a put needs data and a ttl_s > 0 (got %lld)", (long long) ttl_s);
    if (op == KVT_RECORD_GET && (!out || !n_out)) return kvt__fail(KVT_EINVAL, "kvt_store_record: a get needs out and n_out");
    if (op != KVT_RECORD_PUT && op != KVT_RECORD_GET && op != KVT_RECORD_DEL)
        return kvt__fail(KVT_EINVAL, "kvt_store_record: unknown op %d", (int) op);
    return kvt__redis_record(st->redis, (int) op, name, data, n, ttl_s, out, n_out);
}

int kvt_store_redis_info(kvt_store *st, struct kvt_store_redis_info *out) {
    if (!st || !out) return kvt__fail(KVT_EINVAL, "kvt_store_redis_info: NULL %s", !st ? "store" : "out");
    if (!st->redis) return kvt__fail(KVT_EINVAL, "kvt_store_redis_info: the store has no Redis tier (no redis_url)");
    return kvt__redis_info(st->redis, out);
}
