"""A scan of a split before training: every sample decoded and checked once, with a progress bar.

Everything that can be found before training starts is found here (missing files, unreadable or
truncated images, colour labels, size mismatches, raw label values the label map does not cover,
out-of-range label values), so a bad file is named in seconds instead of crashing a run hours later.
The per-class histogram counts the labels after the label map: the train ids the model learns.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from seg_train import losses
from seg_train.progress import progress_bar, shown
from seg_train.config import Config, ConfigError
from seg_train.data.reader import BadSample, ImageReader, Sample, load_sample

log = logging.getLogger("seg_train")


@dataclass
class ScanReport:
    num_samples: int
    bad: list[tuple[Sample, str]] = field(default_factory=list)
    # Pixels per class; the last entry counts ignore_label pixels.
    histogram: np.ndarray | None = None
    # Per class: the labelled (not ignore_label) pixels of the images where the class is present
    # (the denominator of median frequency balancing, losses.median_frequency_weights).
    image_pixels: np.ndarray | None = None
    seconds: float = 0.0
    # Raw label values the label map does not cover: pixels and samples per value (those samples are bad).
    unmapped_pixels: dict[int, int] = field(default_factory=dict)
    unmapped_samples: dict[int, int] = field(default_factory=dict)


def _check(sample: Sample, num_classes: int, ignore_label: int, label_table):
    try:
        _, label = load_sample(sample.image, sample.label, num_classes, ignore_label, label_table)
    except BadSample as e:
        return sample, e, None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. Pillow's DecompressionBombError or a ValueError on a corrupt header
        # Whatever a decoder raises on a file makes that sample bad; it must be named, not crash the scan.
        return sample, (f"unreadable sample ({sample.image}, {sample.label}): expected a valid JPEG/PNG image and "
                        f"PNG label ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"), None
    counts = np.bincount(np.where(label == ignore_label, num_classes, label).ravel(), minlength=num_classes + 1)
    return sample, None, counts


def scan(samples: list[Sample], num_classes: int, ignore_label: int, what: str = "data",
         workers: int = 4, label_table: np.ndarray | None = None) -> ScanReport:
    """Decodes and checks every sample (threads: Pillow releases the GIL while decoding).

    `label_table`: the reader's label map (labels.py; None: labels as stored), applied before counting.
    """
    t0 = time.perf_counter()
    report = ScanReport(len(samples), histogram=np.zeros(num_classes + 1, np.int64),
                        image_pixels=np.zeros(num_classes, np.int64))
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
             f"{'class':<{width}}  {'pixels':>12}  {'share':>7}"]
    for name, n in zip(class_names + ["ignore"], report.histogram):
        lines.append(f"{name:<{width}}  {int(n):>12}  {100.0 * n / total:6.2f}%")
    absent = [n for n, c in zip(class_names, report.histogram[:-1]) if c == 0]
    if absent:
        lines.append(f"classes with no pixels: {', '.join(absent)}")
    if report.unmapped_pixels:
        lines.append("raw label values with no mapping (their samples are bad): " + ", ".join(
            f"{raw} ({report.unmapped_pixels[raw]} pixels in {report.unmapped_samples[raw]} samples)"
            for raw in sorted(report.unmapped_pixels)))
    for sample, problem in report.bad:
        lines.append(f"bad: {problem}")
    return "\n".join(lines)


def scan_split(cfg: Config, reader: ImageReader, what: str):
    """Checks every sample of the reader's split before training; drops bad ones if on_bad_sample: skip.

    Returns the scan's report (its per-class pixel counts give loss.class_weights: median_frequency).
    """
    report = scan(reader.samples, cfg.data.num_classes, cfg.data.ignore_label, what, label_table=reader.label_table)
    log.info("checked %d %s samples in %.1fs: %d bad", report.num_samples, what, report.seconds, len(report.bad))
    if not report.bad:
        return report
    if cfg.data.on_bad_sample == "error":
        more = f" (and {len(report.bad) - 1} more bad samples)" if len(report.bad) > 1 else ""
        raise BadSample(report.bad[0][1] + more)
    for sample, problem in report.bad:
        log.warning("skipping bad sample (data.on_bad_sample: skip): %s", problem)
    bad = {s.id for s, _ in report.bad}
    reader.samples = [s for s in reader.samples if s.id not in bad]
    if not reader.samples:
        raise ConfigError("no usable samples", what, "at least one sample that passes the checks")
    return report


def class_weights_for_split(cfg: Config, reader: ImageReader, report: ScanReport | None = None,
                            class_names=None):
    """The loss.class_weights that seg-train and seg-bench train with on `reader`'s split (losses.class_weights_for).

    `report`: the split's scan, when the caller has one (seg-train scans every split before training).
    Without it the split is scanned here only if the weights need its pixel counts (median_frequency), so
    seg-bench pays no scan for fixed weights or none.
    """
    if report is None and isinstance(cfg.loss.class_weights, str):
        report = scan(reader.samples, cfg.data.num_classes, cfg.data.ignore_label, label_table=reader.label_table)
    return losses.class_weights_for(cfg, report, class_names)
