/* ann.cpp — approximate nearest neighbours by cosine over hnswlib (kvtier.h section 7).
**
** HNSW (Malkov & Yashunin 2018, "Efficient and robust approximate nearest neighbor search
** using Hierarchical Navigable Small World graphs") through hnswlib 0.6.2, header-only.
** Vectors are L2-normalised here, so hnswlib's inner-product space (distance 1 - <a, b>) ranks
** by cosine.  The only C++ file in kvtier: every C++ exception is caught at the extern "C"
** boundary and turned into a KVT_E* code with a message (kvt_errmsg).
**
** Ids: a caller's uint64 id is the hnswlib label (labeltype is size_t, 64 bits here).
** Removal is hnswlib's markDelete: the element keeps its slot and its graph links (the graph
** stays navigable) but is never returned.  Adding an id that is present or removed replaces
** its vector in place (hnswlib 0.6.2's addPoint updates an existing label and unmarks it), so
** slots are used by distinct ids only.  When every slot is taken the index doubles
** (resizeIndex). */
/* hnswlib 0.6.2 prefetches the NEXT neighbour while walking a link list by reading
** datal[j + 1], one entry past the end of a full upper-level list: a heap-buffer-overflow read
** under ASan (nmslib/hnswlib issues #107 and #578, fixes #459/#628 unmerged).  The prefetches are
** only hints, so they are compiled out; the SIMD distance functions stay. */
#if defined(__SSE__)
#include <x86intrin.h> /* declare the real _mm_prefetch before hiding it from hnswlib */
#undef _mm_prefetch    /* a macro itself in unoptimised builds */
#define _mm_prefetch(p, hint) ((void) 0)
#endif
#include <hnswlib/hnswlib.h>
#undef _mm_prefetch

#include <cmath>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <unordered_map>
#include <vector>

/* kvtier.h declares a function kvt_engine_info beside struct kvt_engine_info; legal C, but
** C++'s -Wshadow reports the function as hiding the struct's implicit constructor. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
extern "C" {
#include "internal.h"
}
#pragma GCC diagnostic pop

static_assert(sizeof(hnswlib::labeltype) >= sizeof(uint64_t), "hnswlib labels must hold a uint64 id");

namespace {

constexpr int32_t kDefaultM = 16;
constexpr size_t kEfConstruction = 200;
constexpr int32_t kDefaultEfSearch = 50;
constexpr int32_t kMinCapacity = 16;
constexpr int32_t kMaxDim = 1 << 16;
constexpr int32_t kMaxM = 128;

/* Map an exception escaping hnswlib or the standard library to an error code.  hnswlib reports
** allocation failure as runtime_error("Not enough memory..."). */
int fail_from(const char *what_call, const std::exception &ex) {
    const char *msg = ex.what();
    if (dynamic_cast<const std::bad_alloc *>(&ex) || std::strstr(msg, "Not enough memory"))
        return kvt__fail(KVT_ENOMEM, "ann %s: out of memory (%s)", what_call, msg);
    return kvt__fail(KVT_EINVAL, "ann %s: hnswlib: %s", what_call, msg);
}

} // namespace

struct kvt_ann {
    int32_t dim = 0;
    int32_t m = kDefaultM;
    int32_t ef_search = kDefaultEfSearch;
    size_t capacity = 0; /* hnswlib max_elements: slots, live or removed */
    size_t n_slots = 0;  /* slots in use (distinct ids ever added) */
    int32_t n_live = 0;
    hnswlib::InnerProductSpace *space = nullptr;
    hnswlib::HierarchicalNSW<float> *index = nullptr;
    std::unordered_map<uint64_t, bool> ids; /* id -> live (false: removed, slot kept) */
    std::vector<float> buf;                 /* normalised copy of the vector in hand */

    ~kvt_ann() {
        delete index;
        delete space;
    }
};

/* Copy v[0..dim) into a->buf scaled to unit length.  False if v has a zero, infinite or NaN norm. */
static bool normalise(kvt_ann *a, const float *v, double *norm_out) {
    double ss = 0;
    for (int32_t i = 0; i < a->dim; i++) ss += (double) v[i] * v[i];
    const double norm = std::sqrt(ss);
    *norm_out = norm;
    if (!(norm > 0) || !std::isfinite(norm)) return false;
    for (int32_t i = 0; i < a->dim; i++) a->buf[(size_t) i] = (float) (v[i] / norm);
    return true;
}

