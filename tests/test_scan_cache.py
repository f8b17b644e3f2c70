"""The scan cache (seg_train/data/scan_cache.py): a start on unchanged data decodes nothing; anything
that can change the scan's result scans again; a cached result behaves exactly as a fresh scan."""

import ctypes
import json
import logging
import os
import re
import struct
import threading
import time

import numpy as np
import pytest
from PIL import Image

from seg_train.data import scan_cache, synthetic
from seg_train.data.reader import BadSample
from seg_train.data.scan import _bad_positions, checker_digest, class_weights_for_split, scan_cached, scan_split
from tests.helpers import open_reader, tiny_config


class Opens:
    """Counts the opens of files in the data's image and label folders, from the kernel (inotify):
    whichever library decodes them is seen, and the files themselves are not touched."""

    IN_OPEN = 0x20

    def __init__(self, root):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        for sub in ("JPEGImages", "SegmentationClass"):
            assert libc.inotify_add_watch(self.fd, str(root / sub).encode(), self.IN_OPEN) >= 0

    def count(self) -> int:
        """Opens since the last call (the kernel queues an event during each open call)."""
        n = 0
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return n
            at = 0
            while at < len(data):
                n += 1
                at += 16 + struct.unpack_from("iIII", data, at)[3]

    def close(self):
        os.close(self.fd)


def age(root, seconds=60):
    """Sets every file's mtime back: a scan is stored only if no file changed in the 2 s before it
    (scan_cache.RECENT_SECONDS), and these files were just written."""
    t = time.time() - seconds
    for p in root.rglob("*"):
        if p.is_file():
            os.utime(p, (t, t))


@pytest.fixture
def data(tmp_path):
    root = synthetic.generate(tmp_path / "data", num_train=6, num_val=2, size=(24, 32), num_classes=3)
    age(root)
    return root


@pytest.fixture
def opens(data):
    probe = Opens(data)
    yield probe
    probe.close()


def config(tmp_path, root, **data):
    return tiny_config(tmp_path, root, data={"scan_cache_dir": str(tmp_path / "cache"), **data},
                       loss={"class_weights": "median_frequency"})


def entries(tmp_path):
    return sorted((tmp_path / "cache").glob("*.json"))


def histogram_by_hand(root, split, num_classes, ignore_label=255):
    """Pixels per class (last: ignore_label) and per-class labelled pixels of the images holding the
    class, from the label PNGs read with Pillow."""
    hist, image_pixels = np.zeros(num_classes + 1, np.int64), np.zeros(num_classes, np.int64)
    for sid in (root / "ImageSets" / "Segmentation" / f"{split}.txt").read_text().split():
        a = np.array(Image.open(root / "SegmentationClass" / f"{sid}.png")).ravel()
        for c in range(num_classes):
            hist[c] += (a == c).sum()
            image_pixels[c] += (a != ignore_label).sum() if (a == c).any() else 0
        hist[num_classes] += (a == ignore_label).sum()
    return hist, image_pixels


def test_a_second_scan_decodes_nothing_and_gives_the_same_weights(tmp_path, data, opens, caplog):
    """Wrong answers: a resume decoding the split again; a cached result other than the scan's
    (pixel counts, hence the median frequency class weights); no word in the log of where it came from."""
    cfg = config(tmp_path, data)
    fresh = scan_split(cfg, open_reader(cfg, "train"), "train (train)")
    assert opens.count() >= 12 and fresh.cached is None  # the probe sees the 6 images and 6 labels read
    hist, image_pixels = histogram_by_hand(data, "train", 3)
    assert fresh.histogram.tolist() == hist.tolist() and fresh.image_pixels.tolist() == image_pixels.tolist()
    [entry] = entries(tmp_path)

    caplog.set_level(logging.INFO, "seg_train")
    opens.count()  # the reads by hand above
    reader = open_reader(cfg, "train")
    cached = scan_split(cfg, reader, "train (train)")
    assert opens.count() == 0
    assert cached.cached == entry
    assert re.search(r"train \(train\): the scan of 6 samples read from the scan cache in [0-9.]+s "
                     rf"\({re.escape(str(entry))}; .*\): 0 bad", caplog.text), caplog.text
    assert cached.histogram.tolist() == hist.tolist() and cached.image_pixels.tolist() == image_pixels.tolist()
    w_fresh = class_weights_for_split(cfg, reader, fresh)
    w_cached = class_weights_for_split(cfg, reader, cached)
    assert w_cached.tolist() == w_fresh.tolist() and len(set(w_fresh.tolist())) > 1  # weights that differ per class


