"""The train step's smaller parts held to outside references: hard-pixel mining alone (numpy by
hand), each tower's gradient norm (a GradientTape on the Keras model and that tower's slice),
accumulation with synchronized BN over towers, and the veto of non-finite BN statistics.

Each test fails for a named wrong answer: mining switched off in the step (top_k 1.0), a tower norm
taken after the all-reduce / on another tower's slice / over the tower's own pixels, micro-batches
paired differently on 1 and 2 towers, a non-finite BN statistics update applied.
"""

import numpy as np
import pytest
import tensorflow as tf

from seg_train.data import synthetic
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.loop import HostSide, NonFiniteError
from seg_train.train.step import TrainStep
from tests.helpers import open_reader, random_batch, tiny_config, train_batches

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def strategy(n):
    return replicas.make_strategy(replicas.Devices(DEVICES[:n], "CPU", ""))


def distribute(trainer, images, labels):
    dataset = tf.data.Dataset.from_tensors((images, labels))
    return next(iter(trainer.state.strategy.experimental_distribute_dataset(dataset)))


def batch_with_ignored_pixels():
    """4 images with 384, 1019, 864 and 1002 valid pixels: 0.3 of them are 115.2, 305.7, 259.2 and
    300.6, so rounding (115, 306, 259, 301) and truncation (115, 305, 259, 300) keep different counts."""
    images, labels = random_batch(ignore_rows=[20, 0, 5, 0])
    labels[1, 0, :5] = 255
    labels[3, 0, :22] = 255
    return images, labels


