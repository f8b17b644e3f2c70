"""A dilated ('atrous') Conv2D that runs fast on CPUs and GPUs, with exactly the same result.

Written by hand because Keras' Conv2D calls `tf.nn.convolution`, which runs EVERY dilated
convolution as SpaceToBatchND + a dense conv + BatchToSpaceND. For ASPP on small feature maps that
pads the map to a multiple of the rate in each direction and convolves mostly zeros, about 10x the
time of one native dilated conv and 20x that of the 1x1 conv it really is (the ASPP branches were
the slowest ops of the whole step; measurements in docs/ACCURACY.md, "Where the step time goes"). Two
rewrites, both exact:

1. Taps that can only ever read the zero padding are dropped. With 'same' padding and stride 1, a
   3x3 kernel at rate r reads rows i-r, i, i+r for output row i; when r >= the map's height every
   i-r and i+r is outside the map, so the kernel's top and bottom rows multiply zeros (their
   gradient is zero too). The same holds for columns. ASPP's rates 12 and 18 on the 8x8 or 11x15
   maps of small crops reduce to 1x3, 3x1 or 1x1 convs this way. Needs static spatial sizes (a
   traced training step has them); with unknown sizes nothing is dropped.
2. What remains is one `tf.nn.conv2d(..., dilations=r)` when the kernels support it: oneDNN on x86
   CPUs (TensorFlow's default there) and cuDNN on GPUs do; TensorFlow's plain CPU kernels have no
   dilated filter gradient, so without oneDNN and GPUs the Keras path is kept.

The variables are the layer's usual 3x3 kernel (same name and shape), so checkpoints and weights
are interchangeable with a plain Conv2D.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from keras import layers


@functools.cache
def native_dilation_supported(dtype=tf.float32) -> bool:
    """Whether this process's conv kernels take `dilations` directly (forward and both gradients).

    float16 on a CPU never does: oneDNN's CPU kernels take no float16 here ("oneDNN supports
    DT_HALF only on platforms with AVX-512", seen on an AVX-512 machine), so TensorFlow falls back
    to its plain kernels, whose input gradient refuses dilations ("Current CPU implementations do
    not yet support dilation rates larger than 1"): train.precision mixed_float16 crashed at the
    first step on the demo. There the Keras path (SpaceToBatchND + a dense conv) is kept.
    """
    gpus = bool(tf.config.list_physical_devices("GPU"))
    if tf.as_dtype(dtype) == tf.float16:
        return gpus
    try:
        from tensorflow.python.util import _pywrap_util_port  # TF's own "is oneDNN on" switch
        if _pywrap_util_port.IsMklEnabled():
            return True
    except Exception:  # a TF build without it: decide by the devices alone
        pass
    return gpus


def live_taps(size: int | None, kernel: int, rate: int) -> slice:
    """The kernel positions along one axis that can read the map (the others only read padding)."""
    if size is not None and kernel == 3 and rate > 1 and rate >= size:
        return slice(1, 2)
    return slice(0, kernel)


@keras.saving.register_keras_serializable(package="seg_train")
class AtrousConv2D(layers.Conv2D):
    """keras.layers.Conv2D for stride 1, 'same' padding, channels-last; any dilation (see the module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if tuple(self.strides) != (1, 1) or self.padding != "same" or self.data_format != "channels_last":
            raise ValueError("AtrousConv2D supports strides 1, padding 'same' and channels_last only")

    def convolution_op(self, inputs, kernel):
        (kh, kw), (rh, rw) = self.kernel_size, self.dilation_rate
        if (rh, rw) == (1, 1):
            return super().convolution_op(inputs, kernel)
        rows, cols = live_taps(inputs.shape[1], kh, rh), live_taps(inputs.shape[2], kw, rw)
        kernel = kernel[rows, cols]
        rh = rh if rows.stop - rows.start > 1 else 1
        rw = rw if cols.stop - cols.start > 1 else 1
        if (rh, rw) == (1, 1) or native_dilation_supported(inputs.dtype):
            return tf.nn.conv2d(inputs, kernel, strides=1, padding="SAME", dilations=[1, rh, rw, 1])
        return keras.ops.conv(inputs, kernel, strides=1, padding="same", dilation_rate=(rh, rw))


def conv2d_class(dilation, fast: bool) -> type:
    """The Conv2D class for a stride-1 'same' conv at this dilation: AtrousConv2D where it matters.

    `fast=False` (`model.fast_atrous: false`) keeps keras.layers.Conv2D for dilated convs too.
    """
    rates = (dilation, dilation) if isinstance(dilation, int) else tuple(dilation)
    return AtrousConv2D if fast and rates != (1, 1) else layers.Conv2D
