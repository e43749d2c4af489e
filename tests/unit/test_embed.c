/* test_embed — optional dense retrieval (kvtier.h section 7).
**
** ANN (hnswlib HNSW by cosine): 2000 seeded random unit vectors of dim 64; the top-10 of 50
** random queries must agree with brute force (mean recall@10 >= 0.9), a stored vector must find
** itself first; remove, replace, re-add, growth past the initial capacity, size and bad
** arguments.  A control negates the query: the true neighbour must then rank last, so the
** recall check is shown to be able to fail.
** Embedder (llama.cpp, embeddings on, mean pooling): on Gemma 3 270M ($KVTIER_MODEL; skipped
** when unset) the width is 640, vectors are unit length and deterministic, two sentences about
** volcanoes are closer to each other than to one about bread, long text is cut to n_ctx tokens;
** on the tiny generated model the same plumbing runs without the real model; a missing or
** corrupt GGUF is KVT_EMODEL naming the path. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- helpers ------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) { /* xorshift64* */
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static double rng_unit(uint64_t *s) { return ((rng_next(s) >> 11) + 0.5) / 9007199254740992.0; }

/* Uniform on the unit sphere: normalised Gaussian (Box-Muller). */
static void rand_unit(uint64_t *s, float *v, int dim) {
    double ss = 0;
    for (int i = 0; i < dim; i++) {
        double g = sqrt(-2.0 * log(rng_unit(s))) * cos(6.283185307179586 * rng_unit(s));
        v[i] = (float) g;
        ss += g * g;
    }
    for (int i = 0; i < dim; i++) v[i] = (float) (v[i] / sqrt(ss));
}

static double dot(const float *a, const float *b, int dim) {
    double d = 0;
    for (int i = 0; i < dim; i++) d += (double) a[i] * b[i];
    return d;
}

static double norm(const float *a, int dim) { return sqrt(dot(a, a, dim)); }

/* Brute-force top-k indices of q among base[0..n) by cosine (all unit vectors), best first.
** Entries with alive[i] == 0 are skipped. */
static void brute_topk(const float *base, const char *alive, int n, int dim, const float *q, int k, int *top) {
    double *best = malloc(sizeof(double) * (size_t) k);
    assert_non_null(best);
    for (int j = 0; j < k; j++) {
        top[j] = -1;
        best[j] = -INFINITY;
    }
    for (int i = 0; i < n; i++) {
        if (alive && !alive[i]) continue;
        double s = dot(base + (size_t) i * dim, q, dim);
        if (s <= best[k - 1]) continue;
        int j = k - 1;
        while (j > 0 && best[j - 1] < s) {
            best[j] = best[j - 1];
            top[j] = top[j - 1];
            j--;
        }
        best[j] = s;
        top[j] = i;
    }
    free(best);
}

/* Ids are spread over the whole uint64 range so a narrowing label map would be caught. */
static uint64_t id_of(int i) { return ((uint64_t) i << 40) | 0x5a5aull | ((uint64_t) (i & 1) << 63); }

static int index_of(uint64_t id) { return (int) ((id & ~(1ull << 63)) >> 40); }

/* |found ∩ truth| / k */
static double recall(const uint64_t *found, int n_found, const int *truth, int k) {
    int hit = 0;
    for (int i = 0; i < n_found; i++)
        for (int j = 0; j < k; j++)
            if (truth[j] >= 0 && found[i] == id_of(truth[j])) {
                hit++;
                break;
            }
    return (double) hit / k;
}

enum { N = 2000, DIM = 64, NQ = 50, K = 10 };

struct ann_fx {
    kvt_ann *ann;
    float *base; /* [N][DIM] */
};

/* 2000 vectors added to an index opened with capacity 100 (grows by doubling five times). */
static int ann_setup(void **state) {
    struct ann_fx *f = calloc(1, sizeof *f);
    f->base = malloc(sizeof(float) * N * DIM);
    uint64_t seed = 0x1234abcdull;
    for (int i = 0; i < N; i++) rand_unit(&seed, f->base + (size_t) i * DIM, DIM);
    if (kvt_ann_open(DIM, 100, 0, 0, &f->ann)) return -1;
    for (int i = 0; i < N; i++)
        if (kvt_ann_add(f->ann, id_of(i), f->base + (size_t) i * DIM)) return -1;
    *state = f;
    return 0;
}

