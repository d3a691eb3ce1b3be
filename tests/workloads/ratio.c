/* CPU-bound workload with a known split: main -> work -> heavy takes three
 * times the CPU of main -> work -> light (the same loop, 3x the iterations).
 * Usage: ratio SECONDS (CPU seconds, then prints "cpu_seconds=<float>").
 * Built with frame pointers. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

volatile unsigned long sink;

static void spin(long n) {
    unsigned long x = sink;
    for (long i = 0; i < n; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    sink = x;
}

__attribute__((noinline)) void heavy(void) { spin(3 * 2000000); sink++; }
__attribute__((noinline)) void light(void) { spin(2000000); sink++; }
__attribute__((noinline)) void work(void) { heavy(); light(); }

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    double start = cpu_seconds();
    while (cpu_seconds() - start < seconds)
        work();
    printf("cpu_seconds=%.6f\n", cpu_seconds() - start);
    return 0;
}
