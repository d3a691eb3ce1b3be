/* A light workload for the hostile processes of tests/integration/test_soak.py:
 * for SECONDS, spins in spin() for 10 ms of every 100 ms (about 10% of a CPU),
 * so it is sampled without crowding out the ordinary workload.
 * Usage: duty SECONDS [FILE]   FILE, if given, is mapped readable and executable
 * first (a file named like an interpreter that the runtime reader will probe).
 * Prints "ready" once set up. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

volatile unsigned long sink;

__attribute__((noinline)) void spin(double until) {
    while (wall() < until)
        sink = sink * 6364136223846793005UL + 1;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 10.0;
    if (argc > 2) {
        int fd = open(argv[2], O_RDONLY);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) || mmap(NULL, st.st_size, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0) == MAP_FAILED) {
            perror(argv[2]);
            return 1;
        }
    }
    printf("ready\n");
    fflush(stdout);
    double end = wall() + seconds;
    while (wall() < end) {
        spin(wall() + 0.010);
        usleep(90000);
    }
    return 0;
}
