/* Events shared between gputrace.bpf.c and probes/ebpf/events.py (which mirrors them with struct formats;
 * tests/test_ebpf_layout.py checks that sizes and offsets agree). Bump GT_LAYOUT on any change. How a syscall
 * event's a0, a1 and arg are read is said by its syscall's flags (GT_F_*), which the capture's metadata
 * records: a new flag is no layout change. */
#ifndef GPUTRACE_H
#define GPUTRACE_H

/* The read helpers, called by number. bcc swaps bpf_probe_read_kernel/_user for the legacy bpf_probe_read when
 * kallsyms shows it no address for them, as it does to gputraced once that has dropped CAP_SYSLOG; names of our
 * own are out of its reach, so the service loads the same program as `gputrace capture` as root. (The legacy
 * helper reads the same on x86_64 and is missing where address spaces overlap.) All are there on 5.8+, which
 * the ring buffers need anyway. */
static int (*gt_read_kernel)(void *dst, __u32 size, const void *src) = (void *)BPF_FUNC_probe_read_kernel;
static int (*gt_read_user)(void *dst, __u32 size, const void *src) = (void *)BPF_FUNC_probe_read_user;
static int (*gt_read_user_str)(void *dst, __u32 size, const void *src) = (void *)BPF_FUNC_probe_read_user_str;

#define GT_LAYOUT 6 /* 2: adds GT_EV_FAULT; 3: adds GT_EV_FDRECV; 4: GT_EV_OFFCPU2 replaces GT_EV_OFFCPU;
                      * 5: adds GT_EV_URING; 6: adds GT_EV_DIRTY; the other events are as in 1 */
#define GT_COMM_LEN 16
/* Submit flag of the busy rings (BPF_RB_NO_WAKEUP): no wakeup of the reader per event, which would cost the
 * traced thread an interrupt and the reader a switch each time; user space drains them on a timer instead. */
#define GT_RB_NO_WAKEUP 1
#define GT_DATA_LEN 256
#define GT_SOCKADDR_MAX 128
#define GT_FILENAME_LEN 128
#define GT_POLL_SCAN 8 /* pollfds of a poll of several fds searched for the first ready one */
#ifndef GT_EPOLL_DATA_OFF
#define GT_EPOLL_DATA_OFF 4 /* struct epoll_event's data: packed on x86_64 (the build says 8 elsewhere) */
#endif
#define GT_EPOLL_DATA_OK (1ULL << 32) /* in a0 of an epoll event (GT_F_EPOLLDATA, GT_F_EPOLLCTL): a1 is a data word */
#define GT_SELECT_WORDS 2 /* 64-bit words of an fd_set searched: fds below 128 (each word costs the verifier ~40 ms at load) */
#define GT_FDRECV_MAX 16 /* fds of one SCM_RIGHTS message reported (the first control message only) */
#define GT_NR_MAX 512

/* Event types: the first u32 of every event. */
#define GT_EV_SYS 1    /* struct gt_sys_event */
#define GT_EV_PATH 2   /* struct gt_path_event: a syscall plus its path or sockaddr */
#define GT_EV_BLOCK 3  /* struct gt_block_event */
#define GT_EV_OFFCPU 4 /* struct gt_offcpu_event (layouts 1-3) */
#define GT_EV_FORK 5   /* struct gt_proc_event */
#define GT_EV_EXEC 6
#define GT_EV_EXIT 7
#define GT_EV_FAULT 8 /* struct gt_fault_event */
#define GT_EV_MAPFILE 9 /* struct gt_mapfile_event, in the process-event ring */
/* 10 is EV_UNFINISHED, written by user space (probes/ebpf/events.py) */
#define GT_EV_FDRECV 11 /* struct gt_fdrecv_event, in both rings */
#define GT_EV_OFFCPU2 12 /* struct gt_offcpu2_event */
#define GT_EV_URING 13   /* struct gt_uring_event */
#define GT_EV_DIRTY 14   /* struct gt_dirty_event */

