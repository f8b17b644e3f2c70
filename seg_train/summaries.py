"""TensorBoard summaries: scalars and per-tower image | label | prediction triplets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

from seg_train.palette import colorize


class Summaries:
    """Writes event files under `run_dir` (the tags are part of the CLI contract, see README)."""

    def __init__(self, run_dir: Path, palette: np.ndarray, ignore_label: int, mean, std, max_images: int = 2):
        self.writer = tf.summary.create_file_writer(str(run_dir))
        self.palette, self.ignore_label = palette, ignore_label
        self.mean, self.std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
        self.max_images = max_images

    def scalars(self, step: int, values: dict) -> None:
        with self.writer.as_default(step=step):
            for tag, value in values.items():
                tf.summary.scalar(tag, float(value))

    def triplets(self, step: int, towers: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """towers[i] = (normalised images [b,h,w,3], labels [b,h,w], predictions [b,h,w]) of tower i."""
        with self.writer.as_default(step=step):
            for i, (images, labels, preds) in enumerate(towers):
                k = min(self.max_images, len(images))
                rgb = np.clip(images[:k] * self.std + self.mean, 0, 255).astype(np.uint8)
                tf.summary.image(f"tower_{i}/image", rgb, max_outputs=k)
                tf.summary.image(f"tower_{i}/label", np.stack(
                    [colorize(l, self.palette, self.ignore_label) for l in labels[:k]]), max_outputs=k)
                # Ignored pixels are marked in the prediction too, so the two panels line up.
                marked = np.where(labels[:k] == self.ignore_label, self.ignore_label, preds[:k])
                tf.summary.image(f"tower_{i}/prediction", np.stack(
                    [colorize(p, self.palette, self.ignore_label) for p in marked]), max_outputs=k)

    def histogram(self, step: int, tag: str, values) -> None:
        with self.writer.as_default(step=step):
            tf.summary.histogram(tag, np.asarray(values, np.float32))

    def flush(self) -> None:
        self.writer.flush()
