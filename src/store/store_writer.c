/* store_writer.c — the block store's write side: put (RAM tier, write-behind queue, Redis), the
** writer thread (blob file, then index row; the disk quota's eviction; replaced rows' files) and
** the hits gets record, applied in batches.  store.c says how the parts fit together. */
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

#define HITS_MAX   4096 /* pending hit records; more are not recorded (advisory counts) */
#define HITS_BATCH 256  /* wake the writer at this many */

/* ---- put / get / has ------------------------------------------------------------------------ */

bool kvt__store_key_queued(kvt_store *st, const kvt_key *key) { /* q_mu held */
    for (struct kvt__job *j = st->q_head; j; j = j->next)
        if (!memcmp(j->key.b, key->b, KVT_KEY_BYTES)) return true;
    return false;
}

/* RAM + disk (+ Redis when to_redis: a block that came from Redis is not sent back). */
int kvt__store_put_local(kvt_store *st, const kvt_key *key, const struct kvt_store_meta *m, const void *data, size_t n,
                         bool to_redis, bool prefetched) {
    if (!st || !key || !m || (!data && n > 0))
        return kvt__fail(KVT_EINVAL, "kvt_store_put: NULL %s", !st ? "store" : !key ? "key" : !m ? "meta" : "data");
    if (st->p.read_only)
        return kvt__fail(KVT_EINVAL, "kvt_store_put: the store at %s is open read-only", st->dir ? st->dir : "(RAM only)");
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
        if (kvt__store_key_queued(st, key)) {
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
            if (st->q_tail) st->q_tail->next = j;
            else st->q_head = j;
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

void kvt__store_record_hit(kvt_store *st, const kvt_key *key, double now) {
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
    const int64_t quota = (int64_t) st->p.disk_bytes;
    if (need > quota) return false;
    if (st->disk_bytes_now + need <= quota) return true;
    st->disk_bytes_now = kvt__store_sum_sizes(st->wr); /* other processes may have written or removed */
    sqlite3_stmt *sel;
    if (sqlite3_prepare_v2(st->wr,
                           "SELECT key, size, last_hit + CASE WHEN hits >= ?1 THEN ?2 ELSE ?3 END <= ?4, file FROM blocks "
                           "ORDER BY 3 DESC, hits >= ?1, last_hit LIMIT 256",
                           -1, &sel, NULL) != SQLITE_OK)
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
            const char *f = (const char *) sqlite3_column_text(sel, 3);
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
static bool row_file(kvt_store *st, const kvt_key *key, char old[KVT__SBLOB_NAME], int64_t *size, double *last_hit, int64_t *hits) {
    old[0] = '\0';
    sqlite3_bind_blob(st->wr_exists, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
    bool have = sqlite3_step(st->wr_exists) == SQLITE_ROW;
    if (have) {
        const char *f = (const char *) sqlite3_column_text(st->wr_exists, 2);
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
        sqlite3_bind_int64(s, 3, (sqlite3_int64) h->size);
        sqlite3_bind_int(s, 4, h->codec);
        sqlite3_bind_blob(s, 5, h->sum, 32, SQLITE_STATIC);
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
    if (ok) st->disk_bytes_now += (int64_t) h->size - old_size;
    pthread_mutex_unlock(&st->wr_mu);
    kvt_key k;
    if (ok && old[0] && strcmp(old, name) && kvt__sblob_is_blob(old, &k)) unlinkat(st->blobs_fd, old, 0);
    return ok;
}

void kvt__store_encode(const struct kvt_codec_params *cp, const uint8_t *data, size_t n, int32_t n_tokens, int32_t *codec,
                       uint8_t **enc, size_t *en) {
    *enc = NULL;
    *en = 0;
    if (*codec != KVT_CODEC_RAW || cp->codec == KVT_CODEC_RAW) return;
    kvt_blob raw = { (uint8_t *) data, n, 0, n_tokens, 0, 0 };
    /* not a block's blob, or one the codec refuses (a quantised cache): stored raw */
    if (kvt__blob_shape(&raw) == 0 && kvt_codec_encode(&raw, cp, enc, en, NULL) == 0) *codec = cp->codec;
    else *enc = NULL;
    kvt__clear_error();
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
    char old[KVT__SBLOB_NAME];
    double last_hit = 0;
    int64_t hits = 0;
    /* an expired row is no copy for lookups: skipping the fresh write for it (while the RAM tier
    ** records the block as on disk) lost the block (issue #24 item 7).  The fresh row replaces it
    ** (insert_row), and its file goes; until then it is still the session's copy. */
    if (row_file(st, &j->key, old, NULL, &last_hit, &hits)) skipped = kvt__expires(&st->ttl, last_hit, hits) > now;
    bool room = skipped || make_room(st, (int64_t) j->buf->n, now);
    pthread_mutex_unlock(&st->wr_mu);
    /* the disk tier's codec, here on the writer thread (off the decode path) */
    const uint8_t *data = j->buf->data;
    size_t size = j->buf->n;
    int32_t codec = j->meta.codec;
    uint8_t *enc = NULL;
    size_t en = 0;
    if (!skipped && room) kvt__store_encode(&st->dcodec, data, size, j->meta.n_tokens, &codec, &enc, &en);
    if (enc) {
        data = enc;
        size = en;
    }
    if (!skipped && room) {
        struct kvt__sblob_hdr h = {
            .key = j->key, .model = j->meta.model, .codec = codec, .n_tokens = j->meta.n_tokens, .size = size
        };
        const char *what = NULL;
        char name[KVT__SBLOB_NAME];
        if (kvt__sblob_checksum(0, data, size, h.sum) != 0) {
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

void *kvt__store_writer_main(void *arg) {
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
