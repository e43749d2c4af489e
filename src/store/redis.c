/* redis.c — the block store's Redis tier (kvtier.h section 8; docs/STORE.md "Redis tier"): a
** cache below RAM and disk that several servers share, through hiredis.
**
** Keys are "kvtier:b1:<model fingerprint hex>:<chain key hex>" (b1 = the blob format version);
** values are the bytes of a disk blob file (store_int.h: 128-byte header with key, model,
** sizes and the payload's SHA-256, then the payload), checked on every read as a disk read is:
** a value that fails (garbage, another model's block, truncated) is counted in corrupt, deleted
** and never returned.  Every key is written with EX redis_ttl_s.  Reads ask GETRANGE 0
** redis_max_bytes, not GET: whoever can write the Redis may plant a value of any size, and
** hiredis buffers a whole reply before we see its length, so the reply is bounded at the source
** (a longer value comes back cut at redis_max_bytes + 1 bytes and fails the size check; a missing
** key reads as "", a miss).
**
** Redis is a cache: correctness never depends on it.  A read runs only after RAM and disk
** missed, under a deadline (redis_timeout_ms on connect, send and receive); a timeout or an
** error is a miss (the caller prefills), counted.  After a connection error or a timeout the
** readers back off (100 ms doubling to 5 s, reset by the first success): while backed off a get
** is a miss at once, so a dead Redis costs nothing per request.  Writes never block a caller:
** put queues them (bounded, redis_queue_max; full = dropped) for one writer thread with its own
** connection and its own backoff (its deadline is max(redis_timeout_ms, 1 s): a write is off
** the request path); while backed off it drops what it takes.  Before sending a block the writer
** asks EXPIRE: a key another server already wrote only gets its TTL renewed.
**
** Codec: values hold the blob as the disk tier would (kvt_store_params.disk_codec, encoded on the
** writer thread, decoded after the checks on a read: callers see raw bytes), so the network and
** Redis's memory carry the coded bytes.  A store whose own codec is raw (exact K/V) does not take a
** coded value: a miss, not counted corrupt and not deleted (another server's choice).
**
** Threads: a get takes a connection from a small pool (one per concurrent reader, so no two
** threads ever share a redisContext) and gives it back; the writer owns its own. */
#include "store/store_int.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define POOL_MAX    8
#define BACKOFF_MIN 100  /* ms */
#define BACKOFF_MAX 5000 /* ms */
#define KEY_PREFIX  "kvtier:b1:"

/* ---- URL ------------------------------------------------------------------------------------- */

void kvt__redis_url_redact(const char *url, char *out, size_t n) {
    if (!n) return;
    const char *auth = strstr(url, "://");
    if (!auth) {
        snprintf(out, n, "%s", url);
        return;
    }
    auth += 3;
    size_t alen = strcspn(auth, "/?#");
    const char *at = NULL;
    for (const char *p = auth; p < auth + alen; p++)
        if (*p == '@') at = p;
    if (!at) {
        snprintf(out, n, "%s", url);
        return;
    }
    const char *colon = memchr(auth, ':', (size_t) (at - auth));
    size_t keep = colon ? (size_t) (colon - url) + 1 : (size_t) (auth - url); /* up to the user name */
    snprintf(out, n, "%.*s***%s", (int) keep, url, at);
}

static int url_fail(const char *url, const char *what) {
    char safe[512];
    kvt__redis_url_redact(url, safe, sizeof safe);
    return kvt__fail(KVT_EINVAL,
                     "Redis URL \"%s\": %s (expected redis://[[user:]password@]host[:port][/db] or "
                     "unix:///path[?db=N])",
                     safe, what);
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* Percent-decode s[0..n) into out[cap]; false if malformed or too long. */
static bool pct_decode(const char *s, size_t n, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '%') {
            if (i + 2 >= n) return false;
            int h = hexval(s[i + 1]), l = hexval(s[i + 2]);
            if (h < 0 || l < 0) return false;
            c = (char) (h << 4 | l);
            i += 2;
            if (!c) return false;
        }
        if (o + 1 >= cap) return false;
        out[o++] = c;
    }
    out[o] = '\0';
    return true;
}

/* A decimal integer in [lo, hi] that is all of s[0..n). */
static bool parse_int(const char *s, size_t n, long lo, long hi, int *out) {
    if (n == 0 || n > 9) return false;
    long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return false;
        v = v * 10 + (s[i] - '0');
    }
    if (v < lo || v > hi) return false;
    *out = (int) v;
    return true;
}

