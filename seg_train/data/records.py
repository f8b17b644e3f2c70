"""TFRecord shards of a split: writing them, and reading any one record by its position.

Records are read by (shard, offset, length), found once by walking the record headers, so the stream
stays a pure function of (seed, sample counter) as over a folder: a converted data set trains on the same
stream, each worker reads only what its towers train on, and resume replays nothing.

Framing (TensorFlow's record_writer, little-endian): uint64 length, uint32 masked CRC, data, uint32
masked CRC. CRCs are not checked: a damaged record fails in the decoder, which names it.

Feature names are TensorFlow's segmentation readers' (DeepLab, Model Garden): `image/encoded` and
`image/segmentation/class/encoded` required, the other `image/...` features written and used when present.
Segment labels (data.task panoptic, instance) keep the label file's bytes as they ship (a COCO panoptic RGB PNG,
a Cityscapes 16-bit instanceIds PNG: lossless, mapped when read like class labels) in the same feature, and a
COCO image's segments_info as the int64 lists SEGMENT_KEYS; the split's categories go into its index file.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass

import numpy as np

from seg_train.config import exception_text

IMAGE_KEY = "image/encoded"
LABEL_KEY = "image/segmentation/class/encoded"
# A COCO panoptic image's segments_info: id, category_id, iscrowd of each segment, in its order.
SEGMENT_KEYS = ("image/segmentation/segment/id", "image/segmentation/segment/category_id",
                "image/segmentation/segment/iscrowd")
INDEX_SUFFIX = ".index.json"
INDEX_FORMAT = "seg-train-tfrecord-index"
_HEADER = 12  # uint64 length + uint32 CRC of the length
_FOOTER = 4  # uint32 CRC of the data


@dataclass(frozen=True)
class RecordRef:
    """Where one record's data is: shard file, byte offset of the data, its length."""
    shard: str
    offset: int
    length: int


def _gfile():
    import tensorflow as tf  # file access through TensorFlow's file systems (gs://, s3://, ram://, local)

    return tf.io.gfile


class ShardError(ValueError):
    """A shard whose record framing does not hold: `shard` is the file (not the split's glob), `problem`
    names the record (its number and byte offset) and what is wrong."""

    def __init__(self, shard: str, problem: str):
        self.shard, self.problem = shard, problem
        super().__init__(f"{shard}: {problem}")


def walk_shard(path: str) -> list[RecordRef]:
    """The records of one TFRecord file, by walking the record headers; ShardError if the framing does
    not end exactly at the end of the file (truncated, or not a TFRecord file)."""
    gfile = _gfile()
    size = gfile.stat(path).length
    refs, pos = [], 0
    expected = "expected a complete TFRecord file (this one is truncated, or is not a TFRecord file)"
    with gfile.GFile(path, "rb") as f:
        while pos < size:
            f.seek(pos)
            header = f.read(_HEADER)
            if len(header) < _HEADER:
                raise ShardError(path, f"record {len(refs)} at byte {pos}: the file ends inside its "
                                       f"{_HEADER}-byte header ({size} bytes); {expected}")
            (length,) = struct.unpack("<Q", header[:8])
            end = pos + _HEADER + length + _FOOTER
            if end > size:
                raise ShardError(path, f"record {len(refs)} at byte {pos} claims {length} bytes, past the end of "
                                       f"the file ({size} bytes); {expected}")
            refs.append(RecordRef(path, pos + _HEADER, length))
            pos = end
    return refs


