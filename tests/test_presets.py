"""keras-hub presets (model.backbone_weights: a MiT preset, model.init_weights: a SegFormer preset) held to
keras-hub's own models: keras-hub builds MiT-B0 and a SegFormer-B0 segmenter with recognisable random
weights, `save_to_preset` writes the directories exactly as users download them, seg-train loads them
through its config keys (the config loader and TrainState: the real build path), and the pyramid levels
and logits on a square input must be keras-hub's (float32, 1e-5 relative to the largest value). The same
weights on a non-square input, which keras-hub cannot take, must give the transposed result of the
transposed image once every spatial kernel is transposed (the MiT, the head and the resizes commute with
transposition; a height and width mixed up anywhere breaks it).

Wrong answers these catch: an array loaded into the wrong layer, transposed, or skipped (every array has
values a fresh layer does not: LayerNorm gammas are not 1, BN statistics not 0/1); the spatial-reduction
conv, the attention's scale, a LayerNorm epsilon, Mix-FFN's depthwise conv or its GELU, the patch
embeddings' padding, the head's concatenation order off from the paper's; a classifier loaded over a
different class count or dropped when the counts match; a preset of another size or kind accepted.
"""

import logging
import shutil

import h5py
import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from seg_train import config as config_lib
from seg_train import models
from seg_train.config import ConfigError, ModelConfig
from seg_train.config.variants import MIT_VARIANTS
from seg_train.run.state import TrainState
from tests.helpers import PAPER_HEADS, PAPER_MIT, PAPER_PATCH_SIZES, PAPER_SR_RATIOS, PAPER_STRIDES, tiny_config
from tests.helpers import mit_kwargs as _mit_kwargs

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

SIZE, CLASSES = 64, 5  # keras-hub's model is built for one square size


@pytest.mark.parametrize("name", sorted(PAPER_MIT))
def test_every_mit_size_is_the_papers(name):
    """Every size, B1..B5 included (only B0 is run against keras-hub below): a stage with another head count
    or reduction ratio has the same variables, so its preset loads silently and computes another function."""
    spec = MIT_VARIANTS[name]
    assert (list(spec.widths), list(spec.depths)) == PAPER_MIT[name]
    assert list(spec.heads) == PAPER_HEADS and list(spec.sr_ratios) == PAPER_SR_RATIOS
    assert list(spec.patch_sizes) == PAPER_PATCH_SIZES and list(spec.patch_strides) == PAPER_STRIDES


def keras_hub_mit(name="mit_b0", size=SIZE):
    return keras_hub.models.MiTBackbone(image_shape=(size, size, 3), **_mit_kwargs(name))


def keras_hub_segformer(name="mit_b0", classes=CLASSES, channels=256, size=SIZE):
    backbone = keras_hub.models.SegFormerBackbone(image_encoder=keras_hub_mit(name, size), projection_filters=channels)
    return keras_hub.models.SegFormerImageSegmenter(backbone=backbone, num_classes=classes)


def _perturb(model, seed):
    """Every weight to fixed-seed values it can be recognised by, at scales that keep activations O(1)."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        shape = tuple(v.shape)
        if v.name == "kernel" and len(shape) == 4 and shape[-1] == 1:  # depthwise (3, 3, C, 1)
            value = rng.normal(0, np.sqrt(1.0 / 9), shape)
        elif v.name == "kernel":
            value = rng.normal(0, np.sqrt(1.0 / np.prod(shape[:-1])), shape)
        elif v.name in ("gamma", "moving_variance"):
            value = rng.uniform(0.5, 1.5, shape)
        else:  # bias, beta, moving_mean
            value = rng.normal(0, 0.2, shape)
        v.assign(value.astype(np.float32))


def _levels(mit, x):
    """keras-hub's pyramid levels P1..P4 of x."""
    outs = keras.Model(mit.inputs, [mit.pyramid_outputs[f"P{i}"] for i in range(1, 5)])([x], training=False)
    return [np.asarray(o) for o in outs]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """keras-hub's B0 models with recognisable weights, their preset directories, and their outputs."""
    tmp = tmp_path_factory.mktemp("presets")
    x = np.random.default_rng(0).normal(size=(2, SIZE, SIZE, 3)).astype(np.float32)
    mit = keras_hub_mit()
    _perturb(mit, 1)
    mit.save_to_preset(str(tmp / "mit_b0"))
    seg = keras_hub_segformer()
    _perturb(seg, 2)
    seg.save_to_preset(str(tmp / "segformer_b0"))
    encoder = seg.backbone.image_encoder
    return {"tmp": tmp, "x": x, "mit": mit, "seg": seg,
            "mit_levels": _levels(mit, x), "seg_levels": _levels(encoder, x),
            "features": np.asarray(seg.backbone(x, training=False)),  # the head's fused stride-4 features
            "logits": np.asarray(seg(x, training=False))}


