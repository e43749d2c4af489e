/* kvio.c — the block primitives' engine side.
**
** Unified cache: save [p0, p1) of a sequence by sharing it into a scratch sequence and saving
** that (llama_state_seq_get_data); load by llama_state_seq_set_data into a scratch sequence and
** sharing it into the target.
** One stream per sequence (kv_unified = false; a partial seq_cp across streams aborts llama.cpp):
** every operation reads the whole sequence's state, slices or assembles cells on the host
** (src/kv/blob.c) and writes it back with one llama_state_seq_set_data; a failed write puts the
** previous state back (llama.cpp clears the part that failed and keeps the others,
** bench/llama-streams/REPORT.md §7).  Blocks leave and enter the engine in the canonical
** one-stream form, so they load in either mode and at any n_seq.
** K is re-anchored by RoPE on the host (src/kv/blob.c) or by llama.cpp's lazy K-shift (SEQ_ADD),
** a pending shift being applied first whenever a sequence's state is read. */
#include "engine/engine_int.h"
#include "test_hooks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A pending K-shift is applied by the next llama_decode; force it with one token in the flush
** sequence, then remove that token. */
int kvt__engine_flush_shift(kvt_engine *e) {
    if (!e->shift_pending || e->skip_flush) return 0;
    if (e->seq_flush < 0) return kvt__fail(KVT_ELLAMA, "a K-shift is pending but the context has no flush sequence");
    kvt_token t = 0;
    int rc = kvt_engine_decode(e, e->seq_flush, &t, 1, 0, false);
    kvt_seq_rm(e, e->seq_flush, -1, -1);
    return rc;
}

int kvt__engine_save_seq(kvt_engine *e, int32_t seq, uint8_t **buf, size_t *n) {
    *buf = NULL;
    size_t sz = llama_state_seq_get_size(e->ctx, seq);
    if (sz == 0) return kvt__fail(KVT_ELLAMA, "llama_state_seq_get_size failed for seq %d", seq);
    uint8_t *b = malloc(sz);
    if (!b) return kvt__fail(KVT_ENOMEM, "KV block of %zu bytes", sz);
    size_t w = llama_state_seq_get_data(e->ctx, b, sz, seq);
    if (w != sz) {
        free(b);
        return kvt__fail(KVT_ELLAMA, "llama_state_seq_get_data wrote %zu of %zu bytes", w, sz);
    }
    *buf = b;
    *n = sz;
    return 0;
}

int kvt__engine_snapshot(kvt_engine *e, int32_t seq, const uint8_t **buf, size_t *n) {
    if (!e->snap || e->snap_gen != e->gen || e->snap_seq != seq) {
        free(e->snap);
        e->snap = NULL;
        int rc = kvt__engine_save_seq(e, seq, &e->snap, &e->snap_n);
        if (rc) return rc;
        e->snap_gen = e->gen;
        e->snap_seq = seq;
    }
    *buf = e->snap;
    *n = e->snap_n;
    return 0;
}

/* The cell records of one part of a sequence state written into b[0, n): magic and seq id, then
** n_stream stream records of which at most one has cells (a sequence's state), each cell's
** position, seq id count and ids; what follows them (rows) is not read.  Every record is read
** inside n.  Positions into pos[0, cap); returns the cell count, or -1 when the records do not
** parse as that (a llama.cpp whose state layout changed: the caller takes a snapshot instead). */
static int64_t cell_records(const uint8_t *b, size_t n, int32_t seq, kvt_pos *pos, uint32_t cap) {
    size_t off = 0;
#define CR_READ(v)                          \
    do {                                    \
        if (n - off < sizeof(v)) return -1; \
        memcpy(&(v), b + off, sizeof(v));   \
        off += sizeof(v);                   \
    } while (0)
    uint32_t magic = 0, n_stream = 0;
    int32_t src = 0;
    CR_READ(magic);
    CR_READ(src);
    CR_READ(n_stream);
    if (magic != KVT__BLOB_MAGIC || src != seq || n_stream < 1 || n_stream > KVT__MAX_STREAMS) return -1;
    for (uint32_t s = 0; s < n_stream; s++) {
        uint32_t nc = 0;
        CR_READ(nc);
        if (nc == 0) continue;
        if (nc > cap) return -1;
        for (uint32_t c = 0; c < nc; c++) {
            int32_t p = 0;
            uint32_t k = 0;
            bool ours = false;
            CR_READ(p);
            CR_READ(k);
            if (p < 0 || p >= KVT__MAX_POS || k < 1 || k > 64) return -1;
            for (uint32_t i = 0; i < k; i++) {
                int32_t id = -1;
                CR_READ(id);
                ours |= id == seq;
            }
            if (!ours) return -1;
            pos[c] = p;
        }
        return nc; /* the sequence's own record: the rows follow */
    }
    return 0;
#undef CR_READ
}

