"""FLOPs of the train step counted from its graph (FLOPS_METHOD), and the device peak (PEAK_METHOD).

Element-wise ops, BN, resizes and the optimizer update are memory-bound, so only conv and matmul ops count.
Achieved FLOP/s = FLOPs per step / median step time; `flops_utilization` = achieved / peak.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np

from seg_train.config import Config

log = logging.getLogger("seg_train")

FLOPS_METHOD = ("graph count: 2 * multiply-adds of every Conv2D/DepthwiseConv2dNative/MatMul op and their "
                "backprop-input/-filter ops in one tower's traced forward+backward pass (static shapes, "
                "global batch); element-wise ops, BN, resizes and the optimizer update not counted")
PEAK_METHOD = ("max of a 2048x2048x2048 matmul and a 3x3 conv 4x56x56x256->256 (SAME), timed in this run on "
               "the first device in the precision's compute dtype (median of 7 runs after 2 warm-ups)")


def compute_dtype(precision: str) -> str:
    return {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}[precision]


# ---- peak -------------------------------------------------------------------------------------------
def measure_peak(dtype: str = "float32", device: str = "/device:CPU:0", reps: int = 7) -> dict:
    """GFLOP/s of a large matmul and of a 3x3 conv in `dtype` on `device` (median of `reps`)."""
    import tensorflow as tf

    def timed(fn, flops):
        fn()  # trace
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn().numpy()
            times.append(time.perf_counter() - t0)
        return flops / statistics.median(times) / 1e9

    n = 2048
    b, hw, c = 4, 56, 256
    with tf.device(device):
        a = tf.cast(tf.random.stateless_normal([n, n], seed=[1, 2]), dtype)
        m = tf.cast(tf.random.stateless_normal([n, n], seed=[3, 4]), dtype)
        x = tf.cast(tf.random.stateless_normal([b, hw, hw, c], seed=[5, 6]), dtype)
        k = tf.cast(tf.random.stateless_normal([3, 3, c, c], seed=[7, 8]) * 0.05, dtype)

        @tf.function
        def matmul():
            return tf.reduce_sum(tf.cast(tf.matmul(a, m)[:1, :1], tf.float32))

        @tf.function
        def conv():
            return tf.reduce_sum(tf.cast(tf.nn.conv2d(x, k, 1, "SAME")[:1, :1, :1, :1], tf.float32))

        mm = timed(matmul, 2.0 * n ** 3)
        cv = timed(conv, 2.0 * b * hw * hw * c * 9 * c)
    return {"dtype": dtype, "matmul_gflops": mm, "conv3x3_gflops": cv, "peak_gflops": max(mm, cv),
            "method": PEAK_METHOD}


# ---- FLOP count ---------------------------------------------------------------------------------------
def _dims(tensor):
    shape = tensor.shape
    if shape.rank is None or any(d is None for d in shape.as_list()):
        return None
    return shape.as_list()


def op_flops(op) -> tuple[int, bool]:
    """(FLOPs of one graph op, whether its shapes were known). 2 * multiply-adds for conv/matmul ops."""
    t = op.type
    if t in ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"):
        # The "output" side of the forward conv: Conv2D's output, the backprops' out_backprop input.
        out = _dims(op.outputs[0]) if t == "Conv2D" else _dims(op.inputs[2])
        filt = _dims(op.inputs[1]) if t != "Conv2DBackpropFilter" else _dims(op.outputs[0])
        if out is None or filt is None:
            return 0, False
        n, h, w, co = out
        kh, kw, ci, _ = filt
        return 2 * n * h * w * co * kh * kw * ci, True
    if t in ("DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"):
        out = _dims(op.outputs[0]) if t == "DepthwiseConv2dNative" else _dims(op.inputs[2])
        filt = _dims(op.inputs[1]) if t != "DepthwiseConv2dNativeBackpropFilter" else _dims(op.outputs[0])
        if out is None or filt is None:
            return 0, False
        n, h, w, c = out
        kh, kw = filt[0], filt[1]
        return 2 * n * h * w * c * kh * kw, True
    if t in ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "BatchMatMul"):
        out, a = _dims(op.outputs[0]), _dims(op.inputs[0])
        if out is None or a is None:
            return 0, False
        adj = op.get_attr("transpose_a") if t == "MatMul" else op.get_attr("adj_x")
        k = a[-2] if adj else a[-1]
        return 2 * int(np.prod(out)) * k, True
    return 0, True


def graph_flops(graph) -> dict:
    """Sums op_flops over a graph; counts ops whose shapes were unknown (they add 0)."""
    total, unknown, by_type = 0, 0, {}
    for op in graph.get_operations():
        f, known = op_flops(op)
        if not known:
            unknown += 1
        if f:
            total += f
            by_type[op.type] = by_type.get(op.type, 0) + f
    return {"flops": total, "unknown_ops": unknown, "by_type": by_type}


def count_train_flops(cfg: Config, batch: int) -> dict:
    """FLOPs of one training step on `batch` images, and of the forward pass.

    Traced on a float32 copy outside any strategy: the FLOPs depend on neither dtype nor tower count.
    """
    import keras
    import tensorflow as tf

    from seg_train import models
    from seg_train.models import param_groups
    from seg_train.objectives import pixel_losses as losses

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        model = models.build(cfg.model, cfg.data.num_classes, cfg.seed)
    finally:
        keras.config.set_dtype_policy(previous)
    h, w = cfg.data.crop_size
    image_spec = tf.TensorSpec([batch, h, w, 3], tf.float32)
    label_spec = tf.TensorSpec([batch, h, w], tf.uint8)

    @tf.function
    def forward(images):
        return model(images, training=True)

    @tf.function
    def forward_backward(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            ce, count = losses.pixel_cross_entropy_sum(logits, labels, cfg.data.ignore_label)
            loss = ce / tf.maximum(count, 1.0) + param_groups.weight_decay(param_groups.decay_variables(model),
                                                                     cfg.model.weight_decay)
        return tape.gradient(loss, model.trainable_variables)

    fwd = graph_flops(forward.get_concrete_function(image_spec).graph)
    train = graph_flops(forward_backward.get_concrete_function(image_spec, label_spec).graph)
    if train["unknown_ops"] or fwd["unknown_ops"]:
        log.warning("FLOP count: %d ops with unknown shapes were not counted", train["unknown_ops"])
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    return {"train_flops_per_step": train["flops"], "forward_flops_per_step": fwd["flops"],
            "train_gflop_per_image": train["flops"] / batch / 1e9,
            "forward_gflop_per_image": fwd["flops"] / batch / 1e9,
            "train_to_forward": train["flops"] / max(fwd["flops"], 1),
            "train_flops_by_op": {k: v / batch / 1e9 for k, v in sorted(train["by_type"].items())},
            "trainable_params": params, "method": FLOPS_METHOD}


def utilisation(row: dict, flops: dict, peak: dict | None) -> None:
    """Sets a timed row's achieved_gflops (from its step time) and flops_utilization (None without a peak)."""
    row["achieved_gflops"] = flops["train_flops_per_step"] / (row["step_time_ms"] / 1000.0) / 1e9
    row["flops_utilization"] = row["achieved_gflops"] / peak["peak_gflops"] if peak else None
