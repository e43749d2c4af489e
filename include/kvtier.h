/*
** kvtier.h — a KV-cache memory hierarchy for llama.cpp.
**
** This header is the whole public API and its manual: anything not declared here is
** internal (the functions the library's own files share, and its tests call, are declared in
** src/kvtier_int.h, never installed; libkvtier.so exports exactly the functions declared here).
** Read it top to bottom:
**
**   section                   what                                       implemented in
**   1. Errors                 int returns, 0 = success, negative KVT_E*    src/error.c
**                             code.
**   2. Engine                 one llama.cpp model + context (the only      src/engine/
**                             code that talks to llama.cpp); tokenize,
**                             chat template, prefill/decode, sampling.
**   3. Block primitives       save a position range of a sequence to       src/engine/kvio.c,
**                             host memory, load it back at another         src/kv/ (blob layout,
**                             position with RoPE re-anchoring (no forward  host RoPE),
**                             pass), capture per-head attention mapped to  src/engine/attn.c
**                             positions.
**   4. Host pool              byte-budgeted host RAM tier that spills to   src/store/
**                             checksummed files: a session's block copies
**                             without a store; with one, the store's
**                             private entries (section 8).
**   5. Session                one conversation in one sequence under a     src/session/ (table,
**                             token budget, with a block table, watermark  eviction, positions,
**                             eviction and recompute-free recovery; BM25   sync, generation),
**                             retrieval of evicted blocks.                 src/retrieval/
**   6. Signals                attention mass per block (H2O, SnapKV),      src/policy/
**                             attention entropy and head classes.
**   7. Dense retrieval        optional: embeddings through llama.cpp,      src/engine/embed.c,
**                             approximate nearest neighbours (HNSW).       src/retrieval/ann.cpp
**   8. Block store            content-addressed blocks (chained SHA-256    src/store/
**                             keys) in tiers: RAM -> disk (SQLite index,
**                             checksummed files) -> Redis, across restarts
**                             and servers; holds a session's block copies
**                             (pure ones by content, the rest private).
**   9. Block codecs           self-describing block encodings: raw, KIVI   src/kv/codec.c
**                             q8/q4, ElasticKV sparsification.
**
** The server (server/), the command-line tool (cli/) and the evaluation (eval/) are built on
** this header alone.  It is one file on purpose (a user reads it top to bottom), so it is the
** one file of the tree past ~800 lines.
**
** Units: token counts are tokens, positions are llama_pos-style int32 (half-open [p0, p1)),
** sizes are bytes, times are milliseconds.
**
** Thread-safety: an engine and the sessions on it are single-threaded objects: the caller
** serialises every call that names the same engine.  Sessions on one engine may be interleaved
** call by call (each keeps its own logits).  With one KV stream per sequence (the default) a
** session's numbers are bit-identical to a lone run; with kv_unified they depend slightly on the
** other sessions' cells.
** The host pool and the block store are thread-safe.  An embedder and an ANN index are single-threaded objects like
** an engine.  Functions marked "pure" (BM25, section 6) touch no shared state and may be called
** from any thread, as may kvt_strerror() and kvt_errmsg().
*/
#ifndef KVTIER_H
#define KVTIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ====================================================================================== */
/* 1. Errors                                                                              */
/* ====================================================================================== */

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
** was built against, what ggml's CPU code was compiled for ("CPU build -march=native (znver3),
** compiled out: none") and the device backend built beside it ("backend cpu", "vulkan" or
** "cuda": scripts/bootstrap.sh, KVTIER_BACKEND).  Static strings; cannot fail. */
const char *kvt_version(void);
const char *kvt_build_info(void);

/* The compute devices llama.cpp can use in this process now, as one line written to buf[0..n)
** (NUL included, truncated to fit): "CPU (<cpu>); Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))".
** Loads ggml's backends if needed.  A device backend that finds no device (no driver, or a CPU
** driver that ggml-vulkan skips unless GGML_VK_VISIBLE_DEVICES is set) is simply absent.
** Returns the number of GPU or integrated-GPU devices.  Not thread-safe with engine creation. */
int kvt_devices(char *buf, size_t n);

/* ====================================================================================== */
/* 2. Engine: one llama.cpp model and context                                             */
/* ====================================================================================== */

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
    int32_t n_ctx;             /* KV cells for the caller's sequences (tokens); default 4096.  Streams:
                              ** each of the n_seq sequences gets n_ctx / n_seq cells of its own,
                              ** rounded up to a multiple of 256 (llama.cpp's padding).  Unified: one
                              ** cache of n_ctx cells that all sequences share. */
    int32_t n_batch;           /* max tokens per llama_decode call; default 512 */
    int32_t n_ubatch;          /* physical micro-batch (tokens); default 512 */
    int32_t n_seq;             /* live sequences the caller will use (ids 0..n_seq-1), 1..64; default 1.
                              ** The engine adds scratch sequences for the block primitives (unified:
                              ** three; streams: one, and only on the SEQ_ADD re-anchoring path). */
    bool kv_unified;           /* default false.
                              ** false ("streams"): one KV stream per sequence (llama.cpp kv_unified =
                              ** false): attention runs over the sequence's own cells only, so its cost
                              ** does not grow with other sessions and a sequence's numbers are
                              ** bit-equal to a lone run; each sequence holds at most n_ctx / n_seq
                              ** cells; block save/load, kvt_seq_cp and kvt_seq_shift read and rewrite
                              ** the whole sequence's state on the host, so their cost grows with the
                              ** sequence (Gemma 3 270M, F16, beside 1024 resident tokens: a 64-token
                              ** block ~9 ms to save, ~17 ms to load).
                              ** true: llama.cpp's unified KV cache: every decoded token's attention
                              ** runs over the cells of all sequences (masked), its cost grows with the
                              ** other sessions' cells and its logits depend on them (max|dlogit| 1.1
                              ** on Gemma 3 270M F16, tests/unit/test_streams.c); a block is saved and
                              ** loaded through scratch sequences at a cost that depends on the block
                              ** only (0.3 ms save, 1.6 ms load for 64 tokens).  Kept for one cache
                              ** shared unevenly (one long conversation beside short ones, any
                              ** sequence may use all n_ctx cells), for kvt_seq_cp that shares cells
                              ** instead of copying them, and as the reference streams mode is tested
                              ** against. */
    int32_t n_threads;         /* CPU threads; 0 = all cores */
    const char *type_k;        /* KV cache element type: "f16" (default), "f32", "q8_0" */
    const char *type_v;        /* same choices; quantised V needs flash attention */
    int32_t flash_attn;        /* enum kvt_flash_attn: AUTO (default; on when layers are offloaded
                              ** to a device or V is quantised, off on the CPU: llama-server's
                              ** default), OFF or ON.  On: llama.cpp's fused attention (needed for
                              ** a quantised V); kvt_engine_info.flash_attn says what was chosen.
                              ** Attention capture (kvt_attn_capture) works either way: off, it
                              ** reads llama.cpp's softmax; on, it recomputes the captured layers'
                              ** softmax rows on the host from the fused op's own Q, K and mask
                              ** (n_tok x n_kv x n_head x head_dim multiply-adds per layer; not for
                              ** ALiBi or attention-sink models, whose capture stays empty) */
    int32_t n_gpu_layers;      /* layers whose weights and KV cells live on the GPU device
                              ** (llama-server's -ngl): 0 = none (CPU only), N = the output layer
                              ** and the last N - 1 repeating ones, -1 (default) = all.  Where
                              ** llama.cpp was built without a device backend, or none is
                              ** visible, everything runs on the CPU whatever this says
                              ** (kvt_engine_info.device names what is used).  With the KV on a
                              ** device, block save and load are device<->host copies
                              ** (llama_state_seq_get/set_data) and host re-anchoring rotates K on
                              ** the host between them; kvt_engine_info.reanchor says which path. */
    bool no_op_offload;        /* default false: llama.cpp's op offload, which runs a large batch's
                              ** (>= 32 tokens) operations on the device even for layers kept on
                              ** the CPU (llama-server's default; its --no-op-offload).  true: layers
                              ** on the CPU compute on the CPU (a CPU reference on a GPU build) */
    int32_t reanchor;          /* enum kvt_reanchor; default AUTO */
    bool verbose;              /* pass llama.cpp's log through to stderr */
    const char *chat_template; /* the chat template kvt_chat_format applies instead of the GGUF's
                              ** (llama-server's --chat-template): one of llama.cpp's built-in names
                              ** ("chatml", "llama3", "gemma", ... llama_chat_builtin_templates) or a
                              ** Jinja template's text, which llama_chat_apply_template recognises by
                              ** its markers (it is not executed).  Copied; NULL (default) = the
                              ** GGUF's.  kvt_engine_open fails with KVT_EINVAL when llama.cpp does
                              ** not recognise it. */
};

/* Defaults listed above.  Returned by value; cannot fail. */
struct kvt_engine_params kvt_engine_default_params(void);

/* Load the model and create a context.  kv_unified: one KV cache and n_seq + 3 sequence ids (two
** scratch ids for the block primitives, one for forcing pending K-shifts).  Streams: one KV
** stream per sequence id, n_seq ids, plus one scratch id (a whole stream) only when the
** re-anchoring path is SEQ_ADD (it forces pending K-shifts and re-anchors blocks whose old
** position range overlaps the sequence's cells).  Also verifies host-side RoPE re-anchoring
** against llama.cpp's own RoPE (a 4-token decode shifted by llama_memory_seq_add) and chooses
** the re-anchoring path; a streams context that ends up on the SEQ_ADD path unexpectedly (AUTO
** with F16/F32 K whose rotation did not verify) is created a second time with the scratch id.
** OUT *out: the engine, freed with kvt_engine_free.
** Errors: KVT_EINVAL (bad params, e.g. unknown cache type), KVT_EMODEL (missing, truncated or
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
    int32_t n_ctx_seq; /* cells one sequence can hold: n_ctx when unified, its stream's size
                              ** in streams mode (budgets of one sequence must fit this) */
    bool kv_unified;   /* the cache mode in use (kvt_engine_params.kv_unified) */
    int32_t n_ctx_train;
    int32_t n_vocab;
    int32_t n_seq;             /* caller-usable sequence ids */
    int32_t reanchor;          /* path in use: KVT_REANCHOR_HOST or KVT_REANCHOR_SEQ_ADD */
    double reanchor_err;       /* max |K_host_rotated - K_llama| / max|K| seen at open; -1 if n/a */
    size_t kv_bytes_per_token; /* K+V bytes of one token across all layers of the cache types */
    const char *type_k, *type_v;
    bool flash_attn;        /* fused attention in use */
    char device[160];       /* where the offloaded layers and their KV live: "CPU" or the
                              ** ggml device's name and description, e.g. "Vulkan0 (llvmpipe ...)" */
    int32_t n_layer_device; /* repeating layers on that device (0 on the CPU) */
};

