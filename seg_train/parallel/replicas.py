"""Devices and strategies: which devices the towers run on, the tf.distribute strategy (one machine,
or several through TF_CONFIG), and which process is the chief.
"""

from __future__ import annotations

import json
import logging
import os
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

    With at least `num_towers` GPUs, GPUs 0..N-1; with none, N logical CPU devices, so the same graph
    runs anywhere; with 1..N-1 GPUs an error rather than a silent fall-back to CPU towers.
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
                          f"no GPU here; expected at most {MAX_LOGICAL_CPU_TOWERS} logical CPU towers, "
                          f"got {num_towers}")
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
    return Devices(names, "CPU",
                   f"no GPU found: {num_towers} tower(s) on logical CPU devices (the CPU split {num_towers} ways)")


def strategy_for(train_cfg, devices: Devices, towers: int | None = None) -> tf.distribute.Strategy:
    """THE strategy of a run on one machine: the first `towers` of `devices` (default: all), with the
    config's all-reduce (train.allreduce, train.allreduce_num_packs). seg-train, seg-eval,
    seg-predict, seg-export, seg-bench and --verify-towers all build theirs here."""
    if towers is not None:
        devices = Devices(devices.names[:towers], devices.kind, devices.message)
    return make_strategy(devices, train_cfg.allreduce, train_cfg.allreduce_num_packs)


def make_strategy(devices: Devices, allreduce: str = "auto", num_packs: int = 1) -> tf.distribute.Strategy:
    """One MirroredStrategy over the chosen devices: one set of variables, one replica per tower.

    `allreduce` picks TensorFlow's cross-device implementation; `auto` is NCCL on GPUs and
    ReductionToOneDevice on logical CPU devices: they share memory, and collectives' instance keys
    clash between two strategies in one process (as bench and the tests build).
    """
    if allreduce == "ring":
        raise ConfigError("invalid combination", "train.allreduce",
                          "ring is a cross-machine collective; on one machine use auto, nccl, hierarchical_copy "
                          "or reduction_to_one_device (or pass --workers)")
    if allreduce in ("nccl", "hierarchical_copy") and devices.kind != "GPU":
        raise ConfigError("invalid combination", "train.allreduce",
                          f"{allreduce} needs GPUs; on CPU towers use auto or reduction_to_one_device")
    if num_packs != 1 and allreduce not in ("nccl", "hierarchical_copy"):
        raise ConfigError("invalid combination", "train.allreduce_num_packs",
                          "1 unless train.allreduce is nccl or hierarchical_copy")
    if allreduce == "nccl":
        ops = tf.distribute.NcclAllReduce(num_packs=num_packs)
    elif allreduce == "hierarchical_copy":
        ops = tf.distribute.HierarchicalCopyAllReduce(num_packs=num_packs)
    elif allreduce == "reduction_to_one_device" or devices.kind == "CPU":
        ops = tf.distribute.ReductionToOneDevice(reduce_to_device=devices.names[0])
    else:
        ops = None
    return tf.distribute.MirroredStrategy(devices.names, cross_device_ops=ops)


def cluster_from_env() -> dict | None:
    """The parsed TF_CONFIG, or None when not set."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        cluster = json.loads(raw)
        workers = cluster["cluster"].get("worker", []) + cluster["cluster"].get("chief", [])
        task = cluster["task"]
        assert task["type"] in ("worker", "chief") and isinstance(task["index"], int) and workers
    except (ValueError, KeyError, TypeError, AssertionError, AttributeError):
        raise ConfigError("invalid TF_CONFIG", "TF_CONFIG",
                          'JSON like {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", '
                          '"index": 0}}') from None
    return cluster


def set_cluster(workers: str, index: int) -> None:
    """--workers HOST:PORT,... --worker-index I -> the equivalent TF_CONFIG."""
    hosts = [w.strip() for w in workers.split(",") if w.strip()]
    for h in hosts:
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("invalid worker address", "--workers", f"HOST:PORT entries, got {h!r}")
    if not 0 <= index < len(hosts):
        raise ConfigError("invalid worker index", "--worker-index", f"0..{len(hosts) - 1}, got {index}")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}})


def make_multiworker_strategy(num_gpus: int, allreduce: str, pack_mb: float, timeout: float, num_packs: int = 1):
    """TensorFlow's MultiWorkerMirroredStrategy from TF_CONFIG; returns (strategy, message).

    Each worker uses its first `num_gpus` GPUs, else one CPU device. `timeout` bounds any collective
    waiting for a peer.
    """
    if allreduce in ("hierarchical_copy", "reduction_to_one_device"):
        raise ConfigError("invalid combination", "train.allreduce",
                          f"{allreduce} is a single-machine method; across machines use auto, ring or nccl")
    if num_packs != 1:
        raise ConfigError("invalid combination", "train.allreduce_num_packs",
                          "1 with several workers (pack with train.allreduce_pack_mb instead)")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < num_gpus:
            raise ConfigError("not enough GPUs", "--gpus", f"at most {len(gpus)} (GPUs visible), got {num_gpus}")
        tf.config.set_visible_devices(gpus[:num_gpus], "GPU")
    elif allreduce == "nccl":
        raise ConfigError("invalid combination", "train.allreduce", "nccl needs GPUs; on CPU use auto or ring")
    impl = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}[allreduce]
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=impl, bytes_per_pack=int(pack_mb * 2**20), timeout_seconds=timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    resolver = strategy.cluster_resolver
    num_workers = len(resolver.cluster_spec().as_dict().get("worker", [])) + len(
        resolver.cluster_spec().as_dict().get("chief", []))
    per_worker = len(strategy.extended.worker_devices)
    kind = "GPU" if gpus else "CPU"
    msg = (f"multi-worker: task {resolver.task_type}:{resolver.task_id} of {num_workers} workers, "
           f"{per_worker} {kind} tower(s) each, {strategy.num_replicas_in_sync} in all")
    if not gpus and num_gpus > 1:
        msg += f" (no GPU: --gpus {num_gpus} ignored, one CPU device per worker)"
    return strategy, msg


def is_chief(strategy) -> bool:
    """True for the process that writes checkpoints, summaries and config (task chief, or worker 0)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return True
    spec = resolver.cluster_spec().as_dict()
    if "chief" in spec:
        return resolver.task_type == "chief"
    return resolver.task_type == "worker" and resolver.task_id == 0
