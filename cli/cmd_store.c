/* cmd_store.c — `kvtier store stats|ls|verify|gc|clear`: look after the persistent block store
** (kvtier.h section 8) from the command line.
**
**   stats    entries, bytes, tokens, hot and expired entries of the disk tier   (read-only)
**   ls       one line per stored block, most recently hit first               (read-only)
**   verify   re-check every file against the index; --repair removes failures (read-only
**            without --repair); exit 1 when problems remain
**   gc       remove expired, over-quota and orphaned entries
**   clear    remove every block; prints what it removed
** Every subcommand takes --store DIR (default: $XDG_CACHE_HOME/kvtier/store, else ~/.cache/kvtier/store) and --json (one JSON
** object on stdout instead of the table). */
#include "cli.h"
#include "serve.h" /* stored responses (server/respdb.c) */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct store_opts {
    const char *dir;
    bool json, repair;
    const char *redis;       /* stats: the Redis tier too */
    const char *secret_file; /* verify: the server's --redis-secret-file (stored responses' MAC) */
};

static const char *SUBCMDS = "stats, ls, verify, gc, clear";

static void store_usage(FILE *f) {
    fprintf(f, "Usage: kvtier store stats|ls|verify|gc|clear [--store DIR] [--json]\n"
               "\n"
               "The persistent KV block store (content-addressed blocks; SQLite index + checksummed files):\n"
               "  stats    entries, bytes, tokens, hot and expired blocks of the disk tier (--redis URL:\n"
               "           and the blocks in that Redis)\n"
               "  ls       one line per stored block, most recently hit first\n"
               "  verify   re-check every file against the index, and the stored responses' MACs (--repair removes what fails);\n"
               "           exit status 1 when problems remain\n"
               "  gc       remove expired, over-quota and orphaned entries\n"
               "  clear    remove every block (asks nothing; prints what it removed)\n"
               "DIR defaults to $XDG_CACHE_HOME/kvtier/store, else ~/.cache/kvtier/store.\n"
               "Run 'kvtier store COMMAND --help' for a command's options.\n");
}

static int open_store(const char *cmd, const struct store_opts *o, bool read_only, kvt_store **st, char *dir, size_t n) {
    int rc;
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = o->dir; /* NULL: the default directory */
    p.ram_bytes = 0;
    p.read_only = read_only;
    p.redis_url = o->redis;
    if ((rc = kvt_store_open(&p, st))) {
        app_fail(cmd, o->dir ? "cannot open the store" : "cannot open the default store (or use --store DIR)", rc);
        return rc == KVT_EINVAL ? APP_USAGE : APP_ERR;
    }
    struct kvt_store_stats s;
    kvt_store_get_stats(*st, &s);
    snprintf(dir, n, "%s", s.dir ? s.dir : "");
    return APP_OK;
}

