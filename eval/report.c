/* eval_report.c — the per-policy summary of an eval run and its outputs: the table on stdout,
** <out>/<task>-<stamp>.json (summary + cases + rows), .csv (rows), .png (gnuplot), and with
** --json the summary object as the last stdout line.
**
** Summary per policy (errored sessions are left out and counted in "errors"):
**   pass_rate, ci_low, ci_high   passes / trials, Wilson score interval at 95 % (z = 1.96)
**   answer_logprob               mean over rows of the teacher-forced log-probability (nats)
**   answer_logprob_vs_ref        mean paired difference to no_eviction on the same case and item
**   evictions, recoveries, ...   mean per session; peak_resident_tokens is the maximum
**   ttft_ms                      mean time from adding the question to the first reply token
**   ppl                          exp(total NLL / total scored tokens); nll_abs_diff_vs_ref the
**                                mean |NLL per token - no_eviction's| over segments; kl_vs_ref
**                                the mean KL(no_eviction || policy) per token over the full
**                                vocabulary (nats, see eval_run.c) */
#include "eval.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

void eval_wilson(int64_t k, int64_t n, double *lo, double *hi) {
    if (n <= 0) {
        *lo = 0;
        *hi = 1;
        return;
    }
    const double z = 1.96, p = (double) k / (double) n, z2n = z * z / (double) n;
    double centre = (p + z2n / 2) / (1 + z2n);
    double half = z / (1 + z2n) * sqrt(p * (1 - p) / (double) n + z2n / (4 * (double) n));
    *lo = fmax(0.0, fmin(p, centre - half)); /* p lies inside; keep it so under rounding */
    *hi = fmin(1.0, fmax(p, centre + half));
}

void eval_stamp_fill(struct eval_stamp *st, const struct kvt_engine_info *info, const char *model_path, int32_t n_threads) {
    memset(st, 0, sizeof *st);
    snprintf(st->model, sizeof st->model, "%s", info->desc);
    const char *base = strrchr(model_path, '/');
    snprintf(st->model_file, sizeof st->model_file, "%s", base ? base + 1 : model_path);
    app_build_llama(st->llama, sizeof st->llama);
    app_build_commit(st->commit, sizeof st->commit);
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(st->date, sizeof st->date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    strftime(st->stamp, sizeof st->stamp, "%Y%m%d-%H%M%S", &tm);
    struct utsname u;
    char cpu[128] = "unknown CPU";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10)) {
                const char *c = strchr(line, ':');
                if (c) {
                    snprintf(cpu, sizeof cpu, "%s", c + 2);
                    cpu[strcspn(cpu, "\n")] = '\0';
                }
                break;
            }
        fclose(f);
    }
    long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    /* the stamp may be cut to fit st->machine; snprintf's result is checked so that is explicit */
    int w;
    if (uname(&u) == 0)
        w = snprintf(st->machine, sizeof st->machine, "%.32s %.48s %.16s, %.96s, %ld cores", u.sysname, u.release, u.machine, cpu,
                     nproc);
    else w = snprintf(st->machine, sizeof st->machine, "%.96s, %ld cores", cpu, nproc);
    if (w < 0) st->machine[0] = '\0';
    st->n_threads = n_threads;
}

/* ---------------------------------------------------------------------------------------- */
/* summary                                                                                  */

struct depth_sum {
    int64_t n, passes, prefix_passes;
    double lp;
    int32_t n_rows;
};

struct psum {
    int64_t n, passes, prefix_passes;
    int64_t refs, refs_hit; /* ruler's score: references found / references */
    int32_t n_rows, errors, n_sess;
    double lp, dlp, number_lp, dnumber_lp;
    int32_t n_dlp, n_number, n_dnumber;
    double ttft;
    int32_t n_ttft;
    double evictions, recoveries, tokens_recovered, tokens_decoded, total_tokens, seconds, policy_ms, decode_ms;
    int32_t peak;
    double pool_tokens, pool_raw_bytes, pool_bytes, encode_ms, codec_decode_ms; /* host pool saves */
    double nll_tok;                                                             /* sum of NLL over tokens */
    int64_t n_tok;
    double nll_absdiff;
    int32_t n_absdiff;
    double kl; /* token-weighted */
    int64_t n_kl;
    struct depth_sum depth[EVAL_MAX_DEPTHS];
};

static int depth_index(const struct eval_opts *o, int32_t d) {
    for (int i = 0; i < o->n_depths; i++)
        if (o->depths[i] == d) return i;
    return -1;
}

static const struct eval_row *ref_row(const struct eval_results *res, const struct eval_row *r) {
    if (res->ref_pi < 0 || r->pi == res->ref_pi) return NULL;
    for (int32_t i = 0; i < res->n_rows; i++) {
        const struct eval_row *q = &res->rows[i];
        if (q->pi == res->ref_pi && !q->error && q->case_index == r->case_index && q->item == r->item) return q;
    }
    return NULL;
}

