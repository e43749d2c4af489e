/* respdb.c — stored responses on disk: the Responses API's conversations outlive the process.
**
** Every stored response (its turn: the input items as chat messages and the reply; its Response
** object; its parent's id; the tenant of its API key; created-at and expiry) is one row of the
** table `responses` in the block store's SQLite index (<store>/index.db, WAL; the store's own
** tables are untouched), written in one transaction when the reply is done, so that a reader (this
** server after a restart, another server on the same directory) finds it whole or not at all.
** The RAM table of responses.c stays in front as the cache: a response missing there is read
** here, and every one written there is written here.
**
** Expiry: by TTL (--response-ttl, seconds from its creation; 0: never) and by a per-tenant quota
** (--response-quota rows of one API key; past it the key's least recently used go: a response and
** its ancestors are "used" whenever it is stored or continued, ancestors after it, so a
** conversation's chain outlives its leaves).  DELETE removes the row (a descendant then fails with
** "earlier in the conversation ... was deleted", as in RAM).
**
** Integrity: each row carries HMAC-SHA-256 over its tenant, id, parent, times and body under the
** server's secret (--redis-secret-file when given, so that servers sharing Redis share it; else
** <store>/server-secret, the tenants' secret, created at the first start).  A row whose MAC does
** not match is never served: the lookup fails with that reason (logged), and `kvtier store verify`
** counts it (--repair removes it).  Reads are size-capped (RESPDB_MAX_BODY).
**
** Thread-safety: one connection behind a mutex; every function may be called from any thread. */
#include "serve.h"
#include "sched.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { RESPDB_MAX_BODY = 64 << 20, RESPDB_MAC = 32 };

static const char SCHEMA[] = "CREATE TABLE IF NOT EXISTS responses("
                             " ns TEXT NOT NULL,"         /* the tenant of the API key ("" without keys) */
                             " id TEXT NOT NULL,"         /* resp_<32 hex> */
                             " parent TEXT NOT NULL,"     /* previous_response_id, "" for a first turn */
                             " created INTEGER NOT NULL," /* unix seconds */
                             " expires INTEGER NOT NULL," /* unix seconds; 0: never */
                             " used INTEGER NOT NULL,"    /* least recently used order within a tenant (larger: more recent) */
                             " body BLOB NOT NULL,"       /* JSON {"turn": [chat messages], "object": {Response}} */
                             " mac BLOB NOT NULL,"        /* HMAC-SHA-256, see row_mac */
                             " shared INTEGER NOT NULL,"  /* 1: written to (or read from) Redis, where a DELETE elsewhere shows */
                             " PRIMARY KEY(ns, id)) WITHOUT ROWID;"
                             "CREATE INDEX IF NOT EXISTS responses_lru ON responses(ns, used);"
                             "CREATE INDEX IF NOT EXISTS responses_ttl ON responses(expires) WHERE expires > 0;";

static pthread_mutex_t db_mu = PTHREAD_MUTEX_INITIALIZER;
static sqlite3 *db;
static unsigned char secret[4096];
static size_t n_secret;
static int64_t used_ctr, ttl_s, quota;
static kvt_store *rstore; /* the store, when it has a Redis tier: every row is there too */

static int64_t now_s(void) { return (int64_t) time(NULL); }

/* HMAC-SHA-256(key, ns 0 id 0 parent 0 created expires body), times as 8 bytes little-endian. */
static bool row_mac(const unsigned char *key, size_t n_key, const char *ns, const char *id, const char *parent, int64_t created,
                    int64_t expires, const void *body, size_t n_body, unsigned char out[RESPDB_MAC]) {
    const size_t a = strlen(ns) + 1, b = strlen(id) + 1, c = strlen(parent) + 1, n = a + b + c + 16 + n_body;
    unsigned char *m = malloc(n), *w = m;
    if (!m) return false;
    memcpy(w, ns, a), w += a;
    memcpy(w, id, b), w += b;
    memcpy(w, parent, c), w += c;
    for (int i = 0; i < 8; i++) {
        w[i] = (unsigned char) ((uint64_t) created >> (8 * i));
        w[8 + i] = (unsigned char) ((uint64_t) expires >> (8 * i));
    }
    w += 16;
    if (n_body) memcpy(w, body, n_body);
    unsigned int got = 0;
    bool ok = HMAC(EVP_sha256(), key, (int) n_key, m, n, out, &got) && got == RESPDB_MAC;
    free(m);
    return ok;
}

