/* session_int.h — a session's state and the operations its files share.  Never installed.
**
** A kvt_session is one conversation in one llama.cpp sequence under a token budget.  Its KV is
** managed in blocks of `block` consecutive positions (vLLM's paged blocks) listed in a block
** table (`b`, by id = order in the token stream).  The files, in layers: a file calls only into
** files of lower layers (tests/cli/cli_layers.sh draws the graph from the objects' symbols and
** fails on an arrow up or sideways):
**
**   0 state.c       what every file reads: resident tokens, the peak, roles, chain purity
**   1 positions.c   positions kept below the trained context (compaction of the gaps)
**     index.c       what a sealed block is found by: chain and chunk keys in the store,
**                   InfLLM representatives, text vectors (one step at its seal)
**     signals.c     attention captured per chunk -> H2O / SnapKV / EWMA block signals
**     elastic.c     live ElasticKV passes
**     recovery.c    which evicted blocks come back before a message, as a list (struct rplan):
**                   BM25 novel terms, successor blocks, dense/HNSW, InfLLM representatives,
**                   own tail; it touches no cache
**   2 blocks.c      the executor: record tokens, seal (write-through save + index), evict under
**                   the watermarks, load a block back (RoPE re-anchoring), lift/place, drop,
**                   load a recovery plan
**   3 reuse.c       the store's prompt prefix: lookup and load before prefill
**   4 chunks.c      non-prefix chunk reuse: the scan of a prompt for stored blocks at any
**                   offset, their load with boundary recompute
**   5 feed.c        a run of tokens in budget-sized chunks ending at block boundaries
**   6 sync.c        the conversation: messages, template text diff, cut-back
**   7 prefill.c     a prompt's path as steps (kvt_prefill); kvt_session_sync and _add
**   8 generate.c    generation, batched steps
**     session.c     open/free, parameters, statistics, block info, park/resume
**
** Single-threaded like the public session API: one thread at a time per engine. */
#ifndef KVT_SESSION_INT_H
#define KVT_SESSION_INT_H

#include "internal.h"
#include "policy/policy.h"

#include <stdbool.h>
#include <stdint.h>

struct blk {
    struct kvt_block_info info; /* info.text points at text */
    kvt_token *tok;             /* [block] */
    int32_t role_n[3];          /* tokens per role */
    float *tok_mass;            /* [block] attention each token received (InfLLM representatives) */
    float *rep;                 /* InfLLM: n_rep x row representative keys, un-rotated */
    int32_t n_rep;
    char *text;
    uint64_t key;    /* pool key (sealed blocks) */
    kvt_pos blob_p0; /* position the saved K is rotated for */
    int32_t blob_cells, blob_cells_swa;
    size_t blob_bytes;
    bool enc;     /* the pool's copy is codec_ram-encoded (else the raw blob) */
    float *emb;   /* [emb_dim] unit vector of the text (with an embedder), else NULL */
    bool parked;  /* resident when the session was parked: comes back on resume */
    kvt_key ckey; /* chain key (session/reuse.c), when has_ckey */
    bool has_ckey;
    bool copy_content; /* with a store: the block's copy is its content entry (ckey),
                                ** not a private entry under key */
};

struct msg {
    int role;
    int keep;
    char *content;
};

/* The parts of a session's state, each written by one file (the others may read it). */

/* The prompt's tokens a caller already had (kvt_session_prefill_tokens): the template's tokens of
** the whole request with the assistant prefix, and their text piece by piece (ends, split: as
** kvt__engine_token_text gives them).  Owned by the prefill; sync.c takes the parts it would
** tokenize from them where that provably gives the same tokens. */
struct sess_given {
    const kvt_token *tok; /* [n], the caller's */
    int32_t n;
    char *text;
    size_t len;
    size_t *ends;
    bool *split;
    int64_t used; /* tokens taken from them instead of tokenized (the tests read it) */
};

/* The conversation (session/sync.c): messages, the template text decoded so far, and the
** segment boundaries (tokens in the stream, bytes of kv_text) wherever kv_text was extended: a
** conversation that diverges from kv_text is cut back to the last boundary before the divergence
** and re-fed from there (kvt__sess_cut_stream). */
struct sess_conv {
    struct sess_given *given; /* the prompt's tokens its caller gave, during that prefill (or NULL) */
    struct msg *m;
    int32_t n_m, cap_m, n_m_decoded;
    char *kv_text; /* template text whose tokens are in the stream */
    int32_t *seg_tok;
    size_t *seg_chr;
    int32_t n_seg, cap_seg;
};

