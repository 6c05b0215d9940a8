/* The sample event shared by sampler.bpf.c and probes/sampler.py (SampleEvent mirrors it; the source checks
 * every event's size against the mirror and tests/test_sampler.py checks the compiler's layout). */
#ifndef GPUTRACE_SAMPLER_H
#define GPUTRACE_SAMPLER_H

#define SP_STACK_DEPTH 64 /* user frames kept per sample (the kernel's limit is 127); deeper stacks lose roots */

/* Where samples were lost: indexes of the per-CPU `drops` array. */
#define SP_DROP_RINGBUF 0 /* ring buffer full: the sample is not recorded */
#define SP_DROP_STACK 1   /* no user stack to read (bpf_get_stack failed: an exiting task): not a loss */
#define SP_DROP_TARGETS 2 /* targets map full: a new child process is not followed */
#define SP_LEFT_OUT 3     /* not a loss: processes left out because they gained privileges (GT_OWNER_UID) */
#define SP_DROP_MAX 4
#define SP_TARGET_NEW 1     /* targets value: traced, not sampled yet (user space adds pids so) */
#define SP_TARGET_SAMPLED 2 /* traced, sampled at least once */
#define SP_RB_FORCE_WAKEUP 2 /* BPF_RB_FORCE_WAKEUP */

struct sp_event {
    u64 ts;  /* CLOCK_MONOTONIC ns */
    u32 pid; /* tgid */
    u32 tid;
    u32 nr;  /* frames in ip[], leaf first */
    u32 cpu;
    u64 ip[SP_STACK_DEPTH];
};

#endif
