#!/usr/bin/env python3
"""`make bench-accuracy`: seg-train vs a plain Keras `model.fit` baseline on CamVid, same number of steps.

The budget is a number of steps, not a clock: the accuracy figure counts at most STEP_BUDGET (2000)
steps of global batch 8 (16000 images). Wall time is recorded beside it, but it depends on what
else the machine runs, so it does not decide how long either side trains.

What it does (all under RUN = runs/bench-accuracy/<date-time>/):

1. seg-train (RUN/seg-train) runs the recipe (configs/camvid.yaml + --set) for its own
   train.num_steps (or --steps N, for a short check). The training wall time is the
   launch-to-last-step time (seen from its log lines); the in-process evaluation after the last
   step is not training time.
2. seg-eval on RUN/seg-train, on the val split and on the test split (--split test), at full
   resolution with the config's evaluation options (BN statistics re-estimated as
   eval.bn_reestimate_batches says, EMA weights if train.ema_decay is set, eval.flip/eval.scales if
   set): RUN/seg-train/eval/{val,test}-step<K>.json.
3. The baseline, benchmarks/baseline_keras_fit_accuracy.py (independent of seg_train: plain Keras model.fit,
   DeepLabV3+-lite on keras.applications.MobileNetV2 from scratch, batch 8), for the same number of
   steps (its --max-steps; its wall-clock --minutes is set far above that, as a safety stop only),
   evaluated by itself on the val split with the same metric (confusion matrix over every non-ignored
   pixel at full resolution). It also reports, separately, the mIoU of its weights after
   re-estimating their BN statistics (--bn-reestimate, diagnostic only). The baseline script
   evaluates one split; it is not run on test.
4. A summary (mIoUs, per-class IoU, steps, wall times, commands): printed, written to
   RUN/summary.json and RUN/summary.md, and, for a full run (both sides, the config's own
   train.num_steps within the step budget), written into docs/ACCURACY.md between the
   bench-accuracy markers (--update-doc to force/skip).

Usage:
    .venv/bin/python benchmarks/bench_accuracy.py                    # the full benchmark (2000 steps per side)
    .venv/bin/python benchmarks/bench_accuracy.py --steps 100        # a short check (docs not updated)
    .venv/bin/python benchmarks/bench_accuracy.py --steps 300 --skip-baseline --set train.learning_rate=2e-3

Exit codes: 0 done, 1 a step failed (its log is named), 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the repo's .venv/bin when run as `make bench-accuracy`
# The CamVid root (VOC layout), absolute or relative to the repository: the environment's CAMVID_ROOT.
CAMVID_ROOT = os.environ.get("CAMVID_ROOT", "data/camvid")
DOC_BEGIN = "<!-- bench-accuracy:begin (written by benchmarks/bench_accuracy.py; do not edit by hand) -->"
DOC_END = "<!-- bench-accuracy:end -->"
STEP_BUDGET = 2000    # steps of ...
BUDGET_BATCH = 8      # ... global batch 8: the figure counts at most 16000 training images
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\s+loss\s+([0-9.naninf]+)")
INTERRUPTED_LINE = re.compile(r"interrupted by SIG\w+ at step (\d+)")
NOISE = re.compile(r"^(WARNING: All log messages before absl|[IWE]\d{4} \d\d:\d\d:\d\d|I0000|E0000|W0000)")


class BenchError(RuntimeError):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--steps", type=int, default=None,
                   help="train both sides for N steps (default: the config's train.num_steps); "
                        "a run with --steps does not update the docs")
    p.add_argument("--config", default="configs/camvid.yaml", help="seg-train config (default configs/camvid.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="seg-train config override (repeatable); use --steps rather than train.num_steps")
    p.add_argument("--gpus", type=int, default=1, help="seg-train towers (default 1: fastest on a 2-core CPU)")
    p.add_argument("--test-split", default="test",
                   help="second split seg-train's checkpoint is evaluated on (default test; '' to skip)")
    p.add_argument("--out", default="runs/bench-accuracy", help="parent folder of the run folders")
    p.add_argument("--baseline-minutes", type=float, default=600.0,
                   help="the baseline's wall-clock safety stop (default 600; it stops at the step count first)")
    p.add_argument("--baseline-bn-reestimate", type=int, default=50, metavar="K",
                   help="also report the baseline after re-estimating its BN statistics from K batches (0: off)")
    p.add_argument("--skip-baseline", action="store_true", help="run seg-train only")
    p.add_argument("--skip-seg-train", action="store_true", help="run the baseline only")
    p.add_argument("--update-doc", choices=("auto", "yes", "no"), default="auto",
                   help="write the results into docs/ACCURACY.md: auto = only for a full run (the config's own "
                        "step count, within the budget, both sides)")
    p.add_argument("--doc", default="docs/ACCURACY.md", help="the document to update (default docs/ACCURACY.md)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="also write the summary JSON to PATH (no PATH: print it to stdout at the end)")
    p.add_argument("--quiet", action="store_true", help="do not echo the children's output (it is still logged)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps <= 0:
        p.error("--steps must be positive")
    if args.baseline_minutes <= 0:
        p.error("--baseline-minutes must be positive")
    if args.skip_baseline and args.skip_seg_train:
        p.error("nothing to do: both --skip-baseline and --skip-seg-train")
    for o in args.overrides:
        if "=" not in o:
            p.error(f"--set expects KEY=VALUE, got {o!r}")
    return args


# ---- small helpers ---------------------------------------------------------------------------------
def rel(path) -> str:
    """A path as the user would type it from the repo root."""
    absolute = os.path.abspath(path)  # not resolve(): .venv/bin/python is a symlink out of the repo
    relative = os.path.relpath(absolute, REPO)
    return absolute if relative.startswith(os.path.join("..", "..")) else relative


def quote(cmd) -> str:
    return " ".join(shlex.quote(rel(c) if (os.sep in str(c) and Path(str(c)).exists()) else str(c)) for c in cmd)


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        raise BenchError(f"{path} not found: run `make bench-accuracy` (it installs the package into .venv), "
                         f"or `{BIN / 'python'} -m pip install -e .`")
    return str(path)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def fmt_time(seconds) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


class Child:
    """A child process whose merged stdout/stderr is timestamped line by line, logged and echoed."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, echo: bool, on_line=None):
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.lines: list[tuple[float, str]] = []
        self.on_line = on_line
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in wait()
        self._log.write(f"# {quote(cmd)}\n")
        self._log.flush()
        self._echo = echo
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.t_launch = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     cwd=REPO, env=env)
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self):
        for line in self.proc.stdout:
            t = time.monotonic()
            line = line.rstrip("\n")
            self.lines.append((t, line))
            self._log.write(f"{t - self.t_launch:9.2f} {line}\n")
            self._log.flush()
            if self._echo and not NOISE.match(line):
                print(f"[{self.name}] {line}", flush=True)
            if self.on_line is not None:
                self.on_line(t, line)

    def interrupt(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def wait(self, timeout=None) -> int:
        rc = self.proc.wait(timeout)
        self._thread.join(10)
        self._log.close()
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()

    def tail(self, n=15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


# ---- seg-train ---------------------------------------------------------------------------------------
def seg_train_cmd(args, run_dir: Path, extra: list[str]) -> list[str]:
    cmd = [tool("seg-train"), "--config", args.config, "--gpus", str(args.gpus), "--run-dir", rel(run_dir)]
    for o in [f"data.root={CAMVID_ROOT}"] + args.overrides + extra:
        cmd += ["--set", o]
    return cmd


def seg_eval(args, run_dir: Path, out: Path, split: str, steps: int, echo: bool) -> tuple[dict, str, str]:
    """seg-eval on `split`; returns (its JSON record, the command, the log path)."""
    cfg_path = run_dir / "config.yaml"
    cmd = [tool("seg-eval"), "--config", rel(cfg_path), "--gpus", str(args.gpus), "--checkpoint", rel(run_dir),
           "--split", split]
    ev = Child(f"seg-eval {split}", cmd, out / f"seg-eval-{split}.log", echo)
    rc = ev.wait()
    if rc != 0:
        raise BenchError(f"seg-eval --split {split} exited {rc}; see {rel(ev.log_path)}:\n{ev.tail()}")
    tag = Path(split).stem if ("/" in split or split.endswith(".txt")) else split  # as seg-eval names it
    record_path = run_dir / "eval" / f"{tag}-step{steps}.json"
    if not record_path.is_file():
        raise BenchError(f"seg-eval wrote no {rel(record_path)}; see {rel(ev.log_path)}")
    return json.loads(record_path.read_text()), quote(ev.cmd), rel(ev.log_path)


METRIC_KEYS = ("miou", "pixel_accuracy", "mean_class_accuracy", "per_class_iou", "per_class_accuracy",
               "confusion_matrix", "num_images", "step", "bn_stats_reestimated")


def run_seg_train(args, out: Path, num_steps: int, echo: bool) -> dict:
    run_dir = out / "seg-train"
    state = {"last_step": None, "last_step_time": None, "interrupted_step": None}

    def on_line(t, line):
        m = STEP_LINE.search(line)
        if m:
            state["last_step"], state["last_step_time"] = int(m.group(1)), t
        m = INTERRUPTED_LINE.search(line)
        if m:
            state["interrupted_step"] = int(m.group(1))

    print(f"== seg-train: {num_steps} steps ==", flush=True)
    child = Child("seg-train", seg_train_cmd(args, run_dir, [f"train.num_steps={num_steps}"]),
                  out / "seg-train.log", echo, on_line)
    rc = child.wait()
    if rc != 0 or state["interrupted_step"] is not None or state["last_step"] != num_steps:
        raise BenchError(f"seg-train exited {rc} at step {state['last_step']} of {num_steps}; "
                         f"see {rel(child.log_path)}:\n{child.tail()}")
    train_seconds = state["last_step_time"] - child.t_launch

    import yaml
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    batch = resolved["data"]["batch_size"] * resolved["train"].get("accumulate_steps", 1)
    result = {"steps": num_steps, "batch_size": batch, "images_seen": num_steps * batch,
              "train_seconds": train_seconds, "images_per_sec": num_steps * batch / train_seconds,
              "gpus": args.gpus, "recipe": recipe_of(resolved), "run_dir": rel(run_dir),
              "commands": {"train": quote(child.cmd)}, "logs": {"train": rel(child.log_path)}}
    splits = [("val", resolved["data"]["val_split"])] + ([("test", args.test_split)] if args.test_split else [])
    for key, split in splits:
        print(f"== seg-eval --split {split} ==", flush=True)
        record, cmd, log_path = seg_eval(args, run_dir, out, split, num_steps, echo)
        result[key] = {k: record.get(k) for k in METRIC_KEYS}
        result[key]["split"] = split
        result["commands"][f"eval_{key}"] = cmd
        result["logs"][f"eval_{key}"] = log_path
    # The val figures at the top level, as before (summary.json readers).
    result.update({k: result["val"][k] for k in METRIC_KEYS})
    return result


def recipe_of(cfg: dict) -> dict:
    d, m, t = cfg["data"], cfg["model"], cfg["train"]
    loss, e = cfg.get("loss", {}), cfg.get("eval", {})
    recipe = {
        "model.backbone": m["backbone"], "model.head": m.get("head"), "model.output_stride": m["output_stride"],
        "model.decoder_stride": m.get("decoder_stride"),
        "model.aspp_channels": m["aspp_channels"], "model.decoder_channels": m["decoder_channels"],
        "model.low_level_channels": m["low_level_channels"], "model.bn_momentum": m["bn_momentum"],
        "model.weight_decay": m["weight_decay"], "model.backbone_weights": m["backbone_weights"],
        "data.batch_size": d["batch_size"], "data.crop_size": d["crop_size"],
        "data.random_scale": d["random_scale"], "data.random_mirror": d["random_mirror"],
        "loss.class_weights": loss.get("class_weights"),
        "loss.top_k_percent_pixels": loss.get("top_k_percent_pixels"),
        "data.photometric": d.get("photometric"), "loss.type": loss.get("type"), "loss.terms": loss.get("terms"),
        "loss.ohem_threshold": loss.get("ohem_threshold"), "loss.ohem_min_kept": loss.get("ohem_min_kept"),
        "train.optimizer": t["optimizer"], "train.learning_rate": t["learning_rate"],
        "train.lr_power": t["lr_power"], "train.warmup_steps": t["warmup_steps"],
        "train.num_steps": t["num_steps"], "train.accumulate_steps": t.get("accumulate_steps"),
        "train.clip_global_norm": t.get("clip_global_norm"), "train.ema_decay": t.get("ema_decay"),
        "train.precision": t.get("precision"), "train.jit_compile": t.get("jit_compile"),
    }
    # Evaluation keys as the config has them (newer configs have more).
    recipe.update({f"eval.{k}": v for k, v in e.items()})
    return recipe


# ---- baseline ------------------------------------------------------------------------------------------
def run_baseline(args, out: Path, data: dict, num_steps: int, echo: bool) -> dict:
    print(f"== baseline (Keras model.fit): {num_steps} steps ==", flush=True)
    bdir = out / "baseline"
    cmd = [sys.executable, str(REPO / "benchmarks" / "baseline_keras_fit_accuracy.py"), "--data", rel(data["root"]),
           "--num-classes", str(data["num_classes"]), "--ignore-label", str(data["ignore_label"]),
           "--train-split", data["train_split"], "--val-split", data["val_split"],
           "--batch-size", str(BUDGET_BATCH), "--max-steps", str(num_steps),
           "--minutes", f"{args.baseline_minutes:g}", "--bn-reestimate", str(args.baseline_bn_reestimate),
           "--out", rel(bdir)]
    child = Child("baseline", cmd, out / "baseline.log", echo)
    limit = args.baseline_minutes * 60 + 1800  # its safety stop + generous time for evaluation
    try:
        rc = child.wait(limit)
    except subprocess.TimeoutExpired:
        child.kill()
        raise BenchError(f"the baseline did not finish within {limit:.0f}s; see {rel(child.log_path)}") from None
    if rc != 0 or not (bdir / "result.json").is_file():
        raise BenchError(f"the baseline exited {rc}; see {rel(child.log_path)}:\n{child.tail()}")
    res = json.loads((bdir / "result.json").read_text())
    res["command"] = quote(cmd)
    res["log"] = rel(child.log_path)
    res["images_per_sec"] = res["images_seen"] / res["train_seconds"]
    return res


# ---- report ---------------------------------------------------------------------------------------------
def class_names(seg, base) -> list[str]:
    for r in (seg, base):
        if r:
            return list(r["per_class_iou"].keys())
    return []


def eval_mode(recipe: dict) -> str:
    """How seg-train's evaluation predicts, in words (from the config's eval keys)."""
    parts = [f"{recipe['eval.mode']} windows" if recipe.get("eval.mode") not in (None, "whole") else "whole image"]
    if recipe.get("eval.scales") not in (None, [1.0]):
        parts.append("scales " + ", ".join(f"{x:g}" for x in recipe["eval.scales"]))
    if recipe.get("eval.flip"):
        parts.append("+ left-right flip")
    text = ", ".join(parts) + " (softmax averaged)" if len(parts) > 1 else parts[0]
    if recipe.get("eval.logit_adjustment"):
        text += f", classes divided by their loss weight^{recipe['eval.logit_adjustment']:g} (eval.logit_adjustment)"
    return text


def summary_markdown(s: dict) -> str:
    seg, base = s.get("seg_train"), s.get("baseline")
    reest = (base or {}).get("bn_reestimated")
    test = (seg or {}).get("test")
    lines = []
    title = (f"full benchmark: {s['steps']} steps of batch {BUDGET_BATCH} per side" if s["full"] else
             f"{s['steps']} steps per side: NOT the full benchmark")
    lines.append(f"Run {s['started']} ({title}); {s['cpus']} CPUs; load average (1/5/15 min) at start "
                 f"{s['loadavg_start']}, at end {s['loadavg_end']}; results in `{s['out']}`. The step count is "
                 f"the budget; wall times depend on the machine's other load and are for information.")
    if s.get("over_budget"):
        lines.append("")
        lines.append(f"**Over the budget: {s['steps']} steps x batch {seg['batch_size']} is more than "
                     f"{STEP_BUDGET} steps of batch {BUDGET_BATCH}.**")
    lines.append("")
    lines.append("| | seg-train | Keras `model.fit` baseline |")
    lines.append("| --- | ---: | ---: |")

    def row(name, a, b):
        lines.append(f"| {name} | {a} | {b} |")

    row("**val mIoU %** (101 images)", f"**{pct(seg['miou'])}**" if seg else "-",
        f"**{pct(base['miou'])}**" if base else "-")
    if seg:
        row(f"**{test['split']} mIoU %** ({test['num_images']} images)" if test else "test mIoU %",
            f"**{pct(test['miou'])}**" if test else "not evaluated",
            "not evaluated (the script evaluates one split)" if base else "-")
    if reest:
        row("val mIoU % of the baseline's weights with re-estimated BN statistics (diagnostic)", "",
            pct(reest["miou"]))
    row("val pixel accuracy %", pct(seg["pixel_accuracy"]) if seg else "-",
        pct(base["pixel_accuracy"]) if base else "-")
    row("val mean class accuracy %", pct(seg["mean_class_accuracy"]) if seg else "-",
        pct(base["mean_class_accuracy"]) if base else "-")
    row("steps x batch", f"{seg['steps']} x {seg['batch_size']}" if seg else "-",
        f"{base['steps']} x {base['batch_size']}" if base else "-")
    row("training wall time (process start to last step)", fmt_time(seg["train_seconds"]) if seg else "-",
        fmt_time(base["train_seconds"]) if base else "-")
    row("images/s (incl. start-up)", f"{seg['images_per_sec']:.2f}" if seg else "-",
        f"{base['images_per_sec']:.2f}" if base else "-")
    if seg:
        ema = seg["recipe"].get("train.ema_decay")
        row("weights evaluated", f"exponential moving average (train.ema_decay {ema:g})" if ema else "as trained",
            "as trained" if base else "-")
        row("prediction", eval_mode(seg["recipe"]), "whole image" if base else "-")
    row("BN statistics at evaluation",
        ("re-estimated (eval.bn_reestimate_batches)" if seg.get("bn_stats_reestimated") else "moving averages") if seg
        else "-", "moving averages (momentum 0.999 backbone / 0.99 head)" if base else "-")
    lines.append("")

    names = class_names(seg, base)
    cols = (["seg-train val"] if seg else []) + (["seg-train test"] if test else []) + \
           (["baseline val"] if base else []) + (["baseline val, BN re-estimated"] if reest else [])
    lines.append("| class | " + " | ".join(f"{c} IoU %" for c in cols) + " |")
    lines.append("| --- |" + " ---: |" * len(cols))
    sources = [r for r in (seg, test, base, reest) if r]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(pct(r["per_class_iou"][n]) for r in sources) + " |")
    lines.append("| **mean** | " + " | ".join(f"**{pct(r['miou'])}**" for r in sources) + " |")
    lines.append("")
    if seg:
        lines.append(f"seg-train recipe (`{s['config']}`"
                     + (", overrides " + ", ".join(f"`{o}`" for o in s["overrides"]) if s["overrides"] else "")
                     + f", `--gpus {seg['gpus']}`):")
        lines.append("")
        lines.append("| key | value |")
        lines.append("| --- | --- |")
        for k, v in seg["recipe"].items():
            lines.append(f"| `{k}` | `{json.dumps(v)}` |")
        lines.append("")
    lines.append("Commands (from the repo root):")
    lines.append("")
    lines.append("```sh")
    lines.append(s["command"] + "   # this benchmark")
    if seg:
        lines.append(seg["commands"]["train"])
        lines.append(seg["commands"]["eval_val"])
        if "eval_test" in seg["commands"]:
            lines.append(seg["commands"]["eval_test"])
    if base:
        lines.append(base["command"])
    lines.append("```")
    return "\n".join(lines)


def update_doc(doc: Path, body: str) -> bool:
    if not doc.is_file():
        print(f"note: {rel(doc)} not found; results not written into it", flush=True)
        return False
    text = doc.read_text()
    if DOC_BEGIN not in text or DOC_END not in text:
        print(f"note: {rel(doc)} has no bench-accuracy markers; results not written into it", flush=True)
        return False
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(head + DOC_BEGIN + "\n" + body.rstrip() + "\n" + DOC_END + tail)
    os.replace(tmp, doc)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    from seg_train import config as config_lib  # no TensorFlow: config only

    try:
        cfg = config_lib.load(args.config, [f"data.root={CAMVID_ROOT}"] + args.overrides)
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = {"root": cfg.data.root, "num_classes": cfg.data.num_classes, "ignore_label": cfg.data.ignore_label,
            "train_split": cfg.data.train_split, "val_split": cfg.data.val_split}
    if not Path(cfg.data.root).is_dir():
        print(f"error: data root not found ({cfg.data.root}): expected CamVid in VOC layout "
              "(set CAMVID_ROOT; see docs/ACCURACY.md, 'Data')", file=sys.stderr)
        return 2
    steps = args.steps or cfg.train.num_steps
    images = steps * cfg.data.batch_size * cfg.train.accumulate_steps
    over_budget = images > STEP_BUDGET * BUDGET_BATCH
    if over_budget:
        print(f"warning: {steps} steps x batch {cfg.data.batch_size * cfg.train.accumulate_steps} = {images} "
              f"images is over the budget of {STEP_BUDGET} steps of batch {BUDGET_BATCH}; the docs are not "
              "updated", file=sys.stderr)
    full = args.steps is None and not over_budget and not args.skip_seg_train and not args.skip_baseline
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / stamp
    out.mkdir(parents=True, exist_ok=False)
    summary = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"), "steps": steps, "full": full,
        "over_budget": over_budget, "step_budget": STEP_BUDGET, "budget_batch": BUDGET_BATCH,
        "cpus": os.cpu_count(), "loadavg_start": loadavg(), "config": rel(args.config),
        "overrides": args.overrides, "out": rel(out),
        "command": quote([sys.executable, "benchmarks/bench_accuracy.py"]
                         + (argv if argv is not None else sys.argv[1:])),
    }
    echo = not args.quiet
    print(f"bench-accuracy: {steps} steps per side, results in {rel(out)}", flush=True)
    try:
        if not args.skip_seg_train:
            summary["seg_train"] = run_seg_train(args, out, steps, echo)
        if not args.skip_baseline:
            summary["baseline"] = run_baseline(args, out, data, steps, echo)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    summary["loadavg_end"] = loadavg()

    md = summary_markdown(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(md + "\n")
    print("\n" + "=" * 100 + "\n" + md + "\n" + "=" * 100, flush=True)
    if args.update_doc == "yes" or (args.update_doc == "auto" and full):
        if update_doc(REPO / args.doc, md):
            print(f"wrote the results into {args.doc}", flush=True)
    elif args.update_doc == "auto":
        print(f"{args.doc} not updated (only a full run updates it: the config's own train.num_steps, within "
              f"{STEP_BUDGET} steps of batch {BUDGET_BATCH}, both sides; --update-doc yes to force)", flush=True)
    print(f"wrote {rel(out / 'summary.json')} and {rel(out / 'summary.md')}", flush=True)
    if args.json == "-":
        print(json.dumps(summary, indent=1))
    elif args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
