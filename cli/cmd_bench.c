/* cmd_bench.c — `kvtier bench primitives`: what a block costs to keep versus to recompute.
**
** For each block size L, with L tokens decoded into sequence 0 at [0, L):
**   save    kvt_block_save of [0, L) into a host blob;
**   load    kvt_block_load of that blob at [L, 2L) of sequence 0 (RoPE re-anchoring by L, no
**           forward pass), then (untimed) sequence 0 is emptied and the blob loaded back at
**           [0, L), so every round saves the same cells (iSWA: the load moved the window);
**   prefill kvt_engine_decode of the same L tokens into the empty sequence 1 (the recompute a
**           discarded block would need; with no other context it is a lower bound), then removed.
** The three run interleaved within each repeat, after one untimed warm-up round, and the table
** reports medians.  Speedups are ratios inside one run (shared machines are noisy). */
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_BLOCK_SIZES 32


static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t) n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void bench_usage(FILE *f, const struct cli_opt *opts) {
    fprintf(f, "Usage: kvtier bench primitives [-m MODEL] [options]\n"
               "\n"
               "Times, for each block size L: kvt_block_save of L just-decoded tokens, kvt_block_load of\n"
               "the blob at a new position (RoPE re-anchoring, no forward pass), and re-prefill of the same\n"
               "L tokens with kvt_engine_decode. Medians over --repeats, the three interleaved in each repeat,\n"
               "after a warm-up. MODEL defaults to $KVTIER_MODEL. Progress goes to stderr.\n"
               "\n"
               "Options:\n");
    cli_print_opts(f, opts);
}

/* "16,32,64" -> sizes[]; usage error naming the bad element. */
static int parse_blocks(const char *cmd, const char *s, int32_t *sizes, int *n) {
    *n = 0;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || errno == ERANGE || v < 1 || v > 65536) {
            size_t len = strcspn(p, ",");
            fprintf(stderr, "%s: --blocks element '%.*s' is not a block size in 1..65536 (in '%s')\n", cmd, (int) len, p, s);
            return APP_USAGE;
        }
        if (*n >= MAX_BLOCK_SIZES) {
            fprintf(stderr, "%s: --blocks lists more than %d sizes\n", cmd, MAX_BLOCK_SIZES);
            return APP_USAGE;
        }
        sizes[(*n)++] = (int32_t) v;
        if (!*end) return APP_OK;
        p = end + 1;
    }
}

/* n tokens: the text file's tokens (repeated if short), else pseudo-random ids clear of the
** first few (BOS/EOS/pad).  OUT *out (caller frees).  Returns APP_OK or APP_ERR. */
static int bench_tokens(const char *cmd, kvt_engine *eng, const char *text_path, int32_t n, int32_t n_vocab, kvt_token **out) {
    kvt_token *t = malloc(sizeof *t * (size_t) n);
    *out = NULL;
    if (!t) {
        fprintf(stderr, "%s: out of memory for %d tokens\n", cmd, n);
        return APP_ERR;
    }
    if (text_path) {
        FILE *f = fopen(text_path, "rb");
        if (!f) {
            fprintf(stderr, "%s: cannot open --text '%s': %s\n", cmd, text_path, strerror(errno));
            free(t);
            return APP_ERR;
        }
        char *buf = NULL;
        size_t len = 0, cap = 0, r;
        do {
            if (len + 65536 + 1 > cap) {
                cap = cap ? cap * 2 : 131072;
                char *nb = realloc(buf, cap);
                if (!nb) break;
                buf = nb;
            }
            r = fread(buf + len, 1, cap - len - 1, f);
            len += r;
        } while (r > 0);
        fclose(f);
        if (!buf) {
            fprintf(stderr, "%s: out of memory reading '%s'\n", cmd, text_path);
            free(t);
            return APP_ERR;
        }
        buf[len] = '\0';
        kvt_token *tt = NULL;
        int32_t nt = 0;
        int rc = kvt_tokenize(eng, buf, false, false, &tt, &nt);
        free(buf);
        if (rc || nt == 0) {
            if (rc) app_fail(cmd, "tokenizing --text", rc);
            else fprintf(stderr, "%s: --text '%s' has no tokens\n", cmd, text_path);
            free(tt);
            free(t);
            return APP_ERR;
        }
        for (int32_t i = 0; i < n; i++) t[i] = tt[i % nt];
        free(tt);
    } else {
        uint32_t seed = 1;
        int32_t range = n_vocab > 30000 ? 30000 : n_vocab;
        for (int32_t i = 0; i < n; i++) {
            seed = seed * 1103515245u + 12345u;
            t[i] = (kvt_token) ((seed >> 8) % (uint32_t) range);
            if (t[i] < 3 && range > 3) t[i] += 3;
        }
    }
    *out = t;
    return APP_OK;
}

