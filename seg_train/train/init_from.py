"""--init-from: weights only from another seg-train checkpoint, skipping shapes that differ."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf
import yaml

from seg_train import config as config_lib
from seg_train import models
from seg_train.config import ConfigError
from seg_train.run import checkpoint as ckpt_lib


def _source_config(prefix: str) -> config_lib.Config:
    for d in Path(prefix).resolve().parents[:3]:
        p = d / "config.yaml"
        if p.is_file():
            return config_lib.from_dict(yaml.safe_load(p.read_text()))
    raise ConfigError("no config.yaml beside the checkpoint", prefix,
                      "a checkpoint inside a seg-train run dir (RUN_DIR/checkpoints/ckpt-N with RUN_DIR/config.yaml)")


def load_weights(model, path: str) -> tuple[int, list[str]]:
    """Copies weights from the checkpoint at `path` (prefix, checkpoints/ folder or run dir) into `model`.

    The source model is rebuilt from its saved config (checkpoints are keyed by object graph, not
    name), then weights are matched by Keras variable path. Returns (loaded count, skipped paths).
    """
    prefix = ckpt_lib.resolve(path)
    src_cfg = _source_config(prefix)
    # Every weight comes from the checkpoint: the files the source run started from are not read.
    src_cfg = config_lib.without_weight_files(src_cfg)
    src = models.build(src_cfg.model, src_cfg.data.num_classes, src_cfg.seed)
    tf.train.Checkpoint(model=src).read(prefix).expect_partial()
    source = {v.path: v for v in src.weights}
    loaded, skipped = 0, []
    for v in model.weights:
        s = source.get(v.path)
        if s is None or tuple(s.shape) != tuple(v.shape):
            skipped.append(v.path)
            continue
        v.assign(s.numpy())
        loaded += 1
    if loaded == 0:
        raise ConfigError("no matching weights", prefix, "a checkpoint of a model with the same layers")
    return loaded, skipped
