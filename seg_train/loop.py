"""The step loop shared by seg-train (train.py) and seg-bench (bench.TrainRunner).

The host never waits for a step before dispatching the next one: step k's outputs (losses,
finiteness, norms) are read after step k+1 has been dispatched, so a device is never idle between
steps. The learning rate comes from the host's own step counter (reading the device's counter
would make the host wait for the step before). Before a checkpoint, an evaluation, the last step
or a stop, the caller drains the loop: it waits for the pending step and does its bookkeeping.

Because seg-bench times this same loop, with the same per-step host work (train.py's `_Loop`:
summaries, log lines, non-finite checks), its images/s is what seg-train delivers.
"""

from __future__ import annotations

import statistics
import time

from seg_train.sysinfo import seconds_since_launch

WAITED_S = 0.01  # a read of a step's output that takes longer waited for the step to end (not a busy host)
STEADY_TOLERANCE = 0.10  # a step is "steady" when its time is within 10% of the steady-state step time


class StepLoop:
    """Dispatches train steps and hands each step's outputs to `host.finish` one step late.

    Args:
      train_step: a TrainStep (called per step; its state's learning_rate gives each step's rate).
      batches: an iterator over the distributed dataset.
      start: the step counter before the first dispatched step.
      host: the host side of a step: `finish(pending, ended) -> bool` (whether the group asked to stop;
        ended: when the step ended, perf_counter), and
        optionally `before_step(step)`; pending is (step, outputs, batch, learning rate, want_images).
      image_summary_every: train.image_summary_every (0: never); the first step always has images.
      stop_requested: () -> bool, the host's stop flag, fed to every step.
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
        lr = self.train_step.state.learning_rate(step)
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
        # When did the step end? If reading an output waits, at the end of the wait (a device that
        # runs the step after train_step returned); if not, the step had ended by the time train_step
        # returned (a call that runs the whole step, as on CPU): then, not at this read, which comes
        # after the next step's dispatch.
        t0 = time.perf_counter()
        pending[1].stop.numpy()
        t1 = time.perf_counter()
        end = t1 if t1 - t0 > WAITED_S else pending[5]
        self.finished.append((pending[0], end, end + self.launch_offset))
        return self.host.finish(pending[:5], ended=end)


def step_times(finished: list) -> list[float]:
    """Seconds of each step in StepLoop.finished but the first (end of the step before to its own end;
    the first has no start in this clock)."""
    ends = [t for _, t, _ in finished]
    return [b - a for a, b in zip(ends, ends[1:])]


def warmup(step_times: list[float], steady: float | None = None, tolerance: float = STEADY_TOLERANCE) -> int:
    """The number of steps before the first one whose time is within `tolerance` of the steady state.

    steady defaults to the median of the second half of step_times (a run long enough to settle).
    Returns len(step_times) if no step gets there.
    """
    if not step_times:
        return 0
    if steady is None:
        steady = statistics.median(step_times[len(step_times) // 2:])
    for i, t in enumerate(step_times):
        if t <= steady * (1.0 + tolerance):
            return i
    return len(step_times)
