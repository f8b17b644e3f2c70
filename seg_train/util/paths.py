"""Output paths checked before a command writes anything (no TensorFlow here)."""

from __future__ import annotations

import os
from pathlib import Path

from seg_train.util.errors import ConfigError


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_creatable_dir(path: str | os.PathLike, what: str, hint: str) -> Path:
    """`path` (returned absolute) is a writable folder or can be created as one; nothing is created.
    `what` names it in the message ("run dir", ...), `hint` says what to do instead."""
    path = Path(os.path.abspath(path))
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{what} is a file", str(path), "a directory (or a path that does not exist yet)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{what} is not writable", str(path), f"a folder you can write to ({hint})")
        return path
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise ConfigError(f"{what} cannot be created", str(path), f"{base} is a file, not a folder ({hint})")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} cannot be created", str(path),
                          f"a location you can write to; {base} is not writable ({hint})")
    return path
