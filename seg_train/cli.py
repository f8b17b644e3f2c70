"""Command-line entry points: the only place that reads argv and sets up logging.

The environment is used here too (TF_CPP_MIN_LOG_LEVEL and the CPU allocator set before TensorFlow
starts, TF_CONFIG to tell a lost peer from a bug) and in replicas.py (TF_CONFIG: the multi-worker cluster).

User errors print one line `error: <what> (<where>): <expected>` on stderr and exit 2; `--debug`
shows the traceback instead. Run as a command (argv None), every entry point ends the process itself,
skipping the interpreter's final tear-down (see `_end_process`).
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

from seg_train.util import exit_codes, preflight
from seg_train.config import ConfigError, without_reprs
# Imported before _end_process is registered, so that feed's exit hook (waiting for iterator releases)
# runs after it: never in a command, which ends its process first (seg_train/data/feed.py).
from seg_train.data import feed  # noqa: F401

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
    """Keeps TensorFlow's C++ start-up noise (CUDA probes, oneDNN banners) off the user's screen.

    TF_CPP_MIN_LOG_LEVEL does not silence the lines printed before absl logging starts, so fd 2 is
    pointed at a temporary file while TensorFlow loads and picks devices; --debug shows them.
    """
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


# TensorFlow's CPU device allocates through the C library's malloc unless told otherwise. glibc's malloc
# gives every freed block above its mmap threshold (at most 32 MB: a real batch's activations and their
# gradients are larger) back to the kernel, so every step maps, page-faults and zeroes them again.
# Measured on a 2-core AVX2 machine (docs/ACCURACY.md, "CPU allocator"): a third of the CamVid
# recipe's train-step CPU time was kernel time, and the step ran 1.7x faster with TensorFlow's own
# pooling BFC allocator (the one it uses for GPU memory), asked for here by TensorFlow's own variable.
# The numbers are the same bit for bit (an allocator does not change what ops compute). A value the
# user set wins (TF_CPU_ALLOCATOR_USE_BFC=false turns it off; TensorFlow caps the pool at
# TF_CPU_BFC_MEM_LIMIT_IN_MB, 64 GB unless set). On GPUs it is the host-side allocator only.
TF_ENV_DEFAULTS = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def set_tf_env_defaults() -> None:
    """TensorFlow settings read from the environment (TF_ENV_DEFAULTS), unless the user set them."""
    for key, value in TF_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def import_tensorflow(debug: bool):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if debug else "2")
    set_tf_env_defaults()
    with quiet_stderr(debug):
        import tensorflow as tf  # noqa: F401
        import keras  # noqa: F401
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
    # Only once the reader is loaded can `e` be one of its BadSamples; importing it here would start
    # TensorFlow (and its start-up noise) just to report an error raised before it was needed.
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
    """An exit hook: ends the process with the command's exit code before Python's interpreter
    tear-down begins.

    Why: once that tear-down has begun, Python ends any thread that asks for the GIL, and the
    objects still alive are destroyed. A tf.data iterator destroyed then with decode calls in flight
    (the reader decodes in Python, through tf.numpy_function) waits forever for calls whose threads
    were ended: the process hung after printing its error (tests/test_exit_hang.py). The commands
    now release their iterators on threads of their own (seg_train/data/feed.py): ending the process
    here does not wait for them, where the tear-down would end such a thread on its way out of
    TensorFlow's destructor, which aborts the process.

    Nothing a user needs is skipped. Registered as the command starts (before TensorFlow is
    imported), this hook runs after the exit hooks added later (TensorFlow's, the removal of
    autograph's generated files and of temporary folders) and after non-daemon threads were joined,
    with the interpreter intact. Checkpoints, SavedModels, JSON and PNG files are complete when the
    call writing them returns, and tf.summary writers hand each event to its file as it is written
    (tests/test_exit_hang.py checks that an unflushed writer's events survive). Logging (whose own
    hook, registered earlier, would run after this one) and stdout (the JSON of `--json`) and stderr
    are flushed here.
    """
    if _exit_code is None:  # the command did not return (e.g. a SystemExit escaped it): Python's own exit
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_exit_code)


def run_guarded(main, args, end_process: bool = False) -> int:
    """Runs main(args) and turns user errors into `error: ...` lines and exit code 2.

    end_process: this call is the whole process (a console script, argv None), so the process ends
    right after Python's exit hooks, with the returned code (`_end_process`); an in-process caller
    (argv given, e.g. the tests) just gets the code.
    """
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
    """seg-train's version, then TensorFlow's and Keras' (and TensorBoard's), one per line.

    Read from the installed packages' metadata: importing TensorFlow just to print its version takes
    seconds. TensorFlow is imported (quietly) only if its distribution is not found under its usual
    name.
    """
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


def _version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action=_VersionAction,
                        help="print the seg-train, TensorFlow, Keras and TensorBoard versions and exit")


def _common(parser: argparse.ArgumentParser) -> None:
    _version(parser)
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (dotted, YAML-typed; repeatable), e.g. --set train.num_steps=100")
    parser.add_argument("--gpus", type=int, default=1, help="number of towers (GPUs; logical CPU devices if none)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and TensorFlow's own logs")


def _setup(args, run_dir_flag=None, checks=None):
    """Loads the config (no TF), runs `checks(cfg)` (seg_train.util.preflight, no TF), imports TF quietly,
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
    from seg_train.dist import replicas
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