struct row {
    int32_t block;
    double save_ms, load_ms, prefill_ms, bytes_per_token;
};

/* One interleaved round for block size L: save, load (+ remove), prefill (+ remove). */
static int bench_round(const char *cmd, kvt_engine *eng, const kvt_token *tok, int32_t L, double *save_ms, double *load_ms,
                       double *prefill_ms, size_t *blob_bytes) {
    kvt_blob *blob = NULL;
    double t = now_ms();
    int rc = kvt_block_save(eng, 0, 0, L, &blob);
    *save_ms = now_ms() - t;
    if (rc) {
        app_fail(cmd, "block save", rc);
        return APP_ERR;
    }
    *blob_bytes = blob->size;
    t = now_ms();
    rc = kvt_block_load(eng, blob, 0, L);
    *load_ms = now_ms() - t;
    if (rc) {
        kvt_blob_free(blob);
        app_fail(cmd, "block load", rc);
        return APP_ERR;
    }
    /* Untimed: sequence 0 back to [0, L) as decoded.  Removing [L, 2L) is not enough on iSWA
    ** models (Gemma 3): the load at [L, 2L) moved the sliding window past [0, L)'s last
    ** positions and their SWA cells were dropped, so the next round's save would lack them
    ** (kvt_block_load refuses such a block; with L >= the window it failed at L = 1024). */
    kvt_seq_rm(eng, 0, -1, -1);
    rc = kvt_block_load(eng, blob, 0, 0);
    kvt_blob_free(blob);
    if (rc) {
        app_fail(cmd, "block reload at [0, L)", rc);
        return APP_ERR;
    }
    t = now_ms();
    rc = kvt_engine_decode(eng, 1, tok, L, 0, false);
    *prefill_ms = now_ms() - t;
    kvt_seq_rm(eng, 1, -1, -1);
    if (rc) {
        app_fail(cmd, "re-prefill", rc);
        return APP_ERR;
    }
    return APP_OK;
}

