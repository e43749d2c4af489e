/* test_faults — a session on the tiny generated model (F32 KV cache) while the store fails under
** it, by failure injection (src/fault.h):
**
**   seal_fails_*      the pool refuses the write-through of a full block (kvt_pool_put fails) while
**                     tokens keep coming, one at a time (kvt_session_gen_step and the batched
**                     kvt_session_gen_step_batch): no block ever holds more than `block` tokens,
**                     every decoded token is in the stream exactly once, the steps succeed, and
**                     once the pool works again the next block is saved.
**   lost_block_*      a spilled block's saved copy is corrupted / deleted before the question
**                     that recovers it: the block is recomputed (recomputes == 1, resident again)
**                     and the answer's log-probability equals that of recovery "breadcrumb" (the
**                     same recompute at the tail) to 1e-4; the control (discard: the block stays
**                     out, a hole) is not.  It does not equal the intact kv_restore session: a
**                     block recomputed at the tail sees a different context than when it was
**                     first decoded (on the tiny model -126.04 vs -121.69, the hole -128.01).
**   full_disk_session every spill write fails: the pool's RAM stays within its budget, the
**                     copies it cannot write are dropped (counted), and the probe recomputes the
**                     fact block (answer equal to breadcrumb recovery); a reply is generated.
**   full_disk_store   the same with a block store holding the copies (no pool): private entries'
**                     spills and the store's blob writes fail; RAM (one budget) within ram_bytes,
**                     drops counted, the fact block recomputed as breadcrumb would.
**   resume_*          a parked session whose block copy is corrupted / deleted resumes with that
**                     block recomputed in place: the log-probability equals the intact resume to
**                     1e-4; control: the same session with the block's cells removed differs.
*/
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "fault.h"
#include "internal.h" /* kvt_pool_spill_path */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static kvt_engine *open_tiny(void) {
    const char *dir = getenv("KVT_TINY_DIR");
    assert_non_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny-llama.gguf", dir);
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 2048; /* two sequences, a stream of 1024 cells each */
    p.n_seq = 2;
    p.n_threads = 2;
    p.type_k = "f32";
    p.type_v = "f32";
    kvt_engine *e = NULL;
    assert_int_equal(kvt_engine_open(&p, &e), 0);
    return e;
}

static const char *words = "the dog ran to the park and the cat sat on the wall while the sun went down over the hill";

/* Every block holds at most `block` tokens and the blocks add up to the stream. */
static void check_blocks(kvt_session *s, int32_t block) {
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    int32_t sum = 0;
    for (int32_t i = 0; i < kvt_session_n_blocks(s); i++) {
        struct kvt_block_info b;
        assert_int_equal(kvt_session_block(s, i, &b), 0);
        if (b.n_tokens > block) fail_msg("block %d holds %d tokens, more than the block size %d", i, b.n_tokens, block);
        sum += b.n_tokens;
    }
    assert_int_equal(sum, st.total_tokens);
    assert_int_equal(kvt_session_tokens(s, NULL, 0), st.total_tokens);
}

/* One generated token, by gen_step or by a batch of one.  OUT *tok, *done; returns the step's
** error (0 = the token is in the session). */
static int step(kvt_engine *e, kvt_session *s, bool batch, kvt_token *tok, bool *done) {
    struct kvt_sampling smp = { 0 }; /* greedy */
    *done = false;
    if (batch) {
        int status = 0;
        assert_int_equal(
            kvt_session_gen_step_batch(
                e, &(struct kvt_gen_batch){ .sessions = &s, .n = 1, .smp = &smp, .tok = tok, .done = done, .status = &status }),
            0);
        return status;
    }
    return kvt_session_gen_step(s, &smp, tok, done);
}

