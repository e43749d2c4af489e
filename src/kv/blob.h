/* blob.h — layout of llama.cpp's sequence-state bytes, a writer that slices and assembles them on
** the host, and host-side RoPE re-anchoring.
**
** The format (llama.cpp 0.5.0, llama_state_seq_get_data with host flags):
**   u32 magic 0xaf143cd8 ; i32 src_seq_id
**   per part (iSWA: full-attention cache, then sliding-window cache):
**     u32 n_stream ; then n_stream stream records, each:
**       u32 cell_count                               (0: the record ends here)
**       cell_count x { i32 pos ; u32 n_seq_id ; n_seq_id x i32 seq_id }
**       u32 v_trans ; u32 n_layer
**       per layer: i32 type_k ; u64 k_row_bytes ; cell_count rows
**       !v_trans: per layer: i32 type_v ; u64 v_row_bytes ; cell_count rows
**        v_trans: per layer: i32 type_v ; u32 elem ; u32 n_embd_v ; n_embd_v x cell_count elems
** n_stream is 1 for a unified cache (kv_unified = true) and n_seq_max for one stream per
** sequence; a sequence's state then has one non-empty record, in its own stream's slot, and
** llama.cpp loads a record of any slot into the target's stream but rejects a blob whose
** n_stream differs from the context's (bench/llama-streams/REPORT.md §2).
**
** kvtier's stored form (kvt_blob, the host pool) is canonical: n_stream = 1, whatever the
** context that saved it, so blocks move between contexts of either mode and any n_seq_max; the
** engine converts at its boundary with kvt__blob_write.
** Never installed; used by src/engine/ and tests through kvtier.h wrappers. */
#ifndef KVT_BLOB_H
#define KVT_BLOB_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "kvtier.h" /* kvt_blob */

#define KVT__BLOB_MAGIC 0xaf143cd8u
#define KVT__MAX_LAYERS 512

#define KVT__MAX_STREAMS 256 /* LLAMA_MAX_SEQ */

/* Cell positions a blob may carry, and positions a block may be moved to: [0, 2^30).  Far past
** any trained context, and room below INT32_MAX for position + delta and for the engine's
** position map, which grows by doubling.  Bytes from disk or Redis are untrusted: a position
** outside this range is a malformed block (KVT_EFORMAT), never arithmetic on it. */
#define KVT__MAX_POS (1 << 30)

/* One part, described by its only non-empty stream record (all other records are empty). */
struct kvt__blob_part {
    uint32_t n_stream; /* stream records in the part */
    uint32_t slot;     /* the non-empty record's stream (0 when the part is empty) */
    uint32_t n_cells;
    size_t cells_off; /* offset of the first cell record */
    bool cells_fixed; /* every cell record has one seq id (12 bytes): cell c is found at once */
    uint32_t v_trans, n_layer;
    int32_t k_type[KVT__MAX_LAYERS];
    uint64_t k_row_bytes[KVT__MAX_LAYERS];
    size_t k_off[KVT__MAX_LAYERS]; /* offset of layer's first K row */
    int32_t v_type[KVT__MAX_LAYERS];
    uint64_t v_row_bytes[KVT__MAX_LAYERS]; /* !v_trans: bytes per cell row; v_trans: element size */
    uint32_t v_n_embd[KVT__MAX_LAYERS];    /* v_trans: elements per cell (rows of the transposed V) */
    size_t v_off[KVT__MAX_LAYERS];         /* offset of layer's first V byte after its header */
    size_t v_bytes;                        /* all V bytes of the part, headers included */
};

struct kvt__blob_layout {
    int n_parts;
    struct kvt__blob_part part[2];
    size_t end; /* bytes consumed; equals the blob size when well-formed */
};

/* Walk a blob with n_parts memory parts (2 for iSWA caches) and any n_stream (1..256) per part,
** with at most one non-empty stream record per part.  Checks every field the other functions
** here index or size with: cell positions in [0, KVT__MAX_POS), K/V types known to ggml, row
** sizes whole elements of their type, every record inside n.  Returns 0 or KVT_EFORMAT with a
** message naming the offset or field and its value.  Never reads past n. */
int kvt__blob_parse(const uint8_t *buf, size_t n, int n_parts, struct kvt__blob_layout *out);

