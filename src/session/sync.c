/* sync.c — the conversation: messages, the chat template's text as decoded so far (kv_text) and
** its segment boundaries, cut-back of a diverging history (to a message boundary or the first
** differing token), the template tokens not yet in the stream.  session/prefill.c runs a new
** message through them. */
#include "session/session_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvt__sess_push_msg(kvt_session *s, int role, const char *text, int keep) {
    if (s->conv.n_m == s->conv.cap_m) {
        int32_t cap = s->conv.cap_m ? 2 * s->conv.cap_m : 16;
        struct msg *nm = realloc(s->conv.m, sizeof *nm * (size_t) cap);
        if (!nm) return kvt__fail(KVT_ENOMEM, "messages");
        s->conv.m = nm;
        s->conv.cap_m = cap;
    }
    if (!(s->conv.m[s->conv.n_m].content = strdup(text))) return kvt__fail(KVT_ENOMEM, "message of %zu bytes", strlen(text));
    s->conv.m[s->conv.n_m].role = role;
    s->conv.m[s->conv.n_m].keep = keep;
    s->conv.n_m++;
    return 0;
}

/* kv_text becomes fmt (owned by the session from here), a segment boundary at the current end of
** the stream.  Cannot fail: a boundary that cannot be recorded only makes later cut-backs go
** further back. */
void kvt__sess_set_text(kvt_session *s, char *fmt) { kvt__sess_set_text_at(s, fmt, s->total); }

void kvt__sess_set_text_at(kvt_session *s, char *fmt, int32_t at) {
    free(s->conv.kv_text);
    s->conv.kv_text = fmt;
    if (s->conv.n_seg == s->conv.cap_seg) {
        int32_t cap = s->conv.cap_seg ? 2 * s->conv.cap_seg : 16;
        int32_t *t = realloc(s->conv.seg_tok, sizeof *t * (size_t) cap);
        if (t) s->conv.seg_tok = t;
        size_t *c = realloc(s->conv.seg_chr, sizeof *c * (size_t) cap);
        if (c) s->conv.seg_chr = c;
        if (!t || !c) return;
        s->conv.cap_seg = cap;
    }
    s->conv.seg_tok[s->conv.n_seg] = at;
    s->conv.seg_chr[s->conv.n_seg] = strlen(fmt);
    s->conv.n_seg++;
}

