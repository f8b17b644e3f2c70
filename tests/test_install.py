"""What an installed seg-train does before any work: --version, and the pre-flight checks (seg_train.cli.preflight)
for a bad install or an unwritable place, through the real console scripts. No training here (scripts/check_wheel.sh
trains from a built wheel)."""

import os
import select
import signal
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

import seg_train
from seg_train.cli import preflight
from seg_train.config import ConfigError
from seg_train.data import checks
from tests.helpers import tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

COMMANDS = {"seg-train": "train_main", "seg-eval": "eval_main", "seg-predict": "predict_main",
            "seg-export": "export_main", "seg-bench": "bench_main", "seg-prepare": "prepare_main"}


def command(name):
    """The installed console script next to this Python, else the same entry point through -c."""
    script = Path(sys.executable).with_name(name)
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", f"import sys; from seg_train.cli import {COMMANDS[name]} as m; sys.exit(m())"]


def run(name, args, cwd, pythonpath=None):
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run(command(name) + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_version_on_every_command(tmp_path, name):
    r = run(name, ["--version"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[:3] == [f"seg-train {seg_train.__version__}",
                                         f"TensorFlow {metadata.version('tensorflow')}",
                                         f"Keras {metadata.version('keras')}"], r.stdout
    assert r.stderr == ""  # read from package metadata: TensorFlow is not even started


def synthetic_config(tmp_path):
    """A tiny synthetic-data config in tmp_path/cfg; its data and run would go under tmp_path."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    raw = {"run_dir": "../run", "data": {"root": "../data", "synthetic": True, "num_classes": 3, "batch_size": 2,
                                          "crop_size": [32, 32]},
           "model": {"backbone": "tiny", "aspp_channels": 8, "decoder_channels": 8, "low_level_channels": 4},
           "train": {"num_steps": 1}}
    (folder / "c.yaml").write_text(yaml.safe_dump(raw))
    return folder / "c.yaml"


def assert_one_line_error(r, start, tmp_path):
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    # Checked before any work: neither the run dir nor the synthetic data set was created.
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_missing_tensorboard_is_one_line_before_any_work(tmp_path):
    # What `pip uninstall tensorboard` leaves: `import tensorboard` raises ModuleNotFoundError (None in
    # sys.modules is how Python itself marks a module as absent).
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\n")
    r = run("seg-train", ["--config", str(synthetic_config(tmp_path)), "--gpus", "2"], tmp_path, pythonpath=stub)
    pin = "tensorboard==" + ".".join(metadata.version("tensorflow").split(".")[:2]) + ".*"
    assert_one_line_error(r, f"error: TensorBoard is not installed (python package 'tensorboard'): pip install '{pin}'",
                          tmp_path)


def test_broken_tensorboard_is_one_line(tmp_path):
    stub = tmp_path / "stub" / "tensorboard"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('cannot import name builder (a protobuf mismatch)')\n")
    r = run("seg-train", ["--config", str(synthetic_config(tmp_path))], tmp_path, pythonpath=stub.parent)
    assert_one_line_error(r, "error: TensorBoard cannot be imported (python package 'tensorboard'): a working "
                          "install: pip install --force-reinstall 'tensorboard==", tmp_path)
    assert "(ImportError: cannot import name builder (a protobuf mismatch))" in r.stderr


@pytest.mark.parametrize("name, args, expected", [
    ("seg-train", ["--run-dir", "cfg/c.yaml/run"], "error: run dir cannot be created ({tmp}/cfg/c.yaml/run): "
                                                   "{tmp}/cfg/c.yaml is a file, not a folder"),
    ("seg-train", ["--set", "data.root=cfg"], "error: not the synthetic data set (data.root: {tmp}/cfg): an empty "
                                              "or new folder"),
    ("seg-predict", ["--checkpoint", "cfg", "--output", "cfg/c.yaml/out", "cfg/img.png"],
     "error: output folder cannot be created ({tmp}/cfg/c.yaml/out): {tmp}/cfg/c.yaml is a file, not a folder"),
    ("seg-export", ["--checkpoint", "cfg", "--output", "cfg/c.yaml/out"],
     "error: output folder cannot be created ({tmp}/cfg/c.yaml/out): {tmp}/cfg/c.yaml is a file, not a folder"),
])
def test_unwritable_places_are_one_line_errors(tmp_path, name, args, expected):
    cfg = synthetic_config(tmp_path)
    from PIL import Image
    Image.new("RGB", (8, 8)).save(tmp_path / "cfg" / "img.png")
    r = run(name, ["--config", str(cfg), *args], tmp_path)
    assert_one_line_error(r, expected.format(tmp=tmp_path), tmp_path)


def test_check_run_dir(tmp_path):
    preflight.check_run_dir(tmp_path / "new" / "deeper")  # creatable: fine, and not created
    assert not (tmp_path / "new").exists()
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"^run dir is a file \("):
        preflight.check_run_dir(tmp_path / "f")


def _check_run_dirs_as_nobody(paths) -> list[str]:
    """preflight.check_run_dir on each path in a forked child that drops root for the user nobody.

    Forked, not executed: the interpreter may live where nobody cannot read it (e.g. under /root),
    and the child needs nothing but the modules already loaded and the kernel's permission check.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on, only os._exit
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = []
            for p in paths:
                try:
                    preflight.check_run_dir(p)
                    out.append("ok")
                except ConfigError as e:
                    out.append(str(e))
            os.write(write, "\n".join(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60)
    if not ready:  # never hang the suite: a forked child of a threaded process could block
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child as user nobody failed"
    return text.splitlines()


def test_read_only_run_dir():
    # A chmod 555 folder is read-only for everyone but root, and CI runs as root: there the check
    # runs in a child process that is the unprivileged user nobody, for whom the folder is read-only.
    ro = Path(tempfile.mkdtemp(prefix="seg-train-ro-"))  # under /tmp, which everyone may traverse
    os.chmod(ro, 0o555)
    try:
        paths = [str(ro), str(ro / "run")]
        if os.geteuid() == 0:
            messages = _check_run_dirs_as_nobody(paths)
        else:
            messages = []
            for p in paths:
                with pytest.raises(ConfigError) as info:
                    preflight.check_run_dir(p)
                messages.append(str(info.value))
        assert messages[0].startswith(f"run dir is not writable ({ro}): "), messages
        assert messages[1].startswith(f"run dir cannot be created ({ro}/run): ") and "is not writable" in messages[1], \
            messages
    finally:
        os.chmod(ro, 0o755)
        ro.rmdir()


def test_synthetic_data_folder_in_the_way(tmp_path):
    cfg = tiny_config(tmp_path, data_root=tmp_path / "mine", data={"synthetic": True})
    checks.check_synthetic_data(cfg)  # absent: will be generated
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"^not the synthetic data set \(data.root: "):
        checks.check_synthetic_data(cfg)


def test_every_package_folder_is_committed_with_its_init():
    """Each folder of seg_train/ holding committed modules has a committed __init__.py.

    Fails for a package folder a .gitignore pattern hides (it happened: `data/` hid
    seg_train/data/__init__.py, so a clone imported seg_train.data as a namespace package and the wheel,
    built by find_packages, left seg_train.data out)."""
    root = Path(seg_train.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "seg_train"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split()
    folders = {str(Path(f).parent) for f in tracked if f.endswith(".py")}
    assert len(folders) >= 5
    missing = sorted(f for f in folders if f"{f}/__init__.py" not in tracked)
    assert not missing, f"package folders without a committed __init__.py: {missing}"
