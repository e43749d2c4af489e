/* test_store_faults.c — the block store when things fail: a full write-behind queue (the writer
** held by a test hook), each injected disk failure (ENOSPC on the write, the fsync, the rename,
** the index insert), 100 kill -9 of a process in the middle of writing blocks, gc and verify
** finding damage both ways (rows without files, files without rows), and threads sharing one
** store.  In every case a failure is a dropped write or a miss, counted, with nothing
** half-written visible, and every block read back has exactly its bytes. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "store_fixture.h"
#include "fault.h"
#include "test_hooks.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>

static kvt_key MODEL_A;


static kvt_store *open_store(const char *dir, size_t ram, size_t disk, int32_t queue_max) {
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = dir;
    p.ram_bytes = ram;
    p.disk_bytes = disk;
    p.queue_max = queue_max;
    kvt_store *st = NULL;
    int rc = kvt_store_open(&p, &st);
    if (rc) fail_msg("kvt_store_open %s: %s (%s)", dir, kvt_strerror(rc), kvt_errmsg());
    return st;
}

static int put_block(kvt_store *st, const kvt_key *k) {
    size_t n;
    uint8_t *b = sk_content(k, &n);
    struct kvt_store_meta m = sk_meta(&MODEL_A, k);
    int rc = kvt_store_put(st, k, &m, b, n);
    free(b);
    return rc;
}

/* 0 with exactly the key's bytes, or KVT_ENOENT; anything else fails the test. */
static int check_block(kvt_store *st, const kvt_key *k) {
    void *got = NULL;
    size_t n = 0, want_n;
    int rc = kvt_store_get(st, k, &MODEL_A, &got, &n, NULL, NULL);
    if (rc == KVT_ENOENT) return rc;
    if (rc) fail_msg("get: %s (%s)", kvt_strerror(rc), kvt_errmsg());
    uint8_t *want = sk_content(k, &want_n);
    assert_int_equal(n, want_n);
    assert_memory_equal(got, want, n);
    free(want);
    free(got);
    return 0;
}

static struct kvt_store_stats stats(kvt_store *st) {
    struct kvt_store_stats s;
    kvt_store_get_stats(st, &s);
    return s;
}

/* queue_max 4 with the writer held: 7 puts queue 4 and drop 3, none waits; released, the 4 are
** written.  Gets of queued blocks are answered from the queue (RAM tier off). */
static void test_full_queue(void **state) {
    struct sk_fx *f = *state;
    kvt_store *st = open_store(f->dir, 0, 1 << 20, 4);
    kvt_store_test_hold_writer(st, true);
    kvt_key ks[7];
    for (int i = 0; i < 7; i++) {
        ks[i] = sk_key("queue", i);
        assert_int_equal(put_block(st, &ks[i]), 0);
    }
    struct kvt_store_stats s = stats(st);
    assert_int_equal(s.queue_len, 4);
    assert_int_equal(s.disk.writes_dropped, 3);
    assert_int_equal(s.disk.writes, 0);
    assert_int_equal(check_block(st, &ks[0]), 0); /* from the queue */
    assert_int_equal(check_block(st, &ks[6]), KVT_ENOENT);
    assert_int_equal(sk_count_files(f->dir), 0);
    kvt_store_test_hold_writer(st, false);
    kvt_store_flush(st);
    s = stats(st);
    assert_int_equal(s.queue_len, 0);
    assert_int_equal(s.disk.writes, 4);
    assert_int_equal(s.disk.entries, 4);
    assert_int_equal(sk_count_files(f->dir), 4);
    for (int i = 0; i < 4; i++) assert_int_equal(check_block(st, &ks[i]), 0);
    /* the control: held again, a put of a fifth block queues, close writes it out */
    kvt_store_test_hold_writer(st, true);
    assert_int_equal(put_block(st, &ks[4]), 0);
    assert_int_equal(stats(st).queue_len, 1);
    kvt_store_free(st);
    st = open_store(f->dir, 0, 1 << 20, 4);
    assert_int_equal(stats(st).disk.entries, 5);
    kvt_store_free(st);

    /* with a RAM tier: a block whose disk write was dropped stays in RAM, and putting it again
    ** queues the disk write again (a block RAM holds whose write was queued is not queued twice) */
    char dir2[128];
    snprintf(dir2, sizeof dir2, "%s/ram", f->dir);
    st = open_store(dir2, 1 << 20, 1 << 20, 1);
    kvt_store_test_hold_writer(st, true);
    assert_int_equal(put_block(st, &ks[0]), 0);
    assert_int_equal(put_block(st, &ks[1]), 0); /* dropped: the queue holds one */
    assert_int_equal(put_block(st, &ks[0]), 0); /* already queued: nothing */
    s = stats(st);
    assert_int_equal(s.disk.writes_dropped, 1);
    assert_int_equal(s.queue_len, 1);
    kvt_store_test_hold_writer(st, false);
    kvt_store_flush(st);
    assert_int_equal(put_block(st, &ks[1]), 0); /* in RAM, not on disk: queued again */
    assert_int_equal(put_block(st, &ks[0]), 0); /* in RAM and on disk: nothing */
    kvt_store_flush(st);
    s = stats(st);
    assert_int_equal(s.disk.writes, 2);
    assert_int_equal(s.disk.writes_dropped, 1);
    assert_int_equal(s.disk.entries, 2);
    kvt_store_free(st);
}

