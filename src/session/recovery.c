/* recovery.c — which evicted blocks come back, and where: planners that return a list
** (struct rplan) and touch no cache (blocks.c's kvt__sess_recover_apply loads it).  When: before a user message by BM25 over the
** message's novel terms (terms no resident block holds) with successor blocks for facts cut at a
** boundary, or by cosine with an embedder (linear scan, HNSW past ann_min_blocks); InfLLM's
** representative keys scored by the message's own queries (Xiao et al. 2024); a message longer
** than the budget gets its own evicted blocks relevant to its end. */
#include "session/session_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_cand(const void *a, const void *b) {
    double x = ((const struct cand *) a)->score, y = ((const struct cand *) b)->score;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Dense recovery candidates: evicted blocks whose text vector has cosine >= min_recovery_cosine
** with the message's, from a linear scan, or from the HNSW index once it exists (asked for
** enough neighbours to see past the resident blocks).  OUT c[0..*n_c) unsorted. */
static int dense_candidates(kvt_session *s, const char *query, struct cand *c, int32_t *n_c) {
    double t0 = kvt__now_ms();
    *n_c = 0;
    float *q = malloc(sizeof(float) * (size_t) s->rcv.emb_dim);
    if (!q) return kvt__fail(KVT_ENOMEM, "query vector");
    int rc = kvt_embedder_embed(s->p.embedder, query, q);
    if (rc) {
        free(q);
        kvt__clear_error(); /* e.g. an empty message: nothing to retrieve with */
        return 0;
    }
#define EVICTED(b) kvt__sess_evicted(s, (b))
    if (s->rcv.ann) {
        int32_t n_res = 0;
        for (int32_t i = 0; i < s->n_b; i++) n_res += !EVICTED(&s->b[i]);
        int32_t k = KVT_MIN(s->n_b, n_res + 4 * s->p.top_k + 16), got = 0;
        uint64_t *ids = malloc(sizeof(uint64_t) * (size_t) k);
        float *sims = malloc(sizeof(float) * (size_t) k);
        if (ids && sims && (rc = kvt_ann_search(s->rcv.ann, q, k, ids, sims, &got)) == 0)
            for (int32_t j = 0; j < got; j++)
                if (ids[j] < (uint64_t) s->n_b && EVICTED(&s->b[ids[j]]) && sims[j] >= s->p.min_recovery_cosine)
                    c[(*n_c)++] = (struct cand){ (int32_t) ids[j], sims[j] };
        if (!ids || !sims) rc = kvt__fail(KVT_ENOMEM, "ann search");
        free(ids);
        free(sims);
    } else {
        for (int32_t i = 0; i < s->n_b; i++) {
            const struct blk *b = &s->b[i];
            if (!b->emb || !EVICTED(b)) continue;
            double dot = 0;
            for (int32_t d = 0; d < s->rcv.emb_dim; d++) dot += (double) q[d] * b->emb[d];
            if (dot >= s->p.min_recovery_cosine) c[(*n_c)++] = (struct cand){ i, dot };
        }
    }
#undef EVICTED
    free(q);
    s->st.embed_ms += kvt__now_ms() - t0;
    return rc;
}

/* BM25 recovery candidates: the query's terms that occur in no block of res[0..n_res) (the
** resident context: kvt_bm25_novel_terms) score the evicted blocks (docs[i]: block i's text,
** "" when unsealed; sc: room for s->n_b scores); those scoring at least min_recovery_score are
** candidates.  OUT c[0..*n_c) unsorted, *novel (the novel terms, caller frees; "" when none). */
static int bm25_candidates(kvt_session *s, const char *query, const char **res, int32_t n_res, const char **docs, double *sc,
                           struct cand *c, int32_t *n_c, char **novel) {
    *n_c = 0;
    int rc = kvt_bm25_novel_terms(query, res, n_res, novel);
    if (rc == 0 && (*novel)[0]) rc = kvt_bm25_score(docs, s->n_b, *novel, sc);
    for (int32_t i = 0; rc == 0 && (*novel)[0] && i < s->n_b; i++)
        if (kvt__sess_evicted(s, &s->b[i]) && sc[i] >= s->p.min_recovery_score) c[(*n_c)++] = (struct cand){ i, sc[i] };
    return rc;
}

