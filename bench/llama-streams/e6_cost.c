/* Q6: cost of whole-sequence llama_state_seq_get_data + set_data, 512 tokens, Gemma 3 270M (Q4_K_M
** weights, F16 KV), kv_unified=false, 4 streams.  5 repeats, median.  Indicative only (shared 2-core box). */
#include "common.h"
static int cmpd(const void *a, const void *b) {
    double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}
static double med(double *v, int n) {
    qsort(v, n, sizeof *v, cmpd);
    return v[n / 2];
}
int main(int argc, char **argv) {
    llama_model *m = rs_model(argv[1]);
    n_vocab_g = llama_vocab_n_tokens(llama_model_get_vocab(m));
    llama_token T[512];
    for (int i = 0; i < 512; i++) T[i] = 1000 + (i * 37) % 20000;
    for (int fa = 0; fa < 2; fa++) {
        struct llama_context_params cp = rs_params(4096, 4, 0);
        cp.type_k = GGML_TYPE_F16;
        cp.type_v = GGML_TYPE_F16;
        cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        llama_context *ctx = llama_init_from_model(m, cp);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int rc = rs_decode(ctx, 0, T, 512, 0, NULL);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        printf("flash_attn=%d (v_trans=%d): prefill 512 tokens rc=%d in %.0f ms\n", fa, !fa, rc, rs_ms(t0, t1));
        double g[5], s[5], a[5], sz[5];
        size_t n = 0;
        uint8_t *b = NULL;
        for (int r = 0; r < 5; r++) {
            clock_gettime(CLOCK_MONOTONIC, &t0);
            n = llama_state_seq_get_size(ctx, 0);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            sz[r] = rs_ms(t0, t1);
            if (!b) b = malloc(n);
            clock_gettime(CLOCK_MONOTONIC, &t0);
            llama_state_seq_get_data(ctx, b, n, 0);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            g[r] = rs_ms(t0, t1);
            clock_gettime(CLOCK_MONOTONIC, &t0);
            size_t rd = llama_state_seq_set_data(ctx, b, n, 1); /* replaces seq 1's cells from r = 1 on */
            clock_gettime(CLOCK_MONOTONIC, &t1);
            s[r] = rs_ms(t0, t1);
            if (rd != n) printf("  set_data read %zu of %zu\n", rd, n);
            /* host-side re-assembly of the whole blob (slice + concatenate, no RoPE) */
            struct rs_blob B;
            rs_parse(b, n, 2, &B);
            struct rs_piece p0 = { &B.part[0].rec[0], 0, B.part[0].rec[0].nc, 0 },
                            p1 = { &B.part[1].rec[0], 0, B.part[1].rec[0].nc, 0 };
            struct rs_piece *pp[2] = { &p0, &p1 };
            int npc[2] = { 1, 1 };
            clock_gettime(CLOCK_MONOTONIC, &t0);
            size_t na;
            uint8_t *ba = rs_assemble(2, 4, 1, 1, pp, npc, NULL, 0, &na);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            a[r] = rs_ms(t0, t1);
            free(ba);
        }
        rs_describe("blob", b, n, 2);
        printf("  median of 5: get_size %.2f ms, get_data %.2f ms, set_data %.2f ms, host re-assembly %.2f ms  (blob %.2f MiB)\n",
               med(sz, 5), med(g, 5), med(s, 5), med(a, 5), n / 1048576.0);
        free(b);
        llama_free(ctx);
    }
    llama_model_free(m);
    return 0;
}
