/* test_reuse — sessions over the content-addressed block store (src/session/reuse.c) on the tiny
** generated models (F32 cache: exactness within 1e-3 of a cold prefill's logits):
**   - restart: a prompt prefilled by one engine and store comes back EXACT in a new engine on
**     the same store directory, only the tail decoded, logits equal to the cold prefill's;
**   - PARTIAL: a prompt sharing its first blocks loads those and prefills the rest;
**   - fingerprint: a model with the same shapes and other weights never gets those blocks;
**   - tenants: another tenant's salt misses, the same tenant hits;
**   - purity: a session that evicted stores only the blocks computed before its first eviction;
**   - iSWA: on the Gemma-3-style model (window 32, blocks of 16) a prefix much longer than the
**     window loads with the sliding-window cells of its last window, logits exact;
**   - a corrupted blob file is a miss, never a wrong answer;
**   - the store replaces the host pool: one copy per sealed block (content or private entry),
**     the pool's logits, private entries gone with the session, cleared content recomputed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */
#include "test_hooks.h" /* kvt_store_test_set_clock */

#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { BLOCK = 16 };

static kvt_engine *open_tiny(const char *name) {
    static char path[1024];
    const char *d = getenv("KVT_TINY_DIR");
    snprintf(path, sizeof path, "%s/%s.gguf", d ? d : "tests/models", name);
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 1024;
    p.type_k = "f32";
    p.type_v = "f32";
    kvt_engine *e = NULL;
    int rc = kvt_engine_open(&p, &e);
    if (rc) fprintf(stderr, "open %s: %s: %s\n", path, kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, 0);
    return e;
}

static kvt_store *open_store_codec(const char *dir, const char *codec) {
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = dir;
    p.disk_codec = codec;
    p.ram_bytes = 64u << 20;
    p.disk_bytes = 256u << 20;
    kvt_store *st = NULL;
    int rc = kvt_store_open(&p, &st);
    if (rc) fprintf(stderr, "store %s: %s: %s\n", dir, kvt_strerror(rc), kvt_errmsg());
    assert_int_equal(rc, 0);
    return st;
}

static kvt_store *open_store(const char *dir) { return open_store_codec(dir, NULL); }

static const char *words[] = { "the",    "river", "mill",   "lantern", "harbor", "orchard", "comet",  "glacier",
                               "violin", "stone", "garden", "window",  "winter", "summer",  "market", "bridge" };

/* A system prompt of n words (about 5 tokens each with the tiny models' tokenizer) that differs
** from another seed's after `same` words. */
static char *document(int n, int same, unsigned seed) {
    char *t = calloc((size_t) n * 12 + 1, 1);
    unsigned r = 7;
    for (int i = 0; i < n; i++) {
        if (i == same) r ^= seed * 2654435761u;
        r = r * 1103515245u + 12345u;
        strcat(t, words[(r >> 8) % 16]);
        strcat(t, i % 9 == 8 ? ". " : " ");
    }
    return t;
}

struct run {
    float *logits;
    int32_t n_vocab;
    struct kvt_session_stats st;
};

/* The engine's last logits into out (malloc'd). */
static void keep_logits(kvt_engine *e, struct run *out) {
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    out->n_vocab = I.n_vocab;
    out->logits = malloc(sizeof(float) * (size_t) I.n_vocab);
    memcpy(out->logits, kvt_engine_logits(e), sizeof(float) * (size_t) I.n_vocab);
}

/* One conversation turn (system document + question) in a fresh session; its stats and logits. */
static void turn(kvt_engine *e, kvt_store *store, const char *tenant, int32_t budget, const char *doc, const char *q,
                 struct run *out) {
    struct kvt_session_params p = kvt_session_default_params();
    p.block = BLOCK;
    p.budget = budget;
    p.gen_reserve = 8;
    p.template_fallback = "chatml";
    p.store = store;
    p.tenant = tenant;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &p, &s), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_SYSTEM, doc, KVT_KEEP_NONE), 0);
    int rc = kvt_session_add(s, KVT_ROLE_USER, q, KVT_KEEP_NONE);
    if (rc) fprintf(stderr, "add: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
    keep_logits(e, out);
    kvt_session_get_stats(s, &out->st);
    kvt_session_free(s);
}

