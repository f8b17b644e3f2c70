"""Segmentation metrics from confusion matrices; pure numpy, so importing it does not start TensorFlow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SegMetrics:
    """Summary metrics derived from one confusion matrix (fractions in [0, 1])."""

    miou: float
    pixel_accuracy: float
    mean_class_accuracy: float
    per_class_iou: list[float | None]
    per_class_accuracy: list[float | None]
    # Out of ==/repr: ndarray equality is elementwise, and a large matrix would swamp the repr.
    confusion_matrix: np.ndarray = field(compare=False, repr=False)


def compute_metrics(cm) -> SegMetrics:
    """Derive IoU and accuracy metrics from a confusion matrix.

    Classes with an empty union get IoU None and are left out of the mIoU; classes without
    ground truth get accuracy None. A class only predicted, never labelled, has IoU 0 and counts.

    Args:
        cm: Non-negative integer array [C, C], rows ground truth, cols prediction.

    Raises:
        ValueError: if `cm` is not square and non-negative, or counts no pixels.
    """
    cm = np.array(cm, dtype=np.int64)  # a private copy, frozen below
    if cm.ndim != 2 or cm.shape[0] != cm.shape[1] or cm.shape[0] == 0:
        raise ValueError(f"confusion matrix must be a non-empty square 2-D array, got shape {cm.shape}")
    if (cm < 0).any():
        raise ValueError("confusion matrix has negative counts")
    total = int(cm.sum())
    if total == 0:
        # Every metric would be undefined; failing loudly beats reporting nan.
        raise ValueError("no labelled pixels")
    cm.setflags(write=False)

    tp = np.diag(cm).astype(np.float64)
    gt = cm.sum(axis=1).astype(np.float64)  # ground-truth pixels per class
    pred = cm.sum(axis=0).astype(np.float64)  # predicted pixels per class
    union = gt + pred - tp

    per_class_iou = [float(t / u) if u > 0 else None for t, u in zip(tp, union)]
    per_class_acc = [float(t / g) if g > 0 else None for t, g in zip(tp, gt)]
    # total > 0 guarantees at least one class with ground truth, so neither list is all None.
    valid_iou = [v for v in per_class_iou if v is not None]
    valid_acc = [v for v in per_class_acc if v is not None]
    return SegMetrics(
        miou=float(np.mean(valid_iou)),
        pixel_accuracy=float(tp.sum() / total),
        mean_class_accuracy=float(np.mean(valid_acc)),
        per_class_iou=per_class_iou,
        per_class_accuracy=per_class_acc,
        confusion_matrix=cm,
    )


def _check_names(metrics: SegMetrics, class_names: Sequence[str]) -> None:
    """Raise ValueError unless there is exactly one name per class."""
    if len(class_names) != len(metrics.per_class_iou):
        raise ValueError(f"got {len(class_names)} class names for {len(metrics.per_class_iou)} classes")


def _pct(value: float | None) -> str:
    """Format a fraction as a percentage with two decimals, '-' for None."""
    return "-" if value is None else f"{100.0 * value:.2f}"


def format_table(metrics: SegMetrics, class_names: Sequence[str]) -> str:
    """Per-class IoU / accuracy as a fixed-width text table plus summary lines (percentages, '-' undefined)."""
    _check_names(metrics, class_names)
    name_w = max(len("Class"), *(len(str(n)) for n in class_names))
    idx_w = max(len("Index"), len(str(len(class_names) - 1)))
    num_w = 7  # fits "100.00" and the "IoU %" / "Acc %" headers
    sep = f"+-{'-' * idx_w}-+-{'-' * name_w}-+-{'-' * num_w}-+-{'-' * num_w}-+"

    def row(idx: str, name: str, iou: str, acc: str) -> str:
        return f"| {idx:>{idx_w}} | {name:<{name_w}} | {iou:>{num_w}} | {acc:>{num_w}} |"

    lines = [sep, row("Index", "Class", "IoU %", "Acc %"), sep]
    for i, (name, iou, acc) in enumerate(zip(class_names, metrics.per_class_iou, metrics.per_class_accuracy)):
        lines.append(row(str(i), str(name), _pct(iou), _pct(acc)))
    lines.append(sep)
    lines += [
        f"mIoU:                {_pct(metrics.miou):>7} %",
        f"Pixel accuracy:      {_pct(metrics.pixel_accuracy):>7} %",
        f"Mean class accuracy: {_pct(metrics.mean_class_accuracy):>7} %",
    ]
    return "\n".join(lines)


def metrics_to_json(metrics: SegMetrics, class_names: Sequence[str]) -> dict:
    """Metrics as a JSON-serialisable dict (fractions, None for undefined); per-class values keyed by name."""
    _check_names(metrics, class_names)
    names = [str(n) for n in class_names]
    # Names become dict keys, so duplicates would silently drop classes.
    if len(set(names)) != len(names):
        raise ValueError(f"class names must be unique: {names}")
    return {
        "miou": metrics.miou,
        "pixel_accuracy": metrics.pixel_accuracy,
        "mean_class_accuracy": metrics.mean_class_accuracy,
        "per_class_iou": dict(zip(names, metrics.per_class_iou)),
        "per_class_accuracy": dict(zip(names, metrics.per_class_accuracy)),
        "confusion_matrix": metrics.confusion_matrix.tolist(),  # int64 -> Python int
    }
