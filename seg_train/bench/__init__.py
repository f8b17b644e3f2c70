"""seg-bench: the benchmark's phases (runner.py) and its measurements, one module each; --verify-towers (verify.py)."""
