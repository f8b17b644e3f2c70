"""The per-sample masks beyond the defaults, through the trainer's own step (models/stochastic.py): another
run seed draws other masks, the micro-batches of one step (train.accumulate_steps: 2) draw their own masks,
and with accumulation 2 towers still draw exactly 1 tower's masks and end at its weights.

The draws are recorded where the layers take them (stochastic._row_uniform, wrapped to copy each call's values
out of the graph) and compared with the draws of the reader's numbering of the samples, k = (step * K + m) * B +
tower * b + i (ImageReader.train_order), made here with the layer outside any step. A SegFormer head on the tiny
backbone: its channel dropout is the only stochastic layer, at 0.5.

Wrong answers these catch: the run seed left out of the draw key (every run draws seed 0's masks: the tests
at seed 0 pass), the micro-batch index left out of the sample counter (the micro-batches of a step share their
masks; 1 tower and N towers still agree, as both reuse them alike).
"""

import numpy as np
import pytest
import tensorflow as tf

from seg_train.models import stochastic
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import strategy, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: takes seconds per test (keras-hub builds, traced steps)

B, SIZE, RATE, CHANNELS, LAYER = 4, 32, 0.5, 8, "segformer_dropout"
_ROW_UNIFORM = stochastic._row_uniform  # the layers' own draw, kept from the spy below


def _config(tmp_path, seed=0, accumulate=1, sync=False):
    return tiny_config(tmp_path, seed=seed, data={"batch_size": B, "crop_size": [SIZE, SIZE]},
                       model={"backbone": "tiny", "head": "segformer", "segformer_channels": CHANNELS,
                              "head_dropout": RATE, "sync_batchnorm": sync},
                       train={"optimizer": "sgd", "learning_rate": 0.05, "accumulate_steps": accumulate})


@pytest.fixture
def draws(monkeypatch):
    """Every row draw of the dropout layer as the step runs: a list of arrays [rows, 1, 1, CHANNELS]."""
    real, seen = _ROW_UNIFORM, []

    def spy(row_shape, name):
        u = real(row_shape, name)
        if u is None or name != LAYER:
            return u

        def record(t):
            seen.append(t.numpy())
            return t

        out = tf.py_function(record, [u], u.dtype)
        out.set_shape(u.shape)
        return out

    monkeypatch.setattr(stochastic, "_row_uniform", spy)
    return seen


def _batch(rows, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, SIZE, SIZE, 3)).astype(np.float32),
            rng.integers(0, 3, (rows, SIZE, SIZE)).astype(np.uint8))


def _run(cfg, towers, images, labels, steps=1):
    trainer = TrainStep(TrainState(cfg, strategy(towers)))
    batch = next(iter(trainer.state.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((images, labels)))))
    return trainer, [float(trainer(batch).loss) for _ in range(steps)]


def _expected(ids, seed):
    """The layer's draws for these sample counters, outside any step."""
    with stochastic.per_sample(tf.constant(ids, tf.int64), seed):
        return _ROW_UNIFORM([1, 1, CHANNELS], LAYER).numpy()


def test_another_seed_draws_other_masks(tmp_path, draws):
    images, labels = _batch(B)
    got = {}
    for seed in (0, 1):
        draws.clear()
        _run(_config(tmp_path / f"s{seed}", seed=seed), 1, images, labels)
        assert len(draws) == 1
        got[seed] = draws[0]
        np.testing.assert_array_equal(got[seed], _expected(range(B), seed))
    kept = {seed: got[seed] < 1 - RATE for seed in got}
    assert (kept[0] != kept[1]).any(axis=(1, 2, 3)).all()  # every sample's channels differ between the seeds


def test_micro_batches_of_a_step_draw_their_own_masks(tmp_path, draws):
    images, labels = _batch(2 * B)
    _run(_config(tmp_path, seed=3, accumulate=2), 1, images, labels)
    assert len(draws) == 2
    # Step 0, micro-batch m: counters m * B .. m * B + B - 1 (the loop's calls may record in either order).
    want = [_expected(range(m * B, (m + 1) * B), 3) for m in range(2)]
    assert sorted(d.tobytes() for d in draws) == sorted(w.tobytes() for w in want)
    assert ((want[0] < 1 - RATE) != (want[1] < 1 - RATE)).any(axis=(1, 2, 3)).all()


def test_two_towers_with_accumulation_are_one_tower(tmp_path, draws):
    """Two steps of 2 micro-batches: 1 tower (Keras' BN) and 2 towers (synchronized BN) on the same samples.
    Tower r's micro-batch m holds samples m * B + r * b .. (b = B / 2): the 2-tower batch is the 1-tower
    batch's rows in that order. The same draws per sample, the same losses and weights."""
    images, labels = _batch(2 * B)
    one, losses_1 = _run(_config(tmp_path / "one", seed=2, accumulate=2), 1, images, labels, steps=2)
    draws_1 = sorted(map(bytes, np.concatenate(draws)))
    draws.clear()
    order = [0, 1, 4, 5, 2, 3, 6, 7]  # tower 0: micro 0 (samples 0, 1), micro 1 (4, 5); tower 1: 2, 3 and 6, 7
    two, losses_2 = _run(_config(tmp_path / "two", seed=2, accumulate=2, sync=True), 2, images[order], labels[order],
                         steps=2)
    assert len(draws) == 8 and all(d.shape[0] == B // 2 for d in draws)
    assert sorted(map(bytes, np.concatenate(draws))) == draws_1
    every = np.concatenate([_expected(range(s * 2 * B, (s + 1) * 2 * B), 2) for s in range(2)])
    assert sorted(map(bytes, every)) == draws_1
    np.testing.assert_allclose(losses_1, losses_2, rtol=1e-5)
    for a, b in zip(one.state.model.weights, two.state.model.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, err_msg=a.path)