static double max_diff(const struct run *a, const struct run *b) {
    double m = 0;
    for (int32_t i = 0; i < a->n_vocab; i++) m = fmax(m, fabs((double) a->logits[i] - b->logits[i]));
    return m;
}

static void show(const char *what, const struct run *r) {
    printf("  %-28s route %-7s %4d of %4d looked-up tokens from the store, %4lld decoded, %lld blocks put\n", what,
           kvt_route_name(r->st.route), r->st.route_tokens, r->st.route_lookup_tokens, (long long) r->st.tokens_decoded,
           (long long) r->st.store_blocks_put);
}

static char *tmp_dir(void) {
    char *d = strdup("/tmp/kvt-reuse-XXXXXX");
    assert_non_null(mkdtemp(d));
    return d;
}

static void rm_rf(const char *dir) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static void test_restart_exact_and_partial(void **state) {
    (void) state;
    char *dir = tmp_dir();
    char *doc = document(64, 64, 0), *doc2 = document(64, 32, 99);
    struct run cold, warm, part, part_cold, other;
    /* process 1: a cold prefill stores its blocks */
    kvt_engine *e = open_tiny("tiny-llama");
    kvt_store *st = open_store(dir);
    turn(e, st, NULL, 1024, doc, "what is by the river", &cold);
    show("first run (cold)", &cold);
    assert_int_equal(cold.st.route, KVT_ROUTE_MISS);
    assert_int_equal(cold.st.store_tokens, 0);
    assert_true(cold.st.store_blocks_put >= cold.st.total_tokens / BLOCK - 1);
    kvt_store_free(st);
    kvt_engine_free(e);
    /* process 2 (a restart): a new engine on the same store directory */
    e = open_tiny("tiny-llama");
    st = open_store(dir);
    turn(e, st, NULL, 1024, doc, "what is by the river", &warm);
    show("after restart, same prompt", &warm);
    assert_int_equal(warm.st.route, KVT_ROUTE_EXACT);
    assert_int_equal(warm.st.route_tokens, warm.st.route_lookup_tokens);
    /* decoded: the tail of the system text after its last full block, then the question (a
    ** message that starts inside a block completes it by decoding; a short one is all tail) */
    assert_int_equal(warm.st.tokens_decoded, warm.st.total_tokens - warm.st.route_tokens);
    assert_true(warm.st.tokens_decoded <= 4 * BLOCK);
    assert_int_equal(warm.st.store_blocks_put, 0); /* found, so not written again */
    double d = max_diff(&cold, &warm);
    printf("  exact: max|dlogit| vs the cold prefill %.3g (tolerance 1e-3)\n", d);
    assert_true(d <= 1e-3);
    /* a prompt that shares its first half: those blocks come back, the rest is prefilled */
    turn(e, st, NULL, 1024, doc2, "what is by the river", &part);
    show("shared first half", &part);
    assert_int_equal(part.st.route, KVT_ROUTE_PARTIAL);
    assert_true(part.st.route_tokens >= 4 * BLOCK);
    assert_true(part.st.route_tokens < part.st.route_lookup_tokens);
    turn(e, NULL, NULL, 1024, doc2, "what is by the river", &part_cold);
    assert_int_equal(part_cold.st.route, KVT_ROUTE_NONE);
    d = max_diff(&part, &part_cold);
    printf("  partial: max|dlogit| vs its cold prefill %.3g (tolerance 1e-3)\n", d);
    assert_true(d <= 1e-3);
    /* control: the comparison sees a different context */
    turn(e, NULL, NULL, 1024, doc, "what is by the mill", &other);
    double dc = max_diff(&cold, &other);
    printf("  control: another question moves the logits by %.3g\n", dc);
    assert_true(dc > 1e-2);
    kvt_store_free(st);
    kvt_engine_free(e);
    free(cold.logits);
    free(warm.logits);
    free(part.logits);
    free(part_cold.logits);
    free(other.logits);
    free(doc);
    free(doc2);
    rm_rf(dir);
    free(dir);
}

