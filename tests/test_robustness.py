"""Through the real command: exact, crash-safe resume and clean handling of bad input.

- SIGTERM mid-run -> exit 143 with a checkpoint; the rerun resumes from the newest complete checkpoint
  (the lock a killed trainer leaves is taken over, partial checkpoint files are ignored); the end result
  is bitwise equal (weights AND optimizer slots) to an uninterrupted run.
- One trainer per run dir; config changes on resume refused unless harmless.
- Bad input: one `error: <what> (<where>): <expected>` line on stderr, exit 2, no traceback, and an
  existing run dir left byte-for-byte unchanged (no event file created, nothing appended).
- Non-finite losses: exit 3 naming the step and tower(s), or `train.on_nan: skip_step`; never a
  non-finite tensor in a checkpoint.

Cost: TensorFlow start-up and tracing take ~15-25 s per process on a small CPU, so
- processes that must be separate (the uninterrupted baseline and the SIGTERM -> resume chain, whose
  signal and exit codes are the point) are real subprocesses;
- config errors are rejected before TensorFlow is imported: one fast subprocess each;
- every other case (data errors, lock, config changes, a corrupt checkpoint, NaN runs) runs in ONE
  helper process that imports TensorFlow once and calls the console entry point
  `seg_train.cli.train_main(argv)` once per case (its return value is the exit code of the
  `seg-train` script), capturing stderr (see _DRIVER and the `batch` fixture).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml

from tests.helpers import BAD_TARGET as TARGET
from tests.helpers import DATA_CASES, ckpt_dir, error_lines, rewind, truncate
from tests.helpers import ROBUSTNESS_STEPS as STEPS
from tests.helpers import bad_roots as _bad_roots
from tests.helpers import write_voc_config as write_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

ERROR_LINE = re.compile(r"^error: [^()\n]+ \(.+\): .+$")


# ---- helpers -------------------------------------------------------------------------------------------
def _env():
    return dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")


def cli(args, cwd, timeout=600):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "seg_train.cli", *map(str, args)], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=timeout, check=False)
    r.seconds = time.perf_counter() - t0
    return r


def run_until(args, cwd, pattern, sig, timeout=600):
    """Runs seg-train, sends `sig` at the first stderr line matching `pattern`; returns (exit code, stderr, pid)."""
    proc = subprocess.Popen([sys.executable, "-m", "seg_train.cli", *map(str, args)], cwd=cwd, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, bufsize=1)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines, sent = [], False
    try:
        for line in proc.stderr:
            lines.append(line)
            if not sent and re.search(pattern, line):
                proc.send_signal(sig)
                sent = True
        rc = proc.wait()
    finally:
        watchdog.cancel()
    text = "".join(lines)
    assert sent, f"never saw {pattern!r}:\n{text}"
    return rc, text, proc.pid


def assert_user_error(rc, stderr, expected: str):
    assert rc == 2, f"exit {rc}:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, f"expected one error line:\n{stderr}"
    assert lines[0].startswith(expected), f"expected {expected!r}, got:\n{stderr}"
    assert ERROR_LINE.match(lines[0]), lines[0]
    assert "object at 0x" not in stderr, stderr  # a Python repr (tests/test_error_lines.py has the whole corpus)


def tree_hash(directory: Path) -> dict:
    """Every file (sha256) and folder under `directory`."""
    out = {}
    for p in sorted(Path(directory).rglob("*")):
        rel = str(p.relative_to(directory))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def latest_step(run_dir: Path) -> int | None:
    latest = tf.train.latest_checkpoint(str(ckpt_dir(run_dir)))
    return int(latest.rsplit("-", 1)[1]) if latest else None


def assert_bitwise_equal(prefix_a, prefix_b):
    ra, rb = tf.train.load_checkpoint(str(prefix_a)), tf.train.load_checkpoint(str(prefix_b))
    keys = sorted(ra.get_variable_to_shape_map())
    assert keys == sorted(rb.get_variable_to_shape_map())
    values = [k for k in keys if "VARIABLE_VALUE" in k]
    assert len(values) > 50 and any(k.startswith("optimizer/") for k in values), values
    for k in keys:
        if k.startswith("save_counter/"):  # how many times save() was called, not training state
            continue
        a, b = ra.get_tensor(k), rb.get_tensor(k)
        if isinstance(a, bytes):  # the object graph proto
            assert a == b, k
            continue
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert a.tobytes() == b.tobytes(), f"{k} differs (max |diff| {np.max(np.abs(a.astype(float) - b)):.3g})"


def checkpoint_prefixes(run_dir: Path) -> list[str]:
    return sorted(str(p)[: -len(".index")] for p in ckpt_dir(run_dir).glob("ckpt-*.index"))


def nonfinite_tensors(prefix: str) -> list[str]:
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    return [k for k in dtypes if dtypes[k].is_floating and not np.all(np.isfinite(reader.get_tensor(k)))]


def clone(run_dir: Path, dest: Path, root: Path) -> Path:
    """A copy of a run dir at dest/run with its command's config at dest/cfg.yaml."""
    shutil.copytree(run_dir, dest / "run")
    write_config(dest, root)
    return dest / "run"


