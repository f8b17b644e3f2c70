"""Inference modes (eval.mode whole/slide, eval.flip, eval.scales): the same confusion matrix on 1 and
4 towers, equal to an independent eager computation; every labelled pixel counted once; a window
covering the image is whole-image inference; flip equivariance; seg-predict, the SavedModel,
seg-eval and evaluation during training predict the same classes; the config's checks."""

import json

import numpy as np
import pytest
import tensorflow as tf
import yaml
from PIL import Image

from seg_train import config as config_lib
from seg_train.config import ConfigError
from seg_train.data.label_images import read_label, voc_colormap
from seg_train.infer import eval_checkpoint, modes
from seg_train.infer import evaluate as ev
from seg_train.infer.export import run_export
from seg_train.infer.load import load_evaluator
from seg_train.infer.predict import run_predict
from seg_train.infer.serving import serving_module
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run import rundir
from seg_train.run.state import TrainState
from seg_train.train.summaries import Summaries
from seg_train.train.train import run_evaluation
from tests.helpers import CPU_DEVICES as DEVICES
from tests.helpers import EVAL_NAMES as NAMES
from tests.helpers import EVAL_NUM_CLASSES as NUM_CLASSES
from tests.helpers import calibrate_bn, eval_config, normalized, open_reader, reference_scores, tiny_config
from tests.helpers import write_eval_split as write_split

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

# Not multiples of 32 nor of the slide strides; 5 images, so the last step on 4 towers is partial.
SIZES = [(37, 53), (64, 17), (50, 41), (29, 70), (45, 33)]
CROP, STRIDE = [24, 32], [16, 20]
MODES = {
    "whole_flip_scales": {"flip": True, "scales": [0.75, 1.0, 1.25]},
    "slide": {"mode": "slide", "crop_size": CROP, "stride": STRIDE},
    "slide_flip": {"mode": "slide", "crop_size": CROP, "stride": STRIDE, "flip": True},
}
SLIDE_FLIP_SCALES = {"mode": "slide", "crop_size": CROP, "stride": STRIDE, "flip": True, "scales": [1.0, 1.25]}


def strategy(n):
    return tf.distribute.MirroredStrategy(DEVICES[:n])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("modes")
    root = write_split(tmp / "data", SIZES, seed=1)
    cfg = tiny_config(tmp, data_root=root, data={"num_classes": NUM_CLASSES}, eval={"bn_reestimate_batches": 0})
    trainer = TrainState(cfg, strategy(1))
    reader = open_reader(cfg, "val")
    calibrate_bn(cfg, trainer.model, reader, passes=10)
    four = TrainState(cfg, strategy(4))
    four.model.set_weights(trainer.model.get_weights())
    whole, _ = ev.Evaluator(trainer).evaluate(reader, NAMES, progress=False)
    return {"tmp": tmp, "root": root, "cfg": cfg, "trainer": trainer, "four": four, "reader": reader,
            "whole_cm": whole.confusion_matrix}


@pytest.mark.parametrize("name", list(MODES))
def test_modes_on_1_and_4_towers_give_the_reference_matrix_counting_every_pixel_once(setup, name):
    cfg, reader = setup["cfg"], setup["reader"]
    modes = eval_config(**MODES[name])
    one, n1 = ev.Evaluator(setup["trainer"], modes).evaluate(reader, NAMES, progress=False)
    four, n4 = ev.Evaluator(setup["four"], modes).evaluate(reader, NAMES, progress=False)
    assert n1 == n4 == len(SIZES)
    np.testing.assert_array_equal(four.confusion_matrix, one.confusion_matrix)
    labels = [read_label(s.label) for s in reader.samples]
    # Every non-ignored pixel exactly once: no padding, no window or view counted twice.
    assert one.confusion_matrix.sum() == sum(int((lb != 255).sum()) for lb in labels)
    ref = np.zeros((NUM_CLASSES, NUM_CLASSES), np.int64)
    for s, label in zip(reader.samples, labels):
        pred = reference_scores(setup["trainer"].model, normalized(cfg, s.image), modes).argmax(-1)
        keep = label != 255
        np.add.at(ref, (label[keep], pred[keep]), 1)
    np.testing.assert_array_equal(one.confusion_matrix, ref)
    # The mode changes the predictions (an evaluation that ignored it would give the whole-image matrix).
    assert not np.array_equal(one.confusion_matrix, setup["whole_cm"])
    assert (one.confusion_matrix.sum(axis=0) > 500).sum() >= 2  # not one class everywhere: a real comparison


