"""All tf.distribute code: device selection, the strategy, and cross-tower arithmetic helpers.

Keras 3 under tf.distribute has two silent traps this module exists for (see the project notes):
`optimizer.apply_gradients` inside `strategy.run` already SUMs the towers' gradients, and
BatchNormalization moving statistics are per-tower variables (aggregation NONE) that drift apart
unless they are averaged by hand or the BN is synchronized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tensorflow as tf

from seg_train.config import ConfigError

log = logging.getLogger("seg_train")

MAX_LOGICAL_CPU_TOWERS = 64


@dataclass(frozen=True)
class Devices:
    names: list[str]
    kind: str  # "GPU" or "CPU"
    message: str


def setup_devices(num_towers: int) -> Devices:
    """Picks the devices for `num_towers` towers; must run before TensorFlow creates its context.

    With at least `num_towers` GPUs, GPUs 0..N-1. With none, the CPU is split into N logical devices
    (the way TensorFlow and Keras test their distribution code), so the same graph runs anywhere.
    With 1..N-1 GPUs it is an error: silently falling back to CPU towers would be a surprise.
    """
    if num_towers < 1:
        raise ConfigError("invalid --gpus", "--gpus", f"expected a positive number of towers, got {num_towers}")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < num_towers:
            raise ConfigError(
                "not enough GPUs", "--gpus", f"expected at most {len(gpus)} (GPUs visible), got {num_towers}")
        for g in gpus[:num_towers]:
            try:
                tf.config.experimental.set_memory_growth(g, True)
            except RuntimeError:  # already initialised (e.g. in tests); harmless
                pass
        names = [f"/device:GPU:{i}" for i in range(num_towers)]
        return Devices(names, "GPU", f"{num_towers} tower(s) on GPUs 0..{num_towers - 1}")
    if num_towers > MAX_LOGICAL_CPU_TOWERS:
        raise ConfigError("too many towers", "--gpus",
                          f"no GPU here; expected at most {MAX_LOGICAL_CPU_TOWERS} logical CPU towers, got {num_towers}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    existing = tf.config.get_logical_device_configuration(cpu)
    if existing is None or len(existing) < num_towers:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(max(num_towers, 1))])
        except RuntimeError:
            if existing is None and num_towers > 1:
                raise
    names = [f"/device:CPU:{i}" for i in range(num_towers)]
    return Devices(names, "CPU", f"no GPU found: {num_towers} tower(s) on logical CPU devices (the CPU split {num_towers} ways)")


def make_strategy(devices: Devices) -> tf.distribute.Strategy:
    """One MirroredStrategy over the chosen devices: one set of variables, one replica per tower.

    On logical CPU devices the reductions go through one device (ReductionToOneDevice) rather than
    collective ops: the towers share memory, so a copy-and-add is all a reduction needs, and
    collectives keep runtime state keyed by instance numbers that clash between two strategies in
    one process (seen here: "Shape mismatch in the collective instance" when a second 4-tower
    strategy ran after the first, as bench and the tests do). GPUs keep TensorFlow's default (NCCL).
    """
    if devices.kind == "CPU":
        return tf.distribute.MirroredStrategy(
            devices.names, cross_device_ops=tf.distribute.ReductionToOneDevice(reduce_to_device=devices.names[0]))
    return tf.distribute.MirroredStrategy(devices.names)


def all_reduce_sum(value):
    """Sum of `value` over the towers, from inside a replica function."""
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)


def batchnorm_layers(model) -> list:
    """Every BatchNormalization layer of `model`, nested models included."""
    import keras

    found, seen = [], set()

    def walk(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if isinstance(layer, keras.layers.BatchNormalization):
            found.append(layer)
        for child in getattr(layer, "layers", []) or []:
            walk(child)

    walk(model)
    return found


def average_bn_moving_stats(bn_layers) -> None:
    """Averages every BN layer's moving mean/variance across towers, from inside a replica function.

    Keras 3 keeps these as MirroredVariables with aggregation NONE: each tower assigns its own copy
    from its own batch statistics, and a checkpoint would save tower 0's. The mean of the towers'
    updated copies equals momentum * old + (1 - momentum) * mean(towers' batch statistics), i.e. the
    update a single device would make with the towers' statistics averaged. This is timm's
    `distribute_bn` done every step, in the graph.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return
    variables = []
    for layer in bn_layers:
        variables += [layer.moving_mean, layer.moving_variance]
    # One batched all-reduce for all statistics instead of one per variable.
    values = [tf.convert_to_tensor(v.value) for v in variables]
    means = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, values)
    for v, m in zip(variables, means):
        v.assign(m)
