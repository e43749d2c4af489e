/* blobfile.c — the disk tier's blob files: one file per block, a 128-byte header (store_int.h)
** then the payload, written durably and atomically, checked on every read.
**
** Write: a temporary name no reader looks for ("<blobs>/.tmp-<pid>-<16 hex of key>-XXXXXX",
** O_EXCL), the whole file, fsync, rename to "<64 hex of key>-<16 hex generation>.kvb", fsync of
** the directory.  A writer killed at any point leaves at most a temporary file (removed by open
** and gc) or a complete, durable file; the index row that makes it visible is written only after
** the rename is durable (store.c), so a row never names a half-written file.
**
** Every write has a name of its own (a random 64-bit generation), and the index row names its
** file: whoever removes a row unlinks the file that row named, never a fresh copy of the same
** key another thread or process has just written (issue #24 item 7; with one name per key, a
** remove that deleted the row and then unlinked could take the file of a write that came in
** between, leaving a row without its file).  Stores written before this name files
** "<64 hex>.kvb"; their rows still name them and they read as before. */
#include "store/store_int.h"
#include "fault.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

static void le32(uint8_t *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b[i] = (uint8_t) (v >> (8 * i));
}
static void le64(uint8_t *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (uint8_t) (v >> (8 * i));
}
static uint32_t rd32(const uint8_t *b) {
    return (uint32_t) b[0] | (uint32_t) b[1] << 8 | (uint32_t) b[2] << 16 | (uint32_t) b[3] << 24;
}
static uint64_t rd64(const uint8_t *b) { return (uint64_t) rd32(b) | (uint64_t) rd32(b + 4) << 32; }

int kvt__sha256(const void *data, size_t n, uint8_t out[32]) {
    unsigned len = 0;
    static const uint8_t empty = 0;
    return EVP_Digest(n ? data : &empty, n, out, &len, EVP_sha256(), NULL) == 1 && len == 32 ? 0 : -1;
}

/* ---- the payload checksum of a format version (store_int.h), whole or streamed -------------- */

struct sum {
    EVP_MD_CTX *sha;  /* version 1 */
    XXH3_state_t *xx; /* version 2 */
};

/* Version 2's 32 bytes: XXH3-128 in canonical (big-endian) order, then zeros. */
static void xx_out(XXH128_hash_t x, uint8_t out[32]) {
    XXH128_canonical_t h;
    XXH128_canonicalFromHash(&h, x);
    memset(out, 0, 32);
    memcpy(out, h.digest, sizeof h.digest);
}

static int sum_init(struct sum *c, uint32_t version) {
    memset(c, 0, sizeof *c);
    version = version ? version : KVT__SBLOB_VERSION;
    if (version == 1) {
        if (!(c->sha = EVP_MD_CTX_new()) || EVP_DigestInit_ex(c->sha, EVP_sha256(), NULL) != 1) return -1;
        return 0;
    }
    if (version == 2) return (c->xx = XXH3_createState()) && XXH3_128bits_reset(c->xx) == XXH_OK ? 0 : -1;
    return -1;
}

static int sum_update(struct sum *c, const void *p, size_t n) {
    if (n == 0) return 0;
    if (c->sha) return EVP_DigestUpdate(c->sha, p, n) == 1 ? 0 : -1;
    return XXH3_128bits_update(c->xx, p, n) == XXH_OK ? 0 : -1;
}

/* Frees the context, also when the digest fails. */
static int sum_final(struct sum *c, uint8_t out[32]) {
    int rc = -1;
    memset(out, 0, 32);
    if (c->sha) {
        unsigned len = 0;
        rc = EVP_DigestFinal_ex(c->sha, out, &len) == 1 && len == 32 ? 0 : -1;
    } else if (c->xx) {
        xx_out(XXH3_128bits_digest(c->xx), out);
        rc = 0;
    }
    EVP_MD_CTX_free(c->sha);
    XXH3_freeState(c->xx);
    c->sha = NULL;
    c->xx = NULL;
    return rc;
}

