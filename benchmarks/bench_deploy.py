#!/usr/bin/env python
"""CamVid to TFLite and ONNX: float32, float16 and int8 .tflite files and the float32 .onnx file of each recipe
measured by seg-eval, written to docs/DEPLOY.md.

    python benchmarks/bench_deploy.py [--models camvid,camvid_lraspp,camvid_segformer] [--run NAME=RUN_DIR ...]
                                   [--threads 1,2] [--calibration-images 200] [--output docs/DEPLOY.md]
                                   [--keep] [--report-only] [--set KEY=VALUE ...]

For each model NAME (configs/<name>.yaml), with the real commands a user runs:
  1. seg-train --config configs/<name>.yaml --gpus 1 --run-dir runs/deploy/<name>/run   (skipped when the run dir
     already holds the final step's checkpoint; --run NAME=DIR uses another run dir)
  2. seg-eval --checkpoint DIR --split val|test --json                          (the checkpoint, the config's
     eval modes: flips and scales)
  3. seg-eval --checkpoint DIR --split val|test --json --set eval.flip=false --set eval.scales=[1.0]
                                                                                (the checkpoint, one pass)
  4. seg-export --format tflite --quantize none|float16|int8 --output runs/deploy/NAME/Q.tflite
     seg-export --format onnx --output runs/deploy/NAME/onnx_float32.onnx        (the same model, float32)
  5. seg-eval --model FILE --split val|test --threads T --json                  (LiteRT or ONNX Runtime; mIoU,
                                                                                size, latency)
  6. the float32 .tflite and the .onnx file timed together in this process (TOGETHER)
Results go to runs/deploy/results.json, then docs/DEPLOY.md is rendered from benchmarks/templates/deploy.md
(--report-only re-renders from that JSON; --keep keeps the models of an earlier results.json that this run
does not measure, so one recipe can be added or measured again alone; --set KEY=VALUE goes to every command,
e.g. train.num_steps=20 for a quick look at the files of a short run). Latency is seg-eval's median LiteRT
invoke() (ONNX Runtime run()) per test image, so run it on a quiet machine: a second process on the same cores
slows every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "deploy"
TEMPLATE = ROOT / "benchmarks" / "templates" / "deploy.md"
BIN = Path(sys.executable).parent
# The CamVid root (VOC layout), absolute or relative to the repository: the environment's CAMVID_ROOT.
DATA = ["--set", "data.root=" + os.environ.get("CAMVID_ROOT", "data/camvid")]
QUANTIZATIONS = ("none", "float16", "int8")
LABEL = {"none": "float32", "float16": "float16", "int8": "int8", "int8_float_ops": "int8 --float-ops",
         "onnx": "ONNX float32"}
# A fourth file for the models whose int8 file leaves XNNPACK for some op kinds (docs/DEPLOY.md): int8 with
# those kept in float32.
FLOAT_OPS = {"camvid_segformer": "BATCH_MATMUL,SOFTMAX,GELU,RSQRT,SQUARED_DIFFERENCE"}
# The files seg-export writes per model (measure), by key.
FILES = {"none": "float32.tflite", "float16": "float16.tflite", "int8": "int8.tflite",
         "int8_float_ops": "int8_float_ops.tflite", "onnx": "onnx_float32.onnx"}
# The ONNX-beside-TFLite latency is timed with both files open in one process, in rounds that alternate which
# goes first, so that a load that comes and goes on a shared machine weighs on both alike: ROUNDS rounds of
# CALLS calls each on the first IMAGES val images; per file the median over rounds of each round's median.
TOGETHER = {"rounds": 5, "calls": 20, "images": 10}


def command(cmd: list[str], log: list[str]) -> str:
    """Runs `cmd` (stderr to the terminal), returns its stdout; exits on failure."""
    shown = " ".join(shlex.quote(c) for c in cmd).replace(str(BIN) + "/", "").replace(str(ROOT) + "/", "")
    print(f"$ {shown}", file=sys.stderr, flush=True)
    log.append(shown)
    start = time.time()
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"error: command failed ({shown}): exit {out.returncode}")
    print(f"  ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
    return out.stdout


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def final_step(config: Path, overrides: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from seg_train import config as config_lib
    return config_lib.load(config, overrides).train.num_steps


def has_checkpoint(run_dir: Path, step: int) -> bool:
    return (run_dir / "checkpoints" / f"ckpt-{step}.index").is_file()


def measure(name: str, run_dir: Path, threads: list[int], calibration: int, log: list[str],
            overrides: list[str] = ()) -> dict:
    config = ROOT / "configs" / f"{name}.yaml"
    step = final_step(config, list(overrides))
    data = DATA + [a for o in overrides for a in ("--set", o)]
    r = {"name": name, "config": f"configs/{name}.yaml", "run_dir": str(run_dir), "step": step}
    if not has_checkpoint(run_dir, step):
        start = time.time()
        command([str(BIN / "seg-train"), "--config", str(config), "--gpus", "1", "--run-dir", str(run_dir), *data], log)
        r["train_s"] = round(time.time() - start)
    ckpt = str(run_dir / "checkpoints" / f"ckpt-{step}")
    one_pass = ["--set", "eval.flip=false", "--set", "eval.scales=[1.0]"]
    for split in ("val", "test"):
        for mode, extra in (("modes", []), ("one_pass", one_pass)):
            rec = last_json(command([str(BIN / "seg-eval"), "--config", str(config), "--checkpoint", ckpt,
                                     "--split", split, "--json", *data, *extra], log))
            r[f"checkpoint_{mode}_{split}"] = {"miou": rec["miou"], "per_class_iou": rec["per_class_iou"],
                                               "inference": rec.get("inference")}
    r["files"] = {}
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    # (key, seg-export's format flags); the .onnx file is the float32 .tflite file's model (the same function).
    variants = [(q, ["--format", "tflite", "--quantize", q, "--calibration-images", str(calibration)])
                for q in QUANTIZATIONS]
    if name in FLOAT_OPS:
        variants.append(("int8_float_ops", ["--format", "tflite", "--quantize", "int8", "--calibration-images",
                                            str(calibration), "--float-ops", FLOAT_OPS[name]]))
    variants.append(("onnx", ["--format", "onnx"]))
    for q, flags in variants:
        path = folder / FILES[q]
        start = time.time()
        command([str(BIN / "seg-export"), "--config", str(config), "--checkpoint", ckpt, *flags,
                 "--output", str(path), "--force", *data], log)
        f = {"export_s": round(time.time() - start), "size_bytes": path.stat().st_size,
             "sidecar": json.loads(path.with_suffix(".json").read_text())}
        for split in ("val", "test"):
            # mIoU once per split (it does not depend on the threads); latency from the test split's runs.
            for t in threads if split == "test" else [max(threads)]:
                rec = last_json(command([str(BIN / "seg-eval"), "--config", str(config), "--model", str(path),
                                         "--split", split, "--threads", str(t), "--json", *data], log))
                f.setdefault(split, {"miou": rec["miou"], "per_class_iou": rec["per_class_iou"]})
                if split == "test":
                    f.setdefault("latency_ms", {})[str(t)] = rec["latency_ms"]
        r["files"][q] = f
    return r


def time_together(results: dict) -> None:
    """TOGETHER: each model's float32 .tflite and .onnx files (runs/deploy/NAME/) timed in this process at each
    thread count, through seg-train's own FileModel (as seg-eval runs them); adds "together" to each model."""
    import statistics

    import numpy as np
    from PIL import Image

    sys.path.insert(0, str(ROOT))
    from seg_train.infer.litert import open_model

    root = Path(os.environ.get("CAMVID_ROOT", "data/camvid"))
    root = root if root.is_absolute() else ROOT / root
    ids = (root / "ImageSets" / "Segmentation" / "val.txt").read_text().split()[:TOGETHER["images"]]
    images = [np.asarray(Image.open(root / "JPEGImages" / f"{i}.jpg").convert("RGB")) for i in ids]
    for r in results["models"]:
        if "onnx" not in r["files"]:
            continue
        r["together"] = {**TOGETHER, "ms": {}}
        for t in results["threads"]:
            models = {q: open_model(OUT / r["name"] / FILES[q], t) for q in ("none", "onnx")}
            per_round = {q: [] for q in models}
            for k in range(TOGETHER["rounds"]):
                for q in (list(models) if k % 2 == 0 else list(models)[::-1]):
                    m = models[q]
                    m.invoke_seconds.clear()
                    for j in range(TOGETHER["calls"]):
                        m.classes(images[j % len(images)])
                    per_round[q].append(1000 * statistics.median(m.invoke_seconds))
            r["together"]["ms"][str(t)] = {q: {"median": round(statistics.median(v), 3),
                                               "rounds": [round(x, 3) for x in v]} for q, v in per_round.items()}
            print(f"{r['name']}, {t} thread(s), together: " +
                  ", ".join(f"{q} {statistics.median(v):.1f} ms" for q, v in per_round.items()), file=sys.stderr)


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def render(results: dict) -> str:
    threads = results["threads"]
    rows = ["| model | what | val mIoU | test mIoU | size MB | " +
            " | ".join(f"ms/image, {t} thread{'s' if t > 1 else ''}" for t in threads) + " |",
            "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in threads) + " |"]
    gaps = []
    for r in results["models"]:
        title = TITLES.get(r["name"], r["name"])
        modes = r["checkpoint_modes_val"]["inference"] or {}
        rows.append(f"| {title} | checkpoint, seg-eval (flip {modes.get('flip')}, scales {modes.get('scales')}) | "
                    f"{pct(r['checkpoint_modes_val']['miou'])} | {pct(r['checkpoint_modes_test']['miou'])} | | " +
                    " | ".join("" for _ in threads) + " |")
        rows.append(f"| {title} | checkpoint, seg-eval, one pass | {pct(r['checkpoint_one_pass_val']['miou'])} | "
                    f"{pct(r['checkpoint_one_pass_test']['miou'])} | | " + " | ".join("" for _ in threads) + " |")
        for q, f in r["files"].items():
            lat = [f["latency_ms"][str(t)]["median"] for t in threads]
            what = LABEL[q] if q == "onnx" else f"TFLite {LABEL[q]}"
            rows.append(f"| {title} | {what}, seg-eval --model | {pct(f['val']['miou'])} | "
                        f"{pct(f['test']['miou'])} | {f['size_bytes'] / 1e6:.2f} | " +
                        " | ".join(f"{v:.1f}" for v in lat) + " |")
        fl = r["files"]["none"]
        for q in ("int8", "int8_float_ops"):
            if q not in r["files"]:
                continue
            i8 = r["files"][q]
            gaps.append(f"| {title}{', --float-ops' if q != 'int8' else ''} | "
                        f"{100 * (i8['val']['miou'] - fl['val']['miou']):+.2f} | "
                        f"{100 * (i8['test']['miou'] - fl['test']['miou']):+.2f} | " +
                        " | ".join(f"{fl['latency_ms'][str(t)]['median'] / i8['latency_ms'][str(t)]['median']:.2f}x"
                                   for t in threads) +
                        f" | {fl['size_bytes'] / i8['size_bytes']:.2f}x | "
                        f"{', '.join(f'{k} x{v}' for k, v in i8['sidecar']['float32_ops'].items()) or 'none'} | "
                        f"{verdict(fl, i8, threads)} |")
    gap_head = ["| model | int8 - float32, val | int8 - float32, test | " +
                " | ".join(f"int8 speed-up, {t} thread{'s' if t > 1 else ''}" for t in threads) +
                " | int8 smaller | ops left in float32 | targets (gap <= 1.0 mIoU, >= 2x faster) |",
                "| --- | --- | --- | " + " | ".join("---" for _ in threads) + " | --- | --- | --- |"]
    per_class = []
    for r in results["models"]:
        names = list(r["files"]["none"]["test"]["per_class_iou"])
        per_class.append(f"\n{TITLES.get(r['name'], r['name'])}, test IoU per class:\n")
        per_class.append("| class | " + " | ".join(LABEL[q] for q in r["files"]) + " |")
        per_class.append("| --- | " + " | ".join("---" for _ in r["files"]) + " |")
        for n in names:
            per_class.append(f"| {n} | " + " | ".join(pct(f["test"]["per_class_iou"][n]) for f in r["files"].values())
                             + " |")
    text = TEMPLATE.read_text()
    return (text.replace("{date}", results["date"]).replace("{table}", "\n".join(rows))
            .replace("{gaps}", "\n".join(gap_head + gaps)).replace("{onnx}", onnx_table(results))
            .replace("{per_class}", "\n".join(per_class))
            .replace("{commands}", "\n".join(f"    {c}" for c in results["log"]))
            .replace("{total_min}", f"{results['total_s'] / 60:.0f}"))


def onnx_table(results: dict) -> str:
    """The .onnx file against the float32 .tflite file of the same checkpoint: mIoU difference, size, and
    ONNX Runtime's latency against LiteRT's at each thread count (timed together, TOGETHER, where the results
    have it; else seg-eval's)."""
    threads = results["threads"]
    rows = ["| model | ONNX - TFLite mIoU, val | test | size MB, ONNX / TFLite | " +
            " | ".join(f"ms/image ONNX / TFLite, {t} thread{'s' if t > 1 else ''}" for t in threads) +
            " | ONNX speed vs TFLite, " + ", ".join(f"{t}t" for t in threads) + " |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in threads) + " | --- |"]
    if not any("onnx" in r["files"] for r in results["models"]):
        return ("No .onnx file in these results: they were measured before bench_deploy.py exported one (the "
                "next run adds this table).")
    for r in results["models"]:
        if "onnx" not in r["files"]:
            continue
        o, t = r["files"]["onnx"], r["files"]["none"]
        if "together" in r:
            ms = [(r["together"]["ms"][str(n)]["onnx"]["median"], r["together"]["ms"][str(n)]["none"]["median"])
                  for n in threads]
        else:
            ms = [(o["latency_ms"][str(n)]["median"], t["latency_ms"][str(n)]["median"]) for n in threads]
        rows.append(f"| {TITLES.get(r['name'], r['name'])} | {100 * (o['val']['miou'] - t['val']['miou']):+.2f} | "
                    f"{100 * (o['test']['miou'] - t['test']['miou']):+.2f} | "
                    f"{o['size_bytes'] / 1e6:.2f} / {t['size_bytes'] / 1e6:.2f} | " +
                    " | ".join(f"{a:.1f} / {b:.1f}" for a, b in ms) + " | " +
                    ", ".join(f"{b / a:.2f}x" for a, b in ms) + " |")
    return "\n".join(rows)


def merged(old: dict, new: dict) -> dict:
    """`new`'s models with those of `old` it did not measure (in old's order, new ones after); dates, commands
    and time of both."""
    if old.get("threads") != new["threads"]:
        raise SystemExit(f"error: --keep with other thread counts (runs/deploy/results.json): "
                         f"{old.get('threads')} there, {new['threads']} here")
    names = {m["name"] for m in new["models"]}
    by_name = {m["name"]: m for m in new["models"]}
    models = [by_name.pop(m["name"]) if m["name"] in names else m for m in old["models"]] + list(by_name.values())
    dates = old["date"] if old["date"] == new["date"] else f"{old['date']} and {new['date']}"
    return {**new, "date": dates, "models": models, "log": old["log"] + new["log"],
            "total_s": old["total_s"] + new["total_s"]}


def verdict(fl: dict, i8: dict, threads: list[int]) -> str:
    """Whether int8 meets the targets: within 1.0 mIoU of float32 (val and test), 2x faster at each thread count."""
    gap = max(100 * (fl[s]["miou"] - i8[s]["miou"]) for s in ("val", "test"))
    speed = min(fl["latency_ms"][str(t)]["median"] / i8["latency_ms"][str(t)]["median"] for t in threads)
    return (f"gap {'met' if gap <= 1.0 else 'MISSED'} (largest loss {gap:.2f}), "
            f"speed {'met' if speed >= 2.0 else 'MISSED'} (slowest {speed:.2f}x)")


TITLES = {"camvid": "DeepLabV3+ MobileNetV2", "camvid_lraspp": "LR-ASPP MobileNetV3-Large",
          "camvid_segformer": "SegFormer-B0"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="camvid,camvid_lraspp,camvid_segformer")
    p.add_argument("--run", action="append", default=[], metavar="NAME=RUN_DIR")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--calibration-images", type=int, default=200)
    p.add_argument("--output", default=str(ROOT / "docs" / "DEPLOY.md"))
    p.add_argument("--keep", action="store_true",
                   help="keep the models of an earlier results.json that this run does not measure")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--time-together", action="store_true",
                   help="only time the float32 .tflite and .onnx files of results.json together (TOGETHER), "
                        "then render")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="a config override for every command (e.g. train.num_steps=20: a short run's files)")
    a = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    results_path = OUT / "results.json"
    if a.time_together:
        results = json.loads(results_path.read_text())
        time_together(results)
        results_path.write_text(json.dumps(results, indent=1) + "\n")
    elif not a.report_only:
        runs = dict(item.split("=", 1) for item in a.run)
        threads = [int(t) for t in a.threads.split(",")]
        log: list[str] = []
        start = time.time()
        models = [measure(n, Path(runs.get(n, OUT / n / "run")).resolve(), threads, a.calibration_images, log,
                          a.overrides)
                  for n in a.models.split(",")]
        results = {"date": datetime.date.today().isoformat(), "threads": threads, "models": models, "log": log,
                   "total_s": time.time() - start, "cpu_count": os.cpu_count()}
        time_together(results)
        if a.keep and results_path.is_file():
            results = merged(json.loads(results_path.read_text()), results)
        results_path.write_text(json.dumps(results, indent=1) + "\n")
    results = json.loads(results_path.read_text())
    Path(a.output).write_text(render(results))
    print(f"wrote {a.output} (results in {results_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
