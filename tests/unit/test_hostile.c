/* test_hostile — untrusted bytes (issue #24 items 4 and 8): a block's bytes come from disk or a
** Redis anyone with access can write, so what they claim is checked before anything is
** allocated from it or written into the context.  Each case feeds hostile bytes and asserts the
** error code, its message, and that the sequence (or the store value) is exactly as before.
**
**   positions   tiny llama, f32, unified and streams, HOST and SEQ_ADD re-anchoring: a block
**               whose cell sits at position 2^30 (KVT_EFORMAT from the parser; the position map
**               used to double an int32 past 2^31 and spin), whose cell lies outside the block's
**               own [p0, p0 + n_tokens), whose header p0 makes pos + delta overflow, whose cell
**               count differs from what the block says, with a position twice; a load at
**               2^30 - 4 (KVT_EINVAL); kvt_blocks_load of a good block then a hostile one leaves
**               the sequence untouched (all or nothing: its saved bytes, position max and cell
**               count compared before and after);
**   types       a V type ggml does not know is KVT_EFORMAT at parse time (the codec used to look
**               its name up out of bounds);
**   codec       a section claiming 2^40 bytes from more encoded bytes than the payload holds,
**               checksum recomputed: KVT_ECORRUPT before any allocation (the allocation fault
**               site is armed and must never be reached); a section declaring 4096 x 4096
**               elements in 512 bytes is short before its tensor is allocated; NaN and
**               infinite elements encode with every codec (UBSan: no out-of-range conversion);
**   store       a Redis value with an unknown codec id, a token count past 2^30, truncated, or
**               for another key: refused by kvt__redis_check_value with a reason; a truncated
**               blob file: refused by kvt__sblob_read.
** The whole program runs under alarm(300): the old code spun forever on position 2^30. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */
#include "fault.h"
#include "kv/blob.h"
#include "kv/codec.h"
#include "store/store_int.h"

#include <fcntl.h>
#include <math.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char *tiny(const char *name) {
    static char buf[1024];
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(buf, sizeof buf, "%s/%s.gguf", d ? d : "tests/models", name);
    return buf;
}

