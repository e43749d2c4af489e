/* codec.c — block codecs (kvtier.h section 9): the self-describing container, the codec names
** and parameters, and the walk over a blob's K/V tensors.  The per-tensor coders are in
** codec_tensor.c.
**
** Encoded bytes (host byte order, which is little-endian on every platform llama.cpp's state
** format is used on):
**   0   "KVTC"            magic
**   4   u16 version       KVT_CODEC_VERSION (3), or KVT_CODEC_VERSION_HEADS (4) with the table at
**                         104; versions 1 and 2 are the same with SHA-256 (written before the
**                         codecs ran at memory speed, issue #43; still read)
**   6   u16 codec         enum kvt_codec_id
**   8   u32 header bytes  (HDR_BYTES)
**   12  i32 n_head_kv, group_k, group_v ; f32 s_k, s_v ; i32 n_sink
**   36  i32 p0, n_tokens, n_cells, n_cells_swa ; u32 n_parts
**   56  u64 raw bytes ; u64 payload bytes
**   72  checksum of the payload (32 bytes): XXH3-128 in canonical (big-endian) order then 16
**       zero bytes (versions 3, 4), SHA-256 (1, 2).  A check against damage, not a signature:
**       whoever can write a store can write a matching checksum of either kind
**   104 (versions 4 and 2: per-head bits) u32 n_units ; u32 0 ; n_units x u8 bits (4 or 8), zero-
**       padded to a multiple of 8 bytes; the checksum then covers this table and the payload
**   hb  payload: u32 n_sections ; u64 residue bytes ;
**                n_sections x { u64 off ; u64 len ; u32 n_cells ; u32 n_embd ; u8 kind ;
**                               u8 trans ; u8 elsize ; u8 pad ; u32 layer (v2; v1: 0) ; u64 enc_len } ;
**                residue (the blob's bytes outside the sections, in order) ; the sections.
** raw has no sections: the residue is the whole blob. */
#include "kv/codec.h"
#include "kv/blob.h"
#include "fault.h"
#include "internal.h"

#include "ggml.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HDR_BYTES 104
/* Header bytes of a version-2 header with n per-head entries (the table, padded to 8). */
static size_t hdr_bytes_heads(uint32_t n) { return HDR_BYTES + 8 + ((size_t) n + 7) / 8 * 8; }
#define SEC_BYTES 40
static const uint8_t MAGIC[4] = { 'K', 'V', 'T', 'C' };

static const char *const NAMES[KVT_CODEC__COUNT] = { "raw", "q8", "q4", "elastic", "elastic+q8", "elastic+q4", "ecq" };

const char *kvt_codec_name(int32_t codec) { return codec >= 0 && codec < KVT_CODEC__COUNT ? NAMES[codec] : "unknown"; }

struct kvt_codec_params kvt_codec_default_params(int32_t codec) {
    bool el = codec == KVT_CODEC_ELASTIC || codec == KVT_CODEC_ELASTIC_Q8 || codec == KVT_CODEC_ELASTIC_Q4;
    struct kvt_codec_params p = {
        codec >= 0 && codec < KVT_CODEC__COUNT ? codec : KVT_CODEC_RAW, 0, 64, 64, 0.45f, 0.50f, el ? 64 : 0, NULL, 0
    };
    if (codec == KVT_CODEC_ECQ) p.s_k = p.s_v = KVT__ECQ_STEP;
    return p;
}

