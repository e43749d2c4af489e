/* entropy.c — attention entropy per head, the head classes it implies, and the entropy-adaptive
** per-head budget.  A head whose last query spreads its weight over many keys (high entropy)
** needs more of the context kept than one that looks at a few (attention sinks, local heads);
** the budget scales a base budget by the head's entropy relative to the model's mean, after the
** head-wise adaptive budgets of Ada-KV (Feng et al. 2024) and entropy-guided allocation in the
** style of PyramidKV (Cai et al. 2024).  Pure functions; thread-safe. */
#include "internal.h"

#include <math.h>
#include <stdint.h>

double kvt_entropy_bits(const float *w, int32_t n) {
    if (!w || n <= 0) return 0.0;
    /* H = -sum p log2 p with p = w / Z, computed as log2 Z - (1/Z) sum w log2 w so that the
    ** input needs one pass to normalise and one to sum.  Zero, negative and non-finite weights
    ** carry no probability mass and are skipped. */
    double z = 0.0;
    for (int32_t i = 0; i < n; i++)
        if (w[i] > 0.0f && isfinite(w[i])) z += (double) w[i];
    if (!(z > 0.0) || !isfinite(z)) return 0.0;
    double h = 0.0;
    for (int32_t i = 0; i < n; i++) {
        if (!(w[i] > 0.0f) || !isfinite(w[i])) continue;
        const double p = (double) w[i] / z;
        h -= p * log2(p);
    }
    return h > 0.0 ? h : 0.0; /* rounding can leave -1e-17 for a one-hot row */
}

int32_t kvt_head_classify(double bits) {
    if (bits < 0.5) return KVT_HEAD_SINK;
    if (bits < 1.5) return KVT_HEAD_FOCUSED;
    if (bits < 3.0) return KVT_HEAD_MODERATE;
    return KVT_HEAD_MIXED; /* also NaN: no evidence the head is narrow */
}

const char *kvt_head_class_name(int32_t cls) {
    switch (cls) {
        case KVT_HEAD_SINK: return "sink";
        case KVT_HEAD_FOCUSED: return "focused";
        case KVT_HEAD_MODERATE: return "moderate";
        case KVT_HEAD_MIXED: return "mixed";
        default: return "unknown";
    }
}

int32_t kvt_entropy_budget(int32_t base, double h, double mean_h) {
    if (!(mean_h > 0.0) || !isfinite(mean_h)) return base;
    double r = h / mean_h;
    if (!(r >= 0.3)) r = 0.3; /* also NaN: the lower clamp */
    if (r > 2.5) r = 2.5;
    /* The epsilon keeps products that are integral in exact arithmetic (100 * 0.3) from
    ** rounding down to the integer below. */
    const double b = floor((double) base * r + 1e-9);
    if (b >= (double) INT32_MAX) return INT32_MAX;
    if (b <= (double) INT32_MIN) return INT32_MIN;
    return (int32_t) b;
}
