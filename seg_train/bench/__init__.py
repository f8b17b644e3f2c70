"""seg-bench: the phases of the benchmark (runner.py), the trainer's own loop timed (train_runner.py), the
input pipeline alone (input.py), seg-train in a fresh process (probes.py), the FLOP count and device
peak (flops.py), the op-time profile (op_profile.py), the text report (report.py), and the tower check
of --verify-towers (verify.py)."""