/* Fill *info.  Cannot fail. */
void kvt_engine_info(const kvt_engine *eng, struct kvt_engine_info *info /* OUT */);

/* The model's fingerprint: SHA-256 of the GGUF file's bytes (the weights exactly, not the
** path), computed on the first call (~0.1 s per 100 MB) and cached for the engine's life.
** Two files with equal bytes have equal fingerprints on any machine.
** Errors: KVT_EIO (the file cannot be read again; the message names it), KVT_ENOMEM. */
int kvt_engine_fingerprint(kvt_engine *eng, kvt_key *out /* OUT */);

/* What besides the weights decides the bytes of a saved block, as one stable string: blob
** format version, cache types of K and V, layers, KV heads, head size, sliding window, RoPE
** path.  Blocks are interchangeable between two engines exactly when their fingerprints and
** layouts are equal.  Writes at most n bytes (NUL included).  Cannot fail. */
void kvt_engine_layout(const kvt_engine *eng, char *buf, size_t n);

/* Tokenize UTF-8 text.  add_bos: prepend BOS if the model wants one; parse_special: treat
** "<start_of_turn>" etc. as control tokens.
** OUT *tokens (caller frees with free()), *n_tokens.
** Errors: KVT_EINVAL (model has no tokenizer), KVT_ENOMEM. */
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
** the GGUF's; llama_chat_apply_template; if neither, the template named by `fallback`, e.g.
** "gemma", or "chatml" when NULL).  Thread-safe: it reads the model only, so any thread may call it
** while another decodes (as kvt_tokenize and kvt_detokenize may).
** add_assistant: append the assistant-turn prefix.  OUT *text, caller frees with free().
** Errors: KVT_EINVAL (unknown role or template), KVT_ENOMEM. */
int kvt_chat_format(kvt_engine *eng, const struct kvt_chat_msg *msgs, int32_t n_msgs, bool add_assistant, const char *fallback,
                    char **text /* OUT */);

/* The tokens a session decodes for a conversation: kvt_chat_format's text tokenized with BOS and
** control tokens parsed (kvt_tokenize(eng, text, true, true)).  A server compares them with its
** sessions' streams (kvt_session_tokens) to choose one, and computes the prompt's chain keys
** from them.  fallback: the sessions' kvt_session_params.template_fallback.  OUT *tokens (caller
** frees with free()), *n_tokens.  Errors: those of kvt_chat_format and kvt_tokenize. */
int kvt_chat_tokenize(kvt_engine *eng, const struct kvt_chat_msg *msgs, int32_t n_msgs, bool add_assistant, const char *fallback,
                      kvt_token **tokens /* OUT */, int32_t *n_tokens /* OUT */);

/* Prefill/decode tokens[0..n) into sequence seq at positions pos0, pos0+1, ..., split into
** chunks of n_batch tokens.  pos0 must be the sequence's next position (max resident + 1, or
** any position for an empty sequence).  want_logits: keep the logits of the last token for
** kvt_engine_logits() / kvt_engine_sample().
** Errors: KVT_EINVAL (bad seq or n; positions outside [0, 2^30)), KVT_ECTX (no free KV cells: the message gives the cell
** count; streams: the sequence's own stream is full, whatever the others hold), KVT_ELLAMA.  On error, tokens of the failed chunk are not in the cache; earlier chunks
** are (the caller's block table records what was decoded). */
int kvt_engine_decode(kvt_engine *eng, int32_t seq, const kvt_token *tokens, int32_t n, kvt_pos pos0, bool want_logits);

/* A prefill chunk of one sequence, to decode beside other sequences' decode rows. */
struct kvt_decode_chunk {
    int32_t seq;             /* the chunk's sequence: none of the rows' */
    const kvt_token *tokens; /* [n], not retained */
    int32_t n;               /* tokens, >= 1 (n = 0: no chunk) */
    kvt_pos pos0;            /* position of tokens[0]: the sequence's next position */
    bool want_logits;        /* keep the logits of its last token for kvt_engine_logits() */
};

/* Continuous batching with chunked prefill (as llama-server and vLLM schedule it), in ONE
** llama_decode: n decode rows, one token for each of n different caller sequences (toks[i] at
** position pos[i] of sequence seqs[i]; each seq at most once, each pos its sequence's next
** position; n may be 0 with a chunk), plus, when chunk is not NULL, one other sequence's prefill
** chunk; n + chunk->n in 1..min(n_ubatch, 512).  OUT logits_out[i * n_vocab + v]: every row's
** logits (caller allocates n * n_vocab floats); the chunk's last logits go to
** kvt_engine_logits() when it wants them (else kvt_engine_logits() has nothing).
** The rows are ordered for llama.cpp's ubatch split so that, with one stream per sequence, the
** chunk is a ubatch of its own (the decode rows of consecutive sequences share the others): its
** numbers are those kvt_engine_decode gives it, and its attention is captured as
** kvt_engine_decode's.  Attention capture is skipped for the rows (kvt_attn_get maps one
** sequence per ubatch, and says KVT_EUNSUPPORTED for the rows' sequences until their next
** kvt_engine_decode).  Streams: llama.cpp puts consecutive sequence ids with one token each into
** one ubatch; its attention width is the longest of those sequences' (REPORT.md §5).  The
** unified cache puts all in one ubatch, the chunk's rows first, and captures those rows.
** Errors: KVT_EINVAL (sizes out of range, bad or repeated seq, a chunk sequence out of range or
** also a row, token outside the vocabulary), KVT_ECTX (no free KV cells: then none of the tokens
** is in the cache), KVT_ELLAMA.  Not thread-safe (engine rule). */
int kvt_engine_decode_batch(kvt_engine *eng, const int32_t *seqs, const kvt_token *toks, const kvt_pos *pos, int32_t n,
                            float *logits_out /* OUT [n * n_vocab] */, const struct kvt_decode_chunk *chunk);

/* Logits (n_vocab floats) of the last token decoded with want_logits.  Owned by the engine,
** valid until the next decode.  NULL if none.  Cannot fail. */
const float *kvt_engine_logits(kvt_engine *eng);

/* A grammar-constrained decoding state (llama.cpp's GBNF grammar sampler, the mechanism behind
** llama-server's "grammar" / "json_schema" fields and its generic tool calling).  It tracks
** where in the grammar the tokens sampled so far have led; every token sampled through it is
** accepted into it, and an end-of-generation token is only allowed where the grammar is
** complete.  One per generation (a reply); not shared between concurrent generations. */
typedef struct kvt_grammar kvt_grammar;

/* Compile GBNF text (llama.cpp grammars/README.md syntax) for the engine's vocabulary, starting
** at rule `root` (NULL: "root").  OUT *out: free with kvt_grammar_free; may outlive nothing of
** the engine's but must not outlive the engine.
** Errors: KVT_EINVAL (the grammar does not parse or names no such root: llama.cpp logs where),
** KVT_ENOMEM.  Thread-safety: engine rule. */
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
    kvt_grammar *grammar;                    /* NULL = unconstrained; else only tokens the grammar allows are
                          ** sampled, and the sampled token advances it (borrowed, not owned) */
    const struct kvt_logit_bias *logit_bias; /* [n_logit_bias] (borrowed; tokens outside the
                          ** vocabulary are skipped), applied to the logits first, greedy included */
    int32_t n_logit_bias;
    /* OUT, optional (llama-server's post_sampling_probs): with post set and n_post > 0, a
    ** successful sample writes post[0] = the sampled token and its probability, then post[1 ..
    ** n_post] = the n_post most likely candidates, best first, with their probabilities under the
    ** distribution the token was drawn from: after logit_bias, top_k, top_p, temperature and the
    ** grammar (greedy: the token alone, probability 1).  Entries past the candidates the chain
    ** kept are {-1, 0}.  post[0 .. n_post] is the caller's buffer (n_post + 1 entries), written by
    ** the thread that samples; it is not part of what selects the chain (copies of this struct
    ** with other buffers sample alike). */
    struct kvt_token_p *post;
    int32_t n_post;
    float min_p; /* 0 = off; else tokens below min_p times the most likely one's probability are
                 ** dropped (llama.cpp's min_p sampler, after top_k and top_p) */
};

/* Sample the next token from kvt_engine_logits() (llama.cpp sampler chain: logit_bias, top_k,
** top_p, min_p, temperature, then a draw).  With a grammar the token is first sampled
** unconstrained and kept if the grammar allows it; otherwise the grammar masks the whole
** vocabulary and the chain samples again (llama.cpp common's order).  The engine counts the
** draws: successive calls with the same settings and seed are draws 0, 1, 2, ... of one
** generation (other settings or another seed start again at 0).  At temperature > 0 each draw
** has a generator of its own: draw 0 is seeded with s->seed (the first token is the one
** llama.cpp's dist sampler seeded alike draws), later draws with SplitMix64 of (s->seed, draw)
** (Steele et al., OOPSLA 2014), so a seeded generation gives the same tokens from the same
** logits whatever else the engine samples meanwhile (s->seed 0xFFFFFFFF, LLAMA_DEFAULT_SEED: a
** random seed per draw).  Sessions and batch rows count their own draws.  Not thread-safe (the
** engine's thread).  Errors: KVT_EINVAL (no logits available; the grammar allows no token, e.g.
** it completed and the vocabulary has no end-of-generation token), KVT_ENOMEM. */
int kvt_engine_sample(kvt_engine *eng, const struct kvt_sampling *s, kvt_token *tok /* OUT */);

/* Remove positions [p0, p1) of a sequence from the KV cache (p1 < 0: to the end).  Cannot
** fail for a valid seq; KVT_EINVAL otherwise. */
int kvt_seq_rm(kvt_engine *eng, int32_t seq, kvt_pos p0, kvt_pos p1);

/* Give sequence dst the cells of positions [p0, p1) of sequence src (p1 < 0: to the end); dst
** keeps its own cells.
** Unified cache: metadata only (llama_memory_seq_cp): the cells are shared, not copied, so they
** have one position for both sequences; never load or shift a sequence whose cells another
** sequence shares.
** Streams: a copy (llama.cpp can copy only a whole stream across streams, and aborts the process
** on a partial range, REPORT.md §3): the states of src and dst are read, the range's cells are
** added to dst's on the host and dst is written back with one llama_state_seq_set_data (cost:
** both sequences' cells, a few ms per 512).  The positions must be free in dst; sliding-window
** cells older than dst's new window are dropped (no later query can see them).  On error dst is
** unchanged.
** Errors: KVT_EINVAL (bad or equal ids; streams: dst already holds a position of the range, the
** message names it), KVT_ECTX (streams: dst's stream cannot hold the cells), KVT_ENOMEM,
** KVT_ELLAMA. */
int kvt_seq_cp(kvt_engine *eng, int32_t src, int32_t dst, kvt_pos p0, kvt_pos p1);

