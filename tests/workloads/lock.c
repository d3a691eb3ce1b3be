// Lock contention workload: two threads contend on one pthread mutex inside
// contended() (each holds it while it spins), and a third takes a mutex no
// other thread touches, in a loop, inside quiet().
//
//   lock SECONDS   wait for a line on stdin, run for SECONDS, print the
//                  counts, exit
//
// Prints key=value pairs: contended_locks, quiet_locks, contended_wait_ns (the time the
// contenders spent in pthread_mutex_lock, by their own clock: what a lock profile should hold).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t shared = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t alone = PTHREAD_MUTEX_INITIALIZER;
static volatile int stop;
static volatile unsigned long sink;
static unsigned long contended_locks, quiet_locks, contended_wait_ns;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void spin(long n) {
    for (long i = 0; i < n; i++)
        sink += i;
}

__attribute__((noinline)) void contended(void) {
    double t0 = now_s();
    pthread_mutex_lock(&shared);
    contended_wait_ns += (unsigned long)((now_s() - t0) * 1e9);   // under the lock: no race
    spin(50000);
    contended_locks++;
    pthread_mutex_unlock(&shared);
}

__attribute__((noinline)) void quiet(void) {
    pthread_mutex_lock(&alone);
    sink++;
    quiet_locks++;
    pthread_mutex_unlock(&alone);
}

static void *contender(void *arg) {
    (void)arg;
    while (!stop)
        contended();
    return NULL;
}

static void *quiet_thread(void *arg) {
    (void)arg;
    while (!stop)
        quiet();
    return NULL;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5;
    char line[64];
    if (!fgets(line, sizeof(line), stdin))
        return 2;
    pthread_t t[3];
    pthread_create(&t[0], NULL, contender, NULL);
    pthread_create(&t[1], NULL, contender, NULL);
    pthread_create(&t[2], NULL, quiet_thread, NULL);
    double t0 = now_s();
    while (now_s() - t0 < seconds)
        usleep(10000);
    stop = 1;
    for (int i = 0; i < 3; i++)
        pthread_join(t[i], NULL);
    printf("contended_locks=%lu quiet_locks=%lu contended_wait_ns=%lu\n", contended_locks, quiet_locks,
           contended_wait_ns);
    return 0;
}
