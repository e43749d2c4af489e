/* policy.c — eviction policies: names, the attention-mass signal, and block scores.
**
** A policy turns a block's signals into a keep-score (higher = keep); src/session/blocks.c evicts the
** lowest-scored unprotected blocks.  The signals are kept on struct kvt_block_info:
**   recency      p0 + n_tokens (StreamingLLM keeps the recent window; Xiao et al. 2023)
**   attn_mass    attention received, accumulated over every captured query (H2O; Zhang et al.
**                2023, "heavy hitters")
**   attn_window  attention from the last observation window of the prompt (SnapKV; Li et al.
**                2024)
**   attn_ewma    exponentially weighted attention share per ubatch (kvtier)
**   relevance    BM25 of the block text against the latest user message (kvtier) */
#include "internal.h"
#include "policy/policy.h"

#include <jansson.h>
#include <math.h>
#include <string.h>

static const char *const policy_names[KVT_POLICY__COUNT] = {
    [KVT_POLICY_KVTIER] = "kvtier",     [KVT_POLICY_NO_EVICTION] = "no_eviction",
    [KVT_POLICY_TRUNCATE] = "truncate", [KVT_POLICY_STREAMING] = "streaming",
    [KVT_POLICY_H2O] = "h2o",           [KVT_POLICY_SNAPKV] = "snapkv",
    [KVT_POLICY_INFLLM] = "infllm",
};

static const char *const recovery_names[] = { "kv_restore", "discard", "breadcrumb" };

int kvt_policy_from_name(const char *name, int32_t *policy) {
    for (int32_t i = 0; i < KVT_POLICY__COUNT; i++)
        if (name && !strcmp(name, policy_names[i])) {
            *policy = i;
            return 0;
        }
    return kvt__fail(KVT_EINVAL, "unknown policy '%s' (known: kvtier, no_eviction, truncate, streaming, h2o, snapkv, infllm)",
                     name ? name : "(null)");
}

const char *kvt_policy_name(int32_t policy) { return policy >= 0 && policy < KVT_POLICY__COUNT ? policy_names[policy] : "unknown"; }

int kvt_recovery_from_name(const char *name, int32_t *recovery) {
    for (int32_t i = 0; i < 3; i++)
        if (name && !strcmp(name, recovery_names[i])) {
            *recovery = i;
            return 0;
        }
    return kvt__fail(KVT_EINVAL, "unknown recovery '%s' (known: kv_restore, discard, breadcrumb)", name ? name : "(null)");
}

const char *kvt_recovery_name(int32_t recovery) { return recovery >= 0 && recovery < 3 ? recovery_names[recovery] : "unknown"; }

int kvt_attn_block_mass(const kvt_attn *a, int32_t q_from, const float *head_w, const kvt_pos *p0, const int32_t *n,
                        int32_t n_blocks, double *mass) {
    if (q_from < 0 || q_from >= a->n_query)
        return kvt__fail(KVT_EINVAL, "observation rows start at %d; the capture has %d queries", q_from, a->n_query);
    for (int32_t b = 0; b < n_blocks; b++) mass[b] = 0;
    double wsum = 0;
    for (int32_t h = 0; h < a->n_head; h++) wsum += head_w ? head_w[h] : 1.0;
    if (wsum <= 0) return kvt__fail(KVT_EINVAL, "head weights sum to %g", wsum);
    const double norm = 1.0 / ((double) (a->n_query - q_from) * wsum);
    for (int32_t k = 0; k < a->n_keys; k++) {
        int32_t blk = -1;
        for (int32_t b = 0; b < n_blocks && blk < 0; b++)
            if (a->k_pos[k] >= p0[b] && a->k_pos[k] < p0[b] + n[b]) blk = b;
        if (blk < 0) continue;
        double sum = 0;
        for (int32_t t = q_from; t < a->n_query; t++)
            for (int32_t h = 0; h < a->n_head; h++)
                sum += (head_w ? head_w[h] : 1.0) * a->w[((size_t) t * a->n_head + h) * a->n_keys + k];
        mass[blk] += sum * norm;
    }
    return 0;
}

int kvt_head_weights_load(const char *path, const int32_t *layers, int32_t n_layers, int32_t n_head, float *w) {
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root) return kvt__fail(KVT_EIO, "head profile '%s': %s (line %d)", path, err.text, err.line);
    int rc = 0;
    json_t *ls = json_object_get(root, "layers");
    if (!json_is_array(ls)) rc = kvt__fail(KVT_EFORMAT, "head profile '%s' has no \"layers\" array", path);
    for (int32_t i = 0; rc == 0 && i < n_layers; i++) {
        json_t *lay = NULL, *x;
        size_t k;
        json_array_foreach(ls, k, x) {
            if (json_integer_value(json_object_get(x, "layer")) == layers[i]) lay = x;
        }
        json_t *heads = lay ? json_object_get(lay, "heads") : NULL;
        if (!json_is_array(heads) || (int32_t) json_array_size(heads) != n_head) {
            rc = kvt__fail(KVT_EFORMAT, "head profile '%s': layer %d missing or without %d heads", path, layers[i], n_head);
            break;
        }
        double inv_mean = 0;
        for (int32_t h = 0; h < n_head; h++) {
            json_t *e = json_object_get(json_array_get(heads, (size_t) h), "entropy_bits");
            if (!json_is_number(e)) {
                rc = kvt__fail(KVT_EFORMAT, "head profile '%s': layer %d head %d has no entropy_bits", path, layers[i], h);
                break;
            }
            double hb = fmax(json_number_value(e), 0.05);
            w[i * n_head + h] = (float) (1.0 / hb);
            inv_mean += 1.0 / hb / n_head;
        }
        for (int32_t h = 0; rc == 0 && h < n_head; h++) w[i * n_head + h] = (float) (w[i * n_head + h] / inv_mean);
    }
    json_decref(root);
    return rc;
}

double kvt__score(int32_t policy, const struct kvt_block_info *b, const struct kvt__score_ctx *c) {
    switch (policy) {
        case KVT_POLICY_H2O: return b->attn_mass;
        case KVT_POLICY_SNAPKV: return b->attn_window;
        case KVT_POLICY_KVTIER: {
            /* each signal normalised to [0, 1] over the resident blocks, then weighted */
            double rec = c->now > c->oldest ? (double) (b->p0 + b->n_tokens - c->oldest) / (double) (c->now - c->oldest) : 1;
            double rel = c->max_relevance > 0 ? b->relevance / c->max_relevance : 0;
            double att = c->max_ewma > 0 ? b->attn_ewma / c->max_ewma : 0;
            double s = KVT__W_RECENCY * rec + KVT__W_RELEVANCE * rel + KVT__W_ATTENTION * att;
            if (b->role == KVT_ROLE_USER) s = fmax(s, KVT__FLOOR_USER);
            else if (b->role == KVT_ROLE_ASSISTANT) s = fmax(s, KVT__FLOOR_ASSISTANT);
            if (b->keep == KVT_KEEP_PREFER) s += KVT__BONUS_PREFER;
            return s;
        }
        default: return (double) (b->p0 + b->n_tokens); /* recency: streaming, truncate */
    }
}