/* Move the cells of positions [p0, p1) of a sequence by delta positions (delta < 0: down, to
** close a gap left by eviction).  llama.cpp's own context shift (llama_memory_seq_add, as
** llama-server's context shift uses it): positions change now, K is re-rotated by RoPE at the
** next decode (kvt_block_save applies a pending shift first).  Streams mode on the HOST
** re-anchoring path does it at once instead: the sequence's state is read, K of the range
** rotated on the host (the rotation verified at open) and the state written back, so no shift is
** ever pending and no scratch stream is needed.  The target range [p0 + delta, p1 + delta) must
** hold no other cell of the sequence and must not go below 0.
** Errors: KVT_EINVAL (bad sequence, empty range, negative target, target occupied: the message
** names the position), KVT_ENOMEM, KVT_ELLAMA (streams).  On error the sequence is unchanged. */
int kvt_seq_shift(kvt_engine *eng, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_pos delta);

/* ====================================================================================== */
/* 3. Block primitives                                                                    */
/* ====================================================================================== */

/* A saved KV block: the llama_state_seq_get_data bytes of one position range, plus what is
** needed to load it elsewhere.  Owned by the caller; free with kvt_blob_free.
** The bytes are always in the one-stream form (n_stream = 1, as a unified cache writes them),
** whichever cache mode and n_seq saved them, so a block loads into any engine on the same model
** and cache types; kvt_block_load also accepts llama.cpp's per-sequence form (n_stream =
** n_seq_max, one non-empty stream record). */
typedef struct kvt_blob {
    uint8_t *data;       /* llama.cpp sequence-state bytes (llama_state_seq_get_data format) */
    size_t size;         /* bytes */
    kvt_pos p0;          /* first position the K rows are rotated for */
    int32_t n_tokens;    /* positions covered: [p0, p0 + n_tokens) */
    int32_t n_cells;     /* cells in the full-attention part */
    int32_t n_cells_swa; /* cells in the sliding-window part (iSWA models), else 0 */
} kvt_blob;

/* Block save: copy positions [p0, p1) of sequence seq into a new host blob.  Non-destructive:
** the sequence keeps its cells.  If a K-shift is pending (SEQ_ADD path), it is applied first
** with a one-token decode in a scratch sequence: llama.cpp applies a shift lazily at the next
** llama_decode, and llama_state_seq_get_data would otherwise save the un-shifted K.
** Unified cache: the range is shared into a scratch sequence and that sequence is saved.
** Streams: the whole sequence's state is read (once per cache change: the attention map and
** several saves of one step share it) and the range sliced on the host.
** On iSWA models (Gemma 3), save a block while its sliding-window cells still exist (right
** after it is decoded): the blob carries only the SWA cells llama.cpp still serialises (streams:
** those within the window of the sequence's last position; unified: also older ones whose cells
** were not yet reused), and kvt_block_load refuses a block that lacks the ones it needs.
** OUT *out: caller frees with kvt_blob_free.
** Errors: KVT_EINVAL (empty range, bad seq), KVT_ENOENT (no cells in range), KVT_ENOMEM,
** KVT_ELLAMA.  Cost: one memcpy of the block's K/V (bytes = n_tokens * kv_bytes_per_token);
** streams: plus a read of the whole sequence when the cache changed since the last read. */
int kvt_block_save(kvt_engine *eng, int32_t seq, kvt_pos p0, kvt_pos p1, kvt_blob **out);

/* Block load: put a saved block into sequence seq at positions [new_p0, new_p0 + n_tokens),
** re-anchoring K by RoPE for delta = new_p0 - blob->p0, with no forward pass.
** Unified cache:
**   HOST path: K rows are rotated on the host (EVOKE/"KV splice" style), positions rewritten,
**              one llama_state_seq_set_data into a scratch seq, then seq_cp into seq.
**   SEQ_ADD path: set_data into a scratch seq, llama_memory_seq_add(delta) (applied lazily by
**              llama.cpp at the next decode), seq_cp, seq_rm.
** Streams: the sequence's current cells plus the block's are assembled on the host (sliding-
** window cells older than the new window dropped), the sequence emptied and written with one
** llama_state_seq_set_data.  HOST: K rotated on the host first.  SEQ_ADD: the block goes in at
** its old positions and llama_memory_seq_add moves it lazily; if those positions are taken in
** seq, the shift runs at once in the scratch stream instead.  If llama.cpp rejects the write
** (it clears the part that failed and keeps the others), the previous cells are written back.
** new_p0 must be past every resident position of seq (blocks are loaded at the tail); the next
** decode continues at the highest position + 1.  The blob is not modified.
** The blob's bytes are not trusted (they may come from disk or a shared Redis): before anything
** is written, its cells must be what its fields say -- positions in [0, 2^30), part 0 holding
** n_cells cells, every cell of every part within [p0, p0 + n_tokens), no position twice -- and
** new_p0 + n_tokens must not pass 2^30.
** Errors: KVT_EINVAL (new_p0 not past the tail, or the block would pass position 2^30 - 1),
** KVT_EFORMAT (blob from another model or cache layout; cells that are not what the blob's
** fields say, the message naming the cell and position; an iSWA block without the sliding-window
** cells of its last positions, which would decode without that local context), KVT_ECTX (no free cells; streams: the stream cannot hold
** the sequence's cells plus the block's, checked before anything is touched),
** KVT_EUNSUPPORTED (rope type cannot be re-anchored, e.g. M-RoPE), KVT_ENOMEM, KVT_ELLAMA
** (streams: llama.cpp rejected the assembled state; the sequence has its previous cells back).
** On error the sequence is unchanged (streams: the same cells, packed within its stream). */
int kvt_block_load(kvt_engine *eng, const kvt_blob *blob, int32_t seq, kvt_pos new_p0);

/* Free a blob.  Accepts NULL. */
void kvt_blob_free(kvt_blob *blob);

/* Copy a blob (deep).  OUT *out.  Errors: KVT_ENOMEM. */
int kvt_blob_dup(const kvt_blob *blob, kvt_blob **out);

/* ---- Attention capture ----
** Captures post-softmax attention of the chosen layers during every kvt_engine_decode, keeps
** the last ubatch per layer, and maps KV-cell columns to token positions.  Flash attention off:
** llama.cpp's "kq_soft_max-<il>" nodes are read.  On (the fused op never materialises the
** softmax): the rows are recomputed on the host from the fused op's Q, K and mask with its scale
** and soft-cap, exact to float rounding (tests/unit/test_attention.c, 5e-7), at n_tok x n_kv x
** n_head x head_dim multiply-adds per captured layer; ALiBi and attention-sink models capture
** nothing there (kvt_attn_get: KVT_ENOENT).  Tensors in device memory (Vulkan, CUDA) are copied
** to the host first.  Optionally captures post-RoPE queries ("Qcur-<il>") for verification.
** Source: EVOKE-style attention signals for H2O (Zhang et al. 2023) and SnapKV (Li et al. 2024). */


/* Choose layers to capture (il in [0, n_layer)); n = 0 turns capture off.  capture_q also
** keeps Q.  Errors: KVT_EINVAL (layer out of range), KVT_ENOMEM. */
int kvt_attn_capture(kvt_engine *eng, const int32_t *layers, int32_t n, bool capture_q);

/* Attention of one captured layer for the last ubatch decoded into a given sequence.
** Shapes: w[(t * n_head + h) * n_keys + k] is the softmax weight of query token t (the ubatch's
** t-th token of that sequence, positions q_pos[t]) in head h on key position k_pos[k]
** (ascending).  Keys the query could not see have weight 0; each row sums to 1 over k.
** Sliding-window layers report the keys the last query can see (llama.cpp keeps only those
** cells of the window): earlier queries of a prefill ubatch lose the keys that have left the
** window since, so their rows may sum to less than 1.
** q[(t * n_head + h) * head_dim + d] holds post-RoPE, pre-scale Q if capture_q was set.
** All arrays are malloc'd for the caller, who frees the struct with kvt_attn_free. */
typedef struct kvt_attn {
    int32_t layer, n_query, n_head, n_keys, head_dim;
    kvt_pos *q_pos; /* [n_query] */
    kvt_pos *k_pos; /* [n_keys] */
    float *w;       /* [n_query * n_head * n_keys] */
    float *q;       /* [n_query * n_head * head_dim] or NULL */
} kvt_attn;

/* Works in both cache modes: with one stream per sequence the softmax columns are the cells of
** the sequence's own stream (REPORT.md §5), mapped through that sequence's state.
** Errors: KVT_ENOENT (layer not captured or nothing decoded since), KVT_EUNSUPPORTED (the
** sequence's last decode was a row of kvt_engine_decode_batch: its ubatches mix sequences, and their
** rows are not captured), KVT_EFORMAT (the cell map could not be reconstructed), KVT_ENOMEM. */
int kvt_attn_get(kvt_engine *eng, int32_t layer, int32_t seq, kvt_attn **out);
void kvt_attn_free(kvt_attn *a); /* frees the struct and its arrays; accepts NULL */

/* Layer il's cache part (0 = full-attention cache, 1 = sliding-window cache of an iSWA model)
** and its index among that part's layers, as found at engine open (by which attention mask
** each layer's softmax reads).  Errors: KVT_ENOENT when unknown. */
int kvt_engine_layer_part(const kvt_engine *eng, int32_t il, int *part /* OUT */, int *idx /* OUT */);

/* ====================================================================================== */
/* 4. Host pool: byte-budgeted RAM tier that spills to disk                               */
/* ====================================================================================== */

typedef struct kvt_pool kvt_pool;

struct kvt_pool_params {
    size_t budget_bytes;    /* RAM the pool may hold; default 256 MiB.  A ceiling: see
                              ** kvt_pool_put */
    const char *spill_dir;  /* directory for spill files; NULL = a private directory made
                              ** under $TMPDIR (or /tmp) on first spill, removed by free */
    size_t spill_bytes_max; /* payload bytes the spill files may hold; 0 = unlimited (the
                              ** default).  When a spill would exceed it, the least recently
                              ** used entries on disk are dropped to make room (n_dropped); the
                              ** entry being spilled is dropped instead when it is less recently
                              ** used than all of them, or larger than the quota itself */
};

/* Defaults listed above.  Returned by value; cannot fail. */
struct kvt_pool_params kvt_pool_default_params(void);

/* Create a pool (p NULL = defaults).  OUT *out, freed by kvt_pool_free.  Without a spill_dir,
** the private directories of processes that died without kvt_pool_free are removed from
** $TMPDIR first (at the first such open in a process, per $TMPDIR value): only directories named "kvtier-spill-<pid>-XXXXXX", owned by this user, whose
** pid is not a live process and whose lock no live pool holds, and in them only kvtier's spill
** files.  Errors: KVT_EINVAL (budget 0, empty spill_dir),
** KVT_EIO (spill_dir exists but is not a writable directory), KVT_ENOMEM. */
int kvt_pool_open(const struct kvt_pool_params *p, kvt_pool **out);

