/* A CPU-bound workload for the stack sampler: for each stdin line "N", spin N ms in decode_jpeg_block (a
 * named, never-inlined function), then print "done" and this thread's tid. Prints "ready TID" first. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

__attribute__((noinline)) unsigned long decode_jpeg_block(long ms) {
    volatile unsigned long acc = 0;
    long end = now_ns() + ms * 1000000L;
    while (now_ns() < end)
        for (int i = 0; i < 20000; i++)
            acc += (unsigned long)i * 2654435761u;
    return acc;
}

int main(void) {
    char line[64];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %ld\n", (long)syscall(SYS_gettid));
    while (fgets(line, sizeof line, stdin)) {
        unsigned long acc = decode_jpeg_block(atol(line));
        printf("done %ld %lu\n", (long)syscall(SYS_gettid), acc & 1);
    }
    return 0;
}
