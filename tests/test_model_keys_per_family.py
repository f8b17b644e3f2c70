"""Model keys that apply to every head, through each model family the config builds (TrainState from a
config: the real build path), not only through DeepLabV3+: model.bn_momentum and model.sync_batchnorm reach
every BN layer of DeepLabV3+, Lite R-ASPP and the SegFormer head (on the tiny backbone, so each build is
cheap). The momentum is set away from its default, so a head built with the default passes nowhere.
model.drop_path_rate reaches the MiT under each of the three heads. The train keys after them go through
each family by one SGD step: the backbone and head learning-rate multipliers, the weight decay's set of
variables, train.precision mixed_float16; and model.head_dropout, SegFormer's alone.

Wrong answers these catch: a head whose BN is built with a fixed momentum (or Keras' default) instead of the
config's; a head's BN built as Keras' own layer whatever model.sync_batchnorm says; drop path applied only
under the SegFormer head; a multiplier, a decay exclusion or the float32 logits lost in one family only.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train import models
from seg_train.models.sync_bn import SyncBatchNormalization
from seg_train.run.state import TrainState
from tests.helpers import random_batch, strategy, tiny_config

MOMENTUM = 0.7  # the default is 0.9
HEADS = {"deeplabv3plus": {}, "lraspp": {"lraspp_channels": 5}, "segformer": {"segformer_channels": 6}}
HEAD_BN = {"deeplabv3plus": "decoder", "lraspp": "lraspp_cbr_bn", "segformer": "segformer_fuse_bn"}


def _bn_layers(tmp_path, head, sync):
    cfg = tiny_config(tmp_path, model={"head": head, **HEADS[head], "bn_momentum": MOMENTUM,
                                       "sync_batchnorm": sync})
    model = TrainState(cfg, strategy(1), optimizer=False).model
    bn = models.batchnorm_layers(model)
    backbone = {layer.name for layer in models.batchnorm_layers(models.backbone_of(model))}
    head_bn = [layer for layer in bn if layer.name not in backbone]
    assert backbone and head_bn, head  # both parts have BN layers to check
    assert any(layer.name.startswith(HEAD_BN[head]) for layer in head_bn), [layer.name for layer in head_bn]
    return bn


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("sync", [False, True], ids=["keras_bn", "sync_bn"])
def test_bn_momentum_and_sync_reach_every_bn_layer_of_each_family(tmp_path, head, sync):
    bn = _bn_layers(tmp_path, head, sync)
    assert all(layer.momentum == pytest.approx(MOMENTUM) for layer in bn), \
        {layer.name: layer.momentum for layer in bn if layer.momentum != pytest.approx(MOMENTUM)}
    assert all(isinstance(layer, SyncBatchNormalization) == sync for layer in bn), \
        {layer.name: type(layer).__name__ for layer in bn}


@pytest.mark.parametrize("head", list(HEADS))
def test_drop_path_rate_reaches_the_mit_under_each_head(tmp_path, head):
    """model.drop_path_rate is the MiT backbone's, whatever head sits on it: the last block's branches at the
    configured rate (MiT-B0's 8 blocks: 0 at the first, so 14 DropPath layers)."""
    from seg_train.models.stochastic import DropPath

    cfg = tiny_config(tmp_path, model={"backbone": "mit_b0", "head": head, **HEADS[head], "drop_path_rate": 0.3},
                      data={"crop_size": [32, 32]})
    model = TrainState(cfg, strategy(1), optimizer=False).model
    rates = [layer.rate for layer in models.backbone_of(model).layers if isinstance(layer, DropPath)]
    assert len(rates) == 14 and max(rates) == pytest.approx(0.3), rates



# ---- train keys through each family: one SGD step from the same start ---------------------------------------
# Each head on the tiny backbone; SegFormer also on the MiT (B0) where its LayerNorm matters (weight decay,
# mixed precision).
FAMILIES = {"deeplabv3plus": {}, "lraspp": {"lraspp_channels": 5},
            "segformer": {"segformer_channels": 6, "drop_path_rate": 0.0, "head_dropout": 0.0}}
ON_MIT = {"deeplabv3plus": {}, "lraspp": {}, "segformer": {"backbone": "mit_b0"}}
LR, DECAY = 0.5, 0.05
# Plain SGD, because its step is lr * multiplier * gradient: a multiplier shows up as that exact factor on
# the move. Adam divides the gradient by its own running scale, so its first step is ~lr whatever the
# multiplier does to the gradient's size (the code scales the rate, but a test through Adam could not tell
# a scaled rate from a scaled gradient); one SGD step from zero momentum is the same with or without it.
SGD = {"optimizer": "sgd", "momentum": 0.0, "learning_rate": LR}


def _trainer(tmp_path, head, model=None, train=None):
    from seg_train.train.step import TrainStep

    cfg = tiny_config(tmp_path, model={"head": head, **FAMILIES[head], "weight_decay": 0.0,
                                       "sync_batchnorm": False, **(model or {})},
                      train={**SGD, **(train or {})})
    return TrainStep(TrainState(cfg, strategy(1)))


def _step(trainer, ignore_all=False):
    """One step on a fixed batch from a fixed start: (start, move per trainable variable, the step's output).

    The start is every trainable variable moved off its initial value by fixed-seed noise (biases and
    betas start at 0, where a decay on them would not show), the same in every trainer of a family.
    `ignore_all`: every label 255, so the loss has no gradient and the move is the weight decay's alone.
    """
    rng = np.random.default_rng(5)
    for v in trainer.state.model.trainable_variables:
        v.assign(np.asarray(v) + rng.normal(0, 0.05, v.shape).astype(np.float32))
    start = [np.asarray(v) for v in trainer.state.model.trainable_variables]
    images, labels = random_batch(batch=4, size=32, seed=1, ignore_rows=[32] * 4 if ignore_all else None)
    dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    out = trainer(next(iter(dist)), lr=LR)
    return start, [np.asarray(v) - w for v, w in zip(trainer.state.model.trainable_variables, start)], out


def _in_backbone(model):
    backbone = {id(v) for v in models.backbone_of(model).trainable_variables}
    return [id(v) in backbone for v in model.trainable_variables]


@pytest.mark.slow  # two trained tiny models, ~3-8 s
@pytest.mark.parametrize("head", list(FAMILIES))
def test_lr_multipliers_scale_the_backbone_and_head_moves_of_each_family(tmp_path, head):
    """train.backbone_lr_multiplier 0.25 and train.head_lr_multiplier 4: from the same start on the same
    batch, each backbone variable moves exactly 0.25 times, each head variable 4 times, its move at 1.0.
    Wrong answers: a multiplier ignored (or swapped) in one family, 4x or 16x off."""
    _, ref_moves, _ = _step(_trainer(tmp_path / "ref", head))
    trainer = _trainer(tmp_path / "mult", head, train={"backbone_lr_multiplier": 0.25, "head_lr_multiplier": 4.0})
    start, moves, _ = _step(trainer)
    model = trainer.state.model
    in_backbone = _in_backbone(model)
    assert 0 < sum(in_backbone) < len(in_backbone)
    for v, w, move, ref, bb in zip(model.trainable_variables, start, moves, ref_moves, in_backbone):
        # Tolerance: float32 rounding of the weights themselves, a few ulps of |w|.
        np.testing.assert_allclose(move, (0.25 if bb else 4.0) * ref, rtol=1e-3,
                                   atol=4e-7 * (1 + np.abs(w).max()), err_msg=v.path)
    assert max(np.abs(m).max() for m, bb in zip(ref_moves, in_backbone) if bb) > 1e-3
    assert max(np.abs(m).max() for m, bb in zip(ref_moves, in_backbone) if not bb) > 1e-3


# The head's decayed kernels, written by hand from each head's conv and dense layers (the classifiers
# included).
HEAD_DECAYED = {
    "deeplabv3plus": ["aspp_pool_conv", "aspp0_conv", "aspp1_conv", "aspp2_conv", "aspp3_conv", "aspp_proj_conv",
                      "decoder_low_conv", "decoder_conv1_conv", "decoder_conv2_conv", "logits"],
    "lraspp": ["lraspp_cbr_conv", "lraspp_scale_conv", "lraspp_low_logits", "lraspp_high_logits"],
    "segformer": ["segformer_linear1", "segformer_linear2", "segformer_linear3", "segformer_linear4",
                  "segformer_fuse_conv", "logits"],
}
# The backbones' by layer type: weight decay is for the kernels of convolutions (depthwise included) and
# dense layers; never a bias, a BN or LayerNorm scale or offset.
DECAYED_TYPES = (keras.layers.Conv2D, keras.layers.DepthwiseConv2D, keras.layers.Dense)


def _layers(model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _layers(layer)


@pytest.mark.slow  # a trained model, the MiT's ~10 s
@pytest.mark.parametrize("head", list(FAMILIES))
def test_weight_decay_applies_to_the_kernels_of_each_family_and_nothing_else(tmp_path, head):
    """model.weight_decay 0.05 on a batch whose labels are all ignored (no loss gradient): each variable's
    move is -lr * 0.05 * w on exactly the conv/dense kernels (the head's listed by hand), 0 on every bias,
    BN gamma/beta and the MiT's LayerNorm gamma/beta. Wrong answers: one family decaying its biases or
    norms, or leaving a kernel undecayed."""
    trainer = _trainer(tmp_path, head, model={**ON_MIT[head], "weight_decay": DECAY})
    start, moves, out = _step(trainer, ignore_all=True)
    model = trainer.state.model
    kernels = {id(w) for layer in _layers(model) if isinstance(layer, DECAYED_TYPES)
               for w in layer.trainable_weights if w.name in ("kernel", "depthwise_kernel")}
    in_backbone = _in_backbone(model)
    head_kernels = [v.path.split("/")[0] for v, bb in zip(model.trainable_variables, in_backbone)
                    if id(v) in kernels and not bb]
    assert sorted(head_kernels) == sorted(HEAD_DECAYED[head])
    assert any(id(v) in kernels for v, bb in zip(model.trainable_variables, in_backbone) if bb)
    names = {v.name for v in model.trainable_variables}
    assert {"bias", "gamma", "beta"} <= names, names  # every kind is there to be left alone
    assert float(out.weight_decay) > 0
    for v, w, move in zip(model.trainable_variables, start, moves):
        want = -LR * DECAY * w if id(v) in kernels else np.zeros_like(w)
        np.testing.assert_allclose(move, want, rtol=1e-3, atol=4e-7 * (1 + np.abs(w).max()), err_msg=v.path)


@pytest.mark.slow  # a trained model, the MiT's several seconds
@pytest.mark.parametrize("head", list(FAMILIES))
def test_mixed_float16_computes_in_half_and_keeps_float32_where_promised_in_each_family(tmp_path, head):
    """train.precision mixed_float16 through each family: every conv and dense layer computes in float16
    on float32 variables; the logits leave the model in float32 (the softmax and cross-entropy run on
    them); the MiT's LayerNorm takes moments in float32 (a float16 input of |x| ~ 400, whose squares
    overflow float16, is normalised as in float64; in float16 the variance is inf and the output beta);
    a step from the seeded model is finite. Wrong answers: a head's logits left in float16 (its loss
    computed in half), a family built in float32 whatever the key, LayerNorm moments in half."""
    from seg_train.models.layers import LayerNorm

    trainer = _trainer(tmp_path, head, model=ON_MIT[head], train={"precision": "mixed_float16"})
    model = trainer.state.model
    computing = [layer for layer in _layers(model) if isinstance(layer, DECAYED_TYPES)]
    assert computing and all(layer.compute_dtype == "float16" for layer in computing), \
        {layer.name: layer.compute_dtype for layer in computing if layer.compute_dtype != "float16"}
    assert {v.dtype for v in model.variables} == {"float32"}
    assert model.outputs[0].dtype == "float32"
    norms = [layer for layer in _layers(model) if isinstance(layer, LayerNorm)]
    assert bool(norms) == (head == "segformer")  # the MiT's
    rng = np.random.default_rng(0)
    for layer in norms:
        x = tf.constant(rng.normal(5.0, 400.0, (1, 4, 4, layer.gamma.shape[0])), tf.float16)
        y = layer(x)
        x64 = x.numpy().astype(np.float64)
        want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + layer.epsilon) \
            * np.asarray(layer.gamma) + np.asarray(layer.beta)
        assert y.dtype == tf.float16, layer.name
        np.testing.assert_allclose(y.numpy().astype(np.float64), want, atol=1e-2, err_msg=layer.name)
    images, labels = random_batch(batch=4, size=32, seed=1)
    dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    out = trainer(next(iter(dist)), lr=LR)
    assert out.loss.dtype == tf.float32 and np.isfinite(float(out.loss)) and bool(out.applied)
    assert all(np.isfinite(np.asarray(v)).all() for v in model.trainable_variables)


@pytest.mark.parametrize("head", list(FAMILIES))
def test_head_dropout_is_the_segformer_heads_and_refused_by_the_others(tmp_path, head):
    """model.head_dropout 0.3: under SegFormer a channel dropout at that rate right before the classifier
    (a training pass changes), 0.1 when not given; under DeepLabV3+ and Lite R-ASPP,
    which have no such layer, a user error rather than a key silently dropped."""
    from seg_train.config import ConfigError
    from seg_train.models import stochastic
    from seg_train.models.stochastic import ChannelDropout

    model_keys = {k: v for k, v in FAMILIES[head].items() if k != "head_dropout"}
    if head != "segformer":
        with pytest.raises(ConfigError, match="model.head_dropout"):
            tiny_config(tmp_path, model={"head": head, **model_keys, "head_dropout": 0.3})
        return
    for rate, given in ((0.3, {"head_dropout": 0.3}), (0.1, {})):
        cfg = tiny_config(tmp_path / str(rate), model={"head": head, **model_keys, **given})
        model = TrainState(cfg, strategy(1), optimizer=False).model
        drops = [layer for layer in _layers(model) if isinstance(layer, ChannelDropout)]
        assert [(layer.name, layer.rate) for layer in drops] == [("segformer_dropout", pytest.approx(rate))]
        assert model.get_layer("logits").input is drops[0].output
    # The train step draws the masks per sample (stochastic.per_sample); outside it the layer passes through.
    x = tf.constant(random_batch(batch=2, size=32)[0])
    with stochastic.per_sample(tf.constant([0, 1], tf.int64), seed=0):
        dropped = model(x, training=True)
    assert not np.allclose(dropped, model(x, training=True))
