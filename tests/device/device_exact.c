/* device_exact — kvtier with the layers and KV cells on a device (Vulkan, CUDA) against the CPU
** in the same run (ctest label "device", through tests/device/run.sh).
**
** For each tiny model (llama; Gemma 3 with sliding window), F16 and F32 cache, flash attention
** off and on:
**   1. the device engine offloads every layer (checked when KVT_EXPECT_DEVICE is set: a device
**      test never passes on the CPU by accident);
**   2. a whole-sequence save, evict and load back at the same positions on the device gives the
**      same next-token logits, bit for bit: the state crosses device -> host -> device losslessly;
**   3. the device's next-token logits after a 96-token prompt equal the CPU's within a noise
**      floor measured in this run: each backend's own gap between two evaluations that are equal
**      in exact arithmetic, the prompt at positions 0.. and at 1000.. (RoPE is relative; the
**      float sin/cos of larger angles are not).  (The prompt in one decode or in three of 32
**      tokens gives bit-equal logits on both lavapipe and the CPU: not a floor.)  The bound is 3x
**      the larger floor plus 1e-5 x max|logit|: the device's error has a source the position
**      floor does not see (lavapipe rounds matmul inputs to F16: device_attention measures it),
**      and lavapipe came to 1.9x its floor (F32 cache, 0.041 against 0.022).  A control (one
**      prompt token changed, 0.9-2.4) must exceed the bound.  The CPU engine keeps large batches
**      on the CPU (no_op_offload: llama.cpp would send them to the device otherwise). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* kvt_seq_n_cells: the library's internal calls, as the unit tests use them */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 96 };

static kvt_engine *open_on(const char *name, int ngl, const char *type, bool fa) {
    char path[1024];
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(path, sizeof path, "%s/%s.gguf", d ? d : "tests/models", name);
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 512;
    p.type_k = p.type_v = type;
    p.n_gpu_layers = ngl;
    p.flash_attn = fa ? KVT_FLASH_ATTN_ON : KVT_FLASH_ATTN_OFF;
    p.no_op_offload = ngl == 0; /* the CPU reference computes on the CPU, large batches too */
    kvt_engine *e = NULL;
    int rc = kvt_engine_open(&p, &e);
    if (rc) fprintf(stderr, "open %s: %s\n", path, kvt_errmsg());
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

/* next-token logits after T[0..N) decoded at positions p0.. (sequence 0 cleared first) */
static void prompt_logits(kvt_engine *e, const kvt_token *T, kvt_pos p0, float *out, int nv) {
    kvt_seq_rm(e, 0, -1, -1);
    assert_int_equal(kvt_engine_decode(e, 0, T, N, p0, true), 0);
    memcpy(out, kvt_engine_logits(e), sizeof(float) * (size_t) nv);
}

static void check(const char *model, const char *type, bool fa) {
    kvt_engine *cpu = open_on(model, 0, type, fa), *dev = open_on(model, -1, type, fa);
    struct kvt_engine_info Ic, Id;
    kvt_engine_info(cpu, &Ic);
    kvt_engine_info(dev, &Id);
    assert_int_equal(Ic.n_layer_device, 0);
    if (getenv("KVT_EXPECT_DEVICE")) {
        assert_int_equal(Id.n_layer_device, Id.n_layer);
        assert_true(strcmp(Id.device, "CPU") != 0);
    }
    assert_int_equal(Id.flash_attn, fa);
    const int nv = Id.n_vocab;
    float *a = malloc(sizeof(float) * (size_t) nv), *b = malloc(sizeof(float) * (size_t) nv);
    float *c = malloc(sizeof(float) * (size_t) nv), *x = malloc(sizeof(float) * (size_t) nv);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(c);
    assert_non_null(x);
    kvt_token T[N + 1];
    toks(T, N + 1, 17);

    /* 2. save / evict / load back on the device: bit-equal */
    prompt_logits(dev, T, 0, a, nv);
    kvt_blob *all = NULL;
    assert_int_equal(kvt_block_save(dev, 0, 0, N, &all), 0);
    kvt_seq_rm(dev, 0, -1, -1);
    assert_int_equal(kvt_seq_n_cells(dev, 0), 0);
    assert_int_equal(kvt_block_load(dev, all, 0, 0), 0);
    kvt_blob_free(all);
    assert_int_equal(kvt_engine_decode(dev, 0, T + N, 1, N, true), 0);
    memcpy(b, kvt_engine_logits(dev), sizeof(float) * (size_t) nv);
    prompt_logits(dev, T, 0, c, nv); /* reference: the same N + 1 tokens without the round trip */
    assert_int_equal(kvt_engine_decode(dev, 0, T + N, 1, N, true), 0);
    const double d_round = max_abs_diff(b, kvt_engine_logits(dev), nv);

    /* 3. device against CPU within the floors */
    prompt_logits(dev, T, 0, a, nv);
    prompt_logits(dev, T, 1000, b, nv);
    const double floor_dev = max_abs_diff(a, b, nv);
    prompt_logits(cpu, T, 0, c, nv);
    prompt_logits(cpu, T, 1000, b, nv);
    const double floor_cpu = max_abs_diff(c, b, nv);
    double lmax = 0;
    for (int i = 0; i < nv; i++) lmax = fmax(lmax, fabs(c[i]));
    const double d_cross = max_abs_diff(a, c, nv);
    const double bound = 3 * fmax(floor_dev, floor_cpu) + 1e-5 * lmax;
    kvt_token U[N];
    memcpy(U, T, sizeof U);
    U[N / 2] = (kvt_token) (U[N / 2] + 1); /* control: another prompt, on the CPU */
    prompt_logits(cpu, U, 0, x, nv);
    const double d_ctl = max_abs_diff(x, c, nv);
    printf("  %-11s K/V %s fa %-3s on %s: round trip %.3g; floors: device %.3g, CPU %.3g; device vs CPU %.3g "
           "(bound %.3g, max|logit| %.3g); control (one token changed) %.3g\n",
           model, type, fa ? "on" : "off", Id.device, d_round, floor_dev, floor_cpu, d_cross, bound, lmax, d_ctl);
    assert_true(d_round == 0.0);
    assert_true(d_cross <= bound);
    assert_true(d_ctl > bound);
    free(a);
    free(b);
    free(c);
    free(x);
    kvt_engine_free(cpu);
    kvt_engine_free(dev);
}

static void test_llama(void **st) {
    (void) st;
    check("tiny-llama", "f16", false);
    check("tiny-llama", "f32", false);
    check("tiny-llama", "f16", true);
}

static void test_gemma3_swa(void **st) {
    (void) st;
    check("tiny-gemma3", "f16", false);
    check("tiny-gemma3", "f16", true);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama),
        cmocka_unit_test(test_gemma3_swa),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
