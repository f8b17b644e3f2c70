"""Command-line entry points: the only place that reads argv and the environment and sets up logging.

User errors print one line `error: <what> (<where>): <expected>` on stderr and exit 2; `--debug`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import tempfile
import traceback

from seg_train.config import ConfigError

log = logging.getLogger("seg_train")

EXIT_USER_ERROR, EXIT_INTERNAL = 2, 1


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


def add_file_log(path) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(message)s"))
    log.addHandler(handler)


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


def import_tensorflow(debug: bool):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if debug else "2")
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
    from seg_train.reader import BadSample
    if isinstance(e, BadSample):
        return str(e)
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(e, tf.errors.OpError):
        # A BadSample raised inside tf.data's numpy_function arrives wrapped in an OpError.
        m = re.search(r"BadSample: (.*?)(?:\n|$)", e.message)
        if m:
            return m.group(1).strip()
    return None


def run_guarded(main, args) -> int:
    """Runs main(args) and turns user errors into `error: ...` lines and exit code 2."""
    try:
        return main(args)
    except KeyboardInterrupt:
        print("error: interrupted (keyboard): no checkpoint written for the step in progress", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the boundary where every error becomes an exit code
        if getattr(args, "debug", False):
            traceback.print_exc()
        msg = user_error(e)
        if msg is not None:
            print(f"error: {msg}", file=sys.stderr)
            return EXIT_USER_ERROR
        if not getattr(args, "debug", False):
            print(f"error: internal error ({type(e).__name__}): {str(e).splitlines()[0] if str(e) else ''} "
                  "-- rerun with --debug for the traceback", file=sys.stderr)
        return EXIT_INTERNAL


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (dotted, YAML-typed; repeatable), e.g. --set train.num_steps=100")
    parser.add_argument("--gpus", type=int, default=1, help="number of towers (GPUs; logical CPU devices if none)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and TensorFlow's own logs")


def _setup(args, run_dir_flag=None):
    """Loads the config (no TF), imports TF quietly, picks devices and builds the strategy."""
    from seg_train import config as config_lib
    setup_logging(args.debug)
    cfg = config_lib.load(args.config, args.overrides, run_dir_flag)
    if args.gpus < 1:
        raise ConfigError("invalid --gpus", "--gpus", f"expected a positive number of towers, got {args.gpus}")
    import_tensorflow(args.debug)
    from seg_train import replicas
    with quiet_stderr(args.debug):
        devices = replicas.setup_devices(args.gpus)
        strategy = replicas.make_strategy(devices)
    log.info("%s", devices.message)
    return cfg, strategy


def train_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="seg-train", description="Train DeepLabV3+ semantic segmentation on several GPUs (towers in one graph).")
    _common(parser)
    parser.add_argument("--run-dir", help="where checkpoints, events and the resolved config go (overrides run_dir)")
    parser.add_argument("--init-from", metavar="CKPT_OR_RUN_DIR",
                        help="initialise weights from a seg-train checkpoint (layers with other shapes are skipped)")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though the config changes what the checkpoint means")
    parser.add_argument("--check-data", action="store_true",
                        help="scan the train and val splits, report problems and a per-class pixel histogram, exit")
    args = parser.parse_args(argv)

    def main(args):
        if args.check_data:
            return check_data_main(args)
        cfg, strategy = _setup(args, args.run_dir)
        from seg_train.train import train
        return train(cfg, strategy, init_from=args.init_from, allow_config_change=args.allow_config_change)

    return run_guarded(main, args)


def _checkpoint_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="CKPT_OR_RUN_DIR",
                        help="a run dir (newest checkpoint), its checkpoints/ or best/ folder, or a checkpoint prefix")


def _precheck_checkpoint(path: str) -> None:
    """Fails fast, before TensorFlow's slow import, on a checkpoint path that does not exist at all."""
    from pathlib import Path
    if not Path(path).exists() and not Path(path + ".index").is_file():
        raise ConfigError("checkpoint not found", path,
                          "expected a run dir, a checkpoints/ folder or a checkpoint prefix")


def eval_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="seg-eval", description="Evaluate a checkpoint at full resolution: per-class IoU, mIoU, pixel accuracy. "
        "Writes RUN_DIR/eval/<split>-step<k>.json.")
    _common(parser)
    _checkpoint_arg(parser)
    parser.add_argument("--split", help="split to evaluate (default: data.val_split)")
    args = parser.parse_args(argv)

    def main(args):
        _precheck_checkpoint(args.checkpoint)
        cfg, strategy = _setup(args)
        from seg_train.evaluate import run_eval
        run_eval(cfg, strategy, args.checkpoint, args.split)
        return 0

    return run_guarded(main, args)


def predict_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="seg-predict", description="Segment images of any size: <name>.png (palette PNG of class indices, "
        "original size) and <name>_overlay.jpg for each input.")
    _common(parser)
    _checkpoint_arg(parser)
    parser.add_argument("--output", required=True, metavar="DIR", help="folder for the PNGs and overlays")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="image files or folders of images (one level deep); names must be distinct")
    args = parser.parse_args(argv)

    def main(args):
        from seg_train.predict import check_output_dir, collect_inputs
        collect_inputs(args.inputs)  # fail fast on a bad input, before TensorFlow starts
        check_output_dir(args.output)
        _precheck_checkpoint(args.checkpoint)
        cfg, strategy = _setup(args)
        from seg_train.predict import run_predict
        run_predict(cfg, strategy, args.checkpoint, args.inputs, args.output)
        return 0

    return run_guarded(main, args)


def export_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="seg-export", description="Export a checkpoint as a SavedModel: serving_default(image uint8 "
        "[height, width, 3]) -> classes [height, width], preprocessing inside the graph.")
    _common(parser)
    _checkpoint_arg(parser)
    parser.add_argument("--output", required=True, metavar="DIR", help="SavedModel folder (new or empty)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    args = parser.parse_args(argv)

    def main(args):
        from seg_train.export import check_output
        check_output(args.output, args.force)  # fail fast, before TensorFlow starts
        _precheck_checkpoint(args.checkpoint)
        cfg, strategy = _setup(args)
        from seg_train.export import run_export
        run_export(cfg, strategy, args.checkpoint, args.output, args.force)
        return 0

    return run_guarded(main, args)


def check_data_main(args) -> int:
    """seg-train --check-data: scan the splits without TensorFlow's devices; exit 2 if a sample is bad."""
    from seg_train import config as config_lib
    setup_logging(args.debug)
    cfg = config_lib.load(args.config, args.overrides, args.run_dir)
    import_tensorflow(args.debug)
    from seg_train.datacheck import format_report, scan
    from seg_train.palette import load_class_names
    from seg_train.train import prepare_data
    from seg_train.reader import ImageReader, split_file
    prepare_data(cfg)
    names = load_class_names(cfg.data.root, cfg.data.num_classes, cfg.data.class_names)
    bad = 0
    for split in dict.fromkeys([cfg.data.train_split, cfg.data.val_split]):
        if split == cfg.data.val_split and not split_file(cfg.data.root, split).is_file():
            print(f"split {split}: not found ({split_file(cfg.data.root, split)}), skipped")
            continue
        reader = ImageReader(cfg.data, split, cfg.seed)
        report = scan(reader.samples, cfg.data.num_classes, cfg.data.ignore_label, f"split {split}")
        print(f"split {split}: " + format_report(report, names))
        bad += len(report.bad)
    if bad:
        print(f"error: {bad} bad sample(s) ({cfg.data.root}): see the list above", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(train_main())
