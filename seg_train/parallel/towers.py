"""Trace the tower pass once for every tower: the one implementation, used by the train step (step.py),
evaluation (infer/evaluate.py) and precise BN (infer/precise_bn.py).

Why: MirroredStrategy traces a replica function once per tower, so the graph would hold N copies of
the network to optimise. Instead the pass is a tf.function of (variable handles, inputs), traced ONCE
in cross-replica context and called by every tower with its own handles (`_noinline`: optimised once).
The exception: training-mode synchronized BN on several towers all-reduces inside the pass, which
needs the calling tower's replica context, so it is traced per tower inside strategy.run.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def read_handle(handle, like):
    """A variable's value from its resource handle (inside a function traced once for every tower)."""
    value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=like.dtype)
    value.set_shape(like.shape)
    return value


def handles(variables) -> list:
    """The resource handles of (Keras) variables on the calling tower (replica context)."""
    return [(v.value if isinstance(v, keras.Variable) else v).handle for v in variables]


def values(variables) -> list:
    """The calling tower's values of (Keras) variables, as tensors (replica context)."""
    return [tf.convert_to_tensor(v.value) for v in variables]


def per_tower_trace(sync_batchnorm: bool, num_replicas: int) -> bool:
    """Whether a training-mode pass must be traced per tower: synchronized BN across towers (module doc)."""
    return bool(sync_batchnorm) and num_replicas > 1


def shared(python_function, jit_compile=None):
    """`python_function` as a tf.function that every tower calls from one trace, not inlined (module doc).

    Call it with the calling tower's resource handles (`handles`), never with variables captured
    by the trace: a captured variable would be the first tower's on every tower.
    """
    return tf.function(python_function, jit_compile=jit_compile, autograph=False,
                       experimental_attributes={"_noinline": True})


class TowerPass:
    """`body(trainable_values, non_trainable_values, *inputs)` as the function every tower calls.

    Call `trace` in cross-replica context (inside the outer tf.function, before strategy.run), not
    inside a tower's thread; a second `trace` with the same specs is a cache lookup.

    `variables`, `non_trainable`: in the order `body` takes their values; `per_tower`: trace `body`
    in each tower instead (`per_tower_trace`).
    """

    def __init__(self, body, variables, non_trainable, per_tower: bool = False, jit_compile=None):
        self.body = body
        self.variables, self.non_trainable = list(variables), list(non_trainable)
        self.per_tower = per_tower
        self._function = shared(self._from_handles, jit_compile=jit_compile)

    def _from_handles(self, var_handles, state_handles, *inputs):
        tv = [read_handle(h, v) for h, v in zip(var_handles, self.variables)]
        st = [read_handle(h, v) for h, v in zip(state_handles, self.non_trainable)]
        return self.body(tv, st, *inputs)

    def trace(self, *input_specs):
        """f(*inputs) for use inside strategy.run: `body` on the calling tower's variables.

        `input_specs`: a tf.TensorSpec (or nest) per input of `body` after the values.
        """
        if self.per_tower:
            return lambda *inputs: self.body(values(self.variables), values(self.non_trainable), *inputs)
        res = tf.TensorSpec([], tf.resource)
        concrete = self._function.get_concrete_function(
            [res] * len(self.variables), [res] * len(self.non_trainable), *input_specs)
        return lambda *inputs: concrete(handles(self.variables), handles(self.non_trainable), *inputs)
