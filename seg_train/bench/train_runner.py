"""TrainRunner: seg-train's real step and loop on some towers, timed in windows; interleaved timing, warm-up."""

from __future__ import annotations

import gc
import logging
import statistics
import time

import numpy as np

from seg_train.bench.machine import median
from seg_train.config import Config
from seg_train.data.feed import Feed

log = logging.getLogger("seg_train")


def _cached_dataset_fn(reader, global_batch: int, num_distinct_steps: int, micro_batches: int = 1):
    """A dataset_fn repeating the reader's first `num_distinct_steps` batches from memory: no input cost."""
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

    The steps include seg-train's per-step host work (`loop.HostSide`: summaries, log line, non-finite
    checks, into a throw-away folder), so the images/s measured is what seg-train delivers.

    Args:
      cfg: resolved config (data.batch_size is the GLOBAL batch of one micro-batch).
      input_mode: "reader" (the real pipeline) or "cached" (the same batches from memory).
      loop: "overlapped" (train.py's: step k read after step k+1 is dispatched) or "blocking".
      class_weights: loss.class_weights as computed for training (median_frequency needs the scan).
    """

    def __init__(self, name: str, cfg: Config, devices, reader, input_mode: str = "reader", loop: str = "overlapped",
                 class_weights=None):
        import tempfile

        from seg_train.data.split import train_dataset_fn
        from seg_train.parallel import replicas
        from seg_train.train.run import build_run

        self.name, self.cfg, self.input_mode, self.loop = name, cfg, input_mode, loop
        self.num_towers = len(devices.names)
        self.batch = cfg.data.batch_size
        k = cfg.train.accumulate_steps
        self.images_per_step = self.batch * k
        self.strategy = replicas.strategy_for(cfg.train, devices)
        self.build_start = t0 = time.perf_counter()
        run = build_run(cfg, self.strategy, class_weights)  # as seg-train builds it (train/run.py)
        # measure_eval's evaluation and measure_bn_reestimate's precise BN use the run's evaluator, as train.py's
        self.state, self.train_step, self.evaluator = run.state, run.train_step, run.evaluator
        self.build_s = time.perf_counter() - t0
        batch = self.batch
        if input_mode == "cached":
            dataset_fn = _cached_dataset_fn(reader, batch, 8, k)
        else:  # endless: read until close() releases the Feed
            dataset_fn = train_dataset_fn(reader, batch, start_step=0, end_step=None, micro_batches=k)
        self.dataset = self.state.distribute(dataset_fn)
        self.scratch = tempfile.TemporaryDirectory(prefix="seg-bench-summaries-")
        # seg-train's loop and host side, quietly, its summaries into a throw-away folder; this runner is the host
        # StepLoop reports to (it keeps each step's loss).
        parts = run.loop(self.dataset, 0, self.scratch.name, log_level=logging.DEBUG, host=self)
        self.batches, self.summaries, self.host, self.steps = parts
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
        """Untimed steps: the first traces, the rest let tf.data's autotuning settle. The second call is
        execution alone, so graph_optimization_s ~ first call - second call."""
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
        """Steps until the step time is within STEADY_TOLERANCE of the timed windows' median, and when
        (from launch and from build); `reached` is false if the warm-up was too short."""
        ends = self.warmup_finished
        times = step_times(ends)  # steps 2, 3, ...
        steady = median(self.step_ms) / 1e3
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
        rate = median(self.rates)
        if not all(np.isfinite(self.losses)):
            log.warning("%s: non-finite loss while benchmarking", self.name)
        return {"gpus": self.num_towers, "images_per_sec": rate, "images_per_sec_per_tower": rate / self.num_towers,
                "images_per_step": self.images_per_step, "accumulate_steps": self.cfg.train.accumulate_steps,
                "step_time_ms": median(self.step_ms), "input_wait_fraction": median(self.waits),
                "cpu_ms_per_step": median(self.cpu_ms), "cores_busy": median(self.cores),
                "window_images_per_sec": list(self.rates), "window_input_wait_fraction": list(self.waits),
                "first_step_s": self.first_step_s, "first_step_in_process": self.first_step,
                "last_loss": self.losses[-1] if self.losses else None, **self.graph_counts()}

    def graph_counts(self) -> dict:
        """All-reduce ops and cross-tower-scope graph ops per step, read from the traced step."""
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
    """Seconds of precise-BN re-estimation on `images` images: first run (traces) and a repeat."""
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
    """Evaluation images/s of `val_reader` on this runner's towers, timed after a first (tracing) pass."""
    t0 = time.perf_counter()
    runner.evaluator.evaluate(val_reader, names, progress=False)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, count = runner.evaluator.evaluate(val_reader, names, progress=False)
    seconds = time.perf_counter() - t0
    return {"eval_images_per_sec": count / seconds, "eval_images": count, "eval_first_pass_s": first}


def interleave(runners: list, steps: int, windows: int, warmup: int, pickup: int = 1) -> None:
    """Warms every runner up, then times their windows in turn (A B C, C B A, ...: robust to changing load);
    with several runners, `pickup` untimed steps start each window so none pays for following another."""
    for r in runners:
        log.info("%s: warming up (%d steps, the first one traces)", r.name, warmup)
        r.warmup(warmup)
        log.info("%s: first step %.1fs", r.name, r.first_step_s)
    reentry = pickup if len(runners) > 1 else 0
    for w in range(windows):
        for r in (runners if w % 2 == 0 else runners[::-1]):
            r.window(steps, reentry)
            log.debug("%s: window %d: %.2f images/s", r.name, w, r.rates[-1])



# ---- the warm-up as the loop saw it ---------------------------------------------------------------------
STEADY_TOLERANCE = 0.10  # a step is "steady" when its time is within 10% of the steady-state step time


def step_times(finished: list) -> list[float]:
    """Seconds of each step in StepLoop.finished but the first (which has no start on this clock)."""
    ends = [t for _, t, _ in finished]
    return [b - a for a, b in zip(ends, ends[1:])]


def warmup(step_times: list[float], steady: float | None = None, tolerance: float = STEADY_TOLERANCE) -> int:
    """The number of steps before the first one whose time is within `tolerance` of the steady state.

    steady defaults to the median of step_times' second half; len(step_times) if no step gets there.
    """
    if not step_times:
        return 0
    if steady is None:
        steady = statistics.median(step_times[len(step_times) // 2:])
    for i, t in enumerate(step_times):
        if t <= steady * (1.0 + tolerance):
            return i
    return len(step_times)
