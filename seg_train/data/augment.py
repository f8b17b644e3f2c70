"""The training augmentation of one sample: random scale, mirror and crop, and data.photometric's colour jitter.

Every draw comes from stateless RNG seeded by (seed, sample counter k), so a sample's augmentation is a
pure function of the run's seed and its place in the stream (data/order.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import tensorflow as tf

from seg_train.config import DataConfig
from seg_train.data import segments

PHOTOMETRIC_ORDER = ("brightness", "contrast", "saturation", "hue")


def photometric_draws(spec: dict, key) -> dict:
    """data.photometric's draws for one sample: {name: (applied with p 1/2, amount in [-v, v])}. Each
    step draws from its own split of `key`, so its draws do not depend on which other steps are on."""
    keys = tf.random.experimental.stateless_split(key, num=2 * len(PHOTOMETRIC_ORDER))
    draws = {}
    for i, name in enumerate(PHOTOMETRIC_ORDER):
        if name in spec:
            draws[name] = (tf.random.stateless_uniform([], keys[2 * i]) < 0.5,
                           spec[name] * tf.random.stateless_uniform([], keys[2 * i + 1], -1.0, 1.0))
    return draws


def apply_photometric(image, draws: dict):
    """The colour jitter of a float32 RGB image in 0..255 for `draws`, in PHOTOMETRIC_ORDER, clipped to
    [0, 255] after each step; hue is on OpenCV's 0..180 scale."""
    for name in PHOTOMETRIC_ORDER:
        if name not in draws:
            continue
        applied, amount = draws[name]
        if name == "brightness":
            out = image + amount
        elif name == "contrast":
            out = image * (1.0 + amount)
        elif name == "saturation":
            out = tf.image.adjust_saturation(image / 255.0, 1.0 + amount) * 255.0
        else:
            out = tf.image.adjust_hue(image / 255.0, amount / 180.0) * 255.0
        image = tf.where(applied, tf.clip_by_value(out, 0.0, 255.0), image)
    return image


class Taps(NamedTuple):
    """Along one axis, for each output pixel: the two source pixels ResizeBilinear reads and its weight."""
    lower: tf.Tensor
    upper: tf.Tensor
    lerp: tf.Tensor


def bilinear_axis(out_index, in_size, out_size) -> Taps:
    """Along one axis, ResizeBilinear's taps (half-pixel centres) for output pixels `out_index` of a resize
    from `in_size` to `out_size`, in the CPU kernel's float32 arithmetic, so they match it to the bit."""
    scale = tf.cast(in_size, tf.float32) / tf.cast(out_size, tf.float32)
    p = (tf.cast(out_index, tf.float32) + 0.5) * scale - 0.5
    floor = tf.floor(p)
    lower = tf.maximum(tf.cast(floor, tf.int32), 0)
    upper = tf.minimum(tf.cast(tf.math.ceil(p), tf.int32), in_size - 1)
    return Taps(lower, upper, p - floor)


def nearest_axis(out_index, in_size, out_size):
    """Along one axis, the source pixel ResizeNearestNeighbor (half-pixel centres) reads for output pixels
    `out_index`: min(floor((i + 0.5) * in / out), in - 1), in float32 (resize_nearest_neighbor_op.cc)."""
    scale = tf.cast(in_size, tf.float32) / tf.cast(out_size, tf.float32)
    index = tf.cast(tf.floor((tf.cast(out_index, tf.float32) + 0.5) * scale), tf.int32)
    return tf.maximum(tf.minimum(index, in_size - 1), 0)


@dataclasses.dataclass(frozen=True)
class CropPlan:
    """One sample's crop window, from its draws (`crop_plan`); int32 scalar tensors unless noted.

    (y, x): the window in the scaled, mirrored, padded frame; rows, cols: its part inside the h x w
    scaled image; x0: its first column in the unmirrored scaled image.
    """
    k: tf.Tensor  # the sample counter (int64), which photometric draws also key on
    flip: tf.Tensor  # bool: mirrored
    y: tf.Tensor
    x: tf.Tensor
    x0: tf.Tensor
    rows: tf.Tensor
    cols: tf.Tensor
    h: tf.Tensor
    w: tf.Tensor
    resize: bool  # data.random_scale scales at all (Python: fixed by the config)
    ny: tf.Tensor  # [rows] the source rows ResizeNearestNeighbor reads (the label's), or the rows themselves
    nx: tf.Tensor  # [cols] the same for the columns, right to left when mirrored
    box: tf.Tensor  # [4] the source rows and columns read, resampling margins included: top, left, height, width
    by: Taps | None = None  # ResizeBilinear's rows (resize only)
    bx: Taps | None = None  # and columns
    whole: tf.Tensor | None = None  # bool: `crop` resizes the whole image rather than the window (resize only)