static void test_fingerprint_and_tenant(void **state) {
    (void) state;
    char *dir = tmp_dir();
    char *doc = document(48, 48, 0);
    kvt_engine *a = open_tiny("tiny-llama"), *a2 = open_tiny("tiny-llama"), *b = open_tiny("tiny-llama-seed2");
    kvt_key fa, fa2, fb;
    assert_int_equal(kvt_engine_fingerprint(a, &fa), 0);
    assert_int_equal(kvt_engine_fingerprint(a2, &fa2), 0);
    assert_int_equal(kvt_engine_fingerprint(b, &fb), 0);
    assert_memory_equal(fa.b, fa2.b, KVT_KEY_BYTES);
    assert_memory_not_equal(fa.b, fb.b, KVT_KEY_BYTES);
    char la[512], lb[512];
    kvt_engine_layout(a, la, sizeof la);
    kvt_engine_layout(b, lb, sizeof lb);
    assert_string_equal(la, lb); /* same shapes and cache: only the fingerprint tells them apart */
    kvt_store *st = open_store(dir);
    struct run r1, r2, r3, r4, r5;
    turn(a, st, "tenant-a", 1024, doc, "what is by the river", &r1);
    assert_int_equal(r1.st.route, KVT_ROUTE_MISS);
    turn(b, st, "tenant-a", 1024, doc, "what is by the river", &r2);
    show("other weights, same shapes", &r2);
    assert_int_equal(r2.st.route, KVT_ROUTE_MISS);
    turn(a2, st, "tenant-b", 1024, doc, "what is by the river", &r3);
    show("other tenant", &r3);
    assert_int_equal(r3.st.route, KVT_ROUTE_MISS);
    turn(a2, st, "tenant-a", 1024, doc, "what is by the river", &r4);
    show("same tenant, other engine", &r4);
    assert_int_equal(r4.st.route, KVT_ROUTE_EXACT);
    turn(a2, st, NULL, 1024, doc, "what is by the river", &r5);
    assert_int_equal(r5.st.route, KVT_ROUTE_MISS); /* the shared namespace is a namespace too */
    assert_true(max_diff(&r1, &r4) <= 1e-3);
    kvt_store_free(st);
    kvt_engine_free(a);
    kvt_engine_free(a2);
    kvt_engine_free(b);
    free(r1.logits);
    free(r2.logits);
    free(r3.logits);
    free(r4.logits);
    free(r5.logits);
    free(doc);
    rm_rf(dir);
    free(dir);
}

/* Budget 128 under a prompt of ~300 tokens: the session evicts while the prompt is decoded.  Only
** the blocks sealed before the first eviction are stored: a block decoded after it attended to a
** context with a hole.  A later session with room for everything finds exactly those. */
static void test_purity_after_eviction(void **state) {
    (void) state;
    char *dir = tmp_dir();
    char *doc = document(64, 64, 0);
    kvt_engine *e = open_tiny("tiny-llama");
    kvt_store *st = open_store(dir);
    struct run small, big, cold;
    turn(e, st, NULL, 128, doc, "what is by the river", &small);
    show("budget 128 (evicts)", &small);
    assert_true(small.st.evictions > 0);
    /* the first eviction happens when resident passes 0.95 * 128: at most 7 full blocks before it */
    assert_true(small.st.store_blocks_put >= 1 && small.st.store_blocks_put <= 128 / BLOCK);
    turn(e, st, NULL, 1024, doc, "what is by the river", &big);
    show("budget 1024, same prompt", &big);
    assert_int_equal(big.st.route, KVT_ROUTE_PARTIAL);
    assert_int_equal(big.st.route_tokens, small.st.store_blocks_put * BLOCK);
    turn(e, NULL, NULL, 1024, doc, "what is by the river", &cold);
    double d = max_diff(&big, &cold);
    printf("  after the evicting run: max|dlogit| vs a cold prefill %.3g (tolerance 1e-3)\n", d);
    assert_true(d <= 1e-3);
    kvt_store_free(st);
    kvt_engine_free(e);
    free(small.logits);
    free(big.logits);
    free(cold.logits);
    free(doc);
    rm_rf(dir);
    free(dir);
}

