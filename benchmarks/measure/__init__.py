"""The suite's measurements: step time, commit cost, joiner transfer, recovery (see benchmarks/suite.py)."""
