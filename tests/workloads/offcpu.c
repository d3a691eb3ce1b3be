/* Off-CPU workloads. Every blocking call is an inline syscall instruction in
 * a function with a frame pointer, so the frame-pointer walk sees each caller
 * (Debian's libc has no frame pointers).
 *
 * Usage:
 *   offcpu ratio SECONDS   one thread loops: 300 ms of sleep in slow_wait(),
 *                          100 ms in fast_wait(), and a blocking pipe read in
 *                          pipe_wait() that a feeder thread answers 200 ms later.
 *   offcpu tiny SECONDS    one thread sleeps 200 us at a time in tiny_wait().
 *   offcpu short SECONDS   one thread loops: 6 ms of sleep in six_ms_wait(), 2 ms in
 *                          two_ms_wait() (blocks offcpu_sample_ms samples);
 *                          also prints each one's measured total, six_ns= and two_ns=.
 * Prints "wall_seconds=<float> loops=<n>" of the loop at exit. */
#include <pthread.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SYS_read 0
#define SYS_write 1
#define SYS_nanosleep 35

__attribute__((noinline)) long raw_syscall3(long nr, long a, long b, long c) {
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(nr), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return ret;
}

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void sleep_ns(long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    raw_syscall3(SYS_nanosleep, (long)&ts, 0, 0);
}

static int request[2], data[2];

__attribute__((noinline)) void slow_wait(void) { sleep_ns(300000000L); }
__attribute__((noinline)) void fast_wait(void) { sleep_ns(100000000L); }
__attribute__((noinline)) void tiny_wait(void) { sleep_ns(200000L); }
__attribute__((noinline)) void six_ms_wait(void) { sleep_ns(6000000L); }
__attribute__((noinline)) void two_ms_wait(void) { sleep_ns(2000000L); }

__attribute__((noinline)) void pipe_wait(void) {
    char c = 1;
    raw_syscall3(SYS_write, request[1], (long)&c, 1);
    raw_syscall3(SYS_read, data[0], (long)&c, 1);     /* blocks until the feeder answers */
}

__attribute__((noinline)) void *feeder(void *arg) {
    (void)arg;
    char c;
    for (;;) {
        if (raw_syscall3(SYS_read, request[0], (long)&c, 1) != 1)
            return NULL;
        sleep_ns(200000000L);
        raw_syscall3(SYS_write, data[1], (long)&c, 1);
    }
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: offcpu ratio|tiny|short SECONDS\n"); return 2; }
    double seconds = atof(argv[2]);
    double start = wall(), end = start + seconds;
    long loops = 0;
    if (strcmp(argv[1], "ratio") == 0) {
        pthread_t t;
        if (pipe(request) || pipe(data) || pthread_create(&t, NULL, feeder, NULL)) { perror("setup"); return 1; }
        for (; wall() < end; loops++) {
            slow_wait();
            fast_wait();
            pipe_wait();
        }
    } else if (strcmp(argv[1], "short") == 0) {
        prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);   /* the sleeps as asked, not 50 us longer */
        double six = 0, two = 0, t;
        for (; wall() < end; loops++) {
            t = wall();
            six_ms_wait();
            six += wall() - t;
            t = wall();
            two_ms_wait();
            two += wall() - t;
        }
        printf("six_ns=%.0f two_ns=%.0f ", six * 1e9, two * 1e9);
    } else {
        for (; wall() < end; loops++)
            tiny_wait();
    }
    printf("wall_seconds=%.6f loops=%ld\n", wall() - start, loops);
    return 0;
}
