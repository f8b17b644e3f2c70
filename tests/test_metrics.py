"""Tests for seg_train.infer.metrics (numpy metrics, checked against keras.metrics)."""

import json
import os

import numpy as np
import pytest

from seg_train.infer.metrics import (
    SegMetrics,
    compute_metrics,
    format_table,
    metrics_to_json,
)
from tests.helpers import confusion_matrix

IGNORE = 255
NAMES = ["background", "road", "sky"]

# Hand-checked example, 3 classes; class 2 ("sky") appears in neither labels nor preds.
# One pixel (top right) is ignored; its prediction must not be counted.
LABELS = np.array(
    [[0, 0, 1, IGNORE],
     [0, 1, 1, 1],
     [0, 0, 1, 1]],
    dtype=np.uint8,
)
PREDS = np.array(
    [[0, 1, 1, 1],
     [0, 1, 0, 1],
     [0, 1, 1, 1]],
    dtype=np.int64,
)
# 11 labelled pixels.
# gt 0 at (0,0) (0,1) (1,0) (2,0) (2,1) -> preds 0 1 0 0 1: 3 right, 2 predicted as 1
# gt 1 at (0,2) (1,1) (1,2) (1,3) (2,2) (2,3) -> preds 1 1 0 1 1 1: 5 right, 1 predicted as 0
EXPECTED_CM = np.array(
    [[3, 2, 0],
     [1, 5, 0],
     [0, 0, 0]]
)
# IoU0 = 3 / (3 + 2 FN + 1 FP) = 0.5
# IoU1 = 5 / (5 + 1 FN + 2 FP) = 0.625
# IoU2 = 0 / 0 -> None, excluded: mIoU = (0.5 + 0.625) / 2 = 0.5625
# pixel accuracy = (3 + 5) / 11 = 8/11
# acc0 = 3/5 = 0.6, acc1 = 5/6, acc2 = None: mean class accuracy = (0.6 + 5/6) / 2 = 43/60
EXPECTED_IOU = [0.5, 0.625, None]
EXPECTED_ACC = [0.6, 5 / 6, None]


def _approx_list(values):
    """pytest.approx can't handle None entries; keep them as exact matches."""
    return [None if v is None else pytest.approx(v) for v in values]


def test_hand_computed_confusion_matrix():
    cm = confusion_matrix(LABELS, PREDS, 3, ignore_label=IGNORE)
    assert cm.dtype == np.int64
    np.testing.assert_array_equal(cm, EXPECTED_CM)


def test_hand_computed_metrics():
    m = compute_metrics(EXPECTED_CM)
    assert isinstance(m, SegMetrics)
    assert m.miou == pytest.approx(0.5625)
    assert m.pixel_accuracy == pytest.approx(8 / 11)
    assert m.mean_class_accuracy == pytest.approx(43 / 60)
    assert m.per_class_iou == _approx_list(EXPECTED_IOU)
    assert m.per_class_accuracy == _approx_list(EXPECTED_ACC)
    np.testing.assert_array_equal(m.confusion_matrix, EXPECTED_CM)


def test_predicted_only_class_counts_as_zero_iou():
    # Class 2 is predicted once but never labelled: IoU 0 (in the mean), accuracy None.
    cm = np.array([[1, 0, 1], [0, 2, 0], [0, 0, 0]])
    m = compute_metrics(cm)
    assert m.per_class_iou == _approx_list([0.5, 1.0, 0.0])
    assert m.miou == pytest.approx(0.5)
    assert m.per_class_accuracy == _approx_list([0.5, 1.0, None])
    assert m.mean_class_accuracy == pytest.approx(0.75)


def test_ignored_pixels_are_excluded():
    cm = confusion_matrix(LABELS, PREDS, 3)
    assert cm.sum() == LABELS.size - 1
    # Whatever is predicted under an ignored label must not change the counts.
    other = PREDS.copy()
    other[0, 3] = 2
    np.testing.assert_array_equal(confusion_matrix(LABELS, other, 3), cm)
    # All pixels ignored -> an all-zero matrix, which compute_metrics refuses.
    empty = confusion_matrix(np.full((4, 4), IGNORE), np.zeros((4, 4), int), 3)
    np.testing.assert_array_equal(empty, np.zeros((3, 3)))
    with pytest.raises(ValueError, match="no labelled pixels"):
        compute_metrics(empty)


def test_custom_ignore_label():
    labels = np.array([0, 1, 2, 1])
    preds = np.array([0, 1, 0, 0])
    cm = confusion_matrix(labels, preds, 2, ignore_label=2)
    np.testing.assert_array_equal(cm, [[1, 0], [1, 1]])


@pytest.mark.parametrize("bad_label", [3, 254, -1])
def test_out_of_range_label_raises(bad_label):
    labels = np.zeros((2, 2), dtype=np.int64)
    labels[1, 1] = bad_label
    with pytest.raises(ValueError, match="label"):
        confusion_matrix(labels, np.zeros((2, 2), int), 3)


@pytest.mark.parametrize("bad_pred", [3, -1])
def test_out_of_range_prediction_raises(bad_pred):
    preds = np.zeros((2, 2), dtype=np.int64)
    preds[0, 1] = bad_pred
    with pytest.raises(ValueError, match="prediction"):
        confusion_matrix(np.zeros((2, 2), int), preds, 3)


