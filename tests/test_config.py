"""Config loading: strict keys, types, ranges, paths relative to the file, --set overrides. No TF."""

import pytest
import yaml

from seg_train import config as C


def write(tmp_path, raw, name="c.yaml"):
    p = tmp_path / name
    p.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return p


BASE = {"data": {"root": "d", "num_classes": 3}}


def err(tmp_path, raw, overrides=()):
    with pytest.raises(C.ConfigError) as e:
        C.load(write(tmp_path, raw), list(overrides))
    return str(e.value)


def test_defaults_and_relative_paths(tmp_path):
    (tmp_path / "sub").mkdir()
    cfg = C.load(write(tmp_path / "sub", {"data": {"root": "../voc", "num_classes": 21}, "run_dir": "r"}))
    assert cfg.data.root == tmp_path / "voc"
    assert cfg.run_dir == tmp_path / "sub" / "r"
    assert cfg.data.ignore_label == 255 and cfg.data.train_split == "train" and cfg.data.val_split == "val"
    assert cfg.train.lr_power == 0.9 and cfg.model.sync_batchnorm is False
    assert cfg.data.mean == (127.5, 127.5, 127.5)  # mobilenetv2's own normalisation by default


def test_default_run_dir_is_runs_config_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = C.load(write(tmp_path, BASE, "voc.yaml"))
    assert cfg.run_dir == tmp_path / "runs" / "voc"


def test_unknown_key_suggests_nearest(tmp_path):
    msg = err(tmp_path, {"data": {"root": "d", "num_classes": 3, "batchsize": 4}})
    assert "data.batchsize" in msg and "did you mean 'batch_size'" in msg
    msg = err(tmp_path, {**BASE, "trian": {}})
    assert "trian" in msg and "'train'" in msg


def test_wrong_type_names_key_value_expected(tmp_path):
    msg = err(tmp_path, {"data": {"root": "d", "num_classes": "three"}})
    assert "data.num_classes" in msg and "'three'" in msg and "integer" in msg
    msg = err(tmp_path, {"data": {"root": "d", "num_classes": 3, "crop_size": [321]}})
    assert "data.crop_size" in msg and "[321]" in msg
    msg = err(tmp_path, {"data": {"root": "d", "num_classes": 3, "random_mirror": "yes please"}})
    assert "data.random_mirror" in msg and "true or false" in msg


def test_out_of_range_and_choices(tmp_path):
    msg = err(tmp_path, {"data": {"root": "d", "num_classes": 3, "batch_size": 0}})
    assert "data.batch_size" in msg and "positive" in msg and "0" in msg
    msg = err(tmp_path, {**BASE, "model": {"output_stride": 32}})
    assert "model.output_stride" in msg and "8, 16" in msg
    msg = err(tmp_path, {"data": {"root": "d", "num_classes": 3, "random_scale": [2.0, 0.5]}})
    assert "data.random_scale" in msg


def test_missing_required(tmp_path):
    msg = err(tmp_path, {"data": {"root": "d"}})
    assert "missing required value (data.num_classes)" in msg


def test_yaml_syntax_error_has_line(tmp_path):
    msg = err(tmp_path, "data:\n  root: d\n  num_classes: [3\n")
    assert "YAML syntax error" in msg and "c.yaml:" in msg


def test_python_tags_refused_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    text = f"data: !!python/object/apply:os.system ['touch {marker}']\n"
    msg = err(tmp_path, text)
    assert "refused YAML tag" in msg
    assert not marker.exists()


def test_set_overrides_typed_and_dotted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = C.load(write(tmp_path, BASE), ["train.num_steps=100", "data.crop_size=[65, 33]",
                                         "model.sync_batchnorm=true", "train.learning_rate=1e-3",
                                         "run_dir=elsewhere"])
    assert cfg.train.num_steps == 100 and cfg.data.crop_size == (65, 33)
    assert cfg.model.sync_batchnorm is True and cfg.train.learning_rate == 1e-3
    assert cfg.run_dir == tmp_path / "elsewhere"
    assert "did you mean 'num_steps'" in err(tmp_path, BASE, ["train.numsteps=3"])
    assert "expected KEY=VALUE" in err(tmp_path, BASE, ["train.num_steps"])


def test_resolved_config_round_trips(tmp_path):
    cfg = C.load(write(tmp_path, BASE))
    out = tmp_path / "resolved.yaml"
    C.dump(cfg, out)
    assert C.from_dict(yaml.safe_load(out.read_text())) == cfg


def test_check_batch_against_the_tower_count(tmp_path):
    cfg = C.load(write(tmp_path, {"data": {"root": "d", "num_classes": 3, "batch_size": 12}}))
    for towers in (1, 2, 3, 4, 6, 12):
        C.check_batch(cfg, towers)  # divides: no error
    for towers in (5, 8, 24):
        with pytest.raises(C.ConfigError) as e:
            C.check_batch(cfg, towers)
        assert str(e.value) == ("batch does not divide across towers (data.batch_size): "
                                f"expected a multiple of the {towers} towers, got 12")