int kvt__codec_check(const struct kvt_codec_params *p) {
    if (p->head_bits || p->n_head_bits) {
        if (p->codec != KVT_CODEC_Q8 && p->codec != KVT_CODEC_Q4)
            return kvt__fail(KVT_EINVAL, "codec %s: per-head bits apply to q8 and q4 only", kvt_codec_name(p->codec));
        if (!p->head_bits || p->n_head_bits < 1 || p->n_head_kv < 1 || p->n_head_bits % p->n_head_kv ||
            p->n_head_bits > KVT__MAX_LAYERS * KVT__MAX_HEADS)
            return kvt__fail(KVT_EINVAL, "codec %s: per-head bits table of %d entries is not layers x %d KV heads",
                             kvt_codec_name(p->codec), p->n_head_bits, p->n_head_kv);
        for (int32_t i = 0; i < p->n_head_bits; i++)
            if (p->head_bits[i] != 4 && p->head_bits[i] != 8)
                return kvt__fail(KVT_EINVAL, "codec %s: per-head bits entry %d is %u (4 or 8)", kvt_codec_name(p->codec), i,
                                 p->head_bits[i]);
    }
    if (p->codec < 0 || p->codec >= KVT_CODEC__COUNT)
        return kvt__fail(KVT_EINVAL, "codec id %d is not a codec (0..%d)", p->codec, KVT_CODEC__COUNT - 1);
    if (p->n_head_kv < 0 || p->n_head_kv > KVT__MAX_HEADS)
        return kvt__fail(KVT_EINVAL, "codec %s: n_head_kv %d outside 0..%d", kvt_codec_name(p->codec), p->n_head_kv,
                         KVT__MAX_HEADS);
    if (p->group_k < 1 || p->group_k > 65536 || p->group_v < 1 || p->group_v > 65536)
        return kvt__fail(KVT_EINVAL, "codec %s: group sizes %d (K) / %d (V) outside 1..65536", kvt_codec_name(p->codec), p->group_k,
                         p->group_v);
    if (!(p->s_k > 0 && p->s_k <= 10) || !(p->s_v > 0 && p->s_v <= 10))
        return kvt__fail(KVT_EINVAL, "codec %s: threshold scales %g (K) / %g (V) outside (0, 10]", kvt_codec_name(p->codec),
                         (double) p->s_k, (double) p->s_v);
    if (p->n_sink < 0 || p->n_sink > (1 << 30))
        return kvt__fail(KVT_EINVAL, "codec %s: n_sink %d outside 0..2^30", kvt_codec_name(p->codec), p->n_sink);
    return 0;
}

int kvt_codec_parse(const char *spec, struct kvt_codec_params *out) {
    if (!spec || !out) return kvt__fail(KVT_EINVAL, "codec spec is NULL");
    size_t nl = strcspn(spec, ":");
    int32_t id = -1;
    for (int i = 0; i < KVT_CODEC__COUNT; i++)
        if (strlen(NAMES[i]) == nl && !strncmp(spec, NAMES[i], nl)) id = i;
    if (id < 0)
        return kvt__fail(KVT_EINVAL, "unknown codec '%.*s' in '%s' (expected raw, q8, q4, elastic, elastic+q8, elastic+q4, ecq)",
                         (int) nl, spec, spec);
    struct kvt_codec_params p = kvt_codec_default_params(id);
    if (spec[nl] == ':') {
        const char *a = spec + nl + 1;
        const bool q = id == KVT_CODEC_Q8 || id == KVT_CODEC_Q4;
        int max = id == KVT_CODEC_RAW ? 0 : 3;
        for (int k = 0;; k++) {
            size_t len = strcspn(a, ",");
            if (k >= max)
                return kvt__fail(KVT_EINVAL, "codec '%s': %s takes at most %d value%s (%s)", spec, NAMES[id], max,
                                 max == 1 ? "" : "s",
                                 max == 0              ? "no arguments"
                                 : q                   ? "K group cells, V group channels, sink tokens"
                                 : id == KVT_CODEC_ECQ ? "K step, V step (x each group's standard deviation), sink tokens"
                                                       : "s_K, s_V, sink tokens");
            char tmp[64], *end;
            if (len == 0 || len >= sizeof tmp)
                return kvt__fail(KVT_EINVAL, "codec '%s': value %d is empty or too long", spec, k + 1);
            memcpy(tmp, a, len);
            tmp[len] = '\0';
            errno = 0;
            bool scale = !q && k < 2;
            double v = scale ? strtod(tmp, &end) : (double) strtol(tmp, &end, 10);
            if (*end || errno == ERANGE)
                return kvt__fail(KVT_EINVAL, "codec '%s': '%s' is not %s", spec, tmp, scale ? "a number" : "an integer");
            if (scale) {
                if (!(v > 0 && v <= 10)) return kvt__fail(KVT_EINVAL, "codec '%s': threshold scale %s outside (0, 10]", spec, tmp);
                *(k == 0 ? &p.s_k : &p.s_v) = (float) v;
            } else if (k == 2) {
                if (v < 0 || v > (1 << 30)) return kvt__fail(KVT_EINVAL, "codec '%s': sink tokens %s outside 0..2^30", spec, tmp);
                p.n_sink = (int32_t) v;
            } else {
                if (v < 1 || v > 65536) return kvt__fail(KVT_EINVAL, "codec '%s': group size %s outside 1..65536", spec, tmp);
                *(k == 0 ? &p.group_k : &p.group_v) = (int32_t) v;
            }
            if (!a[len]) break;
            a += len + 1;
        }
    } else if (spec[nl]) {
        return kvt__fail(KVT_EINVAL, "codec '%s': unexpected '%s'", spec, spec + nl);
    }
    *out = p;
    return 0;
}

