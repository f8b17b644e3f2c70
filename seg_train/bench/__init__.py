"""seg-bench: the benchmark runner on the trainer's own loop (runner.py), the FLOP count and device
peak (flops.py), the op-time profile (op_profile.py), the text report (report.py), and the tower check
of --verify-towers (verify.py)."""
