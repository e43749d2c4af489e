/* http.c — the connections of `kvtier serve`: libmicrohttpd (event-driven with workers, or one
** thread per connection), the deadlines of connections still sending, API keys and the Host
** check, the request body, and the workers that answer requests which may wait.  What a request
** gets is the route table's (server/routes.c) and, for a generation route, its API module's
** (server/api.h).  These threads never touch the engine: they queue jobs (server/sched.c) and wait
** on them. */
#include "fields.h"
#include "http.h"

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


static void watch_phase(struct server *srv, struct conn *cn, enum conn_phase phase) {
    if (!cn) return;
    pthread_mutex_lock(&srv->watch->mu);
    if (phase == PHASE_HEADERS) cn->kept = true; /* only completed() goes back to the headers */
    cn->phase = phase;
    cn->t0 = serve_mono_ms();
    pthread_mutex_unlock(&srv->watch->mu);
}

static void *watch_main(void *arg) {
    struct server *srv = arg;
    struct conn_watch *w = srv->watch;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        double now = serve_mono_ms();
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
        struct timespec ts = serve_realtime_in_ms(200);
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
        cn->t0 = serve_mono_ms();
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
    double now = serve_mono_ms();
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


/* ---- workers: event-driven connections ---------------------------------------------------
** libmicrohttpd runs the connections on a few threads with epoll (--http-threads): a connection
** that is idle, or sends its headers or body slowly, costs no thread of its own.  A request that
** may wait (every method but GET and HEAD: a job for the model, a tokenizer run) is answered on
** a worker thread of its own while its connection is suspended; the worker's reply is queued by
** the handler when the worker resumes the connection, and a stream's worker then goes on
** producing its events (stream_produce) while libmicrohttpd sends them (stream_take).  Workers
** are capped (--max-workers; past it a 503): they exist for requests being answered, not for
** connections. */

static void *worker_main(void *arg) {
    struct req *rq = arg;
    struct server *srv = rq->srv;
    struct MHD_Connection *c = rq->c;
    struct serve_deferred d = { 0, NULL };
    serve_defer_begin(&d);
    enum MHD_Result r = serve_dispatch(srv, c, rq->url, rq->method, rq);
    struct stream *st = serve_defer_end();
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
    if (st) serve_stream_produce(st);
    return NULL;
}

static enum MHD_Result to_worker(struct server *srv, struct MHD_Connection *c, const char *url, const char *method,
                                 struct req *rq) {
    pthread_mutex_lock(&srv->mu);
    const bool room = srv->n_workers < srv->http_workers;
    if (room) srv->n_workers++;
    pthread_mutex_unlock(&srv->mu);
    if (!room)
        return serve_send_error(srv, c, 503, "server_error", "server_busy",
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
        return serve_send_error(srv, c, 503, "server_error", "server_busy", "cannot start a worker thread; retry later");
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
        bool open = serve_route_open(srv, url);
        if (open && strcmp(method, "GET") && strcmp(method, "OPTIONS"))
            return serve_send_error(srv, c, 405, "invalid_request_error", NULL, "%s %.40s: use GET", method, url);
        if (!strcmp(method, "OPTIONS")) { /* a CORS preflight: answered without a key (browsers send none) */
            char *empty = strdup("");
            return empty ? serve_send_text(srv, c, 200, "text/plain", empty, NULL) : MHD_NO;
        }
        /* DNS rebinding: a web page whose name was made to resolve to 127.0.0.1 reaches a keyless
        ** server on loopback from the browser, with its own name in Host.  Such a server answers
        ** only requests addressed to a loopback name (issue #38) */
        if (!srv->keys && !srv->public_listen && !host_is_loopback(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host"))) {
            char h[64];
            serve_printable(h, sizeof h, MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Host"));
            return serve_send_error(srv, c, 403, "permission_error", "host_not_allowed",
                                    "Host '%s' is not a loopback name: a server without API keys listening on loopback answers "
                                    "requests for localhost, 127.0.0.1 or [::1] only (give --api-key-file to serve other names)",
                                    h);
        }
        rq->authorized = auth(srv, c, rq->ns, sizeof rq->ns) != NULL;
        /* answered before the body is read: the client learns at once, and a client without a
        ** key cannot make the server buffer anything (libmicrohttpd closes the connection
        ** after a reply sent before the body) */
        if (!open && !rq->authorized) return serve_send_unauthorized(srv, c);
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *e;
            errno = 0;
            unsigned long long n = strtoull(cl, &e, 10);
            if (errno || e == cl || *e || n > (unsigned long long) srv->lim.max_body)
                return serve_send_error(srv, c, 413, "invalid_request_error", "request_too_large",
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
    return serve_dispatch(srv, c, url, method, rq);
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
    serve_routes_started();
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
