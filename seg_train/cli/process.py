"""The commands' process plumbing: logging, quiet start-up, TensorFlow's environment, the error boundary.

With the command modules, the only place that reads argv and sets up logging. User errors print
`error: <what> (<where>): <expected>` and exit 2 (--debug: the traceback). Run as a command (argv
None), every entry point ends the process itself, skipping the interpreter's tear-down (`_end_process`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import traceback

from seg_train.cli import preflight
from seg_train.config import ConfigError, without_reprs

# Imported before _end_process is registered, so feed's exit hook runs after it: never, in a command.
from seg_train.data import feed  # noqa: F401
from seg_train.util import exit_codes

log = logging.getLogger("seg_train")

EXIT_USER_ERROR, EXIT_INTERNAL, EXIT_PEER_FAILED = exit_codes.USER_ERROR, exit_codes.INTERNAL, exit_codes.PEER_FAILED


class _TqdmSafeHandler(logging.StreamHandler):
    """Writes log lines through tqdm when a bar is on screen, so they don't tear it."""

    def emit(self, record):
        try:
            from tqdm import tqdm
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging must never raise
            super().emit(record)


def setup_logging(debug: bool) -> None:
    handler = _TqdmSafeHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(message)s", "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if debug else logging.INFO)
    log.propagate = False


@contextlib.contextmanager
def quiet_stderr(debug: bool):
    """Points fd 2 at a temporary file while TensorFlow loads and picks devices (--debug: no-op).

    TF_CPP_MIN_LOG_LEVEL misses the C++ noise printed before absl logging starts."""
    if debug:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


# TensorFlow's CPU device otherwise uses malloc, and glibc returns freed blocks above its mmap threshold
# (activations are larger) to the kernel, so every step page-faults them in again; TensorFlow's pooling
# BFC allocator keeps them, with identical results. A user's value wins (pool cap: TF_CPU_BFC_MEM_LIMIT_IN_MB).
TF_ENV_DEFAULTS = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def set_tf_env_defaults() -> None:
    """TensorFlow settings read from the environment (TF_ENV_DEFAULTS), unless the user set them."""
    for key, value in TF_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def import_tensorflow(debug: bool):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if debug else "2")
    set_tf_env_defaults()
    with quiet_stderr(debug):
        import keras  # noqa: F401
        import tensorflow as tf  # noqa: F401
    if not debug:
        import absl.logging
        absl.logging.set_verbosity(absl.logging.ERROR)
        tf.get_logger().setLevel(logging.ERROR)
        import warnings
        warnings.filterwarnings("ignore", module="keras")
    return tf


def user_error(e: BaseException) -> str | None:
    """The one-line message for an exception caused by user input, or None for a bug."""
    if isinstance(e, ConfigError):
        return str(e)
    # Looked up, not imported: importing the reader would start TensorFlow just to report an earlier error.
    reader = sys.modules.get("seg_train.data.reader")
    if reader is not None and isinstance(e, reader.BadSample):
        return str(e)
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(e, tf.errors.OpError):
        # A BadSample raised inside tf.data's numpy_function arrives wrapped in an OpError.
        m = re.search(r"BadSample: (.*?)(?:\n|$)", e.message)
        if m:
            return m.group(1).strip()
    return None


def peer_failure(e: BaseException) -> str | None:
    """A short description if `e` is a multi-worker collective that lost its peers, else None."""
    tf = sys.modules.get("tensorflow")
    if tf is None or os.environ.get("TF_CONFIG") is None:
        return None
    if isinstance(e, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError,
                      tf.errors.CancelledError)):
        text = " ".join(e.message.split())
        m = re.search(r"(The following tasks are unhealthy[^:]*: ?\S*|[Cc]ollective ops is aborted[^.]*|"
                      r"[Dd]eadline [Ee]xceeded[^.]*)", text)
        return (m.group(1) if m else text[:200]).strip()
    return None


_exit_code: int | None = None  # what the command returned, for _end_process
_hooked = False


def _end_process() -> None:
    """Exit hook: ends the process with the command's exit code before the interpreter's tear-down.

    That tear-down can hang: live tf.data iterators wait forever on decode threads it has ended.
    Registered before TensorFlow is imported, it runs after every later exit hook."""
    if _exit_code is None:  # the command did not return (e.g. a SystemExit escaped it): Python's own exit
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_exit_code)


