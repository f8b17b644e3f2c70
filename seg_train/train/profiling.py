"""train.profile_steps: a TensorFlow profiler trace of training steps a..b for TensorBoard's Profile tab.

Written under RUN_DIR/plugins/profile/ (needs tensorboard-plugin-profile); each step is marked with a
step trace so the Profile tab splits the time by step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import tensorflow as tf

from seg_train.config import exception_text

log = logging.getLogger("seg_train")


class StepProfiler:
    """Starts the profiler before step a and stops it after step b (steps counted from 1).

    The loop calls `before_step(n)`, `after_step(n)` once its results are fetched, and `close()` on
    the way out (a failed run still writes its trace).
    `steps`: (a, b) from train.profile_steps, or None (then every call does nothing).
    """

    def __init__(self, logdir: Path, steps: tuple[int, int] | None):
        self.logdir, self.steps = Path(logdir), steps
        self.active = False
        self._step_trace = None

    def before_step(self, step: int) -> None:
        """Call just before the step that will be number `step` runs."""
        if self.steps is None:
            return
        a, b = self.steps
        if not self.active and a <= step <= b:
            try:
                tf.profiler.experimental.start(str(self.logdir))
            except (tf.errors.OpError, RuntimeError) as e:  # e.g. another profiler session is running
                log.warning("profiler not started for train.profile_steps %s: %s", list(self.steps),
                            exception_text(e))
                self.steps = None
                return
            self.active = True
            log.info("profiling steps %d..%d (train.profile_steps)", step, b)
        if self.active:
            self._step_trace = tf.profiler.experimental.Trace("train", step_num=step, _r=1)
            self._step_trace.__enter__()

    def after_step(self, step: int) -> None:
        """Call when step number `step` is done; stops the profiler after step b."""
        if self._step_trace is not None:
            self._step_trace.__exit__(None, None, None)
            self._step_trace = None
        if self.active and step >= self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stops the profiler if it runs and writes the trace (safe to call more than once)."""
        if self._step_trace is not None:
            self._step_trace.__exit__(None, None, None)
            self._step_trace = None
        if not self.active:
            return
        self.active = False
        tf.profiler.experimental.stop()
        runs = sorted((self.logdir / "plugins" / "profile").glob("*/"), key=lambda p: p.stat().st_mtime)
        log.info("profile written to %s (TensorBoard's Profile tab; pip install tensorboard-plugin-profile)",
                 runs[-1] if runs else self.logdir / "plugins" / "profile")
