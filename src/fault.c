/* fault.c — failure injection for tests (see fault.h).  One mutex for the armed path; an
** unarmed site is one relaxed atomic load. */
#include "fault.h"

#include <pthread.h>
#include <stdatomic.h>

static pthread_mutex_t fault_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_bool armed[KVT__FAULT__COUNT];
static int64_t skip_left[KVT__FAULT__COUNT], fail_left[KVT__FAULT__COUNT], hits[KVT__FAULT__COUNT];

void kvt__fault_set(enum kvt__fault_site site, int64_t skip, int64_t n) {
    if ((unsigned) site >= KVT__FAULT__COUNT) return;
    pthread_mutex_lock(&fault_mu);
    skip_left[site] = skip > 0 ? skip : 0;
    fail_left[site] = n;
    hits[site] = 0;
    atomic_store_explicit(&armed[site], n != 0, memory_order_release);
    pthread_mutex_unlock(&fault_mu);
}

bool kvt__fault_check(enum kvt__fault_site site) {
    if ((unsigned) site >= KVT__FAULT__COUNT || !atomic_load_explicit(&armed[site], memory_order_relaxed)) return false;
    bool fail = false;
    pthread_mutex_lock(&fault_mu);
    if (skip_left[site] > 0) {
        skip_left[site]--;
    } else if (fail_left[site] != 0) {
        fail = true;
        hits[site]++;
        if (fail_left[site] > 0 && --fail_left[site] == 0) atomic_store_explicit(&armed[site], false, memory_order_relaxed);
    }
    pthread_mutex_unlock(&fault_mu);
    return fail;
}

int64_t kvt__fault_hits(enum kvt__fault_site site) {
    if ((unsigned) site >= KVT__FAULT__COUNT) return 0;
    pthread_mutex_lock(&fault_mu);
    int64_t h = hits[site];
    pthread_mutex_unlock(&fault_mu);
    return h;
}