int kvt__engine_cell_pos(kvt_engine *e, int32_t seq, int part, const kvt_pos **pos, uint32_t *n) {
    if (e->cp_pos && e->cp_gen == e->gen && e->cp_seq == seq && e->cp_part == part) {
        *pos = e->cp_pos;
        *n = e->cp_n;
        return 0;
    }
    /* nothing kept until this read succeeds */
    e->cp_seq = -1;
    /* the sequence's cells (the engine's count: every part holds at most those) and slack */
    const uint32_t cap = (uint32_t) kvt_seq_n_cells(e, seq) + 64;
    /* records: magic, seq id, n_stream, a count per stream, (pos, count 1, the id) per cell (a
    ** sequence's state names that sequence alone); then room for the first rows' headers
    ** (v_trans, n_layer, type, row size) and no more.  Records that do not fit (another layout)
    ** stop the write early: the zeroed rest does not parse, and the snapshot is read instead */
    const size_t need = 12 + 4 * (size_t) e->n_stream + (size_t) cap * 12 + 32;
    if (e->cp_cap < need) {
        uint8_t *b = realloc(e->cp_buf, need);
        if (!b) return kvt__fail(KVT_ENOMEM, "cell records");
        e->cp_buf = b;
        e->cp_cap = need;
    }
    if (e->cp_cap_pos < cap) {
        kvt_pos *p = realloc(e->cp_pos, sizeof *p * cap);
        if (!p) return kvt__fail(KVT_ENOMEM, "cell positions");
        e->cp_pos = p;
        e->cp_cap_pos = cap;
    }
    memset(e->cp_buf, 0, need);
    /* the rows do not fit: llama.cpp stops there and reports it (not printed: expected) */
    kvt__engine_short_write = true;
    llama_state_seq_get_data_ext(e->ctx, e->cp_buf, need, seq, part == 1 ? LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY : 0);
    kvt__engine_short_write = false;
    int64_t nc = e->cp_force_snapshot ? -1 : cell_records(e->cp_buf, need, seq, e->cp_pos, cap);
    /* part 0 holds every cell of the sequence: the count must be the engine's own */
    if (nc < 0 || (part == 0 && nc != kvt_seq_n_cells(e, seq))) {
        e->cp_snapshots++;
        const uint8_t *buf;
        size_t sz;
        struct kvt__blob_layout *L = malloc(sizeof *L);
        if (!L) return kvt__fail(KVT_ENOMEM, "cell positions");
        int rc = kvt__engine_snapshot(e, seq, &buf, &sz);
        if (rc == 0) rc = kvt__blob_parse(buf, sz, e->n_parts, L);
        if (rc == 0 && L->part[part].n_cells > cap)
            rc = kvt__fail(KVT_EFORMAT, "sequence %d has %u cells", seq, L->part[part].n_cells);
        if (rc == 0) {
            nc = L->part[part].n_cells;
            kvt__blob_positions(buf, L, part, e->cp_pos);
        }
        free(L);
        if (rc) return rc;
    }
    e->cp_n = (uint32_t) nc;
    e->cp_seq = seq;
    e->cp_part = part;
    e->cp_gen = e->gen;
    *pos = e->cp_pos;
    *n = e->cp_n;
    return 0;
}

/* A sequence's whole state, owned, parsed (the layout is large: kept off the stack). */
struct state {
    uint8_t *buf;
    size_t n;
    struct kvt__blob_layout L;
};

static void state_free(struct state *st) {
    if (!st) return;
    free(st->buf);
    free(st);
}

static int state_get(kvt_engine *e, int32_t seq, struct state **out) {
    *out = NULL;
    struct state *st = calloc(1, sizeof *st);
    if (!st) return kvt__fail(KVT_ENOMEM, "sequence state");
    int rc = kvt__engine_save_seq(e, seq, &st->buf, &st->n);
    if (rc == 0) rc = kvt__blob_parse(st->buf, st->n, e->n_parts, &st->L);
    if (rc) {
        state_free(st);
        return rc;
    }
    *out = st;
    return 0;
}

/* Smallest and largest position of part p (INT32_MAX / -1 when empty). */
static void part_span(const uint8_t *buf, const struct kvt__blob_layout *L, int p, kvt_pos *lo, kvt_pos *hi) {
    *lo = INT32_MAX;
    *hi = -1;
    for (uint32_t c = 0; p < L->n_parts && c < L->part[p].n_cells; c++) {
        kvt_pos pp = kvt__blob_cell_pos(buf, L, p, c);
        *lo = KVT_MIN(*lo, pp);
        *hi = KVT_MAX(*hi, pp);
    }
}

/* Test hook (kvt_engine_set_unsafe_corrupt_next_load): give the last layer of part p another K
** type, which llama.cpp rejects while reading that part, after clearing it. */
static void corrupt_for_test(kvt_engine *e, uint8_t *buf, size_t n) {
    const int p = e->test_corrupt_part;
    e->test_corrupt_part = -1;
    struct kvt__blob_layout *L = malloc(sizeof *L);
    if (L && kvt__blob_parse(buf, n, e->n_parts, L) == 0 && p >= 0 && p < L->n_parts && L->part[p].n_cells) {
        const struct kvt__blob_part *P = &L->part[p];
        size_t off = P->k_off[P->n_layer - 1] - 12; /* i32 type_k ; u64 k_row_bytes ; rows */
        int32_t t;
        memcpy(&t, buf + off, 4);
        t = t == GGML_TYPE_F32 ? GGML_TYPE_F16 : GGML_TYPE_F32;
        memcpy(buf + off, &t, 4);
    }
    free(L);
}

/* Streams mode: replace all cells of seq by the state in buf (this context's stream layout).  If
** llama.cpp rejects it, seq gets its previous state `prev` back; only if that fails too is the
** sequence left empty (and the message says so).  The cache generation moves either way: cells
** are now packed from index 0 of the stream. */
static int replace_seq(kvt_engine *e, int32_t seq, uint8_t *buf, size_t n, const struct state *prev, const char *what) {
    llama_memory_t mem = llama_get_memory(e->ctx);
    if (e->test_corrupt_part >= 0) corrupt_for_test(e, buf, n);
    e->gen++;
    llama_memory_seq_rm(mem, seq, -1, -1); /* a part with no cells would otherwise keep the old ones */
    size_t r = llama_state_seq_set_data(e->ctx, buf, n, seq);
    if (r == n) return 0;
    llama_memory_seq_rm(mem, seq, -1, -1); /* what llama.cpp loaded before the part that failed */
    size_t r2 = llama_state_seq_set_data(e->ctx, prev->buf, prev->n, seq);
    if (r2 != prev->n) {
        llama_memory_seq_rm(mem, seq, -1, -1);
        kvt__pm_clear(&e->pm[seq], -1, -1);
        return kvt__fail(KVT_ELLAMA,
                         "%s: llama_state_seq_set_data read %zu of %zu bytes into sequence %d, and putting "
                         "back its previous %u cells failed too (%zu of %zu bytes): the sequence is now empty",
                         what, r, n, seq, prev->L.part[0].n_cells, r2, prev->n);
    }
    return kvt__fail(KVT_ELLAMA,
                     "%s: llama_state_seq_set_data read %zu of %zu bytes into sequence %d (llama.cpp's log "
                     "says why); the sequence's previous %u cells are back",
                     what, r, n, seq, prev->L.part[0].n_cells);
}

