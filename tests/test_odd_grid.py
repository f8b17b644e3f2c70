"""The simple pyramid on odd patch grids: DINOv2 at 518 x 518 (37 x 37 patches of 14) and DINOv3 at 336 x 336
(21 x 21 patches of 16), each a one-block ViT 4 wide under the SegFormer head (its stride-2p level, the pyramid's
pooled one, is the level these tests see).

The weights are set so that the prediction is a by-hand function of where the pattern is: a patch whose pixels
are 1 in the red channel is "on" through the ViT (blocks the identity: layer scales 0; the final norm turning
the embedding's sign into a 0/1 indicator), the pooled level's channel 0 is 1 on a pooled cell holding an "on"
patch and 0 elsewhere, and the head reads that channel alone: class 1 where the pooled indicator, resized
bilinearly to stride p / 4 and then to the image, is above 1/2.

Fails for: the pooled level dropping the last patch row and column ("valid" pooling: no class 1 for a pattern
there), inference padding a ViT under the pyramid only to whole patches (the pooled level's cells then stretched
over the image: the class-1 band starts a patch early), the SavedModel's serving function or the .tflite app
function not padding as seg-eval does.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train import models
from seg_train.config import from_dict
from seg_train.config.variants import ViTVariant as Variant
from seg_train.infer.serving import serving_module
from seg_train.infer.tflite_export import app_function, tflite_pad_to
from seg_train.models.dino.neck import SimplePyramid
from seg_train.models.dino.vit import dino_encoder
from seg_train.models.heads.segformer import segformer
from seg_train.models.layer_choice import LayerChoice
from tests.helpers import bilinear_resize

# (family, patch, image side): odd grids of 37 and 21 patches.
GRIDS = {"dinov2": (14, 518), "dinov3": (16, 336)}


def _set(layer, *values):
    layer.set_weights([np.asarray(v, np.float32).reshape(w.shape) for v, w in zip(values, layer.get_weights())])


def _pyramid_model(family: str):
    """(model, its pooled level as a model): the one-block ViT, its pyramid and the SegFormer head, weights by
    hand."""
    patch, _ = GRIDS[family]
    spec = Variant(family, patch, width=4, depth=1, heads=1, mlp=8, key_bias=family == "dinov2", pos_grid=4)
    keras.utils.set_random_seed(0)
    encoder = dino_encoder(spec, (1,))
    pyramid = SimplePyramid(encoder, (4, 8, 16, 32), channels=2)
    model = segformer(pyramid, 2, LayerChoice(False, False, False), channels=2)
    # The ViT: the blocks add nothing, no position embedding; the patch embedding is (s, 0, s, 0) with
    # s = (the patch's red sum) - 1/2, and the final norm (gamma = beta = 1/2) makes it (1, 0, 1, 0) for s > 0
    # ("on") and (0, 1, 0, 1) for s < 0.
    for layer in encoder.layers:
        if layer.name.endswith(("_ls1", "_ls2")):
            _set(layer, np.zeros(4))
    if family == "dinov2":
        tokens = encoder.get_layer("tokens")
        tokens.position_embeddings.assign(tf.zeros_like(tokens.position_embeddings))
    kernel = np.zeros((patch, patch, 3, 4))
    kernel[:, :, 0, 0] = kernel[:, :, 0, 2] = 1.0
    _set(encoder.get_layer("patch_embed"), kernel, [-0.5, 0, -0.5, 0])
    _set(encoder.get_layer("norm"), np.full(4, 0.5), np.full(4, 0.5))
    # The pooled level: its max over a cell is (1, m, 1, m) with an "on" patch (m = 1 when the cell has an "off"
    # one too), (0, 1, 0, 1) without; the lateral conv maps these to (1, 1/4 + m/2) and (0, 1/2), each norm
    # (gamma = beta = 1/2) to the indicator (1, 0) or (0, 1), the 3x3 conv being the identity between them.
    _set(model.get_layer("pyramid_s32_lateral"), np.array([[1.0, 0.25], [0, 0.5], [0, 0], [0, 0]]))
    identity = np.zeros((3, 3, 2, 2))
    identity[1, 1] = np.eye(2)
    _set(model.get_layer("pyramid_s32_output"), identity)
    for name in ("pyramid_s32_lateral_norm", "pyramid_s32_output_norm"):
        _set(model.get_layer(name), [0.5, 0.5], [0.5, 0.5])
    # The head: only the pooled level's channel 0 reaches the fuse conv (levels concatenated deepest first);
    # BN the identity (variance 1 - epsilon); logits (1/2, that channel).
    for i in (1, 2, 3):
        _set(model.get_layer(f"segformer_linear{i}"), np.zeros((2, 2)), np.zeros(2))
    _set(model.get_layer("segformer_linear4"), np.array([[1.0, 0], [0, 0]]), np.zeros(2))
    fuse = np.zeros((1, 1, 8, 2))
    fuse[0, 0, 0, 0] = 1.0
    _set(model.get_layer("segformer_fuse_conv"), fuse)
    bn = model.get_layer("segformer_fuse_bn")
    _set(bn, np.ones(2), np.zeros(2), np.zeros(2), np.full(2, 1.0 - bn.epsilon))
    _set(model.get_layer("logits"), np.array([[0.0, 1.0], [0, 0]]), [0.5, 0.0])
    return model, keras.Model(model.input, model.get_layer("pyramid_s32_output_norm").output)


def _image(family: str, where: str) -> np.ndarray:
    """uint8 [side, side, 3]: 1 in the red channel over the last patch row ("row") or column ("column")."""
    patch, side = GRIDS[family]
    image = np.zeros((side, side, 3), np.uint8)
    if where == "row":
        image[side - patch:, :, 0] = 1
    else:
        image[:, side - patch:, 0] = 1
    return image


def _expected_probability(family: str, where: str) -> np.ndarray:
    """Class 1's probability [side, side] by hand on the image padded to an even grid: the pooled indicator
    (1 on the last pooled row / column) resized bilinearly to p / 4 and then to the padded image, cropped back;
    the logits (1/2, that), softmax."""
    patch, side = GRIDS[family]
    cells = (side // patch + 1) // 2
    indicator = np.zeros((1, cells, cells, 1))
    if where == "row":
        indicator[0, -1] = 1.0
    else:
        indicator[0, :, -1] = 1.0
    fine = bilinear_resize(indicator, (8 * cells, 8 * cells))
    field = bilinear_resize(fine, (2 * cells * patch, 2 * cells * patch))[0, :side, :side, 0]
    return 1.0 / (1.0 + np.exp(0.5 - field))


@pytest.fixture(scope="module", params=sorted(GRIDS))
def built(request):
    family = request.param
    model, levels = _pyramid_model(family)
    yield family, model, levels
    keras.backend.clear_session()


@pytest.mark.parametrize("where", ["row", "column"])
def test_odd_grid_pooled_level_keeps_the_last_patch(built, where):
    """Called on the odd grid itself (a training crop of whole patches): the pooled level has ceil(g / 2)
    cells, the last holding the last patch alone (numpy's 2x2 max pool of the "on" indicator padded with -inf)."""
    family, _, levels = built
    patch, side = GRIDS[family]
    grid = side // patch
    pooled = levels(_image(family, where)[None].astype(np.float32), training=False).numpy()[0, :, :, 0]
    on = np.zeros((grid, grid))
    if where == "row":
        on[-1] = 1.0
    else:
        on[:, -1] = 1.0
    padded = np.pad(on, [(0, 1), (0, 1)], constant_values=-np.inf)
    want = padded.reshape(grid // 2 + 1, 2, grid // 2 + 1, 2).max(axis=(1, 3))
    np.testing.assert_allclose(pooled, want, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["row", "column"])
def test_odd_grid_prediction_lands_on_the_last_patch_row_and_column(built, where):
    """seg-predict / seg-export's serving function and the .tflite app function on the whole odd-grid image:
    class 1 exactly on the pixels of the last patch row (column), its probability the by-hand one, and the
    input padded to 2p (an even grid) by models.input_multiple."""
    family, model, _ = built
    patch, side = GRIDS[family]
    assert models.input_multiple(model) == 2 * patch
    image = _image(family, where)
    by_hand = np.zeros((side, side), np.int32)
    if where == "row":
        by_hand[side - patch:] = 1
    else:
        by_hand[:, side - patch:] = 1
    want = _expected_probability(family, where)
    np.testing.assert_array_equal(want > 0.5, by_hand.astype(bool))  # the reference agrees with the hand

    served = serving_module(model, [0.0] * 3, [1.0] * 3).serve(tf.constant(image))
    np.testing.assert_array_equal(served["classes"].numpy(), by_hand)
    np.testing.assert_allclose(served["probabilities"].numpy()[..., 1], want, atol=1e-5)

    cfg = from_dict({"data": {"root": "data", "num_classes": 2, "crop_size": [side, side]},
                     "model": {"backbone": f"{family}_vits{patch}", "head": "segformer"}})
    app = app_function(model, [0.0] * 3, [1.0] * 3, side, side, probabilities=True,
                       pad_to=tflite_pad_to(cfg, model))
    out = app(tf.constant(image[None]))
    np.testing.assert_array_equal(out["classes"].numpy()[0], by_hand)
    np.testing.assert_allclose(out["probabilities"].numpy()[0, ..., 1], want, atol=1e-5)
