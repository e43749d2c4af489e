/*
** kvtier_int.h — the library's internal API: functions the files of src/ share with each other
** and the tests call, declared and documented as kvtier.h's are, but not the manual a user reads
** and not exported by libkvtier.so (its version script is generated from kvtier.h's
** declarations, CMakeLists.txt).  Never installed.  Sections follow kvtier.h's numbering; each
** function's types are kvtier.h's.
**
** What moved here (issue #25): functions no caller in server/, cli/ or eval/ uses and that no
** public function's contract is written in terms of — sequence bookkeeping, block loads by
** batch, BM25 scoring, attention block mass and head weights, embeddings and the ANN index, chain
** keys, the store's entries and private entries, prefetch cancel, codec and tier names; then
** (issue #40) sampling at a counted draw, a blob's K rows and ElasticKV on a sequence.  (The
** engine's multi-sequence decode, the
** kvt_session_add with its keep hint and the step-wise generation calls stay in kvtier.h: public
** calls are defined by them.)  The server, the command-line tool and the evaluation are built on
** kvtier.h alone.
*/
#ifndef KVTIER_INT_H
#define KVTIER_INT_H

#include "kvtier.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- 8. Store (kvtier.h section 8) ------------------------------------------ */

/* $XDG_CACHE_HOME/kvtier/store (when absolute), else $HOME/.cache/kvtier/store, into buf[n]
** (kvt_store_params.dir NULL).  Errors: KVT_EINVAL (neither variable set, or n too small; buf is
** "" then). */
int kvt_store_default_dir(char *buf, size_t n);

/* ---- 2. Engine: one llama.cpp model and context (kvtier.h section 2) -------- */

/* True if the token ends a generation (EOS, <end_of_turn>, ...).  Cannot fail. */
bool kvt_token_is_eog(const kvt_engine *eng, kvt_token tok);

/* Highest resident position of a sequence, -1 if empty (full-attention cache on iSWA models)
** or if seq is out of range.  Cannot fail. */
kvt_pos kvt_seq_pos_max(kvt_engine *eng, int32_t seq);

/* KV cells the sequence occupies (tokens), counted from the engine's own bookkeeping; 0 if seq
** is out of range.  Cannot fail. */
int32_t kvt_seq_n_cells(kvt_engine *eng, int32_t seq);

/* kvt_engine_sample with the caller counting the draws: draw is the index of this token in the
** generation on sequence seq (0 for the first; -1: kvt_engine_sample's own).  Each sequence's
** generation has its own generator, one mt19937(s->seed) stream drawn in order (llama.cpp's dist
** sampler, as a llama-server slot's), so a generation is the same alone or batched; a draw other
** than the sequence's next starts the stream again and advances it.  Errors: as kvt_engine_sample,
** and KVT_EINVAL for draw < 0 or seq outside -1 .. n_seq + 2. */
int kvt_engine_sample_at(kvt_engine *eng, const struct kvt_sampling *s, int32_t seq, int64_t draw, kvt_token *tok /* OUT */);

/* The repetition-penalty window of s in tokens (struct kvt_sampling.penalty_last_n; 0 there: 64,
** llama-server's repeat_last_n), or 0 when s sets no penalty.  Pure. */
static inline int32_t kvt_penalty_window(const struct kvt_sampling *s) {
    const bool on = s &&
                    ((s->repeat_penalty > 0 && s->repeat_penalty != 1.0f) || s->frequency_penalty != 0 || s->presence_penalty != 0);
    return !on ? 0 : s->penalty_last_n > 0 ? s->penalty_last_n : 64;
}

/* The DRY window of s in tokens (dry_penalty_last_n; 0 there: 64), or 0 when s sets no DRY (or sets
** Mirostat, whose chain has none).  Pure. */
static inline int32_t kvt_dry_window(const struct kvt_sampling *s) {
    const bool on = s && s->dry_multiplier > 0 && s->mirostat != 1 && s->mirostat != 2;
    return !on ? 0 : s->dry_penalty_last_n > 0 ? s->dry_penalty_last_n : 64;
}

/* The history a draw of s reads (struct kvt_sampling.history): the longer of the two windows.  Pure. */
static inline int32_t kvt_history_window(const struct kvt_sampling *s) {
    const int32_t p = kvt_penalty_window(s), d = kvt_dry_window(s);
    return p > d ? p : d;
}

/* ---- 3. Block primitives (kvtier.h section 3) ------------------------------- */