def run_guarded(main, args, end_process: bool = False) -> int:
    """Runs main(args), turning user errors into `error: ...` and exit code 2.

    end_process: this call is the whole process (argv None), which `_end_process` ends with the code."""
    global _exit_code, _hooked
    if end_process and not _hooked:
        atexit.register(_end_process)  # before TensorFlow is imported: runs after TensorFlow's own hooks
        _hooked = True
    _exit_code = None
    code = _run_guarded(main, args)
    if end_process:
        _exit_code = code
    return code


def _run_guarded(main, args) -> int:
    try:
        return main(args)
    except KeyboardInterrupt:
        print("error: interrupted (keyboard): no checkpoint written for the step in progress", file=sys.stderr)
        return exit_codes.signalled(signal.SIGINT)
    except Exception as e:  # noqa: BLE001 - the boundary where every error becomes an exit code
        if getattr(args, "debug", False):
            traceback.print_exc()
        peer = peer_failure(e)
        if peer is not None:
            print(f"error: a peer worker stopped or cannot be reached ({peer}): the group stops; restart every "
                  "worker with the same command to resume from the newest checkpoint", file=sys.stderr)
            return EXIT_PEER_FAILED
        msg = user_error(e)
        if msg is not None:
            print(f"error: {msg}", file=sys.stderr)
            return EXIT_USER_ERROR
        if not getattr(args, "debug", False):
            lines = [line for line in map(without_reprs, str(e).splitlines()) if line]
            print(f"error: internal error ({type(e).__name__}): {lines[-1] if lines else ''} "
                  "-- rerun with --debug for the traceback", file=sys.stderr)
        return EXIT_INTERNAL


def version_text(debug: bool = False) -> str:
    """seg-train's, TensorFlow's, Keras' and TensorBoard's versions, one per line.

    Read from package metadata (importing TensorFlow is slow); imported only if its distribution is not found."""
    from importlib import metadata

    import seg_train

    def installed(dist: str, module: str | None = None) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
        if module is None:
            return "not installed"
        try:
            with quiet_stderr(debug):
                return __import__(module).__version__
        except Exception:  # noqa: BLE001 - a version line must never fail
            return "not installed"

    return "\n".join([f"seg-train {seg_train.__version__}",
                      f"TensorFlow {installed('tensorflow', 'tensorflow')}",
                      f"Keras {installed('keras', 'keras')}",
                      f"TensorBoard {installed('tensorboard')}"])


class _VersionAction(argparse.Action):
    """--version: the versions, exit 0 (before the required arguments are checked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit(0)


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action=_VersionAction,
                        help="print the seg-train, TensorFlow, Keras and TensorBoard versions and exit")


def add_common(parser: argparse.ArgumentParser) -> None:
    add_version(parser)
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (dotted, YAML-typed; repeatable), e.g. --set train.num_steps=100")
    parser.add_argument("--gpus", type=int, default=1, help="number of towers (GPUs; logical CPU devices if none)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and TensorFlow's own logs")


def setup(args, run_dir_flag=None, checks=None):
    """Loads the config (no TF), runs `checks(cfg)` (seg_train.cli.preflight, no TF), imports TF quietly,
    picks devices and builds the strategy."""
    from seg_train import config as config_lib
    setup_logging(args.debug)
    cfg = config_lib.load(args.config, args.overrides, run_dir_flag)
    if args.gpus < 1:
        raise ConfigError("invalid --gpus", "--gpus", f"expected a positive number of towers, got {args.gpus}")
    if getattr(args, "worker_index", None) is not None and not getattr(args, "workers", None):
        raise ConfigError("--worker-index without --workers", "--worker-index", "also --workers HOST:PORT,...")
    if checks is not None:
        checks(cfg)
    import_tensorflow(args.debug)
    from seg_train.parallel import replicas
    if getattr(args, "workers", None):
        replicas.set_cluster(args.workers, args.worker_index)
    t = cfg.train
    if getattr(args, "multiworker_ok", False) and replicas.cluster_from_env() is not None:
        with quiet_stderr(args.debug):
            strategy, message = replicas.make_multiworker_strategy(args.gpus, t.allreduce, t.allreduce_pack_mb,
                                                                   t.collective_timeout, t.allreduce_num_packs)
        log.info("%s", message)
        return cfg, strategy
    with quiet_stderr(args.debug):
        devices = replicas.setup_devices(args.gpus)
        strategy = replicas.strategy_for(t, devices)
    log.info("%s", devices.message)
    return cfg, strategy


def add_checkpoint_arg(parser: argparse.ArgumentParser, model_flag: bool = False, optional: bool = False) -> None:
    help_ = "a run dir (newest checkpoint), its checkpoints/ or best/ folder, or a checkpoint prefix"
    if optional:
        help_ += "; none: the model as model.init_weights starts it"
    if not model_flag:
        parser.add_argument("--checkpoint", required=True, metavar="CKPT_OR_RUN_DIR", help=help_)
        return
    which = parser.add_mutually_exclusive_group(required=not optional)
    which.add_argument("--checkpoint", metavar="CKPT_OR_RUN_DIR", help=help_)
    which.add_argument("--model", metavar="FILE.tflite|FILE.onnx",
                       help="a .tflite file (seg-export --format tflite), run in LiteRT's interpreter (needs pip "
                            "install 'seg-train[tflite]'), or a .onnx file (--format onnx), run in ONNX Runtime "
                            "(needs pip install 'seg-train[onnx]')")
    parser.add_argument("--threads", type=int, default=1,
                        help="LiteRT / ONNX Runtime threads with --model (default 1)")


def precheck_checkpoint(path: str) -> None:
    """Fails fast, before TensorFlow's slow import, on a checkpoint path that does not exist at all."""
    from pathlib import Path
    if not Path(path).exists() and not Path(path + ".index").is_file():
        raise ConfigError("checkpoint not found", path,
                          "expected a run dir, a checkpoints/ folder or a checkpoint prefix")


