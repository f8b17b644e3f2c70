"""Where a runner's step time goes: TensorFlow op time per op type, and the cross-tower share of it."""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Protocol

log = logging.getLogger("seg_train")


class Runner(Protocol):
    """What profile_ops drives (a TrainRunner): step() dispatches a training step, drain() waits for them."""

    def step(self): ...

    def drain(self): ...


CROSS_TOWER_DEFINITION = ("op time of the ops in the cross_tower name scope (collectives.all_reduce_sum: the "
                          "gradient/BN-statistics packs and synchronized BN's moments, with the strategy's copies "
                          "and adds) plus device-to-device transfers (_Send/_Recv/Copy ops), over all op time")


def _is_cross_tower(op_name: str, op_type: str) -> bool:
    return "cross_tower" in op_name or op_type in ("_Send", "_Recv", "_HostSend", "_HostRecv", "Send", "Recv",
                                                   "CollectiveReduceV2", "CollectiveReduceV3", "NcclAllReduce",
                                                   "_CopyFromGpuToHost", "_CopyFromHostToGpu", "Copy")


def profile_ops(runner: Runner, steps: int = 2, top: int = 12) -> dict | None:
    """Where a runner's step time goes: TensorFlow op time per op type over `steps` profiled steps.

    Concurrent ops both count, so shares are of total op time, not of the step; None if unreadable.
    """
    import collections
    import shutil
    import tempfile

    import tensorflow as tf
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # pragma: no cover - the proto moved
        return None
    logdir = tempfile.mkdtemp(prefix="seg-bench-profile-")
    try:
        tf.profiler.experimental.start(logdir)
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step()
        runner.drain()
        wall = (time.perf_counter() - t0) / steps
        tf.profiler.experimental.stop()
        files = [os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs if f.endswith(".xplane.pb")]
        if not files:
            return None
        space = xplane_pb2.XSpace()
        with open(files[0], "rb") as f:
            space.ParseFromString(f.read())
    except Exception as e:  # noqa: BLE001 - profiling is an extra; never fail the benchmark for it
        log.warning("op profile unavailable: %s", e)
        return None
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    per_type, per_op = collections.Counter(), collections.Counter()
    cross = 0.0
    pattern = re.compile(r"^([^ :]+):(_?[A-Z][A-Za-z0-9_]+)$")  # "<op name>:<OpType>"
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for ev in line.events:
                m = pattern.match(names.get(ev.metadata_id, ""))
                if m:
                    ms = ev.duration_ps / 1e9 / steps  # ms per step
                    per_type[m.group(2)] += ms
                    per_op[names[ev.metadata_id]] += ms
                    if _is_cross_tower(m.group(1), m.group(2)):
                        cross += ms
    total = sum(per_type.values())
    if not total:
        return None
    conv = sum(v for k, v in per_type.items() if "Conv" in k)
    return {"profiled_step_ms": 1000.0 * wall, "op_time_ms_per_step": total, "conv_share_of_op_time": conv / total,
            "cross_tower_ms_per_step": cross, "cross_tower_share": cross / total,
            "cross_tower_definition": CROSS_TOWER_DEFINITION,
            "top_ops": [[k, round(v, 1), round(v / total, 4)] for k, v in per_type.most_common(top)],
            "top_op_instances": [[k, round(v, 1), round(v / total, 4)] for k, v in per_op.most_common(8)],
            "note": "op time summed over TF's executor threads (concurrent ops both count); shares are of op time"}