/* Free the pool and delete the spill files it wrote (and its private directory).  Accepts
** NULL.  Must not run concurrently with other calls on the same pool. */
void kvt_pool_free(kvt_pool *pool);

/* Store a copy of data[0..n) under key (replacing any previous value).  When RAM use would
** exceed the budget, least-recently-used entries (possibly this one) are written to spill
** files: header + SHA-256 + payload, written to a temporary name and renamed, so a half-written
** file never carries a valid name.  An entry larger than the whole budget goes straight to disk.
** The budget is a ceiling: once put returns, RAM use is within it (other threads' puts may
** exceed it while their values are being written).  The pool is a cache: an entry whose spill
** write fails (e.g. a full disk), or for which the spill quota has no room, is dropped, counted
** in n_dropped, and later gets of it return KVT_ENOENT.  Spill files are written outside the
** pool's lock and are not fsync'd (they never outlive the pool).
** Errors: KVT_EINVAL (NULL data with n > 0; n larger than both the budget and spill_bytes_max:
** it could never be stored), KVT_ENOMEM (the pool is unchanged), KVT_EIO (a spill write failed
** during this put; the message names the first entry and the cause, and says whether the NEW
** value is stored; the entries it was for are dropped, any old value under key is gone, and the
** pool is within budget).  Thread-safe. */
int kvt_pool_put(kvt_pool *pool, uint64_t key, const void *data, size_t n);

/* Fetch a copy of key's value.  A spilled entry is read back (outside the pool's lock) and its
** SHA-256 checked; on mismatch the entry is reported as KVT_ECORRUPT (message names the file)
** and nothing is returned.  A corrupt entry stays corrupt until it is deleted or replaced.
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
    int64_t n_dropped; /* entries dropped: their spill write failed, or the
                                          ** spill quota had no room for them */
};
/* Cannot fail; thread-safe.  n_corrupt counts failed reads, not distinct entries. */
void kvt_pool_get_stats(kvt_pool *pool, struct kvt_pool_stats *st /* OUT */);

/* ====================================================================================== */
/* 5. Session: one conversation under a token budget                                      */
/* ====================================================================================== */

typedef struct kvt_session kvt_session;

enum kvt_role { KVT_ROLE_SYSTEM = 0, KVT_ROLE_USER = 1, KVT_ROLE_ASSISTANT = 2 };

enum kvt_residency {
    KVT_RES_DEVICE = 0, /* in the llama.cpp KV cache */
    KVT_RES_HOST = 1,   /* evicted; blob in host RAM (the pool's, or the store's RAM tier) */
    KVT_RES_DISK = 2,   /* evicted; blob in a spill file */
    KVT_RES_LOST = 3,   /* evicted with no saved copy: with recovery "discard" gone for good;
                        ** otherwise the copy failed its checksum, its spill file went missing,
                        ** the pool dropped it (failed spill, spill quota) or its save failed,
                        ** and recovery recomputes the block from its tokens (recomputes) */
};

enum kvt_recovery {
    KVT_RECOVERY_KV_RESTORE = 0, /* load saved K/V back, no recompute */
    KVT_RECOVERY_DISCARD = 1,    /* evicted blocks are gone (truncation baseline) */
    KVT_RECOVERY_BREADCRUMB = 2, /* re-prefill the block's tokens at the tail (the recompute path) */
};

/* Eviction policies.  Each picks which resident blocks leave when the high watermark is crossed;
** sinks, the recent tail and the current turn are protected by all but no_eviction.
**   KVTIER       multi-signal score (recency, BM25 relevance to the current user message,
**                attention EWMA, role floors, pins); kv_restore recovery.  The default.
**   NO_EVICTION  reference: nothing is evicted (the budget must hold the whole conversation).
**   TRUNCATE     llama-server's context shift: keep the first block, drop the older half of
**                the rest when full; no recovery.
**   STREAMING    StreamingLLM (Xiao et al. 2023): sink block + recent window, one block at a
**                time; no recovery.
**   H2O          Heavy-Hitter Oracle (Zhang et al. 2023): lowest accumulated attention mass
**                leaves (captured attention, summed over heads and layers, normalised per
**                query); no recovery.
**   SNAPKV       SnapKV (Li et al. 2024): lowest attention from the observation window (the last
**                32 queries of the latest prompt) leaves; no recovery.
**   INFLLM       InfLLM-style (Xiao et al. 2024): recency eviction; every block keeps the keys of
**                its 4 most-attended tokens (one full-attention layer, un-rotated to a common
**                position); after a user message is decoded, the mean query of its last 32
**                tokens scores the evicted blocks and the top_k come back (kv_restore) before
**                the assistant prefix.
** Name strings are the lower-case enum names ("kvtier", "no_eviction", ...). */
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

/* Eviction scorer: higher score = keep.  Called for each evictable resident block.  `now`
** is the session's current position.  The default is recency (the block's last position).
** Later policies (H2O, SnapKV, ...) plug in here. */
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
    int32_t gen_reserve;           /* tokens kept free for the reply when a turn is admitted;
                              ** default 64 */
    float min_recovery_score;      /* BM25 score a block needs to be recovered; default 3.0
                              ** (one shared rare term scores about 2-3, a common one < 1) */
    const char *template_fallback; /* chat template when the GGUF has none; default "gemma" */
    kvt_pool *pool;                /* host tier for a session without a store; NULL = the session
                              ** makes a private 256 MiB pool.  Must be NULL with a store: the
                              ** store then holds every copy (see store) */
    kvt_scorer_fn scorer;          /* overrides the policy's scorer when set */
    void *scorer_ud;
    int32_t policy;             /* enum kvt_policy; default KVTIER.  Baselines set their own
                              ** recovery (discard) whatever `recovery` says. */
    const int32_t *attn_layers; /* layers whose attention feeds H2O/SnapKV/kvtier; NULL = the
                              ** full-attention layers of an iSWA model (Gemma 3 270M: 5, 11, 17),
                              ** else three spread layers.  Copied at open. */
    int32_t n_attn_layers;
    int32_t snap_window;           /* SnapKV observation window (queries); default 32 */
    float ewma_alpha;              /* attention EWMA weight of the newest observation; default 0.3 */
    const char *head_profile;      /* `kvtier calibrate` profile: weights heads in the attention
                              ** signals (read at open); NULL = equal weights */
    struct kvt_embedder *embedder; /* optional dense retrieval for recovery (section 7): every
                              ** sealed block's text is embedded (one embedding per block, ~2.5x
                              ** its prefill on Gemma 3 270M), and recovery ranks evicted blocks
                              ** by cosine to the user message instead of BM25.  Borrowed: must
                              ** outlive the session; NULL = BM25 only (the default) */
    float min_recovery_cosine;     /* with an embedder: cosine an evicted block needs to come
                              ** back; default 0.5 (model-dependent: mean-pooled generative
                              ** models are anisotropic, Gemma 3 270M puts unrelated sentences
                              ** at ~0.6) */
    int32_t ann_min_blocks;        /* with an embedder: sealed blocks from which the block vectors
                              ** go into an HNSW index (kvt_ann) instead of a linear scan;
                              ** default 1024 */
    int32_t successor_blocks;      /* evicted blocks right after a recovered one that come back with
                              ** it (a fact cut at a block boundary continues there; RAG systems
                              ** expand a hit to its neighbouring chunk the same way), for BM25
                              ** hits whose last matching word is in the block's last quarter,
                              ** and for every dense hit; default 1, 0 = only the hits */
    kvt_store *store;              /* content-addressed block store (section 8), shared by sessions
                              ** and processes; NULL = none (the default).  Borrowed: must outlive
                              ** the session.  Prompt prefixes are loaded from it by chain key, the
                              ** session's pure blocks stored in it, and it replaces the host pool
                              ** (docs/MANUAL.md, "A session and the block store") */
    const char *tenant;            /* chain salt (kvt_chain_params.tenant): sessions of different
                              ** tenants never share blocks; NULL/"" = shared.  Copied at open */
    const char *codec_ram;         /* codec of the blocks the session saves to its host pool (a
                              ** section 9 spec: "raw", "q8", "q4", "elastic", "elastic+q8", with
                              ** arguments); NULL or "raw" = the blob's bytes (bit-exact).  Parsed at
                              ** open (KVT_EINVAL naming a bad spec).  Cost, what stays raw and what a
                              ** copy that fails to decode becomes: docs/MANUAL.md, "The host pool codec" */
    float elastic_sk, elastic_sv;  /* live ElasticKV (ElasticKV's "attention haze" removal): threshold
                              ** scales s_k, s_v in [0, 2]: per layer, K/V and KV head, elements with
                              ** |x| < tau_h = max(sigma_h / 2, mu_h) x s of |x| are set to 0;
                              ** both 0 = off (the default; the source design's sweet spot is 0.45,
                              ** 0.50).  A pass every KVT_ELASTIC_INTERVAL tokens; sinks and the tail
                              ** stay untouched; counted in kvt_session_stats.elastic_*.  When passes
                              ** run and what a failed one does: docs/MANUAL.md, "Live ElasticKV" */
    bool elastic_random;           /* control for evaluation: each pass zeroes, per layer, tensor and
                              ** head, the same number of elements uniformly at random instead
                              ** default false */
    float elastic_random_frac;     /* with elastic_random: the sparsity each pass holds the
                              ** thresholded range at (e.g. the
                              ** threshold's measured fraction); 0 = match each pass's threshold
                              ** count (ratchets up over passes); default 0 */
    bool chunk_reuse;              /* non-prefix chunk reuse (issue #12; EPIC, Hu et al. 2024, and
                              ** CacheBlend, Yao et al. 2025): blocks are also stored by their own
                              ** tokens and found at any offset of a prompt, loaded with RoPE
                              ** re-anchoring; needs `store`; default false (off: measured quality
                              ** loss, docs/BENCHMARKS.md).  How a prompt is scanned and loaded:
                              ** docs/MANUAL.md, "Non-prefix chunk reuse"; counted in kvt_session_stats.chunk_* */
    const char *chunk_recompute;   /* with chunk_reuse: tokens of each reused chunk re-decoded in
                              ** context at its start (EPIC's boundary recompute): "K" (tokens,
                              ** >= 0) or "P%" (percent of the run's tokens, 0-100, rounded up);
                              ** NULL = "15%" (CacheBlend's ratio; never worse than k = 0, 4, 16,
                              ** 64 in docs/BENCHMARKS.md).  Rounded UP to whole blocks (a stored block loads
                              ** whole); a run that does not outlast them is decoded entirely.
                              ** Parsed at open (KVT_EINVAL naming the spec; kvt_chunk_recompute_parse) */
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

struct kvt_session_params kvt_session_default_params(void);

/* Create a session on engine sequence params->seq (which must be empty).
** Errors: KVT_EINVAL (message names the bad value: budget smaller than two blocks,
** watermarks out of order, seq out of range), KVT_ENOMEM. */
int kvt_session_open(kvt_engine *eng, const struct kvt_session_params *p, kvt_session **out);

