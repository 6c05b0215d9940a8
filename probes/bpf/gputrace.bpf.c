/* gputrace kernel side: follows a process tree and records what can make a GPU wait.
 *
 * Tracepoints only. Syscalls come through the raw tracepoints sys_enter / sys_exit (GT_RAW_SYSCALLS=1,
 * one program pair for every syscall, no perf trace buffer to fill), or on kernels where those cannot be
 * attached through the classic syscalls:sys_enter_X / sys_exit_X tracepoints of each traced syscall
 * (GT_RAW_SYSCALLS=0). Everything a non-target pays is a few array lookups: syscall entry checks the nr
 * in `sysinfo` (raw path) and the tgid in `tslot`, syscall exit looks up its tid in `inflight` (only
 * targets ever get an entry). Calls shorter
 * than THRESHOLD_NS are summed per (tid, syscall) in `agg`, not emitted. Every lost record is counted in
 * `drops` by reason (see gputrace.h). Build-time settings come in as -D flags from probes/ebpf/source.py. */
/* Only struct pt_regs comes from the kernel's headers (asm/ptrace.h); task_struct fields are read at offsets
 * taken from BTF (probes/ebpf/btf.py). linux/sched.h would make the compile 1 s slower on every capture. */
#include <asm/ptrace.h>
#include "gputrace.h"

#ifndef offsetof
#define offsetof(t, m) __builtin_offsetof(t, m)
#endif

#ifndef GT_RAW_SYSCALLS
#define GT_RAW_SYSCALLS 1
#endif

#ifndef THRESHOLD_NS
#define THRESHOLD_NS 100000
#endif
#ifndef OFFCPU_THRESHOLD_NS
#define OFFCPU_THRESHOLD_NS THRESHOLD_NS
#endif
#ifndef MAX_TARGETS
#define MAX_TARGETS 4096
#endif
#ifndef INFLIGHT_BITS
#define INFLIGHT_BITS 16
#endif
#define INFLIGHT_MASK ((1U << INFLIGHT_BITS) - 1)
#ifndef MAX_OFFCPU
#define MAX_OFFCPU 16384
#endif
#ifndef MAX_AGG
#define MAX_AGG 16384
#endif
#ifndef EVENT_PAGES
#define EVENT_PAGES 4096
#endif
#ifndef PROC_PAGES
#define PROC_PAGES 64
#endif
#ifndef TARGET_BITS
#define TARGET_BITS 16
#endif
#define TARGET_MASK ((1U << TARGET_BITS) - 1)
#define GT_SLOT_SHARED 0xFFFFFFFFU
#define GT_CLONE_THREAD 0x00010000

/* The traced tgids. `targets` is the set; `tslot` answers the common question (is this task traced?)
 * with an array lookup: slot tgid & TARGET_MASK holds 0 (no target), the one target tgid in it, or
 * GT_SLOT_SHARED (several: ask `targets`). User space keeps both the same way (probes/ebpf/source.py). */
BPF_HASH(targets, u32, u8, MAX_TARGETS);
BPF_ARRAY(tslot, u32, 1 << TARGET_BITS);
/* In-flight calls in slots indexed by tid: an array lookup instead of hash update/lookup/delete on every
 * call (the difference between ~1.5x and ~1.2x on a pread loop). Two traced threads whose tids share
 * the low INFLIGHT_BITS and are in a syscall at once collide; the loser is counted in drops. */
BPF_ARRAY(inflight, struct gt_inflight, 1 << INFLIGHT_BITS);
BPF_HASH(agg, struct gt_agg_key, struct gt_agg_val, MAX_AGG);
BPF_ARRAY(sysinfo, struct gt_sysinfo, GT_NR_MAX);
BPF_PERCPU_ARRAY(drops, u64, GT_DROP_SLOTS);
BPF_HASH(blk, struct gt_blk_key, struct gt_blk_val, 8192);
BPF_HASH(offcpu, u32, struct gt_offcpu_val, MAX_OFFCPU);
/* How many traced tasks are off CPU in uninterruptible sleep (D) right now: one per `offcpu` entry in
 * state D. While it is above 0, block requests are recorded whoever submits them (see block_submit). */
BPF_ARRAY(iowait, s64, 1);
BPF_RINGBUF_OUTPUT(events, EVENT_PAGES);
#ifdef HAVE_FILEMAP_FAULT
BPF_HASH(faults, u32, struct gt_fault_val, MAX_OFFCPU); /* by tid: the thread's last file fault */
/* (tgid, file) pairs announced to user space; an evicted pair is announced again, which is harmless. */
BPF_TABLE("lru_hash", struct gt_mapfile_key, u8, mapfiles, MAX_OFFCPU);
#endif
BPF_RINGBUF_OUTPUT(procev, PROC_PAGES);

/* Never read, never updated: they let user space see the compiler's layout of the shared events. */
BPF_ARRAY(layout_sys, struct gt_sys_event, 1);
BPF_ARRAY(layout_path, struct gt_path_event, 1);
BPF_ARRAY(layout_block, struct gt_block_event, 1);
BPF_ARRAY(layout_offcpu, struct gt_offcpu_event, 1);
BPF_ARRAY(layout_offcpu2, struct gt_offcpu2_event, 1);
BPF_ARRAY(layout_proc, struct gt_proc_event, 1);
BPF_ARRAY(layout_fault, struct gt_fault_event, 1);
BPF_ARRAY(layout_mapfile, struct gt_mapfile_event, 1);
BPF_ARRAY(layout_fdrecv, struct gt_fdrecv_event, 1);
BPF_ARRAY(layout_uring, struct gt_uring_event, 1);
BPF_ARRAY(layout_dirty, struct gt_dirty_event, 1);

static __always_inline void count_drop(u32 reason)
{
    u64 *n = drops.lookup(&reason);
    if (n)
        (*n)++;
}

static __always_inline int is_target(u32 tgid)
{
    u32 s = tgid & TARGET_MASK;
    u32 *v = tslot.lookup(&s);
    if (!v || *v == 0)
        return 0;
    if (*v == tgid)
        return 1;
    if (*v != GT_SLOT_SHARED)
        return 0;
    return targets.lookup(&tgid) != 0;
}

static __always_inline int add_target(u32 tgid)
{
    u8 one = 1;
    if (targets.update(&tgid, &one))
        return -1;
    u32 s = tgid & TARGET_MASK;
    u32 *v = tslot.lookup(&s);
    if (v)
        *v = (*v == 0 || *v == tgid) ? tgid : GT_SLOT_SHARED;
    return 0;
}

static __always_inline void remove_target(u32 tgid)
{
    targets.delete(&tgid);
    u32 s = tgid & TARGET_MASK;
    u32 *v = tslot.lookup(&s);
    if (v && *v == tgid)
        *v = 0;
}

/* Claim the calling thread's in-flight slot for a traced call. */
static __always_inline struct gt_inflight *sys_enter_slot(u64 id, u32 nr)
{
    u32 tid = (u32)id;
    u32 slot = tid & INFLIGHT_MASK;
    struct gt_inflight *v = inflight.lookup(&slot);
    if (!v)
        return 0;
    if (v->tid && v->tid != tid)
        count_drop(GT_DROP_INFLIGHT);
    v->tid = tid;
    v->ts = bpf_ktime_get_ns();
    v->nr = nr;
    v->ran_ns = 0;
    v->pause_ts = 0;
    return v;
}

/* Thread `tid`'s in-flight slot while it is in a recorded call, else NULL. */
static __always_inline struct gt_inflight *recorded_call(u32 tid)
{
    u32 slot = tid & INFLIGHT_MASK;
    struct gt_inflight *c = inflight.lookup(&slot);
    return c && c->tid == tid ? c : 0;
}

/* ------------------------------------------------------------------------- select fd sets ---- */

/* The index of the lowest bit set in w (w != 0): BPF has no count-trailing-zeros instruction. */
static __always_inline u32 lowest_bit(u64 w)
{
    u32 n = 0;
    w &= -w;
#pragma unroll
    for (u32 shift = 32; shift; shift >>= 1) {
        if (w >> shift) {
            n += shift;
            w >>= shift;
        }
    }
    return n;
}

/* Word i of an fd_set, limited to its first nfds bits: the kernel reads no more (the caller's set may be
 * shorter than FD_SETSIZE). 0 when the set is NULL or unreadable. */
static __always_inline u64 fdset_word(u64 set, u32 nfds, u32 i)
{
    u64 w = 0;
    if (!set || gt_read_user(&w, sizeof(w), (void *)set + i * 8))
        return 0;
    u32 left = nfds - i * 64;
    return left >= 64 ? w : w & ((1ULL << left) - 1);
}

/* At a select's entry (args: nfds, readfds, writefds, exceptfds): the one fd it watches, in any of its
 * sets, or -1 when it watches none or several (or fds past GT_SELECT_WORDS words). Read now because the
 * call overwrites the sets with the ready ones, all zero when it times out. */
static __always_inline s32 select_single(u64 *args)
{
    u32 nfds = (u32)args[0];
    s32 fd = -1;
    if (nfds > GT_SELECT_WORDS * 64)
        return -1;
#pragma unroll
    for (u32 i = 0; i < GT_SELECT_WORDS; i++) {
        if (i * 64 >= nfds)
            break;
        u64 w = fdset_word(args[1], nfds, i) | fdset_word(args[2], nfds, i) | fdset_word(args[3], nfds, i);
        if (!w)
            continue;
        if (fd >= 0 || (w & (w - 1)))
            return -1;
        fd = i * 64 + lowest_bit(w);
    }
    return fd;
}