def _same_size_bad_label(path):
    """Rewrites `path` as a label with an out-of-range value, padded to the old size, and puts the old
    mtime back: what `rsync -t` or `cp -p` of a new file over an old one can look like."""
    st = os.stat(path)
    a = np.array(Image.open(path))
    a[0, 0] = 9
    Image.fromarray(a, mode="L").save(path, optimize=True)
    new = path.read_bytes()
    assert len(new) <= st.st_size, (len(new), st.st_size)
    path.write_bytes(new + b"\0" * (st.st_size - len(new)))  # Pillow stops at the PNG's end chunk
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def _drop_first_sample(root):
    split = root / "ImageSets" / "Segmentation" / "train.txt"
    split.write_text("\n".join(split.read_text().split()[1:]) + "\n")


def _labels_holding_255(root):
    ids = (root / "ImageSets" / "Segmentation" / "train.txt").read_text().split()
    return sum(int((np.array(Image.open(root / "SegmentationClass" / f"{i}.png")) == 255).any()) for i in ids)


# Each change -> (the edit of the data, config overrides, the bad samples the new scan must find).
CHANGES = {
    "image grows (size)": (lambda r: open(r / "JPEGImages" / "demo_00000.jpg", "ab").write(b"\0" * 16), {}, 0),
    "label touched (mtime)": (lambda r: os.utime(r / "SegmentationClass" / "demo_00001.png", (1e9, 1e9)), {}, 0),
    "label rewritten behind its old size and mtime": (
        lambda r: _same_size_bad_label(r / "SegmentationClass" / "demo_00002.png"), {}, 1),
    "image removed": (lambda r: (r / "JPEGImages" / "demo_00003.jpg").unlink(), {}, 1),
    "sample dropped from the split": (lambda r: _drop_first_sample(r), {}, 0),
    "num_classes": (lambda r: None, {"num_classes": 4}, 0),
    # 255 (the synthetic set's ignore band) becomes an out-of-range value.
    "ignore_label": (lambda r: None, {"ignore_label": 0}, _labels_holding_255),
    "label table": (lambda r: None, {}, 0),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_scans_again(tmp_path, data, opens, change):
    """Wrong answer: a stale result reused after a change of the files, of the checks' settings or of
    the label map (e.g. a label rewritten with a bad value keeping its size and mtime, trained on)."""
    edit, overrides, expect_bad = CHANGES[change]
    cfg = config(tmp_path, data)
    scan_cached(cfg, open_reader(cfg, "train"), "train")
    opens.count()
    assert scan_cached(cfg, open_reader(cfg, "train"), "train").cached is not None and opens.count() == 0

    cfg = config(tmp_path, data, **overrides)
    edit(data)
    reader = open_reader(cfg, "train")
    if change == "label table":  # what ImageReader holds for a label map
        reader.label_table = np.arange(256, dtype=np.uint8)
    report = scan_cached(cfg, reader, "train")
    assert report.cached is None and opens.count() > 0
    expect_bad = expect_bad if isinstance(expect_bad, int) else expect_bad(data)
    assert len(report.bad) == expect_bad > 0 or expect_bad == 0, report.bad
    assert len(report.histogram) == cfg.data.num_classes + 1


CORRUPT = {
    "truncated": lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]),
    "not a mapping": lambda p: p.write_text("[1, 2, 3]"),
    "histogram too short": lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "histogram": [1, 2]})),
    "bad index out of range": lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "bad": [[99, "x"]]})),
    "negative count": lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "image_pixels": [-1, 0, 0]})),
    "binary garbage": lambda p: p.write_bytes(b"\xff\xfe\x00" * 50),
}