int kvt__redis_url_parse(const char *url, struct kvt__redis_url *u) {
    memset(u, 0, sizeof *u);
    u->port = 6379;
    if (!url || !*url) return kvt__fail(KVT_EINVAL, "Redis URL is empty");
    if (!strncmp(url, "unix://", 7)) {
        u->unix_sock = true;
        const char *p = url + 7, *q = strchr(p, '?');
        size_t len = q ? (size_t) (q - p) : strlen(p);
        if (len == 0 || p[0] != '/') return url_fail(url, "the socket path must be absolute");
        if (len >= sizeof u->path) return url_fail(url, "the socket path is too long");
        memcpy(u->path, p, len);
        if (q && (strncmp(q, "?db=", 4) || !parse_int(q + 4, strlen(q + 4), 0, 1 << 20, &u->db)))
            return url_fail(url, "the only query allowed is ?db=N with a database number N");
        return 0;
    }
    if (!strncmp(url, "rediss://", 9)) return url_fail(url, "TLS (rediss://) is not supported");
    if (strncmp(url, "redis://", 8)) return url_fail(url, "unknown scheme");
    const char *auth = url + 8;
    size_t alen = strcspn(auth, "/?#");
    const char *end = auth + alen, *at = NULL;
    for (const char *p = auth; p < end; p++)
        if (*p == '@') at = p;
    const char *host = auth;
    if (at) {
        const char *colon = memchr(auth, ':', (size_t) (at - auth));
        if (colon) {
            if (!pct_decode(auth, (size_t) (colon - auth), u->user, sizeof u->user) ||
                !pct_decode(colon + 1, (size_t) (at - colon - 1), u->pass, sizeof u->pass))
                return url_fail(url, "bad user name or password (percent-encoding, or too long)");
        } else if (!pct_decode(auth, (size_t) (at - auth), u->pass, sizeof u->pass)) { /* as redis-cli -u */
            return url_fail(url, "bad password (percent-encoding, or too long)");
        }
        if (u->user[0] && !u->pass[0]) return url_fail(url, "a user name needs a password");
        host = at + 1;
    }
    const char *hend = end, *port = NULL;
    if (*host == '[') {
        const char *rb = memchr(host, ']', (size_t) (end - host));
        if (!rb) return url_fail(url, "unclosed [ in the host");
        if (rb + 1 < end && rb[1] != ':') return url_fail(url, "text after ] in the host");
        port = rb + 1 < end ? rb + 2 : NULL;
        host++;
        hend = rb;
    } else {
        const char *c = memchr(host, ':', (size_t) (end - host));
        if (c) {
            port = c + 1;
            hend = c;
        }
    }
    if (hend == host) return url_fail(url, "no host");
    if ((size_t) (hend - host) >= sizeof u->host) return url_fail(url, "host name too long");
    memcpy(u->host, host, (size_t) (hend - host));
    if (port && !parse_int(port, (size_t) (end - port), 1, 65535, &u->port))
        return url_fail(url, "the port must be a number from 1 to 65535");
    if (*end == '?' || *end == '#') return url_fail(url, "query strings and fragments are not supported");
    if (*end == '/' && end[1] && !parse_int(end + 1, strlen(end + 1), 0, 1 << 20, &u->db))
        return url_fail(url, "the path must be a database number");
    return 0;
}

int kvt__redis_key(const kvt_key *model, const kvt_key *key, char out[160]) {
    char m[65], k[65];
    kvt_key_hex(model, m);
    kvt_key_hex(key, k);
    return snprintf(out, 160, KEY_PREFIX "%s:%s", m, k);
}

/* ---- the tier -------------------------------------------------------------------------------- */

struct rjob {
    kvt_key key;
    struct kvt_store_meta meta;
    struct kvt__sbuf *buf;
    struct rjob *next;
};

struct backoff {
    double until_ms; /* monotonic: no attempt before */
    int ms;          /* the last wait; 0 = healthy */
};

struct kvt__redis {
    struct kvt__redis_url u;
    char where[300]; /* "host:port/db" or "unix:path/db": messages, never credentials */
    int timeout_ms, w_timeout_ms, ttl_s, queue_max;
    size_t max_bytes;
    char range_end[24]; /* max_bytes in decimal: GETRANGE's last index (a read of max_bytes + 1) */

    struct kvt_codec_params codec; /* the store's disk codec: what a value holds (raw: exact) */

    uint8_t secret[4096]; /* redis_secret_file's bytes (n_secret 0: values not authenticated) */
    size_t n_secret;

    pthread_mutex_t mu; /* pool, readers' backoff, counters */
    redisContext *pool[POOL_MAX];
    int n_pool;
    struct backoff rb;
    int64_t hits, misses, writes, dropped, corrupt, errors, timeouts;

    pthread_mutex_t q_mu; /* queue and writer state */
    pthread_cond_t q_cv, idle_cv;
    struct rjob *q_head, *q_tail;
    int64_t q_len;
    bool busy, stop, started;
    pthread_t thr;
    redisContext *wc;  /* the writer's connection (writer thread only) */
    struct backoff wb; /* the writer's backoff (writer thread only) */
};

static double mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void bump(struct kvt__redis *r, int64_t *ctr, int64_t by) {
    pthread_mutex_lock(&r->mu);
    *ctr += by;
    pthread_mutex_unlock(&r->mu);
}

static void backoff_fail(struct backoff *b) { /* under the lock that guards b */
    b->ms = b->ms ? KVT_MIN(2 * b->ms, BACKOFF_MAX) : BACKOFF_MIN;
    b->until_ms = mono_ms() + b->ms;
}

/* SIGPIPE.  hiredis writes with write(2): a server that closed the connection mid-command (killed,
** or refusing a value past proto-max-bulk-len) would raise SIGPIPE, whose default action kills
** the process.  A library must not change the process's disposition, so a reader (the caller's
** thread) blocks SIGPIPE around its commands and takes back a SIGPIPE they raised; the writer
** thread blocks it for its lifetime.  The write then fails with EPIPE: an error, counted. */
static void pipe_block(sigset_t *old) {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &s, old);
}

static void pipe_restore(const sigset_t *old) {
    if (sigismember(old, SIGPIPE)) return; /* it was blocked already: nothing of ours to undo */
    sigset_t s, pend;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    if (sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE)) {
        const struct timespec zero = { 0, 0 };
        while (sigtimedwait(&s, NULL, &zero) < 0 && errno == EINTR) {}
    }
    pthread_sigmask(SIG_SETMASK, old, NULL);
}

static bool is_timeout(const redisContext *c) {
    return c->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETIMEDOUT ||
                                      strstr(c->errstr, "temporarily unavailable") || strstr(c->errstr, "timed out"));
}

