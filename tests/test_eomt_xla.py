"""train.jit_compile with EoMT: the model's forward and its gradient XLA-compiled, the matcher and the loss not
(objectives/mask_classification.py says why), held to the non-compiled step; and the random draws the compiled
forward makes (drop path, the masked attention's keeps) equal to TensorFlow's own kernels' (models/stochastic.py).

Wrong answers these fail for: a draw inside the XLA cluster made by XLA's lowering of tf.random.stateless_uniform
(other floats from the same seed: other drop-path and mask draws, another loss); the key silently dropped for
EoMT (no XLA-compiled function in the traced step); the compiled forward's gradient not reaching the variables,
or its loss or updated weights not the non-compiled step's.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models import stochastic
from seg_train.models.eomt.eomt import mask_keeps
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import strategy, tiny_config

# dinov3_vits16 is tests/helpers.py's TINY_VITS16 throughout the module (conftest.py's `tiny_vits16`).
pytestmark = pytest.mark.usefixtures("tiny_vits16")


@pytest.mark.slow  # three XLA compilations: seconds
def test_uniform_is_tensorflows_draw_also_under_xla():
    """stochastic.uniform equals tf.random.stateless_uniform run by TensorFlow's CPU kernel (its automatic algorithm,
    what the layers drew before) bit for bit, outside and inside an XLA-compiled function, for int32 and int64
    seeds; so do EoMT's mask keeps. Fails for: the float made by XLA's lowering (the same seed's draw under
    jit_compile differs in most entries), or another algorithm than TensorFlow's Philox."""
    rng = np.random.default_rng(53)
    for dtype in (tf.int32, tf.int64):
        seeds = tf.constant(rng.integers(-2 ** 31, 2 ** 31, (6, 2)), dtype)
        want = tf.stack([tf.random.stateless_uniform([5, 3], s) for s in tf.unstack(seeds)]).numpy()
        draw = lambda s: tf.stack([stochastic.uniform([5, 3], x) for x in tf.unstack(s)])  # noqa: E731
        np.testing.assert_array_equal(tf.function(draw)(seeds).numpy(), want)
        np.testing.assert_array_equal(tf.function(draw, jit_compile=True)(seeds).numpy(), want)
    seeds = tf.constant(rng.integers(0, 2 ** 31, (3, 2)), tf.int32)
    keeps = lambda s: mask_keeps(s, 1, 0.5, 40)  # noqa: E731
    np.testing.assert_array_equal(tf.function(keeps, jit_compile=True)(seeds).numpy(), keeps(seeds).numpy())


# ---- the step ----------------------------------------------------------------------------------------------
def _config(tmp_path, jit_compile: bool):
    return tiny_config(tmp_path, data={"crop_size": [32, 48]},
                       model={"backbone": "dinov3_vits16", "head": "eomt", "eomt_blocks": 2, "num_queries": 5,
                              "weight_decay": 0.0, "drop_path_rate": 0.3},
                       train={"optimizer": "sgd", "learning_rate": 0.05, "num_steps": 8, "jit_compile": jit_compile,
                              "mask_annealing": [[0, 2], [1, 3]]}, loss={"mask_points": 64})


@pytest.fixture(scope="module")
def plain_and_compiled(tmp_path_factory, tiny_vits16):
    """The same 2-EoMT-block tiny ViT (its seeded random initialisation; drop path 0.3, block 1's masking
    annealed from p = 1 to 0.54) from configs with train.jit_compile false and true, 1 tower: the probe of the
    first batch, then two SGD steps; and each traced step's graph."""
    tmp = tmp_path_factory.mktemp("eomt_xla")
    rng = np.random.default_rng(7)
    images = rng.normal(size=(4, 32, 48, 3)).astype(np.float32)
    labels = rng.integers(0, 3, (4, 32, 48)).astype(np.uint8)
    labels[1] = 2              # an image with a single class
    labels[0, :12] = 255       # ignored pixels
    out = {}
    for jit in (False, True):
        step = TrainStep(TrainState(_config(tmp / str(jit), jit), strategy(1)))
        data = step.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
        graph = step.concrete_function(data.element_spec).graph.as_graph_def()
        batch = next(iter(data))
        probe = step.probe(batch)
        losses = [float(step(batch).loss) for _ in range(2)]
        out[jit] = {"graph": graph, "probe_loss": float(probe.loss),
                    "gradients": [g.numpy() for g in probe.gradients], "losses": losses,
                    "weights": [w.numpy() for w in step.state.model.weights]}
    yield out
    keras.backend.clear_session()


def _xla_functions(graph_def):
    return [f for f in graph_def.library.function if "_XlaMustCompile" in f.attr and f.attr["_XlaMustCompile"].b]


@pytest.mark.slow
def test_eomt_jit_compile_compiles_the_forward_and_its_gradient(plain_and_compiled):
    """The step traced from the config with train.jit_compile true holds XLA-compiled functions (the attribute
    tf.function(jit_compile=True) sets) with the model's attention (BatchMatMulV2) and its gradient (BiasAddGrad),
    and none with the matcher's or the loss's ops (CheckNumerics, TopKV2); the plain config's holds none.
    Fails for: the key silently dropped for EoMT; the whole tower pass compiled (the matcher inside: XLA refuses
    its data-dependent shapes)."""
    compiled = _xla_functions(plain_and_compiled[True]["graph"])
    ops = [{n.op for n in f.node_def} for f in compiled]
    assert any("BatchMatMulV2" in o for o in ops) and any("BiasAddGrad" in o for o in ops), ops
    assert not any(o & {"CheckNumerics", "TopKV2"} for o in ops)
    assert not _xla_functions(plain_and_compiled[False]["graph"])


@pytest.mark.slow
def test_compiled_eomt_step_equals_the_plain_one(plain_and_compiled):
    """The XLA-compiled step's loss, gradients and updated weights are the non-compiled step's: the loss to
    float32 round-off (it came out bitwise equal here), gradients to 2e-5 of the largest (XLA fuses and reorders
    float32 sums; 5e-7 of 4.2 was seen), weights after two steps to 1e-6. Fails for: other drop-path or
    mask draws inside the compiled forward (XLA's own stateless_uniform), the gradient not flowing through the
    compiled function, the model's new state or a prediction layer lost on the way out."""
    plain, xla = plain_and_compiled[False], plain_and_compiled[True]
    assert np.isfinite(plain["losses"]).all() and plain["losses"][0] != plain["losses"][1]
    np.testing.assert_allclose(xla["probe_loss"], plain["probe_loss"], rtol=1e-6)
    np.testing.assert_allclose(xla["losses"], plain["losses"], rtol=1e-6)
    scale = max(float(np.abs(g).max()) for g in plain["gradients"])
    assert scale > 0
    for a, b in zip(plain["gradients"], xla["gradients"]):
        np.testing.assert_allclose(b, a, atol=2e-5 * scale)
    assert sum(float(np.abs(g).sum()) > 0 for g in plain["gradients"]) > len(plain["gradients"]) // 2
    for a, b in zip(plain["weights"], xla["weights"]):
        np.testing.assert_allclose(b, a, atol=1e-6)
