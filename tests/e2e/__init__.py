"""End-to-end tests: the four servers as real processes, crashed with SIGKILL."""
