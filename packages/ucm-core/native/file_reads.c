/* The posix store's reads of blocks: a chunk of a batch's blocks opened, read into the
 * caller's parts and digested (digest.h) in one call, their headers checked by the caller
 * afterwards.
 *
 * Why compiled: a block of 256 KiB in eight parts of 32 KiB (a layer's K and V a part, in
 * vLLM) took two opens, a stat, two reads, eight digest calls, a utime and two closes from
 * Python, each giving up the GIL and taking it back; two I/O threads then waited on each
 * other's GIL more than they read (64 MiB from the page cache, 2 vCPUs: 48 ms on two
 * threads, 38 ms on one).  This file's calls hold no GIL (ctypes releases it), so the
 * threads, and the engine's thread that waits, read side by side.
 *
 * A read fills up to ``piece`` bytes (several parts in one preadv2, or a large part cut),
 * and what it filled is digested next, while the core's cache still holds it.  Nothing
 * read from a file sizes anything: reads go into the caller's parts, at most their bytes,
 * and only once the header's first bytes are those of the block asked for.
 * See ucm/core/store/posix/fileio.py, the only caller, for the contract. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "digest.h"

#define MAX_IOV 64

/* Fill the ``n`` parts (``addrs[i]``, ``lens[i]`` bytes) in order from ``fd`` at
 * ``offset``, in reads of at most ``piece`` bytes with preadv2's ``flags`` (RWF_NOWAIT:
 * only what the page cache holds), and store the digest of all they hold in ``*digest``;
 * then set the file's times to now (its recency, for the store's LRU: not an error where
 * it cannot, as for a file of another user in a shared folder).  Returns 0; 1 if the file
 * ends before the parts are full; or -errno of a failed read (-EAGAIN: with RWF_NOWAIT, a
 * page the cache did not hold). */
static int read_digest(int fd, uint64_t offset, const uint64_t *addrs, const uint64_t *lens,
                       uint64_t n, uint64_t piece, int flags, uint64_t *digest) {
    ucm_digest_state st;
    ucm_digest_reset(&st);
    uint64_t part = 0, at = 0; /* the next byte to fill: part ``part``, ``at`` bytes in */
    if (piece == 0)
        piece = (uint64_t)1 << 20;
    while (part < n && lens[part] == 0)
        part++;
    while (part < n) {
        struct iovec iov[MAX_IOV];
        int count = 0;
        uint64_t asked = 0;
        for (uint64_t p = part, from = at; p < n && count < MAX_IOV && asked < piece; p++) {
            uint64_t take = lens[p] - from;
            if (take > piece - asked)
                take = piece - asked;
            if (take) {
                iov[count].iov_base = (void *)(uintptr_t)(addrs[p] + from);
                iov[count].iov_len = (size_t)take;
                count++, asked += take;
            }
            from = 0;
        }
        ssize_t got = preadv2(fd, iov, count, (off_t)offset, flags);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            return 1;
        offset += (uint64_t)got;
        for (int i = 0; i < count && got > 0; i++) { /* digest what landed, in order */
            size_t landed = iov[i].iov_len < (size_t)got ? iov[i].iov_len : (size_t)got;
            ucm_digest_update(&st, (const uint8_t *)iov[i].iov_base, landed);
            got -= (ssize_t)landed;
            at += landed;
            while (part < n && at == lens[part]) /* filled: on to the next part not empty */
                part++, at = 0;
        }
    }
    *digest = ucm_digest_final(&st);
    futimens(fd, NULL);
    return 0;
}

/* What ucm_open_block found: the file's size, inode and mode, the header bytes read, and
 * where it failed (OPENING_FOLDER, OPENING_FILE, READING), as a fixed array. */
enum { SIZE, INODE, MODE, HEADER_READ, STAGE, PAYLOAD_READ, FOUND_FIELDS };
enum { OPENING_FOLDER = 0, OPENING_FILE = 1, READING = 2 };

/* Open block file ``name`` in folder ``folder`` of the folder ``blocks_fd`` for reading,
 * neither through a link (a link at either is ELOOP or ENOTDIR) nor waiting on a FIFO, and,
 * if it is a regular file, read its first ``header_len`` bytes into ``header`` with
 * preadv2's ``flags``.  Returns the file's descriptor, ``found`` filled (the caller checks
 * the mode and closes it); or -errno, ``found[STAGE]`` saying where.  One call for what
 * took five from Python, each giving up and taking back the GIL. */
