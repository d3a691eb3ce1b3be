/* cpu_loop: a fixed amount of CPU work split over N threads; prints the wall time.
 *
 * Usage: cpu_loop UNITS [THREADS [KERNEL_MS]]
 *   UNITS      total work, in units of 1,000,000 loop iterations (split evenly
 *              over the threads; the amount never depends on time)
 *   THREADS    worker threads (default: the number of online CPUs)
 *   KERNEL_MS  then, on every thread, this many ms of reading /dev/zero, so a
 *              profiler sees kernel stacks too (warm-up runs only; default 0;
 *              when given, it is part of elapsed_s)
 * Prints one line: "elapsed_s=<wall s> cpu_s=<user+system s> threads=<n> units=<units>".
 *
 * The hot loop is thread_main -> outer -> inner so that profilers see a few
 * frames; built by bench with -O2 -fno-omit-frame-pointer. */
#include <fcntl.h>
#include <pthread.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define ITERATIONS_PER_UNIT 1000000UL

static volatile unsigned long sink;

__attribute__((noinline)) static unsigned long inner(unsigned long x) {
    for (unsigned long i = 0; i < ITERATIONS_PER_UNIT; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    return x;
}

__attribute__((noinline)) static unsigned long outer(unsigned long units, unsigned long seed) {
    unsigned long x = seed;
    for (unsigned long u = 0; u < units; u++)
        x = inner(x);
    return x;
}

struct job { unsigned long units; unsigned long seed; double kernel_s; };

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void kernel_time(double seconds) {
    static char buf[1 << 16];
    int fd = open("/dev/zero", O_RDONLY);
    if (fd < 0)
        return;
    double end = wall() + seconds;
    while (wall() < end)
        if (read(fd, buf, sizeof buf) < 0)
            break;
    close(fd);
}

static void *thread_main(void *arg) {
    struct job *j = arg;
    sink += outer(j->units, j->seed);
    if (j->kernel_s > 0)
        kernel_time(j->kernel_s);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: cpu_loop UNITS [THREADS [KERNEL_MS]]\n");
        return 2;
    }
    unsigned long units = strtoul(argv[1], NULL, 10);
    long threads = argc > 2 ? strtol(argv[2], NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    long kernel_ms = argc > 3 ? strtol(argv[3], NULL, 10) : 0;
    if (units == 0 || threads < 1 || threads > 4096 || kernel_ms < 0 || kernel_ms > 600000) {
        fprintf(stderr, "cpu_loop: UNITS must be > 0, THREADS in 1..4096, KERNEL_MS in 0..600000\n");
        return 2;
    }
    pthread_t *tids = calloc(threads, sizeof *tids);
    struct job *jobs = calloc(threads, sizeof *jobs);
    if (!tids || !jobs) {
        perror("cpu_loop: calloc");
        return 1;
    }
    double start = wall();
    for (long t = 0; t < threads; t++) {
        /* the remainder goes to the first threads: the total is exactly UNITS */
        jobs[t].units = units / threads + ((unsigned long)t < units % threads ? 1 : 0);
        jobs[t].seed = (unsigned long)t + 1;
        jobs[t].kernel_s = kernel_ms / 1000.0;
        if (pthread_create(&tids[t], NULL, thread_main, &jobs[t]) != 0) {
            perror("cpu_loop: pthread_create");
            return 1;
        }
    }
    for (long t = 0; t < threads; t++)
        pthread_join(tids[t], NULL);
    double elapsed = wall() - start;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    printf("elapsed_s=%.6f cpu_s=%.6f threads=%ld units=%lu\n", elapsed, cpu, threads, units);
    return 0;
}
