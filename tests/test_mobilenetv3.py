"""MobileNetV3 backbones (model.backbone: mobilenetv3_large | mobilenetv3_small) and the LR-ASPP head
(model.head: lraspp).

The backbones are held to Keras 2's own MobileNetV3 (tf_keras, a test-only dependency): the weight
files it writes load layer by layer, and the loaded backbone computes what tf_keras' model computes
up to the first dilated block. The head is held to numpy by hand (torchvision's LRASPPHead, bilinear
resizes with half-pixel centres as its F.interpolate(align_corners=False)).
"""

import io
from contextlib import redirect_stderr

import keras
import numpy as np
import pytest
import tf_keras
import yaml

from seg_train import cli, models
from seg_train import config as config_lib
from seg_train.config import ConfigError, ModelConfig
from seg_train.data import synthetic
from seg_train.infer.load import load_state
from seg_train.models.fused_bn import FusedBatchNormalization
from seg_train.models.sync_bn import SyncBatchNormalization
from seg_train.parallel import replicas
from tests.helpers import PUBLISHED_FILES, bilinear_resize
from tests.helpers import perturb as _perturb
from tests.helpers import read_h5 as _read_h5
from tests.helpers import short_weight_name as _short
from tests.helpers import weighted_layers as _weighted_layers

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

CTORS = {"mobilenetv3_large": tf_keras.applications.MobileNetV3Large,
         "mobilenetv3_small": tf_keras.applications.MobileNetV3Small}
# Keras 3 layer -> the Keras 2 layer of the same place, compared on features: (stride 4 as DeepLabV3+
# reads it, stride 8 as LR-ASPP reads it, the last block before any dilation at output stride 16,
# the depthwise whose stride is removed: at stride 16 its output is ours at odd positions).
PROBES = {
    "mobilenetv3_large": [("expanded_conv_2_add", "expanded_conv_2/Add"),
                          ("expanded_conv_3_project_bn", "expanded_conv_3/project/BatchNorm"),
                          ("expanded_conv_11_add", "expanded_conv_11/Add"),
                          ("expanded_conv_12_depthwise_bn", "expanded_conv_12/depthwise/BatchNorm")],
    "mobilenetv3_small": [("expanded_conv_project_bn", "expanded_conv/project/BatchNorm"),
                          ("expanded_conv_1_project_bn", "expanded_conv_1/project/BatchNorm"),
                          ("expanded_conv_7_add", "expanded_conv_7/Add"),
                          ("expanded_conv_8_depthwise_bn", "expanded_conv_8/depthwise/BatchNorm")],
}
# Keras 3 suffix -> Keras 2's, written out (the loader derives Keras 3 names from Keras 2 ones).
SUFFIXES = {"expand": "expand", "expand_bn": "expand/BatchNorm", "depthwise": "depthwise",
            "depthwise_bn": "depthwise/BatchNorm", "squeeze_excite_conv": "squeeze_excite/Conv",
            "squeeze_excite_conv_1": "squeeze_excite/Conv_1", "project": "project", "project_bn": "project/BatchNorm"}
STEM = {"conv": "Conv", "conv_bn": "Conv/BatchNorm", "conv_1": "Conv_1", "conv_1_bn": "Conv_1/BatchNorm"}


def _keras2_name(name):
    if name in STEM:
        return STEM[name]
    rest = name[len("expanded_conv"):]
    block = ""
    if rest[1].isdigit():
        block, rest = "_" + rest[1:].split("_")[0], rest[1:].split("_", 1)[1]
    else:
        rest = rest[1:]
    return f"expanded_conv{block}/{SUFFIXES[rest]}"


@pytest.fixture(scope="module")
def keras2(tmp_path_factory):
    """Per variant: the .h5 file tf_keras writes (under the published name), a test image and
    tf_keras' features of it at PROBES (inference mode, input x / 127.5 - 1)."""
    out = {}
    image = np.random.default_rng(3).integers(0, 256, (2, 64, 96, 3)).astype(np.float32)
    for i, (name, ctor) in enumerate(CTORS.items()):
        ref = ctor(input_shape=(None, None, 3), include_top=False, weights=None, include_preprocessing=False)
        _perturb(ref, seed=20 + i)
        path = tmp_path_factory.mktemp(name) / PUBLISHED_FILES[name]
        ref.save_weights(str(path))
        probe = tf_keras.Model(ref.input, [ref.get_layer(k2).output for _, k2 in PROBES[name]])
        out[name] = {"path": path, "image": image,
                     "features": [f.numpy() for f in probe(image / 127.5 - 1, training=False)]}
    return out


