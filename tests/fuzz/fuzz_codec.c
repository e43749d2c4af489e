/* fuzz_codec — the codec container's decoder (src/kv/codec.c): kvt_codec_inspect and
** kvt_codec_decode on the input as it is, then on a copy whose checksum is recomputed for the
** version its header names (XXH3-128, or SHA-256 for versions 1 and 2; so that the
** checks behind the checksum are reached, as bytes planted by someone who can write a store would
** reach them); a block that decodes is encoded again with the parameters its header carried.
** Invariants: a decoded block has the size the header says and parses (the decoder promises it). */
#include "fuzz.h"
#include "internal.h"
#include "kv/blob.h"
#include "kv/codec.h"

#include <string.h>

enum { HDR = 104, SHA_AT = 72 };

static void decode(const uint8_t *data, size_t size) {
    struct kvt_codec_info I;
    const int irc = kvt_codec_inspect(data, size, &I);
    kvt_blob *b = NULL;
    if (kvt_codec_decode(data, size, &b) != 0) {
        FUZZ_CHECK(b == NULL);
        return;
    }
    FUZZ_CHECK(irc == 0 && b && b->size == I.raw_bytes && b->n_cells == I.n_cells);
    static struct kvt__blob_layout L;
    int np = I.n_cells_swa > 0 ? 2 : 1;
    FUZZ_CHECK(kvt__blob_parse(b->data, b->size, np, &L) == 0 || kvt__blob_parse(b->data, b->size, 3 - np, &L) == 0);
    uint8_t *enc = NULL;
    size_t n = 0;
    if (kvt_codec_encode(b, &I.params, &enc, &n, NULL) == 0) {
        kvt_blob *d = NULL;
        FUZZ_CHECK(kvt_codec_decode(enc, n, &d) == 0 && d->size == b->size);
        kvt_blob_free(d);
    }
    free(enc);
    kvt_blob_free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    decode(data, size);
    if (size >= HDR) {
        uint8_t *x = malloc(size);
        FUZZ_CHECK(x);
        memcpy(x, data, size);
        uint16_t ver;
        memcpy(&ver, x + 4, 2);
        FUZZ_CHECK(kvt__codec_digest(ver, x + HDR, size - HDR, x + SHA_AT) == 0);
        decode(x, size);
        free(x);
    }
    kvt__clear_error();
    return 0;
}
