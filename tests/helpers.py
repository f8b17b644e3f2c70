"""Small shared builders for tests: tiny configs and synthetic batches."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import tensorflow as tf
import yaml
from PIL import Image

from seg_train import config as config_lib
from seg_train.config.variants import MiTVariant, ViTVariant
from seg_train.data.label_images import save_index_png, voc_colormap
from seg_train.infer import precise_bn
from seg_train.parallel import replicas


def tiny_config(tmp_path: Path, data_root: Path | str = "data", **sections) -> config_lib.Config:
    """A tiny-model config written to tmp_path/config.yaml and loaded through the real loader."""
    raw = {
        "seed": 0,
        "run_dir": "run",
        "data": {"root": str(data_root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                 "random_scale": [0.75, 1.25], "num_parallel_calls": 2},
        "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4,
                  "weight_decay": 1e-3},
        "train": {"num_steps": 4, "learning_rate": 0.01, "summary_every": 1, "checkpoint_every": 2,
                  "image_summary_every": 2},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    path = Path(tmp_path) / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return config_lib.load(path)


def bilinear_resize(x, size):
    """numpy [b, h, w, c] -> [b, size[0], size[1], c]: bilinear, half-pixel centres, edge-clamped (TensorFlow
    2's resize and torch's align_corners=False), written from the definition as a reference."""
    def axis(n_in, n_out):
        src = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        lo = np.floor(src).astype(int)
        return lo, np.minimum(lo + 1, n_in - 1), src - lo

    (y0, y1, wy), (x0, x1, wx) = axis(x.shape[1], size[0]), axis(x.shape[2], size[1])
    rows = x[:, y0] * (1 - wy)[None, :, None, None] + x[:, y1] * wy[None, :, None, None]
    return rows[:, :, x0] * (1 - wx)[None, None, :, None] + rows[:, :, x1] * wx[None, None, :, None]


def random_batch(batch=4, size=32, num_classes=3, seed=0, ignore_rows=None):
    """Normalised-looking images and labels; ignore_rows[i] rows of sample i are set to 255."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch, size, size, 3)).astype(np.float32)
    labels = rng.integers(0, num_classes, size=(batch, size, size)).astype(np.uint8)
    for i, rows in enumerate(ignore_rows or []):
        labels[i, :rows] = 255
    return images, labels



def open_reader(cfg: config_lib.Config, split: str, seed: int | None = None):
    """`split`'s ImageReader through the front door (seg_train/data/split.py's open_split); `seed` in place of
    cfg.seed where a test reads the stream of another seed."""
    from seg_train.data.split import open_split

    return open_split(cfg if seed is None else config_lib.replace(cfg, "seed", seed), split).reader


def train_batches(state, reader):
    """The real reader's training stream from step 0 for a TrainState, distributed as train.py distributes it
    (data.batch_size global images per micro-batch, train.accumulate_steps micro-batches), endless."""
    from seg_train.data.split import train_dataset_fn

    cfg = state.cfg
    return iter(state.distribute(train_dataset_fn(reader, cfg.data.batch_size, start_step=0, end_step=None,
                                                  micro_batches=cfg.train.accumulate_steps)))

