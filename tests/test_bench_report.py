"""benchmarks/bench.py's report (docs/PERFORMANCE.md) rendered from made-up results: its tables hold the
figures recomputed here from those results, and every conditional remark is chosen by the figures. No
benchmark runs."""

import copy
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_bench_script():
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profile(conv, ops, instances, step_ms, op_ms=None):
    return {"profiled_step_ms": step_ms, "conv_share_of_op_time": conv, "op_time_ms_per_step": op_ms or 2 * step_ms,
            "top_ops": [[k, 0.0, share] for k, share in ops],
            "top_op_instances": [[name, 0.0, share] for name, share in instances]}


P_BASE = profile(0.71, [("Conv2DBackpropFilter", 0.27), ("Conv2DBackpropInput", 0.20), ("Conv2D", 0.18),
                        ("FusedBatchNormGradV3", 0.05), ("FusedBatchNormV3", 0.05), ("Mul", 0.02),
                        ("DepthwiseConv2dNativeBackpropInput_MklNative", 0.02), ("Cast", 0.01)],
                 [("deeplabv3plus/decoder_conv2_conv/convolution/Conv2DBackpropFilter:Conv2DBackpropFilter", 0.13),
                  ("gradient_tape/deeplabv3plus/decoder_conv2_conv/Conv2DBackpropInput:Conv2DBackpropInput", 0.08),
                  ("deeplabv3plus/decoder_conv1_conv_1/Conv2D:Conv2D", 0.07),
                  ("deeplabv3plus/aspp/pool:Mean", 0.06), ("x:Add", 0.01)], 1343.4, op_ms=1300.0)
P_FOUR = profile(0.60, [("Conv2DBackpropFilter", 0.22), ("Conv2D", 0.20), ("Conv2DBackpropInput", 0.18),
                        ("FusedBatchNormGradV3", 0.08), ("FusedBatchNormV3", 0.06), ("ResourceApplyAdam", 0.04)],
                 [("deeplabv3plus/decoder_conv1_conv/Conv2DBackpropFilter:Conv2DBackpropFilter", 0.06)], 1000.0,
                 op_ms=1850.0)
P_BF16 = profile(0.58, [("Conv2DBackpropFilter", 0.23), ("DepthwiseConv2dNativeBackpropInput", 0.07),
                        ("Cast", 0.03), ("DepthwiseConv2dNative", 0.06)],
                 [("deeplabv3plus/decoder_conv1_conv/Conv2DBackpropFilter:Conv2DBackpropFilter", 0.06)], 914.2)


def tower(gpus, ips, eff, wait, gflops, util, cpu_ms, cores, first=27.2, prof=None):
    row = {"gpus": gpus, "images_per_sec": ips, "images_per_sec_per_tower": ips / gpus, "step_time_ms": 8000 / ips,
           "efficiency": eff, "efficiency_window_range": [eff - 0.03, eff + 0.05], "input_wait_fraction": wait,
           "achieved_gflops": gflops, "flops_utilization": util, "cpu_ms_per_step": cpu_ms, "cores_busy": cores,
           "first_step_s": first}
    if prof is not None:
        row["op_profile"] = prof
    return row


