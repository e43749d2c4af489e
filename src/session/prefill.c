/* prefill.c — a conversation's prompt through the session, as steps the caller drives.
**
** kvt_session_sync's pipeline (struct kvt_prefill), message by message: the text of messages not
** yet decoded goes in first, then the new user message's tokens (evicted blocks relevant to it
** are recovered before it; InfLLM: after it), then the assistant prefix; each goes in as a run of
** tokens (feed.c).  Every decode of a prefill chunk is handed to the caller (kvt_prefill_next)
** and its result taken back (kvt_prefill_done): the session never calls into the caller, and a
** server decodes the chunk where it likes (alone, or in the step of its other requests); there
** the message's end and the assistant prefix go out as one chunk where a block holds both (one
** weight pass, not two).  kvt_session_sync and kvt_session_add run the same steps, decoding every
** chunk alone and the message and its prefix as two chunks (the numbers of earlier versions: a
** joined chunk is another ubatch shape, other float rounding). */
#include "session/session_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a conversation, step by step --------------------------------------------------------- */

/* Where a prefill stands: the message being added and what comes next for it. */
enum pf_phase {
    PF_MESSAGE,        /* add message i (a user message starts the steps below) */
    PF_PENDING_FED,    /* the text of earlier messages not yet decoded went in */
    PF_MESSAGE_TOKENS, /* the message's tokens; recovery before it */
    PF_INFLLM_FED,     /* InfLLM: the message went in; recovery by its queries, then the prefix */
    PF_MESSAGE_FED,    /* the message went in */
    PF_PREFIX_FED,     /* the assistant prefix went in */
    PF_LOGITS,         /* every message is in: logits of the last token */
    PF_DONE
};

struct kvt_prefill {
    kvt_session *s;
    const struct kvt_chat_msg *msgs; /* [n_msgs] the caller's, valid until kvt_prefill_end */
    int32_t n_msgs, i;               /* the message being added */
    int32_t history;                 /* messages before this index go in with it as one run (see pf_new) */
    int32_t keep;                    /* its keep hint (kvt_session_add), else KVT_KEEP_NONE */
    bool sync;                       /* kvt_session_sync: logits refreshed and a kvt_sync_info */
    bool join;                       /* kvt_session_prefill: a message's end and its assistant prefix
                                     ** in one chunk where the block allows (pf_join_prefix) */
    enum pf_phase phase;
    int rc;                  /* the first error; the prefill stops there */
    char msg[512];           /* its message (the caller may make library calls meanwhile) */
    struct feed f;           /* the run being fed, when feeding */
    bool feeding, chunk_out; /* a run is being fed; one of its chunks is out */
    enum pf_phase after;     /* the phase that takes the run's result */
    kvt_token *tok, *tc;     /* the message's tokens; InfLLM: those without the prefix */
    int32_t n, nc;
    char *fmt, *fc;          /* the template text they complete */
    int32_t n_msg;           /* > 0: tok[0, n_msg) is the message and tok[n_msg, n) its assistant prefix, */
    char *fp;                /*   whose template text is fp (one run: struct feed's split) */
    int32_t total0;          /* the stream before the message's first run (the pending text, else the message): */
    size_t text0;            /*   what a failure cuts the stream and kv_text back to; total0 -1: nothing fed yet */
    int32_t decoded0;        /*  conv.n_m_decoded then */
    int32_t prefix0;         /* the stream before the assistant prefix: what its failure cuts back to (-1: none) */
    struct sess_given given; /* the caller's tokens (kvt_session_prefill_tokens), when given.text */
    /* the session's counters when the prefill began (kvt_sync_info is their difference) */
    int64_t dec0, rec0, ev0, nrec0, rc0, want0, got0, ch0, chr0;
};

static void pf_free_text(struct kvt_prefill *pf) {
    free(pf->tok);
    free(pf->tc);
    free(pf->fmt);
    free(pf->fc);
    free(pf->fp);
    pf->tok = pf->tc = NULL;
    pf->fmt = pf->fc = pf->fp = NULL;
    pf->n = pf->nc = pf->n_msg = 0;
}

