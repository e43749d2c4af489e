/* main.c — the command-line tool: dispatch, flag parser, and the session plumbing shared by
** `kvtier chat` and `kvtier demo` (one user turn, its status line, its JSON).
**
**   kvtier --version | version       kvtier's version and the llama.cpp it was built against
**   kvtier chat  -m MODEL [...]      a conversation under a token budget (cmd_chat.c)
**   kvtier demo  [-m MODEL] [...]    the planted-fact session (cmd_demo.c)
**   kvtier bench primitives [...]    block save / load / re-prefill timings (cmd_bench.c)
**   kvtier calibrate -m MODEL -o F   per-head attention entropy profile (cmd_calibrate.c)
**   kvtier eval niah|multifact|ppl   policies side by side against baselines (cmd_eval.c)
**   kvtier serve -m MODEL [...]      OpenAI-compatible stateful server (cmd_serve.c, serve_*.c)
**
** Exit codes: 0 success, 1 runtime error (model, context, I/O), 2 usage error.  Every error
** names the command and the offending value.  The tool uses only the public kvtier.h. */
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

volatile sig_atomic_t cli_sigint;

/* ---------------------------------------------------------------------------------------- */
/* flag parser                                                                              */

/* A long option by name; '_' in what was typed matches '-' (llama.cpp's tools take
** --backend_sampling for --backend-sampling, and scripts written for them do). */
static const struct cli_opt *find_long(const struct cli_opt *opts, const char *name, size_t len) {
    for (const struct cli_opt *o = opts; o->name; o++) {
        size_t k = 0;
        if (strlen(o->name) != len) continue;
        while (k < len && (o->name[k] == name[k] || (o->name[k] == '-' && name[k] == '_'))) k++;
        if (k == len) return o;
    }
    return NULL;
}

static const struct cli_opt *find_short(const struct cli_opt *opts, char c) {
    for (const struct cli_opt *o = opts; o->name; o++)
        if (o->short_name && o->short_name == c) return o;
    return NULL;
}

static int usage_hint(const char *cmd) {
    fprintf(stderr, "Try '%s --help'.\n", cmd);
    return APP_USAGE;
}

/* Store val into o->dst; `flag` is the spelling the user typed, for the message. */
static int set_value(const char *cmd, const struct cli_opt *o, const char *flag, const char *val) {
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
        case OPT_FLAG: *(bool *) o->dst = true; break;
        case OPT_STR: *(const char **) o->dst = val; break;
        case OPT_INT: {
            long long v = strtoll(val, &end, 10);
            if (end == val || *end || errno == ERANGE) {
                fprintf(stderr, "%s: %s '%s' is not an integer\n", cmd, flag, val);
                return usage_hint(cmd);
            }
            if ((double) v < o->min || (double) v > o->max) {
                fprintf(stderr, "%s: %s %lld is outside %.0f..%.0f\n", cmd, flag, v, o->min, o->max);
                return usage_hint(cmd);
            }
            *(int32_t *) o->dst = (int32_t) v;
            break;
        }
        case OPT_FLOAT: {
            double v = strtod(val, &end);
            if (end == val || *end || errno == ERANGE || !isfinite(v)) {
                fprintf(stderr, "%s: %s '%s' is not a number\n", cmd, flag, val);
                return usage_hint(cmd);
            }
            if (v < o->min || v > o->max) {
                fprintf(stderr, "%s: %s %g is outside %g..%g\n", cmd, flag, v, o->min, o->max);
                return usage_hint(cmd);
            }
            *(double *) o->dst = v;
            break;
        }
    }
    if (o->seen) *o->seen = true;
    return APP_OK;
}

/* llama.cpp's multi-letter one-dash flags, for the options kvtier shares with llama-server */
static const struct cli_opt *find_llama_spelling(const struct cli_opt *opts, const char *a) {
    static const char *const map[][2] = {
        { "-ngl", "n-gpu-layers" }, { "-fa", "flash-attn" }, { "-ub", "ubatch-size" }, { "-np", "parallel" }
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(a, map[i][0])) return find_long(opts, map[i][1], strlen(map[i][1]));
    return NULL;
}

