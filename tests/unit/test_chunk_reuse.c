/* test_chunk_reuse — non-prefix chunk reuse (kvt_session_params.chunk_reuse, src/session/chunks.c)
** on SmolLM2-135M-Instruct ($KVTIER_CHAT_MODEL; skipped without it), a real store in a temp dir.
** A RAG-style turn: system = instruction + documents D1 D2 D3, user = a question.  Session 1 feeds
** [S, D1, D2, D3, Q]; session 2, fresh, feeds [S, D3, D1, D2, Q'] with chunk_reuse:
**   - reorder: the documents' blocks are found at their new offsets and loaded (chunk_tokens > 0),
**     the next-token distribution is close to a cold prefill's (KL bound from the measurement in
**     docs/BENCHMARKS.md), and the CONTROL — the same blocks stored with their cells moved to the
**     new positions WITHOUT rotating K (no RoPE re-anchoring) — is clearly worse;
**   - off: the same without chunk_reuse: 0 chunk tokens, no chunk key in the store;
**   - purity: after session 2's chunk loads, a third session routing the prefix of the same
**     prompt gets only cold-prefill blocks (its logits equal a cold prefill's);
**   - tenants: another tenant salt finds no chunk;
**   - fault: a failing chunk load is decoded instead, counted, logits as a cold prefill's;
**   - recompute: the default 15 % decodes the first block of each run; bad specs are refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "fault.h"
#include "kv/blob.h"
#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { BLOCK = 32 };

static kvt_engine *g_eng;
static int32_t g_vocab;

static const char *INSTR = "Answer the question using the documents below.";
static const char *DOCS[3] = {
    "The lighthouse on Marrow Point was built in 1871 by a team of stonemasons from Aberdeen. Its lamp burned "
    "whale oil until 1903, when the keepers switched to kerosene. The tower is sixty feet tall and painted with "
    "red and white bands so that sailors can recognise it by day. In 1952 the last keeper, Agnes Moore, left the "
    "island and the light became automatic. Today the keeper's cottage is a small museum about shipwrecks.",
    "Copper kettles were common in farmhouse kitchens across the valley. A good kettle was passed from mother to "
    "daughter and polished every Sunday with vinegar and salt. Travelling tinkers repaired the seams with solder "
    "and charged a penny for each patch. When aluminium pans arrived in the shops after the war, most families "
    "sold their copper to the scrap merchant, and only a few kettles survive in the regional collection.",
    "The orchard behind the old school has forty apple trees of eleven varieties. The oldest tree, a Bramley, was "
    "planted by the headmaster in 1920 and still gives fruit every autumn. Pupils pick the apples in October and "
    "press them into juice, which is sold at the harvest fair to pay for new saplings. The secret code of the "
    "orchard gate is 4417, and only the caretaker and the head gardener know it.",
};

static char *join(const char *a, const char *b, const char *c, const char *d) {
    size_t n = strlen(a) + strlen(b) + strlen(c) + strlen(d) + 8;
    char *t = malloc(n);
    snprintf(t, n, "%s\n\n%s\n\n%s\n\n%s", a, b, c, d);
    return t;
}

static char *tmp_dir(void) {
    char *d = strdup("/tmp/kvt-chunk-XXXXXX");
    assert_non_null(mkdtemp(d));
    return d;
}

static void rm_rf(const char *dir) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static kvt_store *open_store(const char *dir) {
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = dir;
    p.ram_bytes = 128u << 20;
    p.disk_bytes = 512u << 20;
    kvt_store *st = NULL;
    int rc = kvt_store_open(&p, &st);
    if (rc) fprintf(stderr, "store %s: %s\n", dir, kvt_errmsg());
    assert_int_equal(rc, 0);
    return st;
}

struct run {
    char *reply; /* greedy reply of 16 tokens when asked for */
    float *logits;
    struct kvt_session_stats st;
    kvt_token *tok; /* the session's stream */
    int32_t n_tok;
    int32_t n_b;
    struct kvt_block_info *b;
};

static void run_free(struct run *r) {
    free(r->logits);
    free(r->reply);
    free(r->tok);
    free(r->b);
    memset(r, 0, sizeof *r);
}

