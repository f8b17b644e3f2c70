"""Small pieces every room uses: the user's one-line error (errors.py), exit codes (exit_codes.py), output folders
checked before anything is written (paths.py), the progress bar (progress.py), process facts such as peak memory
(sysinfo.py)."""
