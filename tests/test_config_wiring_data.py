"""Every data.* and eval.* config key reaches the code that uses it.

The wrong answer each test is for: a key read, validated and documented, then dropped (or replaced by its
default) between the config and the code that should use it, while the only tests of that code call it
directly with their own arguments. So every test here goes through a public door of the real program (the
config loader, the data's front door `open_split(cfg, split)`, and the commands seg-train, seg-eval,
seg-predict and seg-export run in-process through their `cli.*_main`), with a NON-default value of each key,
and holds the result to a reference written out by hand from the literal values below (numpy on the decoded
PNGs, a model called eagerly, TensorBoard's EventAccumulator), never to the config object the code read.

WIRED_DATA (tests/helpers.py) maps each data.* and eval.* key to the test that fails
when the key is ignored (a pytest node id), or to "unobservable: <why>" (no key here needed it);
tests/test_config_wiring.py merges it into its WIRED map, whose `test_every_documented_key_is_wired` keeps
it complete and true.
"""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml
from PIL import Image

from seg_train import cli
from seg_train import config as config_lib
from seg_train.data.reader import ImageReader
from tests.helpers import bilinear_resize, open_reader

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

ROOT = Path(__file__).resolve().parents[1]


# Non-default values, written once; the references below use these literals, not the loaded config.
MEAN, STD = (100.0, 110.0, 120.0), (50.0, 40.0, 60.0)
NAMES = ["sky", "road", "car"]
IGNORE = 200  # the reader's and the training run's ignore label (not a class, not the default 255)


