/* cli.h — what the kvtier command-line tool's files share: a table-driven flag parser, the
** engine/session options every session command takes, one chat turn with its status line,
** and JSON helpers.  Never installed; the tool uses only the public kvtier.h. */
#ifndef KVT_CLI_H
#define KVT_CLI_H

#include "app.h"
#include "kvtier.h"

#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* ---- flag parser ----
** Long flags "--name VALUE" or "--name=VALUE", an optional short form "-m VALUE", "--help"/"-h"
** always.  Numeric values are range-checked; every error names the flag and the bad value. */
enum cli_kind { OPT_FLAG, OPT_INT, OPT_FLOAT, OPT_STR };

struct cli_opt {
    const char *name; /* long name without "--"; NULL ends the table */
    char short_name;  /* 0 = none */
    enum cli_kind kind;
    void *dst;           /* bool*, int32_t*, double*, const char** */
    double min, max;     /* OPT_INT / OPT_FLOAT range (inclusive) */
    const char *metavar; /* "N", "FILE", ... (NULL for flags) */
    const char *help;    /* one line, with the default */
    bool *seen;          /* optional: set when given */
};

/* Parse argv[0..argc) (argv[0] is the first flag, not the command name) for command `cmd`
** ("kvtier chat").  Positional arguments go to pos[0..*n_pos) (at most max_pos, else a usage
** error).  Returns APP_OK, APP_USAGE (message printed to stderr), or -1 if --help was given
** (usage printed to stdout by the caller via cli_print_opts). */
int cli_parse(const char *cmd, const struct cli_opt *opts, int argc, char **argv, char **pos, int max_pos, int *n_pos);

/* Print the option table, one line per option, to f. */
void cli_print_opts(FILE *f, const struct cli_opt *opts);

/* ---- engine + session options shared by chat and demo ---- */
struct cli_run_opts {
    const char *model;
    int32_t ctx, threads;
    const char *type_k, *type_v;
    int32_t budget, block, top_k, max_tokens, pool_mb, gen_reserve;
    int32_t spill_mb;         /* spill-file quota in MiB, 0 = unlimited */
    const char *recovery;     /* "kv_restore" | "discard" | "breadcrumb" */
    const char *policy;       /* kvt_policy_from_name */
    const char *head_profile; /* `kvtier calibrate` profile */
    double temp;
    int32_t seed;
    bool seed_set;
    const char *spill_dir;
    const char *system;
    bool verbose;
    const char *store; /* block store directory; NULL = the default ($XDG_CACHE_HOME/kvtier/store) */
    bool no_store;     /* run without a block store */
    const char *redis; /* the store's Redis tier URL (NULL = none) */
    int32_t redis_timeout_ms;
    const char *codec_disk;       /* the store's disk tier codec (NULL = raw) */
    const char *codec_ram;        /* codec of the session's host pool (NULL = raw) */
    const char *codec_bits;       /* --codec-bits: NULL / "uniform", or "entropy:PROFILE[:FRAC]" */
    float elastic_sk, elastic_sv; /* --elastic (chat): live ElasticKV scales, 0 = off */
    bool chunk_reuse;             /* --chunk-reuse: non-prefix chunk reuse (kvt_session_params) */
    const char *chunk_recompute;  /* --chunk-recompute K|P% (NULL = the library's 15%) */
    const char *n_gpu_layers;     /* -ngl: N, all or auto (NULL = the engine's default, all) */
    const char *flash_attn;       /* -fa: on, off or auto (NULL = the engine's default, auto) */
    bool no_op_offload;           /* --no-op-offload (kvt_engine_params.no_op_offload) */
    bool explain;                 /* --explain (chat): each prefill's decisions on stderr */
};

void cli_run_opts_default(struct cli_run_opts *o);