/* Start feeding tok[0..n) (nothing to feed: the run's result, 0, goes straight to `after`). */
static void pf_feed(struct kvt_prefill *pf, const kvt_token *tok, int32_t n, int role, int32_t reserve, enum pf_phase after) {
    static const char *const what[] = { [PF_PENDING_FED] = "the text of earlier messages",
                                        [PF_INFLLM_FED] = "the message (InfLLM: recovery after it)",
                                        [PF_MESSAGE_FED] = "the message",
                                        [PF_PREFIX_FED] = "the assistant prefix" };
    const char *w = pf->phase == PF_INFLLM_FED ? "the assistant prefix (after InfLLM's recovery)" : what[after];
    pf->after = after;
    pf->phase = after;
    kvt__sess_explain(pf->s, "feed %d tokens: %s, at token %d (recorded as %s)", n, w ? w : "?", pf->s->total,
                      kvt__sess_role_name[role]);
    if (n <= 0) return;
    kvt__sess_feed_init(&pf->f, tok, n, role, reserve);
    pf->feeding = true;
}

/* The stream and kv_text back to total tokens and text bytes (what they were before a run that
** failed), so that the stream holds exactly the template's tokens of kv_text again.  The error
** rc and its message are kept (cutting clears the message). */
static int pf_cut_back(struct kvt_prefill *pf, int rc, int32_t total, size_t text) {
    kvt_session *s = pf->s;
    if (total < 0) return rc;
    char m[512];
    snprintf(m, sizeof m, "%s", kvt_errmsg());
    int rc2 = s->total > total ? kvt__sess_cut_stream(s, total) : 0;
    if (strlen(s->conv.kv_text) > text) s->conv.kv_text[text] = '\0';
    while (s->conv.n_seg > 0 && (s->conv.seg_tok[s->conv.n_seg - 1] > total || s->conv.seg_chr[s->conv.n_seg - 1] > text))
        s->conv.n_seg--;
    if (rc2) return kvt__fail(rc, "%s (and cutting its decoded part back failed: %s)", m, kvt_strerror(rc2));
    return kvt__fail(rc, "%s", m);
}

/* The message being added failed: it is not part of the conversation, nor are its tokens, nor
** the text of earlier messages decoded with it (a system prompt, replayed replies).  The chunks
** already decoded (a prefill stopped by its caller, KVT_ECANCELED, or failed mid-way) are cut
** back, or the next call would find them in the stream but not in kv_text and reply to a
** conversation holding a fragment of a message nobody sent (issues #24, #38). */
static int pf_fail_message(struct kvt_prefill *pf, int rc) {
    kvt_session *s = pf->s;
    pf_free_text(pf);
    s->cur_keep = KVT_KEEP_NONE;
    if (pf->total0 >= 0 && s->conv.n_m_decoded > pf->decoded0) s->conv.n_m_decoded = pf->decoded0; /* their text goes too */
    if (s->conv.n_m_decoded < s->conv.n_m) free(s->conv.m[--s->conv.n_m].content);
    return pf_cut_back(pf, rc, pf->total0, pf->text0);
}

/* The assistant prefix's tokens appended to the message's (pf->tok, pf->n, pf->fmt): n_msg, fp set.
** A template that adds no prefix, or whose text with it does not extend the message's, leaves the
** message alone (the prefix then goes as a run of its own, as after an own-tail recovery). */
static int pf_join_prefix(struct kvt_prefill *pf) {
    if (pf->n == 0) return 0; /* the message is in already: its prefix alone */
    kvt_token *tp = NULL;
    int32_t np = 0;
    char *fp = NULL;
    int rc = kvt__sess_prefix_tokens(pf->s, pf->fmt, &tp, &np, &fp);
    if (rc || np == 0) {
        free(tp);
        free(fp);
        return rc;
    }
    kvt_token *t = realloc(pf->tok, sizeof *t * (size_t) (pf->n + np));
    if (!t) {
        free(tp);
        free(fp);
        return kvt__fail(KVT_ENOMEM, "prompt tokens");
    }
    memcpy(t + pf->n, tp, sizeof *t * (size_t) np);
    free(tp);
    pf->tok = t;
    pf->n_msg = pf->n;
    pf->n += np;
    pf->fp = fp;
    return 0;
}

