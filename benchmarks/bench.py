#!/usr/bin/env python
"""`make bench`: runs the standard benchmarks one after the other and writes docs/PERFORMANCE.md.

    python benchmarks/bench.py [--only towers,variants,keras,input,accuracy,gradients,accumulation,slide]
                            [--output docs/PERFORMANCE.md]
                            [--data DIR] [--steps K] [--windows W] [--dry-run]
                            [--report-only] [--smoke]

Every figure comes from one of the commands below, run by this script in one go, so all ratios are
from the same run (and each command times its own comparison interleaved in one process):

  towers    seg-bench --gpus 1,4                        tower scaling, input alone/wait, FLOP/s, memory
  variants  seg-bench --gpus 1 --compare input=cached --compare train.precision=mixed_bfloat16
                      --compare train.jit_compile=true --compare model.fast_atrous=false
                      --compare model.fused_batchnorm=false
                                                        reader vs cached, bf16 vs fp32, XLA vs not,
                                                        seg-train's dilated conv and BN vs Keras' own
  keras     benchmarks/baseline_keras_fit_speed.py         seg-train step vs plain Keras model.fit
  input     seg-bench --input-only --set data.cache=true  the reader alone with the decoding cache
                                                        (towers has it without)
  accuracy  seg-train (configs/demo.yaml) in float32 and in mixed_bfloat16, 1 tower, both at once; the final
            evaluation of each run (seg_train.infer.evaluate, BN statistics re-estimated) gives val mIoU
  gradients seg-bench --gpus 4 --compare train.allreduce_pack_mb=0,1,4 --compare loop=blocking
                                                        gradient packing (the default 32 MB vs one all-reduce
                                                        per tensor and smaller packs) and the overlapped host
                                                        loop vs one that waits for every step, at 4 towers
  accumulation seg-bench --gpus 1 --compare train.accumulate_steps=4
                                                        4 micro-batches of 2 vs one batch of 8: images/s and
                                                        each set-up's peak memory in a fresh process
  slide     benchmarks/bench_slide_memory.py               peak memory of whole-image vs sliding-window
                                                        evaluation of a synthetic 2048x1024 (and 4096x2048) image

The towers run also times, per tower count: the first step from process launch in fresh seg-train
processes (with and without model.sync_batchnorm), precise-BN re-estimation of a fixed number of
images, evaluation images/s, and at 4 towers the share of op time spent on cross-tower work.

The speed benchmarks use a medium config written to runs/bench/camvid-medium.yaml (shown in the
report): DeepLabV3+ on MobileNetV2, output stride 16, crop 128x128, global batch 8, CamVid
(CAMVID_ROOT, default data/camvid, 240x180 JPEGs, 11 classes); without CamVid, a synthetic demo set of the same
image size is generated instead and the report says so. JSON results go to runs/bench/*.json.
With --only, the selected benchmarks run and print, and the report is NOT rewritten.

The report is benchmarks/templates/performance.md filled with the results (render_report): its prose
lives there, this file computes the figures and picks the remarks that apply.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OUT = Path("runs/bench")  # relative to ROOT (commands in the report are run from the repo root)
CONFIG = OUT / "camvid-medium.yaml"
SECTIONS = ("towers", "variants", "keras", "input", "accuracy", "gradients", "accumulation", "slide")

TARGETS = {
    "keras": ">= 1.0x, aim 1.2x",
    "input": "input wait < 5% of step time",
    "towers": "4 towers at most 15% slower than 1 (efficiency >= 0.85)",
    "bf16": ">= 1.5x faster, demo mIoU within 1 point",
    "jit": "measured; on by default?",
    "flops": "report; aim 40%+",
    "first_step": "4 towers <= 2x the 1-tower time (from launch to the end of step 1)",
    "bn": "4 towers <= 1.25x the 1-tower time, same images",
    "eval": "4 towers >= 0.85x the 1-tower images/s",
    "cross": "<= 5% of op time at 4 towers",
}


def medium_config(data_root: str, num_classes: int, synthetic: bool) -> str:
    return f"""# Medium benchmark config (written by benchmarks/bench.py): representative, fits the time budget.
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
TEMPLATE = ROOT / "benchmarks" / "templates" / "performance.md"