def precheck_model(args) -> None:
    """--model: the file exists and its runtime (LiteRT, ONNX Runtime) is installed, before TensorFlow's slow
    import."""
    from pathlib import Path

    from seg_train.infer.litert import check_runtime, check_threads
    if not Path(args.model).is_file():
        raise ConfigError("model file not found", args.model,
                          "a .tflite or .onnx file (seg-export --format tflite or onnx)")
    check_threads(args.threads)
    check_runtime(args.model, "--model")


def checkpoint_command(argv, prog: str, description: str, add_arguments, fail_fast, run, run_model=None,
                       start_weights: bool = False) -> int:
    """seg-eval, seg-predict and seg-export: a config, towers and CKPT_OR_RUN_DIR.

    Args:
      add_arguments: adds the command's own arguments to the parser.
      fail_fast: checks the command's arguments before TensorFlow's slow start.
      run: run(cfg, strategy, args), the command itself.
      run_model: run_model(cfg, args) for --model FILE.tflite|FILE.onnx, run by LiteRT or ONNX Runtime without
        towers (None: no --model).
      start_weights: without --checkpoint (and --model), run on the model as model.init_weights starts it
        (args.checkpoint None).
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_common(parser)
    add_checkpoint_arg(parser, model_flag=run_model is not None, optional=start_weights)
    add_arguments(parser)
    args = parser.parse_args(argv)

    def main(args):
        fail_fast(args)
        if getattr(args, "model", None) is not None:
            precheck_model(args)
            from seg_train import config as config_lib
            setup_logging(args.debug)
            cfg = config_lib.load(args.config, args.overrides)
            preflight.for_evaluation(cfg)
            import_tensorflow(args.debug)  # the reader lists and opens files through tf.io.gfile
            run_model(cfg, args)
            return 0
        if args.checkpoint is not None:
            precheck_checkpoint(args.checkpoint)
            cfg, strategy = setup(args, checks=preflight.for_evaluation)
        else:
            cfg, strategy = setup(args, checks=_starting_weights_checks)
        run(cfg, strategy, args)
        return 0

    return run_guarded(main, args, end_process=argv is None)


def _starting_weights_checks(cfg) -> None:
    """No --checkpoint: the config must say where the model starts from (model.init_weights)."""
    if cfg.model.init_weights is None:
        raise ConfigError("nothing to evaluate", "--checkpoint",
                          "a checkpoint, --model FILE.tflite, or a config with model.init_weights (the model as "
                          "it starts from them)")
    preflight.for_evaluation(cfg)


def print_json(record: dict) -> None:
    """--json: the record as one line, the last of stdout."""
    import json
    sys.stdout.flush()
    print(json.dumps(record), flush=True)



# The model families every command trains, evaluates, predicts with or exports (model.head / model.backbone).
MODEL_FAMILIES = "DeepLabV3+, LR-ASPP, SegFormer (MiT), DINOv3 / DINOv2 ViTs or EoMT"
