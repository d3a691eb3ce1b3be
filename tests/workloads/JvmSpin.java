// The JVM on-CPU test's workload (tests/integration/test_jvm_cpu.py): worker threads (the second argument:
// how many, "spin-N") that never block, their CPU time split 3:1 between splitA (whose loop calls
// inlinedLeaf, small enough for the JIT to inline) and splitB, by work: the same steps (a multiply-add
// chain in step(), which the test keeps out of line: its call in inlinedLeaf is where splitA's compiled
// code records that inlinedLeaf was inlined there), 3 * STEPS times in splitA, STEPS times in splitB.
// Warm-up first (the JIT compiles them), then "ready" on stdout. Ends by itself after the seconds given as
// its first argument.
public class JvmSpin {
    static final int STEPS = 15_000;
    static volatile long sink;

    static long step(long x) {
        for (int i = 0; i < 64; i++) {
            x = x * 6364136223846793005L + 1442695040888963407L; // STEP
        }
        return x;
    }

    static long inlinedLeaf(long x) {
        return step(x) ^ (x >>> 7); // CALL_STEP
    }

    static long splitA(long x, int steps) {
        for (int i = 0; i < 3 * steps; i++) {
            x = inlinedLeaf(x); // CALL_LEAF
        }
        return x;
    }

    static long splitB(long x, int steps) {
        for (int i = 0; i < steps; i++) {
            x = step(x) ^ (x >>> 7); // SPIN_B
        }
        return x;
    }

    static void work(long deadline) {
        long x = 1;
        while (System.nanoTime() < deadline) {
            x = splitA(x, STEPS); // CALL_A
            x = splitB(x, STEPS); // CALL_B
        }
        sink = x;
    }

    public static void main(String[] args) throws Exception {
        long seconds = Long.parseLong(args[0]);
        long deadline = System.nanoTime() + seconds * 1_000_000_000L;
        // Warm-up: short calls, many of them, so both methods are compiled before "ready".
        long x = 1;
        for (int i = 0; i < 20000; i++) {
            x = splitA(x, 100);
            x = splitB(x, 100);
        }
        sink = x;
        int workers = Integer.parseInt(args[1]);
        Thread[] threads = new Thread[workers];
        for (int w = 0; w < workers; w++) {
            threads[w] = new Thread(() -> work(deadline), "spin-" + w);
            threads[w].setDaemon(true);
            threads[w].start();
        }
        System.out.println("ready");
        System.out.flush();
        for (Thread t : threads) {
            t.join();
        }
    }
}