int kvt__engine_replace_seq(kvt_engine *e, int32_t seq, uint8_t *buf, size_t n, const uint8_t *prev, size_t prev_n,
                            const char *what) {
    struct state *st = calloc(1, sizeof *st);
    if (!st) return kvt__fail(KVT_ENOMEM, "%s: sequence state", what);
    int rc = kvt__blob_parse(prev, prev_n, e->n_parts, &st->L);
    st->buf = (uint8_t *) prev; /* borrowed: not freed here */
    st->n = prev_n;
    if (rc == 0) rc = replace_seq(e, seq, buf, n, st, what);
    free(st);
    return rc;
}

/* The sliding-window position below which a sequence whose highest position is pos_max keeps no
** SWA cells (llama.cpp's own state write keeps pos > pos_max - n_swa); INT32_MIN without SWA. */
static kvt_pos swa_lo(const kvt_engine *e, kvt_pos pos_max) {
    return (e->n_parts > 1 && e->info.n_swa > 0) ? pos_max - e->info.n_swa + 1 : INT32_MIN;
}

/* iSWA: a block loaded at the tail is attended by the next query through its SWA cells of the
** last n_swa - 1 positions.  A block saved after those cells left the window lacks them, and
** llama.cpp would decode without that local context, silently (REPORT.md §4). */
static int check_swa_cells(const kvt_engine *e, const kvt_blob *blob, const struct kvt__blob_layout *L) {
    if (e->n_parts < 2 || e->info.n_swa <= 0) return 0;
    kvt_pos lo, last;
    part_span(blob->data, L, 0, &lo, &last);
    const kvt_pos need_from = last + 2 - e->info.n_swa;
    int32_t n_full = 0, n_swa = 0;
    for (uint32_t c = 0; c < L->part[0].n_cells; c++) n_full += kvt__blob_cell_pos(blob->data, L, 0, c) >= need_from;
    for (uint32_t c = 0; c < L->part[1].n_cells; c++) n_swa += kvt__blob_cell_pos(blob->data, L, 1, c) >= need_from;
    if (n_swa < n_full)
        return kvt__fail(KVT_EFORMAT,
                         "block [%d, %d] holds %d of the %d sliding-window cells its last positions need "
                         "(window of %d; it was saved after they left the window): loading it would decode without "
                         "that local context",
                         lo, last, n_swa, n_full, e->info.n_swa);
    return 0;
}

