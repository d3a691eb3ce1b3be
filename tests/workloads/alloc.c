// Allocation workload: path_a() allocates 3 bytes for every byte path_b()
// allocates (mixed sizes, malloc and calloc and realloc), and both free what
// they allocate; path_leak() allocates and never frees.
//
//   alloc ITERATIONS   wait until uprobes are on malloc and free (their first
//                      byte is int3), run, print "done ...", then wait for
//                      stdin to close (so the leak is live when the test
//                      stops the profiler)
//   alloc free-run ITERATIONS
//                      run at once (a process that is not a target), print
//                      "done ...", wait for stdin to close
//
// Prints key=value pairs: attached_ms, iterations, a_bytes, b_bytes,
// leak_bytes (bytes each path allocated: realloc's new size counts), malloc_addr
// and malloc_byte (where malloc is, and its first byte as this process sees it).
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LEAK_EVERY 100
#define LEAK_SIZE 65536

static volatile uintptr_t sink;
static size_t a_bytes, b_bytes, leak_bytes;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static unsigned char first_byte(void *fn) {
    return *(volatile unsigned char *)fn;
}

__attribute__((noinline)) void path_a(void) {
    char *p = malloc(300);
    char *q = calloc(10, 300);
    char *r = malloc(9000);
    r = realloc(r, 30000);     // an allocation of 30000 (and 9000 freed)
    sink += (uintptr_t)p ^ (uintptr_t)q ^ (uintptr_t)r;
    free(p);
    free(q);
    free(r);
    a_bytes += 300 + 3000 + 9000 + 30000;
}

__attribute__((noinline)) void path_b(void) {
    char *p = malloc(100);
    char *q = calloc(10, 100);
    char *r = malloc(3000);
    r = realloc(r, 10000);
    sink += (uintptr_t)p ^ (uintptr_t)q ^ (uintptr_t)r;
    free(p);
    free(q);
    free(r);
    b_bytes += 100 + 1000 + 3000 + 10000;
}

__attribute__((noinline)) void path_leak(void) {
    char *p = malloc(LEAK_SIZE);
    memset(p, 1, 64);
    sink += (uintptr_t)p;
    leak_bytes += LEAK_SIZE;
}

int main(int argc, char **argv) {
    int free_run = argc > 1 && strcmp(argv[1], "free-run") == 0;
    long iterations = argc > 1 + free_run ? atol(argv[1 + free_run]) : 100000;
    double t0 = now_s();
    if (!free_run) {
        // The uprobes are attached by the collector when it finds this process.
        while (first_byte((void *)malloc) != 0xcc || first_byte((void *)free) != 0xcc) {
            if (now_s() - t0 > 60) {
                fprintf(stderr, "no uprobe on malloc and free after 60 s\n");
                return 3;
            }
            usleep(10000);
        }
    }
    double attached = now_s() - t0;
    for (long i = 0; i < iterations; i++) {
        path_a();
        path_b();
        if (i % LEAK_EVERY == 0)
            path_leak();
    }
    printf("done attached_ms=%.0f iterations=%ld a_bytes=%zu b_bytes=%zu leak_bytes=%zu malloc_addr=%p "
           "malloc_byte=0x%02x seconds=%.3f\n", attached * 1000, iterations, a_bytes, b_bytes, leak_bytes,
           (void *)malloc, first_byte((void *)malloc), now_s() - t0 - attached);
    fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof(buf)) > 0) {
    }
    return 0;
}
