"""Progress bars: the one way every command draws one (tqdm on stderr, only on a terminal)."""

from __future__ import annotations

import sys


def shown(enabled: bool = True) -> bool:
    """Whether a bar would be drawn: asked for, and stderr is a terminal (never in logs or CI)."""
    return bool(enabled) and sys.stderr.isatty()


def progress_bar(total: int, desc: str | None = None, unit: str = "img", initial: int = 0, leave: bool = False,
                 enabled: bool = True):
    """A tqdm bar on stderr, disabled unless `shown(enabled)`; log lines go through tqdm.write while it
    is on screen, so they don't tear it."""
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr,
                leave=leave, disable=not shown(enabled))