/* The work of the current phase up to the next run to feed, or to the end.  A run's result
** arrives as res (0 when there was nothing to feed).  Errors of the message's own steps go
** through pf_fail_message; those after it is in (the own-tail recovery, the assistant prefix)
** leave it in the conversation. */
static int pf_advance(struct kvt_prefill *pf, int res) {
    kvt_session *s = pf->s;
    int rc = 0;
    switch (pf->phase) {
        case PF_MESSAGE: {
            if (pf->i == pf->n_msgs) {
                pf->phase = PF_LOGITS;
                return 0;
            }
            const struct kvt_chat_msg *m = &pf->msgs[pf->i];
            const int role = kvt__sess_role_from_name(m->role);
            if ((rc = kvt__sess_push_msg(s, role, m->content, pf->keep))) return rc;
            if (role != KVT_ROLE_USER || pf->i < pf->history) {
                pf->i++;
                return 0;
            } /* decoded with the next user turn */
            pf->total0 = -1;
            s->turn++;
            s->reuse.route_want = s->reuse.route_tokens = 0;
            /* text of messages added since the last decode (assistant replies a client replays,
        ** system prompts) goes in first, so recovered blocks never split a turn */
            if (s->conv.n_m_decoded < s->conv.n_m - 1) {
                if ((rc = kvt__sess_pending_tokens(s, s->conv.n_m - 1, false, &pf->tok, &pf->n, &pf->fmt)))
                    return pf_fail_message(pf, rc);
                pf->total0 = s->total; /* a failure from here on cuts the pending text back too */
                pf->text0 = strlen(s->conv.kv_text);
                pf->decoded0 = s->conv.n_m_decoded;
                s->cur_keep = KVT_KEEP_NONE;
                for (int32_t i = s->conv.n_m_decoded; i < s->conv.n_m - 1; i++)
                    s->cur_keep = KVT_MAX(s->cur_keep, s->conv.m[i].keep);
                pf_feed(pf, pf->tok, pf->n, s->conv.m[s->conv.n_m - 2].role, 0, PF_PENDING_FED);
                pf->f.logits = false;                      /* the user message follows it (logits: the output projection) */
                if (pf->history > 0) pf->f.routed = false; /* a history in one run: its prefix may be in the store */
                return 0;
            }
            pf->phase = PF_MESSAGE_TOKENS;
            return 0;
        }
        case PF_PENDING_FED:
            s->cur_keep = KVT_KEEP_NONE;
            if (res) return pf_fail_message(pf, res);
            kvt__sess_set_text(s, pf->fmt);
            pf->fmt = NULL;
            pf_free_text(pf);
            s->conv.n_m_decoded = s->conv.n_m - 1;
            pf->phase = PF_MESSAGE_TOKENS;
            return 0;
        case PF_MESSAGE_TOKENS: {
            /* the new user message (the assistant prefix follows as its own segment, so a message
        ** added after it replaces only the prefix) */
            const bool infllm = s->p.policy == KVT_POLICY_INFLLM;
            if ((rc = kvt__sess_pending_tokens(s, s->conv.n_m, infllm, &pf->tok, &pf->n, &pf->fmt))) return pf_fail_message(pf, rc);
            if (pf->total0 < 0 || s->total < pf->total0) { /* no pending text went first (or the stream was cut below it) */
                pf->total0 = s->total;
                pf->text0 = strlen(s->conv.kv_text);
                pf->decoded0 = s->conv.n_m_decoded;
            }
            struct kvt_engine_info I;
            kvt_engine_info(s->eng, &I);
            /* a message longer than the budget is served (its own blocks are evicted while it is
        ** prefilled, positions stay below n_ctx_train by compaction); one longer than the whole
        ** context is not */
            if (pf->n + s->p.gen_reserve > I.n_ctx)
                return pf_fail_message(
                    pf, kvt__fail(KVT_ECTX, "the message is %d tokens; the context holds %d (with %d reserved for the reply)",
                                  pf->n, I.n_ctx, s->p.gen_reserve));
            /* evicted blocks relevant to it come back right before it (InfLLM: right after it,
        ** since its retrieval query is the message's own attention queries) */
            if (infllm) {
                if ((rc = kvt__sess_pending_tokens(s, s->conv.n_m, false, &pf->tc, &pf->nc, &pf->fc)))
                    return pf_fail_message(pf, rc);
                s->cur_keep = s->conv.m[s->conv.n_m - 1].keep;
                pf_feed(pf, pf->tc, pf->nc, KVT_ROLE_USER, s->p.gen_reserve, PF_INFLLM_FED);
                return 0;
            }
            struct rplan rp;
            if ((rc = kvt__sess_plan_recover(s, s->conv.m[s->conv.n_m - 1].content, pf->n, &rp)) ||
                (rc = kvt__sess_recover_apply(s, &rp)))
                return pf_fail_message(pf, rc);
            s->cur_keep = s->conv.m[s->conv.n_m - 1].keep;
            /* the assistant prefix goes in the same run, so that the message's end and the prefix
            ** share a chunk (one weight pass; a segment boundary stays between them) */
            if (pf->join && (rc = pf_join_prefix(pf))) return pf_fail_message(pf, rc);
            pf_feed(pf, pf->tok, pf->n, KVT_ROLE_USER, s->p.gen_reserve, PF_MESSAGE_FED);
            pf->f.split = pf->n_msg;
            /* without the prefix in the run, the message's last token needs no logits (with a
            ** vocabulary of 262k, Gemma 3's output projection is a third of a short decode) */
            pf->f.logits = pf->n_msg > 0;
            return 0;
        }
        case PF_INFLLM_FED:
            s->cur_keep = KVT_KEEP_NONE;
            if (res) return pf_fail_message(pf, res);
            kvt__sess_set_text(s, pf->fc);
            pf->fc = NULL;
            pf_free_text(pf);
            struct rplan rpi;
            if ((rc = kvt__sess_plan_infllm(s, 8, &rpi)) || (rc = kvt__sess_recover_apply(s, &rpi))) return pf_fail_message(pf, rc);
            if ((rc = kvt__sess_pending_tokens(s, s->conv.n_m, true, &pf->tok, &pf->n, &pf->fmt))) /* the assistant prefix */
                return pf_fail_message(pf, rc);
            s->cur_keep = s->conv.m[s->conv.n_m - 1].keep;
            pf_feed(pf, pf->tok, pf->n, KVT_ROLE_USER, s->p.gen_reserve, PF_MESSAGE_FED);
            return 0;
        case PF_MESSAGE_FED: {
            s->cur_keep = KVT_KEEP_NONE;
            /* with the prefix in the run: the message is in once the run's tokens passed it */
            const bool joined = pf->n_msg > 0 && !pf->f.split_cut;
            const int32_t past = joined ? (res ? pf->f.off : pf->n) - pf->n_msg : 0; /* the prefix's tokens in */
            if (res && (!joined || past < 0)) return pf_fail_message(pf, res);
            if (joined) {
                kvt__sess_set_text_at(s, pf->fmt, s->total - past);
                pf->fmt = NULL;
                s->conv.n_m_decoded = s->conv.n_m;
                if (res) { /* as a prefix of its own that failed: the message stays, the prefix goes */
                    pf_free_text(pf);
                    return pf_cut_back(pf, res, s->total - past, strlen(s->conv.kv_text));
                }
                kvt__sess_set_text(s, pf->fp);
                pf->fp = NULL;
                pf_free_text(pf);
                pf->i++;
                pf->phase = PF_MESSAGE;
                return 0;
            }
            kvt__sess_set_text(s, pf->fmt);
            pf->fmt = NULL;
            pf_free_text(pf);
            s->conv.n_m_decoded = s->conv.n_m;
            if (s->p.policy == KVT_POLICY_INFLLM) { /* its prefix went in with it */
                pf->i++;
                pf->phase = PF_MESSAGE;
                return 0;
            }
            /* the assistant prefix */
            struct rplan rpt;
            if ((rc = kvt__sess_plan_own_tail(s, s->conv.m[s->conv.n_m - 1].content, &rpt)) ||
                (rc = kvt__sess_recover_apply(s, &rpt)))
                return rc;
            if ((rc = kvt__sess_pending_tokens(s, s->conv.n_m, true, &pf->tok, &pf->n, &pf->fmt))) return rc;
            pf->prefix0 = s->total;
            if (pf->n == 0 && (rc = kvt__sess_refresh_logits(s))) { /* a template without a prefix */
                pf_free_text(pf);
                return rc;
            }
            pf_feed(pf, pf->tok, pf->n, KVT_ROLE_USER, s->p.gen_reserve, PF_PREFIX_FED);
            return 0;
        }
        case PF_PREFIX_FED:
            if (res) { /* the message stays (decoded); the prefix's chunks go: a retry decodes the prefix alone */
                pf_free_text(pf);
                return pf_cut_back(pf, res, pf->prefix0, strlen(s->conv.kv_text));
            }
            pf->prefix0 = -1;
            kvt__sess_set_text(s, pf->fmt);
            pf->fmt = NULL;
            pf_free_text(pf);
            pf->i++;
            pf->phase = PF_MESSAGE;
            return 0;
        case PF_LOGITS: pf->phase = PF_DONE; return pf->sync ? kvt__sess_refresh_logits(s) : 0;
        case PF_DONE: return 0;
    }
    return 0;
}