/* Free the session, its blobs in the pool (or its private entries in the store; content
** entries stay, shared), and its cells in the engine.  Accepts NULL. */
void kvt_session_free(kvt_session *s);

/* Append a message.  System and assistant messages (a client replaying history) are recorded
** and decoded with the next user message.  For a user message: the pending text of earlier
** messages is decoded, evicted blocks relevant to the message come back at the tail
** (kv_restore: BM25 novel terms or embedder cosine, top_k plus successor_blocks), then the
** message and the assistant prefix are decoded, evicting by watermark so that they plus
** gen_reserve fit the budget.  A message longer than the budget evicts blocks of its own; the
** ones its end asks about come back before the assistant prefix.  The stream always holds the
** template's tokens of the whole conversation (cut back and re-decoded where it diverges).  The
** rules in full: docs/MANUAL.md, "What kvt_session_add does with a message".
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

/* Teacher-forced log-probability (natural log, summed) of `answer` as the assistant's reply to
** the conversation so far: decodes the assistant prefix and answer tokens into a scratch copy
** of the sequence, reads each token's log-softmax, and removes them again.  Session state is
** unchanged.  OUT *logprob (nats), *n_tokens.  Errors: KVT_ECTX, KVT_ELLAMA. */
int kvt_session_answer_logprob(kvt_session *s, const char *answer, double *logprob, int32_t *n_tokens);

/* ---- Servers: whole-conversation sync and step-wise generation ----
** A server receives the whole history with every request (OpenAI clients resend it) and steps
** many sessions one token at a time on one engine.  Every session keeps the logits of its own
** last token, so sessions on one engine may be interleaved call by call. */

struct kvt_sync_info {
    int32_t prompt_tokens;          /* tokens of the formatted conversation (with assistant prefix) */
    int32_t tokens_reused;          /* prompt tokens already in the session (prompt - decoded, >= 0) */
    int64_t tokens_decoded;         /* tokens run through the model by this call (prefill, re-fed tails) */
    int64_t tokens_recovered;       /* tokens brought back by kv_restore by this call */
    int64_t evictions, recoveries;  /* block evictions / loads by this call */
    int64_t recomputes;             /* of those loads, blocks re-decoded because their saved copy was
                               ** lost (kvt_session_stats.recomputes) */
    int32_t route;                  /* enum kvt_route over this call's prompt lookups (block store) */
    int64_t tokens_from_store;      /* prompt tokens loaded from the store (neither decoded nor reused) */
    int64_t tokens_from_chunks;     /* prompt tokens loaded as reused chunks (chunk_reuse; neither
                               ** decoded, reused nor in tokens_from_store) */
    int64_t chunk_recompute_tokens; /* tokens of found chunks decoded at their start (in
                               ** tokens_decoded) */
};

/* Make the session's conversation exactly msgs[0..n_msgs) followed by the assistant prefix, ready
** for kvt_session_gen_step or kvt_session_generate.  The longest common prefix of messages (role
** and content byte-equal; a reply the session generated is stored as kvt_session_gen_end returned
** it) is kept; the messages after it are added with kvt_session_add.  Where the formatted text
** diverges from what was decoded (an edited message, a reply the client shortened, two user
** messages in a row, a first message that shares only its opening with the session's), the token
** stream is cut back to the last message boundary before the divergence, or to the first token
** that differs when that keeps more (see kvt_session_add), and re-decoded from there: the cache
** then holds exactly the template's tokens of the whole conversation.  The last message must be a user message.  msgs is not retained.
** OUT *out (may be NULL): what this call cost.
** Errors: KVT_EINVAL (no messages, unknown role, NULL content, last message not from the user,
** a reply still being generated), plus those of kvt_session_add.  Not thread-safe (engine rule). */
int kvt_session_sync(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n_msgs, struct kvt_sync_info *out);

/* kvt_session_sync as steps, for a scheduler that decodes the prompt's chunks itself: alone, or
** inside one llama_decode with its other requests' decode tokens (kvt_gen_batch.chunk: chunked
** prefill inside the batch, as llama-server and vLLM schedule it).  The session does everything
** else (the cut-back, store and chunk loads, recovery, eviction, sealing, attention signals) in
** kvt_prefill_next and kvt_prefill_done, and never calls into the caller:
**
**     kvt_prefill *pf;
**     struct kvt_decode_chunk c;
**     int rc = kvt_session_prefill(s, msgs, n_msgs, &pf);
**     while (rc == 0 && (rc = kvt_prefill_next(pf, room, &c)) == 1)
**         rc = kvt_prefill_done(pf, decode_somehow(&c));  // 0, an error, or KVT_ECANCELED
**     rc = kvt_prefill_end(pf, &info);                    // kvt_session_sync's result
**
** The chunks, their evictions and sealed blocks are those kvt_session_sync gives (the same
** numbers when each chunk is decoded as kvt_engine_decode would: alone, or in
** kvt_engine_decode_batch with one KV stream per sequence), as long as room leaves chunks whole.
** Between kvt_prefill_done and the next kvt_prefill_next the caller may use the engine for other
** sessions and sequences, not this session.  msgs must stay valid until kvt_prefill_end.
** Not thread-safe (engine rule): all four calls on the engine's one thread at a time.
** OUT *pf: free with kvt_prefill_end.  Errors: those kvt_session_sync gives before decoding. */
typedef struct kvt_prefill kvt_prefill;
int kvt_session_prefill(kvt_session *s, const struct kvt_chat_msg *msgs, int32_t n_msgs, kvt_prefill **pf /* OUT */);

/* The next prefill chunk: returns 1 with *chunk (c->seq is the session's sequence, c->tokens
** owned by pf until kvt_prefill_done, c->pos0 the next position, c->want_logits on the last
** chunk of a run of tokens).  Decode exactly those tokens, then call kvt_prefill_done before any
** other call on this session; a chunk that wants logits must leave them in kvt_engine_logits()
** (no other decode in between).  room > 0: the chunk holds at most room tokens (a step's token
** budget left); 0: up to the block boundary.  Returns 0 when the conversation is in (call
** kvt_prefill_end), or the prefill's error (it stops there: kvt_prefill_end returns it too). */
int kvt_prefill_next(kvt_prefill *pf, int32_t room, struct kvt_decode_chunk *chunk /* OUT */);

/* The chunk kvt_prefill_next handed out was decoded with result rc (0; the decode's error, in
** which case its tokens are not in the cache; or KVT_ECANCELED, not decoded: the caller stops
** the prefill, e.g. its client left).  Records the tokens, seals completed blocks.  Returns 0,
** or the error that stops the prefill: the message being added is then not part of the
** conversation and its decoded chunks are cut back (the session is as before the message). */
int kvt_prefill_done(kvt_prefill *pf, int rc);

/* End the prefill and free pf (NULL: nothing).  Ending before kvt_prefill_next returned 0 stops
** it (KVT_ECANCELED; a chunk still out is removed from the cache; the message being added is
** undone).  OUT *info (may be NULL): as kvt_session_sync's.  Returns the prefill's error, with
** its message in kvt_errmsg(), or 0. */
int kvt_prefill_end(kvt_prefill *pf, struct kvt_sync_info *info /* OUT */);

/* A row of kvt_session_gen_step_batch that belongs to no session: plain text generation in a
** sequence the caller manages itself (a server's /v1/completions), stepped in the same
** llama_decode as the sessions.  The caller prefills the prompt with kvt_engine_decode (want_logits on
** the last token), copies kvt_engine_logits() into `logits`, and sets pos to the prompt's length; the
** row then needs no budget, block table or pool (the caller reserves its KV cells and clears the
** sequence with kvt_seq_rm when done). */
struct kvt_gen_row {
    int32_t seq;             /* IN: caller sequence, used by no session of the batch nor another row */
    kvt_pos pos;             /* IN/OUT: position the sampled token takes (the sequence's next);
                              ** advanced by one when the token is decoded */
    float *logits;           /* IN/OUT [n_vocab]: the logits to sample from; overwritten by those
                              ** after the sampled token when it is decoded.  Owned by the caller */
    int32_t n_gen;           /* IN/OUT: tokens this row has generated (0 for a new generation): the
                              ** index of its next draw; advanced by one when the token is decoded */
    struct kvt_sampling smp; /* IN: this row's sampling (as kvt_engine_sample, its draws counted
                              ** by n_gen: a row's generation is the same alone or batched) */
    kvt_token tok;           /* OUT: the sampled token */
    bool done;               /* OUT: tok ends the generation (it is not decoded) */
    int status;              /* OUT: 0 or this row's error (KVT_EINVAL: NULL logits; sampling) */
};

/* One generated token: samples from the session's own logits (llama.cpp sampler chain, as
** kvt_engine_sample), and unless it ends the generation decodes it into the session (evicting by
** watermark) and appends it to the reply being built.  OUT *tok: the token; *done: true when it
** is an end-of-generation token (not decoded, not part of the reply).  Call kvt_session_gen_end
** to finish the reply, whatever stopped it.
** Errors: KVT_EINVAL (no user turn to reply to), KVT_ENOMEM, KVT_ECTX, KVT_ELLAMA, KVT_EBUDGET;
** on error the token is not part of the reply. */
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
};

/* Continuous batching: kvt_session_gen_step for every session of b and a sampled token for every
** raw row, from their own logits, with ONE llama_decode (kvt_engine_decode_batch) for all the
** tokens that do not end a generation (chats and completions; at most the engine's n_ubatch
** rows in all) and b->chunk's tokens.  With no session or row taking a token the chunk is decoded
** alone.  A token sampled for the last allowed step is decoded like any other (the caller
** discards it with the sequence).  Attention signals are not observed for batched tokens
** (H2O/SnapKV/kvtier scores see prompt chunks only).
** Returns 0, or KVT_EINVAL (negative counts, NULL arrays), or the error of the shared decode
** (KVT_EINVAL for a sequence out of range or used twice, KVT_ECTX, KVT_ELLAMA, KVT_ENOMEM), in
** which case no session and no row took a token (rows' pos and logits are unchanged) and the
** chunk is not in the cache either.  Row logits are not retained.  Not thread-safe (engine
** rule). */
int kvt_session_gen_step_batch(kvt_engine *eng, const struct kvt_gen_batch *b);

/* The logits (n_vocab floats) the session's next token is sampled from: those after its last
** decoded token (a prompt's last token or the last reply token), as kvt_session_gen_step and
** kvt_session_gen_step_batch sample them.  A server reads them before a step for the sampled
** token's log-probability (OpenAI "logprobs").  Owned by the session, valid until its next
** decode; NULL when there are none (no user turn decoded yet, parked).  Cannot fail. */
const float *kvt_session_logits(const kvt_session *s);

