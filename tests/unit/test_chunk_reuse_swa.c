/* test_chunk_reuse_swa — chunk reuse on Gemma 3 ($KVTIER_MODEL; skipped without it), whose
** sliding-window layers keep only the last n_swa (512) positions' cells.  Session A stores a
** document of ~14 blocks under chunk keys; session B reads the same document after another
** introduction, so it is found at a shifted offset and loaded as ONE run longer than the window
** (the early blocks' SWA cells are then gone from the cache).  B is parked and resumed: every
** block comes back from its saved copy — none recomputed — and the next turn's logits equal
** those of an identical session C that was never parked.  The control for the first claim: a
** block sealed by reading the cache back after such a load has no SWA cells, and its load is
** refused (KVT_EFORMAT), which resume would count as a recompute (the bug this test guards:
** loaded chunk blocks were sealed from the cache, not from the bytes just loaded). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { BLOCK = 64 };

static kvt_engine *g_eng;
static struct kvt_engine_info g_info;

static const char *PARA[4] = {
    "The lighthouse on Marrow Point was built in 1871 by a team of stonemasons from Aberdeen. Its lamp burned "
    "whale oil until 1903, when the keepers switched to kerosene. The tower is sixty feet tall and painted with "
    "red and white bands so that sailors can recognise it by day.",
    "Copper kettles were common in farmhouse kitchens across the valley. A good kettle was passed from mother to "
    "daughter and polished every Sunday with vinegar and salt. Travelling tinkers repaired the seams with solder "
    "and charged a penny for each patch.",
    "The orchard behind the old school has forty apple trees of eleven varieties. The oldest tree, a Bramley, was "
    "planted by the headmaster in 1920 and still gives fruit every autumn. Pupils pick the apples in October and "
    "press them into juice, which is sold at the harvest fair.",
    "The ferry to the northern islands leaves twice a day in summer and once in winter. Its captain has crossed "
    "the sound more than nine thousand times and keeps a logbook of every whale she has seen on the way.",
};

static char g_doc[16384];

static int setup(void **state) {
    (void) state;
    const char *m = getenv("KVTIER_MODEL");
    if (!m || access(m, R_OK) != 0) return 0;
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = m;
    p.n_ctx = 8192; /* two sequences of 4096 cells each */
    p.n_seq = 2;
    p.n_threads = 2;
    if (kvt_engine_open(&p, &g_eng)) return -1;
    kvt_engine_info(g_eng, &g_info);
    size_t len = 0;
    for (int i = 0; i < 12; i++) /* ~900 tokens, every sentence numbered: no two blocks alike */
        len += (size_t) snprintf(g_doc + len, sizeof g_doc - len, "Section %d. %s\n", i + 1, PARA[i % 4]);
    return 0;
}

static int teardown(void **state) {
    (void) state;
    kvt_engine_free(g_eng);
    return 0;
}