# ---- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline(tmp_path_factory, demo_root):
    """An uninterrupted deterministic 2-tower run of STEPS steps (checkpoints 2, 4, 6)."""
    d = tmp_path_factory.mktemp("baseline")
    r = cli(["--config", write_config(d, demo_root), "--gpus", 2], d)
    print(f"baseline run: {r.seconds:.1f}s")
    assert r.returncode == 0, r.stderr
    assert latest_step(d / "run") == STEPS
    return d / "run"


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, baseline, demo_root):
    """A run dir that stopped at step 4 of 6 (its command would resume): the bad-input target."""
    run_dir = clone(baseline, tmp_path_factory.mktemp("stopped"), demo_root)
    rewind(run_dir, 4)
    return run_dir


# One process, TensorFlow imported once, the CLI entry point called once per case.
_DRIVER = r'''
import contextlib, hashlib, io, json, sys, time, traceback
from pathlib import Path

def tree(d):
    return {str(p.relative_to(d)): "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(d).rglob("*"))}

cases = json.loads(Path(sys.argv[1]).read_text())
from seg_train import cli
results = {}
for case in cases:
    before = tree(case["unchanged"]) if case.get("unchanged") else None
    buf, t0 = io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stderr(buf):
            rc = cli.train_main(case["argv"])
    except BaseException as e:  # a crash of the entry point itself is a test failure, not a driver failure
        rc = f"raised {type(e).__name__}"
        buf.write(traceback.format_exc())
    results[case["name"]] = {"rc": rc, "stderr": buf.getvalue(), "seconds": time.perf_counter() - t0,
                             "before": before, "after": tree(case["unchanged"]) if before is not None else None}
    Path(sys.argv[2]).write_text(json.dumps(results))  # after every case: a hard crash keeps the rest
'''


