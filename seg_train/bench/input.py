"""The training input pipeline timed alone: images/s, cores busy, CPU per sample, and the decode-only floor."""

from __future__ import annotations

import time

from seg_train.bench.machine import median
from seg_train.data.feed import Feed

DECODE_FLOOR_DEFINITION = ("the same samples in the same order, image and label decoded by the reader's own "
                           "decoders and nothing else (no augmentation, no batching), at data.num_parallel_calls, "
                           "timed in windows of as many samples; cpu_ms_per_sample = this process's CPU time "
                           "(all threads) over a window / its samples, median window")


def input_throughput(reader, global_batch: int, steps: int, windows: int, warmup: int) -> dict:
    """images/s of the real reader's training stream (global batches), iterated without training.

    With data.cache on, a first full pass (first_pass_images_per_sec) fills the cache the windows read.
    cores_busy: process CPU time / wall time, median window (at most 1.0 for a pipeline held by the GIL).
    """
    n = -(-len(reader) // global_batch) if reader.cfg.cache else 0
    # The stream ends with the batches read: nothing is decoded for nothing.
    it = Feed(reader.train_dataset(global_batch, 0, 1, end_step=n + warmup + windows * steps))
    first_pass = None
    if reader.cfg.cache:
        t0 = time.perf_counter()
        for _ in range(n):
            next(it)
        first_pass = n * global_batch / (time.perf_counter() - t0)
    for _ in range(warmup):
        next(it)
    out = _timed_windows(it, steps, windows, global_batch)
    it.close()
    out["cache"] = reader.cfg.cache
    if first_pass is not None:
        out.update(first_pass_images_per_sec=first_pass, cache_mb=reader.cache_bytes() / 2**20)
    return out


def _timed_windows(it, steps: int, windows: int, per_item: int) -> dict:
    """Times `windows` windows of `steps` next(it) calls of `per_item` samples each: images/s, cores busy,
    CPU ms per sample, as medians and per window."""
    rates, busy, cpu = [], [], []
    for _ in range(windows):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            next(it)
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        rates.append(steps * per_item / wall)
        busy.append(used / wall)
        cpu.append(1000.0 * used / (steps * per_item))
    return {"images_per_sec": median(rates), "window_images_per_sec": rates, "cores_busy": median(busy),
            "window_cores_busy": busy, "cpu_ms_per_sample": median(cpu), "window_cpu_ms_per_sample": cpu}


def decode_floor(reader, global_batch: int, steps: int, windows: int, warmup: int) -> dict:
    """The decode-only floor (DECODE_FLOOR_DEFINITION), timed like input_throughput; data.cache off."""
    import tensorflow as tf

    plain = reader.uncached()
    used = (warmup + windows * steps) * global_batch  # the stream ends with the samples read
    ds = plain.train_order(global_batch, 0, 1).take(used).map(
        lambda k, i: plain.decode(i), num_parallel_calls=plain.cfg.num_parallel_calls, deterministic=True)
    it = Feed(ds.prefetch(tf.data.AUTOTUNE))
    for _ in range(warmup * global_batch):
        next(it)
    out = _timed_windows(it, steps * global_batch, windows, 1)
    it.close()
    return out
