/*
** kvtier.h — a KV-cache memory hierarchy for llama.cpp.
**
** This header is the whole public API and its manual: anything not declared here is internal
** (libkvtier.so exports exactly the functions declared here).  Longer notes on a field or call
** are in docs/MANUAL.md, under a section named after it.  Sections:
**   1. Errors            int returns: 0 = success, else a negative KVT_E* code.
**   2. Engine            one llama.cpp model + context: tokenize, chat template, decode, sample.
**   3. Block primitives  save a position range to host memory and load it back elsewhere (RoPE
**                        re-anchoring, no forward pass); per-head attention capture.
**   4. Host pool         byte-budgeted host RAM tier that spills to checksummed files.
**   5. Session           one conversation under a token budget: eviction, recovery, retrieval.
**   6. Signals           attention entropy and head classes.
**   7. Dense retrieval   optional embeddings and approximate nearest neighbours.
**   8. Block store       content-addressed blocks in tiers (RAM -> disk -> Redis).
**   9. Block codecs      self-describing block encodings: raw, KIVI q8/q4, ecq, ElasticKV.
**
** Units: token counts are tokens, positions are llama_pos-style int32 (half-open [p0, p1)),
** sizes are bytes, times are milliseconds.
**
** Thread-safety ("engine rule"): an engine and the sessions on it are single-threaded objects:
** the caller serialises every call that names the same engine.  Sessions on one engine may be
** interleaved call by call (each keeps its own logits).  The host pool and the block store are
** thread-safe.  An embedder and an ANN index are single-threaded like an engine.  Functions
** marked "pure" touch no shared state and may be called from any thread, as may kvt_strerror()
** and kvt_errmsg().
*/
#ifndef KVTIER_H
#define KVTIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ==== 1. Errors ====================================================================== */

/* One table of error codes (libuv style).  Every function that can fail returns 0 or one of
** these negative values, and leaves a message naming the offending value in kvt_errmsg(). */
#define KVT_ERRNO_MAP(X)                                                        \
    X(EINVAL, -1, "invalid argument")                                           \
    X(ENOMEM, -2, "out of memory")                                              \
    X(EIO, -3, "i/o error")                                                     \
    X(ECORRUPT, -4, "stored data failed its checksum")                          \
    X(ENOENT, -5, "not found")                                                  \
    X(EMODEL, -6, "model could not be loaded")                                  \
    X(ELLAMA, -7, "llama.cpp call failed")                                      \
    X(ECTX, -8, "does not fit in the context window")                           \
    X(EBUDGET, -9, "does not fit in the token budget")                          \
    X(EUNSUPPORTED, -10, "not supported for this model or cache configuration") \
    X(EFORMAT, -11, "malformed KV block")                                       \
    X(ECANCELED, -12, "canceled by the caller")

enum kvt_errno {
    KVT_OK = 0,
#define KVT__ERR_ENUM(name, code, msg) KVT_##name = code,
    KVT_ERRNO_MAP(KVT__ERR_ENUM)
#undef KVT__ERR_ENUM
};

/* Static description of an error code ("unknown error" for codes not in the table).
** Never fails; the string is static. */
const char *kvt_strerror(int err);

/* The detailed message of the last error raised on the calling thread, e.g.
** "budget 48 is smaller than two blocks of 64 tokens".  Thread-local; valid until the next
** kvtier call on the same thread; "" if none. */
const char *kvt_errmsg(void);

/* kvtier's version ("0.1.0"), and one line naming the kvtier git commit, the llama.cpp/ggml it
** was built against, what ggml's CPU code was compiled for and the device backend built beside
** it ("backend cpu", "vulkan" or "cuda").  Static strings; cannot fail. */
const char *kvt_version(void);
const char *kvt_build_info(void);

/* The compute devices llama.cpp can use in this process now, as one line written to buf[0..n)
** (NUL included, truncated to fit), e.g. "CPU (<cpu>); Vulkan0 (<device>)".  Loads ggml's
** backends if needed; a backend that finds no device is simply absent.  Returns the number of
** GPU or integrated-GPU devices.  Not thread-safe with engine creation. */
int kvt_devices(char *buf, size_t n);

/* ==== 2. Engine: one llama.cpp model and context ===================================== */

typedef struct kvt_engine kvt_engine;
typedef int32_t kvt_token;
typedef int32_t kvt_pos;

/* A content key: a SHA-256 digest (model fingerprints, block chain keys; section 8). */
#define KVT_KEY_BYTES 32
typedef struct kvt_key {
    uint8_t b[KVT_KEY_BYTES];
} kvt_key;

/* The content-addressed block store (section 8); sessions take one as a parameter. */
typedef struct kvt_store kvt_store;

/* How saved K is re-anchored to a new position (see kvt_block_load). */
enum kvt_reanchor {
    KVT_REANCHOR_AUTO = 0,    /* host rotation when verified at open, else SEQ_ADD */
    KVT_REANCHOR_HOST = 1,    /* rotate K rows of the saved block on the host (F32/F16 K only) */
    KVT_REANCHOR_SEQ_ADD = 2, /* llama_memory_seq_add: llama.cpp's lazy K-shift at the next decode */
};

enum kvt_flash_attn { KVT_FLASH_ATTN_AUTO = -1, KVT_FLASH_ATTN_OFF = 0, KVT_FLASH_ATTN_ON = 1 };

struct kvt_engine_params {
    const char *model_path;    /* GGUF file; required */
    int32_t n_ctx;             /* KV cells for the caller's sequences (tokens); default 4096.  Streams: each
                              ** sequence gets n_ctx / n_seq cells, rounded up to a multiple of 256;
                              ** unified: n_ctx cells that all sequences share */
    int32_t n_batch;           /* max tokens per llama_decode call; default 512 */
    int32_t n_ubatch;          /* physical micro-batch (tokens); default 512 */
    int32_t n_seq;             /* sequences the caller will use (ids 0..n_seq-1), 1..64; default 1 */
    bool kv_unified;           /* default false ("streams"): one KV stream per sequence, whose numbers are
                              ** bit-equal to a lone run; block save/load cost grows with the sequence.
                              ** true: llama.cpp's unified cache: any sequence may use all n_ctx cells,
                              ** kvt_seq_cp shares cells, but attention cost and logits depend on the
                              ** other sequences' cells.  docs/MANUAL.md, "Streams and the unified cache" */
    int32_t n_threads;         /* CPU threads; 0 = all cores */
    const char *type_k;        /* KV cache element type: "f16" (default), "f32", "q8_0" */
    const char *type_v;        /* same choices; quantised V needs flash attention */
    int32_t flash_attn;        /* enum kvt_flash_attn: AUTO (default; on when layers are offloaded or V is
                              ** quantised, as llama-server), OFF or ON (needed for a quantised V);
                              ** kvt_engine_info.flash_attn says what was chosen */
    int32_t n_gpu_layers;      /* layers on the GPU device (llama-server's -ngl): 0 = none, N = the output
                              ** layer and the last N - 1 repeating ones, -1 (default) = all; with no
                              ** device all run on the CPU (kvt_engine_info.device) */
    bool no_op_offload;        /* default false: a batch of >= 32 tokens runs on the device even for CPU
                              ** layers (llama-server's op offload); true: CPU layers compute on the CPU */
    int32_t reanchor;          /* enum kvt_reanchor; default AUTO */
    bool verbose;              /* pass llama.cpp's log through to stderr */
    const char *chat_template; /* template kvt_chat_format applies instead of the GGUF's: a llama.cpp
                              ** built-in name ("chatml", "gemma", ...) or Jinja text it recognises (not
                              ** executed).  Copied; NULL (default) = the GGUF's; unknown: KVT_EINVAL */
};

/* Defaults listed above.  Returned by value; cannot fail. */
struct kvt_engine_params kvt_engine_default_params(void);

/* Load the model and create a context (n_seq sequences plus internal scratch ones); verifies
** host RoPE re-anchoring and picks the path (docs/MANUAL.md, "Engine open").  OUT *out: free
** with kvt_engine_free.  Errors: KVT_EINVAL (bad params, e.g. unknown cache type), KVT_EMODEL (missing, truncated or
** unloadable GGUF; the message names the path), KVT_ELLAMA (context creation failed).
** On error *out is NULL and nothing is leaked. */
int kvt_engine_open(const struct kvt_engine_params *params, kvt_engine **out);

/* Free the context and the model.  Accepts NULL. */
void kvt_engine_free(kvt_engine *eng);

struct kvt_engine_info {
    char desc[128];         /* llama_model_desc, e.g. "gemma3 270M Q4_K - Medium" */
    char arch[32];          /* general.architecture */
    char name[128];         /* general.name ("" if absent) */
    bool has_chat_template; /* kvt_engine_params.chat_template was given or the GGUF carries tokenizer.chat_template */
    int32_t n_layer, n_head, n_head_kv, n_embd;
    int32_t n_swa;     /* sliding window (tokens), 0 = none */
    int32_t n_ctx;     /* cells in the context (all streams; scratch streams included) */
    int32_t n_ctx_seq; /* cells one sequence can hold (unified: n_ctx); a session budget must fit */
    bool kv_unified;   /* the cache mode in use (kvt_engine_params.kv_unified) */
    int32_t n_ctx_train;
    int32_t n_vocab;
    int32_t n_seq;             /* caller-usable sequence ids */
    int32_t reanchor;          /* path in use: KVT_REANCHOR_HOST or KVT_REANCHOR_SEQ_ADD */
    double reanchor_err;       /* max |K_host_rotated - K_llama| / max|K| seen at open; -1 if n/a */
    size_t kv_bytes_per_token; /* K+V bytes of one token across all layers of the cache types */
    const char *type_k, *type_v;
    bool flash_attn;        /* fused attention in use */
    char device[160];       /* where offloaded layers and their KV live: "CPU" or e.g. "Vulkan0 (...)" */
    int32_t n_layer_device; /* repeating layers on that device (0 on the CPU) */
};

/* Fill *info.  Cannot fail. */
void kvt_engine_info(const kvt_engine *eng, struct kvt_engine_info *info /* OUT */);

/* The model's fingerprint: SHA-256 of the GGUF file's bytes (not its path), computed on the first
** call (reads the whole file) and cached.  Errors: KVT_EIO (the file cannot be read again; the message names it), KVT_ENOMEM. */
int kvt_engine_fingerprint(kvt_engine *eng, kvt_key *out /* OUT */);