__attribute__((visibility("default"))) int ucm_open_block(int blocks_fd, const char *folder,
                                                          const char *name, uint8_t *header,
                                                          uint64_t header_len, int flags,
                                                          uint64_t *found) {
    found[STAGE] = OPENING_FOLDER;
    int dir = openat(blocks_fd, folder, O_RDONLY | O_CLOEXEC | O_DIRECTORY | O_NOFOLLOW);
    if (dir < 0)
        return -errno;
    found[STAGE] = OPENING_FILE;
    int fd = openat(dir, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    int failed = errno;
    close(dir);
    if (fd < 0)
        return -failed;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        failed = errno;
        close(fd);
        return -failed;
    }
    found[SIZE] = (uint64_t)st.st_size, found[INODE] = (uint64_t)st.st_ino;
    found[MODE] = (uint64_t)st.st_mode, found[HEADER_READ] = 0;
    if (!S_ISREG(st.st_mode))
        return fd;
    found[STAGE] = READING;
    struct iovec iov = {header, (size_t)header_len};
    ssize_t got;
    do
        got = preadv2(fd, &iov, 1, 0, flags);
    while (got < 0 && errno == EINTR);
    if (got < 0) {
        failed = errno;
        close(fd);
        return -failed;
    }
    found[HEADER_READ] = (uint64_t)got;
    return fd;
}

/* The type of the filesystem ``fd`` is on (fstatfs's f_type, a magic number), or -errno:
 * the store reads from the engine's waiting thread only on filesystems known local. */
__attribute__((visibility("default"))) int64_t ucm_fs_type(int fd) {
    struct statfs st;
    if (fstatfs(fd, &st) < 0)
        return -errno;
    return (int64_t)(uint64_t)st.f_type;
}

/* ucm_open_block, then, if the file is a regular one of ``header_len`` + the parts' bytes
 * at least and its header begins with the ``expect_len`` bytes at ``expect`` (the header
 * of the block asked for: key, size, format), read_digest of the payload, then a close.
 * Returns 0 or -errno, ``found`` filled as ucm_open_block's, ``found[PAYLOAD_READ]`` 1
 * where the payload was read and digested into ``*digest``, 2 where the file ended before
 * it was whole. */
static int read_block(int blocks_fd, const char *folder, const char *name, uint8_t *header,
                      uint64_t header_len, const uint8_t *expect, uint64_t expect_len,
                      const uint64_t *addrs, const uint64_t *lens, uint64_t n, uint64_t piece,
                      int flags, uint64_t *found, uint64_t *digest) {
    found[PAYLOAD_READ] = 0;
    int fd = ucm_open_block(blocks_fd, folder, name, header, header_len, flags, found);
    if (fd < 0)
        return fd;
    uint64_t payload = 0;
    for (uint64_t i = 0; i < n; i++)
        payload += lens[i];
    int done = 0;
    if (S_ISREG((mode_t)found[MODE]) && found[HEADER_READ] == header_len &&
        found[SIZE] >= header_len + payload && expect_len <= header_len &&
        memcmp(header, expect, (size_t)expect_len) == 0) {
        done = read_digest(fd, header_len, addrs, lens, n, piece, flags, digest);
        if (done >= 0)
            found[PAYLOAD_READ] = done == 0 ? 1 : 2;
    }
    close(fd);
    return done < 0 ? done : 0;
}

/* read_block for each of ``count`` blocks: block i named by the NUL-terminated string at
 * ``names + i * stride`` (its folder: the name's first two characters), its header read
 * into ``headers + i * header_len`` (expected to begin with the ``expect_len`` bytes at
 * ``expect + i * expect_len``) and its payload into its parts, ``starts[i]`` to
 * ``starts[i + 1]`` of ``addrs`` and ``lens``; its ``found`` at ``found + i *
 * FOUND_FIELDS``, its digest in ``digests[i]``, what read_block returned in
 * ``results[i]``.  A chunk of a batch in one call: the GIL given up once for all of it. */
__attribute__((visibility("default"))) void ucm_read_blocks(
    int blocks_fd, uint64_t count, const char *names, uint64_t stride, uint8_t *headers,
    uint64_t header_len, const uint8_t *expect, uint64_t expect_len, const uint64_t *addrs,
    const uint64_t *lens, const uint64_t *starts, uint64_t piece, int flags, uint64_t *found,
    uint64_t *digests, int64_t *results) {
    for (uint64_t i = 0; i < count; i++) {
        const char *name = names + i * stride;
        char folder[3] = {name[0], name[0] ? name[1] : 0, 0};
        uint64_t first = starts[i];
        results[i] = read_block(blocks_fd, folder, name, headers + i * header_len,
                                header_len, expect + i * expect_len, expect_len,
                                addrs + first, lens + first, starts[i + 1] - first, piece,
                                flags, found + i * FOUND_FIELDS, digests + i);
    }
}
