/* prefetch.c — the block store's prefetch (kvtier.h section 8, kvt_store_prefetch): blocks a
** caller will soon ask for are read from disk or Redis into the RAM tier by a few threads, so the
** caller's gets find them in RAM (LMCache's prefetch of the chunks that follow a matched prefix;
** EdgeSync-LLM's predictor, which loads the blocks a session will need before it resumes).
**
** Queue.  A ring of prefetch_queue keys; kvt_store_prefetch only appends (a key already in RAM,
** queued or in flight is skipped; a full ring or prefetch_bytes of unread promotions drop it,
** counted) and never waits for I/O.  A worker takes one key at a time, or up to PF_BATCH when
** the store has a Redis tier: the keys that miss on disk are then asked of Redis in one pipelined
** round trip.  The keys a worker holds are "in flight" (slots, one set per worker).
**
** A get meets the prefetch (kvt__pf_wait): a key still queued is taken back and the get reads
** it itself (so the caller and the workers read different blocks at once); a key in flight is
** waited for, and the get then finds it in RAM (PROMOTED) or answers a miss at once (ABSENT: the
** prefetch asked every tier) or reads it itself (SKIPPED, FAILED).  No block is read twice by
** the two, except after a refused read (corrupt: the entry is gone, so the get misses).
**
** RAM.  A promotion enters the RAM tier as the most recently used entry (it is about to be read)
** and, like any insert, evicts least recently used entries for room; so that a prefetch cannot
** flush the tier, the bytes of promoted entries no get has read yet are bounded by
** prefetch_bytes (default a quarter of ram_bytes): past it new keys are dropped (counted) and a
** worker skips what it takes.  An unread promotion that leaves RAM is counted as wasted. */
#include "store/store_int.h"
#include "fault.h"

#include <errno.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#define PF_BATCH 8 /* keys a worker takes at once with a Redis tier (one pipelined round trip) */

struct pf_item {
    kvt_key key, model;
    bool dead; /* taken back by a get */
};

struct pf_slot {
    kvt_key key;
    int state;   /* SLOT_FREE, SLOT_RUN, SLOT_DONE */
    int result;  /* KVT__PF_* once done */
    int waiters; /* gets waiting for it */
};
enum { SLOT_FREE = 0, SLOT_RUN, SLOT_DONE };

struct kvt__pf {
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* a key was queued, or stop */
    pthread_cond_t done_cv; /* a slot finished, or a waiter left */
    struct pf_item *ring;
    int32_t cap, head, len; /* len counts dead items until a worker passes them */
    struct pf_slot *slots;  /* n_thr * PF_BATCH */
    pthread_t *thr;
    int n_thr, n_started;
    bool stop;
    size_t bytes_max;
    int64_t issued, promoted, dropped, skipped, absent, failed, claimed, waited, cancelled;
};

static bool same(const kvt_key *a, const kvt_key *b) { return !memcmp(a->b, b->b, KVT_KEY_BYTES); }

/* ---- worker ----------------------------------------------------------------------------------- */

struct worker_arg {
    kvt_store *st;
    int idx;
};

static void finish_slot(struct kvt__pf *pf, struct pf_slot *sl, int result) {
    pthread_mutex_lock(&pf->mu);
    sl->state = SLOT_DONE;
    sl->result = result;
    switch (result) {
        case KVT__PF_PROMOTED: pf->promoted++; break;
        case KVT__PF_ABSENT: pf->absent++; break;
        case KVT__PF_SKIPPED: pf->skipped++; break;
        default: pf->failed++; break;
    }
    pthread_cond_broadcast(&pf->done_cv);
    pthread_mutex_unlock(&pf->mu);
}

struct redis_batch {
    kvt_store *st;
    struct pf_slot *slots;
    const kvt_key *keys;
    const int *idx; /* slot of each key asked of Redis */
};

/* One Redis reply of a prefetch batch: promoted and its slot finished at once (a get waiting for
** this block does not wait for the rest of the batch). */
static void redis_done(void *ud, int k, int rc, void *data, size_t n, const struct kvt_store_meta *m) {
    struct redis_batch *b = ud;
    kvt_store *st = b->st;
    int res = rc == 0 ? KVT__PF_PROMOTED : rc == KVT_ENOENT ? KVT__PF_ABSENT : rc == KVT_EIO ? KVT__PF_SKIPPED : KVT__PF_FAILED;
    if (rc == 0) {
        /* into RAM (marked prefetched) and queued for disk, as a get's Redis hit is; a read-only
        ** store keeps it nowhere, so the get must read it itself */
        if (st->p.read_only || kvt__store_put_local(st, &b->keys[k], m, data, n, false, true)) res = KVT__PF_SKIPPED;
        kvt__clear_error();
    }
    free(data);
    finish_slot(st->pf, &b->slots[b->idx[k]], res);
}

