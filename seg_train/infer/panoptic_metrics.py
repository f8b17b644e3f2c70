"""Panoptic quality (PQ, SQ, RQ) as panopticapi's pq_compute (the code of cityscapesscripts'
evalPanopticSemanticLabeling) computes it, image by image into a state that sums; numpy only.

Per image and class: a ground-truth and a predicted segment of the class match when their IoU > 0.5, the union
without the prediction's pixels on unlabelled (VOID) ground truth; matches add their IoU and a true positive.
Unmatched non-crowd ground truth segments are false negatives. An unmatched prediction is a false positive
unless more than half of it lies on VOID plus the crowd region of its class (the last crowd segment of that class
in the image's list, as panopticapi keeps one per class). Crowd segments never match.

PQ = sum IoU / (TP + FP / 2 + FN / 2), SQ = sum IoU / TP (0 without TP), RQ = TP / (TP + FP / 2 + FN / 2), per
class; averaged over the classes with any TP, FP or FN, over all / thing / stuff classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class PanopticState:
    """Per-class sums over images: IoU of the matches [K] float64, TP, FP, FN [K] int64. `a + b` merges two
    (towers, workers, image ranges); the order images are added in changes the IoU sums only by rounding."""

    iou: np.ndarray
    tp: np.ndarray
    fp: np.ndarray
    fn: np.ndarray

    @classmethod
    def zeros(cls, num_classes: int) -> PanopticState:
        return cls(np.zeros(num_classes), *(np.zeros(num_classes, np.int64) for _ in range(3)))

    def __add__(self, other: PanopticState) -> PanopticState:
        return PanopticState(self.iou + other.iou, self.tp + other.tp, self.fp + other.fp, self.fn + other.fn)

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The four arrays by name (to all-reduce, or save)."""
        return {"iou": self.iou, "tp": self.tp, "fp": self.fp, "fn": self.fn}

    @classmethod
    def from_arrays(cls, arrays: dict) -> PanopticState:
        """as_arrays' inverse."""
        return cls(np.asarray(arrays["iou"], np.float64),
                   *(np.asarray(arrays[k], np.int64) for k in ("tp", "fp", "fn")))


