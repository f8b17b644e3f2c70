"""A command exits within seconds of its last line, whatever TensorFlow's iterator teardown costs.

Destroying a tf.data iterator can block the destroying thread with nothing left to do: on busy
cores for up to a minute per iterator (TensorFlow's autotuning thread misses its cancellation and
sleeps out its period; seg_train/data/feed.py), and as long as the decode calls in flight after a
stop mid-stream. seg-train used to destroy its iterators on its own thread, so it sat silent after
`done` (docs/PERFORMANCE.md, "Last line to exit").

That race cannot be provoked on demand, so a driver gives every iterator a destruction that blocks
its thread for SLOW_DESTROY = 20 s (a finalizer that sleeps, releasing the GIL as TensorFlow's
destructor does) and records which thread ran it. Each command runs as a user runs it and is timed
from OUTSIDE, from its last line (stdout or stderr) to its exit, which must take under
SLOW_DESTROY / 2 = 10 s: one iterator destroyed by the command itself after its last line costs 20 s
(the 2-tower training iterator is three: 60 s, as the unfixed code took), while releasing them
costs the fixed code well under a second. No iterator may be destroyed by the main thread at all:
that catches a stall before the last line too (seg-eval's precise-BN and evaluation iterators).
The last test counts what precise BN decodes: exactly its batches, nothing ahead of them.
The unfixed code fails every test (the timed ones after minutes); the fixed code takes ~1 min for
the file on this 2-core machine (a tiny model, a few steps).
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
from tests.helpers import SLOW_DESTROY, SLOW_TEARDOWN, destructions
from tests.helpers import write_train_config as write_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

TIMEOUT = 600  # the unfixed code: 20 s per iterator destroyed on the way, a few minutes in all


DRIVER = SLOW_TEARDOWN + r'''
import sys
sys.exit(getattr(cli, sys.argv.pop(1))())
'''


def timed(tmp_path, command: str, args: list[str], stop_at: str | None = None):
    """Runs `command` (a seg_train.cli entry point) through the driver; returns (exit code, output lines,
    seconds from the last line to the exit, the record of destructions). stop_at: a regex; SIGTERM is
    sent when a stderr line matches."""
    import re

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    record = tmp_path / f"{command}-{time.monotonic_ns()}.destroyed"
    env = dict(os.environ, PYTHONUNBUFFERED="1", SLOW_DESTROY=str(SLOW_DESTROY),
               DESTROY_RECORD=str(record))
    proc = subprocess.Popen([sys.executable, str(driver), command, *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, last, signalled = [], [time.monotonic()], []
    lock = threading.Lock()

    def pump(stream, is_err):
        for line in stream:
            with lock:
                lines.append(line.rstrip("\n"))
                last[0] = time.monotonic()
            if is_err and stop_at and not signalled and re.search(stop_at, line):
                signalled.append(line)
                proc.send_signal(signal.SIGTERM)  # once: a second signal would stop it at once

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
    return rc, lines, exited - last[0], record


def check(command: str, rc: int, lines: list[str], gap: float, record, code: int, expected: str) -> None:
    out = "\n".join(lines)
    assert rc == code, out
    assert expected in out, out
    assert gap < SLOW_DESTROY / 2, f"{command} exited {gap:.1f} s after its last line:\n{out}"
    on_main = [kind for kind, thread in destructions(record) if thread == "MainThread"]
    assert not on_main, f"iterators destroyed by the command's own thread: {on_main}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_root):
    """seg-train on 2 towers to its end (the last step evaluates: precise BN, evaluation), timed."""
    tmp, root = tmp_path_factory.mktemp("exitprompt"), demo_root
    cfg = write_config(tmp, root, num_steps=3, checkpoint_every=3, image_summary_every=0)
    return tmp, root, cfg, timed(tmp, "train_main", ["--config", str(cfg), "--gpus", "2"])


def test_train_done_exits_promptly(trained):
    *_, (rc, lines, gap, record) = trained
    check("seg-train", rc, lines, gap, record, 0, "done: step 3")
    # The model of the teardown was in force: the iterators of the last step's evaluation were released.
    assert any(thread == "seg-train-release" for _, thread in destructions(record))


def test_eval_exits_promptly(trained):
    tmp, _, cfg, _ = trained
    check("seg-eval", *timed(tmp, "eval_main", ["--config", str(cfg), "--gpus", "2", "--checkpoint", "run"]), 0,
          "images, step 3: mIoU")


def test_eval_stopped_by_a_bad_image_exits_promptly(trained):
    """A user error mid-stream (an unreadable val image, the evaluation's second step): the iterator
    raising it is still decoding ahead, and the Feed owning it lives in the exception's frames until
    the error is reported."""
    tmp, _, cfg, _ = trained
    bad = synthetic.generate(tmp / "bad", num_train=12, num_val=4, size=(40, 48), num_classes=3)
    third = bad.joinpath("ImageSets", "Segmentation", "val.txt").read_text().split()[2]
    (bad / "JPEGImages" / f"{third}.jpg").write_bytes(b"not a JPEG" * 20)
    check("seg-eval", *timed(tmp, "eval_main", ["--config", str(cfg), "--gpus", "2", "--checkpoint", "run",
                                                "--set", f"data.root={bad}"]), 2,
          f"error: unreadable image ({bad}")


def test_train_stopped_by_a_signal_exits_promptly(tmp_path, trained):
    """SIGTERM mid-run: the step finishes, a checkpoint is written, the training iterator (decoding
    ahead) is released."""
    _, root, _, _ = trained
    cfg = write_config(tmp_path, root, num_steps=200, checkpoint_every=100, image_summary_every=0)
    check("seg-train", *timed(tmp_path, "train_main", ["--config", str(cfg), "--gpus", "1"], stop_at=r"step 2/200\b"),
          128 + signal.SIGTERM, "interrupted by SIGTERM at step")


def test_precise_bn_decodes_only_the_batches_it_uses(tmp_path, demo_root):
    """Nothing is decoded for nothing: the re-estimation's stream ends with its batches, so its teardown
    has no work in flight (a stream cut after its prefetch decoded ahead of the batches it used)."""
    from seg_train.infer import precise_bn
    from seg_train.parallel import replicas
    from seg_train.run.state import TrainState
    from tests.helpers import open_reader, tiny_config

    cfg = tiny_config(tmp_path, demo_root, data={"batch_size": 4, "cache": True})  # every decode through Python
    state = TrainState(cfg, replicas.make_strategy(replicas.Devices(["/device:CPU:0"], "CPU", "test")))
    reader = open_reader(cfg, "train")
    decoded, decode = [], reader._decode_py
    reader._decode_py = lambda index: (decoded.append(int(index)), decode(index))[1]
    assert precise_bn.PreciseBN(state).reestimate(reader, 3, progress=False)
    assert len(decoded) == 3 * 4, decoded
