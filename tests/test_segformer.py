"""model.backbone: mit_b0..mit_b5 and model.head: segformer in seg-train's own machinery: parameter counts
equal keras-hub's and the paper's for every size; train steps of MiT-B0 + SegFormer (synchronized BN, drop
path and dropout on) on 4 towers equal 1 tower with Keras' own BN; evaluation (whole and slide) of
non-square images equals an independent eager computation; seg-predict, the SavedModel and a TFLite file
of builtins predict what the model predicts; the MiT backbone under DeepLabV3+ and LR-ASPP, the SegFormer
head on another backbone; the config's checks.

Wrong answers these catch: a MiT size with other depths or widths than the paper's (or keras-hub's), the
SegFormer head's width not the paper's C; the head's BN left out of the BN layers the towers synchronise;
drop path or dropout masks that depend on the tower a sample lands on;
a model that only runs on square or fixed-size inputs; an op without a TFLite builtin; a key accepted
where it means nothing (an output stride the MiT cannot have, the stride-2 decoder without stride-2
features, a preset for a head that cannot hold it).
"""

import contextlib

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train import config as config_lib
from seg_train import models
from seg_train.config import ConfigError, ModelConfig
from seg_train.config.variants import MIT_VARIANTS
from seg_train.data.label_images import read_label
from seg_train.infer import evaluate as ev
from seg_train.infer.export import run_export
from seg_train.infer.predict import run_predict
from seg_train.models import param_groups, stochastic
from seg_train.objectives import pixel_losses as losses
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import EVAL_NAMES as NAMES
from tests.helpers import EVAL_NUM_CLASSES as NUM_CLASSES
from tests.helpers import (
    PAPER_MIT,
    TINY_MIT_B0,
    calibrate_bn,
    eval_config,
    normalized,
    open_reader,
    reference_scores,
    strategy,
    tiny_config,
)
from tests.helpers import mit_kwargs as _mit_kwargs
from tests.helpers import write_eval_split as write_split

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

# SegFormer with 150 classes (ADE20K), in millions as the paper's Table 1 gives them (encoder + decoder).
PAPER_MILLIONS = {"mit_b0": 3.8, "mit_b1": 13.7, "mit_b2": 27.5, "mit_b3": 47.3, "mit_b4": 64.1, "mit_b5": 84.7}


@pytest.mark.parametrize("name", ["mit_b1", "mit_b2", "mit_b3", "mit_b4", "mit_b5"])
def test_parameter_counts_equal_keras_hubs_and_the_papers(name):
    """Built, not run (B0's are compared in tests/test_presets.py, with its outputs). The encoder against
    the parameter count keras-hub records for its published preset of that size (its metadata counts a
    10-class classifier on the last level, 10 x (width + 1), for every size), the whole model with 150
    classes against the paper; B1 (C = 256) and B2 (C = 768) also against keras-hub's models built here."""
    from keras_hub.src.models.mit.mit_presets import backbone_presets_with_weights

    model = models.build(config_lib.from_dict({"data": {"root": "d", "num_classes": 150},
                                               "model": {"backbone": name, "head": "segformer"}}).model, 150)
    encoder = models.backbone_of(model).count_params()
    recorded = backbone_presets_with_weights[f"{name}_ade20k_{640 if name == 'mit_b5' else 512}"]["metadata"]
    assert encoder + 10 * (PAPER_MIT[name][0][-1] + 1) == recorded["params"]
    assert round(model.count_params() / 1e6, 1) == PAPER_MILLIONS[name]
    if name in ("mit_b1", "mit_b2"):
        hub = keras_hub.models.MiTBackbone(image_shape=(64, 64, 3), **_mit_kwargs(name))
        hub_seg = keras_hub.models.SegFormerImageSegmenter(
            backbone=keras_hub.models.SegFormerBackbone(image_encoder=hub, projection_filters=256 if name == "mit_b1"
                                                        else 768), num_classes=150)
        assert encoder == hub.count_params()
        assert model.count_params() == hub_seg.count_params()
    keras.backend.clear_session()