/* gt_proc_event.flags of a GT_EV_EXEC event: the exec gave the task privileges the capture's owner lacks, and
 * the process was left out of the trace from there on (see gt_task_foreign). */
#define GT_EXEC_LEFT_OUT 0x1

/* Where records were lost: indexes of the per-CPU `drops` array. */
#define GT_DROP_RINGBUF 0  /* events ring buffer full */
#define GT_DROP_PROCBUF 1  /* process-event ring buffer full */
#define GT_DROP_INFLIGHT 2 /* in-flight slot taken by another thread: that thread's call is lost */
#define GT_DROP_AGG 3      /* short-call aggregation map full */
#define GT_DROP_BLOCK 4    /* block request map full */
#define GT_DROP_OFFCPU 5   /* off-CPU map full */
#define GT_DROP_TARGETS 6  /* target set full: a child is not followed */
#define GT_DROP_FAULT 7    /* file-fault map full: a thread's wait in a page fault is not named */
#define GT_DROP_LAYOUT 8   /* a raw program read nonsense through a BTF offset (a wrong tid, no ring): skipped */
#define GT_DROP_URING 9    /* io_uring request map full: a request's file and timing are not recorded */
#define GT_DROP_MAX 10
/* After them, like the probe runs the kernel skipped, what the kernel did not report (offcpu_unreported,
 * unreported_switch_away): switches of a traced thread on or off a CPU, and of those the off-CPU spans lost for
 * want of a wakeup or a call's return to end them at */
#define GT_NOTE_UNREPORTED GT_DROP_MAX
#define GT_NOTE_UNREPORTED_LOST (GT_DROP_MAX + 1)
#define GT_DROP_SLOTS (GT_DROP_MAX + 2)

/* Per-syscall flags (the `sysinfo` array, filled from probes/ebpf/syscalls.py). */
#define GT_F_FD 0x1             /* args[0] is an fd */
#define GT_F_XFER 0x2           /* a positive return value is a byte count */
#define GT_F_PATH 0x4           /* args[1] is a user path */
#define GT_F_SOCKADDR 0x8       /* args[1] is a sockaddr, args[2] its length */
#define GT_F_SOCKADDR_PLEN 0x10 /* args[1] is a sockaddr, args[2] points to its length (filled on return) */
#define GT_F_FDTABLE 0x20       /* changes the fd table: always emitted, whatever its duration */
#define GT_F_PIPE 0x40          /* args[0] points to int[2], filled on return */
#define GT_F_TIMESPEC 0x80      /* the main argument points to a struct timespec */
#define GT_F_TRACED 0x100       /* set in the kernel's copy only: the raw entry program's "trace this nr" */
#define GT_F_PATH0 0x200        /* with GT_F_PATH: the path is args[0] and there is no dirfd (chdir) */
#define GT_F_DUPFD 0x400        /* changes the fd table when args[1] is F_DUPFD or F_DUPFD_CLOEXEC (fcntl) */
#define GT_F_MSGHDR 0x800       /* args[1] is a struct user_msghdr: fds it receives (SCM_RIGHTS) are reported */
#define GT_F_POLLFD 0x1000      /* args[0] points to args[1] struct pollfd: a0 reports the fd of a single one, else the
                                 * first ready one among the first GT_POLL_SCAN when the call returned > 0, else -1 */
#define GT_F_EPOLLFD 0x2000     /* no longer set: captures of earlier versions, whose epoll waits reported in a0 the low
                                 * 32 bits of the first ready event's data word, taken as an fd (else -1) */
#define GT_F_EPOLLDATA 0x4000   /* epoll_wait family: a0 keeps the epoll fd; when the call returned > 0, a1 is the first
                                 * ready event's whole data word and a0 has GT_EPOLL_DATA_OK */
