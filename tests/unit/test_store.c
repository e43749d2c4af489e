/* test_store.c — the block store (kvtier.h section 8): chain keys (their exact bytes, across
** processes, sensitivity to every parameter), round trips through RAM and through disk after a
** restart, RAM LRU, disk quota eviction with hot promotion, TTL expiry (injected clock), and
** every kind of damaged blob file read back as a counted miss, never as data; private entries
** (sessions' own copies) sharing the RAM budget, spilling, without TTL, outside the index.
** Faults, the full queue, kill -9 and gc/verify are in test_store_faults.c. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "store_fixture.h"
#include "test_hooks.h"

#include <ctype.h>
#include <spawn.h>
#include <sqlite3.h>
#include <sys/wait.h>

extern char **environ;

static kvt_key MODEL_A, MODEL_B;


static kvt_store *open_store(const char *dir, size_t ram, size_t disk) {
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = dir;
    p.ram_bytes = ram;
    p.disk_bytes = disk;
    kvt_store *st = NULL;
    int rc = kvt_store_open(&p, &st);
    if (rc) fail_msg("kvt_store_open %s: %s (%s)", dir ? dir : "(RAM only)", kvt_strerror(rc), kvt_errmsg());
    return st;
}

static void put_block(kvt_store *st, const kvt_key *model, const kvt_key *k) {
    size_t n;
    uint8_t *b = sk_content(k, &n);
    struct kvt_store_meta m = sk_meta(model, k);
    int rc = kvt_store_put(st, k, &m, b, n);
    if (rc) fail_msg("put: %s (%s)", kvt_strerror(rc), kvt_errmsg());
    free(b);
}

/* n blocks of MODEL_A with keys sk_key(tag, i) (OUT ks[n]) written to the disk tier of a store
** at dir, which is closed again (every write on disk). */
static void fill_disk(const char *dir, const char *tag, kvt_key *ks, int n) {
    kvt_store *st = open_store(dir, 0, 1 << 20);
    for (int i = 0; i < n; i++) {
        ks[i] = sk_key(tag, i);
        put_block(st, &MODEL_A, &ks[i]);
    }
    kvt_store_free(st);
}

/* get must return exactly the key's bytes and meta; returns the tier. */
static enum kvt_tier expect_block(kvt_store *st, const kvt_key *model, const kvt_key *k) {
    void *got = NULL;
    size_t n = 0, want_n;
    struct kvt_store_meta m;
    enum kvt_tier tier = KVT_TIER_NONE;
    int rc = kvt_store_get(st, k, model, &got, &n, &m, &tier);
    if (rc) fail_msg("get: %s (%s)", kvt_strerror(rc), kvt_errmsg());
    uint8_t *want = sk_content(k, &want_n);
    assert_int_equal(n, want_n);
    assert_memory_equal(got, want, n);
    struct kvt_store_meta wm = sk_meta(model, k);
    assert_memory_equal(m.model.b, wm.model.b, KVT_KEY_BYTES);
    assert_int_equal(m.n_tokens, wm.n_tokens);
    assert_int_equal(m.codec, 0);
    free(want);
    free(got);
    return tier;
}

static int get_rc(kvt_store *st, const kvt_key *model, const kvt_key *k) {
    void *got = (void *) 1;
    size_t n = 99;
    int rc = kvt_store_get(st, k, model, &got, &n, NULL, NULL);
    if (rc) {
        assert_null(got);
        assert_int_equal(n, 0);
    }
    free(got);
    return rc;
}

static struct kvt_store_stats stats(kvt_store *st) {
    struct kvt_store_stats s;
    kvt_store_get_stats(st, &s);
    return s;
}

/* ---- keys ------------------------------------------------------------------------------------ */

static const kvt_token TOKS[] = { 2, 651, 1234567, -1, 0, 65535, 7, 99 };

static kvt_key chain_of(const struct kvt_chain_params *p, int n_blocks) {
    kvt_key k;
    assert_int_equal(kvt_chain_root(p, &k), 0);
    for (int i = 0; i < n_blocks; i++) assert_int_equal(kvt_chain_next(&k, TOKS + 2 * i, 2, &k), 0);
    return k;
}

static struct kvt_chain_params base_params(void) {
    return (struct kvt_chain_params){ .model = MODEL_A, .layout = "v1 k=f16 v=f16 L=18 H=1 D=256", .block = 64, .tenant = NULL };
}

/* h_0 and h_1 rebuilt here from the documented bytes (docs/STORE.md): the encoding is pinned. */
static void test_chain_known_bytes(void **state) {
    (void) state;
    struct kvt_chain_params p = base_params();
    p.tenant = "acme";
    uint8_t buf[512], *w = buf;
#define U32(v)                                                            \
    do {                                                                  \
        uint32_t v_ = (uint32_t) (v);                                     \
        for (int i_ = 0; i_ < 4; i_++) *w++ = (uint8_t) (v_ >> (8 * i_)); \
    } while (0)
    U32(12);
    memcpy(w, "kvtier-chain", 12);
    w += 12;
    U32(1);
    memcpy(w, MODEL_A.b, 32);
    w += 32;
    U32(strlen(p.layout));
    memcpy(w, p.layout, strlen(p.layout));
    w += strlen(p.layout);
    U32(64);
    U32(4);
    memcpy(w, "acme", 4);
    w += 4;
    kvt_key want0, got0, want1, got1;
    assert_int_equal(kvt__sha256(buf, (size_t) (w - buf), want0.b), 0);
    assert_int_equal(kvt_chain_root(&p, &got0), 0);
    assert_memory_equal(got0.b, want0.b, 32);
    w = buf;
    memcpy(w, want0.b, 32);
    w += 32;
    for (int i = 0; i < 8; i++) U32(TOKS[i]);
#undef U32
    assert_int_equal(kvt__sha256(buf, (size_t) (w - buf), want1.b), 0);
    assert_int_equal(kvt_chain_next(&got0, TOKS, 8, &got1), 0);
    assert_memory_equal(got1.b, want1.b, 32);
}