/* The candidates c[0..n_c) sorted best first and cut to top_k, each hit followed by up to
** successor_blocks evicted blocks after it (a contiguous run, none a hit itself): a fact cut by
** a block boundary goes on there ("... the secret code of Tavoren" | "is 48213.").  BM25 hits
** (novel != NULL) take successors only when the match is in the block's last quarter, where a
** statement about it may run on past the boundary (a successor that starts the next turn would
** otherwise come back as noise).  c has room for 2 * nb entries (the second half is scratch).
** Returns the new count. */
static int32_t top_with_successors(kvt_session *s, struct cand *c, int32_t n_c, size_t nb, const char *novel) {
    qsort(c, (size_t) n_c, sizeof *c, cmp_cand);
    if (n_c > s->p.top_k) n_c = s->p.top_k;
    int32_t n_hit = n_c;
    struct cand *x = c + nb;
    int32_t n_x = 0;
    for (int32_t k = 0; k < n_hit; k++) {
        x[n_x++] = c[k];
        const char *t = s->b[c[k].i].text;
        if (novel && t && kvt__bm25_last_match(t, novel) < (int32_t) (strlen(t) * 3 / 4)) continue;
        for (int32_t j = c[k].i + 1; j <= c[k].i + s->p.successor_blocks && n_x < (int32_t) nb; j++) {
            bool taken = j >= s->n_b || !s->b[j].info.sealed || !kvt__sess_evicted(s, &s->b[j]);
            for (int32_t q = 0; q < n_x && !taken; q++) taken = x[q].i == j;
            for (int32_t q = k + 1; q < n_hit && !taken; q++) taken = c[q].i == j;
            if (taken) break; /* only a contiguous run after the hit */
            x[n_x++] = (struct cand){ j, c[k].score };
        }
    }
    memcpy(c, x, sizeof *c * (size_t) n_x);
    return n_x;
}

/* The plan's query and candidates: one explain line (kvt_session_params.explain, or stderr with
** KVT_DEBUG_RECOVERY set). */
static void debug_candidates(const kvt_session *s, const char *what, const char *novel, const struct cand *c, int32_t n_c) {
    char list[512];
    int o = 0;
    list[0] = '\0';
    for (int32_t k = 0; k < n_c && o >= 0 && o < (int) sizeof list; k++)
        o += snprintf(list + o, sizeof list - (size_t) o, " blk%d=%.2f", s->b[c[k].i].info.id, c[k].score);
    kvt__sess_explain(s, "recovery plan, turn %d, %s \"%.80s\": %d candidates%s", s->turn, what, novel ? novel : "", n_c, list);
}

/* Tokens of text's last max_bytes bytes (all with 0), best effort (0 when it does not tokenize). */
static int32_t count_tokens(kvt_session *s, const char *text, size_t max_bytes) {
    size_t len = strlen(text);
    const char *t = max_bytes && len > max_bytes ? text + len - max_bytes : text;
    kvt_token *tok = NULL;
    int32_t n = 0;
    if (kvt_tokenize(s->eng, t, false, false, &tok, &n)) {
        kvt__clear_error();
        n = 0;
    }
    free(tok);
    return n;
}

