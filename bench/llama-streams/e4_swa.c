/* Q4: SWA cells per stream (tiny Gemma 3, n_swa = 32), kv_unified=false, n_ubatch = 64 so that the
** per-stream SWA cache (pad256(min(n_ctx_seq, n_swa + n_ubatch)) = 256) is smaller than the sequence. */
#include "common.h"
static llama_token T[1024];
int main(int argc, char **argv) {
    llama_model *m = rs_model(argv[1]);
    n_vocab_g = llama_vocab_n_tokens(llama_model_get_vocab(m));
    for (int i = 0; i < 1024; i++) T[i] = (i * 17 + 1) % n_vocab_g;
    float *ref = malloc(4 * n_vocab_g), *out = malloc(4 * n_vocab_g);
    struct llama_context_params cp = rs_params(2048, 4, 0);
    cp.n_ubatch = 64;
    cp.n_batch = 64;
    g_show_log = 1;
    llama_context *ctx = llama_init_from_model(m, cp);
    g_show_log = 0;
    llama_memory_t mem = llama_get_memory(ctx);
    for (int i = 0; i < 400; i += 50) rs_decode(ctx, 0, T + i, 50, i, NULL);
    rs_decode(ctx, 2, T + 500, 20, 0, NULL);
    printf("seq 0: 400 tokens; llama_memory_seq_pos_min/max = %d/%d (iSWA reports the SWA cache)\n",
           llama_memory_seq_pos_min(mem, 0), llama_memory_seq_pos_max(mem, 0));
    size_t n;
    uint8_t *b = rs_save(ctx, 0, &n);
    rs_describe("seq 0 blob", b, n, 2);
    size_t np_ = llama_state_seq_get_size_ext(ctx, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    uint8_t *bp = malloc(np_);
    llama_state_seq_get_data_ext(ctx, bp, np_, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    rs_describe("seq 0 blob, PARTIAL_ONLY flag (SWA part only)", bp, np_, 1);
    rs_decode(ctx, 0, T + 400, 1, 400, ref);
    llama_memory_seq_rm(mem, 0, 400, -1);
    size_t r = llama_state_seq_set_data(ctx, b, n, 1);
    printf("restore into seq 1: read %zu/%zu, seq 1 pos=[%d,%d]\n", r, n, llama_memory_seq_pos_min(mem, 1),
           llama_memory_seq_pos_max(mem, 1));
    rs_decode(ctx, 1, T + 400, 1, 400, out);
    printf("next token seq 1 (restored) vs seq 0: max|d|=%.3g\n", rs_maxdiff(ref, out, n_vocab_g));
    size_t n2;
    uint8_t *b2 = rs_save(ctx, 2, &n2);
    rs_describe("seq 2 blob (its stream untouched by seq 0/1 traffic)", b2, n2, 2);
    /* a blob whose SWA part was dropped on the host: the sequence loses its local context */
    {
        struct rs_blob B;
        rs_parse(b, n, 2, &B);
        struct rs_piece p0 = { &B.part[0].rec[0], 0, B.part[0].rec[0].nc, 0 };
        struct rs_piece *pp[2] = { &p0, NULL };
        int npc[2] = { 1, 0 };
        size_t na;
        uint8_t *ba = rs_assemble(2, 4, 0, 3, pp, npc, NULL, 0, &na);
        r = llama_state_seq_set_data(ctx, ba, na, 3);
        printf("blob without SWA cells -> seq 3: read %zu/%zu, seq_pos_max=%d (base part restored, SWA empty)\n", r, na,
               llama_memory_seq_pos_max(mem, 3));
        int rc = rs_decode(ctx, 3, T + 400, 1, 400, out);
        printf("  decode at 400: rc=%d, max|d| vs correct=%.3g (silently wrong: no local context)\n", rc,
               rs_maxdiff(ref, out, n_vocab_g));
        free(ba);
    }
    free(b);
    free(bp);
    free(b2);
    free(ref);
    free(out);
    llama_free(ctx);
    llama_model_free(m);
    return 0;
}