def pixel_ce64(logits, labels):
    """Softmax cross-entropy per pixel, float64 numpy; ignored pixels get NaN."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    safe = np.where(labels == 255, 0, labels).astype(np.int64)
    ce = -np.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    return np.where(labels == 255, np.nan, ce)


def ce_sum_tf(logits, labels):
    """Softmax cross-entropy summed over the valid pixels, by hand (not losses.py)."""
    valid = labels != 255
    logp = tf.nn.log_softmax(tf.cast(logits, tf.float32), axis=-1)
    picked = tf.gather(logp, np.where(valid, labels, 0).astype(np.int32), batch_dims=3)
    return -tf.reduce_sum(tf.where(valid, picked, 0.0))


# ---- 1. hard-pixel mining alone --------------------------------------------------------------------------
def test_top_k_alone_is_the_numpy_loss_on_1_and_4_towers(tmp_path):
    """loss.top_k_percent_pixels 0.3 without class weights: per image the round(0.3 * valid) hardest
    valid pixels, summed over the batch / the number kept. A step that ignores the option (top_k 1.0,
    the plain mean) or truncates the counts gives another number."""
    cfg = tiny_config(tmp_path, model={"sync_batchnorm": True}, loss={"top_k_percent_pixels": 0.3})
    images, labels = batch_with_ignored_pixels()
    got = {}
    for n in (1, 4):
        trainer = TrainStep(TrainState(cfg, strategy(n)))
        got[n] = float(trainer.probe(distribute(trainer, images, labels)).loss)
        if n == 1:
            ce = pixel_ce64(trainer.state.model(images, training=True), labels)
    kept_sum, kept = 0.0, 0
    for c in ce.reshape(4, -1):
        c = np.sort(c[~np.isnan(c)])[::-1]
        k = int(np.floor(0.3 * c.size + 0.5))
        kept_sum, kept = kept_sum + c[:k].sum(), kept + k
    expected = kept_sum / kept
    assert kept == 115 + 306 + 259 + 301
    # The plain mean is far below the mined loss: a step without mining fails by far.
    assert np.nanmean(ce) < 0.8 * expected
    np.testing.assert_allclose(got[1], expected, rtol=1e-5)
    np.testing.assert_allclose(got[4], expected, rtol=1e-5)


# ---- 2 and 4: four towers with per-tower BN, shared --------------------------------------------------------
@pytest.fixture(scope="module")
def local_bn(tmp_path_factory):
    """A 4-tower trainer with per-tower BN, and a 1-tower one whose Keras model serves as the reference."""
    cfg = tiny_config(tmp_path_factory.mktemp("local"), model={"sync_batchnorm": False, "bn_momentum": 0.5})
    return cfg, TrainStep(TrainState(cfg, strategy(4))), TrainStep(TrainState(cfg, strategy(1)))


def test_tower_grad_norm_is_the_tape_norm_of_each_towers_slice(local_bn):
    """tower_grad_norm[i] = |d(tower i's loss sum / the step's valid pixels)/dw|: with per-tower BN
    tower i's function is the Keras model on its slice alone. A norm of the reduced gradient (all
    towers equal), of another tower's slice, or over the tower's own pixel count fails."""
    cfg, four, ref = local_bn
    images, labels = batch_with_ignored_pixels()
    ref.state.model.set_weights(four.state.model.get_weights())
    total = float(np.sum(labels != 255))
    expected = []
    for i in range(4):
        with tf.GradientTape() as tape:
            logits = ref.state.model(images[i:i + 1], training=True)
            loss = ce_sum_tf(logits, labels[i:i + 1]) / total
        grads = tape.gradient(loss, ref.state.model.trainable_variables)
        expected.append(float(tf.linalg.global_norm(grads)))
    out = four(distribute(four, images, labels))
    assert bool(out.applied)
    # The slices really differ (else a wrong slice could pass).
    assert min(abs(a - b) for j, a in enumerate(expected) for b in expected[j + 1:]) > 0.02 * max(expected)
    np.testing.assert_allclose(out.tower_grad_norm.numpy(), expected, rtol=2e-4)


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_one_towers_grad_norm_is_the_tape_norm(tmp_path, optimizer):
    """One tower: tower_grad_norm = |d(the batch's loss sum / its valid pixels)/dw|, TensorFlow's tape on the
    Keras model. With AdamW (no L2 term in the loss) the step reads it off the update's global norm instead of a
    pass of its own over the gradients; with Adam's L2 term the tower sums its own squares. Fails for a tower
    norm left at the placeholder 0, or one taken off a gradient with the L2 term in it."""
    cfg = tiny_config(tmp_path, train={"optimizer": optimizer}, data={"batch_size": 4},
                      model={"weight_decay": 0.0 if optimizer == "adamw" else 0.1})
    trainer = TrainStep(TrainState(cfg, strategy(1)))
    images, labels = batch_with_ignored_pixels()
    total = float(np.sum(labels != 255))
    model = trainer.state.model
    with tf.GradientTape() as tape:
        loss = ce_sum_tf(model(images, training=True), labels) / total
    expected = float(tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables)))
    out = trainer(distribute(trainer, images, labels))
    assert bool(out.applied)
    np.testing.assert_allclose(out.tower_grad_norm.numpy(), [expected], rtol=2e-4)
    if optimizer == "adamw":
        np.testing.assert_allclose(float(out.global_norm), expected, rtol=2e-4)
    else:  # the L2 term is in the update's gradient, not in the tower's
        assert cfg.model.weight_decay and float(out.global_norm) > expected * (1 + 1e-3)


def replica_values(variables):
    """Every tower's copy of each variable (a poisoned tower differs from the others)."""
    out = []
    for v in variables:
        value = getattr(v, "value", v)
        out.append([c.numpy() for c in getattr(value, "values", (value,))])
    return out


def test_step_with_non_finite_bn_statistics_is_not_applied(local_bn):
    """Tower 2's copy of a BN moving variance at inf: its batch statistics, loss and gradient are
    finite, its moving update (momentum * inf + ...) is not. Applying the step would put inf into
    every tower's statistics; the step must leave everything as it was and name tower 2."""
    cfg, four, _ = local_bn
    images, labels = batch_with_ignored_pixels()
    bn = four.state.bn_layers[0]
    assert bn.trainable and not bn.synchronized
    poisoned = bn.moving_variance.value.values[2]
    saved = poisoned.numpy()
    poisoned.assign(np.full(saved.shape, np.inf, np.float32))
    try:
        variables = list(four.state.model.weights) + list(four.state.optimizer.variables)
        before = replica_values(variables)
        iterations, step = int(four.state.optimizer.iterations.numpy()), int(four.state.step.numpy())
        out = four(distribute(four, images, labels))
        after = replica_values(variables)
        assert not bool(out.applied)
        assert np.isfinite(float(out.loss)) and np.isfinite(float(out.global_norm))
        assert out.loss_grad_finite.numpy().tolist() == [True] * 4
        assert out.bn_finite.numpy().tolist() == [True, True, False, True]
        assert out.finite.numpy().tolist() == [True, True, False, True]
        for v, a, b in zip(variables, before, after):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y, err_msg=v.path)
        assert int(four.state.optimizer.iterations.numpy()) == iterations
        assert int(four.state.step.numpy()) == step + 1
        # The host loop (train.py) with train.on_nan: stop.
        assert cfg.train.on_nan == "stop"
        loop = HostSide(cfg, four.state, None, None, 4, None)
        with pytest.raises(NonFiniteError, match=r"^non-finite BN statistics at step 7 on tower\(s\) \[2\] "):
            loop.finish((7, out, None, (0.01, 0.01), False))
    finally:
        poisoned.assign(saved)


