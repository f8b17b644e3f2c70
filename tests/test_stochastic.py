"""Dropout and drop path drawn per sample (models/stochastic.py): masks that are a function of (seed, global
sample counter, layer) only.

References: the reader's own numbering of the samples (ImageReader.train_order, whose counter k also draws
each sample's augmentation), keras-hub's MiTBackbone for the drop-path rate of each block, the model built
without the stochastic layers for inference, and a run of the seg-train command resumed from a checkpoint
for the whole chain. The 1-tower = 4-tower check with SegFormer is tests/test_segformer.py's
(test_four_towers_with_drop_path_and_synchronized_bn_equal_one_device).

Wrong answers these fail for: a row's counter from the tower's own rows instead of the global sample index
(a multi-worker or multi-tower layout numbers the samples differently from the reader); one mask for the
whole batch (timm's "batch" mode) or one per call; kept activations not rescaled by 1 / (1 - rate) (the
expectation shifts: inference would see other magnitudes than training); drop path or dropout active at
inference or in a pass without counters (precise BN, evaluation); the rates not rising linearly over the
blocks as the paper's; masks that a resumed run draws differently.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
import yaml

from seg_train import models
from seg_train.config.variants import MIT_VARIANTS
from seg_train.data import synthetic
from seg_train.models import stochastic
from seg_train.models.mit.encoder import drop_path_rates
from seg_train.run.state import TrainState
from tests.helpers import TINY_MIT_B0, open_reader, resume_bitwise, strategy, tiny_config
from tests.helpers import mit_kwargs as _mit_kwargs

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=12, num_val=2, size=(40, 48),
                              num_classes=3)


# ---- the counters: the reader's numbering ------------------------------------------------------------------
@pytest.mark.parametrize("towers, pipelines, micro, batch", [(1, 1, 1, 4), (2, 1, 2, 4), (4, 2, 1, 8), (2, 2, 3, 2)])
def test_sample_ids_are_the_readers_counters(data_root, towers, pipelines, micro, batch):
    """Each row's counter as the train step computes it (step, micro-batch, global tower index) equals the
    counter k the reader attached to the sample in that row (train_order: the one its augmentation is drawn
    from), for several towers, several workers (input pipelines) and micro-batches. Each pipeline's batches
    go to its towers in turn (distribute_datasets_from_function), tower p * (towers / pipelines) + j."""
    cfg = tiny_config(data_root.parent / "cfg", data_root)
    reader = open_reader(cfg, "train", seed=5)
    rows, local, start = batch // towers, towers // pipelines, 3
    seen = set()
    for p in range(pipelines):
        order = reader.train_order(batch, start, towers, p, pipelines, micro).batch(micro * rows)
        for j, (k, _) in enumerate(order.take(3 * local)):
            step, tower = start + j // local, p * local + j % local
            got = np.concatenate([stochastic.sample_ids(step, m, tower, rows, towers, micro).numpy()
                                  for m in range(micro)])
            np.testing.assert_array_equal(got, k.numpy(), err_msg=f"pipeline {p} batch {j}")
            seen.update(got.tolist())
    # Every sample of the three steps, once.
    assert seen == set(range(start * micro * batch, (start + 3) * micro * batch))


# ---- the layers: per sample, rescaled, identity outside training ------------------------------------------
def _call(layer, x, ids, seed=0, training=True):
    with stochastic.per_sample(tf.constant(ids, tf.int64), seed):
        return np.asarray(layer(tf.constant(x), training=training))


def test_drop_path_masks_are_per_sample_and_a_function_of_the_sample():
    layer = stochastic.DropPath(0.5, name="stage1_block2_drop_path1")
    x = np.random.default_rng(0).normal(size=(16, 3, 4, 8)).astype(np.float32)
    ids = list(range(1000, 1016))
    out = _call(layer, x, ids)
    kept = [bool(np.any(o)) for o in out]
    for o, xi, k in zip(out, x, kept):  # a whole sample dropped, or kept and scaled by 1 / (1 - rate)
        np.testing.assert_array_equal(o, xi * np.float32(2.0) if k else np.zeros_like(xi))
    assert 0 < sum(kept) < len(kept)  # rows of one batch differ
    # The same samples in other rows, batches and batch sizes: the same masks.
    again = _call(layer, x[[5, 0, 12]], [1005, 1000, 1012])
    np.testing.assert_array_equal(again, out[[5, 0, 12]])
    # Another layer, another seed: other masks (their own draws, not the same ones).
    other_layer = _call(stochastic.DropPath(0.5, name="stage1_block2_drop_path2"), x, ids)
    other_seed = _call(layer, x, ids, seed=1)
    for other in (other_layer, other_seed):
        assert [bool(np.any(o)) for o in other] != kept


def test_drop_path_keeps_the_expectation():
    """4096 samples at rate 0.3: about 70% kept, each scaled by 1 / 0.7, so the mean is the input's (1); without
    the rescaling it would be 0.7."""
    layer = stochastic.DropPath(0.3, name="stage4_block2_drop_path2")
    out = _call(layer, np.ones((4096, 1, 1, 2), np.float32), list(range(4096)))
    kept = out[:, 0, 0, 0] > 0
    assert abs(kept.mean() - 0.7) < 0.03
    np.testing.assert_array_equal(out[kept], np.float32(1.0) / np.float32(0.7))
    assert abs(out.mean() - 1.0) < 0.04


def test_channel_dropout_drops_whole_channels_per_sample():
    """Dropout2d: each (sample, channel) is zeroed everywhere or kept everywhere, scaled by 1 / (1 - rate);
    about `rate` of them dropped; the samples' channel sets differ, and a sample keeps its set elsewhere."""
    layer = stochastic.ChannelDropout(0.3, name="segformer_dropout")
    x = np.random.default_rng(1).normal(size=(64, 3, 5, 32)).astype(np.float32) + 5.0  # no zeros of its own
    out = _call(layer, x, list(range(64)))
    kept = np.all(out != 0, axis=(1, 2))
    assert np.array_equal(kept, np.any(out != 0, axis=(1, 2)))  # whole channels
    np.testing.assert_allclose(out, np.where(kept[:, None, None, :], x / np.float32(0.7), 0.0), rtol=1e-6)
    assert abs(1 - kept.mean() - 0.3) < 0.03
    assert len({tuple(k) for k in kept}) == len(kept)
    np.testing.assert_array_equal(_call(layer, x[[7, 3]], [7, 3]), out[[7, 3]])


