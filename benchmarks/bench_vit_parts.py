#!/usr/bin/env python
"""The pieces of a ViT block's forward + backward pass alone, each form against the one it replaced or could
replace: CPU milliseconds per call at a DINOv3 ViT-S/16's shapes (docs/PERFORMANCE.md, "The DINOv3 linear step:
the backward pass and the update").

    python benchmarks/bench_vit_parts.py [--batch 2] [--size 224] [--repeats 7] [--calls 10] [--only PIECE]

Each piece is one tf.function of the forward and the gradient with respect to its inputs (given an upstream
gradient), run --calls times in a tf.while_loop per timing (no Python between calls), --repeats timings; the
minimum CPU time of the process per call (all threads; the minimum: the machine is shared) and the median. Pieces
at the tokens of a size x size image (1 + 4 registers + (size / 16)^2) and --batch images:

- rotary: the rotation of q [b, 6, T, 64] as models/dino/vit.py's Attention computes it (every token, the halves
  swapped by a reverse) against its former form (the patches sliced out, the halves sliced and concatenated, the
  prefix concatenated back: a StridedSliceGrad per slice in the backward pass).
- attention: models/attention.py's blockwise loop (the DINO ViTs' default) with all keys in one block (traced with
  unknown lengths, as the model's) against its plain form: what a plain path for keys that fit one block would
  save (not adopted: docs/PERFORMANCE.md).
- gelu: the MLP's activation [b * T, 1536], models/layers.py's gelu (Keras' exact GELU, its three intermediates
  recomputed from x in the backward pass instead of stored: what the models run) against Keras' "gelu"
  differentiated by TensorFlow (before) and a GELU with its gradient written out (tried, not adopted:
  docs/PERFORMANCE.md).
- layernorm: seg-train's LayerNorm [b, T, 384] (its gradient written out, the textbook
  dx = rstd (g - mean(g) - xhat mean(g xhat))) against the same forward differentiated by TensorFlow.
- pixel loss: the linear head's cross-entropy at full resolution, [b, size, size, 150] logits (ADE20K's
  classes), objectives/pixel_losses.py's written-out form against TensorFlow's
  SparseSoftmaxCrossEntropyWithLogits (once per step, not per block).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFIX, HEADS, HEAD_DIM, WIDTH, MLP, CLASSES = 5, 6, 64, 384, 1536, 150


def _former_rotation(tf, t, cos, sin):
    """models/dino/vit.py's rotation before: slices and concatenations."""
    head, patches = t[:, :, :PREFIX], t[:, :, PREFIX:]
    half = t.shape[-1] // 2
    swapped = tf.concat([patches[..., half:], patches[..., :half]], axis=-1)
    return tf.concat([head, patches * cos + swapped * sin], axis=2)


def _written_gelu(tf):
    """The exact GELU, Keras' forward 0.5 x erfc(-x / sqrt 2), with its derivative Phi(x) + x phi(x) written out."""
    @tf.custom_gradient
    def gelu(x):
        def grad(dy):
            pdf = tf.exp(-0.5 * tf.square(x)) * (1.0 / (2.0 * 3.141592653589793) ** 0.5)
            return dy * (0.5 * tf.math.erfc(-x * 0.7071067811865476) + x * pdf)
        return 0.5 * x * tf.math.erfc(-x * 0.7071067811865476), grad
    return gelu


def _former_layernorm(tf, layer):
    """seg-train's LayerNorm before its gradient was written out: the same forward, differentiated by TensorFlow."""
    def run(x):
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        inv = tf.math.rsqrt(variance + layer.epsilon) * layer.gamma
        return x * inv + (layer.beta - mean * inv)
    return run


