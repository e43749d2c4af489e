/* test_attention — captured attention is softmax over the right token positions.
**
** After evictions (holes) and a block loaded at the tail, the captured per-head attention of a
** ubatch must (1) have rows summing to 1, (2) list exactly the resident positions the query can
** see, and (3) equal softmax(q.k / sqrt(d)) recomputed on the host from the captured Q and the
** K rows of a save of the whole sequence, matched by position.  A control pairs the same Q/K with
** positions shifted by one block and must fail the comparison.  Every check runs with a unified
** KV cache and with one KV stream per sequence (there the columns are the sequence's own
** stream's cells); rows of a multi-sequence batch are refused, not mis-mapped.  Both modes run
** again with flash attention on: llama.cpp's softmax is fused there, and the capture recomputes
** the rows on the host from the fused op's inputs (F16 K and V, so the reference reads the same
** K values the op did).  Where a device backend is visible (tests/CMakeLists.txt, label
** "device") the same checks run with the layers and KV cells on the device; there the tolerance
** is at least 2x the gap F16 rounding of Q and K makes in the host's softmax, measured in the
** run (a device's matmul may round its inputs). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */
#include "test_hooks.h" /* kvt_engine_test_cell_pos_snapshot(s) */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool g_kv_unified = true; /* the cache mode of the group being run */
static bool g_flash = false;     /* flash attention in the group being run */

static int mode_unified(void **st) {
    (void) st;
    g_kv_unified = true;
    g_flash = false;
    return 0;
}
static int mode_streams(void **st) {
    (void) st;
    g_kv_unified = false;
    g_flash = false;
    return 0;
}
static int mode_unified_fa(void **st) {
    (void) st;
    g_kv_unified = true;
    g_flash = true;
    return 0;
}
static int mode_streams_fa(void **st) {
    (void) st;
    g_kv_unified = false;
    g_flash = true;
    return 0;
}

static void set_mode(struct kvt_engine_params *p) {
    p->kv_unified = g_kv_unified;
    p->flash_attn = g_flash ? KVT_FLASH_ATTN_ON : KVT_FLASH_ATTN_OFF;
    p->type_k = p->type_v = g_flash ? "f16" : "f32";
}

static kvt_engine *open_tiny(const char *name) {
    char path[1024];
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(path, sizeof path, "%s/%s.gguf", d ? d : "tests/models", name);
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 1024;
    set_mode(&p);
    kvt_engine *e = NULL;
    assert_int_equal(kvt_engine_open(&p, &e), 0);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    assert_int_equal(I.flash_attn, g_flash);
    return e;
}

static void toks(kvt_token *t, int n, unsigned seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        t[i] = (kvt_token) (3 + (seed >> 8) % 500);
    }
}

static double half(double x) { return (double) (float) (_Float16) x; }

/* host attention of query t, head h over the given keys; returns max |diff| against a->w, or
** with half_floor, against the same host attention computed from Q and K rounded to F16 (the
** precision a device's matmul may use: the noise floor for a device's softmax) */
static double host_check(const kvt_attn *a, const float *K, const kvt_pos *Kpos, int32_t n_cells, int32_t row, int n_head_kv,
                         int n_swa, int pos_shift, bool half_floor) {
    const int hd = a->head_dim, group = a->n_head / n_head_kv;
    double worst = 0;
    double *sc = malloc(sizeof(double) * (size_t) n_cells), *sh = malloc(sizeof(double) * (size_t) n_cells);
    for (int t = n_swa > 0 ? a->n_query - 1 : 0; t < a->n_query; t++)
        for (int h = 0; h < a->n_head; h++) {
            const float *q = a->q + ((size_t) t * a->n_head + h) * hd;
            double mx = -INFINITY, z = 0, mxh = -INFINITY, zh = 0;
            for (int32_t c = 0; c < n_cells; c++) {
                kvt_pos p = Kpos[c] + pos_shift;
                bool vis = p <= a->q_pos[t] && (n_swa <= 0 || a->q_pos[t] - p < n_swa);
                if (!vis) {
                    sc[c] = sh[c] = -INFINITY;
                    continue;
                }
                const float *k = K + (size_t) c * row + (size_t) (h / group) * hd;
                double dot = 0, doth = 0;
                for (int d = 0; d < hd; d++) {
                    dot += (double) q[d] * k[d];
                    doth += half(q[d]) * half(k[d]);
                }
                sc[c] = dot / sqrt((double) hd);
                sh[c] = doth / sqrt((double) hd);
                mx = fmax(mx, sc[c]);
                mxh = fmax(mxh, sh[c]);
            }
            for (int32_t c = 0; c < n_cells; c++) z += sc[c] == -INFINITY ? 0 : exp(sc[c] - mx);
            for (int32_t c = 0; c < n_cells; c++) zh += sh[c] == -INFINITY ? 0 : exp(sh[c] - mxh);
            for (int32_t c = 0; c < n_cells; c++) {
                double w = sc[c] == -INFINITY ? 0 : exp(sc[c] - mx) / z;
                if (half_floor) {
                    worst = fmax(worst, fabs(w - (sh[c] == -INFINITY ? 0 : exp(sh[c] - mxh) / zh)));
                    continue;
                }
                /* find this position among the captured keys */
                double got = 0;
                for (int k = 0; k < a->n_keys; k++)
                    if (a->k_pos[k] == Kpos[c] + pos_shift) got = a->w[((size_t) t * a->n_head + h) * a->n_keys + k];
                worst = fmax(worst, fabs(w - got));
            }
        }
    free(sc);
    free(sh);
    return worst;
}

