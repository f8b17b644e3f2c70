"""TFRecord shards: seg-prepare tfrecords' writer, the record index, and reading records by offset.

Outside references: TensorFlow's own TFRecordDataset (the records in file order), Pillow (the label
indices), and shards written by hand with tf.io.TFRecordWriter under Model Garden's feature names
(an independent writer: no index file, only the two required features).
"""

import io
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train.data import records
from seg_train.data.label_images import read_label, save_index_png, voc_colormap
from tests.helpers import LAYOUT_SPLITS as SPLITS  # the tiny Cityscapes tree
from tests.helpers import mapped_label as mapped
from tests.helpers import seg_prepare
from tests.helpers import write_layout_config as write_config


def _voc(root: Path, n: int = 5, size=(24, 32)) -> Path:
    """A tiny VOC folder with palette labels (values 0..2 and 255) and JPEG images of varied sizes."""
    rng = np.random.default_rng(0)
    (root / "JPEGImages").mkdir(parents=True)
    (root / "SegmentationClass").mkdir()
    (root / "ImageSets" / "Segmentation").mkdir(parents=True)
    ids = []
    for i in range(n):
        h, w = size[0] + 2 * i, size[1] - i
        sid = f"s{i:02d}"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / "JPEGImages" / f"{sid}.jpg",
                                                                                quality=90)
        label = rng.choice(np.array([0, 1, 2, 255], np.uint8), size=(h, w))
        save_index_png(root / "SegmentationClass" / f"{sid}.png", label, voc_colormap())
        ids.append(sid)
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("\n".join(ids) + "\n")
    return root


def _samples(root: Path):
    return [(sid, str(root / "JPEGImages" / f"{sid}.jpg"), str(root / "SegmentationClass" / f"{sid}.png"))
            for sid in (root / "ImageSets" / "Segmentation" / "train.txt").read_text().split()]


@pytest.fixture(scope="module")
def voc(tmp_path_factory):
    return _voc(tmp_path_factory.mktemp("tfr") / "voc")


def test_writer_index_matches_tensorflows_reading_of_the_shards(voc, tmp_path):
    samples = _samples(voc)
    index = records.write_split(samples, str(tmp_path / "out"), "train", 2)
    assert [len(s["records"]) for s in index["shards"]] == [2, 3]
    pattern = records.split_pattern(str(tmp_path / "out"), "train")
    refs = records.load_records(pattern)
    assert [sid for sid, _ in refs] == [s[0] for s in samples]
    # TensorFlow's reader gives the same records, in the same order, as reading each by its offset.
    shards = records.shard_paths(pattern)
    assert [Path(p).name for p in shards] == ["train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord"]
    via_tf = [r.numpy() for r in tf.data.TFRecordDataset(shards)]
    assert via_tf == [records.read_record(ref) for _, ref in refs]
    # The header walk (used for shards without an index) finds the same offsets the writer recorded.
    walked = [ref for p in shards for ref in records.walk_shard(p)]
    assert walked == [ref for _, ref in refs]


def test_record_holds_the_image_file_and_the_label_indices(voc, tmp_path):
    samples = _samples(voc)
    records.write_split(samples, str(tmp_path / "out"), "train", 1)
    refs = records.load_records(records.split_pattern(str(tmp_path / "out"), "train"))
    for (sid, image_path, label_path), (rid, ref) in zip(samples, refs):
        image, label, parsed_id = records.parse_example(records.read_record(ref))
        assert parsed_id == sid == rid
        assert image == Path(image_path).read_bytes()  # stored as the file's bytes: no re-encoding
        # The label is the palette PNG's indices (Pillow), readable by TensorFlow's decoder.
        expected = read_label(label_path)
        assert Image.open(label_path).mode == "P"
        np.testing.assert_array_equal(tf.io.decode_png(label, channels=1).numpy()[..., 0], expected)
        np.testing.assert_array_equal(read_label(io.BytesIO(label)), expected)
        tf_image, tf_label = records.parse_example_tf(tf.constant(records.read_record(ref)))
        assert tf_image.numpy() == image and tf_label.numpy() == label