def _mit_config(tmp_path, **sections):
    model = {"backbone": "mit_b0", "head": "segformer", "segformer_channels": 16, **sections.pop("model", {})}
    return tiny_config(tmp_path, model=model, **sections)


# The towers' comparison: high rates, so that most samples' masks differ from most others' (SegFormer's 0.1 and
# 0.1 are the defaults); SGD (Adam's first step is lr * sign(g), which turns rounding in near-zero gradient
# elements into O(lr) differences, tests/test_towers.py).
DROP_PATH, HEAD_DROPOUT = 0.5, 0.3


def _tower_config(tmp_path, sync: bool):
    return _mit_config(tmp_path, data={"crop_size": [32, 48]},
                       model={"sync_batchnorm": sync, "fused_batchnorm": sync, "weight_decay": 0.05,
                              "drop_path_rate": DROP_PATH, "head_dropout": HEAD_DROPOUT},
                       train={"optimizer": "sgd", "learning_rate": 0.05})


@pytest.fixture(scope="module")
def towers_1_and_4(tmp_path_factory):
    """Two SGD steps of MiT-B0 + SegFormer (tests/helpers.py's TINY_MIT_B0 in mit_b0's place: a block per stage)
    at a non-square crop with drop path and dropout on, through the trainer's own step: 4 towers with
    synchronized BN; 1 tower with Keras' own BatchNormalization (no seg-train BN code); and the batch."""
    tmp = tmp_path_factory.mktemp("towers")
    rng = np.random.default_rng(0)
    images = rng.normal(size=(4, 32, 48, 3)).astype(np.float32)
    labels = rng.integers(0, 3, (4, 32, 48)).astype(np.uint8)
    labels[0, :20] = 255  # uneven ignored pixels across the towers
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(MIT_VARIANTS, "mit_b0", TINY_MIT_B0)
        for name, towers, cfg in (("one", 1, _tower_config(tmp / "one", False)),
                                  ("four", 4, _tower_config(tmp / "four", True))):
            step = TrainStep(TrainState(cfg, strategy(towers)))
            if name == "one":
                out["initial"] = [w.numpy() for w in step.state.model.trainable_weights]
            batch = next(iter(step.state.strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensors((images, labels)))))
            out[name] = (step, [float(step(batch).loss) for _ in range(2)])
    out["batch"] = images, labels
    return out


