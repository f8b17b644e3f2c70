"""The machine every seg-bench record is stamped with, and the median of the timed windows."""

from __future__ import annotations

import os
import platform
import statistics


def machine_info() -> dict:
    """CPU model, core counts, TensorFlow/Keras versions."""
    import keras
    import tensorflow as tf
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("unknown", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    return {"cpu": model, "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}),
            "tensorflow": tf.__version__, "keras": keras.__version__, "python": platform.python_version()}


def median(xs):
    return float(statistics.median(xs)) if xs else float("nan")
