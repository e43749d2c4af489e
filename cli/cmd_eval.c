/* cmd_eval.c — `kvtier eval niah|multifact|ppl`: eviction policies side by side on the same
** seeded cases, one engine, cases outer and policies inner.
**
**   niah       needle in a haystack: one seeded "The secret code of <name> is <number>." in a
**              haystack of essay sentences at a depth from --depths, given as document turns;
**              then the question.
**   multifact  one fact per depth (default five, at 10/30/50/70/90 %), probed one after another.
**   ppl        held-out essay text as user turns; the next segment is teacher-forced after each
**              turn: perplexity, top-1 accuracy and KL from no_eviction's distribution.
**
** The case building is in eval_data.c, one case under one policy in eval_run.c, the summary
** and the output files in eval_report.c.  Progress goes to stderr; the table to stdout, and
** with --json one summary object as the last stdout line.  Exit status: 0 ok, 1 runtime error
** (including a policy that failed on some case: the others still run and are reported), 2
** usage error. */
#include "cli.h"
#include "eval.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char DEFAULT_POLICIES[] = "no_eviction,truncate,streaming,h2o,snapkv,infllm,kvtier";

/* --codec "a,b,c": every policy that recovers evicted blocks (kvtier, infllm) runs once per codec,
** its session's host pool storing blocks through it (kvt_session_params.codec_ram); "raw" is
** always among them (first), the reference the others are compared with.  Labels "policy/codec".
** Usage error naming a bad spec (the library's parser says what is wrong with it). */
static int parse_codecs(const char *cmd, const char *s, struct eval_opts *o, char (*buf)[64]) {
    for (int i = 0; i < o->n_policies; i++) {
        snprintf(o->label[i], sizeof o->label[i], "%s", kvt_policy_name(o->policies[i]));
        o->codec[i] = NULL;
    }
    if (!s) return APP_OK;
    int n = 0;
    snprintf(buf[n++], 64, "raw");
    for (const char *p = s; *p;) {
        /* elements end at a comma before a codec name (a letter): "q4:32,64,q8" is q4:32,64 and q8 */
        size_t len = 0;
        while (p[len] && !(p[len] == ',' && (isalpha((unsigned char) p[len + 1]) || p[len + 1] == ',' || !p[len + 1]))) len++;
        if (len == 0 || len >= 64) {
            fprintf(stderr, "%s: --codec '%s' has an empty or overlong element\n", cmd, s);
            return APP_USAGE;
        }
        char spec[64];
        memcpy(spec, p, len);
        spec[len] = '\0';
        struct kvt_codec_params cp;
        if (kvt_codec_parse(spec, &cp)) {
            fprintf(stderr, "%s: --codec: %s\n", cmd, kvt_errmsg());
            return APP_USAGE;
        }
        bool dup = false;
        for (int k = 0; k < n; k++) dup |= !strcmp(buf[k], spec);
        if (!dup) {
            if (n >= EVAL_MAX_CODECS) {
                fprintf(stderr, "%s: --codec '%s' names more than %d codecs\n", cmd, s, EVAL_MAX_CODECS - 1);
                return APP_USAGE;
            }
            snprintf(buf[n++], 64, "%s", spec);
        }
        p += len + (p[len] == ',');
    }
    const int n_pol = o->n_policies;
    bool any = false;
    for (int i = 0; i < n_pol; i++) any |= o->policies[i] == KVT_POLICY_KVTIER || o->policies[i] == KVT_POLICY_INFLLM;
    if (!any) {
        fprintf(stderr,
                "%s: --codec applies to the policies that recover evicted blocks (kvtier, infllm); "
                "--policies lists neither\n",
                cmd);
        return APP_USAGE;
    }
    for (int i = 0; i < n_pol; i++) {
        if (o->policies[i] != KVT_POLICY_KVTIER && o->policies[i] != KVT_POLICY_INFLLM) continue;
        o->codec[i] = buf[0];
        snprintf(o->label[i], sizeof o->label[i], "%.16s/%.63s", kvt_policy_name(o->policies[i]), buf[0]);
        for (int k = 1; k < n; k++) {
            int j = o->n_policies++;
            o->policies[j] = o->policies[i];
            o->codec[j] = buf[k];
            snprintf(o->label[j], sizeof o->label[j], "%.16s/%.63s", kvt_policy_name(o->policies[i]), buf[k]);
        }
    }
    return APP_OK;
}

