"""The step loop shared by seg-train (train.py) and seg-bench (bench.train_runner.TrainRunner).

Step k's outputs are read after step k+1 has been dispatched, so the device is never idle between
steps; the learning rate comes from the host's own step counter for the same reason. Before a
checkpoint, an evaluation, the last step or a stop, the caller drains the loop.

seg-bench times this same loop with the same host work (`HostSide`), so its images/s is seg-train's.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from seg_train.run import loss_scale
from seg_train.run.rundir import write_json
from seg_train.util.sysinfo import seconds_since_launch

if TYPE_CHECKING:
    from seg_train.config import Config
    from seg_train.run.state import TrainState
    from seg_train.train.summaries import Summaries

log = logging.getLogger("seg_train")

WAITED_S = 0.01  # a read of a step's output that takes longer waited for the step to end (not a busy host)


class StepLoop:
    """Dispatches train steps and hands each step's outputs to `host.finish` one step late.

    Args:
      host: `finish(pending, ended) -> bool` (whether the group asked to stop; ended: perf_counter
        time the step ended), optionally `before_step(step)`; pending is (step, outputs, batch, (head, backbone) lr,
        want_images).
      image_summary_every: train.image_summary_every (0: never); the first step always has images.
    """

    def __init__(self, train_step, batches, start: int, host, image_summary_every: int = 0,
                 stop_requested=lambda: False):
        self.train_step, self.batches, self.host = train_step, batches, host
        self.start = self.step = start
        self.image_summary_every = image_summary_every
        self.stop_requested = stop_requested
        self.pending = None
        self.last_input_wait = 0.0  # seconds blocked in next(batches) by the last dispatch
        self.launch_offset = seconds_since_launch() - time.perf_counter()
        # (step, perf_counter, seconds since launch) when each step ended (see _finish).
        self.finished: list[tuple[int, float, float]] = []

    def want_images(self, step: int) -> bool:
        """Whether the update made at `step` (0-based, as the learning rate) returns image summaries."""
        every = self.image_summary_every
        return bool(every) and ((step + 1) % every == 0 or step == self.start)

    def dispatch(self) -> bool:
        """Dispatches the next step, then finishes the one before it (if any); returns whether that
        finished step asked the group to stop."""
        step = self.step
        before = getattr(self.host, "before_step", None)
        if before is not None:
            before(step + 1)
        t0 = time.perf_counter()
        batch = next(self.batches)
        self.last_input_wait = time.perf_counter() - t0
        want_images = self.want_images(step)
        lr = self.train_step.state.learning_rates(step)
        out = self.train_step(batch, lr, self.stop_requested(), want_images)
        dispatched = time.perf_counter()
        self.step = step + 1
        stop = self._finish(self.pending) if self.pending is not None else False
        self.pending = (self.step, out, batch, lr, want_images, dispatched)
        return stop

    def drain(self) -> bool:
        """Waits for the pending step and does its bookkeeping; returns whether it asked to stop."""
        if self.pending is None:
            return False
        pending, self.pending = self.pending, None
        return self._finish(pending)

    def _finish(self, pending) -> bool:
        # The step ended at the end of the read if the read waited; else it had ended when its
        # train_step call returned (on CPU the call runs the whole step).
        t0 = time.perf_counter()
        pending[1].stop.numpy()
        t1 = time.perf_counter()
        end = t1 if t1 - t0 > WAITED_S else pending[5]
        self.finished.append((pending[0], end, end + self.launch_offset))
        return self.host.finish(pending[:5], ended=end)


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient or BN statistics update (train.on_nan: stop)."""


