/* CPU stack sampling of traced processes: a CPU-clock perf event on every CPU fires SAMPLE_HZ times a
 * second; a sample whose task belongs to a traced tgid copies its user stack into the ring with the time,
 * pid and tid. The stack travels with each sample rather than through a stack-id map: a stack map's buckets
 * collide (-EEXIST) after a few hundred distinct stacks, and reusing them makes an id name another stack.
 * User space dedupes stacks and symbolizes each once while the process is alive. New child processes of
 * traced ones are followed through task_newtask; user space adds more with the targets map.
 * With GT_OWNER_UID (a non-root owner), a process that gains privileges the owner lacks leaves the targets
 * at exec, and a sample is taken only of a task that is not foreign (gt_task_foreign in gputrace.h).
 * Build-time parameters (cflags): RINGBUF_PAGES, MAX_TARGETS, HAVE_GROUP_DEAD, GT_OWNER_UID and the offsets
 * gt_task_foreign reads. */
/* Opaque here: the context is only handed to bpf_get_stack. uapi/linux/bpf_perf_event.h would add 1.5 s to
 * every compile. */
struct bpf_perf_event_data;
#include "sampler.h"
#include "gputrace.h"

#define SP_CLONE_THREAD 0x00010000 /* CLONE_THREAD in uapi/linux/sched.h */

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 512
#endif
#ifndef MAX_TARGETS
#define MAX_TARGETS 8192
#endif

BPF_HASH(targets, u32, u8, MAX_TARGETS);
BPF_RINGBUF_OUTPUT(samples, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(drops, u64, SP_DROP_MAX);

static __always_inline void count_drop(u32 where) {
    u64 *n = drops.lookup(&where);
    if (n)
        (*n)++; /* per-CPU: no other writer */
}

int on_sample(struct bpf_perf_event_data *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u8 *traced = tgid ? targets.lookup(&tgid) : 0;
    if (!traced)
        return 0;
#ifdef GT_OWNER_UID
    /* Besides the exec check below: user space adds children it hears of late, maybe after such an exec. */
    if (gt_task_foreign(bpf_get_current_task()))
        return 0;
#endif
    struct sp_event *e = samples.ringbuf_reserve(sizeof(struct sp_event));
    if (!e) {
        count_drop(SP_DROP_RINGBUF);
        return 0;
    }
    long n = bpf_get_stack(ctx, e->ip, sizeof(e->ip), BPF_F_USER_STACK);
    if (n <= 0) {
        samples.ringbuf_discard(e, 0);
        count_drop(SP_DROP_STACK);
        return 0;
    }
    e->ts = bpf_ktime_get_ns();
    e->pid = tgid;
    e->tid = (u32)id;
    e->nr = (u32)n / sizeof(u64);
    e->cpu = bpf_get_smp_processor_id();
    /* Samples wait for the reader's timer, but a process's first one wakes it: its stacks are named from its
     * mappings, which must be read while it lives (a short-lived process may be gone by the next timer). */
    u64 flags = GT_RB_NO_WAKEUP;
    if (*traced == SP_TARGET_NEW) {
        *traced = SP_TARGET_SAMPLED;
        flags = SP_RB_FORCE_WAKEUP;
    }
    samples.ringbuf_submit(e, flags);
    return 0;
}

/* A traced process forked a new process (not a thread: threads share the tgid already traced). */
TRACEPOINT_PROBE(task, task_newtask) {
    if (args->clone_flags & SP_CLONE_THREAD)
        return 0;
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!targets.lookup(&parent))
        return 0;
    u32 child = args->pid;
    u8 one = SP_TARGET_NEW;
    if (targets.update(&child, &one) != 0)
        count_drop(SP_DROP_TARGETS);
    return 0;
}

#ifdef GT_OWNER_UID
/* The exec gave the process privileges the owner lacks: no more samples of it, nor of its children. */
TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!targets.lookup(&tgid) || !gt_task_foreign(bpf_get_current_task()))
        return 0;
    targets.delete(&tgid);
    count_drop(SP_LEFT_OUT);
    return 0;
}
#endif

/* The process is gone: forget it, so a later process reusing its pid is not sampled. */
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
#ifdef HAVE_GROUP_DEAD
    if (args->group_dead)
#else
    if ((u32)id == tgid)
#endif
        targets.delete(&tgid);
    return 0;
}
