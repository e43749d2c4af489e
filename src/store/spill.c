/* spill.c — the disk tier under the host pool: a directory of checksummed spill files (format,
** names, the private directory and its stale copies).  See spill.h and the top of pool.c.
** Nothing here takes the pool's lock: pool.c calls the file operations without it. */
#include "store/spill.h"
#include "fault.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define SPILL_MAGIC   "KVTSPILL"
#define SPILL_VERSION 1u
#define SPILL_HDR     64 /* 8 magic + 4 version + 4 reserved + 8 key + 8 length + 32 sha */
#define DIR_PREFIX    "kvtier-spill-"

/* ---- small helpers ---------------------------------------------------------------- */

static void put_le(uint8_t *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (uint8_t) (v >> (8 * i));
}
static uint64_t get_le(const uint8_t *p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t) p[i] << (8 * i);
    return v;
}

/* 0 on success, -1 if libcrypto fails. */
static int sha256(const uint8_t *p, size_t n, uint8_t md[32]) {
    static const uint8_t empty = 0;
    unsigned int len = 0;
    return EVP_Digest(n ? p : &empty, n, md, &len, EVP_sha256(), NULL) == 1 && len == 32 ? 0 : -1;
}

/* write(2) all of buf, retrying short writes and EINTR.  -1 with errno set on failure. */
static int write_all(int fd, const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t) w;
    }
    return 0;
}

/* read(2) exactly n bytes.  -1 with errno set on error; errno = 0 on early end of file. */
static int read_all(int fd, uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) {
            errno = 0;
            return -1;
        }
        p += r;
        n -= (size_t) r;
    }
    return 0;
}

void kvt__spill_name(const struct kvt__spill *sp, uint64_t key, uint64_t gen, char *buf, size_t size) {
    snprintf(buf, size, "%s/kvt-%ld-%llu-%016llx-%llu.blk", sp->dir, sp->pid, (unsigned long long) sp->serial,
             (unsigned long long) key, (unsigned long long) gen);
}

void kvt__spill_unlink(const struct kvt__spill *sp, uint64_t key, uint64_t gen) {
    char path[PATH_MAX];
    kvt__spill_name(sp, key, gen, path, sizeof path);
    unlink(path); /* a failure is ignored: the value is gone from the pool either way */
}

/* ---- the spill directory --------------------------------------------------------- */

