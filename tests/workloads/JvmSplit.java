// The JVM tests' workload (tests/integration/test_jvm_stacks.py): worker threads (the second argument:
// how many, "worker-N") whose time splits 3:1 between splitA (which calls inlinedLeaf, small enough for
// the JIT to inline) and splitB, and a thread "blocked" in blockedHere. Each pause is a park of PAUSE_NS, so the worker spends its
// time in the JVM's park with its last Java frame recorded (what a reader outside the process can
// walk without the thread's registers). Warm-up first (the JIT compiles splitA with inlinedLeaf
// inlined), then "ready" on stdout once every worker is past it. Ends by itself after the seconds given as its first argument.
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.locks.LockSupport;

public class JvmSplit {
    static final Object LOCK = new Object();
    static volatile long pauseNs = 1;
    static volatile long sink;

    static void inlinedLeaf(int i) {
        sink += i;
        LockSupport.parkNanos(pauseNs); // PARK_LEAF
    }

    static void splitA() {
        for (int i = 0; i < 3; i++) {
            inlinedLeaf(i); // CALL_LEAF
        }
    }

    static void splitB() {
        sink += 1;
        LockSupport.parkNanos(pauseNs); // PARK_B
    }

    static void work(long until, int rounds) {
        for (int i = 0; i < rounds || System.nanoTime() < until; i++) {
            splitA(); // CALL_A
            splitB(); // CALL_B
        }
    }

    static void blockedHere() throws InterruptedException {
        synchronized (LOCK) {
            LOCK.wait(); // WAIT
        }
    }

    public static void main(String[] args) throws Exception {
        long seconds = Long.parseLong(args[0]);
        long deadline = System.nanoTime() + seconds * 1_000_000_000L;
        Thread blocked = new Thread(() -> {
            try {
                // By reflection: before JDK 18 its first calls go through native code (invoke0) back into Java.
                JvmSplit.class.getDeclaredMethod("blockedHere").invoke(null); // INVOKE
            } catch (ReflectiveOperationException e) {
                return;
            }
        }, "blocked");
        blocked.setDaemon(true);
        blocked.start();
        int workers = Integer.parseInt(args[1]);
        CountDownLatch warm = new CountDownLatch(workers);
        Thread[] threads = new Thread[workers];
        for (int w = 0; w < workers; w++) {
            final int id = w;
            threads[w] = new Thread(() -> {
                work(0, 15000);   // warm-up: pauses of 1 ns
                warm.countDown();
                try {
                    warm.await();
                } catch (InterruptedException e) {
                    return;
                }
                pauseNs = 1_000_000;
                // Workers out of step with each other: sampled at once, workers in step are one sample, not many.
                LockSupport.parkNanos(id * 4_000_000L / workers);
                work(deadline, 0);
            }, "worker-" + w);
            threads[w].setDaemon(true);
            threads[w].start();
        }
        warm.await();
        System.out.println("ready");
        System.out.flush();
        for (Thread t : threads) {
            t.join();
        }
    }
}
