"""models/attention.py's two forms of softmax attention held to Keras' keras.ops.dot_product_attention computed in
float64 (its output, and TensorFlow's autodiff of it for the gradients with respect to q, k, v and a dense bias),
and to each other; then EoMT's compact mask, fully masked rows, mixed precision, unknown lengths in a trace, towers,
XLA and the memory the blockwise backward keeps; then the ViT / EoMT / MiT models with both forms.

Tolerance: float32 round-off, TOLERANCE of the largest reference value (seen: about 1e-6 at these sizes, for the
plain and the blockwise form alike); half precision: a few units of its last place.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models.attention import MASKED, attention
from tests.helpers import CPU_DEVICES, eomt_from_reference, strategy, tiny_config

TOLERANCE = 1e-5
B, H, D = 2, 3, 8
# (Tq, Tk, block): keys in several blocks with a partial last one, whole blocks, one block wider than Tk.
SHAPES = [(37, 45, 16), (32, 48, 16), (19, 23, 64)]


def _inputs(tq, tk, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(0, 1, (B, H, t, D)).astype("float32") for t in (tq, tk, tk))
    # Scaled logits: rows whose maximum grows from block to block (the running maximum's rescale matters).
    return q * scale, k, v, rng.normal(0, 1, (B, tq, H * D)).astype("float32")


def _keras(q, k, v, bias=None):
    """Keras' attention on our layout [b, h, T, d] (its own: [b, T, h, d])."""
    def t(x):
        return keras.ops.transpose(x, (0, 2, 1, 3))

    out = keras.ops.dot_product_attention(t(q), t(k), t(v), bias=None if bias is None else bias[:, None])
    return t(out)


def _run(fn, q, k, v, w, bias=None):
    """fn's output and the gradients of sum(output * w) with respect to q, k, v (and the bias)."""
    q, k, v, w = (tf.convert_to_tensor(a) for a in (q, k, v, w))
    watched = [q, k, v] + ([] if bias is None else [tf.convert_to_tensor(bias)])
    with tf.GradientTape() as tape:
        tape.watch(watched)
        out = fn(*watched)
        loss = tf.reduce_sum(tf.cast(out, w.dtype) * _as_heads(w))
    return [out] + tape.gradient(loss, watched)


def _as_heads(w):  # [b, T, h * d] -> [b, h, T, d]
    return tf.transpose(tf.reshape(w, [B, -1, H, D]), [0, 2, 1, 3])


def _reference(q, k, v, w, bias=None, dtype="float64"):
    """Keras' attention and TensorFlow's autodiff of it, in float64 (or `dtype`)."""
    cast = [None if a is None else a.astype(dtype) for a in (q, k, v, w, bias)]
    return [np.asarray(a) for a in _run(lambda *x: _keras(*x), *cast[:4], bias=cast[4])]


def _close(ours, ref, tol=TOLERANCE, what=""):
    ours, ref = np.asarray(tf.cast(ours, tf.float64)), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err < tol, (what, err)