static int bench_primitives(int argc, char **argv) {
    static const char cmd[] = "kvtier bench primitives";
    const char *model = getenv("KVTIER_MODEL"), *blocks_s = "16,32,64,128,256,512,1024", *type_k = "f16", *type_v = NULL,
               *text = NULL, *reanchor_s = "host", *ngl = NULL, *fa = NULL;
    bool no_op_offload = false;
    int32_t repeats = 5, ctx = 0, threads = 0;
    bool json = false, verbose = false;
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        { "model", 'm', OPT_STR, &model, 0, 0, "MODEL", "GGUF model file (default $KVTIER_MODEL)", NULL },
        { "json", 0, OPT_FLAG, &json, 0, 0, NULL, "print one JSON object (the last line) instead of the table", NULL },
        { "repeats", 0, OPT_INT, &repeats, 1, 10000, "N", "timed repeats per block size (default 5)", NULL },
        { "blocks", 0, OPT_STR, &blocks_s, 0, 0, "LIST", "block sizes in tokens (default 16,32,64,128,256,512,1024)", NULL },
        { "type-k", 0, OPT_STR, &type_k, 0, 0, "TYPE", "K cache type: f16, f32, q8_0 (default f16)", NULL },
        { "type-v", 0, OPT_STR, &type_v, 0, 0, "TYPE", "V cache type: f16, f32 (default f16)", NULL },
        { "ctx", 0, OPT_INT, &ctx, 0, 1 << 24, "N", "context cells (default max(4096, 4 x largest block))", NULL },
        { "threads", 't', OPT_INT, &threads, 0, 1024, "N", "CPU threads (default 0 = all cores)", NULL },
        { "text", 0, OPT_STR, &text, 0, 0, "FILE", "tokenize this text for the blocks (default: pseudo-random ids)", NULL },
        { "reanchor", 0, OPT_STR, &reanchor_s, 0, 0, "PATH",
          "host (rotate K on the host), seq_add (llama.cpp's lazy K-shift) or auto (default host)", NULL },
        CLI_DEVICE_OPT_ROWS(&ngl, &fa, &no_op_offload),
        { "verbose", 'v', OPT_FLAG, &verbose, 0, 0, NULL, "llama.cpp's log on stderr", NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */
    int n_pos;
    int rc = cli_parse(cmd, opts, argc, argv, NULL, 0, &n_pos);
    if (rc < 0) {
        bench_usage(stdout, opts);
        return APP_OK;
    }
    if (rc) return rc;
    int32_t sizes[MAX_BLOCK_SIZES], max_block = 0;
    int n_sizes;
    if ((rc = parse_blocks(cmd, blocks_s, sizes, &n_sizes))) return rc;
    for (int i = 0; i < n_sizes; i++) max_block = sizes[i] > max_block ? sizes[i] : max_block;
    int reanchor;
    if (!strcmp(reanchor_s, "host")) reanchor = KVT_REANCHOR_HOST;
    else if (!strcmp(reanchor_s, "seq_add")) reanchor = KVT_REANCHOR_SEQ_ADD;
    else if (!strcmp(reanchor_s, "auto")) reanchor = KVT_REANCHOR_AUTO;
    else {
        fprintf(stderr, "%s: --reanchor '%s' is not one of host, seq_add, auto\n", cmd, reanchor_s);
        return APP_USAGE;
    }
    /* seq 0 holds [0, L) plus the load at [L, 2L); seq 1 the re-prefill of L */
    if (ctx == 0) ctx = 4 * max_block > 4096 ? 4 * max_block : 4096;
    if (ctx < 3 * max_block + 64) {
        fprintf(stderr, "%s: --ctx %d is too small for block %d (needs at least %d cells: 3 blocks + 64)\n", cmd, ctx, max_block,
                3 * max_block + 64);
        return APP_USAGE;
    }
    if (!model || !*model) {
        fprintf(stderr, "%s: no model given (use -m MODEL or set KVTIER_MODEL)\n", cmd);
        return APP_USAGE;
    }

    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = model;
    ep.n_ctx = ctx;
    ep.n_seq = 2;
    ep.n_threads = threads;
    ep.type_k = type_k;
    if (type_v) ep.type_v = type_v;
    ep.reanchor = reanchor;
    ep.verbose = verbose;
    if ((rc = cli_device_opts(cmd, ngl, fa, no_op_offload, &ep))) return rc;
    kvt_engine *eng = NULL;
    if ((rc = kvt_engine_open(&ep, &eng))) {
        fprintf(stderr, "%s: %s\n", cmd, *kvt_errmsg() ? kvt_errmsg() : kvt_strerror(rc));
        if (rc == KVT_EUNSUPPORTED && reanchor == KVT_REANCHOR_HOST)
            fprintf(stderr, "%s: host re-anchoring is not available here; try --reanchor seq_add\n", cmd);
        return rc == KVT_EINVAL ? APP_USAGE : APP_ERR;
    }
    struct kvt_engine_info info;
    kvt_engine_info(eng, &info);
    int n_threads = threads > 0 ? threads : (int) sysconf(_SC_NPROCESSORS_ONLN);
    kvt_token *tok = NULL;
    if ((rc = bench_tokens(cmd, eng, text, max_block, info.n_vocab, &tok))) {
        kvt_engine_free(eng);
        return rc;
    }

    char commit[64], llama[512], date[32];
    app_build_commit(commit, sizeof commit);
    app_build_llama(llama, sizeof llama);
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    const char *reanchor_used = info.reanchor == KVT_REANCHOR_HOST ? "host" : "seq_add";

    struct row rows[MAX_BLOCK_SIZES];
    double *sv = malloc(sizeof(double) * (size_t) repeats * 3);
    if (!sv) {
        fprintf(stderr, "%s: out of memory\n", cmd);
        free(tok);
        kvt_engine_free(eng);
        return APP_ERR;
    }
    double *lv = sv + repeats, *pv = sv + 2 * repeats;
    for (int i = 0; i < n_sizes && rc == APP_OK; i++) {
        const int32_t L = sizes[i];
        size_t blob_bytes = 0;
        double s_ms, l_ms, p_ms;
        fprintf(stderr, "[bench] block %d: ", L);
        kvt_seq_rm(eng, 0, -1, -1);
        kvt_seq_rm(eng, 1, -1, -1);
        if ((rc = kvt_engine_decode(eng, 0, tok, L, 0, false))) {
            fputc('\n', stderr);
            app_fail(cmd, "decoding the block", rc);
            rc = APP_ERR;
            break;
        }
        rc = bench_round(cmd, eng, tok, L, &s_ms, &l_ms, &p_ms, &blob_bytes); /* warm-up */
        for (int r = 0; r < repeats && rc == APP_OK; r++) {
            rc = bench_round(cmd, eng, tok, L, &sv[r], &lv[r], &pv[r], &blob_bytes);
            fputc('.', stderr);
        }
        if (rc) break;
        rows[i] = (struct row){ L, median(sv, repeats), median(lv, repeats), median(pv, repeats), (double) blob_bytes / L };
        fprintf(stderr, " save %.3f ms, load %.3f ms, prefill %.3f ms\n", rows[i].save_ms, rows[i].load_ms, rows[i].prefill_ms);
    }
    free(sv);
    free(tok);
    kvt_seq_rm(eng, 0, -1, -1);
    kvt_engine_free(eng);
    if (rc) return APP_ERR;

    if (json) {
        json_t *arr = json_array();
        for (int i = 0; arr && i < n_sizes; i++) {
            const struct row *r = &rows[i];
            json_t *o = json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:f}", "block", r->block, "save_ms", r->save_ms, "load_ms",
                                  r->load_ms, "prefill_ms", r->prefill_ms, "load_speedup", r->prefill_ms / r->load_ms,
                                  "lifecycle_speedup", r->prefill_ms / (r->save_ms + r->load_ms), "bytes_per_token",
                                  r->bytes_per_token);
            if (!o || json_array_append_new(arr, o)) {
                json_decref(arr);
                arr = NULL;
            }
        }
        json_t *obj = arr ? json_pack("{s:s, s:s, s:i, s:b, s:s, s:s, s:s, s:i, s:s, s:s, s:s, s:i, s:i, s:s, s:o}", "model",
                                      info.desc, "device", info.device, "n_layer_device", info.n_layer_device, "flash_attn",
                                      info.flash_attn, "llama_cpp", llama, "commit", commit, "date", date, "threads", n_threads,
                                      "type_k", info.type_k, "type_v", info.type_v, "reanchor", reanchor_used, "ctx", info.n_ctx,
                                      "repeats", repeats, "tokens", text ? text : "pseudo-random", "rows", arr)
                          : NULL;
        return app_json_line(cmd, obj);
    }
    printf("# kvtier bench primitives | %s | %s | kvtier commit %s | %s | %d threads | device %s, %d/%d layers | flash attn %s"
           " | K %s, V %s | reanchor %s | ctx %d | tokens: %s | median of %d\n",
           info.desc, llama, commit, date, n_threads, info.device, info.n_layer_device, info.n_layer,
           info.flash_attn ? "on" : "off", info.type_k, info.type_v, reanchor_used, info.n_ctx, text ? text : "pseudo-random ids",
           repeats);
    printf("%6s %10s %10s %11s %13s %18s %16s\n", "block", "save_ms", "load_ms", "prefill_ms", "load_speedup", "lifecycle_speedup",
           "bytes_per_token");
    for (int i = 0; i < n_sizes; i++) {
        const struct row *r = &rows[i];
        printf("%6d %10.3f %10.3f %11.3f %12.1fx %17.1fx %16.0f\n", r->block, r->save_ms, r->load_ms, r->prefill_ms,
               r->prefill_ms / r->load_ms, r->prefill_ms / (r->save_ms + r->load_ms), r->bytes_per_token);
    }
    return APP_OK;
}

