/* eval.h — what the files of `kvtier eval` share (cmd_eval.c, eval_data.c, eval_run.c,
** eval_report.c).  Never installed; like the rest of the tool it uses only the public kvtier.h.
**
** Layout of a run: cases outer, policies inner, one engine.  A case is built once from the seed
** (haystack, needle or facts, or a held-out text) and replayed under every policy, so all
** policies see exactly the same tokens.  Each (case, policy) session produces one or more rows
** (one per NIAH case, one per multifact probe, one per scored ppl segment) and one session
** record; eval_report.c turns them into the per-policy summary, the table, the JSON, the CSV
** and the plot. */
#ifndef KVT_EVAL_H
#define KVT_EVAL_H

#include "app.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>

enum eval_task { EVAL_NIAH = 0, EVAL_MULTIFACT = 1, EVAL_PPL = 2, EVAL_RULER = 3 };

/* How a ruler case reaches the model (--shape):
**   prompt    the context and the query in one user message (RULER's own shape);
**   turns     the context as document turns (each answered "Noted."), then the query;
**   followup  the context and the first query in one message, then EVAL_FOLLOWUPS - 1 more
**             queries about the same context as follow-up user turns in the same session
**             (SCBench's shared-context, multi-turn mode). */
enum eval_shape { EVAL_SHAPE_PROMPT = 0, EVAL_SHAPE_TURNS = 1, EVAL_SHAPE_FOLLOWUP = 2 };
#define EVAL_FOLLOWUPS 5
#define EVAL_MAX_REFS  10 /* reference strings of one query (cwe: the 10 common words) */

#define EVAL_MAX_DEPTHS 16
#define EVAL_MAX_FACTS  EVAL_MAX_DEPTHS
#define EVAL_REPLY      "Noted." /* the replayed assistant reply after every document turn */
#define EVAL_MAX_CODECS 8

/* A run is a policy with a host-pool codec (--codec: kvtier and infllm once per codec), plain or
** with live ElasticKV (--elastic adds one run per listed run and scale pair, --elastic-random one
** more per pair with the matched-random control, which holds the sparsity its elastic twin reached
** in the same case); no_eviction's plain run is the ppl reference. */
/* EVAL_STORE (ruler --shape followup --store): kvtier, each query a fresh session finding the
** context in a RAM block store (SCBench's shared context across requests). */
enum eval_variant { EVAL_PLAIN = 0, EVAL_ELASTIC = 1, EVAL_ELASTIC_RANDOM = 2, EVAL_STORE = 3 };
#define EVAL_MAX_PAIRS 4
#define EVAL_MAX_RUNS  ((1 + 2 * EVAL_MAX_PAIRS) * KVT_POLICY__COUNT * EVAL_MAX_CODECS + 1)

struct eval_opts {
    enum eval_task task;
    const char *task_name; /* "niah", "multifact", "ppl" */
    const char *model, *texts, *out;
    int32_t budget, context, cases, seed, threads, max_tokens, block;
    int32_t chunk;        /* tokens of one document turn (text + framing) */
    int32_t segment;      /* ppl: tokens of held-out text per user turn */
    int32_t score_tokens; /* ppl: tokens of the next segment scored per turn */
    int32_t skip;         /* ppl: turns fed before the first scored one */
    bool json, verbose;
    bool single_prompt;                               /* niah: document + question in one user message (task "niah-single") */
    bool cases_only;                                  /* build and write the cases, run no policy (kvtier eval --cases-only) */
    int32_t ruler;                                    /* ruler: index into eval_ruler_tasks */
    int32_t shape;                                    /* ruler: enum eval_shape */
    int32_t first_case;                               /* index of the first case (--first-case): a resumed grid runs the rest */
    int32_t policies[EVAL_MAX_RUNS];                  /* enum kvt_policy of each run */
    const char *codec[EVAL_MAX_RUNS];                 /* --codec: its session's codec_ram (NULL = raw) */
    int8_t variant[EVAL_MAX_RUNS];                    /* enum eval_variant of each run */
    char label[EVAL_MAX_RUNS][96];                    /* "h2o", "kvtier/q4", "no_eviction+elastic", ... */
    int n_policies;                                   /* runs per case */
    float el_sk[EVAL_MAX_RUNS], el_sv[EVAL_MAX_RUNS]; /* live ElasticKV scales of each run */
    int32_t el_twin[EVAL_MAX_RUNS];                   /* random run: the elastic run whose sparsity it matches */
    double *el_frac;                                  /* [EVAL_MAX_RUNS]: per run, the zero fraction of the
                                             ** thresholded range at the end of the current case
                                             ** (written by eval_run_case; owned by cmd_eval) */
    int32_t depths[EVAL_MAX_DEPTHS];                  /* percent of the haystack */
    int n_depths;
    int32_t n_ctx;           /* engine context (cells); no_eviction's budget */
    int32_t fill;            /* ruler: tokens the input may take (0 = context): context, or less where
                             ** context + the queries' and replies' reserve would pass the model's
                             ** trained context (RULER sizes input + generation within the length) */
    const char *embed_model; /* --embed-model: dense recovery for kvtier, NULL = BM25 */
    float min_cosine;        /* --min-cosine: min_recovery_cosine with --embed-model */
    kvt_embedder *embedder;  /* opened from embed_model by cmd_eval */
};

