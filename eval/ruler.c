/* ruler.c — the cases of `kvtier eval ruler`: RULER's synthetic task families, following the
** task definitions of Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context
** Language Models?" (COLM 2024, arXiv:2404.06654) and NVIDIA's reference generator (task names,
** templates, needle wording, haystack types, sizes):
**
**   niah_single_1    noise haystack ("The grass is green. ..." repeated), word key, 7-digit number
**   niah_single_2    essay haystack, word key, number
**   niah_single_3    essay haystack, word key, UUID
**   niah_multikey_1  essay haystack, 4 keys, one queried (3 distractor needles)
**   niah_multikey_2  the haystack is all distractor needles (word keys, numbers)
**   niah_multikey_3  the haystack is all distractor needles (UUID keys, UUID values)
**   niah_multivalue  one key with 4 values, all asked for
**   niah_multiquery  4 keys, all 4 asked for in one query
**   vt               variable tracking: one chain of 4 hops ("VAR QPXKM = 42817." then "VAR ZUTRE =
**                    QPXKM." ...) in noise; find every variable that holds the value
**   cwe              common words extraction: a numbered list where 10 words appear 30 times and the
**                    others 3 times; name the 10 common ones
**   fwe              frequent words extraction: coded words drawn from a Zipf law (alpha 2); name
**                    the three most frequent
**
** Scoring is RULER's string_match_all: the fraction of the reference strings the reply contains,
** case-insensitive (eval_run.c).  Deviations from the reference generator, all forced by having no
** network and no Python at run time: keys are two words of the essays' vocabulary joined by a
** hyphen (RULER draws adjective-noun pairs from the wonderwords lists); cwe draws its words from
** the same vocabulary, and when the context is too short for 10 x 30 + uncommon words the common
** frequency drops so the common words take at most half of the list (never below 4, above the
** uncommon 3); fwe has no "...." noise between words and its vocabulary is pseudo-words of 5
** letters; the teacher-forced answer joins the references with ", " after RULER's answer prefix.
**
** The followup shape (SCBench's shared context, multi-turn) needs EVAL_FOLLOWUPS distinct queries
** about one context: the keyed tasks put that many query groups into the context (each group what
** one RULER case holds: its queried keys, its distractor keys, its values), vt that many chains.
** cwe and fwe have one question only and do not take the shape (cmd_eval.c refuses it). */
#include "eval.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum hay { HAY_NOISE, HAY_ESSAY, HAY_NEEDLE, HAY_VT, HAY_CWE, HAY_FWE };
enum kind { K_WORDS, K_NUMBERS, K_UUIDS };

struct spec {
    enum hay hay;
    enum kind key, val;
    int n_k, n_v, n_q; /* RULER's num_needle_k, num_needle_v, num_needle_q */
};

const struct eval_ruler_task eval_ruler_tasks[] = {
    { "niah_single_1", "one needle (word key, 7-digit number) in repeated noise sentences" },
    { "niah_single_2", "one needle (word key, number) in essay text" },
    { "niah_single_3", "one needle (word key, UUID) in essay text" },
    { "niah_multikey_1", "4 needles with different keys in essay text, one asked for" },
    { "niah_multikey_2", "the haystack is needles with other keys (words, numbers)" },
    { "niah_multikey_3", "the haystack is needles with other keys (UUIDs, UUIDs)" },
    { "niah_multivalue", "one key with 4 values in essay text, all 4 asked for" },
    { "niah_multiquery", "4 needles in essay text, all 4 keys asked for at once" },
    { "vt", "variable tracking: a chain of 4 assignments in noise; name every variable of a value" },
    { "cwe", "common words extraction: the 10 words that appear most often in a numbered list" },
    { "fwe", "frequent words extraction: the 3 most frequent coded words (Zipf, alpha 2)" },
};
const int32_t eval_ruler_n_tasks = (int32_t) (sizeof eval_ruler_tasks / sizeof eval_ruler_tasks[0]);

