#!/usr/bin/env python3
"""Write a split of a data set as sharded TFRecords that seg-train reads with `data.format: tfrecord`.

Usage:
    python scripts/make_tfrecords.py --config configs/voc.yaml --split train --output data/voc-tfrecords
    python scripts/make_tfrecords.py --config configs/voc.yaml --split val --output gs://bucket/voc --shards 8

Reads the split the way seg-train does (data.root, data.layout and the split's list) and writes
OUTPUT/<split>-NNNNN-of-MMMMM.tfrecord plus OUTPUT/<split>.index.json (each record's offset, so the
reader reads any record directly). Each record is a tf.train.Example with TensorFlow's segmentation
feature names (image/encoded: the image file's bytes as they are; image/segmentation/class/encoded: the
label's class indices as a single-channel PNG; image/height, image/width, image/format,
image/filename, image/source_id). Labels are stored raw: data.label_map applies when reading, so the
same records serve any map. Then train with:

    data.root: <OUTPUT>
    data.format: tfrecord        # train_split / val_split name the shard prefixes (or glob patterns)

OUTPUT may be any path TensorFlow's file systems know (a local folder, gs://, s3://, ram://).
Errors are one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the seg-train config whose data section names the split")
    parser.add_argument("--split", required=True, help="split name (e.g. train, val)")
    parser.add_argument("--output", required=True, help="output folder (local path or a TensorFlow file system URL)")
    parser.add_argument("--shards", type=int, default=0,
                        help="number of shard files (default: about 100 MB each by the source files' size)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from seg_train import config as config_lib
    from seg_train.cli import import_tensorflow
    from seg_train.config import ConfigError

    import_tensorflow(debug=False)  # TensorFlow's start-up noise off stderr (file access goes through tf.io.gfile)

    try:
        cfg = config_lib.load(args.config, args.overrides)
        from seg_train.data import records
        from seg_train.data import layouts
        from seg_train.util.progress import progress_bar

        if cfg.data.format == "tfrecord":
            raise ConfigError("already TFRecords", "data.format", "a config that reads image and label files")
        samples = [(s.id, s.image, s.label) for s in layouts.list_samples(cfg.data, args.split)]
        shards = args.shards
        if shards <= 0:
            import tensorflow as tf

            total = sum(tf.io.gfile.stat(p).length for _, i, l_ in samples for p in (i, l_))
            shards = max(1, round(total / 100e6))
        bar = progress_bar(len(samples), f"writing {args.split}")
        try:
            index = records.write_split(samples, args.output, args.split, shards, bar)
        finally:
            bar.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a sample that cannot be converted: named by write_split
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = sum(s["size"] for s in index["shards"])
    print(f"wrote {index['num_records']} records of split {args.split!r} in {len(index['shards'])} shard(s), "
          f"{sizes / 1e6:.1f} MB, to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