@pytest.fixture(scope="module")
def batch(tmp_path_factory, baseline, stopped_run, demo_root):
    """Runs every in-process case in one helper process; returns {case name: result}."""
    base = tmp_path_factory.mktemp("batch")
    roots = _bad_roots(base / "roots", demo_root)
    cfg = stopped_run.parent / "cfg.yaml"
    cases = []

    def case(name, argv, unchanged=None):
        cases.append({"name": name, "argv": [str(a) for a in argv], "unchanged": str(unchanged) if unchanged else None})

    # Bad data and flags on the stopped run (each must leave it byte-for-byte unchanged).
    case("root_missing", ["--config", cfg, "--gpus", 2, "--set", f"data.root={base / 'no' / 'such' / 'root'}"],
         stopped_run)
    for name, root in roots.items():
        case(name, ["--config", cfg, "--gpus", 2, "--set", f"data.root={root}"], stopped_run)
    case("batch_indivisible", ["--config", cfg, "--gpus", 2, "--set", "data.batch_size=3"], stopped_run)
    # Config changes that change what the checkpoint means.
    case("config_changed", ["--config", cfg, "--gpus", 2, "--set", "data.num_classes=4",
                            "--set", "data.class_names=[a, b, c, d]", "--set", "model.aspp_channels=16",
                            "--set", "data.batch_size=2"], stopped_run)
    case("shorter_run", ["--config", cfg, "--gpus", 2, "--set", "train.num_steps=3"], stopped_run)

    # A run dir in use: this test process holds the flock, as a running trainer would.
    held = clone(baseline, base / "held", demo_root)
    rewind(held, 4)
    case("lock_held", ["--config", held.parent / "cfg.yaml", "--gpus", 2], held)

    # A finished run whose state file points at newer checkpoints whose files are truncated
    # (disk full / killed copy): skipped with a warning, the newest complete one is used.
    corrupt = clone(baseline, base / "corrupt", demo_root)
    d = ckpt_dir(corrupt)
    for k, part in ((7, "data-00000-of-00001"), (8, "index")):
        for suffix in ("index", "data-00000-of-00001"):
            shutil.copy(d / f"ckpt-{STEPS}.{suffix}", d / f"ckpt-{k}.{suffix}")
        truncate(d / f"ckpt-{k}.{part}")
    tf.compat.v1.train.update_checkpoint_state(str(d), str(d / "ckpt-8"),
                                               [str(d / f"ckpt-{k}") for k in (2, 4, 6, 7, 8)])
    case("corrupt_newest", ["--config", corrupt.parent / "cfg.yaml", "--gpus", 2])

    # Harmless changes on resume, a stale lock (dead pid) and a bad sample skipped: one run.
    stale = clone(baseline, base / "stale", demo_root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (stale / "train.lock").write_text(str(dead.pid))
    case("harmless", ["--config", stale.parent / "cfg.yaml", "--gpus", 1, "--set", "train.summary_every=2",
                      "--set", f"train.num_steps={STEPS + 2}", "--set", "data.on_bad_sample=skip",
                      "--set", f"data.root={roots['jpeg_truncated']}", "--set", "data.val_split=none"])

    # Non-finite losses: Adam with a huge learning rate blows the weights up at step 1, so step 2's
    # loss is non-finite.
    nan_cfg = write_config(base / "nan", demo_root)
    # (No val split: evaluation is not the point and costs a trace.)
    explode = ["--set", "train.learning_rate=1e30", "--set", "train.checkpoint_every=1", "--set", "data.val_split=none"]
    case("nan_stop", ["--config", nan_cfg, "--gpus", 1, "--run-dir", base / "nan" / "stop", *explode])
    # The same under float16 (its step 1 is a normal float16 step): a non-finite loss is never taken
    # for a loss-scale overflow.
    case("nan_stop_mixed_float16", ["--config", nan_cfg, "--gpus", 1, "--run-dir", base / "nan" / "stop16", *explode,
                                    "--set", "train.precision=mixed_float16"])
    case("nan_skip", ["--config", nan_cfg, "--gpus", 1, "--run-dir", base / "nan" / "skip", *explode,
                      "--set", "train.on_nan=skip_step", "--set", "train.num_steps=4"])
    # A finite gradient whose UPDATE overflows: SGD on a huge weight decay.
    case("nan_overflow", ["--config", nan_cfg, "--gpus", 1, "--run-dir", base / "nan" / "overflow",
                          "--set", "train.optimizer=sgd", "--set", "model.weight_decay=1e30",
                          "--set", "data.val_split=none",
                          "--set", "train.learning_rate=1e10", "--set", "train.checkpoint_every=1",
                          "--set", "train.num_steps=3"])

    (base / "cases.json").write_text(json.dumps(cases))
    (base / "driver.py").write_text(_DRIVER)
    lock_fd = os.open(held / "train.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, str(os.getpid()).encode(), 0)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, base / "driver.py", base / "cases.json", base / "results.json"],
                           cwd=base, env=_env(), capture_output=True, text=True, timeout=900, check=False)
        print(f"in-process cases: {time.perf_counter() - t0:.1f}s")
    finally:
        os.close(lock_fd)
    assert (base / "results.json").is_file(), r.stderr
    results = json.loads((base / "results.json").read_text())
    for name, res in results.items():
        print(f"  {name}: exit {res['rc']} in {res['seconds']:.1f}s")
    missing = [c["name"] for c in cases if c["name"] not in results]
    assert not missing, f"driver died before {missing}:\n{r.stderr[-3000:]}"
    return {"results": results, "roots": roots, "held": held, "corrupt": corrupt, "stale": stale,
            "stale_pid": dead.pid, "base": base}


def _unchanged(res):
    before, after = res["before"], res["after"]
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"run dir changed: {changed}"


# ---- SIGTERM, a stale lock, partial checkpoint files, exact resume -------------------------------------
def test_sigterm_then_stale_lock_then_resume_is_bitwise_exact(tmp_path, baseline, demo_root):
    """SIGTERM mid-run -> 143 + checkpoint; then the lock file left as a killed trainer leaves it (a dead pid)
    and partial files of a newer checkpoint on disk; the rerun takes the lock over, resumes from the SIGTERM's
    checkpoint and ends bitwise equal to the uninterrupted run. Fails for a step lost or run twice across the
    stop, a resume from elsewhere than the SIGTERM's checkpoint, partial files taken for a checkpoint, a stale lock
    refused or not named, or a lock not cleared on a clean exit.
    (A hard stop leaving its pid in the lock: tests/test_signals.py::test_sigterm_then_sigint_through_the_command.)"""
    cfg = write_config(tmp_path, demo_root)
    args = ["--config", cfg, "--gpus", 2]
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()

    # 1. SIGTERM once step 2 is logged: the current step finishes, a checkpoint is written, exit 143.
    rc, err, _ = run_until(args, tmp_path, rf"step 2/{STEPS}\b", signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "error:" not in err, err
    m = re.search(r"interrupted by SIGTERM at step (\d+): checkpoint (\S+) written", err)
    assert m, err
    k = int(m.group(1))
    assert 2 <= k < STEPS and latest_step(run_dir) == k, (k, err)
    steps_logged = [int(s) for s in re.findall(rf"step (\d+)/{STEPS}", err)]
    assert steps_logged == list(range(1, k + 1)), err  # every step that ran was logged: none lost
    if k % 2 == 0:  # the baseline has this checkpoint too
        assert_bitwise_equal(ckpt_dir(run_dir) / f"ckpt-{k}", ckpt_dir(baseline) / f"ckpt-{k}")
    assert (run_dir / "train.lock").read_text() == "", "a clean exit leaves no pid in the lock file"

    # 2. The lock file as a trainer killed outright leaves it: its pid, no longer running, and no flock held.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pid = dead.pid
    (run_dir / "train.lock").write_text(str(pid))
    newest = k

    # 3. Files of a newer checkpoint whose write was killed midway: not in the state file, so ignored.
    d = ckpt_dir(run_dir)
    for suffix in ("index", "data-00000-of-00001"):
        shutil.copy(d / f"ckpt-{newest}.{suffix}", d / f"ckpt-{STEPS}.{suffix}")
        truncate(d / f"ckpt-{STEPS}.{suffix}", 0.3)
    (d / f"ckpt-{STEPS}_temp").mkdir(exist_ok=True)
    (d / f"ckpt-{STEPS}_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"\0" * 100)

    # 4. The same command again: takes the dead trainer's lock over, resumes, ends bitwise equal.
    r = cli(args, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"taking over the lock left by pid {pid}" in r.stderr, r.stderr
    assert f"resumed from step {newest} " in r.stderr, r.stderr
    assert "skipping unreadable checkpoint" not in r.stderr, r.stderr
    assert latest_step(run_dir) == STEPS
    for step in (4, STEPS):
        if (d / f"ckpt-{step}.index").is_file():
            assert_bitwise_equal(d / f"ckpt-{step}", ckpt_dir(baseline) / f"ckpt-{step}")
    assert (run_dir / "train.lock").read_text() == ""
    print(f"SIGTERM at step {k}; chain {time.perf_counter() - t0:.1f}s")


def test_corrupt_newest_checkpoint_is_skipped(batch):
    """The state file points at ckpt-8 (truncated index) and lists ckpt-7 (truncated data): both are
    skipped with a warning and the run resumes from ckpt-6 (then: already complete)."""
    res = batch["results"]["corrupt_newest"]
    err = res["stderr"]
    assert res["rc"] == 0, err
    assert "Traceback" not in err, err
    for k in (8, 7):
        assert re.search(rf"W skipping unreadable checkpoint \S*ckpt-{k}\b", err), err
    assert "resumed from step 6 " in err and "run already complete" in err, err


# ---- one trainer per run dir -----------------------------------------------------------------------------
def test_run_dir_in_use_is_refused(batch):
    res = batch["results"]["lock_held"]
    assert_user_error(res["rc"], res["stderr"], f"error: run dir in use ({batch['held'] / 'train.lock'}): ")
    assert f"pid {os.getpid()}" in res["stderr"]
    _unchanged(res)


# ---- config changes on resume ----------------------------------------------------------------------------
def test_meaningful_config_change_is_refused(batch, stopped_run):
    res = batch["results"]["config_changed"]
    assert_user_error(res["rc"], res["stderr"], f"error: config differs from the checkpoint's ({stopped_run}")
    line = error_lines(res["stderr"])[0]
    for key in ("data.num_classes", "model.aspp_channels", "data.batch_size"):
        assert key in line, line
    assert "data.class_names" not in line and "--allow-config-change" in line, line
    _unchanged(res)

    res = batch["results"]["shorter_run"]
    assert_user_error(res["rc"], res["stderr"], "error: config differs from the checkpoint's")
    assert f"train.num_steps: {STEPS} -> 3" in error_lines(res["stderr"])[0]
    _unchanged(res)


def test_harmless_changes_stale_lock_and_skipped_sample(batch):
    """Resuming a finished run with a longer num_steps and another summary_every is allowed; the lock
    of a dead trainer is taken over; data.on_bad_sample: skip names the file and goes on."""
    res = batch["results"]["harmless"]
    err, stale = res["stderr"], batch["stale"]
    assert res["rc"] == 0, err
    assert f"taking over the lock left by pid {batch['stale_pid']}" in err, err
    assert re.search(rf"W run extended from {STEPS} to {STEPS + 2} steps", err), err
    assert re.search(r"I config changes on resume \(harmless\): .*train\.summary_every: 1 -> 2", err), err
    bad_image = batch["roots"]["jpeg_truncated"] / "JPEGImages" / f"{TARGET}.jpg"
    skip_line = r"W skipping bad sample \(data\.on_bad_sample: skip\): unreadable image \("
    assert re.search(skip_line + re.escape(str(bad_image)) + r"\)", err), err
    assert f"resumed from step {STEPS} " in err, err
    assert f"step {STEPS + 2}/{STEPS + 2}" in err and f"step {STEPS + 1}/" not in err, err  # summary_every: 2
    assert latest_step(stale) == STEPS + 2
    assert (stale / "train.lock").read_text() == ""


# ---- bad input: one error line, exit 2, run dir unchanged -----------------------------------------------
@pytest.mark.parametrize("name", list(DATA_CASES))
def test_bad_data_and_flags(batch, name):
    res = batch["results"][name]
    root = batch["roots"].get(name, "")
    assert_user_error(res["rc"], res["stderr"], DATA_CASES[name].format(root=root))
    line = error_lines(res["stderr"])[0]
    if name == "label_rgb":
        assert "colour (RGB)" in line, line
    if name in ("label_values", "val_label_values"):
        assert "got [7]" in line, line
    _unchanged(res)


def _config_case(name, tmp_path, cfg, run_dir):
    """(argv, expected error prefix) of a config-level case; files written into tmp_path."""
    good = yaml.safe_load(cfg.read_text())
    good["run_dir"] = str(run_dir)

    def write(text):
        p = tmp_path / f"{name}.yaml"
        p.write_text(text)
        return p

    if name == "yaml_syntax":
        text = yaml.safe_dump(good, sort_keys=False).splitlines()
        line = next(i for i, yaml_line in enumerate(text) if yaml_line.strip().startswith("batch_size:"))
        text[line] = text[line] + ": 5"  # "batch_size: 4: 5"
        p = write("\n".join(text) + "\n")
        return ["--config", p, "--run-dir", run_dir], f"error: YAML syntax error ({p}:{line + 1}): "
    if name == "unknown_key":
        good["train"]["checkpoint_evry"] = 2
        p = write(yaml.safe_dump(good))
        return ["--config", p], "error: unknown key (train.checkpoint_evry): did you mean 'checkpoint_every'?"
    if name == "wrong_type":
        return (["--config", cfg, "--set", "train.num_steps=many"],
                "error: wrong type (train.num_steps): expected an integer, got 'many'")
    if name == "missing_required":
        del good["data"]["num_classes"]
        p = write(yaml.safe_dump(good))
        return ["--config", p], "error: missing required value (data.num_classes): expected an integer"
    if name == "out_of_range":
        return (["--config", cfg, "--set", "data.num_classes=1"],
                "error: out of range (data.num_classes): expected an integer in [2, 255], got 1")
    if name == "python_tag":
        marker = tmp_path / "PWNED"
        del good["seed"]
        p = write(yaml.safe_dump(good) + f"seed: !!python/object/apply:os.system ['touch {marker}']\n")
        return ["--config", p], f"error: refused YAML tag ({p}:"
    if name == "gpus_zero":
        return (["--config", cfg, "--gpus", 0],
                "error: invalid --gpus (--gpus): expected a positive number of towers, got 0")
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["yaml_syntax", "unknown_key", "wrong_type", "missing_required", "out_of_range",
                                  "python_tag", "gpus_zero"])
def test_bad_config(tmp_path, stopped_run, name):
    """Rejected before TensorFlow starts (fast), the stopped run's dir unchanged, nothing executed."""
    args, expected = _config_case(name, tmp_path, stopped_run.parent / "cfg.yaml", stopped_run)
    before = tree_hash(stopped_run)
    r = cli(args, tmp_path)
    assert_user_error(r.returncode, r.stderr, expected)
    assert tree_hash(stopped_run) == before
    assert not (tmp_path / "PWNED").exists()
    assert "no GPU found" not in r.stderr  # refused before TensorFlow picked devices


# ---- non-finite losses --------------------------------------------------------------------------------------
def _all_checkpoints_finite(run_dir: Path) -> list[str]:
    prefixes = checkpoint_prefixes(run_dir)
    for p in prefixes:
        bad = nonfinite_tensors(p)
        assert not bad, f"{p}: non-finite {bad[:5]}"
    return prefixes


@pytest.mark.parametrize("case, run", [("nan_stop", "stop"), ("nan_stop_mixed_float16", "stop16")])
def test_nonfinite_loss_stops_with_exit_3(batch, case, run):
    res = batch["results"][case]
    err = res["stderr"]
    assert res["rc"] == 3, err
    assert "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert re.match(r"error: non-finite loss or gradient at step 2 on tower\(s\) \[0\]", lines[0]), err
    run_dir = batch["base"] / "nan" / run
    prefixes = _all_checkpoints_finite(run_dir)
    assert [Path(p).name for p in prefixes] == ["ckpt-1"], prefixes  # nothing saved for the bad step


def test_mixed_float16_step_applied_and_loss_scale_shown(batch):
    """The float16 run above, step 1 (before its weights blow up): applied at the initial loss scale (an
    overflow would halve it and say so), the scale in the step log line, in TensorBoard
    (train/loss_scale) and in the checkpoint with its count of applied steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    err = batch["results"]["nan_stop_mixed_float16"]["stderr"]
    assert re.search(r"I step 1/6  loss [0-9.]+  gnorm [0-9.e+-]+  lr [0-9.e+-]+  loss scale 32768  ", err), err
    assert "overflow" not in err, err
    run_dir = batch["base"] / "nan" / "stop16"
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    scales = [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors("train/loss_scale")]
    assert scales == [(1, 32768.0)], scales
    reader = tf.train.load_checkpoint(str(ckpt_dir(run_dir) / "ckpt-1"))
    assert float(reader.get_tensor("loss_scale/.ATTRIBUTES/VARIABLE_VALUE")) == 32768.0
    assert int(reader.get_tensor("good_steps/.ATTRIBUTES/VARIABLE_VALUE")) == 1  # one applied step
    assert int(reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE")) == 1


def test_nonfinite_loss_skip_step_continues(batch):
    res = batch["results"]["nan_skip"]
    err = res["stderr"]
    assert res["rc"] == 0, err
    assert "Traceback" not in err, err
    skipped = re.findall(r"W non-finite loss or gradient at step (\d+) on tower\(s\) \[0\].*update skipped", err)
    assert skipped and skipped[0] == "2", err
    run_dir = batch["base"] / "nan" / "skip"
    assert latest_step(run_dir) == 4
    assert _all_checkpoints_finite(run_dir)


def test_overflowing_update_never_reaches_a_checkpoint(batch):
    res = batch["results"]["nan_overflow"]
    err = res["stderr"]
    assert "Traceback" not in err, err
    _all_checkpoints_finite(batch["base"] / "nan" / "overflow")
    assert res["rc"] == 3 and re.search(r"error: non-finite .* step \d+", err), err


# ---- guards, without TensorFlow runs ---------------------------------------------------------------------
def test_resume_config_check_tolerates_keys_of_other_versions(tmp_path, demo_root, caplog):
    """A key added by a newer seg-train (absent from an older run's config.yaml) is no change at its
    default; a key this version no longer has is harmless; anything else meaningful is refused."""
    from seg_train import config as config_lib
    from seg_train.config import ConfigError
    from seg_train.run.rundir import check_resume_config

    cfg = config_lib.load(write_config(tmp_path, demo_root))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = cfg.to_dict()
    del old["train"]["jit_compile"], old["train"]["precision"]  # "written by an older version"
    old["train"]["retired_option"] = 3  # "an option this version dropped"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old))
    check_resume_config(cfg, run_dir, allow_change=False)  # no error

    changed = config_lib.replace(cfg, "train.precision", "mixed_float16")  # not the default: a real change
    with pytest.raises(ConfigError, match=r"changed: train\.precision: '<absent>' -> 'mixed_float16'"):
        check_resume_config(changed, run_dir, allow_change=False)
    check_resume_config(changed, run_dir, allow_change=True)

    (run_dir / "config.yaml").write_text("- not\n- a mapping\n")
    with pytest.raises(ConfigError, match=r"^unreadable run config"):
        check_resume_config(cfg, run_dir, allow_change=False)


def test_scan_names_the_file_whatever_the_decoder_raises(monkeypatch, demo_root):
    from seg_train.config import DataConfig
    from seg_train.data import scan
    from seg_train.data.layouts import list_samples

    samples = list_samples(DataConfig(root=demo_root), "val")
    real = scan.load

    def flaky(sample, *rest):
        if sample.image == samples[1].image:
            raise ValueError("tile cannot extend outside image")  # what Pillow raises on some corrupt headers
        return real(sample, *rest)

    monkeypatch.setattr(scan, "load", flaky)
    report = scan.scan(samples, 3, 255)
    assert [s.id for s, _ in report.bad] == [samples[1].id]
    assert report.bad[0][1].startswith(f"unreadable sample ({samples[1].image}, {samples[1].label}): expected")


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path):
    """rundir.write_atomic (JSON records, predicted PNGs, exported .tflite files): a write that fails
    halfway leaves the previous file byte for byte and no temporary file; wrong if it writes in place
    (a truncated file) or forgets the temporary one."""
    from seg_train.run.rundir import write_atomic, write_json

    path = tmp_path / "record.json"
    write_json(path, {"miou": 0.5})
    before = path.read_bytes()

    def half_then_fail(tmp):
        tmp.write_bytes(b'{"miou": 0.')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, half_then_fail)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
    write_atomic(path, lambda tmp: tmp.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
