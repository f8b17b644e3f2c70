"""Interrupting seg-train: a first SIGINT/SIGTERM finishes the step and checkpoints (tests/test_robustness.py);
a second one ends the process at once, even in the middle of a TensorFlow call, with 128 + its number."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import tensorflow as tf

from tests.helpers import write_train_config as write_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

# A TensorFlow call that runs far longer than the test waits: the main thread sits inside it, where
# no Python signal handler can run, until the process is stopped.
SLOW_CALL = textwrap.dedent("""
    import sys, time
    import tensorflow as tf
    from seg_train.train.train import _StopSignals

    @tf.function
    def slow(n):
        return tf.while_loop(lambda i, x: i < n, lambda i, x: (i + 1, x * 0.999 + 1.0),
                             (tf.constant(0, tf.int64), tf.constant(0.0)))[1]

    slow.get_concrete_function(tf.TensorSpec([], tf.int64))  # traced before the signals
    with _StopSignals() as stop:
        print("calling", flush=True)
        slow(tf.constant(10**10, tf.int64))
        print("returned", stop.signum, flush=True)
""")


def test_second_signal_stops_inside_a_tensorflow_call(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout.readline() == "calling\n"
        time.sleep(1.0)  # well inside the call
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # the first signal only asks to stop after the call
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        seconds = time.monotonic() - t0
        out, err = proc.communicate()
    finally:
        watchdog.cancel()
        proc.kill()
    # 128 + the second signal, not 130 for whatever came second (KeyboardInterrupt), and not after the call.
    assert rc == 128 + signal.SIGTERM, (rc, err)
    assert "returned" not in out and seconds < 30, (out, seconds)
    assert "received SIGINT: finishing this step, then writing a checkpoint" in err, err
    assert ("error: interrupted again (SIGTERM after SIGINT): stopped at once, no checkpoint for the step in "
            "progress; rerun the same command to resume from the newest checkpoint") in err, err
    assert "Traceback" not in err, err


def test_sigterm_then_sigint_through_the_command(tmp_path, demo_root):
    """Both signals at once, mid-run: exit 128 + the second one's number, the newest checkpoint complete
    and readable, the lock file left with the pid (no clean-up ran) for the next run to take over.

    Sent back to back, the two may be handled in either order (Linux delivers pending standard signals
    lowest number first, so SIGINT can overtake SIGTERM); the exit code and the message must name the
    same order."""
    cfg = write_config(tmp_path, demo_root, num_steps=500, checkpoint_every=2, image_summary_every=0)
    proc = subprocess.Popen([sys.executable, "-m", "seg_train.cli", "--config", str(cfg), "--gpus", "2"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if re.search(r"step 3/500\b", line):
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGINT)
                break
        lines += proc.stderr.readlines()
        rc = proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        proc.kill()
    err = "".join(lines)
    m = re.search(r"error: interrupted again \((SIGINT|SIGTERM) after (SIGINT|SIGTERM)\): stopped at once", err)
    assert m and m.group(1) != m.group(2), err
    assert f"received {m.group(2)}: finishing this step, then writing a checkpoint" in err, err
    assert rc == 128 + getattr(signal, m.group(1)), err
    assert "Traceback" not in err, err
    ckdir = tmp_path / "run" / "checkpoints"
    newest = tf.train.latest_checkpoint(str(ckdir))
    assert newest is not None and int(newest.rsplit("-", 1)[1]) >= 2, newest
    reader = tf.train.load_checkpoint(newest)
    for key in reader.get_variable_to_shape_map():
        reader.get_tensor(key)  # every tensor of the newest checkpoint reads back
    assert (tmp_path / "run" / "train.lock").read_text() == str(proc.pid)
