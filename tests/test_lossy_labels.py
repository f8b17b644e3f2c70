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
from PIL import Image

from seg_train import cli
from seg_train.cli import user_error
from seg_train.data import decode, records
from seg_train.data.label_images import LossyLabel, read_label
from tests.helpers import LOSSY_H as H
from tests.helpers import LOSSY_KINDS as KINDS
from tests.helpers import LOSSY_MESSAGE as MESSAGE
from tests.helpers import LOSSY_NUM_CLASSES as NUM_CLASSES
from tests.helpers import LOSSY_W as W
from tests.helpers import encoded, jpeg_label, label_array, open_reader
from tests.helpers import write_lossy_config as write_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

ROOT = Path(__file__).resolve().parent.parent


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