extern "C" int kvt_ann_open(int32_t dim, int32_t capacity, int32_t m, int32_t ef_search, kvt_ann **out) {
    if (!out) return kvt__fail(KVT_EINVAL, "ann open: NULL out");
    *out = nullptr;
    if (dim <= 0 || dim > kMaxDim) return kvt__fail(KVT_EINVAL, "ann dimension %d is outside 1..%d", dim, kMaxDim);
    if (capacity < 0) return kvt__fail(KVT_EINVAL, "ann capacity %d is negative", capacity);
    if (m <= 0) m = kDefaultM;
    if (m < 2 || m > kMaxM) return kvt__fail(KVT_EINVAL, "ann M %d is outside 2..%d", m, kMaxM);
    if (ef_search <= 0) ef_search = kDefaultEfSearch;
    kvt_ann *a = nullptr;
    try {
        a = new kvt_ann();
        a->dim = dim;
        a->m = m;
        a->ef_search = ef_search;
        a->capacity = (size_t) (capacity < kMinCapacity ? kMinCapacity : capacity);
        a->buf.resize((size_t) dim);
        a->space = new hnswlib::InnerProductSpace((size_t) dim);
        a->index = new hnswlib::HierarchicalNSW<float>(a->space, a->capacity, (size_t) m, kEfConstruction);
        a->index->setEf((size_t) ef_search);
    } catch (const std::exception &ex) {
        delete a;
        return fail_from("open", ex);
    }
    *out = a;
    return 0;
}

extern "C" void kvt_ann_free(kvt_ann *a) { delete a; }

extern "C" int kvt_ann_add(kvt_ann *a, uint64_t id, const float *v) {
    if (!a) return kvt__fail(KVT_EINVAL, "ann add: NULL index");
    if (!v) return kvt__fail(KVT_EINVAL, "ann add of id %llu: NULL vector", (unsigned long long) id);
    double norm;
    if (!normalise(a, v, &norm))
        return kvt__fail(KVT_EINVAL, "ann add of id %llu: vector norm %g cannot be normalised", (unsigned long long) id, norm);
    try {
        const bool is_new = a->ids.find(id) == a->ids.end();
        if (is_new) {
            if (a->n_slots >= a->capacity) {
                size_t cap = a->capacity * 2;
                a->index->resizeIndex(cap);
                a->capacity = cap;
            }
            a->ids.reserve(a->ids.size() + 1); /* may throw before hnswlib is touched */
        }
        /* New label: a new slot.  Existing label (live or removed): vector replaced in place and
        ** the element unmarked. */
        a->index->addPoint(a->buf.data(), (hnswlib::labeltype) id);
        bool &live = a->ids[id];
        if (is_new) a->n_slots++;
        if (!live) {
            live = true;
            a->n_live++;
        }
    } catch (const std::exception &ex) { return fail_from("add", ex); }
    return 0;
}

extern "C" int kvt_ann_remove(kvt_ann *a, uint64_t id) {
    if (!a) return kvt__fail(KVT_EINVAL, "ann remove: NULL index");
    auto it = a->ids.find(id);
    if (it == a->ids.end() || !it->second)
        return kvt__fail(KVT_ENOENT, "ann remove: id %llu is not in the index", (unsigned long long) id);
    try {
        a->index->markDelete((hnswlib::labeltype) id);
    } catch (const std::exception &ex) { return fail_from("remove", ex); }
    it->second = false;
    a->n_live--;
    return 0;
}

extern "C" int kvt_ann_search(kvt_ann *a, const float *q, int32_t k, uint64_t *ids, float *sims, int32_t *n_found) {
    if (n_found) *n_found = 0;
    if (!a) return kvt__fail(KVT_EINVAL, "ann search: NULL index");
    if (!q || !ids || !n_found) return kvt__fail(KVT_EINVAL, "ann search: NULL query or output array");
    if (k <= 0) return kvt__fail(KVT_EINVAL, "ann search: k %d must be positive", k);
    double norm;
    if (!normalise(a, q, &norm)) return kvt__fail(KVT_EINVAL, "ann search: query norm %g cannot be normalised", norm);
    if (a->n_live == 0) return 0;
    try {
        /* searchKnn widens the beam to max(ef_search, k) itself; the queue holds the farthest on top */
        auto res = a->index->searchKnn(a->buf.data(), (size_t) k);
        int32_t n = (int32_t) res.size();
        for (int32_t i = n - 1; i >= 0; i--) {
            ids[i] = (uint64_t) res.top().second;
            if (sims) sims[i] = 1.0f - res.top().first;
            res.pop();
        }
        *n_found = n;
    } catch (const std::exception &ex) { return fail_from("search", ex); }
    return 0;
}

extern "C" int32_t kvt_ann_size(const kvt_ann *a) { return a ? a->n_live : 0; }