#define GT_F_EPOLLCTL 0x8000    /* epoll_ctl: emitted whenever it succeeds; a0 the epoll fd (| GT_EPOLL_DATA_OK when a1
                                 * holds the data word of the event registered), arg the target fd | op << 32 */
#define GT_F_SELECTFD 0x10000   /* select/pselect6: a0 reports the fd of a select watching a single one, else the lowest
                                 * ready fd (read set, then write, then except) when the call returned > 0, else -1 */
#define GT_F_URING 0x20000      /* io_uring_enter: args[0] is the ring whose requests it submits and waits for */

struct gt_sysinfo {
    u32 flags;
    u32 arg_idx; /* which argument is the "main" one reported in `arg` */
};

struct gt_inflight {
    u64 ts;
    u64 args[4];
    u32 nr;
    u32 tid; /* owner of this slot while its call runs; 0 = free */
    /* The running total of short calls of one (thread, syscall), folded into `agg` when the thread
     * makes a short call of another syscall, exits, or the capture stops. */
    u32 agg_pid;
    u32 agg_tid;
    u32 agg_nr;
    u32 agg_pad;
    u64 agg_count;
    u64 agg_ns;
    /* The latest time a program running in the thread's own context saw it on its CPU during this call (a
     * dirty pause, a block request it submitted), 0 if none: a bound on when an unreported switch away came. */
    u64 ran_ns;
    /* A dirty pause in this call whose sleep no switch away has been seen for (yet): its time (0 if none) and
     * length. A program in the thread's context that finds it later makes the span (pause_unseen). */
    u64 pause_ts;
    u64 pause_ns;
};

struct gt_agg_key {
    u32 pid;
    u32 tid;
    u32 nr;
    u32 pad;
};

struct gt_agg_val {
    u64 count;
    u64 total_ns;
};

struct gt_sys_event { /* 64 bytes */
    u32 type;
    u32 nr;
    u32 pid;
    u32 tid;
    u64 start_ns;
    u64 end_ns;
    s64 ret;
    u64 a0;  /* the fd (or first pipe fd) */
    u64 a1;  /* second argument (dup2 newfd, second pipe fd, sockaddr length) */
    u64 arg; /* the main argument (count, futex address, sleep ns, ioctl cmd) */
};

struct gt_path_event { /* 328 bytes */
    struct gt_sys_event sys;
    u32 len;
    u32 pad;
    char data[GT_DATA_LEN];
};

struct gt_block_event { /* 72 bytes */
    u32 type;
    u32 dev;
    u32 pid;
    u32 tid;
    u64 sector;
    u64 issue_ns;
    u64 complete_ns;
    u32 nbytes;
    s32 error;
    char rwbs[8];
    char comm[GT_COMM_LEN];
};

struct gt_offcpu_event { /* 64 bytes */
    u32 type;
    u32 state;
    u32 pid;
    u32 tid;
    u64 start_ns;
    u64 end_ns;
    u64 wake_ns;
    u32 waker_pid;
    u32 waker_tid;
    char waker_comm[GT_COMM_LEN];
};

/* An off-CPU span (gt_offcpu_event's fields) and the task that had the CPU until this one got it back: when
 * the thread was preempted, or woken and then waited for a CPU, one that held the CPU it waited for. */
struct gt_offcpu2_event { /* 96 bytes: not 88, gt_fdrecv_event's size, by which the reader tells events apart */
    u32 type;
    u32 state;
    u32 pid;
    u32 tid;
    u64 start_ns;
    u64 end_ns;
    u64 wake_ns;
    u32 waker_pid;
    u32 waker_tid;
    char waker_comm[GT_COMM_LEN];
    u32 held_pid;
    u32 held_tid;
    char held_comm[GT_COMM_LEN];
    u64 pad; /* GT_OFFCPU_END_WAKE, GT_OFFCPU_END_RET, GT_OFFCPU_END_SEEN, GT_OFFCPU_START_CALL, or 0 */
};
/* gt_offcpu2_event.pad: the kernel did not report the switch back to the thread (held_* are empty); end_ns is its
 * wakeup (the wait for a CPU after it unknown), or, with no wakeup seen either, the return of the call it slept in */
