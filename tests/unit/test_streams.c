/* test_streams — one KV stream per sequence (kvt_engine_params.kv_unified = false).
**
**   forms:        blocks are stored in one canonical form (one stream record), so a block saved in
**                 either mode and at any n_seq loads in any other with the same next-token logits
**                 (F32, 1e-3) as a block saved where it loads; llama.cpp's own n_stream = N form
**                 loads too.  A control (another block) differs by more than the tolerance.
**   failed loads: a load that llama.cpp rejects half-way (test hook: a corrupted K type in one
**                 cache part), one that does not fit the stream, one without the sliding-window
**                 cells it needs: the target keeps exactly its cells (the bytes of a whole-sequence
**                 save) and the next token's logits (bit-equal); so do seq_cp and seq_shift.
**   independence: a sequence's greedy tokens and logits alone vs with another busy sequence
**                 decoded in between: bit-equal with streams; the unified control shows the
**                 dependence (non-zero differences) that streams remove.  The same for two
**                 sessions (reply text and teacher-forced log-probability).
**   seq_cp:       a partial copy across streams is a copy (never llama.cpp's abort), refuses
**                 positions the target already holds, and matches the unified copy. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */
#include "kv/blob.h"    /* the canonical form and llama.cpp's N-stream form */
#include "test_hooks.h" /* kvt_engine_set_unsafe_corrupt_next_load, kvt_engine_shift_pending */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *path_of(const char *name) {
    static char buf[4][1024];
    static int k;
    char *b = buf[k++ % 4];
    if (!strcmp(name, "gemma3-270m")) {
        const char *m = getenv("KVTIER_MODEL");
        return (m && *m) ? strcpy(b, m) : NULL;
    }
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(b, 1024, "%s/%s.gguf", d ? d : "tests/models", name);
    return b;
}

static kvt_engine *open_eng(const char *name, bool unified, int32_t n_seq, int32_t n_ctx, const char *type, int reanchor) {
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path_of(name);
    if (!p.model_path) return NULL;
    p.kv_unified = unified;
    p.n_seq = n_seq;
    p.n_ctx = n_ctx;
    p.type_k = p.type_v = type;
    p.reanchor = reanchor;
    kvt_engine *e = NULL;
    int rc = kvt_engine_open(&p, &e);
    if (rc) fprintf(stderr, "open %s: %s: %s\n", name, kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, 0);
    return e;
}

static void toks(kvt_token *t, int n, unsigned seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        t[i] = (kvt_token) (3 + (seed >> 8) % 500);
    }
}

static double max_abs_diff(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs((double) a[i] - b[i]));
    return m;
}

static int n_vocab(kvt_engine *e) {
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    return I.n_vocab;
}

/* ---- blob forms ---------------------------------------------------------------------- */

enum { NX = 16, NB = 40, NS = 24, FAR = 500, Q = 60 };

/* Block B (after its context X) decoded far away in sequence s and saved as soon as decoded. */
static kvt_blob *make_block(kvt_engine *e, int32_t s, unsigned seed) {
    kvt_token X[NX], B[NB];
    toks(X, NX, seed);
    toks(B, NB, seed + 1);
    kvt_seq_rm(e, s, -1, -1);
    assert_int_equal(kvt_engine_decode(e, s, X, NX, FAR, false), 0);
    assert_int_equal(kvt_engine_decode(e, s, B, NB, FAR + NX, false), 0);
    kvt_blob *b = NULL;
    assert_int_equal(kvt_block_save(e, s, FAR + NX, FAR + NX + NB, &b), 0);
    kvt_seq_rm(e, s, -1, -1);
    return b;
}

