/* CPU-bound workload whose hot function is chosen by argv: main -> work -> alpha and
 * main -> work -> beta, the one named taking three times the CPU of the other (the same loop,
 * 3x the iterations). Two runs with the other name are a "deploy" that moved the hot spot.
 * Usage: shift SECONDS alpha|beta [wait] (CPU seconds, then prints "cpu_seconds=<float>"); with
 * "wait", it first reads a line from stdin (the test's go, once the recording has started).
 * Built with frame pointers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

static long alpha_n = 2000000, beta_n = 2000000;

__attribute__((noinline)) void alpha(void) { spin(alpha_n); sink++; }
__attribute__((noinline)) void beta(void) { spin(beta_n); sink++; }
__attribute__((noinline)) void work(void) { alpha(); beta(); }

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    const char *hot = argc > 2 ? argv[2] : "alpha";
    if (strcmp(hot, "alpha") == 0) {
        alpha_n *= 3;
    } else if (strcmp(hot, "beta") == 0) {
        beta_n *= 3;
    } else {
        fprintf(stderr, "usage: shift SECONDS alpha|beta [wait]\n");
        return 2;
    }
    if (argc > 3 && strcmp(argv[3], "wait") == 0) {
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            return 3;
    }
    double start = cpu_seconds();
    while (cpu_seconds() - start < seconds)
        work();
    printf("cpu_seconds=%.6f\n", cpu_seconds() - start);
    return 0;
}
