"""Decoding image and label files: TensorFlow's decoders in the graph, Pillow for what they get wrong.

TensorFlow's ops run off the GIL on tf.data's threads; each file's header picks the decoder:

- images: JPEG -> `tf.io.decode_jpeg` with the accurate integer IDCT, Pillow's, so the pixels match
  the Pillow paths (data.cache, the scan, seg-predict) to the bit; 8-bit non-palette PNG ->
  `tf.io.decode_png`; anything else -> Pillow.
- labels: 8-bit single-channel PNG -> `tf.io.decode_png`; everything else -> Pillow's `read_label`.
  decode_png would turn a palette into colours (or luminance), silently wrong classes, and a
  greyscale JPEG label's damaged values mostly stay in the class range, so never decode_jpeg a label.

A PNG's kind is in its first 26 bytes: bit depth at byte 24, colour type at byte 25 (0 grey, 2 RGB,
3 palette, 4 grey-alpha, 6 RGBA).
"""

from __future__ import annotations

import io

import numpy as np
import tensorflow as tf
from PIL import Image

from seg_train.data.label_images import JPEG_START as _JPEG_START
from seg_train.data.label_images import read_label

_HEAD = 26
_PNG_START = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dIHDR"  # signature, then IHDR's length and type
_GREY, _RGB, _PALETTE, _GREY_ALPHA, _RGBA = 0, 2, 3, 4, 6


def _as_bytes(data) -> bytes:
    """tf.numpy_function hands a scalar string over as a 0-d object array or a numpy bytes scalar."""
    return data.item() if isinstance(data, np.ndarray) else bytes(data)


def pillow_rgb(data) -> np.ndarray:
    """uint8 [H, W, 3] RGB from an encoded image, as Pillow decodes it (`convert("RGB")`)."""
    with Image.open(io.BytesIO(_as_bytes(data))) as im:
        return np.asarray(im.convert("RGB"))


def pillow_label(data, name: str = "label") -> np.ndarray:
    """uint8 [H, W] class indices from an encoded label image (label_images.read_label's rules)."""
    return read_label(io.BytesIO(_as_bytes(data)), name=name)


def _header(contents):
    """(is a JPEG, is a PNG, PNG bit depth, PNG colour type) from the first bytes of a file."""
    head = tf.strings.substr(contents, 0, _HEAD)
    # Padded so that a file shorter than the header is simply neither kind.
    head = tf.io.decode_raw(tf.strings.substr(tf.strings.join([head, b"\x00" * _HEAD]), 0, _HEAD), tf.uint8)
    is_jpeg = tf.reduce_all(tf.equal(head[:len(_JPEG_START)], tf.constant(list(_JPEG_START), tf.uint8)))
    is_png = tf.reduce_all(tf.equal(head[:len(_PNG_START)], tf.constant(list(_PNG_START), tf.uint8)))
    return is_jpeg, is_png, head[24], head[25]


def _with_pillow(fn, contents, shape):
    out = tf.numpy_function(fn, [contents], tf.uint8, stateful=False)
    out.set_shape(shape)
    return out


def decode_image(contents):
    """Encoded image bytes (scalar string tensor) -> uint8 [H, W, 3], the pixels Pillow gives."""
    is_jpeg, is_png, depth, colour = _header(contents)
    tf_png = is_png & tf.equal(depth, 8) & tf.reduce_any(
        tf.equal(colour, tf.constant([_GREY, _RGB, _GREY_ALPHA, _RGBA], tf.uint8)))
    return tf.cond(
        is_jpeg,
        lambda: tf.io.decode_jpeg(contents, channels=3, dct_method="INTEGER_ACCURATE"),
        lambda: tf.cond(tf_png, lambda: tf.io.decode_png(contents, channels=3),
                        lambda: _with_pillow(pillow_rgb, contents, [None, None, 3])))


# Rows and columns decoded around a JPEG window beyond those it reads: libjpeg-turbo's cropped decode
# upsamples chroma at the window's edge column as if it were the image's edge, so decode one iMCU more.
JPEG_WINDOW_MARGIN = 16


def is_jpeg(contents):
    """Whether encoded bytes (scalar string tensor) are a JPEG, by their first bytes."""
    return _header(contents)[0]


def decode_jpeg_window(contents, box, size):
    """The pixels of a JPEG that `box` = [top, left, height, width] covers (and up to JPEG_WINDOW_MARGIN
    around it, within the image of `size` [height, width]): (uint8 [h, w, 3], the part's top-left pixel
    [y, x] in the image), equal to `decode_image`'s there, decoding only down to the box's last row.
    """
    start = tf.maximum(box[:2] - JPEG_WINDOW_MARGIN, 0)
    end = tf.minimum(box[:2] + box[2:] + JPEG_WINDOW_MARGIN, size)
    window = tf.concat([start, end - start], 0)
    return tf.image.decode_and_crop_jpeg(contents, window, channels=3, dct_method="INTEGER_ACCURATE"), start


def decode_label(contents):
    """Encoded label PNG bytes (scalar string tensor) -> uint8 [H, W] class indices as stored; fails
    (when run) on what `read_label` refuses."""
    _, is_png, depth, colour = _header(contents)
    grey8 = is_png & tf.equal(depth, 8) & tf.equal(colour, _GREY)
    return tf.cond(grey8, lambda: tf.io.decode_png(contents, channels=1)[..., 0],
                   lambda: _with_pillow(pillow_label, contents, [None, None]))
