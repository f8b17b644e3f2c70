"""models.build picks its layer classes from the config it is given, and from nothing else (models/layer_choice.py).

Fails for: a flag mapped to the wrong class (Keras' BN where the fused one was asked for, a dilated
conv left as Keras' Conv2D with model.fast_atrous true, per-tower BN under sync_batchnorm), and a
choice that outlives its build (a process-wide flag left set, e.g. by a build that raised half-way,
so the next build gets other layers).
"""

import itertools

import keras
import numpy as np
import pytest

from seg_train import models
from seg_train.config import ConfigError, ModelConfig
from seg_train.models.atrous import AtrousConv2D
from seg_train.models.fused_bn import FusedBatchNormalization
from seg_train.models.sync_bn import SyncBatchNormalization


def _config(**model) -> ModelConfig:
    return ModelConfig(backbone="tiny", aspp_channels=8, decoder_channels=8, low_level_channels=4, **model)


def _convs(model):
    """(dilated, undilated) Conv2D layers of `model`, nested models included."""
    convs = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.Conv2D)]
    dilated = [c for c in convs if tuple(c.dilation_rate) != (1, 1)]
    return dilated, [c for c in convs if tuple(c.dilation_rate) == (1, 1)]


@pytest.mark.parametrize("sync,fused,fast", list(itertools.product([False, True], repeat=3)))
def test_layer_classes_follow_the_config(sync, fused, fast):
    model = models.build(_config(sync_batchnorm=sync, fused_batchnorm=fused, fast_atrous=fast), 3, seed=0)
    bn = {type(layer) for layer in models.batchnorm_layers(model)}
    # Synchronized BN is always the repository's own layer, fused or not (models/bn.py says why).
    per_tower = FusedBatchNormalization if fused else keras.layers.BatchNormalization
    assert bn == {SyncBatchNormalization if sync else per_tower}
    assert len(models.batchnorm_layers(model)) == 15  # backbone's 6 and the head's 9: the walk saw them all
    dilated, plain = _convs(model)
    assert len(dilated) == 4  # the backbone's stage3b and ASPP's three rates
    assert {type(c) for c in dilated} == {AtrousConv2D if fast else keras.layers.Conv2D}
    assert {type(c) for c in plain} == {keras.layers.Conv2D}  # undilated convs stay Keras' own either way


def _fingerprint(model):
    """Every layer's name and class, and every variable's path and initial value."""
    classes = [(layer.name, type(layer)) for layer in model._flatten_layers()]
    return classes, [(v.path, np.asarray(v)) for v in model.weights]


def test_one_build_leaves_nothing_behind_for_the_next():
    """A build with plain Keras layers, and one that fails half-way, change nothing for a later default build."""
    before = _fingerprint(models.build(_config(), 3, seed=0))
    plain = models.build(_config(fused_batchnorm=False, fast_atrous=False), 3, seed=0)
    assert {type(layer) for layer in models.batchnorm_layers(plain)} == {keras.layers.BatchNormalization}
    with pytest.raises(ConfigError, match="no pretrained weights"):  # raised while the backbone is built
        models.build(_config(fused_batchnorm=False, fast_atrous=False, backbone_weights="imagenet.h5"), 3, seed=0)
    after = _fingerprint(models.build(_config(), 3, seed=0))
    assert after[0] == before[0]
    assert {FusedBatchNormalization, AtrousConv2D} <= {cls for _, cls in after[0]}
    assert [p for p, _ in after[1]] == [p for p, _ in before[1]]
    for (path, a), (_, b) in zip(after[1], before[1]):
        np.testing.assert_array_equal(a, b, err_msg=path)
