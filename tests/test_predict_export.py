"""seg-predict and seg-export: palette PNGs of the model's argmax at the original size, overlays,
and a SavedModel that (loaded without seg_train) gives exactly the masks seg-predict wrote."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train.config import ConfigError
from seg_train.data.label_images import voc_colormap
from seg_train.infer.export import check_output, run_export
from seg_train.infer.predict import collect_inputs, run_predict
from seg_train.run import checkpoint as ckpt_lib
from seg_train.run.state import TrainState
from tests.helpers import tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

# Odd sizes (padding to 32 and cropping back), one wider than tall, one taller than wide.
SIZES = {"a": (37, 53), "b": (70, 29), "c": (32, 32)}


def strategy():
    return tf.distribute.MirroredStrategy(["/device:CPU:0"])


def blocks_image(rng, h, w):
    """Blocks of random colours (structure, so the predictions vary across the image)."""
    blocks = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    return np.repeat(np.repeat(blocks, 8, axis=0), 8, axis=1)[:h, :w]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A config, a checkpoint in a run dir, and input images: a folder (a.jpg, b.png) and a file (c.jpg)."""
    tmp = tmp_path_factory.mktemp("predict")
    rng = np.random.default_rng(0)
    (tmp / "in").mkdir()
    (tmp / "more").mkdir()
    images = {}
    for name, (h, w) in SIZES.items():
        images[name] = blocks_image(rng, h, w)
        path = tmp / ("more" if name == "c" else "in") / f"{name}.{'png' if name == 'b' else 'jpg'}"
        Image.fromarray(images[name]).save(path)
        images[name] = np.asarray(Image.open(path).convert("RGB"))  # as decoded (JPEG is lossy)
    (tmp / "in" / "notes.txt").write_text("not an image: skipped in folders\n")
    (tmp / "data").mkdir()
    (tmp / "data" / "classes.txt").write_text("bg\nx\ny\n")
    cfg = tiny_config(tmp, data_root=tmp / "data")
    trainer = TrainState(cfg, strategy())
    # BN statistics for these images (an untrained model predicts nearly one class everywhere).
    x = np.stack([np.asarray(Image.fromarray(im).resize((32, 32)), np.float32) for im in images.values()])
    x = (x - np.array(cfg.data.mean, np.float32)) / np.array(cfg.data.std, np.float32)
    for _ in range(30):
        trainer.model(x, training=True)
    trainer.step.assign(5)
    ckpt_lib.Checkpointer(tmp / "run" / "checkpoints", 1, **trainer.checkpoint_objects()).save(5)
    inputs = [str(tmp / "in"), str(tmp / "more" / "c.jpg")]
    return {"tmp": tmp, "cfg": cfg, "trainer": trainer, "images": images, "inputs": inputs,
            "run_dir": str(tmp / "run")}


@pytest.fixture(scope="module")
def predicted(run):
    out = run["tmp"] / "pred"
    written = run_predict(run["cfg"], strategy(), run["run_dir"], run["inputs"], out, progress=False)
    return out, written


def argmax_reference(cfg, model, image):
    """The model's classes for one image, computed eagerly: normalise, pad to 32, crop, argmax."""
    h, w = image.shape[:2]
    x = (image.astype(np.float32) - np.array(cfg.data.mean, np.float32)) / np.array(cfg.data.std, np.float32)
    x = np.pad(x, [(0, -h % 32), (0, -w % 32), (0, 0)])
    return model(x[None], training=False).numpy()[0, :h, :w].argmax(-1)


