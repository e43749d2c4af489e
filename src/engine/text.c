/* text.c — tokens and text: tokenize, detokenize, end-of-generation, chat template (the GGUF's or
** a named llama.cpp built-in). */
#include "engine/engine_int.h"
#include "fault.h"
#include "test_hooks.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

/* llama_tokenize of text[0, len) into a buffer of its own: OUT *tokens (caller frees) / *n_tokens. */
static int tokenize_raw(const kvt_engine *e, const char *text, size_t len, bool add_special, bool parse_special, kvt_token **tokens,
                        int32_t *n_tokens) {
    int32_t cap = (int32_t) len + 8;
    kvt_token *t = malloc(sizeof(kvt_token) * (size_t) cap);
    if (!t) return kvt__fail(KVT_ENOMEM, "tokenize %zu bytes", len);
    int32_t n = llama_tokenize(e->vocab, text, (int32_t) len, t, cap, add_special, parse_special);
    if (n < 0) {
        cap = -n;
        kvt_token *t2 = realloc(t, sizeof(kvt_token) * (size_t) cap);
        if (!t2) {
            free(t);
            return kvt__fail(KVT_ENOMEM, "tokenize");
        }
        t = t2;
        n = llama_tokenize(e->vocab, text, (int32_t) len, t, cap, add_special, parse_special);
        if (n < 0) {
            free(t);
            return kvt__fail(KVT_ELLAMA, "llama_tokenize failed");
        }
    }
    *tokens = t;
    *n_tokens = n;
    return 0;
}

/* ---- the tokenizer's memo ----
**
** A chat client resends its conversation with every request, and another session may send the
** same long document: the texts kvt_chat_tokenize tokenizes mostly start with one tokenized a
** moment ago (a 3.7k-token prompt is 16-23 ms of llama_tokenize on a 2-core Xeon, more than the
** store takes to load its KV).  llama_tokenize(parse_special) first cuts the text at every
** occurrence of a special token's text (control, user-defined and unknown tokens, the longest
** first: llama-vocab.cpp's tokenizer_st_partition) and then tokenizes each piece between them on
** its own (SPM: a piece after a special token is tokenized as a text's first piece; BPE: every
** piece alone).  So where a control token that the cutting took out ends at byte b, the tokens
** before it are the first tokens of every text that starts with the same b bytes, and the rest
** is the tokens of text[b, len) tokenized alone, provided that
**   - no special token's text occurs across b in the new text (it is cut out before the
**     control token when longer, and the pieces differ): sp_across checks every one;
**   - the control token strips no whitespace around it (lstrip / rstrip attributes), and where
**     some special token strips whitespace to its left, the control token ends in none (that
**     token, cut out first, would eat it across the cut);
**   - the tokenizer appends nothing at the end (add_eos), and it is SPM or BPE (the two whose
**     piece-by-piece tokenizing this reads; the others are tokenized whole).
** The memo keeps the last KVT__TOK_MEMO texts of KVT__TOK_MEMO_MIN to _MAX bytes with their
** tokens and cuts; a text found whole takes all its tokens (llama_tokenize is deterministic).
** tests/unit/test_tokenize.c compares every answer with llama_tokenize of the whole text, on the
** reference models and on a vocabulary built to have a special token across a cut, with two
** controls that break the rules on purpose. */
#define KVT__TOK_MEMO_MIN 1024
#define KVT__TOK_MEMO_MAX (2u << 20) /* bytes: the memo holds at most 8 such texts with their tokens */

struct cuts {
    int32_t *tok;
    size_t *chr;
    int32_t n, cap;
};

static int cuts_push(struct cuts *c, int32_t tok, size_t chr) {
    if (c->n == c->cap) {
        const int32_t cap = c->cap ? c->cap * 2 : 32;
        int32_t *t = realloc(c->tok, sizeof *t * (size_t) cap);
        if (t) c->tok = t;
        size_t *h = t ? realloc(c->chr, sizeof *h * (size_t) cap) : NULL;
        if (!h) return kvt__fail(KVT_ENOMEM, "tokenizer memo");
        c->chr = h;
        c->cap = cap;
    }
    c->tok[c->n] = tok;
    c->chr[c->n++] = chr;
    return 0;
}

static void memo_clear(struct tok_memo *m) {
    free(m->text);
    free(m->tok);
    free(m->cut_tok);
    free(m->cut_chr);
    memset(m, 0, sizeof *m);
}

