# A Ruby workload for the runtime reader's tests (Ruby 3.3 and newer).
#
# Work.run (a class method), in the main thread, spends 75% of its time in Work#cpu_a
# and 25% in Spin#cpu_b (a method of a module Work includes), busy: the same work per
# call, three times as much in cpu_a (a split by work holds on a loaded host), about 15
# and 5 ms a call, the work drawn anew each round so that no sampling rate aliases with
# the cycle. A second thread waits in blocked_here (a method of Object, defined at the
# top level), in a block, in sleep.
# It prints "ready PID" and runs until SECONDS (argv[0]) pass.

module Spin
  def cpu_b(n)
    i = 0
    while i < n      # LINE_B
      i += 1         # LINE_B
    end
  end
end

class Work
  include Spin

  def cpu_a(n)
    i = 0
    m = 3 * n        # once: a product per iteration would make cpu_a's iterations the slower
    while i < m      # LINE_A
      i += 1         # LINE_A
    end
  end

  def self.run(stop)
    w = new
    t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    i = 0
    i += 1 while i < 200_000
    n = [1, (200_000 * 0.005 / [Process.clock_gettime(Process::CLOCK_MONOTONIC) - t, 1e-6].max).to_i].max
    while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop
      k = n * rand(50..150) / 100   # cycles of random length: a 19 Hz sampler sees random phases
      w.cpu_a(k)  # CALL_A
      w.cpu_b(k)  # CALL_B
    end
  end
end

def blocked_here(stop)
  [stop].each do |s|
    sleep(1) while Process.clock_gettime(Process::CLOCK_MONOTONIC) < s  # WAIT
  end
end

stop = Process.clock_gettime(Process::CLOCK_MONOTONIC) + (ARGV[0] || 60).to_f
waiter = Thread.new { blocked_here(stop) }
$stdout.puts "ready #{Process.pid}"
$stdout.flush
Work.run(stop)
waiter.join
