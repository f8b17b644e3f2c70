"""EoMT (Kerssies et al., CVPR 2025, "Your ViT is Secretly an Image Segmentation Model"): mask classification
on a plain ViT, the encoder of models/dino/vit.py. Arithmetic held to transformers' EomtForUniversalSegmentation
(tests/test_eomt_model.py against the fixture scripts/reference_eomt_model.py writes).

The model: the ViT's first depth - `eomt_blocks` blocks run on [CLS, registers, patches]; then `queries`
learned tokens are put in front ([queries, CLS, registers, patches]) and go through the last `eomt_blocks`
blocks with the rest. A prediction is made from tokens passed through the ViT's final LayerNorm:
  class logits  [b, Q, K + 1]  a Dense on the queries (the last class is "no object")
  mask logits   [b, Q, h, w]   the queries through a 3-layer MLP, dotted with the patch tokens upscaled by
                               `upscale_blocks` blocks (2x2 stride-2 transposed conv, GELU, 3x3 depthwise conv,
                               LayerNorm), each doubling the grid: h, w = 4 H / p, 4 W / p with two (H/4 at p 16).

Masked attention (training only): before each of the last `eomt_blocks` blocks a prediction is made from the
tokens going in, and in that block query q of sample i attends only to the patches where that prediction's
mask logit, resized bilinearly to the patch grid, is > 0 (queries, CLS and registers always). Each (sample,
query) keeps its mask with the block's probability p (the caller anneals p to 0); the draw is
TensorFlow's Philox uniform (stochastic.uniform: the same under XLA) from the sample's seed folded with the
block index, so a sample's draw depends on nothing else in the batch or on the towers.

Interface (EoMT, built by `eomt`):
  model(images, training=False)                   [b, H, W, K] float32 semantic "logits" (below)
  model.predictions(images, mask_probs, seeds, training=True)
      images      [b, H, W, 3], H and W multiples of the patch (unknown in a trace is fine)
      mask_probs  float [eomt_blocks]: each block's mask probability; None: no masking
      seeds       int32 [b, 2]: each sample's seed for the mask draw (needed with mask_probs)
      -> list of (class_logits [b, Q, K + 1], mask_logits [b, Q, h, w]) in float32, eomt_blocks + 1 of them:
         the one before each masked block in order, the final one last (what the reference computes)
      training=False: the final prediction alone, no masking, mask_probs and seeds ignored
  model.backbone                                  the ViT (vit.dino_encoder's model; presets_vit loads into it)

The semantic output: scores[c] = sum_q softmax(class_q)[c] * sigmoid(mask_q), c over the K real classes,
with the mask logits first resized bilinearly to the input size (as the reference's
post_process_semantic_segmentation does: Q x H x W values per image at full resolution), returned as
log(max(scores, tiny)) so that argmax and a softmax over classes (flip / scale averaging) work as for the
other heads' logits; softmax of them is the scores normalised to sum 1.

Positions: transformers' EoMT has learned position embeddings for its one patch grid on the patches only
(ViTVariant(cls_position=False); config/variants.py's dinov2_vit*16_reg); here, as for DINOv2, they are resized
bicubically (torch's) to the actual grid (the identity at its own grid), so any size works. Its folders load through
models/dino/transformers.py. Mixed precision: the ViT's float32 LayerNorm moments and
softmax; predictions and the semantic output in float32.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from seg_train.config.variants import VIT_VARIANTS, ViTVariant
from seg_train.models import stochastic
from seg_train.models.attention import DEFAULT
from seg_train.models.dino.vit import dino_encoder, encoder_parts, run_blocks
from seg_train.models.layers import LayerNorm, dense, gelu

_TINY = float(np.finfo(np.float32).tiny)
_UPSCALE_EPSILON = 1e-6




def _to_patch_grid(mask_logits, grid_h, grid_w, q: int):
    """Mask logits [b, Q, h, w] -> [b, Q, gh * gw] resized bilinearly (half-pixel centres, no antialias: torch's
    F.interpolate(mode="bilinear"))."""
    small = tf.image.resize(tf.transpose(mask_logits, [0, 2, 3, 1]), (grid_h, grid_w), method="bilinear")
    return tf.transpose(tf.reshape(small, [tf.shape(mask_logits)[0], -1, q]), [0, 2, 1])


def mask_keeps(seeds, block: int, prob, queries: int):
    """bool [b, Q]: which (sample, query) keeps its attention mask in EoMT block `block` (0-based): u < prob,
    u ~ U[0, 1) drawn per sample from its seed [2] folded with the block index (Philox named rather than the
    device's automatic choice). prob 0 keeps none, 1 all."""
    def draw(seed):
        key = tf.random.experimental.stateless_fold_in(seed, block, alg="philox")
        return stochastic.uniform([queries], key)  # as tf.random.stateless_uniform, also under XLA

    u = stochastic.per_row(draw, seeds, [queries])
    return u < tf.cast(prob, tf.float32)


def blocked_patches(mask_logits, keeps, grid_h, grid_w, q: int):
    """bool [b, Q, N]: the masked attention of a block on the tokens [q queries, CLS, registers, N patches] in
    models/attention.py's compact form (the first Q rows, the last N columns): True (MASKED added to the logit)
    where a query that keeps its mask (`keeps` [b, Q]) meets a patch whose mask logit at the patch grid is
    <= 0; every other pair attends (patches and CLS to everything, queries to the queries, CLS, registers)."""
    return (_to_patch_grid(mask_logits, grid_h, grid_w, q) <= 0.0) & keeps[:, :, None]


def semantic_logits(class_logits, mask_logits, size):
    """[b, H, W, K] float32: log(max(scores, tiny)) of scores[c] = sum_q softmax(class_q)[c] *
    sigmoid(mask_q resized bilinearly to `size`), the no-object class dropped (module doc)."""
    masks = tf.image.resize(tf.transpose(tf.cast(mask_logits, tf.float32), [0, 2, 3, 1]), size, method="bilinear")
    probs = tf.nn.softmax(tf.cast(class_logits, tf.float32), axis=-1)[..., :-1]
    scores = tf.einsum("bhwq,bqk->bhwk", tf.sigmoid(masks), probs)
    return tf.math.log(tf.maximum(scores, _TINY))


class EoMT(keras.Model):
    """EoMT on a vit.py encoder (module doc): `backbone` is the only nested model; every variable is created
    here, at construction."""

    def __init__(self, spec: ViTVariant, num_classes: int, queries: int, eomt_blocks: int, upscale_blocks: int = 2,
                 drop_path_rate: float = 0.0, label: str | None = None, name: str = "eomt",
                 attention: str = DEFAULT, **kwargs):
        super().__init__(name=name, **kwargs)
        if not 1 <= eomt_blocks <= spec.depth:
            raise ValueError(f"eomt: eomt_blocks {eomt_blocks}: expected 1..{spec.depth} (the ViT's depth)")
        self.spec, self.num_classes, self.num_queries = spec, num_classes, queries
        self.eomt_blocks, self.upscale_blocks = eomt_blocks, upscale_blocks
        c = spec.width
        self.backbone = dino_encoder(spec, layers=(spec.depth,), drop_path_rate=drop_path_rate, norm=True,
                                     label=label, attention=attention)
        self.queries = self.add_weight(shape=(queries, c), initializer=keras.initializers.RandomNormal(stddev=1.0),
                                       name="queries")
        self.class_head = dense(num_classes + 1, "class_head")
        # Tuples, not lists: Keras 3 keeps a list of layers out of tf.train.Checkpoint's object graph (its
        # TrackedList is no TensorFlow trackable), so a checkpoint restoring the model alone would miss them.
        self.mask_mlp = (dense(c, "mask_mlp1", activation="gelu"), dense(c, "mask_mlp2", activation="gelu"),
                         dense(c, "mask_mlp3"))
        upscale = []  # per block: deconv, GELU, depthwise conv, LayerNorm
        for i in range(1, upscale_blocks + 1):
            upscale += [layers.Conv2DTranspose(c, 2, strides=2, name=f"upscale{i}_deconv"),
                        layers.Activation(gelu, name=f"upscale{i}_gelu"),
                        layers.DepthwiseConv2D(3, padding="same", use_bias=False, name=f"upscale{i}_dwconv"),
                        LayerNorm(epsilon=_UPSCALE_EPSILON, name=f"upscale{i}_norm")]
        self.upscale = tuple(upscale)
        vector, grid = (None, c), (None, None, None, c)
        self.class_head.build(vector)
        for layer in self.mask_mlp:
            layer.build(vector)
        for layer in self.upscale:
            layer.build(grid)
        self.built = True

    @property
    def first_eomt_block(self) -> int:
        """The 1-based block before which the queries join the tokens."""
        return self.spec.depth - self.eomt_blocks + 1

    def _predict(self, normed, grid_h, grid_w):
        """(class logits, mask logits) in float32 from tokens [b, Q + 1 + R + N, C] after the final LayerNorm."""
        q, prefix = self.num_queries, 1 + self.spec.registers
        # A split, not two slices: its gradient is one concat, where each slice's is a zero-filled full-size
        # tensor (StridedSliceGrad) and the two are added.
        queries, _, patches = tf.split(normed, [q, prefix, -1], axis=1)
        queries = tf.ensure_shape(queries, [None, q, normed.shape[-1]])  # Q static in a trace
        class_logits = tf.cast(self.class_head(queries), tf.float32)
        pixels = tf.reshape(patches, [tf.shape(normed)[0], grid_h, grid_w, normed.shape[-1]])
        for layer in self.upscale:
            pixels = layer(pixels)
        embed = queries
        for layer in self.mask_mlp:
            embed = layer(embed)
        mask_logits = tf.einsum("bqc,bhwc->bqhw", tf.cast(embed, tf.float32), tf.cast(pixels, tf.float32))
        return class_logits, mask_logits

    def _forward(self, images, every: bool, mask_probs=None, seeds=None, training=None):
        """The predictions: before each EoMT block and the final one when `every`, else the final one only;
        masked attention when `mask_probs` is given (with `every`)."""
        parts, spec, q = encoder_parts(self.backbone), self.spec, self.num_queries
        prefix = 1 + spec.registers
        grid = parts.patch_embed(parts.patch_check(images))
        tokens = parts.tokens(grid)
        rope = parts.rope(grid) if parts.rope is not None else ()
        grid_h, grid_w = tf.shape(grid)[1], tf.shape(grid)[2]
        norm = parts.norm
        if mask_probs is not None:
            if seeds is None:
                raise ValueError("EoMT.predictions: mask_probs given without seeds (int32 [batch, 2])")
            mask_probs = tf.convert_to_tensor(mask_probs, tf.float32)
            if mask_probs.shape.rank != 1 or mask_probs.shape[0] not in (None, self.eomt_blocks):
                raise ValueError(f"EoMT.predictions: mask_probs of shape {mask_probs.shape}: expected one "
                                 f"probability per EoMT block, [{self.eomt_blocks}]")
        # train.recompute (models/recompute.py); the mask draws stay outside the recomputed blocks.
        recomputed = bool(training) and self.backbone.recompute != "none"
        out = []
        for i in range(1, spec.depth + 1):
            eomt = i >= self.first_eomt_block
            if i == self.first_eomt_block:
                joined = tf.tile(tf.cast(self.queries, tokens.dtype)[None], [tf.shape(tokens)[0], 1, 1])
                tokens = tf.concat([joined, tokens], axis=1)
            blocked = None
            if eomt and every:
                out.append(self._predict(norm(tokens), grid_h, grid_w))
                if mask_probs is not None:
                    j = i - self.first_eomt_block
                    keeps = mask_keeps(seeds, j, mask_probs[j], q)
                    blocked = blocked_patches(out[-1][1], keeps, grid_h, grid_w, q)
            tokens = run_blocks(parts.blocks[i - 1], tokens, rope, recomputed=recomputed, blocked=blocked,
                                prefix=q + prefix if eomt else None, training=training)
        out.append(self._predict(norm(tokens), grid_h, grid_w))
        return out

    def predictions(self, images, mask_probs=None, seeds=None, training=False):
        """The training entry (module doc): a list of (class_logits, mask_logits), the final one last."""
        if not training:
            return self._forward(images, every=False, training=False)
        return self._forward(images, every=True, mask_probs=mask_probs, seeds=seeds, training=True)

    def call(self, images, training=None):
        """[b, H, W, K] float32 semantic logits from the final prediction, no masking (module doc)."""
        class_logits, mask_logits = self._forward(images, every=False, training=training)[-1]
        return semantic_logits(class_logits, mask_logits, tf.shape(images)[1:3])

    def compute_output_shape(self, shape):
        return (*shape[:3], self.num_classes)

    @property
    def output_shape(self):
        """The semantic logits' shape, as a functional model reports it (serving and export read the classes)."""
        return (None, None, None, self.num_classes)


def eomt(name, num_classes: int, queries: int = 100, eomt_blocks: int = 4, upscale_blocks: int = 2,
         drop_path_rate: float = 0.0, label: str | None = None, attention: str = DEFAULT) -> EoMT:
    """EoMT on the ViT `name` (a VIT_VARIANTS key, or a ViTVariant, then named `label`); call inside
    `strategy.scope()` for one set of variables. `attention`: the ViT's form of attention (models/attention.py's
    METHODS)."""
    spec = VIT_VARIANTS[name] if isinstance(name, str) else name
    return EoMT(spec, num_classes, queries, eomt_blocks, upscale_blocks, drop_path_rate,
                label=name if isinstance(name, str) else label, attention=attention)
