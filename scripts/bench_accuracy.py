#!/usr/bin/env python3
"""`make bench-accuracy`: seg-train vs a plain Keras `model.fit` baseline on CamVid, same time budget.

What it does (all under RUN = runs/bench-accuracy/<date-time>/):

1. seg-train timing probe (RUN/probe): the configured recipe (configs/camvid.yaml + --set) runs
   for --probe-steps steps with a log line every 5 steps, then gets SIGINT. The seconds per step
   (from the 10th logged step on, so tracing is excluded) and the start-up time (process launch to
   the first steps: imports, data check, model build, tracing) give
       train.num_steps = (budget - start-up) / (seconds per step) * (1 - margin),
   so the poly learning-rate schedule ends when the budget does.
2. seg-train (RUN/seg-train) with that train.num_steps. The budget counts from the process launch.
   If it is still training at the deadline (a slower machine than the probe saw), it gets SIGINT:
   seg-train finishes the step, writes a checkpoint and exits 130. The training wall time is the
   launch-to-last-step time (seen from its log lines); the final in-process evaluation after the
   last step is not training time.
3. seg-eval on RUN/seg-train (full resolution, val split; BN statistics re-estimated as configured
   by eval.bn_reestimate_batches unless the checkpoint already was): RUN/seg-train/eval/val-step<K>.json.
4. The baseline, scripts/baseline_keras_fit_accuracy.py (independent of seg_train: plain Keras model.fit,
   DeepLabV3+-lite on keras.applications.MobileNetV2 from scratch), with the same budget counted
   from its process start, evaluated on the same val split with the same metric (confusion matrix
   over every non-ignored pixel at full resolution). It also reports, separately, the mIoU of its
   weights after re-estimating their BN statistics (--bn-reestimate, diagnostic only).
5. A summary (both mIoUs, per-class IoU, wall times, steps, commands): printed, written to
   RUN/summary.json and RUN/summary.md, and — for a full run (budget 30 min, both sides) —
   written into docs/ACCURACY.md between the bench-accuracy markers (--update-doc to force/skip).

The machine should be otherwise idle: both sides are timed by the wall clock, and the load average
at the start and end is recorded with the results.

Usage:
    .venv/bin/python scripts/bench_accuracy.py                    # the full benchmark, ~65 minutes
    .venv/bin/python scripts/bench_accuracy.py --minutes 3        # a short check (docs not updated)
    .venv/bin/python scripts/bench_accuracy.py --minutes 3 --skip-baseline --set train.learning_rate=2e-3

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
DOC_BEGIN = "<!-- bench-accuracy:begin (written by scripts/bench_accuracy.py; do not edit by hand) -->"
DOC_END = "<!-- bench-accuracy:end -->"
FULL_MINUTES = 30.0
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\s+loss\s+([0-9.naninf]+)")
INTERRUPTED_LINE = re.compile(r"interrupted by SIG\w+ at step (\d+)")
NOISE = re.compile(r"^(WARNING: All log messages before absl|[IWE]\d{4} \d\d:\d\d:\d\d|I0000|E0000|W0000)")


class BenchError(RuntimeError):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--minutes", type=float, default=FULL_MINUTES, help="training budget of EACH side (default 30)")
    p.add_argument("--config", default="configs/camvid.yaml", help="seg-train config (default configs/camvid.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="seg-train config override (repeatable); train.num_steps is computed, not taken from here")
    p.add_argument("--gpus", type=int, default=1, help="seg-train towers (default 1: fastest on a 2-core CPU)")
    p.add_argument("--out", default="runs/bench-accuracy", help="parent folder of the run folders")
    p.add_argument("--probe-steps", type=int, default=30, help="steps of the seg-train timing probe (default 30)")
    p.add_argument("--margin", type=float, default=0.0,
                   help="fraction of the budget left unplanned (default 0: a run that turns out slower than the probe "
                        "is stopped by SIGINT at the deadline, with its learning rate already near 0)")
    p.add_argument("--baseline-bn-reestimate", type=int, default=50, metavar="K",
                   help="also report the baseline after re-estimating its BN statistics from K batches (0: off)")
    p.add_argument("--skip-baseline", action="store_true", help="run seg-train only")
    p.add_argument("--skip-seg-train", action="store_true", help="run the baseline only")
    p.add_argument("--update-doc", choices=("auto", "yes", "no"), default="auto",
                   help="write the results into docs/ACCURACY.md: auto = only for a full run (30 min, both sides)")
    p.add_argument("--doc", default="docs/ACCURACY.md", help="the document to update (default docs/ACCURACY.md)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="also write the summary JSON to PATH (no PATH: print it to stdout at the end)")
    p.add_argument("--quiet", action="store_true", help="do not echo the children's output (it is still logged)")
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error("--minutes must be positive")
    if args.skip_baseline and args.skip_seg_train:
        p.error("nothing to do: both --skip-baseline and --skip-seg-train")
    if args.probe_steps < 15:
        p.error("--probe-steps must be at least 15 (steps 10.. are timed)")
    if not 0 <= args.margin < 0.5:
        p.error("--margin must be in [0, 0.5)")
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
    for o in args.overrides + extra:
        cmd += ["--set", o]
    return cmd


def probe(args, run_dir: Path, echo: bool) -> dict:
    """Runs the recipe for --probe-steps steps and measures seconds per step and start-up time."""
    steps: list[tuple[int, float]] = []
    done = threading.Event()

    def on_line(t, line):
        m = STEP_LINE.search(line)
        if m:
            steps.append((int(m.group(1)), t))
            if int(m.group(1)) >= args.probe_steps:
                done.set()

    extra = ["train.num_steps=1000000", "train.summary_every=5", "train.image_summary_every=0",
             "train.checkpoint_every=1000000"]
    child = Child("probe", seg_train_cmd(args, run_dir, extra), run_dir.parent / "probe.log", echo, on_line)
    limit = max(900.0, 2 * args.minutes * 60)
    while not done.is_set() and child.proc.poll() is None:
        if time.monotonic() - child.t_launch > limit:
            child.kill()
            raise BenchError(f"the timing probe did not reach step {args.probe_steps} in {limit:.0f}s; "
                             f"see {rel(child.log_path)}")
        done.wait(0.5)
    child.interrupt()
    rc = child.wait(300)
    timed = [(s, t) for s, t in steps if s >= 10]
    if len(timed) < 2:
        raise BenchError(f"the timing probe failed (exit {rc}); see {rel(child.log_path)}:\n{child.tail()}")
    (s0, t0), (s1, t1) = timed[0], timed[-1]
    sec_per_step = (t1 - t0) / (s1 - s0)
    startup = max(t0 - child.t_launch - s0 * sec_per_step, 0.0)
    return {"seconds_per_step": sec_per_step, "startup_seconds": startup, "steps_timed": s1 - s0,
            "command": quote(child.cmd), "log": rel(child.log_path)}


def run_seg_train(args, out: Path, echo: bool) -> dict:
    budget = args.minutes * 60
    run_dir = out / "seg-train"
    print(f"== seg-train timing probe ({args.probe_steps} steps) ==", flush=True)
    pr = probe(args, out / "probe", echo)
    num_steps = max(int((budget * (1 - args.margin) - pr["startup_seconds"]) / pr["seconds_per_step"]), 10)
    print(f"== probe: {pr['seconds_per_step']:.3f} s/step, start-up {pr['startup_seconds']:.0f}s -> "
          f"train.num_steps={num_steps} for a {args.minutes:g}-minute budget ==", flush=True)

    state = {"last_step": None, "last_step_time": None, "interrupted_step": None, "interrupted_time": None}

    def on_line(t, line):
        m = STEP_LINE.search(line)
        if m:
            state["last_step"], state["last_step_time"] = int(m.group(1)), t
        m = INTERRUPTED_LINE.search(line)
        if m:
            state["interrupted_step"], state["interrupted_time"] = int(m.group(1)), t

    print(f"== seg-train: {args.minutes:g} minutes ==", flush=True)
    child = Child("seg-train", seg_train_cmd(args, run_dir, [f"train.num_steps={num_steps}"]),
                  out / "seg-train.log", echo, on_line)
    deadline = child.t_launch + budget
    sent_sigint = False
    while child.proc.poll() is None:
        finished = state["last_step"] == num_steps
        if not finished and not sent_sigint and time.monotonic() >= deadline:
            print(f"== seg-train: budget reached at step {state['last_step']} (logged); sending SIGINT ==", flush=True)
            child.interrupt()
            sent_sigint = True
        time.sleep(0.2)
    rc = child.wait()
    if rc not in (0, 130):
        raise BenchError(f"seg-train exited {rc}; see {rel(child.log_path)}:\n{child.tail()}")
    if state["interrupted_step"] is not None:
        steps, t_end = state["interrupted_step"], state["interrupted_time"]
    elif state["last_step"] == num_steps:
        steps, t_end = num_steps, state["last_step_time"]
    else:
        raise BenchError(f"seg-train exited {rc} without reaching a step; see {rel(child.log_path)}")
    train_seconds = t_end - child.t_launch

    print("== seg-eval ==", flush=True)
    cfg_path = run_dir / "config.yaml"
    ev = Child("seg-eval", [tool("seg-eval"), "--config", rel(cfg_path), "--gpus", str(args.gpus),
                            "--checkpoint", rel(run_dir)], out / "seg-eval.log", echo)
    rc = ev.wait()
    if rc != 0:
        raise BenchError(f"seg-eval exited {rc}; see {rel(ev.log_path)}:\n{ev.tail()}")
    record_path = run_dir / "eval" / f"val-step{steps}.json"
    if not record_path.is_file():
        found = sorted((run_dir / "eval").glob("*.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise BenchError(f"seg-eval wrote no record under {rel(run_dir / 'eval')}")
        record_path = found[-1]
    record = json.loads(record_path.read_text())

    import yaml
    resolved = yaml.safe_load(cfg_path.read_text())
    batch = resolved["data"]["batch_size"]
    return {
        **{k: record[k] for k in ("miou", "pixel_accuracy", "mean_class_accuracy", "per_class_iou",
                                  "per_class_accuracy", "confusion_matrix", "num_images", "step")},
        "bn_stats_reestimated": record.get("bn_stats_reestimated"),
        "steps": steps, "planned_steps": num_steps, "stopped_by_deadline": sent_sigint,
        "batch_size": batch, "images_seen": steps * batch, "train_seconds": train_seconds,
        "images_per_sec": steps * batch / train_seconds, "probe": pr, "gpus": args.gpus,
        "recipe": recipe_of(resolved),
        "commands": {"probe": pr["command"], "train": quote(child.cmd), "eval": quote(ev.cmd)},
        "logs": {"train": rel(child.log_path), "eval": rel(ev.log_path)},
        "eval_record": rel(record_path), "run_dir": rel(run_dir),
    }


def recipe_of(cfg: dict) -> dict:
    d, m, t, e = cfg["data"], cfg["model"], cfg["train"], cfg.get("eval", {})
    return {
        "model.backbone": m["backbone"], "model.output_stride": m["output_stride"],
        "model.aspp_channels": m["aspp_channels"], "model.decoder_channels": m["decoder_channels"],
        "model.low_level_channels": m["low_level_channels"], "model.bn_momentum": m["bn_momentum"],
        "model.weight_decay": m["weight_decay"], "model.backbone_weights": m["backbone_weights"],
        "data.batch_size": d["batch_size"], "data.crop_size": d["crop_size"],
        "data.random_scale": d["random_scale"], "data.random_mirror": d["random_mirror"],
        "train.optimizer": t["optimizer"], "train.learning_rate": t["learning_rate"],
        "train.lr_power": t["lr_power"], "train.warmup_steps": t["warmup_steps"],
        "train.num_steps": t["num_steps"], "train.precision": t.get("precision"),
        "train.jit_compile": t.get("jit_compile"),
        "eval.bn_reestimate_batches": e.get("bn_reestimate_batches"),
    }


# ---- baseline ------------------------------------------------------------------------------------------
def run_baseline(args, out: Path, data: dict, echo: bool) -> dict:
    print(f"== baseline (Keras model.fit): {args.minutes:g} minutes ==", flush=True)
    bdir = out / "baseline"
    cmd = [sys.executable, str(REPO / "scripts" / "baseline_keras_fit_accuracy.py"), "--data", rel(data["root"]),
           "--num-classes", str(data["num_classes"]), "--ignore-label", str(data["ignore_label"]),
           "--train-split", data["train_split"], "--val-split", data["val_split"],
           "--minutes", f"{args.minutes:g}", "--bn-reestimate", str(args.baseline_bn_reestimate), "--out", rel(bdir)]
    child = Child("baseline", cmd, out / "baseline.log", echo)
    limit = args.minutes * 60 + 1800  # budget + generous time for the first epoch overshoot and eval
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


def summary_markdown(s: dict) -> str:
    seg, base = s.get("seg_train"), s.get("baseline")
    reest = (base or {}).get("bn_reestimated")
    full = s["minutes"] == FULL_MINUTES and seg and base
    lines = []
    title = "Full 30-minute benchmark" if full else f"{s['minutes']:g}-minute budget (NOT the full 30-minute benchmark)"
    lines.append(f"Run {s['started']} ({title}); {s['cpus']} CPUs; load average (1/5/15 min) at start "
                 f"{s['loadavg_start']}, at end {s['loadavg_end']}; budget {s['minutes']:g} min per side; "
                 f"results in `{s['out']}`.")
    if s["loadavg_start"] and s["loadavg_start"][0] > 0.5 * (s["cpus"] or 1):
        lines.append("")
        lines.append(f"**Warning: the machine was busy when this run started (1-minute load average "
                     f"{s['loadavg_start'][0]} on {s['cpus']} CPUs): both sides got less than the whole CPU, "
                     f"and the figures are not comparable with a run on an idle machine.**")
    lines.append("")
    lines.append("| | seg-train | Keras `model.fit` baseline |")
    lines.append("| --- | ---: | ---: |")

    def row(name, a, b):
        lines.append(f"| {name} | {a} | {b} |")

    row("**val mIoU %**", f"**{pct(seg['miou'])}**" if seg else "-", f"**{pct(base['miou'])}**" if base else "-")
    if reest:
        row("val mIoU % of the baseline's weights with re-estimated BN statistics (diagnostic)", "",
            pct(reest["miou"]))
    row("pixel accuracy %", pct(seg["pixel_accuracy"]) if seg else "-", pct(base["pixel_accuracy"]) if base else "-")
    row("mean class accuracy %", pct(seg["mean_class_accuracy"]) if seg else "-",
        pct(base["mean_class_accuracy"]) if base else "-")
    row("training wall time (process start to last step)", fmt_time(seg["train_seconds"]) if seg else "-",
        fmt_time(base["train_seconds"]) if base else "-")
    row("steps x batch", f"{seg['steps']} x {seg['batch_size']}" if seg else "-",
        f"{base['steps']} x {base['batch_size']}" if base else "-")
    row("images/s (incl. start-up)", f"{seg['images_per_sec']:.2f}" if seg else "-",
        f"{base['images_per_sec']:.2f}" if base else "-")
    if seg:
        row("seg-train stopped by", "SIGINT at the deadline" if seg["stopped_by_deadline"] else
            f"train.num_steps (from the probe: {seg['probe']['seconds_per_step']:.2f} s/step, "
            f"start-up {seg['probe']['startup_seconds']:.0f}s)", "")
    row("BN statistics at evaluation",
        ("re-estimated (eval.bn_reestimate_batches)" if seg.get("bn_stats_reestimated") else "moving averages") if seg
        else "-", "moving averages (momentum 0.999 backbone / 0.99 head)" if base else "-")
    lines.append("")

    names = class_names(seg, base)
    head = "| class | seg-train IoU % | baseline IoU % |" + (" baseline, BN re-estimated, IoU % |" if reest else "")
    lines.append(head)
    lines.append("| --- | ---: | ---: |" + (" ---: |" if reest else ""))
    for n in names:
        r = f"| {n} | {pct(seg['per_class_iou'][n]) if seg else '-'} | {pct(base['per_class_iou'][n]) if base else '-'} |"
        if reest:
            r += f" {pct(reest['per_class_iou'][n])} |"
        lines.append(r)
    lines.append(f"| **mean** | **{pct(seg['miou']) if seg else '-'}** | **{pct(base['miou']) if base else '-'}** |"
                 + (f" {pct(reest['miou'])} |" if reest else ""))
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
        lines.append(seg["commands"]["probe"] + "   # timing probe, SIGINT after the probe steps")
        lines.append(seg["commands"]["train"])
        lines.append(seg["commands"]["eval"])
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
        cfg = config_lib.load(args.config, [o for o in args.overrides])
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = {"root": cfg.data.root, "num_classes": cfg.data.num_classes, "ignore_label": cfg.data.ignore_label,
            "train_split": cfg.data.train_split, "val_split": cfg.data.val_split}
    if not Path(cfg.data.root).is_dir():
        print(f"error: data root not found ({cfg.data.root}): expected CamVid in VOC layout "
              "(see docs/ACCURACY.md, 'Data')", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / stamp
    out.mkdir(parents=True, exist_ok=False)
    summary = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"), "minutes": args.minutes,
        "cpus": os.cpu_count(), "loadavg_start": loadavg(), "config": rel(args.config),
        "overrides": args.overrides, "out": rel(out),
        "command": quote([sys.executable, "scripts/bench_accuracy.py"] + (argv if argv is not None else sys.argv[1:])),
    }
    echo = not args.quiet
    print(f"bench-accuracy: {args.minutes:g} minutes per side, results in {rel(out)}", flush=True)
    try:
        if not args.skip_seg_train:
            summary["seg_train"] = run_seg_train(args, out, echo)
        if not args.skip_baseline:
            summary["baseline"] = run_baseline(args, out, data, echo)
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
    full = args.minutes == FULL_MINUTES and "seg_train" in summary and "baseline" in summary
    if args.update_doc == "yes" or (args.update_doc == "auto" and full):
        if update_doc(REPO / args.doc, md):
            print(f"wrote the results into {args.doc}", flush=True)
    elif args.update_doc == "auto":
        print(f"{args.doc} not updated (only a full run updates it: --minutes 30 with both sides; "
              "--update-doc yes to force)", flush=True)
    print(f"wrote {rel(out / 'summary.json')} and {rel(out / 'summary.md')}", flush=True)
    if args.json == "-":
        print(json.dumps(summary, indent=1))
    elif args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