/* Where the previous exchange begins in the stream (an original position, kvt_block_info.orig_p0):
** the blocks, resident or not, that hold the last tokens decoded, back to the messages after the
** previous user message and that message's end (a block's worth at most).  The message being
** planned for is conv.m[n_m - 1].  Returns a position past every block when there is no previous
** user message (an empty exchange). */
static kvt_pos previous_exchange(kvt_session *s) {
    kvt_pos end = 0;
    for (int32_t i = 0; i < s->n_b; i++) end = KVT_MAX(end, s->b[i].info.orig_p0 + s->b[i].info.n_tokens);
    int32_t want = 8, j = s->conv.n_m - 2; /* a few template tokens */
    for (; j >= 0 && s->conv.m[j].role != KVT_ROLE_USER; j--) want += count_tokens(s, s->conv.m[j].content, 0);
    if (j < 0) return end;
    want += KVT_MIN(count_tokens(s, s->conv.m[j].content, 1024), s->p.block);
    kvt_pos from = end;
    for (int32_t covered = 0; covered < want;) {
        int32_t best = -1;
        for (int32_t i = 0; i < s->n_b; i++)
            if (s->b[i].info.orig_p0 < from && (best < 0 || s->b[i].info.orig_p0 > s->b[best].info.orig_p0)) best = i;
        if (best < 0) break;
        from = s->b[best].info.orig_p0;
        covered += s->b[best].info.n_tokens;
    }
    return from;
}

/* A follow-up question differs from the previous one in a few terms, its key ("math-hurt"); a
** message with more new terms brings new content, which the novel-term rule serves. */
#define RESIDENT_HALF_MAX_TERMS 4

/* The resident half of a fact cut at a block boundary ("... the special magic uuids for
** math-hurt" resident | "is: a46c6fa0-..." evicted).  Every term of the question is resident, so
** the novel-term rule finds nothing; and the resident block that best matches the whole question
** is the previous question and answer, which share most of its words.  The key is in the
** question's new terms: those the previous exchange (previous_exchange) lacks, at most
** RESIDENT_HALF_MAX_TERMS of them (more: the message is new content, not a question).  Among the resident
** blocks before that exchange, the one they score best by BM25 (at least min_recovery_score;
** docs[i]: block i's text, sc: scratch for s->n_b scores) whose last match of them is in its last
** quarter and whose next block is evicted: it moves to the tail (OUT *mv, -1 when none) and up to
** successor_blocks evicted blocks after it come back right after it (appended to c[*n_c..], at
** most nb entries in all), so the statement reads whole next to the question.  Errors: KVT_ENOMEM. */
static int resident_hit_successors(kvt_session *s, const char *query, const char **docs, double *sc, struct cand *c, int32_t *n_c,
                                   size_t nb, int32_t *mv) {
    *mv = -1;
    if (s->p.successor_blocks <= 0 || s->p.recovery != KVT_RECOVERY_KV_RESTORE || s->rcv.no_resident_successors) return 0;
    const kvt_pos from = previous_exchange(s);
    const char **recent = malloc(sizeof(char *) * (nb + 1));
    char *open_text = NULL, *fresh = NULL;
    if (!recent) return kvt__fail(KVT_ENOMEM, "recovery scores");
    int32_t n_recent = 0, best = -1;
    for (int32_t i = 0; i < s->n_b; i++)
        if (s->b[i].info.residency == KVT_RES_DEVICE && s->b[i].info.sealed && s->b[i].info.orig_p0 >= from)
            recent[n_recent++] = docs[i];
    if (s->open >= 0 && kvt_detokenize(s->eng, s->b[s->open].tok, s->b[s->open].info.n_tokens, false, &open_text) == 0)
        recent[n_recent++] = open_text;
    kvt__clear_error();
    int rc = kvt_bm25_novel_terms(query, recent, n_recent, &fresh);
    int32_t n_fresh = rc == 0 && fresh[0] ? 1 : 0;
    for (const char *p = fresh; n_fresh > 0 && (p = strchr(p, ' ')); p++) n_fresh++;
    if (n_fresh > RESIDENT_HALF_MAX_TERMS) n_fresh = 0;
    if (n_fresh > 0) rc = kvt_bm25_score(docs, s->n_b, fresh, sc);
    for (int32_t i = 0; rc == 0 && n_fresh > 0 && i + 1 < s->n_b; i++) {
        const struct blk *b = &s->b[i];
        if (b->info.residency != KVT_RES_DEVICE || !b->info.sealed || b->info.orig_p0 >= from || b->info.id < s->p.n_sink_blocks ||
            i == s->open || sc[i] < s->p.min_recovery_score || !s->b[i + 1].info.sealed || !kvt__sess_evicted(s, &s->b[i + 1]))
            continue;
        if (!b->text || kvt__bm25_last_match(b->text, fresh) < (int32_t) (strlen(b->text) * 3 / 4)) continue;
        if (best < 0 || sc[i] > sc[best]) best = i;
    }
    int32_t added = 0;
    for (int32_t j = best + 1; best >= 0 && j <= best + s->p.successor_blocks && j < s->n_b && *n_c < (int32_t) nb; j++) {
        bool taken = !s->b[j].info.sealed || !kvt__sess_evicted(s, &s->b[j]);
        for (int32_t q = 0; q < *n_c && !taken; q++) taken = c[q].i == j;
        if (taken) break;
        c[(*n_c)++] = (struct cand){ j, sc[best] };
        added++;
    }
    if (added > 0) {
        *mv = best;
        kvt__sess_explain(s,
                          "recovery plan, turn %d, new terms \"%.60s\": resident blk%d=%.2f ends with them; it moves to the "
                          "tail with the %d evicted block%s after it",
                          s->turn, fresh, s->b[best].info.id, sc[best], added, added == 1 ? "" : "s");
    }
    free(fresh);
    free(open_text);
    free(recent);
    return rc;
}

