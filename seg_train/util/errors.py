"""The user's one-line errors: ConfigError, and an exception's text made fit for that line. Imports
nothing of seg_train, so the config and the pure tables it reads can all raise it."""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """A user mistake in the config; `where` names the key or file, the message says what was expected."""

    def __init__(self, what: str, where: str, expected: str):
        self.what, self.where, self.expected = what, where, expected
        super().__init__(f"{what} ({where}): {expected}")


# A Python object's default repr, which some libraries paste into their messages (Pillow: "cannot identify
# image file <_io.BytesIO object at 0x7f...>" for bytes it was handed in memory): noise in a user's line.
_OBJECT_REPR = re.compile(r"\s*<[^<>\n]*\bat 0x[0-9a-fA-F]+>")


def without_reprs(text: str) -> str:
    """`text` without the Python object reprs in it."""
    return _OBJECT_REPR.sub("", text).strip()


def exception_text(e: BaseException) -> str:
    """What an exception says, for a user's one-line message: the first non-empty line of its message
    without Python object reprs, or its type's name when that leaves nothing."""
    for line in str(e).splitlines():
        line = without_reprs(line)
        if line:
            return line
    return type(e).__name__