/* The container's checksum over the per-head table and the payload (codec.h). */
int kvt__codec_digest(int version, const uint8_t *p, size_t n, uint8_t md[32]) {
    static const uint8_t empty = 0;
    memset(md, 0, 32);
    if (version == KVT_CODEC_VERSION || version == KVT_CODEC_VERSION_HEADS) {
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(n ? p : &empty, n));
        memcpy(md, c.digest, sizeof c.digest);
        return 0;
    }
    unsigned len = 0;
    if (EVP_Digest(n ? p : &empty, n, md, &len, EVP_sha256(), NULL) != 1 || len != 32)
        return kvt__fail(KVT_ENOMEM, "codec: SHA-256 of %zu bytes failed (OpenSSL)", n);
    return 0;
}

/* What the version's checksum is called, for messages. */
static const char *digest_name(int version) { return version >= KVT_CODEC_VERSION ? "XXH3-128" : "SHA-256"; }

/* Versions whose header carries the per-head bits table. */
static bool has_heads(int version) { return version == KVT_CODEC_VERSION_HEADS || version == KVT_CODEC_VERSION_HEADS_SHA256; }

/* Parse a blob whose part count is not known: iSWA blobs have two parts.  A blob parses with
** exactly one count (one part leaves the second as trailing bytes; two run out of bytes). */
static int parse_any(const uint8_t *buf, size_t n, int hint, struct kvt__blob_layout *L, int *n_parts) {
    int first = hint == 2 ? 2 : 1;
    if (kvt__blob_parse(buf, n, first, L) == 0) {
        *n_parts = first;
        return 0;
    }
    char msg[256];
    snprintf(msg, sizeof msg, "%s", kvt_errmsg());
    if (kvt__blob_parse(buf, n, 3 - first, L) == 0) {
        *n_parts = 3 - first;
        return 0;
    }
    return kvt__fail(KVT_EFORMAT, "codec: the block parses neither as %d nor as %d part(s): %s", first, 3 - first, msg);
}

struct sec {
    uint64_t off, len;
    uint32_t n_cells, n_embd;
    uint32_t layer; /* in blob order: part 0's layers, then part 1's */
    uint8_t kind, trans, elsize;
    uint64_t enc_len;
};

static int elsize_of(int32_t type) { return type == GGML_TYPE_F16 ? 2 : type == GGML_TYPE_F32 ? 4 : 0; }

/* The K/V tensors of a parsed blob, in blob order.  OUT *out (malloc'd), *n. */
static int list_sections(const struct kvt__blob_layout *L, struct sec **out, int *n) {
    int cap = 0;
    for (int p = 0; p < L->n_parts; p++) cap += 2 * (int) (L->part[p].n_cells ? L->part[p].n_layer : 0);
    struct sec *S = calloc((size_t) cap + 1, sizeof *S);
    if (!S) return kvt__fail(KVT_ENOMEM, "codec: section table");
    int k = 0;
    for (int p = 0, l0 = 0; p < L->n_parts; l0 += (int) L->part[p].n_layer, p++) {
        const struct kvt__blob_part *P = &L->part[p];
        if (!P->n_cells) continue;
        for (uint32_t l = 0; l < P->n_layer; l++) {
            int es = elsize_of(P->k_type[l]);
            if (!es || P->k_row_bytes[l] % (uint64_t) es) {
                free(S);
                return kvt__fail(KVT_EUNSUPPORTED,
                                 "codec: part %d layer %u: K cache type %s cannot be coded lossily "
                                 "(F16 or F32 only; keep the block raw)",
                                 p, l, ggml_type_name((enum ggml_type) P->k_type[l]));
            }
            S[k++] = (struct sec){ P->k_off[l],
                                   P->k_row_bytes[l] * P->n_cells,
                                   P->n_cells,
                                   (uint32_t) (P->k_row_bytes[l] / (uint64_t) es),
                                   (uint32_t) l0 + l,
                                   KVT__SEC_K,
                                   0,
                                   (uint8_t) es,
                                   0 };
        }
        for (uint32_t l = 0; l < P->n_layer; l++) {
            int es = elsize_of(P->v_type[l]);
            uint64_t row = P->v_trans ? (uint64_t) P->v_row_bytes[l] * P->v_n_embd[l] : P->v_row_bytes[l];
            if (!es || (P->v_trans ? P->v_row_bytes[l] != (uint64_t) es : row % (uint64_t) es != 0)) {
                free(S);
                return kvt__fail(KVT_EUNSUPPORTED,
                                 "codec: part %d layer %u: V cache type %s cannot be coded lossily "
                                 "(F16 or F32 only; keep the block raw)",
                                 p, l, ggml_type_name((enum ggml_type) P->v_type[l]));
            }
            S[k++] = (struct sec){ P->v_off[l],
                                   row * P->n_cells,
                                   P->n_cells,
                                   (uint32_t) (row / (uint64_t) es),
                                   (uint32_t) l0 + l,
                                   KVT__SEC_V,
                                   (uint8_t) (P->v_trans != 0),
                                   (uint8_t) es,
                                   0 };
        }
    }
    *out = S;
    *n = k;
    return 0;
}

