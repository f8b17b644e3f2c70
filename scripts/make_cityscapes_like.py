#!/usr/bin/env python3
"""A Cityscapes-scale synthetic data set for timing input pipelines: 2048x1024 JPEG frames, 19-class 'L' labels.

    python scripts/make_cityscapes_like.py OUT [--num 48] [--quality 90] [--size 1024 2048] [--seed 0]
        [--tfrecords]

Writes, in PASCAL VOC's layout, OUT/JPEGImages/<id>.jpg (textured procedural scenes with sensor noise,
seg_train.data.synthetic's renderer, saved by Pillow as baseline JPEGs, 4:2:0, quality 90, about 0.5 MB
each), OUT/SegmentationClass/<id>.png (8-bit single-channel 'L' PNGs of the class indices 0..18, 255 on
object outlines: Cityscapes' labelTrainIds kind, decoded by TensorFlow's PNG decoder),
OUT/ImageSets/Segmentation/train.txt (all of them) and OUT/bench.yaml, a seg-train config with the
Cityscapes recipe's augmentation (769x769 crops, random scale 0.5-2.0, mirror, global batch 8):

    seg-bench --config OUT/bench.yaml --input-only --steps 3 --windows 4 --warmup 2

With --tfrecords also OUT/tfrecords/train-*.tfrecord (seg-prepare tfrecords: image/encoded,
image/segmentation/class/encoded, image/height, image/width), the records TF Model Garden's
segmentation parser reads (scripts/bench_model_garden_input.py). The same arguments give the same
files (seeded); nothing of seg-train's training reads this set.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_CLASSES = 19

CONFIG = """\
# Written by scripts/make_cityscapes_like.py: the Cityscapes recipe's input pipeline on this set.
seed: 0
data:
  root: {root}
  num_classes: {num_classes}
  batch_size: 8
  crop_size: [769, 769]
  random_scale: [0.5, 2.0]
  random_mirror: true
model:
  backbone: mobilenetv2
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder (created; files in it are overwritten)")
    p.add_argument("--num", type=int, default=48, help="frames (default 48)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    p.add_argument("--size", type=int, nargs=2, default=(1024, 2048), metavar=("HEIGHT", "WIDTH"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tfrecords", action="store_true", help="also write OUT/tfrecords (seg-prepare tfrecords)")
    args = p.parse_args(argv)
    from seg_train.data.synthetic import render_scene

    out = Path(args.out).resolve()
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (out / d).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    ids = [f"frame_{i:05d}" for i in range(args.num)]
    for i, sid in enumerate(ids):
        image, label = render_scene(rng, tuple(args.size), NUM_CLASSES)
        Image.fromarray(image).save(out / "JPEGImages" / f"{sid}.jpg", quality=args.quality)
        Image.fromarray(label, mode="L").save(out / "SegmentationClass" / f"{sid}.png")
        print(f"\r{i + 1}/{args.num}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    (out / "ImageSets" / "Segmentation" / "train.txt").write_text("".join(f"{s}\n" for s in ids))
    (out / "bench.yaml").write_text(CONFIG.format(root=out, num_classes=NUM_CLASSES))
    if args.tfrecords:
        seg_prepare = "import sys; from seg_train.cli import prepare_main; sys.exit(prepare_main())"
        subprocess.run([sys.executable, "-c", seg_prepare, "tfrecords", "--config", str(out / "bench.yaml"),
                        "--split", "train", "--output", str(out / "tfrecords")], check=True)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