int cli_device_opts(const char *cmd, const char *ngl, const char *fa, bool no_op_offload, struct kvt_engine_params *ep) {
    ep->no_op_offload = no_op_offload;
    if (ngl) {
        char *end;
        long v;
        errno = 0;
        if (!strcmp(ngl, "auto") || !strcmp(ngl, "all")) v = -1;
        else if ((v = strtol(ngl, &end, 10)), end == ngl || *end || errno || v < -1 || v > 100000) {
            fprintf(stderr, "%s: --n-gpu-layers '%s' is not a layer count (N >= 0, all or auto)\n", cmd, ngl);
            return APP_USAGE;
        }
        ep->n_gpu_layers = (int32_t) v;
    }
    if (fa) {
        if (!strcmp(fa, "on") || !strcmp(fa, "1") || !strcmp(fa, "true")) ep->flash_attn = KVT_FLASH_ATTN_ON;
        else if (!strcmp(fa, "off") || !strcmp(fa, "0") || !strcmp(fa, "false")) ep->flash_attn = KVT_FLASH_ATTN_OFF;
        else if (!strcmp(fa, "auto")) ep->flash_attn = KVT_FLASH_ATTN_AUTO;
        else {
            fprintf(stderr, "%s: --flash-attn '%s' is not on, off or auto\n", cmd, fa);
            return APP_USAGE;
        }
    }
    return APP_OK;
}

int cli_parse(const char *cmd, const struct cli_opt *opts, int argc, char **argv, char **pos, int max_pos, int *n_pos) {
    bool only_pos = false;
    *n_pos = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (only_pos || a[0] != '-' || a[1] == '\0') {
            if (*n_pos >= max_pos) {
                fprintf(stderr, "%s: unexpected argument '%s'\n", cmd, a);
                return usage_hint(cmd);
            }
            pos[(*n_pos)++] = argv[i];
            continue;
        }
        if (!strcmp(a, "--")) {
            only_pos = true;
            continue;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return -1;
        const struct cli_opt *o;
        const char *val = NULL;
        char flag[64];
        if (a[1] == '-') {
            const char *name = a + 2, *eq = strchr(name, '=');
            size_t len = eq ? (size_t) (eq - name) : strlen(name);
            if (!(o = find_long(opts, name, len))) {
                fprintf(stderr, "%s: unknown option '--%.*s'\n", cmd, (int) len, name);
                return usage_hint(cmd);
            }
            snprintf(flag, sizeof flag, "--%s", o->name);
            if (eq) val = eq + 1;
        } else if (a[2] != '\0' && (o = find_llama_spelling(opts, a))) {
            snprintf(flag, sizeof flag, "%s", a); /* llama.cpp's one-dash spellings: -ngl, -fa, -ub, -np */
        } else {
            if (a[2] != '\0' || !(o = find_short(opts, a[1]))) {
                fprintf(stderr, "%s: unknown option '%s'\n", cmd, a);
                return usage_hint(cmd);
            }
            snprintf(flag, sizeof flag, "-%c", o->short_name);
        }
        if (o->kind == OPT_FLAG) {
            if (val) {
                fprintf(stderr, "%s: option '%s' takes no value (got '%s')\n", cmd, flag, val);
                return usage_hint(cmd);
            }
        } else if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "%s: option '%s' needs a value (%s)\n", cmd, flag, o->metavar ? o->metavar : "VALUE");
                return usage_hint(cmd);
            }
            val = argv[++i];
        }
        int rc = set_value(cmd, o, flag, val);
        if (rc) return rc;
    }
    return APP_OK;
}

void cli_print_opts(FILE *f, const struct cli_opt *opts) {
    for (const struct cli_opt *o = opts; o->name; o++) {
        char left[64];
        if (o->short_name)
            snprintf(left, sizeof left, "-%c, --%s%s%s", o->short_name, o->name, o->metavar ? " " : "",
                     o->metavar ? o->metavar : "");
        else snprintf(left, sizeof left, "    --%s%s%s", o->name, o->metavar ? " " : "", o->metavar ? o->metavar : "");
        fprintf(f, "  %-24s %s\n", left, o->help);
    }
    fprintf(f, "  %-24s %s\n", "-h, --help", "this help");
}

