"""The tower math: N towers in one graph equal 1 tower on the same global batch; and the tower pass
traced once for every tower (towers.py) by the train step, evaluation and precise BN.

These fail for the known wrong answers: a double gradient reduction (N times too large a step),
per-tower loss normalisation (towers with many ignored pixels weigh more), weight decay counted N
times, BN moving statistics left to drift apart per tower, a pass traced inside every tower, and
synchronized BN's training pass traced outside the towers.
"""

import numpy as np
import pytest
import tensorflow as tf

from seg_train import models
from seg_train.models import param_groups
from seg_train.objectives import pixel_losses as losses
from seg_train.parallel import towers
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import random_batch, strategy, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

def one_step(cfg, n, images, labels, start=None):
    """One step on n towers; `start` (a list), if given, receives the trainable weights before it."""
    trainer = TrainStep(TrainState(cfg, strategy(n)))
    if start is not None:
        start.extend(v.numpy() for v in trainer.state.model.trainable_weights)
    dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    out = trainer(next(iter(dist)))
    return trainer, out


def test_pixel_cross_entropy_by_hand():
    logits = np.array([[[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]],
                        [[1.0, 3.0, 0.0], [5.0, -5.0, 0.0]]]], np.float32)  # [1, 2, 2, 3]
    labels = np.array([[[0, 255], [1, 2]]], np.uint8)
    total, count = losses.pixel_cross_entropy_sum(logits, labels, 255)

    def ce(row, k):
        return -row[k] + np.log(np.exp(row).sum())

    expected = ce(logits[0, 0, 0], 0) + ce(logits[0, 1, 0], 1) + ce(logits[0, 1, 1], 2)
    assert float(count) == 3.0
    np.testing.assert_allclose(float(total), expected, rtol=1e-6)


def test_sync_bn_4_towers_equal_1_tower(tmp_path):
    # Uneven ignored pixels (tower 0's sample is mostly ignored) and a weight decay large enough to
    # matter: both a per-tower loss normalisation and an N-times weight decay would break equality.
    # SGD with momentum: Adam's first step is lr * g / |g| elementwise, which turns float rounding in
    # near-zero gradient elements into O(lr) differences and would hide the comparison.
    cfg = tiny_config(tmp_path, model={"sync_batchnorm": True, "weight_decay": 0.05},
                      train={"optimizer": "sgd", "learning_rate": 0.5})
    images, labels = random_batch(ignore_rows=[28, 0, 5, 0])
    start = []
    t1, out1 = one_step(cfg, 1, images, labels, start)
    t4, out4 = one_step(cfg, 4, images, labels)
    np.testing.assert_allclose(float(out1.loss), float(out4.loss), rtol=1e-5)
    np.testing.assert_allclose(float(out1.weight_decay), float(out4.weight_decay), rtol=1e-6)
    for a, b in zip(t1.state.model.weights, t4.state.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, err_msg=a.path)
    for a, b in zip(t1.state.optimizer.variables, t4.state.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=a.path)
    # Checkpoint variable names do not depend on the number of towers.
    keys = []
    for t, d in ((t1, "one"), (t4, "four")):
        prefix = tf.train.Checkpoint(**t.state.checkpoint_objects()).write(str(tmp_path / d / "ckpt"))
        keys.append(dict(tf.train.list_variables(prefix)))
    assert keys[0] == keys[1] and len(keys[0]) > 50
    # The step really moved the weights (an equality of two no-ops would prove nothing).
    moved = max(float(np.abs(a - b.numpy()).max()) for a, b in zip(start, t1.state.model.trainable_weights))
    assert moved > 1e-3


def test_weight_decay_counted_once(tmp_path):
    """The reported decay AND its gradient: one plain SGD step (momentum 0) on 4 towers with and without
    weight decay from the same weights on the same batch. The cross-entropy gradient is the same in
    both, so the difference of the updated weights is the decay's own step, -lr * wd * w on every
    conv/dense kernel and 0 elsewhere; a decay counted N times (or once per tower) moves it N-fold."""
    wd, lr = 0.5, 0.1
    images, labels = random_batch()

    def sgd_step(coefficient):
        cfg = tiny_config(tmp_path, model={"weight_decay": coefficient},
                          train={"optimizer": "sgd", "momentum": 0.0, "learning_rate": lr})
        trainer = TrainStep(TrainState(cfg, strategy(4)))
        start = {v.path: v.numpy() for v in trainer.state.model.trainable_weights}
        dist = trainer.state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
        return trainer, start, trainer(next(iter(dist)))

    decayed, start, out = sgd_step(wd)
    plain, plain_start, plain_out = sgd_step(0.0)
    for path, w in start.items():
        np.testing.assert_array_equal(w, plain_start[path])  # same seed: the same weights to start from
    kernels = param_groups.decay_variables(decayed.state.model)
    expected = wd * sum(0.5 * float(np.sum(start[v.path] ** 2)) for v in kernels)
    np.testing.assert_allclose(float(out.weight_decay), expected, rtol=1e-5)
    ce = float(out.loss) - float(out.weight_decay)
    assert 0.0 < ce < 5.0  # total = global cross-entropy mean + the decay, once
    np.testing.assert_allclose(ce, float(plain_out.loss), rtol=1e-5)  # the same cross-entropy in both

    kernel_paths = {v.path for v in kernels}
    assert len(kernel_paths) > 5
    largest = 0.0
    for a, b in zip(decayed.state.model.trainable_weights, plain.state.model.trainable_weights):
        decay_step = a.numpy() - b.numpy()
        want = -lr * wd * start[a.path] if a.path in kernel_paths else np.zeros_like(decay_step)
        np.testing.assert_allclose(decay_step, want, rtol=1e-3, atol=1e-6, err_msg=a.path)
        largest = max(largest, float(np.abs(want).max()))
    assert largest > 1e-3  # large enough that a decay counted 0, 1/N or N times is far outside the tolerance


