"""seg-export --format onnx, and seg-eval / seg-predict --model FILE.onnx, held to outside references: ONNX
Runtime in a process that never imports seg_train, the Keras model's own argmax and softmax, an evaluation
written here by hand (Pillow resize, ONNX Runtime, a numpy confusion matrix), and the standard library's
math.erfc.

Tolerances, float32 file against the Keras model on the same uint8 images: the class maps equal on every
pixel whose top-two logits are more than MARGIN apart (and such pixels are at least 90% of all), and the
softmax within PROBABILITY_ATOL, or LOGIT_RTOL times the largest logit where that is larger (float32's rounding
in the logits: a ResNet-50 with random weights has logits of several hundred). The files here differ by
about 2e-6 at most, 1.3e-4 for that ResNet-50."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train.cli import eval_main, export_main, predict_main
from seg_train.config import ConfigError
from seg_train.data import synthetic
from seg_train.infer.onnx_export import run_export_onnx
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run.state import TrainState
from tests.helpers import TINY_MIT_B0, confusion_matrix, perturb, run_outside, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: converts models and starts processes

pytest.importorskip("tf2onnx")  # the tests install it (the 'test' extra); users opt in with [onnx]
pytest.importorskip("onnxruntime")

SIZE = (32, 48)       # the exported input size (H, W)
IMAGE = (40, 56)      # the data's image size: evaluation resizes in and out
MARGIN = 1e-4
PROBABILITY_ATOL = 1e-5
LOGIT_RTOL = 1e-6
# data.mean / data.std not any backbone's defaults: the file must normalise with the configured ones.
MEAN, STD = [100.0, 110.0, 120.0], [50.0, 40.0, 60.0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny DeepLabV3+ with BN statistics of the data, saved as a checkpoint, and its .onnx export (with the
    softmax output)."""
    tmp = tmp_path_factory.mktemp("onnx")
    synthetic.generate(tmp / "data", num_train=12, num_val=6, size=IMAGE, num_classes=3, seed=1)
    cfg = tiny_config(tmp, data_root=tmp / "data", data={"crop_size": list(SIZE), "mean": MEAN, "std": STD},
                      eval={"bn_reestimate_batches": 0})
    state = TrainState(cfg, tf.distribute.MirroredStrategy(["/device:CPU:0"]))
    images = np.stack([np.asarray(Image.open(p)) for p in sorted((tmp / "data" / "JPEGImages").glob("*.jpg"))])
    x = (images.astype(np.float32) - np.float32(MEAN)) / np.float32(STD)
    for _ in range(30):  # BN statistics of these images: an untrained model then predicts several classes
        state.model(x, training=True)
    state.step.assign(7)
    ckpt_lib.Checkpointer(tmp / "run" / "checkpoints", 1, **state.checkpoint_objects()).save(7)
    path = run_export_onnx(cfg, state.strategy, str(tmp / "run"), tmp / "out" / "m.onnx", size=SIZE,
                           probabilities=True, progress=False)
    return {"tmp": tmp, "cfg": cfg, "state": state, "path": path, "config": str(tmp / "config.yaml")}


def val_samples(run):
    root = run["tmp"] / "data"
    ids = (root / "ImageSets" / "Segmentation" / "val.txt").read_text().split()
    return [(np.asarray(Image.open(root / "JPEGImages" / f"{i}.jpg").convert("RGB")),
             np.asarray(Image.open(root / "SegmentationClass" / f"{i}.png"))) for i in ids]


def keras_reference(model, images, mean, std, offsets=0.0):
    """The Keras model on the normalised uint8 images, `offsets` subtracted from its logits: (argmax, softmax,
    pixels whose top two logits are more than MARGIN apart)."""
    x = (images.astype(np.float32) - np.float32(mean)) / np.float32(std)
    logits = model(x, training=False).numpy().astype(np.float64) - offsets
    top2 = np.sort(logits, axis=-1)[..., -2:]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    atol = max(PROBABILITY_ATOL, LOGIT_RTOL * np.abs(logits).max())
    return logits.argmax(-1), p / p.sum(-1, keepdims=True), top2[..., 1] - top2[..., 0] > MARGIN, atol


