"""seg-eval: evaluates a checkpoint on a split, prints the per-class table, writes the JSON record."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import tensorflow as tf

from seg_train.config import Config
from seg_train.data.split import open_split
from seg_train.infer import modes
from seg_train.infer.load import load_evaluator, run_dir_of
from seg_train.infer.metrics import format_table, metrics_to_json
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run.rundir import write_json
from seg_train.util.paths import check_creatable_dir

log = logging.getLogger("seg_train")


def split_tag(split: str) -> str:
    """File-name tag of a split: the name itself, or a list file's stem."""
    return Path(split).stem if ("/" in split or os.sep in split or split.endswith(".txt")) else split


def run_eval(cfg: Config, strategy: tf.distribute.Strategy, checkpoint: str | None, split: str | None = None,
             progress: bool = True) -> dict:
    """seg-eval: evaluates a checkpoint on a split, prints the table, writes RUN_DIR/eval/<split>-step<k>.json;
    `checkpoint` None: the model as model.init_weights starts it, RUN_DIR/eval/<split>-init.json (cfg.run_dir).

    Returns:
      The JSON record that was written.
    """
    split = split or cfg.data.val_split
    # The JSON goes next to the checkpoint's run dir: check it can be written before the work.
    out_dir = (run_dir_of(os.path.abspath(ckpt_lib.resolve(checkpoint))) if checkpoint is not None
               else Path(cfg.run_dir)) / "eval"
    check_creatable_dir(out_dir, "eval output folder", "write access to the checkpoint's run dir")
    opened = open_split(cfg, split)
    reader, names = opened.reader, opened.class_names
    evaluator, prefix, step = load_evaluator(cfg, strategy, checkpoint, names)
    reestimated = evaluator.maybe_reestimate_bn(cfg, progress)
    if not reestimated:
        log.info("BN moving statistics as saved (not re-estimated for step %d; see eval.bn_reestimate_batches)",
                 step)
    log.info("evaluating %s (step %d) on %d %s images, %d tower(s), %s", prefix, step, len(reader), split,
             strategy.num_replicas_in_sync, modes.describe(cfg.eval))
    metrics, num_images = evaluator.evaluate(reader, names, progress)
    masks = hasattr(metrics, "headline")  # data.task panoptic / instance: mask_evaluate.MaskScores
    record = {"split": split, "checkpoint": prefix, "step": step, "num_images": num_images,
              "bn_stats_reestimated": reestimated, "inference": modes.as_dict(cfg.eval),
              **(mask_inference(cfg) if masks else {}),
              **(metrics.to_json() if masks else metrics_to_json(metrics, names))}
    path = out_dir / f"{split_tag(split)}-{'init' if checkpoint is None else f'step{step}'}.json"
    write_json(path, record)
    print(metrics.table() if masks else format_table(metrics, names))
    headline = metrics.headline_text() if masks else f"mIoU {100 * metrics.miou:.2f}%"
    print(f"{num_images} images, step {step}: {headline}; wrote {path}")
    return record


def mask_inference(cfg: Config) -> dict:
    """The post-processing settings of a panoptic or instance evaluation, for its JSON record."""
    out = {"letterbox": list(cfg.data.crop_size)}
    if cfg.data.task == "panoptic":
        out.update(mask_thresh=cfg.eval.mask_thresh, overlap_thresh=cfg.eval.overlap_thresh)
    return {"postprocess": out}