/* Decoding and generation (session/generate.c). */
struct sess_dec {
    float *logits; /* after this session's last token (the engine's are shared) */
    bool have_logits;
    kvt_token *gen; /* reply being generated step-wise (kvt_session_gen_step) */
    int32_t n_gen, cap_gen;
    bool generating;
    float *prompt_logits; /* the logits at the end of the last prompt (its assistant prefix), */
    int32_t prompt_total; /*   the stream's tokens then (-1: none, or the stream was cut below it) */
    size_t prompt_chr;    /*   and kv_text's bytes: a resend of that conversation gets them back */
    bool last_unfed;      /* gen[n_gen - 1] was a reply's last draw, sampled and not decoded (struct
                      ** kvt_gen_batch's last): the stream and kv_text end before it; the next
                      ** turn decodes its text with its own tokens */
};

/* Attention signals (session/signals.c; the layers and head weights are set up at open). */
struct sess_sig {
    int32_t n_layers; /* attention layers observed (0 = no attention signals) */
    int32_t *layers;
    float *head_w; /* [n_layers * n_head] from head_profile, NULL = equal */
    int32_t n_head;
};

/* Recovery's indexes (session/recovery.c). */
struct sess_rcv {
    int32_t rep_layer; /* InfLLM: layer of the representative keys */
    int32_t rep_row;   /* floats per representative key row (n_head_kv * head_dim) */
    int32_t emb_dim;   /* embedder width, 0 without one */
    kvt_ann *ann;      /* HNSW over block vectors once ann_min_blocks are sealed */
    bool no_resident_successors; /* the control of tests/unit/test_recovery.c (test_hooks.h) */
};

/* The block store's prefix reuse (session/reuse.c). */
struct sess_reuse {
    char *tenant;  /* copy of p.tenant */
    bool chain_ok; /* every block so far is what a cold prefill gives: store them */
    bool have_root, store_broken;
    kvt_key root, model_fp;                   /* h_0 of the chain; the engine's model fingerprint */
    int32_t route_want, route_tokens;         /* this turn: tokens looked up / loaded from the store */
    int64_t route_want_all, route_tokens_all; /* the same over the session's life */
    const kvt_blob *const *preload;           /* blocks just loaded from the store, in order: their seal */
    int32_t n_preload;                        /*   takes these bytes instead of reading the cache back */
    bool preload_moved;                       /*   they were saved at other positions (reused chunks):
                                    ** matched by order, kept with their own saved position */
};

/* Non-prefix chunk reuse (session/chunks.c). */
struct sess_chunk {
    kvt_key root;  /* c_0 of the chunk keys (kvt_chunk_root), with reuse.have_root */
    int32_t k_tok; /* chunk_recompute parsed: tokens, or -1 ... */
    double k_pct;  /*   ... percent of the run, or -1 */
};

/* Counters and timings, summed by the file that does the work, read by kvt_session_get_stats. */
struct sess_stats {
    int32_t peak; /* resident tokens */
    int64_t evictions, recoveries, decoded, recovered;
    int64_t recomputes;  /* blocks decoded again because their saved copy was gone */
    int64_t compactions; /* times the resident blocks were moved down to close gaps */
    double policy_ms;    /* signals + scoring + bookkeeping (not the primitives) */
    double decode_ms;    /* time in kvt_engine_decode for this session's tokens */
    double embed_ms;     /* time embedding blocks and messages */
    int64_t store_tokens, store_put, store_load_errors;
    double store_ms;
    int64_t pool_tokens, pool_raw_bytes, pool_bytes; /* what saving to the host pool cost */
    double codec_enc_ms, codec_dec_ms;
    int64_t el_passes, el_zeroed;     /* live ElasticKV (session/elastic.c) */
    struct kvt_elastic_stats el_last; /* the last pass */
    double el_ms;
    int64_t chunk_tokens, chunk_recompute_tokens, chunk_runs, chunk_put, chunk_load_errors;
    double chunk_scan_ms;
    int64_t given_tokens; /* prompt tokens taken from a caller's tokens, not tokenized again */
};

