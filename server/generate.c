/* generate.c — a generation request: its API module (api.h) parses the body into the common job,
** the job is queued (server/sched.c) and waited for, and the module writes the reply, the stream
** or the error.  Nothing here knows an API. */
#include "api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Queue j and answer it: the reply once it is done, or, streamed, the stream once its prompt is
** accepted.  j is the reply's from here. */
static enum MHD_Result run_job(struct server *srv, struct MHD_Connection *c, struct job *j) {
    const struct serve_api *api = j->req.api;
    j->req.t_arrival = serve_mono_ms();
    if (srv->lim.request_timeout_s > 0) j->req.deadline = j->req.t_arrival + srv->lim.request_timeout_s * 1e3;
    pthread_cond_init(&j->cv, NULL);
    int q = serve_submit(srv, j);
    if (q) {
        serve_job_free(j);
        if (q == 429)
            return serve_send_error(srv, c, 429, "rate_limit_error", "queue_full",
                                    "the request queue is full (%d waiting); retry later", srv->max_queue);
        if (q == 430)
            return serve_send_error(srv, c, 429, "rate_limit_error", "queue_share_full",
                                    "this API key has %d requests waiting, its share of the queue (--queue-per-key); retry later",
                                    srv->queue_per_key);
        return serve_send_error(srv, c, 503, "server_error", NULL, "the server is shutting down");
    }
    pthread_mutex_lock(&srv->mu);
    /* prompt accepted (or, with return_progress, its prefill begun): the headers can go */
    if (j->req.stream) WAIT_UNTIL(j->state == JOB_DONE || j->started || j->n_prog > 0);
    else serve_wait_watching(srv, serve_conn_fd(c), j, false);
    bool failed = j->state == JOB_DONE && j->err.status && j->err.status != 200;
    pthread_mutex_unlock(&srv->mu);
    if (failed) {
        enum MHD_Result r = serve_send_err(srv, c, &j->err, api);
        serve_job_release(srv, j);
        return r;
    }
    if (j->req.stream) return serve_stream_reply(srv, c, j);
    enum MHD_Result r = serve_send_json(srv, c, 200, api->reply(srv, j), j->out_session);
    serve_job_release(srv, j);
    return r;
}

enum MHD_Result serve_post_generate(struct server *srv, struct MHD_Connection *c, struct req *rq, const struct serve_api *api) {
    json_t *root;
    enum MHD_Result bad = serve_body_json(srv, c, rq, &root);
    if (!root) return bad;
    const char *sid = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Session-Id");
    enum MHD_Result ret;
    if (api->fan_out && api->fan_out(srv, c, rq->ns, sid, root, &ret)) return ret; /* several jobs, answered there */
    struct job *j = calloc(1, sizeof *j);
    if (!j) {
        json_decref(root);
        return MHD_NO;
    }
    j->req.api = api;
    snprintf(j->req.ns, sizeof j->req.ns, "%s", rq->ns);
    if (sid) snprintf(j->req.session_id, sizeof j->req.session_id, "%s", sid);
    struct serve_error e = { 0 };
    int rc = api->parse(srv, root, j, &e);
    json_decref(root);
    if (rc) {
        pthread_cond_init(&j->cv, NULL);
        serve_job_free(j);
        if (!e.status) serve_error_oom(&e); /* a failure that said nothing: an allocation */
        return serve_send_err(srv, c, &e, api);
    }
    return run_job(srv, c, j);
}

size_t serve_run_jobs(struct server *srv, struct MHD_Connection *c, struct job **jobs, size_t n, struct serve_error *e) {
    size_t submitted = 0;
    for (; !e->status && submitted < n; submitted++) {
        struct job *j = jobs[submitted];
        pthread_cond_destroy(&j->cv);
        j->req.t_arrival = serve_mono_ms();
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
        serve_wait_watching(srv, serve_conn_fd(c), j, false);
        pthread_mutex_unlock(&srv->mu);
        if (!e->status && j->err.status && j->err.status != 200) *e = j->err;
    }
    return submitted;
}