/* -ngl/--n-gpu-layers and -fa/--flash-attn, llama-server's names and values, as two rows of a
** table (the strings go to cli_device_opts). */
#define CLI_DEVICE_OPT_ROWS(ngl, fa, nooff)                                                                  \
    { "n-gpu-layers",                                                                                        \
      0,                                                                                                     \
      OPT_STR,                                                                                               \
      (ngl),                                                                                                 \
      0,                                                                                                     \
      0,                                                                                                     \
      "N",                                                                                                   \
      "layers (and their KV cells) on the GPU device (-ngl; llama.cpp's count: the output layer is one): "   \
      "N, all or auto (default all; nothing moves where llama.cpp has no device backend)",                   \
      NULL },                                                                                                \
        { "flash-attn",                                                                                      \
          0,                                                                                                 \
          OPT_STR,                                                                                           \
          (fa),                                                                                              \
          0,                                                                                                 \
          0,                                                                                                 \
          "on|off|auto",                                                                                     \
          "flash attention (-fa; default auto: on where layers are on a device, off on the CPU); attention " \
          "signals are computed on the host either way",                                                     \
          NULL },                                                                                            \
    {                                                                                                        \
        "no-op-offload", 0, OPT_FLAG, (nooff), 0, 0, NULL,                                                   \
            "layers kept on the CPU compute there even for large batches (default: llama.cpp offloads a "    \
            "batch of >= 32 tokens to the device)",                                                          \
            NULL                                                                                             \
    }

/* Apply the -ngl and -fa strings (NULL = not given) and --no-op-offload to *ep.  APP_USAGE (message printed, naming
** the flag and the value) on a bad value. */
int cli_device_opts(const char *cmd, const char *ngl, const char *fa, bool no_op_offload, struct kvt_engine_params *ep);

