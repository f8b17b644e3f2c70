#!/usr/bin/env python
"""`make bench`: runs the standard benchmarks one after the other and writes docs/PERFORMANCE.md.

    python scripts/bench.py [--only towers,variants,keras,accuracy] [--output docs/PERFORMANCE.md]
                            [--data ../shared/data/camvid] [--steps K] [--windows W] [--dry-run]

Every figure comes from one of the commands below, run by this script in one go, so all ratios are
from the same run (and each command times its own comparison interleaved in one process):

  towers    seg-bench --gpus 1,2,4                      tower scaling, input alone/wait, FLOP/s, memory
  variants  seg-bench --gpus 1 --compare input=cached --compare train.precision=mixed_bfloat16
                      --compare train.jit_compile=true  reader vs cached, bf16 vs fp32, XLA vs not
  keras     scripts/keras_fit_baseline_speed.py         seg-train step vs plain Keras model.fit
  accuracy  seg-train (configs/demo.yaml) in float32 and in mixed_bfloat16, 1 tower; the final
            evaluation of each run (seg_train.evaluate, BN statistics re-estimated) gives val mIoU

The speed benchmarks use a medium config written to runs/bench/camvid-medium.yaml (shown in the
report): DeepLabV3+ on MobileNetV2, output stride 16, crop 160x160, global batch 8, CamVid
(../shared/data/camvid, 240x180 JPEGs, 11 classes); without CamVid, a synthetic demo set of the same
image size is generated instead and the report says so. JSON results go to runs/bench/*.json.
With --only, the selected benchmarks run and print, and the report is NOT rewritten.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OUT = Path("runs/bench")  # relative to ROOT (commands in the report are run from the repo root)
CONFIG = OUT / "camvid-medium.yaml"
SECTIONS = ("towers", "variants", "keras", "accuracy")

TARGETS = {
    "keras": ">= 1.0x, aim 1.2x",
    "input": "input wait < 5% of step time",
    "towers": "4 towers at most 15% slower than 1 (efficiency >= 0.85)",
    "bf16": ">= 1.5x faster, demo mIoU within 1 point",
    "jit": "measured; on by default?",
    "flops": "report; aim 40%+",
}


def medium_config(data_root: str, num_classes: int, synthetic: bool) -> str:
    return f"""# Medium benchmark config (written by scripts/bench.py): representative, fits the time budget.
seed: 0
run_dir: medium-run          # not used by the benchmarks (they write no checkpoints)
data:
  root: {data_root}
  synthetic: {str(synthetic).lower()}
  num_classes: {num_classes}
  batch_size: 8              # GLOBAL batch: 8 on 1 tower, 4 x 2 on 2, 2 x 4 on 4
  crop_size: [160, 160]
  random_scale: [0.5, 2.0]
  random_mirror: true
model:
  backbone: mobilenetv2
  output_stride: 16
train:
  precision: float32         # seg-train's defaults otherwise (jit_compile false, adam, ...)
