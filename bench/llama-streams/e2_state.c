/* Q2: llama_state_seq_get/set_data with kv_unified=false: format, replace semantics, holes,
** host-side assembly of several blocks (+ K re-anchoring) into one set_data.  Model: tiny Gemma 3
** (iSWA: part 0 = full-attention layer, part 1 = SWA layers, n_swa = 32), F32 cache, FA off. */
#include "common.h"
static llama_token T[512];
static double maxabs(const float *a, int n) {
    double m = 0;
    for (int i = 0; i < n; i++)
        if (fabs(a[i]) > m) m = fabs(a[i]);
    return m;
}
int main(int argc, char **argv) {
    llama_model *m = rs_model(argv[1]);
    n_vocab_g = llama_vocab_n_tokens(llama_model_get_vocab(m));
    const int NP = llama_model_n_swa(m) > 0 ? 2 : 1, NS = 4;
    for (int i = 0; i < 512; i++) T[i] = (i * 31 + 7) % n_vocab_g;
    float *ref = malloc(4 * n_vocab_g), *out = malloc(4 * n_vocab_g);
    llama_context *ctx = llama_init_from_model(m, rs_params(2048, NS, 0));
    llama_memory_t mem = llama_get_memory(ctx);
    size_t n;

    printf("== A. format: 64 tokens in seq 1, non-unified (n_seq_max=%d) vs unified\n", NS);
    rs_decode(ctx, 1, T, 64, 0, NULL);
    uint8_t *b1 = rs_save(ctx, 1, &n);
    size_t n1 = n;
    rs_describe("non-unified seq 1", b1, n1, NP);
    size_t ne = llama_state_seq_get_size(ctx, 3);
    uint8_t *be = rs_save(ctx, 3, &ne);
    rs_describe("non-unified empty seq 3", be, ne, NP);
    {
        llama_context *cu = llama_init_from_model(m, rs_params(2048, NS, 1));
        rs_decode(cu, 1, T, 64, 0, NULL);
        size_t nu;
        uint8_t *bu = rs_save(cu, 1, &nu);
        rs_describe("unified seq 1", bu, nu, NP);
        printf("  size difference non-unified - unified = %zd bytes (= %d parts x %d extra u32 stream counts)\n",
               (ssize_t) (n1 - nu), NP, NS - 1);
        size_t r = llama_state_seq_set_data(cu, b1, n1, 2);
        printf("  non-unified blob -> unified context: set_data returned %zu (0 = rejected)\n", r);
        llama_free(cu);
        llama_context *c3 = llama_init_from_model(m, rs_params(2048, 2, 0));
        r = llama_state_seq_set_data(c3, b1, n1, 0);
        printf("  n_seq_max=4 blob -> n_seq_max=2 context: set_data returned %zu\n", r);
        llama_free(c3);
        free(bu);
    }

    printf("== B. set_data into a sequence that already has cells; blob of seq 1 into seq 2\n");
    rs_decode(ctx, 1, T + 64, 1, 64, ref); /* seq 1 continues at 64 */
    llama_memory_seq_rm(mem, 1, 64, -1);
    rs_decode(ctx, 2, T + 100, 20, 0, NULL); /* seq 2 holds 20 unrelated tokens */
    printf("  seq 2 before: pos=[%d,%d]\n", llama_memory_seq_pos_min(mem, 2), llama_memory_seq_pos_max(mem, 2));
    size_t r = llama_state_seq_set_data(ctx, b1, n1, 2);
    printf("  set_data(seq 1 blob -> seq 2) read %zu/%zu; seq 2 now pos=[%d,%d]\n", r, n1, llama_memory_seq_pos_min(mem, 2),
           llama_memory_seq_pos_max(mem, 2));
    rs_decode(ctx, 2, T + 64, 1, 64, out);
    printf("  next-token logits seq 2 vs seq 1: max|d|=%.3g  (old cells replaced, none appended)\n",
           rs_maxdiff(ref, out, n_vocab_g));
    llama_memory_seq_rm(mem, 2, 64, -1);
    r = llama_state_seq_set_data(ctx, be, ne, 2);
    printf("  set_data(EMPTY-seq blob -> seq 2) read %zu; seq 2 pos=[%d,%d]  (an empty blob does NOT clear the target)\n", r,
           llama_memory_seq_pos_min(mem, 2), llama_memory_seq_pos_max(mem, 2));
    llama_memory_seq_rm(mem, 2, -1, -1);

    printf("== C. holes: positions {0..15, 32..39, 48..63} (holes [16,32) and [40,48))\n");
    rs_decode(ctx, 0, T, 64, 0, NULL);
    llama_memory_seq_rm(mem, 0, 16, 32);
    llama_memory_seq_rm(mem, 0, 40, 48);
    rs_decode(ctx, 0, T + 64, 1, 64, ref); /* reference: holes punched by seq_rm */
    llama_memory_seq_rm(mem, 0, 64, -1);
    uint8_t *bh = rs_save(ctx, 0, &n);
    rs_describe("seq 0 with holes", bh, n, NP);
    struct rs_blob B;
    rs_parse(b1, n1, NP, &B); /* full 0..63 blob of seq 1 */
    struct rs_piece pc[2][3];
    int np[2] = { 0, 0 };
    for (int pt = 0; pt < NP; pt++) {
        const struct rs_rec *R = &B.part[pt].rec[0];
        int32_t keep[3][2] = { { 0, 16 }, { 32, 40 }, { 48, 64 } };
        for (int k = 0; k < 3; k++) {
            uint32_t c0, c1;
            rs_range(R, keep[k][0], keep[k][1], &c0, &c1);
            if (c1 > c0) pc[pt][np[pt]++] = (struct rs_piece){ R, c0, c1, 0 };
        }
    }
    struct rs_piece *pp[2] = { pc[0], pc[1] };
    size_t na;
    uint8_t *ba = rs_assemble(NP, NS, 0, 0, pp, np, NULL, 0, &na);
    rs_describe("host-sliced blob", ba, na, NP);
    printf("  host-sliced blob == llama.cpp's own blob of the holed seq 0 (byte for byte): %s\n",
           (na == n && !memcmp(ba, bh, n)) ? "yes" : "no");
    r = llama_state_seq_set_data(ctx, ba, na, 3);
    printf("  set_data(sliced -> seq 3) read %zu/%zu; seq 3 pos=[%d,%d]\n", r, na, llama_memory_seq_pos_min(mem, 3),
           llama_memory_seq_pos_max(mem, 3));
    rs_decode(ctx, 3, T + 64, 1, 64, out);
    printf("  next token vs seq_rm-holes reference: max|d|=%.3g\n", rs_maxdiff(ref, out, n_vocab_g));
    llama_memory_seq_rm(mem, 3, -1, -1);
    int rc = rs_decode(ctx, 0, T + 70, 1, 70, NULL);
    printf("  decode seq 0 at pos 70 while pos_max=63: rc=%d (positions must continue at pos_max+1)\n", rc);
    free(ba);

    printf("== D. assembly: prefix P=[0,48) + block X (16 tokens computed standalone at [200,216)) re-anchored to [48,64)\n");
    llama_memory_clear(mem, true);
    rs_decode(ctx, 0, T, 48, 0, NULL);         /* P in seq 0 */
    rs_decode(ctx, 1, T + 300, 16, 200, NULL); /* X far away in seq 1 */
    rs_decode(ctx, 2, T + 300, 16, 48, NULL);  /* X computed at the target positions (reference) */
    size_t nP, nX, nY;
    uint8_t *bP = rs_save(ctx, 0, &nP), *bX = rs_save(ctx, 1, &nX), *bY = rs_save(ctx, 2, &nY);
    struct rs_blob BP, BX, BY;
    rs_parse(bP, nP, NP, &BP);
    rs_parse(bX, nX, NP, &BX);
    rs_parse(bY, nY, NP, &BY);
    struct rs_rope rope = { llama_model_rope_type(m) == LLAMA_ROPE_TYPE_NEOX, 64, { 1e6f, 1e4f } };
    for (int variant = 0; variant < 3; variant++) {
        struct rs_piece q[2][2];
        int nq[2];
        for (int pt = 0; pt < NP; pt++) {
            const struct rs_rec *RP = &BP.part[pt].rec[0], *RX = variant == 0 ? &BY.part[pt].rec[0] : &BX.part[pt].rec[0];
            struct rs_piece a = { RP, 0, RP->nc, 0 }, x = { RX, 0, RX->nc, variant == 0 ? 0 : 48 - 200 };
            if (variant == 2) {
                q[pt][0] = x;
                q[pt][1] = a;
            } else {
                q[pt][0] = a;
                q[pt][1] = x;
            }
            nq[pt] = 2;
        }
        struct rs_piece *qq[2] = { q[0], q[1] };
        size_t nb;
        uint8_t *bb = rs_assemble(NP, NS, 2, 3, qq, nq, &rope, 64, &nb);
        if (variant == 0) rs_describe("assembled P + X(at 48)", bb, nb, NP);
        r = llama_state_seq_set_data(ctx, bb, nb, 3);
        rs_decode(ctx, 3, T + 400, 1, 64, variant == 0 ? ref : out);
        if (variant)
            printf("  %s: set_data read %zu/%zu, next token vs reference: max|d|=%.3g (max|logit| %.3g)\n",
                   variant == 1 ? "P + X re-anchored on the host" : "same, X's cells placed BEFORE P's in the blob", r, nb,
                   rs_maxdiff(ref, out, n_vocab_g), maxabs(ref, n_vocab_g));
        llama_memory_seq_rm(mem, 3, -1, -1);
        free(bb);
    }
    free(bP);
    free(bX);
    free(bY);
    free(b1);
    free(be);
    free(bh);
    free(ref);
    free(out);
    llama_free(ctx);
    llama_model_free(m);
    return 0;
}
