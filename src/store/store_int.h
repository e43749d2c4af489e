/* store_int.h — what the block store's files share (src/store/store*.c, ram.c, blobfile.c):
** the shared payload buffer, the TTL rule, the RAM tier and the blob files.  Never installed. */
#ifndef KVT_STORE_INT_H
#define KVT_STORE_INT_H

#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- payload buffer shared by the RAM tier and the write-behind queue -------------------- */

/* One copy of a put's bytes, reference-counted: the RAM entry and the queued disk write hold a
** reference each, so a put copies the caller's bytes once. */
struct kvt__sbuf {
    atomic_int ref;
    size_t n;
    uint8_t data[];
};
/* New buffer holding a copy of data[0..n) with one reference; NULL on ENOMEM. */
struct kvt__sbuf *kvt__sbuf_new(const void *data, size_t n);
/* New buffer of n bytes, not initialised, with one reference (a reader fills it); NULL on ENOMEM. */
struct kvt__sbuf *kvt__sbuf_alloc(size_t n);
struct kvt__sbuf *kvt__sbuf_ref(struct kvt__sbuf *b);
void kvt__sbuf_unref(struct kvt__sbuf *b); /* accepts NULL */

/* ---- TTL and hot promotion ---------------------------------------------------------------- */

struct kvt__ttl {
    double ttl_s, ttl_hot_s; /* seconds after the last hit (or the write) */
    int32_t hot_hits;        /* hits from which ttl_hot_s applies */
};
/* When an entry last hit (or written) at last_hit with `hits` hits expires (epoch seconds). */
static inline double kvt__expires(const struct kvt__ttl *t, double last_hit, int64_t hits) {
    return last_hit + (hits >= t->hot_hits ? t->ttl_hot_s : t->ttl_s);
}

/* ---- RAM tier (ram.c): a byte-budgeted LRU over a hash table -------------------------------- */

struct kvt__ram_ent;
struct kvt__ram {
    pthread_mutex_t mu;
    size_t budget, bytes;      /* payload bytes allowed / held */
    atomic_size_t reserved;    /* of budget, bytes the store's private entries hold (RAM
                                    ** held by kvt_store_put_private): this tier keeps within
                                    ** budget - reserved, so both share one RAM budget */
    struct kvt__ram_ent **tab; /* hash buckets (chained); key's first 8 bytes as the hash */
    size_t n_buckets, count;
    struct kvt__ram_ent *head, *tail; /* LRU list: head most recently used */
    int64_t hits, misses, writes, writes_dropped, evictions, expired, corrupt;
    size_t pf_bytes;            /* bytes of entries a prefetch promoted that no get has read yet */
    int64_t pf_hits, pf_wasted; /* gets served by such entries / such entries evicted or expired unread */
};

enum { KVT__RAM_HIT = 0, KVT__RAM_MISS, KVT__RAM_EXPIRED, KVT__RAM_FOREIGN };

/* Budget 0 is a disabled tier (every put dropped silently, every get a miss).  Errors: ENOMEM. */
int kvt__ram_init(struct kvt__ram *r, size_t budget);
void kvt__ram_free(struct kvt__ram *r);
/* Insert (taking a reference on buf) unless key is present (an expired entry is replaced).  Least recently used entries leave
** until the new one fits; one larger than the whole budget is not stored (writes_dropped).
** prefetched: a prefetch's promotion, counted in pf_bytes until a get reads it (pf_hits) or it
** leaves unread (pf_wasted).  Returns true if key was already present (nothing changed).
** Thread-safe. */
bool kvt__ram_put(struct kvt__ram *r, const kvt_key *key, const struct kvt_store_meta *m, struct kvt__sbuf *buf,
                  const struct kvt__ttl *t, double now, bool prefetched);