/* The prefill stops at its first error: kept with its message. */
static int pf_stop(struct kvt_prefill *pf, int rc) {
    pf->rc = rc;
    snprintf(pf->msg, sizeof pf->msg, "%s", kvt_errmsg());
    if (pf->feeding) kvt__sess_feed_free(&pf->f);
    pf->feeding = pf->chunk_out = false;
    pf->phase = PF_DONE;
    return rc;
}

int kvt_prefill_next(kvt_prefill *pf, int32_t room, struct kvt_decode_chunk *chunk) {
    if (!pf || !chunk) return kvt__fail(KVT_EINVAL, "kvt_prefill_next: %s is NULL", !pf ? "pf" : "chunk");
    if (pf->rc) return kvt__fail(pf->rc, "%s", pf->msg);
    if (pf->chunk_out) return kvt__fail(KVT_EINVAL, "kvt_prefill_next: the chunk handed out has not been done (kvt_prefill_done)");
    for (;;) {
        if (pf->feeding) {
            int r = kvt__sess_feed_next(pf->s, &pf->f, room, chunk);
            if (r == 1) {
                pf->chunk_out = true;
                return 1;
            }
            kvt__sess_feed_free(&pf->f);
            pf->feeding = false;
            pf->phase = pf->after;
            if ((r = pf_advance(pf, r))) return pf_stop(pf, r);
            continue;
        }
        if (pf->phase == PF_DONE) return 0;
        int rc = pf_advance(pf, 0);
        if (rc) return pf_stop(pf, rc);
    }
}

