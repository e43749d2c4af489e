/* sched.h — what the engine thread's files share: the sessions and the scheduler state of one
** server (server/sched.c runs the jobs, queue.c holds them, step.c decodes their tokens,
** completion.c runs /v1/completions, admit.c chooses chats' sessions).  Engine thread
** only; the HTTP side sees none of it.  Never installed. */
#ifndef KVT_SCHED_H
#define KVT_SCHED_H

#include "serve.h"

/* One conversation's session.  Busy (job != NULL) from the moment a job is given it until its
** reply is over: a busy session is never given to another job (server/admit.c). */
struct sess {
    kvt_session *s;
    int32_t seq; /* engine sequence, -1 while parked */
    char id[80], ns[80];
    double last_used; /* seconds since the epoch */
    struct job *job;  /* running job, NULL when idle */
};

/* /v1/completions run in scratch sequences comp_seq0 .. comp_seq0 + n_comp - 1 and share one
** budget of KV cells (the one cmd_serve reserves beside the sessions' budgets). */
enum { SERVE_MAX_SEQ = 64 }; /* kvt_engine_open takes at most 64 sequences */

/* The engine thread's state: everything it owns beside srv->eng, one per server (no process
** globals, so two servers can live in one process).  Created by serve_engine_open, freed by
** serve_engine_close; touched by the engine thread only. */
struct sched {
    struct sess *sess; /* [cap]: max_sessions hold a sequence, the others are parked */
    int32_t cap;
    kvt_pool *pool;
    kvt_store *store;   /* content-addressed block store; NULL with --no-store */
    uint8_t *head_bits; /* --codec-bits entropy: per-(layer, KV head) bits of q8/q4 tier codecs, or NULL */
    int32_t n_head_bits;
    bool ram_bits;        /* head_bits apply to --codec-ram (a q8/q4 codec) */
    uint64_t n_new;       /* sessions opened without a name (their ids count them) */
    const char *fallback; /* the sessions' chat template fallback (the request's tokens are made with it) */
    int32_t comp_seq0, n_comp;
    bool comp_busy[SERVE_MAX_SEQ];
    int32_t comp_cells;
    /* the prompt cache of the completions (llama-server's per-slot cache_prompt): the tokens
    ** whose KV an idle scratch sequence still holds from its last completion (its prompt and the
    ** generated tokens decoded after it); a completion takes the idle sequence sharing the
    ** longest prefix with its prompt and decodes only the rest (n_comp_tok -1: unknown, cleared
** when its completion ends).  Off (comp_cache false: each
    ** completion clears its sequence) with one KV cache for all sequences, where cells kept
    ** would take room from the others, and with a sliding window, whose cells of earlier
    ** positions are gone once it moved on. */
    bool comp_cache;
    kvt_token *comp_tok[SERVE_MAX_SEQ]; /* owned; NULL when the sequence is empty */
    char comp_ns[SERVE_MAX_SEQ][80];    /* the API key's tenant whose completion left them: another
                                        ** tenant never reuses them (unless --share-store), as with
                                        ** the store's blocks (a hit's timing would tell a prompt) */
    int32_t n_comp_tok[SERVE_MAX_SEQ], cap_comp_tok[SERVE_MAX_SEQ];
    struct job **wait; /* [parallel] admitted completions waiting for a sequence or cells, FIFO */
    int32_t n_wait;
    /* the jobs generating now; they keep taking steps while another job's prompt is prefilled
    ** (serve_prefill_decode, serve_prefill_between) */
    struct job **active; /* [parallel] */
    double *t_last;      /* [parallel] ms of each active job's last token */
    int32_t n_active;
};

/* server/queue.c: jobs between the HTTP side and the engine thread (serve_submit,
** serve_job_release, serve_job_free are in serve.h) */

/* An admitted job that cannot start yet (the session it names is generating) goes back to the
** queue at its place in arrival order; it stays queued for the client and does not count
** against --queue a second time. */
void serve_job_requeue(struct server *srv, struct job *j);
/* Drop one reference (srv->mu held); the last frees the job. */
void serve_job_release_locked(struct job *j);
/* Is the job to stop: its client left, the drain's end aborts jobs, or it ran past its deadline
** (--request-timeout-s from its arrival; j->timed_out then says which)?  Takes srv->mu. */
bool serve_job_stopped(struct server *srv, struct job *j);
/* The error of a job stopped by its deadline (408) or by the end of the drain (503) before its
** reply began; where: the stage ("queued", "prefill", ...). */
void serve_job_timeout_error(struct server *srv, struct job *j, const char *where);
/* Has the end of --drain-s aborted the jobs?  Takes srv->mu. */
bool serve_aborting(struct server *srv);
/* Seconds since the epoch; monotonic milliseconds. */
double serve_wall_s(void);
double serve_mono_ms(void);

