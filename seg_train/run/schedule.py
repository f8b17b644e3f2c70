"""Poly learning-rate schedule with optional linear warmup (and EoMT's two-stage warmup: the head first, then the
backbone), a pure function of the step.

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


def lr_pair_at(step: int, base: float, num_steps: int, power: float = 0.9, warmup_steps: int = 0,
               backbone_warmup_steps: int = 0) -> tuple[float, float]:
    """(head, backbone) learning rates of the update made at `step` (0-based).

    Without train.backbone_warmup_steps both are lr_at's. With it, EoMT's two-stage warmup: the schedule of
    the reference's TwoStageWarmupPolySchedule (written from its formula, update `step` = its scheduler step),
    with w1 = warmup_steps and w2 = backbone_warmup_steps:
      head:     base * step / w1 for step < w1, then base * (1 - (step - w1) / (T - w1)) ** power;
      backbone: 0 for step < w1 (the head learns alone first), base * (step - w1) / w2 up to w1 + w2,
                then base * (1 - (step - w1 - w2) / (T - w1 - w2)) ** power.
    Each group's poly runs over the steps left after its own warmup, and the first update of each stage has
    learning rate 0 (Adam's moments still see its gradient), as in the reference.
    """
    if backbone_warmup_steps <= 0:
        rate = lr_at(step, base, num_steps, power, warmup_steps)
        return rate, rate
    w1, w2 = warmup_steps, backbone_warmup_steps

    def poly(done: int, length: int) -> float:
        frac = 1.0 - min(float(max(done, 0)), float(length)) / float(max(length, 1))
        return base * frac ** power

    head = base * step / w1 if w1 > 0 and step < w1 else poly(step - w1, num_steps - w1)
    if step < w1:
        backbone = 0.0
    elif step < w1 + w2:
        backbone = base * (step - w1) / w2
    else:
        backbone = poly(step - w1 - w2, num_steps - w1 - w2)
    return head, backbone