def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


class _Formatter(string.Formatter):
    """str.format with two more format specs: `pct` (pct above) and `met` (met above)."""

    def format_field(self, value, format_spec):
        if format_spec == "pct":
            return pct(value)
        if format_spec == "met":
            return met(value)
        return super().format_field(value, format_spec)


def load_template(path: Path = TEMPLATE) -> dict[str, str]:
    """The template's blocks by name (see the comment at the top of the template for its rules)."""
    blocks: dict[str, list[str]] = {}
    lines: list[str] = []  # text before the first block (the comment) is dropped
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"<!-- ([a-z0-9_]+) -->", line)
        if m:
            lines = blocks.setdefault(m.group(1), [])
        else:
            lines.append(line)
    out = {}
    for name, block in blocks.items():
        text = "\n".join(block)
        out[name] = re.sub(r"\\\n[ \t]*", "", text)  # backslash-newline: the line goes on
    return out


def _share(prof: dict | None, *names: str) -> float:
    """Share of op time of the op types whose name contains any of `names`."""
    if not prof:
        return float("nan")
    return sum(share for k, _, share in prof["top_ops"] if any(n in k for n in names))


def _ms(prof: dict | None, *names: str) -> float:
    """Op time per step (ms) of the op types whose name contains any of `names` (from their shares)."""
    if not prof or "op_time_ms_per_step" not in prof:
        return float("nan")
    return _share(prof, *names) * prof["op_time_ms_per_step"]


def slowest(prof: dict, n: int = 4) -> str:
    """The n slowest single ops of a profile: 'layer (OpType) share', layer = the name part after the model."""
    out = []
    for name, _, share in prof.get("top_op_instances", [])[:n]:
        path, _, typ = name.rpartition(":")
        skipped = ("gradient_tape", "deeplabv3plus", "convolution")
        parts = [p for p in path.split("/") if p and not p.startswith(skipped)]
        if len(parts) > 1 and parts[-1] == typ.replace("_MklNative", ""):
            parts = parts[:-1]  # the op's own name: the layer is the part before it
        layer = parts[-1] if parts else path
        out.append(f"{layer.removesuffix('_1')} ({typ.replace('_MklNative', '')}) {share:.0%}")
    return ", ".join(out) or "n/a"


def top_ops(prof: dict) -> str:
    """The 7 largest op types of a profile with their shares of op time."""
    return ", ".join(f"{k.replace('_MklNative', '')} {share:.0%}" for k, _, share in prof["top_ops"][:7])


def _le(x, bound):
    return None if x is None else x <= bound


def _ge(x, bound):
    return None if x is None else x >= bound


