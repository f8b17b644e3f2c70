"""Mask AP as pycocotools' COCOeval(iouType="segm") computes it, image by image into a state that concatenates;
numpy only.

COCOeval's rules, all kept: per image and class the detections by descending score (stable), at most 100; mask IoU,
against a crowd ground truth the intersection over the detection's area; per IoU threshold (0.50, 0.55, .., 0.95)
each detection in score order takes the unmatched (or crowd) ground truth of highest IoU >= the threshold,
preferring ground truth that is not ignored (crowd, or its area outside the area range; ties to the later one);
a detection matched to ignored ground truth is ignored, so is an unmatched one whose area is outside the range.
Area ranges [0, 1e10], [0, 32^2], [32^2, 96^2], [96^2, 1e10], both ends inclusive, on the ground truth's area
(its mask's pixels unless given) and the detection mask's pixels. Per class, area range and maxDets (1, 10, 100
per image and class), detections of all images by descending score (ties in image-id order, then by rank in the
image), precision made non-increasing from the right, read at 101 recall points (0 past the last recall);
AP is the mean over IoU thresholds, recall points and classes with ground truth (COCOeval's -1 for none is None
here); AR the mean over thresholds and classes of the final recall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# COCOeval's Params for segm, computed as it computes them (the same floats).
IOU_THRESHOLDS = np.linspace(.5, 0.95, int(np.round((0.95 - .5) / .05)) + 1, endpoint=True)
RECALL_THRESHOLDS = np.linspace(.0, 1.00, int(np.round((1.00 - .0) / .01)) + 1, endpoint=True)
MAX_DETS = (1, 10, 100)
AREA_RANGES = ((0 ** 2, 1e5 ** 2), (0 ** 2, 32 ** 2), (32 ** 2, 96 ** 2), (96 ** 2, 1e5 ** 2))
AREA_NAMES = ("all", "small", "medium", "large")
_CHUNK = 32  # detections per matrix product: bounds the float copy of the masks


@dataclass
class InstanceState:
    """Detections of any number of images and the ground truth counts they are scored against.

    npig [K, A] int64: ground truth not ignored per class and area range. Per detection (at most MAX_DETS[-1]
    per image and class): image [N] int64 (its image id: ties in score are broken in image-id order, as COCOeval's
    sorted image ids do), category [N] int64, rank [N] int64 (its place by score among its image's detections of
    its class), score [N] float64, matched / ignored [N, A, T] bool per area range and IoU threshold.
    `a + b` merges two (towers, workers, image ranges); the images must differ."""

    npig: np.ndarray
    image: np.ndarray
    category: np.ndarray
    rank: np.ndarray
    score: np.ndarray
    matched: np.ndarray
    ignored: np.ndarray

    @classmethod
    def zeros(cls, num_classes: int) -> InstanceState:
        a, t = len(AREA_RANGES), len(IOU_THRESHOLDS)
        return cls(np.zeros((num_classes, a), np.int64), *(np.zeros(0, np.int64) for _ in range(3)),
                   np.zeros(0), np.zeros((0, a, t), bool), np.zeros((0, a, t), bool))

    def __add__(self, other: InstanceState) -> InstanceState:
        if self.npig.shape != other.npig.shape:
            raise ValueError("states of different class counts")
        return InstanceState(self.npig + other.npig, *(np.concatenate([x, y]) for x, y in (
            (self.image, other.image), (self.category, other.category), (self.rank, other.rank),
            (self.score, other.score), (self.matched, other.matched), (self.ignored, other.ignored))))

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The arrays by name (to gather, or save)."""
        return {k: getattr(self, k) for k in _FIELDS}

    @classmethod
    def from_arrays(cls, arrays: dict) -> InstanceState:
        """as_arrays' inverse."""
        return cls(*(np.asarray(arrays[k], dtype) for k, dtype in zip(_FIELDS, _DTYPES)))


_FIELDS = ("npig", "image", "category", "rank", "score", "matched", "ignored")
_DTYPES = (np.int64, np.int64, np.int64, np.int64, np.float64, bool, bool)


def _flat(masks) -> np.ndarray:
    masks = np.asarray(masks, bool)
    return masks.reshape(masks.shape[0], -1)


def _intersections(dets: np.ndarray, gts: np.ndarray) -> np.ndarray:
    """[D, G] int64 pixel counts of det AND gt (float32 products are exact below 2^24 pixels)."""
    dtype = np.float32 if dets.shape[1] < 2 ** 24 else np.float64
    g = gts.T.astype(dtype)
    out = np.empty((dets.shape[0], gts.shape[0]), np.int64)
    for i in range(0, dets.shape[0], _CHUNK):
        out[i:i + _CHUNK] = np.rint(dets[i:i + _CHUNK].astype(dtype) @ g)
    return out


