"""Pictures of segments (data.task panoptic / instance): one colour per segment, for seg-predict's overlays,
TensorBoard's eval/examples and the training triplets; numpy only.

A segment's colour is a function of its id alone (a fixed table of bright colours, id modulo its length), so the
same segment value has the same colour in every picture; 0 (no segment) is black, unlabelled pixels white.
"""

from __future__ import annotations

import numpy as np

from seg_train.data.segments import INSTANCE_BASE

_TABLE = np.random.default_rng(51).integers(48, 256, (997, 3)).astype(np.uint8)  # a prime length: ids spread
SHOWN_SCORE = 0.5  # instance pictures show the predictions scored above this
OVERLAY_ALPHA = 0.5


def segment_colours(ids, void=None) -> np.ndarray:
    """uint8 [H, W, 3] of segment ids [H, W] (0 black); `void`: bool [H, W] painted white."""
    ids = np.asarray(ids, np.int64)
    out = _TABLE[ids % len(_TABLE)]
    out[ids == 0] = 0
    if void is not None:
        out[np.asarray(void, bool)] = 255
    return out


def label_colours(label, num_classes: int) -> np.ndarray:
    """A segment-label map (data/segments.py) coloured per segment value; unlabelled (class >= K) white."""
    label = np.asarray(label, np.int64)
    void = label // INSTANCE_BASE >= num_classes
    return segment_colours(np.where(void, 0, label + 1), void)


def prediction_ids(pred) -> np.ndarray:
    """int64 [H, W] ids of a PanopticPrediction (its segment ids) or an InstancePrediction (its masks scored above
    SHOWN_SCORE, 1 + rank, the higher score on top)."""
    if hasattr(pred, "segment_ids"):
        return np.asarray(pred.segment_ids, np.int64)
    ids = np.zeros(pred.masks.shape[1:], np.int64)
    for rank in np.flatnonzero(pred.scores > SHOWN_SCORE)[::-1]:
        ids[pred.masks[rank]] = rank + 1
    return ids


def overlay(image, colours, shown, alpha: float = OVERLAY_ALPHA) -> np.ndarray:
    """The colours blended over the uint8 image where `shown` (bool [H, W]), the image elsewhere."""
    mixed = np.round((1 - alpha) * image.astype(np.float32) + alpha * colours.astype(np.float32)).astype(np.uint8)
    return np.where(np.asarray(shown, bool)[..., None], mixed, image)


def example_panels(image, label, pred, setup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image, ground truth, prediction) as uint8 RGB [H, W, 3] each (eval/examples)."""
    return np.asarray(image, np.uint8), label_colours(label, setup.num_classes), segment_colours(prediction_ids(pred))
