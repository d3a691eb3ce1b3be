// Two threads taking one pthread mutex in a tight loop (contended: futex
// waits and wakes), for the cost of lock profiling.
//
//   mutex_loop ITERATIONS WARMUP_S
//
// Runs WARMUP_S seconds untimed first (the profiler finds the process),
// then ITERATIONS lock/unlock pairs per thread, timed. Prints
// iterations=N seconds=S (N: both threads' pairs).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_barrier_t start;
static volatile unsigned long counter;
static long iterations;
static double warmup_s;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void pairs(long n) {
    for (long i = 0; i < n; i++) {
        pthread_mutex_lock(&m);
        for (int k = 0; k < 50; k++)
            counter++;
        pthread_mutex_unlock(&m);
    }
}

static void *worker(void *arg) {
    (void)arg;
    double t0 = now_s();
    while (now_s() - t0 < warmup_s)
        pairs(1000);
    pthread_barrier_wait(&start);
    pairs(iterations);
    return NULL;
}

int main(int argc, char **argv) {
    iterations = argc > 1 ? atol(argv[1]) : 1000000;
    warmup_s = argc > 2 ? atof(argv[2]) : 0;
    pthread_t t[2];
    pthread_barrier_init(&start, NULL, 3);
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, worker, NULL);
    pthread_barrier_wait(&start);
    double t1 = now_s();
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    printf("iterations=%ld seconds=%.6f\n", 2 * iterations, now_s() - t1);
    return 0;
}
