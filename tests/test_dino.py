"""The DINOv3 / DINOv2 encoders (models/dino/vit.py) and their preset loader (models/dino/presets.py) held to
keras-hub's own DINOV3Backbone and DINOV2Backbone: keras-hub builds small configs with random weights
(every LayerNorm, layer scale, token and position array away from its initial value), `save_to_preset`
writes the directory as users download it, seg-train loads it, and every chosen block's patch tokens must
be keras-hub's pyramid output with CLS and registers stripped (float32, 1e-5 relative to the largest
value), on a square input and for DINOv3 a non-square one. Then seg-train's encoder is traced ONCE with
unknown H and W: at sizes keras-hub cannot take in one model it gives the right shapes, and at another
size keras-hub can build the same trace gives keras-hub's output (the rotary table and the position
resize computed from the actual grid).

Wrong answers these catch: the rotary table's theta, axes or repetition; the position embedding resized
with another method, from the wrong grid, or not at all; CLS or register tokens left in the maps; layer
scale dropped; a preset of another family or size accepted.
"""

import json

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from seg_train.config import ConfigError
from seg_train.config.variants import VIT_VARIANTS, ViTVariant, four_blocks, swiglu_width
from seg_train.models.dino import vit
from seg_train.models.dino.presets import check_dino_preset, load_dino_preset
from seg_train.models.dino.vit import dino_encoder
from seg_train.models.stochastic import per_sample

pytestmark = pytest.mark.slow  # DEVELOPING.md: takes seconds per test (keras-hub builds, traced steps)

V3 = ViTVariant("dinov3", 16, 32, 3, 2, 64, registers=2, key_bias=False, layer_scale=0.5)
V3_GATED = ViTVariant("dinov3", 16, 48, 2, 4, 64, registers=4, gated=True, activation="silu", key_bias=False)
V2 = ViTVariant("dinov2", 14, 32, 3, 2, 64, pos_grid=4)
V2_REG = ViTVariant("dinov2", 14, 48, 2, 4, 96, registers=2, gated=True, pos_grid=5, antialias=True)


def _hub_kwargs(spec: ViTVariant) -> dict:
    common = dict(patch_size=spec.patch, num_layers=spec.depth, hidden_dim=spec.width, num_heads=spec.heads,
                  intermediate_dim=spec.mlp, num_register_tokens=spec.registers,
                  layer_scale_init_value=spec.layer_scale)
    if spec.family == "dinov3":
        return dict(common, use_gated_mlp=spec.gated, hidden_activation=spec.activation, use_key_bias=spec.key_bias,
                    rope_theta=spec.rope_theta, layer_norm_eps=spec.epsilon)
    edge = spec.pos_grid * spec.patch
    return dict(common, use_swiglu_ffn=spec.gated, position_embedding_shape=(edge, edge, 3),
                antialias_in_interpolation=spec.antialias)


def _hub(spec: ViTVariant, shape, norm=False, **extra):
    cls = keras_hub.models.DINOV3Backbone if spec.family == "dinov3" else keras_hub.models.DINOV2Backbone
    return cls(**_hub_kwargs(spec), image_shape=(*shape, 3), apply_layernorm=norm, **extra)


def _randomize(model, seed=0, vectors_only=False):
    """Every variable away from its initial value (gammas not 1, biases and betas not 0, scales not 1);
    `vectors_only`: the 1-D ones and the tokens (the kernels of a big model are random already)."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if vectors_only and len(v.shape) > 1 and "token" not in v.path:
            continue
        a = rng.normal(0, 0.1, v.shape)
        if len(v.shape) == 1 and ("gamma" in v.path or "lambda" in v.path or "layer_scale" in v.path):
            a += 1.0
        v.assign(a.astype("float32"))
    if hasattr(model, "embeddings") and hasattr(model.embeddings, "interpolated_position_embeddings"):
        e = model.embeddings  # DINOv2: the resized copy derived from the (randomized) source
        e.interpolated_position_embeddings.assign(e._interpolate_position_embeddings(
            e.position_embeddings, e.patch_size, e.position_embedding_shape, e.image_shape,
            e.antialias_in_interpolation))


def _preset(tmp_path, spec, shape, norm=False):
    hub = _hub(spec, shape, norm)
    _randomize(hub)
    hub.save_to_preset(str(tmp_path / "preset"))
    return hub, tmp_path / "preset"


def _hub_maps(hub, spec, image):
    """keras-hub's block outputs as [b, gh, gw, C] patch maps (CLS and registers stripped)."""
    pyramid = keras.Model(hub.inputs, hub.pyramid_outputs)({hub.inputs[0].name: image})
    b, h, w = image.shape[:3]
    return {int(k[5:]): np.asarray(t)[:, 1 + spec.registers:].reshape(b, h // spec.patch, w // spec.patch, -1)
            for k, t in pyramid.items() if k.startswith("stage")}


def _close(ours, theirs):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    err = np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))
    assert err < 1e-5, err