/* Parse a blob's K rows of one layer to F32 (for verification and host-side scoring).
** part: 0 = full-attention cache, 1 = sliding-window cache.  il: layer index within the part.
** OUT *k: [n_cells * row] floats (caller frees with free()), *pos: [n_cells] (caller frees),
** *n_cells, *row_elems.  Errors: KVT_EFORMAT, KVT_EUNSUPPORTED (quantised K), KVT_ENOMEM. */
int kvt_blob_k_rows(const kvt_engine *eng, const kvt_blob *blob, int part, int il, float **k, kvt_pos **pos, int32_t *n_cells,
                    int32_t *row_elems);

/* Live ElasticKV: magnitude pruning of a sequence's resident K/V.
** Source: ElasticKV (a CUDA patch of llama.cpp; "attention haze" removal): per layer, K and V
** apart, and per KV head h, mu_h and sigma_h are the mean and (population) standard deviation
** of |x| over the head's elements of the cells being thresholded, and
**     tau_h = max(sigma_h / 2, mu_h) * s          (s = s_k for K, s_v for V)
** every such element with |x| < tau_h is set to 0.  The same computation as the elastic block
** codec (section 9; one shared implementation, src/kv/codec_tensor.c kvt__elastic_tau).
** Which elements: the cells of the sequence whose position is in [p0, p1), in both parts of an
** iSWA cache (the sliding-window part holds only the window's cells).  Cells outside [p0, p1)
** (the attention sinks before p0, the tail from p1) are neither thresholded nor counted in
** mu/sigma, and come back bit-identical.  Elements already 0 (earlier passes) ARE counted in
** mu/sigma, as the source design thresholds the dense cache as it is: a pass over an already
** pruned range lowers mu, so repeated passes do not ratchet the sparsity up (a second pass on
** unchanged cells zeroes nothing new unless sigma grew).
** IMPORTANT: the zeros stay in llama.cpp's dense cache and save no memory there.  What a pass
** buys is measured quality at a given sparsity (docs/EVALUATION.md "Live ElasticKV"); the tier
** codecs (section 9) turn sparsity into bytes. */
struct kvt_elastic_params {
    float s_k, s_v;    /* threshold scales, >= 0; 0 leaves that tensor kind untouched.  The
                        ** source design's sweet spot: s_k = 0.45, s_v = 0.50 */
    kvt_pos p0, p1;    /* positions thresholded: [p0, p1) (p0 = attention sinks, e.g. 64;
                        ** p1 = start of the protected tail) */
    bool random;       /* control (matched-random zeroing): per layer, tensor and head, the pass
                        ** computes tau_h as above, counts the elements it would leave 0, and
                        ** instead zeroes that many elements of [p0, p1) chosen uniformly at
                        ** random (elements already 0 count towards it), so the head's zero count
                        ** equals the threshold's */
    float random_frac; /* random with random_frac in (0, 1]: instead of the threshold's count,
                        ** each head's zeros in [p0, p1) are brought up to round(random_frac x its
                        ** elements there) (never fewer than already are).  Repeated passes then
                        ** hold a fixed sparsity, where matching the count pass by pass would
                        ** ratchet it up: tau over a randomly thinned range still counts the small
                        ** elements random zeroing spared.  0 = match the threshold's count */
    uint64_t seed;     /* random: seed of the choice (splitmix64) */
};

/* What one pass saw and did (OUT of kvt_seq_elastic); element = one K or V scalar of one cell
** in one layer. */
struct kvt_elastic_stats {
    int64_t n_elems;         /* K and V elements of all the sequence's cells, all layers, both
                              ** parts (sinks and tail included) */
    int64_t n_zero;          /* of them equal to 0 after the pass */
    int64_t n_eligible;      /* of them in cells with position in [p0, p1) */
    int64_t n_zero_eligible; /* of those equal to 0 after the pass */
    int64_t n_zeroed;        /* elements this pass changed from non-zero to 0 */
    double ms;               /* wall time of the pass (read, threshold, write back) */
};