/* A new connection within timeout_ms, authenticated and on its database; NULL (with *timeout
** set when the deadline passed) on any failure. */
static redisContext *dial(struct kvt__redis *r, int timeout_ms, bool *timeout) {
    struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };
    *timeout = false;
    redisContext *c = r->u.unix_sock ? redisConnectUnixWithTimeout(r->u.path, tv)
                                     : redisConnectWithTimeout(r->u.host, r->u.port, tv);
    if (!c) return NULL;
    if (c->err || redisSetTimeout(c, tv) != REDIS_OK) {
        *timeout = is_timeout(c);
        redisFree(c);
        return NULL;
    }
    redisReply *rep = NULL;
    if (r->u.pass[0]) {
        rep = r->u.user[0] ? redisCommand(c, "AUTH %s %s", r->u.user, r->u.pass) : redisCommand(c, "AUTH %s", r->u.pass);
        if (!rep || rep->type == REDIS_REPLY_ERROR) goto bad;
        freeReplyObject(rep);
        rep = NULL;
    }
    if (r->u.db) {
        rep = redisCommand(c, "SELECT %d", r->u.db);
        if (!rep || rep->type == REDIS_REPLY_ERROR) goto bad;
        freeReplyObject(rep);
    }
    return c;
bad:
    *timeout = !rep && is_timeout(c);
    if (rep) freeReplyObject(rep);
    redisFree(c);
    return NULL;
}

/* A reader's connection: pooled, or dialled unless backed off.  NULL: *skipped (backed off) or a
** failure already counted (errors/timeouts), with the backoff started unless the caller is a
** prefetch (speculative: its failures never make the gets skip Redis). */
static redisContext *take(struct kvt__redis *r, bool speculative, bool *pooled, bool *skipped) {
    *skipped = *pooled = false;
    pthread_mutex_lock(&r->mu);
    if (r->rb.ms && mono_ms() < r->rb.until_ms) {
        *skipped = true;
        pthread_mutex_unlock(&r->mu);
        return NULL;
    }
    redisContext *c = r->n_pool ? r->pool[--r->n_pool] : NULL;
    pthread_mutex_unlock(&r->mu);
    if (c) {
        *pooled = true;
        return c;
    }
    bool to;
    c = dial(r, r->timeout_ms, &to);
    if (!c) {
        pthread_mutex_lock(&r->mu);
        if (to) r->timeouts++;
        else r->errors++;
        if (!speculative) backoff_fail(&r->rb);
        pthread_mutex_unlock(&r->mu);
    }
    return c;
}

static void give(struct kvt__redis *r, redisContext *c) {
    pthread_mutex_lock(&r->mu);
    r->rb.ms = 0; /* it answered */
    if (r->n_pool < POOL_MAX) {
        r->pool[r->n_pool++] = c;
        c = NULL;
    }
    pthread_mutex_unlock(&r->mu);
    if (c) redisFree(c);
}

/* A command failed on c (no reply): count, back off, drop the connection (a late reply would
** answer the next command). */
static void broken(struct kvt__redis *r, redisContext *c, bool *was_timeout) {
    bool to = is_timeout(c);
    if (was_timeout) *was_timeout = to;
    pthread_mutex_lock(&r->mu);
    if (to) r->timeouts++;
    else r->errors++;
    backoff_fail(&r->rb);
    pthread_mutex_unlock(&r->mu);
    redisFree(c);
}

int kvt__redis_check_value(const uint8_t *v, size_t n, size_t max_bytes, const kvt_key *key, const kvt_key *model,
                           struct kvt__sblob_hdr *h, const char **why) {
    *why = NULL;
    if (n > max_bytes) {
        *why = "value larger than redis_max_bytes";
        return KVT__SBLOB_BAD;
    }
    int cr = kvt__sblob_check_mem(v, n, h, why);
    if (cr != KVT__SBLOB_OK) return cr;
    *why = memcmp(h->key.b, key->b, KVT_KEY_BYTES)                  ? "value names another key"
           : memcmp(h->model.b, model->b, KVT_KEY_BYTES)            ? "value belongs to another model"
           : h->n_tokens < 0 || h->n_tokens > KVT__REDIS_MAX_TOKENS ? "token count outside 0..2^30"
           : h->codec < 0 || h->codec >= KVT_CODEC__COUNT           ? "unknown codec id"
                                                                    : NULL;
    return *why ? KVT__SBLOB_BAD : KVT__SBLOB_OK;
}

/* With a secret: the value's last 32 bytes must be HMAC-SHA-256(secret, the bytes before them);
** *n_body: the length without them.  0, or -1 with *why (a miss: the caller counts it corrupt).
** Without a secret: *n_body = n. */
static int auth_value(const struct kvt__redis *r, const uint8_t *v, size_t n, size_t *n_body, const char **why) {
    *n_body = n;
    if (!r->n_secret) return 0;
    uint8_t mac[EVP_MAX_MD_SIZE];
    unsigned int ml = 0;
    if (n < KVT__REDIS_MAC) {
        *why = "value without a MAC (redis_secret_file)";
        return -1;
    }
    if (!HMAC(EVP_sha256(), r->secret, (int) r->n_secret, v, n - KVT__REDIS_MAC, mac, &ml) || ml != KVT__REDIS_MAC ||
        CRYPTO_memcmp(mac, v + n - KVT__REDIS_MAC, KVT__REDIS_MAC)) {
        *why = "value's MAC does not match (redis_secret_file)";
        return -1;
    }
    *n_body = n - KVT__REDIS_MAC;
    return 0;
}

static int get_unguarded(struct kvt__redis *r, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                         struct kvt_store_meta *meta, const char **why);

