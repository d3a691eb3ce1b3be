"""The kernel matrix: Debian's kernels booted under qemu with a smoke suite of the agent (README.md here)."""