static void write_header(uint8_t *h, const struct kvt_codec_params *p, const kvt_blob *blob, int n_parts, uint64_t payload,
                         const uint8_t md[32]) {
    uint16_t ver = p->head_bits ? KVT_CODEC_VERSION_HEADS : KVT_CODEC_VERSION, id = (uint16_t) p->codec;
    uint32_t hb = (uint32_t) (p->head_bits ? hdr_bytes_heads((uint32_t) p->n_head_bits) : HDR_BYTES);
    uint32_t np = (uint32_t) n_parts;
    uint64_t raw = blob->size;
    memcpy(h, MAGIC, 4);
    memcpy(h + 4, &ver, 2);
    memcpy(h + 6, &id, 2);
    memcpy(h + 8, &hb, 4);
    int32_t i32[4] = { p->n_head_kv, p->group_k, p->group_v, 0 };
    memcpy(h + 12, i32, 12);
    memcpy(h + 24, &p->s_k, 4);
    memcpy(h + 28, &p->s_v, 4);
    memcpy(h + 32, &p->n_sink, 4);
    int32_t b4[4] = { blob->p0, blob->n_tokens, blob->n_cells, blob->n_cells_swa };
    memcpy(h + 36, b4, 16);
    memcpy(h + 52, &np, 4);
    memcpy(h + 56, &raw, 8);
    memcpy(h + 64, &payload, 8);
    memcpy(h + 72, md, 32);
}