def write_split(root: Path, split: str, sizes, values, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """PNG images and single-channel PNG labels listed as 'image label' pairs in ImageSets/Segmentation/<split>.txt
    (the VOC layout's list-file form). Images: 4x4 blocks of random colours plus noise, so every window is
    unique; labels: 4x4 blocks of `values`. Returns the (image, label) arrays as written."""
    rng = np.random.default_rng(seed)
    for d in ("img", "lbl", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True, exist_ok=True)
    lines, arrays = [], []
    for i, (h, w) in enumerate(sizes):
        blocks = rng.integers(20, 236, (h // 4 + 1, w // 4 + 1, 3))
        image = np.repeat(np.repeat(blocks, 4, 0), 4, 1)[:h, :w] + rng.integers(-15, 16, (h, w, 3))
        image = np.clip(image, 0, 255).astype(np.uint8)
        label = np.repeat(np.repeat(rng.choice(np.asarray(values), (h // 4 + 1, w // 4 + 1)), 4, 0), 4, 1)[:h, :w]
        label = label.astype(np.uint8)
        name = f"{split}{i}"
        Image.fromarray(image).save(root / "img" / f"{name}.png")
        Image.fromarray(label).save(root / "lbl" / f"{name}.png")
        lines.append(f"img/{name}.png lbl/{name}.png")
        arrays.append((image, label))
    (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return arrays


def load_config(folder: Path, raw: dict, name: str = "config.yaml") -> tuple[Path, config_lib.Config]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(raw))
    return path, config_lib.load(path)


TINY_MODEL = {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4,
              "weight_decay": 0.0}


def normalised(image: np.ndarray) -> np.ndarray:
    """(x - mean) / std by hand, with the literal MEAN and STD."""
    return (image.astype(np.float32) - np.float32(MEAN)) / np.float32(STD)


def window_of(crop_image, crop_label, files, ignore: int = IGNORE, scale: int = 1):
    """(file index, y, x) of the one window of a file equal to a training crop: the file (scaled `scale` times:
    bilinear image, nearest label, by hand), padded at the bottom and right to the crop's size with the mean
    colour (0 after normalisation) and `ignore`, normalised by hand. None if no window is."""
    ch, cw = crop_label.shape
    found = []
    for i, (image, label) in enumerate(files):
        x = normalised(image)
        if scale != 1:
            x = bilinear_resize(x[None], (label.shape[0] * scale, label.shape[1] * scale))[0].astype(np.float32)
            label = np.repeat(np.repeat(label, scale, 0), scale, 1)
        h, w = label.shape
        pad = ((0, max(ch - h, 0)), (0, max(cw - w, 0)))
        x = np.pad(x, (*pad, (0, 0)))
        label = np.pad(label, pad, constant_values=ignore)
        diff = np.abs(np.lib.stride_tricks.sliding_window_view(x, (ch, cw, 3))[:, :, 0] - crop_image)
        close = diff.max(axis=(2, 3, 4)) < 1e-3
        for y, xo in zip(*np.nonzero(close)):
            if np.array_equal(label[y:y + ch, xo:xo + cw], crop_label):
                found.append((i, int(y), int(xo)))
    return found[0] if len(found) == 1 else None


def stream(reader: ImageReader, global_batch: int, steps: int):
    """The first `steps` global batches of the reader's training stream on one tower, as numpy."""
    return [(im.numpy(), lb.numpy()) for im, lb in reader.train_dataset(global_batch, 0, 1).take(steps)]


# ---- the reader: crops, scale, mirror, normalisation, photometric, label maps, parallel calls ----------------
SIZES = [(32, 36), (34, 36), (32, 38), (36, 36), (33, 37), (32, 36)]


@pytest.fixture(scope="module")
def reader_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("wiring_reader") / "data"
    files = write_split(root, "fit", SIZES, [0, 1, 2, IGNORE], seed=1)
    return root, files


def reader_config(tmp, root, **data):
    raw = {"seed": 3, "data": {"root": str(root), "train_split": "fit", "num_classes": 3, "ignore_label": IGNORE,
                               "mean": list(MEAN), "std": list(STD), "num_parallel_calls": 2, **data},
           "model": TINY_MODEL}
    return load_config(tmp, raw)[1]


def test_train_crops_are_windows_of_the_file_normalised_by_hand(tmp_path, reader_data):
    """data.crop_size [24, 40] on images 32..36 high and 36..38 wide: every crop of the training stream is a
    24-row window of one file of data.root, padded on the right to 40 columns with the mean colour and
    data.ignore_label, normalised with data.mean / data.std, never mirrored (data.random_mirror: false), never
    rescaled (data.random_scale: [1, 1]). Fails for any of these keys ignored (the defaults: a 321 x 321 crop,
    random scales in [0.5, 2], random flips, the tiny backbone's mean/std, padding with 255)."""
    root, files = reader_data
    cfg = reader_config(tmp_path, root, crop_size=[24, 40], random_scale=[1.0, 1.0], random_mirror=False)
    reader = open_reader(cfg, "fit")
    crops = [(im, lb) for images, labels in stream(reader, 4, 6) for im, lb in zip(images, labels)]
    seen = set()
    for k, (image, label) in enumerate(crops):
        assert label.shape == (24, 40) and image.shape == (24, 40, 3)
        where = window_of(image, label, files)
        assert where is not None, f"crop {k} is no window of a file"
        seen.add(where[0])
        assert (label[:, 38:] == IGNORE).all() and np.abs(image[:, 38:]).max() < 1e-6  # padding: every file < 40 wide
    assert seen == set(range(len(files)))  # the stream read every file of the split
    # Without random_mirror: false, the same stream has mirrored crops (the check above is not vacuous).
    mirrored = open_reader(reader_config(tmp_path / "m", root, crop_size=[24, 40], random_scale=[1.0, 1.0]), "fit")
    assert any(window_of(im, lb, files) is None for images, labels in stream(mirrored, 4, 2)
               for im, lb in zip(images, labels))


def test_random_scale_scales_the_file_content(tmp_path, reader_data):
    """data.random_scale [2, 2]: every crop is a window of the file upscaled twice (bilinear image, nearest label,
    by hand: helpers.bilinear_resize and np.repeat). Fails for the key ignored (the default draws scales in
    [0.5, 2]) or for a scale drawn outside the configured range."""
    root, files = reader_data
    cfg = reader_config(tmp_path, root, crop_size=[24, 24], random_scale=[2.0, 2.0], random_mirror=False)
    reader = open_reader(cfg, "fit")
    for images, labels in stream(reader, 4, 2):
        for image, label in zip(images, labels):
            assert window_of(image, label, files, scale=2) is not None


def _hsv(rgb):
    """float RGB 0..255 [..., 3] -> (hue in [0, 1), saturation, value 0..255), by the textbook formulas."""
    mx, mn = rgb.max(-1), rgb.min(-1)
    delta = mx - mn
    s = np.where(mx > 0, delta / np.maximum(mx, 1e-9), 0.0)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    d = np.maximum(delta, 1e-9)
    h = np.where(mx == r, (g - b) / d, np.where(mx == g, 2.0 + (b - r) / d, 4.0 + (r - g) / d))
    return (h / 6.0) % 1.0, s, mx


def _amount(step: str, plain, jittered):
    """The amount one photometric step applied to one crop (float RGB 0..255), estimated by hand from the
    crop without and with the jitter, and whether the rest of the crop says it was that step alone."""
    p, j = plain.astype(np.float64), jittered.astype(np.float64)
    if step == "brightness":
        d = np.median((j - p)[(p > 40) & (p < 215)])
        return d, np.abs(np.clip(p + d, 0, 255) - j).max() < 0.05
    if step == "contrast":
        f = np.median((j / p)[(p > 30) & (p < 180)])
        return f - 1.0, np.abs(np.clip(p * f, 0, 255) - j).max() < 0.05
    hp, sp, vp = _hsv(p)
    hj, sj, vj = _hsv(j)
    coloured = (sp > 0.15) & (sp < 0.6) & (vp > 40)
    if step == "saturation":
        f = np.median((sj / np.maximum(sp, 1e-9))[coloured])
        return f - 1.0, np.abs(vj - vp).max() < 0.05 and np.abs(np.minimum(sp * f, 1.0) - sj)[coloured].max() < 0.01
    turn = ((hj - hp + 0.5) % 1.0 - 0.5)[coloured] * 180.0  # on the 0..180 hue scale
    d = np.median(turn)
    return d, np.abs(turn - d).max() < 0.5 and np.abs(vj - vp).max() < 0.05


@pytest.mark.parametrize("step, bound", [("brightness", 20.0), ("contrast", 0.3), ("saturation", 0.4), ("hue", 10.0)])
def test_photometric_runs_only_the_named_steps_within_their_amounts(tmp_path, reader_data, step, bound):
    """data.photometric {step: v}, one step at a time: against the same stream without the jitter (the crops
    do not move), each crop is either unchanged or changed by that step alone, with an amount estimated by hand
    in [-v, v] (brightness: added; contrast, saturation: the factor minus 1; hue: the turn on the 0..180 scale),
    about half of the crops, and amounts that reach well into the range. Fails for the key dropped (nothing
    changes), for another step's value or range used (mmsegmentation's 32 / 0.5 / 0.5 / 18 or the maximum), and
    for steps that run although not named."""
    root, files = reader_data
    keys = dict(crop_size=[24, 32], random_scale=[1.0, 1.0], random_mirror=False)
    plain = open_reader(reader_config(tmp_path / "plain", root, **keys), "fit")
    jitter = open_reader(reader_config(tmp_path / "jit", root, photometric={step: bound}, **keys), "fit")
    amounts = []
    for (a, la), (b, lb) in zip(stream(plain, 4, 8), stream(jitter, 4, 8)):
        np.testing.assert_array_equal(la, lb)
        for x, y in zip(a * np.float32(STD) + np.float32(MEAN), b * np.float32(STD) + np.float32(MEAN)):
            if np.abs(x - y).max() < 0.01:
                amounts.append(0.0)
                continue
            amount, alone = _amount(step, x, y)
            assert alone, f"{step}: the crop changed by more than one {step} step"
            amounts.append(amount)
    amounts = np.abs(np.array(amounts))
    applied = amounts > 0
    assert 0.25 < applied.mean() < 0.75, amounts
    assert amounts.max() <= bound * 1.01 + 0.02, amounts
    assert amounts.max() > 0.6 * bound, amounts


def test_label_options_map_the_raw_png_values_by_hand(tmp_path):
    """data.label_map, data.reduce_zero_label and data.binary_threshold on the files reader: the decoded labels
    and the training stream's labels (crops of the whole image) are the raw PNG values mapped by tables written
    out here. Fails for any of the three ignored between the config and the reader (raw values would reach
    training: out of range, so the sample fails, or other ids)."""
    cases = [
        ({"num_classes": 3, "label_map": {0: 255, 5: 0, 6: 1, 9: 2, 255: 255}}, [0, 5, 6, 9, 255],
         {0: 255, 5: 0, 6: 1, 9: 2, 255: 255}),
        ({"num_classes": 3, "reduce_zero_label": True}, [0, 1, 2, 3, 255], {0: 255, 1: 0, 2: 1, 3: 2, 255: 255}),
        ({"num_classes": 2, "binary_threshold": 100}, [0, 3, 99, 100, 180, 255],
         {0: 0, 3: 0, 99: 0, 100: 1, 180: 1, 255: 1}),
    ]
    for n, (keys, values, by_hand) in enumerate(cases):
        root = tmp_path / f"d{n}"
        files = write_split(root, "fit", [(16, 20)] * 3, values, seed=n)
        raw = {"data": {"root": str(root), "train_split": "fit", "crop_size": [16, 20], "random_scale": [1.0, 1.0],
                        "random_mirror": False, "num_parallel_calls": 2, **keys}, "model": TINY_MODEL}
        cfg = load_config(tmp_path / f"c{n}", raw)[1]
        reader = open_reader(cfg, "fit")
        mapped = [np.vectorize(by_hand.get)(label).astype(np.uint8) for _, label in files]
        for i, want in enumerate(mapped):
            np.testing.assert_array_equal(reader.decode(i)[1].numpy(), want, err_msg=str(keys))
        (_, labels), = stream(reader, 3, 1)  # one epoch: each file once
        assert sorted(next(i for i, m in enumerate(mapped) if np.array_equal(m, lb)) for lb in labels) == [0, 1, 2]


def _parallel_calls(ds) -> list[int]:
    """num_parallel_calls of every parallel map in a dataset's graph (tf.data's own serialisation)."""
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef()
    graph.ParseFromString(ds._as_serialized_graph().numpy())
    nodes = {n.name: n for n in graph.node}
    found = []
    for node in graph.node:
        if node.op.startswith("ParallelMapDataset"):
            const = nodes[node.input[1].split(":")[0]]
            found.append(int(tf.make_ndarray(const.attr["value"].tensor)))
    return found


def test_num_parallel_calls_reaches_the_tf_data_graph(tmp_path, reader_data):
    """data.num_parallel_calls 3: the training stream's and the evaluation's decode/augment maps run with 3
    parallel calls, as the dataset's serialised graph says. Fails for the key ignored (autotune, -1)."""
    root, _ = reader_data
    cfg = reader_config(tmp_path, root, crop_size=[24, 32], num_parallel_calls=3)
    reader = open_reader(cfg, "fit", seed=0)
    assert _parallel_calls(reader.train_dataset(4, 0, 1)) == [3]
    assert _parallel_calls(reader.eval_dataset()) == [3]


# ---- helpers of the runs: commands in-process, TensorBoard, inference by hand ---------------------------------
def command(main, argv) -> int:
    """A seg-train command run in-process (cli.*_main), the seg_train logger put back as it was afterwards."""
    log = logging.getLogger("seg_train")
    saved = log.handlers[:], log.propagate, log.level
    try:
        return main(argv)
    finally:
        log.handlers[:], log.propagate, log.level = saved


def events(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    return acc


def scalar(acc, tag: str, step: int) -> float:
    (value,) = [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag) if e.step == step]
    return value


def pictures(acc, tag: str, step: int) -> list[np.ndarray]:
    import io

    (event,) = [e for e in acc.Tensors(tag) if e.step == step]
    return [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in tf.make_ndarray(event.tensor_proto)[2:]]


def adjusted(probs: np.ndarray, weights, tau: float) -> np.ndarray:
    """Post-hoc logit adjustment by its definition: each class's probability divided by w_c ** tau, renormalised."""
    q = probs * np.asarray(weights, np.float64) ** -tau
    return q / q.sum(-1, keepdims=True)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def probabilities_by_hand(model, image: np.ndarray, mode: str = "whole", crop=None, stride=None, flip=False,
                          scales=(1.0,)) -> np.ndarray:
    """Class probabilities [h, w, C] of a uint8 image, each view computed with eager calls of the model: the image
    normalised with MEAN/STD; a forward pass pads to 32 at the bottom/right and crops back; slide: mmsegmentation's
    windows (last row/column moved back to the border), logits averaged over the windows holding a pixel; a scaled
    view resized there and back (bilinear); softmax per view, then the mean over the scales and flips."""
    x = normalised(image)
    h, w = x.shape[:2]

    def forward(t):
        th, tw = t.shape[:2]
        t = np.pad(t, [(0, -th % 32), (0, -tw % 32), (0, 0)])
        return model(t[None], training=False).numpy()[0, :th, :tw]

    def windows(t):
        th, tw = t.shape[:2]
        (ch, cw), (sh, sw) = crop, stride
        total, count = None, np.zeros((th, tw, 1), np.float32)
        for r in range(max(th - ch + sh - 1, 0) // sh + 1):
            for c in range(max(tw - cw + sw - 1, 0) // sw + 1):
                y2, x2 = min(r * sh + ch, th), min(c * sw + cw, tw)
                y1, x1 = max(y2 - ch, 0), max(x2 - cw, 0)
                logits = forward(t[y1:y2, x1:x2])
                if total is None:
                    total = np.zeros((th, tw, logits.shape[-1]), np.float32)
                total[y1:y2, x1:x2] += logits
                count[y1:y2, x1:x2] += 1
        return total / count

    def view(t, s):
        if s != 1.0:
            t = tf.image.resize(t, [max(1, round(h * s)), max(1, round(w * s))]).numpy()
        logits = windows(t) if mode == "slide" else forward(t)
        return logits if s == 1.0 else tf.image.resize(logits, [h, w]).numpy()

    probs = []
    for s in scales:
        probs.append(softmax(view(x, s).astype(np.float64)))
        if flip:
            probs.append(softmax(view(np.ascontiguousarray(x[:, ::-1]), s).astype(np.float64))[:, ::-1])
    return np.mean(probs, axis=0)


def confusion_by_hand(labels, preds, num_classes: int, ignore: int) -> np.ndarray:
    cm = np.zeros((num_classes, num_classes), np.int64)
    for label, pred in zip(labels, preds):
        keep = label != ignore
        np.add.at(cm, (label[keep], pred[keep]), 1)
    return cm


def miou_by_hand(cm: np.ndarray) -> tuple[float, list]:
    ious = []
    for c in range(len(cm)):
        union = cm[c].sum() + cm[:, c].sum() - cm[c, c]
        ious.append(cm[c, c] / union if union else None)
    return float(np.mean([i for i in ious if i is not None])), ious


# ---- seg-train: one short run on 2 towers ---------------------------------------------------------------------
HOLDOUT = [(37, 45), (30, 41), (35, 38)]
WEIGHTS, TAU = [2.0, 1.0, 1.3], 0.7  # loss.class_weights, eval.logit_adjustment


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """seg-train --gpus 2, 2 steps, every data key that training reads at a non-default value, an evaluation at
    the end on the val split with a flip and the logit adjustment."""
    tmp = tmp_path_factory.mktemp("wiring_train")
    root = tmp / "data"
    fit = write_split(root, "fit", SIZES, [0, 1, 2, IGNORE], seed=4)
    holdout = write_split(root, "holdout", HOLDOUT, [0, 1, 2, IGNORE], seed=5)
    raw = {"seed": 2, "run_dir": str(tmp / "run"),
           "data": {"root": str(root), "train_split": "fit", "val_split": "holdout", "num_classes": 3,
                    "ignore_label": IGNORE, "class_names": NAMES, "batch_size": 4, "crop_size": [24, 40],
                    "random_scale": [1.0, 1.0], "random_mirror": False, "mean": list(MEAN), "std": list(STD),
                    "num_parallel_calls": 2},
           # bn_momentum 0: the moving statistics are the last batch's, so the model evaluated predicts classes
           # that differ across the image (a model predicting one class everywhere would prove little).
           "model": {**TINY_MODEL, "bn_momentum": 0.0},
           "loss": {"class_weights": WEIGHTS},
           "train": {"num_steps": 2, "learning_rate": 0.01, "summary_every": 1, "image_summary_every": 1,
                     "checkpoint_every": 2},
           "eval": {"bn_reestimate_batches": 1, "flip": True, "logit_adjustment": TAU}}
    path, cfg = load_config(tmp, raw)
    assert command(cli.train_main, ["--config", str(path), "--gpus", "2"]) == 0
    return {"cfg": cfg, "run": tmp / "run", "fit": fit, "holdout": holdout}


def test_step_1_tower_losses_are_the_losses_of_the_configured_batch_by_hand(trained):
    """loss/tower_0 and loss/tower_1 of step 1 (TensorBoard) are the class-weighted cross-entropies, by hand, of
    the initial model on rows 0-1 and 2-3 of the first global batch of 4 (data.batch_size) of the 'fit' split
    (data.train_split), pixels labelled 200 (data.ignore_label) left out. Fails for data.batch_size ignored or
    read as the per-tower batch (other rows per tower), data.ignore_label not reaching the loss (pixels of 200
    counted: no such class), data.train_split ignored (no 'train' split: the run fails)."""
    from seg_train import models

    cfg, fit = trained["cfg"], trained["fit"]
    (images, labels), = stream(open_reader(cfg, "fit"), 4, 1)
    for image, label in zip(images, labels):
        assert window_of(image, label, fit) is not None  # the crops the test expects (normalised by hand)
    model = models.build(cfg.model, 3, 2)  # the run's initial weights: built from the seed
    acc = events(trained["run"])
    for tower in (0, 1):
        rows = slice(2 * tower, 2 * tower + 2)
        logits = model(images[rows], training=True).numpy().astype(np.float64)  # BN: the tower's own batch
        label = labels[rows].astype(np.int64)
        valid = label != IGNORE
        log_p = np.log(softmax(logits))
        ce = -np.take_along_axis(log_p, np.where(valid, label, 0)[..., None], -1)[..., 0]
        w = np.where(valid, np.asarray(WEIGHTS)[np.where(valid, label, 0)], 0.0)
        want = (w * ce).sum() / w.sum()
        assert scalar(acc, f"loss/tower_{tower}", 1) == pytest.approx(want, rel=2e-4), tower
    assert valid.mean() < 0.9  # the ignored pixels are really there


def test_tensorboard_pictures_show_each_towers_rows_denormalised(trained):
    """tower_<i>/image at step 1 is rows 2i, 2i+1 of the global batch in the file's own colours (data.mean /
    data.std undone), and tower_<i>/label draws the pixels of data.ignore_label (200) white. Fails for the
    summaries' mean/std or ignore label left at their defaults, or another per-tower batch."""
    cfg, fit = trained["cfg"], trained["fit"]
    (images, labels), = stream(open_reader(cfg, "fit"), 4, 1)
    acc = events(trained["run"])
    for tower in (0, 1):
        shown, drawn = pictures(acc, f"tower_{tower}/image", 1), pictures(acc, f"tower_{tower}/label", 1)
        assert len(shown) == len(drawn) == 2
        for k in range(2):
            image, label = images[2 * tower + k], labels[2 * tower + k]
            i, y, x = window_of(image, label, fit)
            file_image = fit[i][0][y:y + 24, x:x + 40].astype(int)
            width = file_image.shape[1]
            assert np.abs(shown[k][:, :width].astype(int) - file_image).max() <= 1
            assert np.abs(shown[k][:, width:].astype(int) - np.array(MEAN)).max() <= 1  # the padding: mean colour
            white = (drawn[k] == 255).all(-1)
            np.testing.assert_array_equal(white, label == IGNORE)


def test_evaluation_during_training_reads_the_val_split_under_the_class_names(trained):
    """The evaluation at the end of the run: eval/iou/<name> for data.class_names, and eval/miou equal to the mIoU
    by hand of the evaluated weights (the step-2 checkpoint, written after the evaluation) on the 'holdout' split
    (data.val_split), each image predicted with eval.flip and eval.logit_adjustment (probabilities divided by
    the loss's weights ** 0.7), pixels of 200 left out. Fails for the val split or the class names ignored, or
    the evaluation during training without the flip or the adjustment."""
    from seg_train.infer.load import load_state

    cfg, holdout = trained["cfg"], trained["holdout"]
    acc = events(trained["run"])
    tags = set(acc.Tags()["tensors"])
    assert {f"eval/iou/{n}" for n in NAMES} <= tags and not [t for t in tags if t.startswith("eval/iou/class")]
    state, _, _ = load_state(cfg, tf.distribute.MirroredStrategy(["/device:CPU:0"]), str(trained["run"]))
    preds, plain = [], []
    for image, _ in holdout:
        probs = probabilities_by_hand(state.model, image, flip=True)
        preds.append(adjusted(probs, WEIGHTS, TAU).argmax(-1))
        plain.append(probabilities_by_hand(state.model, image).argmax(-1))
    labels = [label for _, label in holdout]
    cm = confusion_by_hand(labels, preds, 3, IGNORE)
    miou, ious = miou_by_hand(cm)
    assert scalar(acc, "eval/miou", 2) == pytest.approx(miou, abs=1e-6)
    for name, iou in zip(NAMES, ious):
        assert scalar(acc, f"eval/iou/{name}", 2) == pytest.approx(iou, abs=1e-6), name
    # The keys change the answer here: the plain prediction gives another matrix; several classes are predicted.
    assert not np.array_equal(confusion_by_hand(labels, plain, 3, IGNORE), cm)
    assert (cm.sum(axis=0) > 50).sum() >= 2, cm


# ---- seg-eval, seg-predict, seg-export on one checkpoint ----------------------------------------------------
CHECK = [(37, 53), (29, 70), (45, 33)]  # the val split: not multiples of 32, nor of the window or stride
SLIDE = {"mode": "slide", "crop_size": [24, 32], "stride": [16, 20], "flip": True, "scales": [1.0, 1.25],
         "logit_adjustment": TAU}
SERVED_IGNORE = 0  # a class index: only an evaluation that reads data.ignore_label leaves these pixels out


def classes_by_hand(model, image) -> np.ndarray:
    """What the SLIDE modes predict, by hand: windows 24x32 every 16x20, flipped and at scale 1.25 too, the mean
    probabilities divided by the loss's weights ** 0.7."""
    probs = probabilities_by_hand(model, image, "slide", (24, 32), (16, 20), flip=True, scales=(1.0, 1.25))
    return adjusted(probs, WEIGHTS, TAU).argmax(-1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A checkpoint (step 5, BN statistics of the data but not marked re-estimated) and a config whose data and
    eval keys are all non-default: the val split 'check', ignore label 0, class names, mean/std, the SLIDE modes."""
    from seg_train.run import checkpoint as ckpt_lib
    from seg_train.run.state import TrainState

    tmp = tmp_path_factory.mktemp("wiring_served")
    root = tmp / "data"
    fit = write_split(root, "fit", SIZES, [0, 1, 2], seed=6)
    check = write_split(root, "check", CHECK, [0, 1, 2], seed=7)
    raw = {"seed": 0, "run_dir": str(tmp / "run"),
           "data": {"root": str(root), "train_split": "fit", "val_split": "check", "num_classes": 3,
                    "ignore_label": SERVED_IGNORE, "class_names": NAMES, "batch_size": 6, "crop_size": [24, 24],
                    "mean": list(MEAN), "std": list(STD), "num_parallel_calls": 2},
           "model": TINY_MODEL, "loss": {"class_weights": WEIGHTS},
           "eval": {"bn_reestimate_batches": 0, **SLIDE}}
    path, cfg = load_config(tmp, raw)
    state = TrainState(cfg, tf.distribute.MirroredStrategy(["/device:CPU:0"]))
    x = normalised(np.stack([image[:32, :36] for image, _ in fit]))
    for _ in range(20):  # BN statistics of these images: the model then predicts several classes
        state.model(x, training=True)
    state.step.assign(5)
    ckpt_lib.Checkpointer(tmp / "run" / "checkpoints", 1, **state.checkpoint_objects()).save(5)
    want = [classes_by_hand(state.model, image) for image, _ in check]
    return {"tmp": tmp, "root": root, "path": path, "cfg": cfg, "model": state.model, "fit": fit, "check": check,
            "want": want}


def test_seg_eval_counts_what_the_modes_give_by_hand(served):
    """seg-eval (the default split: data.val_split 'check') counts, pixel by pixel, the classes by hand of the
    SLIDE modes, leaves out the pixels of label 0 (data.ignore_label), names the classes data.class_names,
    normalises with data.mean / data.std and uses the weights as saved (eval.bn_reestimate_batches 0). Fails for
    any of eval.mode, crop_size, stride, flip, scales, logit_adjustment, or these data keys, ignored."""
    run = served["tmp"] / "run"
    assert command(cli.eval_main, ["--config", str(served["path"]), "--checkpoint", str(run)]) == 0
    record = json.loads((run / "eval" / "check-step5.json").read_text())
    labels = [label for _, label in served["check"]]
    cm = confusion_by_hand(labels, served["want"], 3, SERVED_IGNORE)
    assert (record["split"], record["num_images"], record["bn_stats_reestimated"]) == ("check", 3, False)
    assert list(record["per_class_iou"]) == NAMES
    np.testing.assert_array_equal(np.array(record["confusion_matrix"]), cm)
    assert cm[SERVED_IGNORE].sum() == 0 and cm.sum() == sum(int((lb != SERVED_IGNORE).sum()) for lb in labels)
    assert record["inference"] == {"mode": "slide", "flip": True, "scales": [1.0, 1.25], "crop_size": [24, 32],
                                   "stride": [16, 20], "logit_adjustment": TAU}
    # Not vacuous: one whole-image pass predicts other classes; several classes are predicted.
    whole = [probabilities_by_hand(served["model"], image).argmax(-1) for image, _ in served["check"]]
    assert not np.array_equal(confusion_by_hand(labels, whole, 3, SERVED_IGNORE), cm)
    assert (cm.sum(axis=0) > 100).sum() >= 2, cm


def test_seg_predict_writes_the_classes_by_hand(served):
    """seg-predict's class PNGs are the classes by hand of the SLIDE modes on the images normalised with MEAN/STD.
    Fails for seg-predict dropping data.mean / data.std or an eval key on the way to its model."""
    out = served["tmp"] / "pred"
    inputs = [str(served["root"] / "img" / f"check{i}.png") for i in range(len(CHECK))]
    assert command(cli.predict_main, ["--config", str(served["path"]), "--checkpoint", str(served["tmp"] / "run"),
                                      "--output", str(out), *inputs]) == 0
    for i, want in enumerate(served["want"]):
        np.testing.assert_array_equal(np.array(Image.open(out / f"check{i}.png")), want)


def test_seg_export_serves_the_classes_by_hand(served):
    """The SavedModel of seg-export (loaded with TensorFlow alone) predicts the classes by hand of the SLIDE modes
    from uint8 images, and its seg_train.json gives the configured mean/std and modes. Fails for seg-export
    dropping data.mean / data.std or an eval key."""
    out = served["tmp"] / "model"
    assert command(cli.export_main, ["--config", str(served["path"]), "--checkpoint", str(served["tmp"] / "run"),
                                     "--output", str(out)]) == 0
    serve = tf.saved_model.load(str(out)).signatures["serving_default"]
    for (image, _), want in zip(served["check"], served["want"]):
        np.testing.assert_array_equal(serve(image=tf.constant(image))["classes"].numpy(), want)
    meta = json.loads((out / "seg_train.json").read_text())
    assert (meta["mean"], meta["std"], meta["class_names"]) == (list(MEAN), list(STD), NAMES)
    assert meta["inference"] == {"mode": "slide", "flip": True, "scales": [1.0, 1.25], "crop_size": [24, 32],
                                 "stride": [16, 20], "logit_adjustment": TAU}  # seg-eval's record's, key by key


def test_tflite_export_and_its_evaluation_read_the_eval_window_and_the_ignore_label(served):
    """seg-export --format tflite without --input-size takes eval.crop_size (24 x 32, not data.crop_size); seg-eval
    --model evaluates the 'check' split (data.val_split) in LiteRT and leaves out the pixels of label 0
    (data.ignore_label): exactly the other labelled pixels are counted, under data.class_names. Fails for the
    window, the split or the ignore label ignored on the LiteRT path."""
    pytest.importorskip("ai_edge_litert")
    model = served["tmp"] / "lite" / "m.tflite"
    assert command(cli.export_main, ["--config", str(served["path"]), "--checkpoint", str(served["tmp"] / "run"),
                                     "--format", "tflite", "--output", str(model)]) == 0
    assert json.loads(model.with_suffix(".json").read_text())["input_size"] == [24, 32]
    assert command(cli.eval_main, ["--config", str(served["path"]), "--model", str(model)]) == 0
    record = json.loads((model.parent / "m.eval-check.json").read_text())
    cm = np.array(record["confusion_matrix"])
    labels = [label for _, label in served["check"]]
    assert cm[SERVED_IGNORE].sum() == 0 and cm.sum() == sum(int((lb != SERVED_IGNORE).sum()) for lb in labels)
    assert list(record["per_class_iou"]) == NAMES and record["num_images"] == len(CHECK)

def test_bn_reestimation_reads_the_configured_batches(served):
    """seg-export with eval.bn_reestimate_batches 2: the exported first BN layer's moving statistics are the
    population mean and variance, by hand (numpy on tf.nn.conv2d with the stem kernel), of its input over 2
    global batches of 6 (data.batch_size) training crops of the 'fit' split (data.train_split), at the fixed far
    window of the stream where re-estimation reads. Fails for the number of batches, the batch size or the train
    split ignored on the way to the re-estimation (other images, or none: the statistics as saved)."""
    from seg_train.infer import precise_bn

    out = served["tmp"] / "model_bn"
    assert command(cli.export_main, ["--config", str(served["path"]), "--checkpoint", str(served["tmp"] / "run"),
                                     "--output", str(out), "--set", "eval.bn_reestimate_batches=2",
                                     "--set", "eval.mode=whole"]) == 0
    loaded = tf.saved_model.load(str(out))  # held: its variables live as long as it does
    exported = {v.name: v.numpy() for v in loaded.signatures["serving_default"].variables}
    cfg = served["cfg"]
    batches = open_reader(cfg, "fit").train_dataset(6, precise_bn.stream_start_step(6), 1).take(2)
    kernel = served["model"].get_layer("tiny").get_layer("stem_conv").kernel.numpy()  # as saved: no training
    np.testing.assert_array_equal(exported["stem_conv/kernel:0"], kernel)
    features = [tf.nn.conv2d(images, kernel, strides=2, padding="SAME").numpy().reshape(-1, kernel.shape[-1])
                for images, _ in batches]
    assert sum(len(f) for f in features) == 2 * 6 * 12 * 12  # 2 batches of 6 crops of 24 x 24, stride 2
    x = np.concatenate(features).astype(np.float64)
    np.testing.assert_allclose(exported["stem_bn/moving_mean:0"], x.mean(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(exported["stem_bn/moving_variance:0"], x.var(0), rtol=1e-4, atol=1e-5)


# ---- data.synthetic ------------------------------------------------------------------------------------------
def test_synthetic_data_set_generated_where_the_config_says(tmp_path, capsys):
    """data.synthetic: true with data.root a folder that does not exist yet: seg-train --check-data generates the
    demo set there (a VOC tree of labelled images, classes.txt with data.num_classes names) and scans every
    sample of it. Fails for the key ignored (nothing generated: 'data root not found')."""
    root = tmp_path / "demo"
    path, _ = load_config(tmp_path, {"data": {"root": str(root), "synthetic": True, "num_classes": 4},
                                     "model": TINY_MODEL})
    assert command(cli.train_main, ["--config", str(path), "--check-data"]) == 0
    ids = (root / "ImageSets" / "Segmentation" / "train.txt").read_text().split()
    assert f"split train: {len(ids)} samples, 0 bad" in capsys.readouterr().out and len(ids) >= 10
    assert len((root / "classes.txt").read_text().split()) == 4
    values = set(np.unique(np.array(Image.open(root / "SegmentationClass" / f"{ids[0]}.png"))).tolist())
    assert values <= {0, 1, 2, 3, 255} and len(values - {255}) >= 2