int kvt__sblob_checksum(uint32_t version, const void *data, size_t n, uint8_t out[32]) {
    version = version ? version : KVT__SBLOB_VERSION;
    if (version == 2) { /* one shot, no state to allocate */
        xx_out(XXH3_128bits(n ? data : "", n), out);
        return 0;
    }
    if (version == 1) return kvt__sha256(data, n, out);
    memset(out, 0, 32);
    return -1;
}

void kvt__sblob_name(const kvt_key *key, uint64_t gen, char name[KVT__SBLOB_NAME]) {
    kvt_key_hex(key, name);
    if (gen) snprintf(name + 64, KVT__SBLOB_NAME - 64, "-%016llx.kvb", (unsigned long long) gen);
    else memcpy(name + 64, ".kvb", 5);
}

static bool is_hex(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
    return true;
}

bool kvt__sblob_is_blob(const char *name, kvt_key *key) {
    char hex[65];
    const size_t len = strlen(name);
    if (!((len == 68 && !strcmp(name + 64, ".kvb")) ||
          (len == 85 && name[64] == '-' && is_hex(name + 65, 16) && !strcmp(name + 81, ".kvb"))))
        return false;
    if (!is_hex(name, 64)) return false;
    memcpy(hex, name, 64);
    hex[64] = '\0';
    return kvt_key_parse(hex, key) == 0;
}

/* A new file's generation: random, never 0 (the name of stores from before generations). */
static uint64_t new_gen(void) {
    static _Atomic uint64_t counter;
    uint64_t g = 0;
    if (getrandom(&g, sizeof g, GRND_NONBLOCK) != (ssize_t) sizeof g) { /* no entropy yet: unique enough */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        g = (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
        g ^= (uint64_t) getpid() << 40 ^ (++counter * 0x9e3779b97f4a7c15u);
    }
    return g ? g : 1;
}

bool kvt__sblob_is_tmp(const char *name, long *pid) {
    if (strncmp(name, ".tmp-", 5)) return false;
    char *end;
    long p = strtol(name + 5, &end, 10);
    if (end == name + 5 || *end != '-' || p <= 0) return false;
    *pid = p;
    return true;
}

static void encode(const struct kvt__sblob_hdr *h, uint8_t b[KVT__SBLOB_HDR]) {
    memset(b, 0, KVT__SBLOB_HDR);
    memcpy(b, KVT__SBLOB_MAGIC, 8);
    le32(b + 8, h->version ? h->version : KVT__SBLOB_VERSION);
    le32(b + 12, (uint32_t) h->codec);
    memcpy(b + 16, h->key.b, 32);
    memcpy(b + 48, h->model.b, 32);
    le32(b + 80, (uint32_t) h->n_tokens);
    le64(b + 88, h->size);
    memcpy(b + 96, h->sum, 32);
}

static int write_all(int fd, const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        p += w;
        n -= (size_t) w;
    }
    return 0;
}

int kvt__sblob_write(int blobs_fd, const char *blobs_dir, const struct kvt__sblob_hdr *h, const void *data,
                     char name[KVT__SBLOB_NAME], const char **what) {
    char hex[65], tmp[128];
    uint8_t hdr[KVT__SBLOB_HDR];
    kvt_key_hex(&h->key, hex);
    kvt__sblob_name(&h->key, new_gen(), name);
    encode(h, hdr);
    snprintf(tmp, sizeof tmp, ".tmp-%ld-%.16s-XXXXXX", (long) getpid(), hex);
    /* mkstemp needs a path: build it under blobs_dir, then work relative to blobs_fd */
    char path[4096];
    int len = snprintf(path, sizeof path, "%s/%s", blobs_dir, tmp);
    if (len < 0 || (size_t) len >= sizeof path) {
        *what = "create";
        return ENAMETOOLONG;
    }
    int fd = mkstemp(path);
    if (fd < 0) {
        *what = "create";
        return errno;
    }
    const char *tmp_name = path + strlen(blobs_dir) + 1;
    int err = 0;
    if (kvt__fault_check(KVT__FAULT_STORE_WRITE)) {
        *what = "write";
        err = ENOSPC;
    } else if ((err = write_all(fd, hdr, sizeof hdr)) || (err = write_all(fd, data, (size_t) h->size))) {
        *what = "write";
    } else if (kvt__fault_check(KVT__FAULT_STORE_SYNC) ? (errno = EIO, true) : fsync(fd) != 0) {
        *what = "fsync";
        err = errno;
    }
    if (close(fd) && !err) {
        *what = "close";
        err = errno;
    }
    if (!err &&
        (kvt__fault_check(KVT__FAULT_STORE_SYNC) ? (errno = EIO, true) : renameat(blobs_fd, tmp_name, blobs_fd, name) != 0)) {
        *what = "rename";
        err = errno;
    }
    if (err) {
        unlinkat(blobs_fd, tmp_name, 0);
        return err;
    }
    if (fsync(blobs_fd)) { /* the rename is not durable: never let an index row name it */
        *what = "fsync of the directory";
        err = errno;
        unlinkat(blobs_fd, name, 0);
        return err;
    }
    return 0;
}