/* Park a session: every resident block is saved (to the pool, or with kvt_session_params.store
** the store; the open block is sealed early; all sealed blocks are there already, write-through) and its cells leave the cache, so its sequence
** id can serve another session.  kvt_session_resume loads the blocks back; only a block whose
** copy is gone by then (see kvt_session_resume) is recomputed.  A parked session accepts only kvt_session_resume, stats/info calls and kvt_session_free.
** Errors: KVT_EINVAL (a reply is being generated), those of kvt_block_save / kvt_pool_put (the
** session is then not parked).  Parking a parked session does nothing. */
int kvt_session_park(kvt_session *s);

/* Resume a parked session on sequence seq (empty; any caller sequence): the blocks that were
** resident when it was parked are loaded back at the positions they had (kv_restore from the
** pool; no forward pass; counted as recoveries), the evicted ones stay evicted.
** A block whose saved copy is gone (its spill file fails its checksum or is missing, the pool
** dropped it) is recomputed in place from its tokens, after the blocks before it (counted in
** recomputes), so the context has no hole.
** Errors: KVT_EINVAL (not parked, seq out of range or not empty), those of kvt_block_load and
** kvt_engine_decode (the blocks not loaded by then stay evicted). */
int kvt_session_resume(kvt_session *s, int32_t seq);

/* Finish the reply built by kvt_session_gen_step (possibly empty): it becomes an assistant message
** of the conversation.  OUT *reply (may be NULL): its text, caller frees with free().
** Errors: KVT_ENOMEM (the reply stays pending; call again). */
int kvt_session_gen_end(kvt_session *s, char **reply /* OUT */);

/* Messages of the conversation (system, user, assistant, as added or generated) and message i.
** msg->content is owned by the session, valid until the next call that changes the conversation.
** Errors: KVT_EINVAL (i out of range). */
int32_t kvt_session_n_messages(const kvt_session *s);
int kvt_session_message(const kvt_session *s, int32_t i, struct kvt_chat_msg *msg /* OUT */);

/* The conversation's token stream: every token the session decoded for it, in the order said
** (blocks by id), evicted and lost blocks included, a generated reply as generated (its tokens
** may differ from the template's tokenization of its text), the assistant prefix of a pending
** turn included.  This is what a later kvt_session_sync can keep: a server compares it with the
** template's tokens of a request (kvt_chat_format with the assistant prefix and the session's
** template_fallback, then kvt_tokenize with add_bos and parse_special) to choose the session
** sharing the longest prefix.  Copies the first min(n_max, total) tokens into out[] (out may be
** NULL when n_max <= 0) and returns total, the stream's length (= total_tokens of
** kvt_session_get_stats).  Works on a parked session.  Cannot fail.  Not thread-safe (engine
** rule). */
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
    int64_t recomputes;         /* blocks recomputed (their tokens decoded again at the tail)
                                 ** because their saved copy was lost: corrupt, spill file
                                 ** missing, dropped by the pool, or never saved.  Also counted
                                 ** in recoveries, their tokens in tokens_decoded.  Recovery
                                 ** "breadcrumb" recomputes by design and is not counted here */
    kvt_pos next_pos;           /* position the next token will take; always below the model's
                                 ** trained context (n_ctx_train): gaps left by eviction are
                                 ** closed by moving resident blocks down when it would pass */
    int64_t compactions;        /* times that happened (kvt_seq_shift of every resident block) */
    double policy_ms;           /* time in eviction policy work: attention signals, scoring,
                                 ** bookkeeping (ms; the block primitives are not included) */
    double decode_ms;           /* time in kvt_engine_decode for this session (ms) */
    struct kvt_pool_stats pool; /* the host pool's counters, or with a store its private
                                    ** entries' (kvt_store_stats.priv); both are shared with
                                    ** the pool's or store's other sessions */
    /* block store (kvt_session_params.store) */
    int32_t route;               /* enum kvt_route of the last prompt prefill */
    int32_t route_tokens;        /* its tokens loaded from the store (not decoded) */
    int32_t route_lookup_tokens; /* its tokens in full blocks looked up */
    int64_t store_tokens;        /* all tokens loaded from the store (not in tokens_decoded) */
    int64_t store_blocks_put;    /* blocks given to the store (a key already there is not) */
    double store_ms;             /* time in lookups, reads and loads of store blocks (ms) */
    int64_t store_load_errors;   /* prefixes found in the store that the engine refused to load (the
                                 ** tokens were prefilled instead: correct, but the lookup was
                                 ** wasted; a persistent count points at a store/engine mismatch) */
    /* host pool saves (kvt_session_params.codec_ram) */
    int64_t pool_saved_tokens; /* tokens of every block save to the pool (re-saves included) */
    int64_t pool_raw_bytes;    /* their raw blob bytes */
    int64_t pool_stored_bytes; /* the bytes the pool was given for them (encoded) */
    double codec_encode_ms;    /* time encoding them (ms; 0 with raw) */
    double codec_decode_ms;    /* time decoding recovered blocks (ms; 0 with raw) */
    /* live ElasticKV (kvt_session_params.elastic_sk; all 0 when off) */
    int64_t elastic_passes;        /* thresholding passes run */
    int64_t elastic_zeroed;        /* elements set to 0 by all passes (each counted once) */
    int64_t elastic_elems;         /* K/V elements of the resident cells at the last pass (all
                                 ** layers, sinks and tail included) */
    int64_t elastic_zero;          /* of them 0 after it: the resident sparsity is
                                 ** elastic_zero / elastic_elems */
    int64_t elastic_eligible;      /* of them in the thresholded range at the last pass */
    int64_t elastic_zero_eligible; /* of those 0 after it */
    double elastic_ms;             /* time in passes (ms; read, threshold, write back) */
    /* non-prefix chunk reuse (kvt_session_params.chunk_reuse; all 0 when off) */
    int64_t chunk_tokens;           /* prompt tokens loaded from chunk blocks (not decoded; also in
                                 ** store_tokens) */
    int64_t chunk_recompute_tokens; /* tokens of found chunks planned for decoding at their start
                                 ** (boundary recompute; a run no longer than that is decoded
                                 ** whole and counted here entirely) */
    int64_t chunk_runs;             /* runs of consecutive chunk hits the scan found (those decoded
                                 ** whole included) */
    int64_t chunk_blocks_put;       /* blocks given to the store under a chunk key */
    int64_t chunk_load_errors;      /* chunk runs found but decoded instead: the load failed, or the
                                 ** early seal / room / positions for it could not be had */
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
    uint64_t pool_key;      /* key of its saved K/V in the pool or among the store's private
                           ** entries (sealed blocks; a pure block's copy may be its content
                           ** entry instead) */
    int32_t keep;           /* enum kvt_keep of the message it starts in */
    double attn_mass;       /* accumulated attention mass (H2O), sum over heads/layers/queries
                           ** of normalised weights on its tokens */
    double attn_ewma;       /* EWMA of the per-ubatch attention share (kvtier policy) */
    double attn_window;     /* attention from the last observation window (SnapKV) */
    double relevance;       /* BM25 score against the latest user message */
    int32_t recovered_turn; /* turn of its last recovery, -1 never */
    bool from_chunk;        /* its K/V were loaded as a reused chunk (chunk_reuse), computed in
                           ** another context: not a cold prefill's */
    const char *text;       /* detokenized text (owned by the session; valid until next call) */
};

/* Number of blocks in the table (cannot fail), and row i (0 <= i < n) in position order of
** creation; info->text is owned by the session.  Errors: KVT_EINVAL (i out of range). */
int32_t kvt_session_n_blocks(const kvt_session *s);
int kvt_session_block(kvt_session *s, int32_t i, struct kvt_block_info *info /* OUT */);

/* ====================================================================================== */
/* 6. Signals: attention mass per block, entropy                                          */
/* ====================================================================================== */

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

/* ====================================================================================== */
/* 7. Optional dense retrieval: embeddings through llama.cpp, approximate nearest neighbours */
/* ====================================================================================== */

/* An embedding model: any GGUF llama.cpp loads, run with embeddings on and MEAN pooling
** (sentence-transformer style).  Separate from the generation engine (its own model and
** context).  Not thread-safe; one caller at a time. */
typedef struct kvt_embedder kvt_embedder;

/* n_ctx: longest text in tokens (default 512 if <= 0); n_threads 0 = all cores.
** Errors: KVT_EINVAL, KVT_EMODEL (message names the path), KVT_ELLAMA. */
int kvt_embedder_open(const char *model_path, int32_t n_ctx, int32_t n_threads, kvt_embedder **out);
void kvt_embedder_free(kvt_embedder *em); /* accepts NULL */

/* Approximate nearest-neighbour index over L2-normalised vectors by cosine similarity: HNSW
** (Malkov & Yashunin 2018) through hnswlib, defaults M = 16, ef_construction = 200,
** ef_search = 50.  Ids are caller-chosen uint64.  Not thread-safe. */
typedef struct kvt_ann kvt_ann;

/* ====================================================================================== */
/* 8. Block store: content-addressed KV blocks in tiers (RAM -> disk -> Redis), across     */
/*    restarts and servers                                                                */
/* ====================================================================================== */

/* A block's identity is the chain of its prefix (vLLM's prefix caching, LMCache's chunk keys):
**   h_0 = SHA-256("kvtier-chain" | format version | model fingerprint | layout | block | tenant)
**   h_i = SHA-256(h_{i-1} | tokens of block i as little-endian int32)
** so a key names the K/V a cold prefill of exactly those tokens from position 0 produces, on
** exactly those weights and cache layout.  Strings are length-prefixed and integers
** little-endian (docs/STORE.md gives the exact bytes), so no two parameter sets share an input.
** Deterministic across processes and machines (no seed: the production bug of hash-seeded
** prefix caches, 0 % hits after a restart, cannot happen).  Pure functions (any thread). */
struct kvt_chain_params {
    kvt_key model;      /* kvt_engine_fingerprint */
    const char *layout; /* kvt_engine_layout; required */
    int32_t block;      /* tokens per block (> 0) */
    const char *tenant; /* salt: blocks of different tenants never share keys; NULL and ""
                             ** are the same, shared namespace */
};
/* 64 lowercase hex digits + NUL into out[65].  Cannot fail. */
void kvt_key_hex(const kvt_key *k, char out[2 * KVT_KEY_BYTES + 1]);

typedef struct kvt_store kvt_store;

enum kvt_tier { KVT_TIER_NONE = 0, KVT_TIER_RAM = 1, KVT_TIER_DISK = 2, KVT_TIER_REDIS = 3 };