def read_record(ref: RecordRef) -> bytes:
    """The serialized tf.train.Example of one record."""
    with _gfile().GFile(ref.shard, "rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.length)
    if len(data) != ref.length:
        raise ValueError(f"record at byte {ref.offset} of {ref.shard}: read {len(data)} of {ref.length} bytes")
    return data


def parse_example(serialized: bytes) -> tuple[bytes, bytes, str | None]:
    """(encoded image, encoded label, the record's id or None) from a serialized tf.train.Example."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example.FromString(serialized)
    feature = example.features.feature

    def one_bytes(key):
        if key not in feature or not feature[key].bytes_list.value:
            return None
        return feature[key].bytes_list.value[0]

    image, label = one_bytes(IMAGE_KEY), one_bytes(LABEL_KEY)
    missing = [k for k, v in ((IMAGE_KEY, image), (LABEL_KEY, label)) if v is None]
    if missing:
        raise ValueError(f"missing feature(s) {', '.join(missing)}; expected a tf.train.Example with "
                         f"{IMAGE_KEY!r} and {LABEL_KEY!r} (encoded image and label PNG)")
    sid = one_bytes("image/source_id") or one_bytes("image/filename")
    return image, label, sid.decode("utf-8", "replace") if sid is not None else None


def parse_segments(serialized: bytes) -> tuple[tuple[int, ...], ...]:
    """(segment ids, category ids, iscrowd) of a record (SEGMENT_KEYS; empty when absent)."""
    from tensorflow.core.example import example_pb2

    feature = example_pb2.Example.FromString(serialized).features.feature
    return tuple(tuple(feature[k].int64_list.value) if k in feature else () for k in SEGMENT_KEYS)


def parse_segments_tf(serialized):
    """parse_segments inside a TensorFlow graph: three int64 vectors."""
    import tensorflow as tf

    parsed = tf.io.parse_single_example(serialized, {k: tf.io.VarLenFeature(tf.int64) for k in SEGMENT_KEYS})
    return tuple(tf.sparse.to_dense(parsed[k]) for k in SEGMENT_KEYS)


def parse_example_tf(serialized):
    """The same two features, parsed inside a TensorFlow graph (no Python, no GIL)."""
    import tensorflow as tf

    spec = {IMAGE_KEY: tf.io.FixedLenFeature([], tf.string), LABEL_KEY: tf.io.FixedLenFeature([], tf.string)}
    parsed = tf.io.parse_single_example(serialized, spec)
    return parsed[IMAGE_KEY], parsed[LABEL_KEY]


# ---- index ---------------------------------------------------------------------------------------

def index_path(pattern: str) -> str:
    """The index file written beside the shards of `pattern` (e.g. train-*.tfrecord -> train.index.json)."""
    base = pattern.split("*")[0].rstrip("-_.")
    return base + INDEX_SUFFIX


def split_pattern(root: str, split: str) -> str:
    """The shard files of a split: `<root>/<split>-*-of-*.tfrecord`, or `split` itself as a glob
    pattern when it holds a `*` (relative to root unless it is absolute or a URL such as gs://...)."""
    if "*" not in split:
        return f"{str(root).rstrip('/')}/{split}-*-of-*.tfrecord"
    if split.startswith("/") or "://" in split:
        return split
    return f"{str(root).rstrip('/')}/{split}"


def shard_paths(pattern: str) -> list[str]:
    """The shard files matching `pattern`, sorted (a glob through tf.io.gfile)."""
    return sorted(_gfile().glob(pattern))


def load_records(pattern: str) -> list[tuple[str, RecordRef]]:
    """(id, record) for every record of the shards matching `pattern`, in shard order.

    Uses the writer's index when it matches the shards on disk; otherwise walks the headers and names
    each record `<shard file>:<n>` (its id would cost reading every record).
    """
    gfile = _gfile()
    shards = shard_paths(pattern)
    if not shards:
        raise FileNotFoundError(pattern)
    sizes = {p: gfile.stat(p).length for p in shards}
    idx = index_path(pattern)
    if gfile.exists(idx):
        try:
            index = json.loads(gfile.GFile(idx, "r").read())
            by_name = {s["file"]: s for s in index["shards"]}
            names = [p.rsplit("/", 1)[-1] for p in shards]
            if (index.get("format") == INDEX_FORMAT and sorted(by_name) == sorted(names)
                    and all(by_name[n]["size"] == sizes[p] for n, p in zip(names, shards))):
                out = []
                for n, p in zip(names, shards):
                    for sid, off, length in by_name[n]["records"]:
                        out.append((sid, RecordRef(p, off, length)))
                return out
        except (ValueError, KeyError, TypeError):
            pass  # an unreadable or foreign index: the header walk below is the truth
    out = []
    for p in shards:
        name = p.rsplit("/", 1)[-1]
        out += [(f"{name}:{i}", ref) for i, ref in enumerate(walk_shard(p))]
    return out


# ---- writing -------------------------------------------------------------------------------------

def _png_of_indices(label: np.ndarray) -> bytes:
    """A single-channel ('L') PNG of class indices: TensorFlow's decode_png reads it exactly."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(label.astype(np.uint8)), mode="L").save(buf, format="PNG")
    return buf.getvalue()


def make_example(image_bytes: bytes, image_format: str, label: np.ndarray, sample_id: str, label_bytes=None,
                 segments=None):
    """A tf.train.Example of one sample: the image file's bytes as they are, the label as an 'L' PNG, or
    `label_bytes` as they are with the segment table `segments` (SEGMENT_KEYS' lists) for segment labels."""
    import tensorflow as tf

    def b(v):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

    def i(v):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[v]))

    h, w = label.shape
    feature = {
        IMAGE_KEY: b(image_bytes), "image/format": b(image_format.encode()), "image/height": i(h),
        "image/width": i(w), "image/channels": i(3), "image/filename": b(f"{sample_id}.{image_format}".encode()),
        "image/source_id": b(sample_id.encode()),
        LABEL_KEY: b(_png_of_indices(label) if label_bytes is None else label_bytes),
        "image/segmentation/class/format": b(b"png")}
    for key, values in zip(SEGMENT_KEYS, segments or ()):
        feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))
    return tf.train.Example(features=tf.train.Features(feature=feature))


def shard_name(prefix: str, i: int, n: int) -> str:
    return f"{prefix}-{i:05d}-of-{n:05d}.tfrecord"


