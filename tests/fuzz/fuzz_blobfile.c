/* fuzz_blobfile — the disk tier's blob-file reader (src/store/blobfile.c kvt__sblob_read): the
** input is written as a blob file and read back, with the payload and header-and-checksum only;
** then again with the header's size and checksum fields made consistent with the input (so the
** paths behind them are reached).  Invariants: a file that reads OK has the size its header
** says and its payload is the file's bytes after the header.  One file in a private temporary
** directory (under /dev/shm when it exists, else /tmp), rewritten for every input. */
#include "fuzz.h"
#include "internal.h"
#include "store/store_int.h"

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

static int dir_fd = -1;
static const char NAME[] = "0000000000000000000000000000000000000000000000000000000000000000.kvb";

static void cleanup(void) {
    if (dir_fd < 0) return;
    unlinkat(dir_fd, NAME, 0);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", dir_fd);
    char target[4096];
    ssize_t k = readlink(path, target, sizeof target - 1);
    close(dir_fd);
    if (k > 0) {
        target[k] = '\0';
        rmdir(target);
    }
}

static void read_back(const uint8_t *data, size_t size) {
    int fd = openat(dir_fd, NAME, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FUZZ_CHECK(fd >= 0);
    FUZZ_CHECK(size == 0 || write(fd, data, size) == (ssize_t) size);
    close(fd);
    struct kvt__sblob_hdr h;
    const char *why = NULL;
    uint8_t *buf = NULL;
    int rc = kvt__sblob_read(dir_fd, NAME, &h, &buf, &why);
    if (rc == KVT__SBLOB_OK) {
        FUZZ_CHECK(h.size == size - KVT__SBLOB_HDR && buf);
        FUZZ_CHECK(memcmp(buf, data + KVT__SBLOB_HDR, (size_t) h.size) == 0);
    } else {
        FUZZ_CHECK(buf == NULL && why != NULL);
    }
    free(buf);
    FUZZ_CHECK(kvt__sblob_read(dir_fd, NAME, &h, NULL, &why) == rc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (dir_fd < 0) {
        /* tmpfs when there is one: two file writes per input are most of an execution's time on
        ** a disk (3.8k/s on /tmp, a virtual disk); the reader's paths are the same */
        char tmpl[] = "/dev/shm/kvt-fuzz-blobfile-XXXXXX", tmpl2[] = "/tmp/kvt-fuzz-blobfile-XXXXXX";
        char *dir = mkdtemp(tmpl);
        if (!dir) dir = mkdtemp(tmpl2);
        FUZZ_CHECK(dir);
        dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        FUZZ_CHECK(dir_fd >= 0);
        atexit(cleanup);
    }
    read_back(data, size);
    if (size >= KVT__SBLOB_HDR) {
        uint8_t *x = malloc(size);
        FUZZ_CHECK(x);
        memcpy(x, data, size);
        uint64_t n = size - KVT__SBLOB_HDR;
        for (int i = 0; i < 8; i++) x[88 + i] = (uint8_t) (n >> (8 * i)); /* little-endian */
        /* the checksum of the input's own format version (an unknown one: the current one's) */
        const uint32_t ver = (uint32_t) x[8] | (uint32_t) x[9] << 8 | (uint32_t) x[10] << 16 | (uint32_t) x[11] << 24;
        FUZZ_CHECK(kvt__sblob_checksum(ver == 1 ? 1 : 0, x + KVT__SBLOB_HDR, (size_t) n, x + 96) == 0);
        read_back(x, size);
        free(x);
    }
    kvt__clear_error();
    return 0;
}