/* The entry's answer travels in the upper half of args[0] (nfds is an int): the fd + 1, 0 for none. */
static __always_inline void select_enter(u64 *args)
{
    u32 nfds = (u32)args[0];
    args[0] = nfds | ((u64)(u32)(select_single(args) + 1) << 32);
}

/* The lowest fd set in a ready set, or -1. */
static __always_inline s32 fdset_first(u64 set, u32 nfds)
{
    if (!set || nfds > GT_SELECT_WORDS * 64)
        return -1;
#pragma unroll
    for (u32 i = 0; i < GT_SELECT_WORDS; i++) {
        if (i * 64 >= nfds)
            return -1;
        u64 w = fdset_word(set, nfds, i);
        if (w)
            return i * 64 + lowest_bit(w);
    }
    return -1;
}

/* The fd a select names, as poll_fd does for a poll: the one it watched, whatever it returned; else the
 * lowest ready one (read set, then write, then except) when it returned some; else -1. */
static __always_inline s32 select_fd(struct gt_inflight *c, s64 ret)
{
    u32 single = c->args[0] >> 32;
    if (single)
        return (s32)single - 1;
    if (ret <= 0)
        return -1;
    u32 nfds = (u32)c->args[0];
    s32 fd = fdset_first(c->args[1], nfds);
    if (fd < 0)
        fd = fdset_first(c->args[2], nfds);
    if (fd < 0)
        fd = fdset_first(c->args[3], nfds);
    return fd;
}

#if GT_RAW_SYSCALLS
/* x86_64 pt_regs (stable ABI): r10 r9 r8 ax cx dx si di orig_ax ip cs, one word each, in that order.
 * The syscall arguments are di, si, dx, r10 (r8, r9 after them are not used); Python selects this path
 * on x86_64 only. A 32-bit task (code segment __USER32_CS) numbers its calls and passes its arguments
 * differently; the classic tracepoints skip its calls, and so does this path. */
#define GT_REG_R10 0
#define GT_REG_DX 5
#define GT_REG_SI 6
#define GT_REG_DI 7
#define GT_REG_ORIG_AX 8
#define GT_REG_CS 10
#define GT_USER32_CS 0x23
_Static_assert(offsetof(struct pt_regs, orig_ax) - offsetof(struct pt_regs, r10) == 8 * GT_REG_ORIG_AX,
               "unexpected pt_regs layout");
_Static_assert(offsetof(struct pt_regs, cs) - offsetof(struct pt_regs, r10) == 8 * GT_REG_CS,
               "unexpected pt_regs layout");

/* ctx->args: (struct pt_regs *regs, long id). Every syscall of every task comes here: the nr test
 * (an array lookup) goes first, so untraced calls pay nothing else. */
int gt_sys_enter(struct bpf_raw_tracepoint_args *ctx)
{
    u32 nr = (u32)ctx->args[1];
    struct gt_sysinfo *si = sysinfo.lookup(&nr);
    if (!si || !(si->flags & GT_F_TRACED))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u64 r[GT_REG_CS + 1] = {};
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
    gt_read_kernel(r, sizeof(r), (void *)regs + offsetof(struct pt_regs, r10));
    if (r[GT_REG_CS] == GT_USER32_CS)
        return 0;
    struct gt_inflight *v = sys_enter_slot(id, nr);
    if (!v)
        return 0;
    v->args[0] = r[GT_REG_DI];
    v->args[1] = r[GT_REG_SI];
    v->args[2] = r[GT_REG_DX];
    v->args[3] = r[GT_REG_R10];
    if (si->flags & GT_F_SELECTFD)
        select_enter(v->args);
    return 0;
}

/* The nr of the call now returning, to match it with the one its slot holds. */
static __always_inline u32 exit_nr(struct bpf_raw_tracepoint_args *ctx)
{
    u64 nr = (u64)-1;
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
    gt_read_kernel(&nr, sizeof(nr), (void *)regs + offsetof(struct pt_regs, orig_ax));
    return (u32)nr;
}
#define GT_EXIT_CTX struct bpf_raw_tracepoint_args
#define GT_EXIT_RET(ctx) ((s64)(ctx)->args[1])
#else
/* The common layout of every syscalls:sys_enter_X / sys_exit_X tracepoint. */
struct gt_sys_enter_args {
    u64 common;
    s32 nr;
    u32 pad;
    u64 args[6];
};

struct gt_sys_exit_args {
    u64 common;
    s32 nr;
    u32 pad;
    s64 ret;
};

int gt_sys_enter(struct gt_sys_enter_args *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    struct gt_inflight *v = sys_enter_slot(id, (u32)ctx->nr);
    if (!v)
        return 0;
    /* Copied, not loaded from ctx: a direct load past a call's last argument would make the kernel
     * refuse to attach the shared program to tracepoints with fewer arguments. Extra slots hold junk. */
    gt_read_kernel(v->args, sizeof(v->args), ctx->args);
    u32 nr = (u32)ctx->nr;
    struct gt_sysinfo *si = sysinfo.lookup(&nr);
    if (si && (si->flags & GT_F_SELECTFD))
        select_enter(v->args);
    return 0;
}

#define exit_nr(ctx) ((u32)(ctx)->nr)
#define GT_EXIT_CTX struct gt_sys_exit_args
#define GT_EXIT_RET(ctx) ((ctx)->ret)
#endif

static __always_inline void fold_agg(struct gt_inflight *v)
{
    if (!v->agg_count)
        return;
    struct gt_agg_key k = {.pid = v->agg_pid, .tid = v->agg_tid, .nr = v->agg_nr};
    struct gt_agg_val *a = agg.lookup(&k);
    if (a) {
        /* One key per thread: only that thread (or the final read) touches it. */
        a->count += v->agg_count;
        a->total_ns += v->agg_ns;
    } else {
        struct gt_agg_val init = {.count = v->agg_count, .total_ns = v->agg_ns};
        if (agg.insert(&k, &init))
            count_drop(GT_DROP_AGG);
    }
    v->agg_count = 0;
    v->agg_ns = 0;
}

static __always_inline void add_agg(struct gt_inflight *v, u32 pid, u32 tid, u32 nr, u64 dur)
{
    if (v->agg_tid != tid || v->agg_nr != nr) {
        fold_agg(v);
        v->agg_pid = pid;
        v->agg_tid = tid;
        v->agg_nr = nr;
    }
    v->agg_count += 1;
    v->agg_ns += dur;
}

#define GT_EPOLL_CTL_DEL 2 /* the one epoll_ctl op whose event may be NULL */

/* struct pollfd: int fd; short events; short revents. */
struct gt_pollfd {
    s32 fd;
    s16 events;
    s16 revents;
};

/* The fd a poll names: a wait for one fd (a socket with a timeout) names it whatever it returned; of
 * several, the first with events among the first GT_POLL_SCAN, when the call returned some; else -1. */
static __always_inline s32 poll_fd(struct gt_inflight *c, s64 ret)
{
    struct gt_pollfd p = {};
    u64 n = c->args[1];
    if (n == 1)
        return gt_read_user(&p, sizeof(p), (void *)c->args[0]) ? -1 : p.fd;
    if (ret <= 0)
        return -1;
#pragma unroll
    for (int i = 0; i < GT_POLL_SCAN; i++) {
        if (i >= n || gt_read_user(&p, sizeof(p), (void *)c->args[0] + i * sizeof(p)))
            return -1;
        if (p.revents && p.fd >= 0)
            return p.fd;
    }
    return -1;
}

static __always_inline void fill_sys(struct gt_sys_event *e, u32 type, struct gt_inflight *c, u64 id,
                                     u64 now, s64 ret, struct gt_sysinfo *si)
{
    e->type = type;
    e->nr = c->nr;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->start_ns = c->ts;
    e->end_ns = now;
    e->ret = ret;
    e->a0 = c->args[0];
    e->a1 = c->args[1];
    e->arg = c->args[si->arg_idx & 3];
    if (si->flags & GT_F_TIMESPEC) {
        s64 ts[2] = {};
        /* A sleep's time asked for: a duration, or a deadline (TIMER_ABSTIME) on the call's clock. Not on a
         * CPU-time clock (clock_nanosleep's CLOCK_PROCESS_CPUTIME_ID, or a pid's: a negative id), whose time
         * passes with CPU time used, not with wall time: 0, unknown. */
        s32 clock = (s32)c->args[0];
        if ((si->arg_idx & 3) == 2 && (clock < 0 || clock == 2 || clock == 3))
            e->arg = 0;
        else if (e->arg && gt_read_user(ts, sizeof(ts), (void *)e->arg) == 0)
            e->arg = ts[0] * 1000000000ULL + ts[1];
    }
    if (si->flags & GT_F_POLLFD)
        e->a0 = (u64)(s64)poll_fd(c, ret);
    if (si->flags & GT_F_SELECTFD) {
        e->a0 = (u64)(s64)select_fd(c, ret);
        e->arg = (u32)c->args[0];
    }
    if (si->flags & GT_F_EPOLLDATA) {
        /* The data word is the caller's (asyncio, libuv and libev put the fd there, mio/tokio a token, others a
         * pointer): the reader maps it to the fd registered with it (epoll_ctl events, /proc fdinfo). */
        e->a0 = (u32)c->args[0];
        e->a1 = 0;
        if (ret > 0 && gt_read_user(&e->a1, sizeof(e->a1), (void *)c->args[1] + GT_EPOLL_DATA_OFF) == 0)
            e->a0 |= GT_EPOLL_DATA_OK;
    }
    if (si->flags & GT_F_EPOLLCTL) {
        u32 op = (u32)c->args[1];
        e->a0 = (u32)c->args[0];
        e->a1 = 0;
        e->arg = (u32)c->args[2] | ((u64)op << 32);
        if (op != GT_EPOLL_CTL_DEL && c->args[3] &&
            gt_read_user(&e->a1, sizeof(e->a1), (void *)c->args[3] + GT_EPOLL_DATA_OFF) == 0)
            e->a0 |= GT_EPOLL_DATA_OK;
    }
    if ((si->flags & GT_F_PIPE) && ret == 0) {
        int fds[2] = {-1, -1};
        gt_read_user(fds, sizeof(fds), (void *)c->args[0]);
        e->a0 = (u64)(s64)fds[0];
        e->a1 = (u64)(s64)fds[1];
    }
}

