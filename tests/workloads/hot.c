/* CPU-bound workload: the hot loop is main -> top -> mid -> leaf.
 * Usage: hot SECONDS   (runs until it has used SECONDS of CPU time, then
 * prints "cpu_seconds=<float>" and exits). Built with frame pointers. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

volatile unsigned long sink;

__attribute__((noinline)) void leaf(void) {
    unsigned long x = sink;
    for (long i = 0; i < 20000000; i++)   /* ~10 ms: main's share is negligible */
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    sink = x;
}

__attribute__((noinline)) void mid(void) { leaf(); sink++; }
__attribute__((noinline)) void top(void) { mid(); sink++; }

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    double start = cpu_seconds();
    while (cpu_seconds() - start < seconds)
        top();
    printf("cpu_seconds=%.6f\n", cpu_seconds() - start);
    return 0;
}
