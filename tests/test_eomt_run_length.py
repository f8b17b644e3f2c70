"""EoMT runs of any length, and extended: train.mask_annealing left unset is derived from train.num_steps where the
run uses it (resolve.annealing_windows), never stored, so a run shorter than model.eomt_blocks + 2 steps trains
and its RUN_DIR/config.yaml loads, and raising train.num_steps stretches the windows as it stretches the poly
schedule; the windows an older seg-train stored count as unset. A zero-length window is a step from 1 to 0 at
its start.

Fails for: a short run whose config.yaml its own loader refuses (its empty derived windows stored under a check
for start < end), derived windows stored in config.yaml (an extended run then refused as a change of its
windows), an empty window's probability 0/0 = NaN
or its step on the other side (still 1 at its start), a run dir written by an older seg-train (its derived
windows stored) refused when extended, or hand-chosen windows taken for derived ones.
"""

from __future__ import annotations

import io
import shutil
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest
import tensorflow as tf
import yaml

from seg_train import cli
from seg_train.config import ConfigError, dump, from_dict, load
from seg_train.config.resolve import annealing_windows
from seg_train.data import synthetic
from seg_train.objectives.mask_classification import mask_probabilities
from seg_train.run.rundir import check_resume_config

# dinov3_vits16 is tests/helpers.py's TINY_VITS16 throughout the module (conftest.py's `tiny_vits16`).
pytestmark = pytest.mark.usefixtures("tiny_vits16")


def test_empty_window_is_a_step_at_its_start():
    """[5, 5]: 1 before step 5, 0 from it (no 0/0); a window beside it keeps the poly curve (by hand)."""
    windows = [(5, 5), (4, 8)]
    for step, want in [(0, [1, 1]), (4, [1, 1]), (5, [0, 0.75 ** 0.9]), (6, [0, 0.5 ** 0.9]), (9, [0, 0])]:
        got = mask_probabilities(tf.constant(step, tf.int64), windows).numpy()
        assert np.isfinite(got).all(), (step, got)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(step))


def _run(*args) -> tuple[int, str]:
    out = io.StringIO()
    main = cli.eval_main if args[0] == "eval" else cli.train_main
    with redirect_stderr(out), redirect_stdout(out):
        rc = main(list(args[1:]))
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, tiny_vits16):
    """seg-train on 1 tower: EoMT with 4 blocks on dinov3_vits16 (tests/helpers.py's 4-block TINY_VITS16 in its
    place), train.mask_annealing unset, 3 steps (fewer than 4 + 2: derived windows [0, 1], [1, 1], [1, 2],
    [2, 2])."""
    base = tmp_path_factory.mktemp("short")
    root = synthetic.generate(base / "demo", num_train=8, num_val=2, size=(32, 40), num_classes=3)
    raw = {"seed": 1, "run_dir": "run",
           "data": {"root": str(root), "num_classes": 3, "batch_size": 2, "crop_size": [32, 32],
                    "num_parallel_calls": 2, "val_split": "none"},
           "model": {"backbone": "dinov3_vits16", "head": "eomt", "eomt_blocks": 4, "num_queries": 4},
           "train": {"num_steps": 3, "checkpoint_every": 3, "summary_every": 1, "image_summary_every": 0,
                     "optimizer": "adamw", "learning_rate": 1e-3},
           "loss": {"mask_points": 64},
           "eval": {"bn_reestimate_batches": 0}}
    config = base / "cfg.yaml"
    config.write_text(yaml.safe_dump(raw))
    rc, log = _run("train", "--config", str(config), "--gpus", "1")
    assert rc == 0, log[-3000:]
    return config, base / "run"


@pytest.mark.slow
def test_short_eomt_run_trains_and_its_config_loads_in_seg_eval(short_run):
    _, run = short_run
    saved = load(run / "config.yaml")
    assert saved.train.mask_annealing is None
    assert annealing_windows(saved) == [(0, 1), (1, 1), (1, 2), (2, 2)]
    rc, log = _run("eval", "--config", str(run / "config.yaml"), "--checkpoint", str(run), "--gpus", "1",
                   "--set", "data.val_split=val")
    assert rc == 0 and "mIoU" in log, log[-3000:]


@pytest.mark.slow
def test_extended_eomt_run_resumes_with_stretched_windows(short_run, tmp_path):
    """The short run rerun with train.num_steps 6: resumed at step 3 with the extension warning, trained to 6;
    its config.yaml still leaves the windows unset, and those it uses are the ones of 6 steps, [1, 2], [2, 3],
    [3, 4], [4, 5] (6 k // 6)."""
    config, run = short_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    rc, log = _run("train", "--config", str(config), "--gpus", "1", "--run-dir", str(copy),
                   "--set", "train.num_steps=6")
    assert rc == 0, log[-3000:]
    assert "resumed from step 3 " in log and "run extended from 3 to 6 steps" in log, log[-3000:]
    saved = load(copy / "config.yaml")
    assert (saved.train.num_steps, saved.train.mask_annealing) == (6, None)
    assert annealing_windows(saved) == [(1, 2), (2, 3), (3, 4), (4, 5)]
    assert (copy / "checkpoints" / "ckpt-6.index").is_file()


def _raw(steps: int, windows=None) -> dict:
    train = {"num_steps": steps} if windows is None else {"num_steps": steps, "mask_annealing": windows}
    return {"data": {"root": "data", "num_classes": 3, "crop_size": [32, 32]},
            "model": {"backbone": "dinov3_vits16", "head": "eomt", "eomt_blocks": 4, "num_queries": 4},
            "train": train}


@pytest.mark.parametrize("written, extends", [
    ([[0, 1], [1, 1], [1, 2], [2, 2]], True),   # what an older seg-train derived from 3 steps and wrote
    ([[0, 2], [1, 2], [1, 3], [2, 3]], False),  # windows chosen by hand: still a change
])
def test_older_run_dirs_derived_windows_extend_like_unset_ones(tmp_path, written, extends):
    """The resume check (rundir.check_resume_config, what seg-train runs before writing) of a config with the
    windows unset and train.num_steps 6 against a 3-step run dir whose config.yaml holds them written out."""
    dump(from_dict(_raw(3, written)), tmp_path / "config.yaml")
    new = from_dict(_raw(6))
    if extends:
        check_resume_config(new, tmp_path, allow_change=False)
    else:
        with pytest.raises(ConfigError, match="train.mask_annealing"):
            check_resume_config(new, tmp_path, allow_change=False)
