"""train.ema_decay: the moving average follows TensorFlow's ExponentialMovingAverage schedule, is
checkpointed (a resumed run continues it exactly), is swapped in for evaluation without disturbing
the run, and is what a checkpoint loaded for evaluation/prediction/export holds."""

import numpy as np
import pytest
import tensorflow as tf

from seg_train.infer.load import load_state
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import random_batch, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def trainer_and_batches(cfg):
    trainer = TrainStep(TrainState(cfg, replicas.make_strategy(replicas.Devices(DEVICES, "CPU", ""))))
    images, labels = random_batch()
    ds = tf.data.Dataset.from_tensors((images, labels)).repeat()
    return trainer, iter(trainer.state.strategy.experimental_distribute_dataset(ds))


def test_ema_schedule_swap_checkpoint_and_load(tmp_path):
    decay = 0.5
    cfg = tiny_config(tmp_path, train={"ema_decay": decay})
    trainer, batches = trainer_and_batches(cfg)
    expected = [v.numpy() for v in trainer.state.variables]
    for t in (1, 2):
        trainer(next(batches))
        d = min(decay, (1 + t) / (10 + t))  # TF's ExponentialMovingAverage with num_updates
        expected = [d * e + (1 - d) * v.numpy() for e, v in zip(expected, trainer.state.variables)]
    for e, got in zip(expected, trainer.state.ema):
        np.testing.assert_allclose(got.numpy(), e, rtol=1e-6, atol=1e-7)
    weights = [v.numpy() for v in trainer.state.variables + trainer.state.non_trainable]
    assert max(float(np.abs(a - b.numpy()).max()) for a, b in zip(expected, trainer.state.variables)) > 1e-4

    # Swapped in for evaluation, then everything back exactly (weights, BN statistics, the marker).
    with trainer.state.averaged_weights():
        for e, v in zip(trainer.state.ema, trainer.state.variables):
            np.testing.assert_array_equal(e.numpy(), v.numpy())
        assert int(trainer.state.bn_stats_step.numpy()) == -1
        for s in trainer.state.non_trainable:
            s.assign(s + 1.0)  # e.g. BN statistics re-estimated for the averaged weights
    for a, v in zip(weights, trainer.state.variables + trainer.state.non_trainable):
        np.testing.assert_array_equal(a, v.numpy())

    # Checkpointed: a resumed trainer continues the average exactly like the one that went on.
    prefix = tf.train.Checkpoint(**trainer.state.checkpoint_objects()).write(str(tmp_path / "ckpt" / "ckpt-2"))
    trainer(next(batches))
    resumed, batches2 = trainer_and_batches(cfg)
    tf.train.Checkpoint(**resumed.state.checkpoint_objects()).read(prefix).assert_existing_objects_matched()
    resumed(next(batches2))
    for a, b in zip(trainer.state.ema + trainer.state.variables, resumed.state.ema + resumed.state.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    # Loaded for seg-eval / seg-predict / seg-export: the model holds the averaged weights and its BN
    # statistics are marked as not matching them (re-estimated before use).
    loaded, _, step = load_state(cfg, replicas.make_strategy(replicas.Devices(DEVICES[:1], "CPU", "")), prefix)
    assert step == 2 and int(loaded.bn_stats_step.numpy()) == -1
    for v, e in zip(loaded.variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=1e-6, atol=1e-7)
