/* app.c — what the kvtier program's parts (cli/, server/, eval/) share; see app.h. */
#include "app.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void app_fail(const char *cmd, const char *what, int rc) {
    const char *m = kvt_errmsg();
    if (m && *m) fprintf(stderr, "%s: %s: %s\n", cmd, what, m);
    else fprintf(stderr, "%s: %s: %s\n", cmd, what, kvt_strerror(rc));
}

char *app_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t n = 0, cap = 0, r;
    do {
        if (n + 65536 + 1 > cap) {
            cap = cap ? 2 * cap : 131072;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
        }
        r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
    } while (r > 0);
    bool err = ferror(f);
    fclose(f);
    if (err || !buf) {
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    if (len) *len = n;
    return buf;
}

char *app_utf8_clean(const char *s) {
    size_t n = strlen(s);
    char *out = malloc(3 * n + 1), *w = out; /* each bad byte becomes 3 bytes at most */
    if (!out) return NULL;
    const unsigned char *p = (const unsigned char *) s, *e = p + n;
    while (p < e) {
        unsigned c = *p;
        int len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
        bool ok = len > 0 && p + len <= e;
        for (int k = 1; ok && k < len; k++) ok = (p[k] & 0xC0) == 0x80;
        if (ok && len == 3) ok = !(c == 0xE0 && p[1] < 0xA0) && !(c == 0xED && p[1] >= 0xA0); /* overlong, surrogate */
        if (ok && len == 4) ok = !(c == 0xF0 && p[1] < 0x90) && !(c == 0xF4 && p[1] >= 0x90); /* overlong, > U+10FFFF */
        if (ok) {
            memcpy(w, p, (size_t) len);
            w += len;
            p += len;
        } else {
            memcpy(w, "\xEF\xBF\xBD", 3);
            w += 3;
            p++;
        }
    }
    *w = '\0';
    return out;
}

int app_json_line(const char *cmd, json_t *obj) {
    if (!obj) {
        fprintf(stderr, "%s: could not build the JSON output\n", cmd);
        return APP_ERR;
    }
    char *txt = json_dumps(obj, JSON_COMPACT | JSON_REAL_PRECISION(8));
    json_decref(obj);
    if (!txt) {
        fprintf(stderr, "%s: could not serialise the JSON output\n", cmd);
        return APP_ERR;
    }
    puts(txt);
    fflush(stdout);
    free(txt);
    return APP_OK;
}

void app_build_commit(char *buf, size_t n) {
    const char *b = kvt_build_info(), *p = strstr(b, "(commit ");
    size_t len = 0;
    if (p) {
        p += 8;
        while (p[len] && p[len] != ')') len++;
    }
    snprintf(buf, n, "%.*s", p ? (int) len : 7, p ? p : "unknown");
}

void app_build_llama(char *buf, size_t n) {
    const char *b = kvt_build_info(), *p = strstr(b, " built on ");
    snprintf(buf, n, "%s", p ? p + 10 : "unknown");
}