/* Read the keys of slots[0..n) (models[i]) into RAM; each slot is finished as soon as it is known. */
static void run_batch(kvt_store *st, struct pf_slot *slots, const kvt_key *models, int n) {
    struct kvt__pf *pf = st->pf;
    kvt_key rkeys[PF_BATCH], rmodels[PF_BATCH];
    int ridx[PF_BATCH], nr = 0;
    for (int i = 0; i < n; i++) {
        struct pf_slot *sl = &slots[i];
        if (kvt__fault_check(KVT__FAULT_STORE_PREFETCH)) { /* the read fails: as an I/O error would */
            finish_slot(pf, sl, KVT__PF_FAILED);
            continue;
        }
        if (kvt__ram_pf_bytes(&st->ram) >= pf->bytes_max) { /* RAM holds enough unread promotions */
            finish_slot(pf, sl, KVT__PF_SKIPPED);
            continue;
        }
        void *data = NULL;
        size_t sz = 0;
        int res = KVT__PF_NONE;
        int rc = kvt__store_get_local(st, &sl->key, &models[i], &data, &sz, NULL, NULL, &res, &st->ttl, NULL);
        free(data);
        kvt__clear_error();
        if (rc == KVT_ENOMEM) res = KVT__PF_FAILED;
        if (res == KVT__PF_ABSENT && st->redis) { /* asked of Redis below, with the others */
            rkeys[nr] = sl->key;
            rmodels[nr] = models[i];
            ridx[nr++] = i;
            continue;
        }
        finish_slot(pf, sl, res == KVT__PF_NONE ? KVT__PF_FAILED : res);
    }
    if (nr == 0) return;
    struct redis_batch b = { st, slots, rkeys, ridx };
    kvt__redis_mget(st->redis, nr, rkeys, rmodels, redis_done, &b);
}

static void *worker_main(void *arg) {
    struct worker_arg *wa = arg;
    kvt_store *st = wa->st;
    struct kvt__pf *pf = st->pf;
    struct pf_slot *mine = &pf->slots[wa->idx * PF_BATCH];
    const int batch = st->redis ? PF_BATCH : 1;
    free(wa);
    /* below the model's threads: a prefetch that takes a core from llama.cpp's decode (whose
    ** OpenMP workers wait for each other) costs more than it saves (docs/BENCHMARKS.md) */
    setpriority(PRIO_PROCESS, (id_t) syscall(SYS_gettid), 10);
    kvt_key models[PF_BATCH];
    pthread_mutex_lock(&pf->mu);
    for (;;) {
        while (!pf->stop && pf->len == 0) pthread_cond_wait(&pf->work_cv, &pf->mu);
        if (pf->stop) break;
        int n = 0;
        while (pf->len > 0 && n < batch) {
            struct pf_item *it = &pf->ring[pf->head];
            pf->head = (pf->head + 1) % pf->cap;
            pf->len--;
            if (it->dead) continue;
            mine[n] = (struct pf_slot){ .key = it->key, .state = SLOT_RUN };
            models[n++] = it->model;
        }
        if (n == 0) continue;
        pthread_mutex_unlock(&pf->mu);
        run_batch(st, mine, models, n);
        pthread_mutex_lock(&pf->mu);
        for (int i = 0; i < n; i++) { /* the gets that waited have read the result */
            while (mine[i].waiters > 0) pthread_cond_wait(&pf->done_cv, &pf->mu);
            mine[i].state = SLOT_FREE;
        }
    }
    pthread_mutex_unlock(&pf->mu);
    return NULL;
}

/* ---- open / close ------------------------------------------------------------------------------ */