static int read_file_secret(const char *path, unsigned char *s, size_t cap, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    *n = fread(s, 1, cap, f);
    int extra = fgetc(f);
    fclose(f);
    return *n > 0 && extra == EOF ? 0 : -1;
}

bool respdb_on(void) { return db != NULL; }

int respdb_open(struct server *srv, char *err, size_t n_err) {
    if (srv->no_store) return 0;
    char path[4200];
    const char *dir = serve_store_dir(srv);
    if (!dir) {
        snprintf(err, n_err, "stored responses: the block store has no directory");
        return -1;
    }
    if (srv->redis_secret_file) {
        if (read_file_secret(srv->redis_secret_file, secret, sizeof secret, &n_secret)) {
            snprintf(err, n_err, "cannot read --redis-secret-file %s (1 to %zu bytes)", srv->redis_secret_file, sizeof secret);
            return -1;
        }
    } else if (serve_store_secret(dir, secret, err, n_err)) return -1;
    else n_secret = 32;
    snprintf(path, sizeof path, "%s/index.db", dir);
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, NULL) != SQLITE_OK) {
        snprintf(err, n_err, "stored responses: cannot open %s: %s", path, db ? sqlite3_errmsg(db) : "no memory");
        sqlite3_close(db);
        db = NULL;
        return -1;
    }
    sqlite3_busy_timeout(db, 10000);
    char *e = NULL;
    if (sqlite3_exec(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;", NULL, NULL, &e) != SQLITE_OK ||
        sqlite3_exec(db, SCHEMA, NULL, NULL, &e) != SQLITE_OK) {
        snprintf(err, n_err, "stored responses in %s: %s", path, e ? e : sqlite3_errmsg(db));
        sqlite3_free(e);
        sqlite3_close(db);
        db = NULL;
        return -1;
    }
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT COALESCE(MAX(used), 0) FROM responses", -1, &st, NULL) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW)
        used_ctr = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    ttl_s = srv->response_ttl_s;
    quota = srv->response_quota;
    rstore = srv->redis_url ? srv->sched->store : NULL;
    return 0;
}

void respdb_close(void) {
    pthread_mutex_lock(&db_mu);
    sqlite3_close(db);
    db = NULL;
    rstore = NULL;
    OPENSSL_cleanse(secret, sizeof secret);
    n_secret = 0;
    pthread_mutex_unlock(&db_mu);
}

static void log_sql(const char *what) { fprintf(stderr, "kvtier serve: stored responses: %s: %s\n", what, sqlite3_errmsg(db)); }

/* ---- the Redis copy: "kvt:rec:resp:<ns>:<id>" -> {"parent", "created", "expires", "body", "mac"}
** (kvt_store_record: one SET, MACed by the store under --redis-secret-file; the row's own MAC
** inside, under the same secret, so a server reading another's row checks both). */

static bool id_ok(const char *id) { /* a client's previous_response_id: never a Redis key with odd bytes */
    size_t n = strlen(id);
    for (size_t i = 0; i < n; i++)
        if (!((id[i] >= 'a' && id[i] <= 'z') || (id[i] >= 'A' && id[i] <= 'Z') || (id[i] >= '0' && id[i] <= '9') || id[i] == '_' ||
              id[i] == '-'))
            return false;
    return n >= 1 && n <= 64;
}

static void redis_name(char *k, size_t n, const char *ns, const char *id) { snprintf(k, n, "resp:%s:%s", ns, id); }

