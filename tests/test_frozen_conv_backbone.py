"""model.freeze_backbone on a conv backbone with BatchNorm (the tiny test backbone with each BN class, and
MobileNetV2), through the real TrainState / TrainStep: the schema promises "its BN in inference mode";
tests/test_vit_wiring.py freezes a ViT, which has no BN.

Two SGD steps on a batch whose moments are far from the initial statistics: every backbone BN's moving
statistics (and gamma / beta) stay bitwise as built while the head's BN statistics move; and the head learns
what it learns over Keras' own BatchNormalization frozen (trainable = False: inference mode in a training pass,
Keras' documented behaviour) on 1 tower, with seg-train's fused BN and with its synchronized BN on 2 towers.

Fails for: a frozen backbone whose BN layers still run in training mode, updating their moving statistics (a
freeze that leaves the BN layers trainable) or normalising with the batch's moments (a BN class that checks the
training flag but not its layer's `trainable`: the step drops a frozen layer's statistics, the head then learns
from other features), and for a head whose BN statistics stop moving with it.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train import models
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import random_batch, strategy, tiny_config

# id -> (backbone, BN class, towers)
RUNS = {"tiny-keras": ("tiny", "keras", 1), "tiny-fused": ("tiny", "fused", 1),
        "tiny-sync-2-towers": ("tiny", "sync", 2), "mobilenetv2-fused": ("mobilenetv2", "fused", 1)}


def _frozen_run(tmp_path, backbone: str, bn: str, towers: int):
    """Two SGD steps with model.freeze_backbone: (backbone BN layers, head BN layers, their weights before, the
    head's trainable variables after, by path)."""
    cfg = tiny_config(tmp_path, model={"backbone": backbone, "freeze_backbone": True, "sync_batchnorm": bn == "sync",
                                       "fused_batchnorm": bn != "keras"},
                      train={"optimizer": "sgd", "learning_rate": 0.05})
    trainer = TrainStep(TrainState(cfg, strategy(towers)))
    model = trainer.state.model
    frozen = models.batchnorm_layers(models.backbone_of(model))
    head = [layer for layer in models.batchnorm_layers(model) if all(layer is not f for f in frozen)]
    before = {id(v): v.numpy().copy() for layer in frozen + head for v in layer.weights}
    images, labels = random_batch(batch=4, size=32, seed=1)
    images = images * 3.0 + 2.0  # batch moments far from the initial statistics (mean 0, variance 1)
    dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    batch = next(iter(dist))
    for _ in range(2):
        trainer(batch, lr=0.05)
    after = {v.path: v.numpy() for v in model.trainable_variables}
    return frozen, head, before, after


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done = {}

    def get(name):
        if name not in done:
            done[name] = _frozen_run(tmp_path_factory.mktemp(name), *RUNS[name])
        return done[name]

    yield get
    keras.backend.clear_session()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_frozen_conv_backbone_keeps_its_bn_statistics_while_the_heads_move(runs, name):
    frozen, head, before, _ = runs(name)
    assert frozen and head
    for layer in frozen:
        for v in layer.weights:
            assert v.numpy().tobytes() == before[id(v)].tobytes(), f"{layer.name}: {v.path}"
    for layer in head:
        moved = max(float(np.abs(v.numpy() - before[id(v)]).max()) for v in (layer.moving_mean, layer.moving_variance))
        assert moved > 1e-4, f"{layer.name}: moving statistics did not move"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-fused", "tiny-sync-2-towers"])
def test_frozen_backbone_bn_runs_as_keras_frozen_bn(runs, name):
    """The head after two steps over the fused (1 tower) or synchronized (2 towers) frozen BN is the head over
    Keras' own frozen BN on 1 tower, up to rounding (a backbone BN on the batch's moments moves it by O(1))."""
    *_, want = runs("tiny-keras")
    *_, got = runs(name)
    assert got.keys() == want.keys()
    for path, w in want.items():
        np.testing.assert_allclose(got[path], w, rtol=1e-4, atol=1e-5, err_msg=path)
