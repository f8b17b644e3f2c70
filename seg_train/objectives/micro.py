"""What an objective returns for one micro-batch (objectives/__init__.py describes the interface)."""

from __future__ import annotations

from typing import Callable, NamedTuple


class Micro(NamedTuple):
    """One micro-batch's share of the objective (module doc)."""
    loss_sum: object
    normalizer: object
    new_state: list
    predict: Callable
