"""The DINO ViTs as a user configures them: the keys (model.backbone dinov*_, model.head linear, model.vit_layers,
model.neck, model.neck_channels, model.freeze_backbone, train.layer_decay) through the config loader, the model
built from it, the train step and the seg-train command.

Wrong answers these fail for: a key read but dropped before the model or the update (layer decay ignored, the
blocks or the neck's width not the configured ones); layer decay off by one level (the last block at decay^1,
the embeddings at block 1's rate); a frozen backbone that still moves, keeps optimizer slots or trains its
stochastic layers; frozen or fine-tuned ViTs whose 4 towers differ from 1, or a frozen one whose resumed run
differs from the uninterrupted one; an odd-sized image not padded to whole patches (or the padding predicted); AdamW
decaying position embeddings, tokens or layer scales; the config's DINO table out of step with the encoders.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from seg_train import models
from seg_train.config import ConfigError, from_dict
from seg_train.config.variants import VIT_VARIANTS
from seg_train.data import synthetic
from seg_train.infer.serving import serving_module
from seg_train.infer.tflite_export import input_size
from seg_train.objectives import pixel_losses as losses
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from seg_train.train.update import decoupled_decay
from tests.helpers import TINY_VITS16, resume_bitwise, strategy, tiny_config


def _raw(**model):
    return {"data": {"root": "data", "num_classes": 3, "crop_size": [32, 48]},
            "model": {"backbone": "dinov3_vits16", **model}}


# ---- the config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backbone, head, want_layers, want_neck, want_stride", [
    ("dinov3_vits16", "linear", [3, 6, 9, 12], None, 16),
    ("dinov2_vitl14", "linear", [6, 12, 18, 24], None, 16),
    ("dinov3_vitb16", "segformer", [12], "simple_pyramid", 32),
    ("dinov2_vits14_reg", "deeplabv3plus", [12], "simple_pyramid", 16),
])
def test_vit_defaults(backbone, head, want_layers, want_neck, want_stride):
    """The linear head reads 4 evenly spaced blocks (DINOv2's "+ms"), a neck the last block; SegFormer's head
    reads the pyramid's 4 levels (stride 32 last), the other heads stride 16."""
    raw = _raw(backbone=backbone, head=head)
    raw["data"]["crop_size"] = [28, 42] if backbone.startswith("dinov2") else [32, 48]
    m = from_dict(raw).model
    assert (m.vit_layers, m.neck, m.output_stride) == (want_layers, want_neck, want_stride)


@pytest.mark.parametrize("model, data, key", [
    ({"backbone": "mobilenetv2", "head": "linear"}, {}, "model.head"),
    ({"backbone": "mit_b0", "vit_layers": [1]}, {}, "model.vit_layers"),
    ({"backbone": "tiny", "neck": "simple_pyramid"}, {}, "model.neck"),
    ({"vit_layers": [4, 13]}, {}, "model.vit_layers"),
    ({"vit_layers": [4, 2]}, {}, "model.vit_layers"),
    ({"head": "linear", "neck": "simple_pyramid"}, {}, "model.neck"),
    ({"head": "segformer"}, {"crop_size": [32, 40]}, "data.crop_size"),
    ({"backbone": "dinov2_vits14", "head": "linear"}, {"crop_size": [32, 32]}, "data.crop_size"),
    ({"head": "linear", "freeze_backbone": True, "drop_path_rate": 0.1}, {}, "model.drop_path_rate"),
    ({"head": "deeplabv3plus", "decoder_stride": 2}, {}, "model.decoder_stride"),
])
def test_vit_keys_refused_in_one_line(model, data, key):
    raw = _raw(**model)
    raw["data"].update(data)
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_layer_decay_needs_a_vit():
    raw = _raw(backbone="mobilenetv2")
    raw["train"] = {"layer_decay": 0.8}
    with pytest.raises(ConfigError, match="train.layer_decay"):
        from_dict(raw)


def test_tflite_input_size_must_be_whole_patches():
    cfg = from_dict(_raw(head="linear"))
    assert input_size(cfg, None) == (32, 48)
    with pytest.raises(ConfigError, match="--input-size"):
        input_size(cfg, (50, 64))


# ---- the model and the update ----------------------------------------------------------------------------
def _images(b=4, h=32, w=48, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(b, h, w, 3)).astype(np.float32)
    labels = rng.integers(0, 3, (b, h, w)).astype(np.uint8)
    labels[0, :10] = 255
    return images, labels


def _one_sgd_step(cfg, images, labels, lr):
    trainer = TrainStep(TrainState(cfg, strategy(1)))
    model = trainer.state.model
    with tf.GradientTape() as tape:  # the plain tape's gradient of the global mean cross-entropy
        ce, count = losses.pixel_cross_entropy_sum(model(images, training=True), labels, 255)
        loss = ce / count
    grads = tape.gradient(loss, model.trainable_variables)
    start = [v.numpy() for v in model.trainable_variables]
    dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    trainer(next(iter(dist)), lr=lr)
    return trainer, grads, start


@pytest.mark.slow
def test_layer_decay_rates_are_the_hand_table(tmp_path):
    """One plain SGD step, 3 blocks, train.layer_decay 0.5, backbone x0.1, head x2: every variable moves by
    -lr * rate * (the plain tape's gradient), the rates worked out by hand (block i of 3 at 0.1 * 0.5^(3 - i),
    the embeddings at 0.1 * 0.5^3, the final norm with block 3, the head at 2)."""
    lr = 0.5
    cfg = tiny_config(tmp_path, data={"crop_size": [32, 48]},
                      model={"backbone": "dinov3_vits16", "head": "linear", "vit_layers": [3], "weight_decay": 0.0},
                      train={"optimizer": "sgd", "momentum": 0.0, "learning_rate": lr, "layer_decay": 0.5,
                             "backbone_lr_multiplier": 0.1, "head_lr_multiplier": 2.0})
    images, labels = _images()
    trainer, grads, start = _one_sgd_step(cfg, images, labels, lr)
    by_hand = {"patch_embed": 0.0125, "tokens": 0.0125, "block1": 0.025, "block2": 0.05, "block3": 0.1,
               "norm": 0.1, "linear_bn": 2.0, "logits": 2.0}
    seen = set()
    for g, w0, v in zip(grads, start, trainer.state.model.trainable_variables):
        group = v.path.split("/")[0].split("_")[0] if v.path.startswith("block") else v.path.split("/")[0]
        seen.add(group)
        if v.path == "norm/beta":
            continue  # the head's BN removes any per-channel shift: its gradient is 0 up to rounding
        want = -lr * by_hand[group] * g.numpy()
        np.testing.assert_allclose(v.numpy() - w0, want, rtol=2e-3, err_msg=v.path,
                                   atol=max(1e-3 * np.abs(want).max(), 2 * np.spacing(np.abs(w0).max())))
    assert seen == set(by_hand)


@pytest.mark.slow
def test_frozen_backbone_has_no_gradient_no_slots_and_stays_put(tmp_path):
    """model.freeze_backbone: only the head is trainable (the optimizer's slots are the head's), three Adam steps
    leave every backbone weight bitwise as built, and the head moves as the plain tape says."""
    cfg = tiny_config(tmp_path, data={"crop_size": [32, 48]},
                      model={"backbone": "dinov3_vits16", "head": "segformer", "vit_layers": [2],
                             "neck_channels": 8, "segformer_channels": 8, "freeze_backbone": True})
    trainer = TrainStep(TrainState(cfg, strategy(2)))
    model, opt = trainer.state.model, trainer.state.optimizer
    encoder = models.backbone_of(model)
    frozen = [v.numpy() for v in encoder.weights]
    assert encoder.weights and not encoder.trainable_variables
    assert all(not v.path.startswith(("block", "patch_embed", "tokens")) for v in model.trainable_variables)
    slots = [v for v in opt.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(slots) == 2 * len(model.trainable_variables)
    images, labels = _images()
    dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    batch = next(iter(dist))
    head0 = [v.numpy() for v in model.trainable_variables]
    for _ in range(3):
        trainer(batch, lr=1e-2)
    for a, v in zip(frozen, encoder.weights):
        assert a.tobytes() == v.numpy().tobytes(), v.path
    assert max(float(np.abs(a - v.numpy()).max()) for a, v in zip(head0, model.trainable_variables)) > 1e-3


@pytest.mark.slow
def test_adamw_decays_kernels_not_embeddings_tokens_or_layer_scales(tmp_path):
    """AdamW's decoupled decay on a DINOv2 with registers: every kernel, and none of the position embeddings,
    CLS / register tokens, layer scales, norms or biases."""
    cfg = tiny_config(tmp_path, data={"crop_size": [28, 42]},
                      model={"backbone": "dinov2_vits14_reg", "head": "linear", "vit_layers": [1],
                             "weight_decay": 0.0},
                      train={"optimizer": "adamw"})
    state = TrainState(cfg, strategy(1))
    decayed = {v.path: d for v, d in zip(state.variables, decoupled_decay(state.optimizer, state.variables))}
    assert {p for p, d in decayed.items() if d} == {p for p in decayed if p.endswith("/kernel")}
    for name in ("tokens/position_embeddings", "tokens/cls_token", "tokens/register_tokens", "block1_ls1/gamma"):
        assert decayed[name] is False, name


@pytest.mark.slow
def test_vit_layers_and_neck_channels_reach_the_model(tmp_path):
    """model.vit_layers picks the blocks (none built after the last), the linear head reads their concatenated
    maps; model.neck_channels is the pyramid's width."""
    cfg = tiny_config(tmp_path, data={"crop_size": [32, 48]},
                      model={"backbone": "dinov3_vits16", "head": "linear", "vit_layers": [1, 3]})
    model = TrainState(cfg, strategy(1), optimizer=False).model
    encoder = models.backbone_of(model)
    assert {layer.name for layer in encoder.layers if layer.name.startswith("map")} == {"map1", "map3"}
    assert not any(layer.name.startswith("block4_") for layer in encoder.layers)
    assert model.get_layer("linear_bn").gamma.shape == (2 * 384,)
    cfg = tiny_config(tmp_path / "n", data={"crop_size": [32, 48]},
                      model={"backbone": "dinov3_vits16", "head": "deeplabv3plus", "vit_layers": [1],
                             "neck_channels": 12, "aspp_channels": 8, "decoder_channels": 8})
    model = TrainState(cfg, strategy(1), optimizer=False).model
    assert model.get_layer("pyramid_s16_output").kernel.shape == (3, 3, 12, 12)
    assert model.get_layer("pyramid_s4_up2").kernel.shape[-2] == 384 // 4


@pytest.mark.slow
def test_odd_sized_image_padded_to_whole_patches(tmp_path):
    """seg-predict's serving function on a 50x70 image (not whole patches): the scores are the model's on the
    image padded with zeros (the mean colour) to 64x80, cropped back; the model itself refuses 50x70."""
    cfg = tiny_config(tmp_path, data={"crop_size": [32, 48]},
                      model={"backbone": "dinov3_vits16", "head": "linear", "vit_layers": [2]})
    model = TrainState(cfg, strategy(1), optimizer=False).model
    mean, std = np.array(cfg.data.mean, np.float32), np.array(cfg.data.std, np.float32)
    image = np.random.default_rng(1).integers(0, 256, (50, 70, 3)).astype(np.uint8)
    out = serving_module(model, cfg.data.mean, cfg.data.std).serve(tf.constant(image))
    x = np.zeros((1, 64, 80, 3), np.float32)
    x[0, :50, :70] = (image - mean) / std
    want = tf.nn.softmax(model(x, training=False)[0, :50, :70]).numpy()
    np.testing.assert_allclose(out["probabilities"].numpy(), want, atol=1e-5)
    assert out["classes"].shape == (50, 70)
    with pytest.raises(ValueError, match="multiples of 16"):
        model(tf.zeros([1, 50, 70, 3]))


# ---- towers and resume -----------------------------------------------------------------------------------
def _tower_config(tmp_path, frozen: bool, sync: bool):
    return tiny_config(tmp_path, data={"crop_size": [32, 48]},
                       model={"backbone": "dinov3_vits16", "head": "linear", "vit_layers": [2],
                              "sync_batchnorm": sync, "fused_batchnorm": sync, "weight_decay": 0.05,
                              "freeze_backbone": frozen, "drop_path_rate": None if frozen else 0.5},
                       train={"optimizer": "sgd", "learning_rate": 0.05})


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True], ids=["fine_tuned", "frozen"])
def test_four_towers_equal_one_device(tmp_path, frozen, monkeypatch):
    """Two SGD steps of a 2-block DINOv3 (tests/helpers.py's TINY_VITS16 in dinov3_vits16's place) + the linear
    head, drop path 0.5 when fine-tuned: 4 towers (synchronized BN in the head) end at 1 tower's weights (Keras' own
    BN). Fails for drop-path masks drawn per tower row or per call, for a frozen backbone that trains on some tower,
    and for the head's BN not synchronised."""
    monkeypatch.setitem(VIT_VARIANTS, "dinov3_vits16", TINY_VITS16)
    images, labels = _images()
    out = {}
    for name, towers in (("one", 1), ("four", 4)):
        step = TrainStep(TrainState(_tower_config(tmp_path / name, frozen, towers > 1), strategy(towers)))
        batch = next(iter(step.state.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors((images, labels)))))
        out[name] = (step, [float(step(batch).loss) for _ in range(2)])
    (one, l1), (four, l4) = out["one"], out["four"]
    assert np.isfinite(l1).all() and l1[0] != l1[1]
    np.testing.assert_allclose(l1, l4, rtol=1e-5)
    for a, b in zip(one.state.model.weights, four.state.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=2e-5, err_msg=a.path)
    keras.backend.clear_session()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=12, num_val=2, size=(40, 48),
                              num_classes=3)


