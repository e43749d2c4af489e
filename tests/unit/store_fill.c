/* store_fill.c — fills a block store for tests/cli/cli_store.sh: `store_fill DIR N [TAG]` puts N
** blocks whose keys are SHA-256("TAG/i") (TAG defaults to "cli") and whose bytes are a function
** of the key (store_fixture.h), flushing every 64 so that none is dropped, under the model fingerprint SHA-256("model/65"), then closes the
** store (the queue is written out).  Prints the key of block 0.  Exit 0, or 1 with a message. */
#include "store_fixture.h"

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: store_fill DIR N [TAG]\n");
        return 2;
    }
    const char *tag = argc > 3 ? argv[3] : "cli";
    int n = atoi(argv[2]);
    struct kvt_store_params p = kvt_store_default_params();
    p.dir = argv[1];
    p.ram_bytes = 0;
    kvt_store *st;
    int rc = kvt_store_open(&p, &st);
    if (rc) {
        fprintf(stderr, "store_fill: %s\n", kvt_errmsg());
        return 1;
    }
    kvt_key model = sk_key("model", 'A');
    for (int i = 0; i < n; i++) {
        kvt_key k = sk_key(tag, i);
        size_t len;
        uint8_t *b = sk_content(&k, &len);
        struct kvt_store_meta m = sk_meta(&model, &k);
        rc = kvt_store_put(st, &k, &m, b, len);
        free(b);
        if (i % 64 == 63) kvt_store_flush(st); /* a full write-behind queue would drop blocks */
        if (rc) {
            fprintf(stderr, "store_fill: put %d: %s\n", i, kvt_errmsg());
            kvt_store_free(st);
            return 1;
        }
    }
    kvt_store_free(st);
    kvt_key k0 = sk_key(tag, 0);
    char hex[65];
    kvt_key_hex(&k0, hex);
    printf("%s\n", hex);
    return 0;
}
