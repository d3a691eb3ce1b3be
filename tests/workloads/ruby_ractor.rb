# A Ruby workload with a second ractor, for the runtime reader's tests (Ruby 3.3 and newer).
#
# Ractor.new runs Crunch.in_ractor (a class method) in a second ractor, busy in its loop,
# while the main ractor's thread waits for it. Ractor is experimental in 3.3 and 3.4:
# its warning is turned off.
# It prints "ready PID" and runs until SECONDS (argv[0]) pass.

Warning[:experimental] = false

class Crunch
  def self.in_ractor(stop)
    i = 0
    while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop  # CRUNCH
      i += 1                                                      # CRUNCH
    end
    i
  end
end

stop = Process.clock_gettime(Process::CLOCK_MONOTONIC) + (ARGV[0] || 60).to_f
ractor = Ractor.new(stop) { |s| Crunch.in_ractor(s) }  # RACTOR
$stdout.puts "ready #{Process.pid}"
$stdout.flush
# Ractor#take is Ractor#value from 4.0.
ractor.respond_to?(:value) ? ractor.value : ractor.take  # TAKE