/* ---------------------------------------------------------------------------------------- */
/* shared engine + session                                                                  */

void cli_run_opts_default(struct cli_run_opts *o) {
    memset(o, 0, sizeof *o);
    o->ctx = 4096;
    o->budget = 512;
    o->block = 64;
    o->top_k = 4;
    o->max_tokens = 64;
    o->pool_mb = 256;
    o->gen_reserve = -1;
    o->recovery = "kv_restore";
    o->policy = "kvtier";
}

static int parse_recovery(const char *s) {
    int32_t r;
    return kvt_recovery_from_name(s, &r) == 0 ? r : -1;
}

int cli_codec_bits_check(const char *cmd, const char *spec, const char *codec_disk, const char *codec_ram) {
    uint8_t *b;
    int32_t n;
    int rc = app_codec_bits(cmd, NULL, spec, &b, &n);
    if (rc) return rc;
    if (spec && strcmp(spec, "uniform") && !app_codec_takes_bits(codec_disk) && !app_codec_takes_bits(codec_ram)) {
        fprintf(stderr, "%s: --codec-bits '%s' sets the bits of q8/q4 tier codecs: give --codec-disk or --codec-ram q4 or q8\n",
                cmd, spec);
        return APP_USAGE;
    }
    return APP_OK;
}

int cli_run_opts_check(const char *cmd, const struct cli_run_opts *o) {
    int32_t pol;
    if (parse_recovery(o->recovery) < 0) {
        fprintf(stderr, "%s: --recovery '%s' is not one of kv_restore, discard, breadcrumb\n", cmd, o->recovery);
        return usage_hint(cmd);
    }
    if (kvt_policy_from_name(o->policy, &pol) != 0) {
        fprintf(stderr, "%s: --policy: %s\n", cmd, kvt_errmsg());
        return usage_hint(cmd);
    }
    struct kvt_codec_params cparse;
    if (o->codec_ram && kvt_codec_parse(o->codec_ram, &cparse)) {
        fprintf(stderr, "%s: --codec-ram: %s\n", cmd, kvt_errmsg());
        return usage_hint(cmd);
    }
    if (cli_codec_bits_check(cmd, o->codec_bits, o->no_store ? NULL : o->codec_disk, o->codec_ram)) return usage_hint(cmd);
    int32_t ck_tok;
    double ck_pct;
    if (o->chunk_recompute && kvt_chunk_recompute_parse(o->chunk_recompute, &ck_tok, &ck_pct)) {
        fprintf(stderr, "%s: --chunk-recompute: %s\n", cmd, kvt_errmsg());
        return usage_hint(cmd);
    }
    if (o->chunk_recompute && !o->chunk_reuse) {
        fprintf(stderr, "%s: --chunk-recompute '%s' needs --chunk-reuse\n", cmd, o->chunk_recompute);
        return usage_hint(cmd);
    }
    if (o->chunk_reuse && o->no_store) {
        fprintf(stderr, "%s: --chunk-reuse finds blocks in the block store: it cannot be used with --no-store\n", cmd);
        return usage_hint(cmd);
    }
    if (!o->model || !*o->model) {
        fprintf(stderr, "%s: no model given (use -m MODEL)\n", cmd);
        return usage_hint(cmd);
    }
    if (o->budget > o->ctx) {
        fprintf(stderr, "%s: budget %d exceeds the context of %d tokens (raise --ctx or lower --budget)\n", cmd, o->budget, o->ctx);
        return usage_hint(cmd);
    }
    return APP_OK;
}