def _image_format(data: bytes) -> str | None:
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    return None


def encode_segment_sample(image_path: str, label_path: str, sample_id: str, codec, table) -> bytes:
    """encode_sample for segment labels (data.task panoptic, instance): the label file's bytes as they are,
    checked by decoding them with `codec` (panoptic.SegmentCodec) against `table` (the image's segments, or
    None), which the record keeps. ValueError names a bad file."""
    gfile = _gfile()
    try:
        data, fmt, size = _stored_image(gfile, image_path)
        with gfile.GFile(label_path, "rb") as f:
            label_bytes = f.read()
        label = codec.decode_np(label_bytes, table, label_path)
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises names the sample
        raise ValueError(f"cannot convert sample {sample_id!r} ({image_path}, {label_path}): "
                         f"{type(e).__name__}: {exception_text(e)}") from None
    _check_size(label, size, label_path)
    rows = None if table is None else (table.ids, table.category_ids, table.iscrowd)
    return make_example(data, fmt, label, sample_id, label_bytes, rows).SerializeToString()


def encode_sample(image_path: str, label_path: str, sample_id: str) -> bytes:
    """One sample as a serialized tf.train.Example.

    A JPEG or PNG image is stored as its bytes, any other format as PNG. The label is stored as an 'L'
    PNG of class indices (decode_png would read a palette PNG as colours). ValueError names a bad file.
    """
    from seg_train.data.label_images import LossyLabel, read_label

    gfile = _gfile()
    try:
        data, fmt, size = _stored_image(gfile, image_path)
        with gfile.GFile(label_path, "rb") as f:
            label = read_label(io.BytesIO(f.read()), name=label_path)
    except LossyLabel:  # its own line (naming the label): what is wrong and what to do
        raise
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises names the sample
        # exception_text: Pillow decodes from memory here, and its messages would carry the BytesIO's repr.
        raise ValueError(f"cannot convert sample {sample_id!r} ({image_path}, {label_path}): "
                         f"{type(e).__name__}: {exception_text(e)}") from None
    _check_size(label, size, label_path)
    return make_example(data, fmt, label, sample_id).SerializeToString()


def _stored_image(gfile, image_path: str) -> tuple[bytes, str, tuple[int, int]]:
    """The image as a record stores it (a JPEG or PNG as its bytes, any other format as PNG), its format and
    (width, height). A full decode: a truncated file fails here, not in training."""
    from PIL import Image

    with gfile.GFile(image_path, "rb") as f:
        data = f.read()
    fmt = _image_format(data)
    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB")
    if fmt is None:
        buf = io.BytesIO()
        rgb.save(buf, format="PNG")
        data, fmt = buf.getvalue(), "png"
    return data, fmt, rgb.size


def _check_size(label, size: tuple[int, int], label_path: str) -> None:
    if label.shape != (size[1], size[0]):
        raise ValueError(f"label size differs from image ({label_path}): expected {size[0]}x{size[1]}, "
                         f"got {label.shape[1]}x{label.shape[0]}")


def write_split(samples, output: str, prefix: str, num_shards: int, progress=None, encode=None,
                index_extra: dict | None = None) -> dict:
    """Writes `samples` ((id, image path, label path) triples) as `num_shards` TFRecord shards and an index.

    Samples go to shards in contiguous runs, in split order. Returns the index (also written to
    `<output>/<prefix>.index.json`). `encode(image, label, id, position)`: a sample's serialized record
    (default encode_sample); `index_extra`: more entries of the index (a panoptic split's categories).
    """
    import tensorflow as tf

    gfile = _gfile()
    gfile.makedirs(output)
    num_shards = max(1, min(num_shards, len(samples)))
    index = {"format": INDEX_FORMAT, "version": 1, "num_records": len(samples), "shards": [], **(index_extra or {})}
    for s in range(num_shards):
        first = s * len(samples) // num_shards
        part = samples[first:(s + 1) * len(samples) // num_shards]
        name = shard_name(prefix, s, num_shards)
        path = f"{output.rstrip('/')}/{name}"
        records, pos = [], 0
        with tf.io.TFRecordWriter(path) as writer:
            for n, (sid, image, label) in enumerate(part, first):
                data = encode_sample(image, label, sid) if encode is None else encode(image, label, sid, n)
                writer.write(data)
                records.append([sid, pos + _HEADER, len(data)])
                pos += _HEADER + len(data) + _FOOTER
                if progress is not None:
                    progress.update(1)
        size = gfile.stat(path).length
        if size != pos:  # the framing above is TensorFlow's; a mismatch means it changed
            raise RuntimeError(f"{path}: {size} bytes written, {pos} expected from the TFRecord framing")
        index["shards"].append({"file": name, "size": size, "records": records})
    with gfile.GFile(f"{output.rstrip('/')}/{prefix}{INDEX_SUFFIX}", "w") as f:
        f.write(json.dumps(index))
    return index
