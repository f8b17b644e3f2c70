"""seg-export --format tflite, and seg-eval / seg-predict --model FILE.tflite, held to outside references:
LiteRT's own interpreter in a process that never imports seg_train, the Keras model's own argmax, and an
evaluation written here by hand (Pillow resize, the interpreter, a numpy confusion matrix)."""

import json
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
from seg_train.infer.metrics import compute_metrics
from seg_train.infer.tflite_export import run_export_tflite
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run.state import TrainState
from tests.helpers import TINY_VITS16, confusion_matrix, run_outside, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

pytest.importorskip("ai_edge_litert")  # the tests install it (the 'test' extra); users opt in with [tflite]

SIZE = (32, 48)       # the exported input size (H, W)
IMAGE = (40, 56)      # the data's image size: evaluation resizes in and out
QUANTIZATIONS = ("none", "float16", "int8")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny model with BN statistics of the data, saved as a checkpoint, and its three exports."""
    tmp = tmp_path_factory.mktemp("tflite")
    synthetic.generate(tmp / "data", num_train=12, num_val=6, size=IMAGE, num_classes=3, seed=1)
    # data.mean / data.std not the backbone's defaults: the file must normalise with the configured ones.
    cfg = tiny_config(tmp, data_root=tmp / "data", data={"crop_size": list(SIZE), "mean": [100.0, 110.0, 120.0],
                                                         "std": [50.0, 40.0, 60.0]}, eval={"bn_reestimate_batches": 0})
    state = TrainState(cfg, tf.distribute.MirroredStrategy(["/device:CPU:0"]))
    images = np.stack([np.asarray(Image.open(p)) for p in sorted((tmp / "data" / "JPEGImages").glob("*.jpg"))])
    x = (images.astype(np.float32) - np.float32(cfg.data.mean)) / np.float32(cfg.data.std)
    for _ in range(30):  # BN statistics of these images: an untrained model then predicts several classes
        state.model(x, training=True)
    state.step.assign(7)
    ckpt_lib.Checkpointer(tmp / "run" / "checkpoints", 1, **state.checkpoint_objects()).save(7)
    files = {}
    for q in QUANTIZATIONS:
        files[q] = run_export_tflite(cfg, state.strategy, str(tmp / "run"), tmp / "out" / f"{q}.tflite", size=SIZE,
                                     quantize=q, calibration_images=8, progress=False)
    return {"tmp": tmp, "cfg": cfg, "state": state, "files": files, "config": str(tmp / "config.yaml")}


def val_samples(run):
    root = run["tmp"] / "data"
    ids = (root / "ImageSets" / "Segmentation" / "val.txt").read_text().split()
    return [(np.asarray(Image.open(root / "JPEGImages" / f"{i}.jpg").convert("RGB")),
             np.asarray(Image.open(root / "SegmentationClass" / f"{i}.png"))) for i in ids]


def keras_classes(run, images):
    """The Keras model's own argmax and top-2 logit margin on the normalised images (the float reference)."""
    cfg = run["cfg"]
    x = (images.astype(np.float32) - np.float32(cfg.data.mean)) / np.float32(cfg.data.std)
    logits = run["state"].model(x, training=False).numpy()
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return logits.argmax(-1), top2[..., 1] - top2[..., 0]


@pytest.fixture(scope="module")
def outside(run):
    """Each export run by LiteRT in a process without seg_train: (what it reported, its class maps)."""
    tmp = run["tmp"]
    images = np.stack([np.asarray(Image.fromarray(im).resize(SIZE[::-1], Image.BILINEAR))
                       for im, _ in val_samples(run)])
    np.save(tmp / "images.npy", images)
    results = {q: run_outside(path, tmp / "images.npy", tmp / f"{q}.npy") for q, path in run["files"].items()}
    return images, results


@pytest.mark.parametrize("q", QUANTIZATIONS)
def test_file_runs_in_stock_litert_with_builtins_uint8_in_classes_out(outside, q):
    images, results = outside
    info, classes = results[q]
    assert info["input"] == ["uint8", [1, *SIZE, 3]]
    assert info["outputs"] == [["uint8", [1, *SIZE]]]
    # Select TF ops would appear as custom ops (Flex*); the stock interpreter could not run them.
    assert not [op for op in info["ops"] if op.startswith("Flex") or op in ("CUSTOM", "DELEGATE")], info["ops"]
    assert "ARG_MAX" in info["ops"]
    assert classes.shape == (len(images), *SIZE) and set(np.unique(classes)) <= {0, 1, 2}