/* What besides the weights decides a saved block's bytes (format, cache types, layers, heads,
** window, RoPE path) as one stable string: blocks move between engines with equal fingerprints
** and layouts.  Writes at most n bytes (NUL included).  Cannot fail. */
void kvt_engine_layout(const kvt_engine *eng, char *buf, size_t n);

/* Tokenize UTF-8 text.  add_bos: prepend BOS if the model wants one; parse_special: treat "<start_of_turn>"
** etc. as control tokens (a text starting as a recent one reuses its tokens up to a control token: MANUAL.md).
** OUT *tokens (caller frees with free()), *n_tokens.  Errors: KVT_EINVAL (model has no tokenizer), KVT_ENOMEM. */
int kvt_tokenize(kvt_engine *eng, const char *text, bool add_bos, bool parse_special, kvt_token **tokens /* OUT */,
                 int32_t *n_tokens /* OUT */);

/* Detokenize n tokens to a NUL-terminated UTF-8 string (special tokens rendered when
** render_special).  OUT *text, caller frees with free().  Errors: KVT_ENOMEM. */
int kvt_detokenize(kvt_engine *eng, const kvt_token *tokens, int32_t n, bool render_special, char **text /* OUT */);

struct kvt_chat_msg {
    const char *role;    /* "system", "user" or "assistant" */
    const char *content; /* UTF-8 */
};

/* Format a conversation with the engine's chat template (kvt_engine_params.chat_template, else
** the GGUF's; if neither, the template named by `fallback`, e.g. "gemma", or "chatml" when NULL).
** add_assistant: append the assistant-turn prefix.  OUT *text, caller frees with free().
** Errors: KVT_EINVAL (unknown role or template), KVT_ENOMEM.  Thread-safe: it reads the model
** only, so any thread may call it while another decodes (as kvt_tokenize and kvt_detokenize may). */
int kvt_chat_format(kvt_engine *eng, const struct kvt_chat_msg *msgs, int32_t n_msgs, bool add_assistant, const char *fallback,
                    char **text /* OUT */);

/* The tokens a session decodes for a conversation: kvt_chat_format's text through
** kvt_tokenize(eng, text, true, true) (compare with kvt_session_tokens).  fallback: as the
** sessions' template_fallback.  OUT *tokens (caller frees with free()), *n_tokens.
** Errors: those of kvt_chat_format and kvt_tokenize. */
int kvt_chat_tokenize(kvt_engine *eng, const struct kvt_chat_msg *msgs, int32_t n_msgs, bool add_assistant, const char *fallback,
                      kvt_token **tokens /* OUT */, int32_t *n_tokens /* OUT */);

/* Prefill/decode tokens[0..n) into sequence seq at positions pos0, pos0+1, ... in chunks of
** n_batch.  pos0: the sequence's next position (any for an empty one).  want_logits: keep the
** last token's logits for kvt_engine_logits() / kvt_engine_sample().
** Errors: KVT_EINVAL (bad seq or n; positions outside [0, 2^30)), KVT_ECTX (no free KV cells),
** KVT_ELLAMA.  On error the failed chunk is not in the cache; earlier chunks are. */
int kvt_engine_decode(kvt_engine *eng, int32_t seq, const kvt_token *tokens, int32_t n, kvt_pos pos0, bool want_logits);

/* A prefill chunk of one sequence, to decode beside other sequences' decode rows. */
struct kvt_decode_chunk {
    int32_t seq;             /* the chunk's sequence: none of the rows' */
    const kvt_token *tokens; /* [n], not retained */
    int32_t n;               /* tokens, >= 1 (n = 0: no chunk) */
    kvt_pos pos0;            /* position of tokens[0]: the sequence's next position */
    bool want_logits;        /* keep the logits of its last token for kvt_engine_logits() */
};

/* Continuous batching with chunked prefill (as llama-server and vLLM), in ONE llama_decode: n rows
** (toks[i] at the next position pos[i] of distinct sequences seqs[i]; n may be 0) plus an optional
** prefill chunk of another sequence; n + chunk->n in 1..min(n_ubatch, 512).  OUT logits_out[i *
** n_vocab + v] (caller's n * n_vocab floats); the chunk's wanted logits go to kvt_engine_logits().
** Rows' attention is not captured (docs/MANUAL.md, "Continuous batching").
** Errors: KVT_EINVAL (sizes out of range, bad or repeated seq, a chunk sequence out of range or
** also a row, token outside the vocabulary), KVT_ECTX (no free KV cells: then none of the tokens
** is in the cache), KVT_ELLAMA.  Not thread-safe (engine rule). */
int kvt_engine_decode_batch(kvt_engine *eng, const int32_t *seqs, const kvt_token *toks, const kvt_pos *pos, int32_t n,
                            float *logits_out /* OUT [n * n_vocab] */, const struct kvt_decode_chunk *chunk);

/* Logits (n_vocab floats) of the last token decoded with want_logits.  Owned by the engine,
** valid until the next decode.  NULL if none.  Cannot fail. */
const float *kvt_engine_logits(kvt_engine *eng);

/* A grammar-constrained decoding state (llama.cpp's GBNF sampler): tokens sampled through it
** advance it; end-of-generation is allowed only where the grammar is complete.  One per reply. */
typedef struct kvt_grammar kvt_grammar;

/* Compile GBNF text (llama.cpp grammars/README.md syntax) for the engine's vocabulary, starting
** at rule `root` (NULL: "root").  OUT *out: free with kvt_grammar_free, before the engine.
** Errors: KVT_EINVAL (does not parse, or no such root), KVT_ENOMEM.  Not thread-safe (engine rule). */
int kvt_grammar_new(kvt_engine *eng, const char *gbnf, const char *root, kvt_grammar **out /* OUT */);

/* Free a grammar state (NULL is a no-op). */
void kvt_grammar_free(kvt_grammar *g);

/* One logit bias (OpenAI's and llama-server's logit_bias): bias is added to the token's logit
** before any sampler runs; -INFINITY bans the token. */
struct kvt_logit_bias {
    kvt_token token;
    float bias;
};

/* One token and its probability (kvt_sampling.post). */
struct kvt_token_p {
    kvt_token tok; /* -1: no such candidate */
    float p;       /* 0..1 */
};

struct kvt_sampling {
    float temperature;                       /* <= 0: greedy (argmax) */
    float top_p;                             /* 1.0 = off */
    int32_t top_k;                           /* 0 = off */
    uint32_t seed;                           /* used when temperature > 0 */
    kvt_grammar *grammar;                    /* NULL = unconstrained; else only tokens it allows, each advancing it (borrowed) */
    const struct kvt_logit_bias *logit_bias; /* [n_logit_bias] (borrowed; tokens outside the
                          ** vocabulary are skipped), applied to the logits first, greedy included */
    int32_t n_logit_bias;
    /* OUT, optional (llama-server's post_sampling_probs): the caller's post[0 .. n_post] gets the
    ** sampled token, then the n_post likeliest candidates, best first, with probabilities under the
    ** distribution drawn from (greedy: the token alone, p = 1); missing candidates are {-1, 0} */
    struct kvt_token_p *post;
    int32_t n_post;
    float min_p; /* 0 = off; else tokens under min_p x the likeliest's probability are dropped (after top_p) */
    /* Repetition penalties (llama.cpp's penalties sampler, after logit_bias, as llama-server) over the
    ** last penalty_last_n tokens (0: 64) of the context, prompt and reply so far: a session's stream,
    ** else (raw rows, kvt_engine_sample) history[n_history], oldest first (borrowed).  repeat: 0 or 1 =
    ** off, a token in the window has its logit divided by it (> 0) or multiplied (<= 0); frequency,
    ** presence: 0 = off, its logit minus frequency x its count in the window, minus presence once. */
    float repeat_penalty, frequency_penalty, presence_penalty;
    int32_t penalty_last_n, n_history;
    const kvt_token *history;
    /* llama-server's other samplers (llama.cpp's), 0 = off, in its order: top_n_sigma > 0 (logits within n standard
    ** deviations of the largest, Tang et al. 2024, "Top-n-sigma") before top_k; typical_p in (0, 1) (locally typical
    ** sampling, Meister et al. 2023) after it; XTC after min_p (Exclude Top Choices, text-generation-webui #6335:
    ** with chance xtc_probability a draw drops every token of probability >= xtc_threshold but the least likely of
    ** them; threshold > 0.5 = off; a generator per generation seeded with seed, as llama-server's); dynatemp_range
    ** > 0: the temperature within +-range by the normalised entropy ^ dynatemp_exponent (0: 1; arXiv 2309.02772).
    ** At temperature <= 0 (greedy) with typical_p or XTC the whole chain runs, as llama-server's; dynatemp does not. */
    float top_n_sigma, typical_p, xtc_probability, xtc_threshold, dynatemp_range, dynatemp_exponent;
    /* Mirostat (Basu et al. 2021): 1 or 2 (0 = off) at target surprise mirostat_tau bits (0: 5) and learning
    ** rate mirostat_eta (0: 0.1), llama.cpp's, as llama-server runs it: logit_bias, the temperature, then Mirostat
    ** draws (its own generator and mu per generation; a draw out of order starts it again); no other sampler
    ** and no penalty applies.  Greedy at temperature <= 0. */
    int32_t mirostat;
    float mirostat_tau, mirostat_eta;
    /* DRY (p-e-w's "Don't Repeat Yourself", llama.cpp's, after the penalties as in llama-server): dry_multiplier > 0
    ** penalises a token that would extend a repeat of the history's last dry_penalty_last_n tokens (0: 64) past
    ** dry_allowed_length by dry_multiplier x dry_base (0: 1.75) ^ (length - allowed); the sequence breakers (borrowed;
    ** NULL: llama-server's "\n", ":", "\"", "*") end a repeat.  Not with Mirostat. */
    float dry_multiplier, dry_base;
    int32_t dry_allowed_length, dry_penalty_last_n, n_dry_sequence_breakers;
    const char *const *dry_sequence_breakers;
};