static const struct spec SPECS[] = {
    { HAY_NOISE, K_WORDS, K_NUMBERS, 1, 1, 1 },  { HAY_ESSAY, K_WORDS, K_NUMBERS, 1, 1, 1 },
    { HAY_ESSAY, K_WORDS, K_UUIDS, 1, 1, 1 },    { HAY_ESSAY, K_WORDS, K_NUMBERS, 4, 1, 1 },
    { HAY_NEEDLE, K_WORDS, K_NUMBERS, 1, 1, 1 }, { HAY_NEEDLE, K_UUIDS, K_UUIDS, 1, 1, 1 },
    { HAY_ESSAY, K_WORDS, K_NUMBERS, 1, 4, 1 },  { HAY_ESSAY, K_WORDS, K_NUMBERS, 4, 1, 4 },
    { HAY_VT, K_WORDS, K_NUMBERS, 1, 1, 1 },     { HAY_CWE, K_WORDS, K_WORDS, 0, 0, 1 },
    { HAY_FWE, K_WORDS, K_WORDS, 0, 0, 1 },
};

#define VT_HOPS 4
#define CWE_N   10
#define CWE_UCW 3
#define FWE_TOP 3

static const char NOISE[] = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

int32_t eval_ruler_find(const char *name) {
    for (int32_t i = 0; i < eval_ruler_n_tasks; i++)
        if (!strcmp(eval_ruler_tasks[i].name, name)) return i;
    return -1;
}

bool eval_ruler_has_followups(int32_t task) { return SPECS[task].hay != HAY_CWE && SPECS[task].hay != HAY_FWE; }

/* ---------------------------------------------------------------------------------------- */
/* the corpus's words                                                                       */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *) a, *(char *const *) b); }

int eval_corpus_words(struct eval_corpus *c) {
    if (c->words) return 0;
    int32_t cap = 4096, n = 0;
    char **w = malloc(sizeof *w * (size_t) cap);
    if (!w) return -1;
    for (int i = 0; i < c->n; i++) {
        if (c->e[i].held_out) continue;
        for (const char *p = c->e[i].text; *p;) {
            if (!isalpha((unsigned char) *p)) {
                p++;
                continue;
            }
            const char *a = p;
            while (isalpha((unsigned char) *p)) p++;
            size_t len = (size_t) (p - a);
            bool lower = true;
            for (size_t k = 0; k < len; k++) lower &= a[k] >= 'a' && a[k] <= 'z';
            if (!lower || len < 3 || len > 10 || (*p && (isdigit((unsigned char) *p) || *p == '\'' || *p == '-'))) continue;
            if (n == cap) {
                cap *= 2;
                char **nw = realloc(w, sizeof *nw * (size_t) cap);
                if (!nw) goto oom;
                w = nw;
            }
            if (!(w[n] = strndup(a, len))) goto oom;
            n++;
        }
    }
    qsort(w, (size_t) n, sizeof *w, cmp_str);
    int32_t u = 0;
    for (int32_t i = 0; i < n; i++) {
        if (u > 0 && !strcmp(w[u - 1], w[i])) {
            free(w[i]);
            continue;
        }
        w[u++] = w[i];
    }
    if (u < 100) { /* too few to draw distinct keys from */
        for (int32_t i = 0; i < u; i++) free(w[i]);
        free(w);
        return -1;
    }
    c->words = w;
    c->n_words = u;
    return 0;
oom:
    for (int32_t i = 0; i < n; i++) free(w[i]);
    free(w);
    return -1;
}

/* ---------------------------------------------------------------------------------------- */
/* a case's strings                                                                         */

struct arena {
    char **s;
    int32_t n, cap;
    bool oom;
};

static const char *astr(struct arena *a, const char *fmt, ...) {
    if (a->oom) return NULL;
    if (a->n == a->cap) {
        int32_t cap = a->cap ? 2 * a->cap : 256;
        char **ns = realloc(a->s, sizeof *ns * (size_t) cap);
        if (!ns) {
            a->oom = true;
            return NULL;
        }
        a->s = ns;
        a->cap = cap;
    }
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (!(a->s[a->n] = strdup(buf))) {
        a->oom = true;
        return NULL;
    }
    return a->s[a->n++];
}

static void arena_free(struct arena *a) {
    eval_free_strings(a->s, a->n);
    memset(a, 0, sizeof *a);
}