/* One turn (system = documents, user = question) in a fresh session; stats, logits, blocks. */
static void turn_ex(kvt_store *st, bool chunk, const char *recompute, const char *tenant, const char *sys, const char *q,
                    bool reply, struct run *out) {
    memset(out, 0, sizeof *out);
    struct kvt_session_params p = kvt_session_default_params();
    p.block = BLOCK;
    p.budget = 2048;
    p.store = st;
    p.tenant = tenant;
    p.chunk_reuse = chunk;
    p.chunk_recompute = recompute;
    kvt_session *s = NULL;
    int rc = kvt_session_open(g_eng, &p, &s);
    if (rc) fprintf(stderr, "open: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_SYSTEM, sys, KVT_KEEP_NONE), 0);
    rc = kvt_session_add(s, KVT_ROLE_USER, q, KVT_KEEP_NONE);
    if (rc) fprintf(stderr, "add: %s\n", kvt_errmsg());
    assert_int_equal(rc, 0);
    out->logits = malloc(sizeof(float) * (size_t) g_vocab);
    memcpy(out->logits, kvt_session_logits(s), sizeof(float) * (size_t) g_vocab);
    kvt_session_get_stats(s, &out->st);
    out->n_tok = kvt_session_tokens(s, NULL, 0);
    out->tok = malloc(sizeof(kvt_token) * (size_t) out->n_tok);
    kvt_session_tokens(s, out->tok, out->n_tok);
    out->n_b = kvt_session_n_blocks(s);
    out->b = calloc((size_t) out->n_b, sizeof *out->b);
    for (int32_t i = 0; i < out->n_b; i++) assert_int_equal(kvt_session_block(s, i, &out->b[i]), 0);
    for (int32_t i = 0; i < out->n_b; i++) out->b[i].text = NULL; /* owned by the session */
    if (reply) {
        struct kvt_sampling smp;
        memset(&smp, 0, sizeof smp);
        smp.top_p = 1.0f; /* greedy */
        assert_int_equal(kvt_session_generate(s, 16, &smp, NULL, NULL, &out->reply), 0);
    }
    kvt_session_free(s);
    if (st) kvt_store_flush(st);
    printf("  %-34s prefix %4d, chunk %4lld tokens in %lld runs (+%lld recomputed), %4lld decoded, %lld chain / "
           "%lld chunk blocks put, %lld load errors, scan %.2f ms\n",
           chunk ? "chunk_reuse" : "no chunk_reuse", out->st.route_tokens, (long long) out->st.chunk_tokens,
           (long long) out->st.chunk_runs, (long long) out->st.chunk_recompute_tokens, (long long) out->st.tokens_decoded,
           (long long) out->st.store_blocks_put, (long long) out->st.chunk_blocks_put, (long long) out->st.chunk_load_errors,
           out->st.chunk_scan_ms);
}

static void turn(kvt_store *st, bool chunk, const char *recompute, const char *tenant, const char *sys, const char *q,
                 struct run *out) {
    turn_ex(st, chunk, recompute, tenant, sys, q, false, out);
}

/* KL(p || q) of the next-token distributions, nats. */
static double kl(const float *lp, const float *lq) {
    double mp = -INFINITY, mq = -INFINITY, zp = 0, zq = 0, k = 0;
    for (int32_t i = 0; i < g_vocab; i++) {
        mp = fmax(mp, lp[i]);
        mq = fmax(mq, lq[i]);
    }
    for (int32_t i = 0; i < g_vocab; i++) {
        zp += exp(lp[i] - mp);
        zq += exp(lq[i] - mq);
    }
    for (int32_t i = 0; i < g_vocab; i++) {
        double a = lp[i] - mp - log(zp), b = lq[i] - mq - log(zq);
        k += exp(a) * (a - b);
    }
    return k;
}

static int32_t argmax(const float *l) {
    int32_t m = 0;
    for (int32_t i = 1; i < g_vocab; i++)
        if (l[i] > l[m]) m = i;
    return m;
}

static kvt_key chunk_key(const char *tenant, const kvt_token *tok) {
    struct kvt_chain_params cp = { .layout = NULL, .block = BLOCK, .tenant = tenant };
    static char layout[512];
    assert_int_equal(kvt_engine_fingerprint(g_eng, &cp.model), 0);
    kvt_engine_layout(g_eng, layout, sizeof layout);
    cp.layout = layout;
    kvt_key k;
    assert_int_equal(kvt_chunk_root(&cp, &k), 0);
    assert_int_equal(kvt_chain_next(&k, tok, BLOCK, &k), 0);
    return k;
}

static char *S1, *S2;
static char *g_base;            /* a store directory holding session 1's blocks only (setup) */
static struct run g_cold, g_r1; /* cold prefill of [S, D3, D1, D2, Q'] (with its reply); session 1 */
static int g_pad = 0;           /* instruction padding that aligns session 2's first chunk (a hint) */

/* A fresh store directory holding session 1's blocks: a copy of g_base. */
static kvt_store *base_copy(char **dir) {
    *dir = tmp_dir();
    char cmd[2400];
    snprintf(cmd, sizeof cmd, "cp -r '%s/.' '%s/'", g_base, *dir);
    assert_int_equal(system(cmd), 0);
    return open_store(*dir);
}
static const char *Q1 = "What is the secret code of the orchard gate?";
static const char *Q2 = "Which code opens the orchard gate?";

static int setup(void **state) {
    (void) state;
    const char *m = getenv("KVTIER_CHAT_MODEL");
    if (!m || access(m, R_OK) != 0) return 0;
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = m;
    p.n_ctx = 4096;
    p.n_threads = 2;
    if (kvt_engine_open(&p, &g_eng)) return -1;
    struct kvt_engine_info I;
    kvt_engine_info(g_eng, &I);
    g_vocab = I.n_vocab;
    S1 = join(INSTR, DOCS[0], DOCS[1], DOCS[2]);
    S2 = join(INSTR, DOCS[2], DOCS[0], DOCS[1]);
    turn_ex(NULL, false, NULL, NULL, S2, Q2, true, &g_cold); /* the reference: cold prefill */
    g_base = tmp_dir();
    kvt_store *st = open_store(g_base);
    turn(st, true, "0", NULL, S1, Q1, &g_r1); /* session 1 stores chunk keys */
    kvt_store_free(st);
    return 0;
}

static int teardown(void **state) {
    (void) state;
    kvt_engine_free(g_eng);
    run_free(&g_cold);
    run_free(&g_r1);
    if (g_base) rm_rf(g_base);
    free(g_base);
    free(S1);
    free(S2);
    return 0;
}

/* The control store: session 1's chunk blocks with their cells moved to where session 2 holds
** the same tokens, K NOT rotated (so the session's load sees delta 0 and rotates nothing). */
static void put_unanchored(kvt_store *from, kvt_store *to, const struct run *r1, const struct run *r2, int *moved) {
    kvt_key fp;
    assert_int_equal(kvt_engine_fingerprint(g_eng, &fp), 0);
    for (int32_t i = 0; i < r1->n_b; i++) {
        const struct kvt_block_info *b = &r1->b[i];
        if (b->n_tokens != BLOCK) continue;
        const kvt_token *t = r1->tok + b->orig_p0;
        kvt_key k = chunk_key(NULL, t);
        void *data = NULL;
        size_t n = 0;
        struct kvt_store_meta meta;
        if (kvt_store_get(from, &k, &fp, &data, &n, &meta, NULL)) continue;
        int32_t delta = 0;
        for (int32_t j = 0; j < r2->n_b; j++)
            if (r2->b[j].n_tokens == BLOCK && !memcmp(r2->tok + r2->b[j].orig_p0, t, sizeof *t * BLOCK))
                delta = r2->b[j].orig_p0 - b->orig_p0;
        if (delta) { /* positions only: the cell records */
            struct kvt__blob_layout *L = malloc(sizeof *L);
            assert_int_equal(kvt__blob_parse(data, n, 1, L), 0);
            uint8_t *buf = data;
            for (int p = 0; p < L->n_parts; p++) {
                size_t off = L->part[p].cells_off;
                for (uint32_t c = 0; c < L->part[p].n_cells; c++) {
                    int32_t pos;
                    uint32_t nsid;
                    memcpy(&pos, buf + off, 4);
                    memcpy(&nsid, buf + off + 4, 4);
                    pos += delta;
                    memcpy(buf + off, &pos, 4);
                    off += 8 + (size_t) nsid * 4;
                }
            }
            free(L);
            (*moved)++;
        }
        assert_int_equal(kvt_store_put(to, &k, &meta, data, n), 0);
        free(data);
    }
    kvt_store_flush(to);
}

static void test_reorder(void **state) {
    (void) state;
    if (!g_eng) skip();
    char *dir, *dir_off, *dir_ctl = tmp_dir(), *dir_rec;
    kvt_store *st = base_copy(&dir), *st_off = base_copy(&dir_off), *st_ctl = open_store(dir_ctl);
    struct run r2, off2, ctl, pure, other, rec;
    const struct run *cold = &g_cold, *r1 = &g_r1;

    assert_true(r1->st.chunk_blocks_put >= r1->n_tok / BLOCK - 1);
    assert_int_equal(r1->st.chunk_tokens, 0);
    turn(st, true, "0", NULL, S2, Q2, &r2); /* session 2: documents reordered */
    const double kl2 = kl(cold->logits, r2.logits);
    printf("  reorder, k = 0: %lld of %d prompt tokens loaded as chunks, KL vs cold prefill %.5f nats\n",
           (long long) r2.st.chunk_tokens, r2.n_tok, kl2);
    assert_true(r2.st.chunk_runs >= 2);           /* D3, then D1 D2 */
    assert_true(r2.st.chunk_tokens >= 4 * BLOCK); /* most of the ~280 document tokens */
    assert_int_equal(r2.st.chunk_load_errors, 0);
    assert_true(r2.st.tokens_decoded + r2.st.route_tokens + r2.st.chunk_tokens == r2.n_tok);
    /* measured 0.05-0.2 nats on SmolLM2 for k = 0 (docs/BENCHMARKS.md); finite, and far from the
    ** control's */
    assert_true(isfinite(kl2) && kl2 < 1.0);
    for (int32_t i = 0, n = 0; i < r2.n_b; i++) { /* the loaded blocks hold the documents' tokens */
        if (!r2.b[i].from_chunk) continue;
        n++;
        assert_int_equal(r2.b[i].n_tokens, BLOCK);
        kvt_key k = chunk_key(NULL, r2.tok + r2.b[i].orig_p0);
        assert_true(kvt_store_has(st, &k));
        assert_true(n <= r2.st.chunk_tokens / BLOCK);
    }

    /* the same without chunk_reuse, on a store holding session 1's chunk keys: nothing found,
    ** no chunk key written (the keys of its blocks that were not there before are not there
    ** after; session 2 above did write them, so the check can see one) */
    int keys_before = 0, keys_after = 0, keys_on = 0;
    for (int32_t i = 0; i < r2.n_b; i++)
        if (r2.b[i].n_tokens == BLOCK) {
            kvt_key k = chunk_key(NULL, r2.tok + r2.b[i].orig_p0);
            keys_before += kvt_store_has(st_off, &k);
        }
    turn(st_off, false, NULL, NULL, S2, Q2, &off2);
    for (int32_t i = 0; i < r2.n_b; i++)
        if (r2.b[i].n_tokens == BLOCK) {
            kvt_key k = chunk_key(NULL, r2.tok + r2.b[i].orig_p0);
            keys_after += kvt_store_has(st_off, &k);
            keys_on += kvt_store_has(st, &k);
        }
    assert_int_equal(off2.st.chunk_tokens + off2.st.chunk_runs + off2.st.chunk_blocks_put, 0);
    assert_int_equal(keys_after, keys_before);
    assert_true(keys_on > keys_before);
    assert_true(kl(cold->logits, off2.logits) < 1e-3);

    /* CONTROL: the same blocks at the same new positions without RoPE re-anchoring */
    int moved = 0;
    put_unanchored(st, st_ctl, r1, &r2, &moved);
    assert_true(moved > 0);
    turn(st_ctl, true, "0", NULL, S2, Q2, &ctl);
    const double klc = kl(cold->logits, ctl.logits);
    printf("  control (no re-anchoring): %lld chunk tokens, KL %.5f nats\n", (long long) ctl.st.chunk_tokens, klc);
    assert_true(ctl.st.chunk_tokens >= r2.st.chunk_tokens); /* + the prefix (no chain keys in that store) */
    assert_true(klc > 2 * kl2 && klc > kl2 + 0.01);

    /* a prefix route of the same prompt after the chunk loads gets a cold prefill's KV only
    ** (test_chain_purity checks the keys themselves) */
    assert_true(kl2 > 1e-3); /* so a chunk-loaded block routed as a prefix would show */
    turn(st, false, NULL, NULL, S2, Q2, &pure);
    printf("  prefix route after chunk loads: %d tokens, KL %.6f\n", pure.st.route_tokens, kl(cold->logits, pure.logits));
    assert_true(pure.st.route_tokens > 0);
    assert_true(kl(cold->logits, pure.logits) < 1e-3);
    assert_int_equal(argmax(cold->logits), argmax(pure.logits));

    /* another tenant: no chunk */
    turn(st, true, "0", "tenant-b", S2, Q2, &other);
    assert_int_equal(other.st.chunk_tokens + other.st.chunk_runs, 0);

    /* the default recompute (15 %): the first block of each run decoded (a store that holds
    ** session 1's blocks only: session 2's own would match its whole prompt) */
    kvt_store *st_rec = base_copy(&dir_rec);
    turn(st_rec, true, NULL, NULL, S2, Q2, &rec);
    kvt_store_free(st_rec);
    rm_rf(dir_rec);
    free(dir_rec);
    printf("  default recompute: KL %.5f nats\n", kl(cold->logits, rec.logits));
    assert_true(rec.st.chunk_recompute_tokens >= rec.st.chunk_runs * BLOCK);
    assert_true(rec.st.chunk_tokens > 0 && rec.st.chunk_tokens < r2.st.chunk_tokens);

    for (int32_t i = 0; i < r2.n_b; i++) /* test_chain_purity's padding hint */
        if (r2.b[i].from_chunk) {
            g_pad = (BLOCK - r2.b[i].p0 % BLOCK) % BLOCK;
            break;
        }
    run_free(&r2);
    run_free(&off2);
    run_free(&ctl);
    run_free(&pure);
    run_free(&other);
    run_free(&rec);
    kvt_store_free(st);
    kvt_store_free(st_off);
    kvt_store_free(st_ctl);
    rm_rf(dir);
    rm_rf(dir_off);
    rm_rf(dir_ctl);
    free(dir);
    free(dir_off);
    free(dir_ctl);
}

/* After a chunk load the session stores no chain key (its KV is no longer a cold prefill's).
** Checked where it matters: the first chunk starts at a block boundary of session 2 (no early
** seal, which ends purity by itself), found by padding the instruction by the missing tokens. */
static void test_chain_purity(void **state) {
    (void) state;
    if (!g_eng) skip();
    int pad = g_pad;
    bool checked = false;
    for (int attempt = 0; attempt < 4 && !checked; attempt++) {
        char *dir;
        kvt_store *st = base_copy(&dir);
        char instr[1024];
        snprintf(instr, sizeof instr, "%s", INSTR);
        for (int i = 0; i < pad; i++) strcat(instr, " ok");
        char *s2 = join(instr, DOCS[2], DOCS[0], DOCS[1]);
        struct run r2;
        turn(st, true, "0", NULL, s2, Q2, &r2);
        int32_t f = -1;
        for (int32_t i = 0; i < r2.n_b && f < 0; i++)
            if (r2.b[i].from_chunk) f = i;
        assert_true(f > 0);
        const int32_t mis = r2.b[f].p0 % BLOCK;
        bool early = false;
        for (int32_t i = 0; i < f; i++) early |= r2.b[i].n_tokens != BLOCK;
        printf("  pad %d: first chunk block %d at %d (%d past a boundary, %s early seal)\n", pad, f, r2.b[f].p0, mis,
               early ? "an" : "no");
        if (!early) {
            struct kvt_chain_params cp = { .block = BLOCK };
            char layout[512];
            kvt_engine_layout(g_eng, layout, sizeof layout);
            cp.layout = layout;
            assert_int_equal(kvt_engine_fingerprint(g_eng, &cp.model), 0);
            kvt_key h;
            assert_int_equal(kvt_chain_root(&cp, &h), 0);
            for (int32_t i = 0; (i + 1) * BLOCK <= r2.n_tok; i++) {
                assert_int_equal(kvt_chain_next(&h, r2.tok + (size_t) i * BLOCK, BLOCK, &h), 0);
                const bool has = kvt_store_has(st, &h);
                if (i < f) assert_true(has); /* stored while pure (the check sees keys) */
                else assert_false(has);      /* never after the chunk load */
            }
            struct run cold, pure;
            turn(NULL, false, NULL, NULL, s2, Q2, &cold);
            turn(st, false, NULL, NULL, s2, Q2, &pure);
            assert_int_equal(pure.st.route_tokens, f * BLOCK);
            assert_true(kl(cold.logits, pure.logits) < 1e-3);
            run_free(&cold);
            run_free(&pure);
            checked = true;
        }
        pad += (BLOCK - mis) % BLOCK;
        run_free(&r2);
        free(s2);
        kvt_store_free(st);
        rm_rf(dir);
        free(dir);
    }
    assert_true(checked);
}

static void test_load_fault(void **state) {
    (void) state;
    if (!g_eng) skip();
    char *dir;
    kvt_store *st = base_copy(&dir);
    struct run r2;
    const struct run *cold = &g_cold;
    kvt__fault_set(KVT__FAULT_CHUNK_LOAD, 0, -1);
    turn_ex(st, true, "0", NULL, S2, Q2, true, &r2);
    const int64_t hits = kvt__fault_hits(KVT__FAULT_CHUNK_LOAD);
    kvt__fault_set(KVT__FAULT_CHUNK_LOAD, 0, 0);
    assert_true(hits >= 2);
    assert_int_equal(r2.st.chunk_load_errors, hits);
    assert_int_equal(r2.st.chunk_tokens, 0);
    assert_int_equal(r2.st.tokens_decoded + r2.st.route_tokens, r2.n_tok); /* no hole */
    printf("  failed chunk loads decoded instead: KL %.6f, reply '%s' (without reuse: '%s')\n", kl(cold->logits, r2.logits),
           r2.reply, cold->reply);
    /* the same tokens decoded in other pieces (early seals): ~1e-3 nats of f16 numerics.  The
    ** greedy replies are printed, not compared: runs that are not bit-identical may part at a
    ** near tie after the first token, and where depends on the CPU's float summation order */
    assert_true(kl(cold->logits, r2.logits) < 5e-3);
    assert_int_equal(argmax(cold->logits), argmax(r2.logits));
    run_free(&r2);
    kvt_store_free(st);
    rm_rf(dir);
    free(dir);
}

static void test_params(void **state) {
    (void) state;
    int32_t t;
    double pct;
    assert_int_equal(kvt_chunk_recompute_parse("16", &t, &pct), 0);
    assert_int_equal(t, 16);
    assert_int_equal(kvt_chunk_recompute_parse("15%", &t, &pct), 0);
    assert_true(t == -1 && pct == 15);
    assert_int_equal(kvt_chunk_recompute_parse("12.5%", &t, &pct), 0);
    const char *bad[] = { "", "x", "-1", "101%", "1.5", "4 ", "%", "nan%", "15%%" };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(kvt_chunk_recompute_parse(bad[i], &t, &pct), KVT_EINVAL);
        char want[32];
        snprintf(want, sizeof want, "'%s'", bad[i]);
        assert_non_null(strstr(kvt_errmsg(), want));
    }
    /* chain and chunk roots differ for the same inputs */
    struct kvt_chain_params cp = { .layout = "l", .block = 32 };
    kvt_key a, b;
    assert_int_equal(kvt_chain_root(&cp, &a), 0);
    assert_int_equal(kvt_chunk_root(&cp, &b), 0);
    assert_memory_not_equal(a.b, b.b, KVT_KEY_BYTES);
    if (!g_eng) return;
    struct kvt_session_params p = kvt_session_default_params();
    kvt_session *s = NULL;
    p.chunk_reuse = true; /* no store */
    assert_int_equal(kvt_session_open(g_eng, &p, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "store"));
    p.chunk_reuse = false;
    p.chunk_recompute = "7%%";
    assert_int_equal(kvt_session_open(g_eng, &p, &s), KVT_EINVAL);
    assert_non_null(strstr(kvt_errmsg(), "'7%%'"));
    assert_null(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_params),
        cmocka_unit_test(test_reorder),
        cmocka_unit_test(test_chain_purity),
        cmocka_unit_test(test_load_fault),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
