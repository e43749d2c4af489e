/* test_hooks.h — switches and probes that exist only for kvtier's own tests.  Never installed and
** not API: libkvtier.so does not export them (cmake/libkvtier.map); the tests link the static
** library and find this header on their include path (src/). */
#ifndef KVT_TEST_HOOKS_H
#define KVT_TEST_HOOKS_H

#include "kvtier.h"

#include <stdbool.h>

/* The control case of tests/unit/test_primitives.c: while skip is true, kvt_block_save no longer
** forces a pending K-shift (SEQ_ADD path) before saving, so it saves stale K and a restored block
** differs from a recomputed one; the test asserts that its exactness check notices.  Never set
** outside that test.  Cannot fail.  Not thread-safe (engine rule). */
void kvt_engine_set_unsafe_skip_shift_flush(kvt_engine *eng, bool skip);

/* True while a K-shift made by llama_memory_seq_add is still pending (llama.cpp applies it at the
** next llama_decode): the control case checks its setup left one.  Cannot fail. */
bool kvt_engine_shift_pending(const kvt_engine *eng);

/* tests/unit/test_attention.c: kvt_attn_get maps softmax columns to positions from llama.cpp's
** cell records alone, falling back to a whole snapshot when they do not parse.  on: always the
** snapshot (the reference the fast path is compared with).  snapshots: the fallbacks so far.
** Cannot fail.  Not thread-safe (engine rule). */
void kvt_engine_test_cell_pos_snapshot(kvt_engine *eng, bool on);
int64_t kvt_engine_test_cell_pos_snapshots(const kvt_engine *eng);

/* tests/unit/test_tokenize.c: kvt_tokenize's memo of recent tokenizations (src/engine/text.c).
** mode 0: on (the default); 1: off, every text tokenized whole (the reference); 2: the unsafe
** control that cuts after any token, not only after the control tokens llama.cpp cuts a text at;
** 3: the unsafe control that skips the check for a special token's text across a cut.  The test
** asserts that both controls give other tokens than the reference on its texts.  Empties the
** memo.  Not thread-safe
** with kvt_tokenize.  memo_tokens: tokens taken from the memo, over the engine's life. */
void kvt_engine_test_tokenize_memo(kvt_engine *eng, int mode);
int64_t kvt_engine_test_memo_tokens(const kvt_engine *eng);

/* tests/unit/test_conversation.c's DRY test: mode 1 gives every set of DRY sequence breakers one hash, so
** that the engine's DRY samplers (src/engine/decode.c apply_dry) are told apart by the breakers' bytes
** alone; 2 is the unsafe control that then also skips the byte compare (a sampler made for other
** breakers is reused), which the test asserts it notices; 0: off.  Not thread-safe (engine rule). */
void kvt_engine_test_dry_hash(kvt_engine *eng, int mode);
/* DRY samplers the engine made, over its life (a made one maps its breakers over the vocabulary).
** Cannot fail. */
int64_t kvt_engine_test_dry_made(const kvt_engine *eng);

/* tests/unit/test_conversation.c: prompt tokens the session took from its caller's tokens
** (kvt_session_prefill's tok) instead of tokenizing them, over its life.  Cannot fail. */
int64_t kvt_session_test_given_tokens(const kvt_session *s);

/* The control of tests/unit/test_recovery.c's resident-half test: while on, a resident block the
** message is about never brings back the evicted block after it (session/recovery.c
** resident_hit_successors); the novel-term recovery is unchanged. */
void kvt_session_test_no_resident_successors(kvt_session *s, bool on);

/* The failed-load tests of tests/unit/test_streams.c: the next whole-sequence write
** (llama_state_seq_set_data of kvt_block_load, kvt_seq_cp or a host kvt_seq_shift; in unified mode
** the scratch load of kvt_block_load) gets another K type in the last layer of cache part `part`
** (0 full attention, 1 sliding window), which llama.cpp rejects after clearing that part.  The
** test checks that the target sequence is left exactly as it was.  part < 0: off.  Fires once. */
void kvt_engine_set_unsafe_corrupt_next_load(kvt_engine *eng, int part);

/* The block store's tests (tests/unit/test_store*.c): a fake "now" in epoch seconds for every TTL
** decision, created and last-hit time of the store (0 = the real clock again), so expiry and hot
** promotion are tested without waiting.  Thread-safe. */
void kvt_store_test_set_clock(kvt_store *st, double now);

/* Called by the store's removal of a corrupt entry (kvt__store_remove) after its index row is
** deleted and before its file is unlinked: tests/unit/test_store.c's race test puts a fresh copy
** of the same key there, which the unlink must not take.  cb NULL: off.  Not thread-safe with
** removals in flight. */
void kvt_store_test_on_remove(kvt_store *st, void (*cb)(void *ud), void *ud);

/* While hold is true the store's writer thread takes nothing from its queue (puts still queue,
** then drop when the queue is full): the full-queue test.  kvt_store_flush waits forever while
** held; kvt_store_free releases the hold.  Thread-safe. */
void kvt_store_test_hold_writer(kvt_store *st, bool hold);

/* The control of the kill -9 test (tests/unit/test_store_faults.c): while on, the writer writes
** the index row first and then the blob file in place under its final name (no temporary file,
** no fsync, a 2 ms pause halfway): the order the store exists to avoid.  The test asserts that
** killing such a writer leaves rows whose file is missing or torn, which verify finds.  Never set
** outside that test.  Thread-safe. */
void kvt_store_test_unsafe_write_order(kvt_store *st, bool on);

/* tests/unit/test_codec.c: while on, q8/q4 sections without per-head bits are coded by the
** generic per-group coder (the one elastic+q8 uses) instead of codec_kern.c's kernels, so the test
** compares both coders' bytes and decoded tensors.  Cannot fail.  Not thread-safe. */
void kvt_codec_test_generic(bool on);

#endif
