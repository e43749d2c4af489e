/* engine_int.h — the engine's state, shared by the files of src/engine/ (the only code in kvtier
** that includes llama.h).  Never installed.
**
**   engine.c   model + context open/close (unified cache or one stream per sequence), RoPE
**              verification at open, logging, position shadow
**   text.c     tokenize, detokenize, chat template
**   decode.c   decode (single sequence, multi-sequence rows), logits, sampling, grammar,
**              sequence removal/copy
**   kvio.c     block save/load through sequence state (host-side re-anchoring in src/kv/blob.c);
**              in streams mode also the whole-sequence paths of seq_cp and seq_shift
**   attn.c     attention capture (graph callback on kq_soft_max) mapped to positions
**   embed.c    the embedder: its own model and context for dense retrieval
**   ident.c    what names the engine's blocks in a store: model fingerprint, cache layout
**
** Facts and traps of the llama.cpp API this relies on: shared/notes/llama-kv-api.md (the team's
** notes beside the repository); for kv_unified = false, bench/llama-streams/REPORT.md. */
#ifndef KVT_ENGINE_INT_H
#define KVT_ENGINE_INT_H

#include "internal.h"
#include "kv/blob.h"

#include "ggml.h"
#include "llama.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

/* Per-sequence shadow of which positions hold a cell (the full-attention cache). */
struct posmap {
    uint8_t *bits;
    int32_t cap; /* positions covered */
    int32_t n;   /* positions set */
};

/* What the attention callback keeps for one layer: the last ubatch. */
struct attn_cap {
    int32_t layer;
    int32_t n_kv, n_tok, n_head; /* softmax shape */
    float *w;                    /* [n_head][n_tok][n_kv] */
    uint8_t *vis;                /* [n_tok][n_kv]: mask says visible */
    size_t cap_w, cap_vis;
    int32_t hd; /* Q head dim */
    float *q;   /* [n_tok][n_head][hd] */
    size_t cap_q;
    bool have, have_q;
    uint64_t gen; /* cache generation right after the capture */
    int32_t seq;
    kvt_pos *q_pos; /* [n_tok] */
    size_t cap_qpos;
};

/* One earlier tokenization the tokenizer's memo keeps (text.c): the text, its tokens, and the
** cuts after its control tokens: cut_tok[j] tokens hold exactly the text's first cut_chr[j] bytes. */
#define KVT__TOK_MEMO 8
struct tok_memo {
    char *text;
    size_t len;
    kvt_token *tok;
    int32_t n;
    bool add_bos;
    int32_t *cut_tok;
    size_t *cut_chr;
    int32_t n_cut;
    uint64_t used; /* the memo's clock at its last use; 0: empty */
};

