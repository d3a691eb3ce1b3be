/* Context-switch-heavy workload: two processes ping-pong one byte over a pair
 * of pipes. Every round trip is two blocking reads, so four context switches.
 * Usage: pingpong ROUND_TRIPS [WARMUP_SECONDS]   prints "round_trips=N seconds=S" and exits.
 * With WARMUP_SECONDS, it ping-pongs that long first, untimed: time for a
 * profiler to take notice of the two processes (DWARF unwinding starts once
 * the collector has written their unwind tables). */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000;
    double warmup = argc > 2 ? atof(argv[2]) : 0;
    int ping[2], pong[2];
    char c = 0;
    if (pipe(ping) || pipe(pong)) { perror("pipe"); return 1; }
    pid_t child = fork();
    if (child < 0) { perror("fork"); return 1; }
    if (child == 0) {
        close(ping[1]);   /* so that the parent's exit is an end of file here */
        close(pong[0]);
        while (read(ping[0], &c, 1) == 1)   /* until the parent closes its end */
            if (write(pong[1], &c, 1) != 1) _exit(1);
        _exit(0);
    }
    close(ping[0]);
    close(pong[1]);
    for (double until = wall() + warmup; wall() < until;)
        for (int i = 0; i < 1000; i++)
            if (write(ping[1], &c, 1) != 1 || read(pong[0], &c, 1) != 1) { perror("warm-up"); return 1; }
    double start = wall();
    for (long i = 0; i < n; i++) {
        if (write(ping[1], &c, 1) != 1 || read(pong[0], &c, 1) != 1) { perror("ping"); return 1; }
    }
    double seconds = wall() - start;
    close(ping[1]);
    int status;
    waitpid(child, &status, 0);
    printf("round_trips=%ld seconds=%.6f\n", n, seconds);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