static __always_inline void read_sockaddr(struct gt_path_event *e, const void *addr, u32 len)
{
    if (!addr || len == 0)
        return;
    if (len > GT_SOCKADDR_MAX)
        len = GT_SOCKADDR_MAX;
    /* Keep the compiler from folding the clamp away; the mask is the bound the verifier sees. */
    asm volatile("" : "+r"(len));
    u64 n = len & (GT_DATA_LEN - 1);
    if (n && gt_read_user(e->data, n, addr) == 0)
        e->len = n;
}

static __always_inline void emit_path(struct gt_inflight *c, u64 id, u64 now, s64 ret, struct gt_sysinfo *si)
{
    struct gt_path_event *e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(GT_DROP_RINGBUF);
        return;
    }
    fill_sys(&e->sys, GT_EV_PATH, c, id, now, ret, si);
    e->len = 0;
    e->pad = 0;
    e->data[0] = 0;
    if (si->flags & GT_F_PATH) {
        void *path = (void *)((si->flags & GT_F_PATH0) ? c->args[0] : c->args[1]);
        int n = gt_read_user_str(e->data, sizeof(e->data), path);
        e->len = n > 0 ? n - 1 : 0;
    } else if (si->flags & GT_F_SOCKADDR) {
        read_sockaddr(e, (void *)c->args[1], (u32)c->args[2]);
    } else if ((si->flags & GT_F_SOCKADDR_PLEN) && ret >= 0 && c->args[2]) {
        u32 len = 0;
        gt_read_user(&len, sizeof(len), (void *)c->args[2]);
        read_sockaddr(e, (void *)c->args[1], len);
    }
    events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
}

static __always_inline void emit_sys(struct gt_inflight *c, u64 id, u64 now, s64 ret, struct gt_sysinfo *si)
{
    struct gt_sys_event *e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(GT_DROP_RINGBUF);
        return;
    }
    fill_sys(e, GT_EV_SYS, c, id, now, ret, si);
    events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
}

/* ---------------------------------------------------------------- fds received (SCM_RIGHTS) ---- */

#define GT_SOL_SOCKET 1
#define GT_SCM_RIGHTS 1
#define GT_FCNTL_DUPFD 0
#define GT_FCNTL_DUPFD_CLOEXEC 1030
/* x86_64 struct user_msghdr: msg_control at 32, msg_controllen at 40 (the bytes of control data received,
 * written back by the call). struct cmsghdr: cmsg_len (size_t), cmsg_level, cmsg_type, then the data. */
#define GT_MSG_CONTROL_OFF 32
#define GT_CMSG_HDR_LEN 16

struct gt_cmsghdr {
    u64 len;
    s32 level;
    s32 type;
};

#ifdef GT_FILE_TABLE
/* The inode number of the file fd `fd` of `task` holds (the calling task: its file table cannot change under
 * it), 0 if none: task->files->fdt->fd[fd]->f_inode->i_ino, at offsets BTF gives (hooks.file_table_flags). */
static __always_inline u64 fd_inode(u64 task, s32 fd)
{
    u64 files = 0, fdt = 0, table = 0, file = 0, inode = 0, ino = 0;
    u32 max_fds = 0;
    if (fd < 0 || gt_read_kernel(&files, sizeof(files), (void *)task + GT_TASK_FILES_OFF) || !files)
        return 0;
    if (gt_read_kernel(&fdt, sizeof(fdt), (void *)files + GT_FILES_FDT_OFF) || !fdt)
        return 0;
    if (gt_read_kernel(&max_fds, sizeof(max_fds), (void *)fdt + GT_FDT_MAX_FDS_OFF) || (u32)fd >= max_fds)
        return 0;
    if (gt_read_kernel(&table, sizeof(table), (void *)fdt + GT_FDT_FD_OFF) || !table)
        return 0;
    if (gt_read_kernel(&file, sizeof(file), (void *)table + (u64)fd * sizeof(u64)) || !file)
        return 0;
    if (gt_read_kernel(&inode, sizeof(inode), (void *)file + GT_FILE_INODE_OFF) || !inode)
        return 0;
    gt_read_kernel(&ino, sizeof(ino), (void *)inode + GT_INODE_INO_OFF);
    return ino;
}
#endif

/* After a traced recvmsg: the fds its first control message installed, if it is SCM_RIGHTS (at most
 * GT_FDRECV_MAX of them), into both rings. Costs two small user reads per recvmsg. */
static __always_inline void fds_received(struct gt_inflight *c, u64 id, u64 now)
{
    u64 ctl[2] = {}; /* msg_control, msg_controllen */
    if (!c->args[1] || gt_read_user(ctl, sizeof(ctl), (void *)c->args[1] + GT_MSG_CONTROL_OFF))
        return;
    if (!ctl[0] || ctl[1] < GT_CMSG_HDR_LEN + sizeof(s32))
        return;
    struct gt_cmsghdr h = {};
    if (gt_read_user(&h, sizeof(h), (void *)ctl[0]) || h.level != GT_SOL_SOCKET || h.type != GT_SCM_RIGHTS)
        return;
    if (h.len > ctl[1])
        h.len = ctl[1];
    if (h.len < GT_CMSG_HDR_LEN + sizeof(s32))
        return;
    u64 n = (h.len - GT_CMSG_HDR_LEN) / sizeof(s32);
    struct gt_fdrecv_event *e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(GT_DROP_RINGBUF);
        return;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->type = GT_EV_FDRECV;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->ts = now;
    const s32 *src = (const s32 *)(ctl[0] + GT_CMSG_HDR_LEN);
#pragma unroll
    for (int i = 0; i < GT_FDRECV_MAX; i++) {
        if (i >= n || gt_read_user(&e->fds[i], sizeof(s32), src + i))
            break;
        e->count = i + 1;
    }
#ifdef GT_FILE_TABLE
    struct gt_fdrecv_named *p = procev.ringbuf_reserve(sizeof(*p));
    if (p) {
        __builtin_memcpy(&p->ev, e, sizeof(p->ev));
        u64 task = bpf_get_current_task();
#pragma unroll
        for (int i = 0; i < GT_FDRECV_MAX; i++)
            p->ino[i] = i < e->count ? fd_inode(task, e->fds[i]) : 0;
        procev.ringbuf_submit(p, 0);
    } else {
        count_drop(GT_DROP_PROCBUF);
    }
#else
    struct gt_fdrecv_event *p = procev.ringbuf_reserve(sizeof(*p));
    if (p) {
        __builtin_memcpy(p, e, sizeof(*p));
        procev.ringbuf_submit(p, 0);
    } else {
        count_drop(GT_DROP_PROCBUF);
    }
#endif
    events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
}

#define GT_STATE_S 0x1 /* sched_switch prev_state: interruptible sleep */
#define GT_STATE_D 0x2 /* sched_switch prev_state: uninterruptible sleep */

static __always_inline void iowait_add(s64 d)
{
    u32 zero = 0;
    s64 *n = iowait.lookup(&zero);
    if (!n || (d < 0 && *n <= 0))
        return; /* never below zero, even if an increment was missed */
    __sync_fetch_and_add(n, d);
}

static __always_inline int iowait_any(void)
{
    u32 zero = 0;
    s64 *n = iowait.lookup(&zero);
    return n && *n > 0;
}

/* Forget a task's off-CPU entry, keeping `iowait` in step with the entries it counts. */
static __always_inline void offcpu_forget(u32 tid, struct gt_offcpu_val *o)
{
    if (o->io)
        iowait_add(-1);
    offcpu.delete(&tid);
}

/* A reserved off-CPU event for thread `tid`'s span `o` ending at `end`, held_* empty; NULL (counted) when the ring
 * is full. The caller fills in what else it knows and submits it. */