int kvt_prefill_done(kvt_prefill *pf, int rc) {
    if (!pf) return kvt__fail(KVT_EINVAL, "kvt_prefill_done: pf is NULL");
    if (!pf->chunk_out) return kvt__fail(KVT_EINVAL, "kvt_prefill_done: no chunk is out (kvt_prefill_next)");
    pf->chunk_out = false;
    if (rc == KVT_ECANCELED) kvt__fail(rc, "the prefill was stopped by its caller");
    if (rc) { /* a chunk that failed (or was not decoded) leaves no cell behind: it was never recorded */
        char m[512];
        snprintf(m, sizeof m, "%s", kvt_errmsg());
        kvt_seq_rm(pf->s->eng, pf->s->p.seq, pf->s->next_pos, -1);
        kvt__fail(rc, "%s", m);
    }
    if ((rc = kvt__sess_feed_done(pf->s, &pf->f, rc)) == 0) return 0;
    /* the run failed (the decode, the caller's stop, or recording it): its phase takes the error */
    kvt__sess_feed_free(&pf->f);
    pf->feeding = false;
    pf->phase = pf->after;
    int r = pf_advance(pf, rc);
    return pf_stop(pf, r ? r : rc);
}

/* Validate and set up; k: the first message to add. */
static int pf_new(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n, int32_t k, int32_t keep, bool sync,
                  kvt_prefill **out) {
    kvt_prefill *pf = calloc(1, sizeof *pf);
    if (!pf) return kvt__fail(KVT_ENOMEM, "prefill");
    pf->s = s;
    pf->msgs = msgs;
    pf->n_msgs = n;
    pf->i = k;
    pf->keep = keep;
    pf->sync = sync;
    pf->total0 = pf->prefix0 = -1;
    pf->phase = PF_MESSAGE;
    pf->dec0 = s->st.decoded;
    pf->rec0 = s->st.recovered;
    pf->ev0 = s->st.evictions;
    pf->nrec0 = s->st.recoveries;
    pf->rc0 = s->st.recomputes;
    pf->want0 = s->reuse.route_want_all;
    pf->got0 = s->reuse.route_tokens_all;
    pf->ch0 = s->st.chunk_tokens;
    pf->chr0 = s->st.chunk_recompute_tokens;
    /* A conversation given to a session that holds nothing yet (a client resending its history, a
    ** server continuing a conversation another one served, a restart): with a block store, every
    ** message before the last user message goes in as one run, so that the store's prefix covers
    ** the whole history (the store is looked up once per run, at its start; replayed turn by turn,
    ** only the first message's blocks would be found) */
    if (s->p.store && s->total == 0 && s->conv.n_m == 0 && k == 0)
        for (int32_t i = n - 1; i > 0; i--)
            if (kvt__sess_role_from_name(msgs[i].role) == KVT_ROLE_USER) {
                pf->history = i;
                break;
            }
    *out = pf;
    return 0;
}