struct kvt_engine {
    struct llama_model *model;
    struct llama_context *ctx;
    const struct llama_vocab *vocab;
    struct kvt_engine_params p;
    struct kvt_engine_info info;
    char model_path[1024];
    char *chat_template;                /* kvt_engine_params.chat_template, copied (NULL = the GGUF's) */
    int64_t model_size, model_mtime_ns; /* of the file loaded (ident.c checks them) */
    kvt_key fingerprint;                /* SHA-256 of the GGUF file, once have_fp */
    bool have_fp;
    int32_t seq_a, seq_b, seq_flush; /* scratch sequence ids; -1 where the mode has none */
    int n_parts;                     /* 2 for iSWA caches */
    bool unified;                    /* kv_unified: one cache shared by all sequences */
    int32_t n_seq_max;               /* sequence ids in the context: caller's + scratch */
    uint32_t n_stream;               /* stream records per part of a state: 1 or n_seq_max */
    int32_t n_ctx_seq;               /* cells one sequence can hold */
    uint8_t *ref;                    /* streams mode: a one-token state of this context, */
    size_t ref_n;                    /*   canonical form: the layout loads are checked against */
    uint64_t *multi_gen;             /* [n_seq_max]: gen after a a rows-only decode batch with the seq */
    int test_corrupt_part;           /* test hook: corrupt the next set_data's part; -1 off */
    struct llama_batch batch;
    float *logits;
    bool have_logits;
    bool shift_pending, skip_flush;
    struct posmap *pm; /* [n_seq_max] */
    uint64_t gen;      /* bumps on every cache mutation */
    /* re-anchoring */
    struct kvt__rope *rope[2]; /* per part, per layer of the part */
    int32_t n_rot;
    bool neox;
    /* layer il -> part (0 full, 1 SWA) and index within the part; -1 unknown */
    int8_t *layer_part;
    int16_t *layer_idx;
    /* attention capture */
    struct attn_cap *caps;
    int32_t n_caps;
    bool capture_q, capturing;
    int32_t cur_seq, cur_n;            /* the captured rows: sequence, count, */
    const kvt_pos *cur_pos;            /*   positions */
    int32_t cap_ubatch, cap_rows;      /* their ubatch (index in the llama_decode) and its rows */
    int32_t ub_seen;                   /* ubatches of this llama_decode begun so far - 1 */
    int32_t cap_first_layer;           /* lowest captured layer: its softmax starts a ubatch */
    void *mask_probe[KVT__MAX_LAYERS]; /* open-time: mask tensor per layer */
    bool probing;
    /* host copies of device tensors the capture reads (softmax or Q, K, mask), and K as floats */
    uint8_t *dev_buf[3];
    size_t dev_cap[3];
    float *fa_k;
    size_t fa_cap_k;
    /* sampler chain, rebuilt when the sampling params change; smpl_draw: kvt_engine_sample's
    ** draws so far with these params (a caller without its own draw index gets one stream) */
    struct llama_sampler *smpl, *smpl_t; /* top_n_sigma .. min_p; then the temperature (or greedy) */
    /* DRY's samplers (each maps its sequence breakers over the vocabulary once) for the last settings
    ** used, least recently used replaced; reset and given the history at each draw, so generations with
    ** the same settings share one.  n_seq + 4 of them: more than the generations that can draw in turn,
    ** so that concurrent generations with settings of their own never take each other's slot (a miss
    ** costs a scan of the vocabulary per breaker, on every token while they alternate) */
    struct dry_slot {
        struct llama_sampler *s; /* NULL: free */
        float mult, base;
        int32_t allowed, win;
        uint64_t hash, used; /* of the breakers' text; the draw that used it last */
        char *brk;           /* the breakers' text, each ended by a zero byte (owned): a slot is taken
                             ** for equal bytes, not for an equal hash (clients choose the breakers) */
        size_t brk_len;
    } *dry;
    int32_t n_dry;
    uint64_t dry_clock;
    int64_t dry_made; /* DRY samplers made, over the engine's life (src/test_hooks.h) */
    int test_dry_hash; /* src/test_hooks.h kvt_engine_test_dry_hash */
    struct kvt_sampling smpl_p;
    int64_t smpl_draw;
    uint32_t smpl_p_seed; /* the seed of those draws */
    /* each generation's own generator (llama.cpp's dist sampler, as a llama-server slot has one):
    ** [n_seq + 4]: one per sequence id (n_seq + 3 of them, scratch ones included) and a last one for
    ** kvt_engine_sample */
    struct gen_rng {
        struct llama_sampler *dist; /* NULL: none yet */
        uint32_t seed;              /* the seed it was created with */
        int64_t next;               /* the draw it gives next */
        struct llama_sampler *xtc;  /* the generation's XTC sampler (its own generator), NULL: none */
        float xtc_p, xtc_t;         /* its probability and threshold */
        uint32_t xtc_seed;
        int64_t xtc_next;           /* the draw it gives next */
        struct llama_sampler *miro; /* the generation's Mirostat sampler (generator and mu), NULL: none */
        int32_t miro_v;
        float miro_tau, miro_eta;
        uint32_t miro_seed;
        int64_t miro_next; /* the draw it gives next */
    } * rng;
    int32_t n_rng;
    /* the cell positions of one sequence and part (kvt__engine_cell_pos), kept while gen is unchanged */
    uint8_t *cp_buf;
    size_t cp_cap;
    kvt_pos *cp_pos;
    uint32_t cp_n, cp_cap_pos;
    int32_t cp_seq, cp_part;
    uint64_t cp_gen;
    int64_t cp_snapshots;   /* reads that fell back to a whole snapshot (test hook) */
    bool cp_force_snapshot; /* test hook: always the snapshot */
    /* last whole-sequence snapshot taken for attention mapping, reused while gen is unchanged */
    uint8_t *snap;
    size_t snap_n;
    uint64_t snap_gen;
    int32_t snap_seq;
    /* the tokenizer's memo (text.c): kvt_tokenize may run on any thread, so under memo_mu */
    pthread_mutex_t memo_mu;
    struct tok_memo memo[KVT__TOK_MEMO];
    uint64_t memo_clock;
    int64_t memo_tokens; /* tokens taken from it instead of tokenized, over the engine's life */
    int memo_mode;       /* test hook: 0 on, 1 off, 2 and 3 unsafe controls (test_hooks.h) */
    /* the tokens llama.cpp cuts a text at before tokenizing (control, user-defined, unknown),
    ** grouped by first byte: sp_text[sp_first[c] .. sp_first[c + 1]) start with byte c */
    bool sp_built;
    const char **sp_text;
    uint32_t *sp_len;
    int32_t sp_first[257];
    uint32_t sp_max;
    bool sp_lstrip; /* one of them strips whitespace to its left */
};