static __always_inline struct gt_offcpu2_event *offcpu_event(u32 tid, struct gt_offcpu_val *o, u64 end)
{
    struct gt_offcpu2_event *e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(GT_DROP_RINGBUF);
        return 0;
    }
    e->type = GT_EV_OFFCPU2;
    e->state = o->state;
    e->pid = o->pid;
    e->tid = tid;
    e->start_ns = o->ts;
    e->end_ns = end;
    e->wake_ns = o->wake_ns;
    e->waker_pid = o->waker_pid;
    e->waker_tid = o->waker_tid;
    __builtin_memcpy(e->waker_comm, o->waker_comm, sizeof(e->waker_comm));
    e->held_pid = 0;
    e->held_tid = 0;
    __builtin_memset(e->held_comm, 0, sizeof(e->held_comm));
    e->pad = o->flags;
    return e;
}

#ifdef HAVE_FILEMAP_FAULT
/* Thread `tid`'s off-CPU span `o`, inside a file fault, ends at `now` (its switch back, or where offcpu_unreported
 * ends it): the fault's wait, when in D and at least the threshold. */
static __always_inline void fault_wait(u32 tid, struct gt_offcpu_val *o, u64 now)
{
    struct gt_fault_val *f = faults.lookup(&tid);
    if (!f || f->ts != o->fault_ns)
        return;
    f->last = now;
    if (!(o->state & GT_STATE_D) || now - o->ts < OFFCPU_THRESHOLD_NS)
        return;
    struct gt_fault_event *e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(GT_DROP_RINGBUF);
        return;
    }
    e->type = GT_EV_FAULT;
    e->dev = f->dev;
    e->pid = f->pid;
    e->tid = tid;
    e->fault_ns = f->ts;
    e->start_ns = o->ts;
    e->end_ns = now;
    e->ino = f->ino;
    e->index = f->index;
    events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
}
#endif

/* Thread `tid` is on a CPU (in a syscall's exit, or leaving the CPU) while its off-CPU entry `o` is still open:
 * the switch that gave it the CPU back fired no sched_switch. Some kernels report no event at all while certain
 * tasks hold a CPU (seen with a VM's guest agent): a traced thread that takes the CPU from one comes back unseen,
 * and a timer that wakes it while one runs wakes it unseen. The span ends at its wakeup when one was seen (it
 * was off CPU at least that long; the wait for a CPU after it is unknown: GT_OFFCPU_END_WAKE); else, for a sleep
 * (S or D) ended by a call's return at `ret_ns`, there (it was off CPU at most that long: GT_OFFCPU_END_RET);
 * else, found on its CPU at `seen_ns` by a timer interrupt (offcpu_running: at most that long, by up to a tick) or
 * by a program in its own context (a call's return, a dirty pause, a block request it submitted, a file fault:
 * seen_running), there (GT_OFFCPU_END_SEEN); else (found at its next switch away, before any tick) its end is
 * unknown and the span is counted lost. A span inside a file fault is that fault's wait, to the same end. Either
 * way the entry is forgotten, so it does not stay open. held_* are empty: who had the CPU is unknown. */
static __always_inline void offcpu_unreported(u32 tid, struct gt_offcpu_val *o, u64 ret_ns, u64 seen_ns)
{
    count_drop(GT_NOTE_UNREPORTED);
    u64 end = o->wake_ns, flag = GT_OFFCPU_END_WAKE;
    if (!end && ret_ns && (o->state & (GT_STATE_S | GT_STATE_D))) {
        end = ret_ns;
        flag = GT_OFFCPU_END_RET;
    } else if (!end && seen_ns) {
        end = seen_ns;
        flag = GT_OFFCPU_END_SEEN;
    }
    if (!end || end < o->ts) {
        count_drop(GT_NOTE_UNREPORTED_LOST);
    } else {
        if (end - o->ts >= OFFCPU_THRESHOLD_NS) {
            struct gt_offcpu2_event *e = offcpu_event(tid, o, end);
            if (e) {
                e->pad |= flag;
                events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
            }
        }
#ifdef HAVE_FILEMAP_FAULT
        if (o->fault_ns)
            fault_wait(tid, o, end); /* a fault's wait ends with its span, however that end was found */
#endif
    }
    offcpu_forget(tid, o);
}

/* Thread `tid` of process `pid`, in call `c`, is on its CPU at `now` after a dirty pause (c->pause_ts) whose sleep
 * no switch away was seen for: neither the switch away nor the timer's wakeup was reported (both while a task the
 * kernel reports nothing for held the CPU: see offcpu_unreported). A positive pause is slept right after it, in D
 * (a nowait write, BDP_ASYNC, returns instead: back sooner than half the pause, it is taken as not slept), so the
 * thread was off CPU at most from the pause until now: that span (GT_OFFCPU_START_CALL, GT_OFFCPU_END_SEEN, no
 * waker), counted with the unreported switches. */
static __always_inline void pause_unseen(u32 pid, u32 tid, struct gt_inflight *c, u64 now)
{
    u64 from = c->pause_ts;
    c->pause_ts = 0;
    if (!from || now < from || 2 * (now - from) < c->pause_ns)
        return;
    count_drop(GT_NOTE_UNREPORTED);
    if (now - from < OFFCPU_THRESHOLD_NS)
        return;
    struct gt_offcpu_val v = {};
    v.ts = from;
    v.pid = pid;
    v.state = GT_STATE_D;
    v.flags = GT_OFFCPU_START_CALL;
    struct gt_offcpu2_event *e = offcpu_event(tid, &v, now);
    if (e) {
        e->pad |= GT_OFFCPU_END_SEEN;
        events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
    }
}

/* Thread `id`, in a program running in its context at `now`, is on its CPU: see gt_inflight.ran_ns; its call's
 * in-flight slot (NULL when it is in no recorded call). An off-CPU
 * entry still open ended before now, its switch back unreported (offcpu_unreported: at its wakeup if one was seen,
 * else here, GT_OFFCPU_END_SEEN): a dirty pause's sleep whose timer woke it unseen is ended by the next pause, not
 * lost at the switch away that pause begins (and a fault's wait by the next fault); one whose switch away went
 * unseen too ends here (pause_unseen). */
static __always_inline struct gt_inflight *seen_running(u64 id, u64 now)
{
    u32 tid = (u32)id;
    struct gt_inflight *c = recorded_call(tid);
    if (c) {
        pause_unseen(id >> 32, tid, c, now);
        c->ran_ns = now;
    }
    struct gt_offcpu_val *o = offcpu.lookup(&tid);
    if (o)
        offcpu_unreported(tid, o, 0, now);
    return c;
}

int gt_sys_exit(GT_EXIT_CTX *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    u32 slot = tid & INFLIGHT_MASK;
    struct gt_inflight *v = inflight.lookup(&slot);
    if (!v || v->tid != tid)
        return 0;
    struct gt_inflight c = *v;
    v->tid = 0;
    if (c.nr != exit_nr(ctx))
        return 0; /* entry of another call (its exit was missed): no trustworthy duration */
    u64 now = bpf_ktime_get_ns();
    u64 dur = now - c.ts;
    u32 nr = c.nr;
    struct gt_sysinfo *si = sysinfo.lookup(&nr);
    if (!si)
        return 0;
    s64 ret = GT_EXIT_RET(ctx);
    int always = si->flags & GT_F_FDTABLE;
    u32 cmd = (u32)c.args[1];
    if ((si->flags & GT_F_DUPFD) && (cmd == GT_FCNTL_DUPFD || cmd == GT_FCNTL_DUPFD_CLOEXEC))
        always = 1; /* other fcntl commands are frequent: aggregated unless long */
    if ((si->flags & GT_F_EPOLLCTL) && ret == 0)
        always = 1; /* what each ready event's data word stands for */
    if ((si->flags & GT_F_MSGHDR) && ret >= 0)
        fds_received(&c, id, now);
    if (dur < THRESHOLD_NS)
        add_agg(v, id >> 32, tid, nr, dur);
    if (!always && dur < THRESHOLD_NS)
        return 0;
    if (dur >= OFFCPU_THRESHOLD_NS) { /* it may have slept: an entry still open means its return went unreported */
        struct gt_offcpu_val *o = offcpu.lookup(&tid);
        if (o)
            offcpu_unreported(tid, o, now, now);
        pause_unseen(id >> 32, tid, &c, now);
    }
    if (si->flags & (GT_F_PATH | GT_F_SOCKADDR | GT_F_SOCKADDR_PLEN))
        emit_path(&c, id, now, ret, si);
    else
        emit_sys(&c, id, now, ret, si);
    return 0;
}

/* The ring fd of the io_uring_enter call thread `tid` is in now, or -1 when it is in none (or in no traced call). */
static __always_inline s32 uring_ring_fd(u32 tid)
{
    struct gt_inflight *c = recorded_call(tid);
    if (!c)
        return -1;
    u32 nr = c->nr;
    struct gt_sysinfo *si = sysinfo.lookup(&nr);
    return si && (si->flags & GT_F_URING) ? (s32)c->args[0] : -1;
}

/* ----------------------------------------------------------------------------- process tree ---- */

static __always_inline void emit_proc(void *ring_is_proc, struct gt_proc_event *src)
{
    struct gt_proc_event *e;
    if (ring_is_proc)
        e = procev.ringbuf_reserve(sizeof(*e));
    else
        e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(ring_is_proc ? GT_DROP_PROCBUF : GT_DROP_RINGBUF);
        return;
    }
    __builtin_memcpy(e, src, sizeof(*e));
    if (ring_is_proc)
        procev.ringbuf_submit(e, 0);
    else
        events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
}