int kvt__sblob_write_unsafe(int blobs_fd, const struct kvt__sblob_hdr *h, const void *data, const char name[KVT__SBLOB_NAME]) {
    uint8_t hdr[KVT__SBLOB_HDR];
    encode(h, hdr);
    int fd = openat(blobs_fd, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return errno;
    size_t half = (size_t) h->size / 2;
    int err = write_all(fd, hdr, sizeof hdr);
    if (!err) err = write_all(fd, data, half);
    usleep(2000);
    if (!err) err = write_all(fd, (const uint8_t *) data + half, (size_t) h->size - half);
    close(fd);
    return err;
}

static int read_all(int fd, uint8_t *p, size_t n, size_t *got) {
    *got = 0;
    while (*got < n) {
        ssize_t r = read(fd, p + *got, n - *got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) break;
        *got += (size_t) r;
    }
    return 0;
}

/* The header's fields from its first n bytes (a file's or a Redis value's): NULL, or why not
** (short, magic, version).  The one reader of the layout encode() writes. */
static const char *decode(const uint8_t *hdr, size_t n, struct kvt__sblob_hdr *h) {
    if (n < KVT__SBLOB_HDR) return "truncated header";
    if (memcmp(hdr, KVT__SBLOB_MAGIC, 8)) return "bad magic";
    h->version = rd32(hdr + 8);
    if (h->version != 1 && h->version != 2) return "unknown format version";
    h->codec = (int32_t) rd32(hdr + 12);
    memcpy(h->key.b, hdr + 16, 32);
    memcpy(h->model.b, hdr + 48, 32);
    h->n_tokens = (int32_t) rd32(hdr + 80);
    h->size = rd64(hdr + 88);
    memcpy(h->sum, hdr + 96, 32);
    return NULL;
}

/* kvt__sblob_read, the payload into a malloc'd buffer (*data), a shared buffer (*sbp: the RAM
** tier takes a reference to it, the caller another; no copy) or neither. */
static int read_blob(int blobs_fd, const char *name, struct kvt__sblob_hdr *h, uint8_t **data, struct kvt__sbuf **sbp,
                     const char **why) {
    uint8_t hdr[KVT__SBLOB_HDR], sum[32];
    struct stat sb;
    size_t got;
    struct kvt__sbuf *shared = NULL;
    if (data) *data = NULL;
    if (sbp) *sbp = NULL;
    int fd = openat(blobs_fd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        *why = strerror(errno);
        return errno == ENOENT ? KVT__SBLOB_MISSING : errno == ELOOP ? KVT__SBLOB_BAD : KVT__SBLOB_IOERR;
    }
    int rc = KVT__SBLOB_BAD;
    uint8_t *buf = NULL;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode)) {
        *why = "not a regular file";
        goto out;
    }
    if (read_all(fd, hdr, sizeof hdr, &got)) {
        *why = strerror(errno);
        rc = KVT__SBLOB_IOERR;
        goto out;
    }
    if ((*why = decode(hdr, got, h))) goto out;
    if ((uint64_t) sb.st_size != KVT__SBLOB_HDR + h->size || h->size > SIZE_MAX - 1) {
        *why = (uint64_t) sb.st_size < KVT__SBLOB_HDR + h->size ? "truncated payload" : "file longer than its header says";
        goto out;
    }
    /* the payload is checked as it is read; without data it is read in chunks and dropped */
    struct sum c;
    if (sum_init(&c, h->version)) {
        sum_final(&c, sum);
        rc = KVT__SBLOB_NOMEM;
        *why = "no memory for the checksum";
        goto out;
    }
    const bool keep = data || sbp;
    size_t chunk = keep ? (size_t) h->size : KVT_MIN((size_t) h->size, (size_t) 1 << 20);
    if (sbp) buf = (shared = kvt__sbuf_alloc(chunk)) ? shared->data : NULL;
    else buf = malloc(chunk ? chunk : 1);
    if (!buf) {
        sum_final(&c, sum);
        rc = KVT__SBLOB_NOMEM;
        *why = "no memory for the payload";
        goto out;
    }
    uint64_t left = h->size;
    int ok = 1;
    while (left > 0 && ok) {
        size_t want = (size_t) KVT_MIN(left, (uint64_t) chunk);
        uint8_t *dst = keep ? buf + (h->size - left) : buf;
        if (read_all(fd, dst, want, &got) || got != want) {
            *why = got != want ? "truncated payload" : strerror(errno);
            rc = got != want ? KVT__SBLOB_BAD : KVT__SBLOB_IOERR;
            ok = 0;
            break;
        }
        ok = sum_update(&c, dst, want) == 0;
        left -= want;
    }
    if (sum_final(&c, sum) && ok) ok = 0;
    if (!ok) {
        if (left == 0) {
            rc = KVT__SBLOB_NOMEM;
            *why = "checksum failed";
        }
        goto out;
    }
    if (memcmp(sum, h->sum, 32)) {
        *why = h->version == 1 ? "payload SHA-256 mismatch" : "payload checksum (XXH3-128) mismatch";
        goto out;
    }
    rc = KVT__SBLOB_OK;
    if (sbp) {
        *sbp = shared;
        shared = NULL;
        buf = NULL;
    } else if (data) {
        *data = buf;
        buf = NULL;
    }