static int prefill_msgs(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n_msgs, kvt_prefill **out) {
    kvt__clear_error();
    if (!out) return kvt__fail(KVT_EINVAL, "kvt_session_prefill: out is NULL");
    *out = NULL;
    if (s->is_parked) return kvt__sess_parked_error();
    if (s->dec.generating) return kvt__fail(KVT_EINVAL, "sync: a reply is being generated (call kvt_session_gen_end first)");
    if (!msgs || n_msgs < 1) return kvt__fail(KVT_EINVAL, "sync: %d messages; at least one user message is needed", n_msgs);
    for (int32_t i = 0; i < n_msgs; i++) {
        if (kvt__sess_role_from_name(msgs[i].role) < 0)
            return kvt__fail(KVT_EINVAL, "message %d has role '%s'; expected system, user or assistant", i,
                             msgs[i].role ? msgs[i].role : "(null)");
        if (!msgs[i].content) return kvt__fail(KVT_EINVAL, "message %d has no content", i);
    }
    if (kvt__sess_role_from_name(msgs[n_msgs - 1].role) != KVT_ROLE_USER)
        return kvt__fail(KVT_EINVAL, "the last message is '%s'; it must be a user message", msgs[n_msgs - 1].role);
    /* the longest common prefix of messages is kept */
    int32_t k = 0;
    while (k < n_msgs && k < s->conv.n_m && s->conv.m[k].role == kvt__sess_role_from_name(msgs[k].role) &&
           !strcmp(s->conv.m[k].content, msgs[k].content))
        k++;
    /* the same conversation again after the reply to it (a retry, a stream after a non-stream):
    ** the reply goes and the prompt's logits come back as they were computed, so the same request
    ** gets the same reply (decoding the prefix again would be another ubatch shape than the chunk
    ** that held it: other float rounding) and decodes nothing */
    if (k == n_msgs && s->conv.n_m == n_msgs + 1 && s->conv.n_m_decoded == s->conv.n_m &&
        s->conv.m[n_msgs].role == KVT_ROLE_ASSISTANT && s->dec.prompt_logits && s->dec.prompt_total > 0 &&
        s->dec.prompt_total <= s->total && s->dec.prompt_chr <= strlen(s->conv.kv_text)) {
        const int32_t pt = s->dec.prompt_total;
        const size_t pc = s->dec.prompt_chr;
        s->conv.kv_text[pc] = '\0';
        while (s->conv.n_seg > 0 && (s->conv.seg_tok[s->conv.n_seg - 1] > pt || s->conv.seg_chr[s->conv.n_seg - 1] > pc))
            s->conv.n_seg--;
        free(s->conv.m[--s->conv.n_m].content);
        s->conv.n_m_decoded = s->conv.n_m;
        int rc = kvt__sess_cut_stream(s, pt); /* failing, the stream is shorter than kv_text: the next call cuts back */
        if (rc) return rc;
        s->dec.prompt_total = pt;
        memcpy(s->dec.logits, s->dec.prompt_logits, sizeof(float) * (size_t) s->n_vocab);
        s->dec.have_logits = true;
        kvt__sess_explain(s, "the same conversation again: its reply dropped, the prompt's logits (token %d) kept", pt);
    }
    const bool nothing_new = k == n_msgs && s->conv.n_m == n_msgs && s->conv.n_m_decoded == n_msgs && s->dec.have_logits;
    if (!nothing_new) {
        if (k == n_msgs) k--; /* the same conversation again: its last user message is added once more */
        while (s->conv.n_m > k) free(s->conv.m[--s->conv.n_m].content);
        if (s->conv.n_m_decoded > k) s->conv.n_m_decoded = k;
    }
    int rc = pf_new(s, msgs, n_msgs, nothing_new ? n_msgs : k, KVT_KEEP_NONE, true, out);
    if (rc == 0 && nothing_new) (*out)->phase = PF_DONE;
    return rc;
}