/* Runs in the parent: a traced parent's new process joins the target set before it can run. */
TRACEPOINT_PROBE(task, task_newtask)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 ptgid = id >> 32;
    if (!is_target(ptgid))
        return 0;
    struct gt_proc_event ev = {};
    ev.type = GT_EV_FORK;
    ev.flags = (args->clone_flags & GT_CLONE_THREAD) ? 1 : 0;
    ev.pid = ptgid;
    ev.tid = (u32)id;
    ev.ts = bpf_ktime_get_ns();
    ev.child_tid = args->pid;
    ev.child_pid = ev.flags ? ptgid : (u32)args->pid;
    gt_read_kernel(ev.comm, sizeof(ev.comm), args->comm);
    if (!ev.flags) {
        if (add_target(ev.child_pid))
            count_drop(GT_DROP_TARGETS);
    }
    emit_proc((void *)1, &ev);
    /* A copy in the events ring keeps fd inheritance in order with the child's own events. */
    if (!ev.flags)
        emit_proc(0, &ev);
    return 0;
}

#ifdef GT_OWNER_UID
/* The exec'ing task gained privileges the owner lacks: it leaves the target set before it runs an instruction
 * of the new program, so none of its later events are recorded and none of its children are followed. Its
 * other threads are gone (exec kills them first); its execve still in flight is forgotten, so no record ends
 * after this point. `old_tid`: the thread's tid before exec (a non-leader thread takes the leader's). */
static __always_inline void leave_out(u32 tgid, u32 tid, u32 old_tid)
{
    remove_target(tgid);
    u32 slots[2] = {tid & INFLIGHT_MASK, old_tid & INFLIGHT_MASK};
#pragma unroll
    for (int i = 0; i < 2; i++) {
        struct gt_inflight *v = inflight.lookup(&slots[i]);
        if (v && (v->tid == tid || v->tid == old_tid))
            v->tid = 0;
    }
    struct gt_offcpu_val *o = offcpu.lookup(&tid);
    if (o)
        offcpu_forget(tid, o);
#ifdef HAVE_FILEMAP_FAULT
    faults.delete(&tid);
    faults.delete(&old_tid);
#endif
}
#endif

/* Creds are committed by now (begin_new_exec) and the task has not yet returned to user space. */
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    struct gt_proc_event ev = {};
    ev.type = GT_EV_EXEC;
    ev.pid = id >> 32;
    ev.tid = (u32)id;
    ev.ts = bpf_ktime_get_ns();
    bpf_get_current_comm(ev.comm, sizeof(ev.comm));
    TP_DATA_LOC_READ_STR(ev.filename, filename, sizeof(ev.filename));
#ifdef GT_OWNER_UID
    if (gt_task_foreign(bpf_get_current_task())) {
        leave_out(ev.pid, ev.tid, (u32)args->old_pid);
        ev.flags = GT_EXEC_LEFT_OUT;
    }
#endif
    emit_proc((void *)1, &ev);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_target(tgid))
        return 0;
    u32 tid = (u32)id;
    u32 slot = tid & INFLIGHT_MASK;
    struct gt_inflight *v = inflight.lookup(&slot);
    if (v && v->tid == tid)
        v->tid = 0;
    if (v && v->agg_tid == tid)
        fold_agg(v);
    struct gt_offcpu_val *o = offcpu.lookup(&tid);
    if (o)
        offcpu_forget(tid, o);
#ifdef HAVE_FILEMAP_FAULT
    faults.delete(&tid);
#endif
    struct gt_proc_event ev = {};
    ev.type = GT_EV_EXIT;
#ifdef HAVE_GROUP_DEAD
    ev.flags = args->group_dead ? 1 : 0;
#else
    ev.flags = tid == tgid;
#endif
    ev.pid = tgid;
    ev.tid = tid;
    ev.ts = bpf_ktime_get_ns();
    bpf_get_current_comm(ev.comm, sizeof(ev.comm));
    emit_proc((void *)1, &ev);
    if (ev.flags) {
        remove_target(tgid);
        emit_proc(0, &ev);
    }
    return 0;
}

/* ------------------------------------------------------------------------------ page faults ---- */

/* A read through a file mapping (np.memmap, Arrow, safetensors) waits in a page fault, not a syscall.
 * filemap:mm_filemap_fault (Linux 6.11+) fires when a fault on a file mapping needs the page cache, i.e.
 * not for pages already mapped by fault-around, and names the file (dev, inode) and page. There is no
 * "fault done" tracepoint: a sleep of the thread counts as inside the fault while its saved user
 * registers (ip, sp, and orig_ax, which holds the fault's error code) are still the fault's, no recorded
 * syscall is in flight, and the fault showed signs of life within FAULT_GAP_NS. x86_64 only (orig_ax). */
#ifndef FAULT_GAP_NS
#define FAULT_GAP_NS 10000000ULL
#endif
#ifdef HAVE_FILEMAP_FAULT
/* The user registers the calling task entered the kernel with. */
static __always_inline void user_regs(u64 *ip, u64 *sp, u64 *entry)
{
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
    gt_read_kernel(ip, sizeof(*ip), &PT_REGS_IP(regs));
    gt_read_kernel(sp, sizeof(*sp), &PT_REGS_SP(regs));
    gt_read_kernel(entry, sizeof(*entry), &regs->orig_ax);
}

TRACEPOINT_PROBE(filemap, mm_filemap_fault)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    u64 now = bpf_ktime_get_ns();
    seen_running(id, now); /* it faults: on its CPU, so an entry still open ends (a fault's wait among them) */
    struct gt_fault_val v = {};
    user_regs(&v.ip, &v.sp, &v.entry);
    struct gt_fault_val *f = faults.lookup(&tid);
    if (f && f->ip == v.ip && f->sp == v.sp && f->entry == v.entry && f->dev == args->s_dev &&
        f->ino == args->i_ino && f->index == args->index && now - f->last < FAULT_GAP_NS) {
        f->last = now; /* the same fault, retried after it waited (VM_FAULT_RETRY) */
        return 0;
    }
    v.ts = now;
    v.last = now;
    v.ino = args->i_ino;
    v.index = args->index;
    v.dev = args->s_dev;
    v.pid = id >> 32;
    if (faults.update(&tid, &v))
        count_drop(GT_DROP_FAULT);
    struct gt_mapfile_key k = {.pid = v.pid, .dev = v.dev, .ino = v.ino};
    u8 one = 1;
    if (mapfiles.lookup(&k) || mapfiles.update(&k, &one))
        return 0;
    struct gt_mapfile_event *e = procev.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(GT_DROP_PROCBUF);
        mapfiles.delete(&k); /* announce it on the next fault */
        return 0;
    }
    e->type = GT_EV_MAPFILE;
    e->dev = v.dev;
    e->pid = v.pid;
    e->tid = tid;
    e->ts = now;
    e->ino = v.ino;
    procev.ringbuf_submit(e, 0);
    return 0;
}

/* In sched_switch, for the traced task leaving the CPU: the ts of the file fault it is inside, or 0. */
static __always_inline u64 in_file_fault(u32 tid, u64 now)
{
    struct gt_fault_val *f = faults.lookup(&tid);
    if (!f || now - f->last >= FAULT_GAP_NS)
        return 0;
    if (recorded_call(tid))
        return 0; /* inside a recorded syscall: the wait is the call's */
    u64 ip = 0, sp = 0, entry = 0;
    user_regs(&ip, &sp, &entry);
    return (ip == f->ip && sp == f->sp && entry == f->entry) ? f->ts : 0;
}

#endif

/* ------------------------------------------------------------------------------- scheduling ---- */

/* The scheduler's tracepoints come in two kinds. Classic ones (TRACEPOINT_PROBE) share one per-CPU
 * guard with every classic and perf-event program: the kernel skips them while another such program runs
 * on the CPU, e.g. a timer interrupt's wakeup landing in our block_io_start program. Raw tracepoints only
 * skip when the same program nests in itself, so the scheduler and interrupt hooks are raw where the
 * task_struct layout is known from BTF (GT_TASK_PID_OFF, from probes/ebpf/btf.py). A raw program reads the
 * tid from the task pointer the tracepoint passes. */
#if GT_RAW_SCHED
#define GT_SCHED_PROBE(name) int gt_##name(struct bpf_raw_tracepoint_args *ctx)
static __always_inline u32 gt_task_tid(u64 task)
{
    u32 pid = 0;
    gt_read_kernel(&pid, sizeof(pid), (void *)task + GT_TASK_PID_OFF);
    return pid;
}
/* The raw prev_state is the task's __state; the classic tracepoint reports it as one TASK_REPORT bit
 * (__trace_sched_switch_state), and so must we: a task preempted after it set TASK_INTERRUPTIBLE (before
 * it called schedule()) is runnable, not asleep ("R", TASK_REPORT_MAX); TASK_IDLE is "I", not "D";
 * TASK_RTLOCK_WAIT is "D"; otherwise the highest bit of __state & TASK_REPORT. */