void kvt__engine_memo_free(kvt_engine *e) {
    for (int i = 0; i < KVT__TOK_MEMO; i++) memo_clear(&e->memo[i]);
    free(e->sp_text);
    free(e->sp_len);
    e->sp_text = NULL;
    e->sp_len = NULL;
    e->sp_built = false;
}

/* The table of the tokens llama.cpp cuts a text at, once per engine, under memo_mu. */
static int sp_build(kvt_engine *e) {
    if (e->sp_built) return 0;
    const enum llama_token_attr cut = LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_USER_DEFINED | LLAMA_TOKEN_ATTR_UNKNOWN;
    const int32_t nv = llama_vocab_n_tokens(e->vocab);
    int32_t count[256] = { 0 }, n = 0;
    for (kvt_token id = 0; id < nv; id++) {
        const char *t = (llama_vocab_get_attr(e->vocab, id) & cut) ? llama_vocab_get_text(e->vocab, id) : NULL;
        if (t && *t) {
            count[(uint8_t) t[0]]++;
            n++;
        }
    }
    e->sp_text = malloc(sizeof *e->sp_text * (size_t) (n ? n : 1));
    e->sp_len = malloc(sizeof *e->sp_len * (size_t) (n ? n : 1));
    if (!e->sp_text || !e->sp_len) {
        free(e->sp_text);
        free(e->sp_len);
        e->sp_text = NULL;
        e->sp_len = NULL;
        return kvt__fail(KVT_ENOMEM, "tokenizer memo: special tokens");
    }
    int32_t at[256];
    e->sp_first[0] = 0;
    for (int c = 0; c < 256; c++) {
        at[c] = e->sp_first[c];
        e->sp_first[c + 1] = e->sp_first[c] + count[c];
    }
    e->sp_max = 0;
    for (kvt_token id = 0; id < nv; id++) {
        const char *t = (llama_vocab_get_attr(e->vocab, id) & cut) ? llama_vocab_get_text(e->vocab, id) : NULL;
        if (!t || !*t) continue;
        const int32_t i = at[(uint8_t) t[0]]++;
        e->sp_text[i] = t;
        e->sp_len[i] = (uint32_t) strlen(t);
        e->sp_max = KVT_MAX(e->sp_max, e->sp_len[i]);
        e->sp_lstrip |= (llama_vocab_get_attr(e->vocab, id) & LLAMA_TOKEN_ATTR_LSTRIP) != 0;
    }
    e->sp_built = true;
    return 0;
}

/* True when a special token's text occurs in text[0, len) across byte b (from before b to past it). */
static bool sp_across(const kvt_engine *e, const char *text, size_t len, size_t b) {
    for (size_t s = b >= e->sp_max ? b - e->sp_max + 1 : 0; s < b; s++) {
        const uint8_t c = (uint8_t) text[s];
        for (int32_t i = e->sp_first[c]; i < e->sp_first[c + 1]; i++) {
            const size_t L = e->sp_len[i];
            if (s + L > b && s + L <= len && memcmp(text + s, e->sp_text[i], L) == 0) return true;
        }
    }
    return false;
}

/* The cuts of tok[k0, n), whose text starts at byte b0 of text[0, len), appended to *c: after each
** control token whose text is its vocabulary text (what the cutting takes out) and that strips
** no whitespace (mode 2, the unsafe control: after every token).  Stops at the first token whose
** text is not the text's next bytes (a space the tokenizer put in front, say): no cut past it.
** skip0: tok[k0] is the BOS kvt_tokenize(add_bos) adds (no text). */
static int memo_cuts(const kvt_engine *e, const char *text, size_t len, const kvt_token *tok, int32_t k0, int32_t n, size_t b0,
                     bool skip0, struct cuts *c) {
    char buf[256];
    size_t at = b0;
    for (int32_t i = k0 + (skip0 ? 1 : 0); i < n; i++) {
        const int32_t r = llama_token_to_piece(e->vocab, tok[i], buf, (int32_t) sizeof buf, 0, true);
        if (r < 0 || (size_t) r > len - at || memcmp(text + at, buf, (size_t) r) != 0) break;
        at += (size_t) r;
        const enum llama_token_attr a = llama_vocab_get_attr(e->vocab, tok[i]);
        bool cut = e->memo_mode == 2;
        if (!cut && (a & LLAMA_TOKEN_ATTR_CONTROL) && !(a & (LLAMA_TOKEN_ATTR_LSTRIP | LLAMA_TOKEN_ATTR_RSTRIP))) {
            const char *vt = llama_vocab_get_text(e->vocab, tok[i]);
            cut = r > 0 && vt && strlen(vt) == (size_t) r && memcmp(vt, buf, (size_t) r) == 0;
            /* a special token that strips whitespace to its left, cut out before this one, would
            ** eat this one's trailing whitespace in the whole text but not in the rest alone */
            cut = cut && !(e->sp_lstrip && isspace((unsigned char) buf[r - 1]));
        }
        if (cut && cuts_push(c, i + 1, at)) return KVT_ENOMEM;
    }
    return 0;
}

