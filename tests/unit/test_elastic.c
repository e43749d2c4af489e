/* test_elastic — live ElasticKV (kvt_seq_elastic, kvt_session_params.elastic_sk/sv).
**
**   reference  tiny llama (2 KV heads) and tiny Gemma 3 (iSWA, 1 KV head), V transposed, both
**              cache modes: after a pass over [64, N - 64) the state read back has exactly the
**              zeros a host reference tau_h = max(sigma_h / 2, mu_h) * s (Welford, written here
**              apart from the library's) gives over the eligible cells, every other element and
**              every sink / tail cell bit-exact; the stats' counts equal the counts in the state
**              read back; a second pass at the same scale zeroes (almost) nothing new;
**   zero       s = 0 leaves the state bit-identical and writes nothing;
**   control    matched-random zeroing at the threshold's own per-head counts moves the next
**              token's logits more than the threshold does (the test can see damage);
**   faults     an allocation failing at each of the pass's allocation sites, and llama.cpp
**              rejecting the write-back (corrupted part): error, state bit-identical;
**   session    a session with elastic on runs passes every 64 tokens after 128, reports the
**              sparsity, keeps the sinks bit-equal to a session without elastic; bad scales are
**              rejected naming the value; a pass failing inside kvt_session_add is its error,
**              the session stays consistent and the next call's passes run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */
#include "fault.h"
#include "kv/blob.h"
#include "kv/codec.h"
#include "test_hooks.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *model_path(const char *name) {
    static char buf[1024];
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(buf, sizeof buf, "%s/%s.gguf", d ? d : "tests/models", name);
    return buf;
}

static unsigned lcg(unsigned *s) { return *s = *s * 1103515245u + 12345u; }

enum { N = 320, SINK = 64, TAIL = 64 };

static kvt_engine *open_engine(const char *name, bool unified, int n_seq) {
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = model_path(name);
    ep.n_ctx = 1024 * n_seq;
    ep.n_seq = n_seq;
    ep.kv_unified = unified;
    kvt_engine *e = NULL;
    int rc = kvt_engine_open(&ep, &e);
    if (rc) fprintf(stderr, "open %s: %s\n", name, kvt_errmsg());
    assert_int_equal(rc, 0);
    return e;
}

static void fill(kvt_engine *e, int32_t seq, kvt_token *tok, int n) {
    struct kvt_engine_info info;
    kvt_engine_info(e, &info);
    unsigned s = 11;
    for (int i = 0; i < n; i++) tok[i] = 3 + (kvt_token) (lcg(&s) >> 8) % (info.n_vocab - 3);
    for (int i = 0; i < n; i += 64) assert_int_equal(kvt_engine_decode(e, seq, tok + i, n - i < 64 ? n - i : 64, i, false), 0);
}