/* ---- seeded randomness: splitmix64, one independent stream per (seed, purpose, index) ---- */
struct eval_rng {
    uint64_t s;
};
void eval_rng_init(struct eval_rng *r, uint64_t seed, const char *stream, int64_t index);
uint64_t eval_rng_next(struct eval_rng *r);
uint32_t eval_rng_below(struct eval_rng *r, uint32_t n); /* uniform in [0, n); n > 0 */

/* ---- the text corpus: the essays of a directory, as sentences ---- */
struct eval_essay {
    char *name; /* file name */
    char *text; /* whitespace-normalised text; sentences point into it */
    int32_t *s_off, *s_len;
    int32_t *s_tok; /* tokens of each sentence, -1 until counted */
    int32_t n_sent;
    bool held_out; /* reserved for ppl: never used in a haystack */
};

struct eval_corpus {
    char dir[1024];
    struct eval_essay *e;
    int n;
    int n_held_out;
    char **words; /* distinct lowercase words (3-10 letters) of the haystack essays, sorted; built by
                  ** eval_corpus_words, freed with the corpus */
    int32_t n_words;
};

/* The corpus's word list (ruler's keys and common words), built once.  0, or -1 on ENOMEM. */
int eval_corpus_words(struct eval_corpus *c);

/* Find the texts directory (--texts, else $KVT_SOURCE_DIR/../shared/data/pg_essays, else next
** to the executable's checkout, else ../shared/data/pg_essays) and load every *.txt in it
** (LICENSE* skipped), sorted by name; every fifth essay is held out for ppl.  Returns APP_OK,
** or APP_USAGE / APP_ERR with a message naming the directory.  Free with eval_corpus_free. */
int eval_corpus_load(const char *cmd, const char *texts_opt, struct eval_corpus *c);
void eval_corpus_free(struct eval_corpus *c);
/* The essays in order, joined by single spaces, up to the first essay that brings the text to at
** least min_bytes (all of them if they hold less).  Caller frees; NULL when out of memory. */
char *eval_corpus_join(const struct eval_corpus *c, size_t min_bytes);

/* ---- one case ---- */
struct eval_fact {
    char name[48], attr[32], number[40];
    char statement[192]; /* "The secret code of Tavoren is 48213." */
    char question[512];  /* "What is the secret code of Tavoren? Answer with the number." */
    char answer[704];    /* the teacher-forced expected reply */
    char prefix[320];    /* the answer up to the number: "The secret code of Tavoren is" */
    int32_t depth;       /* percent of the haystack where the statement sits */
    /* ruler: the reference strings; the score is the fraction of them the reply contains
    ** (case-insensitive: RULER's string_match_all); number is refs[0].  0 for the other tasks. */
    char refs[EVAL_MAX_REFS][40];
    int32_t n_refs;
};

struct eval_case {
    int32_t index; /* 0-based */
    int32_t depth; /* NIAH: the needle's depth (percent); else -1 */
    char **turns;  /* user messages of the document, each followed by EVAL_REPLY */
    char *single;  /* --single-prompt: the whole document and the question in one user
                                ** message (turns are then not fed); NULL otherwise */
    int32_t n_turns;
    struct eval_fact facts[EVAL_MAX_FACTS];
    int32_t n_facts;
    int32_t probe_order[EVAL_MAX_FACTS]; /* multifact: facts in the order probed */
    /* ppl: turns[k] is segment k; score[k] the next segment's text (turns fed: n_turns) */
    char **score;
    int32_t n_tokens; /* tokens of the formatted conversation up to the first question
                                ** (NIAH/multifact) or of all fed turns (ppl) */
    char essays[256]; /* names of the essays used, for the record */
};

