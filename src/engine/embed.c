/* embed.c — the embedder for dense retrieval (kvtier.h, section 7): its own model and context,
** apart from any engine: embeddings on, MEAN pooling over the tokens of sequence 0, one sequence,
** flash attention off.  A text is decoded as ONE ubatch (n_batch = n_ubatch = n_ctx): llama.cpp
** pools per ubatch and overwrites the sequence's pooled vector with each ubatch, so a text split
** across ubatches would be embedded by its last piece only.  llama.cpp outputs logits for every
** token of an embeddings batch as well (n_vocab floats per token, 1 MiB per token for Gemma 3's
** 262144 tokens): the price of embedding with a generative GGUF through the public API. */
#include "engine/engine_int.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct kvt_embedder {
    struct llama_model *model;
    struct llama_context *ctx;
    const struct llama_vocab *vocab;
    int32_t n_ctx;  /* longest text in tokens (requested, not padded) */
    int32_t dim;    /* pooled embedding width */
    bool add_bos;   /* the vocab asks for BOS */
    kvt_token *tok; /* tokenizer scratch */
    int32_t cap_tok;
    char path[1024];
};

int kvt_embedder_open(const char *model_path, int32_t n_ctx, int32_t n_threads, kvt_embedder **out) {
    if (!out) return kvt__fail(KVT_EINVAL, "embedder open: NULL out");
    *out = NULL;
    kvt__clear_error();
    if (!model_path || !*model_path) return kvt__fail(KVT_EINVAL, "embedder: no model path given");
    if (n_ctx <= 0) n_ctx = 512;
    if (n_ctx < 8) return kvt__fail(KVT_EINVAL, "embedder context of %d tokens is too small (minimum 8)", n_ctx);
    if (n_threads < 0) return kvt__fail(KVT_EINVAL, "embedder: %d threads", n_threads);
    struct stat st;
    if (stat(model_path, &st) != 0) return kvt__fail(KVT_EMODEL, "embedding model file '%s': %s", model_path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return kvt__fail(KVT_EMODEL, "embedding model path '%s' is not a regular file", model_path);

    kvt_embedder *em = calloc(1, sizeof *em);
    if (!em) return kvt__fail(KVT_ENOMEM, "embedder");
    snprintf(em->path, sizeof em->path, "%s", model_path);
    llama_log_set(kvt__engine_log_cb, NULL);
    kvt__engine_backends();
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.progress_callback = kvt__engine_quiet_progress;
    em->model = llama_model_load_from_file(model_path, mp);
    if (!em->model) {
        free(em);
        return kvt__fail(KVT_EMODEL,
                         "llama.cpp could not load embedding model '%s' (%lld bytes): not a GGUF file, "
                         "truncated, or an unsupported architecture",
                         model_path, (long long) st.st_size);
    }
    em->vocab = llama_model_get_vocab(em->model);
    const int32_t n_train = llama_model_n_ctx_train(em->model);
    if (n_train > 0 && n_ctx > n_train) {
        kvt_embedder_free(em);
        return kvt__fail(KVT_EINVAL, "embedder context of %d tokens exceeds the %d tokens '%s' was trained on", n_ctx, n_train,
                         model_path);
    }
    em->n_ctx = n_ctx;
    em->dim = llama_model_n_embd_out(em->model);
    em->add_bos = llama_vocab_get_add_bos(em->vocab);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n_ctx;
    cp.n_batch = (uint32_t) n_ctx; /* one text = one batch = one ubatch (see above) */
    cp.n_ubatch = (uint32_t) n_ctx;
    cp.n_seq_max = 1;
    cp.kv_unified = true;
    cp.embeddings = true;
    cp.pooling_type = LLAMA_POOLING_TYPE_MEAN;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    int nt = n_threads > 0 ? n_threads : (int) sysconf(_SC_NPROCESSORS_ONLN);
    cp.n_threads = nt;
    cp.n_threads_batch = nt;
    cp.no_perf = true;
    em->ctx = llama_init_from_model(em->model, cp);
    if (!em->ctx) {
        kvt_embedder_free(em);
        return kvt__fail(KVT_ELLAMA, "llama.cpp could not create an embedding context of %d tokens for '%s'", n_ctx, model_path);
    }
    if (em->dim <= 0 || llama_pooling_type(em->ctx) != LLAMA_POOLING_TYPE_MEAN) {
        int32_t d = em->dim;
        kvt_embedder_free(em);
        return kvt__fail(KVT_ELLAMA, "embedding context for '%s' has width %d and not mean pooling", model_path, d);
    }
    *out = em;
    return 0;
}

void kvt_embedder_free(kvt_embedder *em) {
    if (!em) return;
    if (em->ctx) llama_free(em->ctx);
    if (em->model) llama_model_free(em->model);
    free(em->tok);
    free(em);
}

int32_t kvt_embedder_dim(const kvt_embedder *em) { return em ? em->dim : 0; }

int kvt_embedder_embed(kvt_embedder *em, const char *text, float *out) {
    if (!em || !out) return kvt__fail(KVT_EINVAL, "embed: NULL %s", em ? "output" : "embedder");
    if (!text || !*text) return kvt__fail(KVT_EINVAL, "embed: empty text");
    if (llama_vocab_type(em->vocab) == LLAMA_VOCAB_TYPE_NONE)
        return kvt__fail(KVT_EINVAL, "embedding model '%s' has no tokenizer", em->path);
    size_t len = strlen(text);
    if (len > INT32_MAX / 2) return kvt__fail(KVT_EINVAL, "embed: text of %zu bytes is too long", len);
    int32_t n = llama_tokenize(em->vocab, text, (int32_t) len, em->tok, em->cap_tok, em->add_bos, false);
    if (n < 0) { /* -n tokens needed */
        kvt_token *t = realloc(em->tok, sizeof(kvt_token) * (size_t) -n);
        if (!t) return kvt__fail(KVT_ENOMEM, "embed: %d tokens", -n);
        em->tok = t;
        em->cap_tok = -n;
        n = llama_tokenize(em->vocab, text, (int32_t) len, em->tok, em->cap_tok, em->add_bos, false);
        if (n < 0) return kvt__fail(KVT_ELLAMA, "llama_tokenize failed on %zu bytes", len);
    }
    if (n == 0) return kvt__fail(KVT_EINVAL, "embed: text of %zu bytes has no tokens", len);
    if (n > em->n_ctx) n = em->n_ctx; /* the first n_ctx tokens */

    llama_memory_t mem = llama_get_memory(em->ctx);
    llama_memory_clear(mem, true);
    int rc = 0;
    int r = llama_decode(em->ctx, llama_batch_get_one(em->tok, n));
    const float *v = r == 0 ? llama_get_embeddings_seq(em->ctx, 0) : NULL;
    if (r != 0) rc = kvt__fail(KVT_ELLAMA, "embed: llama_decode returned %d for %d tokens", r, n);
    else if (!v) rc = kvt__fail(KVT_ELLAMA, "embed: llama.cpp returned no pooled embedding for %d tokens", n);
    else {
        double ss = 0;
        for (int32_t i = 0; i < em->dim; i++) ss += (double) v[i] * v[i];
        const double norm = sqrt(ss);
        if (!(norm > 0) || !isfinite(norm)) rc = kvt__fail(KVT_ELLAMA, "embed: pooled embedding has norm %g", norm);
        else
            for (int32_t i = 0; i < em->dim; i++) out[i] = (float) (v[i] / norm);
    }
    llama_memory_clear(mem, true);
    return rc;
}