def report_values(r: dict, config_text: str, data_note: str, run_log: list[str], started: str, total_s: float,
                  config_path: str) -> dict:
    """What the template's fields name: the JSON results as they are, plus the figures derived from them."""
    tw, va, ke, acc = r["towers"], r["variants"], r["keras"], r["accuracy"]
    gr, ac, sl = r["gradients"], r["accumulation"], r["slide"]
    rows = {t["gpus"]: t for t in tw["towers"]}
    sp, cpu_sp = va["speedup_vs_first_variant"], va["cpu_speedup_vs_first_variant"]
    v = {x["name"]: x for x in va["variants"]}
    base, bf16, jit = v["base"], v["train.precision=mixed_bfloat16"], v["train.jit_compile=true"]
    miou = {a["precision"]: a["miou"] for a in acc}
    load_vals = [x for res in (tw, va, ke) for x in res["_loadavg_1min_before_after"]]
    cores = [t["cores_busy"] for t in tw["towers"]] + [x["towers"][0]["cores_busy"] for x in va["variants"]]
    d = dict(
        r=r, tw=tw, va=va, ke=ke, inp=r.get("input"), m=tw["machine"], ncpu=tw["machine"]["usable_cpus"],
        t1=rows[1], tn=tw["towers"][-1], b1=base["towers"][0], bf1=bf16["towers"][0], jit1=jit["towers"][0],
        bf16=bf16, sp=sp, cpu_sp=cpu_sp, targets=TARGETS, flops=tw["flops"], peak=tw["peak"],
        bf16_peak=va["peaks"].get("bfloat16"), p1=base["towers"][0].get("op_profile"),
        pb=bf16["towers"][0].get("op_profile"),
        rng={k: f"windows {a:.2f}-{b:.2f}x" for k, (a, b) in va["speedup_window_range"].items()},
        keras_speed=ke["speedup_seg_train_vs_keras_fit"], bf16_speed=sp["train.precision=mixed_bfloat16"],
        jit_speed=sp["train.jit_compile=true"], miou_pct={k: 100 * x for k, x in miou.items()},
        dmiou=100 * (miou["mixed_bfloat16"] - miou["float32"]),
        config_path=config_path, config_text=config_text.rstrip(), data_note=data_note, started=started,
        total_min=total_s / 60, load_min=min(load_vals), load_max=max(load_vals), cores_min=min(cores),
        cores_max=max(cores), isa=", ".join(tw["machine"]["isa"]), run_log="\n".join(run_log),
        num_towers_runs=len(tw["towers"]), num_variants=len(va["variants"]), gr=gr, ac=ac, sl=sl,
        slc=sl["cases"],
    )
    # Issue-level tower costs: N towers vs 1 (first step from launch, precise BN, evaluation).
    tn = d["tn"]
    d.update(
        first_step_met=_le(tn.get("first_step_ratio"), 2.0),
        first_step_sync_met=_le(tn.get("first_step_sync_bn_ratio"), 2.0),
        bn_met=_le(tn.get("bn_reestimate_ratio"), 1.25), eval_met=_ge(tn.get("eval_ratio"), 0.85),
        cross_met=_le(tw.get("cross_tower_share"), 0.05),
    )
    gv = {x["name"]: x for x in gr["variants"]}
    d["packing_rows"] = gv
    d["loop_speed"] = 1.0 / gr["speedup_vs_first_variant"]["loop=blocking"]
    d["loop_cpu"] = 1.0 / gr["cpu_speedup_vs_first_variant"]["loop=blocking"]
    av = {x["name"]: x for x in ac["variants"]}
    d["acc_base"], d["acc_k"] = av["base"]["towers"][0], av["train.accumulate_steps=4"]["towers"][0]
    d["acc_speed"] = ac["speedup_vs_first_variant"]["train.accumulate_steps=4"]
    d["acc_micro"] = d["acc_k"]["images_per_step"] // 4
    t1, tn, b1 = d["t1"], d["tn"], d["b1"]
    d.update(
        keras_met=d["keras_speed"] >= 1.0, input_met=max(b1["input_wait_fraction"], tn["input_wait_fraction"]) < 0.05,
        towers_met=tn["efficiency"] >= 0.85, towers_cpu_ratio=t1["cpu_ms_per_step"] / tn["cpu_ms_per_step"],
        bf16_speed_met=d["bf16_speed"] >= 1.5, bf16_accuracy_met=abs(d["dmiou"]) <= 1.0,
        flops_met=t1["flops_utilization"] >= 0.40, jit_default="on" if d["jit_speed"] >= 1.05 else "off",
        input_vs_training=tw["input_images_per_sec"] / t1["images_per_sec"],
        tn_tower_batch=tw["global_batch"] // tn["gpus"], aspp_h=tw["crop_size"][0] // tw["output_stride"],
        aspp_w=tw["crop_size"][1] // tw["output_stride"],
        bf16_conv_peak=va["peaks"].get("bfloat16", {}).get("conv3x3_gflops", float("nan")),
        bn_share_f32=_share(d["p1"], "FusedBatchNorm"), depthwise_share_f32=_share(d["p1"], "Depthwise"),
        depthwise_share_bf16=_share(d["pb"], "Depthwise"), cast_share_bf16=_share(d["pb"], "Cast"),
    )
    # Where the N-tower step's extra op time goes (the towers' own op profiles).
    q1, qn = t1.get("op_profile"), tn.get("op_profile")
    d.update(op1=(q1 or {}).get("op_time_ms_per_step", float("nan")),
             opn=(qn or {}).get("op_time_ms_per_step", float("nan")),
             conv1=_ms(q1, "Conv2D", "Depthwise"), convn=_ms(qn, "Conv2D", "Depthwise"),
             bn1=_ms(q1, "FusedBatchNorm"), bnn=_ms(qn, "FusedBatchNorm"),
             adam1=_ms(q1, "ApplyAdam"), adamn=_ms(qn, "ApplyAdam"))
    # seg-train's own layers against Keras' (the variants with each one off): 1 / the variant's speed.
    for key in ("fast_atrous", "fused_batchnorm"):
        name = f"model.{key}=false"
        if name in sp:
            d[f"{key}_speed"], d[f"{key}_cpu"] = 1 / sp[name], 1 / cpu_sp[name]
    if d["p1"]:
        d["slowest_f32"] = slowest(d["p1"])
    if d["pb"]:
        d["slowest_bf16"] = slowest(d["pb"])
    if d["inp"]:
        d["cache_speedup"] = d["inp"]["input"]["images_per_sec"] / tw["input_images_per_sec"]
    return d


