"""seg-bench: training throughput, input-pipeline speed, tower scaling, FLOP utilisation and memory.

What is measured, and how (docs/PERFORMANCE.md quotes these definitions):

- **Training images/s** (per tower count N): the real `Trainer.train_step` on batches from the
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
  after warm-up; median over windows.
- **FLOPs of the train step**: counted once from the graph of one tower's forward + backward pass
  (model, pixel cross-entropy, gradients) traced with the global batch's static shape: every
  Conv2D / DepthwiseConv2dNative / MatMul / BatchMatMul op and their backprop-input/-filter ops
  count 2 * multiply-adds (read from the ops' static shapes); element-wise ops, BN, resizes and the
  optimizer update are not counted (memory-bound, a few % of the FLOPs). The forward pass alone is
  counted the same way and reported too (train/forward is ~3 minus the skipped input gradient of the
  first conv).
- **Achieved FLOP/s** = counted FLOPs per step / median step time. **Peak** = the faster of a large
  matmul (2048^3) and a 3x3 conv (4x56x56x256 -> 256) timed in this same run on the same device in
  the compute dtype of train.precision (float32, or bfloat16/float16 for the mixed policies);
  `flops_utilization` = achieved / peak.
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
import resource
import statistics
import sys
import time

import numpy as np

from seg_train.config import Config, ConfigError

log = logging.getLogger("seg_train")

EFFICIENCY_DEFINITION = ("images/s at N towers / images/s at 1 tower, same global batch "
                         "(each tower gets global_batch / N images); 1.0 = no loss from splitting")
WAIT_DEFINITION = "time blocked in next(iterator) / total time of the timed steps (median window)"
FLOPS_METHOD = ("graph count: 2 * multiply-adds of every Conv2D/DepthwiseConv2dNative/MatMul op and their "
                "backprop-input/-filter ops in one tower's traced forward+backward pass (static shapes, "
                "global batch); element-wise ops, BN, resizes and the optimizer update not counted")
PEAK_METHOD = ("max of a 2048x2048x2048 matmul and a 3x3 conv 4x56x56x256->256 (SAME), timed in this run on "
               "the first device in the precision's compute dtype (median of 7 runs after 2 warm-ups)")


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


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024.0 * 1024.0) if sys.platform == "darwin" else rss / 1024.0


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


def compute_dtype(precision: str) -> str:
    return {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}[precision]


def _median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


# ---- peak -------------------------------------------------------------------------------------------
def measure_peak(dtype: str = "float32", device: str = "/device:CPU:0", reps: int = 7) -> dict:
    """GFLOP/s of a large matmul and of a 3x3 conv in `dtype` on `device` (median of `reps`)."""
    import tensorflow as tf

    def timed(fn, flops):
        fn()  # trace
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn().numpy()
            times.append(time.perf_counter() - t0)
        return flops / _median(times) / 1e9

    n = 2048
    b, hw, c = 4, 56, 256
    with tf.device(device):
        a = tf.cast(tf.random.stateless_normal([n, n], seed=[1, 2]), dtype)
        m = tf.cast(tf.random.stateless_normal([n, n], seed=[3, 4]), dtype)
        x = tf.cast(tf.random.stateless_normal([b, hw, hw, c], seed=[5, 6]), dtype)
        k = tf.cast(tf.random.stateless_normal([3, 3, c, c], seed=[7, 8]) * 0.05, dtype)

        @tf.function
        def matmul():
            return tf.reduce_sum(tf.cast(tf.matmul(a, m)[:1, :1], tf.float32))

        @tf.function
        def conv():
            return tf.reduce_sum(tf.cast(tf.nn.conv2d(x, k, 1, "SAME")[:1, :1, :1, :1], tf.float32))

        mm = timed(matmul, 2.0 * n ** 3)
        cv = timed(conv, 2.0 * b * hw * hw * c * 9 * c)
    return {"dtype": dtype, "matmul_gflops": mm, "conv3x3_gflops": cv, "peak_gflops": max(mm, cv),
            "method": PEAK_METHOD}


# ---- FLOP count ---------------------------------------------------------------------------------------
def _dims(tensor):
    shape = tensor.shape
    if shape.rank is None or any(d is None for d in shape.as_list()):
        return None
    return shape.as_list()


def op_flops(op) -> tuple[int, bool]:
    """(FLOPs of one graph op, whether its shapes were known). 2 * multiply-adds for conv/matmul ops."""
    t = op.type
    if t in ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"):
        # The "output" side of the forward conv: Conv2D's output, the backprops' out_backprop input.
        out = _dims(op.outputs[0]) if t == "Conv2D" else _dims(op.inputs[2])
        filt = _dims(op.inputs[1]) if t != "Conv2DBackpropFilter" else _dims(op.outputs[0])
        if out is None or filt is None:
            return 0, False
        n, h, w, co = out
        kh, kw, ci, _ = filt
        return 2 * n * h * w * co * kh * kw * ci, True
    if t in ("DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"):
        out = _dims(op.outputs[0]) if t == "DepthwiseConv2dNative" else _dims(op.inputs[2])
        filt = _dims(op.inputs[1]) if t != "DepthwiseConv2dNativeBackpropFilter" else _dims(op.outputs[0])
        if out is None or filt is None:
            return 0, False
        n, h, w, c = out
        kh, kw = filt[0], filt[1]
        return 2 * n * h * w * c * kh * kw, True
    if t in ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "BatchMatMul"):
        out, a = _dims(op.outputs[0]), _dims(op.inputs[0])
        if out is None or a is None:
            return 0, False
        adj = op.get_attr("transpose_a") if t == "MatMul" else op.get_attr("adj_x")
        k = a[-2] if adj else a[-1]
        return 2 * int(np.prod(out)) * k, True
    return 0, True


def graph_flops(graph) -> dict:
    """Sums op_flops over a graph; counts ops whose shapes were unknown (they add 0)."""
    total, unknown, by_type = 0, 0, {}
    for op in graph.get_operations():
        f, known = op_flops(op)
        if not known:
            unknown += 1
        if f:
            total += f
            by_type[op.type] = by_type.get(op.type, 0) + f
    return {"flops": total, "unknown_ops": unknown, "by_type": by_type}


def count_train_flops(cfg: Config, batch: int) -> dict:
    """FLOPs of one training step on `batch` images (see the module docstring), and of the forward pass.

    Traced on a separate float32 copy of the model outside any strategy (the FLOPs do not depend on
    the dtype or the tower count: N towers on batch/N images each do the same work as one tower).
    """
    import keras
    import tensorflow as tf

    from seg_train import losses, models

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        model = models.build(cfg.model, cfg.data.num_classes, cfg.seed)
    finally:
        keras.config.set_dtype_policy(previous)
    h, w = cfg.data.crop_size
    image_spec = tf.TensorSpec([batch, h, w, 3], tf.float32)
    label_spec = tf.TensorSpec([batch, h, w], tf.uint8)

    @tf.function
    def forward(images):
        return model(images, training=True)

    @tf.function
    def forward_backward(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            ce, count = losses.pixel_cross_entropy_sum(logits, labels, cfg.data.ignore_label)
            loss = ce / tf.maximum(count, 1.0) + losses.weight_decay(losses.decay_variables(model),
                                                                     cfg.model.weight_decay)
        return tape.gradient(loss, model.trainable_variables)

    fwd = graph_flops(forward.get_concrete_function(image_spec).graph)
    train = graph_flops(forward_backward.get_concrete_function(image_spec, label_spec).graph)
    if train["unknown_ops"] or fwd["unknown_ops"]:
        log.warning("FLOP count: %d ops with unknown shapes were not counted", train["unknown_ops"])
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    return {"train_flops_per_step": train["flops"], "forward_flops_per_step": fwd["flops"],
            "train_gflop_per_image": train["flops"] / batch / 1e9,
            "forward_gflop_per_image": fwd["flops"] / batch / 1e9,
            "train_to_forward": train["flops"] / max(fwd["flops"], 1),
            "train_flops_by_op": {k: v / batch / 1e9 for k, v in sorted(train["by_type"].items())},
            "trainable_params": params, "method": FLOPS_METHOD}


# ---- input pipeline alone ---------------------------------------------------------------------------
def input_throughput(reader, global_batch: int, steps: int, windows: int, warmup: int) -> dict:
    """images/s of the real reader's training stream (global batches), iterated without training.

    With data.cache on, one full pass over the data comes first (its rate is reported as
    first_pass_images_per_sec), so the timed windows read decoded images from the cache.
    """
    it = iter(reader.train_dataset(global_batch, 0, 1))
    first_pass = None
    if reader.cfg.cache:
        n = -(-len(reader) // global_batch)
        t0 = time.perf_counter()
        for _ in range(n):
            next(it)
        first_pass = n * global_batch / (time.perf_counter() - t0)
    for _ in range(warmup):
        next(it)
    rates = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(steps):
            next(it)
        rates.append(steps * global_batch / (time.perf_counter() - t0))
    del it
    out = {"images_per_sec": _median(rates), "window_images_per_sec": rates, "cache": reader.cfg.cache}
    if first_pass is not None:
        out.update(first_pass_images_per_sec=first_pass, cache_mb=reader.cache_bytes() / 2**20)
    return out


# ---- training -----------------------------------------------------------------------------------------
def _cached_dataset_fn(reader, global_batch: int, num_distinct_steps: int):
    """A dataset_fn serving the first `num_distinct_steps` steps' batches from memory, repeated.

    The batches are those the real reader would give (same per-replica split), decoded and augmented
    once up front, so training from it measures the step without any input-pipeline cost.
    """
    import tensorflow as tf

    def dataset_fn(ctx):
        ds = reader.train_dataset(global_batch, 0, ctx.num_replicas_in_sync, ctx.input_pipeline_id,
                                  ctx.num_input_pipelines)
        per_step = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        batches = list(ds.take(num_distinct_steps * per_step))
        images = tf.stack([b[0] for b in batches])
        labels = tf.stack([b[1] for b in batches])
        return tf.data.Dataset.from_tensor_slices((images, labels)).repeat().prefetch(2)

    return dataset_fn


class TrainRunner:
    """seg-train's real train step on some towers, fed like train.py feeds it; timed in windows.

    Args:
      name: label of this runner (e.g. "gpus=4" or "train.precision=mixed_bfloat16").
      cfg: resolved config (data.batch_size is the GLOBAL batch).
      devices: replicas.Devices for this runner's towers.
      reader: the training ImageReader.
      input_mode: "reader" (the real pipeline) or "cached" (the same batches from memory).
    """

    def __init__(self, name: str, cfg: Config, devices, reader, input_mode: str = "reader"):
        from seg_train import replicas
        from seg_train.trainer import Trainer

        self.name, self.cfg, self.input_mode = name, cfg, input_mode
        self.num_towers = len(devices.names)
        self.batch = cfg.data.batch_size
        self.strategy = replicas.make_strategy(devices)
        self.trainer = Trainer(cfg, self.strategy)
        batch = self.batch
        if input_mode == "cached":
            dataset_fn = _cached_dataset_fn(reader, batch, 8)
        else:
            def dataset_fn(ctx):
                return reader.train_dataset(batch, 0, ctx.num_replicas_in_sync, ctx.input_pipeline_id,
                                            ctx.num_input_pipelines)
        self.batches = iter(self.trainer.distribute(dataset_fn))
        self.first_step_s = None
        self.rates, self.waits, self.step_ms, self.losses = [], [], [], []
        self.cpu_ms, self.cores = [], []

    def step(self) -> tuple[float, float]:
        """One training step as train.py runs it; returns (seconds blocked in next(), total seconds)."""
        t0 = time.perf_counter()
        b = next(self.batches)
        t1 = time.perf_counter()
        out = self.trainer.train_step(b)
        self.losses.append(float(out["loss"]))  # the host reads the loss every step, as train.py does
        return t1 - t0, time.perf_counter() - t0

    def warmup(self, steps: int) -> None:
        """Untimed steps: the first traces the step; the rest let tf.data's autotuning settle."""
        t0 = time.perf_counter()
        self.step()
        self.first_step_s = time.perf_counter() - t0
        for _ in range(max(steps - 1, 0)):
            self.step()

    def window(self, steps: int, reentry: int = 0) -> None:
        """`reentry` untimed steps (after another runner had the CPU), then `steps` timed steps."""
        for _ in range(reentry):
            self.step()
        wait = total = 0.0
        cpu0 = time.process_time()
        for _ in range(steps):
            w, t = self.step()
            wait, total = wait + w, total + t
        cpu = time.process_time() - cpu0
        self.rates.append(steps * self.batch / total)
        self.waits.append(wait / total)
        self.step_ms.append(1000.0 * total / steps)
        self.cpu_ms.append(1000.0 * cpu / steps)
        self.cores.append(cpu / total)

    def summary(self) -> dict:
        rate = _median(self.rates)
        if not all(np.isfinite(self.losses)):
            log.warning("%s: non-finite loss while benchmarking", self.name)
        return {"gpus": self.num_towers, "images_per_sec": rate, "images_per_sec_per_tower": rate / self.num_towers,
                "step_time_ms": _median(self.step_ms), "input_wait_fraction": _median(self.waits),
                "cpu_ms_per_step": _median(self.cpu_ms), "cores_busy": _median(self.cores),
                "window_images_per_sec": list(self.rates), "window_input_wait_fraction": list(self.waits),
                "first_step_s": self.first_step_s, "last_loss": self.losses[-1] if self.losses else None}

    def close(self) -> None:
        del self.batches, self.trainer, self.strategy
        gc.collect()


