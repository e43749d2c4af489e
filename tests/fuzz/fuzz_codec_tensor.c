/* fuzz_codec_tensor — the per-tensor section decoders (src/kv/codec_tensor.c: q8, q4, elastic,
** elastic+q8, elastic+q4, q8/q4 with per-head bits; src/kv/codec_ecq.c: ecq and its zstd frame)
** called directly, the tensor's shape taken from the
** input's first 7 bytes as the container would pass it (so shapes the container's checks allow
** are all reached):
**   0  bit 0 kind (K/V), bit 1 V transposed, bit 2 F32 (else F16), bits 3-4 codec 1..4,
**      bit 5 per-head bits (q8/q4 only), bit 6 elastic+q4 (whatever bits 3-4 say), bit 7 ecq
**      (whatever bits 3-6 say)
**   1  cells (0..64)   2  KV heads (1..4)   3  head_dim (1..16)
**   4  group_k (1..32) 5  group_v (1..32; a divisor of head_dim with per-head bits)
**   6  per-head bits: bit h set = head h in 8 bits, else 4
** then the section's bytes.  A section that decodes is encoded again from the decoded tensor
** and must decode again. */
#include "fuzz.h"
#include "internal.h"
#include "kv/codec.h"

#include <stdbool.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 7) return 0;
    const uint8_t b0 = data[0];
    const int kind = b0 & 1, codec = (b0 & 128) ? KVT_CODEC_ECQ : (b0 & 64) ? KVT_CODEC_ELASTIC_Q4 : 1 + ((b0 >> 3) & 3);
    const bool trans = kind == KVT__SEC_V && (b0 & 2), heads = (b0 & 32) && codec <= KVT_CODEC_Q4;
    const uint32_t es = (b0 & 4) ? 4 : 2, N = data[1] % 65, n_head = 1u + data[2] % 4, hd = 1u + data[3] % 16;
    const uint32_t E = n_head * hd;
    struct kvt_codec_params p = kvt_codec_default_params(codec);
    p.n_head_kv = (int32_t) n_head;
    p.group_k = 1 + data[4] % 32;
    p.group_v = 1 + data[5] % 32;
    uint8_t hb[4];
    if (heads) {
        while (hd % (uint32_t) p.group_v) p.group_v--; /* V groups within one head */
        for (uint32_t h = 0; h < n_head; h++) hb[h] = (data[6] >> h) & 1 ? 8 : 4;
    }
    uint8_t *t = calloc((size_t) N * E * es + 1, 1);
    FUZZ_CHECK(t);
    struct kvt__mat m = { t, N, E, es, trans };
    const uint8_t *enc = data + 7;
    const size_t n = size - 7;
    if (kvt__sec_decode(enc, n, &m, kind, &p, (int) n_head, "fuzz", heads ? hb : NULL) == 0) {
        /* the decoded tensor, encoded again with the same raw cells, decodes again */
        bool *raw = calloc(N + 1, sizeof *raw);
        FUZZ_CHECK(raw);
        for (uint32_t c = 0; c < N; c++) raw[c] = (enc[c / 8] >> (c % 8)) & 1;
        struct kvt__buf out = { 0 };
        int64_t lossy = 0, zeroed = 0;
        if (kvt__sec_encode(&out, &m, raw, kind, &p, (int) n_head, &lossy, &zeroed, heads ? hb : NULL) == 0 && !out.err) {
            uint8_t *t2 = calloc((size_t) N * E * es + 1, 1);
            FUZZ_CHECK(t2);
            struct kvt__mat m2 = { t2, N, E, es, trans };
            FUZZ_CHECK(kvt__sec_decode(out.p, out.n, &m2, kind, &p, (int) n_head, "fuzz again", heads ? hb : NULL) == 0);
            free(t2);
        }
        free(out.p);
        free(raw);
    }
    free(t);
    kvt__clear_error();
    return 0;
}
