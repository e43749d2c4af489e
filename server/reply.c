/* reply.c — replies of the HTTP side: JSON and text with the CORS headers --cors-origins allows,
** errors in an API's shape, the request body as JSON, and waits on a job that watch the client's
** socket.  On a worker thread (server/http.c) a reply is kept for the connection's handler to
** queue: libmicrohttpd queues a response from its handler only. */
#include "api.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* Length of the longest prefix of s[0..n) made of complete, valid UTF-8 sequences. */
size_t serve_utf8_prefix(const char *s, size_t n) {
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

void serve_count_status(struct server *srv, int status) {
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
void serve_add_cors(struct server *srv, struct MHD_Connection *c, struct MHD_Response *r) {
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!origin_allowed(srv->cors_origins, origin)) return;
    /* "*" (any page): no credentials, so a browser sends no cookie or HTTP authentication it holds
    ** for this server to a page of any origin; an origin listed by name gets them (issue #38).  The
    ** origin is named back either way (llama-server's header; without Allow-Credentials naming it
    ** grants a page no more than "*" does; Vary: Origin keeps caches apart) */
    const bool any = !strcmp(srv->cors_origins, "*");
    MHD_add_response_header(r, "Access-Control-Allow-Origin", origin);
    if (!any) MHD_add_response_header(r, "Access-Control-Allow-Credentials", "true");
    MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
    MHD_add_response_header(r, "Access-Control-Allow-Headers", "*");
    MHD_add_response_header(r, "Vary", "Origin");
}

/* Where a reply goes: queued on the connection, or, on a worker thread, kept for the handler to
** queue once the connection is resumed (libmicrohttpd queues a response from its handler only). */
static __thread struct serve_deferred *tl_defer; /* set on a worker thread */
static __thread struct stream *tl_stream;        /* a stream the worker goes on producing after its reply */

void serve_defer_begin(struct serve_deferred *d) {
    tl_defer = d;
    tl_stream = NULL;
}

struct stream *serve_defer_end(void) {
    struct stream *st = tl_stream;
    tl_defer = NULL;
    tl_stream = NULL;
    return st;
}

bool serve_deferred_now(void) { return tl_defer != NULL; }
void serve_defer_stream(struct stream *st) { tl_stream = st; }

enum MHD_Result serve_queue_reply(struct MHD_Connection *c, unsigned status, struct MHD_Response *r) {
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

enum MHD_Result serve_send_text(struct server *srv, struct MHD_Connection *c, int status, const char *ctype, char *text,
                                const char *session_id) {
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    serve_add_cors(srv, c, r);
    if (session_id && *session_id) MHD_add_response_header(r, "X-Session-Id", session_id);
    serve_count_status(srv, status);
    return serve_queue_reply(c, (unsigned) status, r);
}

enum MHD_Result serve_send_json(struct server *srv, struct MHD_Connection *c, int status, json_t *obj, const char *sid) {
    char *txt = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!txt) return MHD_NO;
    return serve_send_text(srv, c, status, "application/json", txt, sid);
}

/* Every error reply: the server's one error form (serve.h, server/error.c), or the API's own. */
enum MHD_Result serve_send_err(struct server *srv, struct MHD_Connection *c, const struct serve_error *e,
                               const struct serve_api *api) {
    return serve_send_json(srv, c, e->status ? e->status : 500, api && api->error ? api->error(e) : serve_error_json(e), NULL);
}


enum MHD_Result serve_send_error(struct server *srv, struct MHD_Connection *c, int status, const char *type, const char *code,
                                 const char *fmt, ...) {
    struct serve_error e = { 0 };
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.msg, sizeof e.msg, fmt, ap);
    va_end(ap);
    e.status = status;
    e.type = type;
    snprintf(e.code, sizeof e.code, "%s", code ? code : "");
    return serve_send_err(srv, c, &e, NULL);
}

#define BAD(...) serve_send_error(srv, c, 400, "invalid_request_error", NULL, __VA_ARGS__)


enum MHD_Result serve_send_unauthorized(struct server *srv, struct MHD_Connection *c) {
    return serve_send_error(srv, c, 401, "authentication_error", "invalid_api_key",
                            "missing or incorrect API key (send Authorization: Bearer KEY, or X-Api-Key: KEY)");
}

enum MHD_Result serve_body_json(struct server *srv, struct MHD_Connection *c, struct req *rq, json_t **root) {
    *root = NULL;
    if (rq->too_big)
        return serve_send_error(srv, c, 413, "invalid_request_error", "request_too_large",
                                "the request body is over the limit of %lld bytes (--max-body-mb)", (long long) srv->lim.max_body);
    size_t ok = serve_utf8_prefix(rq->body ? rq->body : "", rq->n);
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
char serve_first_char(const struct job *j) {
    for (size_t i = 0; j->text && i < j->n_text; i++)
        if (!strchr(" \t\r\n", j->text[i])) return j->text[i];
    return 0;
}

/* Wait (under srv->mu) for a job to finish, or with until_first_char only until its text has a
** non-blank byte, checking every 100 ms that the client is still connected (nothing is written
** meanwhile): one that went away cancels the job at its next token (as a dropped stream does), so
** its slot is not held to max_tokens for nobody. */
int serve_conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

struct timespec serve_realtime_in_ms(long ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* fd: the client's socket (a connection's own while it cannot close under us, or a stream's dup). */
void serve_wait_watching(struct server *srv, int fd, struct job *j, bool until_first_char) {
    while (j->state != JOB_DONE && !(until_first_char && serve_first_char(j))) {
        struct timespec ts = serve_realtime_in_ms(100);
        pthread_cond_timedwait(&j->cv, &srv->mu, &ts);
        if (j->state != JOB_DONE && !j->cancelled && peer_gone_fd(fd)) j->cancelled = true;
    }
}
