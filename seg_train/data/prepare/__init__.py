"""seg-prepare's converters (voc.py, camvid.py, folder.py, tfrecords.py) and what the first three share.

A problem with the input is a `PrepError`, reported by `run_main` as one line
`error: <what> (<where>): <expected>` on stderr, like seg-train's user errors. Standard library only.
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
    """Runs `prepare` (which returns the summary line for stdout); returns 0, or EXIT_INPUT_ERROR after
    printing a PrepError's one line on stderr."""
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
