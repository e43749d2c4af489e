/* eval_data.c — what `kvtier eval` feeds the policies: the essay corpus as sentences, seeded
** names and numbers, and the cases (a haystack with a needle or five facts, or a held-out text
** in segments), sized in tokens of the model under test.
**
** Everything random comes from the seed through splitmix64 streams keyed by (seed, purpose,
** case), so a case is the same whichever policies or tasks run with it, and nothing is drawn
** from a fixed list a policy could special-case: names are built from syllables, numbers are
** drawn uniformly. */
#include "eval.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------- */
/* randomness                                                                               */

uint64_t eval_rng_next(struct eval_rng *r) { /* splitmix64 (Steele, Lea, Flood 2014) */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void eval_rng_init(struct eval_rng *r, uint64_t seed, const char *stream, int64_t index) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a of the stream name */
    for (const char *p = stream; *p; p++) h = (h ^ (unsigned char) *p) * 1099511628211ull;
    r->s = seed * 0x9E3779B97F4A7C15ull ^ h ^ ((uint64_t) index << 32 | (uint64_t) index);
    eval_rng_next(r);
}

uint32_t eval_rng_below(struct eval_rng *r, uint32_t n) { return (uint32_t) (eval_rng_next(r) % n); }

/* ---------------------------------------------------------------------------------------- */
/* corpus                                                                                   */

static bool is_upper(char c) { return c >= 'A' && c <= 'Z'; }
static bool is_lower(char c) { return c >= 'a' && c <= 'z'; }

/* In place: control characters and runs of white space become one space, and a sentence glued
** to the next one by the scrape ("interface.A lot of") gets its space back. */
static void normalise(char *t) {
    char *w = t;
    for (const char *p = t; *p; p++) {
        char c = *p;
        if (c == '\n' || c == '\r' || c == '\t' || c == '\f' || c == '\v') c = ' ';
        if (c == ' ' && (w == t || w[-1] == ' ')) continue;
        *w++ = c;
        if ((c == '.' || c == '?' || c == '!') && w - t >= 2 && is_lower(w[-2]) && is_upper(p[1])) *w++ = ' ';
    }
    while (w > t && w[-1] == ' ') w--;
    *w = '\0';
}

/* Sentences end at . ? ! (and any closing quotes or brackets) followed by a space. */
static int split_sentences(struct eval_essay *e) {
    const char *t = e->text;
    size_t len = strlen(t);
    int32_t cap = 64, n = 0;
    e->s_off = malloc(sizeof(int32_t) * (size_t) cap);
    e->s_len = malloc(sizeof(int32_t) * (size_t) cap);
    if (!e->s_off || !e->s_len) return -1;
    size_t a = 0;
    for (size_t i = 0; i <= len; i++) {
        bool end = i == len;
        if (!end && (t[i] == '.' || t[i] == '?' || t[i] == '!')) {
            size_t j = i + 1;
            while (j < len && (t[j] == '"' || t[j] == '\'' || t[j] == ')' || t[j] == ']')) j++;
            if (j < len && t[j] == ' ') {
                i = j - 1;
                end = true;
            }
        }
        if (!end) continue;
        size_t z = i == len ? len : i + 1;
        while (a < z && t[a] == ' ') a++;
        if (z - a >= 2) {
            if (n == cap) {
                cap *= 2;
                int32_t *no = realloc(e->s_off, sizeof(int32_t) * (size_t) cap);
                if (!no) return -1;
                e->s_off = no;
                int32_t *nl = realloc(e->s_len, sizeof(int32_t) * (size_t) cap);
                if (!nl) return -1;
                e->s_len = nl;
            }
            e->s_off[n] = (int32_t) a;
            e->s_len[n] = (int32_t) (z - a);
            n++;
        }
        a = z;
    }
    e->n_sent = n;
    if (!(e->s_tok = malloc(sizeof(int32_t) * (size_t) (n ? n : 1)))) return -1;
    for (int32_t i = 0; i < n; i++) e->s_tok[i] = -1;
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *) a, *(char *const *) b); }

