/* store_fixture.h — what the block store's tests share (test_store.c, test_store_faults.c,
** store_fill.c): a scratch directory per test, keys made from strings, block contents that are
** a deterministic function of the key (so any process can check any block it reads back), and
** file helpers for the blob directory. */
#ifndef KVT_TEST_STORE_FIXTURE_H
#define KVT_TEST_STORE_FIXTURE_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvtier.h"
#include "store/store_int.h" /* kvt__sha256, kvt__sblob_name, KVT__SBLOB_HDR */

/* key = SHA-256("<tag>/<i>"); also a model fingerprint made from a string. */
static inline kvt_key sk_key(const char *tag, int i) {
    char s[128];
    kvt_key k;
    int n = snprintf(s, sizeof s, "%s/%d", tag, i);
    if (kvt__sha256(s, (size_t) n, k.b)) abort();
    return k;
}

/* Block bytes as a function of the key alone: size 500..8691 from the key's first bytes, then
** xorshift bytes seeded with the key. */
static inline size_t sk_size(const kvt_key *k) { return 500 + ((size_t) k->b[0] | (size_t) k->b[1] << 8) % 8192; }

static inline uint8_t *sk_content(const kvt_key *k, size_t *n) {
    *n = sk_size(k);
    uint8_t *p = malloc(*n);
    if (!p) abort();
    uint64_t s;
    memcpy(&s, k->b + 8, sizeof s);
    s |= 1;
    for (size_t i = 0; i < *n; i++) {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        p[i] = (uint8_t) ((s * 2685821657736338717ull) >> 56);
    }
    return p;
}

static inline struct kvt_store_meta sk_meta(const kvt_key *model, const kvt_key *k) {
    return (struct kvt_store_meta){ .model = *model, .n_tokens = 16 + k->b[2] % 64, .codec = 0 };
}

static inline void sk_rm_rf(const char *path) {
    struct stat sb;
    if (lstat(path, &sb)) return;
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            char sub[PATH_MAX];
            if ((size_t) snprintf(sub, sizeof sub, "%s/%s", path, de->d_name) >= sizeof sub) continue;
            sk_rm_rf(sub);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

/* Files in dir/blobs (all names but . and ..). */
static inline int sk_count_files(const char *dir) {
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/blobs", dir);
    DIR *d = opendir(p);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* The path of key's blob file under dir/blobs/: the file whose name starts with the key's hex
** (each write has a generation of its own in its name), or the generation-less name when there
** is none (a path to create a stray file at). */
static inline void sk_blob_path(const char *dir, const kvt_key *k, char *buf, size_t n) {
    char name[KVT__SBLOB_NAME], bdir[PATH_MAX - 128];
    kvt__sblob_name(k, 0, name);
    snprintf(bdir, sizeof bdir, "%s/blobs", dir);
    DIR *d = opendir(bdir);
    struct dirent *de;
    kvt_key fk;
    while (d && (de = readdir(d)))
        if (kvt__sblob_is_blob(de->d_name, &fk) && !memcmp(fk.b, k->b, KVT_KEY_BYTES)) {
            memcpy(name, de->d_name, strlen(de->d_name) + 1); /* a blob name fits */
            break;
        }
    if (d) closedir(d);
    if ((size_t) snprintf(buf, n, "%s/blobs/%s", dir, name) >= n) abort();
}

/* Flip the bits `mask` of the byte at `off` of key's blob file under dir/blobs/ (a damaged
** payload or header); aborts if the file cannot be read and written there. */
static inline void sk_flip_byte(const char *dir, const kvt_key *k, off_t off, uint8_t mask) {
    char path[PATH_MAX];
    sk_blob_path(dir, k, path, sizeof path);
    int fd = open(path, O_RDWR);
    uint8_t c;
    if (fd < 0 || pread(fd, &c, 1, off) != 1) abort();
    c ^= mask;
    if (pwrite(fd, &c, 1, off) != 1) abort();
    close(fd);
}

/* cmocka fixture: a fresh temporary directory per test (*state is a struct sk_fx), removed after. */
struct sk_fx {
    char dir[64];
};

static inline int sk_setup(void **state) {
    struct sk_fx *f = calloc(1, sizeof *f);
    if (!f) return -1;
    strcpy(f->dir, "/tmp/kvt-test-store-XXXXXX");
    if (!mkdtemp(f->dir)) {
        free(f);
        return -1;
    }
    *state = f;
    return 0;
}

static inline int sk_teardown(void **state) {
    struct sk_fx *f = *state;
    sk_rm_rf(f->dir);
    free(f);
    return 0;
}

#endif
