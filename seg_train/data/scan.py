"""A scan of a split before training: every sample decoded and checked once, with a progress bar.

Finds every bad file before training (missing, unreadable, colour or JPEG label, size mismatch,
unmapped or out-of-range values), so it is named up front rather than crashing a run later. JPEG labels
are counted apart: their damaged values still look like classes. The histogram counts train ids; with segment
labels (data.task panoptic, instance) also the segments and crowd regions of each class.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from seg_train.config import Config, ConfigError, exception_text
from seg_train.data import class_weights, decode, files, panoptic, scan_cache, segments
from seg_train.data.label_images import is_lossy_message, read_label
from seg_train.data.layouts import Sample
from seg_train.data.reader import BadSample, ImageReader, load, load_sample, load_segment_sample
from seg_train.util.progress import progress_bar, shown

log = logging.getLogger("seg_train")


@dataclass
class ScanReport:
    num_samples: int
    bad: list[tuple[Sample, str]] = field(default_factory=list)
    # Pixels per class; the last entry counts ignore_label pixels.
    histogram: np.ndarray | None = None
    # Per class: labelled pixels of the images where it is present (median frequency's denominator).
    image_pixels: np.ndarray | None = None
    seconds: float = 0.0
    # Raw label values the label map does not cover: pixels and samples per value (those samples are bad).
    unmapped_pixels: dict[int, int] = field(default_factory=dict)
    unmapped_samples: dict[int, int] = field(default_factory=dict)
    cached: Path | None = None  # the scan cache entry this report was read from (None: decoded now)
    # Segment labels: segments per class (crowd regions included), and crowd regions per class.
    segments: np.ndarray | None = None
    crowd: np.ndarray | None = None

    @property
    def lossy(self) -> int:
        """Bad samples whose label is a JPEG (counted from their messages, so a cached report has them too)."""
        return sum(is_lossy_message(problem) for _, problem in self.bad)


def _check(sample: Sample, num_classes: int, ignore_label: int, label_table):
    try:
        _, label = load(sample, num_classes, ignore_label, label_table)
    except BadSample as e:
        return sample, e, None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. Pillow's DecompressionBombError or a ValueError on a corrupt header
        # Whatever a decoder raises on a file makes that sample bad; it must be named, not crash the scan.
        return sample, (f"unreadable sample ({sample.image}, {sample.label}): expected a valid JPEG/PNG image and "
                        f"PNG label ({type(e).__name__}: {exception_text(e)})"), None
    if isinstance(label_table, panoptic.SegmentCodec):
        return sample, None, np.concatenate(segments.count(label, num_classes, ignore_label))
    counts = np.bincount(np.where(label == ignore_label, num_classes, label).ravel(), minlength=num_classes + 1)
    return sample, None, counts


# The code that decides a sample's result: the scan cache keys its entries on its source (scan_cache.py).
CHECKING_CODE = (_check, load_sample, read_label, decode.pillow_rgb, decode.pillow_label, files.read_bytes,
                 load_segment_sample, panoptic.SegmentCodec, panoptic.segment_values, segments.count)


def checker_digest() -> str:
    """The digest of CHECKING_CODE, part of every scan cache entry's key."""
    return scan_cache.code_digest(CHECKING_CODE)


def scan(samples: list[Sample], num_classes: int, ignore_label: int, what: str = "data",
         workers: int = 4, label_table: np.ndarray | None = None) -> ScanReport:
    """Decodes and checks every sample (threads: Pillow releases the GIL while decoding).

    `label_table`: the reader's label map (None: labels as stored), applied before counting.
    """
    t0 = time.perf_counter()
    report = ScanReport(len(samples), histogram=np.zeros(num_classes + 1, np.int64),
                        image_pixels=np.zeros(num_classes, np.int64))
    if isinstance(label_table, panoptic.SegmentCodec):
        report.segments, report.crowd = np.zeros(num_classes, np.int64), np.zeros(num_classes, np.int64)
    bar = progress_bar(len(samples), f"checking {what}") if shown() else None
    with ThreadPoolExecutor(workers) as pool:
        for sample, problem, counts in pool.map(lambda s: _check(s, num_classes, ignore_label, label_table),
                                                samples):
            if problem:
                report.bad.append((sample, str(problem)))
                for raw, pixels in getattr(problem, "unmapped", {}).items():
                    report.unmapped_pixels[raw] = report.unmapped_pixels.get(raw, 0) + pixels
                    report.unmapped_samples[raw] = report.unmapped_samples.get(raw, 0) + 1
            else:
                if report.segments is not None:
                    counts, segs, crowd = np.split(counts, [num_classes + 1, 2 * num_classes + 1])
                    report.segments += segs
                    report.crowd += crowd
                report.histogram += counts
                labelled = counts[:num_classes]
                report.image_pixels += np.where(labelled > 0, labelled.sum(), 0)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    report.seconds = time.perf_counter() - t0
    return report


