/* A workload that spends its time in the kernel: read() of /dev/zero, made
 * with an inline syscall instruction so the frame-pointer walk sees every
 * caller (Debian's libc has no frame pointers).
 * Usage: syscall SECONDS */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static char buf[1 << 20];

__attribute__((noinline)) long raw_read(int fd, void *p, unsigned long n) {
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(0L), "D"((long)fd), "S"(p), "d"(n) : "rcx", "r11", "memory");
    return ret;
}

__attribute__((noinline)) void read_loop(int fd) {
    for (int i = 0; i < 64; i++)
        raw_read(fd, buf, sizeof buf);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 3.0;
    int fd = open("/dev/zero", O_RDONLY);
    if (fd < 0) { perror("/dev/zero"); return 1; }
    double end = wall() + seconds;
    while (wall() < end)
        read_loop(fd);
    return 0;
}
