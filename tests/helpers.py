"""Small shared builders for tests: tiny configs and synthetic batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from seg_train import config as config_lib


def tiny_config(tmp_path: Path, data_root: Path | str = "data", **sections) -> config_lib.Config:
    """A tiny-model config written to tmp_path/config.yaml and loaded through the real loader."""
    raw = {
        "seed": 0,
        "run_dir": "run",
        "data": {"root": str(data_root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                 "random_scale": [0.75, 1.25], "num_parallel_calls": 2},
        "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4,
                  "weight_decay": 1e-3},
        "train": {"num_steps": 4, "learning_rate": 0.01, "summary_every": 1, "checkpoint_every": 2,
                  "image_summary_every": 2},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    path = Path(tmp_path) / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return config_lib.load(path)


def bilinear_resize(x, size):
    """numpy [b, h, w, c] -> [b, size[0], size[1], c]: bilinear, half-pixel centres, edge-clamped (TensorFlow
    2's resize and torch's align_corners=False), written from the definition as a reference."""
    def axis(n_in, n_out):
        src = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        lo = np.floor(src).astype(int)
        return lo, np.minimum(lo + 1, n_in - 1), src - lo

    (y0, y1, wy), (x0, x1, wx) = axis(x.shape[1], size[0]), axis(x.shape[2], size[1])
    rows = x[:, y0] * (1 - wy)[None, :, None, None] + x[:, y1] * wy[None, :, None, None]
    return rows[:, :, x0] * (1 - wx)[None, None, :, None] + rows[:, :, x1] * wx[None, None, :, None]


def random_batch(batch=4, size=32, num_classes=3, seed=0, ignore_rows=None):
    """Normalised-looking images and labels; ignore_rows[i] rows of sample i are set to 255."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch, size, size, 3)).astype(np.float32)
    labels = rng.integers(0, num_classes, size=(batch, size, size)).astype(np.uint8)
    for i, rows in enumerate(ignore_rows or []):
        labels[i, :rows] = 255
    return images, labels



def open_reader(cfg: config_lib.Config, split: str, seed: int | None = None):
    """`split`'s ImageReader through the front door (seg_train/data/split.py's open_split); `seed` in place of
    cfg.seed where a test reads the stream of another seed."""
    from seg_train.data.split import open_split

    return open_split(cfg if seed is None else config_lib.replace(cfg, "seed", seed), split).reader


def train_batches(state, reader):
    """The real reader's training stream from step 0 for a TrainState, distributed as train.py distributes it
    (data.batch_size global images per micro-batch, train.accumulate_steps micro-batches), endless."""
    from seg_train.data.split import train_dataset_fn

    cfg = state.cfg
    return iter(state.distribute(train_dataset_fn(reader, cfg.data.batch_size, start_step=0, end_step=None,
                                                  micro_batches=cfg.train.accumulate_steps)))

# A numpy confusion matrix, the by-hand reference the evaluation's bincount path is checked against
# (the package itself counts on the device, seg_train/infer/evaluate.py).
def confusion_matrix(labels, preds, num_classes: int, ignore_label: int | None = 255) -> np.ndarray:
    """Count (ground truth, prediction) pairs over all labelled pixels.

    Args:
        labels: Integer array of ground-truth class ids, any shape.
        preds: Integer array of predicted class ids, same shape as `labels`.
        num_classes: Number of classes C.
        ignore_label: Label value whose pixels are skipped (None: skip nothing).

    Returns:
        int64 array [C, C]; rows are ground truth, columns are predictions.

    Raises:
        ValueError: on shape mismatch, or on a label (other than `ignore_label`)
            or any prediction outside [0, C).
        TypeError: if labels or preds are not integer arrays.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    labels = np.asarray(labels)
    preds = np.asarray(preds)
    if labels.shape != preds.shape:
        raise ValueError(f"labels shape {labels.shape} != preds shape {preds.shape}")
    # Refuse floats: silently truncating e.g. probabilities would give garbage counts.
    for name, arr in (("labels", labels), ("preds", preds)):
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")

    # Widen before arithmetic: uint8 labels would overflow in label * C + pred.
    labels = labels.reshape(-1).astype(np.int64, copy=False)
    preds = preds.reshape(-1).astype(np.int64, copy=False)

    # Predictions are checked everywhere, ignored pixels included: a model can
    # never legitimately emit an out-of-range id, so one anywhere is a bug.
    if preds.size and (preds.min() < 0 or preds.max() >= num_classes):
        bad = preds[(preds < 0) | (preds >= num_classes)]
        raise ValueError(f"prediction values out of range [0, {num_classes}): {np.unique(bad)[:10].tolist()}")

    if ignore_label is not None:
        keep = labels != ignore_label
        labels, preds = labels[keep], preds[keep]
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        bad = labels[(labels < 0) | (labels >= num_classes)]
        raise ValueError(f"label values out of range [0, {num_classes}): {np.unique(bad)[:10].tolist()}")

    # Encode each (gt, pred) pair as one flat index so a single bincount counts them all.
    counts = np.bincount(labels * num_classes + preds, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).astype(np.int64, copy=False)


def seg_prepare() -> list[str]:
    """The installed seg-prepare console script next to this Python, else its entry point through -c."""
    import sys

    script = Path(sys.executable).with_name("seg-prepare")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from seg_train.cli import prepare_main as m; sys.exit(m())"]