#define GT_TASK_REPORT 0x7f
#define GT_TASK_REPORT_MAX 0x100
#define GT_TASK_IDLE 0x402
#define GT_TASK_RTLOCK_WAIT 0x1000
#define GT_REPORT_IDLE 0x80
static __always_inline u32 report_state(u8 preempt, u32 state)
{
    if (preempt)
        return GT_TASK_REPORT_MAX;
    if (state == GT_TASK_IDLE)
        return GT_REPORT_IDLE;
    if (state == GT_TASK_RTLOCK_WAIT)
        return GT_STATE_D;
    state &= GT_TASK_REPORT;
#pragma unroll
    for (int bit = 6; bit >= 0; bit--)
        if (state & (1u << bit))
            return 1u << bit;
    return 0;
}
/* ctx->args: (bool preempt, struct task_struct *prev, struct task_struct *next, unsigned int prev_state) */
#define GT_SWITCH_PREV gt_task_tid(ctx->args[1])
#define GT_SWITCH_NEXT gt_task_tid(ctx->args[2])
#define GT_SWITCH_STATE report_state((u8)ctx->args[0], (u32)ctx->args[3])
#define GT_WAKING_PID gt_task_tid(ctx->args[0]) /* ctx->args: (struct task_struct *p) */
#else
#define GT_SCHED_PROBE(name) int gt_##name(struct tracepoint__sched__##name *args)
#define GT_SWITCH_PREV ((u32)args->prev_pid)
#define GT_SWITCH_NEXT ((u32)args->next_pid)
#define GT_SWITCH_STATE ((u32)args->prev_state)
#define GT_WAKING_PID ((u32)args->pid)
#endif

/* `current` is prev here, so its tgid is at hand; next is known only by tid, hence `offcpu` by tid. */
GT_SCHED_PROBE(sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u32 prev = (u32)id;
#if GT_RAW_SCHED
    if (GT_SWITCH_PREV != prev) { /* the offset from BTF is wrong: record nothing rather than nonsense */
        count_drop(GT_DROP_LAYOUT);
        return 0;
    }
#endif
    if (prev != 0 && is_target(id >> 32)) {
        struct gt_inflight *c = recorded_call(prev);
        if (c)
            c->pause_ts = 0; /* the sleep after a dirty pause in it has its entry */
        struct gt_offcpu_val *old = offcpu.lookup(&prev);
        if (old) /* leaving its CPU again: the switch that gave it the CPU was not reported */
            offcpu_unreported(prev, old, 0, 0);
        struct gt_offcpu_val v = {};
        v.ts = now;
        v.pid = id >> 32;
        v.state = GT_SWITCH_STATE;
#ifdef HAVE_FILEMAP_FAULT
        v.fault_ns = in_file_fault(prev, now);
#endif
        /* Waiting for I/O: in D, or asleep in io_uring_enter, whose reads are issued (and their requests,
         * throttled, dispatched) while it sleeps interruptibly */
        v.io = (v.state & GT_STATE_D) || ((v.state & GT_STATE_S) && uring_ring_fd(prev) >= 0);
        if (offcpu.update(&prev, &v))
            count_drop(GT_DROP_OFFCPU);
        else if (v.io)
            iowait_add(1);
    }
    u32 next = GT_SWITCH_NEXT;
    struct gt_offcpu_val *o = offcpu.lookup(&next);
    if (!o)
        return 0;
    if (now - o->ts >= OFFCPU_THRESHOLD_NS) {
        struct gt_offcpu2_event *e = offcpu_event(next, o, now);
        if (e) {
            /* `current` is prev: the task this one takes the CPU from (the idle task: tid 0) */
            e->held_pid = id >> 32;
            e->held_tid = prev;
            bpf_get_current_comm(e->held_comm, sizeof(e->held_comm));
            events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
        }
    }
#ifdef HAVE_FILEMAP_FAULT
    if (o->fault_ns)
        fault_wait(next, o, now);
#endif
    offcpu_forget(next, o);
    return 0;
}

/* Interrupt context per CPU (0 hard irq, 1 softirq, 2 timer callback): the time the handler was entered,
 * 0 when not inside one. A wakeup from an interrupt names no task: `current` is whoever happened to be
 * interrupted. (The trace_entry flags byte would say so, but it is not filled in on the BPF path.)
 * Timestamps rather than depth counters: an entry seen while its exit program was not yet attached would
 * leave a counter raised forever and blame every later wakeup on that CPU on an interrupt; a timestamp
 * goes stale instead (no handler runs for IRQ_STALE_NS). These handlers do not nest within their kind. */
#define IRQ_STALE_NS 10000000ULL
BPF_PERCPU_ARRAY(irqdepth, u64, 3);

static __always_inline int irq_enter(u32 kind)
{
    u64 *t = irqdepth.lookup(&kind);
    if (t)
        *t = bpf_ktime_get_ns();
    return 0;
}

static __always_inline int irq_leave(u32 kind)
{
    u64 *t = irqdepth.lookup(&kind);
    if (t)
        *t = 0;
    return 0;
}

/* No arguments are read, so one context type serves both kinds of tracepoint. */
int gt_irq_handler_entry(void *ctx) { return irq_enter(0); }
int gt_irq_handler_exit(void *ctx) { return irq_leave(0); }
int gt_softirq_entry(void *ctx) { return irq_enter(1); }
int gt_softirq_exit(void *ctx) { return irq_leave(1); }
/* A timer interrupt in a traced thread whose off-CPU entry is still open: the thread is on its CPU (the entry is
 * made and taken in the scheduler with interrupts off, so no interrupt comes between), and the switch that gave
 * it back fired no sched_switch. The scheduler's tick comes every few ms to a busy CPU, so a thread preempted
 * (or throttled) and given its CPU back unseen has its span ended within a tick, not lost at its next switch
 * away (offcpu_unreported, GT_OFFCPU_END_SEEN). One lookup per timer on the host. */
static __always_inline void offcpu_running(void)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (!tid)
        return;
    struct gt_offcpu_val *o = offcpu.lookup(&tid);
    if (o)
        offcpu_unreported(tid, o, 0, bpf_ktime_get_ns());
}

int gt_hrtimer_expire_entry(void *ctx)
{
    offcpu_running();
    return irq_enter(2);
}
int gt_hrtimer_expire_exit(void *ctx) { return irq_leave(2); }

/* The innermost context: the one entered last (a timer interrupt can come in the middle of a softirq; the
 * hrtimer callback it runs is what wakes the task). 1 hard irq, 2 softirq, 3 timer callback, 0 none. */
static __always_inline int irq_kind(u64 now)
{
    int kind = 0;
    u64 latest = 0;
    for (u32 k = 0; k < 3; k++) {
        u32 key = k;
        u64 *t = irqdepth.lookup(&key);
        if (t && *t && now - *t < IRQ_STALE_NS && *t >= latest) {
            latest = *t;
            kind = k + 1;
        }
    }
    return kind;
}

/* Who is waking a task: `current`, unless the wakeup comes from an interrupt. */
struct gt_waker {
    u64 wake_ns;
    u32 waker_pid;
    u32 waker_tid;
    char waker_comm[GT_COMM_LEN];
    u32 state; /* the wakee's task state as it was woken (early_wake only; 0 where unknown) */
    u32 pad;
};

static __always_inline void current_waker(struct gt_waker *w)
{
    w->wake_ns = bpf_ktime_get_ns();
    int kind = irq_kind(w->wake_ns);
    if (kind) {
        w->waker_pid = 0;
        w->waker_tid = 0;
        if (kind == 1)
            __builtin_memcpy(w->waker_comm, "[irq]\0\0\0\0\0\0\0\0\0\0", GT_COMM_LEN);
        else if (kind == 2)
            __builtin_memcpy(w->waker_comm, "[softirq]\0\0\0\0\0\0", GT_COMM_LEN);
        else
            __builtin_memcpy(w->waker_comm, "[timer]\0\0\0\0\0\0\0\0", GT_COMM_LEN);
    } else {
        u64 id = bpf_get_current_pid_tgid();
        w->waker_pid = id >> 32;
        w->waker_tid = (u32)id;
        bpf_get_current_comm(w->waker_comm, sizeof(w->waker_comm));
    }
}

static __always_inline void set_waker(struct gt_offcpu_val *o, struct gt_waker *w)
{
    o->wake_ns = w->wake_ns;
    o->waker_pid = w->waker_pid;
    o->waker_tid = w->waker_tid;
    __builtin_memcpy(o->waker_comm, w->waker_comm, GT_COMM_LEN);
}

#if GT_RAW_SCHED
/* A wakeup can come while its task is still on its CPU, switching out: try_to_wake_up() fires
 * sched_waking before it waits for the switch to finish, so the task's off-CPU entry does not exist yet.
 * The waker is kept here (traced tasks only: the raw program can read the wakee's tgid) and taken at the
 * task's sched_wakeup, which comes once it is off its CPU. */
BPF_TABLE("lru_hash", u32, struct gt_waker, early_wake, 4096);
#define EARLY_WAKE_NS 1000000ULL

static __always_inline u32 gt_task_tgid(u64 task)
{
    u32 tgid = 0;
    gt_read_kernel(&tgid, sizeof(tgid), (void *)task + GT_TASK_TGID_OFF);
    return tgid;
}
#endif