/* S at [0, NS) of sequence 0, the block loaded at Q, one token: its logits. */
static void logits_with(kvt_engine *e, const kvt_blob *b, float *out) {
    kvt_token S[NS], T = 77;
    toks(S, NS, 4242);
    kvt_seq_rm(e, 0, -1, -1);
    assert_int_equal(kvt_engine_decode(e, 0, S, NS, 0, false), 0);
    int rc = kvt_block_load(e, b, 0, Q);
    if (rc) fprintf(stderr, "load: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
    assert_int_equal(kvt_engine_decode(e, 0, &T, 1, Q + NB, true), 0);
    memcpy(out, kvt_engine_logits(e), sizeof(float) * (size_t) n_vocab(e));
    kvt_seq_rm(e, 0, -1, -1);
}

static void check_forms(const char *model) {
    /* three contexts: unified with 2 sequences, streams with 3, streams with 1 */
    kvt_engine *E[3] = { open_eng(model, true, 2, 1024, "f32", KVT_REANCHOR_AUTO),
                         open_eng(model, false, 3, 1536, "f32", KVT_REANCHOR_AUTO),
                         open_eng(model, false, 1, 512, "f32", KVT_REANCHOR_AUTO) };
    const char *name[3] = { "unified/2", "streams/3", "streams/1" };
    const int nv = n_vocab(E[0]);
    kvt_blob *blk[3], *other = make_block(E[0], 1, 999);
    for (int i = 0; i < 3; i++) {
        blk[i] = make_block(E[i], i == 2 ? 0 : 1, 31);
        struct kvt__blob_layout L;
        assert_int_equal(
            kvt__blob_parse(blk[i]->data, blk[i]->size, 2, &L) == 0 || kvt__blob_parse(blk[i]->data, blk[i]->size, 1, &L) == 0, 1);
        for (int p = 0; p < L.n_parts; p++) assert_int_equal(L.part[p].n_stream, 1); /* canonical */
        assert_int_equal(blk[i]->n_tokens, NB);
    }
    float *native = malloc(sizeof(float) * nv), *got = malloc(sizeof(float) * nv);
    for (int d = 0; d < 3; d++) {
        logits_with(E[d], blk[d], native);
        for (int s = 0; s < 3; s++) {
            logits_with(E[d], blk[s], got);
            double diff = max_abs_diff(native, got, nv);
            printf("  %-11s block saved in %-9s loaded in %-9s: max|dlogit| vs its own block %.3g\n", model, name[s], name[d],
                   diff);
            assert_true(diff <= 1e-3);
        }
        logits_with(E[d], other, got);
        double ctl = max_abs_diff(native, got, nv);
        printf("  %-11s another block loaded in %-9s: %.3g (control, must exceed 1e-3)\n", model, name[d], ctl);
        assert_true(ctl > 1e-3);
    }
    /* llama.cpp's own form of a per-sequence state: n_stream = 4, the cells in slot 2 */
    {
        struct kvt__blob_layout L;
        int n_parts = kvt__blob_parse(blk[0]->data, blk[0]->size, 2, &L) == 0 ? 2 : 1;
        assert_int_equal(kvt__blob_parse(blk[0]->data, blk[0]->size, n_parts, &L), 0);
        struct kvt__blob_src src = { blk[0]->data, &L, { INT32_MIN, INT32_MIN }, { INT32_MAX, INT32_MAX }, 0 };
        kvt_blob wide = *blk[0];
        assert_int_equal(kvt__blob_write(&src, 1, n_parts, 4, 2, 2, &wide.data, &wide.size), 0);
        struct kvt__blob_layout W;
        assert_int_equal(kvt__blob_parse(wide.data, wide.size, n_parts, &W), 0);
        assert_int_equal(W.part[0].n_stream, 4);
        assert_int_equal(W.part[0].slot, 2);
        assert_int_equal(W.part[0].n_cells, L.part[0].n_cells);
        assert_int_equal(wide.size, blk[0]->size + (size_t) n_parts * 12);
        for (int d = 0; d < 3; d++) {
            logits_with(E[d], blk[0], native);
            logits_with(E[d], &wide, got);
            assert_true(max_abs_diff(native, got, nv) == 0);
        }
        free(wide.data);
    }
    free(native);
    free(got);
    for (int i = 0; i < 3; i++) {
        kvt_blob_free(blk[i]);
        kvt_engine_free(E[i]);
    }
    kvt_blob_free(other);
}

static void test_forms_gemma3(void **st) {
    (void) st;
    check_forms("tiny-gemma3");
}
static void test_forms_llama(void **st) {
    (void) st;
    check_forms("tiny-llama");
}

/* ---- failed loads leave the target as it was ----------------------------------------- */

struct snapshot {
    kvt_blob *all; /* a save of every position */
    float *logits; /* next token after it */
    int32_t n_cells;
    kvt_pos pos_max;
};

static void take(kvt_engine *e, int32_t seq, kvt_pos next, struct snapshot *s) {
    const kvt_token T = 55;
    s->n_cells = kvt_seq_n_cells(e, seq);
    s->pos_max = kvt_seq_pos_max(e, seq);
    assert_int_equal(kvt_block_save(e, seq, 0, 100000, &s->all), 0);
    assert_int_equal(kvt_engine_decode(e, seq, &T, 1, next, true), 0);
    s->logits = malloc(sizeof(float) * (size_t) n_vocab(e));
    memcpy(s->logits, kvt_engine_logits(e), sizeof(float) * (size_t) n_vocab(e));
    assert_int_equal(kvt_seq_rm(e, seq, next, next + 1), 0);
}

static void same_as(kvt_engine *e, int32_t seq, kvt_pos next, const struct snapshot *before, const char *what) {
    struct snapshot now;
    take(e, seq, next, &now);
    double d = max_abs_diff(before->logits, now.logits, n_vocab(e));
    bool bytes = before->all->size == now.all->size && !memcmp(before->all->data, now.all->data, now.all->size);
    printf("    after %s: %d cells (was %d), state bytes %s, max|dlogit| %.3g\n", what, now.n_cells, before->n_cells,
           bytes ? "equal" : "DIFFER", d);
    assert_int_equal(now.n_cells, before->n_cells);
    assert_int_equal(now.pos_max, before->pos_max);
    assert_true(bytes);
    assert_true(d == 0);
    kvt_blob_free(now.all);
    free(now.logits);
}

static void check_failed_loads(const char *model, bool unified) {
    kvt_engine *e = open_eng(model, unified, 2, 1024, "f32", KVT_REANCHOR_AUTO);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    const int n_parts = I.n_swa > 0 ? 2 : 1;
    printf("  %s, %s:\n", model, unified ? "unified" : "streams");
    kvt_token A[120];
    toks(A, 120, 8);
    assert_int_equal(kvt_engine_decode(e, 0, A, 60, 0, false), 0);
    assert_int_equal(kvt_seq_rm(e, 0, 10, 20), 0); /* a hole, as eviction leaves */
    kvt_blob *b = make_block(e, 1, 3);
    /* Streams mode packs a sequence's cells whenever it writes the sequence back, successful or
    ** restored: a later token then takes another cell, and its attention sums the same terms in
    ** another order (max|dlogit| 5.5e-5 here).  Pack the target once with a successful load, so
    ** that "as before" can be bit-exact. */
    assert_int_equal(kvt_block_load(e, b, 0, 100), 0);
    assert_int_equal(kvt_seq_rm(e, 0, 100, -1), 0);
    struct snapshot before;
    take(e, 0, 60, &before);
    for (int part = 0; part < n_parts; part++) {
        kvt_engine_set_unsafe_corrupt_next_load(e, part);
        int rc = kvt_block_load(e, b, 0, 100);
        printf("    load rejected by llama.cpp in part %d: %s: %s\n", part, kvt_strerror(rc), kvt_errmsg());
        assert_true(rc == KVT_ELLAMA || rc == KVT_ECTX);
        assert_non_null(strstr(kvt_errmsg(), unified ? "block load" : "previous"));
        same_as(e, 0, 60, &before, "a rejected load");
    }
    /* a blob cut short, and a blob of another model */
    kvt_blob cut = *b;
    cut.size -= 100;
    assert_int_equal(kvt_block_load(e, &cut, 0, 100), KVT_EFORMAT);
    same_as(e, 0, 60, &before, "a truncated blob");
    if (!unified) {
        /* seq_cp and a host seq_shift write the whole sequence too */
        kvt_token C[30];
        toks(C, 30, 17);
        assert_int_equal(kvt_engine_decode(e, 1, C, 30, 200, false), 0);
        kvt_engine_set_unsafe_corrupt_next_load(e, n_parts - 1);
        assert_int_equal(kvt_seq_cp(e, 1, 0, 200, 230), KVT_ELLAMA);
        same_as(e, 0, 60, &before, "a rejected seq_cp");
        kvt_seq_rm(e, 1, -1, -1);
        if (I.reanchor == KVT_REANCHOR_HOST) {
            kvt_engine_set_unsafe_corrupt_next_load(e, 0);
            assert_int_equal(kvt_seq_shift(e, 0, 20, 60, -10), KVT_ELLAMA);
            same_as(e, 0, 60, &before, "a rejected seq_shift");
        }
    }
    kvt_blob_free(before.all);
    free(before.logits);
    kvt_blob_free(b);
    kvt_engine_free(e);
}

static void test_failed_load_gemma3_unified(void **st) {
    (void) st;
    check_failed_loads("tiny-gemma3", true);
}
static void test_failed_load_gemma3_streams(void **st) {
    (void) st;
    check_failed_loads("tiny-gemma3", false);
}
static void test_failed_load_llama_streams(void **st) {
    (void) st;
    check_failed_loads("tiny-llama", false);
}

/* A stream of 256 cells: a block that does not fit, and a block saved after its sliding-window
** cells left the window, are refused before the sequence is touched. */
static void test_refused_loads_streams(void **st) {
    (void) st;
    kvt_engine *e = open_eng("tiny-gemma3", false, 2, 512, "f32", KVT_REANCHOR_AUTO);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    assert_int_equal(I.n_ctx_seq, 256);
    assert_int_equal(I.n_ctx, 512);
    assert_false(I.kv_unified);
    kvt_token A[240];
    toks(A, 240, 9);
    assert_int_equal(kvt_engine_decode(e, 0, A, 200, 0, false), 0);
    assert_int_equal(kvt_engine_decode(e, 1, A, 100, 0, false), 0);
    kvt_blob *big = NULL, *late = NULL;
    assert_int_equal(kvt_block_save(e, 1, 0, 100, &big), 0);
    assert_int_equal(kvt_block_save(e, 1, 10, 40, &late), 0); /* 60 positions ago, window of 32 */
    assert_true(late->n_cells_swa < late->n_cells);
    struct snapshot before;
    take(e, 0, 200, &before);
    int rc = kvt_block_load(e, big, 0, 300);
    printf("  100 cells into a sequence of 200 in a 256-cell stream: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, KVT_ECTX);
    assert_non_null(strstr(kvt_errmsg(), "256"));
    same_as(e, 0, 200, &before, "the overflow");
    rc = kvt_block_load(e, late, 0, 300);
    printf("  a block saved after its window: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, KVT_EFORMAT);
    same_as(e, 0, 200, &before, "the late block");
    /* decode past the stream: ECTX naming the stream */
    rc = kvt_engine_decode(e, 0, A, 60, 200, false);
    assert_int_equal(rc, KVT_ECTX);
    assert_non_null(strstr(kvt_errmsg(), "stream"));
    kvt_blob_free(before.all);
    free(before.logits);
    kvt_blob_free(big);
    kvt_blob_free(late);
    kvt_engine_free(e);
}

/* ---- independence ------------------------------------------------------------------- */

enum { NP = 40, NGEN = 12 };

/* Greedy generation in sequence 0 after prompt P; with `busy`, sequence 1 holds a long prompt
** and decodes 5 more tokens before every step of sequence 0.  Logits of every step to out. */
static void greedy(kvt_engine *e, bool busy, float *out, kvt_token *gen) {
    const int nv = n_vocab(e);
    kvt_token P[NP], O[300];
    toks(P, NP, 1);
    toks(O, 300, 2);
    kvt_seq_rm(e, 0, -1, -1);
    kvt_seq_rm(e, 1, -1, -1);
    kvt_pos o = 0;
    if (busy) {
        assert_int_equal(kvt_engine_decode(e, 1, O, 200, 0, false), 0);
        o = 200;
    }
    assert_int_equal(kvt_engine_decode(e, 0, P, NP, 0, true), 0);
    for (int i = 0; i < NGEN; i++) {
        memcpy(out + (size_t) i * nv, kvt_engine_logits(e), sizeof(float) * (size_t) nv);
        assert_int_equal(kvt_engine_sample(e, NULL, &gen[i]), 0);
        if (busy) {
            assert_int_equal(kvt_engine_decode(e, 1, O + o % 295, 5, o, false), 0);
            o += 5;
        }
        assert_int_equal(kvt_engine_decode(e, 0, &gen[i], 1, NP + i, true), 0);
    }
}

static double independence(const char *model, const char *type, bool unified, bool *same_tokens) {
    kvt_engine *a = open_eng(model, unified, 2, 2048, type, KVT_REANCHOR_AUTO);
    if (!a) return -1;
    kvt_engine *b = open_eng(model, unified, 2, 2048, type, KVT_REANCHOR_AUTO);
    const int nv = n_vocab(a);
    float *la = malloc(sizeof(float) * (size_t) nv * NGEN), *lb = malloc(sizeof(float) * (size_t) nv * NGEN);
    kvt_token ga[NGEN], gb[NGEN];
    greedy(a, false, la, ga);
    greedy(b, true, lb, gb);
    double d = max_abs_diff(la, lb, nv * NGEN);
    *same_tokens = !memcmp(ga, gb, sizeof ga);
    free(la);
    free(lb);
    kvt_engine_free(a);
    kvt_engine_free(b);
    return d;
}

static void check_independence(const char *model, const char *type) {
    bool same_s = false, same_u = false;
    double ds = independence(model, type, false, &same_s);
    if (ds < 0) {
        fprintf(stderr, "skipping: no path for %s in the environment\n", model);
        skip();
    }
    double du = independence(model, type, true, &same_u);
    printf("  %-11s K/V %s, %d greedy steps alone vs beside a busy sequence: max|dlogit| streams %.3g (tokens %s), "
           "unified %.3g (tokens %s)\n",
           model, type, NGEN, ds, same_s ? "same" : "DIFFER", du, same_u ? "same" : "differ");
    assert_true(ds == 0); /* bit-equal: the other stream is not part of the attention */
    assert_true(same_s);
    assert_true(du > 0); /* the control: the unified cache mixes the other sequence's cells in */
}

static void test_independent_gemma3(void **st) {
    (void) st;
    check_independence("tiny-gemma3", "f32");
}
static void test_independent_llama(void **st) {
    (void) st;
    check_independence("tiny-llama", "f16");
}
static void test_independent_real(void **st) {
    (void) st;
    check_independence("gemma3-270m", "f16");
}

/* Two sessions on one engine: session 0's reply and its log-probability of an answer, alone and
** with session 1's turns interleaved (streams: bit-equal). */
static void session_run(kvt_engine *e, bool busy, char **reply, double *lp) {
    struct kvt_session_params p = kvt_session_default_params();
    p.budget = 256;
    p.block = 16;
    p.template_fallback = "chatml";
    kvt_session *s0 = NULL, *s1 = NULL;
    assert_int_equal(kvt_session_open(e, &p, &s0), 0);
    p.seq = 1;
    assert_int_equal(kvt_session_open(e, &p, &s1), 0);
    struct kvt_sampling g = { 0 };
    const char *turns[] = { "the lantern by the harbor is blue", "what colour is the lantern", "and the harbor" };
    for (int t = 0; t < 3; t++) {
        if (busy) {
            char *r = NULL;
            assert_int_equal(kvt_session_add(s1, KVT_ROLE_USER, "a comet over the glacier and the violin mill", KVT_KEEP_NONE), 0);
            assert_int_equal(kvt_session_generate(s1, 6, &g, NULL, NULL, &r), 0);
            free(r);
        }
        assert_int_equal(kvt_session_add(s0, KVT_ROLE_USER, turns[t], KVT_KEEP_NONE), 0);
        free(*reply);
        *reply = NULL;
        assert_int_equal(kvt_session_generate(s0, 8, &g, NULL, NULL, reply), 0);
    }
    int32_t n = 0;
    assert_int_equal(kvt_session_answer_logprob(s0, "blue", lp, &n), 0);
    kvt_session_free(s0);
    kvt_session_free(s1);
}

static void check_sessions(bool unified, bool *same_reply, double *dlp) {
    kvt_engine *a = open_eng("tiny-gemma3", unified, 2, 1024, "f32", KVT_REANCHOR_AUTO);
    kvt_engine *b = open_eng("tiny-gemma3", unified, 2, 1024, "f32", KVT_REANCHOR_AUTO);
    char *ra = NULL, *rb = NULL;
    double la = 0, lb = 0;
    session_run(a, false, &ra, &la);
    session_run(b, true, &rb, &lb);
    *same_reply = !strcmp(ra, rb);
    *dlp = fabs(la - lb);
    free(ra);
    free(rb);
    kvt_engine_free(a);
    kvt_engine_free(b);
}

static void test_independent_sessions(void **st) {
    (void) st;
    bool rs = false, ru = false;
    double ds = 0, du = 0;
    check_sessions(false, &rs, &ds);
    check_sessions(true, &ru, &du);
    printf("  two sessions (tiny-gemma3, F32): |dlogprob| alone vs interleaved: streams %.3g (reply %s), unified %.3g "
           "(reply %s)\n",
           ds, rs ? "same" : "DIFFERS", du, ru ? "same" : "differs");
    assert_true(rs);
    assert_true(ds == 0);
    assert_true(du > 0); /* the control */
}

/* ---- seq_cp across streams --------------------------------------------------------- */

static void test_seq_cp_streams(void **st) {
    (void) st;
    kvt_engine *E[2] = { open_eng("tiny-gemma3", true, 3, 1536, "f32", KVT_REANCHOR_AUTO),
                         open_eng("tiny-gemma3", false, 3, 1536, "f32", KVT_REANCHOR_AUTO) };
    const int nv = n_vocab(E[0]);
    float *l[2] = { malloc(sizeof(float) * nv), malloc(sizeof(float) * nv) };
    kvt_token A[100], T = 9;
    toks(A, 100, 21);
    for (int m = 0; m < 2; m++) {
        kvt_engine *e = E[m];
        assert_int_equal(kvt_engine_decode(e, 0, A, 20, 0, false), 0);
        assert_int_equal(kvt_engine_decode(e, 1, A + 20, 80, 0, false), 0);
        /* the middle of sequence 1 into sequence 0, after a gap; then the whole of it into 2 */
        assert_int_equal(kvt_seq_cp(e, 1, 0, 40, 80), 0);
        assert_int_equal(kvt_seq_n_cells(e, 0), 60);
        assert_int_equal(kvt_seq_pos_max(e, 0), 79);
        assert_int_equal(kvt_seq_n_cells(e, 1), 80); /* the source keeps its cells */
        assert_int_equal(kvt_seq_cp(e, 1, 2, -1, -1), 0);
        assert_int_equal(kvt_seq_n_cells(e, 2), 80);
        assert_int_equal(kvt_engine_decode(e, 0, &T, 1, 80, true), 0);
        memcpy(l[m], kvt_engine_logits(e), sizeof(float) * nv);
        if (m == 1) {
            int rc = kvt_seq_cp(e, 1, 0, 60, 70); /* positions sequence 0 already holds */
            assert_int_equal(rc, KVT_EINVAL);
            assert_non_null(strstr(kvt_errmsg(), "already holds position 60"));
            assert_int_equal(kvt_seq_cp(e, 1, 7, -1, -1), KVT_EINVAL); /* no such sequence, no abort */
            assert_int_equal(kvt_seq_n_cells(e, 0), 61);
            /* and the full copy decodes like its source */
            float *a = malloc(sizeof(float) * nv);
            assert_int_equal(kvt_engine_decode(e, 1, &T, 1, 80, true), 0);
            memcpy(a, kvt_engine_logits(e), sizeof(float) * nv);
            assert_int_equal(kvt_engine_decode(e, 2, &T, 1, 80, true), 0);
            printf("  seq_cp: full copy vs its source: max|dlogit| %.3g\n", max_abs_diff(a, kvt_engine_logits(e), nv));
            assert_true(max_abs_diff(a, kvt_engine_logits(e), nv) == 0);
            free(a);
        }
    }
    double d = max_abs_diff(l[0], l[1], nv);
    printf("  seq_cp of [40, 80) after a gap: streams vs unified max|dlogit| %.3g (tolerance 1e-3)\n", d);
    assert_true(d <= 1e-3);
    free(l[0]);
    free(l[1]);
    kvt_engine_free(E[0]);
    kvt_engine_free(E[1]);
}

/* SEQ_ADD path with streams: a block whose old positions overlap the target's cells is shifted in
** the scratch stream (no pending shift), one whose old positions are free is shifted lazily in
** the target; both give the host path's logits. */
static void test_seqadd_overlap_streams(void **st) {
    (void) st;
    kvt_engine *h = open_eng("tiny-gemma3", false, 2, 1024, "f32", KVT_REANCHOR_HOST);
    kvt_engine *s = open_eng("tiny-gemma3", false, 2, 1024, "f32", KVT_REANCHOR_SEQ_ADD);
    const int nv = n_vocab(h);
    float *lh = malloc(sizeof(float) * nv), *ls = malloc(sizeof(float) * nv);
    kvt_token A[120], T = 5;
    toks(A, 120, 77);
    kvt_engine *E[2] = { h, s };
    float *L[2] = { lh, ls };
    for (int i = 0; i < 2; i++) {
        kvt_engine *e = E[i];
        /* the block [30, 70) of sequence 1, loaded at 100 into sequence 0, which holds [0, 90): its old
        ** range is occupied there, so llama.cpp's shift cannot run in the target */
        assert_int_equal(kvt_engine_decode(e, 1, A, 70, 0, false), 0);
        kvt_blob *b = NULL;
        assert_int_equal(kvt_block_save(e, 1, 30, 70, &b), 0);
        kvt_seq_rm(e, 1, -1, -1);
        assert_int_equal(kvt_engine_decode(e, 0, A + 30, 90, 0, false), 0);
        assert_int_equal(kvt_block_load(e, b, 0, 100), 0);
        assert_false(kvt_engine_shift_pending(e)); /* shifted at once, in the scratch stream */
        kvt_blob_free(b);
        assert_int_equal(kvt_seq_n_cells(e, 0), 130);
        assert_int_equal(kvt_seq_pos_max(e, 0), 139);
        assert_int_equal(kvt_engine_decode(e, 0, &T, 1, 140, true), 0);
        memcpy(L[i], kvt_engine_logits(e), sizeof(float) * nv);
    }
    double d = max_abs_diff(lh, ls, nv);
    printf("  SEQ_ADD through the scratch stream vs host re-anchoring: max|dlogit| %.3g (tolerance 1e-3)\n", d);
    assert_true(d <= 1e-3);
    struct kvt_engine_info I;
    kvt_engine_info(s, &I);
    assert_int_equal(I.reanchor, KVT_REANCHOR_SEQ_ADD);
    assert_int_equal(I.n_ctx_seq, 512);
    assert_int_equal(I.n_ctx, 1536); /* two streams of 512 and the scratch stream */
    kvt_engine_info(h, &I);
    assert_int_equal(I.n_ctx, 1024); /* host path: no scratch stream */
    free(lh);
    free(ls);
    kvt_engine_free(h);
    kvt_engine_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forms_gemma3),
        cmocka_unit_test(test_forms_llama),
        cmocka_unit_test(test_failed_load_gemma3_unified),
        cmocka_unit_test(test_failed_load_gemma3_streams),
        cmocka_unit_test(test_failed_load_llama_streams),
        cmocka_unit_test(test_refused_loads_streams),
        cmocka_unit_test(test_seq_cp_streams),
        cmocka_unit_test(test_seqadd_overlap_streams),
        cmocka_unit_test(test_independent_gemma3),
        cmocka_unit_test(test_independent_llama),
        cmocka_unit_test(test_independent_sessions),
        cmocka_unit_test(test_independent_real),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