/* Each fault site: the put still succeeds, the disk write is dropped and counted, no file (not
** even a temporary one) and no row stays, the block is a miss on disk (the RAM copy, when there
** is a RAM tier, still answers); disarmed, the same block is written. */
static void test_fault_sites(void **state) {
    struct sk_fx *f = *state;
    const struct {
        enum kvt__fault_site site;
        int skip;
        const char *what;
    } cases[] = {
        { KVT__FAULT_STORE_WRITE, 0, "write (ENOSPC)" },
        { KVT__FAULT_STORE_SYNC, 0, "fsync" },
        { KVT__FAULT_STORE_SYNC, 1, "rename" },
        { KVT__FAULT_STORE_INDEX, 0, "index insert" },
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        for (int with_ram = 0; with_ram < 2; with_ram++) {
            char dir[128];
            snprintf(dir, sizeof dir, "%s/%zu-%d", f->dir, c, with_ram);
            kvt_store *st = open_store(dir, with_ram ? 1 << 20 : 0, 1 << 20, 16);
            kvt_key k = sk_key("fault", (int) c);
            kvt__fault_set(cases[c].site, cases[c].skip, 1);
            assert_int_equal(put_block(st, &k), 0);
            kvt_store_flush(st);
            if (kvt__fault_hits(cases[c].site) != 1) fail_msg("%s: the fault did not fire", cases[c].what);
            struct kvt_store_stats s = stats(st);
            assert_int_equal(s.disk.writes_dropped, 1);
            assert_int_equal(s.disk.writes, 0);
            assert_int_equal(s.disk.entries, 0);
            if (sk_count_files(dir) != 0) fail_msg("%s: %d files left in blobs/", cases[c].what, sk_count_files(dir));
            assert_int_equal(check_block(st, &k), with_ram ? 0 : KVT_ENOENT);
            kvt__fault_set(cases[c].site, 0, 0);
            kvt_store_free(st);
            st = open_store(dir, 0, 1 << 20, 16); /* after a restart: nothing of it */
            assert_int_equal(check_block(st, &k), KVT_ENOENT);
            assert_int_equal(put_block(st, &k), 0);
            kvt_store_flush(st);
            assert_int_equal(check_block(st, &k), 0);
            assert_int_equal(sk_count_files(dir), 1);
            kvt_store_free(st);
        }
    }
}

/* ---- kill -9 ------------------------------------------------------------------------------- */

static int count_entry(void *ud, const struct kvt_store_entry *e) {
    (void) e;
    ++*(int64_t *) ud;
    return 0;
}

