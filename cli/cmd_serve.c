/* cmd_serve.c — `kvtier serve`: an OpenAI-compatible HTTP server whose sessions keep their KV
** across requests (only the new tail of a resent history is decoded) under a token budget.
**
**   kvtier serve [-m MODEL] [--host 127.0.0.1] [--port 8080] [-c 4096] [--budget 512] [--parallel 4]
**                [--threads N] [--api-key KEY]... [--api-key-file FILE] [--max-sessions N] [--pool-mb 256]
**                [--spill-dir DIR] [--batch-tokens 128] [--kv-unified]
**
** Startup: flags, API keys, model (without -m the one $KVTIER_MODEL names: cli/model.c); then
** the engine thread (server/sched.c) and libmicrohttpd (server/http.c).  The main thread waits
** for SIGTERM/SIGINT: new requests then get 503, queued and running ones finish, and the process
** exits 0.  API keys are secrets: nothing here or in server/ ever prints one. */
#include "cli.h"
#include "model.h"
#include "serve.h"

#include <ctype.h>
#include <microhttpd.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void serve_usage(FILE *f, const struct cli_opt *opts) {
    fprintf(f, "Usage: kvtier serve [-m MODEL] [options]\n\n"
               "An HTTP server speaking OpenAI's Chat Completions, Completions and Responses, Anthropic's Messages\n"
               "and llama-server's native routes (below).  Sessions keep their KV cache between requests:\n"
               "a client resending its history has only the new tail decoded.  Select a session with the\n"
               "X-Session-Id header, or let the server match the longest common token prefix (one block at least).\n"
               "MODEL defaults to $KVTIER_MODEL (the model scripts/bootstrap.sh cached: `scripts/bootstrap.sh env` prints it).\n\n"
               "Routes ([/v1]: with and without the prefix; every request field: --print-api, docs/API.md):\n");
    serve_routes_print(f, false);
    fprintf(f, "\nOptions:\n");
    cli_print_opts(f, opts);
}

/* Append one API key (copied).  `what` names where it came from in an error message; the key
** itself is never printed.  Returns APP_OK, APP_USAGE (an empty key) or APP_ERR (out of memory). */
static int add_key(struct server *srv, const char *key, const char *what) {
    if (!*key) {
        fprintf(stderr, "kvtier serve: %s is an empty API key\n", what);
        return APP_USAGE;
    }
    char **k = realloc(srv->keys, sizeof *k * (size_t) (srv->n_keys + 1));
    if (k) srv->keys = k;
    if (!k || !(k[srv->n_keys] = strdup(key))) {
        fprintf(stderr, "kvtier serve: out of memory for API key %d\n", srv->n_keys + 1);
        return APP_ERR;
    }
    srv->n_keys++;
    return APP_OK;
}

/* --api-key KEY may be given more than once, which the flag parser (one value per option) cannot
** express: every "--api-key KEY" and "--api-key=KEY" is taken out of argv[0..*argc) here, before
** cli_parse sees the rest.  The values of the other options are stepped over, so a value that
** reads "--api-key" stays theirs; nothing after "--" is taken; a trailing "--api-key" without a
** value is left for cli_parse to report.  A key may not hold white space or control characters
** (a client could not send it as "Authorization: Bearer KEY"); the error says which --api-key,
** by position, never the key. */
static int take_api_keys(struct server *srv, const struct cli_opt *opts, int *argc, char **argv) {
    int n = 0, n_flag = 0;
    for (int i = 0; i < *argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) { /* the rest is positional: left as it is */
            while (i < *argc) argv[n++] = argv[i++];
            break;
        }
        bool joined = !strncmp(a, "--api-key=", 10);
        if (joined || (!strcmp(a, "--api-key") && i + 1 < *argc)) {
            const char *key = joined ? a + 10 : argv[++i];
            char what[48];
            snprintf(what, sizeof what, "--api-key #%d", ++n_flag);
            for (const char *p = key; *p; p++)
                if (isspace((unsigned char) *p) || iscntrl((unsigned char) *p)) {
                    fprintf(stderr,
                            "kvtier serve: %s holds white space or a control character; a client sends the key as "
                            "'Authorization: Bearer KEY'\n",
                            what);
                    return APP_USAGE;
                }
            int rc = add_key(srv, key, what);
            if (rc) return rc;
            continue;
        }
        argv[n++] = argv[i];
        /* another option's value: copied as it is, whatever it reads */
        const struct cli_opt *o = NULL;
        if (a[0] == '-' && a[1] == '-' && !strchr(a, '='))
            for (o = opts; o->name && strcmp(o->name, a + 2); o++) {}
        else if (a[0] == '-' && a[1] && a[1] != '-' && !a[2])
            for (o = opts; o->name && o->short_name != a[1]; o++) {}
        if (o && o->name && o->kind != OPT_FLAG && i + 1 < *argc) argv[n++] = argv[++i];
    }
    *argc = n;
    return APP_OK;
}

/* --api-key-file: one key per line; blank lines and lines starting with '#' are skipped;
** surrounding white space is not part of a key. */
static int load_keys(struct server *srv, const char *path) {
    char *txt = app_read_file(path, NULL);
    if (!txt) {
        fprintf(stderr, "kvtier serve: --api-key-file '%s': cannot read it\n", path);
        return APP_USAGE;
    }
    int32_t n0 = srv->n_keys;
    for (char *line = strtok(txt, "\n"); line; line = strtok(NULL, "\n")) {
        while (isspace((unsigned char) *line)) line++;
        char *e = line + strlen(line);
        while (e > line && isspace((unsigned char) e[-1])) *--e = '\0';
        if (!*line || *line == '#') continue;
        int rc = add_key(srv, line, "--api-key-file");
        if (rc) {
            free(txt);
            return rc;
        }
    }
    free(txt);
    if (srv->n_keys == n0) {
        fprintf(stderr, "kvtier serve: --api-key-file '%s' holds no key (one per line)\n", path);
        return APP_USAGE;
    }
    return APP_OK;
}