def _image(h, w, seed=1):
    return np.random.default_rng(seed).normal(0, 1, (2, h, w, 3)).astype("float32")


@pytest.mark.parametrize("spec,shape,norm", [(V3, (64, 64), False), (V3, (64, 96), True),
                                             (V3_GATED, (64, 96), False)], ids=["square", "nonsquare", "gated"])
def test_dinov3_preset_gives_keras_hubs_pyramid(tmp_path, spec, shape, norm):
    hub, d = _preset(tmp_path, spec, shape, norm)
    layers = tuple(range(1, spec.depth + 1))
    ours = dino_encoder(spec, layers=layers, norm=norm)
    assert load_dino_preset(ours, d, spec) > 0
    image = _image(*shape)
    theirs = _hub_maps(hub, spec, image)
    for i, got in zip(layers, ours(image)):
        _close(got, theirs[i])


@pytest.mark.parametrize("spec,size,norm", [(V2, 42, False), (V2_REG, 56, True), (V2, 56, False)],
                         ids=["resized", "registers", "same-grid"])
def test_dinov2_preset_gives_keras_hubs_pyramid(tmp_path, spec, size, norm):
    hub, d = _preset(tmp_path, spec, (size, size), norm)
    layers = tuple(range(1, spec.depth + 1))
    ours = dino_encoder(spec, layers=layers, norm=norm)
    load_dino_preset(ours, d, spec)
    image = _image(size, size)
    theirs = _hub_maps(hub, spec, image)
    for i, got in zip(layers, ours(image)):
        _close(got, theirs[i])


def _traced(model):
    return tf.function(lambda x: model(x), input_signature=[tf.TensorSpec([None, None, None, 3], tf.float32)])


@pytest.mark.parametrize("spec,built,other", [(V3, (64, 64), (32, 80)), (V2_REG, (56, 56), (28, 28))],
                         ids=["dinov3", "dinov2"])
def test_one_trace_takes_any_size(tmp_path, spec, built, other):
    """Traced once with unknown H and W: sizes keras-hub cannot take give their shapes, and a size keras-hub
    CAN build (another model, loaded from the same preset) gives keras-hub's output."""
    _, d = _preset(tmp_path, spec, built)
    ours = dino_encoder(spec, layers=(1, spec.depth), norm=False)
    load_dino_preset(ours, d, spec)
    f = _traced(ours)
    p = spec.patch
    for h, w in ((3 * p, 5 * p), (5 * p, 3 * p)):
        out = f(_image(h, w))
        assert [tuple(t.shape) for t in out] == [(2, 3 if h < w else 5, 5 if h < w else 3, spec.width)] * 2
    cls = keras_hub.models.DINOV3Backbone if spec.family == "dinov3" else keras_hub.models.DINOV2Backbone
    hub = cls.from_preset(str(d), image_shape=(*other, 3))
    image = _image(*other, seed=2)
    theirs = _hub_maps(hub, spec, image)
    got = f(image)
    assert f.experimental_get_tracing_count() == 1
    _close(got[0], theirs[1])
    _close(got[1], theirs[spec.depth])


def test_rope_table_is_keras_hubs():
    from keras_hub.src.models.dinov3.dinov3_layers import DINOV3RopePositionEmbedding
    ref = DINOV3RopePositionEmbedding(hidden_dim=64, num_heads=2, rope_theta=100.0, patch_size=16)
    cos, sin = ref(tf.zeros([1, 48, 80, 3]))
    ours = vit.rope_tables(3, 5, 32, 100.0)
    np.testing.assert_allclose(ours[0], cos, atol=1e-6)
    np.testing.assert_allclose(ours[1], sin, atol=1e-6)


@pytest.mark.parametrize("antialias", [False, True])
def test_position_resize_is_keras_hubs(antialias):
    """DINOv2's resize at non-square grids too, against keras-hub's own function (which takes a fixed size)."""
    from keras_hub.src.models.dinov2.dinov2_layers import DINOV2Embedding
    pos = np.random.default_rng(4).normal(0, 1, (1, 1 + 37 * 37, 8)).astype("float32")
    for gh, gw in ((3, 5), (5, 3), (40, 24), (37, 37)):
        want = DINOV2Embedding._interpolate_position_embeddings(pos, 14, (518, 518), (gh * 14, gw * 14), antialias)
        np.testing.assert_allclose(vit.resize_positions(tf.constant(pos), gh, gw, antialias), want, atol=1e-5)


