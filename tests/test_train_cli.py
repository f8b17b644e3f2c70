"""seg-train end to end through the real command: resume after a crash, a finished run, --init-from, errors.
(The log line, RUN_DIR/first_step.json, the TensorBoard tags and extending a run: tests/test_tensorboard.py.)"""

import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml

from tests.helpers import run_command as run
from tests.helpers import write_train_config as write_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

ROOT = Path(__file__).resolve().parents[1]


def rewind_to_ckpt2(ckdir):
    """Makes a run's checkpoints/ look killed right after writing ckpt-2: drops ckpt-3, ckpt-4 and their state."""
    for f in [*ckdir.glob("ckpt-3.*"), *ckdir.glob("ckpt-4.*")]:
        f.unlink()
    tf.compat.v1.train.update_checkpoint_state(str(ckdir), str(ckdir / "ckpt-2"),
                                               [str(ckdir / "ckpt-1"), str(ckdir / "ckpt-2")])


@pytest.fixture(scope="module")
def straight(tmp_path_factory, demo_root):
    """test_resume_after_crash_equals_uninterrupted's straight run (tmp/cfg.yaml, tmp/run) and the command's
    result; read only by the tests (they copy it to run the command on it again)."""
    a = tmp_path_factory.mktemp("straight")
    p = write_config(a, demo_root, deterministic=True, image_summary_every=0, eval_every=2, checkpoint_every=1,
                     keep_checkpoints=5, accumulate_steps=2)
    raw = yaml.safe_load(p.read_text())
    raw["data"]["photometric"] = {"brightness": 32, "contrast": 0.5, "saturation": 0.5, "hue": 18}
    raw["loss"] = {"terms": [{"type": "cross_entropy", "weight": 1.0}, {"type": "lovasz", "weight": 0.5}]}
    p.write_text(yaml.safe_dump(raw))
    return a, run(["--config", str(p), "--gpus", "2"], a)


def test_complete_run_exits_0_without_training(tmp_path, straight):
    """The same command again on a finished run (the TensorBoard tests' run checks the log line, the tags and
    extending a run, tests/test_tensorboard.py)."""
    assert straight[1].returncode == 0, straight[1].stderr
    shutil.copytree(straight[0], tmp_path, dirs_exist_ok=True)
    r = run(["--config", str(tmp_path / "cfg.yaml"), "--gpus", "2"], tmp_path)
    assert r.returncode == 0 and "already complete" in r.stderr, r.stderr
    assert "step 1/" not in r.stderr, r.stderr


def test_resume_after_crash_equals_uninterrupted(tmp_path, straight):
    """A run that died right after its step-2 checkpoint (a copy of the straight run's dir without
    ckpt-3 and ckpt-4, as a kill leaves it) and was rerun ends bitwise equal to the straight run, with
    an evaluation in the middle: at step 2 the BN statistics are re-estimated, then the checkpoint is
    written, so the resumed run must start from the re-estimated statistics as the straight run went on
    with them. ckpt-3 (no evaluation before it) holds the statistics the step after the evaluation
    left; ckpt-4 the weights and slots. Each update is 2 micro-batches (train.accumulate_steps): the
    resumed run must pick up the stream at micro-batch 2 * step. The input is jittered
    (data.photometric) and the loss has a Lovász term: a jitter drawn from a stateful generator
    instead of (seed, sample counter) would differ after the restart."""
    a, ra = straight
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


def test_init_from_skips_layers_with_other_shapes(tmp_path, demo_root, straight):
    assert straight[1].returncode == 0, straight[1].stderr  # a 3-class run to start from
    b = tmp_path / "b"
    b.mkdir()
    write_config(b, demo_root, num_steps=1, image_summary_every=0)
    r = run(["--config", str(b / "cfg.yaml"), "--set", "data.num_classes=4", "--set", "eval.bn_reestimate_batches=0",
             "--set", "data.class_names=[a,b,c,d]", "--init-from", str(straight[0] / "run")], b)
    assert r.returncode == 0, r.stderr
    assert "skipped 2 with other shapes: logits/kernel, logits/bias" in r.stderr, r.stderr
