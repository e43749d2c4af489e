/* stream.c — a streamed reply: server-sent events written by the job's API module (api.h) as the
** engine thread hands out the job's text.  This file knows no API: it waits for the job, cuts its
** text at whole UTF-8 characters, takes the probabilities and timings, and calls the module's
** writers (start, progress, a piece, a reply under tools sent whole, the end).
**
** Thread per connection: libmicrohttpd's thread calls stream_read, which waits for the job.
** Event-driven: the worker thread produces the events (serve_stream_produce) into a queue that
** libmicrohttpd's thread takes (stream_take), suspending the connection when it is empty. */
#include "api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void sse_data(struct stream *st, json_t *obj) {
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

/* A typed event (Anthropic's, Responses'): "event: TYPE" and its data (obj's "type"). */
void sse_event(struct stream *st, json_t *obj) {
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
    sse_data(st, obj);
}

void sse_raw(struct stream *st, const char *s) {
    size_t n = strlen(s);
    char *o = realloc(st->out, st->n_out + n + 1);
    if (!o) return;
    st->out = o;
    memcpy(o + st->n_out, s, n + 1);
    st->n_out += n;
}

/* The next piece of the stream: waits for the job, writes events through its API module. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    struct stream *st = cls;
    struct server *srv = st->srv;
    struct job *j = st->j;
    const struct serve_api *api = j->req.api;
    (void) pos;
    while (st->off == st->n_out) {
        st->off = st->n_out = 0;
        if (st->phase == 3) return MHD_CONTENT_READER_END_OF_STREAM;
        if (st->phase == 0) {
            st->phase = 1;
            api->s_start(st);
            if (st->n_out) continue;
        }
        if (j->req.return_progress && api->s_progress) { /* the progress events, all before the reply's text */
            pthread_mutex_lock(&srv->mu);
            WAIT_UNTIL(j->state == JOB_DONE || j->started || j->n_prog > j->n_prog_sent);
            const bool have = j->n_prog > j->n_prog_sent;
            struct prompt_progress p = { 0 };
            if (have) p = j->prog[j->n_prog_sent++];
            pthread_mutex_unlock(&srv->mu);
            if (have) {
                api->s_progress(st, &p);
                continue;
            }
        }
        /* a tool-call reply is one JSON object: parsed and sent whole when it is complete.  Under
        ** tool_choice auto the reply's first character chooses (server/tools.c): '{' a call (or
        ** the JSON reply format), anything else plain text, streamed as it comes like any reply */
        bool whole = false;
        pthread_mutex_lock(&srv->mu);
        if (j->req.format == REPLY_TOOLS && api->s_whole && st->tools_text <= 0) {
            if (st->tools_text < 0) {
                serve_wait_watching(srv, st->peer_fd, j, true);
                const char c0 = serve_first_char(j);
                st->tools_text = c0 && c0 != '{';
            }
            whole = !st->tools_text;
        }
        if (whole) serve_wait_watching(srv, st->peer_fd, j, false); /* nothing is written meanwhile: watch the socket */
        else WAIT_UNTIL(j->state == JOB_DONE || j->n_text > j->n_sent);
        bool done = j->state == JOB_DONE;
        const char *fin = j->finish;
        if (whole) {
            pthread_mutex_unlock(&srv->mu);
            if (!(j->err.status && j->err.status != 200)) {
                json_t *msg = tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
                if (msg) api->s_whole(st, msg, &fin);
            }
            pthread_mutex_lock(&srv->mu);
            j->n_sent = j->text ? strlen(j->text) : 0;
        }
        size_t upto = done ? (j->text ? strlen(j->text) : 0) : j->n_text;
        size_t ok = upto > j->n_sent ? serve_utf8_prefix(j->text + j->n_sent, upto - j->n_sent) : 0;
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
        json_t *tm = j->req.timings && ((piece && *piece) || done) ? serve_timings(j, serve_mono_ms()) : NULL;
        /* streamed logprobs: the ids and ln p of the tokens generated since the last piece, copied
        ** here; their entries built below, outside the lock (the engine thread builds no JSON) */
        struct lp_rec lr = { 0 };
        if (j->n_lp_ready > j->n_lp_sent && ((piece && *piece) || done)) serve_logprobs_take(j, &lr);
        pthread_mutex_unlock(&srv->mu);
        json_t *lps = lr.n ? serve_logprobs_entries(srv, j, &lr) : NULL;
        serve_lp_rec_free(&lr);
        if ((piece && *piece) || lps) api->s_piece(st, piece ? piece : "", tm, lps);
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
        api->s_end(st, fin);
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
    if (st->j->req.api->s_free) st->j->req.api->s_free(st);
    serve_job_release(st->srv, st->j);
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
void serve_stream_produce(struct stream *st) {
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

enum MHD_Result serve_stream_reply(struct server *srv, struct MHD_Connection *c, struct job *j) {
    struct stream *st = calloc(1, sizeof *st);
    if (!st) {
        serve_job_release(srv, j);
        return MHD_NO;
    }
    st->srv = srv;
    st->c = c;
    st->j = j;
    st->peer_fd = dup(serve_conn_fd(c));
    pthread_mutex_init(&st->qmu, NULL);
    st->refs = serve_deferred_now() ? 2 : 1; /* on a worker: the response's and the producer's */
    st->tools_text = -1;
    const bool produced = serve_deferred_now();
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, produced ? stream_take : stream_read, st,
                                                               stream_free);
    if (!r) {
        if (produced) stream_unref(st);
        stream_free(st);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    serve_add_cors(srv, c, r);
    pthread_mutex_lock(&srv->mu);
    if (j->out_session[0]) MHD_add_response_header(r, "X-Session-Id", j->out_session);
    pthread_mutex_unlock(&srv->mu);
    serve_count_status(srv, 200);
    if (produced) serve_defer_stream(st); /* the worker produces it once the reply is handed over */
    return serve_queue_reply(c, 200, r);
}
