/* Workloads for DWARF unwinding: built with -O2 -fomit-frame-pointer, so a
 * frame-pointer walk loses callers; only .eh_frame gives whole stacks.
 *
 * Usage:
 *   nofp cpu SECONDS     rotates, ~1/3 of the time each, between
 *                        main -> hot_path -> top -> mid -> leaf,
 *                        main -> recurse -> rec (x41, 40 deep below the first) -> rec_leaf,
 *                        main -> sort_path -> qsort (libc) -> ... -> compare;
 *                        prints "cpu_seconds=<float>" after SECONDS of CPU time.
 *   nofp offcpu SECONDS  one thread loops: 300 ms of usleep() in slow_wait(),
 *                        100 ms in fast_wait(), and a blocking read() through
 *                        libc in pipe_wait() that a feeder thread answers
 *                        200 ms later; prints "wall_seconds=<float> loops=<n>".
 * Every call below is followed by work, so none becomes a tail call. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

volatile unsigned long sink;

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static unsigned long spin(long n) {
    unsigned long x = sink;
    for (long i = 0; i < n; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    return x;
}

/* ---- main -> hot_path -> top -> mid -> leaf */
__attribute__((noinline)) void leaf(void) { sink = spin(4000000); }
__attribute__((noinline)) void mid(void) { leaf(); sink++; }
__attribute__((noinline)) void top(void) { mid(); sink++; }
__attribute__((noinline)) void hot_path(void) { top(); sink++; }

/* ---- main -> recurse -> rec x41 -> rec_leaf */
__attribute__((noinline)) void rec_leaf(void) { sink = spin(4000000); }
__attribute__((noinline)) void rec(int depth) {
    if (depth == 0)
        rec_leaf();
    else
        rec(depth - 1);
    sink++;
}
__attribute__((noinline)) void recurse(void) { rec(40); sink++; }

/* ---- main -> sort_path -> qsort -> ... -> compare */
__attribute__((noinline)) int compare(const void *a, const void *b) {
    unsigned long x = spin(400);
    sink = x;
    long d = (long)*(const unsigned *)a - (long)*(const unsigned *)b;
    return (d > 0) - (d < 0);
}
__attribute__((noinline)) void sort_path(void) {
    static unsigned v[1024];
    for (unsigned i = 0; i < 1024; i++)
        v[i] = (i * 2654435761u) >> 7;
    qsort(v, 1024, sizeof v[0], compare);
    sink += v[0];
}

/* ---- off-CPU through libc */
static int request[2], data[2];
__attribute__((noinline)) void slow_wait(void) { usleep(300000); sink++; }
__attribute__((noinline)) void fast_wait(void) { usleep(100000); sink++; }
__attribute__((noinline)) void pipe_wait(void) {
    char c = 1;
    if (write(request[1], &c, 1) != 1 || read(data[0], &c, 1) != 1)   /* blocks until the feeder answers */
        exit(1);
    sink++;
}
__attribute__((noinline)) void *feeder(void *arg) {
    (void)arg;
    char c;
    while (read(request[0], &c, 1) == 1) {
        usleep(200000);
        if (write(data[1], &c, 1) != 1)
            break;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: nofp cpu|offcpu SECONDS\n"); return 2; }
    double seconds = atof(argv[2]);
    if (strcmp(argv[1], "cpu") == 0) {
        double start = clock_s(CLOCK_PROCESS_CPUTIME_ID);
        while (clock_s(CLOCK_PROCESS_CPUTIME_ID) - start < seconds) {
            hot_path();
            recurse();
            sort_path();
        }
        printf("cpu_seconds=%.6f\n", clock_s(CLOCK_PROCESS_CPUTIME_ID) - start);
        return 0;
    }
    pthread_t t;
    if (pipe(request) || pipe(data) || pthread_create(&t, NULL, feeder, NULL)) { perror("setup"); return 1; }
    double start = clock_s(CLOCK_MONOTONIC), end = start + seconds;
    long loops = 0;
    for (; clock_s(CLOCK_MONOTONIC) < end; loops++) {
        slow_wait();
        fast_wait();
        pipe_wait();
    }
    printf("wall_seconds=%.6f loops=%ld\n", clock_s(CLOCK_MONOTONIC) - start, loops);
    return 0;
}
