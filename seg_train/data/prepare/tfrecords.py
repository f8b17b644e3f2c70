"""Write a split of a data set as sharded TFRecords that seg-train reads with `data.format: tfrecord`.

Usage:
    seg-prepare tfrecords --config configs/voc.yaml --split train --output data/voc-tfrecords
    seg-prepare tfrecords --config configs/voc.yaml --split val --output gs://bucket/voc --shards 8

Reads the split the way seg-train does (data.root, data.layout and the split's list) and writes
OUTPUT/<split>-NNNNN-of-MMMMM.tfrecord plus OUTPUT/<split>.index.json (each record's offset, so the
reader reads any record directly). Each record is a tf.train.Example with TensorFlow's segmentation
feature names (image/encoded: the image file's bytes as they are; image/segmentation/class/encoded: the
label's class indices as a single-channel PNG; image/height, image/width, image/format,
image/filename, image/source_id). Labels are stored raw: data.label_map applies when reading, so the
same records serve any map. With data.task panoptic or instance the label feature holds the label file as it
ships (COCO's RGB PNG, Cityscapes' instanceIds) with a COCO image's segments, and the index file the
categories (data/records.py). Then train with:

    data.root: <OUTPUT>
    data.format: tfrecord        # train_split / val_split name the shard prefixes (or glob patterns)

OUTPUT may be any path TensorFlow's file systems know (a local folder, gs://, s3://, ram://).
Errors are one line on stderr, exit code 2.
"""

from __future__ import annotations


def write_tfrecords(cfg, split: str, output: str, shards: int) -> str:
    """Writes `split` of cfg's data set to `output`; returns the summary line.

    shards: the number of shard files, or <= 0 for about 100 MB each by the source files' size.
    Raises ConfigError for a config or split that cannot be converted, ValueError (naming the sample)
    for a sample that cannot be.
    """
    import tensorflow as tf

    from seg_train.config import ConfigError
    from seg_train.data import layouts, records
    from seg_train.util.progress import progress_bar

    if cfg.data.format == "tfrecord":
        raise ConfigError("already TFRecords", "data.format", "a config that reads image and label files")
    listed = layouts.list_samples(cfg.data, split)
    samples = [(s.id, s.image, s.label) for s in listed]
    encode = extra = None
    if cfg.data.task != "semantic":
        # Segment labels: the files as they ship, each checked by a decode, and the COCO segments_info.
        from seg_train.data.panoptic import SegmentCodec
        from seg_train.data.split import categories_of

        cats = categories_of(cfg)
        codec = SegmentCodec(cfg.data, cats)
        extra = {"categories": [{"id": i, "name": n, "isthing": int(t)}
                                for i, n, t in zip(cats.ids, cats.names, cats.is_thing)]}

        def encode(image, label, sid, n):
            return records.encode_segment_sample(image, label, sid, codec, listed[n].segments)
    if shards <= 0:
        total = sum(tf.io.gfile.stat(p).length for _, i, l_ in samples for p in (i, l_))
        shards = max(1, round(total / 100e6))
    bar = progress_bar(len(samples), f"writing {split}")
    try:
        index = records.write_split(samples, output, split, shards, bar, encode, extra)
    finally:
        bar.close()
    sizes = sum(s["size"] for s in index["shards"])
    return (f"wrote {index['num_records']} records of split {split!r} in {len(index['shards'])} shard(s), "
            f"{sizes / 1e6:.1f} MB, to {output}")
