<?php
// A PHP workload for the runtime reader's tests (PHP 8.2 and newer).
//
// Work::run() spends 75% of its time in Work::cpu_a() and 25% in cpu_b(), busy:
// the same work per call, three times as much in cpu_a (a split by work holds on a
// loaded host, where waits for a CPU fall on each function in proportion to the
// CPU it uses; a split by deadlines would add each wait to whichever is running
// and tilt the ratio towards 1:1). Calls of about 15 and 5 ms, calibrated at the
// start, the work drawn anew each round so that no sampling rate aliases with the cycle. With the argument "block" it instead waits in blocked_here(), in sleep().
// It prints one line "ready PID" and runs until SECONDS (argv[2]) pass. Run by php-fpm, the
// request's query string gives them instead (mode=split&seconds=60), and the line is the
// response's body.

class Work {
    public static function cpu_a(int $n): void {
        $m = 3 * $n;  // once: a product per iteration would make cpu_a's iterations the slower
        for ($i = 0; $i < $m; $i++) {
            microtime(true);  // LINE_A
        }
    }

    public static function cpu_b(int $n): void {
        for ($i = 0; $i < $n; $i++) {
            microtime(true);  // LINE_B
        }
    }

    public static function run(float $stop): void {
        $t = microtime(true);
        for ($i = 0; $i < 100000; $i++) {
            microtime(true);
        }
        $n = max(1, (int)(100000 * 0.005 / max(microtime(true) - $t, 1e-6)));
        while (microtime(true) < $stop) {
            $k = intdiv($n * mt_rand(50, 150), 100);  // random cycles: a 19 Hz sampler sees random phases
            self::cpu_a($k);  // CALL_A
            self::cpu_b($k);  // CALL_B
        }
    }
}

function blocked_here(float $stop): void {
    while (microtime(true) < $stop) {
        sleep(1);  // WAIT
    }
}

$cli = PHP_SAPI === "cli";
$mode = ($cli ? ($argv[1] ?? null) : ($_GET["mode"] ?? null)) ?? "split";
$stop = microtime(true) + (float)(($cli ? ($argv[2] ?? null) : ($_GET["seconds"] ?? null)) ?? 60);
echo "ready " . getmypid() . "\n";
if ($mode === "block") {
    blocked_here($stop);
} else {
    Work::run($stop);
}
