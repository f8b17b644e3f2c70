"""A process-wide on/off flag for model building (e.g. "build with plain Keras layers")."""

from __future__ import annotations

import contextlib


class Switch:
    """Off by default; `with switch():` turns it on for the block (nestable, restored on exit)."""

    def __init__(self):
        self.on = False

    @contextlib.contextmanager
    def __call__(self):
        before, self.on = self.on, True
        try:
            yield
        finally:
            self.on = before
