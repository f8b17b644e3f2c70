"""train(cfg): the training run, top to bottom in named sections (setup and checks; model, optimizer,
restore; data; loop; final)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import tensorflow as tf

from seg_train import config as config_lib
from seg_train.config import Config, ConfigError, check_batch
from seg_train.data import layouts
from seg_train.data.reader import ImageReader
from seg_train.data.scan import class_weights_for_split, scan_for_training
from seg_train.data.split import open_split, train_dataset_fn
from seg_train.infer import evaluate, modes
from seg_train.infer.metrics import format_table
from seg_train.parallel import replicas
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run.rundir import FIRST_STEP_FILE, RunLock, check_resume_config, write_class_weights, write_json
from seg_train.train import determinism
from seg_train.train.loop import NonFiniteError
from seg_train.train.profiling import StepProfiler
from seg_train.train.run import build_run
from seg_train.train.summaries import Summaries
from seg_train.util import exit_codes
from seg_train.util.progress import progress_bar, shown
from seg_train.util.sysinfo import peak_rss_mb

log = logging.getLogger("seg_train")

EXIT_OK, EXIT_NONFINITE = exit_codes.OK, exit_codes.NONFINITE


def _progress(total: int, initial: int):
    """A tqdm bar on a terminal, None otherwise (then plain log lines are written)."""
    return progress_bar(total, unit="step", initial=initial, leave=True) if shown() else None


class _StopSignals:
    """SIGINT/SIGTERM: the first asks the loop to finish the current step, write a checkpoint and exit
    128 + its number; a second one (either signal) ends the process at once, exit 128 + its number.

    Why not a plain Python handler: it runs only between the main thread's bytecodes, never during a
    TensorFlow call, and two signals in one call look like one. Instead the C-level handler writes to
    a pipe (signal.set_wakeup_fd) read by a watcher thread. os._exit on the second signal is safe to
    resume from: the `checkpoint` state file is written last, and the kernel releases the flock.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = None
        self._old = {}
        self._old_wakeup = -1
        self._pipe = None
        self._watcher = None

    def __enter__(self):
        r, w = os.pipe()
        os.set_blocking(w, False)  # the C-level handler must never block (set_wakeup_fd insists)
        self._pipe = (r, w)
        self._watcher = threading.Thread(target=self._watch, args=(r,), name="seg-train-signals", daemon=True)
        self._watcher.start()
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in self.SIGNALS:
            self._old[s] = signal.signal(s, self._ignore)
        return self

    @staticmethod
    def _ignore(signum, frame):
        """The Python-level handler: the watcher thread has already seen the signal."""

    def _watch(self, fd: int) -> None:
        while True:
            data = os.read(fd, 64)
            if not data:  # the pipe was closed by __exit__
                return
            for signum in data:
                if signum not in self.SIGNALS:
                    continue
                name = signal.Signals(signum).name
                if self.signum is None:
                    self.signum = signum
                    log.warning("received %s: finishing this step, then writing a checkpoint (a second signal "
                                "stops at once, without one)", name)
                    continue
                os.write(2, f"error: interrupted again ({name} after {signal.Signals(self.signum).name}): "
                            "stopped at once, no checkpoint for the step in progress; rerun the same command to "
                            "resume from the newest checkpoint\n".encode())
                os._exit(exit_codes.signalled(signum))

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(self._old_wakeup)
        r, w = self._pipe
        os.close(w)  # the watcher reads end-of-file and returns
        self._watcher.join()
        os.close(r)


def open_val(cfg: Config) -> ImageReader | None:
    """The val split's reader for evaluation during training, or None (with a warning) if there is none."""
    val = open_split(cfg, cfg.data.val_split, optional=True)
    if val is None:
        log.warning("no val split %r (%s): no evaluation during training", cfg.data.val_split,
                    layouts.split_location(cfg.data, cfg.data.val_split))
        return None
    return val.reader


