"""Checks made before a command does any work, for what a plain install or an ordinary config can miss.

Each raises ConfigError rather than letting the command fail part way through. Nothing here imports
TensorFlow (the checks run before its slow start) or writes anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from seg_train.config import Config, ConfigError, exception_text, is_url
from seg_train.config.resolve import check_trainable


def _requirement(name: str) -> str:
    """`name` with the version pin seg-train is installed with (e.g. 'tensorboard==2.21.*')."""
    from importlib import metadata
    try:
        for req in metadata.requires("seg-train") or ():
            if re.match(rf"{re.escape(name)}\s*[=<>!~]", req) and ";" not in req:
                return req.replace(" ", "")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        pass
    if name == "tensorboard":  # TensorBoard's releases follow TensorFlow's minor versions
        try:
            return "tensorboard==" + ".".join(metadata.version("tensorflow").split(".")[:2]) + ".*"
        except metadata.PackageNotFoundError:
            pass
    return name


def check_summary_backend() -> None:
    """TensorBoard's summary ops import, so tf.summary can write (without the `tensorboard` package
    TensorFlow fails only at the first summary, a step into training)."""
    pin = _requirement("tensorboard")
    try:
        import tensorboard  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "tensorboard":
            raise ConfigError("TensorBoard is not installed", "python package 'tensorboard'",
                              f"pip install '{pin}' (tf.summary needs it to write the run's summaries)") from None
        _broken(e, pin)
    except Exception as e:  # noqa: BLE001 - a broken install fails in many ways; all mean "reinstall"
        _broken(e, pin)
    try:
        from tensorboard.summary.v2 import image, scalar  # noqa: F401
    except Exception as e:  # noqa: BLE001
        _broken(e, pin)


def _broken(e: Exception, pin: str):
    detail = exception_text(e)[:200]
    raise ConfigError("TensorBoard cannot be imported", "python package 'tensorboard'",
                      f"a working install: pip install --force-reinstall '{pin}' "
                      f"({type(e).__name__}: {detail})") from None


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_creatable_dir(path: str | os.PathLike, what: str, hint: str) -> Path:
    """`path` (returned absolute) is a writable folder or can be created as one; nothing is created.
    `what` names it in the message ("run dir", ...), `hint` says what to do instead."""
    path = Path(os.path.abspath(path))
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{what} is a file", str(path), "a directory (or a path that does not exist yet)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{what} is not writable", str(path), f"a folder you can write to ({hint})")
        return path
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise ConfigError(f"{what} cannot be created", str(path), f"{base} is a file, not a folder ({hint})")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} cannot be created", str(path),
                          f"a location you can write to; {base} is not writable ({hint})")
    return path


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """The run dir, and what training rewrites inside an existing one, can be written."""
    hint = "set run_dir or pass --run-dir"
    path = check_creatable_dir(run_dir, "run dir", hint)
    for name in ("checkpoints", "best", "train.lock"):
        p = path / name
        if p.exists() and not os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0)):
            raise ConfigError("run dir is not writable", str(p), f"write access to what seg-train keeps there ({hint})")


def check_synthetic_data(cfg: Config) -> None:
    """With data.synthetic, the demo data set is either complete at data.root or can be generated there."""
    from seg_train.data.synthetic import COMPLETE_MARKER

    if cfg.data.synthetic and is_url(cfg.data.root):
        raise ConfigError("synthetic data on a URL", "data.root", f"a local folder for data.synthetic: true "
                          f"(the demo set is written with local file operations), got {cfg.data.root!r}")
    root = Path(cfg.data.root)
    if not cfg.data.synthetic or (root / COMPLETE_MARKER).is_file():
        return
    if root.is_dir() and any(root.iterdir()):
        raise ConfigError("not the synthetic data set", f"data.root: {root}",
                          f"an empty or new folder for data.synthetic: true (this one has files but no "
                          f"{COMPLETE_MARKER}; never overwritten), or data.synthetic: false for your own data")
    check_creatable_dir(root, "synthetic data folder", "set data.root to a folder you can write to")


def check_data_root(cfg: Config) -> None:
    """data.root is a folder (or the synthetic data set can be generated there)."""
    if cfg.data.synthetic:
        check_synthetic_data(cfg)
        return
    if is_url(cfg.data.root):
        return  # only TensorFlow's file systems can look: the reader checks it (layouts.list_samples)
    root = Path(cfg.data.root)
    if not root.is_dir():
        raise ConfigError("data root not found", "data.root",
                          f"expected a {cfg.data.layout}-layout folder, got {str(root)!r}")


def for_training(cfg: Config) -> None:
    """Everything seg-train needs that can be checked before TensorFlow starts."""
    check_trainable(cfg)
    check_summary_backend()
    check_data_root(cfg)
    check_run_dir(cfg.run_dir)


def for_evaluation(cfg: Config) -> None:
    """seg-eval, seg-predict, seg-export, seg-bench: the synthetic data they may generate can be."""
    check_synthetic_data(cfg)