def train_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="seg-train",
        description="Train semantic segmentation (DeepLabV3+ or LR-ASPP) on several GPUs (towers in one graph).")
    _common(parser)
    parser.add_argument("--run-dir", help="where checkpoints, events and the resolved config go (overrides run_dir)")
    parser.add_argument("--init-from", metavar="CKPT_OR_RUN_DIR",
                        help="initialise weights from a seg-train checkpoint (layers with other shapes are skipped)")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though the config changes what the checkpoint means")
    parser.add_argument("--workers", metavar="HOST:PORT,...",
                        help="train on several machines (MultiWorkerMirroredStrategy); same as setting TF_CONFIG")
    parser.add_argument("--worker-index", type=int, help="this machine's index in --workers (0 is the chief)")
    parser.add_argument("--check-data", action="store_true",
                        help="scan the train and val splits, report problems and a per-class pixel histogram, exit")
    args = parser.parse_args(argv)
    args.multiworker_ok = True

    def main(args):
        if args.check_data:
            return check_data_main(args)
        if args.init_from:
            _precheck_checkpoint(args.init_from)
        cfg, strategy = _setup(args, args.run_dir, checks=preflight.for_training)
        from seg_train.train.train import train
        return train(cfg, strategy, init_from=args.init_from, allow_config_change=args.allow_config_change)

    return run_guarded(main, args, end_process=argv is None)


def _checkpoint_arg(parser: argparse.ArgumentParser, model_flag: bool = False) -> None:
    help_ = "a run dir (newest checkpoint), its checkpoints/ or best/ folder, or a checkpoint prefix"
    if not model_flag:
        parser.add_argument("--checkpoint", required=True, metavar="CKPT_OR_RUN_DIR", help=help_)
        return
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", metavar="CKPT_OR_RUN_DIR", help=help_)
    which.add_argument("--model", metavar="FILE.tflite",
                       help="a .tflite file (seg-export --format tflite), run in LiteRT's interpreter "
                            "(needs pip install 'seg-train[tflite]')")
    parser.add_argument("--threads", type=int, default=1,
                        help="LiteRT interpreter threads with --model (default 1)")


def _precheck_checkpoint(path: str) -> None:
    """Fails fast, before TensorFlow's slow import, on a checkpoint path that does not exist at all."""
    from pathlib import Path
    if not Path(path).exists() and not Path(path + ".index").is_file():
        raise ConfigError("checkpoint not found", path,
                          "expected a run dir, a checkpoints/ folder or a checkpoint prefix")