/* Each parameter changes the key; NULL and "" tenant are the same namespace; tokens are
** order-sensitive; a chain split differently into blocks differs (the chain is per block). */
static void test_chain_sensitivity(void **state) {
    (void) state;
    struct kvt_chain_params p = base_params();
    kvt_key k0 = chain_of(&p, 2), k;
    p.tenant = "";
    k = chain_of(&p, 2);
    assert_memory_equal(k.b, k0.b, 32);
    struct kvt_chain_params v[4];
    for (int i = 0; i < 4; i++) v[i] = base_params();
    v[0].tenant = "tenant-2";
    v[1].model = MODEL_B;
    v[2].block = 32;
    v[3].layout = "v1 k=q8_0 v=f16 L=18 H=1 D=256";
    kvt_key ks[4];
    for (int i = 0; i < 4; i++) {
        ks[i] = chain_of(&v[i], 2);
        assert_memory_not_equal(ks[i].b, k0.b, 32);
        for (int j = 0; j < i; j++) assert_memory_not_equal(ks[i].b, ks[j].b, 32);
    }
    /* layout "ab" + tenant "c" must differ from layout "a" + tenant "bc" (length prefixes) */
    struct kvt_chain_params a = base_params(), b = base_params();
    a.layout = "ab";
    a.tenant = "c";
    b.layout = "a";
    b.tenant = "bc";
    kvt_key ka = chain_of(&a, 0), kb = chain_of(&b, 0);
    assert_memory_not_equal(ka.b, kb.b, 32);
    /* token order */
    kvt_key r, x, y;
    kvt_token t1[] = { 1, 2 }, t2[] = { 2, 1 };
    assert_int_equal(kvt_chain_root(&p, &r), 0);
    assert_int_equal(kvt_chain_next(&r, t1, 2, &x), 0);
    assert_int_equal(kvt_chain_next(&r, t2, 2, &y), 0);
    assert_memory_not_equal(x.b, y.b, 32);
    /* [1,2] as one block differs from [1] then [2] */
    assert_int_equal(kvt_chain_next(&r, t1, 1, &y), 0);
    assert_int_equal(kvt_chain_next(&y, t1 + 1, 1, &y), 0);
    assert_memory_not_equal(x.b, y.b, 32);
    /* errors */
    p.layout = NULL;
    assert_int_equal(kvt_chain_root(&p, &k), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "layout"));
    p = base_params();
    p.block = 0;
    assert_int_equal(kvt_chain_root(&p, &k), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "block size 0"));
    assert_int_equal(kvt_chain_next(&r, NULL, 3, &k), KVT_EINVAL);
    assert_int_equal(kvt_chain_next(&r, t1, -1, &k), KVT_EINVAL);
}

static void test_key_hex(void **state) {
    (void) state;
    kvt_key k = sk_key("hex", 1), back;
    char hex[65];
    kvt_key_hex(&k, hex);
    assert_int_equal(strlen(hex), 64);
    assert_int_equal(kvt_key_parse(hex, &back), 0);
    assert_memory_equal(back.b, k.b, 32);
    for (int i = 0; i < 64; i++) hex[i] = (char) toupper((unsigned char) hex[i]);
    assert_int_equal(kvt_key_parse(hex, &back), 0);
    assert_memory_equal(back.b, k.b, 32);
    hex[10] = 'g';
    assert_int_equal(kvt_key_parse(hex, &back), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "at 10"));
    assert_int_equal(kvt_key_parse("abc", &back), KVT_EINVAL);
    kvt_key_hex(&k, hex);
    char longer[80];
    snprintf(longer, sizeof longer, "%s0", hex);
    assert_int_equal(kvt_key_parse(longer, &back), KVT_EINVAL);
    assert_string_equal(kvt_tier_name(KVT_TIER_DISK), "disk");
    assert_string_equal(kvt_tier_name(42), "unknown");
}

/* Two processes (this program exec'd again: nothing shared but the inputs) compute the same
** chain key; the parent's key for another tenant differs from the child's. */
static void print_chain_key(void) {
    struct kvt_chain_params p = base_params();
    kvt_key k = chain_of(&p, 4);
    char hex[65];
    kvt_key_hex(&k, hex);
    printf("%s\n", hex);
}

static void child_key(char out[65]) {
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd[1], 1);
    posix_spawn_file_actions_addclose(&fa, fd[0]);
    char *argv[] = { "test_store", "--print-chain-key", NULL };
    pid_t pid;
    /* cross-built and run under an emulator (KVT_TEST_EMULATOR, e.g. "qemu-aarch64-static -cpu
    ** max": tests/CMakeLists.txt), the host cannot exec this program itself: the emulator runs it */
    const char *emu = getenv("KVT_TEST_EMULATOR");
    if (emu && *emu) {
        char self[4096], words[512], *ev[16];
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        assert_true(n > 0);
        self[n] = '\0';
        snprintf(words, sizeof words, "%s", emu);
        int ac = 0;
        for (char *w = strtok(words, " "); w && ac < 12; w = strtok(NULL, " ")) ev[ac++] = w;
        ev[ac++] = self;
        ev[ac++] = "--print-chain-key";
        ev[ac] = NULL;
        assert_int_equal(posix_spawnp(&pid, ev[0], &fa, NULL, ev, environ), 0);
    } else {
        assert_int_equal(posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, environ), 0);
    }
    posix_spawn_file_actions_destroy(&fa);
    close(fd[1]);
    char buf[128] = { 0 };
    size_t got = 0;
    ssize_t r;
    while (got < sizeof buf - 1 && (r = read(fd[0], buf + got, sizeof buf - 1 - got)) > 0) got += (size_t) r;
    close(fd[0]);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_int_equal(got, 65);
    memcpy(out, buf, 64);
    out[64] = '\0';
}