def render_report(r: dict, config_text: str, data_note: str, run_log: list[str], started: str, total_s: float,
                  config_path: str = str(CONFIG), template: Path = TEMPLATE) -> str:
    """docs/PERFORMANCE.md from the results: the template's `report` block, its pieces picked by the figures."""
    blocks, fmt = load_template(template), _Formatter()
    d = report_values(r, config_text, data_note, run_log, started, total_s, config_path)

    def fill(block: str, **extra) -> str:
        return fmt.vformat(blocks[block], (), {**d, **extra})

    sp, tw, va = d["sp"], d["tw"], d["va"]
    d["row_fast_atrous"] = fill("row_fast_atrous") if "model.fast_atrous=false" in sp else ""
    d["warmup_line"] = fill("warmup_line") if tw.get("warmup_steps_to_steady") is not None else ""
    d["row_fused_batchnorm"] = fill("row_fused_batchnorm") if "model.fused_batchnorm=false" in sp else ""
    d["row_bf16_flops"] = fill("row_bf16_flops") if d["bf16"]["peak_gflops"] else ""
    d["bf16_peak"] = fill("bf16_peak") if d["bf16_peak"] else ""
    plain_layers = all(sp.get(f"model.{k}=false") for k in ("fast_atrous", "fused_batchnorm"))
    d["remark_keras_layers"] = fill("remark_keras_layers") if plain_layers else "."
    remarks = ["remark_towers_ok" if d["tn"]["efficiency"] >= 0.85 else "remark_towers_slow"]
    remarks += ["remark_sync_first_step_slow"] * (d["first_step_sync_met"] is False and
                                                  "first_step_sync_bn_tracing_s" in d["tn"])
    remarks += ["remark_precise_bn_again"] * (
        "bn_reestimate_repeat_s" in d["tn"]
        and d["tn"]["bn_reestimate_repeat_s"] > 1.25 * d["t1"]["bn_reestimate_repeat_s"])
    remarks += ["remark_flops"] * bool(d["p1"]) + ["remark_bf16"] * bool(d["pb"]) + ["remark_keras"]
    d["remarks"] = "\n".join(fill(name) for name in remarks)
    d["input_cache"] = fill("input_cache") if d["inp"] else ""
    jit_speed, jit_cpu = d["jit_speed"], d["cpu_sp"]["train.jit_compile=true"]
    d["jit_verdict"] = fill("jit_faster" if jit_speed >= 1.05 and jit_cpu >= 1.05 else
                            "jit_slower" if jit_speed <= 0.95 else "jit_unclear")
    d["tower_rows"] = "\n".join(fill("tower_row", t=t) for t in tw["towers"])
    d["variant_rows"] = "\n".join(
        fill("variant_row", x=x, t=x["towers"][0], speedup=sp[x["name"]], cpu_speedup=d["cpu_sp"][x["name"]],
             lo=va["speedup_window_range"][x["name"]][0], hi=va["speedup_window_range"][x["name"]][1])
        for x in va["variants"])
    profiles = [(f"{x['name']}, 1 tower", x["towers"][0].get("op_profile")) for x in va["variants"]
                if not x["jit_compile"]]
    profiles += [(f"base, {t['gpus']} towers", t["op_profile"]) for t in tw["towers"]
                 if t.get("op_profile") and t["gpus"] > 1]
    d["profile_rows"] = "\n".join(fill("profile_row", name=name, prof=prof, top_ops=top_ops(prof)) if prof else
                                  fill("profile_row_missing", name=name) for name, prof in profiles)
    d["accuracy_rows"] = "\n".join(fill("accuracy_row", a=a, miou_pct=100 * a["miou"]) for a in d["r"]["accuracy"])
    d["cost_rows"] = "\n".join(fill("cost_row", t=t, **_cost_fields(t)) for t in tw["towers"])
    gr = d["gr"]
    d["gradient_rows"] = "\n".join(
        fill("gradient_row", x=x, t=x["towers"][0], speedup=gr["speedup_vs_first_variant"][x["name"]],
             cpu_speedup=gr["cpu_speedup_vs_first_variant"][x["name"]],
             lo=gr["speedup_window_range"][x["name"]][0], hi=gr["speedup_window_range"][x["name"]][1])
        for x in gr["variants"])
    return fill("report")


