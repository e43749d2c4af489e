/* http.c — the HTTP side of `kvtier serve`: libmicrohttpd (one thread per connection), API-key
** checks, the endpoints, JSON and server-sent-event responses.  Request bodies are validated in
** server/request.c, /metrics printed by server/metrics.c.  These threads never touch the engine:
** they queue jobs (server/sched.c) and wait on them. */
#include "fields.h"
#include "serve.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <poll.h>
#include <sys/socket.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

struct req {
    char *body;
    size_t n, cap;
    bool too_big;
    char ns[40];     /* the caller's tenant, from the headers */
    bool authorized; /* the key was checked when the headers arrived */
    /* event-driven connections (see "workers" below): a request that may wait is answered by a
    ** worker thread while its connection is suspended; the reply it made is queued when the
    ** connection is resumed */
    bool in_worker, reply_ready;
    unsigned reply_status;
    struct server *srv;
    struct MHD_Connection *c;
    struct MHD_Response *reply; /* NULL with reply_ready: close the connection (MHD_NO) */
    char *url, *method;         /* copies for the worker */
    /* set by dispatch for the route's handler */
    bool v1, get;        /* the URL had /v1; the method is GET */
    const char *url_now; /* the URL as requested */
};

/* ---------------------------------------------------------------------------------------- */
/* deadlines of connections still sending                                                   */

/* libmicrohttpd's timeout is an idle one: a client sending a byte a minute keeps a connection
** (and, thread per connection, a thread) for hours.  A watchdog thread holds every connection
** to a total deadline for its headers (--header-timeout-s from accept; on a kept-alive
** connection, --idle-timeout-s plus that from the end of the previous reply, since a client's
** pool may leave it unused a while) and for its body (--body-timeout-s, from the end of the
** headers); past it the socket is shut down (shutdown(2) from another thread is safe;
** libmicrohttpd then sees end-of-file and closes the connection itself).  A request being
** answered has no deadline here. */
enum conn_phase { PHASE_HEADERS, PHASE_BODY, PHASE_ANSWER };
struct conn {
    int fd;
    enum conn_phase phase;
    bool kept; /* kept alive after a reply: its next headers may take the idle time too */
    double t0; /* ms, monotonic: start of the phase */
    struct conn *prev, *next;
};
struct conn_watch {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct conn head; /* list sentinel */
    bool stop, started;
    pthread_t thread;
};

static void watch_stop(struct server *srv);

static double mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Length of the longest prefix of s[0..n) made of complete, valid UTF-8 sequences. */
static size_t utf8_prefix(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *) s, *e = p + n, *b = p;
    while (p < e) {
        unsigned c = *p;
        int len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
        if (len == 0 || p + len > e) break;
        bool ok = true;
        for (int k = 1; ok && k < len; k++) ok = (p[k] & 0xC0) == 0x80;
        if (ok && len == 3) ok = !(c == 0xE0 && p[1] < 0xA0) && !(c == 0xED && p[1] >= 0xA0);
        if (ok && len == 4) ok = !(c == 0xF0 && p[1] < 0x90) && !(c == 0xF4 && p[1] >= 0x90);
        if (!ok) break;
        p += len;
    }
    return (size_t) (p - b);
}

static void watch_phase(struct server *srv, struct conn *cn, enum conn_phase phase) {
    if (!cn) return;
    pthread_mutex_lock(&srv->watch->mu);
    if (phase == PHASE_HEADERS) cn->kept = true; /* only completed() goes back to the headers */
    cn->phase = phase;
    cn->t0 = mono_ms();
    pthread_mutex_unlock(&srv->watch->mu);
}

static void *watch_main(void *arg) {
    struct server *srv = arg;
    struct conn_watch *w = srv->watch;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        double now = mono_ms();
        int64_t n_header = 0, n_body = 0;
        for (struct conn *cn = w->head.next; cn != &w->head; cn = cn->next) {
            /* a kept-alive connection waits for the client's next request: the idle timeout's
            ** worth first (clients pool connections), then the header deadline */
            double limit = cn->phase == PHASE_HEADERS ? (srv->lim.header_timeout_s + (cn->kept ? srv->lim.idle_timeout_s : 0)) * 1e3
                           : cn->phase == PHASE_BODY  ? srv->lim.body_timeout_s * 1e3
                                                      : 0;
            if (limit <= 0 || now - cn->t0 <= limit || cn->fd < 0) continue;
            shutdown(cn->fd, SHUT_RDWR);
            cn->fd = -1; /* once */
            if (cn->phase == PHASE_HEADERS) n_header++;
            else n_body++;
        }
        if (n_header || n_body) {
            pthread_mutex_lock(&srv->mu);
            srv->m.closed_header_timeout += n_header;
            srv->m.closed_body_timeout += n_body;
            pthread_mutex_unlock(&srv->mu);
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* libmicrohttpd: a connection was accepted (listening thread) or is being closed, before its
** socket is. */
static void notify_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                              enum MHD_ConnectionNotificationCode code) {
    struct server *srv = cls;
    struct conn_watch *w = srv->watch;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        struct conn *cn = calloc(1, sizeof *cn);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        *socket_context = cn;
        if (!cn) return; /* not watched: the idle timeout still holds it */
        cn->fd = ci ? ci->connect_fd : -1;
        cn->t0 = mono_ms();
        pthread_mutex_lock(&w->mu);
        cn->next = w->head.next;
        cn->prev = &w->head;
        w->head.next->prev = cn;
        w->head.next = cn;
        pthread_mutex_unlock(&w->mu);
        pthread_mutex_lock(&srv->mu);
        srv->m.connections_accepted++;
        pthread_mutex_unlock(&srv->mu);
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        struct conn *cn = *socket_context;
        if (!cn) return;
        pthread_mutex_lock(&w->mu);
        cn->prev->next = cn->next;
        cn->next->prev = cn->prev;
        pthread_mutex_unlock(&w->mu);
        free(cn);
        *socket_context = NULL;
    }
}

/* libmicrohttpd's own messages ("Server reached connection limit", "Failed to create a new
** thread"): a hostile client can make one per connection, so at most one line a second reaches
** stderr, with the count of those held back. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static double t_last;
    static long held;
    (void) cls;
    double now = mono_ms();
    pthread_mutex_lock(&mu);
    if (now - t_last < 1000) {
        held++;
        pthread_mutex_unlock(&mu);
        return;
    }
    t_last = now;
    long h = held;
    held = 0;
    pthread_mutex_unlock(&mu);
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == ' ')) line[--n] = '\0';
    if (h) fprintf(stderr, "kvtier serve: libmicrohttpd: %s (and %ld messages in the last second, not shown)\n", line, h);
    else fprintf(stderr, "kvtier serve: libmicrohttpd: %s\n", line);
}

static struct conn *conn_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* responses                                                                                */

static void count_status(struct server *srv, int status) {
    pthread_mutex_lock(&srv->mu);
    srv->m.requests++;
    if (status >= 100 && status < 600) srv->m.by_status[status / 100]++;
    pthread_mutex_unlock(&srv->mu);
}

/* Is `origin` (a request's Origin header) one --cors-origins allows?  "*" allows any; "localhost"
** in the list allows http(s)://localhost, 127.0.0.1 and [::1] on any port (llama-server's
** keyword); any other entry must equal the origin. */
static bool origin_allowed(const char *list, const char *origin) {
    if (!list || !origin || !*origin) return false;
    for (const char *p = list; *p;) {
        size_t n = strcspn(p, ",");
        while (n && *p == ' ') p++, n--;
        size_t m = n;
        while (m && p[m - 1] == ' ') m--;
        if (m == 1 && *p == '*') return true;
        if (m == 9 && !strncmp(p, "localhost", 9)) {
            const char *h = !strncmp(origin, "http://", 7) ? origin + 7 : !strncmp(origin, "https://", 8) ? origin + 8 : NULL;
            static const char *const loop[] = { "localhost", "127.0.0.1", "[::1]" };
            for (int i = 0; h && i < 3; i++) {
                size_t l = strlen(loop[i]);
                if (!strncmp(h, loop[i], l) &&
                    (h[l] == '\0' || (h[l] == ':' && h[l + 1] && strspn(h + l + 1, "0123456789") == strlen(h + l + 1))))
                    return true;
            }
        } else if (m && strlen(origin) == m && !strncmp(p, origin, m)) return true;
        p += n + (p[n] == ',');
    }
    return false;
}

/* CORS headers of every reply to a browser origin --cors-origins allows (llama-server's). */
static void add_cors(struct server *srv, struct MHD_Connection *c, struct MHD_Response *r) {
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!origin_allowed(srv->cors_origins, origin)) return;
    /* "*" (any page): no credentials, so a browser sends no cookie or HTTP authentication it holds
    ** for this server to a page of any origin; an origin listed by name gets them (issue #38) */
    const bool any = !strcmp(srv->cors_origins, "*");
    MHD_add_response_header(r, "Access-Control-Allow-Origin", any ? "*" : origin);
    if (!any) MHD_add_response_header(r, "Access-Control-Allow-Credentials", "true");
    MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
    MHD_add_response_header(r, "Access-Control-Allow-Headers", "*");
    MHD_add_response_header(r, "Vary", "Origin");
}

/* Where a reply goes: queued on the connection, or, on a worker thread, kept for the handler to
** queue once the connection is resumed (libmicrohttpd queues a response from its handler only). */
struct deferred {
    unsigned status;
    struct MHD_Response *r;
};
static __thread struct deferred *tl_defer; /* set on a worker thread */
static __thread struct stream *tl_stream;  /* a stream the worker goes on producing after its reply */

static enum MHD_Result queue_reply(struct MHD_Connection *c, unsigned status, struct MHD_Response *r) {
    if (tl_defer) {
        if (tl_defer->r) MHD_destroy_response(tl_defer->r);
        tl_defer->status = status;
        tl_defer->r = r;
        return MHD_YES;
    }
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_text(struct server *srv, struct MHD_Connection *c, int status, const char *ctype, char *text,
                                 const char *session_id) {
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    add_cors(srv, c, r);
    if (session_id && *session_id) MHD_add_response_header(r, "X-Session-Id", session_id);
    count_status(srv, status);
    return queue_reply(c, (unsigned) status, r);
}

static enum MHD_Result send_json(struct server *srv, struct MHD_Connection *c, int status, json_t *obj, const char *sid) {
    char *txt = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!txt) return MHD_NO;
    return send_text(srv, c, status, "application/json", txt, sid);
}

/* Every error reply: the server's one error form (serve.h, server/error.c). */
static enum MHD_Result send_err(struct server *srv, struct MHD_Connection *c, const struct serve_error *e) {
    return send_json(srv, c, e->status ? e->status : 500, serve_error_json(e), NULL);
}

/* The same, in Anthropic's shape for /v1/messages. */
static enum MHD_Result send_err_as(struct server *srv, struct MHD_Connection *c, const struct serve_error *e, bool anthropic) {
    if (!anthropic) return send_err(srv, c, e);
    return send_json(srv, c, e->status ? e->status : 500, anth_error(e), NULL);
}

static enum MHD_Result send_error(struct server *srv, struct MHD_Connection *c, int status, const char *type, const char *code,
                                  const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static enum MHD_Result send_error(struct server *srv, struct MHD_Connection *c, int status, const char *type, const char *code,
                                  const char *fmt, ...) {
    struct serve_error e = { 0 };
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.msg, sizeof e.msg, fmt, ap);
    va_end(ap);
    e.status = status;
    e.type = type;
    snprintf(e.code, sizeof e.code, "%s", code ? code : "");
    return send_err(srv, c, &e);
}

