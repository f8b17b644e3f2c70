"""Model keys that apply to every head, through each model family the config builds (TrainState from a
config: the real build path), not only through DeepLabV3+: model.bn_momentum and model.sync_batchnorm reach
every BN layer of DeepLabV3+, Lite R-ASPP and the SegFormer head (on the tiny backbone, so each build is
cheap). The momentum is set away from its default, so a head built with the default passes nowhere.
model.drop_path_rate reaches the MiT under each of the three heads.

Wrong answers these catch: a head whose BN is built with a fixed momentum (or Keras' default) instead of the
config's; a head's BN built as Keras' own layer whatever model.sync_batchnorm says; drop path applied only
under the SegFormer head.
"""

import pytest

from seg_train import models
from seg_train.models.sync_bn import SyncBatchNormalization
from seg_train.train.state import TrainState
from tests.helpers import tiny_config
from tests.helpers import strategy

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