@pytest.mark.parametrize("corruption", list(CORRUPT))
def test_a_corrupt_entry_is_ignored_and_replaced(tmp_path, data, opens, caplog, corruption):
    """Wrong answers: a crash on a damaged entry, or its contents used (wrong counts, a phantom bad sample)."""
    cfg = config(tmp_path, data)
    fresh = scan_split(cfg, open_reader(cfg, "train"), "train")
    [entry] = entries(tmp_path)
    CORRUPT[corruption](entry)
    opens.count()
    caplog.set_level(logging.INFO, "seg_train")
    report = scan_split(cfg, open_reader(cfg, "train"), "train")
    assert report.cached is None and opens.count() > 0
    assert f"ignoring a corrupt scan cache entry ({entry}): scanning again" in caplog.text or \
        f"ignoring an unreadable scan cache entry ({entry}" in caplog.text, caplog.text
    assert report.histogram.tolist() == fresh.histogram.tolist() and report.bad == []
    again = scan_split(cfg, open_reader(cfg, "train"), "train")  # the entry was written anew
    assert again.cached == entry and opens.count() == 0


def test_an_unusable_cache_folder_is_a_warning(tmp_path, data, caplog):
    """Wrong answer: a run that fails because the cache cannot be read or written (a folder in the
    entry's place, a file in the folder's place)."""
    cfg = config(tmp_path, data)
    scan_split(cfg, open_reader(cfg, "train"), "train")
    [entry] = entries(tmp_path)
    entry.unlink()
    entry.mkdir()
    caplog.set_level(logging.INFO, "seg_train")
    assert scan_split(cfg, open_reader(cfg, "train"), "train").cached is None
    assert f"ignoring an unreadable scan cache entry ({entry}" in caplog.text
    assert f"cannot write the scan cache ({entry}" in caplog.text
    (tmp_path / "blocked").write_text("a file where the cache folder should be")
    cfg = config(tmp_path, data, scan_cache_dir=str(tmp_path / "blocked"))
    report = scan_split(cfg, open_reader(cfg, "train"), "train")
    assert report.cached is None and report.histogram.sum() == 6 * 24 * 32


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_bad_samples_come_back_from_the_cache(tmp_path, data, opens, caplog, policy):
    """Wrong answers: a cached scan that forgets a bad sample (trained on, or a crash later), changes
    its message, or drops other samples than the scan did."""
    (data / "JPEGImages" / "demo_00001.jpg").write_bytes(b"this is not a JPEG" * 20)
    _same_size_bad_label(data / "SegmentationClass" / "demo_00004.png")
    age(data)
    cfg = config(tmp_path, data, on_bad_sample=policy)
    caplog.set_level(logging.INFO, "seg_train")
    outcomes = []
    for _ in range(2):
        caplog.clear()
        reader = open_reader(cfg, "train")
        try:
            report = scan_split(cfg, reader, "train")
            outcomes.append(([r.getMessage() for r in caplog.records if r.levelno == logging.WARNING],
                             [s.id for s in reader.samples], report.histogram.tolist(), opens.count()))
        except BadSample as e:
            outcomes.append((str(e), opens.count()))
    first, second = outcomes
    assert first[-1] >= 12 and second[-1] == 0  # every file read, then none
    if policy == "skip":
        assert first[0] == second[0] and len(first[0]) == 3, first[0]
        assert first[0][0].startswith("skipping bad sample (data.on_bad_sample: skip): unreadable image (")
        assert "label values out of range" in first[0][1] and "got [9]" in first[0][1]
        assert first[0][2] == "train: 2 bad samples of 6 skipped (data.on_bad_sample: skip)", first[0]
        assert first[1] == second[1] == ["demo_00000", "demo_00002", "demo_00003", "demo_00005"]
        assert first[2] == second[2]
    else:
        assert first[0] == second[0] and first[0].startswith("unreadable image (") and \
            first[0].endswith("(and 1 more bad samples)"), first


