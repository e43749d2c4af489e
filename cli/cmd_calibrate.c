/* cmd_calibrate.c — `kvtier calibrate`: a per-head attention-entropy profile of a model.
**
** Texts (Paul Graham essays by default) are prefilled in chunks that end exactly at each
** measurement position; after each chunk the last query's post-softmax attention of every head
** of every layer is read (kvt_attn_capture / kvt_attn_get) and its entropy taken in bits.  Per
** head: the mean over texts and positions, a class (kvt_head_classify) and an entropy-adaptive
** budget (kvt_entropy_budget).  llama.cpp's KV cells are shared by all heads of a layer, so a
** layer keeps what its most demanding head needs; the effective compression reported is
** sum(base) / sum(per-layer max budget) over layers and may be below 1.  Stability: texts are
** split into even/odd halves and the per-head means of the halves are correlated (Pearson). */
#include "cli.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_POSITIONS 64

static void calib_usage(FILE *f, const struct cli_opt *opts) {
    fprintf(f, "Usage: kvtier calibrate -m MODEL [-o PROFILE.json] [options]\n"
               "\n"
               "Per-head attention entropy (bits) of the last query at each --positions, averaged over\n"
               "--n-texts texts (sorted by name), with head classes (sink < 0.5 <= focused < 1.5 <= moderate\n"
               "< 3 <= mixed), entropy-adaptive budgets and a split-half (even/odd texts) stability check.\n"
               "Each text is decoded up to the last position; texts with fewer tokens are skipped.\n"
               "Sliding-window layers only see the window. Table on stdout, progress on stderr.\n"
               "\n"
               "Options:\n");
    cli_print_opts(f, opts);
}

/* "128,256" -> pos[] (ascending, >= 1); usage error naming the bad element. */
static int parse_positions(const char *cmd, const char *s, int32_t *pos, int *n) {
    *n = 0;
    for (const char *p = s;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || errno == ERANGE || v < 1 || v > (1 << 24)) {
            fprintf(stderr, "%s: --positions element '%.*s' is not a position in 1..%d (in '%s')\n", cmd, (int) strcspn(p, ","), p,
                    1 << 24, s);
            return APP_USAGE;
        }
        if (*n >= MAX_POSITIONS) {
            fprintf(stderr, "%s: --positions lists more than %d positions\n", cmd, MAX_POSITIONS);
            return APP_USAGE;
        }
        if (*n > 0 && v <= pos[*n - 1]) {
            fprintf(stderr, "%s: --positions must be strictly ascending: %ld follows %d (in '%s')\n", cmd, v, pos[*n - 1], s);
            return APP_USAGE;
        }
        pos[(*n)++] = (int32_t) v;
        if (!*end) return APP_OK;
        p = end + 1;
    }
}

static bool is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* Default text directory: $KVT_SOURCE_DIR/../shared/data/pg_essays, else shared/data/pg_essays
** in an ancestor of the executable's directory or of the working directory. */
static bool find_texts_dir(char *out, size_t n) {
    const char *src = getenv("KVT_SOURCE_DIR");
    if (src && *src) {
        if (snprintf(out, n, "%s/../shared/data/pg_essays", src) < (int) n && is_dir(out)) return true;
    }
    for (int s = 0; s < 2; s++) { /* s = 0: the executable's directory, 1: the working directory */
        char dir[PATH_MAX];
        ssize_t len = s == 0 ? readlink("/proc/self/exe", dir, sizeof dir - 1) : -1;
        if (s == 0) {
            dir[len > 0 ? len : 0] = '\0';
            char *sl = strrchr(dir, '/');
            *(sl ? sl : dir) = '\0';
        } else if (!getcwd(dir, sizeof dir)) {
            continue;
        }
        for (int up = 0; up < 6 && dir[0]; up++) {
            if (snprintf(out, n, "%s/shared/data/pg_essays", dir) < (int) n && is_dir(out)) return true;
            char *sl = strrchr(dir, '/');
            if (!sl) break;
            *sl = '\0';
        }
    }
    return false;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *) a, *(char *const *) b); }

