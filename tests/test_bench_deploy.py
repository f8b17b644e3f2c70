"""benchmarks/bench_deploy.py's report: int8 verdicts against the size and speed targets, on numbers worked by hand."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_deploy", ROOT / "benchmarks" / "bench_deploy.py")
bench_deploy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_deploy)


def file_result(val, test, ms1, ms2, size, float_ops):
    per_class = {"Sky": test, "Road": test}
    return {"val": {"miou": val, "per_class_iou": per_class}, "test": {"miou": test, "per_class_iou": per_class},
            "latency_ms": {"1": {"median": ms1}, "2": {"median": ms2}}, "size_bytes": size,
            "sidecar": {"float32_ops": float_ops}}


def results():
    checkpoint = {"miou": 0.62, "per_class_iou": {}, "inference": {"flip": True, "scales": [0.75, 1.0, 1.25]}}
    model = {"name": "camvid", "checkpoint_modes_val": checkpoint, "checkpoint_modes_test": checkpoint,
             "checkpoint_one_pass_val": checkpoint, "checkpoint_one_pass_test": checkpoint,
             "files": {"none": file_result(0.600, 0.500, 100.0, 60.0, 12_000_000, {"CONV_2D": 40}),
                       "float16": file_result(0.600, 0.500, 101.0, 61.0, 6_000_000, {"CONV_2D": 40}),
                       "int8": file_result(0.595, 0.488, 40.0, 35.0, 3_000_000, {"CAST": 1, "QUANTIZE": 1})}}
    return {"date": "2026-11-24", "threads": [1, 2], "models": [model], "log": ["seg-eval ..."], "total_s": 600}


def test_verdict_names_the_missed_targets():
    files = results()["models"][0]["files"]
    # Losses 0.5 (val) and 1.2 (test): the larger misses 1.0. Speed-ups 100/40 = 2.5x and 60/35 = 1.71x.
    assert bench_deploy.verdict(files["none"], files["int8"], [1, 2]) == \
        "gap MISSED (largest loss 1.20), speed MISSED (slowest 1.71x)"
    assert bench_deploy.verdict(files["none"], files["int8"], [1]) == \
        "gap MISSED (largest loss 1.20), speed met (slowest 2.50x)"


def test_report_rows_and_no_placeholder_left():
    text = bench_deploy.render(results())
    assert "{" not in text.replace("{{", "")
    assert "| DeepLabV3+ MobileNetV2 | TFLite int8, seg-eval --model | 59.50 | 48.80 | 3.00 | 40.0 | 35.0 |" in text
    assert "| DeepLabV3+ MobileNetV2 | -0.50 | -1.20 | 2.50x | 1.71x | 4.00x | CAST x1, QUANTIZE x1 |" in text


def test_keep_replaces_the_measured_models_and_keeps_the_others():
    old = results()
    old["models"].append({**old["models"][0], "name": "camvid_lraspp"})
    new = results()
    new["models"][0] = {**new["models"][0], "name": "camvid_lraspp", "step": 7}
    new["models"].append({**new["models"][0], "name": "camvid_segformer"})
    new.update(date="2026-11-26", log=["seg-export ..."], total_s=60)
    got = bench_deploy.merged(old, new)
    assert [m["name"] for m in got["models"]] == ["camvid", "camvid_lraspp", "camvid_segformer"]
    assert got["models"][1]["step"] == 7 and "step" not in got["models"][0]
    assert got["date"] == "2026-11-24 and 2026-11-26"
    assert (got["log"], got["total_s"]) == (["seg-eval ...", "seg-export ..."], 660)
    assert "| SegFormer-B0 | TFLite int8, seg-eval --model |" in bench_deploy.render(got)


def test_float_ops_file_gets_its_own_rows():
    r = results()
    files = r["models"][0]["files"]
    files["int8_float_ops"] = file_result(0.598, 0.497, 20.0, 10.0, 3_500_000, {"SOFTMAX": 8, "CAST": 1})
    text = bench_deploy.render(r)
    title = "| DeepLabV3+ MobileNetV2"
    assert f"{title} | TFLite int8 --float-ops, seg-eval --model | 59.80 | 49.70 | 3.50 | 20.0 | 10.0 |" in text
    assert f"{title}, --float-ops | -0.20 | -0.30 | 5.00x | 6.00x | 3.43x | SOFTMAX x8, CAST x1 |" in text


def test_onnx_file_gets_a_row_and_its_comparison_with_the_float32_tflite_file():
    """Fails for: the .onnx file's figures compared with another file than the float32 .tflite file of the
    same checkpoint, or its speed ratio inverted."""
    r = results()
    r["models"][0]["files"]["onnx"] = file_result(0.601, 0.498, 80.0, 50.0, 11_900_000, {})
    text = bench_deploy.render(r)
    title = "| DeepLabV3+ MobileNetV2"
    assert f"{title} | ONNX float32, seg-eval --model | 60.10 | 49.80 | 11.90 | 80.0 | 50.0 |" in text
    # val +0.10, test -0.20; 100 / 80 = 1.25x, 60 / 50 = 1.20x faster than LiteRT.
    assert f"{title} | +0.10 | -0.20 | 11.90 / 12.00 | 80.0 / 100.0 | 50.0 / 60.0 | 1.25x, 1.20x |" in text
    # Timed together (bench_deploy.TOGETHER), those figures replace seg-eval's in the comparison.
    r["models"][0]["together"] = {"ms": {"1": {"onnx": {"median": 70.0}, "none": {"median": 105.0}},
                                         "2": {"onnx": {"median": 40.0}, "none": {"median": 30.0}}}}
    text = bench_deploy.render(r)
    assert f"{title} | +0.10 | -0.20 | 11.90 / 12.00 | 70.0 / 105.0 | 40.0 / 30.0 | 1.50x, 0.75x |" in text