int kvt_codec_encode(const kvt_blob *blob, const struct kvt_codec_params *p, uint8_t **out, size_t *n,
                     struct kvt_codec_stats *stats) {
    if (out) *out = NULL;
    if (n) *n = 0;
    if (!blob || !blob->data || !p || !out || !n) return kvt__fail(KVT_EINVAL, "codec encode: NULL argument");
    int rc = kvt__codec_check(p);
    if (rc) return rc;
    struct kvt__blob_layout *L = malloc(sizeof *L);
    if (!L) return kvt__fail(KVT_ENOMEM, "codec: blob layout");
    int n_parts = 0, n_sec = 0;
    struct sec *S = NULL;
    bool *raw_cell = NULL;
    struct kvt__buf pay = { 0 };
    int64_t n_elems = 0, n_lossy = 0, n_zeroed = 0;
    if ((rc = parse_any(blob->data, blob->size, blob->n_cells_swa > 0 ? 2 : 1, L, &n_parts))) goto out;
    if (p->codec != KVT_CODEC_RAW && (rc = list_sections(L, &S, &n_sec))) goto out;
    int n_head = p->n_head_kv > 0 ? p->n_head_kv : 1;
    for (int s = 0; s < n_sec; s++)
        if (S[s].n_embd % (uint32_t) n_head) {
            rc = kvt__fail(KVT_EUNSUPPORTED, "codec %s: a row of %u elements does not split into %d KV heads",
                           kvt_codec_name(p->codec), S[s].n_embd, n_head);
            goto out;
        }
    if (p->head_bits) { /* one entry per (layer, KV head) of the blob; V groups within one head */
        int32_t n_layers = 0;
        for (int q = 0; q < L->n_parts; q++) n_layers += (int32_t) L->part[q].n_layer;
        if (p->n_head_bits != n_layers * n_head) {
            rc = kvt__fail(KVT_EINVAL,
                           "codec %s: per-head bits table of %d entries, the block has %d layers x %d "
                           "KV heads",
                           kvt_codec_name(p->codec), p->n_head_bits, n_layers, n_head);
            goto out;
        }
        for (int s = 0; s < n_sec; s++)
            if ((S[s].n_embd / (uint32_t) n_head) % (uint32_t) p->group_v) {
                rc = kvt__fail(KVT_EINVAL,
                               "codec %s: per-head bits need V groups within a head: head_dim %u is "
                               "not a multiple of group_v %d",
                               kvt_codec_name(p->codec), S[s].n_embd / (uint32_t) n_head, p->group_v);
                goto out;
            }
    }
    /* one buffer, written once: the header and per-head table (filled in last), the section
    ** table (its encoded lengths filled in after the sections), the residue, the sections */
    const size_t hb = p->head_bits ? hdr_bytes_heads((uint32_t) p->n_head_bits) : HDR_BYTES;
    const size_t tab = hb + 12;
    uint64_t covered = 0;
    for (int s = 0; s < n_sec; s++) covered += S[s].len;
    kvt__buf_reserve(&pay, tab + (size_t) n_sec * SEC_BYTES + blob->size + 4096);
    kvt__buf_zero(&pay, tab + (size_t) n_sec * SEC_BYTES);
    uint64_t at = 0;
    for (int s = 0; s <= n_sec; s++) {
        uint64_t end = s < n_sec ? S[s].off : blob->size;
        kvt__buf_put(&pay, blob->data + at, end - at);
        if (s < n_sec) at = S[s].off + S[s].len;
    }
    for (int s = 0, p_i = -1, cells_seen = 0; s < n_sec; s++) {
        /* which part this section belongs to: sections are grouped by part, 2 * n_layer each */
        if (s == 0 || s >= cells_seen) {
            do { p_i++; } while (!L->part[p_i].n_cells);
            cells_seen += 2 * (int) L->part[p_i].n_layer;
            free(raw_cell);
            uint32_t nc = L->part[p_i].n_cells;
            if (!(raw_cell = malloc(nc))) {
                rc = kvt__fail(KVT_ENOMEM, "codec: cell flags");
                goto out;
            }
            for (uint32_t c = 0; c < nc; c++) raw_cell[c] = kvt__blob_cell_pos(blob->data, L, p_i, c) < p->n_sink;
        }
        struct kvt__mat m = { blob->data + S[s].off, S[s].n_cells, S[s].n_embd, S[s].elsize, S[s].trans };
        size_t before = pay.n;
        const uint8_t *hbt = p->head_bits ? p->head_bits + (size_t) S[s].layer * (size_t) n_head : NULL;
        if ((rc = kvt__sec_encode(&pay, &m, raw_cell, S[s].kind, p, n_head, &n_lossy, &n_zeroed, hbt))) goto out;
        S[s].enc_len = pay.n - before;
        n_elems += (int64_t) S[s].n_cells * S[s].n_embd;
    }
    if (pay.err) {
        rc = kvt__fail(KVT_ENOMEM, "codec: payload of %zu bytes", pay.n);
        goto out;
    }
    uint8_t *res = pay.p;
    uint32_t ns = (uint32_t) n_sec;
    uint64_t residue = blob->size - covered;
    memcpy(res + hb, &ns, 4);
    memcpy(res + hb + 4, &residue, 8);
    for (int s = 0; s < n_sec; s++) {
        uint8_t *t = res + tab + (size_t) s * SEC_BYTES;
        uint32_t layer = p->head_bits ? S[s].layer : 0;
        memcpy(t, &S[s].off, 8);
        memcpy(t + 8, &S[s].len, 8);
        memcpy(t + 16, &S[s].n_cells, 4);
        memcpy(t + 20, &S[s].n_embd, 4);
        t[24] = S[s].kind;
        t[25] = S[s].trans;
        t[26] = S[s].elsize;
        t[27] = 0;
        memcpy(t + 28, &layer, 4);
        memcpy(t + 32, &S[s].enc_len, 8);
    }
    if (p->head_bits) {
        uint32_t nu = (uint32_t) p->n_head_bits;
        memcpy(res + HDR_BYTES, &nu, 4);
        memcpy(res + HDR_BYTES + 8, p->head_bits, nu);
    }
    uint8_t md[32];
    const int ver = p->head_bits ? KVT_CODEC_VERSION_HEADS : KVT_CODEC_VERSION;
    if ((rc = kvt__codec_digest(ver, res + HDR_BYTES, pay.n - HDR_BYTES, md))) goto out; /* table + payload */
    write_header(res, p, blob, n_parts, pay.n - hb, md);
    uint8_t *fit = realloc(res, pay.n); /* give back the reserve (the encoded block may be kept) */
    *out = fit ? fit : res;
    *n = pay.n;
    pay.p = NULL;
    if (stats) *stats = (struct kvt_codec_stats){ blob->size, *n, n_elems, n_lossy, n_zeroed };
out:
    free(L);
    free(S);
    free(raw_cell);
    free(pay.p);
    return rc;
}

