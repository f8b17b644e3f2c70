"""The pre-training scan's result kept between runs (data.scan_cache), so that a resume, a new run on
the same data or another worker's restart decodes nothing.

An entry is reused only when all of these are unchanged:

- every path with its size, mtime, ctime and inode (`rsync -t`, `cp -p`, `tar x` can keep an old mtime
  and size, and chmod changes readability; those change ctime or inode, which no user call can set
  back); remote file systems give size and mtime only;
- data.num_classes, data.ignore_label and the label table (a panoptic.SegmentCodec's cache_key, and each
  image's segment table from its JSON, for segment labels);
- the checking code's source and the Pillow and TensorFlow versions;
- the worker's share of the list.

One entry per (list, share), named by their hash, so a stale entry is overwritten. JSON (never pickle:
the folder may be shared), written to a temporary file and renamed; an unreadable entry is reported and
the split scanned again.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seg_train import __version__
from seg_train.config import is_url

log = logging.getLogger("seg_train")

FORMAT = 1
# A file modified this close to the scan may change again within the same timestamp tick without its
# stat telling (git's "racily clean" problem): such a scan is not stored.
RECENT_SECONDS = 2.0


def folder_for(data_cfg) -> Path | None:
    """Where entries live: data.scan_cache_dir, else $XDG_CACHE_HOME/seg-train/scans, else
    ~/.cache/seg-train/scans (the data root itself may be read-only). None when data.scan_cache is off."""
    if not data_cfg.scan_cache:
        return None
    if data_cfg.scan_cache_dir is not None:
        return Path(data_cfg.scan_cache_dir)
    base = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: a relative $XDG_CACHE_HOME is invalid and is ignored.
    base = Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache"
    return base / "seg-train" / "scans"


@functools.lru_cache(maxsize=None)
def code_digest(functions: tuple) -> str:
    """A hash of the source of `functions` (the code that decides a sample's result), so a changed check
    invalidates old entries."""
    h = hashlib.sha256()
    for fn in functions:
        try:
            h.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):  # no source shipped: the package version stands in for it
            h.update(f"{fn.__module__}.{fn.__qualname__} {__version__}".encode())
    return h.hexdigest()


def _versions() -> dict:
    import PIL
    from PIL import Image, ImageFile
    tf = sys.modules.get("tensorflow")
    return {"pillow": PIL.__version__, "tensorflow": getattr(tf, "__version__", None),
            "max_image_pixels": Image.MAX_IMAGE_PIXELS, "load_truncated_images": bool(ImageFile.LOAD_TRUNCATED_IMAGES)}


def _stat(path: str) -> tuple[int, int, int, int]:
    """(size, mtime ns, ctime ns, inode) of a local file; (size, mtime ns, 0, 0) on a TensorFlow file system."""
    if not is_url(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino
    import tensorflow as tf
    try:
        st = tf.io.gfile.stat(path)
    except tf.errors.NotFoundError:
        raise FileNotFoundError(2, "No such file or directory", path) from None
    except tf.errors.OpError as e:
        raise OSError(0, e.message) from None
    return st.length, st.mtime_nsec, 0, 0


@dataclass
class Entry:
    """The cache entry of one list of samples (one worker's share of a split)."""
    path: Path
    key: dict
    num_samples: int
    num_classes: int
    storable: bool  # False when a file changed too recently (RECENT_SECONDS) to trust its stat
    stat_seconds: float

    @classmethod
    def of(cls, folder: Path, samples, num_classes: int, ignore_label: int, label_table=None,
           shard: tuple[int, int] = (0, 1), *, checker: str) -> "Entry":
        """The entry of `samples` (a worker's `shard` of a split) under these settings. `checker`: the
        digest of the checking code (scan.checker_digest)."""
        t0 = time.perf_counter()
        now_ns = time.time_ns()
        names, files = hashlib.sha256(), hashlib.sha256()
        names.update(f"{FORMAT} {shard[0]} {shard[1]}\n".encode())
        newest = 0
        stats = {}  # TFRecord samples share their shard's file: one stat per shard
        for s in samples:
            record = getattr(s, "record", None)
            for p in (s.image, s.label) if record is None else (record.shard,):
                names.update(p.encode("utf-8", "surrogateescape") + b"\0")
                if getattr(s, "segments", None) is not None:
                    names.update(repr(s.segments).encode() + b"\0")
                if record is not None:
                    names.update(f"{record.offset} {record.length}\0".encode())
                try:
                    size, mtime_ns, ctime_ns, inode = stats.get(p) or stats.setdefault(p, _stat(p))
                except OSError as e:
                    files.update(f"{p}\0missing {e.errno}\n".encode("utf-8", "surrogateescape"))
                    continue
                newest = max(newest, mtime_ns)
                files.update(f"{p}\0{size} {mtime_ns} {ctime_ns} {inode}\n".encode("utf-8", "surrogateescape"))
        table = None
        if hasattr(label_table, "cache_key"):
            table = hashlib.sha256(label_table.cache_key().encode()).hexdigest()
        elif label_table is not None:
            t = np.ascontiguousarray(label_table)
            table = f"{t.dtype.str} {t.shape} {hashlib.sha256(t.tobytes()).hexdigest()}"
        key = {"format": FORMAT, "files": files.hexdigest(), "num_samples": len(samples), "shard": list(shard),
               "num_classes": num_classes, "ignore_label": ignore_label, "label_table": table,
               "checker": checker, **_versions()}
        storable = now_ns - newest >= RECENT_SECONDS * 1e9
        return cls(Path(folder) / f"{names.hexdigest()[:32]}.json", key, len(samples), num_classes, storable,
                   time.perf_counter() - t0)

    def load(self):
        """(bad: [(index, message)], histogram, image_pixels, extra: {name: per-class counts}) if the entry is
        there and current, else None."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            log.warning("ignoring an unreadable scan cache entry (%s: %s): scanning again", self.path,
                        getattr(e, "strerror", None) or e)
            return None
        try:
            data = json.loads(text)
            if data["key"] != self.key:
                log.info("scan cache entry %s is out of date (files or settings changed): scanning again", self.path)
                return None
            ok = self._valid(data)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            ok = False
        if not ok:
            log.warning("ignoring a corrupt scan cache entry (%s): scanning again", self.path)
            return None
        return ([(i, m) for i, m in data["bad"]], np.array(data["histogram"], np.int64),
                np.array(data["image_pixels"], np.int64),
                {k: np.array(v, np.int64) for k, v in data.get("extra", {}).items()})

    def _valid(self, data) -> bool:
        def counts(values, n):
            return (isinstance(values, list) and len(values) == n
                    and all(type(x) is int and 0 <= x < 2**63 for x in values))

        bad = data["bad"]
        extra = data.get("extra", {})
        return (counts(data["histogram"], self.num_classes + 1) and counts(data["image_pixels"], self.num_classes)
                and isinstance(extra, dict) and all(counts(v, self.num_classes) for v in extra.values())
                and isinstance(bad, list)
                and all(isinstance(b, list) and len(b) == 2 and type(b[0]) is int and isinstance(b[1], str)
                        and 0 <= b[0] < self.num_samples for b in bad)
                and all(a[0] < b[0] for a, b in zip(bad, bad[1:])))

    def store(self, bad: list[tuple[int, str]], histogram, image_pixels, seconds: float, extra=None) -> bool:
        """Writes the entry atomically; a folder that cannot be written is a warning, never an error. `extra`:
        more per-class counts by name (segment labels' segments and crowd regions)."""
        if not self.storable:
            log.info("scan result not cached: some files changed less than %gs before the scan", RECENT_SECONDS)
            return False
        data = {"key": self.key, "bad": [[int(i), m] for i, m in bad],
                "histogram": [int(x) for x in histogram], "image_pixels": [int(x) for x in image_pixels],
                "scan_seconds": round(seconds, 3)}
        if extra:
            data["extra"] = {k: [int(x) for x in v] for k, v in extra.items()}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.stem + ".", suffix=".tmp")
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the entry from the other users of a shared folder
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())  # a crash after the rename must not leave an empty entry behind
            os.replace(tmp, self.path)
            return True
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            log.warning("cannot write the scan cache (%s: %s): the next start scans again (data.scan_cache_dir "
                        "moves the cache, data.scan_cache: false turns it off)", self.path, e.strerror or e)
            return False