static void summarise(const struct eval_opts *o, const struct eval_results *res, struct psum *ps) {
    memset(ps, 0, sizeof *ps * (size_t) o->n_policies);
    for (int32_t i = 0; i < res->n_rows; i++) {
        const struct eval_row *r = &res->rows[i];
        struct psum *p = &ps[r->pi];
        if (r->error) continue;
        p->n += r->n;
        p->passes += r->passed;
        p->refs += r->refs;
        p->refs_hit += r->refs_hit;
        p->n_rows++;
        p->lp += r->answer_logprob;
        p->prefix_passes += r->prefix_passed;
        if (!isnan(r->number_logprob)) {
            p->number_lp += r->number_logprob;
            p->n_number++;
        }
        const struct eval_row *q = ref_row(res, r);
        if (q) {
            p->dlp += r->answer_logprob - q->answer_logprob;
            p->n_dlp++;
            if (!isnan(r->number_logprob) && !isnan(q->number_logprob)) {
                p->dnumber_lp += r->number_logprob - q->number_logprob;
                p->n_dnumber++;
            }
            if (!isnan(r->nll) && !isnan(q->nll)) {
                p->nll_absdiff += fabs(r->nll - q->nll);
                p->n_absdiff++;
            }
        }
        if (!isnan(r->ttft_ms)) {
            p->ttft += r->ttft_ms;
            p->n_ttft++;
        }
        if (!isnan(r->nll)) {
            p->nll_tok += r->nll * r->n;
            p->n_tok += r->n;
        }
        if (!isnan(r->kl)) {
            p->kl += r->kl * r->n;
            p->n_kl += r->n;
        }
        int d = r->depth >= 0 ? depth_index(o, r->depth) : -1;
        if (d >= 0) {
            p->depth[d].n += r->n;
            p->depth[d].passes += r->passed;
            p->depth[d].prefix_passes += r->prefix_passed;
            p->depth[d].lp += r->answer_logprob;
            p->depth[d].n_rows++;
        }
    }
    for (int32_t i = 0; i < res->n_sess; i++) {
        const struct eval_sess *s = &res->sess[i];
        struct psum *p = &ps[s->pi];
        if (s->error) {
            p->errors++;
            continue;
        }
        p->n_sess++;
        p->evictions += (double) s->evictions;
        p->recoveries += (double) s->recoveries;
        p->tokens_recovered += (double) s->tokens_recovered;
        p->tokens_decoded += (double) s->tokens_decoded;
        p->total_tokens += s->total_tokens;
        p->seconds += s->seconds;
        p->policy_ms += s->policy_ms;
        p->decode_ms += s->decode_ms;
        p->pool_tokens += (double) s->pool_tokens;
        p->pool_raw_bytes += (double) s->pool_raw_bytes;
        p->pool_bytes += (double) s->pool_bytes;
        p->encode_ms += s->encode_ms;
        p->codec_decode_ms += s->decode_codec_ms;
        if (s->peak_resident > p->peak) p->peak = s->peak_resident;
    }
}

static double mean(double sum, int64_t n) { return n > 0 ? sum / (double) n : NAN; }

/* JSON number, or null for NaN/inf (jansson refuses those). */
static json_t *jnum(double x) { return isfinite(x) ? json_real(x) : json_null(); }

static int32_t policy_budget(const struct eval_opts *o, int32_t pi) {
    return o->policies[pi] == KVT_POLICY_NO_EVICTION ? o->n_ctx : o->budget;
}