static int ann_teardown(void **state) {
    struct ann_fx *f = *state;
    kvt_ann_free(f->ann);
    free(f->base);
    free(f);
    return 0;
}

/* ---- ANN ------------------------------------------------------------------------------ */

static void test_ann_recall(void **state) {
    struct ann_fx *f = *state;
    assert_int_equal(kvt_ann_size(f->ann), N);
    uint64_t seed = 0xfeedull;
    float q[DIM];
    uint64_t ids[K];
    float sims[K];
    int truth[K];
    double sum = 0;
    for (int t = 0; t < NQ; t++) {
        rand_unit(&seed, q, DIM);
        int32_t n = -1;
        assert_int_equal(kvt_ann_search(f->ann, q, K, ids, sims, &n), 0);
        assert_int_equal(n, K);
        brute_topk(f->base, NULL, N, DIM, q, K, truth);
        sum += recall(ids, n, truth, K);
        for (int i = 0; i < n; i++) { /* sims are the cosine of the returned id, best first */
            int j = index_of(ids[i]);
            assert_true(j >= 0 && j < N && ids[i] == id_of(j));
            assert_float_equal(sims[i], dot(f->base + (size_t) j * DIM, q, DIM), 1e-4);
            if (i) assert_true(sims[i] <= sims[i - 1] + 1e-6f);
        }
    }
    double r = sum / NQ;
    fprintf(stderr, "ann recall@%d over %d queries on %d x %d: %.3f\n", K, NQ, N, DIM, r);
    assert_true(r >= 0.9);

    /* a stored vector finds itself first, at cosine 1, also when given unnormalised */
    for (int t = 0; t < NQ; t++) {
        int j = (int) (rng_next(&seed) % N);
        for (int d = 0; d < DIM; d++) q[d] = 3.5f * f->base[(size_t) j * DIM + d];
        int32_t n = 0;
        assert_int_equal(kvt_ann_search(f->ann, q, 1, ids, sims, &n), 0);
        assert_int_equal(n, 1);
        assert_true(ids[0] == id_of(j));
        assert_float_equal(sims[0], 1.0, 1e-4);
    }
}

/* Control: the same checks with the query negated must fail — the true neighbour has cosine -1
** and ranks last of all N. */
static void test_ann_control_negated_query(void **state) {
    struct ann_fx *f = *state;
    const int j = 777;
    float q[DIM];
    for (int d = 0; d < DIM; d++) q[d] = -f->base[(size_t) j * DIM + d];
    uint64_t *ids = malloc(sizeof(uint64_t) * N);
    float *sims = malloc(sizeof(float) * N);
    int32_t n = 0;
    assert_int_equal(kvt_ann_search(f->ann, q, K, ids, sims, &n), 0);
    assert_int_equal(n, K);
    for (int i = 0; i < n; i++) assert_true(ids[i] != id_of(j)); /* "finds itself first" fails */
    int truth[K];
    for (int i = 0; i < K; i++) truth[i] = j; /* recall against the true neighbour: 0 */
    assert_true(recall(ids, n, truth, K) == 0.0);
    assert_int_equal(kvt_ann_search(f->ann, q, N, ids, sims, &n), 0);
    assert_int_equal(n, N);
    assert_true(ids[n - 1] == id_of(j));
    assert_float_equal(sims[n - 1], -1.0, 1e-4);
    free(ids);
    free(sims);
}

