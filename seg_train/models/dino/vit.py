"""DINOv3 and DINOv2 ViT encoders (Simeoni et al. 2025; Oquab et al. 2023) for any input size.

A plain ViT with CLS and register tokens and layer-scaled pre-norm blocks. DINOv3 (patch 16) puts
rotary embeddings on the patch tokens' q and k from the actual grid; DINOv2 (patch 14) adds a learned
37x37 position embedding resized bicubically to the actual grid (TensorFlow's resize as keras-hub's, or
torch's as transformers': ViTVariant.torch_bicubic). The output is the patch tokens of the chosen blocks as
[b, H/p, W/p, C] maps. The transformers format loads through models/dino/transformers.py.

Not keras-hub's DINOV3Backbone/DINOV2Backbone: those compute the rotary table and resized positions
for the one input shape they were built for, while evaluation is traced once for unknown H and W.
Variables, layout and arithmetic follow keras-hub's, so its presets load (models/dino/presets.py).

Mixed precision: LayerNorm moments, RoPE, attention logits/softmax and the position resize in float32.
Inputs must be a multiple of the patch size (a known size that is not is refused; callers pad).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
import tensorflow as tf
from keras import layers

from seg_train.config.variants import VIT_VARIANTS, ViTVariant, four_blocks, swiglu_width
from seg_train.models.attention import BLOCK, DEFAULT, METHODS
from seg_train.models.attention import attention as attend
from seg_train.models.layers import LayerNorm, dense
from seg_train.models.recompute import recompute
from seg_train.models.stochastic import DropPath


def rope_tables(grid_h, grid_w, head_dim: int, theta: float):
    """DINOv3's rotary (cos, sin) [grid_h * grid_w, head_dim] in float32, the patches in row-major order.

    Patch centres mapped to [-1, 1]; head_dim / 4 frequencies; row angles then column angles, repeated
    once (rotate-half pairs dimension d with d + head_dim / 2).
    """
    inv_freq = 1.0 / theta ** tf.range(0.0, 1.0, 4.0 / head_dim, dtype=tf.float32)
    gh, gw = tf.cast(grid_h, tf.float32), tf.cast(grid_w, tf.float32)
    ch = (tf.cast(tf.range(grid_h), tf.float32) + 0.5) / gh
    cw = (tf.cast(tf.range(grid_w), tf.float32) + 0.5) / gw
    coords = tf.stack([tf.repeat(ch[:, None], grid_w, axis=1), tf.repeat(cw[None, :], grid_h, axis=0)], axis=-1)
    coords = 2.0 * tf.reshape(coords, [-1, 2]) - 1.0                      # [N, 2]: (row, column)
    angles = 2 * math.pi * coords[:, :, None] * inv_freq[None, None, :]   # [N, 2, head_dim / 4]
    angles = tf.reshape(angles, [-1, head_dim // 2])
    angles = tf.tile(angles, [1, 2])
    return tf.cos(angles), tf.sin(angles)


def torch_bicubic_matrix(n_in: int, n_out):
    """[n_out, n_in] float32: the 1-D resize of torch's F.interpolate(mode="bicubic", align_corners=False,
    antialias=False) given a size, as a matrix: source x = (i + 0.5) * n_in / n_out - 0.5, Keys' cubic with
    a = -0.75 on its 4 neighbours, indices clamped at the edges. TensorFlow's bicubic differs (a = -0.5, taps
    outside the image dropped); with antialias the two libraries agree (tests/test_transformers_weights.py)."""
    a = -0.75
    scale = tf.cast(n_in, tf.float32) / tf.cast(n_out, tf.float32)
    src = (tf.cast(tf.range(n_out), tf.float32) + 0.5) * scale - 0.5
    start = tf.floor(src)
    t = src - start

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = (far(t + 1), near(t), near(1 - t), far(2 - t))
    first = tf.cast(start, tf.int32) - 1
    return tf.add_n([tf.one_hot(tf.clip_by_value(first + k, 0, n_in - 1), n_in) * w[:, None]
                     for k, w in enumerate(weights)])


def resize_positions(pos, grid_h, grid_w, antialias: bool, cls: bool = True, torch_bicubic: bool = False):
    """DINOv2's position embedding [1, 1 + G*G, C] (`cls` false: [1, G*G, C]) for a grid_h x grid_w patch
    grid: the CLS entry kept, the grid resized bicubically in float32 (tf.image.resize: keras.ops.image.resize
    refuses a dynamic size; at the G x G grid the resize is the identity). `torch_bicubic` without
    `antialias`: torch's bicubic (`torch_bicubic_matrix`) on each axis."""
    c, first = pos.shape[-1], int(cls)
    g = int(round((pos.shape[1] - first) ** 0.5))
    grid = tf.reshape(tf.cast(pos[:, first:], tf.float32), [1, g, g, c])
    if torch_bicubic and not antialias:
        grid = tf.einsum("hi,bijc,wj->bhwc", torch_bicubic_matrix(g, grid_h), grid, torch_bicubic_matrix(g, grid_w))
    else:
        grid = tf.image.resize(grid, (grid_h, grid_w), method="bicubic", antialias=antialias)
    grid = tf.reshape(grid, [1, -1, c])
    return tf.concat([tf.cast(pos[:, :1], tf.float32), grid], axis=1) if cls else grid