/* Table rows for the shared options (to splice into a command's table). */
/* clang-format off */
#define CLI_RUN_OPT_ROWS(o)                                                                        \
    { "model", 'm', OPT_STR, &(o)->model, 0, 0, "MODEL", "GGUF model file", NULL },                \
    { "budget", 0, OPT_INT, &(o)->budget, 0, 1 << 24, "N",                                         \
      "resident-token budget of the session (default 512; 0 = no eviction: the context size)", NULL }, \
    { "block", 0, OPT_INT, &(o)->block, 1, 1 << 20, "N", "tokens per KV block (default 64)", NULL }, \
    { "recovery", 0, OPT_STR, &(o)->recovery, 0, 0, "MODE",                                         \
      "kv_restore (load evicted blocks back), breadcrumb (re-prefill them) or discard (default kv_restore)", NULL }, \
    { "policy", 0, OPT_STR, &(o)->policy, 0, 0, "NAME",                                             \
      "eviction policy: kvtier, no_eviction, truncate, streaming, h2o, snapkv, infllm (default kvtier)", NULL }, \
    { "head-profile", 0, OPT_STR, &(o)->head_profile, 0, 0, "FILE",                                 \
      "entropy profile from `kvtier calibrate`: weights heads in the attention signals", NULL },   \
    { "top-k", 0, OPT_INT, &(o)->top_k, 0, 1 << 20, "N",                                           \
      "evicted blocks recovered per user turn at most (default 4)", NULL },                        \
    { "max-tokens", 0, OPT_INT, &(o)->max_tokens, 1, 1 << 20, "N",                                 \
      "reply length limit in tokens (default 64)", NULL },                                          \
    { "gen-reserve", 0, OPT_INT, &(o)->gen_reserve, 0, 1 << 20, "N",                               \
      "tokens kept free for the reply when a turn is admitted (default: the library's, 64)", NULL }, \
    { "temp", 0, OPT_FLOAT, &(o)->temp, 0, 100, "F", "sampling temperature; 0 = greedy (default 0)", NULL }, \
    { "seed", 0, OPT_INT, &(o)->seed, 0, 2147483647, "N", "sampling seed (default: from the clock)", \
      &(o)->seed_set },                                                                              \
    { "ctx", 0, OPT_INT, &(o)->ctx, 64, 1 << 24, "N", "context size in KV cells (default 4096)", NULL }, \
    { "threads", 't', OPT_INT, &(o)->threads, 0, 1024, "N", "CPU threads (default 0 = all cores)", NULL }, \
    { "type-k", 0, OPT_STR, &(o)->type_k, 0, 0, "TYPE", "K cache type: f16, f32, q8_0 (default f16)", NULL }, \
    { "type-v", 0, OPT_STR, &(o)->type_v, 0, 0, "TYPE", "V cache type: f16, f32 (default f16)", NULL }, \
    CLI_DEVICE_OPT_ROWS(&(o)->n_gpu_layers, &(o)->flash_attn, &(o)->no_op_offload), \
    { "pool-mb", 0, OPT_INT, &(o)->pool_mb, 1, 1 << 20, "N",                                       \
      "host RAM for KV blocks in MiB: the block store's RAM tier (evicted blocks first), or with " \
      "--no-store the host pool; past it blocks spill to disk (default 256)", NULL },             \
    { "spill-mb", 0, OPT_INT, &(o)->spill_mb, 0, 1 << 24, "N",                                     \
      "disk quota of the spill files in MiB; past it the least recently used spilled blocks are "  \
      "dropped (recomputed if needed again) (default 0 = unlimited)", NULL },                      \
    { "spill-dir", 0, OPT_STR, &(o)->spill_dir, 0, 0, "DIR",                                       \
      "directory for spill files (default: a private one under $TMPDIR)", NULL },                  \
    { "store", 0, OPT_STR, &(o)->store, 0, 0, "DIR",                                               \
      "block store: prompt blocks computed before (by any session or process on this model) are "  \
      "loaded instead of prefilled (default $XDG_CACHE_HOME/kvtier/store or ~/.cache/kvtier/store)", NULL }, \
    { "no-store", 0, OPT_FLAG, &(o)->no_store, 0, 0, NULL, "run without the block store", NULL },  \
    { "redis", 0, OPT_STR, &(o)->redis, 0, 0, "URL",                                               \
      "Redis tier of the block store, shared with servers: redis://[[user:]password@]host[:port][/db] " \
      "or unix:///path[?db=N]", NULL },                                                             \
    { "codec-disk", 0, OPT_STR, &(o)->codec_disk, 0, 0, "SPEC",                                    \
      "codec of the blocks the store keeps on disk and in Redis: raw (default), q8, q4, ecq, elastic, elastic+q8, elastic+q4", NULL },  \
    { "codec-ram", 0, OPT_STR, &(o)->codec_ram, 0, 0, "SPEC",                                      \
      "codec of the blocks saved to the host RAM tier: raw (default), q8, q4, ecq, elastic, elastic+q8, elastic+q4", NULL },\
    { "codec-bits", 0, OPT_STR, &(o)->codec_bits, 0, 0, "SPEC",                                    \
      "bits per (layer, KV head) of a q4/q8 --codec-disk and --codec-ram: uniform (default) or "   \
      "entropy:PROFILE[:FRAC] (FRAC, default 0.5, of the lowest-entropy units of a `kvtier "       \
      "calibrate` PROFILE at 8 bits, the others at 4)", NULL },                                    \
    { "chunk-reuse", 0, OPT_FLAG, &(o)->chunk_reuse, 0, 0, NULL,                                   \
      "non-prefix chunk reuse: blocks are also stored by their own tokens and found anywhere in a "  \
      "prompt, loaded at their new positions; costs answer quality (default off)", NULL },         \
    { "chunk-recompute", 0, OPT_STR, &(o)->chunk_recompute, 0, 0, "K|P%",                          \
      "with --chunk-reuse: tokens (K) or percent (P%) of each reused chunk decoded in context at "  \
      "its start, rounded up to whole blocks (default 15%)", NULL },                               \
    { "redis-timeout-ms", 0, OPT_INT, &(o)->redis_timeout_ms, 1, 60000, "N",                       \
      "deadline of a Redis read in ms (default 20)", NULL },                                        \
    { "system", 0, OPT_STR, &(o)->system, 0, 0, "TEXT", "system message to start the session with", NULL }, \
    { "verbose", 'v', OPT_FLAG, &(o)->verbose, 0, 0, NULL,                                         \
      "llama.cpp's log, and the block table after every turn, on stderr", NULL }
/* clang-format on */