int cmd_bench(int argc, char **argv) {
    if (argc < 1 || !strcmp(argv[0], "--help") || !strcmp(argv[0], "-h")) {
        FILE *f = argc < 1 ? stderr : stdout;
        fprintf(f, "Usage: kvtier bench primitives|policy|codec|chunks|prefill [options]\n"
                   "Benchmarks: primitives (block save / load / re-prefill), policy (per-decode-step cost of "
                   "each eviction policy), codec (block codecs: bytes, speed, KL), chunks (quality of non-prefix "
                   "chunk reuse), prefill (a session's prompt chunk against a plain decode of it). Run 'kvtier "
                   "bench NAME --help' for its options.\n");
        return argc < 1 ? APP_USAGE : APP_OK;
    }
    if (!strcmp(argv[0], "policy")) return cmd_bench_policy(argc - 1, argv + 1);
    if (!strcmp(argv[0], "codec")) return cmd_bench_codec(argc - 1, argv + 1);
    if (!strcmp(argv[0], "chunks")) return cmd_bench_chunks(argc - 1, argv + 1);
    if (!strcmp(argv[0], "prefill")) return cmd_bench_prefill(argc - 1, argv + 1);
    if (strcmp(argv[0], "primitives") != 0) {
        fprintf(stderr, "kvtier bench: unknown benchmark '%s' (expected: primitives, policy, codec, chunks, prefill)\n", argv[0]);
        return APP_USAGE;
    }
    return bench_primitives(argc - 1, argv + 1);
}