/* Header fields; also the part count. */
static int read_header(const uint8_t *h, size_t n, struct kvt_codec_info *o, uint32_t *n_parts, const uint8_t **md) {
    if (!h) return kvt__fail(KVT_EFORMAT, "codec: no bytes");
    if (n < 8 || memcmp(h, MAGIC, 4) != 0)
        return kvt__fail(KVT_EFORMAT, "codec: not kvtier codec bytes (magic %02x%02x%02x%02x, expected \"KVTC\"; %zu bytes)",
                         n > 0 ? h[0] : 0, n > 1 ? h[1] : 0, n > 2 ? h[2] : 0, n > 3 ? h[3] : 0, n);
    uint16_t ver, id;
    memcpy(&ver, h + 4, 2);
    memcpy(&id, h + 6, 2);
    if (ver < KVT_CODEC_VERSION_SHA256 || ver > KVT_CODEC_VERSION_HEADS)
        return kvt__fail(KVT_EFORMAT, "codec: format version %u, this build reads versions %d to %d", ver, KVT_CODEC_VERSION_SHA256,
                         KVT_CODEC_VERSION_HEADS);
    if (id >= KVT_CODEC__COUNT) return kvt__fail(KVT_EFORMAT, "codec: unknown codec id %u (0..%d known)", id, KVT_CODEC__COUNT - 1);
    uint32_t hb;
    if (n < HDR_BYTES) return kvt__fail(KVT_EFORMAT, "codec: header truncated (%zu of %d bytes)", n, HDR_BYTES);
    memcpy(&hb, h + 8, 4);
    uint32_t nu = 0;
    if (has_heads(ver)) { /* the per-head bits table */
        if (n < HDR_BYTES + 8) return kvt__fail(KVT_EFORMAT, "codec: header truncated before its per-head table (%zu bytes)", n);
        memcpy(&nu, h + HDR_BYTES, 4);
        if (nu < 1 || nu > KVT__MAX_LAYERS * KVT__MAX_HEADS || hb != hdr_bytes_heads(nu))
            return kvt__fail(KVT_EFORMAT, "codec: per-head table of %u entries in a header of %u bytes", nu, hb);
        if (n < hb) return kvt__fail(KVT_EFORMAT, "codec: header truncated (%zu of %u bytes)", n, hb);
    } else if (hb != HDR_BYTES) {
        return kvt__fail(KVT_EFORMAT, "codec: header of %u bytes, version %u has %d", hb, ver, HDR_BYTES);
    }
    memset(o, 0, sizeof *o);
    if (nu) {
        o->params.head_bits = h + HDR_BYTES + 8;
        o->params.n_head_bits = (int32_t) nu;
    }
    o->version = ver;
    o->params.codec = id;
    memcpy(&o->params.n_head_kv, h + 12, 4);
    memcpy(&o->params.group_k, h + 16, 4);
    memcpy(&o->params.group_v, h + 20, 4);
    memcpy(&o->params.s_k, h + 24, 4);
    memcpy(&o->params.s_v, h + 28, 4);
    memcpy(&o->params.n_sink, h + 32, 4);
    memcpy(&o->p0, h + 36, 4);
    memcpy(&o->n_tokens, h + 40, 4);
    memcpy(&o->n_cells, h + 44, 4);
    memcpy(&o->n_cells_swa, h + 48, 4);
    memcpy(n_parts, h + 52, 4);
    uint64_t raw, pay;
    memcpy(&raw, h + 56, 8);
    memcpy(&pay, h + 64, 8);
    *md = h + 72;
    if (kvt__codec_check(&o->params)) {
        char why[256];
        snprintf(why, sizeof why, "%s", kvt_errmsg()); /* kvt__fail writes the message buffer */
        return kvt__fail(KVT_EFORMAT, "codec: header parameters invalid: %s", why);
    }
    if (*n_parts < 1 || *n_parts > 2) return kvt__fail(KVT_EFORMAT, "codec: header says %u parts (1 or 2)", *n_parts);
    if (pay > (uint64_t) 1 << 40 || raw > (uint64_t) 1 << 40)
        return kvt__fail(KVT_EFORMAT, "codec: header sizes %llu / %llu bytes are implausible", (unsigned long long) raw,
                         (unsigned long long) pay);
    o->raw_bytes = (size_t) raw;
    o->encoded_bytes = hb + (size_t) pay;
    return 0;
}

int kvt_codec_inspect(const void *data, size_t n, struct kvt_codec_info *out) {
    uint32_t np;
    const uint8_t *md;
    struct kvt_codec_info tmp;
    return read_header(data, n, out ? out : &tmp, &np, &md);
}