#define BAD(...) send_error(srv, c, 400, "invalid_request_error", NULL, __VA_ARGS__)

/* ---------------------------------------------------------------------------------------- */
/* replies                                                                                  */

/* A reply in the chat shape: a chat job, or a chat request with an assistant prefill run as a
** completion (server/request.c). */
static bool chat_shape(const struct job *j) { return j->kind == JOB_CHAT || j->req.prefill; }

static json_t *usage_obj(const struct job *j) {
    json_t *u = json_pack(
        "{s:i, s:i, s:i, s:{s:I, s:I, s:I, s:I, s:I, s:i, s:s, s:s, s:I, s:I, s:I, s:i}}", "prompt_tokens", j->prompt_tokens,
        "completion_tokens", j->completion_tokens, "total_tokens", j->prompt_tokens + j->completion_tokens, "kvtier",
        "prompt_tokens_reused", (json_int_t) j->sync.tokens_reused, "prompt_tokens_decoded", (json_int_t) j->sync.tokens_decoded,
        "evictions", (json_int_t) j->sync.evictions, "recoveries", (json_int_t) j->sync.recoveries, "recomputes",
        (json_int_t) j->sync.recomputes, "resident_tokens", j->resident_tokens, "session_id", j->out_session, "store",
        kvt_route_name(j->sync.route), "prompt_tokens_from_store", (json_int_t) j->sync.tokens_from_store,
        "prompt_tokens_from_chunks", (json_int_t) j->sync.tokens_from_chunks, "prompt_tokens_chunk_recomputed",
        (json_int_t) j->sync.chunk_recompute_tokens, "decode_steps_shared", j->shared_steps);
    json_t *kv = json_object_get(u, "kvtier");
    if (kv && json_array_size(j->req.ignored)) json_object_set(kv, "ignored_fields", j->req.ignored); /* fields no table knows */
    return u;
}

static json_t *final_obj(struct server *srv, const struct job *j) {
    char id[64];
    snprintf(id, sizeof id, "%s-%llu", chat_shape(j) ? "chatcmpl" : "cmpl",
             __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
    json_t *choice;
    if (chat_shape(j)) {
        const char *fin = j->finish;
        json_t *msg = tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
        choice = json_pack("{s:i, s:o, s:s, s:n}", "index", 0, "message", msg, "finish_reason", fin, "logprobs");
    } else {
        char *text = app_utf8_clean(j->text ? j->text : "");
        choice = json_pack("{s:i, s:s, s:s, s:n}", "index", 0, "text", text ? text : "", "finish_reason", j->finish, "logprobs");
        free(text);
    }
    json_t *lps = choice ? serve_logprobs_json(srv, j) : NULL;
    if (lps) json_object_set_new(choice, "logprobs", json_pack("{s:o}", "content", lps));
    json_t *verbose = NULL;
    if (j->req.verbose) { /* llama-server's "__verbose": the prompt as the model saw it */
        char *text = NULL;
        if (j->kind == JOB_CHAT)
            kvt_chat_format(srv->eng, j->req.msgs, j->req.n_msgs, true, kvt_session_default_params().template_fallback, &text);
        char *clean = app_utf8_clean(text ? text : j->req.prompt ? j->req.prompt : "");
        verbose = json_pack("{s:s}", "prompt", clean ? clean : "");
        free(clean);
        free(text);
    }
    json_t *reply = json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", id, "object",
                              chat_shape(j) ? "chat.completion" : "text_completion", "created", (json_int_t) time(NULL), "model",
                              srv->model_name, "choices", choice, "usage", usage_obj(j));
    if (reply && verbose) json_object_set_new(reply, "__verbose", verbose);
    else json_decref(verbose);
    return reply;
}

/* Wait (under srv->mu) until the job satisfies cond. */
#define WAIT_UNTIL(cond)                                     \
    do {                                                     \
        while (!(cond)) pthread_cond_wait(&j->cv, &srv->mu); \
    } while (0)

/* The client closed its end (a recv that peeks at end-of-file or fails)?  A client that sent more
** bytes (pipelining) is still there.  A client that only shut down its sending half after the
** request (legal, rare) looks the same and is taken as gone. */
static bool peer_gone_fd(int fd) {
    if (fd < 0) return false;
    struct pollfd p = { .fd = fd, .events = POLLIN };
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLHUP | POLLERR)) return true;
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* First non-blank byte of the job's text so far, or 0 (under srv->mu). */
static char first_char(const struct job *j) {
    for (size_t i = 0; j->text && i < j->n_text; i++)
        if (!strchr(" \t\r\n", j->text[i])) return j->text[i];
    return 0;
}

/* Wait (under srv->mu) for a job to finish, or with until_first_char only until its text has a
** non-blank byte, checking every 100 ms that the client is still connected (nothing is written
** meanwhile): one that went away cancels the job at its next token (as a dropped stream does), so
** its slot is not held to max_tokens for nobody. */
static int conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

/* fd: the client's socket (a connection's own while it cannot close under us, or a stream's dup). */
static void wait_watching_for(struct server *srv, int fd, struct job *j, bool until_first_char) {
    while (j->state != JOB_DONE && !(until_first_char && first_char(j))) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&j->cv, &srv->mu, &ts);
        if (j->state != JOB_DONE && !j->cancelled && peer_gone_fd(fd)) j->cancelled = true;
    }
}

static void wait_watching(struct server *srv, struct MHD_Connection *c, struct job *j) {
    wait_watching_for(srv, conn_fd(c), j, false);
}

struct stream {
    struct server *srv;
    struct MHD_Connection *c; /* the connection (event-driven: resumed when bytes are produced) */
    int peer_fd;              /* a dup of the client's socket: to notice a client that leaves while
                              ** nothing is sent (the connection may be gone when it is read) */
    struct job *j;
    /* event-driven: the worker produces the events (stream_read, which waits for the job) into q;
    ** libmicrohttpd's thread takes them (stream_take), suspending the connection when q is empty */
    pthread_mutex_t qmu;
    char *q;
    size_t q_n, q_off, q_cap;
    bool eof, closed, suspended;
    int refs; /* the response's and the producer's (event-driven); under qmu */
    char id[64];
    int phase;      /* 0 role chunk, 1 content, 2 done */
    int tools_text; /* a reply under tools: -1 not known yet, 1 plain text (streamed),
                               ** 0 a call or JSON (sent whole) */
    char *out;      /* pending bytes */
    size_t n_out, off;
    int a_open;               /* Anthropic: index of the content block open (-1 none) */
    int a_next;               /* Anthropic: the next block's index */
    int r_seq;                /* Responses: the next event's sequence_number */
    int r_items;              /* Responses: output items announced so far */
    bool r_open;              /* Responses: the message item's output_text part is open */
    char r_item[48];          /* Responses: the message item's id */
    json_t *r_timings;        /* Responses with timings_per_token: the timings the next output_text delta carries (borrowed) */
    json_t *r_msg, *r_output; /* Responses: a reply sent whole (under tools): its message and items, kept
                              ** so that the final response names the same call ids */
};

static void stream_emit(struct stream *st, json_t *obj) {
    char *txt = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!txt) return;
    size_t n = strlen(txt);
    char *o = realloc(st->out, st->n_out + n + 9);
    if (o) {
        st->out = o;
        memcpy(o + st->n_out, "data: ", 6);
        memcpy(o + st->n_out + 6, txt, n);
        memcpy(o + st->n_out + 6 + n, "\n\n", 3);
        st->n_out += n + 8;
    }
    free(txt);
}

/* An Anthropic event: "event: TYPE" and its data (obj's "type"). */
static void stream_event(struct stream *st, json_t *obj) {
    const char *type = obj ? json_string_value(json_object_get(obj, "type")) : NULL;
    char line[64];
    int n = snprintf(line, sizeof line, "event: %s\n", type ? type : "error");
    char *o = realloc(st->out, st->n_out + (size_t) n + 1);
    if (!o) {
        json_decref(obj);
        return;
    }
    st->out = o;
    memcpy(o + st->n_out, line, (size_t) n);
    st->n_out += (size_t) n;
    stream_emit(st, obj);
}

static void anth_close_block(struct stream *st) {
    if (st->a_open < 0) return;
    stream_event(st, json_pack("{s:s, s:i}", "type", "content_block_stop", "index", st->a_open));
    st->a_open = -1;
}

/* Anthropic: text as a text_delta of the open text block (opened first if needed). */
static void anth_text(struct stream *st, const char *text) {
    if (st->a_open < 0) {
        st->a_open = st->a_next++;
        stream_event(st, json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_start", "index", st->a_open, "content_block",
                                   "type", "text", "text", ""));
    }
    stream_event(st, json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_delta", "index", st->a_open, "delta", "type",
                               "text_delta", "text", text));
}

/* Anthropic: a whole reply under tools, as its blocks (text, then each tool_use with its input
** as one input_json_delta). */
static void anth_whole(struct stream *st, const json_t *msg) {
    json_t *blocks = anth_blocks(msg);
    size_t i;
    json_t *b;
    json_array_foreach(blocks, i, b) {
        const char *type = json_string_value(json_object_get(b, "type"));
        if (!strcmp(type, "text")) {
            anth_text(st, json_string_value(json_object_get(b, "text")));
            continue;
        }
        anth_close_block(st);
        int idx = st->a_next++;
        char *input = json_dumps(json_object_get(b, "input"), JSON_COMPACT);
        stream_event(st,
                     json_pack("{s:s, s:i, s:{s:s, s:O, s:O, s:{}}}", "type", "content_block_start", "index", idx, "content_block",
                               "type", "tool_use", "id", json_object_get(b, "id"), "name", json_object_get(b, "name"), "input"));
        stream_event(st, json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_delta", "index", idx, "delta", "type",
                                   "input_json_delta", "partial_json", input ? input : "{}"));
        free(input);
        stream_event(st, json_pack("{s:s, s:i}", "type", "content_block_stop", "index", idx));
    }
    json_decref(blocks);
}

/* A Responses event: "event: TYPE", and its data with the next sequence_number. */
static void resp_event(struct stream *st, json_t *obj) {
    if (obj) json_object_set_new(obj, "sequence_number", json_integer(st->r_seq++));
    stream_event(st, obj);
}

static json_t *resp_msg_item(struct stream *st, const char *status, const char *text) {
    json_t *content = json_array();
    if (text) json_array_append_new(content, json_pack("{s:s, s:s, s:[]}", "type", "output_text", "text", text, "annotations"));
    return json_pack("{s:s, s:s, s:s, s:s, s:o}", "type", "message", "id", st->r_item, "status", status, "role", "assistant",
                     "content", content);
}

/* Responses: text as an output_text delta of the message item (announced first if needed). */
static void resp_text(struct stream *st, const char *text) {
    if (!st->r_open) {
        st->r_open = true;
        resp_event(st, json_pack("{s:s, s:i, s:o}", "type", "response.output_item.added", "output_index", st->r_items, "item",
                                 resp_msg_item(st, "in_progress", NULL)));
        resp_event(st, json_pack("{s:s, s:s, s:i, s:i, s:{s:s, s:s, s:[]}}", "type", "response.content_part.added", "item_id",
                                 st->r_item, "output_index", st->r_items, "content_index", 0, "part", "type", "output_text", "text",
                                 "", "annotations"));
    }
    json_t *ev = json_pack("{s:s, s:s, s:i, s:i, s:s, s:[]}", "type", "response.output_text.delta", "item_id", st->r_item,
                           "output_index", st->r_items, "content_index", 0, "delta", text, "logprobs");
    if (ev && st->r_timings) json_object_set(ev, "timings", st->r_timings);
    resp_event(st, ev);
}