@pytest.mark.parametrize("tq, tk, block", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("method", ["plain", "blockwise"])
def test_output_and_gradients_are_keras(method, with_bias, tq, tk, block):
    """Output and the gradients with respect to q, k, v and a dense bias [b, Tq, Tk] are Keras' in float64 (its
    dot_product_attention and TensorFlow's autodiff of it). Fails for: the running maximum's rescale of the sums
    left out or applied to the sum but not the output, the padded keys of a partial last block attended to, the
    scale 1/sqrt(d) missing in the recomputed logits or in dq / dk, the backward's probabilities recomputed
    without the bias or normalised by the last block's maximum instead of the log-sum-exp, the rowsum(dO * O)
    term left out, a block's dk / dv written to another block's place, the bias gradient not summed over heads."""
    q, k, v, w = _inputs(tq, tk, scale=3.0)
    bias = np.random.default_rng(1).normal(0, 2, (B, tq, tk)).astype("float32") if with_bias else None
    ref = _reference(q, k, v, w, bias)
    got = _run(lambda *x: attention(*x[:3], method, bias=x[3] if with_bias else None, block=block), q, k, v, w,
               bias)
    for name, a, r in zip(["out", "dq", "dk", "dv", "dbias"], got, ref):
        _close(a, r, what=name)


def _blocked(tq, tk, r, c, seed=2):
    """A compact mask bool [b, r, c] (one row of it fully blocked) and its dense bias [b, Tq, Tk], by hand."""
    rng = np.random.default_rng(seed)
    blocked = rng.random((B, r, c)) < 0.5
    blocked[:, 1] = True
    dense = np.zeros((B, tq, tk), np.float32)
    dense[:, :r, tk - c:] = np.where(blocked, np.float32(MASKED), np.float32(0.0))
    return blocked, dense


@pytest.mark.parametrize("method", ["plain", "blockwise"])
def test_compact_mask_is_the_dense_bias(method):
    """`blocked` [b, R, C] (EoMT's form: the first R query rows, the last C key columns) gives Keras' attention with
    the dense bias [b, Tq, Tk] built by hand (MASKED where blocked), output and gradients, including a row whose
    C columns are all blocked; no gradient for the mask. Fails for: the rows applied at the bottom or the columns
    at the left, the mask inverted, a block's slice of the mask taken at another block's columns."""
    tq, tk, r, c = 37, 45, 6, 30
    q, k, v, w = _inputs(tq, tk, seed=3, scale=2.0)
    blocked, dense = _blocked(tq, tk, r, c)
    ref = _reference(q, k, v, w, dense)
    got = _run(lambda *x: attention(*x, method, blocked=tf.constant(blocked), block=16), q, k, v, w)
    for name, a, ref_a in zip(["out", "dq", "dk", "dv"], got, ref):
        _close(a, ref_a, what=name)


@pytest.mark.parametrize("method", ["plain", "blockwise"])
def test_fully_masked_row_is_the_plain_softmaxs(method):
    """A row whose every key is masked (MASKED added to all its logits) gets what the plain softmax gives for it:
    in float32 logit + MASKED rounds to the same value for every key here (|logit| < 32, half of MASKED's unit
    in the last place), so the row is the mean of v: Keras' answer in float32 with the dense bias (in float64
    the sum is exact and the row would be the unmasked softmax's), with finite gradients. Fails for: masked
    logits replaced by -inf (0 / 0: NaN), the row zeroed, the running sum started from the masked maximum so
    that the row sums to 0."""
    tq, tk = 12, 40
    q, k, v, w = _inputs(tq, tk, seed=4)
    bias = np.zeros((B, tq, tk), np.float32)
    bias[:, 5] = MASKED
    ref = _reference(q, k, v, w, bias, dtype="float32")
    got = _run(lambda *x: attention(*x[:3], method, bias=x[3], block=16), q, k, v, w, bias)
    np.testing.assert_allclose(np.asarray(got[0])[:, :, 5], v.mean(axis=2), atol=1e-6)
    for name, a, r in zip(["out", "dq", "dk", "dv"], got, ref):
        assert np.all(np.isfinite(a)), name
        _close(a, r, what=name)


@pytest.mark.slow  # traced and its loop bodies read: a few seconds
@pytest.mark.parametrize("dtype, tol", [("float16", 4e-3), ("bfloat16", 3e-2)])
def test_half_precision_v_keeps_float32_statistics(dtype, tol):
    """v in float16 / bfloat16 (mixed precision): the output and dv in v's dtype, dq and dk in float32, every
    max, exp, sum and log of the blockwise form (its loops included) in float32, and the result within half
    precision's round-off of Keras' float64 answer, as the plain form is. Fails for: the softmax statistics or
    the accumulator kept in v's dtype, the output returned in float32."""
    tq, tk = 37, 45
    q, k, v, w = _inputs(tq, tk, seed=5, scale=2.0)
    v_half = tf.cast(v, dtype)
    ref = _reference(q, k, np.asarray(tf.cast(v_half, tf.float32)), w)
    for method in ("plain", "blockwise"):
        got = _run(lambda q, k, v: attention(q, k, v, method, block=16), q, k, v_half, w)
        assert got[0].dtype == got[3].dtype == dtype and got[1].dtype == got[2].dtype == tf.float32
        for name, a, r in zip(["out", "dq", "dk", "dv"], got, ref):
            _close(a, r, tol, what=(method, name))

    spec = [tf.TensorSpec([B, H, None, D]), tf.TensorSpec([B, H, None, D]), tf.TensorSpec([B, H, None, D], dtype)]
    traced = tf.function(lambda q, k, v: _run(lambda *x: attention(*x, "blockwise", block=16), q, k, v, w))
    graph = traced.get_concrete_function(*spec).graph
    graphs = [graph] + [f.graph for f in _nested_functions(graph)]
    stats = [o for g in graphs for o in g.get_operations() if o.type in ("Max", "Exp", "Sum", "Log", "Maximum")]
    assert stats and all(o.outputs[0].dtype == tf.float32 for o in stats), \
        sorted({(o.type, o.outputs[0].dtype.name) for o in stats})


def _nested_functions(graph):
    """Every function a graph's while loops (and their bodies' loops) call."""
    found, todo = [], [graph]
    while todo:
        g = todo.pop()
        for name in list(getattr(g, "_functions", {})):
            f = g._functions[name]  # noqa: SLF001 - the only handle on a loop body's graph
            if hasattr(f, "graph") and f not in found:
                found.append(f)
                todo.append(f.graph)
    return found


def test_one_trace_serves_any_length():
    """Traced once with unknown batch and lengths, the blockwise form (with a compact mask) gives Keras' answer at
    two lengths, one a whole number of blocks and one not. Fails for: the padding taken from the traced
    (unknown) shape as none, a Python loop over the blocks."""
    seq = tf.TensorSpec([None, H, None, D])
    fn = tf.function(lambda q, k, v, m: attention(q, k, v, "blockwise", blocked=m, block=16),
                     input_signature=[seq, seq, seq, tf.TensorSpec([None, None, None], tf.bool)])
    for tq, tk in ((37, 47), (16, 32)):  # 47 keys: 3 blocks of 16, one padded key
        q, k, v, _ = _inputs(tq, tk, seed=6)
        blocked, dense = _blocked(tq, tk, 4, tk - 5)
        _close(fn(q, k, v, blocked), np.asarray(_keras(*(a.astype("float64") for a in (q, k, v, dense)))))
    assert fn.experimental_get_tracing_count() == 1


@pytest.mark.slow  # a 2-tower strategy traced: seconds
def test_two_towers_share_one_trace():
    """Under a 2-tower MirroredStrategy, the tower pass traced once (train/towers.py's `shared`) and called by
    each tower on its own sample gives the whole batch's output and gradients. Fails for: state kept across calls
    of the custom gradient (one tower's saved statistics used by the other's backward)."""
    from seg_train.parallel.towers import shared

    q, k, v, w = _inputs(21, 35, seed=7, scale=2.0)
    blocked, _ = _blocked(21, 35, 4, 30)

    def grads(q, k, v, w, m):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention(q, k, v, "blockwise", blocked=m, block=16)
            loss = tf.reduce_sum(out * tf.transpose(tf.reshape(w, [tf.shape(w)[0], -1, H, D]), [0, 2, 1, 3]))
        return [out] + tape.gradient(loss, [q, k, v])

    one = [tf.TensorSpec([1, H, t, D]) for t in (21, 35, 35)]
    tower = shared(grads).get_concrete_function(*one, tf.TensorSpec([1, 21, H * D]),
                                                tf.TensorSpec([1, 4, 30], tf.bool))
    s = strategy(2)
    arrays = (q, k, v, w, blocked)
    values = [s.experimental_distribute_values_from_function(
        lambda ctx, a=a: tf.constant(a[ctx.replica_id_in_sync_group:ctx.replica_id_in_sync_group + 1]))
        for a in arrays]
    per_tower = tf.function(lambda *x: s.run(tower, x))(*values)
    whole = grads(*(tf.constant(a) for a in arrays))
    for part, ref in zip(per_tower, whole):
        got = np.concatenate([np.asarray(t) for t in s.experimental_local_results(part)])
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.max(np.abs(ref)))
    assert len(CPU_DEVICES) >= 2