/* What every file reads: the engine, the parameters, the block table and the positions. */
struct kvt_session {
    kvt_engine *eng;
    struct kvt_session_params p;
    kvt_pool *pool;
    bool own_pool;
    uint32_t serial;
    struct blk *b; /* the block table (session/blocks.c), by id */
    int32_t n_b, cap_b;
    int32_t open; /* index of the open tail block, -1 if none */
    kvt_pos next_pos;
    kvt_pos pos_limit; /* positions stay below this: n_ctx_train (session/positions.c) */
    int32_t total;     /* tokens in the stream */
    int32_t turn;
    int32_t cur_keep; /* keep hint of the message being decoded */
    int32_t n_vocab;
    bool is_parked;                /* kvt_session_park: no cells, no sequence */
    struct kvt_codec_params codec; /* host pool codec (p.codec_ram parsed; RAW = none) */
    uint8_t *codec_bits;           /* codec.head_bits: the session's copy of p.codec_ram_bits, or NULL */
    int32_t el_pending;            /* live ElasticKV: tokens decoded since the last pass */
    struct sess_conv conv;
    struct sess_dec dec;
    struct sess_sig sig;
    struct sess_rcv rcv;
    struct sess_reuse reuse;
    struct sess_chunk chunk;
    struct sess_stats st;
};

/* A reused chunk found in a prompt (session/chunks.c): its blocks from tokens[at] on are loaded. */
struct chunk_run {
    int32_t at;       /* prompt offset of the first loaded block */
    int32_t n_blocks; /* blocks loaded */
    kvt_key *keys;    /* [n_blocks] chunk keys */
};

/* A recovery candidate: block index and score (higher first). */
struct cand {
    int32_t i;
    double score;
};

enum { N_REP = 4, INFLLM_WINDOW = 32 };

/* What to load back (session/recovery.c's planners; blocks.c's kvt__sess_recover_apply loads it). */
enum rplan_where {
    RPLAN_TAIL,            /* at the tail, in their original order, room for them + extra */
    RPLAN_TAIL_BY_SCORE,   /* at the tail, best first (InfLLM) */
    RPLAN_BEFORE_QUESTION, /* before the message's last q_tokens (lifted and placed back after them) */
};
struct rplan {
    struct cand *c; /* [n_c] best first (owned; NULL when n_c is 0) */
    int32_t n_c;
    int32_t extra; /* tokens that must still fit after them (the message, the reply reserve) */
    enum rplan_where where;
    int32_t q_tokens;        /* RPLAN_BEFORE_QUESTION: the message end that stays last */
    int32_t hold[8], n_hold; /* RPLAN_BEFORE_QUESTION: resident blocks kept while room is made */
    int32_t move[8], n_move; /* RPLAN_TAIL: resident blocks that move to the tail with c (lifted,
                             ** placed back in the order of their original positions among c) */
    bool show;               /* KVT_DEBUG_RECOVERY: print the resident blocks after it */
};

/* "system", "user", "assistant" by enum kvt_role. */
extern const char *const kvt__sess_role_name[3];

/* An evicted block that recovery may bring back: its copy is in the pool (HOST, DISK), or it is
** LOST (the copy failed its checksum, went missing, was dropped by the pool or never saved) in a
** session that does not discard evicted blocks: kvt__sess_load_block recomputes it. */
static inline bool kvt__sess_evicted(const kvt_session *s, const struct blk *b) {
    const int32_t r = b->info.residency;
    return r == KVT_RES_HOST || r == KVT_RES_DISK || (r == KVT_RES_LOST && s->p.recovery != KVT_RECOVERY_DISCARD);
}

