"""Benchmarks (``make bench``): sa-fence next to its peers.  Not tests: pytest
does not collect them (no ``test_`` modules here); ``tests/cli/test_bench_smoke.py``
runs them with tiny counts.  Entry point: ``python -m tests.benchmarks``."""
