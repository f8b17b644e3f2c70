"""Poly learning-rate schedule with optional linear warmup, a pure function of the step.

Computed on the host from its step counter: reading a device value would make the host wait for each step.
"""

from __future__ import annotations


def lr_at(step: int, base: float, num_steps: int, power: float = 0.9, warmup_steps: int = 0) -> float:
    """Learning rate of the update made at `step` (0-based), as a Python float.

    Warmup: base * (step + 1) / warmup_steps for step < warmup_steps. Then Keras' PolynomialDecay
    with end rate 0: base * (1 - min(step, num_steps) / num_steps) ** power.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base * (step + 1.0) / float(warmup_steps)
    frac = 1.0 - min(float(step), float(num_steps)) / float(num_steps)
    return base * frac ** power
