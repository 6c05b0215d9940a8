/* The event shared by libcuda.bpf.c and probes/uprobes.py (UprobeEvent mirrors it; the source checks every
 * event's size against the mirror and tests/test_uprobes.py checks the compiler's layout). */
#ifndef GPUTRACE_LIBCUDA_H
#define GPUTRACE_LIBCUDA_H

#define CU_MAX_FUNCS 24  /* probe slots: enter_N / leave_N for N < CU_MAX_FUNCS */

/* Where records were lost: indexes of the `drops` array. */
#define CU_DROP_RINGBUF 0  /* ring buffer full: the call is not recorded */
#define CU_DROP_INFLIGHT 1 /* in-flight map full: the call is not recorded */
#define CU_LEFT_OUT 2      /* not a loss: a call of a task with privileges the owner lacks (GT_OWNER_UID) */
#define CU_DROP_MAX 3

struct cu_key {
    u32 tid;
    u32 fn;
};

struct cu_event {
    u64 start_ns;
    u64 end_ns;
    u32 pid;
    u32 tid;
    u32 fn;  /* index into the symbol list the Python side attached */
    s32 ret; /* CUresult */
};

#endif