def _precheck_model(args) -> None:
    """--model: the file exists and LiteRT is installed, before TensorFlow's slow import."""
    from pathlib import Path
    from seg_train.infer.litert import check_threads, interpreter_class
    if not Path(args.model).is_file():
        raise ConfigError("model file not found", args.model, "a .tflite file (seg-export --format tflite)")
    check_threads(args.threads)
    interpreter_class("--model")


def _checkpoint_command(argv, prog: str, description: str, add_arguments, fail_fast, run, run_model=None) -> int:
    """seg-eval, seg-predict and seg-export: a config, towers and CKPT_OR_RUN_DIR.

    Args:
      add_arguments: adds the command's own arguments to the parser.
      fail_fast: checks the command's arguments before TensorFlow's slow start (then the checkpoint
        path is checked the same way).
      run: run(cfg, strategy, args), the command itself.
      run_model: run_model(cfg, args) for --model FILE.tflite (None: the command has no --model).
        LiteRT runs the file; no towers are set up.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    _common(parser)
    _checkpoint_arg(parser, model_flag=run_model is not None)
    add_arguments(parser)
    args = parser.parse_args(argv)

    def main(args):
        fail_fast(args)
        if getattr(args, "model", None) is not None:
            _precheck_model(args)
            from seg_train import config as config_lib
            setup_logging(args.debug)
            cfg = config_lib.load(args.config, args.overrides)
            preflight.for_evaluation(cfg)
            import_tensorflow(args.debug)  # the reader lists and opens files through tf.io.gfile
            run_model(cfg, args)
            return 0
        _precheck_checkpoint(args.checkpoint)
        cfg, strategy = _setup(args, checks=preflight.for_evaluation)
        run(cfg, strategy, args)
        return 0

    return run_guarded(main, args, end_process=argv is None)


def _print_json(record: dict) -> None:
    """--json: the record as one line, the last of stdout."""
    import json
    sys.stdout.flush()
    print(json.dumps(record), flush=True)


def eval_main(argv=None) -> int:
    def add_arguments(parser):
        parser.add_argument("--split", help="split to evaluate (default: data.val_split)")
        parser.add_argument("--json", action="store_true",
                            help="print the evaluation record (the JSON file's object) as the last line of stdout")

    def run(cfg, strategy, args):
        from seg_train.infer.eval_checkpoint import run_eval
        record = run_eval(cfg, strategy, args.checkpoint, args.split)
        if args.json:
            _print_json(record)

    def run_model(cfg, args):
        from seg_train.infer.litert import run_eval_tflite
        record = run_eval_tflite(cfg, args.model, args.split, args.threads)
        if args.json:
            _print_json(record)

    return _checkpoint_command(
        argv, "seg-eval", "Evaluate a checkpoint at full resolution, or a .tflite file in LiteRT: per-class IoU, "
        "mIoU, pixel accuracy. Writes RUN_DIR/eval/<split>-step<k>.json (a checkpoint) or "
        "FILE.eval-<split>.json beside FILE.tflite.", add_arguments, lambda args: None, run, run_model)


def predict_main(argv=None) -> int:
    def add_arguments(parser):
        parser.add_argument("--output", required=True, metavar="DIR", help="folder for the PNGs and overlays")
        parser.add_argument("--label-ids", action="store_true",
                            help="write only the data set's raw label values (Cityscapes labelIds as "
                                 "<city>_<seq>_<frame>_labelIds.png, ADE20K 1..150, VOC indices, the inverse of "
                                 "data.label_map), single-channel PNGs as the official evaluators read them")
        parser.add_argument("inputs", nargs="+", metavar="INPUT",
                            help="image files or folders of images (one level deep); names must be distinct")

    def fail_fast(args):
        from seg_train.infer.predict import check_output_dir, collect_inputs
        collect_inputs(args.inputs, args.label_ids)
        check_output_dir(args.output)

    def run(cfg, strategy, args):
        from seg_train.infer.predict import run_predict
        run_predict(cfg, strategy, args.checkpoint, args.inputs, args.output, label_ids=args.label_ids)

    def run_model(cfg, args):
        from seg_train.infer.litert import run_predict_tflite
        run_predict_tflite(cfg, args.model, args.inputs, args.output, args.threads, label_ids=args.label_ids)

    return _checkpoint_command(
        argv, "seg-predict", "Segment whole images (each in one pass: any size that fits in memory; with --model, "
        "resized to the .tflite file's input size and back): <name>.png (palette PNG of class indices, original "
        "size) and <name>_overlay.jpg for each input, or with --label-ids one PNG of the data set's raw label "
        "values.", add_arguments, fail_fast, run, run_model)


def export_main(argv=None) -> int:
    def add_arguments(parser):
        parser.add_argument("--output", required=True, metavar="DIR|FILE.tflite",
                            help="SavedModel folder (new or empty), or the .tflite file with --format tflite")
        parser.add_argument("--force", action="store_true", help="replace a non-empty output folder or a file")
        parser.add_argument("--format", choices=("savedmodel", "tflite"), default="savedmodel",
                            help="savedmodel (any image size, the eval.* inference modes; default) or tflite "
                                 "(a fixed input size, one pass, for LiteRT)")
        parser.add_argument("--input-size", type=int, nargs=2, metavar=("H", "W"),
                            help="tflite: the model's input size (default: eval.crop_size, else data.crop_size)")
        parser.add_argument("--quantize", choices=("none", "float16", "int8"), default="none",
                            help="tflite: float32 (none, default), float16 weights, or full-integer int8 "
                                 "(calibrated on training images)")
        parser.add_argument("--calibration-images", type=int, default=200, metavar="N",
                            help="tflite int8: training images to calibrate on (default 200)")
        parser.add_argument("--float-ops", metavar="OPS",
                            help="tflite int8: TFLite op kinds to keep in float32, comma-separated (e.g. "
                                 "BATCH_MATMUL,SOFTMAX,GELU,RSQRT,SQUARED_DIFFERENCE for a SegFormer on XNNPACK)")
        parser.add_argument("--probabilities", action="store_true",
                            help="tflite: also output the softmax [1, H, W, C] beside the class map")
        parser.add_argument("--check", action="store_true",
                            help="tflite: evaluate the file (and, if quantized, the float32 conversion) in LiteRT "
                                 "on data.val_split and print mIoU, size and latency side by side")
        parser.add_argument("--threads", type=int, default=1, help="tflite --check: LiteRT threads (default 1)")

    def fail_fast(args):
        if args.format == "tflite":
            from seg_train.infer.litert import check_threads
            from seg_train.infer.tflite_export import check_calibration_images, check_output_file
            check_output_file(args.output, args.force)
            if args.check:
                from seg_train.infer.litert import interpreter_class
                interpreter_class("seg-export --check")
            check_calibration_images(args.calibration_images)
            check_threads(args.threads)
            from seg_train.infer.tflite_export import parse_float_ops
            parse_float_ops(args.float_ops, args.quantize)
            return
        given = [flag for flag, value in (("--input-size", args.input_size), ("--quantize", args.quantize != "none"),
                                          ("--probabilities", args.probabilities), ("--check", args.check),
                                          ("--float-ops", args.float_ops))
                 if value]
        if given:
            raise ConfigError(f"{given[0]} needs --format tflite", given[0],
                              "--format tflite (the SavedModel takes any image size, in float32)")
        from seg_train.infer.export import check_output
        check_output(args.output, args.force)

    def run(cfg, strategy, args):
        if args.format == "tflite":
            from seg_train.infer.tflite_export import parse_float_ops, run_export_tflite
            run_export_tflite(cfg, strategy, args.checkpoint, args.output, force=args.force, size=args.input_size,
                              quantize=args.quantize, calibration_images=args.calibration_images,
                              probabilities=args.probabilities, check=args.check, threads=args.threads,
                              float_ops=parse_float_ops(args.float_ops, args.quantize))
            return
        from seg_train.infer.export import run_export
        run_export(cfg, strategy, args.checkpoint, args.output, args.force)

    return _checkpoint_command(
        argv, "seg-export", "Export a checkpoint as a SavedModel: serving_default(image uint8 [height, width, 3]) "
        "-> classes [height, width], preprocessing inside the graph; or with --format tflite as one .tflite file "
        "(uint8 [1, H, W, 3] -> classes uint8 [1, H, W]; float32, float16 or int8) for LiteRT.",
        add_arguments, fail_fast, run)


def check_data_main(args) -> int:
    """seg-train --check-data: scan the splits without TensorFlow's devices; exit 2 if a sample is bad."""
    from seg_train import config as config_lib
    setup_logging(args.debug)
    cfg = config_lib.load(args.config, args.overrides, args.run_dir)
    import_tensorflow(args.debug)
    from seg_train.data.scan import format_report, scan_cached
    from seg_train.data.split import open_split
    from seg_train.data import layouts
    train = open_split(cfg, cfg.data.train_split)
    names = train.class_names  # a wrong classes.txt is a one-line user error (exit 2)
    bad = lossy = 0
    for split in dict.fromkeys([cfg.data.train_split, cfg.data.val_split]):
        opened = train if split == cfg.data.train_split else open_split(cfg, split, optional=True)
        if opened is None:
            print(f"split {split}: not found ({layouts.split_location(cfg.data, split)}), skipped")
            continue
        # Always decoded (refresh): the check is of the files as they are now; it renews the scan cache.
        report = scan_cached(cfg, opened.reader, f"split {split}", refresh=True)
        print(f"split {split}: " + format_report(report, names))
        bad += len(report.bad)
        lossy += report.lossy
    if bad:
        of_them = f", {lossy} of them lossy JPEG labels (convert those to PNG)" if lossy else ""
        print(f"error: {bad} bad sample(s) ({cfg.data.root}): see the list above{of_them}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def bench_main(argv=None) -> int:
    """seg-bench: training images/s per tower count, input speed and wait, FLOP utilisation, peak memory."""
    parser = argparse.ArgumentParser(
        prog="seg-bench", description="Benchmark the train step: images/s (global and per tower) and scaling "
        "efficiency for each tower count, the input pipeline alone and the time spent waiting for it, achieved "
        "FLOP/s against a peak measured in the same run, peak resident memory. See docs/PERFORMANCE.md.")
    _version(parser)
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (dotted, YAML-typed; repeatable), "
                        "e.g. --set train.precision=mixed_bfloat16")
    parser.add_argument("--gpus", default="1", metavar="N[,N...]",
                        help="tower counts to measure, e.g. 1,2,4 (logical CPU devices if no GPU); default 1")
    parser.add_argument("--steps", type=int, default=10, metavar="K", help="timed steps per window (default 10)")
    parser.add_argument("--windows", type=int, default=3, help="timed windows; the median is reported (default 3)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first, tracing included (default 3)")
    parser.add_argument("--pickup", type=int, default=1,
                        help="untimed steps at the start of each window when several set-ups alternate (default 1)")
    parser.add_argument("--input", choices=("reader", "cached"), default="reader",
                        help="train from the real ImageReader (default) or from the same batches cached in memory")
    parser.add_argument("--compare", action="append", default=[], metavar="KEY=VALUE[,VALUE...]",
                        help="also time the config with KEY=VALUE (a config key, e.g. train.precision=mixed_bfloat16; "
                        "input=cached; loop=blocking: the host waits for every step), "
                        "interleaved with the base config; "
                        "repeatable; reports speedups vs the base. train.accumulate_steps=K divides data.batch_size "
                        "by K (the same images per update) and also reports each variant's peak memory")
    parser.add_argument("--bn-images", type=int, default=200, metavar="N",
                        help="time precise-BN re-estimation on N training images per tower count "
                        "(0: skip; default 200)")
    parser.add_argument("--eval-images", type=int, default=64, metavar="N",
                        help="time evaluation on the first N val images per tower count (0: skip; default 64)")
    parser.add_argument("--no-probes", action="store_true",
                        help="skip the fresh seg-train processes that time the first step from launch (with and "
                        "without synchronized BN) and the accumulation variants' peak memory")
    parser.add_argument("--no-input-alone", action="store_true", help="skip timing the input pipeline alone")
    parser.add_argument("--input-only", action="store_true",
                        help="time the input pipeline alone and nothing else (e.g. with --set data.cache=true)")
    parser.add_argument("--no-peak", action="store_true", help="skip measuring the device peak FLOP/s")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile 2 steps of each runner: op time per op type (where the time goes)")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and TensorFlow's own logs")
    parser.add_argument("--verify-towers", action="store_true",
                        help="self-test instead of timing: one step on 1 tower and on --gpus N towers (synchronized "
                        "BN, same weights and batch); prints how far apart the gradients and BN statistics are; "
                        "exit 0 if within tolerance, 1 if not")
    args = parser.parse_args(argv)

    def main(args):
        if args.verify_towers:
            return verify_towers_main(args)
        import json
        from seg_train import config as config_lib
        from seg_train.bench.report import format_report
        from seg_train.bench.runner import parse_towers
        setup_logging(args.debug)
        towers = parse_towers(args.gpus)
        for name in ("steps", "windows"):
            if getattr(args, name) < 1:
                raise ConfigError(f"invalid --{name}", f"--{name}",
                                  f"expected a positive integer, got {getattr(args, name)}")
        if args.pickup < 0:
            raise ConfigError("invalid --pickup", "--pickup", f"expected an integer >= 0, got {args.pickup}")
        if args.warmup < 1:
            raise ConfigError("invalid --warmup", "--warmup",
                              f"expected at least 1 (tracing is never timed), got {args.warmup}")
        cfg = config_lib.load(args.config, args.overrides)
        variants = None
        if args.compare:
            from seg_train.bench.runner import Variant
            variants = [Variant("base", cfg, args.input)]
            for spec in args.compare:
                key, sep, values = spec.partition("=")
                key, values = key.strip(), [v.strip() for v in values.split(",") if v.strip()]
                if not sep or not key or not values:
                    raise ConfigError("invalid --compare", "--compare",
                                      "expected KEY=VALUE[,VALUE...] (e.g. train.precision=mixed_bfloat16), "
                                      f"got {spec!r}")
                for v in values:
                    if key == "input":
                        if v not in ("reader", "cached"):
                            raise ConfigError("invalid --compare", "--compare",
                                              f"expected input=reader or cached, got {v!r}")
                        variants.append(Variant(f"input={v}", cfg, v))
                    elif key == "loop":
                        if v not in ("overlapped", "blocking"):
                            raise ConfigError("invalid --compare", "--compare",
                                              f"expected loop=overlapped or blocking, got {v!r}")
                        variants.append(Variant(f"loop={v}", cfg, args.input, v))
                    else:
                        extra = [f"{key}={v}"]
                        if key == "train.accumulate_steps":
                            # The same images per update: K micro-batches of batch / K.
                            k = config_lib.parse_override(f"{key}={v}")[1]
                            if not isinstance(k, int) or k < 1 or cfg.data.batch_size % k:
                                raise ConfigError("invalid --compare", "--compare",
                                                  f"train.accumulate_steps=K with K dividing data.batch_size "
                                                  f"({cfg.data.batch_size}), got {v!r}")
                            extra.append(f"data.batch_size={cfg.data.batch_size // k}")
                        variants.append(Variant(f"{key}={v}", config_lib.load(args.config, args.overrides + extra),
                                                args.input, overrides=tuple(extra)))
        for name in ("bn_images", "eval_images"):
            if getattr(args, name) < 0:
                raise ConfigError(f"invalid --{name.replace('_', '-')}", f"--{name.replace('_', '-')}",
                                  f"expected an integer >= 0, got {getattr(args, name)}")
        preflight.for_evaluation(cfg)
        import_tensorflow(args.debug)
        from seg_train.dist import replicas
        from seg_train.bench import runner as bench
        with quiet_stderr(args.debug):
            # The logical devices are configured once, for the largest tower count, before TF starts.
            devices = replicas.setup_devices(max(towers))
        log.info("%s", devices.message)
        # With --json, stdout carries exactly one JSON object: anything else printed goes to stderr.
        if args.input_only:
            with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
                result = bench.run_input_only(cfg, steps=args.steps, windows=args.windows, warmup=args.warmup)
            result["config"], result["overrides"] = os.path.abspath(args.config), list(args.overrides)
            inp, floor = result["input"], result["decode_floor"]
            print(json.dumps(result) if args.json else
                  f"input pipeline alone: {inp['images_per_sec']:.1f} images/s, {inp['cores_busy']:.2f} cores busy "
                  f"(global batch {result['global_batch']}, "
                  f"data.cache {result['cache']}" + (f"; first pass {inp['first_pass_images_per_sec']:.1f} images/s, "
                  f"cache {inp['cache_mb']:.0f} MiB" if result["cache"] else "") + ")\n"
                  f"                    {'images/s':>9} {'cores busy':>11} {'CPU ms/sample':>14}\n"
                  f"input pipeline    {inp['images_per_sec']:9.1f} {inp['cores_busy']:11.2f} "
                  f"{inp['cpu_ms_per_sample']:14.1f}\n"
                  f"decode only       {floor['images_per_sec']:9.1f} {floor['cores_busy']:11.2f} "
                  f"{floor['cpu_ms_per_sample']:14.1f}\n"
                  f"CPU per sample: {result['cpu_per_sample_vs_floor']:.2f}x the decode-only floor (the same "
                  "samples, decoded by the reader's decoders, no augmentation)")
            return 0
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            result = bench.run(cfg, towers, devices, steps=args.steps, windows=args.windows, warmup=args.warmup,
                               input_mode=args.input, measure_input=not args.no_input_alone,
                               measure_peak_flops=not args.no_peak, variants=variants,
                               profile=args.profile, pickup=args.pickup, config_path=os.path.abspath(args.config),
                               overrides=tuple(args.overrides), bn_images=args.bn_images,
                               eval_images=args.eval_images, probes=not args.no_probes)
        result["config"] = os.path.abspath(args.config)
        result["overrides"] = list(args.overrides)
        if args.json:
            print(json.dumps(result))
        else:
            print(format_report(result))
        return 0

    return run_guarded(main, args, end_process=argv is None)