/* Gemma-3-style: 5 of 6 layers see a window of 32 positions.  Each block carries the SWA cells of
** its own 16 positions (saved when sealed); loading 20+ blocks keeps those of the last window. */
static void test_swa_prefix(void **state) {
    (void) state;
    char *dir = tmp_dir();
    char *doc = document(80, 80, 0);
    kvt_engine *e = open_tiny("tiny-gemma3");
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    assert_int_equal(I.n_swa, 32);
    kvt_store *st = open_store(dir);
    struct run cold, warm;
    turn(e, st, NULL, 1024, doc, "what is by the river", &cold);
    kvt_store_free(st);
    st = open_store(dir);
    turn(e, st, NULL, 1024, doc, "what is by the river", &warm);
    show("iSWA, window 32", &warm);
    assert_int_equal(warm.st.route, KVT_ROUTE_EXACT);
    assert_true(warm.st.route_tokens >= 10 * I.n_swa);
    double d = max_diff(&cold, &warm);
    printf("  iSWA exact: max|dlogit| vs the cold prefill %.3g (tolerance 1e-3)\n", d);
    assert_true(d <= 1e-3);
    kvt_store_free(st);
    kvt_engine_free(e);
    free(cold.logits);
    free(warm.logits);
    free(doc);
    rm_rf(dir);
    free(dir);
}

/* Flip a byte in the middle of every blob file under dir (all but the SQLite index). */
static int corrupt_files(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' || !strncmp(de->d_name, "index.db", 8)) continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat sb;
        if (stat(path, &sb) != 0) continue;
        if (S_ISDIR(sb.st_mode)) {
            n += corrupt_files(path);
            continue;
        }
        if (!S_ISREG(sb.st_mode) || sb.st_size < 2) continue;
        int fd = open(path, O_RDWR);
        assert_true(fd >= 0);
        unsigned char c;
        assert_int_equal(pread(fd, &c, 1, sb.st_size / 2), 1);
        c ^= 0x5a;
        assert_int_equal(pwrite(fd, &c, 1, sb.st_size / 2), 1);
        close(fd);
        n++;
    }
    closedir(d);
    return n;
}

static void test_corrupt_is_a_miss(void **state) {
    (void) state;
    char *dir = tmp_dir();
    char *doc = document(48, 48, 0);
    kvt_engine *e = open_tiny("tiny-llama");
    kvt_store *st = open_store(dir);
    struct run cold, bad;
    turn(e, st, NULL, 1024, doc, "what is by the river", &cold);
    kvt_store_free(st);
    int n = corrupt_files(dir);
    printf("  corrupted %d blob files\n", n);
    assert_true(n >= cold.st.store_blocks_put);
    st = open_store(dir);
    turn(e, st, NULL, 1024, doc, "what is by the river", &bad);
    show("every blob corrupted", &bad);
    assert_int_equal(bad.st.route, KVT_ROUTE_MISS);
    struct kvt_store_stats ss;
    kvt_store_get_stats(st, &ss);
    assert_true(ss.disk.corrupt >= 1);
    assert_true(max_diff(&cold, &bad) <= 1e-3);
    kvt_store_free(st);
    kvt_engine_free(e);
    free(cold.logits);
    free(bad.logits);
    free(doc);
    rm_rf(dir);
    free(dir);
}

struct sizes {
    int64_t n, bytes, codec_q8, codec_ecq;
};
static int add_size(void *ud, const struct kvt_store_entry *e) {
    struct sizes *z = ud;
    z->n++;
    z->bytes += e->bytes;
    z->codec_q8 += e->codec == KVT_CODEC_Q8;
    z->codec_ecq += e->codec == KVT_CODEC_ECQ;
    return 0;
}