/* Sample the next token from kvt_engine_logits() (llama.cpp's chain: logit_bias, penalties, DRY, top_n_sigma,
** top_k, typical_p, top_p, min_p, XTC, temperature, draw; a grammar masks the vocabulary when the first draw
** is not allowed).  Calls with the same settings and seed are draws 0, 1, ... of one generation, from one
** generator of its own (llama.cpp's dist sampler seeded with s->seed, as a llama-server slot's), so a seeded
** generation is reproducible whatever else the engine samples; seed 0xFFFFFFFF: random.
** Errors: KVT_EINVAL (no logits; the grammar allows no token), KVT_ENOMEM.  Not thread-safe (engine rule). */
int kvt_engine_sample(kvt_engine *eng, const struct kvt_sampling *s, kvt_token *tok /* OUT */);

/* Remove positions [p0, p1) of a sequence from the KV cache (p1 < 0: to the end).  Cannot
** fail for a valid seq; KVT_EINVAL otherwise. */
int kvt_seq_rm(kvt_engine *eng, int32_t seq, kvt_pos p0, kvt_pos p1);

/* Give sequence dst the cells of positions [p0, p1) of src (p1 < 0: to the end).  Unified: shared
** cells (never load or shift a sequence that shares cells); streams: a host copy into free
** positions (docs/MANUAL.md, "Copying and shifting cells").  On error dst is unchanged.
** Errors: KVT_EINVAL (bad or equal ids; streams: dst holds a position of the range, named),
** KVT_ECTX (streams: dst's stream cannot hold the cells), KVT_ENOMEM, KVT_ELLAMA. */
int kvt_seq_cp(kvt_engine *eng, int32_t src, int32_t dst, kvt_pos p0, kvt_pos p1);

/* Move the cells of positions [p0, p1) of a sequence by delta (< 0: down, closing an eviction
** gap), K re-rotated by RoPE as llama-server's context shift does.  [p0 + delta, p1 + delta) must
** be free in the sequence and >= 0.
** Errors: KVT_EINVAL (bad sequence, empty range, negative target, target occupied: the message
** names the position), KVT_ENOMEM, KVT_ELLAMA (streams).  On error the sequence is unchanged. */
int kvt_seq_shift(kvt_engine *eng, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_pos delta);

/* ==== 3. Block primitives ============================================================ */

/* A saved KV block: the llama_state_seq_get_data bytes of one position range, loadable into any
** engine on the same model and cache types.  Owned by the caller; free with kvt_blob_free. */
typedef struct kvt_blob {
    uint8_t *data;       /* llama.cpp sequence-state bytes (llama_state_seq_get_data format) */
    size_t size;         /* bytes */
    kvt_pos p0;          /* first position the K rows are rotated for */
    int32_t n_tokens;    /* positions covered: [p0, p0 + n_tokens) */
    int32_t n_cells;     /* cells in the full-attention part */
    int32_t n_cells_swa; /* cells in the sliding-window part (iSWA models), else 0 */
} kvt_blob;

/* Block save: copy positions [p0, p1) of sequence seq into a new host blob (n_tokens *
** kv_bytes_per_token bytes of K/V); the sequence keeps its cells.  On iSWA models save a block
** right after it is decoded, while its sliding-window cells exist (docs/MANUAL.md, "Block save
** and load").  OUT *out: caller frees with kvt_blob_free.
** Errors: KVT_EINVAL (empty range, bad seq), KVT_ENOENT (no cells in range), KVT_ENOMEM, KVT_ELLAMA. */
int kvt_block_save(kvt_engine *eng, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_blob **out);

/* Block load: put a saved block into sequence seq at positions [new_p0, new_p0 + n_tokens),
** re-anchoring K by RoPE for delta = new_p0 - blob->p0, with no forward pass (EVOKE/"KV splice"
** style).  new_p0 must be past every resident position of seq.  The blob is not modified, and
** its bytes are validated before anything is written (docs/MANUAL.md, "Block save and load").
** Errors: KVT_EINVAL (new_p0 not past the tail, or the block would pass position 2^30 - 1),
** KVT_EFORMAT (blob from another model or cache layout; cells that are not what the blob's
** fields say, the message naming the cell and position; an iSWA block without the sliding-window
** cells of its last positions), KVT_ECTX (no free cells; streams: the stream cannot hold the
** sequence's cells plus the block's), KVT_EUNSUPPORTED (rope type cannot be re-anchored, e.g.
** M-RoPE), KVT_ENOMEM, KVT_ELLAMA (streams: llama.cpp rejected the assembled state).
** On error the sequence is unchanged (streams: the same cells, packed within its stream). */
int kvt_block_load(kvt_engine *eng, const kvt_blob *blob, int32_t seq, kvt_pos new_p0);

/* Free a blob.  Accepts NULL. */
void kvt_blob_free(kvt_blob *blob);

/* Copy a blob (deep).  OUT *out.  Errors: KVT_ENOMEM. */
int kvt_blob_dup(const kvt_blob *blob, kvt_blob **out);

/* ---- Attention capture ----
** Post-softmax attention of chosen layers during every kvt_engine_decode (the last ubatch per
** layer), columns mapped to positions; with flash attention on, recomputed on the host, and
** empty for ALiBi and attention-sink models (docs/MANUAL.md, "Attention capture").  Source:
** EVOKE-style attention signals for H2O (Zhang et al. 2023) and SnapKV (Li et al. 2024). */

/* Choose layers to capture (il in [0, n_layer)); n = 0 turns capture off.  capture_q also
** keeps Q.  Errors: KVT_EINVAL (layer out of range), KVT_ENOMEM. */
int kvt_attn_capture(kvt_engine *eng, const int32_t *layers, int32_t n, bool capture_q);

/* Attention of one captured layer for the last ubatch decoded into a given sequence.
** Shapes: w[(t * n_head + h) * n_keys + k] is the softmax weight of query token t (the ubatch's
** t-th token of that sequence, positions q_pos[t]) in head h on key position k_pos[k]
** (ascending).  Unseen keys have weight 0; rows sum to 1 (sliding-window layers: may be less).
** q[(t * n_head + h) * head_dim + d] holds post-RoPE, pre-scale Q if capture_q was set.
** All arrays are malloc'd for the caller, who frees the struct with kvt_attn_free. */
typedef struct kvt_attn {
    int32_t layer, n_query, n_head, n_keys, head_dim;
    kvt_pos *q_pos; /* [n_query] */
    kvt_pos *k_pos; /* [n_keys] */
    float *w;       /* [n_query * n_head * n_keys] */
    float *q;       /* [n_query * n_head * head_dim] or NULL */
} kvt_attn;

/* Works in both cache modes.  OUT *out: free with kvt_attn_free.
** Errors: KVT_ENOENT (layer not captured or nothing decoded since), KVT_EUNSUPPORTED (the
** sequence's last decode was a row of kvt_engine_decode_batch, whose rows are not captured),
** KVT_EFORMAT (the cell map could not be reconstructed), KVT_ENOMEM. */
int kvt_attn_get(kvt_engine *eng, int32_t layer, int32_t seq, kvt_attn **out);
void kvt_attn_free(kvt_attn *a); /* frees the struct and its arrays; accepts NULL */

/* Layer il's cache part (0 = full-attention, 1 = an iSWA model's sliding-window cache) and its
** index among that part's layers.  Errors: KVT_ENOENT when unknown. */
int kvt_engine_layer_part(const kvt_engine *eng, int32_t il, int *part /* OUT */, int *idx /* OUT */);

/* ==== 4. Host pool: byte-budgeted RAM tier that spills to disk ======================= */

typedef struct kvt_pool kvt_pool;

struct kvt_pool_params {
    size_t budget_bytes;    /* RAM the pool may hold (a ceiling); default 256 MiB */
    const char *spill_dir;  /* directory for spill files; NULL = a private directory made
                              ** under $TMPDIR (or /tmp) on first spill, removed by free */
    size_t spill_bytes_max; /* payload bytes the spill files may hold; 0 = unlimited (the default);
                              ** past it least recently used entries are dropped (n_dropped) */
};

/* Defaults listed above.  Returned by value; cannot fail. */
struct kvt_pool_params kvt_pool_default_params(void);

/* Create a pool (p NULL = defaults).  OUT *out, freed by kvt_pool_free.  Without a spill_dir,
** the private directories that dead processes left in $TMPDIR are removed first (only kvtier's
** own, of this user, unlocked; docs/MANUAL.md, "Host pool spill files").
** Errors: KVT_EINVAL (budget 0, empty spill_dir), KVT_EIO (spill_dir exists but is not a
** writable directory), KVT_ENOMEM. */
int kvt_pool_open(const struct kvt_pool_params *p, kvt_pool **out);

/* Free the pool and delete the spill files it wrote (and its private directory).  Accepts
** NULL.  Must not run concurrently with other calls on the same pool. */
void kvt_pool_free(kvt_pool *pool);

/* Store a copy of data[0..n) under key (replacing any previous value).  Past the budget, least
** recently used entries (maybe this one) spill to checksummed files; once put returns RAM use is
** within budget.  The pool is a cache: an entry whose spill fails or finds no quota is dropped
** (n_dropped; gets say KVT_ENOENT).
** Errors: KVT_EINVAL (NULL data with n > 0; n larger than both the budget and spill_bytes_max),
** KVT_ENOMEM (the pool is unchanged), KVT_EIO (a spill write failed: the message says whether the
** new value is stored; the entries it was for are dropped, any old value is gone).  Thread-safe. */
int kvt_pool_put(kvt_pool *pool, uint64_t key, const void *data, size_t n);

/* Fetch a copy of key's value (a spilled one is read back and its SHA-256 checked).
** OUT *data (caller frees with free()), *n; on any error *data = NULL and *n = 0.
** Errors: KVT_EINVAL, KVT_ENOENT (also: dropped, or deleted while being read), KVT_ECORRUPT (also
** a truncated or padded file), KVT_EIO (file missing or unreadable), KVT_ENOMEM.  Thread-safe. */
int kvt_pool_get(kvt_pool *pool, uint64_t key, void **data, size_t *n);

/* Remove key (and its spill file).  Errors: KVT_ENOENT.  Thread-safe. */
int kvt_pool_del(kvt_pool *pool, uint64_t key);

struct kvt_pool_stats {
    int64_t n_entries, n_spilled;
    int64_t ram_bytes, spill_bytes; /* payload bytes held in RAM / in spill files */
    int64_t n_spill_writes, n_spill_reads, n_corrupt;
    int64_t n_dropped; /* entries dropped: failed spill write, or no room in the spill quota */
};
/* Cannot fail; thread-safe.  n_corrupt counts failed reads, not distinct entries. */
void kvt_pool_get_stats(kvt_pool *pool, struct kvt_pool_stats *st /* OUT */);