class HostSide:
    """The host side of each step (seg-train's and seg-bench's): reads its outputs, logs, writes summaries,
    decides on non-finite steps. The first step's record goes to `first_step_path` (None: nowhere)."""

    def __init__(self, cfg: Config, state: TrainState, summaries: Summaries, bar, num_towers: int, profiler,
                 trace_s: float = 0.0, log_level: int = logging.INFO, first_step_path: Path | None = None):
        self.cfg, self.state, self.summaries, self.bar, self.profiler = cfg, state, summaries, bar, profiler
        self.log_level = log_level  # of the per-step lines (seg-bench does the same work, but quietly)
        self.trace_s, self.loop_start = trace_s, time.perf_counter()
        self.images_per_step = cfg.data.batch_size * cfg.train.accumulate_steps
        self.skipped = 0
        self.overflows = 0  # float16 loss-scale overflows (mixed_float16), skipped by design
        self.first = True
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.images_per_sec = float("nan")
        self.last_loss = float("nan")
        self.micro = cfg.data.batch_size // num_towers  # rows of micro-batch 0 in each tower's slice
        self.first_step_path = first_step_path
        self.first_step_record: dict | None = None

    def restart_clock(self) -> None:
        self.window_start, self.window_steps = time.perf_counter(), 0

    def before_step(self, step: int) -> None:
        self.profiler.before_step(step)

    def finish(self, pending, ended: float | None = None) -> bool:
        """Bookkeeping of one dispatched step; returns whether the group asked to stop after it.

        ended: when the step ended (perf_counter, from StepLoop), if earlier than now."""
        step, out, dist_batch, rates, want_images = pending
        lr = rates[0]
        t_cfg = self.cfg.train
        applied = bool(out.applied)
        loss = float(out.loss)
        self.last_loss = loss
        if not applied:
            finite = out.finite.numpy()
            used = float(out.loss_scale_used)
            if loss_scale.is_overflow(t_cfg.precision == "mixed_float16", bool(out.loss_finite), used,
                                      out.bn_finite.numpy()):
                self.overflows += 1
                log.info("loss-scale overflow at step %d (scale %g): update skipped, loss scale now %g "
                         "(%d overflow(s) so far)", step, used, float(out.loss_scale), self.overflows)
            else:
                bad_grad = [i for i, f in enumerate(out.loss_grad_finite.numpy()) if not f]
                bad_bn = [i for i, f in enumerate(out.bn_finite.numpy()) if not f]
                if bad_grad or not bad_bn:
                    # With no tower's own values non-finite, their reduced sum overflowed: every tower.
                    towers = bad_grad or list(range(len(finite)))
                    msg = f"non-finite loss or gradient at step {step} on tower(s) {towers}"
                    if bad_bn:
                        msg += f" and BN statistics on tower(s) {bad_bn}"
                else:
                    msg = f"non-finite BN statistics at step {step} on tower(s) {bad_bn}"
                at_scale = f", loss scale {used:g}" if t_cfg.precision == "mixed_float16" else ""
                msg += f" (loss {loss:.4g}, learning rate {lr:.3g}{at_scale})"
                if t_cfg.on_nan == "stop":
                    raise NonFiniteError(msg)
                self.skipped += 1
                log.warning("%s: update skipped (train.on_nan: skip_step; %d skipped so far)", msg, self.skipped)
        if self.first:  # tracing and the first step never count towards throughput
            # Its cost as TensorFlow lets it be split: tracing, then optimisation + first execution.
            now = time.perf_counter()
            ended = now if ended is None else ended
            record = {"step": step, "first_step_s": seconds_since_launch() - (now - ended), "tracing_s": self.trace_s,
                      "first_call_s": ended - self.loop_start}
            log.log(self.log_level, "first step done %.1fs after launch: tracing %.1fs, graph optimisation and first "
                    "execution %.1fs", record["first_step_s"], record["tracing_s"], record["first_call_s"])
            self.first_step_record = record
            if self.first_step_path is not None:
                write_json(self.first_step_path, record)
            self.restart_clock()
            self.first = False
        else:
            self.window_steps += 1
        if step % t_cfg.summary_every == 0 or step == t_cfg.num_steps:
            self._scalars(step, out, rates, loss)
        if want_images:
            self._images(step, out, dist_batch)
        if self.bar is not None:
            self.bar.update(1)
        # After the step's outputs were read: the step has finished, so a trace ending here holds it all.
        self.profiler.after_step(step)
        return bool(out.stop)

    def _scalars(self, step, out, rates, loss) -> None:
        lr = rates[0]
        elapsed = time.perf_counter() - self.window_start
        if self.window_steps:
            self.images_per_sec = self.window_steps * self.images_per_step / max(elapsed, 1e-9)
        self.restart_clock()
        gnorm = float(out.global_norm)
        scalars = {"loss/total": loss, "loss/weight_decay": float(out.weight_decay), "learning_rate": lr,
                   "gradients/global_norm": gnorm, "gradients/clipped": float(bool(out.clipped))}
        if self.cfg.train.backbone_warmup_steps:  # two-stage warmup: the backbone has its own rate
            scalars["learning_rate/backbone"] = rates[1]
        # Every tower of the group (all workers): the values travel in the step's all-reduce.
        for i, ce in enumerate(out.tower_ce.numpy()):
            scalars[f"loss/tower_{i}"] = ce
        for i, g in enumerate(out.tower_grad_norm.numpy()):
            scalars[f"gradients/norm/tower_{i}"] = g
        if self.skipped:
            scalars["train/skipped_steps"] = self.skipped
        mixed16 = self.cfg.train.precision == "mixed_float16"
        if mixed16:  # the scale after this step's update: halved on an overflow
            scalars["train/loss_scale"] = float(out.loss_scale)
        if not math.isnan(self.images_per_sec):
            scalars["throughput/images_per_sec"] = self.images_per_sec
        self.summaries.scalars(step, scalars)
        self.summaries.tower_scalars(step, "loss/tower", out.tower_ce.numpy())
        self.summaries.tower_scalars(step, "gradients/norm/tower", out.tower_grad_norm.numpy())
        t_cfg = self.cfg.train
        scale = {"loss_scale": f"{float(out.loss_scale):g}"} if mixed16 else {}
        if self.bar is None:
            log.log(self.log_level, "step %d/%d  loss %.4f  gnorm %.3g  lr %.3g%s  %.1f img/s", step, t_cfg.num_steps,
                    loss, gnorm, lr, f"  loss scale {scale['loss_scale']}" if scale else "", self.images_per_sec)
        else:
            self.bar.set_postfix(loss=f"{loss:.4f}", gnorm=f"{gnorm:.3g}", lr=f"{lr:.2e}", **scale,
                                 img_s=f"{self.images_per_sec:.1f}")

    def _images(self, step, out, dist_batch) -> None:
        images, labels = dist_batch
        local = self.state.strategy.experimental_local_results
        b = self.micro
        self.summaries.triplets(step, [(im.numpy()[:b], lb.numpy()[:b], pr.numpy()) for im, lb, pr in
                                       zip(local(images), local(labels), out.preds)])
        self.summaries.histogram(step, "gradients/per_variable_norm", out.var_grad_norms.numpy())