@pytest.mark.slow  # XLA compiles forward and backward: ~10 s
def test_xla_compiles_the_loops():
    """tf.function(jit_compile=True) compiles the forward and backward loops (train.jit_compile) and gives Keras'
    answer with a compact mask. Fails for: an op XLA cannot compile in the loops (a TensorArray of unknown size, a
    shape that changes between iterations)."""
    tq, tk, r, c = 37, 45, 6, 30
    q, k, v, w = _inputs(tq, tk, seed=8, scale=2.0)
    blocked, dense = _blocked(tq, tk, r, c)
    ref = _reference(q, k, v, w, dense)
    fn = tf.function(lambda q, k, v, w, m: _run(lambda *x: attention(*x, "blockwise", blocked=m, block=16),
                                                q, k, v, w), jit_compile=True)
    got = fn(q, k, v, w, tf.constant(blocked))
    for name, a, ref_a in zip(["out", "dq", "dk", "dv"], got, ref):
        _close(a, ref_a, what=name)


@pytest.mark.parametrize("method, stored", [("plain", True), ("blockwise", False)])
def test_backward_keeps_no_tq_by_tk_map(method, stored):
    """The allocator's peak over a forward + backward at T = 1024 (the tests' CPU allocator keeps statistics,
    conftest.py): the plain form holds several float32 maps [b, h, T, T] (the softmax kept for the backward, the
    logits, their gradient), the blockwise form less than one. Fails for: the probabilities kept for the backward
    (TensorFlow's autodiff through the loop instead of the custom gradient: every block's probabilities stored),
    a block as wide as T."""
    b, h, t, d = 1, 4, 1024, 16
    rng = np.random.default_rng(9)
    q, k, v = (tf.constant(rng.normal(0, 1, (b, h, t, d)).astype("float32")) for _ in range(3))

    @tf.function
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention(q, k, v, method, block=128)
            loss = tf.reduce_sum(out * out)
        return tape.gradient(loss, [q, k, v])

    step(q, k, v)  # traced and run once: later allocations are the step's own
    device = CPU_DEVICES[0].replace("/device:", "")
    # TensorFlow 2.21's CPU allocator keeps these statistics (the pinned build CI installs): no skip, a missing
    # statistic fails the test rather than hiding it.
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    step(q, k, v)
    peak = tf.config.experimental.get_memory_info(device)["peak"] - before
    one_map = b * h * t * t * 4
    assert (peak > 2 * one_map) if stored else (peak < one_map), (peak / one_map)


