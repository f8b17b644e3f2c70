#!/usr/bin/env python
"""`make bench`: runs the standard benchmarks one after the other and writes docs/PERFORMANCE.md.

    python scripts/bench.py [--only towers,variants,keras,accuracy] [--output docs/PERFORMANCE.md]
                            [--data ../shared/data/camvid] [--steps K] [--windows W] [--dry-run]

Every figure comes from one of the commands below, run by this script in one go, so all ratios are
from the same run (and each command times its own comparison interleaved in one process):

  towers    seg-bench --gpus 1,4                        tower scaling, input alone/wait, FLOP/s, memory
  variants  seg-bench --gpus 1 --compare input=cached --compare train.precision=mixed_bfloat16
                      --compare train.jit_compile=true --compare model.fast_atrous=false
                      --compare model.fused_batchnorm=false
                                                        reader vs cached, bf16 vs fp32, XLA vs not,
                                                        seg-train's dilated conv and BN vs Keras' own
  keras     scripts/baseline_keras_fit_speed.py         seg-train step vs plain Keras model.fit
  accuracy  seg-train (configs/demo.yaml) in float32 and in mixed_bfloat16, 1 tower, both at once; the final
            evaluation of each run (seg_train.evaluate, BN statistics re-estimated) gives val mIoU

The speed benchmarks use a medium config written to runs/bench/camvid-medium.yaml (shown in the
report): DeepLabV3+ on MobileNetV2, output stride 16, crop 128x128, global batch 8, CamVid
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
SECTIONS = ("towers", "variants", "keras", "input", "accuracy")

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
  crop_size: [128, 128]
  random_scale: [0.5, 2.0]
  random_mirror: true
model:
  backbone: mobilenetv2
  output_stride: 16
train:
  precision: float32         # seg-train's defaults otherwise (jit_compile false, adam, ...)
"""


