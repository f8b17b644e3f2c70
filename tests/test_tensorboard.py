"""What TensorBoard shows, read back with TensorBoard's own EventAccumulator from one short run of the
real command (2 towers, a profile of steps 2..3, an evaluation at the end), resumed once for a
second run segment. Plus the pictures' own geometry and colours, in-process."""

import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import yaml
from PIL import Image

from seg_train.config import DataConfig
from seg_train.data import synthetic
from seg_train.data.label_images import colorize, read_label, voc_colormap
from seg_train.data.layouts import list_samples
from seg_train.train import plots
from seg_train.train.summaries import confusion_matrix_title

CROP, TOWERS, PER_TOWER = 32, 2, 2
PALETTE = voc_colormap()


def _cli(args, cwd):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "seg_train.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """RUN_DIR after steps 1..4 (profile 2..3, eval at 4), then resumed for step 5 (eval at 5)."""
    tmp = tmp_path_factory.mktemp("tb")
    root = synthetic.generate(tmp / "demo", num_train=12, num_val=4, size=(40, 48), num_classes=3)
    raw = {"seed": 1, "run_dir": "run",
           "data": {"root": str(root), "num_classes": 3, "batch_size": TOWERS * PER_TOWER,
                    "crop_size": [CROP, CROP], "num_parallel_calls": 2},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4},
           "train": {"num_steps": 4, "checkpoint_every": 2, "summary_every": 1, "image_summary_every": 2,
                     "learning_rate": 0.01, "profile_steps": [2, 3]},
           "eval": {"bn_reestimate_batches": 2}}
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
    first = _cli(["--config", "cfg.yaml", "--gpus", str(TOWERS)], tmp)
    assert first.returncode == 0, first.stderr
    # The first segment's record (the second segment writes its own first step there).
    first_step = json.loads((tmp / "run" / "first_step.json").read_text())
    latest = tf.train.latest_checkpoint(str(tmp / "run" / "checkpoints"))
    second = _cli(["--config", "cfg.yaml", "--gpus", str(TOWERS), "--set", "train.num_steps=5"], tmp)
    assert second.returncode == 0, second.stderr
    assert "resumed from step 4" in second.stderr
    return {"dir": tmp / "run", "root": root, "log": first.stderr, "first_step": first_step,
            "first_latest": latest, "second_log": second.stderr}


@pytest.mark.slow
def test_train_log_first_step_tags_and_resume(run):
    """The command's log line, RUN_DIR/first_step.json (what seg-bench's probes read) agreeing with the log's
    first step, the checkpoints, the scalar and picture tags of both towers, the poly decay, and the extended
    run resuming from its last step with the schedule continued."""
    log = run["log"]
    assert "logical CPU devices" in log
    assert re.search(r"step 4/4  loss [0-9.]+  gnorm [0-9.e+-]+  lr ", log), log  # the log line
    first = re.search(r"first step done ([0-9.]+)s after launch: tracing ([0-9.]+)s", log)
    assert first, log
    record = run["first_step"]
    assert record["step"] == 1 and record["first_step_s"] > record["tracing_s"] > 0, record
    assert (f"{record['first_step_s']:.1f}", f"{record['tracing_s']:.1f}") == first.groups(), (record, first)
    assert record["peak_rss_mb"] > 0, record
    assert (run["dir"] / "config.yaml").is_file()
    assert run["first_latest"].endswith("ckpt-4")
    acc = _acc(run["dir"])
    tags = acc.Tags()
    scalars = set(tags["tensors"]) | set(tags["scalars"])
    images = set(tags["images"]) | {t for t in tags["tensors"] if t.startswith("tower_")}
    for tag in ["loss/total", "loss/weight_decay", "loss/tower_0", "loss/tower_1", "learning_rate",
                "throughput/images_per_sec", "gradients/global_norm", "gradients/norm/tower_0",
                "gradients/norm/tower_1", "gradients/clipped"]:
        assert tag in scalars, (tag, scalars)
    for i in range(TOWERS):
        for kind in ("image", "label", "prediction"):
            assert f"tower_{i}/{kind}" in images, images
    lrs = _scalars(acc, "learning_rate")
    assert [s for s, _ in lrs] == [1, 2, 3, 4, 5]
    assert lrs[0][1] > lrs[3][1] > 0  # poly decay over the first segment's 4 steps
    # Extended to 5 steps: resumed from the saved step (the fixture checks the log) and the schedule continues
    # from there, to the new end.
    assert lrs[3][1] > lrs[4][1]
    assert tf.train.latest_checkpoint(str(run["dir"] / "checkpoints")).endswith("ckpt-5")


def _acc(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag):
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def _pngs(acc, tag, step):
    """The decoded pictures of an image summary at `step` (a tensor [w, h, png...])."""
    (event,) = [e for e in acc.Tensors(tag) if e.step == step]
    blobs = tf.make_ndarray(event.tensor_proto)
    pictures = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs[2:]]
    assert all(p.shape[1] == int(blobs[0]) and p.shape[0] == int(blobs[1]) for p in pictures)
    return pictures


def _panel(picture, k, width):
    x = k * (width + plots.GAP)
    return picture[:, x:x + width]


@pytest.mark.slow
def test_tower_runs_carry_each_towers_loss(run):
    main = _acc(run["dir"])
    towers = sorted(p.name for p in (run["dir"] / "towers").iterdir())
    assert towers == [f"tower_{i}" for i in range(TOWERS)]
    series = []
    for i in range(TOWERS):
        acc = _acc(run["dir"] / "towers" / f"tower_{i}")
        assert sorted(acc.Tags()["tensors"]) == ["gradients/norm/tower", "loss/tower"]
        values = _scalars(acc, "loss/tower")
        assert [s for s, _ in values] == [1, 2, 3, 4, 5]  # summary_every 1, over both run segments
        assert values == _scalars(main, f"loss/tower_{i}")
        assert _scalars(acc, "gradients/norm/tower") == _scalars(main, f"gradients/norm/tower_{i}")
        series.append(values)
    assert series[0] != series[1]  # each tower its own loss, not one value copied


@pytest.mark.slow
def test_triplet_is_the_towers_image_label_prediction_and_overlay(run):
    acc = _acc(run["dir"])
    assert {s for s in (e.step for e in acc.Tensors("tower_0/triplet"))} == {1, 2, 4, 5}
    colours = {tuple(PALETTE[c]) for c in range(3)} | {(255, 255, 255)}
    for i in range(TOWERS):
        triplets = _pngs(acc, f"tower_{i}/triplet", 2)
        assert len(triplets) == PER_TOWER
        views = {kind: _pngs(acc, f"tower_{i}/{kind}", 2) for kind in ("image", "label", "prediction")}
        for k, picture in enumerate(triplets):
            assert picture.shape == (CROP, 4 * CROP + 3 * plots.GAP, 3)
            image, label, pred, over = (_panel(picture, j, CROP) for j in range(4))
            np.testing.assert_array_equal(image, views["image"][k])
            np.testing.assert_array_equal(label, views["label"][k])
            np.testing.assert_array_equal(pred, views["prediction"][k])
            found = {tuple(c) for c in label.reshape(-1, 3)}
            assert found <= colours and len(found - {(255, 255, 255)}) >= 2, found
            assert (picture[:, CROP:CROP + plots.GAP] == plots.GAP_COLOUR).all()
            # The overlay: half image, half the predicted class's colour, where the pixel is labelled.
            labelled = (label != 255).any(axis=-1)
            expected = np.round(0.5 * image.astype(float) + 0.5 * pred.astype(float))
            assert np.abs(over[labelled] - expected[labelled]).max() <= 1


@pytest.mark.slow
def test_confusion_matrix_picture_matches_the_evaluation(run):
    acc = _acc(run["dir"])
    assert [e.step for e in acc.Tensors("eval/confusion_matrix")] == [4, 5]
    names = ["background", "disc", "square"]  # demo_data's classes.txt for 3 classes
    assert (run["root"] / "classes.txt").read_text().split() == names
    for step in (4, 5):
        (picture,) = _pngs(acc, "eval/confusion_matrix", step)
        # The same names and caption give the same layout, whatever the counts.
        _, layout = plots.confusion_matrix_image(np.eye(3, dtype=int), names, title=confusion_matrix_title(step))
        # Undo the shading of the diagonal cells: their mean is the mean class accuracy.
        diag = []
        for c in range(3):
            x, y = layout.swatch(c, c)
            r = float(picture[y, x, 0])
            diag.append(((255 - r) / (255 - plots.HIGH[0])) ** 2)
        (accuracy,) = [v for s, v in _scalars(acc, "eval/mean_class_accuracy") if s == step]
        assert abs(np.mean(diag) - accuracy) < 0.01, (diag, accuracy)


@pytest.mark.slow
def test_eval_examples_are_the_same_val_images_each_time(run):
    acc = _acc(run["dir"])
    samples = list_samples(DataConfig(root=run["root"]), "val")
    shown = {step: _pngs(acc, "eval/examples", step) for step in (4, 5)}
    assert len(shown[4]) == len(shown[5]) == 4
    for k, sample in enumerate(samples[:4]):
        label = read_label(sample.label)
        h, w = label.shape
        for step in (4, 5):
            picture = shown[step][k]
            assert picture.shape[1] == 3 * w + 2 * plots.GAP
            np.testing.assert_array_equal(_panel(picture, 1, w)[:h], colorize(label, PALETTE, 255))
            image = np.asarray(Image.open(sample.image).convert("RGB"))
            np.testing.assert_array_equal(_panel(picture, 0, w)[:h], image)


@pytest.mark.slow
def test_config_text_at_the_start_of_each_segment(run):
    acc = _acc(run["dir"])
    texts = {e.step: tf.make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors("config")}
    assert sorted(texts) == [1, 5]
    assert texts[1].startswith("resolved config at step 1, 2 tower(s):")

    def parsed(text):
        body = text.split("\n\n", 1)[1]
        return yaml.safe_load("\n".join(line[4:] for line in body.splitlines()))

    saved = yaml.safe_load((run["dir"] / "config.yaml").read_text())  # the second segment's
    assert parsed(texts[5]) == saved
    first = parsed(texts[1])
    assert first["train"]["num_steps"] == 4 and saved["train"]["num_steps"] == 5
    assert first["seed"] == 1 and first["train"]["profile_steps"] == [2, 3]
    assert first["data"]["root"] == str(run["root"]) and first["run_dir"] == str(run["dir"])


@pytest.mark.slow
def test_profile_of_the_asked_steps(run):
    profiles = list((run["dir"] / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(profiles) == 1, profiles  # the resumed segment (step 5) is outside [2, 3]
    data = profiles[0].read_bytes()
    assert b"__inference__train_step" in data and b"step_num" in data
    assert "profiling steps 2..3 (train.profile_steps)" in run["log"]


# ---- in-process: the pictures and the tower writer -------------------------------------------------
def test_confusion_matrix_rows_normalised():
    cm = np.array([[1000, 0, 0], [1, 3, 0], [0, 0, 0]])
    picture, layout = plots.confusion_matrix_image(cm, ["a", "b", "c"], title="t")
    at = lambda r, c: tuple(picture[layout.swatch(r, c)[1], layout.swatch(r, c)[0]])  # noqa: E731
    assert at(0, 0) == plots.cell_colour(1.0) and at(0, 1) == plots.cell_colour(0.0) == (255, 255, 255)
    assert at(1, 0) == plots.cell_colour(0.25) and at(1, 1) == plots.cell_colour(0.75)
    assert at(2, 2) == plots.EMPTY_ROW  # no ground-truth pixels: no fractions
    assert plots.cell_colour(0.25) != plots.cell_colour(1 / 1001)  # column- or total-normalised differ
    _, same = plots.confusion_matrix_image(cm * 10**8, ["a", "b", "c"], title="t " * 40)
    _, other = plots.confusion_matrix_image(cm, ["a", "b", "c"], title="t " * 40)
    assert (same.x0, same.y0) == (other.x0, other.y0)  # the counts never move the cells
    # Names on both axes: ink left of every row and above every column.
    for i in range(3):
        x, y = layout.centre(i, 0)
        assert (picture[y - 4:y + 4, :layout.x0 - 2] < 128).any()
        x, y = layout.centre(0, i)
        assert (picture[:layout.y0 - 2, x - 4:x + 4] < 128).any()


def test_confusion_matrix_fits_a_screen_at_21_classes():
    names = ["background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
             "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
             "tvmonitor"]
    picture, layout = plots.confusion_matrix_image(np.eye(21, dtype=int) * 5, names, title="step 1")
    assert layout.cell >= 30 and picture.shape[0] < 1000 and picture.shape[1] < 1000


def test_tower_scalars_one_run_per_tower_any_tag(tmp_path):
    from seg_train.train.summaries import Summaries
    s = Summaries(tmp_path, PALETTE, 255, (0, 0, 0), (1, 1, 1))
    s.tower_scalars(7, "gradients/norm/tower", [0.5, 1.5, 2.5])
    s.flush()
    for i, value in enumerate([0.5, 1.5, 2.5]):
        assert _scalars(_acc(tmp_path / "towers" / f"tower_{i}"), "gradients/norm/tower") == [(7, value)]
    assert not (tmp_path / "towers" / "tower_3").exists()