def test_a_window_covering_the_image_is_whole_image_inference(setup):
    covering = eval_config(mode="slide", crop_size=[64, 70], stride=[64, 70])  # the largest image is 64 x 70
    got, _ = ev.Evaluator(setup["trainer"], covering).evaluate(setup["reader"], NAMES, progress=False)
    np.testing.assert_array_equal(got.confusion_matrix, setup["whole_cm"])
    # Scores too, exactly: windows larger than the image, and exactly the image's size.
    model = setup["trainer"].model
    x = tf.constant(normalized(setup["cfg"], setup["reader"].samples[0].image)[None])  # 37 x 53
    whole = modes.class_scores(lambda t: model(t, training=False), x, eval_config(), NUM_CLASSES)
    for crop in ([64, 64], [37, 53]):
        slide = modes.class_scores(lambda t: model(t, training=False), x,
                                       eval_config(mode="slide", crop_size=crop, stride=crop), NUM_CLASSES)
        np.testing.assert_array_equal(slide.numpy(), whole.numpy())


@pytest.mark.parametrize("keys", [{"flip": True}, MODES["whole_flip_scales"], SLIDE_FLIP_SCALES],
                         ids=["flip", "whole_flip_scales", "slide_flip_scales"])
def test_a_flipped_image_gives_the_flipped_probabilities(setup, keys):
    cfg = setup["cfg"]
    image = np.asarray(Image.open(setup["reader"].samples[0].image).convert("RGB"))  # 37 x 53: padded
    flipped = np.ascontiguousarray(image[:, ::-1])
    module = serving_module(setup["trainer"].model, cfg.data.mean, cfg.data.std, eval_config(**keys))
    a, b = module.serve(tf.constant(image)), module.serve(tf.constant(flipped))
    np.testing.assert_array_equal(b["probabilities"].numpy(), a["probabilities"].numpy()[:, ::-1])
    np.testing.assert_array_equal(b["classes"].numpy(), a["classes"].numpy()[:, ::-1])
    np.testing.assert_allclose(a["probabilities"].numpy().sum(-1), 1.0, atol=1e-5)
    # Without eval.flip the model is not symmetric: the check above is not true by construction.
    plain = serving_module(setup["trainer"].model, cfg.data.mean, cfg.data.std)
    p, q = plain.serve(tf.constant(image))["probabilities"].numpy(), plain.serve(tf.constant(flipped))["probabilities"]
    assert np.abs(q.numpy() - p[:, ::-1]).max() > 1e-3


def test_predict_export_eval_and_training_evaluation_agree_in_a_mode(setup):
    """seg-predict's classes in a mode (slide, flip, two scales) are the independent computation's, and, used as
    labels, what evaluation during training and its eval/examples predict. (seg-eval's and the SavedModel's classes
    in such a mode are held to classes by hand in tests/test_config_wiring_data.py.)"""
    tmp, trainer = setup["tmp"], setup["trainer"]
    keys = SLIDE_FLIP_SCALES
    cfg = tiny_config(tmp / "mode", data_root=setup["root"], data={"num_classes": NUM_CLASSES},
                      eval={"bn_reestimate_batches": 0, **keys})
    run_dir = tmp / "mode" / "run"
    trainer.step.assign(3)
    try:
        ckpt_lib.Checkpointer(run_dir / "checkpoints", 1, **trainer.checkpoint_objects()).save(3)
    finally:
        trainer.step.assign(0)
    pred_root = tmp / "pred_labels"
    written = run_predict(cfg, strategy(1), str(run_dir), [str(setup["root"] / "JPEGImages")],
                          pred_root / "SegmentationClass", progress=False)
    assert len(written) == len(SIZES)
    # seg-predict applies the mode: its classes are the independent computation's.
    first = setup["reader"].samples[0]
    ref = reference_scores(trainer.model, normalized(cfg, first.image), cfg.eval).argmax(-1)
    np.testing.assert_array_equal(read_label(written[0]), ref)
    (pred_root / "JPEGImages").symlink_to(setup["root"] / "JPEGImages")
    (pred_root / "ImageSets").symlink_to(setup["root"] / "ImageSets")
    (pred_root / "classes.txt").write_text("\n".join(NAMES) + "\n")
    pred_cfg = config_lib.replace(cfg, "data.root", pred_root)

    # Evaluation during training and its eval/examples use the mode too.
    mode_evaluator, _, _ = load_evaluator(cfg, strategy(1), str(run_dir))
    examples = mode_evaluator.predict_examples(open_reader(pred_cfg, "val"))
    for (_, label, pred), path in zip(examples, written):
        np.testing.assert_array_equal(pred, read_label(path))
        np.testing.assert_array_equal(label, read_label(path))
    train_dir = tmp / "mode" / "train"
    summaries = Summaries(train_dir, voc_colormap(), 255, cfg.data.mean, cfg.data.std)
    run_evaluation(pred_cfg, mode_evaluator, open_reader(pred_cfg, "val"), NAMES, summaries, train_dir, 3,
                   False)
    assert json.loads((train_dir / "best" / "best.json").read_text())["miou"] == 1.0


