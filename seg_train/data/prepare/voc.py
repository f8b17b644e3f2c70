"""Prepare PASCAL VOC 2012 (optionally with the SBD augmentation) for seg-train.

Usage:
    seg-prepare voc --voc VOCdevkit/VOC2012 --output data/voc
    seg-prepare voc --voc VOCdevkit/VOC2012 \
        --sbd benchmark_RELEASE/dataset --output data/voc

Writes the VOC layout to OUT: JPEGImages/<id>.jpg, SegmentationClass/<id>.png
(palette PNGs of class indices, 255 = ignore), ImageSets/Segmentation/<split>.txt
and classes.txt.  VOC's own label PNGs already hold class indices and are
copied (hard-linked where possible) unchanged, along with its train/val/trainval
split files.

With --sbd (the Semantic Boundaries Dataset "benchmark_RELEASE/dataset" folder
holding cls/<id>.mat, train.txt and val.txt), the SBD class masks are converted
to PNGs in SegmentationClassAug/ and an ImageSets/Segmentation/train_aug.txt is
written with the standard recipe: (SBD train + SBD val + VOC train) - VOC val.
Every train_aug id gets a label in SegmentationClass/ too, VOC's own label
taking precedence over SBD's.  Reading the .mat files needs scipy
(pip install scipy).

Errors are reported as one line on stderr, exit code 2.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from seg_train.data.label_images import save_index_png, voc_colormap
from seg_train.data.prepare import PrepError

VOC_CLASSES = (
    "background aeroplane bicycle bird boat bottle bus car cat chair cow diningtable dog horse "
    "motorbike person pottedplant sheep sofa train tvmonitor"
).split()
VOC_SPLITS = ("train", "val", "trainval")


def read_ids(path: Path) -> list[str]:
    """Read a split file: one image id per non-empty line."""
    if not path.is_file():
        raise PrepError("missing split file", path, "a text file with one image id per line")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def place(src: Path, dst: Path, mode: str) -> None:
    """Put a copy of ``src`` at ``dst``: copied, hard-linked (falling back to a copy) or symlinked."""
    if dst.exists() and os.path.samefile(src, dst):
        return  # already in place (re-run, or output inside the input): unlinking would lose it
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    if mode == "hardlink":
        try:
            os.link(src, dst)
            return
        except OSError:  # other file system, or links not supported: copy instead
            pass
    if mode == "symlink":
        os.symlink(src.resolve(), dst)
        return
    shutil.copy2(src, dst)


def check_voc(voc: Path) -> dict[str, list[str]]:
    """Check the VOC2012 folder layout and return its segmentation splits."""
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        if not (voc / sub).is_dir():
            raise PrepError(
                f"missing {sub} folder", voc, "the VOCdevkit/VOC2012 folder of the VOC2012 trainval release"
            )
    splits = {}
    for name in VOC_SPLITS:
        path = voc / "ImageSets" / "Segmentation" / f"{name}.txt"
        if name == "trainval" and not path.exists():
            continue
        splits[name] = read_ids(path)
    return splits


def check_voc_label(path: Path) -> None:
    """Make sure a VOC label exists and is an index image (not a colour rendering)."""
    if not path.is_file():
        raise PrepError("missing label", path, "a SegmentationClass PNG for every id in the split files")
    with Image.open(path) as img:
        if img.mode not in ("P", "L"):
            raise PrepError(
                f"{img.mode} label image", path, "a palette ('P') or single-channel ('L') PNG of class indices"
            )


def load_sbd_mask(path: Path, loadmat) -> np.ndarray:
    """Read GTcls.Segmentation (uint8 class indices) from an SBD cls/<id>.mat file."""
    if not path.is_file():
        raise PrepError("missing SBD mask", path, "a cls/<id>.mat file for every id in SBD's train.txt and val.txt")
    try:
        mat = loadmat(str(path), squeeze_me=True, struct_as_record=False)
        mask = np.asarray(mat["GTcls"].Segmentation)
    except Exception as exc:  # scipy raises many types for corrupt files
        raise PrepError(f"unreadable SBD mask: {exc}", path, "a MATLAB file with a GTcls.Segmentation array") from None
    if mask.ndim != 2 or (mask.size and (mask.min() < 0 or mask.max() >= len(VOC_CLASSES))):
        raise PrepError("bad SBD mask", path, f"a 2-D array of class indices 0..{len(VOC_CLASSES) - 1}")
    return mask.astype(np.uint8)


def import_loadmat(sbd: Path):
    """Return scipy.io.loadmat, or fail with a hint to install scipy."""
    try:
        from scipy.io import loadmat
    except ImportError:
        raise PrepError(
            "scipy is not installed", f"--sbd {sbd}", "pip install scipy to read the SBD .mat masks"
        ) from None
    return loadmat


def check_sbd(sbd: Path) -> set[str]:
    """Check the SBD folder layout and return the ids of its train and val splits."""
    if not (sbd / "cls").is_dir():
        raise PrepError(
            "missing cls folder", sbd, "the benchmark_RELEASE/dataset folder of SBD (cls/*.mat, train.txt, val.txt)"
        )
    return set(read_ids(sbd / "train.txt")) | set(read_ids(sbd / "val.txt"))


def prepare_sbd(voc: Path, sbd: Path, out: Path, train_aug: list[str], mode: str, loadmat) -> None:
    """Write labels (SegmentationClassAug/ and SegmentationClass/) and images of the train_aug ids."""
    aug_dir = out / "SegmentationClassAug"
    aug_dir.mkdir(parents=True, exist_ok=True)
    palette = voc_colormap()
    for image_id in train_aug:
        name = f"{image_id}.png"
        voc_label = voc / "SegmentationClass" / name
        if voc_label.is_file():
            # VOC's finer annotation (with its 255 border) takes precedence over SBD's.
            place(voc_label, aug_dir / name, mode)
            if not (out / "SegmentationClass" / name).exists():
                place(voc_label, out / "SegmentationClass" / name, mode)
        else:
            mask = load_sbd_mask(sbd / "cls" / f"{image_id}.mat", loadmat)
            save_index_png(aug_dir / name, mask, palette)
            place(aug_dir / name, out / "SegmentationClass" / name, mode)
        dst_image = out / "JPEGImages" / f"{image_id}.jpg"
        if not dst_image.exists():
            src = voc / "JPEGImages" / f"{image_id}.jpg"
            if not src.is_file():  # SBD ships its own copies of the images
                src = sbd / "img" / f"{image_id}.jpg"
            if not src.is_file():
                raise PrepError(
                    "missing image",
                    voc / "JPEGImages" / f"{image_id}.jpg",
                    "a JPEG for every train_aug id (in VOC JPEGImages/ or SBD img/)",
                )
            place(src, dst_image, mode)


def prepare(voc: Path, out: Path, sbd: Path | None, mode: str) -> dict[str, int]:
    """Write the VOC (and SBD) data set to ``out``; return the number of ids per split."""
    splits = check_voc(voc)
    ids = sorted({i for s in splits.values() for i in s})
    for image_id in ids:
        if not (voc / "JPEGImages" / f"{image_id}.jpg").is_file():
            raise PrepError(
                "missing image", voc / "JPEGImages" / f"{image_id}.jpg", "a JPEG for every id in the split files"
            )
        check_voc_label(voc / "SegmentationClass" / f"{image_id}.png")
    if sbd is not None:
        # Check SBD before spending time copying VOC.
        loadmat = import_loadmat(sbd)
        sbd_ids = check_sbd(sbd)
        # The standard recipe: everything annotated except VOC val, the evaluation set.
        splits["train_aug"] = sorted((sbd_ids | set(splits["train"])) - set(splits["val"]))

    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for image_id in ids:
        place(voc / "JPEGImages" / f"{image_id}.jpg", out / "JPEGImages" / f"{image_id}.jpg", mode)
        place(voc / "SegmentationClass" / f"{image_id}.png", out / "SegmentationClass" / f"{image_id}.png", mode)
    if sbd is not None:
        prepare_sbd(voc, sbd, out, splits["train_aug"], mode, loadmat)
    for name, split_ids in splits.items():
        (out / "ImageSets" / "Segmentation" / f"{name}.txt").write_text("".join(f"{i}\n" for i in split_ids))
    (out / "classes.txt").write_text("".join(f"{n}\n" for n in VOC_CLASSES))
    return {name: len(split_ids) for name, split_ids in splits.items()}
