"""JPEG labels are refused, found by their bytes whatever the file name, the split list or a
TFRecord's `image/segmentation/class/format` feature says: in a VOC folder (a `.png` name holding a
JPEG), in a `pairs` list naming `.jpg` labels, and in TFRecords written by hand under DeepLab's feature
keys (build_data.py's image_seg_to_tfexample), not by the project's writer.

The labels are made so that JPEG damages them (numpy counts the changed pixels) while every damaged
value stays a valid class: no other check (range, label map) can catch them, only the JPEG check.

Fails for: a JPEG label decoded and trained on by any path (the pre-training scan and --check-data,
the training stream's TensorFlow decode, data.cache, the evaluation stream, seg-prepare tfrecords), a
message that does not say JPEG / lossy / convert to PNG or does not name the file, --check-data or
the skip log not counting them, and a skip that does not leave a run that trains.
"""

import io
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml
from PIL import Image

from seg_train import cli
from seg_train.cli import user_error
from seg_train.data import decode, records
from seg_train.data.label_images import LossyLabel, read_label
from tests.helpers import open_reader

ROOT = Path(__file__).resolve().parent.parent
NUM_CLASSES = 20
H, W = 32, 40
MESSAGE = ("lossy JPEG label ({path}): expected a PNG of class indices (JPEG compression damages the class "
           "values); convert the label to PNG, from its source annotation if you have it")


def label_array(seed: int) -> np.ndarray:
    """6x6 blocks of classes 5..14 (not JPEG's 8x8 grid, which would keep flat blocks exact): JPEG changes
    most pixels, by a few levels, within 0..19 (checked in `sets`)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(5, 15, (H // 6 + 1, W // 6 + 1), dtype=np.uint8)
    return np.repeat(np.repeat(b, 6, 0), 6, 1)[:H, :W]


def encoded(array: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **kw)
    return buf.getvalue()


def photo(seed: int) -> bytes:
    rng = np.random.default_rng(100 + seed)
    return encoded(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), "JPEG", quality=90)


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
        "image/height": i(H), "image/width": i(W), "image/channels": i(3),
        "image/segmentation/class/encoded": b(label), "image/segmentation/class/format": b(label_format),
    })).SerializeToString()


def make_voc(root: Path) -> list[str]:
    """4 samples; s1's SegmentationClass/s1.png holds a JPEG. Returns the bad label paths."""
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True)
    for n in range(4):
        (root / "JPEGImages" / f"s{n}.jpg").write_bytes(photo(n))
        label = jpeg_label(n) if n == 1 else encoded(label_array(n), "PNG")
        (root / "SegmentationClass" / f"s{n}.png").write_bytes(label)
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("s0\ns1\ns2\ns3\n")
    return [str(root / "SegmentationClass" / "s1.png")]


def make_pairs(root: Path) -> list[str]:
    """A pairs list of 4 samples naming masks/p1.jpg and masks/p2.jpg (JPEGs) among PNG masks."""
    (root / "photos").mkdir(parents=True)
    (root / "masks").mkdir()
    lines, bad = [], []
    for n in range(4):
        (root / "photos" / f"p{n}.jpg").write_bytes(photo(n))
        name = f"p{n}.jpg" if n in (1, 2) else f"p{n}.png"
        (root / "masks" / name).write_bytes(jpeg_label(n) if n in (1, 2) else encoded(label_array(n), "PNG"))
        lines.append(f"photos/p{n}.jpg masks/{name}")
        if n in (1, 2):
            bad.append(str(root / "masks" / name))
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    return bad


def make_records(root: Path) -> list[str]:
    """One shard of DeepLab-keyed records, no index file: record 1 a JPEG label said to be 'jpeg', record 2
    a JPEG label said to be 'png', record 3 a PNG label said to be 'jpeg' (usable: the bytes decide)."""
    root.mkdir(parents=True)
    shard = root / "train-00000-of-00001.tfrecord"
    kinds = [(False, b"png"), (True, b"jpeg"), (True, b"png"), (False, b"jpeg")]
    with tf.io.TFRecordWriter(str(shard)) as w:
        for n, (is_jpeg, fmt) in enumerate(kinds):
            label = jpeg_label(n) if is_jpeg else encoded(label_array(n), "PNG")
            w.write(deeplab_example(photo(n), label, fmt, f"r{n}.jpg"))
    return [f"{shard}[{shard.name}:{n}]" for n in (1, 2)]


KINDS = {"voc": make_voc, "pairs": make_pairs, "tfrecord": make_records}