static void run(const char *model, const int32_t *layers, int n_layers) {
    kvt_engine *e = open_tiny(model);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    assert_int_equal(kvt_attn_capture(e, layers, n_layers, true), 0);
    kvt_token T[160];
    toks(T, 160, 11);
    /* 100 tokens, evict [20,50), move [60,80) to the tail at 100 via save/evict/load.  The block is
    ** saved as soon as it is decoded, while its sliding-window cells exist (kvt_block_save) */
    assert_int_equal(kvt_engine_decode(e, 0, T, 80, 0, false), 0);
    kvt_blob *b = NULL;
    assert_int_equal(kvt_block_save(e, 0, 60, 80, &b), 0);
    assert_int_equal(kvt_engine_decode(e, 0, T + 80, 20, 80, false), 0);
    kvt_seq_rm(e, 0, 20, 50);
    kvt_seq_rm(e, 0, 60, 80);
    assert_int_equal(kvt_block_load(e, b, 0, 100), 0);
    kvt_blob_free(b);
    assert_int_equal(kvt_engine_decode(e, 0, T + 120, 8, 120, false), 0);
    /* the resident positions, for checking the key list */
    kvt_pos expect[128];
    int n_expect = 0;
    for (kvt_pos p = 0; p < 128; p++)
        if (p < 20 || (p >= 50 && p < 60) || (p >= 80 && p < 128)) expect[n_expect++] = p;
    /* one save of the whole sequence gives every cell's K and position */
    kvt_blob *all = NULL;
    assert_int_equal(kvt_block_save(e, 0, 0, 1000, &all), 0);
    for (int li = 0; li < n_layers; li++) {
        kvt_attn *a = NULL;
        int rc = kvt_attn_get(e, layers[li], 0, &a);
        if (rc) fprintf(stderr, "attn_get: %s\n", kvt_errmsg());
        assert_int_equal(rc, 0);
        assert_int_equal(a->n_query, 8);
        assert_int_equal(a->n_head, I.n_head);
        assert_non_null(a->q);
        int part, idx;
        assert_int_equal(kvt_engine_layer_part(e, layers[li], &part, &idx), 0);
        const int n_swa = part == 1 ? I.n_swa : 0;
        /* keys: exactly the resident positions some query can see, ascending */
        int n_vis = 0;
        for (int i = 0; i < n_expect; i++)
            if (n_swa <= 0 || a->q_pos[7] - expect[i] < n_swa) {
                assert_true(n_vis < a->n_keys);
                assert_int_equal(a->k_pos[n_vis], expect[i]);
                n_vis++;
            }
        assert_int_equal(n_vis, a->n_keys);
        /* rows sum to 1 (SWA layers: the last row; earlier rows lost keys that left the window) */
        for (int t = n_swa > 0 ? a->n_query - 1 : 0; t < a->n_query; t++)
            for (int h = 0; h < a->n_head; h++) {
                double sum = 0;
                for (int k = 0; k < a->n_keys; k++) sum += a->w[((size_t) t * a->n_head + h) * a->n_keys + k];
                assert_true(fabs(sum - 1.0) < 1e-4);
            }
        /* the same map from a whole snapshot of the sequence (the reference of the cell records) */
        kvt_engine_test_cell_pos_snapshot(e, true);
        kvt_attn *ref = NULL;
        assert_int_equal(kvt_attn_get(e, layers[li], 0, &ref), 0);
        kvt_engine_test_cell_pos_snapshot(e, false);
        assert_int_equal(ref->n_keys, a->n_keys);
        assert_memory_equal(ref->k_pos, a->k_pos, sizeof(kvt_pos) * (size_t) a->n_keys);
        assert_memory_equal(ref->w, a->w, sizeof(float) * (size_t) a->n_query * a->n_head * a->n_keys);
        kvt_attn_free(ref);
        float *K = NULL;
        kvt_pos *Kp = NULL;
        int32_t nc = 0, row = 0;
        assert_int_equal(kvt_blob_k_rows(e, all, part, idx, &K, &Kp, &nc, &row), 0);
        double d = host_check(a, K, Kp, nc, row, I.n_head_kv, n_swa, 0, false);
        double ctl = host_check(a, K, Kp, nc, row, I.n_head_kv, n_swa, 10, false); /* wrong position map */
        /* on a device whose matmul rounds Q and K to F16 (lavapipe: up to 4e-4 with flash attention
        ** off; the host recomputation with it on reads the op's inputs and stays at 1e-6) */
        double tol = 1e-4;
        if (I.n_layer_device > 0) {
            double f16 = host_check(a, K, Kp, nc, row, I.n_head_kv, n_swa, 0, true);
            tol = fmax(tol, 2 * f16);
            printf("  %-12s layer %d on %s: F16 rounding floor %.2g\n", model, layers[li], I.device, f16);
        }
        printf("  %-12s layer %d (%s): %d keys, max|w - host softmax(qk)| = %.2g (tolerance %.2g); control with shifted "
               "positions %.2g\n",
               model, layers[li], part ? "SWA" : "full", a->n_keys, d, tol, ctl);
        assert_true(d < tol);
        assert_true(ctl > 10 * tol);
        free(K);
        free(Kp);
        kvt_attn_free(a);
    }
    /* every map above came from the cell records, none from a snapshot (the reference's aside) */
    assert_int_equal(kvt_engine_test_cell_pos_snapshots(e), n_layers);
    /* the capture is tied to the cache state it saw */
    kvt_seq_rm(e, 0, 0, 1);
    kvt_attn *stale = NULL;
    assert_int_equal(kvt_attn_get(e, layers[0], 0, &stale), KVT_ENOENT);
    kvt_blob_free(all);
    kvt_engine_free(e);
}

