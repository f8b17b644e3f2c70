"""JPEG labels of every header kind are refused: a JPEG is recognised by its start-of-image marker followed
by any marker, not by the JFIF header Pillow happens to write. Cameras and editors write Exif (APP1) first,
Adobe's tools and CMYK writers APP14, some encoders nothing between the start of image and the quantisation
table, and progressive files are as common as baseline ones. Each kind is written here (Pillow, then the
header bytes edited), checked to be a JPEG that Pillow and TensorFlow decode to damaged but in-range class
values, and then refused with the one-line message in a VOC folder, a pairs list and DeepLab-keyed TFRecords.

Wrong answers these catch: a signature check that knows only JFIF (APP0) or a list of APPn markers, so an Exif,
Adobe or marker-less JPEG label decodes as 'L' and trains on its damaged values.
"""

import io
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train import cli
from seg_train.data import decode
from seg_train.data.label_images import LossyLabel, read_label
from tests.helpers import LOSSY_MESSAGE as MESSAGE
from tests.helpers import LOSSY_NUM_CLASSES as NUM_CLASSES
from tests.helpers import deeplab_example, encoded, label_array
from tests.helpers import lossy_photo as photo
from tests.helpers import write_lossy_config as write_config

SOI = b"\xff\xd8"


def _without_app0(data: bytes) -> bytes:
    """The file without Pillow's JFIF APP0 segment (the one right after the start of image)."""
    assert data[2:4] == b"\xff\xe0" and data[6:11] == b"JFIF\x00"
    return SOI + data[4 + int.from_bytes(data[4:6], "big"):]


def jfif(seed):
    return encoded(label_array(seed), "JPEG", quality=75)


def exif(seed):  # APP1 "Exif" first (Pillow writes it after its JFIF APP0, which is dropped)
    exif_data = Image.Exif()
    exif_data[0x010F] = "camera"  # Make
    return _without_app0(encoded(label_array(seed), "JPEG", quality=75, exif=exif_data))


def adobe(seed):  # APP14 "Adobe" (version 100, no flags, transform 0: no colour conversion) in JFIF's place
    app14 = b"\xff\xee" + (14).to_bytes(2, "big") + b"Adobe" + bytes([0, 100, 0, 0, 0, 0, 0])
    rest = _without_app0(jfif(seed))[2:]
    return SOI + app14 + rest


def markerless(seed):  # SOI directly followed by DQT
    return _without_app0(jfif(seed))


def progressive(seed):
    return encoded(label_array(seed), "JPEG", quality=75, progressive=True)


KINDS = {"jfif": jfif, "exif": exif, "adobe": adobe, "markerless": markerless, "progressive": progressive}
SECOND_MARKER = {"jfif": b"\xff\xe0", "exif": b"\xff\xe1", "adobe": b"\xff\xee", "markerless": b"\xff\xdb",
                 "progressive": b"\xff\xe0"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_is_a_jpeg_that_damages_the_classes(kind):
    data = KINDS[kind](1)
    assert data[:4] == SOI + SECOND_MARKER[kind]
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "JPEG" and im.mode == "L"
        assert bool(im.info.get("progressive")) == (kind == "progressive")
        damaged = np.asarray(im)
    assert (damaged != label_array(1)).mean() > 0.3 and damaged.max() < NUM_CLASSES
    np.testing.assert_array_equal(tf.io.decode_jpeg(data).numpy()[..., 0].shape, damaged.shape)


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_is_refused_by_pillows_and_the_graphs_decoder(kind, tmp_path):
    path = tmp_path / "label.png"
    path.write_bytes(KINDS[kind](2))
    with pytest.raises(LossyLabel, match=re.escape(MESSAGE.format(path=path))):
        read_label(path)
    with pytest.raises((LossyLabel, tf.errors.OpError), match="lossy JPEG label"):
        decode.decode_label(tf.io.read_file(str(path))).numpy()


def _voc(root: Path) -> list[str]:
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True)
    names = ["s0", *KINDS]
    for n, name in enumerate(names):
        (root / "JPEGImages" / f"{name}.jpg").write_bytes(photo(n))
        label = KINDS[name](n) if name in KINDS else encoded(label_array(n), "PNG")
        (root / "SegmentationClass" / f"{name}.png").write_bytes(label)
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("\n".join(names) + "\n")
    return [str(root / "SegmentationClass" / f"{k}.png") for k in KINDS]


def _pairs(root: Path) -> list[str]:
    (root / "photos").mkdir(parents=True)
    (root / "masks").mkdir()
    names, lines = ["p0", *KINDS], []
    for n, name in enumerate(names):
        (root / "photos" / f"{name}.jpg").write_bytes(photo(n))
        mask = f"{name}.jpg" if name in KINDS else f"{name}.png"
        (root / "masks" / mask).write_bytes(KINDS[name](n) if name in KINDS else encoded(label_array(n), "PNG"))
        lines.append(f"photos/{name}.jpg masks/{mask}")
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    return [str(root / "masks" / f"{k}.jpg") for k in KINDS]


def _records(root: Path) -> list[str]:
    root.mkdir(parents=True)
    shard = root / "train-00000-of-00001.tfrecord"
    with tf.io.TFRecordWriter(str(shard)) as w:
        w.write(deeplab_example(photo(0), encoded(label_array(0), "PNG"), b"png", "r0.jpg"))
        for n, kind in enumerate(KINDS, 1):
            w.write(deeplab_example(photo(n), KINDS[kind](n), b"png", f"{kind}.jpg"))  # said to be PNG
    return [f"{shard}[{shard.name}:{n}]" for n in range(1, len(KINDS) + 1)]


LAYOUTS = {"voc": _voc, "pairs": _pairs, "tfrecord": _records}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_check_data_refuses_every_kind_in_one_line(layout, tmp_path, capsys):
    root = tmp_path / "data"
    bad = LAYOUTS[layout](root)
    assert cli.train_main(["--config", str(write_config(tmp_path, layout, root)), "--check-data"]) == 2
    out, err = capsys.readouterr()
    listed = [line[len("bad: "):] for line in out.splitlines() if line.startswith("bad: ")]
    assert listed == [MESSAGE.format(path=p) for p in bad], out
    n = len(KINDS)
    assert f"{n + 1} samples, {n} bad" in out, out
    assert err.strip().splitlines()[-1] == (f"error: {n} bad sample(s) ({root}): see the list above, "
                                            f"{n} of them lossy JPEG labels (convert those to PNG)"), err
