"""train.jit_compile with EoMT: the random draws the compiled forward makes (drop path, the masked attention's keeps)
equal to TensorFlow's own kernels' (models/stochastic.py). The step itself, its forward and gradient XLA-compiled
and the matcher and the loss not (objectives/mask_classification.py says why), is held to the non-compiled step in
tests/test_eomt_train.py, which shares the plain step's run with its other tests.

Wrong answers these fail for: a draw inside the XLA cluster made by XLA's lowering of tf.random.stateless_uniform
(other floats from the same seed: other drop-path and mask draws, another loss).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from seg_train.models import stochastic
from seg_train.models.eomt.eomt import mask_keeps


@pytest.mark.slow  # three XLA compilations: seconds
def test_uniform_is_tensorflows_draw_also_under_xla():
    """stochastic.uniform equals tf.random.stateless_uniform run by TensorFlow's CPU kernel (its automatic algorithm,
    what the layers drew before) bit for bit, outside and inside an XLA-compiled function, for int32 and int64
    seeds; so do EoMT's mask keeps. Fails for: the float made by XLA's lowering (the same seed's draw under
    jit_compile differs in most entries), or another algorithm than TensorFlow's Philox."""
    rng = np.random.default_rng(53)
    for dtype in (tf.int32, tf.int64):
        seeds = tf.constant(rng.integers(-2 ** 31, 2 ** 31, (6, 2)), dtype)
        want = tf.stack([tf.random.stateless_uniform([5, 3], s) for s in tf.unstack(seeds)]).numpy()
        draw = lambda s: tf.stack([stochastic.uniform([5, 3], x) for x in tf.unstack(s)])  # noqa: E731
        np.testing.assert_array_equal(tf.function(draw)(seeds).numpy(), want)
        np.testing.assert_array_equal(tf.function(draw, jit_compile=True)(seeds).numpy(), want)
    seeds = tf.constant(rng.integers(0, 2 ** 31, (3, 2)), tf.int32)
    keeps = lambda s: mask_keeps(s, 1, 0.5, 40)  # noqa: E731
    np.testing.assert_array_equal(tf.function(keeps, jit_compile=True)(seeds).numpy(), keeps(seeds).numpy())