static void seal_fails(bool batch) {
    kvt_engine *e = open_tiny();
    struct kvt_pool_params pp = kvt_pool_default_params();
    kvt_pool *pool = NULL;
    assert_int_equal(kvt_pool_open(&pp, &pool), 0);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 1024; /* no eviction: only the seal is under test */
    sp.block = 16;
    sp.pool = pool;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, words, KVT_KEEP_NONE), 0);
    struct kvt_pool_stats ps0, ps1;
    kvt_pool_get_stats(pool, &ps0);

    kvt__fault_set(KVT__FAULT_POOL_PUT, 0, -1); /* every put fails from now on */
    enum { N = 40 };                            /* more than two blocks of 16 */
    kvt_token gen[N];
    int32_t n_gen = 0;
    const int32_t before = kvt_session_tokens(s, NULL, 0);
    int first_err = 0;
    char first_msg[256] = "";
    for (int32_t k = 0; k < N; k++) { /* keep stepping after an error: what does the table do? */
        kvt_token t;
        bool done;
        int rc = step(e, s, batch, &t, &done);
        if (rc && !first_err) {
            first_err = rc;
            snprintf(first_msg, sizeof first_msg, "step %d: %s", k, kvt_errmsg());
        }
        check_blocks(s, sp.block); /* the old code wrote past the block's token array here */
        if (rc == 0 && done) break;
        if (rc == 0) gen[n_gen++] = t;
    }
    const int64_t refused = kvt__fault_hits(KVT__FAULT_POOL_PUT);
    kvt__fault_set(KVT__FAULT_POOL_PUT, 0, 0);
    printf("  %s: %d tokens generated while the pool refused %lld puts\n", batch ? "batched steps" : "gen_step", n_gen,
           (long long) refused);
    if (first_err) fail_msg("a step failed while the seal failed: %s (%s)", kvt_strerror(first_err), first_msg);
    assert_true(n_gen >= 2 * sp.block); /* at least two blocks filled while failing */
    assert_true(refused >= 2);
    kvt_pool_get_stats(pool, &ps1);
    assert_int_equal(ps1.n_entries, ps0.n_entries); /* nothing was saved meanwhile */

    /* every generated token is in the stream once, in order, right after the prompt */
    int32_t total = kvt_session_tokens(s, NULL, 0);
    kvt_token *all = malloc(sizeof(kvt_token) * (size_t) total);
    assert_non_null(all);
    assert_int_equal(kvt_session_tokens(s, all, total), total);
    assert_int_equal(total, before + n_gen);
    assert_memory_equal(all + before, gen, sizeof(kvt_token) * (size_t) n_gen);
    free(all);

    /* the pool works again: the session goes on and saves the next full block */
    for (int32_t k = 0; k < sp.block + 1; k++) {
        kvt_token t;
        bool done;
        assert_int_equal(step(e, s, batch, &t, &done), 0);
        if (done) break;
    }
    check_blocks(s, sp.block);
    kvt_pool_get_stats(pool, &ps1);
    assert_true(ps1.n_entries > ps0.n_entries);
    kvt_session_free(s);
    kvt_pool_free(pool);
    kvt_engine_free(e);
}

static void test_seal_fails_gen_step(void **state) {
    (void) state;
    seal_fails(false);
}

static void test_seal_fails_batched(void **state) {
    (void) state;
    seal_fails(true);
}

/* ---- a lost block is recomputed ------------------------------------------------------- */

enum damage { INTACT, CORRUPT, DELETE };

/* Damage the spill file of the session's block `id` (its copy must be on disk). */
static void damage_block(kvt_session *s, kvt_pool *pool, int32_t id, enum damage d) {
    if (d == INTACT) return;
    struct kvt_block_info b;
    assert_int_equal(kvt_session_block(s, id, &b), 0);
    char path[1024];
    assert_int_equal(kvt_pool_spill_path(pool, b.pool_key, path, sizeof path), 0);
    if (!path[0]) fail_msg("block %d (residency %d) has no spill file", id, b.residency);
    if (d == DELETE) {
        assert_int_equal(unlink(path), 0);
        return;
    }
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, -10, SEEK_END), 0);
    int ch = fgetc(f);
    assert_int_equal(fseek(f, -10, SEEK_END), 0);
    fputc(ch ^ 0x5a, f);
    fclose(f);
}

/* A user message of n made-up words no other message shares (no recovery is triggered by it). */
static void filler_msg(char *buf, size_t size, uint32_t seed, int n) {
    size_t k = 0;
    for (int w = 0; w < n && k + 10 < size; w++) {
        int len = 4 + (int) (seed % 4);
        for (int c = 0; c < len; c++) {
            seed = seed * 1103515245u + 12345u;
            buf[k++] = (char) ('a' + (seed >> 16) % 26);
        }
        buf[k++] = ' ';
    }
    buf[k ? k - 1 : 0] = '\0';
}

static const char *fact = "remember this the vault code word is zebra";
static const char *probe = "what is the vault code word";
static const char *answer_text = "the vault code word is zebra";