def _build(name, path=None, head="deeplabv3plus", output_stride=16):
    return models.build(ModelConfig(backbone=name, head=head, output_stride=output_stride, backbone_weights=path,
                                    aspp_channels=8, decoder_channels=8, low_level_channels=4,
                                    lraspp_channels=8), 3)


@pytest.mark.parametrize("name", list(CTORS))
def test_keras2_file_loads_layer_by_layer_and_computes_as_keras2(keras2, name):
    files = keras2[name]
    in_file = _read_h5(files["path"])
    model = _build(name, files["path"])
    backbone = models.backbone_of(model)
    ours = _weighted_layers(backbone)
    # Every weighted layer of the file is in the backbone (the last 1x1 conv is LR-ASPP's 'high').
    assert sorted(_keras2_name(n) for n in ours) == sorted(in_file)
    n = 0
    for layer_name, layer in ours.items():
        arrays = in_file[_keras2_name(layer_name)]
        assert [_short(w) for w, _ in arrays] == [v.name for v in layer.weights], layer_name
        for (w, expected), v in zip(arrays, layer.weights):
            np.testing.assert_array_equal(v.numpy(), expected, err_msg=w)
            n += 1
    assert n == sum(len(a) for a in in_file.values()) == {"mobilenetv3_large": 262, "mobilenetv3_small": 206}[name]

    data = config_lib.from_dict({"data": {"root": "d", "num_classes": 3}, "model": {"backbone": name}}).data
    x = (files["image"] - np.array(data.mean, np.float32)) / np.array(data.std, np.float32)
    probe = keras.Model(backbone.input, [backbone.get_layer(k3).output for k3, _ in PROBES[name]])
    got = [f.numpy() for f in probe(x, training=False)]
    s4, s8, s16, strided = files["features"]
    assert [g.shape[1:3] for g in got] == [(16, 24), (8, 12), (4, 6), (4, 6)] and strided.shape[1:3] == (2, 3)
    for g, ref in zip(got[:3], (s4, s8, s16)):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # The depthwise that lost its stride: the strided one's outputs are ours at odd positions (its
    # padding made symmetric, so each output still sees the same window).
    np.testing.assert_allclose(got[3][:, 1::2, 1::2], strided, rtol=1e-4, atol=1e-4 * np.abs(strided).max())
    # What each head reads: stride-4 features for DeepLabV3+, stride-8 ones for LR-ASPP.
    low, _ = backbone(x, training=False)
    np.testing.assert_allclose(low.numpy(), s4, rtol=1e-4, atol=1e-4 * np.abs(s4).max())
    low, _ = models.backbone_of(_build(name, files["path"], head="lraspp"))(x, training=False)
    np.testing.assert_allclose(low.numpy(), s8, rtol=1e-4, atol=1e-4 * np.abs(s8).max())


def test_the_other_variant_file_is_refused_in_one_line(keras2):
    for name, other in (("mobilenetv3_large", "mobilenetv3_small"), ("mobilenetv3_small", "mobilenetv3_large")):
        with pytest.raises(ConfigError, match="does not match the backbone") as e:
            _build(name, keras2[other]["path"])
        text = str(e.value)
        assert "\n" not in text and PUBLISHED_FILES[name] in text, text


@pytest.mark.parametrize("output_stride, dilations", [(16, {12: 1, 13: 2, 14: 2}),
                                                      (8, {6: 1, 7: 2, 11: 2, 12: 2, 13: 4, 14: 4})])
