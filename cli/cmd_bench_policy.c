/* cmd_bench_policy.c — `kvtier bench policy`: what each eviction policy costs per decode step.
**
** Every policy of --policies runs the same conversation on one engine: --turns user turns of
** --turn-tokens tokens of essay text, each followed by a greedy reply of at most --gen tokens
** (the decode steps actually run are counted).  The session's own
** clocks (kvt_session_stats) split the time:
**   decode_ms   time in kvt_engine_decode (llama.cpp's forward pass, with attention capture on for
**               the policies that read attention);
**   policy_ms   eviction policy work: attention signals (reading the captured attention and
**               mapping it to blocks), scoring, bookkeeping — not the block primitives.
** The decode phase (the --gen tokens of each reply) is measured separately from the prefill of
** the user turns: "per decode step" numbers are policy_ms / steps over the decode phase only.
** Policies run interleaved, --rounds times, and the table gives per-policy totals; ratios are
** inside one run (shared machines are noisy).  The capture cost appears as decode ms per step
** relative to streaming, which runs the same budget without capture. */
#include "cli.h"
#include "eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

struct pol_sum {
    int32_t policy;
    int64_t steps, prefill_tokens, evictions, recoveries;
    double dec_decode_ms, dec_policy_ms; /* decode phase */
    double pre_decode_ms, pre_policy_ms; /* prefill of the user turns (incl. recovery scoring) */
    int32_t peak;
    int errors;
};

static int bench_policy_usage(FILE *f, const struct cli_opt *opts) {
    fprintf(f, "Usage: kvtier bench policy [-m MODEL] [options]\n"
               "\n"
               "Per-decode-step overhead of each eviction policy: the same conversation (--turns user\n"
               "turns of --turn-tokens tokens of essay text, each answered by --gen greedy tokens) under\n"
               "every policy of --policies, interleaved --rounds times on one engine. Reports decode ms\n"
               "per step, policy ms per step (attention signals, scoring, bookkeeping; not the block\n"
               "primitives) and their ratio, for the decode phase and for the prefill of the turns.\n"
               "MODEL defaults to $KVTIER_MODEL; texts to $KVT_SOURCE_DIR/../shared/data/pg_essays.\n"
               "Progress on stderr; --json prints one JSON object as the last stdout line.\n"
               "\n"
               "Options:\n");
    cli_print_opts(f, opts);
    return APP_OK;
}

/* The conversation: consecutive essay text cut into n turns of `tokens` tokens each. */
static int make_turns(const char *cmd, kvt_engine *eng, const struct eval_corpus *c, int32_t n, int32_t tokens, char ***out) {
    char *all = eval_corpus_join(c, (size_t) n * (size_t) tokens * 8);
    kvt_token *tok = NULL;
    int32_t nt = 0;
    int rc = all ? kvt_tokenize(eng, all, false, false, &tok, &nt) : KVT_ENOMEM;
    free(all);
    if (rc || nt < n * tokens) {
        if (rc) app_fail(cmd, "tokenizing the essays", rc);
        else fprintf(stderr, "%s: the essays hold %d tokens, %d turns of %d need %d\n", cmd, nt, n, tokens, n * tokens);
        free(tok);
        return APP_ERR;
    }
    char **t = calloc((size_t) n, sizeof *t);
    for (int32_t i = 0; t && i < n; i++)
        if (kvt_detokenize(eng, tok + (size_t) i * tokens, tokens, false, &t[i])) {
            for (int32_t j = 0; j < i; j++) free(t[j]);
            free(t);
            t = NULL;
        }
    free(tok);
    if (!t) return APP_ERR;
    *out = t;
    return APP_OK;
}

static bool no_stop(const char *piece, void *ud) {
    (void) piece;
    (void) ud;
    return true;
}

/* One session under one policy; adds into *ps. */
static int run_one(const char *cmd, kvt_engine *eng, kvt_pool *pool, struct pol_sum *ps, int32_t budget, int32_t n_ctx,
                   char **turns, int32_t n_turns, int32_t gen) {
    struct kvt_session_params sp = kvt_session_default_params();
    sp.policy = ps->policy;
    sp.budget = ps->policy == KVT_POLICY_NO_EVICTION ? n_ctx : budget;
    sp.pool = pool;
    sp.gen_reserve = gen;
    kvt_session *s = NULL;
    int rc = kvt_session_open(eng, &sp, &s);
    if (rc) {
        app_fail(cmd, "cannot open the session", rc);
        return rc;
    }
    struct kvt_session_stats a, b, c;
    const struct kvt_sampling smp = { .temperature = 0.0f, .top_p = 1.0f };
    for (int32_t t = 0; t < n_turns && rc == 0; t++) {
        kvt_session_get_stats(s, &a);
        if ((rc = kvt_session_add(s, KVT_ROLE_USER, turns[t], KVT_KEEP_NONE))) break;
        kvt_session_get_stats(s, &b);
        /* at most `gen` steps (end of turn ends a reply early); the steps are counted */
        rc = kvt_session_generate(s, gen, &smp, no_stop, NULL, NULL);
        kvt_session_get_stats(s, &c);
        ps->pre_decode_ms += b.decode_ms - a.decode_ms;
        ps->pre_policy_ms += b.policy_ms - a.policy_ms;
        ps->prefill_tokens += b.tokens_decoded - a.tokens_decoded;
        ps->dec_decode_ms += c.decode_ms - b.decode_ms;
        ps->dec_policy_ms += c.policy_ms - b.policy_ms;
        ps->steps += c.tokens_decoded - b.tokens_decoded;
    }
    if (rc) {
        app_fail(cmd, kvt_policy_name(ps->policy), rc);
        ps->errors++;
    }
    kvt_session_get_stats(s, &c);
    ps->evictions += c.evictions;
    ps->recoveries += c.recoveries;
    ps->peak = c.peak_resident_tokens > ps->peak ? c.peak_resident_tokens : ps->peak;
    kvt_session_free(s);
    return rc;
}