def test_four_towers_with_drop_path_and_synchronized_bn_equal_one_device(towers_1_and_4, monkeypatch):
    """4 towers (synchronized BN in the head, drop path in every MiT block, dropout before the classifier) give
    the weights of 1 tower with Keras' own BN (the tower tests' reference, on this model, to float precision:
    README). Fails for a mask drawn per call or from the tower's own row (a sample's mask then depends on
    where it lands), for the head's BN not synchronised, and for stochastic layers that do nothing in the step
    (the run without them must differ)."""
    (one, losses_1), (four, losses_4) = towers_1_and_4["one"], towers_1_and_4["four"]
    assert [b.name for b in one.state.bn_layers] == ["segformer_fuse_bn"]  # synchronised, re-estimated
    assert np.isfinite(losses_1).all() and losses_1[1] != losses_1[0]
    np.testing.assert_allclose(losses_1, losses_4, rtol=1e-5)
    for a, b in zip(one.state.model.weights, four.state.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, err_msg=a.path)
    assert type(four.state.bn_layers[0]).__name__ == "SyncBatchNormalization"
    assert type(one.state.bn_layers[0]) is keras.layers.BatchNormalization
    moved = max(float(np.abs(a - b.numpy()).max()) for a, b in zip(towers_1_and_4["initial"],
                                                                   one.state.model.trainable_weights))
    assert moved > 1e-3
    # The masks were drawn in the step: its first loss is the model's training pass from the initial weights with
    # the step's sample counters (rows 0-3 of step 0), eagerly, and not the pass without them (the layers'
    # identity outside per_sample).
    monkeypatch.setitem(MIT_VARIANTS, "mit_b0", TINY_MIT_B0)
    cfg = one.state.cfg
    fresh = TrainState(cfg, strategy(1), optimizer=False).model
    for a, b in zip(towers_1_and_4["initial"], fresh.trainable_weights):
        np.testing.assert_array_equal(a, b.numpy())
    images, labels = towers_1_and_4["batch"]

    def first_loss(counters):
        with counters:
            logits = fresh(images, training=True)
        total, norm = losses.objective_sum(logits, labels, 255, cfg.loss.class_weights, 1.0, cfg.loss.term_weights(),
                                           cfg.loss.ohem_threshold, cfg.loss.ohem_min_kept)
        return float(total / norm + param_groups.weight_decay(param_groups.decay_variables(fresh),
                                                              cfg.model.weight_decay))  # the step's L2 term

    np.testing.assert_allclose(first_loss(stochastic.per_sample(stochastic.sample_ids(0, 0, 0, 4, 1, 1), cfg.seed)),
                               losses_1[0], rtol=1e-5)
    assert abs(first_loss(contextlib.nullcontext()) - losses_1[0]) > 1e-3 * abs(losses_1[0])
    # The backbone/head split (train.backbone_lr_multiplier) puts the MiT in the backbone, the head out of it.
    model = one.state.model
    head = [v.path for v, in_backbone in zip(model.trainable_variables, models.backbone_variable_mask(model))
            if not in_backbone]
    assert head and all(p.startswith(("segformer_", "logits")) for p in head), head


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """MiT-B0 + SegFormer (its initial weights, BN statistics of the images), a checkpoint of it, and
    non-square val images."""
    tmp = tmp_path_factory.mktemp("mit_eval")
    sizes = [(37, 53), (64, 17), (50, 41), (29, 70)]
    root = write_split(tmp / "data", sizes, seed=1)
    cfg = _mit_config(tmp, data={"num_classes": NUM_CLASSES, "root": str(root)}, eval={"bn_reestimate_batches": 0})
    state = TrainState(cfg, tf.distribute.OneDeviceStrategy("/cpu:0"))
    reader = open_reader(cfg, "val")
    calibrate_bn(cfg, state.model, reader, passes=20)  # the head's BN statistics for these images
    run_dir = tmp / "run"
    state.step.assign(2)
    ckpt_lib.Checkpointer(run_dir / "checkpoints", 1, **state.checkpoint_objects()).save(2)
    return {"tmp": tmp, "cfg": cfg, "state": state, "root": root, "run_dir": run_dir, "sizes": sizes,
            "reader": reader}


@pytest.mark.parametrize("keys", [{}, {"mode": "slide", "crop_size": [32, 40], "stride": [16, 24]}],
                         ids=["whole", "slide"])
def test_evaluation_of_non_square_images_equals_an_eager_reference(evaluated, keys):
    modes = eval_config(**keys)
    result, n = ev.Evaluator(evaluated["state"], modes).evaluate(evaluated["reader"], NAMES, progress=False)
    assert n == len(evaluated["sizes"])
    ref = np.zeros((NUM_CLASSES, NUM_CLASSES), np.int64)
    for s in evaluated["reader"].samples:
        label = read_label(s.label)
        pred = reference_scores(evaluated["state"].model, normalized(evaluated["cfg"], s.image), modes).argmax(-1)
        keep = label != 255
        np.add.at(ref, (label[keep], pred[keep]), 1)
    np.testing.assert_array_equal(result.confusion_matrix, ref)
    assert (ref.sum(axis=0) > 100).sum() >= 2  # not one class everywhere: a real comparison