def write_config(directory: Path, kind: str, root: Path, **data) -> Path:
    raw = {"seed": 0, "run_dir": "run",
           "data": {"root": str(root), "num_classes": NUM_CLASSES, "train_split": "train", "val_split": "none",
                    "batch_size": 2, "crop_size": [H, W], "random_scale": [1.0, 1.0], "num_parallel_calls": 2,
                    **({"layout": "pairs", "train_split": "train.txt"} if kind == "pairs" else {}),
                    **({"format": "tfrecord"} if kind == "tfrecord" else {}), **data},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4},
           "train": {"num_steps": 1, "checkpoint_every": 1, "summary_every": 1, "image_summary_every": 0},
           "eval": {"bn_reestimate_batches": 0}}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{kind}-{'-'.join(f'{k}={v}' for k, v in data.items()) or 'default'}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """{kind: (data root, the bad labels as messages name them)}."""
    base = tmp_path_factory.mktemp("lossy")
    out = {kind: (base / kind, make(base / kind)) for kind, make in KINDS.items()}
    # The premise: JPEG damages these labels, and every damaged value is still a class (numpy, by hand).
    for n in range(4):
        with Image.open(io.BytesIO(jpeg_label(n))) as im:
            assert im.mode == "L"
            damaged = np.asarray(im)
        assert (damaged != label_array(n)).mean() > 0.3, n
        assert damaged.max() < NUM_CLASSES, n
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_check_data_names_and_counts_jpeg_labels(sets, kind, tmp_path, capsys):
    root, bad = sets[kind]
    assert cli.train_main(["--config", str(write_config(tmp_path, kind, root)), "--check-data"]) == 2
    out, err = capsys.readouterr()
    listed = [line[len("bad: "):] for line in out.splitlines() if line.startswith("bad: ")]
    assert listed == [MESSAGE.format(path=p) for p in bad], out
    assert f"\nlossy JPEG labels: {len(bad)} (their samples are bad: convert those labels to PNG)\n" in out, out
    assert f"4 samples, {len(bad)} bad" in out, out
    assert err.strip().splitlines()[-1] == (f"error: {len(bad)} bad sample(s) ({root}): see the list above, "
                                            f"{len(bad)} of them lossy JPEG labels (convert those to PNG)"), err


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("cache", [False, True], ids=["tf-decode", "data-cache"])
def test_streams_refuse_jpeg_labels(sets, kind, cache, tmp_path):
    """Training and evaluation streams without a scan before them (as seg-eval reads val): TensorFlow's
    decoders (whose label path must not decode a JPEG) and data.cache's Pillow path both stop, naming it."""
    root, bad = sets[kind]
    from seg_train import config as config_lib

    cfg = config_lib.load(write_config(tmp_path, kind, root, cache=cache))
    reader = open_reader(cfg, cfg.data.train_split)
    with pytest.raises(tf.errors.OpError) as info:
        list(reader.train_dataset(4, 0, 1, end_step=1).as_numpy_iterator())  # one batch: the whole split
    assert user_error(info.value) in [MESSAGE.format(path=p) for p in bad]
    with pytest.raises(tf.errors.OpError) as info:
        list(reader.eval_dataset().as_numpy_iterator())
    assert user_error(info.value) == MESSAGE.format(path=bad[0])


@pytest.mark.parametrize("kind", list(KINDS))
def test_skip_drops_jpeg_labels_and_trains(sets, kind, tmp_path, capsys):
    root, bad = sets[kind]
    path = write_config(tmp_path, kind, root, on_bad_sample="skip")
    assert cli.train_main(["--config", str(path), "--gpus", "1"]) == 0
    err = capsys.readouterr().err
    for p in bad:
        assert f"W skipping bad sample (data.on_bad_sample: skip): {MESSAGE.format(path=p)}\n" in err, err
    n = len(bad)
    assert re.search(rf"I checked 4 train \(train(\.txt)?\) samples in [0-9.]+s: {n} bad \({n} lossy JPEG labels\)",
                     err), err
    assert re.search(rf"W train \(train(\.txt)?\): {n} bad samples of 4 skipped \(data\.on_bad_sample: skip\), "
                     rf"{n} of them lossy JPEG labels", err), err
    assert re.search(rf"I training deeplabv3plus_tiny on 1 tower\(s\): {4 - n} images", err), err
    assert "I done: step 1" in err, err
    assert tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints")).endswith("ckpt-1")


def test_decoders_refuse_jpeg_bytes_whatever_the_name(sets, tmp_path):
    """Each decoder on its own: Pillow's read_label (a path or bytes), TensorFlow's in-graph decode_label,
    and seg-prepare tfrecords' writer; a colour JPEG label is called a JPEG, not a colour label; a JPEG image
    (not a label) is still an image."""
    root, (bad,) = sets["voc"]
    with pytest.raises(LossyLabel, match=re.escape(MESSAGE.format(path=bad))):
        read_label(bad)
    with pytest.raises(LossyLabel, match=re.escape(MESSAGE.format(path="x.png"))):
        read_label(io.BytesIO(Path(bad).read_bytes()), name="x.png")
    colour = tmp_path / "colour.png"
    colour.write_bytes(encoded(np.zeros((H, W, 3), np.uint8), "JPEG"))
    with pytest.raises(LossyLabel):
        read_label(colour)
    # In the graph: eagerly the Pillow branch's error arrives as Python's; in tf.data's graph, an OpError.
    with pytest.raises((LossyLabel, tf.errors.OpError), match="lossy JPEG label"):
        decode.decode_label(tf.io.read_file(bad)).numpy()
    assert decode.decode_image(tf.io.read_file(str(root / "JPEGImages" / "s1.jpg"))).shape == (H, W, 3)
    with pytest.raises(LossyLabel, match=re.escape(MESSAGE.format(path=bad))):
        records.encode_sample(str(root / "JPEGImages" / "s1.jpg"), bad, "s1")


def test_prepare_tfrecords_refuses_a_jpeg_label_in_one_line(sets, tmp_path, capsys):
    root, (bad,) = sets["voc"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  root: {root}\n  num_classes: {NUM_CLASSES}\n")
    assert cli.prepare_main(["tfrecords", "--config", str(cfg), "--split", "train", "--output",
                             str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {MESSAGE.format(path=bad)}"