static void test_ann_remove_and_readd(void **state) {
    struct ann_fx *f = *state;
    char *alive = malloc(N);
    memset(alive, 1, N);
    /* remove every third of the first 600, then search for each removed vector */
    int n_removed = 0;
    for (int i = 0; i < 600; i += 3) {
        assert_int_equal(kvt_ann_remove(f->ann, id_of(i)), 0);
        alive[i] = 0;
        n_removed++;
    }
    assert_int_equal(kvt_ann_size(f->ann), N - n_removed);
    assert_int_equal(kvt_ann_remove(f->ann, id_of(0)), KVT_ENOENT); /* already removed */
    assert_int_equal(kvt_ann_remove(f->ann, 42), KVT_ENOENT);       /* never added */
    assert_non_null(strstr(kvt_errmsg(), "42"));
    uint64_t ids[K];
    float sims[K];
    int truth[K];
    double sum = 0;
    int nq = 0;
    for (int i = 0; i < 600; i += 3, nq++) {
        int32_t n = 0;
        const float *q = f->base + (size_t) i * DIM;
        assert_int_equal(kvt_ann_search(f->ann, q, K, ids, sims, &n), 0);
        assert_int_equal(n, K);
        for (int r = 0; r < n; r++) assert_true(alive[index_of(ids[r])]); /* never a removed id */
        brute_topk(f->base, alive, N, DIM, q, K, truth);
        sum += recall(ids, n, truth, K);
    }
    fprintf(stderr, "ann recall@%d after %d removals: %.3f\n", K, n_removed, sum / nq);
    assert_true(sum / nq >= 0.9);
    /* re-adding a removed id brings it back (same slot) */
    assert_int_equal(kvt_ann_add(f->ann, id_of(3), f->base + 3 * DIM), 0);
    assert_int_equal(kvt_ann_size(f->ann), N - n_removed + 1);
    int32_t n = 0;
    assert_int_equal(kvt_ann_search(f->ann, f->base + 3 * DIM, 1, ids, sims, &n), 0);
    assert_true(ids[0] == id_of(3));
    free(alive);
}

static void test_ann_replace(void **state) {
    (void) state;
    kvt_ann *a = NULL;
    assert_int_equal(kvt_ann_open(DIM, 0, 8, 64, &a), 0);
    uint64_t seed = 99;
    float base[64][DIM], w[DIM];
    for (int i = 0; i < 64; i++) {
        rand_unit(&seed, base[i], DIM);
        assert_int_equal(kvt_ann_add(a, (uint64_t) i, base[i]), 0);
    }
    assert_int_equal(kvt_ann_size(a), 64);
    rand_unit(&seed, w, DIM);
    assert_int_equal(kvt_ann_add(a, 5, w), 0); /* replace id 5's vector */
    assert_int_equal(kvt_ann_size(a), 64);
    uint64_t ids[64];
    float sims[64];
    int32_t n = 0;
    assert_int_equal(kvt_ann_search(a, w, 1, ids, sims, &n), 0);
    assert_int_equal(n, 1);
    assert_true(ids[0] == 5);
    assert_float_equal(sims[0], 1.0, 1e-4);
    /* the old vector no longer finds id 5 at cosine 1 */
    assert_int_equal(kvt_ann_search(a, base[5], 64, ids, sims, &n), 0);
    assert_int_equal(n, 64);
    for (int i = 0; i < n; i++)
        if (ids[i] == 5) assert_float_equal(sims[i], dot(base[5], w, DIM), 1e-4);
    assert_true(ids[0] != 5);
    /* k larger than the index: everything, once */
    int seen[64] = { 0 };
    for (int i = 0; i < n; i++) seen[ids[i]]++;
    for (int i = 0; i < 64; i++) assert_int_equal(seen[i], 1);
    kvt_ann_free(a);
}

static void test_ann_empty_and_small(void **state) {
    (void) state;
    kvt_ann *a = NULL;
    assert_int_equal(kvt_ann_open(3, 1, 0, 0, &a), 0);
    float q[3] = { 1, 0, 0 }, v[3] = { 0, 2, 0 };
    uint64_t ids[4];
    float sims[4];
    int32_t n = -1;
    assert_int_equal(kvt_ann_search(a, q, 4, ids, sims, &n), 0);
    assert_int_equal(n, 0);
    assert_int_equal(kvt_ann_size(a), 0);
    assert_int_equal(kvt_ann_add(a, UINT64_MAX, q), 0);
    assert_int_equal(kvt_ann_add(a, 0, v), 0);
    assert_int_equal(kvt_ann_search(a, q, 4, ids, sims, &n), 0);
    assert_int_equal(n, 2);
    assert_true(ids[0] == UINT64_MAX && ids[1] == 0);
    assert_float_equal(sims[0], 1.0, 1e-6);
    assert_float_equal(sims[1], 0.0, 1e-6);
    assert_int_equal(kvt_ann_remove(a, UINT64_MAX), 0);
    assert_int_equal(kvt_ann_remove(a, 0), 0);
    assert_int_equal(kvt_ann_size(a), 0);
    assert_int_equal(kvt_ann_search(a, q, 4, ids, sims, &n), 0);
    assert_int_equal(n, 0);
    kvt_ann_free(a);
    kvt_ann_free(NULL);
}