# ---- the models with either form ----------------------------------------------------------------------------
def _attention_layers(model):
    from seg_train.models.dino.vit import Attention
    from seg_train.models.mit.encoder import EfficientAttention

    found, todo = [], [model]
    while todo:
        layer = todo.pop()
        if isinstance(layer, (Attention, EfficientAttention)):
            found.append(layer)
        todo += getattr(layer, "layers", [])
    return found


def _small_blocks(model, block=8):
    """Every attention layer of `model` on blocks of `block` keys (several blocks at the tests' token counts)."""
    layers = _attention_layers(model)
    for layer in layers:
        layer.block = block
    return layers


def _grads(model, fn):
    with tf.GradientTape() as tape:
        loss = fn()
    return loss, tape.gradient(loss, model.trainable_variables)


def _grads_close(model, ours, theirs, tol):
    """Each variable's gradient within `tol` of the largest gradient value of the model (some are round-off
    around 0: the key projection's bias shifts a whole row of logits, which softmax ignores)."""
    scale = max(float(np.max(np.abs(b))) for b in theirs if b is not None)
    for v, a, b in zip(model.trainable_variables, ours, theirs):
        assert (a is None) == (b is None), v.path
        if a is not None:
            err = np.max(np.abs(np.asarray(a) - np.asarray(b))) / scale
            assert err < tol, (v.path, err)