int kvt__pf_start(kvt_store *st) {
    const struct kvt_store_params *p = &st->p;
    if (p->prefetch_threads <= 0 || p->ram_bytes == 0 || (!st->disk && !st->redis)) return 0;
    struct kvt__pf *pf = calloc(1, sizeof *pf);
    if (!pf) return kvt__fail(KVT_ENOMEM, "store prefetch: no memory");
    pf->cap = p->prefetch_queue;
    pf->n_thr = p->prefetch_threads;
    pf->bytes_max = p->prefetch_bytes ? p->prefetch_bytes : p->ram_bytes / 4;
    pf->ring = calloc((size_t) pf->cap, sizeof *pf->ring);
    pf->slots = calloc((size_t) pf->n_thr * PF_BATCH, sizeof *pf->slots);
    pf->thr = calloc((size_t) pf->n_thr, sizeof *pf->thr);
    pthread_mutex_init(&pf->mu, NULL);
    pthread_cond_init(&pf->work_cv, NULL);
    pthread_cond_init(&pf->done_cv, NULL);
    st->pf = pf;
    if (!pf->ring || !pf->slots || !pf->thr) return kvt__fail(KVT_ENOMEM, "store prefetch: no memory");
    for (int t = 0; t < pf->n_thr; t++) {
        struct worker_arg *wa = malloc(sizeof *wa);
        int err = wa ? 0 : ENOMEM;
        if (wa) {
            *wa = (struct worker_arg){ st, t };
            if ((err = pthread_create(&pf->thr[t], NULL, worker_main, wa))) free(wa);
        }
        if (err) return kvt__fail(KVT_ENOMEM, "store prefetch thread %d: %s", t, strerror(err));
        pf->n_started++;
    }
    return 0;
}

void kvt__pf_stop(kvt_store *st) {
    struct kvt__pf *pf = st->pf;
    if (!pf) return;
    pthread_mutex_lock(&pf->mu);
    pf->stop = true;
    pthread_cond_broadcast(&pf->work_cv);
    pthread_mutex_unlock(&pf->mu);
    for (int t = 0; t < pf->n_started; t++) pthread_join(pf->thr[t], NULL);
    pthread_mutex_destroy(&pf->mu);
    pthread_cond_destroy(&pf->work_cv);
    pthread_cond_destroy(&pf->done_cv);
    free(pf->ring);
    free(pf->slots);
    free(pf->thr);
    free(pf);
    st->pf = NULL;
}

/* ---- the API ------------------------------------------------------------------------------------ */

/* Is key queued (not taken back) or in flight?  (mu held) */
static bool pending(struct kvt__pf *pf, const kvt_key *key) {
    for (int32_t i = 0; i < pf->len; i++) {
        const struct pf_item *it = &pf->ring[(pf->head + i) % pf->cap];
        if (!it->dead && same(&it->key, key)) return true;
    }
    for (int i = 0; i < pf->n_thr * PF_BATCH; i++)
        if (pf->slots[i].state == SLOT_RUN && same(&pf->slots[i].key, key)) return true;
    return false;
}

int kvt_store_prefetch(kvt_store *st, const kvt_key *keys, int n, const kvt_key *model) {
    if (!st || (!keys && n > 0) || !model)
        return kvt__fail(KVT_EINVAL, "kvt_store_prefetch: NULL %s", !st ? "store" : !model ? "model fingerprint" : "keys");
    if (n < 0) return kvt__fail(KVT_EINVAL, "kvt_store_prefetch: n %d is negative", n);
    struct kvt__pf *pf = st->pf;
    if (!pf) return 0; /* no prefetch threads: nothing to do, not an error */
    const double now = kvt__store_now(st);
    int queued = 0;
    for (int i = 0; i < n; i++) {
        if (kvt__ram_has(&st->ram, &keys[i], &st->ttl, now, NULL)) continue; /* nothing to do */
        bool over = kvt__ram_pf_bytes(&st->ram) >= pf->bytes_max;
        pthread_mutex_lock(&pf->mu);
        if (!pending(pf, &keys[i])) {
            if (over || pf->len >= pf->cap) {
                pf->dropped++;
            } else {
                pf->ring[(pf->head + pf->len) % pf->cap] = (struct pf_item){ keys[i], *model, false };
                pf->len++;
                pf->issued++;
                queued++;
                pthread_cond_signal(&pf->work_cv);
            }
        }
        pthread_mutex_unlock(&pf->mu);
    }
    return queued;
}