/* Evict least recently used entries until the tier is within budget - reserved (after the
** private entries grew).  Thread-safe. */
void kvt__ram_trim(struct kvt__ram *r);
/* Look up key: a hit copies the bytes out (malloc; *data NULL on ENOMEM with KVT__RAM_HIT and
** *oom set) or, with ref, hands out a reference to the entry's buffer (*ref; *data points into it,
** not to be freed: kvt__sbuf_unref(*ref) instead), counts a hit and makes the entry most recently used; an expired entry is removed
** (expired, miss: KVT__RAM_EXPIRED); model mismatch is KVT__RAM_FOREIGN (corrupt counted, entry kept: it is intact
** and belongs to its own model).  Thread-safe. */
int kvt__ram_get(struct kvt__ram *r, const kvt_key *key, const kvt_key *model, const struct kvt__ttl *t, double now, void **data,
                 size_t *n, struct kvt_store_meta *meta, bool *oom, struct kvt__sbuf **ref);
/* Present and not expired (nothing counted); OUT *on_disk (may be NULL): its disk write was
** queued, or it came from disk (kvt__ram_set_on_disk). */
bool kvt__ram_has(struct kvt__ram *r, const kvt_key *key, const struct kvt__ttl *t, double now, bool *on_disk);
void kvt__ram_set_on_disk(struct kvt__ram *r, const kvt_key *key);
/* Remove everything; returns entries removed. */
int64_t kvt__ram_clear(struct kvt__ram *r);
void kvt__ram_stats(struct kvt__ram *r, struct kvt_store_tier_stats *out);
void kvt__ram_pf_stats(struct kvt__ram *r, int64_t *bytes, int64_t *hits, int64_t *wasted);
size_t kvt__ram_pf_bytes(struct kvt__ram *r);

/* ---- blob files (blobfile.c) ------------------------------------------------------------- */

/* The header of a blob file, 128 bytes, all integers little-endian:
**   0  "KVTBLOCK"          8  u32 format version (1, 2)  12 u32 codec
**   16 key[32]             48 model fingerprint[32]     80 i32 n_tokens   84 u32 0 (reserved)
**   88 u64 payload bytes   96 checksum of the payload[32]               128 payload
** The checksum is the version's: 1 SHA-256; 2 (written since issue #26) XXH3-128 (canonical,
** big-endian) then 16 zero bytes.  It guards against damage (a torn disk, a flipped bit, a
** truncated Redis value), not against a writer: a block's content key is the hash of its
** tokens, not of its bytes, so anyone who can write the store can write any bytes under a key
** with either checksum; Redis values from other servers are authenticated by the HMAC-SHA-256
** of --redis-secret (redis.c).  XXH3 runs at memory speed where SHA-256 (1.3 GB/s with SHA-NI)
** was most of what a warm request from disk cost. */
#define KVT__SBLOB_MAGIC   "KVTBLOCK"
#define KVT__SBLOB_VERSION 2u /* what is written; version 1 is still read */
#define KVT__SBLOB_HDR     128

struct kvt__sblob_hdr {
    uint32_t version; /* as read; 0 when writing: KVT__SBLOB_VERSION */
    kvt_key key, model;
    int32_t codec, n_tokens;
    uint64_t size;
    uint8_t sum[32]; /* the payload's checksum (kvt__sblob_checksum of version) */
};

/* The payload checksum of format version (0: KVT__SBLOB_VERSION) of data[0..n) into out[32].
** Returns 0, or -1 (an unknown version; OpenSSL or xxHash out of memory). */
int kvt__sblob_checksum(uint32_t version, const void *data, size_t n, uint8_t out[32]);

/* File name of one write of key under blobs/: "<64 hex>-<16 hex of gen>.kvb" into
** name[KVT__SBLOB_NAME]; gen 0 is the name stores from before generations gave every block,
** "<64 hex>.kvb" (blobfile.c says why each write has its own name). */
#define KVT__SBLOB_NAME 96
void kvt__sblob_name(const kvt_key *key, uint64_t gen, char name[KVT__SBLOB_NAME]);
/* SHA-256 of data[0..n).  Returns 0, or -1 if OpenSSL failed (no memory). */
int kvt__sha256(const void *data, size_t n, uint8_t out[32]);