/* Cut the stream (the conversation's tokens in the order they were said, i.e. the blocks by id)
** back to its first `keep` tokens: later blocks leave the cache and the pool; the open tail block
** and a block cut in the middle that is resident at the physical tail are trimmed in place (a
** sealed one is unsealed: its saved copy is deleted and it is saved again when it fills); any
** other block cut in the middle is dropped and its first tokens are decoded again at the tail.
** Positions continue after the highest resident one. */
int kvt__sess_cut_stream(kvt_session *s, int32_t keep) {
    int32_t acc = 0, i = 0;
    while (i < s->n_b && acc + s->b[i].info.n_tokens <= keep) acc += s->b[i].info.n_tokens, i++;
    const int32_t r = keep - acc;
    int32_t n_re = 0, re_role = KVT_ROLE_USER, n_keep = i;
    kvt_token *re = NULL;
    for (int32_t j = s->n_b - 1; j > i; j--) kvt__sess_drop_block(s, &s->b[j]);
    if (i < s->n_b) {
        struct blk *b = &s->b[i];
        if (r > 0 && b->info.residency == KVT_RES_DEVICE &&
            b->info.p0 + b->info.n_tokens - 1 == kvt_seq_pos_max(s->eng, s->p.seq)) {
            /* the physical tail: trim its cells in place; it is the open block again */
            kvt_seq_rm(s->eng, s->p.seq, b->info.p0 + r, b->info.p0 + b->info.n_tokens);
            for (int32_t cut = b->info.n_tokens - r; cut > 0;) { /* per-token roles are not kept: newest role first */
                int k = b->role_n[KVT_ROLE_ASSISTANT] ? KVT_ROLE_ASSISTANT
                        : b->role_n[KVT_ROLE_USER]    ? KVT_ROLE_USER
                                                      : KVT_ROLE_SYSTEM;
                int32_t d = KVT_MIN(cut, b->role_n[k]);
                b->role_n[k] -= d;
                cut -= d;
                if (d == 0) break;
            }
            if (b->info.sealed) kvt__sess_copy_del(s, b);
            b->info.sealed = false;
            if (s->rcv.ann && b->emb) kvt_ann_remove(s->rcv.ann, (uint64_t) b->info.id); /* embedded again when resealed */
            kvt__clear_error();
            free(b->emb);
            b->emb = NULL;
            b->info.n_tokens = r;
            s->open = i;
            n_keep = i + 1;
        } else {
            if (r > 0) { /* elsewhere: dropped, its first r tokens decoded again at the tail */
                if (!(re = malloc(sizeof(kvt_token) * (size_t) r))) return kvt__fail(KVT_ENOMEM, "cut back");
                memcpy(re, b->tok, sizeof(kvt_token) * (size_t) r);
                n_re = r;
                re_role = kvt__sess_block_role(b);
            }
            kvt__sess_drop_block(s, b);
        }
    }
    if (s->open >= n_keep) s->open = -1;
    s->n_b = n_keep;
    if (keep < s->dec.prompt_total) s->dec.prompt_total = -1; /* those logits are no longer the stream's */
    s->next_pos = kvt_seq_pos_max(s->eng, s->p.seq) + 1;
    s->total = keep - n_re;
    s->dec.have_logits = false;
    int rc = n_re > 0 ? kvt__sess_feed(s, re, n_re, re_role, 0) : 0;
    free(re);
    return rc;
}

/* The template's tokens of fmt[from, strlen(fmt)) from the prompt's tokens its caller gave,
** when they are provably what kvt_tokenize(fmt + from, add_bos = from == 0, parse_special) gives:
** fmt is a prefix of the given tokens' text, and both ends of the span fall between tokens, each
** either the text's edge or before a token the tokenizer splits at (a special token: llama.cpp
** tokenizes the text between special tokens piece by piece, so a span from one to the next is
** tokenized alone as it is in the whole).  Returns 0 with *tok (caller frees) / *n, 1 when the
** given tokens cannot say (tokenize instead), or KVT_ENOMEM. */
/* The first token at or after lo whose text ends past byte `at` (ends[] is non-decreasing); n if none. */
static int32_t first_ending_past(const struct sess_given *g, int32_t lo, size_t at) {
    int32_t hi = g->n;
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo) / 2;
        if (g->ends[mid] <= at) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static int given_tokens(kvt_session *s, const char *fmt, size_t from, kvt_token **tok, int32_t *n) {
    struct sess_given *g = s->conv.given;
    const size_t len = strlen(fmt);
    if (!g || len > g->len || memcmp(g->text, fmt, len) != 0) return 1;
    /* k0: the first token of the span (from == 0: the first token, the BOS with it); k1: one past
    ** its last (ends[] is non-decreasing) */
    int32_t k0 = 0;
    if (from > 0) {
        k0 = first_ending_past(g, 0, from);
        if (k0 == 0 || g->ends[k0 - 1] != from || k0 == g->n || !g->split[k0]) return 1;
    }
    const int32_t k1 = first_ending_past(g, k0, len);
    if (k1 <= k0 || g->ends[k1 - 1] != len || (k1 < g->n && !g->split[k1])) return 1;
    if (!(*tok = malloc(sizeof(kvt_token) * (size_t) (k1 - k0)))) return kvt__fail(KVT_ENOMEM, "prompt tokens");
    memcpy(*tok, g->tok + k0, sizeof(kvt_token) * (size_t) (k1 - k0));
    *n = k1 - k0;
    g->used += *n;
    kvt__sess_explain(s, "%d tokens taken from the request's tokens [%d, %d) (not tokenized again)", *n, k0, k1);
    return 0;
}