static json_t *policy_json(const struct eval_opts *o, const struct eval_results *res, const struct psum *p, int32_t pi) {
    double lo, hi;
    eval_wilson(p->passes, p->n, &lo, &hi);
    bool has_ref = res->ref_pi >= 0 && pi != res->ref_pi;
    json_t *j = json_object();
    if (!j) return NULL;
    int bad = 0;
    bad |= json_object_set_new(j, "policy", json_string(o->label[pi]));
    bad |= json_object_set_new(j, "budget", json_integer(policy_budget(o, pi)));
    bad |= json_object_set_new(j, "n", json_integer(p->n));
    bad |= json_object_set_new(j, "passes", json_integer(p->passes));
    bad |= json_object_set_new(j, "pass_rate", jnum(mean((double) p->passes, p->n)));
    bad |= json_object_set_new(j, "ci_low", json_real(lo));
    bad |= json_object_set_new(j, "ci_high", json_real(hi));
    bad |= json_object_set_new(j, "answer_logprob", jnum(mean(p->lp, p->n_rows)));
    bad |= json_object_set_new(j, "answer_logprob_vs_ref", has_ref ? jnum(mean(p->dlp, p->n_dlp)) : json_null());
    bad |= json_object_set_new(j, "evictions", jnum(mean(p->evictions, p->n_sess)));
    bad |= json_object_set_new(j, "recoveries", jnum(mean(p->recoveries, p->n_sess)));
    bad |= json_object_set_new(j, "tokens_recovered", jnum(mean(p->tokens_recovered, p->n_sess)));
    bad |= json_object_set_new(j, "tokens_decoded", jnum(mean(p->tokens_decoded, p->n_sess)));
    bad |= json_object_set_new(j, "total_tokens", jnum(mean(p->total_tokens, p->n_sess)));
    bad |= json_object_set_new(j, "peak_resident_tokens", json_integer(p->peak));
    bad |= json_object_set_new(j, "ttft_ms", jnum(mean(p->ttft, p->n_ttft)));
    bad |= json_object_set_new(j, "policy_ms", jnum(mean(p->policy_ms, p->n_sess)));
    bad |= json_object_set_new(j, "decode_ms", jnum(mean(p->decode_ms, p->n_sess)));
    bad |= json_object_set_new(j, "seconds", jnum(mean(p->seconds, p->n_sess)));
    bad |= json_object_set_new(j, "sessions", json_integer(p->n_sess));
    bad |= json_object_set_new(j, "errors", json_integer(p->errors));
    /* the host pool's codec (--codec): bytes per token stored vs the raw blob, and its cost */
    bad |= json_object_set_new(j, "codec", json_string(o->codec[pi] ? o->codec[pi] : "raw"));
    bad |= json_object_set_new(j, "pool_bytes_per_token", jnum(p->pool_tokens > 0 ? p->pool_bytes / p->pool_tokens : NAN));
    bad |= json_object_set_new(j, "pool_raw_bytes_per_token", jnum(p->pool_tokens > 0 ? p->pool_raw_bytes / p->pool_tokens : NAN));
    bad |= json_object_set_new(j, "codec_encode_ms", jnum(mean(p->encode_ms, p->n_sess)));
    bad |= json_object_set_new(j, "codec_decode_ms", jnum(mean(p->codec_decode_ms, p->n_sess)));
    if (o->task == EVAL_PPL) {
        bad |= json_object_set_new(j, "ppl", jnum(exp(mean(p->nll_tok, p->n_tok))));
        bad |= json_object_set_new(j, "nll_per_token", jnum(mean(p->nll_tok, p->n_tok)));
        bad |= json_object_set_new(j, "nll_abs_diff_vs_ref", has_ref ? jnum(mean(p->nll_absdiff, p->n_absdiff)) : json_null());
        bad |= json_object_set_new(j, "kl_vs_ref", res->ref_pi >= 0 ? jnum(mean(p->kl, p->n_kl)) : json_null());
    } else {
        double pl, ph;
        eval_wilson(p->prefix_passes, p->n, &pl, &ph);
        bad |= json_object_set_new(j, "prefix_passes", json_integer(p->prefix_passes));
        bad |= json_object_set_new(j, "prefix_pass_rate", jnum(mean((double) p->prefix_passes, p->n)));
        bad |= json_object_set_new(j, "prefix_ci_low", json_real(pl));
        bad |= json_object_set_new(j, "prefix_ci_high", json_real(ph));
        bad |= json_object_set_new(j, "number_logprob", jnum(mean(p->number_lp, p->n_number)));
        if (o->task == EVAL_RULER) { /* RULER's string_match_all, Wilson over the references */
            double sl, sh;
            eval_wilson(p->refs_hit, p->refs, &sl, &sh);
            bad |= json_object_set_new(j, "score", jnum(mean((double) p->refs_hit, p->refs)));
            bad |= json_object_set_new(j, "score_ci_low", json_real(sl));
            bad |= json_object_set_new(j, "score_ci_high", json_real(sh));
            bad |= json_object_set_new(j, "refs", json_integer(p->refs));
        }
        bad |= json_object_set_new(j, "number_logprob_vs_ref", has_ref ? jnum(mean(p->dnumber_lp, p->n_dnumber)) : json_null());
        json_t *arr = json_array();
        for (int d = 0; arr && d < o->n_depths; d++) {
            double dl, dh, ql, qh;
            eval_wilson(p->depth[d].passes, p->depth[d].n, &dl, &dh);
            eval_wilson(p->depth[d].prefix_passes, p->depth[d].n, &ql, &qh);
            bad |= json_array_append_new(
                arr, json_pack("{s:i, s:I, s:I, s:o, s:f, s:f, s:I, s:o, s:f, s:f, s:o}", "depth", o->depths[d], "n",
                               (json_int_t) p->depth[d].n, "passes", (json_int_t) p->depth[d].passes, "pass_rate",
                               jnum(mean((double) p->depth[d].passes, p->depth[d].n)), "ci_low", dl, "ci_high", dh, "prefix_passes",
                               (json_int_t) p->depth[d].prefix_passes, "prefix_pass_rate",
                               jnum(mean((double) p->depth[d].prefix_passes, p->depth[d].n)), "prefix_ci_low", ql, "prefix_ci_high",
                               qh, "answer_logprob", jnum(mean(p->depth[d].lp, p->depth[d].n_rows))));
        }
        bad |= arr ? json_object_set_new(j, "by_depth", arr) : -1;
    }
    if (bad) {
        json_decref(j);
        return NULL;
    }
    return j;
}