static void fmt_bytes(char *buf, size_t n, double b) {
    const char *u[] = { "B", "KiB", "MiB", "GiB", "TiB" };
    int i = 0;
    while (b >= 1024 && i < 4) {
        b /= 1024;
        i++;
    }
    snprintf(buf, n, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

static void fmt_age(char *buf, size_t n, double secs) { /* "42s", "5m", "3h", "2d"; negative: "-" */
    if (secs < 0) snprintf(buf, n, "-");
    else if (secs < 120) snprintf(buf, n, "%.0fs", secs);
    else if (secs < 7200) snprintf(buf, n, "%.0fm", secs / 60);
    else if (secs < 172800) snprintf(buf, n, "%.0fh", secs / 3600);
    else snprintf(buf, n, "%.0fd", secs / 86400);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double) ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- stats ------------------------------------------------------------------------------ */

struct agg {
    int64_t entries, bytes, tokens, hot, expired, hits;
    double oldest, newest_hit, now;
    int32_t hot_hits;
};

static int agg_entry(void *ud, const struct kvt_store_entry *e) {
    struct agg *a = ud;
    a->entries++;
    a->bytes += e->bytes;
    a->tokens += e->n_tokens;
    a->hits += e->hits;
    a->hot += e->hits >= a->hot_hits;
    a->expired += e->expires <= a->now;
    if (a->oldest == 0 || e->created < a->oldest) a->oldest = e->created;
    if (e->last_hit > a->newest_hit) a->newest_hit = e->last_hit;
    return 0;
}

static int do_stats(const char *cmd, kvt_store *st, const char *dir, const struct store_opts *o) {
    struct kvt_store_params dp = kvt_store_default_params();
    struct agg a = { .now = now_s(), .hot_hits = dp.hot_hits };
    int rc = kvt_store_ls(st, agg_entry, &a);
    if (rc) {
        app_fail(cmd, "cannot read the index", rc);
        return APP_ERR;
    }
    struct kvt_store_redis_info ri;
    int rrc = o->redis ? kvt_store_redis_info(st, &ri) : 0;
    if (rrc) app_fail(cmd, "cannot read the Redis tier", rrc);
    if (o->json) {
        json_t *j = json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:f}", "store", dir, "entries", (json_int_t) a.entries,
                              "bytes", (json_int_t) a.bytes, "disk_quota", (json_int_t) dp.disk_bytes, "tokens",
                              (json_int_t) a.tokens, "hits", (json_int_t) a.hits, "hot", (json_int_t) a.hot, "expired",
                              (json_int_t) a.expired, "oldest_created", a.oldest, "last_hit", a.newest_hit);
        if (j && o->redis && !rrc)
            json_object_set_new(j, "redis",
                                json_pack("{s:s, s:I, s:I, s:I, s:I}", "server", ri.server, "keys", (json_int_t) ri.keys, "bytes",
                                          (json_int_t) ri.bytes, "used_memory", (json_int_t) ri.used_memory, "maxmemory",
                                          (json_int_t) ri.maxmemory));
        rc = app_json_line(cmd, j);
        return rc ? rc : rrc ? APP_ERR : APP_OK;
    }
    char b[32], q[32], age1[16], age2[16];
    fmt_bytes(b, sizeof b, (double) a.bytes);
    fmt_bytes(q, sizeof q, (double) dp.disk_bytes);
    fmt_age(age1, sizeof age1, a.entries ? a.now - a.oldest : -1);
    fmt_age(age2, sizeof age2, a.entries ? a.now - a.newest_hit : -1);
    printf("store     %s\n", dir);
    printf("entries   %lld (%lld hot: >= %d hits; %lld expired, removed by gc)\n", (long long) a.entries, (long long) a.hot,
           a.hot_hits, (long long) a.expired);
    printf("bytes     %lld (%s of a %s default quota)\n", (long long) a.bytes, b, q);
    printf("tokens    %lld\n", (long long) a.tokens);
    printf("hits      %lld\n", (long long) a.hits);
    printf("oldest    %s ago; last hit %s ago\n", age1, age2);
    if (o->redis && !rrc) {
        char rb[32], um[32], mm[32];
        fmt_bytes(rb, sizeof rb, (double) ri.bytes);
        fmt_bytes(um, sizeof um, (double) ri.used_memory);
        fmt_bytes(mm, sizeof mm, (double) ri.maxmemory);
        printf("redis     %s: %lld blocks (all models), %lld bytes (%s); the server uses %s, maxmemory %s\n", ri.server,
               (long long) ri.keys, (long long) ri.bytes, rb, um, ri.maxmemory ? mm : "none");
        printf("          (this server's hit ratio: /metrics kvtier_store_hit_ratio{tier=\"redis\"})\n");
    }
    return rrc ? APP_ERR : APP_OK;
}

/* ---- ls ----------------------------------------------------------------------------------- */

struct ls_ctx {
    json_t *arr;
    double now;
    bool fail;
};

static int ls_entry(void *ud, const struct kvt_store_entry *e) {
    struct ls_ctx *c = ud;
    char key[65], model[65];
    kvt_key_hex(&e->key, key);
    kvt_key_hex(&e->model, model);
    if (c->arr) {
        json_t *j = json_pack("{s:s, s:s, s:i, s:i, s:s, s:I, s:f, s:f, s:I, s:f}", "key", key, "model", model, "n_tokens",
                              e->n_tokens, "codec", e->codec, "codec_name", app_codec_label(e->codec), "bytes",
                              (json_int_t) e->bytes, "created", e->created, "last_hit", e->last_hit, "hits", (json_int_t) e->hits,
                              "expires", e->expires);
        if (!j || json_array_append_new(c->arr, j)) {
            c->fail = true;
            return 1;
        }
        return 0;
    }
    char age[16], exp[16];
    fmt_age(age, sizeof age, c->now - e->last_hit);
    if (e->expires <= c->now) snprintf(exp, sizeof exp, "expired");
    else fmt_age(exp, sizeof exp, e->expires - c->now);
    printf("%.16s  %.8s  %6d  %-10s  %10lld  %6lld  %8s  %8s\n", key, model, e->n_tokens, app_codec_label(e->codec),
           (long long) e->bytes, (long long) e->hits, age, exp);
    return 0;
}