def test_output_stride_is_real(output_stride, dilations):
    model = _build("mobilenetv3_large", head="lraspp", output_stride=output_stride)
    backbone = models.backbone_of(model)
    low, high = backbone(np.zeros((1, 64, 96, 3), np.float32))
    assert low.shape == (1, 8, 12, 40) and high.shape == (1, 64 // output_stride, 96 // output_stride, 960)
    for block, rate in dilations.items():  # DeepLab's rule: the block that loses its stride keeps its rate
        layer = backbone.get_layer(f"expanded_conv_{block}_depthwise")
        assert tuple(layer.dilation_rate) == (rate, rate) and tuple(layer.strides) == (1, 1), block


def test_lraspp_mobilenetv3_large_has_torchvisions_parameter_count():
    # torchvision publishes num_params = 3221538 for lraspp_mobilenet_v3_large (21 classes, BN's
    # running statistics not counted): the same architecture has as many trainable weights.
    model = models.build(ModelConfig(backbone="mobilenetv3_large", head="lraspp"), 21)
    assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == 3221538


@pytest.mark.parametrize("sync,fused", [(True, True), (False, False), (False, True)])
def test_every_bn_layer_is_of_the_chosen_class(sync, fused):
    # The rebuilt MobileNetV3's BN layers and LR-ASPP's one, with the configured momentum.
    model = models.build(ModelConfig(backbone="mobilenetv3_small", head="lraspp", lraspp_channels=8,
                                     sync_batchnorm=sync, fused_batchnorm=fused, bn_momentum=0.8), 3)
    layers = models.batchnorm_layers(model)
    assert len(layers) == 35 and "lraspp_cbr_bn" in {b.name for b in layers}  # conv_bn ... conv_1_bn, the head's
    per_tower = FusedBatchNormalization if fused else keras.layers.BatchNormalization
    assert {type(b) for b in layers} == {SyncBatchNormalization if sync else per_tower}
    assert {b.momentum for b in layers} == {0.8}  # (the class carries the synchronisation: models/sync_bn.py)


def _weights(model, name):
    return [v.numpy().astype(np.float64) for v in model.get_layer(name).weights]


@pytest.mark.parametrize("backbone", ["mobilenetv3_small", "tiny"])
def test_lraspp_logits_equal_numpy_by_hand(backbone):
    model = _build(backbone, head="lraspp")
    # A fresh MobileNetV3 at inference (moving statistics 0/1) outputs ~1e-10: perturbed, so the
    # high-level branch varies over the image and its resize is seen.
    _perturb(models.backbone_of(model), seed=1)
    rng = np.random.default_rng(0)
    for layer in model.layers:  # recognisable head weights, BN statistics far from 0/1
        if layer.name.startswith("lraspp_") and layer.weights:
            layer.set_weights([rng.uniform(0.5, 1.5, v.shape) if "variance" in v.name or "gamma" in v.name
                               else rng.normal(0, 0.5, v.shape) for v in layer.weights])
    x = rng.normal(size=(2, 56, 72, 3)).astype(np.float32)
    low, high = (f.numpy().astype(np.float64) for f in models.backbone_of(model)(x, training=False))
    # Stride 8 and 16; Keras' MobileNetV3 pads its strided depthwise convs for even sizes, so 7 -> 3.
    assert low.shape[1:3] == (7, 9) and high.shape[1:3] == {"tiny": (4, 5), "mobilenetv3_small": (3, 4)}[backbone]

    (w_cbr,) = _weights(model, "lraspp_cbr_conv")
    # Moving statistics near the batch's own: MobileNetV3's last features vary over the image by ~1%
    # of their size, which BN statistics far from them would leave unseen after the ReLU.
    pre = high @ w_cbr[0, 0]
    bn = model.get_layer("lraspp_cbr_bn")
    bn.moving_mean.assign(pre.mean(axis=(0, 1, 2)) + rng.normal(0, 0.3, pre.shape[-1]) * pre.std(axis=(0, 1, 2)))
    bn.moving_variance.assign(pre.var(axis=(0, 1, 2)) * rng.uniform(0.5, 1.5, pre.shape[-1]))
    gamma, beta, mean, var = _weights(model, "lraspp_cbr_bn")
    (w_scale,) = _weights(model, "lraspp_scale_conv")
    w_low, b_low = _weights(model, "lraspp_low_logits")
    w_high, b_high = _weights(model, "lraspp_high_logits")
    cbr = np.maximum((high @ w_cbr[0, 0] - mean) / np.sqrt(var + 1e-5) * gamma + beta, 0)
    gate = 1 / (1 + np.exp(-(high.mean(axis=(1, 2), keepdims=True) @ w_scale[0, 0])))
    up = bilinear_resize(cbr * gate, low.shape[1:3])
    assert up.std(axis=(1, 2)).mean() > 0.1 * np.abs(up).mean()
    expected = bilinear_resize(low @ w_low[0, 0] + b_low + up @ w_high[0, 0] + b_high, x.shape[1:3])

    got = model(x, training=False)
    assert got.dtype == "float32" and got.shape == (2, 56, 72, 3)
    # float32 against float64: BN subtracts a mean near the values (MobileNetV3: |diff| up to 1.2e-4 of the max).
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())


