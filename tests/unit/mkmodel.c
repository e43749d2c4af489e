/* mkmodel — write a tiny random-weight GGUF for exactness tests and CLI smoke runs.
**
**   mkmodel OUT.gguf llama [--no-tokenizer]           pure-attention llama-style model
**                                                     (NORM RoPE, GQA 4:2)
**   ... [--ctx-train N] [--seed S]                    trained context (default 8192); weights
**                                                     from another seed (same shapes; the last
**                                                     option when both are given)
**   mkmodel OUT.gguf gemma3 [N_SWA] [--no-tokenizer]  Gemma 3-style: NEOX RoPE, Q/K norm, sliding
**                                                     window N_SWA (default 32) on 5 of 6 layers,
**                                                     full attention on layer 5
**   ... --specials                                    the tokenizer also has a control token
**                                                     "<|e|>" and a user-defined "e|>\n\nUser:"
**                                                     that overlaps its end (the tokenizer memo's
**                                                     test: a special token across a cut)
** F32 weights, vocab 512, 6 layers, n_embd 128, head_dim 64.  Deterministic (fixed seed).
**
** Tokenizer: a SentencePiece-style ("llama") vocabulary that llama.cpp accepts, so text can be
** tokenized and a session run on the tiny models: <unk> (0), <s> (1, BOS), </s> (2, EOS), the
** 256 byte-fallback tokens <0x00>..<0xFF>, then "▁", the printable ASCII characters and common
** English words with every prefix of each (SPM merges pairs only into pieces of the vocabulary,
** so a word is reachable only through its prefixes), scores decreasing.  The tokenizer adds no
** tensors and draws nothing from the weights' random stream: the weights are the same as
** without it.  --no-tokenizer writes tokenizer.ggml.model = "none" (no vocabulary at all). */
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

/* ---- SPM vocabulary ---- */

enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER_DEFINED = 4, TT_BYTE = 6 };

/* Words whose prefixes (with the leading "▁") fill the vocabulary after the single characters,
** in order, until it is full. */
static const char *const WORDS[] = {
    "the",   "of",      "and",    "to",     "in",   "is",     "it",    "that",     "you",  "for",    "on",    "was",     "with",
    "as",    "are",     "be",     "this",   "have", "not",    "what",  "at",       "or",   "but",    "they",  "from",    "we",
    "an",    "by",      "one",    "secret", "code", "number", "part",  "document", "here", "answer", "noted", "people",  "about",
    "would", "if",      "can",    "do",     "so",   "there",  "which", "their",    "more", "like",   "when",  "startup", "work",
    "think", "because", "things", "good",   "make", "how",    "some",  "time",     "way",  "who",    "all",
};

static char *vocab[1024];
static float vocab_score[1024];
static int32_t vocab_type[1024];
static int n_tok;

static int vocab_has(const char *t) {
    for (int i = 0; i < n_tok; i++)
        if (!strcmp(vocab[i], t)) return 1;
    return 0;
}

static void vocab_add(const char *t, int32_t type, int n_max) {
    if (n_tok >= n_max || vocab_has(t)) return;
    size_t n = strlen(t) + 1;
    vocab[n_tok] = malloc(n);
    memcpy(vocab[n_tok], t, n);
    vocab_type[n_tok] = type;
    vocab_score[n_tok] = type == TT_NORMAL ? -(float) n_tok : 0.0f; /* earlier = more likely */
    n_tok++;
}

static int specials;

