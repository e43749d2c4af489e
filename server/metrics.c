/* metrics.c — what `kvtier serve` measures, as GET /metrics shows it: latency histograms with
** fixed upper bounds (Prometheus style) and the counters and gauges of struct metrics, printed
** in the Prometheus text format 0.0.4.  The engine thread and the HTTP threads fill srv->m under
** srv->mu (server/sched.c, server/http.c); this file adds histogram samples and prints. */
#include "serve.h"

#include <stdio.h>
#include <stdlib.h>

/* upper bounds of the histogram buckets, ms (the last bucket, +Inf, has none) */
static const double hist_bounds[HIST_N] = { 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000 };

void serve_hist_add(struct hist *h, double ms) {
    int i = 0;
    while (i < HIST_N && ms > hist_bounds[i]) i++;
    h->bucket[i]++;
    h->count++;
    h->sum += ms;
}

static void hist_text(FILE *f, const char *name, const char *help, const struct hist *h) {
    fprintf(f, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    int64_t cum = 0;
    for (int i = 0; i < HIST_N; i++) {
        cum += h->bucket[i];
        fprintf(f, "%s_bucket{le=\"%g\"} %lld\n", name, hist_bounds[i] / 1e3, (long long) cum);
    }
    cum += h->bucket[HIST_N];
    fprintf(f, "%s_bucket{le=\"+Inf\"} %lld\n%s_sum %.6f\n%s_count %lld\n", name, (long long) cum, name, h->sum / 1e3, name,
            (long long) h->count);
}

char *serve_metrics_text(struct server *srv) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) return NULL;
    pthread_mutex_lock(&srv->mu);
    struct metrics m = srv->m;
    pthread_mutex_unlock(&srv->mu);
    fprintf(f, "# HELP kvtier_requests_total HTTP responses by status class.\n# TYPE kvtier_requests_total counter\n");
    for (int i = 1; i < 6; i++) fprintf(f, "kvtier_requests_total{status=\"%dxx\"} %lld\n", i, (long long) m.by_status[i]);
