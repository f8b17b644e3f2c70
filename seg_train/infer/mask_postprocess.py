"""EoMT's panoptic and instance post-processing: one image's class and mask logits to segments, as the EoMT
authors' evaluation does it (and transformers' EomtImageProcessor, which ports it); numpy only.

Inputs are one image's class logits [Q, K + 1] (the last class "no object") and its mask logits, either already
at the image's size [Q, H, W] or as the model gives them [Q, h, w] together with `image_size` and `crop_size`,
the evaluation these tasks use: the image resized so that its long side fits the crop (`scaled_size`) and padded
to the crop; the mask logits resized bilinearly to the crop, the padding cut off, resized bilinearly to the image.
Only the queries that the post-processing keeps are resized.

Where the references differ, this module follows the EoMT authors' code, and says so:
- the scaled size rounds (`round(side * min(crop_h / H, crop_w / W))`); transformers' get_size_with_aspect_ratio
  truncates some sizes to one pixel less on the long side (e.g. 100 x 103 in a 640 crop: 621 x 640 here,
  621 x 639 there), which shifts its masks by a fraction of a pixel;
- instance predictions are the top `top_k` (query, class) pairs by class probability (the authors' and
  Mask2Former's), not transformers' EoMT port's one class per query with a threshold on the final score.

Ties: a pixel whose largest probability x mask probability is shared goes to the first kept query (the lowest
query index), as torch.argmax and numpy's argmax both do. Pairs tied at the top-k boundary go to the lower
pair index q * K + c (torch.topk's pick among them is arbitrary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MASK_THRESH = 0.8  # a query is kept when its class probability is above this (the authors' mask_thresh)
OVERLAP_THRESH = 0.8  # a segment is kept when its final area / its area at sigmoid >= 0.5 is at least this
TOP_K = 100  # the authors' eval_top_k_instances


def scaled_size(image_size: Sequence[int], crop_size: Sequence[int]) -> tuple[int, int]:
    """The image's size once resized so that it fits the crop (its long side fills it): the EoMT authors'
    scale_img_size_instance_panoptic, Python's round (half to even) on side * min(crop_h / H, crop_w / W)."""
    h, w = int(image_size[0]), int(image_size[1])
    factor = min(crop_size[0] / h, crop_size[1] / w)
    return round(h * factor), round(w * factor)


def _linear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] weights of a 1-D bilinear resize with half-pixel centres and the source index clamped at 0
    (torch's interpolate(mode="bilinear", align_corners=False) without antialiasing, TensorFlow 2's resize)."""
    src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = src - lo
    m = np.zeros((n_out, n_in))
    np.add.at(m, (np.arange(n_out), lo), 1.0 - frac)
    np.add.at(m, (np.arange(n_out), hi), frac)
    return m


def resize_matrices(mask_size: Sequence[int], image_size: Sequence[int],
                    crop_size: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(rows [H, h], cols [W, w]) float32 with out = rows @ logits @ cols.T: bilinear to the crop, the padding cut
    off (the scaled image's top-left corner kept), bilinear to the image; both resizes are linear, so one matrix
    per axis does them at once."""
    sh, sw = scaled_size(image_size, crop_size)
    if sh > crop_size[0] or sw > crop_size[1]:
        raise ValueError(f"scaled size {(sh, sw)} larger than the crop {tuple(crop_size)}")
    rows = _linear_matrix(sh, int(image_size[0])) @ _linear_matrix(int(mask_size[0]), int(crop_size[0]))[:sh]
    cols = _linear_matrix(sw, int(image_size[1])) @ _linear_matrix(int(mask_size[1]), int(crop_size[1]))[:sw]
    return rows.astype(np.float32), cols.astype(np.float32)


