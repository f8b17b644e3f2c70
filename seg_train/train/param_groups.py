"""Each trainable variable's learning-rate multiplier: the backbone's and the head's (train.backbone_lr_multiplier,
train.head_lr_multiplier) and, on a ViT, layer-wise decay (train.layer_decay).

Layer-wise decay as BEiT and EoMT fine-tune ViTs: with L blocks, block i (1-based) learns at decay^(L - i), the
patch embedding and the CLS / register tokens and position embeddings at decay^L (the lowest; EoMT's grouping
puts them with block 1), the final LayerNorm with the last block (decay^0, as EoMT's grouping:
tests/test_layer_decay_reference.py), everything outside the backbone at 1; the backbone multiplier applies
on top. L is the number of blocks built (blocks after the last one model.vit_layers names are not).

The multipliers scale the learning rate, not the gradient: Adam would undo a scaled gradient.
"""

from __future__ import annotations

import re

from seg_train import models

# A ViT block's variables live in layers named block<i>_... (models/vit.py).
_BLOCK = re.compile(r"(?:^|/)block(\d+)_")
# The ViT's layers before the first block (models/vit.py): the patch embedding and the token layer.
_EMBEDDING_LAYERS = ("patch_embed", "tokens")


def vit_level(path: str) -> int | None:
    """A backbone variable's level: its block number, 0 for the embeddings, None for anything else (the final
    norm)."""
    found = _BLOCK.search(path)
    if found:
        return int(found.group(1))
    parts = path.split("/")
    if any(p in _EMBEDDING_LAYERS for p in parts):
        return 0
    return None


def lr_multipliers(model, backbone_mult: float = 1.0, head_mult: float = 1.0,
                   layer_decay: float | None = None) -> list[float]:
    """One multiplier per variable of `model.trainable_variables`, in order."""
    in_backbone = models.backbone_variable_mask(model)
    variables = model.trainable_variables
    depth = None
    if layer_decay is not None:
        levels = [vit_level(v.path) if b else None for v, b in zip(variables, in_backbone)]
        depth = max((lv for lv in levels if lv is not None), default=0)
        if depth == 0:
            # The config refuses layer_decay without a ViT; a frozen backbone leaves nothing to decay.
            depth = None
    out = []
    for i, b in enumerate(in_backbone):
        if not b:
            out.append(head_mult)
            continue
        mult = backbone_mult
        if depth is not None:
            level = levels[i]
            mult *= layer_decay ** (depth - (depth if level is None else level))
        out.append(mult)
    return out
