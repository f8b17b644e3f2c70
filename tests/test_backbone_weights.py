"""ImageNet initialisation (model.backbone_weights) from files in exactly the format keras-applications
publishes, written by Keras 2 itself (tf_keras, a test-only dependency); model.freeze_batchnorm; the
backbone/head split of the trainable variables (train.backbone_lr_multiplier).

The weight files hold recognisable values (fixed-seed random kernels, gamma/beta and BN moving
statistics), so a layer loaded from the wrong place, or not loaded, cannot match.
"""

import shutil

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from seg_train import config as config_lib
from seg_train import models
from seg_train.config import ConfigError, ModelConfig
from seg_train.config.variants import BACKBONE_NORMALIZATION
from seg_train.data import synthetic
from seg_train.infer import precise_bn
from seg_train.objectives import pixel_losses as losses
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import PUBLISHED_FILES, open_reader, random_batch, tiny_config
from tests.helpers import perturb as _perturb
from tests.helpers import read_h5 as _read_h5
from tests.helpers import short_weight_name as _short
from tests.helpers import weighted_layers as _weighted_layers

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

# backbone: (tf_keras constructor, its preprocess_input, the low-level (stride 4) layer, layers of the
# no-top file past the backbone's high-level output)
APPS = {
    "mobilenetv2": (tf_keras.applications.MobileNetV2, tf_keras.applications.mobilenet_v2.preprocess_input,
                    "block_2_add", {"Conv_1", "Conv_1_bn"}),
    "resnet50": (tf_keras.applications.ResNet50, tf_keras.applications.resnet.preprocess_input,
                 "conv2_block3_out", set()),
}
HEAD = ("aspp", "decoder", "logits")



@pytest.fixture(scope="module")
def keras2_files(tmp_path_factory):
    """Per backbone: the .h5 file tf_keras writes (under the published name), a test image and
    tf_keras' own low-level features of it (inference mode, tf_keras' own preprocessing)."""
    out = {}
    for i, (name, (ctor, preprocess, low_layer, _)) in enumerate(APPS.items()):
        folder = tmp_path_factory.mktemp(name)
        ref_model = ctor(weights=None, include_top=False)  # input (None, None, 3), as the no-top files are
        _perturb(ref_model, seed=i)
        path = folder / PUBLISHED_FILES[name]
        ref_model.save_weights(str(path))  # .h5: Keras 2's legacy layout, as the published files
        image = np.random.default_rng(10 + i).integers(0, 256, (2, 48, 64, 3)).astype(np.float32)
        low = tf_keras.Model(ref_model.input, ref_model.get_layer(low_layer).output)
        out[name] = {"path": path, "image": image,
                     "low": low(preprocess(image.copy()), training=False).numpy()}
    return out


@pytest.fixture(scope="module", params=list(APPS))
def loaded(request, keras2_files):
    """seg-train's model built with the Keras 2 file as model.backbone_weights."""
    name = request.param
    cfg = ModelConfig(backbone=name, backbone_weights=keras2_files[name]["path"], aspp_channels=8,
                      decoder_channels=8, low_level_channels=4)
    return name, models.build(cfg, 3), keras2_files[name]


def test_every_backbone_weight_equals_the_file_layer_by_layer(loaded):
    name, model, files = loaded
    in_file = _read_h5(files["path"])
    ours = _weighted_layers(models.backbone_of(model))
    # Every weighted layer of the backbone comes from the file; the file's other layers are only
    # those past the backbone's high-level output.
    assert set(ours) <= set(in_file)
    assert set(in_file) - set(ours) == APPS[name][3]
    n = 0
    for layer_name, layer in ours.items():
        arrays = in_file[layer_name]
        assert [_short(w) for w, _ in arrays] == [v.name for v in layer.weights], layer_name
        for (w, expected), v in zip(arrays, layer.weights):
            np.testing.assert_array_equal(v.numpy(), expected, err_msg=w)
            n += 1
    bn = ours["bn_Conv1" if name == "mobilenetv2" else "conv1_bn"]
    assert [v.name for v in bn.weights] == ["gamma", "beta", "moving_mean", "moving_variance"]
    assert n == {"mobilenetv2": 255, "resnet50": 318}[name]


