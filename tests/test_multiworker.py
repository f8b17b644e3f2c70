"""Two worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy) against one process, kills included."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import run_command as run
from tests.helpers import write_train_config as write_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_workers(cfg, cwd, extra=()):
    """Starts workers 0 and 1; each one's stderr goes to cwd/worker-<i>.log (read with `log`)."""
    workers = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    procs = []
    for i in range(2):
        with open(cwd / f"worker-{i}.log", "w") as f:
            p = subprocess.Popen([sys.executable, "-m", "seg_train.cli", "--config", str(cfg), "--workers", workers,
                                  "--worker-index", str(i), *extra], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                 stderr=f, text=True)
        p.log = cwd / f"worker-{i}.log"
        procs.append(p)
    return procs


def finish(procs, timeout=300):
    outs = []
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        outs.append((p.returncode, p.log.read_text()))
    return outs


# Where a checkpoint keeps what: Keras 3 tracks a model's weights through the optimizer (only the BN
# moving statistics are under model/), and the optimizer's slots sit beside them.
WEIGHTS = "optimizer/_trainable_variables/"


def tensors(prefix):
    """Every variable of a checkpoint: weights, optimizer slots, BN moving statistics (not the step counters)."""
    r = tf.train.load_checkpoint(prefix)
    return {k: r.get_tensor(k) for k in r.get_variable_to_shape_map()
            if k.endswith("VARIABLE_VALUE") and k.startswith(("model/", "optimizer/")) and "iterations" not in k}


def test_two_workers_match_one_process_and_resume(tmp_path, demo_root):
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir(), multi.mkdir()
    for d in (single, multi):
        write_config(d, demo_root, num_steps=2, checkpoint_every=1, image_summary_every=0, optimizer="sgd",
                     learning_rate=0.1)
    sets = ["--set", "model.sync_batchnorm=true", "--set", "eval.bn_reestimate_batches=0"]
    r = run(["--config", str(single / "cfg.yaml"), "--gpus", "2", *sets], single)
    assert r.returncode == 0, r.stderr
    results = finish(start_workers(multi / "cfg.yaml", multi, sets))
    for code, err in results:
        assert code == 0, err
    assert "multi-worker: task worker:0 of 2 workers" in results[0][1]
    # The pre-training scan: each worker decodes its half of each split, not all of it.
    for i, (_, err) in enumerate(results):
        for what, n in (("train", 12), ("val", 4)):
            assert f"checked {n // 2} {what} ({what}) samples (worker {i}'s share of {n}, 2 workers)" in err, err
    # Only the chief writes to the run dir.
    assert not list((multi / "run").glob("**/*seg-train-worker*"))
    a = tensors(str(single / "run" / "checkpoints" / "ckpt-2"))
    b = tensors(str(multi / "run" / "checkpoints" / "ckpt-2"))
    weights = [k for k in a if k.startswith(WEIGHTS)]
    assert a.keys() == b.keys() and len(weights) > 20 and len(a) > 2 * len(weights)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=k)
    # ... and the group really trained: step 2 moved the weights (two runs that train nothing match too).
    first = tensors(str(multi / "run" / "checkpoints" / "ckpt-1"))
    assert max(float(np.abs(b[k] - first[k]).max()) for k in weights) > 1e-3

    # Both restarted with a longer run: the group resumes from the chief's checkpoint.
    results = finish(start_workers(multi / "cfg.yaml", multi, [*sets, "--set", "train.num_steps=3"]))
    for i, (code, err) in enumerate(results):
        assert code == 0 and "resumed from step 2" in err, err
        # ... and on a resume reads its half from the scan cache.
        assert f"train (train): the scan of 6 samples (worker {i}'s share of 12, 2 workers) read from the scan cache" \
            in err and "checked " not in err, err
    c = tensors(str(multi / "run" / "checkpoints" / "ckpt-3"))
    assert max(float(np.abs(c[k] - b[k]).max()) for k in weights) > 1e-3


def test_dead_worker_stops_the_other(tmp_path, demo_root):
    write_config(tmp_path, demo_root, num_steps=100000, summary_every=1, image_summary_every=0)
    procs = start_workers(tmp_path / "cfg.yaml", tmp_path, ["--set", "eval.bn_reestimate_batches=0",
                                                             "--set", "train.collective_timeout=60"])
    # Wait until the pair trains, then kill worker 1 outright.
    deadline = time.time() + 240
    while time.time() < deadline and "step 3/" not in procs[0].log.read_text() and procs[0].poll() is None:
        time.sleep(0.5)
    assert "step 3/" in procs[0].log.read_text(), procs[0].log.read_text()
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    try:
        procs[0].wait(timeout=150)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving worker hung after its peer died")
    err = procs[0].log.read_text()
    assert time.time() - t0 < 150
    # The documented exit code and message (README: "Training on several machines"), no traceback.
    assert procs[0].returncode == 4, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: a peer worker stopped or cannot be reached ("), err[-2000:]
    assert errors[0].endswith("): the group stops; restart every worker with the same command to resume from the "
                              "newest checkpoint"), errors[0]
    assert "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_a_bad_sample_found_by_one_worker_reaches_every_worker(tmp_path, demo_root, policy):
    """A bad image in worker 1's share of the scan. Wrong answers: worker 1 raising alone while the chief
    waits in a collective (a hang until the timeout, exit 4), the chief training on it, the workers
    dropping different samples, or the chief's log not naming the problem."""
    root = tmp_path / "data"
    shutil.copytree(demo_root, root)
    bad = root / "JPEGImages" / "demo_00001.jpg"  # sample 1 of the split: worker 1 checks samples 1, 3, 5, ...
    bad.write_bytes(b"this is not a JPEG" * 20)
    write_config(tmp_path, root, num_steps=1, image_summary_every=0)
    t0 = time.time()
    results = finish(start_workers(tmp_path / "cfg.yaml", tmp_path, [
        "--set", f"data.on_bad_sample={policy}", "--set", "eval.bn_reestimate_batches=0",
        "--set", "train.collective_timeout=60"]), timeout=240)
    message = f"unreadable image ({bad}): expected a valid JPEG/PNG ("
    for i, (code, err) in enumerate(results):
        assert "checked 6 train (train) samples (worker %d's share of 12, 2 workers) in" % i in err, err
        if policy == "error":
            errors = [line for line in err.splitlines() if line.startswith("error: ")]
            assert code == 2 and len(errors) == 1 and errors[0].startswith("error: " + message), err[-3000:]
        else:
            assert code == 0, err[-3000:]
            assert "skipping bad sample (data.on_bad_sample: skip): " + message in err, err
            assert re.search(r"training \S+ on 2 tower\(s\): 11 images,", err), err  # the same 11 on both
    assert time.time() - t0 < 200
