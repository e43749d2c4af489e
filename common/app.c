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

void app_utf8_cut(char *s, size_t max) {
    size_t n = strlen(s);
    if (n <= max) return;
    while (max > 0 && ((unsigned char) s[max] & 0xC0) == 0x80) max--; /* s[max] starts the first character left out */
    s[max] = '\0';
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

int app_unit_entropy(const char *cmd, const char *flag, kvt_engine *eng, const char *path, double *ent) {
    struct kvt_engine_info I;
    kvt_engine_info(eng, &I);
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    json_t *layers = root ? json_object_get(root, "layers") : NULL;
    if (!json_is_array(layers)) {
        fprintf(stderr, "%s: %s '%s' is not a calibration profile of `kvtier calibrate` (%s)\n", cmd, flag, path,
                root ? "no layers" : err.text);
        json_decref(root);
        return APP_ERR;
    }
    if ((int32_t) json_array_size(layers) != I.n_layer) { /* a shallower model would find its layers in it */
        fprintf(stderr, "%s: %s '%s' profiles %zu layers, the model has %d (a profile of another model?)\n", cmd, flag, path,
                json_array_size(layers), I.n_layer);
        json_decref(root);
        return APP_ERR;
    }
    const char *pm = json_string_value(json_object_get(root, "model"));
    if (pm && strcmp(pm, I.desc)) /* the same model quantised otherwise keeps its heads' entropies */
        fprintf(stderr, "%s: note: %s '%s' was calibrated on '%s', the model is '%s'\n", cmd, flag, path, pm, I.desc);
    int32_t n_part0 = 0; /* blob order: the layers of part 0 (e.g. full attention), then part 1's */
    for (int32_t il = 0; il < I.n_layer; il++) {
        int part = 0, idx = il;
        if (kvt_engine_layer_part(eng, il, &part, &idx) == 0 && part == 0) n_part0++;
    }
    const int32_t hpk = I.n_head_kv > 0 ? I.n_head / I.n_head_kv : 1; /* query heads per KV head */
    int rc = APP_OK;
    for (int32_t il = 0; il < I.n_layer && rc == APP_OK; il++) {
        int part = 0, idx = il;
        if (kvt_engine_layer_part(eng, il, &part, &idx)) {
            part = 0;
            idx = il;
        }
        const int32_t bl = part == 0 ? idx : n_part0 + idx;
        json_t *L = NULL;
        size_t k;
        json_t *v;
        json_array_foreach(layers, k, v) if (json_integer_value(json_object_get(v, "layer")) == il) L = v;
        json_t *heads = L ? json_object_get(L, "heads") : NULL;
        if (!json_is_array(heads) || (int32_t) json_array_size(heads) != I.n_head) {
            fprintf(stderr, "%s: %s '%s': layer %d missing or without %d heads (a profile of another model?)\n", cmd, flag, path,
                    il, I.n_head);
            rc = APP_ERR;
            break;
        }
        for (int32_t g = 0; g < I.n_head_kv; g++) {
            double s = 0;
            for (int32_t h = g * hpk; h < (g + 1) * hpk; h++) {
                json_t *e = json_object_get(json_array_get(heads, (size_t) h), "entropy_bits");
                if (!json_is_number(e)) {
                    fprintf(stderr, "%s: %s '%s': layer %d head %d has no entropy_bits\n", cmd, flag, path, il, h);
                    json_decref(root);
                    return APP_ERR;
                }
                s += json_number_value(e);
            }
            ent[bl * I.n_head_kv + g] = s / hpk;
        }
    }
    json_decref(root);
    return rc;
}

struct app_unit {
    double e;
    int32_t i;
};
static int cmp_app_unit(const void *a, const void *b) {
    const struct app_unit *x = a, *y = b;
    if (x->e != y->e) return x->e < y->e ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i); /* ties: layer order, so the table is deterministic */
}

int app_units_by_entropy(const double *ent, int32_t n, int32_t *order) {
    struct app_unit *u = malloc(sizeof *u * (size_t) (n > 0 ? n : 1));
    if (!u) return APP_ERR;
    for (int32_t i = 0; i < n; i++) u[i] = (struct app_unit){ ent[i], i };
    qsort(u, (size_t) n, sizeof *u, cmp_app_unit);
    for (int32_t i = 0; i < n; i++) order[i] = u[i].i;
    free(u);
    return APP_OK;
}

int app_codec_bits(const char *cmd, kvt_engine *eng, const char *spec, uint8_t **bits, int32_t *n) {
    *bits = NULL;
    *n = 0;
    if (!spec || !strcmp(spec, "uniform")) return APP_OK;
    if (strncmp(spec, "entropy:", 8) || !spec[8]) {
        fprintf(stderr, "%s: --codec-bits '%s' is not \"uniform\" or \"entropy:PROFILE[:FRAC]\"\n", cmd, spec);
        return APP_USAGE;
    }
    char path[4096];
    double frac = 0.5; /* 0.44x raw bytes: where the curve beats uniform q4 on both reference models */
    snprintf(path, sizeof path, "%s", spec + 8);
    char *colon = strrchr(path, ':');
    if (colon) { /* a trailing ":FRAC"; a colon inside the path is kept when no number follows it */
        char *end = NULL;
        double f = strtod(colon + 1, &end);
        if (colon[1] && end && !*end) {
            if (!(f >= 0 && f <= 1)) {
                fprintf(stderr, "%s: --codec-bits '%s': FRAC %s is outside 0..1\n", cmd, spec, colon + 1);
                return APP_USAGE;
            }
            frac = f;
            *colon = '\0';
        }
    }
    if (!*path) {
        fprintf(stderr, "%s: --codec-bits '%s': no PROFILE (a `kvtier calibrate` output)\n", cmd, spec);
        return APP_USAGE;
    }
    if (!eng) return APP_OK;
    struct kvt_engine_info I;
    kvt_engine_info(eng, &I);
    const int32_t nu = I.n_layer * I.n_head_kv, k8 = (int32_t) (frac * nu + 0.5);
    double *ent = malloc(sizeof *ent * (size_t) nu);
    int32_t *u = malloc(sizeof *u * (size_t) nu);
    uint8_t *b = malloc((size_t) nu);
    int rc = APP_ERR;
    if (!ent || !u || !b) fprintf(stderr, "%s: --codec-bits: no memory\n", cmd);
    else if (app_unit_entropy(cmd, "--codec-bits", eng, path, ent) == APP_OK) {
        if (app_units_by_entropy(ent, nu, u)) {
            fprintf(stderr, "%s: --codec-bits: no memory\n", cmd);
            goto out;
        }
        memset(b, 4, (size_t) nu);
        for (int32_t i = 0; i < k8; i++) b[u[i]] = 8; /* the most focused units */
        *bits = b;
        *n = nu;
        b = NULL;
        rc = APP_OK;
    }
out:
    free(ent);
    free(u);
    free(b);
    return rc;
}

bool app_codec_takes_bits(const char *spec) {
    struct kvt_codec_params c;
    return spec && kvt_codec_parse(spec, &c) == 0 && (c.codec == KVT_CODEC_Q8 || c.codec == KVT_CODEC_Q4);
}

const char *app_codec_label(int32_t codec) {
    static const char *const names[] = { "raw", "q8", "q4", "elastic", "elastic+q8", "elastic+q4", "ecq" };
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) { /* the library's parser says which id a name is */
        struct kvt_codec_params c;
        if (kvt_codec_parse(names[i], &c) == 0 && c.codec == codec) return names[i];
    }
    return "unknown";
}