def crop_plan(cfg: DataConfig, seed: int, hw, k) -> CropPlan:
    """The crop window of sample k of source size `hw`. Draws scale, mirror, y, x, each from its own
    split of the key; this order and arithmetic define the stream: changing them changes every run."""
    seeds = tf.random.experimental.stateless_split(
        tf.stack([tf.constant(seed + 1, tf.int64), k]), num=4)
    hw = tf.cast(hw, tf.int32)
    lo, hi = cfg.random_scale
    resize = hi > lo or lo != 1.0
    if resize:
        scale = tf.random.stateless_uniform([], seeds[0], lo, hi)
        new_hw = tf.maximum(tf.cast(tf.round(tf.cast(hw, tf.float32) * scale), tf.int32), 1)
    else:
        new_hw = hw
    flip = tf.random.stateless_uniform([], seeds[1]) < 0.5 if cfg.random_mirror else tf.constant(False)
    ch, cw = cfg.crop_size
    h, w = new_hw[0], new_hw[1]
    ph, pw = tf.maximum(ch - h, 0), tf.maximum(cw - w, 0)
    y = tf.random.stateless_uniform([], seeds[2], 0, h + ph - ch + 1, dtype=tf.int32)
    x = tf.random.stateless_uniform([], seeds[3], 0, w + pw - cw + 1, dtype=tf.int32)
    rows, cols = tf.minimum(ch, h - y), tf.minimum(cw, w - x)
    # The window's rows and columns in the scaled image; mirrored, its column j is the scaled
    # image's column w - 1 - j: columns x0 .. x0 + cols - 1 read right to left.
    x0 = tf.where(flip, w - cols - x, x)
    ys = tf.range(y, y + rows)
    xs = tf.where(flip, tf.range(x0 + cols - 1, x0 - 1, -1), tf.range(x0, x0 + cols))
    window = dict(k=k, flip=flip, y=y, x=x, x0=x0, rows=rows, cols=cols, h=h, w=w, resize=resize)
    if not resize:
        return CropPlan(**window, ny=ys, nx=xs, box=tf.stack([y, x0, rows, cols]))
    by, bx = bilinear_axis(ys, hw[0], h), bilinear_axis(xs, hw[1], w)
    top, bottom = by.lower[0], by.upper[-1]
    left, right = tf.reduce_min(bx.lower), tf.reduce_max(bx.upper)
    # Two ways to the same values, costed in pixels of work: resize the whole image (h * w), or resample
    # only the window (about 1.5 per pixel of the source box it reads, plus one per window pixel).
    band = tf.cast(bottom - top + 1, tf.float32) * tf.cast(right - left + 1, tf.float32)
    cost = tf.stack([tf.cast(h * w, tf.float32), 1.5 * band + tf.cast(rows * cols, tf.float32)])
    whole = tf.argmin(cost) == 0
    box = tf.where(whole, tf.stack([0, 0, hw[0], hw[1]]), tf.stack([top, left, bottom - top + 1, right - left + 1]))
    return CropPlan(**window, ny=nearest_axis(ys, hw[0], h), nx=nearest_axis(xs, hw[1], w), box=box, by=by, bx=bx,
                    whole=whole)


