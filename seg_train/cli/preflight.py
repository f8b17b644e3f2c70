"""The commands' checks made before any work, for what a plain install or an ordinary config can miss.

Each raises ConfigError rather than letting the command fail part way through. Nothing here imports
TensorFlow (the checks run before its slow start) or writes anything.
"""

from __future__ import annotations

import os
import re

from seg_train.config import Config, ConfigError, exception_text
from seg_train.config.resolve import check_trainable
from seg_train.data.checks import check_data_root, check_synthetic_data
from seg_train.util.paths import check_creatable_dir


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


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """The run dir, and what training rewrites inside an existing one, can be written."""
    hint = "set run_dir or pass --run-dir"
    path = check_creatable_dir(run_dir, "run dir", hint)
    for name in ("checkpoints", "best", "train.lock"):
        p = path / name
        if p.exists() and not os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0)):
            raise ConfigError("run dir is not writable", str(p), f"write access to what seg-train keeps there ({hint})")


def for_training(cfg: Config) -> None:
    """Everything seg-train needs that can be checked before TensorFlow starts."""
    check_trainable(cfg)
    check_summary_backend()
    check_data_root(cfg)
    check_run_dir(cfg.run_dir)


def for_evaluation(cfg: Config) -> None:
    """seg-eval, seg-predict, seg-export, seg-bench: the synthetic data they may generate can be."""
    check_synthetic_data(cfg)
