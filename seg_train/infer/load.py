"""A trained model for seg-eval, seg-predict and seg-export: a TrainState loaded from a checkpoint
(`load_state`), and the Evaluator the commands use it through (`load_evaluator`: the inference modes,
the logit adjustment's offsets from the run's class weights, and the BN gate, eval.bn_reestimate_batches).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import tensorflow as tf

from seg_train import config as config_lib
from seg_train.config import Config, ConfigError
from seg_train.data.split import class_names_of
from seg_train.infer import modes
from seg_train.infer.evaluate import Evaluator
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run.state import TrainState

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


def inference_class_weights(cfg: Config, prefix: str, class_names: list[str] | None = None):
    """The loss's class weights eval.logit_adjustment divides out (None when it is 0): the config's list,
    or for a named scheme the weights the run trained with, from RUN_DIR/class_weights.json (no scan of
    the train split). `class_names`: the config's, when the caller has them."""
    if not cfg.eval.logit_adjustment:
        return None
    if isinstance(cfg.loss.class_weights, list):
        return cfg.loss.class_weights
    from seg_train.run.rundir import read_class_weights

    names = class_names if class_names is not None else class_names_of(cfg)
    return read_class_weights(run_dir_of(prefix), names, cfg.loss.class_weights)


def load_state(cfg: Config, strategy: tf.distribute.Strategy, checkpoint: str | None):
    """Builds a TrainState for `cfg` (without an optimizer) and loads the weights of CKPT_OR_RUN_DIR into it;
    `checkpoint` None: the model as model.init_weights starts it (step 0).

    Returns:
      (state, checkpoint prefix (the start weights' path), the checkpoint's step).
    """
    if checkpoint is None:
        start = config_lib.replace(cfg, "loss.class_weights", None)
        return TrainState(start, strategy, optimizer=False), str(cfg.model.init_weights), 0
    prefix = os.path.abspath(ckpt_lib.resolve(checkpoint))
    # The checkpoint holds every weight, so the pretrained file is not read again (it may have moved).
    # The class weights change no variable and a named scheme would scan the train split: left out.
    cfg = config_lib.replace(config_lib.without_weight_files(cfg), "loss.class_weights", None)
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


def load_evaluator(cfg: Config, strategy: tf.distribute.Strategy, checkpoint: str | None,
                   class_names: list[str] | None = None):
    """`load_state`, and the Evaluator the commands use on it (cfg.eval's modes and logit adjustment).

    Returns:
      (infer.evaluate.Evaluator, checkpoint prefix, the checkpoint's step); the state is evaluator.state.
    """
    # Resolved before the model is built: a missing or mismatched class_weights.json fails fast.
    weights = None
    if checkpoint is not None:
        weights = inference_class_weights(cfg, os.path.abspath(ckpt_lib.resolve(checkpoint)), class_names)
    elif cfg.eval.logit_adjustment and isinstance(cfg.loss.class_weights, list):
        weights = cfg.loss.class_weights
    elif cfg.eval.logit_adjustment:
        raise ConfigError("no class weights to adjust by", "eval.logit_adjustment",
                          "0 without a checkpoint, or loss.class_weights as a list (a named scheme's weights are "
                          "a run's, RUN_DIR/class_weights.json)")
    offsets = modes.score_offsets(cfg.eval, weights)
    state, prefix, step = load_state(cfg, strategy, checkpoint)
    return Evaluator(state, cfg.eval, score_offsets=offsets), prefix, step