/* Threshold the resident K/V of sequence seq in place (ElasticKV, above): reads the whole
** sequence state (llama_state_seq_get_data; a pending K-shift is applied first), zeroes on the
** host, and writes it back with llama_state_seq_set_data, the sequence emptied first.  Nothing
** is written when no element changes (s_k = s_v = 0 or nothing below tau).
** Unified cache: cells the sequence shared with other sequences (kvt_seq_cp) become its own
** copies, the others keep the unpruned ones (the write-back needs free cells for them).
** Cost: one read and one write of the sequence's whole K/V (all layers), O(cells x row).
** OUT *st (may be NULL).  Errors: KVT_EINVAL (seq, negative or non-finite scale, p0 > p1),
** KVT_EUNSUPPORTED (a quantised K or V cache type), KVT_ENOMEM, KVT_ELLAMA (llama.cpp rejected
** the write: the sequence's previous state is written back, bit-identical).  On every error the
** sequence's K/V is unchanged (unless putting it back failed too, which the message says).
** Not thread-safe (engine rule). */
int kvt_seq_elastic(kvt_engine *eng, int32_t seq, const struct kvt_elastic_params *p, struct kvt_elastic_stats *st /* OUT */);

/* Load n saved blocks into sequence seq at positions new_p0[i] (ascending, each block past the
** previous one and past every resident position), re-anchoring each block whose position
** changes.  What a prefix found in a block store needs: streams mode on the HOST path assembles
** the sequence's cells and all n blocks on the host and writes them with ONE
** llama_state_seq_set_data (k blocks one by one would rewrite the sequence k times); sliding-
** window cells older than the final window are dropped, so a chain of blocks that each carry
** their own SWA cells gives the last window exactly.  Other modes load them one by one.
** All or nothing: on error the sequence holds what it held before.
** Errors: those of kvt_block_load (KVT_EINVAL also for order or overlap, naming the block). */
int kvt_blocks_load(kvt_engine *eng, const kvt_blob *const *blobs, int32_t n, int32_t seq, const kvt_pos *new_p0);

/* ---- 5. Session: one conversation under a token budget (kvtier.h section 5) ---- */

const char *kvt_recovery_name(int32_t recovery);

/* Okapi BM25 (Robertson & Zaragoza 2009), k1 = 1.2, b = 0.75:
** Scores n_docs texts against a query: lower-cased alphanumeric terms, English stop words
** removed, idf = ln(1 + (N - df + 0.5) / (df + 0.5)).  OUT scores[n_docs].
** Errors: KVT_ENOMEM.  Pure function; thread-safe. */
int kvt_bm25_score(const char *const *docs, int32_t n_docs, const char *query, double *scores /* OUT */);

/* The query's terms (same analysis as kvt_bm25_score: lower-cased, stop words dropped, each once)
** that occur in none of the n_context texts, joined by single spaces; "" when every term is
** covered.  Session recovery scores evicted blocks with this query, so that a block comes back
** for what the resident context lacks (a needle's name), not for words the resident context
** already holds (the question's own phrasing in earlier turns).  OUT *out: caller frees with
** free().  Errors: KVT_ENOMEM.  Pure function; thread-safe. */
int kvt_bm25_novel_terms(const char *query, const char *const *context, int32_t n_context, char **out /* OUT */);

/* ---- 6. Signals: attention mass per block, entropy (kvtier.h section 6) ----- */

/* Attention mass per block from one captured layer (the H2O / SnapKV signal): for query rows
** [q_from, a->n_query) and every head h, each row's weights (which sum to 1) times head_w[h]
** are added to the block that holds the key position; the total is divided by the number of
** rows times the sum of head weights, so the result over all blocks sums to <= 1 (keys outside
** every block are not counted).  head_w: [a->n_head] non-negative weights, NULL = equal (e.g.
** from an entropy profile, see kvt_head_weights_load).  Blocks are given as half-open ranges
** [p0[i], p0[i] + n[i]), in any order, non-overlapping.
** OUT mass[n_blocks] (overwritten).  Errors: KVT_EINVAL (q_from out of range).  Pure. */
int kvt_attn_block_mass(const kvt_attn *a, int32_t q_from, const float *head_w, const kvt_pos *p0, const int32_t *n,
                        int32_t n_blocks, double *mass /* OUT */);

/* Head weights from a `kvtier calibrate` profile (JSON): for each of the n_layers layers in
** layers[], n_head weights w = (1 / H) / mean over the layer's heads of (1 / H), H the head's
** mean entropy in bits (floored at 0.05): focused heads, whose attention singles out tokens,
** count more than diffuse ones.  OUT w[n_layers * n_head], row-major by layers[] order.
** Errors: KVT_EIO (unreadable file), KVT_EFORMAT (not a profile, or a layer/head missing: the
** message names it).  Pure apart from reading the file. */
int kvt_head_weights_load(const char *profile_path, const int32_t *layers, int32_t n_layers, int32_t n_head, float *w /* OUT */);