int kvt_session_prefill(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n_msgs, const kvt_token *tok, int32_t n_tok,
                        kvt_prefill **out) {
    int rc = prefill_msgs(s, msgs, n_msgs, out);
    if (rc == 0) (*out)->join = true; /* the chunks go to a caller: one weight pass for a message's end and its prefix */
    if (rc || !tok || n_tok <= 0) return rc;
    struct sess_given *g = &(*out)->given;
    g->ends = malloc(sizeof *g->ends * (size_t) n_tok);
    g->split = malloc(sizeof *g->split * (size_t) n_tok);
    rc = !g->ends || !g->split ? kvt__fail(KVT_ENOMEM, "prompt tokens")
                               : kvt__engine_token_text(s->eng, tok, n_tok, &g->text, g->ends, g->split);
    if (rc) {
        char m[512];
        snprintf(m, sizeof m, "%s", kvt_errmsg());
        kvt_prefill_end(*out, NULL); /* nothing was decoded: it frees (the messages kept as kvt_session_prefill cut them) */
        *out = NULL;
        return kvt__fail(rc, "%s", m);
    }
    g->tok = tok;
    g->n = n_tok;
    g->len = g->ends[n_tok - 1];
    s->conv.given = g;
    return 0;
}

int kvt_prefill_end(kvt_prefill *pf, struct kvt_sync_info *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!pf) return 0;
    kvt_session *s = pf->s;
    if (pf->rc == 0 && pf->phase != PF_DONE) { /* ended before its end: as if its caller stopped it */
        /* a chunk handed out may be in the cache; it was not recorded (positions from next_pos on) */
        if (pf->chunk_out) kvt_seq_rm(s->eng, s->p.seq, s->next_pos, -1);
        const bool in_message = pf->feeding && pf->after != PF_PREFIX_FED;
        const bool in_prefix = pf->feeding && pf->after == PF_PREFIX_FED;
        if (pf->feeding) kvt__sess_feed_free(&pf->f);
        pf->feeding = pf->chunk_out = false;
        int rc = kvt__fail(KVT_ECANCELED, "the prefill was ended before its last chunk");
        if (in_message) rc = pf_fail_message(pf, rc);
        else if (in_prefix) rc = pf_cut_back(pf, rc, pf->prefix0, strlen(s->conv.kv_text));
        pf_stop(pf, rc);
    }
    if (out) {
        out->prompt_tokens = s->total;
        out->tokens_decoded = s->st.decoded - pf->dec0;
        out->tokens_recovered = s->st.recovered - pf->rec0;
        out->tokens_from_store = s->reuse.route_tokens_all - pf->got0;
        out->route = kvt__sess_route_kind(s->reuse.route_want_all - pf->want0, out->tokens_from_store);
        out->tokens_from_chunks = s->st.chunk_tokens - pf->ch0;
        out->chunk_recompute_tokens = s->st.chunk_recompute_tokens - pf->chr0;
        out->tokens_reused = KVT_MAX(0, s->total - (int32_t) out->tokens_decoded - (int32_t) out->tokens_from_store -
                                            (int32_t) out->tokens_from_chunks);
        out->evictions = s->st.evictions - pf->ev0;
        out->recoveries = s->st.recoveries - pf->nrec0;
        out->recomputes = s->st.recomputes - pf->rc0;
    }
    const int rc = pf->rc;
    if (rc == 0 && s->dec.have_logits && s->dec.logits && s->n_vocab > 0 &&
        (s->dec.prompt_logits || (s->dec.prompt_logits = malloc(sizeof(float) * (size_t) s->n_vocab)))) {
        /* kept for a resend of this conversation (prefill_msgs); none when out of memory */
        memcpy(s->dec.prompt_logits, s->dec.logits, sizeof(float) * (size_t) s->n_vocab);
        s->dec.prompt_total = s->total;
        s->dec.prompt_chr = strlen(s->conv.kv_text);
    }
    if (rc) kvt__fail(rc, "%s", pf->msg); /* the prefill's own message, whatever ran since */
    pf_free_text(pf);
    if (s->conv.given == &pf->given) s->conv.given = NULL;
    s->st.given_tokens += pf->given.used;
    free(pf->given.text);
    free(pf->given.ends);
    free(pf->given.split);
    free(pf);
    return rc;
}

