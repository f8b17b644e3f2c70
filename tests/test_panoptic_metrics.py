"""Panoptic quality (seg_train/infer/panoptic_metrics.py) held to the official evaluator, cityscapesscripts'
evalPanopticSemanticLabeling (panopticapi's pq_compute), run on COCO panoptic JSON + PNGs: the ground truth
written here by hand, the predictions by seg_train/infer/coco_format.py's writers.

Random images with thing and stuff classes, crowd regions (two of one class in an image: panopticapi keeps the
last), unlabelled pixels, predictions shifted, relabelled, split, dropped, on VOID, on crowd; an image without
prediction, classes only predicted, only labelled, and neither. Equal: every class's TP, FP, FN exactly, PQ / SQ /
RQ to 1e-12 (the IoU sums are added in another grouping), which is far below the evaluator's printed digit."""

import contextlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from seg_train.infer import coco_format as F
from seg_train.infer import panoptic_metrics as M

official = pytest.importorskip("cityscapesscripts.evaluation.evalPanopticSemanticLabeling")

K = 7
IS_THING = [True, True, True, False, False, False, True]
CAT_IDS = [1, 3, 7, 12, 20, 33, 40]  # non-contiguous dataset ids per train id
NAMES = ["person", "car", "dog", "sky", "road", "grass", "ghost"]
NEVER = 6  # neither labelled nor predicted: left out of the averages
ONLY_PREDICTED, ONLY_LABELLED = 5, 2
H, W = 40, 56


def rect(rng, h, w, min_side=3, max_side=20):
    y0, x0 = rng.integers(0, h - min_side), rng.integers(0, w - min_side)
    return slice(y0, y0 + rng.integers(min_side, max_side)), slice(x0, x0 + rng.integers(min_side, max_side))


def ground_truth(rng, next_id):
    """[H, W] ids (0 VOID) and segments_info (train ids): stuff as Voronoi cells, things as rectangles over it,
    crowd rectangles, VOID rectangles."""
    ids = np.zeros((H, W), np.int64)
    segs = []
    yy, xx = np.mgrid[0:H, 0:W]
    centres = rng.uniform(0, [H, W], (4, 2))
    cell = np.argmin((yy[..., None] - centres[:, 0]) ** 2 + (xx[..., None] - centres[:, 1]) ** 2, -1)
    stuff_of_cell = rng.choice([3, 4], 4)
    for c in np.unique(stuff_of_cell):
        sid = next_id()
        ids[np.isin(cell, np.flatnonzero(stuff_of_cell == c))] = sid
        segs.append({"id": sid, "category_id": int(c), "iscrowd": 0})
    for _ in range(rng.integers(2, 7)):
        sid = next_id()
        c = int(rng.choice([0, 1, ONLY_LABELLED]))
        crowd = int(rng.random() < 0.25)
        ids[rect(rng, H, W)] = sid
        segs.append({"id": sid, "category_id": c, "iscrowd": crowd})
    for _ in range(rng.integers(0, 3)):
        ids[rect(rng, H, W, 2, 10)] = 0
    present = set(np.unique(ids).tolist())
    return ids, [s for s in segs if s["id"] in present]