/* ==== 5. Session: one conversation under a token budget ============================== */

typedef struct kvt_session kvt_session;

enum kvt_role { KVT_ROLE_SYSTEM = 0, KVT_ROLE_USER = 1, KVT_ROLE_ASSISTANT = 2 };

enum kvt_residency {
    KVT_RES_DEVICE = 0, /* in the llama.cpp KV cache */
    KVT_RES_HOST = 1,   /* evicted; blob in host RAM (the pool's, or the store's RAM tier) */
    KVT_RES_DISK = 2,   /* evicted; blob in a spill file */
    KVT_RES_LOST = 3,   /* evicted with no saved copy: with recovery "discard" gone for good;
                        ** otherwise the copy failed its checksum, went missing, was dropped or
                        ** never saved, and recovery recomputes the block from its tokens */
};

enum kvt_recovery {
    KVT_RECOVERY_KV_RESTORE = 0, /* load saved K/V back, no recompute */
    KVT_RECOVERY_DISCARD = 1,    /* evicted blocks are gone (truncation baseline) */
    KVT_RECOVERY_BREADCRUMB = 2, /* re-prefill the block's tokens at the tail (the recompute path) */
};

/* Eviction policies: which resident blocks leave when the high watermark is crossed (sinks, the
** recent tail and the current turn are kept by all).  Names: "kvtier", "no_eviction", ...
**   KVTIER       the default: score of recency, BM25 relevance to the user message, attention
**                EWMA, role floors and pins; kv_restore recovery.
**   NO_EVICTION  reference: nothing is evicted (the budget must hold the conversation).
**   TRUNCATE     llama-server's context shift: keep the first block, drop the older half.
**   STREAMING    StreamingLLM (Xiao et al. 2023): sink block + recent window.
**   H2O          Heavy-Hitter Oracle (Zhang et al. 2023): lowest accumulated attention leaves.
**   SNAPKV       SnapKV (Li et al. 2024): lowest attention from the last snap_window queries.
**   INFLLM       InfLLM (Xiao et al. 2024): recency eviction; the mean query of a user message's
**                last 32 tokens scores evicted blocks by their 4 most-attended keys, top_k
**                come back.  docs/MANUAL.md, "Eviction policies".
** Baselines other than KVTIER and INFLLM do no recovery. */
enum kvt_policy {
    KVT_POLICY_KVTIER = 0,
    KVT_POLICY_NO_EVICTION = 1,
    KVT_POLICY_TRUNCATE = 2,
    KVT_POLICY_STREAMING = 3,
    KVT_POLICY_H2O = 4,
    KVT_POLICY_SNAPKV = 5,
    KVT_POLICY_INFLLM = 6,
    KVT_POLICY__COUNT
};

/* Policy <-> name.  kvt_policy_from_name: KVT_EINVAL for an unknown name (the message lists the
** known ones).  kvt_policy_name: static string, "unknown" out of range. */
int kvt_policy_from_name(const char *name, int32_t *policy /* OUT */);
const char *kvt_policy_name(int32_t policy);

/* Recovery <-> name ("kv_restore", "discard", "breadcrumb"); same contract. */
int kvt_recovery_from_name(const char *name, int32_t *recovery /* OUT */);

/* "keep" hint on a message (kvt_session_add): PIN blocks are never evicted; PREFER blocks get
** a score bonus under the kvtier policy. */
enum kvt_keep { KVT_KEEP_NONE = 0, KVT_KEEP_PREFER = 1, KVT_KEEP_PIN = 2 };

/* Eviction scorer: higher = keep; `now` is the session's position.  Default: recency. */
struct kvt_block_info;
typedef double (*kvt_scorer_fn)(const struct kvt_block_info *b, kvt_pos now, void *ud);

struct kvt_session_params {
    int32_t seq;                   /* engine sequence id to use; default 0 */
    int32_t budget;                /* max resident tokens; default 512; >= 2 blocks */
    int32_t block;                 /* tokens per block; default 64 */
    float high_watermark;          /* evict when resident > high * budget; default 0.95 */
    float low_watermark;           /* ... down to low * budget; default 0.75 */
    int32_t n_sink_blocks;         /* leading blocks never evicted (attention sinks); default 1 */
    int32_t n_recent_blocks;       /* trailing complete blocks never evicted; default 1 */
    int32_t recovery;              /* enum kvt_recovery; default KV_RESTORE */
    int32_t top_k;                 /* blocks recovered per user turn at most; default 4 */
    int32_t gen_reserve;           /* tokens kept free for the reply; default 64 */
    float min_recovery_score;      /* BM25 score a block needs to be recovered; default 3.0
                              ** (one shared rare term scores about 2-3, a common one < 1) */
    const char *template_fallback; /* chat template when the GGUF has none; default "gemma" */
    kvt_pool *pool;                /* host tier (borrowed); NULL = a private 256 MiB pool.  Must be
                              ** NULL with a store, which then holds every copy */
    kvt_scorer_fn scorer;          /* overrides the policy's scorer when set */
    void *scorer_ud;
    int32_t policy;             /* enum kvt_policy; default KVTIER (baselines override recovery) */
    const int32_t *attn_layers; /* layers whose attention feeds the policies; NULL = an iSWA model's
                              ** full-attention layers, else three spread ones.  Copied at open */
    int32_t n_attn_layers;
    int32_t snap_window;           /* SnapKV observation window (queries); default 32 */
    float ewma_alpha;              /* attention EWMA weight of the newest observation; default 0.3 */
    const char *head_profile;      /* `kvtier calibrate` profile weighting heads (read at open); NULL = equal */
    struct kvt_embedder *embedder; /* dense recovery (section 7): evicted blocks ranked by cosine to the
                              ** message instead of BM25.  Borrowed; NULL = BM25 (the default) */
    float min_recovery_cosine;     /* with an embedder: cosine a block needs to come back; default 0.5
                              ** (model-dependent: docs/MANUAL.md, "Dense recovery") */
    int32_t ann_min_blocks;        /* with an embedder: sealed blocks from which an HNSW index (kvt_ann)
                              ** replaces the linear scan; default 1024 */
    int32_t successor_blocks;      /* evicted blocks back after a recovered one (BM25 hits ending in its
                              ** last quarter, dense hits) or a moved one (docs/RETRIEVAL.md); default 1 */
    kvt_store *store;              /* block store (section 8) for prompt prefixes and the session's
                              ** copies; borrowed; NULL = none (the default).  docs/MANUAL.md,
                              ** "A session and the block store" */
    const char *tenant;            /* chain salt (kvt_chain_params.tenant): sessions of different
                              ** tenants never share blocks; NULL/"" = shared.  Copied at open */
    const char *codec_ram;         /* codec (section 9 spec) of host pool saves; NULL = "raw" (bit-exact).
                              ** docs/MANUAL.md, "The host pool codec" */
    const uint8_t *codec_ram_bits; /* NULL, or a q8/q4 codec_ram's bits per (layer, KV head): 4 or 8,
                              ** n_layer x n_head_kv (kvt_codec_params.head_bits); copied at open */
    int32_t n_codec_ram_bits;      /* entries of codec_ram_bits */
    float elastic_sk, elastic_sv;  /* live ElasticKV threshold scales in [0, 2] (elements below
                              ** max(sigma_h / 2, mu_h) x s zeroed); both 0 = off (the default;
                              ** ElasticKV uses 0.45, 0.50).  docs/MANUAL.md, "Live ElasticKV" */
    bool elastic_random;           /* control: passes zero as many elements at random; default false */
    float elastic_random_frac;     /* with elastic_random: target sparsity; 0 (default) = the threshold's */
    bool chunk_reuse;              /* non-prefix chunk reuse (EPIC, Hu et al. 2024; CacheBlend,
                              ** Yao et al. 2025); needs store; default false (it costs quality).
                              ** docs/MANUAL.md, "Non-prefix chunk reuse" */
    const char *chunk_recompute;   /* tokens re-decoded at each reused chunk's start (EPIC): "K" tokens or
                              ** "P%" of the run, rounded up to whole blocks; NULL = "15%"
                              ** (CacheBlend's ratio); see kvt_chunk_recompute_parse */
    /* The prefill's decisions, one line each (NULL: none): every run of tokens it feeds (and how
    ** many came from the caller's tokens), the store prefix looked up and loaded, reused chunks,
    ** each recovery plan (blocks, scores, where they go) and each block evicted (with its score).
    ** line: owned by the session, valid during the call, on the thread that drives the session.
    ** `kvtier chat --explain` prints them. */
    void (*explain)(void *ud, const char *line);
    void *explain_ud;
};

/* Parse a chunk_recompute spec: "K" (0..1<<20 tokens) -> *tokens = K, *pct = -1; "P%" (0..100,
** decimals allowed) -> *tokens = -1, *pct = P.  Errors: KVT_EINVAL naming the spec. */
int kvt_chunk_recompute_parse(const char *spec, int32_t *tokens /* OUT */, double *pct /* OUT */);

/* Live ElasticKV in sessions (kvt_session_params.elastic_sk): the source design's constants. */
#define KVT_ELASTIC_SINK     64  /* positions [0, 64) are never pruned (attention sinks) */
#define KVT_ELASTIC_TAIL     64  /* nor the last 64 positions (nor the open block) */
#define KVT_ELASTIC_INTERVAL 64  /* a pass every 64 tokens decoded into the session */
#define KVT_ELASTIC_WARMUP   128 /* from 128 resident tokens on */

/* Where the last prompt prefill's tokens came from: the block store's lookup before a prefill
** (kvt_session_stats.route, kvt_sync_info.route). */
enum kvt_route {
    KVT_ROUTE_NONE = 0,    /* no lookup: no store, no full block to look up, or the session's KV
                           ** is no longer a cold prefill's (after an eviction) */
    KVT_ROUTE_MISS = 1,    /* looked up, the first block was not found */
    KVT_ROUTE_PARTIAL = 2, /* a prefix of the blocks was found and loaded, the rest prefilled */
    KVT_ROUTE_EXACT = 3,   /* every full block before the prompt's last token was found */
};
/* "none", "miss", "partial", "exact" (static; "unknown" out of range).  Pure. */
const char *kvt_route_name(int route);

