/* gen_corpus — writes the seed corpora of tests/fuzz/corpus/<harness>/ from the library's own
** encoders: synthetic blobs in llama.cpp's state format (F16/F32, V transposed or not, one or two
** parts, one or three stream records), each codec's encoding of them (q8/q4 also with per-head
** bits), single coded sections with the shape prefix fuzz_codec_tensor reads, blob-file / Redis
** values of raw and coded payloads; then truncated and bit-flipped variants of each.
**   fuzz_gen_corpus OUT_DIR      (writes OUT_DIR/<harness>/seed-*; deterministic)
** Run it again after a format change, and commit what it wrote (tests/fuzz/README.md). */
#include "fuzz.h"
#include "internal.h"
#include "kv/blob.h"
#include "kv/codec.h"
#include "store/store_int.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

static unsigned seed = 12345u;
static unsigned lcg(void) { return seed = seed * 1103515245u + 12345u; }

struct wb {
    uint8_t *p;
    size_t n, cap;
};
static void w(struct wb *b, const void *s, size_t k) {
    if (b->n + k > b->cap) {
        b->cap = (b->n + k) * 2;
        b->p = realloc(b->p, b->cap);
        FUZZ_CHECK(b->p);
    }
    memcpy(b->p + b->n, s, k);
    b->n += k;
}
static void w32(struct wb *b, uint32_t v) { w(b, &v, 4); }
static void w64(struct wb *b, uint64_t v) { w(b, &v, 8); }

static const char *root;
static int n_written;

static void put(const char *harness, const char *tag, const uint8_t *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", root, harness);
    if (mkdir(path, 0755) && errno != EEXIST) {
        perror(path);
        exit(1);
    }
    snprintf(path, sizeof path, "%s/%s/seed-%s", root, harness, tag);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f)) {
        perror(path);
        exit(1);
    }
    n_written++;
}

/* The bytes, then truncated at three points and with three single-bit flips. */
static void put_variants(const char *harness, const char *tag, const uint8_t *p, size_t n) {
    char t[128];
    put(harness, tag, p, n);
    uint8_t *x = malloc(n + 1);
    FUZZ_CHECK(x);
    const size_t cut[3] = { n / 3, n / 2, n - 1 };
    for (int i = 0; i < 3 && n > 1; i++) {
        snprintf(t, sizeof t, "%.96s-cut%zu", tag, cut[i]);
        put(harness, t, p, cut[i]);
    }
    for (int i = 0; i < 3 && n > 0; i++) {
        memcpy(x, p, n);
        size_t at = lcg() % n;
        x[at] ^= (uint8_t) (1u << (lcg() % 8));
        snprintf(t, sizeof t, "%.96s-flip%zu", tag, at);
        put(harness, t, x, n);
    }
    free(x);
}

struct shape {
    int n_parts, n_stream, type, v_trans, n_cells, p0;
};

static uint16_t f16(float f) {
    uint16_t h;
    struct kvt__mat m = { (uint8_t *) &h, 1, 1, 2, false };
    kvt__mat_set(&m, 0, 0, f);
    return h;
}

static void elem(struct wb *b, int type, float x) {
    if (type == 0) w(b, &x, 4);
    else {
        uint16_t h = f16(x);
        w(b, &h, 2);
    }
}

static float rnd(void) { return (float) ((lcg() >> 8) & 0xffff) / 65536.0f * 2 - 1; }

enum { N_LAYER = 2, N_EMBD = 8 };

static kvt_blob syn(const struct shape *S) {
    struct wb b = { 0 };
    w32(&b, KVT__BLOB_MAGIC);
    w32(&b, 0);
    for (int p = 0; p < S->n_parts; p++) {
        const int nc = p == 0 ? S->n_cells : S->n_cells / 2, c0 = S->n_cells - nc;
        w32(&b, (uint32_t) S->n_stream);
        for (int s = 0; s < S->n_stream; s++) {
            if (s != S->n_stream - 1) {
                w32(&b, 0);
                continue;
            }
            w32(&b, (uint32_t) nc);
            for (int c = 0; c < nc; c++) {
                w32(&b, (uint32_t) (S->p0 + c0 + c));
                w32(&b, 1);
                w32(&b, 0);
            }
            w32(&b, (uint32_t) S->v_trans);
            w32(&b, N_LAYER);
            const size_t es = S->type == 0 ? 4 : 2;
            for (int l = 0; l < N_LAYER; l++) {
                w32(&b, (uint32_t) S->type);
                w64(&b, N_EMBD * es);
                for (int i = 0; i < nc * N_EMBD; i++) elem(&b, S->type, rnd());
            }
            for (int l = 0; l < N_LAYER; l++) {
                w32(&b, (uint32_t) S->type);
                if (!S->v_trans) w64(&b, N_EMBD * es);
                else {
                    w32(&b, (uint32_t) es);
                    w32(&b, N_EMBD);
                }
                for (int i = 0; i < nc * N_EMBD; i++) elem(&b, S->type, rnd());
            }
        }
    }
    return (kvt_blob){ b.p, b.n, S->p0, S->n_cells, S->n_cells, S->n_parts > 1 ? S->n_cells / 2 : 0 };
}

