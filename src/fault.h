/* fault.h — failure injection for tests, as SQLite's fault simulator does for malloc and I/O.
** Never installed; not API.  Tests include it from src/ (tests/CMakeLists.txt puts src/ on their
** include path) to make a named check site fail on purpose and observe what the code does then.
**
** A site is a place in the library where an operation that can fail in the field (a pool's copy
** of a value, a spill file write) asks kvt__fault_check() first.  Unarmed, a check costs one
** relaxed atomic load and passes.  Armed with kvt__fault_set(site, skip, n), the next `skip`
** checks pass and then `n` checks fail (n < 0: every later check fails until the site is set
** again).  Every failing check is counted (kvt__fault_hits).  Thread-safe. */
#ifndef KVT_FAULT_H
#define KVT_FAULT_H

#include <stdbool.h>
#include <stdint.h>

enum kvt__fault_site {
    KVT__FAULT_POOL_PUT = 0,   /* kvt_pool_put fails with KVT_ENOMEM before touching the pool */
    KVT__FAULT_SPILL_WRITE,    /* a spill file write fails with ENOSPC (a full disk) */
    KVT__FAULT_STORE_WRITE,    /* a block store blob file write fails with ENOSPC (a full disk) */
    KVT__FAULT_STORE_SYNC,     /* a blob file's fsync (1st check of a write), then its rename (2nd), fails: EIO */
    KVT__FAULT_STORE_INDEX,    /* the block store's index insert of a written blob fails (SQLITE_IOERR) */
    KVT__FAULT_CODEC_ALLOC,    /* a block codec allocation fails (encode's output growth, decode's block) */
    KVT__FAULT_ELASTIC_ALLOC,  /* a live ElasticKV pass's allocation fails (kvt_seq_elastic: KVT_ENOMEM) */
    KVT__FAULT_STORE_PREFETCH, /* a block store prefetch's read fails (not promoted, prefetch.failed) */
    KVT__FAULT_CHUNK_LOAD,     /* a session's load of a reused chunk (kvt_blocks_load) fails: KVT_ELLAMA */
    KVT__FAULT_TOK_MEMO,       /* the tokenizer memo's allocations (a copy kept, a prefix taken) fail */
    KVT__FAULT_PENALTIES,      /* the repetition penalties' sampler or candidates allocation fails */
    KVT__FAULT_XTC,            /* a generation's XTC or Mirostat sampler allocation fails (kvt_engine_sample: KVT_ENOMEM) */
    KVT__FAULT__COUNT
};

/* Arm site: `skip` checks pass, then `n` fail (n < 0: all of them).  kvt__fault_set(site, 0, 0)
** disarms it.  Resets the site's hit count.  Cannot fail. */
void kvt__fault_set(enum kvt__fault_site site, int64_t skip, int64_t n);

/* True when this check of site must fail (and counts it).  Cannot fail. */
bool kvt__fault_check(enum kvt__fault_site site);

/* Checks of site that failed since it was last set.  Cannot fail. */
int64_t kvt__fault_hits(enum kvt__fault_site site);

#endif
