"""Checkpoints of a run: the training state under RUN_DIR/checkpoints/, the best weights under RUN_DIR/best/.

A training checkpoint (`Checkpointer`) holds `TrainState.checkpoint_objects`; the data position
needs no state, being a pure function of (seed, step) (reader.py). The best checkpoint
(`keep_best`) holds model, step and bn_stats_step only, with best.json beside it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import tensorflow as tf

from seg_train.config import ConfigError, exception_text
from seg_train.run.rundir import write_json

log = logging.getLogger("seg_train")

BEST_DIR, BEST_JSON = "best", "best.json"


class Checkpointer:
    """Saves and restores the trackables `objects` under `directory`, keeping the newest `keep`."""

    def __init__(self, directory: Path, keep: int, **objects):
        self.directory = str(directory)
        self.checkpoint = tf.train.Checkpoint(**objects)
        self.manager = tf.train.CheckpointManager(self.checkpoint, str(directory), max_to_keep=keep)

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def restore_latest(self) -> str | None:
        """Restores the newest readable checkpoint, if any; returns its path.

        An unreadable checkpoint (e.g. truncated by a full disk) is skipped with a warning for the one
        before it; if none is readable that is an error, not a silent restart from step 0.
        """
        state = tf.train.get_checkpoint_state(self.directory)
        if state is None:
            return None
        # Newest first, from the state file itself (the manager's list skips entries without timestamps).
        paths = [state.model_checkpoint_path] + list(reversed(state.all_model_checkpoint_paths))
        candidates = dict.fromkeys(p if Path(p).is_absolute() else str(Path(self.directory) / p) for p in paths if p)
        for path in candidates:
            try:
                # Every object we built must find its values: an optimizer without built slots fails loudly.
                self.checkpoint.restore(path).assert_existing_objects_matched()
                return path
            except (tf.errors.OpError, IndexError, ValueError, AssertionError) as e:
                log.warning("skipping unreadable checkpoint %s (%s)", path, exception_text(e)[:200])
        raise ConfigError("no readable checkpoint", str(self.directory),
                          f"at least one complete checkpoint among {', '.join(Path(p).name for p in candidates)} "
                          "(move the folder away to start over)")

    def save(self, step: int) -> str:
        return self.manager.save(checkpoint_number=step)


def resolve(path: str | Path) -> str:
    """A checkpoint prefix from a prefix, a checkpoints/ folder or a run dir (newest checkpoint)."""
    p = Path(path)
    for d in (p / "checkpoints", p):
        if d.is_dir():
            latest = tf.train.latest_checkpoint(str(d))
            if latest:
                return latest
    if Path(str(p) + ".index").is_file():
        return str(p)
    raise ConfigError("checkpoint not found", str(path),
                      "expected a run dir, a checkpoints/ folder or a checkpoint prefix")


def read_best(run_dir: Path) -> dict | None:
    """RUN_DIR/best/best.json ({'step', 'miou', 'pixel_accuracy', 'checkpoint'}; panoptic / instance: 'pq' / 'ap'
    instead of the last two), or None if there is no best yet."""
    path = Path(run_dir) / BEST_DIR / BEST_JSON
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def keep_best(run_dir: Path, state, step: int, metrics) -> bool:
    """Saves the weights under RUN_DIR/best/ if the task's headline metric beats the best so far: mIoU, or for
    data.task panoptic / instance PQ / mask AP (the scores' `headline` names it, their `value` holds it).

    The checkpoint is written first, then best.json atomically: a crash in between leaves the better
    checkpoint with the older best.json, never a half-written file. `step` names the checkpoint.

    `state`: a TrainState (model, step and bn_stats_step saved); `metrics`: this evaluation's
    SegMetrics (or infer/mask_evaluate.py's MaskScores). Returns True if the metric improved and the checkpoint
    was written.
    """
    best_dir = Path(run_dir) / BEST_DIR
    best = read_best(run_dir)
    name, value = (metrics.headline, metrics.value) if hasattr(metrics, "headline") else ("miou", metrics.miou)
    if best is not None and not value > best.get(name, float("-inf")):
        return False
    ckpt = tf.train.Checkpoint(model=state.model, step=state.step, bn_stats_step=state.bn_stats_step)
    manager = tf.train.CheckpointManager(ckpt, str(best_dir), max_to_keep=1)
    prefix = manager.save(checkpoint_number=step)
    record = {"step": int(step), name: value}
    if name == "miou":
        record["pixel_accuracy"] = metrics.pixel_accuracy
    write_json(best_dir / BEST_JSON, {**record, "checkpoint": Path(prefix).name})
    return True
