/* Reads files through io_uring with raw syscalls (no liburing), as fio's io_uring engine or a Rust/C++ reader
 * inside a Python extension does: IORING_OP_READ requests on one ring, waited for with
 * io_uring_enter(..., min_complete 1, IORING_ENTER_GETEVENTS). Built as a shared library by the tests and
 * called through ctypes:
 *
 *   int  gt_uring_open(unsigned entries)            the ring's fd, or -errno
 *   long gt_uring_read_file(path, chunk, depth, flags)  bytes read, or -errno; flags: GT_URING_DROP_CACHE
 *                                                   (posix_fadvise DONTNEED first: the reads go to the
 *                                                   device), GT_URING_ASYNC (IOSQE_ASYNC: an io-wq worker
 *                                                   thread does each read)
 *   int  gt_uring_last_fd(void)                      the file's fd in the last gt_uring_read_file
 *   long gt_uring_requests(void)                     requests queued so far
 *   long gt_uring_pread(fd, buf, len, off)           one read, submitted and waited for in one io_uring_enter:
 *                                                   bytes read, or -errno
 *   void gt_uring_close(void)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define GT_URING_DROP_CACHE 0x1
#define GT_URING_ASYNC 0x2

struct ring {
    int fd;
    unsigned entries;
    unsigned *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len, sqes_len;
};

static struct ring R = {.fd = -1};
static int last_fd = -1;
static long requests;

static int sys_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned submit, unsigned wait, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, submit, wait, flags, NULL, 0);
}

int gt_uring_open(unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    if (R.fd >= 0)
        return R.fd;
    int fd = sys_setup(entries, &p);
    if (fd < 0)
        return -errno;
    R.fd = fd;
    R.entries = p.sq_entries;
    R.sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    R.cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (R.cq_len > R.sq_len)
            R.sq_len = R.cq_len;
        R.cq_len = R.sq_len;
    }
    R.sq_ptr = mmap(0, R.sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (R.sq_ptr == MAP_FAILED)
        return -errno;
    R.cq_ptr = R.sq_ptr;
    if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {
        R.cq_ptr = mmap(0, R.cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (R.cq_ptr == MAP_FAILED)
            return -errno;
    }
    R.sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    R.sqes = mmap(0, R.sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (R.sqes == MAP_FAILED)
        return -errno;
    char *sq = R.sq_ptr, *cq = R.cq_ptr;
    R.sq_tail = (unsigned *)(sq + p.sq_off.tail);
    R.sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    R.sq_array = (unsigned *)(sq + p.sq_off.array);
    R.cq_head = (unsigned *)(cq + p.cq_off.head);
    R.cq_tail = (unsigned *)(cq + p.cq_off.tail);
    R.cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    R.cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return fd;
}

void gt_uring_close(void)
{
    if (R.fd < 0)
        return;
    munmap(R.sqes, R.sqes_len);
    if (R.cq_ptr != R.sq_ptr)
        munmap(R.cq_ptr, R.cq_len);
    munmap(R.sq_ptr, R.sq_len);
    close(R.fd);
    R.fd = -1;
}

/* Queue one read; the kernel sees it at the next io_uring_enter. */
static void queue_read(int fd, char *buf, unsigned len, unsigned long long off, unsigned long long tag, int flags)
{
    unsigned tail = *R.sq_tail, i = tail & *R.sq_mask;
    struct io_uring_sqe *sqe = &R.sqes[i];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = IORING_OP_READ;
    sqe->fd = fd;
    sqe->addr = (unsigned long long)(unsigned long)buf;
    sqe->len = len;
    sqe->off = off;
    sqe->user_data = tag;
    if (flags & GT_URING_ASYNC)
        sqe->flags |= IOSQE_ASYNC;
    R.sq_array[i] = i;
    __atomic_store_n(R.sq_tail, tail + 1, __ATOMIC_RELEASE);
    requests++;
}

long gt_uring_read_file(const char *path, unsigned chunk, unsigned depth, int flags)
{
    if (R.fd < 0 && gt_uring_open(8) < 0)
        return -ENXIO;
    if (depth == 0 || depth > R.entries)
        depth = R.entries;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    last_fd = fd;
    if (flags & GT_URING_DROP_CACHE)
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    char *bufs = malloc((size_t)chunk * depth);
    if (!bufs) {
        close(fd);
        return -ENOMEM;
    }
    unsigned long long next = 0;
    long total = 0, err = 0;
    unsigned inflight = 0, queued = 0, eof = 0;
    for (unsigned slot = 0; slot < depth; slot++, next += chunk, queued++)
        queue_read(fd, bufs + (size_t)slot * chunk, chunk, next, slot, flags);
    while (queued || inflight) {
        int n = sys_enter(R.fd, queued, 1, IORING_ENTER_GETEVENTS);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            err = -errno;
            break;
        }
        inflight += (unsigned)n;
        queued -= (unsigned)n;
        unsigned head = *R.cq_head, tail = __atomic_load_n(R.cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *cqe = &R.cqes[head & *R.cq_mask];
            unsigned slot = (unsigned)cqe->user_data;
            inflight--;
            if (cqe->res < 0 && !err)
                err = cqe->res;
            if (cqe->res <= 0 || err)
                eof = 1;
            else
                total += cqe->res;
            if (!eof) {
                queue_read(fd, bufs + (size_t)slot * chunk, chunk, next, slot, flags);
                next += chunk;
                queued++;
            }
        }
        __atomic_store_n(R.cq_head, head, __ATOMIC_RELEASE);
    }
    free(bufs);
    close(fd);
    return err ? err : total;
}

long gt_uring_pread(int fd, void *buf, unsigned len, unsigned long long off)
{
    if (R.fd < 0 && gt_uring_open(8) < 0)
        return -ENXIO;
    queue_read(fd, buf, len, off, 0, 0);
    while (sys_enter(R.fd, 1, 1, IORING_ENTER_GETEVENTS) < 0)
        if (errno != EINTR)
            return -errno;
    unsigned head = *R.cq_head;
    if (head == __atomic_load_n(R.cq_tail, __ATOMIC_ACQUIRE))
        return -EAGAIN;
    long res = R.cqes[head & *R.cq_mask].res;
    __atomic_store_n(R.cq_head, head + 1, __ATOMIC_RELEASE);
    return res;
}

int gt_uring_last_fd(void)
{
    return last_fd;
}

long gt_uring_requests(void)
{
    return requests;
}
