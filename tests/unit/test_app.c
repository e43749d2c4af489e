/* test_app.c — the program's shared text helpers (common/app.c): app_utf8_clean and app_utf8_cut,
** which keep what kvtier prints (JSON, log lines with a reply's preview) valid UTF-8. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "app.h"

/* Whether s is valid UTF-8: app_utf8_clean leaves valid text unchanged. */
static bool valid(const char *s) {
    char *c = app_utf8_clean(s);
    assert_non_null(c);
    const bool same = !strcmp(c, s);
    free(c);
    return same;
}

static void test_utf8_cut(void **state) {
    (void) state;
    /* 1-, 2-, 3- and 4-byte characters: every cut lands on a boundary, never above max */
    const char *text = "ab\xC3\xA9"
                       "c\xE2\x82\xAC"
                       "d\xF0\x9F\x98\x80"
                       "e"; /* ab é c € d 😀 e */
    const size_t n = strlen(text);
    int32_t moved = 0;
    for (size_t max = 0; max <= n + 1; max++) {
        char buf[32];
        strcpy(buf, text);
        app_utf8_cut(buf, max);
        assert_true(strlen(buf) <= max);
        assert_true(valid(buf));
        assert_memory_equal(buf, text, strlen(buf)); /* a prefix of the text */
        moved += strlen(buf) < (max < n ? max : n);
        /* control: the byte cut (printf's "%.*s") ends inside a character at these lengths */
        char raw[32];
        snprintf(raw, sizeof raw, "%.*s", (int) max, text);
        if (strlen(buf) < strlen(raw)) assert_false(valid(raw));
    }
    assert_int_equal(moved, 6); /* 1 + 2 + 3 cuts inside the é, € and 😀 */
    char ascii[] = "hello";
    app_utf8_cut(ascii, 60);
    assert_string_equal(ascii, "hello");
}

static void test_utf8_clean(void **state) {
    (void) state;
    char *c = app_utf8_clean("a\xC3"
                             "b\xED\xA0\x80"
                             "c"); /* a lone lead byte, a surrogate */
    assert_non_null(c);
    assert_true(valid(c));
    assert_true(c[0] == 'a' && strchr(c, 'b') && strchr(c, 'c'));
    free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_cut),
        cmocka_unit_test(test_utf8_clean),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
