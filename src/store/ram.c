/* ram.c — the block store's RAM tier: a byte-budgeted LRU over a chained hash table.
**
** Why not the host pool (pool.c): the pool spills an over-budget value to a file instead of
** dropping it, keys are 64-bit, and its LRU victim is found by a linear scan.  This tier must
** drop (the disk tier below is the store's own, written behind), is keyed by 32-byte content
** keys with their meta, and evicts in O(1) from a list.  It shares the payload with the
** write-behind queue by reference (struct kvt__sbuf), so a put copies the caller's bytes once.
** One mutex guards it; a get copies the bytes out under it (a memcpy, no I/O). */
#include "store/store_int.h"

#include <stdlib.h>
#include <string.h>

struct kvt__ram_ent {
    kvt_key key;
    struct kvt_store_meta meta;
    struct kvt__sbuf *buf;
    double last_hit;
    int64_t hits;
    bool on_disk;                     /* queued for the disk tier or read from it */
    bool pf;                          /* promoted by a prefetch and not read since (r->pf_bytes) */
    struct kvt__ram_ent *hnext;       /* hash chain */
    struct kvt__ram_ent *prev, *next; /* LRU list */
};

struct kvt__sbuf *kvt__sbuf_alloc(size_t n) {
    if (n > SIZE_MAX - sizeof(struct kvt__sbuf) - 1) return NULL;
    struct kvt__sbuf *b = malloc(sizeof *b + (n ? n : 1));
    if (!b) return NULL;
    atomic_init(&b->ref, 1);
    b->n = n;
    return b;
}

struct kvt__sbuf *kvt__sbuf_new(const void *data, size_t n) {
    struct kvt__sbuf *b = kvt__sbuf_alloc(n);
    if (b && n) memcpy(b->data, data, n);
    return b;
}

struct kvt__sbuf *kvt__sbuf_ref(struct kvt__sbuf *b) {
    atomic_fetch_add_explicit(&b->ref, 1, memory_order_relaxed);
    return b;
}

void kvt__sbuf_unref(struct kvt__sbuf *b) {
    if (b && atomic_fetch_sub_explicit(&b->ref, 1, memory_order_acq_rel) == 1) free(b);
}

static uint64_t hash_key(const kvt_key *k) {
    uint64_t h;
    memcpy(&h, k->b, sizeof h); /* a SHA-256 digest: its bytes are already uniform */
    return h;
}

int kvt__ram_init(struct kvt__ram *r, size_t budget) {
    memset(r, 0, sizeof *r);
    r->budget = budget;
    atomic_init(&r->reserved, 0);
    r->n_buckets = 64;
    if (!(r->tab = calloc(r->n_buckets, sizeof *r->tab))) return kvt__fail(KVT_ENOMEM, "RAM tier: no memory");
    pthread_mutex_init(&r->mu, NULL);
    return 0;
}

static struct kvt__ram_ent **slot(struct kvt__ram *r, const kvt_key *k) {
    struct kvt__ram_ent **p = &r->tab[hash_key(k) & (r->n_buckets - 1)];
    while (*p && memcmp((*p)->key.b, k->b, KVT_KEY_BYTES)) p = &(*p)->hnext;
    return p;
}