/* Run a prefill to its end, every chunk decoded alone. */
static int pf_run(kvt_prefill *pf, struct kvt_sync_info *out) {
    struct kvt_decode_chunk c;
    int r;
    while ((r = kvt_prefill_next(pf, 0, &c)) == 1)
        if (kvt_prefill_done(pf, kvt_engine_decode(pf->s->eng, c.seq, c.tokens, c.n, c.pos0, c.want_logits))) break;
    return kvt_prefill_end(pf, out);
}

int kvt_session_sync(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n_msgs, struct kvt_sync_info *out) {
    if (out) memset(out, 0, sizeof *out);
    kvt_prefill *pf = NULL;
    int rc = kvt_session_prefill(s, msgs, n_msgs, NULL, 0, &pf);
    if (rc == 0) pf->join = false; /* every chunk alone, as kvt_session_add: the numbers of earlier versions */
    return rc ? rc : pf_run(pf, out);
}

int kvt_session_add(kvt_session *s, enum kvt_role role, const char *text, int32_t keep) {
    kvt__clear_error();
    if (keep < KVT_KEEP_NONE || keep > KVT_KEEP_PIN) return kvt__fail(KVT_EINVAL, "keep %d is not none, prefer or pin", keep);
    if ((int) role < 0 || role > KVT_ROLE_ASSISTANT) return kvt__fail(KVT_EINVAL, "role %d is not system, user or assistant", role);
    if (!text) return kvt__fail(KVT_EINVAL, "NULL message text");
    if (s->is_parked) return kvt__sess_parked_error();
    const struct kvt_chat_msg m = { kvt__sess_role_name[role], text };
    kvt_prefill *pf = NULL;
    int rc = pf_new(s, &m, 1, 0, keep, false, &pf);
    return rc ? rc : pf_run(pf, NULL);
}