/* The disk tier's codec: blocks are encoded on the writer thread (q8 here), a disk hit decodes
** them (the session sees raw blob bytes), the files are smaller, and the logits after an exact
** load stay close to the cold prefill's (q8, KIVI-style groups: within 0.25 on this random F32 model,
** whose logits another question moves by ~3). */
static void test_disk_codec(void **state) {
    (void) state;
    char *dir = tmp_dir(), *dir_raw = tmp_dir();
    char *doc = document(48, 48, 0);
    kvt_engine *e = open_tiny("tiny-llama");
    struct run cold, warm, cold_raw;
    kvt_store *st = open_store_codec(dir, "q8");
    turn(e, st, NULL, 1024, doc, "what is by the river", &cold);
    kvt_store_free(st);
    st = open_store_codec(dir_raw, "raw");
    turn(e, st, NULL, 1024, doc, "what is by the river", &cold_raw);
    struct sizes zr = { 0 }, zq = { 0 };
    kvt_store_flush(st);
    assert_int_equal(kvt_store_ls(st, add_size, &zr), 0);
    kvt_store_free(st);
    st = open_store_codec(dir, "q8");
    assert_int_equal(kvt_store_ls(st, add_size, &zq), 0);
    turn(e, st, NULL, 1024, doc, "what is by the river", &warm);
    show("disk tier q8, after reopen", &warm);
    printf("  disk bytes: q8 %lld in %lld blocks (%lld q8), raw %lld in %lld blocks\n", (long long) zq.bytes, (long long) zq.n,
           (long long) zq.codec_q8, (long long) zr.bytes, (long long) zr.n);
    assert_int_equal(zq.n, zr.n);
    assert_int_equal(zq.codec_q8, zq.n);
    assert_true(zq.bytes * 10 < zr.bytes * 6); /* F32 cache: q8 is ~0.3x */
    assert_int_equal(warm.st.route, KVT_ROUTE_EXACT);
    double d = max_diff(&cold, &warm);
    printf(
        "  q8 exact load: max|dlogit| vs the cold prefill %.3g (bound 0.25, a tenth of what another question moves; raw gives 0)\n",
        d);
    assert_true(d > 0 && d <= 0.25); /* lossy, bounded: really decoded, not the RAM copy */
    kvt_store_free(st);
    /* ecq (entropy-coded) beside q4, same run: fewer bytes than q4, every block coded, an exact
    ** load decoded, its logits about as close to the cold prefill's as q4's (within 3x: this
    ** random-weight model's K/V are nearly uniform, where q4's range step, 0.23 sigma, is finer than
    ** ecq's 0.3 sigma; KL on trained models is bench codec's, and test_codec's engine test) */
    const char *lossy[2] = { "q4", "ecq" };
    struct sizes zl[2];
    double dl[2];
    for (int k = 0; k < 2; k++) {
        char *dir_e = tmp_dir();
        struct run cold_e, warm_e;
        st = open_store_codec(dir_e, lossy[k]);
        turn(e, st, NULL, 1024, doc, "what is by the river", &cold_e);
        kvt_store_free(st);
        st = open_store_codec(dir_e, lossy[k]);
        zl[k] = (struct sizes){ 0 };
        assert_int_equal(kvt_store_ls(st, add_size, &zl[k]), 0);
        turn(e, st, NULL, 1024, doc, "what is by the river", &warm_e);
        dl[k] = max_diff(&cold_e, &warm_e);
        printf("  disk bytes: %s %lld in %lld blocks (%lld ecq); exact load max|dlogit| %.3g\n", lossy[k], (long long) zl[k].bytes,
               (long long) zl[k].n, (long long) zl[k].codec_ecq, dl[k]);
        assert_int_equal(zl[k].n, zr.n);
        assert_int_equal(warm_e.st.route, KVT_ROUTE_EXACT);
        assert_true(dl[k] > 0); /* decoded, not the RAM copy */
        kvt_store_free(st);
        free(cold_e.logits);
        free(warm_e.logits);
        rm_rf(dir_e);
        free(dir_e);
    }
    assert_int_equal(zl[1].codec_ecq, zl[1].n);
    assert_true(zl[1].bytes < zl[0].bytes);
    assert_true(dl[1] <= 3 * dl[0]);
    /* a spec the codec parser refuses is refused at open, naming it */
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = dir;
    p.disk_codec = "q3";
    kvt_store *bad = NULL;
    assert_int_equal(kvt_store_open(&p, &bad), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "q3"));
    kvt_engine_free(e);
    free(cold.logits);
    free(warm.logits);
    free(cold_raw.logits);
    free(doc);
    rm_rf(dir);
    rm_rf(dir_raw);
    free(dir);
    free(dir_raw);
}