def profile_ops(runner: "TrainRunner", steps: int = 2, top: int = 12) -> dict | None:
    """Where a runner's step time goes: TensorFlow op time per op type over `steps` profiled steps.

    Uses tf.profiler and reads its XPlane file directly (no TensorBoard plugin needed). Op times are
    wall times of each op on TensorFlow's executor threads; ops that run concurrently both count, so
    the shares are of total op time, not of the step. Returns None if the profile cannot be read.
    """
    import collections
    import re
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
    pattern = re.compile(r"^[^ :]+:(_?[A-Z][A-Za-z0-9_]+)$")  # "<op name>:<OpType>"
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for ev in line.events:
                m = pattern.match(names.get(ev.metadata_id, ""))
                if m:
                    ms = ev.duration_ps / 1e9 / steps  # ms per step
                    per_type[m.group(1)] += ms
                    per_op[names[ev.metadata_id]] += ms
    total = sum(per_type.values())
    if not total:
        return None
    conv = sum(v for k, v in per_type.items() if "Conv" in k)
    return {"profiled_step_ms": 1000.0 * wall, "op_time_ms_per_step": total, "conv_share_of_op_time": conv / total,
            "top_ops": [[k, round(v, 1), round(v / total, 4)] for k, v in per_type.most_common(top)],
            "top_op_instances": [[k, round(v, 1), round(v / total, 4)] for k, v in per_op.most_common(8)],
            "note": "op time summed over TF's executor threads (concurrent ops both count); shares are of op time"}


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