/* Tokens of the stream (blocks by id) that equal tok[0..n) from the start. */
static int32_t stream_common(const kvt_session *s, const kvt_token *tok, int32_t n) {
    int32_t c = 0;
    for (int32_t i = 0; i < s->n_b; i++)
        for (int32_t k = 0; k < s->b[i].info.n_tokens; k++, c++)
            if (c >= n || s->b[i].tok[k] != tok[c]) return c;
    return c;
}

/* The formatted conversation fmt diverges from kv_text after `common` bytes.  A cut at the last
** segment boundary (a message boundary) would drop everything after it, also what the two share
** inside the message where they differ (two requests that open with the same long document and
** then ask different questions).  Instead, when the template's tokens of fmt share more tokens
** with the stream than that boundary holds, cut the stream at the first token that differs:
** the stream then continues with fmt's own tokens from there, *tok / *n (caller frees), and holds
** exactly the template's tokens of fmt.  Returns 1 when the boundary keeps at least as much or
** the cut point cannot be mapped back to a byte of fmt (the tokens' text is not a suffix of fmt),
** else 0 or an error of cut_stream / allocation. */
static int cut_to_common_tokens(kvt_session *s, const char *fmt, size_t common, kvt_token **tok, int32_t *n) {
    int32_t k = s->conv.n_seg - 1;
    while (k >= 0 && s->conv.seg_chr[k] > common) k--;
    const int32_t at_boundary = k >= 0 ? s->conv.seg_tok[k] : 0;
    kvt_token *all = NULL;
    int32_t n_all = 0;
    int rg = given_tokens(s, fmt, 0, &all, &n_all);
    if (rg == 1) rg = kvt_tokenize(s->eng, fmt, true, true, &all, &n_all);
    if (rg) {
        kvt__clear_error();
        return 1;
    }
    const int32_t c = stream_common(s, all, n_all);
    char *tail = NULL;
    size_t len = strlen(fmt), n_tail = 0;
    bool ok = c > at_boundary;
    if (ok && c < n_all) {
        ok = kvt_detokenize(s->eng, all + c, n_all - c, true, &tail) == 0 && (n_tail = strlen(tail)) <= len &&
             !strcmp(fmt + len - n_tail, tail);
        kvt__clear_error();
    }
    /* the text of all[0..c) is fmt[0..off), which kv_text holds too.  off 0 (only the BOS the
    ** tokenizer adds in common): an empty kv_text says "nothing decoded, the next text gets a BOS",
    ** so the stream must be empty too: the boundary's cut */
    const size_t off = len - n_tail;
    if (!ok || off > common || off == 0) {
        free(tail);
        free(all);
        return 1;
    }
    free(tail);
    int rc = kvt__sess_cut_stream(s, c);
    if (rc) {
        free(all);
        return rc;
    }
    while (s->conv.n_seg > 0 && (s->conv.seg_tok[s->conv.n_seg - 1] > c || s->conv.seg_chr[s->conv.n_seg - 1] > off))
        s->conv.n_seg--;
    s->conv.kv_text[off] = '\0';
    memmove(all, all + c, sizeof(kvt_token) * (size_t) (n_all - c));
    *tok = all;
    *n = n_all - c;
    return 0;
}