def test_bn_moving_stats_averaged_across_towers(tmp_path):
    cfg = tiny_config(tmp_path, model={"sync_batchnorm": False, "bn_momentum": 0.5})
    images, labels = random_batch(seed=3)
    images[2:] += 2.0  # towers 2 and 3 see different statistics from towers 0 and 1
    trainer, _ = one_step(cfg, 4, images, labels)

    # Each tower's own update, from the initial weights and its own quarter of the batch.
    ref = TrainStep(TrainState(cfg, strategy(1)))
    bns = models.batchnorm_layers(ref.state.model)
    init = [(b.moving_mean.numpy(), b.moving_variance.numpy()) for b in bns]
    per_tower = []
    for i in range(4):
        for b, (m, v) in zip(bns, init):
            b.moving_mean.assign(m)
            b.moving_variance.assign(v)
        ref.state.model(images[i:i + 1], training=True)
        per_tower.append([(b.moving_mean.numpy(), b.moving_variance.numpy()) for b in bns])

    got = models.batchnorm_layers(trainer.state.model)
    assert len(got) == len(bns) > 5
    spread = 0.0
    for j, layer in enumerate(got):
        for attr, k in (("moving_mean", 0), ("moving_variance", 1)):
            copies = [c.numpy() for c in getattr(layer, attr).value.values]
            assert len(copies) == 4
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0])  # identical on every tower
            expected = np.mean([pt[j][k] for pt in per_tower], axis=0)
            np.testing.assert_allclose(copies[0], expected, rtol=1e-4, atol=1e-5, err_msg=f"{layer.name}.{attr}")
            spread = max(spread, float(np.abs(per_tower[0][j][k] - per_tower[3][j][k]).max()))
    assert spread > 0.1  # the towers' own updates really differed


@pytest.mark.parametrize("n", [2])
def test_global_batches_independent_of_tower_count(tmp_path, n):
    from seg_train.data import synthetic
    from tests.helpers import open_reader
    root = synthetic.generate(tmp_path / "demo", num_train=10, num_val=2, size=(40, 48), num_classes=3)
    cfg = tiny_config(tmp_path, data_root=root, data={"batch_size": 4})
    reader = open_reader(cfg, "train", seed=7)
    one = reader.train_dataset(4, start_step=3, num_replicas=1)
    many = reader.train_dataset(4, start_step=3, num_replicas=n)
    it1, itn = iter(one), iter(many)
    for _ in range(4):  # crosses an epoch boundary (10 samples, 4 per step)
        im1, lb1 = next(it1)
        parts = [next(itn) for _ in range(n)]
        np.testing.assert_array_equal(im1.numpy(), np.concatenate([p[0].numpy() for p in parts]))
        np.testing.assert_array_equal(lb1.numpy(), np.concatenate([p[1].numpy() for p in parts]))
    # And through the strategy: tower i gets the i-th slice of the global batch.
    st = strategy(n)
    dist = iter(st.distribute_datasets_from_function(
        lambda ctx: reader.train_dataset(4, 3, ctx.num_replicas_in_sync, ctx.input_pipeline_id,
                                         ctx.num_input_pipelines)))
    im1, _ = next(iter(one))
    got = np.concatenate([t.numpy() for t in st.experimental_local_results(next(dist)[0])])
    np.testing.assert_array_equal(got, im1.numpy())


# ---- towers.py: the tower pass traced once for every tower ----------------------------------------------
@pytest.fixture
def counted_tower_passes(monkeypatch):
    """Every towers.TowerPass built from now on, with a count of how often its body is traced."""
    built = []
    original = towers.TowerPass.__init__

    def init(self, body, *args, **kwargs):
        def counted(*a, **k):
            counted.traces += 1
            return body(*a, **k)

        counted.traces = 0
        built.append(counted)
        original(self, counted, *args, **kwargs)

    monkeypatch.setattr(towers.TowerPass, "__init__", init)
    return built


@pytest.mark.parametrize("sync", [False, True], ids=["2_towers", "sync_bn_2_towers"])
def test_step_evaluation_and_precise_bn_trace_the_tower_pass_once_for_every_tower(tmp_path, counted_tower_passes,
                                                                                   sync):
    """The train step, evaluation and precise BN each build their pass through towers.TowerPass, and its body
    is traced ONCE for N towers (the graph holds the network once). Synchronized BN in training mode is the
    exception (its all-reduces need each tower's context): then the step's and precise BN's passes are traced
    once per tower, evaluation's (inference mode, no all-reduce) still once. Fails for a pass traced inside
    every tower (an N-fold graph), for synchronized BN traced once (no tower to reduce over), and for any of
    the three tracing the model its own way (no TowerPass built)."""
    from seg_train.data import synthetic
    from seg_train.infer.evaluate import Evaluator
    from tests.helpers import open_reader

    root = synthetic.generate(tmp_path / "demo", num_train=8, num_val=2, size=(40, 40), num_classes=3)
    cfg = tiny_config(tmp_path, data_root=root, model={"sync_batchnorm": sync})
    n = 2
    trainer = TrainStep(TrainState(cfg, strategy(n)))
    images, labels = random_batch()
    trainer(next(iter(trainer.state.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((images, labels))))))
    evaluator = Evaluator(trainer.state)
    evaluator.evaluate(open_reader(cfg, "val"), ["a", "b", "c"], progress=False)
    assert evaluator.reestimate_bn(open_reader(cfg, "train"), 1, progress=False)
    per_training_pass = n if sync else 1
    assert [p.traces for p in counted_tower_passes] == [per_training_pass, 1, per_training_pass]