static json_t *summary_json(const struct eval_opts *o, const struct eval_stamp *st, const struct eval_results *res,
                            const struct psum *ps, double seconds) {
    json_t *pol = json_array(), *depths = json_array();
    for (int i = 0; pol && i < o->n_policies; i++) {
        json_t *pj = policy_json(o, res, &ps[i], i);
        if (!pj || json_array_append_new(pol, pj)) {
            json_decref(pol);
            pol = NULL;
        }
    }
    for (int d = 0; depths && d < o->n_depths && o->task != EVAL_PPL; d++)
        json_array_append_new(depths, json_integer(o->depths[d]));
    if (!pol || !depths) {
        json_decref(pol);
        json_decref(depths);
        return NULL;
    }
    json_t *j = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:o, s:f, s:o}", "task",
                          o->task_name, "model", st->model, "model_file", st->model_file, "llama_cpp", st->llama, "commit",
                          st->commit, "date", st->date, "machine", st->machine, "threads", st->n_threads, "budget", o->budget,
                          "context", o->context, "cases", o->cases, "seed", o->seed, "block", o->block, "chunk",
                          o->task == EVAL_PPL ? o->segment : o->chunk, "n_ctx", o->n_ctx, "depths", depths, "seconds", seconds,
                          "policies", pol);
    if (j && o->task == EVAL_PPL) {
        json_object_set_new(j, "score_tokens", json_integer(o->score_tokens));
        json_object_set_new(j, "skip", json_integer(o->skip));
    } else if (j) {
        json_object_set_new(j, "max_tokens", json_integer(o->max_tokens));
    }
    if (j && o->task == EVAL_RULER) {
        static const char *const shapes[] = { "prompt", "turns", "followup" };
        json_object_set_new(j, "ruler_task", json_string(eval_ruler_tasks[o->ruler].name));
        json_object_set_new(j, "shape", json_string(shapes[o->shape]));
        json_object_set_new(j, "input_limit", json_integer(o->fill > 0 ? o->fill : o->context));
        json_object_set_new(j, "first_case", json_integer(o->first_case + 1));
    }
    return j;
}

/* ---------------------------------------------------------------------------------------- */
/* table                                                                                    */