static void test_llama(void **st) {
    (void) st;
    const int32_t layers[] = { 0, 3, 5 };
    run("tiny-llama", layers, 3);
}

static void test_gemma3_swa(void **st) {
    (void) st;
    const int32_t layers[] = { 0, 5 }; /* sliding-window layer 0, full-attention layer 5 */
    run("tiny-gemma3", layers, 2);
}

static void test_capture_errors(void **st) {
    (void) st;
    kvt_engine *e = open_tiny("tiny-llama");
    const int32_t bad[] = { 99 };
    assert_int_equal(kvt_attn_capture(e, bad, 1, false), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "99"));
    kvt_attn *a = NULL;
    assert_int_equal(kvt_attn_get(e, 1, 0, &a), KVT_ENOENT);
    kvt_engine_free(e);
}

/* A multi-sequence batch (a rows-only decode batch) puts several sequences in one ubatch; its rows are not
** captured, and kvt_attn_get says so for those sequences instead of mapping another ubatch. */
static void test_multi_sequence_refused(void **st) {
    (void) st;
    kvt_engine *e = NULL;
    {
        char path[1024];
        const char *d = getenv("KVT_TINY_DIR");
        snprintf(path, sizeof path, "%s/%s.gguf", d ? d : "tests/models", "tiny-gemma3");
        struct kvt_engine_params p = kvt_engine_default_params();
        p.model_path = path;
        p.n_ctx = 1024;
        p.n_seq = 2;
        set_mode(&p);
        assert_int_equal(kvt_engine_open(&p, &e), 0);
    }
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    const int32_t layers[] = { 0, 5 };
    assert_int_equal(kvt_attn_capture(e, layers, 2, false), 0);
    kvt_token T[40];
    toks(T, 40, 3);
    assert_int_equal(kvt_engine_decode(e, 0, T, 20, 0, false), 0);
    assert_int_equal(kvt_engine_decode(e, 1, T + 20, 12, 0, false), 0);
    kvt_attn *a = NULL;
    assert_int_equal(kvt_attn_get(e, 5, 1, &a), 0); /* the last kvt_engine_decode: sequence 1 */
    assert_int_equal(a->n_query, 12);
    kvt_attn_free(a);
    const int32_t seqs[2] = { 0, 1 };
    const kvt_token tk[2] = { T[30], T[31] };
    const kvt_pos pos[2] = { 20, 12 };
    float *logits = malloc(sizeof(float) * 2 * (size_t) I.n_vocab);
    assert_int_equal(kvt_engine_decode_batch(e, seqs, tk, pos, 2, logits, NULL), 0);
    for (int s = 0; s < 2; s++) {
        a = NULL;
        assert_int_equal(kvt_attn_get(e, 5, s, &a), KVT_EUNSUPPORTED);
        assert_null(a);
        assert_non_null(strstr(kvt_errmsg(), "kvt_engine_decode_batch"));
    }
    /* the next single-sequence decode is captured again */
    assert_int_equal(kvt_engine_decode(e, 0, T + 32, 3, 21, false), 0);
    assert_int_equal(kvt_attn_get(e, 0, 0, &a), 0);
    assert_int_equal(a->n_query, 3);
    assert_int_equal(a->q_pos[0], 21);
    kvt_attn_free(a);
    free(logits);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama),
        cmocka_unit_test(test_gemma3_swa),
        cmocka_unit_test(test_capture_errors),
        cmocka_unit_test(test_multi_sequence_refused),
    };
    int failed = cmocka_run_group_tests_name("unified KV cache", tests, mode_unified, NULL);
    failed += cmocka_run_group_tests_name("one KV stream per sequence", tests, mode_streams, NULL);
    failed += cmocka_run_group_tests_name("unified KV cache, flash attention", tests, mode_unified_fa, NULL);
    failed += cmocka_run_group_tests_name("one KV stream per sequence, flash attention", tests, mode_streams_fa, NULL);
    return failed;
}