def test_low_level_features_equal_keras2_model_output(loaded):
    # Before any dilation, seg-train's backbone is the same function as tf_keras' model: same
    # weights, and the config's default normalisation (+ the resnets' RGB->BGR flip inside the
    # model) equals keras' preprocess_input.
    name, model, files = loaded
    data = config_lib.from_dict({"data": {"root": "d", "num_classes": 3}, "model": {"backbone": name}}).data
    x = (files["image"] - np.array(data.mean, np.float32)) / np.array(data.std, np.float32)
    low, _ = models.backbone_of(model)(x, training=False)
    ref = files["low"]
    assert low.shape == ref.shape == (2, 12, 16, ref.shape[-1])
    np.testing.assert_allclose(low.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name", ["mobilenetv2", "resnet50", "resnet101"])
def test_default_normalisation_is_keras_preprocess_input(name):
    x = np.random.default_rng(0).uniform(0, 255, (2, 5, 7, 3)).astype(np.float32)
    mean, std = BACKBONE_NORMALIZATION[name]
    ours = (x - np.array(mean, np.float32)) / np.array(std, np.float32)
    if name == "mobilenetv2":  # 'tf' mode: [-1, 1]
        np.testing.assert_allclose(ours, tf_keras.applications.mobilenet_v2.preprocess_input(x.copy()),
                                   rtol=1e-6, atol=1e-6)
    else:  # 'caffe' mode: BGR minus the ImageNet BGR mean; the model flips RGB->BGR itself
        np.testing.assert_allclose(ours[..., ::-1], tf_keras.applications.resnet.preprocess_input(x.copy()),
                                   rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("name", ["mit_b0", "mit_b5"])
def test_mit_default_normalisation_is_imagenets(name):
    """keras-hub's SegFormer/MiT presets take x / 255 normalised by ImageNet's mean and std (its image
    converter's values, written out here)."""
    x = np.random.default_rng(0).uniform(0, 255, (2, 5, 7, 3)).astype(np.float32)
    mean, std = BACKBONE_NORMALIZATION[name]
    ours = (x - np.array(mean, np.float32)) / np.array(std, np.float32)
    want = (x / 255.0 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


def test_file_layer_order_does_not_matter(keras2_files, tmp_path):
    # Keras 3's own load_weights pairs layers by position; this loader pairs them by name.
    path = tmp_path / PUBLISHED_FILES["mobilenetv2"]
    shutil.copy(keras2_files["mobilenetv2"]["path"], path)
    with h5py.File(path, "r+") as f:
        f.attrs["layer_names"] = f.attrs["layer_names"][::-1]
    model = models.build(ModelConfig(backbone="mobilenetv2", backbone_weights=path, aspp_channels=8,
                                     decoder_channels=8, low_level_channels=4), 3)
    layer = models.backbone_of(model).get_layer("block_1_project_BN")
    expected = dict(_read_h5(path)["block_1_project_BN"])
    np.testing.assert_array_equal(layer.moving_variance.numpy(), expected["block_1_project_BN/moving_variance:0"])


def test_a_with_top_file_loads_without_its_classifier(tmp_path):
    ref_model = tf_keras.applications.MobileNetV2(weights=None, include_top=True)
    _perturb(ref_model, seed=5)
    path = tmp_path / "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_224.h5"
    ref_model.save_weights(str(path))
    assert "predictions" in _read_h5(path)
    model = models.build(ModelConfig(backbone="mobilenetv2", backbone_weights=path, aspp_channels=8,
                                     decoder_channels=8, low_level_channels=4), 3)
    layer = models.backbone_of(model).get_layer("block_16_project")
    np.testing.assert_array_equal(layer.kernel.numpy(), ref_model.get_layer("block_16_project").get_weights()[0])

def test_wrong_files_are_refused_with_the_expected_file_named(keras2_files, tmp_path):
    cfg = ModelConfig(backbone="resnet50", backbone_weights=keras2_files["mobilenetv2"]["path"])
    with pytest.raises(ConfigError, match="does not match the backbone") as e:
        models.build(cfg, 3)
    assert "resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5" in str(e.value)
    assert "conv1_conv" in str(e.value) and "bn_Conv1" in str(e.value)
    text = tmp_path / "weights.h5"
    text.write_text("not HDF5")
    with pytest.raises(ConfigError, match="cannot read backbone weights"):
        models.build(ModelConfig(backbone="resnet50", backbone_weights=text), 3)
    with pytest.raises(ConfigError, match="not found"):
        models.build(ModelConfig(backbone="resnet50", backbone_weights=tmp_path / "missing.h5"), 3)


def test_backbone_variable_mask_of_mobilenetv2(loaded):
    name, model, _ = loaded
    mask = models.backbone_variable_mask(model)
    paths = [v.path for v in model.trainable_variables]
    assert len(mask) == len(paths)
    assert mask == [not p.startswith(HEAD) for p in paths]
    assert sum(mask) == len(models.backbone_of(model).trainable_variables) == {"mobilenetv2": 153,
                                                                              "resnet50": 212}[name]


def _tiny(freeze, strategy=None):
    cfg = ModelConfig(backbone="tiny", aspp_channels=8, decoder_channels=8, low_level_channels=4,
                      freeze_batchnorm=freeze)
    if strategy is None:
        return models.build(cfg, 3)
    with strategy.scope():
        return models.build(cfg, 3)


def test_backbone_variable_mask_of_tiny_in_a_strategy_scope():
    strategy = replicas.make_strategy(replicas.Devices(["/device:CPU:0", "/device:CPU:1"], "CPU", "test"))
    for freeze, n_backbone in ((False, 18), (True, 6)):  # 6 conv kernels (+ 6 BN gamma/beta pairs unfrozen)
        model = _tiny(freeze, strategy)
        mask = models.backbone_variable_mask(model)
        paths = [v.path for v in model.trainable_variables]
        assert mask == [p.startswith(("stem_", "stage")) for p in paths]
        assert sum(mask) == n_backbone and len(mask) - sum(mask) == 29


def _bn(model):
    return [layer for layer in models.batchnorm_layers(model)]


def test_freeze_batchnorm_freezes_the_backbone_bn_in_training():
    model = _tiny(True)
    backbone = models.backbone_of(model)
    frozen = [b for b in _bn(backbone)]
    head = [b for b in _bn(model) if b not in frozen]
    assert len(frozen) == 6 and len(head) == 9
    assert not any(b.trainable for b in frozen) and all(b.trainable for b in head)
    rng = np.random.default_rng(0)
    for b in frozen:  # loaded-looking statistics, so batch and moving statistics differ
        b.moving_mean.assign(rng.normal(0, 0.5, b.moving_mean.shape).astype(np.float32))
        b.moving_variance.assign(rng.uniform(0.5, 2.0, b.moving_variance.shape).astype(np.float32))
    trainable = {id(v) for v in model.trainable_variables}
    assert not any(id(v) in trainable for b in frozen for v in (b.gamma, b.beta))
    before = [[v.numpy().copy() for v in b.weights] for b in frozen + head]

    images, labels = random_batch(batch=2, size=32)
    low_train, high_train = backbone(images, training=True)
    low_infer, high_infer = backbone(images, training=False)
    np.testing.assert_allclose(low_train.numpy(), low_infer.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(high_train.numpy(), high_infer.numpy(), rtol=1e-6, atol=1e-6)

    optimizer = keras.optimizers.SGD(0.5)
    with tf.GradientTape() as tape:
        ce, count = losses.pixel_cross_entropy_sum(model(images, training=True), labels, 255)
        loss = ce / count
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    after = [[v.numpy() for v in b.weights] for b in frozen + head]
    for b, old, new in zip(frozen, before, after):
        for v, x, y in zip(b.weights, old, new):
            np.testing.assert_array_equal(x, y, err_msg=f"{b.name}/{v.name}")
    for old, new in zip(before[len(frozen):], after[len(frozen):]):  # the head's BN layers still train
        assert all(not np.array_equal(x, y) for x, y in zip(old, new))


def test_without_freeze_training_and_inference_differ():
    # The counterpart of the test above: the same check fails on an unfrozen backbone.
    model = _tiny(False)
    images, _ = random_batch(batch=2, size=32)
    backbone = models.backbone_of(model)
    assert all(b.trainable for b in _bn(model))
    assert not np.allclose(backbone(images, training=True)[0].numpy(), backbone(images, training=False)[0].numpy(),
                           atol=1e-3)


def test_precise_bn_leaves_frozen_backbone_bn_alone(tmp_path):
    root = synthetic.generate(tmp_path / "data", num_train=8, num_val=2, size=(40, 40), num_classes=3, seed=0)
    cfg = tiny_config(tmp_path, root, data={"batch_size": 4}, model={"freeze_batchnorm": True})
    strategy = replicas.make_strategy(replicas.Devices(["/device:CPU:0", "/device:CPU:1"], "CPU", "test"))
    trainer = TrainStep(TrainState(cfg, strategy))
    frozen = _bn(models.backbone_of(trainer.state.model))
    head = [b for b in _bn(trainer.state.model) if b not in frozen]
    for b in frozen:
        b.moving_mean.assign(np.full(b.moving_mean.shape, 0.25, np.float32))
    assert precise_bn.PreciseBN(trainer.state).reestimate(open_reader(cfg, "train"), 1, progress=False)
    for b in frozen:
        np.testing.assert_array_equal(b.moving_mean.numpy(), 0.25)
        np.testing.assert_array_equal(b.moving_variance.numpy(), 1.0)
    assert all(not np.allclose(b.moving_variance.numpy(), 1.0) for b in head)
