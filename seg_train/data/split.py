"""The front door of the data: a split opened for a config (`open_split`), and the dataset_fn that deals
its training stream to the towers (`train_dataset_fn`).

Every command reads its data through here. Opening a split: generate the synthetic set if asked for
and incomplete; build the label table (labels.py); list the samples (layouts.py); make the reader
(reader.py). Class names (`class_names_of`) are read lazily: they belong to the config, and seg-export
needs them with no split.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from seg_train.config import Config, ConfigError
from seg_train.data import checks, files, labels, layouts, panoptic, synthetic, synthetic_panoptic
from seg_train.data.label_images import load_class_names
from seg_train.data.layouts import Sample
from seg_train.data.reader import ImageReader

log = logging.getLogger("seg_train")


@dataclass
class Split:
    """One split of the configured data, opened (`open_split`)."""
    cfg: Config
    name: str  # the split's name or list file, as the config or --split gives it
    reader: ImageReader

    @property
    def samples(self) -> list[Sample]:
        """The split's samples (a scan with data.on_bad_sample: skip drops the bad ones from the reader)."""
        return self.reader.samples

    @property
    def label_table(self):
        """Raw label value -> train id (labels.label_table), or None: labels hold train ids as stored; for
        data.task panoptic and instance the panoptic.SegmentCodec that decodes the segment labels."""
        return self.reader.label_table

    @property
    def categories(self) -> panoptic.Categories | None:
        """data.task panoptic and instance: the classes' category ids, names and things (categories_of)."""
        return None if self.reader.codec is None else self.reader.codec.categories

    @functools.cached_property
    def class_names(self) -> list[str]:
        """The config's class names (`class_names_of`), read once."""
        return class_names_of(self.cfg)

    def __len__(self) -> int:
        return len(self.reader)


def open_split(cfg: Config, split: str, optional: bool = False) -> Split | None:
    """Opens `split` of the configured data: THE way a command gets at a split.

    Args:
      cfg: the resolved config (its data section and seed).
      split: a split name or list file.
      optional: return None when the split is not there (layouts.split_exists) instead of raising.
    Raises:
      ConfigError: a synthetic set that cannot be written, or what the layout's listing refuses.
    """
    _generate_synthetic(cfg)
    d = cfg.data
    if optional and not layouts.split_exists(d, split):
        return None
    table = labels.label_table(d) if d.task == "semantic" else panoptic.SegmentCodec(d, categories_of(cfg))
    return Split(cfg, split, ImageReader(d, split, cfg.seed, layouts.list_samples(d, split), table))


def categories_of(cfg: Config) -> panoptic.Categories:
    """The classes of data.task panoptic and instance by train id: category id (for writing predictions in the
    data set's ids), name, thing or stuff (data.thing_classes, or the layout's: coco_panoptic's JSON, or its
    TFRecords' index file). THE way the model side learns them; generates the synthetic set if asked for."""
    _generate_synthetic(cfg)
    names = layouts.own_class_names(cfg.data.layout)
    return panoptic.categories(cfg.data, names if names is not None and len(names) == cfg.data.num_classes
                               else None)


def _generate_synthetic(cfg: Config) -> None:
    """Generates the synthetic demo data set at data.root if the config asks for it and it is incomplete."""
    if not cfg.data.synthetic:
        return
    checks.check_synthetic_data(cfg)  # a clear error for a folder that is in the way or read-only
    if not (Path(cfg.data.root) / synthetic.COMPLETE_MARKER).exists():
        log.info("generating the synthetic demo data set in %s", cfg.data.root)
    try:
        if cfg.data.task == "semantic":
            synthetic.generate(cfg.data.root, num_classes=cfg.data.num_classes, seed=0)
        else:
            synthetic_panoptic.generate(cfg.data.root, num_classes=cfg.data.num_classes, seed=0,
                                        thing_classes=cfg.data.thing_classes)
    except OSError as e:  # e.g. the disk filled up while writing
        raise ConfigError("cannot generate the synthetic data set", str(cfg.data.root),
                          f"a folder with room to write it ({e.strerror or e})") from None


def class_names_of(cfg: Config) -> list[str]:
    """data.class_names, else the layout's (same class count), else classes.txt in the data root, else class_i."""
    names, own = cfg.data.class_names, layouts.own_class_names(cfg.data.layout)
    if names is None and own is not None and len(own) == cfg.data.num_classes:
        names = list(own)
    if names is None and cfg.data.layout == "coco_panoptic":
        names = list(categories_of(cfg).names)
    path = files.join(cfg.data.root, "classes.txt")
    try:
        text = files.read_text(path) if names is None and files.is_file(path) else None
        return load_class_names(cfg.data.root, cfg.data.num_classes, names, text)
    except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
        where = "data.class_names" if cfg.data.class_names is not None else path
        raise ConfigError("wrong class names", where, str(e)) from None


def train_dataset_fn(reader: ImageReader, global_batch: int, *, start_step: int, end_step: int | None,
                     micro_batches: int = 1, shard_over_workers: bool = True):
    """The `dataset_fn` of strategy.distribute_datasets_from_function (TrainState.distribute) for `reader`'s
    training stream: THE way a training stream is dealt to towers.

    Each input pipeline (one per worker) reads its own towers' slices of every global batch, so N towers
    on W workers train on the stream 1 tower reads. With `shard_over_workers` False every worker reads
    the whole stream (precise BN: each worker computes the same statistics, nothing to exchange).
    Iterate it through a data.feed.Feed, which releases the iterator without waiting for TensorFlow.

    Args:
      global_batch: data.batch_size: one micro-batch over all towers of all workers.
      start_step: the stream's first step.
      end_step: the step the stream ends before, so no decoding is left in flight when it is dropped;
        None only for a stream read until its Feed is closed.
      micro_batches: train.accumulate_steps.
    """
    def dataset_fn(ctx):
        if shard_over_workers:
            return reader.train_dataset(global_batch, start_step, ctx.num_replicas_in_sync, ctx.input_pipeline_id,
                                        ctx.num_input_pipelines, end_step=end_step, micro_batches=micro_batches)
        local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return reader.train_dataset(global_batch // ctx.num_replicas_in_sync * local, start_step, local, 0, 1,
                                    end_step=end_step, micro_batches=micro_batches)

    return dataset_fn