def run_json(name: str, cmd: list[str], log_lines: list[str], out_dir: Path = OUT) -> dict:
    """Runs a command (from the repo root) that prints one JSON object; stderr goes to the terminal."""
    shown = display(cmd)
    print(f"\n=== {name}: {shown}", file=sys.stderr, flush=True)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: benchmark {name!r} failed with exit code {proc.returncode}: {shown}")
    result = json.loads(proc.stdout)
    result["_command"] = shown
    result["_wall_s"] = wall
    result["_loadavg_1min_before_after"] = [load0, os.getloadavg()[0]]
    (ROOT / out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
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


def accuracy_command(precision: str, out_dir: Path, num_steps: int | None) -> list[str]:
    cmd = [str(BIN / "seg-train"), "--config", "configs/demo.yaml", "--gpus", "1", "--run-dir",
           str(out_dir / f"acc-{precision}"), "--set", f"train.precision={precision}"]
    if num_steps:
        cmd += ["--set", f"train.num_steps={num_steps}"]
    return cmd


def run_accuracy(log_lines: list[str], out_dir: Path = OUT, num_steps: int | None = None) -> list[dict]:
    """Trains the demo in float32 and in mixed_bfloat16 (both at once: only their accuracy is compared)."""
    procs = []
    for precision in ("float32", "mixed_bfloat16"):
        run_dir = ROOT / out_dir / f"acc-{precision}"
        if run_dir.exists():
            shutil.rmtree(run_dir)  # our own run dir: a fresh run, not a resume
        cmd = accuracy_command(precision, out_dir, num_steps)
        print(f"\n=== accuracy {precision}: {display(cmd)}", file=sys.stderr, flush=True)
        log_file = open(ROOT / out_dir / f"acc-{precision}.log", "w")
        procs.append((precision, run_dir, cmd, log_file, subprocess.Popen(cmd, cwd=ROOT, stdout=log_file,
                                                                          stderr=subprocess.STDOUT)))
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    results = []
    for precision, run_dir, cmd, log_file, proc in procs:
        code = proc.wait()
        log_file.close()
        if code != 0:
            raise SystemExit(f"error: accuracy run failed with exit code {code}: {display(cmd)} "
                             f"(log: {out_dir}/acc-{precision}.log)")
        best = json.loads((run_dir / "best" / "best.json").read_text())
        results.append({"precision": precision, "miou": best["miou"], "pixel_accuracy": best.get("pixel_accuracy"),
                        "step": best["step"], "_command": display(cmd)})
    wall = time.perf_counter() - t0
    log_lines.append(f"accuracy (float32 and mixed_bfloat16 side by side): {wall:.0f}s, load {load0:.1f} -> "
                     f"{os.getloadavg()[0]:.1f}")
    return results


# ---- the report ----------------------------------------------------------------------------------------
def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def _profile_line(name: str, prof: dict | None) -> str:
    if not prof:
        return f"| {name} | n/a | n/a | n/a |"
    top = ", ".join(f"{k.replace('_MklNative', '')} {share:.0%}" for k, _, share in prof["top_ops"][:7])
    return (f"| {name} | {prof['profiled_step_ms']:.0f} | {prof['conv_share_of_op_time']:.0%} | {top} |")


def _share(prof: dict | None, *names: str) -> float:
    """Share of op time of the op types whose name contains any of `names`."""
    if not prof:
        return float("nan")
    return sum(share for k, _, share in prof["top_ops"] if any(n in k for n in names))


def slowest(prof: dict, n: int = 4) -> str:
    """The n slowest single ops of a profile: 'layer (OpType) share', layer = the name part after the model."""
    out = []
    for name, _, share in prof.get("top_op_instances", [])[:n]:
        path, _, typ = name.rpartition(":")
        parts = [p for p in path.split("/") if p and not p.startswith(("gradient_tape", "deeplabv3plus", "convolution"))]
        if len(parts) > 1 and parts[-1] == typ.replace("_MklNative", ""):
            parts = parts[:-1]  # the op's own name: the layer is the part before it
        layer = parts[-1] if parts else path
        out.append(f"{layer.removesuffix('_1')} ({typ.replace('_MklNative', '')}) {share:.0%}")
    return ", ".join(out) or "n/a"




def notes(tw, va, ke, t1, tn, b1, bf1, bf16_speed, keras_speed) -> list[str]:
    """Generated remarks: what each missed target most likely comes from, with this run's numbers."""
    out = []
    p1, pb = b1.get("op_profile"), bf1.get("op_profile")
    if tn["efficiency"] < 0.85:
        out.append(
            f"- **Towers**: {tn['gpus']} logical towers reach {tn['efficiency']:.2f} of 1-tower speed (CPU time per step "
            f"{t1['cpu_ms_per_step']:.0f} -> {tn['cpu_ms_per_step']:.0f} ms). The towers share the same {tw['machine']['usable_cpus']} "
            f"cores, each convolves batch {tw['global_batch'] // tn['gpus']} instead of {tw['global_batch']} (smaller ops "
            "parallelise worse), and each step adds cross-tower work: the gradient sum through one device and the "
            "BN moving-statistics average. This measures the one-graph overhead, not GPU scaling: on GPUs each "
            "tower has a device of its own.")
    else:
        out.append(f"- **Towers**: {tn['gpus']} logical towers reach {tn['efficiency']:.2f} of 1-tower speed on the same "
                   "cores: the one-graph multi-tower step costs little beyond the work itself.")
    if p1:
        out.append(
            f"- **FLOP/s**: {pct(t1['flops_utilization'])} of the measured float32 peak at 1 tower. Convolutions take "
            f"{p1['conv_share_of_op_time']:.0%} of op time; BatchNormalization (fused, `model.fused_batchnorm`) "
            f"{_share(p1, 'FusedBatchNorm'):.0%}; the rest is element-wise work, the loss and the optimizer. "
            f"This model's convolutions are small ({tw['backbone']} backbone, depthwise convs, a "
            f"{tw['crop_size'][0] // tw['output_stride']}x{tw['crop_size'][1] // tw['output_stride']} ASPP map at output "
            f"stride {tw['output_stride']} on {tw['crop_size'][0]}x{tw['crop_size'][1]} crops, batch {tw['global_batch']}), "
            f"far from the 2048^3 matmul / large 3x3 conv the peak is measured with. Slowest single ops: {slowest(p1)}.")
    if pb:
        out.append(
            f"- **bfloat16**: convolutions on AMX reach {va['peaks'].get('bfloat16', {}).get('conv3x3_gflops', float('nan')):.0f} "
            f"GFLOP/s in the peak test (float32: {va['peaks']['float32']['conv3x3_gflops']:.0f}); the whole step gains "
            f"{bf16_speed:.2f}x. In bfloat16 the dense convolutions shrink, but the depthwise convolutions' and "
            f"BatchNormalization's gradients, the element-wise ops and the casts do not (on this CPU some are "
            f"slower in bfloat16 than in float32): depthwise convs take {_share(pb, 'Depthwise'):.0%} of op time in "
            f"bfloat16 vs {_share(p1, 'Depthwise'):.0%} in float32, casts {_share(pb, 'Cast'):.0%}; slowest single ops: "
            f"{slowest(pb)}. The fast atrous convs and the fused BN (both on by default) made the float32 step "
            "itself much cheaper, which leaves bfloat16 less to win. The ratio also moves on this shared machine "
            "(see the per-window ratios).")
    plain = {k: va["speedup_vs_first_variant"].get(k) for k in ("model.fast_atrous=false", "model.fused_batchnorm=false")}
    text = (f"- **Keras baseline**: {keras_speed:.2f}x wall clock, {ke['cpu_speedup_seg_train_vs_keras_fit']:.2f}x by CPU "
            "time (per-window ratios "
            f"{ke['speedup_window_range'][0]:.2f}-{ke['speedup_window_range'][1]:.2f}x). The baseline's model is the "
            "same network built from plain Keras layers. seg-train, by default, runs dilated convolutions as one "
            "native dilated conv with the taps that only ever read padding dropped (`model.fast_atrous`, exact: "
            "tests/test_atrous.py) and BatchNormalization as TensorFlow's fused kernel (`model.fused_batchnorm`, "
            "Keras' semantics: tests/test_fused_bn.py)")
    if all(plain.values()):
        text += (f"; on their own they are worth {1 / plain['model.fast_atrous=false']:.2f}x and "
                 f"{1 / plain['model.fused_batchnorm=false']:.2f}x (variants table: seg-train with each one off). "
                 "The rest of the difference is the trainer's own work (tower machinery, weight decay, non-finite "
                 "checks, returning predictions) against Keras' `fit` loop.")
    out.append(text + ("" if text.endswith(".") else "."))
    return out


def input_paragraph(tw: dict, inp: dict | None, t1: dict, c) -> str:
    """data.cache (decoded images kept in memory) vs decoding every time, the reader alone."""
    if not inp:
        return ""
    i = inp["input"]
    return (f"**Decoding cache** (`data.cache: true`, {c(inp)}): after its first pass over the "
            f"{inp['num_train_images']} training images ({i['first_pass_images_per_sec']:.1f} images/s, decoding), the "
            f"reader alone gives {i['images_per_sec']:.1f} images/s vs {tw['input_images_per_sec']:.1f} decoding every "
            f"time ({i['images_per_sec'] / tw['input_images_per_sec']:.2f}x), for {i['cache_mb']:.0f} MiB of memory. "
            f"At {t1['images_per_sec']:.1f} images/s of training on this CPU the reader is far from the bottleneck, "
            "so the default stays off; turn it on where training consumes more than the reader alone gives "
            "(a GPU box, large JPEGs) and the decoded data set fits in memory.")


def write_report(path: Path, r: dict, config_text: str, data_note: str, run_log: list[str], started: str,
                 total_s: float, config_path: str = str(CONFIG)) -> None:
    tw, va, ke, acc = r["towers"], r["variants"], r["keras"], r["accuracy"]
    m = tw["machine"]
    c = lambda res: f"`{res['_command']}`"
    rows = {t["gpus"]: t for t in tw["towers"]}
    t1, tn = rows[1], tw["towers"][-1]
    sp, cpu_sp = va["speedup_vs_first_variant"], va["cpu_speedup_vs_first_variant"]
    rng = {k: f"windows {a:.2f}-{b:.2f}x" for k, (a, b) in va["speedup_window_range"].items()}
    v = {x["name"]: x for x in va["variants"]}
    base, bf16, jit = v["base"], v["train.precision=mixed_bfloat16"], v["train.jit_compile=true"]
    b1, bf1, jit1 = base["towers"][0], bf16["towers"][0], jit["towers"][0]
    jit_speed, bf16_speed, cached_speed = sp["train.jit_compile=true"], sp["train.precision=mixed_bfloat16"], sp["input=cached"]
    miou = {a["precision"]: a["miou"] for a in acc}
    dmiou = 100 * (miou["mixed_bfloat16"] - miou["float32"])
    if jit_speed >= 1.05 and cpu_sp["train.jit_compile=true"] >= 1.05:
        jit_verdict = (f"XLA is {jit_speed:.2f}x faster per step here (by CPU time {cpu_sp['train.jit_compile=true']:.2f}x); "
                       f"worth turning on by default if its one-off compile ({jit1['first_step_s']:.0f}s first step vs "
                       f"{b1['first_step_s']:.0f}s) is acceptable")
    elif jit_speed <= 0.95:
        jit_verdict = (f"XLA is slower here ({jit_speed:.2f}x wall, {cpu_sp['train.jit_compile=true']:.2f}x by CPU time) "
                       f"and its first step takes {jit1['first_step_s']:.0f}s instead of {b1['first_step_s']:.0f}s: keep "
                       "`train.jit_compile: false` as the default on this CPU")
    else:
        jit_verdict = (f"no clear gain ({jit_speed:.2f}x wall, {cpu_sp['train.jit_compile=true']:.2f}x by CPU time) for a "
                       f"longer start ({jit1['first_step_s']:.0f}s first step vs {b1['first_step_s']:.0f}s): keep "
                       "`train.jit_compile: false` as the default")
    util1 = t1["flops_utilization"]
    flops, peak = tw["flops"], tw["peak"]
    bf16_peak = va["peaks"].get("bfloat16")
    keras_speed = ke["speedup_seg_train_vs_keras_fit"]
    load_vals = [x for res in (tw, va, ke) for x in res["_loadavg_1min_before_after"]]
    cores = [t["cores_busy"] for t in tw["towers"]] + [x["towers"][0]["cores_busy"] for x in va["variants"]]
    ncpu = m["usable_cpus"]

    L = [
        "# Performance",
        "",
        "Generated by `make bench` (`scripts/bench.py`); rerun it rather than editing by hand",
        "(`python scripts/bench.py --report-only` rewrites this file from the last run's `runs/bench/*.json`).",
        "Every figure below comes from ONE run of the script. Each comparison was timed inside one process",
        "with the compared set-ups interleaved (windows A B, B A, ...), so a change of machine load during",
        "the run hits both sides. Each table names the command that produced it (run from the repo root once",
        f"`make bench` has written `{config_path}`; `--json` prints every number).",
        "",
        f"Run started {started} and took {total_s / 60:.1f} min. The machine was shared: the 1-minute load",
        f"average was {min(load_vals):.1f} to {max(load_vals):.1f} on {ncpu} CPUs during the speed runs, and the",
        f"benchmark process kept {min(cores):.2f} to {max(cores):.2f} cores busy (`cores` columns). Absolute",
        "images/s move with that load; interleaved ratios much less. Ratios are also given by CPU time per step",
        "(`by CPU`), which other processes inflate far less than wall time: where the two disagree, trust",
        "neither to better than that difference.",
        "",
        "## Summary",
        "",
        "| comparison | target | measured (wall clock) | by CPU | |",
        "| --- | --- | --- | --- | --- |",
        (f"| seg-train step vs plain Keras `model.fit`, 1 device | {TARGETS['keras']} | {keras_speed:.2f}x "
         f"({ke['seg_train_images_per_sec']:.2f} vs {ke['keras_fit_images_per_sec']:.2f} images/s; windows "
         f"{ke['speedup_window_range'][0]:.2f}-{ke['speedup_window_range'][1]:.2f}x) | "
         f"{ke['cpu_speedup_seg_train_vs_keras_fit']:.2f}x | {met(keras_speed >= 1.0)} |"),
        (f"| real ImageReader vs the same batches cached in memory | {TARGETS['input']} | wait "
         f"{pct(b1['input_wait_fraction'])} of the step (1 tower), {pct(tn['input_wait_fraction'])} "
         f"({tn['gpus']} towers); cached runs {cached_speed:.2f}x the reader's speed ({rng['input=cached']}) | "
         f"{cpu_sp['input=cached']:.2f}x | {met(max(b1['input_wait_fraction'], tn['input_wait_fraction']) < 0.05)} |"),
        (f"| {tn['gpus']} logical towers vs 1, same global batch | {TARGETS['towers']} | efficiency "
         f"{tn['efficiency']:.2f} ({tn['images_per_sec']:.2f} vs {t1['images_per_sec']:.2f} images/s; windows "
         f"{tn['efficiency_window_range'][0]:.2f}-{tn['efficiency_window_range'][1]:.2f}) | "
         f"{t1['cpu_ms_per_step'] / tn['cpu_ms_per_step']:.2f} | {met(tn['efficiency'] >= 0.85)} |"),
        (f"| train.precision mixed_bfloat16 vs float32 | {TARGETS['bf16']} | {bf16_speed:.2f}x "
         f"({rng['train.precision=mixed_bfloat16']}); demo mIoU "
         f"{100 * miou['mixed_bfloat16']:.1f}% vs {100 * miou['float32']:.1f}% ({dmiou:+.1f} points) | "
         f"{cpu_sp['train.precision=mixed_bfloat16']:.2f}x | speed {met(bf16_speed >= 1.5)}, "
         f"accuracy {met(abs(dmiou) <= 1.0)} |"),
        (f"| train.jit_compile true vs false | {TARGETS['jit']} | {jit_speed:.2f}x ({rng['train.jit_compile=true']}) | "
         f"{cpu_sp['train.jit_compile=true']:.2f}x | default: {'on' if jit_speed >= 1.05 else 'off'} (below) |"),
        (f"| seg-train's dilated conv (`model.fast_atrous: true`, the default) vs Keras' Conv2D, 1 tower | exact "
         f"(same logits) | {1 / sp['model.fast_atrous=false']:.2f}x | {1 / cpu_sp['model.fast_atrous=false']:.2f}x | |"
         if "model.fast_atrous=false" in sp else ""),
        (f"| seg-train's fused BN (`model.fused_batchnorm: true`, the default) vs Keras' BatchNormalization, 1 tower | "
         f"Keras' semantics | {1 / sp['model.fused_batchnorm=false']:.2f}x | {1 / cpu_sp['model.fused_batchnorm=false']:.2f}x | |"
         if "model.fused_batchnorm=false" in sp else ""),
        (f"| achieved FLOP/s / measured peak, float32, 1 tower | {TARGETS['flops']} | {t1['achieved_gflops']:.0f} / "
         f"{peak['peak_gflops']:.0f} GFLOP/s = {pct(util1)} | | {met(util1 >= 0.40)} |"),
        (f"| the same, mixed_bfloat16, 1 tower | | {bf1['achieved_gflops']:.0f} / {bf16['peak_gflops']:.0f} GFLOP/s "
         f"= {pct(bf1['flops_utilization'])} | | |" if bf16["peak_gflops"] else ""),
        "",
        "## Reading the results",
        "",
        *notes(tw, va, ke, t1, tn, b1, bf1, bf16_speed, keras_speed),
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['logical_cpus']} logical CPUs ({ncpu} usable); ISA: {', '.join(m['isa'])}",
        f"- TensorFlow {m['tensorflow']}, Keras {m['keras']}, Python {m['python']}. No GPU: towers are logical CPU",
        "  devices (the CPU split N ways). They share the same cores, so the ideal N-tower speed is the",
        "  1-tower speed, not N times it.",
        (f"- measured peak, float32: matmul {peak['matmul_gflops']:.0f} GFLOP/s, 3x3 conv {peak['conv3x3_gflops']:.0f} "
         f"GFLOP/s" + (f"; bfloat16: matmul {bf16_peak['matmul_gflops']:.0f}, 3x3 conv "
                       f"{bf16_peak['conv3x3_gflops']:.0f} GFLOP/s (AMX)" if bf16_peak else "")
         + " (measured in this run, under the load above)"),
        "",
        "## Benchmark config",
        "",
        f"`{config_path}` ({data_note}):",
        "",
        "```yaml",
        config_text.rstrip(),
        "```",
        "",
        "## How each figure is measured",
        "",
        "- **images/s**: the real `Trainer.train_step`, fed by the real `ImageReader` through",
        "  `distribute_datasets_from_function`, as `seg-train` runs it (the host reads the loss every step).",
        f"  Warm-up steps ({tw['warmup_steps']}; tracing, first steps, tf.data autotuning) are never timed; then "
        f"{tw['windows']} windows",
        f"  of {tw['steps_per_window']} steps per set-up are timed (each window after an untimed pick-up step "
        "when set-ups alternate),",
        "  and the MEDIAN window is reported: images/s = global batch x steps / window time; per tower =",
        "  that / N; step ms = window time / steps.",
        "- **scaling efficiency** at N towers = images/s at N / images/s at 1 tower, same global batch.",
        "- **per-window ratios**: the ratio of two set-ups within each pair of neighbouring windows; their",
        "  range shows how much the machine's load moved the result.",
        "- **input wait** = time blocked in `next(iterator)` / total time of the timed steps.",
        "- **input images/s alone**: the same reader pipeline (global batches) iterated without training.",
        "- **cached**: the first 8 steps' batches of the same reader, decoded and augmented once, then served",
        "  from memory (`seg-bench --input cached`): reader vs cached is the whole cost of the input pipeline,",
        "  the waiting AND the CPU it takes from the step.",
        "- **CPU ms/step**: this process's CPU time (all threads) over a window / steps; **cores** = CPU",
        "  time / wall time. **by CPU** ratios = CPU ms/step of the reference / of the variant.",
        f"- **FLOPs**: {flops['method']}: {flops['train_gflop_per_image']:.2f} GFLOP per training image",
        f"  (forward {flops['forward_gflop_per_image']:.2f}; training / forward = {flops['train_to_forward']:.2f} "
        "in the graph; the first conv's unused input",
        "  gradient is pruned at run time, so slightly less is executed). Dilated convolutions count as",
        "  executed: seg-train's (`model.fast_atrous`) as one conv over the taps that can read the map; the",
        "  backbone's dilated depthwise convs (and every dilated conv with `fast_atrous: false`) as",
        "  `tf.nn.convolution` runs them, SpaceToBatchND + a dense conv + BatchToSpaceND, padding included.",
        "- **achieved FLOP/s** = counted FLOPs per step / median step time; **peak** = the faster of a",
        "  2048^3 matmul and a 3x3 conv (4x56x56x256 -> 256, SAME) timed in the same process, in the compute",
        "  dtype of train.precision.",
        "- **peak memory**: VmHWM of the benchmark process (all its runners alive at once).",
        "- **plain Keras baseline**: the same `seg_train.models.build` network and precision policy, built from",
        "  plain Keras layers (`model.fast_atrous: false`, `model.fused_batchnorm: false`), the same",
        "  reader batches, `compile(Adam, SparseCategoricalCrossentropy(from_logits=True, ignore_class=255))`",
        "  with Keras' defaults otherwise, `model.fit(ds, steps_per_epoch=K+1, epochs=W+1)` on one device",
        "  (no strategy); epoch 0 is its warm-up; a callback times each later epoch after its first step and",
        "  runs one seg-train window between Keras epochs (interleaved).",
        "",
        "## Towers (logical CPU devices, same global batch)",
        "",
        c(tw),
        "",
        "| towers | images/s | per tower | step ms | efficiency | per-window | input wait | GFLOP/s | of peak | "
        "CPU ms/step | cores |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in tw["towers"]:
        L.append(f"| {t['gpus']} | {t['images_per_sec']:.2f} | {t['images_per_sec_per_tower']:.2f} | "
                 f"{t['step_time_ms']:.0f} | {t['efficiency']:.3f} | {t['efficiency_window_range'][0]:.2f}-"
                 f"{t['efficiency_window_range'][1]:.2f} | {pct(t['input_wait_fraction'])} | "
                 f"{t['achieved_gflops']:.1f} | {pct(t['flops_utilization'])} | {t['cpu_ms_per_step']:.0f} | "
                 f"{t['cores_busy']:.2f} |")
    L += [
        "",
        (f"Input pipeline alone: {tw['input_images_per_sec']:.1f} images/s (global batches of {tw['global_batch']}, "
         f"no training), i.e. {tw['input_images_per_sec'] / t1['images_per_sec']:.0f}x what 1-tower training "
         f"consumes. Peak resident memory: {tw['peak_rss_mb']:.0f} MiB ({len(tw['towers'])} trainers alive at once)."),
        "",
        input_paragraph(tw, r.get("input"), t1, c),
        "",
        "## Input, precision and XLA (1 tower)",
        "",
        c(va),
        "",
        "| variant | images/s | step ms | vs base | per-window ratios | by CPU | input wait | GFLOP/s | "
        "of peak (own dtype) | CPU ms/step | cores | first step s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in va["variants"]:
        t = x["towers"][0]
        lo, hi = va["speedup_window_range"][x["name"]]
        L.append(f"| {x['name']} | {t['images_per_sec']:.2f} | {t['step_time_ms']:.0f} | {sp[x['name']]:.2f}x | "
                 f"{lo:.2f}-{hi:.2f}x | {cpu_sp[x['name']]:.2f}x | {pct(t['input_wait_fraction'])} | {t['achieved_gflops']:.1f} | "
                 f"{pct(t['flops_utilization'])} | {t['cpu_ms_per_step']:.0f} | {t['cores_busy']:.2f} | "
                 f"{t['first_step_s']:.0f} |")
    L += [
        "",
        f"Peak resident memory of this process: {va['peak_rss_mb']:.0f} MiB ({len(va['variants'])} trainers).",
        "",
        f"**XLA**: {jit_verdict}.",
        "",
        "## Where the time goes",
        "",
        "TensorFlow op time per step by op type, from `seg-bench --profile` (2 steps profiled after the",
        "timing; op times are summed over TensorFlow's executor threads, so concurrent ops both count and",
        "the shares are of op time, not of the step; XLA runs are not broken down).",
        "",
        "| set-up | profiled step ms | convolutions | largest op types (share of op time) |",
        "| --- | ---: | ---: | --- |",
    ]
    for x in va["variants"]:
        if x["jit_compile"]:
            continue
        L.append(_profile_line(f"{x['name']}, 1 tower", x["towers"][0].get("op_profile")))
    for t in tw["towers"]:
        if t.get("op_profile") and t["gpus"] > 1:
            L.append(_profile_line(f"base, {t['gpus']} towers", t["op_profile"]))
    L += [
        "",
        "## seg-train vs plain Keras model.fit (1 device)",
        "",
        c(ke),
        "",
        "| | images/s | step ms | CPU ms/step | jit_compile | warm-up s |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
        (f"| seg-train `Trainer.train_step` | {ke['seg_train_images_per_sec']:.2f} | {ke['seg_train_step_time_ms']:.0f} | "
         f"{ke['seg_train_cpu_ms_per_step']:.0f} | {ke['seg_train_jit_compile']} | {ke['seg_train_first_step_s']:.0f} "
         "(first step) |"),
        (f"| Keras `model.fit` | {ke['keras_fit_images_per_sec']:.2f} | {ke['keras_fit_step_time_ms']:.0f} | "
         f"{ke['keras_fit_cpu_ms_per_step']:.0f} | {ke['keras_fit_jit_compile']} (Keras' `auto`) | "
         f"{ke['keras_first_epoch_s']:.0f} (epoch 0) |"),
        "",
        (f"seg-train / Keras = {keras_speed:.3f}x (by CPU time {ke['cpu_speedup_seg_train_vs_keras_fit']:.3f}x). "
         "seg-train's step does more than the baseline (weight decay, non-finite checks, the predictions it returns "
         "for image summaries) and runs the same network's dilated convolutions and BatchNormalization faster "
         "(`model.fast_atrous`, `model.fused_batchnorm`; the baseline has Keras' own layers)."),
        "",
        "## bfloat16 accuracy check (demo data)",
        "",
        "| precision | val mIoU | pixel accuracy | steps | command |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for a in acc:
        L.append(f"| {a['precision']} | {100 * a['miou']:.2f}% | {pct(a['pixel_accuracy'])} | {a['step']} | "
                 f"`{a['_command']}` |")
    L += [
        "",
        f"Difference: {dmiou:+.2f} points (target: within 1). Each mIoU is the final evaluation of its run",
        "(`seg_train.evaluate` on the demo val split at full resolution, BN statistics re-estimated), as kept in",
        "`RUN_DIR/best/best.json`.",
        "",
        "## Run log",
        "",
        "```",
        *run_log,
        "```",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(x for x in L if x is not None))


def smoke_config() -> str:
    return """# Smoke-test config for scripts/bench.py --smoke (checks the script, measures nothing useful).
seed: 0
run_dir: smoke-run
data:
  root: smoke-data
  synthetic: true
  num_classes: 3
  batch_size: 4
  crop_size: [32, 32]
model:
  backbone: tiny
  aspp_channels: 8
  decoder_channels: 8
  low_level_channels: 4
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run the standard benchmarks and write docs/PERFORMANCE.md.")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(SECTIONS)} (the report is not rewritten)")
    p.add_argument("--output", help="the report (default docs/PERFORMANCE.md; with --smoke runs/bench/smoke.md)")
    p.add_argument("--data", default="../shared/data/camvid", help="VOC-layout data for the speed benchmarks")
    p.add_argument("--steps", type=int, default=3, help="timed steps per window (default 3)")
    p.add_argument("--windows", type=int, default=4, help="timed windows per runner (default 4)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the report from the JSON results of the last run (runs/bench/*.json), run nothing")
    p.add_argument("--smoke", action="store_true",
                   help="check this script end to end in a few minutes: tiny model, 2 steps, 10-step accuracy runs")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = only - set(SECTIONS)
    if unknown:
        raise SystemExit(f"error: unknown --only section(s) {sorted(unknown)}: expected {','.join(SECTIONS)}")
    out_dir = OUT / "smoke" if args.smoke else OUT
    output = ROOT / (args.output or (out_dir / "PERFORMANCE.md" if args.smoke else "docs/PERFORMANCE.md"))

    if args.report_only:
        meta = json.loads((ROOT / out_dir / "meta.json").read_text())
        results = {name: json.loads((ROOT / out_dir / f"{name}.json").read_text()) for name in SECTIONS}
        write_report(output, results, meta["config_text"], meta["data_note"], meta["run_log"], meta["started"],
                     meta["total_s"], meta["config_path"])
        print(f"wrote {output.relative_to(ROOT)}", file=sys.stderr)
        return 0

    # ---- the config -----------------------------------------------------------------------------------
    (ROOT / out_dir).mkdir(parents=True, exist_ok=True)
    if args.smoke:
        config_path = out_dir / "smoke.yaml"
        config_text, data_note = smoke_config(), "synthetic demo data, tiny model: a smoke test, not a benchmark"
        args.steps, args.windows, warmup, acc_steps = 2, 1, 1, 10
    else:
        config_path, warmup, acc_steps = CONFIG, 2, None
        data = (ROOT / args.data).resolve()
        if (data / "ImageSets" / "Segmentation" / "train.txt").is_file() and (data / "classes.txt").is_file():
            num_classes = len([x for x in (data / "classes.txt").read_text().splitlines() if x.strip()])
            data_root, synthetic = os.path.relpath(data, ROOT / OUT), False
            data_note = f"data: {args.data}, {num_classes} classes"
        else:
            data_root, synthetic, num_classes = "synthetic-240x180", True, 5
            data_note = f"{args.data} not found: a synthetic demo data set with 240x180 images instead"
            from seg_train import demo_data  # generated here: seg-bench would make 96x96 images
            demo_data.generate(ROOT / OUT / data_root, num_classes=num_classes, size=(180, 240), seed=0)
        config_text = medium_config(data_root, num_classes, synthetic)
    (ROOT / config_path).write_text(config_text)

    seg_bench = str(BIN / "seg-bench")
    common = ["--config", str(config_path), "--steps", str(args.steps), "--windows", str(args.windows),
              "--warmup", str(warmup), "--json"]
    commands = {
        "towers": [seg_bench, *common, "--gpus", "1,4", "--profile"],
        "variants": [seg_bench, *common, "--gpus", "1", "--no-input-alone", "--profile", "--compare", "input=cached",
                     "--compare", "train.precision=mixed_bfloat16", "--compare", "train.jit_compile=true",
                     "--compare", "model.fast_atrous=false", "--compare", "model.fused_batchnorm=false"],
        "keras": [str(BIN / "python"), "scripts/baseline_keras_fit_speed.py", *common],
        # The reader alone, 1 worker thread per core as it runs by default, with and without data.cache.
        "input": [seg_bench, *common, "--input-only", "--set", "data.cache=true"],
    }
    if args.dry_run:
        for name in SECTIONS:
            if name in commands:
                print(display(commands[name]))
            else:
                for prec in ("float32", "mixed_bfloat16"):
                    print(display(accuracy_command(prec, out_dir, acc_steps)))
        return 0

    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    t0 = time.perf_counter()
    run_log: list[str] = []
    results = {}
    for name in ("towers", "variants", "keras", "input"):
        if name in only:
            results[name] = run_json(name, commands[name], run_log, out_dir)
    if "accuracy" in only:
        results["accuracy"] = run_accuracy(run_log, out_dir, acc_steps)
        (ROOT / out_dir / "accuracy.json").write_text(json.dumps(results["accuracy"], indent=1) + "\n")
    total = time.perf_counter() - t0
    run_log.append(f"total: {total:.0f}s")
    print("\n".join(run_log), file=sys.stderr)
    if only != set(SECTIONS):
        print(json.dumps(results, indent=1, default=str))
        return 0
    meta = {"config_text": config_text, "data_note": data_note, "run_log": run_log, "started": started,
            "total_s": total, "config_path": str(config_path)}
    (ROOT / out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    write_report(output, results, config_text, data_note, run_log, started, total, str(config_path))
    print(f"wrote {output.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
