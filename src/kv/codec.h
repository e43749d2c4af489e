/* codec.h — internals of the block codecs (kvtier.h section 9): a K/V tensor of a blob seen as
** a matrix, and the per-tensor section coders (codec_tensor.c) the container (codec.c) calls.
** Never installed; tests include it for the host reference computations.
**
** A section encodes one K or V tensor of one layer (n_cells x n_embd elements):
**   raw-cell bitmap   ceil(n_cells / 8) bytes, bit c set = cell c stored raw (a sink)
**   raw cells         n_raw x n_embd elements in the cache type, cell-major
**   body              the m = n_cells - n_raw other cells (matrix Y[m][n_embd], in cell order):
**     q8 / q4         n_groups x { f32 min, f32 step }, then the codes (bits each, packed low
**                     nibble first for q4) in group order
**     elastic         n_head x f32 tau, bitmap of kept elements (ceil(m n_embd / 8) bytes,
**                     row-major), the kept elements in the cache type, row-major
**     elastic+q8      n_head x f32 tau, bitmap, n_groups x { f32 min, f32 step } over the kept
**                     elements of each group, one u8 code per kept element in group order
**     elastic+q4      as elastic+q8 with a 4-bit code per kept element, packed low nibble first
**                     across the whole section (ceil(n_kept / 2) bytes)
**     ecq             n_groups x { f16 offset, f16 step } (KIVI's groups, as q4's), u32 n_esc,
**                     n_esc x f32 escaped elements, u32 zlen, u32 zpad, a zstd frame of zlen bytes
**                     holding one code a byte for every element in X's row-major order (zigzag of
**                     round((x - offset) / step), 0..252; 255 = the next escaped element), zpad
**                     zero bytes (a body is at least kvt__ecq_min_body bytes, one bit an element,
**                     so what decoding allocates, ~9 bytes an element, stays within ~72x its size);
**                     one zstd frame of the current format, nothing after it
**     q8 / q4 with per-head bits (head_bits, header version 2): n_groups x { f32 min, f32 step },
**                     then each group's codes in its head's bits (4 or 8), a 4-bit group packed
**                     low nibble first and padded to a whole byte
** Groups (KIVI): K groups are group_k consecutive cells of one channel, channel-major
** (channel 0's groups first); V groups are group_v consecutive channels of one cell, cell-major. */
#ifndef KVT_CODEC_INT_H
#define KVT_CODEC_INT_H

#include "kvtier.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { KVT__SEC_K = 0, KVT__SEC_V = 1 };
#define KVT__MAX_HEADS 256   /* n_head_kv the codecs accept */
#define KVT__ECQ_STEP  0.25f /* ecq's default step, x each group's standard deviation (kvtier.h section 9) */

/* One F16 or F32 tensor inside a blob buffer: element (c, e) of cell c, channel e lives at
** base + (trans ? e * n_cells + c : c * n_embd + e) * elsize. */
struct kvt__mat {
    uint8_t *base;
    uint32_t n_cells, n_embd;
    uint32_t elsize; /* 2 (F16) or 4 (F32) */
    bool trans;
};

/* A growing output buffer; err latches the first allocation failure. */
struct kvt__buf {
    uint8_t *p;
    size_t n, cap;
    bool err;
};
void kvt__buf_put(struct kvt__buf *b, const void *src, size_t k);
/* Capacity for cap bytes in all (one allocation now instead of doublings later). */
void kvt__buf_reserve(struct kvt__buf *b, size_t cap);
/* k zero bytes (placeholders filled in later). */
void kvt__buf_zero(struct kvt__buf *b, size_t k);

float kvt__mat_get(const struct kvt__mat *m, uint32_t c, uint32_t e);
void kvt__mat_set(const struct kvt__mat *m, uint32_t c, uint32_t e, float v);

/* ElasticKV threshold of each head of a row-major matrix x[n_cells][n_embd] (head h = channels
** [h * n_embd / n_head, (h + 1) * n_embd / n_head)): tau[h] = max(sigma / 2, mu) * s, mu and
** sigma the mean and (population) standard deviation of |x| over the head's elements. */
void kvt__elastic_tau(const float *x, uint32_t n_cells, uint32_t n_embd, int n_head, float s, float *tau /* OUT */);

/* Encode tensor m as a section (layout above) appended to out.  raw_cell[c]: cell c stays raw.
** Adds to *n_lossy / *n_zeroed.  head_bits: NULL, or (q8/q4) [n_head] bits of each KV head of
** this tensor's layer (every group lies within one head: the caller checks head_dim % group_v).
** Errors: KVT_ENOMEM. */
int kvt__sec_encode(struct kvt__buf *out, const struct kvt__mat *m, const bool *raw_cell, int kind,
                    const struct kvt_codec_params *p, int n_head, int64_t *n_lossy, int64_t *n_zeroed, const uint8_t *head_bits);