static void eval_usage(FILE *f, const char *task, const struct cli_opt *opts) {
    fprintf(f,
            "Usage: kvtier eval niah|multifact|ppl [-m MODEL] [options]\n"
            "       kvtier eval ruler TASK [--shape prompt|turns|followup] [-m MODEL] [options]\n"
            "\n"
            "Runs every policy of --policies on the same seeded cases (cases outer, policies inner,\n"
            "one engine) and reports, per policy: pass rate with its Wilson 95%% interval, the mean\n"
            "teacher-forced log-probability of the expected answer and of its number (nats), the\n"
            "differences to no_eviction on the same cases, evictions, recoveries, time to first\n"
            "token and peak resident tokens.\n"
            "\n"
            "  niah       one seeded needle (\"The secret code of <name> is <number>.\") in a haystack of\n"
            "             essay sentences at a depth from --depths (cases cycle through them), given as\n"
            "             document turns of about --chunk tokens, each answered by a replayed\n"
            "             \"" EVAL_REPLY "\"; then the question. Pass = the greedy reply contains the number.\n"
            "             Prefix pass = the number has probability > 1/2 after the teacher-forced answer\n"
            "             prefix (\"The secret code of <name> is\"), so it is that prefix's greedy\n"
            "             continuation: a retrieval check that does not need the model to follow the\n"
            "             question-answer format (base models often do not).\n"
            "  multifact  one fact per depth (default 10,30,50,70,90), probed one after another.\n"
            "  ppl        held-out essay text as user turns of --segment tokens; after each turn from\n"
            "             --skip on, the next segment's first --score-tokens tokens are teacher-forced:\n"
            "             perplexity, top-1 accuracy (the pass rate here), KL from no_eviction.\n"
            "  ruler      RULER's synthetic tasks (Hsieh et al. 2024): niah_single_1..3, niah_multikey_1..3,\n"
            "             niah_multivalue, niah_multiquery, vt, cwe, fwe, seeded; score = the fraction of\n"
            "             the reference strings the reply contains (RULER's string_match_all), with the\n"
            "             teacher-forced log-probability of the reference answer beside it.\n"
            "\n"
            "no_eviction runs with the whole context as its budget (the reference); the others with\n"
            "--budget. Writes <out>/<task>-<time>.json (summary + per-case rows), .csv (rows) and .png\n"
            "(gnuplot; skipped with a warning if gnuplot is missing; ruler: none, bench/ruler_tables.py\n"
            "plots a grid). Progress on stderr, the table on\n"
            "stdout; --json adds the summary object as the last stdout line.\n"
            "MODEL defaults to $KVTIER_MODEL. Texts: --texts, else $KVT_SOURCE_DIR/../shared/data/pg_essays.\n"
            "\n"
            "Options%s%s:\n",
            task ? " of " : "", task ? task : "");
    cli_print_opts(f, opts);
}

/* "a,b,c" of policy names -> o->policies; usage error naming the bad element (the library's
** message lists the known names) or a repeated one. */
static int parse_policies(const char *cmd, const char *s, struct eval_opts *o) {
    o->n_policies = 0;
    const char *p = s;
    for (;;) {
        size_t len = strcspn(p, ",");
        char name[64];
        if (len == 0 || len >= sizeof name) {
            fprintf(stderr, "%s: --policies '%s' has an empty or overlong element\n", cmd, s);
            return APP_USAGE;
        }
        memcpy(name, p, len);
        name[len] = '\0';
        int32_t pol;
        if (kvt_policy_from_name(name, &pol)) {
            fprintf(stderr, "%s: --policies: %s\n", cmd, kvt_errmsg());
            return APP_USAGE;
        }
        for (int i = 0; i < o->n_policies; i++)
            if (o->policies[i] == pol) {
                fprintf(stderr, "%s: --policies names '%s' twice\n", cmd, name);
                return APP_USAGE;
            }
        if (o->n_policies >= KVT_POLICY__COUNT) return APP_USAGE; /* unreachable: names are distinct */
        o->variant[o->n_policies] = EVAL_PLAIN;
        snprintf(o->label[o->n_policies], sizeof o->label[0], "%s", kvt_policy_name(pol));
        o->policies[o->n_policies++] = pol;
        if (!p[len]) return APP_OK;
        p += len + 1;
    }
}

static int parse_depths(const char *cmd, const char *s, struct eval_opts *o) {
    o->n_depths = 0;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || errno == ERANGE || v < 0 || v > 100) {
            fprintf(stderr, "%s: --depths element '%.*s' is not a percentage in 0..100 (in '%s')\n", cmd, (int) strcspn(p, ","), p,
                    s);
            return APP_USAGE;
        }
        if (o->n_depths >= EVAL_MAX_DEPTHS) {
            fprintf(stderr, "%s: --depths lists more than %d depths\n", cmd, EVAL_MAX_DEPTHS);
            return APP_USAGE;
        }
        o->depths[o->n_depths++] = (int32_t) v;
        if (!*end) return APP_OK;
        p = end + 1;
    }
}

