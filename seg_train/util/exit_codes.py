"""Every exit code of seg-train's commands and scripts, in one place (README: "Resume, interruption, exit codes").

OK                0   done
INTERNAL          1   an unexpected error (the traceback is shown with --debug); also
                      `seg-bench --verify-towers` when the towers disagree (a verdict, not a user error)
USER_ERROR        2   bad config, data, flags or paths: one line `error: <what> (<where>): <expected>`
NONFINITE         3   training stopped on a non-finite loss, gradient or BN statistics (train.on_nan: stop)
PEER_FAILED       4   multi-worker training: another worker failed
signalled(signum) 128 + the signal's number: stopped by SIGINT / SIGTERM (checkpoint written)
"""

OK = 0
INTERNAL = 1
VERIFY_FAILED = 1
USER_ERROR = 2
NONFINITE = 3
PEER_FAILED = 4


def signalled(signum: int) -> int:
    """The exit code after a stop by signal `signum` (the shell's convention)."""
    return 128 + int(signum)