def format_report(report: ScanReport, class_names: list[str]) -> str:
    """A per-class pixel histogram and the list of bad samples."""
    total = max(int(report.histogram.sum()), 1)
    width = max(len(n) for n in class_names + ["ignore"])
    lines = [f"{report.num_samples} samples, {len(report.bad)} bad, scanned in {report.seconds:.1f}s",
             f"{'class':<{width}}  {'pixels':>12}  {'share':>7}" + ("" if report.segments is None else
                                                                   f"  {'segments':>9}  {'crowd':>7}")]
    for i, (name, n) in enumerate(zip(class_names + ["ignore"], report.histogram)):
        extra = "" if report.segments is None or i == len(class_names) else \
            f"  {int(report.segments[i]):>9}  {int(report.crowd[i]):>7}"
        lines.append(f"{name:<{width}}  {int(n):>12}  {100.0 * n / total:6.2f}%{extra}")
    if report.segments is not None:
        lines.append(f"segments: {int(report.segments.sum())} in {report.num_samples - len(report.bad)} images, "
                     f"{int(report.crowd.sum())} of them crowd regions")
    absent = [n for n, c in zip(class_names, report.histogram[:-1]) if c == 0]
    if absent:
        lines.append(f"classes with no pixels: {', '.join(absent)}")
    if report.lossy:
        lines.append(f"lossy JPEG labels: {report.lossy} (their samples are bad: convert those labels to PNG)")
    if report.unmapped_pixels:
        lines.append("raw label values with no mapping (their samples are bad): " + ", ".join(
            f"{raw} ({report.unmapped_pixels[raw]} pixels in {report.unmapped_samples[raw]} samples)"
            for raw in sorted(report.unmapped_pixels)))
    for sample, problem in report.bad:
        lines.append(f"bad: {problem}")
    return "\n".join(lines)


def _bad_positions(samples: list[Sample], bad: list[tuple[Sample, str]]) -> list[tuple[int, str]]:
    """(index in `samples`, message) of each bad sample (scan() lists them in sample order)."""
    out, i = [], 0
    for sample, problem in bad:
        while samples[i] != sample:
            i += 1
        out.append((i, problem))
        i += 1
    return out


def scan_cached(cfg: Config, reader: ImageReader, what: str, shard: tuple[int, int] = (0, 1),
                refresh: bool = False) -> ScanReport:
    """scan() of the reader's samples, or of shard (i, W)'s samples[i::W], through the scan cache
    (scan_cache.py). `refresh` scans even on a cache hit, and stores the new result."""
    d = cfg.data
    samples = reader.samples[shard[0]::shard[1]]
    folder = scan_cache.folder_for(d)
    if folder is None:
        return scan(samples, d.num_classes, d.ignore_label, what, label_table=reader.label_table)
    t0 = time.perf_counter()
    entry = scan_cache.Entry.of(folder, samples, d.num_classes, d.ignore_label, reader.label_table,
                                shard, checker=checker_digest())
    hit = None if refresh else entry.load()
    if hit is not None:
        bad, histogram, image_pixels, extra = hit
        return ScanReport(len(samples), [(samples[i], m) for i, m in bad], histogram, image_pixels,
                          time.perf_counter() - t0, cached=entry.path, segments=extra.get("segments"),
                          crowd=extra.get("crowd"))
    report = scan(samples, d.num_classes, d.ignore_label, what, label_table=reader.label_table)
    extra = {} if report.segments is None else {"segments": report.segments, "crowd": report.crowd}
    entry.store(_bad_positions(samples, report.bad), report.histogram, report.image_pixels, report.seconds, extra)
    return report