/* A stored block's shape from its own bytes (the store and the chunk cache get bytes only): sets
** b->n_cells, b->n_cells_swa (cells of each part; 0 without a sliding-window part) and b->p0 (the
** lowest position of part 0, the one its K rows are rotated for).  Returns 0, KVT_EFORMAT (does
** not parse with 1 or 2 parts, or no cells) or KVT_ENOMEM; b is unchanged on error. */
int kvt__blob_shape(kvt_blob *b);

/* Position of cell c of part p (cells are in ascending cell-index order).  Constant time when
** every cell has one seq id (llama.cpp's sequence states), else a walk over cells 0..c-1. */
int32_t kvt__blob_cell_pos(const uint8_t *buf, const struct kvt__blob_layout *L, int p, uint32_t c);
/* The positions of every cell of part p, in cell order, into pos[0..n_cells) (one walk). */
void kvt__blob_positions(const uint8_t *buf, const struct kvt__blob_layout *L, int p, int32_t *pos);

/* One source of cells for kvt__blob_write: the cells of a parsed blob whose positions lie in
** [lo[p], hi[p]) in part p (use INT32_MIN / INT32_MAX for "all"), positions moved by delta
** (positions only: rotate K beforehand with kvt__blob_reanchor); a moved position must stay in
** [0, KVT__MAX_POS) (else KVT_EFORMAT). */
struct kvt__blob_src {
    const uint8_t *buf;
    const struct kvt__blob_layout *L;
    int32_t lo[2], hi[2];
    int32_t delta;
};

/* Write a blob of n_parts parts holding the selected cells of every source, in source order
** (then cell order), as the single record of stream `slot` of n_stream records per part; each
** cell gets n_seq_id = 1 and seq id `seq`.  Sources of one part must agree on v_trans, layers,
** K/V types and row sizes (else KVT_EFORMAT naming the first difference).
** OUT *out (caller frees with free()), *n.  Errors: KVT_EFORMAT, KVT_EINVAL, KVT_ENOMEM. */
int kvt__blob_write(const struct kvt__blob_src *src, int n_src, int n_parts, uint32_t n_stream, uint32_t slot, int32_t seq,
                    uint8_t **out, size_t *n);

/* RoPE of one layer as llama.cpp applies it: theta_i = pos * scale * base^(-2i/n_rot). */
struct kvt__rope {
    float base, scale;
    int n_rot; /* rotated dims per head (<= head_dim) */
    bool neox; /* NEOX pairs (i, i + n_rot/2); otherwise adjacent pairs (2i, 2i+1) */
};

/* Rotate a head vector x[0..n_rot) by delta positions, in place. */
void kvt__rope_rotate_f32(float *x, const struct kvt__rope *r, int32_t delta);

/* cs[2i], cs[2i+1] = cos, sin of pair i's angle for a rotation by delta (n_rot/2 pairs). */
void kvt__rope_table(const struct kvt__rope *r, int32_t delta, float *cs);

/* Rotate x[0..n_rot) with a table from kvt__rope_table. */
void kvt__rope_apply(float *x, const struct kvt__rope *r, const float *cs);

/* Re-anchor a blob in place: add delta to the position of every cell whose position is in
** [lo, hi) (every part) and rotate its K rows of every layer by delta with rope[p][il] (F32 or
** F16 K only; head_dim = row elems / n_head_kv).  Nothing is modified unless it returns 0;
** errors: KVT_EUNSUPPORTED (quantised K), KVT_EFORMAT (also: a moved position would leave
** [0, KVT__MAX_POS)), KVT_ENOMEM. */
int kvt__blob_reanchor_range(uint8_t *buf, const struct kvt__blob_layout *L, int32_t delta, int32_t lo, int32_t hi, int n_head_kv,
                             struct kvt__rope *const rope[2]);

/* kvt__blob_reanchor_range over every cell. */
int kvt__blob_reanchor(uint8_t *buf, const struct kvt__blob_layout *L, int32_t delta, int n_head_kv,
                       struct kvt__rope *const rope[2]);

/* K rows of layer il of part p as F32: out[c * row_elems + e].  row_elems set on return.
** Returns 0, KVT_EUNSUPPORTED (quantised K) or KVT_EFORMAT.  out must hold n_cells*row elems;
** pass out = NULL to only learn row_elems. */
int kvt__blob_k_f32(const uint8_t *buf, const struct kvt__blob_layout *L, int p, int il, float *out, int32_t *row_elems);

#endif