def assert_matches_keras(info, classes, probabilities, reference, size):
    """The file as ONNX Runtime ran it outside seg_train: uint8 NHWC image in, classes (and the softmax) out,
    Keras' argmax on the clear pixels and its softmax within the module doc's tolerance."""
    expected, softmax, clear, atol = reference
    h, w = size
    assert info["input"] == ["image", "tensor(uint8)", [1, h, w, 3]], info["input"]
    assert info["outputs"][0] == ["classes", "tensor(uint8)", [1, h, w]], info["outputs"]
    assert [o[0] for o in info["outputs"]] == ["classes", "probabilities"]
    assert info["opset"] == [["", 15]] or ["", 15] in info["opset"], info["opset"]
    assert len(np.unique(expected)) >= 2  # a model predicting one class everywhere would prove nothing
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(classes[clear], expected[clear])
    np.testing.assert_allclose(probabilities, softmax, rtol=0, atol=atol)


def test_file_runs_outside_seg_train_and_predicts_what_keras_does(run):
    """Fails for: a file that normalises with other numbers than data.mean / data.std, reads its input as BGR
    or NCHW, loses the argmax or the softmax, or needs seg_train or TensorFlow to run."""
    tmp = run["tmp"]
    images = np.stack([np.asarray(Image.fromarray(im).resize(SIZE[::-1], Image.BILINEAR))
                       for im, _ in val_samples(run)])
    np.save(tmp / "images.npy", images)
    info, classes = run_outside(run["path"], tmp / "images.npy", tmp / "classes.npy")
    probabilities = np.load(tmp / "classes_probabilities.npy")
    assert_matches_keras(info, classes, probabilities, keras_reference(run["state"].model, images, MEAN, STD), SIZE)
    assert "ArgMax" in info["ops"] and "Softmax" in info["ops"]


def test_sidecar_json_describes_the_file(run):
    """Fails for: a FILE.json that is not the .tflite file's kind (format, input, normalisation, classes), or
    that misstates the file's size, opset or tensors."""
    meta = json.loads(run["path"].with_suffix(".json").read_text())
    assert meta["format"] == "onnx" and meta["quantization"] == "none" and meta["step"] == 7
    assert meta["size_bytes"] == os.path.getsize(run["path"]) and meta["opset"] == 15
    assert meta["converter"].startswith("tf2onnx ")
    assert meta["input"]["name"] == "image" and meta["input"]["dtype"] == "uint8"
    assert meta["input"]["shape"] == [1, *SIZE, 3] and meta["input"]["layout"] == "NHWC"
    assert [(o["name"], o["dtype"], o["shape"]) for o in meta["outputs"]] == \
        [("classes", "uint8", [1, *SIZE]), ("probabilities", "float32", [1, *SIZE, 3])]
    assert meta["mean"] == MEAN and meta["std"] == STD and meta["input_size"] == list(SIZE)
    assert meta["num_classes"] == 3 and len(meta["class_names"]) == 3
    assert meta["ops"]["ArgMax"] == 1 and meta["ops"]["Conv"] >= 2