/* The defaults of struct kvt_session_params, as listed above.  Returned by value; cannot fail; thread-safe. */
struct kvt_session_params kvt_session_default_params(void);

/* Create a session on engine sequence p->seq (must be empty).  OUT *out: free with
** kvt_session_free.  Errors: KVT_EINVAL (the message names the bad value: budget under two
** blocks, watermarks out of order, seq out of range, a bad spec), KVT_ENOMEM. */
int kvt_session_open(kvt_engine *eng, const struct kvt_session_params *p, kvt_session **out);

/* Free the session, its blobs in the pool (or its private entries in the store; content
** entries stay, shared), and its cells in the engine.  Accepts NULL. */
void kvt_session_free(kvt_session *s);

/* Append a message.  System and assistant messages are recorded and decoded with the next user
** message.  For a user message: evicted blocks relevant to it come back at the tail (top_k plus
** successors), then it and the assistant prefix are decoded, evicting by watermark so that they
** plus gen_reserve fit the budget (docs/MANUAL.md, "What kvt_session_add does with a message").
** keep: the hint for the message's blocks (enum kvt_keep; KVT_KEEP_NONE for none).
** Errors: KVT_EINVAL (role, keep), KVT_EBUDGET (the message alone does not fit: the message names
** its token count and the budget), KVT_ECTX, KVT_ELLAMA.  On error the message is not in the
** conversation and the block table is consistent with the KV cache. */
int kvt_session_add(kvt_session *s, enum kvt_role role, const char *text, int32_t keep);

/* Per generated token callback; return false to stop.  piece is the token's UTF-8 text. */
typedef bool (*kvt_token_cb)(const char *piece, void *ud);

/* Generate the assistant reply (at most max_tokens; stops at end-of-generation) and keep it in
** the KV cache; evicts by watermark as it goes.  OUT *reply: caller frees with free() (may be
** NULL if not wanted).  Errors: KVT_ECTX, KVT_ELLAMA, KVT_EBUDGET. */
int kvt_session_generate(kvt_session *s, int32_t max_tokens, const struct kvt_sampling *smp, kvt_token_cb cb, void *ud,
                         char **reply);

/* Teacher-forced log-probability of `answer` as the reply (in a scratch copy; the session is
** unchanged).  OUT *logprob (nats, summed), *n_tokens.  Errors: KVT_ECTX, KVT_ELLAMA. */
int kvt_session_answer_logprob(kvt_session *s, const char *answer, double *logprob, int32_t *n_tokens);

/* ---- Servers: whole-conversation sync and step-wise generation ---- */

struct kvt_sync_info {
    int32_t prompt_tokens;          /* tokens of the formatted conversation (with assistant prefix) */
    int32_t tokens_reused;          /* prompt tokens already in the session (prompt - decoded, >= 0) */
    int64_t tokens_decoded;         /* tokens run through the model by this call (prefill, re-fed tails) */
    int64_t tokens_recovered;       /* tokens brought back by kv_restore by this call */
    int64_t evictions, recoveries;  /* block evictions / loads by this call */
    int64_t recomputes;             /* of those loads, blocks re-decoded: their saved copy was lost */
    int32_t route;                  /* enum kvt_route over this call's prompt lookups (block store) */
    int64_t tokens_from_store;      /* prompt tokens loaded from the store (neither decoded nor reused) */
    int64_t tokens_from_chunks;     /* prompt tokens loaded as reused chunks (not in tokens_from_store) */
    int64_t chunk_recompute_tokens; /* tokens of found chunks decoded at their start (in tokens_decoded) */
};

/* Make the conversation exactly msgs[0..n_msgs) (the whole history a client resends) plus the
** assistant prefix: the common prefix of messages is kept, the rest added with kvt_session_add
** (re-decoding from where the tokens diverge).  The last message must be the user's; the same
** conversation again right after its reply (a retry; not after a park) drops the reply and
** restores the prompt's logits bit for bit, decoding nothing.  msgs is not retained.  OUT *out.
** Errors: KVT_EINVAL (no messages, unknown role, NULL content, last message not from the user,
** a reply still being generated), plus those of kvt_session_add.  Not thread-safe (engine rule). */
int kvt_session_sync(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n_msgs, struct kvt_sync_info *out);

/* kvt_session_sync as steps, for a scheduler that decodes the prompt's chunks itself (e.g. in
** kvt_gen_batch.chunk): while kvt_prefill_next returns 1, decode the chunk and pass the result to
** kvt_prefill_done; then kvt_prefill_end (docs/MANUAL.md, "Step-wise prefill").  Between chunks
** the engine may serve other sessions.  tok[0..n_tok) (NULL / 0: none): the request's tokens when
** the caller has them (a server that chose the session by them), as kvt_chat_tokenize(eng, msgs,
** n_msgs, true, the session's template_fallback) gave them: each part of the prompt the session
** would tokenize is taken from them where that provably gives the same tokens (the parts' text is
** compared with theirs), else tokenized: tokens of another text are never used.  A message's end
** and the assistant prefix go out as one chunk where a block holds both (one weight pass; sync
** decodes two: other float rounding).  msgs and tok must stay valid until kvt_prefill_end.  OUT
** *pf: free with kvt_prefill_end.  Errors: those of kvt_session_sync before decoding, KVT_ENOMEM.
** Not thread-safe (engine rule). */
typedef struct kvt_prefill kvt_prefill;
int kvt_session_prefill(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n_msgs, const kvt_token *tok, int32_t n_tok,
                        kvt_prefill **pf /* OUT */);

/* The next chunk: returns 1 with *chunk (tokens owned by pf); decode exactly it (leaving wanted
** logits in kvt_engine_logits()) and call kvt_prefill_done before any other call on the session.
** room > 0: at most room tokens; 0: up to the block boundary.  Returns 0 when done (call
** kvt_prefill_end), or the prefill's error. */
int kvt_prefill_next(kvt_prefill *pf, int32_t room, struct kvt_decode_chunk *chunk /* OUT */);

/* The chunk was decoded with result rc (0, the decode's error, or KVT_ECANCELED: not decoded,
** stop).  Returns 0, or the error that stops the prefill (the message being added is undone). */
int kvt_prefill_done(kvt_prefill *pf, int rc);

/* End the prefill and free pf (NULL: nothing); before kvt_prefill_next returned 0 it cancels
** (KVT_ECANCELED, the message undone).  OUT *info (may be NULL): as kvt_session_sync's.
** Returns 0 or the prefill's error. */
int kvt_prefill_end(kvt_prefill *pf, struct kvt_sync_info *info /* OUT */);

/* A row of kvt_session_gen_step_batch that belongs to no session (plain completion in a sequence
** the caller prefilled and manages itself, clearing it with kvt_seq_rm when done). */
struct kvt_gen_row {
    int32_t seq;             /* IN: caller sequence, used by no session of the batch nor another row */
    kvt_pos pos;             /* IN/OUT: the sampled token's position; +1 when it is decoded */
    float *logits;           /* IN/OUT [n_vocab]: the logits to sample from; overwritten by those
                              ** after the sampled token when it is decoded.  Owned by the caller */
    int32_t n_gen;           /* IN/OUT: tokens generated (0: new), its next draw; +1 when decoded */
    struct kvt_sampling smp; /* IN: this row's sampling (as kvt_engine_sample; the generator is the
                              ** row's sequence's, its draws counted by n_gen) */
    kvt_token tok;           /* OUT: the sampled token */
    bool done;               /* OUT: tok ends the generation (it is not decoded) */
    int status;              /* OUT: 0 or this row's error (KVT_EINVAL: NULL logits; sampling) */
    bool last;               /* IN: the generation's last draw (max_tokens): tok is not decoded */
};

/* One generated token: sampled from the session's logits; unless it ends the generation (*done:
** not decoded) it is decoded (evicting by watermark) and appended to the reply, which
** kvt_session_gen_end finishes.  Errors: KVT_EINVAL (no user turn to reply to), KVT_ENOMEM,
** KVT_ECTX, KVT_ELLAMA, KVT_EBUDGET; on error the token is not part of the reply. */
int kvt_session_gen_step(kvt_session *s, const struct kvt_sampling *smp, kvt_token *tok /* OUT */, bool *done /* OUT */);

/* One step of continuous batching (kvt_session_gen_step_batch): n sessions and n_rows raw rows
** on one engine, and optionally another sequence's prefill chunk in the same llama_decode. */
struct kvt_gen_batch {
    kvt_session *const *sessions; /* [n] distinct sequences of one engine; n may be 0 */
    int32_t n;
    const struct kvt_sampling *smp; /* [n] each session's sampling */
    kvt_token *tok;                 /* OUT [n] the sampled tokens */
    bool *done;                     /* OUT [n] tok[i] ends session i's generation (not decoded) */
    int *status;                    /* OUT [n] 0 or session i's error (its token is then not part
                                     ** of its reply: e.g. KVT_EBUDGET, its reserve cannot be made) */
    struct kvt_gen_row *rows;       /* IN/OUT [n_rows] raw rows (see struct kvt_gen_row) */
    int32_t n_rows;
    const struct kvt_decode_chunk *chunk; /* NULL or another sequence's prefill chunk (none of the
                                     ** sessions' or rows'): a chunk of kvt_prefill_next */
    const bool *last;               /* NULL or [n]: session i's last draw (max_tokens): tok[i] ends
                                     ** the reply undecoded, as in llama-server (one pass less; no
                                     ** logits after it); the next turn decodes its text; gen_end next */
};

/* Continuous batching: kvt_session_gen_step for every session of b and a token for every row,
** with ONE llama_decode (kvt_engine_decode_batch; at most n_ubatch rows) for them and b->chunk.
** Batched tokens feed no attention signals.  Returns 0, KVT_EINVAL (negative counts, NULL
** arrays), or the shared decode's error (KVT_EINVAL: a sequence out of range or used twice,
** KVT_ECTX, KVT_ELLAMA, KVT_ENOMEM): then nothing took a token and the chunk is not in the cache.
** Not thread-safe (engine rule). */
int kvt_session_gen_step_batch(kvt_engine *eng, const struct kvt_gen_batch *b);