int cli_parse_elastic(const char *cmd, const char *flag, const char *spec, float *sk, float *sv) {
    float v[2];
    const char *p = spec;
    for (int i = 0; i < 2; i++) {
        char *end;
        errno = 0;
        double d = strtod(p, &end);
        if (end == p || errno == ERANGE || *end != (i == 0 ? ',' : '\0')) {
            fprintf(stderr, "%s: %s '%s' is not two numbers S_K,S_V (e.g. 0.45,0.50)\n", cmd, flag, spec);
            return APP_USAGE;
        }
        if (!(d >= 0 && d <= 2)) {
            fprintf(stderr, "%s: %s '%s': %s scale %.*s is outside [0, 2]\n", cmd, flag, spec, i ? "V" : "K", (int) (end - p), p);
            return APP_USAGE;
        }
        v[i] = (float) d;
        p = end + 1;
    }
    *sk = v[0];
    *sv = v[1];
    return APP_OK;
}

/* --explain: the session's decisions, one "[explain] " line each on stderr. */
static void explain_line(void *ud, const char *line) {
    (void) ud;
    fprintf(stderr, "[explain] %s\n", line);
}

int cli_session_open(const char *cmd, const struct cli_run_opts *o, struct cli_session *cs) {
    int rc;
    memset(cs, 0, sizeof *cs);
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = o->model;
    ep.n_ctx = o->ctx;
    ep.n_threads = o->threads;
    if (o->type_k) ep.type_k = o->type_k;
    if (o->type_v) ep.type_v = o->type_v;
    if ((rc = cli_device_opts(cmd, o->n_gpu_layers, o->flash_attn, o->no_op_offload, &ep))) return rc;
    ep.verbose = o->verbose;
    if ((rc = kvt_engine_open(&ep, &cs->eng))) {
        fprintf(stderr, "%s: %s\n", cmd, *kvt_errmsg() ? kvt_errmsg() : kvt_strerror(rc));
        return rc == KVT_EINVAL ? usage_hint(cmd) : APP_ERR;
    }
    kvt_engine_info(cs->eng, &cs->info);
    cs->budget = o->budget ? o->budget : cs->info.n_ctx_seq;
    if ((rc = app_codec_bits(cmd, cs->eng, o->codec_bits, &cs->head_bits, &cs->n_head_bits))) {
        cli_session_close(cs);
        return rc;
    }

    if (o->no_store && o->redis) {
        fprintf(stderr, "%s: --redis is a tier of the block store: it cannot be used with --no-store\n", cmd);
        cli_session_close(cs);
        return APP_USAGE;
    }
    if (!o->no_store) {
        struct kvt_store_params stp = kvt_store_default_params();
        stp.dir = o->store;
        stp.redis_url = o->redis;
        stp.disk_codec = o->codec_disk;
        stp.disk_codec_heads = cs->info.n_head_kv;
        if (cs->head_bits && app_codec_takes_bits(o->codec_disk)) {
            stp.disk_codec_bits = cs->head_bits;
            stp.n_disk_codec_bits = cs->n_head_bits;
        }
        if (o->redis_timeout_ms > 0) stp.redis_timeout_ms = o->redis_timeout_ms;
        /* the store replaces the host pool: its RAM tier holds evicted blocks too */
        stp.ram_bytes = (size_t) o->pool_mb << 20;
        stp.private_dir = o->spill_dir;
        stp.private_disk_bytes = (size_t) o->spill_mb << 20;
        if ((rc = kvt_store_open(&stp, &cs->store))) {
            if (o->store || o->redis) { /* the directory or Redis the user named: an error */
                app_fail(cmd, "cannot open the block store", rc);
                cli_session_close(cs);
                return rc == KVT_EINVAL ? APP_USAGE : APP_ERR;
            }
            /* the default one (no cache directory, read-only home): a cache, not a reason to fail */
            fprintf(stderr, "%s: running without a block store: %s\n", cmd, kvt_errmsg());
            cs->store = NULL;
        }
    }

    if (!cs->store) { /* no block store: the session's host pool */
        struct kvt_pool_params pp = kvt_pool_default_params();
        pp.budget_bytes = (size_t) o->pool_mb << 20;
        pp.spill_bytes_max = (size_t) o->spill_mb << 20;
        pp.spill_dir = o->spill_dir;
        if ((rc = kvt_pool_open(&pp, &cs->pool))) {
            app_fail(cmd, "cannot open the host pool", rc);
            cli_session_close(cs);
            return rc == KVT_EINVAL ? APP_USAGE : APP_ERR;
        }
    }

    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = cs->budget;
    sp.block = o->block;
    sp.recovery = parse_recovery(o->recovery);
    kvt_policy_from_name(o->policy, &sp.policy);
    if (!o->budget) sp.policy = KVT_POLICY_NO_EVICTION;
    sp.head_profile = o->head_profile;
    sp.top_k = o->top_k;
    sp.elastic_sk = o->elastic_sk;
    sp.elastic_sv = o->elastic_sv;
    if (o->gen_reserve >= 0) sp.gen_reserve = o->gen_reserve;
    sp.pool = cs->pool;
    sp.store = cs->store;
    sp.codec_ram = o->codec_ram;
    if (cs->head_bits && app_codec_takes_bits(o->codec_ram)) {
        sp.codec_ram_bits = cs->head_bits;
        sp.n_codec_ram_bits = cs->n_head_bits;
    }
    sp.chunk_reuse = o->chunk_reuse && cs->store; /* the default store could not be opened: off */
    sp.chunk_recompute = o->chunk_recompute;
    if (o->explain) sp.explain = explain_line;
    if ((rc = kvt_session_open(cs->eng, &sp, &cs->s))) {
        app_fail(cmd, "cannot open the session", rc);
        cli_session_close(cs);
        return rc == KVT_EINVAL ? usage_hint(cmd) : APP_ERR;
    }
    if (o->system && *o->system && (rc = kvt_session_add(cs->s, KVT_ROLE_SYSTEM, o->system, KVT_KEEP_NONE))) {
        app_fail(cmd, "system message", rc);
        cli_session_close(cs);
        return APP_ERR;
    }
    cs->smp.temperature = (float) o->temp;
    cs->smp.top_p = 1.0f;
    cs->smp.top_k = 0;
    cs->smp.seed = (uint32_t) o->seed;
    return APP_OK;
}