/* Write a blob file durably and atomically: "<blobs>/.tmp-<pid>-<hex>-XXXXXX" (O_EXCL, 0600),
** header + payload, fsync, rename to a name of its own (OUT name: key and a new random
** generation), fsync of blobs/.  Returns 0, or the errno of the
** failed step with *what naming it ("create", "write", "fsync", "rename", "fsync of the
** directory", "SHA-256 of"); the temporary file never stays, and on a failed directory fsync the
** renamed file is removed again.  Fault sites: KVT__FAULT_STORE_WRITE (write: ENOSPC),
** KVT__FAULT_STORE_SYNC (the file's fsync, then the rename: EIO). */
int kvt__sblob_write(int blobs_fd, const char *blobs_dir, const struct kvt__sblob_hdr *h, const void *data,
                     char name[KVT__SBLOB_NAME], const char **what);

/* The kill -9 test's control only (kvt_store_test_unsafe_write_order): the file written in place
** under its final name, no temporary file, no fsync, with a 2 ms pause halfway.  Returns 0 or an
** errno.  name: the file's name (kvt__sblob_name). */
int kvt__sblob_write_unsafe(int blobs_fd, const struct kvt__sblob_hdr *h, const void *data, const char name[KVT__SBLOB_NAME]);

enum { KVT__SBLOB_OK = 0, KVT__SBLOB_MISSING, KVT__SBLOB_BAD, KVT__SBLOB_NOMEM, KVT__SBLOB_IOERR };
/* Read and check the blob file `name` in blobs/: magic, version, payload size against the file
** size, and the payload's checksum against the header.  OUT *h; *data (malloc'd payload, at least
** one byte allocated) when data is not NULL (else only the header and checksum are checked).
** Returns KVT__SBLOB_OK, _MISSING (no such file), _BAD (any mismatch, truncation; *why names it),
** _NOMEM or _IOERR (read error other than ENOENT; *why). */
int kvt__sblob_read(int blobs_fd, const char *name, struct kvt__sblob_hdr *h, uint8_t **data, const char **why);
/* kvt__sblob_read, the payload read into a new shared buffer (OUT *sb, one reference; NULL unless
** KVT__SBLOB_OK): what the RAM tier keeps and a get hands out without a copy. */
int kvt__sblob_read_sbuf(int blobs_fd, const char *name, struct kvt__sblob_hdr *h, struct kvt__sbuf **sb, const char **why);

/* The blob file's bytes in memory (header + payload; the Redis tier's values): a new malloc'd
** buffer of *n bytes, or NULL (no memory; *n 0).  h->sum must be the payload's checksum of
** h->version (kvt__sblob_checksum). */
uint8_t *kvt__sblob_encode_mem(const struct kvt__sblob_hdr *h, const void *data, size_t *n);
/* Check a value of n bytes as kvt__sblob_read checks a file: magic, version, payload size
** against n, checksum.  OUT *h (the payload is v + KVT__SBLOB_HDR).  Returns KVT__SBLOB_OK, _BAD
** (*why names the mismatch) or _NOMEM. */
int kvt__sblob_check_mem(const uint8_t *v, size_t n, struct kvt__sblob_hdr *h, const char **why);

/* A tier's codec on a block at rest: a raw block (*codec KVT_CODEC_RAW) of n_tokens, data[0..n),
** encoded with cp into *enc (caller frees) and *codec set to cp's, when cp is not raw and the
** bytes are a block's blob the codec takes; otherwise nothing changes (*enc NULL: store the bytes
** as they are, raw).  Never fails (a refusal or no memory: stored raw); the error state is
** cleared.  Thread-safe (pure).  The disk writer and the Redis writer both call it. */
void kvt__store_encode(const struct kvt_codec_params *cp, const uint8_t *data, size_t n, int32_t n_tokens, int32_t *codec,
                       uint8_t **enc, size_t *en);

/* Is `name` a temporary file of a writer ("<.tmp->pid-...")?  OUT *pid. */
bool kvt__sblob_is_tmp(const char *name, long *pid);
/* Is `name` a blob file name (either form of kvt__sblob_name: no directory part); OUT *key. */
bool kvt__sblob_is_blob(const char *name, kvt_key *key);

