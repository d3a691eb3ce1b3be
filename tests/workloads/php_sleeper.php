<?php
// A PHP process that forks a child which only sleeps, and waits for it: neither runs once the child
// sleeps. The child sleeps in sleep_here() for SECONDS (argv[1]); the parent prints the child's pid
// and waits in wait_child(). Both end by themselves when the sleep is over.

function sleep_here(int $seconds): void {
    sleep($seconds);  // SLEEP
}

function wait_child(int $pid): void {
    pcntl_waitpid($pid, $status);
}

$seconds = (int)($argv[1] ?? 120);
$pid = pcntl_fork();
if ($pid === 0) {
    sleep_here($seconds);
    exit(0);
}
echo "$pid\n";
fflush(STDOUT);
wait_child($pid);