# A numpy confusion matrix, the by-hand reference the evaluation's bincount path is checked against
# (the package itself counts on the device, seg_train/infer/evaluate.py).
def confusion_matrix(labels, preds, num_classes: int, ignore_label: int | None = 255) -> np.ndarray:
    """Count (ground truth, prediction) pairs over all labelled pixels.

    Args:
        labels: Integer array of ground-truth class ids, any shape.
        preds: Integer array of predicted class ids, same shape as `labels`.
        num_classes: Number of classes C.
        ignore_label: Label value whose pixels are skipped (None: skip nothing).

    Returns:
        int64 array [C, C]; rows are ground truth, columns are predictions.

    Raises:
        ValueError: on shape mismatch, or on a label (other than `ignore_label`)
            or any prediction outside [0, C).
        TypeError: if labels or preds are not integer arrays.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    labels = np.asarray(labels)
    preds = np.asarray(preds)
    if labels.shape != preds.shape:
        raise ValueError(f"labels shape {labels.shape} != preds shape {preds.shape}")
    # Refuse floats: silently truncating e.g. probabilities would give garbage counts.
    for name, arr in (("labels", labels), ("preds", preds)):
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")

    # Widen before arithmetic: uint8 labels would overflow in label * C + pred.
    labels = labels.reshape(-1).astype(np.int64, copy=False)
    preds = preds.reshape(-1).astype(np.int64, copy=False)

    # Predictions are checked everywhere, ignored pixels included: a model can
    # never legitimately emit an out-of-range id, so one anywhere is a bug.
    if preds.size and (preds.min() < 0 or preds.max() >= num_classes):
        bad = preds[(preds < 0) | (preds >= num_classes)]
        raise ValueError(f"prediction values out of range [0, {num_classes}): {np.unique(bad)[:10].tolist()}")

    if ignore_label is not None:
        keep = labels != ignore_label
        labels, preds = labels[keep], preds[keep]
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        bad = labels[(labels < 0) | (labels >= num_classes)]
        raise ValueError(f"label values out of range [0, {num_classes}): {np.unique(bad)[:10].tolist()}")

    # Encode each (gt, pred) pair as one flat index so a single bincount counts them all.
    counts = np.bincount(labels * num_classes + preds, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).astype(np.int64, copy=False)


def seg_prepare() -> list[str]:
    """The installed seg-prepare console script next to this Python, else its entry point through -c."""
    import sys

    script = Path(sys.executable).with_name("seg-prepare")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from seg_train.cli import prepare_main as m; sys.exit(m())"]


# ---- Lovasz-softmax and Dice by hand (numpy, float64), the references of the loss terms
# (tests/test_loss_terms.py)
LOSS_NUM_CLASSES = 4


def softmax64(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward(p, dp):
    """dL/dz from dL/dp through the softmax, per pixel: p * (dp - sum(p * dp))."""
    return p * (dp - (p * dp).sum(axis=-1, keepdims=True))


def lovasz_numpy(logits, labels):
    """Per image: (loss, dL/dlogits), from Berman et al. 2018, over the valid pixels only."""
    out, grads = [], np.zeros(logits.shape, np.float64)
    for i in range(logits.shape[0]):
        valid = labels[i].reshape(-1) != 255
        p = softmax64(logits[i].reshape(-1, LOSS_NUM_CLASSES))[valid]
        y = labels[i].reshape(-1)[valid]
        dp = np.zeros_like(p)
        total, present = 0.0, 0
        for c in range(LOSS_NUM_CLASSES):
            fg = (y == c).astype(np.float64)
            if fg.sum() == 0:
                continue
            present += 1
            err = np.abs(fg - p[:, c])
            order = np.argsort(-err, kind="stable")
            fgs = fg[order]
            gts = fgs.sum()
            jac = 1.0 - (gts - np.cumsum(fgs)) / (gts + np.cumsum(1.0 - fgs))
            g = np.concatenate([jac[:1], np.diff(jac)])
            total += err[order] @ g
            # d err / d p_c = -1 on the class's pixels, +1 elsewhere
            dp[order, c] += g * np.where(fgs > 0, -1.0, 1.0)
        out.append(total / present)
        dz = np.zeros((valid.size, LOSS_NUM_CLASSES))
        dz[valid] = softmax_backward(p, dp / present)
        grads[i] = dz.reshape(logits.shape[1:])
    return np.array(out), grads


def dice_numpy(logits, labels, smooth=1.0):
    """Per image: (loss, dL/dlogits): mean over the LOSS_NUM_CLASSES classes of 1 - (2|X n Y| + s) / (|X| + |Y| + s)."""
    out, grads = [], np.zeros(logits.shape, np.float64)
    for i in range(logits.shape[0]):
        valid = labels[i].reshape(-1) != 255
        p = softmax64(logits[i].reshape(-1, LOSS_NUM_CLASSES))[valid]
        y = np.eye(LOSS_NUM_CLASSES)[labels[i].reshape(-1)[valid]]
        inter, size = (p * y).sum(0), p.sum(0) + y.sum(0)
        out.append(np.mean(1.0 - (2 * inter + smooth) / (size + smooth)))
        dp = -(2 * y * (size + smooth) - (2 * inter + smooth)) / (size + smooth) ** 2 / LOSS_NUM_CLASSES
        dz = np.zeros((valid.size, LOSS_NUM_CLASSES))
        dz[valid] = softmax_backward(p, dp)
        grads[i] = dz.reshape(logits.shape[1:])
    return np.array(out), grads


# ---- Cityscapes' label map written out by hand (tests/test_label_map.py) -----------------------------------
# cityscapesScripts' labels.py, copied entry by entry: labelId -> trainId (255: ignored).
CITYSCAPES_BY_HAND = {
    0: 255, 1: 255, 2: 255, 3: 255, 4: 255, 5: 255, 6: 255,  # unlabeled .. ground
    7: 0, 8: 1,  # road, sidewalk
    9: 255, 10: 255,  # parking, rail track
    11: 2, 12: 3, 13: 4,  # building, wall, fence
    14: 255, 15: 255, 16: 255,  # guard rail, bridge, tunnel
    17: 5, 18: 255,  # pole, polegroup
    19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11, 25: 12, 26: 13, 27: 14, 28: 15,  # traffic light .. bus
    29: 255, 30: 255,  # caravan, trailer
    31: 16, 32: 17, 33: 18,  # train, motorcycle, bicycle
}


# ---- tiny Cityscapes, ADE20K and pairs trees with the real file naming (the `trees` fixture, conftest.py)
# (tests/test_layouts.py)
LAYOUT_H, LAYOUT_W = 48, 64


ADE20K_BY_HAND = {0: 255, **{k: k - 1 for k in range(1, 151)}}  # 0 "other" ignored, k -> class k - 1


PAIRS_BY_HAND = {0: 0, 3: 0, 251: 1, 255: 1}  # a 0/255 mask saved lossily: threshold 128


LAYOUT_BY_HAND = {"cityscapes": CITYSCAPES_BY_HAND, "ade20k": ADE20K_BY_HAND, "pairs": PAIRS_BY_HAND}


CITIES = {"train": {"aachen": 2, "bochum": 1}, "val": {"frankfurt": 2}, "broken": {"aachen": 1},
          "nolabel": {"ulm": 1}, "test": {"berlin": 1}}


def layout_blocks(rng, values, shape=(LAYOUT_H, LAYOUT_W), size=8):
    """8x8 layout_blocks of values drawn from `values`: spatial structure for the model and the crops."""
    b = rng.choice(np.asarray(values), (shape[0] // size + 1, shape[1] // size + 1))
    return np.repeat(np.repeat(b, size, 0), size, 1)[:shape[0], :shape[1]].astype(np.uint8)


def layout_photo(rng):
    b = rng.integers(0, 256, (LAYOUT_H // 8 + 1, LAYOUT_W // 8 + 1, 3), dtype=np.uint8)
    return np.repeat(np.repeat(b, 8, 0), 8, 1)[:LAYOUT_H, :LAYOUT_W]


def make_cityscapes_tree(root, rng):
    for split, cities in CITIES.items():
        for city, count in cities.items():
            (root / "leftImg8bit" / split / city).mkdir(parents=True)
            if split != "test":  # test: images without the gtFine folder
                (root / "gtFine" / split / city).mkdir(parents=True)
            for n in range(count):
                stem = f"{city}_{n:06d}_000019"
                Image.fromarray(layout_photo(rng)).save(root / "leftImg8bit" / split / city / f"{stem}_leftImg8bit.png")
                if split in ("test", "nolabel"):
                    continue
                raw = layout_blocks(rng, range(34))  # every labelId, the ignored ones too
                if split == "broken":
                    raw[8:16, :8] = 40  # no such labelId: 64 pixels without a mapping
                labels = root / "gtFine" / split / city
                Image.fromarray(raw).save(labels / f"{stem}_gtFine_labelIds.png")
                # What gtFine also holds next to each labelIds PNG; never to be read as labels.
                Image.fromarray(np.zeros((LAYOUT_H, LAYOUT_W, 3), np.uint8)).save(labels / f"{stem}_gtFine_color.png")
                Image.fromarray(raw.astype(np.uint16) * 1000).save(labels / f"{stem}_gtFine_instanceIds.png")


def make_ade20k_tree(root, rng):
    for split, count in (("training", 3), ("validation", 2)):
        (root / "images" / split).mkdir(parents=True)
        (root / "annotations" / split).mkdir(parents=True)
        for n in range(count):
            stem = f"ADE_{'train' if split == 'training' else 'val'}_{n + 1:08d}"
            Image.fromarray(layout_photo(rng)).save(root / "images" / split / f"{stem}.jpg", quality=95)
            Image.fromarray(layout_blocks(rng, range(151))).save(root / "annotations" / split / f"{stem}.png")


def make_pairs_tree(root, rng):
    (root / "photos" / "a").mkdir(parents=True)
    (root / "masks").mkdir()
    lines = []
    for n in range(5):
        Image.fromarray(layout_photo(rng)).save(root / "photos" / "a" / f"p{n}.png")
        Image.fromarray(layout_blocks(rng, list(PAIRS_BY_HAND))).save(root / "masks" / f"p{n}_mask.png")
        lines.append(f"photos/a/p{n}.png masks/p{n}_mask.png")
    (root / "train.txt").write_text("\n".join(lines[:3]) + "\n")
    (root / "val.txt").write_text("# comment lines and blank lines are skipped\n\n" + "\n".join(lines[3:]) + "\n")


LAYOUT_SPLITS = {"cityscapes": ("train", "val"), "ade20k": ("training", "validation"),
                 "pairs": ("train.txt", "val.txt")}


def write_layout_config(tmp_path, trees, layout, **data):
    """A tiny-model config of `layout` (no num_classes: the layouts that know theirs bring them)."""
    train, val = LAYOUT_SPLITS[layout]
    raw = {"seed": 0, "run_dir": "run",
           "data": {"layout": layout, "root": str(trees[layout]), "train_split": train, "val_split": val,
                    "batch_size": 2, "crop_size": [32, 32], "num_parallel_calls": 2,
                    **({"num_classes": 2, "binary_threshold": 128} if layout == "pairs" else {}), **data},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4},
           "train": {"num_steps": 2, "checkpoint_every": 2, "summary_every": 1, "image_summary_every": 0,
                     "learning_rate": 0.01},
           "eval": {"bn_reestimate_batches": 1}}
    path = tmp_path / f"{layout}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def load_layout(tmp_path, trees, layout, **data):
    return config_lib.load(write_layout_config(tmp_path, trees, layout, **data))


def raw_label(path):
    """The stored values, read with Pillow directly (not through the reader)."""
    return np.array(Image.open(path))


def mapped_label(layout, path):
    by_hand = LAYOUT_BY_HAND[layout]
    return np.vectorize(lambda v: by_hand[int(v)])(raw_label(path)).astype(np.uint8)


# ---- backbone weight files: perturbed weights, h5 reading (tests/test_backbone_weights.py) -----------------
def perturb(model, seed):
    """Fixed-seed values every weight can be recognised by, at scales that keep activations finite."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        values = []
        for v in layer.weights:
            name, shape = v.name.split("/")[-1].split(":")[0], tuple(v.shape)
            if name in ("kernel", "depthwise_kernel"):
                fan_in = int(np.prod(shape[:-1])) if name == "kernel" else int(np.prod(shape[:2]))
                values.append(rng.normal(0, np.sqrt(2.0 / fan_in), shape))
            elif name in ("gamma", "moving_variance"):
                values.append(rng.uniform(0.5, 1.5, shape))
            else:  # bias, beta, moving_mean
                values.append(rng.normal(0, 0.1, shape))
        if values:
            layer.set_weights([x.astype(np.float32) for x in values])


