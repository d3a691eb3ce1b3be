// The JVM on-CPU test's workload (tests/integration/test_jvm_cpu.py): worker threads (the second argument:
// how many, "spin-N") that never block, their CPU time split 3:1 between splitA (whose loop calls
// inlinedLeaf, small enough for the JIT to inline) and splitB, by work: the same steps (a multiply-add
// chain in step(), which the test keeps out of line: its call in inlinedLeaf is where splitA's compiled
// code records that inlinedLeaf was inlined there), 3 * steps times in splitA, steps times in splitB, with
// steps drawn afresh each round around STEPS.
// Warm-up first (the JIT compiles them), then "ready" on stdout, then every 500 ms "split A_NS B_NS": the
// CPU nanoseconds the workers spent in splitA and in splitB so far, by their own thread CPU clocks (the
// JIT may make a step of one a little dearer than the other's: the test compares with this). CPU time,
// not the wall clock: on a shared host a worker is preempted for milliseconds at a time, and the wall
// clock charges each such wait to whichever half it fell in, which moved a 10-s split by ±10%; the
// sampler counts CPU time only. Ends by itself after the seconds given as its first argument.
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

    // CPU nanoseconds the workers spent in splitA and in splitB, the truth the test compares with.
    static final java.util.concurrent.atomic.AtomicLong NS_A = new java.util.concurrent.atomic.AtomicLong();
    static final java.util.concurrent.atomic.AtomicLong NS_B = new java.util.concurrent.atomic.AtomicLong();
    static final java.lang.management.ThreadMXBean CPU = java.lang.management.ManagementFactory.getThreadMXBean();

    static void work(long deadline) {
        long x = 1;
        int seed = (int) Thread.currentThread().getId() * 0x9E3779B9 | 1;
        long t0 = CPU.getCurrentThreadCpuTime();
        while (System.nanoTime() < deadline) {
            // Each round's length varies (STEPS/2 to 3*STEPS/2, xorshift), so that the rounds keep no
            // fixed phase to the fixed-period sampler (at a fixed length, one run's 5-s windows split
            // varied twice as much as independent samples would).
            seed ^= seed << 13;
            seed ^= seed >>> 17;
            seed ^= seed << 5;
            int steps = STEPS / 2 + (seed >>> 1) % STEPS;
            x = splitA(x, steps); // CALL_A
            long t1 = CPU.getCurrentThreadCpuTime();
            x = splitB(x, steps); // CALL_B
            long t2 = CPU.getCurrentThreadCpuTime();
            NS_A.addAndGet(t1 - t0);
            NS_B.addAndGet(t2 - t1);
            t0 = t2;
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
        while (System.nanoTime() < deadline) {
            Thread.sleep(500);
            System.out.println("split " + NS_A.get() + " " + NS_B.get());
            System.out.flush();
        }
    }
}
