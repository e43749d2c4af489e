/* serve.h — what the files of `kvtier serve` share: a request ("job") as the HTTP threads hand it
** to the engine thread, the server and its metrics.  Never installed.
**
** Threads: libmicrohttpd runs one thread per connection (server/http.c, bodies parsed by
** server/request.c); exactly one engine thread (server/sched.c, sessions chosen by
** server/admit.c, its state in server/sched.h) owns the kvt_engine and every session on it,
** because the library is single-threaded per engine.  They meet in a job queue (one mutex,
** condition variables per job); HTTP threads never call the library on the engine.  All state
** hangs off one struct server: two servers could run in one process. */
#ifndef KVT_SERVE_H
#define KVT_SERVE_H

#include "app.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

enum { SERVE_MAX_STOP = 4, SERVE_PARK_FACTOR = 4, SERVE_MAX_CHOICES = 16 /* n: choices of one request */ };
/* dry_sequence_breakers: strings of one request, bytes of each (llama.cpp's DRY truncates a longer one; kvtier
** refuses it) and bytes in all.  Making a DRY sampler maps each breaker over the whole vocabulary on the engine
** thread, for every new set (the engine keeps one per sequence + 4): on Gemma 3's 262k tokens, measured beside
** other work, 0.5-1.1 s for 3 breakers of 40 bytes, 1.4-1.7 s for 16 of 8 bytes (16 of 40 bytes: 2.1 s, refused). */
enum { SERVE_MAX_DRY_BREAKERS = 16, SERVE_MAX_DRY_BREAKER_BYTES = 40, SERVE_MAX_DRY_BREAKERS_BYTES = 128 };

/* The one form every error of the server takes, wherever it arises (a header, the body's JSON, a
** field, the queue, the engine thread): an HTTP status and the OpenAI error object's type, code
** and param, with a message naming what was wrong and the value.  status 0: no error.  Filled by
** the serve_error_* functions (server/error.c), sent by server/http.c as
** {"error": {"message", "type", "param", "code"}}. */
struct serve_error {
    int status;
    const char *type; /* "invalid_request_error", "server_error", ... (static) */
    char param[64];   /* the request field at fault, "" when none: a copy (a key of the request's JSON
                       ** dies with the JSON, before the error is sent), cut at a UTF-8 boundary */
    char code[48];    /* "" when none */
    char msg[1024];
    int32_t n_prompt_tokens, n_ctx; /* exceed_context_size_error (llama-server's): the prompt's tokens and
                                    ** what could hold them; 0 when unknown */
};

