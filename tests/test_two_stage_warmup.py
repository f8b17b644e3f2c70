"""EoMT's two-stage warmup (train.backbone_warmup_steps): the head warms up alone while the backbone's learning
rate is 0, then the backbone warms up, and each part's poly runs over the steps left after its own warmup.

The reference is the EoMT repository's TwoStageWarmupPolySchedule (training/two_stage_warmup_poly_schedule.py),
stepped under PyTorch with one backbone and one head parameter group; the rates it set before each optimizer
step are written below (seg-train's update k is its scheduler step k), as scripts/reference_two_stage_warmup.py
prints them.

Wrong answers these fail for: the backbone warming up with the head (no first stage); the poly over the whole run
instead of the steps after each warmup; warmup ramps one step early (seg-train's single-stage (k + 1) / w) or
reaching the base rate a step late; the key read but dropped before the step (the run's backbone moves in the
first stage, its TensorBoard rates are the single-stage schedule's); a backbone rate that never reaches the
update (both parts at the head's rate).
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import keras
import numpy as np
import pytest
import tensorflow as tf
import yaml

from seg_train import cli, models
from seg_train.config import ConfigError, from_dict
from seg_train.run.schedule import lr_pair_at
from seg_train.run.state import TrainState
from tests.helpers import strategy

# The reference at warmup_steps (2, 2), 7 steps, power 2, base 0.02: (update, head rate, backbone rate).
SMALL = [(0, 0.0, 0.0), (1, 0.01, 0.0), (2, 0.02, 0.0), (3, 0.0128, 0.01), (4, 0.0072, 0.02),
         (5, 0.0032, 0.00888888888888889), (6, 0.0008, 0.0022222222222222227)]
# The reference at its own warmup (500, 1000), power 0.9, base 1e-4, over its Cityscapes run (19902 steps).
CITYSCAPES = [(0, 0.0, 0.0), (1, 2.0e-07, 0.0), (250, 5e-05, 0.0), (499, 9.98e-05, 0.0), (500, 1e-4, 0.0),
              (501, 9.999536129100407e-05, 1.0e-07), (1000, 9.76776343085261e-05, 5e-05),
              (1499, 9.535377985182302e-05, 9.99e-05), (1500, 9.534911655589108e-05, 1e-4),
              (1501, 9.534445323461782e-05, 9.999510921396896e-05),
              (10000, 5.458694376912093e-05, 5.7249553788076825e-05),
              (19901, 1.3833693518354238e-08, 1.4508465330405384e-08)]


@pytest.mark.parametrize("table, args", [(SMALL, (0.02, 7, 2.0, 2, 2)), (CITYSCAPES, (1e-4, 19902, 0.9, 500, 1000))],
                         ids=["small", "cityscapes"])
def test_rates_are_the_references(table, args):
    base, total, power, w1, w2 = args
    for step, head, backbone in table:
        got = lr_pair_at(step, base, total, power, w1, w2)
        np.testing.assert_allclose(got, (head, backbone), rtol=1e-9, atol=1e-15, err_msg=f"update {step}")


def test_without_it_both_parts_follow_the_one_schedule():
    """Keras' PolynomialDecay after a (k + 1) / w warmup, for head and backbone alike."""
    poly = keras.optimizers.schedules.PolynomialDecay(0.02, 7, end_learning_rate=0.0, power=2.0)
    for step in range(7):
        want = 0.02 * (step + 1) / 2 if step < 2 else float(poly(step))
        np.testing.assert_allclose(lr_pair_at(step, 0.02, 7, 2.0, 2, 0), (want, want), rtol=1e-6)


@pytest.mark.parametrize("train, model, key", [
    ({"warmup_steps": 4, "backbone_warmup_steps": 3}, {}, "train.backbone_warmup_steps"),  # 4 + 3 >= 7 steps
    ({"backbone_warmup_steps": -1}, {}, "train.backbone_warmup_steps"),
    ({"warmup_steps": 1, "backbone_warmup_steps": 2}, {"freeze_backbone": True}, "train.backbone_warmup_steps"),
])
def test_refusals_name_the_key(train, model, key):
    raw = {"data": {"root": "data", "num_classes": 3}, "model": {"backbone": "tiny", **model},
           "train": {"num_steps": 7, **train}}
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    assert key in str(e.value)


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_root):
    """seg-train on 2 towers, the SMALL table's schedule, a checkpoint after every step."""
    tmp = tmp_path_factory.mktemp("two_stage")
    raw = {"seed": 5, "run_dir": "run",
           "data": {"root": str(demo_root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                    "num_parallel_calls": 2, "val_split": "none"},
           "model": {"backbone": "tiny"},
           "train": {"num_steps": 7, "learning_rate": 0.02, "lr_power": 2.0, "warmup_steps": 2,
                     "backbone_warmup_steps": 2, "checkpoint_every": 1, "keep_checkpoints": 10, "summary_every": 1,
                     "image_summary_every": 0},
           "eval": {"bn_reestimate_batches": 0}}
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
    out = io.StringIO()
    with redirect_stderr(out), redirect_stdout(out):
        rc = cli.train_main(["--config", str(tmp / "cfg.yaml"), "--gpus", "2"])
    assert rc == 0, out.getvalue()[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp / "run"), size_guidance={"tensors": 0})
    acc.Reload()
    return {"tmp": tmp, "raw": raw, "acc": acc}


def _events(acc, tag) -> dict[int, float]:
    return {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}


@pytest.mark.slow
def test_run_logs_the_references_rates(run):
    """Update k is logged at step k + 1 (TensorBoard's own reader): learning_rate the head's, learning_rate/backbone
    the backbone's, both the reference's."""
    head, backbone = _events(run["acc"], "learning_rate"), _events(run["acc"], "learning_rate/backbone")
    assert sorted(head) == sorted(backbone) == list(range(1, 8))
    np.testing.assert_allclose([head[k + 1] for k, _, _ in SMALL], [h for _, h, _ in SMALL], rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose([backbone[k + 1] for k, _, _ in SMALL], [b for _, _, b in SMALL], rtol=1e-6,
                               atol=1e-12)


def _parts(run, step=None):
    """(backbone, head) trainable weights: of checkpoint `step`, or of the seeded build (None)."""
    cfg = from_dict(run["raw"], run["tmp"])
    keras.utils.set_random_seed(0)
    state = TrainState(cfg, strategy(1))
    if step is not None:
        assert state.restore_weights(str(run["tmp"] / "run" / "checkpoints" / f"ckpt-{step}")) == step
    mask = models.backbone_variable_mask(state.model)
    weights = [v.numpy().tobytes() for v in state.model.trainable_variables]
    return ([w for w, b in zip(weights, mask) if b], [w for w, b in zip(weights, mask) if not b])


@pytest.mark.slow
def test_run_moves_each_part_only_from_its_first_nonzero_rate(run):
    """Adam at learning rate 0 leaves a weight bitwise where it was: the head stays the seeded build through update
    0 and moves in update 1; the backbone stays the seeded build through updates 0-2 and moves in update 3."""
    built = _parts(run)
    after = {step: _parts(run, step) for step in (1, 2, 3, 4)}
    assert after[1][1] == built[1] and after[2][1] != built[1]
    assert after[3][0] == built[0] and after[4][0] != built[0]
