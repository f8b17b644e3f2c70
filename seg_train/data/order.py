"""The training stream's sample order: a pure function of (seed, sample counter k), nothing stateful.

Epoch k // n is a permutation seeded by (seed, epoch), and sample k its entry k % n (`index_of`), so a
resumed run continues exactly at k = step * global_batch. `train_order` deals one input pipeline its
rows of each step's global batch.
"""

from __future__ import annotations

import tensorflow as tf


def permutation(seed: int, n: int, epoch):
    """The order of the n samples in `epoch`: a permutation drawn from stateless RNG seeded by (seed, epoch)."""
    key = tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)])
    return tf.argsort(tf.random.stateless_uniform([n], seed=key))


def index_of(seed: int, n: int, k):
    """Global sample counter k -> sample index: permutation (k // n) at position k % n.

    The definition of the order. `sample_order` computes the same indices once per epoch, as an
    argsort of n values per sample grows with the data set.
    """
    return tf.gather(permutation(seed, n, k // n), k % n)


def sample_order(seed: int, n: int, first_k) -> tf.data.Dataset:
    """Sample indices for global counters first_k, first_k + 1, ...: index_of's, one argsort per epoch."""
    e0, pos0 = first_k // n, first_k % n
    head = tf.data.Dataset.from_tensor_slices(permutation(seed, n, e0)[pos0:])
    rest = tf.data.Dataset.range(e0 + 1, 2**62).flat_map(
        lambda e: tf.data.Dataset.from_tensor_slices(permutation(seed, n, e)))
    return head.concatenate(rest)


def pipeline_rows(global_batch: int, num_replicas: int, pipeline_id: int, num_pipelines: int,
                  micro_batches: int) -> list[int]:
    """One input pipeline's elements of a step, each as its counter's offset k - s*K*B from the step's first.

    Element t is local replica r, micro-batch m, row i, and holds offset m*B + first + r*b + i (first:
    the pipeline's first row; b: the per-tower batch), which does not depend on the step s.
    """
    b = global_batch // num_replicas
    r_local = num_replicas // num_pipelines
    per_replica = micro_batches * b
    per_step = r_local * per_replica
    first = pipeline_id * r_local * b
    own = []
    for t in range(per_step):
        r, q = t // per_replica, t % per_replica
        own.append((q // b) * global_batch + first + r * b + q % b)
    return own


def train_order(seed: int, n: int, global_batch: int, start_step: int = 0, num_replicas: int = 1,
                pipeline_id: int = 0, num_pipelines: int = 1, micro_batches: int = 1) -> tf.data.Dataset:
    """(global sample counter k, sample index) of each element of one input pipeline, in its order.

    Element t (step s, local replica r, micro-batch m, row i) holds k = (s*K + m)*B + first + r*b + i;
    as k - s*K*B does not depend on s, each step's rows are one fixed gather from that step's slice of the global order.
    """
    step_samples = micro_batches * global_batch
    own = tf.constant(pipeline_rows(global_batch, num_replicas, pipeline_id, num_pipelines, micro_batches),
                      tf.int64)
    indices = sample_order(seed, n, start_step * step_samples).batch(step_samples, drop_remainder=True)
    steps = tf.data.Dataset.range(start_step, 2**62)
    return tf.data.Dataset.zip(steps, indices).map(
        lambda s, v: (s * step_samples + own, tf.gather(v, own))).unbatch()