static bool is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* The checkout the executable was built in: <repo>/build/kvtier -> <repo>. */
static bool exe_repo(char *buf, size_t n) {
    char exe[1024];
    ssize_t r = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (r <= 0) return false;
    exe[r] = '\0';
    for (int up = 0; up < 2; up++) {
        char *sl = strrchr(exe, '/');
        if (!sl) return false;
        *sl = '\0';
    }
    return snprintf(buf, n, "%s", exe) < (int) n;
}

static int find_dir(const char *cmd, const char *opt, char *out, size_t n) {
    if (opt) {
        if (!is_dir(opt)) {
            fprintf(stderr, "%s: --texts '%s' is not a directory\n", cmd, opt);
            return APP_USAGE;
        }
        snprintf(out, n, "%s", opt);
        return APP_OK;
    }
    char cand[3][1200], repo[1024];
    int nc = 0;
    const char *src = getenv("KVT_SOURCE_DIR");
    if (src && *src) snprintf(cand[nc++], sizeof cand[0], "%s/../shared/data/pg_essays", src);
    if (exe_repo(repo, sizeof repo)) snprintf(cand[nc++], sizeof cand[0], "%s/../shared/data/pg_essays", repo);
    snprintf(cand[nc++], sizeof cand[0], "../shared/data/pg_essays");
    for (int i = 0; i < nc; i++)
        if (is_dir(cand[i]) && snprintf(out, n, "%s", cand[i]) < (int) n) return APP_OK;
    fprintf(stderr, "%s: no essay directory found (tried", cmd);
    for (int i = 0; i < nc; i++) fprintf(stderr, "%s '%s'", i ? "," : "", cand[i]);
    fprintf(stderr, "); give one with --texts DIR\n");
    return APP_USAGE;
}

int eval_corpus_load(const char *cmd, const char *texts_opt, struct eval_corpus *c) {
    memset(c, 0, sizeof *c);
    int rc = find_dir(cmd, texts_opt, c->dir, sizeof c->dir);
    if (rc) return rc;
    DIR *d = opendir(c->dir);
    if (!d) {
        fprintf(stderr, "%s: cannot read the essay directory '%s': %s\n", cmd, c->dir, strerror(errno));
        return APP_ERR;
    }
    char **names = NULL;
    int n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        if (l < 5 || strcmp(de->d_name + l - 4, ".txt") || !strncmp(de->d_name, "LICENSE", 7)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            char **nn = realloc(names, sizeof *nn * (size_t) cap);
            if (!nn) break;
            names = nn;
        }
        if (!(names[n] = strdup(de->d_name))) break;
        n++;
    }
    closedir(d);
    if (n < 2) {
        fprintf(stderr, "%s: the essay directory '%s' has %d .txt files; at least 2 are needed\n", cmd, c->dir, n);
        for (int i = 0; i < n; i++) free(names[i]);
        free(names);
        return APP_USAGE;
    }
    qsort(names, (size_t) n, sizeof *names, cmp_str);
    if (!(c->e = calloc((size_t) n, sizeof *c->e))) {
        for (int i = 0; i < n; i++) free(names[i]);
        free(names);
        fprintf(stderr, "%s: out of memory\n", cmd);
        return APP_ERR;
    }
    for (int i = 0; i < n; i++) {
        struct eval_essay *e = &c->e[c->n];
        char path[2400];
        size_t len = 0;
        e->name = names[i];
        snprintf(path, sizeof path, "%s/%s", c->dir, names[i]);
        if (!(e->text = app_read_file(path, &len))) {
            fprintf(stderr, "%s: cannot read '%s': %s\n", cmd, path, strerror(errno));
            c->n++;
            rc = APP_ERR;
            break;
        }
        normalise(e->text);
        c->n++;
        if (split_sentences(e)) {
            fprintf(stderr, "%s: out of memory splitting '%s'\n", cmd, path);
            rc = APP_ERR;
            break;
        }
        e->held_out = i % 5 == 4; /* every fifth essay (by name) is ppl's held-out text */
        c->n_held_out += e->held_out;
    }
    for (int i = c->n; i < n; i++) free(names[i]);
    free(names);
    if (rc) eval_corpus_free(c);
    return rc;
}