struct keys {
    kvt_key *k;
    size_t n, cap;
};
static int collect(void *ud, const struct kvt_store_entry *e) {
    struct keys *ks = ud;
    if (ks->n == ks->cap) {
        ks->cap = ks->cap ? 2 * ks->cap : 256;
        ks->k = realloc(ks->k, ks->cap * sizeof *ks->k);
        if (!ks->k) abort();
    }
    ks->k[ks->n++] = e->key;
    return 0;
}

/* Kill a child that writes blocks (a quota small enough that it also evicts) after a random
** 1..25 ms, n times.  After each kill the store opens, verify with repair runs, a second verify
** must find nothing at all, and every block listed must read back with exactly its bytes.
** Returns the kills after which the first verify found a corrupt file or a row without its file
** (never, with the real write order: a row is written only after its file is durable). */
static int kill_loop(const char *dir, int n, bool unsafe, int64_t *orphans, int64_t *max_entries) {
    int damaged = 0;
    for (int it = 0; it < n; it++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            kvt_store *st = NULL;
            struct kvt_store_params p = kvt_store_default_params();
            p.dir = dir;
            p.ram_bytes = 0;
            p.disk_bytes = 600 << 10;
            p.queue_max = 8;
            if (kvt_store_open(&p, &st)) _exit(3);
            kvt_store_test_unsafe_write_order(st, unsafe);
            for (int j = 0; j < 5000; j++) {
                kvt_key k = sk_key(unsafe ? "crash-control" : "crash", it * 5000 + j);
                if (put_block(st, &k)) _exit(4);
                if (j % 4 == 3) kvt_store_flush(st);
            }
            _exit(0); /* not reached in time: killed */
        }
        usleep((useconds_t) (1000 + rand() % 24000));
        kill(pid, SIGKILL);
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (WIFEXITED(status)) fail_msg("iteration %d: the writer exited with %d", it, WEXITSTATUS(status));
        kvt_store *st = open_store(dir, 0, 600 << 10, 8);
        struct kvt_store_report r;
        assert_int_equal(kvt_store_verify(st, true, &r), 0);
        damaged += r.corrupt || r.missing;
        if (!unsafe && (r.corrupt || r.missing))
            fail_msg("iteration %d: %lld corrupt, %lld missing after kill -9", it, (long long) r.corrupt, (long long) r.missing);
        *orphans += r.orphans;
        assert_int_equal(kvt_store_verify(st, false, &r), 0);
        assert_int_equal(r.corrupt + r.missing + r.orphans, 0);
        assert_int_equal(r.ok, r.checked);
        struct keys ks = { 0 };
        assert_int_equal(kvt_store_ls(st, collect, &ks), 0);
        for (size_t i = 0; i < ks.n; i++)
            if (check_block(st, &ks.k[i])) fail_msg("iteration %d: a listed block is not readable", it);
        free(ks.k);
        *max_entries = KVT_MAX(*max_entries, (int64_t) ks.n);
        assert_int_equal(stats(st).disk.corrupt, 0);
        kvt_store_free(st);
    }
    return damaged;
}

/* 100 kills of a real writer: never a corrupt file or a dangling row.  The control: 20 kills of
** a writer with the unsafe order (row first, file in place) must leave such damage (which
** verify --repair then removes, so the reads stay exact even there). */
static void test_kill9(void **state) {
    struct sk_fx *f = *state;
    unsigned seed = (unsigned) time(NULL);
    srand(seed);
    print_message("kill -9 test: seed %u\n", seed);
    int64_t orphans = 0, max_entries = 0;
    assert_int_equal(kill_loop(f->dir, 100, false, &orphans, &max_entries), 0);
    print_message("kill -9 test: %lld orphan files repaired over 100 kills, up to %lld blocks stored\n", (long long) orphans,
                  (long long) max_entries);
    assert_true(max_entries > 0); /* the children did write */
    char ctl[128];
    snprintf(ctl, sizeof ctl, "%s/control", f->dir);
    int64_t o2 = 0, m2 = 0;
    int damaged = kill_loop(ctl, 20, true, &o2, &m2);
    print_message("kill -9 control (row before file): damage found after %d of 20 kills\n", damaged);
    assert_true(damaged > 0);
}