#define GT_OFFCPU_END_WAKE 0x1
#define GT_OFFCPU_END_RET 0x2
/* ... and where the switch away was not reported either (the thread was woken off its CPU with no entry), its
 * start_ns is the start of the call it slept in: off CPU at most since then (state S) */
#define GT_OFFCPU_START_CALL 0x4
/* ... or, with neither, where the thread was first found on its CPU: by a timer interrupt (the scheduler's tick:
 * off CPU at most that long, by up to a tick), or by a program in its own context (a call's return, a dirty
 * pause, a block request it submitted) */
#define GT_OFFCPU_END_SEEN 0x8

/* gt_uring_event.flags */
#define GT_URING_FIXED 0x1  /* a registered (fixed) file: its fd is not known */
#define GT_URING_ASYNC 0x2  /* IOSQE_ASYNC: an io-wq worker thread issued it */
#define GT_URING_SQPOLL 0x4 /* submitted by the ring's SQPOLL thread */
#define GT_URING_MORE 0x8   /* a multishot request's completion with more to come (IORING_CQE_F_MORE): the next
                             * one's start_ns is this one's end_ns */
#define GT_URING_UNFINISHED 0x10 /* set by user space only: still in flight when the capture stopped (end_ns: the
                                  * stop; res 0), read from the `uring` map */
#define GT_URING_SKIP_CQE 0x20   /* IOSQE_CQE_SKIP_SUCCESS: a successful completion posts no CQE, and so fires no
                                  * io_uring_complete; its entry stays in `uring` done or not */

/* One io_uring request of a traced process, from its submission to its completion (the CQE posted), emitted
 * at completion in whatever context that runs (the submitter, an io-wq worker, an interrupt). */
struct gt_uring_event { /* 64 bytes: not 56 nor 88, the sizes the reader tells fault and fd-receive events by */
    u32 type;
    u32 opcode; /* IORING_OP_* */
    u32 pid;
    u32 tid;      /* the submitting thread (the SQPOLL thread when the ring has one) */
    u64 start_ns; /* submitted (io_uring_submit_req) */
    u64 end_ns;   /* completed (io_uring_complete) */
    s32 fd;       /* the file's fd (io_uring_file_get), -1 when unknown (a fixed file, an op without one) */
    s32 res;      /* the CQE's result: bytes, an fd, or -errno */
    s32 ring_fd;  /* the io_uring_enter fd it was submitted through, -1 when unknown (SQPOLL) */
    u32 flags;    /* GT_URING_* */
    u64 user_data;
    u32 cflags;
    u32 pad;
};

/* An io_uring request in flight, keyed by the kernel's request pointer. */
struct gt_uring_val {
    u64 ts;
    u64 ctx;
    u64 user_data;
    u32 pid;
    u32 tid;
    s32 fd;
    s32 ring_fd;
    u32 opcode;
    u32 flags;
};

struct gt_proc_event { /* 176 bytes */
    u32 type;
    u32 flags; /* fork: 1 = a thread; exit: 1 = the whole process is gone */
    u32 pid;
    u32 tid;
    u64 ts;
    u32 child_pid;
    u32 child_tid;
    char comm[GT_COMM_LEN];
    char filename[GT_FILENAME_LEN];
};

/* A traced thread waited (off CPU, uninterruptible) inside a page fault on a file mapping: emitted when it
 * is switched back in, once per wait of at least the off-CPU threshold. One fault can wait several times;
 * all its events share fault_ns. */
