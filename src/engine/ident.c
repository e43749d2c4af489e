/* ident.c — what names an engine's blocks in a content-addressed store (section 8): the model's
** fingerprint (SHA-256 of the GGUF file's bytes: the weights, tokenizer and hyper-parameters
** exactly, not the path) and the layout string of everything else that decides a saved block's
** bytes.  LMCache and vLLM key blocks by model *name*; two fine-tunes of one base share a name and
** a cache shape, and would exchange KV silently.  Hashing the file costs ~0.1 s per 100 MB once
** per engine, paid on the first request that looks up or stores a block. */
#include "engine/engine_int.h"

#include <openssl/evp.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int kvt_engine_fingerprint(kvt_engine *e, kvt_key *out) {
    if (e->have_fp) {
        *out = e->fingerprint;
        return 0;
    }
    int fd = open(e->model_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvt__fail(KVT_EIO, "model file '%s' cannot be read to fingerprint it: %s", e->model_path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || (int64_t) st.st_size != e->model_size ||
        (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec != e->model_mtime_ns) {
        close(fd);
        /* the bytes on disk are no longer the weights in memory: a fingerprint of them would
        ** name this engine's blocks after another model */
        return kvt__fail(KVT_EIO,
                         "model file '%s' changed since it was loaded (%lld bytes then, %lld now): restart to "
                         "fingerprint it",
                         e->model_path, (long long) e->model_size, (long long) st.st_size);
    }
    enum { CHUNK = 1 << 20 };
    unsigned char *buf = malloc(CHUNK);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    int rc = 0;
    if (!buf || !md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        rc = kvt__fail(KVT_ENOMEM, "SHA-256 state to fingerprint '%s'", e->model_path);
        goto done;
    }
    int64_t total = 0;
    for (;;) {
        ssize_t r = read(fd, buf, CHUNK);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = kvt__fail(KVT_EIO, "reading model file '%s' at byte %lld: %s", e->model_path, (long long) total, strerror(errno));
            goto done;
        }
        if (r == 0) break;
        EVP_DigestUpdate(md, buf, (size_t) r);
        total += r;
    }
    if (total != e->model_size) {
        rc = kvt__fail(KVT_EIO, "model file '%s' read %lld bytes, expected %lld", e->model_path, (long long) total,
                       (long long) e->model_size);
        goto done;
    }
    unsigned int len = 0;
    EVP_DigestFinal_ex(md, e->fingerprint.b, &len);
    e->have_fp = true;
    *out = e->fingerprint;
done:
    EVP_MD_CTX_free(md);
    free(buf);
    close(fd);
    return rc;
}

/* The blob format (src/kv/blob.h: canonical one-stream form), the llama.cpp build whose state
** serialisation wrote it, the cache element types, and flash attention (it decides whether V is
** stored transposed).  The model's own shape (layers, heads, window, RoPE) is in the fingerprint. */
void kvt_engine_layout(const kvt_engine *e, char *buf, size_t n) {
    if (!buf || n == 0) return;
    snprintf(buf, n, "kvtier-blob/1 k=%s v=%s fa=%d parts=%d | %s", e->info.type_k, e->info.type_v, e->p.flash_attn ? 1 : 0,
             e->n_parts, KVT_LLAMA_BUILD);
}
