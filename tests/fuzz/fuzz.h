/* fuzz.h — what the harnesses of tests/fuzz/ share (README.md there says how to run them).
** Each harness is one file with LLVMFuzzerTestOneInput, linked either with libFuzzer (`make
** fuzz`, build-fuzz/) or with replay.c (ctest fuzz_replay_<harness>, both halves of `make test`). */
#ifndef KVT_FUZZ_H
#define KVT_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* An invariant of the code under test that does not hold is a crash: libFuzzer keeps the input. */
#define FUZZ_CHECK(cond)                                                                      \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

#endif
