"""Recompute instead of store (train.recompute: blocks): a transformer block's forward run again in the backward
pass, so that only its input is kept between the two passes, not the dozen activations inside it.

Written by hand rather than with tf.recompute_grad (or keras.RematScope, which maps to it), which differentiates
with respect to the function's arguments and the tf.Variables read inside it only. The train step calls the model
statelessly (keras.StatelessScope maps every variable to a tensor of the step), so the weights a block reads are
tensors captured from outside it, and tf.recompute_grad gives them no gradient: here the block's weight values are
arguments, mapped back onto its variables by a StatelessScope of its own, in the forward pass and in the
recomputation alike.

The recomputation starts from its input plus a zero that depends on the incoming gradient (tf.recompute_grad's
device for the same purpose): without that data dependence TensorFlow may run it as soon as its input exists,
during the forward pass, and Grappler's common-subexpression elimination may merge it with the forward's
identical ops; either way everything would be kept again. x + 0.0 is x to the bit (-0.0 aside, which becomes
+0.0). Nothing random is drawn anew: the drop-path layers (models/stochastic.py) draw from the step's sample
counters, re-entered here, and EoMT's attention masks are drawn outside the block and passed in.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

# keras.StatelessScope's mapping and the layers' autocasting are read through Keras' backend: no public name
# gives a variable's mapped value uncast (under mixed precision `variable.value` is the float16 copy).
from keras.src.backend import AutocastScope, get_autocast_scope

from seg_train.models import stochastic

# train.recompute's values: none (every activation stored for the backward pass) or blocks.
MODES = ("none", "blocks")


def after(x, dy):
    """x to the bit (-0.0 aside), computed only once `dy` exists (module doc): the start of a recomputation in a
    gradient function, which must neither run during the forward pass nor merge with the forward's ops."""
    first = tf.reshape(dy, [-1])[:1]
    ready = tf.reduce_max(first)
    zero = tf.where(tf.equal(ready, ready), tf.zeros([], dy.dtype), tf.constant(float("nan"), dy.dtype))
    return x + tf.cast(zero, x.dtype)


def recompute(fn, x, layers):
    """fn(x) -> y with fn's activations recomputed in the backward pass instead of stored; the gradient is the
    stored version's. `fn` may call only `layers` (their variables get gradients, through their values in the
    enclosing StatelessScope if any) and read tensors it closes over, which get no gradient (rotary tables, EoMT's
    boolean attention masks)."""
    variables = list({id(v): v for layer in layers for v in layer.weights}.values())
    with AutocastScope(None):
        values = [tf.convert_to_tensor(v.value) for v in variables]
    keys = stochastic.active()
    autocast = get_autocast_scope()
    dtype = None if autocast is None else autocast.dtype

    def run(x, values):
        draws = contextlib.nullcontext() if keys is None else stochastic.per_sample(*keys)
        with keras.StatelessScope(list(zip(variables, values)), initialize_variables=False), \
                AutocastScope(dtype), draws:
            return fn(x)

    @tf.custom_gradient
    def block(x, *values):
        def grad(dy):
            again = after(x, dy)
            with tf.GradientTape() as tape:
                tape.watch([again, *values])
                y = run(again, values)
            return tape.gradient(y, [again, *values], output_gradients=dy,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)

        return run(x, values), grad

    return block(x, *values)