/* Before a user message.  Every sealed block gets its BM25 relevance to the message (the kvtier
** policy's relevance signal).  Recovery asks what the resident context lacks: the message's
** terms that occur in no resident block (kvt_bm25_novel_terms) score the evicted blocks, and
** those scoring at least min_recovery_score come back at the tail, best first, at most top_k,
** each followed by the block after it when that one is evicted too (a fact cut by a block
** boundary goes on there: "... the secret code of Tavoren" | "is 48213."), as long as they fit
** next to the message and the reply reserve.  A message whose terms are all resident recovers
** nothing, so earlier turns that repeat the question's wording cannot outbid an evicted fact. */
int kvt__sess_plan_recover(kvt_session *s, const char *query, int32_t msg_tokens, struct rplan *plan) {
    memset(plan, 0, sizeof *plan);
    if (s->p.policy != KVT_POLICY_KVTIER && s->p.recovery == KVT_RECOVERY_DISCARD) return 0;
    int32_t n_ev = 0;
    for (int32_t i = 0; i < s->n_b; i++) n_ev += kvt__sess_evicted(s, &s->b[i]);
    const size_t nb = (size_t) (s->n_b > 0 ? s->n_b : 1);
    const char **docs = malloc(sizeof(char *) * nb), **res = malloc(sizeof(char *) * nb);
    double *sc = malloc(sizeof(double) * nb);
    struct cand *c = malloc(sizeof *c * 2 * nb);
    char *novel = NULL, *open_text = NULL;
    int rc = (!docs || !res || !sc || !c) ? kvt__fail(KVT_ENOMEM, "recovery scores") : 0;
    if (rc == 0) {
        for (int32_t i = 0; i < s->n_b; i++) docs[i] = s->b[i].info.sealed && s->b[i].text ? s->b[i].text : "";
        rc = kvt_bm25_score(docs, s->n_b, query, sc);
        for (int32_t i = 0; rc == 0 && i < s->n_b; i++) s->b[i].info.relevance = sc[i]; /* kvtier's relevance signal */
    }
    int32_t n_c = 0;
    /* a message that (with the reply reserve) fills half the budget is content, not a query:
    ** what came back for it would mostly be evicted again while it is decoded */
    bool long_msg = msg_tokens + s->p.gen_reserve > s->p.budget / 2;
    if (rc == 0 && n_ev > 0 && !long_msg && s->p.recovery != KVT_RECOVERY_DISCARD && s->p.top_k > 0) {
        int32_t n_res = 0;
        for (int32_t i = 0; i < s->n_b; i++)
            if (s->b[i].info.residency == KVT_RES_DEVICE && s->b[i].info.sealed) res[n_res++] = docs[i];
        if (s->open >= 0 && kvt_detokenize(s->eng, s->b[s->open].tok, s->b[s->open].info.n_tokens, false, &open_text) == 0)
            res[n_res++] = open_text;
        if (s->rcv.emb_dim > 0) rc = dense_candidates(s, query, c, &n_c);
        else rc = bm25_candidates(s, query, res, n_res, docs, sc, c, &n_c, &novel);
        if (rc == 0) {
            n_c = top_with_successors(s, c, n_c, nb, s->rcv.emb_dim == 0 ? novel : NULL);
            debug_candidates(s, s->rcv.emb_dim ? "cosine" : "novel terms", novel, c, n_c);
        }
    }
    int32_t mv = -1;
    if (rc == 0 && n_ev > 0 && !long_msg && s->p.top_k > 0 && s->rcv.emb_dim == 0)
        rc = resident_hit_successors(s, query, docs, sc, c, &n_c, nb, &mv);
    if (rc == 0 && n_c > 0) {
        *plan = (struct rplan){ .c = c, .n_c = n_c, .extra = msg_tokens + s->p.gen_reserve, .where = RPLAN_TAIL };
        if (mv >= 0) {
            plan->move[0] = mv;
            plan->n_move = 1;
        }
        c = NULL;
    }
    free(novel);
    free(open_text);
    free(docs);
    free(res);
    free(sc);
    free(c);
    return rc;
}

