"""Two worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy) against one process, kills included."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.test_train_cli import demo_root, run, write_config  # noqa: F401  (fixture)


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


def test_two_workers_match_one_process_and_resume(tmp_path, demo_root):  # noqa: F811
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
    for code, err in results:
        assert code == 0 and "resumed from step 2" in err, err
    c = tensors(str(multi / "run" / "checkpoints" / "ckpt-3"))
    assert max(float(np.abs(c[k] - b[k]).max()) for k in weights) > 1e-3


def test_dead_worker_stops_the_other(tmp_path, demo_root):  # noqa: F811
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
