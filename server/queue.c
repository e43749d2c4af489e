/* queue.c — the jobs of `kvtier serve` between the HTTP side and the engine thread: submit (the
** global and per-key queue limits), requeue in arrival order, references, and a job's error and
** stop conditions (client gone, --request-timeout-s, the end of --drain-s).  Any thread; the
** queue is under srv->mu. */
#include "sched.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void serve_job_free(struct job *j) {
    if (!j) return;
    for (int32_t i = 0; i < j->req.n_msgs; i++) {
        free((char *) j->req.msgs[i].role);
        free((char *) j->req.msgs[i].content);
    }
    free(j->req.msgs);
    free(j->req.prompt);
    free(j->req.prompt_ids);
    free(j->req.bias);
    json_decref(j->req.resp_turn);
    json_decref(j->req.ignored);
    json_decref(j->req.resp_fields);
    free(j->req.grammar);
    kvt_grammar_free(j->req.smp.grammar);
    for (int32_t i = 0; i < j->req.n_stop; i++) free(j->req.stop[i]);
    for (int32_t i = 0; i < j->req.n_dry_breakers; i++) free(j->req.dry_breakers[i]);
    free(j->text);
    free(j->gen);
    free(j->prog);
    free(j->post);
    free(j->lp);
    free(j->top_tok);
    free(j->top_lp);
    free(j->ptok);
    free(j->pen);
    free(j->row.logits);
    pthread_cond_destroy(&j->cv);
    free(j);
}
void serve_running_remove(struct server *srv, struct job *j) {
    for (struct job **pp = &srv->running; *pp; pp = &(*pp)->run_next)
        if (*pp == j) {
            *pp = j->run_next;
            j->run_next = NULL;
            return;
        }
}
int serve_submit(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    if (srv->stopping) {
        pthread_mutex_unlock(&srv->mu);
        return 503;
    }
    /* --queue and --queue-per-key count the requests waiting for a --parallel slot.  Jobs sit in
    ** the queue until the engine thread's next round takes them, free slots or not: walking it in
    ** arrival order, as that round does, the free slots go to the jobs it can start, and the others
    ** wait.  It cannot start a job whose session is generating (marked blocked by its last round)
    ** or that names the session of a job queued before it.  A job that finds a slot left is not
    ** waiting: requests arriving together while slots are free are never refused. */
    int64_t slots = srv->parallel > srv->m.active ? srv->parallel - srv->m.active : 0;
    int32_t waiting = 0, mine = 0;
    bool behind = false; /* j names the session of a running or queued job */
    for (struct job *r = srv->running; r && !behind; r = r->run_next) behind = serve_same_session(r, j);
    for (struct job *q = srv->head; q; q = q->next) {
        if (q->kind == JOB_DELETE) continue;
        behind = behind || serve_same_session(q, j);
        if (!q->blocked && slots > 0) {
            slots--;
            continue;
        }
        waiting++;
        mine += !strcmp(q->req.ns, j->req.ns);
    }
    if (j->kind != JOB_DELETE && (slots == 0 || behind)) {
        int rc = waiting >= srv->max_queue ? 429 : srv->queue_per_key < srv->max_queue && mine >= srv->queue_per_key ? 430 : 0;
        if (rc) { /* 430: 429 for the client, this key's share is full */
            pthread_mutex_unlock(&srv->mu);
            return rc;
        }
    }
    j->blocked = behind;
    j->state = JOB_QUEUED;
    j->refs = 2;
    j->ticket = srv->n_tickets++;
    j->next = NULL;
    if (srv->tail) srv->tail->next = j;
    else srv->head = j;
    srv->tail = j;
    srv->n_queued++;
    srv->m.queue_len = srv->n_queued;
    pthread_cond_signal(&srv->work);
    pthread_mutex_unlock(&srv->mu);
    return 0;
}
/* An admitted job that cannot start yet (the session it names is generating) goes back to the
** queue at its place in arrival order; it is admitted again once runnable() says so.  It stays
** queued for the client (not an error) and does not count against --queue a second time. */
void serve_job_requeue(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    struct job **pp = &srv->head;
    while (*pp && (*pp)->ticket < j->ticket) pp = &(*pp)->next;
    j->next = *pp;
    *pp = j;
    if (!j->next) srv->tail = j;
    j->state = JOB_QUEUED;
    j->blocked = true; /* its session is generating: waiting, whatever slots are free */
    serve_running_remove(srv, j);
    srv->n_queued++;
    srv->m.queue_len = srv->n_queued;
    srv->m.active--;
    pthread_mutex_unlock(&srv->mu);
}
/* under srv->mu */
void serve_job_release_locked(struct job *j) {
    if (--j->refs == 0) serve_job_free(j);
}
void serve_job_release(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    serve_job_release_locked(j);
    pthread_mutex_unlock(&srv->mu);
}
/* Is the job to stop: its client left, or it ran past its deadline (--request-timeout-s, from
** its arrival; j->timed_out then says which)?  Any thread may set cancelled: read under srv->mu. */
bool serve_job_stopped(struct server *srv, struct job *j) {
    pthread_mutex_lock(&srv->mu);
    bool stop = j->cancelled || srv->abort_jobs;
    pthread_mutex_unlock(&srv->mu);
    if (!stop && j->req.deadline > 0 && serve_mono_ms() > j->req.deadline) stop = j->timed_out = true;
    return stop;
}
/* The error of a job stopped by its deadline (or by the end of the drain) before its reply began. */
void serve_job_timeout_error(struct server *srv, struct job *j, const char *where) {
    if (j->timed_out)
        serve_error_set(&j->err, 408, "invalid_request_error", "request_timeout",
                        "the request ran past --request-timeout-s %d (%s)", srv->lim.request_timeout_s, where);
    else
        serve_error_set(&j->err, 503, "server_error", "shutting_down", "the server is shutting down (--drain-s %d passed; %s)",
                        srv->lim.drain_s, where);
}
bool serve_aborting(struct server *srv) {
    pthread_mutex_lock(&srv->mu);
    bool a = srv->abort_jobs;
    pthread_mutex_unlock(&srv->mu);
    return a;
}
double serve_wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}
double serve_mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int serve_job_grammar(struct server *srv, struct job *j) {
    if (!j->req.grammar || j->req.smp.grammar) return 0;
    {
        int rc = kvt_grammar_new(srv->eng, j->req.grammar, "root", &j->req.smp.grammar);
        if (rc && j->req.grammar_user) { /* the client's GBNF */
            serve_error_set(&j->err, 400, "invalid_request_error", NULL, "'grammar' is not valid GBNF: %s", kvt_errmsg());
            serve_error_param(&j->err, "grammar");
            return -1;
        }
        if (rc) { /* our own translation of the schema failed: say which text */
            serve_error_set(&j->err, 400, "invalid_request_error", NULL,
                            "the tools / response_format / json_schema schema could not be compiled to a grammar: %s",
                            kvt_errmsg());
            return -1;
        }
    }
    return 0;
}