static void print_table(const struct eval_opts *o, const struct eval_stamp *st, const struct eval_results *res,
                        const struct psum *ps, double seconds) {
    printf("# kvtier eval %s | %s | %s | kvtier commit %s | %s | %s | %d threads | context %d | budget %d "
           "(no_eviction %d) | %d cases | seed %d | %.0f s\n",
           o->task_name, st->model, st->llama, st->commit, st->date, st->machine, st->n_threads, o->context, o->budget, o->n_ctx,
           o->cases, o->seed, seconds);
    if (o->task == EVAL_PPL)
        printf("%-12s %6s %6s %8s %8s %9s %9s %6s %-15s %7s %7s %6s\n", "policy", "budget", "tokens", "ppl", "nll/tok", "|dnll|ref",
               "kl/tok", "top1", "95% CI", "evict", "recov", "peak");
    else
        printf("%-12s %6s %4s %4s %6s %-15s %4s %6s %-15s %9s %8s %9s %8s %7s %7s %8s %6s\n", "policy", "budget", "n", "pass",
               "rate", "95% CI", "pfx", "rate", "95% CI", "answer_lp", "vs_ref", "number_lp", "vs_ref", "evict", "recov", "ttft_ms",
               "peak");
    for (int i = 0; i < o->n_policies; i++) {
        const struct psum *p = &ps[i];
        double lo, hi;
        char ci[32];
        eval_wilson(p->passes, p->n, &lo, &hi);
        snprintf(ci, sizeof ci, "[%.3f, %.3f]", lo, hi);
        bool has_ref = res->ref_pi >= 0 && i != res->ref_pi;
        if (o->task == EVAL_PPL) {
            char vs[16] = "        -";
            if (has_ref) snprintf(vs, sizeof vs, "%9.4f", mean(p->nll_absdiff, p->n_absdiff));
            printf("%-12s %6d %6lld %8.3f %8.4f %9s %9.4f %6.3f %-15s %7.1f %7.1f %6d", o->label[i], policy_budget(o, i),
                   (long long) p->n_tok, exp(mean(p->nll_tok, p->n_tok)), mean(p->nll_tok, p->n_tok), vs, mean(p->kl, p->n_kl),
                   mean((double) p->passes, p->n), ci, mean(p->evictions, p->n_sess), mean(p->recoveries, p->n_sess), p->peak);
        } else {
            char vs[16] = "       -", vsn[16] = "       -", pci[32];
            if (has_ref) snprintf(vs, sizeof vs, "%+8.3f", mean(p->dlp, p->n_dlp));
            if (has_ref) snprintf(vsn, sizeof vsn, "%+8.3f", mean(p->dnumber_lp, p->n_dnumber));
            eval_wilson(p->prefix_passes, p->n, &lo, &hi);
            snprintf(pci, sizeof pci, "[%.3f, %.3f]", lo, hi);
            printf("%-12s %6d %4lld %4lld %6.3f %-15s %4lld %6.3f %-15s %9.3f %8s %9.3f %8s %7.1f %7.1f %8.1f %6d", o->label[i],
                   policy_budget(o, i), (long long) p->n, (long long) p->passes, mean((double) p->passes, p->n), ci,
                   (long long) p->prefix_passes, mean((double) p->prefix_passes, p->n), pci, mean(p->lp, p->n_rows), vs,
                   mean(p->number_lp, p->n_number), vsn, mean(p->evictions, p->n_sess), mean(p->recoveries, p->n_sess),
                   mean(p->ttft, p->n_ttft), p->peak);
            if (o->task == EVAL_RULER) {
                eval_wilson(p->refs_hit, p->refs, &lo, &hi);
                printf("  score %.3f [%.3f, %.3f]", mean((double) p->refs_hit, p->refs), lo, hi);
            }
        }
        if (p->errors) printf("  (%d failed sessions)", p->errors);
        putchar('\n');
    }
    bool codecs = false;
    for (int i = 0; i < o->n_policies; i++) codecs |= o->codec[i] != NULL;
    if (codecs) { /* --codec: what the host pool's codec stores and costs */
        printf("\nhost pool codec (every recovered block decoded from it):\n%-18s %12s %10s %8s %9s %11s %11s\n", "policy/codec",
               "bytes/token", "raw b/tok", "ratio", "kl/tok", "encode ms", "decode ms");
        for (int i = 0; i < o->n_policies; i++) {
            const struct psum *p = &ps[i];
            double bpt = p->pool_tokens > 0 ? p->pool_bytes / p->pool_tokens : NAN;
            double rpt = p->pool_tokens > 0 ? p->pool_raw_bytes / p->pool_tokens : NAN;
            printf("%-18s %12.1f %10.1f %8.3f %9.5f %11.1f %11.1f\n", o->label[i], bpt, rpt, bpt / rpt, mean(p->kl, p->n_kl),
                   mean(p->encode_ms, p->n_sess), mean(p->codec_decode_ms, p->n_sess));
        }
    }
    if (o->task != EVAL_PPL && o->n_depths > 0) {
        printf("\npasses (free reply / after the answer prefix) by %s depth:\n%-12s", o->task == EVAL_NIAH ? "needle" : "fact",
               "policy");
        for (int d = 0; d < o->n_depths; d++) printf(" %7d%%", o->depths[d]);
        putchar('\n');
        for (int i = 0; i < o->n_policies; i++) {
            printf("%-12s", o->label[i]);
            for (int d = 0; d < o->n_depths; d++) {
                char cell[32];
                snprintf(cell, sizeof cell, "%lld/%lld/%lld", (long long) ps[i].depth[d].passes,
                         (long long) ps[i].depth[d].prefix_passes, (long long) ps[i].depth[d].n);
                printf(" %8s", cell);
            }
            putchar('\n');
        }
    }
    fflush(stdout);
}

/* ---------------------------------------------------------------------------------------- */
/* files                                                                                    */

static int mkdir_p(const char *path) {
    char buf[1024];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int) sizeof buf) return -1;
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            if (mkdir(buf, 0777) && errno != EEXIST) return -1;
            *p = '/';
        }
    if (mkdir(buf, 0777) && errno != EEXIST) return -1;
    struct stat sb;
    return stat(buf, &sb) == 0 && S_ISDIR(sb.st_mode) ? 0 : -1;
}

static void csv_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; s && *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s == '\n' || *s == '\r' ? ' ' : *s, f);
    }
    fputc('"', f);
}

static void csv_num(FILE *f, double x, const char *fmt) {
    if (isfinite(x)) fprintf(f, fmt, x);
}