def _count(spec):
    """Our parameter count by shape (vit.py's layers), for sizes too big to build here."""
    c, m = spec.width, spec.mlp
    s = swiglu_width(m)
    if spec.family == "dinov2" and spec.gated:
        mlp = c * 2 * s + 2 * s + s * c + c
    else:
        mlp = 3 * c * m + 2 * m + c if spec.gated else 2 * c * m + m + c
    attn = 4 * c * c + 4 * c - (0 if spec.key_bias else c)
    block = attn + mlp + 2 * 2 * c + 2 * c
    tokens = c + spec.registers * c + ((1 + spec.pos_grid ** 2) * c if spec.family == "dinov2" else 0)
    return spec.patch * spec.patch * 3 * c + c + tokens + spec.depth * block + 2 * c


def test_parameter_counts_equal_keras_hubs_tiny():
    """keras-hub's count less its mask token (pretraining only) and DINOv2's resized position copy."""
    for spec in (V3, V3_GATED, V2, V2_REG):
        hub = _hub(spec, (spec.patch * 2, spec.patch * 2))
        skipped = spec.width + (hub.embeddings.interpolated_position_embeddings.numpy().size
                                if spec.family == "dinov2" else 0)
        ours = dino_encoder(spec, layers=(spec.depth,))
        assert ours.count_params() == hub.count_params() - skipped == _count(spec), spec


def test_variant_table_matches_keras_hubs_presets():
    """The real sizes: one built both ways (and `_count` held to tiny builds of every kind); DINOv2's exact
    preset counts (keras-hub's presets
    module, a 518 model: its mask token and 1370-token resized copy counted) for all, DINOv3's rounded
    ones within 2 %."""
    from keras_hub.src.models.dinov2.dinov2_presets import backbone_presets as v2_presets
    from keras_hub.src.models.dinov3.dinov3_presets import backbone_presets as v3_presets

    for name in ("dinov3_vits16plus",):
        spec = VIT_VARIANTS[name]
        hub = _hub(spec, (spec.patch * 2, spec.patch * 2))
        skipped = spec.width + (hub.embeddings.interpolated_position_embeddings.numpy().size
                                if spec.family == "dinov2" else 0)
        ours = dino_encoder(name, layers=(spec.depth,))
        assert ours.count_params() == hub.count_params() - skipped == _count(spec), name
    hub_names = {"s": "small", "b": "base", "l": "large", "g": "giant"}
    for name, spec in VIT_VARIANTS.items():
        if spec.family == "dinov2" and not spec.cls_position:  # EoMT's patch-16 ViTs: no keras-hub preset
            continue
        if spec.family == "dinov2":
            size = hub_names[name[len("dinov2_vit")]]
            preset = f"dinov2_with_registers_{size}" if name.endswith("_reg") else f"dinov2_{size}"
            extra = spec.width + (1 + spec.pos_grid ** 2) * spec.width  # mask token, resized copy at 518
            assert _count(spec) + extra == v2_presets[preset]["metadata"]["params"], name
        else:
            size = {"s16": "small", "s16plus": "small_plus", "b16": "base", "l16": "large",
                    "h16plus": "huge_plus"}[name[len("dinov3_vit"):]]
            params = v3_presets[f"dinov3_vit_{size}_lvd1689m"]["metadata"]["params"]
            assert abs(_count(spec) + spec.width - params) < 0.02 * params, name  # "29M": 28.7M


def test_other_presets_refused_before_building(tmp_path):
    _, d = _preset(tmp_path, V2, (28, 28))
    with pytest.raises(ConfigError, match=r"config\.json.*DINOV3Backbone") as e:
        check_dino_preset(d, V3)
    assert "\n" not in str(e.value)
    bigger = ViTVariant("dinov2", 14, 64, 3, 2, 64, pos_grid=4)
    with pytest.raises(ConfigError, match=r"config\.json.*hidden_dim 64 \(got 32\)"):
        check_dino_preset(d, bigger)
    with pytest.raises(ConfigError, match=r"config\.json.*hidden_dim 384"):
        check_dino_preset(d, "dinov2_vits14")
    raw = json.loads((d / "config.json").read_text())
    raw["config"]["num_register_tokens"] = 4
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="num_register_tokens 0 \\(got 4\\)"):
        check_dino_preset(d, V2)


