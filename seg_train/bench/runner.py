"""seg-bench: training throughput, input-pipeline speed, tower scaling, FLOP utilisation and memory.

What is measured, and how (docs/PERFORMANCE.md quotes these definitions):

- **Training images/s** (per tower count N): the real `TrainStep` (step.py) on batches from the
  real `ImageReader.train_dataset` distributed with `distribute_datasets_from_function`, exactly as
  `seg-train` runs it, reading the loss back to the host every step (as train.py does). Warm-up
  steps (tracing, the first steps, tf.data autotuning) are never timed; then `windows` windows of
  `steps` steps each are timed and the MEDIAN window is reported. images/s = global batch *
  steps / window time; per tower = that / N; step time = window time / steps.
- **Scaling efficiency** at N = images/s at N / images/s at 1 tower, for the SAME global batch
  (so each of the N towers gets batch / N images). 1.0 = no loss from splitting the batch; on
  logical CPU devices (which share the same cores) the ideal is 1.0, not N.
- **Input wait fraction**: time spent blocked in `next(iterator)` / total time of the timed steps
  (median over the windows).
- **CPU time per step**: this process's CPU time (all threads, time.process_time) over a window /
  its steps, and `cores_busy` = CPU time / wall time. Other processes on the machine inflate wall
  time far more than CPU time, so CPU-time ratios are a cross-check of the wall-time ratios.
- **Input images/s**: the same ImageReader pipeline (global batches) iterated alone, no training,
  after warm-up; median over windows. Its **CPU ms per sample**: this process's CPU time over a
  window / the window's samples (median window). `--input-only` also times the **decode-only floor**
  (DECODE_FLOOR_DEFINITION: the same samples, decoded by the reader's own decoders, nothing else) and
  reports `cpu_per_sample_vs_floor`, the pipeline's CPU per sample over the floor's.
- **FLOPs, achieved FLOP/s, peak and `flops_utilization`**: defined in flops.py's docstring.
- **Op time per op type and the cross-tower share** (`--profile`): op_profile.py.
- **Peak resident memory**: VmHWM of /proc/self/status (ru_maxrss as fallback) at the end: the
  whole process, with every runner (tower count / variant) alive at once.

All runners (one per tower count, and per variant with `--compare`) are built and warmed up first,
then timed in interleaved windows (A B C, C B A, ...), so their ratios hold even when other
processes load the machine unevenly during the run.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import re
import sys
import statistics
import time
from dataclasses import dataclass

import numpy as np

from seg_train.bench.flops import compute_dtype, count_train_flops, measure_peak, utilisation
from seg_train.bench.op_profile import profile_ops
from seg_train.config import Config, ConfigError
from seg_train.data.feed import Feed
from seg_train.util.sysinfo import peak_rss_mb

log = logging.getLogger("seg_train")

EFFICIENCY_DEFINITION = ("images/s at N towers / images/s at 1 tower, same global batch "
                         "(each tower gets global_batch / N images); 1.0 = no loss from splitting")
WAIT_DEFINITION = "time blocked in next(iterator) / total time of the timed steps (median window)"
DECODE_FLOOR_DEFINITION = ("the same samples in the same order, image and label decoded by the reader's own "
                           "decoders and nothing else (no augmentation, no batching), at data.num_parallel_calls, "
                           "timed in windows of as many samples; cpu_ms_per_sample = this process's CPU time "
                           "(all threads) over a window / its samples, median window")


@dataclass(frozen=True)
class Variant:
    """One set-up to time: a config, where its batches come from, and how the host runs its loop.

    overrides: the --set strings that make this config (for the fresh-process probes)."""
    name: str
    cfg: Config
    input: str = "reader"        # "reader" (the real pipeline) or "cached" (the same batches from memory)
    loop: str = "overlapped"     # train.py's loop, or "blocking" (the host waits for every step)
    overrides: tuple = ()


# ---- small helpers ------------------------------------------------------------------------------
def parse_towers(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, unique); a user error for anything else."""
    try:
        towers = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        towers = []
    if not towers or towers[0] < 1:
        raise ConfigError("invalid --gpus", "--gpus", f"expected tower counts like 1,2,4, got {text!r}")
    return towers


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


def _median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