int kvt_codec_decode(const void *data, size_t n, kvt_blob **out) {
    if (!out) return kvt__fail(KVT_EINVAL, "codec decode: NULL out");
    *out = NULL;
    const uint8_t *h = data;
    struct kvt_codec_info I;
    uint32_t n_parts = 0;     /* set by read_header: initialised for a Release build (-O3), */
    const uint8_t *md = NULL; /* which cannot see it through the error paths */
    int rc = read_header(h, n, &I, &n_parts, &md);
    if (rc) return rc;
    const size_t hb = I.params.head_bits ? hdr_bytes_heads((uint32_t) I.params.n_head_bits) : HDR_BYTES;
    if (n != I.encoded_bytes)
        return kvt__fail(KVT_ECORRUPT, "codec: %zu bytes, the header says %zu (header %zu + payload %zu)%s", n, I.encoded_bytes, hb,
                         I.encoded_bytes - hb, n < I.encoded_bytes ? ": truncated" : "");
    const uint8_t *pay = h + hb;
    size_t pn = n - hb;
    uint8_t dig[32];
    if ((rc = kvt__codec_digest(I.version, h + HDR_BYTES, n - HDR_BYTES, dig))) return rc; /* per-head table + payload */
    if (memcmp(dig, md, 32) != 0)
        return kvt__fail(KVT_ECORRUPT, "codec: payload of %zu bytes (%s block at p0 %d) failed its %s check", pn,
                         kvt_codec_name(I.params.codec), I.p0, digest_name(I.version));
    if (pn < 12) return kvt__fail(KVT_ECORRUPT, "codec: payload of %zu bytes has no section table", pn);
    uint32_t n_sec;
    uint64_t residue;
    memcpy(&n_sec, pay, 4);
    memcpy(&residue, pay + 4, 8);
    if ((I.params.codec == KVT_CODEC_RAW) != (n_sec == 0) || n_sec > 4 * KVT__MAX_LAYERS || (uint64_t) n_sec * SEC_BYTES > pn - 12)
        return kvt__fail(KVT_ECORRUPT, "codec: %u sections for codec %s in a payload of %zu bytes", n_sec,
                         kvt_codec_name(I.params.codec), pn);
    const uint8_t *tab = pay + 12, *res = tab + (size_t) n_sec * SEC_BYTES;
    size_t left = pn - 12 - (size_t) n_sec * SEC_BYTES;
    if (residue > left || residue > I.raw_bytes)
        return kvt__fail(KVT_ECORRUPT, "codec: residue of %llu bytes exceeds the payload (%zu left) or the block (%zu)",
                         (unsigned long long) residue, left, I.raw_bytes);
    const uint8_t *enc = res + residue;
    left -= residue;
    /* before allocating the block: the sizes must add up, the encoded sections must lie in the
    ** payload, and no section may claim more than its encoding could describe (the sparsest, a
    ** 1-bit mask of F32, is 32x smaller): the block allocated is then at most ~64x the bytes
    ** given, whatever the header says.  No sum can overflow: each term is at most the payload
    ** or the raw size (both < 2^41), and there are at most 4 * KVT__MAX_LAYERS of them. */
    uint64_t total = residue, enc_total = 0;
    for (uint32_t s = 0; s < n_sec; s++) {
        uint64_t len, el;
        memcpy(&len, tab + (size_t) s * SEC_BYTES + 8, 8);
        memcpy(&el, tab + (size_t) s * SEC_BYTES + 32, 8);
        if (el > left - enc_total)
            return kvt__fail(KVT_ECORRUPT, "codec: section %u claims %llu encoded bytes, %llu of the payload are left", s,
                             (unsigned long long) el, (unsigned long long) (left - enc_total));
        enc_total += el;
        if (len > I.raw_bytes || len > 64 * el + 4096)
            return kvt__fail(KVT_ECORRUPT, "codec: section %u claims %llu bytes from %llu encoded", s, (unsigned long long) len,
                             (unsigned long long) el);
        total += len;
    }
    if (total != I.raw_bytes)
        return kvt__fail(KVT_ECORRUPT, "codec: residue and sections make %llu bytes, the header says %zu",
                         (unsigned long long) total, I.raw_bytes);
    kvt_blob *b = calloc(1, sizeof *b);
    uint8_t *buf = malloc(I.raw_bytes ? I.raw_bytes : 1);
    struct kvt__blob_layout *L = malloc(sizeof *L);
    if (!b || !buf || !L || kvt__fault_check(KVT__FAULT_CODEC_ALLOC)) {
        rc = kvt__fail(KVT_ENOMEM, "codec: block of %zu bytes", I.raw_bytes);
        goto fail;
    }
    uint64_t at = 0, r_at = 0, e_at = 0;
    int n_head = I.params.n_head_kv > 0 ? I.params.n_head_kv : 1;
    for (uint32_t s = 0; s <= n_sec; s++) {
        struct sec S = { 0 };
        if (s < n_sec) {
            const uint8_t *t = tab + (size_t) s * SEC_BYTES;
            memcpy(&S.off, t, 8);
            memcpy(&S.len, t + 8, 8);
            memcpy(&S.n_cells, t + 16, 4);
            memcpy(&S.n_embd, t + 20, 4);
            S.kind = t[24];
            S.trans = t[25];
            S.elsize = t[26];
            memcpy(&S.layer, t + 28, 4);
            memcpy(&S.enc_len, t + 32, 8);
        } else {
            S.off = I.raw_bytes;
        }
        /* the residue before this section */
        if (S.off < at || S.off > I.raw_bytes || S.off - at > residue - r_at) {
            rc = kvt__fail(KVT_ECORRUPT, "codec: section %u at offset %llu overlaps, leaves the block (%zu bytes) or the residue",
                           s, (unsigned long long) S.off, I.raw_bytes);
            goto fail;
        }
        memcpy(buf + at, res + r_at, S.off - at);
        r_at += S.off - at;
        at = S.off;
        if (s == n_sec) break;
        char what[64];
        snprintf(what, sizeof what, "section %u (%s)", s, S.kind == KVT__SEC_K ? "K" : "V");
        if (S.kind > 1 || S.trans > 1 || (S.elsize != 2 && S.elsize != 4) || S.n_embd == 0 || S.n_embd > (1u << 24) ||
            S.n_cells > (1u << 24) || S.n_embd % (uint32_t) n_head || S.len != (uint64_t) S.n_cells * S.n_embd * S.elsize ||
            S.len > I.raw_bytes - at || S.enc_len > left - e_at) {
            rc = kvt__fail(KVT_ECORRUPT,
                           "codec: %s: shape %u x %u x %u bytes, length %llu, encoded %llu inconsistent "
                           "with the block",
                           what, S.n_cells, S.n_embd, S.elsize, (unsigned long long) S.len, (unsigned long long) S.enc_len);
            goto fail;
        }
        const uint8_t *hbits = NULL;
        if (I.params.head_bits) {
            if (S.layer >= (uint32_t) (I.params.n_head_bits / n_head) ||
                (S.n_embd / (uint32_t) n_head) % (uint32_t) I.params.group_v) {
                rc = kvt__fail(KVT_ECORRUPT,
                               "codec: %s: layer %u outside the per-head table of %d layers x %d heads, "
                               "or head_dim %u not a multiple of group_v %d",
                               what, S.layer, I.params.n_head_bits / n_head, n_head, S.n_embd / (uint32_t) n_head,
                               I.params.group_v);
                goto fail;
            }
            hbits = I.params.head_bits + (size_t) S.layer * (size_t) n_head;
        }
        struct kvt__mat m = { buf + at, S.n_cells, S.n_embd, S.elsize, S.trans != 0 };
        if ((rc = kvt__sec_decode(enc + e_at, S.enc_len, &m, S.kind, &I.params, n_head, what, hbits))) goto fail;
        e_at += S.enc_len;
        at += S.len;
    }
    if (r_at != residue || e_at != left) {
        rc = kvt__fail(KVT_ECORRUPT, "codec: %llu of %llu residue bytes and %llu of %zu section bytes used",
                       (unsigned long long) r_at, (unsigned long long) residue, (unsigned long long) e_at, left);
        goto fail;
    }
    if (kvt__blob_parse(buf, I.raw_bytes, (int) n_parts, L) != 0) {
        rc = kvt__fail(KVT_ECORRUPT, "codec: the decoded block does not parse: %s", kvt_errmsg());
        goto fail;
    }
    if (I.params.head_bits &&
        (int64_t) (L->part[0].n_layer + (n_parts > 1 ? L->part[1].n_layer : 0)) * n_head != I.params.n_head_bits) {
        rc = kvt__fail(KVT_ECORRUPT, "codec: per-head table of %d entries, the decoded block has %u layers x %d KV heads",
                       I.params.n_head_bits, L->part[0].n_layer + (n_parts > 1 ? L->part[1].n_layer : 0), n_head);
        goto fail;
    }
    if (L->part[0].n_cells != (uint32_t) I.n_cells || (n_parts > 1 && L->part[1].n_cells != (uint32_t) I.n_cells_swa)) {
        rc = kvt__fail(KVT_ECORRUPT, "codec: the decoded block has %u / %u cells, the header says %d / %d", L->part[0].n_cells,
                       n_parts > 1 ? L->part[1].n_cells : 0, I.n_cells, I.n_cells_swa);
        goto fail;
    }
    free(L);
    b->data = buf;
    b->size = I.raw_bytes;
    b->p0 = I.p0;
    b->n_tokens = I.n_tokens;
    b->n_cells = I.n_cells;
    b->n_cells_swa = I.n_cells_swa;
    *out = b;
    return 0;
fail:
    free(L);
    free(buf);
    free(b);
    return rc;
}