/* The payload of a checked value (header h, body after it) as the raw blob bytes callers see:
** copied, or decoded when coded.  0 (*data, *n, h->codec raw), KVT_ENOMEM, KVT_ENOENT with *coded
** (a coded value and this store keeps raw: a plain miss) or *bad (the codec payload does not
** decode: corrupt). */
static int value_payload(const struct kvt__redis *r, struct kvt__sblob_hdr *h, const uint8_t *body, void **data, size_t *n,
                         bool *coded, const char **bad) {
    *coded = false;
    *bad = NULL;
    if (h->codec == KVT_CODEC_RAW) {
        if (!(*data = malloc(h->size ? (size_t) h->size : 1))) return KVT_ENOMEM;
        memcpy(*data, body, (size_t) h->size);
        *n = (size_t) h->size;
        return 0;
    }
    if (r->codec.codec == KVT_CODEC_RAW) {
        *coded = true;
        return KVT_ENOENT;
    }
    kvt_blob *dec = NULL;
    int rc = kvt_codec_decode(body, (size_t) h->size, &dec);
    if (rc == KVT_ENOMEM) return rc;
    if (rc) {
        *bad = "codec payload does not decode";
        kvt__clear_error();
        return KVT_ENOENT;
    }
    *data = dec->data;
    *n = dec->size;
    dec->data = NULL;
    kvt_blob_free(dec);
    h->codec = KVT_CODEC_RAW;
    h->size = (uint64_t) *n;
    return 0;
}

int kvt__redis_get(struct kvt__redis *r, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                   struct kvt_store_meta *meta, const char **why) {
    sigset_t old;
    pipe_block(&old);
    int rc = get_unguarded(r, key, model, data, n, meta, why);
    pipe_restore(&old);
    return rc;
}

static int get_unguarded(struct kvt__redis *r, const kvt_key *key, const kvt_key *model, void **data, size_t *n,
                         struct kvt_store_meta *meta, const char **why) {
    *data = NULL;
    *n = 0;
    char k[160];
    int klen = kvt__redis_key(model, key, k);
    redisReply *rep = NULL;
    redisContext *c = NULL;
    for (int attempt = 0; attempt < 2; attempt++) { /* a pooled connection may have died idle: one fresh try */
        bool pooled, skipped;
        c = take(r, false, &pooled, &skipped);
        if (!c) {
            *why = skipped ? "Redis backed off after an error" : "Redis unreachable";
            bump(r, &r->misses, 1);
            return KVT_ENOENT;
        }
        rep = redisCommand(c, "GETRANGE %b 0 %s", k, (size_t) klen, r->range_end); /* hiredis knows no %zu */
        if (rep) break;
        if (attempt == 0 && pooled && c->err == REDIS_ERR_EOF) { /* the server closed it while it idled (restart) */
            redisFree(c);
            c = NULL;
            continue;
        }
        bool to;
        broken(r, c, &to);
        *why = to ? "Redis timed out" : "Redis error";
        bump(r, &r->misses, 1);
        return KVT_ENOENT;
    }
    if (!rep) {
        *why = "Redis error";
        bump(r, &r->misses, 1);
        return KVT_ENOENT;
    }
    int rc = KVT_ENOENT;
    if (rep->type == REDIS_REPLY_NIL || (rep->type == REDIS_REPLY_STRING && rep->len == 0)) {
        *why = "not in Redis";
        bump(r, &r->misses, 1);
    } else if (rep->type != REDIS_REPLY_STRING) {
        *why = "Redis answered with an error";
        pthread_mutex_lock(&r->mu);
        r->errors++;
        r->misses++;
        pthread_mutex_unlock(&r->mu);
    } else {
        struct kvt__sblob_hdr h;
        const char *bad = NULL;
        size_t body = 0;
        int cr = auth_value(r, (const uint8_t *) rep->str, rep->len, &body, &bad)
                     ? KVT__SBLOB_BAD
                     : kvt__redis_check_value((const uint8_t *) rep->str, body, r->max_bytes, key, model, &h, &bad);
        bool coded = false;
        if (cr == KVT__SBLOB_NOMEM) {
            rc = KVT_ENOMEM;
            *why = "no memory";
        } else if (!bad && (rc = value_payload(r, &h, (const uint8_t *) rep->str + KVT__SBLOB_HDR, data, n, &coded, &bad)) == 0) {
            *meta = (struct kvt_store_meta){ h.model, h.n_tokens, h.codec };
            bump(r, &r->hits, 1);
        } else if (rc == KVT_ENOMEM) {
            *why = "no memory";
        } else if (coded) { /* another server's codec; this store keeps exact K/V */
            *why = "value is coded (a lossy disk codec) and this store keeps raw blocks";
            bump(r, &r->misses, 1);
        } else {
            *why = bad;
            pthread_mutex_lock(&r->mu);
            r->corrupt++;
            r->misses++;
            pthread_mutex_unlock(&r->mu);
            freeReplyObject(rep);
            rep = redisCommand(c, "DEL %b", k, (size_t) klen); /* never read again; a writer may put it back */
            if (!rep) {
                broken(r, c, NULL);
                return KVT_ENOENT;
            }
        }
    }
    freeReplyObject(rep);
    give(r, c);
    return rc;
}

/* ---- writer ---------------------------------------------------------------------------------- */

void kvt__redis_put(struct kvt__redis *r, const kvt_key *key, const struct kvt_store_meta *m, struct kvt__sbuf *buf) {
    if (!r || !r->started) return;
    struct rjob *j = malloc(sizeof *j);
    pthread_mutex_lock(&r->q_mu);
    bool full = !j || r->q_len >= r->queue_max;
    if (!full) {
        *j = (struct rjob){ .key = *key, .meta = *m, .buf = kvt__sbuf_ref(buf) };
        if (r->q_tail) r->q_tail->next = j;
        else r->q_head = j;
        r->q_tail = j;
        r->q_len++;
        pthread_cond_signal(&r->q_cv);
    }
    pthread_mutex_unlock(&r->q_mu);
    if (full) {
        free(j);
        bump(r, &r->dropped, 1);
    }
}

