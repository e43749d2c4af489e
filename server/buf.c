/* buf.c — a growing text buffer for what the server writes piece by piece (GBNF grammars,
** large JSON replies): appends never fail loudly, an allocation that fails sets oom and the
** rest is dropped, so a writer checks once at the end. */
#include "serve.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool grow(struct serve_buf *b, size_t more) {
    if (b->oom) return false;
    if (b->n + more + 1 <= b->cap) return true;
    size_t cap = KVT_MAX(b->cap * 2, b->n + more + 256);
    char *s = realloc(b->s, cap);
    if (!s) {
        b->oom = true;
        return false;
    }
    b->s = s;
    b->cap = cap;
    return true;
}

void serve_buf_add(struct serve_buf *b, const char *s, size_t n) {
    if (!grow(b, n)) return;
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

void serve_buf_printf(struct serve_buf *b, const char *fmt, ...) {
    if (b->oom) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0) {
        b->oom = true;
        return;
    }
    if (!grow(b, (size_t) k)) return;
    va_start(ap, fmt);
    vsnprintf(b->s + b->n, (size_t) k + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t) k;
}
