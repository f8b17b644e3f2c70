#!/usr/bin/env python
"""The train step's start-up by phase: EoMT against the linear head (or any variants), each in a fresh process.

    python benchmarks/bench_first_step.py [--variants eomt linear] [--batch 2] [--size 224] [--rounds 2]
                                          [--set KEY=VALUE ...] [--profile N] [--output FILE.json]

A variant is `eomt` or `linear` (the DINOv3 ViT-S/16 models of the transformers comparison in docs/PERFORMANCE.md:
EoMT with 200 queries in the last 4 blocks, 150 classes, 12544 points; or BatchNorm + 1x1 conv on the last block,
fine-tuned), optionally followed by `:KEY=VALUE,KEY=VALUE` overrides of that variant alone (e.g.
`eomt:train.recompute=blocks`); --set applies to every variant. Each process builds the run's TrainState and
TrainStep (train/run.py's parts, 1 tower, AdamW) on random images and labels holding 10 classes each, and times
the phases TensorFlow lets apart:

  trace          TrainStep.concrete_function: Python runs the step once symbolically (forward, loss, the
                 gradient's graph, the update), as seg-train does before its first step
  first call     the first step: graph optimisation (Grappler, function inlining) + the first execution
  steady step    the median of --steps further steps (wall and CPU seconds, all the process's threads)
  graph optimisation = first call - steady step (TensorFlow reports no finer split)

and the ops in the traced graph (the function library's included: what Grappler has to optimise), the process's
peak resident memory (VmHWM: tracing and graph optimisation included) and a steady step's own: TensorFlow's CPU
allocator peak over one more step less what it held before the step (the activations and workspace the step
adds). --profile N prints the N Python functions with the most cumulative time during the trace (cProfile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = {
    "eomt": {"model": {"backbone": "dinov3_vits16", "head": "eomt", "num_queries": 200, "eomt_blocks": 4,
                       "drop_path_rate": 0.0},
             "train": {"mask_annealing": [[50000, 60000], [60000, 70000], [70000, 80000], [80000, 90000]]},
             "loss": {"mask_points": 12544}},
    "linear": {"model": {"backbone": "dinov3_vits16", "head": "linear", "vit_layers": [12], "drop_path_rate": 0.0}},
}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["eomt", "linear"],
                   help="eomt or linear, each optionally :KEY=VALUE,... (default eomt linear)")
    p.add_argument("--batch", type=int, default=2, help="images per step (default 2)")
    p.add_argument("--size", type=int, default=224, help="square input side (default 224)")
    p.add_argument("--classes", type=int, default=150, help="data.num_classes (default 150)")
    p.add_argument("--rounds", type=int, default=2, help="times the sequence of variants is run (default 2)")
    p.add_argument("--steps", type=int, default=2, help="steady steps timed after the first (default 2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every variant (repeatable)")
    p.add_argument("--profile", type=int, default=0, help="print the N costliest Python functions of the trace")
    p.add_argument("--output", type=Path, help="also write every number as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for v in args.variants:
        if v.partition(":")[0] not in BASE:
            p.error(f"variant {v!r}: expected one of {', '.join(BASE)}, optionally :KEY=VALUE,...")
    return args


def _value(text: str):
    import yaml

    return yaml.safe_load(text)


def _config(args, variant: str):
    import copy

    from seg_train.config import from_dict

    name, _, extra = variant.partition(":")
    raw = copy.deepcopy(BASE[name])
    raw.update(seed=0, run_dir="runs/unused")
    raw["data"] = {"root": "data", "num_classes": args.classes, "batch_size": args.batch,
                   "crop_size": [args.size, args.size]}
    raw.setdefault("train", {}).update(optimizer="adamw", learning_rate=1e-4, weight_decay=0.05, num_steps=100000)
    for item in list(args.overrides) + [s for s in extra.split(",") if s]:
        key, _, value = item.partition("=")
        section, _, leaf = key.partition(".")
        raw.setdefault(section, {})[leaf] = _value(value)
    return from_dict(raw)


def _graph_ops(concrete) -> int:
    graph_def = concrete.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def child(args) -> dict:
    from seg_train.cli import set_tf_env_defaults

    set_tf_env_defaults()
    import numpy as np
    import tensorflow as tf

    from seg_train.parallel import replicas
    from seg_train.run.state import TrainState
    from seg_train.train.step import TrainStep
    from seg_train.util.sysinfo import peak_rss_mb

    cfg = _config(args, args.child)
    rng = np.random.default_rng(0)
    images = rng.normal(0, 1, (args.batch, args.size, args.size, 3)).astype("float32")
    present = [rng.choice(args.classes, 10, replace=False) for _ in range(args.batch)]
    cells = rng.integers(0, 10, (args.batch, args.size // 16, args.size // 16))
    labels = np.stack([p[c] for p, c in zip(present, cells)]).repeat(16, 1).repeat(16, 2).astype("uint8")
    t0 = time.perf_counter()
    strategy = replicas.make_strategy(replicas.Devices(["/device:CPU:0"], "CPU", ""))
    step = TrainStep(TrainState(cfg, strategy))
    built = time.perf_counter() - t0
    batch = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((images, labels)))))
    element_spec = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((images, labels))).element_spec
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    concrete = step.concrete_function(element_spec)
    trace = time.perf_counter() - t0
    if profiler is not None:
        import pstats
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(args.profile)
    lr = step.state.learning_rates()
    t0 = time.perf_counter()
    float(step(batch, lr).loss)
    first = time.perf_counter() - t0
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        float(step(batch, lr).loss)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    steady = statistics.median(times)
    # The step's own memory: TensorFlow's CPU allocator peak over one more step, counted from what it held before
    # (weights, optimizer slots, the batch); RSS cannot tell it, freed memory staying with the process.
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"] / 2 ** 20
    float(step(batch, lr).loss)
    step_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2 ** 20
    return {"held_before_step_mib": before, "step_peak_mib": step_peak, "step_growth_mib": step_peak - before,
            "process_peak_rss_mib": peak_rss_mb(),
            "variant": args.child, "build_s": built, "trace_s": trace, "first_call_s": first, "steady_s": steady,
            "steady_cpu_s": statistics.median(cpu),
            "graph_optimisation_s": max(first - steady, 0.0), "first_step_s": trace + first,
            "graph_ops": _graph_ops(concrete)}


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = _parse(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs = []
    for r in range(args.rounds):
        for variant in args.variants:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--batch", str(args.batch),
                   "--size", str(args.size), "--classes", str(args.classes), "--steps", str(args.steps),
                   "--profile", str(args.profile)] + [f"--set={s}" for s in args.overrides]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if args.profile:
                print(out.stderr, file=sys.stderr)
            if out.returncode != 0:
                print(f"{variant}: exit {out.returncode}: {out.stderr.strip()[-2000:]}", file=sys.stderr)
                runs.append({"variant": variant, "failed": out.returncode, "round": r + 1})
                continue
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            rec.update(round=r + 1, load=_load())
            runs.append(rec)
            print(f"round {r + 1} {variant}: trace {rec['trace_s']:.1f} s, first call {rec['first_call_s']:.1f} s, "
                  f"steady {rec['steady_s']:.2f} s ({rec['steady_cpu_s']:.2f} CPU s), "
                  f"peak RSS {rec['process_peak_rss_mib']:.0f} MiB, "
                  f"allocator over a steady step {rec['held_before_step_mib']:.0f} -> {rec['step_peak_mib']:.0f} MiB "
                  f"(load {rec['load']})", file=sys.stderr)
    if args.output:
        args.output.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("output",
                                                                                                   "child")},
                                           "runs": runs}, indent=1, default=str) + "\n")
    print(f"batch {args.batch} x {args.size}, {args.classes} classes, 1 tower; a fresh process per variant, "
          f"{args.rounds} rounds; medians over the rounds\n")
    print("| variant | trace s | graph optimisation s | first execution (steady step) s | first step s "
          "| per round first step s | ops in the graph | steady step CPU s | process peak RSS MiB "
          "| a steady step's allocator growth MiB |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for variant in args.variants:
        recs = [x for x in runs if x["variant"] == variant and "failed" not in x]
        if not recs:
            print(f"| {variant} | failed | | | | | | | | |")
            continue
        med = {k: statistics.median(x[k] for x in recs) for k in ("trace_s", "graph_optimisation_s", "steady_s",
                                                                  "first_step_s", "graph_ops",
                                                                  "steady_cpu_s", "process_peak_rss_mib",
                                                                  "step_growth_mib")}
        print(f"| {variant} | {med['trace_s']:.1f} | {med['graph_optimisation_s']:.1f} | {med['steady_s']:.2f} | "
              f"{med['first_step_s']:.1f} | " + ", ".join(f"{x['first_step_s']:.1f}" for x in recs)
              + f" | {med['graph_ops']:,.0f} | {med['steady_cpu_s']:.2f} | {med['process_peak_rss_mib']:.0f} "
              f"| {med['step_growth_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
