"""EoMT as a user trains it: the keys (model.head eomt, model.num_queries, model.eomt_blocks,
train.mask_annealing) through the config loader, the train step on 1 and 4 towers, and the seg-train command
killed and resumed with the annealing in progress.

Wrong answers these fail for: the annealing windows not the reference's stagger (the EoMT repository's Cityscapes
config: 19902 steps, 4 blocks -> starts 3317, 6634, 9951, 13268); the probability curve not
(1 - progress)^0.9 or not a function of the step; the loss divided by one tower's mask count or class weights
instead of the global batch's (4 towers then differ from 1); the step's loss not the mask-classification loss
of eomt_loss.py on the model's predictions with the step's own seeds; masks or points drawn per tower row or
per call (a resumed run or 4 towers draw others); per-pixel loss keys silently ignored under EoMT.

The steps and the run train dinov3_vits16 with tests/helpers.py's TINY_VITS16 in its place (the `tiny_vits16`
fixture): its structure at 4 blocks of width 32.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from seg_train import cli
from seg_train.cli import preflight
from seg_train.config import ConfigError, from_dict
from seg_train.config.resolve import annealing_windows, check_trainable
from seg_train.data import synthetic
from seg_train.models import stochastic
from seg_train.objectives.mask_classification import mask_probabilities, sample_seeds
from seg_train.objectives.mask_loss import EomtLossOptions, eomt_loss_terms, losses_from_terms
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import resume_bitwise, strategy, tiny_config

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


@pytest.fixture(scope="module")
def one_and_four(tmp_path_factory, tiny_vits16):
    """Two SGD steps of a 2-EoMT-block DINOv3 (drop path 0.3, annealing in progress: block 1 at p = 1 then 0.54,
    block 2 at 1 then 1) on 1 and on 4 towers from the same seed and batch; the 1-tower weights after step 1."""
    tmp = tmp_path_factory.mktemp("eomt")
    images, labels = _images()
    out = {}
    for name, towers in (("one", 1), ("four", 4)):
        step = TrainStep(TrainState(_config(tmp / name), strategy(towers)))
        batch = next(iter(step.state.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors((images, labels)))))
        first = float(step(batch).loss)
        after_first = [v.numpy() for v in step.state.model.weights]
        out[name] = (step, [first, float(step(batch).loss)], after_first)
    yield images, labels, out
    keras.backend.clear_session()


@pytest.mark.slow
def test_four_towers_equal_one(one_and_four):
    """Fails for totals taken per tower (each tower's own mask count and class weights), for masks or points drawn
    from the tower's rows, and for drop path drawn per call."""
    _, _, out = one_and_four
    (one, l1, _), (four, l4, _) = out["one"], out["four"]
    assert np.isfinite(l1).all() and l1[0] != l1[1]
    np.testing.assert_allclose(l1, l4, rtol=2e-5)
    for a, b in zip(one.state.model.weights, four.state.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=2e-5, err_msg=a.path)


@pytest.mark.slow
def test_step_loss_is_eomt_loss_of_the_predictions(one_and_four, tiny_vits16):
    """The loss of step 2 (made at step counter 1) is eomt_loss.py's weighted total over the layers
    (losses_from_terms, held to transformers' EomtLoss) of the model's own training predictions from the weights
    after step 1, with the probabilities of the configured windows at step 1 (0.54, 1), the rows' sample counters
    and the run seed; the model has the configured queries and EoMT blocks."""
    images, labels, out = one_and_four
    step, losses, after_first = out["one"]
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


# ---- the command: kill and resume ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=12, num_val=2, size=(40, 48),
                              num_classes=3)


@pytest.mark.slow
def test_resumed_eomt_run_is_bitwise_the_uninterrupted_one(tmp_path, data_root):
    """seg-train on 2 towers, AdamW with layer decay, EoMT with drop path and the annealing in progress over the 4
    steps (checkpoints at 2 and 4); the run rewound to step 2 and resumed: ckpt-4 bitwise the first run's."""
    raw = {"seed": 3, "run_dir": "run",
           "data": {"root": str(data_root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                    "num_parallel_calls": 2, "val_split": "none"},
           "model": {"backbone": "dinov3_vits16", "head": "eomt", "eomt_blocks": 2, "num_queries": 4,
                     "drop_path_rate": 0.3},
           "train": {"num_steps": 4, "checkpoint_every": 2, "summary_every": 1, "image_summary_every": 2,
                     "optimizer": "adamw", "learning_rate": 1e-3, "layer_decay": 0.8,
                     "mask_annealing": [[1, 3], [2, 4]]},
           "loss": {"mask_points": 64},
           "eval": {"bn_reestimate_batches": 0}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    keys = resume_bitwise(tmp_path / "cfg.yaml", tmp_path)
    assert any("queries" in k for k in keys)
    # seg-eval on the val images (whole, unpadded 40x48 images: padded to whole patches per pass).
    out = io.StringIO()
    with redirect_stderr(out), redirect_stdout(out):
        rc = cli.eval_main(["--config", str(tmp_path / "cfg.yaml"), "--gpus", "2", "--checkpoint",
                            str(tmp_path / "run"), "--set", "data.val_split=val"])
    assert rc == 0 and "mIoU" in out.getvalue(), out.getvalue()[-2000:]
