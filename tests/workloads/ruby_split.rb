# A Ruby workload for the runtime reader's tests (Ruby 3.3 and newer).
#
# Work#run, in the main thread, spends 75% of its time in Work#cpu_a and 25% in
# Work#cpu_b, busy: the same work per call, three times as much in cpu_a (a split
# by work holds on a loaded host), about 15 and 5 ms a call, the work drawn anew each
# round so that no sampling rate aliases with the cycle. A second thread waits in
# blocked_here, in sleep.
# It prints "ready PID" and runs until SECONDS (argv[0]) pass.

class Work
  def cpu_a(n)
    i = 0
    m = 3 * n        # once: a product per iteration would make cpu_a's iterations the slower
    while i < m      # LINE_A
      i += 1         # LINE_A
    end
  end

  def cpu_b(n)
    i = 0
    while i < n      # LINE_B
      i += 1         # LINE_B
    end
  end

  def run(stop)
    t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    i = 0
    i += 1 while i < 200_000
    n = [1, (200_000 * 0.005 / [Process.clock_gettime(Process::CLOCK_MONOTONIC) - t, 1e-6].max).to_i].max
    while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop
      k = n * rand(50..150) / 100   # cycles of random length: a 19 Hz sampler sees random phases
      cpu_a(k)  # CALL_A
      cpu_b(k)  # CALL_B
    end
  end
end

def blocked_here(stop)
  sleep(1) while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop  # WAIT
end

stop = Process.clock_gettime(Process::CLOCK_MONOTONIC) + (ARGV[0] || 60).to_f
waiter = Thread.new { blocked_here(stop) }
$stdout.puts "ready #{Process.pid}"
$stdout.flush
Work.new.run(stop)
waiter.join