/* sched_waking runs in the waker's context (sched_wakeup may run on the target's CPU), so `current` is
 * the waker, traced or not, unless the wakeup comes from an interrupt. */
GT_SCHED_PROBE(sched_waking)
{
    u32 tid = GT_WAKING_PID;
    struct gt_waker w = {};
    struct gt_offcpu_val *o = offcpu.lookup(&tid);
    if (o) {
        current_waker(&w);
        set_waker(o, &w);
        return 0;
    }
#if GT_RAW_SCHED
    if (is_target(gt_task_tgid(ctx->args[0]))) {
        current_waker(&w);
#ifdef GT_TASK_STATE_OFF
        /* still the sleep's state: try_to_wake_up() sets TASK_WAKING after this tracepoint */
        gt_read_kernel(&w.state, sizeof(w.state), (void *)ctx->args[0] + GT_TASK_STATE_OFF);
#endif
        early_wake.update(&tid, &w);
    }
#endif
    return 0;
}

#if GT_RAW_SCHED && defined(GT_TASK_ON_CPU_OFF)
/* A traced task woken off its CPU (`on_cpu` clear: its switch away is complete, so sched_switch has run for it)
 * with no off-CPU entry: that switch away was not reported (see offcpu_unreported). Asleep in a recorded call,
 * it has been off CPU at most since the call began, or since a program last saw it running in that call
 * (gt_inflight.ran_ns): the entry starts there (GT_OFFCPU_START_CALL), in the state it was woken from (S where
 * the state's offset is unknown), with this wakeup, and its switch back (or, unreported too, the call's
 * return) ends it; counted with the unreported switches. Outside a recorded call nothing tells it from a task asleep since before tracing began (whose
 * switch away came before the programs): left alone. (Still on its CPU, or still queued, a task woken before
 * it slept has nothing to record.) */
static __always_inline void unreported_switch_away(u32 tid, u64 task, struct gt_waker *w)
{
    struct gt_inflight *c = recorded_call(tid);
    if (!c)
        return;
    u64 start = c->ran_ns > c->ts ? c->ran_ns : c->ts;
    if (start > w->wake_ns)
        return;
    int on_cpu = 1;
    gt_read_kernel(&on_cpu, sizeof(on_cpu), (void *)task + GT_TASK_ON_CPU_OFF);
    if (on_cpu)
        return;
    c->pause_ts = 0; /* the span starts here */
    count_drop(GT_NOTE_UNREPORTED);
    struct gt_offcpu_val v = {};
    v.ts = start;
    v.pid = gt_task_tgid(task);
    v.state = w->state & GT_STATE_D ? GT_STATE_D : GT_STATE_S;
    v.flags = GT_OFFCPU_START_CALL;
    set_waker(&v, w);
    if (offcpu.update(&tid, &v))
        count_drop(GT_DROP_OFFCPU);
}
#endif

#if GT_RAW_SCHED
/* ctx->args: (struct task_struct *p). The wakeup of a task whose sleep began after its sched_waking. */
int gt_sched_wakeup(struct bpf_raw_tracepoint_args *ctx)
{
    u32 tid = gt_task_tid(ctx->args[0]);
    struct gt_waker *w = early_wake.lookup(&tid);
    if (!w)
        return 0;
    struct gt_offcpu_val *o = offcpu.lookup(&tid);
    /* Within EARLY_WAKE_NS of the switch, either side: the waking may also have run on another CPU while
     * sched_switch, its clock already read, was still filling in the entry. */
    if (o && !o->wake_ns && w->wake_ns + EARLY_WAKE_NS > o->ts && w->wake_ns < o->ts + EARLY_WAKE_NS)
        set_waker(o, w);
#ifdef GT_TASK_ON_CPU_OFF
    if (!o)
        unreported_switch_away(tid, ctx->args[0], w);
#endif
    early_wake.delete(&tid);
    return 0;
}
#endif

/* ------------------------------------------------------------------------------------ block ---- */

/* A request is recorded when a traced task submits it, or while a traced task waits in D: I/O held back
 * (blk-throttle, io.max) or handed off is dispatched later by a kernel worker, or another process may
 * bring in the pages a traced task waits for. The submitter recorded is the real one (the kworker);
 * analysis decides which waiting read a request belongs to. The extra volume is bounded by the time
 * traced tasks spend waiting in D. */
static __always_inline int block_submit(u32 dev, u64 sector)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32)) {
        if (!iowait_any())
            return 0;
#ifdef GT_OWNER_UID
        /* A non-root owner sees requests of other submitters only from kernel threads (the workers that
         * dispatch held-back I/O) or its own processes: not those of a process it may not trace. */
        u64 task = bpf_get_current_task(), mm = 0;
        if (gt_read_kernel(&mm, sizeof(mm), (void *)task + GT_TASK_MM_OFF) || (mm && gt_task_foreign(task)))
            return 0;
#endif
    }
    struct gt_blk_key k = {.dev = dev, .sector = sector};
    struct gt_blk_val v = {};
    v.ts = bpf_ktime_get_ns();
    v.pid = id >> 32;
    v.tid = (u32)id;
    seen_running(id, v.ts); /* a traced submitter: none for another's (the slot and entry are not its) */
    bpf_get_current_comm(v.comm, sizeof(v.comm));
    if (blk.update(&k, &v))
        count_drop(GT_DROP_BLOCK);
    return 0;
}

#ifndef GT_NO_BLOCK /* block I/O turned off for the capture (gputrace capture --off block) */
#ifdef HAVE_BLOCK_IO_START
/* Accounted when the request is made, in the submitter's context. */
TRACEPOINT_PROBE(block, block_io_start)
{
    return block_submit(args->dev, args->sector);
}
#else
TRACEPOINT_PROBE(block, block_rq_issue)
{
    return block_submit(args->dev, args->sector);
}
#endif

/* block_rq_complete carries the bytes completed (after merges), block_io_done only zero. */
TRACEPOINT_PROBE(block, block_rq_complete)
{
    struct gt_blk_key k = {.dev = args->dev, .sector = args->sector};
    struct gt_blk_val *v = blk.lookup(&k);
    if (!v)
        return 0;
    struct gt_block_event *e = events.ringbuf_reserve(sizeof(*e));
    if (e) {
        e->type = GT_EV_BLOCK;
        e->dev = args->dev;
        e->pid = v->pid;
        e->tid = v->tid;
        e->sector = args->sector;
        e->issue_ns = v->ts;
        e->complete_ns = bpf_ktime_get_ns();
        e->nbytes = args->nr_sector << 9;
        e->error = args->error;
        gt_read_kernel(e->rwbs, sizeof(e->rwbs), args->rwbs);
        e->rwbs[7] = 0;
        __builtin_memcpy(e->comm, v->comm, sizeof(e->comm));
        events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
    } else {
        count_drop(GT_DROP_RINGBUF);
    }
    blk.delete(&k);
    return 0;
}
#endif /* GT_NO_BLOCK */

/* --------------------------------------------------------------------- dirty-page throttling ---- */

#ifdef HAVE_DIRTY_THROTTLE
/* A task that dirties page cache faster than its device's writeback cleans it is paused in
 * balance_dirty_pages, inside its write() or page fault: no block request of its own, no wakeup by anyone
 * (the pause is a timed sleep). The tracepoint fires, in the task, each time the kernel works out the pause;
 * a positive one is slept right after it. The device's counts are `wb_*` (`bdi_*` on older kernels:
 * GT_DIRTY_WB=0). */
#ifndef GT_DIRTY_WB
#define GT_DIRTY_WB 1
#endif
TRACEPOINT_PROBE(writeback, balance_dirty_pages)
{
    if (args->pause <= 0)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    struct gt_dirty_event *e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(GT_DROP_RINGBUF);
        return 0;
    }
    e->type = GT_EV_DIRTY;
    e->pad = 0;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->ts = bpf_ktime_get_ns();
    struct gt_inflight *c = seen_running(id, e->ts);
    if (c) { /* slept right after: pause_unseen if no switch away is seen for it */
        c->pause_ts = e->ts;
        c->pause_ns = (u64)args->pause * 1000000;
    }
    e->pause_ms = args->pause;
#if GT_DIRTY_WB
    e->wb_dirty = args->wb_dirty;
    e->wb_setpoint = args->wb_setpoint;
#else
    e->wb_dirty = args->bdi_dirty;
    e->wb_setpoint = args->bdi_setpoint;
#endif
    e->dirty = args->dirty;
    e->limit = args->limit;
    e->task_ratelimit = args->task_ratelimit;
    gt_read_kernel(e->bdi, sizeof(e->bdi), args->bdi);
    e->bdi[sizeof(e->bdi) - 1] = 0;
    events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
    return 0;
}
#endif

/* --------------------------------------------------------------------------------- io_uring ---- */

/* A traced process's io_uring requests: submitted (io_uring_submit_req) and given their file
 * (io_uring_file_get) by a thread of the process (the submitter, its SQPOLL thread or an io-wq worker:
 * all threads of its tgid), completed (io_uring_complete) in any context: the submitter running its task
 * work, an io-wq worker, an interrupt. `uring` keeps each request in flight by the kernel's request pointer;
 * its completion emits one event (at least THRESHOLD_NS long; shorter ones are summed in `agg` per thread and
 * opcode) and forgets it. A request whose completion is never seen (IOSQE_CQE_SKIP_SUCCESS, a skipped
 * program run) stays until its pointer is reused: the ring and user_data are checked at completion. What the
 * map holds at stop is read as the requests still in flight (probes/ebpf/final.py). */