def short_weight_name(weight_name):
    short = weight_name.split("/")[-1].split(":")[0]
    return "kernel" if short == "depthwise_kernel" else short  # Keras 3 names a depthwise kernel 'kernel'


def read_h5(path):
    """layer name -> [(weight name, array)] of a Keras legacy .h5 weights file, read with h5py alone."""
    with h5py.File(path, "r") as f:
        out = {}
        for layer in f.attrs["layer_names"]:
            g = f[layer]
            names = [n.decode() if isinstance(n, bytes) else n for n in g.attrs["weight_names"]]
            if names:
                out[layer.decode() if isinstance(layer, bytes) else layer] = [(n, g[n][()]) for n in names]
    return out


def weighted_layers(model):
    found = {}

    def walk(layer):
        for child in getattr(layer, "layers", None) or []:
            if getattr(child, "layers", None):
                walk(child)
            elif child.weights:
                found[child.name] = child
    walk(model)
    return found


# ---- bad data on the VOC demo set: one copy per defect and the error line each gives; run dirs rewound
# (tests/test_robustness.py)
ROBUSTNESS_STEPS = 6


LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d [DIWEC] ")


BAD_TARGET = "demo_00003"  # the train sample the bad-data cases break


BAD_VAL_TARGET = "demo_00013"  # a val sample (num_train=12)


def write_voc_config(directory: Path, root: Path, drop=(), **train) -> Path:
    raw = {"seed": 1, "run_dir": "run",
           "data": {"root": str(root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                    "num_parallel_calls": 2},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4},
           "train": {"num_steps": ROBUSTNESS_STEPS, "checkpoint_every": 2, "summary_every": 1, "image_summary_every": 0,
                     "learning_rate": 0.01, "deterministic": True, **train},
           "eval": {"bn_reestimate_batches": 0}}
    for dotted in drop:
        section, key = dotted.split(".")
        del raw[section][key]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def error_lines(stderr: str) -> list[str]:
    """stderr without the log lines (HH:MM:SS L message) and the indented/table lines that follow them."""
    return [line for line in stderr.splitlines()
            if line.strip() and not LOG_LINE.match(line) and line[0] not in "|+ "]


def ckpt_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rewind(run_dir: Path, step: int) -> None:
    """Makes a finished run look like it was killed right after writing ckpt-`step`."""
    d = ckpt_dir(run_dir)
    for p in d.glob("ckpt-*"):
        if int(p.name.split(".")[0].split("_")[0][len("ckpt-"):]) > step:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    kept = [str(d / f"ckpt-{k}") for k in range(1, step + 1) if (d / f"ckpt-{k}.index").is_file()]
    tf.compat.v1.train.update_checkpoint_state(str(d), kept[-1], kept)


def resume_bitwise(config: Path, base: Path, towers: int = 2, step: int = 2, last: int = 4) -> list[str]:
    """seg-train `config` on `towers` towers into base/run; a copy rewound to ckpt-`step` (killed after it) and
    the same command run again into base/resumed; asserts the resumed log says so and every tensor of
    ckpt-`last` is bitwise the uninterrupted run's (the object graph and save counter aside: in one process
    Keras numbers the second run's objects on). Returns the checkpoint's keys."""
    from contextlib import redirect_stderr

    from seg_train import cli

    def train(run_dir):
        err = io.StringIO()
        with redirect_stderr(err):
            rc = cli.train_main(["--config", str(config), "--gpus", str(towers), "--run-dir", str(run_dir)])
        assert rc == 0, err.getvalue()
        return err.getvalue()

    train(base / "run")
    shutil.copytree(base / "run", base / "resumed")
    rewind(base / "resumed", step)
    log = train(base / "resumed")
    assert f"resumed from step {step} " in log, log
    a, b = (tf.train.load_checkpoint(str(base / d / "checkpoints" / f"ckpt-{last}")) for d in ("run", "resumed"))
    keys = sorted(k for k in a.get_variable_to_shape_map() if k != "_CHECKPOINTABLE_OBJECT_GRAPH")
    assert keys == sorted(k for k in b.get_variable_to_shape_map() if k != "_CHECKPOINTABLE_OBJECT_GRAPH")
    for k in keys:
        if not k.startswith("save_counter/"):
            assert np.asarray(a.get_tensor(k)).tobytes() == np.asarray(b.get_tensor(k)).tobytes(), k
    return keys


