"""Mask AP (seg_train/infer/instance_metrics.py) held to pycocotools' COCOeval(iouType="segm"): the ground truth
written here as a COCO instances JSON with pycocotools' own RLE, the predictions as a COCO results JSON by
seg_train/infer/coco_format.py, read back by COCO.loadRes.

Random images with overlapping and crowd ground truth, objects at the area ranges' edges (32 x 32, 96 x 96),
predictions shifted, grown, relabelled, empty, scores on a coarse grid (ties inside and across images, the images
streamed in another order than their ids), more than 100 detections of one class in an image, an image without
prediction, a class only predicted and one only labelled. Equal: the precision and recall arrays and every stat
exactly (the same floats summed in the same order)."""

import contextlib
import io
import json

import numpy as np
import pytest

from seg_train.infer import coco_format as F
from seg_train.infer import instance_metrics as M

pytest.importorskip("pycocotools")
from pycocotools import mask as mask_util  # noqa: E402
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402

K = 5
CAT_IDS = [2, 5, 11, 17, 90]
ONLY_PREDICTED, ONLY_LABELLED = 3, 4
H, W = 112, 144
STATS = ("ap", "ap50", "ap75", "ap_small", "ap_medium", "ap_large", "ar1", "ar10", "ar100", "ar_small",
         "ar_medium", "ar_large")


def shape(rng):
    """A random rectangle or ellipse mask; now and then exactly 32 x 32 or 96 x 96 (the area ranges' edges)."""
    m = np.zeros((H, W), bool)
    pick = rng.random()
    if pick < 0.08:
        side = 32 if rng.random() < 0.5 else 96
        y, x = rng.integers(0, H - side + 1), rng.integers(0, W - side + 1)
        m[y:y + side, x:x + side] = True
        return m
    h, w = (rng.integers(3, 20, 2) if pick < 0.5 else rng.integers(10, 110, 2))
    y, x = rng.integers(0, max(H - h, 1)), rng.integers(0, max(W - w, 1))
    if rng.random() < 0.5:
        m[y:y + h, x:x + w] = True
    else:
        yy, xx = np.mgrid[0:H, 0:W]
        m[((yy - y - h / 2) / (h / 2)) ** 2 + ((xx - x - w / 2) / (w / 2)) ** 2 <= 1] = True
    return m


def image(rng, index):
    n_gt = rng.integers(0, 7)
    gt_masks = [shape(rng) for _ in range(n_gt)]
    gt_labels = [int(rng.choice([0, 1, 2, ONLY_LABELLED])) for _ in range(n_gt)]
    gt_crowd = [bool(rng.random() < 0.15) for _ in range(n_gt)]
    if n_gt and rng.random() < 0.6:  # a crowd region around an object of its class: better IoU, to be passed over
        i = int(rng.integers(n_gt))
        gt_masks.append(gt_masks[i] | np.roll(gt_masks[i], 3, 0) | np.roll(gt_masks[i], 3, 1))
        gt_labels.append(gt_labels[i])
        gt_crowd.append(True)
    pred_masks, pred_labels = [], []
    if index != 2:  # image 2: no prediction at all
        for m, c in zip(gt_masks, gt_labels):
            for _ in range(rng.integers(0, 4)):
                p = np.roll(m, tuple(rng.integers(-2, 3, 2)), (0, 1))
                if rng.random() < 0.3:
                    p = p | np.roll(p, 2, 0)
                pred_labels.append(c if c != ONLY_LABELLED and rng.random() > 0.15 else int(rng.integers(0, 4)))
                pred_masks.append(p)
        for _ in range(rng.integers(0, 4)):
            pred_masks.append(shape(rng) if rng.random() > 0.2 else np.zeros((H, W), bool))
            pred_labels.append(int(rng.choice([0, 1, ONLY_PREDICTED])))
    if index == 4:  # more than 100 detections of class 0
        for _ in range(120):
            p = np.zeros((H, W), bool)
            y, x = rng.integers(0, H - 4), rng.integers(0, W - 4)
            p[y:y + rng.integers(1, 5), x:x + rng.integers(1, 5)] = True
            pred_masks.append(p)
            pred_labels.append(0)
    scores = np.round(rng.uniform(0, 1, len(pred_masks)), 1)  # many ties
    return {
        "gt_masks": np.asarray(gt_masks, bool).reshape(-1, H, W), "gt_labels": np.int64(gt_labels),
        "gt_crowd": np.asarray(gt_crowd, bool), "pred_masks": np.asarray(pred_masks, bool).reshape(-1, H, W),
        "pred_labels": np.int64(pred_labels), "pred_scores": scores.astype(np.float32)}


def dataset(seed, n=14):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.arange(n) * 7 + 3)  # streamed in another order than the ids
    return [(int(ids[i]), image(rng, i)) for i in range(n)]


def ours(images):
    state = M.InstanceState.zeros(K)
    for image_id, d in images:
        state = state + M.instance_image_state(image_id, d["pred_masks"], d["pred_scores"], d["pred_labels"],
                                               d["gt_masks"], d["gt_labels"], K, gt_crowd=d["gt_crowd"])
    return state