/* server/step.c: one scheduler step and what a token does to its job */

/* The job's prompt is in: it joins the active set, and its stream may send its headers. */
void serve_job_activate(struct server *srv, struct job *j);
/* return_progress: the job's prompt has processed of its total tokens in the KV cache, cache of
** them already there when its prefill began.  Appends an event for the stream when processed grows
** (the first call always: it is the 0 % event); a no-op without return_progress.  Out of memory:
** the event is dropped (the stream misses one progress line, nothing else). */
void serve_job_progress(struct server *srv, struct job *j, int32_t total, int32_t cache, int32_t processed);
/* The job is over: logprobs built, counted in the metrics, the HTTP side woken, the engine
** thread's reference dropped. */
void serve_job_finish(struct server *srv, struct job *j);
/* One batched step of the active jobs, with the prefill chunk c (NULL: none) in the same
** llama_decode; finished ones leave the set.  Returns true if any did; *drc: the decode's error. */
bool serve_step_active(struct server *srv, const struct kvt_decode_chunk *c, int *drc);
/* Sessions and gauges for GET /v1/sessions and /metrics. */
void serve_publish(struct server *srv);
/* The prefill chunks of an admitted job (a chat's from kvt_prefill_next, a completion's cut in
** completion.c).  room: the tokens the next chunk may take (--batch-tokens less one per active
** job, at least 1; 0 with --batch-tokens 0: up to the block boundary).  decode: the chunk in a
** step of the active jobs (--batch-tokens > 0, all but a chunk that wants logits) or alone;
** KVT_ECANCELED when the job's client left or its deadline passed.  between: after a chunk was
** taken in (--batch-tokens 0, all but a run's last chunk), the active jobs take a step. */
int32_t serve_prefill_room(struct server *srv);
int serve_prefill_decode(struct server *srv, struct job *j, const struct kvt_decode_chunk *c);
void serve_prefill_between(struct server *srv, const struct kvt_decode_chunk *c);

/* server/completion.c: /v1/completions */

/* Admitted: the prompt's tokens and its KV cell reservation.  False (the job has its error) when
** it cannot run at all; else it waits for a sequence (serve_completion_start_waiting). */
bool serve_completion_prepare(struct server *srv, struct job *j);
/* Start the waiting completions, in arrival order, while a scratch sequence is free and their
** cells fit the shared budget; a cancelled one leaves without running. */
void serve_completion_start_waiting(struct server *srv);
/* The completion leaves its sequence and gives back its reservation (rc: the error, if any). */
void serve_completion_end(struct server *srv, struct job *j, int rc);
/* The prompt caches namespace ns's completions left in the idle scratch sequences are dropped (a
** completion's cache belongs to no slot: any sequence may serve id_slot N).  Returns their tokens.
** Engine thread (POST /slots/N?action=erase). */
int64_t serve_completion_forget(struct server *srv, const char *ns);

/* server/sched.c */

/* The chat's reply is over: closed in its session, which is free again (rc: the error, if any). */
void serve_chat_end(struct server *srv, struct job *j, int rc);

/* server/admit.c */

/* What admit_session found: a session, one that is generating (the job waits), or an error. */
enum pick { PICK_OK, PICK_BUSY, PICK_ERR };

/* The session a chat job runs in (*out), resumed if it was parked, new if none fits; see
** admit.c.  A busy session is never handed out: PICK_BUSY when the job names one that is
** generating (the caller puts the job back in the queue).  PICK_ERR: the job has its error,
** *out is NULL. */
enum pick admit_session(struct server *srv, struct job *j, struct sess **out);
/* The chat job's prompt as its session will decode it: the template's tokens of its messages with
** the assistant prefix, computed once per job (the job owns *tok).  Returns a library error (then
** *tok is NULL and *n 0). */
int admit_request_tokens(struct server *srv, struct job *j, const kvt_token **tok, int32_t *n);
/* May the queued job be admitted now?  Not a chat naming a session that is generating. */
bool admit_runnable(struct server *srv, const struct job *j);
/* DELETE /v1/sessions/ID: frees the session, or fills the job's error (404 none, 409 busy).
** With j->erase_slot (POST /slots/N?action=erase): none is no error, and the namespace's idle
** completion caches go too (j->n_erased). */
void admit_delete(struct server *srv, struct job *j);
/* A chat job that waits in the queue: its prompt's chain (the template's tokens, the tenant a new
** session of its namespace would use) is prefetched from the block store's disk/Redis tiers into
** RAM (kvt_store_prefetch_chain), so its routing finds the blocks in RAM when it is admitted.
** Not for a job that names an existing session or continues one's conversation (its history is
** in that session).  Engine thread; the caller holds a reference on j. */
void admit_prefetch(struct server *srv, struct job *j);

#endif