static double per(double x, int64_t n) { return n > 0 ? x / (double) n : NAN; }

int cmd_bench_policy(int argc, char **argv) {
    static const char cmd[] = "kvtier bench policy";
    const char *ngl = NULL, *fa = NULL;
    bool no_op_offload = false; /* -ngl, -fa (cli_device_opts) */
    const char *model = getenv("KVTIER_MODEL"), *policies_s = "no_eviction,truncate,streaming,h2o,snapkv,infllm,kvtier",
               *texts = NULL;
    int32_t budget = 512, turns = 12, turn_tokens = 200, gen = 32, rounds = 1, threads = 0;
    bool json = false, verbose = false;
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        { "model", 'm', OPT_STR, &model, 0, 0, "MODEL", "GGUF model file (default $KVTIER_MODEL)", NULL },
        { "policies", 0, OPT_STR, &policies_s, 0, 0, "LIST",
          "policies to time (default no_eviction,truncate,streaming,h2o,snapkv,infllm,kvtier)", NULL },
        { "budget", 0, OPT_INT, &budget, 128, 1 << 20, "N", "resident-token budget of the evicting policies (default 512)", NULL },
        { "turns", 0, OPT_INT, &turns, 1, 10000, "N", "user turns per session (default 12)", NULL },
        { "turn-tokens", 0, OPT_INT, &turn_tokens, 8, 1 << 16, "N", "essay tokens per user turn (default 200)", NULL },
        { "gen", 0, OPT_INT, &gen, 1, 1 << 16, "N", "generated tokens per turn, the decode steps (default 32)", NULL },
        { "rounds", 0, OPT_INT, &rounds, 1, 1000, "N", "times every policy runs, interleaved (default 1)", NULL },
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
    if (rc < 0) return bench_policy_usage(stdout, opts);
    if (rc) return rc;
    struct pol_sum ps[KVT_POLICY__COUNT];
    int n_pol = 0;
    memset(ps, 0, sizeof ps);
    char *list = strdup(policies_s);
    if (!list) return APP_ERR;
    for (char *save = NULL, *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int32_t p;
        if (kvt_policy_from_name(t, &p)) {
            fprintf(stderr, "%s: --policies: %s\n", cmd, kvt_errmsg());
            free(list);
            return APP_USAGE;
        }
        for (int i = 0; i < n_pol; i++)
            if (ps[i].policy == p) {
                fprintf(stderr, "%s: --policies names '%s' twice\n", cmd, t);
                free(list);
                return APP_USAGE;
            }
        ps[n_pol++].policy = p;
    }
    free(list);
    if (n_pol == 0) {
        fprintf(stderr, "%s: --policies is empty\n", cmd);
        return APP_USAGE;
    }
    if (!model || !*model) {
        fprintf(stderr, "%s: no model given (use -m MODEL or set KVTIER_MODEL)\n", cmd);
        return APP_USAGE;
    }
    struct eval_corpus corpus;
    if ((rc = eval_corpus_load(cmd, texts, &corpus))) return rc;
    /* no_eviction holds the whole conversation */
    int32_t n_ctx = turns * (turn_tokens + gen + 32) + 256;
    if (n_ctx < budget + 256) n_ctx = budget + 256;
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
    kvt_pool *pool = NULL;
    char **conv = NULL;
    if ((rc = kvt_engine_open(&ep, &eng))) {
        fprintf(stderr, "%s: %s\n", cmd, *kvt_errmsg() ? kvt_errmsg() : kvt_strerror(rc));
        eval_corpus_free(&corpus);
        return rc == KVT_EINVAL ? APP_USAGE : APP_ERR;
    }
    if ((rc = kvt_pool_open(NULL, &pool)) || (rc = make_turns(cmd, eng, &corpus, turns, turn_tokens, &conv))) {
        if (!pool) app_fail(cmd, "cannot open the host pool", rc);
        kvt_pool_free(pool);
        kvt_engine_free(eng);
        eval_corpus_free(&corpus);
        return APP_ERR;
    }
    struct kvt_engine_info info;
    kvt_engine_info(eng, &info);
    int n_threads = threads > 0 ? threads : (int) sysconf(_SC_NPROCESSORS_ONLN);
    struct eval_stamp st;
    eval_stamp_fill(&st, &info, model, n_threads);
    fprintf(stderr, "%s: %s | %d policies x %d rounds | %d turns of %d tokens + %d generated | budget %d | ctx %d\n", cmd,
            info.desc, n_pol, rounds, turns, turn_tokens, gen, budget, n_ctx);
    int errors = 0;
    for (int32_t r = 0; r < rounds; r++)
        for (int i = 0; i < n_pol; i++) {
            int j = (i + r) % n_pol; /* rotate the order each round */
            double t0 = (double) clock() / CLOCKS_PER_SEC;
            errors += run_one(cmd, eng, pool, &ps[j], budget, n_ctx, conv, turns, gen) != 0;
            fprintf(stderr, "[bench policy] round %d/%d %-11s policy %.3f ms/step, decode %.2f ms/step (%.1f s CPU)\n", r + 1,
                    rounds, kvt_policy_name(ps[j].policy), per(ps[j].dec_policy_ms, ps[j].steps),
                    per(ps[j].dec_decode_ms, ps[j].steps), (double) clock() / CLOCKS_PER_SEC - t0);
        }
    double ref_step = NAN;
    for (int i = 0; i < n_pol; i++)
        if (ps[i].policy == KVT_POLICY_STREAMING) ref_step = per(ps[i].dec_decode_ms, ps[i].steps);
    struct kvt_engine_info ei;
    kvt_engine_info(eng, &ei);
    printf("# kvtier bench policy | %s | %s | kvtier commit %s | %s | %s | %d threads | device %s, %d/%d layers | flash attn %s"
           " | budget %d | %d turns x (%d + %d) tokens | %d rounds\n",
           st.model, st.llama, st.commit, st.date, st.machine, n_threads, ei.device, ei.n_layer_device, ei.n_layer,
           ei.flash_attn ? "on" : "off", budget, turns, turn_tokens, gen, rounds);
    printf("%-12s %7s %12s %13s %10s %12s %13s %10s %10s %7s %7s\n", "policy", "steps", "decode_ms/st", "policy_ms/st", "overhead",
           "decode_vs_st", "prefill_ms/t", "pf_policy", "overhead", "evict", "recov");
    json_t *arr = json_array();
    for (int i = 0; i < n_pol; i++) {
        const struct pol_sum *p = &ps[i];
        double d = per(p->dec_decode_ms, p->steps), q = per(p->dec_policy_ms, p->steps);
        double pd = per(p->pre_decode_ms, p->prefill_tokens), pq = per(p->pre_policy_ms, p->prefill_tokens);
        printf("%-12s %7lld %12.3f %13.4f %9.2f%% %12.3f %13.3f %10.4f %9.2f%% %7lld %7lld\n", kvt_policy_name(p->policy),
               (long long) p->steps, d, q, 100 * q / d, d / ref_step, pd, pq, 100 * pq / pd, (long long) p->evictions,
               (long long) p->recoveries);
        json_array_append_new(arr,
                              json_pack("{s:s, s:I, s:f, s:f, s:f, s:f, s:I, s:f, s:f, s:f, s:I, s:I, s:i, s:i}", "policy",
                                        kvt_policy_name(p->policy), "decode_steps", (json_int_t) p->steps, "decode_ms_per_step", d,
                                        "policy_ms_per_step", q, "policy_overhead_decode", q / d, "decode_ms_per_step_vs_streaming",
                                        isnan(ref_step) ? 0.0 : d / ref_step, "prefill_tokens", (json_int_t) p->prefill_tokens,
                                        "prefill_ms_per_token", pd, "policy_ms_per_prefill_token", pq, "policy_overhead_prefill",
                                        pq / pd, "evictions", (json_int_t) p->evictions, "recoveries", (json_int_t) p->recoveries,
                                        "peak_resident_tokens", p->peak, "errors", p->errors));
    }
    if (json) {
        json_t *j = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:b, s:i, s:i, s:i, s:i, s:i, s:i, s:o}", "benchmark", "policy",
                              "model", st.model, "llama_cpp", st.llama, "commit", st.commit, "date", st.date, "device", ei.device,
                              "flash_attn", ei.flash_attn, "threads", n_threads, "budget", budget, "turns", turns, "turn_tokens",
                              turn_tokens, "gen", gen, "rounds", rounds, "policies", arr);
        char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
        if (s) printf("%s\n", s);
        free(s);
        json_decref(j);
    } else {
        json_decref(arr);
    }
    for (int32_t i = 0; i < turns; i++) free(conv[i]);
    free(conv);
    kvt_pool_free(pool);
    kvt_engine_free(eng);
    eval_corpus_free(&corpus);
    return errors ? APP_ERR : APP_OK;
}