/* The disk tier's per-head bits (kvt_store_params.disk_codec_bits, what `--codec-bits entropy`
** gives): every block is written with the table, each (layer, KV head) unit coded at its bits.
** Bytes prove it exactly: a table of all 4s costs q4's bytes plus the table, all 8s q8's plus the
** table (the control: a store that ignored the table would write q4 bytes for both), and half at
** 8 lies at the midpoint.  A store reopened with the table loads its blocks (an exact route,
** decoded: logits differ from the cold prefill's).  Bad tables are refused at open, named. */
static void test_disk_codec_bits(void **state) {
    (void) state;
    char *doc = document(48, 48, 0);
    kvt_engine *e = open_tiny("tiny-llama");
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    const int32_t nu = I.n_layer * I.n_head_kv;
    uint8_t *b4 = malloc((size_t) nu), *b8 = malloc((size_t) nu), *bh = malloc((size_t) nu);
    memset(b4, 4, (size_t) nu);
    memset(b8, 8, (size_t) nu);
    for (int32_t i = 0; i < nu; i++) bh[i] = i < nu / 2 ? 8 : 4;
    const char *codec[5] = { "q4", "q8", "q4", "q4", "q4" };
    const uint8_t *bits[5] = { NULL, NULL, b4, b8, bh };
    struct sizes z[5];
    struct run cold, warm;
    char *dir[5];
    for (int k = 0; k < 5; k++) {
        dir[k] = tmp_dir();
        struct kvt_store_params p = kvt_store_default_params();
        p.dir = dir[k];
        p.disk_codec = codec[k];
        p.disk_codec_heads = I.n_head_kv;
        p.disk_codec_bits = bits[k];
        p.n_disk_codec_bits = bits[k] ? nu : 0;
        p.ram_bytes = 64u << 20;
        kvt_store *st = NULL;
        assert_int_equal(kvt_store_open(&p, &st), 0);
        turn(e, st, NULL, 1024, doc, "what is by the river", &cold);
        kvt_store_flush(st);
        z[k] = (struct sizes){ 0 };
        assert_int_equal(kvt_store_ls(st, add_size, &z[k]), 0);
        kvt_store_free(st);
        if (k < 4) free(cold.logits);
        printf("  %s%s: %lld bytes in %lld blocks\n", codec[k],
               k == 2   ? " + all-4 table"
               : k == 3 ? " + all-8 table"
               : k == 4 ? " + half-8 table"
                        : "",
               (long long) z[k].bytes, (long long) z[k].n);
        assert_true(z[k].n > 0);
        assert_int_equal(z[k].n, z[0].n);
    }
    const int64_t table = z[0].n * (8 + ((nu + 7) / 8) * 8); /* u32 count, u32 0, entries padded to 8 */
    assert_int_equal(z[2].bytes - z[0].bytes, table);
    assert_int_equal(z[3].bytes - z[1].bytes, table);
    assert_true(z[1].bytes > z[0].bytes + table); /* the control can see a table that is ignored */
    if (nu % 2 == 0) assert_int_equal(2 * (z[4].bytes - table), z[0].bytes + z[1].bytes);
    /* reopen the half-8 store with its table: the blocks load, decoded */
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = dir[4];
    p.disk_codec = "q4";
    p.disk_codec_heads = I.n_head_kv;
    p.disk_codec_bits = bh;
    p.n_disk_codec_bits = nu;
    kvt_store *st = NULL;
    assert_int_equal(kvt_store_open(&p, &st), 0);
    turn(e, st, NULL, 1024, doc, "what is by the river", &warm);
    assert_int_equal(warm.st.route, KVT_ROUTE_EXACT);
    const double d = max_diff(&cold, &warm);
    printf("  half-8 exact load: max|dlogit| vs the cold prefill %.3g\n", d);
    assert_true(d > 0 && d <= 1.0);
    kvt_store_free(st);
    /* refused at open, naming what is wrong */
    uint8_t *bad5 = malloc((size_t) nu);
    memset(bad5, 4, (size_t) nu);
    bad5[nu - 1] = 5;
    struct {
        const char *codec;
        const uint8_t *bits;
        int32_t n;
        const char *needle;
    } bad[] = { { "q4", bad5, nu, "5" },
                { "raw", b4, nu, "q8 and q4" },
                { "elastic", b4, nu, "q8 and q4" },
                { "q4", b4, 0, "entries" },
                { "q4", NULL, nu, "entries" } };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        p.disk_codec = bad[i].codec;
        p.disk_codec_bits = bad[i].bits;
        p.n_disk_codec_bits = bad[i].n;
        kvt_store *x = NULL;
        assert_int_equal(kvt_store_open(&p, &x), KVT_EINVAL);
        assert_null(x);
        printf("  refused: %s\n", kvt_errmsg());
        assert_non_null(strstr(kvt_errmsg(), bad[i].needle));
        assert_non_null(strstr(kvt_errmsg(), "store disk codec bits: codec ")); /* the wrapped message whole */
    }
    kvt_engine_free(e);
    free(cold.logits);
    free(warm.logits);
    free(doc);
    free(b4);
    free(b8);
    free(bh);
    free(bad5);
    for (int k = 0; k < 5; k++) {
        rm_rf(dir[k]);
        free(dir[k]);
    }
}