static int write_csv(const char *path, const struct eval_opts *o, const struct eval_results *res) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fprintf(f, "policy,case,depth,context,budget,passed,answer_logprob,evictions,recoveries,task,item,n,answer_tokens,"
               "tokens,peak_resident_tokens,ttft_ms,nll_per_token,kl,number_logprob,prefix_passed,error,fact,reply\n");
    for (int32_t i = 0; i < res->n_rows; i++) {
        const struct eval_row *r = &res->rows[i];
        csv_str(f, o->label[r->pi]); /* quoted: "kvtier+elastic:0.35,0.17" holds a comma */
        fprintf(f, ",%d,", r->case_index + 1);
        if (r->depth >= 0) fprintf(f, "%d", r->depth);
        fprintf(f, ",%d,%d,%d,", o->context, policy_budget(o, r->pi), r->passed);
        csv_num(f, r->answer_logprob, "%.6f");
        fprintf(f, ",%lld,%lld,%s,%d,%d,%d,%d,%d,", (long long) r->evictions, (long long) r->recoveries, o->task_name, r->item,
                r->n, r->answer_tokens, r->tokens, r->peak_resident);
        csv_num(f, r->ttft_ms, "%.2f");
        fputc(',', f);
        csv_num(f, r->nll, "%.6f");
        fputc(',', f);
        csv_num(f, r->kl, "%.6f");
        fputc(',', f);
        csv_num(f, r->number_logprob, "%.6f");
        fprintf(f, ",%d,%d,%s,", r->prefix_passed, r->error ? 1 : 0, eval_fact_state_name(r->fact));
        char *reply = app_utf8_clean(r->reply ? r->reply : ""); /* the file is UTF-8 */
        csv_str(f, reply ? reply : "");
        free(reply);
        fputc('\n', f);
    }
    bool bad = ferror(f);
    return (fclose(f) || bad) ? -1 : 0;
}