struct lost_run {
    double lp;       /* log-probability of answer_text after the probe */
    int64_t dropped; /* pool entries dropped (failed spills) */
    int64_t max_ram; /* most pool RAM seen after any message */
    int64_t recomputes, recoveries, tokens_recovered, corrupt;
    int32_t fact_block;    /* the damaged block (the evicted one with "zebra") */
    int32_t residency;     /* its residency after the probe */
    int32_t n_tokens;      /* the stream's length */
    int64_t store_dropped; /* with a store: its disk writes dropped */
};

/* Pool RAM after a message, the most seen so far in *max_ram. */
/* Host RAM held for block copies: the pool's, or the store's (private entries + content RAM tier:
** one budget). */
static void note_ram(kvt_pool *pool, kvt_store *st, int64_t *max_ram) {
    int64_t ram;
    if (st) {
        struct kvt_store_stats ss;
        kvt_store_get_stats(st, &ss);
        ram = ss.priv.ram_bytes + ss.ram.bytes;
    } else {
        struct kvt_pool_stats ps;
        kvt_pool_get_stats(pool, &ps);
        ram = ps.ram_bytes;
    }
    if (ram > *max_ram) *max_ram = ram;
}

/* Fact, filler that evicts it, [damage its copy], probe.  The pool holds pool_budget bytes in RAM
** (1: every copy is a spill file); with full_disk every spill write fails.  with_store: no pool,
** a block store holds the copies (pool_budget its ram_bytes; full_disk: its blob writes fail too). */
static struct lost_run lost_session_ex(kvt_engine *e, int32_t recovery, enum damage d, size_t pool_budget, bool full_disk,
                                       bool with_store) {
    char dir[] = "/tmp/kvt-faults-XXXXXX", sdir[] = "/tmp/kvt-faults-store-XXXXXX";
    assert_non_null(mkdtemp(dir));
    kvt_pool *pool = NULL;
    kvt_store *store = NULL;
    if (with_store) {
        assert_non_null(mkdtemp(sdir));
        struct kvt_store_params stp = kvt_store_default_params();
        stp.dir = sdir;
        stp.ram_bytes = pool_budget;
        stp.disk_bytes = 64u << 20;
        stp.private_dir = dir;
        assert_int_equal(kvt_store_open(&stp, &store), 0);
    } else {
        struct kvt_pool_params pp = kvt_pool_default_params();
        pp.budget_bytes = pool_budget;
        pp.spill_dir = dir;
        assert_int_equal(kvt_pool_open(&pp, &pool), 0);
    }
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 192;
    sp.block = 32;
    sp.recovery = recovery;
    sp.top_k = 1;            /* the probe brings back one block ... */
    sp.successor_blocks = 0; /* ... and nothing after it */
    sp.min_recovery_score = 0.5f;
    sp.gen_reserve = 16;
    sp.pool = pool;
    sp.store = store;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    struct lost_run r = { .fact_block = -1 };
    if (full_disk) kvt__fault_set(KVT__FAULT_SPILL_WRITE, 0, -1);
    if (full_disk && store) kvt__fault_set(KVT__FAULT_STORE_WRITE, 0, -1);
    char msg[512];
    filler_msg(msg, sizeof msg, 1, 12);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "ok", KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, fact, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "ok", KVT_KEEP_NONE), 0);
    note_ram(pool, store, &r.max_ram);
    for (uint32_t k = 2; k < 10; k++) {
        filler_msg(msg, sizeof msg, k, 12);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "ok", KVT_KEEP_NONE), 0);
        note_ram(pool, store, &r.max_ram);
    }
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    assert_int_equal(st.recoveries, 0); /* nothing came back before the probe */
    assert_true(st.evictions > 0);
    for (int32_t i = 0; i < kvt_session_n_blocks(s) && r.fact_block < 0; i++) {
        struct kvt_block_info b;
        kvt_session_block(s, i, &b);
        if (strstr(b.text, "zebra")) r.fact_block = i;
    }
    assert_true(r.fact_block > 0);
    struct kvt_block_info b;
    kvt_session_block(s, r.fact_block, &b);
    assert_int_not_equal(b.residency, KVT_RES_DEVICE); /* evicted */
    if (recovery != KVT_RECOVERY_DISCARD) assert_int_equal(b.residency, full_disk ? KVT_RES_LOST : KVT_RES_DISK);
    damage_block(s, pool, r.fact_block, d);

    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, probe, KVT_KEEP_NONE), 0);
    note_ram(pool, store, &r.max_ram);
    int32_t n = 0;
    assert_int_equal(kvt_session_answer_logprob(s, answer_text, &r.lp, &n), 0);
    kvt_session_get_stats(s, &st);
    kvt_session_block(s, r.fact_block, &b);
    r.recomputes = st.recomputes;
    r.recoveries = st.recoveries;
    r.tokens_recovered = st.tokens_recovered;
    r.corrupt = st.pool.n_corrupt;
    r.dropped = st.pool.n_dropped;
    if (full_disk) { /* the session still answers */
        char *reply = NULL;
        assert_int_equal(kvt_session_generate(s, 8, NULL, NULL, NULL, &reply), 0);
        free(reply);
        note_ram(pool, store, &r.max_ram);
        kvt__fault_set(KVT__FAULT_SPILL_WRITE, 0, 0);
        kvt__fault_set(KVT__FAULT_STORE_WRITE, 0, 0);
    }
    r.residency = b.residency;
    r.n_tokens = st.total_tokens;
    kvt_session_free(s);
    kvt_pool_free(pool);
    if (store) {
        struct kvt_store_stats ss;
        kvt_store_get_stats(store, &ss);
        r.store_dropped = ss.disk.writes_dropped;
        assert_int_equal(ss.priv.n_entries, 0); /* the session's private entries went with it */
        kvt_store_free(store);
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", sdir);
        assert_int_equal(system(cmd), 0);
    }
    rmdir(dir);
    return r;
}