/* The logits (n_vocab floats) the session's next token is sampled from (OpenAI "logprobs").
** Owned by the session, valid until its next decode; NULL if none (nothing decoded, parked). Cannot fail. */
const float *kvt_session_logits(const kvt_session *s);

/* Park a session: every resident block is saved and its cells leave the cache, freeing its
** sequence.  A parked session accepts only resume, stats/info calls and kvt_session_free.
** Errors: KVT_EINVAL (a reply is being generated), those of kvt_block_save / kvt_pool_put (the
** session is then not parked).  Parking a parked session does nothing. */
int kvt_session_park(kvt_session *s);

/* Resume a parked session on an empty sequence seq: its resident blocks are loaded back at
** their positions (recoveries); a block whose copy is gone is recomputed (recomputes).
** Errors: KVT_EINVAL (not parked, seq out of range or not empty), those of kvt_block_load and
** kvt_engine_decode (the blocks not loaded by then stay evicted). */
int kvt_session_resume(kvt_session *s, int32_t seq);

/* Finish the reply built by kvt_session_gen_step (possibly empty): it becomes an assistant message
** of the conversation.  OUT *reply (may be NULL): its text, caller frees with free().
** Errors: KVT_ENOMEM (the reply stays pending; call again). */
int kvt_session_gen_end(kvt_session *s, char **reply /* OUT */);

/* Messages of the conversation and message i (content owned by the session, valid until the
** conversation changes).  Errors: KVT_EINVAL (i out of range). */
int32_t kvt_session_n_messages(const kvt_session *s);
int kvt_session_message(const kvt_session *s, int32_t i, struct kvt_chat_msg *msg /* OUT */);

/* The conversation's token stream (evicted blocks and a pending assistant prefix included): what
** a later kvt_session_sync can keep.  Copies min(n_max, total) tokens to out (NULL if n_max <= 0),
** returns total.  Works on a parked session.  Cannot fail.  Not thread-safe (engine rule). */
int32_t kvt_session_tokens(const kvt_session *s, kvt_token *out /* OUT [n_max] */, int32_t n_max);

struct kvt_session_stats {
    int32_t resident_tokens; /* cells of this session in the llama.cpp cache */
    int32_t peak_resident_tokens;
    int32_t total_tokens; /* tokens of the conversation so far */
    int32_t n_blocks, n_blocks_resident, n_blocks_host, n_blocks_disk, n_blocks_lost;
    int64_t evictions;          /* block evictions */
    int64_t recoveries;         /* block loads back into the cache */
    int64_t tokens_decoded;     /* tokens run through the model (prefill + decode) */
    int64_t tokens_recovered;   /* tokens brought back by kv_restore instead */
    int64_t recomputes;         /* blocks recomputed because their saved copy was lost (also in
                                 ** recoveries; not "breadcrumb" recovery's) */
    kvt_pos next_pos;           /* position the next token will take; kept below n_ctx_train by
                                 ** moving resident blocks down over eviction gaps */
    int64_t compactions;        /* times that happened (kvt_seq_shift of every resident block) */
    double policy_ms;           /* time in eviction policy work, block primitives excluded (ms) */
    double decode_ms;           /* time in kvt_engine_decode for this session (ms) */
    struct kvt_pool_stats pool; /* the host pool's (shared) counters, or the store's priv ones */
    /* block store (kvt_session_params.store) */
    int32_t route;               /* enum kvt_route of the last prompt prefill */
    int32_t route_tokens;        /* its tokens loaded from the store (not decoded) */
    int32_t route_lookup_tokens; /* its tokens in full blocks looked up */
    int64_t store_tokens;        /* all tokens loaded from the store (not in tokens_decoded) */
    int64_t store_blocks_put;    /* blocks given to the store (a key already there is not) */
    double store_ms;             /* time in lookups, reads and loads of store blocks (ms) */
    int64_t store_load_errors;   /* prefixes found that the engine refused to load (prefilled instead) */
    /* host pool saves (kvt_session_params.codec_ram) */
    int64_t pool_saved_tokens; /* tokens of every block save to the pool (re-saves included) */
    int64_t pool_raw_bytes;    /* their raw blob bytes */
    int64_t pool_stored_bytes; /* the bytes the pool was given for them (encoded) */
    double codec_encode_ms;    /* time encoding them (ms; 0 with raw) */
    double codec_decode_ms;    /* time decoding recovered blocks (ms; 0 with raw) */
    /* live ElasticKV (kvt_session_params.elastic_sk; all 0 when off) */
    int64_t elastic_passes;        /* thresholding passes run */
    int64_t elastic_zeroed;        /* elements set to 0 by all passes (each counted once) */
    int64_t elastic_elems;         /* K/V elements of the resident cells at the last pass (all) */
    int64_t elastic_zero;          /* of them 0 after it (resident sparsity = zero / elems) */
    int64_t elastic_eligible;      /* of them in the thresholded range at the last pass */
    int64_t elastic_zero_eligible; /* of those 0 after it */
    double elastic_ms;             /* time in passes (ms; read, threshold, write back) */
    /* non-prefix chunk reuse (kvt_session_params.chunk_reuse; all 0 when off) */
    int64_t chunk_tokens;           /* prompt tokens loaded from chunk blocks (also in store_tokens) */
    int64_t chunk_recompute_tokens; /* tokens of found chunks decoded at their start (chunk_recompute) */
    int64_t chunk_runs;             /* runs of consecutive chunk hits the scan found */
    int64_t chunk_blocks_put;       /* blocks given to the store under a chunk key */
    int64_t chunk_load_errors;      /* chunk runs found but decoded instead (the load failed) */
    double chunk_scan_ms;           /* time hashing windows and asking the store (ms) */
};
/* Fill *st (HOST/DISK block counts as the pool holds them now).  Works on a parked session.
** Cannot fail.  Not thread-safe (engine rule). */
void kvt_session_get_stats(kvt_session *s, struct kvt_session_stats *st /* OUT */);

/* One row of the block table. */
struct kvt_block_info {
    int32_t id;        /* stable block id (creation order) */
    int32_t n_tokens;  /* tokens in the block (= block size unless sealed early) */
    kvt_pos orig_p0;   /* position of the first token when it was decoded */
    kvt_pos p0;        /* current position of the first token (if resident) */
    int32_t role;      /* enum kvt_role of the majority of its tokens */
    int32_t turn;      /* message index its first token belongs to */
    int32_t residency; /* enum kvt_residency */
    bool sealed;       /* complete and saved; the open tail block is not */
    int32_t n_evictions, n_recoveries;
    int32_t last_use_turn;  /* last turn it was decoded or recovered */
    uint64_t pool_key;      /* key of its saved K/V in the pool or the store's private entries */
    int32_t keep;           /* enum kvt_keep of the message it starts in */
    double attn_mass;       /* accumulated attention mass (H2O) */
    double attn_ewma;       /* EWMA of the per-ubatch attention share (kvtier policy) */
    double attn_window;     /* attention from the last observation window (SnapKV) */
    double relevance;       /* BM25 score against the latest user message */
    int32_t recovered_turn; /* turn of its last recovery, -1 never */
    bool from_chunk;        /* its K/V were loaded as a reused chunk (chunk_reuse) */
    const char *text;       /* detokenized text (owned by the session; valid until next call) */
};

/* Number of blocks in the table (cannot fail), and row i (0 <= i < n) in creation order;
** info->text is owned by the session.  Errors: KVT_EINVAL (i out of range). */
int32_t kvt_session_n_blocks(const kvt_session *s);
int kvt_session_block(kvt_session *s, int32_t i, struct kvt_block_info *info /* OUT */);

/* ==== 6. Signals: attention mass per block, entropy ================================== */

/* Shannon entropy in bits of the distribution w[0..n) (normalised here; zeros skipped).
** Uniform over n -> log2(n); one-hot -> 0.  Returns 0 for n <= 0 or an all-zero w.  Pure. */
double kvt_entropy_bits(const float *w, int32_t n);

/* Attention-head classes by entropy (bits): sink < 0.5 <= focused < 1.5 <= moderate < 3 <= mixed
** (NaN: mixed).  kvt_head_class_name: static string, "unknown" out of range.  Pure. */
enum kvt_head_class { KVT_HEAD_SINK = 0, KVT_HEAD_FOCUSED = 1, KVT_HEAD_MODERATE = 2, KVT_HEAD_MIXED = 3 };
int32_t kvt_head_classify(double bits);
const char *kvt_head_class_name(int32_t cls);

/* Entropy-adaptive budget of one head: base * clamp(h / mean_h, 0.3, 2.5), rounded down
** (tokens).  mean_h <= 0 returns base.  Pure. */
int32_t kvt_entropy_budget(int32_t base, double h, double mean_h);

/* ==== 7. Optional dense retrieval: llama.cpp embeddings, approximate nearest neighbours ==== */

/* An embedding model: any GGUF, run with MEAN pooling in its own context.  Not thread-safe. */
typedef struct kvt_embedder kvt_embedder;

/* n_ctx: longest text in tokens (default 512 if <= 0); n_threads 0 = all cores.  OUT *out: free
** with kvt_embedder_free.  Errors: KVT_EINVAL, KVT_EMODEL (message names the path), KVT_ELLAMA. */
int kvt_embedder_open(const char *model_path, int32_t n_ctx, int32_t n_threads, kvt_embedder **out);
void kvt_embedder_free(kvt_embedder *em); /* accepts NULL */

/* Cosine nearest-neighbour index: HNSW (Malkov & Yashunin 2018) through hnswlib, M = 16,
** ef_construction = 200, ef_search = 50; caller-chosen uint64 ids.  Not thread-safe. */
typedef struct kvt_ann kvt_ann;

/* ==== 8. Block store: content-addressed KV blocks in tiers (RAM -> disk -> Redis) ==== */

/* A block's identity is the chain of its prefix (vLLM's prefix caching, LMCache's chunk keys):
**   h_0 = SHA-256("kvtier-chain" | format version | model fingerprint | layout | block | tenant)
**   h_i = SHA-256(h_{i-1} | tokens of block i as little-endian int32)
** naming the K/V a cold prefill of those tokens produces on those weights and layout; the same on
** every machine (exact bytes: docs/STORE.md).  Pure. */
struct kvt_chain_params {
    kvt_key model;      /* kvt_engine_fingerprint */
    const char *layout; /* kvt_engine_layout; required */
    int32_t block;      /* tokens per block (> 0) */
    const char *tenant; /* salt: tenants never share keys; NULL and "" = one shared namespace */
};
/* 64 lowercase hex digits + NUL into out[65].  Cannot fail. */
void kvt_key_hex(const kvt_key *k, char out[2 * KVT_KEY_BYTES + 1]);