def _bad_count(report: ScanReport) -> str:
    """'3 bad', or '3 bad (2 lossy JPEG labels)'."""
    return f"{len(report.bad)} bad" + (f" ({report.lossy} lossy JPEG labels)" if report.lossy else "")


def _log_scan(report: ScanReport, what: str, share: str = "") -> None:
    if report.cached is not None:
        log.info("%s: the scan of %d samples%s read from the scan cache in %.1fs (%s; the files and settings are "
                 "unchanged since they were checked): %s", what, report.num_samples, share, report.seconds,
                 report.cached, _bad_count(report))
    else:
        log.info("checked %d %s samples%s in %.1fs: %s", report.num_samples, what, share, report.seconds,
                 _bad_count(report))


def apply_on_bad_sample(cfg: Config, reader: ImageReader, report: ScanReport, what: str) -> ScanReport:
    """data.on_bad_sample after a scan of the reader's whole split: error raises naming the first bad
    sample; skip drops the bad samples from the reader (with a warning each)."""
    if not report.bad:
        return report
    if cfg.data.on_bad_sample == "error":
        n = len(report.bad)
        lossy = f"; {report.lossy} of the {n} are lossy JPEG labels" if report.lossy and n > 1 else ""
        more = f" (and {n - 1} more bad samples{lossy})" if n > 1 else ""
        raise BadSample(report.bad[0][1] + more)
    for sample, problem in report.bad:
        log.warning("skipping bad sample (data.on_bad_sample: skip): %s", problem)
    bad = {s.id for s, _ in report.bad}
    before = len(reader.samples)
    reader.samples = [s for s in reader.samples if s.id not in bad]
    log.warning("%s: %d bad samples of %d skipped (data.on_bad_sample: skip)%s", what, len(report.bad), before,
                f", {report.lossy} of them lossy JPEG labels" if report.lossy else "")
    if not reader.samples:
        raise ConfigError("no usable samples", what, "at least one sample that passes the checks")
    return report


def scan_split(cfg: Config, reader: ImageReader, what: str):
    """Checks every sample of the reader's split before training (or reads the scan cache); drops bad
    ones if on_bad_sample: skip. Returns the scan's report."""
    report = scan_cached(cfg, reader, what)
    _log_scan(report, what)
    return apply_on_bad_sample(cfg, reader, report, what)


def scan_for_training(cfg: Config, splits: list[tuple[ImageReader, str]], strategy=None) -> list[ScanReport]:
    """The scan before training of each (reader, what), data.on_bad_sample applied; returns the reports.

    With several workers each scans its share samples[i::W] and one all-reduce gives all the whole
    result: a chief-only scan would keep the others waiting in a collective that
    train.collective_timeout bounds. All workers then raise together or drop the same samples, so none
    hangs in its next collective and the stream stays the same on every worker.
    """
    position = _worker_position(strategy)
    if position is None:
        return [scan_split(cfg, reader, what) for reader, what in splits]
    index, count = position
    _check_same_lists(cfg, strategy, splits, count)  # before the shares: their all-reduce needs equal lengths
    shares = []
    for reader, what in splits:
        share = scan_cached(cfg, reader, what, (index, count))
        _log_scan(share, what, f" (worker {index}'s share of {len(reader.samples)}, {count} workers)")
        shares.append(share)
    reports = _combine(cfg, strategy, splits, shares, index, count)
    for (reader, what), report in zip(splits, reports):
        log.info("%s: %d bad samples of %d in all (the scans of the %d workers combined)", what, len(report.bad),
                 report.num_samples, count)
    return [apply_on_bad_sample(cfg, reader, report, what) for (reader, what), report in zip(splits, reports)]