def truncate(path: Path, fraction=0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def bad_roots(base: Path, demo_root: Path) -> dict[str, Path]:
    """One copy of the demo data per defect."""
    def img(r, sid=BAD_TARGET):
        return r / "JPEGImages" / f"{sid}.jpg"

    def lbl(r, sid=BAD_TARGET):
        return r / "SegmentationClass" / f"{sid}.png"

    def split(r):
        return r / "ImageSets" / "Segmentation" / "train.txt"

    def label_resized(r):
        with Image.open(lbl(r)) as im:
            im.resize((24, 20), Image.NEAREST).save(lbl(r))

    def label_rgb(r):
        with Image.open(lbl(r)) as im:
            im.convert("RGB").save(lbl(r))

    def label_values(r, sid=BAD_TARGET):
        with Image.open(lbl(r, sid)) as im:
            a = np.array(im)
        a[:3, :5] = 7
        Image.fromarray(a, mode="L").save(lbl(r, sid))

    defects = {
        "split_missing": lambda r: split(r).unlink(),
        "split_empty": lambda r: split(r).write_text("\n# no samples\n\n"),
        "image_missing": lambda r: img(r).unlink(),
        "label_missing": lambda r: lbl(r).unlink(),
        "jpeg_truncated": lambda r: truncate(img(r)),
        "jpeg_garbage": lambda r: img(r).write_bytes(b"this is not a JPEG" * 20),
        "label_size": label_resized,
        "label_rgb": label_rgb,
        "label_values": label_values,
        "val_label_values": lambda r: label_values(r, BAD_VAL_TARGET),
    }
    roots = {}
    for name, defect in defects.items():
        root = base / name
        shutil.copytree(demo_root, root)
        defect(root)
        roots[name] = root
    return roots


# Each defect of bad_roots (and two flags) -> the start of the one error line it gives.
DATA_CASES = {
    "root_missing": "error: data root not found (data.root): ",
    "split_missing": "error: split not found ({root}/ImageSets/Segmentation/train.txt): ",
    "split_empty": "error: empty split ({root}/ImageSets/Segmentation/train.txt): ",
    "image_missing": f"error: image not found ({{root}}/JPEGImages/{BAD_TARGET}.jpg): ",
    "label_missing": f"error: label not found ({{root}}/SegmentationClass/{BAD_TARGET}.png): ",
    "jpeg_truncated": f"error: unreadable image ({{root}}/JPEGImages/{BAD_TARGET}.jpg): ",
    "jpeg_garbage": f"error: unreadable image ({{root}}/JPEGImages/{BAD_TARGET}.jpg): ",
    "label_size": f"error: label size differs from image ({{root}}/SegmentationClass/{BAD_TARGET}.png): ",
    "label_rgb": f"error: bad label ({{root}}/SegmentationClass/{BAD_TARGET}.png): ",
    "label_values": f"error: label values out of range ({{root}}/SegmentationClass/{BAD_TARGET}.png): ",
    "val_label_values": f"error: label values out of range ({{root}}/SegmentationClass/{BAD_VAL_TARGET}.png): ",
    "batch_indivisible": "error: batch does not divide across towers (data.batch_size): ",
}


# ---- lossy (JPEG) labels in every input format (tests/test_lossy_labels.py) --------------------------------
LOSSY_NUM_CLASSES = 20
LOSSY_MESSAGE = ("lossy JPEG label ({path}): expected a PNG of class indices (JPEG compression damages the class "
                 "values); convert the label to PNG, from its source annotation if you have it")


LOSSY_H, LOSSY_W = 32, 40


def label_array(seed: int) -> np.ndarray:
    """6x6 blocks of classes 5..14 (not JPEG's 8x8 grid, which would keep flat blocks exact): JPEG changes
    most pixels, by a few levels, within 0..19 (checked in `sets`)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(5, 15, (LOSSY_H // 6 + 1, LOSSY_W // 6 + 1), dtype=np.uint8)
    return np.repeat(np.repeat(b, 6, 0), 6, 1)[:LOSSY_H, :LOSSY_W]


def encoded(array: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **kw)
    return buf.getvalue()


def lossy_photo(seed: int) -> bytes:
    rng = np.random.default_rng(100 + seed)
    return encoded(rng.integers(0, 256, (LOSSY_H, LOSSY_W, 3), dtype=np.uint8), "JPEG", quality=90)


def jpeg_label(seed: int) -> bytes:
    return encoded(label_array(seed), "JPEG", quality=75)


def deeplab_example(image: bytes, label: bytes, label_format: bytes, name: str) -> bytes:
    """A tf.train.Example as DeepLab's build_data.image_seg_to_tfexample writes it (its feature keys)."""
    def b(v):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

    def i(v):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))

    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": b(image), "image/filename": b(name.encode()), "image/format": b(b"jpeg"),
        "image/height": i(LOSSY_H), "image/width": i(LOSSY_W), "image/channels": i(3),
        "image/segmentation/class/encoded": b(label), "image/segmentation/class/format": b(label_format),
    })).SerializeToString()


def make_lossy_voc(root: Path) -> list[str]:
    """4 samples; s1's SegmentationClass/s1.png holds a JPEG. Returns the bad label paths."""
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True)
    for n in range(4):
        (root / "JPEGImages" / f"s{n}.jpg").write_bytes(lossy_photo(n))
        label = jpeg_label(n) if n == 1 else encoded(label_array(n), "PNG")
        (root / "SegmentationClass" / f"s{n}.png").write_bytes(label)
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("s0\ns1\ns2\ns3\n")
    return [str(root / "SegmentationClass" / "s1.png")]


def make_lossy_pairs(root: Path) -> list[str]:
    """A pairs list of 4 samples naming masks/p1.jpg and masks/p2.jpg (JPEGs) among PNG masks."""
    (root / "photos").mkdir(parents=True)
    (root / "masks").mkdir()
    lines, bad = [], []
    for n in range(4):
        (root / "photos" / f"p{n}.jpg").write_bytes(lossy_photo(n))
        name = f"p{n}.jpg" if n in (1, 2) else f"p{n}.png"
        (root / "masks" / name).write_bytes(jpeg_label(n) if n in (1, 2) else encoded(label_array(n), "PNG"))
        lines.append(f"photos/p{n}.jpg masks/{name}")
        if n in (1, 2):
            bad.append(str(root / "masks" / name))
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    return bad


def make_lossy_records(root: Path) -> list[str]:
    """One shard of DeepLab-keyed records, no index file: record 1 a JPEG label said to be 'jpeg', record 2
    a JPEG label said to be 'png', record 3 a PNG label said to be 'jpeg' (usable: the bytes decide)."""
    root.mkdir(parents=True)
    shard = root / "train-00000-of-00001.tfrecord"
    kinds = [(False, b"png"), (True, b"jpeg"), (True, b"png"), (False, b"jpeg")]
    with tf.io.TFRecordWriter(str(shard)) as w:
        for n, (is_jpeg, fmt) in enumerate(kinds):
            label = jpeg_label(n) if is_jpeg else encoded(label_array(n), "PNG")
            w.write(deeplab_example(lossy_photo(n), label, fmt, f"r{n}.jpg"))
    return [f"{shard}[{shard.name}:{n}]" for n in (1, 2)]


LOSSY_KINDS = {"voc": make_lossy_voc, "pairs": make_lossy_pairs, "tfrecord": make_lossy_records}


def write_lossy_config(directory: Path, kind: str, root: Path, **data) -> Path:
    raw = {"seed": 0, "run_dir": "run",
           "data": {"root": str(root), "num_classes": LOSSY_NUM_CLASSES, "train_split": "train", "val_split": "none",
                    "batch_size": 2, "crop_size": [LOSSY_H, LOSSY_W], "random_scale": [1.0, 1.0],
                    "num_parallel_calls": 2,
                    **({"layout": "pairs", "train_split": "train.txt"} if kind == "pairs" else {}),
                    **({"format": "tfrecord"} if kind == "tfrecord" else {}), **data},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4},
           "train": {"num_steps": 1, "checkpoint_every": 1, "summary_every": 1, "image_summary_every": 0},
           "eval": {"bn_reestimate_batches": 0}}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{kind}-{'-'.join(f'{k}={v}' for k, v in data.items()) or 'default'}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# ---- a small evaluation split and BN statistics calibrated on it (tests/test_evaluate.py) ------------------
CPU_DEVICES = [f"/device:CPU:{i}" for i in range(4)]


EVAL_NUM_CLASSES = 4


EVAL_NAMES = ["sky", "road", "car", "tree"]