/* Tokens of the template text that is not yet in the stream (the conversation formatted with
** the assistant prefix, minus what was already decoded).  When the formatted conversation
** diverges from what was decoded (two user messages in a row replace the assistant prefix; a
** client edits its history), the stream is first cut back to the last segment boundary before
** the divergence, so the stream always holds exactly the template's tokens. */
int kvt__sess_pending_tokens(kvt_session *s, int32_t n_msgs, bool add_ass, kvt_token **tok, int32_t *n, char **fmt_out) {
    struct kvt_chat_msg *cm = malloc(sizeof *cm * (size_t) (n_msgs > 0 ? n_msgs : 1));
    if (!cm) return kvt__fail(KVT_ENOMEM, "chat");
    for (int32_t i = 0; i < n_msgs; i++)
        cm[i] = (struct kvt_chat_msg){ kvt__sess_role_name[s->conv.m[i].role], s->conv.m[i].content };
    char *fmt = NULL;
    int rc = kvt_chat_format(s->eng, cm, n_msgs, add_ass, s->p.template_fallback, &fmt);
    free(cm);
    if (rc) return rc;
    size_t common = 0, have = strlen(s->conv.kv_text);
    while (common < have && fmt[common] == s->conv.kv_text[common]) common++;
    *tok = NULL;
    *n = 0;
    if (common < have && (rc = cut_to_common_tokens(s, fmt, common, tok, n)) != 1) {
        if (rc) {
            free(fmt);
            return rc;
        }
        *fmt_out = fmt;
        return 0;
    }
    if (common < have) {
        int32_t k = s->conv.n_seg - 1;
        while (k >= 0 && s->conv.seg_chr[k] > common) k--;
        if ((rc = kvt__sess_cut_stream(s, k >= 0 ? s->conv.seg_tok[k] : 0))) {
            free(fmt);
            return rc;
        }
        s->conv.n_seg = k + 1;
        common = have = k >= 0 ? s->conv.seg_chr[k] : 0;
        s->conv.kv_text[have] = '\0';
    }
    if (fmt[common] == '\0') {
        *fmt_out = fmt;
        return 0;
    }
    if ((rc = given_tokens(s, fmt, common, tok, n)) == 1) rc = kvt_tokenize(s->eng, fmt + common, have == 0, true, tok, n);
    if (rc) {
        free(fmt);
        return rc;
    }
    *fmt_out = fmt;
    return 0;
}

int kvt__sess_prefix_tokens(kvt_session *s, const char *fmt_msg, kvt_token **tok, int32_t *n, char **fmt_out) {
    *tok = NULL;
    *n = 0;
    *fmt_out = NULL;
    struct kvt_chat_msg *cm = malloc(sizeof *cm * (size_t) (s->conv.n_m > 0 ? s->conv.n_m : 1));
    if (!cm) return kvt__fail(KVT_ENOMEM, "chat");
    for (int32_t i = 0; i < s->conv.n_m; i++)
        cm[i] = (struct kvt_chat_msg){ kvt__sess_role_name[s->conv.m[i].role], s->conv.m[i].content };
    char *fmt = NULL;
    int rc = kvt_chat_format(s->eng, cm, s->conv.n_m, true, s->p.template_fallback, &fmt);
    free(cm);
    if (rc) return rc;
    const size_t k = strlen(fmt_msg);
    /* what kvt__sess_pending_tokens gives once fmt_msg is kv_text: the rest, no BOS (from the
    ** request's tokens when they can say) */
    if (strncmp(fmt, fmt_msg, k) != 0 || fmt[k] == '\0') {
        free(fmt);
        return 0;
    }
    if ((rc = given_tokens(s, fmt, k, tok, n)) == 1) rc = kvt_tokenize(s->eng, fmt + k, false, true, tok, n);
    if (rc) {
        free(fmt);
        return rc;
    }
    *fmt_out = fmt;
    return 0;
}