def pieces(tf, keras, batch: int, size: int) -> dict:
    """name -> {form: (fn, inputs)}: fn(*inputs, upstream) returns the output and the input gradients."""
    import numpy as np

    from seg_train.models.attention import attention
    from seg_train.models.dino.vit import Attention, rope_tables
    from seg_train.models.layers import LayerNorm, gelu
    from seg_train.objectives.pixel_losses import softmax_cross_entropy

    rng = np.random.default_rng(0)
    grid = size // 16
    t = PREFIX + grid * grid

    def const(*shape, scale=1.0):
        return tf.constant((rng.normal(0, scale, shape)).astype("float32"))

    cos, sin = rope_tables(grid, grid, HEAD_DIM, 100.0)
    sin = sin * tf.constant([-1.0] * (HEAD_DIM // 2) + [1.0] * (HEAD_DIM // 2))
    layer = Attention(HEADS, PREFIX)
    q = const(batch, HEADS, t, HEAD_DIM)
    qkv = [const(batch, HEADS, t, HEAD_DIM) for _ in range(3)]
    x_mlp = const(batch * t, MLP, scale=2.0)
    norm = LayerNorm(epsilon=1e-5)
    x_norm = const(batch, t, WIDTH, scale=3.0)
    norm.build(x_norm.shape)
    logits = const(batch, size, size, CLASSES, scale=3.0)
    labels = tf.constant(rng.integers(0, CLASSES, (batch, size, size)).astype("int32"))
    seq = tf.TensorSpec([None, HEADS, None, HEAD_DIM])
    loop = tf.function(lambda a, b, c: attention(a, b, c, "blockwise", block=t), input_signature=[seq] * 3)
    return {
        "rotary": {"every token, reverse (now)": (lambda a: layer._rotate(a, cos, sin, PREFIX), [q]),
                   "slices and concat (before)": (lambda a: _former_rotation(tf, a, cos, sin), [q])},
        "attention": {"blockwise loop, one block (now)": (loop, qkv),
                      "plain (not adopted)": (lambda a, b, c: attention(a, b, c, "plain"), qkv)},
        "gelu": {"recomputed from x (now)": (gelu, [x_mlp]),
                 "Keras gelu, autodiff (before)": (lambda a: keras.activations.gelu(a, approximate=False), [x_mlp]),
                 "written-out gradient (tried)": (_written_gelu(tf), [x_mlp])},
        "layernorm": {"LayerNorm, written-out gradient (now)": (norm, [x_norm]),
                      "the same forward, autodiff (before)": (_former_layernorm(tf, norm), [x_norm])},
        "pixel loss": {"written-out cross-entropy (now)": (lambda a: softmax_cross_entropy(labels, a), [logits]),
                       "TensorFlow's fused op (before)": (
                           lambda a: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=a),
                           [logits])},
    }


def time_form(tf, fn, inputs, calls: int, repeats: int) -> tuple[float, float]:
    """(min, median) CPU ms per call of forward + backward."""
    upstream = tf.ones_like(fn(*inputs)) * 0.5

    @tf.function(autograph=False)
    def run(*xs):
        def body(i, acc):
            with tf.GradientTape() as tape:
                tape.watch(xs)
                y = fn(*xs)  # each iteration runs the body again (a loop's body is not deduplicated)
            grads = tape.gradient(y, xs, output_gradients=upstream)
            return i + 1, acc + 1e-9 * tf.reduce_mean(grads[0])
        return tf.while_loop(lambda i, _: i < calls, body, (0, 0.0))[1]

    run(*inputs).numpy()
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        run(*inputs).numpy()
        times.append((time.process_time() - c0) / calls * 1e3)
    return min(times), statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--size", type=int, default=224, help="a multiple of 16")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--only", action="append", metavar="PIECE", help="time only this piece (repeatable)")
    args = p.parse_args(argv)
    import keras
    import tensorflow as tf

    tokens = PREFIX + (args.size // 16) ** 2
    print(f"batch {args.batch}, {args.size}x{args.size} ({tokens} tokens), forward + backward per call, CPU ms "
          f"(min / median of {args.repeats} timings of {args.calls} calls)\n")
    print("| piece | form | CPU ms min | median | x per step (12 blocks) min |")
    print("| --- | --- | ---: | ---: | ---: |")
    # rotary: q and k per block; layernorm: 2 per block and the final one; the loss once.
    per_step = {"rotary": 24, "attention": 12, "gelu": 12, "layernorm": 25, "pixel loss": 1}
    for name, forms in pieces(tf, keras, args.batch, args.size).items():
        if args.only and name not in args.only:
            continue
        for form, (fn, inputs) in forms.items():
            lo, med = time_form(tf, fn, inputs, args.calls, args.repeats)
            print(f"| {name} | {form} | {lo:.2f} | {med:.2f} | {lo * per_step[name]:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