#ifdef HAVE_IO_URING
#ifndef MAX_URING
#define MAX_URING 16384
#endif
#define GT_REQ_F_FIXED_FILE 0x1   /* req->flags (low bits are the IOSQE_* flags): IOSQE_FIXED_FILE */
#define GT_REQ_F_FORCE_ASYNC 0x10 /* IOSQE_ASYNC */
#define GT_REQ_F_CQE_SKIP 0x40    /* IOSQE_CQE_SKIP_SUCCESS */
#define GT_CQE_F_MORE 0x2         /* IORING_CQE_F_MORE: a multishot request goes on */
#define GT_URING_AGG_NR 0x10000   /* agg key nr of short requests: this | opcode (syscall numbers are below) */
BPF_HASH(uring, u64, struct gt_uring_val, MAX_URING);

/* The request's fields, read by whichever kind of tracepoint fires; the caller checked the process. */
static __always_inline void uring_submit(u64 id, u64 req, u64 ctx, u64 user_data, u8 opcode, u64 flags, bool sq_thread)
{
    struct gt_uring_val v = {};
    v.ts = bpf_ktime_get_ns();
    v.ctx = ctx;
    v.user_data = user_data;
    v.pid = id >> 32;
    v.tid = (u32)id;
    v.fd = -1;
    v.ring_fd = sq_thread ? -1 : uring_ring_fd(v.tid);
    v.opcode = opcode;
    v.flags = ((flags & GT_REQ_F_FIXED_FILE) ? GT_URING_FIXED : 0) | ((flags & GT_REQ_F_FORCE_ASYNC) ? GT_URING_ASYNC : 0) |
              (sq_thread ? GT_URING_SQPOLL : 0) | ((flags & GT_REQ_F_CQE_SKIP) ? GT_URING_SKIP_CQE : 0);
    if (uring.update(&req, &v))
        count_drop(GT_DROP_URING);
}

/* Where the request gets its file: at issue, by the submitter or the io-wq worker (a fixed file: never). */
static __always_inline void uring_file_get(u64 req, u64 ctx, u64 user_data, s32 fd)
{
    struct gt_uring_val *v = uring.lookup(&req);
    if (v && v->ctx == ctx && v->user_data == user_data)
        v->fd = fd;
}

static __always_inline void uring_emit(struct gt_uring_val *v, u64 now, s32 res, u32 cflags)
{
    struct gt_uring_event *e = events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(GT_DROP_RINGBUF);
        return;
    }
    e->type = GT_EV_URING;
    e->opcode = v->opcode;
    e->pid = v->pid;
    e->tid = v->tid;
    e->start_ns = v->ts;
    e->end_ns = now;
    e->fd = v->fd;
    e->res = res;
    e->ring_fd = v->ring_fd;
    e->flags = v->flags | ((cflags & GT_CQE_F_MORE) ? GT_URING_MORE : 0);
    e->user_data = v->user_data;
    e->cflags = cflags;
    e->pad = 0;
    events.ringbuf_submit(e, GT_RB_NO_WAKEUP);
}

/* A short request, summed per (thread, opcode). Any CPU may complete a thread's requests: atomic adds. */
static __always_inline void uring_agg(struct gt_uring_val *v, u64 dur)
{
    struct gt_agg_key k = {.pid = v->pid, .tid = v->tid, .nr = GT_URING_AGG_NR | (v->opcode & 0xff)};
    struct gt_agg_val *a = agg.lookup(&k);
    if (!a) {
        struct gt_agg_val init = {.count = 1, .total_ns = dur};
        if (agg.insert(&k, &init) == 0)
            return;
        a = agg.lookup(&k); /* another CPU inserted it first */
        if (!a) {
            count_drop(GT_DROP_AGG);
            return;
        }
    }
    __sync_fetch_and_add(&a->count, 1);
    __sync_fetch_and_add(&a->total_ns, dur);
}

/* `v`: the entry of request `req`, which the caller looked up (a CQE of no request, io_post_aux_cqe, has none). */
static __always_inline void uring_complete(u64 req, struct gt_uring_val *v, u64 ctx, u64 user_data, s32 res, u32 cflags)
{
    if (v->ctx != ctx || v->user_data != user_data || !is_target(v->pid)) {
        uring.delete(&req); /* an earlier request's entry at this address, or its process is no longer traced */
        return;
    }
    u64 now = bpf_ktime_get_ns();
    if (now - v->ts >= THRESHOLD_NS)
        uring_emit(v, now, res, cflags);
    else
        uring_agg(v, now - v->ts);
    if (cflags & GT_CQE_F_MORE)
        v->ts = now; /* the next completion of a multishot request covers the time from this one */
    else
        uring.delete(&req);
}

#if GT_RAW_URING
/* Raw tracepoints (probes/ebpf/hooks.py: prototypes and member offsets from the kernel's BTF): the process
 * is checked before anything is read, where a classic tracepoint fills its whole record for every request
 * on the host first. ctx->args: (struct io_kiocb *req) */
#define GT_IORING_SETUP_SQPOLL 0x2 /* io_ring_ctx.flags */
#define GT_IORING_OP_MAX 128       /* above any opcode (IORING_OP_LAST is about 60): else the layout is wrong */
int gt_io_uring_submit_req(struct bpf_raw_tracepoint_args *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    void *req = (void *)ctx->args[0];
    u64 ring = 0, user_data = 0, flags = 0;
    u8 opcode = 0;
    u32 ring_flags = 0;
    gt_read_kernel(&ring, sizeof(ring), req + GT_REQ_CTX_OFF);
    gt_read_kernel(&user_data, sizeof(user_data), req + GT_REQ_CQE_OFF + GT_CQE_USER_DATA_OFF);
    gt_read_kernel(&opcode, sizeof(opcode), req + GT_REQ_OPCODE_OFF);
    gt_read_kernel(&flags, GT_REQ_FLAGS_SIZE, req + GT_REQ_FLAGS_OFF);
    if (!ring || opcode >= GT_IORING_OP_MAX) { /* the offsets from BTF are wrong: record nothing rather than nonsense */
        count_drop(GT_DROP_LAYOUT);
        return 0;
    }
    gt_read_kernel(&ring_flags, sizeof(ring_flags), (void *)ring + GT_CTX_FLAGS_OFF);
    uring_submit(id, (u64)req, ring, user_data, opcode, flags, ring_flags & GT_IORING_SETUP_SQPOLL);
    return 0;
}

/* ctx->args: (struct io_kiocb *req, int fd) */
int gt_io_uring_file_get(struct bpf_raw_tracepoint_args *ctx)
{
    if (!is_target(bpf_get_current_pid_tgid() >> 32))
        return 0;
    void *req = (void *)ctx->args[0];
    u64 ring = 0, user_data = 0;
    gt_read_kernel(&ring, sizeof(ring), req + GT_REQ_CTX_OFF);
    gt_read_kernel(&user_data, sizeof(user_data), req + GT_REQ_CQE_OFF + GT_CQE_USER_DATA_OFF);
    uring_file_get((u64)req, ring, user_data, (s32)ctx->args[1]);
    return 0;
}

/* ctx->args: (struct io_ring_ctx *ctx, void *req, struct io_uring_cqe *cqe); the CQE's layout is the UAPI's */
int gt_io_uring_complete(struct bpf_raw_tracepoint_args *ctx)
{
    u64 req = ctx->args[1];
    struct gt_uring_val *v = req ? uring.lookup(&req) : NULL;
    if (!v)
        return 0; /* not a traced request: nothing read */
    void *cqe = (void *)ctx->args[2];
    u64 user_data = 0;
    s32 res = 0;
    u32 cflags = 0;
    gt_read_kernel(&user_data, sizeof(user_data), cqe + GT_UCQE_USER_DATA_OFF);
    gt_read_kernel(&res, sizeof(res), cqe + GT_UCQE_RES_OFF);
    gt_read_kernel(&cflags, sizeof(cflags), cqe + GT_UCQE_FLAGS_OFF);
    uring_complete(req, v, ctx->args[0], user_data, res, cflags);
    return 0;
}
#else
TRACEPOINT_PROBE(io_uring, io_uring_submit_req)
{
    u64 id = bpf_get_current_pid_tgid();
    if (is_target(id >> 32))
        uring_submit(id, (u64)args->req, (u64)args->ctx, args->user_data, args->opcode, args->flags, args->sq_thread);
    return 0;
}

TRACEPOINT_PROBE(io_uring, io_uring_file_get)
{
    if (is_target(bpf_get_current_pid_tgid() >> 32))
        uring_file_get((u64)args->req, (u64)args->ctx, args->user_data, args->fd);
    return 0;
}

TRACEPOINT_PROBE(io_uring, io_uring_complete)
{
    u64 req = (u64)args->req;
    struct gt_uring_val *v = req ? uring.lookup(&req) : NULL;
    if (v)
        uring_complete(req, v, (u64)args->ctx, args->user_data, args->res, args->cflags);
    return 0;
}
#endif
#endif