def test_ram_filesystem_round_trip(voc):
    out = "ram://tfrecord-test/voc"
    records.write_split(_samples(voc), out, "train", 2)
    refs = records.load_records(records.split_pattern(out, "train"))
    assert len(refs) == 5 and all(ref.shard.startswith("ram://") for _, ref in refs)
    assert [r.numpy() for r in tf.data.TFRecordDataset(records.shard_paths(f"{out}/train-*"))] == \
        [records.read_record(ref) for _, ref in refs]


def _model_garden_shard(path: str, voc: Path) -> list[tuple[bytes, np.ndarray]]:
    """Shards as another tool writes them: Model Garden's feature names, no index file, no ids."""
    written = []
    with tf.io.TFRecordWriter(path) as w:
        for sid, image_path, label_path in _samples(voc):
            label = read_label(label_path)
            png = tf.io.encode_png(label[..., None]).numpy()
            image = Path(image_path).read_bytes()
            h, w_ = label.shape
            ex = tf.train.Example(features=tf.train.Features(feature={
                "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
                "image/height": tf.train.Feature(int64_list=tf.train.Int64List(value=[h])),
                "image/width": tf.train.Feature(int64_list=tf.train.Int64List(value=[w_])),
                "image/segmentation/class/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[png])),
            }))
            w.write(ex.SerializeToString())
            written.append((image, label))
    return written


def test_shards_from_another_writer_are_walked(voc, tmp_path):
    out = tmp_path / "mg"
    out.mkdir()
    written = _model_garden_shard(str(out / "val-00000-of-00001.tfrecord"), voc)
    refs = records.load_records(records.split_pattern(str(out), "val"))
    assert [sid for sid, _ in refs] == [f"val-00000-of-00001.tfrecord:{i}" for i in range(5)]
    for (image, label), (_, ref) in zip(written, refs):
        got_image, got_label, sid = records.parse_example(records.read_record(ref))
        assert sid is None and got_image == image
        np.testing.assert_array_equal(read_label(io.BytesIO(got_label)), label)


def test_truncated_shard_and_stale_index(voc, tmp_path):
    out = tmp_path / "out"
    records.write_split(_samples(voc), str(out), "train", 1)
    shard = out / "train-00000-of-00001.tfrecord"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    # The index no longer matches the shard's size, so the shard is walked, and the walk names the problem:
    # the shard file (not the split's glob) and the record that runs past its end.
    with pytest.raises(records.ShardError, match="past the end of the file") as e:
        records.load_records(records.split_pattern(str(out), "train"))
    assert e.value.shard == str(shard) and re.match(r"record 4 at byte \d+ claims \d+ bytes", e.value.problem)


def test_a_sample_that_cannot_be_converted_is_named(voc, tmp_path):
    bad = tmp_path / "bad.png"
    Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(bad)  # an RGB label: colours, not classes
    with pytest.raises(ValueError, match=r"cannot convert sample 'x'.*bad.png"):
        records.encode_sample(str(voc / "JPEGImages" / "s00.jpg"), str(bad), "x")
    small = tmp_path / "small.png"
    Image.fromarray(np.zeros((5, 5), np.uint8)).save(small)
    with pytest.raises(ValueError, match="label size differs from image"):
        records.encode_sample(str(voc / "JPEGImages" / "s00.jpg"), str(small), "x")


