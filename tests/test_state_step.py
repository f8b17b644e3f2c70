"""The split of the trainer by job: TrainState (what a run is made of) and TrainStep (the compiled step).

Fails for: an inference state that builds an optimizer (slot variables
for nothing, and a checkpoint it could wrongly write), or a step result that is not the typed
StepResult every reader of a step (train, bench, tests) relies on.
"""

import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.infer.load import load_state
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import StepResult, TrainStep
from tests.helpers import random_batch, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def strategy(n):
    return replicas.make_strategy(replicas.Devices(DEVICES[:n], "CPU", ""))


def test_a_step_returns_the_typed_step_result(tmp_path):
    # That a trace leaves nothing behind for a later one is held by its outputs: the probe's and the
    # step's traces alternate on one TrainStep in tests/test_optimizer_reference.py, whose weights, slots
    # and EMA are held to keras.optimizers and tf.train.ExponentialMovingAverage step after step.
    cfg = tiny_config(tmp_path, train={"optimizer": "adam", "ema_decay": 0.9})
    state = TrainState(cfg, strategy(2))
    step = TrainStep(state)
    images, labels = random_batch()
    dist = state.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    batch = next(iter(dist))
    step.concrete_function(dist.element_spec)  # traces
    out = step(batch, 0.01, want_images=True)
    assert isinstance(out, StepResult) and out._fields == StepResult._fields
    assert bool(out.applied) and int(state.step.numpy()) == 1 and int(state.optimizer.iterations.numpy()) == 1
    assert len(out.preds) == 2 and out.tower_ce.shape == (2,)


def test_inference_state_has_no_optimizer_and_loads_a_training_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path, train={"optimizer": "adam", "ema_decay": 0.9})
    trained = TrainState(cfg, strategy(1))
    step = TrainStep(trained)
    images, labels = random_batch()
    dist = trained.strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))
    step(next(iter(dist)), 0.01)
    prefix = tf.train.Checkpoint(**trained.checkpoint_objects()).write(str(tmp_path / "ckpt" / "ckpt-1"))

    def optimizers():
        gc.collect()
        return sum(isinstance(o, keras.optimizers.Optimizer) for o in gc.get_objects())

    count = optimizers()
    loaded, _, at = load_state(cfg, strategy(1), prefix)
    assert loaded.optimizer is None and at == 1
    assert optimizers() == count  # no optimizer (and so no slot variable) was built anywhere
    names = {v.path for v in loaded.model.weights}
    assert names == {v.path for v in trained.model.weights}
    for v, e in zip(loaded.variables, trained.ema):  # the averaged weights are the model's now
        np.testing.assert_array_equal(v.numpy(), e.numpy())
    with pytest.raises(ValueError, match="without its optimizer"):
        loaded.checkpoint_objects()
    with pytest.raises(ValueError, match="needs a TrainState built with its optimizer"):
        TrainStep(loaded)
