"""seg-export: a SavedModel that segments one whole uint8 image (any size memory allows), preprocessing in the graph.

The serving function (`serving.serving_module`) is also what seg-predict runs, with the evaluation's
preprocessing and inference modes, so the exported model predicts what seg-eval measured. The
SavedModel holds no Python: it loads in a process that never imports seg_train.

TensorFlow is imported only inside the functions, so the arguments are checked before its slow start.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from seg_train.config import Config, ConfigError

log = logging.getLogger("seg_train")

METADATA_FILE = "seg_train.json"


def check_output(path: str | os.PathLike, force: bool) -> Path:
    """The SavedModel folder: new, empty, or non-empty with `force`; never a file."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError("output is a file", str(out), "expected a folder for the SavedModel (new or empty)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError("output folder is not empty", str(out),
                          "expected a new or empty folder (pass --force to replace it)")
    from seg_train.util.paths import check_creatable_dir
    check_creatable_dir(out, "output folder", "choose another --output")
    # The SavedModel is written beside `out` and renamed into place: the parent must be writable too.
    parent = Path(os.path.abspath(out)).parent
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("output's parent folder is not writable", str(parent),
                          "a folder you can write to: the SavedModel is written beside --output, then renamed")
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    """Moves the finished folder `tmp` to `out`, replacing `out` if it exists."""
    if out.is_dir() and any(out.iterdir()):
        # A non-empty folder cannot be renamed over: move it aside first (--force was given).
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)  # also replaces an empty folder


def run_export(cfg: Config, strategy, checkpoint: str, output: str | os.PathLike, force: bool = False,
               progress: bool = True) -> Path:
    """seg-export: writes the SavedModel of CKPT_OR_RUN_DIR to `output` (via output.tmp, renamed).

    Returns:
      The SavedModel folder.
    """
    import tensorflow as tf

    from seg_train.data.split import class_names_of
    from seg_train.infer import modes
    from seg_train.infer.load import load_evaluator

    out = check_output(output, force)
    names = class_names_of(cfg)
    evaluator, prefix, step = load_evaluator(cfg, strategy, checkpoint, names)
    reestimated = evaluator.maybe_reestimate_bn(cfg, progress)
    masks = cfg.data.task != "semantic"
    module = (evaluator.mask_serving_module if masks else evaluator.serving_module)(cfg.data.mean, cfg.data.std)
    signature = ("serving_default: image uint8 [height, width, 3] -> classes int32 [height, width], "
                 "probabilities float32 [height, width, num_classes]")
    if masks:
        signature = ("serving_default: image uint8 [height, width, 3], the image letterboxed to the crop "
                     "(resized with Pillow's BILINEAR so that its long side fits, padded below and right with 0) -> "
                     "class_logits float32 [queries, num_classes + 1] (the last class: no object), mask_logits "
                     "float32 [queries, height / patch * 4, width / patch * 4]; post-processing outside the model")

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():  # left over by an interrupted export
        shutil.rmtree(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tf.saved_model.save(module, str(tmp), signatures={"serving_default": module.serve})
        # Plain metadata beside the graph for serving code (class names, where it came from).
        (tmp / METADATA_FILE).write_text(json.dumps({
            "checkpoint": prefix, "step": step, "num_classes": cfg.data.num_classes, "class_names": names,
            "mean": list(cfg.data.mean), "std": list(cfg.data.std), "bn_stats_reestimated": reestimated,
            "inference": modes.as_dict(cfg.eval),
            "score_offsets": modes.offsets_by_class(evaluator.score_offsets, names),
            "signature": signature,
            **(mask_metadata(cfg) if masks else {}),
        }, indent=1) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    what = "class_logits, mask_logits (letterboxed input)" if masks else f"classes [h, w] ({modes.describe(cfg.eval)})"
    print(f"exported step {step} ({prefix}) to {out}: serving_default(image uint8 [h, w, 3]) -> {what}")
    return out


def mask_metadata(cfg: Config) -> dict:
    """What a caller of a panoptic / instance export needs besides the logits: the task, the letterbox size, the
    post-processing settings, which classes are things and each train id's data-set category id."""
    from seg_train.data.split import categories_of
    from seg_train.infer.mask_evaluate import MaskSetup

    setup = MaskSetup.of(cfg)
    out = {"task": cfg.data.task, "letterbox": list(setup.crop), "category_ids": list(categories_of(cfg).ids)}
    if cfg.data.task == "panoptic":
        out.update(thing_classes=np.flatnonzero(setup.is_thing).tolist(), mask_thresh=setup.mask_thresh,
                   overlap_thresh=setup.overlap_thresh)
    return out