/* "kvtier-spill-<pid>-XXXXXX" exactly (mkdtemp's six characters are letters and digits).
** OUT *pid. */
static bool our_dir_name(const char *name, long *pid) {
    size_t lp = strlen(DIR_PREFIX);
    if (strncmp(name, DIR_PREFIX, lp)) return false;
    const char *p = name + lp, *q = p;
    long v = 0;
    while (*q >= '0' && *q <= '9' && q - p < 10) v = v * 10 + (*q++ - '0');
    if (q == p || *q != '-' || v <= 0 || v > INT_MAX) return false;
    q++;
    for (int i = 0; i < 6; i++, q++)
        if (!((*q >= '0' && *q <= '9') || (*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z'))) return false;
    if (*q) return false;
    *pid = v;
    return true;
}

/* A name kvt__spill_write gives a file: "kvt-...blk" or a temporary ".tmp-XXXXXX". */
static bool our_file_name(const char *name) {
    size_t n = strlen(name);
    return (!strncmp(name, "kvt-", 4) && n > 8 && !strcmp(name + n - 4, ".blk")) || (!strncmp(name, ".tmp-", 5) && n == 11);
}

/* Remove the private spill directories that processes which died without kvt_pool_free left in
** tmp: only entries named exactly like ours (our_dir_name), real directories owned by this
** user, whose pid is no live process (kill(pid, 0) fails with ESRCH) and whose lock no live
** pool holds (the lock catches a pid from another pid namespace sharing the directory).
** Inside, only files named like ours are removed; a directory holding anything else stays.
** Best effort: every failure just leaves that directory. */
static void clean_stale_dirs(const char *tmp) {
    DIR *d = opendir(tmp);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        long pid;
        if (!our_dir_name(de->d_name, &pid) || pid == (long) getpid()) continue;
        if (kill((pid_t) pid, 0) == 0 || errno != ESRCH) continue; /* alive (or not ours to judge) */
        char path[PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", tmp, de->d_name) >= (int) sizeof path) continue;
        int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) continue;
        struct stat sb;
        if (fstat(fd, &sb) || !S_ISDIR(sb.st_mode) || sb.st_uid != geteuid() || flock(fd, LOCK_EX | LOCK_NB)) {
            close(fd);
            continue;
        }
        int fd2 = dup(fd);
        DIR *sub = fd2 >= 0 ? fdopendir(fd2) : NULL;
        if (!sub && fd2 >= 0) close(fd2);
        struct dirent *f;
        while (sub && (f = readdir(sub)))
            if (our_file_name(f->d_name)) unlinkat(fd, f->d_name, 0);
        if (sub) closedir(sub);
        rmdir(path); /* fails, and leaves it, if anything else is inside */
        close(fd);   /* releases the lock */
    }
    closedir(d);
}

void kvt__spill_clean_stale_dirs(const char *tmp) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static char done[PATH_MAX];
    pthread_mutex_lock(&mu);
    if (strcmp(done, tmp)) {
        clean_stale_dirs(tmp);
        snprintf(done, sizeof done, "%s", tmp);
    }
    pthread_mutex_unlock(&mu);
}

const char *kvt__spill_tmp_dir(void) {
    const char *tmp = getenv("TMPDIR");
    return tmp && *tmp ? tmp : "/tmp";
}

int kvt__spill_ensure_dir(struct kvt__spill *sp) {
    if (sp->dir) return 0;
    const char *tmp = kvt__spill_tmp_dir();
    char tmpl[PATH_MAX];
    if (snprintf(tmpl, sizeof tmpl, "%s/" DIR_PREFIX "%ld-XXXXXX", tmp, sp->pid) >= (int) sizeof tmpl ||
        strlen(tmpl) > PATH_MAX - 64)
        return kvt__fail(KVT_EIO, "TMPDIR \"%s\" is too long for a spill directory", tmp);
    if (!mkdtemp(tmpl)) return kvt__fail(KVT_EIO, "cannot create spill directory %s: %s", tmpl, strerror(errno));
    if (!(sp->dir = strdup(tmpl))) {
        rmdir(tmpl);
        return kvt__fail(KVT_ENOMEM, "out of memory for spill directory name %s", tmpl);
    }
    sp->own_dir = true;
    sp->dir_fd = open(tmpl, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (sp->dir_fd >= 0) flock(sp->dir_fd, LOCK_EX | LOCK_NB); /* best effort: the pid guards too */
    return 0;
}

void kvt__spill_close(struct kvt__spill *sp) {
    if (sp->own_dir) rmdir(sp->dir);
    if (sp->dir_fd >= 0) close(sp->dir_fd);
    free(sp->dir);
    sp->dir = NULL;
    sp->dir_fd = -1;
}

/* ---- spill write / read ----------------------------------------------------------- */

int kvt__spill_write(const struct kvt__spill *sp, uint64_t key, uint64_t gen, const uint8_t *data, size_t n, const char **what) {
    uint8_t hdr[SPILL_HDR] = { 0 };
    memcpy(hdr, SPILL_MAGIC, 8);
    put_le(hdr + 8, SPILL_VERSION, 4);
    put_le(hdr + 16, key, 8);
    put_le(hdr + 24, n, 8);
    *what = "SHA-256 of";
    if (sha256(data, n, hdr + 32)) return EIO;
    char tmp[PATH_MAX], path[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s/.tmp-XXXXXX", sp->dir);
    kvt__spill_name(sp, key, gen, path, sizeof path);
    *what = "create";
    int fd = mkstemp(tmp);
    if (fd < 0) return errno;
    *what = "write";
    if (kvt__fault_check(KVT__FAULT_SPILL_WRITE)) {
        errno = ENOSPC;
        goto fail;
    }
    if (write_all(fd, hdr, sizeof hdr) || write_all(fd, data, n)) goto fail;
    *what = "close";
    int c = close(fd);
    fd = -1;
    if (c) goto fail;
    *what = "rename";
    if (rename(tmp, path)) goto fail;
    return 0;
fail:;
    int err = errno ? errno : EIO;
    if (fd >= 0) close(fd);
    unlink(tmp);
    return err;
}

int kvt__spill_read(const struct kvt__spill *sp, uint64_t key, uint64_t gen, size_t n, uint8_t **out, bool *missing) {
    char path[PATH_MAX];
    kvt__spill_name(sp, key, gen, path, sizeof path);
    *missing = false;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        *missing = errno == ENOENT;
        return kvt__fail(KVT_EIO, "cannot open spill file %s: %s", path, strerror(errno));
    }
    uint8_t hdr[SPILL_HDR], md[32];
    uint8_t *buf = NULL;
    struct stat sb;
    int rc;
    if (fstat(fd, &sb)) {
        rc = kvt__fail(KVT_EIO, "cannot stat spill file %s: %s", path, strerror(errno));
        goto out;
    }
    if ((uint64_t) sb.st_size != SPILL_HDR + (uint64_t) n) {
        rc = kvt__fail(KVT_ECORRUPT, "spill file %s has %lld bytes, expected %llu", path, (long long) sb.st_size,
                       (unsigned long long) (SPILL_HDR + (uint64_t) n));
        goto out;
    }
    if (!(buf = malloc(n ? n : 1))) {
        rc = kvt__fail(KVT_ENOMEM, "out of memory reading %zu bytes from %s", n, path);
        goto out;
    }
    if (read_all(fd, hdr, sizeof hdr) || read_all(fd, buf, n)) {
        if (errno == 0) /* shrank between fstat and read */
            rc = kvt__fail(KVT_ECORRUPT, "spill file %s is truncated", path);
        else rc = kvt__fail(KVT_EIO, "cannot read spill file %s: %s", path, strerror(errno));
        goto out;
    }
    if (memcmp(hdr, SPILL_MAGIC, 8) || get_le(hdr + 8, 4) != SPILL_VERSION || get_le(hdr + 16, 8) != key ||
        get_le(hdr + 24, 8) != n) {
        rc = kvt__fail(KVT_ECORRUPT,
                       "spill file %s: bad header (expected key %016llx, %zu "
                       "bytes, version %u)",
                       path, (unsigned long long) key, n, SPILL_VERSION);
        goto out;
    }
    if (sha256(buf, n, md)) {
        rc = kvt__fail(KVT_EIO, "SHA-256 of spill file %s failed", path);
        goto out;
    }
    if (memcmp(md, hdr + 32, 32)) {
        rc = kvt__fail(KVT_ECORRUPT, "spill file %s failed its SHA-256 check", path);
        goto out;
    }
    close(fd);
    *out = buf;
    return 0;
out:
    close(fd);
    free(buf);
    return rc;
}