def verify_towers_main(args) -> int:
    """seg-bench --verify-towers (seg_train/bench/verify.py): exit 0 if N towers agree with 1, else 1."""
    import json
    from seg_train import config as config_lib
    from seg_train.bench.runner import parse_towers
    setup_logging(args.debug)
    towers = parse_towers(args.gpus)
    if len(towers) != 1:
        raise ConfigError("invalid --gpus", "--gpus", f"one tower count N with --verify-towers, got {args.gpus!r}")
    cfg = config_lib.load(args.config, args.overrides)
    from seg_train.bench.verify import check_towers
    check_towers(cfg, towers[0])
    preflight.for_evaluation(cfg)
    import_tensorflow(args.debug)
    from seg_train.dist import replicas
    from seg_train.bench import verify
    with quiet_stderr(args.debug):
        devices = replicas.setup_devices(towers[0])
    log.info("%s", devices.message)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        result = verify.run(cfg, devices, towers[0])
    result["config"], result["overrides"] = os.path.abspath(args.config), list(args.overrides)
    print(json.dumps(result) if args.json else verify.format_report(result))
    return exit_codes.OK if result["ok"] else exit_codes.VERIFY_FAILED  # a verdict, not a user error


if __name__ == "__main__":  # pragma: no cover
    sys.exit(train_main())