static void test_chain_across_processes(void **state) {
    (void) state;
    char theirs[65], ours[65], other[65];
    child_key(theirs);
    struct kvt_chain_params p = base_params();
    kvt_key k = chain_of(&p, 4);
    kvt_key_hex(&k, ours);
    assert_string_equal(theirs, ours);
    p.tenant = "someone-else";
    k = chain_of(&p, 4);
    kvt_key_hex(&k, other);
    assert_string_not_equal(theirs, other);
}

/* ---- tiers ---------------------------------------------------------------------------------- */

static int sum_hits(void *ud, const struct kvt_store_entry *e) {
    int64_t *acc = ud;
    acc[0] += e->hits;
    acc[1]++;
    return 0;
}

/* RAM first; after close + reopen the same blocks come from disk, then from RAM again. */
static void test_roundtrip_restart(void **state) {
    struct sk_fx *f = *state;
    enum { N = 24 };
    kvt_store *st = open_store(f->dir, 1 << 20, 64 << 20);
    for (int i = 0; i < N; i++) {
        kvt_key k = sk_key("rt", i);
        put_block(st, &MODEL_A, &k);
    }
    for (int i = 0; i < N; i++) {
        kvt_key k = sk_key("rt", i);
        assert_int_equal(expect_block(st, &MODEL_A, &k), KVT_TIER_RAM);
        assert_true(kvt_store_has(st, &k));
    }
    kvt_store_free(st); /* writes the queue out */
    st = open_store(f->dir, 1 << 20, 64 << 20);
    struct kvt_store_stats s = stats(st);
    assert_int_equal(s.disk.entries, N);
    assert_int_equal(s.ram.entries, 0);
    for (int i = 0; i < N; i++) {
        kvt_key k = sk_key("rt", i);
        assert_true(kvt_store_has(st, &k));
        assert_int_equal(expect_block(st, &MODEL_A, &k), KVT_TIER_DISK);
        assert_int_equal(expect_block(st, &MODEL_A, &k), KVT_TIER_RAM);
    }
    s = stats(st);
    assert_int_equal(s.disk.hits, N);
    assert_int_equal(s.ram.hits, N);
    kvt_key absent = sk_key("rt", N);
    assert_false(kvt_store_has(st, &absent));
    assert_int_equal(get_rc(st, &MODEL_A, &absent), KVT_ENOENT);
    /* hits reach the index (batched by the writer, written out at close) */
    assert_int_equal(kvt_store_ls(st, NULL, NULL), KVT_EINVAL);
    kvt_store_free(st);
    st = open_store(f->dir, 0, 64 << 20);
    int64_t acc[2] = { 0, 0 };
    assert_int_equal(kvt_store_ls(st, sum_hits, acc), 0);
    assert_int_equal(acc[1], N);
    assert_int_equal(acc[0], 3 * N); /* RAM hit, disk hit, RAM hit */
    kvt_store_free(st);
}

/* RAM only: a budget of 10 blocks keeps the 10 most recently used; a block touched by a get
** survives, the least recently used leave first. */
static void test_ram_lru(void **state) {
    (void) state;
    kvt_key ks[16];
    size_t size = 0;
    for (int i = 0; i < 16; i++) ks[i] = sk_key("lru", i);
    /* equal sizes make the count exact: use a fixed size via raw puts */
    kvt_store *st = open_store(NULL, 10 * 1000, 0);
    uint8_t blob[1000];
    for (int i = 0; i < 16; i++) {
        memset(blob, i, sizeof blob);
        struct kvt_store_meta m = { .model = MODEL_A, .n_tokens = 8 };
        assert_int_equal(kvt_store_put(st, &ks[i], &m, blob, sizeof blob), 0);
        size += sizeof blob;
        if (i >= 1) { /* keep block 0 the most recently used */
            void *d;
            size_t n;
            assert_int_equal(kvt_store_get(st, &ks[0], &MODEL_A, &d, &n, NULL, NULL), 0);
            free(d);
        }
        struct kvt_store_stats s = stats(st);
        assert_true(s.ram.bytes <= 10 * 1000);
    }
    struct kvt_store_stats s = stats(st);
    assert_int_equal(s.ram.entries, 10);
    assert_int_equal(s.ram.evictions, 6);
    assert_true(kvt_store_has(st, &ks[0]));
    for (int i = 1; i <= 6; i++) assert_false(kvt_store_has(st, &ks[i]));
    for (int i = 7; i < 16; i++) assert_true(kvt_store_has(st, &ks[i]));
    /* larger than the whole tier: not stored, counted */
    uint8_t *big = calloc(1, 20000);
    struct kvt_store_meta m = { .model = MODEL_A };
    kvt_key kb = sk_key("lru-big", 0);
    assert_int_equal(kvt_store_put(st, &kb, &m, big, 20000), 0);
    free(big);
    assert_false(kvt_store_has(st, &kb));
    assert_int_equal(stats(st).ram.writes_dropped, 1);
    kvt_store_free(st);
}

