"""RUN_DIR/best/ is the evaluation with the best mIoU (README, seg_train/run/checkpoint.py), not the best pixel
accuracy: two evaluations where the two disagree (a frequent class right and a rare one missed has the higher
pixel accuracy and the lower mIoU), in both orders.

Wrong answers these catch: the best chosen by pixel accuracy (in a training run the two mostly rise together,
so a run of the trainer alone does not tell them apart); best.json's mIoU not the kept checkpoint's.
"""

import json
from types import SimpleNamespace

import keras
import pytest
import tensorflow as tf

from seg_train.infer.metrics import compute_metrics
from seg_train.run import checkpoint as ckpt_lib

# Rows ground truth, columns prediction. ACCURATE: pixel accuracy 0.9, mIoU (0.9 + 0) / 2 = 0.45;
# BALANCED: pixel accuracy 0.8, mIoU (70/90 + 10/30) / 2 = 0.56.
ACCURATE = [[90, 0], [10, 0]]
BALANCED = [[70, 20], [0, 10]]


def _state():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    return SimpleNamespace(model=model, step=tf.Variable(0, dtype=tf.int64),
                           bn_stats_step=tf.Variable(0, dtype=tf.int64))


def test_the_two_evaluations_disagree():
    accurate, balanced = compute_metrics(ACCURATE), compute_metrics(BALANCED)
    assert accurate.pixel_accuracy == pytest.approx(0.9) and accurate.miou == pytest.approx(0.45)
    assert balanced.pixel_accuracy == pytest.approx(0.8) and balanced.miou == pytest.approx((70 / 90 + 10 / 30) / 2)


@pytest.mark.parametrize("order", ["accurate_first", "balanced_first"])
def test_best_is_the_higher_miou_not_the_higher_pixel_accuracy(tmp_path, order):
    state = _state()
    runs = [(10, ACCURATE), (20, BALANCED)] if order == "accurate_first" else [(10, BALANCED), (20, ACCURATE)]
    kept = []
    for step, cm in runs:
        state.step.assign(step)
        if ckpt_lib.keep_best(tmp_path, state, step, compute_metrics(cm)):
            kept.append(step)
    best_step = 20 if order == "accurate_first" else 10
    assert kept == ([10, 20] if order == "accurate_first" else [10])
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["step"] == best_step
    assert best["miou"] == pytest.approx(compute_metrics(BALANCED).miou)
    assert best["pixel_accuracy"] == pytest.approx(0.8)
    assert ckpt_lib.resolve(tmp_path / "best").endswith(f"ckpt-{best_step}")