/* A generated reply is in the stream: it becomes an assistant message, and kv_text is extended
** by the reply as the template renders it (templates trim messages: "gemma" strips the leading
** space of " Sure"), so that the next turn's formatted conversation extends kv_text and the
** reply's generated tokens are kept (canonicalised) instead of being cut back and re-decoded.
** If the template's rendering cannot be found, the raw text is appended. */
int kvt__sess_append_reply(kvt_session *s, const char *text, size_t n_dec) {
    int rc = kvt__sess_push_msg(s, KVT_ROLE_ASSISTANT, text, KVT_KEEP_NONE);
    if (rc) return rc;
    s->conv.n_m_decoded = s->conv.n_m;
    size_t a = strlen(s->conv.kv_text), b = strlen(text);
    const char *t0 = text, *t1 = text + b;
    while (t0 < t1 && (*t0 == ' ' || *t0 == '\n' || *t0 == '\t' || *t0 == '\r')) t0++;
    while (t1 > t0 && (t1[-1] == ' ' || t1[-1] == '\n' || t1[-1] == '\t' || t1[-1] == '\r')) t1--;
    if (n_dec < b) b = n_dec; /* the text after the decoded part is the next turn's */
    if (n_dec < (size_t) (t1 - text)) t1 = KVT_MAX(t0, text + n_dec);
    struct kvt_chat_msg *cm = malloc(sizeof *cm * (size_t) s->conv.n_m);
    char *fmt = NULL;
    if (cm) {
        for (int32_t i = 0; i < s->conv.n_m; i++)
            cm[i] = (struct kvt_chat_msg){ kvt__sess_role_name[s->conv.m[i].role], s->conv.m[i].content };
        if (kvt_chat_format(s->eng, cm, s->conv.n_m, false, s->p.template_fallback, &fmt)) fmt = NULL;
        free(cm);
    }
    kvt__clear_error();
    if (fmt && !strncmp(fmt, s->conv.kv_text, a)) {
        size_t n = (size_t) (t1 - t0);
        char *hit = n ? NULL : fmt + a;
        for (char *p = fmt + a; n && *p; p++)
            if (!strncmp(p, t0, n)) {
                hit = p;
                break;
            }
        if (hit) {
            hit[n] = '\0';
            kvt__sess_set_text(s, fmt);
            return 0;
        }
    }
    free(fmt);
    char *kv = malloc(a + b + 1);
    if (!kv) return kvt__fail(KVT_ENOMEM, "reply text");
    memcpy(kv, s->conv.kv_text, a);
    memcpy(kv + a, text, b);
    kv[a + b] = '\0';
    kvt__sess_set_text(s, kv);
    return 0;
}

/* The stream ends with a token whose logits are not kept (nothing was decoded after a cut back):
** decode its last token again. */
int kvt__sess_refresh_logits(kvt_session *s) {
    if (s->dec.have_logits || s->n_b == 0) return 0;
    struct blk *b = &s->b[s->n_b - 1];
    if (b->info.residency != KVT_RES_DEVICE || b->info.n_tokens == 0) return kvt__fail(KVT_EINVAL, "no user turn to reply to");
    kvt_token t = b->tok[b->info.n_tokens - 1];
    int role = kvt__sess_block_role(b);
    int rc = kvt__sess_cut_stream(s, s->total - 1);
    if (rc == 0 && s->conv.n_seg > 0 && s->conv.seg_tok[s->conv.n_seg - 1] > s->total)
        s->conv.seg_tok[s->conv.n_seg - 1] = s->total + 1;
    return rc ? rc : kvt__sess_feed(s, &t, 1, role, 0);
}

int32_t kvt_session_n_messages(const kvt_session *s) { return s->conv.n_m; }

int32_t kvt_session_tokens(const kvt_session *s, kvt_token *out, int32_t n_max) {
    int32_t c = 0;
    for (int32_t i = 0; i < s->n_b; i++) {
        const struct blk *b = &s->b[i];
        int32_t m = KVT_MIN(b->info.n_tokens, n_max - c);
        if (m > 0) memcpy(out + c, b->tok, sizeof(kvt_token) * (size_t) m);
        c += b->info.n_tokens;
    }
    return c;
}

int kvt_session_message(const kvt_session *s, int32_t i, struct kvt_chat_msg *msg) {
    if (i < 0 || i >= s->conv.n_m) return kvt__fail(KVT_EINVAL, "message %d is outside 0..%d", i, s->conv.n_m - 1);
    msg->role = kvt__sess_role_name[s->conv.m[i].role];
    msg->content = s->conv.m[i].content;
    return 0;
}
