"""seg-bench --verify-towers: passes on a correct build, fails (exit 1) when synchronized BN stops reducing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from seg_train import cli, demo_data, replicas, verify
from seg_train.config import ConfigError
from seg_train.models import sync_bn
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
DEVICES = replicas.Devices([f"/device:CPU:{i}" for i in range(4)], "CPU", "")


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    return demo_data.generate(tmp_path_factory.mktemp("data") / "demo", num_train=8, num_val=2, size=(40, 48),
                              num_classes=3)


@pytest.fixture
def cfg_path(tmp_path, demo_root):
    # batch 4 on 4 towers: one image per tower, where per-tower BN statistics are furthest from
    # the global ones. Synchronized BN is off here on purpose: --verify-towers turns it on.
    tiny_config(tmp_path, demo_root, model={"sync_batchnorm": False, "weight_decay": 1e-3})
    return tmp_path / "config.yaml"


def test_rel_l2_by_hand():
    assert verify.rel_l2([[3.0, 4.0]], [[3.0, 4.0]]) == 0.0
    assert verify.rel_l2([[3.0, 0.0], [4.0]], [[3.0, 0.0], [4.5]]) == pytest.approx(0.5 / 5.0)
    assert verify.rel_l2([[0.0]], [[1.0]]) == float("inf")
    assert verify.rel_l2([], []) == 0.0


def test_correct_build_agrees(cfg_path):
    from seg_train import config as config_lib
    r = verify.run(config_lib.load(cfg_path), DEVICES, 4)
    assert r["ok"] is True and r["same_start"] is True and r["start_max_abs_diff"] == 0.0
    assert r["gpus"] == 4 and r["tolerance"] == 1e-2 and r["sync_batchnorm"] is True
    # The tiny model agrees far inside the tolerance (~3e-6 measured); a real step happened.
    assert r["gradient_rel_l2"] < 1e-4 and r["bn_stats_rel_l2"] < 1e-4
    assert r["num_gradient_values"] > 1000 and r["num_bn_stat_values"] > 100
    assert r["global_norm_1_tower"] > 1e-3
    assert r["loss_n_towers"] == pytest.approx(r["loss_1_tower"], rel=1e-5)
    text = verify.format_report(r)
    assert text.splitlines()[-1].startswith("verdict: OK")


def test_unreduced_sync_bn_fails_with_exit_1(cfg_path, monkeypatch, capsys):
    # Each tower normalises with its own one-image moments: the known wrong answer of a
    # synchronized BN whose all-reduce is missing.
    monkeypatch.setattr(sync_bn, "_LOCAL_STATISTICS_FOR_TESTS", True)
    rc = cli.bench_main(["--config", str(cfg_path), "--gpus", "4", "--verify-towers", "--json"])
    out = capsys.readouterr().out
    r = json.loads(out)
    assert rc == 1
    assert r["ok"] is False and r["same_start"] is True
    assert r["gradient_rel_l2"] > 0.5  # ~2.8 measured: far beyond the 1e-2 tolerance
    assert {"gpus", "gradient_rel_l2", "bn_stats_rel_l2", "tolerance", "ok"} <= set(r)


def test_user_errors_before_any_device(cfg_path, capsys):
    from seg_train import config as config_lib
    with pytest.raises(ConfigError, match=r"batch does not divide across towers \(data.batch_size\)"):
        verify.check_towers(config_lib.load(cfg_path), 3)
    for gpus in ("3", "1", "2,4"):
        assert cli.bench_main(["--config", str(cfg_path), "--gpus", gpus, "--verify-towers"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert ("(data.batch_size)" if gpus == "3" else "(--gpus)") in err[0]


def test_cli_exit_0_and_verdict(tmp_path, demo_root):
    # The real command in a fresh process (its own devices, TensorFlow's start-up quietened).
    tiny_config(tmp_path, demo_root, data={"batch_size": 2})
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-c", "import sys; from seg_train.cli import bench_main; "
                        "sys.exit(bench_main(sys.argv[1:]))", "--config", str(tmp_path / "config.yaml"),
                        "--gpus", "2", "--verify-towers"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("tower self-test: 1 vs 2 CPU towers")
    assert lines[-1] == "verdict: OK - 2 towers compute the same update as 1 tower"
    assert "gradients       relative L2 difference" in r.stdout