typedef struct kvt_store kvt_store;

enum kvt_tier { KVT_TIER_NONE = 0, KVT_TIER_RAM = 1, KVT_TIER_DISK = 2, KVT_TIER_REDIS = 3 };

/* TTL (EdgeSync-LLM's rule): an entry expires ttl_s after its last hit or write, ttl_hot_s once
** it has hot_hits hits; expired entries are misses until gc or the quota (expired, then cold,
** then hot, LRU) removes them (docs/STORE.md, "Writes, reads, TTL"). */
struct kvt_store_params {
    const char *dir;   /* the disk tier (SQLite index + blob files); NULL = $XDG_CACHE_HOME/kvtier/store
                              ** (when absolute), else $HOME/.cache/kvtier/store (kvt_store_stats.dir);
                              ** created (mode 0700) if missing, unless read_only */
    size_t ram_bytes;  /* RAM tier budget (payload bytes, LRU, private entries first); default
                              ** 256 MiB; 0 = no RAM tier */
    size_t disk_bytes; /* disk tier quota (payload bytes of the blob files); default 8 GiB;
                              ** 0 = no disk tier (RAM only: nothing persists, dir unused) */
    double ttl_s;      /* seconds, > 0; default 1800 (30 min, EdgeSync-LLM) */
    double ttl_hot_s;  /* seconds, >= ttl_s; default 604800 (7 days) */
    int32_t hot_hits;  /* >= 1; default 5 */
    int32_t queue_max; /* blocks waiting for the disk writer, >= 1; default 256; a put that finds
                              ** it full drops the disk write (disk.writes_dropped) */
    bool read_only;    /* inspect only: nothing created or removed; gc, clear and verify with
                              ** repair return KVT_EINVAL */
    /* Redis tier, shared by servers (docs/STORE.md "Redis tier"): errors are misses or drops. */
    const char *redis_url;         /* NULL or "" = no Redis tier.  "redis://[[user:]password@]host[:port][/db]"
                              ** (port 6379, db 0 by default; host may be [IPv6]) or "unix://path[?db=N]";
                              ** the string is copied at open */
    int32_t redis_timeout_ms;      /* socket timeout of connect, send and receive, ms, >= 1; default 20;
                              ** a get past it is a miss and the tier backs off */
    int32_t redis_ttl_s;           /* EX of every key written, seconds, >= 1; default 86400 (1 day) */
    size_t redis_max_bytes;        /* largest value written or accepted (128-byte header + payload);
                              ** default 64 MiB; a larger block is not written (writes_dropped) */
    int32_t redis_queue_max;       /* Redis writes waiting for the Redis writer thread, >= 1; default
                              ** 256; a put that finds it full drops the Redis write */
    const char *redis_secret_file; /* NULL = values checksummed, not authenticated.  Else a 16..4096-byte
                              ** file (read at open; else KVT_EINVAL) shared by the servers: values
                              ** carry HMAC-SHA-256(secret, value); a mismatch is a miss, deleted */
    const char *disk_codec;        /* codec of blocks at rest, disk and Redis (section 9 spec); NULL = "raw"
                              ** (exact K/V, the default; then a coded Redis value is a miss); callers
                              ** always see raw bytes.  docs/MANUAL.md, "Store disk codec" */
    int32_t disk_codec_heads;      /* KV heads per layer (elastic thresholds per head); 0 = one per row */
    const uint8_t *disk_codec_bits; /* NULL, or a q8/q4 disk_codec's bits per (layer, KV head): 4 or 8,
                              ** layers x disk_codec_heads (kvt_codec_params.head_bits); copied at open.
                              ** A block of another shape (another model) is written raw */
    int32_t n_disk_codec_bits;      /* entries of disk_codec_bits */
    /* Private entries (sessions' own block copies, RAM within ram_bytes, then spill files). */
    const char *private_dir;   /* spill directory; NULL = one under $TMPDIR; copied at open */
    size_t private_disk_bytes; /* spill quota (payload bytes; LRU dropped); 0 = unlimited (the default) */
    /* Prefetch (kvt_store_prefetch; docs/STORE.md "Prefetch"). */
    int32_t prefetch_threads; /* threads reading prefetched blocks into RAM, 0..16; default 2; 0 = none */
    int32_t prefetch_queue;   /* keys waiting for them, >= 1; default 256; overflow is dropped */
    size_t prefetch_bytes;    /* RAM bytes of promoted blocks not yet read, at most; 0 (default) =
                              ** ram_bytes / 4; past it new keys are dropped */
};

/* Defaults listed above.  Cannot fail. */
struct kvt_store_params kvt_store_default_params(void);

/* Open (or create) a store (p NULL = defaults) and start its threads; several processes may share
** a directory, and one left by a killed process opens fine (docs/STORE.md, "Crash safety").  A
** Redis that is down is not an error.  OUT *out: free with kvt_store_free; NULL on error.
** Errors: KVT_EINVAL (bad params, a malformed redis_url: the message names the value, a password
** as "***"), KVT_EIO (dir not a writable directory, read_only and no store there, or the index
** cannot be opened or is of a newer format: the message names the path and SQLite's error), KVT_ENOMEM. */
int kvt_store_open(const struct kvt_store_params *p, kvt_store **out /* OUT */);

/* Write out the queues, stop the threads, close.  Accepts NULL.  Must not run concurrently with
** other calls on the same store. */
void kvt_store_free(kvt_store *st);

/* What the header of a stored block records besides its bytes (checked on every read). */
struct kvt_store_meta {
    kvt_key model;    /* the fingerprint of the model that computed it */
    int32_t n_tokens; /* tokens the block covers (>= 0) */
    int32_t codec;    /* 0 = raw blob bytes (block codecs add others) */
};

struct kvt_store_tier_stats {
    int64_t entries, bytes;         /* held now (payload bytes) */
    int64_t hits, misses;           /* gets answered / not answered by this tier */
    int64_t writes, writes_dropped; /* puts written / dropped (full queue, quota, I/O error; RAM:
                                     ** larger than the tier) */
    int64_t evictions, expired;     /* removed for room (LRU) / by TTL */
    int64_t corrupt;                /* reads failing a checksum, key or fingerprint check, or file missing */
    int64_t errors;                 /* Redis: failed commands and connections (not timeouts) */
    int64_t timeouts;               /* Redis: operations that passed redis_timeout_ms */
};
struct kvt_store_stats {
    const char *dir; /* the disk tier's directory (the store's copy, valid while it is open) */
    struct kvt_store_tier_stats ram, disk;
    int64_t queue_len;                 /* disk writes waiting now */
    struct kvt_store_tier_stats redis; /* zeros without Redis; entries/bytes unfilled (kvt_store_redis_info) */
    int64_t redis_queue_len;           /* Redis writes waiting now */
    bool redis_on;                     /* a Redis tier is configured */
    struct kvt_store_prefetch_stats {
        bool on;              /* prefetch threads run */
        int64_t issued;       /* keys queued by kvt_store_prefetch */
        int64_t promoted;     /* of those, read from disk or Redis into RAM */
        int64_t dropped;      /* keys not queued: queue full, or prefetch_bytes unread */
        int64_t skipped;      /* taken but not read (in RAM meanwhile, prefetch_bytes, Redis down) */
        int64_t absent;       /* taken, and no tier held them */
        int64_t failed;       /* taken and refused (corrupt, also in disk/redis corrupt; no memory) */
        int64_t claimed;      /* still queued when a get asked: the get read them itself */
        int64_t waited;       /* gets that waited for a prefetch of their key in flight */
        int64_t cancelled;    /* taken back before they were read (no longer wanted) */
        int64_t hits;         /* gets served from a promoted block (counted once each) */
        int64_t wasted;       /* promoted blocks evicted or expired before any get */
        int64_t unread_bytes; /* RAM bytes of promoted blocks not read yet */
        int64_t queue_len;    /* keys queued now */
    } prefetch;
    struct kvt_pool_stats priv; /* private entries (sessions' own copies; RAM within ram_bytes) */
};
/* Counters of this process since open; entries/bytes of the disk tier are the index's (all
** processes').  Cannot fail (zeros for NULL).  Never talks to Redis.  Thread-safe. */
void kvt_store_get_stats(kvt_store *st, struct kvt_store_stats *out /* OUT */);

/* Prefetch (LMCache; EdgeSync-LLM's predictor): queue chain keys[0..n), in the order they will be
** asked for, for the prefetch threads to read from disk or Redis into RAM; never blocks.  Blocks
** must carry fingerprint model.  docs/MANUAL.md, "Store prefetch".  Returns the number of keys
** queued (>= 0).  Errors: KVT_EINVAL (NULL store or model, NULL keys with n > 0, n < 0). Thread-safe. */
int kvt_store_prefetch(kvt_store *st, const kvt_key *keys, int n, const kvt_key *model);
/* kvt_store_prefetch of the chain keys (cp) of the full blocks of a prompt tok[0..n) before its
** last token.  Returns keys queued.  Errors: KVT_EINVAL (NULL st or cp, NULL tok with n > 0,
** n < 0, cp invalid), KVT_ENOMEM.  Thread-safe. */
int kvt_store_prefetch_chain(kvt_store *st, const struct kvt_chain_params *cp, const kvt_token *tok, int32_t n);

/* The Redis tier as the server sees it (SCAN of the keyspace: not for every request; at most 10 s
** per command).  Errors: KVT_EINVAL (NULL arguments, no Redis tier), KVT_EIO (Redis unreachable
** or erring: the message names the host, never the password).  Thread-safe. */
struct kvt_store_redis_info {
    int64_t keys, bytes;            /* keys under our prefix, their value bytes */
    int64_t used_memory, maxmemory; /* the server's, bytes */
    char server[128];               /* "host:port/db" or "unix:path" (no credentials) */
};
int kvt_store_redis_info(kvt_store *st, struct kvt_store_redis_info *out /* OUT */);

