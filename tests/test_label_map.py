"""Label maps (seg_train/config/label_tables.py label_ids, applied by seg_train/data/labels.py): raw label values
-> train ids, held to tables written out by hand.

Fails for: a wrong entry in the built-in Cityscapes table (e.g. parking trained as a class, or the ids
shifted by one), ADE20K's zero not ignored or classes not shifted down, a raw value with no mapping
passed through silently instead of naming the sample, the TensorFlow lookup disagreeing with numpy's,
the range check applied to the raw values instead of the mapped ones, and a bad map that is not
refused in one line naming its key.
"""

import numpy as np
import pytest
import yaml
from PIL import Image

from seg_train import cli
from seg_train import config as config_lib
from seg_train.config import ConfigError, label_tables
from seg_train.data import labels, layouts
from seg_train.data.reader import BadSample, load_sample
from tests.helpers import CITYSCAPES_BY_HAND


def data_cfg(tmp_path, **data):
    raw = {"data": {"root": "d", **data}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return config_lib.load(path).data


def lookup(table_by_hand: dict, label: np.ndarray) -> np.ndarray:
    """The by-hand map applied pixel by pixel (-1 where it has no entry)."""
    return np.vectorize(lambda v: table_by_hand.get(int(v), -1))(label)


def test_cityscapes_table_is_the_official_one(tmp_path):
    data = data_cfg(tmp_path, layout="cityscapes")
    assert data.num_classes == 19  # from the layout
    table = labels.label_table(data)
    assert {raw: int(table[raw]) for raw in range(34)} == CITYSCAPES_BY_HAND
    assert (table[34:] == labels.NO_ID).all()  # no labelId above 33: such a value is no Cityscapes label
    assert layouts.CITYSCAPES_CLASSES[13] == "car" and layouts.CITYSCAPES_CLASSES[0] == "road"
    assert len(layouts.CITYSCAPES_CLASSES) == 19


def test_ade20k_reduces_zero(tmp_path):
    data = data_cfg(tmp_path, layout="ade20k")
    assert data.num_classes == 150
    table = labels.label_table(data)
    by_hand = {0: 255, 1: 0, 2: 1, 13: 12, 150: 149, 255: 255}  # 0 "other" ignored, wall (1) is class 0
    assert {raw: int(table[raw]) for raw in by_hand} == by_hand
    names = layouts.ADE20K_CLASSES
    assert len(names) == 150 and len(set(names)) == 150
    assert names[:5] == ("wall", "building", "sky", "floor", "tree") and names[-1] == "flag"


def test_layouts_class_names_are_as_many_as_the_configs_classes():
    """The class counts (label_tables.LAYOUT_LABELS, read when a config loads) and the class names (data/layouts.py,
    read when a split opens) live apart: a layout's names must be as many as its classes, or the class names
    fall back to class_i without a word."""
    assert set(layouts.CLASS_NAMES) == set(label_tables.LAYOUT_LABELS) == {"cityscapes", "ade20k"}
    for layout, names in layouts.CLASS_NAMES.items():
        assert len(names) == label_tables.LAYOUT_LABELS[layout].num_classes, layout


def test_user_maps_list_dict_reduce_zero_binary(tmp_path):
    as_list = labels.label_table(data_cfg(tmp_path, num_classes=2, label_map=[255, 0, 1]))
    assert as_list[:3].tolist() == [255, 0, 1] and (as_list[3:] == labels.NO_ID).all()
    as_dict = labels.label_table(data_cfg(tmp_path, num_classes=2, label_map={0: 255, 1: 0, 2: 1}))
    np.testing.assert_array_equal(as_dict, as_list)
    reduced = labels.label_table(data_cfg(tmp_path, num_classes=3, reduce_zero_label=True))
    assert reduced[[0, 1, 2, 3, 255]].tolist() == [255, 0, 1, 2, 255]
    binary = labels.label_table(data_cfg(tmp_path, num_classes=2, binary_threshold=128))
    assert binary[[0, 3, 127, 128, 200, 255]].tolist() == [0, 0, 0, 1, 1, 1]
    assert labels.label_table(data_cfg(tmp_path, num_classes=3)) is None  # VOC: labels hold train ids


def test_numpy_and_tensorflow_lookups_match_the_table_by_hand(tmp_path):
    table = labels.label_table(data_cfg(tmp_path, layout="cityscapes"))
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 40, (48, 64)).astype(np.uint8)  # 34..39: no mapping
    expected = lookup(CITYSCAPES_BY_HAND, raw)
    np.testing.assert_array_equal(labels.apply(table, raw), expected)
    np.testing.assert_array_equal(labels.apply_tf(table, raw).numpy(), expected)
    counts = labels.unmapped_counts(table, raw)
    assert counts == {v: int((raw == v).sum()) for v in range(34, 40)}