/* Responses: the message item's end (its whole text), if it was opened. */
static void resp_text_done(struct stream *st, const char *text) {
    if (!st->r_open) return;
    st->r_open = false;
    resp_event(st, json_pack("{s:s, s:s, s:i, s:i, s:s, s:[]}", "type", "response.output_text.done", "item_id", st->r_item,
                             "output_index", st->r_items, "content_index", 0, "text", text, "logprobs"));
    resp_event(st, json_pack("{s:s, s:s, s:i, s:i, s:{s:s, s:s, s:[]}}", "type", "response.content_part.done", "item_id",
                             st->r_item, "output_index", st->r_items, "content_index", 0, "part", "type", "output_text", "text",
                             text, "annotations"));
    resp_event(st, json_pack("{s:s, s:i, s:o}", "type", "response.output_item.done", "output_index", st->r_items, "item",
                             resp_msg_item(st, "completed", text)));
    st->r_items++;
}

/* Responses: the reply's output items that were not streamed as text (function calls, or a
** reply under tools sent whole), each announced, its arguments or text, and done. */
static void resp_items(struct stream *st, json_t *output) {
    size_t i;
    json_t *it;
    json_array_foreach(output, i, it) {
        const char *type = json_string_value(json_object_get(it, "type"));
        if (!strcmp(type, "message")) {
            if (st->r_open) continue; /* streamed already */
            const char *text = json_string_value(json_object_get(json_array_get(json_object_get(it, "content"), 0), "text"));
            resp_text(st, text ? text : "");
            resp_text_done(st, text ? text : "");
            continue;
        }
        json_t *added = json_deep_copy(it);
        json_object_set_new(added, "arguments", json_string(""));
        json_object_set_new(added, "status", json_string("in_progress"));
        resp_event(st,
                   json_pack("{s:s, s:i, s:o}", "type", "response.output_item.added", "output_index", st->r_items, "item", added));
        resp_event(st,
                   json_pack("{s:s, s:O, s:i, s:O}", "type", "response.function_call_arguments.delta", "item_id",
                             json_object_get(it, "id"), "output_index", st->r_items, "delta", json_object_get(it, "arguments")));
        resp_event(st, json_pack("{s:s, s:O, s:i, s:O, s:O}", "type", "response.function_call_arguments.done", "item_id",
                                 json_object_get(it, "id"), "output_index", st->r_items, "arguments",
                                 json_object_get(it, "arguments"), "name", json_object_get(it, "name")));
        resp_event(st, json_pack("{s:s, s:i, s:O}", "type", "response.output_item.done", "output_index", st->r_items, "item", it));
        st->r_items++;
    }
}

/* delta: the chat delta to send as is (stolen), else built from role/content. */
static json_t *chunk_delta(struct stream *st, json_t *delta, const char *content, const char *finish, bool role) {
    const struct job *j = st->j;
    json_t *choice;
    if (chat_shape(j)) {
        if (!delta) {
            delta = json_object();
            if (role) json_object_set_new(delta, "role", json_string("assistant"));
            if (content) json_object_set_new(delta, "content", json_string(content));
            else if (role) json_object_set_new(delta, "content", json_null()); /* the role chunk: no text yet */
        }
        choice = json_pack("{s:i, s:o, s:o, s:n}", "index", 0, "delta", delta, "finish_reason",
                           finish ? json_string(finish) : json_null(), "logprobs");
    } else {
        choice = json_pack("{s:i, s:s, s:o, s:n}", "index", 0, "text", content ? content : "", "finish_reason",
                           finish ? json_string(finish) : json_null(), "logprobs");
    }
    return json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", st->id, "object",
                     chat_shape(j) ? "chat.completion.chunk" : "text_completion", "created", (json_int_t) time(NULL), "model",
                     st->srv->model_name, "choices", choice);
}

static json_t *chunk(struct stream *st, const char *content, const char *finish, bool role) {
    if (st->j->req.native) return compat_native_reply(st->srv, st->j, content ? content : "", false, 0);
    return chunk_delta(st, NULL, content, finish, role);
}

/* return_progress: one prompt-progress event (llama-server's): a chunk with no text carrying
** "prompt_progress" (and "timings" with timings_per_token); in the Responses API a
** response.in_progress event. */
static void progress_event(struct stream *st, const struct prompt_progress *p) {
    const struct job *j = st->j;
    json_t *pp = json_pack("{s:i, s:i, s:i, s:I}", "total", p->total, "cache", p->cache, "processed", p->processed, "time_ms",
                           (json_int_t) p->time_ms);
    json_t *ev;
    if (j->req.responses)
        ev = json_pack("{s:s, s:{s:s, s:s, s:s}}", "type", "response.in_progress", "response", "id", j->req.resp_id, "object",
                       "response", "status", "in_progress");
    else ev = chunk(st, chat_shape(j) ? NULL : "", NULL, chat_shape(j)); /* a chat's carries the role */
    if (ev && pp) json_object_set(ev, "prompt_progress", pp);
    if (ev && j->req.timings) json_object_set_new(ev, "timings", compat_progress_timings(p));
    json_decref(pp);
    if (j->req.responses) resp_event(st, ev);
    else stream_emit(st, ev);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    struct stream *st = cls;
    struct server *srv = st->srv;
    struct job *j = st->j;
    (void) pos;
    while (st->off == st->n_out) {
        st->off = st->n_out = 0;
        if (st->phase == 3) return MHD_CONTENT_READER_END_OF_STREAM;
        if (st->phase == 0) {
            st->phase = 1;
            if (j->req.responses) {
                json_t *r0 = resp_object(srv, NULL, j->req.resp_id, j->req.resp_parent, NULL, "in_progress");
                resp_event(st, json_pack("{s:s, s:o}", "type", "response.created", "response", json_deep_copy(r0)));
                resp_event(st, json_pack("{s:s, s:o}", "type", "response.in_progress", "response", r0));
                continue;
            }
            if (j->req.anthropic) {
                pthread_mutex_lock(&srv->mu);
                json_t *m = anth_message(srv, j, NULL, NULL);
                pthread_mutex_unlock(&srv->mu);
                stream_event(st, json_pack("{s:s, s:o}", "type", "message_start", "message", m));
                continue;
            }
            if (chat_shape(j) && !j->req.return_progress) { /* with progress, each progress chunk carries the role */
                stream_emit(st, chunk(st, NULL, NULL, true));
                continue;
            }
        }
        if (j->req.return_progress && !j->req.anthropic) { /* the progress events, all before the reply's text */
            pthread_mutex_lock(&srv->mu);
            WAIT_UNTIL(j->state == JOB_DONE || j->started || j->n_prog > j->n_prog_sent);
            const bool have = j->n_prog > j->n_prog_sent;
            struct prompt_progress p = { 0 };
            if (have) p = j->prog[j->n_prog_sent++];
            pthread_mutex_unlock(&srv->mu);
            if (have) {
                progress_event(st, &p);
                continue;
            }
        }
        /* a tool-call reply is one JSON object: parsed and sent whole when it is complete.  Under
        ** tool_choice auto the reply's first character chooses (server/tools.c): '{' a call (or
        ** the JSON reply format), anything else plain text, streamed as it comes like any reply */
        bool whole = false;
        pthread_mutex_lock(&srv->mu);
        if (chat_shape(j) && j->req.format == REPLY_TOOLS && st->tools_text <= 0) {
            if (st->tools_text < 0) {
                wait_watching_for(srv, st->peer_fd, j, true);
                const char c0 = first_char(j);
                st->tools_text = c0 && c0 != '{';
            }
            whole = !st->tools_text;
        }
        if (whole) wait_watching_for(srv, st->peer_fd, j, false); /* nothing is written meanwhile: watch the socket */
        else WAIT_UNTIL(j->state == JOB_DONE || j->n_text > j->n_sent);
        bool done = j->state == JOB_DONE;
        const char *fin = j->finish;
        if (whole) {
            pthread_mutex_unlock(&srv->mu);
            if (!(j->err.status && j->err.status != 200)) {
                json_t *msg = tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
                if (msg && j->req.responses) {
                    st->r_output = resp_output(srv, msg, st->r_item);
                    st->r_msg = msg;
                    resp_items(st, st->r_output);
                } else if (msg && j->req.anthropic) {
                    anth_whole(st, msg);
                    json_decref(msg);
                } else if (msg) {
                    json_object_del(msg, "role");
                    if (json_is_null(json_object_get(msg, "content"))) json_object_del(msg, "content");
                    stream_emit(st, chunk_delta(st, msg, NULL, NULL, false));
                }
            }
            pthread_mutex_lock(&srv->mu);
            j->n_sent = j->text ? strlen(j->text) : 0;
        }
        size_t upto = done ? (j->text ? strlen(j->text) : 0) : j->n_text;
        size_t ok = upto > j->n_sent ? utf8_prefix(j->text + j->n_sent, upto - j->n_sent) : 0;
        char *piece = NULL;
        if (done && upto > j->n_sent) { /* the rest, bad bytes replaced */
            char *rest = strndup(j->text + j->n_sent, upto - j->n_sent);
            piece = rest ? app_utf8_clean(rest) : NULL;
            free(rest);
            j->n_sent = upto;
        } else if (ok > 0) {
            piece = strndup(j->text + j->n_sent, ok);
            j->n_sent += ok;
        }
        /* timings_per_token: every piece carries the timings so far */
        json_t *tm = j->req.timings && ((piece && *piece) || done) ? compat_timings(j, mono_ms()) : NULL;
        /* streamed logprobs: the ids and ln p of the tokens generated since the last piece, copied
        ** here; their entries built below, outside the lock (the engine thread builds no JSON) */
        struct lp_rec lr = { 0 };
        if (j->n_lp_ready > j->n_lp_sent && ((piece && *piece) || done)) serve_logprobs_take(j, &lr);
        pthread_mutex_unlock(&srv->mu);
        json_t *lps = lr.n ? serve_logprobs_entries(srv, j, &lr) : NULL;
        serve_lp_rec_free(&lr);
        if ((piece && *piece) || lps) {
            if (j->req.anthropic) {
                if (piece && *piece) anth_text(st, piece);
            } else if (j->req.responses) {
                st->r_timings = tm;
                if (piece && *piece) resp_text(st, piece);
                st->r_timings = NULL;
            } else {
                json_t *ch = chunk(st, piece ? piece : "", NULL, false);
                if (ch && tm) json_object_set(ch, "timings", tm);
                if (ch && lps && j->req.native) json_object_set(ch, "completion_probabilities", lps);
                else if (ch && lps)
                    json_object_set_new(json_array_get(json_object_get(ch, "choices"), 0), "logprobs",
                                        json_pack("{s:O}", "content", lps));
                stream_emit(st, ch);
            }
        }
        json_decref(lps);
        json_decref(tm);
        free(piece);
        if (!done) {
            if (st->n_out == 0) { /* an incomplete UTF-8 character: wait for more */
                pthread_mutex_lock(&srv->mu);
                size_t seen = j->n_text;
                WAIT_UNTIL(j->state == JOB_DONE || j->n_text != seen);
                pthread_mutex_unlock(&srv->mu);
            }
            continue;
        }
        if (j->req.responses) {
            if (j->err.status && j->err.status != 200) {
                json_t *err = serve_error_json(&j->err), *eo = json_object_get(err, "error");
                json_object_set_new(eo, "type", json_string("error"));
                resp_event(st, json_incref(eo));
                json_decref(err);
            } else {
                json_t *msg = st->r_msg ? json_incref(st->r_msg) : tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
                json_t *output = st->r_output ? json_incref(st->r_output) : resp_output(srv, msg, st->r_item);
                if (st->r_msg && !strcmp(fin ? fin : "", "stop") && json_array_size(json_object_get(msg, "tool_calls")))
                    fin = "tool_calls";
                if (st->r_open) { /* the text streamed: its whole, cleaned */
                    const json_t *t = json_object_get(json_array_get(json_object_get(json_array_get(output, 0), "content"), 0),
                                                      "text");
                    resp_text_done(st, json_is_string(t) ? json_string_value(t) : "");
                } else if (j->req.format != REPLY_TOOLS || st->tools_text > 0) resp_items(st, output);
                const char *status = !strcmp(fin ? fin : "", "length") ? "incomplete" : "completed";
                json_t *obj = resp_object(srv, j, j->req.resp_id, j->req.resp_parent, output, status);
                if (j->req.resp_store && msg && obj)
                    resp_store(srv, j->req.ns, j->req.resp_id, j->req.resp_parent, j->req.resp_turn, msg, obj);
                json_t *ev = json_pack("{s:s, s:o}", "type",
                                       !strcmp(status, "completed") ? "response.completed" : "response.incomplete", "response",
                                       obj);
                if (ev && j->req.timings) json_object_set_new(ev, "timings", compat_timings(j, mono_ms()));
                resp_event(st, ev);
                json_decref(msg);
            }
            st->phase = 3;
            continue;
        }
        if (j->err.status && j->err.status != 200 && j->req.anthropic) {
            stream_event(st, anth_error(&j->err));
            st->phase = 3;
            continue;
        } else if (j->err.status && j->err.status != 200) {
            stream_emit(st, serve_error_json(&j->err));
        } else if (j->req.anthropic) { /* the last block closed, the stop reason, message_stop */
            if (st->a_next == 0) anth_text(st, "");
            anth_close_block(st);
            stream_event(st, json_pack("{s:s, s:{s:s, s:n}, s:o}", "type", "message_delta", "delta", "stop_reason",
                                       anth_stop_reason(j, fin), "stop_sequence", "usage", anth_usage(j, true)));
            stream_event(st, json_pack("{s:s}", "type", "message_stop"));
            st->phase = 3;
            continue;
        } else if (j->req.native) { /* llama.cpp's last event: stop true, the timings; no [DONE] */
            stream_emit(st, compat_native_reply(srv, j, "", true, mono_ms()));
            st->phase = 3;
            continue;
        } else {
            stream_emit(st, chunk(st, NULL, fin, false));
            if (j->req.include_usage) {
                json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", st->id, "object",
                                      chat_shape(j) ? "chat.completion.chunk" : "text_completion", "created",
                                      (json_int_t) time(NULL), "model", srv->model_name, "choices", "usage", usage_obj(j));
                if (u && j->req.timings) json_object_set_new(u, "timings", compat_timings(j, mono_ms()));
                stream_emit(st, u);
            }
        }
        char *o = realloc(st->out, st->n_out + 15);
        if (o) {
            st->out = o;
            memcpy(o + st->n_out, "data: [DONE]\n\n", 15);
            st->n_out += 14;
        }
        st->phase = 3;
    }
    size_t n = KVT_MIN(max, st->n_out - st->off);
    memcpy(buf, st->out + st->off, n);
    st->off += n;
    return (ssize_t) n;
}