def _state(tmp_path, classes=CLASSES, **model):
    cfg = tiny_config(tmp_path, data={"num_classes": classes, "crop_size": [SIZE, SIZE]},
                      model={"backbone": "mit_b0", "head": "segformer", **model})
    return TrainState(cfg, tf.distribute.OneDeviceStrategy("/cpu:0"), optimizer=False)


def _rel(got, want):
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def _check_levels(model, x, want):
    got = models.backbone_of(model)(x, training=False)
    assert len(got) == 4
    for level, (g, w) in enumerate(zip(got, want), 1):
        assert g.shape == w.shape, level
        assert w.std() > 0.1, level  # not a degenerate comparison
        assert _rel(g, w) <= 1e-5, (level, _rel(g, w))


@pytest.fixture(scope="module")
def from_mit_preset(hub):
    return _state(hub["tmp"] / "run_mit", backbone_weights=str(hub["tmp"] / "mit_b0")).model


@pytest.fixture(scope="module")
def from_segformer_preset(hub):
    return _state(hub["tmp"] / "run_seg", init_weights=str(hub["tmp"] / "segformer_b0")).model


def test_parameter_counts_equal_keras_hubs_b0(hub, from_segformer_preset):
    model = from_segformer_preset
    assert models.backbone_of(model).count_params() == hub["mit"].count_params() == 3_319_392
    assert model.count_params() == hub["seg"].count_params()
    assert model.count_params() - model.get_layer("logits").count_params() == hub["seg"].backbone.count_params()


def test_mit_preset_gives_keras_hubs_pyramid(hub, from_mit_preset):
    _check_levels(from_mit_preset, hub["x"], hub["mit_levels"])


def test_segformer_preset_gives_keras_hubs_levels_and_logits_classifier_kept(hub, from_segformer_preset):
    model = from_segformer_preset
    _check_levels(model, hub["x"], hub["seg_levels"])
    got = model(hub["x"], training=False)
    assert got.shape == hub["logits"].shape and hub["logits"].std() > 0.1
    assert _rel(got, hub["logits"]) <= 1e-5, _rel(got, hub["logits"])


