/* Q3: seq_cp / seq_rm / seq_add / seq_keep with kv_unified=false (tiny Gemma 3, 4 streams). */
#include "common.h"
#include <sys/wait.h>
#include <unistd.h>
#include <limits.h>
static llama_token T[512];
static llama_context *mk(llama_model *m, int unified) { return llama_init_from_model(m, rs_params(2048, 4, unified)); }
static void in_child(const char *what, llama_context *ctx, int op, int a, int b, int p0, int p1) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        llama_memory_t mem = llama_get_memory(ctx);
        if (op == 0) llama_memory_seq_cp(mem, a, b, p0, p1);
        if (op == 1) llama_memory_seq_rm(mem, a, p0, p1);
        if (op == 2) llama_memory_seq_add(mem, a, p0, p1, 5);
        printf("    (child) returned normally; seq %d pos=[%d,%d]\n", b, llama_memory_seq_pos_min(mem, b),
               llama_memory_seq_pos_max(mem, b));
        fflush(stdout);
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    printf("  %-48s -> %s\n", what,
           WIFSIGNALED(st) ? (WTERMSIG(st) == SIGABRT ? "ABORT (SIGABRT)" : "killed by signal") : "survived");
}
int main(int argc, char **argv) {
    llama_model *m = rs_model(argv[1]);
    n_vocab_g = llama_vocab_n_tokens(llama_model_get_vocab(m));
    const int NP = llama_model_n_swa(m) > 0 ? 2 : 1;
    for (int i = 0; i < 512; i++) T[i] = (i * 13 + 5) % n_vocab_g;
    float *ref = malloc(4 * n_vocab_g), *out = malloc(4 * n_vocab_g), *ref1 = malloc(4 * n_vocab_g);
    llama_context *ctx = mk(m, 0);
    llama_memory_t mem = llama_get_memory(ctx);
    printf("llama_memory_can_shift=%d (n_ctx_seq=%u)\n", llama_memory_can_shift(mem), llama_n_ctx_seq(ctx));

    printf("== full cross-stream seq_cp(0 -> 1, -1, -1)\n");
    rs_decode(ctx, 0, T, 40, 0, NULL);
    rs_decode(ctx, 1, T + 200, 10, 0, NULL);
    size_t n0, n1;
    uint8_t *b0 = rs_save(ctx, 0, &n0);
    llama_memory_seq_cp(mem, 0, 1, -1, -1);
    printf("  seq 1 (had 10 own tokens) now pos=[%d,%d]  (destination stream reset, then gets seq 0's cells)\n",
           llama_memory_seq_pos_min(mem, 1), llama_memory_seq_pos_max(mem, 1));
    uint8_t *b1 = rs_save(ctx, 1, &n1);
    struct rs_blob B0, B1;
    rs_parse(b0, n0, NP, &B0);
    rs_parse(b1, n1, NP, &B1);
    const struct rs_rec *R0 = &B0.part[0].rec[0], *R1 = &B1.part[0].rec[0];
    printf("  K rows of seq 1 right after seq_cp equal seq 0's: %s\n",
           !memcmp(R0->k[0], R1->k[0], R0->k_row[0] * R0->nc) ? "yes" : "NO (copy pending)");
    rs_decode(ctx, 3, T, 1, 0, NULL);
    llama_memory_seq_rm(mem, 3, -1, -1); /* any decode runs the pending stream copy */
    free(b1);
    b1 = rs_save(ctx, 1, &n1);
    rs_parse(b1, n1, NP, &B1);
    R1 = &B1.part[0].rec[0];
    printf("  after a 1-token decode in seq 3: equal: %s\n", !memcmp(R0->k[0], R1->k[0], R0->k_row[0] * R0->nc) ? "yes" : "NO");
    rs_decode(ctx, 0, T + 40, 1, 40, ref);
    rs_decode(ctx, 1, T + 40, 1, 40, out);
    printf("  next token seq 1 vs seq 0: max|d|=%.3g\n", rs_maxdiff(ref, out, n_vocab_g));

    printf("== other forms (each run in a forked child)\n");
    in_child("seq_cp(0 -> 2, 10, 20) partial, cross-stream", ctx, 0, 0, 2, 10, 20);
    in_child("seq_cp(0 -> 2, 5, -1) partial, cross-stream", ctx, 0, 0, 2, 5, -1);
    in_child("seq_cp(0 -> 2, 0, INT_MAX) counts as full", ctx, 0, 0, 2, 0, INT_MAX);
    in_child("seq_cp(0 -> 0, 10, 20) same seq", ctx, 0, 0, 0, 10, 20);
    in_child("seq_rm(4, ..) with n_seq_max=4 (seq id out of range)", ctx, 1, 4, 4, -1, -1);
    in_child("seq_add(7, ..) seq id out of range", ctx, 2, 7, 7, -1, -1);

    printf("== seq_keep(0): non-unified vs unified\n");
    for (int u = 0; u < 2; u++) {
        llama_context *c = u ? mk(m, 1) : ctx;
        llama_memory_t mm = llama_get_memory(c);
        llama_memory_clear(mm, true);
        rs_decode(c, 0, T, 8, 0, NULL);
        rs_decode(c, 1, T, 8, 0, NULL);
        rs_decode(c, 2, T, 8, 0, NULL);
        llama_memory_seq_keep(mm, 0);
        printf("  %-11s after seq_keep(0): seq0 max=%d seq1 max=%d seq2 max=%d\n", u ? "unified" : "non-unified",
               llama_memory_seq_pos_max(mm, 0), llama_memory_seq_pos_max(mm, 1), llama_memory_seq_pos_max(mm, 2));
        llama_memory_seq_rm(mm, -1, 4, -1);
        printf("  %-11s after seq_rm(-1, 4, -1): seq0 max=%d seq1 max=%d seq2 max=%d\n", u ? "unified" : "non-unified",
               llama_memory_seq_pos_max(mm, 0), llama_memory_seq_pos_max(mm, 1), llama_memory_seq_pos_max(mm, 2));
        if (u) llama_free(c);
    }

    printf("== seq_add per stream (context shift): seq 0 = 24 tokens at [0,24) shifted by +100\n");
    llama_memory_clear(mem, true);
    rs_decode(ctx, 2, T, 24, 100, NULL);
    rs_decode(ctx, 2, T + 24, 1, 124, ref); /* reference computed at [100,125) */
    rs_decode(ctx, 1, T + 300, 30, 0, NULL);
    llama_token t1 = T[330];
    rs_decode(ctx, 1, &t1, 1, 30, ref1);
    llama_memory_seq_rm(mem, 1, 30, -1);
    rs_decode(ctx, 0, T, 24, 0, NULL);
    llama_memory_seq_add(mem, 0, -1, -1, 100);
    printf("  seq 0 pos after seq_add=[%d,%d] (positions move immediately; K is rotated at the next decode)\n",
           llama_memory_seq_pos_min(mem, 0), llama_memory_seq_pos_max(mem, 0));
    rs_decode(ctx, 0, T + 24, 1, 124, out);
    printf("  next token after shift vs computed-at-[100,124): max|d|=%.3g\n", rs_maxdiff(ref, out, n_vocab_g));
    rs_decode(ctx, 1, &t1, 1, 30, out);
    printf("  seq 1 (other stream) unaffected by the shift: max|d|=%.3g\n", rs_maxdiff(ref1, out, n_vocab_g));
    free(b0);
    free(b1);
    free(ref);
    free(out);
    free(ref1);
    llama_free(ctx);
    llama_model_free(m);
    return 0;
}