static void stream_unref(struct stream *st) {
    pthread_mutex_lock(&st->qmu);
    const bool last = --st->refs == 0;
    pthread_mutex_unlock(&st->qmu);
    if (!last) return;
    serve_job_release(st->srv, st->j);
    json_decref(st->r_msg);
    json_decref(st->r_output);
    if (st->peer_fd >= 0) close(st->peer_fd);
    pthread_mutex_destroy(&st->qmu);
    free(st->q);
    free(st->out);
    free(st);
}

/* libmicrohttpd is done with the response: the stream ended, or the connection is gone (a job
** still running is cancelled at once). */
static void stream_free(void *cls) {
    struct stream *st = cls;
    pthread_mutex_lock(&st->srv->mu);
    if (st->j->state != JOB_DONE) st->j->cancelled = true;
    pthread_mutex_unlock(&st->srv->mu);
    pthread_mutex_lock(&st->qmu);
    st->closed = true;
    pthread_mutex_unlock(&st->qmu);
    stream_unref(st);
}

/* Event-driven: libmicrohttpd's thread takes what the producer wrote; with nothing there the
** connection is suspended (no thread waits for it) until the producer resumes it. */
static ssize_t stream_take(void *cls, uint64_t pos, char *buf, size_t max) {
    struct stream *st = cls;
    (void) pos;
    pthread_mutex_lock(&st->qmu);
    if (st->q_off < st->q_n) {
        size_t n = KVT_MIN(max, st->q_n - st->q_off);
        memcpy(buf, st->q + st->q_off, n);
        st->q_off += n;
        if (st->q_off == st->q_n) st->q_off = st->q_n = 0;
        pthread_mutex_unlock(&st->qmu);
        return (ssize_t) n;
    }
    if (st->eof) {
        pthread_mutex_unlock(&st->qmu);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    st->suspended = true;
    MHD_suspend_connection(st->c);
    pthread_mutex_unlock(&st->qmu);
    return 0;
}

/* Event-driven: the worker thread produces the stream's events (stream_read waits for the job)
** until it ends or the connection is gone, resuming the connection whenever it wrote some. */
static void stream_produce(struct stream *st) {
    char buf[4096];
    for (;;) {
        ssize_t n = stream_read(st, 0, buf, sizeof buf);
        bool end = n < 0 || n == (ssize_t) MHD_CONTENT_READER_END_OF_STREAM;
        pthread_mutex_lock(&st->qmu);
        if (!end && n > 0 && !st->closed) {
            if (st->q_n + (size_t) n > st->q_cap) {
                size_t cap = KVT_MAX(2 * st->q_cap, st->q_n + (size_t) n + 4096);
                char *q = realloc(st->q, cap);
                if (q) {
                    st->q = q;
                    st->q_cap = cap;
                } else end = true; /* out of memory: the stream ends here */
            }
            if (!end) {
                memcpy(st->q + st->q_n, buf, (size_t) n);
                st->q_n += (size_t) n;
            }
        }
        if (end) st->eof = true;
        /* suspended: libmicrohttpd cannot close the connection meanwhile, so it is resumed after
        ** qmu is let go (never with a lock of ours held) */
        const bool wake = st->suspended && !st->closed;
        if (wake) st->suspended = false;
        const bool stop = end || st->closed;
        pthread_mutex_unlock(&st->qmu);
        if (wake) MHD_resume_connection(st->c);
        if (stop) break;
    }
    stream_unref(st);
}

static enum MHD_Result run_job(struct server *srv, struct MHD_Connection *c, struct job *j) {
    j->req.t_arrival = mono_ms();
    if (srv->lim.request_timeout_s > 0) j->req.deadline = j->req.t_arrival + srv->lim.request_timeout_s * 1e3;
    pthread_cond_init(&j->cv, NULL);
    int q = serve_submit(srv, j);
    if (q) {
        serve_job_free(j);
        if (q == 429)
            return send_error(srv, c, 429, "rate_limit_error", "queue_full", "the request queue is full (%d waiting); retry later",
                              srv->max_queue);
        if (q == 430)
            return send_error(srv, c, 429, "rate_limit_error", "queue_share_full",
                              "this API key has %d requests waiting, its share of the queue (--queue-per-key); retry later",
                              srv->queue_per_key);
        return send_error(srv, c, 503, "server_error", NULL, "the server is shutting down");
    }
    pthread_mutex_lock(&srv->mu);
    /* prompt accepted (or, with return_progress, its prefill begun): the headers can go */
    if (j->req.stream) WAIT_UNTIL(j->state == JOB_DONE || j->started || j->n_prog > 0);
    else wait_watching(srv, c, j);
    bool failed = j->state == JOB_DONE && j->err.status && j->err.status != 200;
    pthread_mutex_unlock(&srv->mu);
    if (failed) {
        enum MHD_Result r = send_err_as(srv, c, &j->err, j->req.anthropic);
        serve_job_release(srv, j);
        return r;
    }
    if (!j->req.stream) {
        json_t *reply;
        if (j->req.responses) {
            const char *fin = j->finish;
            json_t *msg = tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
            char item[48];
            snprintf(item, sizeof item, "msg_%llu", __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
            reply = resp_object(srv, j, j->req.resp_id, j->req.resp_parent, resp_output(srv, msg, item),
                                !strcmp(fin ? fin : "", "length") ? "incomplete" : "completed");
            if (j->req.resp_store && msg && reply)
                resp_store(srv, j->req.ns, j->req.resp_id, j->req.resp_parent, j->req.resp_turn, msg, reply);
            json_decref(msg);
        } else if (j->req.anthropic) {
            const char *fin = j->finish;
            json_t *msg = tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
            reply = anth_message(srv, j, msg, fin ? fin : "stop");
            json_decref(msg);
        } else
            reply = j->req.native ? compat_response_fields(j, compat_native_reply(srv, j, j->text ? j->text : "", true, mono_ms()))
                                  : final_obj(srv, j);
        enum MHD_Result r = send_json(srv, c, 200, reply, j->out_session);
        serve_job_release(srv, j);
        return r;
    }
    struct stream *st = calloc(1, sizeof *st);
    if (!st) {
        serve_job_release(srv, j);
        return MHD_NO;
    }
    st->srv = srv;
    st->c = c;
    st->j = j;
    st->peer_fd = dup(conn_fd(c));
    pthread_mutex_init(&st->qmu, NULL);
    st->refs = tl_defer ? 2 : 1; /* on a worker: the response's and the producer's */
    st->tools_text = -1;
    st->a_open = -1;
    snprintf(st->r_item, sizeof st->r_item, "msg_%llu", __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
    snprintf(st->id, sizeof st->id, "%s-%llu", chat_shape(j) ? "chatcmpl" : "cmpl",
             __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
    const bool produced = tl_defer != NULL;
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, produced ? stream_take : stream_read, st,
                                                               stream_free);
    if (!r) {
        if (produced) stream_unref(st);
        stream_free(st);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    add_cors(srv, c, r);
    pthread_mutex_lock(&srv->mu);
    if (j->out_session[0]) MHD_add_response_header(r, "X-Session-Id", j->out_session);
    pthread_mutex_unlock(&srv->mu);
    count_status(srv, 200);
    if (produced) tl_stream = st; /* the worker produces it once the reply is handed over */
    return queue_reply(c, 200, r);
}

/* ---------------------------------------------------------------------------------------- */
/* endpoints                                                                                */

/* The request body as a JSON object (*root, a new reference), or the error reply already queued
** (*root NULL; the return value is the reply's). */
static enum MHD_Result body_json(struct server *srv, struct MHD_Connection *c, struct req *rq, json_t **root) {
    *root = NULL;
    if (rq->too_big)
        return send_error(srv, c, 413, "invalid_request_error", "request_too_large",
                          "the request body is over the limit of %lld bytes (--max-body-mb)", (long long) srv->lim.max_body);
    size_t ok = utf8_prefix(rq->body ? rq->body : "", rq->n);
    if (ok < rq->n) return BAD("the request body is not valid UTF-8 (byte %zu)", ok);
    json_error_t je;
    json_t *r = json_loadb(rq->body ? rq->body : "", rq->n, 0, &je);
    if (!r) return BAD("the request body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    if (!json_is_object(r)) {
        enum MHD_Result ret = BAD("the request body must be a JSON object, got %s", serve_json_type(r));
        json_decref(r);
        return ret;
    }
    *root = r;
    return MHD_YES;
}

enum api { API_OPENAI, API_NATIVE, API_ANTHROPIC, API_RESPONSES };

static enum MHD_Result post_native_batch(struct server *srv, struct MHD_Connection *c, const char *ns, json_t *root);
static enum MHD_Result post_choices(struct server *srv, struct MHD_Connection *c, const char *ns, const char *sid, json_t *root,
                                    bool chat, int n);
static size_t run_jobs(struct server *srv, struct MHD_Connection *c, struct job **jobs, size_t n, struct serve_error *e);

/* api: OpenAI's, llama.cpp's native /completion (its fields, reply and stream shapes) or
** Anthropic's Messages (translated into a chat request, server/anthropic.c). */
static enum MHD_Result post_generate(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *ns, bool chat,
                                     enum api api) {
    json_t *root;
    enum MHD_Result bad = body_json(srv, c, rq, &root);
    if (!root) return bad;
    struct serve_error e = { 0 };
    json_t *turn = NULL, *ignored = NULL;
    char parent[48] = "";
    bool store = true;
    if (api == API_RESPONSES) {
        json_t *tr = NULL, *sv = json_object_get(root, "store");
        store = !json_is_false(sv);
        int trc = resp_to_chat(srv, ns, root, &tr, &turn, parent, sizeof parent, &ignored, &e);
        json_decref(root);
        if (trc) {
            json_decref(ignored);
            return send_err(srv, c, &e);
        }
        root = tr;
    } else if (api == API_ANTHROPIC) {
        json_t *tr = NULL;
        int trc = anth_to_chat(root, &srv->lim, &tr, &ignored, &e);
        json_decref(root);
        if (trc) {
            json_decref(ignored);
            return send_err_as(srv, c, &e, true);
        }
        root = tr;
    }
    struct job *j = calloc(1, sizeof *j);
    if (!j) {
        json_decref(root);
        json_decref(turn);
        json_decref(ignored);
        return MHD_NO;
    }
    j->req.ignored = ignored; /* the translator's unknown fields (Responses, Anthropic) */
    j->kind = chat ? JOB_CHAT : JOB_COMPLETION;
    j->req.anthropic = api == API_ANTHROPIC;
    if ((j->req.responses = api == API_RESPONSES)) {
        j->req.resp_turn = turn;
        j->req.resp_store = store;
        snprintf(j->req.resp_parent, sizeof j->req.resp_parent, "%s", parent);
        resp_new_id(j->req.resp_id, sizeof j->req.resp_id);
    }
    snprintf(j->req.ns, sizeof j->req.ns, "%s", ns);
    const char *sid = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Session-Id");
    if (sid) snprintf(j->req.session_id, sizeof j->req.session_id, "%s", sid);
    /* llama-server's id_slot N (without the header): the session "slot-N", whose KV stays between
    ** the requests that name it, as slot N's does (-1: chosen by prefix, as without it) */
    const json_t *slot = api == API_OPENAI || api == API_NATIVE ? json_object_get(root, "id_slot") : NULL;
    if (!sid && json_is_integer(slot) && json_integer_value(slot) >= 0)
        snprintf(j->req.session_id, sizeof j->req.session_id, "slot-%lld", (long long) json_integer_value(slot));
    const json_t *pr = api == API_NATIVE ? json_object_get(root, "prompt") : NULL;
    bool batch = json_array_size(pr) > 1;
    for (size_t i = 0; batch && i < json_array_size(pr); i++) batch = !json_is_integer(json_array_get(pr, i));
    if (batch) { /* several prompts (no id among them: ids and texts mixed are one sequence) */
        free(j);
        return post_native_batch(srv, c, ns, root);
    }
    const json_t *nv = api == API_OPENAI ? json_object_get(root, "n") : NULL;
    if (json_is_integer(nv) && json_integer_value(nv) > 1 && json_integer_value(nv) <= SERVE_MAX_CHOICES) {
        free(j);
        return post_choices(srv, c, ns, sid, root, chat, (int) json_integer_value(nv));
    }
    int rc = api == API_NATIVE ? compat_native_params(srv, root, j, &e) : 0;
    if (rc == 0) rc = serve_request_parse(srv, root, j, chat, &e);
    json_decref(root);
    if (rc) {
        pthread_cond_init(&j->cv, NULL);
        serve_job_free(j);
        if (!e.status) serve_error_oom(&e); /* a failure that said nothing: an allocation */
        return send_err_as(srv, c, &e, api == API_ANTHROPIC);
    }
    return run_job(srv, c, j);
}

enum { BATCH_MAX = 16 };

/* llama.cpp's batch completion: "prompt" holding several prompts (texts, id lists or
** {prompt_string} objects) on /completion answers a list, one reply per prompt, each prompt a
** job of its own run side by side.  Not streamed. */
static enum MHD_Result post_native_batch(struct server *srv, struct MHD_Connection *c, const char *ns, json_t *root) {
    json_t *prompts = json_object_get(root, "prompt");
    size_t k = json_array_size(prompts);
    struct serve_error e = { 0 };
    serve_error_param(&e, "prompt");
    /* its jobs wait in the queue together: more than one API key may queue never fits (a 400, as
    ** for n; a 429 would say retry to a request that cannot succeed) */
    const int32_t cap = KVT_MIN(srv->max_queue, srv->queue_per_key);
    if (k > BATCH_MAX) serve_bad(&e, "'prompt' holds %zu prompts; at most %d in one request", k, BATCH_MAX);
    else if (k > (size_t) cap)
        serve_bad(&e, "'prompt' holds %zu prompts, more than this server queues at once for one API key (%d, --queue%s)", k, cap,
                  srv->queue_per_key < srv->max_queue ? "-per-key" : "");
    else if (json_is_true(json_object_get(root, "stream"))) serve_bad(&e, "several prompts in one request are not streamed");
    struct job *jobs[BATCH_MAX] = { 0 };
    size_t n = 0;
    for (; !e.status && n < k; n++) {
        json_t *one = json_copy(root);
        struct job *j = calloc(1, sizeof *j);
        if (one) json_object_set(one, "prompt", json_array_get(prompts, n));
        if (!one || !j) {
            json_decref(one);
            free(j);
            serve_error_oom(&e);
            break;
        }
        jobs[n] = j;
        j->kind = JOB_COMPLETION;
        snprintf(j->req.ns, sizeof j->req.ns, "%s", ns);
        pthread_cond_init(&j->cv, NULL);
        if (compat_native_params(srv, one, j, &e) == 0) serve_request_parse(srv, one, j, false, &e);
        json_decref(one);
    }
    json_decref(root);
    size_t submitted = e.status ? 0 : run_jobs(srv, c, jobs, n, &e);
    json_t *out = e.status ? NULL : json_array();
    for (size_t i = 0; i < n; i++) {
        struct job *j = jobs[i];
        if (!j) continue;
        if (i >= submitted) { /* parsed, never queued */
            serve_job_free(j);
            continue;
        }
        if (!e.status && out) {
            json_t *r = compat_native_reply(srv, j, "", true, mono_ms());
            char *clean = app_utf8_clean(j->text ? j->text : "");
            if (r && clean) json_object_set_new(r, "content", json_string(clean));
            if (r) json_object_set_new(r, "index", json_integer((json_int_t) i));
            free(clean);
            json_array_append_new(out, compat_response_fields(j, r));
        }
        serve_job_release(srv, j);
    }
    if (e.status) {
        json_decref(out);
        return send_err(srv, c, &e);
    }
    return send_json(srv, c, 200, out, NULL);
}

/* Submit jobs[0..n) (each built and parsed, its cv not yet set up), wait for every one, and
** return the first error among them in *e (the rest are cancelled then).  Jobs never queued are
** freed here; the others stay the caller's (serve_job_release).  Returns how many were queued. */
static size_t run_jobs(struct server *srv, struct MHD_Connection *c, struct job **jobs, size_t n, struct serve_error *e) {
    size_t submitted = 0;
    for (; !e->status && submitted < n; submitted++) {
        struct job *j = jobs[submitted];
        pthread_cond_destroy(&j->cv);
        j->req.t_arrival = mono_ms();
        if (srv->lim.request_timeout_s > 0) j->req.deadline = j->req.t_arrival + srv->lim.request_timeout_s * 1e3;
        pthread_cond_init(&j->cv, NULL);
        if (serve_submit(srv, j)) {
            serve_error_set(e, 429, "rate_limit_error", "queue_full", "the request queue cannot take %zu jobs now; retry later", n);
            break;
        }
    }
    for (size_t i = 0; i < n; i++) {
        struct job *j = jobs[i];
        if (i >= submitted) { /* never queued: ours alone */
            serve_job_free(j);
            jobs[i] = NULL;
            continue;
        }
        pthread_mutex_lock(&srv->mu);
        if (e->status && j->state != JOB_DONE) j->cancelled = true;
        wait_watching(srv, c, j);
        pthread_mutex_unlock(&srv->mu);
        if (!e->status && j->err.status && j->err.status != 200) *e = j->err;
    }
    return submitted;
}

/* n > 1 on /v1/chat/completions and /v1/completions (OpenAI's choices): one job per choice, run
** side by side.  A chat's first choice runs in its session, which keeps it as the conversation's
** reply (a client that goes on with another choice sends it back: the session then takes that
** history); the others are completions of the template's text (serve_request_detach) in scratch
** sequences, whose prompt cache lets each reuse the prompt another decoded.  Choice i samples with
** the request's seed + i (the same seed would give n equal choices).  Not streamed, no tools. */
static enum MHD_Result post_choices(struct server *srv, struct MHD_Connection *c, const char *ns, const char *sid, json_t *root,
                                    bool chat, int n) {
    struct serve_error e = { 0 };
    serve_error_param(&e, "n");
    /* its jobs wait in the queue together: more than one API key may queue never fits (a 400, not a
    ** 429 to retry); fewer may still find the queue full now (429) */
    const int32_t cap = KVT_MIN(srv->max_queue, srv->queue_per_key);
    if (json_is_true(json_object_get(root, "stream")))
        serve_bad(&e, "'n' %d: several choices are not streamed (send stream false)", n);
    else if (n > cap)
        serve_bad(&e, "'n' %d is more than this server queues at once for one API key (%d, --queue%s)", n, cap,
                  srv->queue_per_key < srv->max_queue ? "-per-key" : "");
    struct job *jobs[SERVE_MAX_CHOICES] = { 0 };
    size_t k = 0;
    for (; !e.status && k < (size_t) n; k++) {
        json_t *one = json_copy(root);
        struct job *j = calloc(1, sizeof *j);
        if (one) json_object_del(one, "n");
        if (!one || !j) {
            json_decref(one);
            free(j);
            serve_error_oom(&e);
            break;
        }
        jobs[k] = j;
        j->kind = chat ? JOB_CHAT : JOB_COMPLETION;
        snprintf(j->req.ns, sizeof j->req.ns, "%s", ns);
        if (sid && k == 0) snprintf(j->req.session_id, sizeof j->req.session_id, "%s", sid);
        pthread_cond_init(&j->cv, NULL);
        if (serve_request_parse(srv, one, j, chat, &e) == 0 && k > 0) serve_request_detach(srv, j, &e);
        j->req.smp.seed += (uint32_t) k;
        json_decref(one);
    }
    json_decref(root);
    size_t submitted = e.status ? 0 : run_jobs(srv, c, jobs, k, &e);
    json_t *reply = NULL, *choices = json_array();
    int64_t completion_tokens = 0;
    for (size_t i = 0; i < k; i++) {
        struct job *j = jobs[i];
        if (!j) continue;
        if (i >= submitted) { /* parsed, never queued */
            serve_job_free(j);
            continue;
        }
        if (!e.status) {
            json_t *r = final_obj(srv, j), *ch = json_array_get(json_object_get(r, "choices"), 0);
            if (ch) json_object_set_new(ch, "index", json_integer((json_int_t) i));
            if (ch && choices) json_array_append(choices, ch);
            completion_tokens += j->completion_tokens;
            if (i == 0) reply = r; /* its id, model and usage (the prompt's tokens) */
            else json_decref(r);
        }
        serve_job_release(srv, j);
    }
    if (e.status || !reply || !choices) {
        json_decref(reply);
        json_decref(choices);
        if (!e.status) serve_error_oom(&e);
        return send_err(srv, c, &e);
    }
    json_object_set_new(reply, "choices", choices);
    json_t *u = json_object_get(reply, "usage");
    json_int_t pt = json_integer_value(json_object_get(u, "prompt_tokens"));
    json_object_set_new(u, "completion_tokens", json_integer(completion_tokens));
    json_object_set_new(u, "total_tokens", json_integer(pt + completion_tokens));
    return send_json(srv, c, 200, reply, NULL);
}

/* The text routes (/tokenize, /detokenize, /apply-template, the token counts) are answered on
** the connection's thread, outside the queue: at most TEXT_WORKERS of them work at once (each may
** hold a reply of a few bytes per token of a --max-body-mb body), the others wait for a turn,
** at most TEXT_WAIT_S, then get a 503.  Six concurrent /tokenize with_pieces of 3.5M tokens once
** grew the server by 10.9 GB (issue #38). */
enum { TEXT_WORKERS = 2, TEXT_WAIT_S = 30 };
static pthread_mutex_t text_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t text_cv = PTHREAD_COND_INITIALIZER;
static int text_busy;

static int text_work_begin(struct server *srv, struct serve_error *e) {
    (void) srv;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += TEXT_WAIT_S;
    pthread_mutex_lock(&text_mu);
    int w = 0;
    while (text_busy >= TEXT_WORKERS && w == 0) w = pthread_cond_timedwait(&text_cv, &text_mu, &until);
    const bool ok = text_busy < TEXT_WORKERS;
    if (ok) text_busy++;
    pthread_mutex_unlock(&text_mu);
    if (ok) return 0;
    return serve_error_set(e, 503, "server_error", "server_busy",
                           "%d tokenizer requests are being answered and others waited %d s for a turn; retry later", TEXT_WORKERS,
                           TEXT_WAIT_S);
}

static void text_work_end(struct server *srv) {
    (void) srv;
    pthread_mutex_lock(&text_mu);
    text_busy--;
    pthread_cond_signal(&text_cv);
    pthread_mutex_unlock(&text_mu);
}

/* POST /tokenize, /detokenize, /apply-template: answered here (server/compat.c), no job. */
static enum MHD_Result post_text(struct server *srv, struct MHD_Connection *c, struct req *rq,
                                 int (*fn)(struct server *, json_t *, json_t **, struct serve_error *)) {
    json_t *root, *out = NULL;
    enum MHD_Result bad = body_json(srv, c, rq, &root);
    if (!root) return bad;
    struct serve_error e = { 0 };
    int rc = -1;
    if (!text_work_begin(srv, &e)) {
        rc = fn(srv, root, &out, &e);
        text_work_end(srv);
    }
    json_decref(root);
    if (rc) {
        if (!e.status) serve_error_oom(&e);
        return send_err(srv, c, &e);
    }
    return send_json(srv, c, 200, out, NULL);
}

/* POST /tokenize: its reply is written as text (server/compat.c), not built as JSON objects. */
static enum MHD_Result post_tokenize(struct server *srv, struct MHD_Connection *c, struct req *rq) {
    json_t *root;
    enum MHD_Result bad = body_json(srv, c, rq, &root);
    if (!root) return bad;
    struct serve_error e = { 0 };
    char *out = NULL;
    int rc = -1;
    if (!text_work_begin(srv, &e)) {
        rc = compat_tokenize(srv, root, &out, &e);
        text_work_end(srv);
    }
    json_decref(root);
    if (rc) {
        if (!e.status) serve_error_oom(&e);
        return send_err(srv, c, &e);
    }
    return send_text(srv, c, 200, "application/json", out, NULL);
}
/* POST /chat/completions/input_tokens (llama-server's): the template's tokens of a chat request. */
static int do_input_tokens(struct server *srv, json_t *root, json_t **out, struct serve_error *e) {
    int32_t n = 0;
    if (compat_chat_tokens(srv, root, &n, e)) return -1;
    return (*out = json_pack("{s:i}", "input_tokens", n)) ? 0 : serve_error_oom(e);
}

static int do_detokenize(struct server *srv, json_t *root, json_t **out, struct serve_error *e) {
    return compat_detokenize(srv, root, out, e);
}

static enum MHD_Result get_sessions(struct server *srv, struct MHD_Connection *c, const char *ns) {
    json_t *data = json_array();
    pthread_mutex_lock(&srv->mu);
    for (int32_t i = 0; i < srv->n_views; i++) {
        const struct sess_view *v = &srv->views[i];
        if (strcmp(v->ns, ns)) continue;
        json_array_append_new(data, json_pack("{s:s, s:s, s:i, s:i, s:i, s:I, s:I, s:I, s:b, s:b}", "id", v->id, "object",
                                              "session", "messages", v->n_messages, "total_tokens", v->total_tokens,
                                              "resident_tokens", v->resident_tokens, "evictions", (json_int_t) v->evictions,
                                              "recoveries", (json_int_t) v->recoveries, "last_used", (json_int_t) v->last_used,
                                              "busy", v->busy, "parked", v->parked));
    }
    pthread_mutex_unlock(&srv->mu);
    return send_json(srv, c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data), NULL);
}

static enum MHD_Result delete_session(struct server *srv, struct MHD_Connection *c, const char *ns, const char *id) {
    struct job *j = calloc(1, sizeof *j);
    if (!j) return MHD_NO;
    j->kind = JOB_DELETE;
    snprintf(j->req.ns, sizeof j->req.ns, "%s", ns);
    snprintf(j->req.session_id, sizeof j->req.session_id, "%s", id);
    j->req.t_arrival = mono_ms();
    pthread_cond_init(&j->cv, NULL);
    if (serve_submit(srv, j)) {
        serve_job_free(j);
        return send_error(srv, c, 503, "server_error", NULL, "the server is shutting down");
    }
    pthread_mutex_lock(&srv->mu);
    WAIT_UNTIL(j->state == JOB_DONE);
    pthread_mutex_unlock(&srv->mu);
    enum MHD_Result r;
    if (j->err.status) r = send_err(srv, c, &j->err);
    else r = send_json(srv, c, 200, json_pack("{s:s, s:s, s:b}", "id", id, "object", "session", "deleted", 1), NULL);
    serve_job_release(srv, j);
    return r;
}

static time_t t_started; /* when the server started listening (/metrics' Process-Start-Time-Unix) */

static enum MHD_Result get_metrics(struct server *srv, struct MHD_Connection *c) {
    char *text = serve_metrics_text(srv);
    if (!text) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    char ts[32];
    snprintf(ts, sizeof ts, "%lld", (long long) t_started);
    MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4");
    MHD_add_response_header(r, "Process-Start-Time-Unix", ts); /* llama-server's */
    add_cors(srv, c, r);
    count_status(srv, 200);
    return queue_reply(c, 200, r);
}

/* ---------------------------------------------------------------------------------------- */
/* dispatch                                                                                 */

/* a == b in time that depends only on the lengths (keys are not leaked by timing) */
static bool same_secret(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    unsigned char d = na != nb;
    for (size_t i = 0; i < na; i++) d |= (unsigned char) (a[i] ^ b[i % (nb ? nb : 1)]);
    return d == 0;
}

/* The caller's tenant: "" without keys; the key's keyed hash (srv->key_ns, server/tenant.c:
** the same for the same key whatever its line in the key file); NULL if unauthorised.  Every key
** is compared, so the time does not say which one matched. */
static const char *auth(struct server *srv, struct MHD_Connection *c, char *ns, size_t n) {
    if (!srv->keys) {
        ns[0] = '\0';
        return ns;
    }
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    const char *key = h && !strncmp(h, "Bearer ", 7) ? h + 7 : NULL;
    if (!key) key = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Api-Key"); /* Anthropic's clients */
    if (!key) return NULL;
    int32_t hit = -1;
    for (int32_t i = 0; i < srv->n_keys; i++)
        if (same_secret(key, srv->keys[i])) hit = i;
    if (hit < 0) return NULL;
    snprintf(ns, n, "%s", srv->key_ns[hit]);
    return ns;
}

/* Is a Host header (absent: yes, HTTP/1.0) a loopback name with an optional port: localhost,
** 127.x.x.x or [::1]? */
static bool host_is_loopback(const char *h) {
    if (!h) return true;
    char name[256];
    size_t n = strlen(h);
    if (n >= sizeof name) return false;
    memcpy(name, h, n + 1);
    char *colon = name[0] == '[' ? strstr(name, "]:") : strrchr(name, ':');
    if (colon) {
        char *port = colon + (name[0] == '[' ? 2 : 1);
        if (!*port || strspn(port, "0123456789") != strlen(port)) return false;
        *(name[0] == '[' ? colon + 1 : colon) = '\0';
    }
    if (!strcasecmp(name, "localhost") || !strcasecmp(name, "localhost.") || !strcmp(name, "[::1]")) return true;
    struct in_addr a;
    return inet_pton(AF_INET, name, &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

static enum MHD_Result send_unauthorized(struct server *srv, struct MHD_Connection *c) {
    return send_error(srv, c, 401, "authentication_error", "invalid_api_key",
                      "missing or incorrect API key (send Authorization: Bearer KEY, or X-Api-Key: KEY)");
}

/* ---- workers: event-driven connections ---------------------------------------------------
** libmicrohttpd runs the connections on a few threads with epoll (--http-threads): a connection
** that is idle, or sends its headers or body slowly, costs no thread of its own.  A request that
** may wait (every method but GET and HEAD: a job for the model, a tokenizer run) is answered on
** a worker thread of its own while its connection is suspended; the worker's reply is queued by
** the handler when the worker resumes the connection, and a stream's worker then goes on
** producing its events (stream_produce) while libmicrohttpd sends them (stream_take).  Workers
** are capped (--max-workers; past it a 503): they exist for requests being answered, not for
** connections. */
static enum MHD_Result dispatch(struct server *srv, struct MHD_Connection *c, const char *url, const char *method, struct req *rq);
static bool route_open(struct server *srv, const char *url);

static void *worker_main(void *arg) {
    struct req *rq = arg;
    struct server *srv = rq->srv;
    struct MHD_Connection *c = rq->c;
    struct deferred d = { 0, NULL };
    tl_defer = &d;
    tl_stream = NULL;
    enum MHD_Result r = dispatch(srv, c, rq->url, rq->method, rq);
    struct stream *st = tl_stream;
    tl_defer = NULL;
    tl_stream = NULL;
    if (r == MHD_NO && d.r) { /* the connection is to be closed */
        MHD_destroy_response(d.r);
        d.r = NULL;
    }
    rq->reply = d.r;
    rq->reply_status = d.status;
    rq->reply_ready = true;
    pthread_mutex_lock(&srv->mu);
    srv->n_workers--;
    pthread_mutex_unlock(&srv->mu);
    MHD_resume_connection(c); /* from here on, rq and c belong to libmicrohttpd again */
    if (st) stream_produce(st);
    return NULL;
}

static enum MHD_Result to_worker(struct server *srv, struct MHD_Connection *c, const char *url, const char *method,
                                 struct req *rq) {
    pthread_mutex_lock(&srv->mu);
    const bool room = srv->n_workers < srv->http_workers;
    if (room) srv->n_workers++;
    pthread_mutex_unlock(&srv->mu);
    if (!room)
        return send_error(srv, c, 503, "server_error", "server_busy",
                          "%d requests are being answered, the most this server answers at once (--max-workers); retry later",
                          srv->http_workers);
    rq->in_worker = true;
    rq->srv = srv;
    rq->c = c;
    rq->url = strdup(url);
    rq->method = strdup(method);
    pthread_attr_t at;
    pthread_t t;
    int rc = !rq->url || !rq->method || pthread_attr_init(&at);
    if (!rc) {
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&at, (size_t) 1 << 20); /* as libmicrohttpd's threads: the JSON parser's depth */
        MHD_suspend_connection(c);
        rc = pthread_create(&t, &at, worker_main, rq);
        pthread_attr_destroy(&at);
        if (rc) MHD_resume_connection(c);
    }
    if (rc) {
        rq->in_worker = false;
        pthread_mutex_lock(&srv->mu);
        srv->n_workers--;
        pthread_mutex_unlock(&srv->mu);
        return send_error(srv, c, 503, "server_error", "server_busy", "cannot start a worker thread; retry later");
    }
    return MHD_YES;
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url, const char *method, const char *version,
                               const char *upload, size_t *upload_size, void **con_cls) {
    struct server *srv = cls;
    (void) version;
    struct req *rq = *con_cls;
    if (!rq) { /* the headers are in, no body byte has been read */
        if (!(rq = calloc(1, sizeof *rq))) return MHD_NO;
        *con_cls = rq;
        pthread_mutex_lock(&srv->mu); /* until completed(): serve_http_stop waits for it */
        srv->n_http++;
        pthread_mutex_unlock(&srv->mu);
        watch_phase(srv, conn_of(c), PHASE_BODY);
        /* the routes open without a key are GETs: any other method on them is answered here too,
        ** before a body byte is read (a POST /health once made the server buffer --max-body-mb) */
        bool open = route_open(srv, url);
        if (open && strcmp(method, "GET") && strcmp(method, "OPTIONS"))
            return send_error(srv, c, 405, "invalid_request_error", NULL, "%s %.40s: use GET", method, url);
        if (!strcmp(method, "OPTIONS")) { /* a CORS preflight: answered without a key (browsers send none) */
            char *empty = strdup("");
            return empty ? send_text(srv, c, 200, "text/plain", empty, NULL) : MHD_NO;
        }
        /* DNS rebinding: a web page whose name was made to resolve to 127.0.0.1 reaches a keyless
        ** server on loopback from the browser, with its own name in Host.  Such a server answers
        ** only requests addressed to a loopback name (issue #38) */
        if (!srv->keys && !srv->public_listen && !host_is_loopback(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host"))) {
            char h[64];
            serve_printable(h, sizeof h, MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host"));
            return send_error(srv, c, 403, "permission_error", "host_not_allowed",
                              "Host '%s' is not a loopback name: a server without API keys listening on loopback answers "
                              "requests for localhost, 127.0.0.1 or [::1] only (give --api-key-file to serve other names)",
                              h);
        }
        rq->authorized = auth(srv, c, rq->ns, sizeof rq->ns) != NULL;
        /* answered before the body is read: the client learns at once, and a client without a
        ** key cannot make the server buffer anything (libmicrohttpd closes the connection
        ** after a reply sent before the body) */
        if (!open && !rq->authorized) return send_unauthorized(srv, c);
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *e;
            errno = 0;
            unsigned long long n = strtoull(cl, &e, 10);
            if (errno || e == cl || *e || n > (unsigned long long) srv->lim.max_body)
                return send_error(srv, c, 413, "invalid_request_error", "request_too_large",
                                  "Content-Length %.32s is over the limit of %lld bytes (--max-body-mb)", cl,
                                  (long long) srv->lim.max_body);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (!rq->too_big && rq->n + *upload_size > (size_t) srv->lim.max_body) {
            rq->too_big = true;
            free(rq->body);
            rq->body = NULL;
            rq->n = rq->cap = 0;
        }
        if (!rq->too_big) {
            if (rq->n + *upload_size + 1 > rq->cap) {
                size_t cap = KVT_MAX(rq->cap * 2, rq->n + *upload_size + 1);
                char *b = realloc(rq->body, cap);
                if (!b) return MHD_NO;
                rq->body = b;
                rq->cap = cap;
            }
            memcpy(rq->body + rq->n, upload, *upload_size);
            rq->n += *upload_size;
            rq->body[rq->n] = '\0';
        }
        *upload_size = 0;
        return MHD_YES;
    }
    watch_phase(srv, conn_of(c), PHASE_ANSWER);
    if (rq->reply_ready) { /* resumed: the worker's reply */
        struct MHD_Response *r = rq->reply;
        rq->reply = NULL;
        if (!r) return MHD_NO;
        enum MHD_Result ret = MHD_queue_response(c, rq->reply_status, r);
        MHD_destroy_response(r);
        return ret;
    }
    if (!srv->thread_per_connection && !rq->in_worker && strcmp(method, "GET") && strcmp(method, "HEAD"))
        return to_worker(srv, c, url, method, rq);
    return dispatch(srv, c, url, method, rq);
}

/* ---------------------------------------------------------------------------------------- */
/* The routes: one table, the one place that says what the server answers (dispatch, the       */
/* header-time checks, --help and docs/API.md read it).                                        */

/* A route's handler: rest is what follows the route's path ("ID" of "/responses/ID"), or "". */
typedef enum MHD_Result (*route_fn)(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest);

enum { M_GET = 1, M_POST = 2, M_DELETE = 4, M_ANY = 7 };
enum { AT_V1 = 1, AT_ROOT = 2, AT_BOTH = 3 }; /* answered under /v1, without it (llama-server's), or both */

struct route {
    const char *path; /* without /v1; "/responses/" with has_id: "/responses/ID" */
    unsigned at, methods;
    bool has_id; /* the path is a prefix followed by an id */
    bool open;   /* answered without an API key (/metrics: with --metrics-public) */
    route_fn fn;
    const char *what; /* --help and docs/API.md */
};

static enum MHD_Result r_health(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rq, (void) rest;
    pthread_mutex_lock(&srv->mu);
    bool stopping = srv->stopping;
    pthread_mutex_unlock(&srv->mu);
    return send_json(srv, c, stopping ? 503 : 200, json_pack("{s:s}", "status", stopping ? "shutting down" : "ok"), NULL);
}
static enum MHD_Result r_metrics(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    if (!rq->authorized && !srv->lim.metrics_public) return send_unauthorized(srv, c);
    if (srv->no_metrics)
        return send_error(srv, c, 501, "not_supported_error", NULL, "this server runs with --no-metrics: no /metrics");
    return get_metrics(srv, c);
}
static enum MHD_Result r_input_tokens(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_text(srv, c, rq, do_input_tokens);
}
static enum MHD_Result r_chat(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_generate(srv, c, rq, rq->ns, true, API_OPENAI);
}
static enum MHD_Result r_completions(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest; /* /v1/completions: OpenAI's; /completions (llama-server's alias of /completion): native */
    return post_generate(srv, c, rq, rq->ns, false, rq->v1 ? API_OPENAI : API_NATIVE);
}
static enum MHD_Result r_native(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_generate(srv, c, rq, rq->ns, false, API_NATIVE);
}
static enum MHD_Result r_responses(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_generate(srv, c, rq, rq->ns, true, API_RESPONSES);
}
static enum MHD_Result r_response_id(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *id) {
    if (rq->get) {
        json_t *o = resp_get(rq->ns, id);
        if (!o) return send_error(srv, c, 404, "invalid_request_error", "not_found", "no stored response '%.60s'", id);
        return send_json(srv, c, 200, o, NULL);
    }
    if (!resp_delete(rq->ns, id))
        return send_error(srv, c, 404, "invalid_request_error", "not_found", "no stored response '%.60s'", id);
    return send_json(srv, c, 200, json_pack("{s:s, s:s, s:b}", "id", id, "object", "response.deleted", "deleted", 1), NULL);
}
static enum MHD_Result r_messages(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_generate(srv, c, rq, rq->ns, true, API_ANTHROPIC);
}
static enum MHD_Result r_count_tokens(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_text(srv, c, rq, anth_count_tokens);
}
static enum MHD_Result r_tokenize(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_tokenize(srv, c, rq);
}
static enum MHD_Result r_detokenize(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_text(srv, c, rq, do_detokenize);
}
static enum MHD_Result r_template(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_text(srv, c, rq, compat_apply_template);
}
static enum MHD_Result r_models(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rq, (void) rest;
    return send_json(srv, c, 200, compat_models(srv), NULL);
}
static enum MHD_Result r_props(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rq, (void) rest;
    return send_json(srv, c, 200, compat_props(srv), NULL);
}
static enum MHD_Result r_slots(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    if (srv->no_slots) return send_error(srv, c, 501, "not_supported_error", NULL, "this server runs with --no-slots: no /slots");
    return send_json(srv, c, 200, compat_slots(srv, rq->ns), NULL);
}
static enum MHD_Result r_not_served(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return send_error(srv, c, 501, "not_supported_error", NULL,
                      "%s: kvtier serves chat and text completions only (no embeddings, reranking or infill)", rq->url_now);
}
static enum MHD_Result r_sessions(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return get_sessions(srv, c, rq->ns);
}
static enum MHD_Result r_session_id(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *id) {
    return delete_session(srv, c, rq->ns, id);
}

/* clang-format off */
static const struct route ROUTES[] = {
    { "/health",                        AT_BOTH, M_GET,    false, true,  r_health,       "200 {\"status\":\"ok\"}; 503 while shutting down" },
    { "/metrics",                       AT_ROOT, M_GET,    false, false, r_metrics,      "Prometheus text (open with --metrics-public)" },
    { "/chat/completions",              AT_BOTH, M_POST,   false, false, r_chat,         "OpenAI Chat Completions" },
    { "/chat/completions/input_tokens", AT_BOTH, M_POST,   false, false, r_input_tokens, "the prompt's token count" },
    { "/completions",                   AT_BOTH, M_POST,   false, false, r_completions,  "OpenAI Completions (/v1); llama-server's native completion (without /v1)" },
    { "/completion",                    AT_ROOT, M_POST,   false, false, r_native,       "llama-server's native completion" },
    { "/responses",                     AT_BOTH, M_POST,   false, false, r_responses,    "OpenAI Responses (previous_response_id held by the server)" },
    { "/responses/",                    AT_BOTH, M_GET | M_DELETE, true, false, r_response_id, "a stored response: read or delete (with the ones that continue it)" },
    { "/messages",                      AT_V1,   M_POST,   false, false, r_messages,     "Anthropic Messages" },
    { "/messages/count_tokens",         AT_V1,   M_POST,   false, false, r_count_tokens, "Anthropic's token count" },
    { "/tokenize",                      AT_ROOT, M_POST,   false, false, r_tokenize,     "llama-server's tokenizer" },
    { "/detokenize",                    AT_ROOT, M_POST,   false, false, r_detokenize,   "llama-server's detokenizer" },
    { "/apply-template",                AT_ROOT, M_POST,   false, false, r_template,     "the chat template applied to messages" },
    { "/models",                        AT_BOTH, M_GET,    false, false, r_models,       "the model served" },
    { "/props",                         AT_ROOT, M_GET,    false, false, r_props,        "llama-server's server properties (kvtier's are flags: GET only)" },
    { "/slots",                         AT_ROOT, M_GET,    false, false, r_slots,        "the caller's sessions as llama-server's slots" },
    { "/sessions",                      AT_V1,   M_GET,    false, false, r_sessions,     "the caller's sessions" },
    { "/sessions/",                     AT_V1,   M_DELETE, true,  false, r_session_id,   "end a session" },
    { "/embedding",                     AT_BOTH, M_ANY,    false, false, r_not_served,   "501: not served" },
    { "/embeddings",                    AT_BOTH, M_ANY,    false, false, r_not_served,   "501: not served" },
    { "/rerank",                        AT_BOTH, M_ANY,    false, false, r_not_served,   "501: not served" },
    { "/reranking",                     AT_BOTH, M_ANY,    false, false, r_not_served,   "501: not served" },
    { "/infill",                        AT_BOTH, M_ANY,    false, false, r_not_served,   "501: not served" },
};
/* clang-format on */

/* The route of url (with or without /v1, as the route allows) and what follows its path; NULL
** when none. */
static const struct route *route_of(const char *url, const char **rest, bool *v1) {
    const char *u = !strncmp(url, "/v1/", 4) ? url + 3 : url;
    *v1 = u != url;
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0]; i++) {
        const struct route *r = &ROUTES[i];
        if (!(r->at & (*v1 ? AT_V1 : AT_ROOT))) continue;
        size_t n = strlen(r->path);
        if (r->has_id ? (!strncmp(u, r->path, n) && u[n]) : !strcmp(u, r->path)) {
            *rest = r->has_id ? u + n : "";
            return r;
        }
    }
    return NULL;
}

static unsigned method_bit(const char *m) {
    return !strcmp(m, "GET") ? M_GET : !strcmp(m, "POST") ? M_POST : !strcmp(m, "DELETE") ? M_DELETE : 0;
}

/* a route open without a key (its header-time checks: other methods get 405 before any body) */
static bool route_open(struct server *srv, const char *url) {
    const char *rest;
    bool v1;
    const struct route *r = route_of(url, &rest, &v1);
    return r && (r->open || (r->fn == r_metrics && srv->lim.metrics_public));
}

static void methods_text(unsigned m, char *buf, size_t cap) {
    snprintf(buf, cap, "%s%s%s%s%s", m & M_GET ? "GET" : "", (m & M_GET) && (m & ~M_GET) ? " or " : "", m & M_POST ? "POST" : "",
             (m & M_POST) && (m & M_DELETE) ? " or " : "", m & M_DELETE ? "DELETE" : "");
}

/* The request's answer (the body is in): its route's handler. */
static enum MHD_Result dispatch(struct server *srv, struct MHD_Connection *c, const char *url, const char *method, struct req *rq) {
    const char *rest;
    const struct route *r = route_of(url, &rest, &rq->v1);
    if (!r) {
        if (!rq->authorized) return send_unauthorized(srv, c);
        return send_error(srv, c, 404, "invalid_request_error", "not_found", "no endpoint %s %s", method, url);
    }
    bool open = r->open || (r->fn == r_metrics && srv->lim.metrics_public);
    if (!open && !rq->authorized) return send_unauthorized(srv, c);
    if (!(r->methods & method_bit(method))) {
        char m[32];
        methods_text(r->methods, m, sizeof m);
        return send_error(srv, c, 405, "invalid_request_error", NULL, "%s %s: use %s", method, url, m);
    }
    rq->get = !strcmp(method, "GET");
    rq->url_now = url;
    return r->fn(srv, c, rq, rest);
}

void serve_routes_print(FILE *f, bool markdown) {
    if (markdown)
        fprintf(f, "# kvtier serve: routes and request fields\n\n"
                   "Generated by `kvtier serve --print-api` from the route table (server/http.c) and the field tables\n"
                   "(server/fields.c): `make docs`; the suite checks that this file is current.\n\n");
    if (markdown) fprintf(f, "## Routes\n\n| method | path | key | what |\n|---|---|---|---|\n");
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0]; i++) {
        const struct route *r = &ROUTES[i];
        char m[32], path[80];
        methods_text(r->methods, m, sizeof m);
        if (r->methods == M_ANY) snprintf(m, sizeof m, "any");
        snprintf(path, sizeof path, "%s%s%s%s",
                 r->at == AT_BOTH ? "[/v1]"
                 : r->at == AT_V1 ? "/v1"
                                  : "",
                 r->path, r->has_id ? "ID" : "", "");
        const char *key = r->open ? "no" : r->fn == r_metrics ? "yes (no with --metrics-public)" : "yes";
        if (markdown) fprintf(f, "| %s | `%s` | %s | %s |\n", m, path, key, r->what);
        else fprintf(f, "  %-15s %-40s %s\n", m, path, r->what);
    }
    if (markdown)
        fprintf(f, "\n`[/v1]`: answered with and without the prefix (llama-server's rule).  Without a key where one is "
                   "needed: 401, before any body byte is read; another method: 405 naming the ones the route takes.\n\n");
}

void serve_print_api(FILE *f) {
    serve_routes_print(f, true);
    serve_fields_print_md(f);
}

/* The request is over: its reply was sent, or the connection failed. */
static void completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    struct server *srv = cls;
    (void) toe;
    watch_phase(srv, conn_of(c), PHASE_HEADERS); /* kept alive: the next request's headers are due */
    struct req *rq = *con_cls;
    if (rq) {
        if (rq->reply) MHD_destroy_response(rq->reply);
        free(rq->url);
        free(rq->method);
        free(rq->body);
        free(rq);
        pthread_mutex_lock(&srv->mu);
        srv->n_http--;
        pthread_mutex_unlock(&srv->mu);
    }
    *con_cls = NULL;
}

/* One listening address of --host: an IPv4 or IPv6 literal, or "localhost" (127.0.0.1). */
static struct MHD_Daemon *listen_on(struct server *srv, const char *host, int32_t port) {
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    /* event-driven (--http-threads N): epoll on N threads, requests that wait on workers; else
    ** (--http-threads 0) a thread per connection */
    const bool tpc = srv->thread_per_connection;
    unsigned flags = !tpc ? MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG
                          : MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_ERROR_LOG;
    char a[64];
    snprintf(a, sizeof a, "%s", host);
    size_t n = strlen(a);
    if (n > 2 && a[0] == '[' && a[n - 1] == ']') { /* [::1] */
        memmove(a, a + 1, n - 2);
        a[n - 2] = '\0';
    }
    if (!strcmp(a, "localhost")) snprintf(a, sizeof a, "127.0.0.1");
    struct sockaddr_in *s4 = (struct sockaddr_in *) &ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *) &ss;
    if (inet_pton(AF_INET, a, &s4->sin_addr) == 1) {
        s4->sin_family = AF_INET;
        s4->sin_port = htons((uint16_t) port);
        if ((ntohl(s4->sin_addr.s_addr) >> 24) != 127) srv->public_listen = true;
    } else if (inet_pton(AF_INET6, a, &s6->sin6_addr) == 1) {
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons((uint16_t) port);
        flags |= MHD_USE_IPv6;
        if (!IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr)) srv->public_listen = true;
    } else {
        fprintf(stderr, "kvtier serve: --host '%s' is not an IPv4 or IPv6 address\n", host);
        return NULL;
    }
    /* thread per connection: a small stack (the handlers' deepest recursion is the JSON parser's,
    ** 2048 levels at most, and the schema's, 32), so the connection cap, not the address space,
    ** bounds the threads */
    struct MHD_Daemon *d = MHD_start_daemon(flags, (uint16_t) port, NULL, NULL, handler, srv, MHD_OPTION_EXTERNAL_LOGGER, mhd_log,
                                            srv, /* first: it covers the others */
                                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *) &ss, MHD_OPTION_NOTIFY_COMPLETED, completed,
                                            srv, MHD_OPTION_NOTIFY_CONNECTION, notify_connection, srv, MHD_OPTION_CONNECTION_LIMIT,
                                            (unsigned) srv->lim.max_connections, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                                            (unsigned) srv->lim.max_per_ip, MHD_OPTION_CONNECTION_TIMEOUT,
                                            (unsigned) srv->lim.idle_timeout_s, MHD_OPTION_THREAD_STACK_SIZE, (size_t) 1 << 20,
                                            MHD_OPTION_THREAD_POOL_SIZE, (unsigned) (tpc ? 0 : srv->http_threads), MHD_OPTION_END);
    if (!d) fprintf(stderr, "kvtier serve: cannot listen on %s port %d (in use, or not allowed)\n", host, port);
    return d;
}