static void blob_file(const char *tag, const uint8_t *payload, size_t n, int32_t codec, int32_t n_tokens) {
    struct kvt__sblob_hdr h;
    memset(&h, 0, sizeof h);
    memset(h.key.b, 0x4b, KVT_KEY_BYTES); /* the key and model fuzz_redis_value asks for */
    memset(h.model.b, 0x4d, KVT_KEY_BYTES);
    h.codec = codec;
    h.n_tokens = n_tokens;
    h.size = n;
    FUZZ_CHECK(kvt__sblob_checksum(0, payload, n, h.sum) == 0);
    size_t vn = 0;
    uint8_t *v = kvt__sblob_encode_mem(&h, payload, &vn);
    FUZZ_CHECK(v);
    put_variants("blobfile", tag, v, vn);
    put_variants("redis_value", tag, v, vn);
    free(v);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
        return 2;
    }
    root = argv[1];
    if (mkdir(root, 0755) && errno != EEXIST) {
        perror(root);
        return 1;
    }
    const struct shape shapes[] = {
        { 1, 1, 1, 0, 6, 0 }, { 1, 1, 0, 1, 5, 64 }, { 2, 1, 1, 1, 6, 128 }, { 2, 3, 1, 0, 4, 3 }, { 1, 3, 0, 0, 3, 1000 },
    };
    char tag[128];
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        const struct shape *S = &shapes[i];
        kvt_blob b = syn(S);
        snprintf(tag, sizeof tag, "p%d-s%d-%s-vt%d", S->n_parts, S->n_stream, S->type ? "f16" : "f32", S->v_trans);
        put_variants("blob", tag, b.data, b.size);
        if (S->n_stream == 1) {
            blob_file(tag, b.data, b.size, KVT_CODEC_RAW, S->n_cells);
            for (int c = 0; c < KVT_CODEC__COUNT; c++)
                for (int heads = 0; heads <= (c == KVT_CODEC_Q8 || c == KVT_CODEC_Q4); heads++) {
                    struct kvt_codec_params p = kvt_codec_default_params(c);
                    p.n_head_kv = 2;
                    p.group_k = 4;
                    p.group_v = 4;
                    p.n_sink = c == KVT_CODEC_RAW ? 0 : S->p0 + 1;
                    uint8_t hb[2 * 2 * N_LAYER];
                    if (heads) {
                        for (size_t k = 0; k < sizeof hb; k++) hb[k] = k & 1 ? 8 : 4;
                        p.head_bits = hb;
                        p.n_head_bits = S->n_parts * N_LAYER * 2;
                    }
                    uint8_t *enc = NULL;
                    size_t n = 0;
                    if (kvt_codec_encode(&b, &p, &enc, &n, NULL)) {
                        fprintf(stderr, "encode %s: %s\n", kvt_codec_name(c), kvt_errmsg());
                        return 1;
                    }
                    char t2[160];
                    snprintf(t2, sizeof t2, "%s-%s%s", tag, kvt_codec_name(c), heads ? "-heads" : "");
                    for (char *q = t2; *q; q++)
                        if (*q == '+') *q = '_';
                    put_variants("codec", t2, enc, n);
                    if (c != KVT_CODEC_RAW && !heads) blob_file(t2, enc, n, c, S->n_cells);
                    free(enc);
                }
        }
        free(b.data);
    }
    /* single sections: prefix (fuzz_codec_tensor.c) + the section */
    for (int codec = 1; codec < KVT_CODEC__COUNT; codec++)
        for (int v = 0; v < 8; v++) {
            const int kind = v & 1, trans = kind && (v & 2), f32 = (v & 4) != 0, heads = codec <= 2 && (v & 2) && !kind;
            const uint32_t N = 5 + (uint32_t) v, n_head = 2, hd = 4, E = n_head * hd, es = f32 ? 4 : 2;
            uint8_t pre[7] = { (uint8_t) (kind | (trans ? 2 : 0) | (f32 ? 4 : 0) |
                                          (codec == KVT_CODEC_ECQ          ? 128
                                           : codec == KVT_CODEC_ELASTIC_Q4 ? 64
                                                                           : (codec - 1) << 3) |
                                          (heads ? 32 : 0)),
                               (uint8_t) N,
                               (uint8_t) (n_head - 1),
                               (uint8_t) (hd - 1),
                               3,
                               1,
                               2 };
            struct kvt_codec_params p = kvt_codec_default_params(codec);
            p.n_head_kv = (int32_t) n_head;
            p.group_k = 4;
            p.group_v = 2;
            uint8_t hb[2] = { 4, 8 };
            uint8_t *t = malloc((size_t) N * E * es);
            FUZZ_CHECK(t);
            struct kvt__mat m = { t, N, E, es, trans != 0 };
            for (uint32_t c = 0; c < N; c++)
                for (uint32_t e = 0; e < E; e++) kvt__mat_set(&m, c, e, rnd() * (e >= E / 2 ? 8.0f : 1.0f));
            bool raw[16] = { true, false, false, true };
            struct kvt__buf out = { 0 };
            kvt__buf_put(&out, pre, sizeof pre);
            int64_t lossy = 0, zeroed = 0;
            FUZZ_CHECK(kvt__sec_encode(&out, &m, raw, kind, &p, (int) n_head, &lossy, &zeroed, heads ? hb : NULL) == 0);
            snprintf(tag, sizeof tag, "%s-%s%s%s-%s", kvt_codec_name(codec), kind ? "v" : "k", trans ? "-trans" : "",
                     heads ? "-heads" : "", f32 ? "f32" : "f16");
            for (char *q = tag; *q; q++)
                if (*q == '+') *q = '_';
            put_variants("codec_tensor", tag, out.p, out.n);
            free(out.p);
            free(t);
        }
    printf("gen_corpus: %d files under %s\n", n_written, root);
    return 0;
}