#define COUNTER(name, help, v) fprintf(f, "# HELP " name " " help "\n# TYPE " name " counter\n" name " %lld\n", (long long) (v))
#define GAUGE(name, help, v)   fprintf(f, "# HELP " name " " help "\n# TYPE " name " gauge\n" name " %lld\n", (long long) (v))
    COUNTER("kvtier_prompt_tokens_total", "Prompt tokens of finished requests.", m.prompt_tokens);
    COUNTER("kvtier_generated_tokens_total", "Generated tokens.", m.completion_tokens);
    COUNTER("kvtier_prompt_tokens_reused_total", "Prompt tokens found in a session's cache.", m.prompt_reused);
    COUNTER("kvtier_prompt_tokens_decoded_total", "Prompt tokens run through the model.", m.prompt_decoded);
    COUNTER("kvtier_evictions_total", "KV block evictions.", m.evictions);
    COUNTER("kvtier_recoveries_total", "KV block recoveries (kv_restore loads).", m.recoveries);
    COUNTER("kvtier_recomputes_total", "KV blocks re-decoded because their saved copy was lost.", m.recomputes);
    COUNTER("kvtier_pool_dropped_total", "Saved KV blocks the host pool dropped (failed spill or disk quota).", m.pool_dropped);
    COUNTER("kvtier_steps_total", "Scheduler steps: llama_decode calls holding decode tokens and/or a prefill chunk.", m.steps);
    COUNTER("kvtier_step_tokens_total", "Tokens in those steps (decode tokens plus prefill chunk tokens).", m.step_tokens);
    COUNTER("kvtier_mixed_steps_total", "Steps holding a prefill chunk AND other requests' decode tokens in one llama_decode.",
            m.mixed_steps);
    COUNTER("kvtier_mixed_prefill_tokens_total", "Prefill tokens decoded in mixed steps.", m.mixed_prefill_tokens);
    COUNTER("kvtier_prefill_alone_tokens_total",
            "Prefill tokens of chunks decoded alone (with --batch-tokens > 0: the last chunk of each prompt part).",
            m.prefill_alone_tokens);
    COUNTER("kvtier_connections_accepted_total", "TCP connections accepted.", m.connections_accepted);
    fprintf(f,
            "# HELP kvtier_connections_closed_total Connections the server shut for missing a deadline.\n"
            "# TYPE kvtier_connections_closed_total counter\n"
            "kvtier_connections_closed_total{reason=\"header_timeout\"} %lld\n"
            "kvtier_connections_closed_total{reason=\"body_timeout\"} %lld\n",
            (long long) m.closed_header_timeout, (long long) m.closed_body_timeout);
    GAUGE("kvtier_resident_tokens", "KV cells held by all sessions.", m.resident_tokens);
    GAUGE("kvtier_sessions", "Open sessions (resident and parked).", m.n_sessions);
    GAUGE("kvtier_sessions_parked", "Sessions parked whole in the host tiers.", m.n_parked);
    GAUGE("kvtier_queue_length", "Requests waiting for a slot.", m.queue_len);
    GAUGE("kvtier_active_requests", "Requests being served.", m.active);
    GAUGE("kvtier_pool_ram_bytes", "Evicted KV bytes in host RAM (the host pool, or the block store's private entries).",
          m.pool_ram);
    GAUGE("kvtier_pool_spill_bytes", "Evicted KV bytes in spill files.", m.pool_spill);
    COUNTER("kvtier_prompt_tokens_from_store_total", "Prompt tokens loaded from the block store (no forward pass).",
            m.prompt_from_store);
    COUNTER("kvtier_prompt_tokens_from_chunks_total", "Prompt tokens loaded as reused chunks (--chunk-reuse; no forward pass).",
            m.prompt_from_chunks);
    fprintf(f, "# HELP kvtier_store_routes_total Chat requests by where their prompt's full blocks were found.\n"
               "# TYPE kvtier_store_routes_total counter\n");
    for (int r = 0; r < 4; r++)
        fprintf(f, "kvtier_store_routes_total{route=\"%s\"} %lld\n", kvt_route_name(r), (long long) m.route[r]);
    if (m.have_store) {
        /* the Redis tier when configured: its entries and bytes are Redis's (kvtier store stats) */
        const struct kvt_store_tier_stats *t[3] = { &m.store.ram, &m.store.disk, &m.store.redis };
        const char *tn[3] = { "ram", "disk", "redis" };
        const int nt = m.store.redis_on ? 3 : 2;
#define TIER(name, type, help, field, n)                                \
    fprintf(f, "# HELP " name " " help "\n# TYPE " name " " type "\n"); \
    for (int k = 0; k < (n); k++) fprintf(f, name "{tier=\"%s\"} %lld\n", tn[k], (long long) t[k]->field);
        TIER("kvtier_store_hits_total", "counter", "Block store lookups answered by the tier.", hits, nt)
        TIER("kvtier_store_misses_total", "counter", "Block store lookups the tier could not answer.", misses, nt)
        TIER("kvtier_store_writes_total", "counter", "Blocks written to the tier.", writes, nt)
        TIER("kvtier_store_writes_dropped_total", "counter", "Block writes dropped (full queue, quota, I/O error).", writes_dropped,
             nt)
        TIER("kvtier_store_evictions_total", "counter", "Blocks removed from the tier for room (LRU).", evictions, 2)
        TIER("kvtier_store_expired_total", "counter", "Blocks removed from the tier by TTL.", expired, 2)
        TIER("kvtier_store_corrupt_total", "counter", "Reads that failed the checksum, key or fingerprint check.", corrupt, nt)
        TIER("kvtier_store_entries", "gauge", "Blocks held by the tier.", entries, 2)
        TIER("kvtier_store_bytes", "gauge", "Bytes held by the tier.", bytes, 2)
        if (m.store.redis_on) {
            TIER("kvtier_store_errors_total", "counter", "Failed commands and connections of the tier (Redis).", errors, 3)
            TIER("kvtier_store_timeouts_total", "counter", "Operations past the tier's deadline (Redis).", timeouts, 3)
        }
#undef TIER
        fprintf(f, "# HELP kvtier_store_hit_ratio Block store hits / lookups since start, per tier.\n"
                   "# TYPE kvtier_store_hit_ratio gauge\n");
        const int64_t lookups = m.store.ram.hits + m.store.ram.misses;
        for (int k = 0; k < nt; k++)
            fprintf(f, "kvtier_store_hit_ratio{tier=\"%s\"} %.6f\n", tn[k], lookups ? (double) t[k]->hits / (double) lookups : 0.0);
        GAUGE("kvtier_store_queue_length", "Block writes waiting for the disk writer.", m.store.queue_len);
        if (m.store.redis_on)
            GAUGE("kvtier_store_redis_queue_length", "Block writes waiting for the Redis writer.", m.store.redis_queue_len);
        if (m.store.prefetch.on) { /* kvt_store_prefetch: what its counters mean is in kvtier.h */
            const struct kvt_store_prefetch_stats *P = &m.store.prefetch;
            const char *pn[] = { "issued", "promoted", "dropped", "skipped", "absent",
                                 "failed", "claimed",  "waited",  "hits",    "wasted" };
            const int64_t pv[] = { P->issued, P->promoted, P->dropped, P->skipped, P->absent,
                                   P->failed, P->claimed,  P->waited,  P->hits,    P->wasted };
            fprintf(f, "# HELP kvtier_store_prefetch_total Block store prefetch: keys issued, promoted into RAM, dropped, ...; "
                       "gets served by promoted blocks (hits), promoted blocks evicted unread (wasted).\n"
                       "# TYPE kvtier_store_prefetch_total counter\n");
            for (int k = 0; k < 10; k++) fprintf(f, "kvtier_store_prefetch_total{what=\"%s\"} %lld\n", pn[k], (long long) pv[k]);
        }
    }
    /* llama-server's names (its tools/server/server-task.cpp), from the same counters, for
    ** dashboards written against it; speculative decoding: none here, so zeros */
    const int64_t n_decode = m.steps + m.prefill_alone_steps;
