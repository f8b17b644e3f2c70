"""Small pieces every room uses: exit codes (exit_codes.py), checks before TensorFlow starts
(preflight.py), the progress bar (progress.py), process facts such as peak memory (sysinfo.py)."""