/* TTL (EdgeSync-LLM's rule): an entry expires ttl_s after its last hit (or its write), or
** ttl_hot_s after once it has hot_hits hits.  Expiry is decided with the parameters of the
** process that asks (the index stores last hit and hit count, not a deadline), so a changed
** ttl applies to blocks already stored.  Expired entries are misses for lookups but stay (the
** writing session's copy) until the quota, gc or a fresh put removes them.  Disk quota eviction takes expired entries first, then cold entries (fewer
** than hot_hits hits) least recently hit first, then hot ones the same way. */
struct kvt_store_params {
    const char *dir;   /* the disk tier: DIR/index.db (SQLite, WAL) + DIR/blobs/ + DIR/lock;
                              ** NULL = kvt_store_default_dir().  Created (mode 0700) if missing,
                              ** unless read_only */
    size_t ram_bytes;  /* RAM tier budget (payload bytes, LRU); default 256 MiB; 0 = no RAM
                              ** tier.  Shared with the private entries (sessions' own block copies),
                              ** which take it first */
    size_t disk_bytes; /* disk tier quota (payload bytes of the blob files); default 8 GiB;
                              ** 0 = no disk tier (RAM only: nothing persists, dir unused) */
    double ttl_s;      /* seconds, > 0; default 1800 (30 min, EdgeSync-LLM) */
    double ttl_hot_s;  /* seconds, >= ttl_s; default 604800 (7 days) */
    int32_t hot_hits;  /* >= 1; default 5 */
    int32_t queue_max; /* write-behind queue (blocks waiting for the disk writer), >= 1;
                              ** default 256.  A put that finds it full drops the disk write
                              ** (counted in disk.writes_dropped); the queue's blocks share their
                              ** bytes with the RAM tier's copy when it holds them */
    bool read_only;    /* inspect only: no writer thread, nothing created or removed (a
                              ** corrupt or expired entry is still a miss); put, gc, clear and
                              ** verify with repair return KVT_EINVAL */
    /* Redis tier (src/store/redis.c; docs/STORE.md "Redis tier"): a cache shared by several
    ** servers, below RAM and disk.  Correctness never depends on it: every error or timeout is a
    ** miss (callers prefill) or a dropped write, counted in stats.redis. */
    const char *redis_url;         /* NULL or "" = no Redis tier.  "redis://[[user:]password@]host[:port][/db]"
                              ** (port 6379, db 0 by default; host may be [IPv6]) or "unix://path[?db=N]";
                              ** the string is copied at open */
    int32_t redis_timeout_ms;      /* deadline of a read, ms, >= 1; default 20: the socket timeout of the
                              ** connect, of each send and of each receive (a reply that trickles in
                              ** may take longer in all; a host name's DNS lookup is not covered).
                              ** A get that passes it is a miss (timeouts) and the tier backs off */
    int32_t redis_ttl_s;           /* EX of every key written, seconds, >= 1; default 86400 (1 day): the
                              ** TTL runs from the last write of the block by any server */
    size_t redis_max_bytes;        /* largest value written or accepted (128-byte header + payload);
                              ** default 64 MiB; a larger block is not written (writes_dropped) */
    int32_t redis_queue_max;       /* Redis writes waiting for the Redis writer thread, >= 1; default
                              ** 256; a put that finds it full drops the Redis write */
    const char *redis_secret_file; /* NULL = values carry a checksum but no key: anyone who can
                              ** write to the Redis can plant K/V for any chain key.  Else a file
                              ** of 16 to 4096 bytes (read at open), shared by the servers that share
                              ** the Redis: every value written carries HMAC-SHA-256(secret, value)
                              ** after it, and a value read whose MAC does not match is a miss,
                              ** counted in redis.corrupt and deleted (servers with different secrets
                              ** on one Redis therefore delete each other's values).  Errors at open:
                              ** KVT_EINVAL (unreadable, shorter than 16 or longer than 4096 bytes) */
    const char *disk_codec;        /* block codec of the disk tier (section 9 spec: "raw", "q8", "q4",
                              ** "elastic", "elastic+q8", with parameters); NULL = "raw" (the
                              ** default: a hit then loads the exact K/V a cold prefill computed).
                              ** Encoded on the writer thread, off the decode path; decoded on a
                              ** disk hit (the RAM tier and callers always see raw blob bytes).
                              ** Lossy codecs trade exactness for bytes: docs/BENCHMARKS.md
                              ** "Block codecs" (q4: 0.32x raw at KL ~0.01 nats/token on Gemma 3
                              ** 270M).  A block the codec cannot take (a quantised cache) is
                              ** written raw */
    int32_t disk_codec_heads;      /* KV heads per layer for the elastic codecs' per-head thresholds
                              ** (kvt_engine_info.n_head_kv); 0 = one threshold per row */
    /* Private entries (sessions' own block copies, RAM within ram_bytes,
    ** then spill files). */
    const char *private_dir;   /* directory of their spill files; NULL = a private directory under
                              ** $TMPDIR (kvt_pool_params.spill_dir); copied at open */
    size_t private_disk_bytes; /* quota of those files (payload bytes); 0 = unlimited (the
                              ** default); past it the least recently used are dropped (their
                              ** blocks recomputed if needed again) */
    /* Prefetch (kvt_store_prefetch; docs/STORE.md "Prefetch"). */
    int32_t prefetch_threads; /* threads reading prefetched blocks into RAM, 0..16; default 2; 0 =
                              ** no prefetch (kvt_store_prefetch then does nothing).  None are
                              ** started without a RAM tier or without a disk or Redis tier */
    int32_t prefetch_queue;   /* keys waiting for those threads, >= 1 when prefetch_threads > 0;
                              ** default 256; a key that finds the queue full is dropped (counted) */
    size_t prefetch_bytes;    /* bound on RAM bytes of promoted blocks no get has read yet; default
                              ** 0 = ram_bytes / 4.  At the bound new keys are dropped (counted);
                              ** each thread may overshoot it by the blocks it holds (one, or 8
                              ** with a Redis tier) */
};

/* Defaults listed above.  Cannot fail. */
struct kvt_store_params kvt_store_default_params(void);

/* $XDG_CACHE_HOME/kvtier/store (when absolute), else $HOME/.cache/kvtier/store, into buf[n].
** Errors: KVT_EINVAL (neither variable set, or n too small; buf is "" then). */
int kvt_store_default_dir(char *buf, size_t n);

/* Open (or create) a store (p NULL = defaults) and start its disk writer thread.  An index or
** blob directory left by a killed process opens fine: SQLite's WAL recovers the index,
** temporary blob files of dead writers are removed, and entries whose file is missing are
** dropped at the first read (or by gc/verify).  Several processes may open one directory at
** once (SQLite's locking, busy_timeout 10 s; DIR/lock keeps gc from taking another process's
** write in flight for an orphan).  With redis_url, the Redis tier's writer thread starts too
** (unless read_only), but nothing connects yet: a Redis that is down is not an error here.
** Errors: KVT_EINVAL (bad params, a malformed redis_url: the message names the value, a URL
** with its password as "***"), KVT_EIO (dir not a writable
** directory, read_only and no store there, or the index cannot be opened or is of a newer
** format: the message names the path and SQLite's error), KVT_ENOMEM.  OUT *out (NULL on
** error; nothing is leaked). */
int kvt_store_open(const struct kvt_store_params *p, kvt_store **out /* OUT */);

/* Write out the queues (waits for the writers; Redis writes each bounded by max(redis_timeout_ms,
** 1 s), dropped at once while Redis is backed off), record pending hits, stop the threads, close.
** Accepts NULL.  Must not run concurrently with other calls on the same store. */
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
    int64_t corrupt;                /* reads that failed the checksum, key or fingerprint check,
                                     ** or found their file missing */
    int64_t errors;                 /* Redis: failed commands and connections (not timeouts) */
    int64_t timeouts;               /* Redis: operations that passed redis_timeout_ms */
};
struct kvt_store_stats {
    struct kvt_store_tier_stats ram, disk;
    int64_t queue_len;                 /* disk writes waiting now */
    struct kvt_store_tier_stats redis; /* zeros without a Redis tier; entries/bytes not filled
                                     ** (kvt_store_redis_info counts them) */
    int64_t redis_queue_len;           /* Redis writes waiting now */
    bool redis_on;                     /* a Redis tier is configured */
    struct kvt_store_prefetch_stats {
        bool on;              /* prefetch threads run */
        int64_t issued;       /* keys queued by kvt_store_prefetch */
        int64_t promoted;     /* of those, read from disk or Redis into RAM */
        int64_t dropped;      /* keys not queued: queue full, or prefetch_bytes unread */
        int64_t skipped;      /* taken but not read (in RAM meanwhile, prefetch_bytes,
                                     ** Redis unreachable, backed off or past its deadline) */
        int64_t absent;       /* taken, and no tier held them */
        int64_t failed;       /* taken and refused (corrupt: also in disk/redis corrupt;
                                     ** no memory; an injected fault) */
        int64_t claimed;      /* still queued when a get asked: the get read them itself */
        int64_t waited;       /* gets that waited for a prefetch of their key in flight */
        int64_t cancelled;    /* taken back before they were read (no longer wanted) */
        int64_t hits;         /* gets served from a promoted block (counted once each) */
        int64_t wasted;       /* promoted blocks evicted or expired before any get */
        int64_t unread_bytes; /* RAM bytes of promoted blocks not read yet */
        int64_t queue_len;    /* keys queued now */
    } prefetch;
    struct kvt_pool_stats priv; /* private entries: sessions' own
                                     ** copies; their RAM bytes count against ram_bytes */
};
/* Counters of this process since open; entries/bytes of the disk tier are the index's (all
** processes').  Cannot fail (zeros for NULL).  Never talks to Redis.  Thread-safe. */
void kvt_store_get_stats(kvt_store *st, struct kvt_store_stats *out /* OUT */);