@pytest.mark.slow
def test_resumed_frozen_vit_run_is_bitwise_the_uninterrupted_one(tmp_path, data_root, monkeypatch):
    """seg-train on 2 towers, AdamW with a frozen backbone, 4 steps with checkpoints at 2 and 4; the run rewound to
    step 2 and resumed: ckpt-4 bitwise the first run's; no optimizer slot for a backbone variable in the checkpoint,
    and the backbone's weights those of the seeded build. (dinov3_vits16's structure at tests/helpers.py's
    TINY_VITS16 size.) The fine-tuned ViT's resume (its drop path, layer decay and AdamW) is
    tests/test_panoptic_model.py's: one resumed run per kind of draws (DEVELOPING.md)."""
    monkeypatch.setitem(VIT_VARIANTS, "dinov3_vits16", TINY_VITS16)
    raw = {"seed": 3, "run_dir": "run",
           "data": {"root": str(data_root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                    "num_parallel_calls": 2, "val_split": "none"},
           "model": {"backbone": "dinov3_vits16", "head": "segformer", "vit_layers": [2], "neck_channels": 8,
                     "segformer_channels": 8, "freeze_backbone": True},
           "train": {"num_steps": 4, "checkpoint_every": 2, "summary_every": 1, "image_summary_every": 0,
                     "optimizer": "adamw", "learning_rate": 1e-3},
           "eval": {"bn_reestimate_batches": 0}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    resume_bitwise(tmp_path / "cfg.yaml", tmp_path)
    cfg = from_dict(raw, tmp_path)
    keras.utils.set_random_seed(0)
    built = models.build(cfg.model, 3, cfg.seed)
    encoder = models.backbone_of(built)
    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "checkpoints" / "ckpt-4"))
    state = TrainState(cfg, strategy(1))
    state.restore_weights(str(tmp_path / "run" / "checkpoints" / "ckpt-4"))
    for v0, v in zip(encoder.weights, models.backbone_of(state.model).weights):
        assert v0.numpy().tobytes() == v.numpy().tobytes(), v.path
    # Adam's m and v per trainable variable: the head's only.
    shapes = reader.get_variable_to_shape_map()
    slots = [tuple(shapes[k]) for k in shapes if k.startswith("optimizer/_variables/")]
    assert len(slots) == 2 * len(state.model.trainable_variables)
    assert set(slots) <= {tuple(v.shape) for v in state.model.trainable_variables}
    assert (16, 16, 3, TINY_VITS16.width) not in slots  # the patch embedding's


