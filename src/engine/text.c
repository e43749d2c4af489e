/* text.c — tokens and text: tokenize, detokenize, end-of-generation, chat template (the GGUF's or
** a named llama.cpp built-in). */
#include "engine/engine_int.h"

#include <stdlib.h>
#include <string.h>

int kvt_tokenize(kvt_engine *e, const char *text, bool add_bos, bool parse_special, kvt_token **tokens, int32_t *n_tokens) {
    *tokens = NULL;
    *n_tokens = 0;
    if (!text) return kvt__fail(KVT_EINVAL, "tokenize: NULL text");
    if (llama_vocab_type(e->vocab) == LLAMA_VOCAB_TYPE_NONE)
        return kvt__fail(KVT_EINVAL, "model '%s' has no tokenizer", e->model_path);
    size_t len = strlen(text);
    if (len > INT32_MAX / 2) return kvt__fail(KVT_EINVAL, "text of %zu bytes is too long to tokenize", len);
    int32_t cap = (int32_t) len + 8;
    kvt_token *t = malloc(sizeof(kvt_token) * (size_t) cap);
    if (!t) return kvt__fail(KVT_ENOMEM, "tokenize %zu bytes", len);
    int32_t n = llama_tokenize(e->vocab, text, (int32_t) len, t, cap, add_bos, parse_special);
    if (n < 0) {
        cap = -n;
        kvt_token *t2 = realloc(t, sizeof(kvt_token) * (size_t) cap);
        if (!t2) {
            free(t);
            return kvt__fail(KVT_ENOMEM, "tokenize");
        }
        t = t2;
        n = llama_tokenize(e->vocab, text, (int32_t) len, t, cap, add_bos, parse_special);
        if (n < 0) {
            free(t);
            return kvt__fail(KVT_ELLAMA, "llama_tokenize failed");
        }
    }
    *tokens = t;
    *n_tokens = n;
    return 0;
}

int kvt_detokenize(kvt_engine *e, const kvt_token *tokens, int32_t n, bool render_special, char **text) {
    int32_t cap = n * 8 + 16;
    char *buf = malloc((size_t) cap);
    *text = NULL;
    if (!buf) return kvt__fail(KVT_ENOMEM, "detokenize");
    int32_t r = llama_detokenize(e->vocab, tokens, n, buf, cap - 1, false, render_special);
    if (r < 0) {
        cap = -r + 1;
        char *b2 = realloc(buf, (size_t) cap);
        if (!b2) {
            free(buf);
            return kvt__fail(KVT_ENOMEM, "detokenize");
        }
        buf = b2;
        r = llama_detokenize(e->vocab, tokens, n, buf, cap - 1, false, render_special);
        if (r < 0) {
            free(buf);
            return kvt__fail(KVT_ELLAMA, "llama_detokenize failed");
        }
    }
    buf[r] = '\0';
    *text = buf;
    return 0;
}

int kvt__engine_token_text(const kvt_engine *e, const kvt_token *tok, int32_t n, char **text, size_t *ends, bool *split) {
    *text = NULL;
    size_t cap = (size_t) n * 8 + 16, len = 0;
    char *buf = malloc(cap);
    if (!buf) return kvt__fail(KVT_ENOMEM, "token text");
    const enum llama_token_attr cut = LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_USER_DEFINED | LLAMA_TOKEN_ATTR_UNKNOWN;
    const bool bos0 = n > 0 && llama_vocab_get_add_bos(e->vocab) && tok[0] == llama_vocab_bos(e->vocab);
    for (int32_t i = 0; i < n; i++) {
        split[i] = (llama_vocab_get_attr(e->vocab, tok[i]) & cut) != 0;
        if (i == 0 && bos0) {
            ends[0] = 0;
            continue;
        }
        for (;;) {
            int32_t r = llama_token_to_piece(e->vocab, tok[i], buf + len, (int32_t) KVT_MIN(cap - len - 1, (size_t) INT32_MAX), 0,
                                             true);
            if (r >= 0) {
                len += (size_t) r;
                break;
            }
            char *b2 = realloc(buf, cap = cap * 2 + (size_t) -r);
            if (!b2) {
                free(buf);
                return kvt__fail(KVT_ENOMEM, "token text");
            }
            buf = b2;
        }
        ends[i] = len;
    }
    buf[len] = '\0';
    *text = buf;
    return 0;
}

bool kvt_token_is_eog(const kvt_engine *e, kvt_token tok) { return llama_vocab_is_eog(e->vocab, tok); }

int kvt_chat_tokenize(kvt_engine *e, const struct kvt_chat_msg *msgs, int32_t n, bool add_ass, const char *fallback,
                      kvt_token **tok, int32_t *n_tok) {
    char *text = NULL;
    *tok = NULL;
    *n_tok = 0;
    int rc = kvt_chat_format(e, msgs, n, add_ass, fallback, &text);
    if (rc == 0) rc = kvt_tokenize(e, text, true, true, tok, n_tok);
    free(text);
    return rc;
}

int kvt_chat_format(kvt_engine *e, const struct kvt_chat_msg *msgs, int32_t n, bool add_ass, const char *fallback, char **text) {
    *text = NULL;
    const char *tmpl = e->chat_template ? e->chat_template : llama_model_chat_template(e->model, NULL);
    if (!tmpl) tmpl = fallback ? fallback : "chatml";
    struct llama_chat_message *cm = malloc(sizeof *cm * (size_t) (n > 0 ? n : 1));
    if (!cm) return kvt__fail(KVT_ENOMEM, "chat messages");
    size_t total = 64;
    for (int32_t i = 0; i < n; i++) {
        const char *r = msgs[i].role;
        if (!r || (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant"))) {
            free(cm);
            return kvt__fail(KVT_EINVAL, "message %d has role '%s'; expected system, user or assistant", i, r ? r : "(null)");
        }
        cm[i].role = r;
        cm[i].content = msgs[i].content ? msgs[i].content : "";
        total += strlen(cm[i].content) + 64;
    }
    char *buf = malloc(total * 2);
    if (!buf) {
        free(cm);
        return kvt__fail(KVT_ENOMEM, "chat format");
    }
    int32_t r = llama_chat_apply_template(tmpl, cm, (size_t) n, add_ass, buf, (int32_t) (total * 2));
    if (r > (int32_t) (total * 2)) {
        char *b2 = realloc(buf, (size_t) r + 1);
        if (!b2) {
            free(buf);
            free(cm);
            return kvt__fail(KVT_ENOMEM, "chat format");
        }
        buf = b2;
        r = llama_chat_apply_template(tmpl, cm, (size_t) n, add_ass, buf, r + 1);
    }
    free(cm);
    if (r < 0) {
        free(buf);
        return kvt__fail(KVT_EINVAL, "chat template '%.40s' is not supported by llama_chat_apply_template", tmpl);
    }
    buf[r] = '\0';
    *text = buf;
    return 0;
}
