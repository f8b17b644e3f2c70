"""A run written by an earlier seg-train still evaluates to the same numbers and resumes.

tests/fixtures/run_3b88e24/ is a tiny run (tiny backbone, Adam, EMA, 2 steps) trained by commit
3b88e24, the code before the train step, synchronized BN and the loop were reworked, with the
seg-eval report that code wrote for it (val-step2.json, BN statistics re-estimated as seg-eval
does by default). The data is regenerated here exactly as it was (demo_data is a pure function of
its arguments).

Fails for: a renamed or re-nested variable (the checkpoint no longer restores), a changed inference
path or BN re-estimation (the confusion matrix moves), a checkpoint object added without a fallback
(resume refuses the old run), the EMA or optimizer slots not read back.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml

from seg_train import cli
from seg_train.data import synthetic

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run_3b88e24"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("old") / "data", num_train=8, num_val=3, size=(40, 48),
                              num_classes=3, seed=0)


def old_run(tmp_path, data):
    """A copy of the old run dir, its config pointed at this machine's data and folder."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run, ignore=shutil.ignore_patterns("val-step2.json"))
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["root"], cfg["run_dir"] = str(data), str(run)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run, config


def test_old_checkpoint_evaluates_to_the_same_numbers(tmp_path, data):
    run, config = old_run(tmp_path, data)
    assert cli.eval_main(["--config", str(config), "--gpus", "1", "--checkpoint", str(run)]) == 0
    got = json.loads((run / "eval" / "val-step2.json").read_text())
    expected = json.loads((FIXTURE / "val-step2.json").read_text())
    assert got["step"] == expected["step"] == 2
    assert got["bn_stats_reestimated"] == expected["bn_stats_reestimated"]
    assert got["confusion_matrix"] == expected["confusion_matrix"]
    assert got["miou"] == pytest.approx(expected["miou"], abs=1e-12)
    assert sum(map(sum, got["confusion_matrix"])) > 1000  # pixels were counted


def test_old_checkpoint_resumes(tmp_path, data):
    run, config = old_run(tmp_path, data)
    old = tf.train.load_checkpoint(str(run / "checkpoints" / "ckpt-2"))
    rc = cli.train_main(["--config", str(config), "--gpus", "1", "--set", "train.num_steps=3",
                         "--set", "data.val_split=none"])
    assert rc == 0
    new = tf.train.load_checkpoint(str(run / "checkpoints" / "ckpt-3"))
    names = old.get_variable_to_shape_map()
    assert set(names) <= set(new.get_variable_to_shape_map())  # every old variable is still there
    iterations = [k for k in names if k.startswith("optimizer/") and "iteration" in k]
    assert iterations and all(int(old.get_tensor(k)) == 2 and int(new.get_tensor(k)) == 3 for k in iterations)
    # The third update started from the old weights, slots and EMA: each moved by one step, not reset.
    moved = [k for k in names if k.startswith(("model/", "ema/")) and old.get_tensor(k).dtype == np.float32
             and not np.array_equal(old.get_tensor(k), new.get_tensor(k))]
    assert any(k.startswith("ema/") for k in moved) and any(k.startswith("model/") for k in moved)
