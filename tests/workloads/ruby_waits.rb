# A Ruby workload whose threads wait in C functions, for the runtime reader's tests (Ruby 3.3 and newer).
#
# The main thread waits in Thread#join (at <main>'s JOIN line) for a thread asleep in park_here
# (Kernel#sleep under Object#park_here, at PARK); a third thread sleeps in a block given to Array#each
# in Cycle#each_round (Kernel#sleep under "block in Cycle#each_round", at ROUND).
# It prints "ready PID" and runs until SECONDS (argv[0]) pass.

def park_here(stop)
  sleep(1) while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop  # PARK
end

class Cycle
  def each_round(stop)
    [stop].each do |s|  # EACH
      sleep(1) while Process.clock_gettime(Process::CLOCK_MONOTONIC) < s  # ROUND
    end
  end
end

stop = Process.clock_gettime(Process::CLOCK_MONOTONIC) + (ARGV[0] || 60).to_f
parked = Thread.new { park_here(stop) }  # THREAD
rounds = Thread.new { Cycle.new.each_round(stop) }  # THREAD
$stdout.puts "ready #{Process.pid}"
$stdout.flush
parked.join  # JOIN
rounds.join