/* ---- Redis tier (redis.c) --------------------------------------------------------------------- */

/* A parsed Redis URL (kvt_store_params.redis_url). */
struct kvt__redis_url {
    bool unix_sock;
    char host[256]; /* without [] for IPv6 */
    int port;
    char path[256];            /* unix socket */
    char user[128], pass[256]; /* percent-decoded; "" = none */
    int db;
};
/* Parse "redis://[[user:]password@]host[:port][/db]" or "unix://path[?db=N]".  Errors:
** KVT_EINVAL with a message naming the URL with its password replaced by "***". */
int kvt__redis_url_parse(const char *url, struct kvt__redis_url *out /* OUT */);
/* url with the password replaced by "***" into out[n] (for messages). */
void kvt__redis_url_redact(const char *url, char *out, size_t n);
/* The Redis key of a block: "kvtier:b1:<model hex>:<chain key hex>" into out[160]; returns its
** length.  b1 = blob format version (KVT__SBLOB_VERSION). */
int kvt__redis_key(const kvt_key *model, const kvt_key *key, char out[160]);

struct kvt__redis;
/* Parse the URL and check the params, start the Redis writer thread unless read_only; never
** connects (Redis may be down: the tier is then a counted miss).  Errors: KVT_EINVAL, KVT_ENOMEM. */
int kvt__redis_open(const struct kvt_store_params *p, struct kvt__redis **out /* OUT */);
/* Write out the queue (each write bounded by the write timeout), stop the thread, close.  NULL ok. */
void kvt__redis_close(struct kvt__redis *r);
/* Queue a write of key (taking a reference on buf); a full queue drops it (counted).  Never blocks on the network. */
void kvt__redis_put(struct kvt__redis *r, const kvt_key *key, const struct kvt_store_meta *m, struct kvt__sbuf *buf);
/* The check of a value read from Redis for key and model (a get's and a prefetch's alike; the
** value is untrusted: anyone who can write to the Redis can put bytes there): at most max_bytes,
** a well-formed blob value (kvt__sblob_check_mem: magic, version, size, checksum), naming key and
** model, a token count in 0..KVT__REDIS_MAX_TOKENS and a known codec id.  Returns
** KVT__SBLOB_OK (OUT *h; the payload is v + KVT__SBLOB_HDR, h->size bytes), _BAD (*why names
** the mismatch) or _NOMEM.  Reads only v[0..n).  Pure apart from the checksum. */
#define KVT__REDIS_MAX_TOKENS (1 << 30)
enum { KVT__REDIS_MAC = 32 }; /* bytes of the HMAC-SHA-256 after a value (redis_secret_file) */
int kvt__redis_check_value(const uint8_t *v, size_t n, size_t max_bytes, const kvt_key *key, const kvt_key *model,
                           struct kvt__sblob_hdr *h, const char **why);
/* Look key up within the deadline.  0: *data (malloc), *n, *meta; KVT_ENOENT: miss, timeout,
** error, corrupt or foreign value (*why says which); KVT_ENOMEM.  Counted.  Thread-safe. */
int kvt__redis_get(struct kvt__redis *r, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                   struct kvt_store_meta *meta, const char **why);
/* Prefetch's read: GETs of keys[0..nk) (nk <= 64; more are misses) pipelined on one connection
** (one write, then the replies in order), each value checked as kvt__redis_get checks it (a bad
** one counted in corrupt and deleted).  done(ud, i, rc, data, n, meta) is called once per key, in
** order, as soon as its reply is checked: rc 0 with data (malloc'd, done frees it), n, meta;
** KVT_ENOENT (nil: not in Redis; or a bad value); KVT_EIO (not answered: Redis unreachable or
** backed off, or a failure or a receive that passed redis_timeout_ms, which drops the connection,
** counts an error or timeout and leaves the rest unanswered, without starting the readers'
** backoff: the gets that follow try Redis themselves); KVT_ENOMEM.
** data is NULL unless rc is 0.  Counts no hits or misses (a prefetch is not a get).  Thread-safe. */
void kvt__redis_mget(struct kvt__redis *r, int nk, const kvt_key *keys, const kvt_key *models,
                     void (*done)(void *ud, int i, int rc, void *data, size_t n, const struct kvt_store_meta *m), void *ud);
