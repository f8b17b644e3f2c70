"""seg-prepare's converters (voc.py, camvid.py, folder.py, tfrecords.py) and what the first three share.

voc, camvid and folder convert a data set into the VOC layout seg-train reads. A problem with the input is a
`PrepError`, reported as one line `error: <what> (<where>): <expected>` on stderr with exit code 2,
the same form as seg-train's own user errors; `run_main` is that boundary. Standard library only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from seg_train.util.exit_codes import USER_ERROR as EXIT_INPUT_ERROR


class PrepError(Exception):
    """A problem with the input: reported as `error: <what> (<where>): <expected>`."""

    def __init__(self, what: str, where: object, expected: str):
        super().__init__(f"error: {what} ({where}): {expected}")


def run_main(prepare: Callable[[], str]) -> int:
    """Runs a converter's work and returns its exit code.

    Args:
      prepare: does the work and returns the summary line, printed on stdout.
    Returns:
      0, or EXIT_INPUT_ERROR after printing a PrepError's one line on stderr (no traceback).
    """
    try:
        summary = prepare()
    except PrepError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INPUT_ERROR
    print(summary)
    return 0


def wrote(out: object, counts: Mapping[str, int]) -> str:
    """The summary line `wrote OUT (train: 1464, val: 1449)`."""
    return f"wrote {out} ({', '.join(f'{name}: {n}' for name, n in counts.items())})"
