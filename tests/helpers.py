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


def random_batch(batch=4, size=32, num_classes=3, seed=0, ignore_rows=None):
    """Normalised-looking images and labels; ignore_rows[i] rows of sample i are set to 255."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch, size, size, 3)).astype(np.float32)
    labels = rng.integers(0, num_classes, size=(batch, size, size)).astype(np.uint8)
    for i, rows in enumerate(ignore_rows or []):
        labels[i, :rows] = 255
    return images, labels
