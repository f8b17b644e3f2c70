"""EoMT as a user trains it: the keys (model.head eomt, model.num_queries, model.eomt_blocks,
train.mask_annealing) through the config loader, the train step on 1 and 4 towers, with train.jit_compile (its
forward and gradient XLA-compiled, the matcher and the loss not: objectives/mask_classification.py says why) and with
train.recompute: blocks (models/recompute.py) against the plain step. The seg-train command killed and resumed with
EoMT (the annealing in progress, recompute on) is tests/test_panoptic_model.py's resume test.

Wrong answers these fail for: the annealing windows not the reference's stagger (the EoMT repository's Cityscapes
config: 19902 steps, 4 blocks -> starts 3317, 6634, 9951, 13268); the probability curve not
(1 - progress)^0.9 or not a function of the step; the loss divided by one tower's mask count or class weights
instead of the global batch's (4 towers then differ from 1); the step's loss not the mask-classification loss
of eomt_loss.py on the model's predictions with the step's own seeds; masks or points drawn per tower row or
per call (4 towers draw others); per-pixel loss keys silently ignored under EoMT; train.jit_compile
silently dropped for EoMT (no XLA-compiled function in the traced step), the whole tower pass compiled, the compiled
forward's gradient not reaching the variables or its loss or updated weights not the plain step's; train.recompute
dropped between the config and the model, or its recomputation redrawing masks or drop path per tower.

The steps and the run train dinov3_vits16 with tests/helpers.py's TINY_VITS16 in its place (the `tiny_vits16`
fixture): its structure at 4 blocks of width 32.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.cli import preflight
from seg_train.config import ConfigError, from_dict
from seg_train.config.resolve import annealing_windows, check_trainable
from seg_train.models import backbone_of, stochastic
from seg_train.objectives.mask_classification import mask_probabilities, sample_seeds
from seg_train.objectives.mask_loss import EomtLossOptions, eomt_loss_terms, losses_from_terms
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import strategy, tiny_config

# dinov3_vits16 is tests/helpers.py's TINY_VITS16 throughout the module (conftest.py's `tiny_vits16`).
pytestmark = pytest.mark.usefixtures("tiny_vits16")


def _raw(model=None, train=None, loss=None, classes=3):
    return {"data": {"root": "data", "num_classes": classes, "crop_size": [32, 48]},
            "model": {"backbone": "dinov3_vits16", "head": "eomt", **(model or {})},
            "train": {"num_steps": 32600, **(train or {})}, "loss": loss or {}}


# ---- the config ------------------------------------------------------------------------------------------
def test_default_annealing_is_the_references_stagger():
    """4 EoMT blocks: the windows of the reference's Cityscapes semantic config, its numbers written here. It
    trains 107 epochs of 186 steps (2975 images, 4 GPUs x 4) = 19902 steps and anneals block k over
    [3317 k, 3317 (k + 1)]: masking ends at 5/6 of training, not at its last step."""
    cfg = from_dict(_raw(train={"num_steps": 19902}))
    assert (cfg.model.num_queries, cfg.model.eomt_blocks) == (100, 4)
    assert annealing_windows(cfg) == [(3317, 6634), (6634, 9951), (9951, 13268), (13268, 16585)]


def test_annealing_probability_is_the_poly_curve():
    """1 before a block's window, 0 from its end, (1 - progress)^0.9 inside (worked out by hand)."""
    windows = [(10, 20), (20, 40)]
    for step, want in [(0, [1, 1]), (10, [1, 1]), (15, [0.5 ** 0.9, 1]), (20, [0, 1]), (30, [0, 0.5 ** 0.9]),
                       (39, [0, 0.05 ** 0.9]), (40, [0, 0]), (10 ** 6, [0, 0])]:
        np.testing.assert_allclose(mask_probabilities(tf.constant(step, tf.int64), windows).numpy(), want,
                                   rtol=1e-6, err_msg=str(step))


@pytest.mark.parametrize("raw, key", [
    (_raw(model={"eomt_blocks": 13}), "model.eomt_blocks"),
    (_raw(model={"vit_layers": [12]}), "model.vit_layers"),
    (_raw(loss={"type": "dice"}), "loss.type"),
    (_raw(loss={"class_weights": [1.0, 2.0, 3.0]}), "loss.class_weights"),
    (_raw(loss={"top_k_percent_pixels": 0.5}), "loss.top_k_percent_pixels"),
    ({**_raw(loss={"mask_points": 100}), "model": {"backbone": "dinov3_vits16", "head": "linear"}},
     "loss.mask_points"),
    (_raw(train={"mask_annealing": [[0, 10]]}), "train.mask_annealing"),
    (_raw(train={"mask_annealing": [[10, 5]] * 4}), "train.mask_annealing"),
    ({**_raw(train={"mask_annealing": [[0, 10]]}), "model": {"backbone": "dinov3_vits16", "head": "linear"}},
     "train.mask_annealing"),
    ({**_raw(), "model": {"backbone": "mobilenetv2", "head": "eomt"}}, "model.head"),
])
def test_eomt_keys_refused_in_one_line(raw, key):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_fewer_queries_than_classes_refused_for_training_only():
    """2 queries for 3 classes: the config loads (seg-eval of a published EoMT: ADE20K's have 100 queries for 150
    classes), the training commands' check refuses it in one line. Fails for: the matcher fed more masks than
    queries (an error inside the traced step), or evaluation refused."""
    cfg = from_dict(_raw(model={"num_queries": 2}))
    with pytest.raises(ConfigError) as err:
        preflight.for_training(cfg)
    assert str(err.value).startswith("fewer queries than classes (model.num_queries): at least data.num_classes (3)")
    check_trainable(from_dict(_raw(model={"num_queries": 3})))


