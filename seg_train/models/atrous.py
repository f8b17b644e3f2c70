"""A dilated ('atrous') Conv2D that runs fast on CPUs and GPUs, with exactly the same result.

Keras' Conv2D runs every dilated conv as SpaceToBatchND + a dense conv + BatchToSpaceND, which for
ASPP on small maps convolves mostly padding (docs/ACCURACY.md). Two exact rewrites:

1. Taps that can only read the zero padding are dropped: at rate r >= the map's size, a 3x3
   kernel's outer rows/columns only multiply zeros. Needs static spatial sizes.
2. What remains is one `tf.nn.conv2d(..., dilations=r)` where the kernels support it (oneDNN,
   cuDNN); TensorFlow's plain CPU kernels have no dilated filter gradient, so there the Keras path stays.

Same variables as a plain Conv2D, so checkpoints are interchangeable.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from keras import layers


@functools.cache
def native_dilation_supported(dtype=tf.float32) -> bool:
    """Whether this process's conv kernels take `dilations` directly (forward and both gradients).

    float16 on a CPU never does: oneDNN may refuse float16, and TensorFlow's plain kernels' input
    gradient refuses dilations, so there the Keras path is kept.
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