int kvt__pf_wait(kvt_store *st, const kvt_key *key) {
    struct kvt__pf *pf = st->pf;
    if (!pf) return KVT__PF_NONE;
    int res = KVT__PF_NONE;
    pthread_mutex_lock(&pf->mu);
    for (int32_t i = 0; i < pf->len; i++) {
        struct pf_item *it = &pf->ring[(pf->head + i) % pf->cap];
        if (!it->dead && same(&it->key, key)) { /* not started: the get reads it itself */
            it->dead = true;
            pf->claimed++;
            pthread_mutex_unlock(&pf->mu);
            return KVT__PF_NONE;
        }
    }
    struct pf_slot *sl = NULL; /* the read in flight, else one just done */
    for (int i = 0; i < pf->n_thr * PF_BATCH; i++) {
        struct pf_slot *c = &pf->slots[i];
        if (c->state == SLOT_FREE || !same(&c->key, key)) continue;
        if (!sl || c->state == SLOT_RUN) sl = c;
    }
    if (sl) {
        sl->waiters++;
        if (sl->state == SLOT_RUN) pf->waited++;
        while (sl->state == SLOT_RUN) pthread_cond_wait(&pf->done_cv, &pf->mu);
        res = sl->result;
        sl->waiters--;
        pthread_cond_broadcast(&pf->done_cv);
    }
    pthread_mutex_unlock(&pf->mu);
    return res;
}

/* Mark the queued items dead: all of them (keys NULL), or those whose key is in keys[0..n). */
static int take_back(kvt_store *st, const kvt_key *keys, int n) {
    if (!st || !st->pf) return 0;
    struct kvt__pf *pf = st->pf;
    int got = 0;
    pthread_mutex_lock(&pf->mu);
    for (int32_t i = 0; i < pf->len; i++) {
        struct pf_item *it = &pf->ring[(pf->head + i) % pf->cap];
        if (it->dead) continue;
        bool hit = !keys;
        for (int k = 0; !hit && k < n; k++) hit = same(&it->key, &keys[k]);
        if (hit) {
            it->dead = true;
            got++;
        }
    }
    pf->cancelled += got;
    pthread_mutex_unlock(&pf->mu);
    return got;
}

int kvt_store_prefetch_cancel(kvt_store *st) { return take_back(st, NULL, 0); }

int kvt_store_prefetch_forget(kvt_store *st, const kvt_key *keys, int n) { return keys && n > 0 ? take_back(st, keys, n) : 0; }

void kvt__pf_stats(kvt_store *st, struct kvt_store_prefetch_stats *o) {
    memset(o, 0, sizeof *o);
    o->on = st->pf != NULL;
    kvt__ram_pf_stats(&st->ram, &o->unread_bytes, &o->hits, &o->wasted);
    struct kvt__pf *pf = st->pf;
    if (!pf) return;
    pthread_mutex_lock(&pf->mu);
    o->issued = pf->issued;
    o->promoted = pf->promoted;
    o->dropped = pf->dropped;
    o->skipped = pf->skipped;
    o->absent = pf->absent;
    o->failed = pf->failed;
    o->claimed = pf->claimed;
    o->waited = pf->waited;
    o->cancelled = pf->cancelled;
    for (int32_t i = 0; i < pf->len; i++) o->queue_len += !pf->ring[(pf->head + i) % pf->cap].dead;
    pthread_mutex_unlock(&pf->mu);
}

int kvt_store_prefetch_chain(kvt_store *st, const struct kvt_chain_params *cp, const kvt_token *tok, int32_t n) {
    if (!st || !cp || (!tok && n > 0))
        return kvt__fail(KVT_EINVAL, "kvt_store_prefetch_chain: NULL %s", !st ? "store" : !cp ? "chain params" : "tokens");
    if (n < 0) return kvt__fail(KVT_EINVAL, "kvt_store_prefetch_chain: n %d is negative", n);
    kvt_key key;
    int rc = kvt_chain_root(cp, &key); /* checks cp, with or without prefetch threads */
    if (rc || !st->pf) return rc;
    const int32_t nb = n > 0 ? (n - 1) / cp->block : 0; /* full blocks before the last token */
    if (nb == 0) return 0;
    kvt_key *keys = malloc(sizeof *keys * (size_t) nb);
    if (!keys) return kvt__fail(KVT_ENOMEM, "kvt_store_prefetch_chain: no memory for %d keys", nb);
    for (int32_t i = 0; i < nb && rc == 0; i++)
        rc = kvt_chain_next(&key, tok + (size_t) i * cp->block, cp->block, &key), keys[i] = key;
    if (rc == 0) rc = kvt_store_prefetch(st, keys, nb, &cp->model);
    free(keys);
    return rc;
}