/* A small named value in the Redis tier beside the blocks (kvtier serve's stored responses, so
** that every server on one Redis continues a conversation).  The key is "kvt:rec:" + name (1..200
** printable bytes, no spaces; the caller scopes it, e.g. by tenant).  PUT: data[0..n) with a
** lifetime of ttl_s (> 0) seconds, one SET ... EX (a reader finds the whole value or none), MACed
** under redis_secret_file like blocks.  GET: *out (malloc'd; free() it) and *n_out.  DEL: gone.
** Synchronous, one command within redis_timeout_ms; a connection failure starts the readers'
** backoff as a block get does.  Errors: KVT_EINVAL (no Redis tier, bad name, op or ttl, NULL
** out/n_out for GET, a value over redis_max_bytes), KVT_ENOENT (GET, DEL: absent or expired),
** KVT_EFORMAT (GET: over redis_max_bytes, or its MAC does not match: counted corrupt), KVT_EIO
** (Redis unreachable, backed off, timed out or erring: the message names the host, never the
** password), KVT_ENOMEM.  Thread-safe. */
enum kvt_record_op { KVT_RECORD_PUT, KVT_RECORD_GET, KVT_RECORD_DEL };
int kvt_store_record(kvt_store *st, enum kvt_record_op op, const char *name, const void *data, size_t n, int64_t ttl_s,
                     void **out /* OUT */, size_t *n_out /* OUT */);

/* One entry of the disk tier as `kvtier store ls` shows it. */
struct kvt_store_entry {
    kvt_key key, model;
    int32_t n_tokens, codec;
    int64_t bytes;            /* payload bytes */
    double created, last_hit; /* seconds since the epoch */
    int64_t hits;
    double expires; /* seconds since the epoch (this process's TTL rule) */
};
/* Call cb for every disk entry, most recently hit first (a snapshot of the index; cb may call
** the store); a non-zero return from cb stops and is returned.
** Errors: KVT_EINVAL (no disk tier, NULL cb), KVT_EIO, KVT_ENOMEM.  Thread-safe. */
int kvt_store_ls(kvt_store *st, int (*cb)(void *ud, const struct kvt_store_entry *e), void *ud);

struct kvt_store_report {
    int64_t checked, ok; /* index rows looked at / found good */
    int64_t expired;     /* removed by TTL (gc) */
    int64_t over_quota;  /* removed (cold before hot, LRU) to get within disk_bytes (gc) */
    int64_t corrupt;     /* files failing their checksum / header (verify) */
    int64_t missing;     /* index rows without a file */
    int64_t orphans;     /* files without an index row, temporary files included */
    int64_t removed;     /* entries and files removed */
    int64_t bytes_freed; /* payload bytes of removed entries, file bytes of orphans */
};
/* Garbage-collect the disk tier: expired entries, index rows without a file, cold-then-LRU
** down to the quota, files without a row.  Waits for a write in flight in any process.
** Errors: KVT_EINVAL (read-only, no disk tier, NULL out), KVT_EIO, KVT_ENOMEM.  Thread-safe. */
int kvt_store_gc(kvt_store *st, struct kvt_store_report *out /* OUT */);
/* Re-read every file the index names and check its header and payload checksum against the row
** (docs/STORE.md); list missing files and orphans.  With repair, remove what fails.  Expiry is
** not looked at (gc's job).  Reads every byte of the tier.
** Errors: KVT_EINVAL (repair on a read-only store, no disk tier, NULL out), KVT_EIO, KVT_ENOMEM.  Thread-safe. */
int kvt_store_verify(kvt_store *st, bool repair, struct kvt_store_report *out /* OUT */);
/* Remove every entry of both local tiers (queued writes included); the shared Redis tier is left
** alone (its keys expire by redis_ttl_s).  Errors: KVT_EINVAL (NULL, read-only), KVT_EIO. Thread-safe. */
int kvt_store_clear(kvt_store *st);

/* ==== 9. Block codecs: self-describing encodings of a block leaving the device ======= */

/* A codec turns a kvt_blob into self-describing bytes (header with the payload's checksum) and
** back into a blob kvt_block_load accepts.  Lossy codecs keep cells below n_sink raw and need F16
** or F32 K/V (else KVT_EUNSUPPORTED: keep such blocks raw).  Layout and error bounds:
** docs/MANUAL.md, "Block codecs".  All functions of this section are pure.
**   raw         the blob's bytes, bit-exact (any cache type).
**   q8, q4      KIVI (Liu et al. 2024): keys per channel, values per token, min/max groups;
**               |x - x^| <= (max - min) / (2^bits - 1) / 2; ~0.56x / ~0.31x of raw F16.
**   ecq         KIVI's groups, each with an offset (its mean) and a step (s_k / s_v x its standard
**               deviation), |x - x^| <= step / 2, the codes entropy-coded with zstd (outliers and
**               non-finite elements stored exactly); ~0.29x of raw F16 at the default step, for
**               tiers at rest (decoding costs more than q4's).
**   elastic     ElasticKV-style sparsification per layer, K/V and KV head: |x| below
**               max(sigma_h / 2, mu_h) x s set to 0; a bitmap plus the kept values.
**   elastic+q8  elastic's bitmap, the kept values as q8 (min/max groups over the kept ones).
**   elastic+q4  the same with the kept values as q4 (the fewest bytes; its KL is elastic's plus
**               q4's).  The elastic codecs never beat q4 at equal KL on the reference models:
**               use q4 for tiers (the measured curve: MANUAL, "Block codecs"). */
#define KVT_CODEC_VERSION              3 /* written: the payload's checksum is XXH3-128 */
#define KVT_CODEC_VERSION_HEADS        4 /* a version-3 header followed by the per-head bits table */
#define KVT_CODEC_VERSION_SHA256       1 /* still read: versions 3 and 4 with SHA-256 instead */
#define KVT_CODEC_VERSION_HEADS_SHA256 2

enum kvt_codec_id {
    KVT_CODEC_RAW = 0,
    KVT_CODEC_Q8 = 1,
    KVT_CODEC_Q4 = 2,
    KVT_CODEC_ELASTIC = 3,
    KVT_CODEC_ELASTIC_Q8 = 4,
    KVT_CODEC_ELASTIC_Q4 = 5,
    KVT_CODEC_ECQ = 6,
    KVT_CODEC__COUNT
};

struct kvt_codec_params {
    int32_t codec;            /* enum kvt_codec_id */
    int32_t n_head_kv;        /* KV heads per layer (elastic thresholds are per head); 0 = one per row */
    int32_t group_k;          /* q8/q4/elastic+q8/elastic+q4: cells per K group (default 64) */
    int32_t group_v;          /* q8/q4/elastic+q8/elastic+q4: channels per V group (default 64) */
    float s_k, s_v;           /* elastic: threshold scales for K and V (defaults 0.45, 0.50); ecq: steps as
                        ** a fraction of each group's standard deviation (default 0.25; smaller: less
                        ** error, more bytes) */
    int32_t n_sink;           /* cells with position < n_sink stay raw; default 64 (elastic), 0 (q8/q4) */
    const uint8_t *head_bits; /* q8/q4: NULL (default) = the codec's bits; else 4 or 8 per (layer, KV
                        ** head), layer-major in blob order; stored in the header; borrowed */
    int32_t n_head_bits;      /* entries of head_bits: the blob's layers x n_head_kv */
};

/* The defaults above for one codec (an unknown id gives raw's).  Cannot fail. */
struct kvt_codec_params kvt_codec_default_params(int32_t codec);

/* Parse a codec spec: "raw", "q8[:GK[,GV[,SINK]]]", "q4[:...]", "ecq[:SK[,SV[,SINK]]]",
** "elastic[:SK[,SV[,SINK]]]", "elastic+q8[:...]", "elastic+q4[:...]" (e.g. "elastic:0.45,0.50");
** omitted values are the defaults, n_head_kv 0.
** OUT *out.  Errors: KVT_EINVAL naming the bad part (unknown name, a non-number, a scale outside
** (0, 10], a group outside 1..65536, a sink count outside 0..2^30, too many values).  Pure. */
int kvt_codec_parse(const char *spec, struct kvt_codec_params *out /* OUT */);

/* What encoding measured (optional OUT of kvt_codec_encode). */
struct kvt_codec_stats {
    size_t raw_bytes;     /* blob->size */
    size_t encoded_bytes; /* *n */
    int64_t n_elems;      /* K/V elements the codec saw (0 for raw, which copies bytes) */
    int64_t n_lossy;      /* of them, encoded by the lossy codec (not sinks, not raw) */
    int64_t n_zeroed;     /* of them, pruned to 0 (elastic codecs) */
};

/* Encode a blob (read only).  OUT *out (caller frees with free()), *n bytes; stats (may be NULL).
** Errors: KVT_EINVAL (NULL argument, bad params: the message names the value; a per-head table
** whose size is not the blob's layers x n_head_kv, an entry not 4 or 8, head_dim not a multiple
** of group_v, a per-head table on a codec other than q8/q4), KVT_EFORMAT (the blob does not
** parse), KVT_EUNSUPPORTED (a lossy codec on a quantised K or V type, or row elements not a
** multiple of n_head_kv: the message names the layer and type; encode raw instead), KVT_ENOMEM.
** On error *out is NULL.  Pure; thread-safe. */
int kvt_codec_encode(const kvt_blob *blob, const struct kvt_codec_params *p, uint8_t **out /* OUT */, size_t *n /* OUT */,
                     struct kvt_codec_stats *stats /* OUT, may be NULL */);

/* The header of encoded bytes, read without decoding the payload. */
struct kvt_codec_info {
    int32_t version;
    struct kvt_codec_params params;
    size_t raw_bytes;     /* size of the blob it decodes to */
    size_t encoded_bytes; /* header + payload */
    kvt_pos p0;
    int32_t n_tokens, n_cells, n_cells_swa;
};

/* Decode bytes of kvt_codec_encode into a new blob, checking the checksum first (XXH3-128; the
** SHA-256 of versions 1 and 2).  OUT *out
** (caller frees with kvt_blob_free).
** Errors: KVT_EFORMAT (foreign magic, other format version, unknown codec id, truncated
** header), KVT_ECORRUPT (payload shorter or longer than its header says, checksum mismatch, or
** a section inconsistent with the header: the message names it), KVT_ENOMEM.  Never reads
** outside data[0..n).  On error *out is NULL.  Pure; thread-safe. */
int kvt_codec_decode(const void *data, size_t n, kvt_blob **out /* OUT */);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_H */
