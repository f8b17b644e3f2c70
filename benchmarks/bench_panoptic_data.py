"""The panoptic data path timed at COCO's shapes: the pre-training scan (Pillow) and the reader (TensorFlow's
decode, the crop, the stream) on COCO-like images (640 x 480 JPEGs, panoptic PNGs of about 50 segments), against
the same images with class labels (the semantic path) as the baseline.

    python benchmarks/bench_panoptic_data.py [--images 48] [--segments 50] [--crop 640]

Prints per image: the scan's CPU time, the evaluation decode's, the training stream's; on this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


def make_data(root: Path, n: int, num_segments: int, rng) -> None:
    """A coco_panoptic split `val` and the same scenes as a VOC split of class PNGs."""
    (root / "annotations" / "panoptic_val").mkdir(parents=True)
    (root / "val").mkdir()
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True, exist_ok=True)
    cats = [{"id": 1 + i, "name": f"c{i}", "isthing": int(i < 80)} for i in range(133)]
    h, w = 480, 640
    yy, xx = np.mgrid[0:h, 0:w]
    images, anns = [], []
    for k in range(n):
        # Segments: the cells of num_segments random centres (nearest centre), ids over 24 bits.
        centres = rng.uniform([0, 0], [h, w], (num_segments, 2))
        cell = np.argmin((yy[..., None] - centres[:, 0]) ** 2 + (xx[..., None] - centres[:, 1]) ** 2, -1)
        ids = rng.choice(np.arange(1, 2 ** 24), num_segments, replace=False)
        seg = ids[cell]
        seg[rng.uniform(size=(h, w)) < 0.02] = 0
        classes = rng.integers(0, 133, num_segments)
        photo = (rng.uniform(0, 255, (h // 8, w // 8, 3))).astype(np.uint8)
        photo = np.asarray(Image.fromarray(photo).resize((w, h), Image.BILINEAR))
        stem = f"{k:012d}"
        Image.fromarray(photo).save(root / "val" / f"{stem}.jpg", quality=90)
        Image.fromarray(photo).save(root / "JPEGImages" / f"{stem}.jpg", quality=90)
        rgb = np.stack([seg & 255, (seg >> 8) & 255, seg >> 16], -1).astype(np.uint8)
        Image.fromarray(rgb).save(root / "annotations" / "panoptic_val" / f"{stem}.png")
        semantic = np.where(seg == 0, 255, classes[cell]).astype(np.uint8)
        Image.fromarray(semantic).save(root / "SegmentationClass" / f"{stem}.png")
        images.append({"id": k, "file_name": f"{stem}.jpg", "height": h, "width": w})
        anns.append({"image_id": k, "file_name": f"{stem}.png", "segments_info": [
            {"id": int(i), "category_id": int(c) + 1, "iscrowd": int(c % 17 == 0)} for i, c in zip(ids, classes)]})
    (root / "annotations" / "panoptic_val.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": cats}))
    (root / "ImageSets/Segmentation/val.txt").write_text("".join(f"{k:012d}\n" for k in range(n)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--segments", type=int, default=50)
    ap.add_argument("--crop", type=int, default=640)
    args = ap.parse_args()

    import tensorflow as tf

    from seg_train import config as config_lib
    from seg_train.data import scan
    from seg_train.data.split import open_split

    tmp = Path(tempfile.mkdtemp(prefix="bench-panoptic-"))
    make_data(tmp, args.images, args.segments, np.random.default_rng(0))
    data = {"root": str(tmp), "train_split": "val", "val_split": "val", "num_classes": 133, "batch_size": 8,
            "crop_size": [args.crop, args.crop], "scan_cache": False}
    configs = {
        "semantic": config_lib.from_dict({"data": data, "model": {"backbone": "dinov3_vits16", "head": "eomt",
                                                                  "num_queries": 200}}),
        "panoptic": config_lib.from_dict({"data": {**data, "layout": "coco_panoptic", "task": "panoptic"},
                                          "model": {"backbone": "dinov3_vits16", "head": "eomt",
                                                    "num_queries": 200}}),
    }
    n = args.images
    import os

    print(f"{n} images 640x480, {args.segments} segments each, crop {args.crop}; {os.cpu_count()} cores, "
          f"TensorFlow {tf.__version__}")
    for name, cfg in configs.items():
        reader = open_split(cfg, "val").reader
        t0 = time.process_time()
        report = scan.scan(reader.samples, 133, 255, label_table=reader.label_table)
        scan_cpu = time.process_time() - t0
        assert not report.bad, report.bad[:1]
        ds = reader.eval_dataset()
        for _ in ds.take(2):
            pass
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in ds:
            pass
        eval_s, eval_cpu = time.perf_counter() - t0, time.process_time() - c0
        stream = reader.train_dataset(8, 0, 1)
        it = iter(stream)
        next(it)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n // 8):
            next(it)
        train_s, train_cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"{name:9s} scan {1000 * scan_cpu / n:6.1f} ms CPU/image ({report.seconds:.2f} s wall) | "
              f"eval decode {1000 * eval_s / n:6.1f} ms/image ({1000 * eval_cpu / n:6.1f} CPU) | "
              f"train stream {1000 * train_s / n:6.1f} ms/image ({1000 * train_cpu / n:6.1f} CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
