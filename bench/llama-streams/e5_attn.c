/* Q5: kq_soft_max layout when one ubatch holds tokens of several streams (kv_unified=false).
** Tiny Gemma 3 (layer 5 = full attention, layers 0-4 SWA), 4 streams, FA off. */
#include "common.h"
static int want_layer = 5, verbose = 1, n_calls = 0;
static bool cb(struct ggml_tensor *t, bool ask, void *ud) {
    (void) ud;
    char nm[64];
    snprintf(nm, sizeof nm, "kq_soft_max-%d", want_layer);
    int is_sm = strcmp(t->name, nm) == 0;
    char kn[32];
    snprintf(kn, sizeof kn, "cache_k_l%d ", want_layer);
    int is_sr = t->op == GGML_OP_SET_ROWS && strncmp(t->name, kn, strlen(kn)) == 0;
    if (ask) return is_sm || is_sr;
    if (!verbose) {
        if (is_sm) n_calls++;
        return true;
    }
    if (is_sr) {
        const struct ggml_tensor *ix = t->src[1];
        printf("    SET_ROWS %s: %s (global row = stream*kv_size + cell) =", t->name, ix->name);
        for (int64_t i = 0; i < ix->ne[0]; i++) printf(" %lld", (long long) ((const int64_t *) ix->data)[i]);
        printf("\n");
        return true;
    }
    n_calls++;
    const struct ggml_tensor *mk = t->src[1];
    printf("    %s: ne=[n_kv=%lld, n_tps=%lld, n_head=%lld, n_stream=%lld]  mask %s ne=[%lld,%lld,%lld,%lld]\n", t->name,
           (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3], mk->name, (long long) mk->ne[0],
           (long long) mk->ne[1], (long long) mk->ne[2], (long long) mk->ne[3]);
    for (int64_t s = 0; s < t->ne[3]; s++)
        for (int64_t r = 0; r < t->ne[1]; r++) {
            const float *row = (const float *) ((const char *) t->data + s * t->nb[3] + r * t->nb[1]); /* head 0 */
            int first = -1, last = -1, cnt = 0;
            double sum = 0;
            for (int64_t j = 0; j < t->ne[0]; j++)
                if (row[j] > 0) {
                    if (first < 0) first = (int) j;
                    last = (int) j;
                    cnt++;
                    sum += row[j];
                }
            printf("      stream-block %lld row %lld: %d nonzero columns, cells %d..%d, row sum %.4f\n", (long long) s,
                   (long long) r, cnt, first, last, sum);
        }
    return true;
}
static llama_token T[64];
static void mixed(llama_context *ctx, const int *seq, const int *pos, int n, float *out) {
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = T[(seq[i] * 11 + pos[i]) % 64];
        b.pos[i] = pos[i];
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = seq[i];
        b.logits[i] = 1;
    }
    b.n_tokens = n;
    n_calls = 0;
    int rc = llama_decode(ctx, b);
    printf("    -> rc=%d, %d kq_soft_max-%d callbacks (one per ubatch)\n", rc, n_calls, want_layer);
    if (out)
        for (int i = 0; i < n; i++) memcpy(out + (size_t) i * n_vocab_g, llama_get_logits_ith(ctx, i), 4 * n_vocab_g);
    llama_batch_free(b);
}
static void prefill(llama_context *ctx, int seq, int n) {
    llama_token t[32];
    for (int i = 0; i < n; i++) t[i] = T[(seq * 11 + i) % 64];
    rs_decode(ctx, seq, t, n, 0, NULL);
}
int main(int argc, char **argv) {
    llama_model *m = rs_model(argv[1]);
    n_vocab_g = llama_vocab_n_tokens(llama_model_get_vocab(m));
    for (int i = 0; i < 64; i++) T[i] = (i * 29 + 3) % n_vocab_g;
    struct llama_context_params cp = rs_params(2048, 4, 0);
    cp.cb_eval = cb;
    llama_context *ctx = llama_init_from_model(m, cp);
    verbose = 0;
    prefill(ctx, 0, 10);
    prefill(ctx, 1, 3);
    prefill(ctx, 2, 5);
    verbose = 1;
    printf("== batch (seq,pos): (1,3) (0,10) (1,4) (0,11): first token is seq 1 -> seq 0 cannot join (ids must ascend from the "
           "first)\n");
    int s1[] = { 1, 0, 1, 0 }, p1[] = { 3, 10, 4, 11 };
    float *lg = malloc(sizeof(float) * 4 * n_vocab_g);
    mixed(ctx, s1, p1, 4, lg);
    llama_memory_seq_rm(llama_get_memory(ctx), 0, 10, -1);
    llama_memory_seq_rm(llama_get_memory(ctx), 1, 3, -1);
    printf("== same tokens, batch order (0,10) (0,11) (1,3) (1,4): one ubatch, two stream blocks\n");
    int s1b[] = { 0, 0, 1, 1 }, p1b[] = { 10, 11, 3, 4 };
    mixed(ctx, s1b, p1b, 4, NULL);
    printf("== batch (0,12) (0,13) (0,14) (1,5): unequal counts -> ubatches {1 token of seq0 + 1 of seq1}, then {2 of seq0}\n");
    int s2[] = { 0, 0, 0, 1 }, p2[] = { 12, 13, 14, 5 };
    mixed(ctx, s2, p2, 4, NULL);
    printf("== batch (0,15) (2,5): non-consecutive seq ids -> one ubatch per sequence\n");
    int s3[] = { 0, 2 }, p3[] = { 15, 5 };
    mixed(ctx, s3, p3, 2, NULL);
    printf("== SWA layer 0 (n_swa = 32), batch (1,6) (2,6)\n");
    want_layer = 0;
    int s4[] = { 1, 2 }, p4[] = { 6, 6 };
    mixed(ctx, s4, p4, 2, NULL);
    /* logits of the first mixed batch vs. each sequence decoded alone in a fresh context */
    verbose = 0;
    want_layer = 5;
    llama_context *c2 = llama_init_from_model(m, cp);
    prefill(c2, 0, 10);
    prefill(c2, 1, 3);
    prefill(c2, 2, 5);
    float *ref = malloc(sizeof(float) * 4 * n_vocab_g);
    int a0[] = { 0, 0 }, q0[] = { 10, 11 }, a1[] = { 1, 1 }, q1[] = { 3, 4 };
    mixed(c2, a1, q1, 2, ref);                          /* ref[0]=(1,3) ref[1]=(1,4) */
    mixed(c2, a0, q0, 2, ref + 2 * (size_t) n_vocab_g); /* ref[2]=(0,10) ref[3]=(0,11) */
    int map[4] = { 0, 2, 1, 3 };
    double md = 0;
    for (int i = 0; i < 4; i++) {
        double d = rs_maxdiff(lg + (size_t) i * n_vocab_g, ref + (size_t) map[i] * n_vocab_g, n_vocab_g);
        if (d > md) md = d;
    }
    printf("llama_get_logits_ith(batch index) of the mixed batch vs the same tokens decoded per sequence: max|d|=%.3g\n", md);
    free(lg);
    free(ref);
    llama_free(c2);
    llama_free(ctx);
    llama_model_free(m);
    return 0;
}