/* A key or value of the kind, not in used[0..n_used) (drawn again until it is not). */
static void draw(struct eval_rng *r, const struct eval_corpus *c, enum kind k, char *buf, size_t n, char (*used)[40],
                 int32_t n_used) {
    for (;;) {
        if (k == K_NUMBERS) {
            snprintf(buf, n, "%u", 1000000u + eval_rng_below(r, 9000000u));
        } else if (k == K_UUIDS) { /* version-4 layout */
            static const char HEX[] = "0123456789abcdef";
            char u[37];
            for (int i = 0; i < 36; i++) u[i] = HEX[eval_rng_below(r, 16)];
            u[8] = u[13] = u[18] = u[23] = '-';
            u[14] = '4';
            u[19] = HEX[8 + eval_rng_below(r, 4)];
            u[36] = '\0';
            snprintf(buf, n, "%s", u);
        } else {
            const char *a = c->words[eval_rng_below(r, (uint32_t) c->n_words)];
            const char *b = c->words[eval_rng_below(r, (uint32_t) c->n_words)];
            snprintf(buf, n, "%.18s-%.18s", a, b);
        }
        bool dup = false;
        for (int32_t i = 0; i < n_used && !dup; i++) dup = !strcmp(used[i], buf);
        if (!dup) return;
    }
}

/* Insert stmts[0..n) (pieces of their own) at seeded uniform positions among the filler, in their
** order (vt's chains stay in order; needles are shuffled before). */
static int insert_ordered(struct eval_rng *r, struct eval_pieces *ps, const struct eval_piece *stmts, int32_t n) {
    int32_t *at = malloc(sizeof *at * (size_t) (n ? n : 1));
    if (!at) return -1;
    const int32_t n0 = ps->n;
    for (int32_t i = 0; i < n; i++) at[i] = (int32_t) eval_rng_below(r, (uint32_t) n0 + 1);
    for (int32_t i = 1; i < n; i++) /* sort the positions, keep the statements' order */
        for (int32_t j = i; j > 0 && at[j - 1] > at[j]; j--) {
            int32_t t = at[j];
            at[j] = at[j - 1];
            at[j - 1] = t;
        }
    for (int32_t i = n - 1; i >= 0; i--) {
        if (eval_pieces_push(ps, (struct eval_piece){ 0 })) {
            free(at);
            return -1;
        }
        memmove(&ps->v[at[i] + 1], &ps->v[at[i]], sizeof *ps->v * (size_t) (ps->n - 1 - at[i]));
        ps->v[at[i]] = stmts[i];
        ps->tok += stmts[i].tok;
    }
    free(at);
    return 0;
}

static int32_t count(kvt_engine *eng, const char *s) { return s ? eval_count_tokens(eng, s) : -1; }

/* Percent of the pieces' tokens before the first piece stating fact f. */
static int32_t depth_of(const struct eval_pieces *ps, int32_t f) {
    int64_t cum = 0;
    for (int32_t i = 0; i < ps->n; i++) {
        if (ps->v[i].fact == f) return ps->tok > 0 ? (int32_t) (100 * cum / ps->tok) : 0;
        cum += ps->v[i].tok;
    }
    return -1;
}

static void set_answer(struct eval_fact *f, const char *prefix, const char *sep) {
    snprintf(f->prefix, sizeof f->prefix, "%s", prefix);
    size_t len = (size_t) snprintf(f->answer, sizeof f->answer, "%s", prefix);
    for (int32_t i = 0; i < f->n_refs && len < sizeof f->answer; i++)
        len += (size_t) snprintf(f->answer + len, sizeof f->answer - len, "%s%s", i ? sep : " ", f->refs[i]);
    if (len < sizeof f->answer) snprintf(f->answer + len, sizeof f->answer - len, ".");
    memcpy(f->number, f->refs[0], sizeof f->number); /* same size; refs[0] is terminated */
}

/* ---------------------------------------------------------------------------------------- */
/* one attempt at a case: the content for `target` tokens of filler                          */

struct built {
    struct eval_pieces ps;
    struct arena ar;
    char intro[320]; /* RULER's task preamble */
};

