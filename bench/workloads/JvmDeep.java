// The jvm bench's workload (bench/jvm.py): THREADS threads, each DEPTH Java frames deep (recursion), then
// a loop of a little arithmetic and a park of PARK_NS: most of the time parked with its last Java frame
// recorded (what the JVM reader walks). Prints "ops N" (the loops done by all threads) every 500 ms;
// ends by itself after SECONDS. Arguments: SECONDS THREADS DEPTH PARK_NS.
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.locks.LockSupport;

public class JvmDeep {
    static final AtomicLong OPS = new AtomicLong();
    static volatile long sink;

    static void leaf(long parkNs, long until) {
        long local = 0;
        while (System.nanoTime() < until) {
            for (int i = 0; i < 2000; i++) {
                local = local * 31 + i;
            }
            sink = local;
            OPS.incrementAndGet();
            LockSupport.parkNanos(parkNs);
        }
    }

    static void down(int depth, long parkNs, long until) {
        if (depth <= 1) {
            leaf(parkNs, until);
        } else {
            down(depth - 1, parkNs, until);
        }
    }

    public static void main(String[] args) throws Exception {
        long seconds = Long.parseLong(args[0]);
        int threads = Integer.parseInt(args[1]);
        int depth = Integer.parseInt(args[2]);
        long parkNs = Long.parseLong(args[3]);
        long until = System.nanoTime() + seconds * 1_000_000_000L;
        for (int t = 0; t < threads; t++) {
            Thread th = new Thread(() -> down(depth, parkNs, until), "deep-" + t);
            th.setDaemon(true);
            th.start();
        }
        while (System.nanoTime() < until) {
            Thread.sleep(500);
            System.out.println("ops " + OPS.get());
            System.out.flush();
        }
    }
}