/* ---- 7. Optional dense retrieval: embeddings through llama.cpp, approximate nearest neighbours (kvtier.h section 7) ---- */

int32_t kvt_embedder_dim(const kvt_embedder *em); /* embedding width (floats); 0 for NULL */

/* Embed UTF-8 text: mean-pooled over its tokens, L2-normalised, written to out[dim].  Text
** longer than n_ctx tokens is cut to its first n_ctx tokens.  Errors: KVT_EINVAL (empty text
** or no tokenizer), KVT_ELLAMA. */
int kvt_embedder_embed(kvt_embedder *em, const char *text, float *out /* OUT [dim] */);

/* dim: vector width; capacity: initial element count (grows by doubling).  m / ef_search <= 0:
** defaults.  Errors: KVT_EINVAL, KVT_ENOMEM. */
int kvt_ann_open(int32_t dim, int32_t capacity, int32_t m, int32_t ef_search, kvt_ann **out);

void kvt_ann_free(kvt_ann *ann); /* accepts NULL */

/* Add or replace id's vector (normalised inside).  Errors: KVT_EINVAL (NULL/zero vector),
** KVT_ENOMEM. */
int kvt_ann_add(kvt_ann *ann, uint64_t id, const float *v);

/* Remove id (marked deleted; never returned again).  Errors: KVT_ENOENT. */
int kvt_ann_remove(kvt_ann *ann, uint64_t id);

/* The k nearest ids to q by cosine, best first.  OUT ids[k], sims[k] (cosine in [-1, 1]),
** *n_found <= k (fewer when the index holds fewer).  Errors: KVT_EINVAL. */
int kvt_ann_search(kvt_ann *ann, const float *q, int32_t k, uint64_t *ids, float *sims, int32_t *n_found);

/* Number of live (not removed) elements; 0 for NULL.  Cannot fail. */
int32_t kvt_ann_size(const kvt_ann *ann);

/* ---- 8. Block store: content-addressed KV blocks in tiers (RAM -> disk -> Redis), across (kvtier.h section 8) ---- */

/* h_0 of the chain.  Errors: KVT_EINVAL (NULL layout, block <= 0), KVT_ENOMEM (OpenSSL could
** not allocate a digest context). */
int kvt_chain_root(const struct kvt_chain_params *p, kvt_key *out /* OUT */);

/* h_i from h_{i-1} and block i's n tokens (out may be prev).  Errors: KVT_EINVAL (NULL prev or
** out, n < 0, NULL tok with n > 0), KVT_ENOMEM (as kvt_chain_root); *out is unchanged then. */
int kvt_chain_next(const kvt_key *prev, const kvt_token *tok, int32_t n, kvt_key *out /* OUT */);

/* Root of the chunk keys (non-prefix chunk reuse, kvt_session_params.chunk_reuse): the same
** inputs as kvt_chain_root behind another domain string,
**   c_0 = SHA-256("kvtier-chunk" | format version | model fingerprint | layout | block | tenant)
** and a block's chunk key is kvt_chain_next(c_0, its tokens): it names a block by its own tokens
** only, so the same tokens anywhere give the same key; no chunk key equals a chain key (other
** domain string).  Errors: those of kvt_chain_root. */
int kvt_chunk_root(const struct kvt_chain_params *p, kvt_key *out /* OUT */);

/* Parse exactly 64 hex digits (either case).  Errors: KVT_EINVAL (message names the text). */
int kvt_key_parse(const char *hex, kvt_key *out /* OUT */);

/* "none", "ram", "disk", "redis" (static; "unknown" out of range).  Pure. */
const char *kvt_tier_name(int tier);