static bool redis_put(const char *ns, const char *id, const char *parent, int64_t created, int64_t expires, const char *body,
                      const unsigned char *mac) {
    if (!rstore || !id_ok(id)) return false;
    char hex[2 * RESPDB_MAC + 1], k[160];
    for (int i = 0; i < RESPDB_MAC; i++) snprintf(hex + 2 * i, 3, "%02x", mac[i]);
    json_t *v = json_pack("{s:s, s:I, s:I, s:s, s:s}", "parent", parent, "created", (json_int_t) created, "expires",
                          (json_int_t) expires, "body", body, "mac", hex);
    char *t = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    const int64_t life = expires > 0 ? expires - now_s() : 365 * 24 * 3600; /* never: a year, renewed by every write */
    redis_name(k, sizeof k, ns, id);
    bool ok = false;
    if (!t) fprintf(stderr, "kvtier serve: stored response '%s': out of memory for its Redis copy\n", id);
    else if (life > 0 && kvt_store_record(rstore, KVT_RECORD_PUT, k, t, strlen(t), life, NULL, NULL))
        fprintf(stderr, "kvtier serve: stored response '%s' not in Redis: %s\n", id, kvt_errmsg());
    else ok = life > 0;
    free(t);
    return ok;
}

/* The row from Redis: 1 with its fields (*body malloc'd), 0 absent, -1 unusable (why). */
static int redis_get(const char *ns, const char *id, char *parent, size_t n_parent, int64_t *created, int64_t *expires, char **body,
                     unsigned char *mac, char *why, size_t n_why) {
    *body = NULL;
    if (!rstore || !id_ok(id)) return 0;
    char k[160];
    redis_name(k, sizeof k, ns, id);
    void *v = NULL;
    size_t n = 0;
    int rc = kvt_store_record(rstore, KVT_RECORD_GET, k, NULL, 0, 0, &v, &n);
    if (rc == KVT_ENOENT) return 0;
    if (rc) {
        snprintf(why, n_why, "its Redis copy: %s", kvt_errmsg());
        return -1;
    }
    int got = respdb_parse_record(v, n, parent, n_parent, created, expires, body, mac, why, n_why);
    free(v);
    return got;
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

int respdb_parse_record(const void *v, size_t n, char *parent, size_t n_parent, int64_t *created, int64_t *expires, char **body,
                        unsigned char *mac, char *why, size_t n_why) {
    *body = NULL;
    if (n > RESPDB_MAX_BODY + 4096) {
        snprintf(why, n_why, "its Redis copy is %zu bytes, over the cap", n);
        return -1;
    }
    json_error_t je;
    json_t *j = json_loadb(v, n, JSON_REJECT_DUPLICATES, &je);
    const char *p = json_string_value(json_object_get(j, "parent")), *b = json_string_value(json_object_get(j, "body")),
               *h = json_string_value(json_object_get(j, "mac"));
    const json_t *c = json_object_get(j, "created"), *e = json_object_get(j, "expires");
    int got = -1;
    if (!p || !b || !h || strlen(h) != 2 * RESPDB_MAC || !json_is_integer(c) || !json_is_integer(e) || strlen(p) >= n_parent)
        snprintf(why, n_why, "its Redis copy is not a stored response's row");
    else {
        got = 1;
        for (int i = 0; i < RESPDB_MAC && got == 1; i++) {
            const int hi = hexval(h[2 * i]), lo = hexval(h[2 * i + 1]);
            if (hi < 0 || lo < 0) got = -1;
            else mac[i] = (unsigned char) (hi << 4 | lo);
        }
        if (got < 0) snprintf(why, n_why, "its Redis copy has a malformed MAC");
        else if (!(*body = strdup(b))) {
            snprintf(why, n_why, "out of memory");
            got = -1;
        } else {
            snprintf(parent, n_parent, "%s", p);
            *created = json_integer_value(c);
            *expires = json_integer_value(e);
        }
    }
    json_decref(j);
    return got;
}

int respdb_remote(const char *ns, const char *id) {
    if (!rstore || !id_ok(id)) return -1;
    char k[160];
    redis_name(k, sizeof k, ns, id);
    void *v = NULL;
    size_t n = 0;
    int rc = kvt_store_record(rstore, KVT_RECORD_GET, k, NULL, 0, 0, &v, &n);
    free(v);
    return rc == 0 ? 1 : rc == KVT_ENOENT ? 0 : -1;
}

/* INSERT OR REPLACE one row (under db_mu).  true when written. */
static bool db_insert(const char *ns, const char *id, const char *parent, int64_t created, int64_t expires, const char *body,
                      size_t n, const unsigned char *mac, bool shared) {
    sqlite3_stmt *s = NULL;
    bool ok = sqlite3_prepare_v2(db,
                                 "INSERT OR REPLACE INTO responses(ns, id, parent, created, expires, used, body, mac, shared) "
                                 "VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                                 -1, &s, NULL) == SQLITE_OK;
    if (ok) {
        sqlite3_bind_text(s, 1, ns, -1, SQLITE_STATIC);
        sqlite3_bind_text(s, 2, id, -1, SQLITE_STATIC);
        sqlite3_bind_text(s, 3, parent, -1, SQLITE_STATIC);
        sqlite3_bind_int64(s, 4, created);
        sqlite3_bind_int64(s, 5, expires);
        sqlite3_bind_int64(s, 6, ++used_ctr);
        sqlite3_bind_blob(s, 7, body, (int) n, SQLITE_STATIC);
        sqlite3_bind_blob(s, 8, mac, RESPDB_MAC, SQLITE_STATIC);
        sqlite3_bind_int(s, 9, shared);
        ok = sqlite3_step(s) == SQLITE_DONE;
    }
    sqlite3_finalize(s);
    return ok;
}

int respdb_put(const char *ns, const char *id, const char *parent, const json_t *turn, const json_t *obj, bool *shared) {
    *shared = false;
    if (!db) return 0;
    json_t *b = json_pack("{s:O, s:O}", "turn", turn, "object", obj);
    char *body = b ? json_dumps(b, JSON_COMPACT) : NULL;
    json_decref(b);
    if (!body) {
        fprintf(stderr, "kvtier serve: stored responses: out of memory writing '%s'\n", id);
        return -1;
    }
    const size_t n = strlen(body);
    const int64_t created = now_s(), expires = ttl_s > 0 ? created + ttl_s : 0;
    unsigned char mac[RESPDB_MAC];
    int rc = -1;
    pthread_mutex_lock(&db_mu);
    if (n > RESPDB_MAX_BODY)
        fprintf(stderr, "kvtier serve: stored responses: '%s' is %zu bytes, over the cap: not on disk\n", id, n);
    else if (!row_mac(secret, n_secret, ns, id, parent, created, expires, body, n, mac))
        fprintf(stderr, "kvtier serve: stored responses: HMAC failed for '%s'\n", id);
    else if ((*shared = redis_put(ns, id, parent, created, expires, body, mac)), /* Redis first: every server's */
             sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        log_sql("begin");
    else {
        bool ok = db_insert(ns, id, parent, created, expires, body, n, mac, *shared);
        /* expired rows (all tenants), then this tenant's least recently used past its quota */
        sqlite3_stmt *s = NULL;
        if (ok &&
            (ok = sqlite3_prepare_v2(db, "DELETE FROM responses WHERE expires > 0 AND expires <= ?1", -1, &s, NULL) == SQLITE_OK)) {
            sqlite3_bind_int64(s, 1, created);
            ok = sqlite3_step(s) == SQLITE_DONE;
        }
        sqlite3_finalize(s);
        s = NULL;
        if (ok && quota > 0 &&
            (ok = sqlite3_prepare_v2(db,
                                     "DELETE FROM responses WHERE ns = ?1 AND id IN (SELECT id FROM responses WHERE ns = ?1 "
                                     "ORDER BY used DESC LIMIT -1 OFFSET ?2)",
                                     -1, &s, NULL) == SQLITE_OK)) {
            sqlite3_bind_text(s, 1, ns, -1, SQLITE_STATIC);
            sqlite3_bind_int64(s, 2, quota);
            ok = sqlite3_step(s) == SQLITE_DONE;
        }
        sqlite3_finalize(s);
        if (ok && sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) == SQLITE_OK) rc = 0;
        else {
            log_sql(id);
            sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        }
    }
    pthread_mutex_unlock(&db_mu);
    free(body);
    return rc;
}

/* A row's body checked and parsed: 0 with *turn, *obj (new references), or -1 with why. */
static int decode_body(const void *body, size_t n, json_t **turn, json_t **obj, char *why, size_t n_why) {
    json_error_t je;
    json_t *b = json_loadb(body, n, JSON_REJECT_DUPLICATES, &je);
    json_t *t = json_object_get(b, "turn"), *o = json_object_get(b, "object");
    if (!json_is_array(t) || !json_is_object(o)) {
        snprintf(why, n_why, "its body is not {\"turn\": [...], \"object\": {...}}%s%s", b ? "" : ": ", b ? "" : je.text);
        json_decref(b);
        return -1;
    }
    size_t i;
    const json_t *m;
    json_array_foreach(t, i, m) if (!json_is_string(json_object_get(m, "role"))) {
        snprintf(why, n_why, "turn message %zu has no role", i);
        json_decref(b);
        return -1;
    }
    *turn = json_incref(t);
    *obj = json_incref(o);
    json_decref(b);
    return 0;
}

int respdb_decode_row(const void *body, size_t n, json_t **turn, json_t **obj, char *why, size_t n_why) {
    *turn = *obj = NULL;
    if (n > RESPDB_MAX_BODY) {
        snprintf(why, n_why, "its body is %zu bytes, over the %d-byte cap", n, RESPDB_MAX_BODY);
        return -1;
    }
    return decode_body(body, n, turn, obj, why, n_why);
}

int respdb_get(const char *ns, const char *id, char *parent, size_t n_parent, json_t **turn, json_t **obj, int64_t *expires,
               bool *shared, char *why, size_t n_why) {
    *turn = *obj = NULL;
    *shared = false;
    if (!db) return 0;
    int found = 0;
    pthread_mutex_lock(&db_mu);
    sqlite3_stmt *s = NULL;
    if (sqlite3_prepare_v2(
            db,
            "SELECT parent, created, expires, length(body), body, mac, shared FROM responses WHERE ns = ?1 AND id = ?2 "
            "AND (expires = 0 OR expires > ?3)",
            -1, &s, NULL) != SQLITE_OK) {
        snprintf(why, n_why, "the store's index: %s", sqlite3_errmsg(db));
        found = -1;
    } else {
        sqlite3_bind_text(s, 1, ns, -1, SQLITE_STATIC);
        sqlite3_bind_text(s, 2, id, -1, SQLITE_STATIC);
        sqlite3_bind_int64(s, 3, now_s());
        int r = sqlite3_step(s);
        if (r == SQLITE_ROW) {
            const char *p = (const char *) sqlite3_column_text(s, 0);
            const int64_t created = sqlite3_column_int64(s, 1), exp = sqlite3_column_int64(s, 2), len = sqlite3_column_int64(s, 3);
            unsigned char mac[RESPDB_MAC];
            if (len > RESPDB_MAX_BODY) { /* size-capped before the body is read */
                snprintf(why, n_why, "its body is %lld bytes, over the %d-byte cap", (long long) len, RESPDB_MAX_BODY);
                found = -1;
            } else {
                const void *body = sqlite3_column_blob(s, 4);
                const size_t n = (size_t) sqlite3_column_bytes(s, 4);
                const void *m = sqlite3_column_blob(s, 5);
                if (!p || sqlite3_column_bytes(s, 5) != RESPDB_MAC ||
                    !row_mac(secret, n_secret, ns, id, p, created, exp, body ? body : "", n, mac) ||
                    CRYPTO_memcmp(mac, m, RESPDB_MAC)) {
                    snprintf(why, n_why, "its MAC does not match (changed on disk, or written under another secret)");
                    found = -1;
                } else if (decode_body(body, n, turn, obj, why, n_why)) found = -1;
                else {
                    snprintf(parent, n_parent, "%s", p);
                    *expires = exp;
                    *shared = sqlite3_column_int(s, 6) != 0;
                    found = 1;
                }
            }
        } else if (r != SQLITE_DONE) {
            snprintf(why, n_why, "the store's index: %s", sqlite3_errmsg(db));
            found = -1;
        }
    }
    sqlite3_finalize(s);
    if (found == 0 && rstore) { /* another server's: from Redis, checked as a local row, then kept here */
        char p[48];
        int64_t created = 0, exp = 0;
        char *body = NULL;
        unsigned char mac[RESPDB_MAC], want[RESPDB_MAC];
        found = redis_get(ns, id, p, sizeof p, &created, &exp, &body, mac, why, n_why);
        if (found == 1 && exp > 0 && exp <= now_s()) found = 0;
        else if (found == 1 && (!row_mac(secret, n_secret, ns, id, p, created, exp, body, strlen(body), want) ||
                                CRYPTO_memcmp(want, mac, RESPDB_MAC))) {
            snprintf(why, n_why,
                     "its Redis copy's MAC does not match (written under another secret: give every server the same "
                     "--redis-secret-file)");
            found = -1;
        } else if (found == 1 && strlen(body) > RESPDB_MAX_BODY) {
            snprintf(why, n_why, "its Redis copy's body is over the %d-byte cap", RESPDB_MAX_BODY);
            found = -1;
        } else if (found == 1 && decode_body(body, strlen(body), turn, obj, why, n_why)) found = -1;
        else if (found == 1) {
            snprintf(parent, n_parent, "%s", p);
            *expires = exp;
            *shared = true;
            if (!db_insert(ns, id, p, created, exp, body, strlen(body), mac, true)) log_sql("keeping a row read from Redis");
        }
        free(body);
    }
    pthread_mutex_unlock(&db_mu);
    if (found < 0) fprintf(stderr, "kvtier serve: stored response '%.60s' not served: %s\n", id, why);
    return found;
}

void respdb_touch(const char *ns, const char (*ids)[48], size_t n) {
    if (!db || !n) return;
    pthread_mutex_lock(&db_mu);
    sqlite3_stmt *s = NULL;
    bool ok = sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK &&
              sqlite3_prepare_v2(db, "UPDATE responses SET used = ?3 WHERE ns = ?1 AND id = ?2", -1, &s, NULL) == SQLITE_OK;
    for (size_t i = 0; ok && i < n; i++) { /* newest first: each ancestor more recent than its child */
        sqlite3_bind_text(s, 1, ns, -1, SQLITE_STATIC);
        sqlite3_bind_text(s, 2, ids[i], -1, SQLITE_STATIC);
        sqlite3_bind_int64(s, 3, ++used_ctr);
        ok = sqlite3_step(s) == SQLITE_DONE;
        sqlite3_reset(s);
    }
    sqlite3_finalize(s);
    if (!ok || sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        log_sql("touch");
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    }
    pthread_mutex_unlock(&db_mu);
}

bool respdb_del(const char *ns, const char *id) {
    if (!db) return false;
    bool gone = false;
    pthread_mutex_lock(&db_mu);
    sqlite3_stmt *s = NULL;
    if (sqlite3_prepare_v2(db, "DELETE FROM responses WHERE ns = ?1 AND id = ?2 AND (expires = 0 OR expires > ?3)", -1, &s, NULL) ==
        SQLITE_OK) {
        sqlite3_bind_text(s, 1, ns, -1, SQLITE_STATIC);
        sqlite3_bind_text(s, 2, id, -1, SQLITE_STATIC);
        sqlite3_bind_int64(s, 3, now_s());
        if (sqlite3_step(s) == SQLITE_DONE) gone = sqlite3_changes(db) > 0;
        else log_sql("delete");
    } else log_sql("delete");
    sqlite3_finalize(s);
    if (rstore && id_ok(id)) { /* and on every other server: its Redis copy */
        char k[160];
        redis_name(k, sizeof k, ns, id);
        const int rc = kvt_store_record(rstore, KVT_RECORD_DEL, k, NULL, 0, 0, NULL, NULL);
        if (rc && rc != KVT_ENOENT)
            fprintf(stderr, "kvtier serve: stored response '%s': its Redis copy was not deleted: %s\n", id, kvt_errmsg());
        gone = gone || rc == 0;
    }
    pthread_mutex_unlock(&db_mu);
    return gone;
}

/* ---- kvtier store verify ------------------------------------------------------------------- */

int respdb_verify(const char *dir, const char *secret_file, bool repair, struct respdb_report *out, char *err, size_t n_err) {
    memset(out, 0, sizeof *out);
    char path[1100];
    snprintf(path, sizeof path, "%s/index.db", dir);
    unsigned char keys[2][4096];
    size_t n_keys[2] = { 0, 0 };
    int nk = 0;
    if (secret_file) {
        if (read_file_secret(secret_file, keys[nk], sizeof keys[nk], &n_keys[nk])) {
            snprintf(err, n_err, "cannot read %s", secret_file);
            return -1;
        }
        nk++;
    }
    char sp[1100];
    snprintf(sp, sizeof sp, "%s/server-secret", dir);
    if (read_file_secret(sp, keys[nk], sizeof keys[nk], &n_keys[nk]) == 0) nk++;
    sqlite3 *v = NULL;
    if (sqlite3_open_v2(path, &v, repair ? SQLITE_OPEN_READWRITE : SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        sqlite3_close(v);
        return 0; /* no index: no stored responses */
    }
    sqlite3_busy_timeout(v, 10000);
    sqlite3_stmt *s = NULL;
    if (sqlite3_prepare_v2(v, "SELECT ns, id, parent, created, expires, body, mac FROM responses", -1, &s, NULL) != SQLITE_OK) {
        sqlite3_close(v); /* no table: a store no server kept responses in */
        return 0;
    }
    size_t n_bad = 0, cap_bad = 0;
    char(*bad)[2][48] = NULL;
    const int64_t now = now_s();
    int r;
    while ((r = sqlite3_step(s)) == SQLITE_ROW) {
        const char *ns = (const char *) sqlite3_column_text(s, 0), *id = (const char *) sqlite3_column_text(s, 1),
                   *parent = (const char *) sqlite3_column_text(s, 2);
        const int64_t created = sqlite3_column_int64(s, 3), exp = sqlite3_column_int64(s, 4);
        const void *body = sqlite3_column_blob(s, 5);
        const size_t n = (size_t) sqlite3_column_bytes(s, 5);
        const void *m = sqlite3_column_blob(s, 6);
        out->checked++;
        if (exp > 0 && exp <= now) {
            out->expired++;
            continue;
        }
        bool mac_ok = false;
        unsigned char mac[RESPDB_MAC];
        for (int k = 0; k < nk && !mac_ok; k++)
            mac_ok = ns && id && parent && sqlite3_column_bytes(s, 6) == RESPDB_MAC &&
                     row_mac(keys[k], n_keys[k], ns, id, parent, created, exp, body ? body : "", n, mac) &&
                     !CRYPTO_memcmp(mac, m, RESPDB_MAC);
        json_t *t = NULL, *o = NULL;
        char why[200] = "";
        if (mac_ok && respdb_decode_row(body ? body : "", n, &t, &o, why, sizeof why) == 0) out->ok++;
        else {
            out->corrupt++;
            fprintf(stderr, "stored response %.60s: %s\n", id ? id : "(no id)",
                    !mac_ok ? "its MAC does not match any secret given (changed on disk, or --redis-secret-file missing)" : why);
            if (repair && ns && id) {
                if (n_bad == cap_bad) {
                    size_t c = cap_bad ? 2 * cap_bad : 16;
                    void *nb = realloc(bad, c * sizeof *bad);
                    if (!nb) break;
                    bad = nb;
                    cap_bad = c;
                }
                snprintf(bad[n_bad][0], 48, "%s", ns);
                snprintf(bad[n_bad][1], 48, "%s", id);
                n_bad++;
            }
        }
        json_decref(t);
        json_decref(o);
    }
    sqlite3_finalize(s);
    int rc = 0;
    if (r != SQLITE_DONE && r != SQLITE_ROW) {
        snprintf(err, n_err, "%s: %s", path, sqlite3_errmsg(v));
        rc = -1;
    }
    for (size_t i = 0; rc == 0 && i < n_bad; i++) {
        sqlite3_stmt *d = NULL;
        if (sqlite3_prepare_v2(v, "DELETE FROM responses WHERE ns = ?1 AND id = ?2", -1, &d, NULL) == SQLITE_OK) {
            sqlite3_bind_text(d, 1, bad[i][0], -1, SQLITE_STATIC);
            sqlite3_bind_text(d, 2, bad[i][1], -1, SQLITE_STATIC);
            if (sqlite3_step(d) == SQLITE_DONE) out->removed++;
        }
        sqlite3_finalize(d);
    }
    free(bad);
    OPENSSL_cleanse(keys, sizeof keys);
    sqlite3_close(v);
    return rc;
}