/* *.txt files of dir except LICENSE*, sorted by name.  OUT *names (each and the array freed by
** the caller), *n.  Returns 0 or errno. */
static int list_texts(const char *dir, char ***names, int *n) {
    *names = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return errno;
    struct dirent *de;
    int cap = 0, err = 0;
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        if (de->d_name[0] == '.' || l < 5 || strcmp(de->d_name + l - 4, ".txt") || !strncmp(de->d_name, "LICENSE", 7)) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 64;
            char **nn = realloc(*names, sizeof *nn * (size_t) cap);
            if (!nn) {
                err = ENOMEM;
                break;
            }
            *names = nn;
        }
        if (!((*names)[*n] = strdup(de->d_name))) {
            err = ENOMEM;
            break;
        }
        (*n)++;
    }
    closedir(d);
    if (*n) qsort(*names, (size_t) *n, sizeof **names, cmp_str);
    return err;
}

/* Pearson correlation of a[i*stride], b[i*stride] over n points; NaN when undefined. */
static double pearson(const double *a, const double *b, int n) {
    double ma = 0, mb = 0, sab = 0, saa = 0, sbb = 0;
    for (int i = 0; i < n; i++) ma += a[i], mb += b[i];
    ma /= n, mb /= n;
    for (int i = 0; i < n; i++) {
        sab += (a[i] - ma) * (b[i] - mb);
        saa += (a[i] - ma) * (a[i] - ma);
        sbb += (b[i] - mb) * (b[i] - mb);
    }
    return n >= 3 && saa > 0 && sbb > 0 ? sab / sqrt(saa * sbb) : NAN;
}

static json_t *jnum(double x) { return isfinite(x) ? json_real(x) : json_null(); }

/* "full" or "swa" as found at engine open; "unknown" when an iSWA layer could not be placed. */
static const char *layer_type(const kvt_engine *eng, const struct kvt_engine_info *info, int l) {
    int part = -1, idx;
    if (kvt_engine_layer_part(eng, l, &part, &idx)) return info->n_swa > 0 ? "unknown" : "full";
    return part ? "swa" : "full";
}

/* Write obj to path via path.tmp + fsync + rename: a crash never leaves a half-written profile. */
static int write_profile(const char *cmd, const char *path, const json_t *obj) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int) sizeof tmp) {
        fprintf(stderr, "%s: -o path '%s' is too long\n", cmd, path);
        return APP_USAGE;
    }
    FILE *f = fopen(tmp, "w");
    if (!f) {
        fprintf(stderr, "%s: cannot write '%s': %s\n", cmd, tmp, strerror(errno));
        return APP_ERR;
    }
    int bad = json_dumpf(obj, f, JSON_INDENT(1) | JSON_REAL_PRECISION(8)) != 0 || fputc('\n', f) == EOF;
    bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        fprintf(stderr, "%s: writing the profile '%s' failed: %s\n", cmd, path, strerror(errno));
        unlink(tmp);
        return APP_ERR;
    }
    return APP_OK;
}