def _utilisation(row: dict, flops: dict, peak: dict | None) -> None:
    row["achieved_gflops"] = flops["train_flops_per_step"] / (row["step_time_ms"] / 1000.0) / 1e9
    row["flops_utilization"] = row["achieved_gflops"] / peak["peak_gflops"] if peak else None


def run_input_only(cfg: Config, steps: int = 10, windows: int = 3, warmup: int = 3) -> dict:
    """`seg-bench --input-only`: the reader's training stream alone (no model, no training)."""
    from seg_train.reader import ImageReader, ensure_data

    ensure_data(cfg)
    reader = ImageReader(cfg.data, cfg.data.train_split, cfg.seed)
    batch = cfg.data.batch_size
    log.info("timing the input pipeline alone (data.cache %s)", cfg.data.cache)
    inp = input_throughput(reader, batch, steps, windows, warmup)
    log.info("input pipeline alone: %.1f images/s", inp["images_per_sec"])
    return {"input_images_per_sec": inp["images_per_sec"], "input": inp, "global_batch": batch,
            "crop_size": list(cfg.data.crop_size), "data_root": str(cfg.data.root), "num_train_images": len(reader),
            "num_parallel_calls": cfg.data.num_parallel_calls, "cache": cfg.data.cache,
            "steps_per_window": steps, "windows": windows, "warmup_steps": warmup,
            "machine": machine_info(), "peak_rss_mb": peak_rss_mb()}