def test_input_not_a_multiple_of_the_patch_refused():
    model = dino_encoder(V3, layers=(1,))
    with pytest.raises(ValueError, match="multiples of 16"):
        model(np.zeros((1, 50, 64, 3), "float32"))


def test_mixed_precision_keeps_layernorm_and_softmax_in_float32():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        half = dino_encoder(V3, layers=(V3.depth,))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    full = dino_encoder(V3, layers=(V3.depth,))
    _randomize(full)
    half.set_weights(full.get_weights())
    image = _image(32, 48)
    f = tf.function(lambda x: half(x)).get_concrete_function(tf.TensorSpec([None, None, None, 3]))
    ops = f.graph.get_operations()
    softmax = [o for o in ops if o.type == "Softmax"]
    moments = [o for o in ops if o.type == "SquaredDifference"]
    assert softmax and all(o.outputs[0].dtype == tf.float32 for o in softmax)
    assert moments and all(o.outputs[0].dtype == tf.float32 for o in moments)
    got, want = half(image), full(image)
    assert got.dtype == tf.float16
    err = np.max(np.abs(np.asarray(got, "float32") - np.asarray(want))) / np.max(np.abs(np.asarray(want)))
    assert err < 2e-2, err


def test_drop_path_zero_and_inference_are_the_plain_model():
    plain = dino_encoder(V3, layers=(V3.depth,))
    _randomize(plain)
    dropped = dino_encoder(V3, layers=(V3.depth,), drop_path_rate=0.5)
    dropped.set_weights(plain.get_weights())
    assert not any("drop_path" in layer.name for layer in plain.layers)
    assert sum("drop_path" in layer.name for layer in dropped.layers) == 2 * (V3.depth - 1)  # block 1 at rate 0
    image = _image(32, 32)
    want = plain(image)
    np.testing.assert_array_equal(dropped(image, training=False), want)
    with per_sample(tf.range(2, dtype=tf.int64), seed=3):
        np.testing.assert_array_equal(plain(image, training=True), want)
        assert np.max(np.abs(np.asarray(dropped(image, training=True)) - np.asarray(want))) > 1e-3
    v2 = dino_encoder(V2, layers=(1,), drop_path_rate=0.2)
    assert sum("drop_path" in layer.name for layer in v2.layers) == 2  # DINOv2: the same rate everywhere


def test_real_size_preset_loads_by_name(tmp_path):
    """A preset of a released size (dinov3_vits16's config, random weights) loads into dino_encoder by name
    (blocks after the last output not built: their arrays skipped) and gives keras-hub's blocks; the gated
    small-plus refuses it."""
    spec = VIT_VARIANTS["dinov3_vits16"]
    hub = _hub(spec, (32, 32), norm=True)
    _randomize(hub, vectors_only=True)
    hub.save_to_preset(str(tmp_path / "preset"))
    assert four_blocks(spec.depth) == (3, 6, 9, 12)
    ours = dino_encoder("dinov3_vits16", layers=(2, 3))
    assert not any(layer.name.startswith("block4_") for layer in ours.layers)
    load_dino_preset(ours, tmp_path / "preset")
    image = _image(32, 32)
    theirs = _hub_maps(hub, spec, image)
    for i, got in zip((2, 3), ours(image)):
        _close(got, theirs[i])
    with pytest.raises(ConfigError, match="use_gated_mlp True \\(got False\\)"):
        check_dino_preset(tmp_path / "preset", "dinov3_vits16plus")


def test_rope_converts_to_int8_without_a_negation():
    """DINOv3's rotary embedding in a full-integer int8 TFLite file: no NEG op (TFLite has no int8 kernel for
    it, so each of q's and k's rotations would leave int8 for a DEQUANTIZE, NEG, QUANTIZE). Fails for the
    rotate-half written as concat(-x2, x1)."""
    pytest.importorskip("ai_edge_litert")
    from seg_train.infer.tflite_export import app_function, convert, describe, frozen_function

    enc = dino_encoder(V3, layers=(V3.depth,))
    inp = keras.Input((None, None, 3))
    out = enc(inp)
    model = keras.Model(inp, keras.layers.Conv2D(3, 1)(out[0] if isinstance(out, (list, tuple)) else out))
    images = np.random.default_rng(2).integers(0, 256, (3, 1, 32, 48, 3), dtype=np.uint8)
    content = convert(frozen_function(app_function(model, [127.5] * 3, [64.0] * 3, 32, 48)), "int8",
                      lambda: ([image] for image in images))
    ops, float_ops, _, _ = describe(content)
    assert "NEG" not in ops, (ops, float_ops)
    assert float_ops.get("CONCATENATION", 0) == 0, float_ops