void cli_session_close(struct cli_session *cs) {
    kvt_session_free(cs->s);
    kvt_pool_free(cs->pool);
    kvt_store_free(cs->store); /* writes out the queued blocks */
    kvt_engine_free(cs->eng);
    free(cs->head_bits);
    cs->head_bits = NULL;
    cs->n_head_bits = 0;
    cs->s = NULL;
    cs->pool = NULL;
    cs->store = NULL;
    cs->eng = NULL;
}

static bool stream_piece(const char *piece, void *ud) {
    struct cli_session *cs = ud;
    const char *nl = cs->stop_at_newline ? strchr(piece, '\n') : NULL;
    if (cs->streaming) {
        fwrite(piece, 1, nl ? (size_t) (nl - piece) : strlen(piece), stdout);
        fflush(stdout);
    }
    return !cli_sigint && !nl;
}

int cli_turn_begin(const char *cmd, struct cli_session *cs, const char *user) {
    struct kvt_session_stats st;
    int rc;
    cs->n_turns++;
    kvt_session_get_stats(cs->s, &st);
    cs->decoded_before = st.tokens_decoded;
    /* the library names the message's token count and the context or budget it exceeds */
    if ((rc = kvt_session_add(cs->s, KVT_ROLE_USER, user, KVT_KEEP_NONE))) {
        char what[64];
        snprintf(what, sizeof what, "turn %d: user message of %zu bytes", cs->n_turns, strlen(user));
        app_fail(cmd, what, rc);
        return APP_ERR;
    }
    return APP_OK;
}

/* The end of a turn: the tokens it ran through the model, its status line and block table. */
static int turn_done(struct cli_session *cs, const struct cli_run_opts *o, bool quiet) {
    struct kvt_session_stats st;
    kvt_session_get_stats(cs->s, &st);
    cs->turn_decoded = st.tokens_decoded - cs->decoded_before;
    if (!quiet) {
        cli_print_status(cs);
        if (o->verbose) cli_print_blocks(cs);
    }
    return APP_OK;
}

