"""One training run's parts, built the same way by seg-train (train.py) and seg-bench (bench/train_runner.py):
the state, the compiled step and the evaluator (`build_run`), then the loop around them (`Run.loop`): the
training batches, the summaries, the host side of each step and the step loop."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import tensorflow as tf

from seg_train.config import Config
from seg_train.data.feed import Feed
from seg_train.data.label_images import voc_colormap
from seg_train.infer import modes
from seg_train.infer.evaluate import Evaluator
from seg_train.run.state import TrainState
from seg_train.train.loop import HostSide, StepLoop
from seg_train.train.profiling import StepProfiler
from seg_train.train.step import TrainStep
from seg_train.train.summaries import Summaries


class Loop(NamedTuple):
    """The loop of a run (`Run.loop`): close `batches` (and flush `summaries`) when done."""
    batches: Feed
    summaries: Summaries
    host: HostSide
    steps: StepLoop


class Run(NamedTuple):
    """The parts of a training run (`build_run`)."""
    cfg: Config
    strategy: tf.distribute.Strategy
    state: TrainState
    train_step: TrainStep
    evaluator: Evaluator

    def loop(self, dist_data, start: int, write_dir: Path | str, bar=None, profiler: StepProfiler | None = None,
             trace_s: float = 0.0, first_step_path: Path | None = None, log_level: int = logging.INFO,
             host=None, stop_requested=lambda: False) -> Loop:
        """The step loop from step `start` over the distributed dataset `dist_data`, writing summaries under
        `write_dir`. `host`: what StepLoop hands each finished step to (default: the HostSide built here;
        seg-bench wraps it)."""
        cfg = self.cfg
        batches = Feed(dist_data)  # released without waiting for TensorFlow's teardown (data/feed.py)
        summaries = Summaries(write_dir, voc_colormap(), cfg.data.ignore_label, cfg.data.mean, cfg.data.std,
                              segment_classes=None if cfg.data.task == "semantic" else cfg.data.num_classes)
        profiler = profiler or StepProfiler(write_dir, None)
        side = HostSide(cfg, self.state, summaries, bar, self.strategy.num_replicas_in_sync, profiler, trace_s,
                        log_level=log_level, first_step_path=first_step_path)
        steps = StepLoop(self.train_step, batches, start, host or side, cfg.train.image_summary_every,
                         stop_requested)
        return Loop(batches, summaries, side, steps)


def build_run(cfg: Config, strategy: tf.distribute.Strategy, class_weights=None, eval_cfg=None) -> Run:
    """The state (model, optimizer, counters), the train step and the evaluator of `cfg` on `strategy`.

    `class_weights`: data/class_weights.py's, for loss.class_weights (and eval.logit_adjustment); `eval_cfg`: the
    evaluation settings when they differ from cfg.eval's (seg-train builds from a config without the start weights'
    files when it resumes, and evaluates with the run's own eval keys)."""
    eval_cfg = eval_cfg or cfg.eval
    state = TrainState(cfg, strategy)
    train_step = TrainStep(state, class_weights=class_weights)
    evaluator = Evaluator(state, eval_cfg, score_offsets=modes.score_offsets(eval_cfg, class_weights))
    return Run(cfg, strategy, state, train_step, evaluator)