"""


def run_json(name: str, cmd: list[str], log_lines: list[str]) -> dict:
    """Runs a command (from the repo root) that prints one JSON object; stderr goes to the terminal."""
    shown = display(cmd)
    print(f"\n=== {name}: {shown}", file=sys.stderr, flush=True)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: benchmark {name!r} failed with exit code {proc.returncode}: {shown}")
    result = json.loads(proc.stdout)
    result["_command"] = shown
    result["_wall_s"] = wall
    result["_loadavg_1min_before_after"] = [load0, os.getloadavg()[0]]
    (ROOT / OUT).mkdir(parents=True, exist_ok=True)
    (ROOT / OUT / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    log_lines.append(f"{name}: {wall:.0f}s, load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    return result


def display(cmd: list[str]) -> str:
    """A command as a user would type it from the repo root (.venv/bin/... shortened)."""
    out = []
    for c in cmd:
        if c.startswith(str(BIN) + os.sep):
            c = os.path.relpath(c, ROOT)
        out.append(shlex.quote(c))
    return " ".join(out)


def run_accuracy(precision: str, log_lines: list[str]) -> dict:
    run_dir = OUT / f"acc-{precision}"
    if (ROOT / run_dir).exists():
        shutil.rmtree(ROOT / run_dir)  # our own run dir: a fresh run, not a resume
    cmd = [str(BIN / "seg-train"), "--config", "configs/demo.yaml", "--gpus", "1", "--run-dir", str(run_dir),
           "--set", f"train.precision={precision}"]
    shown = display(cmd)
    print(f"\n=== accuracy {precision}: {shown}", file=sys.stderr, flush=True)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: accuracy run failed with exit code {proc.returncode}: {shown}")
    best = json.loads((ROOT / run_dir / "best" / "best.json").read_text())
    log_lines.append(f"accuracy {precision}: {wall:.0f}s, load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    return {"precision": precision, "miou": best["miou"], "pixel_accuracy": best.get("pixel_accuracy"),
            "step": best["step"], "wall_s": wall, "_command": shown}


# ---- the report ----------------------------------------------------------------------------------------
def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def write_report(path: Path, r: dict, config_text: str, data_note: str, run_log: list[str], started: str,
                 total_s: float) -> None:
    tw, va, ke, acc = r["towers"], r["variants"], r["keras"], r["accuracy"]
    m = tw["machine"]
    c = lambda res: f"`{res['_command']}`"
    rows1 = {t["gpus"]: t for t in tw["towers"]}
    t1, tn = rows1[1], tw["towers"][-1]
    sp = va["speedup_vs_first_variant"]
    v = {x["name"]: x for x in va["variants"]}
    base, jit = v["base"], v["train.jit_compile=true"]
    jit_speed = sp["train.jit_compile=true"]
    bf16_speed = sp["train.precision=mixed_bfloat16"]
    miou = {a["precision"]: a["miou"] for a in acc}
    dmiou = 100 * (miou["mixed_bfloat16"] - miou["float32"])
    jit_first = jit["towers"][0]["first_step_s"]
    base_first = base["towers"][0]["first_step_s"]
    if jit_speed >= 1.05:
        jit_verdict = (f"XLA is {jit_speed:.2f}x faster per step here; worth turning on by default once its "
                       f"one-off compile ({jit_first:.0f}s first step vs {base_first:.0f}s) is acceptable")
    elif jit_speed <= 0.95:
        jit_verdict = f"XLA is slower here ({jit_speed:.2f}x): keep `train.jit_compile: false` as the default"
    else:
        jit_verdict = (f"no clear gain ({jit_speed:.2f}x, within noise) for a longer start ({jit_first:.0f}s first "
                       f"step vs {base_first:.0f}s): keep `train.jit_compile: false` as the default")
    util1 = t1["flops_utilization"]
    flops = tw["flops"]
    peak = tw["peak"]
    bf16_peak = va["peaks"].get("bfloat16")
    keras_speed = ke["speedup_seg_train_vs_keras_fit"]
    load_vals = [x for res in (tw, va, ke) for x in res["_loadavg_1min_before_after"]]

    lines = [
        "# Performance",
        "",
        "Generated by `make bench` (`scripts/bench.py`); do not edit by hand, rerun it. Every figure below",
        "comes from ONE run of the script; each comparison was timed inside one process with the compared",
        "set-ups interleaved (windows A B, B A, ...), so a change of machine load during the run hits both",
        "sides. Each table names the command that produced it (run from the repo root after",
        "`make bench` has written the config; `--json` gives every number, `runs/bench/*.json` keeps them).",
        "",
        f"Run started {started}, took {total_s / 60:.1f} min. 1-minute load average during the speed runs: "
        f"{min(load_vals):.1f} to {max(load_vals):.1f} on {m['usable_cpus']} CPUs (other processes shared the "
        "machine; absolute images/s move with that load, interleaved ratios much less).",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['logical_cpus']} logical CPUs ({m['usable_cpus']} usable), "
        f"ISA: {', '.join(m['isa'])}",
        f"- TensorFlow {m['tensorflow']}, Keras {m['keras']}, Python {m['python']}; no GPU: towers are logical",
        "  CPU devices (the CPU split N ways; they share the same cores, so the ideal N-tower speed is",
        "  the 1-tower speed, not N times it)",
        f"- measured peak ({peak['dtype']}): matmul {peak['matmul_gflops']:.0f} GFLOP/s, 3x3 conv "
        f"{peak['conv3x3_gflops']:.0f} GFLOP/s"
        + (f"; bfloat16: matmul {bf16_peak['matmul_gflops']:.0f}, 3x3 conv {bf16_peak['conv3x3_gflops']:.0f} GFLOP/s"
           if bf16_peak else ""),
        "",
        "## Summary",
        "",
        "| comparison | target | measured | |",
        "| --- | --- | --- | --- |",
        f"| seg-train step vs plain Keras `model.fit` (1 device) | {TARGETS['keras']} | "
        f"{keras_speed:.2f}x ({ke['seg_train_images_per_sec']:.2f} vs {ke['keras_fit_images_per_sec']:.2f} images/s) | "
        f"{met(keras_speed >= 1.0)} |",
        f"| real ImageReader vs the same batches cached in memory | {TARGETS['input']} | wait "
        f"{pct(base['input_wait_fraction'])} of the step; cached is {sp['input=cached']:.2f}x the reader's speed | "
        f"{met(base['input_wait_fraction'] < 0.05)} |",
        f"| 4 logical towers vs 1, same global batch | {TARGETS['towers']} | efficiency {tn['efficiency']:.2f} "
        f"({tn['images_per_sec']:.2f} vs {t1['images_per_sec']:.2f} images/s) | {met(tn['efficiency'] >= 0.85)} |",
        f"| train.precision mixed_bfloat16 vs float32 | {TARGETS['bf16']} | {bf16_speed:.2f}x; demo mIoU "
        f"{100 * miou['mixed_bfloat16']:.1f}% vs {100 * miou['float32']:.1f}% ({dmiou:+.1f} points) | "
        f"speed {met(bf16_speed >= 1.5)}, accuracy {met(abs(dmiou) <= 1.0)} |",
        f"| train.jit_compile true vs false | {TARGETS['jit']} | {jit_speed:.2f}x | see below |",
        f"| achieved FLOP/s / measured peak (float32, 1 tower) | {TARGETS['flops']} | "
        f"{t1['achieved_gflops']:.0f} / {peak['peak_gflops']:.0f} GFLOP/s = {pct(util1)} | {met(util1 >= 0.40)} |",
        "",
        "## Benchmark config",
        "",
        f"`{CONFIG}` ({data_note}):",
        "",
        "```yaml",
        config_text.rstrip(),
        "```",
        "",
        "## How each figure is measured",
        "",
        "- **images/s**: the real `Trainer.train_step`, fed by the real `ImageReader` through",
        "  `distribute_datasets_from_function`, exactly as `seg-train` runs it (the host reads the loss every",
        "  step). Warm-up steps (tracing, first steps, tf.data autotuning) are never timed; then windows of",
        "  K steps are timed and the MEDIAN window is reported; images/s = global batch x K / window time,",
        "  per tower = that / N, step time = window time / K.",
        "- **scaling efficiency** at N towers = images/s at N / images/s at 1 tower, same global batch.",
        "- **input wait** = time blocked in `next(iterator)` / total time of the timed steps.",
        "- **input images/s alone**: the same reader pipeline iterated without training.",
        "- **cached**: the same first batches of the reader decoded and augmented once, then served from",
        "  memory (`seg-bench --input cached`); reader vs cached is the whole cost of the input pipeline",
        "  (waiting AND the CPU it takes from the step).",
        f"- **FLOPs**: {flops['method']}; {flops['train_gflop_per_image']:.2f} GFLOP per training image "
        f"(forward {flops['forward_gflop_per_image']:.2f}, ratio {flops['train_to_forward']:.2f}; runtime pruning",
        "  of the first conv's unused input gradient makes the executed count a little lower).",
        "- **achieved FLOP/s** = counted FLOPs per step / median step time; **peak** = the faster of a",
        "  2048^3 matmul and a 3x3 conv (4x56x56x256 -> 256) timed in the same process, in the compute dtype",
        "  of train.precision.",
        "- **peak memory**: VmHWM of the benchmark process (all its runners alive at once).",
        "- **plain Keras baseline**: the same `seg_train.models.build` model and precision, the same reader",
        "  batches, `compile(Adam, SparseCategoricalCrossentropy(from_logits=True, ignore_class=255))`,",
        "  `model.fit(ds, steps_per_epoch=K+1, epochs=W+1)` on one device; a callback times each epoch after",
        "  its first step and runs one seg-train window between Keras epochs (interleaved).",
        "",
        "## Towers (logical CPU devices, same global batch)",
        "",
        c(tw),
        "",
        "| towers | images/s | per tower | step ms | efficiency | input wait | GFLOP/s | of peak |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in tw["towers"]:
        lines.append(f"| {t['gpus']} | {t['images_per_sec']:.2f} | {t['images_per_sec_per_tower']:.2f} | "
                     f"{t['step_time_ms']:.0f} | {t['efficiency']:.3f} | {pct(t['input_wait_fraction'])} | "
                     f"{t['achieved_gflops']:.1f} | {pct(t['flops_utilization'])} |")
    lines += [
        "",
        f"Input pipeline alone: {tw['input_images_per_sec']:.1f} images/s (global batches of "
        f"{tw['global_batch']}, no training). Peak resident memory of this process: {tw['peak_rss_mb']:.0f} MiB "
        f"({len(tw['towers'])} trainers alive at once).",
        "",
        "## Input, precision and XLA (1 tower)",
        "",
        c(va),
        "",
        "| variant | images/s | step ms | vs base | input wait | GFLOP/s | of peak (own dtype) | first step s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in va["variants"]:
        t = x["towers"][0]
        lines.append(f"| {x['name']} | {t['images_per_sec']:.2f} | {t['step_time_ms']:.0f} | {sp[x['name']]:.2f}x | "
                     f"{pct(t['input_wait_fraction'])} | {t['achieved_gflops']:.1f} | {pct(t['flops_utilization'])} | "
                     f"{t['first_step_s']:.0f} |")
    lines += [
        "",
        f"Peak resident memory of this process: {va['peak_rss_mb']:.0f} MiB ({len(va['variants'])} trainers).",
        "",
        f"XLA: {jit_verdict}.",
        "",
        "## seg-train vs plain Keras model.fit (1 device)",
        "",
        c(ke),
        "",
        "| | images/s | step ms | jit_compile | first epoch / first step s |",
        "| --- | ---: | ---: | --- | ---: |",
        f"| seg-train `Trainer.train_step` | {ke['seg_train_images_per_sec']:.2f} | {ke['seg_train_step_time_ms']:.0f} | "
        f"{ke['seg_train_jit_compile']} | {ke['seg_train_first_step_s']:.0f} |",
        f"| Keras `model.fit` | {ke['keras_fit_images_per_sec']:.2f} | {ke['keras_fit_step_time_ms']:.0f} | "
        f"{ke['keras_fit_jit_compile']} (Keras' `auto`) | {ke['keras_first_epoch_s']:.0f} |",
        "",
        f"seg-train / Keras = {keras_speed:.3f}x. seg-train's step also computes weight decay, non-finite checks",
        "and the predictions it returns for image summaries; the Keras baseline does none of these.",
        "",
        "## bfloat16 accuracy check (demo data)",
        "",
        "| precision | val mIoU | pixel accuracy | steps | command |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for a in acc:
        lines.append(f"| {a['precision']} | {100 * a['miou']:.2f}% | {pct(a['pixel_accuracy'])} | {a['step']} | "
                     f"`{a['_command']}` |")
    lines += [
        "",
        f"Difference: {dmiou:+.2f} points (target: within 1). The mIoU is the final evaluation of each run",
        "(`seg_train.evaluate` on the demo val split at full resolution, BN statistics re-estimated),",
        "as kept in `RUN_DIR/best/best.json`.",
        "",
        "## Run log",
        "",
        "```",
        *run_log,
        "```",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run the standard benchmarks and write docs/PERFORMANCE.md.")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(SECTIONS)} (the report is not rewritten)")
    p.add_argument("--output", default="docs/PERFORMANCE.md")
    p.add_argument("--data", default="../shared/data/camvid", help="VOC-layout data for the speed benchmarks")
    p.add_argument("--steps", type=int, default=5, help="timed steps per window (default 5)")
    p.add_argument("--windows", type=int, default=3, help="timed windows per runner (default 3)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = only - set(SECTIONS)
    if unknown:
        raise SystemExit(f"error: unknown --only section(s) {sorted(unknown)}: expected {','.join(SECTIONS)}")

    # ---- the medium config -----------------------------------------------------------------------
    data = (ROOT / args.data).resolve()
    if (data / "ImageSets" / "Segmentation" / "train.txt").is_file() and (data / "classes.txt").is_file():
        num_classes = len([x for x in (data / "classes.txt").read_text().splitlines() if x.strip()])
        data_root, synthetic = os.path.relpath(data, ROOT / OUT), False
        data_note = f"data: {args.data}, {num_classes} classes"
    else:
        data_root, synthetic, num_classes = "synthetic-240x180", True, 5
        data_note = f"{args.data} not found: a synthetic demo data set with 240x180 images instead"
        from seg_train import demo_data
        demo_data.generate(ROOT / OUT / data_root, num_classes=5, size=(180, 240), seed=0)
    config_text = medium_config(data_root, num_classes, synthetic)
    (ROOT / OUT).mkdir(parents=True, exist_ok=True)
    (ROOT / CONFIG).write_text(config_text)

    seg_bench = str(BIN / "seg-bench")
    common = ["--config", str(CONFIG), "--steps", str(args.steps), "--windows", str(args.windows), "--json"]
    commands = {
        "towers": [seg_bench, *common, "--gpus", "1,2,4"],
        "variants": [seg_bench, *common, "--gpus", "1", "--no-input-alone", "--compare", "input=cached",
                     "--compare", "train.precision=mixed_bfloat16", "--compare", "train.jit_compile=true"],
        "keras": [str(BIN / "python"), "scripts/keras_fit_baseline_speed.py", *common],
    }
    if args.dry_run:
        for name in SECTIONS:
            if name in commands:
                print(display(commands[name]))
            else:
                for prec in ("float32", "mixed_bfloat16"):
                    print(f".venv/bin/seg-train --config configs/demo.yaml --gpus 1 --run-dir runs/bench/acc-{prec} "
                          f"--set train.precision={prec}")
        return 0

    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    t0 = time.perf_counter()
    run_log: list[str] = []
    results = {}
    for name in ("towers", "variants", "keras"):
        if name in only:
            results[name] = run_json(name, commands[name], run_log)
    if "accuracy" in only:
        results["accuracy"] = [run_accuracy(prec, run_log) for prec in ("float32", "mixed_bfloat16")]
        (ROOT / OUT / "accuracy.json").write_text(json.dumps(results["accuracy"], indent=1) + "\n")
    total = time.perf_counter() - t0
    run_log.append(f"total: {total:.0f}s")
    print("\n".join(run_log), file=sys.stderr)
    if only != set(SECTIONS):
        print(json.dumps({k: v for k, v in results.items()}, indent=1, default=str))
        return 0
    out = ROOT / args.output
    write_report(out, results, config_text, data_note, run_log, started, total)
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