def independent_eval(path, samples, c=3):
    """The app's protocol by hand: Pillow resize in, ONNX Runtime, Pillow nearest back, numpy counts."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    h, w = inp.shape[1:3]
    cm = np.zeros((c, c), np.int64)
    preds = []
    for image, label in samples:
        x = image if image.shape[:2] == (h, w) else np.asarray(Image.fromarray(image).resize((w, h), Image.BILINEAR))
        (pred,) = session.run(["classes"], {"image": x[None]})
        pred = pred[0]
        if pred.shape != label.shape:
            pred = np.asarray(Image.fromarray(pred).resize(label.shape[::-1], Image.NEAREST))
        preds.append(pred)
        cm += confusion_matrix(label, pred, c)
    return cm, preds


def test_seg_eval_model_onnx_equals_onnx_runtime_by_hand(run, capsys):
    """seg-eval --model FILE.onnx --json: the confusion matrix of ONNX Runtime run here by hand on the same
    images, and the record a .tflite file gets. Fails for: a file evaluated without its resizes, with a
    transposed matrix, without FILE.json (its step and checkpoint), or timed over nothing."""
    path = run["path"]
    assert eval_main(["--config", run["config"], "--model", str(path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cm, _ = independent_eval(path, val_samples(run))
    assert cm.sum() > 0 and np.count_nonzero(cm - np.diag(np.diag(cm)))  # errors off the diagonal too
    np.testing.assert_array_equal(np.array(record["confusion_matrix"]), cm)
    tp = np.diag(cm)
    assert record["miou"] == pytest.approx(np.nanmean(tp / (cm.sum(0) + cm.sum(1) - tp)), abs=1e-12)
    assert record["format"] == "onnx" and record["runtime"] == "ONNX Runtime" and record["step"] == 7
    assert record["num_images"] == 6 and record["size_bytes"] == os.path.getsize(path)
    assert record["latency_ms"]["invokes"] == 6 and record["latency_ms"]["median"] > 0
    assert json.loads((path.parent / f"{path.stem}.eval-val.json").read_text()) == record


def test_seg_predict_model_onnx_writes_the_files_class_maps(run):
    """Fails for: seg-predict --model FILE.onnx writing anything but ONNX Runtime's class maps at the images'
    size."""
    samples = val_samples(run)
    root = run["tmp"] / "data" / "JPEGImages"
    ids = (run["tmp"] / "data" / "ImageSets" / "Segmentation" / "val.txt").read_text().split()[:2]
    out = run["tmp"] / "pred"
    assert predict_main(["--config", run["config"], "--model", str(run["path"]), "--output", str(out),
                         *[str(root / f"{i}.jpg") for i in ids]]) == 0
    _, preds = independent_eval(run["path"], samples[:2])
    for i, pred in zip(ids, preds):
        np.testing.assert_array_equal(np.asarray(Image.open(out / f"{i}.png")), pred)


def test_export_command_with_check(run, capsys):
    """seg-export --format onnx --check --input-size: the command's file at that size, measured in ONNX Runtime
    on the val split. Fails for: --input-size or --check dropped on the way to the ONNX export."""
    out = run["tmp"] / "cli" / "c.onnx"
    assert export_main(["--config", run["config"], "--checkpoint", str(run["tmp"] / "run"), "--format", "onnx",
                        "--input-size", "64", "32", "--check", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "check on val (6 images), ONNX Runtime, 1 thread(s):" in text and "c.onnx" in text
    assert json.loads(out.with_suffix(".json").read_text())["input"]["shape"] == [1, 64, 32, 3]


@pytest.mark.parametrize("argv, line", [
    (["--format", "onnx", "--quantize", "int8", "--output", "m.onnx"], "error: --quantize needs --format tflite "),
    (["--format", "onnx", "--output", "m.tflite"], "error: output is not a .onnx file (m.tflite): "),
    (["--format", "onnx", "--check", "--threads", "0", "--output", "m.onnx"], "error: invalid --threads "),
    (["--probabilities", "--output", "x"], "error: --probabilities needs --format tflite or onnx (--probabilities): "),
])
def test_export_flag_errors_are_one_line(run, argv, line, capsys, monkeypatch):
    monkeypatch.chdir(run["tmp"])
    assert export_main(["--config", run["config"], "--checkpoint", "run", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
    assert not (run["tmp"] / "m.onnx").exists()


def test_an_output_name_taken_by_the_tflite_export_is_refused(run, tmp_path, capsys):
    """m.tflite exists: seg-export --format onnx --output m.onnx would replace its m.json. Fails for: the .tflite
    file's description overwritten (seg-eval --model m.tflite would then read the ONNX file's)."""
    (tmp_path / "m.tflite").write_bytes(b"tflite")
    (tmp_path / "m.json").write_text('{"format": "tflite"}')
    assert export_main(["--config", run["config"], "--checkpoint", str(run["tmp"] / "run"), "--format", "onnx",
                        "--output", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: output name taken by another export ({tmp_path / 'm.onnx'}): "
                                               "a name of its own (m.tflite is described by m.json)"), err
    assert json.loads((tmp_path / "m.json").read_text()) == {"format": "tflite"}


def test_without_the_onnx_extra_the_commands_say_how_to_install_it(run, tmp_path):
    """tf2onnx (seg-export --format onnx) or onnxruntime (seg-eval --model FILE.onnx) missing: one line naming
    the extra, exit 2, no file. Fails for: a traceback, or the export's work done before the missing converter
    is noticed."""
    cases = [("tf2onnx", "export_main", ["--checkpoint", str(run["tmp"] / "run"), "--format", "onnx",
                                         "--output", str(tmp_path / "m.onnx")], "tf2onnx"),
             ("onnxruntime", "eval_main", ["--model", str(run["path"])], "onnxruntime")]
    for module, command, argv, what in cases:
        # sys.modules[name] = None: Python's own way to make `import name` fail and find_spec not find it.
        code = (f"import sys; sys.modules[{module!r}] = None; from seg_train.cli import {command}; "
                f"sys.exit({command}(sys.argv[1:]))")
        out = subprocess.run([sys.executable, "-c", code, "--config", run["config"], *argv], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert lines == [lines[-1]] and lines[0].startswith(f"error: {what} is not installed ("), lines
        assert "pip install 'seg-train[onnx]'" in lines[0]
    assert not (tmp_path / "m.onnx").exists()


def frozen(fn, shape):
    from seg_train.infer.tflite_export import frozen_function

    return frozen_function(tf.function(fn, input_signature=[tf.TensorSpec(shape, tf.float32, name="image")]))


def test_erfc_converts_to_one_minus_erf():
    """TensorFlow's exact GELU computes erfc, which tf2onnx 1.17 leaves unmapped: seg-export's handler gives
    ONNX Runtime 1 - Erf(x), held to math.erfc. Fails for: Erfc written as Erf (GELU then wrong in every ViT)."""
    import onnxruntime

    from seg_train.infer.onnx_export import convert

    x = np.linspace(-4, 4, 17, dtype=np.float32)[None]
    content = convert(frozen(lambda v: {"classes": tf.math.erfc(v)}, [1, 17]))
    session = onnxruntime.InferenceSession(content, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    np.testing.assert_allclose(got[0], [math.erfc(float(v)) for v in x[0]], rtol=0, atol=1e-6)


def test_sigmoid_keeps_its_tails():
    """Sigmoid in the file, run by ONNX Runtime, within 1e-6 relative of 1 / (1 + exp(-x)) computed in double
    precision, down to x = -80. Fails for: ONNX's Sigmoid op, whose ONNX Runtime kernel returns 0 below
    x = -18, which changed EoMT's class on pixels that every query's mask leaves far outside."""
    import onnxruntime

    from seg_train.infer.onnx_export import convert

    x = np.array([[-80, -40, -25, -18, -17, -10, -1, 0, 1, 10, 20, 80]], np.float32)
    content = convert(frozen(lambda v: {"classes": tf.sigmoid(v)}, list(x.shape)))
    session = onnxruntime.InferenceSession(content, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    np.testing.assert_allclose(got[0], [1 / (1 + math.exp(-float(v))) for v in x[0]], rtol=1e-6, atol=0)


def test_an_op_tf2onnx_cannot_convert_is_one_line():
    """tf2onnx logs an op it has no handler for and leaves it in the graph; the export refuses it, naming it.
    Fails for: a .onnx file ONNX Runtime cannot open."""
    from seg_train.infer.onnx_export import convert

    with pytest.raises(ConfigError, match=r"cannot convert the model to ONNX.*got Lgamma \(no ONNX op at opset 15\)"):
        convert(frozen(lambda v: {"classes": tf.math.lgamma(v)}, [1, 4]))


# (head, backbone, input size, more model keys): every family seg-export writes. A DINO backbone is a
# 2-block ViT of that family (tiny_vit), mit_b0 is tests/helpers.py's TINY_MIT_B0 (a block per stage), both built
# through models.build as the named one would be.
FAMILIES = {
    "deeplabv3plus-mobilenetv2-os8": ("deeplabv3plus", "mobilenetv2", (32, 48), {"output_stride": 8}),
    "lraspp-mobilenetv3_small": ("lraspp", "mobilenetv3_small", (32, 48), {"output_stride": 16}),
    # At its default head widths: with 16/16/8 its logits reach ~110, not several hundred, while the file's
    # softmax still differs from Keras' by ~1.9e-4 (float32 rounding), beyond LOGIT_RTOL of them (measured).
    "deeplabv3plus-resnet50": ("deeplabv3plus", "resnet50", (32, 48), {}),
    "segformer-mit_b0": ("segformer", "mit_b0", (32, 48), {"segformer_channels": 16}),
    "linear-dinov3": ("linear", "dinov3_vits16", (32, 48), {"vit_layers": [2]}),
    "linear-dinov2_reg": ("linear", "dinov2_vits14_reg", (28, 42), {"vit_layers": [1, 2]}),
    "pyramid-deeplabv3plus-dinov3": ("deeplabv3plus", "dinov3_vits16plus", (32, 48),
                                     {"vit_layers": [2], "neck_channels": 16, "aspp_channels": 16,
                                      "decoder_channels": 16, "low_level_channels": 8}),
    "pyramid-segformer-dinov2": ("segformer", "dinov2_vits14", (28, 42),
                                 {"vit_layers": [1, 2], "neck_channels": 16, "segformer_channels": 16}),
    "eomt-dinov3": ("eomt", "dinov3_vits16", (32, 48), {"num_queries": 4, "eomt_blocks": 1}),
    "eomt-dinov2": ("eomt", "dinov2_vits14", (28, 42), {"num_queries": 4, "eomt_blocks": 1}),
}


def tiny_vit(name):
    """A 2-block ViT of `name`'s family (width 32, 2 heads): its patch, registers, gated MLP, position scheme."""
    from dataclasses import replace

    from seg_train.config.variants import VIT_VARIANTS

    spec = VIT_VARIANTS[name]
    return replace(spec, width=32, depth=2, heads=2, mlp=64, pos_grid=4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_converts_and_predicts_what_keras_does_outside_seg_train(family, tmp_path, monkeypatch):
    """Each model family's app function, converted as seg-export converts it, run by ONNX Runtime in a process
    without seg_train: Keras' argmax and softmax (module doc's tolerances). Fails for: an op tf2onnx maps
    wrongly or leaves out (TensorFlow's Erfc in every ViT's GELU), a layout or normalisation slip."""
    from seg_train import models
    from seg_train.config import ModelConfig
    from seg_train.config.variants import MIT_VARIANTS, VIT_VARIANTS
    from seg_train.infer.onnx_export import convert
    from seg_train.infer.tflite_export import app_function, frozen_function

    head, backbone, (h, w), keys = FAMILIES[family]
    if backbone in VIT_VARIANTS:
        monkeypatch.setitem(VIT_VARIANTS, backbone, tiny_vit(backbone))
    if backbone == "mit_b0":
        monkeypatch.setitem(MIT_VARIANTS, backbone, TINY_MIT_B0)
    model = models.build(ModelConfig(backbone=backbone, head=head, **keys), 3)
    # At its initial weights a model's logits hardly vary over the image (EoMT's by 3e-4, a MobileNetV3's by
    # 5e-3): one class everywhere, which would prove nothing. Weights of He's scale vary them by about 1.
    perturb(model, seed=1)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (3, h, w, 3), dtype=np.uint8)
    x = (images.astype(np.float32) - np.float32(MEAN)) / np.float32(STD)
    for _ in range(5):  # BN statistics of these images
        model(x, training=True)
    # Each class's mean logit subtracted inside the file (as eval.logit_adjustment's offsets are), so that no
    # class wins everywhere on a constant alone.
    offsets = model(x, training=False).numpy().mean(axis=(0, 1, 2))
    reference = keras_reference(model, images, MEAN, STD, offsets)
    content = convert(frozen_function(app_function(model, MEAN, STD, h, w, probabilities=True, offsets=offsets)))
    (tmp_path / "m.onnx").write_bytes(content)
    np.save(tmp_path / "images.npy", images)
    info, classes = run_outside(tmp_path / "m.onnx", tmp_path / "images.npy", tmp_path / "classes.npy")
    assert_matches_keras(info, classes, np.load(tmp_path / "classes_probabilities.npy"), reference, (h, w))