def reference_coco(tmp_path, images):
    """COCOeval on the ground truth (pycocotools' own RLE) and on the results the writers wrote."""
    gt_anns, results = [], []
    for image_id, d in images:
        for m, c, crowd in zip(d["gt_masks"], d["gt_labels"], d["gt_crowd"]):
            rle = mask_util.encode(np.asfortranarray(m.astype(np.uint8)))
            gt_anns.append({"id": len(gt_anns) + 1, "image_id": image_id, "category_id": CAT_IDS[c],
                            "segmentation": {"size": rle["size"], "counts": rle["counts"].decode()},
                            "area": int(m.sum()), "bbox": mask_util.toBbox(rle).tolist(), "iscrowd": int(crowd)})
        results += F.instance_results(image_id, d["pred_masks"], d["pred_scores"], d["pred_labels"], CAT_IDS)
    gt = {"images": [{"id": i, "height": H, "width": W} for i, _ in images], "annotations": gt_anns,
          "categories": [{"id": c} for c in CAT_IDS]}
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "results.json").write_text(json.dumps(results))
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(tmp_path / "gt.json"))
        if results:
            coco_dt = coco_gt.loadRes(str(tmp_path / "results.json"))
        else:  # loadRes cannot read an empty list
            coco_dt = COCO()
            coco_dt.dataset = {"images": gt["images"], "categories": gt["categories"], "annotations": []}
            coco_dt.createIndex()
        ev = COCOeval(coco_gt, coco_dt, iouType="segm")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


def assert_same(state, ev):
    precision, recall = M.accumulate(state)
    np.testing.assert_array_equal(precision, ev.eval["precision"])
    np.testing.assert_array_equal(recall, ev.eval["recall"])
    summary = M.instance_summary(state)
    assert [summary[k] if summary[k] is not None else -1 for k in STATS] == ev.stats.tolist()
    return summary


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ap_equals_cocoeval(tmp_path, seed):
    """Random sets: precision [T, R, K, A, M], recall and the 12 stats equal COCOeval's exactly. Fails for: crowd
    ground truth not ignored or its IoU over the union, area ranges with an end exclusive, the detection's area
    ignored for unmatched detections outside the range, a tie in score ordered otherwise (by stream order, not
    image id), precision not made non-increasing or read at 11 points, maxDets 1 / 10 not applied, matches at
    IoU > t instead of >= t, a crowd region of higher IoU preferred to a regular object, a class without ground
    truth counted as 0, RLE written row-major."""
    images = dataset(seed)
    state = ours(images)
    summary = assert_same(state, reference_coco(tmp_path, images))
    assert summary["per_class_ap"][str(ONLY_PREDICTED)] is None
    assert summary["per_class_ap"][str(ONLY_LABELLED)] == 0.0


def test_ap_with_no_prediction_at_all(tmp_path):
    """No image has a prediction: AP 0 for the classes with ground truth, as COCOeval. Fails for: None (no
    detection mistaken for no ground truth), a crash on empty arrays."""
    images = [(i, {**d, "pred_masks": np.zeros((0, H, W), bool), "pred_labels": np.zeros(0, np.int64),
                   "pred_scores": np.zeros(0, np.float32)}) for i, d in dataset(5, 4)]
    summary = assert_same(ours(images), reference_coco(tmp_path, images))
    assert summary["ap"] == 0.0


def test_random_sets_reach_the_rules():
    """The random sets hold what the comparison needs: crowd ground truth that detections match, objects of
    exactly 32^2 and 96^2 pixels, ties in score across images, more than 100 detections of a class in an image.
    Fails for: a generator change that stops making one of them."""
    crowd = edge = crowd_matched = 0
    scores = []
    for seed in (0, 1, 2):
        state = ours(dataset(seed))
        crowd_matched += int((state.matched[:, 0, 0] & state.ignored[:, 0, 0]).sum())
        for image_id, d in dataset(seed):
            crowd += int(d["gt_crowd"].sum())
            edge += int(np.isin(d["gt_masks"].sum((1, 2)), [32 ** 2, 96 ** 2]).sum())
            scores += [(s, image_id) for s in d["pred_scores"].tolist()]
    assert crowd >= 3 and edge >= 2 and crowd_matched >= 3
    by_score = {}
    for s, i in scores:
        by_score.setdefault(s, set()).add(i)
    assert any(len(v) > 1 for v in by_score.values())
    assert any(np.bincount(d["pred_labels"], minlength=K).max() > 100 for _, d in dataset(0))


def test_states_merge_in_any_grouping():
    """Images split over two 'towers', merged in the other order: the same precision and recall. Fails for: ties
    broken by merge order instead of image id, npig not summed."""
    images = dataset(6, 8)
    whole = ours(images)
    merged = M.InstanceState.from_arrays(ours(images[4:]).as_arrays()) + ours(images[:4])
    for a, b in zip(M.accumulate(whole), M.accumulate(merged)):
        np.testing.assert_array_equal(a, b)