def test_head_and_backbone_choices(tmp_path):
    base = {"data": {"root": "d", "num_classes": 3}}
    for backbone in ("tiny", "mobilenetv2", "mobilenetv3_large", "mobilenetv3_small", "resnet50", "resnet101"):
        for head in ("deeplabv3plus", "lraspp"):  # every backbone gives stride-4 and stride-8 features
            cfg = config_lib.from_dict({**base, "model": {"backbone": backbone, "head": head}})
            assert (cfg.model.backbone, cfg.model.head) == (backbone, head)
    old = config_lib.from_dict(base).model  # a config from before model.head: DeepLabV3+ as it was
    assert (old.head, old.lraspp_channels) == ("deeplabv3plus", 128)
    mnv3 = config_lib.from_dict({**base, "model": {"backbone": "mobilenetv3_small"}}).data
    # Keras' own MobileNetV3 input rescaling (include_preprocessing=True) is what the defaults do.
    rescale = tf_keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), include_top=False, weights=None,
                                                     include_preprocessing=True).layers[1]
    assert type(rescale).__name__ == "Rescaling"
    image = np.random.default_rng(0).uniform(0, 255, (1, 32, 32, 3)).astype(np.float32)
    np.testing.assert_allclose((image - np.array(mnv3.mean, np.float32)) / np.array(mnv3.std, np.float32),
                               rescale(image).numpy(), rtol=1e-6, atol=1e-6)

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**base, "run_dir": str(tmp_path / "run")}))
    for override, line in [
        ("model.head=lrasp", "error: invalid value (model.head): expected one of deeplabv3plus, lraspp, segformer, "
         "linear, eomt, got 'lrasp'"),
        ("model.backbone=mobilenetv3", "error: invalid value (model.backbone): expected one of tiny, mobilenetv2, "
         "mobilenetv3_large, mobilenetv3_small, resnet50, resnet101, mit_b0, mit_b1, mit_b2, mit_b3, mit_b4, mit_b5, "
         "dinov3_vits16, dinov3_vits16plus, dinov3_vitb16, dinov3_vitl16, dinov3_vith16plus, dinov2_vits14, "
         "dinov2_vitb14, dinov2_vitl14, dinov2_vitg14, dinov2_vits14_reg, dinov2_vitb14_reg, dinov2_vitl14_reg, "
         "dinov2_vitg14_reg, dinov2_vits16_reg, dinov2_vitb16_reg, dinov2_vitl16_reg, dinov2_vitg16_reg, "
         "got 'mobilenetv3'"),
        ("model.lraspp_channels=0", "error: out of range (model.lraspp_channels): expected a positive number, got 0"),
    ]:
        err = io.StringIO()
        with redirect_stderr(err):
            rc = cli.train_main(["--config", str(path), "--set", override])
        assert rc == 2
        assert [s for s in err.getvalue().splitlines() if s.strip()] == [line], err.getvalue()


def test_train_lraspp_on_two_towers(tmp_path):
    root = synthetic.generate(tmp_path / "data", num_train=8, num_val=2, size=(64, 64), num_classes=3, seed=0)
    raw = {"seed": 0, "run_dir": str(tmp_path / "run"),
           "data": {"root": str(root), "num_classes": 3, "batch_size": 4, "crop_size": [64, 64],
                    "num_parallel_calls": 2},
           # tiny: the same run on mobilenetv3_small takes a minute on two cores.
           "model": {"backbone": "tiny", "head": "lraspp", "lraspp_channels": 8},
           "train": {"num_steps": 2, "checkpoint_every": 2, "summary_every": 1, "image_summary_every": 0,
                     "accumulate_steps": 2, "ema_decay": 0.5},
           "eval": {"bn_reestimate_batches": 1}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.train_main(["--config", str(path), "--gpus", "2"]) == 0
    assert yaml.safe_load((tmp_path / "run" / "best" / "best.json").read_text())["step"] == 2  # evaluated

    cfg = config_lib.load(tmp_path / "run" / "config.yaml")
    assert (cfg.model.head, cfg.model.backbone) == ("lraspp", "tiny")
    strategy = replicas.make_strategy(replicas.Devices(["/device:CPU:0"], "CPU", "test"))
    state, _, step = load_state(cfg, strategy, str(tmp_path / "run"))
    assert step == 2
    image = np.zeros((1, 64, 96, 3), np.float32)
    low, high = models.backbone_of(state.model)(image)
    assert low.shape == (1, 8, 12, 64) and high.shape == (1, 4, 6, 128)
    assert state.model(image).shape == (1, 64, 96, 3)
