/* Q1: cells per stream, llama_n_ctx / llama_n_ctx_seq, and what happens when a stream is full. */
#include "common.h"
int main(int argc, char **argv) {
    llama_model *m = rs_model(argv[1]);
    n_vocab_g = llama_vocab_n_tokens(llama_model_get_vocab(m));
    printf("model %s n_swa=%d n_ctx_train=%d\n", argv[1], llama_model_n_swa(m), llama_model_n_ctx_train(m));
    int cfg[][3] = { { 1024, 4, 0 }, { 1024, 3, 0 }, { 1000, 3, 0 }, { 300, 1, 0 }, { 256, 8, 0 }, { 1024, 4, 1 } };
    g_show_log = 1;
    for (unsigned i = 0; i < sizeof cfg / sizeof cfg[0]; i++) {
        struct llama_context_params cp = rs_params(cfg[i][0], cfg[i][1], cfg[i][2]);
        printf("request n_ctx=%d n_seq_max=%d kv_unified=%d\n", cfg[i][0], cfg[i][1], cfg[i][2]);
        llama_context *ctx = llama_init_from_model(m, cp);
        printf("  -> llama_n_ctx=%u llama_n_ctx_seq=%u llama_n_seq_max=%u\n", llama_n_ctx(ctx), llama_n_ctx_seq(ctx),
               llama_n_seq_max(ctx));
        llama_free(ctx);
    }
    g_show_log = 0;
    /* full stream: n_ctx=1024, 4 streams of 256 cells */
    llama_context *ctx = llama_init_from_model(m, rs_params(1024, 4, 0));
    llama_memory_t mem = llama_get_memory(ctx);
    llama_token t[512];
    for (int i = 0; i < 512; i++) t[i] = (i * 7 + 3) % n_vocab_g;
    int rc = rs_decode(ctx, 0, t, 256, 0, NULL);
    printf("seq0: decode 256 tokens into a 256-cell stream: rc=%d pos=[%d,%d]\n", rc, llama_memory_seq_pos_min(mem, 0),
           llama_memory_seq_pos_max(mem, 0));
    rc = rs_decode(ctx, 0, t, 1, 256, NULL);
    printf("seq0: one more token (pos 256): rc=%d (1 = no KV slot) pos=[%d,%d]\n", rc, llama_memory_seq_pos_min(mem, 0),
           llama_memory_seq_pos_max(mem, 0));
    rc = rs_decode(ctx, 1, t, 256, 0, NULL);
    printf("seq1: 256 tokens in its own stream meanwhile: rc=%d pos=[%d,%d]\n", rc, llama_memory_seq_pos_min(mem, 1),
           llama_memory_seq_pos_max(mem, 1));
    rc = rs_decode(ctx, 2, t, 300, 0, NULL);
    printf("seq2: one batch of 300 tokens (> 256 cells): rc=%d pos_max=%d\n", rc, llama_memory_seq_pos_max(mem, 2));
    llama_memory_seq_rm(mem, 0, 0, 16);
    rc = rs_decode(ctx, 0, t, 1, 256, NULL);
    printf("seq0 after seq_rm [0,16): one more token: rc=%d pos=[%d,%d]\n", rc, llama_memory_seq_pos_min(mem, 0),
           llama_memory_seq_pos_max(mem, 0));
    llama_free(ctx);
    llama_model_free(m);
    return 0;
}