/* ---- 0 session/state.c ---- */
int32_t kvt__sess_resident(const kvt_session *s); /* cells of the session's sequence */
int kvt__sess_parked_error(void);                 /* KVT_EINVAL "the session is parked" */
void kvt__sess_note_peak(kvt_session *s);         /* peak resident tokens */
int kvt__sess_block_role(const struct blk *b);    /* the role with most tokens in b */
/* enum kvt_role of "system", "user", "assistant"; -1 for anything else. */
int kvt__sess_role_from_name(const char *r);
/* The session's KV stops being a cold prefill's (eviction, recovery, compaction, early seal):
** no block from now on gets a chain key. */
void kvt__sess_chain_off(kvt_session *s);
/* One line of the prefill's decisions to kvt_session_params.explain (without one: to stderr when
** KVT_DEBUG_RECOVERY is set, else nowhere). */
void kvt__sess_explain(const kvt_session *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* enum kvt_route of lookups that wanted `want` tokens and found `found`. */
int32_t kvt__sess_route_kind(int64_t want, int64_t found);

/* ---- 1 session/positions.c ---- */
/* Make room for n more positions below pos_limit: compact the resident blocks down to close the
** gaps if next_pos + n would pass it.  KVT_ECTX (with the numbers) when even that is not enough;
** errors of kvt_seq_shift.  Call before every decode or load at next_pos. */
int kvt__sess_reserve_positions(kvt_session *s, int32_t n);
/* Move every resident block down, in position order, to sit contiguously from 0. */
int kvt__sess_compact(kvt_session *s);

/* ---- 1 session/index.c ---- */
/* h_0 (and c_0 with chunk_reuse) and the model fingerprint, computed once; false (store off for
** the session, reported on stderr) when they cannot be. */
bool kvt__sess_roots(kvt_session *s);
/* Block b was just saved as blob (at its seal): index it.  Its chain key while the session is
** pure and its chunk key with chunk_reuse go into the store (write-behind), its InfLLM
** representatives are picked.  Never fails (each index is best effort).  Returns true if the
** store holds b's bytes under its chain key now (put, or there already): that entry is b's copy. */
bool kvt__sess_index_block(kvt_session *s, struct blk *b, const kvt_blob *blob);
/* Block b was closed with its text: its vector for dense recovery (with an embedder), into the
** HNSW index once ann_min_blocks are sealed.  Best effort. */
void kvt__sess_index_text(kvt_session *s, struct blk *b);
/* b's bytes from the store by its chain key (a copy the pool lost).  KVT_ENOENT when none. */
int kvt__sess_store_fetch(kvt_session *s, const struct blk *b, void **data, size_t *n);

/* ---- 1 session/recovery.c: planners; none touches the cache (the relevance signal is set) ---- */
/* Before a user message of msg_tokens tokens: relevance of every block, the evicted blocks to
** bring back.  OUT *plan (kvt__sess_recover_apply it).  Errors: KVT_ENOMEM, the embedder's. */
int kvt__sess_plan_recover(kvt_session *s, const char *query, int32_t msg_tokens, struct rplan *plan);
/* InfLLM: after the message, by its own queries (suffix_tokens still to come). */
int kvt__sess_plan_infllm(kvt_session *s, int32_t suffix_tokens, struct rplan *plan);
/* A message that evicted blocks of its own: those relevant to its end. */
int kvt__sess_plan_own_tail(kvt_session *s, const char *text, struct rplan *plan);
/* The current message lost blocks of its own (kvt__sess_plan_own_tail has work to do). */
bool kvt__sess_own_tail_lost(const kvt_session *s);

/* ---- 1 session/signals.c ---- */
/* Attention captured for the last decoded chunk -> block signals (best effort). */
void kvt__sess_observe(kvt_session *s, bool prompt);
/* The same for the chunk's query rows [lo, hi) only (relative to its first row), as if they had
** been decoded as a chunk of their own: rows before hi never see later ones. */
void kvt__sess_observe_rows(kvt_session *s, bool prompt, int32_t lo, int32_t hi);

/* ---- 1 session/elastic.c ---- */
/* Validate p's elastic fields (KVT_EINVAL naming the value). */
int kvt__sess_elastic_check(const struct kvt_session_params *p);
/* n tokens were just decoded into the session: run a live ElasticKV pass when one is due
** (kvt_session_params.elastic_sk).  On error the cache is unchanged (kvt_seq_elastic) and the
** pass is tried again after the next tokens. */
int kvt__sess_elastic(kvt_session *s, int32_t n);
/* The elastic_* fields of st. */
void kvt__sess_elastic_stats(const kvt_session *s, struct kvt_session_stats *st);

/* ---- 2 session/blocks.c ---- */
/* Record tokens[0..n) just decoded at positions next_pos.. in the block table, sealing blocks as
** they fill.  A block never holds more than `block` tokens: a full block whose seal fails is
** closed without a saved copy (reported on stderr) and recomputed from its tokens if it is
** evicted and needed, so a failing pool is not an error here.  Errors: KVT_ENOMEM (the block
** table cannot grow; the tokens from the one that needed a new block on are not recorded). */
int kvt__sess_record(kvt_session *s, const kvt_token *tok, int32_t n, int role);
/* Seal the open block (also one not yet full): save its K/V to the pool (write-through),
** detokenize its text.  On error the block stays open and resident; nothing is lost. */
int kvt__sess_seal(kvt_session *s);
/* Make room so that `need` more tokens fit (watermark eviction).  KVT_EBUDGET when even evicting
** every unprotected block cannot. */
int kvt__sess_make_room(kvt_session *s, int32_t need);
/* Load evicted block i back at next_pos (kv_restore: pool copy + RoPE re-anchoring; breadcrumb:
** re-decode).  A block whose copy is gone (corrupt, missing spill file, dropped by the pool) is
** re-decoded from its tokens instead (counted in recomputes).  Errors: those of kvt_block_load
** and kvt_engine_decode (a block whose recompute failed is left LOST, evicted). */
int kvt__sess_load_block(kvt_session *s, int32_t i);
/* Move sealed resident blocks to the tail so that blocks loaded meanwhile read before them (a long
** message's question stays last: kvt__sess_recover_own_tail): lift takes block i's cells out of
** the cache (its sealed copy stays; not counted as an eviction), place loads it back at next_pos
** by RoPE re-anchoring (its copy gone: re-decoded, counted in recomputes; not counted as a
** recovery).  Errors of place: those of kvt__sess_load_block. */
void kvt__sess_lift_block(kvt_session *s, int32_t i);
int kvt__sess_place_block(kvt_session *s, int32_t i);
/* Remove block b from the cache, the pool and the index and free its memory (b is zeroed). */
void kvt__sess_drop_block(kvt_session *s, struct blk *b);
/* Where a sealed block's copy lives: the session's host pool, or with a store the store (its
** content entry when b->copy_content, else a private entry under b->key: the store replaces
** the pool).  Delete b's copy (a content entry, shared, is only forgotten).  Errors ignored. */
void kvt__sess_copy_del(kvt_session *s, struct blk *b);
/* enum kvt_tier of b's copy now: RAM, DISK or NONE. */
int kvt__sess_copy_tier(const kvt_session *s, const struct blk *b);
/* HOST vs DISK from the pool (or the store) now; a block whose copy is gone is LOST. */
void kvt__sess_refresh_residency(const kvt_session *s, struct blk *b);
/* Load a recovery plan's blocks back where it says (room made for them under the budget, the
** weakest dropped while they do not fit; a block whose copy is gone is recomputed), then free
** the plan (zeroed).  Errors: those of kvt__sess_seal and kvt__sess_load_block. */
int kvt__sess_recover_apply(kvt_session *s, struct rplan *p);

/* ---- 3 session/reuse.c ---- */
/* Before prefilling tok[0..n) of a prompt: the longest prefix of its full blocks found in the
** store is loaded and recorded; *used = its tokens (the caller decodes the rest). */
int kvt__sess_route(kvt_session *s, const kvt_token *tok, int32_t n, int role, int32_t *used);
/* reuse.c: the load-or-decode step of both reuse paths (the store's prompt prefix, a reused
** chunk): the `found` blocks bp[] are loaded at s->next_pos + q * block in one kvt_blocks_load,
** all or nothing, and recorded as the next found * block tokens of tok as if decoded (each block
** seals with the bytes loaded: s->preload).  moved: a reused chunk (saved at other positions:
** the session's chain keys end, copies keep their saved position, blocks marked from_chunk; the
** KVT__FAULT_CHUNK_LOAD site).  A failed load leaves the sequence as it was, is counted
** (chunk_load_errors / store_load_errors) and reported on stderr, and *loaded is 0: the caller
** runs the tokens through the model instead.  Positions must be reserved by the caller.
** OUT *loaded (tokens).  Returns 0 or the error of recording them (KVT_ENOMEM, ...). */
int kvt__sess_load_run(kvt_session *s, const kvt_blob **bp, int32_t found, const kvt_token *tok, int role, bool moved,
                       int32_t *loaded);

/* ---- 4 session/chunks.c ---- */
/* The reused chunks of prompt tokens tok[0..n) (the last token never in one), greedy left to
** right at every offset, with the boundary recompute taken off their starts.  *runs: caller
** frees with kvt__sess_chunk_free.  0 runs without chunk_reuse or a store.  Errors: KVT_ENOMEM. */
int kvt__sess_chunk_plan(kvt_session *s, const kvt_token *tok, int32_t n, struct chunk_run **runs, int32_t *n_runs);
void kvt__sess_chunk_free(struct chunk_run *runs, int32_t n_runs);
/* Load run r (its tokens at tok) at the tail: early-seal the open block, fetch, kvt_blocks_load,
** record.  *used = tokens loaded (0: nothing loaded, the caller decodes them; a store miss or a
** failed load is not an error).  Errors: those of kvt__sess_record. */
int kvt__sess_chunk_load(kvt_session *s, const struct chunk_run *r, const kvt_token *tok, int role, int32_t *used);

/* ---- 5 session/feed.c ---- */
/* One run of tokens being fed. */
struct feed {
    const kvt_token *tok; /* [n], not owned */
    int32_t n, role, reserve_after;
    int32_t off;            /* tokens of tok in the cache (decoded or loaded) */
    bool routed;            /* the store's prefix lookup is done (or not wanted) */
    struct chunk_run *runs; /* reused chunks after the prefix (session/chunks.c) */
    int32_t n_runs, next_run, runs_base;
    bool logits;    /* the run's last token wants logits (false: more of the prompt follows it) */
    int32_t split;  /* > 0: tok[0, split) is a user message and tok[split, n) its assistant prefix,
                    ** decoded in the same chunk where a block holds both (one weight pass, not
                    ** two); the attention signals see the two parts as two chunks */
    bool split_cut; /* the run stopped at split: the message lost blocks of its own (the prefix
                    ** follows the own-tail recovery as a run of its own) */
    int32_t m;      /* the chunk handed out: its tokens, */
    bool last;      /*   the run's last chunk, */
    double t0;      /*   when it was handed out (ms) */
};

void kvt__sess_feed_init(struct feed *f, const kvt_token *tok, int32_t n, int role, int32_t reserve_after);
void kvt__sess_feed_free(struct feed *f);
/* The next chunk of the run: whatever must see the whole prompt before its first chunk (the
** store's prefix lookup, the plan of reused chunks) and the loads of reused chunks happen here;
** then room is made for the chunk (eviction) and its positions reserved.  room > 0: at most that
** many tokens.  Returns 1 with *c (decode it, then kvt__sess_feed_done), 0 when the run is in,
** or an error. */
int kvt__sess_feed_next(kvt_session *s, struct feed *f, int32_t room, struct kvt_decode_chunk *c);
/* The chunk handed out was decoded with result rc (its last logits in the engine when it wanted
** them): record its tokens, seal completed blocks, run the attention signals. */
int kvt__sess_feed_done(kvt_session *s, struct feed *f, int rc);
/* Decode tokens for the conversation in chunks that end at block boundaries, keeping the budget
** (plus reserve_after free tokens after the last chunk) at every chunk, each chunk alone. */
int kvt__sess_feed(kvt_session *s, const kvt_token *tok, int32_t n, int role, int32_t reserve_after);

/* ---- 6 session/sync.c ---- */
int kvt__sess_push_msg(kvt_session *s, int role, const char *text, int keep);
void kvt__sess_set_text(kvt_session *s, char *fmt);
/* kvt__sess_set_text with the segment ending at stream token `at` (<= s->total) instead of s->total. */
void kvt__sess_set_text_at(kvt_session *s, char *fmt, int32_t at);
/* Tokens of the assistant prefix that follows fmt_msg, the template text of all the conversation's
** messages (not yet in kv_text): *n 0 (and *fmt_out NULL) when the template adds none or the text
** with it does not extend fmt_msg.  OUT *tok, *fmt_out (the text with it; caller frees both). */
int kvt__sess_prefix_tokens(kvt_session *s, const char *fmt_msg, kvt_token **tok, int32_t *n, char **fmt_out);
int kvt__sess_cut_stream(kvt_session *s, int32_t keep);
/* The reply `text` becomes an assistant message; kv_text ends after its first n_dec bytes (the
** part in the stream: strlen(text) unless its last token was not decoded). */
int kvt__sess_append_reply(kvt_session *s, const char *text, size_t n_dec);
/* Tokens of the template text of messages [0, n_msgs) (with the assistant prefix when add_ass)
** not yet in the stream, the stream cut back first where the text diverges.  OUT *tok (caller
** frees), *n, *fmt_out: the whole template text (caller frees; kv_text once they are in). */
int kvt__sess_pending_tokens(kvt_session *s, int32_t n_msgs, bool add_ass, kvt_token **tok, int32_t *n, char **fmt_out);
/* The stream ends with a token whose logits are not kept (nothing was decoded after a cut back):
** decode it again. */
int kvt__sess_refresh_logits(kvt_session *s);

#endif
