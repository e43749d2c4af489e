/* internal.h — helpers shared by kvtier's source files.  Never installed. */
#ifndef KVT_INTERNAL_H
#define KVT_INTERNAL_H

#include "kvtier.h"
#include "kvtier_int.h"

/* Record a detailed message for kvt_errmsg() and return err (printf-style). */
int kvt__fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvt__clear_error(void);

/* Monotonic clock in milliseconds. */
double kvt__now_ms(void);

#define KVT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVT_MAX(a, b) ((a) > (b) ? (a) : (b))


/* Replace the engine's last logits (n_vocab floats), e.g. after a side computation such as a
** teacher-forced score, so that the next kvt_engine_sample sees the conversation's logits again. */
void kvt__engine_set_logits(kvt_engine *e, const float *logits);
/* Rotate one head vector x[0..n) of layer il by delta positions with the RoPE verified at
** engine open (host re-anchoring path).  Errors: KVT_EUNSUPPORTED (no verified RoPE). */
int kvt__engine_rotate(const kvt_engine *e, int32_t il, float *x, int32_t n, int32_t delta);
/* The text of tokens tok[0..n) piece by piece (special tokens rendered, as kvt_tokenize with
** parse_special reads them): OUT *text (caller frees, NUL-terminated), ends[i] = bytes of text
** up to and including token i, split[i] = token i is one the tokenizer splits text at (control,
** user-defined or unknown: its neighbours are tokenized apart).  A first token that is the BOS
** kvt_tokenize(add_bos) adds has no text.  ends and split: [n], the caller's.  Thread-safe (reads
** the vocabulary only).  Errors: KVT_ENOMEM, KVT_ELLAMA. */
int kvt__engine_token_text(const kvt_engine *e, const kvt_token *tok, int32_t n, char **text, size_t *ends, bool *split);
/* Byte offset just past the last word of text that is one of query's BM25 terms, -1 if none. */
int32_t kvt__bm25_last_match(const char *text, const char *query);

/* Path of key's spill file in buf, or "" while the entry is in RAM.  The session asks it to tell
** KVT_RES_HOST from KVT_RES_DISK; the tests, to corrupt and remove spill files.  Not public: the
** file layout is the pool's own (the persistent store will change it), and users see where
** entries are through kvt_pool_get_stats and kvt_block_info.residency.
** Errors: KVT_ENOENT, KVT_EINVAL (NULL pool or buf, or the path does not fit: buf is set to "").
** Thread-safe. */
int kvt_pool_spill_path(kvt_pool *pool, uint64_t key, char *buf, size_t buf_size);
#endif
