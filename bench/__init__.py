"""`make bench`: speed and overhead figures for ebpfprofiler (see bench/README.md)."""
