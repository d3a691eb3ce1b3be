/* A process the runtime reader takes for a runtime's: it maps the file argv[2] (a libcoreclr.so makes it
 * .NET's, a libjvm.so a JVM's), executable, as a runtime maps its library. Then, as argv[1] says:
 *   map: nothing more (a fake libjvm.so with a huge .symtab: issue 40);
 *   burst: it runs on a CPU for BURST_MS, then sleeps (a fake JVM that takes a register-sampling slot and
 *     sits on it: issue 40, case 8);
 *   spin: it runs on a CPU until it ends (a busy process that needs a slot);
 *   silent: it listens on the diagnostics socket a .NET process of its pid and start time would have,
 *     /tmp/dotnet-diagnostic-<pid>-<start time>-socket, and never accepts a connection (a peer that never
 *     answers: issue 40, case 6);
 *   answer: it listens there and answers every command as .NET 8.0.4 does, OK (the bytes .NET 8.0.4 sent to
 *     EnablePerfMap).
 * Usage: fake_runtime map|silent|answer FILE SECONDS. Prints "ready" once it maps the file (and listens);
 * ends after SECONDS, or when its stdin closes (the test's end), removing its socket. */
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static const unsigned char OK_8_0_4[24] = {'D', 'O', 'T', 'N', 'E', 'T', '_', 'I', 'P', 'C', '_', 'V', '1', 0,
                                           24, 0, 0xff, 0, 0, 0, 0, 0, 0, 0};
static char sock_path[108];
#define BURST_MS 1000

static void bye(int sig) {
    (void)sig;
    if (sock_path[0])
        unlink(sock_path);
    _exit(0);
}

static unsigned long long start_ticks(void) {
    char buf[4096];
    int fd = open("/proc/self/stat", O_RDONLY);
    ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof(buf) - 1);
    if (n <= 0)
        exit(2);
    buf[n] = 0;
    char *p = strrchr(buf, ')');               /* field 2 (comm) ends at the last ')'; field 22 is the start time */
    for (int field = 2; p && field < 22; field++)
        p = strchr(p + 1, ' ');
    if (!p)
        exit(2);
    close(fd);
    return strtoull(p + 1, NULL, 10);
}

int main(int argc, char **argv) {
    const char *mode = argv[1];
    if (argc != 4 || (strcmp(mode, "map") && strcmp(mode, "burst") && strcmp(mode, "spin") &&
                      strcmp(mode, "silent") && strcmp(mode, "answer"))) {
        fprintf(stderr, "usage: %s map|burst|spin|silent|answer FILE SECONDS\n", argv[0]);
        return 2;
    }
    int answer = !strcmp(mode, "answer"), listening = !strcmp(mode, "silent") || answer;
    int spin = !strcmp(mode, "spin") || !strcmp(mode, "burst");
    int fd = open(argv[2], O_RDONLY);
    if (fd < 0 || mmap(NULL, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0) == MAP_FAILED) {
        perror(argv[2]);
        return 2;
    }
    snprintf(sock_path, sizeof(sock_path), "/tmp/dotnet-diagnostic-%d-%llu-socket", getpid(), start_ticks());
    signal(SIGALRM, bye);
    signal(SIGTERM, bye);
    alarm((unsigned)atoi(argv[3]));            /* its own deadline */
    int srv = -1;
    if (listening) {
        srv = socket(AF_UNIX, SOCK_STREAM, 0);
        struct sockaddr_un addr = {.sun_family = AF_UNIX};
        strcpy(addr.sun_path, sock_path);
        unlink(sock_path);
        if (srv < 0 || bind(srv, (struct sockaddr *)&addr, sizeof(addr)) || listen(srv, 64)) {
            perror(sock_path);
            return 2;
        }
    } else {
        sock_path[0] = 0;                      /* nothing to remove */
    }
    printf("ready\n");
    fflush(stdout);
    struct pollfd fds[2] = {{.fd = 0, .events = POLLIN}, {.fd = srv, .events = answer ? POLLIN : 0}};
    struct timespec began;
    clock_gettime(CLOCK_MONOTONIC, &began);
    for (;;) {
        if (spin && !strcmp(mode, "burst")) {
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            spin = (now.tv_sec - began.tv_sec) * 1000 + (now.tv_nsec - began.tv_nsec) / 1000000 < BURST_MS;
        }
        if (spin)                              /* ~10 ms of CPU between looks at stdin */
            for (volatile unsigned long i = 0; i < 5000000; i++)
                ;
        if (poll(fds, 2, spin ? 0 : -1) < 0)
            continue;
        if (fds[0].revents) {                  /* stdin closed (or written to): the test is over */
            char c;
            if (read(0, &c, 1) <= 0)
                bye(0);
        }
        if (fds[1].revents & POLLIN) {
            int conn = accept(srv, NULL, NULL);
            if (conn < 0)
                continue;
            unsigned char req[64];
            if (read(conn, req, sizeof(req)) >= 20)
                (void)!write(conn, OK_8_0_4, sizeof(OK_8_0_4));
            close(conn);
        }
    }
}
