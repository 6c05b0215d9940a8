/* Host-side timing of CUDA driver calls (launches, copies, synchronizes) for processes without the agent.
 *
 * One uprobe and one uretprobe per symbol, each a tiny wrapper passing its slot number: bcc 0.26 has no
 * bpf cookies. Entry time is kept per (thread, function); the return emits one event. The process filter is
 * the uprobe attachment itself (pid=), which covers every thread sharing the process's mm, and the mm of
 * whatever that process execs. With GT_OWNER_UID (a non-root owner), no call is recorded of a task that
 * holds privileges the owner lacks (gt_task_foreign in gputrace.h): a traced process that exec'd a setuid
 * program, say.
 * Build-time parameters (cflags): RINGBUF_PAGES, INFLIGHT_MAX, GT_OWNER_UID and the offsets gt_task_foreign
 * reads. */
#include <uapi/linux/ptrace.h>
#include "libcuda.h"
#include "gputrace.h"

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif
#ifndef INFLIGHT_MAX
#define INFLIGHT_MAX 16384
#endif

BPF_HASH(inflight, struct cu_key, u64, INFLIGHT_MAX);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(drops, u64, CU_DROP_MAX);

static __always_inline void count_drop(u32 where) {
    u64 *n = drops.lookup(&where);
    if (n)
        __sync_fetch_and_add(n, 1);
}

static __always_inline int on_enter(u32 fn) {
#ifdef GT_OWNER_UID
    if (gt_task_foreign(bpf_get_current_task())) {
        count_drop(CU_LEFT_OUT); /* and no entry time: its return records nothing either */
        return 0;
    }
#endif
    struct cu_key key = {.tid = (u32)bpf_get_current_pid_tgid(), .fn = fn};
    u64 ts = bpf_ktime_get_ns();
    if (inflight.update(&key, &ts) != 0)
        count_drop(CU_DROP_INFLIGHT);
    return 0;
}

static __always_inline int on_return(struct pt_regs *ctx, u32 fn) {
    u64 id = bpf_get_current_pid_tgid();
    struct cu_key key = {.tid = (u32)id, .fn = fn};
    u64 *start = inflight.lookup(&key);
    if (!start)
        return 0; /* entered before the probe was attached */
    u64 start_ns = *start;
    inflight.delete(&key);
    struct cu_event *e = events.ringbuf_reserve(sizeof(struct cu_event));
    if (!e) {
        count_drop(CU_DROP_RINGBUF);
        return 0;
    }
    e->start_ns = start_ns;
    e->end_ns = bpf_ktime_get_ns();
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->fn = fn;
    e->ret = (s32)PT_REGS_RC(ctx);
    events.ringbuf_submit(e, 0);
    return 0;
}

#define CU_PROBE(N)                                                                                     \
    int enter_##N(struct pt_regs *ctx) { return on_enter(N); }                                       \
    int leave_##N(struct pt_regs *ctx) { return on_return(ctx, N); }

CU_PROBE(0) CU_PROBE(1) CU_PROBE(2) CU_PROBE(3) CU_PROBE(4) CU_PROBE(5) CU_PROBE(6) CU_PROBE(7)
CU_PROBE(8) CU_PROBE(9) CU_PROBE(10) CU_PROBE(11) CU_PROBE(12) CU_PROBE(13) CU_PROBE(14) CU_PROBE(15)
CU_PROBE(16) CU_PROBE(17) CU_PROBE(18) CU_PROBE(19) CU_PROBE(20) CU_PROBE(21) CU_PROBE(22) CU_PROBE(23)