char *eval_corpus_join(const struct eval_corpus *c, size_t min_bytes) {
    size_t cap = 1, len = 0;
    char *all = malloc(cap);
    if (!all) return NULL;
    all[0] = '\0';
    for (int i = 0; i < c->n && len < min_bytes; i++) {
        size_t l = strlen(c->e[i].text);
        if (len + l + 2 > cap) {
            cap = (len + l + 2) * 2;
            char *na = realloc(all, cap);
            if (!na) {
                free(all);
                return NULL;
            }
            all = na;
        }
        memcpy(all + len, c->e[i].text, l);
        len += l;
        all[len++] = ' ';
        all[len] = '\0';
    }
    return all;
}

void eval_corpus_free(struct eval_corpus *c) {
    for (int i = 0; i < c->n; i++) {
        free(c->e[i].name);
        free(c->e[i].text);
        free(c->e[i].s_off);
        free(c->e[i].s_len);
        free(c->e[i].s_tok);
    }
    free(c->e);
    eval_free_strings(c->words, c->n_words);
    memset(c, 0, sizeof *c);
}

int32_t eval_count_tokens(kvt_engine *eng, const char *text) {
    kvt_token *t = NULL;
    int32_t n = 0;
    if (kvt_tokenize(eng, text, false, false, &t, &n)) return -1;
    free(t);
    return n;
}

static int32_t sent_tokens(kvt_engine *eng, struct eval_essay *e, int32_t i) {
    if (e->s_tok[i] < 0) {
        char *s = strndup(e->text + e->s_off[i], (size_t) e->s_len[i]);
        if (!s) return -1;
        e->s_tok[i] = eval_count_tokens(eng, s);
        free(s);
    }
    return e->s_tok[i];
}

/* ---------------------------------------------------------------------------------------- */
/* names, numbers, facts                                                                    */

/* A capitalised name of 2-3 consonant-vowel syllables (optionally closed by n/r/l). */
static void make_name(struct eval_rng *r, char *buf, size_t n) {
    static const char C[] = "bdfgklmnprstvz", V[] = "aeiou", E[] = "nrl";
    int syl = 2 + (int) eval_rng_below(r, 2);
    size_t k = 0;
    for (int i = 0; i < syl && k + 3 < n; i++) {
        buf[k++] = C[eval_rng_below(r, sizeof C - 1)];
        buf[k++] = V[eval_rng_below(r, sizeof V - 1)];
        if (i == syl - 1 && eval_rng_below(r, 2)) buf[k++] = E[eval_rng_below(r, sizeof E - 1)];
    }
    buf[k] = '\0';
    buf[0] = (char) (buf[0] - 'a' + 'A');
}

static void make_number(struct eval_rng *r, char *buf, size_t n) { snprintf(buf, n, "%u", 10000u + eval_rng_below(r, 90000u)); }

/* NIAH's needle: "The secret code of <name> is <number>." */
static void make_needle(struct eval_rng *r, struct eval_fact *f) {
    make_name(r, f->name, sizeof f->name);
    make_number(r, f->number, sizeof f->number);
    snprintf(f->attr, sizeof f->attr, "secret code");
    snprintf(f->statement, sizeof f->statement, "The secret code of %.47s is %.15s.", f->name, f->number);
    snprintf(f->question, sizeof f->question, "The document is complete. What is the secret code of %.47s? Answer with the number.",
             f->name);
    snprintf(f->answer, sizeof f->answer, "The secret code of %.47s is %.15s.", f->name, f->number);
    snprintf(f->prefix, sizeof f->prefix, "The secret code of %.47s is", f->name);
}