def run_evaluation(cfg: Config, evaluator: evaluate.Evaluator, reader: ImageReader, names: list[str],
                   summaries: Summaries, run_dir: Path, step: int, progress: bool) -> None:
    """Evaluates evaluator.state on the val split, logs, keeps the best.

    With train.ema_decay the averaged weights are evaluated (and kept in best/); the training weights
    and statistics are back in place afterwards.
    """
    state = evaluator.state
    with state.averaged_weights():
        reestimated = evaluator.maybe_reestimate_bn(cfg, progress)
        metrics, count = evaluator.evaluate(reader, names, progress=progress)
        evaluate.write_eval_summaries(summaries.writer, step, metrics, names)
        if hasattr(metrics, "headline"):  # panoptic / instance: mask_evaluate.MaskScores
            summaries.eval_segment_pictures(step, evaluator.predict_examples(reader))
        else:
            summaries.eval_pictures(step, metrics.confusion_matrix, names, evaluator.predict_examples(reader))
        improved = ckpt_lib.keep_best(run_dir, state, step, metrics)
    if hasattr(metrics, "headline"):
        log.info("eval at step %d on %d %s images (%sBN statistics %s): %s%s\n%s", step, count, cfg.data.val_split,
                 "EMA weights, " if state.ema is not None else "", "re-estimated" if reestimated else "as trained",
                 metrics.headline_text(), " (new best, kept in best/)" if improved else "", metrics.table())
        return
    log.info("eval at step %d on %d %s images (%s, %sBN statistics %s): mIoU %.2f%%, pixel accuracy %.2f%%%s\n%s",
             step, count, cfg.data.val_split, modes.describe(state.cfg.eval),
             "EMA weights, " if state.ema is not None else "",
             "re-estimated" if reestimated else "as trained", 100 * metrics.miou,
             100 * metrics.pixel_accuracy, " (new best, kept in best/)" if improved else "",
             format_table(metrics, names))


def _check_same_start(strategy, start: int) -> None:
    """Multi-worker: every worker must have restored the same step (RUN_DIR on shared storage)."""
    mean = strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(lambda: tf.constant(float(start))), axis=None)
    if abs(float(mean) - start) > 1e-6:
        raise ConfigError("workers restored different steps", "run_dir",
                          f"a run dir on storage shared by every worker (this worker is at step {start}, "
                          f"the group's mean is {float(mean):g})")


def train(cfg: Config, strategy: tf.distribute.Strategy, init_from: str | None = None,
          allow_config_change: bool = False) -> int:
    """Trains (or resumes) the run in cfg.run_dir. Returns the process exit code.

    Everything that can be checked is checked before anything is written to the run dir, so bad
    input never changes an existing run.
    """
    # ---- setup and checks (nothing written yet) --------------------------------------------------
    check_batch(cfg, strategy.num_replicas_in_sync)
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("run dir is a file", str(run_dir), "a directory (or a path that does not exist yet)")
    chief = replicas.is_chief(strategy)
    # Other workers write to a throw-away folder: multi-worker checkpointing needs every worker to save.
    lock = RunLock(run_dir) if chief else None
    if lock and run_dir.is_dir():
        lock.acquire()  # fail fast when another trainer owns the run dir
    scratch = None if chief else tempfile.TemporaryDirectory(prefix="seg-train-worker-")
    try:
        write_dir = run_dir if chief else Path(scratch.name)
        # Signals are caught from here on, so one arriving during the checks or tracing is handled too.
        with _StopSignals() as stop:
            return _train_locked(cfg, strategy, run_dir, write_dir, lock, init_from, allow_config_change, stop)
    finally:
        if lock:
            lock.release()
        if scratch:
            scratch.cleanup()