static void lru_unlink(struct kvt__ram *r, struct kvt__ram_ent *e) {
    if (e->prev) e->prev->next = e->next;
    else r->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else r->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push_front(struct kvt__ram *r, struct kvt__ram_ent *e) {
    e->prev = NULL;
    e->next = r->head;
    if (r->head) r->head->prev = e;
    else r->tail = e;
    r->head = e;
}

/* Remove e from the table and the list and free it. */
static void drop(struct kvt__ram *r, struct kvt__ram_ent *e) {
    struct kvt__ram_ent **p = slot(r, &e->key);
    *p = e->hnext;
    lru_unlink(r, e);
    r->bytes -= e->buf->n;
    r->count--;
    if (e->pf) r->pf_bytes -= e->buf->n;
    kvt__sbuf_unref(e->buf);
    free(e);
}

/* Double the buckets when the table is fuller than one entry per bucket (best effort). */
static void grow(struct kvt__ram *r) {
    if (r->count < r->n_buckets) return;
    size_t nb = r->n_buckets * 2;
    struct kvt__ram_ent **t = calloc(nb, sizeof *t);
    if (!t) return; /* longer chains, still correct */
    for (size_t i = 0; i < r->n_buckets; i++) {
        for (struct kvt__ram_ent *e = r->tab[i], *nx; e; e = nx) {
            nx = e->hnext;
            struct kvt__ram_ent **p = &t[hash_key(&e->key) & (nb - 1)];
            e->hnext = *p;
            *p = e;
        }
    }
    free(r->tab);
    r->tab = t;
    r->n_buckets = nb;
}

/* What this tier may hold now: its budget less what the private entries hold (r->mu held). */
static size_t limit(struct kvt__ram *r) {
    const size_t res = atomic_load_explicit(&r->reserved, memory_order_relaxed);
    return res < r->budget ? r->budget - res : 0;
}

/* Evict least recently used entries until `need` more bytes fit under limit() (r->mu held). */
static void evict_for(struct kvt__ram *r, size_t need) {
    const size_t lim = limit(r);
    while (r->tail && r->bytes + need > lim) {
        r->pf_wasted += r->tail->pf;
        drop(r, r->tail);
        r->evictions++;
    }
}

void kvt__ram_trim(struct kvt__ram *r) {
    if (r->budget == 0) return;
    pthread_mutex_lock(&r->mu);
    evict_for(r, 0);
    pthread_mutex_unlock(&r->mu);
}

bool kvt__ram_put(struct kvt__ram *r, const kvt_key *key, const struct kvt_store_meta *m, struct kvt__sbuf *buf,
                  const struct kvt__ttl *t, double now, bool prefetched) {
    if (r->budget == 0) return false;
    pthread_mutex_lock(&r->mu);
    struct kvt__ram_ent *old = *slot(r, key);
    if (old && kvt__expires(t, old->last_hit, old->hits) <= now) { /* expired: replaced */
        r->pf_wasted += old->pf;
        drop(r, old);
        r->expired++;
    } else if (old) {
        pthread_mutex_unlock(&r->mu);
        return true;
    }
    struct kvt__ram_ent *e = buf->n <= limit(r) ? calloc(1, sizeof *e) : NULL;
    if (!e) { /* larger than what the tier may hold, or no memory for the entry: not kept in RAM */
        r->writes_dropped++;
        pthread_mutex_unlock(&r->mu);
        return false;
    }
    evict_for(r, buf->n);
    e->key = *key;
    e->meta = *m;
    e->buf = kvt__sbuf_ref(buf);
    e->last_hit = now;
    e->pf = prefetched;
    if (prefetched) r->pf_bytes += buf->n;
    struct kvt__ram_ent **p = slot(r, key);
    *p = e;
    lru_push_front(r, e);
    r->bytes += buf->n;
    r->count++;
    r->writes++;
    grow(r);
    pthread_mutex_unlock(&r->mu);
    return false;
}

int kvt__ram_get(struct kvt__ram *r, const kvt_key *key, const kvt_key *model, const struct kvt__ttl *t, double now, void **data,
                 size_t *n, struct kvt_store_meta *meta, bool *oom, struct kvt__sbuf **ref) {
    *oom = false;
    if (r->budget == 0) return KVT__RAM_MISS;
    pthread_mutex_lock(&r->mu);
    struct kvt__ram_ent *e = *slot(r, key);
    int rc = KVT__RAM_MISS;
    if (!e) {
        r->misses++;
    } else if (kvt__expires(t, e->last_hit, e->hits) <= now) {
        /* a miss for lookups; the entry stays (its session reads it at any age, with the TTL
        ** of kvt__ttl_forever) until the LRU or a fresh put replaces it */
        r->expired++;
        r->misses++;
        rc = KVT__RAM_EXPIRED;
    } else if (memcmp(e->meta.model.b, model->b, KVT_KEY_BYTES)) {
        r->corrupt++;
        r->misses++;
        rc = KVT__RAM_FOREIGN;
    } else {
        rc = KVT__RAM_HIT;
        if (ref) { /* the entry's own bytes, by reference */
            *ref = kvt__sbuf_ref(e->buf);
            *data = e->buf->data;
        } else {
            *data = malloc(e->buf->n ? e->buf->n : 1);
        }
        if (!*data) {
            *oom = true;
        } else {
            if (!ref && e->buf->n) memcpy(*data, e->buf->data, e->buf->n);
            *n = e->buf->n;
            *meta = e->meta;
            e->hits++;
            e->last_hit = now;
            if (e->pf) { /* the prefetch was used */
                r->pf_hits++;
                r->pf_bytes -= e->buf->n;
                e->pf = false;
            }
            lru_unlink(r, e);
            lru_push_front(r, e);
            r->hits++;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

bool kvt__ram_has(struct kvt__ram *r, const kvt_key *key, const struct kvt__ttl *t, double now, bool *on_disk) {
    if (on_disk) *on_disk = false;
    if (r->budget == 0) return false;
    pthread_mutex_lock(&r->mu);
    const struct kvt__ram_ent *e = *slot(r, key);
    bool has = e && kvt__expires(t, e->last_hit, e->hits) > now;
    if (has && on_disk) *on_disk = e->on_disk;
    pthread_mutex_unlock(&r->mu);
    return has;
}

void kvt__ram_set_on_disk(struct kvt__ram *r, const kvt_key *key) {
    if (r->budget == 0) return;
    pthread_mutex_lock(&r->mu);
    struct kvt__ram_ent *e = *slot(r, key);
    if (e) e->on_disk = true;
    pthread_mutex_unlock(&r->mu);
}

int64_t kvt__ram_clear(struct kvt__ram *r) {
    if (!r->tab) return 0;
    pthread_mutex_lock(&r->mu);
    int64_t n = (int64_t) r->count;
    while (r->tail) drop(r, r->tail);
    pthread_mutex_unlock(&r->mu);
    return n;
}

void kvt__ram_stats(struct kvt__ram *r, struct kvt_store_tier_stats *o) {
    pthread_mutex_lock(&r->mu);
    o->entries = (int64_t) r->count;
    o->bytes = (int64_t) r->bytes;
    o->hits = r->hits;
    o->misses = r->misses;
    o->writes = r->writes;
    o->writes_dropped = r->writes_dropped;
    o->evictions = r->evictions;
    o->expired = r->expired;
    o->corrupt = r->corrupt;
    pthread_mutex_unlock(&r->mu);
}

void kvt__ram_pf_stats(struct kvt__ram *r, int64_t *bytes, int64_t *hits, int64_t *wasted) {
    pthread_mutex_lock(&r->mu);
    *bytes = (int64_t) r->pf_bytes;
    *hits = r->pf_hits;
    *wasted = r->pf_wasted;
    pthread_mutex_unlock(&r->mu);
}

size_t kvt__ram_pf_bytes(struct kvt__ram *r) {
    pthread_mutex_lock(&r->mu);
    size_t n = r->pf_bytes;
    pthread_mutex_unlock(&r->mu);
    return n;
}

void kvt__ram_free(struct kvt__ram *r) {
    if (!r->tab) return;
    kvt__ram_clear(r);
    free(r->tab);
    r->tab = NULL;
    pthread_mutex_destroy(&r->mu);
}