/* Prefetch: ask for blocks to be read into the RAM tier ahead of the gets that will want them
** (LMCache's prefetch of the chunks following a matched prefix; EdgeSync-LLM's predictor, which
** loads a session's blocks before it resumes).  keys[0..n) (chain keys, in the order they will
** be asked for) are queued for the store's prefetch threads and the call returns: it never
** reads, never waits for I/O, never blocks on a full queue.  A key already in RAM, queued or in
** flight is skipped; one that finds the queue full (prefetch_queue) or prefetch_bytes of
** promoted blocks still unread is dropped (prefetch.dropped).  A thread reads each key as a get
** would, RAM untouched: the disk tier (index row, blob header, checksum; model must match:
** another model's block or a missing one is "absent"), then, on a disk miss, the Redis tier,
** with up to 8 keys per pipelined round trip on one connection (each reply within
** redis_timeout_ms; a timeout ends the batch, counted in redis.timeouts: the rest are skipped
** and their gets ask Redis themselves; a prefetch's failure does not start the tier's backoff).
** The threads run at nice 10 (setpriority on each thread): on a machine whose cores the model's
** decode keeps busy they yield to it.  A block that passes is put into RAM as its most recently
** used entry (evicting least recently used entries as any insert does; prefetch_bytes bounds
** how much of RAM unread promotions can take), marked prefetched until a get reads it
** (prefetch.hits) or it leaves RAM unread (prefetch.wasted); one from Redis is also queued for
** disk.  A block that fails a check is removed as a get would remove it (disk/redis corrupt,
** prefetch.failed) and never promoted.
** Reads count no tier hits or misses (those are the gets'), and record no hit in the index.
** A get of a key whose prefetch is still queued takes it back and reads it itself
** (prefetch.claimed, so the caller and the threads read different blocks at once); of one in
** flight waits for it (prefetch.waited), then reads RAM, or answers KVT_ENOENT at once if the
** prefetch found no tier holding the key: a block is never read twice.  model: the fingerprint
** the blocks must carry.  Returns the number of keys queued (>= 0; 0 also when the store runs
** no prefetch threads).  Errors: KVT_EINVAL (NULL store or model, NULL keys with n > 0, n < 0).
** Thread-safe.  Fault site (tests): KVT__FAULT_STORE_PREFETCH fails a thread's read.  A session
** with a store prefetches the chain of a prompt's full blocks before it asks for them in order
** (kvt_session_sync's routing); `kvtier serve` prefetches the prompts of queued chat requests. */
int kvt_store_prefetch(kvt_store *st, const kvt_key *keys, int n, const kvt_key *model);
/* The prefetch of a prompt: the chain keys of the full blocks of tok[0..n) before its last
** token (the blocks a session's prompt routing asks for, kvt_session_sync; cp: the chain
** parameters, with the tenant the session will use) passed to kvt_store_prefetch.  For a
** caller that has no session yet (a server's queued request).  Returns keys queued.  Errors:
** KVT_EINVAL (NULL st or cp, NULL tok with n > 0, n < 0, cp invalid),
** KVT_ENOMEM.  Thread-safe. */
int kvt_store_prefetch_chain(kvt_store *st, const struct kvt_chain_params *cp, const kvt_token *tok, int32_t n);

/* The Redis tier as the server sees it: keys under this kvtier's prefix ("kvtier:b1:", every
** model's, counted with SCAN, so it costs a pass over the Redis keyspace: for `kvtier store
** stats`, not for every request) and their value bytes (STRLEN of each), and the server's
** used_memory and maxmemory (INFO memory; 0 = no limit).  Waits at most 10 s per command.
** Errors: KVT_EINVAL (NULL arguments, no Redis tier), KVT_EIO (Redis unreachable or answering
** with an error: the message names the host, never the password).  Thread-safe. */
struct kvt_store_redis_info {
    int64_t keys, bytes;            /* keys under our prefix, their value bytes */
    int64_t used_memory, maxmemory; /* the server's, bytes */
    char server[128];               /* "host:port/db" or "unix:path" (no credentials) */
};
int kvt_store_redis_info(kvt_store *st, struct kvt_store_redis_info *out /* OUT */);

/* One entry of the disk tier as `kvtier store ls` shows it. */
struct kvt_store_entry {
    kvt_key key, model;
    int32_t n_tokens, codec;
    int64_t bytes;            /* payload bytes */
    double created, last_hit; /* seconds since the epoch */
    int64_t hits;
    double expires; /* seconds since the epoch (this process's TTL rule) */
};
/* Call cb for every disk entry, most recently hit first (a snapshot of the index taken before
** the first call; cb may call the store); a non-zero return from cb stops and is returned.
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
** down to the quota, files without a row (temporary files of killed writers included).  Waits
** for a write in flight in any process (DIR/lock).  Errors: KVT_EINVAL (read-only, no disk
** tier, NULL out), KVT_EIO, KVT_ENOMEM.  Thread-safe. */
int kvt_store_gc(kvt_store *st, struct kvt_store_report *out /* OUT */);
/* Re-read every file the index names and check its header (magic, version, key, model, size,
** codec, tokens) and payload checksum (docs/STORE.md) against the row; list orphans both ways (rows without a
** file: missing; files without a row: orphans).  With repair, remove what fails (rows and
** files).  Expiry is not looked at (gc's job).  Reads every byte of the tier.
** Errors: KVT_EINVAL (repair on a read-only store, no disk tier, NULL out), KVT_EIO,
** KVT_ENOMEM.  Thread-safe. */
int kvt_store_verify(kvt_store *st, bool repair, struct kvt_store_report *out /* OUT */);
/* Remove every entry of both local tiers (queued writes included).  The Redis tier, shared
** with other servers, is left alone (its keys expire by redis_ttl_s; `redis-cli --scan --pattern
** 'kvtier:b1:*'` lists them).  Errors: KVT_EINVAL (NULL, read-only), KVT_EIO.  Thread-safe. */
int kvt_store_clear(kvt_store *st);

/* ====================================================================================== */
/* 9. Block codecs: self-describing encodings of a block leaving the device               */
/* ====================================================================================== */

/* A codec turns a kvt_blob (section 3) into bytes for a host or disk tier and back: a
** self-describing header ("KVTC", version, codec and parameters, the blob's shape, the SHA-256
** of the payload) and the payload.  Decoding re-assembles a blob that kvt_block_load accepts
** (only K/V values differ for a lossy codec).  Cells below n_sink stay raw in every lossy codec.
**   raw         the blob's bytes, bit-exact (any cache type).
**   q8, q4      KIVI (Liu et al. 2024): keys per channel, values per token, asymmetric min/max
**               groups; |x - x^| <= (max - min) / (2^bits - 1) / 2 (+ F16 rounding); q4 ~0.31x
**               and q8 ~0.56x of raw F16.  Per-head bits (4 or 8) with kvt_codec_params.head_bits.
**   elastic     ElasticKV-style magnitude sparsification per layer, K/V and KV head
**               (tau_h = max(sigma_h / 2, mu_h) x s); a bitmap plus the kept values.
**   elastic+q8  elastic's bitmap, the kept values as q8.
** The byte layout, the error bounds and the per-head table: docs/MANUAL.md, "Block codecs".
** Lossy codecs need F16 or F32 K and V; a quantised cache type (q8_0) is KVT_EUNSUPPORTED (callers
** keep such blocks raw).  All functions of this section are pure: no engine, no shared state,
** callable from any thread (encoding can run off the decode path). */
#define KVT_CODEC_VERSION       1
#define KVT_CODEC_VERSION_HEADS 2 /* a version-1 header followed by the per-head bits table */

enum kvt_codec_id {
    KVT_CODEC_RAW = 0,
    KVT_CODEC_Q8 = 1,
    KVT_CODEC_Q4 = 2,
    KVT_CODEC_ELASTIC = 3,
    KVT_CODEC_ELASTIC_Q8 = 4,
    KVT_CODEC__COUNT
};

struct kvt_codec_params {
    int32_t codec;            /* enum kvt_codec_id */
    int32_t n_head_kv;        /* KV heads per layer (kvt_engine_info.n_head_kv): the elastic codecs'
                        ** thresholds are per head; 0 = one head per row.  Row elements must be
                        ** a multiple of it */
    int32_t group_k;          /* q8/q4/elastic+q8: cells per K group (default 64) */
    int32_t group_v;          /* q8/q4/elastic+q8: channels per V group (default 64) */
    float s_k, s_v;           /* elastic: threshold scales for K and V (defaults 0.45, 0.50) */
    int32_t n_sink;           /* cells with position < n_sink stay raw (attention sinks); default 64
                        ** for the elastic codecs, 0 for q8/q4 */
    const uint8_t *head_bits; /* q8/q4 only ("entropy-sized heads"): NULL = every head in the
                        ** codec's bits (the default); else [n_head_bits] = bits (4 or 8) of each
                        ** (layer, KV head) of the blob, layer-major, layers in blob order (the
                        ** full-attention part's layers, then the sliding-window part's: see
                        ** kvt_engine_layer_part).  n_head_bits must be the blob's layers x
                        ** n_head_kv, and head_dim a multiple of group_v.  The table goes into the
                        ** header (format version KVT_CODEC_VERSION_HEADS), so decoding needs
                        ** nothing else; borrowed (it points into the bytes) */
    int32_t n_head_bits;
};

/* The defaults above for one codec (an unknown id gives raw's).  Cannot fail. */
struct kvt_codec_params kvt_codec_default_params(int32_t codec);

/* Parse a codec spec: NAME[:ARGS], ARGS comma-separated:
**   raw                      no arguments
**   q8[:GK[,GV[,SINK]]], q4[:GK[,GV[,SINK]]] group sizes (cells for K, channels for V), sinks
**   elastic[:SK[,SV[,SINK]]]                 e.g. "elastic:0.45,0.50" or "elastic:0.3,0.3,0"
**   elastic+q8[:SK[,SV[,SINK]]]
** Omitted values keep kvt_codec_default_params(codec); n_head_kv is left 0 (set it from the
** engine).  OUT *out.  Errors: KVT_EINVAL with a message naming the spec and the bad part
** (unknown name, a non-number, a scale outside (0, 10], a group outside 1..65536, a sink
** count outside 0..2^30, too many values).  Pure. */
int kvt_codec_parse(const char *spec, struct kvt_codec_params *out /* OUT */);

/* What encoding measured (optional OUT of kvt_codec_encode). */
struct kvt_codec_stats {
    size_t raw_bytes;     /* blob->size */
    size_t encoded_bytes; /* *n */
    int64_t n_elems;      /* K/V elements the codec saw (0 for raw, which copies bytes) */
    int64_t n_lossy;      /* of them, encoded by the lossy codec (not sinks, not raw) */
    int64_t n_zeroed;     /* of them, pruned to 0 (elastic codecs) */
};

/* Encode a blob.  The blob is read, never modified; it must be a blob of kvt_block_save (or
** kvt_codec_decode), any model.  OUT *out (caller frees with free()), *n bytes; stats (may be
** NULL) filled on success.
** Errors: KVT_EINVAL (NULL argument, bad params: the message names the value; a per-head table
** whose size is not the blob's layers x n_head_kv, an entry not 4 or 8, head_dim not a multiple
** of group_v, a per-head table on a codec other than q8/q4), KVT_EFORMAT
** (the blob does not parse), KVT_EUNSUPPORTED (a lossy codec on a quantised K or V type, or row
** elements not a multiple of n_head_kv: the message names the layer and type; encode raw
** instead), KVT_ENOMEM.  On error *out is NULL.  Pure; thread-safe.
** Cost: linear in the blob (tens to hundreds of MB/s, see docs/BENCHMARKS.md). */
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

/* Decode bytes of kvt_codec_encode into a new blob (loadable with kvt_block_load on an engine
** of the same model and cache types).  The payload's SHA-256 is checked before anything else.
** OUT *out (caller frees with kvt_blob_free).
** Errors: KVT_EFORMAT (foreign magic, other format version, unknown codec id, truncated
** header), KVT_ECORRUPT (payload shorter or longer than its header says, checksum mismatch, or
** a section inconsistent with the header: the message names it), KVT_ENOMEM.  Never reads
** outside data[0..n).  On error *out is NULL.  Pure; thread-safe. */
int kvt_codec_decode(const void *data, size_t n, kvt_blob **out /* OUT */);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_H */
