"""Config loading: strict keys, types, ranges, paths relative to the file, --set overrides. No TF."""

from pathlib import Path

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


def test_synthetic_data_root_defaults_to_current_folder(tmp_path, monkeypatch):
    """A copied demo config (no paths in it) keeps its data and run under the folder it is run from."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    demo = (Path(__file__).resolve().parents[1] / "configs" / "demo.yaml").read_text()
    cfg = C.load(write(tmp_path, demo, "demo.yaml"))
    assert cfg.data.root == cwd / "data" / "demo"
    assert cfg.run_dir == cwd / "runs" / "demo"
    # Given, it is relative to the config file as always; without synthetic data it is required.
    assert C.load(write(tmp_path, {"data": {"synthetic": True, "root": "d", "num_classes": 3}})).data.root == \
        tmp_path / "d"
    assert err(tmp_path, {"data": {"num_classes": 3}}).startswith("missing required value (data.root)")


def test_non_utf8_config_is_a_user_error(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"data:\n  root: \xff\xfe\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    assert str(e.value) == f"cannot read config ({p}): a UTF-8 text YAML file (byte 14 is not UTF-8)"


def test_loss_section_and_fine_tuning_keys(tmp_path):
    cfg = C.load(write(tmp_path, BASE))
    assert cfg.loss == C.LossConfig(class_weights=None, top_k_percent_pixels=1.0)
    assert cfg.model.freeze_batchnorm is False and cfg.train.backbone_lr_multiplier == 1.0
    cfg = C.load(write(tmp_path, {**BASE, "loss": {"class_weights": [1, 2.5, 0], "top_k_percent_pixels": 0.25},
                                  "model": {"freeze_batchnorm": True}, "train": {"backbone_lr_multiplier": 0.1}}))
    assert cfg.loss.class_weights == [1.0, 2.5, 0.0] and cfg.loss.top_k_percent_pixels == 0.25
    assert cfg.model.freeze_batchnorm is True and cfg.train.backbone_lr_multiplier == 0.1
    cfg = C.load(write(tmp_path, BASE), ["loss.class_weights=median_frequency"])
    assert cfg.loss.class_weights == "median_frequency"
    assert C.load(write(tmp_path, BASE), ["loss.class_weights=sqrt_median_frequency"]).loss.class_weights == \
        "sqrt_median_frequency"
    out = tmp_path / "resolved.yaml"
    C.dump(cfg, out)
    assert C.from_dict(yaml.safe_load(out.read_text())) == cfg


@pytest.mark.parametrize("loss, expected", [
    ({"class_weights": "median"}, "invalid value (loss.class_weights): expected null, a list of per-class weights, "
                                  "'median_frequency' or 'sqrt_median_frequency', got 'median'"),
    ({"class_weights": [1, 2]}, "wrong number of class weights (loss.class_weights): expected one weight per "
                                "class (3, data.num_classes), got 2"),
    ({"class_weights": [1, -1, 2]}, "out of range (loss.class_weights): expected weights >= 0, got [1.0, -1.0, 2.0]"),
    ({"class_weights": [0, 0, 0]}, "out of range (loss.class_weights): expected at least one weight above 0"),
    ({"class_weights": 2}, "wrong type (loss.class_weights): expected a list of numbers or a string (or null), got 2"),
    ({"class_weights": ["a", "b", "c"]}, "wrong type (loss.class_weights): expected a list of numbers or a string"),
    ({"top_k_percent_pixels": 0}, "out of range (loss.top_k_percent_pixels): expected a number in (0, 1], got 0.0"),
    ({"top_k_percent_pixels": 1.5}, "out of range (loss.top_k_percent_pixels): expected a number in (0, 1]"),
    ({"top_k_percent_pixel": 0.5}, "unknown key (loss.top_k_percent_pixel): did you mean 'top_k_percent_pixels'?"),
])
def test_loss_errors_name_key_and_expected(tmp_path, loss, expected):
    assert err(tmp_path, {**BASE, "loss": loss}).startswith(expected)


def test_backbone_lr_multiplier_must_be_positive(tmp_path):
    msg = err(tmp_path, {**BASE, "train": {"backbone_lr_multiplier": 0}})
    assert msg.startswith("out of range (train.backbone_lr_multiplier): expected a positive number")


@pytest.mark.parametrize("key, value", [("model.freeze_batchnorm", True), ("train.backbone_lr_multiplier", 0.1),
                                        ("loss.class_weights", "median_frequency"),
                                        ("loss.class_weights", [1.0, 2.0, 3.0]),
                                        ("loss.top_k_percent_pixels", 0.5), ("train.accumulate_steps", 2),
                                        ("train.clip_global_norm", 1.0), ("train.ema_decay", 0.999),
                                        ("train.head_lr_multiplier", 10.0), ("train.weight_decay", 0.01),
                                        ("model.drop_path_rate", 0.1), ("model.head_dropout", 0.1)])
def test_new_keys_change_what_a_checkpoint_means(tmp_path, key, value):
    from seg_train.run.rundir import check_resume_config

    cfg = C.load(write(tmp_path, BASE))
    old = cfg.to_dict()
    del old["loss"], old["model"]["freeze_batchnorm"], old["train"]["backbone_lr_multiplier"]  # an older run
    for k in ("accumulate_steps", "clip_global_norm", "ema_decay", "head_lr_multiplier", "weight_decay"):
        del old["train"][k]
    del old["model"]["drop_path_rate"], old["model"]["head_dropout"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    check_resume_config(cfg, tmp_path, allow_change=False)  # absent = the default: no change
    with pytest.raises(C.ConfigError, match=f"changed: {key}"):
        check_resume_config(C.replace(cfg, key, value), tmp_path, allow_change=False)


def test_weight_decays_resolved_per_optimizer(tmp_path):
    """model.weight_decay (the L2 term) and train.weight_decay (AdamW's decoupled decay) each default for its
    optimizer and never stack unasked; an older run's resolved config (adam, 4e-5) resolves as it did."""
    def resolved(**train):
        cfg = C.load(write(tmp_path, {**BASE, "train": train}))
        return cfg.model.weight_decay, cfg.train.weight_decay

    assert resolved() == resolved(optimizer="sgd") == (4e-5, None)
    assert resolved(optimizer="adamw") == (0.0, 0.01)  # SegFormer's decay, and no L2 beside it
    assert resolved(optimizer="adamw", weight_decay=0.05) == (0.0, 0.05)
    assert C.load(write(tmp_path, {**BASE, "model": {"weight_decay": 0}, "train": {"optimizer": "adamw"}})) \
        .model.weight_decay == 0.0
    assert C.load(write(tmp_path, {**BASE, "model": {"weight_decay": 1e-3}})).model.weight_decay == 1e-3
    assert err(tmp_path, {**BASE, "model": {"weight_decay": 4e-5}, "train": {"optimizer": "adamw"}}) == (
        "two weight decays (model.weight_decay): 0 (or no value) with train.optimizer adamw, which decays the "
        "weights itself (train.weight_decay), got 4e-05")
    assert err(tmp_path, {**BASE, "train": {"weight_decay": 0.01}}) == (
        "not available for this optimizer (train.weight_decay): no value with train.optimizer 'adam': it is AdamW's "
        "decoupled decay (adamw); the L2 term of adam and sgd is model.weight_decay, got 0.01")
    assert err(tmp_path, {**BASE, "train": {"head_lr_multiplier": 0}}).startswith(
        "out of range (train.head_lr_multiplier): expected a positive number")
    assert C.load(write(tmp_path, BASE)).train.head_lr_multiplier == 1.0


def test_profile_steps_two_integers_in_order(tmp_path):
    assert C.load(write(tmp_path, BASE)).train.profile_steps is None
    cfg = C.load(write(tmp_path, {**BASE, "train": {"profile_steps": [3, 5]}}))
    assert cfg.train.profile_steps == (3, 5) and cfg.to_dict()["train"]["profile_steps"] == [3, 5]
    assert C.load(write(tmp_path, {**BASE, "train": {"profile_steps": [4, 4]}})).train.profile_steps == (4, 4)
    for bad, expected in [([5, 3], "1 <= a <= b, got [5, 3]"), ([0, 2], "1 <= a <= b, got [0, 2]"),
                          ([2], "a list of 2 integers"), ([1.5, 2], "an integer, got 1.5"), (7, "a list of 2")]:
        msg = err(tmp_path, {**BASE, "train": {"profile_steps": bad}})
        assert msg.startswith("train.profile_steps") or "(train.profile_steps)" in msg, msg
        assert expected in msg, msg


def test_check_batch_against_the_tower_count(tmp_path):
    cfg = C.load(write(tmp_path, {"data": {"root": "d", "num_classes": 3, "batch_size": 12}}))
    for towers in (1, 2, 3, 4, 6, 12):
        C.check_batch(cfg, towers)  # divides: no error
    for towers in (5, 8, 24):
        with pytest.raises(C.ConfigError) as e:
            C.check_batch(cfg, towers)
        assert str(e.value) == ("batch does not divide across towers (data.batch_size): "
                                f"expected a multiple of the {towers} towers, got 12")