def test_load_sample_maps_names_unmapped_values_and_checks_the_mapped_range(tmp_path):
    Image.fromarray(np.full((6, 8, 3), 90, np.uint8)).save(tmp_path / "im.png")
    raw = np.array([[7, 8, 26, 0, 33, 9, 24, 23]] * 6, np.uint8)
    Image.fromarray(raw).save(tmp_path / "lbl.png")
    table = labels.label_table(data_cfg(tmp_path, layout="cityscapes"))
    _, label = load_sample(str(tmp_path / "im.png"), str(tmp_path / "lbl.png"), 19, 255, table)
    assert label[0].tolist() == [0, 1, 13, 255, 18, 255, 11, 10]
    # Without the table the raw ids are out of range for 19 classes: the check applies to mapped values.
    with pytest.raises(BadSample, match=r"out of range .*got \[23, 24, 26, 33\]$"):
        load_sample(str(tmp_path / "im.png"), str(tmp_path / "lbl.png"), 19, 255)

    raw[2, :3] = [40, 41, 40]
    Image.fromarray(raw).save(tmp_path / "lbl.png")
    with pytest.raises(BadSample) as e:
        load_sample(str(tmp_path / "im.png"), str(tmp_path / "lbl.png"), 19, 255, table)
    assert str(e.value) == (f"label values with no mapping ({tmp_path / 'lbl.png'}): expected raw values the label "
                            "map covers, got [40, 41]")
    assert e.value.unmapped == {40: 2, 41: 1}

    reduced = labels.label_table(data_cfg(tmp_path, layout="ade20k"))
    Image.fromarray(np.array([[0, 1, 150, 200]], np.uint8)).save(tmp_path / "ade.png")
    Image.fromarray(np.zeros((1, 4, 3), np.uint8)).save(tmp_path / "ade.jpg")
    with pytest.raises(BadSample, match=r"got \[199\] after the label map \(raw values \[200\]\)$"):
        load_sample(str(tmp_path / "ade.jpg"), str(tmp_path / "ade.png"), 150, 255, reduced)


BAD_MAPS = [
    ({"num_classes": 3, "label_map": {0: 0, 1: 1, 2: 5}},
     "label map value out of range (data.label_map): expected train ids in [0, 3) (data.num_classes) or 255 "
     "(data.ignore_label), got 2: 5"),
    ({"num_classes": 3, "label_map": {0: 0, 1: 1, 300: 2}},
     "label map key out of range (data.label_map): expected raw label values in 0..255 (8-bit labels), got key 300"),
    ({"num_classes": 3, "label_map": [0, 1, 255]},
     "a class with no id (data.label_map): expected every class 0..2 to have a raw value mapped to it, none maps "
     "to [2]"),
    ({"num_classes": 2, "label_map": [0] * 257},
     "label map too long (data.label_map): expected at most 256 entries (raw values 0..255), got 257"),
    ({"num_classes": 2, "label_map": [0, 1], "binary_threshold": 128},
     "more than one label map (data.label_map, data.binary_threshold): expected at most one of them"),
    ({"num_classes": 3, "binary_threshold": 128},
     "binary_threshold needs 2 classes (data.num_classes): expected 2 with data.binary_threshold (raw < 128 -> 0, "
     "raw >= 128 -> 1), got 3"),
    ({"num_classes": 2, "binary_threshold": 0},
     "out of range (data.binary_threshold): expected an integer in [1, 255], got 0"),
    ({"num_classes": 2, "label_map": "0:1"},
     "wrong type (data.label_map): expected a mapping of integers to integers or a list of integers (or null), "
     "got '0:1'"),
    ({"layout": "cityscapes", "num_classes": 20},
     "wrong number of classes (data.num_classes): expected 19 (the cityscapes layout's classes; or leave it out), "
     "got 20; another class set needs a data.label_map of your own"),
    ({"layout": "pairs"}, "missing required value (data.num_classes): expected an integer"),
]


@pytest.mark.parametrize("data, message", BAD_MAPS, ids=[m.split(" (")[0] for _, m in BAD_MAPS])
def test_bad_maps_are_one_line_errors_naming_the_key(tmp_path, capsys, data, message):
    with pytest.raises(ConfigError) as e:
        data_cfg(tmp_path, **data)
    assert str(e.value) == message
    # Through the command: that line, exit code 2, before any data is read.
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump({"data": {"root": str(tmp_path / "nowhere"), **data}}))
    assert cli.train_main(["--config", str(path), "--check-data"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_a_user_map_replaces_the_layouts(tmp_path):
    # Cityscapes' 34 ids merged into 2 classes (road-like vs the rest): the layout's 19 no longer apply.
    mapping = {i: int(i in (7, 8)) for i in range(34)}
    data = data_cfg(tmp_path, layout="cityscapes", num_classes=2, label_map=mapping)
    table = labels.label_table(data)
    assert table[[7, 8, 26, 0]].tolist() == [1, 1, 0, 0] and table[34] == labels.NO_ID


def test_a_changed_label_map_is_a_change_on_resume(tmp_path):
    """The resume check compares label_map as one value: dropping an entry is not a 'removed key'."""
    from seg_train.run.rundir import check_resume_config

    cfg = config_lib.load(_write(tmp_path / "a.yaml", {"data": {"root": "d", "num_classes": 2,
                                                                "label_map": {0: 0, 1: 1, 2: 255}}}))
    (tmp_path / "run").mkdir()
    config_lib.dump(cfg, tmp_path / "run" / "config.yaml")
    check_resume_config(cfg, tmp_path / "run", allow_change=False)  # the same map: no change
    changed = config_lib.replace(cfg, "data.label_map", {0: 0, 1: 1})
    with pytest.raises(ConfigError, match=r"changed: data\.label_map: \{0: 0, 1: 1, 2: 255\} -> \{0: 0, 1: 1\}"):
        check_resume_config(changed, tmp_path / "run", allow_change=False)


def _write(path, raw):
    path.write_text(yaml.safe_dump(raw))
    return path
