"""ImageReader: a split (in any data.layout, layouts.py) -> tf.data pipelines of (image, label) batches.

decode -> augment (augment.py) -> per-tower batches, in order.py's sample order, and the evaluation samples.

- The training stream is a pure function of (seed, sample counter k), with no pipeline state, so a
  resumed run restarts it at k = step * global_batch exactly (a distributed iterator cannot be
  checkpointed anyway).
- Step s's global batch is samples s*B .. s*B+B-1 whatever the tower count; each pipeline emits its
  towers' slices in turn, as `distribute_datasets_from_function` deals them round-robin.
- Files are decoded by TensorFlow's ops off the GIL (decode.py). A sample they fail on or that fails a
  check is decoded again by `load_sample` (Pillow, full checks), which names the file in a BadSample or
  gives the stand-in (data.on_bad_sample: skip).
- The label map is applied both in `load_sample` and in the graph, from the same table, so every path
  (scan, class weights, data.cache, training) sees the same train ids.
- data.task panoptic and instance: the label table is a panoptic.SegmentCodec and labels are int32 segment
  labels (segments.py), decoded by it in the graph and in `load_segment_sample`; everything after the decode is
  the same (nearest sampling of the label), padding with segments.ignore_value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import posixpath
import threading

import numpy as np
import tensorflow as tf
from PIL import UnidentifiedImageError

from seg_train.config import DataConfig, exception_text
from seg_train.data import augment, files, labels, order, records, segments
from seg_train.data import decode as decoders
from seg_train.data.augment import PHOTOMETRIC_ORDER, apply_photometric, photometric_draws  # noqa: F401 (re-exported)
from seg_train.data.label_images import LOSSY_EXPECTED, LOSSY_WHAT, LossyLabel
from seg_train.data.layouts import Sample
from seg_train.data.panoptic import SegmentCodec, SegmentTable

log = logging.getLogger("seg_train")


class BadSample(ValueError):
    """A sample that cannot be used; the message names the file. `unmapped`: pixels per raw value the
    label map does not cover."""

    def __init__(self, message: str, unmapped: dict[int, int] | None = None):
        super().__init__(message)
        self.unmapped = unmapped or {}


def record_contents(sample: Sample, with_segments: bool = False) -> tuple:
    """(encoded image, encoded label) of a data.format: tfrecord sample, and its segment table (records.
    parse_segments) `with_segments`; BadSample naming the record."""
    try:
        serialized = records.read_record(sample.record)
        image, label, _ = records.parse_example(serialized)
        table = SegmentTable(*records.parse_segments(serialized)) if with_segments else None
    except Exception as e:  # noqa: BLE001 - a damaged record: whatever protobuf or the file system raises
        raise BadSample(f"unreadable record ({sample.image}, at byte {sample.record.offset}): expected a "
                        f"tf.train.Example with an encoded image and label ({type(e).__name__}: "
                        f"{exception_text(e)})") from None
    return (image, label, table) if with_segments else (image, label)


def load(sample: Sample, num_classes: int, ignore_label: int,
         label_table: np.ndarray | SegmentCodec | None = None) -> tuple[np.ndarray, np.ndarray]:
    """load_sample of a Sample: its files, or its record (data.format: tfrecord); load_segment_sample when the
    label table is a SegmentCodec (data.task panoptic and instance)."""
    if isinstance(label_table, SegmentCodec):
        if sample.record is None:
            return load_segment_sample(sample.image, sample.label, label_table, sample.segments)
        image, label, table = record_contents(sample, with_segments=True)
        return load_segment_sample(sample.image, sample.label, label_table, table, (image, label))
    contents = record_contents(sample) if sample.record is not None else None
    return load_sample(sample.image, sample.label, num_classes, ignore_label, label_table, contents)


def load_segment_sample(image_path: str, label_path: str, codec: SegmentCodec, table=None,
                        contents: tuple[bytes, bytes] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """load_sample for data.task panoptic and instance: (uint8 image, int32 segment labels) through `codec`,
    `table` the image's segments (coco_panoptic), with load_sample's checks; BadSample names the file."""
    image = _pillow_image(image_path, contents[0] if contents else None)
    with _label_errors(label_path, "segment ids"):
        label = codec.decode_np(contents[1] if contents else files.read_bytes(label_path), table, label_path)
    _check_label_size(label, image, image_path, label_path)
    return image, label


@contextlib.contextmanager
def _label_errors(label_path: str, content: str):
    """A label file's read and decode errors as one-line BadSamples naming the path (Pillow's own messages would
    name the in-memory BytesIO); `content`: what the PNG holds, for the missing-file message."""
    try:
        yield
    except FileNotFoundError:
        raise BadSample(f"label not found ({label_path}): expected a PNG of {content}") from None
    except LossyLabel:
        raise BadSample(f"{LOSSY_WHAT} ({label_path}): {LOSSY_EXPECTED}") from None
    except UnidentifiedImageError:
        raise BadSample(f"unreadable label ({label_path}): expected a valid PNG (its bytes are of no image "
                        "format Pillow reads)") from None
    except ValueError as e:
        raise BadSample(f"bad label ({label_path}): {str(e).replace(f'{label_path}: ', '')}") from None
    except (OSError, SyntaxError) as e:
        raise BadSample(f"unreadable label ({label_path}): expected a valid PNG ({exception_text(e)})") from None


def _check_label_size(label: np.ndarray, image: np.ndarray, image_path: str, label_path: str) -> None:
    if label.shape != image.shape[:2]:
        raise BadSample(f"label size differs from image ({label_path}): expected {image.shape[1]}x{image.shape[0]} "
                        f"like {posixpath.basename(image_path)}, got {label.shape[1]}x{label.shape[0]}")


def _pillow_image(image_path: str, data: bytes | None) -> np.ndarray:
    """load_sample's image decode (Pillow), BadSample naming the path."""
    try:
        return decoders.pillow_rgb(data if data is not None else files.read_bytes(image_path))
    except FileNotFoundError:
        raise BadSample(f"image not found ({image_path}): expected a readable JPEG/PNG image") from None
    except UnidentifiedImageError:
        raise BadSample(f"unreadable image ({image_path}): expected a valid JPEG/PNG (its bytes are of no "
                        "image format Pillow reads)") from None
    except (OSError, SyntaxError) as e:
        raise BadSample(f"unreadable image ({image_path}): expected a valid JPEG/PNG ({exception_text(e)})") from None