def write_eval_split(root, sizes, seed=0):
    """A VOC-layout folder of random images and labels (with ignored blocks) of the given sizes."""
    rng = np.random.default_rng(seed)
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True, exist_ok=True)
    ids = []
    for i, (h, w) in enumerate(sizes):
        sid = f"img{i}"
        # Blocks of random colours: spatial structure, so the predictions vary across the image.
        blocks = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        image = np.repeat(np.repeat(blocks, 8, axis=0), 8, axis=1)[:h, :w]
        Image.fromarray(image).save(root / "JPEGImages" / f"{sid}.jpg")
        label = rng.integers(0, EVAL_NUM_CLASSES, (h, w)).astype(np.uint8)
        label[: h // 3, : w // 4] = 255
        save_index_png(root / "SegmentationClass" / f"{sid}.png", label, voc_colormap())
        ids.append(sid)
    for split in ("train", "val"):
        (root / "ImageSets/Segmentation" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    (root / "classes.txt").write_text("\n".join(EVAL_NAMES) + "\n")
    return root


def calibrate_bn(cfg, model, reader, passes=30):
    """BN moving statistics for these images (forward passes in training mode): an untrained model
    with its initial statistics predicts nearly one class everywhere, which would make a weak test."""
    x = np.stack([np.asarray(Image.open(s.image).convert("RGB").resize((32, 32)), np.float32)
                  for s in reader.samples])
    x = (x - np.array(cfg.data.mean, np.float32)) / np.array(cfg.data.std, np.float32)
    for _ in range(passes):
        model(x, training=True)


# ---- the inference modes computed by hand (tests/test_eval_modes.py) ---------------------------------------
def eval_config(**keys):
    """An EvalConfig through the real loader (checks and defaults included)."""
    return config_lib.from_dict({"data": {"root": "d", "num_classes": EVAL_NUM_CLASSES}, "eval": keys}).eval


def normalized(cfg, path):
    image = np.asarray(Image.open(path).convert("RGB"), np.float32)
    return (image - np.array(cfg.data.mean, np.float32)) / np.array(cfg.data.std, np.float32)


def reference_scores(model, x, modes):
    """The scores of one image [h, w, 3], computed independently: eager calls, Python loops, numpy sums."""
    h, w = x.shape[:2]

    def forward(t):  # pad to 32 at the bottom/right, crop back
        th, tw = t.shape[:2]
        t = np.pad(t, [(0, -th % 32), (0, -tw % 32), (0, 0)])
        return model(t[None], training=False).numpy()[0, :th, :tw]

    def slide(t):  # mmsegmentation's window placement
        th, tw = t.shape[:2]
        (ch, cw), (sh, sw) = modes.crop_size, modes.stride
        total = np.zeros((th, tw, EVAL_NUM_CLASSES), np.float32)
        count = np.zeros((th, tw, 1), np.float32)
        for r in range(max(th - ch + sh - 1, 0) // sh + 1):
            for c in range(max(tw - cw + sw - 1, 0) // sw + 1):
                y2, x2 = min(r * sh + ch, th), min(c * sw + cw, tw)
                y1, x1 = max(y2 - ch, 0), max(x2 - cw, 0)
                total[y1:y2, x1:x2] += forward(t[y1:y2, x1:x2])
                count[y1:y2, x1:x2] += 1
        return total / count

    def view(t, s):
        if s != 1.0:
            t = tf.image.resize(t, [max(1, round(h * s)), max(1, round(w * s))]).numpy()
        logits = slide(t) if modes.mode == "slide" else forward(t)
        return logits if s == 1.0 else tf.image.resize(logits, [h, w]).numpy()

    if not modes.flip and len(modes.scales) == 1:
        return view(x, modes.scales[0])
    probs = []
    for s in modes.scales:
        probs.append(tf.nn.softmax(view(x, s)).numpy())
        if modes.flip:
            probs.append(tf.nn.softmax(view(x[:, ::-1], s)).numpy()[:, ::-1])
    return np.mean(probs, axis=0)


# ---- a slow tf.data iterator teardown, to time a command's exit (tests/test_exit_prompt.py) ----------------
SLOW_DESTROY = 20.0


# Makes every tf.data iterator's destruction slow and records the thread that ran it (module doc).
# Patched when the command imports TensorFlow, as the command imports it.
SLOW_TEARDOWN = r'''
import os, threading, time, weakref
from seg_train import cli


def _slow_teardown():
    from tensorflow.python.data.ops import iterator_ops, multi_device_iterator_ops

    seconds, record = float(os.environ["SLOW_DESTROY"]), os.environ["DESTROY_RECORD"]

    def destroyed(kind):
        with open(record, "a") as f:
            f.write(f"{kind} {threading.current_thread().name}\n")
        time.sleep(seconds)

    for cls in (iterator_ops.OwnedIterator, multi_device_iterator_ops.OwnedMultiDeviceIterator):
        def __init__(self, *args, _init=cls.__init__, _kind=cls.__name__, **kwargs):
            _init(self, *args, **kwargs)
            # Iterators alive when the process ends are never destroyed (os._exit): nor are these.
            weakref.finalize(self, destroyed, _kind).atexit = False
        cls.__init__ = __init__


_import_tensorflow = cli.process.import_tensorflow


def import_tensorflow(debug):
    tf = _import_tensorflow(debug)
    _slow_teardown()
    return tf


cli.process.import_tensorflow = import_tensorflow
'''


def destructions(record) -> list[tuple[str, str]]:
    """(iterator class, thread name) of each destruction the driver saw."""
    return [tuple(line.split()) for line in record.read_text().splitlines()] if record.exists() else []


# ---- a tiny training config and a command run in a fresh process (tests/test_train_cli.py) -----------------
def run_command(args, cwd, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "seg_train.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def write_train_config(tmp_path, root, **train):
    raw = {"seed": 1, "run_dir": "run",
           "data": {"root": str(root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                    "num_parallel_calls": 2},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4},
           "train": {"num_steps": 4, "checkpoint_every": 2, "summary_every": 1, "image_summary_every": 2,
                     "learning_rate": 0.01, **train},
           # Small: the final evaluation re-estimates BN statistics (exercised, not measured, here).
           "eval": {"bn_reestimate_batches": 2}}
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


# ---- MiT sizes written out, not read from seg-train's MIT_VARIANTS (a wrong entry would build keras-hub's reference
# with the same mistake): the SegFormer paper's Table 6, the same as the B0 of keras-hub's MiTBackbone /
# SegFormerBackbone docstrings and the parameter counts of its published mit_b*_ade20k presets
# (tests/test_segformer.py). Heads and reduction ratios are per stage; a head count off changes no shape.
PAPER_HEADS, PAPER_SR_RATIOS, PAPER_PATCH_SIZES, PAPER_STRIDES = [1, 2, 5, 8], [8, 4, 2, 1], [7, 3, 3, 3], [4, 2, 2, 2]
PAPER_MIT = {  # name: (hidden sizes, depths)
    "mit_b0": ([32, 64, 160, 256], [2, 2, 2, 2]),
    "mit_b1": ([64, 128, 320, 512], [2, 2, 2, 2]),
    "mit_b2": ([64, 128, 320, 512], [3, 4, 6, 3]),
    "mit_b3": ([64, 128, 320, 512], [3, 4, 18, 3]),
    "mit_b4": ([64, 128, 320, 512], [3, 8, 27, 3]),
    "mit_b5": ([64, 128, 320, 512], [3, 6, 40, 3]),
}


def mit_kwargs(name):
    """keras-hub's MiTBackbone arguments for a size, from the paper's table above."""
    widths, depths = PAPER_MIT[name]
    return dict(num_layers=4, hidden_dims=list(widths), layerwise_depths=list(depths),
                layerwise_num_heads=list(PAPER_HEADS), layerwise_sr_ratios=list(PAPER_SR_RATIOS),
                layerwise_patch_sizes=list(PAPER_PATCH_SIZES), layerwise_strides=list(PAPER_STRIDES),
                max_drop_path_rate=0.1)


# ---- the tf.distribute strategy of n CPU towers (tests/test_towers.py) -------------------------------------


def strategy(n):
    return replicas.make_strategy(replicas.Devices(CPU_DEVICES[:n], "CPU", ""))


# ---- a tiny ViT in dinov3_vits16's place (the `tiny_vits16` fixture, conftest.py) ---------------------------
# The EoMT and ViT runs build dinov3_vits16 from config files (the loader and the builders read
# config/variants.py's VIT_VARIANTS): this one has its structure (patch 16, 4 registers, RoPE, no key bias, a level
# per block for layer decay) at 4 blocks of width 32, where ViT-S's 12 of 384 make every traced step several times
# larger (the trace grows with blocks x towers). 4 blocks: model.eomt_blocks' default, so a config that leaves it
# unset still builds, and 2 EoMT blocks leave 2 plain ones before them.
TINY_VITS16 = ViTVariant("dinov3", 16, 32, 4, 2, 64, registers=4, key_bias=False)
# In mit_b0's place where a run's steps are compared or resumed (config/variants.py's MIT_VARIANTS, which the
# builders read): one block per stage where MiT-B0 has two, widths a multiple of each stage's heads; the stages'
# heads, reductions and patches are B0's.
TINY_MIT_B0 = MiTVariant((8, 16, 40, 64), (1, 1, 1, 1))


# ---- BN population statistics by hand (tests/test_bn_stats.py) ---------------------------------------------
def global_batches(trainer, reader, num_batches):
    """The images PreciseBN.reestimate reads: global batches of the training stream at its fixed start."""
    batch = trainer.state.cfg.data.batch_size
    ds = reader.train_dataset(batch, precise_bn.stream_start_step(batch), 1)
    return [images.numpy() for images, _ in ds.take(num_batches)]


def population(features):
    x = np.concatenate([f.reshape(-1, f.shape[-1]) for f in features]).astype(np.float64)
    return x.mean(0), x.var(0)


# ---- the data.* and eval.* keys' wiring map (tests/test_config_wiring.py merges it into WIRED)
# (tests/test_config_wiring_data.py)
# key -> the pytest node id of a test that fails when the key is ignored (replaced by its default), or
# "unobservable: <why>". Node ids, not bare names, so the dict merges into any other list of this kind.
WIRED_DATA_HERE = "tests/test_config_wiring_data.py::"


WIRED_DATA = {
    # Required (no default to fall back to): every test reads its files from it.
    "data.root": WIRED_DATA_HERE + "test_train_crops_are_windows_of_the_file_normalised_by_hand",
    # open_split(cfg) of Cityscapes / ADE20K / pairs trees against maps by hand (voc, the default,
    # would list other files or none).
    "data.layout": "tests/test_layouts.py::test_reader_labels_are_the_by_hand_mapping",
    "data.train_split": WIRED_DATA_HERE + "test_step_1_tower_losses_are_the_losses_of_the_configured_batch_by_hand",
    "data.val_split": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "data.num_classes": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "data.ignore_label": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "data.batch_size": WIRED_DATA_HERE + "test_step_1_tower_losses_are_the_losses_of_the_configured_batch_by_hand",
    "data.crop_size": WIRED_DATA_HERE + "test_train_crops_are_windows_of_the_file_normalised_by_hand",
    "data.random_scale": WIRED_DATA_HERE + "test_random_scale_scales_the_file_content",
    "data.random_mirror": WIRED_DATA_HERE + "test_train_crops_are_windows_of_the_file_normalised_by_hand",
    "data.photometric": WIRED_DATA_HERE + "test_photometric_runs_only_the_named_steps_within_their_amounts",
    "data.mean": WIRED_DATA_HERE + "test_train_crops_are_windows_of_the_file_normalised_by_hand",
    "data.std": WIRED_DATA_HERE + "test_train_crops_are_windows_of_the_file_normalised_by_hand",
    "data.class_names": WIRED_DATA_HERE + "test_evaluation_during_training_reads_the_val_split_under_the_class_names",
    "data.synthetic": WIRED_DATA_HERE + "test_synthetic_data_set_generated_where_the_config_says",
    "data.num_parallel_calls": WIRED_DATA_HERE + "test_num_parallel_calls_reaches_the_tf_data_graph",
    # Through the config (open_split(cfg)): the same stream as without it, cache bytes > 0, each file
    # decoded once.
    "data.cache": "tests/test_reader.py::test_cache_gives_the_same_stream_and_decodes_once",
    "data.label_map": WIRED_DATA_HERE + "test_label_options_map_the_raw_png_values_by_hand",
    "data.reduce_zero_label": WIRED_DATA_HERE + "test_label_options_map_the_raw_png_values_by_hand",
    "data.binary_threshold": WIRED_DATA_HERE + "test_label_options_map_the_raw_png_values_by_hand",
    # seg-train and seg-eval on a folder holding only the records (files: nothing to list); the reader's own
    # branch: tests/test_tfrecord.py::test_the_stream_over_records_is_the_stream_over_the_files (no fallback).
    "data.format": "tests/test_tfrecord.py::test_cityscapes_as_tfrecords_trains_and_evaluates",
    # seg-train --check-data on Cityscapes' gtFine: the instanceIds scanned into segments and crowd per class.
    "data.task": "tests/test_panoptic_data.py::test_check_data_scans_cityscapes_instance_ids_for_the_panoptic_task",
    # open_split of a COCO panoptic JSON without isthing: the config's thing classes are the things.
    "data.thing_classes": "tests/test_panoptic_data.py::test_coco_errors_are_one_line_naming_the_file",
    # The reader's stand-in; the scan's drop of bad samples (scan_split(cfg)):
    # tests/test_scan_cache.py::test_bad_samples_come_back_from_the_cache[skip].
    "data.on_bad_sample": "tests/test_decode.py::test_missing_file_is_named_in_one_line_and_skip_gives_the_stand_in",
    # scan_split(cfg) with scan_cache: false decodes every time and writes nothing.
    "data.scan_cache": "tests/test_scan_cache.py::test_where_the_cache_lives",
    # scan_split(cfg) writes its entry in the configured folder.
    "data.scan_cache_dir": "tests/test_scan_cache.py::test_a_second_scan_decodes_nothing_and_gives_the_same_weights",
    "eval.bn_reestimate_batches": WIRED_DATA_HERE + "test_bn_reestimation_reads_the_configured_batches",
    "eval.mode": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "eval.flip": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "eval.scales": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "eval.crop_size": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "eval.stride": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "eval.logit_adjustment": WIRED_DATA_HERE + "test_seg_eval_counts_what_the_modes_give_by_hand",
    "eval.mask_thresh": "tests/test_panoptic_model.py::"
                        "test_seg_eval_pq_is_the_official_evaluators_on_seg_predicts_files",
    "eval.overlap_thresh": "tests/test_panoptic_model.py::test_evaluation_on_four_towers_equals_one",
}


# ---- keras-applications' weight files (tests/test_backbone_weights.py, tests/test_mobilenetv3.py) ----------------
# keras-applications' published file names (tf_keras.applications builds them the same way), written out: the
# fixtures save under them and seg-train's one-line errors name them.
PUBLISHED_FILES = {
    "mobilenetv2": "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_224_no_top.h5",
    "mobilenetv3_large": "weights_mobilenet_v3_large_224_1.0_float_no_top_v2.h5",
    "mobilenetv3_small": "weights_mobilenet_v3_small_224_1.0_float_no_top_v2.h5",
    "resnet50": "resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5",
    "resnet101": "resnet101_weights_tf_dim_ordering_tf_kernels_notop.h5",
}


EOMT_FIXTURE = Path(__file__).parent / "fixtures" / "eomt_model.npz"


def eomt_from_reference(path: Path = EOMT_FIXTURE):
    """(model, fixture): seg-train's EoMT (models/eomt/eomt.py) built with the config numbers of the fixture that
    scripts/reference_eomt_model.py writes, its transformers weights loaded by seg-train's loader
    (models/dino/transformers.py) from a folder written with the `safetensors` package under their
    transformers names (the loader refuses a weight left over or missing, and sets each variable once)."""
    import tempfile

    from safetensors.numpy import save_file

    from seg_train.models.dino.transformers import check_eomt_folder, load_eomt_folder
    from seg_train.models.eomt.eomt import eomt

    z = np.load(path)
    cfg = {k[len("config/"):]: z[k].item() for k in z.files if k.startswith("config/")}
    c, depth = cfg["hidden_size"], cfg["num_hidden_layers"]
    spec = ViTVariant("dinov2", cfg["patch_size"], c, depth, cfg["num_attention_heads"], c * cfg["mlp_ratio"],
                   registers=cfg["num_register_tokens"], layer_scale=cfg["layerscale_value"],
                   pos_grid=cfg["image_size"] // cfg["patch_size"], cls_position=False)
    assert spec.epsilon == cfg["layer_norm_eps"]
    model = eomt(spec, cfg["num_labels"], queries=cfg["num_queries"], eomt_blocks=cfg["num_blocks"],
                 upscale_blocks=cfg["num_upscale_blocks"])
    with tempfile.TemporaryDirectory() as folder:
        save_file({k[len("w/"):]: z[k] for k in z.files if k.startswith("w/")}, Path(folder) / "model.safetensors")
        config = {"architectures": ["EomtForUniversalSegmentation"], "model_type": "eomt", "hidden_act": "gelu",
                  **cfg}
        (Path(folder) / "config.json").write_text(json.dumps(config))
        loaded = check_eomt_folder(folder, spec, "fixture", cfg["num_queries"], cfg["num_blocks"], cfg["num_labels"])
        assert load_eomt_folder(model, loaded) == len(model.weights)
    return model, z


# ---- transformers folders (tests/test_transformers_weights.py; scripts/reference_transformers_checkpoints.py) ----
TRANSFORMERS_FIXTURES = Path(__file__).parent / "fixtures" / "transformers"
ENCODER_CASES = ("dinov3_vit", "dinov2", "dinov2_registers")
EOMT_CASES = ("eomt", "eomt_dinov3")


def transformers_case(case: str):
    """(folder, outputs, Variant, EoMT keys or None) of a fixture folder, the Variant read off its config.json by
    transformers' meaning of each number (with the position resize transformers uses)."""
    from seg_train.config.variants import ViTVariant as Variant

    folder = TRANSFORMERS_FIXTURES / case
    raw = json.loads((folder / "config.json").read_text())
    v3 = raw["model_type"] in ("dinov3_vit", "eomt_dinov3")
    c, p = raw["hidden_size"], raw["patch_size"]
    common = dict(registers=raw.get("num_register_tokens", 0), layer_scale=raw["layerscale_value"])
    if v3:
        spec = Variant("dinov3", p, c, raw["num_hidden_layers"], raw["num_attention_heads"], raw["intermediate_size"],
                       gated=raw["use_gated_mlp"], activation=raw["hidden_act"], key_bias=raw["key_bias"], **common)
    else:
        eomt = raw["model_type"] == "eomt"
        spec = Variant("dinov2", p, c, raw["num_hidden_layers"], raw["num_attention_heads"], c * raw["mlp_ratio"],
                       gated=raw["use_swiglu_ffn"], pos_grid=raw["image_size"] // p, cls_position=not eomt,
                       antialias=raw["model_type"] == "dinov2_with_registers", torch_bicubic=True, **common)
    assert spec.epsilon == raw["layer_norm_eps"], raw["layer_norm_eps"]
    eomt_keys = {"queries": raw["num_queries"], "eomt_blocks": raw["num_blocks"], "classes": len(raw["id2label"])} \
        if "num_queries" in raw else None
    return folder, dict(np.load(TRANSFORMERS_FIXTURES / f"{case}.npz")), spec, eomt_keys


def transformers_layout(architecture: str) -> dict:
    """config.json and {tensor: [dtype, shape]} of a transformers model at TINY_VITS16's size (layouts.json)."""
    return json.loads((TRANSFORMERS_FIXTURES / "layouts.json").read_text())[architecture]


def write_transformers_folder(directory: Path, layout: dict, seed: int = 0, drop=(), config=None,
                              shapes=None) -> dict:
    """A transformers folder of `layout`'s config.json and tensors, stored as BF16, written with the `safetensors`
    package; tensors `drop` left out, `config` entries and tensor `shapes` {name: shape} changed. Returns the
    float32 values written. The values are random at the scales scripts/reference_transformers_checkpoints.py
    gives its models (every matrix N(0, 1 / fan_in); vectors and tokens N(0, 0.1), norm weights and layer scales
    near 1; positions and queries N(0, 1)): at a small width, transformers' own N(0, 0.02) leaves an EoMT's
    prediction one class over the whole image."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays, written = {}, {}
    for name, (_, shape) in layout["tensors"].items():
        if name in drop:
            continue
        shape = (shapes or {}).get(name, shape)
        if len(shape) == 1 or "token" in name:
            a = rng.normal(0.0, 0.1, shape)
            if len(shape) == 1 and (name.endswith("lambda1") or "norm" in name and name.endswith("weight")):
                a += 1.0
        elif "position_embeddings" in name or name == "query.weight":
            a = rng.normal(0.0, 1.0, shape)
        else:  # Linear [out, in], Conv2d [out, in, kh, kw], the upscale blocks' ConvTranspose2d (conv1) [in, out, ...]
            fan_in = int(np.prod(shape[1:])) if "conv1" not in name else shape[0] * int(np.prod(shape[2:]))
            a = rng.normal(0.0, fan_in ** -0.5, shape)
        stored = a.astype(np.float32).astype(ml_dtypes.bfloat16)
        arrays[name], written[name] = stored, stored.astype(np.float32)
    save_file(arrays, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**layout["config"], **(config or {})}))
    return written

# ---- panoptic data as it ships (tests/test_panoptic_data.py, tests/test_config_wiring_data.py) ---------------
# Five of COCO's panoptic categories with their real ids, names and isthing, and the train ids COCO's 133 would
# give them here (in increasing id order), written out by hand.
COCO_CATEGORIES = [{"id": 1, "name": "person", "isthing": 1, "supercategory": "person", "color": [220, 20, 60]},
                   {"id": 3, "name": "car", "isthing": 1, "supercategory": "vehicle", "color": [0, 0, 142]},
                   {"id": 184, "name": "tree-merged", "isthing": 0, "supercategory": "plant", "color": [107, 142, 35]},
                   {"id": 199, "name": "wall-other-merged", "isthing": 0, "supercategory": "wall",
                    "color": [102, 102, 156]},
                   {"id": 200, "name": "rug-merged", "isthing": 0, "supercategory": "floor", "color": [250, 141, 255]}]
COCO_TRAIN_ID_BY_HAND = {1: 0, 3: 1, 184: 2, 199: 3, 200: 4}
COCO_IMAGES = ("000000000139", "000000000285", "000000000632")  # COCO val2017's first file names
COCO_H, COCO_W = 24, 32


def coco_scene(rng, n):
    """One image's segments by hand: (segment ids [H, W], 0 unlabelled, and segments_info). Ids spread over all
    three bytes; two persons and a car numbered by hand, a crowd of persons, two stuff classes."""
    ids = np.zeros((COCO_H, COCO_W), np.int64)
    wall, tree = 0x0A0B0C + n, 0x00FF01 + n  # stuff: 789260 + n (R 12, G 11, B 10), 65281 + n
    person_a, person_b, car, crowd = 0x123456 + n, 0x000102, 0xFFFFFF - n, 0x010000
    ids[:12] = wall
    ids[12:] = tree
    y, x = int(rng.integers(0, 6)), int(rng.integers(0, 8))
    ids[y:y + 8, x:x + 6] = person_a
    ids[y + 2:y + 10, x + 6:x + 10] = person_b  # touches person_a: only the ids keep them apart
    ids[14:20, 20:30] = car
    ids[20:24, 0:6] = crowd
    ids[0, :] = 0  # unlabelled row
    info = [{"id": wall, "category_id": 199, "iscrowd": 0}, {"id": person_a, "category_id": 1, "iscrowd": 0},
            {"id": tree, "category_id": 184, "iscrowd": 0}, {"id": person_b, "category_id": 1, "iscrowd": 0},
            {"id": crowd, "category_id": 1, "iscrowd": 1}, {"id": car, "category_id": 3, "iscrowd": 0}]
    for s in info:
        m = ids == s["id"]
        rows, cols = np.flatnonzero(m.any(1)), np.flatnonzero(m.any(0))
        s.update(area=int(m.sum()), bbox=[int(cols[0]), int(rows[0]), int(cols[-1] - cols[0] + 1),
                                          int(rows[-1] - rows[0] + 1)])
    return ids, info


def coco_rgb(ids):
    """COCO panoptic's PNG colours of segment ids, from the format's definition id = R + 256 G + 256^2 B."""
    return np.stack([ids & 0xFF, (ids >> 8) & 0xFF, (ids >> 16) & 0xFF], -1).astype(np.uint8)


def make_coco_panoptic_tree(root, rng, split="val2017", categories=None):
    """A COCO panoptic split laid out as COCO ships it: annotations/panoptic_<split>.json, annotations/
    panoptic_<split>/<image id>.png (RGB, written by Pillow), <split>/<image id>.jpg. Returns {stem: (ids, info)}."""
    root = Path(root)
    (root / "annotations" / f"panoptic_{split}").mkdir(parents=True)
    (root / split).mkdir(parents=True)
    images, annotations, scenes = [], [], {}
    for n, stem in enumerate(COCO_IMAGES):
        ids, info = coco_scene(rng, n)
        Image.fromarray(layout_photo(rng)[:COCO_H, :COCO_W]).save(root / split / f"{stem}.jpg", quality=95)
        Image.fromarray(coco_rgb(ids), mode="RGB").save(root / "annotations" / f"panoptic_{split}" / f"{stem}.png")
        images.append({"id": int(stem), "file_name": f"{stem}.jpg", "height": COCO_H, "width": COCO_W})
        annotations.append({"image_id": int(stem), "file_name": f"{stem}.png", "segments_info": info})
        scenes[stem] = (ids, info)
    (root / "annotations" / f"panoptic_{split}.json").write_text(json.dumps(
        {"info": {}, "licenses": [], "images": images, "annotations": annotations,
         "categories": COCO_CATEGORIES if categories is None else categories}))
    return scenes


def coco_labels_by_hand(ids, info, ignore_label=255):
    """The segment labels of one COCO image, by hand: train id * 1000 + (0 stuff, 999 crowd, the thing's place
    among the image's non-crowd things, 1-based), ignore_label * 1000 unlabelled."""
    out = np.full(ids.shape, ignore_label * 1000, np.int64)
    things = 0
    for s in info:
        train = COCO_TRAIN_ID_BY_HAND[s["category_id"]]
        if s["iscrowd"]:
            inst = 999
        elif s["category_id"] in (1, 3):
            things += 1
            inst = things
        else:
            inst = 0
        out[ids == s["id"]] = train * 1000 + inst
    return out

# ---- exported files run outside seg-train: stock LiteRT / ONNX Runtime in a fresh interpreter ------------
# Each script imports only the runtime, its file reader and numpy (no seg_train, no TensorFlow: it asserts
# so), runs the file on every image, saves the class maps, and prints what it read of the file as JSON.
OUTSIDE_LITERT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter, OpResolverType
    path, images = sys.argv[1], np.load(sys.argv[2])
    plain = Interpreter(model_path=path, experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    plain.allocate_tensors()
    ops = sorted({op["op_name"] for op in plain._get_ops_details()})
    it = Interpreter(model_path=path)
    it.allocate_tensors()
    (inp,), outs = it.get_input_details(), it.get_output_details()
    classes = []
    for image in images:
        it.set_tensor(inp["index"], image[None])
        it.invoke()
        classes.append(it.get_tensor(outs[0]["index"])[0])
    np.save(sys.argv[3], np.stack(classes))
    assert "seg_train" not in sys.modules and "tensorflow" not in sys.modules
    print(json.dumps({"ops": ops, "input": [inp["dtype"].__name__, inp["shape"].tolist()],
                      "outputs": [[o["dtype"].__name__, o["shape"].tolist()] for o in outs]}))
""")
# The outputs are found by name (classes, probabilities), as an app written from FILE.json finds them.
OUTSIDE_ONNX = textwrap.dedent("""
    import json, sys
    import numpy as np
    import onnx
    import onnxruntime
    path, images = sys.argv[1], np.load(sys.argv[2])
    model = onnx.load(path)
    ops = sorted({node.op_type for node in model.graph.node})
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    (inp,), outs = session.get_inputs(), session.get_outputs()
    names = [o.name for o in outs]
    results = [dict(zip(names, session.run(None, {inp.name: image[None]}))) for image in images]
    np.save(sys.argv[3], np.stack([r["classes"][0] for r in results]))
    if "probabilities" in names:
        np.save(sys.argv[3][:-4] + "_probabilities.npy", np.stack([r["probabilities"][0] for r in results]))
    assert "seg_train" not in sys.modules and "tensorflow" not in sys.modules
    print(json.dumps({"ops": ops, "opset": [(o.domain, o.version) for o in model.opset_import],
                      "input": [inp.name, inp.type, inp.shape], "outputs": [[o.name, o.type, o.shape] for o in outs]}))
""")


def run_outside(path, images_npy, out_npy):
    """The .tflite (stock LiteRT) or .onnx (ONNX Runtime, CPU) file at `path` run on the images saved at
    `images_npy` in a fresh interpreter (OUTSIDE_LITERT / OUTSIDE_ONNX, written beside the images): (what it
    reported, its class maps, also saved at `out_npy`). A .onnx file's softmax, if it has one, is saved
    beside them as <out_npy stem>_probabilities.npy."""
    onnx = Path(path).suffix == ".onnx"
    script = images_npy.parent / ("outside_onnx.py" if onnx else "outside.py")
    script.write_text(OUTSIDE_ONNX if onnx else OUTSIDE_LITERT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(script), str(path), str(images_npy), str(out_npy)],
                         capture_output=True, text=True, env=env, cwd=images_npy.parent, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), np.load(out_npy)