static json_t *rows_json(const struct eval_opts *o, const struct eval_results *res) {
    json_t *a = json_array();
    for (int32_t i = 0; a && i < res->n_rows; i++) {
        const struct eval_row *r = &res->rows[i];
        char *reply = app_utf8_clean(r->reply ? r->reply : "");
        json_t *j =
            reply
                ? json_pack("{s:s, s:i, s:i, s:o, s:i, s:i, s:o, s:i, s:o, s:i, s:I, s:I, s:i, s:i, s:o, s:o, s:o, s:b, s:s, s:s}",
                            "policy", o->label[r->pi], "case", r->case_index + 1, "item", r->item, "depth",
                            r->depth >= 0 ? json_integer(r->depth) : json_null(), "n", r->n, "passed", r->passed, "answer_logprob",
                            jnum(r->answer_logprob), "answer_tokens", r->answer_tokens, "number_logprob", jnum(r->number_logprob),
                            "prefix_passed", r->prefix_passed, "evictions", (json_int_t) r->evictions, "recoveries",
                            (json_int_t) r->recoveries, "tokens", r->tokens, "peak_resident_tokens", r->peak_resident, "ttft_ms",
                            jnum(r->ttft_ms), "nll_per_token", jnum(r->nll), "kl", jnum(r->kl), "error", r->error, "fact",
                            eval_fact_state_name(r->fact), "reply", reply)
                : NULL;
        free(reply);
        if (j && o->task == EVAL_RULER &&
            (json_object_set_new(j, "refs", json_integer(r->refs)) ||
             json_object_set_new(j, "refs_hit", json_integer(r->refs_hit)))) {
            json_decref(j);
            j = NULL;
        }
        if (!j || json_array_append_new(a, j)) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

static json_t *cases_json(const struct eval_opts *o, const struct eval_case *cases, int32_t n_cases) {
    json_t *a = json_array();
    for (int32_t c = 0; a && c < n_cases; c++) {
        const struct eval_case *k = &cases[c];
        json_t *facts = json_array();
        for (int32_t q = 0; facts && q < k->n_facts; q++) {
            const struct eval_fact *f = &k->facts[k->probe_order[q]];
            json_t *fj = json_pack("{s:s, s:s, s:s, s:s, s:i}", "statement", f->statement, "question", f->question, "answer",
                                   f->answer, "prefix", f->prefix, "depth", f->depth);
            json_t *refs = f->n_refs > 0 ? json_array() : NULL;
            for (int32_t i = 0; refs && i < f->n_refs; i++) json_array_append_new(refs, json_string(f->refs[i]));
            if (fj && refs) json_object_set_new(fj, "refs", refs);
            else json_decref(refs);
            if (fj) json_array_append_new(facts, fj);
        }
        json_t *j = facts ? json_pack("{s:i, s:o, s:i, s:i, s:s, s:o}", "case", k->index + 1, "depth",
                                      k->depth >= 0 ? json_integer(k->depth) : json_null(), "tokens", k->n_tokens, "turns",
                                      k->n_turns, "essays", k->essays, "facts", facts)
                          : NULL;
        if (j && o->task == EVAL_RULER) { /* the text itself, so that a case can be checked and replayed */
            json_t *msgs = json_array();
            if (k->single) json_array_append_new(msgs, json_string(k->single));
            for (int32_t t = 0; msgs && !k->single && t < k->n_turns; t++) json_array_append_new(msgs, json_string(k->turns[t]));
            for (int32_t q = k->single ? 1 : 0; msgs && q < k->n_facts; q++)
                json_array_append_new(msgs, json_string(k->facts[k->probe_order[q]].question));
            if (!msgs || json_object_set_new(j, "messages", msgs)) {
                json_decref(j);
                j = NULL;
            }
        }
        if (!j || json_array_append_new(a, j)) {
            json_decref(a);
            return NULL;
        }
    }
    (void) o;
    return a;
}

static int write_json_file(const char *path, json_t *obj) {
    return json_dump_file(obj, path, JSON_INDENT(1) | JSON_REAL_PRECISION(8)) ? -1 : 0;
}

/* The plot through gnuplot on a pipe: pass rate per policy with its interval, and pass rate by
** depth (niah, multifact) or perplexity per policy (ppl).  Returns 0, 1 (no gnuplot: warned),
** or -1 (gnuplot failed: warned). */
static int write_png(const char *cmd, const char *path, const struct eval_opts *o, const struct eval_stamp *st,
                     const struct psum *ps) {
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        fprintf(stderr, "%s: warning: gnuplot is not installed; no plot written (install gnuplot-nox)\n", cmd);
        return 1;
    }
    char gp[1400];
    snprintf(gp, sizeof gp, "gnuplot 2>'%s.log'", path);
    FILE *g = popen(gp, "w");
    if (!g) {
        fprintf(stderr, "%s: warning: could not start gnuplot: %s; no plot written\n", cmd, strerror(errno));
        return -1;
    }
    fprintf(g, "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo size 1200,480 noenhanced "
               "font ',10' } else { set terminal png size 1200,480 noenhanced }\n");
    fprintf(g, "set output '%s'\n", path);
    /* columns: index, name, pass rate, ci low, ci high, perplexity, prefix rate, its ci low, high */
    fprintf(g, "$rate << EOD\n");
    for (int i = 0; i < o->n_policies; i++) {
        double lo, hi, plo, phi, r = mean((double) ps[i].passes, ps[i].n), pr = mean((double) ps[i].prefix_passes, ps[i].n);
        eval_wilson(ps[i].passes, ps[i].n, &lo, &hi);
        eval_wilson(ps[i].prefix_passes, ps[i].n, &plo, &phi);
        fprintf(g, "%d %s %.6f %.6f %.6f %.6f %.6f %.6f %.6f\n", i, o->label[i], isfinite(r) ? r : 0, lo, hi,
                exp(mean(ps[i].nll_tok, ps[i].n_tok)), isfinite(pr) ? pr : 0, plo, phi);
    }
    fprintf(g, "EOD\n");
    fprintf(g, "set multiplot layout 1,2 title '%s: %s | context %d, budget %d, %d cases, seed %d | kvtier %s | %s'\n",
            o->task_name, st->model, o->context, o->budget, o->cases, o->seed, st->commit, st->date);
    fprintf(g,
            "set style fill solid 0.5 border -1\nset grid ytics\nset xrange [-0.7:%d.7]\n"
            "set yrange [0:1.05]\nset xtics rotate by -30\nset key top right\n",
            o->n_policies - 1);
    if (o->task == EVAL_PPL) {
        fprintf(g, "set title 'top-1 accuracy per policy (Wilson 95%% CI)'\nset boxwidth 0.6\n");
        fprintf(g, "plot $rate using 1:3:xtic(2) with boxes notitle, '' using 1:3:4:5 with yerrorbars lc rgb "
                   "'black' pt 0 notitle\n");
        fprintf(g, "set title 'perplexity of the next segment per policy'\nset autoscale y\nset yrange [0:*]\n");
        fprintf(g, "plot $rate using 1:6:xtic(2) with boxes notitle\n");
    } else {
        fprintf(g, "set title 'pass rate per policy (Wilson 95%% CI)'\nset boxwidth 0.35\n");
        fprintf(g, "plot $rate using ($1-0.18):3:xtic(2) with boxes title 'free reply', "
                   "'' using ($1-0.18):3:4:5 with yerrorbars lc rgb 'black' pt 0 notitle, "
                   "'' using ($1+0.18):7 with boxes title 'after the answer prefix', "
                   "'' using ($1+0.18):7:8:9 with yerrorbars lc rgb 'black' pt 0 notitle\n");
        /* columns: depth, then per policy: free pass rate, prefix pass rate */
        fprintf(g, "$depth << EOD\n");
        for (int d = 0; d < o->n_depths; d++) {
            fprintf(g, "%d", o->depths[d]);
            for (int i = 0; i < o->n_policies; i++) {
                double r = mean((double) ps[i].depth[d].passes, ps[i].depth[d].n),
                       pr = mean((double) ps[i].depth[d].prefix_passes, ps[i].depth[d].n);
                fprintf(g, isfinite(r) ? " %.6f" : " NaN", r);
                fprintf(g, isfinite(pr) ? " %.6f" : " NaN", pr);
            }
            fputc('\n', g);
        }
        fprintf(g, "EOD\nnames = '");
        for (int i = 0; i < o->n_policies; i++) fprintf(g, "%s%s", i ? " " : "", o->label[i]);
        fprintf(g,
                "'\nset title 'pass rate by %s depth (solid: after the answer prefix, dashed: free reply)'\n"
                "set xlabel 'depth (%% of the document)'\nset xrange [-2:102]\nset xtics norotate\n"
                "set key outside right\n",
                o->task == EVAL_NIAH ? "needle" : "fact");
        fprintf(g,
                "plot for [i=1:%d] $depth using 1:(column(2*i+1)) with linespoints lw 2 lc i title word(names, i), "
                "for [i=1:%d] $depth using 1:(column(2*i)) with lines dt 2 lc i notitle\n",
                o->n_policies, o->n_policies);
    }
    fprintf(g, "unset multiplot\n");
    int st_ = pclose(g);
    char log[1400];
    snprintf(log, sizeof log, "%s.log", path);
    struct stat sb;
    bool made = stat(path, &sb) == 0 && sb.st_size > 0;
    if (st_ != 0 || !made) {
        fprintf(stderr, "%s: warning: gnuplot failed (status %d); its messages are in '%s'\n", cmd, st_, log);
        return -1;
    }
    remove(log);
    return 0;
}

int eval_report(const char *cmd, const struct eval_opts *o, const struct eval_stamp *st, const struct eval_results *res,
                const struct eval_case *cases, int32_t n_cases, double seconds) {
    struct psum *ps = calloc((size_t) o->n_policies, sizeof *ps);
    if (!ps) {
        fprintf(stderr, "%s: out of memory\n", cmd);
        return APP_ERR;
    }
    summarise(o, res, ps);
    if (o->cases_only) printf("# %s: %d cases built, no policy run (--cases-only)\n", o->task_name, n_cases);
    else print_table(o, st, res, ps, seconds);

    int rc = APP_OK;
    char base[1200], path[1300];
    if (mkdir_p(o->out)) {
        fprintf(stderr, "%s: cannot create the output directory '%s': %s\n", cmd, o->out, strerror(errno));
        rc = APP_ERR;
    }
    /* <task>-<stamp>, with -2, -3, ... if a run in the same second already wrote it; the name is
    ** claimed by creating the .json exclusively (runs side by side in one directory,
    ** bench/eval_cases.sh, may finish in the same second) */
    snprintf(base, sizeof base, "%s/%s-%s", o->out, o->task_name, st->stamp);
    for (int k = 2; rc == APP_OK; k++) {
        snprintf(path, sizeof path, "%s.json", base);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (fd >= 0) {
            close(fd);
            break;
        }
        if (errno != EEXIST || k > 1000) {
            fprintf(stderr, "%s: cannot create '%s': %s\n", cmd, path, strerror(errno));
            rc = APP_ERR;
            break;
        }
        snprintf(base, sizeof base, "%s/%s-%s-%d", o->out, o->task_name, st->stamp, k);
    }
    json_t *summary = summary_json(o, st, res, ps, seconds);
    if (!summary) {
        fprintf(stderr, "%s: could not build the JSON summary\n", cmd);
        rc = APP_ERR;
    }
    if (rc == APP_OK) {
        json_t *full = json_deep_copy(summary);
        json_t *rows = rows_json(o, res), *cs = cases_json(o, cases, n_cases);
        snprintf(path, sizeof path, "%s.json", base);
        if (!full || !rows || !cs || json_object_set_new(full, "cases_detail", cs) || json_object_set_new(full, "rows", rows) ||
            write_json_file(path, full)) {
            fprintf(stderr, "%s: cannot write '%s'\n", cmd, path);
            rc = APP_ERR;
        } else {
            fprintf(stderr, "%s: wrote %s\n", cmd, path);
        }
        json_decref(full);
    }
    if (rc == APP_OK) {
        snprintf(path, sizeof path, "%s.csv", base);
        if (write_csv(path, o, res)) {
            fprintf(stderr, "%s: cannot write '%s': %s\n", cmd, path, strerror(errno));
            rc = APP_ERR;
        } else {
            fprintf(stderr, "%s: wrote %s\n", cmd, path);
        }
    }
    if (rc == APP_OK && o->task != EVAL_RULER) { /* ruler: bench/ruler_tables.py plots the grid */
        snprintf(path, sizeof path, "%s.png", base);
        if (write_png(cmd, path, o, st, ps) == 0) fprintf(stderr, "%s: wrote %s\n", cmd, path);
    }
    if (o->json && summary) {
        int jr = app_json_line(cmd, summary); /* frees summary */
        summary = NULL;
        if (rc == APP_OK) rc = jr;
    }
    json_decref(summary);
    free(ps);
    return rc;
}