int cmd_calibrate(int argc, char **argv) {
    static const char cmd[] = "kvtier calibrate";
    const char *model = getenv("KVTIER_MODEL"), *out = NULL, *texts = NULL, *pos_s = "128,256,512,768,1024";
    int32_t n_texts = 8, n_tok = 1024, ctx = 0, threads = 0, base = 512;
    bool json = false, verbose = false;
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        { "model", 'm', OPT_STR, &model, 0, 0, "MODEL", "GGUF model file (default $KVTIER_MODEL)", NULL },
        { "output", 'o', OPT_STR, &out, 0, 0, "FILE", "write the JSON profile here (via FILE.tmp + rename)", NULL },
        { "texts", 0, OPT_STR, &texts, 0, 0, "DIR", "directory of .txt texts (default $KVT_SOURCE_DIR/../shared/data/pg_essays)",
          NULL },
        { "n-texts", 0, OPT_INT, &n_texts, 1, 100000, "N", "texts to use (default 8)", NULL },
        { "tokens", 0, OPT_INT, &n_tok, 1, 1 << 24, "N", "tokens per text; positions may not exceed it (default 1024)", NULL },
        { "positions", 0, OPT_STR, &pos_s, 0, 0, "LIST", "measurement positions (default 128,256,512,768,1024)", NULL },
        { "base-budget", 0, OPT_INT, &base, 1, 1 << 24, "N", "budget of a head of mean entropy (default 512)", NULL },
        { "ctx", 0, OPT_INT, &ctx, 0, 1 << 24, "N", "context cells (default: last position + 64)", NULL },
        { "threads", 't', OPT_INT, &threads, 0, 1024, "N", "CPU threads (default 0 = all cores)", NULL },
        { "json", 0, OPT_FLAG, &json, 0, 0, NULL, "also print the profile as one JSON line (the last)", NULL },
        { "verbose", 'v', OPT_FLAG, &verbose, 0, 0, NULL, "llama.cpp's log on stderr", NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */
    int n_pos, rc = cli_parse(cmd, opts, argc, argv, NULL, 0, &n_pos);
    if (rc < 0) {
        calib_usage(stdout, opts);
        return APP_OK;
    }
    if (rc) return rc;
    int32_t pos[MAX_POSITIONS];
    if ((rc = parse_positions(cmd, pos_s, pos, &n_pos))) return rc;
    const int32_t last = pos[n_pos - 1];
    if (last > n_tok) {
        fprintf(stderr, "%s: position %d is past --tokens %d\n", cmd, last, n_tok);
        return APP_USAGE;
    }
    if (ctx == 0) ctx = last + 64;
    if (last > ctx) {
        fprintf(stderr, "%s: position %d does not fit in --ctx %d\n", cmd, last, ctx);
        return APP_USAGE;
    }
    if (!model || !*model) {
        fprintf(stderr, "%s: no model given (use -m MODEL or set KVTIER_MODEL)\n", cmd);
        return APP_USAGE;
    }
    if (out) { /* fail before the run, not after it, when the profile cannot be written */
        const char *sl = strrchr(out, '/');
        char od[PATH_MAX];
        snprintf(od, sizeof od, "%.*s", sl ? (int) (sl - out) + 1 : 1, sl ? out : ".");
        if (access(od, W_OK | X_OK)) {
            fprintf(stderr, "%s: -o '%s': directory '%s' is not writable: %s\n", cmd, out, od, strerror(errno));
            return APP_ERR;
        }
    }
    char dir[PATH_MAX];
    if (texts) snprintf(dir, sizeof dir, "%s", texts);
    else if (!find_texts_dir(dir, sizeof dir)) {
        fprintf(stderr,
                "%s: no --texts given and shared/data/pg_essays not found ($KVT_SOURCE_DIR/../, or an "
                "ancestor of the executable or the working directory)\n",
                cmd);
        return APP_ERR;
    }
    char **names = NULL;
    int n_names = 0, err = list_texts(dir, &names, &n_names);
    if (err || n_names < n_texts) {
        if (err || !n_names) fprintf(stderr, "%s: text directory '%s': %s\n", cmd, dir, err ? strerror(err) : "no .txt files");
        else fprintf(stderr, "%s: --n-texts %d but '%s' has %d texts\n", cmd, n_texts, dir, n_names);
        for (int i = 0; i < n_names; i++) free(names[i]);
        free(names);
        return err || !n_names ? APP_ERR : APP_USAGE;
    }

    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = model;
    ep.n_ctx = ctx;
    ep.n_seq = 1;
    ep.n_threads = threads;
    ep.flash_attn = false;
    ep.verbose = verbose;
    kvt_engine *eng = NULL;
    struct kvt_engine_info info;
    int32_t *layers = NULL, *used = NULL;
    double *acc = NULL; /* [2 halves][n_layer * n_head] entropy sums, then 3 x the means */
    int n_used = 0, cnt[2] = { 0, 0 };
    json_t *jl = NULL, *obj = NULL;
    if ((rc = kvt_engine_open(&ep, &eng))) {
        fprintf(stderr, "%s: %s\n", cmd, *kvt_errmsg() ? kvt_errmsg() : kvt_strerror(rc));
        rc = rc == KVT_EINVAL ? APP_USAGE : APP_ERR;
        goto done;
    }
    kvt_engine_info(eng, &info);
    const int NL = info.n_layer, NH = info.n_head, NLH = NL * NH;
    layers = malloc(sizeof *layers * (size_t) NL);
    used = malloc(sizeof *used * (size_t) n_texts);
    acc = calloc(5 * (size_t) NLH, sizeof *acc);
    if (!layers || !used || !acc) {
        fprintf(stderr, "%s: out of memory\n", cmd);
        rc = APP_ERR;
        goto done;
    }
    for (int l = 0; l < NL; l++) layers[l] = l;
    if ((rc = kvt_attn_capture(eng, layers, NL, false))) {
        app_fail(cmd, "attention capture", rc);
        rc = APP_ERR;
        goto done;
    }

    /* ---- measure ---- */
    const double t0 = now_ms();
    for (int i = 0; i < n_names && n_used < n_texts; i++) {
        char path[PATH_MAX];
        char *txt = snprintf(path, sizeof path, "%s/%s", dir, names[i]) < (int) sizeof path ? app_read_file(path, NULL) : NULL;
        if (!txt) {
            fprintf(stderr, "%s: cannot read text '%s': %s\n", cmd, path, strerror(errno));
            rc = APP_ERR;
            goto done;
        }
        kvt_token *tok = NULL;
        int32_t nt = 0;
        rc = kvt_tokenize(eng, txt, true, false, &tok, &nt);
        free(txt);
        if (rc) {
            app_fail(cmd, "tokenizing a text", rc);
            rc = APP_ERR;
            goto done;
        }
        if (nt < last) {
            fprintf(stderr, "[calibrate] skip %s: %d tokens < position %d\n", names[i], nt, last);
            free(tok);
            continue;
        }
        const int half = n_used % 2;
        double *sum = acc + (size_t) half * NLH;
        fprintf(stderr, "[calibrate] text %d/%d %s (half %c):", n_used + 1, n_texts, names[i], "ab"[half]);
        kvt_seq_rm(eng, 0, -1, -1);
        for (int k = 0, p = 0; k < n_pos && rc == APP_OK; p = pos[k++]) {
            if ((rc = kvt_engine_decode(eng, 0, tok + p, pos[k] - p, p, false))) {
                fputc('\n', stderr);
                app_fail(cmd, "decoding", rc);
                break;
            }
            for (int l = 0; l < NL; l++) {
                kvt_attn *a = NULL;
                if ((rc = kvt_attn_get(eng, l, 0, &a))) {
                    fputc('\n', stderr);
                    app_fail(cmd, "reading captured attention", rc);
                    break;
                }
                if (a->n_head != NH || a->n_query < 1 || a->q_pos[a->n_query - 1] != pos[k] - 1) {
                    fprintf(stderr, "\n%s: layer %d attention has %d heads, last query at %d (expected %d, %d)\n", cmd, l,
                            a->n_head, a->n_query ? a->q_pos[a->n_query - 1] : -1, NH, pos[k] - 1);
                    kvt_attn_free(a);
                    rc = KVT_EFORMAT;
                    break;
                }
                const float *row = a->w + (size_t) (a->n_query - 1) * NH * a->n_keys;
                for (int h = 0; h < NH; h++) sum[l * NH + h] += kvt_entropy_bits(row + (size_t) h * a->n_keys, a->n_keys);
                kvt_attn_free(a);
            }
            cnt[half]++;
            fprintf(stderr, " %d", pos[k]);
        }
        free(tok);
        if (rc) {
            rc = APP_ERR;
            goto done;
        }
        fprintf(stderr, " (%.1f s)\n", (now_ms() - t0) / 1e3);
        used[n_used++] = i;
    }
    kvt_seq_rm(eng, 0, -1, -1);
    if (n_used < n_texts) {
        fprintf(stderr, "%s: only %d of the %d texts in '%s' have at least %d tokens; --n-texts %d\n", cmd, n_used, n_names, dir,
                last, n_texts);
        rc = APP_ERR;
        goto done;
    }
    const double wall_s = (now_ms() - t0) / 1e3;

    /* ---- summarise: per-head means, halves, classes, budgets; the table as we go ---- */
    double *H = acc + 2 * NLH, *Ha = H + NLH, *Hb = H + 2 * NLH, mean = 0;
    for (int i = 0; i < NLH; i++) {
        H[i] = (acc[i] + acc[NLH + i]) / (cnt[0] + cnt[1]);
        Ha[i] = cnt[0] ? acc[i] / cnt[0] : NAN;
        Hb[i] = cnt[1] ? acc[NLH + i] / cnt[1] : NAN;
        mean += H[i] / NLH;
    }
    const double r_all = cnt[1] ? pearson(Ha, Hb, NLH) : NAN;
    char llama[512], date[32];
    app_build_llama(llama, sizeof llama);
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    printf("# kvtier calibrate | %s | %s | %s | %d texts:", info.desc, llama, date, n_used);
    for (int i = 0; i < n_used; i++) printf("%s%s", i ? "," : " ", names[used[i]]);
    printf(" | positions %s | base budget %d | %.1f s\n%5s %-9s", pos_s, base, wall_s, "layer", "type");
    for (int h = 0; h < NH; h++) {
        char hb[24];
        snprintf(hb, sizeof hb, "h%d_bits", h);
        printf("  %8s %-9s", hb, "class");
    }
    printf(" %10s %7s\n", "max_budget", "r_half");
    int64_t sum_max = 0;
    jl = json_array();
    for (int l = 0; jl && l < NL; l++) {
        const char *type = layer_type(eng, &info, l);
        char t[24];
        snprintf(t, sizeof t, strcmp(type, "swa") ? "%s" : "%s(%d)", type, info.n_swa);
        printf("%5d %-9s", l, t);
        json_t *jh = json_array();
        int32_t mx = 0;
        for (int h = 0; jh && h < NH; h++) {
            const int i = l * NH + h;
            const int32_t b = kvt_entropy_budget(base, H[i], mean);
            const char *cls = kvt_head_class_name(kvt_head_classify(H[i]));
            mx = b > mx ? b : mx;
            printf("  %8.3f %-9s", H[i], cls);
            if (json_array_append_new(jh, json_pack("{s:i, s:o, s:o, s:o, s:s, s:i}", "head", h, "entropy_bits", jnum(H[i]),
                                                    "entropy_half_a", jnum(Ha[i]), "entropy_half_b", jnum(Hb[i]), "class", cls,
                                                    "budget", b)))
                json_decref(jh), jh = NULL;
        }
        sum_max += mx;
        const double r = cnt[1] ? pearson(Ha + l * NH, Hb + l * NH, NH) : NAN;
        if (isfinite(r)) printf(" %10d %7.3f\n", mx, r);
        else printf(" %10d %7s\n", mx, "-");
        json_t *lo = jh ? json_pack("{s:i, s:s, s:o, s:i, s:o}", "layer", l, "type", type, "heads", jh, "max_budget", mx,
                                    "split_half_correlation", jnum(r))
                        : NULL;
        if (lo && !strcmp(type, "swa")) json_object_set_new(lo, "window", json_integer(info.n_swa));
        if (!lo || json_array_append_new(jl, lo)) json_decref(jl), jl = NULL;
    }
    const double compression = (double) base * NL / (double) sum_max;
    printf("# mean entropy %.3f bits | split-half correlation (even/odd texts, %d heads) %.3f | effective compression "
           "%.3f (%d x %d / %lld kept)\n",
           mean, NLH, r_all, compression, NL, base, (long long) sum_max);
    if (info.n_swa > 0)
        printf("# swa layers see at most the last %d keys: their entropy is bounded by %.2f bits\n", info.n_swa,
               log2((double) info.n_swa));
    fflush(stdout);
    json_t *jt = json_array(), *jp = json_array();
    for (int i = 0; jt && i < n_used; i++) json_array_append_new(jt, json_string(names[used[i]]));
    for (int k = 0; jp && k < n_pos; k++) json_array_append_new(jp, json_integer(pos[k]));
    if (jl && jt && jp) /* json_pack takes the three references, also when it fails */
        obj = json_pack("{s:s, s:s, s:s, s:o, s:o, s:i, s:o, s:o, s:o, s:o}", "model", info.desc, "llama_cpp", llama, "date", date,
                        "texts", jt, "positions", jp, "base_budget", base, "mean_entropy_bits", jnum(mean),
                        "split_half_correlation", jnum(r_all), "effective_compression", jnum(compression), "layers", jl);
    else json_decref(jt), json_decref(jp), json_decref(jl);
    jl = NULL;
    if (!obj) {
        fprintf(stderr, "%s: could not build the JSON profile\n", cmd);
        rc = APP_ERR;
        goto done;
    }
    if (out && (rc = write_profile(cmd, out, obj))) goto done;
    if (out) fprintf(stderr, "[calibrate] profile written to %s\n", out);
    if (json) {
        rc = app_json_line(cmd, obj); /* frees obj */
        obj = NULL;
    }

done:
    json_decref(obj);
    json_decref(jl);
    free(acc);
    free(used);
    free(layers);
    kvt_engine_free(eng);
    for (int i = 0; i < n_names; i++) free(names[i]);
    free(names);
    return rc;
}