struct gt_fault_event { /* 56 bytes */
    u32 type;
    u32 dev; /* the file's s_dev (MAJ << 20 | MIN) */
    u32 pid;
    u32 tid;
    u64 fault_ns; /* when the fault reached the file (filemap_fault) */
    u64 start_ns; /* this wait: off CPU from start_ns to end_ns */
    u64 end_ns;
    u64 ino;
    u64 index; /* page index in the file */
};

/* The kernel paused a traced thread for dirtying page cache faster than its device's writeback cleans it
 * (balance_dirty_pages, writeback:balance_dirty_pages with pause > 0): it sleeps `pause_ms` next, inside
 * whatever call dirtied the pages (a write(), a fault on a shared mapping). The counts are pages, as the
 * tracepoint gives them: the device's writeback (`wb_*`) and its whole dirty domain. */
struct gt_dirty_event { /* 104 bytes: not 56 nor 88 */
    u32 type;
    u32 pad;
    u32 pid;
    u32 tid;
    u64 ts;
    s64 pause_ms;       /* how long the kernel set the pause for */
    u64 wb_dirty;       /* dirty + writeback pages of the device's writeback */
    u64 wb_setpoint;    /* the level it steers those to */
    u64 dirty;          /* dirty pages of the domain (global, or the cgroup's) */
    u64 limit;          /* the domain's dirty limit */
    u64 task_ratelimit; /* KB/s the thread was allowed to dirty */
    char bdi[32];       /* the device: "MAJ:MIN" for a block device */
};

/* A traced process's first fault on a file mapping: user space reads the file's path from /proc/PID/maps
 * while the faulting thread still holds the mapping. */
struct gt_mapfile_event { /* 32 bytes */
    u32 type;
    u32 dev;
    u32 pid;
    u32 tid;
    u64 ts;
    u64 ino;
};

/* A traced recvmsg installed fds received in an SCM_RIGHTS message. Emitted into the events ring (where it
 * is, the decoder forgets what those fd numbers held) and into the process-event ring (user space reads
 * /proc/PID/fd/N at once). */
struct gt_fdrecv_event { /* 88 bytes */
    u32 type;
    u32 count; /* fds filled in (more in the message are not reported) */
    u32 pid;
    u32 tid;
    u64 ts;
    s32 fds[GT_FDRECV_MAX];
};

/* The process-event ring's copy where BTF gives the file table's layout (GT_FILE_TABLE): each fd's inode
 * number as the recvmsg returned (0 where it could not be read), so that a name read later from /proc is
 * taken only if the fd still holds that inode. */
struct gt_fdrecv_named { /* 216 bytes */
    struct gt_fdrecv_event ev;
    u64 ino[GT_FDRECV_MAX];
};

struct gt_mapfile_key {
    u32 pid;
    u32 dev;
    u64 ino;
};

/* The last file-backed fault of a traced thread, keyed by tid. ip, sp and entry are the user registers at
 * the fault: while they are unchanged the thread has not returned to user space, so a sleep is inside it. */
struct gt_fault_val {
    u64 ts;
    u64 last; /* the fault's latest sign of life (a retry, a switch back in) */
    u64 ip;
    u64 sp;
    u64 entry; /* orig_ax: the fault's error code (a syscall's number when it entered by a syscall) */
    u64 ino;
    u64 index;
    u32 dev;
    u32 pid;
};

struct gt_blk_key {
    u32 dev;
    u32 pad;
    u64 sector;
};

struct gt_blk_val {
    u64 ts;
    u32 pid;
    u32 tid;
    char comm[GT_COMM_LEN];
};

struct gt_offcpu_val {
    u64 ts;
    u64 wake_ns;
    u64 fault_ns; /* the sleep is inside this thread's file fault of that time (gt_fault_val.ts), or 0 */
    u32 pid;
    u32 state;
    u32 waker_pid;
    u32 waker_tid;
    char waker_comm[GT_COMM_LEN];
    u32 io;  /* counted in `iowait`: off CPU in D, or waiting in io_uring_enter */
    u32 flags; /* GT_OFFCPU_START_CALL, or 0: passed on in the event's pad */
};