/* ---- the store replaces the host pool ------------------------------------------------------ */

/* A conversation under budget 128 (it evicts while the ~300-token document is decoded): the
** document, a question, park + resume (every resident block comes back from its copy), a second
** question.  With a store the session has no pool: its copies are the store's.  clear_store:
** `kvtier store clear` between the park and the resume (the content entries go, the private ones
** stay); AGED: the store's clock moves 8 days on instead (every content entry past its TTL, 7
** days hot).  *out: the logits after the second question and the stats; *sealed: sealed blocks. */
enum parked { KEPT, CLEARED, AGED };

struct fresh {
    double now;
    int64_t n, fresh;
};

static int count_fresh(void *ud, const struct kvt_store_entry *e) {
    struct fresh *f = ud;
    f->n++;
    f->fresh += e->expires > f->now;
    return 0;
}

static kvt_session *conversation(kvt_engine *e, kvt_store *store, enum parked meanwhile, struct run *out, int32_t *sealed) {
    struct kvt_session_params p = kvt_session_default_params();
    p.block = BLOCK;
    p.budget = 128;
    p.gen_reserve = 8;
    p.template_fallback = "chatml";
    p.store = store;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &p, &s), 0);
    char *doc = document(64, 64, 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_SYSTEM, doc, KVT_KEEP_NONE), 0);
    free(doc);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "what is by the river", KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_park(s), 0);
    if (meanwhile == CLEARED) assert_int_equal(kvt_store_clear(store), 0);
    if (meanwhile == AGED) {
        kvt_store_flush(store); /* the index rows written: ls sees them */
        struct fresh f = { (double) time(NULL) + 8 * 86400.0, 0, 0 };
        kvt_store_test_set_clock(store, f.now);
        assert_int_equal(kvt_store_ls(store, count_fresh, &f), 0);
        printf("  8 days later: %lld content entries, %lld of them within their TTL\n", (long long) f.n, (long long) f.fresh);
        assert_true(f.n > 0);
        assert_int_equal(f.fresh, 0); /* a lookup by another session would miss every one */
    }
    assert_int_equal(kvt_session_resume(s, 0), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "and what is in the orchard", KVT_KEEP_NONE), 0);
    keep_logits(e, out);
    kvt_session_get_stats(s, &out->st);
    *sealed = 0;
    for (int32_t i = 0; i < out->st.n_blocks; i++) {
        struct kvt_block_info bi;
        assert_int_equal(kvt_session_block(s, i, &bi), 0);
        *sealed += bi.sealed;
    }
    return s;
}

