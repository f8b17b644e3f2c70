"""train.recompute: blocks (models/recompute.py): each transformer block's forward run again in the backward pass.

Held to TensorFlow's autodiff of the stored forward: on random weights and inputs (never a trained model's), the
outputs and every gradient (weights and input) of a tiny DINOv3 and DINOv2 encoder and of a tiny EoMT (masked
attention in progress) are bitwise those of the same model with recompute off, drop path on, float32 and
mixed_float16; then the key from a config file reaches the model. The step with the key (its traced graph
recomputes, 4 towers equal 1, 1 tower equals the step without recompute) is in tests/test_eomt_train.py, which
shares the step without recompute with its other tests; a killed and resumed run with it in
tests/test_panoptic_model.py.

Wrong answers these fail for: the key dropped between the config and the model (no recomputation in the graph);
the recomputation drawing drop path outside the step's sample counters (the backward pass of other masks, or of
none: the step's `per_sample` block has closed when the gradient is traced); the weights read inside the block
given no gradient (what tf.recompute_grad does under the step's keras.StatelessScope); EoMT's attention masks drawn
anew for the recomputation; the key accepted for a backbone without transformer blocks.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.config import ConfigError, from_dict
from seg_train.config.variants import ViTVariant
from seg_train.models import stochastic
from seg_train.models.dino.vit import dino_encoder
from seg_train.models.eomt.eomt import EoMT, eomt
from seg_train.run.state import TrainState
from tests.helpers import strategy, tiny_config

# dinov3_vits16 is tests/helpers.py's TINY_VITS16 throughout the module (conftest.py's `tiny_vits16`).
pytestmark = pytest.mark.usefixtures("tiny_vits16")

V3 = ViTVariant("dinov3", 8, 32, 3, 2, 64, registers=2, key_bias=False, layer_scale=0.5)
V2 = ViTVariant("dinov2", 8, 32, 3, 2, 64, registers=1, gated=True, pos_grid=3, layer_scale=0.5)
MATMULS = {"MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}


def _random_values(model, seed):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(0.0, 0.3, v.shape).astype(np.float32)) for v in model.weights]


def _ops(graph) -> list[str]:
    graph_def = graph.as_graph_def()
    return [n.op for n in graph_def.node] + [n.op for f in graph_def.library.function for n in f.node_def]


def _grads(model, values, x, forward, mode: str):
    """(loss, outputs, d loss / d [x, *values], the traced graph's op types) of `forward(model, x)` with the
    backbone's recompute `mode`, the weights mapped to `values` as the train step maps them (keras.StatelessScope)
    and drop path drawn from fixed sample counters."""
    (model.backbone if isinstance(model, EoMT) else model).recompute = mode

    @tf.function
    def step(values, x):
        with tf.GradientTape() as tape:
            tape.watch([x, *values])
            with stochastic.per_sample(tf.constant([11, 12], tf.int64), 5), \
                    keras.StatelessScope(list(zip(model.weights, values))):
                outs = [tf.cast(t, tf.float32) for t in forward(model, x)]
            loss = tf.add_n([tf.reduce_sum(o * o * (i + 1.0)) for i, o in enumerate(outs)])
        return loss, outs, tape.gradient(loss, [x, *values], unconnected_gradients=tf.UnconnectedGradients.ZERO)

    loss, outs, grads = step(values, x)
    ops = _ops(step.get_concrete_function(values, x).graph)
    return loss.numpy(), [o.numpy() for o in outs], [g.numpy() for g in grads], ops


def _assert_bitwise(stored, recomputed, names):
    assert stored[0].tobytes() == recomputed[0].tobytes()
    for a, b in zip(stored[1], recomputed[1]):
        assert a.tobytes() == b.tobytes()
    for a, b, name in zip(stored[2], recomputed[2], names):
        assert a.tobytes() == b.tobytes(), (name, float(np.max(np.abs(a - b))))
    assert all(np.any(g != 0) for g in recomputed[2]), [n for g, n in zip(recomputed[2], names) if not np.any(g)]
    matmuls = [sum(op in MATMULS for op in r[3]) for r in (stored, recomputed)]
    assert matmuls[1] > matmuls[0], matmuls  # the forward's products traced again in the backward pass


def _encoder_forward(model, x):
    return model(x, training=True)


@pytest.mark.slow  # two gradient graphs of a tiny ViT traced and run: several seconds each
@pytest.mark.parametrize("spec, precision", [(V3, "float32"), (V2, "float32"), (V3, "mixed_float16")],
                         ids=["dinov3", "dinov2", "dinov3-mixed"])
def test_vit_gradients_are_the_stored_ones_bitwise(spec, precision):
    """A 3-block ViT of width 32 (DINOv3: RoPE, registers; DINOv2: learned positions, SwiGLU), drop path 0.5,
    outputs of blocks 2 and 3: loss, outputs and the gradient of every weight and of the image bitwise equal with
    and without recompute, every gradient non-zero, the backward pass holding more products than the stored one.
    Fails for: drop path drawn outside the sample counters in the recomputation, weights without gradients,
    recompute not applied."""
    keras.utils.set_random_seed(1)
    keras.config.set_dtype_policy(precision)
    try:
        model = dino_encoder(spec, layers=(2, 3), drop_path_rate=0.5, label="tiny")
    finally:
        keras.config.set_dtype_policy("float32")
    values = _random_values(model, 2)
    x = tf.constant(np.random.default_rng(3).normal(size=(2, 16, 24, 3)).astype(np.float32))
    stored = _grads(model, values, x, _encoder_forward, "none")
    recomputed = _grads(model, values, x, _encoder_forward, "blocks")
    _assert_bitwise(stored, recomputed, ["image"] + [v.path for v in model.weights])
    # Drop path does draw here (else the masks' redraw would be untested): inference differs.
    with keras.StatelessScope(list(zip(model.weights, values))):
        plain = model(x, training=False)[-1]
    assert np.max(np.abs(np.asarray(plain, np.float32) - stored[1][-1])) > 1e-3


def _eomt_forward(model, x):
    probs = tf.constant([1.0, 0.5])
    seeds = tf.constant([[3, 4], [5, 6]], tf.int32)
    return [t for pair in model.predictions(x, probs, seeds, training=True) for t in pair]


@pytest.mark.slow  # two gradient graphs of a tiny EoMT traced and run: several seconds
def test_eomt_gradients_are_the_stored_ones_bitwise():
    """A tiny EoMT (3 blocks, the last 2 EoMT blocks, 4 queries, drop path 0.3) in training with block 1's masks
    kept and block 2's kept with probability 0.5: every prediction, weight gradient and the image's gradient
    bitwise equal with and without recompute. Fails for: the masks drawn anew or dropped in the recomputation,
    drop path redrawn, the queries (joined before the EoMT blocks) or the blocks' weights without gradients."""
    keras.utils.set_random_seed(1)
    model = eomt(V3, 3, queries=4, eomt_blocks=2, drop_path_rate=0.3, label="tiny")
    values = _random_values(model, 4)
    x = tf.constant(np.random.default_rng(5).normal(size=(2, 16, 24, 3)).astype(np.float32))
    stored = _grads(model, values, x, _eomt_forward, "none")
    recomputed = _grads(model, values, x, _eomt_forward, "blocks")
    _assert_bitwise(stored, recomputed, ["image"] + [v.path for v in model.weights])


@pytest.mark.parametrize("backbone, head", [("tiny", "deeplabv3plus"), ("mit_b0", "segformer")])
def test_recompute_refused_without_transformer_blocks(backbone, head):
    """Fails for the key accepted (and silently doing nothing) on a CNN or on MiT, whose blocks it does not wrap."""
    raw = {"data": {"root": "data", "num_classes": 3}, "model": {"backbone": backbone, "head": head},
           "train": {"recompute": "blocks"}}
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert "train.recompute" in str(err.value) and "\n" not in str(err.value)


# ---- the run ------------------------------------------------------------------------------------------------
@pytest.mark.slow  # models built from config files: seconds
def test_recompute_key_reaches_the_model(tmp_path):
    """train.recompute from a config file, through TrainState, on a linear head over block 1 of dinov3_vits16
    (tests/helpers.py's TINY_VITS16 in its place): the traced gradient of a training call holds more products with
    blocks than with none (the block's forward again). Fails for: the key dropped between the config and the
    model."""
    counts = {mode: _gradient_matmuls(tmp_path / mode, mode) for mode in ("none", "blocks")}
    keras.backend.clear_session()
    assert counts["blocks"] > counts["none"], counts


def _gradient_matmuls(tmp_path, mode):
    cfg = tiny_config(tmp_path, data={"crop_size": [32, 32]}, train={"recompute": mode},
                      model={"backbone": "dinov3_vits16", "head": "linear", "vit_layers": [1]})
    model = TrainState(cfg, strategy(1), optimizer=False).model

    @tf.function
    def grads(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    graph = grads.get_concrete_function(tf.TensorSpec([1, 32, 32, 3], tf.float32)).graph
    return sum(op in MATMULS for op in _ops(graph))