/* Disk quota of 10 blocks: writing 15 evicts the 5 least recently hit, except a hot block
** (hot_hits hits), which outlives colder ones written after it. */
static void test_disk_quota(void **state) {
    struct sk_fx *f = *state;
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = f->dir;
    p.ram_bytes = 0;
    p.disk_bytes = 10 * 1000;
    p.hot_hits = 2;
    kvt_store *st;
    assert_int_equal(kvt_store_open(&p, &st), 0);
    const double t0 = 1.7e9;
    uint8_t blob[1000];
    kvt_key ks[15];
    struct kvt_store_meta m = { .model = MODEL_A, .n_tokens = 8 };
    for (int i = 0; i < 15; i++) {
        ks[i] = sk_key("quota", i);
        kvt_store_test_set_clock(st, t0 + i);
        memset(blob, i, sizeof blob);
        assert_int_equal(kvt_store_put(st, &ks[i], &m, blob, sizeof blob), 0);
        kvt_store_flush(st);
        if (i == 2) { /* block 0 becomes hot: two hits (now older than blocks 1..) */
            for (int h = 0; h < 2; h++) {
                void *d;
                size_t n;
                assert_int_equal(kvt_store_get(st, &ks[0], &MODEL_A, &d, &n, NULL, NULL), 0);
                free(d);
            }
            kvt_store_flush(st);
        }
        assert_true(stats(st).disk.bytes <= 10 * 1000);
    }
    struct kvt_store_stats s = stats(st);
    assert_int_equal(s.disk.entries, 10);
    assert_int_equal(s.disk.evictions, 5);
    assert_int_equal(s.disk.writes, 15);
    assert_true(kvt_store_has(st, &ks[0])); /* hot: stays */
    for (int i = 1; i <= 5; i++) assert_false(kvt_store_has(st, &ks[i]));
    for (int i = 6; i < 15; i++) assert_true(kvt_store_has(st, &ks[i]));
    assert_int_equal(sk_count_files(f->dir), 10);
    /* a block larger than the quota is dropped */
    uint8_t *big = calloc(1, 20000);
    kvt_key kb = sk_key("quota-big", 0);
    assert_int_equal(kvt_store_put(st, &kb, &m, big, 20000), 0);
    free(big);
    kvt_store_flush(st);
    assert_int_equal(stats(st).disk.writes_dropped, 1);
    assert_int_equal(stats(st).disk.entries, 10);
    kvt_store_free(st);
}

/* TTL 100 s, 1000 s once hot (3 hits), on the injected clock; disk tier and RAM tier. */
static void ttl_case(const char *dir, size_t ram, size_t disk) {
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = dir;
    p.ram_bytes = ram;
    p.disk_bytes = disk;
    p.ttl_s = 100;
    p.ttl_hot_s = 1000;
    p.hot_hits = 3;
    kvt_store *st;
    assert_int_equal(kvt_store_open(&p, &st), 0);
    const double t0 = 1.8e9;
    kvt_store_test_set_clock(st, t0);
    kvt_key a = sk_key("ttl-a", 0), b = sk_key("ttl-b", 0), c = sk_key("ttl-c", 0);
    put_block(st, &MODEL_A, &a);
    put_block(st, &MODEL_A, &b);
    put_block(st, &MODEL_A, &c);
    kvt_store_flush(st);
    kvt_store_test_set_clock(st, t0 + 10);
    for (int i = 0; i < 3; i++) expect_block(st, &MODEL_A, &a); /* a: hot from now on */
    expect_block(st, &MODEL_A, &c);                             /* c: one hit, still cold */
    kvt_store_flush(st);
    kvt_store_test_set_clock(st, t0 + 105); /* b: 105 s after its write; c: 95 s after its hit */
    assert_false(kvt_store_has(st, &b));
    assert_int_equal(get_rc(st, &MODEL_A, &b), KVT_ENOENT);
    assert_non_null(strstr(kvt_errmsg(), "expired"));
    expect_block(st, &MODEL_A, &c);
    kvt_store_flush(st);
    kvt_store_test_set_clock(st, t0 + 500); /* a: hot, 490 s after its hit; c: expired */
    expect_block(st, &MODEL_A, &a);
    kvt_store_flush(st);
    assert_int_equal(get_rc(st, &MODEL_A, &c), KVT_ENOENT);
    kvt_store_test_set_clock(st, t0 + 1600); /* a: 1100 s after its last hit */
    assert_int_equal(get_rc(st, &MODEL_A, &a), KVT_ENOENT);
    struct kvt_store_stats s = stats(st);
    struct kvt_store_tier_stats *t = disk ? &s.disk : &s.ram;
    assert_int_equal(t->expired, 3);
    /* met expired by lookups (and by the prefetcher's reads, the same path), but still the copy of
    ** the session that wrote them: nothing removed them (issue #24 item 7: a get used to delete
    ** the row and the file, and the session's next kvt_store_get_copy recomputed the block) */
    if (disk) assert_int_equal(s.disk.entries, 3);
    for (int i = 0; i < 3; i++) {
        const kvt_key *k = i == 0 ? &a : i == 1 ? &b : &c;
        void *got = NULL;
        size_t n = 0, want_n;
        assert_int_equal(kvt_store_get_copy(st, k, &MODEL_A, &got, &n), 0);
        uint8_t *want = sk_content(k, &want_n);
        assert_int_equal(n, want_n);
        assert_memory_equal(got, want, n);
        free(want);
        free(got);
    }
    if (disk) { /* gc is what removes them (the quota's make_room too: test_quota) */
        kvt_store_flush(st);
        kvt_store_test_set_clock(st, t0 + 1e5);
        struct kvt_store_report r;
        assert_int_equal(kvt_store_gc(st, &r), 0);
        assert_int_equal(r.expired, 3);
        assert_int_equal(stats(st).disk.entries, 0);
        assert_int_equal(sk_count_files(dir), 0);
    }
    kvt_store_free(st);
}