def _match(ious: np.ndarray, gt_ignore: np.ndarray, crowd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """COCOeval.evaluateImg's greedy matching of detections (rows, by score) to ground truth (columns):
    (matched, ignored) [T, D]."""
    t_n, d_n = len(IOU_THRESHOLDS), ious.shape[0]
    matched, ignored = np.zeros((t_n, d_n), bool), np.zeros((t_n, d_n), bool)
    if d_n == 0 or ious.shape[1] == 0:
        return matched, ignored
    order = np.argsort(gt_ignore, kind="mergesort")  # ignored ground truth last
    ious = ious[:, order]
    ig, cr = gt_ignore[order].tolist(), crowd[order].tolist()
    best = ious.max(1)
    rows = ious.tolist()
    for t_i, t in enumerate(IOU_THRESHOLDS):
        threshold = min(t, 1 - 1e-10)
        taken = [False] * len(ig)
        for d in np.flatnonzero(best >= threshold).tolist():  # no other detection can match at this threshold
            row, iou, m = rows[d], threshold, -1
            for g in range(len(ig)):
                if taken[g] and not cr[g]:
                    continue
                if m > -1 and not ig[m] and ig[g]:
                    break
                if row[g] < iou:
                    continue
                iou, m = row[g], g
            if m > -1:
                matched[t_i, d], ignored[t_i, d], taken[m] = True, ig[m], True
    return matched, ignored


def instance_image_state(image_id: int, pred_masks, pred_scores, pred_labels, gt_masks, gt_labels, num_classes: int,
                         gt_crowd=None, gt_areas=None) -> InstanceState:
    """One image's contribution.

    Args:
        image_id: an integer key; ties in score across images go to the lower id (COCOeval's image-id order).
        pred_masks: [N, H, W] bool; pred_scores [N]; pred_labels [N] train ids. Their order breaks ties in score.
        gt_masks: [G, H, W] bool, may overlap; gt_labels [G] train ids; gt_crowd [G] bool (default none);
            gt_areas [G] (default the masks' pixels; COCO's JSON may give polygon areas).
        num_classes: K; labels are 0 .. K - 1.
    """
    scores = np.asarray(pred_scores, np.float64).reshape(-1)
    labels = np.asarray(pred_labels, np.int64).reshape(-1)
    gt_labels = np.asarray(gt_labels, np.int64).reshape(-1)
    dets, gts = _flat(pred_masks) if len(labels) else None, _flat(gt_masks) if len(gt_labels) else None
    crowd = np.zeros(len(gt_labels), bool) if gt_crowd is None else np.asarray(gt_crowd, bool).reshape(-1)
    gt_area = (gts.sum(1) if gts is not None else np.zeros(0, np.int64)) if gt_areas is None \
        else np.asarray(gt_areas, np.float64).reshape(-1)
    for name, values in (("pred_labels", labels), ("gt_labels", gt_labels)):
        if values.size and (values.min() < 0 or values.max() >= num_classes):
            raise ValueError(f"{name} must lie in 0 .. {num_classes - 1}")
    if len(scores) != len(labels) or (dets is not None and len(dets) != len(labels)):
        raise ValueError("pred_masks, pred_scores and pred_labels differ in length")
    if len(crowd) != len(gt_labels) or len(gt_area) != len(gt_labels) \
            or (gts is not None and len(gts) != len(gt_labels)):
        raise ValueError("gt_masks, gt_labels, gt_crowd and gt_areas differ in length")
    if dets is not None and gts is not None and dets.shape[1] != gts.shape[1]:
        raise ValueError("prediction and ground truth masks differ in size")

    state = InstanceState.zeros(num_classes)
    parts = []
    for c in np.union1d(labels, gt_labels).tolist():
        d_idx = np.flatnonzero(labels == c)
        d_idx = d_idx[np.argsort(-scores[d_idx], kind="mergesort")][:MAX_DETS[-1]]
        g_idx = np.flatnonzero(gt_labels == c)
        d_area = dets[d_idx].sum(1) if d_idx.size else np.zeros(0, np.int64)
        if d_idx.size and g_idx.size:
            inter = _intersections(dets[d_idx], gts[g_idx])
            union = np.where(crowd[g_idx][None], d_area[:, None],
                             d_area[:, None] + gts[g_idx].sum(1)[None] - inter)
            ious = np.where(inter > 0, inter / np.maximum(union, 1), 0.0)
        else:
            ious = np.zeros((d_idx.size, g_idx.size))
        matched = np.zeros((d_idx.size, len(AREA_RANGES), len(IOU_THRESHOLDS)), bool)
        ignored = np.zeros_like(matched)
        for a, (lo, hi) in enumerate(AREA_RANGES):
            gt_ignore = crowd[g_idx] | (gt_area[g_idx] < lo) | (gt_area[g_idx] > hi)
            state.npig[c, a] += int(np.count_nonzero(~gt_ignore))
            m, ig = _match(ious, gt_ignore, crowd[g_idx])
            outside = (d_area < lo) | (d_area > hi)
            matched[:, a], ignored[:, a] = m.T, (ig | (~m & outside[None])).T
        parts.append((np.full(d_idx.size, c), np.arange(d_idx.size), scores[d_idx], matched, ignored))
    if parts:
        state.category, state.rank, state.score, state.matched, state.ignored = (
            np.concatenate([p[i] for p in parts]).astype(state_dtype) for i, state_dtype in
            enumerate((np.int64, np.int64, np.float64, bool, bool)))
        state.image = np.full(state.score.size, int(image_id), np.int64)
    return state


def accumulate(state: InstanceState) -> tuple[np.ndarray, np.ndarray]:
    """COCOeval.accumulate: (precision [T, R, K, A, M], recall [T, K, A, M]), -1 where a class has no ground
    truth in the area range."""
    k_n = state.npig.shape[0]
    t_n, r_n, a_n, m_n = len(IOU_THRESHOLDS), len(RECALL_THRESHOLDS), len(AREA_RANGES), len(MAX_DETS)
    precision = -np.ones((t_n, r_n, k_n, a_n, m_n))
    recall = -np.ones((t_n, k_n, a_n, m_n))
    order = np.lexsort((state.rank, state.image, -state.score))
    for k in range(k_n):
        of_k = order[state.category[order] == k]
        for a in range(a_n):
            npig = state.npig[k, a]
            if npig == 0:
                continue
            for m, max_det in enumerate(MAX_DETS):
                sel = of_k[state.rank[of_k] < max_det]
                dtm, dt_ig = state.matched[sel, a].T, state.ignored[sel, a].T  # [T, nd]
                tp_sum = np.cumsum(dtm & ~dt_ig, axis=1).astype(float)
                fp_sum = np.cumsum(~dtm & ~dt_ig, axis=1).astype(float)
                nd = sel.size
                for t in range(t_n):
                    tp, fp = tp_sum[t], fp_sum[t]
                    rc = tp / npig
                    pr = tp / (fp + tp + np.spacing(1))
                    recall[t, k, a, m] = rc[-1] if nd else 0
                    pr = np.maximum.accumulate(pr[::-1])[::-1]  # exact: max rounds nothing
                    inds = np.searchsorted(rc, RECALL_THRESHOLDS, side="left")
                    q = np.zeros(r_n)
                    inside = inds < nd
                    q[inside] = pr[inds[inside]]
                    precision[t, :, k, a, m] = q
    return precision, recall


def _mean(s: np.ndarray) -> float | None:
    return None if len(s[s > -1]) == 0 else float(np.mean(s[s > -1]))


def _summarize(precision, recall, ap: bool, iou=None, area="all", max_dets=100) -> float | None:
    # COCOeval.summarize's _summarize, its indexing kept so the mean runs over the same values in the same order.
    aind = [i for i, name in enumerate(AREA_NAMES) if name == area]
    mind = [i for i, m in enumerate(MAX_DETS) if m == max_dets]
    s = precision if ap else recall
    if iou is not None:
        s = s[np.where(iou == IOU_THRESHOLDS)[0]]
    s = s[:, :, :, aind, mind] if ap else s[:, :, aind, mind]
    return _mean(s)


def instance_summary(state: InstanceState, class_names: Sequence[str] | None = None) -> dict:
    """The report, COCOeval.stats by name: ap, ap50, ap75, ap_small, ap_medium, ap_large, ar1, ar10, ar100,
    ar_small, ar_medium, ar_large (None where COCOeval prints -1: no ground truth in that area range), and
    per_class_ap {name or train id: AP over the thresholds at maxDets 100, all areas; None without ground
    truth}."""
    precision, recall = accumulate(state)
    p, r = precision, recall
    out = {
        "ap": _summarize(p, r, True), "ap50": _summarize(p, r, True, iou=.5), "ap75": _summarize(p, r, True, iou=.75),
        "ap_small": _summarize(p, r, True, area="small"), "ap_medium": _summarize(p, r, True, area="medium"),
        "ap_large": _summarize(p, r, True, area="large"),
        "ar1": _summarize(p, r, False, max_dets=1), "ar10": _summarize(p, r, False, max_dets=10),
        "ar100": _summarize(p, r, False), "ar_small": _summarize(p, r, False, area="small"),
        "ar_medium": _summarize(p, r, False, area="medium"), "ar_large": _summarize(p, r, False, area="large"),
    }
    k_n = state.npig.shape[0]
    names = list(class_names) if class_names is not None else [str(c) for c in range(k_n)]
    out["per_class_ap"] = {names[k]: _mean(precision[:, :, k, 0, -1]) for k in range(k_n)}
    return out
