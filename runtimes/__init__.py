"""Runtime readers: stacks of interpreted runtimes read from process memory (CAP_SYS_PTRACE only)."""