# ---- input pipeline alone ---------------------------------------------------------------------------
def input_throughput(reader, global_batch: int, steps: int, windows: int, warmup: int) -> dict:
    """images/s of the real reader's training stream (global batches), iterated without training.

    With data.cache on, one full pass over the data comes first (its rate is reported as
    first_pass_images_per_sec), so the timed windows read decoded images from the cache.
    cores_busy: the process's CPU time (all threads, user + system) over the wall time of each timed
    window, median: how many cores the pipeline kept busy (1.0 at most for a pipeline held by the GIL).
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
    """Times `windows` windows of `steps` next(it) calls, each giving `per_item` samples: images/s, cores
    busy and CPU milliseconds per sample (this process's CPU time, all threads, over the window's
    samples), the median window of each and the windows themselves."""
    rates, busy, cpu = [], [], []
    for _ in range(windows):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            next(it)
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        rates.append(steps * per_item / wall)
        busy.append(used / wall)
        cpu.append(1000.0 * used / (steps * per_item))
    return {"images_per_sec": _median(rates), "window_images_per_sec": rates, "cores_busy": _median(busy),
            "window_cores_busy": busy, "cpu_ms_per_sample": _median(cpu), "window_cpu_ms_per_sample": cpu}


def decode_floor(reader, global_batch: int, steps: int, windows: int, warmup: int) -> dict:
    """The decode-only floor of the training stream: the same samples in the same order, each image and
    label decoded by the reader's own decoders (`ImageReader.decode`: TensorFlow's, Pillow where the
    reader uses Pillow) and nothing else, at data.num_parallel_calls; timed like input_throughput
    (windows of `steps` global batches' worth of samples). Always decodes the files (data.cache off).
    """
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


# ---- training -----------------------------------------------------------------------------------------
def _cached_dataset_fn(reader, global_batch: int, num_distinct_steps: int, micro_batches: int = 1):
    """A dataset_fn serving the first `num_distinct_steps` steps' batches from memory, repeated.

    The batches are those the real reader would give (same per-replica split), decoded and augmented
    once up front, so training from it measures the step without any input-pipeline cost.
    """
    import tensorflow as tf

    from seg_train.data.split import train_dataset_fn

    distinct = train_dataset_fn(reader, global_batch, start_step=0, end_step=num_distinct_steps,
                                micro_batches=micro_batches)

    def dataset_fn(ctx):
        batches = list(Feed(distinct(ctx)))
        images = tf.stack([b[0] for b in batches])
        labels = tf.stack([b[1] for b in batches])
        return tf.data.Dataset.from_tensor_slices((images, labels)).repeat().prefetch(2)

    return dataset_fn


class TrainRunner:
    """seg-train's real train step on some towers, run by seg-train's own loop; timed in windows.

    The steps go through loop.StepLoop with seg-train's per-step host work (`loop.HostSide`: scalar summaries
    every train.summary_every steps, image summaries, the log line, the non-finite checks), written
    to a throw-away folder, so the images/s measured here is what seg-train delivers.

    Args:
      name: label of this runner (e.g. "gpus=4" or "train.precision=mixed_bfloat16").
      cfg: resolved config (data.batch_size is the GLOBAL batch of one micro-batch).
      devices: replicas.Devices for this runner's towers.
      reader: the training ImageReader.
      input_mode: "reader" (the real pipeline) or "cached" (the same batches from memory).
      loop: "overlapped" (train.py's loop: step k's outputs are read after step k+1 is dispatched)
        or "blocking" (the host reads every step's outputs before dispatching the next one).
      class_weights: loss.class_weights as computed for training (median_frequency needs the scan).
    """

    def __init__(self, name: str, cfg: Config, devices, reader, input_mode: str = "reader", loop: str = "overlapped",
                 class_weights=None):
        import tempfile

        from seg_train.dist import replicas
        from seg_train.train.loop import HostSide, StepLoop
        from seg_train.data.label_images import voc_colormap
        from seg_train.data.split import train_dataset_fn
        from seg_train.train.profiling import StepProfiler
        from seg_train.train.summaries import Summaries
        from seg_train.infer import modes
        from seg_train.infer.evaluate import Evaluator
        from seg_train.train.state import TrainState
        from seg_train.train.step import TrainStep

        self.name, self.cfg, self.input_mode, self.loop = name, cfg, input_mode, loop
        self.num_towers = len(devices.names)
        self.batch = cfg.data.batch_size
        k = cfg.train.accumulate_steps
        self.images_per_step = self.batch * k
        self.strategy = replicas.strategy_for(cfg.train, devices)
        self.build_start = t0 = time.perf_counter()
        self.state = TrainState(cfg, self.strategy)
        self.train_step = TrainStep(self.state, class_weights=class_weights)
        # measure_eval's evaluation and measure_bn_reestimate's precise BN, as train.py evaluates
        self.evaluator = Evaluator(self.state, cfg.eval, score_offsets=modes.score_offsets(cfg.eval, class_weights))
        self.build_s = time.perf_counter() - t0
        batch = self.batch
        if input_mode == "cached":
            dataset_fn = _cached_dataset_fn(reader, batch, 8, k)
        else:  # endless: read until close() releases the Feed
            dataset_fn = train_dataset_fn(reader, batch, start_step=0, end_step=None, micro_batches=k)
        self.dataset = self.state.distribute(dataset_fn)
        self.batches = Feed(self.dataset)
        self.scratch = tempfile.TemporaryDirectory(prefix="seg-bench-summaries-")
        self.summaries = Summaries(self.scratch.name, voc_colormap(), cfg.data.ignore_label, cfg.data.mean,
                                   cfg.data.std)
        self.host = HostSide(cfg, self.state, self.summaries, None, self.num_towers,
                          StepProfiler(self.scratch.name, None), log_level=logging.DEBUG)
        self.steps = StepLoop(self.train_step, self.batches, 0, self, cfg.train.image_summary_every)
        self.first_step_s = None
        self.first_step = {}
        self.rates, self.waits, self.step_ms, self.losses = [], [], [], []
        self.cpu_ms, self.cores = [], []

    # The host side StepLoop calls: train.py's, plus the loss for the summary.
    def before_step(self, step: int) -> None:
        self.host.before_step(step)

    def finish(self, pending, ended=None) -> bool:
        stop = self.host.finish(pending, ended)
        self.losses.append(self.host.last_loss)
        return stop

    def step(self) -> tuple[float, float]:
        """One training step as train.py runs it; returns (seconds blocked in next(), total seconds)."""
        t0 = time.perf_counter()
        self.steps.dispatch()
        if self.loop == "blocking":
            self.steps.drain()
        return self.steps.last_input_wait, time.perf_counter() - t0

    def drain(self) -> float:
        """Waits for the last dispatched step (end of a timed window); returns the seconds it took."""
        t0 = time.perf_counter()
        self.steps.drain()
        return time.perf_counter() - t0

    def warmup(self, steps: int) -> None:
        """Untimed steps: the first traces the step; the rest let tf.data's autotuning settle.

        The first step is split where TensorFlow lets it be: tracing (Python building the graph:
        get_concrete_function), then the first call, which is graph optimisation (Grappler, placement,
        function instantiation per device) plus the first execution; a second call gives the
        execution time alone, so graph_optimization_s ~ first call - second call.
        """
        t0 = time.perf_counter()
        self.train_step.concrete_function(self.dataset.element_spec)
        trace = time.perf_counter() - t0
        self.host.trace_s, self.host.loop_start = trace, time.perf_counter()
        t1 = time.perf_counter()
        self.step()
        self.drain()
        first_call = time.perf_counter() - t1
        t2 = time.perf_counter()
        self.step()
        self.drain()
        second = time.perf_counter() - t2
        self.first_step_s = self.build_s + trace + first_call
        self.first_step = {"build_s": self.build_s, "tracing_s": trace, "first_call_s": first_call,
                           "graph_optimization_s": max(first_call - second, 0.0), "first_execution_s": second,
                           "note": "in this process, after other runners were built (see process_first_step for a "
                                   "fresh process)"}
        for _ in range(max(steps - 2, 0)):
            self.step()
        self.drain()
        # Only the warm-up's steps follow each other without another runner's window in between.
        self.warmup_finished = list(self.steps.finished)

    def warmup_figures(self) -> dict:
        """The warm-up as the loop saw it (after the timed windows): the steps until the step time is
        within 10% of the steady state (the median step of the timed windows), and when that was, in
        seconds from this process's launch and from this runner's build. With fewer warm-up steps
        than that, warmup_steps_to_steady is the warm-up's length and `reached` is false."""
        from seg_train.train.loop import step_times, warmup

        ends = self.warmup_finished
        times = step_times(ends)  # steps 2, 3, ...
        steady = _median(self.step_ms) / 1e3
        n = 1 + warmup(times, steady)  # the first step (tracing, graph optimisation) is never steady
        reached = n - 1 < len(times)
        n = min(n, len(ends))
        return {"warmup_steps_to_steady": n, "warmup_reached_steady": reached,
                "launch_to_steady_s": ends[n - 1][2], "build_to_steady_s": ends[n - 1][1] - self.build_start,
                "warmup_step_ms": [round(1e3 * t, 1) for t in times]}

    def window(self, steps: int, reentry: int = 0) -> None:
        """`reentry` untimed steps (after another runner had the CPU), then `steps` timed steps."""
        for _ in range(reentry):
            self.step()
        self.drain()
        wait = total = 0.0
        cpu0 = time.process_time()
        for _ in range(steps):
            w, t = self.step()
            wait, total = wait + w, total + t
        total += self.drain()
        cpu = time.process_time() - cpu0
        self.rates.append(steps * self.images_per_step / total)
        self.waits.append(wait / total)
        self.step_ms.append(1000.0 * total / steps)
        self.cpu_ms.append(1000.0 * cpu / steps)
        self.cores.append(cpu / total)

    def summary(self) -> dict:
        rate = _median(self.rates)
        if not all(np.isfinite(self.losses)):
            log.warning("%s: non-finite loss while benchmarking", self.name)
        return {"gpus": self.num_towers, "images_per_sec": rate, "images_per_sec_per_tower": rate / self.num_towers,
                "images_per_step": self.images_per_step, "accumulate_steps": self.cfg.train.accumulate_steps,
                "step_time_ms": _median(self.step_ms), "input_wait_fraction": _median(self.waits),
                "cpu_ms_per_step": _median(self.cpu_ms), "cores_busy": _median(self.cores),
                "window_images_per_sec": list(self.rates), "window_input_wait_fraction": list(self.waits),
                "first_step_s": self.first_step_s, "first_step_in_process": self.first_step,
                "last_loss": self.losses[-1] if self.losses else None, **self.graph_counts()}

    def graph_counts(self) -> dict:
        """What crosses the towers per step, read from the traced step: tensors all-reduced (gradient
        packs, or one per gradient with packing off) and graph ops in the cross-tower scope."""
        graph = self.train_step.concrete_function(self.dataset.element_spec).graph
        cross = [op for op in graph.get_operations() if "cross_tower" in op.name]
        reduce_ops = [op for op in cross if op.type in ("AddN", "CollectiveReduceV2", "CollectiveReduceV3",
                                                        "NcclAllReduce")]
        return {"allreduce_ops_per_step": len(reduce_ops), "cross_tower_graph_ops": len(cross),
                "allreduce_pack_mb": self.cfg.train.allreduce_pack_mb}

    def close(self) -> None:
        """Releases the runner's iterator (without waiting for it, data/feed.py), graphs and scratch folder."""
        self.batches.close()
        self.summaries.flush()
        del self.steps, self.host, self.summaries, self.batches, self.dataset
        del self.train_step, self.evaluator, self.state, self.strategy
        gc.collect()
        self.scratch.cleanup()


def measure_bn_reestimate(runner: TrainRunner, reader, images: int) -> dict:
    """Precise-BN re-estimation from `images` training images on this runner's towers: the first run
    (which traces) and a second one (trace cached), in seconds."""
    state = runner.state
    batches = max(images // runner.batch, 1)
    saved = [np.asarray(v) for v in state.non_trainable] + [int(state.bn_stats_step.numpy())]
    times = []
    for _ in range(2):
        state.bn_stats_step.assign(-7)  # forces the re-estimation (it is skipped when already done)
        t0 = time.perf_counter()
        runner.evaluator.reestimate_bn(reader, batches, progress=False)
        times.append(time.perf_counter() - t0)
    for v, x in zip(state.non_trainable, saved[:-1]):  # the runner goes on training from its own statistics
        v.assign(x)
    state.bn_stats_step.assign(saved[-1])
    return {"bn_reestimate_s": times[0], "bn_reestimate_repeat_s": times[1],
            "bn_reestimate_images": batches * runner.batch}


def measure_eval(runner: TrainRunner, val_reader, names) -> dict:
    """Full-resolution evaluation of `val_reader`'s images on this runner's towers: a first pass (which
    traces), then a timed pass; images/s of the timed pass."""
    t0 = time.perf_counter()
    runner.evaluator.evaluate(val_reader, names, progress=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, count = runner.evaluator.evaluate(val_reader, names, progress=False)
    seconds = time.perf_counter() - t0
    return {"eval_images_per_sec": count / seconds, "eval_images": count, "eval_first_pass_s": first}


def interleave(runners: list, steps: int, windows: int, warmup: int, pickup: int = 1) -> None:
    """Warms every runner up, then times their windows in turn: A B C, C B A, A B C, ...

    Interleaving makes the ratios between runners robust to load that changes during the run (other
    processes on the machine); with several runners each window starts with `pickup` untimed steps,
    so a runner need not pay for picking up after another (caches, its input buffer).
    """
    for r in runners:
        log.info("%s: warming up (%d steps, the first one traces)", r.name, warmup)
        r.warmup(warmup)
        log.info("%s: first step %.1fs", r.name, r.first_step_s)
    reentry = pickup if len(runners) > 1 else 0
    for w in range(windows):
        for r in (runners if w % 2 == 0 else runners[::-1]):
            r.window(steps, reentry)
            log.debug("%s: window %d: %.2f images/s", r.name, w, r.rates[-1])


def run_input_only(cfg: Config, steps: int = 10, windows: int = 3, warmup: int = 3) -> dict:
    """`seg-bench --input-only`: the reader's training stream alone (no model, no training)."""
    from seg_train.data.split import open_split

    reader = open_split(cfg, cfg.data.train_split).reader
    batch = cfg.data.batch_size
    log.info("timing the input pipeline alone (data.cache %s)", cfg.data.cache)
    inp = input_throughput(reader, batch, steps, windows, warmup)
    log.info("input pipeline alone: %.1f images/s, %.2f cores busy, %.1f ms CPU per sample", inp["images_per_sec"],
             inp["cores_busy"], inp["cpu_ms_per_sample"])
    log.info("timing the decode-only floor on the same samples")
    floor = decode_floor(reader, batch, steps, windows, warmup)
    log.info("decode only: %.1f images/s, %.2f cores busy, %.1f ms CPU per sample", floor["images_per_sec"],
             floor["cores_busy"], floor["cpu_ms_per_sample"])
    return {"input_images_per_sec": inp["images_per_sec"], "input": inp, "global_batch": batch,
            "input_cpu_ms_per_sample": inp["cpu_ms_per_sample"], "decode_floor": floor,
            "cpu_per_sample_vs_floor": inp["cpu_ms_per_sample"] / floor["cpu_ms_per_sample"],
            "decode_floor_definition": DECODE_FLOOR_DEFINITION,
            "crop_size": list(cfg.data.crop_size), "data_root": str(cfg.data.root), "num_train_images": len(reader),
            "num_parallel_calls": cfg.data.num_parallel_calls, "cache": cfg.data.cache,
            "steps_per_window": steps, "windows": windows, "warmup_steps": warmup,
            "machine": machine_info(), "peak_rss_mb": peak_rss_mb()}


_FIRST_STEP_LINE = re.compile(r"first step done ([\d.]+)s after launch: tracing ([\d.]+)s, graph optimisation and "
                              r"first execution ([\d.]+)s")
_PEAK_LINE = re.compile(r"peak resident memory (\d+) MiB")


def cli_probe(config_path: str, overrides: list[str], towers: int, steps: int = 1, timeout: float = 3600) -> dict:
    """Runs seg-train itself for `steps` steps in a fresh process (no evaluation, a scratch run dir) and
    reads its own report of the first step (seconds from process launch, tracing, first call) and
    of its peak resident memory: what a user launching seg-train meets."""
    import shutil
    import subprocess
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="seg-bench-probe-")
    sets = list(overrides) + [f"train.num_steps={steps}", "data.val_split=__seg_bench_no_val__",
                              "train.image_summary_every=0", f"train.summary_every={steps}",
                              f"train.checkpoint_every={steps}"]
    cmd = [sys.executable, "-m", "seg_train.cli", "--config", str(config_path), "--gpus", str(towers),
           "--run-dir", run_dir] + [x for o in sets for x in ("--set", o)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    first, peak = _FIRST_STEP_LINE.search(proc.stderr), _PEAK_LINE.search(proc.stderr)
    if proc.returncode != 0 or not first:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"seg-train probe ({' '.join(cmd)}) failed with exit {proc.returncode}: {tail}")
    return {"first_step_s": float(first.group(1)), "tracing_s": float(first.group(2)),
            "first_call_s": float(first.group(3)), "peak_rss_mb": float(peak.group(1)) if peak else None,
            "process_wall_s": time.time() - t0, "steps": steps}


# ---- the benchmark's phases, in the order run() calls them -----------------------------------------
def _setup_figures(cfg: Config, reader, input_mode: str, all_devices, steps: int, windows: int, warmup: int,
                   pickup: int) -> dict:
    """What is measured and how (config, data, timing plan, machine): the report's first keys."""
    return {
        "config": None, "precision": cfg.train.precision, "jit_compile": cfg.train.jit_compile,
        "backbone": cfg.model.backbone, "output_stride": cfg.model.output_stride,
        "crop_size": list(cfg.data.crop_size), "global_batch": cfg.data.batch_size,
        "num_classes": cfg.data.num_classes, "data_root": str(cfg.data.root), "num_train_images": len(reader),
        "input": input_mode, "device_kind": all_devices.kind, "steps_per_window": steps, "windows": windows,
        "warmup_steps": warmup, "pickup_steps": pickup, "accumulate_steps": cfg.train.accumulate_steps,
        "allreduce_pack_mb": cfg.train.allreduce_pack_mb,
        "efficiency_definition": EFFICIENCY_DEFINITION, "input_wait_definition": WAIT_DEFINITION,
        "machine": machine_info(),
    }


def _measure_peaks(variants: list[Variant], device: str) -> dict[str, dict]:
    """The device's peak FLOP/s (matmul and 3x3 conv), once per compute dtype of the variants."""
    peaks: dict[str, dict] = {}
    for v in variants:
        dtype = compute_dtype(v.cfg.train.precision)
        if dtype not in peaks:
            log.info("measuring the device peak (%s matmul and 3x3 conv)", dtype)
            peaks[dtype] = measure_peak(dtype, device)
            log.info("peak %s: matmul %.0f GFLOP/s, 3x3 conv %.0f GFLOP/s", dtype, peaks[dtype]["matmul_gflops"],
                     peaks[dtype]["conv3x3_gflops"])
    return peaks


def _count_flops(vcfg: Config, counts: dict[tuple, dict]) -> dict:
    """The FLOPs of vcfg's train step, counted the first time its shapes are met (`counts` keeps them)."""
    k = vcfg.train.accumulate_steps
    key = (vcfg.model, vcfg.data.crop_size, vcfg.data.batch_size, vcfg.data.num_classes, k)
    if key not in counts:
        log.info("counting the FLOPs of the train step")
        one = count_train_flops(vcfg, vcfg.data.batch_size)
        # A step of K micro-batches does K times one micro-batch's work (per-image figures unchanged).
        counts[key] = dict(one, train_flops_per_step=one["train_flops_per_step"] * k,
                           forward_flops_per_step=one["forward_flops_per_step"] * k)
        log.info("train step: %.2f GFLOP per image (forward %.2f)", counts[key]["train_gflop_per_image"],
                 counts[key]["forward_gflop_per_image"])
    return counts[key]


def _time_input_alone(reader, batch: int, steps: int, windows: int, warmup: int) -> dict:
    """images/s of the training input pipeline alone, before any runner exists."""
    log.info("timing the input pipeline alone")
    inp = input_throughput(reader, batch, steps, windows, warmup)
    log.info("input pipeline alone: %.1f images/s, %.2f cores busy", inp["images_per_sec"], inp["cores_busy"])
    return inp


def _build_runners(variants: list[Variant], towers: list[int], all_devices, reader, class_weights) -> list[tuple]:
    """One TrainRunner per variant and tower count (each times its own build): (variant name, config, runner)."""
    from seg_train.dist import replicas
    from seg_train.data.split import open_split

    cfg = variants[0].cfg
    runners = []
    try:
        for v in variants:
            vreader = reader if v.cfg.data == cfg.data else open_split(v.cfg, v.cfg.data.train_split).reader
            for n in towers:
                name = f"gpus={n}" if len(variants) == 1 else f"{v.name} gpus={n}"
                devices = replicas.Devices(all_devices.names[:n], all_devices.kind, "")
                log.info("%s: building (%s input, %s loop, %s, jit_compile %s)", name, v.input, v.loop,
                         v.cfg.train.precision, v.cfg.train.jit_compile)
                runners.append((v.name, v.cfg, TrainRunner(name, v.cfg, devices, vreader, v.input, v.loop,
                                                           class_weights)))
    except BaseException:
        for _, _, r in runners:
            r.close()
        raise
    return runners


def _time_interleaved(runners: list[tuple], steps: int, windows: int, warmup: int, pickup: int) -> None:
    """Every runner's first step and warm-up, then the timed windows of all runners, interleaved."""
    log.info("timing: %d warm-up steps each, then %d windows of %d steps per runner, interleaved", warmup, windows,
             steps)
    interleave([r for _, _, r in runners], steps, windows, warmup, pickup)


def _profile_runners(runners: list[tuple]) -> dict:
    """Op time per op type of every runner (2 profiled steps each), by runner name."""
    profiles = {}
    for _, vcfg, r in runners:
        if vcfg.train.jit_compile:
            continue  # XLA runs the step as one fused cluster: no per-op times to show
        log.info("%s: profiling 2 steps", r.name)
        profiles[r.name] = profile_ops(r)
    return profiles


def _cross_tower_profile(top_runner: TrainRunner, cfg: Config, profiles: dict | None) -> dict | None:
    """Where the time of the largest tower count goes: the share of op time that is cross-tower work."""
    if top_runner.num_towers > 1 and not cfg.train.jit_compile:
        log.info("%s: profiling 2 steps for the cross-tower share", top_runner.name)
        return (profiles or {}).get(top_runner.name) or profile_ops(top_runner)
    return None


def _time_bn_and_eval(cfg: Config, reader, base_runners: list[TrainRunner], bn_images: int,
                      eval_images: int) -> dict[int, dict]:
    """Precise BN re-estimation and evaluation timed on each tower count (base variant), by tower count."""
    from seg_train.data.split import open_split

    extra: dict[int, dict] = {}
    val = open_split(cfg, cfg.data.val_split, optional=True) if eval_images else None
    if val is not None:
        val.reader.samples = val.samples[:eval_images]
    for r in base_runners:
        row = {}
        if bn_images:
            log.info("%s: precise BN on %d images", r.name, bn_images)
            row.update(measure_bn_reestimate(r, reader, bn_images))
        if val is not None:
            log.info("%s: evaluating %d val images", r.name, len(val))
            row.update(measure_eval(r, val.reader, val.class_names))
        extra[r.num_towers] = row
    return extra


def _add_efficiency(rows: list[dict]) -> dict:
    """Scaling efficiency of each row (median and window range) against the 1-tower row; returns that row."""
    ref = next((x for x in rows if x["gpus"] == 1), rows[0])
    for x in rows:
        x["efficiency"] = x["images_per_sec"] / ref["images_per_sec"]
        ratios = [a / b for a, b in zip(x["window_images_per_sec"], ref["window_images_per_sec"])]
        x["efficiency_window_range"] = [min(ratios), max(ratios)]
    return ref


def _variant_figures(v: Variant, is_base: bool, runners: list[tuple], extra: dict[int, dict], profiles: dict | None,
                     flops: dict, peak: dict | None) -> dict:
    """One variant's row per tower count (timings, warm-up, FLOP utilisation, efficiency) and its top figures.

    extra: the base variant's precise-BN and evaluation figures by tower count; profiles: None without --profile.
    """
    rows = []
    for name, _, r in runners:
        if name == v.name:
            row = dict(r.summary(), **r.warmup_figures())
            if is_base:
                row.update(extra.get(r.num_towers, {}))
            if profiles is not None:
                row["op_profile"] = profiles.get(r.name)
            utilisation(row, flops, peak)
            rows.append(row)
            log.info("%s: %.2f images/s (%.2f per tower), step %.0f ms, input wait %.1f%%, %.1f GFLOP/s", r.name,
                     row["images_per_sec"], row["images_per_sec_per_tower"], row["step_time_ms"],
                     100 * row["input_wait_fraction"], row["achieved_gflops"])
    ref = _add_efficiency(rows)
    top, vcfg = rows[-1], v.cfg
    return {
        "name": v.name, "precision": vcfg.train.precision, "jit_compile": vcfg.train.jit_compile, "input": v.input,
        "loop": v.loop, "accumulate_steps": vcfg.train.accumulate_steps, "global_batch": vcfg.data.batch_size,
        "allreduce_pack_mb": vcfg.train.allreduce_pack_mb,
        "top_level_figures_for_gpus": top["gpus"], "efficiency_reference_gpus": ref["gpus"],
        "train_images_per_sec": top["images_per_sec"],
        "train_images_per_sec_per_tower": top["images_per_sec_per_tower"],
        "step_time_ms": top["step_time_ms"], "input_wait_fraction": top["input_wait_fraction"],
        "efficiency": top["efficiency"], "achieved_gflops": top["achieved_gflops"],
        "peak_gflops": peak["peak_gflops"] if peak else None, "flops_utilization": top["flops_utilization"],
        "towers": rows}


def _fresh_process_probes(variants: list[Variant], per_variant: list[dict], cfg: Config, config_path: str,
                          overrides: tuple) -> None:
    """The first step from launch (with and without synchronized BN) and the peak memory of accumulation
    variants, each in a fresh seg-train process; added to the variants' rows."""
    # After every in-process runner is gone: the first step as a user meets it, timed from launch; the
    # accumulation variants one process each (a shared process's peak would mix them).
    for v, pv in zip(variants, per_variant):
        is_base, is_accum = v is variants[0], "train.accumulate_steps" in v.name
        if not (is_base or is_accum):
            continue
        for row in pv["towers"]:
            n = row["gpus"]
            log.info("%s gpus=%d: seg-train in a fresh process (first step from launch%s)", v.name, n,
                     ", peak memory" if is_accum else "")
            probe = cli_probe(config_path, list(overrides) + list(v.overrides), n, steps=3)
            row.update({"first_step_s": probe["first_step_s"], "first_step_tracing_s": probe["tracing_s"],
                        "first_step_first_call_s": probe["first_call_s"],
                        # TensorFlow does not report its graph optimisation apart from the first
                        # execution: the steady step time stands in for the execution.
                        "first_step_graph_optimization_s": max(probe["first_call_s"] - row["step_time_ms"] / 1e3,
                                                               0.0),
                        "first_step_first_execution_s": row["step_time_ms"] / 1e3,
                        "peak_rss_mb_process": probe["peak_rss_mb"]})
            if is_base and not cfg.model.sync_batchnorm:
                sync = cli_probe(config_path, list(overrides) + ["model.sync_batchnorm=true"], n, steps=1)
                row.update({"first_step_sync_bn_s": sync["first_step_s"],
                            "first_step_sync_bn_tracing_s": sync["tracing_s"],
                            "first_step_sync_bn_first_call_s": sync["first_call_s"]})


def _top_level_figures(first: dict, inp: dict | None, peaks: dict[str, dict], cfg: Config, flops: dict) -> dict:
    """The report's headline: the first variant's figures at the largest tower count, input alone, peak, FLOPs."""
    out = {k: first[k] for k in (
        "top_level_figures_for_gpus", "efficiency_reference_gpus", "train_images_per_sec",
        "train_images_per_sec_per_tower", "step_time_ms", "input_wait_fraction", "efficiency")}
    out.update({
        "input_images_per_sec": inp["images_per_sec"] if inp else None,
        "input_window_images_per_sec": inp["window_images_per_sec"] if inp else None,
        "achieved_gflops": first["achieved_gflops"],
        "peak_gflops": first["peak_gflops"],
        "flops_utilization": first["flops_utilization"],
        "peak": peaks.get(compute_dtype(cfg.train.precision)),
        "peaks": peaks,
        "flops": flops,
        "towers": first["towers"],
    })
    return out


def _variant_speedups(per_variant: list[dict]) -> dict:
    """Each variant's speedup over the first at the largest tower count: wall time (median, window range), CPU time."""
    first = per_variant[0]
    return {
        "variants": per_variant,
        "speedup_vs_first_variant": {
            v["name"]: v["train_images_per_sec"] / first["train_images_per_sec"] for v in per_variant},
        "speedup_definition": ("train images/s of the variant / train images/s of the first variant, at "
                               f"{first['top_level_figures_for_gpus']} tower(s), interleaved windows"),
        "speedup_window_range": {
            v["name"]: [min(a / b for a, b in zip(v["towers"][-1]["window_images_per_sec"],
                                                  first["towers"][-1]["window_images_per_sec"])),
                        max(a / b for a, b in zip(v["towers"][-1]["window_images_per_sec"],
                                                  first["towers"][-1]["window_images_per_sec"]))]
            for v in per_variant},
        "cpu_speedup_vs_first_variant": {
            v["name"]: first["towers"][-1]["cpu_ms_per_step"] / v["towers"][-1]["cpu_ms_per_step"]
            for v in per_variant},
        "cpu_speedup_definition": ("process CPU time per step of the first variant / that of the variant "
                                   "(less sensitive to other processes' load than wall time)"),
    }


def _add_tower_ratios(rows: list[dict]) -> None:
    """The per-tower-count ratios of issue-level interest (N towers vs 1 tower, same global batch): first step,
    precise BN, evaluation; added to the rows."""
    by_gpus = {r["gpus"]: r for r in rows}
    if 1 in by_gpus:
        one = by_gpus[1]
        for r in by_gpus.values():
            for key, ratio in (("first_step_s", "first_step_ratio"),
                               ("first_step_sync_bn_s", "first_step_sync_bn_ratio"),
                               ("bn_reestimate_s", "bn_reestimate_ratio"),
                               ("bn_reestimate_repeat_s", "bn_reestimate_repeat_ratio"),
                               ("eval_images_per_sec", "eval_ratio")):
                if r.get(key) is not None and one.get(key):
                    r[ratio] = r[key] / one[key]


def _closing_figures(top: dict, warmup_runner: str, first_warmup: dict, cross: dict | None) -> dict:
    """The largest tower count's first step, precise BN and evaluation (and their ratios), the first runner's
    warm-up, the cross-tower share."""
    out = {k: top.get(k) for k in (
        "first_step_s", "first_step_sync_bn_s", "bn_reestimate_s", "eval_images_per_sec", "first_step_ratio",
        "first_step_sync_bn_ratio", "bn_reestimate_ratio", "eval_ratio")}
    # The warm-up of the runner that ran first in this process: the only one whose launch_to_steady_s
    # is not delayed by other runners' building and warming up.
    out.update({"warmup_runner": warmup_runner, **{k: first_warmup[k] for k in (
        "warmup_steps_to_steady", "warmup_reached_steady", "launch_to_steady_s", "build_to_steady_s")}})
    out["cross_tower_share"] = cross["cross_tower_share"] if cross else None
    out["cross_tower_profile"] = cross
    return out


def run(cfg: Config, towers: list[int], all_devices, steps: int = 10, windows: int = 3, warmup: int = 3,
        input_mode: str = "reader", measure_input: bool = True, measure_peak_flops: bool = True,
        variants: list[Variant] | None = None, profile: bool = False, pickup: int = 1,
        config_path: str | None = None, overrides: tuple = (), bn_images: int = 200, eval_images: int = 64,
        probes: bool = True) -> dict:
    """The whole benchmark: peak, FLOP count, input alone, then training at each tower count.

    Args:
      cfg: the resolved config (its data.batch_size is the GLOBAL batch for every tower count).
      towers: tower counts, e.g. [1, 2, 4].
      all_devices: replicas.Devices for max(towers) towers (set up once, before TensorFlow starts).
      variants: optional set-ups to compare (e.g. two precisions); every variant is run at every tower
        count, all runners interleaved. The first variant is the reference.
      profile: after the timing, profile 2 steps of every runner (op time per op type).
      pickup: untimed steps at the start of each window when several runners alternate.
      config_path, overrides: the config file and --set strings, for the fresh-process probes.
      bn_images: precise-BN re-estimation timed on this many training images per tower count (0: skip).
      eval_images: evaluation timed on this many val images per tower count (0: skip).
      probes: time the first step from process launch in fresh seg-train processes (with and without
        synchronized BN), and the peak memory of train.accumulate_steps variants.
    Returns:
      The JSON-able result. Top-level figures are those of the largest tower count (of the first
      variant when comparing).
    """
    from seg_train.config import check_batch
    from seg_train.data.scan import class_weights_for_split
    from seg_train.data.split import open_split

    # ---- set-up: every variant's batch checked, the data, the class weights -------------------------
    variants = variants or [Variant("default", cfg, input_mode)]
    cfg, input_mode = variants[0].cfg, variants[0].input
    for v in variants:
        for n in towers:
            check_batch(v.cfg, n)
    reader = open_split(cfg, cfg.data.train_split).reader
    class_weights = class_weights_for_split(cfg, reader)
    t0 = time.perf_counter()
    result = _setup_figures(cfg, reader, input_mode, all_devices, steps, windows, warmup, pickup)
    # ---- before any runner exists: the device peak, the FLOP count, the input pipeline alone ---------
    peaks = _measure_peaks(variants, all_devices.names[0]) if measure_peak_flops else {}
    flop_counts: dict[tuple, dict] = {}
    for v in variants:
        _count_flops(v.cfg, flop_counts)
    inp = _time_input_alone(reader, cfg.data.batch_size, steps, windows, warmup) if measure_input else None
    # ---- every runner alive at once: built, warmed up, timed interleaved, profiled, BN and eval -------
    runners = _build_runners(variants, towers, all_devices, reader, class_weights)
    try:
        _time_interleaved(runners, steps, windows, warmup, pickup)
        profiles = _profile_runners(runners) if profile else None
        base_runners = [r for name, _, r in runners if name == variants[0].name]
        cross = _cross_tower_profile(base_runners[-1], cfg, profiles)
        extra = _time_bn_and_eval(cfg, reader, base_runners, bn_images, eval_images)
        per_variant = [_variant_figures(v, v is variants[0], runners, extra, profiles, _count_flops(v.cfg, flop_counts),
                                        peaks.get(compute_dtype(v.cfg.train.precision))) for v in variants]
        first_warmup = runners[0][2].warmup_figures()
    finally:  # every way out (a runner sits in a reference cycle: it would live until a garbage collection)
        for _, _, r in runners:
            r.close()
    # ---- fresh seg-train processes, after every in-process runner is gone -----------------------------
    if probes and config_path:
        _fresh_process_probes(variants, per_variant, cfg, config_path, overrides)
    # ---- the report ------------------------------------------------------------------------------------
    first = per_variant[0]
    result.update(_top_level_figures(first, inp, peaks, cfg, _count_flops(cfg, flop_counts)))
    if len(variants) > 1:
        result.update(_variant_speedups(per_variant))
    _add_tower_ratios(first["towers"])
    result.update(_closing_figures(first["towers"][-1], runners[0][2].name, first_warmup, cross))
    result.update({
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_scope": "whole process: every runner above was alive at once (interleaved timing)",
        "wall_time_s": time.perf_counter() - t0,
    })
    return result