static int do_ls(const char *cmd, kvt_store *st, const char *dir, const struct store_opts *o) {
    struct ls_ctx c = { .arr = o->json ? json_array() : NULL, .now = now_s() };
    if (o->json && !c.arr) return app_json_line(cmd, NULL);
    if (!o->json)
        printf("%-16s  %-8s  %6s  %-10s  %10s  %6s  %8s  %8s\n", "KEY", "MODEL", "TOKENS", "CODEC", "BYTES", "HITS", "LAST-HIT",
               "EXPIRES");
    int rc = kvt_store_ls(st, ls_entry, &c);
    if (rc && !c.fail) {
        json_decref(c.arr);
        app_fail(cmd, "cannot read the index", rc);
        return APP_ERR;
    }
    if (!o->json) return APP_OK;
    if (c.fail) {
        json_decref(c.arr);
        return app_json_line(cmd, NULL);
    }
    return app_json_line(cmd, json_pack("{s:s, s:o}", "store", dir, "entries", c.arr));
}

/* ---- verify / gc / clear -------------------------------------------------------------------- */

static json_t *report_json(const char *dir, const struct kvt_store_report *r) {
    return json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "store", dir, "checked", (json_int_t) r->checked, "ok",
                     (json_int_t) r->ok, "expired", (json_int_t) r->expired, "over_quota", (json_int_t) r->over_quota, "corrupt",
                     (json_int_t) r->corrupt, "missing", (json_int_t) r->missing, "orphans", (json_int_t) r->orphans, "removed",
                     (json_int_t) r->removed, "bytes_freed", (json_int_t) r->bytes_freed);
}

static void report_print(const char *dir, const struct kvt_store_report *r, bool gc) {
    char b[32];
    fmt_bytes(b, sizeof b, (double) r->bytes_freed);
    printf("store     %s\n", dir);
    printf("checked   %lld index entries: %lld ok\n", (long long) r->checked, (long long) r->ok);
    if (gc) printf("expired   %lld\nover quota %lld\n", (long long) r->expired, (long long) r->over_quota);
    else printf("corrupt   %lld (header or checksum does not match the index)\n", (long long) r->corrupt);
    printf("missing   %lld (index entries without a file)\n", (long long) r->missing);
    printf("orphans   %lld (files without an index entry, temporary files included)\n", (long long) r->orphans);
    printf("removed   %lld (%s)\n", (long long) r->removed, b);
}

static int do_verify(const char *cmd, kvt_store *st, const char *dir, const struct store_opts *o) {
    struct kvt_store_report r;
    int rc = kvt_store_verify(st, o->repair, &r);
    if (rc) {
        app_fail(cmd, "verify failed", rc);
        return APP_ERR;
    }
    /* the stored responses in the same index (kvtier serve's Responses API) */
    struct respdb_report rr;
    char err[1200];
    if (respdb_verify(dir, o->secret_file, o->repair, &rr, err, sizeof err)) {
        fprintf(stderr, "%s: stored responses: %s\n", cmd, err);
        return APP_ERR;
    }
    const bool bad = !o->repair && (r.corrupt || r.missing || r.orphans || rr.corrupt);
    if (o->json) {
        json_t *j = report_json(dir, &r);
        if (j) json_object_set_new(j, "repaired", json_boolean(o->repair));
        if (j)
            json_object_set_new(j, "responses",
                                json_pack("{s:I, s:I, s:I, s:I, s:I}", "checked", (json_int_t) rr.checked, "ok", (json_int_t) rr.ok,
                                          "expired", (json_int_t) rr.expired, "corrupt", (json_int_t) rr.corrupt, "removed",
                                          (json_int_t) rr.removed));
        rc = app_json_line(cmd, j);
    } else {
        report_print(dir, &r, false);
        printf("responses %lld stored responses: %lld ok, %lld expired, %lld corrupt (MAC or shape), %lld removed\n",
               (long long) rr.checked, (long long) rr.ok, (long long) rr.expired, (long long) rr.corrupt, (long long) rr.removed);
        if (bad) printf("problems found: run 'kvtier store verify --repair' to remove them\n");
    }
    return rc ? rc : bad ? APP_ERR : APP_OK;
}

static int do_gc(const char *cmd, kvt_store *st, const char *dir, const struct store_opts *o) {
    struct kvt_store_report r;
    int rc = kvt_store_gc(st, &r);
    if (rc) {
        app_fail(cmd, "gc failed", rc);
        return APP_ERR;
    }
    if (o->json) return app_json_line(cmd, report_json(dir, &r));
    report_print(dir, &r, true);
    return APP_OK;
}

static int do_clear(const char *cmd, kvt_store *st, const char *dir, const struct store_opts *o) {
    struct kvt_store_stats s;
    kvt_store_get_stats(st, &s);
    int rc = kvt_store_clear(st);
    if (rc) {
        app_fail(cmd, "clear failed", rc);
        return APP_ERR;
    }
    if (o->json)
        return app_json_line(cmd, json_pack("{s:s, s:I, s:I}", "store", dir, "removed", (json_int_t) s.disk.entries, "bytes_freed",
                                            (json_int_t) s.disk.bytes));
    char b[32];
    fmt_bytes(b, sizeof b, (double) s.disk.bytes);
    printf("removed %lld blocks (%s) from %s\n", (long long) s.disk.entries, b, dir);
    return APP_OK;
}

