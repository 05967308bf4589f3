"""What the tests and the benchmarks both use, and neither owns: PostgreSQL servers of their own, a
vLLM-style stand-in model, NeMo Gym's installation, the stateful machines and the queries that check
their invariants. benchmarks/ imports these, never tests/. (The in-process four-server stack and the
environment conformance suite are installed, for plugins too: apps.stack, apps.conformance.)"""