/* InfLLM retrieval, after the user message is decoded: the mean query of its last tokens
** (rep_layer, rotated back to position 0) against every evicted block's representative keys;
** a block scores its best representative; the top_k come back at the tail. */
int kvt__sess_plan_infllm(kvt_session *s, int32_t suffix_tokens, struct rplan *plan) {
    memset(plan, 0, sizeof *plan);
    kvt_attn *a = NULL;
    struct kvt_engine_info I;
    kvt_engine_info(s->eng, &I);
    if (s->p.top_k == 0 || s->rcv.rep_row == 0 || kvt_attn_get(s->eng, s->rcv.rep_layer, s->p.seq, &a) || !a->q) {
        kvt_attn_free(a);
        kvt__clear_error();
        return 0;
    }
    double t0 = kvt__now_ms();
    const int32_t hd = a->head_dim, nh = a->n_head, group = nh / I.n_head_kv;
    float *qbar = calloc((size_t) nh * hd, sizeof(float)), *tmp = malloc(sizeof(float) * (size_t) hd);
    struct cand *c = malloc(sizeof *c * (size_t) (s->n_b ? s->n_b : 1));
    int32_t from = a->n_query > INFLLM_WINDOW ? a->n_query - INFLLM_WINDOW : 0, n_c = 0;
    if (qbar && tmp && c && hd == s->rcv.rep_row / I.n_head_kv) {
        for (int32_t t = from; t < a->n_query; t++)
            for (int32_t h = 0; h < nh; h++) {
                memcpy(tmp, a->q + ((size_t) t * nh + h) * hd, sizeof(float) * (size_t) hd);
                kvt__engine_rotate(s->eng, s->rcv.rep_layer, tmp, hd, -a->q_pos[t]);
                for (int32_t d = 0; d < hd; d++) qbar[(size_t) h * hd + d] += tmp[d] / (float) (a->n_query - from);
            }
        double bar = -INFINITY; /* like the BM25 rule: only blocks that beat every resident non-sink block */
        for (int32_t i = 0; i < s->n_b; i++) {
            const struct blk *b = &s->b[i];
            bool evicted = kvt__sess_evicted(s, b);
            if (b->n_rep == 0 || (!evicted && (b->info.residency != KVT_RES_DEVICE || b->info.id < s->p.n_sink_blocks))) continue;
            double best = -INFINITY;
            for (int32_t r = 0; r < b->n_rep; r++) {
                double dot = 0;
                for (int32_t h = 0; h < nh; h++) {
                    const float *k = b->rep + (size_t) r * s->rcv.rep_row + (size_t) (h / group) * hd;
                    for (int32_t d = 0; d < hd; d++) dot += (double) qbar[(size_t) h * hd + d] * k[d];
                }
                best = fmax(best, dot / sqrt((double) hd));
            }
            if (evicted) c[n_c++] = (struct cand){ i, best };
            else bar = fmax(bar, best);
        }
        int32_t kept = 0;
        for (int32_t k = 0; k < n_c; k++)
            if (c[k].score > bar) c[kept++] = c[k];
        n_c = kept;
        qsort(c, (size_t) n_c, sizeof *c, cmp_cand);
        if (n_c > s->p.top_k) n_c = s->p.top_k;
    }
    kvt_attn_free(a);
    free(qbar);
    free(tmp);
    s->st.policy_ms += kvt__now_ms() - t0;
    if (!c) return kvt__fail(KVT_ENOMEM, "recovery candidates");
    if (n_c == 0) {
        free(c);
        return 0;
    }
    *plan = (struct rplan){ .c = c, .n_c = n_c, .extra = suffix_tokens + s->p.gen_reserve, .where = RPLAN_TAIL_BY_SCORE };
    return 0;
}