/* The writer's command: NULL after a failure (counted, connection dropped, backoff started). */
static redisReply *wcommand(struct kvt__redis *r, const char *fmt, const char *k, size_t klen, const void *v, size_t vn) {
    redisReply *rep = v ? redisCommand(r->wc, fmt, k, klen, v, vn, r->ttl_s) : redisCommand(r->wc, fmt, k, klen, r->ttl_s);
    if (rep) return rep;
    bool to = is_timeout(r->wc);
    bump(r, to ? &r->timeouts : &r->errors, 1);
    redisFree(r->wc);
    r->wc = NULL;
    backoff_fail(&r->wb);
    return NULL;
}

static void write_job(struct kvt__redis *r, struct rjob *j) {
    if (!r->wc) {
        if (r->wb.ms && mono_ms() < r->wb.until_ms) { /* backed off: drop, never wait */
            bump(r, &r->dropped, 1);
            return;
        }
        bool to;
        if (!(r->wc = dial(r, r->w_timeout_ms, &to))) {
            bump(r, to ? &r->timeouts : &r->errors, 1);
            bump(r, &r->dropped, 1);
            backoff_fail(&r->wb);
            return;
        }
    }
    /* over the cap: raw bytes are dropped here; a block the codec will take is judged by its
    ** coded size, below (a q4 value is ~0.32x the raw one) */
    const size_t mac = r->n_secret ? KVT__REDIS_MAC : 0;
    const bool to_code = r->codec.codec != KVT_CODEC_RAW && j->meta.codec == KVT_CODEC_RAW;
    if (!to_code && KVT__SBLOB_HDR + j->buf->n + mac > r->max_bytes) {
        bump(r, &r->dropped, 1);
        return;
    }
    char k[160];
    int klen = kvt__redis_key(&j->meta.model, &j->key, k);
    /* another server may have written it: then only renew its TTL */
    redisReply *rep = wcommand(r, "EXPIRE %b %d", k, (size_t) klen, NULL, 0);
    if (!rep) {
        bump(r, &r->dropped, 1);
        return;
    }
    bool present = rep->type == REDIS_REPLY_INTEGER && rep->integer == 1;
    freeReplyObject(rep);
    if (present) {
        r->wb.ms = 0;
        bump(r, &r->writes, 1);
        return;
    }
    /* the codec, here on the writer thread (off the caller's path); a blob it cannot take (not a
    ** block's, a quantised cache) goes raw, as on disk */
    const uint8_t *data = j->buf->data;
    size_t size = j->buf->n;
    int32_t codec = j->meta.codec;
    uint8_t *enc = NULL;
    size_t en = 0;
    kvt__store_encode(&r->codec, data, size, j->meta.n_tokens, &codec, &enc, &en);
    if (enc) {
        data = enc;
        size = en;
    }
    if (KVT__SBLOB_HDR + size + mac > r->max_bytes) {
        free(enc);
        bump(r, &r->dropped, 1);
        return;
    }
    struct kvt__sblob_hdr h = { .key = j->key, .model = j->meta.model, .codec = codec, .n_tokens = j->meta.n_tokens, .size = size };
    size_t vn = 0;
    uint8_t *v = kvt__sblob_checksum(0, data, size, h.sum) ? NULL : kvt__sblob_encode_mem(&h, data, &vn);
    free(enc);
    if (v && r->n_secret) { /* the MAC after the value */
        uint8_t *w = realloc(v, vn + KVT__REDIS_MAC);
        unsigned int ml = 0;
        if (!w || !HMAC(EVP_sha256(), r->secret, (int) r->n_secret, w, vn, w + vn, &ml) || ml != KVT__REDIS_MAC) {
            free(w ? w : v);
            v = NULL;
        } else {
            v = w;
            vn += KVT__REDIS_MAC;
        }
    }
    if (!v) {
        bump(r, &r->dropped, 1);
        return;
    }
    rep = wcommand(r, "SET %b %b EX %d", k, (size_t) klen, v, vn);
    free(v);
    if (!rep) {
        bump(r, &r->dropped, 1);
        return;
    }
    r->wb.ms = 0;
    bool ok = rep->type == REDIS_REPLY_STATUS;
    freeReplyObject(rep);
    pthread_mutex_lock(&r->mu);
    if (ok) {
        r->writes++;
    } else { /* an error reply: OOM under maxmemory noeviction, a read-only replica, ... */
        r->errors++;
        r->dropped++;
    }
    pthread_mutex_unlock(&r->mu);
}

static void *writer_main(void *arg) {
    struct kvt__redis *r = arg;
    sigset_t old;
    pipe_block(&old); /* for the thread's lifetime */
    pthread_mutex_lock(&r->q_mu);
    for (;;) {
        while (!r->q_head && !r->stop) pthread_cond_wait(&r->q_cv, &r->q_mu);
        if (!r->q_head) break;
        struct rjob *j = r->q_head;
        r->q_head = j->next;
        if (!r->q_head) r->q_tail = NULL;
        r->q_len--;
        r->busy = true;
        pthread_mutex_unlock(&r->q_mu);
        write_job(r, j);
        kvt__sbuf_unref(j->buf);
        free(j);
        pthread_mutex_lock(&r->q_mu);
        r->busy = false;
        if (!r->q_head) pthread_cond_broadcast(&r->idle_cv);
    }
    pthread_cond_broadcast(&r->idle_cv);
    pthread_mutex_unlock(&r->q_mu);
    return NULL;
}

void kvt__redis_flush(struct kvt__redis *r) {
    if (!r || !r->started) return;
    pthread_mutex_lock(&r->q_mu);
    while (r->q_head || r->busy) pthread_cond_wait(&r->idle_cv, &r->q_mu);
    pthread_mutex_unlock(&r->q_mu);
}

/* ---- open / close / stats -------------------------------------------------------------------- */

