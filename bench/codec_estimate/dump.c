/* dump.c — the K and V of the first 1,024 tokens of a text, decoded by a model, as F32 files
** OUT/K_<part>_<layer>.f32 and OUT/V_<part>_<layer>.f32, each [cells][n_embd] row-major (V
** untransposed), for estimate.py.  Saved with kvt_block_save (the state llama.cpp gives) and
** cut with the library's blob parser (internal: src/kv/blob.h).  Part 1 is Gemma 3's sliding
** window (its last 512 cells).  A measuring tool, not part of kvtier: built by run.sh.
**   dump MODEL TEXT OUT */
#include "kvtier.h"
#include "kv/blob.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
void kvt__h2f(const uint8_t *src, float *dst, size_t n);
int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: dump MODEL TEXT OUT\n");
        return 2;
    }
    const char *model = argv[1], *text = argv[2], *out = argv[3];
    int T = 1024;
    FILE *f = fopen(text, "rb");
    if (!f) {
        perror(text);
        return 1;
    }
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = model;
    ep.n_ctx = 2048;
    ep.n_threads = 2;
    kvt_engine *e;
    if (kvt_engine_open(&ep, &e)) {
        fprintf(stderr, "open: %s\n", kvt_errmsg());
        return 1;
    }
    kvt_token *tok;
    int32_t nt;
    kvt_tokenize(e, buf, true, false, &tok, &nt);
    if (nt < T) {
        fprintf(stderr, "only %d tokens\n", nt);
        return 1;
    }
    for (int i = 0; i < T; i += 64)
        if (kvt_engine_decode(e, 0, tok + i, 64, i, false)) {
            fprintf(stderr, "decode %s\n", kvt_errmsg());
            return 1;
        }
    kvt_blob *b;
    if (kvt_block_save(e, 0, 0, T, &b)) {
        fprintf(stderr, "save %s\n", kvt_errmsg());
        return 1;
    }
    struct kvt__blob_layout L;
    int np = 1;
    if (kvt__blob_parse(b->data, b->size, 1, &L)) {
        np = 2;
        if (kvt__blob_parse(b->data, b->size, 2, &L)) {
            fprintf(stderr, "parse\n");
            return 1;
        }
    }
    for (int p = 0; p < L.n_parts; p++) {
        struct kvt__blob_part *P = &L.part[p];
        printf("part %d: cells %u layers %u v_trans %u\n", p, P->n_cells, P->n_layer, P->v_trans);
        for (uint32_t il = 0; il < P->n_layer; il++) {
            uint32_t N = P->n_cells;
            uint32_t Ek = (uint32_t) (P->k_row_bytes[il] / 2);
            float *k = malloc(sizeof(float) * N * Ek);
            kvt__h2f(b->data + P->k_off[il], k, (size_t) N * Ek);
            char path[512];
            snprintf(path, sizeof path, "%s/K_%d_%02u.f32", out, p, il);
            FILE *o = fopen(path, "wb");
            fwrite(k, sizeof(float), (size_t) N * Ek, o);
            fclose(o);
            uint32_t Ev = P->v_trans ? P->v_n_embd[il] : (uint32_t) (P->v_row_bytes[il] / 2);
            float *v = malloc(sizeof(float) * N * Ev), *vt = malloc(sizeof(float) * N * Ev);
            kvt__h2f(b->data + P->v_off[il], v, (size_t) N * Ev);
            if (P->v_trans) {
                for (uint32_t e2 = 0; e2 < Ev; e2++)
                    for (uint32_t c = 0; c < N; c++) vt[c * Ev + e2] = v[e2 * N + c];
            } else memcpy(vt, v, sizeof(float) * N * Ev);
            snprintf(path, sizeof path, "%s/V_%d_%02u.f32", out, p, il);
            o = fopen(path, "wb");
            fwrite(vt, sizeof(float), (size_t) N * Ev, o);
            fclose(o);
            if (il == 0) printf("  Ek %u Ev %u\n", Ek, Ev);
            free(k);
            free(v);
            free(vt);
        }
    }
    return 0;
}
