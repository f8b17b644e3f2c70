"""seg-bench --verify-towers: passes on a correct build, fails (exit 1) when synchronized BN stops reducing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from seg_train import cli
from seg_train.bench import verify
from seg_train.config import ConfigError
from seg_train.data import synthetic
from seg_train.models import sync_bn
from seg_train.parallel import collectives, replicas
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
DEVICES = replicas.Devices([f"/device:CPU:{i}" for i in range(4)], "CPU", "")


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("data") / "demo", num_train=8, num_val=2, size=(40, 48),
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


@pytest.fixture(scope="module")
def probes(tmp_path_factory, demo_root):
    """The real probes of a correct build on 1 and 4 towers, at bn_momentum 0.99 (where the moving
    statistics hide a wrong batch statistic best); shared by the tests that judge them."""
    from seg_train.data.split import open_split
    cfg = tiny_config(tmp_path_factory.mktemp("probes"), demo_root,
                      model={"sync_batchnorm": False, "weight_decay": 1e-3, "bn_momentum": 0.99})
    cfg = verify.verify_config(cfg)
    reader = open_split(cfg, cfg.data.train_split).reader
    return cfg, verify._probe(cfg, DEVICES, 1, reader), verify._probe(cfg, DEVICES, 4, reader)


def _copy(result):
    return {k: [np.array(x) for x in v] if k in ("gradients", "bn_stats") else v for k, v in result.items()}


def test_compare_by_hand():
    big, small, dust = np.ones(10000), np.full(4, 0.5), np.array([1e-6])  # norms 100, 1, 1e-6
    names = ["big", "small", "dust"]
    # 'small' scaled by 1.5: 0.5 / 1 per variable, but 0.5 / sqrt(100^2 + 1) = 0.005 concatenated.
    r = verify.compare(names, [big, small, dust], [big, 1.5 * small, dust])
    assert r["rel_l2"] == pytest.approx(0.5 / np.sqrt(10001.0), rel=1e-9) and r["rel_l2"] < 1e-2
    assert r["per_variable"] == pytest.approx([0.0, 0.5, 0.0], rel=1e-9)
    assert r["worst"] == {"variable": "small", "rel_l2": pytest.approx(0.5, rel=1e-9)}
    assert [v["variable"] for v in r["over"]] == ["small"]
    # A variable below 1e-3 of the whole norm is judged against that floor, not its own norm:
    # 'dust' 100% off is 1e-6 / (1e-3 * 100.005) = 1e-5; 2% everywhere (rounding) passes.
    r = verify.compare(names, [big, small, dust], [1.02 * big, 1.02 * small, 2 * dust])
    assert r["per_variable"] == pytest.approx([0.02, 0.02, 1e-6 / (1e-3 * np.sqrt(10001.0 + 1e-12))], rel=1e-6)
    assert r["over"] == [] and r["worst"]["variable"] in ("big", "small")
    # Zero reference: any difference is infinitely far; none is 0.
    assert verify.compare(["z"], [np.zeros(3)], [np.zeros(3)])["per_variable"] == [0.0]
    assert verify.compare(["z"], [np.zeros(3)], [np.ones(3)])["per_variable"] == [float("inf")]


def test_batch_statistics_by_hand():
    # Moving mean 1.0, batch mean 0.5, momentum 0.99: the update sets 0.99 * 1.0 + 0.01 * 0.5 = 0.995.
    # A batch mean 100% wrong (1.0) sets 1.0: the moving statistics are 0.5% apart, under a 1e-2
    # tolerance, while the batch statistics they carry are 100% apart.
    old, m = [np.array([1.0, 1.0])], [0.99]
    right, wrong = [np.array([0.995, 0.995])], [np.array([1.0, 1.0])]
    assert verify.batch_statistics(right, old, m)[0] == pytest.approx([0.5, 0.5], abs=1e-12)
    assert verify.batch_statistics(wrong, old, m)[0] == pytest.approx([1.0, 1.0], abs=1e-12)
    assert verify.rel_l2(right, wrong) == pytest.approx(0.005 / 0.995, rel=1e-9)  # 5.0e-3 < 1e-2
    r = verify.compare(["mean"], verify.batch_statistics(right, old, m), verify.batch_statistics(wrong, old, m))
    assert r["per_variable"] == pytest.approx([1.0], rel=1e-9) and len(r["over"]) == 1
    # Momentum 0: the batch statistics are the new ones.
    assert verify.batch_statistics([np.array([3.0])], [np.array([7.0])], [0.0])[0] == pytest.approx([3.0])


@pytest.mark.slow
def test_correct_build_agrees(probes):
    cfg, one, many = probes
    r = verify.judge(cfg, "CPU", 4, one, many)
    assert r["ok"] is True and r["same_start"] is True and r["start_max_abs_diff"] == 0.0
    assert r["gpus"] == 4 and r["tolerance"] == 0.1 and r["floor"] == 1e-3 and r["sync_batchnorm"] is True
    # The tiny model agrees far inside the tolerance (~4e-6 per variable measured); a real step happened.
    assert r["gradient_rel_l2"] < 1e-4 and r["bn_stats_rel_l2"] < 1e-4
    assert r["worst_gradient"]["rel_l2"] < 1e-4 and r["worst_bn_stat"]["rel_l2"] < 1e-4
    assert r["num_gradients_over_tolerance"] == 0 and r["num_bn_stats_over_tolerance"] == 0
    assert r["gradients_over_tolerance"] == [] and r["bn_stats_over_tolerance"] == []
    assert r["num_gradient_values"] > 1000 and r["num_bn_stat_values"] > 100
    assert r["num_gradient_variables"] == len(one["names"]) and r["num_bn_stat_variables"] == len(one["bn_names"])
    assert set(one["bn_momentum"]) == {0.99}
    assert r["global_norm_1_tower"] > 1e-3
    assert r["loss_n_towers"] == pytest.approx(r["loss_1_tower"], rel=1e-5)
    text = verify.format_report(r)
    assert "over tolerance  " not in text
    assert text.splitlines()[-1].startswith("verdict: OK")


@pytest.mark.slow
def test_one_wrong_gradient_fails(probes):
    # One variable's gradient 1.5x on the N-tower side only (e.g. counted 1.5 times in the
    # reduction): a variable with under 2% of the gradient norm, so the concatenated difference
    # stays under 1e-2, and over 0.1% of it, so it is judged against its own norm.
    cfg, one, many = probes
    norms = np.array([np.linalg.norm(g) for g in one["gradients"]])
    share = norms / np.linalg.norm(norms)
    i = int(np.argmax(np.where((share > 5e-3) & (share < 1.5e-2), share, 0.0)))
    assert 5e-3 < share[i] < 1.5e-2
    bad = _copy(many)
    bad["gradients"][i] = 1.5 * bad["gradients"][i]
    r = verify.judge(cfg, "CPU", 4, one, bad)
    assert r["gradient_rel_l2"] < 1e-2  # the old whole-model verdict would have passed it
    assert r["ok"] is False
    assert r["num_gradients_over_tolerance"] == 1 and r["num_bn_stats_over_tolerance"] == 0
    assert r["gradients_over_tolerance"] == [{"variable": one["names"][i], "rel_l2": pytest.approx(0.5, rel=1e-3)}]
    assert r["worst_gradient"]["variable"] == one["names"][i]
    text = verify.format_report(r)
    assert f"over tolerance  gradient of {one['names'][i]} (5.00e-01)" in text
    assert text.splitlines()[-1].startswith("verdict: FAIL")


@pytest.mark.slow
def test_one_wrong_batch_variance_fails(probes):
    # One layer's batch variance 100% off (doubled) on the N-tower side, at bn_momentum 0.99: the
    # new moving variance m * old + (1 - m) * batch moves by 0.01 * batch / (0.99 * old + 0.01 *
    # batch), under 1e-2 for that layer alone, while the batch statistics are 100% apart.
    cfg, one, many = probes
    m = 0.99
    batch = verify.batch_statistics(many["bn_stats"], many["bn_old"], many["bn_momentum"])
    j = next(k for k, name in enumerate(one["bn_names"]) if name.endswith("moving_variance"))
    bad = _copy(many)
    bad["bn_stats"][j] = (m * many["bn_old"][j] + (1 - m) * 2.0 * batch[j]).astype(np.float32)
    new_stats_layer = verify.rel_l2([one["bn_stats"][j]], [bad["bn_stats"][j]])
    assert 1e-4 < new_stats_layer < 1e-2  # comparing the new moving statistics would pass it
    assert verify.rel_l2(one["bn_stats"], bad["bn_stats"]) < 1e-2
    r = verify.judge(cfg, "CPU", 4, one, bad)
    assert r["ok"] is False and r["num_gradients_over_tolerance"] == 0
    assert r["bn_stats_over_tolerance"] == [{"variable": one["bn_names"][j], "rel_l2": pytest.approx(1.0, rel=1e-3)}]
    assert r["worst_bn_stat"]["variable"] == one["bn_names"][j]
    assert f"over tolerance  batch statistics of {one['bn_names'][j]} (1.00e+00)" in verify.format_report(r)


class _NoCrossTower:
    """seg_train.parallel.collectives as synchronized BN would see it with its reduction broken: one tower,
    all-reduces that return this tower's own sums; everything else the real module's."""

    def __getattr__(self, name):
        return getattr(collectives, name)

    @staticmethod
    def num_replicas():
        return 1

    @staticmethod
    def all_reduce_sum(tensors):
        return list(tensors)


@pytest.mark.slow
def test_unreduced_sync_bn_fails_with_exit_1(cfg_path, monkeypatch, capsys):
    # Each tower normalises with its own one-image moments (forward and backward sums left per
    # tower): the known wrong answer of a synchronized BN whose all-reduce is missing.
    monkeypatch.setattr(sync_bn, "collectives", _NoCrossTower())
    rc = cli.bench_main(["--config", str(cfg_path), "--gpus", "4", "--verify-towers", "--json"])
    out = capsys.readouterr().out
    r = json.loads(out)
    assert rc == 1
    assert r["ok"] is False and r["same_start"] is True
    assert r["gradient_rel_l2"] > 0.5  # ~2.8 measured: far beyond the 0.1 tolerance
    # A broken reduction fails variable after variable; the report names the worst few.
    assert r["num_gradients_over_tolerance"] > r["num_gradient_variables"] // 2
    assert len(r["gradients_over_tolerance"]) == 5 and r["worst_gradient"]["rel_l2"] > 0.5
    assert r["gradients_over_tolerance"][0] == r["worst_gradient"]
    assert {"gpus", "gradient_rel_l2", "bn_stats_rel_l2", "tolerance", "ok"} <= set(r)


@pytest.mark.slow
def test_user_errors_before_any_device(cfg_path, capsys):
    from seg_train import config as config_lib
    with pytest.raises(ConfigError, match=r"batch does not divide across towers \(data.batch_size\)"):
        verify.check_towers(config_lib.load(cfg_path), 3)
    for gpus in ("3", "1", "2,4"):
        assert cli.bench_main(["--config", str(cfg_path), "--gpus", gpus, "--verify-towers"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert ("(data.batch_size)" if gpus == "3" else "(--gpus)") in err[0]


@pytest.mark.slow
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