static void add_tokenizer(int n_vocab) {
    static const char SP[] = "\xe2\x96\x81"; /* U+2581, SentencePiece's space */
    char buf[64];
    vocab_add("<unk>", TT_UNKNOWN, n_vocab);
    vocab_add("<s>", TT_CONTROL, n_vocab);
    vocab_add("</s>", TT_CONTROL, n_vocab);
    if (specials) {
        vocab_add("<|e|>", TT_CONTROL, n_vocab);
        vocab_add("e|>\n\nUser:", TT_USER_DEFINED, n_vocab);
    }
    for (int b = 0; b < 256; b++) {
        snprintf(buf, sizeof buf, "<0x%02X>", b); /* llama.cpp's byte-token spelling */
        vocab_add(buf, TT_BYTE, n_vocab);
    }
    vocab_add(SP, TT_NORMAL, n_vocab);
    for (int c = 0x21; c < 0x7f; c++) {
        buf[0] = (char) c;
        buf[1] = '\0';
        vocab_add(buf, TT_NORMAL, n_vocab);
    }
    for (size_t w = 0; w < sizeof WORDS / sizeof WORDS[0]; w++)
        for (size_t len = 1; len <= strlen(WORDS[w]); len++) {
            snprintf(buf, sizeof buf, "%s%.*s", SP, (int) len, WORDS[w]);
            vocab_add(buf, TT_NORMAL, n_vocab);
        }
    /* pad with two-letter pieces (deterministic order) until the vocabulary is full */
    for (int a = 'a'; a <= 'z' && n_tok < n_vocab; a++)
        for (int b = 'a'; b <= 'z' && n_tok < n_vocab; b++) {
            buf[0] = (char) a;
            buf[1] = (char) b;
            buf[2] = '\0';
            vocab_add(buf, TT_NORMAL, n_vocab);
        }
    gguf_set_val_str(gctx, "tokenizer.ggml.model", "llama");
    gguf_set_arr_str(gctx, "tokenizer.ggml.tokens", (const char **) vocab, (size_t) n_tok);
    gguf_set_arr_data(gctx, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, vocab_score, (size_t) n_tok);
    gguf_set_arr_data(gctx, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, vocab_type, (size_t) n_tok);
    gguf_set_val_u32(gctx, "tokenizer.ggml.unknown_token_id", 0);
    gguf_set_val_u32(gctx, "tokenizer.ggml.bos_token_id", 1);
    gguf_set_val_u32(gctx, "tokenizer.ggml.eos_token_id", 2);
    gguf_set_val_bool(gctx, "tokenizer.ggml.add_bos_token", true);
    gguf_set_val_bool(gctx, "tokenizer.ggml.add_eos_token", false);
    /* like Gemma's tokenizer: no "▁" in front of a text tokenized on its own (the session
    ** tokenizes conversation fragments separately) */
    gguf_set_val_bool(gctx, "tokenizer.ggml.add_space_prefix", false);
}

int main(int argc, char **argv) {
    int tokenizer = 1, n_ctx_train = 8192;
    if (argc > 4 && !strcmp(argv[argc - 2], "--seed")) { /* other weights, same shapes and tokenizer */
        rng ^= strtoull(argv[argc - 1], NULL, 10) * 0x9E3779B97F4A7C15ull;
        if (!rng) rng = 1;
        argc -= 2;
    }
    if (argc > 4 && !strcmp(argv[argc - 2], "--ctx-train")) {
        n_ctx_train = atoi(argv[argc - 1]);
        argc -= 2;
    }
    if (argc > 3 && !strcmp(argv[argc - 1], "--specials")) {
        specials = 1;
        argc--;
    }
    if (argc > 3 && !strcmp(argv[argc - 1], "--no-tokenizer")) {
        tokenizer = 0;
        argc--;
    }
    if (argc < 3 || argc > 4 || (strcmp(argv[2], "llama") && strcmp(argv[2], "gemma3")) || n_ctx_train < 16) {
        fprintf(stderr, "usage: mkmodel OUT.gguf llama|gemma3 [n_swa] [--no-tokenizer] [--specials] [--ctx-train N >= 16]\n");
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
    kv_u32(arch, "context_length", (uint32_t) n_ctx_train);
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
    if (tokenizer) add_tokenizer(n_vocab);
    else gguf_set_val_str(gctx, "tokenizer.ggml.model", "none");

    add("token_embd.weight", n_embd, n_vocab, 0.0f, gemma ? 0.1f : 0.5f); /* logits ~ 10, like real models */
    add("output_norm.weight", n_embd, 0, 1.0f, 0.05f);
    if (!gemma) add("output.weight", n_embd, n_vocab, 0.0f, 0.1f);
    char nm[128];
    for (int il = 0; il < n_layer; il++) {
#define A(suffix, a, b, m, s)                          \
    do {                                               \
        snprintf(nm, sizeof nm, "blk.%d." suffix, il); \
        add(nm, a, b, m, s);                           \
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
    for (int i = 0; i < n_tok; i++) free(vocab[i]);
    return 0;
}