@pytest.mark.parametrize("layer", [stochastic.DropPath(0.5, name="dp"), stochastic.ChannelDropout(0.5, name="do")],
                         ids=["drop_path", "channel_dropout"])
def test_identity_at_inference_and_without_counters(layer):
    x = np.random.default_rng(2).normal(size=(8, 2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(_call(layer, x, list(range(8)), training=False), x)
    np.testing.assert_array_equal(np.asarray(layer(tf.constant(x), training=True)), x)  # no counters: precise BN
    assert not np.array_equal(_call(layer, x, list(range(8))), x)  # and in training with counters it acts


# ---- the model from the config ----------------------------------------------------------------------------
def _segformer_config(tmp_path, **model):
    return tiny_config(tmp_path, model={"backbone": "mit_b0", "head": "segformer", "segformer_channels": 8,
                                        **model}, data={"crop_size": [32, 48]})


def _rates(model) -> dict:
    return {layer.name: layer.rate for layer in models.backbone_of(model).layers
            if isinstance(layer, stochastic.DropPath)}


def test_drop_path_rate_and_head_dropout_reach_the_model(tmp_path):
    """TrainState from a config with model.drop_path_rate 0.3 and model.head_dropout 0.2: every MiT block's two
    branches at the rate keras-hub's MiTBackbone(max_drop_path_rate=0.3) gives that block (0 at the first,
    rising linearly to 0.3 at the last: no layer where it is 0), the head's dropout at 0.2. The defaults
    resolve to SegFormer's 0.1 and 0.1 (keras-hub's MiT preset default)."""
    model = TrainState(_segformer_config(tmp_path / "set", drop_path_rate=0.3, head_dropout=0.2), strategy(1),
                       optimizer=False).model
    hub = keras_hub.models.MiTBackbone(image_shape=(64, 64, 3), **{**_mit_kwargs("mit_b0"), "max_drop_path_rate": 0.3})
    hub_rates = [float(layer.drop_path.rate) for layer in hub.layers if hasattr(layer, "drop_path")]
    assert len(hub_rates) == 8 and hub_rates[0] == 0.0
    blocks = [f"stage{s}_block{b}" for s in range(1, 5) for b in (1, 2)]
    want = {f"{block}_drop_path{i}": rate for block, rate in zip(blocks, hub_rates) if rate for i in (1, 2)}
    assert _rates(model).keys() == want.keys()
    for name, rate in _rates(model).items():
        assert rate == pytest.approx(want[name], abs=1e-7), name
    assert drop_path_rates("mit_b0", 0.3) == pytest.approx(hub_rates, abs=1e-7)
    assert model.get_layer("segformer_dropout").rate == 0.2

    cfg = _segformer_config(tmp_path / "default")
    assert (cfg.model.drop_path_rate, cfg.model.head_dropout) == (0.1, 0.1)
    assert max(_rates(TrainState(cfg, strategy(1), optimizer=False).model).values()) == pytest.approx(0.1)
    keras.backend.clear_session()


def test_inference_is_the_model_without_stochastic_layers(tmp_path):
    """With drop path 0.5 and dropout 0.5, a training=False pass inside the step's counters gives exactly what
    the same weights give in a model built without the layers; a training pass there does not."""
    noisy = TrainState(_segformer_config(tmp_path / "noisy", drop_path_rate=0.5, head_dropout=0.5), strategy(1),
                       optimizer=False).model
    plain = TrainState(_segformer_config(tmp_path / "plain", drop_path_rate=0.0, head_dropout=0.0), strategy(1),
                       optimizer=False).model
    assert not _rates(plain) and len(_rates(noisy)) == 14
    plain.set_weights(noisy.get_weights())
    x = tf.constant(np.random.default_rng(3).normal(size=(2, 32, 48, 3)).astype(np.float32))
    want = plain(x, training=False).numpy()
    np.testing.assert_array_equal(noisy(x, training=False).numpy(), want)
    with stochastic.per_sample(tf.constant([4, 9], tf.int64), 0):
        np.testing.assert_array_equal(noisy(x, training=False).numpy(), want)
        training = noisy(x, training=True).numpy()  # (an eager training call moves the BN statistics: last)
    assert np.abs(training - plain(x, training=True).numpy()).max() > 1e-3


# ---- a run interrupted and resumed ------------------------------------------------------------------------
def test_resumed_segformer_run_is_bitwise_the_uninterrupted_one(tmp_path, data_root, monkeypatch):
    """seg-train on 2 towers (AdamW with the head at 10x) on SegFormer (mit_b0: tests/helpers.py's TINY_MIT_B0 in
    its place) with drop path 0.5 and dropout 0.3, 4 steps with checkpoints at 2 and 4; the run dir rewound to
    step 2 (as if killed after that checkpoint) and the same command run again: its step-4 checkpoint is bitwise
    the first run's (weights, slots, counters). Masks drawn per call, or from a generator whose state is not in
    the checkpoint, would draw other masks for steps 3 and 4. (One micro-batch per step: a second one doubles the
    traced graph, and the micro-batch index in the counter is test_sample_ids_are_the_readers_counters'.)"""
    raw = {"seed": 3, "run_dir": "run",
           "data": {"root": str(data_root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                    "num_parallel_calls": 2, "val_split": "none"},
           "model": {"backbone": "mit_b0", "head": "segformer", "segformer_channels": 8, "drop_path_rate": 0.5,
                     "head_dropout": 0.3},
           "train": {"num_steps": 4, "checkpoint_every": 2, "summary_every": 1, "image_summary_every": 0,
                     "optimizer": "adamw", "learning_rate": 1e-3, "head_lr_multiplier": 10.0},
           "eval": {"bn_reestimate_batches": 0}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setitem(MIT_VARIANTS, "mit_b0", TINY_MIT_B0)
    keys = resume_bitwise(tmp_path / "cfg.yaml", tmp_path)
    assert any(k.startswith("optimizer/") for k in keys) and len(keys) > 100