out:
    if (shared) kvt__sbuf_unref(shared);
    else free(buf);
    close(fd);
    return rc;
}

int kvt__sblob_read(int blobs_fd, const char *name, struct kvt__sblob_hdr *h, uint8_t **data, const char **why) {
    return read_blob(blobs_fd, name, h, data, NULL, why);
}

int kvt__sblob_read_sbuf(int blobs_fd, const char *name, struct kvt__sblob_hdr *h, struct kvt__sbuf **sb, const char **why) {
    return read_blob(blobs_fd, name, h, NULL, sb, why);
}

/* ---- the same bytes in memory (the Redis tier's values) ---------------------------------------- */

uint8_t *kvt__sblob_encode_mem(const struct kvt__sblob_hdr *h, const void *data, size_t *n) {
    *n = 0;
    if (h->size > SIZE_MAX - KVT__SBLOB_HDR) return NULL;
    uint8_t *v = malloc(KVT__SBLOB_HDR + (size_t) h->size);
    if (!v) return NULL;
    encode(h, v);
    if (h->size) memcpy(v + KVT__SBLOB_HDR, data, (size_t) h->size);
    *n = KVT__SBLOB_HDR + (size_t) h->size;
    return v;
}

int kvt__sblob_check_mem(const uint8_t *v, size_t n, struct kvt__sblob_hdr *h, const char **why) {
    uint8_t sum[32];
    if ((*why = decode(v, n, h))) return KVT__SBLOB_BAD;
    if (h->size != (uint64_t) (n - KVT__SBLOB_HDR)) {
        *why = h->size > (uint64_t) (n - KVT__SBLOB_HDR) ? "truncated payload" : "value longer than its header says";
        return KVT__SBLOB_BAD;
    }
    if (kvt__sblob_checksum(h->version, v + KVT__SBLOB_HDR, (size_t) h->size, sum)) {
        *why = "checksum failed";
        return KVT__SBLOB_NOMEM;
    }
    if (memcmp(sum, h->sum, 32)) {
        *why = h->version == 1 ? "payload SHA-256 mismatch" : "payload checksum (XXH3-128) mismatch";
        return KVT__SBLOB_BAD;
    }
    return KVT__SBLOB_OK;
}