int cli_turn_end(const char *cmd, struct cli_session *cs, const struct cli_run_opts *o, bool stream, bool quiet, char **reply) {
    *reply = NULL;
    cs->streaming = stream;
    int rc = kvt_session_generate(cs->s, o->max_tokens, &cs->smp, stream_piece, cs, reply);
    if (stream) {
        fputc('\n', stdout);
        fflush(stdout);
    }
    if (rc && rc != KVT_ECANCELED) {
        char what[64];
        snprintf(what, sizeof what, "turn %d: generation", cs->n_turns);
        app_fail(cmd, what, rc);
        free(*reply);
        *reply = NULL;
        return APP_ERR;
    }
    if (!*reply && !(*reply = calloc(1, 1))) {
        fprintf(stderr, "%s: out of memory\n", cmd);
        return APP_ERR;
    }
    if (cs->stop_at_newline) (*reply)[strcspn(*reply, "\n")] = '\0';
    return turn_done(cs, o, quiet);
}

int cli_turn(const char *cmd, struct cli_session *cs, const struct cli_run_opts *o, const char *user, bool stream, bool quiet,
             char **reply) {
    *reply = NULL;
    int rc = cli_turn_begin(cmd, cs, user);
    return rc ? rc : cli_turn_end(cmd, cs, o, stream, quiet, reply);
}

int cli_turn_scripted(const char *cmd, struct cli_session *cs, const struct cli_run_opts *o, const char *user, const char *reply,
                      bool echo, bool quiet) {
    int rc = cli_turn_begin(cmd, cs, user);
    if (rc) return rc;
    if (echo) {
        puts(reply);
        fflush(stdout);
    }
    if ((rc = kvt_session_add(cs->s, KVT_ROLE_ASSISTANT, reply, KVT_KEEP_NONE))) {
        char what[64];
        snprintf(what, sizeof what, "turn %d: scripted reply", cs->n_turns);
        app_fail(cmd, what, rc);
        return APP_ERR;
    }
    return turn_done(cs, o, quiet);
}

void cli_print_status(struct cli_session *cs) {
    struct kvt_session_stats st;
    char lost[32] = "";
    char disk[48] = "";
    char recomp[40] = "";
    kvt_session_get_stats(cs->s, &st);
    if (st.n_blocks_lost) snprintf(lost, sizeof lost, ", lost %d", st.n_blocks_lost);
    if (st.recomputes) snprintf(recomp, sizeof recomp, " (%lld recomputed)", (long long) st.recomputes);
    if (st.pool.spill_bytes) snprintf(disk, sizeof disk, " + %.1f MiB spilled", st.pool.spill_bytes / 1048576.0);
    fprintf(stderr,
            "[turn %d] resident %d/%d tokens | blocks %d (dev %d, host %d, disk %d%s) | evictions %lld | "
            "recoveries %lld%s | pool %.1f MiB%s | decoded %lld tok\n",
            cs->n_turns, st.resident_tokens, cs->budget, st.n_blocks, st.n_blocks_resident, st.n_blocks_host, st.n_blocks_disk,
            lost, (long long) st.evictions, (long long) st.recoveries, recomp, st.pool.ram_bytes / 1048576.0, disk,
            (long long) cs->turn_decoded);
}

void cli_print_blocks(struct cli_session *cs) {
    static const char *const res[] = { "dev", "host", "disk", "lost" };
    static const char *const role[] = { "system", "user", "asst" };
    int32_t n = kvt_session_n_blocks(cs->s);
    for (int32_t i = 0; i < n; i++) {
        struct kvt_block_info b;
        if (kvt_session_block(cs->s, i, &b)) continue;
        char text[61];
        size_t k = 0;
        for (const char *p = b.text ? b.text : ""; *p && k < sizeof text - 1; p++)
            text[k++] = (*p == '\n' || *p == '\r' || *p == '\t') ? ' ' : *p;
        text[k] = '\0';
        fprintf(stderr, "  block %3d  %-4s  pos %5d (orig %5d)  %3d tok  %-6s turn %2d  ev %d rec %d  \"%s\"\n", b.id,
                (b.residency >= 0 && b.residency < 4) ? res[b.residency] : "?", b.p0, b.orig_p0, b.n_tokens,
                (b.role >= 0 && b.role < 3) ? role[b.role] : "?", b.turn, b.n_evictions, b.n_recoveries, text);
    }
}

