"""The Mix Transformer (MiT-B0..B5), SegFormer's encoder (Xie et al., NeurIPS 2021), for any input size.

Four stages of overlapping patch embedding, transformer blocks (efficient self-attention with keys and
values from a map shrunk by the stage's reduction ratio; Mix-FFN with a 3x3 depthwise conv as the
position information) and a LayerNorm; features at strides 4, 8, 16, 32.

Not keras-hub's MiTBackbone: it rebuilds the 2-D map as H = W = sqrt(N), so it takes only square
inputs of the size it was built for; here every layer works on the [b, H, W, C] map with its dynamic
shape, so any H x W works. Variables match keras-hub's, so its presets load (models/mit/presets.py); GELU
(tanh form) and the stage LayerNorms' epsilon 1e-5 follow keras-hub so the presets give its outputs.

Mixed precision: LayerNorm moments and attention logits/softmax in float32 (float16 logits overflow).
Inputs need at least 29 pixels per side, for the first stage's 8x8 reduction conv.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers

from seg_train.config.variants import MIT_VARIANTS
from seg_train.models.attention import BLOCK, METHODS
from seg_train.models.attention import attention as attend
from seg_train.models.layers import LayerNorm, dense
from seg_train.models.stochastic import DropPath

STRIDES = (4, 8, 16, 32)  # each stage's output stride
_MLP_RATIO = 4
# The epsilons: blocks' LayerNorms, and every other LayerNorm (embeddings, reductions, stage ends).
BLOCK_EPSILON, EPSILON = 1e-6, 1e-5


@keras.saving.register_keras_serializable(package="seg_train")
class EfficientAttention(layers.Layer):
    """Multi-head softmax(q k^T / sqrt(d)) v of a query map [b, h, w, c] and a key/value map [b, h', w', c].

    No weights: the projections are the Dense layers around it. Any h x w, also unknown in a trace.
    `method`: models/attention.py's plain or blockwise form (`block` keys per block), the same function.
    """

    # plain: with keys from the reduced map the blockwise form saved no memory at 512 (docs/PERFORMANCE.md).
    def __init__(self, heads: int, method: str = "plain", block: int = BLOCK, **kwargs):
        super().__init__(**kwargs)
        if method not in METHODS:
            raise ValueError(f"EfficientAttention: method {method!r}: expected one of {', '.join(METHODS)}")
        self.heads, self.method, self.block = heads, method, block

    def call(self, q, k, v):
        c = q.shape[-1]
        d = c // self.heads
        shape = tf.shape(q)

        def split(t):  # [b, h, w, c] -> [b, heads, h * w, d]
            t = tf.reshape(t, [shape[0], -1, self.heads, d])
            return tf.transpose(t, [0, 2, 1, 3])

        # Logits and softmax in float32 under a mixed policy (module doc); no-ops in float32.
        out = attend(split(tf.cast(q, tf.float32)), split(tf.cast(k, tf.float32)), split(v), self.method,
                     block=self.block)  # [b, heads, h * w, d]
        out = tf.transpose(out, [0, 2, 1, 3])
        return tf.reshape(out, [shape[0], shape[1], shape[2], c])

    def compute_output_shape(self, q_shape, k_shape, v_shape):
        return q_shape

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "method": self.method, "block": self.block}


@keras.saving.register_keras_serializable(package="seg_train")
class Gelu(layers.Layer):
    """GELU as keras.ops.gelu computes it by default (the tanh approximation), as keras-hub's Mix-FFN.

    A layer of its own: keras.layers.Activation("gelu") is the exact (erf) form.
    """

    def call(self, x):
        return keras.ops.gelu(x, approximate=True)


def _layer_norm(epsilon: float, name: str) -> layers.LayerNormalization:
    return LayerNorm(epsilon=epsilon, name=name)


# The original's initialisation (dense N(0, 0.02): models/layers.py's dense; conv N(0, 2 / fan_out)): Keras'
# Glorot default is several times wider, which matters from scratch.
def _conv_init():
    return keras.initializers.VarianceScaling(2.0, mode="fan_out", distribution="untruncated_normal")


def _block(x, width: int, heads: int, sr_ratio: int, name: str, drop_path: float = 0.0, attention: str = "plain"):
    """One transformer block on the map x [b, h, w, width]; each residual branch dropped per sample with
    probability `drop_path` in training (two independent draws)."""
    y = _layer_norm(BLOCK_EPSILON, f"{name}_norm1")(x)
    q = dense(width, f"{name}_attn_q")(y)
    kv = y
    if sr_ratio > 1:
        kv = layers.Conv2D(width, sr_ratio, strides=sr_ratio, kernel_initializer=_conv_init(),
                           name=f"{name}_attn_sr")(kv)
        kv = _layer_norm(EPSILON, f"{name}_attn_sr_norm")(kv)
    k = dense(width, f"{name}_attn_k")(kv)
    v = dense(width, f"{name}_attn_v")(kv)
    y = EfficientAttention(heads, attention, name=f"{name}_attn")(q, k, v)
    y = dense(width, f"{name}_attn_proj")(y)
    if drop_path:
        y = DropPath(drop_path, name=f"{name}_drop_path1")(y)
    x = layers.Add(name=f"{name}_add1")([x, y])

    y = _layer_norm(BLOCK_EPSILON, f"{name}_norm2")(x)
    y = dense(width * _MLP_RATIO, f"{name}_ffn_fc1")(y)
    y = layers.DepthwiseConv2D(3, padding="same", depthwise_initializer=_conv_init(), name=f"{name}_ffn_dwconv")(y)
    y = Gelu(name=f"{name}_ffn_gelu")(y)
    y = dense(width, f"{name}_ffn_fc2")(y)
    if drop_path:
        y = DropPath(drop_path, name=f"{name}_drop_path2")(y)
    return layers.Add(name=f"{name}_add2")([x, y])


def drop_path_rates(name: str, rate: float) -> list[float]:
    """Each block's drop-path rate over all stages' blocks: linearly from 0 to `rate` (the paper's)."""
    n = sum(MIT_VARIANTS[name].depths)
    return [rate * i / (n - 1) for i in range(n)]


def mix_transformer(name: str, low_strides: tuple[int, ...] = (4,), drop_path_rate: float = 0.0,
                    attention: str = "plain") -> keras.Model:
    """MiT `name`: the features at each of `low_strides` (4, 8 or 16), then the stride-32 features.
    `drop_path_rate`: the last block's stochastic depth; blocks at rate 0 have no DropPath layer. `attention`:
    each block's form of attention (models/attention.py's METHODS)."""
    spec = MIT_VARIANTS[name]
    rates = iter(drop_path_rates(name, drop_path_rate))
    inp = keras.Input((None, None, 3), name="image")
    x, found = inp, {}
    for i in range(4):
        s = f"stage{i + 1}"
        patch, stride = spec.patch_sizes[i], spec.patch_strides[i]
        x = layers.ZeroPadding2D(patch // 2, name=f"{s}_embed_pad")(x)
        x = layers.Conv2D(spec.widths[i], patch, strides=stride, kernel_initializer=_conv_init(),
                          name=f"{s}_embed_conv")(x)
        x = _layer_norm(EPSILON, f"{s}_embed_norm")(x)
        for j in range(spec.depths[i]):
            x = _block(x, spec.widths[i], spec.heads[i], spec.sr_ratios[i], f"{s}_block{j + 1}", next(rates),
                       attention)
        x = found[STRIDES[i]] = _layer_norm(EPSILON, f"{s}_norm")(x)
    return keras.Model(inp, [found[s] for s in low_strides] + [found[32]], name=name)
