/* reuse.c — a prompt's prefix from the content-addressed block store (section 8 of kvtier.h).
**
** A block's chain key (index.c) names the K/V a cold prefill of the token stream from position 0
** gives (vLLM's prefix caching and LMCache key blocks the same way).  A session's block i carries that
** K/V exactly while the session is "chain-pure": every block before it was resident at its
** original position when it was decoded or loaded.  The first eviction ends that: a block decoded
** after it attended to a context with a hole, and its K/V belong to no prefix.  So the session
** keeps `chain_ok` from open until the first eviction, recovery, compaction or early seal, stores
** each full block it seals while pure (write-behind: kvt_store_put copies and returns), and before
** a prompt is prefilled looks its full blocks up in order: the found prefix is loaded with
** kvt_blocks_load (one state write, no forward pass) and recorded like decoded tokens (sealed,
** saved to the pool for its own recovery later), the rest is decoded.  The last prompt token is
** always decoded: its logits start the reply.
**
** Gemma 3's sliding-window cells: each block is saved right after it is decoded, with the SWA
** cells of its own positions; a prefix of k blocks loaded together keeps the cells of the last
** n_swa positions (kvt_blocks_load drops the older ones), which the last blocks of the chain carry
** (tests/unit/test_reuse.c checks the logits after such a load against a cold prefill). */
#include "session/session_int.h"
#include "fault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *kvt_route_name(int route) {
    static const char *const names[] = { "none", "miss", "partial", "exact" };
    return route >= 0 && route < 4 ? names[route] : "unknown";
}

int kvt__sess_route(kvt_session *s, const kvt_token *tok, int32_t n, int role, int32_t *used) {
    *used = 0;
    const int32_t B = s->p.block;
    /* at a block boundary of a pure stream, with at least one full block before the last token */
    if (!s->p.store || !s->reuse.chain_ok || s->open >= 0 || s->next_pos != s->total || s->total % B != 0 || n <= B) return 0;
    if (!kvt__sess_roots(s)) return 0;
    const int32_t i0 = s->n_b;
    if (i0 > 0 && !s->b[i0 - 1].has_ckey) return 0;
    const int32_t want = (n - 1) / B;
    s->reuse.route_want += want * B;
    s->reuse.route_want_all += want * B;
    /* what fits the budget beside what is resident, leaving a block of room for the rest: loaded
    ** blocks that had to be evicted at once would only cost a copy */
    int32_t k_max = KVT_MIN(want, (s->p.budget - kvt__sess_resident(s) - B) / B);
    if (k_max <= 0) return 0;
    const double t0 = kvt__now_ms();
    kvt_blob *blobs = calloc((size_t) k_max, sizeof *blobs);
    const kvt_blob **bp = calloc((size_t) k_max, sizeof *bp);
    void **refs = calloc((size_t) k_max, sizeof *refs); /* the store's buffers the blobs point into */
    int32_t found = 0;
    int rc = 0;
    kvt_key *keys = NULL;
    if (!blobs || !bp || !refs) {
        rc = kvt__fail(KVT_ENOMEM, "store lookup of %d blocks", k_max);
        goto out;
    }
    /* the keys first: all k_max blocks are prefetched (kvt_store_prefetch: the store's threads
    ** read them from disk or Redis, a Redis batch pipelined, while this thread takes back and
    ** reads the ones still queued), then asked for in order.  Block 0 too: a get of block 0
    ** racing the threads' pipelined batches for a loaded Redis missed its deadline in the
    ** measurements (docs/BENCHMARKS.md "Block store prefetch"), and a miss at block 0 costs the
    ** whole prompt's prefill; in a batch it comes first, and a prefetch that is not answered in
    ** time leaves the get its own try */
    keys = malloc(sizeof *keys * (size_t) k_max);
    if (!keys) {
        rc = kvt__fail(KVT_ENOMEM, "store lookup of %d blocks", k_max);
        goto out;
    }
    for (int32_t j = 0; j < k_max; j++)
        kvt_chain_next(j ? &keys[j - 1] : i0 > 0 ? &s->b[i0 - 1].ckey : &s->reuse.root, tok + (size_t) j * B, B, &keys[j]);
    if (k_max > 1) { /* nothing happens when the store runs no prefetch threads */
        kvt_store_prefetch(s->p.store, keys, k_max, &s->reuse.model_fp);
        kvt__clear_error();
    }
    int32_t j = 0;
    for (; j < k_max; j++) {
        const kvt_key key = keys[j];
        const void *data = NULL;
        size_t sz = 0;
        struct kvt_store_meta m;
        if (kvt__store_get_ref(s->p.store, &key, &s->reuse.model_fp, &data, &sz, &m, &refs[found])) break;
        blobs[found] = (kvt_blob){ (void *) data, sz, (i0 + j) * B, B, B, 0 }; /* read-only: loaded, never written */
        if (m.n_tokens != B || m.codec != 0) break;                            /* freed below with the others */
        bp[found] = &blobs[found];
        found++;
    }
    if (j + 1 < k_max) kvt_store_prefetch_forget(s->p.store, keys + j + 1, k_max - j - 1); /* the chain broke at j */
    kvt__clear_error();
    if (found == 0) goto out;
    if ((rc = kvt__sess_reserve_positions(s, found * B))) goto out;
    /* the blocks seal with the bytes just loaded (pool copies for this session's recovery; their
    ** keys are in the store, so nothing is written twice) */
    if ((rc = kvt__sess_load_run(s, bp, found, tok, role, false, used)) || *used == 0) goto out;
    s->reuse.route_tokens += found * B;
    s->reuse.route_tokens_all += found * B;
    s->st.store_tokens += found * B;
out:
    for (int32_t q = 0; refs && q <= found && q < k_max; q++) kvt__store_ref_free(refs[q]);
    free(refs);
    free(blobs);
    free(bp);
    free(keys);
    s->st.store_ms += kvt__now_ms() - t0;
    kvt__sess_explain(s, "store prefix: %d blocks wanted, %d fit the budget, %d found, %d tokens loaded (%.1f ms)", want, k_max,
                      found, *used, kvt__now_ms() - t0);
    return rc;
}

