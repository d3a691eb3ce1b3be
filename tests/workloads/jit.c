/* A "JIT": copies a counting loop into an anonymous executable mapping, names
 * it in /tmp/perf-<pid>.map and runs it.
 * Usage: jit SECONDS MODE [TARGET]
 *   MODE own      write the map file itself (it owns it)
 *   MODE shared   the same, its code in shared anonymous memory ("/dev/zero (deleted)" in its maps)
 *   MODE symlink  make /tmp/perf-<pid>.map a symlink to TARGET instead
 * Prints "ready <code address>" once the map is in place. Removes the map file at exit. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* mov ecx, 50000000; 1: dec ecx; jnz 1b; ret */
static const unsigned char code[] = {0xb9, 0x80, 0xf0, 0xfa, 0x02, 0xff, 0xc9, 0x75, 0xfc, 0xc3};

__attribute__((noinline)) void call_jit(void (*fn)(void)) { fn(); }

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: jit SECONDS own|shared|symlink [TARGET]\n"); return 2; }
    double seconds = atof(argv[1]);
    int shared = strcmp(argv[2], "shared") == 0;
    unsigned char *mem = mmap(NULL, 4096, PROT_READ | PROT_WRITE, (shared ? MAP_SHARED : MAP_PRIVATE) | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) { perror("mmap"); return 1; }
    memcpy(mem, code, sizeof code);
    if (mprotect(mem, 4096, PROT_READ | PROT_EXEC)) { perror("mprotect"); return 1; }

    char path[64];
    snprintf(path, sizeof path, "/tmp/perf-%d.map", getpid());
    if (strcmp(argv[2], "symlink") == 0) {
        if (argc < 4 || symlink(argv[3], path)) { perror("symlink"); return 1; }
    } else {
        FILE *f = fopen(path, "w");
        if (!f) { perror(path); return 1; }
        fprintf(f, "%lx %zx jit_spin_loop\n", (unsigned long)mem, sizeof code);
        fclose(f);
    }
    printf("ready %lx\n", (unsigned long)mem);
    fflush(stdout);
    double end = wall() + seconds;
    while (wall() < end)
        call_jit((void (*)(void))mem);
    unlink(path);
    return 0;
}
