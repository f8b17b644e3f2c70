"""The run directory: its guards (one trainer at a time, resuming only with a compatible config) and
atomic JSON files in it (`write_json`: eval records, best.json)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
from pathlib import Path

import yaml

from seg_train import config as config_lib
from seg_train.config import Config, ConfigError, exception_text, flatten
from seg_train.config.resolve import default_mask_annealing

log = logging.getLogger("seg_train")

LOCK_NAME = "train.lock"

# Keys whose change does not change what a checkpoint means; they may differ on resume.
HARMLESS = {
    "run_dir", "data.root", "data.val_split", "data.class_names", "data.num_parallel_calls", "data.on_bad_sample",
    "data.synthetic", "train.summary_every", "train.image_summary_every", "train.checkpoint_every",
    "train.keep_checkpoints", "train.eval_every", "train.on_nan", "train.deterministic", "eval.bn_reestimate_batches",
    # How the towers' gradients are summed and XLA: execution details, not what the weights mean.
    "train.jit_compile", "train.allreduce", "train.allreduce_pack_mb", "train.allreduce_num_packs",
    "train.collective_timeout",
    # Same maths, other kernels (models/atrous.py, models/fused_bn.py, models/attention.py); the same data, cached.
    "model.fast_atrous", "model.fused_batchnorm", "model.attention", "train.recompute", "data.cache",
    # Where the pre-training scan's result is kept between runs (it is the same result either way).
    "data.scan_cache", "data.scan_cache_dir",
    # What is recorded, not what is trained.
    "train.profile_steps",
    # How a model is evaluated and served (flips, scales, sliding window), not its weights.
    "eval.mode", "eval.flip", "eval.scales", "eval.crop_size", "eval.stride", "eval.logit_adjustment",
}

_ABSENT = "<absent>"


def write_atomic(path: Path, write) -> None:
    """Calls write(tmp) on a temporary name beside `path`, then renames it to `path` (os.replace).

    Readers never see half a file; a failed write leaves neither a truncated `path` nor the temporary.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    """Writes the dict `obj` as JSON atomically (write_atomic), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One top-level key per line, each value compact: a confusion matrix stays a few lines long.
    body = ",\n".join(f" {json.dumps(str(k))}: {json.dumps(v)}" for k, v in obj.items())
    write_atomic(path, lambda tmp: tmp.write_text("{\n" + body + "\n}\n"))


CLASS_WEIGHTS_FILE = "class_weights.json"
# RUN_DIR/first_step.json: the first step's timing (loop.HostSide) and peak memory (train.py), for seg-bench.
FIRST_STEP_FILE = "first_step.json"


def write_class_weights(run_dir: Path, source: str, names, weights) -> None:
    """RUN_DIR/class_weights.json: the loss's class weights as trained ({"source", "weights": {name: w}})."""
    write_json(Path(run_dir) / CLASS_WEIGHTS_FILE, {"source": source,
                                                    "weights": {n: float(w) for n, w in zip(names, weights)}})


