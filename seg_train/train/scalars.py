"""The few scalars each tower sends along with its gradients in the step's one all-reduce (step.py, update.py).

Each tower packs its `TowerScalars` into its own one-hot block (collectives.one_hot_row), so the sum over
towers is an all-gather riding in the gradients' all-reduce. The field order is the packing order.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from seg_train.parallel import collectives


class TowerScalars(NamedTuple):
    """One tower's scalars (float32), or after `unpack` each field's [towers] column."""
    loss_sum: tf.Tensor  # the tower's loss sum over its micro-batches
    normalizer: tf.Tensor  # its normaliser (valid pixels, or the kept pixels' weights)
    grad_sq: tf.Tensor  # the squared norm of its gradient sum
    finite: tf.Tensor  # 1.0 when its loss and gradient are finite
    bn_finite: tf.Tensor  # 1.0 when its new BN statistics are finite
    stop: tf.Tensor  # 1.0 when its process asks the group to stop after this step (a signal)

    @staticmethod
    def size(num_towers: int) -> int:
        """Length of the packed vector of `num_towers` towers."""
        return num_towers * len(TowerScalars._fields)

    def pack(self, tower_index, num_towers: int) -> tf.Tensor:
        """This tower's values in block `tower_index` of a [size(num_towers)] vector, zeros elsewhere."""
        return collectives.one_hot_row(tf.stack(list(self)), tower_index, num_towers)

    @staticmethod
    def table(packed, num_towers: int) -> tf.Tensor:
        """The reduced packed vector as a [towers, fields] table (row i: tower i's values)."""
        return tf.reshape(packed, [num_towers, len(TowerScalars._fields)])

    @classmethod
    def unpack(cls, table) -> "TowerScalars":
        """A [towers, fields] table (`table`) -> each field's [towers] column."""
        return cls(*tf.unstack(table, num=len(cls._fields), axis=1))
