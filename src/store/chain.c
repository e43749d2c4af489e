/* chain.c — the block store's content keys (kvtier.h section 8): the chain of SHA-256 digests
** that names a block by its whole prefix, their hex form, tier names and the default directory.
**
** Encoding (all integers little-endian, every string length-prefixed, so that no two different
** parameter sets hash the same bytes):
**   h_0 = SHA-256( u32 12 | "kvtier-chain" | u32 KVT__CHAIN_VERSION | model[32] |
**                  u32 len | layout | i32 block | u32 len | tenant )
**   h_i = SHA-256( h_{i-1}[32] | tok_0 | tok_1 | ... )   each token as a little-endian int32
** h_{i-1} is fixed-size and tokens are fixed-size, so h_i's input is unambiguous too.
** Chunk keys (non-prefix chunk reuse): c_0 is h_0's input with "kvtier-chunk" for
** "kvtier-chain", and a block's chunk key is SHA-256(c_0 | its tokens): position-free.  Nothing
** depends on the process (no seed, no pointer, no locale): the same inputs give the same key in
** every process on every machine. */
#include "internal.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVT__CHAIN_VERSION 1u

static void put_u32(uint8_t b[4], uint32_t v) {
    b[0] = (uint8_t) v;
    b[1] = (uint8_t) (v >> 8);
    b[2] = (uint8_t) (v >> 16);
    b[3] = (uint8_t) (v >> 24);
}

static int update_u32(EVP_MD_CTX *c, uint32_t v) {
    uint8_t b[4];
    put_u32(b, v);
    return EVP_DigestUpdate(c, b, 4);
}

/* u32 length, then the bytes. */
static int update_str(EVP_MD_CTX *c, const char *s) {
    size_t n = s ? strlen(s) : 0;
    return update_u32(c, (uint32_t) n) && (n == 0 || EVP_DigestUpdate(c, s, n));
}

static int finish(EVP_MD_CTX *c, int ok, kvt_key *out) {
    unsigned len = 0;
    ok = ok && EVP_DigestFinal_ex(c, out->b, &len) == 1 && len == KVT_KEY_BYTES;
    EVP_MD_CTX_free(c);
    if (!ok) return kvt__fail(KVT_ENOMEM, "SHA-256 of a chain key failed (OpenSSL could not allocate)");
    return 0;
}

/* h_0 (domain "kvtier-chain") or c_0 (domain "kvtier-chunk": same length, so the two inputs
** differ in their domain bytes only). */
static int root(const char *fn, const char *domain, const struct kvt_chain_params *p, kvt_key *out) {
    if (!p || !out) return kvt__fail(KVT_EINVAL, "%s: NULL %s", fn, !p ? "params" : "out");
    if (!p->layout) return kvt__fail(KVT_EINVAL, "%s: layout is NULL (use kvt_engine_layout)", fn);
    if (p->block <= 0) return kvt__fail(KVT_EINVAL, "%s: block size %d is not positive", fn, p->block);
    if (strlen(p->layout) > UINT32_MAX || (p->tenant && strlen(p->tenant) > UINT32_MAX))
        return kvt__fail(KVT_EINVAL, "%s: layout or tenant longer than 4 GiB", fn);
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    if (!c) return kvt__fail(KVT_ENOMEM, "SHA-256 of a chain key: no memory for a digest context");
    int ok = EVP_DigestInit_ex(c, EVP_sha256(), NULL) == 1 && update_str(c, domain) && update_u32(c, KVT__CHAIN_VERSION) &&
             EVP_DigestUpdate(c, p->model.b, KVT_KEY_BYTES) && update_str(c, p->layout) && update_u32(c, (uint32_t) p->block) &&
             update_str(c, p->tenant);
    return finish(c, ok, out);
}

int kvt_chain_root(const struct kvt_chain_params *p, kvt_key *out) { return root("kvt_chain_root", "kvtier-chain", p, out); }

int kvt_chunk_root(const struct kvt_chain_params *p, kvt_key *out) { return root("kvt_chunk_root", "kvtier-chunk", p, out); }

int kvt_chain_next(const kvt_key *prev, const kvt_token *tok, int32_t n, kvt_key *out) {
    if (!prev || !out || n < 0 || (n > 0 && !tok))
        return kvt__fail(KVT_EINVAL, "kvt_chain_next: %s",
                         !prev   ? "prev is NULL"
                         : !out  ? "out is NULL"
                         : n < 0 ? "negative token count"
                                 : "tokens are NULL");
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    if (!c) return kvt__fail(KVT_ENOMEM, "SHA-256 of a chain key: no memory for a digest context");
    kvt_key h = *prev; /* prev may alias out */
    int ok = EVP_DigestInit_ex(c, EVP_sha256(), NULL) == 1 && EVP_DigestUpdate(c, h.b, KVT_KEY_BYTES);
    uint8_t buf[4 * 256];
    for (int32_t i = 0; ok && i < n;) {
        int32_t m = 0;
        for (; m < 256 && i < n; m++, i++) put_u32(buf + 4 * m, (uint32_t) tok[i]);
        ok = EVP_DigestUpdate(c, buf, (size_t) m * 4) == 1;
    }
    return finish(c, ok, out);
}

void kvt_key_hex(const kvt_key *k, char out[2 * KVT_KEY_BYTES + 1]) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < KVT_KEY_BYTES; i++) {
        out[2 * i] = digits[k->b[i] >> 4];
        out[2 * i + 1] = digits[k->b[i] & 15];
    }
    out[2 * KVT_KEY_BYTES] = '\0';
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int kvt_key_parse(const char *hex, kvt_key *out) {
    if (!hex || !out) return kvt__fail(KVT_EINVAL, "kvt_key_parse: NULL %s", !hex ? "text" : "out");
    kvt_key k;
    for (int i = 0; i < 2 * KVT_KEY_BYTES; i++) {
        int v = hexval(hex[i]);
        if (v < 0)
            return kvt__fail(KVT_EINVAL, "key '%.80s' is not %d hex digits (bad character at %d)", hex, 2 * KVT_KEY_BYTES, i);
        if (i % 2) k.b[i / 2] |= (uint8_t) v;
        else k.b[i / 2] = (uint8_t) (v << 4);
    }
    if (hex[2 * KVT_KEY_BYTES] != '\0')
        return kvt__fail(KVT_EINVAL, "key '%.80s' is longer than %d hex digits", hex, 2 * KVT_KEY_BYTES);
    *out = k;
    return 0;
}

const char *kvt_tier_name(int tier) {
    switch (tier) {
        case KVT_TIER_NONE: return "none";
        case KVT_TIER_RAM: return "ram";
        case KVT_TIER_DISK: return "disk";
        case KVT_TIER_REDIS: return "redis";
        default: return "unknown";
    }
}

int kvt_store_default_dir(char *buf, size_t n) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int len;
    if (!buf || n == 0) return kvt__fail(KVT_EINVAL, "kvt_store_default_dir: no buffer");
    buf[0] = '\0';
    /* the XDG base directory spec: a relative $XDG_CACHE_HOME is invalid and ignored */
    if (xdg && xdg[0] == '/') len = snprintf(buf, n, "%s/kvtier/store", xdg);
    else if (home && *home) len = snprintf(buf, n, "%s/.cache/kvtier/store", home);
    else return kvt__fail(KVT_EINVAL, "no store directory: neither $XDG_CACHE_HOME (absolute) nor $HOME is set");
    if (len < 0 || (size_t) len >= n) {
        buf[0] = '\0';
        return kvt__fail(KVT_EINVAL, "store directory path needs %d bytes, the buffer has %zu", len, n);
    }
    return 0;
}