static void test_ann_bad_args(void **state) {
    (void) state;
    kvt_ann *a = (kvt_ann *) (uintptr_t) 1;
    assert_int_equal(kvt_ann_open(0, 10, 0, 0, &a), KVT_EINVAL);
    assert_null(a);
    assert_non_null(strstr(kvt_errmsg(), "dimension 0"));
    assert_int_equal(kvt_ann_open(-4, 10, 0, 0, &a), KVT_EINVAL);
    assert_int_equal(kvt_ann_open(8, -1, 0, 0, &a), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "capacity -1"));
    assert_int_equal(kvt_ann_open(8, 10, 1, 0, &a), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "M 1"));
    assert_int_equal(kvt_ann_open(8, 10, 0, 0, NULL), KVT_EINVAL);
    assert_int_equal(kvt_ann_open(4, 10, 0, 0, &a), 0);
    float zero[4] = { 0 }, nan4[4] = { 1, NAN, 0, 0 }, ok[4] = { 1, 2, 3, 4 };
    assert_int_equal(kvt_ann_add(a, 7, NULL), KVT_EINVAL);
    assert_int_equal(kvt_ann_add(a, 7, zero), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "id 7"));
    assert_int_equal(kvt_ann_add(a, 7, nan4), KVT_EINVAL);
    assert_int_equal(kvt_ann_add(NULL, 7, ok), KVT_EINVAL);
    assert_int_equal(kvt_ann_size(a), 0);
    assert_int_equal(kvt_ann_add(a, 7, ok), 0);
    uint64_t ids[2];
    float sims[2];
    int32_t n = 0;
    assert_int_equal(kvt_ann_search(a, ok, 0, ids, sims, &n), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "k 0"));
    assert_int_equal(kvt_ann_search(a, ok, -3, ids, sims, &n), KVT_EINVAL);
    assert_int_equal(kvt_ann_search(a, NULL, 2, ids, sims, &n), KVT_EINVAL);
    assert_int_equal(kvt_ann_search(a, ok, 2, NULL, sims, &n), KVT_EINVAL);
    assert_int_equal(kvt_ann_search(a, ok, 2, ids, sims, NULL), KVT_EINVAL);
    assert_int_equal(kvt_ann_search(a, zero, 2, ids, sims, &n), KVT_EINVAL);
    assert_int_equal(kvt_ann_search(NULL, ok, 2, ids, sims, &n), KVT_EINVAL);
    assert_int_equal(kvt_ann_remove(NULL, 7), KVT_EINVAL);
    assert_int_equal(kvt_ann_size(NULL), 0);
    assert_int_equal(kvt_ann_size(a), 1);
    kvt_ann_free(a);
}

/* ---- embedder ------------------------------------------------------------------------- */

static double cosine(const float *a, const float *b, int dim) { return dot(a, b, dim) / (norm(a, dim) * norm(b, dim)); }

static kvt_embedder *g_em; /* Gemma 3 270M, opened once for the group */

static int em_setup(void **state) {
    (void) state;
    const char *m = getenv("KVTIER_MODEL");
    if (!m || !*m) return 0; /* the tests skip */
    int rc = kvt_embedder_open(m, 256, 0, &g_em);
    if (rc) fprintf(stderr, "embedder open %s: %s: %s\n", m, kvt_strerror(rc), kvt_errmsg());
    return rc ? -1 : 0;
}

static int em_teardown(void **state) {
    (void) state;
    kvt_embedder_free(g_em);
    g_em = NULL;
    return 0;
}

