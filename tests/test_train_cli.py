"""seg-train end to end through the real command: train, TensorBoard tags, resume, errors."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml
from tests.helpers import run_command as run, write_train_config as write_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

ROOT = Path(__file__).resolve().parents[1]


def event_tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    return set(tags["tensors"]) | set(tags["scalars"]), set(tags["images"]) | set(
        t for t in tags["tensors"] if t.startswith("tower_")), acc


def rewind_to_ckpt2(ckdir):
    """Makes a run's checkpoints/ look killed right after writing ckpt-2: drops ckpt-3, ckpt-4 and their state."""
    for f in [*ckdir.glob("ckpt-3.*"), *ckdir.glob("ckpt-4.*")]:
        f.unlink()
    tf.compat.v1.train.update_checkpoint_state(str(ckdir), str(ckdir / "ckpt-2"),
                                               [str(ckdir / "ckpt-1"), str(ckdir / "ckpt-2")])


def test_train_tags_and_resume(tmp_path, demo_root):
    cfg = write_config(tmp_path, demo_root)
    r = run(["--config", str(cfg), "--gpus", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "logical CPU devices" in r.stderr
    assert re.search(r"step 4/4  loss [0-9.]+  gnorm [0-9.e+-]+  lr ", r.stderr), r.stderr  # the log line
    first = re.search(r"first step done ([0-9.]+)s after launch: tracing ([0-9.]+)s", r.stderr)
    assert first, r.stderr
    run_dir = tmp_path / "run"
    # The same first step, machine-readable (what seg-bench's probes read), with the run's peak memory.
    record = json.loads((run_dir / "first_step.json").read_text())
    assert record["step"] == 1 and record["first_step_s"] > record["tracing_s"] > 0, record
    assert (f"{record['first_step_s']:.1f}", f"{record['tracing_s']:.1f}") == first.groups(), (record, first)
    assert record["peak_rss_mb"] > 0, record
    assert (run_dir / "config.yaml").is_file()
    assert tf.train.latest_checkpoint(str(run_dir / "checkpoints")).endswith("ckpt-4")
    scalars, images, acc = event_tags(run_dir)
    for tag in ["loss/total", "loss/weight_decay", "loss/tower_0", "loss/tower_1", "learning_rate",
                "throughput/images_per_sec", "gradients/global_norm", "gradients/norm/tower_0",
                "gradients/norm/tower_1", "gradients/clipped"]:
        assert tag in scalars, (tag, scalars)
    for i in range(2):
        for kind in ("image", "label", "prediction"):
            assert f"tower_{i}/{kind}" in images, images
    lrs = [float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors("learning_rate")]
    assert len(lrs) == 4 and lrs[0] > lrs[-1] > 0  # poly decay

    # Already complete: exits 0 without training.
    r = run(["--config", str(cfg), "--gpus", "2"], tmp_path)
    assert r.returncode == 0 and "already complete" in r.stderr

    # Extend the run: it resumes from the saved step and the schedule continues from there.
    r = run(["--config", str(cfg), "--gpus", "2", "--set", "train.num_steps=6"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resumed from step 4" in r.stderr
    assert tf.train.latest_checkpoint(str(run_dir / "checkpoints")).endswith("ckpt-6")


def test_resume_after_crash_equals_uninterrupted(tmp_path, demo_root):
    """A run that died right after its step-2 checkpoint (a copy of the straight run's dir without
    ckpt-3 and ckpt-4, as a kill leaves it) and was rerun ends bitwise equal to the straight run, with
    an evaluation in the middle: at step 2 the BN statistics are re-estimated, then the checkpoint is
    written, so the resumed run must start from the re-estimated statistics as the straight run went on
    with them. ckpt-3 (no evaluation before it) holds the statistics the step after the evaluation
    left; ckpt-4 the weights and slots. Each update is 2 micro-batches (train.accumulate_steps): the
    resumed run must pick up the stream at micro-batch 2 * step. The input is jittered
    (data.photometric) and the loss has a Lovász term: a jitter drawn from a stateful generator
    instead of (seed, sample counter) would differ after the restart."""
    import shutil
    a = tmp_path / "a"
    a.mkdir()
    p = write_config(a, demo_root, deterministic=True, image_summary_every=0, eval_every=2, checkpoint_every=1,
                     keep_checkpoints=5, accumulate_steps=2)
    raw = yaml.safe_load(p.read_text())
    raw["data"]["photometric"] = {"brightness": 32, "contrast": 0.5, "saturation": 0.5, "hue": 18}
    raw["loss"] = {"terms": [{"type": "cross_entropy", "weight": 1.0}, {"type": "lovasz", "weight": 0.5}]}
    p.write_text(yaml.safe_dump(raw))
    ra = run(["--config", str(p), "--gpus", "2"], a)
    assert ra.returncode == 0, ra.stderr
    assert ra.stderr.count("re-estimated the statistics") == 2 and "eval at step 2 " in ra.stderr, ra.stderr
    b = tmp_path / "b"
    shutil.copytree(a, b)
    rewind_to_ckpt2(b / "run" / "checkpoints")
    r = run(["--config", str(b / "cfg.yaml"), "--gpus", "2"], b)
    assert r.returncode == 0, r.stderr
    assert "resumed from step 2" in r.stderr, r.stderr
    for step in (3, 4):
        ra = tf.train.load_checkpoint(str(a / "run" / "checkpoints" / f"ckpt-{step}"))
        rb = tf.train.load_checkpoint(str(b / "run" / "checkpoints" / f"ckpt-{step}"))
        keys = [k for k in ra.get_variable_to_shape_map() if "VARIABLE_VALUE" in k]
        assert any("optimizer" in k for k in keys) and any("moving_variance" in k for k in keys) and len(keys) > 50
        for k in keys:
            np.testing.assert_array_equal(ra.get_tensor(k), rb.get_tensor(k), err_msg=f"ckpt-{step}: {k}")
        assert ra.get_tensor("bn_stats_step/.ATTRIBUTES/VARIABLE_VALUE") == {3: 2, 4: 4}[step]  # re-estimated at


@pytest.mark.parametrize("args, expected", [
    (["--gpus", "0"], "error: invalid --gpus (--gpus): expected a positive number of towers, got 0"),
    (["--set", "data.batch_size=3", "--gpus", "2"], "error: batch does not divide across towers (data.batch_size)"),
    (["--set", "train.nm_steps=3"], "error: unknown key (train.nm_steps): did you mean 'num_steps'?"),
    (["--set", "data.root=/nonexistent/voc"], "error: data root not found (data.root)"),
    (["--set", "data.class_names=[a,b]", "--check-data"], "error: wrong class names (data.class_names)"),
])
def test_user_errors_one_line_exit_2(tmp_path, demo_root, args, expected):
    cfg = write_config(tmp_path, demo_root)
    r = run(["--config", str(cfg), *args], tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line[:8].count(":") == 2]
    assert len(lines) == 1 and lines[0].startswith(expected), r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # nothing written for a run that never started


def test_init_from_skips_layers_with_other_shapes(tmp_path, demo_root):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_config(a, demo_root, num_steps=1, image_summary_every=0)
    assert run(["--config", str(a / "cfg.yaml"), "--set", "eval.bn_reestimate_batches=0"], a).returncode == 0
    write_config(b, demo_root, num_steps=1, image_summary_every=0)
    r = run(["--config", str(b / "cfg.yaml"), "--set", "data.num_classes=4", "--set", "eval.bn_reestimate_batches=0",
             "--set", "data.class_names=[a,b,c,d]", "--init-from", str(a / "run")], b)
    assert r.returncode == 0, r.stderr
    assert "skipped 2 with other shapes: logits/kernel, logits/bias" in r.stderr, r.stderr
