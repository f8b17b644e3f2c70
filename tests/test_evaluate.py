"""Evaluation: every labelled pixel counted exactly once at full resolution, the metrics equal an
independent numpy computation, N towers give the identical confusion matrix as 1 tower, the seg-eval
record, best-checkpoint keeping and the eval summaries."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train import config as config_lib
from seg_train.config import ConfigError
from seg_train.data.label_images import read_label
from seg_train.infer import eval_checkpoint
from seg_train.infer import evaluate as ev
from seg_train.infer import metrics as metrics_lib
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import CPU_DEVICES as DEVICES
from tests.helpers import EVAL_NAMES as NAMES
from tests.helpers import EVAL_NUM_CLASSES as NUM_CLASSES
from tests.helpers import calibrate_bn, confusion_matrix, open_reader, tiny_config
from tests.helpers import write_eval_split as write_split

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

# Sizes that are not multiples of 32 (padding must not be counted); 5 images, so the last step on
# 2 and 4 towers is partial (a tower without an image must count nothing).
SIZES = [(37, 53), (64, 17), (33, 32), (50, 41), (29, 29)]


def strategy(n):
    return tf.distribute.MirroredStrategy(DEVICES[:n])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    root = write_split(tmp / "data", SIZES)
    cfg = tiny_config(tmp, data_root=root, data={"num_classes": NUM_CLASSES})
    trainer = TrainStep(TrainState(cfg, strategy(1)))
    reader = open_reader(cfg, "val")
    calibrate_bn(cfg, trainer.state.model, reader)
    return cfg, trainer, reader


def reference(cfg, model, reader):
    """The confusion matrix computed independently: eager model calls and numpy metrics."""
    cm = np.zeros((NUM_CLASSES, NUM_CLASSES), np.int64)
    for s in reader.samples:
        image = np.asarray(Image.open(s.image).convert("RGB"), np.float32)
        label = read_label(s.label)
        h, w = label.shape
        x = (image - np.array(cfg.data.mean, np.float32)) / np.array(cfg.data.std, np.float32)
        x = np.pad(x, [(0, -h % 32), (0, -w % 32), (0, 0)])
        logits = model(x[None], training=False).numpy()[0, :h, :w]
        cm += confusion_matrix(label, logits.argmax(-1), NUM_CLASSES, 255)
    return cm


def test_evaluate_equals_numpy_reference_and_counts_every_pixel_once(setup):
    cfg, trainer, reader = setup
    metrics, num_images = ev.Evaluator(trainer.state).evaluate(reader, NAMES, progress=False)
    assert num_images == len(SIZES)
    labels = [read_label(s.label) for s in reader.samples]
    # Every non-ignored pixel exactly once: not the padding, not the ignored block, no image twice.
    assert metrics.confusion_matrix.sum() == sum(int((lb != 255).sum()) for lb in labels)
    cm = reference(cfg, trainer.state.model, reader)
    np.testing.assert_array_equal(metrics.confusion_matrix, cm)
    expected = metrics_lib.compute_metrics(cm)
    assert metrics == expected
    # The predictions really vary (an all-one-class model would make the comparison weak).
    assert (cm.sum(axis=0) > 100).sum() >= 3


@pytest.mark.parametrize("n", [2, 4])
def test_n_towers_give_the_identical_confusion_matrix(setup, n):
    cfg, trainer, reader = setup
    one, _ = ev.Evaluator(trainer.state).evaluate(reader, NAMES, progress=False)
    multi = TrainStep(TrainState(cfg, strategy(n)))
    multi.state.model.set_weights(trainer.state.model.get_weights())
    evaluator = ev.Evaluator(multi.state)
    got, num_images = evaluator.evaluate(reader, NAMES, progress=False)
    assert num_images == len(SIZES)
    np.testing.assert_array_equal(got.confusion_matrix, one.confusion_matrix)
    # A second call reuses the Evaluator's compiled step (no second trace) and gives the same answer.
    again, _ = evaluator.evaluate(reader, NAMES, progress=False)
    np.testing.assert_array_equal(again.confusion_matrix, one.confusion_matrix)
    assert evaluator._step.experimental_get_tracing_count() == 1


def test_each_image_is_decoded_once_whatever_the_scales_and_flips(setup, tmp_path, monkeypatch):
    """Multi-scale, flipped evaluation decodes each file once and makes every view from that decode
    (eval_dataset decodes, the inference modes resize the decoded image). Counted through the decoder
    itself: fails for an evaluation that decodes a file again per scale or per view (15 or 30 decodes
    of these 5 images, not 5)."""
    from seg_train.data import decode

    cfg, trainer, reader = setup
    calls = []
    real = decode.decode_image

    def counting(contents):
        image = real(contents)
        tick = tf.numpy_function(lambda: calls.append(1) or np.int64(0), [], tf.int64, stateful=True)
        with tf.control_dependencies([tick]):
            return tf.identity(image)

    monkeypatch.setattr(decode, "decode_image", counting)
    modes = tiny_config(tmp_path, eval={"flip": True, "scales": [0.5, 1.0, 1.5]}).eval
    _, num_images = ev.Evaluator(trainer.state, modes).evaluate(reader, NAMES, progress=False)
    assert num_images == len(SIZES) and len(calls) == len(SIZES), len(calls)


def test_wrong_number_of_class_names_is_refused(setup):
    _, trainer, reader = setup
    with pytest.raises(ConfigError, match="class names"):
        ev.Evaluator(trainer.state).evaluate(reader, NAMES[:2], progress=False)


def test_run_eval_writes_the_record(setup, tmp_path, capsys):
    cfg, trainer, _ = setup
    run_dir = tmp_path / "run"
    trainer.state.step.assign(7)
    trainer.state.bn_stats_step.assign(7)
    try:
        ckpt_lib.Checkpointer(run_dir / "checkpoints", 2, **trainer.state.checkpoint_objects()).save(7)
    finally:
        trainer.state.step.assign(0)
        trainer.state.bn_stats_step.assign(-1)
    # The run's config as trained with class weights from the train split's histogram: evaluation
    # needs no loss, so it neither reads that split nor refuses the config.
    trained_cfg = config_lib.replace(cfg, "loss.class_weights", "median_frequency")
    record = eval_checkpoint.run_eval(trained_cfg, strategy(2), str(run_dir), progress=False)
    path = run_dir / "eval" / "val-step7.json"
    assert json.loads(path.read_text()) == record
    assert record["step"] == 7 and record["num_images"] == len(SIZES) and record["split"] == "val"
    assert record["checkpoint"] == str(run_dir / "checkpoints" / "ckpt-7")
    assert record["bn_stats_reestimated"] is True  # saved with bn_stats_step == step
    assert list(record["per_class_iou"]) == NAMES
    cm = reference(cfg, trainer.state.model, open_reader(cfg, "val"))
    assert record["confusion_matrix"] == cm.tolist()
    assert record["miou"] == metrics_lib.compute_metrics(cm).miou
    out = capsys.readouterr().out
    assert "| road" in out and "mIoU" in out and str(path) in out
    assert not list((run_dir / "eval").glob("*.tmp*"))


def test_keep_best_saves_only_improvements(setup, tmp_path):
    cfg, _, _ = setup
    trainer = TrainStep(TrainState(cfg, strategy(1)))
    calibrate_bn(cfg, trainer.state.model, open_reader(cfg, "val"), passes=2)  # weights unlike a fresh model's
    run_dir = tmp_path / "run"

    def m(miou_cm):
        return metrics_lib.compute_metrics(miou_cm)

    low, mid, high = m([[1, 1], [1, 1]]), m([[3, 1], [1, 3]]), m([[9, 1], [0, 9]])
    assert low.miou < mid.miou < high.miou
    for step, metrics, improved in ((10, mid, True), (20, low, False), (30, mid, False), (40, high, True)):
        trainer.state.step.assign(step)
        assert ckpt_lib.keep_best(run_dir, trainer.state, step, metrics) is improved
    best = json.loads((run_dir / "best" / "best.json").read_text())
    assert best["step"] == 40 and best["miou"] == high.miou
    prefix = ckpt_lib.resolve(run_dir / "best")
    assert prefix.endswith("ckpt-40")
    assert not list((run_dir / "best").glob("ckpt-10*"))  # the superseded best is gone
    restored = TrainStep(TrainState(cfg, strategy(1)))
    assert restored.state.restore_weights(prefix) == 40
    for a, b in zip(restored.state.model.weights, trainer.state.model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_write_eval_summaries(tmp_path):
    metrics = metrics_lib.compute_metrics([[3, 1, 0], [1, 3, 0], [0, 0, 0]])  # class 2: IoU undefined
    writer = tf.summary.create_file_writer(str(tmp_path))
    ev.write_eval_summaries(writer, 5, metrics, ["a", "b", "c"])
    values = {}
    for path in tmp_path.glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for v in event.summary.value:
                values[v.tag] = (event.step, float(tf.make_ndarray(v.tensor)))
    assert values == {"eval/miou": (5, pytest.approx(0.6)), "eval/pixel_accuracy": (5, pytest.approx(0.75)),
                      "eval/mean_class_accuracy": (5, pytest.approx(0.75)),
                      "eval/iou/a": (5, pytest.approx(0.6)), "eval/iou/b": (5, pytest.approx(0.6))}


def test_cli_missing_checkpoint_is_a_one_line_user_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("data: {root: data, num_classes: 3}\n")
    exe = os.path.join(os.path.dirname(sys.executable), "seg-eval")
    proc = subprocess.run([exe, "--config", str(config), "--checkpoint", str(tmp_path / "nope")],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: checkpoint not found ({tmp_path / 'nope'}): "
                                   "expected a run dir, a checkpoints/ folder or a checkpoint prefix")


def test_confusion_counts_match_bincount_without_using_it():
    """The one-hot matmul confusion matrix equals a plain bincount (ignore pixels excluded), and its
    graph has no Bincount op (no deterministic GPU kernel: train.deterministic would refuse it)."""
    from seg_train.infer.evaluate import confusion_counts

    rng = np.random.default_rng(0)
    c, ignore = 5, 255
    labels = rng.integers(0, c, size=(1, 37, 53)).astype(np.uint8)
    labels[0, :5] = ignore
    preds = rng.integers(0, c, size=(1, 37, 53)).astype(np.int32)
    valid = labels != ignore
    expected = np.bincount(labels[valid].astype(np.int64) * c + preds[valid], minlength=c * c)
    got = confusion_counts(tf.constant(labels), tf.constant(preds), c, ignore)
    assert got.dtype == tf.int64
    np.testing.assert_array_equal(got.numpy(), expected)
    graph = tf.function(lambda a, b: confusion_counts(a, b, c, ignore)).get_concrete_function(
        tf.TensorSpec([1, None, None], tf.uint8), tf.TensorSpec([1, None, None], tf.int32)).graph
    assert not [op.type for op in graph.get_operations() if "Bincount" in op.type]
