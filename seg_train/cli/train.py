"""seg-train, and seg-train --check-data (the splits scanned, nothing trained)."""

from __future__ import annotations

import argparse
import sys

from seg_train.cli import preflight, process
from seg_train.util import exit_codes


def train_main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="seg-train",
        description=f"Train semantic segmentation ({process.MODEL_FAMILIES}) on several GPUs (towers in one "
        "graph).")
    process.add_common(parser)
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
            process.precheck_checkpoint(args.init_from)
        cfg, strategy = process.setup(args, args.run_dir, checks=preflight.for_training)
        from seg_train.train.train import train
        return train(cfg, strategy, init_from=args.init_from, allow_config_change=args.allow_config_change)

    return process.run_guarded(main, args, end_process=argv is None)


def check_data_main(args) -> int:
    """seg-train --check-data: scan the splits without TensorFlow's devices; exit 2 if a sample is bad."""
    from seg_train import config as config_lib
    process.setup_logging(args.debug)
    cfg = config_lib.load(args.config, args.overrides, args.run_dir)
    process.import_tensorflow(args.debug)
    from seg_train.data import layouts
    from seg_train.data.scan import format_report, scan_cached
    from seg_train.data.split import open_split
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
        return exit_codes.USER_ERROR
    return 0