/* Store a copy of data[0..n) under key: into the RAM tier now (LRU eviction within ram_bytes;
** a block larger than ram_bytes skips RAM, counted in ram.writes_dropped), and queued for the
** disk tier (write-behind by the writer thread: temp file + fsync + rename + fsync of the
** directory, then the index row; a write that would pass disk_bytes evicts first).  Never
** blocks on disk: a full queue, a block larger than the quota, or a failed write (a full disk,
** an I/O error, the index) drops the disk write (disk.writes_dropped), never an error here.
** A key already stored (RAM, queue or index) is not rewritten (content-addressed: same key,
** same bytes), except that a block the RAM tier holds whose disk write was dropped at a full
** queue is queued again; put never updates hit counts.  With a Redis tier, a block new to RAM
** is also queued for the Redis writer thread (its own bounded queue, redis_queue_max; full,
** Redis down or refusing: redis.writes_dropped), never waited for.
** Errors: KVT_EINVAL (NULL store, key or meta; NULL data with n > 0; negative n_tokens;
** read-only store), KVT_ENOMEM (the RAM copy may be stored, the disk write is not queued).
** Thread-safe. */
int kvt_store_put(kvt_store *st, const kvt_key *key, const struct kvt_store_meta *m, const void *data, size_t n);

/* Fetch key's bytes: RAM tier, else disk tier (its write queue, then the index and the blob
** file; a disk hit is copied into RAM).  A disk read checks the file's header (magic, version,
** key, model, size, codec, tokens) against the index row and the payload's checksum against
** both: a mismatch, a truncated or a missing file is never returned: the entry is removed,
** counted in disk.corrupt, and the get is a miss.  model must equal the stored block's model
** fingerprint, else the get is a miss counted in corrupt (the entry, intact, stays for its own
** model).  A hit updates last-hit time and hit count (RAM at once; the index through the writer
** thread, in batches: a get never waits for an index write).  With a Redis tier, a local miss
** asks Redis within redis_timeout_ms: the value is checked as a blob file is (header key and
** model, size, checksum; a bad one is counted in redis.corrupt, deleted, a miss); a hit is
** copied into RAM and queued for disk (*tier KVT_TIER_REDIS); a timeout or error is a miss
** (counted; the tier then backs off 100 ms doubling to 5 s, each get meanwhile a miss at once).  OUT *data (free()), *n (bytes),
** *meta, *tier (meta and tier may be NULL).
** Errors: KVT_ENOENT (miss, expired, corrupt, foreign model: callers prefill instead; the
** message says which), KVT_EINVAL (NULL store, key, model, data or n), KVT_ENOMEM, KVT_EIO (the
** index cannot be read).  On error *data is NULL and *n 0.  Thread-safe. */
int kvt_store_get(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data, size_t *n, struct kvt_store_meta *meta,
                  enum kvt_tier *tier);

/* kvt_store_get without the copy out: *data points into a buffer the store shares (the RAM
** tier's entry, a queued write, a disk read that RAM keeps too), held by the reference *ref until
** kvt__store_ref_free(*ref); read-only.  A session's load of store blocks uses it (what a warm
** prompt costs is these bytes' trip into the KV cache, not their copies).  Same errors; on error
** *data and *ref are NULL.  Thread-safe. */
int kvt__store_get_ref(kvt_store *st, const kvt_key *key, const kvt_key *model, const void **data, size_t *n,
                       struct kvt_store_meta *meta, void **ref);
void kvt__store_ref_free(void *ref); /* accepts NULL */

/* Is key in RAM or on disk and not expired (no file read, no checksum, no hit counted; Redis is
** not asked)?  False for NULL arguments.  Thread-safe. */
bool kvt_store_has(kvt_store *st, const kvt_key *key);

/* Where key's bytes are, whatever their age (expired entries count until something removes
** them): KVT_TIER_RAM (the RAM tier, or its write queued for disk), KVT_TIER_DISK (the index),
** KVT_TIER_NONE (neither; NULL arguments).  What kvt_store_get_copy would find locally.
** Thread-safe. */
int kvt_store_tier(kvt_store *st, const kvt_key *key);

/* A session's own copy of one of its blocks (kvt_session_params.store): kvt_store_get with the
** TTL not applied, so an entry past its TTL that no get, gc or quota has removed yet is still
** returned (age does not change K/V; the TTL governs reuse by lookups).  A hit refreshes the
** entry (last hit, hit count) as any hit does.  A session parked longer than the TTL resumes its
** pure blocks without recompute unless the entry went meanwhile.  Errors: as kvt_store_get.
** Thread-safe. */
int kvt_store_get_copy(kvt_store *st, const kvt_key *key, const kvt_key *model, void **data /* OUT */, size_t *n /* OUT */);

