"""Dropout and stochastic depth drawn per SAMPLE from (seed, global sample counter, layer), not per call.

Each row's global sample counter k (ImageReader.train_order's) is held in `per_sample` while the train
step traces the model; a layer draws row i's mask from the stateless RNG seeded by (k, a hash of the
seed and the layer's name). So masks do not depend on the tower or worker count, and a resumed run draws
what the uninterrupted one drew, with nothing in the checkpoint. keras.layers.Dropout draws per CALL
from a SeedGenerator, so its masks depend on the towers and on the calls before.

Outside `per_sample` and when `training` is false the layers are the identity: inference is
deterministic, and precise BN estimates the statistics of the network inference runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading

import keras
import tensorflow as tf
from keras import layers

# Per thread: with synchronized BN each tower traces its pass in its own thread.
_local = threading.local()


@contextlib.contextmanager
def per_sample(sample_ids, seed: int):
    """While a training-mode pass is traced inside this block, the stochastic layers draw row i's mask from
    (seed, sample_ids[i], layer name). `sample_ids`: int64 [rows], its length static."""
    previous = getattr(_local, "keys", None)
    _local.keys = (tf.cast(sample_ids, tf.int64), int(seed))
    try:
        yield
    finally:
        _local.keys = previous


def active():
    """(sample_ids, seed) of the enclosing `per_sample`, or None: what a recomputation in the backward pass
    (models/recompute.py), traced after the block has closed, enters again to draw the same masks."""
    return getattr(_local, "keys", None)


def sample_ids(step, micro, tower, rows: int, towers: int, micro_batches: int):
    """The global sample counter of each row of one micro-batch on one tower: int64 [rows].

    k = (step * K + micro) * B + tower * rows + i with B = towers * rows (the tower index counts every
    worker's towers).
    """
    step, micro, tower = (tf.cast(x, tf.int64) for x in (step, micro, tower))
    first = (step * micro_batches + micro) * (towers * rows) + tower * rows
    return first + tf.range(rows, dtype=tf.int64)


def salt(seed: int, name: str) -> int:
    """A 63-bit number for (run seed, layer name): the second half of every stateless seed the layer uses."""
    digest = hashlib.sha256(f"seg_train/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def per_row(fn, seeds, shape):
    """fn(seed [2]) for each row of seeds [b, 2], stacked: float32 [b, *shape] (int32 [b, 2] with shape None).
    A static batch (the train step's) is unrolled, one call per row; an unknown one goes through tf.map_fn."""
    seeds = tf.cast(tf.convert_to_tensor(seeds), tf.int32)
    if seeds.shape[0] is not None:
        return tf.stack([fn(s) for s in tf.unstack(seeds)])
    spec = tf.TensorSpec([2], tf.int32) if shape is None else \
        tf.TensorSpec([d if isinstance(d, int) else None for d in shape], tf.float32)
    return tf.map_fn(fn, seeds, fn_output_signature=spec)


def uniform(shape, seed) -> tf.Tensor:
    """float32 U[0, 1) of `shape` from a stateless seed [2]: TensorFlow's own Philox draw (the device's
    automatic choice on CPUs and GPUs), the same inside an XLA cluster (train.jit_compile).

    Written out because XLA's lowering of tf.random.stateless_uniform gives other floats than TensorFlow's
    kernels from the same seed: its automatic algorithm is not Philox, and even with alg="philox" it turns the
    same 32 random bits into a float its own way. The bits agree, so the float is made here as TensorFlow's
    kernels make it: the low 23 bits as the mantissa of a float in [1, 2), minus 1.
    """
    bits = tf.random.stateless_uniform(shape, seed, minval=None, maxval=None, dtype=tf.uint32, alg="philox")
    one_to_two = tf.bitwise.bitwise_or(tf.bitwise.bitwise_and(bits, 0x7FFFFF), 0x3F800000)
    return tf.bitcast(one_to_two, tf.float32) - 1.0


def _row_uniform(row_shape, name: str):
    """U[0, 1) of shape [rows, *row_shape], row i drawn from (sample_ids[i], salt(seed, name)); None outside
    `per_sample`."""
    keys = getattr(_local, "keys", None)
    if keys is None:
        return None
    ids, seed = keys
    salted = tf.constant(salt(seed, name), tf.int64)
    return tf.stack([uniform(row_shape, tf.stack([k, salted])) for k in tf.unstack(ids)])


def _kept(x, rate: float, row_shape, name: str):
    """x * mask / (1 - rate), mask drawn per row by `_row_uniform` (1 with probability 1 - rate); None
    outside `per_sample`."""
    u = _row_uniform(row_shape, name)
    if u is None:
        return None
    keep = 1.0 - rate
    # The rescaling keeps every activation's expectation what inference (no mask) computes.
    scale = tf.cast(u < keep, tf.float32) / keep
    return x * tf.cast(scale, x.dtype)


class _PerSampleDrop(layers.Layer):
    """What DropPath and ChannelDropout share: in training, a mask per sample (the rows of `_row_shape`),
    kept entries scaled by 1 / (1 - rate); the identity at inference or rate 0."""

    def __init__(self, rate: float, **kwargs):
        super().__init__(**kwargs)
        self.rate = float(rate)

    def _row_shape(self, x) -> list:
        raise NotImplementedError

    def call(self, x, training=None):
        if not training or not self.rate:
            return x
        out = _kept(x, self.rate, self._row_shape(x), self.name)
        return x if out is None else out

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "rate": self.rate}


@keras.saving.register_keras_serializable(package="seg_train")
class DropPath(_PerSampleDrop):
    """Stochastic depth (Huang et al. 2016; timm's DropPath): in training, each sample's residual branch is
    dropped with probability `rate`, kept ones scaled by 1 / (1 - rate). Drawn per sample (module doc)."""

    def _row_shape(self, x) -> list:
        return [1] * (len(x.shape) - 1)


@keras.saving.register_keras_serializable(package="seg_train")
class ChannelDropout(_PerSampleDrop):
    """Dropout of whole channels (PyTorch's Dropout2d): in training, each (sample, channel) of an NHWC map
    is zeroed with probability `rate`, kept ones scaled by 1 / (1 - rate). Drawn per sample (module doc)."""

    def _row_shape(self, x) -> list:
        return [1, 1, x.shape[-1]]