/* X's shape for a tensor of M lossy cells of E channels (kernels, below): R rows of L elements,
** groups of G along a row (group_k for K, group_v for V), n_groups of them, ne elements. */
struct kvt__xshape {
    uint32_t R, L, G;
    size_t ne, n_groups;
};
struct kvt__xshape kvt__x_shape(int kind, uint32_t M, uint32_t E, const struct kvt_codec_params *p);

/* The lossy cells of m as X (codec.h, kernels), after appending the raw cells to out (cell-major,
** in the cache type).  OUT *x: R x L floats (caller frees).  Errors: KVT_ENOMEM. */
int kvt__sec_x_encode(struct kvt__buf *out, const struct kvt__mat *m, const bool *raw_cell, int kind, uint32_t M, float **x);
/* The inverse: X (R x L) and the raw cells (rawv, those set in cbm) written into m; m is not
** touched on error.  Errors: KVT_ENOMEM. */
int kvt__sec_x_decode(const struct kvt__mat *m, const uint8_t *cbm, const uint8_t *rawv, uint32_t M, int kind, const float *x);

/* ecq (codec_ecq.c): encode the M lossy cells' body, raw cells first; decode a body of n bytes
** (after the raw cells).  Errors: KVT_ENOMEM; decode KVT_ECORRUPT naming the section `what`. */
int kvt__ecq_encode(struct kvt__buf *out, const struct kvt__mat *m, const bool *raw_cell, int kind,
                    const struct kvt_codec_params *p, uint32_t M);
int kvt__ecq_decode(const uint8_t *b, size_t n, const struct kvt__mat *m, const uint8_t *cbm, const uint8_t *rawv, uint32_t M,
                    int kind, const struct kvt_codec_params *p, const char *what);
/* The fewest bytes an ecq body of ne elements has (ne / 8: a decoder's allocation is bounded by
** its input). */
size_t kvt__ecq_min_body(size_t ne);

/* Decode a section of exactly n bytes into m (every element written).  Errors: KVT_ECORRUPT
** (sizes or counts inconsistent with the tensor; the message names the section `what`),
** KVT_ENOMEM. */
int kvt__sec_decode(const uint8_t *enc, size_t n, const struct kvt__mat *m, int kind, const struct kvt_codec_params *p, int n_head,
                    const char *what, const uint8_t *head_bits);

/* The container's checksum of version `version` over p[0..n) into md: XXH3-128 canonical then 16
** zero bytes (KVT_CODEC_VERSION, _HEADS), SHA-256 (the _SHA256 versions).  Errors: KVT_ENOMEM
** (OpenSSL failed). */
int kvt__codec_digest(int version, const uint8_t *p, size_t n, uint8_t md[32]);

/* ---- kernels (codec_kern.c): q8/q4 over contiguous groups, the F16 conversions ----
** The uniform q8/q4 sections see the lossy elements as a row-major F32 matrix X[R][L] whose
** groups are G consecutive elements of a row: K as channels x cells (R = n_embd, L = m),
** V as cells x channels (R = m, L = n_embd); group and code order are then X's row-major order,
** which is the section layout above. */

/* F16 <-> F32 of n elements; src and dst may be misaligned (blob bytes).  Round to nearest even,
** as ggml's converters. */
void kvt__h2f(const uint8_t *src, float *dst, size_t n);
void kvt__f2h(const float *src, uint8_t *dst, size_t n);
/* dst[j][i] = src[i][j] for src[rows][cols] (dst is cols x rows; no overlap). */
void kvt__transpose(const float *src, uint32_t rows, uint32_t cols, float *dst);
/* Quantise X[R][L] in groups of G along each row to bits (8 or 4) per element: prm gets every
** group's { f32 min, f32 step } (8 bytes each, row-major group order, unaligned), codes[R * L]
** one code per element (unpacked). */
void kvt__quant_rows(const float *x, uint32_t R, uint32_t L, uint32_t G, int bits, uint8_t *prm, uint8_t *codes);
/* The inverse: X[i] = min + code * step of its group. */
void kvt__dequant_rows(const uint8_t *codes, const uint8_t *prm, uint32_t R, uint32_t L, uint32_t G, float *x);
/* ecq: X[R][L] in groups of G along each row: prm gets every group's { f16 mean, f16 step = s x
** the standard deviation } over its finite elements within 4 deviations of their mean (then again
** without the others: outliers), the step at least |mean - offset| / 64 (4 bytes each, row-major
** group order), codes one
** byte per element (zigzag of round((x - mean) / step) within +-126, else 255), esc the 255s'
** elements in order; returns their count.  dequant: X = offset + q x step (255s left to the caller). */
uint32_t kvt__ecq_quant_rows(const float *x, uint32_t R, uint32_t L, uint32_t G, float s, uint8_t *prm, uint8_t *codes, float *esc);
void kvt__ecq_dequant_rows(const uint8_t *codes, const uint8_t *prm, uint32_t R, uint32_t L, uint32_t G, float *x);
/* n 4-bit codes (one per byte) to ceil(n / 2) bytes, low nibble first, and back. */
void kvt__pack4(const uint8_t *codes, size_t n, uint8_t *packed);
void kvt__unpack4(const uint8_t *packed, size_t n, uint8_t *codes);

#endif
