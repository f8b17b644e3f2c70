"""The loss's per-class weights from a split's pixel counts (loss.class_weights): SegNet's median frequency
balancing and its square root, computed from the pre-training scan of the train split (scan.py)."""

from __future__ import annotations

import logging

import numpy as np

from seg_train.config import ConfigError

log = logging.getLogger("seg_train")


def median_frequency_weights(class_pixels, image_pixels, class_names=None) -> np.ndarray:
    """SegNet's median frequency balancing (Badrinarayanan et al. 2017, after Eigen & Fergus 2015).

    w_c = median_freq / freq_c, with freq_c = (pixels of class c) / (pixels of the images where c is
    present), LABELLED pixels only (ignore_label pixels count in neither). A class with no pixel gets
    weight 0 (with a warning) and takes no part in the median.
    `class_pixels` [C]: each class's pixels over the split; `image_pixels` [C]: the labelled pixels
    of the images that contain it. Returns float32 [C] weights.
    """
    class_pixels = np.asarray(class_pixels, np.float64)
    image_pixels = np.asarray(image_pixels, np.float64)
    present = class_pixels > 0
    if not present.any():
        raise ValueError("no labelled pixel in the split: median frequency weights need class pixels")
    freq = np.zeros_like(class_pixels)
    freq[present] = class_pixels[present] / image_pixels[present]
    weights = np.zeros_like(class_pixels)
    weights[present] = np.median(freq[present]) / freq[present]
    if not present.all():
        absent = [class_names[c] if class_names else str(c) for c in np.flatnonzero(~present)]
        log.warning("loss.class_weights: median_frequency: no pixel of class(es) %s in the train split: weight 0",
                    ", ".join(absent))
    return weights.astype(np.float32)


def class_weights_for(cfg, scan_report, class_names=None) -> np.ndarray | None:
    """The per-class loss weights `loss.class_weights` asks for, as float32 [num_classes], or None.

    `scan_report` is datacheck.scan's report of the TRAIN split (its pixel counts give
    'median_frequency' and 'sqrt_median_frequency'); `class_names` only name classes in warnings.
    """
    weights = cfg.loss.class_weights
    if weights is None:
        return None
    if not isinstance(weights, str):
        return np.asarray(weights, np.float32)
    n = cfg.data.num_classes
    try:
        w = median_frequency_weights(scan_report.histogram[:n], scan_report.image_pixels[:n], class_names)
    except ValueError:
        raise ConfigError("no labelled pixels to balance", "loss.class_weights",
                          f"a train split with labelled pixels for '{weights}' (or a list of weights)") from None
    # 'sqrt_median_frequency': a milder balancing; the full weights push too many pixels into rare classes.
    return np.sqrt(w).astype(np.float32) if weights == "sqrt_median_frequency" else w