def test_predict_and_the_savedmodel_segment_any_size(evaluated):
    cfg, tmp = evaluated["cfg"], evaluated["tmp"]
    written = run_predict(cfg, tf.distribute.OneDeviceStrategy("/cpu:0"), str(evaluated["run_dir"]),
                          [str(evaluated["root"] / "JPEGImages")], tmp / "pred", progress=False)
    assert len(written) == len(evaluated["sizes"])
    export_dir = tmp / "model"
    run_export(cfg, tf.distribute.OneDeviceStrategy("/cpu:0"), str(evaluated["run_dir"]), export_dir, progress=False)
    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    for path in written:
        image = np.asarray(Image.open(evaluated["root"] / "JPEGImages" / f"{path.stem}.jpg").convert("RGB"))
        ref = reference_scores(evaluated["state"].model, normalized(cfg, evaluated["root"] / "JPEGImages" /
                                                                    f"{path.stem}.jpg"), cfg.eval).argmax(-1)
        np.testing.assert_array_equal(read_label(path), ref)
        np.testing.assert_array_equal(serve(image=tf.constant(image))["classes"].numpy(), ref)


def test_tflite_file_has_builtins_only_and_predicts_what_keras_predicts(evaluated):
    from ai_edge_litert.interpreter import Interpreter

    from seg_train.infer.tflite_export import app_function, convert, frozen_function

    cfg, model = evaluated["cfg"], evaluated["state"].model
    image = np.random.default_rng(5).integers(0, 256, (1, 64, 96, 3), dtype=np.uint8)
    content = convert(frozen_function(app_function(model, cfg.data.mean, cfg.data.std, 64, 96)), "none", None)
    interpreter = Interpreter(model_content=content)
    interpreter.allocate_tensors()
    ops = {op["op_name"] for op in interpreter._get_ops_details()}
    assert not [op for op in ops if "FLEX" in op.upper() or "CUSTOM" in op.upper()], ops
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], image)
    interpreter.invoke()
    classes = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])[0]
    x = (image.astype(np.float32) - np.array(cfg.data.mean, np.float32)) / np.array(cfg.data.std, np.float32)
    logits = model(x, training=False).numpy()[0]
    top2 = np.sort(logits, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-3
    assert clear.mean() > 0.9 and (classes[clear] == logits.argmax(-1)[clear]).all()
    assert len(np.unique(classes)) >= 2


FLOAT_KINDS = ("BATCH_MATMUL", "SOFTMAX", "GELU", "RSQRT", "SQUARED_DIFFERENCE")


@pytest.fixture(scope="module")
def int8_files(evaluated):
    """MiT-B0 + SegFormer at 64x96 as a full-integer int8 file and as one with FLOAT_KINDS in float32
    (--float-ops), calibrated on the same three random images."""
    from seg_train.infer.tflite_export import app_function, convert, frozen_function

    cfg, model = evaluated["cfg"], evaluated["state"].model
    images = np.random.default_rng(6).integers(0, 256, (3, 1, 64, 96, 3), dtype=np.uint8)
    frozen = frozen_function(app_function(model, cfg.data.mean, cfg.data.std, 64, 96))
    return {"images": images,
            "full": convert(frozen, "int8", lambda: ([image] for image in images)),
            "float_ops": convert(frozen, "int8", lambda: ([image] for image in images), FLOAT_KINDS)}


def test_int8_file_keeps_every_layer_norm_in_int8(int8_files):
    """Full-integer quantization of MiT-B0 + SegFormer: no op but the input's CAST and QUANTIZE computes in
    float32. Fails for Keras' own LayerNormalization, whose shift -mean * inv converts to a NEG op with no
    int8 kernel (each LayerNorm then leaves int8 for a DEQUANTIZE, NEG, QUANTIZE)."""
    from seg_train.infer.tflite_export import describe

    ops, float_ops, _, _ = describe(int8_files["full"])
    assert float_ops == {"CAST": 1, "QUANTIZE": 1}, float_ops
    assert ops["MEAN"] >= 2 * 15  # the 15 LayerNorms of MiT-B0 (moments: two MEANs each) are in the file


def test_int8_file_with_the_attention_and_layer_norm_ops_in_float(evaluated, int8_files):
    """--float-ops for a SegFormer (docs/DEPLOY.md): the op kinds XNNPACK declines in int8 stay in float32,
    every one of them, and the rest stays int8; LiteRT then predicts what Keras predicts on the pixels
    whose top two logits are clearly apart. Fails for a denylist that does not reach the converter."""
    from ai_edge_litert.interpreter import Interpreter

    from seg_train.infer.tflite_export import describe

    cfg, model = evaluated["cfg"], evaluated["state"].model
    images, content = int8_files["images"], int8_files["float_ops"]
    ops, float_ops, _, _ = describe(content)
    assert {op: float_ops.get(op) for op in FLOAT_KINDS} == {op: ops[op] for op in FLOAT_KINDS}
    assert "FULLY_CONNECTED" not in float_ops and "CONV_2D" not in float_ops
    interpreter = Interpreter(model_content=content)
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], images[0])
    interpreter.invoke()
    classes = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])[0]
    x = (images[0].astype(np.float32) - np.array(cfg.data.mean, np.float32)) / np.array(cfg.data.std, np.float32)
    logits = model(x, training=False).numpy()[0]
    top2 = np.sort(logits, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 0.05 * np.ptp(logits)
    assert clear.sum() > 1000 and (classes[clear] == logits.argmax(-1)[clear]).mean() > 0.99
    # Fewer XNNPACK partitions than the full-integer file (each DELEGATE node is one).
    partitions = []
    for c in (content, int8_files["full"]):
        it = Interpreter(model_content=c)
        it.allocate_tensors()
        partitions.append([op["op_name"] for op in it._get_ops_details()].count("DELEGATE"))
    assert partitions[0] < partitions[1], partitions


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_layer_norm_is_keras_layer_normalization(policy):
    """layers.LayerNorm (models/layers.py: the shift as beta - mean * inv, for int8 files) against Keras'
    LayerNormalization with the same gamma and beta: outputs, and the gradients of the input, gamma and beta. Under
    mixed_float16 the input is float16, as the model's layers give it (Keras' LayerNormalization does not autocast),
    and its squares (|x| ~ 400) overflow float16: the moments must be in float32, as Keras'. Fails for a mean left
    in, the variance over another axis, epsilon outside the root, gamma or beta dropped, moments in float16."""
    from seg_train.models.layers import LayerNorm

    rng = np.random.default_rng(0)
    x = tf.cast(rng.normal(5.0, 400.0, (2, 5, 7, 16)), "float16" if policy == "mixed_float16" else "float32")
    gamma, beta = rng.normal(1.0, 0.5, 16), rng.normal(0.0, 0.5, 16)
    weights = tf.constant(rng.normal(size=(2, 5, 7, 16)), tf.float32)
    got = []
    for layer in (LayerNorm(epsilon=1e-5, dtype=policy), keras.layers.LayerNormalization(epsilon=1e-5, dtype=policy)):
        layer.build(x.shape)
        layer.set_weights([gamma, beta])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
        got.append([y.numpy().astype(np.float32)] + [np.asarray(g, np.float32)
                                                     for g in tape.gradient(loss, [x, *layer.weights])])
    assert got[0][0].dtype == got[1][0].dtype
    tol = 1e-5 if policy == "float32" else 2e-3
    assert np.isfinite(got[0][0]).all()
    for ours, keras_ in zip(*got):
        np.testing.assert_allclose(ours, keras_, rtol=tol, atol=tol * np.abs(keras_).max())


@pytest.mark.parametrize("head, backbone, features", [
    ("deeplabv3plus", "mit_b0", [(16, 24, 32), (2, 3, 256)]),   # stride 4 and 32
    ("lraspp", "mit_b0", [(8, 12, 64), (2, 3, 256)]),           # stride 8 and 32
    ("segformer", "tiny", [(16, 24, 32), (8, 12, 64), (4, 6, 128)]),  # strides 4, 8 and 16 (tiny's output stride)
])
def test_every_head_on_the_mit_and_segformer_on_another_backbone(head, backbone, features):
    cfg = config_lib.from_dict({"data": {"root": "d", "num_classes": 3},
                                "model": {"backbone": backbone, "head": head, "segformer_channels": 8,
                                          "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4}}).model
    model = models.build(cfg, 3)
    x = np.random.default_rng(0).normal(size=(1, 64, 96, 3)).astype(np.float32)
    got = models.backbone_of(model)(x)
    assert [tuple(f.shape[1:]) for f in got] == features
    assert model(x).shape == (1, 64, 96, 3)


def test_defaults_resolved_from_the_backbone():
    def model(**keys):
        return config_lib.from_dict({"data": {"root": "d", "num_classes": 3}, "model": keys})

    assert model(backbone="mit_b0", head="segformer").model.output_stride == 32
    assert model(backbone="mit_b1", head="segformer").model.segformer_channels == 256
    assert model(backbone="mit_b2", head="segformer").model.segformer_channels == 768
    assert model(backbone="mit_b2", head="segformer", segformer_channels=64).model.segformer_channels == 64
    # SegFormer's regularisation for the MiT and its head; nothing (null, as an older run's config) elsewhere.
    seg = model(backbone="mit_b0", head="segformer").model
    assert (seg.drop_path_rate, seg.head_dropout) == (0.1, 0.1)
    assert (model(backbone="mit_b0").model.drop_path_rate, model(backbone="mit_b0").model.head_dropout) == (0.1, None)
    assert (model(head="segformer").model.drop_path_rate, model(head="segformer").model.head_dropout) == (None, 0.1)
    assert (model().model.drop_path_rate, model().model.head_dropout) == (None, None)
    mit = model(backbone="mit_b3", head="segformer").data
    assert (mit.mean, mit.std) == ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375))  # keras-hub's converter
    old = model()  # an old config: the model it always built
    assert (old.model.output_stride, old.model.backbone, old.model.head) == (16, "mobilenetv2", "deeplabv3plus")


@pytest.mark.parametrize("sections, expected", [
    ({"model": {"backbone": "mit_b0", "output_stride": 16}},
     "error: not available for this backbone (model.output_stride): expected 32 (or no value) with model.backbone "
     "'mit_b0': the Mix Transformer's stages have no dilated form, got 16"),
    ({"model": {"output_stride": 32}},
     "error: not available for this backbone (model.output_stride): expected one of 8, 16 (or no value) with "
     "model.backbone 'mobilenetv2' (32 is the MiT backbones' fixed stride), got 32"),
    ({"model": {"backbone": "mit_b0", "decoder_stride": 2}},
     "error: not available for this backbone (model.decoder_stride): expected 4 (or no value) with model.backbone "
     "'mit_b0': the Mix Transformer has no stride-2 features, got 2"),
    ({"model": {"backbone": "mit_b0", "init_weights": "p"}},
     "error: not available for this model (model.init_weights): a keras-hub SegFormer preset needs model.backbone "
     "mit_b0..mit_b5 and model.head segformer, a transformers EoMT folder a dinov*_ backbone and model.head eomt, "
     "got 'mit_b0' and 'deeplabv3plus'"),
    ({"model": {"backbone": "mit_b0", "head": "segformer", "init_weights": "p", "backbone_weights": "q"}},
     "error: two initialisations (model.backbone_weights): null with model.init_weights (the SegFormer preset holds "
     "the encoder too)"),
    ({"model": {"backbone": "mit_b0"}, "data": {"crop_size": [28, 64]}},
     "error: too small for this backbone (data.crop_size): expected at least 29 pixels per side with model.backbone "
     "'mit_b0' (its first stage's 8x8 spatial reduction at stride 4), got [28, 64]"),
    ({"model": {"backbone": "mit_b0"}, "eval": {"mode": "slide", "crop_size": [64, 16]}},
     "error: too small for this backbone (eval.crop_size): expected at least 29 pixels per side with model.backbone "
     "'mit_b0' (its first stage's 8x8 spatial reduction at stride 4), got [64, 16]"),
    ({"model": {"segformer_channels": 0}},
     "error: out of range (model.segformer_channels): expected a positive number, got 0"),
    ({"model": {"drop_path_rate": 0.1}},
     "error: not available for this backbone (model.drop_path_rate): 0 (or no value) with model.backbone "
     "'mobilenetv2': drop path skips a transformer's residual blocks (mit_*, dinov3_*, dinov2_*), got 0.1"),
    ({"model": {"backbone": "mit_b0", "head_dropout": 0.1}},
     "error: not available for this head (model.head_dropout): 0 (or no value) with model.head 'deeplabv3plus': it "
     "is the SegFormer head's dropout before its classifier, got 0.1"),
    ({"model": {"backbone": "mit_b0", "drop_path_rate": 1.0}},
     "error: out of range (model.drop_path_rate): expected a number in [0, 1), got 1.0"),
    ({"model": {"backbone": "mit_b6"}}, "error: invalid value (model.backbone): expected one of tiny, mobilenetv2, "),
])
def test_config_errors_are_one_line_naming_the_key(sections, expected):
    raw = {"data": {"root": "d", "num_classes": 3, **sections.pop("data", {})}, **sections}
    with pytest.raises(ConfigError) as e:
        config_lib.from_dict(raw)
    assert f"error: {e.value}".startswith(expected), str(e.value)
    assert "\n" not in str(e.value)


def test_the_mit_backbone_is_the_models_only_nested_model_and_has_no_batchnorm():
    model = models.build(ModelConfig(backbone="mit_b0", head="segformer", segformer_channels=8), 3)
    assert models.backbone_of(model).name == "mit_b0"
    assert [b.name for b in models.batchnorm_layers(model)] == ["segformer_fuse_bn"]
    assert ModelConfig().output_stride is None  # unresolved: build takes the backbone's (16 here)
    assert models.build(ModelConfig(backbone="tiny", aspp_channels=8, decoder_channels=8, low_level_channels=4),
                        3).get_layer("aspp1_conv").dilation_rate == (6, 6)


def test_attention_logits_and_softmax_in_float32_under_mixed_float16():
    """Under mixed_float16 the attention's inputs are float16; q.k / sqrt(d) beyond float16's 65504 must
    still give the float64 reference (in float16 the logits would be inf and the softmax NaN)."""
    from seg_train.models.mit.encoder import EfficientAttention

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 3, 5, 16)) for _ in range(3))
    q[..., :8] *= 300.0
    k[..., :8] *= 300.0  # logits up to ~1e5 after the 1/sqrt(8) scale
    layer = EfficientAttention(2, dtype="mixed_float16")
    got = layer(*(tf.constant(t, tf.float16) for t in (q, k, v))).numpy().astype(np.float64)
    q16, k16, v16 = (t.astype(np.float16).astype(np.float64) for t in (q, k, v))

    def heads(t):  # [1, h, w, 16] -> [2, h*w, 8]
        return t.reshape(1, -1, 2, 8).transpose(0, 2, 1, 3)[0]

    logits = heads(q16) @ heads(k16).transpose(0, 2, 1) / np.sqrt(8)
    assert np.abs(logits).max() > 65504
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = ((p / p.sum(-1, keepdims=True)) @ heads(v16)).transpose(1, 0, 2).reshape(1, 3, 5, 16)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


def test_precise_bn_gives_the_heads_bn_the_population_statistics_of_its_input(tmp_path):
    """Precise BN (before every evaluation and export) reaches the SegFormer head's BN through the nested
    MiT: its moving statistics become the mean and variance of its input over the re-estimation batches."""
    from seg_train.data import synthetic
    from seg_train.infer import precise_bn
    from tests.helpers import global_batches, population

    root = synthetic.generate(tmp_path / "data", num_train=8, num_val=2, size=(40, 48), num_classes=3, seed=0)
    cfg = _mit_config(tmp_path, data_root=root, data={"batch_size": 4})
    state = TrainState(cfg, strategy(1))
    reader = open_reader(cfg, "train")
    assert precise_bn.PreciseBN(state).reestimate(reader, 2, progress=False) is True
    fuse = keras.Model(state.model.input, state.model.get_layer("segformer_fuse_conv").output)
    batches = global_batches(type("T", (), {"state": state})(), reader, 2)
    mean, var = population([fuse(b, training=False).numpy() for b in batches])
    bn = state.model.get_layer("segformer_fuse_bn")
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, rtol=1e-3, atol=1e-6)
