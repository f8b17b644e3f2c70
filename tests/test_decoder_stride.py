"""model.decoder_stride: 2, DeepLabV3+'s refinement stage on the backbone's stride-2 features.

The stage is held to numpy written from its definition (1x1 conv + BN + ReLU of the stride-2 features,
the stride-4 decoder's features resized bilinearly and concatenated before them, two 3x3 convs + BN + ReLU,
the 1x1 logits, the final resize); every backbone's stride-2 features are really at stride 2; the TFLite
file of such a model predicts what Keras predicts; the default builds the model it always built.

Wrong answers these catch: the stride-4 features fed to the fine stage (or the stride-8 ones), the
concatenation in the other order, a BN or ReLU left out, the logits taken before the stage, a
backbone's stride-2 layer that is really at stride 4, a default that grew the new layers (old
checkpoints would no longer load).
"""

from pathlib import Path

import numpy as np
import pytest

from seg_train import config as config_lib
from seg_train import models
from seg_train.config import ConfigError, ModelConfig
from seg_train.models.cnn.backbones import build_backbone
from seg_train.models.layer_choice import LayerChoice
from tests.helpers import bilinear_resize
from tests.helpers import perturb as _perturb


def _bn_relu(x, model, name, eps=1e-5):
    gamma, beta, mean, var = (v.numpy().astype(np.float64) for v in model.get_layer(name).weights)
    return np.maximum((x - mean) / np.sqrt(var + eps) * gamma + beta, 0.0)


def _conv3x3(x, kernel):
    """'same' 3x3 convolution, stride 1, no bias: [b, h, w, cin] x [3, 3, cin, cout]."""
    h, w = x.shape[1:3]
    padded = np.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)])
    return sum(padded[:, dy:dy + h, dx:dx + w] @ kernel[dy, dx] for dy in range(3) for dx in range(3))


def _kernel(model, name):
    return model.get_layer(name).weights[0].numpy().astype(np.float64)