/* ---- text pieces: what a haystack is made of, joined into messages ---- */
struct eval_piece {
    const char *p; /* not owned */
    int32_t len, tok;
    int32_t fact; /* -1: filler; else the fact it states */
};
struct eval_pieces {
    struct eval_piece *v;
    int32_t n, cap;
    int32_t tok;
    char sep; /* between pieces when joined; 0 = ' ' */
};
int eval_pieces_push(struct eval_pieces *ps, struct eval_piece pc); /* 0, -1 on ENOMEM */
/* Essay sentences (held-out ones for ppl) from a seeded start until ps->tok >= target; sentences
** over max_tok skipped; the essays used are listed in names.  0, or -1 (ENOMEM, tokenizer, too
** little text). */
int eval_take_text(kvt_engine *eng, struct eval_corpus *c, struct eval_rng *r, bool held_out, int32_t target, int32_t max_tok,
                   struct eval_pieces *ps, char *names, size_t names_len);
/* Pieces [a, b) joined by ps->sep after prefix; caller frees; NULL on ENOMEM. */
char *eval_join(const char *prefix, const struct eval_pieces *ps, int32_t a, int32_t b);
/* intro (NULL: the niah one), the pieces, a blank line, the question; caller frees. */
char *eval_single_message(const struct eval_pieces *ps, const char *intro, const char *question);
/* k->turns: the pieces as document turns of at most body tokens of text, the first one opening
** with the document convention and task_intro (NULL: none).  0, or -1 on ENOMEM. */
int eval_make_turns(const struct eval_pieces *ps, int32_t body, const char *task_intro, struct eval_case *k);
/* Tokens of the conversation as the engine's template formats it: every turn followed by the
** replayed reply, then question (if any) with the assistant prefix; -1 on failure. */
int32_t eval_conversation_tokens(kvt_engine *eng, char *const *turns, int32_t n_turns, const char *question);
void eval_free_strings(char **t, int32_t n);

/* ---- ruler (eval/ruler.c) ---- */
struct eval_ruler_task {
    const char *name;  /* RULER's task name: niah_single_1, ..., vt, cwe, fwe */
    const char *about; /* one line for --help */
};
extern const struct eval_ruler_task eval_ruler_tasks[];
extern const int32_t eval_ruler_n_tasks;
/* Index of the task called name, -1 if none. */
int32_t eval_ruler_find(const char *name);
/* Whether the task has distinct queries for the followup shape (the keyed ones: niah_*, vt). */
bool eval_ruler_has_followups(int32_t task);
/* Build case `index` of ruler task o->ruler in shape o->shape (see eval_case_build). */
int eval_ruler_case_build(kvt_engine *eng, struct eval_corpus *c, const struct eval_opts *o, int32_t index, struct eval_case *k);

/* Build case `index` of the task from the corpus and the seed (deterministic).  The conversation
** up to the first question is at most o->context tokens (ruler: o->fill) as the engine's chat template formats
** it.  Returns APP_OK or APP_ERR (message printed).  Free with eval_case_free. */
int eval_case_build(const char *cmd, kvt_engine *eng, struct eval_corpus *c, const struct eval_opts *o, int32_t index,
                    struct eval_case *k);
void eval_case_free(struct eval_case *k);

/* Tokens the chat template and the part header add around one document turn's text (plus the
** introduction of the first turn when intro), as the engine formats them; -1 on failure. */
int32_t eval_framing_tokens(kvt_engine *eng, bool intro);

/* Tokens of text (no BOS, no special parsing); -1 on failure. */
int32_t eval_count_tokens(kvt_engine *eng, const char *text);

/* ---- results ---- */
struct eval_row {
    int32_t pi;               /* index into o->policies */
    int32_t case_index, item; /* item: multifact probe number, ppl turn; 0 for NIAH */
    int32_t depth;            /* percent, -1 when not applicable (ppl) */
    int32_t n;                /* trials in this row: 1, or the scored tokens of a ppl segment */
    int32_t passed;           /* passes among them (ruler: all references in the reply) */
    int32_t refs, refs_hit;   /* ruler: reference strings of the query and how many the reply contains, any case
                              ** (RULER's string_match_all score is refs_hit / refs); else 1 and passed */
    double answer_logprob;    /* nats, summed over answer_tokens */
    int32_t answer_tokens;
    double number_logprob;         /* log P(number + "." | question, answer prefix), nats; NaN for ppl */
    int32_t prefix_passed;         /* number_logprob > ln 1/2: the number is then the greedy continuation
                            ** of the teacher-forced prefix (every token's conditional is > 1/2) */
    int64_t evictions, recoveries; /* the session's counts when the row was taken */
    int32_t tokens;                /* conversation tokens when the row was taken */
    int32_t peak_resident;
    double ttft_ms; /* question add + first token; NaN for ppl */
    double nll;     /* ppl: mean NLL per scored token (nats); NaN otherwise */
    double kl;      /* ppl: mean KL(no_eviction || policy) per token over the full
                            ** vocabulary (nats); NaN without a reference */
    bool error;
    int32_t fact; /* enum eval_fact_state: where the probed fact's statement was when
                            ** the question had been added (after its recovery); ppl: unknown */
    char *reply;  /* generated reply (malloc'd), "" for ppl */
};