@keras.saving.register_keras_serializable(package="seg_train")
class PatchGrid(layers.Layer):
    """The identity on the image, refusing a known height or width that is not a multiple of the patch."""

    def __init__(self, patch: int, **kwargs):
        super().__init__(**kwargs)
        self.patch = patch

    def call(self, x):
        h, w = x.shape[1], x.shape[2]
        if (h is not None and h % self.patch) or (w is not None and w % self.patch):
            raise ValueError(f"input {h}x{w} for a patch-{self.patch} ViT: expected height and width that are "
                             f"multiples of {self.patch} (pad or crop to one)")
        return x

    def compute_output_shape(self, shape):
        return shape

    def get_config(self):
        return {**super().get_config(), "patch": self.patch}


@keras.saving.register_keras_serializable(package="seg_train")
class Tokens(layers.Layer):
    """The patch map [b, gh, gw, C] -> the token sequence [b, 1 + R + gh * gw, C]: CLS, R registers, patches.

    DINOv2 (`pos_grid` > 0): the position embedding (CLS entry, then the grid resized to gh x gw) is added
    to CLS and the patches before the registers go in, as the reference does; without `cls_position` it has
    no CLS entry and is added to the patches only.
    """

    def __init__(self, registers: int, pos_grid: int = 0, antialias: bool = False, cls_position: bool = True,
                 torch_bicubic: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.registers, self.pos_grid, self.antialias = registers, pos_grid, antialias
        self.cls_position, self.torch_bicubic = cls_position, torch_bicubic

    def build(self, shape):
        c = shape[-1]
        init = keras.initializers.TruncatedNormal(stddev=0.02)
        self.cls_token = self.add_weight(shape=(1, 1, c), initializer=init, name="cls_token")
        self.register_tokens = self.add_weight(shape=(1, self.registers, c), initializer=init,
                                               name="register_tokens") if self.registers else None
        entries = int(self.cls_position) + self.pos_grid ** 2
        self.position_embeddings = self.add_weight(shape=(1, entries, c), initializer=init,
                                                   name="position_embeddings") if self.pos_grid else None

    def call(self, x):
        shape = tf.shape(x)
        b, c = shape[0], x.shape[-1]
        patches = tf.reshape(x, [b, -1, c])
        cls = tf.tile(tf.cast(self.cls_token, x.dtype), [b, 1, 1])
        if self.pos_grid:
            pos = resize_positions(self.position_embeddings, shape[1], shape[2], self.antialias,
                                   self.cls_position, self.torch_bicubic)
            if not self.cls_position:
                patches = patches + tf.cast(pos, x.dtype)
        tokens = tf.concat([cls, patches], axis=1)
        if self.pos_grid and self.cls_position:
            tokens = tokens + tf.cast(pos, x.dtype)
        if self.registers:
            reg = tf.tile(tf.cast(self.register_tokens, x.dtype), [b, 1, 1])
            tokens = tf.concat([tokens[:, :1], reg, tokens[:, 1:]], axis=1)
        return tokens

    def compute_output_shape(self, shape):
        return (shape[0], None, shape[-1])

    def get_config(self):
        return {**super().get_config(), "registers": self.registers, "pos_grid": self.pos_grid,
                "antialias": self.antialias, "cls_position": self.cls_position, "torch_bicubic": self.torch_bicubic}


@keras.saving.register_keras_serializable(package="seg_train")
class RopeTables(layers.Layer):
    """The patch map [b, gh, gw, C] -> DINOv3's rotary (cos, signed sin), each [gh * gw, head_dim]: `rope_tables`
    with the sine's first half negated, once for every block, so that the rotation needs no negated activations
    (a NEG op has no int8 kernel in TFLite: each would take the attention out of int8)."""

    def __init__(self, head_dim: int, theta: float, **kwargs):
        super().__init__(**kwargs)
        self.head_dim, self.theta = head_dim, theta

    def call(self, x):
        shape = tf.shape(x)
        cos, sin = rope_tables(shape[1], shape[2], self.head_dim, self.theta)
        half = self.head_dim // 2
        return cos, sin * tf.constant([-1.0] * half + [1.0] * half, tf.float32)

    def compute_output_shape(self, shape):
        return (None, self.head_dim), (None, self.head_dim)

    def get_config(self):
        return {**super().get_config(), "head_dim": self.head_dim, "theta": self.theta}


@keras.saving.register_keras_serializable(package="seg_train")
class Attention(layers.Layer):
    """Multi-head softmax(q k^T / sqrt(d) + bias) v over a token sequence [b, T, C]; with (cos, sin) the
    tokens after the first `prefix` get rotary embeddings on q and k (rotate-half form; `sin` is RopeTables'
    signed sine). RoPE, logits and softmax in float32; no weights (the projections are the Dense layers
    around it). `method`: models/attention.py's plain or blockwise form (`block` keys per block), the same
    function; the rotation is applied before either.

    At call: `bias` (float32 [b, T, T], added to every head's logits), `blocked` (bool [b, R, C]: EoMT's masked
    attention in compact form, models/attention.py) and `prefix` (instead of the constructor's: EoMT's queries
    come before CLS and the registers).
    """

    def __init__(self, heads: int, prefix: int = 0, method: str = DEFAULT, block: int = BLOCK, **kwargs):
        super().__init__(**kwargs)
        if method not in METHODS:
            raise ValueError(f"Attention: method {method!r}: expected one of {', '.join(METHODS)}")
        self.heads, self.prefix, self.method, self.block = heads, prefix, method, block

    def call(self, q, k, v, cos=None, sin=None, bias=None, prefix=None, blocked=None):
        c = q.shape[-1]
        d = c // self.heads
        shape = tf.shape(q)

        def split(t):  # [b, T, C] -> [b, heads, T, d]
            return tf.transpose(tf.reshape(t, [shape[0], -1, self.heads, d]), [0, 2, 1, 3])

        q, k = split(tf.cast(q, tf.float32)), split(tf.cast(k, tf.float32))
        if cos is not None:
            first = self.prefix if prefix is None else prefix
            q, k = (self._rotate(t, tf.cast(cos, tf.float32), tf.cast(sin, tf.float32), first) for t in (q, k))
        bias = None if bias is None else tf.cast(bias, tf.float32)
        out = attend(q, k, split(v), self.method, bias=bias, blocked=blocked, block=self.block)
        return tf.reshape(tf.transpose(out, [0, 2, 1, 3]), [shape[0], -1, c])

    def _rotate(self, t, cos, sin, prefix):
        # The first `prefix` tokens take cos 1 and sin 0: t * 1 + swapped * 0 is t exactly (and so is its
        # gradient), so every token goes through the same ops. Slicing the patches out and concatenating the
        # prefix back cost a StridedSliceGrad (a zero-filled copy of the whole tensor) per slice in the backward
        # pass, several times the rotation's own arithmetic on the CPU; the halves swapped by a reverse of a
        # [.., 2, d / 2] view (its gradient is the same reverse) instead of two slices, for the same reason.
        shape, d = tf.shape(t), t.shape[-1]
        cos = tf.pad(cos, [[prefix, 0], [0, 0]], constant_values=1.0)
        sin = tf.pad(sin, [[prefix, 0], [0, 0]])
        # rotate_half(x) * sin = [-x2, x1] * [s1, s2] = [x2, x1] * [-s1, s2]: the same products, no negation.
        halves = tf.reshape(t, tf.concat([shape[:-1], [2, d // 2]], axis=0))
        swapped = tf.reshape(tf.reverse(halves, axis=[-2]), shape)
        return t * cos + swapped * sin

    def compute_output_shape(self, q_shape, *_):
        return q_shape

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "prefix": self.prefix, "method": self.method,
                "block": self.block}


@keras.saving.register_keras_serializable(package="seg_train")
class LayerScale(layers.Layer):
    """x * gamma, a learned per-channel factor on a residual branch (Touvron et al. 2021)."""

    def __init__(self, init: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.init = init

    def build(self, shape):
        self.gamma = self.add_weight(shape=(shape[-1],), initializer=keras.initializers.Constant(self.init),
                                     name="gamma")

    def call(self, x):
        return x * tf.cast(self.gamma, x.dtype)

    def compute_output_shape(self, shape):
        return shape

    def get_config(self):
        return {**super().get_config(), "init": self.init}


@keras.saving.register_keras_serializable(package="seg_train")
class SwiGLU(layers.Layer):
    """silu(a) * b of the two halves of the last axis (DINOv2's SwiGLU between its two projections)."""

    def call(self, x):
        a, b = tf.split(x, 2, axis=-1)
        return tf.nn.silu(a) * b

    def compute_output_shape(self, shape):
        return (*shape[:-1], shape[-1] // 2)


@keras.saving.register_keras_serializable(package="seg_train")
class PatchMap(layers.Layer):
    """Tokens [b, 1 + R + N, C] -> the patch tokens as a map [b, gh, gw, C] shaped like the patch map given."""

    def __init__(self, prefix: int, **kwargs):
        super().__init__(**kwargs)
        self.prefix = prefix

    def call(self, tokens, grid):
        shape = tf.shape(grid)
        return tf.reshape(tokens[:, self.prefix:], [shape[0], shape[1], shape[2], tokens.shape[-1]])

    def compute_output_shape(self, tokens_shape, grid_shape):
        return (*grid_shape[:3], tokens_shape[-1])

    def get_config(self):
        return {**super().get_config(), "prefix": self.prefix}




def _block_layers(spec: ViTVariant, name: str, drop_path: float, attention: str = DEFAULT) -> dict:
    """One block's layers by role; each named f"{name}_{role}" (the names presets are loaded by)."""
    c = spec.width
    out = {"norm1": LayerNorm(epsilon=spec.epsilon, name=f"{name}_norm1"),
           "attn_q": dense(c, f"{name}_attn_q"),
           "attn_k": dense(c, f"{name}_attn_k", use_bias=spec.key_bias),
           "attn_v": dense(c, f"{name}_attn_v"),
           "attn": Attention(spec.heads, 1 + spec.registers, attention, name=f"{name}_attn"),
           "attn_out": dense(c, f"{name}_attn_out"),
           "ls1": LayerScale(spec.layer_scale, name=f"{name}_ls1"),
           "add1": layers.Add(name=f"{name}_add1"),
           "norm2": LayerNorm(epsilon=spec.epsilon, name=f"{name}_norm2")}
    if spec.family == "dinov2" and spec.gated:
        out.update(mlp_in=dense(2 * swiglu_width(spec.mlp), f"{name}_mlp_in"),
                   mlp_swiglu=SwiGLU(name=f"{name}_mlp_swiglu"), mlp_out=dense(c, f"{name}_mlp_out"))
    elif spec.gated:
        out.update(mlp_gate=dense(spec.mlp, f"{name}_mlp_gate", activation=spec.activation),
                   mlp_up=dense(spec.mlp, f"{name}_mlp_up"), mlp_down=dense(c, f"{name}_mlp_down"),
                   mlp_mul=layers.Multiply(name=f"{name}_mlp_mul"))
    else:
        out.update(mlp_up=dense(spec.mlp, f"{name}_mlp_up", activation=spec.activation),
                   mlp_down=dense(c, f"{name}_mlp_down"))
    out.update(ls2=LayerScale(spec.layer_scale, name=f"{name}_ls2"), add2=layers.Add(name=f"{name}_add2"))
    if drop_path:
        out.update(drop_path1=DropPath(drop_path, name=f"{name}_drop_path1"),
                   drop_path2=DropPath(drop_path, name=f"{name}_drop_path2"))
    return out


class EncoderParts(NamedTuple):
    """An encoder's layers by role: what code outside this module uses instead of the layer names, which belong
    here (presets and checkpoints depend on them)."""
    patch_check: layers.Layer
    patch_embed: layers.Layer
    tokens: layers.Layer
    rope: layers.Layer | None  # DINOv3's rotary tables (no weights); None for DINOv2
    blocks: list               # block i + 1's layers by role (`run_block`'s parts), for the blocks built
    norm: layers.Layer | None  # the final LayerNorm (None when built without it)

    def levels(self) -> dict[int, int]:
        """id(variable) -> its depth in the encoder, the parameter groups of layer-wise decay: 0 for the embeddings
        (patch embedding, CLS / register tokens, positions), i for block i's, and the last block's number for the
        final norm (it learns with the last block, as EoMT's and BEiT's grouping put it)."""
        out = {id(v): 0 for layer in (self.patch_embed, self.tokens) for v in layer.weights}
        for i, parts in enumerate(self.blocks, start=1):
            out.update({id(v): i for layer in parts.values() for v in layer.weights})
        if self.norm is not None:
            out.update({id(v): len(self.blocks) for v in self.norm.weights})
        return out


def encoder_parts(model: keras.Model) -> EncoderParts:
    """The parts of an encoder built by `dino_encoder`."""
    names = {layer.name for layer in model.layers}
    blocks = []
    while f"block{len(blocks) + 1}_norm1" in names:
        prefix = f"block{len(blocks) + 1}_"
        blocks.append({layer.name[len(prefix):]: layer for layer in model.layers if layer.name.startswith(prefix)})
    get = lambda name: model.get_layer(name) if name in names else None  # noqa: E731
    return EncoderParts(get("patch_check"), get("patch_embed"), get("tokens"), get("rope"), blocks, get("norm"))


def run_block(parts: dict, x, rope=(), bias=None, prefix=None, training=None, blocked=None):
    """One block on the tokens x [b, T, C] (symbolic while an encoder is built, or tensors: models/eomt/eomt.py),
    with `parts` from `_block_layers` / `EncoderParts.blocks`; each residual branch dropped per sample (DropPath).
    `bias`, `prefix`, `blocked`: Attention's call arguments."""
    y = parts["norm1"](x)
    q, k, v = parts["attn_q"](y), parts["attn_k"](y), parts["attn_v"](y)
    extra = {} if bias is None and prefix is None and blocked is None else \
        {"bias": bias, "prefix": prefix, "blocked": blocked}
    drop = {} if training is None else {"training": training}
    y = parts["attn"](q, k, v, *rope, **extra)
    y = parts["ls1"](parts["attn_out"](y))
    if "drop_path1" in parts:
        y = parts["drop_path1"](y, **drop)
    x = parts["add1"]([x, y])

    y = parts["norm2"](x)
    if "mlp_in" in parts:
        y = parts["mlp_out"](parts["mlp_swiglu"](parts["mlp_in"](y)))
    elif "mlp_gate" in parts:
        y = parts["mlp_down"](parts["mlp_mul"]([parts["mlp_gate"](y), parts["mlp_up"](y)]))
    else:
        y = parts["mlp_down"](parts["mlp_up"](y))
    y = parts["ls2"](y)
    if "drop_path2" in parts:
        y = parts["drop_path2"](y, **drop)
    return parts["add2"]([x, y])


def run_blocks(parts: dict, x, rope=(), recomputed: bool = False, **kwargs):
    """`run_block`, its activations recomputed in the backward pass instead of stored when `recomputed`
    (train.recompute: blocks; models/recompute.py); `kwargs`: run_block's."""
    def one(tokens):
        return run_block(parts, tokens, rope, **kwargs)

    return recompute(one, x, parts.values()) if recomputed else one(x)


@keras.saving.register_keras_serializable(package="seg_train")
class ViTEncoder(keras.Model):
    """`dino_encoder`'s functional model. With `recompute` "blocks" (train.recompute; set after building) a
    training call runs the same layers on the same graph block by block (`run_blocks`), each block's activations
    recomputed in the backward pass; any other call runs the functional graph."""

    recompute = "none"
    layers_chosen: tuple = ()

    def call(self, inputs, training=None, mask=None):
        if not training or self.recompute == "none":
            return super().call(inputs, training=training, mask=mask)
        parts = encoder_parts(self)
        grid = parts.patch_embed(parts.patch_check(inputs))
        x = parts.tokens(grid)
        rope = parts.rope(grid) if parts.rope is not None else ()
        found = {}
        for i, block in enumerate(parts.blocks, start=1):
            x = run_blocks(block, x, rope, recomputed=True, training=training)
            if i in self.layers_chosen:
                found[i] = self.get_layer(f"map{i}")(parts.norm(x) if parts.norm else x, grid)
        return [found[i] for i in self.layers_chosen]


def _block(x, rope, spec: ViTVariant, name: str, drop_path: float, attention: str = DEFAULT):
    """One block on the tokens x [b, T, C]; each residual branch dropped per sample with `drop_path`."""
    return run_block(_block_layers(spec, name, drop_path, attention), x, rope)


def drop_path_rates(spec: ViTVariant, rate: float) -> list[float]:
    """Each block's drop-path rate: DINOv3 linearly from 0 to `rate`, DINOv2 `rate` everywhere (keras-hub's)."""
    if spec.family == "dinov2" or spec.depth == 1:
        return [rate] * spec.depth
    return [rate * i / (spec.depth - 1) for i in range(spec.depth)]


def dino_encoder(name, layers: tuple[int, ...] | None = None, drop_path_rate: float = 0.0,
                 norm: bool = True, label: str | None = None, attention: str = DEFAULT) -> keras.Model:
    """The DINO encoder `name` (a VIT_VARIANTS key, or a ViTVariant): one [b, H/p, W/p, C] map per block of
    `layers` (1-based; default `four_blocks`). `norm`: apply the final LayerNorm to each map (as DINO's
    own segmentation heads do). `attention`: each block's form of attention (models/attention.py's METHODS).
    Blocks after the last one asked for are not built. `label`: the model's name (default `name`, or
    "<family>_custom" for a ViTVariant)."""
    spec = VIT_VARIANTS[name] if isinstance(name, str) else name
    label = label or (name if isinstance(name, str) else f"{spec.family}_custom")
    chosen = tuple(layers or four_blocks(spec.depth))
    if not all(1 <= i <= spec.depth for i in chosen):
        raise ValueError(f"dino_encoder {label}: layers {chosen}: expected block numbers 1..{spec.depth}")
    inp = keras.Input((None, None, 3), name="image")
    x = PatchGrid(spec.patch, name="patch_check")(inp)
    grid = keras.layers.Conv2D(spec.width, spec.patch, strides=spec.patch, name="patch_embed",
                               kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.02))(x)
    v2 = spec.family == "dinov2"
    x = Tokens(spec.registers, spec.pos_grid if v2 else 0, spec.antialias, spec.cls_position, spec.torch_bicubic,
               name="tokens")(grid)
    rope = () if v2 else RopeTables(spec.width // spec.heads, spec.rope_theta, name="rope")(grid)
    final = LayerNorm(epsilon=spec.epsilon, name="norm") if norm else None
    found = {}
    for i, rate in enumerate(drop_path_rates(spec, drop_path_rate), start=1):
        x = _block(x, rope, spec, f"block{i}", rate, attention)
        if i in chosen:
            found[i] = PatchMap(1 + spec.registers, name=f"map{i}")(final(x) if final else x, grid)
        if i == max(chosen):
            break
    model = ViTEncoder(inp, [found[i] for i in chosen], name=label)
    model.layers_chosen = chosen
    return model