void kvt__redis_flush(struct kvt__redis *r);
void kvt__redis_stats(struct kvt__redis *r, struct kvt_store_tier_stats *out, int64_t *queue_len);
int kvt__redis_info(struct kvt__redis *r, struct kvt_store_redis_info *out);
/* kvt_store_record on the Redis tier: SET (with the MAC), GETRANGE (capped, MAC checked) or DEL of
** "kvt:rec:" + name, on a reader's connection within redis_timeout_ms.  Returns as
** kvt_store_record.  Thread-safe. */
int kvt__redis_record(struct kvt__redis *r, int op, const char *name, const void *data, size_t n, int64_t ttl_s, void **out,
                      size_t *n_out);

/* ---- the store (store.c: open, put/get, writer; store_gc.c: ls, gc, verify, clear) ----------- */

#include <sqlite3.h>

struct kvt__job { /* a disk write waiting for the writer thread */
    kvt_key key;
    struct kvt_store_meta meta;
    struct kvt__sbuf *buf;
    double t;        /* put time: the row's created */
    double last_hit; /* t, or the last get answered while it waited */
    int64_t hits;    /* gets answered while it waited (record_hit) */
    struct kvt__job *next;
};

struct kvt__hit { /* a get to record in the index (hit count, last hit) */
    kvt_key key;
    double t;
};

struct kvt_store {
    struct kvt_store_params p;      /* p.dir points at dir */
    struct kvt_codec_params dcodec; /* the disk tier's codec (p.disk_codec parsed); RAW = none */
    uint8_t *dbits;                 /* dcodec.head_bits: the store's copy of p.disk_codec_bits, or NULL */
    char *dir, *blobs_dir;
    int blobs_fd; /* DIR/blobs, -1 without a disk tier */
    int lock_fd;  /* DIR/lock: the writer's shared flock per write (gc takes it exclusive) */
    struct kvt__ttl ttl;
    struct kvt__ram ram;
    bool disk; /* disk tier on */

    sqlite3 *rd, *wr; /* readers' connection (rd_mu) and writers' (wr_mu); wr NULL read-only */
    pthread_mutex_t rd_mu, wr_mu;
    sqlite3_stmt *rd_get; /* the row of a key */
    sqlite3_stmt *wr_exists, *wr_ins, *wr_hit, *wr_del;
    void (*on_remove)(void *); /* test hook (kvt_store_test_on_remove): between row and unlink */
    void *on_remove_ud;
    int64_t disk_bytes_now; /* blob bytes in the index as this process last knew (wr_mu) */

    pthread_mutex_t q_mu;   /* queue, hits, writer state, disk counters */
    pthread_cond_t q_cv;    /* wakes the writer */
    pthread_cond_t idle_cv; /* the writer went idle */
    struct kvt__job *q_head, *q_tail;
    int64_t q_len;
    struct kvt__hit *hits;
    size_t n_hits, cap_hits;
    int64_t flush_req; /* flushes waiting: the writer applies hits now */
    bool busy, stop, hold;
    bool unsafe_order; /* test hook: row before file, file written in place (a control) */
    bool writer_started;
    pthread_t writer;
    /* disk tier counters (q_mu) */
    int64_t d_hits, d_misses, d_writes, d_dropped, d_evictions, d_expired, d_corrupt;

    atomic_llong clock_us;    /* test clock (epoch microseconds); 0 = the real clock */
    struct kvt__redis *redis; /* the Redis tier, NULL without one */
    struct kvt__pf *pf;       /* prefetch threads and queue (prefetch.c), NULL without them */
    kvt_pool *priv;           /* private entries (store_private.c): sessions' own copies */
};

/* Open the private entries' pool (store_private.c).  Errors: those of kvt_pool_open. */
int kvt__store_priv_open(kvt_store *st);