def _dense(ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each pixel's position in `keys` + 1 (sorted unique segment ids), 0 for an id not in keys (VOID, or
    unknown)."""
    flat = ids.ravel()
    pos = np.searchsorted(keys, flat)
    hit = pos < keys.size
    hit[hit] = keys[pos[hit]] == flat[hit]
    return np.where(hit, pos + 1, 0)


def panoptic_image_state(gt_ids, gt_segments: Sequence[dict], pred_ids, pred_segments: Sequence[dict],
                         num_classes: int) -> PanopticState:
    """One image's contribution.

    Args:
        gt_ids: [H, W] ground truth segment ids, 0 for unlabelled (VOID).
        gt_segments: {"id", "category_id" (train id), "iscrowd"} per ground truth segment; ids in gt_ids but not
            here are neither VOID nor a segment (as in panopticapi).
        pred_ids: [H, W] predicted segment ids, 0 for none.
        pred_segments: {"id", "category_id" (train id)} per predicted segment; each must have pixels and every
            non-zero id of pred_ids must be listed (panopticapi refuses both).
        num_classes: K; category ids are 0 .. K - 1.
    """
    gt_ids, pred_ids = np.asarray(gt_ids), np.asarray(pred_ids)
    if gt_ids.shape != pred_ids.shape:
        raise ValueError(f"ground truth {gt_ids.shape} and prediction {pred_ids.shape} differ in size")
    state = PanopticState.zeros(num_classes)
    gt_keys = np.asarray([s["id"] for s in gt_segments], np.int64)
    pred_keys = np.asarray([s["id"] for s in pred_segments], np.int64)
    if 0 in gt_keys or 0 in pred_keys or len(set(gt_keys.tolist())) < gt_keys.size \
            or len(set(pred_keys.tolist())) < pred_keys.size:
        raise ValueError("segment ids must be unique and non-zero")
    gt_order, pred_order = np.argsort(gt_keys), np.argsort(pred_keys)
    g = _dense(gt_ids, gt_keys[gt_order])
    p = _dense(pred_ids, pred_keys[pred_order])
    if np.any((p == 0) & (pred_ids.ravel() != 0)):
        raise ValueError("a predicted segment id is in the map but not in pred_segments")
    n_g, n_p = gt_keys.size + 1, pred_keys.size + 1
    # inter[i, j]: pixels of sorted gt segment i - 1 and sorted predicted segment j - 1; row 0 gt VOID or unknown,
    # column 0 no prediction. "Unknown" ground truth ids count in areas as panopticapi's do (only id 0 is VOID).
    inter = np.bincount(g * n_p + p, minlength=n_g * n_p).reshape(n_g, n_p)
    gt_void = (gt_ids.ravel() == 0)
    void_inter = np.bincount(p[gt_void], minlength=n_p)  # each prediction's pixels on VOID
    pred_area = inter.sum(0)
    gt_area = np.bincount(g, minlength=n_g)
    if np.any(pred_area[1:] == 0):
        raise ValueError("a predicted segment has no pixel")

    gt_cat = np.asarray([gt_segments[i]["category_id"] for i in gt_order], np.int64)
    gt_crowd = np.asarray([bool(gt_segments[i].get("iscrowd", 0)) for i in gt_order], bool)
    pred_cat = np.asarray([pred_segments[i]["category_id"] for i in pred_order], np.int64)
    for cats in (gt_cat, pred_cat):
        if cats.size and (cats.min() < 0 or cats.max() >= num_classes):
            raise ValueError(f"category ids must lie in 0 .. {num_classes - 1}")

    # Matches: non-crowd ground truth and a prediction of its class, IoU > 0.5 (unique by construction).
    gi, pj = np.nonzero(inter[1:, 1:])
    same = (gt_cat[gi] == pred_cat[pj]) & ~gt_crowd[gi]
    gi, pj = gi[same], pj[same]
    i_area = inter[gi + 1, pj + 1]
    union = pred_area[pj + 1] + gt_area[gi + 1] - i_area - void_inter[pj + 1]
    iou = i_area / union
    match = iou > 0.5
    gi, pj, iou = gi[match], pj[match], iou[match]
    np.add.at(state.iou, gt_cat[gi], iou)
    np.add.at(state.tp, gt_cat[gi], 1)
    gt_matched = np.zeros(gt_keys.size, bool)
    gt_matched[gi] = True
    pred_matched = np.zeros(pred_keys.size, bool)
    pred_matched[pj] = True

    np.add.at(state.fn, gt_cat[~gt_matched & ~gt_crowd], 1)
    crowd_of_cat: dict[int, int] = {}  # the last crowd segment of each class, in the list's order
    for i, s in enumerate(gt_segments):
        if s.get("iscrowd", 0):
            crowd_of_cat[int(s["category_id"])] = int(np.flatnonzero(gt_order == i)[0])
    for j in np.flatnonzero(~pred_matched):
        ignored = void_inter[j + 1]
        crowd = crowd_of_cat.get(int(pred_cat[j]))
        if crowd is not None:
            ignored += inter[crowd + 1, j + 1]
        if ignored / pred_area[j + 1] > 0.5:
            continue
        state.fp[pred_cat[j]] += 1
    return state


def _per_class(state: PanopticState, c: int) -> dict:
    tp, fp, fn, iou = int(state.tp[c]), int(state.fp[c]), int(state.fn[c]), float(state.iou[c])
    denom = tp + 0.5 * fp + 0.5 * fn
    if tp + fp + fn == 0:
        return {"pq": 0.0, "sq": 0.0, "rq": 0.0, "tp": 0, "fp": 0, "fn": 0}
    return {"pq": iou / denom, "sq": iou / tp if tp else 0.0, "rq": tp / denom, "tp": tp, "fp": fp, "fn": fn}


def _average(state: PanopticState, classes) -> dict:
    # Summed class by class in train-id order, as panopticapi sums in its categories' order.
    pq = sq = rq = 0.0
    n = 0
    for c in classes:
        if state.tp[c] + state.fp[c] + state.fn[c] == 0:
            continue
        r = _per_class(state, int(c))
        pq, sq, rq, n = pq + r["pq"], sq + r["sq"], rq + r["rq"], n + 1
    if n == 0:
        return {"pq": None, "sq": None, "rq": None, "n": 0}
    return {"pq": pq / n, "sq": sq / n, "rq": rq / n, "n": n}


def panoptic_summary(state: PanopticState, is_thing: Sequence[bool],
                     class_names: Sequence[str] | None = None) -> dict:
    """The report: pq, sq, rq, n (classes averaged) for all / things / stuff (keys pq, pq_things, pq_stuff, ...;
    None where no class of the group has a TP, FP or FN, where panopticapi divides by zero), and per_class:
    {name or train id: {pq, sq, rq, tp, fp, fn}} for every class (pq, sq, rq 0 for a class never seen, which the
    averages leave out)."""
    is_thing = np.asarray(is_thing, bool)
    k = state.tp.size
    if is_thing.shape != (k,):
        raise ValueError(f"is_thing has {is_thing.shape} entries for {k} classes")
    out = {}
    for suffix, classes in (("", np.arange(k)), ("_things", np.flatnonzero(is_thing)),
                            ("_stuff", np.flatnonzero(~is_thing))):
        for key, value in _average(state, classes).items():
            out[key + suffix] = value
    names = list(class_names) if class_names is not None else [str(c) for c in range(k)]
    out["per_class"] = {names[c]: _per_class(state, c) for c in range(k)}
    return out
