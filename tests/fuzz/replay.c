/* replay.c — run one harness over every file of the directories (or files) named on the
** command line, without libFuzzer: the regression replay of the committed corpora and crashes
** that ctest runs (fuzz_replay_<harness>) in the normal and the sanitizer build.  A harness that
** crashes, trips a sanitizer or fails a FUZZ_CHECK fails the test.  A directory that does not
** exist is skipped; no input at all is a failure (a corpus went missing).  Files whose names
** start with '.' are ignored (.gitkeep). */
#include "fuzz.h"

#include <dirent.h>
#include <string.h>
#include <sys/stat.h>

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return -1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    for (size_t r; buf && (r = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += r;
        if (n == cap) {
            uint8_t *nb = realloc(buf, cap *= 2);
            if (!nb) {
                free(buf);
                buf = NULL;
            }
            buf = nb;
        }
    }
    fclose(f);
    if (!buf) {
        fprintf(stderr, "%s: out of memory\n", path);
        return -1;
    }
    /* a copy of exactly n bytes, so that ASan sees a read past the input as libFuzzer would */
    uint8_t *in = malloc(n ? n : 1);
    if (!in) {
        free(buf);
        return -1;
    }
    memcpy(in, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(in, n);
    free(in);
    return 0;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *) a, *(char *const *) b); }

int main(int argc, char **argv) {
    long total = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0) {
            printf("replay: %s: absent, skipped\n", argv[i]);
            continue;
        }
        if (!S_ISDIR(sb.st_mode)) {
            if (run_file(argv[i])) return 1;
            total++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (!d) {
            perror(argv[i]);
            return 1;
        }
        char **names = NULL;
        size_t n = 0, cap = 0;
        for (struct dirent *de; (de = readdir(d));) {
            if (de->d_name[0] == '.') continue;
            if (n == cap && !(names = realloc(names, sizeof *names * (cap = cap ? 2 * cap : 64)))) return 1;
            if (!(names[n++] = strdup(de->d_name))) return 1;
        }
        closedir(d);
        if (n > 1) qsort(names, n, sizeof *names, cmp_names); /* the same order every run */
        long here = 0;
        for (size_t k = 0; k < n; k++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[i], names[k]);
            if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode)) {
                if (run_file(path)) return 1;
                here++;
            }
            free(names[k]);
        }
        free(names);
        printf("replay: %ld inputs from %s\n", here, argv[i]);
        total += here;
    }
    if (total == 0) {
        fprintf(stderr, "replay: no inputs at all\n");
        return 1;
    }
    printf("replay: %ld inputs, no crash\n", total);
    return 0;
}
