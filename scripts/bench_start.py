"""Launch to the end of step 1 against the size of the data set: a first run, a resume and a new run dir.

For each synthetic data set (same image size, --sizes train images each; generated once under --work,
which takes minutes for 20,000), in fresh seg-train processes, one after the other:
  first   an empty run dir and an empty scan cache (every sample decoded by the pre-training scan);
  resume  the same run dir, train.num_steps one higher (the scan's result from the cache);
  newdir  another empty run dir (the cache again);
  nocache the resume again with data.scan_cache: false (what every start cost before the cache).
Each figure is seg-train's own `first step done Xs after launch` (process launch to the end of its first
step), with the scan's own seconds from its log line. No val split (it would only add its own scan).

    python scripts/bench_start.py --sizes 300 20000 [--hw 160 160] [--rounds 2] [--work /tmp/seg-train-start]
    python scripts/bench_start.py --sizes 300 20000 --breakdown    # in-process: what else grows with the data

--breakdown times, in this process, the steps of a start that read every sample's name or file: listing
the split, stat'ing every file for the cache key, reading the entry, and the reader's first batch (its
per-epoch permutation covers every sample). Run it on a quiet machine (see `uptime`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
NO_VAL = "__bench_start_no_val__"
FIRST_STEP = re.compile(r"first step done ([\d.]+)s after launch")
SCANNED = re.compile(r"checked \d+ \S+ \(train\) samples in ([\d.]+)s")
CACHED = re.compile(r"read from the scan cache in ([\d.]+)s")


def data_root(work: Path, n: int, hw) -> Path:
    from seg_train.data import synthetic

    root = work / f"synthetic-{n}-{hw[0]}x{hw[1]}"
    if not (root / ".complete").exists():
        t0 = time.perf_counter()
        synthetic.generate(root, num_train=n, num_val=1, size=tuple(hw), num_classes=5, seed=0)
        print(f"generated {n} images in {time.perf_counter() - t0:.0f}s: {root}", file=sys.stderr, flush=True)
    return root


def write_config(work: Path, root: Path, gpus: int) -> Path:
    raw = {"seed": 0, "data": {"root": str(root), "num_classes": 5, "val_split": NO_VAL, "batch_size": 4 * gpus,
                               "crop_size": [128, 128], "scan_cache_dir": str(work / "scan-cache")},
           "train": {"num_steps": 1, "checkpoint_every": 1000, "summary_every": 1, "image_summary_every": 0}}
    path = work / f"start-{root.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def seg_train(config: Path, run_dir: Path, gpus: int, sets: list[str]) -> dict:
    local = Path(sys.executable).parent / "seg-train"
    cmd = [str(local) if local.exists() else "seg-train", "--config", str(config), "--run-dir", str(run_dir),
           "--gpus", str(gpus)] + [x for s in sets for x in ("--set", s)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"error: seg-train failed with exit {proc.returncode}:\n{proc.stderr[-2000:]}")
    first = FIRST_STEP.search(proc.stderr)
    scan = SCANNED.search(proc.stderr) or CACHED.search(proc.stderr)
    return {"first_step_s": float(first.group(1)), "scan_s": float(scan.group(1)), "wall_s": wall,
            "cached": bool(CACHED.search(proc.stderr)), "load": os.getloadavg()[0]}


def timings(work: Path, root: Path, gpus: int, sets: list[str]) -> dict:
    config = write_config(work, root, gpus)
    shutil.rmtree(work / "scan-cache", ignore_errors=True)
    runs = work / "runs"
    for d in ("a", "b"):
        shutil.rmtree(runs / d, ignore_errors=True)
    out = {"first": seg_train(config, runs / "a", gpus, sets)}
    out["resume"] = seg_train(config, runs / "a", gpus, sets + ["train.num_steps=2"])
    out["newdir"] = seg_train(config, runs / "b", gpus, sets)
    out["nocache"] = seg_train(config, runs / "a", gpus, sets + ["train.num_steps=3", "data.scan_cache=false"])
    return out


def _best(fn, repeat=3) -> float:
    """The fastest of `repeat` calls, seconds (the first may pay for a cold file cache or TF's start)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def breakdown(work: Path, root: Path) -> dict:
    """Seconds of each per-sample step of a start, in this process (best of 3)."""
    from seg_train.cli import set_tf_env_defaults

    set_tf_env_defaults()  # the CPU allocator the commands run on (the environment's choice wins)
    import tensorflow as tf

    from seg_train import config as config_lib
    from seg_train.data import layouts, scan_cache
    from seg_train.data.scan import checker_digest
    from seg_train.data.split import open_split

    cfg = config_lib.load(write_config(work, root, 1))
    samples = layouts.list_samples(cfg.data, "train")
    out = {"list_s": _best(lambda: layouts.list_samples(cfg.data, "train"))}
    checker = checker_digest()
    out["stat_s"] = _best(lambda: scan_cache.Entry.of(work / "scan-cache", samples, 5, 255, checker=checker))
    entry = scan_cache.Entry.of(work / "scan-cache", samples, 5, 255, checker=checker)
    out["entry_found"] = entry.load() is not None
    out["load_entry_s"] = _best(entry.load)
    reader = open_split(cfg, "train").reader
    out["first_batch_s"] = _best(lambda: next(iter(reader.train_dataset(cfg.data.batch_size, end_step=1))))
    # The training order: sample indices of the stream (one argsort of n numbers per epoch), per sample;
    # and by the definition, a fresh permutation of all n samples per sample (what the stream used to do).
    # Counted inside tf.data (reduce), so Python's per-element iteration is not what is timed.
    order = reader.train_order(cfg.data.batch_size).take(10000)
    zero = tf.constant(0, tf.int64)
    out["order_ms_per_sample"] = _best(
        lambda: order.reduce(zero, lambda a, x: a + tf.cast(x[1], tf.int64))) * 1000 / 10000
    indices = tf.data.Dataset.range(1000).map(reader._index_of)
    out["index_of_ms_per_sample"] = _best(
        lambda: indices.reduce(zero, lambda a, x: a + tf.cast(x, tf.int64))) * 1000 / 1000
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[300, 20000], help="train images per data set")
    parser.add_argument("--hw", type=int, nargs=2, default=[160, 160], metavar=("H", "W"))
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default="/tmp/seg-train-start", help="data sets, runs and the scan cache")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    roots = {n: data_root(work, n, args.hw) for n in args.sizes}
    if args.breakdown:
        for n, root in roots.items():
            print(n, {k: round(v, 4) if isinstance(v, float) else v for k, v in breakdown(work, root).items()})
        return 0
    results = {n: [] for n in args.sizes}
    for r in range(args.rounds):
        for n, root in roots.items():
            t = timings(work, root, args.gpus, args.sets)
            results[n].append(t)
            print(f"round {r + 1}, {n} images: " + ", ".join(
                f"{k} {v['first_step_s']:.1f}s (scan {v['scan_s']:.1f}s{', cached' if v['cached'] else ''}, "
                f"load {v['load']:.1f})" for k, v in t.items()), file=sys.stderr, flush=True)
    print("| train images | round | first run s (scan s) | resume s (scan s) | new run dir s (scan s) "
          "| resume without the cache s (scan s) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, rows in results.items():
        for r, t in enumerate(rows, 1):
            print(f"| {n} | {r} | " + " | ".join(f"{t[k]['first_step_s']:.1f} ({t[k]['scan_s']:.2f})"
                                                  for k in ("first", "resume", "newdir", "nocache")) + " |")
    small, large = min(results), max(results)
    for k in ("first", "resume", "newdir", "nocache"):
        a = statistics.median(t[k]["first_step_s"] for t in results[small])
        b = statistics.median(t[k]["first_step_s"] for t in results[large])
        print(f"{k}: {large} images / {small} images = {b:.1f} / {a:.1f} s = {b / a:.2f}x (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