@pytest.fixture(scope="module")
def vits16_preset(tmp_path_factory):
    """keras-hub's DINOV3Backbone at dinov3_vits16's sizes (random weights, LayerNorm gammas off 1), saved as a
    preset directory as users download them."""
    import keras_hub

    hub = keras_hub.models.DINOV3Backbone(
        patch_size=16, num_layers=12, hidden_dim=384, num_heads=6, intermediate_dim=1536, num_register_tokens=4,
        layer_scale_init_value=1.0, use_gated_mlp=False, hidden_activation="gelu", use_key_bias=False,
        rope_theta=100.0, layer_norm_eps=1e-5, image_shape=(32, 32, 3))
    rng = np.random.default_rng(0)
    for v in hub.weights:
        if len(v.shape) == 1 and "gamma" in v.path:
            v.assign((1.0 + rng.normal(0, 0.1, v.shape)).astype("float32"))
    path = tmp_path_factory.mktemp("preset") / "dinov3_vits16"
    hub.save_to_preset(str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("head", ["linear", "eomt"])
def test_backbone_weights_reach_the_runs_vit(tmp_path, vits16_preset, head):
    """model.backbone_weights (a keras-hub DINOv3 preset directory) through the config and TrainState: every
    backbone variable of the run's model is what load_dino_preset (held to keras-hub's own backbone in
    tests/test_dino.py) reads from the directory, under the linear head and inside EoMT; dropping the key leaves
    the seeded initialisation, which differs."""
    from seg_train.models.dino.presets import load_dino_preset
    from seg_train.models.dino.vit import dino_encoder

    keys = {"vit_layers": [12]} if head == "linear" else {"num_queries": 3, "eomt_blocks": 1}
    cfg = tiny_config(tmp_path, data={"crop_size": [32, 48]},
                      model={"backbone": "dinov3_vits16", "head": head, "backbone_weights": str(vits16_preset),
                             **keys})
    got = models.backbone_of(TrainState(cfg, strategy(1), optimizer=False).model)
    want = dino_encoder("dinov3_vits16", layers=(12,))
    load_dino_preset(want, vits16_preset, "dinov3_vits16")
    assert len(got.weights) == len(want.weights)
    for a, b in zip(got.weights, want.weights):
        assert a.numpy().tobytes() == b.numpy().tobytes(), a.path
    seeded = models.backbone_of(models.build(dataclasses.replace(cfg.model, backbone_weights=None), 3))
    assert any(a.numpy().tobytes() != b.numpy().tobytes() for a, b in zip(seeded.weights, want.weights)
               if "norm" in a.path and "gamma" in a.path)
