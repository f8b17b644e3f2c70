"""seg-predict: class-index PNGs and colour overlays for whole images.

Each image is predicted at its own size with the inference modes of eval.* (modes.py): in the
default mode in one pass (padded to a multiple of 32), so the largest image is bounded by the memory
of one device, not by the training crop; with eval.mode: slide by the window's memory.

For each input image `<name>.<ext>` it writes, at the image's original size:
- `<name>.png`: a palette ('P') PNG whose pixel values are the predicted class indices (VOC colours,
  so viewers show colours and `np.array(Image.open(p))` gives the classes);
- `<name>_overlay.jpg`: the prediction's colours blended over the photo.
With --label-ids it writes instead, for each input, one single-channel 8-bit PNG of the data set's own
raw label values (labels.raw_ids: Cityscapes' labelIds, ADE20K's 1..150, VOC's indices, the inverse of
data.label_map / reduce_zero_label / binary_threshold), named as the benchmarks' tools look for them
(`label_ids_name`), and nothing else: the folder is what an official evaluator or a submission reads.
The model runs through serving.serving_module: the same graph and preprocessing as the exported
SavedModel (and as evaluation), so the three agree.

Outputs are named by the input's file name without its extension, so two inputs with the same name
(a/x.jpg and b/x.jpg, or x.jpg and x.png) would overwrite each other: that is refused before anything
runs (by the names of the files the run writes). Folders are read one level deep (no recursion), in sorted order.

This module imports TensorFlow only inside `run_predict`: the command line checks the inputs before
TensorFlow's slow start.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from seg_train.util.progress import progress_bar
from seg_train.config import Config, ConfigError
from seg_train.data.label_images import save_index_png, voc_colormap
from seg_train.train.rundir import write_atomic

log = logging.getLogger("seg_train")

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
OVERLAY_ALPHA = 0.5


def _check_image(path: Path) -> None:
    """Raises ConfigError unless Pillow can identify `path` as an image (reads the header only)."""
    try:
        with Image.open(path):
            pass
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ConfigError("unreadable image", str(path), f"expected a JPEG/PNG image ({e})") from None


# Cityscapes' image names end in _leftImg8bit; its evaluator (cityscapesscripts'
# evalPixelLevelSemanticLabeling.getPrediction) matches a prediction to a ground truth by
# `<city>_<seq>_<frame>*.png` anywhere under the results folder, and stops at a second match.
CITYSCAPES_IMAGE_SUFFIX = "_leftImg8bit"


def label_ids_name(image: Path) -> str:
    """The --label-ids PNG's name: `<city>_<seq>_<frame>_labelIds.png` for a Cityscapes image
    (`..._leftImg8bit.png`), else `<name>.png` (ADE20K's and VOC's devkits look for the image's name
    with .png)."""
    stem = image.stem
    if stem.endswith(CITYSCAPES_IMAGE_SUFFIX):
        return stem[:-len(CITYSCAPES_IMAGE_SUFFIX)] + "_labelIds.png"
    return f"{stem}.png"


def _palette_name(image: Path) -> str:
    return f"{image.stem}.png"


def collect_inputs(paths, label_ids: bool = False) -> list[Path]:
    """Image files from files and folders (folders: images one level deep, sorted), checked.

    `label_ids`: the names checked for collisions are --label-ids' (label_ids_name).

    Raises:
      ConfigError: a path that does not exist, a folder without images, an unreadable image, or
        two inputs that would write the same output names.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise ConfigError("no images in folder", str(p),
                                  f"expected image files ({', '.join(IMAGE_SUFFIXES)}); folders are not searched "
                                  "recursively")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError("input not found", str(p), "expected an image file or a folder of images")
    name_of = label_ids_name if label_ids else _palette_name
    unique, seen, by_name = [], set(), {}
    for f in files:
        key = f.resolve()
        if key in seen:  # the same file given twice (e.g. a file and its folder): predict it once
            continue
        seen.add(key)
        _check_image(f)
        other = by_name.setdefault(name_of(f), f)
        if other is not f:
            raise ConfigError("output name collision", f"{other} and {f}",
                              f"expected inputs with distinct names: both would write {name_of(f)}; "
                              "rename one or predict them into separate --output folders")
        unique.append(f)
    return unique