def _worker_position(strategy) -> tuple[int, int] | None:
    """(this worker's index, number of workers) with several workers, else None; the chief is index 0."""
    if strategy is None:
        return None
    import tensorflow as tf
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict()
    tasks = ([("chief", i) for i in range(len(spec.get("chief", [])))]
             + [("worker", i) for i in range(len(spec.get("worker", [])))])
    if len(tasks) < 2:
        return None
    return tasks.index((resolver.task_type, resolver.task_id)), len(tasks)


def _sum_over_workers(strategy, vector: np.ndarray) -> np.ndarray:
    """The SUM over the workers of one int64 vector per worker: one collective."""
    import tensorflow as tf
    value = tf.constant(vector, tf.int64)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.identity(value)), axis=None)
    # Every tower of a worker contributes that worker's vector (the same number of towers on each).
    return total.numpy() // len(strategy.extended.worker_devices)


def _check_same_lists(cfg: Config, strategy, splits, count: int) -> None:
    """Every worker must see the same samples (paths relative to data.root), or their shares and the
    data stream would not line up."""
    h = hashlib.sha256()
    for reader, _ in splits:
        for s in reader.samples:
            h.update(f"{os.path.relpath(s.image, cfg.data.root)}\0{os.path.relpath(s.label, cfg.data.root)}\n".encode())
        h.update(b"\0end of split\0")
    mine = int.from_bytes(h.digest()[:5], "big")  # 40 bits: the sum over any realistic group fits in int64
    total = int(_sum_over_workers(strategy, np.array([mine], np.int64))[0])
    if total != count * mine:
        raise ConfigError("workers see different samples", str(cfg.data.root),
                          "the same split files and data on every worker (shared storage or identical copies)")


def _combine(cfg: Config, strategy, splits, shares: list[ScanReport], index: int, count: int) -> list[ScanReport]:
    """The whole-split reports from every worker's share, through one all-reduce."""
    num_classes, ignore_label = cfg.data.num_classes, cfg.data.ignore_label
    parts, own = [], []
    for (reader, _), share in zip(splits, shares):
        mine = range(index, len(reader.samples), count)
        flags = np.zeros(len(reader.samples), np.int64)
        messages = {mine[j]: m for j, m in _bad_positions(reader.samples[index::count], share.bad)}
        flags[list(messages)] = index + 1  # which worker found it, for the message of the others
        parts += [flags, share.histogram, share.image_pixels]
        own.append(messages)
    total = _sum_over_workers(strategy, np.concatenate(parts))
    reports, at = [], 0
    for (reader, _), share, messages in zip(splits, shares, own):
        n = len(reader.samples)
        flags = total[at:at + n]
        histogram = total[at + n:at + n + num_classes + 1]
        image_pixels = total[at + n + num_classes + 1:at + n + 2 * num_classes + 1]
        at += n + 2 * num_classes + 1
        bad = []
        for i in np.flatnonzero(flags).tolist():
            sample, message = reader.samples[i], messages.get(i)
            # Another worker's find: the chief, whose log the user reads, checks it again for the message.
            if message is None and index == 0 and (cfg.data.on_bad_sample == "skip" or not bad):
                message = _check(sample, num_classes, ignore_label, reader.label_table)[1]
                message = None if message is None else str(message)
            bad.append((sample, message or f"bad sample ({sample.image}, {sample.label}): found by worker "
                                           f"{int(flags[i]) - 1}, whose log names the problem"))
        reports.append(ScanReport(n, bad, histogram, image_pixels, share.seconds))
    return reports


def class_weights_for_split(cfg: Config, reader: ImageReader, report: ScanReport | None = None,
                            class_names=None):
    """The loss.class_weights that seg-train and seg-bench train with on `reader`'s split (data/class_weights.py).

    `report`: the split's scan if the caller has one; without it the split is scanned only when the
    weights need pixel counts (median_frequency).
    """
    if report is None and isinstance(cfg.loss.class_weights, str):
        report = scan(reader.samples, cfg.data.num_classes, cfg.data.ignore_label, label_table=reader.label_table)
    return class_weights.class_weights_for(cfg, report, class_names)
