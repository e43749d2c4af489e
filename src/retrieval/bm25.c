/* bm25.c — Okapi BM25 (Robertson & Zaragoza, "The Probabilistic Relevance Framework: BM25 and
** Beyond", 2009) over short block texts, the retrieval signal for recovering evicted blocks.
** Blocks are ~64 tokens and queries one user message, so plain arrays beat any index here. */
#include "internal.h"

#include <ctype.h>
#include <stdbool.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const stop_words[] = {
    "a",     "about", "all",   "also",  "am",    "an",   "and",  "any",  "are",   "as",   "at",   "be",   "been",
    "but",   "by",    "can",   "could", "did",   "do",   "does", "for",  "from",  "had",  "has",  "have", "he",
    "her",   "him",   "his",   "how",   "i",     "if",   "in",   "into", "is",    "it",   "its",  "just", "me",
    "my",    "no",    "not",   "of",    "on",    "or",   "our",  "she",  "so",    "some", "than", "that", "the",
    "their", "them",  "then",  "there", "these", "they", "this", "to",   "up",    "us",   "was",  "we",   "were",
    "what",  "when",  "where", "which", "who",   "why",  "will", "with", "would", "you",  "your",
};

static int is_stop(const char *w) {
    size_t lo = 0, hi = sizeof stop_words / sizeof stop_words[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(w, stop_words[mid]);
        if (c == 0) return 1;
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return 0;
}

struct terms {
    char **t;
    int n, cap;
};

static void terms_free(struct terms *ts) {
    for (int i = 0; i < ts->n; i++) free(ts->t[i]);
    free(ts->t);
}

/* The next word at or after *s: a lower-cased run of ASCII letters/digits (bytes >= 0x80 count as
** letters, so UTF-8 words stay whole) of at most 64 bytes, into w; *s moves past it.  Returns
** false at the end of the text. */
static bool next_word(const char **s, char w[65]) {
    const char *p = *s;
    for (;;) {
        while (*p && !(isalnum((unsigned char) *p) || (unsigned char) *p >= 0x80)) p++;
        const char *b = p;
        while (*p && (isalnum((unsigned char) *p) || (unsigned char) *p >= 0x80)) p++;
        size_t n = (size_t) (p - b);
        if (n == 0) {
            *s = p;
            return false;
        }
        if (n > 64) continue;
        for (size_t i = 0; i < n; i++) w[i] = (char) tolower((unsigned char) b[i]);
        w[n] = '\0';
        *s = p;
        return true;
    }
}

/* The words of s (next_word), stop words dropped.  Returns 0 or KVT_ENOMEM. */
static int split_terms(const char *s, struct terms *out) {
    out->t = NULL;
    out->n = out->cap = 0;
    char w[65];
    while (s && next_word(&s, w)) {
        if (is_stop(w)) continue;
        if (out->n == out->cap) {
            int cap = out->cap ? out->cap * 2 : 32;
            char **nt = realloc(out->t, sizeof(char *) * (size_t) cap);
            if (!nt) {
                terms_free(out);
                return kvt__fail(KVT_ENOMEM, "bm25 terms");
            }
            out->t = nt;
            out->cap = cap;
        }
        if (!(out->t[out->n] = strdup(w))) {
            terms_free(out);
            return kvt__fail(KVT_ENOMEM, "bm25 term");
        }
        out->n++;
    }
    return 0;
}

static int count(const struct terms *d, const char *w) {
    int c = 0;
    for (int i = 0; i < d->n; i++) c += strcmp(d->t[i], w) == 0;
    return c;
}

int kvt_bm25_score(const char *const *docs, int32_t n_docs, const char *query, double *scores) {
    const double k1 = 1.2, b = 0.75;
    struct terms q, *d = calloc((size_t) (n_docs > 0 ? n_docs : 1), sizeof *d);
    if (!d) return kvt__fail(KVT_ENOMEM, "bm25 docs");
    int rc = split_terms(query, &q);
    double avgdl = 0;
    for (int32_t i = 0; rc == 0 && i < n_docs; i++) {
        rc = split_terms(docs[i], &d[i]);
        avgdl += d[i].n;
        scores[i] = 0;
    }
    if (rc == 0 && n_docs > 0) {
        avgdl = avgdl / n_docs > 0 ? avgdl / n_docs : 1;
        for (int j = 0; j < q.n; j++) {
            int dup = 0; /* each distinct query term counts once */
            for (int k = 0; k < j && !dup; k++) dup = strcmp(q.t[k], q.t[j]) == 0;
            if (dup) continue;
            int df = 0;
            for (int32_t i = 0; i < n_docs; i++) df += count(&d[i], q.t[j]) > 0;
            if (df == 0) continue;
            double idf = log(1.0 + (n_docs - df + 0.5) / (df + 0.5));
            for (int32_t i = 0; i < n_docs; i++) {
                int tf = count(&d[i], q.t[j]);
                if (tf) scores[i] += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * d[i].n / avgdl));
            }
        }
    }
    for (int32_t i = 0; i < n_docs; i++) terms_free(&d[i]);
    if (rc == 0) terms_free(&q);
    free(d);
    return rc;
}

int kvt_bm25_novel_terms(const char *query, const char *const *context, int32_t n_context, char **out) {
    *out = NULL;
    struct terms q;
    int rc = split_terms(query, &q);
    if (rc) return rc;
    struct terms *d = calloc((size_t) (n_context > 0 ? n_context : 1), sizeof *d);
    if (!d) {
        terms_free(&q);
        return kvt__fail(KVT_ENOMEM, "bm25 context");
    }
    for (int32_t i = 0; rc == 0 && i < n_context; i++) rc = split_terms(context[i] ? context[i] : "", &d[i]);
    size_t len = 0;
    char *buf = NULL;
    if (rc == 0 && !(buf = malloc(strlen(query) + 1))) rc = kvt__fail(KVT_ENOMEM, "bm25 query");
    for (int j = 0; rc == 0 && j < q.n; j++) {
        int seen = 0;
        for (int k = 0; k < j && !seen; k++) seen = strcmp(q.t[k], q.t[j]) == 0;
        for (int32_t i = 0; i < n_context && !seen; i++) seen = count(&d[i], q.t[j]) > 0;
        if (seen) continue;
        size_t n = strlen(q.t[j]); /* terms are lower-cased slices of the query: they fit */
        if (len) buf[len++] = ' ';
        memcpy(buf + len, q.t[j], n);
        len += n;
    }
    if (buf) buf[len] = '\0';
    for (int32_t i = 0; i < n_context; i++) terms_free(&d[i]);
    free(d);
    terms_free(&q);
    if (rc) {
        free(buf);
        return rc;
    }
    *out = buf;
    return 0;
}

/* Byte offset just past the last word of text that is one of query's terms (same analysis as
** kvt_bm25_score), -1 if none.  For the session's successor rule. */
int32_t kvt__bm25_last_match(const char *text, const char *query) {
    struct terms q;
    if (!text || split_terms(query, &q)) return -1;
    int32_t last = -1;
    const char *s = text;
    char w[65];
    while (next_word(&s, w))
        if (count(&q, w) > 0) last = (int32_t) (s - text);
    terms_free(&q);
    return last;
}
