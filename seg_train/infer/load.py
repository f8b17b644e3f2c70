"""A trained model for seg-eval, seg-predict and seg-export: a TrainState loaded from a checkpoint, and
the gate that re-estimates its BN statistics before use (eval.bn_reestimate_batches).

"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import tensorflow as tf

from seg_train import checkpoint as ckpt_lib
from seg_train import config as config_lib
from seg_train.config import Config, ConfigError
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