#ifdef GT_OWNER_UID
/* Whether `task` (a struct task_struct *) holds privileges the capture's owner, uid GT_OWNER_UID, lacks: a
 * non-root owner must not see into it, as the kernel would refuse that user ptrace or perf_event_open on it.
 * Shared with sampler.bpf.c. The kernel's rule (ptrace_may_access, PTRACE_MODE_READ_REALCREDS) lets a caller
 * in when the target's uid, euid and suid equal the caller's uid and its gid, egid and sgid the caller's gid,
 * its permitted capabilities are a subset of the caller's, and it is dumpable. Here, checked on the
 * objective credentials (real_cred, as ptrace does):
 *   - uid, euid, suid and fsuid all GT_OWNER_UID (a setuid program changes euid, suid and fsuid);
 *   - egid, sgid and fsgid all equal the task's own real gid (a setgid program changes them and leaves the
 *     real gid; an owner's process has no way to a real gid it was not given, so the owner's gid need not
 *     be known);
 *   - no permitted or effective capability (file capabilities, a setcap program; the owner is assumed to
 *     have none). This also leaves out a process holding capabilities in a user namespace of its own, which
 *     ptrace would allow: stricter than the kernel, never looser;
 *   - dumpable (mm->flags & MMF_DUMPABLE_MASK == SUID_DUMP_USER): also false after exec of a program its user
 *     may not read, whose code and symbols we would otherwise read for it.
 * Layouts come from BTF as -D flags (probes/ebpf/owner.py owner_cflags); a field that cannot be read makes
 * the task foreign: nothing is traced that was not checked. */
#define GT_DUMPABLE_MASK 0x3
#define GT_SUID_DUMP_USER 0x1
static __always_inline u32 gt_cred_u32(u64 cred, u32 off)
{
    u32 v = 0;
    if (gt_read_kernel(&v, sizeof(v), (void *)cred + off))
        return ~0U;
    return v;
}

static __always_inline int gt_task_foreign(u64 task)
{
    u64 cred = 0, mm = 0, mmflags = 0, caps[2] = {~0ULL, ~0ULL};
    if (gt_read_kernel(&cred, sizeof(cred), (void *)task + GT_TASK_REAL_CRED_OFF) || !cred)
        return 1;
    if (gt_cred_u32(cred, GT_CRED_UID_OFF) != GT_OWNER_UID || gt_cred_u32(cred, GT_CRED_EUID_OFF) != GT_OWNER_UID ||
        gt_cred_u32(cred, GT_CRED_SUID_OFF) != GT_OWNER_UID || gt_cred_u32(cred, GT_CRED_FSUID_OFF) != GT_OWNER_UID)
        return 1;
    u32 gid = gt_cred_u32(cred, GT_CRED_GID_OFF);
    if (gid == ~0U || gt_cred_u32(cred, GT_CRED_EGID_OFF) != gid || gt_cred_u32(cred, GT_CRED_SGID_OFF) != gid ||
        gt_cred_u32(cred, GT_CRED_FSGID_OFF) != gid)
        return 1;
    gt_read_kernel(&caps[0], sizeof(caps[0]), (void *)cred + GT_CRED_CAP_PERMITTED_OFF);
    gt_read_kernel(&caps[1], sizeof(caps[1]), (void *)cred + GT_CRED_CAP_EFFECTIVE_OFF);
    if (caps[0] || caps[1])
        return 1;
    if (gt_read_kernel(&mm, sizeof(mm), (void *)task + GT_TASK_MM_OFF) || !mm)
        return 1; /* no user memory (a kernel thread): nothing of the owner's */
    if (gt_read_kernel(&mmflags, sizeof(mmflags), (void *)mm + GT_MM_FLAGS_OFF))
        return 1;
    return (mmflags & GT_DUMPABLE_MASK) != GT_SUID_DUMP_USER;
}
#endif

#endif