def test_files_changed_just_before_the_scan_are_not_cached(tmp_path, data, opens, caplog):
    """Wrong answer: a result stored for files written within the scan's timestamp tick, which could
    change again without their size and times telling."""
    os.utime(data / "SegmentationClass" / "demo_00005.png")  # now
    cfg = config(tmp_path, data)
    caplog.set_level(logging.INFO, "seg_train")
    scan_split(cfg, open_reader(cfg, "train"), "train")
    assert "scan result not cached: some files changed less than 2s before the scan" in caplog.text
    assert entries(tmp_path) == []
    opens.count()
    assert scan_split(cfg, open_reader(cfg, "train"), "train").cached is None and opens.count() > 0


def test_where_the_cache_lives(tmp_path, monkeypatch, data, opens):
    """data.scan_cache_dir, else $XDG_CACHE_HOME/seg-train/scans, else ~/.cache/seg-train/scans; off with
    data.scan_cache: false (then every start decodes). Wrong answers: entries written into the user's
    home when told otherwise; a relative XDG_CACHE_HOME used (the XDG spec says to ignore it)."""
    cfg = config(tmp_path, data)
    assert scan_cache.folder_for(cfg.data) == tmp_path / "cache"
    plain = tiny_config(tmp_path, data)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert scan_cache.folder_for(plain.data) == tmp_path / "xdg" / "seg-train" / "scans"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for value in ("relative/cache", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert scan_cache.folder_for(plain.data) == tmp_path / "home" / ".cache" / "seg-train" / "scans"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert scan_cache.folder_for(plain.data) == tmp_path / "home" / ".cache" / "seg-train" / "scans"

    off = config(tmp_path, data, scan_cache=False)
    assert scan_cache.folder_for(off.data) is None
    for _ in range(2):
        assert scan_split(off, open_reader(off, "train"), "train").cached is None and opens.count() >= 12
    assert not (tmp_path / "cache").exists() and not (tmp_path / "home").exists()


@pytest.mark.slow
def test_check_data_scans_everything_and_refreshes(tmp_path, data, opens, capsys):
    """seg-train --check-data checks the files as they are now. Wrong answer: it reports from the
    cache (a check that checks nothing)."""
    from seg_train import cli

    cfg = config(tmp_path, data)
    scan_split(cfg, open_reader(cfg, "train"), "train")
    [entry] = entries(tmp_path)
    before = entry.stat().st_mtime_ns
    opens.count()
    log = logging.getLogger("seg_train")
    saved = log.handlers[:], log.propagate, log.level
    try:
        assert cli.train_main(["--config", str(tmp_path / "config.yaml"), "--check-data"]) == 0
    finally:
        log.handlers[:], log.propagate, log.level = saved
    assert opens.count() >= 16  # train and val: 8 images, 8 labels
    assert "split train: 6 samples, 0 bad" in capsys.readouterr().out
    assert entry.stat().st_mtime_ns > before  # the entry renewed
    assert scan_cached(cfg, open_reader(cfg, "train"), "train").cached == entry


def test_concurrent_writers_and_readers_never_see_half_an_entry(tmp_path, data, caplog):
    """Two processes scanning the same data write the same entry; the write is atomic (temp file +
    rename). Wrong answer: a reader meeting a half-written entry (a rescan, or worse)."""
    for i in range(300):  # missing files: bad samples with long messages make the entry large
        (data / "ImageSets" / "Segmentation" / "train.txt").open("a").write(f"missing_{i:04d}_{'x' * 80}\n")
    age(data)
    cfg = config(tmp_path, data, on_bad_sample="skip")
    reader = open_reader(cfg, "train")
    report = scan_cached(cfg, reader, "train")
    entry = scan_cache.Entry.of(tmp_path / "cache", reader.samples, 3, 255, checker=checker_digest())
    bad = _bad_positions(reader.samples, report.bad)
    assert entry.path.stat().st_size > 50_000
    caplog.set_level(logging.INFO, "seg_train")
    stop, seen = threading.Event(), []

    def write():
        while not stop.is_set():
            entry.store(bad, report.histogram, report.image_pixels, 0.0)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for w in writers:
        w.start()
    try:
        deadline = time.time() + 3
        while time.time() < deadline:
            seen.append(entry.load() is not None)
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert len(seen) > 100 and all(seen), (len(seen), seen.count(False))
    assert "corrupt" not in caplog.text
