"""The learning-rate schedule against Keras' PolynomialDecay and a warmup computed by hand.

Fails for: the poly decay evaluated at step + 1 (every rate one step late), the power ignored, the
end rate not 0, a warmup that starts at 0 instead of base / warmup_steps (a wasted first update) or
ends one step early or late, and the decay restarted after the warmup (step - warmup_steps).
"""

import keras
import numpy as np
import pytest

from seg_train.run.schedule import lr_at


@pytest.mark.parametrize("power", [0.9, 1.0, 0.0])
def test_poly_decay_equals_keras_polynomial_decay(power):
    base, num_steps = 3e-3, 50
    keras_schedule = keras.optimizers.schedules.PolynomialDecay(base, num_steps, end_learning_rate=0.0, power=power)
    for step in [0, 1, 2, 17, 48, 49, 50, 60]:
        np.testing.assert_allclose(lr_at(step, base, num_steps, power), float(keras_schedule(step)), rtol=1e-6,
                                   err_msg=f"step {step}")


def test_warmup_by_hand_then_the_same_poly_decay():
    base, num_steps, warmup = 0.01, 100, 4
    # Update k (0-based) during the warmup uses base * (k + 1) / warmup: the first update is not wasted
    # and the last warmup update reaches the base rate.
    assert [lr_at(k, base, num_steps, 0.9, warmup) for k in range(4)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    # From then on, the poly decay of the step itself (not restarted at the end of the warmup).
    for step in (4, 5, 50, 99):
        assert lr_at(step, base, num_steps, 0.9, warmup) == pytest.approx(base * (1 - step / num_steps) ** 0.9)
    assert lr_at(100, base, num_steps, 0.9, warmup) == 0.0
