"""The dynamic loss scale of train.precision mixed_float16: its variables, its update rule and the host's
verdict on a skipped step (bfloat16 has float32's range and needs no scale).

An overflowed step is skipped and the scale halved (never below the floor, where a non-finite gradient
is a real non-finite step: `is_overflow`); it doubles after GROWTH_INTERVAL applied steps (Keras' rule).
"""

from __future__ import annotations

import tensorflow as tf

LOSS_SCALE_INITIAL, LOSS_SCALE_FLOOR = 2.0 ** 15, 1.0
GROWTH_INTERVAL = 2000  # applied steps in a row before the scale doubles


class LossScale:
    """The scale (`scale`) and its count of applied steps (`good_steps`), built inside `strategy.scope()`.
    `enabled`: train.precision is mixed_float16; otherwise the scale stays 1.0 and is not saved.
    """

    def __init__(self, enabled: bool, aggregation):
        self.enabled = enabled
        self.scale = tf.Variable(LOSS_SCALE_INITIAL if enabled else 1.0, trainable=False, name="loss_scale",
                                 aggregation=aggregation)
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps", aggregation=aggregation)

    def checkpoint_objects(self) -> dict:
        """The checkpoint objects it is saved as (top-level `loss_scale` and `good_steps`; none when disabled)."""
        return {"loss_scale": self.scale, "good_steps": self.good_steps} if self.enabled else {}

    def update(self, applied) -> None:
        """After a step (cross-replica context): grow after GROWTH_INTERVAL applied steps, halve on a skipped one."""
        if not self.enabled:
            return
        scale, good = self.scale, self.good_steps

        def grow():
            good.assign_add(1)
            done = good >= GROWTH_INTERVAL
            scale.assign(tf.where(done, scale * 2.0, scale))
            good.assign(tf.where(done, tf.constant(0, tf.int64), good))
            return tf.constant(0)

        def shrink():
            scale.assign(tf.maximum(scale / 2.0, LOSS_SCALE_FLOOR))
            good.assign(0)
            return tf.constant(0)

        tf.cond(applied, grow, shrink)


def is_overflow(enabled: bool, loss_finite: bool, scale_used: float, bn_finite) -> bool:
    """Whether a skipped step was a float16 overflow (skipped by design, the scale halved), not a non-finite step.

    An overflow has a finite loss, a scale above the floor (where halving cures nothing) and finite BN
    statistics (float32, unscaled). `scale_used`: the step's scale; `bn_finite`: per tower.
    """
    return enabled and loss_finite and scale_used > LOSS_SCALE_FLOOR \
        and all(bn_finite)