def prediction(rng, gt_ids, gt_segs, next_id):
    """Predictions from the ground truth: shifted, relabelled, split, dropped; plus false positives, some on
    VOID or on a crowd region."""
    ids = np.zeros((H, W), np.int64)
    segs = []

    def paint(mask, c):
        sid = next_id()
        ids[mask] = sid
        segs.append({"id": sid, "category_id": int(c)})

    for s in gt_segs:
        if rng.random() < 0.1:
            continue
        mask = np.roll(gt_ids == s["id"], tuple(rng.integers(-3, 4, 2)), (0, 1))
        c = s["category_id"] if rng.random() > 0.15 else rng.choice([0, 1, 3, 4])
        c = 0 if c == ONLY_LABELLED else c
        if rng.random() < 0.15:  # split in two halves along the columns
            cols = np.flatnonzero(mask.any(0))
            if cols.size > 1:
                half = mask.copy()
                half[:, cols[cols.size // 2]:] = False
                paint(mask & ~half, c)
                mask = half
        paint(mask, c)
    for _ in range(rng.integers(0, 3)):
        mask = np.zeros((H, W), bool)
        mask[rect(rng, H, W, 2, 12)] = True
        paint(mask, rng.choice([0, 1, 3, ONLY_PREDICTED]))
    void = np.argwhere(gt_ids == 0)
    if void.size:  # a small prediction around an unlabelled pixel: mostly on VOID or not
        y, x = void[rng.integers(len(void))]
        mask = np.zeros((H, W), bool)
        mask[max(y - 1, 0):y + 2, max(x - 1, 0):x + 2] = True
        paint(mask, rng.choice([0, 1]))
    for s in gt_segs:  # a prediction inside a crowd region, of its class or not
        if s["iscrowd"] and rng.random() < 0.7:
            inside = np.argwhere(gt_ids == s["id"])
            y, x = inside[rng.integers(len(inside))]
            mask = np.zeros((H, W), bool)
            mask[max(y - 2, 0):y + 2, max(x - 2, 0):x + 3] = True
            paint(mask, s["category_id"] if rng.random() < 0.8 and s["category_id"] != ONLY_LABELLED else 1)
    present = set(np.unique(ids).tolist())
    return ids, [s for s in segs if s["id"] in present]


def dataset(seed, n_images=12):
    rng = np.random.default_rng(seed)
    counter = iter(range(1, 10 ** 6))
    # Sparse ids above 256 and 256^2, so that the three colour channels all carry bits.
    def next_id():
        return next(counter) * 997 + 60000

    images = []
    for i in range(n_images):
        gt_ids, gt_segs = ground_truth(rng, next_id)
        if i == 0:  # two crowd regions of class 1 (panopticapi keeps the last one's), a prediction in each
            for rows in (slice(2, 10), slice(30, 38)):
                sid = next_id()
                gt_ids[rows, 40:50] = sid
                gt_segs.append({"id": sid, "category_id": 1, "iscrowd": 1})
            present = set(np.unique(gt_ids).tolist())
            gt_segs = [s for s in gt_segs if s["id"] in present]
        if i == 1:
            pred_ids, pred_segs = np.zeros((H, W), np.int64), []
        else:
            pred_ids, pred_segs = prediction(rng, gt_ids, gt_segs, next_id)
        if i == 0:
            for rows in (slice(4, 8), slice(32, 36)):
                sid = next_id()
                pred_ids[rows, 42:48] = sid
                pred_segs.append({"id": sid, "category_id": 1})
            present = set(np.unique(pred_ids).tolist())
            pred_segs = [s for s in pred_segs if s["id"] in present]
        images.append((gt_ids, gt_segs, pred_ids, pred_segs))
    return images


def write_reference_gt(root, images):
    """The ground truth in COCO panoptic format, by hand (not through the writers under test)."""
    folder = root / "gt"
    folder.mkdir()
    annotations = []
    for i, (gt_ids, gt_segs, _, _) in enumerate(images):
        rgb = np.stack([gt_ids % 256, (gt_ids >> 8) % 256, gt_ids >> 16], -1).astype(np.uint8)
        Image.fromarray(rgb).save(folder / f"{i}.png")
        annotations.append({"image_id": f"img{i}", "file_name": f"{i}.png", "segments_info": [
            {"id": s["id"], "category_id": CAT_IDS[s["category_id"]], "iscrowd": s["iscrowd"],
             "area": int((gt_ids == s["id"]).sum())} for s in gt_segs]})
    categories = [{"id": CAT_IDS[c], "name": NAMES[c], "isthing": int(IS_THING[c])} for c in range(K)]
    path = root / "gt.json"
    path.write_text(json.dumps({"annotations": annotations, "categories": categories,
                                "images": [{"id": f"img{i}"} for i in range(len(images))]}))
    return path, folder


def write_predictions(root, images):
    folder = root / "pred"
    folder.mkdir()
    annotations = []
    for i, (_, _, pred_ids, pred_segs) in enumerate(images):
        F.write_panoptic_png(folder / f"{i}.png", pred_ids)
        annotations.append(F.panoptic_annotation(f"img{i}", f"{i}.png", pred_ids, pred_segs, CAT_IDS))
    path = root / "pred.json"
    path.write_text(json.dumps({"annotations": annotations}))
    return path, folder


def run_official(tmp_path, images):
    gt_json, gt_folder = write_reference_gt(tmp_path, images)
    pred_json, pred_folder = write_predictions(tmp_path, images)
    categories = {c["id"]: c for c in json.loads(gt_json.read_text())["categories"]}
    gt_anns = json.loads(gt_json.read_text())["annotations"]
    pred_anns = {a["image_id"]: a for a in json.loads(pred_json.read_text())["annotations"]}
    with contextlib.redirect_stdout(io.StringIO()):
        stat = official.pq_compute_single_core(
            0, [(g, pred_anns[g["image_id"]]) for g in gt_anns], str(gt_folder), str(pred_folder), categories)
    return stat, official.average_pq(stat, categories)


def ours(images):
    state = M.PanopticState.zeros(K)
    for gt_ids, gt_segs, pred_ids, pred_segs in images:
        state = state + M.panoptic_image_state(gt_ids, gt_segs, pred_ids, pred_segs, K)
    return state, M.panoptic_summary(state, IS_THING, NAMES)


def assert_same(state, summary, stat, results):
    for c in range(K):
        ref = stat.pq_per_cat[CAT_IDS[c]]
        assert (int(state.tp[c]), int(state.fp[c]), int(state.fn[c])) == (ref.tp, ref.fp, ref.fn), NAMES[c]
        assert state.iou[c] == pytest.approx(ref.iou, rel=1e-12, abs=1e-12)
        for key in ("pq", "sq", "rq"):
            assert summary["per_class"][NAMES[c]][key] == pytest.approx(
                results["per_class"][CAT_IDS[c]][key], rel=1e-12, abs=1e-15)
    for group, suffix in (("All", ""), ("Things", "_things"), ("Stuff", "_stuff")):
        assert summary["n" + suffix] == results[group]["n"]
        for key in ("pq", "sq", "rq"):
            assert summary[key + suffix] == pytest.approx(results[group][key], rel=1e-12), (group, key)
            assert f"{100 * summary[key + suffix]:5.1f}" == f"{100 * results[group][key]:5.1f}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pq_equals_the_official_evaluator(tmp_path, seed):
    """Random sets: every class's TP / FP / FN and IoU sum, the per-class and all / things / stuff PQ, SQ, RQ and
    the class counts n equal the official's. Fails for: matching at IoU >= 0.4 or without the VOID pixels taken
    out of the union, crowd segments matched or counted as FN, predictions on a crowd region of their class or on
    VOID counted as FP (or on another class's crowd not counted), the first crowd of a class used instead of the
    last, the never-seen class counted in the averages, SQ divided by TP + FP, things and stuff swapped, category
    ids not mapped back, the PNG's channels in another order."""
    images = dataset(seed)
    state, summary = ours(images)
    stat, results = run_official(tmp_path, images)
    assert_same(state, summary, stat, results)
    assert summary["per_class"][NAMES[NEVER]] == {"pq": 0.0, "sq": 0.0, "rq": 0.0, "tp": 0, "fp": 0, "fn": 0}
    assert state.tp[ONLY_LABELLED] == 0 and state.fn[ONLY_LABELLED] > 0
    assert state.fp[ONLY_PREDICTED] > 0 and state.fn[ONLY_PREDICTED] == 0


def test_rules_are_exercised_by_the_random_sets():
    """The random sets reach each rule (else the comparison above could not see a mistake in it): matches,
    crowd-absorbed and VOID-absorbed predictions, two crowds of one class in an image. Fails for: a generator
    change that stops making crowd or VOID cases."""
    crowd_absorbed = void_absorbed = two_crowds = 0
    for seed in (0, 1, 2):
        for gt_ids, gt_segs, pred_ids, pred_segs in dataset(seed):
            crowd_cats = [s["category_id"] for s in gt_segs if s["iscrowd"]]
            two_crowds += len(crowd_cats) != len(set(crowd_cats))
            for s in pred_segs:
                mask = pred_ids == s["id"]
                on_void = (gt_ids[mask] == 0).sum()
                crowd = [g["id"] for g in gt_segs if g["iscrowd"] and g["category_id"] == s["category_id"]]
                on_crowd = np.isin(gt_ids[mask], crowd[-1:]).sum()
                void_absorbed += on_void / mask.sum() > 0.5
                crowd_absorbed += on_void / mask.sum() <= 0.5 < (on_void + on_crowd) / mask.sum()
    assert crowd_absorbed >= 3 and void_absorbed >= 3 and two_crowds >= 1


def test_states_sum_in_any_grouping(tmp_path):
    """Images split over two 'towers' in another order and the two states added: the same counts and, to
    rounding, the same IoU sums. Fails for: a state that keeps only its last image, counts not summed."""
    images = dataset(3, 8)
    whole, _ = ours(images)
    a, _ = ours(images[5:])
    b, _ = ours(images[:5])
    merged = M.PanopticState.from_arrays(b.as_arrays()) + a
    for key in ("tp", "fp", "fn"):
        np.testing.assert_array_equal(getattr(merged, key), getattr(whole, key))
    np.testing.assert_allclose(merged.iou, whole.iou, rtol=1e-12)


def test_no_thing_or_no_stuff_seen_gives_none():
    """A group of classes none of which has a TP, FP or FN averages to None (panopticapi divides by zero).
    Fails for: 0.0 reported for a group never seen (it would drag a mean of runs down)."""
    ids = np.ones((4, 4), np.int64)
    state = M.panoptic_image_state(ids, [{"id": 1, "category_id": 0, "iscrowd": 0}], ids,
                                   [{"id": 1, "category_id": 0}], 2)
    summary = M.panoptic_summary(state, [True, False])
    assert summary["pq"] == summary["pq_things"] == 1.0 and summary["pq_stuff"] is None
    assert summary["n_stuff"] == 0


@pytest.mark.slow
def test_pq_equals_the_official_command_on_the_written_files(tmp_path):
    """The official evaluatePanoptic itself (its JSON loading, image matching and worker pool) on the files the
    writers wrote. Fails for: a predictions JSON or PNG the evaluator refuses or reads otherwise (a segment
    listed without pixels, ids not matching the PNG, image ids of another type)."""
    images = dataset(4)
    state, summary = ours(images)
    gt_json, gt_folder = write_reference_gt(tmp_path, images)
    pred_json, pred_folder = write_predictions(tmp_path, images)
    with contextlib.redirect_stdout(io.StringIO()):
        results = official.evaluatePanoptic(str(gt_json), str(gt_folder), str(pred_json), str(pred_folder),
                                            str(tmp_path / "results.json"))
    for group, suffix in (("All", ""), ("Things", "_things"), ("Stuff", "_stuff")):
        assert summary["n" + suffix] == results[group]["n"]
        for key in ("pq", "sq", "rq"):
            assert summary[key + suffix] == pytest.approx(results[group][key], rel=1e-12), (group, key)
