"""Checkpoints: tf.train.Checkpoint {model, optimizer (built, slots included), step} + CheckpointManager.

The data pipeline's position needs no state of its own: the stream is a pure function of
(seed, step) (see reader.py), so the step restores it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import tensorflow as tf

log = logging.getLogger("seg_train")


class Checkpointer:
    """Saves and restores the training state under `directory`.

    Args:
      directory: RUN_DIR/checkpoints.
      keep: checkpoints kept (the newest ones).
      **objects: trackables to save (model=..., optimizer=..., step=...).
    """

    def __init__(self, directory: Path, keep: int, **objects):
        self.directory = str(directory)
        self.checkpoint = tf.train.Checkpoint(**objects)
        self.manager = tf.train.CheckpointManager(self.checkpoint, str(directory), max_to_keep=keep)

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def restore_latest(self) -> str | None:
        """Restores the newest readable checkpoint, if any; returns its path.

        TensorFlow writes a checkpoint's files first and the `checkpoint` state file last (atomically),
        so a process killed mid-write leaves the state pointing at the previous, complete checkpoint.
        A checkpoint that is still unreadable (truncated files after a full disk) is skipped with a
        warning in favour of the one before it; if checkpoints exist but none is readable, that is
        an error rather than a silent restart from step 0.
        """
        state = tf.train.get_checkpoint_state(self.directory)
        if state is None:
            return None
        # Newest first: the state's newest entry, then every entry it lists (the manager's own list
        # leaves out entries without timestamps).
        paths = [state.model_checkpoint_path] + list(reversed(state.all_model_checkpoint_paths))
        candidates = dict.fromkeys(p if Path(p).is_absolute() else str(Path(self.directory) / p) for p in paths if p)
        for path in candidates:
            try:
                # assert_existing_objects_matched: every object we built must find its values, so an
                # optimizer whose slots were not built (keras#19389) fails loudly instead of silently.
                self.checkpoint.restore(path).assert_existing_objects_matched()
                return path
            except (tf.errors.OpError, IndexError, ValueError, AssertionError) as e:
                log.warning("skipping unreadable checkpoint %s (%s)", path, (str(e).splitlines() or [""])[0][:200])
        from seg_train.config import ConfigError
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
    from seg_train.config import ConfigError
    raise ConfigError("checkpoint not found", str(path), "expected a run dir, a checkpoints/ folder or a checkpoint prefix")
