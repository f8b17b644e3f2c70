"""train.layer_decay against the EoMT reference's parameter grouping (tue-mps/eomt, training/lightning_module.py,
`configure_optimizers`), its numbers written in here.

The reference walks the parameters in reverse with a running block index: a parameter of `blocks.<i>` (0-based,
of L) learns at lr * llrd^(L - 1 - i); the ViT's final norm (`backbone.norm`) is set back to lr; everything
outside the ViT (queries, class head, mask MLP, upscale blocks) is at lr. With its default llrd_l2_enabled the
EoMT blocks decay like the others. For L = 12 and llrd 0.8 that is block 1 (1-based) at 0.8^11 = 0.08589934592
up to block 12 at 1.

Not compared: the embeddings (patch embedding, CLS / register tokens), which the reference leaves at block 1's
rate (its running index stays at 0) and seg-train puts one level lower, at decay^L, as the EoMT configs' headers
say.

Fails for: the final LayerNorm at decay^L (or at any rate but the last block's), the blocks counted from the other
end or off by one, the head decayed.
"""

from __future__ import annotations

import pytest

from seg_train import models
from seg_train.models import param_groups
from seg_train.run.state import TrainState
from tests.helpers import strategy, tiny_config

# The reference's multipliers (lr of the group / lr) for a 12-block ViT at llrd 0.8, 1-based block numbers.
EOMT_BLOCK_RATES = {1: 0.08589934592, 2: 0.1073741824, 3: 0.134217728, 4: 0.16777216, 5: 0.2097152,
                    6: 0.262144, 7: 0.32768, 8: 0.4096, 9: 0.512, 10: 0.64, 11: 0.8, 12: 1.0}
EOMT_FINAL_NORM_RATE = 1.0
EOMT_HEAD_RATE = 1.0


@pytest.mark.slow
def test_eomt_layer_decay_rates_are_the_references(tmp_path):
    """EoMT on a 12-block DINOv3 ViT-S/16, train.layer_decay 0.8: each variable's multiplier, as the update
    takes it (param_groups.lr_multipliers with the config's values), is the reference's for its group."""
    cfg = tiny_config(tmp_path, data={"crop_size": [32, 32]},
                      model={"backbone": "dinov3_vits16", "head": "eomt", "num_queries": 4, "weight_decay": None},
                      train={"optimizer": "adamw", "layer_decay": 0.8})
    model = TrainState(cfg, strategy(1), optimizer=False).model
    t = cfg.train
    rates = param_groups.lr_multipliers(model, cfg.model, t.backbone_lr_multiplier, t.head_lr_multiplier,
                                        t.layer_decay)
    in_backbone = models.backbone_variable_mask(model)
    seen = set()
    for v, rate, backbone in zip(model.trainable_variables, rates, in_backbone):
        layer = v.path.split("/")[0]
        if not backbone:
            want, group = EOMT_HEAD_RATE, "head"
        elif layer == "norm":
            want, group = EOMT_FINAL_NORM_RATE, "norm"
        elif layer.startswith("block"):
            group = int(layer[len("block"):].split("_")[0])
            want = EOMT_BLOCK_RATES[group]
        else:
            assert layer in ("patch_embed", "tokens"), v.path
            continue  # the embeddings: module doc
        seen.add(group)
        assert rate == pytest.approx(want, rel=1e-9), v.path
    assert seen == set(EOMT_BLOCK_RATES) | {"norm", "head"}
