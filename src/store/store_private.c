/* store_private.c — the store's private entries (kvtier.h section 8, "Private entries"): the
** copies a session keeps of blocks that are NOT a cold prefill's K/V (decoded after an eviction,
** re-anchored, recomputed at another position, encoded with a lossy codec_ram), so that no
** content key may name them.  They live in the host pool (pool.c) the store owns: RAM within the
** store's ram_bytes, spilled to checksummed files (never dropped while a spill can be written),
** no TTL, never in the index, never in Redis, removed by their session (or with the process:
** the pool's private directory, and a dead process's by the next pool opened in $TMPDIR).
**
** One RAM budget.  The pool and the content RAM tier (ram.c) share ram_bytes, private entries
** first: after every private put or delete the bytes the pool holds in RAM are published to the
** RAM tier (kvt__ram.reserved), which keeps within ram_bytes - reserved, evicting its own least
** recently used entries (they are on disk or can be fetched again; a private entry spilled
** costs a file read, a content entry evicted a disk read).  The pool spills its own entries
** once ram_bytes is theirs. */
#include "store/store_int.h"

#include <stdlib.h>

int kvt__store_priv_open(kvt_store *st) {
    struct kvt_pool_params pp = kvt_pool_default_params();
    pp.budget_bytes = st->p.ram_bytes ? st->p.ram_bytes : 1; /* no RAM tier: every entry spills */
    pp.spill_dir = st->p.private_dir;                        /* copied by the pool */
    pp.spill_bytes_max = st->p.private_disk_bytes;           /* 0: no quota */
    return kvt_pool_open(&pp, &st->priv);
}

/* The pool's RAM bytes, published to the RAM tier, which gives them up. */
static void rebalance(kvt_store *st) {
    struct kvt_pool_stats ps;
    kvt_pool_get_stats(st->priv, &ps);
    atomic_store_explicit(&st->ram.reserved, (size_t) ps.ram_bytes, memory_order_relaxed);
    kvt__ram_trim(&st->ram);
}

int kvt_store_put_private(kvt_store *st, uint64_t key, const void *data, size_t n) {
    if (!st) return kvt__fail(KVT_EINVAL, "kvt_store_put_private: NULL store");
    int rc = kvt_pool_put(st->priv, key, data, n);
    rebalance(st);
    return rc;
}

int kvt_store_get_private(kvt_store *st, uint64_t key, void **data, size_t *n) {
    if (data) *data = NULL;
    if (n) *n = 0;
    if (!st || !data || !n) return kvt__fail(KVT_EINVAL, "kvt_store_get_private: NULL argument");
    return kvt_pool_get(st->priv, key, data, n);
}

int kvt_store_del_private(kvt_store *st, uint64_t key) {
    if (!st) return kvt__fail(KVT_EINVAL, "kvt_store_del_private: NULL store");
    int rc = kvt_pool_del(st->priv, key);
    rebalance(st);
    return rc;
}

int kvt_store_private_tier(kvt_store *st, uint64_t key) {
    if (!st) return KVT_TIER_NONE;
    char path[4096];
    int rc = kvt_pool_spill_path(st->priv, key, path, sizeof path);
    if (rc) {
        kvt__clear_error();
        return KVT_TIER_NONE;
    }
    return path[0] ? KVT_TIER_DISK : KVT_TIER_RAM;
}

void kvt_store_private_stats(kvt_store *st, struct kvt_pool_stats *out) { kvt_pool_get_stats(st ? st->priv : NULL, out); }
