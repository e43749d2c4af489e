/* chunks.c — non-prefix chunk reuse (kvt_session_params.chunk_reuse, issue #12).
**
** RAG prompts put the same documents in different orders, so a document's blocks are rarely a
** prefix the chain keys (session/reuse.c) can find.  EPIC (Hu et al. 2024, "position-independent
** context caching") and CacheBlend (Yao et al. 2025) reuse a chunk's KV wherever it stands and
** recompute a few tokens to repair the cross-chunk attention it lacks.  Here:
**
**   store    every full block the session seals is also put in the block store under its chunk
**            (index.c)
**            key, SHA-256(c_0 | its tokens) (kvt_chunk_root: the chain root's inputs behind the
**            domain "kvtier-chunk", so model, cache layout, block size and tenant are in it, and
**            no chunk key equals a chain key).  Whatever the block's purity: its K/V come from
**            *some* context, which is the premise of chunk reuse.  The bytes are the plain blob
**            (the store's disk codec applies); the position it was saved at is read back from
**            the blob's own cells when it is loaded, so it is re-anchored by the right delta.
**   scan     after the prefix lookup stops, the rest of the prompt (its last token excluded: its
**            logits start the reply) is hashed at EVERY token offset, one block-sized window
**            each (SHA-256 of `block` tokens: ~1 us for 64 tokens), and each window's key asked
**            of the store's RAM and disk tiers (kvt_store_has: no read; Redis is not asked).
**            Greedy left to right: a hit starts a run, which extends block by block while the
**            next window hits; the scan goes on after the run.
**   recompute the first chunk_recompute tokens of each run are decoded in context (EPIC's
**            boundary recompute), rounded UP to whole blocks because a stored block loads whole;
**            a run that does not outlast them is decoded entirely.
**   load     at the first loaded block of a run the open block is sealed early (the session's
**            blocks are fixed-size and the run's blocks must start one), the run fetched from the
**            store and loaded at the tail with kvt_blocks_load (one state write, RoPE re-anchored
**            from each blob's saved position), and recorded like decoded tokens.  The session's
**            chain purity ends there (kvt__sess_chain_off): no later block is stored under a
**            prefix chain key.  A block the store no longer has ends the run there; a load that
**            fails (counted in chunk_load_errors) leaves the cache unchanged (all or nothing) and
**            the tokens are decoded: never a hole. */
#include "session/session_int.h"
#include "kv/blob.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvt_chunk_recompute_parse(const char *spec, int32_t *tokens, double *pct) {
    if (!spec || !tokens || !pct) return kvt__fail(KVT_EINVAL, "kvt_chunk_recompute_parse: NULL argument");
    char *end = NULL;
    double v = strtod(spec, &end);
    const bool is_pct = end && *end == '%' && end[1] == '\0';
    if (end == spec || (!is_pct && *end != '\0') || !isfinite(v) || spec[0] == ' ' || spec[0] == '+')
        return kvt__fail(KVT_EINVAL, "chunk recompute '%.80s' is not a token count K or a percentage P%%", spec);
    if (is_pct) {
        if (!(v >= 0 && v <= 100)) return kvt__fail(KVT_EINVAL, "chunk recompute '%.80s': %g %% is outside 0..100 %%", spec, v);
        *tokens = -1;
        *pct = v;
        return 0;
    }
    if (!(v >= 0 && v <= (1 << 20)) || v != floor(v))
        return kvt__fail(KVT_EINVAL, "chunk recompute '%.80s' is not a whole number of tokens in 0..%d", spec, 1 << 20);
    *tokens = (int32_t) v;
    *pct = -1;
    return 0;
}

void kvt__sess_chunk_free(struct chunk_run *runs, int32_t n_runs) {
    for (int32_t i = 0; runs && i < n_runs; i++) free(runs[i].keys);
    free(runs);
}

/* Blocks of a run of `blocks` blocks decoded at its start (boundary recompute). */
static int32_t recompute_blocks(const kvt_session *s, int32_t blocks) {
    const int32_t B = s->p.block;
    double k = s->chunk.k_tok >= 0 ? s->chunk.k_tok : ceil(s->chunk.k_pct / 100.0 * blocks * B - 1e-9);
    return (int32_t) ceil(k / B);
}