/* multifact: "<name>'s <attribute> is <number>." with distinct names, attributes and numbers. */
static void make_facts(struct eval_rng *r, struct eval_fact *f, int n) {
    static const char *const ATTR[] = { "locker number",       "room number",    "badge number",      "ticket number",
                                        "parking spot number", "account number", "membership number", "seat number",
                                        "order number",        "desk number" };
    const int n_attr = (int) (sizeof ATTR / sizeof ATTR[0]);
    int perm[sizeof ATTR / sizeof ATTR[0]];
    for (int i = 0; i < n_attr; i++) perm[i] = i;
    for (int i = n_attr - 1; i > 0; i--) {
        int j = (int) eval_rng_below(r, (uint32_t) i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int i = 0; i < n; i++) {
        bool dup;
        do {
            make_name(r, f[i].name, sizeof f[i].name);
            make_number(r, f[i].number, sizeof f[i].number);
            dup = false;
            for (int j = 0; j < i; j++) dup |= !strcmp(f[i].name, f[j].name) || !strcmp(f[i].number, f[j].number);
        } while (dup);
        snprintf(f[i].attr, sizeof f[i].attr, "%s", ATTR[perm[i % n_attr]]);
        snprintf(f[i].statement, sizeof f[i].statement, "%.47s's %.31s is %.15s.", f[i].name, f[i].attr, f[i].number);
        snprintf(f[i].question, sizeof f[i].question, "The document is complete. What is %.47s's %.31s? Answer with the number.",
                 f[i].name, f[i].attr);
        snprintf(f[i].answer, sizeof f[i].answer, "%.47s's %.31s is %.15s.", f[i].name, f[i].attr, f[i].number);
        snprintf(f[i].prefix, sizeof f[i].prefix, "%.47s's %.31s is", f[i].name, f[i].attr);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* haystacks                                                                                */

int eval_pieces_push(struct eval_pieces *ps, struct eval_piece pc) {
    if (ps->n == ps->cap) {
        int32_t cap = ps->cap ? 2 * ps->cap : 256;
        struct eval_piece *nv = realloc(ps->v, sizeof *nv * (size_t) cap);
        if (!nv) return -1;
        ps->v = nv;
        ps->cap = cap;
    }
    ps->v[ps->n++] = pc;
    ps->tok += pc.tok;
    return 0;
}

/* Sentences from the seeded order of essays (held-out ones for ppl, the others for haystacks),
** starting at a seeded sentence of the first one, until `target` tokens.  Sentences longer
** than max_tok (tables, run-ons) are skipped so chunks stay near their size.  The essays used
** are listed in names[]. */
int eval_take_text(kvt_engine *eng, struct eval_corpus *c, struct eval_rng *r, bool held_out, int32_t target, int32_t max_tok,
                   struct eval_pieces *ps, char *names, size_t names_len) {
    int idx[1024], n = 0;
    for (int i = 0; i < c->n && n < 1024; i++)
        if (c->e[i].held_out == held_out && c->e[i].n_sent > 4) idx[n++] = i;
    if (n == 0) return -1;
    for (int i = n - 1; i > 0; i--) {
        int j = (int) eval_rng_below(r, (uint32_t) i + 1), t = idx[i];
        idx[i] = idx[j];
        idx[j] = t;
    }
    names[0] = '\0';
    for (int round = 0; ps->tok < target; round++) {
        if (round >= 8 * n) return -1; /* the corpus is too small for the target */
        struct eval_essay *e = &c->e[idx[round % n]];
        /* the first two sentences are the site's banner; start somewhere in the first half */
        int32_t s0 = round == 0 ? 2 + (int32_t) eval_rng_below(r, (uint32_t) (e->n_sent / 2)) : 2;
        size_t used = strlen(names);
        if (round < n && used + strlen(e->name) + 2 < names_len)
            snprintf(names + used, names_len - used, "%s%s", used ? " " : "", e->name);
        for (int32_t i = s0; i < e->n_sent && ps->tok < target; i++) {
            int32_t t = sent_tokens(eng, e, i);
            if (t < 0) return -1;
            if (t == 0 || t > max_tok) continue;
            if (eval_pieces_push(ps, (struct eval_piece){ e->text + e->s_off[i], e->s_len[i], t, -1 })) return -1;
        }
    }
    return 0;
}

/* Put each fact's statement at its depth (percent of the haystack's tokens), at the sentence
** boundary at or after that point. */
static int insert_facts(kvt_engine *eng, struct eval_pieces *ps, const struct eval_fact *f, int32_t n_facts) {
    int32_t at[EVAL_MAX_FACTS];
    for (int32_t k = 0; k < n_facts; k++) {
        int64_t want = (int64_t) ps->tok * f[k].depth / 100, cum = 0;
        int32_t i = 0;
        while (i < ps->n && cum < want) cum += ps->v[i++].tok;
        at[k] = i;
    }
    /* insert from the back so earlier indices stay valid; equal depths keep fact order */
    for (int32_t k = n_facts - 1; k >= 0; k--) {
        int32_t t = eval_count_tokens(eng, f[k].statement);
        if (t < 0 || eval_pieces_push(ps, (struct eval_piece){ 0 })) return -1;
        memmove(&ps->v[at[k] + 1], &ps->v[at[k]], sizeof *ps->v * (size_t) (ps->n - 1 - at[k]));
        ps->v[at[k]] = (struct eval_piece){ f[k].statement, (int32_t) strlen(f[k].statement), t, k };
    }
    return 0;
}

void eval_free_strings(char **t, int32_t n) {
    if (!t) return;
    for (int32_t i = 0; i < n; i++) free(t[i]);
    free(t);
}

char *eval_join(const char *prefix, const struct eval_pieces *ps, int32_t a, int32_t b) {
    const char sep = ps->sep ? ps->sep : ' ';
    size_t len = strlen(prefix) + 1;
    for (int32_t i = a; i < b; i++) len += (size_t) ps->v[i].len + 1;
    char *s = malloc(len), *w = s;
    if (!s) return NULL;
    w += sprintf(w, "%s", prefix);
    for (int32_t i = a; i < b; i++) {
        if (i > a) *w++ = sep;
        memcpy(w, ps->v[i].p, (size_t) ps->v[i].len);
        w += ps->v[i].len;
    }
    *w = '\0';
    return s;
}

static const char INTRO[] =
    "I am going to give you a long document in several parts. Read it carefully and reply to each part "
    "with \"Noted.\" only. When the document is complete I will ask you questions about it: answer them.\n\n";

/* --single-prompt: the document as one message, the question at its end. */
static const char SINGLE_INTRO[] = "Read the following document. A question about it comes at the end.\n\n";

char *eval_single_message(const struct eval_pieces *ps, const char *intro, const char *question) {
    char *doc = eval_join(intro ? intro : SINGLE_INTRO, ps, 0, ps->n);
    if (!doc) return NULL;
    size_t a = strlen(doc), b = strlen(question);
    char *m = malloc(a + b + 3);
    if (m) {
        memcpy(m, doc, a);
        memcpy(m + a, "\n\n", 2);
        memcpy(m + a + 2, question, b + 1);
    }
    free(doc);
    return m;
}

int eval_make_turns(const struct eval_pieces *ps, int32_t body, const char *task_intro, struct eval_case *k) {
    int32_t n_chunks = 0, cap = 16;
    int32_t *start = malloc(sizeof(int32_t) * (size_t) cap);
    if (!start) return -1;
    for (int32_t i = 0; i < ps->n;) {
        if (n_chunks + 1 >= cap) {
            cap *= 2;
            int32_t *ns = realloc(start, sizeof(int32_t) * (size_t) cap);
            if (!ns) {
                free(start);
                return -1;
            }
            start = ns;
        }
        start[n_chunks++] = i;
        int32_t t = 0;
        while (i < ps->n && (t == 0 || t + ps->v[i].tok <= body)) t += ps->v[i++].tok;
    }
    start[n_chunks] = ps->n;
    k->turns = calloc((size_t) (n_chunks ? n_chunks : 1), sizeof(char *));
    if (!k->turns) {
        free(start);
        return -1;
    }
    k->n_turns = n_chunks;
    for (int32_t c = 0; c < n_chunks; c++) {
        char prefix[sizeof INTRO + 512];
        snprintf(prefix, sizeof prefix, "%s%.400s%sHere is part %d of %d of the document:\n", c == 0 ? INTRO : "",
                 c == 0 && task_intro ? task_intro : "", c == 0 && task_intro ? "\n\n" : "", c + 1, n_chunks);
        if (!(k->turns[c] = eval_join(prefix, ps, start[c], start[c + 1]))) {
            free(start);
            return -1;
        }
    }
    free(start);
    return 0;
}

int32_t eval_conversation_tokens(kvt_engine *eng, char *const *turns, int32_t n_turns, const char *question) {
    int32_t n_msgs = 2 * n_turns + (question ? 1 : 0);
    struct kvt_chat_msg *m = malloc(sizeof *m * (size_t) (n_msgs ? n_msgs : 1));
    if (!m) return -1;
    for (int32_t i = 0; i < n_turns; i++) {
        m[2 * i] = (struct kvt_chat_msg){ "user", turns[i] };
        m[2 * i + 1] = (struct kvt_chat_msg){ "assistant", EVAL_REPLY };
    }
    if (question) m[n_msgs - 1] = (struct kvt_chat_msg){ "user", question };
    kvt_token *t = NULL;
    int32_t n = 0;
    int rc = kvt_chat_tokenize(eng, m, n_msgs, question != NULL, "gemma", &t, &n);
    free(m);
    free(t);
    return rc ? -1 : n;
}

int32_t eval_framing_tokens(kvt_engine *eng, bool intro) {
    char hdr[sizeof INTRO + 64];
    char *t[1] = { hdr };
    snprintf(hdr, sizeof hdr, "%sHere is part 10 of 10 of the document:\n", intro ? INTRO : "");
    return eval_conversation_tokens(eng, t, 1, NULL);
}

void eval_case_free(struct eval_case *k) {
    eval_free_strings(k->turns, k->n_turns);
    eval_free_strings(k->score, k->n_turns);
    free(k->single);
    memset(k, 0, sizeof *k);
}

static int build_haystack_case(kvt_engine *eng, struct eval_corpus *c, const struct eval_opts *o, int32_t index,
                               struct eval_case *k) {
    struct eval_rng r;
    eval_rng_init(&r, (uint64_t) o->seed, o->task == EVAL_NIAH ? "niah-facts" : "multifact-facts", index);
    if (o->task == EVAL_NIAH) {
        k->n_facts = 1;
        make_needle(&r, &k->facts[0]);
        k->depth = k->facts[0].depth = o->depths[index % o->n_depths];
        k->probe_order[0] = 0;
    } else {
        k->n_facts = o->n_depths;
        make_facts(&r, k->facts, k->n_facts);
        k->depth = -1;
        for (int32_t i = 0; i < k->n_facts; i++) {
            k->facts[i].depth = o->depths[i];
            k->probe_order[i] = i;
        }
        for (int32_t i = k->n_facts - 1; i > 0; i--) { /* probe in a seeded order, not by depth */
            int32_t j = (int32_t) eval_rng_below(&r, (uint32_t) i + 1), t = k->probe_order[i];
            k->probe_order[i] = k->probe_order[j];
            k->probe_order[j] = t;
        }
    }
    int32_t framing_first = eval_framing_tokens(eng, true), framing = eval_framing_tokens(eng, false);
    int32_t q_tok = eval_count_tokens(eng, k->facts[k->probe_order[0]].question);
    if (framing_first < 0 || framing < 0 || q_tok < 0) return -1;
    int32_t body = o->chunk - framing_first; /* text tokens per turn: every turn fits o->chunk */
    if (body < 16) return -1;                /* cmd_eval.c checked this with a message */
    const char *question = k->facts[k->probe_order[0]].question;
    /* aim the haystack at the context minus the framing, then correct by the measured length
    ** of the formatted conversation until it fits (and is within 48 tokens of the context) */
    int32_t n_est = o->context / (body + framing) + 1;
    int32_t target = o->context - n_est * framing - (framing_first - framing) - q_tok - 16;
    int32_t fact_tok = 0;
    for (int32_t i = 0; i < k->n_facts; i++) {
        int32_t t = eval_count_tokens(eng, k->facts[i].statement);
        if (t < 0) return -1;
        fact_tok += t;
    }
    for (int iter = 0; iter < 12; iter++) {
        struct eval_pieces ps = { 0 };
        struct eval_rng tr;
        eval_rng_init(&tr, (uint64_t) o->seed, "haystack", index);
        int rc = eval_take_text(eng, c, &tr, false, target - fact_tok, body, &ps, k->essays, sizeof k->essays);
        if (rc == 0) rc = insert_facts(eng, &ps, k->facts, k->n_facts);
        eval_free_strings(k->turns, k->n_turns);
        k->turns = NULL;
        k->n_turns = 0;
        if (rc == 0) rc = eval_make_turns(&ps, body, NULL, k);
        free(k->single);
        k->single = NULL;
        if (rc == 0 && o->single_prompt && !(k->single = eval_single_message(&ps, NULL, question))) rc = -1;
        free(ps.v);
        if (rc) return -1;
        k->n_tokens = o->single_prompt ? eval_conversation_tokens(eng, NULL, 0, k->single)
                                       : eval_conversation_tokens(eng, k->turns, k->n_turns, question);
        if (k->n_tokens < 0) return -1;
        bool fits = k->n_tokens <= o->context;
        if (fits && (o->context - k->n_tokens <= 48 || iter >= 6)) return 0;
        /* each text token also brings its share of the turns' framing (none in one message) */
        target += (int32_t) ((double) (o->context - k->n_tokens - 8) * (o->single_prompt ? 1.0 : (double) body / (body + framing)));
    }
    return -1;
}

/* ppl: held-out text in segments of o->segment tokens; turns[i] is fed, score[i] is the
** segment after it, until the fed turns fill the context. */
static int build_ppl_case(kvt_engine *eng, struct eval_corpus *c, const struct eval_opts *o, int32_t index, struct eval_case *k) {
    struct eval_rng r;
    eval_rng_init(&r, (uint64_t) o->seed, "ppl-text", index);
    k->depth = -1;
    char *t[1] = { "" };
    int32_t framing = eval_conversation_tokens(eng, t, 1, NULL);
    if (framing < 0) return -1;
    int32_t n_seg = o->context / (o->segment + framing) + 2;
    struct eval_pieces ps = { 0 };
    if (eval_take_text(eng, c, &r, true, n_seg * o->segment + o->segment, o->segment, &ps, k->essays, sizeof k->essays)) {
        free(ps.v);
        return -1;
    }
    char **seg = calloc((size_t) n_seg + 1, sizeof(char *));
    int32_t made = 0;
    for (int32_t i = 0; seg && i < ps.n && made < n_seg + 1;) {
        int32_t a = i, tk = 0;
        while (i < ps.n && (tk == 0 || tk + ps.v[i].tok <= o->segment)) tk += ps.v[i++].tok;
        if (!(seg[made++] = eval_join("", &ps, a, i))) break;
    }
    free(ps.v);
    if (!seg || made < 2 || !seg[made - 1]) {
        eval_free_strings(seg, made);
        return -1;
    }
    /* fed turns: as many as fit the context; each needs the next segment to score */
    int32_t n_fed = made - 1;
    while (n_fed > 1 && (k->n_tokens = eval_conversation_tokens(eng, seg, n_fed, NULL)) > o->context) n_fed--;
    if (n_fed == 1) k->n_tokens = eval_conversation_tokens(eng, seg, 1, NULL);
    k->turns = calloc((size_t) n_fed, sizeof(char *));
    k->score = calloc((size_t) n_fed, sizeof(char *));
    if (!k->turns || !k->score) {
        eval_free_strings(seg, made);
        return -1;
    }
    k->n_turns = n_fed;
    for (int32_t i = 0; i < n_fed; i++) {
        k->turns[i] = seg[i];
        k->score[i] = strdup(seg[i + 1]);
        if (!k->score[i]) {
            for (int32_t j = n_fed; j < made; j++) free(seg[j]);
            free(seg);
            return -1;
        }
    }
    for (int32_t j = n_fed; j < made; j++) free(seg[j]);
    free(seg);
    return k->n_tokens < 0 ? -1 : 0;
}

int eval_case_build(const char *cmd, kvt_engine *eng, struct eval_corpus *c, const struct eval_opts *o, int32_t index,
                    struct eval_case *k) {
    memset(k, 0, sizeof *k);
    k->index = index;
    int rc = o->task == EVAL_PPL     ? build_ppl_case(eng, c, o, index, k)
             : o->task == EVAL_RULER ? eval_ruler_case_build(eng, c, o, index, k)
                                     : build_haystack_case(eng, c, o, index, k);
    if (rc) {
        fprintf(stderr,
                "%s: case %d: could not build %d tokens of conversation from the %d essays in '%s' (out of "
                "memory, a tokenizer failure, or too little text)\n",
                cmd, index + 1, o->task == EVAL_RULER && o->fill > 0 ? o->fill : o->context, c->n, c->dir);
        eval_case_free(k);
        return APP_ERR;
    }
    return APP_OK;
}
