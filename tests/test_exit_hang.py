"""A command that stops while its tf.data pipeline is still decoding exits with its code instead of hanging.

The reader decodes in Python (tf.numpy_function). When a command ended with a prefetching distributed
iterator still alive (an error mid-run, Ctrl-C), the iterator was destroyed during interpreter
shutdown: its destructor waits for the decode calls in flight, and Python ends any thread that asks
for the GIL once shutdown has begun, so those calls never finished and the process hung after
printing its error line. seg-bench showed it: its runners keep their iterators in a reference cycle,
so they die only in the collection that shutdown runs. seg_train/cli/process.py ends the process itself.

A small driver slows the decode (as a slow disk would), so decode calls are always in flight when
the error arrives, and makes every iterator's destruction slow (tests/test_exit_prompt.py): seg-bench
must close its runners on the way out without destroying their iterators on its own thread. The
user error comes from real input: a bad sample reached after the warm-up (exit 2); the internal
error is raised by the driver right after a step (exit 1), as the AttributeError that first showed
the hang was. Without the fix both runs time out; with it each takes ~10-15 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from seg_train.data import synthetic
from tests.helpers import SLOW_DESTROY, SLOW_TEARDOWN, destructions

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

HANG_TIMEOUT = 120  # a run takes ~10 s; far above that means it hung at exit
BAD = "demo_00005"  # with seed 0 the training stream reaches it at step 3, after the warm-up's two steps

DRIVER = SLOW_TEARDOWN + r'''
import sys, time
from seg_train.bench import train_runner
from seg_train.data import reader

decode = reader.ImageReader._decode_uncached


def slow_decode(self, index):
    time.sleep(0.05)
    return decode(self, index)


reader.ImageReader._decode_uncached = slow_decode
if sys.argv.pop(1) == "internal":
    step, calls = train_runner.TrainRunner.step, []

    def failing_step(self):
        out = step(self)
        calls.append(1)
        if len(calls) == 3:  # the first step after the warm-up, its successor's batch being decoded
            raise AttributeError("'TrainRunner' object has no attribute 'injected_for_the_test'")
        return out

    train_runner.TrainRunner.step = failing_step
from seg_train.cli import bench_main
sys.exit(bench_main())
'''


@pytest.fixture(scope="module")
def bench_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exithang")
    good = synthetic.generate(tmp / "good", num_train=12, num_val=4, size=(40, 48), num_classes=3)
    bad = synthetic.generate(tmp / "bad", num_train=12, num_val=4, size=(40, 48), num_classes=3)
    (bad / "JPEGImages" / f"{BAD}.jpg").write_bytes(b"this is not a JPEG" * 20)
    raw = {"seed": 0, "run_dir": "run",
           "data": {"root": str(good), "num_classes": 3, "batch_size": 4, "crop_size": [32, 32],
                    "num_parallel_calls": 2},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4}}
    config = tmp / "cfg.yaml"
    config.write_text(yaml.safe_dump(raw))
    (tmp / "driver.py").write_text(DRIVER)
    return tmp


@pytest.mark.parametrize("kind, code, message", [
    ("user", 2, rf"^error: unreadable image \(.*{BAD}\.jpg\): expected a valid JPEG/PNG"),
    ("internal", 1, r"^error: internal error \(AttributeError\): .*injected_for_the_test"),
])
def test_bench_error_mid_run_exits(bench_setup, tmp_path, kind, code, message):
    tmp = bench_setup
    data_root = tmp / ("bad" if kind == "user" else "good")
    # TMPDIR: a folder of this test's own, to see that the clean-up Python does at exit still happens
    # (seg-bench's scratch summaries folder, autograph's generated modules).
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    record = tmp_path / "destroyed"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(scratch), SLOW_DESTROY=str(SLOW_DESTROY),
               DESTROY_RECORD=str(record))
    args = ["--config", str(tmp / "cfg.yaml"), "--set", f"data.root={data_root}", "--gpus", "2", "--steps", "4",
            "--windows", "1", "--warmup", "1", "--no-probes", "--no-peak", "--no-input-alone", "--bn-images", "0",
            "--eval-images", "0"]
    try:
        r = subprocess.run([sys.executable, str(tmp / "driver.py"), kind, *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=HANG_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"seg-bench hung at exit after its error (no exit within {HANG_TIMEOUT} s); stderr:\n{err}")
    lines = r.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert r.returncode == code, r.stderr
    assert len(errors) == 1 and re.search(message, lines[errors[0]]), r.stderr
    # Mid-run: the error comes after the warm-up, with the iterators alive and decoding.
    assert any(re.search(r"gpus=2: first step [0-9.]+s", line) for line in lines[:errors[0]]), r.stderr
    assert sorted(p.name for p in scratch.iterdir()) == [], "clean-up at exit skipped"
    on_main = [kind for kind, thread in destructions(record) if thread == "MainThread"]
    assert not on_main, f"iterators destroyed by seg-bench's own thread: {on_main}"


PROMISES = r'''
import argparse, sys
import numpy as np
import tensorflow as tf
from seg_train import cli


def main(args):
    writer = tf.summary.create_file_writer(sys.argv[1])
    writer.cycle = writer  # alive until a garbage collection, as seg-bench's runners are
    with writer.as_default(step=1):
        tf.summary.scalar("kept", 1.5)
        tf.summary.image("picture", np.zeros((2, 64, 64, 3), np.uint8), max_outputs=2)
    print("on stdout", end="")  # a pipe: block-buffered, no newline
    return 3


sys.exit(cli.run_guarded(main, argparse.Namespace(), end_process=True))
'''


def test_ending_the_process_keeps_what_a_normal_exit_writes(tmp_path):
    """What a user needs from a normal exit: the events of a tf.summary writer never flushed (in a
    reference cycle, so never destroyed either) are in its file, buffered stdout is written, the
    command's exit code is the process's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    r = subprocess.run([sys.executable, "-c", PROMISES, str(tmp_path / "events")], env=env, capture_output=True,
                       text=True, timeout=HANG_TIMEOUT)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "on stdout"
    acc = EventAccumulator(str(tmp_path / "events"), size_guidance={"tensors": 0})
    acc.Reload()
    assert {"kept", "picture"} <= set(acc.Tags()["tensors"]), acc.Tags()
