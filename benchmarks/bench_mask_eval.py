#!/usr/bin/env python
"""Panoptic and instance evaluation per image at COCO's shapes: EoMT's post-processing, PQ, mask AP and the COCO
writers (seg_train/infer/mask_postprocess.py, panoptic_metrics.py, instance_metrics.py, coco_format.py).

    python benchmarks/bench_mask_eval.py [--height 480] [--width 640] [--crop 640] [--queries 200]
                                         [--classes 133] [--segments 100] [--gt 20] [--repeats 5]

Random inputs of the shapes: class logits [Q, K + 1] with one confident class per query, mask logits at the
crop / 4 (the model's output) of smooth blobs; --segments predicted segments (a panoptic map of that many
segments; that many instance masks) against --gt ground truth segments (stuff cells under thing rectangles, some
crowd, a VOID band). Each part runs --repeats times on one thread of numpy (as seg-eval's host side); the median
wall ms is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seg_train.infer import coco_format, instance_metrics, mask_postprocess, panoptic_metrics  # noqa: E402


def median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def blobs(rng, n, h, w):
    yy, xx = np.mgrid[0:h, 0:w]
    cy, cx = rng.uniform(0, h, n), rng.uniform(0, w, n)
    s = rng.uniform(2, min(h, w) / 6, n)
    d = (yy[None] - cy[:, None, None]) ** 2 + (xx[None] - cx[:, None, None]) ** 2
    return (8 * np.exp(-d / (2 * s[:, None, None] ** 2)) - 3 + rng.normal(0, .3, (n, h, w))).astype(np.float32)


def ground_truth(rng, h, w, n_gt, num_classes, is_thing):
    ids = np.zeros((h, w), np.int64)
    yy, xx = np.mgrid[0:h, 0:w]
    centres = rng.uniform(0, [h, w], (6, 2))
    cell = np.argmin((yy[..., None] - centres[:, 0]) ** 2 + (xx[..., None] - centres[:, 1]) ** 2, -1)
    stuff = np.flatnonzero(~is_thing)
    things = np.flatnonzero(is_thing)
    segs = []
    for i in range(6):
        ids[cell == i] = i + 1
        segs.append({"id": i + 1, "category_id": int(rng.choice(stuff)), "iscrowd": 0})
    for i in range(n_gt - 6):
        y, x = rng.integers(0, h - 20), rng.integers(0, w - 20)
        ids[y:y + rng.integers(8, 150), x:x + rng.integers(8, 150)] = 100 + i
        segs.append({"id": 100 + i, "category_id": int(rng.choice(things)), "iscrowd": int(rng.random() < 0.1)})
    ids[:, :4] = 0
    present = set(np.unique(ids).tolist())
    return ids, [s for s in segs if s["id"] in present]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--crop", type=int, default=640)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--classes", type=int, default=133)
    p.add_argument("--segments", type=int, default=100)
    p.add_argument("--gt", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    h, w, k, q = args.height, args.width, args.classes, args.queries
    is_thing = np.arange(k) < 80  # COCO panoptic: 80 thing and 53 stuff classes
    low = args.crop // 4

    class_logits = rng.normal(0, 1, (q, k + 1)).astype(np.float32)
    class_logits[np.arange(q), rng.integers(0, k, q)] += 6
    mask_logits = blobs(rng, q, low, low)
    image, crop = (h, w), (args.crop, args.crop)

    # Predictions of exactly --segments segments / masks for the metrics.
    gt_ids, gt_segs = ground_truth(rng, h, w, args.gt, k, is_thing)
    pred_ids = np.zeros((h, w), np.int64)
    pred_segs = []
    for i in range(args.segments):
        y, x = rng.integers(0, h - 10), rng.integers(0, w - 10)
        pred_ids[y:y + rng.integers(5, 120), x:x + rng.integers(5, 120)] = i + 1
    for i in np.unique(pred_ids)[1:]:
        pred_segs.append({"id": int(i), "category_id": int(rng.integers(0, k))})
    pred_masks = np.zeros((args.segments, h, w), bool)
    for i in range(args.segments):
        y, x = rng.integers(0, h - 10), rng.integers(0, w - 10)
        pred_masks[i, y:y + rng.integers(5, 200), x:x + rng.integers(5, 200)] = True
    pred_scores = rng.random(args.segments).astype(np.float32)
    pred_labels = rng.integers(0, k, args.segments)
    gt_masks = np.stack([gt_ids == s["id"] for s in gt_segs])
    gt_labels = np.asarray([s["category_id"] for s in gt_segs])
    gt_crowd = np.asarray([s["iscrowd"] for s in gt_segs], bool)

    rows = []
    pan = mask_postprocess.panoptic_prediction(class_logits, mask_logits, is_thing, image_size=image, crop_size=crop)
    rows.append((f"panoptic post-processing (Q {q}, K {k}, masks {low}x{low} -> {h}x{w}; "
                 f"{len(pan.segments)} segments kept)",
                 median_ms(lambda: mask_postprocess.panoptic_prediction(
                     class_logits, mask_logits, is_thing, image_size=image, crop_size=crop), args.repeats)))
    rows.append(("instance post-processing (top 100 pairs)", median_ms(lambda: mask_postprocess.instance_prediction(
        class_logits, mask_logits, image_size=image, crop_size=crop), args.repeats)))
    rows.append((f"PQ state, one image ({len(gt_segs)} GT, {len(pred_segs)} predicted segments)",
                 median_ms(lambda: panoptic_metrics.panoptic_image_state(gt_ids, gt_segs, pred_ids, pred_segs, k),
                           args.repeats)))
    rows.append((f"AP state, one image ({len(gt_segs)} GT, {args.segments} predicted masks)",
                 median_ms(lambda: instance_metrics.instance_image_state(
                     0, pred_masks, pred_scores, pred_labels, gt_masks, gt_labels, k, gt_crowd=gt_crowd),
                     args.repeats)))
    rows.append((f"RLE of {args.segments} masks (results JSON entries)", median_ms(
        lambda: coco_format.instance_results(0, pred_masks, pred_scores, pred_labels, list(range(k))),
        args.repeats)))
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(("panoptic PNG + annotation entry", median_ms(lambda: (
            coco_format.write_panoptic_png(Path(tmp) / "p.png", pred_ids),
            coco_format.panoptic_annotation(0, "p.png", pred_ids, pred_segs, list(range(k)))), args.repeats)))

    # The summaries once per evaluation, at a val split's size: 5000 images' states (the AP state repeated).
    one = instance_metrics.instance_image_state(0, pred_masks, pred_scores, pred_labels, gt_masks, gt_labels, k,
                                                gt_crowd=gt_crowd)
    n_img = 5000
    big = instance_metrics.InstanceState(
        one.npig * n_img, np.repeat(np.arange(n_img), one.score.size), np.tile(one.category, n_img),
        np.tile(one.rank, n_img), np.tile(one.score, n_img), np.tile(one.matched, (n_img, 1, 1)),
        np.tile(one.ignored, (n_img, 1, 1)))
    rows.append((f"AP summary over {n_img} such images (once per evaluation)",
                 median_ms(lambda: instance_metrics.instance_summary(big), 1)))

    print("| part | median ms |\n| --- | --- |")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