json_t *cli_stats_json(struct cli_session *cs) {
    struct kvt_session_stats st;
    kvt_session_get_stats(cs->s, &st);
    json_t *o = json_pack(
        "{s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "resident_tokens",
        st.resident_tokens, "budget", cs->budget, "peak_resident_tokens", st.peak_resident_tokens, "total_tokens", st.total_tokens,
        "blocks", st.n_blocks, "blocks_device", st.n_blocks_resident, "blocks_host", st.n_blocks_host, "blocks_disk",
        st.n_blocks_disk, "blocks_lost", st.n_blocks_lost, "evictions", (json_int_t) st.evictions, "recoveries",
        (json_int_t) st.recoveries, "recomputes", (json_int_t) st.recomputes, "tokens_decoded", (json_int_t) st.tokens_decoded,
        "turn_tokens_decoded", (json_int_t) cs->turn_decoded, "tokens_recovered", (json_int_t) st.tokens_recovered,
        "pool_ram_bytes", (json_int_t) st.pool.ram_bytes, "pool_spill_bytes", (json_int_t) st.pool.spill_bytes);
    json_t *store = o ? json_pack("{s:b, s:s, s:i, s:i, s:I, s:I, s:I}", "enabled", cs->store != NULL, "route",
                                  kvt_route_name(st.route), "turn_tokens_from_store", st.route_tokens, "turn_tokens_looked_up",
                                  st.route_lookup_tokens, "tokens_from_store", (json_int_t) st.store_tokens, "blocks_put",
                                  (json_int_t) st.store_blocks_put, "load_errors", (json_int_t) st.store_load_errors)
                      : NULL;
    if (!store || json_object_set_new(o, "store", store)) {
        json_decref(o);
        return NULL;
    }
    if (st.elastic_passes) { /* live ElasticKV: the sparsity at the last pass (no memory saved) */
        json_t *el = json_pack("{s:I, s:I, s:f, s:f, s:f}", "passes", (json_int_t) st.elastic_passes, "zeroed",
                               (json_int_t) st.elastic_zeroed, "zero_fraction_resident",
                               st.elastic_elems ? (double) st.elastic_zero / (double) st.elastic_elems : 0.0, "zero_fraction_range",
                               st.elastic_eligible ? (double) st.elastic_zero_eligible / (double) st.elastic_eligible : 0.0, "ms",
                               st.elastic_ms);
        if (!el || json_object_set_new(o, "elastic", el)) {
            json_decref(o);
            return NULL;
        }
    }
    if (st.chunk_runs || st.chunk_blocks_put) { /* --chunk-reuse */
        json_t *ch = json_pack("{s:I, s:I, s:I, s:I, s:I, s:f}", "prompt_tokens_from_chunks", (json_int_t) st.chunk_tokens,
                               "recompute_tokens", (json_int_t) st.chunk_recompute_tokens, "runs", (json_int_t) st.chunk_runs,
                               "blocks_put", (json_int_t) st.chunk_blocks_put, "load_errors", (json_int_t) st.chunk_load_errors,
                               "scan_ms", st.chunk_scan_ms);
        if (!ch || json_object_set_new(o, "chunks", ch)) {
            json_decref(o);
            return NULL;
        }
    }
    return o;
}


/* ---------------------------------------------------------------------------------------- */
/* main                                                                                     */

