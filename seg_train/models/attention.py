"""Multi-head softmax attention, softmax(q k^T / sqrt(d) + bias) v, in two forms with the same arithmetic:

- "plain": the logits and softmax as whole [b, heads, Tq, Tk] tensors. TensorFlow's autodiff keeps the
  softmax for the backward pass (and, under mixed precision, the half-precision copy multiplied with v):
  Tq x Tk values per head and block stored between the forward and the backward pass (measured: about two such
  float32 maps per block, docs/PERFORMANCE.md).
- "blockwise": FlashAttention's algorithm (Dao et al. 2022; Dao 2023) in TensorFlow ops. A tf.while_loop over
  blocks of `block` keys keeps a running row maximum m, row sum l and unnormalised output acc, rescaled by
  exp(m_old - m_new) whenever the maximum grows; the output is acc / l at the end. A tf.custom_gradient keeps
  only q, k, v, the bias, the output and each row's m and 1 / l, and its backward pass loops over the key
  blocks again, recomputing each block's probabilities exp(s - m) / l from them. Nothing of size Tq x Tk per
  head is stored; the largest transient is one block's [b, heads, Tq, block] logits. (FlashAttention keeps the
  log-sum-exp m + log(l) instead: in float32 next to a masked row's m of about -1e9 the log(l) rounds away.)

Why by hand: TensorFlow has no fused attention op on the CPU, and Keras 3's keras.ops.dot_product_attention
refuses flash_attention=True on the TensorFlow backend (without it, it is the plain form). The loop is a
tf.while_loop over a dynamic number of blocks (any Tq, Tk, also unknown in a trace) with fixed-size blocks (the
keys padded to whole blocks, padded keys at -inf), so that XLA compiles it too.

Precision: q and k come in float32 (the callers cast and rotate them in float32); logits, softmax statistics and
the accumulator are float32. v may be float16 / bfloat16: as in the plain form, the probabilities are cast to
v's dtype before they meet v (the plain form casts the normalised softmax, this form each block's exp(s - m)),
and the output has v's dtype.

Masks: `bias` float32 [b, Tq, Tk] is added to every head's logits (differentiable). `blocked` bool [b, R, C] is
the compact form of a constant mask: MASKED is added where it is True, in the first R query rows and the last C
key columns (EoMT's queries before CLS, registers and patches: R = queries, C = patches; models/eomt/eomt.py). The
plain form expands it to the [b, Tq, Tk] bias; the blockwise form adds it block by block (no gradient). A row
whose every key is masked gets what the plain softmax gives for logits + MASKED (MASKED is added, not
substituted, in both forms).

Used by the DINO ViTs and EoMT (models/dino/vit.py's Attention, `model.attention`, DEFAULT) and available to MiT's
attention (models/mit/encoder.py; plain there: its keys come from a spatially reduced map, few enough that the blockwise
form saved no memory). TFLite: the converter turns the loop into WHILE ops and its int8 calibration crashed on
them, so seg-export --format tflite traces the plain form (`plain_only`, infer/tflite_export.py's app
function); a SavedModel keeps the configured form.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

METHODS = ("plain", "blockwise")
# The DINO ViTs' and EoMT's form (model.attention's default): docs/PERFORMANCE.md, "Attention", measured it.
DEFAULT = "blockwise"
# The additive logit of a masked pair (EoMT's reference's): exp underflows to 0 in float32.
MASKED = -1e9
# Keys per block of the blockwise form (measured there too).
BLOCK = 256

_SCOPE = threading.local()


@contextlib.contextmanager
def plain_only():
    """Inside it (while a function is traced), `attention` computes the plain form whatever its method: for a
    file format without a good loop (TFLite, infer/tflite_export.py). This thread only."""
    before = getattr(_SCOPE, "plain", False)
    _SCOPE.plain = True
    try:
        yield
    finally:
        _SCOPE.plain = before


def dense_bias(blocked, tq, tk):
    """float32 [b, Tq, Tk]: MASKED where `blocked` (bool [b, R, C]) is True in the first R rows and last C
    columns, 0 elsewhere."""
    r, c = tf.shape(blocked)[1], tf.shape(blocked)[2]
    bias = tf.where(blocked, tf.constant(MASKED, tf.float32), tf.constant(0.0, tf.float32))
    return tf.pad(bias, [[0, 0], [0, tq - r], [tk - c, 0]])


def plain_attention(q, k, v, bias=None):
    """softmax(q k^T / sqrt(d) + bias) v with whole logits. q, k float32 [b, h, Tq | Tk, d]; v [b, h, Tk, d];
    bias float32 [b, Tq, Tk] or None. Returns [b, h, Tq, d] in v's dtype."""
    logits = tf.matmul(q, k, transpose_b=True) * (q.shape[-1] ** -0.5)
    if bias is not None:
        logits = logits + bias[:, None]
    weights = tf.nn.softmax(logits, axis=-1)
    return tf.matmul(tf.cast(weights, v.dtype), v)