@pytest.mark.slow  # two encoders built and differentiated: a few seconds
def test_dino_encoder_forms_agree():
    """A DINOv3 encoder (rotary q and k after CLS and registers) gives the same maps and gradients (every
    variable, and the image) with blockwise attention as with plain. Fails for: the layer handing the blockwise
    form other operands than the plain form's (q and k before their rotation)."""
    from seg_train.config.variants import ViTVariant as Variant
    from seg_train.models.dino.vit import dino_encoder

    spec = Variant("dinov3", 16, 32, 2, 2, 64, registers=2, key_bias=False)
    plain = dino_encoder(spec, layers=(1, 2), attention="plain")
    rng = np.random.default_rng(13)
    for w in plain.weights:  # wider than the initialisation: logits that differ between keys
        w.assign(rng.normal(0, 0.3, w.shape).astype("float32"))
    blockwise = dino_encoder(spec, layers=(1, 2), attention="blockwise")
    blockwise.set_weights(plain.get_weights())
    assert {layer.method for layer in _small_blocks(blockwise, 4)} == {"blockwise"}
    x = tf.constant(np.random.default_rng(10).normal(0, 1, (2, 48, 64, 3)).astype("float32"))

    def run(model):
        with tf.GradientTape() as tape:
            tape.watch(x)
            maps = model(x, training=True)
            loss = tf.add_n([tf.reduce_sum(tf.sin(m)) for m in maps])
        return maps, tape.gradient(loss, [x] + model.trainable_variables)

    (maps_p, grads_p), (maps_b, grads_b) = run(plain), run(blockwise)
    for a, b in zip(maps_b, maps_p):
        _close(a, b)
    _close(grads_b[0], grads_p[0])
    _grads_close(blockwise, grads_b[1:], grads_p[1:], TOLERANCE)


@pytest.mark.slow  # two EoMT models traced in training mode: ~5 s
def test_eomt_forms_agree_and_are_the_reference():
    """EoMT with blockwise attention (its masked attention in the compact form) gives the transformers reference's
    predictions (every mask kept; the fixture of tests/test_eomt_model.py) and the plain model's predictions and
    gradients with half the masks kept. Fails for: the compact mask's rows or columns off by the queries / CLS /
    registers, the mask not passed to the blockwise form, the blockwise backward's recomputation without it."""
    from seg_train.models.eomt.eomt import eomt

    plain, z = eomt_from_reference()
    blockwise = eomt(plain.spec, 5, queries=8, eomt_blocks=3, attention="blockwise")
    blockwise.set_weights(plain.get_weights())
    assert {layer.method for layer in _small_blocks(blockwise)} == {"blockwise"}
    seeds = tf.constant([[1, 2], [3, 4]], tf.int32)
    got = blockwise.predictions(z["images"], [1.0] * 3, seeds, training=True)
    for i, (class_logits, mask_logits) in enumerate(got):
        _close(class_logits, z["masked_class"][i], 1e-4)
        _close(mask_logits, z["masked_mask"][i], 1e-4)
    _close(blockwise.predictions(z["images"])[0][1], z["eval_mask"][0], 1e-4)

    def loss(model):
        preds = model.predictions(z["images"], [0.5] * 3, seeds, training=True)
        return preds, tf.add_n([tf.reduce_sum(c ** 2) + tf.reduce_sum(tf.sigmoid(m)) for c, m in preds])

    with tf.GradientTape() as tape:
        preds_p, loss_p = loss(plain)
    grads_p = tape.gradient(loss_p, plain.trainable_variables)
    with tf.GradientTape() as tape:
        preds_b, loss_b = loss(blockwise)
    grads_b = tape.gradient(loss_b, blockwise.trainable_variables)
    for (cb, mb), (cp, mp) in zip(preds_b, preds_p):
        _close(cb, cp)
        _close(mb, mp)
    _grads_close(blockwise, grads_b, grads_p, TOLERANCE)


