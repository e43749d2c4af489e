/* spill.h — the disk tier under the host pool (store/pool.c): one directory of spill files, one
** file per stored value.  Never installed.
**
** Spill file (all integers little-endian):
**   "KVTSPILL" | u32 version = 1 | u32 reserved = 0 | u64 key | u64 payload bytes |
**   32-byte SHA-256 of the payload | payload
** written to "<dir>/.tmp-XXXXXX", closed and renamed to
** "<dir>/kvt-<pid>-<pool serial>-<key as 16 hex>-<generation>.blk", so a half-written file never
** carries a valid name.  The generation is the pool's number for the value, so each value has
** its own file: a late writer or unlink never touches a newer value's file under the same key.
** Nothing is fsync'd: spill files never outlive their pool (a process that dies leaves a stale
** directory, which kvt__spill_clean_stale_dirs removes), so the rename only has to be atomic,
** not durable.
**
** The private directory (the pool was given no spill_dir) is "$TMPDIR/kvtier-spill-<pid>-XXXXXX",
** made on first use and flock'ed while its pool lives.
**
** Thread-safety: the file operations (name, write, read, unlink) only read the struct, and may run
** concurrently once `dir` is set; kvt__spill_ensure_dir and kvt__spill_close change it (the pool
** calls the first under its lock, the second when nothing else runs). */
#ifndef KVT_STORE_SPILL_H
#define KVT_STORE_SPILL_H

#include "internal.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvt__spill {
    char *dir;       /* NULL until the private directory is made; then constant */
    bool own_dir;    /* made by kvt__spill_ensure_dir: removed by kvt__spill_close */
    int dir_fd;      /* the private directory, flock'ed; -1 if none */
    long pid;        /* pid at open, part of file names */
    uint64_t serial; /* process-unique pool number, part of file names */
};

/* Path of value (key, gen)'s spill file into buf (PATH_MAX; truncated silently if smaller).
** Needs dir set.  Cannot fail. */
void kvt__spill_name(const struct kvt__spill *sp, uint64_t key, uint64_t gen, char *buf, size_t size);

/* Write data[0..n) as value (key, gen)'s spill file.  Returns 0, or the errno of the step that
** failed (*what names it: "create", "write", "close", "rename", "SHA-256 of"); the temporary file
** never stays.  Failure injection: KVT__FAULT_SPILL_WRITE (ENOSPC). */
int kvt__spill_write(const struct kvt__spill *sp, uint64_t key, uint64_t gen, const uint8_t *data, size_t n,
                     const char **what /* OUT */);

/* Read and verify value (key, gen)'s spill file of n payload bytes.  OUT *out (malloc'd, n bytes,
** at least 1 allocated; caller frees), *missing (the file does not exist).  Errors: KVT_EIO
** (open/read failed), KVT_ECORRUPT (size, header or SHA-256 mismatch; message names the file),
** KVT_ENOMEM; nothing is returned then. */
int kvt__spill_read(const struct kvt__spill *sp, uint64_t key, uint64_t gen, size_t n, uint8_t **out, bool *missing /* OUT */);

/* Unlink value (key, gen)'s spill file; a failure is ignored. */
void kvt__spill_unlink(const struct kvt__spill *sp, uint64_t key, uint64_t gen);

/* Make the private directory if dir is NULL (named with pid, flock'ed).  Errors: KVT_EIO ($TMPDIR
** too long or not writable; message names the path), KVT_ENOMEM; dir stays NULL then. */
int kvt__spill_ensure_dir(struct kvt__spill *sp);

/* Remove the private directory (if ours and empty), release its lock, free dir.  Cannot fail. */
void kvt__spill_close(struct kvt__spill *sp);

/* $TMPDIR, or "/tmp".  Static or environment string. */
const char *kvt__spill_tmp_dir(void);

/* Remove from tmp the private directories of processes that died without freeing their pool:
** only entries named exactly "kvtier-spill-<pid>-XXXXXX", real directories (never through a
** symlink) owned by this user, whose pid is no live process and whose lock no live pool holds
** (a pid from another pid namespace sharing tmp), and in them only files named like ours; a
** directory holding anything else stays.  Runs once per process and tmp value.  Best effort:
** cannot fail.  Thread-safe. */
void kvt__spill_clean_stale_dirs(const char *tmp);

#endif