int cmd_serve(int argc, char **argv) {
    const char *cmd = "kvtier serve";
    struct server srv;
    memset(&srv, 0, sizeof srv);
    srv.response_quota = -1; /* --response-quota not given */
    pthread_mutex_init(&srv.mu, NULL);
    pthread_cond_init(&srv.work, NULL);
    const char *host = "127.0.0.1", *key_file = NULL, *key_unused = NULL, *elastic = NULL, *ngl = NULL, *fa = NULL;
    bool no_op_offload = false;
    int32_t port = 8080, max_sessions = 0;
    /* llama-server's flags */
    double temp = 1.0, top_p = 1.0, min_p = 0.0, repeat_penalty = 1.0, frequency_penalty = 0.0, presence_penalty = 0.0;
    int repeat_last_n = 64;
    int32_t top_k = 0;
    double top_n_sigma = -1, typical = 1, xtc_p = 0, xtc_t = 0.1, dyn_range = 0, dyn_exp = 1;
    double miro_tau = 5, miro_eta = 0.1;
    int32_t mirostat = 0, dry_allowed = 2, dry_last_n = 64;
    double dry_mult = 0, dry_base = 1.75;
    int32_t resp_ttl = 30 * 24 * 3600; /* --response-ttl */
    int32_t seed = -1, n_predict = -1;
    bool budget_seen = false, slots_on = false, metrics_on = false, jinja = false, no_jinja = false, offline = false,
         cont_batching = false, backend_sampling = false, swa_full = false, context_shift = false;
    const char *tmpl_name = NULL, *tmpl_file = NULL, *slot_save = NULL, *pooling = NULL, *media_path = NULL;
    bool embedding = false, reranking = false, print_api = false;
    char *tmpl_text = NULL;
    srv.cors_origins = NULL; /* default below: "*" with API keys, "localhost" without */
    bool prefetch_on = false, prefetch_off = false;
    srv.n_ctx = 4096;
    srv.budget = 512;
    srv.block = 64;
    srv.parallel = 4;
    srv.pool_mb = 0; /* 256 with --no-store; refused with a store (see below) */
    srv.spill_mb = 0;
    srv.max_queue = 64;
    srv.store_ram_mb = 256;
    srv.store_disk_mb = 8192;
    srv.redis_timeout_ms = 20;
    srv.redis_ttl_s = 86400;
    srv.max_tokens_default = 0; /* 0: not given (256 below, and a completion may fill its budget) */
    srv.batch_tokens = 128;
    int32_t max_body_mb = 8;
    srv.lim = (struct serve_limits){
        .max_messages = 4096,
        .max_parts = 1024,
        .max_tools = 128,
        .max_schema_nodes = 10000,
        .max_alternatives = 1024,
        .max_connections = 0, /* below: 16384, or 256 with --thread-per-connection */
        .max_per_ip = 64,
        .idle_timeout_s = 60,
        .header_timeout_s = 10,
        .body_timeout_s = 60,
        .request_timeout_s = 600,
        .drain_s = 30,
    };
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        { "model", 'm', OPT_STR, &srv.model_path, 0, 0, "MODEL", "GGUF model file (default $KVTIER_MODEL)", NULL },
        { "host", 0, OPT_STR, &host, 0, 0, "ADDR[,ADDR...]",
          "IPv4 or IPv6 addresses to listen on, comma-separated (default 127.0.0.1; e.g. 127.0.0.1,::1)", NULL },
        { "port", 0, OPT_INT, &port, 0, 65535, "N", "TCP port (default 8080; 0 = any free port, printed at start)", NULL },
        { "ctx-size", 'c', OPT_INT, &srv.n_ctx, 256, 1 << 20, "N",
          "KV cells in all (default 4096); each session and completion slot gets its own stream of at least --budget cells", NULL },
        { "budget", 0, OPT_INT, &srv.budget, 128, 1 << 20, "N",
          "resident-token budget of each session (default 512; when -c cannot hold two budgets of 512, "
          "llama-server's slot: -c / --parallel in whole blocks, four blocks at least, with --parallel sessions)",
          &budget_seen },
        { "block", 0, OPT_INT, &srv.block, 16, 4096, "N", "tokens per KV block (default 64)", NULL },
        { "parallel", 0, OPT_INT, &srv.parallel, 1, 64, "N", "requests generating at once (default 4)", NULL },
        { "threads", 't', OPT_INT, &srv.threads, 0, 1024, "N", "CPU threads (default 0 = all cores)", NULL },
        { "api-key", 0, OPT_STR, &key_unused, 0, 0, "KEY",
          "require Authorization: Bearer KEY; may be given more than once, and with --api-key-file (a key on the "
          "command line is visible to other local users: prefer the file)",
          NULL },
        { "api-key-file", 0, OPT_STR, &key_file, 0, 0, "FILE",
          "require Authorization: Bearer KEY, one key per line; sessions are private to their key", NULL },
        { "max-sessions", 0, OPT_INT, &max_sessions, 1, 63, "N",
          "sessions holding KV cells at once (default: ctx-size / budget - 1); past it the least recently used idle "
          "one is parked in the host tier (4x as many kept in all)",
          NULL },
        { "pool-mb", 0, OPT_INT, &srv.pool_mb, 1, 1 << 20, "N",
          "with --no-store: host RAM for evicted KV blocks in MiB (default 256); with the block store, "
          "--store-ram-mb holds them",
          NULL },
        { "spill-dir", 0, OPT_STR, &srv.spill_dir, 0, 0, "DIR",
          "directory for the spill files of evicted blocks that leave host RAM (default: private, under $TMPDIR)", NULL },
        { "spill-mb", 0, OPT_INT, &srv.spill_mb, 0, 1 << 24, "N",
          "disk quota of the spill files in MiB; least recently used spilled blocks are dropped past it "
          "(recomputed if needed again; default 0 = unlimited)",
          NULL },
        { "store", 0, OPT_STR, &srv.store_dir, 0, 0, "DIR",
          "content-addressed block store shared by sessions and restarts (default: $XDG_CACHE_HOME/kvtier/store or "
          "~/.cache/kvtier/store)",
          NULL },
        { "no-store", 0, OPT_FLAG, &srv.no_store, 0, 0, NULL, "run without a block store (nothing outlives the process)", NULL },
        { "store-ram-mb", 0, OPT_INT, &srv.store_ram_mb, 0, 1 << 20, "N",
          "host RAM of the block store in MiB: sessions' evicted blocks first, then cached prompt blocks "
          "(default 256)",
          NULL },
        { "store-disk-mb", 0, OPT_INT, &srv.store_disk_mb, 0, 1 << 24, "N",
          "disk quota of the block store in MiB (default 8192; least recently used blocks go past it)", NULL },
        { "redis", 0, OPT_STR, &srv.redis_url, 0, 0, "URL",
          "Redis tier below the block store's RAM and disk, shared with other servers: redis://[[user:]password@]"
          "host[:port][/db] or unix:///path[?db=N] (a password on the command line is visible to other local users)",
          NULL },
        { "redis-timeout-ms", 0, OPT_INT, &srv.redis_timeout_ms, 1, 60000, "N",
          "deadline of a Redis read in ms; past it the block is prefilled (default 20)", NULL },
        { "codec-disk", 0, OPT_STR, &srv.codec_disk, 0, 0, "SPEC",
          "codec of the blocks the store keeps on disk and in Redis: raw (default: exact K/V), q8, q4, ecq (q4's "
          "KL or less in ~0.29x of raw), elastic, elastic+q8, elastic+q4 (kvtier bench codec measures bytes and KL)",
          NULL },
        { "codec-ram", 0, OPT_STR, &srv.codec_ram, 0, 0, "SPEC",
          "codec of the blocks sessions save to the host RAM tier: raw (default: exact K/V), q8, q4, ecq, elastic, "
          "elastic+q8, elastic+q4 (kvtier eval ppl --codec measures KL and bytes)",
          NULL },
        { "codec-bits", 0, OPT_STR, &srv.codec_bits, 0, 0, "SPEC",
          "bits per (layer, KV head) of a q4/q8 --codec-disk and --codec-ram: uniform (default: the codec's) or "
          "entropy:PROFILE[:FRAC], the FRAC (default 0.5) of the units of lowest attention entropy in a `kvtier "
          "calibrate` PROFILE at 8 bits, the others at 4",
          NULL },
        { "redis-secret-file", 0, OPT_STR, &srv.redis_secret_file, 0, 0, "FILE",
          "16-4096 bytes shared by the servers sharing --redis: every value written carries HMAC-SHA-256 under it "
          "and a value read without a matching one is a miss, counted and deleted (default: values carry a checksum "
          "only, so whoever can write to the Redis can plant K/V)",
          NULL },
        { "redis-ttl-s", 0, OPT_INT, &srv.redis_ttl_s, 1, 1 << 30, "N",
          "expiry of the blocks written to Redis in seconds (default 86400)", NULL },
        { "prefetch", 0, OPT_FLAG, &prefetch_on, 0, 0, NULL,
          "read the blocks a prompt will load from the block store's disk/Redis tiers into its RAM tier ahead of need "
          "(while the request waits in the queue, and during its routing; the default)",
          NULL },
        { "no-prefetch", 0, OPT_FLAG, &prefetch_off, 0, 0, NULL, "no block store prefetch (every block read when asked for)",
          NULL },
        { "share-store", 0, OPT_FLAG, &srv.share_store, 0, 0, NULL,
          "let sessions of different API keys reuse each other's blocks (default: a salt per key)", NULL },
        { "max-tokens", 0, OPT_INT, &srv.max_tokens_default, 1, 1 << 20, "N",
          "reply limit when a request gives none (default 256; given neither this nor -n, a completion may fill what its prompt "
          "leaves of the budget)",
          NULL },
        { "queue", 0, OPT_INT, &srv.max_queue, 1, 1 << 16, "N", "requests waiting for a slot before 429 (default 64)", NULL },
        { "queue-per-key", 0, OPT_INT, &srv.queue_per_key, 1, 1 << 16, "N",
          "requests one API key may have waiting (default: half of --queue with two keys or more, so one key "
          "cannot fill it; all of it otherwise)",
          NULL },
        { "max-responses", 0, OPT_INT, &srv.max_responses, 1, 1 << 24, "N",
          "Responses API replies kept for previous_response_id and GET, in all (default 4096; least recently used first out)",
          NULL },
        { "responses-per-key", 0, OPT_INT, &srv.responses_per_key, 1, 1 << 24, "N",
          "stored responses one API key may hold (default: half of --max-responses with two keys or more, so one key "
          "cannot evict every other key's conversations; all of it otherwise); past it the key's own oldest goes",
          NULL },
        { "response-ttl", 0, OPT_INT, &resp_ttl, 0, 2147483647, "S",
          "a stored response (previous_response_id, GET) expires S seconds after it was made, in RAM and on disk "
          "(default 2592000: 30 days; 0: never)",
          NULL },
        { "response-quota", 0, OPT_INT, &srv.response_quota, 0, 1 << 30, "N",
          "stored responses one API key keeps on disk, in the block store's index (default 100000; past it the key's "
          "least recently used go; 0: no quota).  Without a store (--no-store) they live in RAM only",
          NULL },
        { "batch-tokens", 0, OPT_INT, &srv.batch_tokens, 0, 512, "N",
          "tokens of one scheduler step: every generating request's next token plus a chunk of a new prompt in ONE "
          "llama_decode (mixed prefill; default 128); 0 = prefill chunks decoded alone, between steps",
          NULL },
        { "elastic", 0, OPT_STR, &elastic, 0, 0, "S_K,S_V",
          "live ElasticKV in every session: zero K/V elements under max(sigma/2, mu) x s per head every 64 tokens "
          "(sinks and the last 64 tokens kept; no memory saved in the dense cache), e.g. 0.45,0.50 (default off)",
          NULL },
        { "chunk-reuse", 0, OPT_FLAG, &srv.chunk_reuse, 0, 0, NULL,
          "non-prefix chunk reuse: blocks are also stored by their own tokens and found anywhere in a prompt (RAG "
          "documents in another order), loaded at their new positions; costs answer quality (docs/BENCHMARKS.md; "
          "default off)",
          NULL },
        { "chunk-recompute", 0, OPT_STR, &srv.chunk_recompute, 0, 0, "K|P%",
          "with --chunk-reuse: tokens (K) or percent (P%) of each reused chunk decoded in context at its start, "
          "rounded up to whole blocks (default 15%)",
          NULL },
        CLI_DEVICE_OPT_ROWS(&ngl, &fa, &no_op_offload),
        { "kv-unified", 0, OPT_FLAG, &srv.kv_unified, 0, 0, NULL,
          "one KV cache shared by all sequences (llama.cpp kv_unified) instead of one stream per sequence: a "
          "session's numbers then depend on the others' (for comparison only)",
          NULL },
        /* what one client may ask (docs/RELIABILITY.md) */
        { "max-body-mb", 0, OPT_INT, &max_body_mb, 1, 1024, "N",
          "largest request body in MiB (default 8); a larger Content-Length gets 413 before the body is read", NULL },
        { "max-messages", 0, OPT_INT, &srv.lim.max_messages, 1, 1 << 20, "N", "entries of one request's messages[] (default 4096)",
          NULL },
        { "max-content-parts", 0, OPT_INT, &srv.lim.max_parts, 1, 1 << 20, "N", "content parts of one message (default 1024)",
          NULL },
        { "max-tools", 0, OPT_INT, &srv.lim.max_tools, 1, 1 << 16, "N", "entries of one request's tools[] (default 128)", NULL },
        { "max-schema-nodes", 0, OPT_INT, &srv.lim.max_schema_nodes, 1, 1 << 24, "N",
          "JSON schema nodes one request's tools and response_format may expand into grammar, counted as they are "
          "expanded (default 10000)",
          NULL },
        { "max-schema-alternatives", 0, OPT_INT, &srv.lim.max_alternatives, 1, 1 << 20, "N",
          "entries of one enum, anyOf or oneOf (default 1024)", NULL },
        { "max-connections", 0, OPT_INT, &srv.lim.max_connections, 1, 1 << 16, "N",
          "open connections in all (default 16384; 256 with --thread-per-connection, a thread each); past it new ones are "
          "closed at once",
          NULL },
        { "http-threads", 0, OPT_INT, &srv.http_threads, 1, 64, "N",
          "threads that run every connection with epoll (default 2): an idle or slow connection costs no thread", NULL },
        { "max-workers", 0, OPT_INT, &srv.http_workers, 1, 1 << 16, "N",
          "requests answered at once, each on a worker thread while its connection waits (default 256; past it 503)", NULL },
        { "print-api", 0, OPT_FLAG, &print_api, 0, 0, NULL,
          "print every request field of every API and what kvtier does with it (docs/API.md, as Markdown) and exit", NULL },
        { "thread-per-connection", 0, OPT_FLAG, &srv.thread_per_connection, 0, 0, NULL,
          "a thread for every connection, as before event-driven connections (--max-connections then caps the threads)", NULL },
        { "max-connections-per-ip", 0, OPT_INT, &srv.lim.max_per_ip, 1, 1 << 16, "N",
          "open connections from one client address (default 64; behind a reverse proxy every client has the proxy's address: "
          "raise it there)",
          NULL },
        { "idle-timeout-s", 0, OPT_INT, &srv.lim.idle_timeout_s, 1, 86400, "N",
          "a connection silent this long is closed (default 60)", NULL },
        { "header-timeout-s", 0, OPT_INT, &srv.lim.header_timeout_s, 1, 3600, "N",
          "a request's headers must arrive within this time of the connection (or of the previous reply on it), "
          "however slowly they trickle (default 10)",
          NULL },
        { "body-timeout-s", 0, OPT_INT, &srv.lim.body_timeout_s, 1, 3600, "N",
          "a request's body must arrive within this time of its headers (default 60)", NULL },
        { "request-timeout-s", 0, OPT_INT, &srv.lim.request_timeout_s, 0, 86400, "N",
          "a request's time from arrival to its last token: queued or prefilling past it gets 408, generating past it "
          "ends the reply (finish_reason \"length\"); 0 = none (default 600)",
          NULL },
        { "drain-s", 0, OPT_INT, &srv.lim.drain_s, 0, 86400, "N",
          "after SIGTERM/SIGINT, requests in flight get this long to finish; then, or at a second signal, they are "
          "stopped (replies end, waiting requests get 503) (default 30)",
          NULL },
        { "metrics-public", 0, OPT_FLAG, &srv.lim.metrics_public, 0, 0, NULL,
          "serve GET /metrics without an API key (default: a key is needed when keys are set)", NULL },
        { "cors-origins", 0, OPT_STR, &srv.cors_origins, 0, 0, "ORIGINS",
          "browser origins allowed to read the server's replies (CORS): *, a comma-separated list (localhost: the "
          "loopback origins on any port), or '' for none (default: * with API keys, as llama-server; localhost "
          "without, so that a web page elsewhere cannot use a keyless server); preflight OPTIONS requests are answered "
          "without an API key",
          NULL },
        /* llama-server's flags, for what kvtier has (its scripts start kvtier with their command lines) */
        { "alias", 'a', OPT_STR, &srv.aliases, 0, 0, "NAME[,NAME...]",
          "the model's id in /v1/models and replies (default: the GGUF's general.name); with several, all are "
          "listed as aliases and the id is the first in byte order (llama-server)",
          NULL },
        { "tags", 0, OPT_STR, &srv.tags, 0, 0, "TAG[,TAG...]", "tags listed with the model in /v1/models", NULL },
        { "temp", 0, OPT_FLOAT, &temp, 0, 2, "T", "temperature of a request that sends none (default 1, OpenAI's)", NULL },
        { "top-k", 0, OPT_INT, &top_k, 0, 1000000, "N", "top_k of a request that sends none (default 0: off, OpenAI's)", NULL },
        { "top-p", 0, OPT_FLOAT, &top_p, 0.000001, 1, "P", "top_p of a request that sends none (default 1: off, OpenAI's)", NULL },
        { "min-p", 0, OPT_FLOAT, &min_p, 0, 1, "P",
          "min_p of a request that sends none (default 0: off; llama-server's defaults are --top-k 40 --top-p 0.95 "
          "--min-p 0.05 --temp 0.8)",
          NULL },
        { "top-nsigma", 0, OPT_FLOAT, &top_n_sigma, -1, 100, "N",
          "top_n_sigma of a request that sends none: sampling among the logits within N standard deviations of the largest "
          "(default -1: off)",
          NULL },
        { "typical", 0, OPT_FLOAT, &typical, 0.000001, 1, "P",
          "typical_p of a request that sends none: locally typical sampling (default 1: off)", NULL },
        { "xtc-probability", 0, OPT_FLOAT, &xtc_p, 0, 1, "P",
          "xtc_probability of a request that sends none: the chance that a draw drops the likeliest tokens (XTC; default 0: "
          "off)",
          NULL },
        { "xtc-threshold", 0, OPT_FLOAT, &xtc_t, 0, 1, "P",
          "xtc_threshold of a request that sends none: XTC drops the tokens of at least this probability but the least "
          "likely of them (default 0.1; above 0.5: off)",
          NULL },
        { "dynatemp-range", 0, OPT_FLOAT, &dyn_range, 0, 2, "R",
          "dynatemp_range of a request that sends none: the temperature within +-R by the distribution's entropy "
          "(default 0: off; not at temperature 0, greedy)",
          NULL },
        { "dynatemp-exp", 0, OPT_FLOAT, &dyn_exp, 0.000001, 10, "E", "dynatemp_exponent of a request that sends none (default 1)",
          NULL },
        { "mirostat", 0, OPT_INT, &mirostat, 0, 2, "N",
          "mirostat of a request that sends none: 1 or 2, Mirostat 1.0 / 2.0 after the temperature in place of the other "
          "samplers, as llama-server (default 0: off)",
          NULL },
        { "mirostat-ent", 0, OPT_FLOAT, &miro_tau, 0.000001, 100, "TAU",
          "mirostat_tau of a request that sends none: the target surprise in bits (default 5)", NULL },
        { "mirostat-lr", 0, OPT_FLOAT, &miro_eta, 0.000001, 10, "ETA",
          "mirostat_eta of a request that sends none: the learning rate (default 0.1)", NULL },
        { "dry-multiplier", 0, OPT_FLOAT, &dry_mult, 0, 100, "M",
          "dry_multiplier of a request that sends none: DRY, a token that would extend a repeat of the history past "
          "--dry-allowed-length has its logit lowered by M x --dry-base ^ (length - allowed) (default 0: off)",
          NULL },
        { "dry-base", 0, OPT_FLOAT, &dry_base, 1, 10, "B", "dry_base of a request that sends none (default 1.75)", NULL },
        { "dry-allowed-length", 0, OPT_INT, &dry_allowed, 0, 1 << 20, "N",
          "dry_allowed_length of a request that sends none: repeats up to N tokens go free (default 2)", NULL },
        { "dry-penalty-last-n", 0, OPT_INT, &dry_last_n, -1, 1 << 20, "N",
          "dry_penalty_last_n of a request that sends none: the tokens DRY scans (default 64, llama-server's; -1: the context; 0: "
          "no DRY)",
          NULL },
        { "repeat-penalty", 0, OPT_FLOAT, &repeat_penalty, 0.000001, 10, "F",
          "repeat_penalty of a request that sends none: the logit of a token in the window divided by F where positive, "
          "multiplied where negative (default 1: off)",
          NULL },
        { "frequency-penalty", 0, OPT_FLOAT, &frequency_penalty, -2, 2, "F",
          "frequency_penalty of a request that sends none: F x a token's count in the window off its logit (default 0: off)",
          NULL },
        { "presence-penalty", 0, OPT_FLOAT, &presence_penalty, -2, 2, "F",
          "presence_penalty of a request that sends none: F off the logit of a token in the window (default 0: off)", NULL },
        { "repeat-last-n", 0, OPT_INT, &repeat_last_n, -1, 1 << 20, "N",
          "the penalties' window of a request that sends none: the last N tokens of prompt and reply (default 64; -1: "
          "the context; 0: no penalty unless the request sends repeat_last_n)",
          NULL },
        { "seed", 0, OPT_INT, &seed, -1, 2147483647, "N",
          "sampling seed of a request that sends none (default -1: a new one per request)", NULL },
        { "n-predict", 'n', OPT_INT, &n_predict, -1, 1 << 20, "N",
          "the limit of a request that gives none (llama-server's -n; the same as --max-tokens; default -1: "
          "--max-tokens' 256)",
          NULL },
        { "batch-size", 'b', OPT_INT, &srv.n_batch, 1, 1 << 16, "N",
          "llama.cpp's logical batch, the most tokens of one llama_decode (default 512; a scheduler step holds "
          "--batch-tokens)",
          NULL },
        { "ubatch-size", 0, OPT_INT, &srv.n_ubatch, 1, 1 << 16, "N", "llama.cpp's physical micro-batch (-ub; default 512)", NULL },
        { "chat-template", 0, OPT_STR, &tmpl_name, 0, 0, "NAME",
          "chat template instead of the GGUF's: a llama.cpp built-in (chatml, llama3, gemma, ...) or a template's "
          "text, recognised by llama_chat_apply_template",
          NULL },
        { "chat-template-file", 0, OPT_STR, &tmpl_file, 0, 0, "FILE",
          "chat template read from FILE (a Jinja template, recognised by its markers: kvtier has no Jinja engine)", NULL },
        { "jinja", 0, OPT_FLAG, &jinja, 0, 0, NULL,
          "accepted and logged: chat templates are applied by llama_chat_apply_template, which recognises the "
          "template's format; no Jinja engine runs",
          NULL },
        { "no-jinja", 0, OPT_FLAG, &no_jinja, 0, 0, NULL, "the default: no Jinja engine (accepted)", NULL },
        { "slots", 0, OPT_FLAG, &slots_on, 0, 0, NULL, "serve GET /slots, each session as a slot (the default)", NULL },
        { "no-slots", 0, OPT_FLAG, &srv.no_slots, 0, 0, NULL, "GET /slots answers 501", NULL },
        { "metrics", 0, OPT_FLAG, &metrics_on, 0, 0, NULL, "serve GET /metrics (the default; accepted)", NULL },
        { "no-metrics", 0, OPT_FLAG, &srv.no_metrics, 0, 0, NULL, "GET /metrics answers 501", NULL },
        { "slot-save-path", 0, OPT_STR, &slot_save, 0, 0, "DIR",
          "llama-server's directory of saved slots: here the block store's directory (--store), which keeps every "
          "session's blocks across restarts",
          NULL },
        { "offline", 0, OPT_FLAG, &offline, 0, 0, NULL, "accepted: kvtier never downloads a model", NULL },
        { "cont-batching", 0, OPT_FLAG, &cont_batching, 0, 0, NULL, "accepted: requests are always batched together", NULL },
        { "backend-sampling", 0, OPT_FLAG, &backend_sampling, 0, 0, NULL,
          "accepted and logged: kvtier samples on the host, with the same samplers and probabilities (a request's "
          "backend_sampling likewise)",
          NULL },
        { "swa-full", 0, OPT_FLAG, &swa_full, 0, 0, NULL,
          "accepted and logged: llama-server's full-size sliding-window cache, which it needs to reuse a prompt's "
          "prefix; kvtier saves a sliding-window model's window cells with each block and reuses a prefix from them "
          "(the replies are the same either way)",
          NULL },
        { "context-shift", 0, OPT_FLAG, &context_shift, 0, 0, NULL,
          "accepted and logged: a conversation longer than its session's budget is served by evicting blocks into "
          "the store and recovering them, not by shifting the context; a raw completion longer than the budget "
          "is still refused (exceed_context_size_error)",
          NULL },
        { "verbose", 'v', OPT_FLAG, &srv.verbose, 0, 0, NULL, "llama.cpp's log on stderr", NULL },
        /* llama-server's flags for what kvtier does not serve: accepted, logged, and the endpoints answer 501 */
        { "embedding", 0, OPT_FLAG, &embedding, 0, 0, NULL, "accepted and logged: kvtier serves no embeddings (/embeddings: 501)",
          NULL },
        { "embeddings", 0, OPT_FLAG, &embedding, 0, 0, NULL, "the same as --embedding", NULL },
        { "reranking", 0, OPT_FLAG, &reranking, 0, 0, NULL, "accepted and logged: kvtier serves no reranking (/rerank: 501)",
          NULL },
        { "pooling", 0, OPT_STR, &pooling, 0, 0, "TYPE", "accepted and logged (embeddings' pooling; kvtier serves none)", NULL },
        { "media-path", 0, OPT_STR, &media_path, 0, 0, "DIR",
          "accepted and logged: kvtier takes no image or audio input (such content parts get 400)", NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */
    char *pos[1];
    int n_pos = 0;
    int rc = take_api_keys(&srv, opts, &argc, argv);
    if (rc == APP_OK) rc = cli_parse(cmd, opts, argc, argv, pos, 0, &n_pos);
    if (rc < 0) {
        serve_usage(stdout, opts);
        rc = APP_OK;
        goto out;
    }
    if (rc) goto out;
    if (print_api) {
        serve_print_api(stdout);
        goto out; /* rc APP_OK */
    }
    bool model_from_env = false;
    rc = APP_USAGE;
    if (!(srv.model_path = cli_model_path(cmd, srv.model_path, &model_from_env))) goto out;
    if (elastic && cli_parse_elastic(cmd, "--elastic", elastic, &srv.elastic_sk, &srv.elastic_sv)) goto out;
    {
        struct kvt_engine_params dp = kvt_engine_default_params();
        if (cli_device_opts(cmd, ngl, fa, no_op_offload, &dp)) goto out;
        srv.n_gpu_layers = dp.n_gpu_layers;
        srv.flash_attn = dp.flash_attn;
        srv.no_op_offload = dp.no_op_offload;
    }
    if (!budget_seen && (int64_t) 2 * srv.budget > srv.n_ctx) {
        /* llama-server's -c is the cells of all its slots, each -c / --parallel (-c 512 -np 2:
        ** 256 each): here a session (a slot) holds that as its budget, four blocks at least
        ** (attention sinks, the recent tail, the open block and room to evict), --parallel
        ** sessions hold cells, and completions one budget more */
        int32_t b = srv.n_ctx / srv.parallel / srv.block * srv.block;
        srv.budget = KVT_MAX(b, 4 * srv.block);
        if (!max_sessions) max_sessions = KVT_MIN(srv.parallel, 63);
        int32_t need = (max_sessions + 1) * srv.budget;
        fprintf(stderr,
                "%s: -c %d with --parallel %d: --budget %d and %d sessions (each session's resident tokens; a longer "
                "conversation is evicted into the store, not refused)\n",
                cmd, srv.n_ctx, srv.parallel, srv.budget, max_sessions);
        if (need > srv.n_ctx) {
            fprintf(stderr, "%s: -c %d raised to %d KV cells: %d sessions and the completions' stream of %d each\n", cmd, srv.n_ctx,
                    need, max_sessions, srv.budget);
            srv.n_ctx = need;
        }
    }
    if (tmpl_name && tmpl_file) {
        fprintf(stderr, "%s: --chat-template and --chat-template-file both name a template: give one\n", cmd);
        goto out;
    }
    if (tmpl_file) {
        if (!(tmpl_text = app_read_file(tmpl_file, NULL))) {
            fprintf(stderr, "%s: --chat-template-file '%s': cannot read it\n", cmd, tmpl_file);
            goto out;
        }
        srv.chat_template = tmpl_text;
        srv.chat_template_src = tmpl_file;
    } else if (tmpl_name) srv.chat_template = srv.chat_template_src = tmpl_name;
    if (jinja && no_jinja) {
        fprintf(stderr, "%s: --jinja and --no-jinja contradict each other\n", cmd);
        goto out;
    }
    if (jinja)
        fprintf(stderr,
                "%s: --jinja: kvtier has no Jinja engine; chat templates are applied by llama_chat_apply_template, which "
                "recognises the template's format (tool calls: kvtier's own format, docs/SERVING.md)\n",
                cmd);
    if (slots_on && srv.no_slots) {
        fprintf(stderr, "%s: --slots and --no-slots contradict each other\n", cmd);
        goto out;
    }
    if (metrics_on && srv.no_metrics) {
        fprintf(stderr, "%s: --metrics and --no-metrics contradict each other\n", cmd);
        goto out;
    }
    if (slot_save) {
        if (srv.store_dir && strcmp(srv.store_dir, slot_save)) {
            fprintf(stderr, "%s: --slot-save-path '%s' and --store '%s' both name the block store's directory\n", cmd, slot_save,
                    srv.store_dir);
            goto out;
        }
        if (srv.no_store) {
            fprintf(stderr, "%s: --slot-save-path names the block store's directory: it cannot be used with --no-store\n", cmd);
            goto out;
        }
        srv.store_dir = slot_save;
    }
    srv.temp_default = (float) temp;
    srv.top_k_default = top_k;
    srv.top_p_default = (float) top_p;
    srv.min_p_default = (float) min_p;
    srv.top_n_sigma_default = top_n_sigma > 0 ? (float) top_n_sigma : 0;
    srv.typical_p_default = typical < 1 ? (float) typical : 0;
    srv.xtc_probability_default = (float) xtc_p;
    srv.xtc_threshold_default = (float) xtc_t;
    srv.dynatemp_range_default = (float) dyn_range;
    srv.dynatemp_exponent_default = (float) dyn_exp;
    srv.mirostat_default = mirostat;
    srv.mirostat_tau_default = (float) miro_tau;
    srv.mirostat_eta_default = (float) miro_eta;
    if (dry_last_n > srv.n_ctx) {
        fprintf(stderr, "%s: --dry-penalty-last-n %d is past the context (-c %d); -1 takes the whole context\n", cmd, dry_last_n,
                srv.n_ctx);
        goto out;
    }
    srv.dry_multiplier_default = (float) dry_mult;
    srv.dry_base_default = (float) dry_base;
    srv.dry_allowed_length_default = dry_allowed;
    srv.dry_penalty_last_n_default = dry_last_n;
    if (repeat_last_n > srv.n_ctx) {
        fprintf(stderr, "%s: --repeat-last-n %d is past the context (-c %d); -1 takes the whole context\n", cmd, repeat_last_n,
                srv.n_ctx);
        goto out;
    }
    srv.repeat_penalty_default = (float) repeat_penalty;
    srv.frequency_penalty_default = (float) frequency_penalty;
    srv.presence_penalty_default = (float) presence_penalty;
    srv.repeat_last_n_default = repeat_last_n;
    srv.seed_default = seed;
    if (n_predict > 0) { /* llama-server's -n: the limit of a request that gives none */
        srv.n_predict_cap = n_predict;
        srv.max_tokens_default = KVT_MIN(n_predict, srv.n_ctx);
    }
    /* no limit given (neither --max-tokens nor -n): a request that names none may fill what its
    ** prompt leaves (llama-server's n_predict -1); a limit the server was given is kept to, as
    ** llama-server keeps to its -n (a prompt with it over the context is a 400) */
    srv.max_tokens_unset = srv.max_tokens_default == 0;
    if (srv.max_tokens_default == 0) srv.max_tokens_default = 256;
    (void) offline;
    (void) cont_batching;
    if (backend_sampling)
        fprintf(stderr, "%s: --backend-sampling: kvtier samples on the host (the same samplers and probabilities)\n", cmd);
    if (swa_full)
        fprintf(stderr,
                "%s: --swa-full: kvtier reuses a sliding-window model's prefix from its blocks (each saved with its "
                "window's cells); the cache keeps llama.cpp's default size\n",
                cmd);
    if (context_shift)
        fprintf(stderr,
                "%s: --context-shift: a session evicts past its budget into the store instead of shifting; a raw "
                "completion longer than the budget is still refused\n",
                cmd);
    if (embedding || reranking || pooling)
        fprintf(stderr, "%s: %s: kvtier serves no embeddings or reranking; those endpoints answer 501\n", cmd,
                embedding   ? "--embedding"
                : reranking ? "--reranking"
                            : "--pooling");
    if (media_path) fprintf(stderr, "%s: --media-path: kvtier takes no image or audio input; ignored\n", cmd);
    if (srv.aliases) {
        /* llama-server's id: the first alias in byte order */
        const char *best = NULL;
        size_t best_n = 0;
        for (const char *p = srv.aliases; *p;) {
            size_t n = strcspn(p, ",");
            if (n && (!best || memcmp(p, best, KVT_MIN(n, best_n)) < 0 || (!memcmp(p, best, KVT_MIN(n, best_n)) && n < best_n))) {
                best = p;
                best_n = n;
            }
            p += n + (p[n] == ',');
        }
        if (!best) {
            fprintf(stderr, "%s: --alias '%s' names no model id\n", cmd, srv.aliases);
            goto out;
        }
        snprintf(srv.model_name, sizeof srv.model_name, "%.*s", (int) KVT_MIN(best_n, sizeof srv.model_name - 1), best);
    }
    /* -b/-ub: a prefill chunk is one block and a scheduler step --batch-tokens, each in one
    ** llama_decode of one micro-batch: smaller values are raised to them (said here) */
    for (int k = 0; k < 2; k++) {
        int32_t *v = k ? &srv.n_ubatch : &srv.n_batch;
        if (*v > 0 && *v < srv.block) {
            fprintf(stderr, "%s: %s %d is below a block of %d tokens (one prefill chunk): llama.cpp's %s is %d\n", cmd,
                    k ? "-ub" : "-b", *v, srv.block, k ? "micro-batch" : "batch", srv.block);
            *v = srv.block;
        }
    }
    {
        int32_t lim = KVT_MIN(srv.n_batch > 0 ? srv.n_batch : 512, srv.n_ubatch > 0 ? srv.n_ubatch : 512);
        if (srv.batch_tokens > lim) {
            fprintf(stderr, "%s: --batch-tokens %d is over llama.cpp's batch of %d: a scheduler step holds %d tokens\n", cmd,
                    srv.batch_tokens, lim, lim);
            srv.batch_tokens = lim;
        }
    }
    if (srv.budget < 2 * srv.block) {
        fprintf(stderr, "%s: --budget %d is smaller than two blocks of %d tokens\n", cmd, srv.budget, srv.block);
        goto out;
    }
    srv.max_sessions = max_sessions ? max_sessions : KVT_MAX(1, KVT_MIN(63, srv.n_ctx / srv.budget - 1));
    if ((int64_t) (srv.max_sessions + 1) * srv.budget > srv.n_ctx) {
        fprintf(stderr, "%s: %d sessions of --budget %d plus one budget for completions need %lld KV cells; -c is %d\n", cmd,
                srv.max_sessions, srv.budget, (long long) (srv.max_sessions + 1) * srv.budget, srv.n_ctx);
        goto out;
    }
    if (srv.pool_mb && !srv.no_store) {
        fprintf(stderr,
                "%s: --pool-mb %d: with the block store, evicted blocks live in the store's RAM tier "
                "(--store-ram-mb %d); --pool-mb sizes the host pool of --no-store\n",
                cmd, srv.pool_mb, srv.store_ram_mb);
        goto out;
    }
    if (!srv.pool_mb) srv.pool_mb = 256;
    if (srv.redis_secret_file && !srv.redis_url) {
        fprintf(stderr, "%s: --redis-secret-file authenticates the values of --redis: give --redis too\n", cmd);
        goto out;
    }
    if (srv.redis_url && srv.no_store) {
        fprintf(stderr, "%s: --redis is a tier of the block store: it cannot be used with --no-store\n", cmd);
        goto out;
    }
    struct kvt_codec_params cparse;
    if (srv.codec_ram && kvt_codec_parse(srv.codec_ram, &cparse)) {
        fprintf(stderr, "%s: --codec-ram: %s\n", cmd, kvt_errmsg());
        goto out;
    }
    if (cli_codec_bits_check(cmd, srv.codec_bits, srv.no_store ? NULL : srv.codec_disk, srv.codec_ram)) goto out;
    int32_t ck_tok;
    double ck_pct;
    if (srv.chunk_recompute && kvt_chunk_recompute_parse(srv.chunk_recompute, &ck_tok, &ck_pct)) {
        fprintf(stderr, "%s: --chunk-recompute: %s\n", cmd, kvt_errmsg());
        goto out;
    }
    if (srv.chunk_recompute && !srv.chunk_reuse) {
        fprintf(stderr, "%s: --chunk-recompute '%s' needs --chunk-reuse\n", cmd, srv.chunk_recompute);
        goto out;
    }
    if (srv.chunk_reuse && srv.no_store) {
        fprintf(stderr, "%s: --chunk-reuse finds blocks in the block store: it cannot be used with --no-store\n", cmd);
        goto out;
    }
    if (prefetch_on && prefetch_off) {
        fprintf(stderr, "%s: --prefetch and --no-prefetch contradict each other\n", cmd);
        goto out;
    }
    srv.prefetch = !prefetch_off;
    srv.lim.max_body = (int64_t) max_body_mb << 20;
    bool per_key_given = srv.queue_per_key > 0;
    if (srv.parallel > srv.max_sessions) srv.parallel = srv.max_sessions;
    rc = APP_OK;
    if (key_file && (rc = load_keys(&srv, key_file))) goto out;
    if (!srv.cors_origins) srv.cors_origins = srv.n_keys ? "*" : "localhost";
    if (!per_key_given) srv.queue_per_key = srv.n_keys >= 2 ? KVT_MAX(1, srv.max_queue / 2) : srv.max_queue;
    if (!srv.max_responses) srv.max_responses = 4096;
    if (!srv.http_threads) srv.http_threads = 2;
    if (!srv.http_workers) srv.http_workers = 256;
    if (!srv.lim.max_connections) srv.lim.max_connections = srv.thread_per_connection ? 256 : 16384;
    { /* a descriptor per connection: the soft limit raised toward the hard one as far as they need */
        struct rlimit rl;
        const rlim_t want = (rlim_t) srv.lim.max_connections + 1024;
        if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < want) {
            rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > want ? want : rl.rlim_max;
            setrlimit(RLIMIT_NOFILE, &rl);
        }
        if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < want)
            fprintf(stderr, "%s: --max-connections %d: the open-file limit is %llu (ulimit -n); connections past it are refused\n",
                    cmd, srv.lim.max_connections, (unsigned long long) rl.rlim_cur);
    }
    srv.response_ttl_s = resp_ttl;
    if (srv.response_quota < 0) srv.response_quota = 100000;
    if (!srv.responses_per_key) srv.responses_per_key = srv.n_keys >= 2 ? KVT_MAX(1, srv.max_responses / 2) : srv.max_responses;

    /* signals: handled by sigwait in this thread only */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    if ((rc = serve_engine_open(&srv))) goto out;
    struct kvt_engine_info info;
    kvt_engine_info(srv.eng, &info);
    char terr[1300];
    if (serve_tenant_init(&srv, terr, sizeof terr)) {
        fprintf(stderr, "%s: API keys: %s\n", cmd, terr);
        serve_engine_close(&srv);
        rc = APP_ERR;
        goto out;
    }
    if (respdb_open(&srv, terr, sizeof terr)) {
        fprintf(stderr, "%s: %s\n", cmd, terr);
        serve_engine_close(&srv);
        rc = APP_ERR;
        goto out;
    }
    if (!srv.keys && strcmp(host, "127.0.0.1") && strcmp(host, "localhost") && strcmp(host, "::1") && strcmp(host, "127.0.0.1,::1"))
        fprintf(stderr,
                "%s: warning: listening on %s without --api-key-file: anyone who can reach this address can use "
                "the server, its sessions and its store\n",
                cmd, host);
    fprintf(stderr, "%s: model %s: %s (%s)%s\n", cmd, srv.model_path, srv.model_name, info.desc,
            model_from_env ? " (no -m given: $KVTIER_MODEL or the build's default)" : "");
    pthread_t eng_thread;
    if (pthread_create(&eng_thread, NULL, serve_engine_main, &srv)) {
        fprintf(stderr, "%s: cannot start the engine thread\n", cmd);
        serve_engine_close(&srv);
        rc = APP_ERR;
        goto out;
    }
    int32_t bound = port;
    struct serve_http *d = serve_http_start(&srv, host, port, &bound);
    if (d) {
        struct kvt_engine_info ei;
        kvt_engine_info(srv.eng, &ei);
        fprintf(stderr,
                "%s: listening on http://%s:%d (model %s; context %d, budget %d, %d sessions, %d parallel, "
                "batch %d tokens%s%s; device %s, %d/%d layers, flash attention %s)\n",
                cmd, host, bound, srv.model_name, srv.n_ctx, srv.budget, srv.max_sessions, srv.parallel, srv.batch_tokens,
                srv.kv_unified ? ", unified KV cache" : "", srv.keys ? ", API keys required" : "", ei.device, ei.n_layer_device,
                ei.n_layer, ei.flash_attn ? "on" : "off");
        int sig = 0;
        sigwait(&set, &sig);
        fprintf(stderr, "%s: %s: finishing the requests in flight (at most %d s; a second signal stops them now)\n", cmd,
                sig == SIGTERM ? "SIGTERM" : "SIGINT", srv.lim.drain_s);
    }
    pthread_mutex_lock(&srv.mu);
    srv.stopping = true;
    pthread_cond_broadcast(&srv.work);
    pthread_mutex_unlock(&srv.mu);
    /* the drain: until the engine is done, --drain-s passes or another signal comes */
    struct timespec t_end;
    clock_gettime(CLOCK_MONOTONIC, &t_end);
    t_end.tv_sec += srv.lim.drain_s;
    for (bool done = false; !done;) {
        pthread_mutex_lock(&srv.mu);
        done = srv.engine_done;
        pthread_mutex_unlock(&srv.mu);
        if (done) break;
        struct timespec now, step = { 0, 100 * 1000000L };
        clock_gettime(CLOCK_MONOTONIC, &now);
        int got = sigtimedwait(&set, NULL, &step);
        bool late = now.tv_sec > t_end.tv_sec || (now.tv_sec == t_end.tv_sec && now.tv_nsec >= t_end.tv_nsec);
        if (got > 0 || late) {
            fprintf(stderr, "%s: %s: stopping the requests in flight\n", cmd, got > 0 ? "second signal" : "--drain-s passed");
            pthread_mutex_lock(&srv.mu);
            srv.abort_jobs = true;
            pthread_cond_broadcast(&srv.work);
            pthread_mutex_unlock(&srv.mu);
            break;
        }
    }
    pthread_join(eng_thread, NULL);
    if (d) serve_http_stop(&srv, d);
    serve_engine_close(&srv);
    rc = d ? APP_OK : APP_ERR;
    if (d) fprintf(stderr, "%s: stopped\n", cmd);
out:
    for (int32_t i = 0; i < srv.n_keys; i++) free(srv.keys[i]);
    free(srv.keys);
    free(srv.key_ns);
    free(srv.views);
    free(tmpl_text);
    resp_free_all();
    respdb_close();
    pthread_cond_destroy(&srv.work);
    pthread_mutex_destroy(&srv.mu);
    return rc;
}
