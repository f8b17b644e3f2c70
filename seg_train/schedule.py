"""Poly learning-rate schedule with optional linear warmup, a pure function of the step."""

from __future__ import annotations

import keras
import tensorflow as tf


def poly_lr(step, base: float, num_steps: int, power: float = 0.9, warmup_steps: int = 0):
    """Learning rate at `step` (0-based), as a float32 tensor.

    Warmup: base * (step + 1) / warmup_steps for step < warmup_steps. Then
    base * (1 - step / num_steps) ** power, through Keras' PolynomialDecay (end rate 0).
    """
    step = tf.cast(step, tf.float32)
    poly = keras.optimizers.schedules.PolynomialDecay(base, num_steps, end_learning_rate=0.0, power=power)(step)
    if warmup_steps > 0:
        warm = base * (step + 1.0) / float(warmup_steps)
        return tf.where(step < warmup_steps, warm, poly)
    return poly
