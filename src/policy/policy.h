/* policy.h — block scores shared by the session (src/session/) and the tests.  Never installed. */
#ifndef KVT_POLICY_H
#define KVT_POLICY_H

#include "kvtier.h"

/* Weights of the kvtier multi-signal score (each signal in [0, 1]).  Relevance leads: a block
** the current message asks about should survive; attention breaks ties among the rest; recency
** keeps the conversation's thread.  Role floors keep user/assistant text above system filler
** when other signals are silent. */
#define KVT__W_RECENCY       0.35
#define KVT__W_RELEVANCE     0.45
#define KVT__W_ATTENTION     0.20
#define KVT__FLOOR_USER      0.20
#define KVT__FLOOR_ASSISTANT 0.10
#define KVT__BONUS_PREFER    0.50

/* What a score needs beyond the block itself. */
struct kvt__score_ctx {
    kvt_pos now;          /* next position of the session */
    kvt_pos oldest;       /* smallest p0 + n_tokens among resident blocks */
    double max_relevance; /* over resident blocks */
    double max_ewma;      /* over resident blocks */
};

/* Exponentially weighted moving average: alpha * x + (1 - alpha) * prev. */
static inline double kvt__ewma(double prev, double x, double alpha) { return alpha * x + (1 - alpha) * prev; }

/* Keep-score of block b under a policy (higher = keep).  Pure. */
double kvt__score(int32_t policy, const struct kvt_block_info *b, const struct kvt__score_ctx *c);

#endif