static kvt_engine *open_engine(bool unified, int reanchor) {
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = tiny("tiny-llama");
    p.kv_unified = unified;
    p.n_ctx = 512;
    p.n_seq = 1;
    p.type_k = "f32";
    p.type_v = "f32";
    p.reanchor = reanchor;
    kvt_engine *e = NULL;
    int rc = kvt_engine_open(&p, &e);
    if (rc) fprintf(stderr, "open: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, 0);
    return e;
}

static void expect(int rc, int want, const char *needle) {
    if (rc != want || (needle && !strstr(kvt_errmsg(), needle)))
        fprintf(stderr, "got %d (%s), want %d with \"%s\"\n", rc, kvt_errmsg(), want, needle ? needle : "");
    assert_int_equal(rc, want);
    if (needle) assert_non_null(strstr(kvt_errmsg(), needle));
}

/* What must not change: the saved bytes of [0, 16), the highest position and the cell count. */
struct snap {
    kvt_blob *b;
    kvt_pos max;
    int32_t n;
};

static struct snap snap_of(kvt_engine *e) {
    struct snap s = { NULL, kvt_seq_pos_max(e, 0), kvt_seq_n_cells(e, 0) };
    assert_int_equal(kvt_block_save(e, 0, 0, 16, &s.b), 0);
    return s;
}

static void same(kvt_engine *e, const struct snap *before) {
    struct snap now = snap_of(e);
    assert_int_equal(now.max, before->max);
    assert_int_equal(now.n, before->n);
    assert_int_equal(now.b->size, before->b->size);
    assert_memory_equal(now.b->data, before->b->data, now.b->size);
    kvt_blob_free(now.b);
}

/* A copy of blob with cell c of part 0 at position pos (the blob is one-stream, n_seq_id 1). */
static kvt_blob *with_pos(const kvt_blob *b, uint32_t c, int32_t pos) {
    kvt_blob *x = NULL;
    assert_int_equal(kvt_blob_dup(b, &x), 0);
    struct kvt__blob_layout *L = malloc(sizeof *L);
    assert_non_null(L);
    assert_int_equal(kvt__blob_parse(x->data, x->size, 1, L), 0);
    assert_true(L->part[0].cells_fixed && c < L->part[0].n_cells);
    memcpy(x->data + L->part[0].cells_off + (size_t) c * 12, &pos, 4);
    free(L);
    return x;
}

static void positions(bool unified, int reanchor) {
    kvt_engine *e = open_engine(unified, reanchor);
    kvt_token t[32];
    for (int i = 0; i < 32; i++) t[i] = 5 + (7 * i) % 50;
    assert_int_equal(kvt_engine_decode(e, 0, t, 32, 0, false), 0);
    kvt_blob *b = NULL;
    assert_int_equal(kvt_block_save(e, 0, 16, 32, &b), 0);
    assert_int_equal(b->p0, 16);
    assert_int_equal(b->n_cells, 16);
    assert_int_equal(kvt_seq_rm(e, 0, 16, -1), 0);
    struct snap before = snap_of(e);
    assert_int_equal(before.max, 15);

    /* position 2^30: refused by the parser, naming the value */
    kvt_blob *x = with_pos(b, 3, KVT__MAX_POS);
    expect(kvt_block_load(e, x, 0, 16), KVT_EFORMAT, "position 1073741824");
    same(e, &before);
    kvt_blob_free(x);
    /* a cell outside the block's own positions (it would land at 100000 + delta) */
    x = with_pos(b, 3, 100000);
    expect(kvt_block_load(e, x, 0, 40), KVT_EFORMAT, "position 100000, outside the block's [16, 32)");
    same(e, &before);
    kvt_blob_free(x);
    /* a header p0 far below the cells: pos + delta would pass INT32_MAX */
    x = with_pos(b, 15, 200000000);
    x->p0 = -2000000000;
    expect(kvt_block_load(e, x, 0, 16), KVT_EFORMAT, "tokens at position -2000000000");
    same(e, &before);
    x->p0 = 16;
    expect(kvt_block_load(e, x, 0, 16), KVT_EFORMAT, "position 200000000");
    same(e, &before);
    kvt_blob_free(x);
    /* cells: the count the block says, each position once */
    assert_int_equal(kvt_blob_dup(b, &x), 0);
    x->n_cells = 15;
    expect(kvt_block_load(e, x, 0, 16), KVT_EFORMAT, "hold 16 cells, the block says 15");
    same(e, &before);
    kvt_blob_free(x);
    x = with_pos(b, 5, 20);
    expect(kvt_block_load(e, x, 0, 16), KVT_EFORMAT, "position 20 holds two cells");
    same(e, &before);
    kvt_blob_free(x);
    /* the caller's position: the block's last token would pass 2^30 - 1 */
    expect(kvt_block_load(e, b, 0, KVT__MAX_POS - 4), KVT_EINVAL, "would pass position 1073741823");
    same(e, &before);
    expect(kvt_engine_decode(e, 0, t, 8, KVT__MAX_POS - 4, false), KVT_EINVAL, "positions are 0..1073741823");
    same(e, &before);
    /* all or nothing: a good block, then a hostile one */
    x = with_pos(b, 3, 100000);
    const kvt_blob *two[2] = { b, x };
    const kvt_pos at[2] = { 16, 32 };
    expect(kvt_blocks_load(e, two, 2, 0, at), KVT_EFORMAT, "block 1: cell 3 of part 0 is at position 100000");
    same(e, &before);
    kvt_blob_free(x);
    /* control: the same load of the good block works, at the tail and moved */
    const kvt_blob *one[1] = { b };
    const kvt_pos at2[1] = { 20 };
    assert_int_equal(kvt_blocks_load(e, one, 1, 0, at2), 0);
    assert_int_equal(kvt_seq_pos_max(e, 0), 35);
    assert_int_equal(kvt_seq_n_cells(e, 0), 32);
    kvt_blob_free(before.b);
    kvt_blob_free(b);
    kvt_engine_free(e);
}

static void test_positions_unified_host(void **st) {
    (void) st;
    positions(true, KVT_REANCHOR_HOST);
}
static void test_positions_streams_host(void **st) {
    (void) st;
    positions(false, KVT_REANCHOR_HOST);
}
static void test_positions_unified_seqadd(void **st) {
    (void) st;
    positions(true, KVT_REANCHOR_SEQ_ADD);
}
static void test_positions_streams_seqadd(void **st) {
    (void) st;
    positions(false, KVT_REANCHOR_SEQ_ADD);
}

/* ---- synthetic blobs (src/kv/blob.h describes the format): one part, F32, 8 cells ---- */

struct wb {
    uint8_t *p;
    size_t n, cap;
};
static void w(struct wb *b, const void *s, size_t k) {
    if (b->n + k > b->cap) {
        b->cap = (b->n + k) * 2;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, s, k);
    b->n += k;
}
static void w32(struct wb *b, uint32_t v) { w(b, &v, 4); }
static void w64(struct wb *b, uint64_t v) { w(b, &v, 8); }

enum { S_CELLS = 8, S_EMBD = 8, S_LAYERS = 2 };

/* v_type_at: where the first V type was written (to damage it). */
static kvt_blob syn(size_t *v_type_at) {
    struct wb b = { 0 };
    unsigned s = 7;
    w32(&b, KVT__BLOB_MAGIC);
    w32(&b, 0);
    w32(&b, 1);
    w32(&b, S_CELLS);
    for (int c = 0; c < S_CELLS; c++) {
        w32(&b, (uint32_t) c);
        w32(&b, 1);
        w32(&b, 0);
    }
    w32(&b, 0);
    w32(&b, S_LAYERS);
    for (int kv = 0; kv < 2; kv++)
        for (int l = 0; l < S_LAYERS; l++) {
            if (kv == 1 && l == 0 && v_type_at) *v_type_at = b.n;
            w32(&b, 0); /* GGML_TYPE_F32 */
            w64(&b, S_EMBD * 4);
            for (int i = 0; i < S_CELLS * S_EMBD; i++) {
                s = s * 1103515245u + 12345u;
                float f = (float) ((s >> 8) & 0xffff) / 65536.0f - 0.5f;
                w(&b, &f, 4);
            }
        }
    return (kvt_blob){ b.p, b.n, 0, S_CELLS, S_CELLS, 0 };
}

static void test_types(void **st) {
    (void) st;
    size_t at = 0;
    kvt_blob b = syn(&at);
    struct kvt__blob_layout *L = malloc(sizeof *L);
    assert_non_null(L);
    assert_int_equal(kvt__blob_parse(b.data, b.size, 1, L), 0);
    int32_t bad = 999;
    memcpy(b.data + at, &bad, 4);
    expect(kvt__blob_parse(b.data, b.size, 1, L), KVT_EFORMAT, "bad V type 999");
    uint8_t *enc = NULL;
    size_t n = 0;
    struct kvt_codec_params p = kvt_codec_default_params(KVT_CODEC_Q8);
    expect(kvt_codec_encode(&b, &p, &enc, &n, NULL), KVT_EFORMAT, "V type 999");
    assert_null(enc);
    free(L);
    free(b.data);
}

/* ---- codec: a section that claims more than the payload ---- */

enum { HDR = 104, SEC_BYTES = 40 };

static void resign(uint8_t *x, size_t n) { /* the checksum of the header's version */
    uint16_t ver;
    memcpy(&ver, x + 4, 2);
    assert_int_equal(kvt__codec_digest(ver, x + HDR, n - HDR, x + 72), 0);
}

static void test_codec_claims(void **st) {
    (void) st;
    kvt_blob b = syn(NULL);
    struct kvt_codec_params p = kvt_codec_default_params(KVT_CODEC_Q8);
    uint8_t *enc = NULL;
    size_t n = 0;
    assert_int_equal(kvt_codec_encode(&b, &p, &enc, &n, NULL), 0);
    kvt_blob *d = NULL;
    assert_int_equal(kvt_codec_decode(enc, n, &d), 0); /* control: it decodes as written */
    kvt_blob_free(d);
    /* raw bytes 2^40; section 0 claims the difference, from 2^34 encoded bytes (more than the
    ** payload holds): ~1 KB that used to ask for a 1 TiB block */
    uint8_t *x = malloc(n);
    assert_non_null(x);
    memcpy(x, enc, n);
    const uint64_t raw = (uint64_t) 1 << 40;
    uint64_t raw0, len0, el0 = (uint64_t) 1 << 34;
    memcpy(&raw0, x + 56, 8);
    uint8_t *t0 = x + HDR + 12; /* the first section's table entry */
    memcpy(&len0, t0 + 8, 8);
    len0 += raw - raw0;
    memcpy(x + 56, &raw, 8);
    memcpy(t0 + 8, &len0, 8);
    memcpy(t0 + 32, &el0, 8);
    resign(x, n);
    kvt__fault_set(KVT__FAULT_CODEC_ALLOC, 0, -1); /* any allocation of the block fails: never reached */
    d = NULL;
    expect(kvt_codec_decode(x, n, &d), KVT_ECORRUPT, "section 0 claims 17179869184 encoded bytes");
    assert_null(d);
    assert_int_equal(kvt__fault_hits(KVT__FAULT_CODEC_ALLOC), 0);
    kvt__fault_set(KVT__FAULT_CODEC_ALLOC, 0, 0);
    /* an encoded length that would wrap 64 * len: refused the same way */
    el0 = ((uint64_t) 1 << 58) + 1;
    memcpy(t0 + 32, &el0, 8);
    resign(x, n);
    expect(kvt_codec_decode(x, n, &d), KVT_ECORRUPT, "encoded bytes");
    free(x);
    free(enc);
    free(b.data);
}

/* ---- codec sections: sizes checked before allocating; NaN elements encode ---- */

static void test_codec_sections(void **st) {
    (void) st;
    /* 4096 x 4096 F32 elements declared, 512 bytes given: short before anything is allocated
    ** for the tensor (the body check names it) */
    struct kvt_codec_params p = kvt_codec_default_params(KVT_CODEC_Q8);
    uint8_t enc[512] = { 0 };
    uint8_t one = 0;
    struct kvt__mat m = { &one, 4096, 4096, 4, false }; /* never written: the check comes first */
    expect(kvt__sec_decode(enc, sizeof enc, &m, KVT__SEC_K, &p, 1, "hostile", NULL), KVT_ECORRUPT, "inside the body");
    /* a tensor holding NaN and infinities (a block decoded from hostile bytes can): every codec
    ** encodes it and the result decodes (UBSan: no out-of-range float-to-integer conversion) */
    float x[4 * 8];
    for (int i = 0; i < 4 * 8; i++) x[i] = (float) i;
    x[3] = NAN;
    x[9] = INFINITY;
    x[17] = -INFINITY;
    struct kvt__mat t = { (uint8_t *) x, 4, 8, 4, false };
    bool raw[4] = { false, false, false, false };
    for (int c = KVT_CODEC_Q8; c < KVT_CODEC__COUNT; c++) {
        p = kvt_codec_default_params(c);
        struct kvt__buf out = { 0 };
        int64_t lossy = 0, zeroed = 0;
        assert_int_equal(kvt__sec_encode(&out, &t, raw, KVT__SEC_V, &p, 1, &lossy, &zeroed, NULL), 0);
        float y[4 * 8];
        struct kvt__mat d = { (uint8_t *) y, 4, 8, 4, false };
        assert_int_equal(kvt__sec_decode(out.p, out.n, &d, KVT__SEC_V, &p, 1, "nan", NULL), 0);
        free(out.p);
    }
}

/* ---- store: Redis values and blob files ---- */

static uint8_t *value(int32_t codec, int32_t n_tokens, size_t *n, const kvt_key *key, const kvt_key *model) {
    static const uint8_t payload[40] = { 1, 2, 3 };
    struct kvt__sblob_hdr h;
    memset(&h, 0, sizeof h);
    h.key = *key;
    h.model = *model;
    h.codec = codec;
    h.n_tokens = n_tokens;
    h.size = sizeof payload;
    assert_int_equal(kvt__sblob_checksum(0, payload, sizeof payload, h.sum), 0);
    uint8_t *v = kvt__sblob_encode_mem(&h, payload, n);
    assert_non_null(v);
    return v;
}

static void test_store_values(void **st) {
    (void) st;
    kvt_key key, model, other;
    memset(key.b, 1, sizeof key.b);
    memset(model.b, 2, sizeof model.b);
    memset(other.b, 3, sizeof other.b);
    struct kvt__sblob_hdr h;
    const char *why = NULL;
    size_t n = 0;
    uint8_t *v = value(KVT_CODEC_RAW, 64, &n, &key, &model);
    assert_int_equal(kvt__redis_check_value(v, n, 1 << 20, &key, &model, &h, &why), KVT__SBLOB_OK); /* control */
    assert_null(why);
    assert_int_equal(kvt__redis_check_value(v, n - 1, 1 << 20, &key, &model, &h, &why), KVT__SBLOB_BAD);
    assert_string_equal(why, "truncated payload");
    assert_int_equal(kvt__redis_check_value(v, 100, 1 << 20, &key, &model, &h, &why), KVT__SBLOB_BAD);
    assert_string_equal(why, "truncated header");
    assert_int_equal(kvt__redis_check_value(v, n, n - 1, &key, &model, &h, &why), KVT__SBLOB_BAD);
    assert_string_equal(why, "value larger than redis_max_bytes");
    assert_int_equal(kvt__redis_check_value(v, n, 1 << 20, &other, &model, &h, &why), KVT__SBLOB_BAD);
    assert_string_equal(why, "value names another key");
    assert_int_equal(kvt__redis_check_value(v, n, 1 << 20, &key, &other, &h, &why), KVT__SBLOB_BAD);
    assert_string_equal(why, "value belongs to another model");
    free(v);
    v = value(99, 64, &n, &key, &model);
    assert_int_equal(kvt__redis_check_value(v, n, 1 << 20, &key, &model, &h, &why), KVT__SBLOB_BAD);
    assert_string_equal(why, "unknown codec id");
    free(v);
    v = value(KVT_CODEC_RAW, INT32_MAX, &n, &key, &model);
    assert_int_equal(kvt__redis_check_value(v, n, 1 << 20, &key, &model, &h, &why), KVT__SBLOB_BAD);
    assert_string_equal(why, "token count outside 0..2^30");
    free(v);
    v = value(KVT_CODEC_RAW, -1, &n, &key, &model);
    assert_int_equal(kvt__redis_check_value(v, n, 1 << 20, &key, &model, &h, &why), KVT__SBLOB_BAD);
    free(v);
    /* the same bytes as a blob file, truncated by one byte: refused, nothing returned */
    v = value(KVT_CODEC_RAW, 64, &n, &key, &model);
    char dir[] = "/tmp/kvt-test-hostile-XXXXXX";
    assert_non_null(mkdtemp(dir));
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    assert_true(dfd >= 0);
    char name[KVT__SBLOB_NAME];
    kvt__sblob_name(&key, 1, name);
    int fd = openat(dfd, name, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, v, n - 1), (ssize_t) (n - 1));
    close(fd);
    uint8_t *data = (uint8_t *) 1;
    assert_int_equal(kvt__sblob_read(dfd, name, &h, &data, &why), KVT__SBLOB_BAD);
    assert_string_equal(why, "truncated payload");
    assert_null(data);
    unlinkat(dfd, name, 0);
    close(dfd);
    rmdir(dir);
    free(v);
}

int main(void) {
    alarm(300);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_types),
        cmocka_unit_test(test_codec_claims),
        cmocka_unit_test(test_codec_sections),
        cmocka_unit_test(test_store_values),
        cmocka_unit_test(test_positions_unified_host),
        cmocka_unit_test(test_positions_streams_host),
        cmocka_unit_test(test_positions_unified_seqadd),
        cmocka_unit_test(test_positions_streams_seqadd),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
