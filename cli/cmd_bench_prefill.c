/* cmd_bench_prefill.c — `kvtier bench prefill`: what a session's prompt chunk costs beside a plain
** llama_decode of the same chunk.
**
** A session (the default policy, a budget that evicts nothing) holds --resident tokens of essay
** text as one user message.  Then --turns times a new user message of --message tokens goes in
** through the step-wise prefill a server uses (kvt_session_prefill: the conversation so far
** resent, an assistant reply "ok" between turns), and each chunk's wall time is taken from
** kvt_prefill_next to the end of kvt_prefill_done: eviction and recovery planning, the decode with
** attention capture, recording, sealing, the attention signals.  Right after each turn, the same
** chunks (same tokens, same count, the positions right after the session's) are decoded again
** with kvt_engine_decode alone — the same capture layers on, the same resident cells — and removed.
** The ratio session / plain is the session's cost per prompt chunk over the forward pass itself.
** The turn's whole wall time (kvt_session_prefill to kvt_prefill_end: template, tokens, recovery
** search) is reported too.  Ratios are inside one run. */
#include "cli.h"
#include "eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#define IMIN(a, b) ((a) < (b) ? (a) : (b))
#define IMAX(a, b) ((a) > (b) ? (a) : (b))

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int bench_prefill_usage(FILE *f, const struct cli_opt *opts) {
    fprintf(f, "Usage: kvtier bench prefill [-m MODEL] [options]\n"
               "\n"
               "A session's prompt chunk against a plain llama_decode of the same chunk with the same\n"
               "attention capture, at --resident tokens in the cache: --turns user messages of --message\n"
               "tokens go in through the step-wise prefill (kvt_session_prefill), each chunk timed from\n"
               "kvt_prefill_next to kvt_prefill_done; the same chunks are then decoded alone and removed.\n"
               "MODEL defaults to $KVTIER_MODEL; texts to $KVT_SOURCE_DIR/../shared/data/pg_essays.\n"
               "Progress on stderr; --json prints one JSON object as the last stdout line.\n"
               "\n"
               "Options:\n");
    cli_print_opts(f, opts);
    return APP_OK;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    if (n <= 0) return NAN;
    qsort(v, (size_t) n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Essay text of exactly n tokens starting at token `from` of tok (detokenized). */
static char *text_of(kvt_engine *eng, const kvt_token *tok, int32_t from, int32_t n) {
    char *t = NULL;
    return kvt_detokenize(eng, tok + from, n, false, &t) ? NULL : t;
}

int cmd_bench_prefill(int argc, char **argv) {
    static const char cmd[] = "kvtier bench prefill";
    const char *ngl = NULL, *fa = NULL;
    bool no_op_offload = false; /* -ngl, -fa (cli_device_opts) */
    const char *model = getenv("KVTIER_MODEL"), *texts = NULL;
    int32_t resident = 3712, message = 48, turns = 8, threads = 0;
    bool json = false, verbose = false;
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        { "model", 'm', OPT_STR, &model, 0, 0, "MODEL", "GGUF model file (default $KVTIER_MODEL)", NULL },
        { "resident", 0, OPT_INT, &resident, 64, 1 << 20, "N", "tokens in the cache before the measured turns (default 3712)",
          NULL },
        { "message", 0, OPT_INT, &message, 1, 1 << 16, "N", "essay tokens per measured user message (default 48)", NULL },
        { "turns", 0, OPT_INT, &turns, 1, 10000, "N", "measured user messages (default 8)", NULL },
        { "threads", 't', OPT_INT, &threads, 0, 1024, "N", "CPU threads (default 0 = all cores)", NULL },
        { "texts", 0, OPT_STR, &texts, 0, 0, "DIR", "essay directory (default ../shared/data/pg_essays)", NULL },
        { "json", 0, OPT_FLAG, &json, 0, 0, NULL, "print the results as one JSON object on the last stdout line", NULL },
        CLI_DEVICE_OPT_ROWS(&ngl, &fa, &no_op_offload),
        { "verbose", 'v', OPT_FLAG, &verbose, 0, 0, NULL, "llama.cpp's log on stderr", NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */
    int n_pos;
    int rc = cli_parse(cmd, opts, argc, argv, NULL, 0, &n_pos);
    if (rc < 0) return bench_prefill_usage(stdout, opts);
    if (rc) return rc;
    if (!model || !*model) {
        fprintf(stderr, "%s: no model given (use -m MODEL or set KVTIER_MODEL)\n", cmd);
        return APP_USAGE;
    }
    struct eval_corpus corpus;
    if ((rc = eval_corpus_load(cmd, texts, &corpus))) return rc;
    const int32_t n_ctx = resident + turns * (message + 64) + 1024;
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = model;
    ep.n_ctx = n_ctx;
    ep.n_seq = 1;
    ep.n_threads = threads;
    ep.verbose = verbose;
    if ((rc = cli_device_opts(cmd, ngl, fa, no_op_offload, &ep))) {
        eval_corpus_free(&corpus);
        return rc;
    }
    kvt_engine *eng = NULL;
    if ((rc = kvt_engine_open(&ep, &eng))) {
        fprintf(stderr, "%s: %s\n", cmd, *kvt_errmsg() ? kvt_errmsg() : kvt_strerror(rc));
        eval_corpus_free(&corpus);
        return rc == KVT_EINVAL ? APP_USAGE : APP_ERR;
    }
    /* the texts: the resident document, then one message per turn */
    char *all = eval_corpus_join(&corpus, (size_t) (resident + turns * message) * 8);
    eval_corpus_free(&corpus);
    kvt_token *tok = NULL;
    int32_t nt = 0;
    rc = all ? kvt_tokenize(eng, all, false, false, &tok, &nt) : KVT_ENOMEM;
    free(all);
    if (rc || nt < resident + turns * message) {
        if (rc) app_fail(cmd, "tokenizing the essays", rc);
        else fprintf(stderr, "%s: the essays hold %d tokens; %d are needed\n", cmd, nt, resident + turns * message);
        free(tok);
        kvt_engine_free(eng);
        return APP_ERR;
    }
    const int32_t n_msgs = 2 * turns + 1;
    struct kvt_chat_msg *msgs = calloc((size_t) n_msgs, sizeof *msgs);
    char **owned = calloc((size_t) turns + 1, sizeof *owned);
    double *sess = malloc(sizeof(double) * (size_t) (turns * 64 + 64)),
           *plain = malloc(sizeof(double) * (size_t) (turns * 64 + 64));
    double *turn_ms = calloc((size_t) turns, sizeof(double));
    struct kvt_decode_chunk *chunks = malloc(sizeof *chunks * 64);
    kvt_token *copy = malloc(sizeof(kvt_token) * (size_t) (64 * (message + 256)));
    kvt_session *s = NULL;
    rc = msgs && owned && sess && plain && turn_ms && chunks && copy ? APP_OK : APP_ERR;
    for (int32_t i = 0; rc == APP_OK && i <= turns; i++) {
        owned[i] = i == 0 ? text_of(eng, tok, 0, resident) : text_of(eng, tok, resident + (i - 1) * message, message);
        if (!owned[i]) rc = APP_ERR;
    }
    free(tok);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = n_ctx - 256; /* nothing is evicted: the chunk's own cost, not eviction's */
    if (rc == APP_OK && (rc = kvt_session_open(eng, &sp, &s))) app_fail(cmd, "cannot open the session", rc);
    msgs[0] = (struct kvt_chat_msg){ "user", owned[0] };
    if (rc == APP_OK && (rc = kvt_session_sync(s, msgs, 1, NULL))) app_fail(cmd, "the resident document", rc);
    int32_t n_chunks = 0, n_turn = 0, turn_tokens = 0;
    double sum_sess = 0, sum_plain = 0;
    for (int32_t t = 1; rc == APP_OK && t <= turns; t++) {
        msgs[2 * t - 1] = (struct kvt_chat_msg){ "assistant", "ok" };
        msgs[2 * t] = (struct kvt_chat_msg){ "user", owned[t] };
        kvt_prefill *pf = NULL;
        int32_t k = 0;
        const double t0 = now_ms();
        if ((rc = kvt_session_prefill(s, msgs, 2 * t + 1, NULL, 0, &pf))) break;
        for (;;) {
            const double c0 = now_ms();
            struct kvt_decode_chunk c;
            int r = kvt_prefill_next(pf, 0, &c);
            if (r != 1) {
                rc = r;
                break;
            }
            r = kvt_prefill_done(pf, kvt_engine_decode(eng, c.seq, c.tokens, c.n, c.pos0, c.want_logits));
            if (k < 64) { /* its tokens for the plain decode (pf owns them only until the next call) */
                sess[n_chunks + k] = now_ms() - c0;
                memcpy(copy + (size_t) k * (message + 256), c.tokens, sizeof(kvt_token) * (size_t) IMIN(c.n, message + 256));
                chunks[k] = c;
                k++;
            }
            if (r) {
                rc = r;
                break;
            }
        }
        struct kvt_sync_info si;
        int re = kvt_prefill_end(pf, &si);
        if (rc == 0) rc = re;
        if (rc) {
            app_fail(cmd, "a measured turn", rc);
            break;
        }
        turn_ms[n_turn++] = now_ms() - t0;
        /* the same chunks again, plain, at the positions after the session's, then removed */
        kvt_pos next = 0;
        for (int32_t i = 0; i < k; i++) next = IMAX(next, chunks[i].pos0 + chunks[i].n);
        for (int32_t i = 0; i < k && rc == 0; i++) {
            const int32_t m = IMIN(chunks[i].n, message + 256);
            const double c0 = now_ms();
            rc = kvt_engine_decode(eng, chunks[i].seq, copy + (size_t) i * (message + 256), m, next, true);
            plain[n_chunks + i] = now_ms() - c0;
            kvt_seq_rm(eng, chunks[i].seq, next, -1);
            sum_sess += sess[n_chunks + i];
            sum_plain += plain[n_chunks + i];
            turn_tokens += m;
        }
        if (rc) {
            app_fail(cmd, "a plain decode", rc);
            break;
        }
        n_chunks += k;
        fprintf(stderr, "%s: turn %d/%d: %d chunks, %.1f ms in all (%d prompt tokens)\n", cmd, t, turns, k, turn_ms[n_turn - 1],
                si.prompt_tokens);
    }
    if (rc == APP_OK && n_chunks > 0) {
        struct kvt_engine_info I;
        kvt_engine_info(eng, &I);
        double ms[2] = { median(sess, n_chunks), median(plain, n_chunks) }, turn_med = median(turn_ms, n_turn);
        const double ratio = sum_sess / sum_plain;
        printf("model: %s | %d resident tokens | %d turns of %d tokens | %d chunks (%d tokens) | %s\n", I.desc, resident, turns,
               message, n_chunks, turn_tokens, kvt_build_info());
        printf("%-40s %10s %10s\n", "", "median ms", "sum ms");
        printf("%-40s %10.2f %10.1f\n", "session chunk (next .. done)", ms[0], sum_sess);
        printf("%-40s %10.2f %10.1f\n", "plain kvt_engine_decode, same capture", ms[1], sum_plain);
        printf("session / plain: %.3fx; a whole turn (template, tokens, recovery search, chunks): median %.1f ms\n", ratio,
               turn_med);
        if (json) {
            json_t *o = json_pack("{s:s,s:i,s:i,s:i,s:i,s:i,s:f,s:f,s:f,s:f,s:f,s:f,s:s}", "model", I.desc, "resident", resident,
                                  "turns", turns, "message", message, "chunks", n_chunks, "chunk_tokens", turn_tokens,
                                  "session_chunk_ms_median", ms[0], "plain_decode_ms_median", ms[1], "session_ms_sum", sum_sess,
                                  "plain_ms_sum", sum_plain, "ratio", ratio, "turn_ms_median", turn_med, "build", kvt_build_info());
            char *d = o ? json_dumps(o, JSON_COMPACT) : NULL;
            if (d) printf("%s\n", d);
            free(d);
            json_decref(o);
        }
    }
    kvt_session_free(s);
    for (int32_t i = 0; owned && i <= turns; i++) free(owned[i]);
    free(owned);
    free(msgs);
    free(sess);
    free(plain);
    free(turn_ms);
    free(chunks);
    free(copy);
    kvt_engine_free(eng);
    return rc == APP_OK ? APP_OK : APP_ERR;
}