int kvt__redis_open(const struct kvt_store_params *p, struct kvt__redis **out) {
    *out = NULL;
    struct kvt__redis_url u;
    int rc = kvt__redis_url_parse(p->redis_url, &u);
    if (rc) return rc;
    char safe[512];
    kvt__redis_url_redact(p->redis_url, safe, sizeof safe);
    if (p->redis_timeout_ms < 1) return kvt__fail(KVT_EINVAL, "Redis timeout %d ms is below 1 (%s)", p->redis_timeout_ms, safe);
    if (p->redis_ttl_s < 1) return kvt__fail(KVT_EINVAL, "Redis TTL %d s is below 1 (%s)", p->redis_ttl_s, safe);
    if (p->redis_queue_max < 1) return kvt__fail(KVT_EINVAL, "Redis queue_max %d is below 1 (%s)", p->redis_queue_max, safe);
    if (p->redis_max_bytes <= KVT__SBLOB_HDR)
        return kvt__fail(KVT_EINVAL, "Redis max value bytes %zu is not above the %d-byte header (%s)", p->redis_max_bytes,
                         KVT__SBLOB_HDR, safe);
    struct kvt_codec_params codec = kvt_codec_default_params(KVT_CODEC_RAW);
    if (p->disk_codec && kvt_codec_parse(p->disk_codec, &codec)) return kvt__fail(KVT_EINVAL, "Redis tier: %s", kvt_errmsg());
    codec.n_head_kv = p->disk_codec_heads;
    codec.head_bits = p->disk_codec_bits; /* the store's copy: freed after this tier closes */
    codec.n_head_bits = p->disk_codec_bits ? p->n_disk_codec_bits : 0;
    struct kvt__redis *r = calloc(1, sizeof *r);
    if (!r) return kvt__fail(KVT_ENOMEM, "Redis tier: no memory");
    if (p->redis_secret_file) {
        FILE *f = fopen(p->redis_secret_file, "rb");
        size_t got = f ? fread(r->secret, 1, sizeof r->secret, f) : 0;
        bool more = f && fgetc(f) != EOF;
        if (f) fclose(f);
        if (!f || got < 16 || more) {
            rc = kvt__fail(KVT_EINVAL, "Redis secret file '%s': %s", p->redis_secret_file,
                           !f     ? strerror(errno)
                           : more ? "longer than 4096 bytes"
                                  : "shorter than 16 bytes");
            memset(r->secret, 0, sizeof r->secret);
            free(r);
            return rc;
        }
        r->n_secret = got;
    }
    r->u = u;
    if (u.unix_sock) snprintf(r->where, sizeof r->where, "unix:%s/%d", u.path, u.db);
    else snprintf(r->where, sizeof r->where, strchr(u.host, ':') ? "[%s]:%d/%d" : "%s:%d/%d", u.host, u.port, u.db);
    r->timeout_ms = p->redis_timeout_ms;
    r->w_timeout_ms = KVT_MAX(p->redis_timeout_ms, 1000);
    r->ttl_s = p->redis_ttl_s;
    r->queue_max = p->redis_queue_max;
    r->max_bytes = p->redis_max_bytes;
    r->codec = codec;
    snprintf(r->range_end, sizeof r->range_end, "%zu", r->max_bytes);
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->q_mu, NULL);
    pthread_cond_init(&r->q_cv, NULL);
    pthread_cond_init(&r->idle_cv, NULL);
    if (!p->read_only) {
        int err = pthread_create(&r->thr, NULL, writer_main, r);
        if (err) {
            kvt__redis_close(r);
            return kvt__fail(KVT_ENOMEM, "Redis writer thread: %s", strerror(err));
        }
        r->started = true;
    }
    *out = r;
    return 0;
}

void kvt__redis_close(struct kvt__redis *r) {
    if (!r) return;
    if (r->started) {
        pthread_mutex_lock(&r->q_mu);
        r->stop = true;
        pthread_cond_broadcast(&r->q_cv);
        pthread_mutex_unlock(&r->q_mu);
        pthread_join(r->thr, NULL);
    }
    if (r->wc) redisFree(r->wc);
    for (int i = 0; i < r->n_pool; i++) redisFree(r->pool[i]);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->q_mu);
    pthread_cond_destroy(&r->q_cv);
    pthread_cond_destroy(&r->idle_cv);
    memset(r->u.pass, 0, sizeof r->u.pass);
    free(r);
}

void kvt__redis_stats(struct kvt__redis *r, struct kvt_store_tier_stats *o, int64_t *queue_len) {
    pthread_mutex_lock(&r->mu);
    o->hits = r->hits;
    o->misses = r->misses;
    o->writes = r->writes;
    o->writes_dropped = r->dropped;
    o->corrupt = r->corrupt;
    o->errors = r->errors;
    o->timeouts = r->timeouts;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&r->q_mu);
    *queue_len = r->q_len;
    pthread_mutex_unlock(&r->q_mu);
}

static int64_t info_field(const char *info, const char *name) {
    const char *p = strstr(info, name);
    return p ? strtoll(p + strlen(name), NULL, 10) : 0;
}

static int info_unguarded(struct kvt__redis *r, struct kvt_store_redis_info *o);

int kvt__redis_info(struct kvt__redis *r, struct kvt_store_redis_info *o) {
    sigset_t old;
    pipe_block(&old);
    int rc = info_unguarded(r, o);
    pipe_restore(&old);
    return rc;
}