# ---- the step ----------------------------------------------------------------------------------------------
def _images(b=4, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(b, 32, 48, 3)).astype(np.float32)
    labels = rng.integers(0, 3, (b, 32, 48)).astype(np.uint8)
    labels[1] = 2              # an image with a single class
    labels[0, :12] = 255       # ignored pixels on one tower only
    return images, labels


def _config(tmp_path, **train):
    return tiny_config(tmp_path, data={"crop_size": [32, 48]},
                       model={"backbone": "dinov3_vits16", "head": "eomt", "eomt_blocks": 2, "num_queries": 5,
                              "weight_decay": 0.0, "drop_path_rate": 0.3},
                       train={"optimizer": "sgd", "learning_rate": 0.05, "num_steps": 8,
                              "mask_annealing": [[0, 2], [1, 3]], **train}, loss={"mask_points": 64})


# One run per configuration of the step, shared by the tests of this section: plain on 1 tower, with
# train.jit_compile on 1, with train.recompute on 4 (each a traced and optimized step: the costly part). No plain
# 4-tower run and no recomputing 1-tower run: recompute's gradients are the stored ones bitwise
# (tests/test_recompute.py), so the recomputing 4 towers against the plain 1 tower hold the towers' split and the
# recomputation at once.
RUNS = {"one": (1, {}), "xla": (1, {"jit_compile": True}), "recompute_four": (4, {"recompute": "blocks"})}
MATMULS = {"MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}


@pytest.fixture(scope="module")
def steps(tmp_path_factory, tiny_vits16):
    """Two SGD steps of a 2-EoMT-block DINOv3 (drop path 0.3, annealing in progress: block 1 at p = 1 then 0.54,
    block 2 at 1 then 1) from the same seed and batch in each of RUNS' configurations: the step, its two losses,
    the weights after step 1 and after step 2, the traced step's graph, and for "one" and "xla" the probe of the
    batch before the first step (nothing applied)."""
    tmp = tmp_path_factory.mktemp("eomt")
    images, labels = _images()
    out = {}
    for name, (towers, train) in RUNS.items():
        step = TrainStep(TrainState(_config(tmp / name, **train), strategy(towers)))
        data = step.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
        run = {"step": step}
        run["graph"] = step.concrete_function(data.element_spec).graph.as_graph_def()
        batch = next(iter(data))
        if name in ("one", "xla"):
            probe = step.probe(batch)
            run["probe_loss"], run["gradients"] = float(probe.loss), [g.numpy() for g in probe.gradients]
        first = float(step(batch).loss)
        run["after_first"] = [v.numpy() for v in step.state.model.weights]
        run["losses"] = [first, float(step(batch).loss)]
        run["weights"] = [(v.path, v.numpy()) for v in step.state.model.weights]
        out[name] = run
    yield images, labels, out
    keras.backend.clear_session()


@pytest.mark.slow
def test_four_towers_equal_one(steps):
    """4 towers (train.recompute on: RUNS) against the plain step on 1. Fails for totals taken per tower (each tower's
    own mask count and class weights), for masks or points drawn from the tower's rows, and for drop path drawn per
    call."""
    _, _, out = steps
    one, four = out["one"], out["recompute_four"]
    l1, l4 = one["losses"], four["losses"]
    assert np.isfinite(l1).all() and l1[0] != l1[1]
    np.testing.assert_allclose(l1, l4, rtol=2e-5)
    for (path, a), (_, b) in zip(one["weights"], four["weights"]):
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=path)