static int build_niah(kvt_engine *eng, struct eval_corpus *c, const struct spec *sp, const struct eval_opts *o, int32_t index,
                      int32_t n_groups, int32_t target, int32_t body, struct built *b, struct eval_case *k) {
    struct eval_rng r;
    eval_rng_init(&r, (uint64_t) o->seed, eval_ruler_tasks[o->ruler].name, index);
    const char *vn = sp->val == K_UUIDS ? "uuids" : "numbers";
    snprintf(b->intro, sizeof b->intro,
             "Some special magic %s are hidden within the following text. Make sure to memorize it. I will quiz you about "
             "the %s afterwards.",
             vn, vn);
    /* keys and values: group g holds keys [g*n_k, (g+1)*n_k), the first n_q of them queried */
    const int32_t n_keys = n_groups * sp->n_k, n_needles = n_keys * sp->n_v;
    /* every key and value drawn: the case's, and for HAY_NEEDLE two per distractor needle (each
    ** at least 8 tokens: "One of the special magic numbers for" alone is more) */
    const int32_t cap_used = n_keys + n_needles + (sp->hay == HAY_NEEDLE ? 2 * (target / 8 + 1) : 0) + 2;
    char(*used)[40] = calloc((size_t) cap_used, sizeof *used);
    struct eval_piece *st = calloc((size_t) n_needles, sizeof *st);
    if (!used || !st) {
        free(used);
        free(st);
        return -1;
    }
    int32_t n_used = 0;
    for (int32_t i = 0; i < n_keys; i++, n_used++) draw(&r, c, sp->key, used[n_used], sizeof used[0], used, n_used);
    for (int32_t i = 0; i < n_needles; i++, n_used++) draw(&r, c, sp->val, used[n_used], sizeof used[0], used, n_used);
    /* needle i: key i / n_v, value n_keys + i */
    for (int32_t i = 0; i < n_needles; i++) {
        const int32_t key = i / sp->n_v, g = key / sp->n_k, in_group = key % sp->n_k;
        const char *t = astr(&b->ar, "One of the special magic %s for %s is: %s.", vn, used[key], used[n_keys + i]);
        st[i] = (struct eval_piece){ t, t ? (int32_t) strlen(t) : 0, count(eng, t), in_group < sp->n_q ? g : -1 };
        if (!t || st[i].tok < 0) goto fail;
    }
    for (int32_t i = n_needles - 1; i > 0; i--) { /* needles in a seeded order */
        int32_t j = (int32_t) eval_rng_below(&r, (uint32_t) i + 1);
        struct eval_piece t = st[i];
        st[i] = st[j];
        st[j] = t;
    }
    int32_t stmt_tok = 0;
    for (int32_t i = 0; i < n_needles; i++) stmt_tok += st[i].tok;
    struct eval_rng hr;
    eval_rng_init(&hr, (uint64_t) o->seed, "ruler-haystack", index);
    const int32_t fill = target - stmt_tok;
    if (sp->hay == HAY_ESSAY) {
        if (eval_take_text(eng, c, &hr, false, fill, body, &b->ps, k->essays, sizeof k->essays)) goto fail;
    } else if (sp->hay == HAY_NOISE) {
        const int32_t t = count(eng, NOISE);
        if (t <= 0) goto fail;
        while (b->ps.tok < fill)
            if (eval_pieces_push(&b->ps, (struct eval_piece){ NOISE, (int32_t) strlen(NOISE), t, -1 })) goto fail;
        snprintf(k->essays, sizeof k->essays, "(noise)");
    } else { /* HAY_NEEDLE: needles with other keys */
        snprintf(k->essays, sizeof k->essays, "(needles)");
        while (b->ps.tok < fill) {
            if (n_used + 2 > cap_used) break; /* unreachable: needles are longer than 8 tokens */
            draw(&hr, c, sp->key, used[n_used], sizeof used[0], used, n_used);
            n_used++;
            draw(&hr, c, sp->val, used[n_used], sizeof used[0], used, n_used);
            n_used++;
            const char *t = astr(&b->ar, "One of the special magic %s for %s is: %s.", vn, used[n_used - 2], used[n_used - 1]);
            int32_t tok = count(eng, t);
            if (!t || tok < 0 || eval_pieces_push(&b->ps, (struct eval_piece){ t, (int32_t) strlen(t), tok, -1 })) goto fail;
        }
    }
    if (insert_ordered(&hr, &b->ps, st, n_needles)) goto fail;
    /* the queries: group g's first n_q keys; references their values in needle order */
    k->n_facts = n_groups;
    for (int32_t g = 0; g < n_groups; g++) {
        struct eval_fact *f = &k->facts[g];
        char query[256];
        size_t ql = 0;
        f->n_refs = 0;
        for (int32_t q = 0; q < sp->n_q; q++) {
            const int32_t key = g * sp->n_k + q;
            ql += (size_t) snprintf(query + ql, sizeof query - ql, "%s%s%s",
                                    q == 0            ? ""
                                    : q + 1 < sp->n_q ? ", "
                                                      : ", and ",
                                    used[key], "");
            if (ql >= sizeof query) goto fail;
            for (int32_t v = 0; v < sp->n_v && f->n_refs < EVAL_MAX_REFS; v++)
                snprintf(f->refs[f->n_refs++], sizeof f->refs[0], "%s", used[n_keys + key * sp->n_v + v]);
        }
        snprintf(f->name, sizeof f->name, "%.47s", used[g * sp->n_k]);
        snprintf(f->attr, sizeof f->attr, "special magic %s", sp->val == K_UUIDS ? "uuid" : "number");
        snprintf(f->statement, sizeof f->statement, "One of the special magic %s for %.40s is: %.39s.", vn, used[g * sp->n_k],
                 used[n_keys + g * sp->n_k * sp->n_v]);
        snprintf(f->question, sizeof f->question, "What are all the special magic %s for %s mentioned in the provided text?", vn,
                 query);
        char prefix[400];
        snprintf(prefix, sizeof prefix, "The special magic %s for %s mentioned in the provided text are", vn, query);
        set_answer(f, prefix, ", ");
        f->depth = depth_of(&b->ps, g);
        k->probe_order[g] = g;
    }
    free(used);
    free(st);
    return b->ar.oom ? -1 : 0;
fail:
    free(used);
    free(st);
    return -1;
}

