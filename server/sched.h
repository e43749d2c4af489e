/* sched.h — what the engine thread's files share: the sessions and the scheduler state of one
** server (server/sched.c runs the jobs, server/admit.c chooses their sessions).  Engine thread
** only; the HTTP side sees none of it.  Never installed. */
#ifndef KVT_SCHED_H
#define KVT_SCHED_H

#include "serve.h"

/* One conversation's session.  Busy (job != NULL) from the moment a job is given it until its
** reply is over: a busy session is never given to another job (server/admit.c). */
struct sess {
    kvt_session *s;
    int32_t      seq;        /* engine sequence, -1 while parked */
    char         id[80], ns[80];
    double       last_used;  /* seconds since the epoch */
    struct job  *job;        /* running job, NULL when idle */
};

/* /v1/completions run in scratch sequences comp_seq0 .. comp_seq0 + n_comp - 1 and share one
** budget of KV cells (the one cmd_serve reserves beside the sessions' budgets). */
enum { SERVE_MAX_SEQ = 64 }; /* kvt_engine_open takes at most 64 sequences */

/* The engine thread's state: everything it owns beside srv->eng, one per server (no process
** globals, so two servers can live in one process).  Created by serve_engine_open, freed by
** serve_engine_close; touched by the engine thread only. */
struct sched {
    struct sess *sess;          /* [cap]: max_sessions hold a sequence, the others are parked */
    int32_t      cap;
    kvt_pool    *pool;
    kvt_store   *store;         /* content-addressed block store; NULL with --no-store */
    uint64_t     n_new;         /* sessions opened without a name (their ids count them) */
    const char  *fallback;      /* the sessions' chat template fallback (request tokens must agree) */
    int32_t      comp_seq0, n_comp;
    bool         comp_busy[SERVE_MAX_SEQ];
    int32_t      comp_cells;
    struct job **wait;          /* [parallel] admitted completions waiting for a sequence or cells, FIFO */
    int32_t      n_wait;
    /* the jobs generating now; shared with the chunk callback, which keeps them generating while
    ** another job's prompt is prefilled */
    struct job **active;        /* [parallel] */
    double      *t_last;        /* [parallel] ms of each active job's last token */
    int32_t      n_active;
    struct job  *prefilling;    /* the job whose prompt is being prefilled, NULL between prefills */
};

/* server/sched.c, for server/admit.c */

/* Fill the job's error (status, OpenAI error type, code or NULL, message). */
void serve_job_error(struct job *j, int status, const char *type, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* A library error as an HTTP error: input the library refused is the client's (400), the rest
** is ours (500).  what: the step that failed ("prompt"). */
void serve_job_lib_error(struct job *j, const char *what, int rc);
/* The chunk callback of every session (ud: the server): between the prefill chunks of one job,
** the active ones take a batched step. */
void serve_on_chunk(void *ud);
/* Give a new session the server's prefill schedule: mixed prefill hooks (--batch-tokens > 0),
** else the chunk callback serve_on_chunk. */
void serve_session_hooks(struct server *srv, kvt_session *s);

/* server/admit.c */

/* What admit_session found: a session, one that is generating (the job waits), or an error. */
enum pick { PICK_OK, PICK_BUSY, PICK_ERR };

/* The session a chat job runs in (*out), resumed if it was parked, new if none fits; see
** admit.c.  A busy session is never handed out: PICK_BUSY when the job names one that is
** generating (the caller puts the job back in the queue).  PICK_ERR: the job has its error,
** *out is NULL. */
enum pick admit_session(struct server *srv, struct job *j, struct sess **out);
/* May the queued job be admitted now?  Not a chat naming a session that is generating. */
bool admit_runnable(struct server *srv, const struct job *j);
/* DELETE /v1/sessions/ID: frees the session, or fills the job's error (404 none, 409 busy). */
void admit_delete(struct server *srv, struct job *j);
/* A chat job that waits in the queue: its prompt's chain (the template's tokens, the tenant a new
** session of its namespace would use) is prefetched from the block store's disk/Redis tiers into
** RAM (kvt_store_prefetch_chain), so its routing finds the blocks in RAM when it is admitted.
** Not for a job that names an existing session or continues one's conversation (its history is
** in that session).  Engine thread; the caller holds a reference on j. */
void admit_prefetch(struct server *srv, struct job *j);

#endif