/* ---- gc / verify ----------------------------------------------------------------------------- */

static void write_file(const char *path, const void *data, size_t n) {
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(data, 1, n, fp), n);
    fclose(fp);
}

static void test_gc_verify(void **state) {
    struct sk_fx *f = *state;
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = f->dir;
    p.ram_bytes = 0;
    kvt_store *st;
    assert_int_equal(kvt_store_open(&p, &st), 0);
    const double t0 = 1.75e9;
    kvt_key ks[6];
    for (int i = 0; i < 6; i++) {
        ks[i] = sk_key("gc", i);
        kvt_store_test_set_clock(st, i < 2 ? t0 : t0 + 1000);
        assert_int_equal(put_block(st, &ks[i]), 0);
        kvt_store_flush(st);
    }
    char path[PATH_MAX], other[PATH_MAX];
    /* a row without a file */
    sk_blob_path(f->dir, &ks[2], path, sizeof path);
    assert_int_equal(unlink(path), 0);
    /* files without a row: a blob under a key the index does not know, a dead writer's temp */
    kvt_key stray = sk_key("gc-stray", 0);
    sk_blob_path(f->dir, &ks[3], path, sizeof path);
    sk_blob_path(f->dir, &stray, other, sizeof other);
    assert_int_equal(link(path, other), 0);
    snprintf(path, sizeof path, "%s/blobs/.tmp-999999999-0123456789abcdef-AbCdEf", f->dir);
    write_file(path, "half", 4);
    snprintf(path, sizeof path, "%s/blobs/README", f->dir); /* not ours: never touched */
    write_file(path, "keep", 4);

    struct kvt_store_report r;
    assert_int_equal(kvt_store_verify(st, false, &r), 0);
    assert_int_equal(r.checked, 6);
    assert_int_equal(r.ok, 5);
    assert_int_equal(r.missing, 1);
    assert_int_equal(r.orphans, 2);
    assert_int_equal(r.corrupt, 0);
    assert_int_equal(r.removed, 0);
    assert_int_equal(sk_count_files(f->dir), 5 + 2 + 1);

    kvt_store_test_set_clock(st, t0 + 1900); /* blocks 0, 1: 1900 s after their write (ttl 1800) */
    assert_int_equal(kvt_store_gc(st, &r), 0);
    assert_int_equal(r.checked, 6);
    assert_int_equal(r.expired, 2);
    assert_int_equal(r.missing, 1);
    assert_int_equal(r.orphans, 2);
    assert_int_equal(r.over_quota, 0);
    assert_int_equal(r.ok, 3);
    assert_int_equal(r.removed, 5);
    assert_true(r.bytes_freed > 0);
    assert_int_equal(sk_count_files(f->dir), 3 + 1); /* README stays */
    assert_true(access(path, F_OK) == 0);
    for (int i = 3; i < 6; i++) assert_int_equal(check_block(st, &ks[i]), 0);

    /* a corrupt file: verify reports, repair removes, a second verify is clean */
    sk_blob_path(f->dir, &ks[4], path, sizeof path);
    int fd = open(path, O_RDWR);
    assert_int_equal(pwrite(fd, "X", 1, KVT__SBLOB_HDR + 1), 1);
    close(fd);
    assert_int_equal(kvt_store_verify(st, false, &r), 0);
    assert_int_equal(r.corrupt, 1);
    assert_int_equal(r.ok, 2);
    assert_int_equal(kvt_store_verify(st, true, &r), 0);
    assert_int_equal(r.corrupt, 1);
    assert_int_equal(r.removed, 1);
    assert_int_equal(kvt_store_verify(st, false, &r), 0);
    assert_int_equal(r.checked, 2);
    assert_int_equal(r.ok, 2);
    assert_int_equal(r.corrupt + r.missing + r.orphans, 0);
    kvt_store_free(st);

    /* over quota: reopened with room for one of the two, gc removes the least recently hit */
    p.disk_bytes = sk_size(&ks[5]) > sk_size(&ks[3]) ? sk_size(&ks[5]) : sk_size(&ks[3]);
    assert_int_equal(kvt_store_open(&p, &st), 0);
    kvt_store_test_set_clock(st, t0 + 2000);
    assert_int_equal(check_block(st, &ks[3]), 0); /* 3 hit last (both hit at t0 + 1900 above): 5 goes */
    kvt_store_flush(st);
    assert_int_equal(kvt_store_gc(st, &r), 0);
    assert_int_equal(r.over_quota, 1);
    assert_int_equal(check_block(st, &ks[5]), KVT_ENOENT);
    assert_int_equal(check_block(st, &ks[3]), 0);
    assert_true(stats(st).disk.bytes <= (int64_t) p.disk_bytes);
    int64_t n = 0;
    assert_int_equal(kvt_store_ls(st, count_entry, &n), 0);
    assert_int_equal(n, 1);
    /* clear: nothing left but the foreign file */
    assert_int_equal(kvt_store_clear(st), 0);
    assert_int_equal(stats(st).disk.entries, 0);
    assert_int_equal(sk_count_files(f->dir), 1);
    kvt_store_free(st);
}

