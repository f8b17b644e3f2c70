"""TensorBoard summaries: scalars, per-tower curves in one chart, sample pictures, evaluation
pictures and the run's config (the tags are part of the CLI contract, see README).

Layout under RUN_DIR (the --logdir): every tag at the top, except towers/tower_<i>/, one run per
tower, whose shared tags (`loss/tower`) TensorBoard overlays in one chart with a line per tower.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf
import yaml

from seg_train.data.label_images import colorize
from seg_train.train import plots

EVAL_EXAMPLE_SIDE = 384  # eval/examples: each panel's longer side at most this many pixels


def confusion_matrix_title(step: int) -> str:
    """The caption above eval/confusion_matrix."""
    return f"step {step}: % of each true class (row) predicted as each class (column)"


class Summaries:
    """Writes event files under `run_dir`; `mean`, `std`: the data normalisation, undone for pictures."""

    def __init__(self, run_dir: Path, palette: np.ndarray, ignore_label: int, mean, std, max_images: int = 2,
                 segment_classes: int | None = None):
        """`segment_classes`: data.num_classes when the labels are segment labels (data.task panoptic / instance):
        the triplets then show one colour per segment, the prediction's per query (infer/mask_pictures.py)."""
        self.segment_classes = segment_classes
        self.run_dir = Path(run_dir)
        self.writer = tf.summary.create_file_writer(str(run_dir))
        self.palette, self.ignore_label = palette, ignore_label
        self.mean, self.std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
        self.max_images = max_images
        self._tower_writers: dict[int, tf.summary.SummaryWriter] = {}

    def scalars(self, step: int, values: dict) -> None:
        with self.writer.as_default(step=step):
            for tag, value in values.items():
                tf.summary.scalar(tag, float(value))

    def tower_scalars(self, step: int, tag: str, values) -> None:
        """One value per tower under the same `tag`, tower i's in the run RUN_DIR/towers/tower_<i>."""
        for i, value in enumerate(np.asarray(values, np.float64).reshape(-1)):
            writer = self._tower_writers.get(i)
            if writer is None:
                writer = self._tower_writers[i] = tf.summary.create_file_writer(
                    str(self.run_dir / "towers" / f"tower_{i}"))
            with writer.as_default(step=step):
                tf.summary.scalar(tag, float(value))

    def config_text(self, step: int, cfg, towers: int | None = None) -> None:
        """The resolved config as YAML under the text tag `config`.

        Called at the first step of every run segment (start or resume), so each segment's settings
        show next to its curves."""
        body = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None).rstrip("\n")
        head = f"resolved config at step {step}" + (f", {towers} tower(s)" if towers else "")
        # Indented four spaces: a Markdown code block, so TensorBoard keeps the YAML's layout.
        text = head + ":\n\n" + "\n".join("    " + line for line in body.splitlines())
        with self.writer.as_default(step=step):
            tf.summary.text("config", text)
        self.writer.flush()

    def triplets(self, step: int, towers: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """towers[i] = (normalised images [b,h,w,3], labels [b,h,w], predictions [b,h,w]) of tower i.

        Writes tower_<i>/image, /label, /prediction and /triplet (all panels of a sample in one
        picture, so they are never separated in the grid).
        """
        with self.writer.as_default(step=step):
            for i, (images, labels, preds) in enumerate(towers):
                k = min(self.max_images, len(images))
                rgb = np.clip(images[:k] * self.std + self.mean, 0, 255).astype(np.uint8)
                tf.summary.image(f"tower_{i}/image", rgb, max_outputs=k)
                if self.segment_classes is not None:
                    self._segment_triplets(i, rgb, labels[:k], preds[:k])
                    continue
                tf.summary.image(f"tower_{i}/label", np.stack(
                    [colorize(label, self.palette, self.ignore_label) for label in labels[:k]]), max_outputs=k)
                # Ignored pixels are marked in the prediction too, so the two panels line up.
                marked = np.where(labels[:k] == self.ignore_label, self.ignore_label, preds[:k])
                tf.summary.image(f"tower_{i}/prediction", np.stack(
                    [colorize(p, self.palette, self.ignore_label) for p in marked]), max_outputs=k)
                tf.summary.image(f"tower_{i}/triplet", np.stack(
                    [plots.sample_panels(im, lb, pr, self.palette, self.ignore_label, overlay=True)
                     for im, lb, pr in zip(rgb, labels[:k], preds[:k])]), max_outputs=k)

    def _segment_triplets(self, i: int, rgb, labels, preds) -> None:
        from seg_train.data.segments import INSTANCE_BASE
        from seg_train.infer import mask_pictures

        label_rgb = [mask_pictures.label_colours(lb, self.segment_classes) for lb in labels]
        void = [lb // INSTANCE_BASE >= self.segment_classes for lb in labels]
        pred_rgb = [mask_pictures.segment_colours(pr.astype(np.int64) + 1, v) for pr, v in zip(preds, void)]
        k = len(rgb)
        tf.summary.image(f"tower_{i}/label", np.stack(label_rgb), max_outputs=k)
        tf.summary.image(f"tower_{i}/prediction", np.stack(pred_rgb), max_outputs=k)
        tf.summary.image(f"tower_{i}/triplet", np.stack(
            [plots.side_by_side([im, lb, pr, plots.blend(im, mask_pictures.segment_colours(p.astype(np.int64) + 1))])
             for im, lb, pr, p in zip(rgb, label_rgb, pred_rgb, preds)]), max_outputs=k)

    def eval_pictures(self, step: int, confusion_matrix: np.ndarray, class_names,
                      examples: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = ()) -> None:
        """eval/confusion_matrix (rows normalised, class names on both axes) and eval/examples.

        `examples`: (uint8 RGB image, label, prediction) of the same val images at every evaluation.
        """
        matrix, _ = plots.confusion_matrix_image(confusion_matrix, class_names, title=confusion_matrix_title(step))
        pictures = [plots.sample_panels(plots.fit(image, EVAL_EXAMPLE_SIDE, nearest=False),
                                        plots.fit(label, EVAL_EXAMPLE_SIDE, nearest=True),
                                        plots.fit(pred, EVAL_EXAMPLE_SIDE, nearest=True),
                                        self.palette, self.ignore_label, overlay=False)
                    for image, label, pred in examples]
        with self.writer.as_default(step=step):
            tf.summary.image("eval/confusion_matrix", matrix[None], max_outputs=1)
            if pictures:
                # Val images differ in size and one summary holds one shape: pad to the largest.
                tf.summary.image("eval/examples", plots.pad_to_common(pictures), max_outputs=len(pictures))
        self.writer.flush()

    def eval_segment_pictures(self, step: int, examples) -> None:
        """eval/examples of a panoptic or instance evaluation: (image, ground truth, prediction) uint8 RGB each,
        one colour per segment (infer/mask_pictures.py)."""
        pictures = [plots.side_by_side([plots.fit(p, EVAL_EXAMPLE_SIDE, nearest=k > 0) for k, p in enumerate(panels)])
                    for panels in examples]
        if pictures:
            with self.writer.as_default(step=step):
                tf.summary.image("eval/examples", plots.pad_to_common(pictures), max_outputs=len(pictures))
            self.writer.flush()

    def histogram(self, step: int, tag: str, values) -> None:
        with self.writer.as_default(step=step):
            tf.summary.histogram(tag, np.asarray(values, np.float32))

    def flush(self) -> None:
        self.writer.flush()
        for writer in self._tower_writers.values():
            writer.flush()