def fake_results():
    """Results shaped like runs/bench/*.json and meta.json (the figures of a real run, rounded)."""
    machine = {"cpu": "Test CPU", "logical_cpus": 2, "usable_cpus": 2, "isa": ["avx2", "avx512f", "amx_bf16"],
               "tensorflow": "2.21.0", "keras": "3.15.1", "python": "3.11.7"}
    towers = {
        "_command": ".venv/bin/seg-bench --config c.yaml --gpus 1,4 --profile",
        "_loadavg_1min_before_after": [1.4, 1.6],
        "machine": machine, "global_batch": 8, "backbone": "mobilenetv2", "crop_size": [128, 128],
        "output_stride": 16, "warmup_steps": 2, "windows": 4, "steps_per_window": 3,
        "input_images_per_sec": 272.0, "peak_rss_mb": 2802.4,
        "flops": {"method": "graph count", "train_gflop_per_image": 9.35, "forward_gflop_per_image": 3.12,
                  "train_to_forward": 3.0},
        "peak": {"peak_gflops": 191.2, "matmul_gflops": 188.1, "conv3x3_gflops": 191.2},
        "towers": [tower(1, 11.30, 1.0, 0.003, 105.7, 0.553, 1325, 1.85, prof=P_BASE),
                   tower(4, 8.26, 0.73, 0.007, 77.1, 0.404, 1851, 1.91, prof=P_FOUR)],
        "warmup_runner": "gpus=1", "warmup_steps_to_steady": 17, "warmup_reached_steady": True,
        "launch_to_steady_s": 61.3, "build_to_steady_s": 38.4,
        "cross_tower_share": 0.031,
        "cross_tower_profile": {"cross_tower_ms_per_step": 42.5, "op_time_ms_per_step": 1371.0,
                                "cross_tower_definition": "cross-tower op time over all op time"},
    }
    costs = [dict(first_step_s=14.2, first_step_tracing_s=3.9, first_step_graph_optimization_s=2.4,
                  first_step_first_execution_s=0.71, first_step_sync_bn_s=15.8, bn_reestimate_s=9.1,
                  bn_reestimate_repeat_s=5.3, bn_reestimate_images=200, eval_images_per_sec=6.1, eval_images=64),
             dict(first_step_s=24.9, first_step_tracing_s=5.2, first_step_graph_optimization_s=8.8,
                  first_step_first_execution_s=0.97, first_step_sync_bn_s=33.0, bn_reestimate_s=10.6,
                  bn_reestimate_repeat_s=6.4, bn_reestimate_images=200, eval_images_per_sec=5.4, eval_images=64)]
    for row, extra in zip(towers["towers"], costs):
        row.update(extra)
    one, four = towers["towers"]
    four.update(first_step_ratio=four["first_step_s"] / one["first_step_s"],
                first_step_sync_bn_ratio=four["first_step_sync_bn_s"] / one["first_step_sync_bn_s"],
                bn_reestimate_ratio=four["bn_reestimate_s"] / one["bn_reestimate_s"],
                eval_ratio=four["eval_images_per_sec"] / one["eval_images_per_sec"])
    gnames = ["base", "train.allreduce_pack_mb=0", "train.allreduce_pack_mb=1", "loop=blocking"]
    gspeed, gops = [1.0, 0.88, 0.97, 0.96], [2, 262, 24, 2]
    gradients = {
        "_command": ".venv/bin/seg-bench --config c.yaml --gpus 4 --compare ...",
        "_loadavg_1min_before_after": [1.2, 1.3],
        "allreduce_pack_mb": 32.0,
        "speedup_vs_first_variant": dict(zip(gnames, gspeed)),
        "cpu_speedup_vs_first_variant": dict(zip(gnames, gspeed)),
        "speedup_window_range": {n: [s - 0.03, s + 0.03] for n, s in zip(gnames, gspeed)},
        "towers": [tower(4, 8.3, 1.0, 0.004, 77.0, 0.40, 1850, 1.9)],
        "variants": [{"name": n, "towers": [dict(tower(4, 8.3 * s, 1.0, 0.004, 77.0, 0.40, 1850, 1.9),
                                                allreduce_ops_per_step=o, cross_tower_graph_ops=o * 5)]}
                     for n, s, o in zip(gnames, gspeed, gops)],
    }
    accumulation = {
        "_command": ".venv/bin/seg-bench --config c.yaml --gpus 1 --compare train.accumulate_steps=4",
        "_loadavg_1min_before_after": [1.3, 1.1],
        "speedup_vs_first_variant": {"base": 1.0, "train.accumulate_steps=4": 0.81},
        "variants": [{"name": "base", "towers": [dict(tower(1, 11.0, 1.0, 0.0, 100.0, 0.5, 1300, 1.8),
                                                      images_per_step=8, peak_rss_mb_process=1710.0)]},
                     {"name": "train.accumulate_steps=4",
                      "towers": [dict(tower(1, 8.9, 1.0, 0.0, 80.0, 0.4, 1600, 1.8), images_per_step=8,
                                      peak_rss_mb_process=1290.0)]}],
    }
    names = ["base", "input=cached", "train.precision=mixed_bfloat16", "train.jit_compile=true",
             "model.fast_atrous=false", "model.fused_batchnorm=false"]
    speed = [1.0, 1.10, 1.54, 0.30, 0.5435, 0.99]
    cpu = [1.0, 1.17, 1.57, 0.28, 0.5025, 0.9434]
    variants = {
        "_command": ".venv/bin/seg-bench --config c.yaml --gpus 1 --compare ...",
        "_loadavg_1min_before_after": [1.6, 1.0],
        "speedup_vs_first_variant": dict(zip(names, speed)), "cpu_speedup_vs_first_variant": dict(zip(names, cpu)),
        "speedup_window_range": {n: [s - 0.07, s + 0.15] for n, s in zip(names, speed)},
        "peaks": {"float32": {"conv3x3_gflops": 185.0}, "bfloat16": {"matmul_gflops": 414.0, "conv3x3_gflops": 647.0}},
        "peak_rss_mb": 3196.0,
        "variants": [{"name": n, "jit_compile": n == "train.jit_compile=true",
                      "peak_gflops": 647.0 if "bfloat16" in n else 185.0,
                      "towers": [tower(1, 8.44 * s, 1.0, 0.002, 74.8 * s, 0.404 * s, 1644 / c, 1.68, first=27 + i,
                                       prof=P_BF16 if "bfloat16" in n else (None if "atrous" in n else P_BASE))]}
                     for i, (n, s, c) in enumerate(zip(names, speed, cpu))],
    }
    keras = {"_command": ".venv/bin/python benchmarks/baseline_keras_fit_speed.py --config c.yaml",
             "_loadavg_1min_before_after": [1.0, 1.8], "speedup_seg_train_vs_keras_fit": 2.667,
             "cpu_speedup_seg_train_vs_keras_fit": 2.738, "speedup_window_range": [1.91, 3.83],
             "seg_train_images_per_sec": 8.17, "keras_fit_images_per_sec": 3.06, "seg_train_step_time_ms": 983.0,
             "seg_train_cpu_ms_per_step": 1773.0, "seg_train_jit_compile": False, "seg_train_first_step_s": 29.0,
             "keras_fit_step_time_ms": 2613.0, "keras_fit_cpu_ms_per_step": 4855.0, "keras_fit_jit_compile": False,
             "keras_first_epoch_s": 53.0}
    inp = {"_command": ".venv/bin/seg-bench --config c.yaml --input-only --set data.cache=true",
           "num_train_images": 367, "input": {"first_pass_images_per_sec": 211.3, "images_per_sec": 326.6,
                                              "cache_mb": 60.2}}
    accuracy = [{"precision": "float32", "miou": 0.8911, "pixel_accuracy": 0.974, "step": 300, "_command": "a f32"},
                {"precision": "mixed_bfloat16", "miou": 0.8933, "pixel_accuracy": None, "step": 300,
                 "_command": "a bf16"}]
    slide = {"_command": ".venv/bin/python benchmarks/bench_slide_memory.py", "_loadavg_1min_before_after": [1.0, 1.0],
             "backbone": "mobilenetv2", "num_classes": 19, "crop": [512, 1024], "stride": [341, 683],
             "cases": {"model": {"image": [1024, 2048], "peak_rss_mb": 685.0, "above_model_mb": 0.0, "windows": 0},
                       "whole": {"image": [1024, 2048], "peak_rss_mb": 1535.0, "above_model_mb": 850.0, "windows": 1},
                       "slide": {"image": [1024, 2048], "peak_rss_mb": 1385.0, "above_model_mb": 700.0, "windows": 9},
                       "whole_large": {"image": [2048, 4096], "peak_rss_mb": 4196.0, "above_model_mb": 3511.0,
                                       "windows": 1},
                       "slide_large": {"image": [2048, 4096], "peak_rss_mb": 2503.0, "above_model_mb": 1818.0,
                                       "windows": 36}}}
    results = {"towers": towers, "variants": variants, "keras": keras, "input": inp, "accuracy": accuracy,
               "gradients": gradients, "accumulation": accumulation, "slide": slide}
    meta = {"config_text": "seed: 0\ndata:\n  root: d\n", "data_note": "data: d, 11 classes",
            "run_log": ["towers: 220s, load 1.4 -> 1.6", "total: 946s"], "started": "2026-11-22 09:30 UTC",
            "total_s": 946.0, "config_path": "runs/bench/camvid-medium.yaml"}
    return results, meta