/* Private entries: the copies a session keeps of its blocks that no content key may name (a
** block decoded after an eviction attended to a context with a hole; one recomputed or re-saved
** at another position, or encoded with a lossy codec_ram, is not a cold prefill's K/V), and of
** its pure blocks when their content entry could not be written.  A session with a store keeps
** every block copy here or under its chain key, so the store replaces the session's host pool
** (section 4): one RAM budget, one set of tiers (docs/STORE.md "Sessions and the store").
** They are the host pool's entries (kvt_pool_put / _get / _del semantics; the store owns the
** pool): RAM within ram_bytes, shared with the content RAM tier, private entries first (the
** content tier evicts its least recently used entries to give them room, the pool spills its
** own least recently used ones to checksummed files once ram_bytes is theirs); spill files in a
** private directory under $TMPDIR or in private_dir (never fsync'd, removed at close; a dead
** process's by the next pool or store opened with that $TMPDIR), at most private_disk_bytes.  They
** never expire, are never written to the index or to Redis, never found by kvt_store_get, and
** not listed, verified, gc'd or cleared: they belong to a live session, which deletes them.
** key: the caller's 64-bit name, unique among the store's users (a session uses its process-
** unique serial and the block's id).  A read-only store takes them too (nothing goes to DIR).
** put errors: those of kvt_pool_put (KVT_EIO: a spill failed, the entries it was for are
** dropped, counted in stats.priv.n_dropped); get: those of kvt_pool_get (KVT_ENOENT, KVT_ECORRUPT,
** KVT_EIO, KVT_ENOMEM); del: KVT_ENOENT.  KVT_EINVAL for a NULL store.  Thread-safe. */
int kvt_store_put_private(kvt_store *st, uint64_t key, const void *data, size_t n);

int kvt_store_get_private(kvt_store *st, uint64_t key, void **data /* OUT, free() */, size_t *n /* OUT */);

int kvt_store_del_private(kvt_store *st, uint64_t key);

/* Where a private entry is: KVT_TIER_RAM, KVT_TIER_DISK (spilled), KVT_TIER_NONE (absent,
** dropped, or NULL store).  Thread-safe. */
int kvt_store_private_tier(kvt_store *st, uint64_t key);

/* The private entries' counters (kvt_store_get_stats's priv, without the index query the rest
** of it costs).  Zeros for NULL.  Thread-safe. */
void kvt_store_private_stats(kvt_store *st, struct kvt_pool_stats *out /* OUT */);

/* Wait until every queued disk and Redis write is done and every pending hit is in the index (tests,
** shutdown, `kvtier store`).  Returns at once without a writer (read-only, no disk tier).
** Thread-safe. */
void kvt_store_flush(kvt_store *st);

/* Take back every key still queued (not those in flight; prefetch.cancelled).  Returns how many.
** NULL ok.  Thread-safe. */
int kvt_store_prefetch_cancel(kvt_store *st);

/* Take back the queued (not yet started) prefetches of the keys in keys[0..n): for a caller that
** will not ask for them after all (a session's routing whose chain broke at an earlier miss, so
** the threads do not look up keys no tier holds).  Returns how many were taken back (counted in
** prefetch.cancelled); 0 for NULL st or keys, n <= 0, or a store without prefetch threads.  O(queue
** length x n).  Thread-safe. */
int kvt_store_prefetch_forget(kvt_store *st, const kvt_key *keys, int n);

/* ---- 9. Block codecs: self-describing encodings of a block leaving the device (kvtier.h section 9) ---- */

/* "raw", "q8", "q4", "elastic", "elastic+q8", "elastic+q4", "ecq" (static; "unknown" out of range).  Pure. */
const char *kvt_codec_name(int32_t codec);

/* Read and check the header (magic, version, codec id, sizes, the per-head table's size and
** entries; not the checksum).  out->params.head_bits points into data when the bytes have a
** per-head table (valid while data is).
** Errors: KVT_EFORMAT (not kvtier codec bytes, truncated header, another format version, an
** unknown codec id, a per-head table of another size than the header says or with an entry not
** 4 or 8: the message names the value).  Pure. */
int kvt_codec_inspect(const void *data, size_t n, struct kvt_codec_info *out /* OUT */);

/* Check codec params as kvt_codec_encode does before it reads a blob (id, groups, scales, the
** per-head table: q8/q4 only, a multiple of n_head_kv entries, each 4 or 8).  0 or KVT_EINVAL
** (the message names the value).  Lets a tier refuse bad params at open, not at its first write. */
int kvt__codec_check(const struct kvt_codec_params *p);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_INT_H */
