"""The input pipeline alone, two source trees of seg-train against each other (before / after a change).

Each round runs one fresh process per tree, in turn A B, A B, ... (so a change of machine load hits both),
with PYTHONPATH set to the tree. The process times the loop `seg-bench --input-only` times
(seg_train/bench/runner.py `input_throughput`: the reader's training stream, global batches, no model)
and reports images/s, cores busy (its CPU time, all threads, over the wall time of each timed window:
how many cores the pipeline kept busy) and CPU milliseconds per sample (that CPU time over the window's
samples), each the median over the windows. Only `ImageReader.train_dataset`
is used, so a tree from before seg-bench reported cores busy is measured the same way.

    python scripts/bench_input_ab.py --config CFG --trees OLD_TREE NEW_TREE [--rounds 3] [--cpus 0]
        [--steps 3] [--windows 4] [--warmup 2] [--set KEY=VALUE ...]

--cpus 0 pins each process to those CPUs (os.sched_setaffinity), e.g. to see how each tree scales from
one core to all. Prints a Markdown table: per round and tree images/s and cores busy, the ratio B/A of
each round's pair, and the 1-minute load average when each process started.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(args) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from seg_train.cli import set_tf_env_defaults

    set_tf_env_defaults()  # the CPU allocator the commands run on (the environment's choice wins)
    import seg_train
    from seg_train import config as config_lib
    from seg_train.data.split import open_split

    cfg = config_lib.load(args.config, args.set)
    reader = open_split(cfg, cfg.data.train_split).reader
    batch = cfg.data.batch_size
    it = iter(reader.train_dataset(batch, 0, 1))
    for _ in range(args.warmup):
        next(it)
    rates, busy, cpu = [], [], []
    for _ in range(args.windows):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            next(it)
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        rates.append(args.steps * batch / wall)
        busy.append(used / wall)
        cpu.append(1000.0 * used / (args.steps * batch))
    del it  # as input_throughput does: an iterator left to interpreter exit can hang it
    print(json.dumps({"tree": os.path.dirname(os.path.dirname(os.path.abspath(seg_train.__file__))),
                      "images_per_sec": statistics.median(rates), "cores_busy": statistics.median(busy),
                      "cpu_ms_per_sample": statistics.median(cpu), "window_images_per_sec": rates,
                      "window_cores_busy": busy, "window_cpu_ms_per_sample": cpu}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--trees", nargs=2, metavar=("A", "B"), help="two seg-train source trees (repo roots)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpus", help="pin the processes to these CPUs, e.g. 0 or 0,1")
    p.add_argument("--steps", type=int, default=3, help="global batches per timed window")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # inherited by the children
    if args.child:
        child(args)
        return 0
    if not args.trees:
        p.error("--trees A B is required")
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--config", os.path.abspath(args.config),
            "--steps", str(args.steps), "--windows", str(args.windows), "--warmup", str(args.warmup)]
    argv += [f"--set={s}" for s in args.set]
    rows, ratios, cpu_ratios = [], [], []
    for r in range(1, args.rounds + 1):
        pair = []
        for tree in args.trees:
            load = os.getloadavg()[0]
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=False)
            if proc.returncode != 0:
                print(f"error: the run of {tree} failed with exit code {proc.returncode}", file=sys.stderr)
                return 1
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            pair.append(out)
            rows.append(f"| {r} | {out['tree']} | {out['images_per_sec']:.2f} | {out['cores_busy']:.2f} | "
                        f"{out['cpu_ms_per_sample']:.1f} | {load:.2f} |")
        ratios.append(pair[1]["images_per_sec"] / pair[0]["images_per_sec"])
        cpu_ratios.append(pair[0]["cpu_ms_per_sample"] / pair[1]["cpu_ms_per_sample"])
    print("| round | tree | images/s | cores busy | CPU ms/sample | load at start |\n"
          "| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\nB/A per round: {', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}); "
          f"by CPU per sample (A/B): {', '.join(f'{x:.2f}' for x in cpu_ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