static void test_ttl_hot(void **state) {
    struct sk_fx *f = *state;
    ttl_case(f->dir, 0, 1 << 20); /* disk: the index's hits and last hit */
    ttl_case(NULL, 1 << 20, 0);   /* RAM */
}

/* A block put again after its disk row expired (no get met the row, so it is still in the
** index) is written afresh: the writer once skipped it as "already in the index", and the next
** get found only the expired row and lost the block (issue #24 item 7). */
static void test_rewrite_expired(void **state) {
    struct sk_fx *f = *state;
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = f->dir;
    p.ram_bytes = 0;
    p.disk_bytes = 1 << 20;
    p.ttl_s = 100;
    p.ttl_hot_s = 1000;
    p.hot_hits = 3;
    kvt_store *st;
    assert_int_equal(kvt_store_open(&p, &st), 0);
    const double t0 = 1.8e9;
    kvt_store_test_set_clock(st, t0);
    kvt_key k = sk_key("expired-then-put", 0);
    put_block(st, &MODEL_A, &k);
    kvt_store_flush(st);
    kvt_store_test_set_clock(st, t0 + 150); /* expired; its row still there */
    put_block(st, &MODEL_A, &k);            /* the same content again, fresh */
    kvt_store_flush(st);
    kvt_store_test_set_clock(st, t0 + 160);
    expect_block(st, &MODEL_A, &k);
    struct kvt_store_stats s = stats(st);
    assert_int_equal(s.disk.entries, 1);
    assert_int_equal(s.disk.writes, 2);
    struct kvt_store_report r;
    assert_int_equal(kvt_store_verify(st, false, &r), 0);
    assert_int_equal(r.corrupt + r.missing, 0);
    kvt_store_free(st);
}

/* A corrupt entry's removal and a fresh write of the same key, interleaved: another store (as
** another process would) puts the key again between the removal's row delete and its unlink.
** The fresh copy must survive, row and file: each write has a file of its own, and the removal
** unlinks only the file its row named.  With one file name per key the unlink took the fresh
** file and left its row without one (issue #24 item 7), which this test showed as a miss and a
** "missing" entry in verify. */
struct race_ctx {
    kvt_store *other;
    kvt_key key;
    int calls;
};

static void race_put(void *ud) {
    struct race_ctx *c = ud;
    if (c->calls++) return;
    put_block(c->other, &MODEL_A, &c->key);
    kvt_store_flush(c->other);
}

static void test_remove_write_race(void **state) {
    struct sk_fx *f = *state;
    kvt_store *a = open_store(f->dir, 0, 1 << 20), *b = open_store(f->dir, 0, 1 << 20);
    struct race_ctx c = { .other = b, .key = sk_key("race", 0) };
    put_block(a, &MODEL_A, &c.key);
    kvt_store_flush(a);
    sk_flip_byte(f->dir, &c.key, KVT__SBLOB_HDR + 9, 0x01);
    kvt_store_test_on_remove(a, race_put, &c);
    assert_int_equal(get_rc(a, &MODEL_A, &c.key), KVT_ENOENT); /* the corrupt copy: removed */
    assert_int_equal(c.calls, 1);
    kvt_store_test_on_remove(a, NULL, NULL);
    assert_int_equal(stats(a).disk.corrupt, 1);
    /* the fresh copy b wrote meanwhile: found by either store, verify clean, one file */
    assert_int_equal(expect_block(a, &MODEL_A, &c.key), KVT_TIER_DISK);
    assert_int_equal(expect_block(b, &MODEL_A, &c.key), KVT_TIER_DISK);
    struct kvt_store_report r;
    assert_int_equal(kvt_store_verify(a, false, &r), 0);
    assert_int_equal(r.ok, 1);
    assert_int_equal(r.missing + r.corrupt + r.orphans, 0);
    assert_int_equal(sk_count_files(f->dir), 1);
    kvt_store_free(b);
    kvt_store_free(a);
}

