/* fuzz_redis_value — the check of a value read from Redis (src/store/redis.c
** kvt__redis_check_value; the value is untrusted: anyone who can write to the Redis can put
** bytes there): the input as it is, then with the key, model, size and checksum fields set to
** what the check expects (so its later checks, token count and codec id, are reached).
** Invariants: an accepted value names the key and model asked for and its payload is the
** value's bytes after the header. */
#include "fuzz.h"
#include "internal.h"
#include "store/store_int.h"

#include <string.h>

static void check(const uint8_t *v, size_t n, const kvt_key *key, const kvt_key *model) {
    struct kvt__sblob_hdr h;
    const char *why = NULL;
    int rc = kvt__redis_check_value(v, n, (size_t) 1 << 20, key, model, &h, &why);
    if (rc == KVT__SBLOB_OK) {
        FUZZ_CHECK(why == NULL && n >= KVT__SBLOB_HDR && h.size == n - KVT__SBLOB_HDR);
        FUZZ_CHECK(!memcmp(h.key.b, key->b, KVT_KEY_BYTES) && !memcmp(h.model.b, model->b, KVT_KEY_BYTES));
        FUZZ_CHECK(h.n_tokens >= 0 && h.codec >= 0 && h.codec < KVT_CODEC__COUNT);
    } else {
        FUZZ_CHECK(why != NULL);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvt_key key, model;
    memset(key.b, 0x4b, KVT_KEY_BYTES);
    memset(model.b, 0x4d, KVT_KEY_BYTES);
    check(data, size, &key, &model);
    if (size >= KVT__SBLOB_HDR) {
        uint8_t *x = malloc(size);
        FUZZ_CHECK(x);
        memcpy(x, data, size);
        memcpy(x + 16, key.b, KVT_KEY_BYTES);
        memcpy(x + 48, model.b, KVT_KEY_BYTES);
        uint64_t n = size - KVT__SBLOB_HDR;
        for (int i = 0; i < 8; i++) x[88 + i] = (uint8_t) (n >> (8 * i));
        /* the checksum of the input's own format version (an unknown one: the current one's) */
        const uint32_t ver = (uint32_t) x[8] | (uint32_t) x[9] << 8 | (uint32_t) x[10] << 16 | (uint32_t) x[11] << 24;
        FUZZ_CHECK(kvt__sblob_checksum(ver == 1 ? 1 : 0, x + KVT__SBLOB_HDR, (size_t) n, x + 96) == 0);
        check(x, size, &key, &model);
        free(x);
    }
    kvt__clear_error();
    return 0;
}