struct serve_http *serve_http_start(struct server *srv, const char *hosts, int32_t port, int32_t *bound_port) {
    struct serve_http *h = calloc(1, sizeof *h);
    struct conn_watch *w = calloc(1, sizeof *w);
    if (!h || !w) {
        free(h);
        free(w);
        return NULL;
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->head.next = w->head.prev = &w->head;
    srv->watch = w;
    if (!(w->started = !pthread_create(&w->thread, NULL, watch_main, srv))) {
        fprintf(stderr, "kvtier serve: cannot start the connection watchdog thread\n");
        goto fail;
    }
    /* --host A,B,...: one daemon per address, all on the first one's port (port 0: the one it got) */
    for (const char *p = hosts; *p;) {
        size_t n = strcspn(p, ",");
        char one[64];
        if (n == 0 || n >= sizeof one || h->n == SERVE_MAX_HOSTS) {
            fprintf(stderr, "kvtier serve: --host '%s': give 1..%d comma-separated addresses\n", hosts, SERVE_MAX_HOSTS);
            goto fail;
        }
        snprintf(one, sizeof one, "%.*s", (int) n, p);
        if (!(h->d[h->n] = listen_on(srv, one, port))) goto fail;
        if (h->n++ == 0) {
            const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d[0], MHD_DAEMON_INFO_BIND_PORT);
            port = info ? info->port : port;
        }
        p += n + (p[n] == ',');
    }
    if (h->n == 0) {
        fprintf(stderr, "kvtier serve: --host '%s' names no address\n", hosts);
        goto fail;
    }
    *bound_port = port;
    t_started = time(NULL);
    return h;
fail:
    for (int i = 0; i < h->n; i++) MHD_stop_daemon(h->d[i]);
    free(h);
    watch_stop(srv);
    return NULL;
}

static void watch_stop(struct server *srv) {
    struct conn_watch *w = srv->watch;
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (w->started) pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
    srv->watch = NULL;
}

void serve_http_stop(struct server *srv, struct serve_http *h) {
    for (int i = 0; i < 3000; i++) { /* 10 ms steps, 30 s at most */
        pthread_mutex_lock(&srv->mu);
        int32_t n = srv->n_http;
        pthread_mutex_unlock(&srv->mu);
        if (n == 0) break;
        nanosleep(&(struct timespec){ 0, 10 * 1000000L }, NULL);
    }
    for (int i = 0; i < h->n; i++) MHD_stop_daemon(h->d[i]);
    free(h);
    watch_stop(srv); /* after the daemons: their last connections are closed (and unlinked) by now */
}
