"""Prepare a folder of images and a folder of label images for seg-train.

Usage:
    seg-prepare folder --images IMAGES_DIR --labels LABELS_DIR --output OUT
        [--val-fraction 0.1] [--seed 0] [--colour-map FILE] [--class-names FILE]

Images and labels are paired by file stem (photo_01.jpg <-> photo_01.png).
Label images must hold class indices: palette ('P') PNGs (the palette index is
the class, as in PASCAL VOC), single-channel ('L') or 16-bit images with values
0..255; 255 means "ignore".  Colour (RGB) label images need --colour-map, a
text file of lines "R G B index" (# comments allowed) or a JSON file, either a
list of [R, G, B, index] or an object {"R,G,B": index}; colours not in the map
become 255 and are counted in a warning.  A JPEG label (lossy: its class values
are damaged) is refused.

Writes the VOC layout to OUT: JPEGImages/<id>.jpg, SegmentationClass/<id>.png
(palette PNGs of class indices), ImageSets/Segmentation/{train,val}.txt (a
deterministic random split given --seed) and classes.txt (from --class-names,
else class_0..class_N for the largest index found).  Files without a partner
are reported and skipped.

Errors are reported as one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from seg_train.data.label_images import JPEG_START, LOSSY_EXPECTED, LOSSY_WHAT, save_index_png, voc_colormap
from seg_train.data.prepare import PrepError, wrote

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".ppm"}
IGNORE_LABEL = 255
JPEG_QUALITY = 95


def list_by_stem(folder: Path, role: str) -> dict[str, Path]:
    """Map file stem -> path for the image files in ``folder``."""
    if not folder.is_dir():
        raise PrepError("no such folder", folder, f"a folder of {role}")
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        if path.stem in files:
            raise PrepError(f"two {role} named {path.stem}", folder, "one file per stem")
        if any(ch.isspace() for ch in path.stem):
            # Split files hold one id per line, split on whitespace by many readers.
            raise PrepError("file name contains whitespace", path, "names without spaces (they become image ids)")
        files[path.stem] = path
    return files


def parse_colour_map(path: Path) -> dict[tuple[int, int, int], int]:
    """Read a colour map file: lines "R G B index", or JSON [[R,G,B,index], ...] or {"R,G,B": index}."""
    expected = 'lines "R G B index", or JSON [[R, G, B, index], ...] or {"R,G,B": index}, values 0..255'
    try:
        text = path.read_text()
    except OSError:
        raise PrepError("cannot read colour map", path, expected) from None
    entries: list[list[int]] = []
    try:
        if text.lstrip().startswith(("[", "{")):
            data = json.loads(text)
            if isinstance(data, dict):
                for key, index in data.items():
                    entries.append([int(v) for v in key.replace(",", " ").split()] + [int(index)])
            else:
                entries = [[int(v) for v in row] for row in data]
        else:
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    entries.append([int(v) for v in line.replace(",", " ").split()])
    except (ValueError, TypeError, AttributeError):
        raise PrepError("malformed colour map", path, expected) from None
    mapping: dict[tuple[int, int, int], int] = {}
    for entry in entries:
        if len(entry) != 4 or not all(0 <= v <= 255 for v in entry):
            raise PrepError(f"bad colour map entry {entry}", path, expected)
        colour, index = (entry[0], entry[1], entry[2]), entry[3]
        if mapping.get(colour, index) != index:
            raise PrepError(
                f"colour {colour} mapped to both {mapping[colour]} and {index}", path, "one index per colour"
            )
        mapping[colour] = index
    if not mapping:
        raise PrepError("empty colour map", path, expected)
    return mapping


def map_colours(rgb: np.ndarray, colour_map: dict[tuple[int, int, int], int]) -> tuple[np.ndarray, int]:
    """Map an [H, W, 3] colour label to indices; return (indices, number of pixels of unknown colours)."""
    keys = (rgb[..., 0].astype(np.int32) << 16) | (rgb[..., 1].astype(np.int32) << 8) | rgb[..., 2]
    # Look up each distinct colour once rather than each pixel.
    unique, inverse = np.unique(keys.ravel(), return_inverse=True)
    colours = [((k >> 16) & 255, (k >> 8) & 255, k & 255) for k in unique.tolist()]
    lookup = np.array([colour_map.get(c, IGNORE_LABEL) for c in colours], dtype=np.uint8)
    known = np.array([c in colour_map for c in colours])
    return lookup[inverse].reshape(keys.shape), int((~known[inverse]).sum())


def read_label(path: Path, colour_map: dict | None) -> tuple[np.ndarray, int]:
    """Read a label image as uint8 class indices; return (indices, pixels of unknown colours).

    A JPEG is refused by its bytes: converted to PNG, its damaged class values would pass every later check.
    """
    with open(path, "rb") as f:
        if f.read(len(JPEG_START)) == JPEG_START:
            raise PrepError(LOSSY_WHAT, path, LOSSY_EXPECTED)
    try:
        with Image.open(path) as img:
            mode = img.mode
            if mode in ("P", "L"):
                return np.array(img, dtype=np.uint8), 0
            if mode in ("RGB", "RGBA"):
                if colour_map is None:
                    raise PrepError(
                        "colour (RGB) label image",
                        path,
                        "palette ('P') or single-channel ('L') PNGs of class indices, or pass --colour-map FILE",
                    )
                return map_colours(np.array(img.convert("RGB")), colour_map)
            if mode == "I" or mode.startswith("I;16"):
                values = np.array(img)
                if values.size and (values.min() < 0 or values.max() > 255):
                    raise PrepError(f"{mode} label values outside 0..255", path, "class indices 0..255")
                return values.astype(np.uint8), 0
    except OSError as exc:
        raise PrepError(f"unreadable label image: {exc}", path, "a PNG of class indices") from None
    raise PrepError(f"{mode} label image", path, "a palette ('P') or single-channel ('L') PNG of class indices")


def write_image(src: Path, dst: Path) -> tuple[int, int]:
    """Store ``src`` as an RGB JPEG at ``dst`` (copied if it already is one); return its (width, height)."""
    try:
        with Image.open(src) as img:
            size = img.size
            if img.format == "JPEG" and img.mode == "RGB":
                if not (dst.exists() and os.path.samefile(src, dst)):
                    shutil.copyfile(src, dst)  # avoid a lossy re-encode
            else:
                img.convert("RGB").save(dst, quality=JPEG_QUALITY)
    except OSError as exc:
        raise PrepError(f"unreadable image: {exc}", src, "an image file Pillow can open") from None
    return size


def split_ids(ids: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministically split sorted ``ids`` into (train, val), both sorted."""
    ids = sorted(ids)
    num_val = int(round(val_fraction * len(ids)))
    if val_fraction > 0 and len(ids) >= 2:
        num_val = min(max(num_val, 1), len(ids) - 1)  # keep both splits non-empty
    order = np.random.default_rng(seed).permutation(len(ids))
    val = {ids[i] for i in order[:num_val]}
    return [i for i in ids if i not in val], sorted(val)


