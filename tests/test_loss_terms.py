"""loss.type / loss.terms (Lovász-softmax, Dice) and loss.ohem_threshold, held to numpy written from the
definitions, their gradients to the references' analytic gradients, and the trainer's 1 tower = N towers.

Wrong answers these catch: Lovász errors sorted ascending, its Jaccard gradient not differenced, an
average over all classes instead of the present ones, ignored pixels counted as background or sorted
among the others; Dice without the smooth term or over the ignored pixels; OHEM keeping pixels above
the threshold, not the minimum kept, ranking by the weighted loss; terms normalised per tower.
"""

import numpy as np
import pytest
import tensorflow as tf

from seg_train.objectives import pixel_losses as losses
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import LOSS_NUM_CLASSES as C
from tests.helpers import dice_numpy, lovasz_numpy, softmax64, tiny_config

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def batch(seed=0, b=3, h=6, w=7, scale=2.0):
    """Random logits; labels with ignored pixels, image 2 missing class 3, image 1 fully labelled."""
    rng = np.random.default_rng(seed)
    logits = (scale * rng.normal(size=(b, h, w, C))).astype(np.float32)
    labels = rng.integers(0, C, size=(b, h, w)).astype(np.uint8)
    labels[0, :2] = 255
    if b > 2:
        labels[2][labels[2] == 3] = 0
        labels[2, -1, :3] = 255
    return logits, labels


@pytest.mark.parametrize("name, fn, reference", [
    ("lovasz", losses.lovasz_softmax_per_image, lovasz_numpy),
    ("dice", losses.dice_per_image, dice_numpy),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_per_image_loss_and_gradient_match_the_numpy_reference(name, fn, reference, seed):
    logits, labels = batch(seed)
    want, want_grad = reference(logits, labels)
    x = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(x)
        got = fn(x, labels, 255)
        total = tf.reduce_sum(got)
    grad = tape.gradient(total, x).numpy()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
    # Ignored pixels: no gradient, and any logits there give the same loss.
    assert np.all(grad[labels == 255] == 0)
    moved = np.where((labels == 255)[..., None], 50.0 * np.sign(logits), logits).astype(np.float32)
    np.testing.assert_allclose(fn(tf.constant(moved), labels, 255).numpy(), got.numpy(), rtol=1e-6)


def test_lovasz_is_zero_for_a_perfect_prediction_and_gradient_matches_finite_differences():
    logits, labels = batch(3, b=1, h=3, w=4, scale=1.0)
    onehot = 30.0 * np.eye(C)[np.where(labels == 255, 0, labels)].astype(np.float32)
    assert float(losses.lovasz_softmax_per_image(onehot, labels, 255)[0]) < 1e-6
    z = logits.astype(np.float64)
    _, analytic = lovasz_numpy(z, labels)
    eps = 1e-6
    for idx in [(0, 2, 1, 0), (0, 1, 3, 2), (0, 2, 2, 3)]:
        up, down = z.copy(), z.copy()
        up[idx] += eps
        down[idx] -= eps
        numeric = (lovasz_numpy(up, labels)[0][0] - lovasz_numpy(down, labels)[0][0]) / (2 * eps)
        assert abs(numeric - analytic[idx]) < 1e-5, idx


def test_an_image_without_valid_pixels_is_zero():
    logits, labels = batch(0, b=2)
    labels[1] = 255
    for fn in (losses.lovasz_softmax_per_image, losses.dice_per_image):
        assert float(fn(logits, labels, 255)[1]) == 0.0


def ohem_numpy(logits, labels, threshold, min_kept, weights=None):
    """Per image: keep valid pixels with true-class probability < threshold, and the min_kept lowest."""
    sums, norms = [], []
    w = np.ones(C) if weights is None else np.asarray(weights, np.float64)
    for i in range(logits.shape[0]):
        valid = labels[i].reshape(-1) != 255
        y = labels[i].reshape(-1)[valid].astype(np.int64)
        p = softmax64(logits[i].reshape(-1, C))[valid][np.arange(y.size), y]
        order = np.argsort(p, kind="stable")
        keep = np.zeros(y.size, bool)
        keep[order[:min(min_kept, y.size)]] = True
        keep |= p < threshold
        sums.append((-np.log(p) * w[y])[keep].sum())
        norms.append(w[y][keep].sum())
    return np.array(sums), np.array(norms)


@pytest.mark.parametrize("threshold, min_kept, weights", [
    (0.3, 0, None), (0.3, 20, None), (0.05, 10, [1.0, 2.0, 0.5, 3.0]), (0.3, 1000, None)])
def test_ohem_matches_numpy(threshold, min_kept, weights):
    logits, labels = batch(4)
    want_sum, want_norm = ohem_numpy(logits, labels, threshold, min_kept, weights)
    got_sum, got_norm = losses.cross_entropy_per_image(logits, labels, 255, weights, ohem_threshold=threshold,
                                                       ohem_min_kept=min_kept)
    np.testing.assert_allclose(got_sum.numpy(), want_sum, rtol=1e-5)
    np.testing.assert_allclose(got_norm.numpy(), want_norm, rtol=1e-6)
    # Not vacuous: fewer than all valid pixels kept, unless min_kept asks for more than an image has.
    everything = ohem_numpy(logits, labels, 1.1, 0, weights)[1]
    if min_kept >= 42:
        np.testing.assert_array_equal(want_norm, everything)
    else:
        assert want_norm.sum() < 0.8 * everything.sum()


def test_per_image_cross_entropy_sums_to_pixel_loss_sum():
    logits, labels = batch(5)
    for kw in ({}, {"class_weights": [1.0, 2.0, 0.5, 3.0]}, {"top_k": 0.3},
               {"class_weights": [1.0, 2.0, 0.5, 3.0], "top_k": 0.3}):
        s, n = losses.cross_entropy_per_image(logits, labels, 255, **kw)
        s0, n0 = losses.pixel_loss_sum(logits, labels, 255, **kw)
        np.testing.assert_allclose(float(tf.reduce_sum(s)), float(s0), rtol=1e-6)
        np.testing.assert_allclose(float(tf.reduce_sum(n)), float(n0), rtol=1e-6)


def test_terms_objective_by_hand():
    """(w_ce * sum ce + sum_t w_t sum_i n_i L_t,i) / sum_i n_i with n_i the image's cross-entropy normalizer."""
    logits, labels = batch(6)
    weights = [1.0, 2.0, 0.5, 3.0]
    terms = {"cross_entropy": 1.0, "lovasz": 0.5, "dice": 0.25}
    total, norm = losses.objective_sum(logits, labels, 255, weights, terms=terms)
    ce, n = ohem_numpy(logits, labels, 1.1, 0, weights)  # threshold above 1: every valid pixel
    lov, _ = lovasz_numpy(logits, labels)
    dice, _ = dice_numpy(logits, labels)
    want = (ce.sum() + 0.5 * (n * lov).sum() + 0.25 * (n * dice).sum()) / n.sum()
    np.testing.assert_allclose(float(total / norm), want, rtol=1e-5)
    # Without a cross_entropy term the images weigh their valid pixels.
    total, norm = losses.objective_sum(logits, labels, 255, terms={"lovasz": 1.0})
    valid = (labels != 255).reshape(3, -1).sum(axis=1)
    np.testing.assert_allclose(float(total / norm), (valid * lov).sum() / valid.sum(), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("loss", [
    {"terms": [{"type": "cross_entropy", "weight": 1.0}, {"type": "lovasz", "weight": 0.5},
               {"type": "dice", "weight": 0.5}], "class_weights": [1.0, 2.0, 0.5]},
    {"ohem_threshold": 0.4, "ohem_min_kept": 30},
])
def test_trainer_one_tower_equals_four(tmp_path, loss):
    """The trainer's loss and gradient on 1 and 4 towers (per-image terms: the definition promises it),
    and its loss is objective_sum's on the whole batch (not per tower)."""
    cfg = tiny_config(tmp_path, model={"sync_batchnorm": True}, loss=loss)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(4, 32, 32, 3)).astype(np.float32)
    labels = rng.integers(0, 3, size=(4, 32, 32)).astype(np.uint8)
    labels[0, :20] = 255  # towers with very different valid counts: the weights n_i differ
    labels[3, :, :5] = 255
    got = {}
    for n in (1, 4):
        trainer = TrainStep(TrainState(cfg, replicas.make_strategy(replicas.Devices(DEVICES[:n], "CPU", ""))))
        dist = trainer.state.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors((images, labels)))
        got[n] = trainer.probe(next(iter(dist)))
        if n == 1:
            logits = trainer.state.model(images, training=True)
            total, norm = losses.objective_sum(logits, labels, 255, cfg.loss.class_weights, 1.0,
                                               cfg.loss.term_weights(), cfg.loss.ohem_threshold,
                                               cfg.loss.ohem_min_kept)
            np.testing.assert_allclose(float(got[1].loss), float(total / norm), rtol=1e-5)
    np.testing.assert_allclose(float(got[4].loss), float(got[1].loss), rtol=1e-5)
    for a, b in zip(got[1].gradients, got[4].gradients):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-3, atol=2e-6)