def check_output_dir(path: str | os.PathLike) -> Path:
    """The predictions folder: anything but an existing file (created if missing)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError("output is a file", str(out), "expected a folder for the predictions (created if missing)")
    from seg_train.util.preflight import check_creatable_dir
    check_creatable_dir(out, "output folder", "choose another --output")
    return out


def overlay(image: np.ndarray, classes: np.ndarray, palette: np.ndarray, alpha: float = OVERLAY_ALPHA) -> np.ndarray:
    """uint8 [H, W, 3]: the class colours blended over `image` with weight `alpha`."""
    colours = np.asarray(palette, np.float32)[classes]
    return np.round((1 - alpha) * image.astype(np.float32) + alpha * colours).astype(np.uint8)


def run_predict(cfg: Config, strategy, checkpoint: str, inputs, output: str | os.PathLike,
                progress: bool = True, label_ids: bool = False) -> list[Path]:
    """seg-predict: segments every input image with CKPT_OR_RUN_DIR and writes PNGs and overlays (with
    `label_ids`, the raw-label-value PNGs instead).

    Returns:
      The class-index (or raw-label-value) PNGs written (one per input image, in input order).
    """
    import tensorflow as tf

    from seg_train.infer.load import load_evaluator

    files = collect_inputs(inputs, label_ids)
    out = check_output_dir(output)
    raw = raw_ids_of(cfg, label_ids)
    evaluator, prefix, step = load_evaluator(cfg, strategy, checkpoint)
    # As in seg-eval and seg-export, so predictions match the exported model and the eval numbers.
    evaluator.maybe_reestimate_bn(cfg, progress)
    module = evaluator.serving_module(cfg.data.mean, cfg.data.std)
    written = write_predictions(files, out, lambda image: module.serve(tf.constant(image))["classes"].numpy(),
                                progress, raw)
    print(f"wrote {written_summary(cfg, len(written), raw)} to {out} (step {step}, {prefix})")
    return written


def raw_ids_of(cfg: Config, label_ids: bool) -> np.ndarray | None:
    """--label-ids: train id -> raw label value (labels.raw_ids); None without it."""
    if not label_ids:
        return None
    from seg_train.data.labels import raw_ids
    return raw_ids(cfg.data)


def written_summary(cfg: Config, n: int, raw: np.ndarray | None) -> str:
    """What the run wrote, for its last line."""
    if raw is None:
        return f"{n} class-index PNG(s) and {n} overlay(s)"
    return f"{n} PNG(s) of the {cfg.data.layout} layout's raw label values (--label-ids)"


def _save_gray_png(path: Path, values: np.ndarray) -> None:
    Image.fromarray(np.ascontiguousarray(values, np.uint8)).save(path, format="PNG")  # 2-D uint8: mode L


def write_predictions(files, out: Path, classes_of, progress: bool = True,
                      raw_ids: np.ndarray | None = None) -> list[Path]:
    """For each image file: `classes_of(uint8 [h, w, 3])` -> class map [h, w], written as <stem>.png and
    <stem>_overlay.jpg in `out`; with `raw_ids` (train id -> raw label value) only `raw_ids[classes]` as a
    single-channel PNG named label_ids_name. Returns the PNG paths in input order.

    Raises:
      ConfigError: with `raw_ids`, a predicted class that has no raw value (a .tflite file with more
        classes than data.num_classes).
    """
    palette = voc_colormap()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with progress_bar(len(files), "predict", enabled=progress) as bar:
        for f in files:
            with Image.open(f) as im:
                image = np.asarray(im.convert("RGB"))
            classes = classes_of(image)
            if raw_ids is not None:
                if classes.size and int(classes.max()) >= len(raw_ids):
                    raise ConfigError("model predicts a class the config does not have", str(f),
                                      f"classes 0..{len(raw_ids) - 1} (data.num_classes: {len(raw_ids)}) to write "
                                      f"as raw label values, got {int(classes.max())}")
                mask_path = out / label_ids_name(f)
                write_atomic(mask_path, functools.partial(_save_gray_png, values=raw_ids[classes]))
            else:
                mask_path = out / _palette_name(f)
                write_atomic(mask_path, functools.partial(save_index_png, label=classes, palette=palette))
                blended = Image.fromarray(overlay(image, classes, palette))
                write_atomic(out / f"{f.stem}_overlay.jpg",
                             functools.partial(blended.save, format="JPEG", quality=90))
            written.append(mask_path)
            bar.update(1)
    return written
