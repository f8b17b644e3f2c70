"""The inference modes (eval.mode, eval.flip, eval.scales): one implementation for seg-eval,
evaluation during training, seg-predict, the SavedModel of seg-export and eval/examples.

`class_scores` turns one normalised, UNPADDED image into per-pixel scores at the image's size. A view
is the image at one scale, flipped or not; its logits come from the whole image (mode whole) or from
overlapping windows (mode slide), resized back bilinearly. One view: the scores are its logits (the
default is one plain forward pass); several: the mean of the views' softmax probabilities, so one
view with extreme logits cannot outweigh the others (as DeepLab and mmsegmentation's TTA do).

Each forward pass pads its own input at the bottom/right to a multiple of `pad_to` with zeros (the
mean colour) and crops its logits back; flips and scales act on the unpadded image, so no padding is
ever predicted. A flipped view is flip(view(flip(image))), so a flipped image gives exactly the
flipped prediction.

Slide: windows of eval.crop_size every eval.stride pixels, the last ones aligned to the border; a
pixel's logits are the mean over its windows. Windows run one at a time, so activations are one
window's whatever the image size.

Logit adjustment (tau > 0): a loss with class weights w_c trains towards w_c p(c | x), over-predicting
up-weighted classes; dividing by w_c**tau takes that back (Menon et al., "Long-tail learning via
logit adjustment"). Weight-0 classes are left as they are.

Written for unknown image sizes in graph mode (Keras' UpSampling2D fails on them), so one trace
serves every image.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

PAD_TO = 32


def is_single_view(cfg) -> bool:
    """Whether `cfg` (EvalConfig) predicts from one view (no flip, one scale): the scores are logits."""
    return not cfg.flip and len(cfg.scales) == 1


def describe(cfg) -> str:
    """A short human-readable name of the modes of `cfg`, e.g. 'slide 512x512/341x341, flip, scales 0.75/1/1.25'."""
    parts = ["whole" if cfg.mode == "whole" else
             f"slide {'x'.join(map(str, cfg.crop_size))}/{'x'.join(map(str, cfg.stride))}"]
    if cfg.flip:
        parts.append("flip")
    if list(cfg.scales) != [1.0]:
        parts.append("scales " + "/".join(f"{s:g}" for s in cfg.scales))
    if cfg.logit_adjustment:
        parts.append(f"logit adjustment {cfg.logit_adjustment:g}")
    return ", ".join(parts)


def as_dict(cfg) -> dict:
    """The modes of `cfg` as plain JSON values (for eval records and the SavedModel's metadata)."""
    return {"mode": cfg.mode, "flip": cfg.flip, "scales": list(cfg.scales),
            "crop_size": list(cfg.crop_size) if cfg.mode == "slide" else None,
            "stride": list(cfg.stride) if cfg.mode == "slide" else None,
            "logit_adjustment": cfg.logit_adjustment}


def score_offsets(cfg, class_weights):
    """float32 [C] subtracted from each view's logits (eval.logit_adjustment; module doc), or None.

    tau * log(w_c) for the loss's class weights w_c; 0 for a class of weight 0. None when tau is 0.
    """
    tau = float(cfg.logit_adjustment)
    if not tau:
        return None
    if class_weights is None:
        raise ValueError("eval.logit_adjustment needs the loss's class weights")
    # As the loss holds them (float32), so training's evaluation and seg-eval's offsets are the same bits.
    w = np.asarray(class_weights, np.float32).astype(np.float64)
    return np.where(w > 0, tau * np.log(np.where(w > 0, w, 1.0)), 0.0).astype(np.float32)


def offsets_by_class(offsets, names):
    """`score_offsets`' output as {class name: offset} for the exports' JSON metadata, or None."""
    return None if offsets is None else dict(zip(names, map(float, offsets)))


def _forward(model_fn, x, pad_to: int):
    """Logits float32 [1, h, w, C] of x [1, h, w, 3]: padded to a multiple of pad_to, one pass, cropped."""
    h, w = tf.shape(x)[1], tf.shape(x)[2]
    padded = tf.pad(x, [[0, 0], [0, (-h) % pad_to], [0, (-w) % pad_to], [0, 0]])
    return tf.cast(model_fn(padded)[:, :h, :w], tf.float32)


def _window_starts(size, crop: int, stride: int):
    """Start of each window along one axis: every `stride`, the last one moved back to end at the border."""
    n = tf.maximum(size - crop + stride - 1, 0) // stride + 1
    return tf.maximum(tf.minimum(tf.range(n) * stride + crop, size) - crop, 0)


def _coverage(size, starts, crop: int):
    """float32 [size]: how many windows along this axis contain each position."""
    pos = tf.range(size)[:, None]
    return tf.reduce_sum(tf.cast((pos >= starts[None]) & (pos < starts[None] + crop), tf.float32), axis=1)


def _slide(model_fn, x, crop, stride, num_classes: int, pad_to: int):
    """Logits float32 [1, h, w, C] of x [1, h, w, 3], averaged over overlapping windows."""
    h, w = tf.shape(x)[1], tf.shape(x)[2]
    (ch, cw), (sh, sw) = crop, stride
    ys, xs = _window_starts(h, ch, sh), _window_starts(w, cw, sw)
    cols = tf.size(xs)

    def body(i, total):
        y1, x1 = ys[i // cols], xs[i % cols]
        y2, x2 = tf.minimum(y1 + ch, h), tf.minimum(x1 + cw, w)
        logits = _forward(model_fn, x[:, y1:y2, x1:x2], pad_to)
        # In place where TensorFlow can reuse the sum's buffer. Not a scatter-add: under op
        # determinism TensorFlow runs scatter ops on the CPU.
        begin, end = tf.stack([0, y1, x1, 0]), tf.stack([1, y2, x2, num_classes])
        total = tf.raw_ops.TensorStridedSliceUpdate(input=total, begin=begin, end=end, strides=[1, 1, 1, 1],
                                                    value=total[:, y1:y2, x1:x2] + logits)
        return i + 1, total

    total = tf.zeros([1, h, w, num_classes], tf.float32)
    # parallel_iterations=1: one window's activations at a time.
    _, total = tf.while_loop(lambda i, _: i < tf.size(ys) * cols, body, (tf.constant(0), total),
                             parallel_iterations=1)
    # Windows form a grid, so a pixel's window count is (windows over its row) x (over its column).
    count = _coverage(h, ys, ch)[:, None] * _coverage(w, xs, cw)[None, :]
    return total / count[None, :, :, None]


def _view_logits(model_fn, x, cfg, scale: float, num_classes: int, pad_to: int):
    """Logits float32 [1, h, w, C] of one view of x at `scale`, at x's size."""
    h, w = tf.shape(x)[1], tf.shape(x)[2]
    if scale != 1.0:
        size = tf.maximum(tf.cast(tf.round(tf.cast(tf.stack([h, w]), tf.float32) * scale), tf.int32), 1)
        x = tf.image.resize(x, size, method="bilinear")
    if cfg.mode == "slide":
        logits = _slide(model_fn, x, cfg.crop_size, cfg.stride, num_classes, pad_to)
    else:
        logits = _forward(model_fn, x, pad_to)
    if scale != 1.0:
        logits = tf.image.resize(logits, tf.stack([h, w]), method="bilinear")
    return logits


def class_scores(model_fn, image, cfg, num_classes: int, pad_to: int = PAD_TO, offsets=None):
    """Per-pixel scores float32 [1, h, w, C] of `image` whose argmax is the predicted class.

    Args:
      model_fn: logits of a batch: [1, H, W, 3] -> [1, H, W, C] (H, W multiples of pad_to).
      image: float32 [1, h, w, 3], normalised, not padded; any size (also unknown in a trace).
      offsets: float32 [C] from `score_offsets`, or None.
    """
    if bool(cfg.logit_adjustment) != (offsets is not None):
        raise ValueError("eval.logit_adjustment and the offsets passed disagree (modes.score_offsets)")
    if is_single_view(cfg):
        logits = _view_logits(model_fn, image, cfg, cfg.scales[0], num_classes, pad_to)
        return logits if offsets is None else logits - tf.constant(offsets, tf.float32)
    # Not inlined, so the graph holds the network once instead of once per view.
    model_fn = tf.function(model_fn, input_signature=[tf.TensorSpec([1, None, None, 3], tf.float32)], autograph=False,
                           experimental_attributes={"_noinline": True})
    total = None
    for scale in cfg.scales:
        probs = tf.nn.softmax(_view_logits(model_fn, image, cfg, scale, num_classes, pad_to), axis=-1)
        if cfg.flip:
            flipped = _view_logits(model_fn, tf.reverse(image, [2]), cfg, scale, num_classes, pad_to)
            probs = probs + tf.reverse(tf.nn.softmax(flipped, axis=-1), [2])
        total = probs if total is None else total + probs
    mean = total / float(len(cfg.scales) * (2 if cfg.flip else 1))
    if offsets is None:
        return mean
    # In the log domain: exp(-offsets) can overflow float32.
    return tf.nn.softmax(tf.math.log(mean) - tf.constant(offsets, tf.float32), axis=-1)


def probabilities(scores, cfg):
    """Per-pixel class probabilities from `class_scores`' output (softmax of a single view's logits)."""
    return tf.nn.softmax(scores, axis=-1) if is_single_view(cfg) else scores