@pytest.mark.parametrize("loss, where, expected", [
    ({"type": "lovasz", "terms": [{"type": "dice", "weight": 1.0}]}, "loss.type", "loss.type or loss.terms"),
    ({"terms": [{"type": "focal", "weight": 1.0}]}, "loss.terms", "type one of cross_entropy, lovasz, dice"),
    ({"terms": [{"type": "dice", "weight": 0}]}, "loss.terms", "a weight > 0 for dice"),
    ({"terms": [{"type": "dice", "weight": 1}, {"type": "dice", "weight": 2}]}, "loss.terms", "at most once"),
    ({"terms": [{"type": "dice"}]}, "loss.terms", "the keys type and weight"),
    ({"type": "dice", "class_weights": [1, 2, 3]}, "loss.class_weights", "a cross_entropy term"),
    ({"type": "lovasz", "ohem_threshold": 0.7}, "loss.ohem_threshold", "a cross_entropy term"),
    ({"ohem_threshold": 0.7, "top_k_percent_pixels": 0.5}, "loss.ohem_threshold", "one mining at a time"),
    ({"ohem_threshold": 1.0}, "loss.ohem_threshold", "a number in (0, 1)"),
    ({"ohem_min_kept": -1}, "loss.ohem_min_kept", "a number >= 0"),
])
def test_loss_config_errors(tmp_path, loss, where, expected):
    from seg_train.config import ConfigError
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, loss=loss)
    assert e.value.where == where and expected in e.value.expected, str(e.value)


@pytest.mark.slow
def test_xla_compiles_the_new_losses():
    """train.jit_compile: the per-image sorts need a static pixel count inside an XLA-compiled tower."""
    logits, labels = batch(7)
    kw = dict(class_weights=[1.0, 2.0, 0.5, 3.0], terms={"cross_entropy": 1.0, "lovasz": 0.5, "dice": 0.5},
              ohem_threshold=0.4, ohem_min_kept=5)
    fn = tf.function(lambda x, y: losses.objective_sum(x, y, 255, **kw), jit_compile=True)
    got = fn(tf.constant(logits), tf.constant(labels))
    want = losses.objective_sum(logits, labels, 255, **kw)
    np.testing.assert_allclose([float(g) for g in got], [float(w) for w in want], rtol=1e-5)