/* Damaged blob files (flipped payload byte, flipped header byte, truncated, missing, another
** key's file, a header naming another model) are misses counted in corrupt, removed, never
** returned; the untouched block still reads back. */
static void test_corrupt_files(void **state) {
    struct sk_fx *f = *state;
    enum { N = 7 };
    kvt_key ks[N];
    fill_disk(f->dir, "bad", ks, N);
    char p[N][PATH_MAX];
    for (int i = 0; i < N; i++) sk_blob_path(f->dir, &ks[i], p[i], sizeof p[i]);
    /* 0: flip a payload byte */
    int fd = open(p[0], O_RDWR);
    uint8_t c;
    assert_int_equal(pread(fd, &c, 1, KVT__SBLOB_HDR + 100), 1);
    c ^= 0x40;
    assert_int_equal(pwrite(fd, &c, 1, KVT__SBLOB_HDR + 100), 1);
    close(fd);
    /* 1: truncate */
    struct stat sb;
    assert_int_equal(stat(p[1], &sb), 0);
    assert_int_equal(truncate(p[1], sb.st_size - 1), 0);
    /* 2: missing */
    assert_int_equal(unlink(p[2]), 0);
    /* 3: another key's (valid) file under this key's name */
    assert_int_equal(rename(p[4], p[3]), 0);
    /* 4 is now missing too (its file moved); 5: header says another model */
    fd = open(p[5], O_RDWR);
    assert_int_equal(pwrite(fd, MODEL_B.b, 32, 48), 32);
    close(fd);
    kvt_store *st = open_store(f->dir, 1 << 20, 1 << 20);
    for (int i = 0; i < N - 1; i++) {
        assert_int_equal(get_rc(st, &MODEL_A, &ks[i]), KVT_ENOENT);
        assert_false(kvt_store_has(st, &ks[i])); /* removed */
    }
    struct kvt_store_stats s = stats(st);
    assert_int_equal(s.disk.corrupt, N - 1);
    assert_int_equal(s.disk.hits, 0);
    expect_block(st, &MODEL_A, &ks[N - 1]); /* the control */
    assert_int_equal(stats(st).disk.entries, 1);
    assert_int_equal(sk_count_files(f->dir), 1);
    kvt_store_free(st);
}

/* Rewrite key's stored block as format version `version` with the checksum `sum_version`
** computes, in its blob file's header and in its index row (as a writer of that version left
** it), the store closed. */
static void rewrite_format(const char *dir, const kvt_key *k, uint32_t version, uint32_t sum_version) {
    char path[PATH_MAX];
    sk_blob_path(dir, k, path, sizeof path);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    struct stat sb;
    assert_int_equal(fstat(fd, &sb), 0);
    size_t n = (size_t) sb.st_size - KVT__SBLOB_HDR;
    uint8_t *payload = malloc(n), v[4] = { (uint8_t) version, 0, 0, 0 }, sum[32];
    assert_non_null(payload);
    assert_int_equal(pread(fd, payload, n, KVT__SBLOB_HDR), (ssize_t) n);
    assert_int_equal(kvt__sblob_checksum(sum_version, payload, n, sum), 0);
    assert_int_equal(pwrite(fd, v, 4, 8), 4);
    assert_int_equal(pwrite(fd, sum, 32, 96), 32);
    close(fd);
    free(payload);
    char db_path[PATH_MAX];
    snprintf(db_path, sizeof db_path, "%s/index.db", dir);
    sqlite3 *db = NULL;
    sqlite3_stmt *s = NULL;
    assert_int_equal(sqlite3_open(db_path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, "UPDATE blocks SET checksum = ?1 WHERE key = ?2", -1, &s, NULL), SQLITE_OK);
    sqlite3_bind_blob(s, 1, sum, 32, SQLITE_STATIC);
    sqlite3_bind_blob(s, 2, k->b, KVT_KEY_BYTES, SQLITE_STATIC);
    assert_int_equal(sqlite3_step(s), SQLITE_DONE);
    assert_int_equal(sqlite3_changes(db), 1);
    sqlite3_finalize(s);
    sqlite3_close(db);
}

/* Blob format versions: new files are version 2 (XXH3-128, then 16 zero bytes); a store written
** by a version-1 writer (SHA-256) still reads, and a damaged payload is caught under either.
** Control: a version-2 file carrying the SHA-256 of its payload is not accepted (the version
** decides the checksum). */
static void test_format_versions(void **state) {
    struct sk_fx *f = *state;
    enum { N = 4 };
    kvt_key ks[N];
    fill_disk(f->dir, "ver", ks, N);
    /* what was written: version 2, the XXH3-128 of the payload, zeros after it */
    char path[PATH_MAX];
    sk_blob_path(f->dir, &ks[2], path, sizeof path);
    int fd = open(path, O_RDONLY);
    uint8_t hdr[KVT__SBLOB_HDR], zero[16] = { 0 }, want[32];
    assert_int_equal(pread(fd, hdr, sizeof hdr, 0), (ssize_t) sizeof hdr);
    close(fd);
    assert_int_equal(hdr[8], 2);
    size_t n;
    uint8_t *b = sk_content(&ks[2], &n);
    assert_int_equal(kvt__sblob_checksum(2, b, n, want), 0);
    free(b);
    assert_memory_equal(hdr + 96, want, 32);
    assert_memory_equal(hdr + 112, zero, 16);
    rewrite_format(f->dir, &ks[0], 1, 1); /* a version-1 store */
    rewrite_format(f->dir, &ks[1], 1, 1);
    sk_flip_byte(f->dir, &ks[1], KVT__SBLOB_HDR + 100, 0x08); /* ... damaged */
    rewrite_format(f->dir, &ks[3], 2, 1);                     /* the control */
    kvt_store *st = open_store(f->dir, 1 << 20, 1 << 20);
    assert_int_equal(expect_block(st, &MODEL_A, &ks[0]), KVT_TIER_DISK);
    assert_int_equal(get_rc(st, &MODEL_A, &ks[1]), KVT_ENOENT);
    assert_int_equal(expect_block(st, &MODEL_A, &ks[2]), KVT_TIER_DISK);
    assert_int_equal(get_rc(st, &MODEL_A, &ks[3]), KVT_ENOENT);
    struct kvt_store_stats s = stats(st);
    assert_int_equal(s.disk.corrupt, 2);
    assert_int_equal(s.disk.hits, 2);
    kvt_store_free(st);
    /* a damaged version-2 payload: test_corrupt_files (its blocks are written as version 2) */
}

