/* mkmodel — write a tiny random-weight GGUF for exactness tests (no tokenizer).
**
**   mkmodel OUT.gguf llama            pure-attention llama-style model (NORM RoPE, GQA 4:2)
**   mkmodel OUT.gguf gemma3 [N_SWA]   Gemma 3-style: NEOX RoPE, Q/K norm, sliding window N_SWA
**                                     (default 32) on 5 of 6 layers, full attention on layer 5
** F32 weights, vocab 512, 6 layers, n_embd 128, head_dim 64.  Deterministic (fixed seed). */
#include "ggml.h"
#include "gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned long long rng = 88172645463325252ull;

static float frand(void) { /* xorshift64, sum of 4 uniforms ~ N(0,1) */
    float s = 0;
    for (int i = 0; i < 4; i++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        s += (float) ((rng >> 11) * (1.0 / 9007199254740992.0)) - 0.5f;
    }
    return s * 1.7320508f;
}

static struct ggml_context *ctx;
static struct gguf_context *gctx;

static void add(const char *name, int64_t ne0, int64_t ne1, float mean, float sd) {
    struct ggml_tensor *t = ne1 > 0 ? ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ne0, ne1)
                                    : ggml_new_tensor_1d(ctx, GGML_TYPE_F32, ne0);
    ggml_set_name(t, name);
    float *d = (float *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); i++) d[i] = mean + sd * frand();
    gguf_add_tensor(gctx, t);
}

static void kv_u32(const char *arch, const char *k, uint32_t v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    gguf_set_val_u32(gctx, key, v);
}

static void kv_f32(const char *arch, const char *k, float v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    gguf_set_val_f32(gctx, key, v);
}

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[2], "llama") && strcmp(argv[2], "gemma3"))) {
        fprintf(stderr, "usage: mkmodel OUT.gguf llama|gemma3 [n_swa]\n");
        return 2;
    }
    const char *out = argv[1], *arch = argv[2];
    const int gemma = !strcmp(arch, "gemma3");
    const int n_swa = argc > 3 ? atoi(argv[3]) : 32;
    const int n_vocab = 512, n_embd = 128, n_ff = 256, n_layer = 6, hd = 64;
    const int n_head = gemma ? 4 : 4, n_head_kv = gemma ? 1 : 2;

    struct ggml_init_params ip = { 64u * 1024 * 1024, NULL, false };
    ctx = ggml_init(ip);
    gctx = gguf_init_empty();
    gguf_set_val_str(gctx, "general.architecture", arch);
    gguf_set_val_str(gctx, "general.name", gemma ? "tiny-random-gemma3" : "tiny-random-llama");
    kv_u32(arch, "vocab_size", n_vocab);
    kv_u32(arch, "context_length", 8192);
    kv_u32(arch, "embedding_length", n_embd);
    kv_u32(arch, "block_count", n_layer);
    kv_u32(arch, "feed_forward_length", n_ff);
    kv_u32(arch, "attention.head_count", n_head);
    kv_u32(arch, "attention.head_count_kv", n_head_kv);
    kv_u32(arch, "attention.key_length", hd);
    kv_u32(arch, "attention.value_length", hd);
    kv_f32(arch, "attention.layer_norm_rms_epsilon", 1e-6f);
    if (gemma) {
        kv_f32(arch, "rope.freq_base", 1000000.0f);
        if (n_swa > 0) kv_u32(arch, "attention.sliding_window", n_swa);
    } else {
        kv_f32(arch, "rope.freq_base", 10000.0f);
        kv_u32(arch, "rope.dimension_count", hd);
    }
    gguf_set_val_str(gctx, "tokenizer.ggml.model", "none");

    add("token_embd.weight", n_embd, n_vocab, 0.0f, gemma ? 0.1f : 0.5f); /* logits ~ 10, like real models */
    add("output_norm.weight", n_embd, 0, 1.0f, 0.05f);
    if (!gemma) add("output.weight", n_embd, n_vocab, 0.0f, 0.1f);
    char nm[128];
    for (int il = 0; il < n_layer; il++) {
#define A(suffix, a, b, m, s)                              \
    do {                                                   \
        snprintf(nm, sizeof nm, "blk.%d." suffix, il);     \
        add(nm, a, b, m, s);                               \
    } while (0)
        A("attn_norm.weight", n_embd, 0, 1.0f, 0.05f);
        A("attn_q.weight", n_embd, n_head * hd, 0.0f, 0.15f);
        A("attn_k.weight", n_embd, n_head_kv * hd, 0.0f, 0.15f);
        A("attn_v.weight", n_embd, n_head_kv * hd, 0.0f, 0.15f);
        A("attn_output.weight", n_head * hd, n_embd, 0.0f, 0.1f);
        A("ffn_norm.weight", n_embd, 0, 1.0f, 0.05f);
        A("ffn_gate.weight", n_embd, n_ff, 0.0f, 0.1f);
        A("ffn_up.weight", n_embd, n_ff, 0.0f, 0.1f);
        A("ffn_down.weight", n_ff, n_embd, 0.0f, 0.1f);
        if (gemma) {
            A("post_attention_norm.weight", n_embd, 0, 1.0f, 0.05f);
            A("attn_q_norm.weight", hd, 0, 1.0f, 0.3f);
            A("attn_k_norm.weight", hd, 0, 1.0f, 0.3f);
            A("post_ffw_norm.weight", n_embd, 0, 1.0f, 0.05f);
        }
#undef A
    }
    if (!gguf_write_to_file(gctx, out, false)) {
        fprintf(stderr, "mkmodel: could not write %s\n", out);
        return 1;
    }
    gguf_free(gctx);
    ggml_free(ctx);
    return 0;
}
