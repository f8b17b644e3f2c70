"""seg-train run in a fresh process: the first step as a user meets it, and the run's peak memory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cli_probe(config_path: str, overrides: list[str], towers: int, steps: int = 1, timeout: float = 3600) -> dict:
    """Runs seg-train for `steps` steps (no evaluation, scratch run dir) and reads its first-step record:
    seconds from launch to the first step's end, tracing, first call, and peak resident memory."""
    from seg_train.run.rundir import FIRST_STEP_FILE

    run_dir = tempfile.mkdtemp(prefix="seg-bench-probe-")
    sets = list(overrides) + [f"train.num_steps={steps}", "data.val_split=__seg_bench_no_val__",
                              "train.image_summary_every=0", f"train.summary_every={steps}",
                              f"train.checkpoint_every={steps}"]
    cmd = [sys.executable, "-m", "seg_train.cli", "--config", str(config_path), "--gpus", str(towers),
           "--run-dir", run_dir] + [x for o in sets for x in ("--set", o)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        try:
            record = json.loads((Path(run_dir) / FIRST_STEP_FILE).read_text())
        except (OSError, ValueError):
            record = None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if proc.returncode != 0 or record is None:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"seg-train probe ({' '.join(cmd)}) failed with exit {proc.returncode}: {tail}")
    return {"first_step_s": float(record["first_step_s"]), "tracing_s": float(record["tracing_s"]),
            "first_call_s": float(record["first_call_s"]), "peak_rss_mb": record.get("peak_rss_mb"),
            "process_wall_s": time.time() - t0, "steps": steps}