def attention(q, k, v, method: str = "plain", bias=None, blocked=None, block: int = BLOCK):
    """softmax(q k^T / sqrt(d) + bias) v per head in the form `method` (module doc).

    q, k: float32 [b, h, Tq, d], [b, h, Tk, d]; v: [b, h, Tk, d], any float dtype (the output's).
    bias: float32 [b, Tq, Tk] (differentiable); blocked: bool [b, R, C] (module doc); at most one of them.
    Returns [b, h, Tq, d] in v's dtype.
    """
    if method not in METHODS:
        raise ValueError(f"attention: method {method!r}: expected one of {', '.join(METHODS)}")
    if bias is not None and blocked is not None:
        raise ValueError("attention: bias and blocked given together: expected at most one of them")
    if q.dtype != tf.float32 or k.dtype != tf.float32:
        raise ValueError(f"attention: q {q.dtype.name}, k {k.dtype.name}: expected float32 (logits in float32)")
    if method == "plain" or getattr(_SCOPE, "plain", False):
        if blocked is not None:
            bias = dense_bias(blocked, tf.shape(q)[2], tf.shape(k)[2])
        return plain_attention(q, k, v, bias)
    if blocked is not None:
        # Constant: built outside the custom gradient, which then returns no gradient for it.
        rows = tf.where(blocked, tf.constant(MASKED, tf.float32), tf.constant(0.0, tf.float32))
        return _blockwise(block, bias_grad=False)(q, k, v, tf.stop_gradient(rows))
    if bias is not None:
        return _blockwise(block, bias_grad=True)(q, k, v, tf.cast(bias, tf.float32))
    return _blockwise(block, bias_grad=False, with_bias=False)(q, k, v)