static struct lost_run lost_session(kvt_engine *e, int32_t recovery, enum damage d, size_t pool_budget, bool full_disk) {
    return lost_session_ex(e, recovery, d, pool_budget, full_disk, false);
}

static void lost_block(enum damage d) {
    kvt_engine *e = open_tiny();
    struct lost_run in = lost_session(e, KVT_RECOVERY_KV_RESTORE, INTACT, 1, false);
    struct lost_run bc = lost_session(e, KVT_RECOVERY_BREADCRUMB, INTACT, 1, false);
    struct lost_run hole = lost_session(e, KVT_RECOVERY_DISCARD, INTACT, 1, false);
    struct lost_run x = lost_session(e, KVT_RECOVERY_KV_RESTORE, d, 1, false);
    printf("  %s copy of block %d: log-prob %.4f (recomputes %lld, recoveries %lld); intact kv_restore %.4f "
           "(recoveries %lld), breadcrumb %.4f, hole (discard) %.4f\n",
           d == CORRUPT ? "corrupt" : "deleted", x.fact_block, x.lp, (long long) x.recomputes, (long long) x.recoveries, in.lp,
           (long long) in.recoveries, bc.lp, hole.lp);
    /* the intact session restores the block by kv_restore, nothing recomputed */
    assert_int_equal(in.recoveries, 1);
    assert_int_equal(in.recomputes, 0);
    assert_int_equal(in.residency, KVT_RES_DEVICE);
    assert_true(in.tokens_recovered > 0);
    /* the damaged one recomputes it: resident again, counted, nothing restored from the pool */
    assert_int_equal(x.fact_block, in.fact_block);
    assert_int_equal(x.recomputes, 1);
    assert_int_equal(x.recoveries, 1);
    assert_int_equal(x.residency, KVT_RES_DEVICE);
    assert_int_equal(x.tokens_recovered, 0);
    assert_int_equal(x.corrupt, d == CORRUPT ? 1 : 0);
    assert_int_equal(x.n_tokens, in.n_tokens);
    /* the same computation as the recompute path */
    assert_int_equal(bc.recomputes, 0);
    assert_true(fabs(x.lp - bc.lp) < 1e-4);
    /* control: a hole (the block left out, as the old code did) would fail that comparison */
    assert_true(fabs(hole.lp - bc.lp) > 1e-2);
    assert_int_equal(hole.recoveries, 0);
    kvt_engine_free(e);
}

static void test_lost_block_corrupt(void **state) {
    (void) state;
    lost_block(CORRUPT);
}

static void test_lost_block_deleted(void **state) {
    (void) state;
    lost_block(DELETE);
}