static int cmp_pos(const void *a, const void *b) {
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

/* A block's bytes may come from disk, Redis or any caller: before anything is written into the
** context, its cells must be what its kvt_blob fields say (part 0 holds n_cells cells; every
** cell of every part lies in [p0, p0 + n_tokens), no position twice in a part) and it must fit
** at new_p0.  Every position a load then computes (pos + new_p0 - p0) lies in [new_p0, new_p0 +
** n_tokens) within [0, KVT__MAX_POS), and nothing can overflow.  KVT_EFORMAT (the block) or
** KVT_EINVAL (new_p0), naming the value. */
static int check_blob(const kvt_blob *blob, const struct kvt__blob_layout *L, kvt_pos new_p0, const char *what) {
    const kvt_pos p0 = blob->p0;
    if (blob->n_tokens < 1 || p0 < 0 || (int64_t) p0 + blob->n_tokens > KVT__MAX_POS)
        return kvt__fail(KVT_EFORMAT, "%s: the block says %d tokens at position %d (positions are 0..%d)", what, blob->n_tokens, p0,
                         KVT__MAX_POS - 1);
    if (new_p0 < 0 || (int64_t) new_p0 + blob->n_tokens > KVT__MAX_POS)
        return kvt__fail(KVT_EINVAL, "%s at position %d: its %d tokens would pass position %d", what, new_p0, blob->n_tokens,
                         KVT__MAX_POS - 1);
    if (blob->n_cells < 0 || L->part[0].n_cells != (uint32_t) blob->n_cells)
        return kvt__fail(KVT_EFORMAT, "%s: the block's bytes hold %u cells, the block says %d", what, L->part[0].n_cells,
                         blob->n_cells);
    uint32_t most = 1;
    for (int p = 0; p < L->n_parts; p++) most = KVT_MAX(most, L->part[p].n_cells);
    int32_t *pos = malloc(sizeof *pos * most);
    if (!pos) return kvt__fail(KVT_ENOMEM, "%s: positions of %u cells", what, most);
    int rc = 0;
    for (int p = 0; p < L->n_parts && rc == 0; p++) {
        const uint32_t n = L->part[p].n_cells;
        kvt__blob_positions(blob->data, L, p, pos);
        for (uint32_t c = 0; c < n && rc == 0; c++)
            if (pos[c] < p0 || pos[c] - p0 >= blob->n_tokens)
                rc = kvt__fail(KVT_EFORMAT, "%s: cell %u of part %d is at position %d, outside the block's [%d, %d)", what, c, p,
                               pos[c], p0, p0 + blob->n_tokens);
        qsort(pos, n, sizeof *pos, cmp_pos);
        for (uint32_t c = 1; c < n && rc == 0; c++)
            if (pos[c] == pos[c - 1])
                rc = kvt__fail(KVT_EFORMAT, "%s: position %d holds two cells in part %d of the block", what, pos[c], p);
    }
    free(pos);
    return rc;
}

/* ---- save ---- */

static int save_unified(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_blob *b) {
    llama_memory_t mem = llama_get_memory(e->ctx);
    llama_memory_seq_cp(mem, seq, e->seq_a, p0, p1); /* metadata only: cells are shared */
    int rc = kvt__engine_save_seq(e, e->seq_a, &b->data, &b->size);
    llama_memory_seq_rm(mem, e->seq_a, -1, -1);
    return rc;
}

/* Streams: the whole sequence's state (one snapshot per cache generation), sliced by position on
** the host; the SWA part keeps the cells in range that llama.cpp still serialises (the window). */
static int save_streams(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_blob *b) {
    const uint8_t *buf;
    size_t n;
    int rc = kvt__engine_snapshot(e, seq, &buf, &n);
    if (rc) return rc;
    struct kvt__blob_layout *L = malloc(sizeof *L);
    if (!L) return kvt__fail(KVT_ENOMEM, "block save");
    if ((rc = kvt__blob_parse(buf, n, e->n_parts, L)) == 0) {
        struct kvt__blob_src src = { buf, L, { p0, p0 }, { p1, p1 }, 0 };
        rc = kvt__blob_write(&src, 1, e->n_parts, 1, 0, seq, &b->data, &b->size);
    }
    free(L);
    return rc;
}

int kvt_block_save(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_blob **out) {
    *out = NULL;
    if (!kvt__engine_seq_ok(e, seq) || seq >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "block save: sequence id %d", seq);
    if (p0 < 0 || p1 <= p0) return kvt__fail(KVT_EINVAL, "block save: empty range [%d, %d)", p0, p1);
    int rc = kvt__engine_flush_shift(e);
    if (rc) return rc;
    kvt_blob *b = calloc(1, sizeof *b);
    if (!b) return kvt__fail(KVT_ENOMEM, "blob");
    rc = e->unified ? save_unified(e, seq, p0, p1, b) : save_streams(e, seq, p0, p1, b);
    if (rc) {
        free(b);
        return rc;
    }
    struct kvt__blob_layout *L = malloc(sizeof *L);
    if (!L) {
        kvt_blob_free(b);
        return kvt__fail(KVT_ENOMEM, "blob");
    }
    if ((rc = kvt__blob_parse(b->data, b->size, e->n_parts, L))) {
        free(L);
        kvt_blob_free(b);
        return rc;
    }
    if (L->part[0].n_cells == 0) {
        free(L);
        kvt_blob_free(b);
        return kvt__fail(KVT_ENOENT, "block save: sequence %d has no cells in [%d, %d)", seq, p0, p1);
    }
    kvt_pos lo, hi;
    part_span(b->data, L, 0, &lo, &hi);
    b->p0 = lo;
    b->n_tokens = hi - lo + 1;
    b->n_cells = (int32_t) L->part[0].n_cells;
    b->n_cells_swa = e->n_parts > 1 ? (int32_t) L->part[1].n_cells : 0;
    free(L);
    *out = b;
    return 0;
}

/* ---- load ---- */

static int load_unified(kvt_engine *e, const kvt_blob *blob, const struct kvt__blob_layout *L, int32_t seq, int32_t delta) {
    llama_memory_t mem = llama_get_memory(e->ctx);
    const uint8_t *src = blob->data;
    size_t n = blob->size;
    uint8_t *tmp = NULL;
    int rc;
    if (L->part[0].n_stream != 1 || (e->n_parts > 1 && L->part[1].n_stream != 1)) {
        /* llama.cpp's form from a context with one stream per sequence: to the one-stream form */
        struct kvt__blob_src one = { blob->data, L, { INT32_MIN, INT32_MIN }, { INT32_MAX, INT32_MAX }, 0 };
        if ((rc = kvt__blob_write(&one, 1, e->n_parts, 1, 0, e->seq_b, &tmp, &n))) return rc;
    } else if ((e->info.reanchor == KVT_REANCHOR_HOST && delta != 0) || e->test_corrupt_part >= 0) {
        if (!(tmp = malloc(n))) return kvt__fail(KVT_ENOMEM, "block load copy of %zu bytes", n);
        memcpy(tmp, blob->data, n);
    }
    if (tmp) {
        struct kvt__blob_layout *T = malloc(sizeof *T);
        rc = T ? kvt__blob_parse(tmp, n, e->n_parts, T) : kvt__fail(KVT_ENOMEM, "block load");
        if (rc == 0 && e->info.reanchor == KVT_REANCHOR_HOST && delta != 0)
            rc = kvt__blob_reanchor(tmp, T, delta, e->info.n_head_kv, e->rope);
        free(T);
        if (rc) {
            free(tmp);
            return rc;
        }
        if (e->test_corrupt_part >= 0) corrupt_for_test(e, tmp, n);
        src = tmp;
    }
    llama_memory_seq_rm(mem, e->seq_b, -1, -1);
    size_t r = llama_state_seq_set_data(e->ctx, src, n, e->seq_b);
    free(tmp);
    if (r != n) {
        llama_memory_seq_rm(mem, e->seq_b, -1, -1);
        return kvt__fail(KVT_ECTX,
                         "block load of %d tokens failed (llama.cpp read %zu of %zu bytes): no free KV cells "
                         "or a blob from another model/cache layout",
                         blob->n_tokens, r, n);
    }
    if (e->info.reanchor == KVT_REANCHOR_SEQ_ADD && delta != 0) {
        llama_memory_seq_add(mem, e->seq_b, -1, -1, delta);
        e->shift_pending = true;
    }
    llama_memory_seq_cp(mem, e->seq_b, seq, -1, -1);
    llama_memory_seq_rm(mem, e->seq_b, -1, -1);
    return 0;
}

/* Streams, SEQ_ADD path, when the block's old positions overlap the target's cells: llama.cpp's
** K-shift of the block alone, in the scratch stream, applied at once by one more token there.
** OUT *out: the shifted block in canonical form (caller frees). */
static int shift_in_scratch(kvt_engine *e, const kvt_blob *blob, const struct kvt__blob_layout *L, int32_t delta, uint8_t **out,
                            size_t *out_n) {
    llama_memory_t mem = llama_get_memory(e->ctx);
    const int32_t s = e->seq_flush;
    uint8_t *in = NULL;
    size_t in_n = 0;
    kvt_pos lo, hi, lo1, hi1;
    part_span(blob->data, L, 0, &lo, &hi);
    part_span(blob->data, L, 1, &lo1, &hi1);
    hi = KVT_MAX(hi, hi1);
    struct kvt__blob_src src = { blob->data, L, { INT32_MIN, INT32_MIN }, { INT32_MAX, INT32_MAX }, 0 };
    int rc = kvt__blob_write(&src, 1, e->n_parts, e->n_stream, (uint32_t) s, s, &in, &in_n);
    if (rc) return rc;
    llama_memory_seq_rm(mem, s, -1, -1);
    size_t r = llama_state_seq_set_data(e->ctx, in, in_n, s);
    free(in);
    if (r != in_n) {
        llama_memory_seq_rm(mem, s, -1, -1);
        return kvt__fail(KVT_ELLAMA, "block load: llama_state_seq_set_data read %zu of %zu bytes into the scratch sequence %d", r,
                         in_n, s);
    }
    llama_memory_seq_add(mem, s, -1, -1, delta);
    kvt_token t = 0;
    rc = kvt_engine_decode(e, s, &t, 1, hi + delta + 1, false); /* runs the pending shift first */
    struct state *st = NULL;
    if (rc == 0) rc = state_get(e, s, &st);
    kvt_seq_rm(e, s, -1, -1);
    if (rc == 0) {
        struct kvt__blob_src sl = { st->buf, &st->L, { lo + delta, lo + delta }, { hi + 1 + delta, hi + 1 + delta }, 0 };
        rc = kvt__blob_write(&sl, 1, e->n_parts, 1, 0, s, out, out_n);
    }
    state_free(st);
    return rc;
}

/* Streams: the target's cells plus the block's (re-anchored, positions rewritten), SWA cells
** trimmed to the new window, one set_data; on failure the previous cells are put back. */
static int load_streams(kvt_engine *e, const kvt_blob *blob, const struct kvt__blob_layout *Lb, int32_t seq, int32_t delta) {
    int rc = kvt__engine_flush_shift(e); /* a pending shift must land in K before the state is read */
    if (rc) return rc;
    struct state *cur = NULL, *blk = NULL;
    uint8_t *asm_buf = NULL;
    size_t asm_n = 0;
    struct kvt__blob_layout *Lref = malloc(sizeof *Lref);
    if (!Lref) return kvt__fail(KVT_ENOMEM, "block load");
    if ((rc = kvt__blob_parse(e->ref, e->ref_n, e->n_parts, Lref)) || (rc = state_get(e, seq, &cur))) goto out;
    const int64_t n_cells = (int64_t) cur->L.part[0].n_cells + Lb->part[0].n_cells;
    if (n_cells > e->n_ctx_seq) {
        rc = kvt__fail(KVT_ECTX, "block load of %u cells into sequence %d, which holds %u: its stream has %d cells",
                       Lb->part[0].n_cells, seq, cur->L.part[0].n_cells, e->n_ctx_seq);
        goto out;
    }
    /* the block as it goes in: positions and K final (HOST, or SEQ_ADD via the scratch stream), or
    ** at its old positions with llama.cpp's K-shift to follow (SEQ_ADD, "lazy") */
    const uint8_t *bbuf = blob->data;
    const struct kvt__blob_layout *bL = Lb;
    int32_t pending = 0; /* the shift still to apply to the block's cells */
    kvt_pos b_lo, b_hi, b_lo1, b_hi1;
    part_span(blob->data, Lb, 0, &b_lo, &b_hi);
    part_span(blob->data, Lb, 1, &b_lo1, &b_hi1);
    const kvt_pos b_min = KVT_MIN(b_lo, b_lo1), b_max = KVT_MAX(b_hi, b_hi1);
    if (delta != 0 && e->info.reanchor == KVT_REANCHOR_HOST) {
        if (!(blk = calloc(1, sizeof *blk)) || !(blk->buf = malloc(blob->size))) {
            rc = kvt__fail(KVT_ENOMEM, "block load copy of %zu bytes", blob->size);
            goto out;
        }
        memcpy(blk->buf, blob->data, blob->size);
        blk->n = blob->size;
        blk->L = *Lb;
        if ((rc = kvt__blob_reanchor(blk->buf, &blk->L, delta, e->info.n_head_kv, e->rope))) goto out;
        bbuf = blk->buf;
        bL = &blk->L;
    } else if (delta != 0) {
        bool overlap = false;
        for (int p = 0; p < e->n_parts && !overlap; p++)
            for (uint32_t c = 0; c < cur->L.part[p].n_cells && !overlap; c++) {
                kvt_pos pp = kvt__blob_cell_pos(cur->buf, &cur->L, p, c);
                overlap = pp >= b_min && pp <= b_max;
            }
        if (!overlap) {
            pending = delta;
        } else {
            if (!(blk = calloc(1, sizeof *blk))) {
                rc = kvt__fail(KVT_ENOMEM, "block load");
                goto out;
            }
            if ((rc = shift_in_scratch(e, blob, Lb, delta, &blk->buf, &blk->n)) ||
                (rc = kvt__blob_parse(blk->buf, blk->n, e->n_parts, &blk->L)))
                goto out;
            bbuf = blk->buf;
            bL = &blk->L;
        }
    }
    const kvt_pos new_max = KVT_MAX(kvt__pm_max(&e->pm[seq]), b_hi + delta);
    const kvt_pos win = swa_lo(e, new_max);
    const int32_t bwin = win == INT32_MIN ? INT32_MIN : win - pending; /* in the block's own positions */
    struct kvt__blob_src src[3] = {
        { e->ref, Lref, { 0, 0 }, { 0, 0 }, 0 }, /* selects nothing: the layout every part must match */
        { cur->buf, &cur->L, { INT32_MIN, win }, { INT32_MAX, INT32_MAX }, 0 },
        { bbuf, bL, { INT32_MIN, bwin }, { INT32_MAX, INT32_MAX }, 0 },
    };
    if ((rc = kvt__blob_write(src, 3, e->n_parts, e->n_stream, (uint32_t) seq, seq, &asm_buf, &asm_n))) goto out;
    if ((rc = replace_seq(e, seq, asm_buf, asm_n, cur, "block load"))) goto out;
    if (pending) {
        llama_memory_seq_add(llama_get_memory(e->ctx), seq, b_min, b_max + 1, pending);
        e->shift_pending = true;
    }
out:
    free(Lref);
    free(asm_buf);
    state_free(cur);
    state_free(blk);
    return rc;
}

int kvt_block_load(kvt_engine *e, const kvt_blob *blob, int32_t seq, kvt_pos new_p0) {
    if (!blob || !blob->data) return kvt__fail(KVT_EINVAL, "block load: NULL blob");
    if (!kvt__engine_seq_ok(e, seq) || seq >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "block load: sequence id %d", seq);
    kvt_pos tail = kvt__pm_max(&e->pm[seq]);
    if (new_p0 <= tail)
        return kvt__fail(KVT_EINVAL, "block load at position %d: sequence %d already holds position %d (load at the tail)", new_p0,
                         seq, tail);
    struct kvt__blob_layout *L = malloc(sizeof *L);
    if (!L) return kvt__fail(KVT_ENOMEM, "block load");
    int rc = kvt__blob_parse(blob->data, blob->size, e->n_parts, L);
    if (rc == 0 && L->part[0].n_cells == 0) rc = kvt__fail(KVT_EFORMAT, "block load: the blob holds no cells");
    if (rc == 0) rc = check_blob(blob, L, new_p0, "block load");
    if (rc == 0) rc = check_swa_cells(e, blob, L);
    /* the position map covers the block before the cache changes: the sets below cannot fail */
    if (rc == 0) rc = kvt__pm_reserve(&e->pm[seq], new_p0 + blob->n_tokens - 1);
    const int32_t delta = rc == 0 ? new_p0 - blob->p0 : 0;
    if (rc == 0) rc = e->unified ? load_unified(e, blob, L, seq, delta) : load_streams(e, blob, L, seq, delta);
    for (uint32_t c = 0; rc == 0 && c < L->part[0].n_cells; c++)
        kvt__pm_set(&e->pm[seq], kvt__blob_cell_pos(blob->data, L, 0, c) + delta);
    free(L);
    if (rc == 0) e->gen++;
    return rc;
}

/* Streams + HOST re-anchoring: every block (copied and re-anchored where it moves) after the
** sequence's cells, one assembly, one set_data: the cost is one write of the result, not one per
** block (a prefix of k blocks loaded one by one rewrites the sequence k times). */
static int load_many_streams(kvt_engine *e, const kvt_blob *const *blobs, int32_t n, int32_t seq, const kvt_pos *new_p0,
                             struct kvt__blob_layout *Ls) {
    int rc = kvt__engine_flush_shift(e);
    if (rc) return rc;
    struct state *cur = NULL;
    uint8_t **tmp = calloc((size_t) n, sizeof *tmp);
    struct kvt__blob_src *src = calloc((size_t) n + 2, sizeof *src);
    struct kvt__blob_layout *Lref = malloc(sizeof *Lref);
    uint8_t *asm_buf = NULL;
    size_t asm_n = 0;
    if (!tmp || !src || !Lref) {
        rc = kvt__fail(KVT_ENOMEM, "load of %d blocks", n);
        goto out;
    }
    if ((rc = kvt__blob_parse(e->ref, e->ref_n, e->n_parts, Lref)) || (rc = state_get(e, seq, &cur))) goto out;
    int64_t n_cells = cur->L.part[0].n_cells;
    kvt_pos new_max = kvt__pm_max(&e->pm[seq]);
    for (int32_t i = 0; i < n; i++) {
        n_cells += Ls[i].part[0].n_cells;
        new_max = KVT_MAX(new_max, new_p0[i] + blobs[i]->n_tokens - 1);
    }
    if (n_cells > e->n_ctx_seq) {
        rc = kvt__fail(KVT_ECTX, "load of %d blocks (%lld cells with the %u sequence %d holds): its stream has %d cells", n,
                       (long long) n_cells, cur->L.part[0].n_cells, seq, e->n_ctx_seq);
        goto out;
    }
    const kvt_pos win = swa_lo(e, new_max);
    src[0] = (struct kvt__blob_src){ e->ref, Lref, { 0, 0 }, { 0, 0 }, 0 };
    src[1] = (struct kvt__blob_src){ cur->buf, &cur->L, { INT32_MIN, win }, { INT32_MAX, INT32_MAX }, 0 };
    for (int32_t i = 0; i < n; i++) {
        const int32_t delta = new_p0[i] - blobs[i]->p0;
        const uint8_t *buf = blobs[i]->data;
        if (delta != 0) {
            if (!(tmp[i] = malloc(blobs[i]->size))) {
                rc = kvt__fail(KVT_ENOMEM, "block copy of %zu bytes", blobs[i]->size);
                goto out;
            }
            memcpy(tmp[i], blobs[i]->data, blobs[i]->size);
            if ((rc = kvt__blob_reanchor(tmp[i], &Ls[i], delta, e->info.n_head_kv, e->rope))) goto out;
            buf = tmp[i];
        }
        src[i + 2] = (struct kvt__blob_src){ buf, &Ls[i], { INT32_MIN, win }, { INT32_MAX, INT32_MAX }, 0 };
    }
    if ((rc = kvt__blob_write(src, n + 2, e->n_parts, e->n_stream, (uint32_t) seq, seq, &asm_buf, &asm_n))) goto out;
    rc = replace_seq(e, seq, asm_buf, asm_n, cur, "load of blocks");
out:
    for (int32_t i = 0; tmp && i < n; i++) free(tmp[i]);
    free(tmp);
    free(src);
    free(Lref);
    free(asm_buf);
    state_free(cur);
    return rc;
}

int kvt_blocks_load(kvt_engine *e, const kvt_blob *const *blobs, int32_t n, int32_t seq, const kvt_pos *new_p0) {
    if (n <= 0 || !blobs || !new_p0) return kvt__fail(KVT_EINVAL, "load of %d blocks", n);
    if (!kvt__engine_seq_ok(e, seq) || seq >= e->p.n_seq) return kvt__fail(KVT_EINVAL, "block load: sequence id %d", seq);
    kvt_pos prev = kvt__pm_max(&e->pm[seq]);
    struct kvt__blob_layout *Ls = malloc(sizeof *Ls * (size_t) n);
    if (!Ls) return kvt__fail(KVT_ENOMEM, "load of %d blocks", n);
    /* every block checked before any is loaded: bytes that are not what they claim (disk, Redis)
    ** fail the whole load with the sequence untouched */
    int rc = 0;
    char what[64];
    for (int32_t i = 0; rc == 0 && i < n; i++) {
        snprintf(what, sizeof what, "load of blocks: block %d", i);
        if (!blobs[i] || !blobs[i]->data) rc = kvt__fail(KVT_EINVAL, "%s is NULL", what);
        else if (new_p0[i] <= prev)
            rc = kvt__fail(KVT_EINVAL,
                           "%s at position %d is not past position %d (blocks go in ascending order at the "
                           "tail)",
                           what, new_p0[i], prev);
        if (rc == 0) rc = kvt__blob_parse(blobs[i]->data, blobs[i]->size, e->n_parts, &Ls[i]);
        if (rc == 0 && Ls[i].part[0].n_cells == 0) rc = kvt__fail(KVT_EFORMAT, "%s holds no cells", what);
        if (rc == 0) rc = check_blob(blobs[i], &Ls[i], new_p0[i], what);
        if (rc == 0) rc = check_swa_cells(e, blobs[i], &Ls[i]);
        if (rc == 0) prev = new_p0[i] + blobs[i]->n_tokens - 1;
    }
    if (rc == 0) rc = kvt__pm_reserve(&e->pm[seq], prev); /* the sets after the write cannot fail */
    if (rc) {
        free(Ls);
        return rc;
    }
    if (e->unified || e->info.reanchor != KVT_REANCHOR_HOST) { /* one by one; on error the loaded ones go again */
        free(Ls);
        kvt_pos tail = kvt__pm_max(&e->pm[seq]);
        for (int32_t i = 0; i < n; i++) {
            rc = kvt_block_load(e, blobs[i], seq, new_p0[i]);
            if (rc) {
                kvt_seq_rm(e, seq, tail + 1, -1); /* keeps the error message */
                return rc;
            }
        }
        return 0;
    }
    rc = load_many_streams(e, blobs, n, seq, new_p0, Ls);
    for (int32_t i = 0; rc == 0 && i < n; i++)
        for (uint32_t c = 0; c < Ls[i].part[0].n_cells; c++)
            kvt__pm_set(&e->pm[seq], kvt__blob_cell_pos(blobs[i]->data, &Ls[i], 0, c) + new_p0[i] - blobs[i]->p0);
    free(Ls);
    if (rc == 0) e->gen++;
    return rc;
}

/* ---- streams mode: seq_cp and seq_shift through whole-sequence state ---- */

int kvt__engine_seq_cp_host(kvt_engine *e, int32_t src, int32_t dst, kvt_pos p0, kvt_pos p1) {
    const kvt_pos lo = p0 < 0 ? INT32_MIN : p0, hi = p1 < 0 ? INT32_MAX : p1;
    int rc = kvt__engine_flush_shift(e);
    if (rc) return rc;
    struct state *S = NULL, *D = NULL;
    uint8_t *asm_buf = NULL;
    size_t asm_n = 0;
    struct kvt__blob_layout *Lref = malloc(sizeof *Lref);
    if (!Lref) return kvt__fail(KVT_ENOMEM, "seq_cp");
    if ((rc = kvt__blob_parse(e->ref, e->ref_n, e->n_parts, Lref)) || (rc = state_get(e, src, &S)) || (rc = state_get(e, dst, &D)))
        goto out;
    int32_t n = 0;
    kvt_pos s_max = -1;
    for (uint32_t c = 0; c < S->L.part[0].n_cells; c++) {
        kvt_pos pp = kvt__blob_cell_pos(S->buf, &S->L, 0, c);
        if (pp < lo || pp >= hi) continue;
        const struct posmap *m = &e->pm[dst];
        if (pp < m->cap && (m->bits[pp >> 3] & (1u << (pp & 7)))) {
            rc = kvt__fail(KVT_EINVAL,
                           "seq_cp from %d to %d: sequence %d already holds position %d (with one stream per "
                           "sequence a copy is a copy: the positions must be free)",
                           src, dst, dst, pp);
            goto out;
        }
        n++;
        s_max = KVT_MAX(s_max, pp);
    }
    if (n == 0) goto out; /* nothing in range: like llama_memory_seq_cp, a no-op */
    if ((int64_t) D->L.part[0].n_cells + n > e->n_ctx_seq) {
        rc = kvt__fail(KVT_ECTX, "seq_cp of %d cells into sequence %d, which holds %u: its stream has %d cells", n, dst,
                       D->L.part[0].n_cells, e->n_ctx_seq);
        goto out;
    }
    const kvt_pos win = swa_lo(e, KVT_MAX(kvt__pm_max(&e->pm[dst]), s_max));
    struct kvt__blob_src srcs[3] = {
        { e->ref, Lref, { 0, 0 }, { 0, 0 }, 0 },
        { D->buf, &D->L, { INT32_MIN, win }, { INT32_MAX, INT32_MAX }, 0 },
        { S->buf, &S->L, { lo, KVT_MAX(lo, win) }, { hi, hi }, 0 },
    };
    if ((rc = kvt__blob_write(srcs, 3, e->n_parts, e->n_stream, (uint32_t) dst, dst, &asm_buf, &asm_n))) goto out;
    if ((rc = replace_seq(e, dst, asm_buf, asm_n, D, "seq_cp"))) goto out;
    for (uint32_t c = 0; rc == 0 && c < S->L.part[0].n_cells; c++) {
        kvt_pos pp = kvt__blob_cell_pos(S->buf, &S->L, 0, c);
        if (pp >= lo && pp < hi) rc = kvt__pm_set(&e->pm[dst], pp);
    }
out:
    free(Lref);
    free(asm_buf);
    state_free(S);
    state_free(D);
    return rc;
}

int kvt__engine_seq_shift_host(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_pos delta) {
    struct state *cur = NULL;
    uint8_t *nb = NULL;
    int rc = state_get(e, seq, &cur);
    if (rc) return rc;
    if (!(nb = malloc(cur->n))) {
        rc = kvt__fail(KVT_ENOMEM, "seq_shift copy of %zu bytes", cur->n);
        state_free(cur);
        return rc;
    }
    memcpy(nb, cur->buf, cur->n);
    rc = kvt__blob_reanchor_range(nb, &cur->L, delta, p0, p1, e->info.n_head_kv, e->rope);
    if (rc == 0) rc = replace_seq(e, seq, nb, cur->n, cur, "seq_shift");
    free(nb);
    state_free(cur);
    return rc;
}

int kvt_blob_dup(const kvt_blob *b, kvt_blob **out) {
    kvt_blob *n = malloc(sizeof *n);
    *out = NULL;
    if (!n) return kvt__fail(KVT_ENOMEM, "blob");
    *n = *b;
    n->data = malloc(b->size);
    if (!n->data) {
        free(n);
        return kvt__fail(KVT_ENOMEM, "blob of %zu bytes", b->size);
    }
    memcpy(n->data, b->data, b->size);
    *out = n;
    return 0;
}

void kvt_engine_set_unsafe_skip_shift_flush(kvt_engine *e, bool skip) { e->skip_flush = skip; }

void kvt_engine_set_unsafe_corrupt_next_load(kvt_engine *e, int part) { e->test_corrupt_part = part; }

bool kvt_engine_shift_pending(const kvt_engine *e) { return e->shift_pending; }

void kvt_engine_test_cell_pos_snapshot(kvt_engine *e, bool on) {
    e->cp_force_snapshot = on;
    e->cp_seq = -1;
}

int64_t kvt_engine_test_cell_pos_snapshots(const kvt_engine *e) { return e->cp_snapshots; }

int kvt_blob_k_rows(const kvt_engine *e, const kvt_blob *blob, int part, int il, float **k, kvt_pos **pos, int32_t *n_cells,
                    int32_t *row_elems) {
    struct kvt__blob_layout L;
    *k = NULL;
    *pos = NULL;
    int rc = kvt__blob_parse(blob->data, blob->size, e->n_parts, &L);
    if (rc) return rc;
    if (part < 0 || part >= L.n_parts) return kvt__fail(KVT_EINVAL, "blob has no part %d", part);
    uint32_t nc = L.part[part].n_cells;
    if ((rc = kvt__blob_k_f32(blob->data, &L, part, il, NULL, row_elems))) return rc;
    float *kk = malloc(sizeof(float) * (nc ? nc : 1) * (size_t) (*row_elems ? *row_elems : 1));
    kvt_pos *pp = malloc(sizeof(kvt_pos) * (nc ? nc : 1));
    if (!kk || !pp) {
        free(kk);
        free(pp);
        return kvt__fail(KVT_ENOMEM, "K rows");
    }
    if (nc) kvt__blob_k_f32(blob->data, &L, part, il, kk, row_elems);
    for (uint32_t c = 0; c < nc; c++) pp[c] = kvt__blob_cell_pos(blob->data, &L, part, c);
    *k = kk;
    *pos = pp;
    *n_cells = (int32_t) nc;
    return 0;
}

int kvt_engine_layer_part(const kvt_engine *e, int32_t il, int *part, int *idx) {
    if (il < 0 || il >= e->info.n_layer || e->layer_part[il] < 0)
        return kvt__fail(KVT_ENOENT, "layer %d has no known cache part", il);
    *part = e->layer_part[il];
    *idx = e->layer_idx[il];
    return 0;
}

/* Rotate a head vector with the RoPE verified at open (used for InfLLM's position-free keys). */
int kvt__engine_rotate(const kvt_engine *e, int32_t il, float *x, int32_t n, int32_t delta) {
    int part = 0, idx = 0;
    if (kvt_engine_layer_part(e, il, &part, &idx) || !e->rope[part])
        return kvt__fail(KVT_EUNSUPPORTED, "no verified RoPE for layer %d", il);
    struct kvt__rope r = e->rope[part][idx];
    if (r.n_rot > n) return kvt__fail(KVT_EINVAL, "head vector of %d dims, n_rot %d", n, r.n_rot);
    kvt__rope_rotate_f32(x, &r, delta);
    return 0;
}