static float *embed(kvt_embedder *em, const char *text) {
    int32_t dim = kvt_embedder_dim(em);
    float *v = malloc(sizeof(float) * (size_t) dim);
    assert_non_null(v);
    int rc = kvt_embedder_embed(em, text, v);
    if (rc) fprintf(stderr, "embed: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, 0);
    return v;
}

static const char *VOLCANO_A = "Volcanoes erupt when molten rock from deep inside the Earth rises through the crust.";
static const char *VOLCANO_B = "Lava and ash poured from the volcano as the eruption continued for days.";
static const char *BREAD = "To bake bread, mix flour, water, yeast and salt, then let the dough rise before baking.";

static void test_embed_gemma_basic(void **state) {
    (void) state;
    if (!g_em) skip();
    assert_int_equal(kvt_embedder_dim(g_em), 640);
    float *a = embed(g_em, VOLCANO_A), *a2 = embed(g_em, VOLCANO_A);
    assert_float_equal(norm(a, 640), 1.0, 1e-4);
    assert_memory_equal(a, a2, sizeof(float) * 640); /* cleared between calls: identical */
    float *b = embed(g_em, BREAD), *a3 = embed(g_em, VOLCANO_A);
    assert_memory_equal(a, a3, sizeof(float) * 640); /* also after another text */
    assert_float_equal(norm(b, 640), 1.0, 1e-4);
    free(a);
    free(a2);
    free(b);
    free(a3);
}

static void test_embed_gemma_topic(void **state) {
    (void) state;
    if (!g_em) skip();
    float *va = embed(g_em, VOLCANO_A), *vb = embed(g_em, VOLCANO_B), *br = embed(g_em, BREAD);
    double s_ab = cosine(va, vb, 640), s_a_br = cosine(va, br, 640), s_b_br = cosine(vb, br, 640);
    fprintf(stderr, "cos(volcano, volcano) %.4f  cos(volcano A, bread) %.4f  cos(volcano B, bread) %.4f\n", s_ab, s_a_br, s_b_br);
    assert_true(s_ab > s_a_br);
    assert_true(s_ab > s_b_br);

    /* through the index: a volcano query finds a volcano sentence first */
    static const char *docs[] = {
        "Volcanoes erupt when molten rock from deep inside the Earth rises through the crust.",
        "To bake bread, mix flour, water, yeast and salt, then let the dough rise before baking.",
        "The football match ended in a draw after ninety minutes of play.",
        "Lava and ash poured from the volcano as the eruption continued for days.",
        "The stock market fell sharply as investors sold technology shares.",
    };
    kvt_ann *ann = NULL;
    assert_int_equal(kvt_ann_open(640, 4, 0, 0, &ann), 0);
    for (int i = 0; i < 5; i++) {
        float *v = embed(g_em, docs[i]);
        assert_int_equal(kvt_ann_add(ann, (uint64_t) i, v), 0);
        free(v);
    }
    float *q = embed(g_em, "What happens when a volcano erupts and lava flows?");
    uint64_t ids[5];
    float sims[5];
    int32_t n = 0;
    assert_int_equal(kvt_ann_search(ann, q, 5, ids, sims, &n), 0);
    assert_int_equal(n, 5);
    fprintf(stderr, "volcano query ranks docs:");
    for (int i = 0; i < n; i++) fprintf(stderr, " %d (%.3f)", (int) ids[i], sims[i]);
    fprintf(stderr, "\n");
    assert_true(ids[0] == 0 || ids[0] == 3);
    kvt_ann_free(ann);
    free(q);
    free(va);
    free(vb);
    free(br);
}

/* Text past n_ctx (256 here) tokens is cut: two long texts that differ only after the first
** few hundred words embed identically; the same texts cut short do not. */
static void test_embed_gemma_truncation(void **state) {
    (void) state;
    if (!g_em) skip();
    size_t cap = 64 * 1024;
    char *a = malloc(cap), *b = malloc(cap);
    a[0] = '\0';
    for (int i = 0; i < 400; i++) strcat(a, "mountain river ");
    strcpy(b, a);
    strcat(a, "The end is about cats.");
    strcat(b, "The end is about spaceships and rockets.");
    float *va = embed(g_em, a), *vb = embed(g_em, b);
    assert_memory_equal(va, vb, sizeof(float) * 640);
    free(va);
    free(vb);
    va = embed(g_em, "The end is about cats.");
    vb = embed(g_em, "The end is about spaceships and rockets.");
    assert_true(memcmp(va, vb, sizeof(float) * 640) != 0);
    free(va);
    free(vb);
    free(a);
    free(b);
}

static void test_embed_bad_args(void **state) {
    (void) state;
    kvt_embedder *em = (kvt_embedder *) (uintptr_t) 1;
    const char *missing = "/nonexistent/dir/embedding-model.gguf";
    assert_int_equal(kvt_embedder_open(missing, 0, 0, &em), KVT_EMODEL);
    assert_null(em);
    assert_non_null(strstr(kvt_errmsg(), missing));
    assert_int_equal(kvt_embedder_open(NULL, 0, 0, &em), KVT_EINVAL);
    assert_int_equal(kvt_embedder_open("", 0, 0, &em), KVT_EINVAL);
    assert_int_equal(kvt_embedder_open(missing, 0, -2, &em), KVT_EINVAL);
    assert_int_equal(kvt_embedder_open(missing, 0, 0, NULL), KVT_EINVAL);

    char path[] = "/tmp/kvt_embed_corrupt_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "GGUF\3\0\0\0garbage", 15), 15);
    close(fd);
    assert_int_equal(kvt_embedder_open(path, 0, 0, &em), KVT_EMODEL);
    assert_null(em);
    assert_non_null(strstr(kvt_errmsg(), path));
    unlink(path);

    kvt_embedder_free(NULL);
    assert_int_equal(kvt_embedder_dim(NULL), 0);
    if (!g_em) return;
    float v[640];
    assert_int_equal(kvt_embedder_embed(g_em, "", v), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "empty"));
    assert_int_equal(kvt_embedder_embed(g_em, NULL, v), KVT_EINVAL);
    assert_int_equal(kvt_embedder_embed(g_em, "text", NULL), KVT_EINVAL);
    assert_int_equal(kvt_embedder_embed(NULL, "text", v), KVT_EINVAL);
    /* n_ctx beyond the trained context */
    assert_int_equal(kvt_embedder_open(getenv("KVTIER_MODEL"), 1 << 20, 0, &em), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "1048576"));
}