def test_predict_writes_palette_pngs_of_the_argmax_at_the_original_size(run, predicted):
    out, written = predicted
    assert [p.name for p in written] == ["a.png", "b.png", "c.png"]
    seen_classes = set()
    for name, image in run["images"].items():
        with Image.open(out / f"{name}.png") as png:
            assert png.mode == "P"
            assert png.size == (image.shape[1], image.shape[0])
            assert png.getpalette()[3:6] == voc_colormap()[1].tolist()  # class 1 shows as VOC red
            classes = np.array(png)
        np.testing.assert_array_equal(classes, argmax_reference(run["cfg"], run["trainer"].model, image))
        seen_classes |= set(np.unique(classes).tolist())
        with Image.open(out / f"{name}_overlay.jpg") as ov:
            assert ov.size == (image.shape[1], image.shape[0]) and ov.mode == "RGB"
    assert len(seen_classes) >= 2  # the masks are not trivially one class
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{n}.png" for n in SIZES] + [f"{n}_overlay.jpg" for n in SIZES])  # no temporary files left


def test_collect_inputs_refuses_missing_files_and_name_collisions(run, tmp_path):
    with pytest.raises(ConfigError, match=r"input not found \(.*nope.jpg\)"):
        collect_inputs([str(tmp_path / "nope.jpg")])
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "a.png")
    with pytest.raises(ConfigError, match="output name collision.*a.png"):
        collect_inputs([run["inputs"][0], str(tmp_path / "a.png")])  # in/a.jpg and a.png -> a.png
    (tmp_path / "bad.jpg").write_text("not a jpeg")
    with pytest.raises(ConfigError, match="unreadable image"):
        collect_inputs([str(tmp_path / "bad.jpg")])
    # The same file twice (as a file and through its folder) is predicted once.
    twice = collect_inputs([run["inputs"][0], os.path.join(run["inputs"][0], "a.jpg")])
    assert [p.name for p in twice] == ["a.jpg", "b.png"]


def test_exported_savedmodel_agrees_with_predict_without_seg_train(run, predicted, tmp_path):
    out, _ = predicted
    export_dir = tmp_path / "model"
    run_export(run["cfg"], strategy(), run["run_dir"], export_dir)
    meta = json.loads((export_dir / "seg_train.json").read_text())
    assert meta["step"] == 5 and meta["class_names"] == ["bg", "x", "y"]
    assert not (tmp_path / "model.tmp").exists()
    names = list(SIZES)
    np.savez(tmp_path / "images.npz", **run["images"])
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import tensorflow as tf
        serve = tf.saved_model.load({str(export_dir)!r}).signatures["serving_default"]
        images = np.load({str(tmp_path / 'images.npz')!r})
        result = {{}}
        for name in {names!r}:
            out = serve(image=tf.constant(images[name]))
            assert out["classes"].dtype == tf.int32, out["classes"].dtype
            result[name] = out["classes"].numpy()
            np.testing.assert_allclose(out["probabilities"].numpy().sum(-1), 1.0, rtol=1e-5)
        assert not any(m == "seg_train" or m.startswith("seg_train.") for m in sys.modules), "imported seg_train"
        np.savez({str(tmp_path / 'classes.npz')!r}, **result)
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(tmp_path / "classes.npz")
    for name, image in run["images"].items():
        assert got[name].shape == image.shape[:2]
        np.testing.assert_array_equal(got[name], np.array(Image.open(out / f"{name}.png")))


def test_export_output_checks_and_force(run, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="output is a file"):
        check_output(tmp_path / "file", force=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.txt").write_text("x")
    with pytest.raises(ConfigError, match="not empty.*--force"):
        run_export(run["cfg"], strategy(), run["run_dir"], full)
    assert (full / "old.txt").exists()
    (tmp_path / "empty").mkdir()
    assert check_output(tmp_path / "empty", force=False) == tmp_path / "empty"
    run_export(run["cfg"], strategy(), run["run_dir"], full, force=True)
    assert (full / "saved_model.pb").is_file() and not (full / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "full"]  # no .tmp/.old left


def test_cli_predict_missing_input_is_a_one_line_user_error(run, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "seg-predict")
    missing = tmp_path / "missing.jpg"
    proc = subprocess.run([exe, "--config", str(run["tmp"] / "config.yaml"), "--checkpoint", run["run_dir"],
                           "--output", str(tmp_path / "out"), str(missing)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: input not found ({missing}): expected an image file or a folder of images"