@pytest.mark.slow
def test_seg_prepare_tfrecords(voc, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  root: {voc}\n  num_classes: 3\n")
    out = tmp_path / "rec"
    proc = subprocess.run([*seg_prepare(), "tfrecords", "--config", str(cfg),
                           "--split", "train", "--output", str(out), "--shards", "2"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 5 records of split 'train' in 2 shard(s)" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord",
                                                     "train.index.json"]
    proc = subprocess.run([*seg_prepare(), "tfrecords", "--config", str(cfg),
                           "--split", "nope", "--output", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1


# ---- reading them: data.format: tfrecord -----------------------------------------------------------

def _readers(tmp_path, voc, out, split="train", **data):
    from tests.helpers import open_reader, tiny_config

    recs = tiny_config(tmp_path / "recs", data_root=out, data={"format": "tfrecord", **data})
    recs = open_reader(recs, split, seed=3)
    if split != "train":  # the folder has only a train split
        return None, recs
    files = tiny_config(tmp_path / "files", data_root=voc, data=data)
    return open_reader(files, split, seed=3), recs


def test_the_stream_over_records_is_the_stream_over_the_files(voc, tmp_path):
    # Same order, same augmentation, same batches (and so the same resume and 1 tower = N towers);
    # the reference is the folder the records were written from, read by the files reader.
    out = str(tmp_path / "out")
    records.write_split(_samples(voc), out, "train", 2)
    files, recs = _readers(tmp_path, voc, out)
    assert [s.id for s in recs.samples] == [s.id for s in files.samples]
    start = 3  # a resumed position: samples 12-23 of the stream, across two epoch ends (5 samples, batches of 4)
    a = list(files.train_dataset(4, start, 2, end_step=start + 3).as_numpy_iterator())
    b = list(recs.train_dataset(4, start, 2, end_step=start + 3).as_numpy_iterator())
    assert len(a) == len(b) == 6
    for (ia, la), (ib, lb) in zip(a, b):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(la, lb)
    ea = list(files.eval_dataset().as_numpy_iterator())
    eb = list(recs.eval_dataset().as_numpy_iterator())
    for (ia, la, xa), (ib, lb, xb) in zip(ea, eb):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(la, lb)
        assert xa == xb
    assert not recs._fell_back  # TensorFlow's decoders read the records; Pillow was never needed


def test_records_from_another_writer_with_a_label_map_and_ram(voc, tmp_path):
    out = "ram://tfrecord-test/mg"
    tf.io.gfile.makedirs(out)
    written = _model_garden_shard(f"{out}/val-00000-of-00001.tfrecord", voc)
    # A label map applies to the records' raw values as to files: 0 -> 1, 1 -> 0, 2 -> 2, 255 stays ignored.
    _, recs = _readers(tmp_path, voc, out, split="val", label_map={0: 1, 1: 0, 2: 2, 255: 255})
    by_hand = np.array([1, 0, 2] + [0] * 252 + [255], np.uint8)
    for i, (_, label) in enumerate(written):
        image, got = recs.decode(i)
        np.testing.assert_array_equal(got.numpy(), by_hand[label])


def test_a_damaged_record_is_named(voc, tmp_path):
    from seg_train.data.reader import BadSample

    out = tmp_path / "out"
    records.write_split(_samples(voc)[:2], str(out), "train", 1)
    shard = out / "train-00000-of-00001.tfrecord"
    data = bytearray(shard.read_bytes())
    data[40:60] = b"\0" * 20  # inside the first record's protobuf / JPEG bytes; sizes unchanged
    shard.write_bytes(bytes(data))
    _, recs = _readers(tmp_path, voc, str(out))
    with pytest.raises((BadSample, tf.errors.OpError), match=r"train-00000-of-00001.tfrecord\[s00\]"):
        recs.decode(0)



@pytest.mark.slow
def test_cityscapes_as_tfrecords_trains_and_evaluates(tmp_path, trees):  # noqa: F811
    """The Cityscapes tree converted by seg-prepare tfrecords (its entry point in this process; the command itself:
    test_seg_prepare_tfrecords), read with data.format: tfrecord: its own label map applies to the records' raw
    labelIds; seg-train and seg-eval count every val pixel under its train id."""
    import json

    from seg_train import cli
    from seg_train import config as config_lib
    from seg_train.data import layouts

    files_cfg = write_config(tmp_path, trees, "cityscapes")
    out = tmp_path / "records"
    for split in SPLITS["cityscapes"]:
        assert cli.prepare_main(["tfrecords", "--config", str(files_cfg), "--split", split, "--output", str(out)]) == 0
    (tmp_path / "rec").mkdir()
    path = str(write_config(tmp_path / "rec", trees, "cityscapes", root=str(out), format="tfrecord"))
    assert cli.train_main(["--config", path, "--gpus", "1", "--check-data"]) == 0
    assert cli.train_main(["--config", path, "--gpus", "1"]) == 0
    run = tmp_path / "rec" / "run"
    assert cli.eval_main(["--config", path, "--gpus", "1", "--checkpoint", str(run)]) == 0
    record = json.loads((run / "eval" / "val-step2.json").read_text())
    cfg = config_lib.load(files_cfg)
    val = layouts.list_samples(cfg.data, "val")
    labels = np.concatenate([mapped("cityscapes", s.label).ravel() for s in val])
    by_class = np.bincount(labels[labels != 255], minlength=19)
    np.testing.assert_array_equal(np.sum(record["confusion_matrix"], axis=1), by_class)