/* A message longer than the budget evicted blocks of its own during its prefill.  Before the
** reply, the ones relevant to the end of the message (its last ~40 words, the question, as
** SnapKV's observation window is the prompt's end) come back right before that end (which is
** moved after them: load_before_question) by recover()'s rule:
** the query's terms that no resident block holds score the evicted blocks (the blocks holding
** the query itself, the message's last ones, do not count as resident context), at least
** min_recovery_score, at most top_k, each followed by its evicted successors when the match is
** in its last quarter.  Best effort: nothing is recovered when no block qualifies or none fits. */
bool kvt__sess_own_tail_lost(const kvt_session *s) {
    if (s->p.recovery != KVT_RECOVERY_KV_RESTORE || s->p.top_k == 0) return false;
    for (int32_t i = 0; i < s->n_b; i++)
        if (s->b[i].info.turn == s->turn && kvt__sess_evicted(s, &s->b[i])) return true;
    return false;
}

int kvt__sess_plan_own_tail(kvt_session *s, const char *text, struct rplan *plan) {
    memset(plan, 0, sizeof *plan);
    if (!kvt__sess_own_tail_lost(s)) return 0;
    int32_t own = 0; /* tokens of this message's blocks */
    for (int32_t i = 0; i < s->n_b; i++)
        if (s->b[i].info.turn == s->turn) own += s->b[i].info.n_tokens;
    /* A message longer than the budget (a pasted document with a question at its end, issue #23)
    ** gets the question-aware placement below: its question as the query when a line break sets
    ** it off, resident answers held, what comes back placed before the question.  A shorter
    ** message that lost blocks of its own to the watermark (turns of a multi-turn session) keeps
    ** the rule the multi-turn evaluation was measured with: the message's last ~40 words as the
    ** query, what comes back loaded at the tail -- the question-aware rule measured worse there
    ** (multifact 8/35 against 11/35, NIAH 9/10 against 10/10 at 4096/1024, docs/EVALUATION.md). */
    const bool long_msg = own > s->p.budget;
    size_t len = strlen(text), from = len > 240 ? len - 240 : 0;
    while (from > 0 && from < len && text[from - 1] != ' ') from++;
    /* a question set off from the document by a line break (how people paste a document and ask
    ** about it) is the query by itself: the document's last words would only bring back blocks
    ** that share its vocabulary */
    for (size_t i = long_msg ? len : from; i > from; i--)
        if (text[i - 1] == '\n') {
            size_t words = 0;
            for (size_t j = i; j < len; j++) words += text[j] != ' ' && (j == i || text[j - 1] == ' ');
            if (words >= 3) from = i;
            break;
        }
    const char *query = text + from;
    const size_t nb = (size_t) (s->n_b > 0 ? s->n_b : 1);
    const char **docs = malloc(sizeof(char *) * nb), **res = malloc(sizeof(char *) * nb);
    double *sc = malloc(sizeof(double) * nb);
    struct cand *c = malloc(sizeof *c * 2 * nb);
    char *novel = NULL;
    kvt_token *qt = NULL;
    int32_t n_qt = 0, n_c = 0, n_res = 0;
    int rc = (!docs || !res || !sc || !c) ? kvt__fail(KVT_ENOMEM, "recovery scores") : 0;
    /* the blocks holding the query: the last ones, back to the query's token count (and a few
    ** template tokens after it) */
    if (rc == 0 && kvt_tokenize(s->eng, query, false, false, &qt, &n_qt)) { /* best effort: a block's worth */
        kvt__clear_error();
        n_qt = s->p.block;
    }
    int32_t q_blocks = 0;
    if (rc == 0) {
        for (int32_t i = s->n_b - 1, covered = 0; i >= 0 && covered < n_qt + 8; i--, q_blocks++) covered += s->b[i].info.n_tokens;
        for (int32_t i = 0; i < s->n_b; i++) {
            docs[i] = s->b[i].info.sealed && s->b[i].text ? s->b[i].text : "";
            if (i < s->n_b - q_blocks && s->b[i].info.residency == KVT_RES_DEVICE && s->b[i].info.sealed) res[n_res++] = docs[i];
        }
        rc = bm25_candidates(s, query, res, n_res, docs, sc, c, &n_c, &novel);
    }
    /* resident blocks other than the query's own that match the whole query (its terms that are
    ** not novel are resident somewhere: the answer may be there already), best first, at most
    ** top_k: kept while room is made for what comes back */
    int32_t hold[8], n_hold = 0;
    const int32_t max_hold = KVT_MIN(s->p.top_k, 8);
    if (rc == 0 && long_msg && n_c > 0 && (rc = kvt_bm25_score(docs, s->n_b, query, sc)) == 0)
        while (n_hold < max_hold) {
            int32_t best = -1;
            for (int32_t i = 0; i < s->n_b - q_blocks; i++) {
                if (s->b[i].info.residency != KVT_RES_DEVICE || !s->b[i].info.sealed || sc[i] < s->p.min_recovery_score) continue;
                bool taken = false;
                for (int32_t j = 0; j < n_hold; j++) taken |= hold[j] == i;
                if (!taken && (best < 0 || sc[i] > sc[best])) best = i;
            }
            if (best < 0) break;
            hold[n_hold++] = best;
        }
    if (rc == 0) {
        n_c = top_with_successors(s, c, n_c, nb, novel);
        debug_candidates(s, "own tail, novel terms", novel, c, n_c);
        if (n_c > 0) {
            *plan = (struct rplan){ .c = c, .n_c = n_c, .extra = s->p.gen_reserve, .where = RPLAN_TAIL };
            if (long_msg) {
                plan->where = RPLAN_BEFORE_QUESTION;
                plan->q_tokens = n_qt + 8;
                plan->n_hold = n_hold;
                memcpy(plan->hold, hold, sizeof(int32_t) * (size_t) n_hold);
            }
            c = NULL;
        }
        plan->show = true; /* KVT_DEBUG_RECOVERY: the executor prints what the reply will see */
    }
    free(qt);
    free(novel);
    free(docs);
    free(res);
    free(sc);
    free(c);
    return rc;
}