/* Fill e.  Returns -1, so that a parser can end with `return serve_error_set(...)`. */
int serve_error_set(struct serve_error *e, int status, const char *type, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Name the request field at fault: a copy of name (NULL: none) into e->param, at most 63 bytes,
** cut at a UTF-8 character boundary; control characters become '?'. */
void serve_error_param(struct serve_error *e, const char *name);
/* src (NULL: "") as a name fit for a log line or an error: at most cap - 1 bytes, cut at a UTF-8
** character boundary, control characters as '?'.  cap >= 1. */
void serve_printable(char *dst, size_t cap, const char *src);
/* 400 invalid_request_error about the field e->param (set by the caller); returns -1. */
int serve_bad(struct serve_error *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* 500 server_error "out of memory"; returns -1. */
int serve_error_oom(struct serve_error *e);
/* A library error as an HTTP error: input the library refused is the client's (400;
** context_length_exceeded for KVT_ECTX / KVT_EBUDGET), the rest is ours (500).  what: the step
** that failed ("prompt"); the message is kvt_errmsg(). */
void serve_error_lib(struct serve_error *e, const char *what, int rc);
/* {"error": {...}} for e (a fresh reference). */
json_t *serve_error_json(const struct serve_error *e);

/* What one client may ask of the server: every cap is a `kvtier serve` flag (cli/cmd_serve.c
** gives the defaults, docs/RELIABILITY.md why); past one the request gets a 4xx naming the cap
** and the value, or the connection is closed, before unbounded work is done. */
struct serve_limits {
    int64_t max_body;          /* --max-body-mb: bytes of one request body */
    int32_t max_messages;      /* --max-messages: entries of messages[] */
    int32_t max_parts;         /* --max-content-parts: content parts of one message */
    int32_t max_tools;         /* --max-tools: entries of tools[] */
    int32_t max_schema_nodes;  /* --max-schema-nodes: schema nodes expanded into grammar, per request */
    int32_t max_alternatives;  /* --max-schema-alternatives: entries of one enum / anyOf / oneOf */
    int32_t max_connections;   /* --max-connections: open connections in all */
    int32_t max_per_ip;        /* --max-connections-per-ip */
    int32_t idle_timeout_s;    /* --idle-timeout-s: a connection silent this long is closed */
    int32_t header_timeout_s;  /* --header-timeout-s: from accept to the end of the headers, in all */
    int32_t body_timeout_s;    /* --body-timeout-s: from the headers to the end of the body, in all */
    int32_t request_timeout_s; /* --request-timeout-s: from arrival to the last token; 0 = none */
    int32_t drain_s;           /* --drain-s: after SIGTERM, jobs still running past this are stopped */
    bool metrics_public;       /* --metrics-public: GET /metrics without a key */
};

#define KVT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVT_MAX(a, b) ((a) > (b) ? (a) : (b))

enum job_kind { JOB_CHAT, JOB_COMPLETION, JOB_DELETE };
/* What the reply is: free text, JSON under a grammar (response_format), or the generic
** tool-call JSON (server/tools.c) to be turned into `tool_calls` or `content`. */
enum reply_format { REPLY_TEXT, REPLY_JSON, REPLY_TOOLS };
enum job_state { JOB_QUEUED, JOB_RUNNING, JOB_DONE };

/* What the client asked for, parsed by the HTTP thread (server/request.c) before the job is
** queued.  The engine thread changes two things in it: smp.grammar (grammar compiled) and
** msgs[k].content of assistant messages (echoed replies replaced by the session's own text,
** server/admit.c). */
struct serve_api; /* server/api.h */
struct server;

struct job_req {
    char ns[80];               /* API-key namespace ("" without --api-key-file) */
    char session_id[80];       /* X-Session-Id ("" = choose by prefix / new) */
    struct kvt_chat_msg *msgs; /* JOB_CHAT: owned copies */
    int32_t n_msgs;
    char *prompt; /* JOB_COMPLETION */
    int32_t max_tokens;
    bool max_tokens_given; /* the request set it (max_tokens, max_completion_tokens, n_predict > 0); else the server's default */
    struct kvt_sampling smp;
    int32_t repeat_last_n; /* the penalty window as llama-server reports it: the request's or --repeat-last-n
                           ** (-1 resolved to the context; 0: penalties off, smp's window then unused) */
    bool seeded;
    char *stop[SERVE_MAX_STOP];
    int32_t n_stop;
    char *dry_breakers[SERVE_MAX_DRY_BREAKERS]; /* owned; smp.dry_sequence_breakers points here (NULL: llama-server's) */
    int32_t n_dry_breakers;
    bool stream, include_usage;
    bool logprobs;        /* "logprobs": true (not streamed) */
    int32_t top_logprobs; /* "top_logprobs" (native: "n_probs"): the most likely tokens listed at each position */
    bool post_sampling;   /* native "post_sampling_probs": the probabilities after the samplers (kvt_sampling.post),
                          ** listed as llama-server's "prob" / "top_probs" */
    enum reply_format format;
    char *grammar;                     /* GBNF for the reply (tools / response_format / json_schema, or the
                                   ** request's own "grammar"), NULL = free text; compiled into
                                   ** smp.grammar by the engine thread */
    bool grammar_user;                 /* grammar is the request's "grammar" text (its errors name that field) */
    const struct serve_api *api;       /* the API the request came in (server/api.h): its reply, stream and error shapes */
    bool llama_probs;                  /* probabilities listed in llama-server's shape (native /completion: "id",
                                       ** "prob" / "top_probs") */
    bool prefill;                      /* a chat whose last message is the assistant's: run as a completion of the template's text
                       ** ending in that message (no session), replied in the chat shape */
    bool prompt_special;               /* prompt's control tokens are parsed (a chat template's text) and BOS added */
    bool resp_store;                   /* responses: keep the reply for previous_response_id and GET (store, default true) */
    char resp_id[48], resp_parent[48]; /* responses: this response's id; previous_response_id ("" none) */
    json_t *resp_turn;                 /* responses: the chat messages of this turn's input (owned) */
    json_t *ignored;                   /* the names of request fields no table knows (owned; usage.kvtier.ignored_fields) */
    json_t *resp_fields;               /* native response_fields: the reply's fields to send (owned; NULL: all) */
    bool return_tokens;                /* native: the reply lists the generated token ids */
    bool verbose;                /* "verbose": true, or the server's --verbose: the reply carries "__verbose" (the prompt's text) */
    bool timings;                /* "timings_per_token" (llama-server's): every streamed chunk carries "timings" */
    bool no_prompt_cache;        /* "cache_prompt": false (llama-server's): a completion decodes its whole prompt, reusing no
                                 ** cached KV (a chat's session keeps its own) */
    bool return_progress;        /* "return_progress" (llama-server's): a stream sends prompt-progress events while the
                                 ** prompt is prefilled (struct prompt_progress) */
    kvt_token *prompt_ids;       /* native: the prompt as token ids (instead of prompt text), owned */
    struct kvt_logit_bias *bias; /* logit_bias (smp.logit_bias points here), owned */
    int32_t n_bias;
    int32_t n_prompt_ids;
    double t_arrival; /* ms, monotonic */
    double deadline;  /* ms, monotonic: t_arrival + --request-timeout-s; 0 = none */
};

/* One prompt-progress event (llama-server's "prompt_progress"): the prompt's tokens in all, those
** already in the KV cache when its prefill began (a session's kept prefix, blocks loaded from the
** store), those in the cache now, and the ms since the request arrived and since the prefill's
** first chunk.  total and cache stay the same across one request's events; processed grows,
** and the last event has processed == total. */
struct prompt_progress {
    int32_t total, cache, processed;
    double time_ms, prompt_ms;
};

/* One request: what was asked (req) and how its run stands.  The run state is written by the
** engine thread under srv->mu (cancelled: by the HTTP thread). */
struct job {
    enum job_kind kind;
    struct job_req req;
    uint64_t ticket; /* arrival order, set by serve_submit: a job put back keeps its place */
    enum job_state state;
    bool cancelled;         /* client went away (set by the HTTP thread) */
    bool timed_out;         /* stopped by its deadline (engine thread) */
    bool started;           /* the prompt is in: a stream may send its headers */
    struct serve_error err; /* err.status != 0: the job failed */
    char *text;             /* reply so far (valid UTF-8 prefix sent as it grows) */
    size_t n_text, cap_text;
    size_t n_sent;      /* bytes of text already streamed (HTTP side) */
    const char *finish; /* "stop" | "length" */
    bool stop_word;     /* finished by one of req.stop (llama.cpp's native API: stop_type "word") */
    int32_t prompt_tokens, completion_tokens;
    struct kvt_sync_info sync;
    int32_t resident_tokens;
    char out_session[80];         /* session the job ran in */
    double t_first;               /* ms of the first token, 0 before */
    int32_t n_gen_pub;            /* n_gen as last published with the text (under srv->mu): what the HTTP side may read */
    struct prompt_progress *prog; /* return_progress: the events so far (engine thread appends, under srv->mu) */
    int32_t n_prog, cap_prog;
    int32_t n_prog_sent;  /* events already streamed (HTTP side) */
    pthread_cond_t cv;    /* signalled on every change */
    int refs;             /* HTTP side + engine side; freed at 0 (under srv->mu) */
    struct job *next;     /* queue link */
    struct job *run_next; /* link of the server's running jobs (under srv->mu) */
    /* engine-side generation state */
    void *slot; /* struct sess * while running */
    /* how the engine thread ends it (rc 0 done, else the failure): serve_chat_end or
    ** serve_completion_end, set when it is activated (server/sched.c, completion.c) */
    void (*end)(struct server *srv, struct job *j, int rc);
    int64_t resumed; /* blocks loaded back by resuming a parked session */
    /* JOB_DELETE of POST /slots/N?action=erase: the caller's session slot-N (none is no error)
    ** and its idle completions' prompt caches go; n_erased: their tokens (engine thread) */
    bool erase_slot;
    int64_t n_erased;
    bool prefetched; /* its prompt's blocks were prefetched while it waited (engine thread) */
    /* queued behind a running or queued job of its session: it waits whatever slots are free
    ** (serve_submit sets it, the engine thread's rounds update it; under srv->mu) */
    bool blocked;
    kvt_token *gen;
    float *lp;                /* [cap_gen] with logprobs: ln p of each generated token, else NULL */
    kvt_token *top_tok;       /* [cap_gen * req.top_logprobs]: each position's most likely tokens, best first */
    float *top_lp;            /* [cap_gen * req.top_logprobs]: their ln p */
    struct kvt_token_p *post; /* with post_sampling: [top_logprobs + 1], what the last sample wrote (engine thread) */
    int32_t n_gen, cap_gen;
    int32_t n_lp_ready;   /* streamed with logprobs: tokens whose ids and ln p are complete (under srv->mu) */
    int32_t n_lp_sent;    /* ...of which the connection has sent the entries (under srv->mu) */
    int32_t shared_steps; /* decode steps of this job that shared their llama_decode with
                                   ** another request's tokens (usage.kvtier.decode_steps_shared) */
    /* JOB_COMPLETION: a raw row of the batched step in a scratch sequence */
    kvt_token *ptok; /* prompt tokens: a completion's until prefilled; a chat's template
                                   ** tokens with the assistant prefix, once computed (server/admit.c:
                                   ** prefetch and admission share them) */
    int32_t n_ptok;  /* JOB_CHAT: tokens in ptok */
    bool have_ptok;  /* JOB_CHAT: ptok computed (NULL when it could not be) */
    kvt_token *pen;  /* JOB_COMPLETION with a penalty: [2 x window], the prompt's last n_pen tokens, then the window */
    int32_t n_pen;
    int32_t seq;            /* scratch sequence while running, -1 otherwise */
    int32_t cells;          /* KV cells reserved: prompt + max_tokens */
    struct kvt_gen_row row; /* position and logits (row.logits owned) */
};

/* a and b are chat turns naming one session (X-Session-Id, same key namespace): they must run one
** after the other, in arrival order.  Caller holds srv->mu or owns both jobs. */
static inline bool serve_same_session(const struct job *a, const struct job *b) {
    return a->kind == JOB_CHAT && b->kind == JOB_CHAT && a->req.session_id[0] && !strcmp(a->req.session_id, b->req.session_id) &&
           !strcmp(a->req.ns, b->req.ns);
}

/* Histogram with fixed upper bounds (ms), Prometheus style (cumulative when printed). */
enum { HIST_N = 12 };
struct hist {
    double sum;
    int64_t count, bucket[HIST_N + 1];
};

struct metrics {
    int64_t by_status[6]; /* index status / 100 */
    int64_t requests;
    int64_t prompt_tokens, completion_tokens, prompt_reused, prompt_decoded;
    int64_t evictions, recoveries, recomputes;
    int64_t resident_tokens, n_sessions, n_parked, queue_len, active;
    int64_t pool_ram, pool_spill, pool_dropped;
    int64_t route[4];             /* chat requests by enum kvt_route of their prompt */
    int64_t prompt_from_store;    /* prompt tokens loaded from the block store */
    int64_t prompt_from_chunks;   /* prompt tokens loaded as reused chunks (--chunk-reuse) */
    struct kvt_store_stats store; /* zero without a store */
    bool have_store;
    int64_t steps, step_tokens;                         /* scheduler steps (one llama_decode each) and the tokens they held */
    int64_t mixed_steps, mixed_prefill_tokens;          /* steps holding a prefill chunk AND decode tokens; the chunks' tokens */
    int64_t prefill_alone_tokens;                       /* prefill tokens of chunks decoded alone (a prompt's last chunk) */
    int64_t prefill_alone_steps;                        /* llama_decode calls of those chunks */
    int64_t decode_rows;                                /* decode tokens (one per generating request) summed over steps */
    double prompt_ms, predicted_ms;                     /* finished requests: arrival to first token, first token to the end (ms) */
    int64_t n_tokens_max;                               /* the longest request seen: prompt + generated tokens */
    int64_t connections_accepted;                       /* TCP connections libmicrohttpd accepted */
    int64_t closed_header_timeout, closed_body_timeout; /* connections shut for --header/--body-timeout-s */
    struct hist ttft, per_token;
};

/* Snapshot of one session for GET /v1/sessions (the engine thread publishes them). */
struct sess_view {
    char id[80], ns[80];
    int32_t n_messages, total_tokens, resident_tokens;
    int64_t evictions, recoveries;
    double last_used; /* seconds since the epoch */
    bool busy, parked;
};

struct server {
    pthread_mutex_t mu;
    pthread_cond_t work; /* queue non-empty or shutting down */
    struct job *head, *tail;
    struct job *running; /* the admitted jobs (m.active of them: DELETE jobs are not), under mu */
    int32_t n_queued, max_queue;
    int32_t queue_per_key;      /* --queue-per-key: one API key's jobs waiting at most */
    int32_t max_responses;      /* --max-responses: stored Responses in all (server/responses.c) */
    bool public_listen;         /* a --host address is not loopback (set by serve_http_start) */
    bool thread_per_connection; /* --thread-per-connection: libmicrohttpd's thread per connection (the old way) */
    int32_t http_threads;       /* --http-threads: threads running every connection (epoll) */
    int32_t http_workers;       /* --max-workers: requests answered at once on worker threads */
    int32_t n_workers;          /* worker threads running (under mu) */
    int32_t responses_per_key;  /* --responses-per-key: one API key's stored responses at most */
    int64_t response_ttl_s;     /* --response-ttl: a stored response expires this long after it was made (0: never) */
    int32_t response_quota;     /* --response-quota: one API key's stored responses on disk at most (respdb.c) */
    uint64_t n_tickets;         /* jobs ever queued (the next job's ticket) */
    bool stopping;              /* SIGTERM: finish what is queued and running, take nothing new */
    bool engine_done;
    bool abort_jobs; /* --drain-s passed or a second signal: every job stops now */
    int32_t n_http;  /* requests whose reply is not yet sent (HTTP threads) */
    /* configuration */
    const char *model_path;
    char model_name[128];
    int32_t n_ctx, budget, parallel, threads, max_sessions, pool_mb, spill_mb, block, max_tokens_default;
    bool max_tokens_unset; /* neither --max-tokens nor -n given: a completion naming no limit fills its budget */
    int32_t batch_tokens;  /* --batch-tokens: tokens of one scheduler step (decode rows + a prefill chunk) */
    bool kv_unified;       /* --kv-unified: one KV cache shared by all sequences (the old layout) */
    int32_t n_gpu_layers;  /* -ngl (kvt_engine_params.n_gpu_layers) */
    int32_t flash_attn;    /* -fa (kvt_engine_params.flash_attn) */
    bool no_op_offload;    /* --no-op-offload (kvt_engine_params.no_op_offload) */
    const char *spill_dir;
    const char *store_dir; /* block store (--store); NULL = the user's cache directory */
    bool no_store;         /* --no-store */
    bool share_store;      /* --share-store: tenants (API keys) share blocks */
    int32_t store_ram_mb, store_disk_mb;
    const char *redis_url;                 /* --redis: the block store's Redis tier (NULL = none) */
    const char *redis_secret_file;         /* --redis-secret-file: values MACed under it (NULL = none) */
    int32_t redis_timeout_ms, redis_ttl_s; /* --redis-timeout-ms, --redis-ttl-s */
    bool prefetch;                         /* --prefetch / --no-prefetch: the block store's prefetch */
    const char *codec_disk;                /* --codec-disk: the store's disk tier codec (NULL = raw) */
    const char *codec_ram;                 /* --codec-ram: codec of the sessions' host pool (NULL = raw) */
    const char *codec_bits;                /* --codec-bits: "uniform" / NULL, or "entropy:PROFILE[:FRAC]" */
    float elastic_sk, elastic_sv;          /* --elastic: live ElasticKV scales of every session, 0 = off */
    bool chunk_reuse;                      /* --chunk-reuse: non-prefix chunk reuse in every session */
    const char *chunk_recompute;           /* --chunk-recompute K|P% (NULL = the library's 15%) */
    /* llama-server's flags, for what kvtier has (cli/cmd_serve.c) */
    float temp_default;                 /* --temp: a request's temperature when it sends none (default 1, OpenAI's) */
    int32_t top_k_default;              /* --top-k: a request's top_k when it sends none (default 0: off) */
    float top_p_default, min_p_default; /* --top-p, --min-p: likewise (defaults 1 and 0: off) */
    /* --top-nsigma, --typical, --xtc-probability, --xtc-threshold, --dynatemp-range, --dynatemp-exp: likewise
    ** (kvt_sampling's values: 0 = off; the threshold 0.1 and the exponent 1 as llama-server's) */
    float top_n_sigma_default, typical_p_default, xtc_probability_default, xtc_threshold_default, dynatemp_range_default,
        dynatemp_exponent_default;
    int32_t mirostat_default;                                       /* --mirostat: likewise (0: off) */
    float mirostat_tau_default, mirostat_eta_default;               /* --mirostat-ent, --mirostat-lr (5 and 0.1, llama-server's) */
    float dry_multiplier_default, dry_base_default;                 /* --dry-multiplier (0: off), --dry-base (1.75) */
    int32_t dry_allowed_length_default, dry_penalty_last_n_default; /* --dry-allowed-length (2), --dry-penalty-last-n (64) */
    /* --repeat-penalty, --frequency-penalty, --presence-penalty, --repeat-last-n: likewise (defaults
    ** 1, 0, 0: off; the window 64 tokens, -1 the context, 0 no penalty unless a request sends one) */
    float repeat_penalty_default, frequency_penalty_default, presence_penalty_default;
    int32_t repeat_last_n_default;
    int64_t seed_default;          /* --seed: a request's seed when it sends none; -1 (default) = drawn per request */
    int32_t n_predict_cap;         /* -n/--n-predict: the limit of a request that gives none (llama-server's); 0 = none given */
    const char *aliases, *tags;    /* --alias, --tags: comma-separated, as given (NULL = none); model_name is the
                                ** first alias in byte order (llama-server's id) */
    bool no_slots;                 /* --no-slots: GET /slots answers 501 */
    bool no_metrics;               /* --no-metrics: GET /metrics answers 501 */
    const char *chat_template;     /* --chat-template NAME or --chat-template-file's text (NULL = the GGUF's) */
    const char *chat_template_src; /* for /props: what was given ("chatml", the file's path) */
    int32_t n_batch, n_ubatch;     /* -b, -ub: llama.cpp's logical and physical batch; 0 = the engine's default */
    bool verbose;                  /* -v/--verbose: llama.cpp's log on stderr */
    const char *cors_origins;      /* --cors-origins: "*" (default), "" (none) or a comma list of origins */
    char **keys;                   /* API keys (NULL = no auth) */
    int32_t n_keys;
    char (*key_ns)[40]; /* [n_keys]: each key's tenant, "t" + 32 hex digits of
                                   ** HMAC-SHA-256(server secret, key) (server/tenant.c) */
    struct serve_limits lim;
    struct conn_watch *watch; /* deadlines of connections still sending (server/http.c) */
    /* published by the engine thread */
    struct metrics m;
    struct sess_view *views;
    int32_t n_views;
    unsigned long long n_replies, n_calls; /* ids given to replies / tool calls so far (atomic, any thread) */
    kvt_engine *eng;                       /* used only by the engine thread */
    struct sched *sched;                   /* the engine thread's state (server/sched.h), owned */
};

/* server/sched.c */
/* Open the model (srv->eng), the host pool and the scheduler state (srv->sched) from srv's
** configuration; fills srv->model_name.  Returns APP_OK, or APP_ERR with the message printed and
** nothing left open. */
int serve_engine_open(struct server *srv);
void *serve_engine_main(void *srv); /* the engine thread */
/* Free the sessions, the pool, srv->sched and srv->eng (what is open of them). */
void serve_engine_close(struct server *srv);

/* Queue a job (refs becomes 2: caller + engine).  Returns 0, or 429 when the queue is full, 430
** when the job's API key holds its share of it (--queue-per-key; a 429 for the client), or 503
** when shutting down. */
int serve_submit(struct server *srv, struct job *j);
/* Take j off srv->running (the admitted jobs) if it is there.  Under srv->mu. */
void serve_running_remove(struct server *srv, struct job *j);
/* Drop the caller's reference (and free the job when the engine is done with it). */
void serve_job_release(struct server *srv, struct job *j);
void serve_job_free(struct job *j);


/* server/tools.c — tool calling and structured output (see the file's header) */

/* Validate tools / tool_choice / parallel_tool_calls / response_format of a chat request, within
** lim's caps on tools, schema nodes (counted as they are expanded) and alternatives.  Sets
** j->req.format and j->req.grammar (owned by the job); *sys_extra (caller frees) is the text describing
** the tools, to append to the system message, or NULL.  On a bad field: e filled (e->param the
** field), returns -1. */
int tools_parse(json_t *root, struct job *j, const struct serve_limits *lim, char **sys_extra, struct serve_error *e);
/* An assistant message's tool_calls (as a client echoes them) as the JSON text the model
** generates.  NULL with e filled if malformed.  Caller frees. */
char *tools_render_calls(const json_t *calls, size_t msg_index, struct serve_error *e);
/* A tool result as the user-message text the model sees.  Caller frees; NULL on OOM. */
char *tools_render_result(const char *tool_name, const char *content);
/* Is `echo` (an assistant message a client sent back) the reply the session stored as `stored`?
** Byte-equal, or equal as JSON, or the "response" text of a stored {"response": ...}. */
bool tools_same_reply(const char *stored, const char *echo);
/* The assistant message for a finished reply: {"role", "content", "tool_calls"?}; the calls'
** ids count on srv->n_calls.  *finish becomes "tool_calls" when the reply is a complete tool call.
** New reference; NULL on OOM. */
json_t *tools_reply(struct server *srv, const char *text, int format, const char **finish);

/* server/request.c */
/* "an object", "a string", ... for messages naming a JSON value's type (v NULL: a missing
** field).  Cannot fail. */
const char *serve_json_type(const json_t *v);
/* The JSON body of POST /v1/chat/completions (chat) or /v1/completions into the job: sampling,
** max_tokens, stop, stream, then tools / response_format and messages (chat) or prompt.  Returns
** 0; or -1 with e filled (400 naming the field, e->param, and the bad value; 500 out of memory).
** On error the job holds what was parsed: serve_job_free. */
int serve_request_parse(struct server *srv, json_t *root, struct job *j, bool chat, struct serve_error *e);
/* llama-server's id_slot N in root, without an X-Session-Id: j's session is "slot-N", whose KV stays
** between the requests that name it, as slot N's does (-1 or absent: chosen by prefix). */
void serve_request_slot(struct job *j, const json_t *root);
/* A request translated into the chat completion it means (Responses, Anthropic): checked against
** the OpenAI field table, then parsed as a chat into j.  chat is consumed.  0, or -1 with e. */
int serve_request_parse_chat(struct server *srv, json_t *chat, struct job *j, struct serve_error *e);
/* Engine thread: compile j's grammar (req.grammar: the client's GBNF or a schema's translation)
** into req.smp.grammar, once.  0, or -1 with j->err set (a 400 naming the field for the client's
** own GBNF). */
int serve_job_grammar(struct server *srv, struct job *j);
/* s sets a repetition penalty (frequency, presence or repeat_penalty; server/request.c): its
** window is s->penalty_last_n tokens (set with the penalties).  Pure. */
/* The sampling of a request that sends no sampling field: the server's --temp, --top-k, ... flags
** (dry_penalty_last_n -1 as the context).  Pure. */
struct kvt_sampling serve_sampling_defaults(const struct server *srv);
bool serve_penalized(const struct kvt_sampling *s);
/* The history a job's draws read (the prompt's and the reply's last tokens): the longer of the
** penalties' and DRY's windows, 0 when neither applies.  Pure. */
int32_t serve_history_window(const struct kvt_sampling *s);

/* A parsed chat job becomes a completion of its template's text with the assistant prefix, run in
** a scratch sequence and replied in the chat shape: a choice after the first of an n > 1 request
** (the first runs in the session; these leave the session's conversation alone).  A job that is
** no chat is left as it is.  0, or -1 with e filled (400 with tools or response_format). */
int serve_request_detach(struct server *srv, struct job *j, struct serve_error *e);

/* server/metrics.c */
/* Add one sample (ms) to a histogram (caller holds srv->mu).  Cannot fail. */
void serve_hist_add(struct hist *h, double ms);
/* GET /metrics: srv->m in the Prometheus text format.  Caller frees; NULL on OOM. */
char *serve_metrics_text(struct server *srv);

/* server/tenant.c */
/* srv->key_ns: each API key's tenant id, a keyed hash under the server secret of the store
** directory (created at the first start with keys) or, with --no-store, a secret drawn now (see
** the file's header).  Call after the store is open.  0, or -1 with the reason in err. */
int serve_tenant_init(struct server *srv, char *err, size_t n_err);

/* server/compat.c — llama-server's endpoints and shapes (see the file's header) */
/* llama.cpp's native /completion fields into the job (n_predict as max_tokens, return_tokens);
** call before serve_request_parse.  0, or -1 with e filled (400 naming the field). */
int compat_native_params(struct server *srv, json_t *root, struct job *j, struct serve_error *e);
/* A native reply object: a streamed piece (final false) or the last object with the timings
** (final true; t_done: ms, monotonic, when the job finished).  New reference; NULL on OOM. */
/* reply (consumed) cut to the job's response_fields (llama-server's: "a/b" is field b of a,
** named "a/b"; a missing one is left out); the reply itself without them.  New reference. */
json_t *compat_response_fields(const struct job *j, json_t *reply);
json_t *compat_native_reply(struct server *srv, const struct job *j, const char *content, bool final, double t_done);
/* llama-server's "timings" of a job (t_done: ms, monotonic; a job still running: now, with srv->mu held): prompt_n (decoded),
** cache_n (reused), prompt_ms, predicted_n, predicted_ms and their rates.  New reference. */
json_t *serve_timings(const struct job *j, double t_done);
/* The timings of a prompt-progress event: prompt_n the tokens decoded so far, prompt_ms since the
** first event, nothing predicted yet.  New reference. */
json_t *serve_progress_timings(const struct prompt_progress *p);
/* A prompt-progress event's fields, added to ev (any API's event object): llama-server's
** "prompt_progress" (total, cache, processed, time_ms) and, with timings_per_token, "timings". */
void serve_progress_attach(json_t *ev, const struct job *j, const struct prompt_progress *p);
/* POST /tokenize: 0 with *out the reply's JSON text (malloc'd; a few bytes per token, with_pieces
** too), or -1 with e filled.  /detokenize, /apply-template: 0 with *out (new reference), or -1. */
int compat_tokenize(struct server *srv, const json_t *root, char **out, struct serve_error *e);
int compat_detokenize(struct server *srv, const json_t *root, json_t **out, struct serve_error *e);
int compat_apply_template(struct server *srv, json_t *root, json_t **out, struct serve_error *e);
/* Append an OpenAI function tool {type: function, function: {name, description?, parameters?}}
** to tools (desc, params borrowed; NULL or null: left out).  0, or -1 out of memory. */
int compat_function_tool(json_t *tools, const char *name, const json_t *desc, const json_t *params);
/* The template's tokens of a chat request (chat: its JSON, changed: stream and max_tokens
** removed), with the assistant prefix unless it ends in a prefill.  0 with *n, or -1 with e. */
int compat_chat_tokens(struct server *srv, json_t *chat, int32_t *n, struct serve_error *e);
/* GET /v1/models, /props, /slots (the caller's tenant ns names its own sessions).  NULL on OOM. */
json_t *compat_models(struct server *srv);
json_t *compat_props(struct server *srv);
json_t *compat_slots(struct server *srv, const char *ns);
/* POST /slots/ID?action=ACTION, llama-server's slot actions: id is the path after /slots/, action
** the query parameter (NULL: absent), root the JSON body (NULL: none sent).  erase is served (OUT
** *slot: 0 .. --parallel sessions - 1, as GET /slots lists them); save and restore are 501 (a
** session's blocks already outlive it in the block store, found again by their content).
** Returns 0, or -1 with e: 400 naming id_slot or action and their text (40 bytes at most,
** printable), 400 naming a body field erase does not take, 501 for save and restore. */
int compat_slot_action(const struct server *srv, const char *id, const char *action, const json_t *root, int32_t *slot,
                       struct serve_error *e);

/* server/anthropic.c — Anthropic's Messages API on the chat path (see the file's header) */
/* The chat completion request an Anthropic Messages request means.  0 with *out (new reference),
** or -1 with e filled (400 naming the field and where).  lim: --max-messages and
** --max-content-parts are checked before any work on the messages or their blocks.  The fields are
** checked against the Anthropic table (server/fields.h) first; the names of unknown ones are
** appended to *ignored (created on the first; the caller owns it). */
int anth_to_chat(const json_t *in, const struct serve_limits *lim, json_t **out, json_t **ignored, struct serve_error *e);
/* A Message for a finished reply (msg: tools_reply's assistant message, fin its finish reason),
** or for message_start (msg NULL, fin NULL: no content, no stop_reason).  New reference. */
json_t *anth_message(struct server *srv, const struct job *j, const json_t *msg, const char *fin);
/* msg's content blocks: text, then one tool_use per tool call.  New reference. */
json_t *anth_blocks(const json_t *msg);
/* usage: input_tokens (decoded), cache_read_input_tokens (reused KV), output_tokens (final). */
json_t *anth_usage(const struct job *j, bool final);
const char *anth_stop_reason(const struct job *j, const char *fin);
/* An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}. */
json_t *anth_error(const struct serve_error *e);
/* POST /v1/messages/count_tokens: {"input_tokens": N}, the template's tokens of the request. */
int anth_count_tokens(struct server *srv, json_t *root, json_t **out, struct serve_error *e);

/* server/responses.c — OpenAI's Responses API with server-held conversations (see its header) */
/* The chat request a Responses request means, with previous_response_id's conversation (of the
** tenant ns) replayed first: 0 with *out and *turn (this turn's input as chat messages; new
** references) and parent (previous_response_id or ""), or -1 with e filled (400 naming the
** field; 404 when the previous response is not stored).  The fields are checked against the
** Responses table (server/fields.h) first; unknown ones' names are appended to *ignored (as
** anth_to_chat). */
int resp_to_chat(struct server *srv, const char *ns, const json_t *in, json_t **out, json_t **turn, char *parent, size_t n_parent,
                 json_t **ignored, struct serve_error *e);
/* The output items of a finished reply (msg: tools_reply's assistant message): a message with
** its output_text, then one function_call per tool call.  New reference. */
json_t *resp_output(struct server *srv, const json_t *msg, const char *item_id);
/* input_tokens (cached_tokens: the prompt tokens not computed: the session's KV, the block store's
** prefix, reused chunks), output_tokens */
json_t *resp_usage(const struct job *j);
/* A Response object (status "in_progress", "completed" or "incomplete"; j NULL: no usage yet).
** Steals output.  New reference. */
json_t *resp_object(struct server *srv, const struct job *j, const char *id, const char *parent, json_t *output,
                    const char *status);
/* Keep a finished response: turn (this turn's input messages, the reply appended), obj (what GET
** returns).  Out of memory: not kept (a later previous_response_id gets 404). */
void resp_store(struct server *srv, const char *ns, const char *id, const char *parent, json_t *turn, const json_t *msg,
                json_t *obj);
json_t *resp_get(struct server *srv, const char *ns, const char *id); /* new reference, or NULL (RAM, else disk) */
/* A new response id: "resp_" and 32 hex digits from getrandom(2) (not guessable). */
void resp_new_id(char *id, size_t n);
/* Stored responses of the tenant ns (NULL: of all). */
int32_t resp_count(const char *ns);
bool resp_delete(const char *ns, const char *id); /* false: no such response */
void resp_free_all(void);                         /* at exit */

/* server/respdb.c — stored responses on disk, in the block store's index (see its header).
** Without a store (--no-store) every call is a no-op and the RAM table is all there is. */
/* Open <store>/index.db's responses table (created if needed) and the MAC secret.  0, or -1 with
** err.  Called once before the HTTP threads start. */
int respdb_open(struct server *srv, char *err, size_t n_err);
void respdb_close(void);
bool respdb_on(void);
/* Write one response (INSERT OR REPLACE) in one transaction with the TTL and quota expiry, and,
** with a Redis tier, its copy there first (one SET: *shared).  0, or -1 (logged; the response
** stays in RAM). */
int respdb_put(const char *ns, const char *id, const char *parent, const json_t *turn, const json_t *obj,
               bool *shared /* OUT: in Redis */);
/* Read one live response of tenant ns: 1 with parent, *turn, *obj (new references) and *expires
** (unix s, 0: never); 0 when absent or expired; -1 when the row exists but cannot be served (MAC,
** size cap, shape), with why (logged). */
int respdb_get(const char *ns, const char *id, char *parent, size_t n_parent, json_t **turn, json_t **obj, int64_t *expires,
               bool *shared /* OUT: its copy is in Redis */, char *why, size_t n_why);
/* ids[0..n) (newest first, a chain) were used now: each more recent than the one before it. */
void respdb_touch(const char *ns, const char (*ids)[48], size_t n);
bool respdb_del(const char *ns, const char *id); /* false: no live row */
/* Is (ns, id) in Redis (the servers' shared copy)?  1 yes, 0 no (deleted or expired elsewhere),
** -1 unknown (no Redis tier, or Redis unreachable).  One GET within redis_timeout_ms. */
int respdb_remote(const char *ns, const char *id);
/* A row's body (JSON {"turn": [...], "object": {...}}, at most 64 MiB) checked and parsed: 0 with
** *turn and *obj (new references), or -1 with why.  The fuzz harness's entry. */
int respdb_decode_row(const void *body, size_t n, json_t **turn, json_t **obj, char *why, size_t n_why);
/* A Redis copy of a row (JSON {"parent", "created", "expires", "body", "mac": 64 hex digits})
** parsed: 1 with its fields (*body malloc'd, mac[32]), or -1 with why.  Checks shapes only (the
** caller checks the MAC).  The fuzz harness's entry. */
int respdb_parse_record(const void *v, size_t n, char *parent, size_t n_parent, int64_t *created, int64_t *expires, char **body,
                        unsigned char *mac, char *why, size_t n_why);
struct respdb_report {
    int64_t checked, ok, expired, corrupt, removed;
};
/* `kvtier store verify`: every stored response in dir/index.db checked (its MAC under the
** secret_file's bytes or dir/server-secret, its body's shape); repair deletes the corrupt ones.
** 0 (a store without the table counts nothing), or -1 with err. */
int respdb_verify(const char *dir, const char *secret_file, bool repair, struct respdb_report *out, char *err, size_t n_err);
/* The 32-byte secret of a store directory (<dir>/server-secret, created at the first call;
** server/tenant.c).  0, or -1 with err. */
int serve_store_secret(const char *dir, unsigned char *s, char *err, size_t n_err);
/* The block store's directory (valid while the server runs); NULL with --no-store. */
const char *serve_store_dir(struct server *srv);

/* server/buf.c: a growing text, s[0..n) NUL-terminated (s NULL while empty); an allocation that
** fails sets oom and drops the rest (check once at the end).  The caller frees s. */
struct serve_buf {
    char *s;
    size_t n, cap;
    bool oom;
};
void serve_buf_add(struct serve_buf *b, const char *s, size_t n);
void serve_buf_printf(struct serve_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* server/step.c: a finished, unstreamed job's "logprobs" content array (its tokens' text, ln p,
** bytes and top_logprobs; native: llama-server's completion_probabilities entries), built on the
** caller's thread (detokenizing only reads the vocabulary).  New reference; NULL when the job
** asked for none, was streamed, or out of memory. */
json_t *serve_logprobs_json(struct server *srv, const struct job *j);
/* Generated tokens' ids and ln p, copied out of a job (owned by the record): n tokens, top_tok and
** top_lp n x top_logprobs (NULL without top_logprobs). */
struct lp_rec {
    kvt_token *tok;
    float *lp;
    kvt_token *top_tok;
    float *top_lp;
    int32_t n;
};
/* A streamed job's tokens not yet sent with logprobs: copies them into *out (n 0: none) and
** marks them sent.  Call under srv->mu (the engine thread grows the arrays under it); build the
** entries with serve_logprobs_entries after unlocking.  0, or -1 out of memory (nothing marked). */
int serve_logprobs_take(struct job *j, struct lp_rec *out);
/* r's entries as a "logprobs" content array (as serve_logprobs_json).  New reference. */
json_t *serve_logprobs_entries(struct server *srv, const struct job *j, const struct lp_rec *r);
void serve_lp_rec_free(struct lp_rec *r);

/* server/http.c (the HTTP side's files: server/http.h) */
struct MHD_Daemon;
enum { SERVE_MAX_HOSTS = 8 };
struct serve_http { /* the listening daemons, one per --host address */
    struct MHD_Daemon *d[SERVE_MAX_HOSTS];
    int n;
};
/* Listen on each address of hosts (comma-separated IPv4/IPv6 literals, [::1] or localhost) at
** port (0: any free one, the same for all; *bound_port says which).  NULL with the reason printed. */
struct serve_http *serve_http_start(struct server *srv, const char *hosts, int32_t port, int32_t *bound_port);
/* Stop libmicrohttpd once the replies in flight have been sent (at most 30 s for slow clients):
** after SIGTERM the engine finishes every job, but each reply is written by its connection's
** thread afterwards, and stopping the daemon at once would close the connection first. */
void serve_http_stop(struct server *srv, struct serve_http *h);
/* The route table (server/routes.c, the one place that says what the server answers): one line
** per route for --help, or Markdown for docs/API.md. */
void serve_routes_print(FILE *f, bool markdown);
/* docs/API.md: the routes, then every request field of every API (server/fields.c). */
void serve_print_api(FILE *f);

#endif