def run(cfg: Config, towers: list[int], all_devices, steps: int = 10, windows: int = 3, warmup: int = 3,
        input_mode: str = "reader", measure_input: bool = True, measure_peak_flops: bool = True,
        variants: list[tuple[str, Config, str]] | None = None, profile: bool = False, pickup: int = 1) -> dict:
    """The whole benchmark: peak, FLOP count, input alone, then training at each tower count.

    Args:
      cfg: the resolved config (its data.batch_size is the GLOBAL batch for every tower count).
      towers: tower counts, e.g. [1, 2, 4].
      all_devices: replicas.Devices for max(towers) towers (set up once, before TensorFlow starts).
      variants: optional [(name, cfg, input_mode)] to compare (e.g. two precisions); every variant is
        run at every tower count, all runners interleaved. The first variant is the reference.
      profile: after the timing, profile 2 steps of every runner (op time per op type).
      pickup: untimed steps at the start of each window when several runners alternate.
    Returns:
      The JSON-able result. Top-level figures are those of the largest tower count (of the first
      variant when comparing).
    """
    from seg_train import replicas
    from seg_train.reader import ImageReader, ensure_data
    from seg_train.config import check_batch

    variants = variants or [("default", cfg, input_mode)]
    cfg, input_mode = variants[0][1], variants[0][2]
    for _, vcfg, _ in variants:
        for n in towers:
            check_batch(vcfg, n)
    ensure_data(cfg)
    reader = ImageReader(cfg.data, cfg.data.train_split, cfg.seed)
    batch = cfg.data.batch_size
    t0 = time.perf_counter()
    result = {
        "config": None, "precision": cfg.train.precision, "jit_compile": cfg.train.jit_compile,
        "backbone": cfg.model.backbone, "output_stride": cfg.model.output_stride,
        "crop_size": list(cfg.data.crop_size), "global_batch": batch, "num_classes": cfg.data.num_classes,
        "data_root": str(cfg.data.root), "num_train_images": len(reader), "input": input_mode,
        "device_kind": all_devices.kind, "steps_per_window": steps, "windows": windows, "warmup_steps": warmup,
        "pickup_steps": pickup,
        "efficiency_definition": EFFICIENCY_DEFINITION, "input_wait_definition": WAIT_DEFINITION,
        "machine": machine_info(),
    }
    peaks: dict[str, dict] = {}
    if measure_peak_flops:
        for _, vcfg, _ in variants:
            dtype = compute_dtype(vcfg.train.precision)
            if dtype not in peaks:
                log.info("measuring the device peak (%s matmul and 3x3 conv)", dtype)
                peaks[dtype] = measure_peak(dtype, all_devices.names[0])
                log.info("peak %s: matmul %.0f GFLOP/s, 3x3 conv %.0f GFLOP/s", dtype, peaks[dtype]["matmul_gflops"],
                         peaks[dtype]["conv3x3_gflops"])
    flop_counts: dict[tuple, dict] = {}

    def flops_of(vcfg):
        key = (vcfg.model, vcfg.data.crop_size, vcfg.data.batch_size, vcfg.data.num_classes)
        if key not in flop_counts:
            log.info("counting the FLOPs of the train step")
            flop_counts[key] = count_train_flops(vcfg, vcfg.data.batch_size)
            log.info("train step: %.2f GFLOP per image (forward %.2f)", flop_counts[key]["train_gflop_per_image"],
                     flop_counts[key]["forward_gflop_per_image"])
        return flop_counts[key]

    for _, vcfg, _ in variants:
        flops_of(vcfg)
    inp = None
    if measure_input:
        log.info("timing the input pipeline alone")
        inp = input_throughput(reader, batch, steps, windows, warmup)
        log.info("input pipeline alone: %.1f images/s", inp["images_per_sec"])

    runners = []
    for vname, vcfg, vinput in variants:
        vreader = reader if vcfg.data == cfg.data else ImageReader(vcfg.data, vcfg.data.train_split, vcfg.seed)
        for n in towers:
            name = f"gpus={n}" if len(variants) == 1 else f"{vname} gpus={n}"
            devices = replicas.Devices(all_devices.names[:n], all_devices.kind, "")
            log.info("%s: building (%s input, %s, jit_compile %s)", name, vinput, vcfg.train.precision,
                     vcfg.train.jit_compile)
            runners.append((vname, vcfg, TrainRunner(name, vcfg, devices, vreader, vinput)))
    log.info("timing: %d warm-up steps each, then %d windows of %d steps per runner, interleaved", warmup, windows,
             steps)
    interleave([r for _, _, r in runners], steps, windows, warmup, pickup)
    profiles = {}
    if profile:
        for _, vcfg, r in runners:
            if vcfg.train.jit_compile:
                continue  # XLA runs the step as one fused cluster: no per-op times to show
            log.info("%s: profiling 2 steps", r.name)
            profiles[r.name] = profile_ops(r)

    per_variant = []
    for vname, vcfg, vinput in variants:
        rows = []
        for name, rcfg, r in runners:
            if name == vname:
                row = r.summary()
                if profile:
                    row["op_profile"] = profiles.get(r.name)
                _utilisation(row, flops_of(vcfg), peaks.get(compute_dtype(vcfg.train.precision)))
                rows.append(row)
                log.info("%s: %.2f images/s (%.2f per tower), step %.0f ms, input wait %.1f%%, %.1f GFLOP/s", r.name,
                         row["images_per_sec"], row["images_per_sec_per_tower"], row["step_time_ms"],
                         100 * row["input_wait_fraction"], row["achieved_gflops"])
        ref = next((x for x in rows if x["gpus"] == 1), rows[0])
        for x in rows:
            x["efficiency"] = x["images_per_sec"] / ref["images_per_sec"]
            ratios = [a / b for a, b in zip(x["window_images_per_sec"], ref["window_images_per_sec"])]
            x["efficiency_window_range"] = [min(ratios), max(ratios)]
        top = rows[-1]
        peak = peaks.get(compute_dtype(vcfg.train.precision))
        per_variant.append({
            "name": vname, "precision": vcfg.train.precision, "jit_compile": vcfg.train.jit_compile, "input": vinput,
            "top_level_figures_for_gpus": top["gpus"], "efficiency_reference_gpus": ref["gpus"],
            "train_images_per_sec": top["images_per_sec"],
            "train_images_per_sec_per_tower": top["images_per_sec_per_tower"],
            "step_time_ms": top["step_time_ms"], "input_wait_fraction": top["input_wait_fraction"],
            "efficiency": top["efficiency"], "achieved_gflops": top["achieved_gflops"],
            "peak_gflops": peak["peak_gflops"] if peak else None, "flops_utilization": top["flops_utilization"],
            "towers": rows})
    for _, _, r in runners:
        r.close()
    flops = flops_of(cfg)
    first = per_variant[0]
    result.update({k: first[k] for k in (
        "top_level_figures_for_gpus", "efficiency_reference_gpus", "train_images_per_sec",
        "train_images_per_sec_per_tower", "step_time_ms", "input_wait_fraction", "efficiency")})
    result.update({
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
    if len(variants) > 1:
        result["variants"] = per_variant
        result["speedup_vs_first_variant"] = {
            v["name"]: v["train_images_per_sec"] / first["train_images_per_sec"] for v in per_variant}
        result["speedup_definition"] = ("train images/s of the variant / train images/s of the first variant, at "
                                        f"{first['top_level_figures_for_gpus']} tower(s), interleaved windows")
        result["speedup_window_range"] = {
            v["name"]: [min(a / b for a, b in zip(v["towers"][-1]["window_images_per_sec"],
                                                  first["towers"][-1]["window_images_per_sec"])),
                        max(a / b for a, b in zip(v["towers"][-1]["window_images_per_sec"],
                                                  first["towers"][-1]["window_images_per_sec"]))]
            for v in per_variant}
        result["cpu_speedup_vs_first_variant"] = {
            v["name"]: first["towers"][-1]["cpu_ms_per_step"] / v["towers"][-1]["cpu_ms_per_step"] for v in per_variant}
        result["cpu_speedup_definition"] = ("process CPU time per step of the first variant / that of the variant "
                                            "(less sensitive to other processes' load than wall time)")
    result.update({
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_scope": "whole process: every runner above was alive at once (interleaved timing)",
        "wall_time_s": time.perf_counter() - t0,
    })
    return result


def format_report(r: dict) -> str:
    """A human-readable summary of `run`'s result."""
    lines = [
        f"seg-bench: {r['backbone']} OS{r['output_stride']}, crop {r['crop_size'][0]}x{r['crop_size'][1]}, "
        f"global batch {r['global_batch']}, {r['precision']}, jit_compile {r['jit_compile']}, input {r['input']}",
        f"machine: {r['machine']['cpu']}, {r['machine']['usable_cpus']} cpus, TF {r['machine']['tensorflow']}",
        f"timing: {r['warmup_steps']} warm-up steps, then the median of {r['windows']} windows of "
        f"{r['steps_per_window']} steps",
        "",
        "towers  images/s  per tower  step ms  efficiency  input wait  GFLOP/s  of peak  cpu ms/step  cores",
    ]
    for t in r["towers"]:
        util = f"{100 * t['flops_utilization']:6.1f}%" if t["flops_utilization"] is not None else "     -"
        lines.append(f"{t['gpus']:6d}  {t['images_per_sec']:8.2f}  {t['images_per_sec_per_tower']:9.2f}  "
                     f"{t['step_time_ms']:7.0f}  {t['efficiency']:10.3f}  {100 * t['input_wait_fraction']:9.1f}%  "
                     f"{t['achieved_gflops']:7.1f}  {util}  {t['cpu_ms_per_step']:11.0f}  {t['cores_busy']:5.2f}")
    lines.append("")
    if r["input_images_per_sec"] is not None:
        lines.append(f"input pipeline alone: {r['input_images_per_sec']:.1f} images/s")
    f = r["flops"]
    lines.append(f"train step: {f['train_gflop_per_image']:.3f} GFLOP/image (forward {f['forward_gflop_per_image']:.3f}, "
                 f"ratio {f['train_to_forward']:.2f}); {f['method']}")
    if r["peak"]:
        p = r["peak"]
        lines.append(f"measured peak ({p['dtype']}): matmul {p['matmul_gflops']:.0f} GFLOP/s, 3x3 conv "
                     f"{p['conv3x3_gflops']:.0f} GFLOP/s -> peak {p['peak_gflops']:.0f}")
    for v in r.get("variants", []):
        t = v["towers"][-1]
        util = f", {100 * t['flops_utilization']:.1f}% of peak" if t["flops_utilization"] is not None else ""
        lines.append(f"variant {v['name']}: {t['images_per_sec']:.2f} images/s at {t['gpus']} tower(s), step "
                     f"{t['step_time_ms']:.0f} ms, input wait {100 * t['input_wait_fraction']:.1f}%{util}; "
                     f"speedup {r['speedup_vs_first_variant'][v['name']]:.3f}x "
                     f"(by CPU time {r['cpu_speedup_vs_first_variant'][v['name']]:.3f}x)")
    for v in r.get("variants") or [{"name": "", "towers": r["towers"]}]:
        for t in v["towers"]:
            prof = t.get("op_profile")
            if prof:
                top = ", ".join(f"{k} {share:.0%}" for k, _, share in prof["top_ops"][:6])
                lines.append(f"op time {v['name']} gpus={t['gpus']}: convolutions {prof['conv_share_of_op_time']:.0%} "
                             f"of {prof['op_time_ms_per_step']:.0f} ms/step; top: {top}")
    lines.append(f"efficiency = {r['efficiency_definition']}")
    lines.append(f"input wait = {r['input_wait_definition']}")
    lines.append(f"peak resident memory: {r['peak_rss_mb']:.0f} MiB ({r['peak_rss_scope']})")
    return "\n".join(lines)
