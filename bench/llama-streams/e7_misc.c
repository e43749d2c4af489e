/* Q7: a set_data that does not fit the stream; llama_memory_clear across streams.
** Tiny Gemma 3, n_ctx 1024 / 4 streams = 256 cells per stream (base and SWA). */
#include "common.h"
static llama_token T[512];
static int show_idx = 0;
static bool cb(struct ggml_tensor *t, bool ask, void *ud) {
    (void) ud;
    int hit = t->op == GGML_OP_SET_ROWS && strncmp(t->name, "cache_k_l5 ", 11) == 0;
    if (ask) return hit;
    if (hit && show_idx)
        printf("    next token written to global row %lld of layer 5's K (= stream*256 + cell)\n",
               (long long) ((const int64_t *) t->src[1]->data)[0]);
    return true;
}
int main(int argc, char **argv) {
    llama_model *m = rs_model(argv[1]);
    n_vocab_g = llama_vocab_n_tokens(llama_model_get_vocab(m));
    for (int i = 0; i < 512; i++) T[i] = (i * 19 + 2) % n_vocab_g;
    float *ref = malloc(4 * n_vocab_g), *out = malloc(4 * n_vocab_g);
    struct llama_context_params cp = rs_params(1024, 4, 0);
    cp.cb_eval = cb;
    llama_context *ctx = llama_init_from_model(m, cp);
    llama_memory_t mem = llama_get_memory(ctx);
    rs_decode(ctx, 0, T, 200, 0, NULL);
    rs_decode(ctx, 1, T + 300, 50, 0, NULL);
    rs_decode(ctx, 1, T + 350, 1, 50, ref);
    llama_memory_seq_rm(mem, 1, 50, -1);
    size_t n;
    uint8_t *b = rs_save(ctx, 0, &n);
    struct rs_blob B;
    rs_parse(b, n, 2, &B);
    /* 300 base cells: [0,200) + a copy of [0,100) at positions [200,300) -> does not fit 256 cells */
    struct rs_piece p0[2] = { { &B.part[0].rec[0], 0, 200, 0 }, { &B.part[0].rec[0], 0, 100, 200 } };
    struct rs_piece p1[1] = { { &B.part[1].rec[0], 0, B.part[1].rec[0].nc, 0 } };
    struct rs_piece *pp[2] = { p0, p1 };
    int npc[2] = { 2, 1 };
    size_t na;
    uint8_t *ba = rs_assemble(2, 4, 0, 1, pp, npc, NULL, 0, &na);
    printf("seq 1 before: pos=[%d,%d]\n", llama_memory_seq_pos_min(mem, 1), llama_memory_seq_pos_max(mem, 1));
    size_t r = llama_state_seq_set_data(ctx, ba, na, 1);
    printf("set_data of a 300-cell blob into seq 1 (256-cell stream): returned %zu\n", r);
    printf("seq 1 after: seq_pos_min/max=[%d,%d] (SWA cache still has seq 1; its full-attention cells are gone)\n",
           llama_memory_seq_pos_min(mem, 1), llama_memory_seq_pos_max(mem, 1));
    {
        size_t nf;
        uint8_t *bf = rs_save(ctx, 1, &nf);
        rs_describe("seq 1 after the failed load", bf, nf, 2);
        free(bf);
    }
    int rc = rs_decode(ctx, 1, T + 350, 1, 50, out);
    printf("decode seq 1 at 50: rc=%d, max|d| vs before=%.3g  (=> on failure, seq_rm the target and reload)\n", rc,
           rs_maxdiff(ref, out, n_vocab_g));
    llama_memory_clear(mem, true);
    printf("after llama_memory_clear: seq0 max=%d seq1 max=%d (all streams emptied)\n", llama_memory_seq_pos_max(mem, 0),
           llama_memory_seq_pos_max(mem, 1));
    printf("== whole-sequence set_data packs the stream (seq 2: 64 tokens, seq_rm [16,32))\n");
    rs_decode(ctx, 2, T, 64, 0, NULL);
    llama_memory_seq_rm(mem, 2, 16, 32);
    show_idx = 1;
    rs_decode(ctx, 2, T + 64, 1, 64, NULL);
    show_idx = 0;
    printf("  ^ after seq_rm: the token at pos 64 fills the hole (cell 16)\n");
    llama_memory_seq_rm(mem, 2, 64, -1);
    size_t nh;
    uint8_t *bh = rs_save(ctx, 2, &nh);
    llama_memory_seq_rm(mem, 2, -1, -1);
    llama_state_seq_set_data(ctx, bh, nh, 2);
    show_idx = 1;
    rs_decode(ctx, 2, T + 64, 1, 64, NULL);
    show_idx = 0;
    printf("  ^ after save + set_data of the same sequence: its 48 cells sit at 0..47, the new token at cell 48\n");
    free(bh);
    printf("== a blob whose SWA part is empty, loaded into a sequence that has SWA cells\n");
    rs_decode(ctx, 3, T + 100, 40, 0, NULL);
    {
        struct rs_piece q0[1] = { { &B.part[0].rec[0], 0, 20, 0 } };
        struct rs_piece *qq[2] = { q0, NULL };
        int nq[2] = { 1, 0 };
        size_t nz;
        uint8_t *bz = rs_assemble(2, 4, 0, 3, qq, nq, NULL, 0, &nz);
        size_t rz = llama_state_seq_set_data(ctx, bz, nz, 3);
        printf("  set_data read %zu/%zu; seq 3 pos=[%d,%d] (SWA cache: the old 40 tokens' cells were NOT removed)\n", rz, nz,
               llama_memory_seq_pos_min(mem, 3), llama_memory_seq_pos_max(mem, 3));
        free(bz);
    }
    free(b);
    free(ba);
    free(ref);
    free(out);
    llama_free(ctx);
    llama_model_free(m);
    return 0;
}