/* ---- threads ------------------------------------------------------------------------------- */

struct worker {
    kvt_store *st;
    unsigned seed;
    int64_t hits;
};

static void *worker_main(void *arg) {
    struct worker *w = arg;
    for (int i = 0; i < 300; i++) {
        kvt_key k = sk_key("thr", rand_r(&w->seed) % 48);
        if (rand_r(&w->seed) % 3 == 0) {
            if (put_block(w->st, &k)) abort();
        } else {
            void *got = NULL;
            size_t n = 0, want_n;
            int rc = kvt_store_get(w->st, &k, &MODEL_A, &got, &n, NULL, NULL);
            if (rc == 0) {
                uint8_t *want = sk_content(&k, &want_n);
                if (n != want_n || memcmp(got, want, n)) abort(); /* wrong bytes: never */
                free(want);
                free(got);
                w->hits++;
            } else if (rc != KVT_ENOENT) {
                abort();
            }
        }
    }
    return NULL;
}

/* Four threads put and get 48 shared keys through a small RAM tier, a small queue and a disk
** quota of ~12 blocks (evictions and drops all the time): every hit has the right bytes, and
** the store verifies clean afterwards. */
static void test_threads(void **state) {
    struct sk_fx *f = *state;
    kvt_store *st = open_store(f->dir, 40000, 60000, 16);
    pthread_t th[4];
    struct worker w[4];
    for (int t = 0; t < 4; t++) {
        w[t] = (struct worker){ .st = st, .seed = 77u + (unsigned) t };
        assert_int_equal(pthread_create(&th[t], NULL, worker_main, &w[t]), 0);
    }
    int64_t hits = 0;
    for (int t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        hits += w[t].hits;
    }
    kvt_store_flush(st);
    struct kvt_store_report r;
    assert_int_equal(kvt_store_verify(st, false, &r), 0);
    assert_int_equal(r.corrupt + r.missing + r.orphans, 0);
    struct kvt_store_stats s = stats(st);
    print_message("threads: %lld hits; ram evictions %lld, disk writes %lld, dropped %lld, evictions %lld\n", (long long) hits,
                  (long long) s.ram.evictions, (long long) s.disk.writes, (long long) s.disk.writes_dropped,
                  (long long) s.disk.evictions);
    assert_true(hits > 0);
    assert_true(s.disk.bytes <= 60000);
    kvt_store_free(st);
}

int main(void) {
    MODEL_A = sk_key("model", 'A');
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_full_queue, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_fault_sites, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_gc_verify, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_threads, sk_setup, sk_teardown),
        cmocka_unit_test_setup_teardown(test_kill9, sk_setup, sk_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