/* ---- dispatch ------------------------------------------------------------------------------ */

int cmd_store(int argc, char **argv) {
    if (argc < 1 || !strcmp(argv[0], "--help") || !strcmp(argv[0], "-h")) {
        store_usage(argc < 1 ? stderr : stdout);
        return argc < 1 ? APP_USAGE : APP_OK;
    }
    static const struct {
        const char *name, *help;
        int (*run)(const char *, kvt_store *, const char *, const struct store_opts *);
        bool read_only; /* unless --repair */
    } subs[] = {
        { "stats", "Entries, bytes, tokens, hot and expired blocks of the disk tier (read-only).", do_stats, true },
        { "ls", "One line per stored block, most recently hit first (read-only).", do_ls, true },
        { "verify",
          "Re-read every file the index names and check its header and checksum against the index;\n"
          "list rows without files and files without rows. Read-only unless --repair, which\n"
          "removes what fails. Exit status 1 when problems remain.",
          do_verify, true },
        { "gc",
          "Remove expired entries, entries past the disk quota (cold before hot, least recently hit\n"
          "first), rows without files and files without rows (temporary files of killed writers).",
          do_gc, false },
        { "clear", "Remove every block of the store. Asks nothing; prints what it removed.", do_clear, false },
    };
    int s = -1;
    for (int i = 0; i < (int) (sizeof subs / sizeof *subs); i++)
        if (!strcmp(argv[0], subs[i].name)) s = i;
    if (s < 0) {
        fprintf(stderr, "kvtier store: unknown command '%s' (expected: %s)\nTry 'kvtier store --help'.\n", argv[0], SUBCMDS);
        return APP_USAGE;
    }
    char cmd[32];
    snprintf(cmd, sizeof cmd, "kvtier store %s", subs[s].name);
    struct store_opts o = { 0 };
    const bool is_verify = !strcmp(subs[s].name, "verify"), is_stats = !strcmp(subs[s].name, "stats");
    /* clang-format off: one row per option, laid out by hand */
    struct cli_opt opts[] = {
        { "store", 0, OPT_STR, &o.dir, 0, 0, "DIR", "the store directory (default: $XDG_CACHE_HOME/kvtier/store)", NULL },
        { "json", 0, OPT_FLAG, &o.json, 0, 0, NULL, "one JSON object on stdout instead of the table", NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL }, /* --repair (verify) or --redis (stats) */
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL }, /* --secret-file (verify) */
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */
    /* clang-format off */
    const struct cli_opt repair = { "repair", 0, OPT_FLAG, &o.repair, 0, 0, NULL, "remove what fails (verify)", NULL };
    const struct cli_opt redis = { "redis", 0, OPT_STR, &o.redis, 0, 0, "URL",
                                   "also count the blocks in this Redis (redis://[[user:]password@]host[:port][/db] or "
                                   "unix:///path): a SCAN over its keys", NULL };
    /* clang-format on */
    const struct cli_opt secret = { "secret-file",
                                    0,
                                    OPT_STR,
                                    &o.secret_file,
                                    0,
                                    0,
                                    "FILE",
                                    "the --redis-secret-file the server ran with (stored responses are MACed under it; "
                                    "else under the store's server-secret)",
                                    NULL };
    if (is_verify) opts[2] = repair, opts[3] = secret;
    if (is_stats) opts[2] = redis;
    char *pos[1];
    int n_pos;
    int rc = cli_parse(cmd, opts, argc - 1, argv + 1, pos, 0, &n_pos);
    if (rc == -1) {
        printf("Usage: %s [--store DIR] [--json]%s\n\n%s\n\nOptions:\n", cmd,
               is_verify  ? " [--repair] [--secret-file FILE]"
               : is_stats ? " [--redis URL]"
                          : "",
               subs[s].help);
        cli_print_opts(stdout, opts);
        return APP_OK;
    }
    if (rc) return rc;
    if (o.dir && !*o.dir) {
        fprintf(stderr, "%s: --store is empty\nTry '%s --help'.\n", cmd, cmd);
        return APP_USAGE;
    }
    char dir[4096];
    kvt_store *st = NULL;
    if ((rc = open_store(cmd, &o, subs[s].read_only && !o.repair, &st, dir, sizeof dir))) return rc;
    rc = subs[s].run(cmd, st, dir, &o);
    kvt_store_free(st);
    return rc;
}