/* Park (every block's copy spilled), [damage block `victim`], resume.  OUT *lp, *recomputes.
** With hole, the resumed session's cells of that block are removed before scoring (the control). */
static void resume_session(kvt_engine *e, enum damage d, bool hole, double *lp, int64_t *recomputes) {
    char dir[] = "/tmp/kvt-faults-XXXXXX";
    assert_non_null(mkdtemp(dir));
    struct kvt_pool_params pp = kvt_pool_default_params();
    pp.budget_bytes = 1;
    pp.spill_dir = dir;
    kvt_pool *pool = NULL;
    assert_int_equal(kvt_pool_open(&pp, &pool), 0);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 1024; /* no eviction */
    sp.block = 32;
    sp.pool = pool;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    char msg[512];
    filler_msg(msg, sizeof msg, 1, 12);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "ok", KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, fact, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "ok", KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, probe, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_park(s), 0);
    const int32_t victim = 2; /* a block in the middle: blocks after it were computed with it */
    assert_true(kvt_session_n_blocks(s) > victim + 1);
    damage_block(s, pool, victim, d);
    assert_int_equal(kvt_session_resume(s, 1), 0); /* another sequence: positions are the session's own */
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    assert_int_equal(st.n_blocks_resident, st.n_blocks); /* every block is back, none lost */
    struct kvt_block_info b;
    assert_int_equal(kvt_session_block(s, victim, &b), 0);
    assert_int_equal(b.residency, KVT_RES_DEVICE);
    assert_int_equal(b.p0, b.orig_p0); /* in place */
    if (hole) kvt_seq_rm(e, 1, b.p0, b.p0 + b.n_tokens);
    int32_t n = 0;
    assert_int_equal(kvt_session_answer_logprob(s, answer_text, lp, &n), 0);
    *recomputes = st.recomputes;
    kvt_session_free(s);
    kvt_pool_free(pool);
    rmdir(dir);
}

static void resume_lost(enum damage d) {
    kvt_engine *e = open_tiny();
    double lp_in, lp_x, lp_hole;
    int64_t rc_in, rc_x, rc_hole;
    resume_session(e, INTACT, false, &lp_in, &rc_in);
    resume_session(e, d, false, &lp_x, &rc_x);
    resume_session(e, INTACT, true, &lp_hole, &rc_hole);
    printf("  resume with a %s copy: log-prob %.6f (recomputes %lld), intact %.6f, control with the block's cells "
           "removed %.6f\n",
           d == CORRUPT ? "corrupt" : "deleted", lp_x, (long long) rc_x, lp_in, lp_hole);
    assert_int_equal(rc_in, 0);
    assert_int_equal(rc_x, 1);
    assert_true(fabs(lp_x - lp_in) < 1e-4);
    assert_true(fabs(lp_hole - lp_in) > 1e-2); /* control: a hole would be caught */
    kvt_engine_free(e);
}

static void test_resume_corrupt(void **state) {
    (void) state;
    resume_lost(CORRUPT);
}

static void test_resume_deleted(void **state) {
    (void) state;
    resume_lost(DELETE);
}

/* Resume after eviction left gaps (review finding): the damaged block sits right after an evicted
** one, so it cannot be re-decoded at its own position (llama.cpp decodes a sequence only at
** consecutive positions).  It is recomputed right after what is already back; the resume
** succeeds, every block that was resident is back, and the session goes on (a turn is added and
** answered).  Before the fix the resume failed with KVT_ELLAMA and the session was unusable. */
static void test_resume_after_gap(void **state) {
    (void) state;
    kvt_engine *e = open_tiny();
    char dir[] = "/tmp/kvt-faults-XXXXXX";
    assert_non_null(mkdtemp(dir));
    struct kvt_pool_params pp = kvt_pool_default_params();
    pp.budget_bytes = 1; /* every copy spills: it can be damaged on disk */
    pp.spill_dir = dir;
    kvt_pool *pool = NULL;
    assert_int_equal(kvt_pool_open(&pp, &pool), 0);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 128;
    sp.block = 32;
    sp.gen_reserve = 8;
    sp.pool = pool;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    char msg[512];
    for (uint32_t t = 1; t <= 6; t++) {
        filler_msg(msg, sizeof msg, t, 12);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "ok", KVT_KEEP_NONE), 0);
    }
    filler_msg(msg, sizeof msg, 99, 4);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
    /* a resident sealed block whose position-predecessor is not resident: it sits after a gap */
    int32_t victim = -1, n_res = 0;
    kvt_pos prev_end = 0;
    for (int32_t i = 0; i < kvt_session_n_blocks(s); i++) {
        struct kvt_block_info b;
        assert_int_equal(kvt_session_block(s, i, &b), 0);
        if (b.residency != KVT_RES_DEVICE) continue;
        n_res++;
        if (victim < 0 && b.sealed && b.p0 > prev_end) victim = i;
        prev_end = b.p0 + b.n_tokens;
    }
    if (victim < 0) fail_msg("no resident block after a gap: the session did not evict");
    assert_int_equal(kvt_session_park(s), 0);
    damage_block(s, pool, victim, DELETE);
    int rc = kvt_session_resume(s, 1);
    if (rc) fail_msg("resume: %s: %s", kvt_strerror(rc), kvt_errmsg());
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    printf("  resume after a gap: block %d recomputed (recomputes %lld), %d of %d blocks resident, next_pos %d\n", victim,
           (long long) st.recomputes, st.n_blocks_resident, st.n_blocks, st.next_pos);
    assert_int_equal(st.recomputes, 1);
    assert_int_equal(st.n_blocks_resident, n_res);
    assert_int_equal(st.next_pos, kvt_seq_pos_max(e, 1) + 1);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "and then?", KVT_KEEP_NONE), 0);
    char *reply = NULL;
    struct kvt_sampling smp = { 0 };
    assert_int_equal(kvt_session_generate(s, 4, &smp, NULL, NULL, &reply), 0);
    free(reply);
    kvt_session_free(s);
    kvt_pool_free(pool);
    rmdir(dir);
    kvt_engine_free(e);
}