/* ---- engine.c ---- */
extern bool kvt__engine_verbose;                   /* llama.cpp's log on stderr (kvt_engine_params.verbose) */
extern _Thread_local bool kvt__engine_short_write; /* a state read into a short buffer on purpose:
                                                    ** llama.cpp's error about it is not printed */
void kvt__engine_log_cb(enum ggml_log_level level, const char *text, void *ud);
bool kvt__engine_quiet_progress(float progress, void *ud);
void kvt__engine_backends(void); /* loads ggml's dynamic backends when none is linked in */
/* Position shadow: mark / clear [p0, p1) / highest set position (-1 when empty).  Positions are
** [0, KVT__MAX_POS): set and reserve refuse others (KVT_EINVAL, naming it); both can fail with
** KVT_ENOMEM while the map grows, so a caller that must not fail after changing the cache
** reserves its highest position first (kvt__pm_reserve: the map then covers [0, p], nothing set),
** after which a set of any position up to p cannot fail. */
int kvt__pm_reserve(struct posmap *m, kvt_pos p);
int kvt__pm_set(struct posmap *m, kvt_pos p);
void kvt__pm_clear(struct posmap *m, kvt_pos p0, kvt_pos p1);
kvt_pos kvt__pm_max(const struct posmap *m);

/* ---- text.c ---- */
/* Frees the tokenizer's memo (kvt_engine_free). */
void kvt__engine_memo_free(kvt_engine *e);

/* ---- decode.c ---- */
bool kvt__engine_seq_ok(const kvt_engine *e, int32_t seq); /* user and scratch sequence ids */

/* ---- kvio.c ---- */
/* Apply a pending K-shift now (one token through the flush sequence, removed again). */
int kvt__engine_flush_shift(kvt_engine *e);
/* The whole state of sequence seq (llama_state_seq_get_data), *buf owned by the caller. */
int kvt__engine_save_seq(kvt_engine *e, int32_t seq, uint8_t **buf, size_t *n);
/* The whole state of sequence seq as of now, owned by the engine (e->snap) and valid until the
** cache changes (e->gen): one get_data serves the attention map and the block saves of a step. */
int kvt__engine_snapshot(kvt_engine *e, int32_t seq, const uint8_t **buf, size_t *n);
/* Positions of sequence seq's cells in cache part `part` (0: full attention, 1: the sliding
** window of an iSWA model), in cell order: the columns of a captured softmax.  Read from the cell
** records llama.cpp writes before any K/V row: the state goes into a buffer with room for the
** records only, so llama_state_seq_get_data stops at the first row and no K/V is copied (a whole
** snapshot when the records do not parse).  OUT *pos [*n], owned by the engine, valid until the
** cache changes.  Errors: KVT_EFORMAT, KVT_ENOMEM, KVT_ELLAMA. */
int kvt__engine_cell_pos(kvt_engine *e, int32_t seq, int part, const kvt_pos **pos, uint32_t *n);
/* Streams mode: copy positions [p0, p1) of src into dst through whole-sequence state. */
int kvt__engine_seq_cp_host(kvt_engine *e, int32_t src, int32_t dst, kvt_pos p0, kvt_pos p1);
/* Streams mode, host re-anchoring: move [p0, p1) of seq by delta (K rotated on the host). */
int kvt__engine_seq_shift_host(kvt_engine *e, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_pos delta);

/* Replace every cell of seq by the state buf[0..n) (this context's layout); if llama.cpp rejects
** it, prev[0..prev_n) (the sequence's state before, borrowed) is written back (KVT_ELLAMA).  Both
** cache modes. */
int kvt__engine_replace_seq(kvt_engine *e, int32_t seq, uint8_t *buf, size_t n, const uint8_t *prev, size_t prev_n,
                            const char *what);

/* ---- attn.c ---- */
/* llama.cpp's cb_eval: keeps the softmax (and Q) of the captured layers' last ubatch. */
bool kvt__attn_eval_cb(struct ggml_tensor *t, bool ask, void *ud);
struct attn_cap *kvt__attn_cap_for(kvt_engine *e, int il);

#endif