static kvt_session *open_session(kvt_store *st, int32_t seq, bool chunk) {
    struct kvt_session_params p = kvt_session_default_params();
    p.seq = seq;
    p.block = BLOCK;
    p.budget = 3072;
    p.store = st;
    p.chunk_reuse = chunk;
    p.chunk_recompute = chunk ? "0" : NULL;
    kvt_session *s = NULL;
    int rc = kvt_session_open(g_eng, &p, &s);
    if (rc) fprintf(stderr, "open: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
    return s;
}

static void add(kvt_session *s, enum kvt_role role, const char *text) {
    int rc = kvt_session_add(s, role, text, KVT_KEEP_NONE);
    if (rc) fprintf(stderr, "add: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
}

static double kl(const float *lp, const float *lq, int32_t n) {
    double mp = -INFINITY, mq = -INFINITY, zp = 0, zq = 0, k = 0;
    for (int32_t i = 0; i < n; i++) {
        mp = fmax(mp, lp[i]);
        mq = fmax(mq, lq[i]);
    }
    for (int32_t i = 0; i < n; i++) {
        zp += exp(lp[i] - mp);
        zq += exp(lq[i] - mq);
    }
    for (int32_t i = 0; i < n; i++) {
        double a = lp[i] - mp - log(zp), b = lq[i] - mq - log(zq);
        k += exp(a) * (a - b);
    }
    return k;
}

/* Sessions B (parked and resumed on its sequence) and C (never parked) read the same turn; then
** one more user turn each: KL(C || B) of the next-token logits.  OUT *sb: B's stats after resume. */
static double park_vs_live(kvt_store *st, bool chunk, const char *sys, struct kvt_session_stats *sb) {
    kvt_session *b = open_session(st, 0, chunk), *c = open_session(st, 1, chunk);
    add(b, KVT_ROLE_SYSTEM, sys);
    add(b, KVT_ROLE_USER, "Summarise it.");
    add(c, KVT_ROLE_SYSTEM, sys);
    add(c, KVT_ROLE_USER, "Summarise it.");
    struct kvt_session_stats sc;
    kvt_session_get_stats(b, sb);
    kvt_session_get_stats(c, &sc);
    printf("  %s: %lld chunk tokens in %lld runs, %lld load errors; window %d\n", chunk ? "chunk" : "plain",
           (long long) sb->chunk_tokens, (long long) sb->chunk_runs, (long long) sb->chunk_load_errors, g_info.n_swa);
    if (chunk) { /* one run longer than the sliding window was loaded */
        assert_true(sb->chunk_tokens > g_info.n_swa + BLOCK);
        assert_int_equal(sb->chunk_load_errors, 0);
        assert_int_equal(sc.chunk_tokens, sb->chunk_tokens);
    }
    /* park B (its sequence's cells leave the cache) and resume it on the same sequence */
    assert_int_equal(kvt_session_park(b), 0);
    int rc = kvt_session_resume(b, 0);
    if (rc) fprintf(stderr, "resume: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
    kvt_session_get_stats(b, sb);
    printf("  %s after resume: %lld recoveries, %lld recomputes\n", chunk ? "chunk" : "plain", (long long) sb->recoveries,
           (long long) sb->recomputes);
    assert_true(sb->recoveries > 0);
    assert_int_equal(sb->recomputes, 0); /* every block from its saved copy, SWA cells included */
    add(b, KVT_ROLE_USER, "Which bands is the tower painted with?");
    float *lb = malloc(sizeof(float) * (size_t) g_info.n_vocab);
    assert_non_null(lb);
    memcpy(lb, kvt_session_logits(b), sizeof(float) * (size_t) g_info.n_vocab);
    kvt_session_free(b);
    add(c, KVT_ROLE_USER, "Which bands is the tower painted with?");
    double d = kl(kvt_session_logits(c), lb, g_info.n_vocab);
    free(lb);
    kvt_session_free(c);
    return d;
}

static void test_long_run_parks_and_resumes(void **state) {
    (void) state;
    if (!g_eng) skip();
    assert_true(g_info.n_swa > 0); /* the model this test is about */
    char dir[] = "/tmp/kvt-chunk-swa-XXXXXX";
    assert_non_null(mkdtemp(dir));
    struct kvt_store_params sp = kvt_store_default_params();
    sp.dir = dir;
    sp.ram_bytes = 256u << 20;
    sp.disk_bytes = 1024u << 20;
    kvt_store *st = NULL;
    assert_int_equal(kvt_store_open(&sp, &st), 0);

    char sys_a[17000], sys_b[17000];
    snprintf(sys_a, sizeof sys_a, "Read the document.\n\n%s", g_doc);
    snprintf(sys_b, sizeof sys_b, "You are a careful reader. Here is a document about a coastal village.\n\n%s", g_doc);

    kvt_session *a = open_session(st, 0, true); /* stores the document's blocks under chunk keys */
    add(a, KVT_ROLE_SYSTEM, sys_a);
    add(a, KVT_ROLE_USER, "Summarise it.");
    kvt_session_free(a);
    kvt_store_flush(st);

    struct kvt_session_stats sb;
    double d_chunk = park_vs_live(st, true, sys_b, &sb);
    /* the reference: the same park/resume without chunk reuse (a cold prefill of both): how
    ** far a resumed session's next logits are from a live one's on this model anyway (cells
    ** written back in another order; Gemma's quantised matmuls amplify the rounding) */
    struct kvt_session_stats sp0;
    double d_plain = park_vs_live(NULL, false, sys_b, &sp0);
    printf("  KL(live || resumed): chunk-loaded %.3g, plain %.3g\n", d_chunk, d_plain);
    assert_true(d_chunk <= 4 * d_plain + 1e-3);
    kvt_store_free(st);
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_long_run_parks_and_resumes),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