@pytest.mark.parametrize("keys, where, message", [
    ({"scales": []}, "eval.scales", "non-empty list"),
    ({"scales": [1.0, 0]}, "eval.scales", "positive numbers"),
    ({"scales": [1.0, -0.5]}, "eval.scales", "positive numbers"),
    ({"mode": "tiles"}, "eval.mode", "one of whole, slide"),
    ({"mode": "slide"}, "eval.crop_size", "when eval.mode is slide"),
    ({"mode": "slide", "crop_size": [0, 32]}, "eval.crop_size", "two positive numbers"),
    ({"mode": "slide", "crop_size": [32, 32], "stride": [16, -1]}, "eval.stride", "two positive numbers"),
    ({"mode": "slide", "crop_size": [32, 32], "stride": [16, 40]}, "eval.stride", "at most eval.crop_size"),
    ({"crop_size": [32]}, "eval.crop_size", "a list of 2 integers"),
])
def test_bad_mode_keys_are_refused_with_one_line(keys, where, message):
    with pytest.raises(ConfigError) as e:
        eval_config(**keys)
    assert e.value.where == where and message in str(e.value) and "\n" not in str(e.value)


def test_mode_defaults_and_stride_default():
    e = eval_config()
    assert (e.mode, e.flip, e.scales, e.crop_size, e.stride) == ("whole", False, [1.0], None, None)
    assert modes.is_single_view(e)
    e = eval_config(mode="slide", crop_size=[32, 49])
    assert e.stride == (22, 33)  # two thirds, rounded up
    assert modes.describe(e) == "slide 32x49/22x33"


def test_mode_keys_may_change_on_resume(tmp_path):
    (tmp_path / "run").mkdir()
    config_lib.dump(tiny_config(tmp_path), tmp_path / "run" / "config.yaml")
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["eval"]["mode"] == "whole"
    changed = tiny_config(tmp_path, eval={"mode": "slide", "crop_size": [32, 32], "flip": True, "scales": [0.5, 1]})
    rundir.check_resume_config(changed, tmp_path / "run", allow_change=False)  # no error
    with pytest.raises(ConfigError, match="differs"):  # while a key that changes the weights is refused
        rundir.check_resume_config(tiny_config(tmp_path, model={"aspp_channels": 16}), tmp_path / "run", False)


# ---- eval.logit_adjustment ------------------------------------------------------------------------
WEIGHTS = [3.0, 1.0, 0.3, 0.0]  # NAMES' order; "tree" has weight 0 (a class the train split lacks): untouched


def adjusted(probs, tau):
    """The definition, in numpy: each class's probability times w_c**-tau (w_c = 0: times 1), renormalised."""
    w = np.array(WEIGHTS, np.float64)
    q = probs * np.where(w > 0, np.where(w > 0, w, 1.0) ** -tau, 1.0)
    return q / q.sum(-1, keepdims=True)


def adjusted_reference_matrix(cfg, model, reader, e, tau, preds=None):
    """The confusion matrix of the adjusted classes of the independent reference, and how many pixels moved
    (the class maps appended to `preds`, by image id, if given)."""
    cm, moved = np.zeros((NUM_CLASSES, NUM_CLASSES), np.int64), 0
    for s in reader.samples:
        scores = reference_scores(model, normalized(cfg, s.image), e)
        probs = tf.nn.softmax(scores).numpy() if modes.is_single_view(e) else scores
        pred = adjusted(probs, tau).argmax(-1)
        moved += int((pred != probs.argmax(-1)).sum())
        if preds is not None:
            preds[s.id] = pred
        label = read_label(s.label)
        keep = label != 255
        np.add.at(cm, (label[keep], pred[keep]), 1)
    return cm, moved