def load_sample(image_path: str, label_path: str, num_classes: int, ignore_label: int,
                label_table: np.ndarray | None = None,
                contents: tuple[bytes, bytes] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decodes one sample with Pillow, with full checks, the label through `label_table` (None: as
    stored); BadSample names the file. `contents`: the encoded image and label when not read from the
    two files (a TFRecord's; the paths then only name the sample in messages).
    """
    # Pillow's own messages would name the in-memory BytesIO, so these messages name the path.
    image = _pillow_image(image_path, contents[0] if contents else None)
    with _label_errors(label_path, "class indices"):
        label = decoders.pillow_label(contents[1] if contents else files.read_bytes(label_path), label_path)
    _check_label_size(label, image, image_path, label_path)
    raw = label
    if label_table is not None:
        mapped = labels.apply(label_table, raw)
        if (mapped == labels.NO_ID).any():
            unmapped = labels.unmapped_counts(label_table, raw)
            raise BadSample(f"label values with no mapping ({label_path}): expected raw values the label map "
                            f"covers, got {sorted(unmapped)[:8]}", unmapped)
        label = mapped.astype(np.uint8)
    bad = (label >= num_classes) & (label != ignore_label)
    if bad.any():
        values = sorted(set(np.unique(label[bad]).tolist()))[:8]
        mapped_from = "" if label_table is None else \
            f" after the label map (raw values {sorted(set(np.unique(raw[bad]).tolist()))[:8]})"
        raise BadSample(f"label values out of range ({label_path}): expected values in [0, {num_classes}) or "
                        f"{ignore_label}, got {values}{mapped_from}")
    return image, label


class ImageReader:
    """Reads one split into tf.data pipelines, labels mapped to train ids through `label_table` (None:
    as stored); made by split.open_split."""

    def __init__(self, cfg: DataConfig, split: str, seed: int, samples: list[Sample], label_table):
        self.cfg, self.split, self.seed = cfg, split, seed
        self.label_table = label_table
        self.samples = samples
        # data.task panoptic / instance: labels are int32 segment labels, decoded by the codec.
        self.codec = label_table if isinstance(label_table, SegmentCodec) else None
        self.label_dtype = tf.uint8 if self.codec is None else tf.int32
        self.ignore_value = cfg.ignore_label if self.codec is None else segments.ignore_value(cfg.ignore_label)
        self._warned: set[str] = set()
        self._fell_back = False
        self._lock = threading.Lock()
        # data.cache: decoded (image, label) by sample index; identical to a fresh decode, so the
        # stream and resume do not change.
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] | None = {} if cfg.cache else None
        self._sample_locks: dict[int, threading.Lock] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def uncached(self) -> "ImageReader":
        """This reader with data.cache off (the same samples and label table): it decodes the files every time."""
        if self._cache is None:
            return self
        return ImageReader(dataclasses.replace(self.cfg, cache=False), self.split, self.seed, self.samples,
                           self.label_table)

    # ---- decoding -------------------------------------------------------------------------------
    def _decode_py(self, index):
        index = int(index)
        if self._cache is None:
            return self._decode_uncached(index)
        hit = self._cache.get(index)
        if hit is None:
            with self._lock:  # one lock per sample: tf.data's parallel calls never decode a file twice
                sample_lock = self._sample_locks.setdefault(index, threading.Lock())
            with sample_lock:
                hit = self._cache.get(index)
                if hit is None:
                    hit = self._cache[index] = self._decode_uncached(index)
        return hit

    def cache_bytes(self) -> int:
        """Memory held by data.cache so far."""
        return sum(a.nbytes + b.nbytes for a, b in list((self._cache or {}).values()))

    def _decode_uncached(self, index: int):
        s = self.samples[index]
        try:
            return load(s, self.cfg.num_classes, self.cfg.ignore_label, self.label_table)
        except BadSample as e:
            if self.cfg.on_bad_sample == "error":
                raise
            with self._lock:
                if s.id not in self._warned:
                    self._warned.add(s.id)
                    log.warning("skipping bad sample (data.on_bad_sample: skip): %s", e)
            # A fully ignored stand-in keeps every later sample at its position in the stream, so
            # resume stays exact; it contributes no loss.
            return np.zeros((8, 8, 3), np.uint8), np.full((8, 8), self.ignore_value, self.label_dtype.as_numpy_dtype)

    def _decode_checked(self, index, fallback: bool):
        """load_sample in tf.numpy_function (through data.cache when it is on)."""
        def run(i):
            out = self._decode_py(i)
            if fallback and not self._fell_back and self.samples[int(i)].id not in self._warned:
                self._fell_back = True  # once: a file system failing now and then would fill the log
                s = self.samples[int(i)]
                log.warning("TensorFlow could not decode %s, %s; decoded them with Pillow instead (slower)",
                            s.image, s.label)
            return out

        image, label = tf.numpy_function(run, [index], [tf.uint8, self.label_dtype], stateful=False)
        image.set_shape([None, None, 3])
        label.set_shape([None, None])
        return image, label

    def _decode_files(self, image_path, label_path, table=None):
        """TensorFlow's decode of one sample, with load_sample's checks as assertions."""
        return self._decode_contents(tf.io.read_file(image_path), tf.io.read_file(label_path), table)

    def _read_record(self, index):
        """Sample `index`'s record, parsed in the graph: (image, label, segment table or None); read in a
        numpy_function, as TensorFlow has no op that reads a byte range."""
        def read(i):
            return records.read_record(self.samples[int(i)].record)

        data = tf.numpy_function(read, [index], tf.string, stateful=False)
        data.set_shape([])
        table = records.parse_segments_tf(data) if self.codec is not None and self.codec.kind == "coco" else None
        return (*records.parse_example_tf(data), table)

    def _table_of(self, index):
        """Sample `index`'s segment table (coco_panoptic files) as tensors (ids, category ids, iscrowd), else None."""
        if self.codec is None or self.codec.kind != "coco":
            return None
        # Built from the samples as they are now (the scan may have dropped bad ones), once per list.
        if getattr(self, "_tables", (None,))[0] is not self.samples:
            counts = [len(s.segments.ids) if s.segments is not None else 0 for s in self.samples]
            flat = [(i, c, w) for s in self.samples if s.segments is not None
                    for i, c, w in zip(s.segments.ids, s.segments.category_ids, s.segments.iscrowd)]
            self._tables = (self.samples, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                            np.asarray(flat, np.int64).reshape(-1, 3))
        splits, flat = (tf.constant(a) for a in self._tables[1:])
        rows = flat[splits[index]:splits[index + 1]]
        return rows[:, 0], rows[:, 1], rows[:, 2]

    def _labels(self, label_contents, table):
        """Encoded label bytes -> (train ids or segment labels, whether all pass load_sample's value checks)."""
        if self.codec is not None:
            return self.codec.decode_tf(label_contents, table)
        return self._train_ids(decoders.decode_label(label_contents))

    def _decode_contents(self, image_contents, label_contents, table=None):
        """TensorFlow's decode of encoded image and label bytes, with load_sample's checks as assertions."""
        image = decoders.decode_image(image_contents)
        ids, in_range = self._labels(label_contents, table)
        checks = [tf.debugging.assert_equal(tf.shape(ids), tf.shape(image)[:2]),
                  tf.debugging.assert_equal(in_range, True)]
        with tf.control_dependencies(checks):
            return tf.identity(image), tf.cast(ids, self.label_dtype)

    def _train_ids(self, label):
        """A decoded uint8 label -> (its train ids, whether all are classes or ignore_label). An unmapped
        value (NO_ID) fails the check; without a map the check runs on uint8 (no int32 copy)."""
        c, ignore = self.cfg.num_classes, self.cfg.ignore_label
        if self.label_table is None:
            valid = label == ignore
            if c < 256:
                valid |= label < c
            else:
                valid = tf.ones_like(valid)
            return label, tf.reduce_all(valid)
        ids = labels.apply_tf(self.label_table, label)
        return ids, tf.reduce_all(((ids >= 0) & (ids < c)) | (ids == ignore))

    def decode(self, index):
        """Sample `index` -> (uint8 image [H, W, 3], uint8 label [H, W]).

        With data.cache: load_sample once per sample. Otherwise TensorFlow's decoders; on an error the
        fast one-element dataset empties (ignore_errors) and the load_sample one behind it is read.
        """
        if self._cache is not None:
            return self._decode_checked(index, fallback=False)
        index = tf.cast(index, tf.int64)
        if self.cfg.format == "tfrecord":
            fast = tf.data.Dataset.from_tensors(index).map(lambda i: self._decode_contents(*self._read_record(i)))
        else:
            paths = tf.constant([[s.image, s.label] for s in self.samples])
            fast = tf.data.Dataset.from_tensors(index).map(
                lambda i: self._decode_files(paths[i][0], paths[i][1], self._table_of(i)))
        checked = tf.data.Dataset.from_tensors(index).map(lambda i: self._decode_checked(i, fallback=True))
        return fast.ignore_errors().concatenate(checked).take(1).get_single_element()

    def training_sample(self, k, index):
        """`augment(*decode(index), k)`, more cheaply: a JPEG decodes only what its crop reads (the label
        whole, for the checks). Failures fall back to load_sample as in `decode`."""
        if self._cache is not None:
            return self.augment(*self._decode_checked(index, fallback=False), k)
        index = tf.cast(index, tf.int64)
        if self.cfg.format == "tfrecord":
            def from_record(i):
                image, label, table = self._read_record(i)
                return self._decode_crop(image, label, k, table)

            fast = tf.data.Dataset.from_tensors(index).map(from_record)
        else:
            paths = tf.constant([[s.image, s.label] for s in self.samples])
            fast = tf.data.Dataset.from_tensors(index).map(
                lambda i: self._decode_crop(tf.io.read_file(paths[i][0]), tf.io.read_file(paths[i][1]), k,
                                            self._table_of(i)))
        checked = tf.data.Dataset.from_tensors(index).map(
            lambda i: self.augment(*self._decode_checked(i, fallback=True), k))
        return fast.ignore_errors().concatenate(checked).take(1).get_single_element()

    def _decode_crop(self, image_contents, label_contents, k, table=None):
        """`_decode_contents` then `augment`, a JPEG image decoded only where the crop reads it."""
        ids, in_range = self._labels(label_contents, table)

        def jpeg():
            size = tf.io.extract_jpeg_shape(image_contents)[:2]
            plan = self._window_plan(size, k)
            part, origin = decoders.decode_jpeg_window(image_contents, plan.box, size)
            return (size,) + self._crop(part, ids, plan, origin)

        def other():
            image = decoders.decode_image(image_contents)
            size = tf.shape(image)[:2]
            return (size,) + self._crop(image, ids, self._window_plan(size, k), tf.zeros([2], tf.int32))

        size, image, crop_label = tf.cond(decoders.is_jpeg(image_contents), jpeg, other)
        # load_sample's checks, as in _decode_contents: on the whole label.
        checks = [tf.debugging.assert_equal(tf.shape(ids), size), tf.debugging.assert_equal(in_range, True)]
        with tf.control_dependencies(checks):
            return tf.identity(image), tf.identity(crop_label)

    def normalize(self, image):
        """uint8/float RGB -> float32 (x - mean) / std."""
        return (tf.cast(image, tf.float32) - tf.constant(self.cfg.mean)) / tf.constant(self.cfg.std)

    # ---- training ---------------------------------------------------------------------------------
    def _index_of(self, k):
        """Global sample counter k -> sample index (order.index_of: the definition of the order)."""
        return order.index_of(self.seed, len(self.samples), k)

    def augment(self, image, label, k):
        """Random scale, mirror and crop of one sample as the stream's sample k (augment.augment)."""
        return augment.augment(self.cfg, self.seed, image, label, k)

    def _window_plan(self, hw, k) -> augment.CropPlan:
        """The crop window of sample k, of source size `hw` (augment.crop_plan)."""
        return augment.crop_plan(self.cfg, self.seed, hw, k)

    def _crop(self, image, label, plan: augment.CropPlan, origin):
        """The crop `plan` describes (augment.crop)."""
        return augment.crop(self.cfg, self.seed, image, label, plan, origin)

    def train_order(self, global_batch: int, start_step: int = 0, num_replicas: int = 1, pipeline_id: int = 0,
                    num_pipelines: int = 1, micro_batches: int = 1) -> tf.data.Dataset:
        """(global sample counter k, sample index) of each element of one input pipeline (order.train_order)."""
        return order.train_order(self.seed, len(self.samples), global_batch, start_step, num_replicas, pipeline_id,
                                 num_pipelines, micro_batches)

    def train_dataset(self, global_batch: int, start_step: int = 0, num_replicas: int = 1,
                      pipeline_id: int = 0, num_pipelines: int = 1, end_step: int | None = None,
                      micro_batches: int = 1) -> tf.data.Dataset:
        """The endless training stream of one input pipeline, batched per replica.

        Args:
          global_batch: the GLOBAL batch size of one micro-batch (all towers of all workers).
          start_step: first step to produce (resume).
          num_replicas: towers in sync over all pipelines.
          pipeline_id, num_pipelines: this input pipeline (one per worker) among all.
          end_step: the step to stop before (None: endless), so no decoding is in flight at exit.
          micro_batches: K (train.accumulate_steps): step s consumes micro-batches s*K .. s*K+K-1, so
            K micro-batches of B on N towers see the samples of one step of K*B on K*N towers.
        Returns:
          Per-replica batches (image float32 [K*b, h, w, 3], label uint8 [K*b, h, w] (int32 segment labels
          for data.task panoptic and instance), micro-batch m
          in rows m*b .. m*b+b-1), taken by this pipeline's towers in turn.
        """
        per_replica = micro_batches * (global_batch // num_replicas)

        def load(k, index):
            return self.training_sample(k, index)

        ds = self.train_order(global_batch, start_step, num_replicas, pipeline_id, num_pipelines, micro_batches)
        if end_step is not None:
            ds = ds.take((end_step - start_step) * per_replica * (num_replicas // num_pipelines))
        ds = ds.map(load, num_parallel_calls=self.cfg.num_parallel_calls, deterministic=True)
        ds = ds.batch(per_replica, drop_remainder=True)
        return ds.prefetch(tf.data.AUTOTUNE)

    # ---- evaluation -------------------------------------------------------------------------------
    def eval_dataset(self, pad_to: int = 32, shard: tuple[int, int] = (0, 1)) -> tf.data.Dataset:
        """Full-resolution samples in split order: (image [1, H', W', 3], label [1, H', W'], index), padded
        to a multiple of `pad_to` (labels with ignore_label, or segments.ignore_value for segment labels, so
        padding is never counted)."""

        def load(i):
            image, label = self.decode(i)
            h, w = tf.shape(image)[0], tf.shape(image)[1]
            ph, pw = (-h) % pad_to, (-w) % pad_to
            image = self.normalize(image)
            image = tf.pad(image, [[0, ph], [0, pw], [0, 0]])
            label = tf.pad(label, [[0, ph], [0, pw]], constant_values=tf.cast(self.ignore_value, label.dtype))
            return image[None], label[None], i

        ds = tf.data.Dataset.range(len(self.samples)).shard(shard[1], shard[0])
        return ds.map(load, num_parallel_calls=self.cfg.num_parallel_calls, deterministic=True).prefetch(2)