int kvt__sess_load_run(kvt_session *s, const kvt_blob **bp, int32_t found, const kvt_token *tok, int role, bool moved,
                       int32_t *loaded) {
    const int32_t B = s->p.block;
    *loaded = 0;
    kvt_pos *p0 = malloc(sizeof *p0 * (size_t) found);
    if (!p0) return kvt__fail(KVT_ENOMEM, "loading %d blocks", found);
    for (int32_t q = 0; q < found; q++) p0[q] = s->next_pos + q * B;
    int rc = moved && kvt__fault_check(KVT__FAULT_CHUNK_LOAD) ? kvt__fail(KVT_ELLAMA, "chunk load (injected fault)")
                                                              : kvt_blocks_load(s->eng, bp, found, s->p.seq, p0);
    free(p0);
    if (rc) { /* all or nothing: nothing was loaded, the tokens go through the model instead */
        if (moved)
            fprintf(stderr, "kvtier: a reused chunk of %d blocks could not be loaded, decoded instead: %s\n", found, kvt_errmsg());
        else
            fprintf(stderr, "kvtier: %d blocks found in the store could not be loaded, prefilled instead: %s\n", found,
                    kvt_errmsg());
        kvt__clear_error();
        if (moved) s->st.chunk_load_errors++;
        else s->st.store_load_errors++;
        return 0;
    }
    if (moved) kvt__sess_chain_off(s); /* from here on the KV is not a cold prefill's: no more chain keys */
    const int32_t first = s->n_b;
    s->reuse.preload = bp;
    s->reuse.n_preload = found;
    s->reuse.preload_moved = moved;
    rc = kvt__sess_record(s, tok, found * B, role);
    s->reuse.preload = NULL;
    s->reuse.n_preload = 0;
    s->reuse.preload_moved = false;
    if (rc) return rc;
    if (moved)
        for (int32_t i = first; i < s->n_b; i++) s->b[i].info.from_chunk = true;
    kvt__sess_note_peak(s);
    *loaded = found * B;
    return 0;
}