/* The same key asked with another model's fingerprint is a miss (counted), in RAM, in the
** queue and on disk; the entry stays for its own model. */
static void test_foreign_model(void **state) {
    struct sk_fx *f = *state;
    kvt_key k = sk_key("foreign", 0);
    kvt_store *st = open_store(f->dir, 1 << 20, 1 << 20);
    put_block(st, &MODEL_A, &k);
    assert_int_equal(get_rc(st, &MODEL_B, &k), KVT_ENOENT);
    assert_non_null(strstr(kvt_errmsg(), "another model"));
    assert_int_equal(stats(st).ram.corrupt, 1);
    assert_int_equal(expect_block(st, &MODEL_A, &k), KVT_TIER_RAM);
    kvt_store_free(st);
    st = open_store(f->dir, 0, 1 << 20);
    assert_int_equal(get_rc(st, &MODEL_B, &k), KVT_ENOENT);
    assert_int_equal(stats(st).disk.corrupt, 1);
    assert_int_equal(expect_block(st, &MODEL_A, &k), KVT_TIER_DISK);
    kvt_store_free(st);
}

/* Bad parameters and arguments are refused with a message naming the value; a read-only open
** of a directory with no store fails; a read-only store refuses writes. */
static void test_errors(void **state) {
    struct sk_fx *f = *state;
    struct kvt_store_params p = kvt_store_default_params();
    kvt_store *st = (kvt_store *) 1;
    p.dir = f->dir;
    p.ttl_s = 0;
    assert_int_equal(kvt_store_open(&p, &st), KVT_EINVAL);
    assert_null(st);
    assert_non_null(strstr(kvt_errmsg(), "ttl_s 0"));
    p = kvt_store_default_params();
    p.dir = f->dir;
    p.ttl_hot_s = 10;
    assert_int_equal(kvt_store_open(&p, &st), KVT_EINVAL);
    p = kvt_store_default_params();
    p.dir = f->dir;
    p.queue_max = 0;
    assert_int_equal(kvt_store_open(&p, &st), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "queue_max 0"));
    char sub[128];
    snprintf(sub, sizeof sub, "%s/none", f->dir);
    p = kvt_store_default_params();
    p.dir = sub;
    p.read_only = true;
    assert_int_equal(kvt_store_open(&p, &st), KVT_EIO);
    assert_non_null(strstr(kvt_errmsg(), sub));
    /* a file where the directory should be */
    snprintf(sub, sizeof sub, "%s/file", f->dir);
    fclose(fopen(sub, "w"));
    p.read_only = false;
    assert_int_equal(kvt_store_open(&p, &st), KVT_EIO);
    /* read-only store: writes refused, reads fine */
    st = open_store(f->dir, 0, 1 << 20);
    kvt_key k = sk_key("ro", 0);
    put_block(st, &MODEL_A, &k);
    kvt_store_free(st);
    p = kvt_store_default_params();
    p.dir = f->dir;
    p.read_only = true;
    assert_int_equal(kvt_store_open(&p, &st), 0);
    expect_block(st, &MODEL_A, &k);
    struct kvt_store_meta m = { .model = MODEL_A };
    assert_int_equal(kvt_store_put(st, &k, &m, "x", 1), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "read-only"));
    struct kvt_store_report r;
    assert_int_equal(kvt_store_gc(st, &r), KVT_EINVAL);
    assert_int_equal(kvt_store_clear(st), KVT_EINVAL);
    assert_int_equal(kvt_store_verify(st, true, &r), KVT_EINVAL);
    assert_int_equal(kvt_store_verify(st, false, &r), 0);
    assert_int_equal(r.ok, 1);
    void *d;
    size_t n;
    assert_int_equal(kvt_store_get(st, &k, NULL, &d, &n, NULL, NULL), KVT_EINVAL);
    assert_int_equal(kvt_store_put(st, NULL, &m, "x", 1), KVT_EINVAL);
    kvt_store_free(st);
    kvt_store_free(NULL);
    /* an index of a newer format is refused, read-write and read-only */
    char db_path[128];
    snprintf(db_path, sizeof db_path, "%s/index.db", f->dir);
    sqlite3 *db;
    assert_int_equal(sqlite3_open(db_path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "PRAGMA user_version = 7", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    for (int ro = 0; ro < 2; ro++) {
        p.read_only = ro;
        assert_int_equal(kvt_store_open(&p, &st), KVT_EIO);
        assert_non_null(strstr(kvt_errmsg(), "format version 7"));
    }
    char buf[8];
    assert_int_equal(kvt_store_default_dir(buf, sizeof buf), KVT_EINVAL);
}

/* Private entries (kvt_store_put_private: a session's own block copies, the host pool the store
** replaces).  One RAM budget: the content RAM tier gives its room to them (its LRU entries leave),
** the private entries spill to files once the budget is theirs and read back byte-exact.  They
** never expire (test clock past the hot TTL), never enter the index, ls, or kvt_store_get's key
** space, survive a clear, go with del; a read-only store takes them too. */
static void test_private_entries(void **state) {
    struct sk_fx *f = *state;
    enum { SZ = 1000 };
    kvt_store *st = open_store(f->dir, 10 * SZ, 1 << 20);
    uint8_t blob[SZ];
    kvt_key ck[8];
    for (int i = 0; i < 8; i++) { /* 8 content entries: 8000 of the 10000 bytes */
        ck[i] = sk_key("priv-content", i);
        memset(blob, 0x40 + i, SZ);
        struct kvt_store_meta m = { .model = MODEL_A, .n_tokens = 8 };
        assert_int_equal(kvt_store_put(st, &ck[i], &m, blob, SZ), 0);
    }
    kvt_store_flush(st);
    assert_int_equal(stats(st).ram.entries, 8);
    /* 6 private entries: the content tier keeps within 10000 - their bytes */
    for (int i = 0; i < 6; i++) {
        memset(blob, i, SZ);
        assert_int_equal(kvt_store_put_private(st, 100 + (uint64_t) i, blob, SZ), 0);
        struct kvt_store_stats s = stats(st);
        assert_true(s.ram.bytes + s.priv.ram_bytes <= 10 * SZ);
        assert_int_equal(kvt_store_private_tier(st, 100 + (uint64_t) i), KVT_TIER_RAM);
    }
    struct kvt_store_stats s = stats(st);
    printf("  6 private entries: content RAM %lld B in %lld entries (evicted %lld), private RAM %lld B\n", (long long) s.ram.bytes,
           (long long) s.ram.entries, (long long) s.ram.evictions, (long long) s.priv.ram_bytes);
    assert_int_equal(s.priv.ram_bytes, 6 * SZ);
    assert_int_equal(s.ram.entries, 4);
    assert_int_equal(s.ram.evictions, 4);
    for (int i = 0; i < 4; i++) assert_int_equal(kvt_store_tier(st, &ck[i]), KVT_TIER_DISK); /* LRU left RAM */
    for (int i = 4; i < 8; i++) assert_int_equal(kvt_store_tier(st, &ck[i]), KVT_TIER_RAM);
    /* 6 more: the budget is theirs; the oldest private entries spill, nothing is dropped */
    for (int i = 6; i < 12; i++) {
        memset(blob, i, SZ);
        assert_int_equal(kvt_store_put_private(st, 100 + (uint64_t) i, blob, SZ), 0);
    }
    s = stats(st);
    printf("  12 private entries: content RAM %lld entries, private RAM %lld B, %lld spilled (%lld B)\n", (long long) s.ram.entries,
           (long long) s.priv.ram_bytes, (long long) s.priv.n_spilled, (long long) s.priv.spill_bytes);
    assert_int_equal(s.ram.entries, 0);
    assert_true(s.priv.ram_bytes <= 10 * SZ);
    assert_int_equal(s.priv.n_spilled, 2);
    assert_int_equal(s.priv.n_dropped, 0);
    assert_int_equal(kvt_store_private_tier(st, 100), KVT_TIER_DISK);
    for (int i = 0; i < 12; i++) {
        void *d = NULL;
        size_t n = 0;
        assert_int_equal(kvt_store_get_private(st, 100 + (uint64_t) i, &d, &n), 0);
        assert_int_equal(n, SZ);
        memset(blob, i, SZ);
        assert_memory_equal(d, blob, SZ);
        free(d);
    }
    /* no TTL: a week and a day later they are all there; the content entries have expired */
    kvt_store_test_set_clock(st, (double) time(NULL) + 8 * 86400.0);
    for (int i = 0; i < 12; i++) assert_int_not_equal(kvt_store_private_tier(st, 100 + (uint64_t) i), KVT_TIER_NONE);
    assert_int_equal(get_rc(st, &MODEL_A, &ck[7]), KVT_ENOENT);
    /* never in the index, ls or the content key space; a clear leaves them */
    kvt_store_flush(st);
    assert_int_equal(stats(st).disk.entries, 8); /* the content entries (the expired one stays); no private */
    assert_int_equal(kvt_store_clear(st), 0);
    assert_int_equal(stats(st).priv.n_entries, 12);
    /* del: gone, and their RAM given back */
    for (int i = 0; i < 12; i++) assert_int_equal(kvt_store_del_private(st, 100 + (uint64_t) i), 0);
    assert_int_equal(kvt_store_del_private(st, 100), KVT_ENOENT);
    s = stats(st);
    assert_int_equal(s.priv.n_entries, 0);
    assert_int_equal(s.priv.ram_bytes, 0);
    void *d = (void *) 1;
    size_t n = 7;
    assert_int_equal(kvt_store_get_private(st, 100, &d, &n), KVT_ENOENT);
    assert_null(d);
    assert_int_equal(n, 0);
    kvt_store_free(st);
    /* a read-only store keeps a session's copies too (nothing of them goes to DIR) */
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = f->dir;
    p.read_only = true;
    int rc = kvt_store_open(&p, &st);
    if (rc) fail_msg("read-only open: %s", kvt_errmsg());
    memset(blob, 7, SZ);
    assert_int_equal(kvt_store_put_private(st, 1, blob, SZ), 0);
    assert_int_equal(kvt_store_get_private(st, 1, &d, &n), 0);
    assert_memory_equal(d, blob, SZ);
    free(d);
    kvt_store_free(st);
    assert_int_equal(kvt_store_put_private(NULL, 1, blob, SZ), KVT_EINVAL);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--print-chain-key")) {
        MODEL_A = sk_key("model", 'A');
        print_chain_key();
        return 0;
    }
    MODEL_A = sk_key("model", 'A');
    MODEL_B = sk_key("model", 'B');
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_known_bytes),
        cmocka_unit_test(test_chain_sensitivity),
        cmocka_unit_test(test_key_hex),
        cmocka_unit_test(test_chain_across_processes),
        cmocka_unit_test_setup_teardown(test_roundtrip_restart, sk_setup, sk_teardown),
        cmocka_unit_test(test_ram_lru),
        cmocka_unit_test_setup_teardown(test_disk_quota, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_ttl_hot, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_rewrite_expired, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_remove_write_race, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_corrupt_files, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_format_versions, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_foreign_model, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_errors, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_private_entries, sk_setup, sk_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