/* An open engine + pool + session. */
struct cli_session {
    kvt_engine *eng;
    kvt_pool *pool;
    kvt_store *store; /* NULL with --no-store */
    kvt_session *s;
    uint8_t *head_bits; /* --codec-bits entropy: the tiers' per-(layer, KV head) bits, or NULL */
    int32_t n_head_bits;
    struct kvt_engine_info info;
    int32_t budget; /* effective budget (0 resolved to the context size) */
    struct kvt_sampling smp;
    int32_t n_turns;        /* user turns run so far */
    int64_t decoded_before; /* tokens_decoded when the turn began */
    int64_t turn_decoded;   /* tokens run through the model in the last turn */
    bool stop_at_newline;   /* end a reply at its first line break (base models
                                           ** rarely emit end-of-turn); the reply is cut there */
    bool streaming;         /* the reply being generated goes to stdout */
};

/* --elastic S_K,S_V: two numbers in [0, 2] (live ElasticKV threshold scales,
** kvt_session_params.elastic_sk / elastic_sv).  APP_OK, or APP_USAGE with a message on stderr
** naming the flag, the spec and the bad part. */
int cli_parse_elastic(const char *cmd, const char *flag, const char *spec, float *sk /* OUT */, float *sv /* OUT */);

/* --codec-bits SPEC against the tier codecs it would apply to (codec_disk NULL without a store):
** the spec parses (app_codec_bits) and, unless "uniform", one of them is q8 or q4.  APP_OK or
** APP_USAGE with a message on stderr naming the flag and the value. */
int cli_codec_bits_check(const char *cmd, const char *spec, const char *codec_disk, const char *codec_ram);

/* Validate the shared options that need no model (exit code APP_USAGE with a message). */
int cli_run_opts_check(const char *cmd, const struct cli_run_opts *o);

/* Open the engine, pool and session (and add --system).  Returns APP_OK, APP_USAGE (a value the
** library rejected as invalid) or APP_ERR; prints the error. On error nothing stays open. */
int cli_session_open(const char *cmd, const struct cli_run_opts *o, struct cli_session *cs);
void cli_session_close(struct cli_session *cs);

/* One user turn in two halves, so a caller can look at the session in between:
**   begin: kvt_session_add(USER);
**   end:   generation (streamed to stdout when stream), then the status line on stderr
**          (unless quiet) and, with --verbose, the block table.  OUT *reply (caller frees).
** Both return APP_OK or APP_ERR (message printed).  cli_turn runs both. */
int cli_turn_begin(const char *cmd, struct cli_session *cs, const char *user);
int cli_turn_end(const char *cmd, struct cli_session *cs, const struct cli_run_opts *o, bool stream, bool quiet, char **reply);
int cli_turn(const char *cmd, struct cli_session *cs, const struct cli_run_opts *o, const char *user, bool stream, bool quiet,
             char **reply);

/* A user turn whose reply is given, not generated (a replayed conversation): begin, then
** kvt_session_add(ASSISTANT, reply) (echoed to stdout when echo), then the status line.  The
** reply's tokens are decoded with the next user turn, as the library does for any added
** assistant message. */
int cli_turn_scripted(const char *cmd, struct cli_session *cs, const struct cli_run_opts *o, const char *user, const char *reply,
                      bool echo, bool quiet);

/* The status line of the last turn, on stderr. */
void cli_print_status(struct cli_session *cs);

/* The block table on stderr (for --verbose). */
void cli_print_blocks(struct cli_session *cs);

/* Session statistics (and the last turn's decoded tokens) as a JSON object (new reference,
** NULL on failure). */
json_t *cli_stats_json(struct cli_session *cs);

/* Set by the SIGINT handler of an interactive chat: stops the reply being generated. */
extern volatile sig_atomic_t cli_sigint;

/* Subcommands. */
int cmd_chat(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_bench_policy(int argc, char **argv);  /* cmd_bench_policy.c, run by cmd_bench */
int cmd_bench_codec(int argc, char **argv);   /* cmd_bench_codec.c, run by cmd_bench */
int cmd_bench_chunks(int argc, char **argv);  /* cmd_bench_chunks.c, run by cmd_bench */
int cmd_bench_prefill(int argc, char **argv); /* cmd_bench_prefill.c, run by cmd_bench */
int cmd_calibrate(int argc, char **argv);     /* cmd_calibrate.c */
int cmd_eval(int argc, char **argv);          /* cmd_eval.c */
int cmd_serve(int argc, char **argv);         /* cmd_serve.c */
int cmd_store(int argc, char **argv);         /* cmd_store.c */

#endif
