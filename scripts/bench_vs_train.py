"""seg-bench's images/s against seg-train's own, timed from outside: does the benchmark measure the trainer?

For each tower count, each round runs, one after the other in fresh processes:
  1. seg-bench --json (its `images_per_sec`: the median of its timed windows);
  2. seg-train for LONG steps and for SHORT steps, each in an empty run dir, with no evaluation (no val
     split) and one checkpoint at the end. Start-up, the first step and the final checkpoint are the same
     in both, so they cancel: seg-train delivers images/s = batch x (LONG - SHORT) / (wall(LONG) - wall(SHORT)).
The process CPU time is subtracted the same way (CPU seconds per step), which other processes on a shared
machine inflate far less than the wall clock: seg-bench reports its own (`cpu_ms_per_step`).

    python scripts/bench_vs_train.py --config configs/camvid.yaml --gpus 1,4 [--rounds 2] [--set KEY=VALUE ...]
    python scripts/bench_vs_train.py --config configs/camvid.yaml --gpus 1,4 --synthetic 200 150

--synthetic W H trains on a freshly generated demo data set of W x H images instead of the config's data
(a data set the project's figures were never tuned on). Prints a Markdown table and, with --json PATH,
writes every measurement. Run it on a quiet machine: the subtraction turns a few seconds of start-up
noise into a large error over a few dozen steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_VAL = "__bench_vs_train_no_val__"


def _timed(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, CPU seconds of the child, the finished process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"error: command failed with exit {proc.returncode} ({' '.join(cmd)}):\n{tail}")
    return wall, cpu, proc


def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def bench(config: str, sets: list[str], towers: int, steps: int, windows: int, warmup: int) -> dict:
    cmd = [_bin("seg-bench"), "--config", config, "--gpus", str(towers), "--steps", str(steps), "--windows",
           str(windows), "--warmup", str(warmup), "--bn-images", "0", "--eval-images", "0", "--no-probes", "--json"]
    cmd += [x for s in sets for x in ("--set", s)]
    _, _, proc = _timed(cmd)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    row = next(r for r in report["towers"] if r["gpus"] == towers)
    return {"images_per_sec": row["images_per_sec"], "cpu_s_per_step": row["cpu_ms_per_step"] / 1e3,
            "images_per_step": row["images_per_step"], "warmup_steps_to_steady": row.get("warmup_steps_to_steady")}


def train(config: str, sets: list[str], towers: int, steps: int) -> tuple[float, float]:
    run_dir = tempfile.mkdtemp(prefix="bench-vs-train-")
    try:
        cmd = [_bin("seg-train"), "--config", config, "--gpus", str(towers), "--run-dir", run_dir]
        for s in sets + [f"train.num_steps={steps}", f"data.val_split={NO_VAL}", f"train.checkpoint_every={steps}"]:
            cmd += ["--set", s]
        wall, cpu, _ = _timed(cmd)
        return wall, cpu
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", default="1,4", help="tower counts, comma-separated (default 1,4)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--short", type=int, default=20, help="seg-train's short run, steps (default 20)")
    parser.add_argument("--long", type=int, default=80, help="seg-train's long run, steps (default 80)")
    parser.add_argument("--bench-steps", type=int, default=10)
    parser.add_argument("--bench-windows", type=int, default=3)
    parser.add_argument("--bench-warmup", type=int, default=20)
    parser.add_argument("--synthetic", type=int, nargs=2, metavar=("W", "H"))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    sets = list(args.sets)
    scratch = None
    if args.synthetic:
        from seg_train.data import synthetic

        scratch = tempfile.mkdtemp(prefix="bench-vs-train-data-")
        w, h = args.synthetic
        synthetic.generate(Path(scratch) / "demo", num_classes=5, size=(h, w), seed=7)
        sets += [f"data.root={Path(scratch) / 'demo'}", "data.num_classes=5", "loss.class_weights=null"]
    rows = []
    try:
        for towers in [int(t) for t in args.gpus.split(",")]:
            for r in range(args.rounds):
                b = bench(args.config, sets, towers, args.bench_steps, args.bench_windows, args.bench_warmup)
                long_wall, long_cpu = train(args.config, sets, towers, args.long)
                short_wall, short_cpu = train(args.config, sets, towers, args.short)
                n = args.long - args.short
                outside = b["images_per_step"] * n / (long_wall - short_wall)
                row = {"gpus": towers, "round": r + 1, "bench_images_per_sec": b["images_per_sec"],
                       "train_images_per_sec": outside, "ratio": b["images_per_sec"] / outside,
                       "bench_cpu_s_per_step": b["cpu_s_per_step"], "train_cpu_s_per_step": (long_cpu - short_cpu) / n,
                       "train_wall_s": [round(short_wall, 1), round(long_wall, 1)],
                       "bench_warmup_steps_to_steady": b["warmup_steps_to_steady"],
                       "load_average": os.getloadavg()[0]}
                row["cpu_ratio"] = row["bench_cpu_s_per_step"] / row["train_cpu_s_per_step"]
                rows.append(row)
                print(f"gpus={towers} round {r + 1}: seg-bench {row['bench_images_per_sec']:.2f} images/s, seg-train "
                      f"{outside:.2f} (walls {short_wall:.1f} s / {long_wall:.1f} s), ratio {row['ratio']:.2f}; "
                      f"CPU per step {row['bench_cpu_s_per_step']:.2f} vs {row['train_cpu_s_per_step']:.2f} s",
                      file=sys.stderr, flush=True)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print("| towers | round | seg-bench images/s | seg-train images/s (outside) | ratio | CPU s/step bench / train "
          "| ratio | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['gpus']} | {r['round']} | {r['bench_images_per_sec']:.2f} | {r['train_images_per_sec']:.2f} | "
              f"{r['ratio']:.2f} | {r['bench_cpu_s_per_step']:.2f} / {r['train_cpu_s_per_step']:.2f} | "
              f"{r['cpu_ratio']:.2f} | {r['load_average']:.1f} |")
    for towers in sorted({r["gpus"] for r in rows}):
        ratios = [r["ratio"] for r in rows if r["gpus"] == towers]
        print(f"\ngpus={towers}: median ratio {statistics.median(ratios):.2f} over {len(ratios)} round(s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