def test_fine_stage_equals_numpy_by_hand():
    cfg = ModelConfig(backbone="tiny", output_stride=16, aspp_channels=8, decoder_channels=6, low_level_channels=4,
                      decoder_stride=2, fine_low_level_channels=3, fine_channels=5)
    model = models.build(cfg, 4)
    rng = np.random.default_rng(0)
    _perturb(model, seed=1)  # every weight and BN statistic recognisable (not 0/1)
    x = rng.normal(size=(2, 40, 56, 3)).astype(np.float32)
    fine, low, high = (f.numpy().astype(np.float64) for f in models.backbone_of(model)(x, training=False))
    assert fine.shape[1:3] == (20, 28) and low.shape[1:3] == (10, 14) and high.shape[1:3] == (3, 4)

    import keras
    decoder = keras.Model(model.input, model.get_layer("decoder_conv2_relu").output)(x, training=False)
    decoder = decoder.numpy().astype(np.float64)
    assert decoder.shape == (2, 10, 14, 6)
    projected = _bn_relu(fine @ _kernel(model, "decoder_fine_low_conv")[0, 0], model, "decoder_fine_low_bn")
    cat = np.concatenate([bilinear_resize(decoder, (20, 28)), projected], axis=-1)
    y = _bn_relu(_conv3x3(cat, _kernel(model, "decoder_fine_conv1_conv")), model, "decoder_fine_conv1_bn")
    y = _bn_relu(_conv3x3(y, _kernel(model, "decoder_fine_conv2_conv")), model, "decoder_fine_conv2_bn")
    w, b = (v.numpy().astype(np.float64) for v in model.get_layer("logits").weights)
    expected = bilinear_resize(y @ w[0, 0] + b, (40, 56))
    assert expected.std() > 0.1 * np.abs(expected).mean()

    got = model(x, training=False).numpy()
    assert got.shape == (2, 40, 56, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.slow
@pytest.mark.parametrize("name, channels", [("tiny", 16), ("mobilenetv2", 16), ("mobilenetv3_large", 16),
                                            ("mobilenetv3_small", 16), ("resnet50", 64), ("resnet101", 64)])
def test_every_backbone_gives_stride_2_features(name, channels):
    backbone = build_backbone(name, 16, 0.9, LayerChoice(False, True, True), low_strides=(2, 4))
    fine, low, high = backbone(np.zeros((1, 64, 96, 3), np.float32))
    assert fine.shape[1:] == (32, 48, channels) and low.shape[1:3] == (16, 24) and high.shape[1:3] == (4, 6)


@pytest.mark.slow
def test_default_builds_deeplabs_decoder_unchanged():
    # decoder_stride 4 (the default) builds none of the stage's layers, and the stage adds only its own
    # variables (the default's against the code before the option: the test below).
    cfg = ModelConfig(backbone="tiny", aspp_channels=8, decoder_channels=8, low_level_channels=4)
    assert cfg.decoder_stride == 4
    plain = models.build(cfg, 3)
    assert not [layer.name for layer in plain.layers if "fine" in layer.name]
    assert len(models.backbone_of(plain).outputs) == 2
    fine = models.build(ModelConfig(**{**cfg.__dict__, "decoder_stride": 2}), 3)
    extra = {v.path for v in fine.weights} - {v.path for v in plain.weights}
    assert extra and all("decoder_fine" in p for p in extra)
    assert {v.path for v in plain.weights} <= {v.path for v in fine.weights}


OLD_VARIABLES = Path(__file__).resolve().parent / "fixtures" / "model_variables_3678d2a.json"


@pytest.mark.slow
@pytest.mark.parametrize("key", ["mobilenetv2/deeplabv3plus", "mobilenetv3_large/lraspp", "resnet50/deeplabv3plus"])
def test_default_models_have_the_variables_of_the_code_before_the_option(key):
    """The default models (19 classes, every width at its default) have exactly the variable paths and
    shapes that commit 3678d2a, the code before model.decoder_stride, built (the fixture was written
    by that commit). Checkpoints restore by path, so a renamed, added or reshaped variable here is an
    old checkpoint that no longer loads; the keras.applications backbones were rewired by the option
    (each names its stride-2 layer), which the tiny-backbone run of test_old_checkpoint.py cannot see."""
    import json

    expected = {path: shape for path, shape in json.loads(OLD_VARIABLES.read_text())[key]}
    backbone, head = key.split("/")
    model = models.build(ModelConfig(backbone=backbone, head=head), 19)
    got = {v.path: list(v.shape) for v in model.weights}
    assert got == expected


@pytest.mark.slow
def test_tflite_file_predicts_what_keras_predicts():
    from ai_edge_litert.interpreter import Interpreter

    from seg_train.infer.tflite_export import app_function, convert, frozen_function

    model = models.build(ModelConfig(backbone="tiny", output_stride=16, aspp_channels=8, decoder_channels=8,
                                     low_level_channels=4, decoder_stride=2), 3)
    _perturb(model, seed=2)
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (1, 32, 48, 3), dtype=np.uint8)
    content = convert(frozen_function(app_function(model, [127.5] * 3, [127.5] * 3, 32, 48)), "none", None)
    interpreter = Interpreter(model_content=content)
    interpreter.allocate_tensors()
    ops = {op["op_name"] for op in interpreter._get_ops_details()}
    assert not [op for op in ops if "FLEX" in op.upper() or "CUSTOM" in op.upper()], ops
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], image)
    interpreter.invoke()
    classes = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])[0]
    logits = model((image.astype(np.float32) - 127.5) / 127.5, training=False).numpy()[0]
    top2 = np.sort(logits, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-3
    assert clear.mean() > 0.9 and (classes[clear] == logits.argmax(-1)[clear]).all()


@pytest.mark.parametrize("model, expected", [
    ({"decoder_stride": 3}, "error: invalid value (model.decoder_stride): expected one of 4, 2, got 3"),
    ({"head": "lraspp", "decoder_stride": 2}, "error: not available for this head (model.decoder_stride): "
                                             "expected 4 (or no value) with model.head 'lraspp'"),
    ({"fine_channels": 0}, "error: out of range (model.fine_channels): expected a positive number, got 0"),
])
def test_decoder_stride_config_errors(model, expected):
    with pytest.raises(ConfigError) as e:
        config_lib.from_dict({"data": {"root": "d", "num_classes": 3}, "model": model})
    assert f"error: {e.value}".startswith(expected), str(e.value)
