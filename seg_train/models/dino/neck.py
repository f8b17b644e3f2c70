"""What sits between a DINO ViT (models/dino/vit.py) and a head: the DINO papers' linear head, and ViTDet's simple
pyramid, which turns the ViT's single-scale map into the four levels the per-pixel heads expect.

Linear (`linear_head`): BatchNorm + 1x1 conv on the chosen blocks' patch maps concatenated along the channels,
the logits bilinearly upsampled to the input (DINOv2's linear / "+ms" protocol on 4 blocks, DINOv3's on the
last one). The maps come out of the ViT's final LayerNorm, as in those protocols.

Simple pyramid (Li et al., "Exploring Plain Vision Transformer Backbones for Object Detection", 2022): from the
last block's map at the patch stride p: two 2x2 transposed convs (LayerNorm + GELU between) to p / 4, one to
p / 2, the map itself at p, 2x2 max pooling to 2p (PatchPairPool: no patch dropped on an odd grid); each level
then a 1x1 and a 3x3 conv without bias, each followed by a LayerNorm over the channels. With p = 16 these are
strides 4, 8, 16 and 32, the strides the heads are written for (with p = 14: 3.5, 7, 14, 28; the heads resize
to their inputs' actual sizes).
"""

from __future__ import annotations

import keras
from keras import layers

from seg_train.models.layer_choice import LayerChoice
from seg_train.models.layers import LayerNorm, ResizeLike, gelu

# The levels by their nominal stride (patch 16) -> how many times the patch grid they are.
LEVELS = {4: "x4", 8: "x2", 16: "x1", 32: "pool"}


@keras.saving.register_keras_serializable(package="seg_train")
class PatchPairPool(layers.MaxPooling2D):
    """The pyramid's stride-2p level: 2x2 max pooling of the patch map, "same" padded.

    On an odd grid (DINOv2's 518 = 37 x 14, 336 / 16 = 21) "valid" pooling would drop the last patch row and
    column, and the heads would stretch what is left over the whole image. "Same" pads the bottom / right
    with -inf: the last pooled cell holds the last patch alone and no patch is lost, at any grid (a training
    crop of whole patches; a model called directly). The cells are then whole pairs of patches only on an
    even grid, where the heads' resizes between levels are exact 2:1: so inference pads its inputs to 2p
    under this level (models.input_multiple finds it by this class), as it pads a conv backbone's to its
    deepest stride.
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("pool_size", 2)
        kwargs.setdefault("strides", 2)
        kwargs.setdefault("padding", "same")
        super().__init__(**kwargs)


def linear_head(encoder: keras.Model, num_classes: int, choice: LayerChoice, bn_momentum: float = 0.9,
                name: str | None = None) -> keras.Model:
    """BatchNorm + 1x1 conv on the concatenated patch maps of `encoder` (models/dino/vit.py's dino_encoder);
    float32 logits at the input's size."""
    inp = keras.Input((None, None, 3), name="image")
    maps = encoder(inp)
    maps = maps if isinstance(maps, (list, tuple)) else [maps]
    x = maps[0] if len(maps) == 1 else layers.Concatenate(name="linear_concat")(list(maps))
    x = choice.batch_norm(bn_momentum, 1e-5, "linear_bn")(x)
    x = layers.Conv2D(num_classes, 1, name="logits")(x)
    x = ResizeLike(name="logits_resize")(x, inp)
    x = layers.Activation("linear", dtype="float32", name="logits_float32")(x)
    return keras.Model(inp, x, name=name or f"linear_{encoder.name}")


class SimplePyramid:
    """The pyramid levels a head asks for, from the encoder's (last) map: `features(inp)` -> [maps], shallowest
    first, at the nominal `strides` (keys of LEVELS).

    A callable with a `name`, the shape the heads take their backbone in (`head(backbone, ...)` calls
    `backbone(inp)`): the encoder stays the model's one nested keras.Model (models.backbone_of), and the
    pyramid's layers belong to the head's side (its learning rate, never frozen with the backbone).
    """

    def __init__(self, encoder: keras.Model, strides: tuple[int, ...], channels: int = 256):
        unknown = [s for s in strides if s not in LEVELS]
        if unknown:
            raise ValueError(f"simple pyramid: strides {unknown}: expected some of {sorted(LEVELS)}")
        self.encoder, self.strides, self.channels = encoder, tuple(strides), channels
        self.name = f"{encoder.name}_pyramid"

    def __call__(self, inp):
        x = self.encoder(inp)
        x = x[-1] if isinstance(x, (list, tuple)) else x
        width = x.shape[-1]
        out = []
        for stride in self.strides:
            level = LEVELS[stride]
            name = f"pyramid_s{stride}"
            if level == "x4":
                y = layers.Conv2DTranspose(width // 2, 2, strides=2, name=f"{name}_up1")(x)
                y = LayerNorm(epsilon=1e-6, name=f"{name}_up1_norm")(y)
                y = layers.Activation(gelu, name=f"{name}_up1_gelu")(y)
                y = layers.Conv2DTranspose(width // 4, 2, strides=2, name=f"{name}_up2")(y)
            elif level == "x2":
                y = layers.Conv2DTranspose(width // 2, 2, strides=2, name=f"{name}_up1")(x)
            elif level == "x1":
                y = x
            else:
                y = PatchPairPool(name=f"{name}_pool")(x)
            y = layers.Conv2D(self.channels, 1, use_bias=False, name=f"{name}_lateral")(y)
            y = LayerNorm(epsilon=1e-6, name=f"{name}_lateral_norm")(y)
            y = layers.Conv2D(self.channels, 3, padding="same", use_bias=False, name=f"{name}_output")(y)
            out.append(LayerNorm(epsilon=1e-6, name=f"{name}_output_norm")(y))
        return out
