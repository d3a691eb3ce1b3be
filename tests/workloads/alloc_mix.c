// A realistic allocation mix, run the way a user's process runs: it does not
// wait for the profiler. mix_a() and mix_b() allocate blocks of 32 to 352
// bytes and free each at once, mix_a() three blocks for every one of
// mix_b()'s; leak_page() allocates 4 KiB blocks and never frees them.
// Paced to MB_PER_S megabytes a second (the process: 10).
//
//   alloc_mix SECONDS MB_PER_S
//
// Prints "started" once running, then after SECONDS "done ..." with key=value
// pairs: a_bytes, b_bytes, leak_bytes (what each function allocated),
// a_calls, b_calls, leak_calls, seconds; then waits for stdin to close (so
// the leak is live when the test stops the profiler).
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define LEAK_SIZE 4096
#define LEAK_EVERY 100           // iterations per leaked page: ~5% of the bytes
#define BATCH 256                // iterations between looks at the clock

static volatile uintptr_t sink;
static size_t a_bytes, b_bytes, leak_bytes, a_calls, b_calls, leak_calls;
static uint64_t rng = 88172645463325252ull;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static size_t block_size(void) {   // 32..352 in steps of 16: mean 192
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return 32 + 16 * (rng % 21);
}

__attribute__((noinline)) void mix_a(void) {
    for (int i = 0; i < 3; i++) {
        size_t n = block_size();
        char *p = malloc(n);
        p[0] = 1;
        sink += (uintptr_t)p;
        free(p);
        a_bytes += n;
        a_calls++;
    }
}

__attribute__((noinline)) void mix_b(void) {
    size_t n = block_size();
    char *p = malloc(n);
    p[0] = 1;
    sink += (uintptr_t)p;
    free(p);
    b_bytes += n;
    b_calls++;
}

__attribute__((noinline)) void leak_page(void) {
    char *p = malloc(LEAK_SIZE);
    p[0] = 1;
    sink += (uintptr_t)p;
    leak_bytes += LEAK_SIZE;
    leak_calls++;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 30;
    double rate = (argc > 2 ? atof(argv[2]) : 10) * 1e6;
    printf("started\n");
    fflush(stdout);
    double t0 = now_s(), t = t0;
    long i = 0;
    while (t - t0 < seconds) {
        for (int j = 0; j < BATCH; j++, i++) {
            mix_a();
            mix_b();
            if (i % LEAK_EVERY == 0)
                leak_page();
        }
        t = now_s();
        double ahead = (a_bytes + b_bytes + leak_bytes) / rate - (t - t0);
        if (ahead > 0) {
            struct timespec ts = {(time_t)ahead, (long)((ahead - (time_t)ahead) * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
    printf("done a_bytes=%zu b_bytes=%zu leak_bytes=%zu a_calls=%zu b_calls=%zu leak_calls=%zu seconds=%.3f\n",
           a_bytes, b_bytes, leak_bytes, a_calls, b_calls, leak_calls, now_s() - t0);
    fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof(buf)) > 0) {
    }
    return 0;
}