def test_exports_predict_what_the_keras_model_predicts(run, outside):
    """Float32: exactly Keras' argmax wherever the top two logits are not nearly tied; float16 and int8 close."""
    images, results = outside
    reference, margin = keras_classes(run, images)
    assert len(np.unique(reference)) >= 2  # a model predicting one class everywhere would prove nothing
    clear = margin > 1e-3
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(results["none"][1][clear], reference[clear])
    assert (results["float16"][1] == reference).mean() > 0.99
    assert (results["int8"][1] == reference).mean() > 0.9


def test_sidecar_json_describes_the_file(run):
    cfg = run["cfg"]
    for q, path in run["files"].items():
        meta = json.loads(path.with_suffix(".json").read_text())
        assert meta["quantization"] == q and meta["step"] == 7
        assert meta["size_bytes"] == os.path.getsize(path)
        assert meta["input"]["shape"] == [1, *SIZE, 3] and meta["input"]["dtype"] == "uint8"
        assert meta["mean"] == list(cfg.data.mean) and meta["std"] == list(cfg.data.std)
        assert meta["num_classes"] == 3 and len(meta["class_names"]) == 3
        assert meta["builtin_ops_only"] is True
    int8 = json.loads(run["files"]["int8"].with_suffix(".json").read_text())
    train = (run["tmp"] / "data" / "ImageSets" / "Segmentation" / "train.txt").read_text().split()
    assert int8["calibration"]["images"] == 8 and set(int8["calibration"]["ids"]) <= set(train)
    # Only the uint8 input's conversion computes in float; every conv runs in int8.
    assert set(int8["float32_ops"]) <= {"CAST", "QUANTIZE"}, int8["float32_ops"]
    none = json.loads(run["files"]["none"].with_suffix(".json").read_text())
    assert none["calibration"] is None and "CONV_2D" in none["float32_ops"]
    sizes = {q: os.path.getsize(p) for q, p in run["files"].items()}
    assert sizes["int8"] < sizes["float16"] < sizes["none"]


def test_logit_adjustment_is_in_the_file(run, outside):
    """eval.logit_adjustment: LiteRT, outside seg_train, predicts argmax(Keras logits - tau log w_c), and
    the sidecar JSON gives the offsets. Fails for a file that ignores the adjustment seg-eval measured."""
    from seg_train import config as config_lib

    images, results = outside
    weights, tau = [4.0, 1.0, 0.25], 1.0
    cfg = config_lib.replace(config_lib.replace(run["cfg"], "loss.class_weights", weights),
                             "eval.logit_adjustment", tau)
    path = run_export_tflite(cfg, run["state"].strategy, str(run["tmp"] / "run"), run["tmp"] / "adjusted.tflite",
                             size=SIZE, progress=False)
    _, classes = run_outside(path, run["tmp"] / "images.npy", run["tmp"] / "adjusted.npy")
    x = (images.astype(np.float32) - np.float32(cfg.data.mean)) / np.float32(cfg.data.std)
    logits = run["state"].model(x, training=False).numpy() - tau * np.log(weights)
    top2 = np.sort(logits, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-3
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(classes[clear], logits.argmax(-1)[clear])
    assert (classes != results["none"][1]).mean() > 0.05  # it moved predictions: not the plain file again
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["logit_adjustment"] == tau
    np.testing.assert_allclose(list(meta["score_offsets"].values()), tau * np.log(weights), rtol=1e-6)


def independent_eval(path, samples, c=3):
    """The app's protocol by hand: Pillow resize in, LiteRT, Pillow nearest back, numpy counts."""
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=str(path))
    it.allocate_tensors()
    (inp,), (out,) = it.get_input_details(), it.get_output_details()
    h, w = inp["shape"][1:3]
    cm = np.zeros((c, c), np.int64)
    preds = []
    for image, label in samples:
        x = image if image.shape[:2] == (h, w) else np.asarray(Image.fromarray(image).resize((w, h), Image.BILINEAR))
        it.set_tensor(inp["index"], x[None])
        it.invoke()
        pred = it.get_tensor(out["index"])[0]
        if pred.shape != label.shape:
            pred = np.asarray(Image.fromarray(pred).resize(label.shape[::-1], Image.NEAREST))
        preds.append(pred)
        cm += confusion_matrix(label, pred, c)
    return cm, preds