def read_class_names(path: Path, max_index: int) -> list[str]:
    """Read class names, one per non-empty line; there must be a name for every index found."""
    try:
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        raise PrepError("cannot read class names", path, "a text file with one class name per line") from None
    if len(names) <= max_index:
        raise PrepError(
            f"{len(names)} class names but labels use index {max_index}", path, f"at least {max_index + 1} names"
        )
    return names


def prepare(args: argparse.Namespace) -> str:
    """Convert and split the paired files; print warnings; return the summary line."""
    if not 0.0 <= args.val_fraction < 1.0:
        raise PrepError("bad value", f"--val-fraction {args.val_fraction}", "a fraction in [0, 1)")
    colour_map = parse_colour_map(args.colour_map) if args.colour_map else None
    images = list_by_stem(args.images, "images")
    labels = list_by_stem(args.labels, "label images")
    ids = sorted(images.keys() & labels.keys())
    if not ids:
        raise PrepError(
            "no image/label pairs", f"{args.images}, {args.labels}", "images and labels with matching file stems"
        )
    for role, unmatched in (("images", images.keys() - labels.keys()), ("labels", labels.keys() - images.keys())):
        if unmatched:
            names = sorted(unmatched)
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            listed = ", ".join(names[:5]) + more
            print(f"warning: {len(names)} {role} without a partner, skipped: {listed}", file=sys.stderr)

    out = args.output
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    palette = voc_colormap()
    max_index, unknown_pixels, unknown_files = 0, 0, 0
    for image_id in ids:
        label, unknown = read_label(labels[image_id], colour_map)
        size = write_image(images[image_id], out / "JPEGImages" / f"{image_id}.jpg")
        if size != (label.shape[1], label.shape[0]):
            raise PrepError(
                f"image is {size[0]}x{size[1]} but its label {label.shape[1]}x{label.shape[0]}",
                images[image_id],
                "an image and label of the same size",
            )
        unknown_pixels += unknown
        unknown_files += unknown > 0
        valid = label[label != IGNORE_LABEL]
        if valid.size:
            max_index = max(max_index, int(valid.max()))
        save_index_png(out / "SegmentationClass" / f"{image_id}.png", label, palette)
    if unknown_pixels:
        print(
            f"warning: {unknown_pixels} pixels in {unknown_files} label images have colours not in "
            f"{args.colour_map}; set to {IGNORE_LABEL} (ignore)",
            file=sys.stderr,
        )

    train, val = split_ids(ids, args.val_fraction, args.seed)
    split_dir = out / "ImageSets" / "Segmentation"
    (split_dir / "train.txt").write_text("".join(f"{i}\n" for i in train))
    (split_dir / "val.txt").write_text("".join(f"{i}\n" for i in val))
    if args.class_names:
        names = read_class_names(args.class_names, max_index)
    else:
        names = [f"class_{i}" for i in range(max_index + 1)]
    (out / "classes.txt").write_text("".join(f"{n}\n" for n in names))
    return wrote(out, {"train": len(train), "val": len(val), "classes": len(names)})