static void usage(FILE *f) {
    fprintf(f,
            "kvtier %s — a KV-cache memory hierarchy for llama.cpp\n"
            "\n"
            "Usage:\n"
            "  kvtier chat -m MODEL [options]     chat under a token budget (stdin or --script)\n"
            "  kvtier demo [-m MODEL] [options]   planted-fact session; ends with one JSON line\n"
            "  kvtier bench primitives [options]  block save / load / re-prefill timings\n"
            "  kvtier serve -m MODEL [options]    OpenAI-compatible server; sessions keep their KV\n"
            "  kvtier store stats|ls|verify|gc|clear  the persistent KV block store\n"
            "  kvtier --version                   kvtier and llama.cpp versions\n"
            "\n"
            "Run 'kvtier COMMAND --help' for a command's options.\n"
            "Exit status: 0 ok, 1 runtime error, 2 usage error.\n",
            kvt_version());
}

static int cmd_version(int argc, char **argv) {
    if (argc > 0 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h"))) {
        printf("Usage: kvtier --version\nPrints kvtier's version, the llama.cpp/ggml it was built against (CPU build, device "
               "backend)\n"
               "and the compute devices llama.cpp can use now.\n");
        return APP_OK;
    }
    if (argc > 0) {
        fprintf(stderr, "kvtier version: unexpected argument '%s'\n", argv[0]);
        return usage_hint("kvtier version");
    }
    char dev[1024];
    int n_gpu = kvt_devices(dev, sizeof dev);
    printf("kvtier %s\n%s\ndevices: %s\n", kvt_version(), kvt_build_info(), dev);
    if (n_gpu == 0 && strstr(kvt_build_info(), ", backend vulkan"))
        printf("note: no Vulkan device is visible; ggml-vulkan skips CPU drivers such as Mesa's lavapipe unless "
               "GGML_VK_VISIBLE_DEVICES=0 is set\n");
    return APP_OK;
}

/* glibc's allocator serves a request above its mmap threshold (128 KiB, raised by every free of
** such a chunk up to 32 MiB) with a fresh mmap and returns a heap top above its trim threshold to
** the kernel.  kvtier's block blobs (0.3-2 MB), decoded blocks and state assemblies (up to tens of
** MB) are allocated and freed on every load and save, so with the defaults each one comes back as
** page faults on fresh pages: a q4 block load measured 1.28x-1.42x a raw one (Gemma 3 270M) against
** 1.14x with the thresholds fixed at 32 MiB (mmap) and 64 MiB (trim); raw loads were 10 % faster
** too (docs/BENCHMARKS.md, "Codecs at memory speed").  The cost: up to 64 MiB of freed memory kept
** in the heap.  A user's own GLIBC_TUNABLES malloc settings or MALLOC_*_ variables win, and
** KVTIER_MALLOC=system keeps glibc's defaults.  The library itself never calls mallopt: the choice
** belongs to the program. */
static void tune_malloc(void) {
#if defined(__GLIBC__)
    const char *t = getenv("GLIBC_TUNABLES"), *k = getenv("KVTIER_MALLOC");
    if ((t && strstr(t, "glibc.malloc.")) || getenv("MALLOC_MMAP_THRESHOLD_") || getenv("MALLOC_TRIM_THRESHOLD_") ||
        (k && !strcmp(k, "system")))
        return;
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 64 << 20);
#endif
}

int main(int argc, char **argv) {
    tune_malloc();
    if (argc < 2) {
        usage(stderr);
        return APP_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "-V") || !strcmp(cmd, "version")) return cmd_version(argc - 2, argv + 2);
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage(stdout);
        return APP_OK;
    }
    if (!strcmp(cmd, "chat")) return cmd_chat(argc - 2, argv + 2);
    if (!strcmp(cmd, "demo")) return cmd_demo(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench")) return cmd_bench(argc - 2, argv + 2);
    if (!strcmp(cmd, "calibrate")) return cmd_calibrate(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "serve")) return cmd_serve(argc - 2, argv + 2);
    if (!strcmp(cmd, "store")) return cmd_store(argc - 2, argv + 2);
    if (cmd[0] == '-') fprintf(stderr, "kvtier: unknown option '%s'\n", cmd);
    else fprintf(stderr, "kvtier: unknown command '%s'\n", cmd);
    return usage_hint("kvtier");
}
