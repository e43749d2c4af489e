/* store_index.c — the disk tier's SQLite index (DIR/index.db): schema and its version, the two
** connections (rd for lookups under rd_mu, wr for changes under wr_mu) and their prepared
** statements, and the removal of one row with the file it names.  store.c says how the index,
** the blob files and the writer thread fit together. */
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

#define SCHEMA_VERSION 1

static const char *SCHEMA = "CREATE TABLE IF NOT EXISTS blocks("
                            "  key BLOB PRIMARY KEY,"  /* 32-byte chain key */
                            "  file TEXT NOT NULL,"    /* name under blobs/ */
                            "  size INTEGER NOT NULL," /* payload bytes */
                            "  codec INTEGER NOT NULL,"
                            "  checksum BLOB NOT NULL," /* the payload's, as its blob file header (blobfile.c) */
                            "  model BLOB NOT NULL,"    /* model fingerprint */
                            "  n_tokens INTEGER NOT NULL,"
                            "  created REAL NOT NULL,"  /* epoch seconds */
                            "  last_hit REAL NOT NULL," /* epoch seconds: the write, then the last get */
                            "  hits INTEGER NOT NULL DEFAULT 0"
                            ") WITHOUT ROWID;"
                            "CREATE INDEX IF NOT EXISTS blocks_last_hit ON blocks(last_hit);";

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
    int flags = SQLITE_OPEN_NOMUTEX |
                (st->p.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | (writer ? SQLITE_OPEN_CREATE : 0));
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
        return kvt__fail(KVT_EIO, "store index %s/index.db has format version %d, newer than this kvtier's %d", st->dir, version,
                         SCHEMA_VERSION);
    return 0;
}

int kvt__store_index_open(kvt_store *st) {
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
                          "last_hit, hits) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                          &st->wr_ins)) ||
            (rc = prepare(st, st->wr, "UPDATE blocks SET hits = hits + 1, last_hit = max(last_hit, ?2) WHERE key = ?1",
                          &st->wr_hit)) ||
            (rc = prepare(st, st->wr, "DELETE FROM blocks WHERE key = ?1 AND (?2 IS NULL OR file = ?2) RETURNING size",
                          &st->wr_del)))
            return rc;
    }
    if ((rc = open_db(st, false, &st->rd)) || (st->p.read_only && (rc = check_version(st, st->rd)))) return rc;
    return prepare(st, st->rd, "SELECT file, size, codec, checksum, model, n_tokens, last_hit, hits FROM blocks WHERE key = ?1",
                   &st->rd_get);
}

int64_t kvt__store_sum_sizes(sqlite3 *db) {
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