static void var_name(struct eval_rng *r, char *buf) {
    for (int i = 0; i < 5; i++) buf[i] = (char) ('A' + eval_rng_below(r, 26));
    buf[5] = '\0';
}

static int build_vt(kvt_engine *eng, const struct eval_opts *o, int32_t index, int32_t n_chains, int32_t target, struct built *b,
                    struct eval_case *k) {
    struct eval_rng r;
    eval_rng_init(&r, (uint64_t) o->seed, "vt", index);
    snprintf(b->intro, sizeof b->intro, "Memorize and track the chain(s) of variable assignment hidden in the following text.");
    snprintf(k->essays, sizeof k->essays, "(noise)");
    const int32_t n_vars = n_chains * (VT_HOPS + 1);
    char(*vars)[40] = calloc((size_t) n_vars + (size_t) n_chains, sizeof *vars);
    struct eval_piece *st = calloc((size_t) n_vars, sizeof *st);
    if (!vars || !st) goto fail;
    for (int32_t i = 0; i < n_vars; i++) {
        bool dup;
        do {
            var_name(&r, vars[i]);
            dup = false;
            for (int32_t j = 0; j < i; j++) dup |= !strcmp(vars[i], vars[j]);
        } while (dup);
    }
    char(*val)[40] = vars + n_vars;
    for (int32_t ch = 0; ch < n_chains; ch++) {
        bool dup;
        do {
            snprintf(val[ch], sizeof val[0], "%u", 10000u + eval_rng_below(&r, 90000u));
            dup = false;
            for (int32_t j = 0; j < ch; j++) dup |= !strcmp(val[ch], val[j]);
        } while (dup);
    }
    /* statements: chain by chain, hop by hop; chains interleave by a seeded merge that keeps each
    ** chain's order */
    int32_t *next = calloc((size_t) n_chains, sizeof *next), n_st = 0;
    if (!next) goto fail;
    while (n_st < n_vars) {
        int32_t ch = (int32_t) eval_rng_below(&r, (uint32_t) n_chains);
        while (next[ch] > VT_HOPS) ch = (ch + 1) % n_chains;
        const int32_t h = next[ch]++;
        const char *t = h == 0 ? astr(&b->ar, "VAR %s = %s.", vars[ch * (VT_HOPS + 1)], val[ch])
                               : astr(&b->ar, "VAR %s = %s.", vars[ch * (VT_HOPS + 1) + h], vars[ch * (VT_HOPS + 1) + h - 1]);
        st[n_st] = (struct eval_piece){ t, t ? (int32_t) strlen(t) : 0, count(eng, t), ch };
        if (!t || st[n_st].tok < 0) {
            free(next);
            goto fail;
        }
        n_st++;
    }
    free(next);
    int32_t stmt_tok = 0;
    for (int32_t i = 0; i < n_st; i++) stmt_tok += st[i].tok;
    const int32_t t = count(eng, NOISE);
    if (t <= 0) goto fail;
    while (b->ps.tok < target - stmt_tok)
        if (eval_pieces_push(&b->ps, (struct eval_piece){ NOISE, (int32_t) strlen(NOISE), t, -1 })) goto fail;
    struct eval_rng hr;
    eval_rng_init(&hr, (uint64_t) o->seed, "ruler-haystack", index);
    if (insert_ordered(&hr, &b->ps, st, n_st)) goto fail;
    k->n_facts = n_chains;
    for (int32_t ch = 0; ch < n_chains; ch++) {
        struct eval_fact *f = &k->facts[ch];
        f->n_refs = VT_HOPS + 1;
        for (int32_t h = 0; h <= VT_HOPS; h++) snprintf(f->refs[h], sizeof f->refs[0], "%s", vars[ch * (VT_HOPS + 1) + h]);
        snprintf(f->name, sizeof f->name, "%s", vars[ch * (VT_HOPS + 1)]);
        snprintf(f->attr, sizeof f->attr, "variable");
        snprintf(f->statement, sizeof f->statement, "VAR %s = %s.", vars[ch * (VT_HOPS + 1)], val[ch]);
        snprintf(f->question, sizeof f->question, "Question: Find all variables that are assigned the value %s in the text above.",
                 val[ch]);
        char prefix[320];
        snprintf(prefix, sizeof prefix,
                 "Answer: According to the chain(s) of variable assignment in the text above, %d variables are assigned the "
                 "value %s, they are:",
                 VT_HOPS + 1, val[ch]);
        set_answer(f, prefix, ", ");
        f->depth = depth_of(&b->ps, ch);
        k->probe_order[ch] = ch;
    }
    free(vars);
    free(st);
    return b->ar.oom ? -1 : 0;
fail:
    free(vars);
    free(st);
    return -1;
}