def read_class_weights(run_dir: Path, names, scheme: str | None = None) -> list[float]:
    """The weights `write_class_weights` wrote, in the order of `names`; a ConfigError if they are not
    there, are not finite and >= 0, or were computed by another scheme than `scheme` (when given)."""
    path = Path(run_dir) / CLASS_WEIGHTS_FILE
    try:
        record = json.loads(path.read_text())
        weights = [float(record["weights"][n]) for n in names]
        if not all(w >= 0 and w != float("inf") for w in weights):  # NaN fails w >= 0
            raise ValueError(f"expected finite weights >= 0, got {weights}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = "no such file" if isinstance(e, FileNotFoundError) else f"{type(e).__name__}: {exception_text(e)}"
        raise ConfigError("class weights of the run not found", str(path),
                          f"the {CLASS_WEIGHTS_FILE} seg-train writes when it trains with a named "
                          f"loss.class_weights scheme, with a weight for each class ({problem}); or give "
                          f"the weights as a list (--set 'loss.class_weights=[...]')") from None
    if scheme is not None and record.get("source") != scheme:
        raise ConfigError("class weights of another scheme", str(path),
                          f"weights computed as loss.class_weights says ({scheme!r}); the run trained with "
                          f"{record.get('source')!r}")
    return weights


def _default_of(key: str):
    """The plain default value of a dotted config key, or _ABSENT if it has none (or is unknown)."""
    section, _, name = key.rpartition(".")
    cls = config_lib.SECTIONS.get(section) if section else config_lib.Config
    for f in dataclasses.fields(cls) if cls is not None else ():
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return config_lib.to_plain(f.default)
            if f.default_factory is not dataclasses.MISSING:
                return config_lib.to_plain(f.default_factory())
    return _ABSENT


class RunLock:
    """An exclusive flock on RUN_DIR/train.lock, released by the kernel when the process dies.

    So a killed trainer's lock is taken over with no stale-lock heuristics. The file stays (holding
    the last owner's pid).
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd = None
        self.owner = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError("run dir in use", str(self.path),
                              f"one trainer per run dir; another seg-train (pid {owner}) is training here "
                              "(wait for it, or use another --run-dir)") from None
        previous = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if previous and previous.isdigit() and int(previous) != os.getpid() and not _alive(int(previous)):
            log.info("taking over the lock left by pid %s (no longer running)", previous)
        self.fd = fd

    def mark_owner(self) -> None:
        """Writes our pid into the lock file (only once the run is known to start)."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        self.owner = True

    def release(self) -> None:
        if self.fd is not None:
            if self.owner:  # a clean exit leaves no pid behind (only a killed trainer does)
                os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _derived_windows(saved: dict) -> bool:
    """Whether a run dir's flat config holds the EoMT annealing windows an older seg-train derived from its
    train.num_steps and wrote there: those were never chosen, so they count as unset and follow num_steps
    (resolve.annealing_windows) like a newer run's. Windows given by hand that equal them are taken the same."""
    windows, steps = saved.get("train.mask_annealing"), saved.get("train.num_steps")
    blocks = saved.get("model.eomt_blocks", _default_of("model.eomt_blocks"))
    if not (isinstance(windows, list) and isinstance(steps, int) and isinstance(blocks, int)):
        return False
    return windows == [list(w) for w in default_mask_annealing(steps, blocks)]


def check_resume_config(cfg: Config, run_dir: Path, allow_change: bool) -> None:
    """Refuses to resume with a config that changes what the checkpoint means.

    Harmless keys (HARMLESS) are allowed and reported; a longer train.num_steps is allowed with a
    warning (the poly schedule is stretched); anything else needs `allow_change`.
    """
    saved_path = Path(run_dir) / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        loaded = yaml.safe_load(saved_path.read_text()) or {}
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        loaded = None
    if not isinstance(loaded, dict):
        raise ConfigError("unreadable run config", str(saved_path),
                          "the YAML mapping seg-train wrote there (restore it, or use another --run-dir)")
    saved = flatten(loaded)
    new = flatten(cfg.to_dict())
    if new.get("train.mask_annealing") is None and _derived_windows(saved):
        saved["train.mask_annealing"] = None
    changed = []
    for k in sorted(set(saved) | set(new)):
        old_value, new_value = saved.get(k, _ABSENT), new.get(k, _ABSENT)
        # A key newer than the run's config.yaml: its default is what the run used, so no change.
        if old_value == _ABSENT and new_value == _default_of(k):
            continue
        if old_value != new_value:
            changed.append(k)
    if not changed:
        return
    meaningful, harmless = [], []
    for key in changed:
        desc = f"{key}: {saved.get(key, _ABSENT)!r} -> {new.get(key, _ABSENT)!r}"
        if key in HARMLESS or key not in new:  # a key this version no longer has cannot apply any more
            harmless.append(desc)
        elif key == "train.num_steps" and isinstance(saved.get(key), int) and new[key] > saved[key]:
            log.warning("run extended from %d to %d steps: the poly schedule is stretched to the new length",
                        saved[key], new[key])
        else:
            meaningful.append(desc)
    if harmless:
        log.info("config changes on resume (harmless): %s", "; ".join(harmless))
    if meaningful:
        if allow_change:
            log.warning("resuming with a changed config (--allow-config-change): %s", "; ".join(meaningful))
            return
        raise ConfigError("config differs from the checkpoint's", str(saved_path),
                          f"the same meaning to resume; changed: {'; '.join(meaningful)} "
                          "(use another --run-dir, or --allow-config-change to resume anyway)")