def render(bench, tmp_path, results, meta):
    path = tmp_path / "PERFORMANCE.md"
    bench.write_report(path, results, meta["config_text"], meta["data_note"], meta["run_log"], meta["started"],
                       meta["total_s"], meta["config_path"])
    return path.read_text()


@pytest.fixture(scope="module")
def bench():
    return load_bench_script()


def row_cells(text, first, header=None):
    """The cells of the one table row of `text` whose first cell is `first` (in the table whose header
    line starts with `header`, if given)."""
    lines = text.splitlines()
    if header is not None:
        start = next(i for i, line in enumerate(lines) if line.startswith(header))
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        lines = lines[start:end]
    rows = [line.split("|")[1:-1] for line in lines if line.startswith(f"| {first} |")]
    assert len(rows) == 1, (first, rows)
    return [cell.strip() for cell in rows[0]]


def number(cell):
    return float(cell.rstrip("x%").replace("+", "").split()[0])


def test_tables_hold_the_figures_of_the_results(bench, tmp_path):
    # Each figure recomputed here from the made-up results (not from the report's template) and found in
    # its row, at the precision the row prints it.
    results, meta = fake_results()
    text = render(bench, tmp_path, results, meta)
    towers = results["towers"]
    for r in towers["towers"]:
        cells = row_cells(text, r["gpus"], "| towers | images/s |")
        got = [number(c) for c in cells[1:5]] + [number(cells[6])] + [number(c) for c in cells[7:11]]
        want = [r["images_per_sec"], r["images_per_sec"] / r["gpus"], towers["global_batch"] * 1000
                / r["images_per_sec"], r["efficiency"], 100 * r["input_wait_fraction"], r["achieved_gflops"],
                100 * r["flops_utilization"], r["cpu_ms_per_step"], r["cores_busy"]]
        assert got == pytest.approx(want, abs=0.51), (r["gpus"], cells)
    one, four = towers["towers"]
    cells = row_cells(text, "first step, 4 towers vs 1 (fresh process, launch to the end of step 1)")
    assert cells[2] == f"{four['first_step_s'] / one['first_step_s']:.2f}x ({four['first_step_s']} vs " \
                       f"{one['first_step_s']} s)"
    grad = results["gradients"]
    for v in grad["variants"]:
        t, base = v["towers"][0], grad["variants"][0]["towers"][0]
        cells = row_cells(text, v["name"], "| set-up | images/s | step ms |")
        assert number(cells[1]) == pytest.approx(t["images_per_sec"], abs=0.006)
        assert number(cells[2]) == pytest.approx(4 * 1000 * 2 / t["images_per_sec"], abs=0.51)
        assert number(cells[3]) == pytest.approx(t["images_per_sec"] / base["images_per_sec"], abs=0.006)
        assert [int(cells[6]), int(cells[7])] == [t["allreduce_ops_per_step"], t["cross_tower_graph_ops"]]
    var = results["variants"]
    base = var["variants"][0]["towers"][0]
    for v in var["variants"]:
        t = v["towers"][0]
        cells = row_cells(text, v["name"], "| variant | images/s |")
        assert number(cells[1]) == pytest.approx(t["images_per_sec"], abs=0.006), cells
        assert number(cells[3]) == pytest.approx(t["images_per_sec"] / base["images_per_sec"], abs=0.006)
        assert number(cells[5]) == pytest.approx(base["cpu_ms_per_step"] / t["cpu_ms_per_step"], abs=0.006)
        assert number(cells[9]) == pytest.approx(t["cpu_ms_per_step"], abs=0.51)
    keras = results["keras"]
    cells = row_cells(text, "seg-train step vs plain Keras `model.fit`, 1 device")
    assert cells[2].startswith(f"{keras['seg_train_images_per_sec'] / keras['keras_fit_images_per_sec']:.2f}x "
                               f"({keras['seg_train_images_per_sec']} vs {keras['keras_fit_images_per_sec']}")
    f32, bf16 = results["accuracy"]
    assert f"demo mIoU {100 * bf16['miou']:.1f}% vs {100 * f32['miou']:.1f}% " \
           f"(+{100 * (bf16['miou'] - f32['miou']):.1f} points)" in text