/* cwe: "1. word" items; fwe: coded words.  Both are all content: the target sizes the list. */
static int build_words(kvt_engine *eng, struct eval_corpus *c, bool fwe, const struct eval_opts *o, int32_t index, int32_t target,
                       struct built *b, struct eval_case *k) {
    struct eval_rng r;
    eval_rng_init(&r, (uint64_t) o->seed, fwe ? "fwe" : "cwe", index);
    struct eval_fact *f = &k->facts[0];
    k->n_facts = 1;
    k->probe_order[0] = 0;
    f->depth = -1;
    snprintf(k->essays, sizeof k->essays, "(words)");
    int32_t *seq = NULL, n_seq = 0, rc = -1;
    if (!fwe) {
        snprintf(b->intro, sizeof b->intro,
                 "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
                 "appear most often.");
        b->ps.sep = '\n';
        /* tokens of one item, from a sample of 32 */
        int32_t sample = 0;
        for (int i = 0; i < 32; i++) {
            char item[64];
            snprintf(item, sizeof item, "%d. %s", 100 + i * 37, c->words[eval_rng_below(&r, (uint32_t) c->n_words)]);
            int32_t t = count(eng, item);
            if (t < 0) return -1;
            sample += t + 1; /* and its newline */
        }
        const int32_t n_items = target * 32 / (sample > 0 ? sample : 1);
        int32_t freq = 30;
        if (CWE_N * freq > n_items / 2) freq = n_items / 2 / CWE_N;
        if (freq < CWE_UCW + 1) freq = CWE_UCW + 1;
        int32_t n_ucw = (n_items - CWE_N * freq) / CWE_UCW;
        if (n_ucw < 1) n_ucw = 1;
        const int32_t n_w = CWE_N + n_ucw;
        int32_t *w = malloc(sizeof *w * (size_t) n_w); /* word indices, the first CWE_N common */
        n_seq = CWE_N * freq + n_ucw * CWE_UCW;
        seq = malloc(sizeof *seq * (size_t) n_seq);
        if (!w || !seq) {
            free(w);
            goto out;
        }
        if (n_w > c->n_words / 2) { /* the vocabulary cannot supply that many distinct words */
            free(w);
            goto out;
        }
        for (int32_t i = 0; i < n_w; i++) {
            bool dup;
            do {
                w[i] = (int32_t) eval_rng_below(&r, (uint32_t) c->n_words);
                dup = false;
                for (int32_t j = 0; j < i && !dup; j++) dup = w[j] == w[i];
            } while (dup);
        }
        int32_t m = 0;
        for (int32_t i = 0; i < n_w; i++)
            for (int32_t j = 0; j < (i < CWE_N ? freq : CWE_UCW); j++) seq[m++] = w[i];
        for (int32_t i = n_seq - 1; i > 0; i--) {
            int32_t j = (int32_t) eval_rng_below(&r, (uint32_t) i + 1), t = seq[i];
            seq[i] = seq[j];
            seq[j] = t;
        }
        for (int32_t i = 0; i < n_seq; i++) {
            const char *t = astr(&b->ar, "%d. %s", i + 1, c->words[seq[i]]);
            int32_t tok = count(eng, t);
            if (!t || tok < 0 || eval_pieces_push(&b->ps, (struct eval_piece){ t, (int32_t) strlen(t), tok, -1 })) {
                free(w);
                goto out;
            }
        }
        f->n_refs = CWE_N;
        for (int32_t i = 0; i < CWE_N; i++) snprintf(f->refs[i], sizeof f->refs[0], "%s", c->words[w[i]]);
        free(w);
        snprintf(f->question, sizeof f->question, "Question: What are the %d most common words in the above list?", CWE_N);
        char prefix[160];
        snprintf(prefix, sizeof prefix, "Answer: The top %d words that appear most often in the list are:", CWE_N);
        set_answer(f, prefix, ", ");
        snprintf(f->attr, sizeof f->attr, "common words");
    } else {
        snprintf(b->intro, sizeof b->intro,
                 "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
                 "appeared coded words.");
        /* a vocabulary of pseudo-words; ranks drawn from Zipf(2) truncated to it */
        const int32_t V = 400;
        char(*voc)[8] = calloc((size_t) V, sizeof *voc);
        double *cdf = malloc(sizeof *cdf * (size_t) V);
        int32_t *cnt = calloc((size_t) V, sizeof *cnt);
        if (!voc || !cdf || !cnt) {
            free(voc);
            free(cdf);
            free(cnt);
            goto out;
        }
        for (int32_t i = 0; i < V; i++) {
            bool dup;
            do {
                for (int j = 0; j < 5; j++) voc[i][j] = (char) ('a' + eval_rng_below(&r, 26));
                voc[i][5] = '\0';
                dup = false;
                for (int32_t j = 0; j < i && !dup; j++) dup = !strcmp(voc[i], voc[j]);
            } while (dup);
        }
        double z = 0;
        for (int32_t i = 0; i < V; i++) cdf[i] = (z += 1.0 / ((double) (i + 1) * (i + 1)));
        int32_t sample = 0;
        for (int i = 0; i < 16; i++) sample += count(eng, voc[i * 7]) + 1;
        const int32_t n_words = target * 16 / (sample > 0 ? sample : 1);
        for (int32_t i = 0; i < n_words; i++) {
            double u = (double) (eval_rng_next(&r) >> 11) / 9007199254740992.0 * z;
            int32_t lo = 0;
            while (lo < V - 1 && cdf[lo] < u) lo++;
            cnt[lo]++;
            const char *t = astr(&b->ar, "%s", voc[lo]);
            int32_t tok = count(eng, t);
            if (!t || tok < 0 || eval_pieces_push(&b->ps, (struct eval_piece){ t, (int32_t) strlen(t), tok, -1 })) {
                free(voc);
                free(cdf);
                free(cnt);
                goto out;
            }
        }
        /* the references: the FWE_TOP most frequent, most frequent first (ties by rank) */
        f->n_refs = 0;
        for (int32_t t = 0; t < FWE_TOP; t++) {
            int32_t best = -1;
            for (int32_t i = 0; i < V; i++) {
                bool taken = false;
                for (int32_t j = 0; j < f->n_refs; j++) taken |= !strcmp(f->refs[j], voc[i]);
                if (!taken && (best < 0 || cnt[i] > cnt[best])) best = i;
            }
            snprintf(f->refs[f->n_refs++], sizeof f->refs[0], "%s", voc[best]);
        }
        free(voc);
        free(cdf);
        free(cnt);
        snprintf(f->question, sizeof f->question,
                 "Question: Do not provide any explanation. What are the three most frequently appeared words in the above coded "
                 "text?");
        set_answer(f, "Answer: According to the coded text above, the three most frequently appeared words are:", ", ");
        snprintf(f->attr, sizeof f->attr, "frequent words");
    }
    char r0[sizeof f->refs[0]];
    memcpy(r0, f->refs[0], sizeof r0);
    snprintf(f->name, sizeof f->name, "%s", r0);
    snprintf(f->statement, sizeof f->statement, "%s", r0);
    rc = b->ar.oom ? -1 : 0;
out:
    free(seq);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* the case                                                                                 */

int eval_ruler_case_build(kvt_engine *eng, struct eval_corpus *c, const struct eval_opts *o, int32_t index, struct eval_case *k) {
    const struct spec *sp = &SPECS[o->ruler];
    if (eval_corpus_words(c)) return -1;
    const int32_t n_groups = o->shape == EVAL_SHAPE_FOLLOWUP ? EVAL_FOLLOWUPS : 1;
    const bool turns = o->shape == EVAL_SHAPE_TURNS;
    const int32_t framing_first = eval_framing_tokens(eng, true), framing = eval_framing_tokens(eng, false);
    if (framing_first < 0 || framing < 0) return -1;
    /* the input's length: --context, or less where the model's trained context must also hold the
    ** queries and replies (eval_opts.fill) */
    const int32_t fill = o->fill > 0 ? o->fill : o->context;
    const int32_t body = turns ? o->chunk - framing_first - 96 : fill; /* 96: room for the task preamble */
    if (body < 16) return -1;
    k->depth = -1;
    int32_t n_est = turns ? fill / (body + framing) + 1 : 0;
    int32_t target = fill - n_est * framing - 160;
    for (int iter = 0; iter < 12; iter++) {
        struct built b;
        memset(&b, 0, sizeof b);
        for (int32_t i = 0; i < k->n_facts; i++) memset(&k->facts[i], 0, sizeof k->facts[i]);
        int rc;
        if (sp->hay == HAY_VT) rc = build_vt(eng, o, index, n_groups, target, &b, k);
        else if (sp->hay == HAY_CWE || sp->hay == HAY_FWE) rc = build_words(eng, c, sp->hay == HAY_FWE, o, index, target, &b, k);
        else rc = build_niah(eng, c, sp, o, index, n_groups, target, body, &b, k);
        eval_free_strings(k->turns, k->n_turns);
        k->turns = NULL;
        k->n_turns = 0;
        free(k->single);
        k->single = NULL;
        char question[sizeof k->facts[0].question];
        if (rc == 0) {
            /* turns: the convention's signal that the document ended, as the niah task has it */
            snprintf(question, sizeof question, "%s%.470s", turns ? "The document is complete. " : "", k->facts[0].question);
            if (turns) {
                rc = eval_make_turns(&b.ps, body, b.intro, k);
                snprintf(k->facts[0].question, sizeof k->facts[0].question, "%s", question);
            } else {
                char intro[340];
                snprintf(intro, sizeof intro, "%s\n\n", b.intro);
                if (!(k->single = eval_single_message(&b.ps, intro, question))) rc = -1;
            }
        }
        free(b.ps.v);
        arena_free(&b.ar);
        if (rc) return -1;
        k->n_tokens = turns ? eval_conversation_tokens(eng, k->turns, k->n_turns, question)
                            : eval_conversation_tokens(eng, NULL, 0, k->single);
        if (k->n_tokens < 0) return -1;
        bool fits = k->n_tokens <= fill;
        if (fits && (fill - k->n_tokens <= 64 || iter >= 6)) return 0;
        target += (int32_t) ((double) (fill - k->n_tokens - 16) * (turns ? (double) body / (body + framing) : 1.0));
    }
    return -1;
}