def _train_locked(cfg, strategy, run_dir, write_dir, lock, init_from, allow_config_change, stop) -> int:
    n = strategy.num_replicas_in_sync
    train_split = open_split(cfg, cfg.data.train_split)
    reader = train_split.reader
    val_reader = open_val(cfg)
    splits = [(reader, f"train ({cfg.data.train_split})")]
    if val_reader is not None:
        splits.append((val_reader, f"val ({cfg.data.val_split})"))
    train_report = scan_for_training(cfg, splits, strategy)[0]
    names = train_split.class_names
    class_weights = class_weights_for_split(cfg, reader, train_report, names)
    if cfg.train.deterministic:
        tf.config.experimental.enable_op_determinism()
    resuming = any((run_dir / "checkpoints").glob("ckpt-*.index"))
    if resuming:
        check_resume_config(cfg, run_dir, allow_config_change)

    # ---- model, optimizer, restore ----------------------------------------------------------------
    if stop.signum is not None:  # signalled during the checks: nothing written yet, nothing to save
        log.warning("interrupted by %s before training started", signal.Signals(stop.signum).name)
        return exit_codes.signalled(stop.signum)
    # Resuming: the checkpoint holds every weight; the start weights' file may have moved since.
    build_cfg = config_lib.without_weight_files(cfg) if resuming else cfg
    run = build_run(build_cfg, strategy, class_weights, eval_cfg=cfg.eval)
    state, train_step, evaluator = run.state, run.train_step, run.evaluator
    ckpt = ckpt_lib.Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints, **state.checkpoint_objects())
    restored = ckpt.restore_latest()
    if write_dir != run_dir:
        ckpt = ckpt_lib.Checkpointer(write_dir / "checkpoints", 1, **state.checkpoint_objects())
    if init_from and not restored:
        from seg_train.train.init_from import load_weights
        loaded, skipped = load_weights(state.model, init_from)
        log.info("initialised %d weights from %s; skipped %d with other shapes%s", loaded, init_from, len(skipped),
                 (": " + ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else "")) if skipped else "")
    start = int(state.step.numpy())
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        _check_same_start(strategy, start)
    if restored:
        log.info("resumed from step %d (%s)", start, restored)
    if start >= cfg.train.num_steps:
        log.info("run already complete: step %d of %d (%s)", start, cfg.train.num_steps, run_dir)
        return EXIT_OK

    batch = cfg.data.batch_size
    k_micro = cfg.train.accumulate_steps
    dist_data = state.distribute(train_dataset_fn(reader, batch, start_step=start, end_step=cfg.train.num_steps,
                                                  micro_batches=k_micro))
    # Trace the step now (the loop reuses this trace), so its cost is reported apart from the rest.
    t_trace = time.perf_counter()
    step_graph = train_step.concrete_function(dist_data.element_spec)
    trace_s = time.perf_counter() - t_trace
    if cfg.train.deterministic:
        # Such an op would raise only when it runs: refuse now, before anything is written.
        kind = "GPU" if any("GPU" in d.upper() for d in strategy.extended.worker_devices) else "CPU"
        determinism.check_graph(step_graph, kind)
        log.info("op determinism %s when the step was traced (train.deterministic); no op of the step lacks a "
                 "deterministic %s kernel", "on" if determinism.enabled() else "OFF", kind)

    # From here on the run is known to start: claim the run dir and write the resolved config.
    if lock is not None:
        if lock.fd is None:
            lock.acquire()
        lock.mark_owner()
    write_dir.mkdir(parents=True, exist_ok=True)
    config_lib.dump(cfg, write_dir / "config.yaml")
    if class_weights is not None:
        log.info("loss class weights (%s): %s", cfg.loss.class_weights if isinstance(cfg.loss.class_weights, str)
                 else "given", ", ".join(f"{n} {w:.3g}" for n, w in zip(names, class_weights)))
        write_class_weights(write_dir, cfg.loss.class_weights if isinstance(cfg.loss.class_weights, str)
                            else "config", names, class_weights)

    # ---- data and loop ------------------------------------------------------------------------------
    bar = _progress(cfg.train.num_steps, start)
    profiler = StepProfiler(write_dir, cfg.train.profile_steps)
    parts = run.loop(dist_data, start, write_dir, bar, profiler, trace_s, first_step_path=write_dir / FIRST_STEP_FILE,
                     stop_requested=lambda: stop.signum is not None)
    batches, summaries, loop, steps = parts
    summaries.config_text(start + 1, cfg, towers=n)  # the first step of this run segment
    log.info("training %s on %d tower(s): %d images, global batch %d (%d per tower)%s, steps %d..%d, run dir %s",
             state.model.name, n, len(reader), batch, batch // n,
             f" x {k_micro} micro-batches per update" if k_micro > 1 else "", start, cfg.train.num_steps, run_dir)

    # ---- loop ---------------------------------------------------------------------------------------
    t_cfg = cfg.train
    multiworker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    state_finite = tf.function(lambda: tf.reduce_all(
        [tf.reduce_all(tf.math.is_finite(v)) for v in state.model.weights + state.optimizer.variables
         if tf.as_dtype(v.dtype).is_floating]))
    status, saved_at = EXIT_OK, None

    def save_checked(at: int) -> str:
        # An update of finite gradients can still overflow: never write such a state.
        if not bool(state_finite()):
            raise NonFiniteError(f"non-finite weights or optimizer state after the update of step {at}")
        return ckpt.save(at)

    try:
        while steps.step < t_cfg.num_steps:
            group_stop = steps.dispatch()  # finishes the step before this one
            step = steps.step
            evaluate_now = val_reader is not None and ((t_cfg.eval_every and step % t_cfg.eval_every == 0)
                                                       or step == t_cfg.num_steps)
            checkpoint_now = step % t_cfg.checkpoint_every == 0 or step == t_cfg.num_steps
            # With several workers only the all-reduced flag decides, so all stop after the same step.
            stopping = group_stop or (stop.signum is not None and not multiworker)
            if not (evaluate_now or checkpoint_now or stopping):
                continue
            group_stop = steps.drain() or group_stop
            stopping = group_stop or (stop.signum is not None and not multiworker)
            # Evaluate first: BN re-estimation changes the statistics, and a resumed run must match.
            if evaluate_now:
                run_evaluation(cfg, evaluator, val_reader, names, summaries, write_dir, step, bar is not None)
                loop.restart_clock()  # evaluation is not training time
            if checkpoint_now:
                save_checked(step)
                saved_at = step
            if stopping and step < t_cfg.num_steps:
                path = ckpt.latest if saved_at == step else save_checked(step)
                signum = stop.signum or signal.SIGTERM  # a peer worker was signalled
                log.warning("interrupted by %s at step %d: checkpoint %s written; rerun the same command "
                            "to resume", "a peer worker" if stop.signum is None else signal.Signals(signum).name,
                            step, path if write_dir == run_dir else run_dir / "checkpoints")
                status = exit_codes.signalled(signum)
                break
        steps.drain()
    except NonFiniteError as e:
        print(f"error: {e} (not saved; newest checkpoint: {ckpt.latest}): a finite loss; lower "
              "train.learning_rate, or set train.on_nan: skip_step to skip such steps", file=sys.stderr)
        status = EXIT_NONFINITE
    finally:
        batches.close()
        if bar is not None:
            bar.close()
        profiler.close()
        summaries.flush()

    # ---- final ----------------------------------------------------------------------------------------
    log.debug("steps %d..%d ended at (s after launch): %s", start + 1, steps.step,
              " ".join(f"{since:.2f}" for _, _, since in steps.finished))
    if status == EXIT_OK:
        peak = peak_rss_mb()
        log.info("peak resident memory %.0f MiB", peak)
        if loop.first_step_record is not None:  # the first step's record, with the whole run's peak memory
            write_json(write_dir / FIRST_STEP_FILE, dict(loop.first_step_record, peak_rss_mb=peak))
        log.info("done: step %d, loss %.4f; checkpoints in %s", t_cfg.num_steps, loop.last_loss,
                 run_dir / "checkpoints")
        log.info("view with: tensorboard --logdir %s", run_dir)
    return status
