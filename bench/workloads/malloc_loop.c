// malloc/free in a tight loop: the worst case for allocation profiling
// (every call traps into the kernel twice with uprobes on malloc and free).
//
//   malloc_loop ITERATIONS WAIT [DELAY_US]
//
// WAIT 1: first wait (up to 60 s) until malloc and free carry a uprobe
// breakpoint (their first byte is int3), so the timed loop runs with the
// profiler attached to it; then sleep DELAY_US before timing (bench/alloc.py
// draws it over one burst period: a run that started at a burst's start would
// have one burst more than its share). Prints iterations=N seconds=S.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static volatile uintptr_t sink;

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    int wait = argc > 2 && atoi(argv[2]);
    long delay_us = argc > 3 ? atol(argv[3]) : 0;
    double t0 = now_s();
    while (wait && (*(volatile unsigned char *)malloc != 0xcc || *(volatile unsigned char *)free != 0xcc)) {
        if (now_s() - t0 > 60) {
            fprintf(stderr, "no uprobe on malloc and free after 60 s\n");
            return 3;
        }
        usleep(10000);
    }
    if (delay_us > 0)
        usleep(delay_us);
    static const size_t sizes[4] = {16, 64, 256, 1024};
    double t1 = now_s();
    for (long i = 0; i < n; i++) {
        void *p = malloc(sizes[i & 3]);
        sink += (uintptr_t)p;
        free(p);
    }
    printf("iterations=%ld seconds=%.6f\n", n, now_s() - t1);
    return 0;
}