@pytest.mark.parametrize("keys", [{}, MODES["whole_flip_scales"]], ids=["one_view", "flip_scales"])
def test_logit_adjustment_divides_the_probabilities_by_the_class_weights(setup, keys):
    """eval.logit_adjustment tau: the served probabilities are the independent reference's times w_c**-tau,
    renormalised (a class of weight 0 untouched), the classes their argmax, and seg-eval's step counts those
    classes. Fails for the weights multiplied instead of divided, probabilities left unnormalised, log(0)
    for the weight-0 class, or an evaluation that ignores the adjustment (or reuses the unadjusted step)."""
    cfg, trainer, reader = setup["cfg"], setup["trainer"], setup["reader"]
    tau = 0.8
    e = config_lib.from_dict({"data": {"root": "d", "num_classes": NUM_CLASSES}, "loss": {"class_weights": WEIGHTS},
                              "eval": {**keys, "logit_adjustment": tau}}).eval
    assert "logit adjustment 0.8" in modes.describe(e)
    offsets = modes.score_offsets(e, WEIGHTS)
    module = serving_module(trainer.model, cfg.data.mean, cfg.data.std, e, offsets)
    for s in reader.samples[:2]:
        scores = reference_scores(trainer.model, normalized(cfg, s.image), e)
        want = adjusted(tf.nn.softmax(scores).numpy() if not keys else scores, tau)
        got = module.serve(tf.constant(np.asarray(Image.open(s.image).convert("RGB"))))
        np.testing.assert_allclose(got["probabilities"].numpy(), want, atol=1e-5)
        top2 = np.sort(want, axis=-1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > 1e-4
        np.testing.assert_array_equal(got["classes"].numpy()[clear], want.argmax(-1)[clear])
    ref, moved = adjusted_reference_matrix(cfg, trainer.model, reader, e, tau)
    assert moved > 0.05 * sum(h * w for h, w in SIZES)  # the adjustment changes real predictions
    # An evaluation with other weights' offsets (all 0) on the same state first: the real offsets' own
    # Evaluator must not reuse its step.
    ev.Evaluator(trainer, e, score_offsets=modes.score_offsets(e, [1.0] * NUM_CLASSES)).evaluate(
        reader, NAMES, progress=False)
    got = ev.Evaluator(trainer, e, score_offsets=offsets).evaluate(reader, NAMES, progress=False)[0].confusion_matrix
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(ValueError, match="disagree"):  # an adjustment without its offsets: no silent plain argmax
        ev.Evaluator(trainer, e)


def test_seg_eval_predict_and_export_divide_out_the_weights_the_run_trained_with(setup):
    """A run trained with a named weighting scheme: seg-eval reads the weights from RUN_DIR/class_weights.json
    by class name (written here in another order) and counts what the reference predicts; seg-predict and the
    SavedModel predict those classes, and its seg_train.json gives the offsets. A file of another scheme, or
    none, stops it with a one-line error naming the file."""
    tmp, trainer = setup["tmp"] / "adjust", setup["trainer"]
    tau = 0.5
    cfg = tiny_config(tmp, data_root=setup["root"], data={"num_classes": NUM_CLASSES},
                      loss={"class_weights": "median_frequency"},
                      eval={"bn_reestimate_batches": 0, "logit_adjustment": tau})
    run_dir = tmp / "run"
    ckpt_lib.Checkpointer(run_dir / "checkpoints", 1, **trainer.checkpoint_objects()).save(0)
    rundir.write_class_weights(run_dir, "median_frequency", NAMES[::-1], WEIGHTS[::-1])
    record = eval_checkpoint.run_eval(cfg, strategy(1), str(run_dir), progress=False)
    assert record["inference"]["logit_adjustment"] == tau
    preds = {}
    ref, _ = adjusted_reference_matrix(cfg, trainer.model, setup["reader"], cfg.eval, tau, preds)
    np.testing.assert_array_equal(np.array(record["confusion_matrix"]), ref)
    assert not np.array_equal(ref, setup["whole_cm"])
    written = run_predict(cfg, strategy(1), str(run_dir), [str(setup["root"] / "JPEGImages")], tmp / "pred",
                          progress=False)
    for path in written:
        np.testing.assert_array_equal(read_label(path), preds[path.stem])
    run_export(cfg, strategy(1), str(run_dir), tmp / "model", progress=False)
    meta = json.loads((tmp / "model" / "seg_train.json").read_text())
    want = {n: (tau * np.log(w) if w else 0.0) for n, w in zip(NAMES, WEIGHTS)}
    assert meta["score_offsets"] == pytest.approx(want) and meta["inference"]["logit_adjustment"] == tau
    serve = tf.saved_model.load(str(tmp / "model")).signatures["serving_default"]
    image = np.asarray(Image.open(setup["reader"].samples[0].image).convert("RGB"))
    np.testing.assert_array_equal(serve(image=tf.constant(image))["classes"].numpy(),
                                  preds[setup["reader"].samples[0].id])
    other = config_lib.replace(cfg, "loss.class_weights", "sqrt_median_frequency")
    with pytest.raises(ConfigError, match="another scheme"):
        eval_checkpoint.run_eval(other, strategy(1), str(run_dir), progress=False)
    (run_dir / "class_weights.json").unlink()
    with pytest.raises(ConfigError) as e:
        eval_checkpoint.run_eval(cfg, strategy(1), str(run_dir), progress=False)
    assert e.value.where == str(run_dir / "class_weights.json") and "\n" not in str(e.value)


def test_logit_adjustment_needs_class_weights():
    with pytest.raises(ConfigError) as e:
        eval_config(logit_adjustment=0.5)
    assert e.value.where == "eval.logit_adjustment" and "loss.class_weights" in str(e.value)
    with pytest.raises(ConfigError, match="a number >= 0"):
        eval_config(logit_adjustment=-1)
    assert modes.score_offsets(eval_config(), WEIGHTS) is None
