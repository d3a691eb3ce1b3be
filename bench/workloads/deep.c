/* A CPU-bound workload with a stack of a chosen depth, for the unwinding bench.
 * Usage: deep FRAMES UNITS THREADS
 * Each of THREADS threads runs UNITS/THREADS times: rec() nested so that the
 * whole user stack (_start ... main, worker or start_thread, rec x N, spin) is
 * about FRAMES deep, then 10^5 iterations of a multiply-add chain at the leaf.
 * Prints "elapsed=<wall seconds>". Built with or without frame pointers by bench. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

volatile unsigned long sink;
static int nest;
static long per_thread;

__attribute__((noinline)) void spin(void) {
    unsigned long x = sink;
    for (long i = 0; i < 100000; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    sink = x;
}

__attribute__((noinline)) void rec(int depth) {
    if (depth <= 0)
        spin();
    else
        rec(depth - 1);
    sink++;
}

__attribute__((noinline)) void *worker(void *arg) {
    (void)arg;
    for (long i = 0; i < per_thread; i++)
        rec(nest);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: deep FRAMES UNITS THREADS\n"); return 2; }
    int frames = atoi(argv[1]), threads = atoi(argv[3]);
    long units = atol(argv[2]);
    /* threads: clone3, start_thread, worker, rec x (nest + 1), spin */
    nest = frames - 5 > 0 ? frames - 5 : 0;
    per_thread = units / (threads > 0 ? threads : 1);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    pthread_t t[256];
    for (int i = 0; i < threads && i < 256; i++)
        pthread_create(&t[i], NULL, worker, NULL);
    for (int i = 0; i < threads && i < 256; i++)
        pthread_join(t[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("elapsed=%.6f\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9);
    return 0;
}
