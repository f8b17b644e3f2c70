"""seg-bench: the benchmark runner on the trainer's own loop (runner.py) and the tower check of
--verify-towers (verify.py)."""