def crop(cfg: DataConfig, seed: int, image, label, plan: CropPlan, origin):
    """The crop `plan` describes, from uint8 `image` [H', W', 3] and `label` [H'', W''] whose top-left
    pixels are the source image's pixel `origin` (the whole image at [0, 0], or a part of it holding
    at least plan.box of the image; the label is always whole). Normalised image, uint8 label (int32 segment
    labels for data.task panoptic and instance).

    Element-wise steps work on [rows, cols * 3] views: TensorFlow broadcasts row/column vectors much
    faster than a [3]-vector over [h, w, 3].
    """
    ch, cw = cfg.crop_size
    top, left, bh, bw = tf.unstack(plan.box)
    rows, cols, x0 = plan.rows, plan.cols, plan.x0
    image = image[top - origin[0]:top - origin[0] + bh, left - origin[1]:left - origin[1] + bw]
    label = label[top:top + bh, left:left + bw]

    def mirrored(part):
        return tf.cond(plan.flip, lambda: tf.reverse(part, [1]), lambda: part)

    if plan.resize:
        (y0, y1, wy), (x0s, x1s, wx) = plan.by, plan.bx
        y, h, w = plan.y, plan.h, plan.w

        def whole():
            # The whole scaled image, then the window.
            scaled = tf.image.resize(image, [h, w], method="bilinear")
            return tf.reshape(mirrored(scaled[y:y + rows, x0:x0 + cols]), [rows, -1])

        def window():
            # ResizeBilinear's arithmetic in its order (along x, then y). x runs on the transposed
            # source because gathering whole rows is much faster than single pixels.
            source = tf.reshape(tf.transpose(tf.cast(image, tf.float32), [1, 0, 2]), [bw, -1])
            a, b = tf.gather(source, x0s - left), tf.gather(source, x1s - left)
            along_x = a + (b - a) * wx[:, None]
            along_x = tf.reshape(tf.transpose(tf.reshape(along_x, [cols, bh, 3]), [1, 0, 2]), [bh, -1])
            upper, lower = tf.gather(along_x, y0 - top), tf.gather(along_x, y1 - top)
            return upper + (lower - upper) * wy[:, None]

        image = tf.cond(plan.whole, whole, window)
        # The label's rows, then its columns as the rows of the transpose (as above).
        label = tf.gather(label, plan.ny - top)
        label = tf.transpose(tf.gather(tf.transpose(label), plan.nx - left))
    else:
        image = tf.reshape(tf.cast(mirrored(image), tf.float32), [bh, -1])
        label = mirrored(label)
    # Pad to the crop size: image with the mean colour (zero after normalisation), label with
    # ignore_label, so padding is never learned from; (x - mean) + mean keeps the values bit-exact.
    mean = tf.constant(cfg.mean, tf.float32)
    image = tf.pad(image - tf.tile(mean, [cols])[None], [[0, ch - rows], [0, 3 * (cw - cols)]])
    image = image + tf.tile(mean, [cw])[None]
    # Segment labels (data.task panoptic, instance: int32) pad with their ignore value and keep their dtype.
    segment_labels = cfg.task != "semantic"
    pad = segments.ignore_value(cfg.ignore_label) if segment_labels else cfg.ignore_label
    label = tf.pad(label, [[0, ch - rows], [0, cw - cols]], constant_values=tf.cast(pad, label.dtype))
    if cfg.photometric:
        image = tf.reshape(image, [ch, cw, 3])
        # Its own key, folded off this sample's, so the crop draws do not depend on the jitter.
        key = tf.random.experimental.stateless_fold_in(
            tf.stack([tf.constant(seed + 1, tf.int64), plan.k]), 1)
        jittered = apply_photometric(image, photometric_draws(cfg.photometric, key))
        # The padding keeps the mean colour (zero after normalisation), as without the jitter.
        inside = (tf.range(ch)[:, None] < rows) & (tf.range(cw)[None, :] < cols)
        image = tf.reshape(tf.where(inside[..., None], jittered, image), [ch, -1])
    image = (image - tf.tile(mean, [cw])[None]) / tf.tile(tf.constant(cfg.std, tf.float32), [cw])[None]
    image = tf.reshape(image, [ch, cw, 3])
    label.set_shape([ch, cw])
    return image, tf.cast(label, tf.int32 if segment_labels else tf.uint8)


def augment(cfg: DataConfig, seed: int, image, label, k):
    """Random scale, mirror and crop of one sample, drawn from stateless RNG seeded by (seed, k).

    The definition: scale by s ~ U(data.random_scale) (bilinear; the label nearest), mirror with p 1/2,
    pad bottom/right to data.crop_size, cut a window at a uniform position. Only the window is computed,
    equal bit for bit to the crop of the whole scaled image (tests/test_crop_window.py).
    """
    plan = crop_plan(cfg, seed, tf.shape(image)[:2], k)
    return crop(cfg, seed, image, label, plan, tf.zeros([2], tf.int32))