def _cost_fields(t: dict) -> dict:
    """A tower row's issue-level costs, as text ('n/a' where a figure was not measured)."""
    def num(key, spec):
        return "n/a" if t.get(key) is None else format(t[key], spec)
    return {k: num(k, spec) for k, spec in (
        ("first_step_s", ".1f"), ("first_step_tracing_s", ".1f"), ("first_step_graph_optimization_s", ".1f"),
        ("first_step_first_execution_s", ".2f"), ("first_step_ratio", ".2f"), ("first_step_sync_bn_s", ".1f"),
        ("first_step_sync_bn_ratio", ".2f"), ("bn_reestimate_s", ".1f"), ("bn_reestimate_repeat_s", ".1f"),
        ("bn_reestimate_ratio", ".2f"), ("eval_images_per_sec", ".2f"), ("eval_ratio", ".2f"),
        ("peak_rss_mb_process", ".0f"))}


def write_report(path: Path, r: dict, config_text: str, data_note: str, run_log: list[str], started: str,
                 total_s: float, config_path: str = str(CONFIG)) -> None:
    text = render_report(r, config_text, data_note, run_log, started, total_s, config_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def smoke_config() -> str:
    return """# Smoke-test config for benchmarks/bench.py --smoke (checks the script, measures nothing useful).
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
    p.add_argument("--data", default=os.environ.get("CAMVID_ROOT", "data/camvid"),
                   help="VOC-layout data for the speed benchmarks, relative to the repository "
                        "(default: the environment's CAMVID_ROOT, else data/camvid)")
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
            from seg_train.data import synthetic as synthetic_data  # generated here: seg-bench would make 96x96 images
            synthetic_data.generate(ROOT / OUT / data_root, num_classes=num_classes, size=(180, 240), seed=0)
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
        "keras": [str(BIN / "python"), "benchmarks/baseline_keras_fit_speed.py", *common],
        # The reader alone, 1 worker thread per core as it runs by default, with and without data.cache.
        "input": [seg_bench, *common, "--input-only", "--set", "data.cache=true"],
        "gradients": [seg_bench, *common, "--gpus", "4", "--no-input-alone", "--no-peak", "--no-probes",
                      "--bn-images", "0", "--eval-images", "0", "--compare", "train.allreduce_pack_mb=0,1,4",
                      "--compare", "loop=blocking"],
        "accumulation": [seg_bench, *common, "--gpus", "1", "--no-input-alone", "--no-peak", "--bn-images", "0",
                         "--eval-images", "0", "--compare", "train.accumulate_steps=4"],
        "slide": [str(BIN / "python"), "benchmarks/bench_slide_memory.py"],
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
    for name in ("towers", "variants", "keras", "input", "gradients", "accumulation", "slide"):
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
