/* app.h — what the parts of the kvtier program share: the command line (cli/), the server
** (server/) and the evaluation (eval/).  Exit codes, error printing, whole-file reading, UTF-8
** cleaning for JSON, one-line JSON output, the build's commit and llama.cpp version.  Never
** installed; like the rest of the program it uses only the public kvtier.h. */
#ifndef KVT_APP_H
#define KVT_APP_H

#include "kvtier.h"

#include <jansson.h>
#include <stddef.h>

/* Exit codes: 0 success, 1 runtime error (model, context, I/O), 2 usage error (bad flags). */
enum { APP_OK = 0, APP_ERR = 1, APP_USAGE = 2 };

/* Print "cmd: what: kvt_errmsg()" (or kvt_strerror(rc) without a message) to stderr. */
void app_fail(const char *cmd, const char *what, int rc);

/* The whole file as a NUL-terminated string (caller frees); *len = bytes (may be NULL).  NULL on
** any open/read/allocation error (errno tells which). */
char *app_read_file(const char *path, size_t *len);

/* Copy of s with invalid UTF-8 replaced by U+FFFD (jansson rejects invalid UTF-8).  Caller
** frees; NULL on ENOMEM. */
char *app_utf8_clean(const char *s);

/* Print one JSON value as a single line on stdout (compact) and free it.  Returns APP_OK, or
** APP_ERR when obj is NULL (a json_pack failure) or cannot be serialised. */
int app_json_line(const char *cmd, json_t *obj);

/* kvtier's git commit and the llama.cpp build, cut out of kvt_build_info() into buf[0..n). */
void app_build_commit(char *buf, size_t n);
void app_build_llama(char *buf, size_t n);

#endif