/* Where a probed fact's statement (located by its number's first occurrence in the block texts)
** was once the question had been added: what a failed case needs to say why it failed. */
enum eval_fact_state {
    EVAL_FACT_UNKNOWN = 0,   /* not found in the block texts (ppl rows; detokenization split) */
    EVAL_FACT_RESIDENT = 1,  /* resident, never evicted */
    EVAL_FACT_RECOVERED = 2, /* evicted, then recovered: resident again */
    EVAL_FACT_EVICTED = 3,   /* evicted and not resident (at least one of its blocks) */
};
const char *eval_fact_state_name(int32_t state);

struct eval_sess {
    int32_t pi, case_index;
    int64_t evictions, recoveries, tokens_decoded, tokens_recovered;
    int32_t peak_resident, total_tokens;
    double seconds, policy_ms, decode_ms;
    bool error;
    /* host pool saves (kvt_session_stats.pool_*): tokens, raw and stored (encoded) bytes */
    int64_t pool_tokens, pool_raw_bytes, pool_bytes;
    double encode_ms, decode_codec_ms;
};

/* The ppl reference: no_eviction's full next-token log-softmax at every scored position
** (n_vocab floats a row; 1 MiB for Gemma 3's 262144), written to an anonymous temporary file so
** that long runs do not hold gigabytes in RAM.  Row r of turn t is at row index off[t] + r. */
struct eval_ref {
    FILE *f; /* tmpfile(), NULL until the reference ran */
    int32_t n_vocab;
    int64_t *off; /* [n_seg] first row of each turn */
    int32_t *n;   /* [n_seg] positions scored per turn */
    int32_t n_seg;
    int64_t n_rows; /* rows written */
};

struct eval_results {
    struct eval_row *rows;
    int32_t n_rows, cap_rows;
    struct eval_sess *sess;
    int32_t n_sess, cap_sess;
    int32_t ref_pi; /* index of no_eviction in o->policies, -1 if not run */
};

int eval_add_row(struct eval_results *r, const struct eval_row *row); /* copies; takes reply */
int eval_add_sess(struct eval_results *r, const struct eval_sess *s);
void eval_results_free(struct eval_results *r);

/* Run one case under policy o->policies[pi] on a fresh session (sequence 0 of eng, which must
** be empty; it is empty again afterwards), appending rows and one session record, and printing
** progress on stderr.  ref: the ppl reference, filled when the policy is no_eviction and read
** otherwise (NULL for other tasks).  A library error in the session is printed, recorded as an
** errored session/row and returned as APP_ERR; the caller goes on with the next policy. */
int eval_run_case(const char *cmd, kvt_engine *eng, kvt_pool *pool, const struct eval_opts *o, int32_t pi,
                  const struct eval_case *k, struct eval_ref *ref, struct eval_results *res);

void eval_ref_free(struct eval_ref *ref);

/* ---- reporting ---- */
struct eval_stamp {
    char model[192], model_file[256], llama[512], commit[64], date[32], stamp[32], machine[256];
    int32_t n_threads;
};
void eval_stamp_fill(struct eval_stamp *st, const struct kvt_engine_info *info, const char *model_path, int32_t n_threads);

/* Wilson score interval (95 %, z = 1.96) of k passes in n trials; [0, 1] for n = 0. */
void eval_wilson(int64_t k, int64_t n, double *lo, double *hi);

/* Print the table on stdout, write <out>/<task>-<stamp>.{json,csv,png}, and with --json print
** the summary object as the last stdout line.  Returns APP_OK or APP_ERR (an output file could
** not be written; the message names it).  A missing gnuplot is a warning, not an error. */
int eval_report(const char *cmd, const struct eval_opts *o, const struct eval_stamp *st, const struct eval_results *res,
                const struct eval_case *cases, int32_t n_cases, double seconds);

#endif