@pytest.mark.slow
def test_step_loss_is_eomt_loss_of_the_predictions(steps, tiny_vits16):
    """The loss of step 2 (made at step counter 1) is eomt_loss.py's weighted total over the layers
    (losses_from_terms, held to transformers' EomtLoss) of the model's own training predictions from the weights
    after step 1, with the probabilities of the configured windows at step 1 (0.54, 1), the rows' sample counters
    and the run seed; the model has the configured queries and EoMT blocks."""
    images, labels, out = steps
    step, losses, after_first = (out["one"][k] for k in ("step", "losses", "after_first"))
    cfg = step.state.cfg
    fresh = TrainState(cfg, strategy(1), optimizer=False)
    fresh.model.set_weights(after_first)
    assert fresh.model.queries.shape == (5, tiny_vits16.width)
    ids = stochastic.sample_ids(1, 0, 0, 4, 1, 1)
    probs = mask_probabilities(1, [(0, 2), (1, 3)])
    np.testing.assert_allclose(probs.numpy(), [0.5 ** 0.9, 1.0], rtol=1e-6)
    with stochastic.per_sample(ids, cfg.seed):
        preds = fresh.model.predictions(tf.constant(images), probs, sample_seeds(ids, cfg.seed, "mask"),
                                        training=True)
    opts = EomtLossOptions(num_classes=3, num_points=64)
    terms = eomt_loss_terms(preds, tf.constant(labels), sample_seeds(ids, cfg.seed, "points"), opts)
    want = float(losses_from_terms(terms, opts)["loss"])
    np.testing.assert_allclose(losses[1], want, rtol=1e-5)
    assert len(preds) == cfg.model.eomt_blocks + 1


def _xla_functions(graph_def):
    return [f for f in graph_def.library.function if "_XlaMustCompile" in f.attr and f.attr["_XlaMustCompile"].b]


@pytest.mark.slow
def test_eomt_jit_compile_compiles_the_forward_and_its_gradient(steps):
    """The step traced from the config with train.jit_compile true holds XLA-compiled functions (the attribute
    tf.function(jit_compile=True) sets) with the model's attention (BatchMatMulV2) and its gradient (BiasAddGrad),
    and none with the matcher's or the loss's ops (CheckNumerics, TopKV2); the plain config's holds none.
    Fails for: the key silently dropped for EoMT; the whole tower pass compiled (the matcher inside: XLA refuses
    its data-dependent shapes)."""
    _, _, out = steps
    compiled = _xla_functions(out["xla"]["graph"])
    ops = [{n.op for n in f.node_def} for f in compiled]
    assert any("BatchMatMulV2" in o for o in ops) and any("BiasAddGrad" in o for o in ops), ops
    assert not any(o & {"CheckNumerics", "TopKV2"} for o in ops)
    assert not _xla_functions(out["one"]["graph"])


@pytest.mark.slow
def test_compiled_eomt_step_equals_the_plain_one(steps):
    """The XLA-compiled step's loss, gradients and updated weights are the non-compiled step's: the loss to
    float32 round-off, gradients to 2e-5 of the largest (XLA fuses and reorders float32 sums), weights after two
    steps to 1e-6. Fails for: other drop-path or mask draws inside the compiled forward (XLA's own
    stateless_uniform), the gradient not flowing through the compiled function, the model's new state or a
    prediction layer lost on the way out."""
    _, _, out = steps
    plain, xla = out["one"], out["xla"]
    assert np.isfinite(plain["losses"]).all() and plain["losses"][0] != plain["losses"][1]
    np.testing.assert_allclose(xla["probe_loss"], plain["probe_loss"], rtol=1e-6)
    np.testing.assert_allclose(xla["losses"], plain["losses"], rtol=1e-6)
    scale = max(float(np.abs(g).max()) for g in plain["gradients"])
    assert scale > 0
    for a, b in zip(plain["gradients"], xla["gradients"]):
        np.testing.assert_allclose(b, a, atol=2e-5 * scale)
    assert sum(float(np.abs(g).sum()) > 0 for g in plain["gradients"]) > len(plain["gradients"]) // 2
    for (_, a), (_, b) in zip(plain["weights"], xla["weights"]):
        np.testing.assert_allclose(b, a, atol=1e-6)


def _matmuls(graph_def) -> int:
    ops = [n.op for n in graph_def.node] + [n.op for f in graph_def.library.function for n in f.node_def]
    return sum(op in MATMULS for op in ops)


@pytest.mark.slow
def test_recompute_key_reaches_the_step(steps):
    """train.recompute: blocks from a config file (models/recompute.py; tests/test_recompute.py holds its
    gradients to the stored ones bitwise) on 4 towers: the model's blocks recompute and the traced step holds the
    recomputation (more products than the stored step's, whose tower pass is traced once for every tower too);
    test_four_towers_equal_one holds its weights to the plain step's. Fails for: the key dropped between the config
    and the model, EoMT's own blocks left stored."""
    _, _, out = steps
    stored, four = out["one"], out["recompute_four"]
    assert backbone_of(stored["step"].state.model).recompute == "none"
    assert backbone_of(four["step"].state.model).recompute == "blocks"
    assert _matmuls(four["graph"]) > _matmuls(stored["graph"]), (_matmuls(four["graph"]), _matmuls(stored["graph"]))
