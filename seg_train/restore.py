"""A trained model for seg-eval, seg-predict and seg-export: a TrainState loaded from a checkpoint, and
the gate that re-estimates its BN statistics before use (eval.bn_reestimate_batches).

Also used by train.py before each evaluation during training (`maybe_reestimate_bn`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import tensorflow as tf

from seg_train import bn_stats
from seg_train import checkpoint as ckpt_lib
from seg_train import config as config_lib
from seg_train.config import Config, ConfigError
from seg_train.reader import ImageReader, ensure_data, split_file
from seg_train.state import TrainState

log = logging.getLogger("seg_train")


def run_dir_of(prefix: str) -> Path:
    """RUN_DIR of a checkpoint prefix RUN_DIR/checkpoints/ckpt-K (or RUN_DIR/best/ckpt-K)."""
    folder = Path(prefix).parent
    return folder.parent if folder.name in ("checkpoints", ckpt_lib.BEST_DIR) else folder


def _mismatch(e: Exception) -> str:
    """A short description of a failed restore: the variable and both shapes if Keras names them."""
    text = str(e).strip()
    m = re.search(r"variable\.shape=(\([^)]*\)), Received: value\.shape=(\([^)]*\)).*?path=([^,]+)", text, re.DOTALL)
    if m:
        return f"{m.group(3)} has shape {m.group(1)} in this model, {m.group(2)} in the checkpoint"
    return text.splitlines()[0][:300] if text else type(e).__name__


def load_state(cfg: Config, strategy: tf.distribute.Strategy, checkpoint: str):
    """Builds a TrainState for `cfg` (without an optimizer) and loads the weights of CKPT_OR_RUN_DIR into it.

    Returns:
      (state, checkpoint prefix, the checkpoint's step).
    """
    prefix = os.path.abspath(ckpt_lib.resolve(checkpoint))
    # The checkpoint holds every weight: the ImageNet file the run started from is not read again
    # (it may have moved since). The loss's class weights change no variable and no prediction, and
    # a named scheme (median_frequency) would need the train split's histogram: not needed here.
    cfg = config_lib.replace(config_lib.replace(cfg, "model.backbone_weights", None), "loss.class_weights", None)
    state = TrainState(cfg, strategy, optimizer=False)  # inference: no optimizer slots are built or read
    try:
        step = state.restore_weights(prefix)
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        # A checkpoint of another model (backbone, channels, num_classes) fails here.
        raise ConfigError("checkpoint does not fit the model", prefix,
                          f"expected a checkpoint of the model this config builds (model.*, data.num_classes): "
                          f"{_mismatch(e)}") from None
    if state.ema_restored:
        state.use_averaged_weights()
        log.info("using the exponential moving average of the weights (train.ema_decay)")
    return state, prefix, step


def maybe_reestimate_bn(state, cfg: Config, progress: bool = True) -> bool:
    """Re-estimates the BN statistics if eval.bn_reestimate_batches > 0.

    Returns:
      Whether the BN statistics match the weights (re-estimated now or before the checkpoint).
    """
    if cfg.eval.bn_reestimate_batches > 0 and int(state.bn_stats_step.numpy()) != int(state.step.numpy()):
        ensure_data(cfg)  # the re-estimation reads the training split
        if not split_file(cfg.data.root, cfg.data.train_split).is_file():
            # Predicting or exporting where the training data is not at hand: go on with the
            # statistics as trained, and say so.
            log.warning("BN statistics not re-estimated: training split %r not found under %s "
                        "(eval.bn_reestimate_batches needs it)", cfg.data.train_split, cfg.data.root)
            return False
        train_reader = ImageReader(cfg.data, cfg.data.train_split, cfg.seed)
        bn_stats.reestimate(state, train_reader, cfg.eval.bn_reestimate_batches, progress=progress)
    return int(state.bn_stats_step.numpy()) == int(state.step.numpy())
