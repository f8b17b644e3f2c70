"""seg-bench: the JSON contract on a tiny config, the text report of the same results, the FLOP counter,
argument errors. No timing assertions."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from seg_train.bench.report import format_input_only, format_report
from seg_train.data import synthetic

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

ROOT = Path(__file__).resolve().parents[1]


def run_bench(args, cwd, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    code = "import sys; from seg_train.cli import bench_main; sys.exit(bench_main())"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    root = synthetic.generate(tmp / "data", num_train=12, num_val=4, size=(40, 48), num_classes=3)
    raw = {"seed": 0, "run_dir": "run",
           "data": {"root": str(root), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                    "num_parallel_calls": 2},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4}}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_json_tiny(tiny_cfg):
    r = run_bench(["--config", str(tiny_cfg), "--gpus", "1,2", "--steps", "3", "--windows", "2", "--warmup", "1",
                   "--bn-images", "8", "--eval-images", "2", "--no-probes", "--json"], tiny_cfg.parent)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object on stdout (json.loads refuses trailing text)
    for key in ("train_images_per_sec", "input_images_per_sec", "input_wait_fraction", "towers",
                "flops_utilization", "peak_rss_mb", "top_level_figures_for_gpus", "step_time_ms", "peak_gflops"):
        assert key in out, key
    assert out["top_level_figures_for_gpus"] == 2
    assert [t["gpus"] for t in out["towers"]] == [1, 2]
    assert out["towers"][0]["efficiency"] == 1.0
    for t in out["towers"]:
        assert positive(t["images_per_sec"]) and positive(t["efficiency"]) and positive(t["step_time_ms"])
        assert t["images_per_sec_per_tower"] == pytest.approx(t["images_per_sec"] / t["gpus"])
        assert 0.0 <= t["input_wait_fraction"] <= 1.0
    assert out["train_images_per_sec"] == out["towers"][-1]["images_per_sec"]
    assert positive(out["input_images_per_sec"])
    assert 0.0 <= out["input_wait_fraction"] <= 1.0
    assert positive(out["flops_utilization"]) and positive(out["peak_gflops"]) and positive(out["achieved_gflops"])
    assert positive(out["peak_rss_mb"])
    # Precise BN, evaluation and the cross-tower share, per tower count (the JSON keys users read).
    for t in out["towers"]:
        assert positive(t["bn_reestimate_s"]) and t["bn_reestimate_images"] == 8
        assert positive(t["eval_images_per_sec"]) and t["eval_images"] == 2
        assert positive(t["first_step_in_process"]["tracing_s"])
    assert out["towers"][0]["allreduce_ops_per_step"] == 0  # one tower: nothing crosses
    # Packed (32 MB bound): one pack of gradients, one of BN statistics, one of the step's scalars.
    # Unpacked, the tiny model would need one all-reduce per variable (far more than 3).
    assert out["towers"][1]["allreduce_ops_per_step"] == 3
    assert out["bn_reestimate_ratio"] == pytest.approx(out["towers"][1]["bn_reestimate_s"]
                                                       / out["towers"][0]["bn_reestimate_s"])
    assert positive(out["eval_ratio"]) and 0.0 < out["cross_tower_share"] < 1.0
    # The tiny model: 3x3 convs only, so the graph count of training is exactly 3x the forward pass.
    assert out["flops"]["train_to_forward"] == pytest.approx(3.0)
    assert out["precision"] == "float32" and out["jit_compile"] is False
    # --warmup 1 still makes two warm-up steps (the first call, then a second one to split it): the first
    # is never steady; with the second not steady either, the warm-up was not seen to end.
    n = out["warmup_steps_to_steady"]
    assert n in (1, 2) and out["warmup_reached_steady"] is (n == 1)
    assert out["warmup_runner"] == "gpus=1" and positive(out["launch_to_steady_s"])
    # seg-bench without --json prints this report of the same result. Wrong answer: a key the report reads
    # that run no longer writes (renamed, moved) crashes the text output, which the --json runs never show.
    text = format_report(out)
    assert [line.split()[0] for line in text.splitlines() if re.match(r" +\d+  ", line)] == ["1", "2"]
    assert f"efficiency = {out['efficiency_definition']}" in text and "measured peak (float32)" in text


def test_bench_bad_gpus_is_a_user_error(tiny_cfg):
    r = run_bench(["--config", str(tiny_cfg), "--gpus", "1,x"], tiny_cfg.parent, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("error: invalid --gpus (--gpus)")


def test_bench_bad_compare_is_a_user_error(tiny_cfg):
    r = run_bench(["--config", str(tiny_cfg), "--compare", "train.precision"], tiny_cfg.parent, timeout=60)
    assert r.returncode == 2
    assert "error: invalid --compare" in r.stderr


def test_op_flops_counts_conv_and_matmul():
    import tensorflow as tf

    from seg_train.bench.flops import graph_flops

    @tf.function
    def f(x, k, dw, a, b):
        y = tf.nn.conv2d(x, k, 1, "SAME")                         # 2 * 2*8*8 * 4 * 3*3*3
        z = tf.nn.depthwise_conv2d(y, dw, [1, 1, 1, 1], "SAME")   # 2 * 2*8*8 * 4 * 3*3
        return z, tf.matmul(a, b)                                 # 2 * 5*7 * 6

    g = f.get_concrete_function(tf.TensorSpec([2, 8, 8, 3]), tf.TensorSpec([3, 3, 3, 4]), tf.TensorSpec([3, 3, 4, 1]),
                                tf.TensorSpec([5, 6]), tf.TensorSpec([6, 7])).graph
    counted = graph_flops(g)
    assert counted["unknown_ops"] == 0
    assert counted["by_type"] == {"Conv2D": 2 * 128 * 4 * 27, "DepthwiseConv2dNative": 2 * 128 * 4 * 9,
                                  "MatMul": 2 * 35 * 6}


def test_parse_towers():
    from seg_train.bench.runner import parse_towers
    from seg_train.config import ConfigError
    assert parse_towers("4,1,2,2") == [1, 2, 4]
    for bad in ("", "0", "a", "1,-2"):
        with pytest.raises(ConfigError):
            parse_towers(bad)


def test_flops_key_takes_a_vit_config():
    """A ViT's model section holds a list (model.vit_layers): seg-bench's FLOP-count key must still hash,
    and tell two block choices apart."""
    from seg_train import config as config_lib
    from seg_train.bench.runner import flops_key
    vit = ["model.backbone=dinov3_vits16", "model.head=linear", "data.crop_size=[64,64]"]
    last = config_lib.load(ROOT / "configs" / "demo.yaml", vit + ["model.vit_layers=[12]"])
    four = config_lib.load(ROOT / "configs" / "demo.yaml", vit + ["model.vit_layers=[3,6,9,12]"])
    counts = {flops_key(last): 1}
    assert flops_key(last) in counts and flops_key(four) not in counts


def test_bench_input_only_with_cache(tiny_cfg):
    r = run_bench(["--config", str(tiny_cfg), "--input-only", "--set", "data.cache=true", "--steps", "2",
                   "--windows", "2", "--warmup", "1", "--json"], tiny_cfg.parent)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["cache"] is True and positive(out["input_images_per_sec"])
    assert positive(out["input"]["first_pass_images_per_sec"]) and positive(out["input"]["cache_mb"])
    # CPU time over wall time of the timed windows: above 0, at most the cores the process may use.
    assert 0 < out["input"]["cores_busy"] <= out["machine"]["usable_cpus"] * 1.05
    assert "towers" not in out  # nothing but the reader was run
    # CPU per SAMPLE (not per batch): in every window CPU time / samples = cores busy / (samples / s); and
    # the decode-only floor on the same files beside it (decoding the files even with data.cache on).
    floor = out["decode_floor"]
    for timed in (out["input"], floor):
        for cpu, busy, rate in zip(timed["window_cpu_ms_per_sample"], timed["window_cores_busy"],
                                   timed["window_images_per_sec"]):
            assert cpu == pytest.approx(1000 * busy / rate, rel=1e-6)
    assert positive(floor["images_per_sec"]) and positive(out["input_cpu_ms_per_sample"])
    ratio = out["input"]["cpu_ms_per_sample"] / floor["cpu_ms_per_sample"]
    assert out["cpu_per_sample_vs_floor"] == pytest.approx(ratio)
    # seg-bench --input-only without --json prints this report of the same result (as format_report above).
    text = format_input_only(out)
    assert re.search(r"decode only +[\d.]+ +[\d.]+ +[\d.]+\n", text), text
    assert re.search(r"CPU per sample: [\d.]+x the decode-only floor", text), text
    assert re.search(r"first pass [\d.]+ images/s, cache [\d.]+ MiB", text), text


def test_bench_first_step_probes_and_accumulation_memory(tiny_cfg):
    """Fresh seg-train processes time the first step from launch (with and without sync BN) and give
    the accumulation variant's own peak memory; the variant's batch is divided by K."""
    # One tower: the probes' processes trace one tower pass each (test_bench_json_tiny runs 1 and 2 towers).
    r = run_bench(["--config", str(tiny_cfg), "--gpus", "1", "--steps", "2", "--windows", "1", "--warmup", "2",
                   "--bn-images", "0", "--eval-images", "0", "--no-peak", "--no-input-alone",
                   "--compare", "train.accumulate_steps=2", "--json"], tiny_cfg.parent, timeout=900)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    base, accum = out["variants"]
    assert accum["name"] == "train.accumulate_steps=2" and accum["global_batch"] == 2 and base["global_batch"] == 4
    row = base["towers"][0]
    assert positive(row["first_step_s"]) and positive(row["first_step_sync_bn_s"])
    assert row["first_step_s"] > row["first_step_tracing_s"] > 0 and positive(row["peak_rss_mb_process"])
    a = accum["towers"][0]
    assert a["images_per_step"] == 4 and a["accumulate_steps"] == 2 and positive(a["peak_rss_mb_process"])
    # K micro-batches of 2 do the FLOPs of one batch of 4: the same work per step as the base.
    assert a["achieved_gflops"] * a["step_time_ms"] == pytest.approx(row["achieved_gflops"] * row["step_time_ms"],
                                                                     rel=0.05)
    assert out["first_step_s"] == row["first_step_s"]
    # The text report without a peak (--no-peak). Wrong answer: the missing utilisation formatted as a number.
    text = format_report(out)
    variant_lines = [line for line in text.splitlines() if line.startswith("variant ")]
    assert [line.split(":")[0] for line in variant_lines] == ["variant base", "variant train.accumulate_steps=2"]
    assert not any("of peak" in line for line in variant_lines) and "measured peak" not in text
    assert [line.split()[7] for line in text.splitlines() if re.match(r" +\d+  ", line)] == ["-"]
