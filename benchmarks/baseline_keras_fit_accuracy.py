#!/usr/bin/env python3
"""Reference baseline for `make bench-accuracy`: a plain Keras `model.fit` DeepLabV3+-lite.

This is "what a user would write" to train semantic segmentation with Keras on a VOC-layout data
set, written independently of seg_train (it imports nothing from it):

- keras.applications.MobileNetV2(weights=None): from scratch, with the BatchNormalization layers as
  keras.applications builds them (momentum 0.999); the head's BN layers are Keras' default (0.99).
- DeepLabV3+-lite head: ASPP (1x1, three 3x3 atrous at rates 6/12/18, image pooling; 128 channels)
  on block_13_expand_relu (stride 16), decoder with block_3_expand_relu (stride 4, projected to 48
  channels), two 3x3 convs (128), bilinear upsampling back to the input size.
- Adam(1e-3), constant learning rate; SparseCategoricalCrossentropy(from_logits=True,
  ignore_class=IGNORE); batch 8; augmentation: random left-right flip.
- Full resolution: every image is padded (bottom/right) to the smallest multiple of 32 that holds
  the data set's largest image (CamVid 240x180 -> 256x192); padded label pixels are IGNORE.
- A wall-clock budget: a callback stops `fit` at the first batch end after --minutes, counted from
  the start of this process (imports, data loading, model building and tracing included).

Evaluation: the val split at full resolution, with the model's moving BN statistics (what
`model.predict` gives a user): one confusion matrix over every pixel whose label is not IGNORE
(padding cropped away), computed with numpy; mIoU = mean IoU over the classes with a non-empty
union. With --bn-reestimate K (the default for the benchmark is set by bench_accuracy.py) it also
reports a second, clearly separate figure: the same weights after re-estimating the BN statistics
from K training batches (population statistics of each BN input over those batches, weights untouched), which
separates "bad weights" from "stale BN statistics".

Usage:
    python benchmarks/baseline_keras_fit_accuracy.py --data data/camvid --minutes 30 \
        --out runs/bench-accuracy/baseline

Writes OUT/result.json (figures, per-class IoU, confusion matrices, steps, timings), OUT/log.csv
(per-epoch loss) and OUT/model.weights.h5. Exit codes: 0 done, 2 bad arguments or data.
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # the budget counts from here: imports and data loading are part of it

# The imports below come after T_START on purpose, so that their time counts against the budget.
import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True,
                   help="VOC-layout root (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/)")
    p.add_argument("--num-classes", type=int, default=None, help="default: the number of lines of classes.txt")
    p.add_argument("--ignore-label", type=int, default=255)
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="val")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock training budget from process start")
    p.add_argument("--max-steps", type=int, default=0, help="also stop after this many steps (0: budget only)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--bn-reestimate", type=int, default=0, metavar="K",
                   help="also report mIoU after re-estimating BN statistics from K training batches (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output folder (result.json, log.csv, model.weights.h5)")
    return p.parse_args(argv)


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


# ---- data ------------------------------------------------------------------------------------------
def read_split(root: Path, split: str) -> list[str]:
    path = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not path.is_file():
        fail(f"split file not found: {path}")
    ids = [line.split()[0] for line in path.read_text().splitlines() if line.strip()]
    if not ids:
        fail(f"empty split: {path}")
    return ids


def load_split(root: Path, ids: list[str]):
    """Lists of uint8 RGB images [h, w, 3] and uint8 label maps [h, w] (class indices, read with Pillow)."""
    images, labels = [], []
    for i in ids:
        img_path, lbl_path = root / "JPEGImages" / f"{i}.jpg", root / "SegmentationClass" / f"{i}.png"
        try:
            with Image.open(img_path) as im:
                image = np.asarray(im.convert("RGB"))
            with Image.open(lbl_path) as lb:
                if lb.mode not in ("P", "L"):  # palette or greyscale PNGs hold indices; colour PNGs don't
                    fail(f"label is not an index PNG (mode {lb.mode}): {lbl_path}")
                label = np.asarray(lb)
        except OSError as e:
            fail(f"cannot read sample {i}: {e}")
        if image.shape[:2] != label.shape:
            fail(f"image and label sizes differ for {i}: {image.shape[:2]} vs {label.shape}")
        images.append(image)
        labels.append(label)
    return images, labels


def pad_all(images, labels, height: int, width: int, ignore: int):
    """Pads every sample at the bottom/right to [height, width]: image with mid-grey, label with ignore."""
    n = len(images)
    x = np.full((n, height, width, 3), 127.5, np.float32)  # 127.5 -> 0 after MobileNetV2 preprocessing
    y = np.full((n, height, width), ignore, np.uint8)
    for k, (im, lb) in enumerate(zip(images, labels)):
        h, w = lb.shape
        x[k, :h, :w] = im
        y[k, :h, :w] = lb
    return x / 127.5 - 1.0, y  # keras.applications.mobilenet_v2.preprocess_input


# ---- model -----------------------------------------------------------------------------------------
def build_model(height: int, width: int, num_classes: int):
    import keras
    from keras import layers

    def conv_bn_relu(x, filters, kernel, dilation=1):
        x = layers.Conv2D(filters, kernel, padding="same", dilation_rate=dilation, use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x)

    base = keras.applications.MobileNetV2(input_shape=(height, width, 3), include_top=False, weights=None)
    high = base.get_layer("block_13_expand_relu").output  # stride 16, 576 channels
    low = base.get_layer("block_3_expand_relu").output  # stride 4, 144 channels
    hh, hw = high.shape[1], high.shape[2]

    pool = layers.GlobalAveragePooling2D(keepdims=True)(high)
    pool = conv_bn_relu(pool, 128, 1)
    pool = layers.UpSampling2D(size=(hh, hw), interpolation="bilinear")(pool)
    branches = [conv_bn_relu(high, 128, 1)] + [conv_bn_relu(high, 128, 3, r) for r in (6, 12, 18)] + [pool]
    x = conv_bn_relu(layers.Concatenate()(branches), 128, 1)

    x = layers.UpSampling2D(size=(low.shape[1] // hh, low.shape[2] // hw), interpolation="bilinear")(x)
    x = layers.Concatenate()([x, conv_bn_relu(low, 48, 1)])
    x = conv_bn_relu(x, 128, 3)
    x = conv_bn_relu(x, 128, 3)
    x = layers.Conv2D(num_classes, 1)(x)
    x = layers.UpSampling2D(size=(height // low.shape[1], width // low.shape[2]), interpolation="bilinear")(x)
    return keras.Model(base.input, x, name="deeplabv3plus_lite_mobilenetv2")


# ---- metric (numpy) --------------------------------------------------------------------------------
def confusion(model, x, y, sizes, num_classes: int, ignore: int, batch: int = 8) -> np.ndarray:
    """[C, C] counts (rows: label, cols: prediction) over every non-ignored pixel at full resolution."""
    cm = np.zeros((num_classes, num_classes), np.int64)
    for s in range(0, len(x), batch):
        logits = np.asarray(model.predict_on_batch(x[s:s + batch]))
        pred = logits.argmax(-1)
        for k in range(pred.shape[0]):
            h, w = sizes[s + k]
            lab = y[s + k, :h, :w].astype(np.int64).ravel()
            prd = pred[k, :h, :w].astype(np.int64).ravel()
            keep = lab != ignore
            cm += np.bincount(lab[keep] * num_classes + prd[keep],
                              minlength=num_classes * num_classes).reshape(num_classes, num_classes)
    return cm


def metrics(cm: np.ndarray, names: list[str]) -> dict:
    tp = np.diag(cm).astype(np.float64)
    gt, pred = cm.sum(1).astype(np.float64), cm.sum(0).astype(np.float64)
    union = gt + pred - tp
    iou = [float(t / u) if u > 0 else None for t, u in zip(tp, union)]
    acc = [float(t / g) if g > 0 else None for t, g in zip(tp, gt)]
    return {
        "miou": float(np.mean([v for v in iou if v is not None])),
        "pixel_accuracy": float(tp.sum() / cm.sum()),
        "mean_class_accuracy": float(np.mean([v for v in acc if v is not None])),
        "per_class_iou": dict(zip(names, iou)),
        "per_class_accuracy": dict(zip(names, acc)),
        "confusion_matrix": cm.tolist(),
    }


def table(m: dict) -> str:
    rows = [f"{'class':<14} {'IoU %':>7} {'Acc %':>7}"]
    for name, iou in m["per_class_iou"].items():
        acc = m["per_class_accuracy"][name]
        rows.append(f"{name:<14} {'-' if iou is None else f'{100 * iou:.2f}':>7} "
                    f"{'-' if acc is None else f'{100 * acc:.2f}':>7}")
    rows.append(f"mIoU {100 * m['miou']:.2f}%  pixel accuracy {100 * m['pixel_accuracy']:.2f}%  "
                f"mean class accuracy {100 * m['mean_class_accuracy']:.2f}%")
    return "\n".join(rows)


def reestimate_bn(model, batches, num_batches: int) -> None:
    """Sets every BN layer's moving statistics to the population mean and variance of its input over
    `num_batches` training batches, from forward passes in training mode (no gradients, weights unchanged).

    With momentum 0 a training-mode call leaves each layer's batch mean and variance in its moving
    statistics; they are collected after every batch and combined exactly (equal-sized batches):
    mean = avg(mean_i), var = avg(var_i + mean_i**2) - mean**2. Momenta are restored afterwards.
    """
    import keras
    import tensorflow as tf

    bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    saved = [b.momentum for b in bns]
    s1 = [np.zeros(b.moving_mean.shape, np.float64) for b in bns]
    s2 = [np.zeros(b.moving_mean.shape, np.float64) for b in bns]
    try:
        for b in bns:
            b.momentum = 0.0  # read when the function below is traced
        forward = tf.function(lambda x: model(x, training=True))
        for _ in range(num_batches):
            xb, _ = next(batches)
            forward(xb)
            for k, b in enumerate(bns):
                m = np.asarray(b.moving_mean.numpy(), np.float64)
                s1[k] += m
                s2[k] += np.asarray(b.moving_variance.numpy(), np.float64) + m * m
        for k, b in enumerate(bns):
            mean = s1[k] / num_batches
            b.moving_mean.assign(mean.astype(np.float32))
            b.moving_variance.assign(np.maximum(s2[k] / num_batches - mean * mean, 0.0).astype(np.float32))
    finally:
        for b, m in zip(bns, saved):
            b.momentum = m


# ---- main ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    budget = args.minutes * 60.0
    root = Path(args.data)
    if not root.is_dir():
        fail(f"data root not found: {root}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    names_file = root / "classes.txt"
    names = [n.strip() for n in names_file.read_text().splitlines() if n.strip()] if names_file.is_file() else []
    num_classes = args.num_classes or len(names)
    if not num_classes:
        fail("no classes.txt in the data root: pass --num-classes")
    if len(names) != num_classes:
        names = [f"class_{i}" for i in range(num_classes)]

    train_x, train_y = load_split(root, read_split(root, args.train_split))
    val_x, val_y = load_split(root, read_split(root, args.val_split))
    sizes = [lb.shape for lb in val_y]
    height = 32 * math.ceil(max(lb.shape[0] for lb in train_y + val_y) / 32)
    width = 32 * math.ceil(max(lb.shape[1] for lb in train_y + val_y) / 32)
    for lb in train_y + val_y:
        bad = np.setdiff1d(np.unique(lb), np.r_[np.arange(num_classes), args.ignore_label])
        if bad.size:
            fail(f"label values outside 0..{num_classes - 1} and {args.ignore_label}: {bad[:10].tolist()}")
    train_x, train_y = pad_all(train_x, train_y, height, width, args.ignore_label)
    val_x, val_y = pad_all(val_x, val_y, height, width, args.ignore_label)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(args.seed)

    def flip(x, y):
        y = tf.cast(y, tf.int32)[..., None]
        do = tf.random.uniform([]) < 0.5
        x = tf.cond(do, lambda: tf.reverse(x, [1]), lambda: x)
        y = tf.cond(do, lambda: tf.reverse(y, [1]), lambda: y)
        return x, y[..., 0]

    train_ds = (tf.data.Dataset.from_tensor_slices((train_x, train_y))
                .shuffle(len(train_x), seed=args.seed, reshuffle_each_iteration=True)
                .repeat()
                .map(flip, num_parallel_calls=tf.data.AUTOTUNE)
                .batch(args.batch_size, drop_remainder=True)
                .prefetch(tf.data.AUTOTUNE))

    model = build_model(height, width, num_classes)
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=args.ignore_label))

    class Deadline(keras.callbacks.Callback):
        """Stops fit at the first batch end after the wall-clock budget (or --max-steps)."""

        def __init__(self):
            super().__init__()
            self.steps, self.first_step_end, self.end = 0, None, None

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            now = time.monotonic()
            if self.first_step_end is None:
                self.first_step_end = now
            self.end = now
            if now - T_START >= budget or (args.max_steps and self.steps >= args.max_steps):
                self.model.stop_training = True

    deadline = Deadline()
    steps_per_epoch = max(len(train_x) // args.batch_size, 1)
    print(f"baseline: {len(train_x)} train / {len(val_x)} val images padded to {width}x{height}, "
          f"{num_classes} classes, batch {args.batch_size}, budget {args.minutes:g} min "
          f"({time.monotonic() - T_START:.1f}s spent before training)", flush=True)
    model.fit(train_ds, epochs=10**6, steps_per_epoch=steps_per_epoch, verbose=2,
              callbacks=[deadline, keras.callbacks.CSVLogger(str(out / "log.csv"))])
    train_seconds = (deadline.end or time.monotonic()) - T_START
    steps = deadline.steps
    steady = ((deadline.end - deadline.first_step_end) / max(steps - 1, 1)) if steps > 1 else float("nan")
    print(f"baseline: stopped after {steps} steps, {train_seconds:.0f}s from process start "
          f"({steady:.3f} s/step after the first)", flush=True)
    model.save_weights(str(out / "model.weights.h5"))

    t = time.monotonic()
    result = {
        "what": "plain Keras model.fit DeepLabV3+-lite on keras.applications.MobileNetV2 (from scratch)",
        "command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]),
        "steps": steps, "batch_size": args.batch_size, "images_seen": steps * args.batch_size,
        "train_seconds": train_seconds, "budget_seconds": budget, "seconds_per_step": steady,
        "input_size": [height, width], "learning_rate": args.learning_rate,
        "bn_momentum": "keras.applications backbone 0.999, head 0.99 (Keras default)",
        "num_val_images": len(val_x),
    }
    m = metrics(confusion(model, val_x, val_y, sizes, num_classes, args.ignore_label), names)
    result["eval_seconds"] = time.monotonic() - t
    result.update(m)
    print("baseline, val, BN moving statistics as trained:\n" + table(m), flush=True)
    if args.bn_reestimate > 0:
        t = time.monotonic()
        reestimate_bn(model, iter(train_ds), args.bn_reestimate)
        m2 = metrics(confusion(model, val_x, val_y, sizes, num_classes, args.ignore_label), names)
        m2["batches"] = args.bn_reestimate
        m2["seconds"] = time.monotonic() - t
        result["bn_reestimated"] = m2
        print(f"baseline, val, BN statistics re-estimated from {args.bn_reestimate} training batches "
              f"(diagnostic, not what model.fit gives):\n" + table(m2), flush=True)
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out / "result.json")
    print(f"baseline: val mIoU {100 * result['miou']:.2f}% after {steps} steps in {train_seconds:.0f}s; "
          f"wrote {out / 'result.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
