/* cmd_chat.c — `kvtier chat`: a conversation under a token budget.
**
** User turns come from a terminal (prompt "> ", Ctrl-C stops a reply, Ctrl-C at the prompt or
** EOF ends the chat) or from a script: one turn per line, from a file or '-' for stdin, blank
** lines and lines starting with '#' skipped.  Each reply streams to stdout and is followed by a
** status line on stderr; with --json each turn is instead one JSON object on stdout. */
#include "cli.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void on_sigint(int sig) {
    (void) sig;
    cli_sigint = 1;
}

static void chat_usage(FILE *f, const struct cli_opt *opts) {
    fprintf(f, "Usage: kvtier chat -m MODEL [options]\n"
               "\n"
               "Chat with MODEL while keeping at most --budget tokens in the llama.cpp KV cache: blocks\n"
               "of --block tokens are evicted to host RAM (then disk), and the ones most relevant to a\n"
               "new user turn are loaded back (--recovery kv_restore) or lost (--recovery discard).\n"
               "Reads user turns line by line from stdin, or from --script. Each reply streams to\n"
               "stdout; a status line per turn goes to stderr.\n"
               "\n"
               "Options:\n");
    cli_print_opts(f, opts);
}

/* Strip the line ending; true if the line is a turn to run. */
static bool take_line(char *line, bool script) {
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
    const char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (!*p) return false;
    return !(script && *p == '#');
}

int cmd_chat(int argc, char **argv) {
    static const char cmd[] = "kvtier chat";
    struct cli_run_opts o;
    const char *script = NULL;
    bool json = false;
    const char *elastic = NULL;
    cli_run_opts_default(&o);
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        CLI_RUN_OPT_ROWS(&o),
        { "script", 0, OPT_STR, &script, 0, 0, "FILE", "user turns, one per line ('-' = stdin); blank and '#' lines skipped",
          NULL },
        { "json", 0, OPT_FLAG, &json, 0, 0, NULL, "one JSON object per turn on stdout instead of the reply text", NULL },
        { "explain", 0, OPT_FLAG, &o.explain, 0, 0, NULL,
          "print each prompt's decisions on stderr: the runs fed, store prefix, reused chunks, recovery plans, "
          "evictions", NULL },
        { "elastic", 0, OPT_STR, &elastic, 0, 0, "S_K,S_V",
          "live ElasticKV: zero K/V elements under max(sigma/2, mu) x s per head every 64 tokens (sinks and the last "
          "64 tokens kept; no memory saved in the dense cache), e.g. 0.45,0.50 (default off)",
          NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */
    int n_pos;
    int rc = cli_parse(cmd, opts, argc, argv, NULL, 0, &n_pos);
    if (rc < 0) {
        chat_usage(stdout, opts);
        return APP_OK;
    }
    if (rc) return rc;
    if ((rc = cli_run_opts_check(cmd, &o))) return rc;
    if (elastic && (rc = cli_parse_elastic(cmd, "--elastic", elastic, &o.elastic_sk, &o.elastic_sv))) return rc;
    if (!o.seed_set) o.seed = (int32_t) (((unsigned) time(NULL) ^ ((unsigned) getpid() << 16)) & 0x7fffffff);

    FILE *in = stdin;
    bool interactive = false, from_script = true;
    if (script && strcmp(script, "-") != 0) {
        if (!(in = fopen(script, "r"))) {
            fprintf(stderr, "%s: cannot open script '%s': %s\n", cmd, script, strerror(errno));
            return APP_ERR;
        }
    } else if (!script && isatty(STDIN_FILENO)) {
        interactive = true;
        from_script = false;
    }

    struct cli_session cs;
    if ((rc = cli_session_open(cmd, &o, &cs))) {
        if (in != stdin) fclose(in);
        return rc;
    }
    if (o.verbose)
        fprintf(stderr, "%s: %s, context %d, budget %d, block %d, recovery %s, seed %d\n", cmd, cs.info.desc, cs.info.n_ctx,
                cs.budget, o.block, o.recovery, o.seed);
    if (interactive) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_sigint; /* no SA_RESTART: Ctrl-C at the prompt ends getline */
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
        fprintf(stderr, "kvtier chat — %s, budget %d tokens. Ctrl-C stops a reply; Ctrl-D or Ctrl-C at the prompt quits.\n",
                cs.info.desc, cs.budget);
    }

    char *line = NULL;
    size_t cap = 0;
    rc = APP_OK;
    for (;;) {
        if (interactive) {
            fputs("> ", stderr);
            fflush(stderr);
        }
        cli_sigint = 0;
        errno = 0;
        if (getline(&line, &cap, in) < 0) {
            if (ferror(in) && errno != EINTR) {
                fprintf(stderr, "%s: reading %s: %s\n", cmd, script ? script : "stdin", strerror(errno));
                rc = APP_ERR;
            }
            if (interactive) fputc('\n', stderr);
            break;
        }
        if (!take_line(line, from_script)) continue;
        char *reply = NULL;
        if ((rc = cli_turn(cmd, &cs, &o, line, !json, false, &reply))) break;
        if (json) {
            char *u = app_utf8_clean(line), *r = app_utf8_clean(reply);
            json_t *stats = cli_stats_json(&cs);
            json_t *obj = (u && r) ? json_pack("{s:i, s:s, s:s}", "turn", cs.n_turns, "user", u, "reply", r) : NULL;
            if (obj && stats) json_object_update(obj, stats);
            else {
                json_decref(obj);
                obj = NULL;
            }
            json_decref(stats);
            free(u);
            free(r);
            rc = app_json_line(cmd, obj);
        }
        free(reply);
        if (rc) break;
    }
    free(line);
    if (in != stdin) fclose(in);
    cli_session_close(&cs);
    return rc;
}
