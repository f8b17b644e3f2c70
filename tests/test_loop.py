"""loop.StepLoop, the step loop seg-train and seg-bench share: the order of dispatches and reads, the
learning rate fed per step (against Keras' PolynomialDecay), seg-bench going through it, and the
warm-up figure (by hand)."""

import time

import keras
import pytest

from seg_train import cli
from seg_train.bench import train_runner
from seg_train.data import synthetic
from seg_train.parallel import replicas
from seg_train.train import loop
from tests.helpers import open_reader, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    root = synthetic.generate(tmp / "data", num_train=8, num_val=2, size=(40, 48), num_classes=3)
    cfg = tiny_config(tmp, root, train={"num_steps": 4, "learning_rate": 0.01, "summary_every": 1,
                                        "checkpoint_every": 2, "image_summary_every": 2})
    reader = open_reader(cfg, cfg.data.train_split)
    r = train_runner.TrainRunner("gpus=1", cfg, replicas.Devices(["/device:CPU:0"], "CPU", ""), reader)
    yield r
    r.close()


class Recorder:
    """Wraps the real TrainStep (called per step; its state gives the learning rate) and the real host
    side, logging the calls."""

    def __init__(self, train_step, host):
        self.train_step, self.host, self.events, self.fed = train_step, host, [], []
        self.state = train_step.state
        self.called, self.ended = [], {}  # when each train_step call began; when the loop says each step ended

    def __call__(self, batch, lr, stop, want_images):
        self.called.append(time.perf_counter())
        out = self.train_step(batch, lr, stop, want_images)
        self.fed.append((lr, want_images))
        self.events.append(("dispatch", len(self.fed), id(out)))
        return out

    def finish(self, pending, ended):
        self.events.append(("finish", pending[0], id(pending[1])))
        self.ended[pending[0]] = ended
        return self.host.finish(pending, ended)


@pytest.fixture(scope="module")
def recorded(runner):
    rec = Recorder(runner.train_step, runner.host)
    steps = loop.StepLoop(rec, runner.batches, 0, rec, image_summary_every=2)
    for _ in range(3):
        steps.dispatch()
    steps.drain()
    for _ in range(3):  # past train.num_steps (4): the schedule has ended
        steps.dispatch()
    steps.drain()
    return rec


def test_step_k_is_read_only_after_step_k_plus_1_was_dispatched(recorded):
    kinds = [(kind, step) for kind, step, _ in recorded.events]
    assert kinds == [("dispatch", 1), ("dispatch", 2), ("finish", 1), ("dispatch", 3), ("finish", 2),
                     ("finish", 3),  # drained
                     ("dispatch", 4), ("dispatch", 5), ("finish", 4), ("dispatch", 6), ("finish", 5), ("finish", 6)]
    # Each step's own outputs are the ones read for it.
    outs = {step: oid for kind, step, oid in recorded.events if kind == "dispatch"}
    assert all(outs[step] == oid for kind, step, oid in recorded.events if kind == "finish")
    # On CPU train_step runs the whole step: step k ended before step k+1 was called, although its
    # outputs were read after (the first-step log line and the warm-up figure use this end).
    assert all(recorded.ended[k] < recorded.called[k] for k in (1, 2, 4, 5))


def test_learning_rate_per_step_is_the_schedule_at_that_step(recorded):
    keras_poly = keras.optimizers.schedules.PolynomialDecay(0.01, 4, end_learning_rate=0.0, power=0.9)
    expected = [float(keras_poly(s)) for s in range(6)]  # updates 0..5; 0 from update 4 on
    # (head, backbone): the same without train.backbone_warmup_steps.
    assert [lr[0] for lr, _ in recorded.fed] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert [lr[1] for lr, _ in recorded.fed] == [lr[0] for lr, _ in recorded.fed]
    # Images on the first step and every image_summary_every (2) steps: updates 0, 1, 3, 5.
    assert [w for _, w in recorded.fed] == [True, True, False, True, False, True]


def test_seg_bench_runs_the_same_loop_and_host_work_as_seg_train(runner, monkeypatch):
    calls = []
    real = loop.StepLoop.dispatch

    def counting(self):
        calls.append(self)
        return real(self)

    monkeypatch.setattr(loop.StepLoop, "dispatch", counting)
    losses = len(runner.losses)
    runner.step()
    runner.drain()
    assert calls == [runner.steps]
    assert isinstance(runner.host, loop.HostSide)
    assert len(runner.losses) == losses + 1  # seg-train's HostSide read the step


def test_seg_train_dispatches_every_step_through_the_same_loop(tmp_path, monkeypatch):
    # The other half of "the same loop": seg-train's run (in-process, 3 steps) dispatches each of its
    # steps through loop.StepLoop, one loop object for the run, and HostSide reads each of them.
    dispatched, finished = [], []
    real_dispatch, real_finish = loop.StepLoop.dispatch, loop.HostSide.finish

    def dispatch(self):
        dispatched.append(self)
        return real_dispatch(self)

    def finish(self, pending, ended=None):
        finished.append(pending[0])
        return real_finish(self, pending, ended)

    monkeypatch.setattr(loop.StepLoop, "dispatch", dispatch)
    monkeypatch.setattr(loop.HostSide, "finish", finish)
    root = synthetic.generate(tmp_path / "data", num_train=8, num_val=2, size=(40, 48), num_classes=3)
    tiny_config(tmp_path, root, train={"num_steps": 3, "checkpoint_every": 3, "image_summary_every": 0})
    monkeypatch.chdir(tmp_path)
    assert cli.train_main(["--config", str(tmp_path / "config.yaml"), "--gpus", "1"]) == 0
    assert len(dispatched) == 3 and all(d is dispatched[0] for d in dispatched)
    assert sorted(finished) == [1, 2, 3]


def test_warmup_by_hand():
    times = [5.0, 2.0, 1.2, 1.05, 1.0, 0.98, 1.02, 1.0]
    # steady = median of the second half (1.0, 0.98, 1.02, 1.0) = 1.0; 1.2 > 1.1, 1.05 <= 1.1
    assert train_runner.warmup(times) == 3
    assert train_runner.warmup(times, steady=1.1) == 2  # 1.2 <= 1.21
    assert train_runner.warmup(times, steady=1.0, tolerance=0.2) == 2
    assert train_runner.warmup([3.0, 3.0, 3.0], steady=1.0) == 3  # never steady
    assert train_runner.warmup([]) == 0