def resize_mask_logits(mask_logits, image_size: Sequence[int], crop_size: Sequence[int]) -> np.ndarray:
    """[Q, h, w] mask logits of the padded crop -> [Q, H, W] float32 at the image's size (see the module doc)."""
    mask_logits = np.asarray(mask_logits, np.float32)
    rows, cols = resize_matrices(mask_logits.shape[1:], image_size, crop_size)
    return np.matmul(np.matmul(rows, mask_logits), cols.T)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # float32 like the references: sigmoid(x) >= 0.5 is then also true for tiny negative x, as it is in torch.
    # In place on one new array: these are [Q, H, W] at the image's size.
    out = np.negative(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    out += 1
    return np.reciprocal(out, out=out)


def _first_argmax(scores: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """argmax over queries of scores[q] * masks[q] (float32 products), ties to the lowest q as numpy's argmax;
    one contiguous pass per query, without the [Q, H, W] product and numpy's strided argmax over its first axis."""
    best = scores[0] * masks[0]
    owner = np.zeros(masks.shape[1:], np.int64)
    for q in range(1, len(scores)):
        value = scores[q] * masks[q]
        better = value > best
        owner[better] = q
        np.maximum(best, value, out=best)
    return owner


def _masks_at_image(mask_logits, queries: np.ndarray, image_size, crop_size) -> np.ndarray:
    mask_logits = np.asarray(mask_logits, np.float32)
    if (image_size is None) != (crop_size is None):
        raise ValueError("give both image_size and crop_size (mask logits of the crop), or neither (at the image)")
    if image_size is None:
        return mask_logits[queries]
    return resize_mask_logits(mask_logits[queries], image_size, crop_size)


@dataclass(frozen=True)
class PanopticPrediction:
    """segment_ids [H, W] int32, 0 where no segment; segments: one dict per id 1, 2, ... in order, with keys
    id, category_id (train id), isthing, score (the query's class probability, float32 as a float) and query
    (the query index that made it; for a merged stuff segment, the first of its queries)."""

    segment_ids: np.ndarray
    segments: list[dict]


def panoptic_prediction(class_logits, mask_logits, is_thing: Sequence[bool], *, mask_thresh: float = MASK_THRESH,
                        overlap_thresh: float = OVERLAP_THRESH, image_size: Sequence[int] | None = None,
                        crop_size: Sequence[int] | None = None) -> PanopticPrediction:
    """One image's panoptic segments.

    Per query the most probable class of the softmax over K + 1; a query is kept when that class is a real one
    and its probability is above `mask_thresh` (at `mask_thresh` >= 0.5 this is the best real class). Each pixel
    goes to the kept query with the largest probability x sigmoid(mask logit). Query by query (in index order), the
    pixels it won where its sigmoid >= 0.5 make its segment, kept when it has pixels and the pixels it won / the
    pixels where its sigmoid >= 0.5 is at least `overlap_thresh`; the segments of a stuff class (is_thing False)
    are one segment, with the first one's id and score. Pixels of no kept segment are 0.

    The segments and pixels are transformers' post_process_panoptic_segmentation's, with ids one higher (0 is
    "none" here, -1 there). One difference in the area ratio: the authors compare it in double precision
    (ratio < overlap_thresh drops it), transformers in float32 (ratio > overlap_thresh keeps it); at ratio exactly
    0.8 both keep it (0.8 rounds up in float32), they differ only for areas above about 10^7 pixels.

    Args:
        class_logits: [Q, K + 1].
        mask_logits: [Q, H, W] at the image, or [Q, h, w] of the padded crop with image_size and crop_size.
        is_thing: K booleans, per train id.
    """
    class_logits = np.asarray(class_logits, np.float32)
    num_classes = class_logits.shape[-1] - 1
    is_thing = np.asarray(is_thing, bool)
    if is_thing.shape != (num_classes,):
        raise ValueError(f"is_thing has {is_thing.shape} entries, expected one per class ({num_classes})")
    probs = _softmax(class_logits)
    labels, scores = probs.argmax(-1), probs.max(-1)
    keep = np.flatnonzero((labels != num_classes) & (scores > mask_thresh))
    masks = _sigmoid(_masks_at_image(mask_logits, keep, image_size, crop_size))
    height, width = masks.shape[1:]
    if keep.size == 0:
        return PanopticPrediction(np.zeros((height, width), np.int32), [])

    owner = _first_argmax(scores[keep], masks)
    owner_inside = np.take_along_axis(masks, owner[None], 0)[0] >= 0.5
    won = np.bincount(owner.ravel(), minlength=keep.size)
    inside = np.count_nonzero(masks >= 0.5, axis=(1, 2))
    final = np.bincount(owner[owner_inside], minlength=keep.size)

    id_of = np.zeros(keep.size + 1, np.int32)  # per kept query its segment id; the last entry for "not inside"
    segments: list[dict] = []
    stuff_ids: dict[int, int] = {}
    for j, query in enumerate(keep):
        if inside[j] == 0 or won[j] == 0 or final[j] == 0 or won[j] / inside[j] < overlap_thresh:
            continue
        label = int(labels[query])
        if not is_thing[label] and label in stuff_ids:
            id_of[j] = stuff_ids[label]
            continue
        segment_id = len(segments) + 1
        if not is_thing[label]:
            stuff_ids[label] = segment_id
        id_of[j] = segment_id
        segments.append({"id": segment_id, "category_id": label, "isthing": bool(is_thing[label]),
                         "score": float(scores[query]), "query": int(query)})
    segment_ids = id_of[np.where(owner_inside, owner, keep.size)].astype(np.int32)
    return PanopticPrediction(segment_ids, segments)


@dataclass(frozen=True)
class InstancePrediction:
    """masks [N, H, W] bool, scores [N] float32, labels [N] int32 (train ids), queries [N] int32: the top
    (query, class) pairs, highest score first, equal scores in the order of the pairs' index q * K + c."""

    masks: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    queries: np.ndarray


def instance_prediction(class_logits, mask_logits, *, top_k: int = TOP_K, image_size: Sequence[int] | None = None,
                        crop_size: Sequence[int] | None = None) -> InstancePrediction:
    """One image's instance predictions, as the EoMT authors' evaluation (Mask2Former's) makes them.

    The top `top_k` (query, class) pairs by class probability (softmax over K + 1, "no object" left out; all
    pairs when Q K <= top_k); each pair's mask is its query's mask logits > 0 and its score is the class
    probability x the mean sigmoid of the mask logits inside that mask (sum / (pixels + 1e-6), 0 for an empty
    mask). Empty masks stay, as in the reference (transformers' post-processing leaves them out of its output).

    Args:
        class_logits: [Q, K + 1].
        mask_logits: [Q, H, W] at the image, or [Q, h, w] of the padded crop with image_size and crop_size.
    """
    class_logits = np.asarray(class_logits, np.float32)
    num_classes = class_logits.shape[-1] - 1
    probs = _softmax(class_logits)[:, :num_classes].ravel()
    pairs = np.sort(np.argsort(-probs, kind="stable")[:min(top_k, probs.size)])
    queries, labels = pairs // num_classes, pairs % num_classes
    unique, slot = np.unique(queries, return_inverse=True)
    logits = _masks_at_image(mask_logits, unique, image_size, crop_size)
    masks = logits > 0
    inside = np.count_nonzero(masks, axis=(1, 2))
    # Sigmoid only where it counts (inside the masks), summed per query.
    owner = np.broadcast_to(np.arange(len(unique))[:, None, None], masks.shape)[masks]
    sums = np.bincount(owner, weights=_sigmoid(logits[masks]), minlength=len(unique))
    mask_score = sums / (inside + 1e-6)
    scores = (probs[pairs] * mask_score[slot]).astype(np.float32)
    order = np.argsort(-scores, kind="stable")
    return InstancePrediction(masks[slot[order]], scores[order], labels[order].astype(np.int32),
                              queries[order].astype(np.int32))
