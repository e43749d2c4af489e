/* fuzz_blob — the state-blob parser (src/kv/blob.c): kvt__blob_parse as one and as two parts,
** then what the engine does with a blob that parsed: cell positions (walk and direct), the
** writer (one source moved by a delta taken from the input, and two sources), host
** re-anchoring of a copy, K rows as F32.  Invariants: a blob the writer produced parses again
** with the cells it selected; re-anchoring that succeeds leaves a blob that parses. */
#include "fuzz.h"
#include "internal.h"
#include "kv/blob.h"

#include <string.h>

static struct kvt__blob_layout L, W; /* large: kept off the stack */

static void exercise(const uint8_t *data, size_t size, int n_parts) {
    uint32_t tail = 0;
    if (size >= 4) memcpy(&tail, data + size - 4, 4);
    /* a delta that is small, pushes positions to the edge of their range, or past it */
    const int32_t deltas[4] = { 0, (int32_t) (tail % 4096) - 2048, KVT__MAX_POS - 1, INT32_MIN + 5 };
    const int32_t delta = deltas[tail >> 30];
    for (int p = 0; p < n_parts; p++) {
        const uint32_t n = L.part[p].n_cells;
        int32_t *pos = malloc(sizeof *pos * (n ? n : 1));
        FUZZ_CHECK(pos);
        kvt__blob_positions(data, &L, p, pos);
        for (uint32_t c = 0; c < n && (L.part[p].cells_fixed || c < 256); c++) {
            FUZZ_CHECK(kvt__blob_cell_pos(data, &L, p, c) == pos[c]);
            FUZZ_CHECK(pos[c] >= 0 && pos[c] < KVT__MAX_POS);
        }
        free(pos);
    }
    /* the writer: every cell, moved by delta */
    struct kvt__blob_src src[2] = {
        { data, &L, { INT32_MIN, INT32_MIN }, { INT32_MAX, INT32_MAX }, delta },
        { data, &L, { 0, 0 }, { 64, 64 }, 0 },
    };
    for (int n_src = 1; n_src <= 2; n_src++) {
        uint8_t *out = NULL;
        size_t n = 0;
        if (kvt__blob_write(src, n_src, n_parts, 1 + (tail & 1), tail & 1, 7, &out, &n) == 0) {
            FUZZ_CHECK(kvt__blob_parse(out, n, n_parts, &W) == 0);
            if (n_src == 1)
                for (int p = 0; p < n_parts; p++) FUZZ_CHECK(W.part[p].n_cells == L.part[p].n_cells);
        }
        free(out);
    }
    /* re-anchoring a copy (one KV head, 2 rotated dims: whatever the rows are, they are rotated) */
    struct kvt__rope *rope[2] = { NULL, NULL };
    for (int p = 0; p < n_parts; p++) {
        rope[p] = calloc(L.part[p].n_layer + 1, sizeof *rope[p]);
        FUZZ_CHECK(rope[p]);
        for (uint32_t l = 0; l < L.part[p].n_layer; l++) rope[p][l] = (struct kvt__rope){ 10000.0f, 1.0f, 2, (l & 1) != 0 };
    }
    uint8_t *copy = malloc(size ? size : 1);
    FUZZ_CHECK(copy);
    memcpy(copy, data, size);
    if (kvt__blob_reanchor_range(copy, &L, delta, (int32_t) (tail & 255), INT32_MAX, 1, rope) == 0)
        FUZZ_CHECK(kvt__blob_parse(copy, size, n_parts, &W) == 0);
    else FUZZ_CHECK(memcmp(copy, data, size) == 0); /* nothing modified on error */
    free(copy);
    for (int p = 0; p < 2; p++) free(rope[p]);
    /* K rows of the first layer as F32 */
    int32_t row = 0;
    if (kvt__blob_k_f32(data, &L, 0, 0, NULL, &row) == 0 && row > 0) {
        float *k = malloc(sizeof *k * (size_t) row * L.part[0].n_cells + 1);
        FUZZ_CHECK(k);
        FUZZ_CHECK(kvt__blob_k_f32(data, &L, 0, 0, k, &row) == 0);
        free(k);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    for (int n_parts = 1; n_parts <= 2; n_parts++)
        if (kvt__blob_parse(data, size, n_parts, &L) == 0) {
            FUZZ_CHECK(L.end == size);
            exercise(data, size, n_parts);
        }
    kvt__clear_error();
    return 0;
}
