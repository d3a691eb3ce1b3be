/* A small program for the unwind table tests (tests/unit/test_cfi.py, test_unwind_serve.py).
 * Built with -O2 -fomit-frame-pointer (and cross-compiled for arm64) so its CFI has
 * what real binaries have: SP-based CFAs that move with pushes, a frame-pointer CFA
 * (the variable-length array), callee-saved registers, remember/restore state around
 * early returns, and a call through libc (qsort calling back into cmp).
 * Run with "wait": prints "ready" and blocks reading stdin until EOF. No headers, so
 * it also builds with a cross compiler that has no target libc headers. */
typedef unsigned long size_t;
extern void qsort(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *));
extern long read(int fd, void *buf, size_t n);
extern int puts(const char *s);
extern int fflush(void *stream);
extern int strcmp(const char *a, const char *b);

volatile unsigned long sink;

__attribute__((noinline)) static unsigned long leaf(unsigned long x) {
    for (int i = 0; i < 1000; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    return x;
}

__attribute__((noinline)) static unsigned long mid(unsigned long x) { return leaf(x) + leaf(x ^ 7); }

__attribute__((noinline)) static unsigned long top(unsigned long x) { return mid(x) * 3 + mid(x + 5); }

__attribute__((noinline)) static unsigned long recurse(int depth, unsigned long x) {
    if (depth == 0)
        return top(x);
    return recurse(depth - 1, x + 1) * 7 + 1;
}

static int cmp(const void *a, const void *b) {
    unsigned long x = leaf(*(const unsigned long *)a), y = leaf(*(const unsigned long *)b);
    return x < y ? -1 : x > y;
}

__attribute__((noinline)) static unsigned long with_vla(int n) {
    unsigned long buf[n];
    for (int i = 0; i < n; i++)
        buf[i] = (unsigned long)(n - i) * 2654435761UL;
    qsort(buf, (size_t)n, sizeof buf[0], cmp);
    return buf[0] + buf[n - 1];
}

__attribute__((noinline)) static unsigned long many(unsigned long a, unsigned long b, unsigned long c,
                                                    unsigned long d) {
    unsigned long r = 0;
    for (unsigned long i = 0; i < a; i++) {
        if (i == b)
            return r + mid(c);
        r += top(i ^ c) + recurse((int)(d & 7), i) + (i * d);
        sink = r;
    }
    return r;
}

int main(int argc, char **argv) {
    sink = many(3, 5, 11, 13) + with_vla(40 + argc) + recurse(40, 1);
    if (argc > 1 && strcmp(argv[1], "wait") == 0) {
        char buf[64];
        puts("ready");
        fflush(0);
        while (read(0, buf, sizeof buf) > 0)
            ;
    }
    return 0;
}