class _Blocks:
    """The key blocks of one call: n blocks of `width` keys each, width = ceil(Tk / n) for n = ceil(Tk / block)
    (fewer than n padded keys in all), k, v and the bias put block-major, so that block j is one slice of a fixed
    shape (XLA wants fixed shapes inside the loop). Padded keys get -inf logits (exp gives exactly 0), in the last
    block only; none when Tk is known to fill the blocks."""

    def __init__(self, q, k, v, rows, block: int):
        self.qs = q * (q.shape[-1] ** -0.5)  # scaled once here, not each block's logits
        shape = tf.shape(k)
        b, h, d = shape[0], shape[1], k.shape[-1]
        self.tq, self.tk = tf.shape(q)[2], shape[2]
        static = k.shape[2]
        if static is not None:  # Python numbers: static shapes in the loop
            self.n = -(-static // block)
            self.width = -(-static // self.n)
            pad = self.n * self.width - static
        else:
            self.n = (self.tk + block - 1) // block
            self.width = (self.tk + self.n - 1) // self.n
            pad = self.n * self.width - self.tk

        def blocks(t):  # [b, h, Tk, d] -> [n, b, h, width, d]
            t = tf.pad(t, [[0, 0], [0, 0], [0, pad], [0, 0]])
            return tf.transpose(tf.reshape(t, [b, h, self.n, self.width, d]), [2, 0, 1, 3, 4])

        self.k, self.v = blocks(k), blocks(v)
        self.last_pad = None if static is not None and pad == 0 else \
            tf.where(tf.range(self.width) < self.width - pad, 0.0, float("-inf"))
        self.rows = None
        if rows is not None:  # [b, R, C] -> [n, b, R, width]: the C last real columns, zeros in front and behind
            self.r, c = tf.shape(rows)[1], tf.shape(rows)[2]
            full = tf.pad(rows, [[0, 0], [0, 0], [self.tk - c, pad]])
            self.rows = tf.transpose(tf.reshape(full, [b, self.r, self.n, self.width]), [2, 0, 1, 3])

    def logits(self, j, last: bool):
        """Block j's float32 logits [b, h, Tq, width], the bias added, and the key padding when `last`."""
        s = tf.matmul(self.qs, self.k[j], transpose_b=True)
        if self.rows is not None:
            # The compact rows padded with exact zeros to all Tq rows: the same sums as the dense bias.
            s = s + tf.pad(self.rows[j], [[0, 0], [0, self.tq - self.r], [0, 0]])[:, None]
        if last and self.last_pad is not None:
            s = s + self.last_pad
        return s

    def loop(self, body, state):
        """body(j, last, *state) -> state for j = 0 .. n - 1: a tf.while_loop over all blocks but the last, the
        last one after it (it alone holds padded keys)."""
        _, *state = tf.while_loop(lambda j, *_: j < self.n - 1, lambda j, *s: (j + 1, *body(j, False, *s)),
                                  (tf.constant(0), *state), parallel_iterations=1)
        return body(self.n - 1, True, *state)

    def unblock(self, stacked):
        """[n, b, X, width, ...] -> [b, X, Tk, ...] (the keys' gradients, or the bias' columns)."""
        t = tf.transpose(stacked, [1, 2, 0] + list(range(3, stacked.shape.rank)))
        shape = tf.shape(t)
        t = tf.reshape(t, tf.concat([shape[:2], [self.n * self.width], shape[4:]], axis=0))
        return t[:, :, :self.tk]


def _blockwise(block: int, bias_grad: bool, with_bias: bool = True):
    """The blockwise form as a tf.custom_gradient function of (q, k, v[, rows]) (module doc). `rows`: float32
    [b, R, C] added to the first R rows' last C columns (R = Tq, C = Tk: a dense bias); its gradient is
    computed when `bias_grad`, else None."""

    def forward(q, k, v, rows):
        blocks = _Blocks(q, k, v, rows, block)
        shape = tf.shape(q)

        def body(j, last, top, total, acc):  # running row maximum, sum of exp(s - top), sum of exp(s - top) v
            s = blocks.logits(j, last)
            new_top = tf.maximum(top, tf.reduce_max(s, axis=-1))
            alpha = tf.exp(top - new_top)  # rescales what was summed under the old maximum (0 at the start)
            p = tf.exp(s - new_top[..., None])
            pv = tf.matmul(tf.cast(p, v.dtype), blocks.v[j])
            return new_top, total * alpha + tf.reduce_sum(p, axis=-1), acc * alpha[..., None] + tf.cast(pv, tf.float32)

        top, total, acc = blocks.loop(body, (tf.fill(shape[:3], float("-inf")), tf.zeros(shape[:3]), tf.zeros(shape)))
        # The statistics stay apart: top + log(total) would round log(total) away next to a masked row's -1e9.
        return acc / total[..., None], (top[..., None], 1.0 / total[..., None])

    def backward(q, k, v, rows, out, stats, dout):
        blocks = _Blocks(q, k, v, rows, block)
        do = tf.cast(dout, v.dtype)
        delta = tf.reduce_sum(tf.cast(dout, tf.float32) * out, axis=-1)[..., None]  # rowsum(dP * P) = rowsum(dO * O)
        arrays = [tf.TensorArray(tf.float32, size=blocks.n), tf.TensorArray(v.dtype, size=blocks.n)]
        if rows is not None and bias_grad:
            arrays.append(tf.TensorArray(tf.float32, size=blocks.n))

        def body(j, last, dq, arrays):
            p = tf.exp(blocks.logits(j, last) - stats[0]) * stats[1]  # the block's probabilities, recomputed
            dv = tf.matmul(tf.cast(p, v.dtype), do, transpose_a=True)
            dp = tf.cast(tf.matmul(do, blocks.v[j], transpose_b=True), tf.float32)
            ds = p * (dp - delta)  # d logits
            dq = dq + tf.matmul(ds, blocks.k[j])
            written = [arrays[0].write(j, tf.matmul(ds, blocks.qs, transpose_a=True)), arrays[1].write(j, dv)]
            if len(arrays) > 2:  # the bias is shared by the heads: their gradients summed
                written.append(arrays[2].write(j, tf.reduce_sum(ds, axis=1)[:, :blocks.r]))
            return dq, written

        dq, arrays = blocks.loop(body, (tf.zeros_like(q), arrays))
        dq = dq * (q.shape[-1] ** -0.5)
        dk, dv = blocks.unblock(arrays[0].stack()), blocks.unblock(arrays[1].stack())
        drows = None
        if len(arrays) > 2:  # [n, b, R, width] -> [b, R, Tk] -> the last C columns
            drows = blocks.unblock(arrays[2].stack())[:, :, blocks.tk - tf.shape(rows)[2]:]
        return dq, dk, dv, drows

    if with_bias:
        @tf.custom_gradient
        def run(q, k, v, rows):
            out, stats = forward(q, k, v, rows)

            def grad(dout):
                return backward(q, k, v, rows, out, stats, dout)

            return tf.cast(out, v.dtype), grad
    else:
        @tf.custom_gradient
        def run(q, k, v):
            out, stats = forward(q, k, v, None)

            def grad(dout):
                return backward(q, k, v, None, out, stats, dout)[:3]

            return tf.cast(out, v.dtype), grad
    return run
