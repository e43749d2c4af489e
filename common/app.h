/* app.h — what the parts of the kvtier program share: the command line (cli/), the server
** (server/) and the evaluation (eval/).  Exit codes, error printing, whole-file reading, UTF-8
** cleaning for JSON, one-line JSON output, the build's commit and llama.cpp version.  Never
** installed; like the rest of the program it uses only the public kvtier.h. */
#ifndef KVT_APP_H
#define KVT_APP_H

#include "kvtier.h"

#include <jansson.h>
#include <stdbool.h>
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

/* Cut valid UTF-8 s to at most max bytes, at a character boundary (a preview never ends inside a
** character).  Cannot fail. */
void app_utf8_cut(char *s, size_t max);

/* Print one JSON value as a single line on stdout (compact) and free it.  Returns APP_OK, or
** APP_ERR when obj is NULL (a json_pack failure) or cannot be serialised. */
int app_json_line(const char *cmd, json_t *obj);

/* Mean attention entropy (bits) of every (layer, KV head) of eng's model, in blob order (the order
** of kvt_codec_params.head_bits), from a `kvtier calibrate` profile: a KV head's is the mean of its
** query heads'.  OUT ent[n_layer x n_head_kv].  APP_OK, or APP_ERR with a message on stderr naming
** flag ("--codec-bits"), the file and what is missing (not a profile, a layer or its heads absent:
** another model's profile). */
int app_unit_entropy(const char *cmd, const char *flag, kvt_engine *eng, const char *path, double *ent);

/* The units' indices ordered by ascending ent (ties by index, so the order is deterministic):
** OUT order[n].  The order in which --codec-bits entropy gives units 8 bits.  APP_OK or APP_ERR
** (no memory). */
int app_units_by_entropy(const double *ent, int32_t n, int32_t *order);

/* --codec-bits SPEC, the tiers' per-head bits (kvt_codec_params.head_bits of a q8/q4 codec):
** "uniform" (the codec's own bits: *bits NULL, *n 0) or "entropy:PROFILE[:FRAC]": the FRAC (0..1,
** default 0.5) of the (layer, KV head) units of lowest mean attention entropy in PROFILE get 8
** bits, the others 4 (docs/BENCHMARKS.md, "Entropy-sized heads": a focused head's error reaches the output
** undiluted).  With eng NULL only the spec is checked.  OUT *bits (caller frees) and *n =
** n_layer x n_head_kv.  APP_OK; APP_USAGE (a bad spec: message on stderr); APP_ERR (the profile
** unreadable or another model's; ENOMEM). */
int app_codec_bits(const char *cmd, kvt_engine *eng, const char *spec, uint8_t **bits /* OUT */, int32_t *n /* OUT */);

/* The name of codec id (enum kvt_codec_id: "raw", "q8", ... "elastic+q4"; "unknown" for an id no
** name parses to, e.g. from a newer kvtier).  Static string. */
const char *app_codec_label(int32_t codec);

/* Whether spec (a codec spec, NULL = raw) names q8 or q4, the codecs --codec-bits applies to. */
bool app_codec_takes_bits(const char *spec);

/* kvtier's git commit and the llama.cpp build, cut out of kvt_build_info() into buf[0..n). */
void app_build_commit(char *buf, size_t n);
void app_build_llama(char *buf, size_t n);

#endif