def test_mit_attention_forms_agree():
    """MiT's efficient attention (queries from the map, keys from the reduced map) gives the same output and
    gradients in both forms. Fails for: Tq taken for Tk (or the reverse) in the blockwise form."""
    from seg_train.models.mit.encoder import EfficientAttention

    rng = np.random.default_rng(11)
    q = tf.constant(rng.normal(0, 1, (2, 6, 7, 16)).astype("float32"))
    kv = [tf.constant(rng.normal(0, 1, (2, 3, 4, 16)).astype("float32")) for _ in range(2)]
    outs = []
    for method in ("plain", "blockwise"):
        layer = EfficientAttention(2, method, block=5)
        with tf.GradientTape() as tape:
            tape.watch([q] + kv)
            out = layer(q, *kv)
            loss = tf.reduce_sum(tf.sin(out))
        outs.append([out] + tape.gradient(loss, [q] + kv))
    for a, b in zip(*outs):
        _close(a, b)


def _graph_ops(graph_def) -> set[str]:
    return {n.op for n in graph_def.node} | {n.op for f in graph_def.library.function for n in f.node_def}


@pytest.mark.slow  # ViT-S models built, one checkpointed and exported twice: tens of seconds
@pytest.mark.parametrize("method", ["plain", "blockwise"])
def test_attention_key_reaches_the_run_and_its_exports(method, tmp_path):
    """model.attention from a config file: every attention layer of the run's model (TrainState; a linear head and
    EoMT) has the form; seg-export's SavedModel keeps it (a while loop in the graph with blockwise, none with
    plain) and serves the model's classes; seg-export --format tflite builds the plain form whatever the key (no
    WHILE op: builtins a phone runs well) and its file predicts the same classes. Fails for: the key dropped
    between the config and the model (the default's form everywhere), the TFLite export converting the loop."""
    from ai_edge_litert.interpreter import Interpreter

    from seg_train.infer.export import run_export
    from seg_train.infer.tflite_export import describe, run_export_tflite
    from seg_train.run import checkpoint as ckpt_lib
    from seg_train.run.state import TrainState

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "classes.txt").write_text("bg\nx\ny\n")
    vit = {"backbone": "dinov3_vits16", "attention": method}
    eomt_cfg = tiny_config(tmp_path / "eomt", data={"crop_size": [32, 48]},
                           model={**vit, "head": "eomt", "num_queries": 4, "eomt_blocks": 1})
    assert {layer.method for layer in _attention_layers(TrainState(eomt_cfg, strategy(1), optimizer=False).model)} \
        == {method}
    cfg = tiny_config(tmp_path, data_root=tmp_path / "data", data={"crop_size": [32, 48]},
                      eval={"bn_reestimate_batches": 0}, model={**vit, "head": "linear", "vit_layers": [1]})
    state = TrainState(cfg, strategy(1))
    assert {layer.method for layer in _attention_layers(state.model)} == {method}
    ckpt_lib.Checkpointer(tmp_path / "run" / "checkpoints", 1, **state.checkpoint_objects()).save(1)
    image = np.random.default_rng(12).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    x = (image.astype(np.float32) - np.float32(cfg.data.mean)) / np.float32(cfg.data.std)
    expected = np.argmax(state.model(x[None], training=False).numpy()[0], -1)

    saved = run_export(cfg, strategy(1), str(tmp_path / "run"), tmp_path / "model", progress=False)
    serve = tf.saved_model.load(str(saved)).signatures["serving_default"]
    assert bool({"While", "StatelessWhile"} & _graph_ops(serve.graph.as_graph_def())) == (method == "blockwise")
    np.testing.assert_array_equal(serve(image=tf.constant(image))["classes"].numpy(), expected)

    path = run_export_tflite(cfg, strategy(1), str(tmp_path / "run"), tmp_path / "m.tflite", progress=False)
    content = path.read_bytes()
    ops = describe(content)[0]
    assert "WHILE" not in ops and not [op for op in ops if op.startswith("Flex") or op == "CUSTOM"], ops
    interpreter = Interpreter(model_content=content)
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], image[None])
    interpreter.invoke()
    got = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])[0]
    assert (got == expected).mean() > 0.99


def test_config_default_is_the_models():
    """model.attention's default (the config cannot import TensorFlow) is the form the models take by default."""
    from seg_train.config import ModelConfig
    from seg_train.models.attention import DEFAULT
    from seg_train.models.dino.vit import Attention

    assert ModelConfig().attention == DEFAULT == Attention(2).method
