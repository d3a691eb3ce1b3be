"""The runtimes and Debian roots bench and the tests run their workloads under, each built once and cached.

Owns: fetching them (debootstrap roots, JDKs, .NET runtimes) into /var/cache/ebpfprofiler-test.
They live under bench because bench runs them too and bench never imports tests; the tests take
them from here (tests/assets.py prepares them all at once).

Must not: start a profiled process; the benchmarks and the tests that use an asset do.
"""