@pytest.mark.parametrize("q", ["none", "int8"])
def test_seg_eval_model_json_equals_an_independent_evaluation(run, q, capsys):
    path = run["files"][q]
    assert eval_main(["--config", run["config"], "--model", str(path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cm, _ = independent_eval(path, val_samples(run))
    assert cm.sum() > 0
    np.testing.assert_array_equal(np.array(record["confusion_matrix"]), cm)
    tp = np.diag(cm)
    iou = tp / (cm.sum(0) + cm.sum(1) - tp)
    assert record["miou"] == pytest.approx(np.nanmean(iou), abs=1e-12)
    assert record["num_images"] == 6 and record["quantization"] == q
    assert record["size_bytes"] == os.path.getsize(path)
    assert record["latency_ms"]["invokes"] == 6 and record["latency_ms"]["median"] > 0
    assert set(record["per_class_iou"]) == set(json.loads(path.with_suffix(".json").read_text())["class_names"])
    written = json.loads((path.parent / f"{path.stem}.eval-val.json").read_text())
    assert written == record


def test_export_at_the_image_size_is_not_resized(run, capsys):
    """An input size equal to the images': the file sees the images as they are (no resize either way)."""
    out = run["tmp"] / "native" / "m.tflite"
    assert export_main(["--config", run["config"], "--checkpoint", str(run["tmp"] / "run"), "--format", "tflite",
                        "--input-size", *map(str, IMAGE), "--output", str(out)]) == 0
    assert eval_main(["--config", run["config"], "--model", str(out), "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    samples = val_samples(run)
    reference, margin = keras_classes(run, np.stack([im for im, _ in samples]))
    labels = np.stack([lb for _, lb in samples])
    clear = (margin > 1e-3).all(axis=(1, 2))  # images without a near tie anywhere
    cm = sum(confusion_matrix(labels[i], reference[i], 3) for i in np.flatnonzero(clear))
    if clear.all():
        np.testing.assert_array_equal(np.array(record["confusion_matrix"]), cm)
    assert record["input_size"] == list(IMAGE)
    assert compute_metrics(np.array(record["confusion_matrix"])).miou == pytest.approx(record["miou"])


def test_seg_predict_model_writes_the_files_class_maps(run):
    samples = val_samples(run)
    root = run["tmp"] / "data" / "JPEGImages"
    ids = (run["tmp"] / "data" / "ImageSets" / "Segmentation" / "val.txt").read_text().split()[:2]
    out = run["tmp"] / "pred"
    assert predict_main(["--config", run["config"], "--model", str(run["files"]["int8"]), "--output", str(out),
                         *[str(root / f"{i}.jpg") for i in ids]]) == 0
    _, preds = independent_eval(run["files"]["int8"], samples[:2])
    for i, pred in zip(ids, preds):
        np.testing.assert_array_equal(np.asarray(Image.open(out / f"{i}.png")), pred)
        assert (out / f"{i}_overlay.jpg").is_file()


def test_check_prints_float_and_exported_side_by_side(run, capsys):
    """With a logit adjustment, which both files carry: no warning that the float32 reference lacks it (it
    once had no sidecar, so seg-eval's check read its adjustment as 0)."""
    out = run["tmp"] / "check" / "q.tflite"
    assert export_main(["--config", run["config"], "--checkpoint", str(run["tmp"] / "run"), "--format", "tflite",
                        "--quantize", "int8", "--calibration-images", "4", "--check", "--input-size", *map(str, SIZE),
                        "--output", str(out), "--set", "loss.class_weights=[4.0, 1.0, 0.25]",
                        "--set", "eval.logit_adjustment=1.0"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "float32 (not written)" in text and "q.tflite" in text and "exported - float32:" in text
    assert "check on val (6 images)" in text
    assert "logit_adjustment" not in captured.err, captured.err


def test_float_ops_keeps_the_named_ops_in_float32(run, tmp_path):
    """seg-export --quantize int8 --float-ops CONV_2D: every CONV_2D of the file computes in float32 (the
    sidecar counts them from the file itself) and the JSON names the request; without the flag none does.
    Fails for a flag that does not reach the converter. A name the model does not have is one line and no
    file."""
    out = tmp_path / "f.tflite"
    assert export_main(["--config", run["config"], "--checkpoint", str(run["tmp"] / "run"), "--format", "tflite",
                        "--quantize", "int8", "--calibration-images", "4", "--input-size", *map(str, SIZE),
                        "--float-ops", "CONV_2D", "--output", str(out)]) == 0
    meta = json.loads(out.with_suffix(".json").read_text())
    plain = json.loads(run["files"]["int8"].with_suffix(".json").read_text())
    assert meta["float_ops_requested"] == ["CONV_2D"] and meta["ops"]["CONV_2D"] >= 2
    assert meta["float32_ops"]["CONV_2D"] == meta["ops"]["CONV_2D"] and "CONV_2D" not in plain["float32_ops"]
    with pytest.raises(ConfigError, match="not an op of this model"):
        run_export_tflite(run["cfg"], run["state"].strategy, str(run["tmp"] / "run"), tmp_path / "g.tflite",
                          size=SIZE, quantize="int8", calibration_images=2, progress=False, float_ops=("GELU",))
    assert not (tmp_path / "g.tflite").exists()


@pytest.mark.parametrize("argv, line", [
    (["--quantize", "int8", "--output", "x"], "error: --quantize needs --format tflite (--quantize): "),
    (["--format", "tflite", "--output", "m.tflite", "--float-ops", "SOFTMAX"],
     "error: --float-ops needs --quantize int8 (--float-ops): "),
    (["--format", "tflite", "--quantize", "int8", "--output", "m.tflite", "--float-ops", "softmax"],
     "error: invalid --float-ops (--float-ops): "),
    (["--format", "tflite", "--output", "x.pb"], "error: output is not a .tflite file (x.pb): "),
    (["--format", "tflite", "--output", "m.tflite", "--calibration-images", "0"],
     "error: invalid --calibration-images (--calibration-images): "),
    (["--format", "tflite", "--output", "m.tflite", "--threads", "0"], "error: invalid --threads (--threads): "),
])
def test_export_flag_errors_are_one_line(run, argv, line, capsys, monkeypatch):
    monkeypatch.chdir(run["tmp"])
    assert export_main(["--config", run["config"], "--checkpoint", "run", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err
    assert not (run["tmp"] / "m.tflite").exists()


def test_model_threads_below_one_is_one_line(run, capsys):
    assert eval_main(["--config", run["config"], "--model", str(run["files"]["int8"]), "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: invalid --threads (--threads): "), err


def test_without_litert_the_model_commands_say_how_to_install_it(run, tmp_path):
    """ai-edge-litert missing (an import that fails, as Python reports it): one line, exit 2, before any work."""
    fake = tmp_path / "site"
    (fake / "ai_edge_litert").mkdir(parents=True)
    (fake / "ai_edge_litert" / "__init__.py").write_text("raise ImportError(\"No module named 'ai_edge_litert'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), os.getcwd()]))
    for cmd in (["seg_train.cli", "eval_main", "--model", str(run["files"]["int8"])],
                ["seg_train.cli", "export_main", "--checkpoint", str(run["tmp"] / "run"), "--format", "tflite",
                 "--check", "--output", str(tmp_path / "m.tflite")]):
        code = f"import sys; from {cmd[0]} import {cmd[1]}; sys.exit({cmd[1]}(sys.argv[1:]))"
        out = subprocess.run([sys.executable, "-c", code, "--config", run["config"], *cmd[2:]], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert lines == [lines[-1]] and lines[0].startswith("error: ai-edge-litert is not installed ("), lines
        assert "pip install 'seg-train[tflite]'" in lines[0]
    assert not (tmp_path / "m.tflite").exists()


def test_mobilenetv3_int8_runs_whole_in_xnnpack():
    """MobileNetV3's hard-swish (models.cnn.backbones.HardSwish) is Keras' function, and its int8 file runs in one
    XNNPACK partition: Keras' own form converts to HARD_SWISH, which LiteRT's XNNPACK has no int8 kernel for,
    and every activation would then split the graph (the int8 file ran slower than the float32 one)."""
    import keras
    from ai_edge_litert.interpreter import Interpreter

    from seg_train import models
    from seg_train.config import ModelConfig
    from seg_train.infer.tflite_export import app_function, convert, frozen_function
    from seg_train.models.cnn.backbones import HardSwish

    x = np.linspace(-8, 8, 480, dtype=np.float32).reshape(1, 4, 8, 15)
    np.testing.assert_allclose(HardSwish()(x).numpy(), keras.activations.hard_swish(x).numpy(), atol=1e-6)
    model = models.build(ModelConfig(backbone="mobilenetv3_small", head="lraspp", output_stride=16), 3)
    assert sum(isinstance(layer, HardSwish) for layer in models.backbone_of(model).layers) > 0
    rng = np.random.default_rng(0)
    for _ in range(20):  # BN statistics of images: at init MobileNetV3's features are ~1e-10, and XNNPACK
        model(rng.normal(size=(4, 32, 48, 3)).astype(np.float32), training=True)  # refuses such int8 scales
    fn = frozen_function(app_function(model, [127.5] * 3, [127.5] * 3, 32, 48))
    content = convert(fn, "int8", lambda: ([rng.integers(0, 256, (1, 32, 48, 3), dtype=np.uint8)] for _ in range(2)))
    interpreter = Interpreter(model_content=content)
    interpreter.allocate_tensors()
    ops = [op["op_name"] for op in interpreter._get_ops_details()]
    assert "HARD_SWISH" not in ops and ops.count("DELEGATE") == 1, sorted(set(ops))


@pytest.mark.parametrize("backbone, head, size", [("dinov3_vits16", "linear", (32, 48)),
                                                  ("dinov2_vits14_reg", "linear", (28, 42)),
                                                  ("dinov3_vits16", "eomt", (32, 48))])
def test_vit_file_is_builtins_and_predicts_what_keras_does(backbone, head, size, tmp_path, monkeypatch):
    """A DINO ViT + linear head (one block), and EoMT (on dinov3_vits16's structure at tests/helpers.py's
    TINY_VITS16 size: the ops are the same at any depth), convert to builtin ops only (no Flex: the rotary table,
    the resized position embeddings, the attention and EoMT's semantic sum are all TFLite builtins, computed for
    the file's fixed size), and the file, run by stock LiteRT in a process without seg_train or TensorFlow,
    predicts Keras' argmax in float32; its int8 file mostly agrees (random weights, so only a loose bound)."""
    from seg_train import models
    from seg_train.config import ModelConfig
    from seg_train.config.variants import VIT_VARIANTS
    from seg_train.infer.tflite_export import app_function, convert, frozen_function

    if head == "eomt":
        monkeypatch.setitem(VIT_VARIANTS, "dinov3_vits16", TINY_VITS16)

    keys = {"vit_layers": [1]} if head == "linear" else {"num_queries": 4, "eomt_blocks": 1}
    model = models.build(ModelConfig(backbone=backbone, head=head, **keys), 3)
    rng = np.random.default_rng(0)
    if head == "eomt":
        # At the tiny width, the transformers' N(0, 0.02) kernels make every query's class and mask logits
        # nearly equal: one class everywhere. Kernels of variance 1 / fan-in give a prediction that varies.
        for v in model.trainable_weights:
            if len(v.shape) >= 2:
                v.assign(rng.normal(0, 1 / np.sqrt(np.prod(v.shape[:-1])), v.shape).astype(np.float32))
    h, w = size
    images = rng.integers(0, 256, (4, h, w, 3), dtype=np.uint8)
    mean, std = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]
    x = (images.astype(np.float32) - np.float32(mean)) / np.float32(std)
    for _ in range(10):  # the head's BN statistics of these images
        model(x, training=True)
    logits = model(x, training=False).numpy()
    reference, top2 = logits.argmax(-1), np.sort(logits, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 1e-3
    assert len(np.unique(reference)) >= 2 and clear.mean() > 0.9
    fn = frozen_function(app_function(model, mean, std, h, w))
    np.save(tmp_path / "images.npy", images)
    for q in ("none", "int8"):
        (tmp_path / f"{q}.tflite").write_bytes(convert(fn, q, lambda: ([im[None]] for im in images)))
        info, got = run_outside(tmp_path / f"{q}.tflite", tmp_path / "images.npy", tmp_path / f"{q}.npy")
        ops = info["ops"]
        assert not [op for op in ops if op.startswith("Flex") or op in ("CUSTOM", "DELEGATE")], ops
        if q == "none":
            np.testing.assert_array_equal(got[clear], reference[clear])
        else:
            assert (got == reference).mean() > 0.6