/* ruler: positions a case needs after its input (tokens): each query, the reply, the reference
** answer scored, and a margin. */
static int32_t ruler_reserve(const struct eval_opts *o) {
    return (o->shape == EVAL_SHAPE_FOLLOWUP ? EVAL_FOLLOWUPS : 1) * (192 + o->max_tokens) + 64;
}

/* Engine cells: the conversation up to the first question, plus questions, answers being
** scored and replies, over the high watermark, rounded up to 256.  no_eviction gets all of it
** as its budget, so it never has to evict. */
static int32_t engine_ctx(const struct eval_opts *o) {
    int32_t extra;
    switch (o->task) {
        case EVAL_RULER: extra = ruler_reserve(o); break;
        case EVAL_NIAH: extra = 128 + o->max_tokens + 64; break;
        case EVAL_MULTIFACT: extra = o->n_depths * (96 + o->max_tokens) + 64; break;
        default: extra = o->score_tokens + 64; break;
    }
    int32_t n = (int32_t) ceil((o->context + extra) / 0.95) + 64;
    return (n + 255) / 256 * 256;
}

int cmd_eval(int argc, char **argv) {
    char cmd[64] = "kvtier eval";
    struct eval_opts o;
    const char *ngl = NULL, *fa = NULL;
    bool no_op_offload = false; /* -ngl, -fa (cli_device_opts) */
    memset(&o, 0, sizeof o);
    const char *policies_s = DEFAULT_POLICIES, *depths_s = NULL, *codec_s = NULL;
    char codec_buf[EVAL_MAX_CODECS][64];
    double min_cosine = 0.5;
    const char *elastic_s = NULL;
    bool elastic_random = false;
    bool depths_seen = false, segment_seen = false, chunk_seen = false, ppl_seen = false, fresh_engine = false, cases_only = false;
    bool single_prompt = false, max_tokens_seen = false, first_seen = false;
    const char *shape_s = NULL;
    bool by_store = false;
    o.model = getenv("KVTIER_MODEL");
    o.out = "results";
    o.budget = 1024;
    o.context = 4096;
    o.cases = 10;
    o.seed = 1;
    o.max_tokens = 24;
    o.block = 64;
    o.segment = 256;
    o.score_tokens = 64;
    o.skip = 2;
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        { "model", 'm', OPT_STR, &o.model, 0, 0, "MODEL", "GGUF model file (default $KVTIER_MODEL)", NULL },
        { "policies", 0, OPT_STR, &policies_s, 0, 0, "LIST",
          "policies to compare (default no_eviction,truncate,streaming,h2o,snapkv,infllm,kvtier)", NULL },
        { "budget", 0, OPT_INT, &o.budget, 2, 1 << 24, "N", "resident-token budget of the evicting policies (default 1024)", NULL },
        { "context", 0, OPT_INT, &o.context, 64, 1 << 22, "N",
          "conversation length in tokens up to the first question (default 4096; ruler: less the replies' reserve "
          "where the model's trained context must also hold them)",
          NULL },
        { "cases", 0, OPT_INT, &o.cases, 1, 100000, "N", "cases per policy (default 10)", NULL },
        { "seed", 0, OPT_INT, &o.seed, 0, 2147483647, "S", "seed of the texts, names and numbers (default 1)", NULL },
        { "depths", 0, OPT_STR, &depths_s, 0, 0, "LIST",
          "needle depths in % (niah default 5,25,50,75,95; multifact: one fact each, default 10,30,50,70,90)", &depths_seen },
        { "json", 0, OPT_FLAG, &o.json, 0, 0, NULL, "print the summary as one JSON object on the last stdout line", NULL },
        { "out", 0, OPT_STR, &o.out, 0, 0, "DIR", "directory for the .json/.csv/.png files (default results)", NULL },
        { "threads", 't', OPT_INT, &o.threads, 0, 1024, "N", "CPU threads (default 0 = all cores)", NULL },
        CLI_DEVICE_OPT_ROWS(&ngl, &fa, &no_op_offload),
        { "max-tokens", 0, OPT_INT, &o.max_tokens, 1, 4096, "N", "reply length limit in tokens (default 24; ruler 64, cwe 128)",
          &max_tokens_seen },
        { "block", 0, OPT_INT, &o.block, 1, 4096, "N", "tokens per KV block (default 64)", NULL },
        { "chunk", 0, OPT_INT, &o.chunk, 32, 1 << 20, "N",
          "tokens per document turn, template included (default: half the budget in whole blocks, at most 512)", &chunk_seen },
        { "segment", 0, OPT_INT, &o.segment, 16, 1 << 20, "N",
          "ppl: text tokens per user turn (default 256, at most the --chunk default)", &segment_seen },
        { "score-tokens", 0, OPT_INT, &o.score_tokens, 1, 1024, "N",
          "ppl: tokens of the next segment scored after each turn (default 64)", &ppl_seen },
        { "skip", 0, OPT_INT, &o.skip, 0, 1 << 20, "N", "ppl: turns fed before the first scored one (default 2)", &ppl_seen },
        { "single-prompt", 0, OPT_FLAG, &single_prompt, 0, 0, NULL,
          "niah: the whole document and the question in ONE user message longer than the budget (what a user "
          "pasting a document sends), instead of document turns; results are recorded as task niah-single",
          NULL },
        { "shape", 0, OPT_STR, &shape_s, 0, 0, "SHAPE",
          "ruler: prompt (context and query in one message, default), turns (the context as document turns, then the "
          "query) or followup (context and query 1 in one message, then 4 more queries as follow-up turns)",
          NULL },
        { "store", 0, OPT_FLAG, &by_store, 0, 0, NULL,
          "ruler --shape followup: also run kvtier+store, every query a request of its own (a fresh session) that "
          "finds the context in a RAM block store the first query filled",
          NULL },
        { "first-case", 0, OPT_INT, &o.first_case, 1, 1000000, "N",
          "number of the first case (default 1): cases N .. N+cases-1, the same cases a longer run has there", &first_seen },
        { "texts", 0, OPT_STR, &o.texts, 0, 0, "DIR", "essay directory (default ../shared/data/pg_essays)", NULL },
        { "cases-only", 0, OPT_FLAG, &cases_only, 0, 0, NULL,
          "build the cases and write them (the .json's cases_detail: each case's messages and references) without "
          "running a policy: the text a run with the same options is given (bench/ruler_grid.py's llama-server pass "
          "takes an archived unit's text from it)",
          NULL },
        { "fresh-engine", 0, OPT_FLAG, &fresh_engine, 0, 0, NULL,
          "load the model again for every session, so no session runs on a KV cache earlier sessions "
          "have used (about 0.7 s per session for Gemma 3 270M)",
          NULL },
        { "embed-model", 0, OPT_STR, &o.embed_model, 0, 0, "GGUF",
          "kvtier recovers by cosine of mean-pooled embeddings from this model instead of BM25", NULL },
        { "min-cosine", 0, OPT_FLOAT, &min_cosine, -1, 1, "F",
          "with --embed-model: cosine an evicted block needs to come back (default 0.5)", NULL },
        { "codec", 0, OPT_STR, &codec_s, 0, 0, "LIST",
          "host pool codecs (raw, q8, q4, ecq, elastic, elastic+q8, elastic+q4, with arguments): kvtier and infllm run once per "
          "codec, every recovered block decoded from it, beside raw; reports bytes per token stored",
          NULL },
        { "elastic", 0, OPT_STR, &elastic_s, 0, 0, "S_K,S_V",
          "also run every policy with live ElasticKV at these threshold scales (rows <policy>+elastic; "
          "no_eviction's plain run stays the reference), e.g. 0.45,0.50; several pairs: 0.35,0.17/0.45,0.50",
          NULL },
        { "elastic-random", 0, OPT_FLAG, &elastic_random, 0, 0, NULL,
          "with --elastic: also run the matched-random control (rows <policy>+random: every pass holds each head's "
          "thresholded range at the zero fraction its +elastic twin ended the case with, zeros placed uniformly at "
          "random)",
          NULL },
        { "verbose", 'v', OPT_FLAG, &o.verbose, 0, 0, NULL, "llama.cpp's log on stderr", NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */

    /* the task comes first: kvtier eval TASK [options] */
    if (argc < 1 || argv[0][0] == '-') {
        if (argc >= 1 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h"))) {
            eval_usage(stdout, NULL, opts);
            return APP_OK;
        }
        fprintf(stderr, "%s: which task? (niah, multifact, ppl or ruler)\nTry 'kvtier eval --help'.\n", cmd);
        return APP_USAGE;
    }
    o.task_name = argv[0];
    if (!strcmp(o.task_name, "niah")) o.task = EVAL_NIAH;
    else if (!strcmp(o.task_name, "multifact")) o.task = EVAL_MULTIFACT;
    else if (!strcmp(o.task_name, "ppl")) o.task = EVAL_PPL;
    else if (!strcmp(o.task_name, "ruler")) o.task = EVAL_RULER;
    else {
        fprintf(stderr, "%s: unknown task '%s' (known: niah, multifact, ppl, ruler)\nTry 'kvtier eval --help'.\n", cmd,
                o.task_name);
        return APP_USAGE;
    }
    snprintf(cmd, sizeof cmd, "kvtier eval %s", o.task_name);
    int n_pos;
    char *pos[2];
    int rc = cli_parse(cmd, opts, argc - 1, argv + 1, pos, 2, &n_pos);
    if (rc < 0) {
        eval_usage(stdout, o.task_name, opts);
        return APP_OK;
    }
    if (rc) return rc;
    static char ruler_name[96];
    if (o.task == EVAL_RULER) { /* kvtier eval ruler RULER_TASK [--shape S] */
        if (n_pos != 1) {
            fprintf(stderr, "%s: which RULER task? one of:", cmd);
            for (int32_t i = 0; i < eval_ruler_n_tasks; i++) fprintf(stderr, " %s", eval_ruler_tasks[i].name);
            fprintf(stderr, "\n");
            return APP_USAGE;
        }
        if ((o.ruler = eval_ruler_find(pos[0])) < 0) {
            fprintf(stderr, "%s: unknown RULER task '%s' (known:", cmd, pos[0]);
            for (int32_t i = 0; i < eval_ruler_n_tasks; i++) fprintf(stderr, " %s", eval_ruler_tasks[i].name);
            fprintf(stderr, ")\n");
            return APP_USAGE;
        }
        o.shape = EVAL_SHAPE_PROMPT;
        if (shape_s && !strcmp(shape_s, "turns")) o.shape = EVAL_SHAPE_TURNS;
        else if (shape_s && !strcmp(shape_s, "followup")) o.shape = EVAL_SHAPE_FOLLOWUP;
        else if (shape_s && strcmp(shape_s, "prompt")) {
            fprintf(stderr, "%s: --shape '%s' is not one of prompt, turns, followup\n", cmd, shape_s);
            return APP_USAGE;
        }
        if (o.shape == EVAL_SHAPE_FOLLOWUP && !eval_ruler_has_followups(o.ruler)) {
            fprintf(stderr,
                    "%s: --shape followup needs distinct queries about one context; %s has a single question "
                    "(use it with niah_* and vt)\n",
                    cmd, pos[0]);
            return APP_USAGE;
        }
        if (chunk_seen && o.shape != EVAL_SHAPE_TURNS) {
            fprintf(stderr, "%s: --chunk applies to --shape turns only\n", cmd);
            return APP_USAGE;
        }
        if (!max_tokens_seen) o.max_tokens = !strcmp(pos[0], "cwe") ? 128 : 64;
        snprintf(ruler_name, sizeof ruler_name, "ruler-%s-%s", pos[0],
                 o.shape == EVAL_SHAPE_TURNS      ? "turns"
                 : o.shape == EVAL_SHAPE_FOLLOWUP ? "followup"
                                                  : "prompt");
        o.task_name = ruler_name;
    } else if (n_pos > 0) {
        fprintf(stderr, "%s: unexpected argument '%s'\n", cmd, pos[0]);
        return APP_USAGE;
    } else if (shape_s) {
        fprintf(stderr, "%s: --shape applies to ruler only\n", cmd);
        return APP_USAGE;
    }
    if (first_seen) o.first_case -= 1; /* 0-based inside */

    /* ---- validation that needs no model ---- */
    if (single_prompt && o.task != EVAL_NIAH) {
        fprintf(stderr, "%s: --single-prompt applies to niah only%s\n", cmd,
                o.task == EVAL_RULER ? " (ruler: --shape prompt, the default)" : "");
        return APP_USAGE;
    }
    if (single_prompt && chunk_seen) {
        fprintf(stderr, "%s: --chunk does not apply with --single-prompt (the document is one message)\n", cmd);
        return APP_USAGE;
    }
    if (single_prompt) {
        o.single_prompt = true;
        o.task_name = "niah-single";
    }
    if ((rc = parse_policies(cmd, policies_s, &o))) return rc;
    if ((rc = parse_codecs(cmd, codec_s, &o, codec_buf))) return rc;
    if (by_store) {
        if (o.task != EVAL_RULER || o.shape != EVAL_SHAPE_FOLLOWUP) {
            fprintf(stderr, "%s: --store applies to ruler --shape followup only\n", cmd);
            return APP_USAGE;
        }
        const int r = o.n_policies++;
        o.policies[r] = KVT_POLICY_KVTIER;
        o.codec[r] = NULL;
        o.variant[r] = EVAL_STORE;
        snprintf(o.label[r], sizeof o.label[r], "kvtier+store");
    }
    if (elastic_random && !elastic_s) {
        fprintf(stderr, "%s: --elastic-random needs --elastic S_K,S_V (the scales whose zero counts it matches)\n", cmd);
        return APP_USAGE;
    }
    static double el_frac[EVAL_MAX_RUNS];
    o.el_frac = el_frac;
    if (elastic_s) { /* PAIR[/PAIR...]: runs per pair, elastic ones first, each random after its twin */
        float sk[EVAL_MAX_PAIRS], sv[EVAL_MAX_PAIRS];
        int n_pairs = 0;
        for (const char *p = elastic_s;;) {
            size_t len = strcspn(p, "/");
            char one[64];
            if (n_pairs == EVAL_MAX_PAIRS || len >= sizeof one) {
                fprintf(stderr, "%s: --elastic '%s' lists more than %d scale pairs\n", cmd, elastic_s, EVAL_MAX_PAIRS);
                return APP_USAGE;
            }
            memcpy(one, p, len);
            one[len] = '\0';
            if ((rc = cli_parse_elastic(cmd, "--elastic", one, &sk[n_pairs], &sv[n_pairs]))) return rc;
            n_pairs++;
            if (!p[len]) break;
            p += len + 1;
        }
        const int n_base = o.n_policies;
        for (int v = EVAL_ELASTIC; v <= (elastic_random ? EVAL_ELASTIC_RANDOM : EVAL_ELASTIC); v++)
            for (int k = 0; k < n_pairs; k++)
                for (int i = 0; i < n_base; i++) {
                    const int r = o.n_policies++;
                    o.policies[r] = o.policies[i];
                    o.codec[r] = o.codec[i];
                    o.variant[r] = (int8_t) v;
                    o.el_sk[r] = sk[k];
                    o.el_sv[r] = sv[k];
                    o.el_twin[r] = v == EVAL_ELASTIC_RANDOM ? n_base * (1 + k) + i : -1;
                    const char *what = v == EVAL_ELASTIC ? "elastic" : "random";
                    char base[64]; /* the plain run's label ("kvtier", "kvtier/q4"): a copy, since
                                   ** o.label[r] and o.label[i] live in the same object */
                    snprintf(base, sizeof base, "%.63s", o.label[i]);
                    if (n_pairs == 1) snprintf(o.label[r], sizeof o.label[0], "%s+%s", base, what);
                    else snprintf(o.label[r], sizeof o.label[0], "%s+%s:%.2f,%.2f", base, what, sk[k], sv[k]);
                }
    }
    if ((o.task == EVAL_PPL || o.task == EVAL_RULER) && depths_seen) {
        fprintf(stderr, "%s: --depths does not apply to %s\n", cmd,
                o.task == EVAL_PPL ? "ppl" : "ruler (RULER places needles at random depths)");
        return APP_USAGE;
    }
    if (o.task != EVAL_PPL && (segment_seen || ppl_seen)) {
        fprintf(stderr, "%s: --segment, --score-tokens and --skip apply to ppl only\n", cmd);
        return APP_USAGE;
    }
    if (!depths_s) depths_s = o.task == EVAL_MULTIFACT ? "10,30,50,70,90" : "5,25,50,75,95";
    if (o.task != EVAL_RULER && (rc = parse_depths(cmd, depths_s, &o))) return rc;
    if (o.budget > o.context) {
        fprintf(stderr,
                "%s: --budget %d is larger than --context %d: nothing would ever be evicted (no_eviction is "
                "the reference for that)\n",
                cmd, o.budget, o.context);
        return APP_USAGE;
    }
    if (o.budget < 2 * o.block) {
        fprintf(stderr, "%s: --budget %d is smaller than two blocks of %d tokens\n", cmd, o.budget, o.block);
        return APP_USAGE;
    }
    if (!chunk_seen) {
        int32_t half = o.budget / 2 / o.block * o.block;
        o.chunk = half < 512 ? half : 512;
        if (o.chunk < 32) o.chunk = 32;
    }
    /* a document turn plus the reply reserve (64) must fit under the high watermark */
    if (o.chunk + 64 > (int32_t) (0.95 * o.budget)) {
        fprintf(stderr,
                "%s: --chunk %d plus 64 reply tokens does not fit under 95%% of --budget %d (use a smaller "
                "--chunk)\n",
                cmd, o.chunk, o.budget);
        return APP_USAGE;
    }
    if (o.chunk > o.context / 2 && (o.task != EVAL_RULER || o.shape == EVAL_SHAPE_TURNS)) {
        fprintf(stderr, "%s: --chunk %d is more than half of --context %d; the document would be one turn\n", cmd, o.chunk,
                o.context);
        return APP_USAGE;
    }
    if (o.task == EVAL_PPL) {
        if (!segment_seen && o.segment > o.chunk) o.segment = o.chunk;
        if (o.segment + 64 > (int32_t) (0.95 * o.budget)) {
            fprintf(stderr, "%s: --segment %d plus 64 reply tokens does not fit under 95%% of --budget %d\n", cmd, o.segment,
                    o.budget);
            return APP_USAGE;
        }
        if (o.skip >= o.context / o.segment) {
            fprintf(stderr, "%s: --skip %d leaves no scored turn: --context %d holds about %d segments of %d tokens\n", cmd, o.skip,
                    o.context, o.context / o.segment, o.segment);
            return APP_USAGE;
        }
    }
    if (!o.model || !*o.model) {
        fprintf(stderr, "%s: no model given (use -m MODEL or set KVTIER_MODEL)\n", cmd);
        return APP_USAGE;
    }
    struct eval_corpus corpus;
    if ((rc = eval_corpus_load(cmd, o.texts, &corpus))) return rc;
    if (o.task == EVAL_RULER && eval_corpus_words(&corpus)) {
        fprintf(stderr, "%s: '%s' has too few distinct words for RULER's keys (or out of memory)\n", cmd, corpus.dir);
        eval_corpus_free(&corpus);
        return APP_USAGE;
    }
    if (o.task == EVAL_PPL ? corpus.n_held_out == 0 : corpus.n - corpus.n_held_out == 0) {
        fprintf(stderr, "%s: '%s' has no %s essays\n", cmd, corpus.dir, o.task == EVAL_PPL ? "held-out" : "haystack");
        eval_corpus_free(&corpus);
        return APP_USAGE;
    }

    /* ---- engine ---- */
    o.n_ctx = engine_ctx(&o);
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = o.model;
    ep.n_ctx = o.n_ctx;
    ep.n_seq = 1;
    ep.n_threads = o.threads;
    ep.verbose = o.verbose;
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
    struct kvt_engine_info info;
    kvt_engine_info(eng, &info);
    /* RULER sizes a case so that its input and the tokens to generate fit the length; at the
    ** length of the model's trained context (SmolLM2 at 8192) an input of --context tokens would
    ** leave no position for the reply, so the input gives up the queries' and replies' reserve */
    o.fill = o.context;
    if (o.task == EVAL_RULER && info.n_ctx_train > 0 && o.context + ruler_reserve(&o) > info.n_ctx_train) {
        o.fill = info.n_ctx_train - ruler_reserve(&o);
        if (o.fill < o.context / 2 || o.fill < 64) {
            if (o.fill >= 64)
                fprintf(stderr,
                        "%s: --context %d is beyond the model's trained context (%d positions) with %d tokens of "
                        "queries and replies; use --context %d or less\n",
                        cmd, o.context, info.n_ctx_train, ruler_reserve(&o), o.fill);
            else
                fprintf(stderr,
                        "%s: --context %d is beyond the model's trained context (%d positions) with %d tokens of "
                        "queries and replies; lower --max-tokens or use a model of a longer context\n",
                        cmd, o.context, info.n_ctx_train, ruler_reserve(&o));
            kvt_engine_free(eng);
            eval_corpus_free(&corpus);
            return APP_USAGE;
        }
        /* the checks against --context above, again against the input */
        const char *why = o.budget > o.fill ? "--budget" : o.shape == EVAL_SHAPE_TURNS && o.chunk > o.fill / 2 ? "--chunk" : NULL;
        if (why) {
            fprintf(stderr,
                    "%s: %s %d is too large for an input of %d tokens (the model's trained context, %d positions, "
                    "also holds %d tokens of queries and replies): %s\n",
                    cmd, why, why[2] == 'b' ? o.budget : o.chunk, o.fill, info.n_ctx_train, ruler_reserve(&o),
                    why[2] == 'b' ? "nothing would ever be evicted" : "the document would be one turn");
            kvt_engine_free(eng);
            eval_corpus_free(&corpus);
            return APP_USAGE;
        }
        fprintf(stderr,
                "%s: the input is %d tokens, not --context %d: the model's trained context (%d positions) must "
                "also hold %d tokens of queries and replies (RULER sizes input plus generation within the "
                "length)\n",
                cmd, o.fill, o.context, info.n_ctx_train, ruler_reserve(&o));
    }
    kvt_pool *pool = NULL;
    if ((rc = kvt_pool_open(NULL, &pool))) {
        app_fail(cmd, "cannot open the host pool", rc);
        kvt_engine_free(eng);
        eval_corpus_free(&corpus);
        return APP_ERR;
    }
    o.min_cosine = (float) min_cosine;
    if (o.embed_model && (rc = kvt_embedder_open(o.embed_model, o.block, o.threads, &o.embedder))) {
        fprintf(stderr, "%s: --embed-model: %s\n", cmd, *kvt_errmsg() ? kvt_errmsg() : kvt_strerror(rc));
        kvt_pool_free(pool);
        kvt_engine_free(eng);
        eval_corpus_free(&corpus);
        return APP_ERR;
    }
    /* the template's framing must leave room for text in every turn */
    int32_t framing = eval_framing_tokens(eng, true);
    int32_t room = o.task == EVAL_PPL                                    ? o.segment
                   : o.task == EVAL_RULER && o.shape != EVAL_SHAPE_TURNS ? 1 << 20 /* one message: no turns to fill */
                                                                         : o.chunk - framing - (o.task == EVAL_RULER ? 96 : 0);
    if (framing < 0 || room < 32) {
        if (framing < 0) app_fail(cmd, "formatting a document turn with the chat template", KVT_EINVAL);
        else
            fprintf(stderr,
                    "%s: --chunk %d leaves %d tokens of text per turn after the %d tokens of chat template and "
                    "part header of this model; raise --chunk (and --budget)\n",
                    cmd, o.chunk, room, framing);
        kvt_pool_free(pool);
        kvt_embedder_free(o.embedder);
        kvt_engine_free(eng);
        eval_corpus_free(&corpus);
        return framing < 0 ? APP_ERR : APP_USAGE;
    }
    int n_threads = o.threads > 0 ? o.threads : (int) sysconf(_SC_NPROCESSORS_ONLN);
    struct eval_stamp stamp;
    eval_stamp_fill(&stamp, &info, o.model, n_threads);
    fprintf(stderr,
            "%s: %s | %d policies | context %d | budget %d (no_eviction %d) | chunk %d | %d cases | seed %d | "
            "texts %s\n",
            cmd, info.desc, o.n_policies, o.context, o.budget, o.n_ctx, o.task == EVAL_PPL ? o.segment : o.chunk, o.cases, o.seed,
            corpus.dir);

    /* no_eviction runs first in every case: ppl compares the others with its distributions */
    int32_t order[EVAL_MAX_RUNS], n_order = 0;
    struct eval_results res;
    memset(&res, 0, sizeof res);
    res.ref_pi = -1;
    for (int i = 0; i < o.n_policies; i++)
        if (o.policies[i] == KVT_POLICY_NO_EVICTION && o.variant[i] == EVAL_PLAIN) {
            order[n_order++] = i;
            res.ref_pi = i;
        }
    for (int i = 0; i < o.n_policies; i++)
        if (o.policies[i] != KVT_POLICY_NO_EVICTION || o.variant[i] != EVAL_PLAIN) order[n_order++] = i;
    o.cases_only = cases_only;
    if (cases_only) n_order = 0; /* the cases are built and reported, no policy runs */

    struct eval_case *cases = calloc((size_t) o.cases, sizeof *cases);
    struct eval_ref ref;
    memset(&ref, 0, sizeof ref);
    int32_t n_cases = 0, n_errors = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    rc = cases ? APP_OK : APP_ERR;
    for (int32_t c = 0; c < o.cases && rc == APP_OK; c++) {
        if ((rc = eval_case_build(cmd, eng, &corpus, &o, o.first_case + c, &cases[c]))) break;
        n_cases++;
        eval_ref_free(&ref);
        for (int32_t j = 0; j < n_order && rc == APP_OK; j++) {
            /* building a case only tokenizes, so any engine of the model will do for it */
            if (fresh_engine && (c > 0 || j > 0)) {
                kvt_engine_free(eng);
                int orc = kvt_engine_open(&ep, &eng);
                if (orc) {
                    eng = NULL;
                    app_fail(cmd, "reopening the model (--fresh-engine)", orc);
                    rc = APP_ERR;
                    break;
                }
            }
            if (eval_run_case(cmd, eng, pool, &o, order[j], &cases[c], o.task == EVAL_PPL ? &ref : NULL, &res)) n_errors++;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    eval_ref_free(&ref);
    if (rc == APP_OK) {
        double secs = (double) (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
        rc = eval_report(cmd, &o, &stamp, &res, cases, n_cases, secs);
    }
    if (rc == APP_OK && n_errors) {
        fprintf(stderr, "%s: %d session(s) failed (see above); their cases are left out of the rates\n", cmd, n_errors);
        rc = APP_ERR;
    }
    for (int32_t c = 0; c < n_cases; c++) eval_case_free(&cases[c]);
    free(cases);
    eval_results_free(&res);
    kvt_pool_free(pool);
    kvt_embedder_free(o.embedder);
    kvt_engine_free(eng);
    eval_corpus_free(&corpus);
    return rc;
}
