/* error.c — the error table, thread-local detailed messages, version strings, the monotonic clock. */
#include "internal.h"
#include "kvt_commit.h" /* KVT_GIT_COMMIT, generated at each build (cmake/commit.cmake) */

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static _Thread_local char errmsg_buf[1024];

const char *kvt_strerror(int err) {
    switch (err) {
        case KVT_OK: return "success";
#define KVT__ERR_CASE(name, code, msg) \
    case KVT_##name: return msg;
            KVT_ERRNO_MAP(KVT__ERR_CASE)
#undef KVT__ERR_CASE
        default: return "unknown error";
    }
}

const char *kvt_errmsg(void) { return errmsg_buf; }

/* Formatted into a scratch buffer first: an argument may be kvt_errmsg() itself (a message that
** wraps the one before it), which vsnprintf must not read while it writes the same buffer. */
int kvt__fail(int err, const char *fmt, ...) {
    char tmp[sizeof errmsg_buf];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(errmsg_buf, tmp, sizeof tmp);
    return err;
}

void kvt__clear_error(void) { errmsg_buf[0] = '\0'; }

const char *kvt_version(void) { return KVT_VERSION_STRING; }

const char *kvt_build_info(void) {
    return "kvtier " KVT_VERSION_STRING " (commit " KVT_GIT_COMMIT ") built on " KVT_LLAMA_BUILD ", CPU build " KVT_LLAMA_CPU
           ", backend " KVT_LLAMA_BACKEND;
}

double kvt__now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