def test_other_class_count_skips_the_classifier_with_one_info_line(hub, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="seg_train"):
        model = _state(tmp_path, classes=3, init_weights=str(hub["tmp"] / "segformer_b0")).model
    skipped = [r.getMessage() for r in caplog.records if "classifier not loaded" in r.getMessage()]
    assert skipped == ["model.init_weights: classifier not loaded: the preset has 5 classes, data.num_classes is 3 "
                       "(it starts from its initial weights)"]
    _check_levels(model, hub["x"], hub["seg_levels"])
    features = keras.Model(model.input, model.get_layer("segformer_fuse_relu").output)(hub["x"], training=False)
    assert _rel(features, hub["features"]) <= 1e-5
    # The classifier is the seeded initial one: what the same config builds without the preset.
    fresh = models.build(ModelConfig(backbone="mit_b0", head="segformer"), 3, seed=0)
    for a, b in zip(model.get_layer("logits").weights, fresh.get_layer("logits").weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _transposed_twin(model, num_classes):
    """The same architecture with every spatial kernel transposed (kernel[i, j] -> kernel[j, i])."""
    twin = models.build(ModelConfig(backbone="mit_b0", head="segformer"), num_classes)
    for a, b in zip(model.weights, twin.weights):
        value = a.numpy()
        if a.name == "kernel" and value.ndim == 4:
            value = value.transpose(1, 0, 2, 3)
        b.assign(value)
    return twin


@pytest.mark.parametrize("shape", [(64, 96), (72, 100)], ids=["64x96", "72x100"])
def test_non_square_input_is_consistent_under_transposition(hub, from_segformer_preset, shape):
    """keras-hub's model cannot take these; ours must, and model(x) transposed must be the transposed
    model of x transposed. 72 x 100 is not a multiple of the strides (patch embeddings round up, the
    reductions round down)."""
    model = from_segformer_preset
    twin = _transposed_twin(model, CLASSES)
    x = np.random.default_rng(3).normal(size=(2, *shape, 3)).astype(np.float32)
    xt = x.transpose(0, 2, 1, 3)
    levels, levels_t = models.backbone_of(model)(x), models.backbone_of(twin)(xt)
    for stride, a, b in zip((4, 8, 16, 32), levels, levels_t):
        assert a.shape[1:3] == (-(-shape[0] // stride), -(-shape[1] // stride))
        assert _rel(np.asarray(b).transpose(0, 2, 1, 3), np.asarray(a)) <= 1e-5
    logits, logits_t = model(x, training=False), twin(xt, training=False)
    assert logits.shape == (2, *shape, CLASSES)
    assert _rel(np.asarray(logits_t).transpose(0, 2, 1, 3), np.asarray(logits)) <= 1e-5


def _copy(hub, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(hub["tmp"] / name, dst)
    return dst


def _error(model_keys, classes=CLASSES):
    with pytest.raises(ConfigError) as e:
        models.build(ModelConfig(**model_keys), classes)
    return f"error: {e.value}"


def test_a_preset_of_another_kind_or_size_is_refused_in_one_line(hub, tmp_path):
    mit, seg = hub["tmp"] / "mit_b0", hub["tmp"] / "segformer_b0"
    base = {"backbone": "mit_b0", "head": "segformer"}
    assert _error({**base, "backbone_weights": seg}) == (
        f"error: preset of another model ({seg}/config.json): expected a keras-hub MiTBackbone, got "
        f"'SegFormerBackbone' (a SegFormer preset goes in model.init_weights)")
    assert _error({**base, "init_weights": mit}) == (
        f"error: preset of another model ({mit}/config.json): expected a keras-hub SegFormerBackbone, got "
        f"'MiTBackbone' (an encoder-only MiT preset goes in model.backbone_weights)")
    assert _error({**base, "backbone": "mit_b1", "backbone_weights": mit}) == (
        f"error: preset of another model size ({mit}/config.json): expected mit_b1 (hidden_dims [64, 128, 320, "
        f"512], layerwise_depths [2, 2, 2, 2]: model.backbone), got mit_b0's")
    assert _error({**base, "segformer_channels": 128, "init_weights": seg}) == (
        f"error: preset of another width ({seg}/config.json): expected projection_filters 128 "
        f"(model.segformer_channels), got 256: set model.segformer_channels to the preset's")
    missing = tmp_path / "nowhere"
    assert _error({**base, "backbone_weights": missing}) == (
        f"error: preset not found (model.backbone_weights): expected the directory of a keras-hub MiTBackbone "
        f"preset (config.json, model.weights.h5), got '{missing}'")
    assert _error({**base, "backbone_weights": tmp_path}) == (
        f"error: not a keras-hub preset ({tmp_path}/config.json): expected the config.json of a keras-hub "
        f"MiTBackbone preset (model.backbone_weights takes the unpacked preset directory)")


def test_a_weights_file_of_another_layout_is_refused_before_anything_is_loaded(hub, tmp_path):
    base = {"backbone": "mit_b0", "head": "segformer"}
    broken = _copy(hub, "mit_b0", tmp_path)
    with h5py.File(broken / "model.weights.h5", "a") as f:
        del f["layers/hierarchical_transformer_encoder_5/mlp/dwconv"]
    assert _error({**base, "backbone_weights": broken}) == (
        f"error: preset weights do not match ({broken}/model.weights.h5): expected keras-hub's MiTBackbone "
        f"(mit_b0) layout: no arrays at 'layers/hierarchical_transformer_encoder_5/mlp/dwconv'")
    extra = _copy(hub, "segformer_b0", tmp_path)
    with h5py.File(extra / "model.weights.h5", "a") as f:
        f["layers/dense_4/vars/0"] = np.zeros((8, 8), np.float32)
    message = _error({**base, "init_weights": extra})
    assert message.startswith(f"error: preset weights do not match ({extra}/model.weights.h5): expected keras-hub's "
                              "SegFormerBackbone (mit_b0) layout with nothing else; 1 arrays not of this model"), \
        message


def test_config_paths_of_the_presets_are_resolved_like_the_other_paths(tmp_path):
    (tmp_path / "sub").mkdir()
    cfg = tiny_config(tmp_path / "sub", model={"backbone": "mit_b0", "head": "segformer",
                                               "init_weights": "presets/segformer_b0_ade20k_512"})
    assert cfg.model.init_weights == tmp_path / "sub" / "presets" / "segformer_b0_ade20k_512"
    assert cfg.model.output_stride == 32 and cfg.model.segformer_channels == 256
    assert config_lib.without_weight_files(cfg).model.init_weights is None


def test_a_checkpoint_is_read_without_its_preset(hub, tmp_path, from_segformer_preset):
    """Inference (and a resumed run) rebuilds the model from the config of a run that started from a
    preset: the checkpoint holds every weight, so the preset is not read again (it may be gone)."""
    from seg_train.infer.load import load_state
    from seg_train.run import checkpoint as ckpt_lib

    preset = _copy(hub, "segformer_b0", tmp_path)
    cfg = tiny_config(tmp_path / "cfg", data={"num_classes": CLASSES, "crop_size": [SIZE, SIZE]},
                      model={"backbone": "mit_b0", "head": "segformer", "init_weights": str(preset)})
    state = TrainState(cfg, tf.distribute.OneDeviceStrategy("/cpu:0"))
    state.step.assign(1)
    ckpt_lib.Checkpointer(tmp_path / "run" / "checkpoints", 1, **state.checkpoint_objects()).save(1)
    shutil.rmtree(preset)
    loaded, _, step = load_state(cfg, tf.distribute.OneDeviceStrategy("/cpu:0"), str(tmp_path / "run"))
    assert step == 1
    np.testing.assert_array_equal(loaded.model(hub["x"], training=False),
                                  from_segformer_preset(hub["x"], training=False))