def lines_with(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


def test_remarks_are_picked_by_the_figures(bench, tmp_path):
    results, meta = fake_results()
    text = render(bench, tmp_path, results, meta)
    assert lines_with(
        text, "- **Towers**: 4 logical towers reach 0.73 of 1-tower speed (CPU time per step 1325 -> 1851 ms).")
    assert lines_with(text, "**XLA**: XLA is slower here (0.30x wall, 0.28x by CPU time)")

    faster = copy.deepcopy(results)
    faster["towers"]["towers"][-1]["efficiency"] = 0.9
    for key in ("speedup_vs_first_variant", "cpu_speedup_vs_first_variant"):
        faster["variants"][key]["train.jit_compile=true"] = 1.2
    del faster["input"]
    faster["variants"]["variants"][0]["towers"][0].pop("op_profile")  # no float32 profile
    text = render(bench, tmp_path, faster, meta)
    assert lines_with(text, "- **Towers**: ") == [
        "- **Towers**: 4 logical towers reach 0.90 of 1-tower speed on the same cores: the one-graph multi-tower "
        "step costs little beyond the work itself."]
    assert lines_with(text, "**XLA**: ") == [
        "**XLA**: XLA is 1.20x faster per step here (by CPU time 1.20x); worth turning on by default if its "
        "one-off compile (30s first step vs 27s) is acceptable."]
    assert not lines_with(text, "**Decoding cache**") and not lines_with(text, "- **FLOP/s**")
    assert "| base, 1 tower | n/a | n/a | n/a |" in text.splitlines()

    unclear = copy.deepcopy(results)
    unclear["variants"]["speedup_vs_first_variant"]["train.jit_compile=true"] = 1.2  # by CPU time still 0.28x
    assert lines_with(render(bench, tmp_path, unclear, meta), "**XLA**: ") == [
        "**XLA**: no clear gain (1.20x wall, 0.28x by CPU time) for a longer start (30s first step vs 27s): keep "
        "`train.jit_compile: false` as the default."]


def test_rows_and_figures_that_depend_on_the_results(bench, tmp_path):
    results, meta = fake_results()
    results["accuracy"][1]["miou"] = 0.8711  # 2 points below float32
    results["keras"]["speedup_seg_train_vs_keras_fit"] = 0.95
    results["variants"]["variants"][2]["peak_gflops"] = None  # no bfloat16 peak measured
    del results["variants"]["peaks"]["bfloat16"]
    text = render(bench, tmp_path, results, meta)
    summary = lines_with(text, "| train.precision mixed_bfloat16 vs float32 |")[0]
    assert "demo mIoU 87.1% vs 89.1% (-2.0 points)" in summary
    assert summary.endswith("| speed met, accuracy **missed** |")
    row = lines_with(text, "| seg-train step vs plain Keras `model.fit`, 1 device |")[0]
    assert row.endswith("| 2.74x | **missed** |")
    assert not lines_with(text, "| the same, mixed_bfloat16, 1 tower |")
    assert lines_with(text, "- measured peak, float32: ") == [
        "- measured peak, float32: matmul 188 GFLOP/s, 3x3 conv 191 GFLOP/s "
        "(measured in this run, under the load above)"]
    assert lines_with(text, "Difference: ") == ["Difference: -2.00 points (target: within 1). Each mIoU is the final "
                                                "evaluation of its run"]
    assert "| mixed_bfloat16 | 87.11% | n/a | 300 | `a bf16` |" in text.splitlines()


def test_docstring_lists_every_section(bench):
    usage, table = bench.__doc__.split("\n\n")[1], bench.__doc__.split("\n\n")[3]
    assert f"--only {','.join(bench.SECTIONS)}]" in usage
    firsts = [line.split()[0] for line in table.splitlines() if line[:2] == "  " and line[2] != " "]
    assert firsts == list(bench.SECTIONS)