/* Bytes text a[0, na) and b[0, nb) share from the start. */
static size_t common_prefix(const char *a, size_t na, const char *b, size_t nb) {
    const size_t n = KVT_MIN(na, nb);
    size_t i = 0;
    while (i + 64 <= n && memcmp(a + i, b + i, 64) == 0) i += 64;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* Keeps text / tok / cuts (copied) in the memo, in place of the least recently used entry. */
static void memo_put(kvt_engine *e, const char *text, size_t len, bool add_bos, const kvt_token *tok, int32_t n,
                     const struct cuts *c) {
    struct tok_memo m = { 0 };
    m.text = malloc(len + 1);
    m.tok = malloc(sizeof *m.tok * (size_t) (n ? n : 1));
    m.cut_tok = malloc(sizeof *m.cut_tok * (size_t) (c->n ? c->n : 1));
    m.cut_chr = malloc(sizeof *m.cut_chr * (size_t) (c->n ? c->n : 1));
    if (!m.text || !m.tok || !m.cut_tok || !m.cut_chr || kvt__fault_check(KVT__FAULT_TOK_MEMO)) {
        memo_clear(&m); /* a memo less: the answer is right all the same */
        return;
    }
    memcpy(m.text, text, len + 1);
    m.len = len;
    memcpy(m.tok, tok, sizeof *tok * (size_t) n);
    m.n = n;
    m.add_bos = add_bos;
    if (c->n) {
        memcpy(m.cut_tok, c->tok, sizeof *c->tok * (size_t) c->n);
        memcpy(m.cut_chr, c->chr, sizeof *c->chr * (size_t) c->n);
    }
    m.n_cut = c->n;
    pthread_mutex_lock(&e->memo_mu);
    struct tok_memo *slot = &e->memo[0];
    for (int i = 0; i < KVT__TOK_MEMO; i++) {
        struct tok_memo *x = &e->memo[i];
        if (x->used && x->add_bos == add_bos && x->len == len && memcmp(x->text, text, len) == 0) {
            slot = NULL; /* a concurrent call put the same text */
            break;
        }
        if (x->used < slot->used) slot = x;
    }
    if (slot) {
        memo_clear(slot);
        *slot = m;
        slot->used = ++e->memo_clock;
    }
    pthread_mutex_unlock(&e->memo_mu);
    if (!slot) memo_clear(&m);
}

/* kvt_tokenize(text, add_bos, parse_special = true) through the memo.  Returns 0 with the tokens,
** or an error of allocation or llama_tokenize. */
static int memo_tokenize(kvt_engine *e, const char *text, size_t len, bool add_bos, kvt_token **tokens, int32_t *n_tokens) {
    struct cuts c = { 0 };
    kvt_token *pre = NULL, *suf = NULL;
    int32_t k = 0, n_suf = 0;
    size_t b = 0;
    int rc = 0;
    pthread_mutex_lock(&e->memo_mu);
    if (sp_build(e) == 0) {
        struct tok_memo *best = NULL;
        int32_t best_j = -1;
        for (int i = 0; i < KVT__TOK_MEMO; i++) {
            struct tok_memo *m = &e->memo[i];
            if (!m->used || m->add_bos != add_bos) continue;
            const size_t common = common_prefix(m->text, m->len, text, len);
            if (common == len && m->len == len) { /* the same text: its tokens */
                kvt_token *t = malloc(sizeof *t * (size_t) (m->n ? m->n : 1));
                if (t) {
                    memcpy(t, m->tok, sizeof *t * (size_t) m->n);
                    m->used = ++e->memo_clock;
                    e->memo_tokens += m->n;
                    *tokens = t;
                    *n_tokens = m->n;
                }
                pthread_mutex_unlock(&e->memo_mu);
                return t ? 0 : kvt__fail(KVT_ENOMEM, "tokenize %zu bytes", len);
            }
            int32_t lo = 0, hi = m->n_cut; /* the first cut past common */
            while (lo < hi) {
                const int32_t mid = lo + (hi - lo) / 2;
                if (m->cut_chr[mid] <= common) lo = mid + 1;
                else hi = mid;
            }
            for (int32_t j = lo - 1; j >= 0 && (!best || m->cut_chr[j] > best->cut_chr[best_j]); j--)
                if (e->memo_mode == 3 || !sp_across(e, text, len, m->cut_chr[j])) {
                    best = m;
                    best_j = j;
                    break;
                }
        }
        if (best) {
            k = best->cut_tok[best_j];
            b = best->cut_chr[best_j];
            pre = kvt__fault_check(KVT__FAULT_TOK_MEMO) ? NULL : malloc(sizeof *pre * (size_t) k);
            for (int32_t j = 0; pre && j <= best_j && cuts_push(&c, best->cut_tok[j], best->cut_chr[j]) == 0; j++)
                ;
            if (pre && c.n == best_j + 1) {
                memcpy(pre, best->tok, sizeof *pre * (size_t) k);
                best->used = ++e->memo_clock;
                e->memo_tokens += k;
            } else {
                k = 0;
                b = 0;
                c.n = 0;
            }
        }
    }
    pthread_mutex_unlock(&e->memo_mu);
    kvt__clear_error(); /* a memo that could not be used: the whole text is tokenized */
    if ((rc = tokenize_raw(e, text + b, len - b, b == 0 && add_bos, true, &suf, &n_suf))) goto out;
    kvt_token *all = suf;
    if (k > 0) {
        if (!(all = malloc(sizeof *all * (size_t) (k + n_suf)))) {
            rc = kvt__fail(KVT_ENOMEM, "tokenize %zu bytes", len);
            goto out;
        }
        memcpy(all, pre, sizeof *all * (size_t) k);
        memcpy(all + k, suf, sizeof *all * (size_t) n_suf);
        free(suf);
        suf = NULL;
    } else suf = NULL;
    const bool skip0 = b == 0 && add_bos && k + n_suf > 0 && llama_vocab_get_add_bos(e->vocab) &&
                       all[0] == llama_vocab_bos(e->vocab);
    if (memo_cuts(e, text, len, all, k, k + n_suf, b, skip0, &c) == 0) memo_put(e, text, len, add_bos, all, k + n_suf, &c);
    kvt__clear_error();
    *tokens = all;
    *n_tokens = k + n_suf;
out:
    free(pre);
    free(suf);
    free(c.tok);
    free(c.chr);
    return rc;
}

int kvt_tokenize(kvt_engine *e, const char *text, bool add_bos, bool parse_special, kvt_token **tokens, int32_t *n_tokens) {
    *tokens = NULL;
    *n_tokens = 0;
    if (!text) return kvt__fail(KVT_EINVAL, "tokenize: NULL text");
    const enum llama_vocab_type vt = llama_vocab_type(e->vocab);
    if (vt == LLAMA_VOCAB_TYPE_NONE) return kvt__fail(KVT_EINVAL, "model '%s' has no tokenizer", e->model_path);
    size_t len = strlen(text);
    if (len > INT32_MAX / 2) return kvt__fail(KVT_EINVAL, "text of %zu bytes is too long to tokenize", len);
    if (parse_special && len >= KVT__TOK_MEMO_MIN && len <= KVT__TOK_MEMO_MAX && e->memo_mode != 1 &&
        (vt == LLAMA_VOCAB_TYPE_SPM || vt == LLAMA_VOCAB_TYPE_BPE) && !(add_bos && llama_vocab_get_add_eos(e->vocab)))
        return memo_tokenize(e, text, len, add_bos, tokens, n_tokens);
    return tokenize_raw(e, text, len, add_bos, parse_special, tokens, n_tokens);
}

void kvt_engine_test_tokenize_memo(kvt_engine *e, int mode) {
    e->memo_mode = mode;
    for (int i = 0; i < KVT__TOK_MEMO; i++) memo_clear(&e->memo[i]);
}

int64_t kvt_engine_test_memo_tokens(const kvt_engine *e) { return e->memo_tokens; }

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