/* The same plumbing on the tiny generated llama (random weights): no real model needed. */
static void test_embed_tiny(void **state) {
    (void) state;
    const char *d = getenv("KVT_TINY_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny-llama.gguf", d ? d : "tests/models");
    if (access(path, R_OK) != 0) skip();
    kvt_embedder *em = NULL;
    int rc = kvt_embedder_open(path, 64, 1, &em);
    if (rc) fprintf(stderr, "tiny embedder: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, 0);
    int32_t dim = kvt_embedder_dim(em);
    assert_true(dim > 0);
    float *a = embed(em, "hello world"), *b = embed(em, "hello world"), *c = embed(em, "something else entirely");
    assert_float_equal(norm(a, dim), 1.0, 1e-4);
    assert_memory_equal(a, b, sizeof(float) * (size_t) dim);
    assert_true(memcmp(a, c, sizeof(float) * (size_t) dim) != 0);
    free(a);
    free(b);
    free(c);
    kvt_embedder_free(em);
}

int main(void) {
    const struct CMUnitTest ann[] = {
        cmocka_unit_test(test_ann_recall), cmocka_unit_test(test_ann_control_negated_query),
        cmocka_unit_test(test_ann_remove_and_readd), /* last: it removes from the shared index */
    };
    const struct CMUnitTest ann_small[] = {
        cmocka_unit_test(test_ann_replace),
        cmocka_unit_test(test_ann_empty_and_small),
        cmocka_unit_test(test_ann_bad_args),
    };
    const struct CMUnitTest em[] = {
        cmocka_unit_test(test_embed_gemma_basic),
        cmocka_unit_test(test_embed_gemma_topic),
        cmocka_unit_test(test_embed_gemma_truncation),
        cmocka_unit_test(test_embed_bad_args),
        cmocka_unit_test(test_embed_tiny),
    };
    int fails = cmocka_run_group_tests_name("ann", ann, ann_setup, ann_teardown);
    fails += cmocka_run_group_tests_name("ann_small", ann_small, NULL, NULL);
    fails += cmocka_run_group_tests_name("embedder", em, em_setup, em_teardown);
    return fails;
}