/* A full disk under a session: every spill write fails.  The pool keeps its RAM within the
** budget by dropping the copies it cannot write (counted), the evicted fact block is LOST, and
** the probe recomputes it: the answer equals recovery "breadcrumb" (the same computation), and
** the session still generates a reply. */
static void full_disk(bool with_store) {
    kvt_engine *e = open_tiny();
    const size_t budget = 450000; /* about two blocks' copies */
    struct lost_run bc = lost_session(e, KVT_RECOVERY_BREADCRUMB, INTACT, 1, false);
    struct lost_run x = lost_session_ex(e, KVT_RECOVERY_KV_RESTORE, INTACT, budget, true, with_store);
    printf("  full disk%s: RAM at most %lld of %zu bytes, %lld copies and %lld store disk writes dropped, %lld "
           "recomputed; log-prob %.4f, breadcrumb %.4f\n",
           with_store ? " under a store" : "", (long long) x.max_ram, budget, (long long) x.dropped, (long long) x.store_dropped,
           (long long) x.recomputes, x.lp, bc.lp);
    assert_true(x.max_ram <= (int64_t) budget);
    assert_true(x.max_ram > 0);
    assert_true(x.dropped > 0);
    if (with_store) assert_true(x.store_dropped > 0);
    assert_int_equal(x.recomputes, 1);
    assert_int_equal(x.residency, KVT_RES_DEVICE);
    assert_true(fabs(x.lp - bc.lp) < 1e-4);
    kvt_engine_free(e);
}

static void test_full_disk_session(void **state) {
    (void) state;
    full_disk(false);
}

/* The same full disk under a session whose block store holds its copies (the store replaces the
** pool): the private entries' spills and the store's blob writes all fail.  Host RAM (private
** entries + content RAM tier: one budget) stays within ram_bytes, the copies that cannot be
** written are dropped and counted, the fact block is recomputed (answer equal to breadcrumb
** recovery over a pool), the session answers, and its private entries go with it. */
static void test_full_disk_store(void **state) {
    (void) state;
    full_disk(true);
}

/* A failed test must not leave a site armed for the next one. */
static int disarm(void **state) {
    (void) state;
    for (int k = 0; k < KVT__FAULT__COUNT; k++) kvt__fault_set((enum kvt__fault_site) k, 0, 0);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_seal_fails_gen_step, disarm), cmocka_unit_test_teardown(test_seal_fails_batched, disarm),
        cmocka_unit_test_teardown(test_lost_block_corrupt, disarm),  cmocka_unit_test_teardown(test_lost_block_deleted, disarm),
        cmocka_unit_test_teardown(test_resume_corrupt, disarm),      cmocka_unit_test_teardown(test_resume_deleted, disarm),
        cmocka_unit_test_teardown(test_resume_after_gap, disarm),    cmocka_unit_test_teardown(test_full_disk_session, disarm),
        cmocka_unit_test_teardown(test_full_disk_store, disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