static int info_unguarded(struct kvt__redis *r, struct kvt_store_redis_info *o) {
    memset(o, 0, sizeof *o);
    snprintf(o->server, sizeof o->server, "%.127s", r->where);
    bool to;
    redisContext *c = dial(r, 10000, &to);
    if (!c) return kvt__fail(KVT_EIO, "Redis %s: cannot connect%s", r->where, to ? " (timed out)" : "");
    int rc = 0;
    redisReply *rep = redisCommand(c, "INFO memory");
    if (!rep || rep->type != REDIS_REPLY_STRING) {
        rc = kvt__fail(KVT_EIO, "Redis %s: INFO memory: %s", r->where,
                       rep ? (rep->str ? rep->str : "unexpected reply") : c->errstr);
        goto out;
    }
    o->used_memory = info_field(rep->str, "\nused_memory:");
    o->maxmemory = info_field(rep->str, "\nmaxmemory:");
    freeReplyObject(rep);
    rep = NULL;
    char cursor[32] = "0";
    do {
        rep = redisCommand(c, "SCAN %s MATCH " KEY_PREFIX "* COUNT 1000", cursor);
        if (!rep || rep->type != REDIS_REPLY_ARRAY || rep->elements != 2 || rep->element[0]->type != REDIS_REPLY_STRING) {
            rc = kvt__fail(KVT_EIO, "Redis %s: SCAN: %s", r->where, rep ? "unexpected reply" : c->errstr);
            goto out;
        }
        snprintf(cursor, sizeof cursor, "%s", rep->element[0]->str);
        redisReply *keys = rep->element[1];
        for (size_t i = 0; i < keys->elements; i++)
            redisAppendCommand(c, "STRLEN %b", keys->element[i]->str, (size_t) keys->element[i]->len);
        for (size_t i = 0; i < keys->elements; i++) {
            redisReply *sl = NULL;
            if (redisGetReply(c, (void **) &sl) != REDIS_OK) {
                rc = kvt__fail(KVT_EIO, "Redis %s: STRLEN: %s", r->where, c->errstr);
                goto out;
            }
            if (sl->type == REDIS_REPLY_INTEGER && sl->integer > 0) { /* 0: expired since the SCAN */
                o->keys++;
                o->bytes += sl->integer;
            }
            freeReplyObject(sl);
        }
        freeReplyObject(rep);
        rep = NULL;
    } while (strcmp(cursor, "0"));
out:
    if (rep) freeReplyObject(rep);
    redisFree(c);
    return rc;
}

/* ---- prefetch: pipelined reads ------------------------------------------------------------ */

/* Check one GET reply for keys[i]; 0 with the payload copied out, KVT_ENOENT (nil, error reply,
** bad value: corrupt counted, *del set) or KVT_ENOMEM. */
static int check_reply(struct kvt__redis *r, const redisReply *rep, const kvt_key *key, const kvt_key *model, void **data,
                       size_t *n, struct kvt_store_meta *meta, bool *del) {
    *del = false;
    if (rep->type == REDIS_REPLY_NIL || (rep->type == REDIS_REPLY_STRING && rep->len == 0)) return KVT_ENOENT;
    if (rep->type != REDIS_REPLY_STRING) {
        bump(r, &r->errors, 1);
        return KVT_ENOENT;
    }
    struct kvt__sblob_hdr h;
    const char *bad = NULL;
    size_t body = 0;
    int cr = auth_value(r, (const uint8_t *) rep->str, rep->len, &body, &bad)
                 ? KVT__SBLOB_BAD
                 : kvt__redis_check_value((const uint8_t *) rep->str, body, r->max_bytes, key, model, &h, &bad);
    if (cr == KVT__SBLOB_NOMEM) return KVT_ENOMEM;
    bool coded = false;
    int rc = cr == KVT__SBLOB_OK ? value_payload(r, &h, (const uint8_t *) rep->str + KVT__SBLOB_HDR, data, n, &coded, &bad) : 0;
    if (rc == KVT_ENOMEM) return rc;
    if (cr != KVT__SBLOB_OK || bad) {
        bump(r, &r->corrupt, 1);
        *del = true;
        return KVT_ENOENT;
    }
    if (coded) return KVT_ENOENT; /* another server's codec; this store keeps exact K/V */
    *meta = (struct kvt_store_meta){ h.model, h.n_tokens, h.codec };
    return 0;
}

/* A prefetch's command failed on c: counted like a get's failure, the connection dropped, but no
** backoff: a prefetch is speculative, and a big pipelined batch that passed its deadline on a
** loaded machine must not make the gets that follow skip Redis (their own failure backs off). */
static void broken_pf(struct kvt__redis *r, redisContext *c) {
    bool to = is_timeout(c);
    bump(r, to ? &r->timeouts : &r->errors, 1);
    redisFree(c);
}

static void mget_unguarded(struct kvt__redis *r, int nk, const kvt_key *keys, const kvt_key *models,
                           void (*done)(void *ud, int i, int rc, void *data, size_t n, const struct kvt_store_meta *m), void *ud) {
    int next = 0; /* keys before it have been handed to done */
    bool pooled, skipped;
    redisContext *c = take(r, true, &pooled, &skipped);
    if (!c) goto rest;
    char k[160];
    for (int i = 0; i < nk; i++) { /* appended to hiredis's output buffer: one write for all */
        int klen = kvt__redis_key(&models[i], &keys[i], k);
        if (redisAppendCommand(c, "GETRANGE %b 0 %s", k, (size_t) klen, r->range_end) != REDIS_OK) {
            broken_pf(r, c);
            goto rest;
        }
    }
    bool del_any = false, dels[64] = { false };
    for (; next < nk; next++) { /* each block handed on as its reply arrives */
        redisReply *rep = NULL;
        if (redisGetReply(c, (void **) &rep) != REDIS_OK || !rep) { /* each receive within redis_timeout_ms */
            broken_pf(r, c); /* the rest are misses; a late reply must not answer another command */
            goto rest;
        }
        void *data = NULL;
        size_t n = 0;
        struct kvt_store_meta meta;
        int rc = check_reply(r, rep, &keys[next], &models[next], &data, &n, &meta, &dels[next]);
        del_any |= dels[next];
        freeReplyObject(rep);
        done(ud, next, rc, data, n, &meta);
    }
    for (int i = 0; del_any && i < nk; i++) { /* a bad value is never read again */
        if (!dels[i]) continue;
        int klen = kvt__redis_key(&models[i], &keys[i], k);
        redisReply *rep = redisCommand(c, "DEL %b", k, (size_t) klen);
        if (!rep) {
            broken_pf(r, c);
            return;
        }
        freeReplyObject(rep);
    }
    give(r, c);
    return;
rest: /* not answered (unreachable, backed off, a failure or a timeout) */
    for (; next < nk; next++) done(ud, next, KVT_EIO, NULL, 0, NULL);
}

