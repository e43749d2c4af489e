/* internal.h — helpers shared by kvtier's source files.  Never installed. */
#ifndef KVT_INTERNAL_H
#define KVT_INTERNAL_H

#include "kvtier.h"

/* Record a detailed message for kvt_errmsg() and return err (printf-style). */
int kvt__fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvt__clear_error(void);

/* Monotonic clock in milliseconds. */
double kvt__now_ms(void);

#define KVT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVT_MAX(a, b) ((a) > (b) ? (a) : (b))


/* Replace the engine's last logits (n_vocab floats), e.g. after a side computation such as a
** teacher-forced score, so that the next kvt_sample sees the conversation's logits again. */
void kvt__engine_set_logits(kvt_engine *e, const float *logits);
/* Rotate one head vector x[0..n) of layer il by delta positions with the RoPE verified at
** engine open (host re-anchoring path).  Errors: KVT_EUNSUPPORTED (no verified RoPE). */
int kvt__engine_rotate(const kvt_engine *e, int32_t il, float *x, int32_t n, int32_t delta);
/* Byte offset just past the last word of text that is one of query's BM25 terms, -1 if none. */
int32_t kvt__bm25_last_match(const char *text, const char *query);
#endif