#define LCOUNTER(name, help, fmt, v) \
    fprintf(f, "# HELP llamacpp:" name " " help "\n# TYPE llamacpp:" name " counter\nllamacpp:" name " " fmt "\n", v)
#define LGAUGE(name, help, fmt, v) \
    fprintf(f, "# HELP llamacpp:" name " " help "\n# TYPE llamacpp:" name " gauge\nllamacpp:" name " " fmt "\n", v)
    LCOUNTER("prompt_tokens_total", "Number of prompt tokens processed (run through the model).", "%lld",
             (long long) m.prompt_decoded);
    LCOUNTER("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache.", "%lld", (long long) m.prompt_reused);
    LCOUNTER("prompt_seconds_total", "Total time spent processing prompts (arrival to first token).", "%.6f", m.prompt_ms / 1e3);
    LCOUNTER("tokens_predicted_total", "Number of generation tokens processed.", "%lld", (long long) m.completion_tokens);
    LCOUNTER("tokens_predicted_seconds_total", "Total time spent generating tokens.", "%.6f", m.predicted_ms / 1e3);
    LCOUNTER("n_decode_total", "Total number of llama_decode() calls.", "%lld", (long long) n_decode);
    LCOUNTER("n_tokens_max", "Largest observed sequence length (prompt + generation).", "%lld", (long long) m.n_tokens_max);
    LCOUNTER("spec_decode_num_draft_tokens_total", "Speculative: total draft tokens generated (kvtier: none).", "%d", 0);
    LCOUNTER("spec_decode_num_accepted_tokens_total", "Speculative: total draft tokens accepted (kvtier: none).", "%d", 0);
    LCOUNTER("spec_decode_num_drafts_total", "Speculative: total verification steps (kvtier: none).", "%d", 0);
    LGAUGE("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", "%.3f",
           m.prompt_ms > 0 ? 1e3 * (double) m.prompt_decoded / m.prompt_ms : 0.0);
    LGAUGE("predicted_tokens_seconds", "Average generation throughput in tokens/s.", "%.3f",
           m.predicted_ms > 0 ? 1e3 * (double) m.completion_tokens / m.predicted_ms : 0.0);
    LGAUGE("requests_processing", "Number of requests processing.", "%lld", (long long) m.active);
    LGAUGE("requests_deferred", "Number of requests deferred (queued).", "%lld", (long long) m.queue_len);
    LGAUGE("n_busy_slots_per_decode", "Average number of generating requests per llama_decode() call.", "%.3f",
           (double) m.decode_rows / (double) (n_decode > 0 ? n_decode : 1));
#undef LCOUNTER
#undef LGAUGE
    hist_text(f, "kvtier_ttft_seconds", "Time to first token.", &m.ttft);
    hist_text(f, "kvtier_token_latency_seconds", "Time between generated tokens.", &m.per_token);
    if (fclose(f)) {
        free(buf);
        return NULL;
    }
    return buf;
}
