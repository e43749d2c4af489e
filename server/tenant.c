/* tenant.c — who a request belongs to: the tenant id of an API key.
**
** Sessions are private to their tenant, and, unless --share-store, so are the blocks their
** prompts store: the tenant salts every chain key (kvt_chain_params.tenant).  The store on disk
** and a Redis shared by several servers outlive the key file, so the id must not depend on where
** a key sits in that file (it once was "key<line number>": reorder the file and another customer
** inherited the salt, and `usage.kvtier.prompt_tokens_from_store` told them whether a guessed
** prefix had been sent).  The id is a keyed hash,
**     "t" + the first 32 hex digits of HMAC-SHA-256(server secret, key),
** stable across edits of the key file and restarts, and different on servers that do not share
** the secret.  The secret is 32 random bytes in <store>/server-secret (mode 0600), created at the
** first start; servers sharing a store directory share it.  With --redis-secret-file it is
** derived from that file instead (HMAC-SHA-256(file, "kvtier tenants")): servers sharing a Redis
** and its secret file share tenants, each with a store of its own (a fleet).  Without a store the secret
** is drawn at start: nothing a tenant stores outlives the process then.  Like vLLM's cache_salt,
** but derived by the server, so a client cannot choose another tenant's. */
#include "serve.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { SECRET_BYTES = 32 };

static int read_secret(const char *path, unsigned char *s) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, s, SECRET_BYTES);
    close(fd);
    return n == SECRET_BYTES ? 0 : -2;
}

/* The secret of the store directory dir: read, or created once (written to a temporary file,
** then link(2)ed into place, so two servers starting together end with the same secret and no
** reader ever sees a half-written one). */
int serve_store_secret(const char *dir, unsigned char *s, char *err, size_t n_err) {
    char path[1100], tmp[1200];
    snprintf(path, sizeof path, "%s/server-secret", dir);
    int rc = read_secret(path, s);
    if (rc == 0) return 0;
    if (rc == -2) {
        snprintf(err, n_err, "%s is not %d bytes: remove it to draw a new secret (tenants then change)", path, SECRET_BYTES);
        return -1;
    }
    if (RAND_bytes(s, SECRET_BYTES) != 1) {
        snprintf(err, n_err, "cannot draw random bytes for %s", path);
        return -1;
    }
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long) getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(err, n_err, "cannot create %s: %s", tmp, strerror(errno));
        return -1;
    }
    bool ok = write(fd, s, SECRET_BYTES) == SECRET_BYTES && fsync(fd) == 0;
    ok = close(fd) == 0 && ok;
    if (ok && link(tmp, path) != 0 && errno != EEXIST) ok = false;
    int e = errno;
    unlink(tmp);
    if (!ok) {
        snprintf(err, n_err, "cannot write %s: %s", path, strerror(e));
        return -1;
    }
    return read_secret(path, s) == 0 ? 0
                                     : (snprintf(err, n_err, "cannot read %s back", path), -1); /* another server's, if it won */
}

int serve_tenant_init(struct server *srv, char *err, size_t n_err) {
    if (!srv->n_keys) return 0;
    unsigned char secret[SECRET_BYTES];
    if (srv->redis_secret_file && !srv->no_store) {
        /* servers sharing a Redis and its secret share tenants: a key's blocks and stored
        ** responses are found by every one of them (a fleet behind a load balancer) */
        unsigned char buf[4096];
        FILE *f = fopen(srv->redis_secret_file, "rb");
        size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
        if (f) fclose(f);
        unsigned int ml = 0;
        if (!n || !HMAC(EVP_sha256(), buf, (int) n, (const unsigned char *) "kvtier tenants", 14, secret, &ml) ||
            ml != SECRET_BYTES) {
            snprintf(err, n_err, "cannot read --redis-secret-file %s", srv->redis_secret_file);
            return -1;
        }
        memset(buf, 0, sizeof buf);
    } else if (srv->no_store) {
        if (RAND_bytes(secret, SECRET_BYTES) != 1) {
            snprintf(err, n_err, "cannot draw random bytes for the tenant secret");
            return -1;
        }
    } else {
        const char *dir = serve_store_dir(srv);
        if (!dir) {
            snprintf(err, n_err, "the block store has no directory");
            return -1;
        }
        if (serve_store_secret(dir, secret, err, n_err)) return -1;
    }
    if (!(srv->key_ns = calloc((size_t) srv->n_keys, sizeof *srv->key_ns))) {
        snprintf(err, n_err, "out of memory");
        return -1;
    }
    for (int32_t i = 0; i < srv->n_keys; i++) {
        unsigned char mac[EVP_MAX_MD_SIZE];
        unsigned int n = 0;
        if (!HMAC(EVP_sha256(), secret, SECRET_BYTES, (const unsigned char *) srv->keys[i], strlen(srv->keys[i]), mac, &n) ||
            n < 16) {
            snprintf(err, n_err, "HMAC-SHA-256 failed");
            return -1;
        }
        srv->key_ns[i][0] = 't';
        for (int k = 0; k < 16; k++) snprintf(srv->key_ns[i] + 1 + 2 * k, 3, "%02x", mac[k]);
    }
    memset(secret, 0, sizeof secret);
    return 0;
}