/* The whole sequence as a canonical blob (the state read back). */
static kvt_blob *state(kvt_engine *e, int32_t seq) {
    kvt_blob *b = NULL;
    int rc = kvt_block_save(e, seq, 0, 1 << 20, &b);
    if (rc) fprintf(stderr, "save: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
    return b;
}

/* Tensor t (0..2*n_layer-1: K layers then V layers) of part p. */
static struct kvt__mat mat(const kvt_blob *b, const struct kvt__blob_layout *L, int p, uint32_t t) {
    const struct kvt__blob_part *P = &L->part[p];
    uint32_t l = t % P->n_layer;
    bool v = t >= P->n_layer;
    uint32_t es = (uint32_t) ((v ? P->v_type[l] : P->k_type[l]) == 1 ? 2 : 4);
    if (!v) return (struct kvt__mat){ b->data + P->k_off[l], P->n_cells, (uint32_t) (P->k_row_bytes[l] / es), es, false };
    if (P->v_trans) return (struct kvt__mat){ b->data + P->v_off[l], P->n_cells, P->v_n_embd[l], es, true };
    return (struct kvt__mat){ b->data + P->v_off[l], P->n_cells, (uint32_t) (P->v_row_bytes[l] / es), es, false };
}

static const uint8_t *el(const struct kvt__mat *m, uint32_t c, uint32_t e) {
    return m->base + (m->trans ? (size_t) e * m->n_cells + c : (size_t) c * m->n_embd + e) * m->elsize;
}

/* Cell of position pos in part p (-1 if none). */
static int cell_of(const kvt_blob *b, const struct kvt__blob_layout *L, int p, int32_t pos) {
    for (uint32_t c = 0; c < L->part[p].n_cells; c++)
        if (kvt__blob_cell_pos(b->data, L, p, c) == pos) return (int) c;
    return -1;
}

struct check {
    long mismatches, near, zeros_expected;
    int64_t n_elems, n_zero, n_eligible, n_zero_eligible, n_zeroed;
};

/* Compare before/after against the host reference for every tensor of every part. */
static void check_pass(const kvt_blob *b0, const kvt_blob *b1, int n_head, double s_k, double s_v, int32_t p0, int32_t p1,
                       struct check *ck) {
    struct kvt__blob_layout *L0 = malloc(sizeof *L0), *L1 = malloc(sizeof *L1);
    assert_int_equal(kvt__blob_parse(b0->data, b0->size, 2, L0) == 0 || kvt__blob_parse(b0->data, b0->size, 1, L0) == 0, 1);
    assert_int_equal(kvt__blob_parse(b1->data, b1->size, L0->n_parts, L1), 0);
    memset(ck, 0, sizeof *ck);
    for (int p = 0; p < L0->n_parts; p++) {
        const struct kvt__blob_part *P = &L0->part[p];
        assert_int_equal(P->n_cells, L1->part[p].n_cells);
        if (!P->n_cells) continue;
        int *map = malloc(sizeof *map * P->n_cells); /* cell of b0 -> cell of b1 (same position) */
        for (uint32_t c = 0; c < P->n_cells; c++) {
            map[c] = cell_of(b1, L1, p, kvt__blob_cell_pos(b0->data, L0, p, c));
            assert_true(map[c] >= 0);
        }
        for (uint32_t t = 0; t < 2 * P->n_layer; t++) {
            struct kvt__mat m0 = mat(b0, L0, p, t), m1 = mat(b1, L1, p, t);
            const double s = t < P->n_layer ? s_k : s_v;
            const uint32_t hd = m0.n_embd / (uint32_t) n_head;
            double tau[16];
            for (int h = 0; h < n_head; h++) { /* Welford over |x| of the eligible cells */
                double n = 0, mu = 0, m2 = 0;
                for (uint32_t c = 0; c < m0.n_cells; c++) {
                    int32_t pos = kvt__blob_cell_pos(b0->data, L0, p, c);
                    if (pos < p0 || pos >= p1) continue;
                    for (uint32_t e = h * hd; e < (h + 1) * hd; e++) {
                        double a = fabs(kvt__mat_get(&m0, c, e)), d0 = a - mu;
                        n += 1;
                        mu += d0 / n;
                        m2 += d0 * (a - mu);
                    }
                }
                double sigma = n > 0 ? sqrt(m2 / n) : 0;
                tau[h] = (sigma / 2 > mu ? sigma / 2 : mu) * s;
            }
            for (uint32_t c = 0; c < m0.n_cells; c++) {
                int32_t pos = kvt__blob_cell_pos(b0->data, L0, p, c);
                bool elig = pos >= p0 && pos < p1 && s > 0;
                for (uint32_t e = 0; e < m0.n_embd; e++) {
                    double x = kvt__mat_get(&m0, c, e), y = kvt__mat_get(&m1, (uint32_t) map[c], e), th = tau[e / hd];
                    ck->n_elems++;
                    ck->n_zero += y == 0;
                    if (pos >= p0 && pos < p1) {
                        ck->n_eligible++;
                        ck->n_zero_eligible += y == 0;
                    }
                    ck->n_zeroed += x != 0 && y == 0;
                    if (elig && fabs(fabs(x) - th) < 1e-5 * th) {
                        ck->near++;
                        continue;
                    }
                    bool zero = elig && fabs(x) < th;
                    ck->zeros_expected += zero;
                    if (zero ? y != 0 : memcmp(el(&m0, c, e), el(&m1, (uint32_t) map[c], e), m0.elsize) != 0) ck->mismatches++;
                }
            }
        }
        free(map);
    }
    free(L0);
    free(L1);
}

static void run_reference(const char *name, bool unified) {
    kvt_engine *e = open_engine(name, unified, 1);
    struct kvt_engine_info info;
    kvt_engine_info(e, &info);
    kvt_token tok[N];
    fill(e, 0, tok, N);
    kvt_blob *b0 = state(e, 0);
    struct kvt_elastic_params ep = { 0.45f, 0.50f, SINK, N - TAIL, false, 0, 0 };
    struct kvt_elastic_stats st;
    int rc = kvt_seq_elastic(e, 0, &ep, &st);
    if (rc) fprintf(stderr, "elastic: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
    kvt_blob *b1 = state(e, 0);
    struct check ck;
    check_pass(b0, b1, info.n_head_kv, 0.45, 0.50, SINK, N - TAIL, &ck);
    printf("%s %s: %lld elements, %lld eligible, %lld zero (%.1f %% of eligible), %ld near tau, %ld mismatches\n", name,
           unified ? "unified" : "streams", (long long) ck.n_elems, (long long) ck.n_eligible, (long long) ck.n_zero,
           100.0 * ck.n_zero_eligible / ck.n_eligible, ck.near, ck.mismatches);
    assert_int_equal(ck.mismatches, 0);
    assert_true(ck.near < ck.n_eligible / 1000 + 2);
    assert_true(ck.zeros_expected > ck.n_eligible / 10); /* the pass did something */
    assert_int_equal(st.n_elems, ck.n_elems);
    assert_int_equal(st.n_zero, ck.n_zero);
    assert_int_equal(st.n_eligible, ck.n_eligible);
    assert_int_equal(st.n_zero_eligible, ck.n_zero_eligible);
    assert_int_equal(st.n_zeroed, ck.n_zeroed);
    /* a second pass over the same cells: zeros counted in mu/sigma lower tau, nothing ratchets */
    struct kvt_elastic_stats st2;
    assert_int_equal(kvt_seq_elastic(e, 0, &ep, &st2), 0);
    printf("  second pass zeroed %lld more (%.3f %% of eligible)\n", (long long) st2.n_zeroed,
           100.0 * st2.n_zeroed / st.n_eligible);
    assert_true(st2.n_zeroed < st.n_eligible / 100);
    /* the decode continues after the write-back */
    assert_int_equal(kvt_engine_decode(e, 0, tok, 1, N, true), 0);
    assert_non_null(kvt_engine_logits(e));
    kvt_blob_free(b0);
    kvt_blob_free(b1);
    kvt_engine_free(e);
}

static void test_reference(void **stp) {
    (void) stp;
    run_reference("tiny-llama", false);
    run_reference("tiny-gemma3", false);
    run_reference("tiny-gemma3", true);
}

static bool same_blob(const kvt_blob *a, const kvt_blob *b) { return a->size == b->size && memcmp(a->data, b->data, a->size) == 0; }

static void test_zero(void **stp) {
    (void) stp;
    kvt_engine *e = open_engine("tiny-gemma3", false, 1);
    kvt_token tok[N];
    fill(e, 0, tok, N);
    kvt_blob *b0 = state(e, 0);
    struct kvt_elastic_params ep = { 0, 0, SINK, N - TAIL, false, 0, 0 };
    struct kvt_elastic_stats st;
    assert_int_equal(kvt_seq_elastic(e, 0, &ep, &st), 0);
    assert_int_equal(st.n_zeroed, 0);
    kvt_blob *b1 = state(e, 0);
    assert_true(same_blob(b0, b1));
    /* bad arguments are rejected before anything is touched */
    ep.s_k = -0.1f;
    assert_int_equal(kvt_seq_elastic(e, 0, &ep, NULL), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "-0.1"));
    ep.s_k = 0.45f;
    ep.p0 = 100;
    ep.p1 = 50;
    assert_int_equal(kvt_seq_elastic(e, 0, &ep, NULL), KVT_EINVAL);
    assert_int_equal(kvt_seq_elastic(e, 7, &ep, NULL), KVT_EINVAL);
    kvt_blob *b2 = state(e, 0);
    assert_true(same_blob(b0, b2));
    kvt_blob_free(b0);
    kvt_blob_free(b1);
    kvt_blob_free(b2);
    kvt_engine_free(e);
}

static double kl(const float *p_logits, const float *q_logits, int n) {
    double mp = -INFINITY, mq = -INFINITY, zp = 0, zq = 0, k = 0;
    for (int i = 0; i < n; i++) {
        mp = fmax(mp, p_logits[i]);
        mq = fmax(mq, q_logits[i]);
    }
    for (int i = 0; i < n; i++) {
        zp += exp(p_logits[i] - mp);
        zq += exp(q_logits[i] - mq);
    }
    for (int i = 0; i < n; i++) {
        double lp = p_logits[i] - mp - log(zp), lq = q_logits[i] - mq - log(zq);
        k += exp(lp) * (lp - lq);
    }
    return k;
}

/* Put state b back into seq 0, optionally run a pass, decode `next` at N: logits into out. */
static void step(kvt_engine *e, const kvt_blob *b, const struct kvt_elastic_params *ep, kvt_token next, float *out, int n_vocab,
                 struct kvt_elastic_stats *st) {
    assert_int_equal(kvt_seq_rm(e, 0, -1, -1), 0);
    assert_int_equal(kvt_block_load(e, b, 0, 0), 0);
    if (ep) assert_int_equal(kvt_seq_elastic(e, 0, ep, st), 0);
    assert_int_equal(kvt_engine_decode(e, 0, &next, 1, N, true), 0);
    memcpy(out, kvt_engine_logits(e), sizeof *out * (size_t) n_vocab);
}

static void run_control(const char *name) {
    kvt_engine *e = open_engine(name, false, 1);
    struct kvt_engine_info info;
    kvt_engine_info(e, &info);
    kvt_token tok[N + 1];
    fill(e, 0, tok, N);
    tok[N] = tok[7];
    kvt_blob *b0 = state(e, 0);
    const int nv = info.n_vocab;
    float *ref = malloc(sizeof *ref * (size_t) nv), *thr = malloc(sizeof *thr * (size_t) nv),
          *rnd = malloc(sizeof *rnd * (size_t) nv);
    struct kvt_elastic_params ep = { 0.45f, 0.50f, SINK, N - TAIL, false, 0, 0 };
    struct kvt_elastic_stats st_t, st_r;
    step(e, b0, NULL, tok[N], ref, nv, NULL);
    step(e, b0, &ep, tok[N], thr, nv, &st_t);
    double kl_t = kl(ref, thr, nv), kl_r = 0;
    for (uint64_t seed = 1; seed <= 3; seed++) { /* three random draws, each must be worse */
        ep.random = true;
        ep.seed = seed;
        step(e, b0, &ep, tok[N], rnd, nv, &st_r);
        double k = kl(ref, rnd, nv);
        printf("%s: zero fraction threshold %.4f random %.4f | KL threshold %.3g random %.3g\n", name,
               (double) st_t.n_zero_eligible / st_t.n_eligible, (double) st_r.n_zero_eligible / st_r.n_eligible, kl_t, k);
        assert_int_equal(st_r.n_zero_eligible, st_t.n_zero_eligible); /* same count per head, so in total */
        assert_true(k > kl_t);
        kl_r += k;
    }
    assert_true(kl_r / 3 > 2 * kl_t);
    /* a fixed sparsity (random_frac): every head's range at round(frac x elements), and a second
    ** pass adds nothing (matching the threshold's count pass by pass would ratchet up) */
    ep.random_frac = 0.25f;
    step(e, b0, &ep, tok[N], rnd, nv, &st_r);
    printf("%s: random_frac 0.25 -> %.4f of the range\n", name, (double) st_r.n_zero_eligible / st_r.n_eligible);
    assert_true(fabs((double) st_r.n_zero_eligible / st_r.n_eligible - 0.25) < 0.002);
    assert_int_equal(kvt_seq_rm(e, 0, N, -1), 0);
    assert_int_equal(kvt_seq_elastic(e, 0, &ep, &st_r), 0);
    assert_int_equal(st_r.n_zeroed, 0);
    ep.random_frac = 0;
    assert_int_equal(kvt_seq_elastic(e, 0, &ep, &st_r), 0);
    printf("%s: matching the count again on the thinned range zeroes %lld more\n", name, (long long) st_r.n_zeroed);
    assert_true(st_r.n_zeroed > 0); /* the ratchet the fixed fraction avoids */
    ep.random_frac = 1.5f;
    assert_int_equal(kvt_seq_elastic(e, 0, &ep, NULL), KVT_EINVAL);
    free(ref);
    free(thr);
    free(rnd);
    kvt_blob_free(b0);
    kvt_engine_free(e);
}

static void test_control(void **stp) {
    (void) stp;
    run_control("tiny-llama");
    run_control("tiny-gemma3");
}

static void test_faults(void **stp) {
    (void) stp;
    kvt_engine *e = open_engine("tiny-gemma3", false, 1);
    kvt_token tok[N];
    fill(e, 0, tok, N);
    kvt_blob *b0 = state(e, 0);
    struct kvt_elastic_params ep = { 0.45f, 0.50f, SINK, N - TAIL, false, 0, 0 };
    int n_fail = 0;
    for (int k = 0; k < 64; k++) { /* the k-th allocation check fails */
        kvt__fault_set(KVT__FAULT_ELASTIC_ALLOC, k, 1);
        int rc = kvt_seq_elastic(e, 0, &ep, NULL);
        bool hit = kvt__fault_hits(KVT__FAULT_ELASTIC_ALLOC) > 0;
        kvt__fault_set(KVT__FAULT_ELASTIC_ALLOC, 0, 0);
        if (!hit) {
            assert_int_equal(rc, 0);
            break;
        }
        assert_int_equal(rc, KVT_ENOMEM);
        assert_non_null(strstr(kvt_errmsg(), "elastic"));
        kvt_blob *b = state(e, 0);
        assert_true(same_blob(b0, b));
        kvt_blob_free(b);
        n_fail++;
    }
    printf("allocation failures injected: %d\n", n_fail);
    assert_true(n_fail >= 3);
    /* llama.cpp rejects the write-back: the previous state is back, bit-identical */
    assert_int_equal(kvt_seq_rm(e, 0, -1, -1), 0);
    assert_int_equal(kvt_block_load(e, b0, 0, 0), 0);
    kvt_blob *b1 = state(e, 0);
    for (int part = 0; part < 2; part++) {
        kvt_engine_set_unsafe_corrupt_next_load(e, part);
        assert_int_equal(kvt_seq_elastic(e, 0, &ep, NULL), KVT_ELLAMA);
        assert_non_null(strstr(kvt_errmsg(), "previous"));
        kvt_blob *b = state(e, 0);
        assert_true(same_blob(b1, b));
        kvt_blob_free(b);
    }
    kvt_engine_set_unsafe_corrupt_next_load(e, -1);
    kvt_blob_free(b0);
    kvt_blob_free(b1);
    kvt_engine_free(e);
}

static char *words(int n) {
    static const char *W[] = { "river",  "stone",  "quiet",  "lamp",   "orbit",   "maple", "signal", "harbor",
                               "violet", "engine", "copper", "meadow", "thunder", "paper", "garden", "silver" };
    char *t = malloc((size_t) n * 10 + 1);
    size_t k = 0;
    unsigned s = 3;
    for (int i = 0; i < n; i++) k += (size_t) sprintf(t + k, "%s ", W[(lcg(&s) >> 8) % 16]);
    t[k] = 0;
    return t;
}

/* Same positions and K/V bytes (the cell records carry the sequence id, which differs). */
static bool same_kv(const kvt_blob *a, const kvt_blob *b) {
    struct kvt__blob_layout *La = malloc(sizeof *La), *Lb = malloc(sizeof *Lb);
    assert_int_equal(kvt__blob_parse(a->data, a->size, 1, La), 0);
    assert_int_equal(kvt__blob_parse(b->data, b->size, 1, Lb), 0);
    bool same = La->part[0].n_cells == Lb->part[0].n_cells;
    for (uint32_t c = 0; same && c < La->part[0].n_cells; c++)
        same = kvt__blob_cell_pos(a->data, La, 0, c) == kvt__blob_cell_pos(b->data, Lb, 0, c);
    for (uint32_t t = 0; same && t < 2 * La->part[0].n_layer; t++) {
        struct kvt__mat ma = mat(a, La, 0, t), mb = mat(b, Lb, 0, t);
        same = memcmp(ma.base, mb.base, (size_t) ma.n_cells * ma.n_embd * ma.elsize) == 0;
    }
    free(La);
    free(Lb);
    return same;
}

static void test_session(void **stp) {
    (void) stp;
    kvt_engine *e = open_engine("tiny-llama", false, 2);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.policy = KVT_POLICY_NO_EVICTION;
    sp.elastic_sk = -0.5f;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "-0.5"));
    sp.elastic_sk = 0.45f;
    sp.elastic_sv = 2.5f;
    assert_int_equal(kvt_session_open(e, &sp, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "2.5"));
    sp.elastic_sv = 0.50f;
    kvt_session *plain = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    struct kvt_session_params pp = sp;
    pp.seq = 1;
    pp.elastic_sk = pp.elastic_sv = 0;
    assert_int_equal(kvt_session_open(e, &pp, &plain), 0);
    char *text = words(100);
    int rca = kvt_session_add(s, KVT_ROLE_USER, text, KVT_KEEP_NONE);
    if (rca) fprintf(stderr, "add: %s\n", kvt_errmsg());
    assert_int_equal(rca, 0);
    assert_int_equal(kvt_session_add(plain, KVT_ROLE_USER, text, KVT_KEEP_NONE), 0);
    struct kvt_session_stats st, stp0;
    kvt_session_get_stats(s, &st);
    kvt_session_get_stats(plain, &stp0);
    printf("session: %lld tokens, %lld passes, resident sparsity %.3f, eligible %.3f, %.1f ms\n", (long long) st.tokens_decoded,
           (long long) st.elastic_passes, (double) st.elastic_zero / st.elastic_elems,
           (double) st.elastic_zero_eligible / st.elastic_eligible, st.elastic_ms);
    /* a pass at every 64 tokens once 128 are resident (chunks end at 64-token block boundaries);
    ** the one due at 128 has nothing to threshold (64 sinks + 64 tail), so the first is at 192 */
    assert_true(st.tokens_decoded > 256);
    assert_int_equal(st.elastic_passes, st.tokens_decoded / 64 - 2);
    assert_int_equal(stp0.elastic_passes, 0);
    assert_true(st.elastic_zero_eligible > st.elastic_eligible / 10);
    assert_true(st.elastic_zero < st.elastic_elems);
    assert_true(st.elastic_zeroed >= st.elastic_zero_eligible);
    /* sinks: bit-equal to the session that never pruned */
    kvt_blob *a = NULL, *b = NULL;
    assert_int_equal(kvt_block_save(e, 0, 0, SINK, &a), 0);
    assert_int_equal(kvt_block_save(e, 1, 0, SINK, &b), 0);
    assert_true(same_kv(a, b));
    kvt_blob_free(a);
    kvt_blob_free(b);
    /* and the range after them is not (control: the comparison can see a pruned block) */
    assert_int_equal(kvt_block_save(e, 0, SINK, 2 * SINK, &a), 0);
    assert_int_equal(kvt_block_save(e, 1, SINK, 2 * SINK, &b), 0);
    assert_false(same_kv(a, b));
    kvt_blob_free(a);
    kvt_blob_free(b);
    /* generation goes on with passes */
    struct kvt_sampling smp = { .temperature = 0.0f, .top_p = 1.0f };
    char *reply = NULL;
    assert_int_equal(kvt_session_generate(s, 70, &smp, NULL, NULL, &reply), 0);
    free(reply);
    /* a pass that fails is returned by the call that decoded the tokens; the cache and the block
    ** table stay consistent, and the next call's passes run again */
    kvt_session_get_stats(s, &st);
    const int64_t passes = st.elastic_passes;
    kvt__fault_set(KVT__FAULT_ELASTIC_ALLOC, 0, -1);
    int rcf = kvt_session_add(s, KVT_ROLE_USER, text, KVT_KEEP_NONE);
    kvt__fault_set(KVT__FAULT_ELASTIC_ALLOC, 0, 0);
    assert_int_equal(rcf, KVT_ENOMEM);
    kvt_session_get_stats(s, &st);
    assert_int_equal(st.elastic_passes, passes);
    assert_int_equal(st.resident_tokens, kvt_seq_n_cells(e, 0));
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "and one more short message to go on with", KVT_KEEP_NONE), 0);
    kvt_session_get_stats(s, &st);
    assert_true(st.elastic_passes > passes);
    free(text);
    kvt_session_free(s);
    kvt_session_free(plain);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference), cmocka_unit_test(test_zero),    cmocka_unit_test(test_control),
        cmocka_unit_test(test_faults),    cmocka_unit_test(test_session),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
