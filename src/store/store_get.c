/* store_get.c — the block store's read side: get through RAM, the write queue, the disk tier
** (index row, blob file, checksum, codec) and Redis; has and tier.  A get never writes the index
** except to remove a corrupt entry; its hits go to the writer (store_writer.c). */
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

static void count(kvt_store *st, int64_t *ctr) {
    pthread_mutex_lock(&st->q_mu);
    (*ctr)++;
    pthread_mutex_unlock(&st->q_mu);
}

/* A block still waiting for the writer is the disk tier's too: copy it out (q_mu held). */
static int get_queued(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n, struct kvt_store_meta *meta,
                      bool *found, struct kvt__sbuf **ref) {
    *found = false;
    for (struct kvt__job *j = st->q_head; j; j = j->next) {
        if (memcmp(j->key.b, key->b, KVT_KEY_BYTES)) continue;
        *found = true;
        if (memcmp(j->meta.model.b, model->b, KVT_KEY_BYTES)) {
            st->d_corrupt++;
            st->d_misses++;
            return KVT_ENOENT;
        }
        if (ref) {
            *ref = kvt__sbuf_ref(j->buf);
            *data = j->buf->data;
        } else {
            if (!(*data = malloc(j->buf->n ? j->buf->n : 1))) return KVT_ENOMEM;
            if (j->buf->n) memcpy(*data, j->buf->data, j->buf->n);
        }
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
                         struct kvt_store_meta *meta, enum kvt_tier *tier, int *pf, const struct kvt__ttl *ttl,
                         struct kvt__sbuf **ref) {
    if (ref) *ref = NULL;
    if (data) *data = NULL;
    if (n) *n = 0;
    if (tier) *tier = KVT_TIER_NONE;
    if (!st || !key || !model || !data || !n)
        return kvt__fail(KVT_EINVAL, "kvt_store_get: NULL %s",
                         !st      ? "store"
                         : !key   ? "key"
                         : !model ? "model fingerprint"
                                  : "data or n");
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
        found = kvt__store_key_queued(st, key);
        pthread_mutex_unlock(&st->q_mu);
        if (found) { /* waiting for the writer: RAM holds it, or held it moments ago */
            *pf = KVT__PF_SKIPPED;
            return KVT_ENOENT;
        }
        goto index;
    }
    int r = kvt__ram_get(&st->ram, key, model, ttl, now, data, n, &mt, &oom, ref);
    if (r == KVT__RAM_HIT) {
        if (oom) return kvt__fail(KVT_ENOMEM, "kvt_store_get: no memory for block %.16s", hex);
        kvt__store_record_hit(st, key, now);
        if (meta) *meta = mt;
        if (tier) *tier = KVT_TIER_RAM;
        return 0;
    }
    if (r == KVT__RAM_FOREIGN) return kvt__fail(KVT_ENOENT, "block %.16s belongs to another model", hex);
    if (!st->disk) return kvt__fail(KVT_ENOENT, "block %.16s %s", hex, r == KVT__RAM_EXPIRED ? "expired" : "is not stored");

    pthread_mutex_lock(&st->q_mu);
    int rc = get_queued(st, key, model, data, n, &mt, &found, ref);
    pthread_mutex_unlock(&st->q_mu);
    if (found) {
        if (rc)
            return rc == KVT_ENOMEM ? kvt__fail(rc, "kvt_store_get: no memory for block %.16s", hex)
                                    : kvt__fail(rc, "block %.16s belongs to another model", hex);
        kvt__store_record_hit(st, key, now);
        if (meta) *meta = mt;
        if (tier) *tier = KVT_TIER_DISK;
        return 0;
    }

index:;
    struct {
        int64_t size, hits;
        int32_t codec, n_tokens;
        uint8_t sum[32];
        kvt_key model;
        double last_hit;
        char file[KVT__SBLOB_NAME];
    } row;
    pthread_mutex_lock(&st->rd_mu);
    sqlite3_bind_blob(st->rd_get, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
    int s = sqlite3_step(st->rd_get);
    bool have = s == SQLITE_ROW && sqlite3_column_bytes(st->rd_get, 3) == 32 && sqlite3_column_bytes(st->rd_get, 4) == 32;
    if (have) {
        const char *f = (const char *) sqlite3_column_text(st->rd_get, 0);
        snprintf(row.file, sizeof row.file, "%s", f ? f : "");
        row.size = sqlite3_column_int64(st->rd_get, 1);
        row.codec = sqlite3_column_int(st->rd_get, 2);
        memcpy(row.sum, sqlite3_column_blob(st->rd_get, 3), 32);
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
    struct kvt__sbuf *sb = NULL; /* the bytes read, shared with the RAM tier (no copy into it) */
    kvt_key fk;
    if (!kvt__sblob_is_blob(row.file, &fk) || memcmp(fk.b, key->b, KVT_KEY_BYTES)) {
        kvt__store_remove(st, key, row.file);
        return miss(st, &st->d_corrupt, "the index names a file of another key", hex, pf);
    }
    const bool shared = ref || pf || st->ram.budget;
    r = shared ? kvt__sblob_read_sbuf(st->blobs_fd, row.file, &h, &sb, &why)
               : kvt__sblob_read(st->blobs_fd, row.file, &h, &buf, &why);
    if (r == KVT__SBLOB_NOMEM) return kvt__fail(KVT_ENOMEM, "kvt_store_get: block %.16s: %s", hex, why);
    if (r == KVT__SBLOB_OK) {
        if (sb) buf = sb->data;
        why = memcmp(h.key.b, key->b, 32)          ? "header names another key"
              : memcmp(h.model.b, row.model.b, 32) ? "header names another model"
              : (int64_t) h.size != row.size || h.codec != row.codec || h.n_tokens != row.n_tokens
                  ? "header disagrees with the index"
              : memcmp(h.sum, row.sum, 32) ? "checksum disagrees with the index"
                                           : NULL;
        char dec_why[512];
        if (!why && h.codec != KVT_CODEC_RAW) { /* the disk tier's codec: callers see raw bytes */
            kvt_blob *dec = NULL;
            int drc = kvt_codec_decode(buf, (size_t) h.size, &dec);
            if (sb) kvt__sbuf_unref(sb);
            else free(buf);
            buf = NULL;
            sb = NULL;
            if (drc == KVT_ENOMEM) return kvt__fail(KVT_ENOMEM, "kvt_store_get: decoding block %.16s", hex);
            if (drc) {
                snprintf(dec_why, sizeof dec_why, "codec payload does not decode (%s)", kvt_errmsg());
                why = dec_why;
            } else {
                h.size = dec->size;
                h.codec = KVT_CODEC_RAW;
                row.codec = KVT_CODEC_RAW;
                if (shared) { /* the decoded bytes are what RAM keeps */
                    sb = kvt__sbuf_new(dec->data, dec->size);
                    kvt_blob_free(dec);
                    if (!sb) return kvt__fail(KVT_ENOMEM, "kvt_store_get: decoding block %.16s", hex);
                    buf = sb->data;
                } else {
                    buf = dec->data;
                    dec->data = NULL;
                    kvt_blob_free(dec);
                }
            }
        }
        if (!why) {
            const struct kvt_store_meta m = { row.model, row.n_tokens, row.codec };
            if (st->ram.budget) { /* a disk hit goes into RAM: the buffer read, shared */
                kvt__ram_put(&st->ram, key, &m, sb, &st->ttl, now, pf != NULL);
                kvt__ram_set_on_disk(&st->ram, key);
            }
            if (pf) {
                *pf = KVT__PF_PROMOTED;
                kvt__sbuf_unref(sb);
                return 0;
            }
            kvt__store_record_hit(st, key, now);
            count(st, &st->d_hits);
            if (ref) {
                *ref = sb;
                *data = sb->data;
            } else if (sb) { /* the caller's own copy */
                *data = malloc(h.size ? (size_t) h.size : 1);
                if (*data && h.size) memcpy(*data, sb->data, (size_t) h.size);
                kvt__sbuf_unref(sb);
                if (!*data) return kvt__fail(KVT_ENOMEM, "kvt_store_get: no memory for block %.16s", hex);
            } else {
                *data = buf;
            }
            *n = (size_t) h.size;
            if (meta) *meta = m;
            if (tier) *tier = KVT_TIER_DISK;
            return 0;
        }
        if (sb) kvt__sbuf_unref(sb);
        else free(buf);
    } else if (r == KVT__SBLOB_MISSING) {
        /* evicted between the lookup and the open is an ordinary miss; a row left without its
        ** file is not */
        pthread_mutex_lock(&st->rd_mu);
        sqlite3_bind_blob(st->rd_get, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
        bool still = sqlite3_step(st->rd_get) == SQLITE_ROW;
        if (still) { /* the same write's row: a fresh one names another file */
            const char *f = (const char *) sqlite3_column_text(st->rd_get, 0);
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
static int get_tiers(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n, struct kvt_store_meta *meta,
                     enum kvt_tier *tier, const struct kvt__ttl *ttl, struct kvt__sbuf **ref) {
    /* a prefetch of key in flight is waited for (never read twice); one that found no tier
    ** holding it spares the get Redis's round trip, not the local tiers: the key may have been
    ** put since the prefetch looked */
    const bool pf_absent = st && key && model && data && n && kvt__pf_wait(st, key) == KVT__PF_ABSENT;
    int rc = kvt__store_get_local(st, key, model, data, n, meta, tier, NULL, ttl, ref);
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
    if (ref) { /* handed out like the local tiers' bytes (a Redis hit pays this copy) */
        if (!(*ref = kvt__sbuf_new(*data, *n))) {
            free(*data);
            *data = NULL;
            *n = 0;
            return kvt__fail(KVT_ENOMEM, "kvt_store_get: no memory for block %.16s from Redis", hex);
        }
        free(*data);
        *data = (*ref)->data;
    }
    if (meta) *meta = mt;
    if (tier) *tier = KVT_TIER_REDIS;
    return 0;
}

int kvt_store_get(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n, struct kvt_store_meta *meta,
                  enum kvt_tier *tier) {
    return get_tiers(st, key, model, data, n, meta, tier, st ? &st->ttl : NULL, NULL);
}

int kvt__store_get_ref(kvt_store *st, const kvt_key *key, const kvt_key *model, const void **data, size_t *n,
                       struct kvt_store_meta *meta, void **ref) {
    void *d = NULL;
    struct kvt__sbuf *sb = NULL;
    int rc = get_tiers(st, key, model, &d, n, meta, NULL, st ? &st->ttl : NULL, &sb);
    *data = d;
    *ref = sb;
    return rc;
}

void kvt__store_ref_free(void *ref) { kvt__sbuf_unref(ref); }

int kvt_store_get_copy(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n) {
    return get_tiers(st, key, model, data, n, NULL, NULL, &kvt__ttl_forever, NULL);
}

/* Where key's bytes are under ttl: RAM (or its write queued), disk, none. */
static int tier_of(kvt_store *st, const kvt_key *key, const struct kvt__ttl *ttl) {
    if (!st || !key) return KVT_TIER_NONE;
    if (kvt__ram_has(&st->ram, key, ttl, kvt__store_now(st), NULL)) return KVT_TIER_RAM;
    if (!st->disk) return KVT_TIER_NONE;
    pthread_mutex_lock(&st->q_mu);
    bool has = kvt__store_key_queued(st, key);
    pthread_mutex_unlock(&st->q_mu);
    if (has) return KVT_TIER_RAM; /* its bytes wait in the write queue */
    pthread_mutex_lock(&st->rd_mu);
    sqlite3_bind_blob(st->rd_get, 1, key->b, KVT_KEY_BYTES, SQLITE_STATIC);
    if (sqlite3_step(st->rd_get) == SQLITE_ROW)
        has = kvt__expires(ttl, sqlite3_column_double(st->rd_get, 6), sqlite3_column_int64(st->rd_get, 7)) > kvt__store_now(st);
    sqlite3_reset(st->rd_get);
    pthread_mutex_unlock(&st->rd_mu);
    return has ? KVT_TIER_DISK : KVT_TIER_NONE;
}

int kvt_store_tier(kvt_store *st, const kvt_key *key) { return tier_of(st, key, &kvt__ttl_forever); }

bool kvt_store_has(kvt_store *st, const kvt_key *key) { return st && tier_of(st, key, &st->ttl) != KVT_TIER_NONE; }
