"""A command exits within seconds of its last line, whatever TensorFlow's iterator teardown costs.

Destroying a tf.data iterator can block the destroying thread with nothing left to do: on busy
cores for up to a minute per iterator (TensorFlow's autotuning thread misses its cancellation and
sleeps out its period; seg_train/data/feed.py), and as long as the decode calls in flight after a
stop mid-stream. seg-train used to destroy its iterators on its own thread: after `done`, 8-60 s
per iterator beside two CPU-bound processes (docs/PERFORMANCE.md, "Last line to exit").

That race cannot be provoked on demand, so a driver gives every iterator a destruction that blocks
its thread for SLOW_DESTROY = 20 s (a finalizer that sleeps, releasing the GIL as TensorFlow's
destructor does) and records which thread ran it. Each command runs as a user runs it and is timed
from OUTSIDE, from its last line (stdout or stderr) to its exit, which must take under
SLOW_DESTROY / 2 = 10 s: one iterator destroyed by the command itself after its last line costs 20 s
(the 2-tower training iterator is three: 60 s, as the unfixed code took), while releasing them
costs the fixed code well under a second. No iterator may be destroyed by the main thread at all:
that catches a stall before the last line too (seg-eval's precise-BN and evaluation iterators).
Each run takes ~15-25 s here (a tiny model, 2 towers, a few steps); the unfixed code takes
minutes and fails every test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from seg_train.data import synthetic
from tests.test_train_cli import write_config

SLOW_DESTROY = 20.0
TIMEOUT = 600  # the unfixed code: 20 s per iterator destroyed on the way, a few minutes in all

# Makes every tf.data iterator's destruction slow and records the thread that ran it (module doc).
# Patched when the command imports TensorFlow, as the command imports it.
SLOW_TEARDOWN = r'''
import os, threading, time, weakref
from seg_train import cli


def _slow_teardown():
    from tensorflow.python.data.ops import iterator_ops, multi_device_iterator_ops

    seconds, record = float(os.environ["SLOW_DESTROY"]), os.environ["DESTROY_RECORD"]

    def destroyed(kind):
        with open(record, "a") as f:
            f.write(f"{kind} {threading.current_thread().name}\n")
        time.sleep(seconds)

    for cls in (iterator_ops.OwnedIterator, multi_device_iterator_ops.OwnedMultiDeviceIterator):
        def __init__(self, *args, _init=cls.__init__, _kind=cls.__name__, **kwargs):
            _init(self, *args, **kwargs)
            # Iterators alive when the process ends are never destroyed (os._exit): nor are these.
            weakref.finalize(self, destroyed, _kind).atexit = False
        cls.__init__ = __init__


_import_tensorflow = cli.import_tensorflow


def import_tensorflow(debug):
    tf = _import_tensorflow(debug)
    _slow_teardown()
    return tf


cli.import_tensorflow = import_tensorflow
'''

DRIVER = SLOW_TEARDOWN + r'''
import sys
command = sys.argv.pop(1)
if os.environ.get("INJECT_ERROR_AT_STEP"):
    from seg_train import loop
    finish, at = loop.HostSide.finish, int(os.environ["INJECT_ERROR_AT_STEP"])

    def failing_finish(self, pending, ended=None):
        if pending[0] == at:  # a bug in the host side of a step, mid-run: the next step's batch in flight
            raise AttributeError("'HostSide' object has no attribute 'injected_for_the_test'")
        return finish(self, pending, ended)

    loop.HostSide.finish = failing_finish
sys.exit(getattr(cli, command)())
'''


def destructions(record) -> list[tuple[str, str]]:
    """(iterator class, thread name) of each destruction the driver saw."""
    return [tuple(line.split()) for line in record.read_text().splitlines()] if record.exists() else []


def timed(tmp_path, command: str, args: list[str], stop_at: str | None = None, env_extra: dict | None = None):
    """Runs `command` (a seg_train.cli entry point) through the driver; returns (exit code, output lines,
    seconds from the last line to the exit). stop_at: a regex; SIGTERM is sent when a stderr line matches."""
    import re

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONUNBUFFERED="1", SLOW_DESTROY=str(SLOW_DESTROY),
               DESTROY_RECORD=str(tmp_path / f"{command}.destroyed"), **(env_extra or {}))
    proc = subprocess.Popen([sys.executable, str(driver), command, *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, last = [], [time.monotonic()]
    lock = threading.Lock()

    def pump(stream, is_err):
        for line in stream:
            with lock:
                lines.append(line.rstrip("\n"))
                last[0] = time.monotonic()
            if is_err and stop_at and re.search(stop_at, line):
                proc.send_signal(signal.SIGTERM)

    pumps = [threading.Thread(target=pump, args=(proc.stdout, False)),
             threading.Thread(target=pump, args=(proc.stderr, True))]
    for p in pumps:
        p.start()
    try:
        rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{command} did not exit within {TIMEOUT} s; output:\n" + "\n".join(lines))
    exited = time.monotonic()
    for p in pumps:
        p.join()
    return rc, lines, exited - last[0]


def check(tmp_path, command: str, rc: int, code: int, lines: list[str], gap: float, expected_last: str) -> None:
    out = "\n".join(lines)
    assert rc == code, out
    assert expected_last in out, out
    assert gap < SLOW_DESTROY / 2, f"{command} exited {gap:.1f} s after its last line:\n{out}"
    seen = destructions(tmp_path / f"{command}.destroyed")
    on_main = [kind for kind, thread in seen if thread == "MainThread"]
    assert not on_main, f"iterators destroyed by the command's own thread: {on_main}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """seg-train on 2 towers to its end (the last step evaluates: precise BN, evaluation), timed."""
    tmp = tmp_path_factory.mktemp("exitprompt")
    root = synthetic.generate(tmp / "demo", num_train=12, num_val=4, size=(40, 48), num_classes=3)
    cfg = write_config(tmp, root, num_steps=3, checkpoint_every=3, image_summary_every=0)
    rc, lines, gap = timed(tmp, "train_main", ["--config", str(cfg), "--gpus", "2"])
    return tmp, root, cfg, rc, lines, gap


def test_train_done_exits_promptly(trained):
    tmp, _, _, rc, lines, gap = trained
    check(tmp, "train_main", rc, 0, lines, gap, "done: step 3")
    # The model of the teardown was in force: the iterators of the last step's evaluation were released.
    assert any(thread == "seg-train-release" for _, thread in destructions(tmp / "train_main.destroyed"))


def test_eval_exits_promptly(trained):
    tmp, _, cfg, *_ = trained
    rc, lines, gap = timed(tmp, "eval_main", ["--config", str(cfg), "--gpus", "2", "--checkpoint", "run"])
    check(tmp, "eval_main", rc, 0, lines, gap, "images, step 3: mIoU")


@pytest.mark.parametrize("way_out", ["sigterm", "internal_error"])
def test_train_stopped_mid_run_exits_promptly(tmp_path, trained, way_out):
    """A stop mid-stream: the training iterator is still decoding ahead when it is released."""
    _, root, _, *_ = trained
    cfg = write_config(tmp_path, root, num_steps=200, checkpoint_every=100, image_summary_every=0)
    args = ["--config", str(cfg), "--gpus", "1"]  # one tower: cheaper, the same way out
    if way_out == "sigterm":
        rc, lines, gap = timed(tmp_path, "train_main", args, stop_at=r"step 2/200\b")
        check(tmp_path, "train_main", rc, 128 + signal.SIGTERM, lines, gap, "interrupted by SIGTERM at step")
    else:
        rc, lines, gap = timed(tmp_path, "train_main", args, env_extra={"INJECT_ERROR_AT_STEP": "2"})
        check(tmp_path, "train_main", rc, 1, lines, gap, "error: internal error (AttributeError)")
