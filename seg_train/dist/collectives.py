"""In-graph cross-tower arithmetic: the all-reduces of the train step and of synchronized BN.

Everything here runs inside a replica function (`strategy.run`). Device selection and the strategy
itself live in replicas.py.

Why not `tf.distribute.get_replica_context().all_reduce` as it is: for SUM and MEAN it wraps the
reduction in `tf.custom_gradient` so that it can be differentiated, and in graph mode
`custom_gradient` walks the graph backwards from the result to find the variables involved. Under
MirroredStrategy the reduction's result depends on every tower's input, so each walk crosses into
the other towers' graphs: with ~60 synchronized BN layers x 3 all-reduces x 4 towers, tracing
the step took longer than 17 minutes. Nothing here is differentiated through (synchronized BN
writes its gradient out, models/sync_bn.py), so `all_reduce_sum` calls the strategy's reduction
directly and no walk happens.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def num_replicas() -> int:
    """Towers in sync (1 outside a strategy)."""
    ctx = tf.distribute.get_replica_context()
    return 1 if ctx is None else ctx.num_replicas_in_sync


def replica_id():
    """This tower's index in the whole group (all workers), as an int32 tensor (0 outside a strategy)."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        return tf.constant(0)
    rid = ctx.replica_id_in_sync_group
    return tf.convert_to_tensor(rid, tf.int32)


def all_reduce_sum(values: list):
    """SUM of each tensor in `values` over all towers, from inside a replica function; no gradient.

    Returns a list of the same length. One call is one batched reduction (the strategy may still
    reduce tensor by tensor: pack first (`pack_layout`, `pack`) to avoid that; the train step does).
    """
    values = list(values)
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1 or not values:
        return values
    # One name scope for everything that crosses the towers: seg-bench's profile adds it up.
    with tf.name_scope("cross_tower"):
        values = [tf.stop_gradient(v) for v in values]
        if ctx.strategy.extended._use_merge_call():  # MirroredStrategy: reduce in cross-replica context
            def merge_fn(distribution, *per_replica):
                return distribution.extended.batch_reduce_to(
                    tf.distribute.ReduceOp.SUM, [(v, v) for v in per_replica])

            return list(ctx.merge_call(merge_fn, args=tuple(values)))
        # MultiWorkerMirroredStrategy: collective ops in replica context. Their results depend on the
        # other towers only through the collective runtime, not through graph edges, so the
        # custom_gradient walk of the public API stays inside this tower.
        return list(ctx.all_reduce(tf.distribute.ReduceOp.SUM, values))


def pack_layout(shapes: list, pack_bytes: int):
    """How float32 tensors of these shapes are grouped into flat packs of at most `pack_bytes`.

    Consecutive tensors share a pack until it would exceed the bound; a tensor larger than the
    bound gets a pack of its own (tensors are never split). Returns None for `pack_bytes` 0 (no
    packing: one tensor per all-reduce), else a list of packs, each a list of (index, shape).

    Why pack: strategies that reduce tensor by tensor (ReductionToOneDevice, the logical-CPU default)
    pay a fixed cost per tensor, and a MobileNetV2 DeepLabV3+ has ~260 gradients, most of them tiny
    (tf_cnn_benchmarks' `agg_small_grads_max_bytes` idea, with one size bound).
    """
    if pack_bytes <= 0:
        return None
    groups, current, size = [], [], 0
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape)) * 4
        if current and size + n > pack_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((i, tuple(shape)))
        size += n
    if current:
        groups.append(current)
    return groups


def pack_sizes(shapes: list, layout) -> list:
    """The shape of each pack (for function signatures)."""
    if layout is None:
        return [list(s) for s in shapes]
    return [[sum(int(np.prod(s)) for _, s in group)] for group in layout]


def pack(tensors: list, layout) -> list:
    """Flattens `tensors` into the packs of `layout` (see pack_layout)."""
    if layout is None:
        return list(tensors)
    return [tf.concat([tf.reshape(tensors[i], [-1]) for i, _ in group], axis=0) if len(group) > 1
            else tf.reshape(tensors[group[0][0]], [-1]) for group in layout]


def unpack(packs: list, layout) -> list:
    """The inverse of `pack`: the tensors in their original order and shapes."""
    if layout is None:
        return list(packs)
    out = {}
    for p, group in zip(packs, layout):
        parts = tf.split(p, [int(np.prod(s)) for _, s in group]) if len(group) > 1 else [p]
        for (i, shape), part in zip(group, parts):
            out[i] = tf.reshape(part, shape)
    return [out[i] for i in range(len(out))]


def one_hot_row(values, index, size: int):
    """A [size * k] vector with `values` (k floats) at block `index`, zeros elsewhere.

    Summed over the towers, each tower's block lands in its own slot: an all-gather of a few
    scalars per tower that rides in the same all-reduce as the gradients.
    """
    values = tf.reshape(tf.cast(values, tf.float32), [1, -1])
    mask = tf.reshape(tf.one_hot(index, size, dtype=tf.float32), [size, 1])
    return tf.reshape(mask * values, [-1])