void kvt__redis_mget(struct kvt__redis *r, int nk, const kvt_key *keys, const kvt_key *models,
                     void (*done)(void *ud, int i, int rc, void *data, size_t n, const struct kvt_store_meta *m), void *ud) {
    sigset_t old;
    pipe_block(&old);
    mget_unguarded(r, nk > 64 ? 64 : nk, keys, models, done, ud);
    for (int i = 64; i < nk; i++) done(ud, i, KVT_EIO, NULL, 0, NULL);
    pipe_restore(&old);
}

/* ---- records (kvt_store_record) -------------------------------------------------------------- */

static int record_unguarded(struct kvt__redis *r, int op, const char *name, const void *data, size_t n, int64_t ttl_s, void **out,
                            size_t *n_out);

int kvt__redis_record(struct kvt__redis *r, int op, const char *name, const void *data, size_t n, int64_t ttl_s, void **out,
                      size_t *n_out) {
    sigset_t old;
    pipe_block(&old);
    int rc = record_unguarded(r, op, name, data, n, ttl_s, out, n_out);
    pipe_restore(&old);
    return rc;
}

static int record_unguarded(struct kvt__redis *r, int op, const char *name, const void *data, size_t n, int64_t ttl_s, void **out,
                            size_t *n_out) {
    char k[220];
    const int klen = snprintf(k, sizeof k, "kvt:rec:%s", name);
    uint8_t *v = NULL;
    size_t vn = n + (r->n_secret ? KVT__REDIS_MAC : 0);
    if (op == KVT_RECORD_PUT) {
        if (vn > r->max_bytes)
            return kvt__fail(KVT_EINVAL, "record '%s' is %zu bytes with its MAC; the Redis tier's values are at most %zu", name, vn,
                             r->max_bytes);
        if (!(v = malloc(vn ? vn : 1))) return kvt__fail(KVT_ENOMEM, "record of %zu bytes", vn);
        if (n) memcpy(v, data, n);
        unsigned int ml = 0;
        if (r->n_secret && (!HMAC(EVP_sha256(), r->secret, (int) r->n_secret, v, n, v + n, &ml) || ml != KVT__REDIS_MAC)) {
            free(v);
            return kvt__fail(KVT_EIO, "record '%s': HMAC-SHA-256 failed", name);
        }
    }
    redisReply *rep = NULL;
    redisContext *c = NULL;
    for (int attempt = 0; attempt < 2 && !rep; attempt++) { /* a pooled connection may have died idle: one fresh try */
        bool pooled, skipped;
        if (!(c = take(r, false, &pooled, &skipped))) {
            free(v);
            return kvt__fail(KVT_EIO, "record '%s': Redis %s %s", name, r->where,
                             skipped ? "backed off after an error" : "unreachable");
        }
        if (op == KVT_RECORD_PUT) rep = redisCommand(c, "SET %b %b EX %lld", k, (size_t) klen, v, vn, (long long) ttl_s);
        else if (op == KVT_RECORD_GET) rep = redisCommand(c, "GETRANGE %b 0 %s", k, (size_t) klen, r->range_end);
        else rep = redisCommand(c, "DEL %b", k, (size_t) klen);
        if (rep) break;
        if (attempt == 0 && pooled && c->err == REDIS_ERR_EOF) {
            redisFree(c);
            c = NULL;
            continue;
        }
        bool to;
        broken(r, c, &to);
        free(v);
        return kvt__fail(KVT_EIO, "record '%s': Redis %s %s", name, r->where, to ? "timed out" : "failed");
    }
    free(v);
    int rc = 0;
    if (!rep) rc = kvt__fail(KVT_EIO, "record '%s': Redis %s failed", name, r->where);
    else if (rep->type == REDIS_REPLY_ERROR) rc = kvt__fail(KVT_EIO, "record '%s': Redis %s: %.200s", name, r->where, rep->str);
    else if (op == KVT_RECORD_DEL && rep->type == REDIS_REPLY_INTEGER && rep->integer == 0) rc = KVT_ENOENT; /* nothing there */
    else if (op == KVT_RECORD_GET) {
        size_t body = 0;
        const char *why = NULL;
        if (rep->type == REDIS_REPLY_NIL || (rep->type == REDIS_REPLY_STRING && rep->len == 0)) rc = KVT_ENOENT;
        else if (rep->type != REDIS_REPLY_STRING) rc = kvt__fail(KVT_EIO, "record '%s': Redis answered no string", name);
        else if (rep->len > r->max_bytes)
            rc = kvt__fail(KVT_EFORMAT, "record '%s' is larger than redis_max_bytes (%zu)", name, r->max_bytes);
        else if (auth_value(r, (const uint8_t *) rep->str, rep->len, &body, &why))
            rc = kvt__fail(KVT_EFORMAT, "record '%s': %s", name, why);
        else if (!(*out = malloc(body ? body : 1))) rc = kvt__fail(KVT_ENOMEM, "record of %zu bytes", body);
        else {
            memcpy(*out, rep->str, body);
            *n_out = body;
        }
        if (rc == KVT_EFORMAT) bump(r, &r->corrupt, 1);
    }
    if (rep) freeReplyObject(rep);
    if (rep) give(r, c);
    else if (c) redisFree(c);
    return rc;
}