def test_shape_mismatch_and_float_inputs_rejected():
    with pytest.raises(ValueError, match="shape"):
        confusion_matrix(np.zeros((2, 3), int), np.zeros((3, 2), int), 3)
    with pytest.raises(TypeError):
        confusion_matrix(np.zeros((2, 2)), np.zeros((2, 2), int), 3)


def test_odd_image_size_matches_naive_count():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=(7, 13)).astype(np.uint8)
    labels[rng.random((7, 13)) < 0.2] = IGNORE
    preds = rng.integers(0, 4, size=(7, 13))
    expected = np.zeros((4, 4), dtype=np.int64)
    for gt, pr in zip(labels.ravel(), preds.ravel()):
        if gt != IGNORE:
            expected[gt, pr] += 1
    np.testing.assert_array_equal(confusion_matrix(labels, preds, 4), expected)


def test_accumulation_equals_concatenation():
    rng = np.random.default_rng(1)
    shapes = [(7, 13), (16, 16), (5, 31)]
    labels = [rng.integers(0, 5, size=s) for s in shapes]
    preds = [rng.integers(0, 5, size=s) for s in shapes]
    for lab in labels:
        lab[rng.random(lab.shape) < 0.1] = IGNORE
    summed = sum(confusion_matrix(lab, pr, 5) for lab, pr in zip(labels, preds))
    flat = confusion_matrix(
        np.concatenate([lab.ravel() for lab in labels]),
        np.concatenate([pr.ravel() for pr in preds]),
        5,
    )
    np.testing.assert_array_equal(summed, flat)
    assert compute_metrics(summed).miou == compute_metrics(flat).miou


def test_format_table_contents():
    table = format_table(compute_metrics(EXPECTED_CM), NAMES)
    for name in NAMES:
        assert name in table
    assert "50.00" in table and "62.50" in table  # per-class IoU
    assert "56.25" in table  # mIoU
    assert "72.73" in table  # pixel accuracy 8/11
    assert "71.67" in table  # mean class accuracy 43/60
    assert "mIoU" in table and "Pixel accuracy" in table and "Mean class accuracy" in table
    sky_row = next(line for line in table.splitlines() if "sky" in line)
    assert sky_row.count("-") == 2  # both IoU and accuracy undefined
    # Fixed width: every table row has the same length.
    rows = [line for line in table.splitlines() if line.startswith(("|", "+"))]
    assert len({len(r) for r in rows}) == 1


def test_metrics_to_json():
    out = metrics_to_json(compute_metrics(EXPECTED_CM), NAMES)
    assert set(out) == {
        "miou", "pixel_accuracy", "mean_class_accuracy",
        "per_class_iou", "per_class_accuracy", "confusion_matrix",
    }
    assert out["miou"] == pytest.approx(0.5625)
    assert out["per_class_iou"]["sky"] is None
    assert out["per_class_accuracy"]["sky"] is None
    assert out["per_class_iou"]["road"] == pytest.approx(0.625)
    assert out["confusion_matrix"] == EXPECTED_CM.tolist()
    assert all(type(v) is int for row in out["confusion_matrix"] for v in row)
    # Must survive a JSON round trip (None -> null, no numpy scalars).
    assert json.loads(json.dumps(out))["per_class_iou"]["sky"] is None


def test_class_name_count_mismatch_raises():
    m = compute_metrics(EXPECTED_CM)
    with pytest.raises(ValueError):
        format_table(m, NAMES[:2])
    with pytest.raises(ValueError):
        metrics_to_json(m, ["a", "a", "b"])


def test_matches_keras_mean_iou():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    keras = pytest.importorskip("keras")

    num_classes = 6
    rng = np.random.default_rng(42)
    # Small odd-sized batch so the run stays light on a shared machine.
    labels = rng.integers(0, 4, size=(3, 37, 53))  # classes 4, 5 never labelled
    labels[rng.random(labels.shape) < 0.15] = IGNORE
    preds = rng.integers(0, 5, size=labels.shape)  # class 4 predicted only, 5 absent
    # Make predictions partly right so IoUs aren't all near chance.
    agree = rng.random(labels.shape) < 0.5
    preds[agree & (labels != IGNORE)] = labels[agree & (labels != IGNORE)]

    m = compute_metrics(confusion_matrix(labels, preds, num_classes))
    assert m.per_class_iou[5] is None and m.per_class_iou[4] == 0.0

    kw = dict(num_classes=num_classes, ignore_class=IGNORE, sparse_y_true=True, sparse_y_pred=True)
    mean_iou = keras.metrics.MeanIoU(**kw)
    for lab, pr in zip(labels, preds):  # accumulate per image, like an eval loop
        mean_iou.update_state(lab, pr)
    assert float(mean_iou.result()) == pytest.approx(m.miou, abs=1e-6)

    for k, ours in enumerate(m.per_class_iou):
        if ours is None:
            continue  # Keras reports 0 for empty-union classes; we report None
        iou_k = keras.metrics.IoU(target_class_ids=[k], **kw)
        iou_k.update_state(labels, preds)
        assert float(iou_k.result()) == pytest.approx(ours, abs=1e-6)
