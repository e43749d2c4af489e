/* blob.h — layout of llama.cpp's sequence-state bytes and host-side RoPE re-anchoring.
**
** The format (llama.cpp 0.5.0, host flags, unified KV, one stream per part):
**   u32 magic 0xaf143cd8 ; i32 src_seq_id
**   per part (iSWA: full-attention cache, then sliding-window cache):
**     u32 n_stream (= 1) ; u32 cell_count
**     cell_count x { i32 pos ; u32 n_seq_id ; n_seq_id x i32 seq_id }
**     u32 v_trans ; u32 n_layer
**     per layer: i32 type_k ; u64 k_row_bytes ; cell_count rows
**     !v_trans: per layer: i32 type_v ; u64 v_row_bytes ; cell_count rows
**      v_trans: per layer: i32 type_v ; u32 elem ; u32 n_embd_v ; n_embd_v x cell_count elems
** (cell_count = 0 ends the part right after the count.)
** Never installed; used by src/engine/ and tests through kvtier.h wrappers. */
#ifndef KVT_BLOB_H
#define KVT_BLOB_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#define KVT__BLOB_MAGIC 0xaf143cd8u
#define KVT__MAX_LAYERS 512

struct kvt__blob_part {
    uint32_t n_cells;
    size_t   cells_off;          /* offset of the first cell record */
    uint32_t v_trans, n_layer;
    int32_t  k_type[KVT__MAX_LAYERS];
    uint64_t k_row_bytes[KVT__MAX_LAYERS];
    size_t   k_off[KVT__MAX_LAYERS]; /* offset of layer's first K row */
    size_t   v_bytes;            /* all V bytes of the part, headers included */
};

struct kvt__blob_layout {
    int      n_parts;
    struct kvt__blob_part part[2];
    size_t   end;                /* bytes consumed; equals the blob size when well-formed */
};

/* Walk a blob with n_parts memory parts (2 for iSWA caches).  Returns 0 or KVT_EFORMAT with a
** message naming the offset and field that was wrong.  Never reads past n. */
int kvt__blob_parse(const uint8_t *buf, size_t n, int n_parts, struct kvt__blob_layout *out);

/* Position of cell c of part p (cells are in ascending cell-index order). */
int32_t kvt__blob_cell_pos(const uint8_t *buf, const struct kvt__blob_layout *L, int p, uint32_t c);

/* RoPE of one layer as llama.cpp applies it: theta_i = pos * scale * base^(-2i/n_rot). */
struct kvt__rope {
    float base, scale;
    int   n_rot;     /* rotated dims per head (<= head_dim) */
    bool  neox;      /* NEOX pairs (i, i + n_rot/2); otherwise adjacent pairs (2i, 2i+1) */
};

/* Rotate a head vector x[0..n_rot) by delta positions, in place. */
void kvt__rope_rotate_f32(float *x, const struct kvt__rope *r, int32_t delta);

/* cs[2i], cs[2i+1] = cos, sin of pair i's angle for a rotation by delta (n_rot/2 pairs). */
void kvt__rope_table(const struct kvt__rope *r, int32_t delta, float *cs);

/* Rotate x[0..n_rot) with a table from kvt__rope_table. */
void kvt__rope_apply(float *x, const struct kvt__rope *r, const float *cs);

/* Re-anchor a blob in place: add delta to every cell position of every part and rotate every
** K row of every layer by delta with rope[p][il] (F32 or F16 K only; head_dim = row elems /
** n_head_kv).  Returns 0, KVT_EUNSUPPORTED (quantised K) or KVT_EFORMAT. */
int kvt__blob_reanchor(uint8_t *buf, const struct kvt__blob_layout *L, int32_t delta,
                       int n_head_kv, struct kvt__rope *const rope[2]);

/* K rows of layer il of part p as F32: out[c * row_elems + e].  row_elems set on return.
** Returns 0, KVT_EUNSUPPORTED (quantised K) or KVT_EFORMAT.  out must hold n_cells*row elems;
** pass out = NULL to only learn row_elems. */
int kvt__blob_k_f32(const uint8_t *buf, const struct kvt__blob_layout *L, int p, int il,
                    float *out, int32_t *row_elems);

#endif
