"""Resident-memory soak test of seg-train: RSS over thousands of steps after warm-up.

    python scripts/memory_soak.py [--steps 3000] [--gpus 2] [--run-dir runs/memory-soak]

Runs the real `seg-train` command on the demo data with a small crop (so thousands of steps fit in a
few minutes), samples the process's resident memory (VmRSS) once a second, and prints the RSS after
warm-up (10% of the steps), at the end, and the growth between them.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "memory-soak"))
    args = p.parse_args()
    shutil.rmtree(args.run_dir, ignore_errors=True)
    cmd = [str(Path(sys.executable).with_name("seg-train")), "--config", str(ROOT / "configs" / "demo.yaml"),
           "--gpus", str(args.gpus), "--run-dir", args.run_dir, "--set", f"data.root={ROOT / 'data' / 'demo'}",
           "--set", f"train.num_steps={args.steps}", "--set", "data.crop_size=[48,48]",
           "--set", "train.summary_every=100", "--set", "train.image_summary_every=500",
           "--set", "train.checkpoint_every=1000", "--set", "eval.bn_reestimate_batches=0"]
    print("command:", " ".join(cmd), flush=True)
    log = open(Path(args.run_dir).parent / "memory-soak.log", "w") if Path(args.run_dir).parent.is_dir() else None
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log or subprocess.DEVNULL, text=True)
    samples = []  # (seconds, rss_mb, step)
    t0 = time.time()
    while proc.poll() is None:
        r = rss_mb(proc.pid)
        if r is not None:
            samples.append((time.time() - t0, r))
        time.sleep(1.0)
    if proc.returncode != 0:
        print(f"error: seg-train exited {proc.returncode}", file=sys.stderr)
        return 1
    # Warm-up = the first 10% of the wall time after the first step (tracing, first checkpoint).
    total = samples[-1][0]
    warm = [r for t, r in samples if t >= 0.1 * total]
    after_warmup, end, peak = warm[0], warm[-1], max(r for _, r in samples)
    print(f"steps {args.steps} on {args.gpus} towers in {total:.0f}s; RSS after warm-up {after_warmup:.0f} MB, "
          f"at the end {end:.0f} MB (growth {end - after_warmup:+.0f} MB, "
          f"{100 * (end - after_warmup) / after_warmup:+.1f}%), peak {peak:.0f} MB")
    for frac in (0.1, 0.25, 0.5, 0.75, 1.0):
        t, r = min(samples, key=lambda s: abs(s[0] - frac * total))
        print(f"  t={t:6.0f}s  RSS {r:7.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