/* A session with a store keeps each sealed block's copy exactly once: a pure block's is its
** content entry (shared), every other block's a private entry of the store; no host pool.  The
** conversation (evictions, park/resume loading every resident block) gives the logits of the
** same conversation over a host pool; freeing the session removes its private entries, not the
** shared ones.  Content entries gone meanwhile (store clear) are recomputed, counted, never a
** hole; the private entries survive a clear.  Parked past every content entry's TTL, the session
** still loads its own copies (none recomputed).  A pool and a store together are refused. */
static void test_store_replaces_pool(void **state) {
    (void) state;
    char *dir = tmp_dir();
    kvt_engine *e = open_tiny("tiny-llama");
    struct run pool, store, cleared;
    int32_t pool_sealed, store_sealed, cleared_sealed;
    kvt_session *s = conversation(e, NULL, KEPT, &pool, &pool_sealed);
    kvt_session_free(s);
    kvt_store *st = open_store(dir);
    s = conversation(e, st, KEPT, &store, &store_sealed);
    struct kvt_store_stats ss;
    kvt_store_get_stats(st, &ss);
    printf("  pool:  %d sealed blocks, %lld evictions, %lld recoveries, %lld recomputes, pool %lld entries\n", pool_sealed,
           (long long) pool.st.evictions, (long long) pool.st.recoveries, (long long) pool.st.recomputes,
           (long long) pool.st.pool.n_entries);
    printf("  store: %d sealed blocks, %lld evictions, %lld recoveries, %lld recomputes; %lld content blocks put, "
           "%lld private entries (%lld B RAM); RAM tier %lld entries\n",
           store_sealed, (long long) store.st.evictions, (long long) store.st.recoveries, (long long) store.st.recomputes,
           (long long) store.st.store_blocks_put, (long long) ss.priv.n_entries, (long long) ss.priv.ram_bytes,
           (long long) ss.ram.entries);
    assert_true(store.st.evictions > 0 && store.st.recoveries > 0);
    assert_int_equal(store.st.recomputes, 0);
    assert_int_equal(store.st.evictions, pool.st.evictions);
    assert_int_equal(store.st.recoveries, pool.st.recoveries);
    assert_true(store.st.store_blocks_put > 0 && ss.priv.n_entries > 0);
    /* one copy per sealed block: content entries for the pure ones, private entries for the rest */
    assert_int_equal(store.st.store_blocks_put + ss.priv.n_entries, store_sealed);
    assert_int_equal(pool.st.pool.n_entries, pool_sealed);        /* the pool holds every block's copy */
    assert_int_equal(store.st.pool.n_entries, ss.priv.n_entries); /* the session's stats show the store's */
    double d = max_diff(&store, &pool);
    printf("  max|dlogit| store vs pool %.3g\n", d);
    assert_true(d <= 1e-5);
    kvt_session_free(s);
    kvt_store_get_stats(st, &ss);
    assert_int_equal(ss.priv.n_entries, 0);
    assert_int_equal(ss.priv.ram_bytes, 0);
    assert_true(ss.ram.entries >= store.st.store_blocks_put); /* shared: they stay */

    /* the content entries cleared while the session is parked: its pure blocks are recomputed */
    s = conversation(e, st, CLEARED, &cleared, &cleared_sealed);
    printf("  store cleared while parked: %lld recomputes, %lld recoveries\n", (long long) cleared.st.recomputes,
           (long long) cleared.st.recoveries);
    assert_int_equal(cleared_sealed, pool_sealed);
    assert_true(cleared.st.recomputes > 0);
    assert_true(cleared.st.recomputes < cleared.st.recoveries); /* the private entries came back as they were */
    d = max_diff(&cleared, &pool);
    printf("  max|dlogit| after recomputes vs pool %.3g (tolerance 1e-3)\n", d);
    assert_true(d <= 1e-3);
    kvt_session_free(s);

    /* parked past every content entry's TTL: its own copies still load (kvt_store_get_copy), none
    ** recomputed, the pool run's logits */
    struct run aged;
    int32_t aged_sealed;
    s = conversation(e, st, AGED, &aged, &aged_sealed);
    d = max_diff(&aged, &pool);
    printf("  parked 8 days: %lld recomputes, %lld recoveries, max|dlogit| vs pool %.3g\n", (long long) aged.st.recomputes,
           (long long) aged.st.recoveries, d);
    assert_int_equal(aged.st.recomputes, 0);
    assert_int_equal(aged.st.recoveries, pool.st.recoveries);
    assert_true(d <= 1e-5);
    kvt_session_free(s);

    /* a pool and a store together: refused, naming both */
    kvt_pool *pl = NULL;
    assert_int_equal(kvt_pool_open(NULL, &pl), 0);
    struct kvt_session_params p = kvt_session_default_params();
    p.pool = pl;
    p.store = st;
    assert_int_equal(kvt_session_open(e, &p, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "pool"));
    assert_non_null(strstr(kvt_errmsg(), "store"));
    kvt_pool_free(pl);
    kvt_store_free(st);
    kvt_engine_free(e);
    free(pool.logits);
    free(store.logits);
    free(cleared.logits);
    free(aged.logits);
    rm_rf(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_restart_exact_and_partial), cmocka_unit_test(test_fingerprint_and_tenant),
        cmocka_unit_test(test_purity_after_eviction),     cmocka_unit_test(test_swa_prefix),
        cmocka_unit_test(test_corrupt_is_a_miss),         cmocka_unit_test(test_disk_codec),
        cmocka_unit_test(test_disk_codec_bits),           cmocka_unit_test(test_store_replaces_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