int kvt__sess_chunk_plan(kvt_session *s, const kvt_token *tok, int32_t n, struct chunk_run **runs, int32_t *n_runs) {
    *runs = NULL;
    *n_runs = 0;
    const int32_t B = s->p.block;
    if (!s->p.chunk_reuse || !s->p.store || n - 1 < B || !kvt__sess_roots(s)) return 0;
    const double t0 = kvt__now_ms();
    const int32_t max_blocks = (n - 1) / B;
    kvt_key *keys = malloc(sizeof *keys * (size_t) max_blocks);
    struct chunk_run *out = NULL;
    int32_t n_out = 0, cap = 0;
    int rc = keys ? 0 : kvt__fail(KVT_ENOMEM, "chunk lookup of %d tokens", n);
    for (int32_t i = 0; rc == 0 && i + B <= n - 1;) {
        int32_t nb = 0;
        for (int32_t j = i; j + B <= n - 1; j += B) { /* the run from i */
            if (kvt_chain_next(&s->chunk.root, tok + j, B, &keys[nb])) break;
            if (!kvt_store_has(s->p.store, &keys[nb])) break;
            nb++;
        }
        kvt__clear_error();
        if (nb == 0) {
            i++;
            continue;
        }
        s->st.chunk_runs++;
        const int32_t r = recompute_blocks(s, nb);
        if (r >= nb) { /* simply decoded */
            s->st.chunk_recompute_tokens += (int64_t) nb * B;
        } else {
            if (n_out == cap) {
                int32_t c2 = cap ? 2 * cap : 8;
                struct chunk_run *o2 = realloc(out, sizeof *o2 * (size_t) c2);
                if (!o2) {
                    rc = kvt__fail(KVT_ENOMEM, "chunk runs");
                    break;
                }
                out = o2;
                cap = c2;
            }
            struct chunk_run *cr = &out[n_out];
            cr->at = i + r * B;
            cr->n_blocks = nb - r;
            cr->keys = malloc(sizeof *cr->keys * (size_t) cr->n_blocks);
            if (!cr->keys) {
                rc = kvt__fail(KVT_ENOMEM, "chunk run of %d blocks", cr->n_blocks);
                break;
            }
            memcpy(cr->keys, keys + r, sizeof *cr->keys * (size_t) cr->n_blocks);
            n_out++;
            s->st.chunk_recompute_tokens += (int64_t) r * B;
        }
        i += nb * B;
    }
    free(keys);
    s->st.chunk_scan_ms += kvt__now_ms() - t0;
    if (rc) {
        kvt__sess_chunk_free(out, n_out);
        return rc;
    }
    for (int32_t q = 0; q < n_out; q++)
        kvt__sess_explain(s, "reused chunk: %d blocks from the store at prompt offset +%d", out[q].n_blocks, out[q].at);
    *runs = out;
    *n_runs = n_out;
    return 0;
}

int kvt__sess_chunk_load(kvt_session *s, const struct chunk_run *r, const kvt_token *tok, int role, int32_t *used) {
    *used = 0;
    const int32_t B = s->p.block;
    /* at most what fits the budget beside a block of room and the reply reserve (the prefix
    ** route's cap): the rest of a longer run is decoded */
    const int32_t n_max = KVT_MIN(r->n_blocks, (s->p.budget - s->p.gen_reserve - 2 * B) / B);
    if (n_max <= 0) return 0;
    const double t0 = kvt__now_ms();
    kvt_blob *blobs = calloc((size_t) r->n_blocks, sizeof *blobs);
    const kvt_blob **bp = calloc((size_t) r->n_blocks, sizeof *bp);
    int32_t found = 0;
    int rc = 0;
    if (!blobs || !bp) {
        rc = kvt__fail(KVT_ENOMEM, "chunk load of %d blocks", r->n_blocks);
        goto out;
    }
    for (; found < n_max; found++) { /* a block gone since the scan ends the run there */
        struct kvt_store_meta m;
        kvt_blob *b = &blobs[found];
        if (kvt_store_get(s->p.store, &r->keys[found], &s->reuse.model_fp, (void **) &b->data, &b->size, &m, NULL)) break;
        b->n_tokens = B;
        if (m.n_tokens != B || m.codec != 0 || kvt__blob_shape(b)) {
            free(b->data);
            b->data = NULL;
            break;
        }
        bp[found] = b;
    }
    kvt__clear_error();
    if (found == 0) goto out;
    /* only now, with the bytes at hand, anything that changes the session: the open block is
    ** sealed early (chain purity ends there, kvt__sess_seal) and room made; if that fails the
    ** run is decoded */
    if ((s->open >= 0 && kvt__sess_seal(s)) || kvt__sess_make_room(s, found * B + B) || kvt__sess_reserve_positions(s, found * B)) {
        kvt__clear_error();
        s->st.chunk_load_errors++;
        goto out;
    }
    /* each block seals with the bytes just loaded (the pool's copy keeps the position they were
    ** saved at, so a recovery re-anchors by the right delta).  Not read back from the cache: on
    ** Gemma 3 a run longer than the sliding window has lost the older blocks' SWA cells there,
    ** and a copy without them could not be loaded again */
    if ((rc = kvt__sess_load_run(s, bp, found, tok, role, true, used)) || *used == 0) goto out;
    s->st.chunk_tokens += found * B;
    s->st.store_tokens += found * B;
out:
    for (int32_t q = 0; blobs && q < r->n_blocks; q++) free(blobs[q].data);
    free(blobs);
    free(bp);
    s->st.store_ms += kvt__now_ms() - t0;
    return rc;
}
