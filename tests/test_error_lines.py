"""Every error line names the file (and the record) and carries no Python repr: the bad-input
corpus the suite already builds (tests/helpers.py's `bad_roots`, tests/test_lossy_labels.py's
JPEG labels, tests/test_layouts.py's Cityscapes tree) and TFRecords damaged in the ways a copy or another
writer damages them, each through every route a user meets it by:

- `train`: seg-train itself (in process), which stops at the pre-training scan or the listing;
- `check`: seg-train --check-data, its `bad:` lines and its last line;
- `stream`: the training stream with no scan before it (how seg-eval reads a split), TensorFlow's decode
  falling back to Pillow, the line seg-train would print for the error it raises;
- `convert`: seg-prepare tfrecords on the folder (in process).

Fails for a line with `object at 0x` anywhere in what the user reads (Pillow's "cannot identify image file
<_io.BytesIO object at 0x...>" for bytes it decodes from memory), a shard named by the split's glob
instead of its file, and a line that does not name the file the case broke.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from seg_train import cli
from seg_train import config as config_lib
from seg_train.data import records, synthetic
from tests.helpers import (
    DATA_CASES,
    LOSSY_KINDS,
    deeplab_example,
    encoded,
    error_lines,
    label_array,
    lossy_photo,
    open_reader,
    write_lossy_config,
)
from tests.helpers import bad_roots as _bad_roots
from tests.helpers import write_layout_config as layout_config
from tests.helpers import write_voc_config as voc_config

ROOT = Path(__file__).resolve().parent.parent
REPR = re.compile(r"object at 0x|<[^<>]* at 0x[0-9a-fA-F]+>")


@dataclass
class Case:
    config: Path
    where: str | tuple[str, ...]  # what every line must name: the broken file (a record: its shard and record),
    # or one of the broken files
    routes: tuple[str, ...]
    split: str | None = None  # the split the stream route reads (None: data.train_split)
    prefix: str | None = None  # the train route's line starts with it (test_robustness's expectations)
    convert: Path | None = None  # the folder seg-prepare tfrecords converts


def _shard_record(path: Path, i: int) -> str:
    return f"{path}[{path.name}:{i}]"


def _deeplab_shard(path: Path, examples: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as w:
        for e in examples:
            w.write(e)
    return path


def _good(n: int) -> bytes:
    return deeplab_example(lossy_photo(n), encoded(label_array(n), "PNG"), b"png", f"r{n}.jpg")


def _records_config(directory: Path, root: Path) -> Path:
    return write_lossy_config(directory, "tfrecord", root)


SAMPLE_ROUTES = ("train", "check", "stream")
LIST_ROUTES = ("train", "check")  # the listing fails: no stream to read


def build(base: Path, trees: dict) -> dict[str, Case]:  # noqa: F811
    cases: dict[str, Case] = {}
    demo = synthetic.generate(base / "demo", num_train=12, num_val=4, size=(40, 48), num_classes=3)
    for name, root in _bad_roots(base / "voc", demo).items():
        prefix = DATA_CASES[name].format(root=root)
        where = re.search(r"\((.*)\): $", prefix).group(1)
        sample_level = name not in ("split_missing", "split_empty")
        cases[f"voc-{name}"] = Case(voc_config(base / "cfg" / name, root), where,
                                    SAMPLE_ROUTES if sample_level else LIST_ROUTES,
                                    "val" if name.startswith("val_") else None, prefix,
                                    convert=root if name == "jpeg_garbage" else None)
    for kind, make in LOSSY_KINDS.items():
        root = base / f"lossy-{kind}"
        bad = make(root)
        cases[f"lossy-{kind}"] = Case(write_lossy_config(base / "cfg", kind, root), tuple(bad), SAMPLE_ROUTES)

    # TFRecords: the project's writer's shard cut short (its index then stale: the shard is walked) ...
    out = base / "rec-truncated"
    samples = [(s.id, s.image, s.label) for s in open_reader(
        config_lib.load(voc_config(base / "cfg" / "demo", demo)), "train").samples]
    records.write_split(samples, str(out), "train", 2)
    shard = out / "train-00001-of-00002.tfrecord"
    shard.write_bytes(shard.read_bytes()[:-100])
    cases["rec-shard-truncated"] = Case(_records_config(base / "cfg" / "rt", out), str(shard), LIST_ROUTES)
    # ... a shard of random bytes beside a good one ...
    out = base / "rec-garbage"
    _deeplab_shard(out / "train-00000-of-00002.tfrecord", [_good(0), _good(1)])
    shard = out / "train-00001-of-00002.tfrecord"
    shard.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    cases["rec-shard-garbage"] = Case(_records_config(base / "cfg" / "rg", out), str(shard), LIST_ROUTES)
    # ... records of another writer whose image, or label, is no image, or that lack the label ...
    for name, example in (
            ("image-not-an-image", deeplab_example(b"this is not an image" * 5,
                                                         encoded(label_array(1), "PNG"), b"png", "x")),
            ("label-not-an-image", deeplab_example(lossy_photo(1), b"\x89PNG but not really" * 5, b"png", "x")),
            ("no-label", tf.train.Example(features=tf.train.Features(feature={"image/encoded": tf.train.Feature(
                bytes_list=tf.train.BytesList(value=[lossy_photo(1)]))})).SerializeToString())):
        shard = _deeplab_shard(base / f"rec-{name}" / "train-00000-of-00001.tfrecord", [_good(0), example, _good(2)])
        cases[f"rec-{name}"] = Case(_records_config(base / "cfg" / name, shard.parent), _shard_record(shard, 1),
                                    SAMPLE_ROUTES)
    # ... and a record damaged in place (its index still matches the shard's size).
    out = base / "rec-damaged"
    records.write_split(samples[:2], str(out), "train", 1)
    shard = out / "train-00000-of-00001.tfrecord"
    data = bytearray(shard.read_bytes())
    data[40:60] = b"\0" * 20
    shard.write_bytes(bytes(data))
    cases["rec-damaged"] = Case(_records_config(base / "cfg" / "damaged", out), f"{shard}[{samples[0][0]}]",
                                SAMPLE_ROUTES)

    # The layouts: a Cityscapes labelId with no mapping, a label missing next to its image, a bad list line.
    for d in ("cs-broken", "cs-nolabel", "pairs"):
        (base / "cfg" / d).mkdir(parents=True)
    cs = layout_config(base / "cfg" / "cs-broken", trees, "cityscapes", train_split="broken")
    label = trees["cityscapes"] / "gtFine/broken/aachen/aachen_000000_000019_gtFine_labelIds.png"
    cases["cityscapes-unmapped"] = Case(cs, str(label), SAMPLE_ROUTES)
    cs = layout_config(base / "cfg" / "cs-nolabel", trees, "cityscapes", train_split="nolabel")
    label = trees["cityscapes"] / "gtFine/nolabel/ulm/ulm_000000_000019_gtFine_labelIds.png"
    cases["cityscapes-no-label"] = Case(cs, str(label), LIST_ROUTES)
    bad_list = base / "bad-list.txt"
    bad_list.write_text("photos/a/p0.png masks/p0_mask.png\nphotos/a/p1.png\n")
    cases["pairs-bad-line"] = Case(layout_config(base / "cfg" / "pairs", trees, "pairs", train_split=str(bad_list)),
                                   f"{bad_list}:2", LIST_ROUTES)
    return cases


CASES = [f"voc-{n}" for n in DATA_CASES if n not in ("root_missing", "batch_indivisible")] + [
    "lossy-voc", "lossy-pairs", "lossy-tfrecord", "rec-shard-truncated", "rec-shard-garbage",
    "rec-image-not-an-image", "rec-label-not-an-image", "rec-no-label", "rec-damaged", "cityscapes-unmapped",
    "cityscapes-no-label", "pairs-bad-line"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, trees):  # noqa: F811
    cases = build(tmp_path_factory.mktemp("corpus"), trees)
    assert sorted(cases) == sorted(CASES)
    return cases


def _no_repr(text: str, route: str):
    found = [line for line in text.splitlines() if REPR.search(line)]
    assert not found, f"{route}: a Python repr in what the user reads: {found}"


def _route_lines(case: Case, route: str, capsys) -> tuple[list[str], str]:
    """(the error lines of `route`, everything it printed)."""
    capsys.readouterr()
    if route == "train":
        assert cli.train_main(["--config", str(case.config), "--gpus", "1"]) == 2
        out, err = capsys.readouterr()
        return error_lines(err), out + err
    if route == "check":
        assert cli.train_main(["--config", str(case.config), "--check-data"]) == 2
        out, err = capsys.readouterr()
        return [line for line in out.splitlines() if line.startswith("bad: ")] + error_lines(err), out + err
    if route == "stream":
        cfg = config_lib.load(case.config)
        reader = open_reader(cfg, case.split or cfg.data.train_split, seed=0)
        with pytest.raises(tf.errors.OpError) as info:
            list(reader.eval_dataset().as_numpy_iterator())
        line = cli.user_error(info.value)
        assert line is not None, f"not a user error: {info.value.message[:500]}"
        return [f"error: {line}"], capsys.readouterr().err + line
    cfg = case.config.parent / "convert.yaml"
    cfg.write_text(f"data:\n  root: {case.convert}\n  num_classes: 3\n")
    assert cli.prepare_main(["tfrecords", "--config", str(cfg), "--split", "train", "--output",
                             str(case.config.parent / "converted")]) == 2
    out, err = capsys.readouterr()
    return err.strip().splitlines(), out + err


@pytest.mark.parametrize("name", CASES)
def test_error_lines_name_the_file_and_carry_no_repr(corpus, name, capsys):
    case = corpus[name]
    data_root = str(config_lib.load(case.config).data.root)
    for route in case.routes + (("convert",) if case.convert else ()):
        lines, printed = _route_lines(case, route, capsys)
        _no_repr(printed, route)
        assert lines, f"{route}: no error line:\n{printed}"
        for line in lines:
            # --check-data's last line sums up the list above it (whose lines name the files): it names the root.
            summary = route == "check" and re.match(r"error: \d+ bad sample\(s\) ", line)
            names = (data_root,) if summary else (case.where,) if isinstance(case.where, str) else case.where
            assert any(n in line for n in names), f"{route}: {line!r} does not name {names}"
        if route == "train" and case.prefix:
            assert lines == [lines[0]] and lines[0].startswith(case.prefix), (route, lines)
        if name.startswith("rec-shard"):
            # The shard file by name, never the split's glob, and where in it the framing breaks.
            assert all("*" not in line and re.search(r"record \d+ at byte \d+", line) for line in lines), lines