# ---- 3. accumulation with synchronized BN ----------------------------------------------------------------
@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=16, num_val=2, size=(40, 48),
                              num_classes=3)


def run(cfg, towers, steps):
    """`steps` updates through the real reader stream, as train.py feeds them."""
    trainer = TrainStep(TrainState(cfg, strategy(towers)))
    it = train_batches(trainer.state, open_reader(cfg, cfg.data.train_split))
    for _ in range(steps):
        trainer(next(it))
    return trainer


def test_accumulation_with_sync_bn_is_tower_invariant(tmp_path, data_root):
    """2 micro-batches of global batch 4 with synchronized BN: 1 tower (the tf.while_loop path) and
    2 towers (micro-batches unrolled, BN all-reduced per micro-batch) normalise micro-batch m over
    the same 4 images, so weights, momentum slots and BN statistics agree after 2 SGD steps. A
    layout giving tower r micro-batch m of other samples, or a skipped micro-batch, fails.

    A small learning rate: at 0.1 the first step lands where BN over 4 small images is so
    ill-conditioned that a 1e-6 relative change of the weights moves the next update by 2e-4."""
    common = dict(data_root=data_root, data={"batch_size": 4},
                  model={"sync_batchnorm": True, "bn_momentum": 0.5, "weight_decay": 0.05},
                  train={"optimizer": "sgd", "learning_rate": 0.02, "accumulate_steps": 2})
    one = run(tiny_config(tmp_path / "one", **common), 1, 2)
    two = run(tiny_config(tmp_path / "two", **common), 2, 2)
    assert two.state.per_tower_trace and not one.state.per_tower_trace
    fresh = TrainStep(TrainState(tiny_config(tmp_path / "fresh", **common), strategy(1)))
    variables = list(zip(one.state.model.weights, two.state.model.weights, fresh.state.model.weights))
    slots = list(zip(one.state.optimizer.variables, two.state.optimizer.variables))
    assert len(variables) > 50 and len(slots) > 20
    for a, b, _ in variables:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=a.path)
    for a, b in slots:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=a.path)
    # It trained: weights and BN statistics moved by far more than the tolerance.
    moved = {kind: max(float(np.abs(np.asarray(a) - np.asarray(c)).max()) for a, _, c in variables
                       if ("moving" in a.path) == (kind == "bn")) for kind in ("bn", "weights")}
    assert moved["bn"] > 1e-2 and moved["weights"] > 1e-3, moved