/* Now, in epoch seconds (the test clock when set). */
double kvt__store_now(kvt_store *st);
/* SQLite failure -> KVT_EIO naming the store's index and SQLite's message. */
int kvt__store_sql_fail(kvt_store *st, sqlite3 *db, const char *what);
/* Remove the index row of key that names `file`, then that file (wr_mu taken inside; a row of a
** fresher write names another file and stays).  Returns the bytes freed or -1 if no such row. */
int64_t kvt__store_remove(kvt_store *st, const kvt_key *key, const char *file);
/* store_index.c: open the index's connections (the writer's only for a writable store), create
** or check the schema, prepare the statements.  Returns 0 or KVT_EIO naming the step. */
int kvt__store_index_open(kvt_store *st);
/* Payload bytes the index's rows hold (0 if it cannot be read). */
int64_t kvt__store_sum_sizes(sqlite3 *db);
/* store_writer.c: the writer thread's body (arg: the store), started by kvt_store_open. */
void *kvt__store_writer_main(void *arg);
/* Is a write of key waiting in the queue (q_mu held)? */
bool kvt__store_key_queued(kvt_store *st, const kvt_key *key);
/* Record a get's hit for the index (applied by the writer in batches; a queued write of key gets
** it in its row).  Takes q_mu. */
void kvt__store_record_hit(kvt_store *st, const kvt_key *key, double now);
/* Flock DIR/lock exclusively (gc, verify, clear: no write of any process is half done while it
** is held).  Returns the fd to release with kvt__store_unlock, or -1 (no lock file). */
int kvt__store_lock_all(kvt_store *st);
void kvt__store_unlock(int fd);

/* The local tiers' get (pf NULL) or a prefetch's read of them (pf: see store.c; nothing is
** handed out, *data stays NULL); expiry by ttl (&st->ttl; kvt__ttl_forever for a session's own
** copy).  ref NULL: *data is the caller's (free()); ref set: *ref holds a reference to the shared
** buffer *data points into (kvt__sbuf_unref; a RAM hit, a queued write and a disk read when the
** RAM tier is on are handed out without a copy). */
int kvt__store_get_local(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                         struct kvt_store_meta *meta, enum kvt_tier *tier, int *pf, const struct kvt__ttl *ttl,
                         struct kvt__sbuf **ref);
/* A TTL under which nothing expires. */
extern const struct kvt__ttl kvt__ttl_forever;
/* RAM + disk (+ Redis when to_redis); prefetched: the RAM entry is a prefetch's promotion. */
int kvt__store_put_local(kvt_store *st, const kvt_key *key, const struct kvt_store_meta *m, const void *data, size_t n,
                         bool to_redis, bool prefetched);

/* ---- prefetch (prefetch.c) ----------------------------------------------------------------- */

/* What a prefetch of a key did (a get waiting for it acts on this). */
enum {
    KVT__PF_NONE = 0, /* no prefetch of the key was queued or in flight */
    KVT__PF_PROMOTED, /* now in RAM (marked prefetched) */
    KVT__PF_ABSENT,   /* no tier holds it (not stored, expired, another model's; Redis missed) */
    KVT__PF_SKIPPED,  /* not read (already in RAM or queued for disk, over prefetch_bytes, Redis
                         ** did not answer in time): the get reads it itself */
    KVT__PF_FAILED
}; /* read and refused (corrupt, counted; injected fault), or no memory */

/* Start the prefetch threads (none when prefetch_threads is 0, there is no RAM tier or nothing
** below it).  Errors: KVT_ENOMEM.  kvt__pf_stop joins them and drops the queue; NULL-safe. */
int kvt__pf_start(kvt_store *st);
void kvt__pf_stop(kvt_store *st);
/* Before a get of key: a queued prefetch of it is taken back (the get reads it itself); one in
** flight is waited for.  Returns what that prefetch did, KVT__PF_NONE if there was none. */
int kvt__pf_wait(kvt_store *st, const kvt_key *key);
void kvt__pf_stats(kvt_store *st, struct kvt_store_prefetch_stats *out);

#endif
