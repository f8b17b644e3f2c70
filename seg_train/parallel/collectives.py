"""In-graph cross-tower arithmetic: the all-reduces of the train step and of synchronized BN.

Everything here runs inside a replica function (`strategy.run`); the strategy itself is replicas.py's.

Why not the replica context's `all_reduce` as it is: it wraps SUM and MEAN in `tf.custom_gradient`,
whose graph-mode walk back from the result crosses into every other tower's graph under
MirroredStrategy, making tracing with synchronized BN impractically slow. Nothing here is
differentiated through (synchronized BN writes its gradient out), so `all_reduce_sum` calls the
strategy's reduction directly.
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

    One call is one batched reduction, though the strategy may still reduce tensor by tensor: pack
    first (`pack_layout`, `pack`) to avoid that.
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
        # MultiWorkerMirroredStrategy: collectives link towers through the runtime, not graph edges,
        # so the public API's custom_gradient walk stays inside this tower.
        return list(ctx.all_reduce(tf.distribute.ReduceOp.SUM, values))


def pack_layout(shapes: list, pack_bytes: int):
    """How float32 tensors of these shapes are grouped into flat packs of at most `pack_bytes`.

    Consecutive tensors share a pack up to the bound; a larger tensor gets its own (never split).
    Returns None for `pack_bytes` 0 (no packing), else a list of packs, each a list of (index, shape).
    Why: strategies that reduce tensor by tensor (ReductionToOneDevice) pay a fixed cost per tensor,
    and a model has hundreds of mostly tiny gradients.
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

    Summed over the towers: an all-gather that rides in the gradients' all-reduce.
    """
    values = tf.reshape(tf.cast(values, tf.float32), [1, -1])
    mask = tf.reshape(tf.one_hot(index, size, dtype=tf.float32), [size, 1])
    return tf.reshape(mask * values, [-1])
